"""The EDM half of the ood family: edm_score on every backend against its definition, the op
contract, EDMScorer (preconditioning, loss, training, scoring, persistence) and evaluate()
against scikit-learn."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import torch_kernels
from torch_kernels import backends
from torch_kernels.ood import EDMScorer, MahalanobisScorer, OODScorer, evaluate, ood_metrics, roc_curve
from torch_kernels.ops import ood as ood_ops
from torch_kernels.reference import ood as reference

from harness import (
    FLOAT32_BYTES, assert_close, backend_params, compiled_fullgraph, counted_flops, only_row, profiled, profiled_names,
    require_backend, run_opcheck,
)

OP = "edm_score"
STATISTICS = ("denoise", "scoped")
# (B, D, H, K, L): one row, one feature, no residual block, odd widths, a block of rows and a part
SHAPES = [(1, 1, 1, 0, 1), (7, 5, 6, 2, 3), (20, 40, 33, 1, 2), (37, 17, 70, 2, 2)]


def edm_inputs(seed, dtype=torch.float32, shape=(9, 13, 20, 2, 3)):
    """(x, params in EDM_TENSORS order, sigmas, sigma_data): a random denoiser of moderate gain."""
    b, d, h, k, levels = shape
    gen = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0):
        return torch.randn(*size, generator=gen, dtype=torch.float64) * scale

    x = randn(b, d) * 2 + 0.5
    params = [randn(d) * 2, randn(d).abs() * 0.5 + 0.25, randn(levels, d), randn(levels).abs() + 0.1,
              randn(levels, h), randn(d, h, scale=d**-0.5), randn(k, h, h, scale=h**-0.5), randn(k, h, scale=0.1),
              randn(k, h, h, scale=h**-0.5), randn(k, h, scale=0.1), randn(h, d, scale=h**-0.5), randn(d, scale=0.1)]
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    sigmas = [0.2 * 3**i for i in range(levels)]
    return x.to(dtype), [p.to(param_dtype) for p in params], sigmas, 0.8


def _score(x, params, sigmas, sigma_data, statistic, backend=None):
    return torch_kernels.edm_score(x, *params, sigmas, sigma_data, statistic, implementation=backend)


def _naive(x, params, sigmas, sigma_data, statistic):
    return reference.edm_score_naive(x.double(), *(p.double() for p in params), sigmas, sigma_data, statistic)


# ---- the definition and the reference kernel ----

def test_preconditioning_and_loss_weight_match_edm():
    sigma = torch.tensor([0.002, 0.1, 0.5, 1.0, 3.0, 80.0], dtype=torch.float64)
    sd = 0.7
    c_skip, c_out, c_in, c_noise = reference.edm_preconditioning(sigma, sd)
    for s, skip, out, inp, noise, weight in zip(sigma.tolist(), c_skip, c_out, c_in, c_noise,
                                                reference.edm_loss_weight(sigma, sd)):
        assert skip.item() == pytest.approx(sd**2 / (s**2 + sd**2), rel=1e-14)
        assert out.item() == pytest.approx(s * sd / math.sqrt(s**2 + sd**2), rel=1e-14)
        assert inp.item() == pytest.approx(1 / math.sqrt(s**2 + sd**2), rel=1e-14)
        assert noise.item() == pytest.approx(math.log(s) / 4, rel=1e-14)
        assert weight.item() == pytest.approx((s**2 + sd**2) / (s * sd) ** 2, rel=1e-14)
    # EDM's design: F's input and its effective target have unit variance at every level
    torch.testing.assert_close(c_in**2 * (sigma**2 + sd**2), torch.ones_like(sigma))
    torch.testing.assert_close(reference.edm_loss_weight(sigma, sd) * c_out**2, torch.ones_like(sigma))


def _numpy_denoiser(scorer: EDMScorer, y: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """EDM's D(y; sigma) from the scorer's weights, written again in float64 numpy."""
    p = {name: getattr(scorer, name).detach().double().numpy() for name in (
        "w_in", "b_in", "embedding", "w1", "b1", "w2", "b2", "w_out", "b_out", "frequencies_")}
    sd = float(scorer.sigma_data_)
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    angles = 2 * np.pi * (np.log(sigma) / 4)[:, None] * p["frequencies_"]
    h = (y / np.sqrt(sigma**2 + sd**2)[:, None]) @ p["w_in"] + p["b_in"] + np.concatenate(
        [np.cos(angles), np.sin(angles)], axis=1) @ p["embedding"]
    for k in range(p["w1"].shape[0]):
        h = h + silu(silu(h) @ p["w1"][k] + p["b1"][k]) @ p["w2"][k] + p["b2"][k]
    f = silu(h) @ p["w_out"] + p["b_out"]
    c_skip = sd**2 / (sigma**2 + sd**2)
    c_out = sigma * sd / np.sqrt(sigma**2 + sd**2)
    return c_skip[:, None] * y + c_out[:, None] * f


@pytest.fixture(scope="module")
def small_scorer():
    gen = torch.Generator().manual_seed(3)
    data = torch.randn(300, 6, generator=gen) @ torch.randn(6, 6, generator=gen) + 3.0
    return EDMScorer(width=24, depth=2, levels=3, probes=2).fit(data, steps=60, batch_size=64, progress=False), data


def test_denoiser_and_loss_match_the_formulas(small_scorer):
    scorer, data = small_scorer
    gen = torch.Generator().manual_seed(4)
    y = (data[:50] - scorer.mean_) * scorer.inv_scale_
    sigma = (torch.randn(50, generator=gen) * 1.2 - 1.2).exp()
    noise = torch.randn(50, 6, generator=gen)
    want = _numpy_denoiser(scorer, (y + sigma[:, None] * noise).double().numpy(), sigma.double().numpy())
    got = scorer.denoise(y + sigma[:, None] * noise, sigma)
    np.testing.assert_allclose(got.detach().double().numpy(), want, rtol=1e-4, atol=1e-5)
    sd = float(scorer.sigma_data_)
    weight = (sigma.double().numpy() ** 2 + sd**2) / (sigma.double().numpy() * sd) ** 2
    want_loss = np.mean(weight[:, None] * (want - y.double().numpy()) ** 2)
    assert scorer.loss(y, sigma, noise).item() == pytest.approx(want_loss, rel=1e-4)


def test_training_draws_noise_levels_as_edm(monkeypatch):
    """ln(sigma) of the training batches ~ N(-1.2, 1.2^2): 40 steps of 256 rows, within 4 standard errors."""
    drawn = []
    original = EDMScorer.loss

    def recording(self, y, sigma, noise):
        drawn.append(sigma.detach().log())
        assert noise.shape == y.shape
        return original(self, y, sigma, noise)

    monkeypatch.setattr(EDMScorer, "loss", recording)
    EDMScorer(width=8, depth=0, levels=1).fit(torch.randn(512, 3), steps=40, batch_size=256, progress=False)
    log_sigma = torch.cat(drawn).double()
    n = log_sigma.numel()
    assert n == 40 * 256
    assert log_sigma.mean().item() == pytest.approx(-1.2, abs=4 * 1.2 / n**0.5)
    assert log_sigma.std().item() == pytest.approx(1.2, abs=4 * 1.2 / (2 * n) ** 0.5)


@pytest.mark.parametrize("statistic", STATISTICS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_kernel_matches_definition(shape, dtype, statistic):
    x, params, sigmas, sd = edm_inputs(1, dtype, shape)
    out = _score(x, params, sigmas, sd, statistic, "reference")
    assert out.dtype == reference.compute_dtype(dtype)
    assert_close(out, _naive(x, params, sigmas, sd, statistic).to(out.dtype), dtype)


def test_scoped_is_score_norm_plus_hutchinson_divergence():
    """The "scoped" level term against the score function and its full Jacobian (torch.func.jacfwd)."""
    x, params, sigmas, sd = edm_inputs(2, torch.float64, (4, 5, 7, 2, 2))
    mean, inv_scale, noise, level_weights, level_bias, *weights = params
    y = (x - mean) * inv_scale
    want = torch.zeros(4, dtype=torch.float64)
    for sigma, n, weight, bias in zip(sigmas, noise, level_weights, level_bias):
        c_skip, c_out, c_in, _ = reference.edm_preconditioning(torch.tensor(sigma, dtype=torch.float64), sd)

        def score_function(v):  # s(v) = (D(v) - v) / sigma^2 for one row
            return (c_skip * v + c_out * reference.edm_mlp(c_in * v[None], bias, *weights)[0] - v) / sigma**2

        for row in range(4):
            s = score_function(y[row])
            jacobian = torch.func.jacfwd(score_function)(y[row])
            want[row] += weight * sigma**2 * (s @ s + n @ jacobian @ n)
    assert_close(_score(x, params, sigmas, sd, "scoped", "reference"), want, torch.float64)


# ---- every backend against the definition ----

# float32 at every shape; half precision x (converted to float32 as it is read) at one
BACKEND_CASES = [(shape, torch.float32) for shape in SHAPES] + [
    (SHAPES[1], torch.float16), (SHAPES[1], torch.bfloat16)]


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("backend", backend_params(OP, exclude=("reference",)))
@pytest.mark.parametrize("statistic", STATISTICS)
@pytest.mark.parametrize("shape, dtype", BACKEND_CASES, ids=str)
def test_backend_matches_definition(backend, dtype, statistic, shape):
    require_backend(backend)
    x, params, sigmas, sd = edm_inputs(5, dtype, shape)
    out = _score(x, params, sigmas, sd, statistic, backend)
    assert out.dtype == torch.float32
    assert backends.last_backend(OP) == backend
    _assert_float32_accurate(out, x, params, sigmas, sd, statistic, backend)


def _assert_float32_accurate(out, x, params, sigmas, sd, statistic, what):
    """Within float32's tolerance of the float64 definition, or (where the residual D(v) - y
    cancels, which no float32 computation escapes) no further from it than the float32 reference."""
    want = _naive(x, params, sigmas, sd, statistic)
    reference32 = _score(x.float(), [p.float() for p in params], sigmas, sd, statistic, "reference").double()
    error = (out.double() - want).abs()
    allowed = torch.maximum(4 * (reference32 - want).abs(), 1e-4 * want.abs().max())
    assert (error <= allowed).all(), f"{what}: errors {error.tolist()} over {allowed.tolist()}"


@pytest.mark.parametrize("backend", backend_params(OP))
def test_float64_runs_in_float64_or_passes_on(backend):
    require_backend(backend)
    x, params, sigmas, sd = edm_inputs(6, torch.float64, (6, 7, 9, 1, 2))
    want = _naive(x, params, sigmas, sd, "denoise")
    if backend in ("triton", "pallas"):
        with pytest.raises(RuntimeError, match=f"{backend}: float64"):
            _score(x, params, sigmas, sd, "denoise", backend)
        out = _score(x, params, sigmas, sd, "denoise", [backend, "reference"])
        assert backends.last_backend(OP) == "reference"
    else:
        out = _score(x, params, sigmas, sd, "denoise", backend)
    assert out.dtype == torch.float64
    assert_close(out, want, torch.float64)


@pytest.mark.parametrize("backend", backend_params(OP))
@pytest.mark.parametrize("statistic", STATISTICS)
def test_nan_row_scores_nan_and_leaves_the_others(backend, statistic):
    require_backend(backend)
    x, params, sigmas, sd = edm_inputs(7, torch.float32, (5, 6, 8, 1, 2))
    x[3, 2] = float("nan")
    out = _score(x, params, sigmas, sd, statistic, backend)
    assert torch.isnan(out[3])
    keep = torch.arange(5) != 3
    _assert_float32_accurate(out[keep], x[keep], params, sigmas, sd, statistic, backend)


@pytest.mark.parametrize("backend", backend_params(OP))
def test_strided_x_and_parameters_in_x_dtype(backend):
    require_backend(backend)
    x, params, sigmas, sd = edm_inputs(8, torch.float16, (6, 9, 10, 1, 2))
    strided = torch.stack([x, x], dim=2)[:, :, 0]  # x itself, with a column stride of 2
    half_params = [p.half() for p in params]
    out = _score(strided, half_params, sigmas, sd, "scoped", backend)
    _assert_float32_accurate(out, x, half_params, sigmas, sd, "scoped", backend)


@pytest.mark.parametrize("backend, why", [("pallas", "VMEM"), ("sycl", "local memory")])
def test_hidden_width_beyond_a_backend_passes_to_the_next(backend, why):
    require_backend(backend)
    x, params, sigmas, sd = edm_inputs(16, torch.float32, (2, 1, 20000, 0, 1))
    out = _score(x, params, sigmas, sd, "denoise", [backend, "reference"])
    assert backends.last_backend(OP) == "reference"
    torch.testing.assert_close(out, _score(x, params, sigmas, sd, "denoise", "reference"))
    with pytest.raises(RuntimeError, match=f"{backend}: .*{why}"):
        _score(x, params, sigmas, sd, "denoise", backend)


def test_empty_batch():
    x, params, sigmas, sd = edm_inputs(9)
    for statistic in STATISTICS:
        assert _score(x[:0], params, sigmas, sd, statistic).shape == (0,)


# ---- gradients ----

@pytest.mark.parametrize("statistic", STATISTICS)
def test_gradcheck_and_gradgradcheck_float64(statistic):
    x, params, sigmas, sd = edm_inputs(10, torch.float64, (4, 3, 5, 1, 2))
    args = [t.clone().requires_grad_() for t in (x, *params)]

    def fn(*a):
        return torch_kernels.edm_score(*a, sigmas, sd, statistic, implementation="reference")

    assert torch.autograd.gradcheck(fn, args)
    # second order in x and the first layer's weights (the rest held), to keep the check quick
    held = [a.detach() for a in args]

    def partial(xg, w_in):
        return fn(xg, *held[1:6], w_in, *held[7:])

    assert torch.autograd.gradgradcheck(partial, (args[0], args[6]))


def _grads(backend, x, params, sigmas, sd, statistic):
    args = [t.clone().requires_grad_() for t in (x, *params)]
    weights = torch.linspace(0.5, 1.5, x.shape[0], dtype=torch.float64).to(reference.compute_dtype(x.dtype))
    (torch_kernels.edm_score(*args, sigmas, sd, statistic, implementation=backend) * weights).sum().backward()
    return [a.grad for a in args]


@pytest.mark.parametrize("backend", backend_params(OP))
@pytest.mark.parametrize("statistic", STATISTICS)
def test_gradients_in_x_and_parameters_match_float64(backend, statistic):
    """The forward runs on ``backend``; every gradient (x and all the weights) against float64."""
    require_backend(backend)
    x, params, sigmas, sd = edm_inputs(11, torch.float32, (13, 7, 12, 2, 2))
    want = _grads("reference", x.double(), [p.double() for p in params], sigmas, sd, statistic)
    got = _grads(backend, x, params, sigmas, sd, statistic)
    for name, g, w in zip(("x", *ood_ops.EDM_TENSORS), got, want):
        assert g.dtype == torch.float32
        assert_close(g, w.float(), torch.float32, scale=10, what=f"grad {name}")


def test_backward_op_matches_autograd_through_the_definition():
    x, params, sigmas, sd = edm_inputs(12, torch.float64, (6, 4, 5, 2, 2))
    grad = torch.linspace(-1, 1, 6, dtype=torch.float64)
    for statistic in STATISTICS:
        got = torch.ops.torch_kernels.edm_score_backward(grad, x, *params, sigmas, sd, statistic)
        args = [t.clone().requires_grad_() for t in (x, *params)]
        out = reference.edm_score_naive(*args, sigmas, sd, statistic)
        want = torch.autograd.grad(out, args, grad)
        for name, g, w in zip(("x", *ood_ops.EDM_TENSORS), got, want):
            assert_close(g, w, torch.float64, what=f"{statistic} grad {name}")


# ---- the op contract ----

@pytest.mark.parametrize("backend", backend_params(OP))
def test_opcheck(backend):
    require_backend(backend)
    x, params, sigmas, sd = edm_inputs(13, torch.float32, (5, 4, 6, 1, 2))
    for statistic in STATISTICS:
        run_opcheck(torch.ops.torch_kernels.edm_score.default, (x, *params, sigmas, sd, statistic, backend))
    run_opcheck(torch.ops.torch_kernels.edm_score_backward.default,
                (torch.ones(5), x, *params, sigmas, sd, "scoped", backend))


def test_compile_fullgraph_forward_and_backward(small_scorer):
    scorer, data = small_scorer

    def loss(features):
        return torch.nn.functional.softplus(scorer(features) - 1.0).mean() + scorer(features, "scoped").mean()

    compiled = compiled_fullgraph(loss)
    x = data[:17].clone().requires_grad_()
    x_eager = data[:17].clone().requires_grad_()
    out, out_eager = compiled(x), loss(x_eager)
    torch.testing.assert_close(out, out_eager)
    out.backward()
    compiled_grads = [p.grad.clone() for p in scorer.parameters()]
    scorer.zero_grad()
    out_eager.backward()
    torch.testing.assert_close(x.grad, x_eager.grad)
    for got, param in zip(compiled_grads, scorer.parameters()):
        torch.testing.assert_close(got, param.grad)
    scorer.zero_grad()


@pytest.mark.parametrize("backend", backend_params(OP))
def test_profiler_names_op_and_backend(backend):
    require_backend(backend)
    x, params, sigmas, sd = edm_inputs(14, torch.float32, (3, 4, 5, 1, 1))
    names = profiled_names(lambda: _score(x, params, sigmas, sd, "denoise", backend))
    assert "torch_kernels::edm_score" in names
    assert f"torch_kernels::edm_score[{backend}]" in names


@pytest.mark.parametrize("statistic", STATISTICS)
def test_flop_counter_counts_the_op(statistic):
    b, d, h, k, levels = 64, 24, 32, 2, 3
    x, params, sigmas, sd = edm_inputs(15, torch.float32, (b, d, h, k, levels))
    flops = counted_flops(lambda: _score(x, params, sigmas, sd, statistic))
    per_level = 2 * d * h + k * 2 * (2 * h * h) + 2 * h * d
    assert flops == ood_ops.edm_score_flops(b, d, h, k, levels, statistic == "scoped") == (
        b * levels * per_level * (2 if statistic == "scoped" else 1))
    xg = x.clone().requires_grad_()
    backward = counted_flops(lambda: _score(xg, params, sigmas, sd, statistic).sum().backward())
    assert backward == 4 * flops  # the forward, then the backward op (3x the forward)
    assert ood_ops.edm_score_bytes(b, d, h, k, levels, 4, 4) == 4 * (
        b * d + 2 * d * h + 2 * k * h * h + 2 * k * h + levels * (d + h + 1) + 3 * d + b)


# ---- EDMScorer ----

def _mixture(gen, n):
    """Three round Gaussians (std 0.5) at the corners of a triangle of side about 6."""
    centers = torch.tensor([[-3.0, 0.0], [3.0, 0.0], [0.0, 4.5]])
    return centers[torch.randint(0, 3, (n,), generator=gen)] + 0.5 * torch.randn(n, 2, generator=gen)


@pytest.fixture(scope="module")
def mixture():
    """A scorer fitted on a 2-D mixture, in-mixture test points, and points off it (more than 1.5
    from every center: between the modes, where one Gaussian's density is high, and around them)."""
    gen = torch.Generator().manual_seed(20)
    train, inside = _mixture(gen, 3000), _mixture(gen, 400)
    grid = torch.rand(3000, 2, generator=gen) * torch.tensor([10.0, 9.0]) - torch.tensor([5.0, 2.5])
    centers = torch.tensor([[-3.0, 0.0], [3.0, 0.0], [0.0, 4.5]])
    outside = grid[torch.cdist(grid, centers).min(dim=1).values > 1.5][:400]
    scorer = EDMScorer(width=64, depth=2, levels=4, probes=2, sigma_min=0.2, sigma_max=1.5).fit(
        train, steps=400, batch_size=256, progress=False)
    return scorer, train, inside, outside


@pytest.mark.parametrize("statistic", STATISTICS)
def test_mixture_of_gaussians_separates_where_one_gaussian_cannot(mixture, statistic):
    scorer, train, inside, outside = mixture
    scorer.statistic = statistic
    try:
        edm = evaluate(scorer, inside, outside)
    finally:
        scorer.statistic = "denoise"
    gaussian = evaluate(MahalanobisScorer().fit(train), inside, outside)
    assert edm.auroc > 0.95, edm
    assert gaussian.auroc < 0.75, gaussian


def test_fit_is_deterministic_and_batches_equal_one_tensor():
    data = torch.randn(200, 3, generator=torch.Generator().manual_seed(21))
    kwargs = dict(steps=30, batch_size=32, progress=False)
    first = EDMScorer(width=16, depth=1, levels=2).fit(data, seed=5, **kwargs).state_dict()
    again = EDMScorer(width=16, depth=1, levels=2).fit(iter(data.split(64)), seed=5, **kwargs).state_dict()
    other = EDMScorer(width=16, depth=1, levels=2).fit(data, seed=6, **kwargs).state_dict()
    assert first.keys() == again.keys()
    for name in first:
        assert torch.equal(first[name], again[name]), name
    assert not torch.equal(first["w_in"], other["w_in"])
    assert not torch.equal(first["noise_"], other["noise_"])


def test_standardization_and_grid(small_scorer):
    scorer, data = small_scorer
    torch.testing.assert_close(scorer.mean_, data.mean(0))
    torch.testing.assert_close(scorer.inv_scale_, 1 / data.std(0, unbiased=False), rtol=1e-5, atol=0)
    assert float(scorer.sigma_data_) == pytest.approx(1.0, abs=1e-5)
    assert scorer.sigmas_.tolist() == pytest.approx(np.repeat(np.geomspace(0.8, 3.0, 3), 2).tolist(), rel=1e-6)
    assert scorer.noise_.shape == (6, 6)
    assert not torch.equal(scorer.noise_[0], scorer.noise_[1])  # each probe of a level draws its own noise


def test_a_constant_feature_is_centred_not_scaled_as_for_mahalanobis():
    """A feature constant in the fit data gets scale 1 (scikit-learn's StandardScaler's rule) in
    EDM's standardization and unit variance, uncorrelated, in Mahalanobis' covariance; ridge, when
    given, is still added to every feature's variance."""
    data = torch.randn(100, 3, generator=torch.Generator().manual_seed(22))
    data[:, 1] = 7.0
    scorer = EDMScorer(width=8, depth=0, levels=1).fit(data, steps=2, progress=False)
    assert scorer.inv_scale_[1].item() == 1.0 and scorer.mean_[1].item() == 7.0
    torch.testing.assert_close(scorer.inv_scale_[[0, 2]], 1 / data[:, [0, 2]].std(0, unbiased=False), rtol=1e-5, atol=0)
    covariance = MahalanobisScorer().fit(data).covariance_
    assert covariance[1].tolist() == [0.0, 1.0, 0.0] and covariance[:, 1].tolist() == [0.0, 1.0, 0.0]
    scorer = EDMScorer(width=8, depth=0, levels=1, ridge=0.25).fit(data, steps=2, progress=False)
    want = 1 / (data.double().var(0, unbiased=False) + 0.25).sqrt()
    torch.testing.assert_close(scorer.inv_scale_, want.float())
    assert scorer.inv_scale_[1].item() == 2.0
    torch.testing.assert_close(MahalanobisScorer(ridge=0.25).fit(data).covariance_.diagonal()[1],
                               torch.tensor(0.25, dtype=torch.float64))


def test_real_minilm_features_fit_by_default():
    """all-MiniLM-L6-v2 embeddings of CLINC150 queries (tests/data) have dead output dimensions:
    both scorers fit them with their defaults, those dimensions centred and not scaled, and score
    held-out rows finitely."""
    import pathlib

    features = torch.from_numpy(np.load(pathlib.Path(__file__).parent / "data" / "clinc150_minilm.npz")["features"])
    fit, held_out = features[:400], features[400:]
    variance = fit.double().var(0, unbiased=False)
    dead = variance <= 384 * torch.finfo(torch.float64).eps * variance.max()
    assert 1 <= int(dead.sum()) <= 8, "the embeddings no longer have the dead dimensions this test is about"
    edm = EDMScorer(width=16, depth=1, levels=2, probes=1).fit(fit, steps=5, progress=False)
    assert (edm.inv_scale_[dead] == 1.0).all() and torch.isfinite(edm.score(held_out)).all()
    mahalanobis = MahalanobisScorer().fit(fit)
    assert (mahalanobis.covariance_.diagonal()[dead] == 1.0).all()
    assert torch.isfinite(mahalanobis.score(held_out)).all()


def test_training_rows_score_in_range_over_seeds():
    """A constant feature (with ridge) or one that only takes two neighbouring float32 values (no ridge:
    its tiny variance standardizes to 1, and the fit standardizes with the float32 mean scoring uses)
    leaves the scores of the training rows where they are without it: before, the first was scaled by
    1 / (1e-3 x typical spread) and training rows were once seen scoring 1e4 to 1e6 (normally 1 to 30)."""
    for seed in range(10):
        gen = torch.Generator().manual_seed(100 + seed)
        scale, offset = torch.rand(4, generator=gen) + 0.2, 3 * torch.randn(4, generator=gen)
        data = torch.randn(96, 4, generator=gen) * scale + offset
        near = data.clone()
        data[:, 1] = 10 * torch.randn((), generator=gen)
        near[:, 2] = torch.where(torch.rand(96, generator=gen) < 0.5, 1000.0, torch.nextafter(torch.tensor(1000.0),
                                                                                               torch.tensor(2000.0)))
        for rows, ridge in ((data, 1e-3), (near, 0.0)):
            scorer = EDMScorer(width=16, depth=1, levels=2, probes=2, ridge=ridge).fit(
                rows, epochs=3, batch_size=32, seed=seed, progress=False)
            for statistic in STATISTICS:
                scores = scorer.score(rows, statistic)
                assert torch.isfinite(scores).all() and scores.abs().max() < 100, (seed, ridge, statistic, scores.max())


def test_state_dict_round_trip_and_repr(small_scorer):
    scorer, data = small_scorer
    restored = EDMScorer()
    restored.load_state_dict(scorer.state_dict())
    for statistic in STATISTICS:
        first = scorer.score(data[:40], statistic)
        assert torch.equal(scorer.score(data[:40], statistic), first)  # the grid's noise is fixed: no draw per call
        torch.testing.assert_close(restored.score(data[:40], statistic), first)
    assert (restored.width, restored.depth, restored.levels, restored.probes) == (24, 2, 3, 2)
    assert "features=6" in repr(restored) and "width=24" in repr(restored)


def test_score_is_the_op_on_the_scorer_weights(small_scorer):
    scorer, data = small_scorer
    level_bias = scorer.noise_embedding(scorer.sigmas_)
    sd = float(scorer.sigma_data_)
    lam = reference.edm_loss_weight(scorer.sigmas_.double(), sd) / (6 * 6)
    for statistic, weights in (("denoise", lam), ("scoped", torch.full((6,), 1 / 36, dtype=torch.float64))):
        params = [scorer.mean_, scorer.inv_scale_, scorer.noise_, weights, level_bias, scorer.w_in, scorer.w1,
                  scorer.b1, scorer.w2, scorer.b2, scorer.w_out, scorer.b_out]
        want = _naive(data[:30], [p.detach() for p in params], scorer.sigmas_.tolist(), sd, statistic)
        assert_close(scorer.score(data[:30], statistic).detach(), want.float(), torch.float32, scale=5)
    # the denoising score is the EDM loss at the grid's levels with the stored noise: about 1 after training
    assert 0.05 < scorer.score(data).mean().item() < 2.0


def test_threshold_and_protocol(small_scorer):
    scorer, data = small_scorer
    assert isinstance(scorer, OODScorer) and isinstance(MahalanobisScorer(), OODScorer)
    scores = scorer.score(data).detach().double()
    for tpr in (0.5, 0.95, 1.0):
        assert scorer.threshold(data, tpr) == pytest.approx(torch.quantile(scores, tpr).item(), rel=1e-9)


def test_load_checks_the_configuration_given_to_the_constructor(small_scorer):
    """A width (depth, levels, probes, sigma_min, sigma_max) given to the constructor is checked against
    the state dict, as torch checks shapes; one not given follows it. Before, EDMScorer(width=32) took a
    width-24 state dict, reported all keys matched and changed its width to 24."""
    scorer, data = small_scorer
    saved = scorer.state_dict()
    for name, value in (("width", 32), ("depth", 1), ("levels", 4), ("probes", 1), ("sigma_min", 0.5),
                        ("sigma_max", 2.0)):
        other = EDMScorer(**{name: value})
        for strict in (True, False):
            with pytest.raises(RuntimeError, match=rf"{name}: this EDMScorer was made with {name}={value} but the "
                                                   rf"state dict holds a scorer of {name}="):
                other.load_state_dict(saved, strict=strict)
        assert not other.fitted and getattr(other, name) == value  # nothing changed
    fitted = EDMScorer(width=8, depth=1, levels=3, probes=2).fit(data, steps=2, progress=False)
    before = {name: t.clone() for name, t in fitted.state_dict().items()}
    with pytest.raises(RuntimeError, match="width: this EDMScorer was made with width=8"):
        fitted.load_state_dict(saved)
    assert all(torch.equal(before[name], t) for name, t in fitted.state_dict().items())
    # every argument given and agreeing: loads, and the floats given stay exact
    same = EDMScorer(width=24, depth=2, levels=3, probes=2, sigma_min=0.8, sigma_max=3.0)
    same.load_state_dict(saved)
    assert (same.width, same.sigma_min, same.sigma_max) == (24, 0.8, 3.0)
    torch.testing.assert_close(same.score(data[:20]), scorer.score(data[:20]))
    # a grid of one repeated level is any split of its size
    flat = EDMScorer(width=4, depth=0, levels=2, probes=3, sigma_min=1.0, sigma_max=1.0).fit(data, steps=2,
                                                                                           progress=False)
    again = EDMScorer(width=4, levels=2, probes=3, sigma_min=1.0, sigma_max=1.0)
    again.load_state_dict(flat.state_dict())
    assert (again.levels, again.probes) == (2, 3)
    restored = EDMScorer()
    restored.load_state_dict(flat.state_dict())
    assert restored.levels * restored.probes == 6 and restored.depth == 0


def _fitted(kind, data):
    if kind == "mahalanobis":
        return MahalanobisScorer("ledoit_wolf").fit(data)
    return EDMScorer(width=16, depth=1, levels=2, probes=2).fit(data, steps=20, batch_size=64, progress=False)


@pytest.mark.parametrize("kind", ["mahalanobis", "edm"])
def test_score_protocol_is_the_same_for_both_scorers(kind):
    """score gives plain scores (no graph unless x requires grad, and then to x only); forward is
    differentiable in x and in the scorer's parameters. Before, EDMScorer.score was forward, so its
    scores required grad through the weights and .numpy() failed on them."""
    from torch_kernels.ood import OODGate

    data = torch.randn(200, 5, generator=torch.Generator().manual_seed(40)) + 1.0
    scorer, x = _fitted(kind, data), data[:16]
    scores = scorer.score(x)
    assert isinstance(scorer, OODScorer) and not scores.requires_grad and scores.grad_fn is None
    assert scores.dtype == torch.float32 and scores.numpy().shape == (16,)
    assert_close(scorer.score(x.double()).float(), scores, torch.float32)
    assert scorer.score(x.double()).dtype == torch.float64
    torch.testing.assert_close(scorer(x).detach(), scores)
    # x requiring grad: differentiable in x, the same gradient as forward's; nothing reaches the parameters
    x_grad, x_forward = x.clone().requires_grad_(), x.clone().requires_grad_()
    scorer.score(x_grad).sum().backward()
    scorer(x_forward).sum().backward()
    torch.testing.assert_close(x_grad.grad, x_forward.grad)
    params = list(scorer.parameters())
    assert (kind == "edm") == bool(params) and all(p.grad is not None for p in params)  # from forward only
    for p in params:
        p.grad = None
    scorer.score(x.clone().requires_grad_()).sum().backward()
    assert all(p.grad is None for p in params)
    with torch.no_grad():
        assert not scorer.score(x.clone().requires_grad_()).requires_grad
    # what is built on score: threshold, evaluate, the serving gate
    limit = scorer.threshold(data[100:], 0.9)
    assert isinstance(limit, float)
    assert evaluate(scorer, data[100:], data[:50] * 4 + 20).auroc == 1.0
    gate = OODGate(scorer, limit)
    assert gate.score(x) == pytest.approx(scores.tolist())


def test_dtype_conversion_keeps_the_fit(small_scorer):
    scorer, data = small_scorer
    model = torch.nn.Sequential(torch.nn.Identity(), EDMScorer())
    model[1].load_state_dict(scorer.state_dict())
    model.half()
    assert model[1].w_in.dtype == model[1].noise_.dtype == torch.float32
    torch.testing.assert_close(model[1](data[:20]), scorer(data[:20]))
    assert_close(model[1](data[:20].half()).detach(), scorer(data[:20]).detach(), torch.float16)


def test_progress_bar_shows_the_loss(capsys):
    pytest.importorskip("tqdm")
    EDMScorer(width=8, depth=1, levels=1).fit(torch.randn(64, 2), steps=5, batch_size=16, progress=True)
    err = capsys.readouterr().err
    assert "EDM fit" in err and "loss=" in err
    EDMScorer(width=8, depth=1, levels=1).fit(torch.randn(64, 2), steps=5, batch_size=16, progress=False)
    assert "EDM fit" not in capsys.readouterr().err


def test_epochs_set_the_steps(monkeypatch):
    steps = []
    monkeypatch.setattr(EDMScorer, "_train", lambda self, y, n, *args: steps.append(n))
    EDMScorer(width=4).fit(torch.randn(100, 2), epochs=2.5, batch_size=32, progress=False)
    EDMScorer(width=4).fit(torch.randn(100, 2), batch_size=32, progress=False)
    assert steps == [math.ceil(2.5 * 100 / 32), EDMScorer.DEFAULT_STEPS]


# ---- evaluate against scikit-learn ----

sklearn_metrics = pytest.importorskip("sklearn.metrics")


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("sizes", [(500, 120), (7, 3), (1, 1)], ids=str)
def test_metrics_equal_sklearn(sizes, ties):
    gen = torch.Generator().manual_seed(sum(sizes) + ties)
    n_id, n_ood = sizes
    id_scores = torch.randn(n_id, generator=gen, dtype=torch.float64)
    ood_scores = torch.randn(n_ood, generator=gen, dtype=torch.float64) + 1.0
    if ties:  # few distinct values, shared between the two sets
        id_scores, ood_scores = (id_scores * 2).round(), (ood_scores * 2).round()
    got = ood_metrics(id_scores, ood_scores)
    labels = np.r_[np.zeros(n_id), np.ones(n_ood)]
    scores = torch.cat([id_scores, ood_scores]).numpy()
    assert got.auroc == pytest.approx(sklearn_metrics.roc_auc_score(labels, scores), abs=1e-12)
    assert got.aupr == pytest.approx(sklearn_metrics.average_precision_score(labels, scores), abs=1e-12)
    assert got.aupr_in == pytest.approx(sklearn_metrics.average_precision_score(1 - labels, -scores), abs=1e-12)
    fpr, tpr, _ = sklearn_metrics.roc_curve(1 - labels, -scores, drop_intermediate=False)
    assert got.fpr95 == pytest.approx(fpr[np.searchsorted(tpr, 0.95, side="left")], abs=1e-12)
    ours = roc_curve(id_scores, ood_scores)
    theirs = sklearn_metrics.roc_curve(labels, scores, drop_intermediate=False)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-12)


def test_evaluate_takes_either_scorer(small_scorer):
    scorer, data = small_scorer
    far = data[:50] + 25.0
    for each in (scorer, MahalanobisScorer().fit(data)):
        metrics = evaluate(each, data[50:150], far)
        with torch.no_grad():
            assert metrics == ood_metrics(each.score(data[50:150]), each.score(far))
        assert metrics.auroc == 1.0 and metrics.fpr95 == 0.0


# ---- the byte formula, against counts made here ----

def test_edm_bytes_match_the_analytic_count():
    b, d, h, k, levels = 9, 6, 8, 2, 3
    gen = torch.Generator().manual_seed(4)
    shapes = [(d,), (d,), (levels, d), (levels,), (levels, h), (d, h), (k, h, h), (k, h), (k, h, h), (k, h),
              (h, d), (d,)]
    params = [torch.rand(*s, generator=gen) * 0.3 + 0.1 for s in shapes]
    x = torch.randn(b, d, generator=gen)
    sigmas = [0.2, 0.6, 1.8]
    prof, _ = profiled(lambda: torch_kernels.edm_score(x, *params, sigmas, 0.8, "scoped"))
    row = only_row(prof, "edm_score")
    assert row["bytes"] == ood_ops.edm_score_bytes(b, d, h, k, levels, FLOAT32_BYTES, FLOAT32_BYTES)
    assert row["flops"] == ood_ops.edm_score_flops(b, d, h, k, levels, True)

"""The ood family: mahalanobis_score on every backend, and MahalanobisScorer against scikit-learn."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_kernels
from torch_kernels import backends
from torch_kernels.ood import MahalanobisScorer
from torch_kernels.ops import ood as ood_ops
from torch_kernels.reference import ood as reference
from torch_kernels.ops.ood import mahalanobis_inputs

from harness import (
    FLOAT32_BYTES, assert_close, backend_params, compiled_fullgraph, counted_flops, nbytes, only_row, profiled,
    profiled_names, random_tensor, require_backend, run_isolated, run_opcheck,
)

OP = "mahalanobis_score"
SHAPES = [  # (B, D, C): odd sizes, one row, one feature, thousands of rows, many classes
    (1, 1, 1), (5, 3, 1), (33, 127, 4), (3001, 3, 2), (257, 385, 1), (64, 20, 150),
]
BIG = (1200, 193, 3)  # many row blocks and whitening tiles, each with a tail; small enough to interpret


def _inputs(seed, dtype, shape, device="cpu"):
    b, d, c = shape
    return mahalanobis_inputs(torch.Generator().manual_seed(seed), dtype, device, b=b, d=d, c=c)


@pytest.mark.parametrize("shape", SHAPES + [BIG], ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reference_kernel_matches_definition(shape, dtype):
    x, means, whitener = _inputs(1, dtype, shape)
    expected = reference.mahalanobis_score_naive(x, means, whitener)
    assert_close(torch_kernels.mahalanobis_score(x, means, whitener, implementation="reference"), expected, dtype)


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("backend", backend_params(OP, exclude=("reference",)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backend_matches_reference(backend, dtype, shape):
    require_backend(backend)
    x, means, whitener = _inputs(2, dtype, shape)
    expected = reference.mahalanobis_score_naive(x, means, whitener)
    out = torch_kernels.mahalanobis_score(x, means, whitener, implementation=backend)
    assert out.dtype == torch.float32
    assert_close(out, expected, dtype, what=backend)
    assert backends.last_backend(OP) == backend


@pytest.mark.parametrize("backend", backend_params(OP, exclude=("reference",)))
def test_backend_large_batch(backend):
    require_backend(backend)
    x, means, whitener = _inputs(3, torch.float32, BIG)
    expected = reference.mahalanobis_score_naive(x, means, whitener)
    assert_close(torch_kernels.mahalanobis_score(x, means, whitener, implementation=backend), expected, torch.float32)


@pytest.mark.parametrize("backend", backend_params(OP))
def test_nearest_class_and_params_in_x_dtype(backend):
    """Means and whitener may be in x's own dtype; rows far from all but one class pick it."""
    require_backend(backend)
    gen = torch.Generator().manual_seed(4)
    means = torch.randn(6, 16, generator=gen) * 10
    labels = torch.randint(0, 6, (50,), generator=gen)
    x = (means[labels] + 0.1 * torch.randn(50, 16, generator=gen)).half()
    eye = torch.eye(16)
    expected = reference.mahalanobis_score_naive(x, means.half(), eye.half())
    out = torch_kernels.mahalanobis_score(x, means.half(), eye.half(), implementation=backend)
    torch.testing.assert_close(out, ((x.float() - means.half().float()[labels]) ** 2).sum(1), rtol=2e-2, atol=2e-2)
    per_class = ((x.float()[:, None, :] - means.half().float()[None]) ** 2).sum(-1)
    second = per_class.sort(dim=1).values[:, 1]
    assert (out < 0.1 * second).all()  # the min picked each row's own class, by a wide margin
    assert_close(out, expected, torch.float16)


def test_gradcheck_reference_float64():
    x, means, whitener = _inputs(5, torch.float64, (7, 5, 3))
    args = tuple(t.clone().requires_grad_() for t in (x, means, whitener))
    assert torch.autograd.gradcheck(lambda *a: torch_kernels.mahalanobis_score(*a, implementation="reference"), args)


def _grads(backend, x, means, whitener):
    args = [t.clone().requires_grad_() for t in (x, means, whitener)]
    weights = torch.linspace(0.5, 1.5, x.shape[0])
    (torch_kernels.mahalanobis_score(*args, implementation=backend) * weights).sum().backward()
    return [a.grad for a in args]


@pytest.mark.parametrize("backend", backend_params(OP, exclude=("reference",)))
def test_backend_gradients_match_reference(backend):
    require_backend(backend)
    x, means, whitener = _inputs(6, torch.float32, (45, 37, 3))
    for name, got, want in zip(("x", "means", "whitener"), _grads(backend, x, means, whitener),
                               _grads("reference", x.double(), means.double(), whitener.double())):
        assert_close(got, want.float(), torch.float32, scale=10, what=f"grad {name}")


def test_torchax_tensors_run_pallas_with_gradients():
    require_backend("pallas")
    run_isolated(TORCHAX_CHECK)


# torchax registers a 'jax' device for the whole process, which upsets opcheck and dynamo in the
# tests after it, so this runs in a process of its own.
TORCHAX_CHECK = """
import pytest, torch, torch_kernels
from torch_kernels.reference import ood as reference
from torch_kernels.ops.ood import mahalanobis_inputs
from harness import assert_close

def grads(fn, tensors):
    args = [t.clone().requires_grad_() for t in tensors]
    fn(*args).sum().backward()
    return [a.grad for a in args]

env = torch_kernels.torchax_environment()
x, means, whitener = mahalanobis_inputs(torch.Generator().manual_seed(7), torch.float32, "cpu", b=40, d=24, c=2)
expected = reference.mahalanobis_score_naive(x, means, whitener)
want = grads(lambda *a: torch_kernels.mahalanobis_score(*a, implementation="reference"), (x, means, whitener))
with env:
    jx, jm, jw = (t.to("jax").requires_grad_() for t in (x, means, whitener))
    out = torch.ops.torch_kernels.mahalanobis_score(jx, jm, jw)
    assert type(out).__module__.startswith("torchax"), type(out)
    out.sum().backward()
    got = [t.grad.to("cpu") for t in (jx, jm, jw)]
    out_cpu = out.detach().to("cpu")
    by_reference = torch_kernels.mahalanobis_score(jx, jm, jw, implementation="reference").detach().to("cpu")
    with pytest.raises(NotImplementedError, match="torchax tensors run"):
        torch_kernels.mahalanobis_score(jx, jm, jw, implementation="triton")
    with torch_kernels.use_backend("triton"), pytest.raises(NotImplementedError, match="torchax tensors run"):
        torch_kernels.mahalanobis_score(jx, jm, jw)  # the context is honoured here too
    with pytest.raises(ValueError, match="whitener: expected size 24 in dimension 0"):
        torch_kernels.mahalanobis_score(jx, jm, jw[:5])
    with pytest.raises(TypeError, match="x: expected dtype"):
        torch_kernels.mahalanobis_score(jx.int(), jm, jw)
    empty = torch_kernels.mahalanobis_score(jx[:0].detach(), jm.detach(), jw.detach())
    assert tuple(empty.shape) == (0,)
    # the fitted form, from class terms made once, on both of its torchax backends
    jterms = [t.to("jax").requires_grad_() for t in reference.class_terms(means, whitener, torch.float32)]
    fitted = {}
    for backend in ("pallas", "reference"):
        args = [jx, jterms[0], jw, *jterms[1:]]
        out_fitted = torch_kernels.mahalanobis_score_fitted(*args, implementation=backend)
        assert type(out_fitted).__module__.startswith("torchax"), type(out_fitted)
        grad_x, grad_proj = torch.autograd.grad(out_fitted.sum(), [jx, jterms[1]])
        fitted[backend] = [t.detach().to("cpu") for t in (out_fitted, grad_x, grad_proj)]
    with pytest.raises(ValueError, match="class_sq: expected size 2"):
        torch_kernels.mahalanobis_score_fitted(jx, jterms[0], jw, jterms[1], jterms[2][:1])
assert_close(out_cpu, expected, torch.float32)
assert_close(by_reference, expected, torch.float32)
for g, w in zip(got, want):
    assert_close(g, w, torch.float32, scale=10)
terms = [t.clone().requires_grad_() for t in reference.class_terms(means, whitener, torch.float32)]
xc = x.clone().requires_grad_()
cpu_fitted = torch_kernels.mahalanobis_score_fitted(xc, terms[0], whitener, *terms[1:])
cpu_grads = torch.autograd.grad(cpu_fitted.sum(), [xc, terms[1]])
for backend, results in fitted.items():
    for g, w in zip(results, (cpu_fitted.detach(), *cpu_grads)):
        assert_close(g, w, torch.float32, scale=10, what=backend)
print("torchax ok")
"""


@pytest.mark.parametrize("torch_version, torchax_version, needed", [
    ("2.12.1", "0.0.13", False), ("2.13.0+cpu", "0.0.13", True), ("2.14.1", "0.0.12", True),
    ("2.13.0", "0.0.14", False),
])
def test_torchax_shim_only_where_needed(torch_version, torchax_version, needed):
    from torch_kernels.pallas import torchax_tensors

    assert torchax_tensors._needs_import_shim(torch_version, torchax_version) == needed


def test_torchax_shim_is_needed_here_when_it_says_so():
    require_backend("pallas")
    from torch_kernels.pallas import torchax_tensors

    if not torchax_tensors._needs_import_shim():
        pytest.skip("this torch and torchax import together without the shim")
    with pytest.raises(AssertionError, match="has no overload name"):  # torchax fails without it
        run_isolated("import torchax\ntorchax.default_env()\n")


@pytest.mark.parametrize("backend", backend_params(OP))
def test_nan_row_gives_nan_score_and_leaves_other_rows(backend):
    require_backend(backend)
    x, means, whitener = _inputs(11, torch.float32, (6, 5, 3))
    x[2, 1] = float("nan")
    out = torch_kernels.mahalanobis_score(x, means, whitener, implementation=backend)
    assert torch.isnan(out[2]), out
    keep = torch.arange(6) != 2
    assert_close(out[keep], reference.mahalanobis_score_naive(x[keep], means, whitener), torch.float32)
    # the backward gathers means[nearest]: the NaN row's class must still be in range
    grad_x, _, _ = torch.ops.torch_kernels.mahalanobis_score_backward(torch.ones(6), x, means, whitener, backend)
    assert torch.isfinite(grad_x[keep]).all()


@pytest.mark.parametrize("backend", backend_params(OP))
def test_strided_and_expanded_inputs(backend):
    require_backend(backend)
    x, means, whitener = _inputs(12, torch.float32, (9, 6, 1))
    cases = {
        "x transposed": (x.T.contiguous().T, means, whitener),
        "means a column view": (x, torch.cat([means.T, means.T], 1)[:, :1].T, whitener),
        "means expanded": (x, torch.full((1, 1), 0.5).expand(1, 6), whitener),
        "whitener transposed": (x, means, whitener.T.contiguous().T),
        "x a row slice": (torch.cat([x, x], 1)[:, ::2], means, whitener),
    }
    for name, (xs, ms, ws) in cases.items():
        out = torch_kernels.mahalanobis_score(xs, ms, ws, implementation=backend)
        assert_close(out, reference.mahalanobis_score_naive(xs, ms, ws), torch.float32, what=name)


@pytest.mark.parametrize("backend", backend_params(OP))
def test_overflowing_row_names_a_class_in_range(backend):
    require_backend(backend)
    x, means, _ = _inputs(13, torch.float32, (4, 5, 3))
    whitener = 2 * torch.eye(5)
    x[1] = 3e38  # y = x W overflows to inf, and inf - inf is NaN in the fused form
    out = torch_kernels.mahalanobis_score(x, means, whitener, implementation=backend)
    assert not torch.isfinite(out[1])
    keep = torch.tensor([True, False, True, True])
    assert_close(out[keep], reference.mahalanobis_score_naive(x[keep], means, whitener), torch.float32)
    grad_x, _, _ = torch.ops.torch_kernels.mahalanobis_score_backward(torch.ones(4), x, means, whitener, backend)
    assert torch.isfinite(grad_x[keep]).all()


@pytest.mark.parametrize("backend", backend_params(OP, exclude=("reference",)))
@pytest.mark.parametrize("dtype, shape", [(torch.float32, (30, 9, 1)), (torch.float16, (30, 9, 2)),
                                          (torch.bfloat16, (30, 9, 2))], ids=str)
def test_backend_gradients_one_class_and_half_precision(backend, dtype, shape):
    require_backend(backend)
    x, means, whitener = _inputs(14, dtype, shape)
    want = _grads("reference", x.double(), means.double(), whitener.double())
    for name, got, w, t in zip(("x", "means", "whitener"), _grads(backend, x, means, whitener), want, (x, means, whitener)):
        assert got.dtype == t.dtype
        assert_close(got.float(), w.float(), dtype, scale=10, what=f"grad {name}")


@pytest.mark.parametrize("backend, classes", [("triton", 300), ("pallas", 1100), ("sycl", 20000)])
def test_class_count_beyond_a_backend_passes_to_the_next(backend, classes):
    require_backend(backend)
    x, means, whitener = _inputs(22, torch.float32, (3, 4, classes))
    out = torch_kernels.mahalanobis_score(x, means, whitener, implementation=[backend, "reference"])
    assert backends.last_backend(OP) == "reference"
    torch.testing.assert_close(out, torch_kernels.mahalanobis_score(x, means, whitener, implementation="reference"))
    with pytest.raises(RuntimeError, match=f"{backend}: .*{classes}"):
        torch_kernels.mahalanobis_score(x, means, whitener, implementation=backend)


def test_higher_order_gradients_float64():
    x, means, whitener = _inputs(16, torch.float64, (5, 4, 2))
    args = tuple(t.clone().requires_grad_() for t in (x, means, whitener))
    assert torch.autograd.gradgradcheck(lambda *a: torch_kernels.mahalanobis_score(*a, implementation="reference"), args)


def test_backward_follows_the_backend_of_its_forward():
    require_backend("sycl")  # any backend but the cpu default would do
    x, means, whitener = _inputs(17, torch.float32, (6, 5, 2))
    xg = x.clone().requires_grad_()
    with torch_kernels.use_backend("sycl"):
        out = torch_kernels.mahalanobis_score(xg, means, whitener)
    torch_kernels.mahalanobis_score(x, means, whitener)  # the default, reference, runs in between
    assert backends.last_backend(OP) == "reference"
    out.sum().backward()  # outside the block: recomputes the nearest classes on sycl
    assert backends.last_backend(OP) == "sycl"


def test_non_contiguous_x_under_compile_and_opcheck():
    x, means, whitener = _inputs(18, torch.float32, (6, 9, 1))
    xt = x.T.contiguous().T.requires_grad_()
    run_opcheck(torch.ops.torch_kernels.mahalanobis_score_backward.default, (torch.ones(6), x.T.contiguous().T, means, whitener, None))
    fn = compiled_fullgraph(lambda a: torch_kernels.mahalanobis_score(a, means, whitener).sum())
    (grad,) = torch.autograd.grad(fn(xt), xt)
    (want,) = torch.autograd.grad(torch_kernels.mahalanobis_score(xt, means, whitener).sum(), xt)
    assert_close(grad, want, torch.float32)


@pytest.mark.parametrize("backend", backend_params(OP))
def test_opcheck(backend):
    require_backend(backend)
    x, means, whitener = _inputs(8, torch.float32, (9, 6, 2))
    run_opcheck(torch.ops.torch_kernels.mahalanobis_score.default, (x, means, whitener, backend))
    grad = torch.ones(9)
    run_opcheck(torch.ops.torch_kernels.mahalanobis_score_backward.default, (grad, x, means, whitener, backend))


def test_compile_fullgraph_forward_and_backward():
    scorer = MahalanobisScorer().fit(torch.randn(200, 8, generator=torch.Generator().manual_seed(9)))

    def loss(features):
        return torch.nn.functional.softplus(scorer(features) - 8.0).mean()

    compiled = compiled_fullgraph(loss)
    x = torch.randn(31, 8, generator=torch.Generator().manual_seed(10), requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    out, out_eager = compiled(x), loss(x_eager)
    torch.testing.assert_close(out, out_eager)
    out.backward()
    out_eager.backward()
    torch.testing.assert_close(x.grad, x_eager.grad)


@pytest.mark.parametrize("backend", backend_params(OP))
def test_profiler_names_op_and_backend(backend):
    require_backend(backend)
    x, means, whitener = _inputs(11, torch.float32, (8, 4, 1))
    names = profiled_names(lambda: torch_kernels.mahalanobis_score(x, means, whitener, implementation=backend))
    assert "torch_kernels::mahalanobis_score" in names
    assert f"torch_kernels::mahalanobis_score[{backend}]" in names


def test_flop_counter_counts_the_op():
    b, d, c = 64, 32, 3
    x, means, whitener = _inputs(12, torch.float32, (b, d, c))
    flops = counted_flops(lambda: torch_kernels.mahalanobis_score(x, means, whitener))
    assert flops == ood_ops.score_flops(b, c, d) == 2 * b * d * d + 2 * c * d * d + 2 * b * c * d + 2 * b * d


def test_empty_batch():
    x, means, whitener = _inputs(13, torch.float32, (1, 4, 2))
    assert torch_kernels.mahalanobis_score(x[:0], means, whitener).shape == (0,)


# ---- backend selection ----

def test_selection_order_and_fallback(monkeypatch):
    x, means, whitener = _inputs(15, torch.float64, (4, 3, 1))
    torch_kernels.mahalanobis_score(x, means, whitener)
    assert backends.last_backend(OP) == "reference"  # the cpu default
    if backends.unavailable_reason("triton") is None:
        # triton has no float64: an ordered list moves on, a single name fails and says why
        torch_kernels.mahalanobis_score(x, means, whitener, implementation=["triton", "reference"])
        assert backends.last_backend(OP) == "reference"
        with pytest.raises(RuntimeError, match=r"\(tried triton; explicitly chosen\): triton: float64 inputs are not supported"):
            torch_kernels.mahalanobis_score(x, means, whitener, implementation="triton")
        xf, mf, wf = x.float(), means.float(), whitener.float()
        monkeypatch.setenv(backends.ENV_VAR, "triton")
        torch_kernels.mahalanobis_score(xf, mf, wf)
        assert backends.last_backend(OP) == "triton"
        with torch_kernels.use_backend("reference"):  # the context beats the environment
            torch_kernels.mahalanobis_score(xf, mf, wf)
            assert backends.last_backend(OP) == "reference"
            torch_kernels.mahalanobis_score(xf, mf, wf, implementation="triton")  # the argument beats both
            assert backends.last_backend(OP) == "triton"
    with pytest.raises(ValueError, match="implementation: unknown backend 'cuda'"):
        torch_kernels.mahalanobis_score(x, means, whitener, implementation="cuda")
    with pytest.raises(ValueError, match="use_backend: unknown backend"):
        with torch_kernels.use_backend(["reference", "nope"]):
            pass
    monkeypatch.setenv(backends.ENV_VAR, "bogus")
    with pytest.raises(ValueError, match="TORCH_KERNELS_BACKEND: unknown backend 'bogus'"):
        torch_kernels.mahalanobis_score(x, means, whitener)


def test_device_defaults():
    assert backends.resolve("cpu", None) == (("reference",), False)
    assert backends.resolve("cuda", None) == (("triton", "reference"), False)
    assert backends.resolve("xpu", None) == (("sycl", "triton", "reference"), False)
    assert backends.resolve("jax", None) == (("pallas", "reference"), False)
    assert backends.resolve("cuda", "pallas,reference") == (("pallas", "reference"), True)


def test_import_needs_only_torch_and_numpy():
    """With jax, triton and dpctl hidden, the package imports and says why those backends are off."""
    code = (
        "import sys, importlib.abc\n"
        "class Hide(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('jax', 'jaxlib', 'triton', 'dpctl', 'torchax'):\n"
        "            raise ImportError('hidden: ' + name)\n"
        "sys.meta_path.insert(0, Hide())\n"
        "import torch, torch_kernels\n"
        "r = torch_kernels.unavailable_reasons()\n"
        "assert r['reference'] is None, r\n"
        "assert all(r[b] and 'hidden' in r[b] for b in ('triton', 'pallas')) and r['sycl'], r\n"
        "x = torch.randn(3, 2)\n"
        "print(torch_kernels.mahalanobis_score(x, x[:1], torch.eye(2)).shape)\n"
    )
    assert "torch.Size([3])" in run_isolated(code)


# ---- mahalanobis_score_fitted: the score from class terms made once ----

def _fitted_args(x, means, whitener):
    center, class_proj, class_sq = reference.class_terms(means, whitener, reference.compute_dtype(x.dtype))
    return x, center, whitener, class_proj, class_sq


@pytest.mark.parametrize("backend", backend_params(OP))
@pytest.mark.parametrize("shape", [(5, 3, 1), (33, 20, 4)], ids=str)
def test_fitted_terms_give_the_op_s_scores_and_gradient_to_x(backend, shape):
    require_backend(backend)
    x, means, whitener = _inputs(30, torch.float32, shape)
    xg, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    weights = torch.linspace(0.5, 1.5, x.shape[0])
    want = torch_kernels.mahalanobis_score(xg, means, whitener, implementation=backend)
    got = torch_kernels.mahalanobis_score_fitted(*_fitted_args(xf, means, whitener), implementation=backend)
    assert backends.last_backend(OP) == backend  # the same kernels
    torch.testing.assert_close(got, want)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    assert_close(xf.grad, xg.grad, torch.float32)
    assert_close(got, reference.mahalanobis_score_naive(x, means, whitener), torch.float32)


def test_fitted_gradcheck_and_gradgradcheck_in_every_term_float64():
    x, means, whitener = _inputs(31, torch.float64, (6, 4, 3))
    args = tuple(t.clone().requires_grad_() for t in _fitted_args(x, means, whitener))
    fn = lambda *a: torch_kernels.mahalanobis_score_fitted(*a, implementation="reference")  # noqa: E731
    assert torch.autograd.gradcheck(fn, args)
    assert torch.autograd.gradgradcheck(fn, args)


def test_fitted_opcheck_profiler_flops_bytes_and_empty_batch():
    b, d, c = 9, 6, 2
    args = _fitted_args(*_inputs(32, torch.float32, (b, d, c)))
    run_opcheck(torch.ops.torch_kernels.mahalanobis_score_fitted.default, (*args, None))
    run_opcheck(torch.ops.torch_kernels.mahalanobis_score_fitted_backward.default, (torch.ones(b), *args, None))
    names = profiled_names(lambda: torch_kernels.mahalanobis_score_fitted(*args))
    assert {"torch_kernels::mahalanobis_score_fitted", "torch_kernels::mahalanobis_score_fitted[reference]"} <= set(names)
    assert counted_flops(lambda: torch_kernels.mahalanobis_score_fitted(*args)) == ood_ops.fitted_score_flops(b, c, d)
    prof, out = profiled(lambda: torch_kernels.mahalanobis_score_fitted(*args))
    row = only_row(prof, "mahalanobis_score_fitted")
    assert (row["backend"], row["bytes"]) == ("reference", nbytes(*args, out))
    assert torch_kernels.mahalanobis_score_fitted(args[0][:0], *args[1:]).shape == (0,)


def test_scorer_whitens_its_means_once(monkeypatch):
    """A fitted (or loaded) scorer scores from the class terms of its fit, in float32 and float64, and
    its state_dict carries the fit alone."""
    gen = torch.Generator().manual_seed(33)
    data, labels = torch.randn(400, 12, generator=gen, dtype=torch.float64), torch.arange(400) % 5
    scorer = MahalanobisScorer("ledoit_wolf").fit(data, labels)
    restored = MahalanobisScorer("ledoit_wolf")
    restored.load_state_dict(scorer.state_dict())
    assert set(scorer.state_dict()) == {"means_", "covariance_", "precision_", "whitener_", "shrinkage_"}
    x = torch.randn(7, 12, generator=gen, dtype=torch.float64) * 2
    want = reference.mahalanobis_score_naive(x, scorer.means_, scorer.whitener_)
    monkeypatch.setattr(reference, "class_terms", None)  # scoring must not whiten the means again
    for model in (scorer, restored):
        torch.testing.assert_close(model.score(x), want, rtol=1e-12, atol=0)
        assert_close(model.score(x.float()), want.float(), torch.float32)


# ---- MahalanobisScorer against scikit-learn ----

sklearn_covariance = pytest.importorskip("sklearn.covariance")


def _correlated(seed, n, d, shift=3.0):
    rng = np.random.default_rng(seed)
    mix = rng.normal(size=(d, d)) / np.sqrt(d) + np.eye(d)
    return rng.normal(size=(n, d)) @ mix + shift + rng.normal(size=d)


_ESTIMATORS = [("empirical", "EmpiricalCovariance"), ("ledoit_wolf", "LedoitWolf"), ("oas", "OAS")]


# 60 rows of 40 features: only the shrunk estimators are conditioned well enough to compare at 1e-6
@pytest.mark.parametrize(
    "kind, estimator, n, d",
    [(*e, n, d) for e in _ESTIMATORS for n, d in [(500, 1), (500, 7), (2000, 127)]]
    + [(*e, 60, 40) for e in _ESTIMATORS[1:]],
)
def test_fit_matches_sklearn(kind, estimator, n, d):
    data = _correlated(n + d, n, d)
    ours = MahalanobisScorer(covariance=kind).fit(torch.from_numpy(data))
    theirs = getattr(sklearn_covariance, estimator)().fit(data)
    np.testing.assert_allclose(ours.means_[0].numpy(), theirs.location_, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(ours.covariance_.numpy(), theirs.covariance_, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(ours.precision_.numpy(), theirs.precision_, rtol=1e-6, atol=1e-6 * np.abs(theirs.precision_).max())
    if kind != "empirical":
        assert ours.shrinkage_.item() == pytest.approx(theirs.shrinkage_, rel=1e-6, abs=1e-12)
    queries = _correlated(1, 100, d, shift=4.0)
    np.testing.assert_allclose(ours.score(torch.from_numpy(queries)).numpy(), theirs.mahalanobis(queries), rtol=1e-6)


@pytest.mark.parametrize("kind", ["empirical", "ledoit_wolf", "oas"])
def test_fit_streaming_equals_one_pass(kind):
    data = torch.from_numpy(_correlated(3, 1000, 16))
    whole = MahalanobisScorer(kind).fit(data)
    streamed = MahalanobisScorer(kind).fit(iter(data.split(77)))
    torch.testing.assert_close(streamed.covariance_, whole.covariance_, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(streamed.means_, whole.means_, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind, estimator", [("empirical", "EmpiricalCovariance"), ("ledoit_wolf", "LedoitWolf"), ("oas", "OAS")])
def test_fit_with_labels_is_tied_covariance(kind, estimator):
    rng = np.random.default_rng(4)
    centers = rng.normal(size=(5, 12)) * 4
    labels = rng.integers(0, 5, size=800)
    data = centers[labels] + _correlated(5, 800, 12, shift=0.0)
    ours = MahalanobisScorer(kind).fit(list(torch.from_numpy(data).split(100)), list(torch.from_numpy(labels).split(100)))
    class_means = np.stack([data[labels == c].mean(0) for c in range(5)])
    theirs = getattr(sklearn_covariance, estimator)(assume_centered=True).fit(data - class_means[labels])
    np.testing.assert_allclose(ours.means_.numpy(), class_means, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(ours.covariance_.numpy(), theirs.covariance_, rtol=1e-6, atol=1e-9)
    queries = rng.normal(size=(30, 12)) * 4
    expected = np.min([theirs.mahalanobis(queries - m) for m in class_means], axis=0)
    np.testing.assert_allclose(ours.score(torch.from_numpy(queries)).numpy(), expected, rtol=1e-6)


def test_threshold_state_dict_and_ridge():
    data = torch.from_numpy(_correlated(6, 4000, 10))
    scorer = MahalanobisScorer("oas", ridge=1e-3).fit(data[:3000])
    limit = scorer.threshold(data[3000:], tpr=0.9)
    assert (scorer.score(data[3000:]) <= limit).double().mean().item() == pytest.approx(0.9, abs=2e-3)
    restored = MahalanobisScorer("oas", ridge=1e-3)
    restored.load_state_dict(scorer.state_dict())
    torch.testing.assert_close(restored.score(data[:50].float()), scorer.score(data[:50].float()))
    assert restored.covariance_.diagonal().min() >= 1e-3
    assert "classes=1, features=10" in repr(restored)


def test_threshold_interpolates_as_quantile():
    scorer = MahalanobisScorer().fit(torch.randn(300, 3, generator=torch.Generator().manual_seed(19)))
    held_out = torch.randn(101, 3, generator=torch.Generator().manual_seed(20))
    scores = scorer.score(held_out).double()
    for tpr in (0.5, 0.95, 0.999, 1.0):
        assert scorer.threshold(held_out, tpr) == pytest.approx(torch.quantile(scores, tpr).item(), rel=1e-12)


def test_dtype_conversion_of_a_model_keeps_the_fit():
    data = torch.randn(400, 6, generator=torch.Generator().manual_seed(21), dtype=torch.float64)
    x = data[:20].float()
    expected = MahalanobisScorer("ledoit_wolf").fit(data).score(x)
    for convert in (torch.nn.Module.half, torch.nn.Module.bfloat16, torch.nn.Module.double):
        model = torch.nn.Sequential(torch.nn.Identity(), MahalanobisScorer("ledoit_wolf").fit(data))
        convert(model)
        scorer = model[1]
        assert scorer.means_.dtype == scorer.whitener_.dtype == torch.float64
        torch.testing.assert_close(scorer(x), expected)
        assert_close(scorer(x.half()), expected, torch.float16)


def test_fit_with_a_ridge_or_empty_batches():
    """A ridge makes a singular covariance invertible; empty batches (first or later) add nothing."""
    MahalanobisScorer(ridge=0.1).fit(torch.randn(3, 8))
    good = torch.randn(50, 4, dtype=torch.float64)
    want = MahalanobisScorer().fit(good)
    got = MahalanobisScorer().fit([good[:0], good[:20], good[:0], good[20:]])
    torch.testing.assert_close(got.means_, want.means_)
    torch.testing.assert_close(got.covariance_, want.covariance_)


# ---- the byte formula, against counts made here ----

def test_ood_bytes_are_every_input_and_output():
    b, c, d = 20, 3, 16
    x, means, whitener = random_tensor(b, d, seed=1), random_tensor(c, d, seed=2), random_tensor(d, d, seed=3)
    prof, _ = profiled(lambda: torch_kernels.mahalanobis_score(x, means, whitener))
    row = only_row(prof, "mahalanobis_score")
    assert row["bytes"] == ood_ops.score_bytes(b, c, d, FLOAT32_BYTES, FLOAT32_BYTES)
    assert row["bytes"] == nbytes(x, means, whitener) + b * FLOAT32_BYTES
    assert row["flops"] == ood_ops.score_flops(b, c, d)

    xg = x.clone().requires_grad_()
    prof, _ = profiled(lambda: torch_kernels.mahalanobis_score(xg, means, whitener).sum().backward())
    backward = only_row(prof, "mahalanobis_score_backward")
    # reads the score's gradient, x, means and whitener; writes a gradient of each of the three
    assert backward["bytes"] == b * FLOAT32_BYTES + 2 * nbytes(x, means, whitener)
    assert backward["flops"] == ood_ops.score_flops(b, c, d) + 6 * b * d * d

"""The Triton linear-attention kernels (triton_impl.linear_attention), run by the Triton interpreter
on CPU tensors, against the definition: ``recurrence_naive`` in float64 for outputs and final
states, autograd through it for every gradient, compared by relative RMSE (RMS of the difference over RMS of the
truth). The interpreter computes in float32 whatever the input dtype (its bfloat16 arithmetic is
wrong, so the kernels widen every load there), so float32 is held to 1e-4, far inside the 5e-3
(o, final state), 8e-3 (dq, dk, dv, dh0) and 2e-2 (dg, dbeta) allowed; measured errors are ~1e-6.
Shapes stay small: the interpreter's cost is per program and per op."""

from __future__ import annotations

import math

import pytest
import torch

from harness import require_backend
from torch_kernels.reference.linear_attention import recurrence_naive

pytestmark = pytest.mark.usefixtures("triton_available")

FLOAT32_TOLERANCE = 1e-4
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.fixture
def triton_available():
    require_backend("triton")


def relative_rmse(out: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.double()
    return ((out.double() - expected).square().mean().sqrt() / expected.square().mean().sqrt().clamp_min(1e-30)).item()


def make_inputs(batch=1, length=75, heads=1, value_heads=1, k_dim=64, v_dim=64, delta=True, gate="weak",
                initial_state=True, l2norm=True, cu_seqlens=None, seed=0):
    """Random inputs; without in-kernel normalization the keys come normalized (as a delta-rule
    model feeds them: else the recurrence diverges) and queries scaled to a similar size."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, k_dim, generator=gen)
    k = torch.randn(batch, length, heads, k_dim, generator=gen)
    if not l2norm:
        k = k / k.norm(dim=-1, keepdim=True)
        q = q / k_dim ** 0.5
    v = torch.randn(batch, length, value_heads, v_dim, generator=gen)
    gate_shape = (batch, length, value_heads)
    g = {"weak": lambda: -0.02 * torch.rand(gate_shape, generator=gen),
         "strong": lambda: -5.0 * (0.5 + torch.rand(gate_shape, generator=gen)), None: lambda: None}[gate]()
    beta = torch.rand(gate_shape, generator=gen) if delta else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)
    num_states = batch if cu is None else len(cu_seqlens) - 1
    h0 = torch.randn(num_states, value_heads, k_dim, v_dim, generator=gen) if initial_state else None
    return dict(q=q, k=k, v=v, g=g, beta=beta, scale=k_dim ** -0.5, initial_state=h0, cu_seqlens=cu,
                use_qk_l2norm=l2norm)


def definition(inputs, do, dht, widen=True):
    """(o, final state, {gradient name: tensor}) by the naive recurrence and autograd: in float64,
    or with ``widen=False`` on the inputs as they are (float32 arithmetic, o and the gradients in
    the inputs' dtypes: what the reference backend returns)."""
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = {n: (inputs[n].detach().double() if widen else inputs[n].detach().clone()).requires_grad_()
              for n in names if inputs[n] is not None}
    args = {**inputs, **leaves}
    o, ht = recurrence_naive(args["q"], args["k"], args["v"], args["g"], args["beta"], inputs["scale"],
                             args["initial_state"], inputs["cu_seqlens"], inputs["use_qk_l2norm"])
    grads = torch.autograd.grad([o, ht], list(leaves.values()), [do.to(o.dtype), dht.to(ht.dtype)])
    return o, ht, {"d" + ("h0" if n == "initial_state" else n): g for n, g in zip(leaves, grads)}


def cotangents(inputs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    v, q = inputs["v"], inputs["q"]
    num_states = q.shape[0] if inputs["cu_seqlens"] is None else inputs["cu_seqlens"].shape[0] - 1
    do = torch.randn(v.shape, generator=gen)
    dht = torch.randn(num_states, v.shape[2], q.shape[3], v.shape[3], generator=gen)
    return do, dht


def check_form(form: str, inputs, tolerance=FLOAT32_TOLERANCE):
    from triton_impl import linear_attention as kernels

    args = [inputs[n] for n in ("q", "k", "v", "g", "beta", "scale", "initial_state", "cu_seqlens", "use_qk_l2norm")]
    do, dht = cotangents(inputs)
    o_ref, ht_ref, grads_ref = definition(inputs, do, dht)
    o, ht = getattr(kernels, f"{form}_forward")(*args)
    assert o.shape == inputs["v"].shape and o.dtype == inputs["v"].dtype
    assert ht.shape == ht_ref.shape and ht.dtype == torch.float32
    errors = {"o": relative_rmse(o, o_ref), "ht": relative_rmse(ht, ht_ref)}
    grads = dict(zip(GRADIENTS, getattr(kernels, f"{form}_backward")(do, dht, *args)))
    for name, grad in grads.items():
        if name not in grads_ref:
            assert grad is None or not grad.any(), f"{name}: a gradient for an absent input"
            continue
        assert grad.shape == grads_ref[name].shape, name
        errors[name] = relative_rmse(grad, grads_ref[name])
    assert set(errors) == {"o", "ht"} | set(grads_ref)
    worst = {name: err for name, err in errors.items() if not err <= tolerance}
    assert not worst, f"relative RMSE above {tolerance}: {worst} (all: {errors})"


CHUNK_CASES = {
    "delta-grouped-weak-h0-l2": dict(length=75, heads=2, value_heads=4),
    "delta-strong-batch": dict(batch=2, length=130, gate="strong", initial_state=False, l2norm=False),
    "delta-T1": dict(batch=2, length=1, value_heads=2),
    "delta-K60-V100-packed": dict(length=63, k_dim=60, v_dim=100, l2norm=False, cu_seqlens=[0, 20, 20, 63]),
    "delta-no-gate-packed": dict(length=75, value_heads=2, gate=None, initial_state=False,
                                 cu_seqlens=[0, 64, 75]),
    "gla-weak-h0": dict(length=130, heads=2, value_heads=2, delta=False),
    "gla-strong": dict(batch=2, length=63, delta=False, gate="strong", initial_state=False),
    "gla-no-gate-packed": dict(length=75, delta=False, gate=None, cu_seqlens=[0, 5, 75]),
    "gla-T1": dict(length=1, delta=False),
}

RECURRENT_CASES = {
    "delta-grouped-weak-h0-l2": dict(length=75, heads=2, value_heads=4),
    "delta-strong": dict(length=63, gate="strong", initial_state=False, l2norm=False),
    "delta-T1": dict(batch=2, length=1, value_heads=2),
    "delta-K60-V100-packed": dict(length=63, k_dim=60, v_dim=100, l2norm=False, cu_seqlens=[0, 20, 20, 63]),
    "delta-no-gate-batch": dict(batch=2, length=63, gate=None),
    "gla-weak": dict(length=130, delta=False, initial_state=False),
    "gla-strong": dict(length=63, delta=False, gate="strong"),
    "gla-no-gate-packed": dict(length=75, delta=False, gate=None, cu_seqlens=[0, 5, 75]),
}


@pytest.mark.parametrize("case", CHUNK_CASES)
def test_chunk_matches_definition(case):
    check_form("chunk", make_inputs(**CHUNK_CASES[case]))


@pytest.mark.parametrize("case", RECURRENT_CASES)
def test_recurrent_matches_definition(case):
    check_form("recurrent", make_inputs(**RECURRENT_CASES[case]))


@pytest.mark.parametrize("delta", [True, False], ids=["delta", "gla"])
def test_chunk_small_tiles(delta, monkeypatch):
    """16-wide K blocks and 32-wide V blocks, so that every K and V loop (and V split) of the chunk
    kernels runs several times with a ragged last block (K = 60, V = 100), as K, V = 256 do on a
    GPU."""
    import dataclasses

    from triton_impl import linear_attention as kernels

    default = kernels.default_config
    monkeypatch.setattr(kernels, "default_config", lambda *args, **kwargs: dataclasses.replace(
        default(*args, **kwargs), block_k=16, block_v=32))
    spec = dict(CHUNK_CASES["delta-K60-V100-packed"], delta=delta, length=90, cu_seqlens=[0, 20, 20, 90])
    check_form("chunk", make_inputs(**spec))


@pytest.mark.parametrize("delta", [True, False], ids=["delta", "gla"])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("spike", [-1e4, float("-inf")], ids=["g-1e4", "g-inf"])
def test_strong_decay_across_chunks(spike, form, delta):
    """Spikes on the first and last steps of sequences and chunks (T = 150 packed as 70 + 80, so
    the second sequence's chunks straddle the first's), every seventh step besides: held to 1e-5
    against the float64 recurrence, as the shared single-chunk test holds them."""
    inputs = make_inputs(length=150, k_dim=32, v_dim=32, delta=delta, l2norm=False, cu_seqlens=[0, 70, 150], seed=9)
    g = torch.full((1, 150, 1), -0.1)
    g[:, 6::7] = spike
    g[:, [0, 63, 64, 69, 70, 133, 134, 149]] = spike
    inputs["g"] = g
    if delta:
        inputs["beta"] = torch.ones_like(g)
    check_form(form, inputs, tolerance=1e-5)


EMPTY_CASES = {  # what the reference returns: empty outputs, final states = initial states (or zeros)
    "B0": dict(batch=0, length=5),
    "T0": dict(batch=2, length=0),
    "T0-no-state": dict(batch=2, length=0, initial_state=False),
    "packed-all-empty": dict(length=0, cu_seqlens=[0, 0, 0]),
}


@pytest.mark.parametrize("delta", [True, False], ids=["delta", "gla"])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("case", EMPTY_CASES)
def test_empty_inputs(case, form, delta):
    from triton_impl import linear_attention as kernels

    inputs = make_inputs(k_dim=16, v_dim=16, delta=delta, **EMPTY_CASES[case])
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta", "scale", "initial_state", "cu_seqlens", "use_qk_l2norm")]
    o, ht = getattr(kernels, f"{form}_forward")(*args)
    o_ref, ht_ref = recurrence_naive(*args)
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert torch.equal(ht, ht_ref)
    do, dht = cotangents(inputs)
    grads = dict(zip(GRADIENTS, getattr(kernels, f"{form}_backward")(do, dht, *args)))
    for name in ("q", "k", "v", "g", "beta"):
        grad = grads["d" + name]
        if inputs[name] is None:
            assert grad is None or grad.numel() == 0, name
        else:
            assert grad.shape == inputs[name].shape and grad.numel() == 0, name
    if inputs["initial_state"] is None:
        assert grads["dh0"] is None
    else:
        assert torch.equal(grads["dh0"], dht)  # nothing between the initial and the final state


def worst_relative(out: torch.Tensor, truth: torch.Tensor) -> float:
    """The largest element-wise error relative to |truth|, floored at 1% of its largest element (as
    ``harness.assert_close`` measures it)."""
    truth = truth.double()
    return ((out.double() - truth).abs() / (truth.abs() + 0.01 * truth.abs().max())).max().item()


def check_as_accurate_as_reference(form: str, inputs):
    """The kernels on 16-bit inputs: each output and gradient (rounded to its input's dtype, as the
    op returns it) no further from the float64 definition on the same inputs, element by element,
    than twice the reference's own error (float32 arithmetic, o in the inputs' dtype) plus
    float32's tolerance: the bar tests/test_on_device.py holds the compiled kernels to. A float32
    intermediate or normalized q, k rounded to the 16-bit dtype misses it by 10x or more."""
    from triton_impl import linear_attention as kernels

    args = [inputs[n] for n in ("q", "k", "v", "g", "beta", "scale", "initial_state", "cu_seqlens", "use_qk_l2norm")]
    do, dht = cotangents(inputs)
    do = do.to(inputs["v"].dtype)
    o_ref, ht_ref, grads_ref = definition(inputs, do, dht)
    o_own, ht_own, grads_own = definition(inputs, do, dht, widen=False)
    o, ht = getattr(kernels, f"{form}_forward")(*args)
    assert o.dtype == inputs["v"].dtype
    grads = dict(zip(GRADIENTS, getattr(kernels, f"{form}_backward")(do, dht, *args)))
    got = {"o": (o, o_ref, o_own), "ht": (ht, ht_ref, ht_own)}
    for name, truth in grads_ref.items():
        source = inputs["initial_state" if name == "dh0" else name[1:]]
        got[name] = (grads[name].to(source.dtype), truth, grads_own[name])
    errors = {name: (worst_relative(out, truth), worst_relative(own, truth)) for name, (out, truth, own) in got.items()}
    missed = {name: f"{err:.2e} (reference {own:.2e})" for name, (err, own) in errors.items() if err > 2 * own + 2e-5}
    assert not missed, f"further from the definition than the reference: {missed}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_half_precision_inputs(form, dtype):
    """16-bit inputs, l2-normalized in the op (the interpreter widens them after loading): as
    accurate as the reference, element by element; q, k were once normalized and then rounded to
    their dtype, which left the final states ~1000x further off than the reference's."""
    inputs = make_inputs(length=75, heads=1, value_heads=2, k_dim=32, v_dim=32, cu_seqlens=[0, 30, 75])
    for name in ("q", "k", "v"):
        inputs[name] = inputs[name].to(dtype)
    check_as_accurate_as_reference(form, inputs)


@pytest.mark.parametrize("case", ["delta-strong-batch", "gla-weak-h0"])
def test_chunk_sixteen_bit_dot_path(case, monkeypatch):
    """The GPU's path for 16-bit inputs, forced in the interpreter with float16 (whose arithmetic it
    gets right): ``Q K^T`` and gated linear attention's ``dO V^T`` in float16, every other product
    as float32 (once rounded to float16 too, ~20x further off than the reference)."""
    from triton_impl import linear_attention as kernels

    monkeypatch.setattr(kernels, "_low_precision", lambda dtype, interpreted: dtype == torch.float16)
    inputs = make_inputs(**CHUNK_CASES[case])
    for name in ("q", "k", "v"):
        inputs[name] = inputs[name].half()
    check_as_accurate_as_reference("chunk", inputs)


GUARD = 1024  # elements of NaN on either side of every guarded tensor


def guarded_empty(*shape, dtype=torch.float32, device="cpu", guards=None):
    """A tensor of ``shape`` inside a buffer whose GUARD elements on either side hold NaN (-2^30 for
    integers); ``guards`` collects (buffer, size) to check afterwards."""
    shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
    size = math.prod(shape)
    buffer = torch.full((size + 2 * GUARD,), float("nan") if dtype.is_floating_point else -2 ** 30, dtype=dtype,
                        device=device)
    guards.append((buffer, size))
    return buffer[GUARD:GUARD + size].view(shape)


def untouched(buffer: torch.Tensor, size: int) -> bool:
    sides = torch.cat([buffer[:GUARD], buffer[GUARD + size:]])
    return bool(sides.isnan().all() if sides.is_floating_point() else (sides == -2 ** 30).all())


@pytest.mark.parametrize("delta, dtype", [(True, torch.bfloat16), (False, torch.float32)], ids=["delta", "gla"])
def test_gpu_tiles_stay_in_bounds(delta, dtype, monkeypatch):
    """The chunk kernels at the tiles they take on an H100/H200 for ``dtype`` inputs (16 and 32 wide,
    a ragged last V block, partial chunks), with every input and every buffer the launchers
    allocate inside NaN guards: no store lands in a guard and no load from one reaches a result.
    The interpreter checks no address, and on a GPU such an access is an illegal one or silent."""
    import types

    from triton_impl import linear_attention as kernels

    guards = []
    proxy = types.ModuleType("torch_with_guarded_buffers")
    proxy.__getattr__ = lambda name: getattr(torch, name)
    proxy.empty = lambda *shape, dtype=torch.float32, device="cpu": guarded_empty(*shape, dtype=dtype, device=device,
                                                                                 guards=guards)
    proxy.empty_like = lambda t, dtype=None: guarded_empty(t.shape, dtype=dtype or t.dtype, device=t.device,
                                                           guards=guards)
    monkeypatch.setattr(kernels, "torch", proxy)
    monkeypatch.setattr(kernels._Problem, "config", lambda self, kernel: kernels.default_config(
        kernel, self.shape[3], self.shape[4], dtype, interpreted=False, arch=90))
    inputs = make_inputs(length=75, heads=1, value_heads=2 if delta else 1, k_dim=32, v_dim=48, delta=delta,
                         cu_seqlens=[0, 30, 75])
    for name in ("q", "k", "v", "g", "beta", "initial_state"):
        if inputs[name] is not None:
            inputs[name] = guarded_empty(inputs[name].shape, guards=guards).copy_(inputs[name])
    check_form("chunk", inputs)
    assert all(untouched(buffer, size) for buffer, size in guards)


def test_no_config_splits_dots_into_narrow_tf32_tiles():
    """On sm_90 no default config, nor any an autotuner may try, has 8 warps split a 16-wide dot into
    8-wide tf32 wgmma tiles (an illegal memory access on an H200 under Triton 3.6), at any K, V; the
    compile report checks the PTX of the benchmark shapes' builds."""
    from triton_impl import linear_attention as kernels

    for kernel in kernels.KERNELS:
        for dtype in (torch.float32, torch.bfloat16):
            for k_dim, v_dim in ((16, 16), (32, 48), (64, 64), (128, 128), (256, 256)):
                configs = kernels.config_space(kernel, k_dim, v_dim, dtype, arch=90)
                assert configs[0] == kernels.default_config(kernel, k_dim, v_dim, dtype, arch=90)
                split = [c for c in configs if kernels._splits_narrow_dots(kernel, c.block_k, c.block_v, c.num_warps,
                                                                           k_dim, v_dim, 90)]
                assert not split, (kernel, dtype, k_dim, v_dim, split)
    assert kernels._splits_narrow_dots("chunk_grad", 16, 32, 8, 128, 128, 90)  # the launch that faulted
    assert not kernels._splits_narrow_dots("chunk_grad", 16, 32, 8, 128, 128, 80)  # mma.sync on sm_80


def test_unsupported_inputs_raise_not_implemented():
    from triton_impl import linear_attention as kernels

    inputs = make_inputs(length=3, k_dim=16, v_dim=16)
    args = [inputs[n] for n in ("q", "k", "v", "g", "beta", "scale", "initial_state", "cu_seqlens", "use_qk_l2norm")]
    wide = make_inputs(length=2, k_dim=300, v_dim=16)
    wide_args = [wide[n] for n in ("q", "k", "v", "g", "beta", "scale", "initial_state", "cu_seqlens", "use_qk_l2norm")]
    for fn in (kernels.chunk_forward, kernels.recurrent_forward):
        with pytest.raises(NotImplementedError, match="^triton: "):
            fn(*[a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args])
        with pytest.raises(NotImplementedError, match="^triton: key head size"):
            fn(*wide_args)


def _op_case(delta: bool, length: int):
    inputs = make_inputs(length=length, heads=1, value_heads=2 if delta else 1, delta=delta,
                         cu_seqlens=[0, 11, length], l2norm=delta)
    leaves = {n: inputs[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")
              if inputs[n] is not None}
    return inputs, leaves


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_simple_gla"])
def test_ops_on_triton(op):
    """The public ops with ``implementation="triton"``: forward and backward against the definition."""
    import torch_kernels
    from torch_kernels import backends

    delta = op != "chunk_simple_gla"
    inputs, leaves = _op_case(delta, 63 if "recurrent" in op else 75)
    args = {**inputs, **leaves}
    if delta:
        o, ht = getattr(torch_kernels, op)(
            args["q"], args["k"], args["v"], args["g"], args["beta"], scale=inputs["scale"],
            initial_state=args["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=inputs["cu_seqlens"], implementation="triton")
    else:
        o, ht = torch_kernels.chunk_simple_gla(
            args["q"], args["k"], args["v"], args["g"], scale=inputs["scale"], initial_state=args["initial_state"],
            output_final_state=True, cu_seqlens=inputs["cu_seqlens"], implementation="triton")
    assert backends.last_backend(op) == "triton"
    do, dht = cotangents(inputs)
    grads = torch.autograd.grad([o, ht], list(leaves.values()), [do, dht])
    assert backends.last_backend(f"{op}_backward") == "triton"
    o_ref, ht_ref, grads_ref = definition(inputs, do, dht)
    assert relative_rmse(o, o_ref) <= FLOAT32_TOLERANCE
    assert relative_rmse(ht, ht_ref) <= FLOAT32_TOLERANCE
    for name, grad in zip(leaves, grads):
        key = "d" + ("h0" if name == "initial_state" else name)
        assert relative_rmse(grad, grads_ref[key]) <= FLOAT32_TOLERANCE, key


def test_op_passes_float64_to_the_next_backend():
    import torch_kernels
    from torch_kernels import backends

    inputs = make_inputs(length=5, k_dim=16, v_dim=16)
    o, _ = torch_kernels.chunk_gated_delta_rule(
        inputs["q"].double(), inputs["k"].double(), inputs["v"].double(), inputs["g"].double(),
        inputs["beta"].double(), implementation=["triton", "reference"])
    assert backends.last_backend("chunk_gated_delta_rule") == "reference"
    assert o.dtype == torch.float64


def test_opcheck_on_triton():
    """The op's schema, fake and autograd agree with what the Triton kernels return."""
    x = make_inputs(length=20, value_heads=2, k_dim=16, v_dim=16, cu_seqlens=[0, 7, 20])
    tensors = [x[n].requires_grad_() for n in ("q", "k", "v", "g", "beta")]
    args = (*tensors, x["scale"], x["initial_state"].requires_grad_(), x["cu_seqlens"], True, "triton")
    torch.library.opcheck(torch.ops.torch_kernels.chunk_gated_delta_rule.default, args)

"""The SYCL linear-attention kernels (oneapi_impl.linear_attention) against the definition.

Outputs, final states and every gradient of the chunked and the recurrent kernels against
``recurrence_naive`` (gradients: autograd through it), by relative RMSE: odd lengths (1, 63, 75,
130: one row, a partial chunk, a chunk and a bit, three chunks), K = 60 / V = 100 (neither a
power of two; two state blocks), grouped value heads, packed sequences (one empty), weak and
strong decays, the delta rule and gated linear attention with and without a gate, the q/k l2
norm; float16 / bfloat16 storage; and the public ops run with ``implementation="sycl"``.
"""

from __future__ import annotations

import pytest
import torch

import torch_kernels
from harness import require_backend
from torch_kernels import backends
from torch_kernels.reference import linear_attention as reference

# relative RMSE bounds in float32 (accumulation order differs from the step-by-step truth)
TOLERANCE = {"o": 5e-3, "final_state": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 8e-3,
             "dg": 2e-2, "dbeta": 2e-2}
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


@pytest.fixture(scope="module")
def sycl():
    require_backend("sycl")
    from oneapi_impl import linear_attention

    return linear_attention


def _rmse(out, expected) -> float:
    out, expected = out.double(), expected.double()
    return ((out - expected).square().mean().sqrt() / expected.square().mean().sqrt().clamp_min(1e-30)).item()


def _inputs(seed, *, batch=2, length=75, heads=2, value_heads=4, k_dim=64, v_dim=64, delta=True, gate=True,
            decay=0.1, initial_state=True, cu_seqlens=None, l2norm=False, dtype=torch.float32):
    """Random inputs; ``decay`` bounds -g per step (5 drives exp(b) to underflow within a chunk).
    Keys are scaled so that the delta rule's k.k stays near 1 (as with the l2 norm)."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = batch if cu_seqlens is None else len(cu_seqlens) - 1
    q = torch.randn(batch, length, heads, k_dim, generator=gen)
    k = torch.randn(batch, length, heads, k_dim, generator=gen) * (1.0 if l2norm else k_dim ** -0.5)
    v = torch.randn(batch, length, value_heads, v_dim, generator=gen)
    g = -torch.rand(batch, length, value_heads, generator=gen) * decay if gate else None
    beta = torch.rand(batch, length, value_heads, generator=gen) if delta else None
    h0 = torch.randn(num_seqs, value_heads, k_dim, v_dim, generator=gen) if initial_state else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=beta, scale=k_dim ** -0.5,
                initial_state=h0, cu_seqlens=cu, use_qk_l2norm=l2norm)


def _truth(x, with_dht=True, seed=1):
    """(o, final state, do, dht, gradients by name) from the naive recurrence."""
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = {n: None if x[n] is None else x[n].detach().clone().requires_grad_() for n in names}
    o, ht = reference.recurrence_naive(*(leaves[n] for n in names[:5]), x["scale"], leaves["initial_state"],
                                       x["cu_seqlens"], x["use_qk_l2norm"])
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, generator=gen) if with_dht else None
    present = [n for n in names if leaves[n] is not None]
    outputs, upstream = ([o, ht], [do, dht]) if with_dht else ([o], [do])
    found = torch.autograd.grad(outputs, [leaves[n] for n in present], upstream)
    grads = dict(zip(present, found))
    return o, ht, do, dht, {d: grads.get(n) for d, n in zip(GRADIENTS, names)}


def _args(x):
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["initial_state"], x["cu_seqlens"],
            x["use_qk_l2norm"])


CASES = {  # name -> _inputs arguments (and whether the final state's gradient flows)
    "T75-grouped-weak": dict(length=75),
    "T1-strong": dict(length=1, decay=5.0),
    "T63-gla": dict(length=63, delta=False),
    "T130-gla-no-gate-zero-state": dict(length=130, delta=False, gate=False, initial_state=False),
    "T130-packed-K60-V100-strong": dict(batch=1, length=130, cu_seqlens=[0, 5, 5, 70, 130], k_dim=60, v_dim=100,
                                        decay=5.0),
    "T130-l2norm-no-dht": dict(length=130, l2norm=True, decay=1.0, initial_state=False, with_dht=False),
}


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_naive_recurrence(sycl, form, case):
    options = dict(CASES[case])
    with_dht = options.pop("with_dht", True)
    x = _inputs(0, **options)
    o_ref, ht_ref, do, dht, expected = _truth(x, with_dht)
    o, ht = getattr(sycl, f"{form}_forward")(*_args(x))
    assert o.dtype == x["v"].dtype and ht.dtype == torch.float32
    assert _rmse(o, o_ref) <= TOLERANCE["o"], "o"
    assert _rmse(ht, ht_ref) <= TOLERANCE["final_state"], "final_state"
    grads = getattr(sycl, f"{form}_backward")(do, dht, *_args(x))
    for name, got in zip(GRADIENTS, grads):
        if expected[name] is None:
            assert got is None, f"{name}: expected None for an absent input"
            continue
        assert got.shape == expected[name].shape, name
        assert torch.isfinite(got).all(), name
        err = _rmse(got, expected[name])
        assert err <= TOLERANCE[name], f"{name}: relative RMSE {err:.2e} > {TOLERANCE[name]:.0e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_low_precision_storage(sycl, form, dtype):
    """The kernels compute in float32 from exactly converted loads, so the output in the input
    dtype is the float32 kernel's output rounded as torch rounds (the encoders, bit for bit), and
    the gradients (float32) are those of the float32 kernel on the same values."""
    x = _inputs(2, length=70, dtype=dtype)
    wide = {**x, **{n: x[n].float() for n in ("q", "k", "v")}}
    forward, backward = getattr(sycl, f"{form}_forward"), getattr(sycl, f"{form}_backward")
    o, ht = forward(*_args(x))
    o32, ht32 = forward(*_args(wide))
    assert o.dtype == dtype
    assert torch.equal(o, o32.to(dtype))
    assert torch.equal(ht, ht32)
    o_ref, ht_ref, do, dht, expected = _truth(x)
    assert _rmse(o, o_ref) <= (2e-3 if dtype == torch.float16 else 1e-2)
    for name, got in zip(GRADIENTS, backward(do, dht, *_args(x))):
        assert _rmse(got, expected[name].float()) <= TOLERANCE[name], name


def _op_leaves(x):
    return {n: None if x[n] is None else x[n].detach().clone().requires_grad_()
            for n in ("q", "k", "v", "g", "beta", "initial_state")}


def _check_op_gradients(out, ht, leaves, o_ref, ht_ref, do, dht, expected, op):
    assert backends.last_backend(op) == "sycl"
    assert _rmse(out, o_ref) <= TOLERANCE["o"] and _rmse(ht, ht_ref) <= TOLERANCE["final_state"]
    present = [(d, t) for d, t in zip(GRADIENTS, leaves.values()) if t is not None]
    found = torch.autograd.grad([out, ht], [t for _, t in present], [do, dht])
    assert backends.last_backend(f"{op}_backward") == "sycl"
    for (name, _), got in zip(present, found):
        err = _rmse(got, expected[name])
        assert err <= TOLERANCE[name], f"{name}: relative RMSE {err:.2e}"


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_delta_rule_ops_run_on_sycl(sycl, op):
    x = _inputs(3, batch=1, length=130, cu_seqlens=[0, 64, 64, 67, 130], l2norm=True, decay=0.5)
    o_ref, ht_ref, do, dht, expected = _truth(x)
    leaves = _op_leaves(x)
    out, ht = getattr(torch_kernels, op)(
        leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], scale=x["scale"],
        initial_state=leaves["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=x["cu_seqlens"], implementation="sycl")
    _check_op_gradients(out, ht, leaves, o_ref, ht_ref, do, dht, expected, op)


@pytest.mark.parametrize("gate", [True, False])
def test_simple_gla_op_runs_on_sycl(sycl, gate):
    x = _inputs(4, length=75, value_heads=2, delta=False, gate=gate)
    o_ref, ht_ref, do, dht, expected = _truth(x)
    leaves = _op_leaves(x)
    out, ht = torch_kernels.chunk_simple_gla(leaves["q"], leaves["k"], leaves["v"], leaves["g"], scale=x["scale"],
                                             initial_state=leaves["initial_state"], output_final_state=True,
                                             implementation="sycl")
    _check_op_gradients(out, ht, leaves, o_ref, ht_ref, do, dht, expected, "chunk_simple_gla")


def test_unsupported_inputs_pass_to_the_next_backend(sycl):
    x = _inputs(5, length=9)
    wide = {**x, **{n: x[n].double() for n in ("q", "k", "v")}}
    with pytest.raises(NotImplementedError, match="^sycl: "):
        sycl.chunk_forward(*_args(wide))
    meta = {**x, **{n: x[n].to("meta") for n in ("q", "k", "v", "g", "beta", "initial_state")}}
    with pytest.raises(NotImplementedError, match="^sycl: "):
        sycl.recurrent_forward(*_args(meta))
    out, _ = torch_kernels.chunk_gated_delta_rule(wide["q"], wide["k"], wide["v"], x["g"], x["beta"],
                                                  implementation=["sycl", "reference"])
    assert out.dtype == torch.float64 and backends.last_backend("chunk_gated_delta_rule") == "reference"


def _spiky(x, rows):
    """``x`` with its gates set to -1e4, -inf and -50 in turn on ``rows``: decays whose cumulative
    sums cancel in float32 (or give -inf - -inf) unless each decay sums only the gates it spans."""
    g = x["g"].clone()
    for i, row in enumerate(rows):
        g[:, row] = (-1e4, float("-inf"), -50.0)[i % 3]
    return {**x, "g": g}


@pytest.mark.parametrize("delta", [True, False], ids=["delta", "gla"])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_strong_gates_keep_float32_precision(sycl, form, delta):
    """Spikes on a packed sequence's first row, on both sides of chunk borders and on its last
    row, over three chunks (one partial), two state blocks and grouped heads: outputs, final
    states and every gradient within 1e-5 relative RMSE of the float64 recurrence."""
    x = _inputs(6, batch=1, length=150, heads=1, value_heads=2, k_dim=60, v_dim=100, delta=delta,
                cu_seqlens=[0, 10, 10, 150])
    x = _spiky(x, [10, 40, 73, 74, 75, 137, 138, 149])
    wide = {**x, **{n: x[n].double() for n in ("q", "k", "v", "g", "beta", "initial_state") if x[n] is not None}}
    o_ref, ht_ref, do, dht, expected = _truth(wide)
    o, ht = getattr(sycl, f"{form}_forward")(*_args(x))
    grads = getattr(sycl, f"{form}_backward")(do.float(), dht.float(), *_args(x))
    errors = {"o": _rmse(o, o_ref), "final_state": _rmse(ht, ht_ref)}
    errors.update({name: _rmse(got, expected[name]) for name, got in zip(GRADIENTS, grads) if got is not None})
    bad = {name: f"{err:.1e}" for name, err in errors.items() if not err <= 1e-5}
    assert not bad, f"relative RMSE above 1e-5: {bad}"


EMPTY = {  # name -> _inputs arguments with nothing or next to nothing to run
    "B0": dict(batch=0, length=5),
    "T0": dict(batch=2, length=0),
    "packed-all-empty": dict(batch=1, length=0, cu_seqlens=[0, 0, 0]),
    "packed-empty-ends": dict(batch=1, length=3, cu_seqlens=[0, 0, 3, 3]),
}


@pytest.mark.parametrize("case", list(EMPTY))
@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_simple_gla"])
def test_empty_inputs_match_the_reference(sycl, op, case):
    """Zero-size batches, T = 0 and empty packed sequences, forward and backward, as the reference
    backend: the same shapes and dtypes, initial states and their gradients handed through."""
    delta = op != "chunk_simple_gla"
    x = _inputs(7, **EMPTY[case], value_heads=4 if delta else 2, delta=delta)
    results = {}
    for backend in ("reference", "sycl"):
        leaves = _op_leaves(x)
        gate_args = (leaves["g"], leaves["beta"]) if delta else (leaves["g"],)
        out, ht = getattr(torch_kernels, op)(leaves["q"], leaves["k"], leaves["v"], *gate_args, scale=x["scale"],
                                             initial_state=leaves["initial_state"], output_final_state=True,
                                             cu_seqlens=x["cu_seqlens"], implementation=backend)
        assert backends.last_backend(op) == backend
        gen = torch.Generator().manual_seed(8)
        upstream = [torch.randn(out.shape, generator=gen), torch.randn(ht.shape, generator=gen)]
        present = [t for t in leaves.values() if t is not None]
        results[backend] = [out, ht, *torch.autograd.grad([out, ht], present, upstream)]
        assert backends.last_backend(f"{op}_backward") == backend
    for i, (got, want) in enumerate(zip(results["sycl"], results["reference"])):
        assert got.shape == want.shape and got.dtype == want.dtype, i
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

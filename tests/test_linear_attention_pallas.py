"""The pallas backend of linear attention: the Pallas kernels (interpret mode) and the recurrent
form against ``recurrence_naive`` (float64, the definition), gradients against autograd through it.

Errors are relative RMSE (RMS of the difference over RMS of the truth), as fla's tests measure
them: float32 kernels within 5e-3 for outputs and final states, 8e-3 for dq, dk, dv and dh0,
2e-2 for dg and dbeta. Covers one step, lengths around the 64-step chunk, K/V off the 128 lanes,
grouped value heads, packed sequences (an empty one included), weak and strong decays, keys all
alike (where a Neumann-series inverse would cancel catastrophically), GLA with and without a gate,
gates of -1e4 and -inf at chunk and sequence edges, nothing to compute (B = 0, T = 0, no value heads,
packed sequences all empty), the ops with ``implementation="pallas"``, the TPU lowering, and
torchax tensors.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import torch_kernels
from torch_kernels import backends
from torch_kernels.reference import linear_attention as reference

from harness import assert_lowers_for_tpu, require_backend, run_isolated

pytestmark = pytest.mark.usefixtures("pallas")

OUT_TOL, GRAD_TOL, GATE_TOL = 5e-3, 8e-3, 2e-2
SCALE = 0.2


@pytest.fixture(scope="module")
def pallas():
    require_backend("pallas")


def rel_rmse(out, expected) -> float:
    out = out.detach() if isinstance(out, torch.Tensor) else torch.as_tensor(np.array(out))
    out, expected = out.double(), expected.detach().double()
    assert out.shape == expected.shape, (tuple(out.shape), tuple(expected.shape))
    return ((out - expected).square().mean().sqrt() / expected.square().mean().sqrt().clamp_min(1e-30)).item()


# (id, B, T, H, HV, K, V, cu_seqlens, decay, with initial state)
CASES = [
    ("T1", 2, 1, 2, 2, 64, 64, None, "weak", False),
    ("T63-grouped", 1, 63, 1, 2, 64, 64, None, "strong", True),
    ("T75-K60-V100-grouped", 2, 75, 2, 4, 60, 100, None, "weak", True),
    ("T130", 1, 130, 2, 2, 64, 64, None, "strong", True),
    ("T130-packed", 1, 130, 1, 2, 64, 64, (0, 1, 64, 64, 130), "weak", True),
]
CASE_IDS = [c[0] for c in CASES]


def make_inputs(seed, case, *, gated=True, delta=True, alike_keys=False):
    """float32 inputs; strong decays reach exp(-2.5) per step (exp(b) underflows within a chunk)."""
    _, b, t, h, hv, k_dim, v_dim, cu, decay, with_state = case
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, k_dim, generator=gen)
    k = torch.randn(b, t, h, k_dim, generator=gen)
    if alike_keys:
        k = k[:, :1].expand_as(k).contiguous()
    v = torch.randn(b, t, hv, v_dim, generator=gen)
    top = 2.5 if decay == "strong" else 0.05
    g = -top * torch.rand(b, t, hv, generator=gen) if gated else None
    beta = torch.rand(b, t, hv, generator=gen) if delta else None
    if alike_keys:
        beta = 0.9 + 0.1 * beta
    num_states = b if cu is None else len(cu) - 1
    h0 = torch.randn(num_states, hv, k_dim, v_dim, generator=gen) if with_state else None
    if not delta:  # linear attention's state grows with T: keep its values O(1)
        k = k / k_dim ** 0.5
    do = torch.randn(v.shape, generator=gen)
    dht = torch.randn(num_states, hv, k_dim, v_dim, generator=gen)
    return (q, k, v, g, beta, h0), do, dht


def naive(q, k, v, g, beta, h0, cu, l2norm, do, dht):
    """(o, final state, gradients of (q, k, v, g, beta, h0) for cotangents do, dht), in float64."""
    leaves = [None if x is None else x.double().requires_grad_() for x in (q, k, v, g, beta, h0)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # thousands of tiny ops: several times faster on one thread
    try:
        o, ht = reference.recurrence_naive(*leaves[:5], SCALE, leaves[5], None if cu is None else torch.tensor(cu),
                                           l2norm)
        present = [x for x in leaves if x is not None]
        grads = iter(torch.autograd.grad([o, ht], present, [do.double(), dht.double()]))
    finally:
        torch.set_num_threads(threads)
    return o, ht, [None if x is None else next(grads) for x in leaves]


@functools.lru_cache(maxsize=None)
def problem(case, *, delta=True, gated=True, alike_keys=False):
    """(inputs, do, dht, l2norm, the naive truth) for a case; cached, since the naive loop over
    time steps (with autograd) costs seconds and several tests share a problem."""
    l2norm = delta and case[0] != "T1"  # one case feeds raw keys (small enough at T=1) to the solve
    inputs, do, dht = make_inputs(1, case, gated=gated, delta=delta, alike_keys=alike_keys)
    return inputs, do, dht, l2norm, naive(*inputs, case[7], l2norm, do, dht)


def jax_vjp(fn, inputs, do, dht):
    """(o, final state, gradients) by jax.vjp of ``fn`` (through the kernels' custom_vjp)."""
    import jax
    import jax.numpy as jnp

    arrays = [None if x is None else jnp.asarray(x.numpy()) for x in inputs]
    (o, ht), vjp = jax.vjp(fn, *arrays)
    return o, ht, vjp((jnp.asarray(do.numpy()), jnp.asarray(dht.numpy())))


def assert_matches(name, o, ht, grads, want_o, want_ht, want_grads):
    errors = {"o": rel_rmse(o, want_o), "final state": rel_rmse(ht, want_ht)}
    tolerances = {"o": OUT_TOL, "final state": OUT_TOL}
    for grad_name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, want_grads):
        if want is None:
            assert got is None, grad_name
            continue
        errors[grad_name] = rel_rmse(got, want)
        tolerances[grad_name] = GATE_TOL if grad_name in ("dg", "dbeta") else GRAD_TOL
    bad = {n: f"{e:.2e} > {tolerances[n]:.0e}" for n, e in errors.items() if not e <= tolerances[n]}
    assert not bad, f"{name}: {bad}"


def _kernels():
    from jax_impl import linear_attention as kernels

    return kernels


def _offsets(case):
    return None if case[7] is None else np.array(case[7])


def assert_delta_rule_matches_naive(kernel: str, case, alike_keys: bool = False) -> None:
    """jax_impl's gated delta rule ``kernel``, output, final state and gradients, against the naive recurrence."""
    delta_rule = getattr(_kernels(), kernel)
    inputs, do, dht, l2norm, want = problem(case, alike_keys=alike_keys)

    def fn(q, k, v, g, beta, h0):
        return delta_rule(q, k, v, g, beta, SCALE, h0, _offsets(case), l2norm)

    assert_matches(case[0], *jax_vjp(fn, inputs, do, dht), *want)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_chunk_gated_delta_rule_matches_naive(case):
    assert_delta_rule_matches_naive("chunk_gated_delta_rule", case)


@pytest.mark.parametrize("case", [CASES[1], CASES[4]], ids=[CASE_IDS[1], CASE_IDS[4]])
def test_chunk_delta_rule_with_keys_all_alike(case):
    """Identical unit keys and beta near 1: (I + A)^{-1} stays small, but A's powers are huge."""
    assert_delta_rule_matches_naive("chunk_gated_delta_rule", case, alike_keys=True)


GLA_CASES = [(c, True) for c in CASES if c[3] == c[4]] + [(CASES[3], False)]  # GLA has no grouped heads


@pytest.mark.parametrize("case, gated", GLA_CASES, ids=[f"{c[0]}-{'g' if gated else 'no-g'}" for c, gated in GLA_CASES])
def test_chunk_simple_gla_matches_naive(case, gated):
    kernels = _kernels()
    (q, k, v, g, _, h0), do, dht, _, want = problem(case, delta=False, gated=gated)

    def fn(q, k, v, g, h0):
        return kernels.chunk_simple_gla(q, k, v, g, SCALE, h0, _offsets(case))

    o, ht, grads = jax_vjp(fn, (q, k, v, g, h0), do, dht)
    assert_matches(case[0], o, ht, (*grads[:4], None, grads[4]), *want)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=[CASE_IDS[0], CASE_IDS[2], CASE_IDS[4]])
def test_fused_recurrent_matches_naive(case):
    assert_delta_rule_matches_naive("fused_recurrent_gated_delta_rule", case)


def _op_grads(fn, inputs, do, dht, **kwargs):
    leaves = [None if x is None else x.clone().requires_grad_() for x in inputs]
    o, ht = fn(*leaves, output_final_state=True, **kwargs)
    present = [x for x in leaves if x is not None]
    grads = iter(torch.autograd.grad([o, ht], present, [do, dht]))
    return o, ht, [None if x is None else next(grads) for x in leaves]


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_delta_ops_run_pallas_forward_and_backward(op):
    case = CASES[4]  # packed, grouped
    cu = torch.tensor(case[7], dtype=torch.int32)
    inputs, do, dht, _, want = problem(case)
    fn = getattr(torch_kernels, op)

    def call(q, k, v, g, beta, h0, **kwargs):
        return fn(q, k, v, g, beta, scale=SCALE, initial_state=h0, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                  **kwargs)

    o, ht, grads = _op_grads(call, inputs, do, dht, implementation="pallas")
    assert backends.last_backend(op) == "pallas" and backends.last_backend(f"{op}_backward") == "pallas"
    assert o.dtype == torch.float32 and ht.dtype == torch.float32
    assert_matches(op, o, ht, grads, *want)


def test_gla_op_runs_pallas_with_and_without_gate():
    case = CASES[3]
    for gated in (True, False):
        (q, k, v, g, _, h0), do, dht, _, want = problem(case, delta=False, gated=gated)

        def call(q, k, v, g, h0, **kwargs):
            return torch_kernels.chunk_simple_gla(q, k, v, g, scale=SCALE, initial_state=h0, **kwargs)

        o, ht, grads = _op_grads(call, (q, k, v, g, h0), do, dht, implementation="pallas")
        assert backends.last_backend("chunk_simple_gla_backward") == "pallas"
        assert_matches(f"gla gated={gated}", o, ht, (*grads[:4], None, grads[4]), *want)


def test_op_backward_without_state_gradient_and_initial_state():
    """dht None (final state unused) and no initial state: the backward op's optional inputs."""
    case = CASES[1]
    (q, k, v, g, beta, _), do, _ = make_inputs(13, case)
    grads = torch.ops.torch_kernels.chunk_gated_delta_rule_backward(do, None, q, k, v, g, beta, SCALE, None, None,
                                                                    True, "pallas")
    want = torch.ops.torch_kernels.chunk_gated_delta_rule_backward(do, None, q, k, v, g, beta, SCALE, None, None,
                                                                   True, "reference")
    for name, got, w in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, want):
        assert rel_rmse(got, w) <= (GATE_TOL if name in ("dg", "dbeta") else GRAD_TOL), name


def test_float64_passes_to_the_next_backend():
    q, k, v, g, beta, _ = (None if x is None else x.double() for x in make_inputs(15, CASES[0])[0])
    o, _ = torch_kernels.chunk_gated_delta_rule(q, k, v, g, beta, implementation=["pallas", "reference"])
    assert backends.last_backend("chunk_gated_delta_rule") == "reference" and o.dtype == torch.float64
    with pytest.raises(RuntimeError, match="pallas: float64 is not supported"):
        torch_kernels.chunk_gated_delta_rule(q, k, v, g, beta, implementation="pallas")


def test_traced_offsets_are_refused():
    import jax
    import jax.numpy as jnp

    kernels = _kernels()
    x = jnp.zeros((1, 4, 1, 8))
    with pytest.raises(ValueError, match="cu_seqlens: expected concrete offsets"):
        jax.jit(lambda cu: kernels.chunk_simple_gla(x, x, x, None, 1.0, None, cu))(jnp.array([0, 4]))


@pytest.mark.parametrize("form", ["delta", "gla", "kda"])
def test_lowers_for_tpu_forward_and_backward(form):
    """Mosaic's TPU lowering on CPU: (8, 128) blocks, bf16 inputs, grouped heads (one per q/k head
    for KDA, whose decay per key channel is g [B, T, HV, K]), K=100 padded."""
    import jax
    import jax.numpy as jnp

    kernels = _kernels()
    b, t, h, hv, k_dim, v_dim = 2, 100, 1, (2 if form == "delta" else 1), 100, 64
    spec = jax.ShapeDtypeStruct
    gates = (b, t, hv, k_dim) if form == "kda" else (b, t, hv)
    shapes = [spec((b, t, h, k_dim), jnp.bfloat16), spec((b, t, h, k_dim), jnp.bfloat16),
              spec((b, t, hv, v_dim), jnp.bfloat16), spec(gates, jnp.float32),
              spec((b, t, hv), jnp.float32), spec((b, hv, k_dim, v_dim), jnp.float32)]

    def forward(q, k, v, g, beta, h0):
        if form == "gla":
            return kernels.chunk_simple_gla(q, k, v, g, None, h0, interpret=False)
        if form == "kda":
            return kernels.chunk_kda(q, k, v, g, beta, None, h0, None, True, interpret=False)
        return kernels.chunk_gated_delta_rule(q, k, v, g, beta, None, h0, None, True, interpret=False)

    def loss(*args):
        o, ht = forward(*args)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(ht ** 2)

    for fn in (forward, jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))):
        assert_lowers_for_tpu(fn, shapes)


def test_torchax_tensors_run_pallas_with_gradients():
    run_isolated(TORCHAX_CHECK)


# torchax registers a 'jax' device for the whole process (see test_ood): a process of its own
TORCHAX_CHECK = """
import pytest, torch, torch_kernels
from test_linear_attention_pallas import CASES, SCALE, problem, assert_matches

env = torch_kernels.torchax_environment()
case = CASES[4]
(q, k, v, g, beta, h0), do, dht, _, want = problem(case)
cu = torch.tensor(case[7])
with env:
    for op in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        for implementation in ("pallas", "reference"):
            leaves = [t.to("jax").requires_grad_() for t in (q, k, v, g, beta, h0)]
            o, ht = getattr(torch_kernels, op)(*leaves[:5], scale=SCALE, initial_state=leaves[5],
                                                output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                cu_seqlens=cu.to("jax"), implementation=implementation)
            assert type(o).__module__.startswith("torchax"), type(o)
            torch.autograd.backward([o, ht], [do.to("jax"), dht.to("jax")])
            grads = [t.grad.to("cpu") for t in leaves]
            assert_matches(f"torchax {op} {implementation}", o.detach().to("cpu"), ht.detach().to("cpu"), grads,
                           *want)
    # the dispatcher's own call, trailing defaults left out
    jq, jk, jv = (t.to("jax").requires_grad_() for t in (q, k, v[:, :, :1]))
    o, ht = torch.ops.torch_kernels.chunk_simple_gla(jq, jk, jv, None, SCALE)
    o.sum().backward()
    assert tuple(jq.grad.shape) == tuple(q.shape) and tuple(ht.shape) == (1, 1, 64, 64)
    with pytest.raises(ValueError, match="cu_seqlens: expected to end at the time length"):
        torch_kernels.chunk_gated_delta_rule(jq, jk, v.to("jax"), g.to("jax"), beta.to("jax"),
                                             cu_seqlens=torch.tensor([0, 5]).to("jax"))
    with pytest.raises(NotImplementedError, match="torchax tensors run"):
        torch_kernels.chunk_simple_gla(jq, jk, jv, implementation="triton")
    # Kimi Delta Attention (g per key channel) against its float64 definition: the step form with
    # gradients, the chunked form's forward (its gradients take the custom_vjp checked above for
    # Gated DeltaNet, and test_linear_attention_kda checks their numbers)
    import test_linear_attention_kda as kda
    x = kda.make_inputs(length=20, heads=2, k_dim=8, v_dim=8, cu_seqlens=[0, 7, 20])
    names = ("q", "k", "v", "g", "beta", "initial_state")
    want_leaves = {n: x[n].double().requires_grad_() for n in names}
    want_o, want_ht = kda.definition({**x, **want_leaves})
    torch.autograd.backward([want_o, want_ht], [torch.ones_like(want_o), torch.ones_like(want_ht)])
    for op in ("fused_recurrent_kda", "chunk_kda"):
        leaves = {n: x[n].to("jax").requires_grad_() for n in names}
        o, ht = getattr(torch_kernels, op)(**{**x, **leaves, "cu_seqlens": x["cu_seqlens"].to("jax")},
                                           output_final_state=True, implementation="pallas")
        assert type(o).__module__.startswith("torchax"), type(o)
        checks = [("o", o.detach().to("cpu"), want_o), ("final_state", ht.detach().to("cpu"), want_ht)]
        if op == "fused_recurrent_kda":
            torch.autograd.backward([o, ht], [torch.ones_like(o), torch.ones_like(ht)])
            checks += [(f"d{n}", leaves[n].grad.to("cpu"), want_leaves[n].grad) for n in names]
        for name, got, want in checks:
            assert kda.relative_rmse(got, want) <= 1e-5, f"{op} {name}"
print("torchax ok")
"""


# (id, B, T, value heads, cu_seqlens, with initial state): nothing to run, or sequences of no steps
EMPTY = [
    ("B0", 0, 5, 2, None, True),
    ("B0-T0-no-state", 0, 0, 2, None, False),
    ("T0", 2, 0, 2, None, True),
    ("no-value-heads", 1, 5, 0, None, True),
    ("packed-all-empty-no-state", 1, 0, 2, (0, 0, 0), False),
    ("packed-some-empty", 1, 9, 2, (0, 0, 4, 4, 9, 9), True),
]
OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_simple_gla")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", EMPTY, ids=[c[0] for c in EMPTY])
def test_empty_batches_and_sequences_match_the_reference(case, op):
    """Forward and backward as the reference: empty outputs, and a sequence of no steps hands its
    initial state (or zeros) through, and dht back to dh0, bit for bit. The interpreter raises on
    any out-of-bounds read (B = 0 once indexed the empty per-chunk lists)."""
    _, b, t, hv, cu, with_state = case
    if op == "chunk_simple_gla" and hv == 0:
        pytest.skip("chunk_simple_gla has one value head per head")
    h = max(hv, 1)  # as many heads as value heads (as GLA needs), and one where there are none
    gen = torch.Generator().manual_seed(21)
    num_states = b if cu is None else len(cu) - 1
    inputs = dict(q=torch.randn(b, t, h, 8, generator=gen), k=torch.randn(b, t, h, 8, generator=gen) / 8 ** 0.5,
                  v=torch.randn(b, t, hv, 8, generator=gen), g=-torch.rand(b, t, hv, generator=gen),
                  initial_state=torch.randn(num_states, hv, 8, 8, generator=gen) if with_state else None)
    if op != "chunk_simple_gla":
        inputs["beta"] = torch.rand(b, t, hv, generator=gen)
    do, dht = torch.randn(b, t, hv, 8, generator=gen), torch.randn(num_states, hv, 8, 8, generator=gen)
    offsets = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    fn = getattr(torch_kernels, op)

    def run(implementation):
        leaves = {n: x.clone().requires_grad_() for n, x in inputs.items() if x is not None}
        o, ht = fn(**leaves, scale=SCALE, cu_seqlens=offsets, output_final_state=True, implementation=implementation)
        used = [(x, dx) for x, dx in ((o, do), (ht, dht)) if x.requires_grad]  # T = 0, no state: ht is not
        grads = torch.autograd.grad([x for x, _ in used], list(leaves.values()), [dx for _, dx in used],
                                    allow_unused=True, materialize_grads=True)
        return o, ht, dict(zip(leaves, grads))

    o, ht, grads = run("pallas")
    assert backends.last_backend(op) == "pallas" and backends.last_backend(f"{op}_backward") == "pallas"
    want_o, want_ht, want_grads = run("reference")
    assert o.shape == want_o.shape and ht.shape == want_ht.shape
    for name, got, want in [("o", o, want_o), ("final state", ht, want_ht)] + [(n, grads[n], want_grads[n])
                                                                             for n in want_grads]:
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert torch.isfinite(got).all() and (got.numel() == 0 or rel_rmse(got, want) <= 1e-5), name
    spans = [(0, t)] * b if cu is None else list(zip(cu[:-1], cu[1:]))
    for n, (start, end) in enumerate(spans):
        if start == end:
            assert torch.equal(ht[n], inputs["initial_state"][n] if with_state else torch.zeros_like(ht[n]))
            if with_state:
                assert torch.equal(grads["initial_state"][n], dht[n])


@pytest.mark.parametrize("form", ["delta", "gla"])
def test_empty_batch_in_jax(form):
    """B = 0 through jax.vjp (the kernels' custom_vjp, which torchax uses): empty results."""
    import jax
    import jax.numpy as jnp

    kernels = _kernels()
    q, v, gate = jnp.zeros((0, 3, 1, 8)), jnp.zeros((0, 3, 1, 8)), jnp.zeros((0, 3, 1))
    h0 = jnp.zeros((0, 1, 8, 8))
    if form == "delta":
        fn = functools.partial(kernels.chunk_gated_delta_rule, beta=gate, scale=SCALE)
    else:
        fn = functools.partial(kernels.chunk_simple_gla, scale=SCALE)
    (o, ht), vjp = jax.vjp(lambda q, k, v, g, h0: fn(q, k, v, g, initial_state=h0), q, q, v, gate, h0)
    assert o.shape == v.shape and ht.shape == h0.shape
    assert [x.shape for x in vjp((o, ht))] == [q.shape, q.shape, v.shape, gate.shape, h0.shape]


def spiky_gates(length, value_heads, spike):
    """-0.1 per step, ``spike`` on the first and last steps of chunks and packed sequences."""
    g = torch.full((1, length, value_heads), -0.1)
    g[:, [0, 1, 5, 63, 64, 100, 127, 129]] = spike
    return g


@pytest.mark.parametrize("spike", [-1e4, float("-inf")], ids=["g-1e4", "g-inf"])
@pytest.mark.parametrize("form", ["delta", "gla"])
def test_extreme_gates_across_chunks_and_sequences(form, spike):
    """Gates of -1e4 and -inf (a full reset) at chunk and packed-sequence edges, over three chunks
    with grouped value heads: outputs and gradients within float32 rounding of the definition."""
    case = CASES[4]  # T = 130 packed as (0, 1, 64, 64, 130)
    kernels = _kernels()
    (q, k, v, _, beta, h0), do, dht = make_inputs(31, case, delta=form == "delta")
    g = spiky_gates(case[2], case[4], spike)
    if form == "gla":  # one value head per head
        q, k = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
    inputs = (q, k, v, g, beta, h0)
    want = naive(*inputs, case[7], form == "delta", do, dht)

    if form == "delta":
        def fn(q, k, v, g, beta, h0):
            return kernels.chunk_gated_delta_rule(q, k, v, g, beta, SCALE, h0, _offsets(case), True)
        o, ht, grads = jax_vjp(fn, inputs, do, dht)
    else:
        def fn(q, k, v, g, h0):
            return kernels.chunk_simple_gla(q, k, v, g, SCALE, h0, _offsets(case))
        o, ht, grads = jax_vjp(fn, (q, k, v, g, h0), do, dht)
        grads = (*grads[:4], None, grads[4])
    errors = {"o": rel_rmse(o, want[0]), "final state": rel_rmse(ht, want[1])}
    for name, got, w in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, want[2]):
        if w is not None:
            errors[name] = rel_rmse(got, w)
    bad = {n: f"{e:.1e}" for n, e in errors.items() if not e <= 1e-5}
    assert not bad, f"relative RMSE above 1e-5: {bad}"

"""The linear-attention ops (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
chunk_simple_gla) through their public API on every backend, against the naive float64 recurrence
(``recurrence_naive``, the definition) and autograd through it.

Errors are relative RMSE (RMS of the difference over RMS of the truth). Bounds in float32: 5e-3
for outputs and final states, 8e-3 for dq, dk, dv, dh0, 2e-2 for dg and dbeta; every backend is
held to a tenth of that here (measured errors are about 1e-6). Then what a user relies on beyond
the math: packed sequences equal separate runs, a state handed over between two halves equals one
run, a decode step continues a chunked prefill, long sequences stay finite, and the op contract
(opcheck, torch.compile of a Gated DeltaNet layer forward and backward, profiler names, FLOP
counts, checked inputs; bad values in the deferred check mode, Kimi Delta Attention's two ops
included).
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_kernels
from harness import (
    FLOAT32_BYTES, HostReads, assert_compiled_matches_eager, backend_params, counted_flops, nbytes, only_row,
    profiled, profiled_names, random_tensor, require_backend, run_opcheck,
)
from torch_kernels import backends
from torch_kernels.ops import linear_attention as family_ops
from torch_kernels.reference import linear_attention as reference

CHUNK_DELTA, RECURRENT_DELTA, CHUNK_GLA = "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_simple_gla"
OPS = (CHUNK_DELTA, RECURRENT_DELTA, CHUNK_GLA)
BOUNDS = {"o": 5e-3, "final_state": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 8e-3, "dg": 2e-2, "dbeta": 2e-2}
MARGIN = 0.1  # every backend is held to this fraction of the bounds
LEAVES = ("q", "k", "v", "g", "beta", "initial_state")
GRAD_NAMES = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}


def relative_rmse(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.detach().double(), expected.detach().double()
    return ((out - expected).square().mean().sqrt() / expected.square().mean().sqrt().clamp_min(1e-30)).item()


def make_inputs(op, *, batch=1, length=75, heads=2, value_heads=None, k_dim=32, v_dim=32, decay="weak",
                initial_state=True, l2norm=True, cu_seqlens=None, seed=0, dtype=torch.float32):
    """Keyword arguments of ``op``; without the in-op l2 norm the delta rule's keys come
    normalized (as a model feeds them, else the recurrence diverges), and linear attention's keys
    are scaled down so that its growing state stays O(1)."""
    delta = op != CHUNK_GLA
    value_heads = value_heads or heads
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, k_dim, generator=gen)
    k = torch.randn(batch, length, heads, k_dim, generator=gen)
    if not (delta and l2norm):
        k = k / k.norm(dim=-1, keepdim=True) if delta else k * k_dim ** -0.5
    v = torch.randn(batch, length, value_heads, v_dim, generator=gen)
    gate = (batch, length, value_heads)
    g = {"weak": lambda: -0.02 * torch.rand(gate, generator=gen), None: lambda: None if not delta else torch.zeros(gate),
         "strong": lambda: -5.0 * (0.5 + torch.rand(gate, generator=gen))}[decay]()
    num_states = batch if cu_seqlens is None else len(cu_seqlens) - 1
    x = dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, scale=k_dim ** -0.5,
             initial_state=torch.randn(num_states, value_heads, k_dim, v_dim, generator=gen) if initial_state else None,
             cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32))
    if delta:
        x.update(beta=torch.rand(gate, generator=gen), use_qk_l2norm_in_kernel=l2norm)
    return x


def run_op(op, x, **extra):
    """(o, final_state) of the public op on inputs ``x``."""
    return getattr(torch_kernels, op)(**x, output_final_state=True, **extra)


def definition(op, x):
    """(o, final state) by the naive recurrence in float64, leaves kept for autograd."""
    cast = {n: x[n].double() if n in LEAVES and x.get(n) is not None else x.get(n) for n in x}
    return reference.recurrence_naive(cast["q"], cast["k"], cast["v"], cast["g"], cast.get("beta"), x["scale"],
                                      cast["initial_state"], x["cu_seqlens"], x.get("use_qk_l2norm_in_kernel", False))


def with_grads(x):
    """A copy of ``x`` whose differentiable inputs require grad: (copy, {name: leaf})."""
    leaves = {n: x[n].detach().clone().requires_grad_() for n in LEAVES if x.get(n) is not None}
    return {**x, **leaves}, leaves


def errors_against_definition(op, x, backend, truth=None):
    """Relative RMSE of o, the final state and every gradient, the op on ``backend`` vs the definition
    (``truth(inputs)``, else ``recurrence_naive`` in float64)."""
    got_x, got_leaves = with_grads(x)
    o, ht = run_op(op, got_x, implementation=backend)
    assert backends.last_backend(op) == backend
    gen = torch.Generator().manual_seed(1)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    grads = torch.autograd.grad([o, ht], list(got_leaves.values()), [do.to(o.dtype), dht])
    assert backends.last_backend(f"{op}_backward") == backend
    want_x, want_leaves = with_grads(x)
    want_o, want_ht = definition(op, want_x) if truth is None else truth(want_x)
    want_grads = torch.autograd.grad([want_o, want_ht], list(want_leaves.values()), [do.double(), dht.double()])
    assert o.shape == x["v"].shape and o.dtype == x["v"].dtype and ht.dtype == torch.float32
    errors = {"o": relative_rmse(o, want_o), "final_state": relative_rmse(ht, want_ht)}
    for name, got, want in zip(got_leaves, grads, want_grads):
        assert got.shape == want.shape and got.dtype == got_leaves[name].dtype, name
        errors[GRAD_NAMES[name]] = relative_rmse(got, want)
    return errors


def assert_within(errors, margin=MARGIN):
    bad = {n: f"{e:.2e} > {BOUNDS[n] * margin:.1e}" for n, e in errors.items() if not e <= BOUNDS[n] * margin}
    assert not bad, f"relative RMSE: {bad} (all: { {n: f'{e:.1e}' for n, e in errors.items()} })"


# Odd lengths around the 64-step chunk, K = 60 / V = 100, grouped value heads, packed sequences
# (an empty one included), weak, strong and no decay, with and without the in-op l2 norm.
CASES = {
    "T1": dict(length=1, batch=2),
    "T63-K60-V100-strong": dict(length=63, heads=1, k_dim=60, v_dim=100, decay="strong", l2norm=False),
    "T75-grouped-packed": dict(length=75, heads=1, value_heads=2, cu_seqlens=[0, 11, 11, 75]),
    "T130-no-decay-no-state": dict(length=130, heads=1, decay=None, initial_state=False),
}


def _case(op, name, **changes):
    spec = {**CASES[name], **changes}
    if op == CHUNK_GLA:
        spec.pop("value_heads", None)  # one value head per head
    return make_inputs(op, **spec)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backend_params(CHUNK_DELTA))
def test_matches_definition(backend, op, case):
    require_backend(backend)
    assert_within(errors_against_definition(op, _case(op, case), backend))


@pytest.mark.parametrize("op", OPS)
def test_long_odd_length_on_the_cpu_default(op):
    """T = 500 with K = 60, V = 100 (the other backends meet these shapes in their own tests)."""
    x = make_inputs(op, length=500, heads=1, value_heads=2 if op != CHUNK_GLA else None, k_dim=60, v_dim=100)
    assert_within(errors_against_definition(op, x, "reference"))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backend_params(CHUNK_DELTA))
def test_packed_equals_separate(backend, op):
    """Packed sequences (B = 1, cu_seqlens) equal each one run alone, outputs concatenated."""
    require_backend(backend)
    lens = [5, 0, 70, 33]
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    packed = make_inputs(op, length=cu[-1], cu_seqlens=cu, seed=3)
    o, ht = run_op(op, packed, implementation=backend)
    for i, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        alone = {**packed, "cu_seqlens": None, "initial_state": packed["initial_state"][i:i + 1]}
        for n in ("q", "k", "v", "g", "beta"):
            if alone.get(n) is not None:
                alone[n] = alone[n][:, start:end]
        if start == end:  # an empty sequence hands its initial state through
            assert torch.equal(ht[i], packed["initial_state"][i])
            continue
        o_i, ht_i = run_op(op, alone, implementation=backend)
        torch.testing.assert_close(o[:, start:end], o_i, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ht[i:i + 1], ht_i, rtol=1e-5, atol=1e-5)


def _halves(x, cut):
    first, second = dict(x), dict(x)
    for n in ("q", "k", "v", "g", "beta"):
        if x.get(n) is not None:
            first[n], second[n] = x[n][:, :cut], x[n][:, cut:]
    return first, second


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backend_params(CHUNK_DELTA))
def test_state_carried_between_halves(backend, op):
    """Two calls with the first's final state as the second's initial state equal one call, and
    the gradient flows back through the handed-over state: for the chunked ops a cut inside the
    first of two chunks, for the step-by-step op (whose time grows with every step) a short run."""
    require_backend(backend)
    length, cut = (24, 9) if op == RECURRENT_DELTA else (90, 37)
    x = make_inputs(op, batch=2, length=length, seed=4)
    whole_x, whole_leaves = with_grads(x)
    o, ht = run_op(op, whole_x, implementation=backend)
    split_x, split_leaves = with_grads(x)
    first, second = _halves(split_x, cut)
    o1, ht1 = run_op(op, first, implementation=backend)
    o2, ht2 = run_op(op, {**second, "initial_state": ht1}, implementation=backend)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht2, ht, rtol=1e-5, atol=1e-5)
    gen = torch.Generator().manual_seed(5)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    whole = torch.autograd.grad([o, ht], list(whole_leaves.values()), [do, dht])
    split = torch.autograd.grad([o1, o2, ht2], list(split_leaves.values()), [do[:, :cut], do[:, cut:], dht])
    for name, a, b in zip(whole_leaves, whole, split):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("backend", backend_params(CHUNK_DELTA))
def test_decode_step_continues_the_chunked_prefill(backend):
    """A prompt through chunk_gated_delta_rule, then one token through the recurrent form from
    its final state: the token's output equals the chunked form's over prompt + token."""
    require_backend(backend)
    x = make_inputs(CHUNK_DELTA, length=70, heads=1, value_heads=2, seed=6)
    prompt, token = _halves(x, 69)
    _, state = run_op(CHUNK_DELTA, prompt, implementation=backend)
    o_step, ht_step = run_op(RECURRENT_DELTA, {**token, "initial_state": state}, implementation=backend)
    o_all, ht_all = run_op(CHUNK_DELTA, x, implementation=backend)
    torch.testing.assert_close(o_step, o_all[:, 69:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht_step, ht_all, rtol=1e-5, atol=1e-5)


def spiky_gate(length, heads, spike, every=7):
    """-0.1 per step, ``spike`` on every ``every``-th step: real gates (``-exp(A_log) *
    softplus(...)``) reach -1e4, and -inf is a full state reset."""
    g = torch.full((1, length, heads), -0.1)
    g[:, every - 1::every] = spike
    return g


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("spike", [-50.0, -1e4, float("-inf")], ids=["g-50", "g-1e4", "g-inf"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backend_params(CHUNK_DELTA))
def test_strong_decay_keeps_float32_precision(backend, op, spike):
    """Cumulative gates that grow large must not cancel: the chunked forms once took exp of
    differences of cumulative sums, ~3e-3 off at g = -1e4 and NaN at -inf. T = 64, K = 32,
    beta = 1, against the float64 recurrence, outputs and every gradient."""
    require_backend(backend)
    x = make_inputs(op, length=64, heads=1, k_dim=32, v_dim=32, l2norm=False, seed=8)
    x["g"] = spiky_gate(64, 1, spike)
    if op != CHUNK_GLA:
        x["beta"] = torch.ones_like(x["g"])
    errors = errors_against_definition(op, x, backend)
    bad = {n: f"{e:.1e}" for n, e in errors.items() if not e <= 1e-5}
    assert not bad, f"relative RMSE above 1e-5: {bad}"


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("where", ["q", "v", "g"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backend_params(CHUNK_DELTA))
def test_nan_propagates_within_its_sequence_and_head_only(backend, op, where):
    """The NaN policy (README): a NaN in q_t makes o_t NaN; one in k_t, v_t, g_t or beta_t makes
    the state NaN from step t on (later outputs, the final state). Other packed sequences and
    other heads are untouched, and so are the outputs of earlier chunks (within step t's chunk the
    chunked forms may spread it back through zero weights)."""
    require_backend(backend)
    x = make_inputs(op, length=150, heads=2, k_dim=16, v_dim=16, cu_seqlens=[0, 20, 150], seed=9)
    clean_o, clean_ht = run_op(op, x, implementation=backend)
    step, head = 100, 1  # step 80 of the second sequence, its second chunk
    bad = {**x, where: x[where].clone()}
    bad[where][0, step, head] = math.nan
    o, ht = run_op(op, bad, implementation=backend)
    value_head = head  # one value head per head here
    same = torch.ones(o.shape[:3], dtype=torch.bool)
    same[0, 20 + 64:, value_head] = False  # from the start of step 100's chunk on
    torch.testing.assert_close(o[same.nonzero(as_tuple=True)], clean_o[same.nonzero(as_tuple=True)])
    torch.testing.assert_close(ht[0], clean_ht[0])
    torch.testing.assert_close(ht[1, 1 - value_head], clean_ht[1, 1 - value_head])
    assert o[0, step, value_head].isnan().all()
    if where == "q":
        torch.testing.assert_close(o[0, step + 1:, value_head], clean_o[0, step + 1:, value_head])
        torch.testing.assert_close(ht[1, value_head], clean_ht[1, value_head])
    else:
        assert o[0, step:, value_head].isnan().all() and ht[1, value_head].isnan().all()


# offsets of three packed sequences over T = 24 that do not add up, and the full mode's message
BAD_OFFSETS = {"decreasing": ([0, 15, 9, 24], "cu_seqlens: expected non-decreasing offsets"),
               "not from 0": ([2, 9, 15, 24], "cu_seqlens: expected to start at 0"),
               "not to T": ([0, 9, 15, 20], "cu_seqlens: expected to end at the time length T=24")}


def _deferred_case(op):
    """Keyword arguments of ``op`` for three packed sequences (T = 24, K = V = 16; the delta rule's
    q, k l2-normalized in the op), the tensors leaves requiring grad, and the good offsets."""
    delta = op != CHUNK_GLA
    *tensors, h0, cu = family_ops.linear_attention_inputs(
        torch.Generator().manual_seed(12), torch.float32, "cpu", delta, cu_seqlens=(0, 9, 15, 24), heads=(1, 2),
        k_dim=16, v_dim=16, per_channel=op in family_ops.PER_CHANNEL_OPS)
    x = {name: t.requires_grad_() for name, t in zip(("q", "k", "v", "g", "beta"), tensors)}
    l2norm = {"use_qk_l2norm_in_kernel": True} if delta else {}
    return {**x, "initial_state": h0.requires_grad_(), "scale": 0.25, **l2norm}, cu


@pytest.mark.parametrize("op", family_ops.OPS)
@pytest.mark.parametrize("backend", backend_params(CHUNK_DELTA, skip={
    "pallas": "the checks are the op layer's, shared by every backend, and pallas' interpreted kernels take 10 s per "
              "op here"}))
def test_deferred_mode_makes_bad_offsets_nan_and_keeps_a_positive_gate(backend, op):
    """In the deferred check mode a bad value raises nothing at the call, and on Triton (the
    accelerator's path) nothing is read on the host: offsets that do not add up make o, the final
    states and every gradient NaN (the sequences' rows cannot be told apart); a positive g is used
    as given (as the definition does). ``raise_deferred_errors()`` then raises the full mode's
    error, less the value."""
    require_backend(backend)
    x, _ = _deferred_case(op)
    leaves = {name: t for name, t in x.items() if isinstance(t, torch.Tensor)}
    for case, (offsets, message) in BAD_OFFSETS.items():
        with torch_kernels.checks("deferred"), HostReads() as guard:
            o, ht = getattr(torch_kernels, op)(**x, output_final_state=True, implementation=backend,
                                               cu_seqlens=torch.tensor(offsets, dtype=torch.int32))
            grads = torch.autograd.grad([o, ht], list(leaves.values()), [torch.ones_like(o), torch.ones_like(ht)])
        assert backend != "triton" or not guard.reads, f"{case}: read on the host: {guard.reads}"
        for name, t in (("o", o), ("final_state", ht), *zip(leaves, grads)):
            assert t.isnan().all(), f"{case}: {name} is not all NaN"
        with pytest.raises(ValueError, match=f"^{re.escape(message)} \\(found by a deferred check\\)$"):
            torch_kernels.raise_deferred_errors()
    x, cu = _deferred_case(op)
    g = x["g"].detach().clone()
    g[0, 3, 0] = 0.5
    with torch_kernels.checks("deferred"):
        o, ht = getattr(torch_kernels, op)(**{**x, "g": g}, output_final_state=True, cu_seqlens=cu,
                                           implementation=backend)
    with pytest.raises(ValueError, match=r"^g: expected log decays <= 0 .* \(found by a deferred check\)$"):
        torch_kernels.raise_deferred_errors()
    cast = {n: t.detach().double() for n, t in x.items() if isinstance(t, torch.Tensor)}
    want_o, want_ht = reference.recurrence_naive(cast["q"], cast["k"], cast["v"], g.double(), cast.get("beta"), 0.25,
                                                 cast["initial_state"], cu, op != CHUNK_GLA)
    torch.testing.assert_close(o, want_o.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ht, want_ht.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("op", [CHUNK_DELTA, CHUNK_GLA])
def test_long_sequence_stays_finite(op):
    """T = 8192, strong decays and none, forward and backward on the CPU default."""
    for decay in ("strong", None):
        x, leaves = with_grads(make_inputs(op, length=8192, heads=1, k_dim=16, v_dim=16, decay=decay, seed=7))
        o, ht = run_op(op, x)
        (o.square().sum() + ht.sum()).backward()
        for name, t in {"o": o, "final_state": ht, **{GRAD_NAMES[n]: leaf.grad for n, leaf in leaves.items()}}.items():
            assert torch.isfinite(t).all(), f"{decay} decay: {name} not finite"
        assert o.abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    """16-bit q, k, v: the state and arithmetic stay float32; against the definition on the same
    rounded inputs."""
    x = make_inputs(CHUNK_DELTA, length=75, dtype=dtype)
    errors = errors_against_definition(CHUNK_DELTA, x, "reference")
    assert_within({n: e for n, e in errors.items() if n != "o"}, margin=1.0)
    assert errors["o"] <= (2e-3 if dtype == torch.float16 else 1e-2)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", backend_params(CHUNK_DELTA))
def test_float16_inputs_give_float16_outputs(backend, op):
    """The output takes v's dtype and the state stays float32, on every backend."""
    require_backend(backend)
    x = make_inputs(op, length=20, heads=1, k_dim=16, v_dim=16, dtype=torch.float16)
    o, ht = run_op(op, x, implementation=backend)
    assert (o.dtype, ht.dtype) == (torch.float16, torch.float32)
    want, _ = definition(op, x)
    assert relative_rmse(o, want) <= 2e-3


@pytest.mark.parametrize("op", OPS)
def test_gradcheck_in_float64(op):
    x = make_inputs(op, length=9, heads=1, value_heads=2 if op != CHUNK_GLA else None, k_dim=4, v_dim=3,
                    cu_seqlens=[0, 4, 9], dtype=torch.float64)
    x = {n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in x.items()}
    x, leaves = with_grads(x)
    names = list(leaves)

    def fn(*tensors):
        return run_op(op, {**x, **dict(zip(names, tensors))})

    assert torch.autograd.gradcheck(fn, tuple(leaves.values()))


def _opcheck_args(op, backend):
    x = make_inputs(op, length=20, heads=1, value_heads=2 if op != CHUNK_GLA else None, k_dim=8, v_dim=8,
                    cu_seqlens=[0, 7, 20])
    x, _ = with_grads(x)
    tensors = [x["q"], x["k"], x["v"], x["g"]] + ([x["beta"]] if op != CHUNK_GLA else [])
    flags = [x["use_qk_l2norm_in_kernel"]] if op != CHUNK_GLA else []
    return (*tensors, x["scale"], x["initial_state"], x["cu_seqlens"], *flags, backend)


@pytest.mark.parametrize("op", OPS)
def test_opcheck(op):
    run_opcheck(getattr(torch.ops.torch_kernels, op).default, _opcheck_args(op, "reference"))


class GatedDeltaNet(nn.Module):
    """A Qwen3-Next-style Gated DeltaNet layer: projections, a causal depthwise conv1d with SiLU
    over q, k, v, the op (l2 norm in it), a gated RMSNorm and the output projection."""

    def __init__(self, hidden=64, heads=2, value_heads=4, k_dim=16, v_dim=16, conv=4):
        super().__init__()
        self.heads, self.value_heads, self.k_dim, self.v_dim = heads, value_heads, k_dim, v_dim
        self.qkv_size = 2 * heads * k_dim + value_heads * v_dim
        self.in_proj = nn.Linear(hidden, self.qkv_size + value_heads * v_dim + 2 * value_heads, bias=False)
        self.conv = nn.Conv1d(self.qkv_size, self.qkv_size, conv, groups=self.qkv_size, padding=conv - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(value_heads))
        self.a_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, value_heads)))
        self.norm_weight = nn.Parameter(torch.ones(v_dim))
        self.out_proj = nn.Linear(value_heads * v_dim, hidden, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        qkv, z, b_proj, a_proj = self.in_proj(x).split(
            [self.qkv_size, self.value_heads * self.v_dim, self.value_heads, self.value_heads], dim=-1)
        qkv = F.silu(self.conv(qkv.transpose(1, 2))[..., :t].transpose(1, 2))
        q, k, v = qkv.split([self.heads * self.k_dim, self.heads * self.k_dim, self.value_heads * self.v_dim], -1)
        q, k = q.view(b, t, self.heads, self.k_dim), k.view(b, t, self.heads, self.k_dim)
        v = v.view(b, t, self.value_heads, self.v_dim)
        g = -self.a_log.exp() * F.softplus(a_proj + self.dt_bias)
        o, _ = torch_kernels.chunk_gated_delta_rule(q, k, v, g, b_proj.sigmoid(), use_qk_l2norm_in_kernel=True)
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        o = o * F.silu(z.view(b, t, self.value_heads, self.v_dim))
        return self.out_proj(o.reshape(b, t, -1))


def test_compile_fullgraph_gated_deltanet_layer():
    torch.manual_seed(0)
    layer = GatedDeltaNet()
    x = torch.randn(2, 70, 64)
    assert_compiled_matches_eager(layer, x)


@pytest.mark.parametrize("op", OPS)
def test_profiler_names_op_and_backend(op):
    x, _ = with_grads(make_inputs(op, length=10, heads=1, k_dim=8, v_dim=8))

    def step():
        o, ht = run_op(op, x)
        (o.sum() + ht.sum()).backward()

    names = profiled_names(step)
    for wanted in (f"torch_kernels::{op}", f"torch_kernels::{op}_backward"):
        assert any(wanted in n for n in names), f"{wanted} not among {sorted(set(names))[:20]}"


@pytest.mark.parametrize("op", OPS)
def test_flop_counter_counts_the_op(op):
    x = make_inputs(op, batch=2, length=10, heads=1, value_heads=2 if op != CHUNK_GLA else None, k_dim=8, v_dim=4)
    per_step = (6 if op != CHUNK_GLA else 4) * 8 * 4
    assert counted_flops(lambda: run_op(op, x)) == 2 * 10 * x["v"].shape[2] * per_step


def test_default_scale_and_optional_final_state():
    x = make_inputs(CHUNK_DELTA, length=12)
    o, ht = torch_kernels.chunk_gated_delta_rule(**{**x, "scale": None})
    assert ht is None
    torch.testing.assert_close(o, run_op(CHUNK_DELTA, {**x, "scale": 32 ** -0.5})[0])


# ---- the byte formula, against counts made here ----

def test_linear_attention_bytes_are_every_input_and_output():
    batch, length, heads, k_dim, v_dim = 1, 9, 2, 8, 4
    q, k = random_tensor(batch, length, heads, k_dim, seed=8), random_tensor(batch, length, heads, k_dim, seed=9)
    v = random_tensor(batch, length, heads, v_dim, seed=10)
    g = -0.1 * torch.rand(batch, length, heads, generator=torch.Generator().manual_seed(11))
    prof, (o, _) = profiled(lambda: torch_kernels.chunk_simple_gla(q, k, v, g, output_final_state=True))
    state = batch * heads * k_dim * v_dim * FLOAT32_BYTES  # the final state, float32, always written
    assert only_row(prof, "chunk_simple_gla")["bytes"] == nbytes(q, k, v, g, o) + state

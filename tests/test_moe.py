"""The moe family (router_topk, moe_dispatch, grouped_mm, moe_combine, fused_moe) through the
public API on every backend, against the readable definitions in ``reference.moe`` (loops over
experts) and ``torch.nn.functional.grouped_mm``; gradients against autograd through the
definitions, by relative RMSE; then the op contract (gradcheck, opcheck, torch.compile of an MoE
layer forward and backward, profiler names, FLOP counts).

Routings are random and deliberately uneven: skewed (most tokens to a few experts), uniform, all
tokens to one expert, empty experts, dropped slots (id -1), k from 1 to 8, E up to 128, odd H and I.
The router's choice rule (ties, signed zeros, probabilities that underflowed, NaN and infinite
logits) is held against a plain-loop definition on every backend and in the jnp reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_kernels
from harness import (
    FLOAT32_BYTES, HostReads, assert_close, assert_compiled_matches_eager, backend_params, counted_flops, nbytes,
    only_row, profiled, profiled_names, random_tensor, require_backend, run_opcheck,
)
from torch_kernels import backends
from torch_kernels.reference import moe as reference
from torch_kernels.selftest import TOLERANCES, relative_error

BACKENDS = backend_params("fused_moe")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def relative_rmse(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    if want.numel() == 0:
        return 0.0
    return ((got - want).square().mean().sqrt() / want.square().mean().sqrt().clamp_min(1e-30)).item()


def make_routing(kind: str, tokens: int, experts: int, k: int, gen) -> torch.Tensor:
    """int32 ``[T, k]`` expert ids, distinct per token, of the given ``kind``."""
    if kind == "uniform":
        scores = torch.rand(tokens, experts, generator=gen)
    elif kind == "skewed":  # a few popular experts
        scores = torch.rand(tokens, experts, generator=gen) * torch.logspace(0, -3, experts)
    elif kind == "one expert":  # every token's first choice is expert 0
        scores = torch.rand(tokens, experts, generator=gen)
        scores[:, 0] = 2.0
    else:  # "dropped": uniform, then some slots dropped (-1)
        scores = torch.rand(tokens, experts, generator=gen)
    ids = scores.topk(k, dim=-1).indices.to(torch.int32)
    if kind == "dropped":
        ids[torch.rand(tokens, k, generator=gen) < 0.3] = -1
    return ids


def make_layer(tokens=13, hidden=33, inter=20, experts=6, k=2, kind="skewed", dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    ids = make_routing(kind, tokens, experts, k, gen)
    weights = torch.rand(tokens, k, generator=gen).softmax(dim=-1)
    return x, w13, w2, weights, ids


ROUTINGS = ["skewed", "uniform", "one expert", "dropped"]
SHAPES = {  # (tokens, hidden, inter, experts, k)
    "small odd": (13, 33, 20, 6, 2),
    "k1": (9, 16, 8, 4, 1),
    "k8 many experts": (10, 24, 12, 128, 8),
    "one token": (1, 40, 24, 8, 3),
    "no tokens": (0, 16, 8, 4, 2),
}


# ---- router_topk ----

ROUTER_CASES = {
    "softmax renormalized": dict(scoring="softmax", renormalize=True),
    "softmax raw": dict(scoring="softmax", renormalize=False),
    "deepseek groups": dict(scoring="sigmoid", renormalize=True, num_expert_groups=8, topk_groups=4,
                            routed_scaling_factor=2.5),
    "sigmoid with bias, no groups": dict(scoring="sigmoid", renormalize=False),
}


@pytest.mark.parametrize("case", ROUTER_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_router_matches_definition(backend, case):
    require_backend(backend)
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(37, 64, generator=gen) * 3
    kwargs = dict(ROUTER_CASES[case])
    if kwargs["scoring"] == "sigmoid":
        kwargs["correction_bias"] = torch.randn(64, generator=gen) * 0.1
    weights, ids = torch_kernels.router_topk(logits, 6, implementation=backend, **kwargs)
    assert backends.last_backend("router_topk") == backend
    assert (weights.dtype, ids.dtype, weights.shape) == (torch.float32, torch.int32, (37, 6))
    full = dict(num_expert_groups=None, topk_groups=None, correction_bias=None, routed_scaling_factor=1.0)
    want_w, want_ids = reference.router_topk(logits, 6, **{**full, **kwargs})
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    if "num_expert_groups" in kwargs:  # each token's choices lie within its topk_groups kept groups
        assert max(len(set((row // 8).tolist())) for row in ids) <= kwargs["topk_groups"]


def test_router_gradient_and_bias():
    """d weights / d logits by autograd through the scores, the choice fixed; the bias steers the
    choice only."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(16, generator=gen, dtype=torch.float64)
    for kwargs in ROUTER_CASES.values():
        extra = {"correction_bias": bias} if kwargs["scoring"] == "sigmoid" else {}
        kwargs = {**kwargs, "num_expert_groups": 4, "topk_groups": 2} if "num_expert_groups" in kwargs else kwargs
        assert torch.autograd.gradcheck(lambda t: torch_kernels.router_topk(t, 3, **kwargs, **extra)[0], (logits,))
    huge = torch.zeros(16, dtype=torch.float64)
    huge[5] = 100.0
    w, ids = torch_kernels.router_topk(logits, 2, scoring="sigmoid", correction_bias=huge, renormalize=False)
    assert (ids == 5).any(dim=1).all()
    torch.testing.assert_close(w[ids == 5], logits.sigmoid()[:, 5])


def router_choice_definition(logits, top_k, scoring="softmax", renormalize=True, num_expert_groups=None,
                             topk_groups=None, correction_bias=None, routed_scaling_factor=1.0):
    """The documented choice rule, token by token in plain loops: experts ranked by their logits
    (by float32 ``score + bias`` with a bias), groups by the float32 sum of their two best
    ``score (+ bias)``; every ranking larger first, NaN as -inf, equal values by lowest index; a
    row with a NaN logit gets NaN weights."""
    logits = logits.float()
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    bias = torch.zeros(logits.shape[1]) if correction_bias is None else correction_bias.float()
    weights, ids = [], []
    for row, score in zip(logits, scores):
        biased = [float(v) for v in score + bias]  # float32 sums
        key = biased if correction_bias is not None else [float(v) for v in row]

        def rank(values, candidates):
            clean = [-math.inf if math.isnan(v) else v for v in values]
            return sorted(candidates, key=lambda i: (-clean[i], i))

        candidates = range(len(key))
        if num_expert_groups is not None:
            size = len(key) // num_expert_groups
            group_scores = []
            for g in range(num_expert_groups):
                members = range(g * size, (g + 1) * size)
                two = [-math.inf if math.isnan(biased[i]) else biased[i] for i in rank(biased, members)[:2]]
                group_scores.append(float(torch.tensor(two, dtype=torch.float32).sum()))
            kept = rank(group_scores, range(num_expert_groups))[:topk_groups]
            candidates = [i for i in candidates if i // size in kept]
        chosen = rank(key, candidates)[:top_k]
        w = score[chosen].double()
        if renormalize:
            w = w / w.sum()
        if row.isnan().any():
            w = torch.full_like(w, math.nan)
        weights.append(w * routed_scaling_factor)
        ids.append(chosen)
    return torch.stack(weights).float(), torch.tensor(ids)


def _quantized(t, step=0.5):
    """bfloat16 logits on a coarse grid: many exact ties in every row."""
    return ((t * 2).div(step).round() * step).to(torch.bfloat16)


def _special_rows(e, gen):
    """Ordinary rows around rows holding a NaN, +inf, -inf, all -inf, NaN with -inf, all NaN."""
    rows = torch.randn(9, e, generator=gen)
    nan, inf = math.nan, math.inf
    rows[1, 2] = nan
    rows[2, 5] = inf
    rows[3, 1] = -inf
    rows[4] = -inf
    rows[5, :e // 2] = -inf
    rows[5, 3] = nan
    rows[6] = nan
    rows[7, ::3] = inf
    return rows


RULE_INPUTS = {  # name: (logits from a generator, top_k)
    "zeros, signed": (lambda gen: torch.zeros(5, 16) * torch.tensor([1.0, -1.0]).repeat(8), 3),  # -0.0 == 0.0
    "bf16 ties": (lambda gen: _quantized(torch.randn(11, 16, generator=gen)), 4),
    "bf16 ties, 128 experts top 8": (lambda gen: _quantized(torch.randn(6, 128, generator=gen)), 8),
    "underflow": (lambda gen: torch.randn(7, 16, generator=gen) * 1e30, 2),
    "nan, inf, -inf rows": (lambda gen: _special_rows(16, gen), 3),
}
RULE_SCORINGS = {
    "softmax": dict(scoring="softmax"),
    "grouped sigmoid": dict(scoring="sigmoid", num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5),
    "grouped sigmoid, no bias": dict(scoring="sigmoid", num_expert_groups=4, topk_groups=2, renormalize=False),
}


def rule_case(inputs, scoring):
    gen = torch.Generator().manual_seed(len(inputs) + len(scoring))
    make, top_k = RULE_INPUTS[inputs]
    logits = make(gen)
    kwargs = dict(RULE_SCORINGS[scoring])
    if scoring == "grouped sigmoid":  # a bias with ties of its own
        kwargs["correction_bias"] = torch.randint(0, 3, (logits.shape[1],), generator=gen) * 0.25
    return logits, top_k, kwargs


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("scoring", RULE_SCORINGS)
@pytest.mark.parametrize("inputs", RULE_INPUTS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_router_choice_rule(backend, inputs, scoring):
    """Ties, probabilities that underflowed and non-finite logits: every backend picks the ids of
    the documented rule (distinct and in range in every row) and NaN weights for NaN rows."""
    require_backend(backend)
    logits, top_k, kwargs = rule_case(inputs, scoring)
    weights, ids = torch_kernels.router_topk(logits, top_k, implementation=backend, **kwargs)
    assert backends.last_backend("router_topk") == backend
    assert ((ids >= 0) & (ids < logits.shape[1])).all(), ids
    assert all(len(set(row)) == top_k for row in ids.tolist()), ids
    want_weights, want_ids = router_choice_definition(logits, top_k, **kwargs)
    assert torch.equal(ids.long(), want_ids), (ids, want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("scoring", RULE_SCORINGS)
@pytest.mark.parametrize("inputs", RULE_INPUTS)
def test_router_choice_rule_jnp_reference(inputs, scoring):
    """The torchax reference backend (jax_impl's jnp router) follows the same rule."""
    require_backend("pallas")
    import jax.numpy as jnp
    from jax_impl import moe as jax_moe

    logits, top_k, kwargs = rule_case(inputs, scoring)
    bias = kwargs.pop("correction_bias", None)
    weights, ids = jax_moe.router_topk_reference(
        jnp.asarray(logits.float().numpy()).astype(jnp.bfloat16 if logits.dtype == torch.bfloat16 else jnp.float32),
        top_k, correction_bias=None if bias is None else jnp.asarray(bias.numpy()), **kwargs)
    want_weights, want_ids = router_choice_definition(logits, top_k, correction_bias=bias, **kwargs)
    assert torch.equal(torch.tensor(np.array(ids)).long(), want_ids)
    torch.testing.assert_close(torch.tensor(np.array(weights)), want_weights, rtol=1e-5, atol=1e-6,
                               equal_nan=True)


# ---- dispatch and combine ----

def dispatch_definition(x, ids, num_experts):
    """Rows sorted by expert, tokens in order within each; dropped slots last as zero rows."""
    t, k = ids.shape
    rows, counts = [], []
    for e in range(num_experts):
        chosen = [(token, j) for token in range(t) for j in range(k) if int(ids[token, j]) == e]
        counts.append(len(chosen))
        rows += [x[token] for token, _ in chosen]
    rows += [x.new_zeros(x.shape[1])] * (t * k - len(rows))
    sorted_rows = torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])
    return sorted_rows, torch.tensor(counts).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("shape", ["small odd", "k8 many experts", "no tokens"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatch_and_combine(backend, shape, kind):
    require_backend(backend)
    tokens, hidden, _, experts, k = SHAPES[shape]
    x, _, _, weights, ids = make_layer(tokens, hidden, 8, experts, k, kind, seed=3)
    x_sorted, offsets, handle = torch_kernels.moe_dispatch(x, ids, experts, implementation=backend)
    want_rows, want_offsets = dispatch_definition(x, ids, experts)
    assert torch.equal(offsets, want_offsets) and offsets.dtype == torch.int32
    assert torch.equal(x_sorted, want_rows)
    y = torch.randn(x_sorted.shape, generator=torch.Generator().manual_seed(4))
    y[int(offsets[-1]):] = float("nan")  # dropped slots' rows are never read
    out = torch_kernels.moe_combine(y, handle, weights, implementation=backend)
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(k):
            if ids[t, j] >= 0:
                want[t] += weights[t, j].double() * y[handle.row_of_slot[t, j]].double()
    assert_close(out, want, torch.float32, what="combine")


@pytest.mark.parametrize("backend", BACKENDS)
def test_dispatch_and_combine_gradients(backend):
    """The backward of dispatch is a combine of the row gradients; combine's is a dispatch of the
    token gradients times the weights, and d weights = <d out, y>."""
    require_backend(backend)
    x, _, _, weights, ids = make_layer(11, 24, 8, 5, 3, "dropped", seed=5)
    x = x.requires_grad_()
    weights = weights.requires_grad_()
    x_sorted, offsets, handle = torch_kernels.moe_dispatch(x, ids, 5, implementation=backend)
    y = x_sorted * torch.linspace(0.5, 1.5, x_sorted.shape[0])[:, None]
    out = torch_kernels.moe_combine(y, handle, weights, implementation=backend)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(6))
    got = torch.autograd.grad(out, [x, weights], d_out)
    want_rows, _ = dispatch_definition(x, ids, 5)
    want_y = want_rows * torch.linspace(0.5, 1.5, x_sorted.shape[0])[:, None]
    picked = want_y[handle.row_of_slot.clamp(min=0)]
    want_out = torch.where((ids >= 0)[..., None], picked * weights[..., None], 0).sum(dim=1)
    want = torch.autograd.grad(want_out, [x, weights], d_out)
    for name, a, b in zip(("dx", "dweights"), got, want):
        assert relative_rmse(a, b) < 1e-6, name


# ---- grouped_mm ----

def random_offsets(rows: int, experts: int, gen, empty_every: int = 3) -> torch.Tensor:
    counts = torch.randint(0, 5, (experts,), generator=gen)
    counts[::empty_every] = 0
    counts = (counts.float() / counts.sum().clamp(min=1) * rows).floor().long()
    return counts.cumsum(0).to(torch.int32)


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w-transposed-view"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mm_matches_definition(backend, dtype, transposed):
    require_backend(backend)
    gen = torch.Generator().manual_seed(7)
    m, k_dim, n, experts = 37, 33, 20, 7
    x = torch.randn(m, k_dim, generator=gen).to(dtype)
    w = torch.randn(experts, n, k_dim, generator=gen).to(dtype).transpose(1, 2) if transposed \
        else torch.randn(experts, k_dim, n, generator=gen).to(dtype)
    offsets = random_offsets(30, experts, gen)  # rows 30.. belong to no expert
    out = torch_kernels.grouped_mm(x, w, offsets, implementation=backend)
    assert backends.last_backend("grouped_mm") == backend
    want = reference.grouped_mm_naive(x.double(), w.double(), offsets, torch.float64)
    assert out.dtype == dtype and torch.all(out[int(offsets[-1]):] == 0)
    assert_close(out, want, dtype, what="grouped_mm")
    out32 = torch_kernels.grouped_mm(x, w, offsets, out_dtype=torch.float32, implementation=backend)
    assert out32.dtype == torch.float32
    assert_close(out32, want, dtype, what="grouped_mm float32 out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mm_equals_torch_grouped_mm(backend, dtype):
    """torch.nn.functional.grouped_mm, the peer, on the rows it defines (it leaves later rows as
    they come), shapes it takes (16-byte aligned)."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(40, 32, generator=gen).to(dtype)
    w = torch.randn(5, 32, 16, generator=gen).to(dtype)
    offsets = torch.tensor([3, 3, 20, 31, 36], dtype=torch.int32)
    require_backend(backend)
    ours = torch_kernels.grouped_mm(x, w, offsets, implementation=backend)
    peer = F.grouped_mm(x, w, offs=offsets)
    assert_close(ours[:36], peer[:36].float(), dtype, what=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mm_gradients(backend):
    require_backend(backend)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(29, 17, generator=gen, requires_grad=True)
    w_base = torch.randn(6, 11, 17, generator=gen, requires_grad=True)
    offsets = random_offsets(25, 6, gen)
    out = torch_kernels.grouped_mm(x, w_base.transpose(1, 2), offsets, implementation=backend)
    d_out = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, [x, w_base], d_out)
    assert backends.last_backend("grouped_mm_weight_grad") == backend
    want_out = reference.grouped_mm_naive(x.double(), w_base.double().transpose(1, 2), offsets, torch.float64)
    want = torch.autograd.grad(want_out, [x, w_base], d_out.double())
    for name, a, b in zip(("dx", "dw"), got, want):
        assert relative_rmse(a, b) < 1e-5, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mm_empty_products(backend):
    """N = 0 gives [M, 0], K = 0 zeros, no experts and no rows [0, N]: the same on every backend,
    gradients included (no expert for M > 0 rows is a bad input, in tests/families/moe.py)."""
    require_backend(backend)
    offsets = torch.tensor([2, 2, 7, 9], dtype=torch.int32)
    cases = {"N 0": (torch.randn(10, 16), torch.randn(4, 16, 0), offsets),
             "K 0": (torch.randn(10, 0), torch.randn(4, 0, 8), offsets),
             "no experts, no rows": (torch.randn(0, 16), torch.randn(0, 16, 8), offsets[:0])}
    for name, (x, w, offs) in cases.items():
        x, w = x.requires_grad_(), w.requires_grad_()
        out = torch_kernels.grouped_mm(x, w, offs, implementation=backend)
        assert out.shape == (x.shape[0], w.shape[2]) and out.dtype == x.dtype and not out.any(), name
        d_x, d_w = torch.autograd.grad(out, [x, w], torch.ones_like(out))
        assert d_x.shape == x.shape and d_w.shape == w.shape and not d_x.any() and not d_w.any(), name


# ---- fused_moe ----

def fused_definition(x, w13, w2, weights, ids, activation="silu", w13_scale=None, w2_scale=None, block_shape=None):
    return reference.fused_moe_naive(x, w13, w2, weights, ids, activation, w13_scale, w2_scale, block_shape)


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_moe_matches_definition(backend, shape, activation):
    require_backend(backend)
    x, w13, w2, weights, ids = make_layer(*SHAPES[shape], kind="dropped" if shape == "small odd" else "skewed", seed=10)
    out = torch_kernels.fused_moe(x, w13, w2, weights, ids, activation, implementation=backend)
    assert backends.last_backend("fused_moe") == backend
    want = fused_definition(x.double(), w13.double(), w2.double(), weights, ids, activation)
    assert_close(out, want, torch.float32, what=f"{shape} {activation}")


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_moe_half_precision(backend, kind, dtype):
    """16-bit x and weights: float32 accumulation, h rounded to x's dtype between the GEMMs. The
    CPU reference also rounds each GEMM's output to 16 bits, as transformers' experts do (their own
    error is its gate: test_moe_transformers.py), so it is held to the largest error alone."""
    require_backend(backend)
    x, w13, w2, weights, ids = make_layer(kind=kind, dtype=dtype, seed=11)
    out = torch_kernels.fused_moe(x, w13, w2, weights, ids, implementation=backend)
    assert out.dtype == dtype
    assert_half_precision(out, fused_definition(x, w13, w2, weights, ids).float(), dtype, backend, kind)


def assert_half_precision(out, expected, dtype, backend: str, what: str = "") -> None:
    if backend != "reference":
        return assert_close(out, expected, dtype, what=what)
    error = relative_error(out, expected)
    assert error <= TOLERANCES[dtype][0], f"{what}: relative error {error:.3e} for {dtype}"


def test_reference_fused_moe_keeps_16_bit_weights_in_their_dtype():
    """Decode reads each expert's weights once: the reference kernel converts none of them to
    float32 (that took longer than the GEMMs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x, w13, w2, weights, ids = make_layer(tokens=3, hidden=64, inter=32, experts=4, k=2, dtype=torch.bfloat16, seed=12)
    converted = []  # sizes of the tensors converted to another dtype

    class Conversions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default) and out.dtype != source.dtype:
                converted.append(source.numel())
            return out

    token_of_row, row_of_slot, offsets = reference.sort_by_expert(ids, w13.shape[0])
    with Conversions():
        out = reference.fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets.long(), "silu", None, None,
                                  None)
    assert converted and max(converted) < w2[0].numel(), f"weight-sized tensors converted: {converted}"
    assert_half_precision(out, fused_definition(x, w13, w2, weights, ids).float(), torch.bfloat16, "reference")


def quantize_fp8(w: torch.Tensor, block_shape=None):
    """float8_e4m3fn entries and float32 scales (per output channel, or per block), amax / 448."""
    largest = torch.finfo(torch.float8_e4m3fn).max
    if block_shape is None:
        scale = w.abs().amax(dim=2).clamp(min=1e-12) / largest
        return (w / scale[..., None]).to(torch.float8_e4m3fn), scale
    bn, bk = block_shape
    e, n, k = w.shape
    padded = F.pad(w, (0, -k % bk, 0, -n % bn))
    blocks = padded.view(e, padded.shape[1] // bn, bn, padded.shape[2] // bk, bk)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / largest
    full = scale.repeat_interleave(bn, 1)[:, :n].repeat_interleave(bk, 2)[:, :, :k]
    return (w / full).to(torch.float8_e4m3fn), scale


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("block_shape", [None, (16, 32)], ids=["per-channel", "blocks"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_moe_fp8_weights(backend, dtype, block_shape):
    """float8_e4m3fn weights with float32 scales, dequantized in the kernel: equal to the
    definition on the dequantized weights."""
    require_backend(backend)
    x, w13, w2, weights, ids = make_layer(tokens=11, hidden=48, inter=40, experts=5, k=2, dtype=dtype, seed=12)
    q13, s13 = quantize_fp8(w13.float(), block_shape)
    q2, s2 = quantize_fp8(w2.float(), block_shape)
    out = torch_kernels.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2,
                                  block_shape=None if block_shape is None else list(block_shape), implementation=backend)
    want = fused_definition(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, block_shape=block_shape)
    assert_close(out, want.float(), dtype, what="fp8")


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_token_stays_in_its_rows(backend):
    """A NaN in one token's hidden state makes that token's output NaN and leaves every other
    token's output as it was (tiles shared with it do not spread it)."""
    require_backend(backend)
    x, w13, w2, weights, ids = make_layer(tokens=9, hidden=24, inter=12, experts=3, k=2, kind="uniform", seed=22)
    clean = torch_kernels.fused_moe(x, w13, w2, weights, ids, implementation=backend)
    x[4, 7] = float("nan")
    out = torch_kernels.fused_moe(x, w13, w2, weights, ids, implementation=backend)
    assert out[4].isnan().all()
    others = torch.arange(9) != 4
    torch.testing.assert_close(out[others], clean[others], rtol=0, atol=0)


def composition(x, w13, w2, weights, ids, activation="silu", implementation=None):
    x_sorted, offsets, handle = torch_kernels.moe_dispatch(x, ids, w13.shape[0], implementation=implementation)
    gate_up = torch_kernels.grouped_mm(x_sorted, w13.transpose(1, 2), offsets, out_dtype=torch.float32,
                                       implementation=implementation)
    h = reference.activate(gate_up, activation).to(x.dtype)
    y = torch_kernels.grouped_mm(h, w2.transpose(1, 2), offsets, out_dtype=torch.float32,
                                 implementation=implementation)
    return torch_kernels.moe_combine(y, handle, weights, implementation=implementation).to(x.dtype)


@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_moe_gradients(backend, activation):
    """Every gradient of fused_moe, and of the composition it equals, against autograd through the
    float64 definition."""
    require_backend(backend)
    layer = make_layer(tokens=9, hidden=21, inter=10, experts=5, k=3, kind="dropped", seed=13)
    ids = layer[4]
    leaves = [t.clone().requires_grad_() for t in layer[:4]]
    want_out = fused_definition(*[t.double() for t in leaves], ids, activation)
    d_out = torch.randn(want_out.shape, generator=torch.Generator().manual_seed(14))
    want = torch.autograd.grad(want_out, leaves, d_out.double())
    for name, fn in (("fused", torch_kernels.fused_moe), ("composition", composition)):
        out = fn(*leaves, ids, activation, implementation=backend)
        got = torch.autograd.grad(out, leaves, d_out)
        for grad_name, a, b in zip(("dx", "dw13", "dw2", "dweights"), got, want):
            assert relative_rmse(a, b) < 1e-5, f"{name} {grad_name}: {relative_rmse(a, b):.1e}"


# ---- the deferred check mode: bad values made safe ----

@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_expert_ids_in_deferred_mode_are_dropped(backend):
    """Expert ids 9 and -3 (5 experts), deferred checks: moe_dispatch, moe_combine, the composition
    and fused_moe raise nothing and give, gradients included, exactly what the same ids as -1
    (dropped) give, reading nothing on the host on Triton (the accelerator's path);
    ``raise_deferred_errors`` then names topk_ids."""
    require_backend(backend)
    if backend == "pallas":
        pytest.skip("pallas compiles each new shape (over ten seconds here in interpret mode); the ids are checked "
                    "in the op layer, the same for every backend, and grouped_mm's deferred test runs on pallas")
    layer = make_layer(tokens=9, hidden=21, inter=10, experts=5, k=3, seed=15)
    bad_ids, dropped_ids = layer[4].clone(), layer[4].clone()
    bad_ids[2, 1], bad_ids[6, 0] = 9, -3
    dropped_ids[2, 1] = dropped_ids[6, 0] = -1
    d_out = torch.randn(layer[0].shape, generator=torch.Generator().manual_seed(16))

    def run(ids):
        leaves = [t.clone().requires_grad_() for t in layer[:4]]
        x_sorted, offsets, handle = torch_kernels.moe_dispatch(leaves[0], ids, 5, implementation=backend)
        results = [x_sorted.detach(), offsets, handle.token_of_row, handle.row_of_slot]
        for fn in (torch_kernels.fused_moe, composition):
            out = fn(*leaves, ids, implementation=backend)
            results += [out.detach(), *torch.autograd.grad(out, leaves, d_out)]
        return results

    want = run(dropped_ids)
    (got,) = run_deferred(run, backend, bad_ids)
    with pytest.raises(ValueError, match=r"^topk_ids: expected expert ids in \[0, 5\) or -1 \(dropped\) \(found by "
                                         r"a deferred check\)$"):
        torch_kernels.raise_deferred_errors()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def run_deferred(run, backend: str, *inputs) -> list:
    """``run`` on each of ``inputs`` in the deferred check mode; on Triton (the accelerators'
    path) with no host read."""
    with torch_kernels.checks("deferred"), HostReads() as guard:
        results = [run(x) for x in inputs]
    assert backend != "triton" or not guard.reads, guard.reads
    return results


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mm_in_deferred_mode(backend):
    """Deferred checks: good offsets give the full mode's output and gradients; decreasing offsets
    raise nothing at the call, and the output and both gradients are all NaN (which rows go to which
    expert is unknown); nothing is read on the host on Triton (the accelerator's path);
    ``raise_deferred_errors`` then names offsets."""
    require_backend(backend)
    gen = torch.Generator().manual_seed(17)
    x = torch.randn(29, 17, generator=gen)
    w = torch.randn(6, 17, 11, generator=gen)
    d_out = torch.randn(29, 11, generator=gen)

    def run(offsets):
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        out = torch_kernels.grouped_mm(*leaves, offsets, implementation=backend)
        return [out.detach(), *torch.autograd.grad(out, leaves, d_out)]

    offsets = random_offsets(25, 6, gen)
    want = run(offsets)
    got, bad = run_deferred(run, backend, offsets, torch.tensor([3, 9, 4, 12, 20, 25], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^offsets: expected non-decreasing cumulative row ends \(found by a "
                                         r"deferred check\)$"):
        torch_kernels.raise_deferred_errors()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for name, t in zip(("out", "dx", "dw"), bad):
        assert torch.isnan(t).all(), name


def test_gradcheck_in_float64():
    layer = make_layer(tokens=5, hidden=4, inter=3, experts=3, k=2, kind="dropped", dtype=torch.float64, seed=15)
    leaves = tuple(t.clone().requires_grad_() for t in layer[:3]) + (layer[3].double().requires_grad_(),)
    ids = layer[4]
    for activation in reference.ACTIVATIONS:
        assert torch.autograd.gradcheck(lambda *t: torch_kernels.fused_moe(*t, ids, activation), leaves)
    offsets = torch.tensor([1, 1, 4], dtype=torch.int32)
    assert torch.autograd.gradcheck(lambda x, w: torch_kernels.grouped_mm(x, w, offsets), leaves[:1] + (
        torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True),))


def test_fp8_weights_are_inference_only():
    x, w13, w2, weights, ids = make_layer(seed=16)
    q13, s13 = quantize_fp8(w13)
    q2, s2 = quantize_fp8(w2)
    out = torch_kernels.fused_moe(x.requires_grad_(), q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    with pytest.raises(RuntimeError, match="float8 weights are inference-only"):
        out.sum().backward()


# ---- the op contract ----

@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    require_backend(backend)
    x, w13, w2, weights, ids = make_layer(tokens=6, hidden=16, inter=8, experts=4, k=2, kind="dropped", seed=17)
    x, w13, w2, weights = (t.requires_grad_() for t in (x, w13, w2, weights))
    run_opcheck(torch.ops.torch_kernels.fused_moe.default, (x, w13, w2, weights, ids, "silu", None, None, None, backend))
    offsets = torch.tensor([2, 2, 5, 9], dtype=torch.int32)
    xs = torch.randn(12, 16, requires_grad=True)
    run_opcheck(torch.ops.torch_kernels.grouped_mm.default, (xs, w13.detach().transpose(1, 2).requires_grad_(),
                                                              offsets, None, backend))
    logits = torch.randn(6, 8, requires_grad=True)
    run_opcheck(torch.ops.torch_kernels.router_topk.default, (logits, 2, "softmax", True, None, None, None, 1.0, backend))
    token_of_row, row_of_slot, _ = reference.sort_by_expert(ids, 4)
    run_opcheck(torch.ops.torch_kernels.moe_gather.default, (x, token_of_row, row_of_slot, backend))
    run_opcheck(torch.ops.torch_kernels.moe_combine.default,
                (torch.randn(12, 16, requires_grad=True), token_of_row, row_of_slot, weights, backend))


class MoEBlock(torch.nn.Module):
    """A Qwen3-MoE-style sparse block: router, top-k, the experts through the ops."""

    def __init__(self, hidden=32, inter=16, experts=8, k=2, fused=True):
        super().__init__()
        gen = torch.Generator().manual_seed(18)
        self.k, self.fused = k, fused
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.w13 = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5)
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5)

    def forward(self, x):
        weights, ids = torch_kernels.router_topk(self.gate(x), self.k)
        if self.fused:
            return torch_kernels.fused_moe(x, self.w13, self.w2, weights, ids)
        return composition(x, self.w13, self.w2, weights, ids)


@pytest.mark.parametrize("fused", [True, False], ids=["fused_moe", "composition"])
def test_compile_fullgraph_moe_block(fused):
    torch.manual_seed(19)
    block = MoEBlock(fused=fused)
    x = torch.randn(24, 32)
    assert_compiled_matches_eager(block, x)


@pytest.mark.parametrize("backend", BACKENDS)
def test_profiler_names_op_and_backend(backend):
    require_backend(backend)
    x, w13, w2, weights, ids = make_layer(seed=20)
    names = profiled_names(lambda: torch_kernels.fused_moe(x, w13, w2, weights, ids, implementation=backend))
    assert "torch_kernels::fused_moe" in names and f"torch_kernels::fused_moe[{backend}]" in names


def test_flop_counter_counts_the_ops():
    x, w13, w2, weights, ids = make_layer(tokens=13, hidden=33, inter=20, experts=6, k=2, kind="dropped", seed=21)
    routed = int((ids >= 0).sum())
    assert counted_flops(lambda: torch_kernels.fused_moe(x, w13, w2, weights, ids)) == 6 * routed * 33 * 20
    offsets = torch.tensor([3, 3, 9], dtype=torch.int32)
    w = torch.randn(3, 33, 7)
    assert counted_flops(lambda: torch_kernels.grouped_mm(torch.randn(12, 33), w, offsets)) == 2 * 9 * 33 * 7


# ---- the byte formula, against counts made here ----

def test_moe_bytes_count_routed_rows_and_used_experts():
    tokens, hidden, inter, experts = 4, 6, 5, 4
    x = random_tensor(tokens, hidden, seed=13)
    ids = torch.tensor([[0, 2], [-1, -1], [2, 0], [0, -1]], dtype=torch.int32)  # token 1 dropped; expert 1, 3 idle
    weights = torch.rand(tokens, 2, generator=torch.Generator().manual_seed(14))
    routed_tokens, routed_slots, used_experts = 3, 5, 2

    def moe_layer():
        rows, offsets, handle = torch_kernels.moe_dispatch(x, ids, experts)
        w = random_tensor(experts, hidden, inter, seed=15)
        y = torch_kernels.grouped_mm(rows, w, offsets)
        return rows, offsets, w, y, torch_kernels.moe_combine(y, handle, weights)

    prof, (rows, offsets, w, y, out) = profiled(moe_layer)
    handle_bytes = tokens * 2 * 8  # int64 sorted-row -> token map
    assert only_row(prof, "moe_gather")["bytes"] == (routed_tokens * hidden * FLOAT32_BYTES + handle_bytes
                                                     + nbytes(rows))
    assert only_row(prof, "grouped_mm")["bytes"] == (routed_slots * hidden * FLOAT32_BYTES
                                                     + used_experts * hidden * inter * FLOAT32_BYTES
                                                     + nbytes(offsets, y))
    assert only_row(prof, "grouped_mm")["flops"] == 2 * routed_slots * hidden * inter
    combine = only_row(prof, "moe_combine")
    assert combine["bytes"] == routed_slots * inter * FLOAT32_BYTES + tokens * 2 * 8 + nbytes(weights, out)
    assert combine["flops"] == 2 * routed_slots * inter

    w13, w2 = random_tensor(experts, 2 * inter, hidden, seed=16), random_tensor(experts, hidden, inter, seed=17)
    prof, out = profiled(lambda: torch_kernels.fused_moe(x, w13, w2, weights, ids))
    fused = only_row(prof, "fused_moe")
    assert fused["bytes"] == nbytes(x, weights, ids, out) + used_experts * 3 * inter * hidden * FLOAT32_BYTES
    assert fused["flops"] == counted_flops(lambda: torch_kernels.fused_moe(x, w13, w2, weights, ids))

    logits = random_tensor(tokens, experts, seed=18)
    prof, (topk_weights, topk_ids) = profiled(lambda: torch_kernels.router_topk(logits, 2))
    assert only_row(prof, "router_topk")["bytes"] == nbytes(logits, topk_weights, topk_ids)


@pytest.mark.parametrize("tokens, top_k, experts", [(5, 2, 4), (300, 8, 64), (1, 1, 1), (0, 2, 3), (40, 3, 255)])
def test_triton_routing_maps_equal_the_reference(tokens, top_k, experts):
    """MoE's routing maps on the Triton backend (three launches: count, scan, place) equal
    ``reference.sort_by_expert``'s bit for bit (rows in slot order within an expert, dropped slots
    last), over several tiles of slots and with dropped ids."""
    require_backend("triton")
    from torch_kernels.ops.moe import _common

    ids = torch.randint(-1, experts, (tokens, top_k), generator=torch.Generator().manual_seed(tokens))
    got, want = _common.sort_by_expert(ids, experts, "triton"), reference.sort_by_expert(ids, experts)
    for name, g, w in zip(("token_of_row", "row_of_slot", "offsets"), got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), name

"""The quantized_attention family (``quantized_attention``, ``quantized_sdpa``) on every backend.

Accuracy gates against float32 ``scaled_dot_product_attention`` on the same inputs, for every
granularity and pv_dtype: cosine similarity and relative L1 (``sum |O - O_ref| / sum |O_ref|``),
on random inputs and on keys with large per-channel offsets (smoothing off fails the gate,
smoothing on passes). Then the definitions: the int8 groups and scales, the online softmax against
the untiled definition, varlen against per-sequence calls, the lse against float32 logsumexp and
as ring attention combines it, gradients against float32 SDPA autograd (relative RMSE), and the op
contract (opcheck, torch.compile fullgraph forward and backward, profiler names, FLOP and byte
counts, bad offsets in the deferred check mode; its bad inputs are in
tests/families/quantized_attention.py). Sizes are small and odd (N from 1 to 333) to keep the file
fast.

Run with ``-s`` to see the measured figures.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import torch_kernels
from harness import (
    FLOAT32_BYTES, HostReads, assert_compiled_matches_eager, backend_params, counted_flops, only_row, profiled,
    profiled_names, random_tensor, require_backend, run_opcheck,
)
from torch_kernels import backends
from torch_kernels.ops import quantized_attention as ops
from torch_kernels.reference import quantized_attention as reference

BACKENDS = backend_params("quantized_attention")
GRANULARITIES = reference.GRANULARITIES
PV_DTYPES = reference.PV_DTYPES
# (min cosine, max relative L1) against float32 SDPA. fp8: float8_e4m3fn keeps 3 mantissa bits, so
# rounding P and V to it costs about 0.035 relative L1 on random inputs even with exact scores
# (test_fp8_gate_is_the_operand_rounding); the gate leaves that floor 1.6x room.
GATES = {"fp16": (0.999, 0.03), "none": (0.999, 0.03), "fp8": (0.998, 0.06)}
KEY_OFFSET = 20.0  # per-channel key offsets of this size (times a standard normal) defeat unsmoothed int8 keys
QUERY_OFFSET = 40.0  # and +-40 on a few query channels (outliers, as SmolLM2's) unsmoothed int8 queries
# Pallas runs here in TPU interpret mode, where each new shape, dtype or pv_dtype compiles a program
# (1-3 s; the mask, granularity and smoothing do not): on it the option matrices below run along
# their diagonal (every option once), and test_quantized_attention_pallas.py holds the whole
# matrix to the reference's numbers.
DIAGONAL_ONLY = ("pallas",)


def diagonal_only(backend: str, *indices: int) -> None:
    """On a backend of DIAGONAL_ONLY, skip a case unless its option indices are all equal."""
    if backend in DIAGONAL_ONLY and len(set(indices)) > 1:
        pytest.skip(f"{backend} runs this matrix's diagonal (each case compiles in interpret mode)")


def accuracy(out: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(cosine similarity, relative L1) of ``out`` against ``want``, in float64."""
    out, want = out.detach().double().flatten(), want.detach().double().flatten()
    return F.cosine_similarity(out, want, dim=0).item(), ((out - want).abs().sum() / want.abs().sum()).item()


def relative_rmse(got, want) -> float:
    """RMS of the difference over RMS of ``want`` (fla's gradient measure)."""
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).square().mean().sqrt() / want.square().mean().sqrt().clamp_min(1e-30)).item()


def bottom_right_mask(nq: int, nk: int) -> torch.Tensor:
    """FlashAttention's causal mask for ``nq`` queries that are the last of ``nk`` keys."""
    return torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)


def sdpa_float32(q, k, v, causal=False, sm_scale=None):
    """The truth: float32 SDPA (HND) on the same inputs, bottom-right causal, GQA by head groups."""
    mask = bottom_right_mask(q.shape[2], k.shape[2]) if causal else None
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=sm_scale,
                                          enable_gqa=True)


def logsumexp_float32(q, k, causal=False, sm_scale=None):
    """Each row's natural-log logsumexp of the exact float32 scores."""
    group = q.shape[1] // k.shape[1]
    scale = q.shape[3] ** -0.5 if sm_scale is None else sm_scale
    scores = q.float() @ k.float().repeat_interleave(group, dim=1).transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(~bottom_right_mask(q.shape[2], k.shape[2]), -math.inf)
    return scores.logsumexp(dim=-1)


def make_qkv(b=2, hq=4, hkv=2, nq=150, nk=150, d=64, dtype=torch.float16, key_offset=0.0, seed=0, requires_grad=False,
             query_offset=0.0):
    """Random ``[B, H, N, D]`` q, k, v; ``key_offset`` adds a per-(head, channel) constant of that
    scale to the keys; ``query_offset`` adds +-``query_offset`` to 4 channels of each query head, on
    which the keys are nearly constant (their noise scaled by 0.05), as with LLMs' outlier channels."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=gen)
    k = torch.randn(b, hkv, nk, d, generator=gen)
    k = k + key_offset * torch.randn(1, hkv, 1, d, generator=gen)
    v = torch.randn(b, hkv, nk, d, generator=gen)
    if query_offset:  # drawn last, so that the other tensors stay those of the same seed
        q[..., :4] += query_offset * torch.randn(1, hq, 1, 4, generator=gen).sign()
        k[..., :4] -= 0.95 * (k[..., :4] - k[..., :4].mean(dim=2, keepdim=True))
    return tuple(t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))


def report(what: str, cos: float, l1: float) -> None:
    """Print a measured figure (shown with ``pytest -s``)."""
    print(f"\n{what}: cosine {cos:.6f}, relative L1 {l1:.4f}", end="")


# ---- accuracy gates ----

CASE_DTYPES = {64: torch.float16, 96: torch.bfloat16, 128: torch.float32}  # every dtype meets every head size below


@pytest.mark.covering
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_size", [64, 96, 128])
@pytest.mark.parametrize("pv_dtype", PV_DTYPES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gates_on_random_inputs(backend, granularity, pv_dtype, head_size, causal):
    """GQA 4:2, Nq != Nk (bottom-right causal), odd lengths."""
    require_backend(backend)
    diagonal_only(backend, GRANULARITIES.index(granularity), PV_DTYPES.index(pv_dtype), (64, 96, 128).index(head_size))
    # one batch element under the Triton interpreter, whose cost is per program and step: its 54
    # cases take about 10 s so, 20 s with two
    batch = 1 if backend == "triton" else 2
    q, k, v = make_qkv(b=batch, nq=131, nk=197, d=head_size, dtype=CASE_DTYPES[head_size], seed=head_size)
    out = torch_kernels.quantized_attention(q, k, v, causal=causal, granularity=granularity, pv_dtype=pv_dtype,
                                            implementation=backend)
    assert backends.last_backend("quantized_attention") == backend
    assert out.dtype == q.dtype and out.shape == q.shape
    cos, l1 = accuracy(out, sdpa_float32(q, k, v, causal))
    report(f"random D={head_size} {'causal' if causal else 'full'} {granularity} {pv_dtype}", cos, l1)
    min_cos, max_l1 = GATES[pv_dtype]
    assert cos >= min_cos and l1 <= max_l1, (cos, l1)


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("pv_dtype", PV_DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gates_every_dtype_and_layout(backend, pv_dtype, dtype):
    """MQA (8 query heads, 1 kv head), NHD layout, lengths 1 and 333, an explicit sm_scale."""
    require_backend(backend)
    diagonal_only(backend, PV_DTYPES.index(pv_dtype), (torch.float16, torch.bfloat16, torch.float32).index(dtype))
    for nq, nk in ((333, 333), (1, 77)):
        q, k, v = make_qkv(b=1, hq=8, hkv=1, nq=nq, nk=nk, d=128, dtype=dtype, seed=nq)
        nhd = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
        out = torch_kernels.quantized_attention(*nhd, layout="NHD", sm_scale=0.1, pv_dtype=pv_dtype,
                                                implementation=backend)
        cos, l1 = accuracy(out.transpose(1, 2), sdpa_float32(q, k, v, sm_scale=0.1))
        report(f"{dtype} NHD MQA Nq={nq} Nk={nk} {pv_dtype}", cos, l1)
        min_cos, max_l1 = GATES[pv_dtype]
        assert cos >= min_cos and l1 <= max_l1, (nq, cos, l1)


# what each case offsets, the smoothing that undoes it, make_qkv's inputs, and whether unsmoothed
# both gate figures fail (keys) or at least one (queries)
OFFSET_CASES = {
    "keys": ("smooth_k", dict(hkv=4, key_offset=KEY_OFFSET, seed=3), True),
    "queries": ("smooth_q", dict(hkv=2, key_offset=KEY_OFFSET, query_offset=QUERY_OFFSET, seed=5), False),
}


@pytest.mark.covering
@pytest.mark.parametrize("offsets", OFFSET_CASES)
@pytest.mark.parametrize("pv_dtype", PV_DTYPES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_offsets_need_smoothing(backend, granularity, pv_dtype, offsets):
    """Keys or queries with large per-channel offsets (as in LLMs; SmolLM2's queries have them):
    unsmoothed int8 rows spend their range on the offset and fail the gate; smoothed ones (for
    queries, the offset's scores returned as a key bias) pass it."""
    require_backend(backend)
    diagonal_only(backend, GRANULARITIES.index(granularity), PV_DTYPES.index(pv_dtype))
    option, inputs, both_fail = OFFSET_CASES[offsets]
    q, k, v = make_qkv(b=1, hq=4, nq=190, nk=190, d=128, dtype=torch.bfloat16, **inputs)
    want = sdpa_float32(q, k, v, causal=True)
    min_cos, max_l1 = GATES[pv_dtype]
    figures = {}
    for smooth in (True, False):
        out = torch_kernels.quantized_attention(q, k, v, causal=True, granularity=granularity, pv_dtype=pv_dtype,
                                                implementation=backend, **{option: smooth})
        figures[smooth] = accuracy(out, want)
        report(f"{offsets} offsets {granularity} {pv_dtype} {option}={smooth}", *figures[smooth])
    cos, l1 = figures[True]
    assert cos >= min_cos and l1 <= max_l1, figures
    cos, l1 = figures[False]
    fails = (cos < min_cos, l1 > max_l1)
    assert all(fails) if both_fail else any(fails), figures


def test_fp8_gate_is_the_operand_rounding():
    """The fp8 gate's justification: exact float32 scores and softmax, then P and V rounded to
    float8_e4m3fn as the FP8 MMA reads them (V per channel, P scaled by 448), already lose about
    0.035 relative L1 on random inputs (V's rounding alone about 0.026): the floor of any FP8 P.V.
    The kernel's int8 Q K^T adds little to it, and the gate leaves it 1.6x room."""
    q, k, v = make_qkv(b=2, hq=4, hkv=2, nq=200, nk=200, d=128, dtype=torch.float32, seed=4)
    v8, scale = reference.quantize_values_fp8(v.flatten(0, 1))
    v_rounded = (v8.float() * scale[:, None, :]).view(v.shape)
    want = sdpa_float32(q, k, v)
    p = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 128 ** -0.5).softmax(dim=-1)
    p_rounded = (p * reference.FP8_MAX).to(torch.float8_e4m3fn).float() / reference.FP8_MAX
    v_floor = accuracy(sdpa_float32(q, k, v_rounded), want)
    floor = accuracy(p_rounded @ v_rounded.repeat_interleave(2, dim=1), want)
    kernel = accuracy(torch_kernels.quantized_attention(q, k, v, pv_dtype="fp8"), want)
    report("V rounded to e4m3", *v_floor)
    report("P and V rounded to e4m3 (exact scores)", *floor)
    report("fp8 kernel", *kernel)
    assert v_floor[1] < floor[1] < 0.045 and kernel[1] < 1.15 * floor[1] and kernel[1] * 1.6 < GATES["fp8"][1]


# ---- the definitions ----

def test_quantization_groups_and_scales():
    """Every group's largest |value| maps to +-127, scales are amax / 127 per group, sm_scale *
    log2(e) is folded into Q's scales, and the groups are the documented rows."""
    gen = torch.Generator().manual_seed(5)
    assert reference.row_groups(130, "q", "per_block")[0].tolist() == [0] * 128 + [1] * 2
    assert reference.row_groups(70, "k", "per_block")[0].tolist() == [0] * 64 + [1] * 6
    assert reference.row_groups(40, "q", "per_warp")[0].tolist() == [0] * 32 + [1] * 8
    groups, count = reference.row_groups(40, "q", "per_thread")
    assert count == 16 and groups[:32].tolist() == list(range(8)) * 4 and groups[32:].tolist() == list(range(8, 16))
    groups, count = reference.row_groups(70, "k", "per_thread")
    assert count == 8 and groups[:8].tolist() == [0, 0, 1, 1, 2, 2, 3, 3] and groups[64:].tolist() == [4, 4, 5, 5, 6, 6]
    q = torch.randn(3, 130, 64, generator=gen, dtype=torch.float64).half()
    q[1] = 0  # an all-zero group: scale 1, entries 0
    for granularity in GRANULARITIES:
        q8, scale = reference.quantize_queries(q, None, 0.125, granularity)
        group, _ = reference.row_groups(130, "q", granularity)
        folded = q.float() * torch.tensor(0.125 * reference.LOG2E, dtype=torch.float32).item()
        for g in group.unique():
            rows = group == g
            assert torch.all(scale[:, rows] == scale[:, rows][:, :1])
            assert q8[0][rows].abs().max() == 127 and torch.all(q8[1] == 0) and torch.all(scale[1] == 1)
            torch.testing.assert_close(scale[0, rows][0], folded[0][rows].abs().max() / 127)
        assert torch.equal(q8.float(), (folded / scale[..., None]).round())
        assert (q8.float() * scale[..., None] - folded).abs().max() <= scale.max() / 2 * 1.0001


def test_value_scale_is_the_least_power_of_two():
    """fp16 P.V's V scale: 1 within float16's range (and for inf / NaN maxima), else the least power
    of two bringing the max within 65504; per packed sequence with cu_seqlens."""
    amax = [65504.0, 65505.0, 131008.0, 131009.0, 3.0e38, torch.finfo(torch.float32).max, math.inf, math.nan, 1.0,
            0.0]
    want = [1.0, 2.0, 2.0, 4.0, 2.0**112, 2.0**113, 1.0, 1.0, 1.0, 1.0]
    v = torch.tensor(amax).view(1, 1, 1, -1) * torch.tensor([1.0, -0.5]).view(1, 1, 2, 1)
    assert reference.value_scale(v).flatten().tolist() == want
    cu = torch.tensor([0, 1, 1, 2])  # an empty sequence between two
    packed = reference.value_scale(torch.cat([v[:, :, :1], v[:, :, :1] / 2**10], dim=2), cu)
    assert packed[:, 0].tolist() == [want, [1.0] * len(want), [1.0, 1.0, 1.0, 1.0, 2.0**102, 2.0**103, 1.0, 1.0, 1.0,
                                                               1.0]]


def test_smoothing_and_int8_matmul_are_exact():
    """Smoothed keys and queries are centred, the key bias is exactly the scores Q smoothing took
    out, and the emulated int8 GEMM equals int32 accumulation (torch._int_mm)."""
    gen = torch.Generator().manual_seed(6)
    k = torch.randn(2, 3, 50, 16, generator=gen) + 30
    q = torch.randn(2, 6, 40, 16, generator=gen) - 20
    k_mean, q_mean, bias = reference.smoothing(q, k, 0.3, True, True)
    k8, _ = reference.quantize_keys(k[0], k_mean[0], "per_block")
    q8, _ = reference.quantize_queries(q[0], q_mean[0], 0.3, "per_block")
    assert k8.float().mean(dim=1).abs().max() < 2 and q8.float().mean(dim=1).abs().max() < 2  # the offsets are gone
    k_s = k.double() - k.double().mean(dim=2, keepdim=True)
    exact = q.double().mean(dim=2, keepdim=True) @ k_s.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.3 * reference.LOG2E
    torch.testing.assert_close(bias, exact.squeeze(2).float(), rtol=1e-5, atol=1e-4)
    cu = torch.tensor([0, 20, 20, 50])  # packed: each key takes its own sequence's means
    packed_k, packed_q = k[:1].repeat(1, 1, 1, 1), q[:1, :, :50].repeat(1, 1, 1, 1)
    k_mean, q_mean, bias = reference.smoothing(packed_q, packed_k, 0.3, True, True, cu, cu)
    for s, (start, end) in enumerate([(0, 20), (20, 20), (20, 50)]):
        if end > start:
            _, _, want = reference.smoothing(packed_q[:, :, start:end], packed_k[:, :, start:end], 0.3, True, True)
            torch.testing.assert_close(bias[:, :, start:end], want, rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(q_mean[s], packed_q[0, :, start:end].mean(dim=1))
    assert torch.all(q_mean[1] == 0) and torch.all(k_mean[1] == 0)
    a = torch.randint(-127, 128, (3, 33, 256), generator=gen, dtype=torch.int8)
    b = torch.randint(-127, 128, (3, 256, 65), generator=gen, dtype=torch.int8)
    s = reference.int8_matmul(a, b)
    assert s.dtype == torch.int32
    assert torch.equal(s, torch.stack([torch._int_mm(x.contiguous(), y.contiguous()) for x, y in zip(a, b)])) \
        if hasattr(torch, "_int_mm") else torch.equal(s.long(), (a.long()[..., None] * b.long()[:, None]).sum(2))


@pytest.mark.parametrize("pv_dtype", PV_DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_online_softmax_matches_untiled_definition(backend, pv_dtype):
    """The tiled float32 online softmax against one float64 softmax over the same int8 scores; the
    tolerance is P's rounding (none for float32 'none', float16's, e4m3's)."""
    require_backend(backend)
    tolerance = {"none": 1e-5, "fp16": 2e-3, "fp8": 0.05}[pv_dtype]
    for causal in (False, True):
        q, k, v = make_qkv(b=2, hq=6, hkv=3, nq=97, nk=201, d=64, dtype=torch.float32, key_offset=3.0, seed=7)
        smoothing = reference.smoothing(q, k, 0.125, True, True)
        out, lse = torch_kernels.quantized_attention(q, k, v, causal=causal, granularity="per_thread",
                                                     pv_dtype=pv_dtype, return_lse=True, implementation=backend)
        want, want_lse = reference.quantized_attention_naive(q, k, v, *smoothing, 0.125, causal, "per_thread",
                                                             pv_dtype)
        assert accuracy(out, want)[1] <= tolerance
        torch.testing.assert_close(lse, want_lse.float(), rtol=1e-5, atol=1e-4)


# changes that make the offsets of three packed sequences (Nq = 30, Nk = 40) not add up, and the
# full mode's message for each
BAD_OFFSETS = {"q decreasing": (dict(cu_seqlens_q=[0, 18, 10, 30]), "cu_seqlens_q: expected non-decreasing offsets"),
               "k not from 0": (dict(cu_seqlens_k=[1, 25, 30, 40]), "cu_seqlens_k: expected to start at 0"),
               "k not to Nk": (dict(cu_seqlens_k=[0, 25, 30, 39]),
                               "cu_seqlens_k: expected to end at the 40 packed tokens")}


@pytest.mark.parametrize("backend", backend_params("quantized_attention", skip={
    "pallas": "the checks are the op layer's, shared by every backend, and pallas' interpreted kernels compile for "
              "each call's offsets here (30 s)"}))
def test_deferred_mode_makes_bad_offsets_nan(backend):
    """In the deferred check mode the packed offsets are checked on the device: good ones give the
    full mode's results bit for bit and, on Triton (the accelerator's path), nothing is read on the
    host; offsets that do not add up raise nothing at the call and make the output, the lse and
    every gradient NaN (the sequences' rows cannot be told apart). ``raise_deferred_errors()``
    then raises the full mode's error, less the value."""
    require_backend(backend)
    q, k, v = make_qkv(b=1, nq=30, nk=40, seed=14, requires_grad=True)
    good = dict(cu_seqlens_q=torch.tensor([0, 10, 18, 30], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 25, 30, 40], dtype=torch.int32))

    def call(offsets):
        return torch_kernels.quantized_attention(q, k, v, causal=True, return_lse=True, implementation=backend,
                                                 **offsets)

    want = call(good)
    with torch_kernels.checks("deferred"), HostReads() as guard:
        got = call(good)
    torch_kernels.raise_deferred_errors()  # nothing recorded
    assert backend != "triton" or not guard.reads, f"read on the host: {guard.reads}"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for case, (change, message) in BAD_OFFSETS.items():
        offsets = {**good, **{name: torch.tensor(o, dtype=torch.int32) for name, o in change.items()}}
        with torch_kernels.checks("deferred"), HostReads() as guard:
            out, lse = call(offsets)
            grads = torch.autograd.grad([out, lse], [q, k, v], [torch.ones_like(out), torch.ones_like(lse)])
        assert backend != "triton" or not guard.reads, f"{case}: read on the host: {guard.reads}"
        for name, t in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
            assert t.isnan().all(), f"{case}: {name} is not all NaN"
        with pytest.raises(ValueError, match=f"^{re.escape(message)} \\(found by a deferred check\\)$"):
            torch_kernels.raise_deferred_errors()


@pytest.mark.parametrize("backend", BACKENDS)
def test_varlen_equals_per_sequence_calls(backend):
    """Packed sequences (NHD, B = 1) attend only within themselves: equal to calling each alone.
    Lengths include an empty query sequence, Nq < Nk, Nq > Nk (causal rows with no key) and an
    empty key sequence."""
    require_backend(backend)
    q_lens, k_lens = [37, 0, 130, 70, 5, 9], [50, 20, 130, 70, 3, 0]
    hq, hkv, d = 4, 2, 64
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(1, sum(q_lens), hq, d, generator=gen).half()
    k = (torch.randn(1, sum(k_lens), hkv, d, generator=gen) + 5).half()
    v = torch.randn(1, sum(k_lens), hkv, d, generator=gen).half()
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens).cumsum(0).to(torch.int32)
    for causal, granularity, pv_dtype in ((True, "per_thread", "fp16"), (False, "per_block", "fp8")):
        out, lse = torch_kernels.quantized_attention(q, k, v, causal=causal, layout="NHD", granularity=granularity,
                                                     pv_dtype=pv_dtype, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                                     return_lse=True, implementation=backend)
        for s in range(len(q_lens)):
            rows, keys = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
            if q_lens[s] == 0:
                continue
            if k_lens[s] == 0:
                assert torch.all(out[:, rows] == 0) and torch.all(lse[:, :, rows] == -math.inf)
                continue
            alone, alone_lse = torch_kernels.quantized_attention(
                q[:, rows], k[:, keys], v[:, keys], causal=causal, layout="NHD", granularity=granularity,
                pv_dtype=pv_dtype, return_lse=True, implementation=backend)
            # one rounding apart at most: where the interpreter's blocks follow the row count the
            # packed launch's tiles are taller, so a float32 sum may round differently once
            torch.testing.assert_close(out[:, rows], alone, rtol=2**-10, atol=2**-24)
            torch.testing.assert_close(lse[:, :, rows], alone_lse, rtol=2**-22, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_rows_without_keys(backend):
    """Bottom-right causal with Nq > Nk: the first Nq - Nk rows see no key (0, lse -inf); no keys at all likewise."""
    require_backend(backend)
    q, k, v = make_qkv(b=1, hq=2, hkv=1, nq=40, nk=25, d=64, seed=9)
    out, lse = torch_kernels.quantized_attention(q, k, v, causal=True, return_lse=True, implementation=backend)
    assert torch.all(out[:, :, :15] == 0) and torch.all(lse[:, :, :15] == -math.inf)
    cos, l1 = accuracy(out[:, :, 15:], sdpa_float32(q[:, :, 15:], k, v, causal=True))
    assert cos >= 0.999 and l1 <= 0.03
    out, lse = torch_kernels.quantized_attention(q, k[:, :, :0], v[:, :, :0], return_lse=True, implementation=backend)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_spreads_over_its_quantization_group(backend):
    """A NaN is never dropped: it reaches the rows that share its int8 scale (with Q smoothing, its
    whole head, through the mean), and only those."""
    require_backend(backend)
    q, k, v = make_qkv(b=1, hq=2, hkv=1, nq=200, nk=200, d=64, dtype=torch.float32, seed=26)
    q[0, 1, 5, 3] = float("nan")  # query group 0 (rows 0-127) of head 1
    bad = torch_kernels.quantized_attention(q, k, v, smooth_q=False, implementation=backend).isnan().any(dim=-1)[0]
    assert bad[1, :128].all() and not bad[1, 128:].any() and not bad[0].any()
    bad = torch_kernels.quantized_attention(q, k, v, implementation=backend).isnan().any(dim=-1)[0]
    assert bad[1].all() and not bad[0].any()
    q[0, 1, 5, 3] = 0.0
    k[0, 0, 70, 1] = float("inf")  # key group 1 (keys 64-127): causal rows 64.. see it
    for smooth_k, first_bad in ((False, 64), (True, 0)):
        bad = torch_kernels.quantized_attention(q, k, v, causal=True, smooth_k=smooth_k,
                                                implementation=backend).isnan().any(dim=-1)[0]
        assert bad[:, first_bad:].all() and not bad[:, :first_bad].any(), smooth_k
    k[0, 0, 70, 1] = 0.0
    v[0, 0, 150, 2] = float("nan")
    for pv_dtype in PV_DTYPES:  # rows that attend to it; earlier ones may be NaN too (0 * NaN in a tile)
        out = torch_kernels.quantized_attention(q, k, v, causal=True, pv_dtype=pv_dtype, implementation=backend)
        assert out[0, :, 150:].isnan().any(dim=-1).all(), pv_dtype


def each_channel_at(v: torch.Tensor, value: float, cu: list[int]) -> torch.Tensor:
    """``v`` with every (sequence, head, channel)'s max |v| scaled to ``value`` (in v's dtype)."""
    parts = [v[:, :, a:b].float() for a, b in zip(cu, cu[1:])]
    return torch.cat([p / p.abs().amax(dim=2, keepdim=True) * value for p in parts], dim=2).to(v.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_values_beyond_float16_range(backend, dtype):
    """``pv_dtype="fp16"`` with |V| past float16's 65504 (float32 and bfloat16 inputs): no NaN,
    within the fp16 gate of float32 SDPA, through quantized_sdpa too. V is divided by a power of
    two per (sequence, kv head, channel), 1 where it fits: channels at max |v| 60000 multiplied by
    2^20 give exactly 2^20 times their output, and packed sequences scale each on its own."""
    require_backend(backend)
    q, k, v = make_qkv(b=1, hq=4, hkv=2, nq=70, nk=70, d=64, dtype=dtype, seed=40)
    cu = [0, 30, 70]
    v = each_channel_at(v, 60000.0, cu)
    fits = torch_kernels.quantized_attention(q, k, v, implementation=backend)
    big = v * 2**20
    out = torch_kernels.quantized_attention(q, k, big, implementation=backend)
    assert not out.isnan().any()
    cos, l1 = accuracy(out, sdpa_float32(q, k, big))
    report(f"{backend} {dtype} |V| to 6e4 * 2^20", cos, l1)
    assert cos >= GATES["fp16"][0] and l1 <= GATES["fp16"][1]
    assert torch.equal(out, fits * 2**20)
    sdpa = torch_kernels.quantized_sdpa(q, k, big, enable_gqa=True, force_quantized=True, implementation=backend)
    assert torch.equal(sdpa, out)
    offsets = torch.tensor(cu, dtype=torch.int32)
    packed = dict(cu_seqlens_q=offsets, cu_seqlens_k=offsets, implementation=backend)
    alone = torch_kernels.quantized_attention(q, k, v, **packed)
    mixed = torch_kernels.quantized_attention(q, k, torch.cat([big[:, :, :30], v[:, :, 30:]], dim=2), **packed)
    assert torch.equal(mixed[:, :, :30], alone[:, :, :30] * 2**20)
    assert torch.equal(mixed[:, :, 30:], alone[:, :, 30:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_matches_float32_logsumexp(backend):
    """The natural-log lse of the unsmoothed scores, also with large key offsets (the smoothing
    correction added back)."""
    require_backend(backend)
    for key_offset, causal in ((0.0, False), (KEY_OFFSET, True)):
        q, k, v = make_qkv(b=2, hq=4, hkv=2, nq=77, nk=150, d=96, dtype=torch.bfloat16, key_offset=key_offset, seed=10)
        want = logsumexp_float32(q, k, causal)
        for granularity in GRANULARITIES:
            _, lse = torch_kernels.quantized_attention(q, k, v, causal=causal, granularity=granularity,
                                                       return_lse=True, implementation=backend)
            assert lse.dtype == torch.float32 and lse.shape == (2, 4, 77)
            error = (lse - want).abs().max().item()
            print(f"\nlse key_offset={key_offset} {granularity}: max |error| {error:.4f}", end="")
            assert error < 0.02


@pytest.mark.parametrize("backend", BACKENDS)
def test_lse_combines_like_ring_attention(backend):
    """Two halves of the keys attended separately, merged by their lse, pass the gate against the
    whole attention (how context-parallel attention composes)."""
    require_backend(backend)
    q, k, v = make_qkv(b=1, hq=4, hkv=4, nq=120, nk=240, d=64, dtype=torch.float16, key_offset=5.0, seed=11)
    parts = [torch_kernels.quantized_attention(q, k[:, :, i:i + 120], v[:, :, i:i + 120], return_lse=True,
                                               implementation=backend) for i in (0, 120)]
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    merged = sum(out.float() * torch.exp(part_lse - lse)[..., None] for out, part_lse in parts)
    cos, l1 = accuracy(merged, sdpa_float32(q, k, v))
    report("two halves merged by lse", cos, l1)
    assert cos >= 0.999 and l1 <= 0.03


# ---- gradients ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_against_float32_sdpa(backend, dtype):
    """The straight-through backward is exact attention's gradient: against float32 SDPA autograd
    on the same inputs, by relative RMSE (the inputs' precision is all that differs); gradients
    through the lse included."""
    require_backend(backend)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    for causal in (False, True):
        q, k, v = make_qkv(b=2, hq=4, hkv=2, nq=70, nk=101, d=64, dtype=dtype, key_offset=2.0, seed=12,
                           requires_grad=True)
        out, lse = torch_kernels.quantized_attention(q, k, v, causal=causal, return_lse=True, implementation=backend)
        gen = torch.Generator().manual_seed(13)
        d_out, d_lse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
        got = torch.autograd.grad((out.float() * d_out).sum() + (lse * d_lse).sum(), (q, k, v))
        leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
        want_out = sdpa_float32(*leaves, causal=causal)
        want_lse = logsumexp_float32(leaves[0], leaves[1], causal)
        want = torch.autograd.grad((want_out * d_out).sum() + (want_lse * d_lse).sum(), leaves)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            error = relative_rmse(a, b)
            print(f"\n{dtype} {'causal' if causal else 'full'} {name}: relative RMSE {error:.2e}", end="")
            assert a.dtype == dtype and error < tolerance, (name, error)


def test_varlen_gradients_stay_within_sequences():
    """A packed sequence's output has no gradient in another's inputs, and its own equal SDPA's."""
    q_lens, k_lens = [20, 45], [30, 45]
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(1, 4, 65, 64, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, 75, 64, generator=gen, requires_grad=True)
    v = torch.randn(1, 2, 75, 64, generator=gen, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 20, 65], dtype=torch.int32), torch.tensor([0, 30, 75], dtype=torch.int32)
    out = torch_kernels.quantized_attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    got = torch.autograd.grad(out[:, :, :20].sum(), (q, k, v))  # only the first sequence's output
    assert torch.all(got[0][:, :, 20:] == 0) and torch.all(got[1][:, :, 30:] == 0) and torch.all(got[2][:, :, 30:] == 0)
    leaves = [t.detach()[:, :, :n].requires_grad_() for t, n in zip((q, k, v), (q_lens[0], k_lens[0], k_lens[0]))]
    want = torch.autograd.grad(sdpa_float32(*leaves, causal=True).sum(), leaves)
    for a, b, n in zip(got, want, (20, 30, 30)):
        assert relative_rmse(a[:, :, :n], b) < 1e-5


# ---- quantized_sdpa ----

def test_quantized_sdpa_swaps_for_sdpa():
    """The quantized path equals quantized_attention, options included; on CPU tensors it runs only
    when forced (exact SDPA otherwise); every fallback equals SDPA itself, forced or not."""
    q, k, v = make_qkv(b=2, hq=8, hkv=2, nq=90, nk=90, d=64, dtype=torch.bfloat16, seed=15)
    out = torch_kernels.quantized_sdpa(q, k, v, is_causal=True, enable_gqa=True, force_quantized=True)
    assert torch.equal(out, torch_kernels.quantized_attention(q, k, v, causal=True))
    cos, l1 = accuracy(out, F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                           enable_gqa=True))
    assert cos >= 0.999 and l1 <= 0.03
    options = dict(granularity="per_thread", pv_dtype="fp8", smooth_k=False, smooth_q=False)
    assert torch.equal(torch_kernels.quantized_sdpa(q, k, v, enable_gqa=True, force_quantized=True, **options),
                       torch_kernels.quantized_attention(q, k, v, **options))
    assert not torch.equal(out, torch_kernels.quantized_sdpa(q, k, v, is_causal=True, enable_gqa=True,
                                                             force_quantized=True, **options))
    assert not ops.quantizing_pays(q)  # CPU: exact SDPA, the options unused
    assert torch.equal(torch_kernels.quantized_sdpa(q, k, v, is_causal=True, enable_gqa=True, **options),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    # masks, dropout, top-left causal with L != S and non-4D inputs are SDPA's own, unquantized
    mask = torch.rand(90, 90, generator=torch.Generator().manual_seed(16)) > 0.3
    for kwargs, (qq, kk, vv) in (
        (dict(attn_mask=mask, enable_gqa=True), (q, k, v)),
        (dict(attn_mask=torch.randn(90, 90).to(q.dtype), enable_gqa=True), (q, k, v)),
        (dict(is_causal=True, enable_gqa=True), (q[:, :, :30], k, v)),
        (dict(), (q[0, :2], k[0], v[0])),
    ):
        torch.testing.assert_close(torch_kernels.quantized_sdpa(qq, kk, vv, force_quantized=True, **kwargs),
                                   F.scaled_dot_product_attention(qq, kk, vv, **kwargs), rtol=0, atol=0)
    torch.manual_seed(17)
    dropped = torch_kernels.quantized_sdpa(q, k, v, dropout_p=0.5, enable_gqa=True, force_quantized=True)
    torch.manual_seed(17)
    torch.testing.assert_close(dropped, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, enable_gqa=True))
    with pytest.raises(RuntimeError):  # SDPA's own error for heads that differ without enable_gqa
        torch_kernels.quantized_sdpa(q, k, v, force_quantized=True)


# ---- the op contract ----

@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    """Both ops, with and without packed sequences."""
    require_backend(backend)
    q, k, v = make_qkv(b=1, hq=4, hkv=2, nq=33, nk=47, d=64, dtype=torch.float32, seed=18, requires_grad=True)
    op = torch.ops.torch_kernels.quantized_attention.default
    run_opcheck(op, (q, k, v, 0.125, True, "per_warp", "fp8", True, None, None, backend))
    cu_q, cu_k = torch.tensor([0, 13, 33], dtype=torch.int32), torch.tensor([0, 20, 47], dtype=torch.int32)
    run_opcheck(op, (q, k, v, 0.125, False, "per_block", "fp16", False, cu_q, cu_k, backend))
    d_out, d_lse = torch.randn(q.shape), torch.randn(q.shape[:3])
    run_opcheck(torch.ops.torch_kernels.quantized_attention_backward.default,
                (d_out, d_lse, q.detach(), k.detach(), v.detach(), 0.125, True, None, None, backend))


class AttentionBlock(torch.nn.Module):
    """Projections around quantized_attention (NHD, causal, GQA) and quantized_sdpa (HND)."""

    def __init__(self, hidden=64, heads=4, kv_heads=2, head_size=64):
        """Random projections for ``heads`` query and ``kv_heads`` key/value heads."""
        super().__init__()
        torch.manual_seed(19)
        self.heads, self.kv_heads, self.head_size = heads, kv_heads, head_size
        self.q = torch.nn.Linear(hidden, heads * self.head_size)
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * self.head_size)
        self.o = torch.nn.Linear(heads * self.head_size, hidden)

    def forward(self, x):
        """``x [B, N, hidden]`` -> ``[B, N, hidden]``."""
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.head_size)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.head_size).unbind(2)
        a = torch_kernels.quantized_attention(q, k, v, causal=True, layout="NHD", granularity="per_thread")
        s = torch_kernels.quantized_sdpa(*(t.transpose(1, 2) for t in (q, k, v)), enable_gqa=True,
                                         force_quantized=True).transpose(1, 2)
        return self.o((a + s).reshape(b, n, -1))


def test_compile_fullgraph_forward_and_backward():
    """Inductor, fullgraph: the block's output and every gradient equal eager's."""
    assert_compiled_matches_eager(AttentionBlock(), torch.randn(2, 37, 64, generator=torch.Generator().manual_seed(20)))


def test_compile_dynamic_shapes_and_scale():
    """No graph break or failure when lengths and sm_scale are symbolic (dynamic=True)."""
    def attend(q, k, v, scale):
        return torch_kernels.quantized_attention(q, k, v, sm_scale=scale, causal=True, layout="NHD")

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, dynamic=True, backend="aot_eager")
    for n, scale in ((40, 0.1), (53, 0.2)):
        q, k, v = (t.transpose(1, 2).requires_grad_() for t in make_qkv(b=1, nq=n, nk=n, dtype=torch.float32, seed=n))
        out = compiled(q, k, v, scale)
        assert torch.equal(out, attend(q, k, v, scale))
        out.sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_profiler_names_op_and_backend(backend):
    """The forward and backward ops and the backend that ran them, by name."""
    require_backend(backend)
    q, k, v = make_qkv(nq=20, nk=20, seed=21, dtype=torch.float32, requires_grad=True)

    def step():
        torch_kernels.quantized_attention(q, k, v, implementation=backend).sum().backward()

    names = profiled_names(step)
    for op in ("quantized_attention", "quantized_attention_backward"):
        assert f"torch_kernels::{op}" in names and f"torch_kernels::{op}[{backend}]" in names, op


def test_flop_counter_counts_visible_pairs():
    """4 Hq D per visible (query, key) pair forward, 2.5x that backward; the byte formula."""
    b, hq, d = 2, 4, 64
    q, k, v = make_qkv(b=b, hq=hq, hkv=2, nq=50, nk=70, d=d, dtype=torch.float32, seed=22, requires_grad=True)
    assert counted_flops(lambda: torch_kernels.quantized_attention(q, k, v)) == 4 * b * hq * 50 * 70 * d
    # bottom-right causal: query i sees i + 21 keys
    causal_pairs = sum(i + 21 for i in range(50))
    assert counted_flops(lambda: torch_kernels.quantized_attention(q, k, v, causal=True)) == \
        4 * b * hq * causal_pairs * d
    square = make_qkv(b=1, hq=hq, hkv=2, nq=64, nk=64, d=d, dtype=torch.float32, seed=23)
    assert counted_flops(lambda: torch_kernels.quantized_attention(*square, causal=True)) == 4 * hq * d * 64 * 65 // 2
    assert ops.visible_pairs(40, 25, True) == 25 * 26 // 2
    # forward and the backward's 2.5x
    assert counted_flops(lambda: torch_kernels.quantized_attention(q, k, v).sum().backward()) == \
        4 * b * hq * 50 * 70 * d * 7 // 2
    cu_q, cu_k = torch.tensor([0, 20, 50], dtype=torch.int32), torch.tensor([0, 30, 70], dtype=torch.int32)
    packed = [t[:1].detach() for t in (q, k, v)]
    assert counted_flops(lambda: torch_kernels.quantized_attention(*packed, causal=True, cu_seqlens_q=cu_q,
                                                                    cu_seqlens_k=cu_k)) == \
        4 * hq * d * (ops.visible_pairs(20, 30, True) + ops.visible_pairs(30, 40, True))
    assert ops.quantized_attention_bytes(hq, 2, d, [(50, 70)] * b, 4) == \
        (2 * 2 * 50 * hq + 2 * 2 * 70 * 2) * d * 4 + 4 * 2 * 50 * hq


@pytest.mark.parametrize("backend", ["triton", "pallas", "sycl"])
def test_declined_calls_fall_through(backend):
    """A head size the kernels decline runs on the next backend of the order, and naming the
    declining backend alone fails with its reason."""
    require_backend(backend)
    assert backend in backends.implementations("quantized_attention")
    q, k, v = make_qkv(b=1, hq=2, hkv=1, nq=10, nk=10, d=264, seed=24)
    torch_kernels.quantized_attention(q, k, v, implementation=[backend, "reference"])
    assert backends.last_backend("quantized_attention") == "reference"
    with pytest.raises(RuntimeError, match="264|head size"):
        torch_kernels.quantized_attention(q, k, v, implementation=backend)


# ---- the byte formula, against counts made here ----

def test_quantized_attention_bytes_match_the_analytic_count():
    b, hq, hkv, nq, nk, d = 2, 4, 2, 10, 14, 64
    q = random_tensor(b, hq, nq, d, seed=5)
    k, v = random_tensor(b, hkv, nk, d, seed=6), random_tensor(b, hkv, nk, d, seed=7)
    prof, _ = profiled(lambda: torch_kernels.quantized_attention(q, k, v, causal=True))
    row = only_row(prof, "quantized_attention")
    assert row["bytes"] == ops.quantized_attention_bytes(hq, hkv, d, [(nq, nk)] * b, FLOAT32_BYTES)
    assert row["flops"] == 4 * hq * d * b * sum(min(nk, i + nk - nq + 1) for i in range(nq))

"""Mixture of experts as Triton kernels: routing, gather, combine, grouped GEMMs and the fused layer.

Contract: ``torch_kernels.reference.moe`` (inputs checked and contiguous, indices int64, rows sorted
by expert with cumulative row ends ``offsets``).

Grouped GEMM tiles: expert ``e``'s rows ``offsets[e-1]:offsets[e]`` are cut into ``BM``-row tiles,
the last one short (vLLM's ``moe_align_block_size``: each expert's segment padded to the tile
height, here only virtually: rows past the segment are masked, never stored). Every program
derives its tile's expert and first row from ``offsets`` itself (a prefix sum of the per-expert
tile counts over at most ``MAX_EXPERTS`` lanes), so there is no host sync and no extra launch;
the grid is the bound ``rows // BM + min(segments, rows)`` on the number of tiles and the
programs past the real count return at once. ``grouped_mm`` adds a last segment, the rows past
``offsets[-1]``, whose tiles store zeros.

``fused_moe`` is three launches: ``gate_up_kernel`` gathers each row's token from ``x``, multiplies
it by the gate and up halves of ``w13`` (two accumulators over one ``x`` tile) and writes the
activation ``h`` in x's dtype; ``grouped_mm_kernel`` multiplies ``h`` by ``w2`` and scales each row
by its routing weight (found through ``row_of_slot``) into float32 ``y``; ``combine_kernel`` sums
each token's rows in slot order (deterministic, no atomics).

Precision: float32 accumulation. On a GPU float16/bfloat16 operands enter ``tl.dot`` as they are,
float32 ones as tf32x3 (three tf32 products: float32 accuracy on tensor cores). float8_e4m3fn
weights are widened in registers to the activations' dtype (exact); per-channel scales multiply
the accumulator in the epilogue, ``[bn, bk]`` block scales each K step's partial product (both
exact in float32) unless ``bk`` is not a multiple of 16, where each weight is dequantized on its
own and the dot takes float32 (tf32x3) operands. Under the interpreter (CPU tensors) every
operand is float32 and bfloat16 stores are rounded to nearest even by hand (the interpreter's own
cast truncates).
"""

from __future__ import annotations

import dataclasses
import typing

import torch
import triton
import triton.language as tl

from . import autotune, for_device

MAX_EXPERTS = 1024  # the tile lookup and the router hold all experts in one program's registers
MAX_TOP_K = 64
CLOSED = tl.constexpr(-2 ** 31)  # the router's key of an expert out of the running: below every _order_key
ACTIVATIONS = {"silu": 0, "gelu": 1, "swigluoai": 2}
SCALE_NONE, SCALE_CHANNEL, SCALE_BLOCK, SCALE_ELEMENT = 0, 1, 2, 3
FP8_DTYPES = (torch.float8_e4m3fn,)


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch: a GEMM's tile (``block_m`` rows, ``block_n`` output columns, ``block_k`` of the
    reduction; for the weight gradient ``block_m`` is the step over an expert's rows), the number
    of row tiles walked together (L2 reuse of weight tiles), warps and pipeline stages. The
    row-wise kernels use ``block_m`` x ``block_n`` as rows x columns per program."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


KERNELS = ("router_topk", "moe_gather", "moe_combine", "grouped_mm", "gate_up", "weight_grad")


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(max(1, n)))


def default_config(kernel: str, rows: int, n: int, k: int, num_experts: int, dtype: torch.dtype) -> Config:
    """Heuristic per kernel (``KERNELS``; "grouped_mm" also covers fused_moe's down GEMM) for
    ``rows`` routed rows over ``num_experts`` and an ``[n, k]`` weight per expert (the output
    ``[k, n]`` for "weight_grad"; columns ``n`` for the row-wise kernels). Sized so that every
    GEMM's pipeline fits an A100 block's shared memory (166,912 bytes; tests/test_moe_triton.py
    compiles the real shapes and checks):

    - few rows per expert (decode): 16-row tiles, narrow N and long K steps, so that more
      programs stream the weights, which are the cost;
    - many (prefill): up to 128 x 128 tiles (128 x 64 for the gate/up kernel, whose two
      accumulators make it as wide), eight warps at that size;
    - four stages, three for float32 (tf32x3) past 32 rows, whose tiles are twice as wide; its
      tiles also stop at 64 x 64, past which Ampere's mma.sync spills the split operands.
    """
    wide = dtype == torch.float32
    if kernel in ("grouped_mm", "gate_up"):
        per_expert = rows / max(1, num_experts)
        block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert <= 96 else 128
        block_n = 64 if block_m <= 32 or kernel == "gate_up" else 128
        block_k = 128 if block_m <= 32 else 64
        if wide:
            block_m, block_n, block_k = min(block_m, 64), block_n // 2 if kernel == "gate_up" else 64, 32
        columns = block_n * (2 if kernel == "gate_up" else 1)
        config = Config(block_m=block_m, block_n=block_n, block_k=block_k,
                        num_warps=8 if block_m * columns >= 128 * 128 else 4,
                        num_stages=3 if wide and block_m > 32 else 4)
    elif kernel == "weight_grad":
        config = Config(block_m=32 if wide else 64, block_n=64 if wide else 128, block_k=128, num_warps=8,
                        num_stages=3)
    elif kernel == "router_topk":
        experts = _pow2(num_experts, 2)
        return Config(block_m=max(1, min(16, 4096 // experts)), block_n=experts, block_k=16, num_warps=4)
    elif kernel in ("moe_gather", "moe_combine"):
        block_n = min(1024, _pow2(n))
        return Config(block_m=max(1, 2048 // block_n), block_n=block_n, block_k=16, num_warps=4)
    else:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    # no tile wider than the problem (tl.dot's smallest is 16)
    return dataclasses.replace(config, block_n=min(config.block_n, _pow2(n)), block_k=min(config.block_k, _pow2(k)))


# ---- shared pieces ----

@triton.jit
def _to_store(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 ``x`` rounded to ``dtype``; the interpreter's bfloat16 cast truncates, so there the
    rounding to nearest even is done on the bits first (the cast then only drops zeros)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _mma(acc, a, b, LOW: tl.constexpr):
    """``acc + a @ b``: 16-bit operands as they are when LOW, else float32 as tf32x3 (never plain tf32)."""
    if LOW:
        return tl.dot(a, b, acc)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32x3")


@triton.jit
def _expert_tile(offsets_ptr, pid_m, num_experts, num_rows, EP: tl.constexpr, BM: tl.constexpr, TAIL: tl.constexpr):
    """``(segment, first row, end row)`` of row tile ``pid_m``: segment ``e < num_experts`` is
    expert ``e``'s rows, segment ``num_experts`` (with TAIL) the rows past ``offsets[-1]``; each cut
    into ``BM``-row tiles in order. A segment past the last is an idle tile (beyond the real count)."""
    seg = tl.arange(0, EP)
    prev = tl.load(offsets_ptr + seg - 1, mask=(seg >= 1) & (seg <= num_experts), other=0).to(tl.int32)
    ends = tl.load(offsets_ptr + seg, mask=seg < num_experts, other=0).to(tl.int32)
    if TAIL:
        ends = tl.where(seg == num_experts, num_rows, ends)
        live = seg <= num_experts
    else:
        live = seg < num_experts
    tiles = tl.where(live, (ends - prev + BM - 1) // BM, 0)
    tile_end = tl.cumsum(tiles, axis=0)
    segment = tl.sum((tile_end <= pid_m).to(tl.int32), axis=0)
    here = seg == segment
    tile_start = tl.sum(tl.where(here, tile_end - tiles, 0), axis=0)
    first = tl.sum(tl.where(here, prev, 0), axis=0) + (pid_m - tile_start) * BM
    return segment, first, tl.sum(tl.where(here, ends, 0), axis=0)


@triton.jit
def _swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Row tile and column tile of program ``pid``: ``GROUP_M`` row tiles sweep the columns
    together, so neighbouring programs share weight tiles in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _weight_tile(w_ptrs, scale_base, ks, k0, cols, k_ok, col_ok, K, N, SCALE: tl.constexpr, SCALE_BN: tl.constexpr,
                 SCALE_BK: tl.constexpr, DT: tl.constexpr):
    """A ``[BK, BN]`` weight tile as a dot operand of dtype ``DT``; float8 entries widened (times
    their block scale when SCALE_ELEMENT: each entry its own, for ``bk`` not a multiple of 16)."""
    w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
    if SCALE == 3:
        k_blocks = tl.cdiv(K, SCALE_BK)
        scale = tl.load(scale_base + (cols // SCALE_BN)[None, :] * k_blocks + ((k0 + ks) // SCALE_BK)[:, None],
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        return (w.to(tl.float32) * scale).to(DT)
    return w.to(DT)


@triton.jit
def _block_scale(scale_base, k0, cols, col_ok, K, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr):
    """The ``[BN]`` block scales of columns ``cols`` for the K step at ``k0`` (inside one block)."""
    return tl.load(scale_base + (cols // SCALE_BN) * tl.cdiv(K, SCALE_BK) + k0 // SCALE_BK, mask=col_ok, other=0.0)


@triton.jit
def _routing_weight(rows, row_ok, token_of_row_ptr, row_of_slot_ptr, weights_ptr, top_k, KP: tl.constexpr):
    """Each row's routing weight: its token's slot whose row it is (searched among the ``top_k``)."""
    token = tl.load(token_of_row_ptr + rows, mask=row_ok, other=0)
    js = tl.arange(0, KP)
    slot = token[:, None] * top_k + js[None, :]
    ok = row_ok[:, None] & (js < top_k)[None, :]
    row_of_slot = tl.load(row_of_slot_ptr + slot, mask=ok, other=-1)
    weight = tl.load(weights_ptr + slot, mask=ok, other=0.0)
    return tl.sum(tl.where(row_of_slot == rows[:, None], weight, 0.0), axis=1)


# ---- kernels ----

@triton.jit
def _order_key(x):
    """int32 keys in the order of float32 ``x``, NaN as -inf and -0.0 as 0.0; every key is above
    ``CLOSED``."""
    x = tl.where(x == x, x, float("-inf"))
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits reversed
    return tl.where(key == -1, 0, key)  # -0.0


@triton.jit
def router_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, top_k, num_groups, topk_groups,
    group_size, scaling,
    EP: tl.constexpr, GP: tl.constexpr, KP: tl.constexpr, BT: tl.constexpr, SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr, GROUPED: tl.constexpr, RENORMALIZE: tl.constexpr,
):
    """``BT`` tokens: scores, group selection, then ``top_k`` rounds of argmax. The choice rule of
    ``reference.router_topk``: experts ranked by their logits, or by ``scores + bias`` with a bias;
    NaN ranks as -inf, equal values go to the lowest index; a row with a NaN logit gets NaN
    weights. The ranked values are held as ``_order_key``s, so that an expert out of the running
    (padding, an excluded group, already chosen) can sit below every value, -inf included."""
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    token_ok = tokens < num_tokens
    cols = tl.arange(0, EP)
    col_ok = cols < num_experts
    ok = token_ok[:, None] & col_ok[None, :]
    logits = tl.load(logits_ptr + tokens.to(tl.int64)[:, None] * num_experts + cols[None, :], mask=ok,
                     other=0.0).to(tl.float32)
    logits = tl.where(col_ok[None, :], logits, float("-inf"))  # rows past the tokens stay finite: no NaN
    if SIGMOID:
        scores = tl.sigmoid(logits)
    else:
        exp = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        exp = tl.where(col_ok[None, :], exp, 0.0)
        scores = exp / tl.sum(exp, axis=1)[:, None]
    if HAS_BIAS:
        biased = scores + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    else:
        biased = scores
    if GROUPED:
        # a group's score: its two best biased scores (one if a group has one expert), NaN as -inf
        biased = tl.where(col_ok[None, :] & (biased == biased), biased, float("-inf"))
        group_of = cols // group_size
        groups = tl.arange(0, GP)
        group_score = tl.full([BT, GP], float("-inf"), tl.float32)
        for g in range(num_groups):
            member = tl.where((group_of == g)[None, :], biased, float("-inf"))
            best = tl.max(member, axis=1)
            first = tl.min(tl.where(member == best[:, None], cols[None, :], EP), axis=1)
            score = best
            if group_size > 1:
                score += tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), member), axis=1)
            group_score = tl.where(groups[None, :] == g, score[:, None], group_score)
        group_key = tl.where(groups[None, :] < num_groups, _order_key(group_score), CLOSED)
        kept = tl.zeros([BT, GP], tl.int32)
        for _ in range(topk_groups):
            best = tl.max(group_key, axis=1)
            pick = tl.min(tl.where(group_key == best[:, None], groups[None, :], GP), axis=1)
            chosen = groups[None, :] == pick[:, None]
            kept = tl.where(chosen, 1, kept)
            group_key = tl.where(chosen, CLOSED, group_key)
        allowed = tl.zeros([BT, EP], tl.int32)
        for g in range(num_groups):
            group_kept = tl.max(tl.where(groups[None, :] == g, kept, 0), axis=1)
            allowed = tl.where((group_of == g)[None, :], group_kept[:, None], allowed)
        col_ok = col_ok[None, :] & (allowed > 0)
    choice = tl.where(col_ok, _order_key(biased if HAS_BIAS else logits), CLOSED)
    js = tl.arange(0, KP)
    top_weights = tl.zeros([BT, KP], tl.float32)
    top_ids = tl.zeros([BT, KP], tl.int32)
    for j in range(top_k):
        best = tl.max(choice, axis=1)
        pick = tl.min(tl.where(choice == best[:, None], cols[None, :], EP), axis=1)
        picked = cols[None, :] == pick[:, None]
        weight = tl.sum(tl.where(picked, scores, 0.0), axis=1)
        top_weights = tl.where(js[None, :] == j, weight[:, None], top_weights)
        top_ids = tl.where(js[None, :] == j, pick[:, None], top_ids)
        choice = tl.where(picked, CLOSED, choice)
    if RENORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=1)[:, None]
    out = tokens.to(tl.int64)[:, None] * top_k + js[None, :]
    out_ok = token_ok[:, None] & (js < top_k)[None, :]
    if SIGMOID:  # a NaN logit makes its row NaN here too (under softmax it spreads on its own)
        nan_row = tl.max((scores != scores).to(tl.int32), axis=1) > 0
        top_weights = tl.where(nan_row[:, None], float("nan"), top_weights)
    tl.store(weights_ptr + out, top_weights * scaling, mask=out_ok)
    tl.store(ids_ptr + out, top_ids, mask=out_ok)


@triton.jit
def gather_rows_kernel(x_ptr, token_of_row_ptr, out_ptr, num_rows, H, BR: tl.constexpr, BH: tl.constexpr):
    """Rows ``x[token_of_row[r]]`` (zero where -1), copied as they are."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    row_ok = rows < num_rows
    col_ok = cols < H
    token = tl.load(token_of_row_ptr + rows, mask=row_ok, other=-1)
    values = tl.load(x_ptr + token[:, None] * H + cols[None, :], mask=(token >= 0)[:, None] & col_ok[None, :],
                     other=0.0)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], values, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def combine_kernel(y_ptr, row_of_slot_ptr, weights_ptr, out_ptr, num_tokens, N, top_k,
                   BT: tl.constexpr, BN: tl.constexpr, HAS_WEIGHTS: tl.constexpr, INTERPRETED: tl.constexpr):
    """``out[t] = sum_j weights[t, j] * y[row_of_slot[t, j]]`` in float32, ``j`` in order; a slot
    whose row is -1 adds nothing and its row is not read. Without HAS_WEIGHTS the rows come weighted."""
    tokens = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    token_ok = tokens < num_tokens
    col_ok = cols < N
    acc = tl.zeros([BT, BN], tl.float32)
    for j in range(top_k):
        row = tl.load(row_of_slot_ptr + tokens * top_k + j, mask=token_ok, other=-1)
        used = row >= 0
        term = tl.load(y_ptr + row[:, None] * N + cols[None, :], mask=used[:, None] & col_ok[None, :],
                       other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            term = term * tl.load(weights_ptr + tokens * top_k + j, mask=used, other=0.0)[:, None]
        acc += term
    tl.store(out_ptr + tokens.to(tl.int64)[:, None] * N + cols[None, :],
             _to_store(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=token_ok[:, None] & col_ok[None, :])


@triton.jit
def grouped_mm_kernel(
    a_ptr, w_ptr, out_ptr, offsets_ptr, scale_ptr, token_of_row_ptr, row_of_slot_ptr, weights_ptr,
    num_rows, N, K, num_experts, num_row_tiles, top_k,
    EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    W_KN: tl.constexpr, TAIL: tl.constexpr, SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    ROUTED: tl.constexpr, KP: tl.constexpr, LOW: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """``out[rows of e] = a[rows of e] @ W_e`` for one ``[BM, BN]`` tile; ``W_e`` is ``w[e]`` read
    as ``[K, N]`` (W_KN) or as the transpose of ``[N, K]``. TAIL: rows past ``offsets[-1]`` get
    zeros. ROUTED: each row times its routing weight (fused_moe's down GEMM). SCALE (float8
    weights, ``_scale_mode``): 0 none, 1 per output channel, 2 per block, one per K step, 3 per
    block, entry by entry."""
    pid_m, pid_n = _swizzle(tl.program_id(0), num_row_tiles, tl.cdiv(N, BN), GROUP_M)
    segment, first, end = _expert_tile(offsets_ptr, pid_m, num_experts, num_rows, EP, BM, TAIL)
    if TAIL:
        idle = segment > num_experts
    else:
        idle = segment >= num_experts
    if idle:
        return
    rows = first + tl.arange(0, BM)
    row_ok = rows < end
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < N
    ks = tl.arange(0, BK)
    expert = tl.minimum(segment, num_experts - 1).to(tl.int64)  # the tail reads no weights
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :]
    if W_KN:
        w_ptrs = w_ptr + expert * K * N + ks[:, None] * N + cols[None, :]
        w_step = BK * N
    else:
        w_ptrs = w_ptr + expert * K * N + cols[None, :] * K + ks[:, None]
        w_step = BK
    if SCALE == 1:
        scale_base = scale_ptr + expert * N
    else:
        scale_base = scale_ptr + expert * tl.cdiv(N, SCALE_BN) * tl.cdiv(K, SCALE_BK)
    dt = a_ptr.dtype.element_ty if LOW else tl.float32
    acc = tl.zeros([BM, BN], tl.float32)
    steps = tl.where(segment < num_experts, tl.cdiv(K, BK), 0)
    for step in range(steps):
        k0 = step * BK
        k_ok = ks < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(dt)
        b = _weight_tile(w_ptrs, scale_base, ks, k0, cols, k_ok, col_ok, K, N, SCALE, SCALE_BN, SCALE_BK, dt)
        if SCALE == 2:
            acc += _mma(tl.zeros([BM, BN], tl.float32), a, b, LOW) * _block_scale(
                scale_base, k0, cols, col_ok, K, SCALE_BN, SCALE_BK)[None, :]
        else:
            acc = _mma(acc, a, b, LOW)
        a_ptrs += BK
        w_ptrs += w_step
    if SCALE == 1:
        acc *= tl.load(scale_base + cols, mask=col_ok, other=0.0)[None, :]
    if ROUTED:
        acc *= _routing_weight(rows, row_ok, token_of_row_ptr, row_of_slot_ptr, weights_ptr, top_k, KP)[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :],
             _to_store(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def gate_up_kernel(
    x_ptr, w_ptr, h_ptr, offsets_ptr, scale_ptr, token_of_row_ptr,
    num_rows, I, H, num_experts, num_row_tiles,
    EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ACTIVATION: tl.constexpr, SCALE: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    LOW: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """``h[rows of e, cols] = act(x[tokens] @ w13[e, cols]^T, x[tokens] @ w13[e, I + cols]^T)``:
    one ``x`` tile feeds the gate and the up accumulators; ``h`` in x's dtype. ACTIVATION:
    ``ACTIVATIONS``; SCALE: as ``grouped_mm_kernel``'s."""
    pid_m, pid_n = _swizzle(tl.program_id(0), num_row_tiles, tl.cdiv(I, BN), GROUP_M)
    expert, first, end = _expert_tile(offsets_ptr, pid_m, num_experts, num_rows, EP, BM, False)
    if expert >= num_experts:
        return
    expert = expert.to(tl.int64)
    rows = first + tl.arange(0, BM)
    row_ok = rows < end
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < I
    ks = tl.arange(0, BK)
    token = tl.load(token_of_row_ptr + rows, mask=row_ok, other=0)
    x_ptrs = x_ptr + token[:, None] * H + ks[None, :]
    gate_ptrs = w_ptr + expert * 2 * I * H + cols[None, :] * H + ks[:, None]
    up_ptrs = gate_ptrs + I * H
    if SCALE == 1:
        scale_base = scale_ptr + expert * 2 * I
    else:
        scale_base = scale_ptr + expert * tl.cdiv(2 * I, SCALE_BN) * tl.cdiv(H, SCALE_BK)
    dt = x_ptr.dtype.element_ty if LOW else tl.float32
    gate = tl.zeros([BM, BN], tl.float32)
    up = tl.zeros([BM, BN], tl.float32)
    for step in range(tl.cdiv(H, BK)):
        k0 = step * BK
        k_ok = ks < H - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(dt)
        b_gate = _weight_tile(gate_ptrs, scale_base, ks, k0, cols, k_ok, col_ok, H, 2 * I, SCALE, SCALE_BN,
                              SCALE_BK, dt)
        b_up = _weight_tile(up_ptrs, scale_base, ks, k0, I + cols, k_ok, col_ok, H, 2 * I, SCALE, SCALE_BN,
                            SCALE_BK, dt)
        if SCALE == 2:
            zeros = tl.zeros([BM, BN], tl.float32)
            gate += _mma(zeros, a, b_gate, LOW) * _block_scale(scale_base, k0, cols, col_ok, H, SCALE_BN,
                                                               SCALE_BK)[None, :]
            up += _mma(zeros, a, b_up, LOW) * _block_scale(scale_base, k0, I + cols, col_ok, H, SCALE_BN,
                                                           SCALE_BK)[None, :]
        else:
            gate = _mma(gate, a, b_gate, LOW)
            up = _mma(up, a, b_up, LOW)
        x_ptrs += BK
        gate_ptrs += BK
        up_ptrs += BK
    if SCALE == 1:
        gate *= tl.load(scale_base + cols, mask=col_ok, other=0.0)[None, :]
        up *= tl.load(scale_base + I + cols, mask=col_ok, other=0.0)[None, :]
    if ACTIVATION == 0:
        h = gate * tl.sigmoid(gate) * up
    elif ACTIVATION == 1:
        h = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476)) * up
    else:
        gate = tl.minimum(gate, 7.0)  # gpt-oss's clamped GLU (limit 7, alpha 1.702), as the reference
        up = tl.minimum(tl.maximum(up, -7.0), 7.0)
        h = (up + 1.0) * gate * tl.sigmoid(1.702 * gate)
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * I + cols[None, :],
             _to_store(h, h_ptr.dtype.element_ty, INTERPRETED), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def weight_grad_kernel(
    x_ptr, dy_ptr, out_ptr, offsets_ptr, K, N,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LOW: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """``out[e, ks, ns] = x[rows of e, ks]^T @ dy[rows of e, ns]``: a ``[BK, BN]`` tile per program,
    ``BM`` rows per step over expert ``program_id(1)``'s rows (none: zeros)."""
    num_pid_n = tl.cdiv(N, BN)
    pid_k = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    expert = tl.program_id(1)
    start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0)
    end = tl.load(offsets_ptr + expert)
    ks = pid_k * BK + tl.arange(0, BK)
    ns = pid_n * BN + tl.arange(0, BN)
    k_ok = ks < K
    n_ok = ns < N
    dt = x_ptr.dtype.element_ty if LOW else tl.float32
    acc = tl.zeros([BK, BN], tl.float32)
    for r0 in range(start, end, BM):
        rows = r0 + tl.arange(0, BM)
        row_ok = rows < end
        xt = tl.load(x_ptr + rows[None, :] * K + ks[:, None], mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        dy = tl.load(dy_ptr + rows[:, None] * N + ns[None, :], mask=row_ok[:, None] & n_ok[None, :], other=0.0)
        acc = _mma(acc, xt.to(dt), dy.to(dt), LOW)
    tl.store(out_ptr + expert.to(tl.int64) * K * N + ks[:, None] * N + ns[None, :],
             _to_store(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=k_ok[:, None] & n_ok[None, :])


# ---- launchers ----

# ---- routing: slots sorted by expert, stably, in three launches (count, scan, place) ----

@triton.jit
def _expert_keys(ids_ptr, slots, live, num_experts):
    """Each slot's expert, ``num_experts`` for a dropped one (an id outside the experts: -1)."""
    ids = tl.load(ids_ptr + slots, mask=live, other=-1)
    return tl.where((ids < 0) | (ids >= num_experts), num_experts, ids).to(tl.int32)


@triton.jit
def route_count_kernel(ids_ptr, counts_ptr, num_slots, num_experts, TILE: tl.constexpr, EP: tl.constexpr):
    """Program p: how many of slots ``[TILE p, TILE (p + 1))`` go to each expert (and dropped, at
    ``num_experts``), as row p of ``counts`` [tiles, EP]."""
    pid = tl.program_id(0)
    slots = pid * TILE + tl.arange(0, TILE)
    live = slots < num_slots
    keys = _expert_keys(ids_ptr, slots, live, num_experts)
    tl.store(counts_ptr + pid * EP + tl.arange(0, EP), tl.histogram(keys, EP, mask=live))


@triton.jit
def route_scan_kernel(counts_ptr, bases_ptr, offsets_ptr, num_tiles, num_experts, EP: tl.constexpr):
    """One program: each expert's first row (experts in order, dropped slots last), each tile's
    first row within its experts (``bases``, the tiles before it in order) and ``offsets``, each
    expert's end."""
    experts = tl.arange(0, EP)
    totals = tl.zeros([EP], tl.int32)
    for tile in range(num_tiles):
        totals += tl.load(counts_ptr + tile * EP + experts)
    ends = tl.cumsum(totals, axis=0)
    tl.store(offsets_ptr + experts, ends, mask=experts < num_experts)
    running = ends - totals
    for tile in range(num_tiles):
        tl.store(bases_ptr + tile * EP + experts, running)
        running += tl.load(counts_ptr + tile * EP + experts)


@triton.jit
def route_place_kernel(ids_ptr, bases_ptr, token_of_row_ptr, row_of_slot_ptr, num_slots, num_experts, top_k,
                       TILE: tl.constexpr, EP: tl.constexpr):
    """Program p: the rows of its slots, its tile's base for the expert plus the slots of that
    expert before it in the tile (so rows keep slot order within an expert); ``token_of_row`` and
    ``row_of_slot`` from them, -1 for a dropped slot."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, TILE)
    slots = pid * TILE + lanes
    live = slots < num_slots
    keys = _expert_keys(ids_ptr, slots, live, num_experts)
    before = (keys[:, None] == keys[None, :]) & (lanes[None, :] < lanes[:, None])
    rows = tl.load(bases_ptr + pid * EP + keys, mask=live, other=0) + tl.sum(before.to(tl.int32), axis=1)
    dropped = keys == num_experts
    tl.store(token_of_row_ptr + rows, tl.where(dropped, -1, slots // top_k).to(tl.int64), mask=live)
    tl.store(row_of_slot_ptr + slots, tl.where(dropped, -1, rows).to(tl.int64), mask=live)


_ROUTE_TILE = 128


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """Contract: ``torch_kernels.reference.moe.sort_by_expert`` (the same maps, bit for bit), in
    three launches; an id outside the experts counts as dropped."""
    num_tokens, top_k = topk_ids.shape
    num_slots, device = num_tokens * top_k, topk_ids.device
    ids = topk_ids.reshape(-1).contiguous()
    ep = triton.next_power_of_2(num_experts + 1)
    tiles = max(1, triton.cdiv(num_slots, _ROUTE_TILE))
    counts = torch.empty(2, tiles, ep, dtype=torch.int32, device=device)  # counts, then bases
    offsets = torch.empty(num_experts, dtype=torch.int32, device=device)
    token_of_row = torch.empty(num_slots, dtype=torch.int64, device=device)
    row_of_slot = torch.empty(num_slots, dtype=torch.int64, device=device)
    for_device(route_count_kernel, device)[(tiles,)](ids, counts[0], num_slots, num_experts, TILE=_ROUTE_TILE, EP=ep)
    for_device(route_scan_kernel, device)[(1,)](counts[0], counts[1], offsets, tiles, num_experts, EP=ep)
    for_device(route_place_kernel, device)[(tiles,)](ids, counts[1], token_of_row, row_of_slot, num_slots,
                                                      num_experts, top_k, TILE=_ROUTE_TILE, EP=ep)
    return token_of_row, row_of_slot.view(num_tokens, top_k), offsets


def _interpreted(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _low_precision(dtype: torch.dtype, interpreted: bool) -> bool:
    """Whether dots take 16-bit operands (on a GPU); the interpreter mishandles bfloat16."""
    return not interpreted and dtype in (torch.float16, torch.bfloat16)


def _decline_float64(**dtypes) -> None:
    for name, dtype in dtypes.items():
        if dtype == torch.float64:
            raise NotImplementedError(f"triton: {name} float64 is not supported")


def _decline_sizes(num_experts: int, top_k: int = 1) -> None:
    if num_experts > MAX_EXPERTS:
        raise NotImplementedError(f"triton: at most {MAX_EXPERTS} experts, got {num_experts}")
    if top_k > MAX_TOP_K:
        raise NotImplementedError(f"triton: top_k at most {MAX_TOP_K}, got {top_k}")


def _row_tiles(rows: int, segments: int, block_m: int) -> int:
    """A bound on the ``block_m``-row tiles of ``segments`` segments of ``rows`` rows in all,
    known without reading the offsets: each non-empty segment adds at most one short tile."""
    return rows // block_m + min(segments, rows)


def _scale_mode(quantized: bool, block_shape, block_k: int):
    """``(SCALE, SCALE_BN, SCALE_BK, BK)``: none; per channel; per block with one scale per K step
    (the step cut to a power of two dividing ``bk``); per entry when ``bk`` is not a multiple of 16."""
    if not quantized:
        return SCALE_NONE, 1, 1, block_k
    if block_shape is None:
        return SCALE_CHANNEL, 1, 1, block_k
    scale_bn, scale_bk = block_shape
    divisor = scale_bk & -scale_bk  # the largest power of two dividing it
    if divisor >= 16:
        return SCALE_BLOCK, scale_bn, scale_bk, min(block_k, divisor)
    return SCALE_ELEMENT, scale_bn, scale_bk, block_k


def config_space(kernel: str, rows: int, n: int, k: int, num_experts: int, dtype: torch.dtype) -> list[Config]:
    """The configs an autotuner may try for a GEMM kernel (``triton_impl.autotune``; arguments as
    :func:`default_config`): the heuristic's, then half, the same or twice its row tile (16 to
    128), 64 or 128 columns, K steps of 64 or 128 (32 or 64 for float32, whose tiles stop at 64 x
    64), 4 or 8 warps, the heuristic's stages. A config out of shared memory fails to launch and
    is skipped."""
    default = default_config(kernel, rows, n, k, num_experts, dtype)
    wide = dtype == torch.float32
    limit = 64 if wide else 128
    block_m = (32, 64) if kernel == "weight_grad" else \
        sorted({m for m in (default.block_m // 2, default.block_m, default.block_m * 2) if 16 <= m <= limit})
    return autotune.space(default, lambda config: config.block_n <= min(limit, _pow2(n)) and config.block_k <= _pow2(k),
                          block_m=block_m, block_n=(64, 128), block_k=(32, 64) if wide else (64, 128),
                          num_warps=(4, 8))


def _choose(name: str, kernel: str, tensor: torch.Tensor, run, rows: int, n_dim: int, k_dim: int, num_experts: int,
            dtype: torch.dtype, **variant) -> Config:
    """The config of GEMM ``kernel``'s launch ``name``: tuned or cached per device
    (``triton_impl.autotune``), else the heuristic; ``variant``: what else its key holds."""
    sizes = (kernel, rows, n_dim, k_dim, num_experts, dtype)
    return autotune.choose(f"moe.{name}", tensor.device,
                           dict(rows=rows, n=n_dim, k=k_dim, experts=num_experts, dtype=dtype, **variant),
                           lambda: default_config(*sizes), lambda: config_space(*sizes), run)


def _gemm_setup(kernel: str, rows: int, n_dim: int, k_dim: int, num_experts: int, dtype: torch.dtype,
                interpreted: bool, quantized: bool = False, block_shape=None, config: Config | None = None, **flags):
    """``(config, row tiles, constexprs)`` of a ``grouped_mm_kernel`` ("grouped_mm") or
    ``gate_up_kernel`` ("gate_up"; ``n_dim`` is I) launch at ``config`` (None: the heuristic);
    ``flags``: that kernel's own constexprs."""
    config = config or default_config(kernel, rows, n_dim, k_dim, num_experts, dtype)
    scale, scale_bn, scale_bk, block_k = _scale_mode(quantized, block_shape, config.block_k)
    segments = num_experts + bool(flags.get("TAIL", False))
    # weights dequantized one by one would round to 16 bits before the dot: those dot in float32
    low = _low_precision(dtype, interpreted) and scale != SCALE_ELEMENT
    constexprs = dict(EP=_pow2(segments, 2), BM=config.block_m, BN=config.block_n, BK=block_k, GROUP_M=config.group_m,
                      SCALE=scale, SCALE_BN=scale_bn, SCALE_BK=scale_bk, LOW=low, INTERPRETED=interpreted, **flags)
    return config, _row_tiles(rows, segments, config.block_m), constexprs


def _weight_grad_setup(rows: int, n_dim: int, k_dim: int, num_experts: int, dtype: torch.dtype, interpreted: bool,
                       config: Config | None = None):
    config = config or default_config("weight_grad", rows, n_dim, k_dim, num_experts, dtype)
    return config, dict(BM=config.block_m, BN=config.block_n, BK=config.block_k,
                        LOW=_low_precision(dtype, interpreted), INTERPRETED=interpreted)


def _router_setup(num_tokens: int, num_experts: int, top_k: int, num_groups: int | None, sigmoid: bool,
                  has_bias: bool, renormalize: bool, dtype: torch.dtype):
    config = default_config("router_topk", num_tokens, num_experts, 0, num_experts, dtype)
    return config, dict(EP=config.block_n, GP=_pow2(num_groups or 1, 2), KP=_pow2(top_k, 2), BT=config.block_m,
                        SIGMOID=sigmoid, HAS_BIAS=has_bias, GROUPED=num_groups is not None, RENORMALIZE=renormalize)


def _launch(kernel, tensor: torch.Tensor, grid, config: Config, *args, **constexprs) -> None:
    for_device(kernel, tensor.device)[grid](*args, **constexprs, num_warps=config.num_warps,
                                            num_stages=config.num_stages)


def router_topk(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, correction_bias,
                routed_scaling_factor):
    """``(weights float32 [T, k], ids int32 [T, k])``; contract: ``reference.router_topk``."""
    _decline_float64(logits=logits.dtype, correction_bias=None if correction_bias is None else correction_bias.dtype)
    num_tokens, num_experts = logits.shape
    _decline_sizes(num_experts, top_k)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    groups = num_expert_groups or 1
    config, constexprs = _router_setup(num_tokens, num_experts, top_k, num_expert_groups, scoring == "sigmoid",
                                       correction_bias is not None, bool(renormalize), logits.dtype)
    _launch(router_topk_kernel, logits, (triton.cdiv(num_tokens, config.block_m),), config,
            logits, logits if correction_bias is None else correction_bias, weights, ids, num_tokens, num_experts,
            top_k, groups, topk_groups or 1, num_experts // groups, float(routed_scaling_factor), **constexprs)
    return weights, ids


def moe_gather(x, token_of_row):
    """``[R, H]``: ``x[token_of_row[r]]``, zero where -1; contract: ``reference.moe_gather``."""
    _decline_float64(x=x.dtype)
    rows, hidden = token_of_row.shape[0], x.shape[1]
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    if rows == 0 or hidden == 0:
        return out
    config = default_config("moe_gather", rows, hidden, 0, 1, x.dtype)
    _launch(gather_rows_kernel, x, (triton.cdiv(rows, config.block_m), triton.cdiv(hidden, config.block_n)), config,
            x, token_of_row, out, rows, hidden, BR=config.block_m, BH=config.block_n)
    return out


def _combine(y, row_of_slot, weights, out_dtype):
    num_tokens, top_k = row_of_slot.shape
    width = y.shape[1]
    out = torch.empty(num_tokens, width, dtype=out_dtype, device=y.device)
    if num_tokens == 0 or width == 0:
        return out
    config = default_config("moe_combine", num_tokens, width, 0, 1, y.dtype)
    _launch(combine_kernel, y, (triton.cdiv(num_tokens, config.block_m), triton.cdiv(width, config.block_n)), config,
            y, row_of_slot, y if weights is None else weights, out, num_tokens, width, top_k, BT=config.block_m,
            BN=config.block_n, HAS_WEIGHTS=weights is not None, INTERPRETED=_interpreted(y))
    return out


def moe_combine(y, row_of_slot, weights, out_dtype):
    """``[T, N]``: each token's rows weighted and summed in slot order; contract: ``reference.moe_combine``."""
    _decline_float64(y=y.dtype, out_dtype=out_dtype)
    _decline_sizes(1, row_of_slot.shape[1])
    return _combine(y, row_of_slot, weights, out_dtype)


def grouped_mm(x, w, offsets, out_dtype, w_transposed):
    """``[M, N]``: each expert's rows times its matrix, rows past ``offsets[-1]`` zero; contract:
    ``reference.grouped_mm`` (``w`` ``[E, K, N]``, or ``[E, N, K]`` when ``w_transposed``, read as it lies)."""
    _decline_float64(x=x.dtype, out_dtype=out_dtype)
    rows, k_dim = x.shape
    num_experts = w.shape[0]
    _decline_sizes(num_experts)
    n_dim = w.shape[1] if w_transposed else w.shape[2]
    out = torch.empty(rows, n_dim, dtype=out_dtype, device=x.device)
    if rows == 0 or n_dim == 0:
        return out
    config = _choose("grouped_mm", "grouped_mm", x, lambda: grouped_mm(x, w, offsets, out_dtype, w_transposed),
                     rows, n_dim, k_dim, num_experts, x.dtype, transposed=w_transposed, out=out_dtype)
    config, row_tiles, constexprs = _gemm_setup("grouped_mm", rows, n_dim, k_dim, num_experts, x.dtype,
                                                _interpreted(x), config=config, W_KN=not w_transposed, TAIL=True,
                                                ROUTED=False, KP=2)
    _launch(grouped_mm_kernel, x, (row_tiles * triton.cdiv(n_dim, config.block_n),), config,
            x, w, out, offsets, x, offsets, offsets, x, rows, n_dim, k_dim, num_experts, row_tiles, 1, **constexprs)
    return out


def grouped_mm_weight_grad(x, dy, offsets, num_experts, out_dtype):
    """``[E, K, N]``: ``x_e^T dy_e`` per expert (zero for none); contract: ``reference.grouped_mm_weight_grad``."""
    _decline_float64(x=x.dtype, out_dtype=out_dtype)
    _decline_sizes(num_experts)
    k_dim, n_dim = x.shape[1], dy.shape[1]
    out = torch.empty(num_experts, k_dim, n_dim, dtype=out_dtype, device=x.device)
    if out.numel() == 0:
        return out
    config = _choose("weight_grad", "weight_grad", x,
                     lambda: grouped_mm_weight_grad(x, dy, offsets, num_experts, out_dtype),
                     x.shape[0], n_dim, k_dim, num_experts, x.dtype, out=out_dtype)
    config, constexprs = _weight_grad_setup(x.shape[0], n_dim, k_dim, num_experts, x.dtype, _interpreted(x), config)
    grid = (triton.cdiv(k_dim, config.block_k) * triton.cdiv(n_dim, config.block_n), num_experts)
    _launch(weight_grad_kernel, x, grid, config, x, dy, out, offsets, k_dim, n_dim, **constexprs)
    return out


def fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets, activation, w13_scale, w2_scale,
              block_shape):
    """``[T, H]`` in x's dtype: gate/up GEMM with the activation, down GEMM with the routing weight,
    combine (module docstring); contract: ``reference.fused_moe``."""
    _decline_float64(x=x.dtype)
    num_experts, two_i, hidden = w13.shape
    num_tokens, top_k = row_of_slot.shape
    _decline_sizes(num_experts, top_k)
    quantized = w13.dtype in FP8_DTYPES
    if quantized and x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (8, 9):
        raise NotImplementedError("triton: float8_e4m3fn weights need compute capability 8.9 or newer")
    if num_tokens == 0 or hidden == 0:
        return torch.zeros_like(x)
    inter = two_i // 2
    rows = token_of_row.shape[0]
    interpreted = _interpreted(x)
    h = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    rerun = lambda: fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets, activation,  # noqa: E731
                              w13_scale, w2_scale, block_shape)
    variant = dict(weights=w13.dtype, block_shape=block_shape)
    config = _choose("fused_gate_up", "gate_up", x, rerun, rows, inter, hidden, num_experts, x.dtype, **variant)
    config, row_tiles, constexprs = _gemm_setup("gate_up", rows, inter, hidden, num_experts, x.dtype, interpreted,
                                                quantized, block_shape, config, ACTIVATION=ACTIVATIONS[activation])
    _launch(gate_up_kernel, x, (row_tiles * triton.cdiv(inter, config.block_n),), config,
            x, w13, h, offsets, w13_scale if quantized else x, token_of_row, rows, inter, hidden, num_experts,
            row_tiles, **constexprs)
    y = torch.empty(rows, hidden, dtype=torch.float32, device=x.device)  # rows past offsets[-1]: never read
    config = _choose("fused_down", "grouped_mm", x, rerun, rows, hidden, inter, num_experts, x.dtype, **variant)
    config, row_tiles, constexprs = _gemm_setup("grouped_mm", rows, hidden, inter, num_experts, x.dtype, interpreted,
                                                quantized, block_shape, config, W_KN=False, TAIL=False, ROUTED=True,
                                                KP=_pow2(top_k, 2))
    _launch(grouped_mm_kernel, x, (row_tiles * triton.cdiv(hidden, config.block_n),), config,
            h, w2, y, offsets, w2_scale if quantized else x, token_of_row, row_of_slot, weights, rows, hidden, inter,
            num_experts, row_tiles, top_k, **constexprs)
    return _combine(y, row_of_slot, None, x.dtype)


# ---- ahead-of-time builds ----

_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.float8_e4m3fn: "fp8e4nv"}
MODELS = {  # (experts, top_k, hidden H, intermediate I, router groups, kept groups)
    "qwen3-30b-a3b": (128, 8, 2048, 768, None, None),
    "deepseek-v3": (256, 8, 7168, 2048, 8, 4),
}


def _signature(kernel, constexprs: dict, types: dict) -> dict:
    """Argument types of ``kernel``: ``types`` by name, other pointers float32, other scalars i32."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        else:
            signature[name] = "*fp32" if name.endswith("_ptr") else "i32"
    return signature


class CompileTarget(typing.NamedTuple):
    name: str
    kernel: object
    signature: dict
    constexprs: dict
    config: Config
    has_dots: bool
    divisible: tuple  # arguments a launch on these shapes has 16-aligned (pointers) or multiples of 16


_SIZES = ("N", "K", "H", "I")  # the model's dimensions, all multiples of 16


def compile_targets(model: str, dtype: torch.dtype, weight_dtype: torch.dtype | None = None, block_shape=None,
                    num_tokens: int = 4096) -> list[CompileTarget]:
    """Every kernel one MoE layer of ``model`` (``MODELS``) launches for ``num_tokens`` tokens of
    ``dtype``, at its default config. With float8 ``weight_dtype``, only fused_moe's kernels
    (scales per channel, or per ``block_shape`` block); the others do not take float8. A launch
    specializes on ``divisible`` (Triton's JIT does so by the values): without it the loads are
    not vectorized and the pipeline is not built."""
    num_experts, top_k, hidden, inter, groups, _ = MODELS[model]
    rows = num_tokens * top_k
    act = "*" + _TRITON_TYPES[dtype]
    quantized = weight_dtype in FP8_DTYPES
    weight = "*" + _TRITON_TYPES[weight_dtype if quantized else dtype]
    index = dict(offsets_ptr="*i64", token_of_row_ptr="*i64", row_of_slot_ptr="*i64")
    targets = []

    def add(name, kernel, config, constexprs, types, dots):
        signature = _signature(kernel, constexprs, types)
        divisible = tuple(n for n, t in signature.items() if t.startswith("*") or n in _SIZES)
        targets.append(CompileTarget(name, kernel, signature, constexprs, config, dots, divisible))

    config, _, constexprs = _gemm_setup("gate_up", rows, inter, hidden, num_experts, dtype, False, quantized,
                                        block_shape, ACTIVATION=ACTIVATIONS["silu"])
    add("fused_gate_up", gate_up_kernel, config, constexprs, dict(x_ptr=act, w_ptr=weight, h_ptr=act, **index), True)
    config, _, constexprs = _gemm_setup("grouped_mm", rows, hidden, inter, num_experts, dtype, False, quantized,
                                        block_shape, W_KN=False, TAIL=False, ROUTED=True, KP=_pow2(top_k, 2))
    add("fused_down", grouped_mm_kernel, config, constexprs, dict(a_ptr=act, w_ptr=weight, **index), True)
    combine = default_config("moe_combine", num_tokens, hidden, 0, 1, torch.float32)
    combine_flags = dict(BT=combine.block_m, BN=combine.block_n, INTERPRETED=False)
    add("fused_combine", combine_kernel, combine, dict(HAS_WEIGHTS=False, **combine_flags), dict(out_ptr=act, **index),
        False)
    if quantized:
        return targets
    for w_transposed in (False, True):
        config, _, constexprs = _gemm_setup("grouped_mm", rows, 2 * inter, hidden, num_experts, dtype, False,
                                            W_KN=not w_transposed, TAIL=True, ROUTED=False, KP=2)
        add(f"grouped_mm_{'nk' if w_transposed else 'kn'}", grouped_mm_kernel, config, constexprs,
            dict(a_ptr=act, w_ptr=act, out_ptr=act, weights_ptr=act, **index), True)
    config, constexprs = _weight_grad_setup(rows, 2 * inter, hidden, num_experts, dtype, False)
    add("weight_grad", weight_grad_kernel, config, constexprs, dict(x_ptr=act, dy_ptr=act, out_ptr=act, **index), True)
    grouped = groups is not None  # DeepSeek-V3's router: sigmoid, bias, groups
    config, constexprs = _router_setup(num_tokens, num_experts, top_k, groups, grouped, grouped, True, dtype)
    add("router_topk", router_topk_kernel, config, constexprs,
        dict(logits_ptr=act, bias_ptr=act, ids_ptr="*i32", scaling="fp32"), False)
    gather = default_config("moe_gather", rows, hidden, 0, 1, dtype)
    add("moe_gather", gather_rows_kernel, gather, dict(BR=gather.block_m, BH=gather.block_n),
        dict(x_ptr=act, out_ptr=act, **index), False)
    add("moe_combine", combine_kernel, combine, dict(HAS_WEIGHTS=True, **combine_flags),
        dict(y_ptr=act, out_ptr=act, **index), False)
    return targets


_GEMMS = ("fused_gate_up", "fused_down", "grouped_mm_kn", "grouped_mm_nk", "weight_grad")
_COMPILE_CASES = [  # (model, dtype, float8 weights, block shape, tokens, the kernels CI builds (None: all))
    ("qwen3-30b-a3b", torch.bfloat16, None, None, 4096, None),
    ("deepseek-v3", torch.bfloat16, None, None, 4096, ("router_topk", "fused_gate_up", "fused_down")),
    ("qwen3-30b-a3b", torch.float32, None, None, 4096, _GEMMS),  # tf32x3
    ("deepseek-v3", torch.float16, None, None, 1, _GEMMS),  # decode: 16-row tiles
    ("deepseek-v3", torch.bfloat16, torch.float8_e4m3fn, (128, 128), 4096, _GEMMS),
    ("qwen3-30b-a3b", torch.float16, torch.float8_e4m3fn, None, 1, _GEMMS),
]


def compile_groups(everything: bool) -> dict:
    """The compile report's builds of this family: ``{group id: function of an arch returning its
    builds}``, a build being ``compile_report.Build``'s fields but ``family``. A group per (model,
    dtype, weights, tokens) case: one MoE layer's kernels, built as a launch on these shapes
    specializes them; the row-wise kernels, with no loads to pipeline, as plain builds (the same
    configs on every arch). By default the share CI builds: the GEMMs at prefill and decode,
    16-bit, float32 and float8 weights; ``everything``: every kernel of every case."""
    import functools

    from . import dtype_name

    def builds(model, dtype, weight_dtype, block_shape, tokens, only, arch: int = 90) -> list[dict]:
        weights = f" {dtype_name(weight_dtype)} weights {block_shape or 'per channel'}" if weight_dtype else ""
        return [dict(label=f"{target.name} {model} {dtype_name(dtype)}{weights} T={tokens}", kernel=target.kernel,
                     signature=target.signature, constexprs=target.constexprs, num_warps=target.config.num_warps,
                     num_stages=target.config.num_stages if target.has_dots else None,
                     divisible=tuple(target.divisible) if target.has_dots else ())
                for target in compile_targets(model, dtype, weight_dtype, block_shape, num_tokens=tokens)
                if only is None or target.name in only]

    def routing(arch: int = 90) -> list[dict]:
        found = []
        for num_experts in (128, 256):  # Qwen3-30B-A3B, DeepSeek-V3
            ep = dict(EP=triton.next_power_of_2(num_experts + 1))
            tile = dict(TILE=_ROUTE_TILE, **ep)
            found += [
                dict(label=f"route_count E={num_experts}", kernel=route_count_kernel, constexprs=tile,
                     signature=dict(ids_ptr="*i64", counts_ptr="*i32", num_slots="i32", num_experts="i32",
                                    TILE="constexpr", EP="constexpr"), num_warps=4, num_stages=None),
                dict(label=f"route_scan E={num_experts}", kernel=route_scan_kernel, constexprs=ep,
                     signature=dict(counts_ptr="*i32", bases_ptr="*i32", offsets_ptr="*i32", num_tiles="i32",
                                    num_experts="i32", EP="constexpr"), num_warps=4, num_stages=None),
                dict(label=f"route_place E={num_experts}", kernel=route_place_kernel, constexprs=tile,
                     signature=dict(ids_ptr="*i64", bases_ptr="*i32", token_of_row_ptr="*i64",
                                    row_of_slot_ptr="*i64", num_slots="i32", num_experts="i32", top_k="i32",
                                    TILE="constexpr", EP="constexpr"), num_warps=4, num_stages=None)]
        return found

    return {**{f"moe-{model}-{dtype_name(dtype)}{'-fp8' if weight_dtype else ''}-T{tokens}": functools.partial(
                builds, model, dtype, weight_dtype, block_shape, tokens, None if everything else only)
               for model, dtype, weight_dtype, block_shape, tokens, only in _COMPILE_CASES},
            "moe-routing": routing}

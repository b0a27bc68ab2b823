"""Quantized attention (SageAttention's recipe) as Triton kernels, and the exact backward.

Forward, three launches (four with ``pv_dtype="fp8"``):

1. ``quantize_kernel`` for Q and for K: one program per tile of rows of one sequence and head
   (128 query rows, 64 key rows, starting at the sequence's first token, so that every
   quantization group of the reference lies inside one tile; several tiles under the
   interpreter), Q and K smoothed by the op's query and key means (where given),
   ``sm_scale * log2(e)`` folded into Q. It writes the int8 values and one float32 scale per row
   (the group's scale repeated), so the attention kernel needs no notion of groups.
2. ``value_fp8_kernel`` (``"fp8"`` only): V's per-channel scales over each sequence, then V in
   ``float8_e4m3fn``.
3. ``attention_kernel``: one program per tile of ``BLOCK_M`` query rows of one sequence and one
   query head (GQA: its kv head is ``h // group``), walking the key tiles the tile sees
   (bottom-right causal: none past the tile's last row's diagonal) ``BLOCK_N = 64`` at a time, the
   reference's tile, so that the online softmax rescales at the same points and P is rounded at
   the same magnitudes: ``s_int = q8 @ k8^T`` by an int8 ``tl.dot`` (int32, exact), ``s = (s_int *
   q_scale) * k_scale + key_bias`` in float32 (the bias, Q smoothing's scores, loaded only where
   given: a constexpr), ``exp2`` online softmax, P.V per ``pv_dtype`` accumulated in
   float32, then ``out = acc / l`` and ``lse = ln 2 (m + log2 l) + sm_scale q . k_mean``.

The int8 values and scales equal the reference's bit for bit (IEEE division by ``tl.div_rn``,
round half to even by adding and subtracting ``1.5 * 2**23``, NaN flagged by hand because max
reductions drop it); scores too under the interpreter (on a GPU, Triton's default FP fusion
makes the last scale product and the bias add one FMA, as the sm_90 PTX shows: one rounding
fewer, half an ulp of a score). The rest differs from the reference only in float32 summation
order and ``exp2`` / ``log2`` rounding.

Backward, FlashAttention-2 style, the gradient of exact attention at the same inputs (a
straight-through estimator, ``torch_kernels.reference.quantized_attention.attention_backward``):

4. ``backward_preprocess_kernel`` per query tile and head: the exact row statistics, ``lse``
   (base 2) and ``delta = rowsum(dO * O) - d lse`` with ``O`` the exact attention output (the
   forward's output is the quantized one), as ``rowsum(P * dO V^T)`` by an online softmax: the
   same sum, with no product of a rounded P.
5. ``backward_dq_kernel`` per query tile and head: ``P = exp2(S - lse)``, ``dS = P (dO V^T -
   delta)``, ``dQ = sm_scale dS K``.
6. ``backward_dkdv_kernel`` per key tile and kv head, over the query tiles of every query head of
   its group (GQA sums without atomics): ``dV = P^T dO``, ``dK = sm_scale dS^T Q``.

Sequences: with ``cu_seqlens`` the tiles of sequence ``s`` are numbered from ``cu[s] // BLOCK + s``
(a binary search finds a program's sequence, no host sync); without, the batch elements are the
sequences, found the same way from offsets ``b * N``.

Precision on a GPU: float16 / bfloat16 operands enter ``tl.dot`` as they are, float32 ones as
tf32x3; float32 accumulation. The backward keeps P and dS in float32, as the reference does: each
enters its product with an input (``dV = P^T dO``, ``dQ = dS K``, ``dK = dS^T Q``) as two parts in
the inputs' dtype, ``hi + lo`` (``_dot_split``: two tensor-core products keeping 22 of its bits in
float16, 16 in bfloat16). Rounded once to the inputs' dtype, as FlashAttention-2 does, they made
the gradients up to 10x less accurate than the reference's on an H200: a row of dS sums to 0, so
``dS K`` cancels what the keys share (their mean, large where K smoothing pays) while the rounding
errors of dS do not cancel and are multiplied by it; bfloat16's 8 bits of P cost dV 0.1 of
relative error per element. FP8 P.V needs float8_e4m3fn MMA (compute capability 8.9+): declined
below. Under the interpreter (CPU tensors), whose bfloat16 arithmetic and float8 rounding are wrong
(and whose float16 products are slow), P.V's operands are rounded to their dtype's values in
float32 and multiplied in float32 (the products exact, as in the MMA), V quantized to e4m3 is kept
in float32, the backward computes in float32 and bfloat16 results are rounded on the host.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import triton
import triton.language as tl

from . import arch_of, autotune, for_device
from .common import dot_inputs, round_to_fp8_grid, sequence_of

HEAD_SIZES = (64, 96, 128)
BLOCK_Q, BLOCK_K = 128, 64  # the reference's quantization tiles of queries and keys (BLOCK_K its key tile too)
GROUPINGS = {("q", "per_block"): 0, ("q", "per_warp"): 1, ("q", "per_thread"): 2,
             ("k", "per_block"): 0, ("k", "per_warp"): 0, ("k", "per_thread"): 3}
FP8_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn
LOG2E = math.log2(math.e)
LN2 = tl.constexpr(math.log(2.0))

QUANTIZE_WARPS = {"q": 16, "k": 4}  # 32 elements a thread (at head size 128): none spilled, 8 warps did for float32
_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def folded_scale(sm_scale: float) -> float:
    """``sm_scale * log2(e)`` rounded to float32 (inf past its range), on the host: the reference's
    constant folded into Q."""
    with np.errstate(over="ignore"):
        return float(np.float32(sm_scale * LOG2E))


@dataclasses.dataclass(frozen=True)
class Config:
    """One attention launch: query rows per program (``block_m``), key rows per step (``block_n``;
    the forward's is always 64, the reference's tile), warps and pipeline stages."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


KERNELS = ("forward", "backward_dq", "backward_dkdv")


def _interpreted_block(n: int, tile: int, most: int = 512) -> int:
    """A block of whole ``tile``s covering ``n`` rows, up to ``most``: the interpreter's cost is per
    program and per step, hardly per element."""
    return max(tile, min(most, triton.next_power_of_2(max(n, 1))))


def default_config(kernel: str, head_size: int, dtype: torch.dtype = torch.float16, pv_dtype: str = "fp16",
                   interpreted: bool = False, num_q: int = 0, num_k: int = 0, arch: int | None = None) -> Config:
    """Heuristic per kernel (``KERNELS``; the backward's preprocessing takes backward_dq's) for
    ``num_q`` query and ``num_k`` key rows of ``dtype``, from ptxas's registers at sm_80 and sm_90
    (tests/test_device_compile.py prints them):

    - forward: 128 query rows (SageAttention's tile) over 8 warps (4 spilled at head size 64); one
      pipeline stage at head size 96, whose padded, masked tiles spilled with two on sm_80; where
      P.V multiplies float32 (tf32x3: three products of split operands), 64 rows, 32 at head size 64
      and on sm_80 (``arch``, the compute capability, ``triton_impl.arch_of``; None: not CUDA), where
      64 spilled at head size 128 (sm_90 keeps 64 for wgmma's 64-row tiles);
    - backward: 64 x 64 tiles for dQ (64 x 32 at head size 64 on sm_80, where bfloat16's split
      dS K spilled 108 bytes); for dK and dV, which hold K, V and two ``[64, D]`` float32
      accumulators, 32 query rows a step at head size 64 and 16 above (32 spilled up to 248 bytes
      on sm_90 with the split products, 64 spilled at head size 128); float32 inputs 16 x 32 and
      16 x 16 over 8 warps (four spilled up to 56 bytes at head size 128; 32 x 32 spilled 200);
    - the interpreter, whose cost is per program and step: blocks of up to 512 rows.
    """
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    wide = dtype == torch.float32
    if kernel == "forward":
        if interpreted:
            return Config(block_m=_interpreted_block(num_q, 128), block_n=BLOCK_K, num_stages=1)
        if wide and pv_dtype == "none":
            if head_size <= 64:
                return Config(block_m=32, block_n=BLOCK_K, num_warps=4)
            return Config(block_m=32 if arch is not None and arch < 90 else 64, block_n=BLOCK_K, num_warps=8)
        return Config(block_m=128, block_n=BLOCK_K, num_warps=8, num_stages=1 if head_size == 96 else 2)
    if interpreted:
        return Config(block_m=_interpreted_block(num_q, 64), block_n=_interpreted_block(num_k, 64), num_stages=1)
    if wide:
        return Config(block_m=16, block_n=32 if kernel == "backward_dq" else 16, num_warps=8, num_stages=1)
    warps = 4 if head_size <= 64 else 8
    if kernel == "backward_dq":
        narrow = head_size <= 64 and arch is not None and arch < 90
        return Config(block_m=64, block_n=32 if narrow else 64, num_warps=warps, num_stages=2)
    return Config(block_m=32 if head_size <= 64 else 16, block_n=64, num_warps=warps, num_stages=2)


# ---- shared pieces ----

@triton.jit
def _sequence(cu_ptr, s, VARLEN: tl.constexpr):
    """``(begin, end, batch, base)`` of sequence ``s``: its rows ``[begin, end)`` in ``cu``'s
    numbering, and the batch element and row number that numbering starts at in the tensors."""
    begin = tl.load(cu_ptr + s)
    end = tl.load(cu_ptr + s + 1)
    batch = s
    base = begin
    if VARLEN:  # B = 1: rows are numbered as in the tensors
        batch = 0
        base = begin * 0
    return begin, end, batch, base


@triton.jit
def _tile_start(cu_ptr, num_seqs, tile, BLOCK: tl.constexpr, VARLEN: tl.constexpr):
    """The sequence of tile ``tile`` and that tile's first row (past ``end`` for a spare tile)."""
    s = sequence_of(cu_ptr, num_seqs, tile, BLOCK)
    begin, end, batch, base = _sequence(cu_ptr, s, VARLEN)
    return s, begin, end, batch, base, begin + (tile - (begin // BLOCK + s)) * BLOCK


@triton.jit
def _load(ptr, rows, row_ok, dims, d_ok, D: tl.constexpr):
    """``[rows, dims]`` of a row-major ``[*, D]`` tensor (``rows`` int64), 0 outside."""
    return tl.load(ptr + rows[:, None] * D + dims[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)


@triton.jit
def _rne_bf16(x):
    """float32 ``x`` rounded to bfloat16's values (half to even), still float32: the interpreter's
    own bfloat16 cast truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


# ---- quantization ----

@triton.jit
def quantize_kernel(
    x_ptr, mean_ptr, x8_ptr, scale_ptr, cu_ptr, num_seqs, n_rows, multiplier,
    H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
    GROUPING: tl.constexpr, HAS_MEAN: tl.constexpr, VARLEN: tl.constexpr,
):
    """int8 values and per-row scales of row block ``program_id(0)`` (``BLOCK`` rows, whole
    quantization tiles of ``TILE`` rows: 128 query rows, 64 key rows) of head ``program_id(1)``:
    ``x' = (x - mean) * multiplier``; per group ``scale = amax / 127`` (1 where 0, inf where the
    group holds a NaN or inf), ``x8 = clamp(round_half_even(x' / scale), +-127)``, NaN -> 0.
    GROUPING: 0 the whole tile, 1 per 32 rows, 2 rows ``i % 8`` of each 32 (queries per_thread),
    3 keys ``(j % 8) // 2`` of each 64 (keys per_thread)."""
    h = tl.program_id(1)
    s, begin, end, batch, base, start = _tile_start(cu_ptr, num_seqs, tl.program_id(0), BLOCK, VARLEN)
    if start < end:
        rows = start + tl.arange(0, BLOCK)
        row_ok = rows < end
        dims = tl.arange(0, DP)
        d_ok = dims < D
        offsets = (batch * H + h).to(tl.int64) * n_rows - base + rows
        ok = row_ok[:, None] & d_ok[None, :]
        x = _load(x_ptr, offsets, row_ok, dims, d_ok, D).to(tl.float32)
        if HAS_MEAN:
            mean = tl.load(mean_ptr + (s * H + h).to(tl.int64) * D + dims, mask=d_ok, other=0.0)
            x = tl.where(ok, x - mean[None, :], 0.0)
        x = x * multiplier
        # max reductions drop NaN (on the GPU and in the interpreter): a row holding one gets amax inf
        row_amax = tl.max(tl.abs(x), axis=1)
        row_nan = tl.max(tl.where(x != x, 1, 0), axis=1)
        row_amax = tl.where(row_nan > 0, float("inf"), row_amax)
        if GROUPING == 0:
            tiles = tl.max(tl.reshape(row_amax, [BLOCK // TILE, TILE]), axis=1)
            amax = tl.reshape(tl.broadcast_to(tiles[:, None], [BLOCK // TILE, TILE]), [BLOCK])
        elif GROUPING == 1:
            warps = tl.max(tl.reshape(row_amax, [BLOCK // 32, 32]), axis=1)
            amax = tl.reshape(tl.broadcast_to(warps[:, None], [BLOCK // 32, 32]), [BLOCK])
        elif GROUPING == 2:  # row i = 32 w + 8 a + b belongs to group (w, b)
            groups = tl.max(tl.reshape(row_amax, [BLOCK // 32, 4, 8]), axis=1)
            amax = tl.reshape(tl.broadcast_to(groups[:, None, :], [BLOCK // 32, 4, 8]), [BLOCK])
        else:  # key j = 64 t + 8 a + 2 c + e belongs to group (t, c)
            groups = tl.max(tl.max(tl.reshape(row_amax, [BLOCK // 64, 8, 4, 2]), axis=3), axis=1)
            amax = tl.reshape(tl.broadcast_to(groups[:, None, :, None], [BLOCK // 64, 8, 4, 2]), [BLOCK])
        scale = tl.where(amax > 0.0, tl.div_rn(amax, 127.0), 1.0)
        y = tl.div_rn(x, scale[:, None])
        y = tl.where(y != y, 0.0, y)  # NaN is stored as 0 (its scale is inf)
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        y = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23 rounds to an integer, half to even
        tl.store(x8_ptr + offsets[:, None] * D + dims[None, :], y.to(tl.int8), mask=ok)
        tl.store(scale_ptr + offsets, scale, mask=row_ok)


@triton.jit
def value_fp8_kernel(
    v_ptr, v8_ptr, scale_ptr, cu_ptr, n_rows,
    H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, VARLEN: tl.constexpr,
    EMULATE_FP8: tl.constexpr,
):
    """Sequence ``program_id(0)``'s values of head ``program_id(1)`` in float8_e4m3fn with one scale
    per channel: ``scale = amax / 448`` (1 where amax is 0 or NaN, as the reference's NaN-propagating
    amax fails ``amax > 0``), ``v8 = e4m3(clamp(v / scale, +-448))``. EMULATE_FP8 (interpreter):
    ``v8`` as float32 values on e4m3's grid."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    begin, end, batch, base = _sequence(cu_ptr, s, VARLEN)
    dims = tl.arange(0, DP)
    d_ok = dims < D
    head = (batch * H + h).to(tl.int64) * n_rows - base
    amax = tl.zeros([DP], tl.float32)
    nan = tl.zeros([DP], tl.int32)
    for start in range(begin, end, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        v = _load(v_ptr, head + rows, rows < end, dims, d_ok, D).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(v), axis=0))
        nan = tl.maximum(nan, tl.max(tl.where(v != v, 1, 0), axis=0))
    scale = tl.where((amax > 0.0) & (nan == 0), tl.div_rn(amax, FP8_MAX), 1.0)
    tl.store(scale_ptr + (s * H + h).to(tl.int64) * D + dims, scale, mask=d_ok)
    for start in range(begin, end, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        row_ok = rows < end
        offsets = (head + rows)[:, None] * D + dims[None, :]
        v = _load(v_ptr, head + rows, row_ok, dims, d_ok, D).to(tl.float32)
        y = tl.clamp(tl.div_rn(v, scale[None, :]), -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
        if EMULATE_FP8:
            y = round_to_fp8_grid(y, 3, -6)
        tl.store(v8_ptr + offsets, y.to(v8_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# ---- forward ----

@triton.jit
def _round_operand(x, P_DT: tl.constexpr):
    """float32 ``x`` rounded to 16-bit ``P_DT``'s values, still float32."""
    if P_DT == tl.bfloat16:
        return _rne_bf16(x)
    return x.to(P_DT).to(tl.float32)


@triton.jit
def _pv(p, v, P_DT: tl.constexpr, EMULATE: tl.constexpr):
    """``P V`` of one tile, float32 accumulation, P and V rounded to ``P_DT`` (float8_e4m3fn: P
    scaled by 448, V already quantized). EMULATE (interpreter): the operands rounded in float32,
    their products exact as in the MMA (its bfloat16 and e4m3 casts are wrong, and numpy's float16
    products are slow); V comes in e4m3's values as float32 there."""
    if P_DT == tl.float32:
        return tl.dot(p, v.to(tl.float32), input_precision="tf32x3")
    if P_DT == tl.float8e4nv:
        if EMULATE:
            return tl.dot(round_to_fp8_grid(p * FP8_MAX, 3, -6), v, input_precision="ieee")
        return tl.dot((p * FP8_MAX).to(P_DT), v)
    if EMULATE:
        return tl.dot(_round_operand(p, P_DT), _round_operand(v.to(tl.float32), P_DT), input_precision="ieee")
    return tl.dot(p.to(P_DT), v.to(P_DT))


@triton.jit
def _tile_geometry(cu_k_ptr, s, h, q_begin, q_end, batch, q_base, q_start, nq_rows, nk_rows,
                   HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                   CAUSAL: tl.constexpr, VARLEN: tl.constexpr):
    """Where the query tile of head ``h`` that starts at row ``q_start`` of sequence ``s`` reads:
    its rows (and which are in the sequence), the head dimensions (and which are real), its rows'
    offsets, its kv head's first key row, the sequence's first key and key base, its query and
    key counts, and ``stop``, the key positions the tile sees (all, or up to the causal diagonal)."""
    kv_head = h // (HQ // HKV)
    k_begin, k_end, _, k_base = _sequence(cu_k_ptr, s, VARLEN)
    nq = q_end - q_begin
    nk = k_end - k_begin
    rows = q_start + tl.arange(0, BLOCK_M)
    row_ok = rows < q_end
    dims = tl.arange(0, DP)
    d_ok = dims < D
    q_rows = (batch * HQ + h).to(tl.int64) * nq_rows - q_base + rows
    k_head = (batch * HKV + kv_head).to(tl.int64) * nk_rows - k_base + k_begin
    stop = nk
    if CAUSAL:
        stop = tl.minimum(nk, tl.minimum(q_start + BLOCK_M, q_end) - q_begin + (nk - nq))
    return rows, row_ok, dims, d_ok, q_rows, k_head, k_begin, k_base, nq, nk, stop


@triton.jit
def attention_kernel(
    q8_ptr, q_scale_ptr, k8_ptr, k_scale_ptr, v_ptr, v_scale_ptr, mean_ptr, bias_ptr, q_ptr, out_ptr, lse_ptr,
    cu_q_ptr, cu_k_ptr, num_seqs, nq_rows, nk_rows, sm_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, P_DT: tl.constexpr, HAS_MEAN: tl.constexpr,
    HAS_BIAS: tl.constexpr, VARLEN: tl.constexpr, EMULATE: tl.constexpr,
):
    """Query tile ``program_id(0)`` of query head ``program_id(1)``: the module docstring, step 3."""
    h = tl.program_id(1)
    kv_head = h // (HQ // HKV)
    s, q_begin, q_end, batch, q_base, q_start = _tile_start(cu_q_ptr, num_seqs, tl.program_id(0), BLOCK_M, VARLEN)
    if q_start < q_end:
        rows, row_ok, dims, d_ok, q_rows, k_head, k_begin, k_base, nq, nk, stop = _tile_geometry(
            cu_k_ptr, s, h, q_begin, q_end, batch, q_base, q_start, nq_rows, nk_rows, HQ, HKV, D, DP, BLOCK_M,
            CAUSAL, VARLEN)
        q8 = tl.load(q8_ptr + q_rows[:, None] * D + dims[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0)
        q_scale = tl.load(q_scale_ptr + q_rows, mask=row_ok, other=0.0)
        bias_head = (batch * HQ + h).to(tl.int64) * nk_rows - k_base + k_begin  # key_bias is [B, HQ, Nk]
        diagonal = rows - q_begin + (nk - nq)  # the last key each row sees (bottom-right causal)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DP], tl.float32)
        for j0 in range(0, stop, BLOCK_N):
            cols = j0 + tl.arange(0, BLOCK_N)
            col_ok = cols < nk
            k8 = tl.load(k8_ptr + (k_head + cols)[:, None] * D + dims[None, :],
                         mask=col_ok[:, None] & d_ok[None, :], other=0)
            k_scale = tl.load(k_scale_ptr + k_head + cols, mask=col_ok, other=0.0)
            scores = (tl.dot(q8, tl.trans(k8)).to(tl.float32) * q_scale[:, None]) * k_scale[None, :]
            if HAS_BIAS:  # the scores Q smoothing took out of the queries
                scores += tl.load(bias_ptr + bias_head + cols, mask=col_ok, other=0.0)[None, :]
            seen = col_ok[None, :]
            if CAUSAL:
                seen = seen & (cols[None, :] <= diagonal[:, None])
            scores = tl.where(seen, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: exp2(-inf) = 0
            p = tl.exp2(scores - m_safe[:, None])
            alpha = tl.exp2(m - m_safe)
            l = l * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + (k_head + cols)[:, None] * D + dims[None, :], mask=col_ok[:, None] & d_ok[None, :],
                        other=0.0)
            acc = acc * alpha[:, None] + _pv(p, v, P_DT, EMULATE)
            m = m_new
        out = tl.div_rn(acc, tl.where(l == 0.0, 1.0, l)[:, None])  # a row with no key: acc = 0
        if P_DT == tl.float8e4nv:
            v_scale = tl.load(v_scale_ptr + (s * HKV + kv_head).to(tl.int64) * D + dims, mask=d_ok, other=1.0)
            out = out * tl.div_rn(v_scale, FP8_MAX)[None, :]
        lse = (m + tl.log2(l)) * LN2
        if HAS_MEAN:  # smoothing shifted row i's scores by sm_scale q_i . k_mean
            if nk > 0:
                mean = tl.load(mean_ptr + (s * HKV + kv_head).to(tl.int64) * D + dims, mask=d_ok, other=0.0)
                q = _load(q_ptr, q_rows, row_ok, dims, d_ok, D).to(tl.float32)
                lse = lse + sm_scale * tl.sum(q * mean[None, :], axis=1)
        tl.store(out_ptr + q_rows[:, None] * D + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(lse_ptr + q_rows, lse, mask=row_ok)


# ---- backward ----

@triton.jit
def _safe(lse):
    """``lse`` with -inf (a row that sees no key) as 0, so that its masked scores give exp2(-inf) = 0."""
    return tl.where(lse == float("-inf"), 0.0, lse)


@triton.jit
def _dot_split(a, b, acc, LOW: tl.constexpr, DT: tl.constexpr):
    """``acc + a @ b`` for a float32 ``a`` (P or dS) and ``b`` an input, holding ``DT``'s values: when
    LOW, ``a`` as ``hi + lo``, both in DT, two products on the tensor cores (module docstring,
    precision); else tf32x3."""
    if LOW:
        hi = a.to(DT)
        lo = (a - hi.to(tl.float32)).to(DT)
        return tl.dot(lo, b.to(DT), tl.dot(hi, b.to(DT), acc))
    return tl.dot(a, b.to(tl.float32), acc, input_precision="tf32x3")


@triton.jit
def _query_tile(q_ptr, do_ptr, cu_k_ptr, s, h, q_begin, q_end, batch, q_base, q_start, nq_rows, nk_rows,
                HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
                CAUSAL: tl.constexpr, VARLEN: tl.constexpr):
    """What the backward kernels over query tiles start from: the tile's geometry
    (:func:`_tile_geometry`) and its ``q`` and ``dO``."""
    rows, row_ok, dims, d_ok, q_rows, k_head, _, _, nq, nk, stop = _tile_geometry(
        cu_k_ptr, s, h, q_begin, q_end, batch, q_base, q_start, nq_rows, nk_rows, HQ, HKV, D, DP, BLOCK_M, CAUSAL,
        VARLEN)
    q = _load(q_ptr, q_rows, row_ok, dims, d_ok, D)
    do = _load(do_ptr, q_rows, row_ok, dims, d_ok, D)
    return rows, row_ok, dims, d_ok, q_rows, k_head, q, do, nq, nk, stop


@triton.jit
def backward_preprocess_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, dlse_ptr, lse_ptr, delta_ptr, cu_q_ptr, cu_k_ptr, num_seqs, nq_rows, nk_rows,
    qk_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_DLSE: tl.constexpr, VARLEN: tl.constexpr,
    LOW: tl.constexpr,
):
    """Exact ``lse`` (base 2) and ``delta = rowsum(dO * O) - d lse`` of query tile ``program_id(0)``
    of head ``program_id(1)``: ``rowsum(dO * O) = rowsum(P * dO V^T)``, by an online softmax in
    float32 (P never rounded for a product)."""
    h = tl.program_id(1)
    s, q_begin, q_end, batch, q_base, q_start = _tile_start(cu_q_ptr, num_seqs, tl.program_id(0), BLOCK_M, VARLEN)
    if q_start < q_end:
        DT = q_ptr.dtype.element_ty
        rows, row_ok, dims, d_ok, q_rows, k_head, q, do, nq, nk, stop = _query_tile(
            q_ptr, do_ptr, cu_k_ptr, s, h, q_begin, q_end, batch, q_base, q_start, nq_rows, nk_rows, HQ, HKV, D, DP,
            BLOCK_M, CAUSAL, VARLEN)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        pdp = tl.zeros([BLOCK_M], tl.float32)  # rowsum(P * dO V^T), P relative to m
        for j0 in range(0, stop, BLOCK_N):
            cols = j0 + tl.arange(0, BLOCK_N)
            col_ok = cols < nk
            k = _load(k_ptr, k_head + cols, col_ok, dims, d_ok, D)
            v = _load(v_ptr, k_head + cols, col_ok, dims, d_ok, D)
            seen = col_ok[None, :]
            if CAUSAL:
                seen = seen & (cols[None, :] <= (rows - q_begin + (nk - nq))[:, None])
            scores = tl.where(seen, dot_inputs(q, tl.trans(k), LOW, DT) * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(scores - m_safe[:, None])
            alpha = tl.exp2(m - m_safe)
            l = l * alpha + tl.sum(p, axis=1)
            pdp = pdp * alpha + tl.sum(p * dot_inputs(do, tl.trans(v), LOW, DT), axis=1)
            m = m_new
        delta = pdp / tl.where(l == 0.0, 1.0, l)  # a row with no key: 0
        if HAS_DLSE:
            delta = delta - tl.load(dlse_ptr + q_rows, mask=row_ok, other=0.0)
        tl.store(lse_ptr + q_rows, m + tl.log2(l), mask=row_ok)
        tl.store(delta_ptr + q_rows, delta, mask=row_ok)


@triton.jit
def backward_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_q_ptr, cu_k_ptr, num_seqs, nq_rows, nk_rows,
    sm_scale, qk_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, LOW: tl.constexpr,
):
    """``dQ`` of query tile ``program_id(0)`` of head ``program_id(1)`` (module docstring, step 5)."""
    h = tl.program_id(1)
    s, q_begin, q_end, batch, q_base, q_start = _tile_start(cu_q_ptr, num_seqs, tl.program_id(0), BLOCK_M, VARLEN)
    if q_start < q_end:
        DT = q_ptr.dtype.element_ty
        rows, row_ok, dims, d_ok, q_rows, k_head, q, do, nq, nk, stop = _query_tile(
            q_ptr, do_ptr, cu_k_ptr, s, h, q_begin, q_end, batch, q_base, q_start, nq_rows, nk_rows, HQ, HKV, D, DP,
            BLOCK_M, CAUSAL, VARLEN)
        lse = _safe(tl.load(lse_ptr + q_rows, mask=row_ok, other=0.0))
        delta = tl.load(delta_ptr + q_rows, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, DP], tl.float32)
        for j0 in range(0, stop, BLOCK_N):
            cols = j0 + tl.arange(0, BLOCK_N)
            col_ok = cols < nk
            k = _load(k_ptr, k_head + cols, col_ok, dims, d_ok, D)
            v = _load(v_ptr, k_head + cols, col_ok, dims, d_ok, D)
            seen = col_ok[None, :]
            if CAUSAL:
                seen = seen & (cols[None, :] <= (rows - q_begin + (nk - nq))[:, None])
            p = tl.where(seen, tl.exp2(dot_inputs(q, tl.trans(k), LOW, DT) * qk_scale - lse[:, None]), 0.0)
            ds = p * (dot_inputs(do, tl.trans(v), LOW, DT) - delta[:, None])
            dq = _dot_split(ds, k, dq, LOW, DT)
        tl.store(dq_ptr + q_rows[:, None] * D + dims[None, :], (dq * sm_scale).to(dq_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def backward_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_q_ptr, cu_k_ptr, num_seqs, nq_rows,
    nk_rows, sm_scale, qk_scale,
    HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, LOW: tl.constexpr,
):
    """``dK``, ``dV`` of key tile ``program_id(0)`` of kv head ``program_id(1)``, summed over its
    group's query heads (module docstring, step 6)."""
    kv_head = tl.program_id(1)
    s, k_begin, k_end, batch, k_base, k_start = _tile_start(cu_k_ptr, num_seqs, tl.program_id(0), BLOCK_N, VARLEN)
    if k_start < k_end:
        DT = k_ptr.dtype.element_ty
        q_begin, q_end, _, q_base = _sequence(cu_q_ptr, s, VARLEN)
        nq = q_end - q_begin
        nk = k_end - k_begin
        cols = k_start - k_begin + tl.arange(0, BLOCK_N)  # key positions within the sequence
        col_ok = cols < nk
        dims = tl.arange(0, DP)
        d_ok = dims < D
        k_rows = (batch * HKV + kv_head).to(tl.int64) * nk_rows - k_base + k_begin + cols
        k = _load(k_ptr, k_rows, col_ok, dims, d_ok, D)
        v = _load(v_ptr, k_rows, col_ok, dims, d_ok, D)
        first = 0
        if CAUSAL:  # query i sees key j iff i >= j - (nk - nq)
            first = tl.maximum(0, k_start - k_begin - (nk - nq))
        dk = tl.zeros([BLOCK_N, DP], tl.float32)
        dv = tl.zeros([BLOCK_N, DP], tl.float32)
        for g in range(HQ // HKV):
            head = (batch * HQ + kv_head * (HQ // HKV) + g).to(tl.int64) * nq_rows - q_base
            for i0 in range(first, nq, BLOCK_M):
                rows = q_begin + i0 + tl.arange(0, BLOCK_M)
                row_ok = rows < q_end
                q = _load(q_ptr, head + rows, row_ok, dims, d_ok, D)
                do = _load(do_ptr, head + rows, row_ok, dims, d_ok, D)
                lse = _safe(tl.load(lse_ptr + head + rows, mask=row_ok, other=0.0))
                delta = tl.load(delta_ptr + head + rows, mask=row_ok, other=0.0)
                # transposed, [keys, queries]: P^T and dS^T multiply dO and Q as they are
                seen = col_ok[:, None] & row_ok[None, :]
                if CAUSAL:
                    seen = seen & (cols[:, None] <= (rows - q_begin + (nk - nq))[None, :])
                pt = tl.where(seen, tl.exp2(dot_inputs(k, tl.trans(q), LOW, DT) * qk_scale - lse[None, :]), 0.0)
                dv = _dot_split(pt, do, dv, LOW, DT)
                dst = pt * (dot_inputs(v, tl.trans(do), LOW, DT) - delta[None, :])
                dk = _dot_split(dst, q, dk, LOW, DT)
        mask = col_ok[:, None] & d_ok[None, :]
        tl.store(dk_ptr + k_rows[:, None] * D + dims[None, :], (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=mask)
        tl.store(dv_ptr + k_rows[:, None] * D + dims[None, :], dv.to(dv_ptr.dtype.element_ty), mask=mask)


# ---- launchers ----

def _interpreted(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _low_precision(dtype: torch.dtype, interpreted: bool) -> bool:
    """Whether dots take 16-bit operands (on a GPU); the interpreter mishandles bfloat16."""
    return not interpreted and dtype in (torch.float16, torch.bfloat16)


def _result_dtype(dtype: torch.dtype, interpreted: bool) -> torch.dtype:
    """What a kernel stores: bfloat16 results go through float32 under the interpreter, whose
    bfloat16 cast truncates (the host rounds them, as the reference's ``.to``)."""
    return torch.float32 if interpreted and dtype == torch.bfloat16 else dtype


def _decline(q: torch.Tensor, pv_dtype: str | None = None) -> None:
    if q.shape[3] not in HEAD_SIZES:
        raise NotImplementedError(f"triton: head size {q.shape[3]} is not supported (only {HEAD_SIZES})")
    if pv_dtype == "fp8" and not _interpreted(q):
        if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) < (8, 9):
            raise NotImplementedError("triton: pv_dtype 'fp8' needs float8_e4m3fn MMA (CUDA compute capability "
                                      "8.9 or newer)")


def _offsets(cu: torch.Tensor | None, batch: int, n: int, device) -> tuple[torch.Tensor, int, bool]:
    """``(offsets, sequences, varlen)``: ``cu_seqlens`` as given, else the batch elements' ``b * n``."""
    if cu is not None:
        return cu, cu.shape[0] - 1, True
    return torch.arange(batch + 1, dtype=torch.int64, device=device) * n, batch, False


def quantize(x: torch.Tensor, mean: torch.Tensor | None, multiplier: float, role: str, granularity: str,
             cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 [B, H, N, D], float32 per-row scale [B, H, N])`` of queries (``role="q"``,
    ``multiplier`` the folded ``sm_scale * log2(e)`` as a float32 value) or keys (``"k"``,
    ``multiplier`` 1), each smoothed by ``mean [S, H, D]`` if given: the reference's
    ``quantize_queries`` / ``quantize_keys`` per sequence."""
    batch, heads, n, d = x.shape
    cu, num_seqs, varlen = _offsets(cu_seqlens, batch, n, x.device)
    tile = BLOCK_Q if role == "q" else BLOCK_K
    block = _interpreted_block(n, tile) if _interpreted(x) else tile
    x8 = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(x.shape[:3], dtype=torch.float32, device=x.device)
    if x.numel():
        kernel = for_device(quantize_kernel, x.device)
        kernel[(batch * n // block + num_seqs, heads)](
            x, x if mean is None else mean, x8, scale, cu, num_seqs, n, multiplier,
            H=heads, D=d, DP=triton.next_power_of_2(d), BLOCK=block, TILE=tile, GROUPING=GROUPINGS[role, granularity],
            HAS_MEAN=mean is not None, VARLEN=varlen, num_warps=QUANTIZE_WARPS[role])
    return x8, scale


def quantize_values_fp8(v: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v8 [B, H, N, D], per-channel scale float32 [S, H, D])``, the reference's
    ``quantize_values_fp8`` per sequence: ``v8`` in float8_e4m3fn, or under the interpreter float32
    holding e4m3's values."""
    batch, heads, n, d = v.shape
    cu, num_seqs, varlen = _offsets(cu_seqlens, batch, n, v.device)
    interpreted = _interpreted(v)
    v8 = torch.empty(v.shape, dtype=torch.float32 if interpreted else torch.float8_e4m3fn, device=v.device)
    scale = torch.ones(num_seqs, heads, d, dtype=torch.float32, device=v.device)
    if v.numel() and num_seqs:
        kernel = for_device(value_fp8_kernel, v.device)
        kernel[(num_seqs, heads)](v, v8, scale, cu, n, H=heads, D=d, DP=triton.next_power_of_2(d),
                                  BLOCK=_interpreted_block(n, 64) if interpreted else 64,
                                  VARLEN=varlen, EMULATE_FP8=interpreted, num_warps=4)
    return v8, scale


_P_DTYPES = {"fp16": tl.float16, "fp8": tl.float8e4nv}
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def _p_dtype(pv_dtype: str, dtype: torch.dtype):
    return _P_DTYPES.get(pv_dtype) or _TL_DTYPES[dtype]


def config_space(kernel: str, head_size: int, dtype: torch.dtype = torch.float16, pv_dtype: str = "fp16",
                 interpreted: bool = False, num_q: int = 0, num_k: int = 0, arch: int | None = None) -> list[Config]:
    """The configs an autotuner may try (``triton_impl.autotune``): the heuristic's, then for the
    forward 32 to 128 query rows (key rows stay the reference's tile), 4 or 8 warps, 1 or 2
    stages; for the backward 16 to 64 rows of each, 4 or 8 warps."""
    default = default_config(kernel, head_size, dtype, pv_dtype, interpreted, num_q, num_k, arch)
    if kernel == "forward":
        return autotune.space(default, block_m=(32, 64, 128), num_warps=(4, 8), num_stages=(1, 2))
    return autotune.space(default, block_m=(16, 32, 64), block_n=(16, 32, 64), num_warps=(4, 8))


def _choose(kernel: str, q, run, key: dict, *heuristic_args) -> Config:
    """``kernel``'s config for this launch: tuned or cached per device (``triton_impl.autotune``),
    else the heuristic (``default_config(kernel, *heuristic_args)`` for ``q``'s GPU)."""
    batch, heads, num_q, head_size = q.shape
    key = dict(batch=batch, heads=heads, nq=num_q, head_size=str(head_size), **key, dtype=q.dtype)
    arch = arch_of(q.device)
    return autotune.choose(f"quantized_attention.{kernel}", q.device, key,
                           lambda: default_config(kernel, *heuristic_args, arch=arch),
                           lambda: config_space(kernel, *heuristic_args, arch=arch),
                           run)


def quantized_attention(q, k, v, k_mean, q_mean, key_bias, sm_scale, causal, granularity, pv_dtype, cu_seqlens_q,
                        cu_seqlens_k, config: Config | None = None):
    """The forward on CUDA/XPU tensors, or interpreted on CPU tensors (module docstring).

    Contract: ``torch_kernels.reference.quantized_attention.quantized_attention``. Declines head
    sizes other than 64, 96, 128, and ``pv_dtype="fp8"`` on a GPU without float8_e4m3fn MMA.
    """
    _decline(q, pv_dtype)
    batch, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    interpreted = _interpreted(q)
    config = config or _choose(
        "forward", q, lambda: quantized_attention(q, k, v, k_mean, q_mean, key_bias, sm_scale, causal, granularity,
                                                  pv_dtype, cu_seqlens_q, cu_seqlens_k),
        dict(nk=nk, causal=causal, pv=pv_dtype), d, q.dtype, pv_dtype, interpreted, nq)
    if config.block_n != BLOCK_K:
        raise ValueError(f"config: the forward's block_n must be the reference's key tile {BLOCK_K}, "
                         f"got {config.block_n}")
    lse = torch.full((batch, hq, nq), -math.inf, dtype=torch.float32, device=q.device)
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), lse
    cu_q, num_seqs, varlen = _offsets(cu_seqlens_q, batch, nq, q.device)
    cu_k, _, _ = _offsets(cu_seqlens_k, batch, nk, q.device)
    q8, q_scale = quantize(q, q_mean, folded_scale(sm_scale), "q", granularity, cu_seqlens_q)
    k8, k_scale = quantize(k, k_mean, 1.0, "k", granularity, cu_seqlens_k)
    if pv_dtype == "fp8":
        v_read, v_scale = quantize_values_fp8(v, cu_seqlens_k)
    else:
        v_read, v_scale = v, lse  # no scales read
    p_dtype = _p_dtype(pv_dtype, q.dtype)
    out = torch.empty(q.shape, dtype=_result_dtype(q.dtype, interpreted), device=q.device)
    kernel = for_device(attention_kernel, q.device)
    kernel[(batch * nq // config.block_m + num_seqs, hq)](
        q8, q_scale, k8, k_scale, v_read, v_scale, lse if k_mean is None else k_mean,
        lse if key_bias is None else key_bias, q, out, lse, cu_q, cu_k, num_seqs, nq, nk, sm_scale,
        HQ=hq, HKV=hkv, D=d, DP=triton.next_power_of_2(d), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        CAUSAL=causal, P_DT=p_dtype, HAS_MEAN=k_mean is not None, HAS_BIAS=key_bias is not None, VARLEN=varlen,
        EMULATE=interpreted, num_warps=config.num_warps, num_stages=config.num_stages)
    return out.to(q.dtype), lse


def quantized_attention_backward(grad_out, grad_lse, q, k, v, sm_scale, causal, cu_seqlens_q, cu_seqlens_k,
                                 configs: tuple[Config, Config] | None = None):
    """``(dq, dk, dv)`` of exact attention (module docstring, steps 4-6) on CUDA/XPU tensors, or
    interpreted on CPU tensors; ``configs`` for backward_dq (and the preprocessing) and
    backward_dkdv.

    Contract: ``torch_kernels.reference.quantized_attention.attention_backward``. Declines head
    sizes other than 64, 96, 128.
    """
    _decline(q)
    batch, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    interpreted = _interpreted(q)
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cu_q, num_seqs, varlen = _offsets(cu_seqlens_q, batch, nq, q.device)
    cu_k, _, _ = _offsets(cu_seqlens_k, batch, nk, q.device)
    if configs:
        dq_config, dkdv_config = configs
    else:
        rerun = lambda: quantized_attention_backward(grad_out, grad_lse, q, k, v, sm_scale, causal,  # noqa: E731
                                                     cu_seqlens_q, cu_seqlens_k)
        key = dict(nk=nk, causal=causal)
        dq_config = _choose("backward_dq", q, rerun, key, d, q.dtype, None, interpreted, nq, nk)
        dkdv_config = _choose("backward_dkdv", q, rerun, key, d, q.dtype, None, interpreted, nq, nk)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse)
    qk_scale = sm_scale * LOG2E
    common = dict(HQ=hq, HKV=hkv, D=d, DP=triton.next_power_of_2(d), CAUSAL=causal, VARLEN=varlen,
                  LOW=_low_precision(q.dtype, interpreted))
    dq_launch = dict(BLOCK_M=dq_config.block_m, BLOCK_N=dq_config.block_n, num_warps=dq_config.num_warps,
                     num_stages=dq_config.num_stages, **common)
    q_grid = (batch * nq // dq_config.block_m + num_seqs, hq)
    for_device(backward_preprocess_kernel, q.device)[q_grid](
        q, k, v, grad_out, lse if grad_lse is None else grad_lse, lse, delta, cu_q, cu_k, num_seqs, nq, nk, qk_scale,
        HAS_DLSE=grad_lse is not None, **dq_launch)
    result = _result_dtype(q.dtype, interpreted)
    dq = torch.empty(q.shape, dtype=result, device=q.device)
    dk = torch.empty(k.shape, dtype=result, device=q.device)
    dv = torch.empty(v.shape, dtype=result, device=q.device)
    for_device(backward_dq_kernel, q.device)[q_grid](
        q, k, v, grad_out, lse, delta, dq, cu_q, cu_k, num_seqs, nq, nk, sm_scale, qk_scale, **dq_launch)
    for_device(backward_dkdv_kernel, q.device)[(batch * nk // dkdv_config.block_n + num_seqs, hkv)](
        q, k, v, grad_out, lse, delta, dk, dv, cu_q, cu_k, num_seqs, nq, nk, sm_scale, qk_scale,
        BLOCK_M=dkdv_config.block_m, BLOCK_N=dkdv_config.block_n, num_warps=dkdv_config.num_warps,
        num_stages=dkdv_config.num_stages, **common)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def compile_targets(dtype: torch.dtype, head_size: int, heads: int = 32, kv_heads: int = 8, arch: int = 90):
    """``(label, kernel, signature, constexprs, num_warps, num_stages, dots)`` for every kernel a
    forward (each ``pv_dtype``, the per_thread groups, causal, varlen, Q and K smoothed, the key
    bias) and the backward launch on ``dtype`` inputs of ``head_size``, at their default configs for compute capability ``arch`` on
    a GPU."""
    x = "*" + _TRITON_TYPES[dtype]
    dp = triton.next_power_of_2(head_size)
    seqs = dict(cu_ptr="*i64", num_seqs="i32", n_rows="i32")
    targets = []
    for role, granularity in (("q", "per_thread"), ("k", "per_thread"), ("q", "per_warp")):
        block = BLOCK_Q if role == "q" else BLOCK_K
        constexprs = dict(H=heads if role == "q" else kv_heads, D=head_size, DP=dp, BLOCK=block, TILE=block,
                          GROUPING=GROUPINGS[role, granularity], HAS_MEAN=True, VARLEN=True)
        signature = dict(x_ptr=x, mean_ptr="*fp32", x8_ptr="*i8", scale_ptr="*fp32", **seqs, multiplier="fp32",
                         **dict.fromkeys(constexprs, "constexpr"))
        targets.append((f"quantize {role} {granularity}", quantize_kernel, signature, constexprs,
                        QUANTIZE_WARPS[role], None, False))
    constexprs = dict(H=kv_heads, D=head_size, DP=dp, BLOCK=64, VARLEN=True, EMULATE_FP8=False)
    signature = dict(v_ptr=x, v8_ptr="*fp8e4nv", scale_ptr="*fp32", cu_ptr="*i64", n_rows="i32",
                     **dict.fromkeys(constexprs, "constexpr"))
    targets.append(("value_fp8", value_fp8_kernel, signature, constexprs, 4, None, False))
    for pv_dtype in ("fp16", "fp8", "none"):
        config = default_config("forward", head_size, dtype, pv_dtype, arch=arch)
        p_dtype = _p_dtype(pv_dtype, dtype)
        constexprs = dict(HQ=heads, HKV=kv_heads, D=head_size, DP=dp, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                          CAUSAL=True, P_DT=p_dtype, HAS_MEAN=True, HAS_BIAS=True, VARLEN=True, EMULATE=False)
        signature = dict(q8_ptr="*i8", q_scale_ptr="*fp32", k8_ptr="*i8", k_scale_ptr="*fp32",
                         v_ptr="*fp8e4nv" if pv_dtype == "fp8" else x, v_scale_ptr="*fp32", mean_ptr="*fp32",
                         bias_ptr="*fp32", q_ptr=x, out_ptr=x, lse_ptr="*fp32", cu_q_ptr="*i64", cu_k_ptr="*i64",
                         num_seqs="i32", nq_rows="i32", nk_rows="i32", sm_scale="fp32",
                         **dict.fromkeys(constexprs, "constexpr"))
        targets.append((f"attention pv {pv_dtype}", attention_kernel, signature, constexprs, config.num_warps,
                        config.num_stages, True))
    common = dict(HQ=heads, HKV=kv_heads, D=head_size, DP=dp, CAUSAL=True, VARLEN=True,
                  LOW=_low_precision(dtype, False))
    inputs = dict(q_ptr=x, k_ptr=x, v_ptr=x, do_ptr=x)
    sizes = dict(cu_q_ptr="*i64", cu_k_ptr="*i64", num_seqs="i32", nq_rows="i32", nk_rows="i32")
    for name, kernel, config, pointers, scalars, extra in (
        ("backward_preprocess", backward_preprocess_kernel, "backward_dq",
         dict(dlse_ptr="*fp32", lse_ptr="*fp32", delta_ptr="*fp32"), dict(qk_scale="fp32"), dict(HAS_DLSE=True)),
        ("backward_dq", backward_dq_kernel, "backward_dq", dict(lse_ptr="*fp32", delta_ptr="*fp32", dq_ptr=x),
         dict(sm_scale="fp32", qk_scale="fp32"), {}),
        ("backward_dkdv", backward_dkdv_kernel, "backward_dkdv",
         dict(lse_ptr="*fp32", delta_ptr="*fp32", dk_ptr=x, dv_ptr=x), dict(sm_scale="fp32", qk_scale="fp32"), {}),
    ):
        config = default_config(config, head_size, dtype, arch=arch)
        constexprs = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, **common, **extra)
        signature = {**inputs, **pointers, **sizes, **scalars, **dict.fromkeys(constexprs, "constexpr")}
        targets.append((name, kernel, signature, constexprs, config.num_warps, config.num_stages, True))
    return targets


def compile_groups(everything: bool) -> dict:
    """The compile report's builds of this family: ``{group id: function of an arch returning its
    builds}``, a build being ``compile_report.Build``'s fields but ``family``. A group per head size,
    each with every kernel of the forward (each P.V dtype) and the backward. By default the share
    CI builds: float16 at 64, bfloat16 at 96, bfloat16 and float32 at 128; ``everything``: every
    dtype at every head size."""
    import functools

    from . import dtype_name

    shares = {64: (torch.float16,), 96: (torch.bfloat16,), 128: (torch.bfloat16, torch.float32)}

    def builds(head_size: int, dtypes, arch: int = 90) -> list[dict]:
        return [dict(label=f"{label} {dtype_name(dtype)} D={head_size}", kernel=kernel, signature=signature,
                     constexprs=constexprs, num_warps=num_warps, num_stages=num_stages)
                for dtype in dtypes
                for label, kernel, signature, constexprs, num_warps, num_stages, _ in compile_targets(
                    dtype, head_size, arch=arch)]

    return {f"quantized_attention-D{size}": functools.partial(builds, size, tuple(_TRITON_TYPES) if everything
                                                              else dtypes)
            for size, dtypes in shares.items()}

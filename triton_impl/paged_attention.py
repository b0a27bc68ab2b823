"""Ragged paged attention and the KV-cache write as Triton kernels.

One attention kernel serves mixed batches. A program owns ``BLOCK_Q`` query tokens of one
sequence and the query heads of one kv head (GQA rows share every key tile), finds its sequence
by binary search over ``cu_q_lens``, and walks the visible key positions ``BLOCK_N`` at a time
through the block table, with an online softmax in float32. A third grid axis splits the key
range (flash-decoding): each split writes its partial output and log-sum-exp and a second kernel
merges them, so that a few long decode sequences still fill the GPU.

The caches are addressed through their (block, slot, kv head) strides, passed as arguments, so
any view whose last dimension is contiguous (vLLM's key and value halves of one tensor) is read
and written in place.

Quantized caches are widened in registers; their per-kv-head scales are folded into the logit
scale (keys) and the output (values), so no per-element multiply is needed.

NaN and inf (the policy of ``torch_kernels.reference.paged_attention``): a program's key range
is walked once with no per-tile check; a NaN or inf entry in it, seen or not, leaves its sums
non-finite, and only then is the range walked again exactly, those positions zeroed and the rows
that see one written as NaN (see ``_attend_tiles``). Stores keep NaN (int8: 0) and saturate fp8
and int8 explicitly.

With ``key`` and ``value`` given, the kernel reads the new tokens' keys from those inputs
(rounded through the cache dtype, exactly as stored) and writes them to the cache itself, so
attention and the write are one launch. That needs each new token's slot to be the one its
position has in the block table and no other sequence to read a page being written; otherwise the
write runs first as its own launch (Triton has no grid-wide barrier to order them inside one).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from . import arch_of, autotune, for_device
from .checks import record
from .common import entry_offset, round_to_cache, sequence_of

# cache dtype -> how the kernels round a float32 value to it
_CACHE_KINDS = {torch.float32: 0, torch.float16: 0, torch.bfloat16: 0, torch.int8: 1,
                torch.float8_e4m3fn: 2, torch.float8_e5m2: 2}


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of one launch: query tokens and key positions per tile, key-range splits (a
    power of two)."""
    block_q: int
    block_n: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_config(num_tokens: int, num_seqs: int, group: int, head_size: int, max_kv: int,
                   num_kv_heads: int, sm_count: int, arch: int | None = None,
                   cache_dtype: torch.dtype | None = None) -> Config:
    """Heuristic: decode-heavy batches get 16 rows per program and split keys to fill the GPU;
    prefill 32 rows on sm_80 (``arch``, the compute capability, ``triton_impl.arch_of``; None: not
    CUDA), where 64 and 128 spilled with 16-bit tiles at head sizes 256 and 128. Decode from an
    8-bit ``cache_dtype`` past head size 128, where ptxas stopped at 128 registers and spilled
    (sm_90): int8 32-key tiles there, float8 two pipeline stages (their tiles are small)."""
    rows_per_token = triton.next_power_of_2(group)
    decode = num_tokens <= 2 * num_seqs
    rows = 16 if decode else 32 if arch is not None and arch < 90 else 64 if head_size > 128 else 128
    block_q = max(1, rows // rows_per_token)
    # 64 at head size 128 spilled 1-2 KB per thread (ptxas -v); 32 at 256, up to 1 KB
    block_n = 16 if head_size > 128 else 32 if head_size > 64 else 64
    wide_decode = decode and head_size > 128
    if wide_decode and cache_dtype == torch.int8 and (arch is None or arch >= 90):  # sm_80 fits 16
        block_n = 32
    float8_cache = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    programs = (num_tokens // block_q + num_seqs) * num_kv_heads
    wanted = -(-2 * sm_count // max(1, programs))
    num_splits = triton.next_power_of_2(max(1, min(wanted, 16, -(-max_kv // (4 * block_n)))))
    # one stage past head size 128: two copies of float32 key and value tiles there exceed an A100
    # block's shared memory (167,936 of 166,912 bytes at 256). Eight warps: with four, decode tiles
    # spilled up to 1.4 KB per thread (float32) at head sizes 64 and 128 (measured once; the
    # report, compiled_kernels.md, holds the defaults only).
    return Config(block_q=block_q, block_n=block_n, num_splits=num_splits, num_warps=8,
                  num_stages=1 if head_size > 128 and not (wide_decode and float8_cache) else 2)


@triton.jit
def reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    k_block_stride, k_slot_stride, k_head_stride, v_block_stride, v_slot_stride, v_head_stride,
    HKV: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CACHE_KIND: tl.constexpr,
):
    """Token ``program_id(0)``'s ``[Hkv, D]`` key and value to its slot (none for slot -1); the
    caches' strides (in elements; the last dimension's is 1) are arguments."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        heads = tl.arange(0, HP)
        dims = tl.arange(0, DP)
        mask = (heads[:, None] < HKV) & (dims[None, :] < D)
        offsets = heads[:, None] * D + dims[None, :]
        k_scale = tl.load(k_scale_ptr + heads, mask=heads < HKV, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads, mask=heads < HKV, other=1.0)
        k = tl.load(key_ptr + token * HKV * D + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(value_ptr + token * HKV * D + offsets, mask=mask, other=0.0).to(tl.float32)
        cache_dtype = key_cache_ptr.dtype.element_ty
        k_entry = entry_offset(slot, k_block_stride, k_slot_stride, BLOCK_SIZE) + heads[:, None] * k_head_stride
        v_entry = entry_offset(slot, v_block_stride, v_slot_stride, BLOCK_SIZE) + heads[:, None] * v_head_stride
        tl.store(key_cache_ptr + k_entry + dims[None, :],
                 round_to_cache(k / k_scale[:, None], CACHE_KIND, cache_dtype), mask=mask)
        tl.store(value_cache_ptr + v_entry + dims[None, :],
                 round_to_cache(v / v_scale[:, None], CACHE_KIND, cache_dtype), mask=mask)


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): exact limits at +-inf, no libdevice needed
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _load_keys(cache_ptr, new_ptr, scale, entry, new_row, kv_ok, is_new, kv_head, dims, d_ok,
               HKV: tl.constexpr, D: tl.constexpr, FUSED: tl.constexpr, CACHE_KIND: tl.constexpr):
    """Raw cache entries of ``BLOCK_N`` key positions (``entry``: each one's offset in the
    cache); new tokens (fused) from their inputs."""
    cached = kv_ok
    if FUSED:
        cached = kv_ok & ~is_new
    entries = tl.load(cache_ptr + entry[:, None] + dims[None, :],
                      mask=cached[:, None] & d_ok[None, :], other=0.0)
    if FUSED:
        fresh = tl.load(new_ptr + (new_row[:, None] * HKV + kv_head) * D + dims[None, :],
                        mask=(kv_ok & is_new)[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        stored = round_to_cache(fresh / scale, CACHE_KIND, cache_ptr.dtype.element_ty)
        entries = tl.where(is_new[:, None], stored, entries)
    return entries


@triton.jit
def _is_finite(x):
    return tl.abs(x) < float("inf")  # false for NaN too


@triton.jit
def _non_finite(entries, widened, CACHE_KIND: tl.constexpr):
    """Which cache entries are NaN or inf: fp8 by their bits (the interpreter widens those codes
    to finite numbers), the others by their widened values."""
    if CACHE_KIND == 2:
        bits = entries.to(tl.uint8, bitcast=True)
        if entries.dtype == tl.float8e4nv:
            return (bits & 0x7F) == 0x7F  # NaN (e4m3fn has no inf)
        else:
            return (bits & 0x7C) == 0x7C  # the top exponent: inf or NaN
    else:
        return ~_is_finite(widened)


@triton.jit
def _bad_positions(k_entries, v_entries, k, v, CACHE_KIND: tl.constexpr):
    """1 for each key position whose key or value holds a NaN or inf, else 0."""
    bad = _non_finite(k_entries, k, CACHE_KIND) | _non_finite(v_entries, v, CACHE_KIND)
    return tl.max(tl.where(bad, 1, 0), axis=1)


@triton.jit
def _widen(entries, dtype, FIX_FP8_SPECIALS: tl.constexpr):
    """Cache entries in the dot dtype. The interpreter widens fp8 NaN and inf codes to finite
    numbers: with FIX_FP8_SPECIALS they become NaN, as a GPU's conversion keeps them non-finite."""
    x = entries.to(dtype)
    if FIX_FP8_SPECIALS:
        x = tl.where(_non_finite(entries, x, 2), float("nan"), x)
    return x


@triton.jit
def _qk(q, k, DOT_F32: tl.constexpr):
    """``q k^T`` in float32: tf32x3 for float32 operands, else in their dtype."""
    if DOT_F32:
        return tl.dot(q, tl.trans(k), input_precision="tf32x3")
    return tl.dot(q, tl.trans(k))


@triton.jit
def _visible(kv_pos, q_pos, kv_ok, sliding_window, HAS_WINDOW: tl.constexpr):
    seen = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :]
    if HAS_WINDOW:
        seen &= kv_pos[None, :] > q_pos[:, None] - sliding_window
    return seen


@triton.jit
def _attend_tiles(q, q_ptrs, q_mask, q_pos, row_bad, seq, context, q_begin, kv_len, first, tile_lo, tile_hi, kv_head,
                  dims, d_ok,
                  key_cache_ptr, value_cache_ptr, key_ptr, value_ptr, block_table_ptr, block_table_stride,
                  k_strides, v_strides, k_scale, v_scale, logit_scale, soft_cap, sliding_window,
                  ROWS: tl.constexpr, DP: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
                  HAS_WINDOW: tl.constexpr, FUSED: tl.constexpr, CACHE_KIND: tl.constexpr, DOT_F32: tl.constexpr,
                  FIX_FP8_SPECIALS: tl.constexpr, EXACT: tl.constexpr, QK_CHUNK: tl.constexpr):
    """Online softmax of the rows over key tiles ``[tile_lo, tile_hi)``: (row_max, row_sum, acc,
    row_bad).

    The logits take the query tile ``q`` whole where ``QK_CHUNK == DP``; else they are summed over
    ``QK_CHUNK``-wide slices of the head, each slice of the query (at ``q_ptrs`` where ``q_mask``,
    read again from L1 per tile) and of the keys loaded for its own product: at head size 256
    whole query and key tiles held as dot operands spilled registers.

    The NaN policy in two passes. The fast pass (EXACT False) checks nothing per tile: a NaN or
    inf in the query or in any entry of the range, seen or not, reaches every row's sums and
    stays there, a value's through P @ V (a zero weight times NaN is NaN), a query's or key's
    through ``row_sum += sum(weights + logit * 0)`` (one FMA per logit; the logit before the soft
    cap, which would make an inf finite). Only when the caller finds that does the exact pass
    run, with the bad query rows zeroed and flagged: it reads the positions whose key or value
    holds a NaN or inf as zeros and flags in ``row_bad`` the rows that see one."""
    dot_dtype = tl.float32 if DOT_F32 else q_ptrs.dtype.element_ty
    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, DP], tl.float32)
    for tile in range(tile_lo, tile_hi):
        kv_pos = first + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < kv_len
        page = tl.load(block_table_ptr + seq * block_table_stride + kv_pos // BLOCK_SIZE, mask=kv_ok, other=0)
        page = page.to(tl.int64)
        offset = kv_pos % BLOCK_SIZE
        k_entry = page * k_strides[0] + offset * k_strides[1] + kv_head * k_strides[2]
        v_entry = page * v_strides[0] + offset * v_strides[1] + kv_head * v_strides[2]
        is_new = kv_pos >= context
        new_row = q_begin + kv_pos - context
        if QK_CHUNK == DP:
            k_entries = _load_keys(key_cache_ptr, key_ptr, k_scale, k_entry, new_row, kv_ok, is_new, kv_head, dims,
                                   d_ok, HKV, D, FUSED, CACHE_KIND)
        v_entries = _load_keys(value_cache_ptr, value_ptr, v_scale, v_entry, new_row, kv_ok, is_new, kv_head, dims,
                               d_ok, HKV, D, FUSED, CACHE_KIND)
        if QK_CHUNK == DP:
            k = _widen(k_entries, dot_dtype, FIX_FP8_SPECIALS)
        v = _widen(v_entries, dot_dtype, FIX_FP8_SPECIALS)
        seen = _visible(kv_pos, q_pos, kv_ok, sliding_window, HAS_WINDOW)
        keep = kv_ok
        if EXACT and CACHE_KIND != 1:  # int8 entries are always finite
            if QK_CHUNK != DP:
                k_entries = _load_keys(key_cache_ptr, key_ptr, k_scale, k_entry, new_row, kv_ok, is_new, kv_head,
                                       dims, d_ok, HKV, D, FUSED, CACHE_KIND)
                k = _widen(k_entries, dot_dtype, FIX_FP8_SPECIALS)
            bad = _bad_positions(k_entries, v_entries, k, v, CACHE_KIND) != 0
            row_bad = row_bad | (tl.max(tl.where(seen & bad[None, :], 1, 0), axis=1) != 0)
            # loaded again without those positions (zeros): a select on the loaded tiles would
            # cost shared memory for the whole kernel
            keep = kv_ok & ~bad
            k = _widen(_load_keys(key_cache_ptr, key_ptr, k_scale, k_entry, new_row, keep, is_new, kv_head, dims,
                                  d_ok, HKV, D, FUSED, CACHE_KIND), dot_dtype, FIX_FP8_SPECIALS)
            v = _widen(_load_keys(value_cache_ptr, value_ptr, v_scale, v_entry, new_row, keep, is_new, kv_head, dims,
                                  d_ok, HKV, D, FUSED, CACHE_KIND), dot_dtype, FIX_FP8_SPECIALS)
        if QK_CHUNK == DP:
            logits = _qk(q, k, DOT_F32)
        else:
            logits = tl.zeros([ROWS, BLOCK_N], tl.float32)
            for d0 in tl.static_range(0, DP, QK_CHUNK):
                part = d0 + tl.arange(0, QK_CHUNK)
                part_ok = part < D
                q_part = tl.load(q_ptrs + d0, mask=q_mask & part_ok[None, :], other=0.0).to(dot_dtype)
                k = _widen(_load_keys(key_cache_ptr, key_ptr, k_scale, k_entry, new_row, keep, is_new, kv_head, part,
                                      part_ok, HKV, D, FUSED, CACHE_KIND), dot_dtype, FIX_FP8_SPECIALS)
                logits += _qk(q_part, k, DOT_F32)
        raw_logits = logits * logit_scale
        logits = raw_logits
        if HAS_SOFT_CAP:
            logits = soft_cap * _tanh(logits / soft_cap)
        logits = tl.where(seen, logits, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(logits, axis=1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # rows that see nothing yet
        weights = tl.exp(logits - safe_max[:, None])
        correction = tl.exp(row_max - safe_max)
        if EXACT:
            row_sum = row_sum * correction + tl.sum(weights, axis=1)
        else:
            row_sum = row_sum * correction + tl.sum(weights + raw_logits * 0.0, axis=1)
        if DOT_F32:
            acc = acc * correction[:, None] + tl.dot(weights, v, input_precision="tf32x3")
        else:
            acc = acc * correction[:, None] + tl.dot(weights.to(dot_dtype), v)
        row_max = new_max
    return row_max, row_sum, acc, row_bad


@triton.jit
def paged_attention_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, cu_q_lens_ptr, kv_lens_ptr, block_table_ptr,
    k_scale_ptr, v_scale_ptr, key_ptr, value_ptr, slot_ptr, bad_rows_ptr, out_ptr, partial_out_ptr, partial_lse_ptr,
    sm_scale, soft_cap, sliding_window, num_seqs, num_tokens, block_table_stride,
    k_block_stride, k_slot_stride, k_head_stride, v_block_stride, v_slot_stride, v_head_stride,
    HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    DP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, HAS_WINDOW: tl.constexpr,
    FUSED: tl.constexpr, CACHE_KIND: tl.constexpr, DOT_F32: tl.constexpr, FIX_FP8_SPECIALS: tl.constexpr,
    HAS_BAD_ROWS: tl.constexpr,
):
    """Attention of one (query block, kv head, key split); see the module docstring. The caches'
    strides are in elements (their last dimension's is 1). With ``HAS_BAD_ROWS`` the tokens marked
    in ``bad_rows_ptr`` (the deferred checks' bad sequences) end as NaN rows."""
    block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = sequence_of(cu_q_lens_ptr, num_seqs, block, BLOCK_Q)
    q_begin = tl.load(cu_q_lens_ptr + seq)
    q_end = tl.load(cu_q_lens_ptr + seq + 1)
    q_start = q_begin + (block - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_start < q_end:
        kv_len = tl.load(kv_lens_ptr + seq)
        context = kv_len - (q_end - q_begin)  # positions before the new tokens

        # rows: BLOCK_Q tokens x GP heads (the G query heads of this kv head, padded)
        rows = tl.arange(0, BLOCK_Q * GP)
        token = q_start + rows // GP
        head = kv_head * G + rows % GP
        row_ok = (token < q_end) & (rows % GP < G)
        q_pos = context + token - q_begin
        dims = tl.arange(0, DP)
        d_ok = dims < D
        q_rows = q_ptr + (token.to(tl.int64)[:, None] * HQ + head[:, None]) * D
        q_mask = row_ok[:, None]
        # slices only help at 256 (at 128 they spilled more); float32 (tf32x3, operands split in
        # two) in 32-wide ones: 64-wide float32 decode spilled 88 bytes on sm_90
        QK_CHUNK: tl.constexpr = (32 if DOT_F32 else 64) if DP > 128 else DP
        q_ptrs = q_rows + tl.arange(0, QK_CHUNK)[None, :]
        q = q_ptrs  # (unused) sliced: read per slice in the loop
        if QK_CHUNK == DP:
            q = tl.load(q_rows + dims[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)

        # key positions any row of this block sees, in whole tiles, split NUM_SPLITS ways
        last = context + tl.minimum(q_start + BLOCK_Q, q_end) - 1 - q_begin
        first = 0
        if HAS_WINDOW:
            first = tl.maximum(0, context + q_start - q_begin - sliding_window + 1)
        first = first // BLOCK_N * BLOCK_N
        num_tiles = tl.cdiv(last + 1 - first, BLOCK_N)
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        tile_lo = split * per_split
        tile_hi = tl.minimum(num_tiles, tile_lo + per_split)

        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
        logit_scale = sm_scale * k_scale
        row_bad = tl.zeros([BLOCK_Q * GP], tl.int1)  # rows that end as NaN
        k_strides = (k_block_stride, k_slot_stride, k_head_stride)
        v_strides = (v_block_stride, v_slot_stride, v_head_stride)
        row_max, row_sum, acc, row_bad = _attend_tiles(
            q, q_ptrs, q_mask, q_pos, row_bad, seq, context, q_begin, kv_len, first, tile_lo, tile_hi, kv_head, dims,
            d_ok, key_cache_ptr, value_cache_ptr, key_ptr, value_ptr, block_table_ptr, block_table_stride,
            k_strides, v_strides, k_scale, v_scale, logit_scale, soft_cap, sliding_window, BLOCK_Q * GP, DP, HKV, D,
            BLOCK_SIZE, BLOCK_N,
            HAS_SOFT_CAP, HAS_WINDOW, FUSED, CACHE_KIND, DOT_F32, FIX_FP8_SPECIALS, False, QK_CHUNK)
        # a NaN or inf in a real row's sums: the query or some tile holds one (rare), so redo exactly
        leaked = row_ok & ((row_sum * 0.0 + tl.sum(acc * 0.0, axis=1)) != 0.0)
        if tl.max(tl.where(leaked, 1, 0), axis=0) != 0:
            # rows whose query holds a NaN or inf end as NaN; zeroed, they keep the sums finite
            if QK_CHUNK == DP:
                row_bad = tl.max(tl.where(_is_finite(q), 0, 1), axis=1) != 0
                q = tl.where(row_bad[:, None], tl.zeros_like(q), q)
            else:
                q_whole = tl.load(q_rows + dims[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
                row_bad = tl.max(tl.where(_is_finite(q_whole), 0, 1), axis=1) != 0
            row_max, row_sum, acc, row_bad = _attend_tiles(
                q, q_ptrs, q_mask & ~row_bad[:, None], q_pos, row_bad, seq, context, q_begin, kv_len, first, tile_lo,
                tile_hi, kv_head, dims, d_ok,
                key_cache_ptr, value_cache_ptr, key_ptr, value_ptr, block_table_ptr, block_table_stride,
                k_strides, v_strides, k_scale, v_scale, logit_scale, soft_cap, sliding_window, BLOCK_Q * GP, DP, HKV,
                D, BLOCK_SIZE, BLOCK_N, HAS_SOFT_CAP, HAS_WINDOW, FUSED, CACHE_KIND, DOT_F32, FIX_FP8_SPECIALS, True,
                QK_CHUNK)

        out_rows = token.to(tl.int64)[:, None] * HQ + head[:, None]
        mask = row_ok[:, None] & d_ok[None, :]
        if HAS_BAD_ROWS:  # read here, not held through the tiles (at head size 256 that spilled)
            row_bad = row_bad | (tl.load(bad_rows_ptr + token, mask=row_ok, other=0) != 0)
        normalized = acc * v_scale / tl.maximum(row_sum, 1e-30)[:, None]
        normalized = tl.where(row_bad[:, None], float("nan"), normalized)
        if NUM_SPLITS == 1:
            tl.store(out_ptr + out_rows * D + dims[None, :], normalized.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            lse = tl.where(row_sum > 0, row_max + tl.log(tl.maximum(row_sum, 1e-30)), float("-inf"))
            part = split * num_tokens * HQ + out_rows
            tl.store(partial_out_ptr + part * D + dims[None, :], normalized, mask=mask)
            tl.store(partial_lse_ptr + split * num_tokens * HQ + token.to(tl.int64) * HQ + head, lse, mask=row_ok)

        if FUSED and split == 0 and q_start == q_begin:
            # this sequence's new tokens go to the cache (read above from key/value, not from there)
            cache_dtype = key_cache_ptr.dtype.element_ty
            for t0 in range(q_begin, q_end, BLOCK_Q):
                new_tokens = t0 + tl.arange(0, BLOCK_Q)
                slot = tl.load(slot_ptr + new_tokens, mask=new_tokens < q_end, other=-1)
                write = (slot >= 0)[:, None] & d_ok[None, :]
                source = (new_tokens.to(tl.int64)[:, None] * HKV + kv_head) * D + dims[None, :]
                k_entry = entry_offset(slot, k_block_stride, k_slot_stride, BLOCK_SIZE) + kv_head * k_head_stride
                v_entry = entry_offset(slot, v_block_stride, v_slot_stride, BLOCK_SIZE) + kv_head * v_head_stride
                k_new = tl.load(key_ptr + source, mask=write, other=0.0).to(tl.float32)
                v_new = tl.load(value_ptr + source, mask=write, other=0.0).to(tl.float32)
                tl.store(key_cache_ptr + k_entry[:, None] + dims[None, :],
                         round_to_cache(k_new / k_scale, CACHE_KIND, cache_dtype), mask=write)
                tl.store(value_cache_ptr + v_entry[:, None] + dims[None, :],
                         round_to_cache(v_new / v_scale, CACHE_KIND, cache_dtype), mask=write)


@triton.jit
def merge_splits_kernel(partial_out_ptr, partial_lse_ptr, out_ptr, num_rows,
                        NUM_SPLITS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr):
    """Combine the splits' partial outputs of row ``program_id(0)`` (a token and query head)."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, DP)
    lse = tl.load(partial_lse_ptr + splits * num_rows + row)
    top = tl.max(lse, axis=0)
    weights = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))
    parts = tl.load(partial_out_ptr + (splits[:, None] * num_rows + row) * D + dims[None, :],
                    mask=(dims[None, :] < D) & (lse[:, None] > float("-inf")), other=0.0)
    merged = tl.sum(parts * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    tl.store(out_ptr + row * D + dims, merged.to(out_ptr.dtype.element_ty), mask=dims < D)


@triton.jit
def check_batch_kernel(cu_ptr, kv_ptr, table_ptr, table_stride, codes_ptr, word_ptr,
                         safe_cu_ptr, safe_kv_ptr, safe_table_ptr, bad_rows_ptr,
                         num_seqs, num_tokens, num_blocks, block_size, max_blocks, width,
                         SEQS: tl.constexpr, PAGES: tl.constexpr, TOKENS: tl.constexpr, SCAN: tl.constexpr):
    """The deferred checks of a paged batch, for the sequences ``[SEQS * program, +SEQS)``: see
    ``check_lengths``. Each program reads all of ``cu`` itself (a few bytes a sequence), so none
    waits on another for whether the offsets hold."""
    pid = tl.program_id(0)
    first = tl.load(cu_ptr)
    last = tl.load(cu_ptr + num_seqs)
    decreases = 0
    for start in range(0, num_seqs, SCAN):
        s = start + tl.arange(0, SCAN)
        a = tl.load(cu_ptr + s, mask=s < num_seqs, other=0)
        b = tl.load(cu_ptr + s + 1, mask=s < num_seqs, other=0)
        decreases += tl.sum((b < a).to(tl.int32), axis=0)
    offsets_bad = (first != 0) | (last != num_tokens) | (decreases != 0)

    seqs = pid * SEQS + tl.arange(0, SEQS)
    ok = seqs < num_seqs
    begin = tl.load(cu_ptr + seqs, mask=ok, other=0)
    end = tl.load(cu_ptr + seqs + 1, mask=ok, other=0)
    kv = tl.load(kv_ptr + seqs, mask=ok, other=0).to(tl.int64)
    q_len = (end - begin).to(tl.int64)
    pages = tl.where(kv > 0, (kv + block_size - 1) // block_size, 0)
    negative = ok & (kv < 0)
    short = ok & (q_len > kv)
    too_long = ok & (pages > max_blocks)
    bad_pages = tl.zeros([SEQS], tl.int32)
    for col0 in range(0, max_blocks, PAGES):
        cols = col0 + tl.arange(0, PAGES)
        used = ok[:, None] & (cols[None, :] < pages[:, None]) & (cols[None, :] < max_blocks)
        block = tl.load(table_ptr + seqs.to(tl.int64)[:, None] * table_stride + cols[None, :], mask=used, other=0)
        bad_pages += tl.sum((used & ((block < 0) | (block >= num_blocks))).to(tl.int32), axis=1)
    seq_bad = negative | short | too_long | (bad_pages != 0) | offsets_bad

    # the codes' order: check_lengths's messages (the offsets' three recorded once, by program 0)
    if pid == 0:
        record(word_ptr, codes_ptr, 0, (first != 0).to(tl.int32))
        record(word_ptr, codes_ptr, 1, decreases)
        record(word_ptr, codes_ptr, 2, (last != num_tokens).to(tl.int32))
    record(word_ptr, codes_ptr, 3, tl.sum(negative.to(tl.int32), axis=0))
    record(word_ptr, codes_ptr, 4, tl.sum(short.to(tl.int32), axis=0))
    record(word_ptr, codes_ptr, 5, tl.sum(too_long.to(tl.int32), axis=0))
    record(word_ptr, codes_ptr, 6, tl.sum(bad_pages, axis=0))

    # safe inputs: a bad sequence attends to its own new rows over page 0, and bad offsets give every
    # row to sequence 0 (so a kernel still writes each row, NaN); every page id kept is inside the cache
    first_seq = seqs == 0
    tl.store(safe_cu_ptr + seqs, tl.where(offsets_bad, tl.where(first_seq, 0, num_tokens), begin), mask=ok)
    if pid == 0:
        tl.store(safe_cu_ptr + num_seqs, num_tokens)
    safe_kv = tl.where(offsets_bad, tl.where(first_seq, num_tokens, 0), tl.where(seq_bad, q_len, kv))
    tl.store(safe_kv_ptr + seqs, safe_kv.to(tl.int32), mask=ok)
    for col0 in range(0, width, PAGES):
        cols = col0 + tl.arange(0, PAGES)
        inside = ok[:, None] & (cols[None, :] < max_blocks)
        block = tl.load(table_ptr + seqs.to(tl.int64)[:, None] * table_stride + cols[None, :], mask=inside, other=0)
        keep = inside & ~seq_bad[:, None] & (block >= 0) & (block < num_blocks)
        tl.store(safe_table_ptr + seqs.to(tl.int64)[:, None] * width + cols[None, :], tl.where(keep, block, 0),
                 mask=ok[:, None] & (cols[None, :] < width))

    # bad_rows: every row when the offsets are bad (program 0), else each sequence's rows its flag
    if offsets_bad:
        if pid == 0:
            for row0 in range(0, num_tokens, TOKENS):
                rows = row0 + tl.arange(0, TOKENS)
                tl.store(bad_rows_ptr + rows, tl.full([TOKENS], 1, tl.int1), mask=rows < num_tokens)
    else:
        lo = tl.min(tl.where(ok, begin, num_tokens), axis=0)
        hi = tl.max(tl.where(ok, end, 0), axis=0)
        for row0 in range(lo, hi, TOKENS):
            rows = row0 + tl.arange(0, TOKENS)
            mine = ok[None, :] & (rows[:, None] >= begin[None, :]) & (rows[:, None] < end[None, :])
            bad = tl.max((mine & seq_bad[None, :]).to(tl.int32), axis=1) != 0
            tl.store(bad_rows_ptr + rows, bad, mask=rows < hi)


# sequences a program, and its tiles of pages, rows and offsets: 32-wide tiles keep it in registers
# on sm_80 and sm_90 (64-wide ones spilled 300 bytes)
_LENGTHS_TILES = dict(SEQS=32, PAGES=32, TOKENS=32, SCAN=256)


def check_batch(cu_q_lens, kv_lens, block_table, num_tokens: int, num_blocks: int, block_size: int,
                codes: torch.Tensor, word: torch.Tensor):
    """A paged batch's deferred value checks in one launch, recorded in ``word`` (int32 counts) at
    ``codes`` (int64 ``[7]``, in the order of ``torch_kernels.ops.paged_attention.check_lengths``'s
    messages), no host read. Returns ``(cu_q_lens, kv_lens, block_table, bad_rows)`` made safe as
    that function's deferred mode says, except that bad offsets give every row to sequence 0 (they
    are all in ``bad_rows`` either way)."""
    num_seqs, max_blocks = block_table.shape
    width = max(max_blocks, -(-num_tokens // block_size))  # pages enough for a bad sequence's own rows
    device = cu_q_lens.device
    # the kernel steps 1 along each (a strided view, such as a column slice, is copied)
    cu_q_lens, kv_lens, block_table = cu_q_lens.contiguous(), kv_lens.contiguous(), block_table.contiguous()
    safe = torch.empty(2 * num_seqs + 1 + num_seqs * width, dtype=torch.int32, device=device)
    bad_rows = torch.empty(num_tokens, dtype=torch.bool, device=device)
    safe_cu, safe_kv = safe[:num_seqs + 1], safe[num_seqs + 1:2 * num_seqs + 1]
    safe_table = safe[2 * num_seqs + 1:].view(num_seqs, width)
    kernel = for_device(check_batch_kernel, device)
    kernel[(max(1, triton.cdiv(num_seqs, _LENGTHS_TILES["SEQS"])),)](
        cu_q_lens, kv_lens, block_table, block_table.stride(0), codes, word, safe_cu, safe_kv, safe_table, bad_rows,
        num_seqs, num_tokens, num_blocks, block_size, max_blocks, width, **_LENGTHS_TILES)
    return safe_cu, safe_kv, safe_table, bad_rows


def _dot_in_float32(dtype: torch.dtype, interpreted: bool) -> bool:
    """float32 queries multiply in float32 (tf32x3); the interpreter mishandles bfloat16, so there
    every dtype does."""
    return interpreted or dtype == torch.float32


def check_cache_dtype(cache: torch.Tensor) -> int:
    """How the kernels round to ``cache``'s dtype (``round_to_cache``'s CACHE_KIND); NotImplementedError
    where this device cannot store it."""
    kind = _CACHE_KINDS.get(cache.dtype)
    if kind is None:
        raise NotImplementedError(f"triton: cache dtype {cache.dtype} is not supported")
    if (cache.dtype == torch.float8_e4m3fn and cache.device.type == "cuda"
            and torch.cuda.get_device_capability(cache.device) < (8, 9)):
        raise NotImplementedError("triton: float8_e4m3fn caches need compute capability 8.9 or newer")
    return kind


def cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    """The (block, slot, kv head) strides of a ``[num_blocks, block_size, Hkv, D]`` cache, in
    elements; the kernels take any whose last dimension's is 1 (the op checks that)."""
    return cache.stride(0), cache.stride(1), cache.stride(2)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    """The write kernel on CUDA/XPU tensors, or interpreted on CPU tensors.

    Contract: ``torch_kernels.reference.paged_attention.reshape_and_cache``.
    """
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    kernel = for_device(reshape_and_cache_kernel, key.device)
    kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale,
        *cache_strides(key_cache), *cache_strides(value_cache),
        HKV=num_kv_heads, D=head_size, HP=triton.next_power_of_2(num_kv_heads),
        DP=triton.next_power_of_2(head_size), BLOCK_SIZE=key_cache.shape[1], CACHE_KIND=check_cache_dtype(key_cache),
    )


def writes_own_pages(cu_q_lens, kv_lens, block_table, slot_mapping, block_size: int, num_blocks: int) -> bool:
    """Whether each new token's slot is its position's slot in the block table and no other
    sequence reads a page being written, so the write may run inside the attention launch."""
    num_tokens = slot_mapping.shape[0]
    q_lens = (cu_q_lens[1:] - cu_q_lens[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(len(q_lens), device=q_lens.device), q_lens, output_size=num_tokens)
    position = kv_lens.long()[seq] - q_lens[seq] + (torch.arange(num_tokens, device=seq.device) - cu_q_lens.long()[seq])
    slot = block_table[seq, position // block_size].long() * block_size + position % block_size
    pages = (kv_lens.long() + block_size - 1) // block_size
    used = torch.arange(block_table.shape[1], device=seq.device) < pages[:, None]
    readers = torch.zeros(num_blocks, dtype=torch.int64, device=seq.device).index_add_(
        0, block_table[used].long(), torch.ones_like(block_table[used], dtype=torch.int64))
    return bool(((slot == slot_mapping).all() & (readers[slot // block_size] == 1).all()).item())


def config_space(num_tokens: int, num_seqs: int, group: int, head_size: int, max_kv: int, num_kv_heads: int,
                 sm_count: int, arch: int | None = None, cache_dtype: torch.dtype | None = None) -> list[Config]:
    """The configs an autotuner may try (``triton_impl.autotune``): the heuristic's, then 16 or 32
    rows per program (decode) or 32, 64 or 128 (prefill), 32 or 64 key positions a step, half, the
    same or twice the heuristic's key-range splits, 4 or 8 warps; at least 16 rows (tl.dot's
    smallest tile). A config out of shared memory fails to launch and is skipped."""
    default = default_config(num_tokens, num_seqs, group, head_size, max_kv, num_kv_heads, sm_count, arch,
                             cache_dtype)
    rows_per_token = triton.next_power_of_2(group)
    rows = (16, 32) if num_tokens <= 2 * num_seqs else (32, 64, 128)
    splits = {max(1, default.num_splits // 2), default.num_splits, min(16, 2 * default.num_splits)}
    return autotune.space(default, lambda config: config.block_q * rows_per_token >= 16,
                          block_q=sorted({max(1, r // rows_per_token) for r in rows}), block_n=(32, 64),
                          num_splits=sorted(splits), num_warps=(4, 8))


def ragged_paged_attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                           sliding_window, soft_cap, k_scale, v_scale, key, value, slot_mapping,
                           config: Config | None = None, out: torch.Tensor | None = None,
                           bad_rows: torch.Tensor | None = None):
    """The attention kernel (and merge) on CUDA/XPU tensors, or interpreted on CPU tensors;
    written into ``out`` (contiguous, query's shape and dtype) where given; the rows ``bad_rows``
    marks (bool ``[T]``) made NaN in the kernel.

    Contract: ``torch_kernels.reference.paged_attention.ragged_paged_attention``. float32 queries
    multiply in float32 (tf32x3); float16/bfloat16 in their own dtype; float32 accumulation.
    """
    num_tokens, num_q_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = kv_lens.shape[0]
    cache_kind = check_cache_dtype(key_cache)
    fused = key is not None and num_tokens > 0 and writes_own_pages(
        cu_q_lens, kv_lens, block_table, slot_mapping, block_size, num_blocks)
    if key is not None and not fused:
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    out = torch.empty_like(query) if out is None else out
    if num_tokens == 0 or num_seqs == 0:  # no sequence owns a row (with none, every row is bad)
        return out if bad_rows is None else out.masked_fill_(bad_rows[:, None, None], float("nan"))
    group = num_q_heads // num_kv_heads
    sizes = (num_tokens, num_seqs, group, head_size, block_table.shape[1] * block_size, num_kv_heads,
             _sm_count(query.device), arch_of(query.device), key_cache.dtype)
    config = config or autotune.choose(
        "paged_attention.ragged_paged_attention", query.device,
        dict(tokens=num_tokens, seqs=num_seqs, group=group, head_size=str(head_size), max_kv=sizes[4],
             kv_heads=num_kv_heads, dtype=query.dtype, cache=key_cache.dtype, fused=fused),
        lambda: default_config(*sizes), lambda: config_space(*sizes),
        lambda: ragged_paged_attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                                       sliding_window, soft_cap, k_scale, v_scale, key, value, slot_mapping))
    splits = config.num_splits
    if splits > 1:
        partial_out = torch.empty(splits, num_tokens, num_q_heads, head_size, device=query.device)
        partial_lse = torch.empty(splits, num_tokens, num_q_heads, device=query.device)
    else:
        partial_out = partial_lse = out  # not written
    if not fused:
        key = value = slot_mapping = query  # not read
    grid = (num_tokens // config.block_q + num_seqs, num_kv_heads, splits)
    kernel = for_device(paged_attention_kernel, query.device)
    kernel[grid](
        query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, k_scale, v_scale, key, value,
        slot_mapping, out if bad_rows is None else bad_rows, out, partial_out, partial_lse,
        sm_scale, 1.0 if soft_cap is None else soft_cap, 0 if sliding_window is None else sliding_window,
        num_seqs, num_tokens, block_table.stride(0), *cache_strides(key_cache), *cache_strides(value_cache),
        HQ=num_q_heads, HKV=num_kv_heads, G=group, GP=triton.next_power_of_2(group), D=head_size,
        DP=triton.next_power_of_2(head_size), BLOCK_SIZE=block_size, BLOCK_Q=config.block_q,
        BLOCK_N=config.block_n, NUM_SPLITS=splits, HAS_SOFT_CAP=soft_cap is not None,
        HAS_WINDOW=sliding_window is not None, FUSED=fused, CACHE_KIND=cache_kind,
        DOT_F32=_dot_in_float32(query.dtype, query.device.type == "cpu"),
        FIX_FP8_SPECIALS=query.device.type == "cpu" and cache_kind == 2, HAS_BAD_ROWS=bad_rows is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if splits > 1:
        merge = for_device(merge_splits_kernel, query.device)
        merge[(num_tokens * num_q_heads,)](partial_out, partial_lse, out, num_tokens * num_q_heads,
                                           NUM_SPLITS=splits, D=head_size, DP=triton.next_power_of_2(head_size))
    return out


TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8",
                 torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


# The caches' strides: i32 (Triton passes one of 2**31 or more as i64, a second specialization).
_STRIDE_SIGNATURE = {f"{cache}_{dim}_stride": "i32" for cache in "kv" for dim in ("block", "slot", "head")}


def write_compile_targets(query_dtype: torch.dtype, cache_dtype: torch.dtype, head_size: int = 128,
                          num_kv_heads: int = 8, block_size: int = 16):
    """(signature, constexprs) to build the write kernel ahead of time."""
    new, cache = "*" + TRITON_TYPES[query_dtype], "*" + TRITON_TYPES[cache_dtype]
    signature = {"key_ptr": new, "value_ptr": new, "key_cache_ptr": cache, "value_cache_ptr": cache,
                 "slot_ptr": "*i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", **_STRIDE_SIGNATURE}
    constexprs = {"HKV": num_kv_heads, "D": head_size, "HP": triton.next_power_of_2(num_kv_heads),
                  "DP": triton.next_power_of_2(head_size), "BLOCK_SIZE": block_size,
                  "CACHE_KIND": _CACHE_KINDS[cache_dtype]}
    signature.update({name: "constexpr" for name in constexprs})
    return signature, constexprs


def compile_targets(query_dtype: torch.dtype, cache_dtype: torch.dtype, head_size: int = 128, group: int = 4,
                    block_size: int = 16, decode: bool = True, fused: bool = False, arch: int = 90):
    """(signature, constexprs, config) to build the attention kernel ahead of time for compute
    capability ``arch``, with the config a launch of these sizes takes."""
    q, cache = "*" + TRITON_TYPES[query_dtype], "*" + TRITON_TYPES[cache_dtype]
    config = default_config(64 if decode else 4096, 64, group, head_size, 8192, 8, sm_count=132, arch=arch,
                            cache_dtype=cache_dtype)
    signature = {
        "q_ptr": q, "key_cache_ptr": cache, "value_cache_ptr": cache, "cu_q_lens_ptr": "*i32",
        "kv_lens_ptr": "*i32", "block_table_ptr": "*i32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
        "key_ptr": q, "value_ptr": q, "slot_ptr": "*i64", "bad_rows_ptr": "*i1", "out_ptr": q,
        "partial_out_ptr": "*fp32",
        "partial_lse_ptr": "*fp32", "sm_scale": "fp32", "soft_cap": "fp32", "sliding_window": "i32",
        "num_seqs": "i32", "num_tokens": "i32", "block_table_stride": "i32", **_STRIDE_SIGNATURE,
    }
    constexprs = {
        "HQ": 8 * group, "HKV": 8, "G": group, "GP": triton.next_power_of_2(group), "D": head_size,
        "DP": triton.next_power_of_2(head_size), "BLOCK_SIZE": block_size, "BLOCK_Q": config.block_q,
        "BLOCK_N": config.block_n, "NUM_SPLITS": config.num_splits, "HAS_SOFT_CAP": True, "HAS_WINDOW": True,
        "FUSED": fused, "CACHE_KIND": _CACHE_KINDS[cache_dtype], "DOT_F32": _dot_in_float32(query_dtype, False),
        "FIX_FP8_SPECIALS": False, "HAS_BAD_ROWS": True,  # deferred checks: an accelerator's default
    }
    signature.update({name: "constexpr" for name in constexprs})
    return signature, constexprs, config


_COMPILE_CASES = [  # (query dtype, cache dtype, decode batch, fused write)
    (torch.bfloat16, torch.bfloat16, True, False),
    (torch.bfloat16, torch.bfloat16, False, True),
    (torch.float16, torch.float8_e4m3fn, True, True),
    (torch.bfloat16, torch.float8_e5m2, False, False),
    (torch.float16, torch.int8, True, False),
    (torch.float32, torch.float32, True, False),
]
_MAX_SPLITS = 16  # the most key-range splits the config takes: the merge's widest tile


def compile_groups(everything: bool) -> dict:
    """The compile report's builds of this family: ``{group id: function of an arch returning its
    builds}``, a build being ``compile_report.Build``'s fields but ``family``. A group per head size,
    each with attention, the cache write and the split merge per (query, cache, decode, fused) case.
    By default the share CI builds: every case at head size 256, and 16-bit decode and prefill and
    float32 (the most shared memory) at 64 and 128; ``everything``: every case at every size."""
    from . import dtype_name

    def builds(head_size: int, cases, arch: int = 90) -> list[dict]:
        found = []
        for query_dtype, cache_dtype, decode, fused in cases:
            signature, constexprs, config = compile_targets(query_dtype, cache_dtype, head_size=head_size,
                                                            decode=decode, fused=fused, arch=arch)
            label = (f"{dtype_name(query_dtype)} q, {dtype_name(cache_dtype)} cache, "
                     f"{'decode' if decode else 'prefill'}{', fused' if fused else ''}, D={head_size}")
            found.append(dict(label=f"paged_attention {label}", kernel=paged_attention_kernel, signature=signature,
                              constexprs=constexprs, num_warps=config.num_warps, num_stages=config.num_stages))
            write_signature, write_constexprs = write_compile_targets(query_dtype, cache_dtype, head_size,
                                                                      constexprs["HKV"], constexprs["BLOCK_SIZE"])
            found.append(dict(label=f"reshape_and_cache {label}", kernel=reshape_and_cache_kernel,
                              signature=write_signature, constexprs=write_constexprs, num_warps=4, num_stages=None))
            found.append(dict(
                label=f"merge_splits {dtype_name(query_dtype)} out, {_MAX_SPLITS} splits, D={head_size}",
                kernel=merge_splits_kernel,
                signature={"partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
                           "out_ptr": "*" + TRITON_TYPES[query_dtype], "num_rows": "i32",
                           "NUM_SPLITS": "constexpr", "D": "constexpr", "DP": "constexpr"},
                constexprs=dict(NUM_SPLITS=_MAX_SPLITS, D=head_size, DP=constexprs["DP"]), num_warps=4,
                num_stages=None))
        return found

    def check_builds(arch: int = 90) -> list[dict]:
        index = "*i32"
        lengths = {name: index for name in ("cu_ptr", "kv_ptr", "table_ptr", "word_ptr", "safe_cu_ptr",
                                            "safe_kv_ptr", "safe_table_ptr")}
        lengths.update(codes_ptr="*i64", bad_rows_ptr="*i1", **{name: "i32" for name in (
            "table_stride", "num_seqs", "num_tokens", "num_blocks", "block_size", "max_blocks", "width")})
        return [dict(label="check_batch (deferred checks of a paged batch)", kernel=check_batch_kernel,
                     signature={**lengths, **{name: "constexpr" for name in _LENGTHS_TILES}},
                     constexprs=dict(_LENGTHS_TILES), num_warps=4, num_stages=None)]

    few = [_COMPILE_CASES[0], _COMPILE_CASES[1], _COMPILE_CASES[5]]
    return {**{f"paged_attention-D{size}": functools.partial(
        builds, size, _COMPILE_CASES if everything or size == 256 else few) for size in (64, 128, 256)},
        "paged_attention-checks": check_builds}

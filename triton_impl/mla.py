"""Multi-head latent attention over a paged latent cache, and its cache write, as Triton kernels.

The write: a program stores one token's row ``cat(kv_c, k_pe) / scale`` at its slot of a
``[num_blocks, block_size, Lr + R]`` cache, addressed through the cache's (block, slot) strides
and rounded as the paged attention family's write rounds (``common.round_to_cache``).

The attention: a program owns ``BLOCK_Q`` query tokens of one sequence (found by binary search
over ``cu_q_lens``) times ``BLOCK_H`` heads, and ``OUT_CHUNK`` columns of the output. It walks
the positions its rows see ``BLOCK_N`` at a time through the block table with an online softmax
in float32; each cache tile serves as keys (all ``Lr + R`` columns, multiplied ``L_CHUNK`` at a
time) and as values (its first ``Lr``, the program's chunk of them). Splitting the output
columns keeps the accumulator small at Lr 512 (the logits are recomputed per chunk; decode reads
the same tiles, from L2). Sparse calls (``topk_indices``) take one token per program and walk
its index list instead of the positions, so the work is ``top_k`` rows whatever the context.
The kv scale multiplies the logits and the output, not every entry. Contract:
``torch_kernels.reference.mla``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import arch_of, for_device
from .common import entry_offset, round_to_cache, sequence_of
from .paged_attention import TRITON_TYPES, check_cache_dtype


@triton.jit
def mla_reshape_and_cache_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_ptr, scale_ptr, block_stride, slot_stride,
    LR: tl.constexpr, R: tl.constexpr, LP: tl.constexpr, RP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    CACHE_KIND: tl.constexpr,
):
    """Token ``program_id(0)``'s latent and RoPE key to its slot (none for slot -1)."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        inverse = 1.0 / tl.load(scale_ptr)
        row = cache_ptr + entry_offset(slot, block_stride, slot_stride, BLOCK_SIZE)
        cache_dtype = cache_ptr.dtype.element_ty
        latent = tl.arange(0, LP)
        c = tl.load(kv_c_ptr + token * LR + latent, mask=latent < LR, other=0.0).to(tl.float32)
        tl.store(row + latent, round_to_cache(c * inverse, CACHE_KIND, cache_dtype), mask=latent < LR)
        rope = tl.arange(0, RP)
        k = tl.load(k_pe_ptr + token * R + rope, mask=rope < R, other=0.0).to(tl.float32)
        tl.store(row + LR + rope, round_to_cache(k * inverse, CACHE_KIND, cache_dtype), mask=rope < R)


@triton.jit
def _row_offsets(pos, pos_ok, seq, block_table_ptr, block_table_stride, block_stride, slot_stride,
                 BLOCK_SIZE: tl.constexpr):
    """Cache offsets of the rows at positions ``pos`` of sequence ``seq`` (0 where not ``pos_ok``)."""
    page = tl.load(block_table_ptr + seq.to(tl.int64) * block_table_stride + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    return page.to(tl.int64) * block_stride + (pos % BLOCK_SIZE).to(tl.int64) * slot_stride


@triton.jit
def _dot(a, b, dot_dtype, DOT_F32: tl.constexpr):
    """``a @ b`` accumulated in float32: operands in ``dot_dtype`` (cache entries widened through
    float32), float32 ones as tf32x3."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    return tl.dot(a.to(dot_dtype), b.to(tl.float32).to(dot_dtype), out_dtype=tl.float32)


@triton.jit
def _mla_tile(q_nope_rows, q_pe_rows, row_ok, q_pos, cache_ptr, entry, pos, pos_ok, column, logit_scale,
              row_max, row_sum, acc, LR: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, L_CHUNK: tl.constexpr,
              OUT_CHUNK: tl.constexpr, DOT_F32: tl.constexpr):
    """One tile of positions folded into the online softmax of the program's rows."""
    dot_dtype = tl.float32 if DOT_F32 else q_nope_rows.dtype.element_ty
    logits = tl.zeros((q_nope_rows.shape[0], pos.shape[0]), dtype=tl.float32)
    for start in tl.static_range(0, LR, L_CHUNK):
        dims = start + tl.arange(0, L_CHUNK)
        q = tl.load(q_nope_rows[:, None] + dims[None, :], mask=row_ok[:, None] & (dims[None, :] < LR), other=0.0)
        k = tl.load(cache_ptr + entry[None, :] + dims[:, None], mask=pos_ok[None, :] & (dims[:, None] < LR), other=0.0)
        logits += _dot(q, k, dot_dtype, DOT_F32)
    rope = tl.arange(0, RP)
    q = tl.load(q_pe_rows[:, None] + rope[None, :], mask=row_ok[:, None] & (rope[None, :] < R), other=0.0)
    k = tl.load(cache_ptr + entry[None, :] + LR + rope[:, None], mask=pos_ok[None, :] & (rope[:, None] < R), other=0.0)
    logits += _dot(q, k, dot_dtype, DOT_F32)
    seen = row_ok[:, None] & pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
    logits = tl.where(seen, logits * logit_scale, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(logits, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    weights = tl.exp(logits - safe_max[:, None])
    correction = tl.exp(row_max - safe_max)
    row_sum = row_sum * correction + tl.sum(weights, axis=1)
    v = tl.load(cache_ptr + entry[:, None] + column[None, :], mask=pos_ok[:, None] & (column[None, :] < LR), other=0.0)
    acc = acc * correction[:, None] + _dot(weights, v, dot_dtype, DOT_F32)
    return new_max, row_sum, acc


@triton.jit
def ragged_paged_mla_kernel(
    q_nope_ptr, q_pe_ptr, cache_ptr, cu_q_lens_ptr, kv_lens_ptr, block_table_ptr, topk_ptr, scale_ptr,
    out_ptr, lse_ptr, sm_scale, num_seqs, block_table_stride, block_stride, slot_stride,
    H: tl.constexpr, LR: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, TOPK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    L_CHUNK: tl.constexpr, OUT_CHUNK: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Attention of one (query block, head block, output chunk); see the module docstring.
    ``TOPK`` 0: dense; otherwise the width of ``topk_indices`` (then ``BLOCK_Q`` is 1)."""
    block = tl.program_id(0)
    seq = sequence_of(cu_q_lens_ptr, num_seqs, block, BLOCK_Q)
    q_begin = tl.load(cu_q_lens_ptr + seq)
    q_end = tl.load(cu_q_lens_ptr + seq + 1)
    q_start = q_begin + (block - (q_begin // BLOCK_Q + seq)) * BLOCK_Q
    if q_start < q_end:
        context = tl.load(kv_lens_ptr + seq) - (q_end - q_begin)
        rows = tl.arange(0, BLOCK_Q * BLOCK_H)
        token = q_start + rows // BLOCK_H
        head = tl.program_id(1) * BLOCK_H + rows % BLOCK_H
        row_ok = (token < q_end) & (head < H)
        q_pos = context + token - q_begin
        row = token.to(tl.int64) * H + head
        q_nope_rows = q_nope_ptr + row * LR
        q_pe_rows = q_pe_ptr + row * R
        column = tl.program_id(2) * OUT_CHUNK + tl.arange(0, OUT_CHUNK)
        kv_scale = tl.load(scale_ptr)
        logit_scale = sm_scale * kv_scale
        row_max = tl.full((BLOCK_Q * BLOCK_H,), float("-inf"), dtype=tl.float32)
        row_sum = tl.zeros((BLOCK_Q * BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_Q * BLOCK_H, OUT_CHUNK), dtype=tl.float32)
        if TOPK == 0:
            seen_end = context + tl.minimum(q_start + BLOCK_Q, q_end) - q_begin  # past the last row's position
            for first in range(0, seen_end, BLOCK_N):
                pos = first + tl.arange(0, BLOCK_N)
                pos_ok = pos < seen_end
                entry = _row_offsets(pos, pos_ok, seq, block_table_ptr, block_table_stride, block_stride,
                                     slot_stride, BLOCK_SIZE)
                row_max, row_sum, acc = _mla_tile(q_nope_rows, q_pe_rows, row_ok, q_pos, cache_ptr, entry, pos,
                                                  pos_ok, column, logit_scale, row_max, row_sum, acc, LR, R, RP,
                                                  L_CHUNK, OUT_CHUNK, DOT_F32)
        else:  # one token: its list, deduplicated by the op, -1 and later positions masked
            for first in range(0, TOPK, BLOCK_N):
                listed = first + tl.arange(0, BLOCK_N)
                pos = tl.load(topk_ptr + q_start.to(tl.int64) * TOPK + listed, mask=listed < TOPK, other=-1)
                pos_ok = pos >= 0
                entry = _row_offsets(pos, pos_ok, seq, block_table_ptr, block_table_stride, block_stride,
                                     slot_stride, BLOCK_SIZE)
                row_max, row_sum, acc = _mla_tile(q_nope_rows, q_pe_rows, row_ok, q_pos, cache_ptr, entry, pos,
                                                  pos_ok, column, logit_scale, row_max, row_sum, acc, LR, R, RP,
                                                  L_CHUNK, OUT_CHUNK, DOT_F32)
        out = acc * (kv_scale / tl.where(row_sum > 0, row_sum, 1.0))[:, None]
        tl.store(out_ptr + row[:, None] * LR + column[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (column[None, :] < LR))
        if tl.program_id(2) == 0:
            # -inf where nothing was attended; NaN stays NaN (a NaN query or an inf key), as elsewhere
            lse = tl.where(row_sum == 0, float("-inf"), row_max + tl.log(row_sum))
            tl.store(lse_ptr + row, lse, mask=row_ok)


def mla_reshape_and_cache(kv_c, k_pe, kv_cache, slot_mapping, scale) -> None:
    """The write kernel on CUDA/XPU tensors, or interpreted on CPU tensors."""
    num_tokens, latent = kv_c.shape
    if num_tokens == 0:
        return
    rope = k_pe.shape[1]
    kernel = for_device(mla_reshape_and_cache_kernel, kv_c.device)
    kernel[(num_tokens,)](
        kv_c, k_pe, kv_cache, slot_mapping, scale, kv_cache.stride(0), kv_cache.stride(1),
        LR=latent, R=rope, LP=triton.next_power_of_2(latent), RP=triton.next_power_of_2(rope),
        BLOCK_SIZE=kv_cache.shape[1], CACHE_KIND=check_cache_dtype(kv_cache),
    )


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles of one attention launch: query tokens and heads per program, positions per tile,
    latent columns per logit step and per output chunk."""
    block_q: int
    block_h: int
    block_n: int = 32
    l_chunk: int = 64
    out_chunk: int = 128
    num_warps: int = 4


def default_config(num_tokens: int, num_seqs: int, num_heads: int, latent: int, sparse: bool,
                   interpreted_run: bool = False, dtype: torch.dtype = torch.bfloat16,
                   arch: int | None = None) -> Config:
    """16 rows per program for decode and sparse calls (one token, 16 heads), 64 for prefill;
    128 output columns (the accumulator at 64 rows: 64 float32 registers a thread), float32
    (tf32x3 splits each operand in two) 32-column logit steps and 64-column chunks: 64 and 128
    spilled 172 bytes on sm_90; prefill on sm_80 (``arch``, ``triton_impl.arch_of``) 64-column
    chunks: 128 spilled 208 bytes there. The interpreter, whose cost is per step, takes the whole latent
    in one chunk."""
    rows = 16 if sparse or num_tokens <= 2 * num_seqs else 64
    block_h = min(triton.next_power_of_2(num_heads), rows)
    latent_p = triton.next_power_of_2(latent)
    if interpreted_run:
        return Config(block_q=1 if sparse else rows // block_h, block_h=block_h, block_n=32, l_chunk=latent_p,
                      out_chunk=latent_p)
    wide = dtype == torch.float32
    narrow_out = wide or (rows == 64 and arch is not None and arch < 90)
    return Config(block_q=1 if sparse else rows // block_h, block_h=block_h, l_chunk=min(32 if wide else 64, latent_p),
                  out_chunk=min(64 if narrow_out else 128, latent_p))


def ragged_paged_mla(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, sm_scale, topk_indices, scale,
                     config: Config | None = None):
    """The attention kernel on CUDA/XPU tensors, or interpreted on CPU tensors."""
    num_tokens, num_heads, latent = q_nope.shape
    out = torch.empty_like(q_nope)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q_nope.device)
    if num_tokens == 0:
        return out, lse
    check_cache_dtype(kv_cache)
    num_seqs = kv_lens.shape[0]
    sparse = topk_indices is not None
    on_cpu = q_nope.device.type == "cpu"  # interpreted: float32 dots (it mishandles bfloat16)
    config = config or default_config(num_tokens, num_seqs, num_heads, latent, sparse, on_cpu, q_nope.dtype,
                                     arch_of(q_nope.device))
    topk = topk_indices if sparse else cu_q_lens  # any int32 pointer when dense
    grid = (num_tokens // config.block_q + num_seqs, triton.cdiv(num_heads, config.block_h),
            triton.cdiv(latent, config.out_chunk))
    kernel = for_device(ragged_paged_mla_kernel, q_nope.device)
    kernel[grid](
        q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, topk, scale, out, lse, float(sm_scale), num_seqs,
        block_table.stride(0), kv_cache.stride(0), kv_cache.stride(1),
        H=num_heads, LR=latent, R=q_pe.shape[2], RP=triton.next_power_of_2(q_pe.shape[2]),
        TOPK=topk_indices.shape[1] if sparse else 0, BLOCK_SIZE=kv_cache.shape[1], BLOCK_Q=config.block_q,
        BLOCK_H=config.block_h, BLOCK_N=config.block_n, L_CHUNK=config.l_chunk, OUT_CHUNK=config.out_chunk,
        DOT_F32=on_cpu or q_nope.dtype == torch.float32,
        num_warps=config.num_warps,
    )
    return out, lse


@triton.jit
def _ordered(score):
    """float32 scores as int64 keys in the same order (a NaN first made -inf, -0 made +0)."""
    score = tl.where(score != score, float("-inf"), score)
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def indexer_topk_kernel(
    q_ptr, k_cache_ptr, weights_ptr, cu_q_lens_ptr, kv_lens_ptr, block_table_ptr, scratch_ptr, out_ptr, num_seqs,
    block_table_stride, block_stride, slot_stride, top_k,
    HI: tl.constexpr, DI: tl.constexpr, HI_P: tl.constexpr, DI_P: tl.constexpr, TOPK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Token ``program_id(0)``'s ``top_k`` best visible positions; see ``indexer_topk``."""
    token = tl.program_id(0)
    seq = sequence_of(cu_q_lens_ptr, num_seqs, token, 1)  # one query block per token (the grid is T + S)
    q_begin = tl.load(cu_q_lens_ptr + seq)
    q_end = tl.load(cu_q_lens_ptr + seq + 1)
    t = q_begin + (token - (q_begin + seq))
    if t < q_end:
        seen_end = tl.load(kv_lens_ptr + seq) - (q_end - t) + 1  # positions below it are visible
        heads = tl.arange(0, HI_P)
        dims = tl.arange(0, DI_P)
        row = t.to(tl.int64) * HI + heads
        q = tl.load(q_ptr + row[:, None] * DI + dims[None, :], mask=(heads[:, None] < HI) & (dims[None, :] < DI),
                    other=0.0)
        w = tl.load(weights_ptr + row, mask=heads < HI, other=0.0).to(tl.float32)
        none = tl.full((TOPK_P,), -9223372036854775808, dtype=tl.int64)  # below every real key
        best = none
        scratch = scratch_ptr + t.to(tl.int64) * TOPK_P + tl.arange(0, TOPK_P)
        for chunk in range(0, seen_end, TOPK_P):
            # the chunk's keys, BLOCK_N positions at a time, through this token's scratch row
            for first in tl.static_range(0, TOPK_P, BLOCK_N):
                pos = chunk + first + tl.arange(0, BLOCK_N)
                pos_ok = pos < seen_end
                entry = _row_offsets(pos, pos_ok, seq, block_table_ptr, block_table_stride, block_stride, slot_stride,
                                     BLOCK_SIZE)
                k = tl.load(k_cache_ptr + entry[None, :] + dims[:, None], mask=pos_ok[None, :] & (dims[:, None] < DI),
                            other=0.0)
                if DOT_F32:
                    dots = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
                else:
                    dots = tl.dot(q, k, out_dtype=tl.float32)
                # relu keeping NaN (then ranked as -inf, as the reference ranks it); padding heads
                # add nothing (their 0 weight times an inf dot would be NaN); the positive and negative
                # weights' terms summed apart, so an overflow is +inf or -inf whatever the fusing of
                # the sums, and both ways NaN (see indexer_topk)
                weighted = tl.maximum(dots, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[:, None]
                real = heads[:, None] < HI
                down = w[:, None] < 0.0
                score = (tl.sum(tl.where(real & ~down, weighted, 0.0), axis=0)
                         + tl.sum(tl.where(real & down, weighted, 0.0), axis=0))
                # higher score first, then lower position: the position, reversed, in the low bits
                key = (_ordered(score) << 32) | (2147483647 - pos).to(tl.int64)
                tl.store(scratch_ptr + t.to(tl.int64) * TOPK_P + first + tl.arange(0, BLOCK_N),
                         tl.where(pos_ok, key, -9223372036854775808))
            tl.debug_barrier()
            candidates = tl.load(scratch)
            tl.debug_barrier()  # every thread has read the row before the next chunk writes it
            # best sorted descending against the candidates ascending: the larger of each pair are
            # the best TOPK_P of both (the first step of a bitonic merge), sorted again
            best = tl.sort(tl.maximum(best, tl.sort(candidates)), descending=True)
        column = tl.arange(0, TOPK_P)
        chosen = tl.where(best == none, -1, 2147483647 - (best & 0xFFFFFFFF))
        tl.store(out_ptr + t.to(tl.int64) * top_k + column, chosen.to(tl.int32), mask=column < top_k)


def indexer_topk(q, k_cache, weights, cu_q_lens, kv_lens, block_table, top_k: int):
    """The fused indexer and top-k on CUDA/XPU tensors, or interpreted on CPU tensors. A program
    per token keeps its best ``top_k`` (position, score) keys sorted in registers and merges each
    chunk of ``top_k`` (rounded up to a power of two) positions' keys into them: scores are never
    kept past their chunk (a row of ``8 * top_k`` bytes per token holds a chunk's keys while the
    program assembles it ``BLOCK_N`` positions at a time)."""
    num_tokens, num_heads, head_size = q.shape
    out = torch.empty(num_tokens, top_k, dtype=torch.int32, device=q.device)
    if num_tokens == 0:
        return out
    constexprs, num_warps = indexer_constexprs(num_heads, head_size, top_k, k_cache.shape[1],
                                               q.device.type == "cpu" or q.dtype == torch.float32)
    scratch = torch.empty(num_tokens, constexprs["TOPK_P"], dtype=torch.int64, device=q.device)
    kernel = for_device(indexer_topk_kernel, q.device)
    kernel[(num_tokens + kv_lens.shape[0],)](
        q, k_cache, weights, cu_q_lens, kv_lens, block_table, scratch, out, kv_lens.shape[0],
        block_table.stride(0), k_cache.stride(0), k_cache.stride(1), top_k, **constexprs, num_warps=num_warps,
    )
    return out


def indexer_constexprs(num_heads: int, head_size: int, top_k: int, block_size: int, dot_f32: bool):
    """(constexprs, num_warps) of an indexer launch: heads and head size padded to powers of two
    of at least 16 (tl.dot's least), the kept keys to one of ``top_k``, 64 positions scored a
    step, and 8 warps from top 512 up (4 below) for the sorted ``2 * TOPK_P`` keys."""
    topk_p = max(16, triton.next_power_of_2(top_k))
    constexprs = {"HI": num_heads, "DI": head_size, "HI_P": max(16, triton.next_power_of_2(num_heads)),
                  "DI_P": max(16, triton.next_power_of_2(head_size)), "TOPK_P": topk_p,
                  "BLOCK_N": min(topk_p, 64), "BLOCK_SIZE": block_size, "DOT_F32": dot_f32}
    return constexprs, 4 if topk_p <= 256 else 8


def write_compile_target(new_dtype: torch.dtype, cache_dtype: torch.dtype, latent: int = 512, rope: int = 64,
                         block_size: int = 64):
    """(signature, constexprs) to build the write kernel ahead of time."""
    constexprs = {"LR": latent, "R": rope, "LP": triton.next_power_of_2(latent), "RP": triton.next_power_of_2(rope),
                  "BLOCK_SIZE": block_size, "CACHE_KIND": check_cache_dtype(torch.empty(0, dtype=cache_dtype))}
    new = "*" + TRITON_TYPES[new_dtype]
    signature = {"kv_c_ptr": new, "k_pe_ptr": new, "cache_ptr": "*" + TRITON_TYPES[cache_dtype], "slot_ptr": "*i64",
                 "scale_ptr": "*fp32", "block_stride": "i32", "slot_stride": "i32",
                 **{name: "constexpr" for name in constexprs}}
    return signature, constexprs


def compile_target(query_dtype: torch.dtype, cache_dtype: torch.dtype, decode: bool = True, sparse: bool = False,
                   num_heads: int = 128, latent: int = 512, rope: int = 64, block_size: int = 64, top_k: int = 2048,
                   arch: int = 90):
    """(signature, constexprs, config) to build the attention kernel ahead of time at these sizes
    (DeepSeek-V3's by default), with the config a launch of them takes."""
    config = default_config(64 if decode or sparse else 4096, 64, num_heads, latent, sparse, dtype=query_dtype,
                            arch=arch)
    q = "*" + TRITON_TYPES[query_dtype]
    signature = {"q_nope_ptr": q, "q_pe_ptr": q, "cache_ptr": "*" + TRITON_TYPES[cache_dtype], "cu_q_lens_ptr": "*i32",
                 "kv_lens_ptr": "*i32", "block_table_ptr": "*i32", "topk_ptr": "*i32", "scale_ptr": "*fp32",
                 "out_ptr": q, "lse_ptr": "*fp32", "sm_scale": "fp32", "num_seqs": "i32",
                 "block_table_stride": "i32", "block_stride": "i32", "slot_stride": "i32"}
    constexprs = {"H": num_heads, "LR": latent, "R": rope, "RP": triton.next_power_of_2(rope),
                  "TOPK": top_k if sparse else 0, "BLOCK_SIZE": block_size, "BLOCK_Q": config.block_q,
                  "BLOCK_H": config.block_h, "BLOCK_N": config.block_n, "L_CHUNK": config.l_chunk,
                  "OUT_CHUNK": config.out_chunk, "DOT_F32": query_dtype == torch.float32}
    signature.update({name: "constexpr" for name in constexprs})
    return signature, constexprs, config


def indexer_compile_target(dtype: torch.dtype, num_heads: int = 64, head_size: int = 128, top_k: int = 2048,
                           block_size: int = 64):
    """(signature, constexprs, num_warps) to build the indexer ahead of time (DeepSeek-V3.2's
    sizes by default: 64 indexer heads of 128, top 2048)."""
    constexprs, num_warps = indexer_constexprs(num_heads, head_size, top_k, block_size, dtype == torch.float32)
    q = "*" + TRITON_TYPES[dtype]
    signature = {"q_ptr": q, "k_cache_ptr": q, "weights_ptr": "*fp32", "cu_q_lens_ptr": "*i32", "kv_lens_ptr": "*i32",
                 "block_table_ptr": "*i32", "scratch_ptr": "*i64", "out_ptr": "*i32", "num_seqs": "i32",
                 "block_table_stride": "i32", "block_stride": "i32", "slot_stride": "i32", "top_k": "i32",
                 **{name: "constexpr" for name in constexprs}}
    return signature, constexprs, num_warps


_WRITE_CASES = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn)]
_ATTENTION_CASES = [  # (query dtype, cache dtype, decode, sparse)
    (torch.bfloat16, torch.bfloat16, True, False),
    (torch.bfloat16, torch.bfloat16, False, False),
    (torch.bfloat16, torch.bfloat16, True, True),
    (torch.bfloat16, torch.float8_e4m3fn, True, False),
    (torch.float32, torch.float32, True, False),
]


def compile_groups(everything: bool) -> dict:
    """The compile report's builds of this family at DeepSeek-V3's sizes (128 heads, Lr 512, R 64,
    64-slot pages, top-k 2048): attention in bfloat16 for decode, prefill and sparse calls, from a
    float8_e4m3fn cache and in float32, and the write from bfloat16 to a bfloat16 and a
    float8_e4m3fn cache (float16 compiles as bfloat16 does; ``everything`` adds its write and
    float32's); the indexer in bfloat16 (DeepSeek-V3.2: 64 heads of 128) at top 64, a group of its
    own ahead of the attention's so that only the newest arch builds it, and at DeepSeek-V3.2's top
    2048 with ``everything`` only: ptxas takes minutes over that one's merge network (measured once
    with ``TORCH_KERNELS_COMPILE_ALL=1``: 254 registers on sm_90 and 225 on sm_80, no spills; the
    committed report is the default one, without it)."""
    from . import dtype_name

    writes = _WRITE_CASES + ([(torch.float16, torch.float16), (torch.float32, torch.float32)] if everything else [])

    def indexer_builds(arch: int = 90) -> list[dict]:
        found = []
        for dtype, top_k in ((torch.bfloat16, 64), *([(torch.bfloat16, 2048)] if everything else [])):
            signature, constexprs, num_warps = indexer_compile_target(dtype, top_k=top_k)
            found.append(dict(label=f"indexer_topk {dtype_name(dtype)} Hi=64 Di=128 top_k={top_k}",
                              kernel=indexer_topk_kernel, signature=signature, constexprs=constexprs,
                              num_warps=num_warps, num_stages=None))
        return found

    def builds(arch: int = 90) -> list[dict]:
        found = []
        for query_dtype, cache_dtype, decode, sparse in _ATTENTION_CASES:
            signature, constexprs, config = compile_target(query_dtype, cache_dtype, decode, sparse, arch=arch)
            kind = "sparse" if sparse else "decode" if decode else "prefill"
            found.append(dict(label=f"ragged_paged_mla {dtype_name(query_dtype)} q, {dtype_name(cache_dtype)} "
                                    f"cache, {kind}, H=128 Lr=512", kernel=ragged_paged_mla_kernel,
                              signature=signature, constexprs=constexprs, num_warps=config.num_warps,
                              num_stages=None))
        for new_dtype, cache_dtype in writes:
            signature, constexprs = write_compile_target(new_dtype, cache_dtype)
            found.append(dict(label=f"mla_reshape_and_cache {dtype_name(new_dtype)} -> {dtype_name(cache_dtype)} "
                                    "Lr=512 R=64", kernel=mla_reshape_and_cache_kernel, signature=signature,
                              constexprs=constexprs, num_warps=4, num_stages=None))
        return found

    return {"mla-indexer": indexer_builds, "mla": builds}

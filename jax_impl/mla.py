"""Multi-head latent attention over a paged latent cache, as Pallas TPU kernels.

The cache is ``[num_blocks, block_size, Lr + R]``: one row per token, the latent ``c`` then the
RoPE key ``k_pe``, shared by every head; slot ``= block * block_size + offset``, pages through
``block_table`` as in ``jax_impl.paged_attention``. The logit of query ``t``, head ``h`` and
position ``s`` is ``(q_nope[t, h] . c[s] + q_pe[t, h] . k_pe[s]) * sm_scale * kv_scale``; the
values are the latents ``c[s]``; causal.

Dense calls: the grid walks blocks of ``q_block`` tokens of one sequence (the paged attention
family's schedule); a step holds all ``H`` heads of its tokens as one ``[H * q_block, Lr]``
matrix (row ``h * q_block + t``), copies the pages its rows see ``kv_pages`` at a time from HBM
into VMEM (every head reads the same rows), and keeps an online softmax in float32 VMEM.
Sparse calls (``topk_indices``): a step is one token; it copies the cache rows its list names
(``SPARSE_TILE`` at a time, one row copy each) and runs the same softmax over them.

NaN and inf, as the reference and the Triton kernel: rows past the block's last position, pages
the block does not need and positions a list does not name are never used (staged as 0); a NaN
or inf in a staged row flows through the sums (a zero weight times NaN is NaN). A query that
attends to nothing gets zeros and lse ``-inf``; a NaN sum stays NaN in both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import interpret_params, round_up
from .paged_attention import schedule

KV_TILE = 128  # positions per dense tile, at most (whole pages)
SPARSE_TILE = 128  # listed positions per sparse tile, at most
MAX_Q_BLOCK = 16


def _fold_tile(q_nope, q_pe, kv, seen, logit_scale, m_ref, l_ref, acc_ref, latent, dot_dtype):
    """One tile of cache rows ``kv [n, Lr + R]`` (float32, zeros where unused) folded into the
    online softmax of the rows ``q_nope [rows, Lr]``, ``q_pe [rows, R]`` under mask ``seen [rows, n]``."""
    c, k_pe = kv[:, :latent].astype(dot_dtype), kv[:, latent:].astype(dot_dtype)
    contract = (((1,), (1,)), ((), ()))
    logits = (jax.lax.dot_general(q_nope, c, contract, preferred_element_type=jnp.float32)
              + jax.lax.dot_general(q_pe, k_pe, contract, preferred_element_type=jnp.float32))
    logits = jnp.where(seen, logits * logit_scale, -jnp.inf)
    m_prev = m_ref[...]
    m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))  # NaN propagates
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen nothing yet
    weights = jnp.exp(logits - m_safe)
    correction = jnp.exp(m_prev - m_safe)
    l_ref[...] = l_ref[...] * correction + jnp.sum(weights, axis=1, keepdims=True)
    acc_ref[...] = acc_ref[...] * correction + jnp.dot(weights.astype(dot_dtype), c, preferred_element_type=jnp.float32)
    m_ref[...] = m_new


def _finish(o_ref, lse_ref, m_ref, l_ref, acc_ref, kv_scale):
    total = l_ref[...]
    empty = total == 0.0
    out = jnp.where(empty, 0.0, acc_ref[...] * (kv_scale / jnp.where(empty, 1.0, total)))
    o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, -jnp.inf, m_ref[...] + jnp.log(jnp.where(empty, 1.0, total))).reshape(lse_ref.shape)


def _start_softmax(m_ref, l_ref, acc_ref):
    m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
    l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)


def _copy_pages(tile, pages_needed, seq, table_ref, cache_ref, buf, sem, max_pages: int, num_blocks: int):
    """Copy tile ``tile``'s pages (``buf.shape[0]`` of them) of sequence ``seq`` from HBM into
    ``buf``, every copy in flight at once, and wait for them. Pages from ``pages_needed`` on are
    never copied: their table entries may be anything (the clamps keep any input in bounds)."""
    kv_pages = buf.shape[0]

    def page_copy(p, action):
        page = tile * kv_pages + p

        @pl.when(page < pages_needed)
        def _():
            block = jnp.clip(table_ref[seq * max_pages + jnp.minimum(page, max_pages - 1)], 0, num_blocks - 1)
            copy = pltpu.make_async_copy(cache_ref.at[block], buf.at[p], sem.at[0])
            copy.start() if action == "start" else copy.wait()

    for action in ("start", "wait"):
        jax.lax.fori_loop(jnp.int32(0), jnp.int32(kv_pages), lambda p, c: (page_copy(p, action), c)[1], 0)


def _dense_kernel(item_seq_ref, item_q0_ref, item_count_ref, cu_ref, kv_lens_ref, table_ref, scale_ref, q_nope_ref,
                  q_pe_ref, cache_ref, o_ref, lse_ref, buf, sem, m_ref, l_ref, acc_ref, *, num_heads, q_block,
                  kv_pages, block_size, max_pages, num_blocks, latent, sm_scale, dot_dtype):
    i = pl.program_id(0)
    s, q0, count = item_seq_ref[i], item_q0_ref[i], item_count_ref[i]
    first = kv_lens_ref[s] - (cu_ref[s + 1] - cu_ref[s]) + q0  # position of the block's first token
    end = first + count  # the positions some row of the block sees are below it
    kv_tile = kv_pages * block_size
    num_tiles = jnp.where(count > 0, jax.lax.div(end + kv_tile - 1, jnp.int32(kv_tile)), 0)
    pages_needed = jax.lax.div(end + block_size - 1, jnp.int32(block_size))
    rows = num_heads * q_block
    q_nope = q_nope_ref[...].reshape(rows, latent).astype(dot_dtype)
    q_pe = q_pe_ref[...].reshape(rows, -1).astype(dot_dtype)
    row_t = jax.lax.broadcasted_iota(jnp.int32, (rows, kv_tile), 0) & (q_block - 1)  # rows are head-major
    row_pos, row_real = first + row_t, row_t < count
    _start_softmax(m_ref, l_ref, acc_ref)

    def body(tile, carry):
        _copy_pages(tile, pages_needed, s, table_ref, cache_ref, buf, sem, max_pages, num_blocks)
        start = tile * kv_tile
        position = start + jax.lax.broadcasted_iota(jnp.int32, (kv_tile, 1), 0)
        kv = jnp.where(position < end, buf[...].reshape(kv_tile, -1).astype(jnp.float32), 0.0)
        k_pos = start + jax.lax.broadcasted_iota(jnp.int32, (rows, kv_tile), 1)
        _fold_tile(q_nope, q_pe, kv, (k_pos <= row_pos) & row_real, sm_scale * scale_ref[0], m_ref, l_ref, acc_ref,
                   latent, dot_dtype)
        return carry

    jax.lax.fori_loop(jnp.int32(0), num_tiles, body, 0)
    _finish(o_ref, lse_ref, m_ref, l_ref, acc_ref, scale_ref[0])


def _sparse_kernel(token_seq_ref, cu_ref, kv_lens_ref, table_ref, topk_ref, scale_ref, listed_ref, q_nope_ref,
                   q_pe_ref, cache_ref, o_ref, lse_ref, buf, sem, m_ref, l_ref, acc_ref, *, num_heads, width,
                   tile, block_size, max_pages, num_blocks, latent, sm_scale, dot_dtype):
    t = pl.program_id(0)
    s = token_seq_ref[t]
    q_pos = kv_lens_ref[s] - cu_ref[s + 1] + t
    q_nope = q_nope_ref[...].reshape(num_heads, latent).astype(dot_dtype)
    q_pe = q_pe_ref[...].reshape(num_heads, -1).astype(dot_dtype)
    _start_softmax(m_ref, l_ref, acc_ref)
    for first in range(0, width, tile):
        def row_copy(k, action):
            pos = topk_ref[t * width + first + k]
            use = (pos >= 0) & (pos <= q_pos)

            @pl.when(use)
            def _():
                page = jax.lax.div(pos, jnp.int32(block_size))
                block = jnp.clip(table_ref[s * max_pages + jnp.minimum(page, max_pages - 1)], 0, num_blocks - 1)
                copy = pltpu.make_async_copy(cache_ref.at[block, pos - page * block_size], buf.at[k], sem.at[0])
                copy.start() if action == "start" else copy.wait()

            if action == "start":
                @pl.when(~use)
                def _():
                    buf[pl.ds(k, 1), :] = jnp.zeros((1, buf.shape[1]), buf.dtype)  # no stale row reaches the sums

        for action in ("start", "wait"):
            jax.lax.fori_loop(jnp.int32(0), jnp.int32(tile), lambda k, c: (row_copy(k, action), c)[1], 0)
        pos = listed_ref[0, :, pl.ds(first, tile)]  # [1, tile]
        seen = jnp.broadcast_to((pos >= 0) & (pos <= q_pos), (num_heads, tile))
        _fold_tile(q_nope, q_pe, buf[...].astype(jnp.float32), seen, sm_scale * scale_ref[0], m_ref, l_ref, acc_ref,
                   latent, dot_dtype)
    _finish(o_ref, lse_ref, m_ref, l_ref, acc_ref, scale_ref[0])


def _token_sequences(cu, num_tokens: int):
    """int32 ``[T]``: the sequence each token of the ragged batch belongs to, from its offsets ``cu``
    (tokens past the last offset go to the last sequence)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    return jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), cu.shape[0] - 2).astype(jnp.int32)


def _scratch(rows: int, latent: int):
    return [pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, latent), jnp.float32)]


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret"))
def ragged_paged_mla(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, sm_scale, topk_indices=None,
                     kv_scale=None, *, interpret=None):
    """Causal latent attention of a ragged batch over a paged latent cache, by Pallas.

    q_nope ``[T, H, Lr]``, q_pe ``[T, H, R]`` (float32, bfloat16, float16); kv_cache
    ``[num_blocks, block_size, Lr + R]`` (q's dtype, int8 or float8; an entry means
    ``entry * kv_scale``); cu_q_lens ``[S+1]``, kv_lens ``[S]``, block_table ``[S, max_pages]``
    int32; sm_scale a static float; topk_indices optional int32 ``[T, k]`` (positions of the
    token's sequence, -1 none, no repeats); kv_scale float32 ``[1]`` or None (1).

    Returns ``(out [T, H, Lr] in q's dtype, lse [T, H] float32)``. Inputs are expected to be
    valid (the torch op checks them); invalid ones give wrong numbers, never a read outside the
    arrays.
    """
    num_tokens, num_heads, latent = q_nope.shape
    num_blocks, block_size, width = kv_cache.shape
    num_seqs, max_pages = block_table.shape
    if num_tokens == 0 or num_seqs == 0:
        return jnp.zeros(q_nope.shape, q_nope.dtype), jnp.full((num_tokens, num_heads), -jnp.inf, jnp.float32)
    # TPUs multiply float16 poorly or not at all: float16 queries are computed in float32
    out_dtype = q_nope.dtype
    compute_dtype = jnp.float32 if out_dtype == jnp.float16 else out_dtype
    dot_dtype = jnp.bfloat16 if q_nope.dtype == jnp.bfloat16 else jnp.float32
    scale = jnp.ones((1,), jnp.float32) if kv_scale is None else jnp.ravel(kv_scale).astype(jnp.float32)
    cu, lens = cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32)
    table = jnp.pad(block_table.astype(jnp.int32).reshape(-1), (0, 1 if max_pages == 0 else 0))  # SMEM: not empty
    any_spec, smem = pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pltpu.SMEM)
    static = dict(num_heads=num_heads, block_size=block_size, max_pages=max(1, max_pages), num_blocks=num_blocks,
                  latent=latent, sm_scale=float(sm_scale), dot_dtype=dot_dtype)
    q_nope, q_pe = q_nope.astype(compute_dtype), q_pe.astype(compute_dtype)

    if topk_indices is not None:
        tile = min(SPARSE_TILE, round_up(topk_indices.shape[1], 8))
        listed = jnp.pad(topk_indices.astype(jnp.int32), ((0, 0), (0, round_up(topk_indices.shape[1], tile)
                                                                     - topk_indices.shape[1])), constant_values=-1)
        token_seq = _token_sequences(cu, num_tokens)
        row_spec = lambda n: pl.BlockSpec((1, num_heads, n), lambda t, *_: (t, 0, 0))  # noqa: E731
        out, lse = pl.pallas_call(
            functools.partial(_sparse_kernel, width=listed.shape[1], tile=tile, **static),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=5, grid=(num_tokens,),
                in_specs=[smem, pl.BlockSpec((1, 1, listed.shape[1]), lambda t, *_: (t, 0, 0)),
                          row_spec(latent), row_spec(q_pe.shape[2]), any_spec],
                out_specs=[row_spec(latent), row_spec(1)],
                scratch_shapes=[pltpu.VMEM((tile, width), kv_cache.dtype), pltpu.SemaphoreType.DMA((1,)),
                                *_scratch(num_heads, latent)]),
            out_shape=[jax.ShapeDtypeStruct(q_nope.shape, compute_dtype),
                       jax.ShapeDtypeStruct((num_tokens, num_heads, 1), jnp.float32)],
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
            interpret=interpret_params(interpret),
        )(token_seq, cu, lens, table, listed.reshape(-1), scale, listed[:, None, :], q_nope, q_pe, kv_cache)
        return out.astype(out_dtype), lse[..., 0]

    # the mean query length, within [8, 16]: 8 rows are a TPU block's least (a sublane tile)
    q_block = min(MAX_Q_BLOCK, max(8, 1 << max(0, -(-num_tokens // num_seqs) - 1).bit_length()))
    kv_pages = max(1, min(max(1, max_pages), KV_TILE // block_size))
    num_items = max(1, (num_tokens + num_seqs * (q_block - 1)) // q_block)  # >= sum of ceil(q_len / q_block)
    item_seq, item_q0, item_count, token_row, gather = schedule(cu, num_tokens, num_seqs, q_block, num_items)
    q_spec = lambda n: pl.BlockSpec((num_heads, q_block, n), lambda i, *_: (0, i, 0))  # noqa: E731
    head_major = lambda x: x[gather].transpose(1, 0, 2)  # noqa: E731  [H, items * q_block, n]
    out, lse = pl.pallas_call(
        functools.partial(_dense_kernel, q_block=q_block, kv_pages=kv_pages, **static),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6, grid=(num_items,),
            in_specs=[smem, q_spec(latent), q_spec(q_pe.shape[2]), any_spec],
            out_specs=[q_spec(latent), q_spec(1)],
            scratch_shapes=[pltpu.VMEM((kv_pages, block_size, width), kv_cache.dtype), pltpu.SemaphoreType.DMA((1,)),
                            *_scratch(num_heads * q_block, latent)]),
        out_shape=[jax.ShapeDtypeStruct((num_heads, num_items * q_block, latent), compute_dtype),
                   jax.ShapeDtypeStruct((num_heads, num_items * q_block, 1), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret_params(interpret),
    )(item_seq, item_q0, item_count, cu, lens, table, scale, head_major(q_nope), head_major(q_pe), kv_cache)
    return (out[:, token_row].transpose(1, 0, 2).astype(out_dtype),
            lse[:, token_row, 0].transpose(1, 0))


def _indexer_kernel(token_seq_ref, cu_ref, kv_lens_ref, table_ref, q_ref, w_ref, k_cache_ref, o_ref, buf, sem, *,
                    kv_pages, block_size, max_pages, num_blocks, dot_dtype):
    t = pl.program_id(0)
    s = token_seq_ref[t]
    seen_end = kv_lens_ref[s] - cu_ref[s + 1] + t + 1  # positions below it are visible
    kv_tile = kv_pages * block_size
    pages_needed = jax.lax.div(seen_end + block_size - 1, jnp.int32(block_size))
    q = q_ref[0].astype(dot_dtype)  # [Hi, Di]
    w = w_ref[0]  # [Hi, 1] float32
    o_ref[...] = jnp.full(o_ref.shape, -jnp.inf, jnp.float32)

    def body(tile, carry):
        _copy_pages(tile, pages_needed, s, table_ref, k_cache_ref, buf, sem, max_pages, num_blocks)
        start = tile * kv_tile
        position = start + jax.lax.broadcasted_iota(jnp.int32, (kv_tile, 1), 0)
        keys = jnp.where(position < seen_end, buf[...].reshape(kv_tile, -1).astype(jnp.float32), 0.0)
        dots = jax.lax.dot_general(q, keys.astype(dot_dtype), (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)  # [Hi, kv_tile]
        terms = jnp.maximum(dots, 0.0) * w  # relu keeps NaN
        # positive and negative weights' terms summed apart: an overflow is +inf or -inf whatever
        # the fusing of the sum, and both ways NaN (see indexer_topk)
        scores = (jnp.sum(jnp.where(w < 0, 0.0, terms), axis=0, keepdims=True)
                  + jnp.sum(jnp.where(w < 0, terms, 0.0), axis=0, keepdims=True))
        visible = start + jax.lax.broadcasted_iota(jnp.int32, (1, kv_tile), 1) < seen_end
        o_ref[0, :, pl.ds(start, kv_tile)] = jnp.where(visible & ~jnp.isnan(scores), scores, -jnp.inf)
        return carry

    jax.lax.fori_loop(jnp.int32(0), jax.lax.div(seen_end + kv_tile - 1, jnp.int32(kv_tile)), body, 0)


@functools.partial(jax.jit, static_argnames=("interpret",))
def indexer_scores(q, k_cache, weights, cu_q_lens, kv_lens, block_table, *, interpret=None):
    """Each token's lightning-indexer scores, float32 ``[T, positions]`` (positions: the block
    table's reach, rounded up to whole tiles): ``sum_h weights[t, h] * relu(q[t, h] . k[s])`` for
    the positions it sees, ``-inf`` for the others and for NaN scores. A grid step per token
    copies the pages it sees into VMEM ``kv_pages`` at a time."""
    num_tokens, num_heads, head_size = q.shape
    num_blocks, block_size, _ = k_cache.shape
    num_seqs, max_pages = block_table.shape
    kv_pages = max(1, min(max(1, max_pages), KV_TILE // block_size))
    width = round_up(max(1, max_pages) * block_size, kv_pages * block_size)
    cu, lens = cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32)
    token_seq = _token_sequences(cu, num_tokens)
    table = jnp.pad(block_table.astype(jnp.int32).reshape(-1), (0, 1 if max_pages == 0 else 0))
    compute_dtype = jnp.float32 if q.dtype == jnp.float16 else q.dtype  # as the attention computes it
    return pl.pallas_call(
        functools.partial(_indexer_kernel, kv_pages=kv_pages, block_size=block_size, max_pages=max(1, max_pages),
                          num_blocks=num_blocks,
                          dot_dtype=jnp.bfloat16 if q.dtype == jnp.bfloat16 else jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(num_tokens,),
            in_specs=[pl.BlockSpec((1, num_heads, head_size), lambda t, *_: (t, 0, 0)),
                      pl.BlockSpec((1, num_heads, 1), lambda t, *_: (t, 0, 0)), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((1, 1, width), lambda t, *_: (t, 0, 0)),
            scratch_shapes=[pltpu.VMEM((kv_pages, block_size, head_size), k_cache.dtype),
                            pltpu.SemaphoreType.DMA((1,))]),
        out_shape=jax.ShapeDtypeStruct((num_tokens, 1, width), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret_params(interpret),
    )(token_seq, cu, lens, table, q.astype(compute_dtype), weights.astype(jnp.float32)[..., None],
      k_cache)[:, 0]


def _seen_end(cu_q_lens, kv_lens, num_tokens):
    """Per token, one past the last position it sees."""
    cu, lens = cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32)
    seq = _token_sequences(cu, num_tokens)
    return lens[seq] - cu[seq + 1] + jnp.arange(num_tokens, dtype=jnp.int32) + 1


@functools.partial(jax.jit, static_argnames=("top_k",))
def _select(scores, cu_q_lens, kv_lens, top_k: int):
    padded = jnp.pad(scores, ((0, 0), (0, max(0, top_k - scores.shape[1]))), constant_values=-jnp.inf)
    _, order = jax.lax.top_k(padded, top_k)
    # the visible positions are 0 .. seen_end - 1 and unseen ones score -inf, so every visible
    # position (a NaN's -inf included) precedes them: what is left past them is -1
    return jnp.where(order < _seen_end(cu_q_lens, kv_lens, scores.shape[0])[:, None], order, -1).astype(jnp.int32)


def indexer_topk(q, k_cache, weights, cu_q_lens, kv_lens, block_table, top_k: int, *, interpret=None):
    """DeepSeek-V3.2's lightning indexer and its top-k: int32 ``[T, top_k]``, each token's best
    visible positions by :func:`indexer_scores`, best first, equal scores lower position first
    (``lax.top_k``'s order), NaN as -inf, then -1. The scores are written out (``[T, positions]``
    float32): TPUs have no sort inside a kernel to keep a running top-k with."""
    scores = indexer_scores(q, k_cache, weights, cu_q_lens, kv_lens, block_table, interpret=interpret)
    return _select(scores, cu_q_lens, kv_lens, top_k)  # apart: a new top_k does not rebuild the kernel

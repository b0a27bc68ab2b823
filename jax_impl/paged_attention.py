"""Ragged paged attention with a fused KV-cache write, as Pallas TPU kernels.

Caches are vLLM's flash layout ``[num_blocks, block_size, Hkv, D]``; slot ``= block * block_size
+ offset``. Sequence ``s`` owns query rows ``cu_q_lens[s]:cu_q_lens[s+1]``, its last positions of
``kv_lens[s]``, and reads page ``j`` from ``block_table[s, j]``.

The attention kernel's grid is (query block, kv-head block). Queries are regrouped outside the
kernel into blocks of ``q_block`` tokens that never straddle two sequences, laid out
``[Hkv, G, blocks * q_block, D]``, so a grid step holds, for each kv head of its block, the ``G``
query heads that share it as one ``[G * q_block, D]`` matrix (row ``g * q_block + t``). The step
walks the kv tiles its rows can see (causal, windowed; a tile is ``kv_pages`` pages): each page's
``[block_size, heads, D]`` is copied from HBM (contiguous: the flash layout keeps a token's heads
together) into a VMEM double buffer, the next tile's copies starting before the current tile is
computed; each kv head then reads its rows out of the buffer. An online softmax keeps its max,
sum and accumulator in f32 VMEM. Quantized entries are cast to the dot dtype in VMEM; ``k_scale``
folds into the logits' scale and ``v_scale`` into the final normalization.

The fused write: at the first grid step the kernel copies each new token's quantized
``[Hkv, D]`` row into its slot (HBM to HBM) and waits, before any page is read; the grid is then
sequential ("arbitrary") so no core reads ahead of the write. The caches are aliased
input-to-output, so on TPU the write is in place (when the caller donates them, or inside a
jitted step that threads the cache through).

Every number matches ``torch_kernels.reference.paged_attention``: storing divides by the scale
and rounds (int8 half to even then saturate; fp8 saturates to its largest finite value); logits,
softmax and accumulation are float32, the dots in bfloat16 for bfloat16 queries.

NaN and inf follow the reference's policy: entries a query does not see never reach its output;
a NaN or inf in its query or in an entry it sees makes its row NaN; stores keep NaN (int8: 0).
A grid step walks its kv tiles once with no per-tile check; a NaN or inf entry among them leaves
its sums non-finite, and only then does it walk them again exactly, zeroing those entries and
flagging, by a matmul of the visibility mask with the non-finite pattern, the rows that see one.
Queries holding one are zeroed before the kernel and their rows set to NaN after it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import interpret_params

QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)
# default kv tile: about this many bytes of one cache per buffer slot (4 of them live in VMEM),
# and at most this many keys (a step's logits are [G * q_block, keys] float32)
KV_TILE_BYTES = 1 << 20
MAX_KV_TILE = 512
MAX_Q_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes; 0 picks the heuristic default.

    q_block: query tokens per grid step, a power of two >= 8 (a step holds ``q_block * G`` rows
        per kv head). The default is the batch's mean query length, rounded up, within [8, 64].
    kv_pages: pages per kv tile (one double-buffer slot). The default makes a slot about
        ``KV_TILE_BYTES`` of one cache, with at most ``MAX_KV_TILE`` keys.
    kv_heads_per_block: kv heads per grid step, a divisor of Hkv. The default is all of them
        (each page is then copied once per query block) unless Hkv is a larger multiple of the
        cache dtype's sublane tile, which it then is (so head slices stay tile-aligned in HBM).
    """

    q_block: int = 0
    kv_pages: int = 0
    kv_heads_per_block: int = 0


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _resolve_config(config: Config | None, num_tokens, num_seqs, block_size, max_pages, num_kv_heads,
                    head_size, query_dtype, cache_dtype) -> Config:
    config = config or Config()
    q_block = config.q_block
    if not q_block:
        minimum = 16 if jnp.dtype(query_dtype).itemsize == 2 else 8  # one sublane tile of the dtype
        q_block = min(MAX_Q_BLOCK, max(minimum, _next_power_of_two(-(-num_tokens // max(1, num_seqs)))))
    if q_block < 8 or q_block & (q_block - 1):
        raise ValueError(f"config.q_block: expected a power of two >= 8, got {q_block}")
    heads = config.kv_heads_per_block
    if not heads:
        tile = 32 // jnp.dtype(cache_dtype).itemsize  # sublanes of one (8, 128) 32-bit tile
        heads = tile if num_kv_heads > tile and num_kv_heads % tile == 0 else num_kv_heads
    if num_kv_heads % heads:
        raise ValueError(f"config.kv_heads_per_block: expected a divisor of {num_kv_heads}, got {heads}")
    page_bytes = block_size * heads * head_size * jnp.dtype(cache_dtype).itemsize
    kv_pages = config.kv_pages or max(1, min(max_pages, KV_TILE_BYTES // page_bytes, MAX_KV_TILE // block_size))
    return Config(q_block=q_block, kv_pages=kv_pages, kv_heads_per_block=heads)


def quantize(x, scale, dtype):
    """``x [..., Hkv, D] / scale [Hkv]`` rounded to cache dtype ``dtype`` as the reference does."""
    y = x.astype(jnp.float32) / scale.astype(jnp.float32)[:, None]
    dtype = jnp.dtype(dtype)
    if dtype == jnp.int8:
        y = jnp.where(jnp.isnan(y), 0.0, y)  # int8 has no NaN: 0, not whatever a device's cast gives
        y = jnp.clip(jnp.round(y), -128, 127)  # jnp.round is half to even
    elif dtype in QUANTIZED_DTYPES:  # the float8 ones
        largest = float(jnp.finfo(dtype).max)
        y = jnp.clip(y, -largest, largest)
    return y.astype(dtype)


def _scales(scale, num_kv_heads):
    if scale is None:
        return jnp.ones((num_kv_heads,), jnp.float32)
    return jnp.broadcast_to(jnp.ravel(scale).astype(jnp.float32), (num_kv_heads,))


def _write_slots(slot_mapping, num_blocks, block_size):
    """Per token: its (block, offset), or (-1, 0) for a padding token (or a slot outside the cache)."""
    slots = slot_mapping.astype(jnp.int32)
    real = (slots >= 0) & (slots < num_blocks * block_size)
    return jnp.where(real, slots // block_size, -1), jnp.where(real, slots % block_size, 0)


def _div(a, b: int):
    """``a // b`` for non-negative int32 scalars (jnp's floor division lowers through ``sign``,
    whose TPU lowering needs a TPU at hand)."""
    return jax.lax.div(a, jnp.int32(b))


def _write_new_tokens(write_block_ref, write_offset_ref, new_k_ref, new_v_ref, k_cache_ref, v_cache_ref,
                      sem_ref, num_tokens):
    """Copy each real token's [Hkv, D] rows into its slot, HBM to HBM, and wait for all of them."""

    def copies(t):
        block, offset = write_block_ref[t], write_offset_ref[t]
        return (pltpu.make_async_copy(new_k_ref.at[t], k_cache_ref.at[block, offset], sem_ref.at[0]),
                pltpu.make_async_copy(new_v_ref.at[t], v_cache_ref.at[block, offset], sem_ref.at[1]))

    def start(t, carry):
        @pl.when(write_block_ref[t] >= 0)
        def _():
            for c in copies(t):
                c.start()

        return carry

    def wait(t, carry):
        @pl.when(write_block_ref[t] >= 0)
        def _():
            for c in copies(t):
                c.wait()

        return carry

    # all copies in flight at once; each wait consumes one copy's bytes (all are the same size)
    jax.lax.fori_loop(jnp.int32(0), jnp.int32(num_tokens), start, 0)
    jax.lax.fori_loop(jnp.int32(0), jnp.int32(num_tokens), wait, 0)


def _write_kernel(write_block_ref, write_offset_ref, new_k_ref, new_v_ref, k_in_ref, v_in_ref,
                  k_cache_ref, v_cache_ref, sem_ref, *, num_tokens):
    del k_in_ref, v_in_ref  # aliased to k_cache_ref / v_cache_ref
    _write_new_tokens(write_block_ref, write_offset_ref, new_k_ref, new_v_ref, k_cache_ref, v_cache_ref,
                      sem_ref, num_tokens)


def _write_call(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, interpret):
    """pallas_call of the standalone write; returns the updated caches."""
    num_tokens, num_kv_heads = key.shape[0], key_cache.shape[2]
    write_block, write_offset = _write_slots(slot_mapping, *key_cache.shape[:2])
    new_k = quantize(key, _scales(k_scale, num_kv_heads), key_cache.dtype)
    new_v = quantize(value, _scales(v_scale, num_kv_heads), value_cache.dtype)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_write_kernel, num_tokens=num_tokens),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(1,),
            in_specs=[any_spec] * 4,
            out_specs=[any_spec] * 2,
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=[jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype),
                   jax.ShapeDtypeStruct(value_cache.shape, value_cache.dtype)],
        # operands: write_block, write_offset, new_k, new_v, key_cache, value_cache
        input_output_aliases={4: 0, 5: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret_params(interpret),
    )(write_block, write_offset, new_k, new_v, key_cache, value_cache)


@functools.partial(jax.jit, static_argnames=("interpret",))
def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None, *,
                      interpret=None):
    """Write ``quantize(key[t])`` / ``quantize(value[t])`` to slot ``slot_mapping[t]`` of the caches.

    key, value ``[T, Hkv, D]``; caches ``[num_blocks, block_size, Hkv, D]`` (float or int8 / fp8);
    slot_mapping ``[T]`` int, ``-1`` skips a token; k_scale, v_scale float32 ``[Hkv]`` (or one
    value, or None for 1). Returns ``(new_key_cache, new_value_cache)``; every entry outside the
    written slots keeps its bytes. The caches are aliased to the outputs: donate them to update
    in place.
    """
    if key.shape[0] == 0:
        return key_cache, value_cache
    return _write_call(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale, interpret)


def _mask_non_finite(k, v, seen, bad_ref):
    """The exact pass's NaN policy for one kv head's tile: ``(k, v)`` with NaN and inf zeroed (a
    zero weight times NaN is NaN), and ``bad_ref`` raised for the rows that see one."""
    finite = jnp.isfinite(k.astype(jnp.float32)) & jnp.isfinite(v.astype(jnp.float32))  # Mosaic's is f32 only
    # per row and dimension, how many seen positions are non-finite there: a matmul keeps the key
    # axis where the logits have it (no transpose of a per-position vector)
    pattern = jnp.where(finite, 0.0, 1.0).astype(jnp.float32)
    hits = jnp.dot(seen.astype(jnp.float32), pattern, preferred_element_type=jnp.float32)
    bad_ref[...] = jnp.maximum(bad_ref[...], jnp.max(hits, axis=1, keepdims=True))
    return jnp.where(finite, k, jnp.zeros_like(k)), jnp.where(finite, v, jnp.zeros_like(v))


def _attention_kernel(*refs, fused, num_tokens, num_blocks, num_kv_heads, heads_per_block, group, q_block,
                      kv_pages, block_size, max_pages, sm_scale, sliding_window, soft_cap, dot_dtype,
                      may_hold_non_finite):
    (item_seq_ref, item_q0_ref, item_count_ref, cu_ref, kv_lens_ref, block_table_ref, *refs) = refs
    if fused:
        write_block_ref, write_offset_ref, *refs = refs
    scales_ref, q_ref, k_in_ref, v_in_ref, *refs = refs
    if fused:
        new_k_ref, new_v_ref, o_ref, k_cache_ref, v_cache_ref, *refs = refs
    else:
        o_ref, *refs = refs
        k_cache_ref, v_cache_ref = k_in_ref, v_in_ref
    k_buf, v_buf, sems, m_ref, l_ref, acc_ref, bad_ref, *refs = refs

    i, head_block = pl.program_id(0), pl.program_id(1)
    if fused:
        @pl.when((i == 0) & (head_block == 0))
        def _():
            _write_new_tokens(write_block_ref, write_offset_ref, new_k_ref, new_v_ref, k_cache_ref,
                              v_cache_ref, refs[0], num_tokens)

    h0 = head_block * heads_per_block
    rows, kv_tile = group * q_block, kv_pages * block_size
    s, q0, count = item_seq_ref[i], item_q0_ref[i], item_count_ref[i]
    kv_len = kv_lens_ref[s]
    first = kv_len - (cu_ref[s + 1] - cu_ref[s]) + q0  # position of the block's first query
    lo = jnp.int32(0) if sliding_window is None else jnp.maximum(first - sliding_window + 1, 0)
    tile_lo = _div(lo, kv_tile)
    tile_hi = jnp.where(count > 0, _div(first + count + kv_tile - 1, kv_tile), tile_lo)
    # the checked inputs never need the clamps (here and on block ids), but no input makes the
    # kernel read outside the table or the caches
    num_pages = jnp.minimum(_div(kv_len + block_size - 1, block_size), max_pages)

    def fetch(tile, slot, action):
        """Start (or wait for) the copies of one tile's pages into buffer slot ``slot``."""

        def page_copies(p, carry):
            page = tile * kv_pages + p

            # pages past the sequence's end are never copied: their table entries may be anything
            @pl.when(page < num_pages)
            def _():
                block = jnp.clip(block_table_ref[s * max_pages + page], 0, num_blocks - 1)
                for cache, buf, kind in ((k_cache_ref, k_buf, 0), (v_cache_ref, v_buf, 1)):
                    # a page's [block_size, Hkv, D] is contiguous in HBM: one copy for its heads
                    src = (cache.at[block] if heads_per_block == num_kv_heads
                           else cache.at[block, :, pl.ds(h0, heads_per_block), :])
                    copy = pltpu.make_async_copy(src, buf.at[slot, p], sems.at[kind, slot])
                    if action == "start":
                        copy.start()
                    else:
                        copy.wait()

            return carry

        jax.lax.fori_loop(jnp.int32(0), jnp.int32(kv_pages), page_copies, 0)

    row_t = jax.lax.broadcasted_iota(jnp.int32, (rows, kv_tile), 0) & (q_block - 1)  # rows are g-major
    q_pos = first + row_t
    row_real = row_t < count

    def body(tile, carry, exact):
        slot = jax.lax.rem(tile - tile_lo, jnp.int32(2))
        fetch(tile, slot, "wait")

        @pl.when(tile + 1 < tile_hi)
        def _():
            fetch(tile + 1, 1 - slot, "start")

        start = tile * kv_tile
        k_pos = start + jax.lax.broadcasted_iota(jnp.int32, (rows, kv_tile), 1)
        seen = (k_pos <= q_pos) & row_real
        if sliding_window is not None:
            seen &= k_pos > q_pos - sliding_window
        for j in range(heads_per_block):  # the G query heads of kv head h0 + j at once
            k = k_buf[slot, :, :, j, :].astype(dot_dtype).reshape(kv_tile, -1)
            v = v_buf[slot, :, :, j, :].astype(dot_dtype).reshape(kv_tile, -1)
            if exact:
                k, v = _mask_non_finite(k, v, seen, bad_ref.at[j])
            q = q_ref[j].reshape(rows, -1).astype(dot_dtype)
            logits = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            raw_logits = logits * (sm_scale * scales_ref[0, h0 + j])
            logits = raw_logits
            if soft_cap is not None:
                logits = soft_cap * jnp.tanh(logits / soft_cap)
            logits = jnp.where(seen, logits, -jnp.inf)

            m_prev = m_ref[j]
            m_new = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows that have seen nothing yet
            weights = jnp.exp(logits - m_safe)
            correction = jnp.exp(m_prev - m_safe)
            if not exact and may_hold_non_finite:  # a NaN or inf key's logit (before the cap) reaches l
                weights_sum = jnp.sum(weights + raw_logits * 0.0, axis=1, keepdims=True)
            else:
                weights_sum = jnp.sum(weights, axis=1, keepdims=True)
            l_ref[j] = l_ref[j] * correction + weights_sum
            acc_ref[j] = acc_ref[j] * correction + jnp.dot(
                weights.astype(dot_dtype), v, preferred_element_type=jnp.float32)
            m_ref[j] = m_new
        return carry

    def walk(exact):
        """The online softmax over the step's kv tiles, from fresh sums."""
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

        @pl.when(tile_lo < tile_hi)
        def _():
            fetch(tile_lo, 0, "start")

        jax.lax.fori_loop(tile_lo, tile_hi, functools.partial(body, exact=exact), 0)

    # The NaN policy in two passes: the first checks nothing per tile; a NaN or inf entry in the
    # step's tiles, seen or not, leaves every row's sums non-finite (a value's through P @ V, a
    # key's through its logit added times 0 to l). Only then does the exact pass run.
    bad_ref[...] = jnp.zeros_like(bad_ref)
    walk(exact=False)
    if may_hold_non_finite:
        real = jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) & (q_block - 1) < count
        leaked = jnp.float32(0.0)
        for j in range(heads_per_block):
            probe = l_ref[j] * 0.0 + jnp.sum(acc_ref[j] * 0.0, axis=1, keepdims=True)
            leaked = jnp.maximum(leaked, jnp.max(jnp.where(real & (probe != 0.0), 1.0, 0.0)))

        @pl.when(leaked > 0.0)
        def _():
            walk(exact=True)
    for j in range(heads_per_block):
        l = l_ref[j]
        out = acc_ref[j] * (scales_ref[1, h0 + j] / jnp.where(l > 0.0, l, 1.0))  # rows that see nothing: 0
        out = jnp.where(bad_ref[j] > 0.0, jnp.nan, out)
        o_ref[j] = out.reshape(o_ref.shape[1:]).astype(o_ref.dtype)


def schedule(cu_q_lens, num_tokens, num_seqs, q_block, num_items):
    """Query blocks of ``q_block`` tokens, none straddling two sequences: per block its sequence,
    first query index within the sequence and number of real queries; and, per token, its row in
    the blocked layout."""
    cu = cu_q_lens.astype(jnp.int32)
    q_lens = cu[1:] - cu[:-1]
    blocks = (q_lens + q_block - 1) // q_block
    ends = jnp.cumsum(blocks)
    starts = ends - blocks
    n = jnp.arange(num_items, dtype=jnp.int32)
    real = n < ends[-1]
    item_seq = jnp.minimum(jnp.searchsorted(ends, n, side="right"), num_seqs - 1).astype(jnp.int32)
    item_q0 = jnp.where(real, (n - starts[item_seq]) * q_block, 0)
    item_count = jnp.where(real, jnp.clip(q_lens[item_seq] - item_q0, 0, q_block), 0)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    token_seq = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), num_seqs - 1)
    local = t - cu[token_seq]
    token_row = (starts[token_seq] + local // q_block) * q_block + local % q_block
    gather = cu[item_seq][:, None] + item_q0[:, None] + jnp.arange(q_block, dtype=jnp.int32)
    return item_seq, item_q0, item_count.astype(jnp.int32), token_row, jnp.clip(gather.reshape(-1), 0, num_tokens - 1)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "config"))
def ragged_paged_attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                           sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, key=None,
                           value=None, slot_mapping=None, *, interpret=None, config=None):
    """Causal attention over a ragged batch whose keys and values live in pages, by Pallas.

    query ``[T, Hq, D]`` (float32, bfloat16, float16); caches ``[num_blocks, block_size, Hkv, D]``
    (query's dtype, int8, float8_e4m3fn or float8_e5m2; ``Hq = G * Hkv``); cu_q_lens ``[S+1]``,
    kv_lens ``[S]``, block_table ``[S, max_pages]`` ints; sm_scale, sliding_window, soft_cap
    static Python numbers (or None); k_scale, v_scale float32 ``[Hkv]`` (or one value, or None
    for 1). When key, value ``[T, Hkv, D]`` and slot_mapping ``[T]`` are given, the kernel first
    writes them into the caches as :func:`reshape_and_cache` does.

    Returns ``(out [T, Hq, D] in query's dtype, new_key_cache, new_value_cache)``; without
    new tokens the caches come back as given. Inputs are expected to be valid (the torch op checks
    them: lengths add up, the pages a sequence uses are in range, slots are unique); invalid ones
    give wrong numbers, never a read or write outside the arrays.
    """
    num_tokens, num_q_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs, max_pages = block_table.shape
    group = num_q_heads // num_kv_heads
    fused = key is not None
    if num_tokens == 0 or num_seqs == 0:
        if fused:
            key_cache, value_cache = reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale,
                                                       v_scale, interpret=interpret)
        return jnp.zeros(query.shape, query.dtype), key_cache, value_cache
    cfg = _resolve_config(config, num_tokens, num_seqs, block_size, max(1, max_pages), num_kv_heads, head_size,
                          query.dtype, key_cache.dtype)
    q_block, kv_pages, heads_per_block = cfg.q_block, cfg.kv_pages, cfg.kv_heads_per_block
    num_items = max(1, (num_tokens + num_seqs * (q_block - 1)) // q_block)  # >= sum of ceil(q_len / q_block)
    item_seq, item_q0, item_count, token_row, gather = schedule(cu_q_lens, num_tokens, num_seqs, q_block,
                                                                 num_items)

    # TPUs multiply float16 poorly or not at all: float16 queries are computed in float32
    compute_dtype = jnp.float32 if query.dtype == jnp.float16 else query.dtype
    dot_dtype = jnp.bfloat16 if query.dtype == jnp.bfloat16 else jnp.float32
    bad_query = ~jnp.all(jnp.isfinite(query), axis=-1, keepdims=True)  # [T, Hq, 1]: NaN rows, set after
    query = jnp.where(bad_query, jnp.zeros_like(query), query)
    q = query.astype(compute_dtype).reshape(num_tokens, num_kv_heads, group, head_size)[gather]
    q = q.transpose(1, 2, 0, 3)  # [Hkv, G, num_items * q_block, D]
    scales = jnp.stack([_scales(k_scale, num_kv_heads), _scales(v_scale, num_kv_heads)])
    # SMEM arrays must not be empty
    table = jnp.pad(block_table.astype(jnp.int32).reshape(-1), (0, 1 if max_pages == 0 else 0))
    prefetch = [item_seq, item_q0, item_count, cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32), table]
    q_spec = pl.BlockSpec((heads_per_block, group, q_block, head_size), lambda i, h, *_: (h, 0, i, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    in_specs = [pl.BlockSpec(memory_space=pltpu.SMEM), q_spec, any_spec, any_spec]
    operands = [scales, q, key_cache, value_cache]
    out_specs = [q_spec]
    out_shape = [jax.ShapeDtypeStruct(q.shape, compute_dtype)]
    scratch = [
        pltpu.VMEM((2, kv_pages, block_size, heads_per_block, head_size), key_cache.dtype),
        pltpu.VMEM((2, kv_pages, block_size, heads_per_block, head_size), value_cache.dtype),
        pltpu.SemaphoreType.DMA((2, 2)),
        pltpu.VMEM((heads_per_block, group * q_block, 1), jnp.float32),
        pltpu.VMEM((heads_per_block, group * q_block, 1), jnp.float32),
        pltpu.VMEM((heads_per_block, group * q_block, head_size), jnp.float32),
        pltpu.VMEM((heads_per_block, group * q_block, 1), jnp.float32),  # rows that saw NaN or inf
    ]
    aliases = {}
    if fused:
        write_block, write_offset = _write_slots(slot_mapping, num_blocks, block_size)
        prefetch += [write_block, write_offset]
        in_specs += [any_spec, any_spec]
        operands += [quantize(key, scales[0], key_cache.dtype), quantize(value, scales[1], value_cache.dtype)]
        out_specs += [any_spec, any_spec]
        out_shape += [jax.ShapeDtypeStruct(key_cache.shape, key_cache.dtype),
                      jax.ShapeDtypeStruct(value_cache.shape, value_cache.dtype)]
        scratch.append(pltpu.SemaphoreType.DMA((2,)))
        # operand indices count the scalar-prefetch arrays first
        aliases = {len(prefetch) + 2: 1, len(prefetch) + 3: 2}

    kernel = functools.partial(
        _attention_kernel, fused=fused, num_tokens=num_tokens, num_blocks=num_blocks, num_kv_heads=num_kv_heads,
        heads_per_block=heads_per_block, group=group, q_block=q_block, kv_pages=kv_pages,
        block_size=block_size, max_pages=max(1, max_pages), sm_scale=float(sm_scale),
        sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap), dot_dtype=dot_dtype,
        may_hold_non_finite=jnp.dtype(key_cache.dtype) != jnp.int8)
    results = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(num_items, num_kv_heads // heads_per_block),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        input_output_aliases=aliases,
        # the fused write happens at step (0, 0): no other core may run ahead of it
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary") if fused else ("parallel", "arbitrary"),
        ),
        interpret=interpret_params(interpret),
    )(*prefetch, *operands)
    out = results[0][:, :, token_row].transpose(2, 0, 1, 3).reshape(query.shape).astype(query.dtype)
    out = jnp.where(bad_query, jnp.nan, out)
    if fused:
        return out, results[1], results[2]
    return out, key_cache, value_cache


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_reference(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                                     sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, key=None,
                                     value=None, slot_mapping=None):
    """The definition in plain jnp (dense over each sequence's page table; jittable); same
    returns as :func:`ragged_paged_attention`."""
    num_tokens, num_q_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs, max_pages = block_table.shape
    k_scale, v_scale = _scales(k_scale, num_kv_heads), _scales(v_scale, num_kv_heads)
    if key is not None:
        key_cache, value_cache = reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping,
                                                             k_scale, v_scale)
    if num_tokens == 0 or num_seqs == 0:
        return jnp.zeros(query.shape, query.dtype), key_cache, value_cache
    group = num_q_heads // num_kv_heads
    cu, kv = cu_q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32)
    t = jnp.arange(num_tokens)
    seq = jnp.minimum(jnp.searchsorted(cu[1:], t, side="right"), num_seqs - 1)
    q_pos = kv[seq] - (cu[seq + 1] - t)  # [T]
    k_pos = jnp.arange(max_pages * block_size)
    used = k_pos[None, :] < kv[:, None]  # [S, max_kv]
    pages = jnp.where(used[:, ::block_size], block_table, 0)  # unused table entries may be anything
    k = key_cache[pages].reshape(num_seqs, -1, num_kv_heads, head_size).astype(jnp.float32)
    v = value_cache[pages].reshape(num_seqs, -1, num_kv_heads, head_size).astype(jnp.float32)
    # the NaN policy: positions holding a NaN or inf count as zero in the sums (a zero weight
    # times NaN is NaN), and the rows that see one (or whose query holds one) are NaN at the end
    bad_kv = ~(jnp.all(jnp.isfinite(k), axis=-1) & jnp.all(jnp.isfinite(v), axis=-1))  # [S, max_kv, Hkv]
    dropped = (bad_kv | ~used[:, :, None])[..., None]  # past kv_len: may hold anything
    k = jnp.where(dropped, 0.0, k) * k_scale[:, None]
    v = jnp.where(dropped, 0.0, v) * v_scale[:, None]
    q = query.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_size)
    bad_q = ~jnp.all(jnp.isfinite(q), axis=-1)  # [T, Hkv, G]
    q = jnp.where(bad_q[..., None], 0.0, q)
    logits = jnp.einsum("thgd,tkhd->thgk", q, k[seq], precision="highest") * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    seen = (k_pos[None, :] <= q_pos[:, None]) & used[seq]
    if sliding_window is not None:
        seen &= k_pos[None, :] > q_pos[:, None] - sliding_window
    weights = jax.nn.softmax(jnp.where(seen[:, None, None, :], logits, -jnp.inf), axis=-1)
    out = jnp.einsum("thgk,tkhd->thgd", weights, v[seq], precision="highest")
    sees_bad = jnp.any(seen[:, :, None] & bad_kv[seq], axis=1)  # [T, Hkv]
    out = jnp.where((bad_q | sees_bad[:, :, None])[..., None], jnp.nan, out)
    return out.reshape(query.shape).astype(query.dtype), key_cache, value_cache


@jax.jit
def reshape_and_cache_reference(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None):
    """The write in plain jnp (a scatter; padding tokens dropped); same returns as
    :func:`reshape_and_cache`."""
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    block, offset = _write_slots(slot_mapping, num_blocks, block_size)
    block = jnp.where(block >= 0, block, num_blocks)  # out of range: dropped by the scatter
    new_k = quantize(key, _scales(k_scale, num_kv_heads), key_cache.dtype)
    new_v = quantize(value, _scales(v_scale, num_kv_heads), value_cache.dtype)
    return (key_cache.at[block, offset].set(new_k, mode="drop"),
            value_cache.at[block, offset].set(new_v, mode="drop"))

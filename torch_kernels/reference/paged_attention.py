"""Ragged paged attention and the KV-cache write in plain PyTorch.

The kernel contract every backend follows (inputs already checked by ``torch_kernels.ops``):

- ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)``
  writes ``quantize(key[t], k_scale)`` to ``key_cache[slot // block_size, slot % block_size]``
  for every ``slot = slot_mapping[t] >= 0`` (and the same for values), in place, touching
  nothing else. Scales are float32 ``[Hkv]``.
- ``ragged_paged_attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table,
  sm_scale, sliding_window, soft_cap, k_scale, v_scale, key, value, slot_mapping)`` returns
  ``[T, Hq, D]`` in query's dtype; when ``key`` is not None it first writes ``key``/``value``
  as ``reshape_and_cache`` does (a backend may fuse the two).

Numbers: a cache entry means ``float32(entry) * scale[kv_head]``; storing divides by the scale
and rounds to the cache dtype (int8: round half to even and saturate; fp8: saturate to the
largest finite value). Logits, softmax and the weighted sum are float32.
Sequence ``s`` owns query rows ``cu_q_lens[s]:cu_q_lens[s+1]``, which are its last
``q_len`` positions of ``kv_lens[s]``; a query at position ``p`` sees key positions ``j`` with
``j <= p`` and, given a window ``w``, ``j > p - w``.

NaN and inf (every backend; ``ragged_paged_attention_naive`` states it in code):

1. Entries a query does not attend to are never read: key and value entries past its position
   (the causal diagonal inside a prefill chunk included), outside its window, past its
   sequence's kv_len or on pages past its last one cannot change its output, whatever they
   hold; it equals the output with those entries set to zero.
2. If the query row of head ``h``, or any element of the key or value entry of kv head
   ``h // G`` at a position the query attends to, is NaN or +-inf, the query's output row for
   head ``h`` is NaN: all ``D`` elements, never +-inf or a finite number. No other row changes.
   A new token written by the same call counts as the entry it is stored as (rule 3). Overflow
   of finite numbers (a logit past the float32 range) is outside this rule.
3. Writes store ``key / scale`` computed in float32 and rounded to the cache dtype: NaN stays NaN
   in float16, bfloat16, float32 and fp8 caches and is stored as 0 in int8 ones (int8 has no
   NaN); +-inf and values past the range saturate to the largest finite value in fp8 (+-448
   e4m3fn, +-57344 e5m2) and int8 (127, -128) caches; float caches round as their dtype does
   (overflow is +-inf). The same on every device (no float -> int cast of NaN is relied on).

``ragged_paged_attention_naive`` is the definition, written for reading (a loop over sequences).
``ragged_paged_attention`` is the reference backend's kernel and the CPU default: flash-style
tiles over padded sequences, with no Python loop over tokens or pages.
"""

from __future__ import annotations

import torch

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)

# Elements of one logits tile [S, Hq, q_tile, kv_tile] (4 MB of float32), and its most query rows:
# tiles that stay in the CPU's caches run several times faster than larger ones.
_TILE_ELEMENTS = 1 << 20
_MAX_Q_TILE = 256


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [..., Hkv, D] / scale [Hkv]`` rounded to cache dtype ``dtype``."""
    y = x.float() / scale[:, None]
    if dtype == torch.int8:
        # int8 has no NaN, and a float -> int cast of NaN differs by device: 0, explicitly
        y = y.masked_fill(y.isnan(), 0.0).round().clamp(-128, 127)
    elif dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        largest = torch.finfo(dtype).max
        y = y.clamp(-largest, largest)
    return y.to(dtype)


def dequantize(entries: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of cache entries ``[..., Hkv, D]`` with per-kv-head ``scale [Hkv]``."""
    return entries.float() * scale[:, None]


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    """Write each token's key and value to its slot; slot -1 (padding) is skipped."""
    real = slot_mapping >= 0
    slots = slot_mapping[real]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, offsets] = quantize(key[real], k_scale, key_cache.dtype)
    value_cache[blocks, offsets] = quantize(value[real], v_scale, value_cache.dtype)


def _write_new_tokens(key_cache, value_cache, key, value, slot_mapping, k_scale, v_scale) -> None:
    if key is not None:
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Which key positions each query position sees: causal, within the window."""
    seen = k_pos <= q_pos
    if sliding_window is not None:
        seen &= k_pos > q_pos - sliding_window
    return seen


def _capped(logits: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    return logits if soft_cap is None else soft_cap * torch.tanh(logits / soft_cap)


def _non_finite_rows(x: torch.Tensor) -> torch.Tensor:
    """Which rows (last dimension) of ``x`` hold a NaN or an inf."""
    return ~torch.isfinite(x).all(dim=-1)


def ragged_paged_attention_naive(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table,
                                 sm_scale, sliding_window=None, soft_cap=None, k_scale=None,
                                 v_scale=None, key=None, value=None, slot_mapping=None):
    """The definition: for each sequence, gather its pages, attend causally, one at a time."""
    num_kv_heads = key_cache.shape[2]
    k_scale = torch.ones(num_kv_heads) if k_scale is None else k_scale.float().expand(num_kv_heads)
    v_scale = torch.ones(num_kv_heads) if v_scale is None else v_scale.float().expand(num_kv_heads)
    _write_new_tokens(key_cache, value_cache, key, value, slot_mapping, k_scale, v_scale)
    block_size = key_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float32)
    for s in range(len(kv_lens)):
        start, end, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        if start == end:
            continue
        pages = block_table[s, : -(-kv_len // block_size)].long()
        k = key_cache[pages].flatten(0, 1)[:kv_len].float()  # [kv_len, Hkv, D]
        v = value_cache[pages].flatten(0, 1)[:kv_len].float()
        q = query[start:end].float()  # [q_len, Hq, D]
        # the NaN policy: non-finite entries count as zero in the sums (a zero weight times NaN
        # would be NaN), and the rows that see one are NaN at the end
        bad_kv = _non_finite_rows(k) | _non_finite_rows(v)  # [kv_len, Hkv]
        bad_q = _non_finite_rows(q)  # [q_len, Hq]
        k = dequantize(k.masked_fill(bad_kv[..., None], 0.0), k_scale).repeat_interleave(group, dim=1)
        v = dequantize(v.masked_fill(bad_kv[..., None], 0.0), v_scale).repeat_interleave(group, dim=1)
        q = q.masked_fill(bad_q[..., None], 0.0)
        logits = _capped(torch.einsum("qhd,khd->hqk", q, k) * sm_scale, soft_cap)
        q_pos = torch.arange(kv_len - (end - start), kv_len)[:, None]
        seen = _visible(q_pos, torch.arange(kv_len)[None, :], sliding_window)  # [q_len, kv_len]
        weights = logits.masked_fill(~seen, float("-inf")).softmax(dim=-1)
        rows = torch.einsum("hqk,khd->qhd", weights, v)
        sees_bad = (seen[:, None, :] & bad_kv.repeat_interleave(group, dim=1).T[None]).any(dim=-1)  # [q_len, Hq]
        out[start:end] = rows.masked_fill((sees_bad | bad_q)[..., None], float("nan"))
    return out.to(query.dtype)


def ragged_paged_attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                           sliding_window, soft_cap, k_scale, v_scale, key, value, slot_mapping):
    """The reference backend's kernel: sequences bucketed by query length (1, 2, 3-4, 5-8, ...),
    each bucket padded to its longest and attended by :func:`_attend_padded`, so a mixed batch
    pads its decodes to one row, not to the longest prefill chunk."""
    _write_new_tokens(key_cache, value_cache, key, value, slot_mapping, k_scale, v_scale)
    args = (key_cache, value_cache, sm_scale, sliding_window, soft_cap, k_scale, v_scale)
    cu = cu_q_lens.long()
    q_lens = cu[1:] - cu[:-1]
    buckets: dict[int, list[int]] = {}
    for s, n in enumerate(q_lens.tolist()):
        if n > 0:
            buckets.setdefault((n - 1).bit_length(), []).append(s)
    if len(buckets) == 1 and len(next(iter(buckets.values()))) == len(q_lens):
        return _attend_padded(query, cu_q_lens, kv_lens, block_table, *args)
    out = torch.zeros_like(query)  # idle sequences (no query rows) are left out: padding them costs
    for seqs in buckets.values():
        seqs = torch.tensor(seqs, device=query.device)
        lens = q_lens[seqs]
        sub_cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        # token rows of these sequences, in order: each sequence's start plus its row offsets
        rows = cu[seqs].repeat_interleave(lens) + torch.arange(int(sub_cu[-1]), device=query.device) \
            - sub_cu[:-1].repeat_interleave(lens)
        out[rows] = _attend_padded(query[rows], sub_cu, kv_lens[seqs], block_table[seqs], *args)
    return out


def _may_hold_non_finite(k: torch.Tensor, v: torch.Tensor) -> bool:
    """False only if every entry of ``k`` and ``v`` is finite. On CPU a sum tells (a NaN or inf
    makes it non-finite; an overflow of finite ones only costs the masking); elsewhere always
    True, which spares a device sync per tile."""
    if k.device.type != "cpu":
        return True
    return not bool(torch.isfinite(k.sum() + v.sum()))


def _attend_padded(query, cu_q_lens, kv_lens, block_table, key_cache, value_cache, sm_scale, sliding_window,
                   soft_cap, k_scale, v_scale):
    """Online softmax over tiles of sequences padded to the longest query length.

    Keys and values are gathered a tile of pages at a time, all kv heads at once; then each kv
    head's keys multiply all its query heads' rows (``max_q_len * group``) in one batched matmul
    over sequences, on strided views of the tile (a loop over kv heads, not tokens or pages:
    permuting the tile to head-major costs more than the matmuls). The scales multiply the
    logits and the output, not the tile. Tiles that no query of the batch can see (above the
    diagonal, or outside every window) are skipped. A tile whose sum is not finite (rare: NaN
    garbage past kv_len, a poisoned entry) gets the NaN policy's masking; the others skip it.
    """
    t, num_q_heads, head_size = query.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    group = num_q_heads // num_kv_heads
    num_seqs = kv_lens.shape[0]
    if t == 0 or num_seqs == 0:
        return query.new_zeros(query.shape)
    device = query.device
    cu = cu_q_lens.long()
    q_lens, kv = cu[1:] - cu[:-1], kv_lens.long()
    max_q, max_kv = int(q_lens.max()), int(kv.max())

    # padded query layout: [S, Hkv, max_q, group, D]; row r of sequence s is token cu[s] + r
    rows = torch.arange(max_q, device=device)
    token = cu[:-1, None] + rows
    real_row = rows < q_lens[:, None]
    q = query[token.clamp(max=t - 1)].float().view(num_seqs, max_q, num_kv_heads, group, head_size)
    q = q.permute(0, 2, 1, 3, 4).contiguous()
    bad_q = _non_finite_rows(q)  # [S, Hkv, max_q, group]: rows that end as NaN
    q.masked_fill_(bad_q[..., None], 0.0)
    q_pos = (kv - q_lens)[:, None] + rows  # [S, max_q]
    logit_scale = k_scale.float() * sm_scale  # [Hkv]

    # square-ish tiles: causal prefill skips the tiles above the diagonal
    q_tile = min(max_q, _MAX_Q_TILE)
    kv_tile = max(block_size, min(-(-max_kv // block_size) * block_size,
                                  _TILE_ELEMENTS // (num_seqs * num_q_heads * q_tile) // block_size * block_size))
    pages_per_tile = kv_tile // block_size
    out = torch.empty(num_seqs, num_kv_heads, max_q, group, head_size, device=device)
    for q0 in range(0, max_q, q_tile):
        q1 = min(max_q, q0 + q_tile)
        rows_shape = (num_seqs, num_kv_heads, q1 - q0, group)
        qt, pos = q[:, :, q0:q1].flatten(2, 3), q_pos[:, q0:q1]  # [S, Hkv, rows, D]
        row_max = torch.full(rows_shape, float("-inf"), device=device)
        row_sum = torch.zeros(rows_shape, device=device)
        acc = torch.zeros(*rows_shape, head_size, device=device)
        poisoned = bad_q[:, :, q0:q1].clone()  # rows that saw a non-finite entry (or query)
        # keys this query tile may see: up to its last position, from its first window start
        hi = int((pos.masked_fill(~real_row[:, q0:q1], -1).max(dim=1).values + 1).clamp(min=0).max())
        lo = 0 if sliding_window is None else max(0, int((pos[:, 0] - sliding_window + 1).min()))
        for k0 in range(lo // kv_tile * kv_tile, hi, kv_tile):
            page = torch.arange(k0 // block_size, k0 // block_size + pages_per_tile, device=device)
            used = page[None, :] * block_size < kv[:, None]  # pages past kv_len may hold any id
            ids = torch.where(used, block_table[:, page.clamp(max=block_table.shape[1] - 1)].long(), 0)
            k_pos = k0 + torch.arange(kv_tile, device=device)
            stored = k_pos < kv[:, None]  # slots past kv_len (or filler pages) may hold anything, NaN too
            tile_shape = (num_seqs, kv_tile, num_kv_heads, head_size)
            k = key_cache.index_select(0, ids.flatten()).view(tile_shape).float()  # a copy (faster than [ids])
            v = value_cache.index_select(0, ids.flatten()).view(tile_shape).float()
            hidden = ~(_visible(pos[:, :, None], k_pos, sliding_window) & stored[:, None, :])[:, :, None]
            bad = None
            if _may_hold_non_finite(k, v):
                bad = _non_finite_rows(k) | _non_finite_rows(v)  # [S, kv_tile, Hkv]
                # zeroed: a zero weight times NaN would still be NaN; the rows that see one are flagged
                k.masked_fill_(bad[..., None], 0.0)
                v.masked_fill_(bad[..., None], 0.0)
            for h in range(num_kv_heads):
                if bad is not None:
                    poisoned[:, h] |= (~hidden & bad[:, None, None, :, h]).any(dim=-1)
                logits = (qt[:, h] @ k[:, :, h].transpose(-1, -2)).view(num_seqs, q1 - q0, group, kv_tile)
                logits = _capped(logits * logit_scale[h], soft_cap).masked_fill_(hidden, float("-inf"))
                new_max = torch.maximum(row_max[:, h], logits.amax(dim=-1))
                safe_max = new_max.masked_fill(new_max == float("-inf"), 0.0)  # rows that see nothing yet
                weights = torch.exp(logits.sub_(safe_max[..., None]))
                correction = torch.exp(row_max[:, h] - safe_max)
                row_sum[:, h] = row_sum[:, h] * correction + weights.sum(dim=-1)
                pv = weights.view(num_seqs, -1, kv_tile) @ v[:, :, h]
                acc[:, h] = acc[:, h] * correction[..., None] + pv.view(num_seqs, q1 - q0, group, head_size)
                row_max[:, h] = new_max
        out[:, :, q0:q1] = (acc / row_sum.clamp(min=torch.finfo(torch.float32).tiny)[..., None]).masked_fill_(
            poisoned[..., None], float("nan"))
    out *= v_scale.float().view(1, num_kv_heads, 1, 1, 1)
    # back to token-major rows, keeping only the real ones
    out = out.permute(0, 2, 1, 3, 4).reshape(num_seqs, max_q, num_q_heads, head_size)
    return out[real_row].to(query.dtype)

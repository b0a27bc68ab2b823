"""Ragged paged attention and the KV-cache write in plain PyTorch.

The kernel contract every backend follows (inputs already checked by ``torch_kernels.ops``;
caches are ``[num_blocks, block_size, Hkv, D]`` views with any strides whose last is 1 and whose
entries do not share memory, read and written in place, never copied into a new tensor):

- ``reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)``
  writes ``quantize(key[t], k_scale)`` to ``key_cache[slot // block_size, slot % block_size]``
  for every ``slot = slot_mapping[t] >= 0`` (and the same for values), in place, touching
  nothing else. Scales are float32 ``[Hkv]``.
- ``ragged_paged_attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table,
  sm_scale, sliding_window, soft_cap, k_scale, v_scale, key, value, slot_mapping)`` returns
  ``[T, Hq, D]`` in query's dtype; when ``key`` is not None it first writes ``key``/``value``
  as ``reshape_and_cache`` does (a backend may fuse the two). Keyword ``bad_rows``, where given
  (bool ``[T]``, the deferred checks' verdict on a bad sequence's rows), makes those rows' output
  NaN (:func:`nan_rows`); every row then belongs to some sequence.

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
``ragged_paged_attention`` is the reference backend's kernel and the CPU default: each group of
similar sequences gathers its pages once and multiplies them, all heads together, in batched
matmuls, with no Python loop over tokens, pages or heads; the NaN policy costs it a check of two
sums per group unless a NaN or inf is there.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

from .._checks import entries_apart
from .._memo import LastBatch

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)

# The CPU default's tiles: query rows per unit (64 ran fastest), and budgets in float32 elements
# of one group's gathered keys (one of K and V: 16 MB) and of its logits, all heads (16 MB).
_MAX_Q_TILE = 64
_KEY_TILE_ELEMENTS = 1 << 22
_LOGIT_TILE_ELEMENTS = 1 << 22
# A group of units closes before padding them to its widest would waste this share of its work.
_GROUP_WASTE = 0.25


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
    if not real.all():
        slot_mapping, key, value = slot_mapping[real], key[real], value[real]
    block_size = key_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, offsets] = _stored(key, k_scale, key_cache.dtype)
    value_cache[blocks, offsets] = _stored(value, v_scale, value_cache.dtype)


def _stored(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``quantize(x, scale, dtype)``; ``x`` itself when that is exact: a float cache of x's dtype
    and scales of 1 (a float16, bfloat16 or float32 value is exact in float32, and so is / 1)."""
    if dtype == x.dtype and bool((scale == 1).all()):
        return x
    return quantize(x, scale, dtype)


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
    num_kv_heads, device = key_cache.shape[2], query.device
    k_scale = torch.ones(num_kv_heads, device=device) if k_scale is None else k_scale.float().expand(num_kv_heads)
    v_scale = torch.ones(num_kv_heads, device=device) if v_scale is None else v_scale.float().expand(num_kv_heads)
    _write_new_tokens(key_cache, value_cache, key, value, slot_mapping, k_scale, v_scale)
    block_size = key_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float32, device=device)
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
        q_pos = torch.arange(kv_len - (end - start), kv_len, device=device)[:, None]
        seen = _visible(q_pos, torch.arange(kv_len, device=device)[None, :], sliding_window)  # [q_len, kv_len]
        weights = logits.masked_fill(~seen, float("-inf")).softmax(dim=-1)
        rows = torch.einsum("hqk,khd->qhd", weights, v)
        sees_bad = (seen[:, None, :] & bad_kv.repeat_interleave(group, dim=1).T[None]).any(dim=-1)  # [q_len, Hq]
        out[start:end] = rows.masked_fill((sees_bad | bad_q)[..., None], float("nan"))
    return out.to(query.dtype)


def nan_rows(out: torch.Tensor, bad_rows: torch.Tensor | None) -> torch.Tensor:
    """``out`` with the rows ``bad_rows`` marks (the deferred checks' verdict) set to NaN, or to -1
    in an index output, in place; unchanged for None."""
    if bad_rows is not None:
        out.masked_fill_(bad_rows.reshape(-1, *([1] * (out.dim() - 1))), torch.nan if out.is_floating_point() else -1)
    return out


def ragged_paged_attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                           sliding_window, soft_cap, k_scale, v_scale, key, value, slot_mapping, out=None,
                           bad_rows=None):
    """The reference backend's kernel and the CPU default.

    Each sequence's query rows are cut into units of at most ``_MAX_Q_TILE`` rows; a unit reads
    the pages holding the keys its rows may see (from its first row's window start to its last
    row's position). Units of similar size form a group (:func:`_plan`), attended together by
    :func:`_attend_group`: their pages gathered once, padded to the group's largest, and every kv
    head's keys multiplied with its query heads' rows in one batched matmul. The lengths are
    read on the host once; the plan is kept for the next call with the same batch (a model's
    layers share it).
    """
    _write_new_tokens(key_cache, value_cache, key, value, slot_mapping, k_scale, v_scale)
    if out is None:  # else a contiguous tensor of query's shape and dtype, written in place
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if query.shape[0] == 0:
        return out
    scales = _multipliers(float(sm_scale), k_scale, v_scale)
    caches = (key_cache, value_cache, _paired(key_cache, value_cache))
    for group in _plan(query, key_cache, cu_q_lens, kv_lens, block_table, sliding_window):
        _attend_group(out, query, caches, group, scales, soft_cap)
    return nan_rows(out, bad_rows)


def _multipliers(sm_scale: float, k_scale, v_scale) -> tuple:
    """What scales the float32 queries (``sm_scale * k_scale``) and the outputs (``v_scale``):
    a float, or per kv head ``[1, Hkv, 1, 1, 1]``; None for the outputs when every scale is 1."""
    k_scales, v_scales = k_scale.tolist(), v_scale.tolist()
    products = [sm_scale * s for s in k_scales]  # in double, then rounded once to float32
    q_multiplier = products[0] if len(set(products)) == 1 else \
        torch.tensor(products, dtype=torch.float32, device=k_scale.device).view(1, -1, 1, 1, 1)
    v_multiplier = None if all(s == 1.0 for s in v_scales) else v_scale.view(1, -1, 1, 1, 1)
    return q_multiplier, v_multiplier


def _paired(key_cache, value_cache) -> torch.Tensor | None:
    """Both caches as one ``[num_blocks, block_size, Hkv, 2, D]`` view, so that one gather reads
    both, when they are views of one tensor with the same strides (vLLM's halves of its
    ``[..., 2 * D]`` cache: in its NHD layout the pair is contiguous, whole blocks); else None."""
    offset = value_cache.storage_offset() - key_cache.storage_offset()
    if (key_cache.untyped_storage().data_ptr() != value_cache.untyped_storage().data_ptr()
            or key_cache.stride() != value_cache.stride() or key_cache.dtype != value_cache.dtype or offset <= 0):
        return None
    pair = key_cache.as_strided((*key_cache.shape[:3], 2, key_cache.shape[3]), (*key_cache.stride()[:3], offset, 1))
    return pair if entries_apart(pair) else None


@dataclasses.dataclass(frozen=True)
class _PageTile:
    """A tile of a group's pages: each unit's block ids, and which key positions of the tile each
    padded row cannot see (``[n, 1, rows, 1, tile keys]``: for every kv head and query head)."""

    ids: torch.Tensor
    hidden: torch.Tensor


@dataclasses.dataclass(frozen=True)
class _Group:
    """Units attended together: ``n`` units padded to ``rows`` rows each. ``query_rows`` holds the
    token of each padded row (a padding row repeats its unit's last row); ``real`` marks the real
    ones (None: all are) and ``out_rows`` their tokens; ``out_start`` is the first when they are
    one range of tokens in order (None otherwise)."""

    n: int
    rows: int
    query_rows: torch.Tensor
    tiles: tuple[_PageTile, ...]
    real: torch.Tensor | None
    out_rows: torch.Tensor
    out_start: int | None


_last_plan = LastBatch()  # the groups of the last batch planned


def _plan(query, key_cache, cu_q_lens, kv_lens, block_table, sliding_window) -> list[_Group]:
    """The groups of a batch: the last call's when the batch is the same (compared by value)."""
    _, block_size, num_kv_heads, head_size = key_cache.shape
    cu, kv = cu_q_lens.tolist(), kv_lens.tolist()
    key = (tuple(cu), tuple(kv), tuple(query.shape), key_cache.shape, query.device, block_table.shape, sliding_window,
           _MAX_Q_TILE, _KEY_TILE_ELEMENTS, _LOGIT_TILE_ELEMENTS, _GROUP_WASTE)
    groups = _last_plan.get(key, block_table)
    if groups is not None:
        return groups
    units = []
    for s, kv_len in enumerate(kv):
        start, end = cu[s], cu[s + 1]
        for first in range(start, end, _MAX_Q_TILE):
            rows = min(_MAX_Q_TILE, end - first)
            first_pos = kv_len - (end - first)
            lo = 0 if sliding_window is None else max(0, first_pos - sliding_window + 1)
            first_page = lo // block_size
            end_page = -(-(first_pos + rows) // block_size)
            units.append((first, rows, first_pos, first_page, end_page - first_page, s))
    key_elements = block_size * num_kv_heads * head_size  # of a page's keys
    logit_elements = query.shape[1] * block_size  # of a row's logits over a page, all heads
    groups = [_group(group, block_table, block_size, sliding_window, key_elements, logit_elements)
              for group in _grouped(units, key_elements, logit_elements)]
    _last_plan.put(groups, key, block_table)
    return groups


def _grouped(units: list, key_elements: int, logit_elements: int) -> list[list]:
    """Units batched together: by row count (1, 2, 3-4, 5-8, ...), then by page count, largest
    first; a group closes before the padding to its widest unit costs more than ``_GROUP_WASTE``
    of the work, or before its gathered keys or logits pass their budget."""
    by_rows: dict[int, list] = {}
    for unit in units:
        by_rows.setdefault((unit[1] - 1).bit_length(), []).append(unit)
    groups = []
    for bucket in by_rows.values():
        bucket.sort(key=lambda u: (u[4], u[1]), reverse=True)
        group, rows, pages, work = [], 0, 0, 0
        for unit in bucket:
            n = len(group) + 1
            grown_rows, grown_pages = max(rows, unit[1]), max(pages, unit[4])
            padded = n * grown_rows * grown_pages
            if group and (padded - (work + unit[1] * unit[4]) > _GROUP_WASTE * padded
                          or n * grown_pages * key_elements > _KEY_TILE_ELEMENTS
                          or padded * logit_elements > _LOGIT_TILE_ELEMENTS):
                groups.append(group)
                group, grown_rows, grown_pages, work = [], unit[1], unit[4], 0
            group.append(unit)
            rows, pages, work = grown_rows, grown_pages, work + unit[1] * unit[4]
        groups.append(group)
    return groups


def _group(units: list, block_table, block_size: int, sliding_window, key_elements: int,
           logit_elements: int) -> _Group:
    """The index tensors of a group of units ``(first token, rows, first position, first page,
    pages, sequence)``."""
    device = block_table.device
    n = len(units)
    units = sorted(units)  # in token order: rows of consecutive units are one range of out
    first_token, rows, first_pos, first_page, pages, seq = \
        torch.tensor(units, dtype=torch.int64, device=device).unbind(1)
    max_rows, max_pages = max(u[1] for u in units), max(u[4] for u in units)
    row = torch.minimum(torch.arange(max_rows, device=device), rows[:, None] - 1)  # [n, R]
    q_pos = (first_pos[:, None] + row)[:, :, None, None]
    # long units walk their pages in tiles, within the budgets of one gather and of the logits
    tile_pages = max(1, min(_KEY_TILE_ELEMENTS // (n * key_elements),
                            _LOGIT_TILE_ELEMENTS // (n * max_rows * logit_elements)))
    tiles = []
    for p0 in range(0, max_pages, tile_pages):
        page = torch.arange(p0, min(max_pages, p0 + tile_pages), device=device)
        used = page < pages[:, None]  # pages past a unit's last may hold any id
        column = (first_page[:, None] + page).clamp(max=block_table.shape[1] - 1)
        ids = torch.where(used, block_table[seq[:, None], column].long(), 0).flatten()
        k_pos = ((first_page[:, None] + page[0]) * block_size
                 + torch.arange(len(page) * block_size, device=device))[:, None, None, :]
        hidden = k_pos > q_pos  # [n, R, 1, L]; this hides every slot past kv_len too
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        tiles.append(_PageTile(ids, hidden.unsqueeze(1)))
    real = torch.arange(max_rows, device=device) < rows[:, None]
    tokens = first_token[:, None] + torch.arange(max_rows, device=device)
    all_real = all(u[1] == max_rows for u in units)
    one_range = all_real and all(b[0] == a[0] + max_rows for a, b in zip(units, units[1:]))
    return _Group(n, max_rows, (first_token[:, None] + row).flatten(), tuple(tiles),
                  None if all_real else real.flatten(), tokens.flatten() if all_real else tokens[real],
                  units[0][0] if one_range else None)


def _attend_group(out, query, caches, group: _Group, scales, soft_cap, exact=False) -> None:
    """Attention of a group of units, written to their rows of ``out``.

    A tile of pages is gathered once for all kv heads (``index_select`` on the caches as they
    are, any strides; keys and values in one gather when ``caches`` holds them paired) and
    converted to float32 with the kv heads first, so that one batched matmul over (unit, kv head)
    computes every head's logits and one more their weighted sums; a group of long units walks
    its pages in tiles whose softmax partials are merged by their log-sum-exp. ``scales`` is
    ``(query multiplier, value multiplier)``: ``sm_scale * k_scale`` and ``v_scale``, each a
    float or ``[1, Hkv, 1, 1, 1]`` (None: 1).

    The NaN policy: the fast pass (``exact`` False) masks nothing. A NaN or inf in a query or in
    any gathered entry, seen or not, makes that head's logits (keys; checked before the soft cap,
    which would make an inf finite) or weighted sum (values: a zero weight times NaN is NaN)
    non-finite, which their sums show; only then is the group attended again exactly: those
    entries zeroed, and the rows that see one (or whose query holds one) written as NaN.
    """
    q_multiplier, v_multiplier = scales
    key_cache, value_cache, pair = caches
    n, max_rows = group.n, group.rows
    _, num_q_heads, head_size = query.shape
    num_kv_heads = key_cache.shape[2]
    group_size = num_q_heads // num_kv_heads
    batch = n * num_kv_heads  # one matmul batch entry per unit and kv head
    # [n, Hkv, R, G, D], a new float32 tensor: scaled in place
    rows_in = query.index_select(0, group.query_rows) if group.out_start is None else \
        query[group.out_start:group.out_start + n * max_rows]  # the rows are one range: no gather
    q = _float_copy(rows_in.view(n, max_rows, num_kv_heads, group_size, head_size), (0, 2, 1, 3, 4))
    poisoned = None  # [n, Hkv, R, G]: rows that end as NaN
    if exact:
        poisoned = _non_finite_rows(q)
        q.masked_fill_(poisoned[..., None], 0.0)
    q = q.mul_(q_multiplier).view(batch, max_rows * group_size, head_size)
    single = len(group.tiles) == 1
    partials = []  # per page tile: (outputs [n, Hkv, R, G, D], log-sum-exp [n, Hkv, R, G, 1] if several tiles)
    checks = None  # the sum of the logits' and outputs' sums: finite unless a NaN or inf is there
    for tile in group.tiles:
        if pair is None:  # [n, Hkv, L, D] each
            k = _float_copy(key_cache.index_select(0, tile.ids).view(n, -1, num_kv_heads, head_size), (0, 2, 1, 3))
            v = _float_copy(value_cache.index_select(0, tile.ids).view(n, -1, num_kv_heads, head_size), (0, 2, 1, 3))
        else:  # [n, Hkv, 2, L, D]: a key and a value slice of it keep (unit, kv head) one batch dimension
            k, v = _float_copy(pair.index_select(0, tile.ids).view(n, -1, num_kv_heads, 2, head_size),
                               (0, 2, 3, 1, 4)).unbind(2)
        hidden = tile.hidden  # [n, 1, R, 1, L]
        if exact:
            bad = _non_finite_rows(k) | _non_finite_rows(v)  # [n, Hkv, L]
            k = k.masked_fill(bad[..., None], 0.0)
            v = v.masked_fill(bad[..., None], 0.0)
            seen_bad = (~hidden & bad[:, :, None, None, :]).any(dim=-1)  # [n, Hkv, R, 1]
            poisoned = poisoned | seen_bad
        keys = k.shape[2]
        logits = torch.bmm(q, k.reshape(batch, keys, head_size).transpose(1, 2))
        if not exact:  # before the soft cap, which would make an inf finite
            checks = logits.sum() if checks is None else checks + logits.sum()
        if soft_cap is not None:
            logits = torch.tanh(logits.div_(soft_cap)).mul_(soft_cap)
        logits = logits.view(n, num_kv_heads, max_rows, group_size, keys).masked_fill_(hidden, float("-inf"))
        lse = None
        if single:
            weights = logits.softmax(dim=-1)
        else:  # a tile some rows see nothing of: log-sum-exp -inf, weights 0
            lse = logits.logsumexp(dim=-1, keepdim=True)
            weights = torch.exp(logits - lse.masked_fill(lse == float("-inf"), 0.0))
        heads = torch.bmm(weights.view(batch, max_rows * group_size, keys), v.reshape(batch, keys, head_size))
        if not exact:
            checks = checks + heads.sum()
        partials.append((heads.view(n, num_kv_heads, max_rows, group_size, head_size), lse))
    if checks is not None and not math.isfinite(checks.item()):  # one host read (cheaper than torch.isfinite)
        _attend_group(out, query, caches, group, scales, soft_cap, exact=True)
        return
    result = _merged(partials)
    if v_multiplier is not None:
        result = result * v_multiplier
    if poisoned is not None:
        result.masked_fill_(poisoned[..., None], float("nan"))
    if group.out_start is not None:  # back to token-major, in out's dtype: one copy, in place
        start = group.out_start
        out[start:start + n * max_rows].view(n, max_rows, num_kv_heads, group_size, head_size).permute(
            0, 2, 1, 3, 4).copy_(result)
        return
    rows = torch.empty((n, max_rows, num_kv_heads, group_size, head_size), dtype=out.dtype, device=out.device)
    rows.permute(0, 2, 1, 3, 4).copy_(result)  # back to token-major, in out's dtype: one copy
    rows = rows.view(n * max_rows, num_q_heads, head_size)
    if group.real is not None:
        rows = rows[group.real]
    out.index_copy_(0, group.out_rows, rows)


def _float_copy(x: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``x.permute(order)`` as a new contiguous float32 tensor: one copy that converts and
    reorders. (``Tensor.to`` returns a float32 input as it is, strides and all.)"""
    permuted = x.permute(order)
    return torch.empty(permuted.shape, dtype=torch.float32, device=x.device).copy_(permuted)


def _merged(partials) -> torch.Tensor:
    """The output over every page tile: each tile's partial weighted by its share of the
    softmax's denominator."""
    if len(partials) == 1:
        return partials[0][0]
    lse = torch.stack([lse for _, lse in partials])  # [tiles, n, Hkv, R, G, 1]
    shares = torch.exp(lse - lse.logsumexp(dim=0, keepdim=True))
    return (shares * torch.stack([heads for heads, _ in partials])).sum(dim=0)

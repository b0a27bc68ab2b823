"""Ragged paged attention and the KV-cache write as SYCL kernels (``paged_attention.cl``).

Contract: ``torch_kernels.reference.paged_attention``. One SPIR-V build per (query dtype, cache
dtype, head size) holds both kernels. The kernels take each cache's (block, slot, kv head) strides
and the offset of its first entry, so a cache may be any view whose last dimension is contiguous.

CPU tensors run on the ``opencl:cpu`` SYCL device through USM copies: the SYCL runtime refuses a
host pointer it did not allocate as a kernel argument, and USM memory can be viewed by torch but
not the reverse. Attention copies the storage the caches view (once when both view one tensor, as
vLLM's key and value halves do) keeping its strides; the written slots are copied back into the
caches in place, slot by slot, so nothing else in their storage is written.
"""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from . import _runtime

SOURCE = "paged_attention.cl"
ROWS = 16  # query rows (token, head) per work-group, as in paged_attention.cl
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2,
          torch.int8: 3, torch.float8_e4m3fn: 4, torch.float8_e5m2: 5}
_QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How query rows are grouped into work-groups: ``q_block`` tokens of one sequence times
    ``heads_per_group`` of a kv head's query heads (their product is at most ``ROWS``)."""

    q_block: int
    heads_per_group: int


def default_layout(group: int, max_q_len: int) -> Layout:
    """All of a kv head's query heads in one work-group if they fit; the rest of the rows go to
    more tokens of a prefill (a decode-only batch has one token per sequence)."""
    heads = min(group, ROWS)
    return Layout(q_block=max(1, min(ROWS // heads, max_q_len)), heads_per_group=heads)


def _work_group_size(head_size: int) -> int:
    return min(head_size, 256)  # WG of paged_attention.cl


def tile_keys(width: int) -> int:
    """Keys per local-memory tile of rows ``width`` wide: KT of paged_attention.cl and mla.cl."""
    return 64 if width <= 64 else 32 if width <= 128 else 16 if width <= 256 else 8


def _local_bytes(head_size: int) -> int:
    """The __local arrays of the attention kernel, as paged_attention.cl sizes them."""
    keys = tile_keys(head_size)
    floats = ROWS * head_size + keys * (head_size + 1) + keys * head_size + ROWS * keys + 3 * ROWS
    return 4 * floats + 2 * 8 * keys + 3 * 4 * ROWS + 4 * keys


def _macros(query_dtype: torch.dtype, cache_dtype: torch.dtype, head_size: int) -> dict[str, int]:
    return {"Q_KIND": KINDS[query_dtype], "CACHE_KIND": KINDS[cache_dtype], "HEAD_SIZE": head_size}


def _supported(query_dtype, cache, *tensors) -> None:
    for t in (cache, *tensors):
        if t is not None and t.device.type != "cpu":
            # Torch XPU tensors would be passed zero-copy through DLPack; that path is not built yet.
            raise NotImplementedError(f"sycl: only CPU tensors (run on the opencl:cpu device) are supported, got {t.device}")
    if query_dtype not in _QUERY_DTYPES or cache.dtype not in KINDS:
        raise NotImplementedError(f"sycl: no kernel for {query_dtype} queries with a {cache.dtype} cache")
    head_size = cache.shape[3]
    if _local_bytes(head_size) > _runtime.local_memory_bytes():
        raise NotImplementedError(f"sycl: head size {head_size} does not fit the device's local memory")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # copies through bytes are bit-exact for every dtype


@dataclasses.dataclass
class DeviceCache:
    """A cache as a kernel sees it: USM memory, the element offset of entry (0, 0, 0, 0) in it,
    and the cache's strides; ``view`` is that cache as a torch view of the memory."""

    memory: object
    offset: int
    strides: tuple[int, int, int]
    view: torch.Tensor

    def layout_args(self) -> list:
        """The kernels' CACHE_LAYOUT arguments: offset, block, slot and kv head strides."""
        return [ctypes.c_int64(x) for x in (self.offset, *self.strides)]


def _extent(cache: torch.Tensor) -> tuple[int, int]:
    """(first, end) element of the storage region ``cache`` reaches."""
    start = cache.storage_offset()
    return start, start + 1 + sum((size - 1) * stride for size, stride in zip(cache.shape, cache.stride()))


def device_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> list[DeviceCache]:
    """USM copies of the storage the caches view, their strides kept: one copy of the region both
    reach when they view one storage (vLLM's halves of one tensor), else one each."""
    caches = (key_cache, value_cache)
    if key_cache.untyped_storage().data_ptr() == value_cache.untyped_storage().data_ptr():
        extents = [_extent(c) for c in caches]
        shared = (min(e[0] for e in extents), max(e[1] for e in extents))
        regions = [shared, shared]
    else:
        regions = [_extent(c) for c in caches]
    copies = {}
    result = []
    for cache, region in zip(caches, regions):
        start, end = region
        key = (cache.untyped_storage().data_ptr(), region)
        if key not in copies:
            copies[key] = _runtime.usm_copy(_bytes(cache.as_strided((end - start,), (1,), start)))
        memory, raw = copies[key]
        offset = cache.storage_offset() - start
        view = raw.view(cache.dtype).as_strided(cache.shape, cache.stride(), offset)
        result.append(DeviceCache(memory, offset, cache.stride()[:3], view))
    return result


def _write_args(key, value, key_cache: DeviceCache, value_cache: DeviceCache, slot_mapping, k_scale, v_scale,
                block_size: int) -> list:
    inputs = [_runtime.usm_copy(t) for t in (key, value)]
    slots = _runtime.usm_copy(slot_mapping)
    scales = [_runtime.usm_copy(t.float()) for t in (k_scale, v_scale)]
    return [inputs[0][0], inputs[1][0], key_cache.memory, value_cache.memory, slots[0], scales[0][0], scales[1][0],
            ctypes.c_int(block_size), *key_cache.layout_args(), *value_cache.layout_args()]


def _write_range(key: torch.Tensor) -> list[int]:
    return list(key.shape)  # SYCL lists the slowest dimension first: OpenCL (D, Hkv, T)


def _slot_index(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of each slot in ``cache``."""
    block_size = cache.shape[1]
    return slots // block_size, slots % block_size


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    """Write ``key[t] / k_scale`` (and the values) rounded to the cache dtype to slot
    ``slot_mapping[t]`` of the caches, in place; slot -1 is skipped, nothing else changes."""
    _supported(key.dtype, key_cache, key, value, value_cache, slot_mapping, k_scale, v_scale)
    num_tokens, _, head_size = key.shape
    if num_tokens == 0:
        return
    kernel = _runtime.kernel(SOURCE, "reshape_and_cache", **_macros(key.dtype, key_cache.dtype, head_size))
    # The kernel writes slot slot_mapping[t] of the caches it gets. Handing it [T, 1, Hkv, D] stand-ins
    # (blocks of one slot) with slot t (or -1) keeps the USM traffic to the written rows, which are
    # then scattered into the real caches: a serving cache is far larger than one step's tokens.
    real = slot_mapping >= 0
    local_slots = torch.where(real, torch.arange(num_tokens), -1)
    row_shape = (num_tokens, 1, *key_cache.shape[2:])
    stand_ins = []
    for _ in range(2):
        memory, view = _runtime.usm_empty(row_shape, key_cache.dtype)
        stand_ins.append(DeviceCache(memory, 0, view.stride()[:3], view))
    args = _write_args(key, value, *stand_ins, local_slots, k_scale, v_scale, block_size=1)
    _runtime.host_queue().submit(kernel, args, _write_range(key)).wait()
    blocks, offsets = _slot_index(key_cache, slot_mapping[real])
    source_rows = real.nonzero()[:, 0]
    for cache, written in zip((key_cache, value_cache), stand_ins):
        _bytes(cache)[blocks, offsets] = _bytes(written.view)[source_rows, 0]


def ragged_paged_attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                           sliding_window, soft_cap, k_scale, v_scale, key, value, slot_mapping,
                           layout: Layout | None = None, out: torch.Tensor | None = None,
                           bad_rows: torch.Tensor | None = None):
    """Attention of each sequence's new query tokens over its paged keys and values.

    ``query [T, Hq, D]``, caches ``[num_blocks, block_size, Hkv, D]``; returns ``[T, Hq, D]`` in
    query's dtype. With ``key`` given, the new tokens are first written to the caches (in place),
    as ``reshape_and_cache`` does. ``layout`` overrides ``default_layout``. ``out`` is not written:
    the result is a new tensor, which the op copies into it. ``bad_rows``: the rows to make NaN
    (the contract's).
    """
    _supported(query.dtype, key_cache, query, value_cache, cu_q_lens, kv_lens, block_table,
               k_scale, v_scale, key, value, slot_mapping)
    if soft_cap is not None and not 1e-37 < soft_cap < 1e37:
        raise NotImplementedError(f"sycl: soft_cap {soft_cap} is outside the float32 range the kernel computes in")
    num_tokens, num_q_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs, max_blocks = block_table.shape
    queue = _runtime.host_queue()
    macros = _macros(query.dtype, key_cache.dtype, head_size)
    out_mem, out = _runtime.usm_empty(tuple(query.shape), query.dtype)
    if num_tokens == 0 or num_seqs == 0:
        return _nan_rows(out.zero_(), bad_rows)

    caches = device_caches(key_cache, value_cache)
    write = None
    if key is not None:
        # Two kernels on one queue, not one: the attention of a token may read keys that another
        # work-group writes, and a kernel has no grid-wide barrier to wait for them.
        write_kernel = _runtime.kernel(SOURCE, "reshape_and_cache", **macros)
        write_args = _write_args(key, value, *caches, slot_mapping, k_scale, v_scale, block_size)
        write = queue.submit_async(write_kernel, write_args, _write_range(key))

    group = num_q_heads // num_kv_heads
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    layout = layout or default_layout(group, int(q_lens.max()))
    if layout.q_block * layout.heads_per_group > ROWS or min(layout.q_block, layout.heads_per_group) < 1:
        raise ValueError(f"layout: expected q_block * heads_per_group in [1, {ROWS}], got {layout}")
    chunks = -(-group // layout.heads_per_group)
    q_blocks = num_tokens // layout.q_block + num_seqs  # what the kernel's sequence search assumes
    inputs = [_runtime.usm_copy(t) for t in (query, cu_q_lens, kv_lens, block_table)]
    scales = [_runtime.usm_copy(t.float()) for t in (k_scale, v_scale)]
    args = [inputs[0][0], caches[0].memory, caches[1].memory, inputs[1][0], inputs[2][0], inputs[3][0],
            scales[0][0], scales[1][0], out_mem, ctypes.c_int(num_seqs), ctypes.c_int(num_q_heads),
            ctypes.c_int(block_size), ctypes.c_int(max_blocks),
            ctypes.c_int(layout.q_block), ctypes.c_int(layout.heads_per_group), ctypes.c_float(sm_scale),
            # 0 means none; a window past 2^31 - 1 keys covers every sequence, as none does
            ctypes.c_int(min(sliding_window or 0, 2 ** 31 - 1)), ctypes.c_float(soft_cap or 0.0),
            *caches[0].layout_args(), *caches[1].layout_args()]
    work_group = _work_group_size(head_size)
    kernel = _runtime.kernel(SOURCE, "ragged_paged_attention", **macros)
    # OpenCL dimensions (head chunk, kv head, query block), listed slowest first as SYCL does
    queue.submit(kernel, args, [q_blocks, num_kv_heads, chunks * work_group], [1, 1, work_group],
                 dEvents=[write] if write else None).wait()

    if key is not None:
        blocks, offsets = _slot_index(key_cache, slot_mapping[slot_mapping >= 0])
        for cache, written in zip((key_cache, value_cache), caches):
            _bytes(cache)[blocks, offsets] = _bytes(written.view)[blocks, offsets]
    return _nan_rows(out, bad_rows)


def _nan_rows(out: torch.Tensor, bad_rows: torch.Tensor | None) -> torch.Tensor:
    """``out`` with the rows ``bad_rows`` marks NaN, in place (the deferred checks' bad sequences)."""
    return out if bad_rows is None else out.masked_fill_(bad_rows[:, None, None], torch.nan)


def spirv_binaries() -> list[bytes]:
    """The SPIR-V modules for every (query dtype, cache dtype) pair at head size 128 (built, cached)."""
    return [_runtime.spirv(SOURCE, _macros(q, c, 128))
            for q in _QUERY_DTYPES for c in (q, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)]

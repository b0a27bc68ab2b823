"""The sycl backend of the mla family: the latent-cache write, run by the paged attention
family's OpenCL C write with the latent cache as a one-kv-head cache (the pallas backend,
``torch_kernels/pallas/mla.py``, says why that is the same write), and the attention
(``mla.cl``).

Contract: ``torch_kernels.reference.mla``. One SPIR-V build per (query dtype, cache dtype, Lr,
R). CPU tensors run on the ``opencl:cpu`` SYCL device through USM copies, as the paged attention
family's do (``oneapi_impl/paged_attention.py`` says why); the cache's storage region is copied
once, its strides kept.
"""

from __future__ import annotations

import ctypes

import torch

from . import _runtime
from .paged_attention import KINDS, Layout, default_layout, device_caches, reshape_and_cache, tile_keys

SOURCE = "mla.cl"
ROWS = 16  # query rows (token, head) per work-group, as in mla.cl


def mla_reshape_and_cache(kv_c, k_pe, kv_cache, slot_mapping, scale) -> None:
    """Contract: ``torch_kernels.reference.mla.mla_reshape_and_cache``."""
    row = torch.cat([kv_c, k_pe], dim=-1)[:, None]  # key and value: the same row, to the same slot
    reshape_and_cache(row, row, kv_cache[:, :, None], kv_cache[:, :, None], slot_mapping, scale, scale)


def _macros(query_dtype: torch.dtype, cache_dtype: torch.dtype, latent: int, rope: int) -> dict[str, int]:
    return {"Q_KIND": KINDS[query_dtype], "CACHE_KIND": KINDS[cache_dtype], "LR": latent, "R": rope}


def _local_bytes(latent: int, rope: int) -> int:
    """The __local arrays of mla.cl at these widths."""
    width = latent + rope
    keys = tile_keys(width)
    return 4 * (ROWS * width + keys * (width + 1) + ROWS * keys + 3 * ROWS) + 12 * keys + 8 * ROWS


def ragged_paged_mla(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, sm_scale, topk_indices, scale):
    """Contract: ``torch_kernels.reference.mla.ragged_paged_mla`` (``topk_indices``, when given,
    has each row sorted with repeats replaced by -1, as the op passes it)."""
    # the cache's bytes: its device is checked here, its dtype (quantized ones too) below
    _runtime.require_supported(q_nope, q_pe, kv_cache.view(torch.uint8), cu_q_lens, kv_lens, block_table,
                               topk_indices, scale)
    if kv_cache.dtype not in KINDS:
        raise NotImplementedError(f"sycl: no kernel for a {kv_cache.dtype} latent cache")
    num_tokens, num_heads, latent = q_nope.shape
    rope = q_pe.shape[2]
    if _local_bytes(latent, rope) > _runtime.local_memory_bytes():
        raise NotImplementedError(f"sycl: Lr + R = {latent + rope} does not fit the device's local memory")
    out_mem, out = _runtime.usm_empty(tuple(q_nope.shape), q_nope.dtype)
    lse_mem, lse = _runtime.usm_empty((num_tokens, num_heads), torch.float32)
    num_seqs, max_blocks = block_table.shape
    if num_tokens == 0:
        return out, lse
    sparse = topk_indices is not None
    # a sparse row reads its own positions: one token a work-group
    layout = (Layout(1, min(num_heads, ROWS)) if sparse else
              default_layout(num_heads, int((cu_q_lens[1:] - cu_q_lens[:-1]).max())))
    q_block, heads_per_group = layout.q_block, layout.heads_per_group
    chunks = -(-num_heads // heads_per_group)
    q_blocks = num_tokens // q_block + num_seqs  # what the kernel's sequence search assumes
    cache = device_caches(kv_cache, kv_cache)[0]
    inputs = [_runtime.usm_copy(t)[0] for t in (q_nope, q_pe)]
    index = [_runtime.usm_copy(t)[0] for t in (cu_q_lens, kv_lens, block_table,
                                                topk_indices if sparse else cu_q_lens, scale.float())]
    args = [*inputs, cache.memory, *index, out_mem, lse_mem, ctypes.c_int(num_seqs), ctypes.c_int(num_heads),
            ctypes.c_int(kv_cache.shape[1]), ctypes.c_int(max_blocks), ctypes.c_int(q_block),
            ctypes.c_int(heads_per_group), ctypes.c_int(topk_indices.shape[1] if sparse else 0),
            ctypes.c_float(sm_scale), *cache.layout_args()[:3]]
    work_group = min(latent, 256)  # WG of mla.cl
    kernel = _runtime.kernel(SOURCE, "ragged_paged_mla", **_macros(q_nope.dtype, kv_cache.dtype, latent, rope))
    # OpenCL dimensions (head chunk, query block), listed slowest first as SYCL does
    _runtime.host_queue().submit(kernel, args, [q_blocks, chunks * work_group], [1, work_group]).wait()
    return out, lse


INDEXER_WORK_GROUP = 64  # WG_I of mla.cl
GPU_LOCAL_BYTES = 64 * 1024  # an Intel GPU's local memory per work-group, the SPIR-V builds' target


def _indexer_macros(dtype, num_heads: int, head_size: int, top_k: int, local_bytes: int) -> dict:
    """The indexer's build macros for a device of ``local_bytes`` of local memory: its queries
    staged there where they fit beside the keys (``16 * TOPK_P`` bytes), else read from global."""
    topk_p = max(16, 1 << (top_k - 1).bit_length())
    macros = {"Q_KIND": KINDS[dtype], "HI": num_heads, "DI": head_size, "TOPK_P": topk_p}
    keys_and_weights = 16 * topk_p + 4 * num_heads
    if keys_and_weights > local_bytes:
        raise NotImplementedError(f"sycl: top_k {top_k} does not fit the device's local memory")
    if keys_and_weights + 4 * num_heads * head_size > local_bytes:
        macros["Q_IN_GLOBAL"] = 1
    return macros


def indexer_topk(q, k_cache, weights, cu_q_lens, kv_lens, block_table, top_k: int):
    """Contract: ``torch_kernels.reference.mla.indexer_topk``."""
    _runtime.require_supported(q, k_cache, weights, cu_q_lens, kv_lens, block_table)
    num_tokens, num_heads, head_size = q.shape
    macros = _indexer_macros(q.dtype, num_heads, head_size, top_k, _runtime.local_memory_bytes())
    out_mem, out = _runtime.usm_empty((num_tokens, top_k), torch.int32)
    if num_tokens == 0:
        return out
    cache = device_caches(k_cache, k_cache)[0]
    inputs = [_runtime.usm_copy(t)[0] for t in (q, weights.float(), cu_q_lens, kv_lens, block_table)]
    args = [inputs[0], cache.memory, *inputs[1:], out_mem, ctypes.c_int(kv_lens.shape[0]),
            ctypes.c_int(k_cache.shape[1]), ctypes.c_int(block_table.shape[1]), ctypes.c_int(top_k),
            *cache.layout_args()[:3]]
    kernel = _runtime.kernel(SOURCE, "indexer_topk", **macros)
    _runtime.host_queue().submit(kernel, args, [num_tokens * INDEXER_WORK_GROUP], [INDEXER_WORK_GROUP]).wait()
    return out


def spirv_binaries() -> list[bytes]:
    """The SPIR-V modules of the attention at DeepSeek-V3's widths (Lr 512, R 64), bfloat16 over a
    bfloat16 and a float8_e4m3fn cache and float32, and of the indexer at DeepSeek-V3.2's (64
    heads of 128, top 2048) in bfloat16 for a GPU's 64 KiB of local memory (its queries read from
    global) (built, cached; the other dtypes differ only in loads)."""
    return ([_runtime.spirv(SOURCE, _macros(q, c, 512, 64))
             for q, c in ((torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e4m3fn),
                          (torch.float32, torch.float32))]
            + [_runtime.spirv(SOURCE, _indexer_macros(torch.bfloat16, 64, 128, 2048, GPU_LOCAL_BYTES))])

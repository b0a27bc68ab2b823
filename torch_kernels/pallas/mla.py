"""The pallas backend of the mla family on CPU torch tensors: the latent-cache write and the
attention (``jax_impl.mla``).

A latent cache ``[num_blocks, block_size, Lr + R]`` is a paged cache with one kv head of size
``Lr + R``, so the write is the paged attention family's Pallas write with the row
``cat(kv_c, k_pe)`` as that head's key and value, both caches the one latent cache (the same
row lands in the same slot twice; no other entry changes).
"""

from __future__ import annotations

import torch

from .. import _checks
from .paged_attention import check_cache_dtype, pallas_reshape_and_cache
from .torch_tensors import check_cpu, to_jax, to_torch


def pallas_mla_reshape_and_cache(kv_c, k_pe, kv_cache, slot_mapping, scale) -> None:
    """Contract: ``torch_kernels.reference.mla.mla_reshape_and_cache``."""
    rows = torch.cat([kv_c, k_pe], dim=-1)[:, None]
    cache = kv_cache[:, :, None]
    pallas_reshape_and_cache(rows, rows, cache, cache, slot_mapping, scale, scale)


def pallas_ragged_paged_mla(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, sm_scale, topk_indices,
                            scale):
    """Contract: ``torch_kernels.reference.mla.ragged_paged_mla``."""
    check_cpu(q_nope, kv_cache)
    check_cache_dtype(kv_cache)
    from jax_impl import mla

    out, lse = mla.ragged_paged_mla(
        *map(to_jax, (q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table)), float(sm_scale),
        None if topk_indices is None else to_jax(topk_indices), to_jax(scale))
    return to_torch(out), to_torch(lse)


def pallas_indexer_topk(q, k_cache, weights, cu_q_lens, kv_lens, block_table, top_k):
    """Contract: ``torch_kernels.reference.mla.indexer_topk``."""
    check_cpu(q, k_cache)
    from jax_impl import mla

    return to_torch(mla.indexer_topk(*map(to_jax, (q, k_cache, weights, cu_q_lens, kv_lens, block_table)), top_k))


def torchax_implementations() -> dict:
    """mla_reshape_and_cache on torchax tensors, by op name: the paged write on the latent cache
    as one kv head; the cache's torchax tensor is pointed at the updated array (JAX arrays are
    immutable; a torchax tensor keeps its array in ``_elem``)."""
    import jax.numpy as jnp
    from torchax.interop import jax_view

    from jax_impl import paged_attention as kernels

    from ..ops import mla as op
    from ..ops import paged_attention as paged
    from .torchax_tensors import first_backend

    writes = {"pallas": kernels.reshape_and_cache, "reference": kernels.reshape_and_cache_reference}

    def mla_reshape_and_cache(kv_c, k_pe, kv_cache, slot_mapping, scale=None, implementation=None):
        op.check_write_inputs(kv_c, k_pe, kv_cache, slot_mapping, scale)
        checks = _checks.ValueChecks(slot_mapping.device, "full")  # torchax: read on the host, as JAX's own checks are
        paged.check_slots(slot_mapping, kv_cache, checks)
        paged.scale_checks(checks, scale=scale)
        checks.finish()
        write = first_backend(implementation, writes)
        c, pe, cache, slots, scale = jax_view((kv_c, k_pe, kv_cache, slot_mapping, scale))
        rows = jnp.concatenate([c, pe], axis=-1)[:, None]
        scale = None if scale is None else scale.reshape(1)
        new, _ = write(rows, rows, cache[:, :, None], cache[:, :, None], slots, scale, scale)
        kv_cache._elem = new[:, :, 0]

    return {"mla_reshape_and_cache": mla_reshape_and_cache}

"""The paged_attention family on the pallas backend: ``reshape_and_cache`` and ``ragged_paged_attention``.

CPU torch tensors: ``pallas_reshape_and_cache`` and ``pallas_ragged_paged_attention``, the kernels
``torch_kernels.ops.paged_attention`` registers; they copy the written slots back into the caches.
Torchax tensors: :func:`torchax_implementations`.
"""

from __future__ import annotations

import torch

from .. import _checks
from ..ops import paged_attention as op
from ..reference.paged_attention import nan_rows
from .torch_tensors import FLOAT8_JAX_NAMES, check_cpu, to_jax, to_torch
from .torchax_tensors import first_backend

_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, *FLOAT8_JAX_NAMES)


def check_cache_dtype(cache: torch.Tensor) -> None:
    """Decline (NotImplementedError) a cache dtype the Pallas kernels are not built for."""
    if cache.dtype not in _CACHE_DTYPES:
        raise NotImplementedError(f"pallas: caches of dtype {cache.dtype} are not supported")


def _store_slots(cache: torch.Tensor, new, slot_mapping: torch.Tensor) -> None:
    """Copy the slots ``slot_mapping`` wrote from the kernel's updated cache ``new`` back into
    ``cache`` in place, byte for byte (NaN payloads included). JAX arrays have no strides, so a
    strided cache (any view whose last dimension is contiguous) crossed as a contiguous copy; only
    its written slots come back, so nothing else in its storage is written."""
    slots = slot_mapping[slot_mapping >= 0]
    blocks, offsets = slots // cache.shape[1], slots % cache.shape[1]
    cache.view(torch.uint8)[blocks, offsets] = to_torch(new).view(torch.uint8)[blocks, offsets]


def _slots(slot_mapping: torch.Tensor) -> torch.Tensor:
    return slot_mapping.to(torch.int32)  # JAX runs without 64-bit ints; slots fit in 32 bits


def pallas_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    check_cpu(key, key_cache)
    check_cache_dtype(key_cache)
    from jax_impl import paged_attention

    new_k, new_v = paged_attention.reshape_and_cache(
        *map(to_jax, (key, value, key_cache, value_cache, _slots(slot_mapping), k_scale, v_scale)))
    _store_slots(key_cache, new_k, slot_mapping)
    _store_slots(value_cache, new_v, slot_mapping)


def pallas_ragged_paged_attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                                  sliding_window, soft_cap, k_scale, v_scale, key, value, slot_mapping, out=None,
                                  bad_rows=None):
    check_cpu(query, key_cache)
    check_cache_dtype(key_cache)
    from jax_impl import paged_attention

    # ``out`` is not written: JAX arrays are new ones, and the op copies the result into it
    new = None if key is None else (to_jax(key), to_jax(value), to_jax(_slots(slot_mapping)))
    attended, new_k, new_v = paged_attention.ragged_paged_attention(
        *map(to_jax, (query, key_cache, value_cache, cu_q_lens, kv_lens, block_table)), sm_scale,
        sliding_window, soft_cap, to_jax(k_scale), to_jax(v_scale), *(new or (None, None, None)))
    if new is not None:
        _store_slots(key_cache, new_k, slot_mapping)
        _store_slots(value_cache, new_v, slot_mapping)
    return nan_rows(to_torch(attended), bad_rows)


def torchax_implementations() -> dict:
    """reshape_and_cache, ragged_paged_attention and its ``_out`` form on torchax tensors, by op name.

    Both write the caches: JAX arrays are immutable, so the kernels return updated caches and the
    caches' torchax tensors are pointed at them (a torchax tensor keeps its array in ``_elem``).
    Inference only: no gradients.
    """
    from jax_impl import paged_attention as kernels
    from torchax.interop import jax_view, torch_view

    writes = {"pallas": kernels.reshape_and_cache, "reference": kernels.reshape_and_cache_reference}
    attentions = {"pallas": kernels.ragged_paged_attention, "reference": kernels.ragged_paged_attention_reference}

    def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None,
                          implementation=None):
        op.check_write_inputs(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        checks = _checks.ValueChecks(slot_mapping.device, "full")  # torchax: read on the host
        op.check_slots(slot_mapping, key_cache, checks)
        op.scale_checks(checks, k_scale=k_scale, v_scale=v_scale)
        checks.finish()
        write = first_backend(implementation, writes)
        key_cache._elem, value_cache._elem = write(
            *jax_view((key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)))

    def ragged_paged_attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                               sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, key=None,
                               value=None, slot_mapping=None, implementation=None):
        op.check_inputs(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale, sliding_window,
                        soft_cap, k_scale, v_scale, key, value, slot_mapping)
        checks = _checks.ValueChecks(query.device, "full")  # torchax: read on the host
        op.check_lengths(query, key_cache, cu_q_lens, kv_lens, block_table, checks)
        if key is not None:
            op.check_slots(slot_mapping, key_cache, checks)
        op.scale_checks(checks, k_scale=k_scale, v_scale=v_scale)
        checks.finish()
        attention = first_backend(implementation, attentions)
        out, new_k, new_v = attention(
            *jax_view((query, key_cache, value_cache, cu_q_lens, kv_lens, block_table)), float(sm_scale),
            sliding_window, None if soft_cap is None else float(soft_cap),
            *jax_view((k_scale, v_scale, key, value, slot_mapping)))
        if key is not None:
            key_cache._elem, value_cache._elem = new_k, new_v
        return torch_view(out)

    def ragged_paged_attention_out(out, query, *args, **kwargs):
        op.check_out(out, query)
        out.copy_(ragged_paged_attention(query, *args, **kwargs))

    return {op.WRITE_OP: reshape_and_cache, op.OP: ragged_paged_attention, op.OUT_OP: ragged_paged_attention_out}

"""The sycl backend of the mla family: the latent-cache write, run by the paged attention
family's OpenCL C write with the latent cache as a one-kv-head cache (the pallas backend,
``torch_kernels/pallas/mla.py``, says why that is the same write)."""

from __future__ import annotations

import torch

from .paged_attention import reshape_and_cache


def mla_reshape_and_cache(kv_c, k_pe, kv_cache, slot_mapping, scale) -> None:
    """Contract: ``torch_kernels.reference.mla.mla_reshape_and_cache``."""
    row = torch.cat([kv_c, k_pe], dim=-1)[:, None]  # key and value: the same row, to the same slot
    reshape_and_cache(row, row, kv_cache[:, :, None], kv_cache[:, :, None], slot_mapping, scale, scale)

"""Running jax_impl kernels on ordinary torch tensors (the pallas backend outside torchax).

Tensors cross by DLPack without copies where both sides allow it. On CPU this is how the tests
and the doctor exercise the Pallas kernels (in interpret mode); on a TPU, users pass torchax
tensors instead and ``torch_kernels._torchax`` calls the kernels on the JAX arrays directly.
"""

from __future__ import annotations

import torch


def to_jax(t: torch.Tensor):
    import jax.dlpack

    return jax.dlpack.from_dlpack(t.contiguous())


def to_torch(a) -> torch.Tensor:
    return torch.from_dlpack(a)


def pallas_mahalanobis_min(x, center, whitener, class_proj, class_sq):
    if x.device.type != "cpu":
        raise NotImplementedError(f"pallas: takes torchax tensors or CPU tensors, got {x.device.type}")
    from jax_impl import ood

    if x.dtype == torch.float64:
        raise NotImplementedError("pallas: float64 is not supported (TPUs have no float64)")
    score, nearest = ood.mahalanobis_min(*map(to_jax, (x, center, whitener, class_proj, class_sq)))
    return to_torch(score), to_torch(nearest).to(torch.int64)

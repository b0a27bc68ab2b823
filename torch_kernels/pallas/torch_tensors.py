"""Torch tensors to JAX arrays and back, for running jax_impl kernels on ordinary CPU tensors.

Tensors cross by DLPack without copies where both sides allow it. On CPU this is how the tests
and the doctor exercise the Pallas kernels (in interpret mode); on a TPU, users pass torchax
tensors instead and :mod:`torch_kernels.pallas.torchax_tensors` runs the kernels on their arrays.
"""

from __future__ import annotations

import torch

# DLPack has no float8 codes: these cross as uint8 and are bitcast on the JAX side
FLOAT8_JAX_NAMES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def to_jax(t: torch.Tensor):
    """The JAX array of CPU tensor ``t`` (gradients detached; float8 bitcast through uint8)."""
    import jax.dlpack

    t = t.detach()  # DLPack refuses tensors that require grad (inference-only ops see them under no_grad)
    if t.dtype in FLOAT8_JAX_NAMES:
        return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(t.contiguous().view(torch.uint8)),
                                            FLOAT8_JAX_NAMES[t.dtype])
    return jax.dlpack.from_dlpack(t.contiguous())


def to_torch(a) -> torch.Tensor:
    """The torch tensor of JAX array ``a`` (float8 bitcast through uint8)."""
    for dtype, name in FLOAT8_JAX_NAMES.items():
        if a.dtype == name:
            import jax

            return torch.from_dlpack(jax.lax.bitcast_convert_type(a, "uint8")).view(dtype)
    return torch.from_dlpack(a)


def check_cpu(*tensors: torch.Tensor) -> None:
    """Decline tensors on other devices: there, only torchax tensors reach the Pallas kernels."""
    for t in tensors:
        if t.device.type != "cpu":
            raise NotImplementedError(f"pallas: takes torchax tensors or CPU tensors, got {t.device.type}")


def check_no_float64(*tensors: torch.Tensor) -> None:
    """Decline float64 tensors, as the kernels' TPU target must."""
    if any(t.dtype == torch.float64 for t in tensors):
        raise NotImplementedError("pallas: float64 is not supported (TPUs have no float64)")


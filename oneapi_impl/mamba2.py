"""Mamba-2's decode step as a SYCL kernel (``mamba2.cl``): ``selective_state_update``, a
work-item per (batch entry, head, head channel).

Contract: ``torch_kernels.ops.mamba2`` (the backend function) and ``torch_kernels.reference.mamba2``
(the math). One SPIR-V build per x dtype. CPU tensors run on the ``opencl:cpu`` SYCL device
through USM copies: the rows the batch uses are gathered (float32) into one, the kernel updates
them there, and the live ones are copied back into the caller's state. The chunked scan runs
``chunk_simple_gla``'s SYCL kernels.
"""

from __future__ import annotations

import ctypes

import torch

from . import _runtime

SOURCE = "mamba2.cl"
_KINDS = _runtime.FLOAT_KINDS


def _usm(t: torch.Tensor | None, fill: torch.Tensor):
    """A USM copy of ``t`` (contiguous), or of the one-element ``fill`` for an absent input."""
    return _runtime.usm_copy((fill if t is None else t).contiguous())[0]


def selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, softplus, rows):
    """The decode step (see the module docstring); writes the used rows of ``state``."""
    _runtime.require_supported(x)
    batch, heads, headdim = x.shape
    groups, dstate = B.shape[1:]
    out_mem, out = _runtime.usm_empty(tuple(x.shape), x.dtype)
    if out.numel() == 0:
        return out
    lines = torch.arange(batch) if rows is None else rows.long()
    live = lines >= 0
    state_mem, gathered = _runtime.usm_copy(state[lines.clamp(min=0)].float())
    same = B.dtype == x.dtype and C.dtype == x.dtype and (z is None or z.dtype == x.dtype)
    if not same:
        B, C, z = (None if t is None else t.to(x.dtype) for t in (B, C, z))
    none = torch.zeros(1)
    args = [state_mem, _usm(x, x), _usm(dt.float(), none), _usm(A.float(), none), _usm(B, x), _usm(C, x),
            _usm(None if D is None else D.float(), none), _usm(z, x), _usm(None if dt_bias is None else dt_bias.float(), none),
            _usm(live.to(torch.int32), none), out_mem,
            *map(ctypes.c_int, (heads, headdim, dstate, heads // groups, D is not None, z is not None,
                                dt_bias is not None, softplus))]
    kernel = _runtime.kernel(SOURCE, "selective_state_update", X_KIND=_KINDS[x.dtype])
    # SYCL ranges list the slowest dimension first: OpenCL dimension 0 (the head channel) is last
    _runtime.host_queue().submit(kernel, args, [batch, heads, headdim]).wait()
    state[lines[live]] = gathered[live].to(state.dtype)
    return out


def spirv_binaries() -> list[bytes]:
    """The SPIR-V of every x dtype, as an Intel GPU loads it."""
    return [_runtime.spirv(SOURCE, {"X_KIND": kind}) for kind in _KINDS.values()]

"""Causal depthwise conv1d as SYCL kernels (``causal_conv1d.cl``): the convolution, a work-item
per output, and the decode update, a work-item per (batch entry, channel).

Contract: ``torch_kernels.ops.causal_conv1d`` (the backend functions) and
``torch_kernels.reference.causal_conv1d`` (the math). One SPIR-V build per (x dtype, width).
CPU tensors run on the ``opencl:cpu`` SYCL device through USM copies; the update copies back
only the conv_state rows its batch uses.
"""

from __future__ import annotations

import ctypes

import torch

from . import _runtime

SOURCE = "causal_conv1d.cl"
_KINDS = _runtime.FLOAT_KINDS


def _output(x: torch.Tensor):
    """(USM allocation, tensor view) for the output, x's shape and dtype, once x is one the kernels take."""
    _runtime.require_supported(x)
    return _runtime.usm_empty(tuple(x.shape), x.dtype)


def _macros(dtype: torch.dtype, width: int) -> dict[str, int]:
    return {"X_KIND": _KINDS[dtype], "WIDTH": width}


def _usm(t: torch.Tensor | None, fill: torch.Tensor):
    """A USM copy of ``t``, or of the one-element ``fill`` for an absent input."""
    return _runtime.usm_copy((fill if t is None else t).contiguous())[0]


def causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, silu):
    """The convolution (see the module docstring)."""
    batch, dim, length = x.shape
    out_mem, out = _output(x)
    if out.numel() == 0:
        return out
    width = weight.shape[1]
    kernel = _runtime.kernel(SOURCE, "causal_conv1d_fwd", **_macros(x.dtype, width))
    args = [_usm(x, x), _usm(weight.float(), x), _usm(None if bias is None else bias.float(), torch.zeros(1)),
            _usm(seq_idx, torch.zeros(1, dtype=torch.int32)), _usm(initial_states, x.new_zeros(1)), out_mem,
            *map(ctypes.c_int, (dim, length, bias is not None, seq_idx is not None, initial_states is not None, silu))]
    # SYCL ranges list the slowest dimension first: OpenCL dimension 0 (time) is last
    _runtime.host_queue().submit(kernel, args, [batch, dim, length]).wait()
    return out


def causal_conv1d_update(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices):
    """The decode update (see the module docstring); writes the used rows of ``conv_state``."""
    batch, dim, length = x.shape
    out_mem, out = _output(x)
    if out.numel() == 0:
        return out
    width = weight.shape[1]
    state_mem, state = _runtime.usm_copy(conv_state.contiguous())
    kernel = _runtime.kernel(SOURCE, "causal_conv1d_update", **_macros(x.dtype, width))
    none = torch.zeros(1, dtype=torch.int32)
    args = [_usm(x, x), state_mem, _usm(weight.float(), x), _usm(None if bias is None else bias.float(), torch.zeros(1)),
            _usm(cache_seqlens, none), _usm(conv_state_indices, none), out_mem,
            *map(ctypes.c_int, (dim, length, conv_state.shape[2])), *map(ctypes.c_long, state.stride()),
            *map(ctypes.c_int, (bias is not None, cache_seqlens is not None, conv_state_indices is not None, silu))]
    _runtime.host_queue().submit(kernel, args, [batch, dim]).wait()
    rows = torch.arange(batch) if conv_state_indices is None else conv_state_indices.long()
    rows = rows[rows >= 0]
    conv_state[rows] = state[rows]
    return out


def spirv_binaries() -> list[bytes]:
    """The SPIR-V of every x dtype at widths 2, 3 and 4 (what the models use), as an Intel GPU loads it."""
    return [_runtime.spirv(SOURCE, _macros(dtype, width)) for dtype in _KINDS for width in (2, 3, 4)]

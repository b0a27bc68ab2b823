"""The causal_conv1d family on the pallas backend: ``causal_conv1d_fn`` and ``causal_conv1d_update``.

CPU torch tensors: ``pallas_causal_conv1d_fn`` and ``pallas_causal_conv1d_update``, the kernels
``torch_kernels.ops.causal_conv1d`` registers; the update copies the rows it wrote back into
``conv_state``. Torchax tensors: :func:`torchax_implementations`.
"""

from __future__ import annotations

import torch

from ..ops import causal_conv1d as op
from .torch_tensors import check_cpu, check_no_float64, to_jax, to_torch
from .torchax_tensors import first_backend, schema_arguments, torchax_implementation


def _arrays(*tensors):
    return tuple(None if t is None else to_jax(t) for t in tensors)


def pallas_causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, silu):
    check_cpu(x)
    check_no_float64(*(t for t in (x, weight, bias) if t is not None))
    from jax_impl import causal_conv1d

    return to_torch(causal_conv1d.causal_conv1d(*_arrays(x, weight, bias, seq_idx, initial_states), silu))


def pallas_causal_conv1d_update(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices):
    check_cpu(x)
    check_no_float64(*(t for t in (x, weight, bias) if t is not None))
    from jax_impl import causal_conv1d

    out, new_state = causal_conv1d.causal_conv1d_update(*_arrays(x, conv_state, weight, bias), silu,
                                                        *_arrays(cache_seqlens, conv_state_indices))
    rows = torch.arange(x.shape[0]) if conv_state_indices is None else conv_state_indices.long()
    rows = rows[rows >= 0]  # only the rows this batch uses come back: the others stay as they were
    conv_state[rows] = to_torch(new_state)[rows]
    return to_torch(out)


def torchax_implementations() -> dict:
    """Both ops on torchax tensors, by op name: the convolution with gradients (its
    ``jax.custom_vjp``), the update writing ``conv_state`` by pointing its torchax tensor at the
    updated array (a torchax tensor keeps its array in ``_elem``)."""
    from jax_impl import causal_conv1d as kernels
    from torchax.interop import jax_view, torch_view

    run = torchax_implementation(lambda *args: None, pallas=kernels.causal_conv1d,  # checked below
                                 reference=kernels.causal_conv1d_reference)
    updates = {"pallas": kernels.causal_conv1d_update, "reference": kernels.causal_conv1d_update_reference}

    def forward(*args, **kwargs):
        x, weight, bias, seq_idx, initial_states, activation, choice = schema_arguments(op.causal_conv1d_fn_op,
                                                                                         args, kwargs)
        op.check_inputs(x, weight, bias, seq_idx, initial_states, activation)
        return run(x, weight, bias, seq_idx, initial_states, op.check_activation(activation), choice)

    def update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, conv_state_indices=None,
               implementation=None):
        op.check_update_inputs(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)
        op.check_update_values(conv_state, cache_seqlens, conv_state_indices)
        steps = x if x.dim() == 3 else x[..., None]
        out, conv_state._elem = first_backend(implementation, updates)(
            *jax_view((steps, conv_state, weight, bias)), op.check_activation(activation),
            *jax_view((cache_seqlens, conv_state_indices)))
        return torch_view(out).reshape(x.shape)

    return {op.FORWARD_OP: forward, op.UPDATE_OP: update}

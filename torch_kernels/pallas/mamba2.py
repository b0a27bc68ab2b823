"""The mamba2 family on the pallas backend: ``selective_state_update`` on CPU torch tensors
(``pallas_selective_state_update``, which ``torch_kernels.ops.mamba2`` registers), copying the
rows it wrote back into the caller's state. Torchax tensors: :func:`torchax_implementations`.
The chunked scan, a composite, runs ``chunk_simple_gla``'s Pallas kernels on either
(``torch_kernels.pallas.linear_attention``).
"""

from __future__ import annotations

import torch

from ..ops import mamba2 as op
from .torch_tensors import check_cpu, check_no_float64, to_jax, to_torch
from .torchax_tensors import first_backend, schema_arguments


def pallas_selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, softplus, rows):
    check_cpu(x)
    present = [t for t in (state, x, dt, A, B, C, D, z, dt_bias) if t is not None]
    check_no_float64(*present)
    from jax_impl import mamba2

    arrays = [None if t is None else to_jax(t.contiguous()) for t in (state, x, dt, A, B, C, D, z, dt_bias)]
    out, new_state = mamba2.selective_state_update(*arrays, softplus, None if rows is None else to_jax(rows))
    lines = torch.arange(x.shape[0]) if rows is None else rows.long()
    lines = lines[lines >= 0]  # only the rows this batch uses come back: the others stay as they were
    state[lines] = to_torch(new_state)[lines]
    return to_torch(out)


def torchax_implementations() -> dict:
    """The decode step on torchax tensors, by op name: it writes ``state`` by pointing its torchax
    tensor at the updated array (a torchax tensor keeps its array in ``_elem``)."""
    from jax_impl import mamba2 as kernels
    from torchax.interop import jax_view, torch_view

    updates = {"pallas": kernels.selective_state_update, "reference": kernels.selective_state_update_reference}

    def update(*args, **kwargs):
        state, x, dt, A, B, C, D, z, dt_bias, softplus, rows, choice = schema_arguments(
            op.selective_state_update_op, args, kwargs)
        op.check_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, rows)
        op.check_update_values(state, rows)
        out, state._elem = first_backend(choice, updates)(*jax_view((state, x, dt, A, B, C, D, z, dt_bias)),
                                                          bool(softplus), jax_view(rows))
        return torch_view(out)

    return {op.UPDATE_OP: update}

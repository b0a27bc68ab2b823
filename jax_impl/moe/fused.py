"""The experts block as Pallas kernels: gather, gate/up GEMM with the activation, down GEMM,
combine."""

from __future__ import annotations

import jax.numpy as jnp

from ._common import ACTIVATIONS, decline_float64
from .gather_combine import moe_combine, moe_gather
from .grouped_gemm import gmm

def fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets, activation="silu", w13_scale=None,
              w2_scale=None, block_shape=None, *, interpret=None, config=None):
    """``[T, H]`` in x's dtype: the experts block of ``torch_kernels.reference.moe.fused_moe``.

    x ``[T, H]``; w13 ``[E, 2I, H]`` (gate rows then up rows), w2 ``[E, H, I]``, x's dtype or
    float8_e4m3fn with float32 scales per output channel (``[E, 2I]``, ``[E, H]``) or per
    ``block_shape = (bn, bk)`` block; weights float32 ``[T, k]``; routing maps as
    :func:`sort_by_expert` makes them. Its four kernels are jitted one by one (shared between
    layers of equal shapes); wrap the call in ``jax.jit`` to compile it as one program."""
    decline_float64(x, w13)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    num_tokens, hidden = x.shape
    if num_tokens == 0 or hidden == 0:
        return jnp.zeros(x.shape, x.dtype)
    block_shape = None if block_shape is None else tuple(block_shape)
    rows = moe_gather(x, token_of_row, interpret=interpret)
    h = gmm(rows, w13, offsets, w13_scale, out_dtype=x.dtype, transposed=True, parts=2, block_shape=block_shape,
             activation=activation, tail=False, interpret=interpret, config=config)
    y = gmm(h, w2, offsets, w2_scale, out_dtype=jnp.dtype(jnp.float32), transposed=True, block_shape=block_shape,
             tail=False, interpret=interpret, config=config)
    return moe_combine(y, row_of_slot, weights, x.dtype, interpret=interpret)


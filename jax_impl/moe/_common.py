"""What the moe family's JAX kernels share: the grouped GEMMs' tile config, the TPU block rules
(tile sizes, row alignment), dtype handling around Mosaic, the float32 dot and the activations."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from .. import round_up

LANES = 128
ROW_ALIGN = 16  # rows of a block: a multiple of the 16-bit sublane tile
ACTIVATIONS = ("silu", "gelu", "swigluoai")
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0


@dataclasses.dataclass(frozen=True)
class Config:
    """Preferred tiles of the grouped GEMMs (rows, output columns, inner dimension); column and
    inner tiles are power-of-two multiples of 128 (see :func:`lane_tile`)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 512


def decline_float64(*arrays) -> None:
    """NotImplementedError for a float64 array (TPUs have none)."""
    for a in arrays:
        if a is not None and a.dtype == jnp.float64:
            raise NotImplementedError("pallas: float64 is not supported (TPUs have no float64)")


def lane_tile(dim: int, preferred: int) -> int:
    """A block size along a lane-tiled dimension: the whole dimension if it is at most
    ``preferred``, else the largest of preferred, preferred / 2, ..., 128 that divides it, else
    ``preferred`` with a ragged last block (odd sizes; the kernels mask what they must)."""
    if dim <= preferred:
        return dim
    tile = preferred
    while dim % tile and tile > LANES:
        tile //= 2
    return tile if dim % tile == 0 else preferred


def row_block(rows: int, preferred: int) -> int:
    """Rows of a block: ``preferred`` rounded to the row alignment, at most the rows (rounded)."""
    return max(ROW_ALIGN, min(round_up(preferred, ROW_ALIGN), round_up(rows, ROW_ALIGN)))


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints."""
    return -(-a // b)


def pad_to(a, shape, value=0):
    """``a`` padded at the end of each dimension up to ``shape`` with ``value``."""
    widths = [(0, s - d) for d, s in zip(a.shape, shape)]
    return a if all(w == (0, 0) for w in widths) else jnp.pad(a, widths, constant_values=value)


def wide(a):
    """float32 for float16 (Mosaic loads, stores and converts no float16 on any TPU); else ``a``."""
    return a.astype(jnp.float32) if a is not None and a.dtype == jnp.float16 else a


def stored_dtype(dtype):
    """The dtype a kernel stores for a result of ``dtype`` (float16 is narrowed after the kernel)."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


def dot_dtype_of(dtype):
    """The dtype a dot multiplies ``dtype`` operands in: bfloat16 stays, others float32."""
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32


def dot(a, b, contract_b: int):
    """``a @ b`` (contract_b=0) or ``a @ b.T`` (contract_b=1), float32 accumulation."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def sigmoid(x):
    """The logistic function, written out (lowers in Mosaic)."""
    return 1.0 / (1.0 + jnp.exp(-x))


def activate(gate, up, activation: str):
    """float32 ``[.., I]`` from the gate and up halves, as ``reference.activate``."""
    if activation == "silu":
        return gate * sigmoid(gate) * up
    if activation == "gelu":
        return gate * 0.5 * (1.0 + jax.lax.erf(gate * math.sqrt(0.5))) * up
    gate = jnp.minimum(gate, SWIGLUOAI_LIMIT)
    up = jnp.clip(up, -SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
    return (up + 1.0) * gate * sigmoid(SWIGLUOAI_ALPHA * gate)



def no_nan(values):
    """``values`` with NaN as -inf (NaN ranks last)."""
    return jnp.where(values == values, values, -jnp.inf)


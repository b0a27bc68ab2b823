"""Token rows to expert-sorted rows and back: ``moe_gather`` and ``moe_combine``, rows fetched
from HBM by DMA at indices read from SMEM."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import interpret_params, round_up
from ._common import LANES, ROW_ALIGN, cdiv, decline_float64, lane_tile, pad_to, row_block, stored_dtype

ROW_BYTES = 2 << 20  # VMEM bytes of a gather or combine row buffer
COPY_COLS = 8192  # widest row a gather or combine copies whole


def _widen(a):
    """float32 copy of 16-bit rows (see the module docstring); 32-bit arrays as they are."""
    return a if jnp.dtype(a.dtype).itemsize == 4 else a.astype(jnp.float32)


def _copy_tiles(rows: int, cols: int, copies_per_row: int = 1) -> tuple[int, int, int]:
    """(rows per block, column block, padded width) of a float32 row buffer of about ROW_BYTES:
    whole rows up to COPY_COLS wide, else 128-aligned column blocks (an odd width padded then:
    a row copy may not run past the array)."""
    padded = cols if cols <= COPY_COLS else round_up(cols, LANES)
    col_block = cols if cols <= COPY_COLS else lane_tile(padded, 2048)
    preferred = max(ROW_ALIGN, min(256, ROW_BYTES // (4 * col_block * copies_per_row)) // ROW_ALIGN * ROW_ALIGN)
    return row_block(rows, preferred), col_block, padded


def _smem_row_spec(size: int):
    """One grid row's indices in SMEM, from ``[row blocks, 1, size]`` (a rank-1 block would have to
    be a power of two of at least 128)."""
    return pl.BlockSpec((None, 1, size), lambda i, j: (i, 0, 0), memory_space=pltpu.SMEM)


def _columns(ref, num_col_blocks: int, cols: int):
    """This grid column's block of ``ref``'s columns (the whole ref when there is one block: an
    odd width is then never sliced)."""
    if num_col_blocks == 1:
        return ref
    return ref.at[:, pl.ds(pl.multiple_of(pl.program_id(1) * cols, LANES), cols)]


def _gather_kernel(token_smem, token_ref, x_hbm, out_ref, buf, sem, *, num_col_blocks):
    rows, cols = buf.shape
    x_hbm = _columns(x_hbm, num_col_blocks, cols)

    def copy(r):
        return pltpu.make_async_copy(x_hbm.at[pl.ds(token_smem[0, r], 1)], buf.at[pl.ds(r, 1)], sem.at[0])

    def start(r, carry):
        @pl.when(token_smem[0, r] >= 0)
        def _():
            copy(r).start()
        return carry

    def wait(r, carry):
        @pl.when(token_smem[0, r] >= 0)
        def _():
            copy(r).wait()
        return carry

    # every copy in flight at once; each wait consumes one row's bytes (all rows are alike)
    jax.lax.fori_loop(0, rows, start, 0)
    jax.lax.fori_loop(0, rows, wait, 0)
    out_ref[...] = jnp.where(token_ref[...] >= 0, buf[...], 0.0).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def moe_gather(x, token_of_row, *, interpret=None):
    """``[R, H]`` in x's dtype: row r is ``x[token_of_row[r]]``, zero where the token is -1."""
    decline_float64(x)
    (num_tokens, hidden), num_rows = x.shape, token_of_row.shape[0]
    if num_rows == 0 or num_tokens == 0 or hidden == 0:
        return jnp.zeros((num_rows, hidden), x.dtype)
    rows, cols, padded_cols = _copy_tiles(num_rows, hidden)
    row_blocks = cdiv(num_rows, rows)
    tokens = pad_to(token_of_row.astype(jnp.int32), (row_blocks * rows,), -1)  # SMEM reads stay in bounds
    out = pl.pallas_call(
        functools.partial(_gather_kernel, num_col_blocks=padded_cols // cols),
        grid=(row_blocks, padded_cols // cols),
        in_specs=[_smem_row_spec(rows),
                  pl.BlockSpec((rows, 1), lambda i, j: (i, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((rows, cols), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((num_rows, padded_cols), stored_dtype(x.dtype)),
        scratch_shapes=[pltpu.VMEM((rows, cols), jnp.float32), pltpu.SemaphoreType.DMA((1,))],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret_params(interpret),
    )(tokens.reshape(-1, 1, rows), tokens[:, None], pad_to(_widen(x), (num_tokens, padded_cols)))
    return out[:, :hidden].astype(x.dtype)


def _combine_kernel(row_smem, row_ref, weight_ref, y_hbm, out_ref, buf, sem, *, num_col_blocks):
    top_k, rows, cols = buf.shape
    y_hbm = _columns(y_hbm, num_col_blocks, cols)

    def copy(slot):
        t, j = jax.lax.div(slot, top_k), jax.lax.rem(slot, top_k)
        return pltpu.make_async_copy(y_hbm.at[pl.ds(row_smem[0, slot], 1)], buf.at[j, pl.ds(t, 1)], sem.at[0])

    def start(slot, carry):
        @pl.when(row_smem[0, slot] >= 0)  # a dropped slot's row is never read
        def _():
            copy(slot).start()
        return carry

    def wait(slot, carry):
        @pl.when(row_smem[0, slot] >= 0)
        def _():
            copy(slot).wait()
        return carry

    jax.lax.fori_loop(0, rows * top_k, start, 0)
    jax.lax.fori_loop(0, rows * top_k, wait, 0)
    acc = jnp.zeros((rows, cols), jnp.float32)
    for j in range(top_k):  # slot order: deterministic, as the reference sums
        used = row_ref[:, j:j + 1] >= 0
        acc = acc + jnp.where(used, buf[j] * weight_ref[:, j:j + 1], 0.0)
    out_ref[...] = acc.astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def moe_combine(y, row_of_slot, weights, out_dtype=None, *, interpret=None):
    """``[T, N]``: ``out[t] = sum_j weights[t, j] * y[row_of_slot[t, j]]`` in float32, in slot
    order, slots whose row is -1 skipped; ``out_dtype`` defaults to y's."""
    decline_float64(y)
    out_dtype = jnp.dtype(out_dtype or y.dtype)
    (num_rows, cols_in), (num_tokens, top_k) = y.shape, row_of_slot.shape
    if num_tokens == 0 or num_rows == 0 or cols_in == 0:
        return jnp.zeros((num_tokens, cols_in), out_dtype)
    rows, cols, padded_cols = _copy_tiles(num_tokens, cols_in, top_k)
    padded = cdiv(num_tokens, rows) * rows
    slots = pad_to(row_of_slot.astype(jnp.int32), (padded, top_k), -1)  # SMEM reads stay in bounds
    out = pl.pallas_call(
        functools.partial(_combine_kernel, num_col_blocks=padded_cols // cols),
        grid=(padded // rows, padded_cols // cols),
        in_specs=[_smem_row_spec(rows * top_k),
                  pl.BlockSpec((rows, top_k), lambda i, j: (i, 0)),
                  pl.BlockSpec((rows, top_k), lambda i, j: (i, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((rows, cols), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((num_tokens, padded_cols), stored_dtype(out_dtype)),
        scratch_shapes=[pltpu.VMEM((top_k, rows, cols), jnp.float32), pltpu.SemaphoreType.DMA((1,))],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret_params(interpret),
    )(slots.reshape(-1, 1, rows * top_k), slots, pad_to(weights.astype(jnp.float32), (padded, top_k)),
      pad_to(_widen(y), (num_rows, padded_cols)))
    return out[:, :cols_in].astype(out_dtype)


"""Grouped GEMMs over expert-sorted rows: ``grouped_mm`` (and the fused block's two GEMMs, with
its activation in the epilogue) and the transposed form ``grouped_mm_weight_grad``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import interpret_params
from ._common import (
    LANES, Config, activate, cdiv, decline_float64, dot, dot_dtype_of, lane_tile, row_block, stored_dtype, wide,
)

def _group_schedule(ends, num_rows: int, block_m: int, *, tail: bool, visit_empty: bool):
    """Per grid step its group and row tile, plus each group's row range and the step count.

    Groups are the experts (rows ``ends[e-1]:ends[e]``) and, with ``tail``, the rows past the last
    expert. A group's steps are its row tiles in order; a tile shared by consecutive groups comes
    once per group. With ``visit_empty`` an empty group gets one step (at a valid tile)."""
    ends = ends.astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    if tail:
        starts = jnp.append(starts, ends[-1])
        ends = jnp.append(ends, jnp.int32(num_rows))
    num_groups, num_tiles = ends.shape[0], num_rows // block_m
    sizes = ends - starts
    first = jnp.minimum(starts // block_m, num_tiles - 1)
    visits = jnp.where(sizes > 0, (ends - 1) // block_m - first + 1, 1 if visit_empty else 0)
    done = jnp.cumsum(visits)  # steps up to and including each group
    step = jnp.arange(num_tiles + num_groups, dtype=jnp.int32)  # an upper bound on the steps
    group = jnp.minimum(jnp.searchsorted(done, step, side="right"), num_groups - 1).astype(jnp.int32)
    tile = jnp.clip(first[group] + step - (done - visits)[group], 0, num_tiles - 1)
    return group, tile, starts, ends, done[-1:]


def _scale_row(scale_ref, ch0, b, width: int, bn: int):
    """(1, width) float32: block scales ``scale[ch // bn, b]`` of channels ``ch0 .. ch0 + width``."""
    channel = ch0 + jax.lax.broadcasted_iota(jnp.int32, (1, width), 1)
    last = jnp.minimum(jax.lax.div(ch0 + width - 1, bn), scale_ref.shape[0] - 1)

    def fill(a, row):
        inside = (channel >= a * bn) & (channel < (a + 1) * bn)
        return jnp.where(inside, scale_ref[a, b], row)

    return jax.lax.fori_loop(jax.lax.div(ch0, bn), last + 1, fill, jnp.zeros((1, width), jnp.float32))


def _load_inner(ref, k0, ragged_k, axis: int, dtype):
    """``ref``'s tile in ``dtype``; with ``ragged_k`` (the true K) the columns past it, which a
    ragged last K block fills with whatever VMEM held (NaN included), are zeroed."""
    tile = ref[...].astype(dtype)
    if ragged_k is None:
        return tile
    column = k0 + jax.lax.broadcasted_iota(jnp.int32, tile.shape, axis)
    return jnp.where(column < ragged_k, tile, jnp.zeros_like(tile))


def _add_block_scaled(acc_ref, x_ref, w_ref, scale_ref, block_shape, ch0, k0, dot_dtype, ragged_k):
    """``acc += x @ (w * scale).T`` for a ``[bn, bk]`` block-scaled tile whose first output channel
    is ``ch0`` and first inner column ``k0``: one product per K block the tile covers, scaled by
    the (1, block_n) row of its blocks' scales, so no dequantized weight is ever rounded."""
    (bn, bk), block_k, block_n = block_shape, x_ref.shape[1], w_ref.shape[0]
    first_b = jax.lax.div(k0, bk)
    if block_k % bk == 0 and bk % LANES == 0 and ragged_k is None:  # whole K blocks: static aligned slices
        for j in range(block_k // bk):
            # sliced as they load (slicing loaded tiles crashed v6e's compiler in libtpu 0.0.42)
            columns = slice(j * bk, (j + 1) * bk)
            part = dot(x_ref[:, columns].astype(dot_dtype), w_ref[:, columns].astype(dot_dtype), 1)
            acc_ref[...] += part * _scale_row(scale_ref, ch0, first_b + j, block_n, bn)
        return
    x = _load_inner(x_ref, k0, ragged_k, 1, dot_dtype)
    w = _load_inner(w_ref, k0, ragged_k, 1, dot_dtype)
    if bk % block_k == 0:  # the tile lies in one K block
        acc_ref[...] += dot(x, w, 1) * _scale_row(scale_ref, ch0, first_b, block_n, bn)
    else:  # misaligned (odd sizes): the columns of each K block in turn, the others masked
        column = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)

        def k_block(b, carry):
            inside = (column >= b * bk) & (column < (b + 1) * bk)
            acc_ref[...] += dot(jnp.where(inside, x, 0), w, 1) * _scale_row(scale_ref, ch0, b, block_n, bn)
            return carry

        last_b = jnp.minimum(jax.lax.div(k0 + block_k - 1, bk), scale_ref.shape[1] - 1)
        jax.lax.fori_loop(first_b, last_b + 1, k_block, 0)


def _gmm_kernel(group_ref, tile_ref, start_ref, end_ref, steps_ref, x_ref, *refs, parts, num_experts, transposed,
                scale_kind, block_shape, half_rows, dot_dtype, activation, ragged_k):
    w_refs, refs = refs[:parts], refs[parts:]
    scale_refs = ()
    if scale_kind == "channel":
        scale_refs, refs = refs[:parts], refs[parts:]
    elif scale_kind == "block":
        scale_refs, refs = refs[:1], refs[1:]
    out_ref, acc_ref = refs
    block_m, block_n = out_ref.shape
    block_k = x_ref.shape[1]
    n, s, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group = group_ref[s]
    real_step = s < steps_ref[0]

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(real_step & (group < num_experts))
    def _():
        k0 = k * block_k
        if scale_kind == "block":
            for p in range(parts):
                _add_block_scaled(acc_ref.at[p], x_ref, w_refs[p], scale_refs[0], block_shape,
                                  p * half_rows + n * block_n, k0, dot_dtype, ragged_k)
            return
        x = _load_inner(x_ref, k0, ragged_k, 1, dot_dtype)
        for p in range(parts):  # float8 entries are exact in bfloat16 and float32
            w = _load_inner(w_refs[p], k0, ragged_k, 1 if transposed else 0, dot_dtype)
            acc_ref[p] += dot(x, w, 1 if transposed else 0)

    @pl.when(real_step & (k == pl.num_programs(2) - 1))
    def _():
        values = [acc_ref[p] * (scale_refs[p][...] if scale_kind == "channel" else 1.0) for p in range(parts)]
        value = values[0] if parts == 1 else activate(values[0], values[1], activation)
        rows = tile_ref[s] * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
        mine = (rows >= start_ref[group]) & (rows < end_ref[group])
        value = jnp.where(group < num_experts, value, 0.0)  # rows past the last expert
        out_ref[...] = jnp.where(mine, value.astype(out_ref.dtype), out_ref[...])


@functools.partial(jax.jit, static_argnames=("out_dtype", "transposed", "parts", "block_shape", "activation", "tail",
                                             "interpret", "config"))
def gmm(x, w, ends, scale=None, *, out_dtype, transposed, parts=1, block_shape=None, activation=None, tail=True,
        interpret=None, config=None):
    """Grouped GEMM over ``w [E, P * N, K]`` (transposed) or ``[E, K, N]`` (P = 1); two parts are
    the gate and up rows, joined by ``activation``. ``scale``: per channel ``[E, P * N]``, or per
    ``block_shape`` block ``[E, nb, kb]``. Returns ``[M, N]`` in ``out_dtype``."""
    config = config or Config()
    num_rows, k_dim = x.shape
    num_experts = w.shape[0]
    n_dim = w.shape[1] // parts if transposed else w.shape[2]
    half_rows = n_dim  # where the up rows start, for block scales
    w = w.reshape(num_experts, parts, n_dim, k_dim) if transposed else w[:, None]
    block_m = row_block(num_rows, config.block_m)
    block_n = lane_tile(n_dim, config.block_n)
    preferred_k = config.block_k
    if block_shape is not None and block_shape[1] % LANES == 0:  # K tiles of whole scale blocks, or within one
        while preferred_k > LANES and preferred_k % block_shape[1] and block_shape[1] % preferred_k:
            preferred_k //= 2
    block_k = lane_tile(k_dim, preferred_k)

    # ragged last blocks: rows and columns past the arrays are computed, then dropped on store
    group, tile, starts, ends, steps = _group_schedule(ends, cdiv(num_rows, block_m) * block_m, block_m,
                                                       tail=tail, visit_empty=False)
    x, w = wide(x), wide(w)

    def expert(g):
        return jnp.minimum(g, num_experts - 1)  # the tail group's steps read any expert's blocks

    def weight_spec(p):
        if transposed:
            return pl.BlockSpec((None, None, block_n, block_k),
                                lambda n, s, k, g, *_: (expert(g[s]), p, n, k))
        return pl.BlockSpec((None, None, block_k, block_n), lambda n, s, k, g, *_: (expert(g[s]), p, k, n))

    in_specs = [pl.BlockSpec((block_m, block_k), lambda n, s, k, g, t, *_: (t[s], k))]
    in_specs += [weight_spec(p) for p in range(parts)]
    operands = [x] + [w] * parts
    scale_kind = None
    if scale is not None and block_shape is None:
        scale_kind = "channel"
        scale = scale.astype(jnp.float32).reshape(num_experts, parts, 1, n_dim)
        in_specs += [pl.BlockSpec((None, None, 1, block_n), lambda n, s, k, g, *_, p=p: (expert(g[s]), p, 0, n))
                     for p in range(parts)]
        operands += [scale] * parts
    elif scale is not None:
        scale_kind = "block"
        in_specs.append(pl.BlockSpec((None,) + scale.shape[1:], lambda n, s, k, g, *_: (expert(g[s]), 0, 0),
                                     memory_space=pltpu.SMEM))
        operands.append(scale.astype(jnp.float32))

    kernel = functools.partial(
        _gmm_kernel, parts=parts, num_experts=num_experts, transposed=transposed, scale_kind=scale_kind,
        block_shape=block_shape, half_rows=half_rows, dot_dtype=dot_dtype_of(x.dtype), activation=activation,
        ragged_k=k_dim if k_dim % block_k else None)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(cdiv(n_dim, block_n), jnp.maximum(steps[0], 1), cdiv(k_dim, block_k)),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((block_m, block_n), lambda n, s, k, g, t, *_: (t[s], n)),
            scratch_shapes=[pltpu.VMEM((parts, block_m, block_n), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((num_rows, n_dim), stored_dtype(out_dtype)),
        # consecutive steps may share an output tile: only the column axis is split across cores
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret_params(interpret),
    )(group, tile, starts, ends, steps, *operands)
    return out.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "w_transposed", "interpret", "config"))
def grouped_mm(x, w, offsets, out_dtype=None, w_transposed=False, *, interpret=None, config=None):
    """``[M, N]``: rows ``offsets[e-1]:offsets[e]`` of ``x [M, K]`` times expert e's ``[K, N]``
    matrix (``w [E, K, N]``, or ``[E, N, K]`` when ``w_transposed``); rows past ``offsets[-1]``
    zero; float32 accumulation."""
    decline_float64(x, w)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    num_rows, n_dim = x.shape[0], w.shape[1] if w_transposed else w.shape[2]
    if num_rows == 0 or n_dim == 0:
        return jnp.zeros((num_rows, n_dim), out_dtype)
    if x.shape[1] == 0:
        return jnp.zeros((num_rows, n_dim), out_dtype)
    return gmm(x, w, offsets, out_dtype=out_dtype, transposed=w_transposed, interpret=interpret, config=config)


def _tgmm_kernel(group_ref, tile_ref, start_ref, end_ref, steps_ref, x_ref, dy_ref, out_ref, acc_ref, *,
                 dot_dtype):
    s, last = pl.program_id(2), steps_ref[0] - 1
    group = group_ref[s]
    block_m = x_ref.shape[0]

    @pl.when((s == 0) | (group_ref[jnp.maximum(s - 1, 0)] != group))
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(end_ref[group] > start_ref[group])
    def _():
        rows = tile_ref[s] * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
        mine = (rows >= start_ref[group]) & (rows < end_ref[group])
        # both sides masked: another expert's rows may hold inf, and 0 * inf is NaN
        x = jnp.where(mine, x_ref[...].astype(jnp.float32), 0.0)
        dy = jnp.where(mine, dy_ref[...].astype(jnp.float32), 0.0)
        acc_ref[...] += dot(x.T.astype(dot_dtype), dy.astype(dot_dtype), 0)

    @pl.when((s == last) | (group_ref[jnp.minimum(s + 1, last)] != group))
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("num_experts", "out_dtype", "interpret", "config"))
def grouped_mm_weight_grad(x, dy, offsets, num_experts, out_dtype=None, *, interpret=None, config=None):
    """``[E, K, N]``: ``x_e^T dy_e`` for each expert's rows ``offsets[e-1]:offsets[e]`` of
    ``x [M, K]`` and ``dy [M, N]``, float32 accumulation; zero for an expert with no rows."""
    decline_float64(x, dy)
    config = config or Config()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    (num_rows, k_dim), n_dim = x.shape, dy.shape[1]
    if num_rows == 0 or k_dim == 0 or n_dim == 0 or num_experts == 0:
        return jnp.zeros((num_experts, k_dim, n_dim), out_dtype)
    block_m = row_block(num_rows, config.block_m)
    block_k, block_n = lane_tile(k_dim, config.block_n), lane_tile(n_dim, config.block_n)
    # ragged last blocks: rows past the array belong to no expert (masked); columns past it are
    # computed into rows and columns of out that are dropped on store
    group, tile, starts, ends, steps = _group_schedule(offsets, cdiv(num_rows, block_m) * block_m, block_m,
                                                       tail=False, visit_empty=True)
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, dot_dtype=dot_dtype_of(x.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(cdiv(k_dim, block_k), cdiv(n_dim, block_n), steps[0]),
            in_specs=[pl.BlockSpec((block_m, block_k), lambda i, j, s, g, t, *_: (t[s], i)),
                      pl.BlockSpec((block_m, block_n), lambda i, j, s, g, t, *_: (t[s], j))],
            out_specs=pl.BlockSpec((None, block_k, block_n), lambda i, j, s, g, *_: (g[s], i, j)),
            scratch_shapes=[pltpu.VMEM((block_k, block_n), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((num_experts, k_dim, n_dim), stored_dtype(out_dtype)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret_params(interpret),
    )(group, tile, starts, ends, steps, wide(x), wide(dy))
    return out.astype(out_dtype)


"""Mixture of experts as Pallas TPU kernels: routing, row gather, grouped GEMMs, combine, the fused layer.

Every piece is a Pallas kernel; plain jnp only builds metadata (the group schedule, the routing
maps of :func:`sort_by_expert`), widens float16 and pads index arrays around the kernels.

- ``router_topk``: one grid step per block of tokens holds all E scores: softmax or sigmoid,
  the group limit (top-2 sum per group, ``topk_groups`` rounds of argmax over groups), then
  ``top_k`` rounds of argmax, weights from the unbiased scores. The choice rule is
  ``reference.router_topk``'s: by the logits, or by ``scores + bias`` with a bias; NaN ranks as
  -inf; equal values go to the lowest index; a row with a NaN logit gets NaN weights.
- ``moe_gather`` / ``moe_combine``: rows fetched from HBM by DMA at indices read from SMEM.
  16-bit rows are widened to float32 before the kernel, so that every row copy moves whole
  32-bit sublanes (a single 16-bit row is half of a packed sublane). The combine adds a token's
  slots in slot order in float32 (deterministic) and never uses a dropped slot's row.
- ``grouped_mm`` and the GEMMs of ``fused_moe``: megablox's grouped matmul idea. Rows are sorted
  by expert; the grid walks (column tile, step, inner tile), and a step is one (expert, row tile)
  pair from a schedule in scalar prefetch: a row tile shared by two experts is visited once per
  expert, consecutively, each visit storing only its rows, so the output block stays in VMEM
  across them. Rows past the last expert form one more group whose steps store zeros. The
  step count is the grid's dynamic extent.
- ``grouped_mm_weight_grad``: the transposed form (tgmm): the grid walks (K tile, N tile,
  step); an expert's steps accumulate ``x_e^T dy_e`` in VMEM and its last step stores it; an
  empty expert gets one step that stores zeros.
- ``fused_moe``: gather -> grouped GEMM with w13 as two operands (gate rows, up rows) and the
  activation in its epilogue, h stored in x's dtype -> grouped GEMM with w2 storing float32 ->
  combine, which applies the routing weights. float8_e4m3fn weights are cast in VMEM (exact in
  bfloat16 and float32); per-channel scales multiply the float32 accumulator in the epilogue;
  ``[bn, bk]`` block scales (read from SMEM) scale each inner tile's partial product per
  K block, so dequantized weights are never rounded.

Tiles obey the TPU block rules: a dimension up to the preferred tile is one full-dimension
block; a larger one is tiled by a power-of-two multiple of 128, the largest up to the preferred
that divides it, else the preferred with a ragged last block whose extra columns the GEMMs mask
in K (rows and output columns past an array are dropped on store): no weight is ever copied.
Mosaic has no float16 on any TPU generation: float16 operands are widened to float32 before a
kernel and results narrowed after (in ``fused_moe`` h is rounded to float16 between the GEMMs).
bfloat16 multiplies in bfloat16, float16 and float32 in float32 (HIGHEST precision);
accumulation is always float32. float64 is declined (NotImplementedError).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import interpret_params, round_up

LANES = 128
ROW_ALIGN = 16  # rows of a block: a multiple of the 16-bit sublane tile
ROW_BYTES = 2 << 20  # VMEM bytes of a gather or combine row buffer
COPY_COLS = 8192  # widest row a gather or combine copies whole
ACTIVATIONS = ("silu", "gelu", "swigluoai")
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0


@dataclasses.dataclass(frozen=True)
class Config:
    """Preferred tiles of the grouped GEMMs (rows, output columns, inner dimension); column and
    inner tiles are power-of-two multiples of 128 (see :func:`_tile`)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 512


def _decline_float64(*arrays) -> None:
    for a in arrays:
        if a is not None and a.dtype == jnp.float64:
            raise NotImplementedError("pallas: float64 is not supported (TPUs have no float64)")


def _tile(dim: int, preferred: int) -> int:
    """A block size along a lane-tiled dimension: the whole dimension if it is at most
    ``preferred``, else the largest of preferred, preferred / 2, ..., 128 that divides it, else
    ``preferred`` with a ragged last block (odd sizes; the kernels mask what they must)."""
    if dim <= preferred:
        return dim
    tile = preferred
    while dim % tile and tile > LANES:
        tile //= 2
    return tile if dim % tile == 0 else preferred


def _row_block(rows: int, preferred: int) -> int:
    return max(ROW_ALIGN, min(round_up(preferred, ROW_ALIGN), round_up(rows, ROW_ALIGN)))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to(a, shape, value=0):
    widths = [(0, s - d) for d, s in zip(a.shape, shape)]
    return a if all(w == (0, 0) for w in widths) else jnp.pad(a, widths, constant_values=value)


def _wide(a):
    """float32 for float16 (Mosaic loads, stores and converts no float16 on any TPU); else ``a``."""
    return a.astype(jnp.float32) if a is not None and a.dtype == jnp.float16 else a


def _stored(dtype):
    """The dtype a kernel stores for a result of ``dtype`` (float16 is narrowed after the kernel)."""
    return jnp.dtype(jnp.float32) if jnp.dtype(dtype) == jnp.float16 else jnp.dtype(dtype)


def _dot_dtype(dtype):
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32


def _dot(a, b, contract_b: int):
    """``a @ b`` (contract_b=0) or ``a @ b.T`` (contract_b=1), float32 accumulation."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _sigmoid(x):
    return 1.0 / (1.0 + jnp.exp(-x))


def _activate(gate, up, activation: str):
    """float32 ``[.., I]`` from the gate and up halves, as ``reference.activate``."""
    if activation == "silu":
        return gate * _sigmoid(gate) * up
    if activation == "gelu":
        return gate * 0.5 * (1.0 + jax.lax.erf(gate * math.sqrt(0.5))) * up
    gate = jnp.minimum(gate, SWIGLUOAI_LIMIT)
    up = jnp.clip(up, -SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
    return (up + 1.0) * gate * _sigmoid(SWIGLUOAI_ALPHA * gate)


# ---- routing ----

def _no_nan(values):
    return jnp.where(values == values, values, -jnp.inf)


_CLOSED = -2 ** 31  # the key of an expert or group out of the running: below every _order_key


def _order_key(x):
    """int32 keys in the order of float32 ``x``, NaN as -inf and -0.0 as 0.0; all above ``_CLOSED``."""
    bits = jax.lax.bitcast_convert_type(_no_nan(x), jnp.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits reversed
    return jnp.where(key == -1, 0, key)  # -0.0


def _router_kernel(logits_ref, bias_ref, weights_ref, ids_ref, *, top_k, scoring, renormalize, num_groups,
                   topk_groups, has_bias, scaling):
    logits = logits_ref[...].astype(jnp.float32)
    rows, num_experts = logits.shape
    lane = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    if scoring == "softmax":  # a NaN logit makes the whole row NaN
        exp = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
        scores = exp / jnp.sum(exp, axis=1, keepdims=True)
    else:
        scores = _sigmoid(logits)
    biased = scores + bias_ref[...]

    def first_max(keys, positions, none):
        """Per row: the first position holding the largest key."""
        best = jnp.max(keys, axis=1, keepdims=True)
        return jnp.min(jnp.where(keys == best, positions, none), axis=1, keepdims=True)

    allowed = None
    if num_groups is not None:
        biased = _no_nan(biased)
        size = num_experts // num_groups
        members = [(lane >= g * size) & (lane < (g + 1) * size) for g in range(num_groups)]
        group_lane = jax.lax.broadcasted_iota(jnp.int32, (rows, num_groups), 1)
        group_scores = jnp.zeros((rows, num_groups), jnp.float32)
        for g, inside in enumerate(members):  # the sum of the group's two best biased scores
            values = jnp.where(inside, biased, -jnp.inf)
            best = jnp.max(values, axis=1, keepdims=True)
            if size > 1:
                at = jnp.min(jnp.where(values == best, lane, num_experts), axis=1, keepdims=True)
                best = best + jnp.max(jnp.where(lane == at, -jnp.inf, values), axis=1, keepdims=True)
            group_scores = jnp.where(group_lane == g, best, group_scores)
        group_keys = _order_key(group_scores)
        kept = jnp.zeros((rows, num_groups), jnp.bool_)
        for _ in range(topk_groups):
            at = first_max(group_keys, group_lane, num_groups)
            kept = kept | (group_lane == at)
            group_keys = jnp.where(group_lane == at, _CLOSED, group_keys)
        allowed = jnp.zeros(logits.shape, jnp.bool_)
        for g, inside in enumerate(members):
            allowed = allowed | (inside & kept[:, g:g + 1])
    # ranked by the biased scores with a bias, else by the logits (the scores' order, without the
    # ties of probabilities that underflowed or rounded alike)
    choice = _order_key(biased if has_bias else logits)
    if allowed is not None:
        choice = jnp.where(allowed, choice, _CLOSED)

    slot = jax.lax.broadcasted_iota(jnp.int32, (rows, top_k), 1)
    ids = jnp.zeros((rows, top_k), jnp.int32)
    weights = jnp.zeros((rows, top_k), jnp.float32)
    for j in range(top_k):  # best first
        at = first_max(choice, lane, num_experts)
        picked = jnp.sum(jnp.where(lane == at, scores, 0.0), axis=1, keepdims=True)
        ids = jnp.where(slot == j, at, ids)
        weights = jnp.where(slot == j, picked, weights)
        choice = jnp.where(lane == at, _CLOSED, choice)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=1, keepdims=True)
    if scoring == "sigmoid":  # a NaN logit makes its row NaN here too
        weights = jnp.where(jnp.max(jnp.where(scores == scores, 0.0, 1.0), axis=1, keepdims=True) > 0, jnp.nan,
                            weights)
    weights_ref[...] = weights * scaling
    ids_ref[...] = ids


@functools.partial(jax.jit, static_argnames=("top_k", "scoring", "renormalize", "num_expert_groups", "topk_groups",
                                             "routed_scaling_factor", "interpret", "block_tokens"))
def router_topk(logits, top_k, scoring="softmax", renormalize=True, num_expert_groups=None, topk_groups=None,
                correction_bias=None, routed_scaling_factor=1.0, *, interpret=None, block_tokens=128):
    """``(weights float32 [T, k], ids int32 [T, k])`` for router ``logits [T, E]``: the contract of
    ``torch_kernels.reference.moe.router_topk`` (inputs assumed checked)."""
    _decline_float64(logits, correction_bias)
    num_tokens, num_experts = logits.shape
    if num_tokens == 0:
        return jnp.zeros((0, top_k), jnp.float32), jnp.zeros((0, top_k), jnp.int32)
    rows = _row_block(num_tokens, block_tokens)
    bias = (jnp.zeros((1, num_experts), jnp.float32) if correction_bias is None
            else correction_bias.astype(jnp.float32).reshape(1, num_experts))
    weights, ids = pl.pallas_call(
        functools.partial(_router_kernel, top_k=top_k, scoring=scoring, renormalize=renormalize,
                          num_groups=num_expert_groups, topk_groups=topk_groups,
                          has_bias=correction_bias is not None, scaling=float(routed_scaling_factor)),
        grid=(_cdiv(num_tokens, rows),),
        in_specs=[pl.BlockSpec((rows, num_experts), lambda i: (i, 0)),
                  pl.BlockSpec((1, num_experts), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((rows, top_k), lambda i: (i, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((num_tokens, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret_params(interpret),
    )(_wide(logits), bias)  # a ragged last block's extra rows are computed and dropped
    return weights, ids


@functools.partial(jax.jit, static_argnames=("num_experts",))
def sort_by_expert(topk_ids, num_experts):
    """``(token_of_row [T*k], row_of_slot [T, k], offsets [E])`` int32, as
    ``torch_kernels.reference.moe.sort_by_expert`` makes them (slots sorted by expert, stably;
    dropped slots, id -1, past ``offsets[-1]`` with token and row -1)."""
    num_tokens, k = topk_ids.shape
    ids = topk_ids.reshape(-1).astype(jnp.int32)
    dropped = ids < 0
    key = jnp.where(dropped, num_experts, ids)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    offsets = jnp.cumsum(jnp.bincount(key, length=num_experts + 1)[:num_experts]).astype(jnp.int32)
    token_of_row = jnp.where(dropped[order], -1, order // k)
    row_of_slot = jnp.zeros_like(order).at[order].set(jnp.arange(num_tokens * k, dtype=jnp.int32))
    return token_of_row, jnp.where(dropped, -1, row_of_slot).reshape(num_tokens, k), offsets


# ---- gather and combine: rows by DMA ----

def _widen(a):
    """float32 copy of 16-bit rows (see the module docstring); 32-bit arrays as they are."""
    return a if jnp.dtype(a.dtype).itemsize == 4 else a.astype(jnp.float32)


def _copy_tiles(rows: int, cols: int, copies_per_row: int = 1) -> tuple[int, int, int]:
    """(rows per block, column block, padded width) of a float32 row buffer of about ROW_BYTES:
    whole rows up to COPY_COLS wide, else 128-aligned column blocks (an odd width padded then:
    a row copy may not run past the array)."""
    padded = cols if cols <= COPY_COLS else round_up(cols, LANES)
    col_block = cols if cols <= COPY_COLS else _tile(padded, 2048)
    preferred = max(ROW_ALIGN, min(256, ROW_BYTES // (4 * col_block * copies_per_row)) // ROW_ALIGN * ROW_ALIGN)
    return _row_block(rows, preferred), col_block, padded


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
    _decline_float64(x)
    (num_tokens, hidden), num_rows = x.shape, token_of_row.shape[0]
    if num_rows == 0 or num_tokens == 0 or hidden == 0:
        return jnp.zeros((num_rows, hidden), x.dtype)
    rows, cols, padded_cols = _copy_tiles(num_rows, hidden)
    row_blocks = _cdiv(num_rows, rows)
    tokens = _pad_to(token_of_row.astype(jnp.int32), (row_blocks * rows,), -1)  # SMEM reads stay in bounds
    out = pl.pallas_call(
        functools.partial(_gather_kernel, num_col_blocks=padded_cols // cols),
        grid=(row_blocks, padded_cols // cols),
        in_specs=[_smem_row_spec(rows),
                  pl.BlockSpec((rows, 1), lambda i, j: (i, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((rows, cols), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((num_rows, padded_cols), _stored(x.dtype)),
        scratch_shapes=[pltpu.VMEM((rows, cols), jnp.float32), pltpu.SemaphoreType.DMA((1,))],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret_params(interpret),
    )(tokens.reshape(-1, 1, rows), tokens[:, None], _pad_to(_widen(x), (num_tokens, padded_cols)))
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
    _decline_float64(y)
    out_dtype = jnp.dtype(out_dtype or y.dtype)
    (num_rows, cols_in), (num_tokens, top_k) = y.shape, row_of_slot.shape
    if num_tokens == 0 or num_rows == 0 or cols_in == 0:
        return jnp.zeros((num_tokens, cols_in), out_dtype)
    rows, cols, padded_cols = _copy_tiles(num_tokens, cols_in, top_k)
    padded = _cdiv(num_tokens, rows) * rows
    slots = _pad_to(row_of_slot.astype(jnp.int32), (padded, top_k), -1)  # SMEM reads stay in bounds
    out = pl.pallas_call(
        functools.partial(_combine_kernel, num_col_blocks=padded_cols // cols),
        grid=(padded // rows, padded_cols // cols),
        in_specs=[_smem_row_spec(rows * top_k),
                  pl.BlockSpec((rows, top_k), lambda i, j: (i, 0)),
                  pl.BlockSpec((rows, top_k), lambda i, j: (i, 0)),
                  pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((rows, cols), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((num_tokens, padded_cols), _stored(out_dtype)),
        scratch_shapes=[pltpu.VMEM((top_k, rows, cols), jnp.float32), pltpu.SemaphoreType.DMA((1,))],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret_params(interpret),
    )(slots.reshape(-1, 1, rows * top_k), slots, _pad_to(weights.astype(jnp.float32), (padded, top_k)),
      _pad_to(_widen(y), (num_rows, padded_cols)))
    return out[:, :cols_in].astype(out_dtype)


# ---- grouped GEMMs ----

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
            part = _dot(x_ref[:, columns].astype(dot_dtype), w_ref[:, columns].astype(dot_dtype), 1)
            acc_ref[...] += part * _scale_row(scale_ref, ch0, first_b + j, block_n, bn)
        return
    x = _load_inner(x_ref, k0, ragged_k, 1, dot_dtype)
    w = _load_inner(w_ref, k0, ragged_k, 1, dot_dtype)
    if bk % block_k == 0:  # the tile lies in one K block
        acc_ref[...] += _dot(x, w, 1) * _scale_row(scale_ref, ch0, first_b, block_n, bn)
    else:  # misaligned (odd sizes): the columns of each K block in turn, the others masked
        column = k0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)

        def k_block(b, carry):
            inside = (column >= b * bk) & (column < (b + 1) * bk)
            acc_ref[...] += _dot(jnp.where(inside, x, 0), w, 1) * _scale_row(scale_ref, ch0, b, block_n, bn)
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
            acc_ref[p] += _dot(x, w, 1 if transposed else 0)

    @pl.when(real_step & (k == pl.num_programs(2) - 1))
    def _():
        values = [acc_ref[p] * (scale_refs[p][...] if scale_kind == "channel" else 1.0) for p in range(parts)]
        value = values[0] if parts == 1 else _activate(values[0], values[1], activation)
        rows = tile_ref[s] * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
        mine = (rows >= start_ref[group]) & (rows < end_ref[group])
        value = jnp.where(group < num_experts, value, 0.0)  # rows past the last expert
        out_ref[...] = jnp.where(mine, value.astype(out_ref.dtype), out_ref[...])


@functools.partial(jax.jit, static_argnames=("out_dtype", "transposed", "parts", "block_shape", "activation", "tail",
                                             "interpret", "config"))
def _gmm(x, w, ends, scale=None, *, out_dtype, transposed, parts=1, block_shape=None, activation=None, tail=True,
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
    block_m = _row_block(num_rows, config.block_m)
    block_n = _tile(n_dim, config.block_n)
    preferred_k = config.block_k
    if block_shape is not None and block_shape[1] % LANES == 0:  # K tiles of whole scale blocks, or within one
        while preferred_k > LANES and preferred_k % block_shape[1] and block_shape[1] % preferred_k:
            preferred_k //= 2
    block_k = _tile(k_dim, preferred_k)

    # ragged last blocks: rows and columns past the arrays are computed, then dropped on store
    group, tile, starts, ends, steps = _group_schedule(ends, _cdiv(num_rows, block_m) * block_m, block_m,
                                                       tail=tail, visit_empty=False)
    x, w = _wide(x), _wide(w)

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
        block_shape=block_shape, half_rows=half_rows, dot_dtype=_dot_dtype(x.dtype), activation=activation,
        ragged_k=k_dim if k_dim % block_k else None)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(_cdiv(n_dim, block_n), jnp.maximum(steps[0], 1), _cdiv(k_dim, block_k)),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((block_m, block_n), lambda n, s, k, g, t, *_: (t[s], n)),
            scratch_shapes=[pltpu.VMEM((parts, block_m, block_n), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((num_rows, n_dim), _stored(out_dtype)),
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
    _decline_float64(x, w)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    num_rows, n_dim = x.shape[0], w.shape[1] if w_transposed else w.shape[2]
    if num_rows == 0 or n_dim == 0:
        return jnp.zeros((num_rows, n_dim), out_dtype)
    if x.shape[1] == 0:
        return jnp.zeros((num_rows, n_dim), out_dtype)
    return _gmm(x, w, offsets, out_dtype=out_dtype, transposed=w_transposed, interpret=interpret, config=config)


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
        acc_ref[...] += _dot(x.T.astype(dot_dtype), dy.astype(dot_dtype), 0)

    @pl.when((s == last) | (group_ref[jnp.minimum(s + 1, last)] != group))
    def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("num_experts", "out_dtype", "interpret", "config"))
def grouped_mm_weight_grad(x, dy, offsets, num_experts, out_dtype=None, *, interpret=None, config=None):
    """``[E, K, N]``: ``x_e^T dy_e`` for each expert's rows ``offsets[e-1]:offsets[e]`` of
    ``x [M, K]`` and ``dy [M, N]``, float32 accumulation; zero for an expert with no rows."""
    _decline_float64(x, dy)
    config = config or Config()
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    (num_rows, k_dim), n_dim = x.shape, dy.shape[1]
    if num_rows == 0 or k_dim == 0 or n_dim == 0 or num_experts == 0:
        return jnp.zeros((num_experts, k_dim, n_dim), out_dtype)
    block_m = _row_block(num_rows, config.block_m)
    block_k, block_n = _tile(k_dim, config.block_n), _tile(n_dim, config.block_n)
    # ragged last blocks: rows past the array belong to no expert (masked); columns past it are
    # computed into rows and columns of out that are dropped on store
    group, tile, starts, ends, steps = _group_schedule(offsets, _cdiv(num_rows, block_m) * block_m, block_m,
                                                       tail=False, visit_empty=True)
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, dot_dtype=_dot_dtype(x.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(_cdiv(k_dim, block_k), _cdiv(n_dim, block_n), steps[0]),
            in_specs=[pl.BlockSpec((block_m, block_k), lambda i, j, s, g, t, *_: (t[s], i)),
                      pl.BlockSpec((block_m, block_n), lambda i, j, s, g, t, *_: (t[s], j))],
            out_specs=pl.BlockSpec((None, block_k, block_n), lambda i, j, s, g, *_: (g[s], i, j)),
            scratch_shapes=[pltpu.VMEM((block_k, block_n), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((num_experts, k_dim, n_dim), _stored(out_dtype)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret_params(interpret),
    )(group, tile, starts, ends, steps, _wide(x), _wide(dy))
    return out.astype(out_dtype)


# ---- the fused layer ----

def fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets, activation="silu", w13_scale=None,
              w2_scale=None, block_shape=None, *, interpret=None, config=None):
    """``[T, H]`` in x's dtype: the experts block of ``torch_kernels.reference.moe.fused_moe``.

    x ``[T, H]``; w13 ``[E, 2I, H]`` (gate rows then up rows), w2 ``[E, H, I]``, x's dtype or
    float8_e4m3fn with float32 scales per output channel (``[E, 2I]``, ``[E, H]``) or per
    ``block_shape = (bn, bk)`` block; weights float32 ``[T, k]``; routing maps as
    :func:`sort_by_expert` makes them. Its four kernels are jitted one by one (shared between
    layers of equal shapes); wrap the call in ``jax.jit`` to compile it as one program."""
    _decline_float64(x, w13)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    num_tokens, hidden = x.shape
    if num_tokens == 0 or hidden == 0:
        return jnp.zeros(x.shape, x.dtype)
    block_shape = None if block_shape is None else tuple(block_shape)
    rows = moe_gather(x, token_of_row, interpret=interpret)
    h = _gmm(rows, w13, offsets, w13_scale, out_dtype=x.dtype, transposed=True, parts=2, block_shape=block_shape,
             activation=activation, tail=False, interpret=interpret, config=config)
    y = _gmm(h, w2, offsets, w2_scale, out_dtype=jnp.dtype(jnp.float32), transposed=True, block_shape=block_shape,
             tail=False, interpret=interpret, config=config)
    return moe_combine(y, row_of_slot, weights, x.dtype, interpret=interpret)


# ---- differentiable forms (what torchax tensors run) ----
#
# Each op as a jax.custom_vjp over a set of kernels, the Pallas ones above or the plain-jnp
# references below, its backward composed of the same set's kernels as torch_kernels.ops.moe's
# backwards compose the ops: a gather's is a combine and the reverse, a grouped GEMM's are a
# grouped GEMM and a weight-gradient GEMM, fused_moe's recomputes its forward unfused. The first
# argument names the set (bind it with functools.partial); index arrays get no cotangent.


@dataclasses.dataclass(frozen=True)
class Kernels:
    """One backend's kernels, with the Pallas kernels' signatures."""

    router_topk: object
    moe_gather: object
    moe_combine: object
    grouped_mm: object
    grouped_mm_weight_grad: object
    fused_moe: object


def _ranked(values, excluded=None):
    """Each row's indices, best first: larger first, NaN counted as -inf, equal values (-0.0 and
    0.0 too: sorts order them apart) by lowest index, ``excluded`` positions after all others."""
    values = _no_nan(values)
    keys = (-jnp.where(values == 0, 0.0, values),)
    return jnp.lexsort(keys if excluded is None else keys + (excluded,), axis=-1)


def router_topk_reference(logits, top_k, scoring="softmax", renormalize=True, num_expert_groups=None,
                          topk_groups=None, correction_bias=None, routed_scaling_factor=1.0):
    """:func:`router_topk` in jnp, with its choice rule."""
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
    biased = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    choice = logits if correction_bias is None else biased
    excluded = None
    if num_expert_groups is not None:
        num_tokens, num_experts = choice.shape
        size = num_experts // num_expert_groups
        grouped = _no_nan(biased).reshape(num_tokens, num_expert_groups, size)
        group_scores = jax.lax.top_k(grouped, min(2, size))[0].sum(axis=-1)  # values: order moot
        kept = _ranked(group_scores)[:, :topk_groups]
        mask = jnp.zeros(group_scores.shape, jnp.bool_).at[jnp.arange(num_tokens)[:, None], kept].set(True)
        excluded = ~jnp.repeat(mask, size, axis=1)
    ids = _ranked(choice, excluded)[:, :top_k]
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if renormalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    weights = jnp.where(jnp.isnan(logits).any(axis=-1, keepdims=True), jnp.nan, weights)
    return weights * routed_scaling_factor, ids.astype(jnp.int32)


def moe_gather_reference(x, token_of_row):
    """:func:`moe_gather` in jnp."""
    if x.shape[0] == 0:
        return jnp.zeros((token_of_row.shape[0], x.shape[1]), x.dtype)
    rows = jnp.take(x, jnp.maximum(token_of_row, 0), axis=0)
    return jnp.where((token_of_row >= 0)[:, None], rows, jnp.zeros_like(rows))


def moe_combine_reference(y, row_of_slot, weights, out_dtype=None):
    """:func:`moe_combine` in jnp: float32, slot by slot in order, dropped slots never read."""
    out_dtype = jnp.dtype(out_dtype or y.dtype)
    (num_tokens, top_k), cols = row_of_slot.shape, y.shape[1]
    if num_tokens == 0 or y.shape[0] == 0:
        return jnp.zeros((num_tokens, cols), out_dtype)
    rows = jnp.take(y, jnp.maximum(row_of_slot, 0).reshape(-1), axis=0).reshape(num_tokens, top_k, cols)
    used = (row_of_slot >= 0)[..., None]
    terms = jnp.where(used, rows.astype(jnp.float32) * weights[..., None].astype(jnp.float32), 0.0)
    out = terms[:, 0]
    for j in range(1, top_k):
        out = out + terms[:, j]
    return out.astype(out_dtype)


def _group_sizes(offsets):
    return jnp.diff(offsets.astype(jnp.int32), prepend=0)


def grouped_mm_reference(x, w, offsets, out_dtype=None, w_transposed=False):
    """:func:`grouped_mm` in jnp: ``lax.ragged_dot`` in float32, rows past ``offsets[-1]`` zero."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    w = jnp.swapaxes(w, 1, 2) if w_transposed else w
    (num_rows, k_dim), (num_experts, _, n_dim) = x.shape, w.shape
    if num_rows == 0 or k_dim == 0 or n_dim == 0 or num_experts == 0:
        return jnp.zeros((num_rows, n_dim), out_dtype)
    out = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), _group_sizes(offsets),
                             precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    routed = jnp.arange(num_rows)[:, None] < offsets[-1]  # zero past the experts, whatever ragged_dot leaves
    return jnp.where(routed, out, 0.0).astype(out_dtype)


def grouped_mm_weight_grad_reference(x, dy, offsets, num_experts, out_dtype=None):
    """:func:`grouped_mm_weight_grad` in jnp: ``lax.ragged_dot_general`` over the ragged rows."""
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    (num_rows, k_dim), n_dim = x.shape, dy.shape[1]
    if num_rows == 0 or k_dim == 0 or n_dim == 0 or num_experts == 0:
        return jnp.zeros((num_experts, k_dim, n_dim), out_dtype)
    numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    out = jax.lax.ragged_dot_general(x.astype(jnp.float32), dy.astype(jnp.float32), _group_sizes(offsets), numbers,
                                     precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _dequantized(w, scale, block_shape):
    """float32 weights ``[E, N, K]`` from float8 entries and their channel or block scales."""
    if scale is None:
        return w
    w = w.astype(jnp.float32)
    if block_shape is None:
        return w * scale[..., None]
    (bn, bk), (_, n, k) = block_shape, w.shape
    return w * jnp.repeat(jnp.repeat(scale, bn, axis=1)[:, :n], bk, axis=2)[:, :, :k]


def fused_moe_reference(x, w13, w2, weights, token_of_row, row_of_slot, offsets, activation="silu", w13_scale=None,
                        w2_scale=None, block_shape=None):
    """:func:`fused_moe` in jnp, unfused (h rounded to x's dtype between the GEMMs, as the kernels)."""
    rows = moe_gather_reference(x, token_of_row)
    gate_up = grouped_mm_reference(rows, _dequantized(w13, w13_scale, block_shape), offsets, jnp.float32, True)
    half = gate_up.shape[1] // 2
    h = _activate(gate_up[:, :half], gate_up[:, half:], activation).astype(x.dtype)
    y = grouped_mm_reference(h, _dequantized(w2, w2_scale, block_shape), offsets, jnp.float32, True)
    return moe_combine_reference(y, row_of_slot, weights, x.dtype)


PALLAS = Kernels(router_topk, moe_gather, moe_combine, grouped_mm, grouped_mm_weight_grad, fused_moe)
REFERENCE = Kernels(router_topk_reference, moe_gather_reference, moe_combine_reference, grouped_mm_reference,
                    grouped_mm_weight_grad_reference, fused_moe_reference)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4, 5, 6, 7, 8))
def differentiable_router_topk(kernels, logits, correction_bias, top_k, scoring="softmax", renormalize=True,
                               num_expert_groups=None, topk_groups=None, routed_scaling_factor=1.0):
    """``kernels.router_topk``, differentiable in ``logits`` (the bias only steers the choice)."""
    return kernels.router_topk(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, correction_bias,
                               routed_scaling_factor)


def _router_fwd(kernels, logits, correction_bias, top_k, scoring, renormalize, num_expert_groups, topk_groups,
                routed_scaling_factor):
    weights, ids = differentiable_router_topk(kernels, logits, correction_bias, top_k, scoring, renormalize,
                                              num_expert_groups, topk_groups, routed_scaling_factor)
    return (weights, ids), (logits, ids)


def _router_bwd(kernels, top_k, scoring, renormalize, num_expert_groups, topk_groups, routed_scaling_factor,
                residuals, cotangents):
    logits, ids = residuals
    scores = logits.astype(jnp.float32)
    scores = jax.nn.softmax(scores, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(scores)
    picked = jnp.take_along_axis(scores, ids, axis=1)
    d_picked = cotangents[0].astype(jnp.float32) * routed_scaling_factor
    if renormalize:
        total = picked.sum(axis=-1, keepdims=True)
        d_picked = (d_picked - (d_picked * picked).sum(axis=-1, keepdims=True) / total) / total
    d_scores = jnp.zeros_like(scores).at[jnp.arange(ids.shape[0])[:, None], ids].add(d_picked)
    if scoring == "softmax":
        d_logits = scores * (d_scores - (d_scores * scores).sum(axis=-1, keepdims=True))
    else:
        d_logits = d_scores * scores * (1 - scores)
    return d_logits.astype(logits.dtype), None


differentiable_router_topk.defvjp(_router_fwd, _router_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def differentiable_moe_gather(kernels, x, token_of_row, row_of_slot):
    """``kernels.moe_gather``; its backward combines the rows' gradients with unit weights."""
    return kernels.moe_gather(x, token_of_row)


def _gather_fwd(kernels, x, token_of_row, row_of_slot):
    return kernels.moe_gather(x, token_of_row), (token_of_row, row_of_slot)


def _gather_bwd(kernels, residuals, d_rows):
    token_of_row, row_of_slot = residuals
    ones = jnp.ones(row_of_slot.shape, jnp.float32)
    return kernels.moe_combine(d_rows, row_of_slot, ones, d_rows.dtype), None, None  # d_rows: x's dtype


differentiable_moe_gather.defvjp(_gather_fwd, _gather_bwd)


def _combine_grads(kernels, y, token_of_row, row_of_slot, weights, d_out, d_y_dtype):
    """(d y, d weights) of ``combine(y, weights)``: each row gets its token's gradient times its
    routing weight (a gather), each used slot the dot of its row with its token's gradient."""
    used = row_of_slot >= 0
    flat = jnp.maximum(row_of_slot, 0).reshape(-1)
    weight_of_row = jnp.zeros((y.shape[0],), jnp.float32).at[flat].add(
        jnp.where(used, weights.astype(jnp.float32), 0.0).reshape(-1))
    d_y = (kernels.moe_gather(d_out, token_of_row).astype(jnp.float32) * weight_of_row[:, None]).astype(d_y_dtype)
    rows = jnp.take(y, flat, axis=0).reshape(*row_of_slot.shape, y.shape[1]).astype(jnp.float32)
    d_weights = jnp.where(used, (rows * d_out.astype(jnp.float32)[:, None, :]).sum(axis=-1), 0.0)
    return d_y, d_weights.astype(weights.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def differentiable_moe_combine(kernels, y, token_of_row, row_of_slot, weights):
    """``kernels.moe_combine`` into y's dtype, differentiable in ``y`` and ``weights``."""
    return kernels.moe_combine(y, row_of_slot, weights.astype(jnp.float32), y.dtype)


def _combine_fwd(kernels, y, token_of_row, row_of_slot, weights):
    out = differentiable_moe_combine(kernels, y, token_of_row, row_of_slot, weights)
    return out, (y, token_of_row, row_of_slot, weights)


def _combine_bwd(kernels, residuals, d_out):
    y, token_of_row, row_of_slot, weights = residuals
    d_y, d_weights = _combine_grads(kernels, y, token_of_row, row_of_slot, weights, d_out, y.dtype)
    return d_y, None, None, d_weights


differentiable_moe_combine.defvjp(_combine_fwd, _combine_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def differentiable_grouped_mm(kernels, x, w, offsets, out_dtype=None):
    """``kernels.grouped_mm`` of ``w [E, K, N]``, differentiable in ``x`` and ``w``."""
    return kernels.grouped_mm(x, w, offsets, out_dtype)


def _grouped_fwd(kernels, x, w, offsets, out_dtype):
    return kernels.grouped_mm(x, w, offsets, out_dtype), (x, w, offsets)


def _grouped_bwd(kernels, out_dtype, residuals, d_out):
    x, w, offsets = residuals
    d_out = d_out.astype(x.dtype)
    d_x = kernels.grouped_mm(d_out, w, offsets, x.dtype, True)  # w read as each expert's transpose
    d_w = kernels.grouped_mm_weight_grad(x, d_out, offsets, w.shape[0], w.dtype)
    return d_x, d_w, None


differentiable_grouped_mm.defvjp(_grouped_fwd, _grouped_bwd)


def _activation_backward(gate_up, d_h, activation: str):
    """float32 ``d gate_up`` from ``d h`` for ``h = activate(gate_up)``, as the op layer's."""
    half = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :half], gate_up[..., half:]
    if activation == "silu":
        sig = _sigmoid(gate)
        d_act = sig * (1 + gate * (1 - sig))
        return jnp.concatenate([d_h * up * d_act, d_h * gate * sig], axis=-1)
    if activation == "gelu":
        cdf = 0.5 * (1 + jax.lax.erf(gate * math.sqrt(0.5)))
        pdf = jnp.exp(-0.5 * gate * gate) / math.sqrt(2 * math.pi)
        return jnp.concatenate([d_h * up * (cdf + gate * pdf), d_h * gate * cdf], axis=-1)
    g, u = jnp.minimum(gate, SWIGLUOAI_LIMIT), jnp.clip(up, -SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
    sig = _sigmoid(SWIGLUOAI_ALPHA * g)
    d_g = d_h * (u + 1) * (sig + SWIGLUOAI_ALPHA * g * sig * (1 - sig)) * (gate <= SWIGLUOAI_LIMIT)
    d_u = d_h * g * sig * ((up >= -SWIGLUOAI_LIMIT) & (up <= SWIGLUOAI_LIMIT))
    return jnp.concatenate([d_g, d_u], axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 8, 11))
def differentiable_fused_moe(kernels, x, w13, w2, weights, token_of_row, row_of_slot, offsets, activation="silu",
                             w13_scale=None, w2_scale=None, block_shape=None):
    """``kernels.fused_moe``, differentiable in ``x``, ``w13``, ``w2`` and ``weights`` for
    unquantized weights (float8 weights are inference-only: their backward raises)."""
    return kernels.fused_moe(x, w13, w2, weights.astype(jnp.float32), token_of_row, row_of_slot, offsets, activation,
                             w13_scale, w2_scale, block_shape)


def _fused_fwd(kernels, x, w13, w2, weights, token_of_row, row_of_slot, offsets, activation, w13_scale, w2_scale,
               block_shape):
    out = differentiable_fused_moe(kernels, x, w13, w2, weights, token_of_row, row_of_slot, offsets, activation,
                                   w13_scale, w2_scale, block_shape)
    return out, (x, w13, w2, weights, token_of_row, row_of_slot, offsets, w13_scale)


def _fused_bwd(kernels, activation, block_shape, residuals, d_out):
    x, w13, w2, weights, token_of_row, row_of_slot, offsets, w13_scale = residuals
    if w13_scale is not None:
        raise RuntimeError("fused_moe: float8 weights are inference-only; call it without gradients")
    num_experts, acc = w13.shape[0], jnp.float32
    # the forward recomputed unfused, then each piece's backward
    rows = kernels.moe_gather(x, token_of_row)
    gate_up = kernels.grouped_mm(rows, w13, offsets, acc, True)
    half = gate_up.shape[1] // 2
    h = _activate(gate_up[:, :half], gate_up[:, half:], activation).astype(x.dtype)
    y = kernels.grouped_mm(h, w2, offsets, acc, True)
    d_y, d_weights = _combine_grads(kernels, y, token_of_row, row_of_slot, weights, d_out, x.dtype)
    d_h = kernels.grouped_mm(d_y, w2, offsets, acc)
    d_w2 = kernels.grouped_mm_weight_grad(d_y, h, offsets, num_experts, w2.dtype)
    d_gate_up = _activation_backward(gate_up, d_h, activation).astype(x.dtype)
    d_rows = kernels.grouped_mm(d_gate_up, w13, offsets, x.dtype)
    d_w13 = kernels.grouped_mm_weight_grad(d_gate_up, rows, offsets, num_experts, w13.dtype)
    d_x = kernels.moe_combine(d_rows, row_of_slot, jnp.ones(row_of_slot.shape, acc), x.dtype)
    return d_x, d_w13, d_w2, d_weights, None, None, None, None, None


differentiable_fused_moe.defvjp(_fused_fwd, _fused_bwd)

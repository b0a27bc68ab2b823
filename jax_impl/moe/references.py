"""Each kernel of the family in plain jnp, with the Pallas kernels' signatures and choice rules:
the reference set of the differentiable forms."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._common import activate, no_nan

def _ranked(values, excluded=None):
    """Each row's indices, best first: larger first, NaN counted as -inf, equal values (-0.0 and
    0.0 too: sorts order them apart) by lowest index, ``excluded`` positions after all others."""
    values = no_nan(values)
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
        grouped = no_nan(biased).reshape(num_tokens, num_expert_groups, size)
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
    h = activate(gate_up[:, :half], gate_up[:, half:], activation).astype(x.dtype)
    y = grouped_mm_reference(h, _dequantized(w2, w2_scale, block_shape), offsets, jnp.float32, True)
    return moe_combine_reference(y, row_of_slot, weights, x.dtype)


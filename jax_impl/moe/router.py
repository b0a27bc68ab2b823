"""Top-k routing as a Pallas kernel (``router_topk``) and the routing maps of a choice
(``sort_by_expert``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .. import interpret_params
from ._common import cdiv, decline_float64, no_nan, row_block, sigmoid, wide

_CLOSED = -2 ** 31  # the key of an expert or group out of the running: below every _order_key


def _order_key(x):
    """int32 keys in the order of float32 ``x``, NaN as -inf and -0.0 as 0.0; all above ``_CLOSED``."""
    bits = jax.lax.bitcast_convert_type(no_nan(x), jnp.int32)
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
        scores = sigmoid(logits)
    biased = scores + bias_ref[...]

    def first_max(keys, positions, none):
        """Per row: the first position holding the largest key."""
        best = jnp.max(keys, axis=1, keepdims=True)
        return jnp.min(jnp.where(keys == best, positions, none), axis=1, keepdims=True)

    allowed = None
    if num_groups is not None:
        biased = no_nan(biased)
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
    decline_float64(logits, correction_bias)
    num_tokens, num_experts = logits.shape
    if num_tokens == 0:
        return jnp.zeros((0, top_k), jnp.float32), jnp.zeros((0, top_k), jnp.int32)
    rows = row_block(num_tokens, block_tokens)
    bias = (jnp.zeros((1, num_experts), jnp.float32) if correction_bias is None
            else correction_bias.astype(jnp.float32).reshape(1, num_experts))
    weights, ids = pl.pallas_call(
        functools.partial(_router_kernel, top_k=top_k, scoring=scoring, renormalize=renormalize,
                          num_groups=num_expert_groups, topk_groups=topk_groups,
                          has_bias=correction_bias is not None, scaling=float(routed_scaling_factor)),
        grid=(cdiv(num_tokens, rows),),
        in_specs=[pl.BlockSpec((rows, num_experts), lambda i: (i, 0)),
                  pl.BlockSpec((1, num_experts), lambda i: (0, 0))],
        out_specs=[pl.BlockSpec((rows, top_k), lambda i: (i, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((num_tokens, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret_params(interpret),
    )(wide(logits), bias)  # a ragged last block's extra rows are computed and dropped
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


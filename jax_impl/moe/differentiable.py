"""Differentiable forms of the family's ops (what torchax tensors run).

Each op as a jax.custom_vjp over a set of kernels, the Pallas ones or the plain-jnp
:mod:`.references`, its backward composed of the same set's kernels as torch_kernels.ops.moe's
backwards compose the ops: a gather's is a combine and the reverse, a grouped GEMM's are a
grouped GEMM and a weight-gradient GEMM, fused_moe's recomputes its forward unfused. The first
argument names the set (bind it with functools.partial); index arrays get no cotangent."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from . import references
from ._common import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, activate, sigmoid
from .fused import fused_moe
from .gather_combine import moe_combine, moe_gather
from .grouped_gemm import grouped_mm, grouped_mm_weight_grad
from .router import router_topk

@dataclasses.dataclass(frozen=True)
class Kernels:
    """One backend's kernels, with the Pallas kernels' signatures."""

    router_topk: object
    moe_gather: object
    moe_combine: object
    grouped_mm: object
    grouped_mm_weight_grad: object
    fused_moe: object



PALLAS = Kernels(router_topk, moe_gather, moe_combine, grouped_mm, grouped_mm_weight_grad, fused_moe)
REFERENCE = Kernels(references.router_topk_reference, references.moe_gather_reference,
                    references.moe_combine_reference, references.grouped_mm_reference,
                    references.grouped_mm_weight_grad_reference, references.fused_moe_reference)


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
        sig = sigmoid(gate)
        d_act = sig * (1 + gate * (1 - sig))
        return jnp.concatenate([d_h * up * d_act, d_h * gate * sig], axis=-1)
    if activation == "gelu":
        cdf = 0.5 * (1 + jax.lax.erf(gate * math.sqrt(0.5)))
        pdf = jnp.exp(-0.5 * gate * gate) / math.sqrt(2 * math.pi)
        return jnp.concatenate([d_h * up * (cdf + gate * pdf), d_h * gate * cdf], axis=-1)
    g, u = jnp.minimum(gate, SWIGLUOAI_LIMIT), jnp.clip(up, -SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
    sig = sigmoid(SWIGLUOAI_ALPHA * g)
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
    h = activate(gate_up[:, :half], gate_up[:, half:], activation).astype(x.dtype)
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

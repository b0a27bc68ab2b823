"""Mahalanobis scoring as one Pallas TPU kernel, and a differentiable JAX op around it.

The kernel tiles the whitening GEMM ``y = (x - center) @ W`` over (rows, output columns, inner
dimension) and, as each column block of ``y`` completes, folds it into ``||y||^2`` and the class
dot products ``y . class_proj[c]`` kept in VMEM; the last column block takes the min over classes.
``y`` never leaves VMEM. Shapes are padded to the TPU's (8, 128) tiles; padded classes get an
infinite ``class_sq`` so they never win the min.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import interpret_params, round_up

LANES = 128
MAX_CLASSES = 1024  # class_proj blocks [C, 512] and the dots [256, C] stay within a few MB of VMEM


def _block(dim: int, preferred: int) -> int:
    """The largest of preferred, preferred/2, ... (down to 128) that divides ``dim``."""
    block = preferred
    while dim % block:
        block //= 2
    return block


def _kernel(x_ref, center_ref, w_ref, proj_ref, class_sq_ref, score_ref, nearest_ref,
            acc_ref, sq_ref, dots_ref, *, dot_dtype, num_classes):
    n, k = pl.program_id(1), pl.program_id(2)
    last_n, last_k = pl.num_programs(1) - 1, pl.num_programs(2) - 1

    @pl.when((n == 0) & (k == 0))
    def _():
        sq_ref[...] = jnp.zeros_like(sq_ref)
        dots_ref[...] = jnp.zeros_like(dots_ref)

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    centred = (x_ref[...].astype(jnp.float32) - center_ref[...]).astype(dot_dtype)
    acc_ref[...] += jnp.dot(centred, w_ref[...].astype(dot_dtype), preferred_element_type=jnp.float32)

    @pl.when(k == last_k)
    def _():
        y = acc_ref[...]
        sq_ref[...] += jnp.sum(y * y, axis=1, keepdims=True)
        dots_ref[...] += jax.lax.dot_general(
            y, proj_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    @pl.when((n == last_n) & (k == last_k))
    def _():
        distances = sq_ref[...] - 2.0 * dots_ref[...] + class_sq_ref[...]
        classes = jax.lax.broadcasted_iota(jnp.int32, distances.shape, 1)
        real = classes < num_classes
        # As torch.min: a NaN distance (a NaN row, or inf - inf) wins and its class is the
        # nearest; never a padding column.
        is_nan = (distances != distances) & real
        has_nan = jnp.max(is_nan.astype(jnp.int32), axis=1, keepdims=True) > 0
        best = jnp.min(jnp.where(real, distances, jnp.inf), axis=1, keepdims=True)
        best = jnp.where(has_nan, jnp.nan, best)
        is_best = jnp.where(has_nan, is_nan, distances == best) & real
        first = jnp.min(jnp.where(is_best, classes, distances.shape[1]), axis=1, keepdims=True)
        score_ref[...] = jnp.where(best < 0.0, 0.0, best)
        nearest_ref[...] = jnp.minimum(first, num_classes - 1)


@functools.partial(jax.jit, static_argnames=("interpret", "block_rows", "block_cols"))
def mahalanobis_min(x, center, whitener, class_proj, class_sq, *, interpret=None,
                    block_rows=256, block_cols=512):
    """min_c of ||(x - center) W||^2 - 2 (x - center) W . class_proj[c] + class_sq[c], and argmin.

    x ``[B, D]`` (float32, bfloat16 or float16), center ``[D]``, whitener ``[D, D]``,
    class_proj ``[C, D]``, class_sq ``[C]`` (float32). Returns float32 ``[B]`` scores (clamped at
    0) and int32 ``[B]`` nearest classes. bfloat16 ``x`` multiplies in bfloat16 with float32
    accumulation; float16 in float32 (a whitener's entries, 1 / sigma, can overflow float16).
    """
    if x.dtype == jnp.float64:
        raise NotImplementedError("pallas: float64 is not supported (TPUs have no float64)")
    b, d = x.shape
    c = class_proj.shape[0]
    if c > MAX_CLASSES:
        raise NotImplementedError(f"pallas: at most {MAX_CLASSES} classes (the class terms live in VMEM), got {c}")
    if b == 0:
        return jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32)
    dot_dtype = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
    rows = min(block_rows, round_up(b, 16))
    bp, dp, cp = round_up(b, rows), round_up(d, LANES), round_up(c, LANES)
    cols = _block(dp, block_cols)

    x = jnp.pad(x, ((0, bp - b), (0, dp - d)))
    center = jnp.pad(center.astype(jnp.float32), (0, dp - d))[None, :]
    whitener = jnp.pad(whitener, ((0, dp - d), (0, dp - d)))
    class_proj = jnp.pad(class_proj.astype(jnp.float32), ((0, cp - c), (0, dp - d)))
    class_sq = jnp.pad(class_sq.astype(jnp.float32), (0, cp - c), constant_values=jnp.inf)[None, :]

    score, nearest = pl.pallas_call(
        functools.partial(_kernel, dot_dtype=dot_dtype, num_classes=c),
        grid=(bp // rows, dp // cols, dp // cols),
        in_specs=[
            pl.BlockSpec((rows, cols), lambda i, n, k: (i, k)),
            pl.BlockSpec((1, cols), lambda i, n, k: (0, k)),
            pl.BlockSpec((cols, cols), lambda i, n, k: (k, n)),
            pl.BlockSpec((cp, cols), lambda i, n, k: (0, n)),
            pl.BlockSpec((1, cp), lambda i, n, k: (0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((rows, 1), lambda i, n, k: (i, 0)),
            pl.BlockSpec((rows, 1), lambda i, n, k: (i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((bp, 1), jnp.float32),
            jax.ShapeDtypeStruct((bp, 1), jnp.int32),
        ],
        scratch_shapes=[
            pltpu.VMEM((rows, cols), jnp.float32),
            pltpu.VMEM((rows, 1), jnp.float32),
            pltpu.VMEM((rows, cp), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")
        ),
        interpret=interpret_params(interpret),
    )(x, center, whitener, class_proj, class_sq)
    return score[:b, 0], nearest[:b, 0]


def class_terms(means, whitener):
    """center, (means - center) @ W and its squared row norms (see the kernel's contract)."""
    means = means.astype(jnp.float32)
    center = means.mean(axis=0)
    class_proj = (means - center) @ whitener.astype(jnp.float32)
    return center, class_proj, jnp.sum(class_proj * class_proj, axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def mahalanobis_score(x, means, whitener, interpret=None):
    """min_c ||(x - means[c]) @ whitener||^2 per row of x, by the Pallas kernel; differentiable."""
    return _score_fwd(x, means, whitener, interpret)[0]


def _score_fwd(x, means, whitener, interpret):
    center, class_proj, class_sq = class_terms(means, whitener)
    score, nearest = mahalanobis_min(x, center, whitener, class_proj, class_sq, interpret=interpret)
    return score, (x, means, whitener, nearest)


def _score_bwd(interpret, residuals, grad):
    x, means, whitener, nearest = residuals
    w = whitener.astype(jnp.float32)
    diff = x.astype(jnp.float32) - means.astype(jnp.float32)[nearest]
    weighted = (diff @ w) * (2.0 * grad)[:, None]
    grad_x = weighted @ w.T
    grad_means = jnp.zeros(means.shape, jnp.float32).at[nearest].add(-grad_x)
    grad_whitener = diff.T @ weighted
    return grad_x.astype(x.dtype), grad_means.astype(means.dtype), grad_whitener.astype(whitener.dtype)


mahalanobis_score.defvjp(_score_fwd, _score_bwd)


def mahalanobis_score_reference(x, means, whitener):
    """The definition in plain jnp: min_c ||(x - means[c]) @ whitener||^2 (autodiff for gradients)."""
    x, means, whitener = (a.astype(jnp.float32) for a in (x, means, whitener))
    y = (x[:, None, :] - means[None, :, :]) @ whitener
    return jnp.min(jnp.sum(y * y, axis=-1), axis=1)

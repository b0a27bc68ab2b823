"""Mahalanobis scoring as one Pallas TPU kernel, and a differentiable JAX op around it (EDM
scoring, below, likewise).

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def mahalanobis_score_fitted(x, center, whitener, class_proj, class_sq, interpret=None):
    """``mahalanobis_score`` from the class terms (``class_terms``' center, class_proj and class_sq,
    computed once), by the Pallas kernel; differentiable in all five."""
    return _fitted_fwd(x, center, whitener, class_proj, class_sq, interpret)[0]


def _fitted_fwd(x, center, whitener, class_proj, class_sq, interpret):
    score, nearest = mahalanobis_min(x, center, whitener, class_proj, class_sq, interpret=interpret)
    return score, (x, center, whitener, class_proj, class_sq, nearest)


def _fitted_bwd(interpret, residuals, grad):
    # the score is ||y||^2 - 2 y . class_proj[n] + class_sq[n], y = (x - center) W, n the nearest class
    x, center, whitener, class_proj, class_sq, nearest = residuals
    w = whitener.astype(jnp.float32)
    centred = x.astype(jnp.float32) - center
    y = centred @ w
    weighted = (y - class_proj[nearest]) * (2.0 * grad)[:, None]
    grad_x = weighted @ w.T
    grad_proj = jnp.zeros(class_proj.shape, jnp.float32).at[nearest].add(-2.0 * y * grad[:, None])
    grad_sq = jnp.zeros(class_sq.shape, jnp.float32).at[nearest].add(grad)
    return (grad_x.astype(x.dtype), -grad_x.sum(axis=0), (centred.T @ weighted).astype(whitener.dtype), grad_proj,
            grad_sq)


mahalanobis_score_fitted.defvjp(_fitted_fwd, _fitted_bwd)


def mahalanobis_score_fitted_reference(x, center, whitener, class_proj, class_sq):
    """The fitted form in plain jnp: min_c ||y||^2 - 2 y . class_proj[c] + class_sq[c], clamped at 0,
    with y = (x - center) @ whitener (autodiff for gradients)."""
    y = (x.astype(jnp.float32) - center) @ whitener.astype(jnp.float32)
    distances = jnp.sum(y * y, axis=1, keepdims=True) - 2.0 * (y @ class_proj.T) + class_sq
    return jnp.maximum(jnp.min(distances, axis=1), 0.0)


def mahalanobis_score_reference(x, means, whitener):
    """The definition in plain jnp: min_c ||(x - means[c]) @ whitener||^2 (autodiff for gradients)."""
    x, means, whitener = (a.astype(jnp.float32) for a in (x, means, whitener))
    y = (x[:, None, :] - means[None, :, :]) @ whitener
    return jnp.min(jnp.sum(y * y, axis=-1), axis=1)


# ---- EDM diffusion scoring ----
#
# One grid step owns a block of rows and runs the whole denoiser at every noise level for them, the
# weights resident in VMEM (their block is the whole array, fetched once: the index maps are
# constant), levels and residual blocks as fori_loops. Features and hidden width are padded to the
# 128 lanes with zeros, which the MLP carries through as zeros (silu(0) = 0). The per-level scalars
# (sigma, c_in, c_skip, c_out and the level weight) are read from SMEM. With ``scoped``, a tangent
# rides along every matmul (one Jacobian-vector product per level).

EDM_MAX_WEIGHT_BYTES = 24 << 20  # resident weights; VMEM also holds their second pipeline buffer


def _silu_and_slope(h):
    gate = jax.nn.sigmoid(h)
    return h * gate, gate * (1.0 + h * (1.0 - gate))


def _edm_kernel(coef_ref, level_weight_ref, x_ref, mean_ref, inv_scale_ref, noise_ref, level_bias_ref, w_in_ref,
                w1_ref, b1_ref, w2_ref, b2_ref, w_out_ref, b_out_ref, score_ref, *, num_levels, num_blocks, scoped):
    f32 = jnp.float32
    y = (x_ref[...].astype(f32) - mean_ref[...]) * inv_scale_ref[...]

    def dot(a, b):
        return jnp.dot(a, b, preferred_element_type=f32)

    def level(l, total):
        sigma, c_in, c_skip, c_out = (coef_ref[4 * l + i] for i in range(4))
        noise = noise_ref[l]  # [1, Dp]
        w_in = w_in_ref[...]
        if scoped:
            h = dot(c_in * y, w_in)
            th = jnp.broadcast_to(dot(c_in * noise, w_in), h.shape)  # the tangent's input is the same for every row
        else:
            h = dot(c_in * (y + sigma * noise), w_in)
            th = None
        h = h + level_bias_ref[l]

        def block(k, carry):
            h, th = carry
            a, slope = _silu_and_slope(h)
            z = dot(a, w1_ref[k]) + b1_ref[k]
            t, z_slope = _silu_and_slope(z)
            h = h + dot(t, w2_ref[k]) + b2_ref[k]
            if th is not None:
                th = th + dot(z_slope * dot(slope * th, w1_ref[k]), w2_ref[k])
            return h, th

        h, th = jax.lax.fori_loop(0, num_blocks, block, (h, th))
        a, slope = _silu_and_slope(h)
        f = dot(a, w_out_ref[...]) + b_out_ref[...]
        if scoped:
            residual = c_skip * y + c_out * f - y
            tf = dot(slope * th, w_out_ref[...])
            error = (jnp.sum(residual * residual, axis=1, keepdims=True) / (sigma * sigma)
                     + jnp.sum(c_out * tf * noise, axis=1, keepdims=True) + (c_skip - 1.0) * jnp.sum(noise * noise))
        else:
            residual = c_skip * (y + sigma * noise) + c_out * f - y
            error = jnp.sum(residual * residual, axis=1, keepdims=True)
        return total + level_weight_ref[l] * error

    score_ref[...] = jax.lax.fori_loop(0, num_levels, level, jnp.zeros(score_ref.shape, f32))


@functools.partial(jax.jit, static_argnames=("scoped", "interpret", "block_rows"))
def edm_score_levels(x, mean, inv_scale, coefficients, noise, level_weights, level_bias, w_in, w1, b1, w2, b2,
                     w_out, b_out, *, scoped=False, interpret=None, block_rows=256):
    """The EDM score of each row of ``x`` by the fused Pallas kernel (contract:
    ``torch_kernels.reference.ood.edm_score_levels``): ``[B]`` float32.

    x ``[B, D]`` (float32, bfloat16 or float16); coefficients ``[L, 4]`` (sigma, c_in, c_skip,
    c_out per level), everything else float32 as the op passes it. Multiplies in float32.
    """
    if x.dtype == jnp.float64:
        raise NotImplementedError("pallas: float64 is not supported (TPUs have no float64)")
    b, d = x.shape
    h, k, num_levels = w_in.shape[1], w1.shape[0], coefficients.shape[0]
    dp, hp = round_up(d, LANES), round_up(h, LANES)
    weight_bytes = 4 * (2 * dp * hp + 2 * max(k, 1) * hp * (hp + 1) + num_levels * (dp + hp) + 3 * dp)
    if weight_bytes > EDM_MAX_WEIGHT_BYTES:
        raise NotImplementedError(f"pallas: the denoiser's {weight_bytes >> 20} MB of weights do not fit VMEM "
                                  f"(at most {EDM_MAX_WEIGHT_BYTES >> 20} MB)")
    if b == 0:
        return jnp.zeros((0,), jnp.float32)
    rows = min(block_rows, round_up(b, 16))  # 16: bfloat16 rows pack in pairs
    bp = round_up(b, rows)
    f32 = jnp.float32

    def pad(a, *shape):
        return jnp.pad(a.astype(f32), [(0, s - n) for s, n in zip(shape, a.shape)])

    if k == 0:  # nothing to loop over; a zero block keeps every operand non-empty
        w1, b1, w2, b2 = (jnp.zeros((1,) + a.shape[1:], f32) for a in (w1, b1, w2, b2))
    kp = w1.shape[0]
    operands = (
        jnp.pad(x, ((0, bp - b), (0, dp - d))),
        pad(mean, dp)[None], pad(inv_scale, dp)[None],
        pad(noise, num_levels, dp)[:, None, :], pad(level_bias, num_levels, hp)[:, None, :],
        pad(w_in, dp, hp), pad(w1, kp, hp, hp), pad(b1, kp, hp)[:, None, :],
        pad(w2, kp, hp, hp), pad(b2, kp, hp)[:, None, :], pad(w_out, hp, dp), pad(b_out, dp)[None],
    )

    def whole(a):
        return pl.BlockSpec(a.shape, lambda i, _n=a.ndim: (0,) * _n)

    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    score = pl.pallas_call(
        functools.partial(_edm_kernel, num_levels=num_levels, num_blocks=k, scoped=scoped),
        grid=(bp // rows,),
        in_specs=[smem, smem, pl.BlockSpec((rows, dp), lambda i: (i, 0)), *map(whole, operands[1:])],
        out_specs=pl.BlockSpec((rows, 1), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((bp, 1), f32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                             vmem_limit_bytes=2 * weight_bytes + (16 << 20)),
        interpret=interpret_params(interpret),
    )(coefficients.astype(f32).reshape(-1), level_weights.astype(f32), *operands)
    return score[:b, 0]


def edm_score_reference(x, mean, inv_scale, coefficients, noise, level_weights, level_bias, w_in, w1, b1, w2, b2,
                        w_out, b_out, *, scoped=False):
    """The same scores in plain jnp, the tangent by ``jax.jvp`` (autodiff for gradients)."""
    f32 = jnp.float32
    y = (x.astype(f32) - mean) * inv_scale

    def mlp(u, bias):
        h = u @ w_in + bias
        for kk in range(w1.shape[0]):
            h = h + jax.nn.silu(jax.nn.silu(h) @ w1[kk] + b1[kk]) @ w2[kk] + b2[kk]
        return jax.nn.silu(h) @ w_out + b_out

    total = jnp.zeros(x.shape[0], f32)
    for l in range(coefficients.shape[0]):
        sigma, c_in, c_skip, c_out = coefficients[l]
        n = noise[l]

        def denoiser(v, c_in=c_in, c_skip=c_skip, c_out=c_out, bias=level_bias[l]):
            return c_skip * v + c_out * mlp(c_in * v, bias)

        if scoped:
            out, jvp = jax.jvp(denoiser, (y,), (jnp.broadcast_to(n, y.shape),))
            error = jnp.sum((out - y) ** 2, axis=1) / sigma**2 + jvp @ n - jnp.sum(n * n)
        else:
            error = jnp.sum((denoiser(y + sigma * n) - y) ** 2, axis=1)
        total = total + level_weights[l] * error
    return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(14, 15))
def edm_score(x, mean, inv_scale, coefficients, noise, level_weights, level_bias, w_in, w1, b1, w2, b2, w_out, b_out,
              scoped=False, interpret=None):
    """EDM scores by the Pallas kernel; differentiable (the backward is the vector-Jacobian
    product of ``edm_score_reference``)."""
    return edm_score_levels(x, mean, inv_scale, coefficients, noise, level_weights, level_bias, w_in, w1, b1, w2, b2,
                            w_out, b_out, scoped=scoped, interpret=interpret)


def _edm_fwd(*args):
    *arrays, scoped, interpret = args
    return edm_score_levels(*arrays, scoped=scoped, interpret=interpret), arrays


def _edm_bwd(scoped, interpret, arrays, grad):
    _, vjp = jax.vjp(functools.partial(edm_score_reference, scoped=scoped), *arrays)
    return vjp(grad)


edm_score.defvjp(_edm_fwd, _edm_bwd)


def edm_level_coefficients(sigmas, sigma_data: float):
    """``[L, 4]`` float32 table of ``(sigma, c_in, c_skip, c_out)`` at the noise levels ``sigmas``
    (EDM's preconditioning: ``1 / sqrt(s^2 + sd^2)``, ``sd^2 / (s^2 + sd^2)``, ``s sd / sqrt(s^2 + sd^2)``)."""
    s = jnp.asarray(sigmas, jnp.float32)
    total = s * s + sigma_data**2
    return jnp.stack([s, jax.lax.rsqrt(total), sigma_data**2 / total, s * sigma_data * jax.lax.rsqrt(total)], axis=1)

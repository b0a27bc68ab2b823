"""Mahalanobis scoring as one fused Triton kernel (EDM scoring: the section below).

Each program owns ``BLOCK_B`` rows. For each block of ``BLOCK_N`` output columns it runs the
whitening GEMM ``y = (x - center) @ W`` over the inner dimension, then folds that block of ``y``
into ``||y||^2`` and the class dot products ``y . class_proj[c]`` held in registers; after the last
column block it takes the min over classes. ``y`` never goes to memory.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import autotune, for_device

MAX_CLASSES = 256  # the class dot products live in registers: [BLOCK_B, BLOCK_C] floats


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of one launch: rows per program, output columns and inner dimension per step."""

    block_b: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4


def default_config(b: int, d: int, c: int) -> Config:
    """Heuristic: narrower row blocks when many classes share the registers; 32-wide whitening
    tiles, 16 wide under many classes (the class dot goes through FMAs over a whole ``BLOCK_N``):
    64-wide ones spilled (ptxas fell back to 32 registers at 150 classes). None spills for sm_80
    or sm_90 (benchmarks/results/compiled_kernels.md): 64-row blocks take 8 warps and many classes
    16-deep K steps (measured once with the earlier 4 warps and 32-deep steps: spills of up to 208
    and 76 bytes, not in the report, which holds the defaults only)."""
    small = max(16, triton.next_power_of_2(d))
    if c > 64:
        return Config(block_b=32, block_n=min(16, small), block_k=min(16, small), num_warps=8)
    wide = b > 32
    return Config(block_b=64 if wide else 16, block_n=min(32, small), block_k=min(32, small),
                  num_warps=8 if wide else 4)


@triton.jit
def mahalanobis_min_kernel(
    x_ptr, center_ptr, w_ptr, proj_ptr, class_sq_ptr, score_ptr, nearest_ptr,
    B, D, C, stride_x, stride_w, stride_proj,
    BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """Scores and nearest classes of rows ``[pid * BLOCK_B, (pid + 1) * BLOCK_B)`` (module docstring)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
    row_mask = rows < B
    classes = tl.arange(0, BLOCK_C)
    class_mask = classes < C
    sq = tl.full([BLOCK_B], 0.0, tl.float32)
    dots = tl.full([BLOCK_B, BLOCK_C], 0.0, tl.float32)
    for n0 in range(0, D, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        col_mask = cols < D
        acc = tl.full([BLOCK_B, BLOCK_N], 0.0, tl.float32)
        for k0 in range(0, D, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < D
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            center = tl.load(center_ptr + ks, mask=k_mask, other=0.0)
            x = x - center[None, :]
            w = tl.load(w_ptr + ks[:, None] * stride_w + cols[None, :],
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if DOT_F32:
                # near-float32 accuracy from tensor cores; the interpreter computes in float32
                acc = tl.dot(x, w.to(tl.float32), acc, input_precision="tf32x3")
            else:
                acc = tl.dot(x.to(w.dtype), w, acc)
        sq += tl.sum(acc * acc, axis=1)
        proj = tl.load(proj_ptr + classes[:, None] * stride_proj + cols[None, :],
                       mask=class_mask[:, None] & col_mask[None, :], other=0.0)
        dots = tl.dot(acc, tl.trans(proj), dots, input_precision="ieee")
    class_sq = tl.load(class_sq_ptr + classes, mask=class_mask, other=float("inf"))
    distances = sq[:, None] - 2.0 * dots + class_sq[None, :]
    # As torch.min: a NaN distance (a NaN row, or inf - inf) wins and its class is the nearest.
    # tl.min and tl.maximum may drop NaNs, so NaN is tracked by hand; no index past C comes out.
    is_nan = (distances != distances) & class_mask[None, :]
    has_nan = tl.max(is_nan.to(tl.int32), axis=1) > 0
    best = tl.min(distances, axis=1)
    best = tl.where(has_nan, float("nan"), best)
    is_best = tl.where(has_nan[:, None], is_nan, distances == best[:, None]) & class_mask[None, :]
    nearest = tl.minimum(tl.min(tl.where(is_best, classes[None, :], BLOCK_C), axis=1), C - 1)
    tl.store(score_ptr + rows, tl.where(best < 0.0, 0.0, best), mask=row_mask)
    tl.store(nearest_ptr + rows, nearest.to(tl.int64), mask=row_mask)


def block_classes(c: int) -> int:
    """The class dimension of the register tile: a power of two >= C, at least 16 (for tl.dot)."""
    return max(16, triton.next_power_of_2(c))


def dot_in_float32(dtype: torch.dtype, interpreted: bool = False) -> bool:
    """Whether the whitening GEMM multiplies in float32 (tf32x3) rather than in x's dtype.

    float16 does: a whitener's entries (1 / sigma) can overflow it. The interpreter mishandles
    bfloat16 arithmetic, so there bfloat16 does too.
    """
    return interpreted or dtype != torch.bfloat16


def config_space(b: int, d: int, c: int) -> list[Config]:
    """The configs an autotuner may try (``triton_impl.autotune``): the heuristic's, then row
    blocks of 16 to 128 while the class dot products stay within 32 x 256 floats, 16- and 32-wide
    tiles (64 spilled), 4 or 8 warps."""
    small, classes = max(16, triton.next_power_of_2(d)), block_classes(c)
    return autotune.space(default_config(b, d, c), lambda config: config.block_b * classes <= 32 * 256
                          and max(config.block_n, config.block_k) <= small,
                          block_b=(16, 32, 64, 128), block_n=(16, 32), block_k=(16, 32), num_warps=(4, 8))


def mahalanobis_min(x, center, whitener, class_proj, class_sq, config: Config | None = None):
    """The fused kernel on CUDA/XPU tensors, or interpreted on CPU tensors.

    Contract: ``torch_kernels.reference.ood.mahalanobis_min``. On a GPU float32 and float16
    ``x`` multiply in float32 (tf32x3); bfloat16 ``x`` with the whitener rounded to bfloat16,
    accumulating in float32.
    """
    if x.dtype == torch.float64:
        raise NotImplementedError("triton: float64 inputs are not supported")
    b, d = x.shape
    c = class_proj.shape[0]
    if c > MAX_CLASSES:
        raise NotImplementedError(f"triton: at most {MAX_CLASSES} classes, got {c}")
    dot_f32 = dot_in_float32(x.dtype, interpreted=x.device.type == "cpu")
    whitener = whitener.to(torch.float32 if dot_f32 else x.dtype).contiguous()
    config = config or autotune.choose(
        "ood.mahalanobis_min", x.device, dict(b=b, d=d, c=c, dtype=x.dtype), lambda: default_config(b, d, c),
        lambda: config_space(b, d, c), lambda: mahalanobis_min(x, center, whitener, class_proj, class_sq))
    score = torch.empty(b, dtype=torch.float32, device=x.device)
    nearest = torch.empty(b, dtype=torch.int64, device=x.device)
    kernel = for_device(mahalanobis_min_kernel, x.device)
    kernel[(triton.cdiv(b, config.block_b),)](
        x, center, whitener, class_proj, class_sq, score, nearest,
        b, d, c, x.stride(0), whitener.stride(0), class_proj.stride(0),
        BLOCK_B=config.block_b, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        BLOCK_C=block_classes(c), DOT_F32=dot_f32, num_warps=config.num_warps,
    )
    return score, nearest


def compile_targets(dtype: torch.dtype, c: int = 1):
    """(signature, constexprs, num_warps) to build the kernel ahead of time for ``dtype`` x."""
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    x_type = "*" + names[dtype]
    w_type = "*fp32" if dot_in_float32(dtype) else x_type
    signature = {
        "x_ptr": x_type, "center_ptr": "*fp32", "w_ptr": w_type, "proj_ptr": "*fp32",
        "class_sq_ptr": "*fp32", "score_ptr": "*fp32", "nearest_ptr": "*i64",
        "B": "i32", "D": "i32", "C": "i32", "stride_x": "i32", "stride_w": "i32", "stride_proj": "i32",
        "BLOCK_B": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "BLOCK_C": "constexpr",
        "DOT_F32": "constexpr",
    }
    config = default_config(4096, 1024, c)
    constexprs = {
        "BLOCK_B": config.block_b, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
        "BLOCK_C": block_classes(c), "DOT_F32": dot_in_float32(dtype),
    }
    return signature, constexprs, config.num_warps


# ---- EDM diffusion scoring ----
#
# One program owns BLOCK_B rows and runs the whole denoiser at every noise level for them, layer
# after layer as tiled GEMMs: the input layer over feature tiles, each residual block as two GEMMs
# over the hidden width, the output layer over feature tiles folded straight into the rows' error.
# A layer's activations go to the program's own rows of a scratch buffer (a few KB, in L1/L2 on a
# GPU), which the next layer reads back tile by tile after a barrier; only the [B] scores reach the
# caller. With SCOPED, a tangent rides along every GEMM (one Jacobian-vector product per level).


@dataclasses.dataclass(frozen=True)
class EDMConfig:
    """Tile sizes of one ``edm_score`` launch: rows per program, feature tile, hidden tiles."""

    block_b: int = 16
    block_d: int = 32
    block_n: int = 32
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 1


def edm_default_config(d: int, h: int) -> EDMConfig:
    """Heuristic: 16 rows per program, 32-wide tiles (shrunk to small widths), no software
    pipelining: compiled for sm_90 that takes 122 registers (188 with the tangent) and spills
    nothing, where Triton's default 3 stages spilled at 255 registers."""
    small_d, small_h = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(h))
    return EDMConfig(block_d=min(32, small_d), block_n=min(32, small_h), block_k=min(32, small_h))


@triton.jit
def _silu_and_slope(h):
    gate = tl.sigmoid(h)
    return h * gate, gate * (1.0 + h * (1.0 - gate))


@triton.jit
def _standardized(x_ptr, mean_ptr, inv_scale_ptr, noise_ptr, rows, row_mask, cols, col_mask, stride_x, level, D):
    """(y, noise) of one feature tile: y = (x - mean) * inv_scale, zero outside the rows and features."""
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=row_mask[:, None] & col_mask[None, :],
                other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + cols, mask=col_mask, other=0.0)
    inv_scale = tl.load(inv_scale_ptr + cols, mask=col_mask, other=0.0)
    noise = tl.load(noise_ptr + level * D + cols, mask=col_mask, other=0.0)
    y = tl.where(row_mask[:, None] & col_mask[None, :], (x - mean[None, :]) * inv_scale[None, :], 0.0)
    return y, noise


@triton.jit
def _hidden_gemm(src_ptr, tangent_ptr, w_ptr, w_stride, cols, col_mask, H,
                 BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACTIVATE: tl.constexpr,
                 SCOPED: tl.constexpr):
    """``act(src) @ w[:, cols]`` over the program's [BLOCK_B, H] scratch rows ``src`` (act: silu if
    ACTIVATE), and with SCOPED the tangent's ``(act'(src) * tangent) @ w[:, cols]``."""
    local = tl.arange(0, BLOCK_B)
    acc = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
    tacc = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
    for i0 in range(0, H, BLOCK_K):
        inner = i0 + tl.arange(0, BLOCK_K)
        inner_mask = inner < H
        a = tl.load(src_ptr + local[:, None] * H + inner[None, :], mask=inner_mask[None, :], other=0.0)
        w = tl.load(w_ptr + inner[:, None] * w_stride + cols[None, :], mask=inner_mask[:, None] & col_mask[None, :],
                    other=0.0)
        if ACTIVATE:
            a, slope = _silu_and_slope(a)
        if SCOPED:
            ta = tl.load(tangent_ptr + local[:, None] * H + inner[None, :], mask=inner_mask[None, :], other=0.0)
            if ACTIVATE:
                ta = slope * ta
            tacc = tl.dot(ta, w, tacc, input_precision="tf32x3")
        acc = tl.dot(a, w, acc, input_precision="tf32x3")
    return acc, tacc


@triton.jit
def edm_score_kernel(
    x_ptr, mean_ptr, inv_scale_ptr, coef_ptr, noise_ptr, level_weight_ptr, level_bias_ptr,
    w_in_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, w_out_ptr, b_out_ptr, score_ptr, scratch_ptr,
    B, D, H, L, K, stride_x,
    BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCOPED: tl.constexpr,
):
    """Scores of rows ``[pid * BLOCK_B, (pid + 1) * BLOCK_B)`` (the section comment above).

    ``scratch_ptr``: float32, ``[programs, 4 (hidden, inner and their tangents), BLOCK_B, H]``.
    """
    pid = tl.program_id(0).to(tl.int64)
    local = tl.arange(0, BLOCK_B)
    rows = pid * BLOCK_B + local
    row_mask = rows < B
    h_ptr = scratch_ptr + pid * 4 * BLOCK_B * H
    t_ptr = h_ptr + BLOCK_B * H
    th_ptr = t_ptr + BLOCK_B * H
    tt_ptr = th_ptr + BLOCK_B * H
    total = tl.zeros([BLOCK_B], tl.float32)
    for level in range(L):
        sigma = tl.load(coef_ptr + 4 * level)
        c_in = tl.load(coef_ptr + 4 * level + 1)
        c_skip = tl.load(coef_ptr + 4 * level + 2)
        c_out = tl.load(coef_ptr + 4 * level + 3)
        # input layer: h = c_in (y [+ sigma n]) @ w_in + level_bias; the tangent's input is c_in n
        for n0 in range(0, H, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_mask = cols < H
            acc = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
            tacc = tl.zeros([BLOCK_B, BLOCK_N], tl.float32)
            for d0 in range(0, D, BLOCK_D):
                features = d0 + tl.arange(0, BLOCK_D)
                feature_mask = features < D
                y, noise = _standardized(x_ptr, mean_ptr, inv_scale_ptr, noise_ptr, rows, row_mask, features,
                                         feature_mask, stride_x, level, D)
                w = tl.load(w_in_ptr + features[:, None] * H + cols[None, :],
                            mask=feature_mask[:, None] & col_mask[None, :], other=0.0)
                if SCOPED:
                    acc = tl.dot(c_in * y, w, acc, input_precision="tf32x3")
                    tangent = tl.zeros([BLOCK_B, BLOCK_D], tl.float32) + c_in * noise[None, :]
                    tacc = tl.dot(tangent, w, tacc, input_precision="tf32x3")
                else:
                    acc = tl.dot(c_in * (y + sigma * noise[None, :]), w, acc, input_precision="tf32x3")
            acc += tl.load(level_bias_ptr + level * H + cols, mask=col_mask, other=0.0)[None, :]
            tl.store(h_ptr + local[:, None] * H + cols[None, :], acc, mask=col_mask[None, :])
            if SCOPED:
                tl.store(th_ptr + local[:, None] * H + cols[None, :], tacc, mask=col_mask[None, :])
        tl.debug_barrier()
        # residual blocks: t = silu(silu(h) @ w1[k] + b1[k]), then h += t @ w2[k] + b2[k]
        for k in range(K):
            for n0 in range(0, H, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                col_mask = cols < H
                z, tz = _hidden_gemm(h_ptr, th_ptr, w1_ptr + k * H * H, H, cols, col_mask, H,
                                     BLOCK_B, BLOCK_N, BLOCK_K, True, SCOPED)
                z += tl.load(b1_ptr + k * H + cols, mask=col_mask, other=0.0)[None, :]
                t, z_slope = _silu_and_slope(z)
                tl.store(t_ptr + local[:, None] * H + cols[None, :], t, mask=col_mask[None, :])
                if SCOPED:
                    tl.store(tt_ptr + local[:, None] * H + cols[None, :], z_slope * tz, mask=col_mask[None, :])
            tl.debug_barrier()
            for n0 in range(0, H, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                col_mask = cols < H
                update, tangent_update = _hidden_gemm(t_ptr, tt_ptr, w2_ptr + k * H * H, H, cols, col_mask, H,
                                                      BLOCK_B, BLOCK_N, BLOCK_K, False, SCOPED)
                update += tl.load(b2_ptr + k * H + cols, mask=col_mask, other=0.0)[None, :]
                here = local[:, None] * H + cols[None, :]
                tl.store(h_ptr + here, tl.load(h_ptr + here, mask=col_mask[None, :], other=0.0) + update,
                         mask=col_mask[None, :])
                if SCOPED:
                    tl.store(th_ptr + here, tl.load(th_ptr + here, mask=col_mask[None, :], other=0.0) + tangent_update,
                             mask=col_mask[None, :])
            tl.debug_barrier()
        # output layer F = silu(h) @ w_out + b_out, folded into the level's error tile by tile
        error = tl.zeros([BLOCK_B], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            features = d0 + tl.arange(0, BLOCK_D)
            feature_mask = features < D
            f, tf = _hidden_gemm(h_ptr, th_ptr, w_out_ptr, D, features, feature_mask, H,
                                 BLOCK_B, BLOCK_D, BLOCK_K, True, SCOPED)
            f += tl.load(b_out_ptr + features, mask=feature_mask, other=0.0)[None, :]
            y, noise = _standardized(x_ptr, mean_ptr, inv_scale_ptr, noise_ptr, rows, row_mask, features,
                                     feature_mask, stride_x, level, D)
            if SCOPED:
                residual = tl.where(feature_mask[None, :], c_skip * y + c_out * f - y, 0.0)
                error += (tl.sum(residual * residual, axis=1) / (sigma * sigma)
                          + tl.sum(c_out * tf * noise[None, :], axis=1) + (c_skip - 1.0) * tl.sum(noise * noise))
            else:
                residual = tl.where(feature_mask[None, :], c_skip * (y + sigma * noise[None, :]) + c_out * f - y, 0.0)
                error += tl.sum(residual * residual, axis=1)
        total += tl.load(level_weight_ptr + level) * error
        tl.debug_barrier()  # every tile read h before the next level writes it
    tl.store(score_ptr + rows, total, mask=row_mask)


def edm_config_space(d: int, h: int) -> list[EDMConfig]:
    """The configs an autotuner may try: the heuristic's, then 16 or 32 rows per program, 32- and
    64-wide tiles no wider than the problem, 4 or 8 warps, one stage (three spilled)."""
    small_d, small_h = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(h))
    return autotune.space(edm_default_config(d, h), lambda config: config.block_d <= small_d
                          and max(config.block_n, config.block_k) <= small_h,
                          block_b=(16, 32), block_d=(32, 64), block_n=(32, 64), block_k=(32,), num_warps=(4, 8))


def edm_score_levels(x, mean, inv_scale, coefficients, noise, level_weights, level_bias, w_in, w1, b1, w2, b2,
                     w_out, b_out, scoped, config: EDMConfig | None = None):
    """The fused kernel on CUDA/XPU tensors, or interpreted on CPU tensors.

    Contract: ``torch_kernels.reference.ood.edm_score_levels``. Multiplies in float32 (tf32x3 on
    tensor cores), whatever ``x``'s dtype.
    """
    if x.dtype == torch.float64:
        raise NotImplementedError("triton: float64 inputs are not supported")
    b, d = x.shape
    h, k = w_in.shape[1], w1.shape[0]
    config = config or autotune.choose(
        "ood.edm_score", x.device, dict(b=b, d=d, h=h, scoped=scoped, dtype=x.dtype), lambda: edm_default_config(d, h),
        lambda: edm_config_space(d, h),
        lambda: edm_score_levels(x, mean, inv_scale, coefficients, noise, level_weights, level_bias, w_in, w1, b1, w2,
                                 b2, w_out, b_out, scoped))
    programs = triton.cdiv(b, config.block_b)
    score = torch.empty(b, dtype=torch.float32, device=x.device)
    scratch = torch.empty(programs * 4 * config.block_b * h, dtype=torch.float32, device=x.device)
    kernel = for_device(edm_score_kernel, x.device)
    kernel[(programs,)](
        x, mean, inv_scale, coefficients, noise, level_weights, level_bias, w_in, w1, b1, w2, b2, w_out, b_out,
        score, scratch, b, d, h, coefficients.shape[0], k, x.stride(0),
        BLOCK_B=config.block_b, BLOCK_D=config.block_d, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SCOPED=scoped, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return score


def edm_compile_targets(dtype: torch.dtype, scoped: bool, hidden: int = 512, features: int = 1024):
    """(signature, constexprs, config) to build ``edm_score_kernel`` ahead of time for ``dtype`` x."""
    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    pointers = ("x_ptr", "mean_ptr", "inv_scale_ptr", "coef_ptr", "noise_ptr", "level_weight_ptr",
                "level_bias_ptr", "w_in_ptr", "w1_ptr", "b1_ptr", "w2_ptr", "b2_ptr", "w_out_ptr", "b_out_ptr",
                "score_ptr", "scratch_ptr")
    signature = {name: "*fp32" for name in pointers}
    signature["x_ptr"] = "*" + names[dtype]
    signature.update(dict.fromkeys(("B", "D", "H", "L", "K", "stride_x"), "i32"))
    signature.update(dict.fromkeys(("BLOCK_B", "BLOCK_D", "BLOCK_N", "BLOCK_K", "SCOPED"), "constexpr"))
    config = edm_default_config(features, hidden)
    constexprs = {"BLOCK_B": config.block_b, "BLOCK_D": config.block_d, "BLOCK_N": config.block_n,
                  "BLOCK_K": config.block_k, "SCOPED": scoped}
    return signature, constexprs, config


def compile_groups(everything: bool) -> dict:
    """The compile report's builds of this family: ``{group id: function of an arch returning its
    builds}``, a build being ``compile_report.Build``'s fields but ``family``. One group, the same
    with and without ``everything``: Mahalanobis scoring at 1 and 150 classes and EDM scoring
    (denoise and scoped) for every dtype (the same configs on every arch)."""
    from . import dtype_name

    def builds(arch: int = 90) -> list[dict]:
        found = []
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for classes in (1, 150):
                signature, constexprs, num_warps = compile_targets(dtype, classes)
                found.append(dict(label=f"mahalanobis_min {dtype_name(dtype)} C={classes}",
                                  kernel=mahalanobis_min_kernel, signature=signature, constexprs=constexprs,
                                  num_warps=num_warps, num_stages=None))
            for scoped in (False, True):
                signature, constexprs, config = edm_compile_targets(dtype, scoped)
                found.append(dict(label=f"edm_score {dtype_name(dtype)} {'scoped' if scoped else 'denoise'} H=512",
                                  kernel=edm_score_kernel, signature=signature, constexprs=constexprs,
                                  num_warps=config.num_warps, num_stages=config.num_stages))
        return found

    return {"ood": builds}

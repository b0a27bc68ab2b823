"""Mahalanobis scoring as one fused Triton kernel.

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

from . import for_device

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
    64-wide ones spilled (ptxas fell back to 32 registers at 150 classes)."""
    small = max(16, triton.next_power_of_2(d))
    if c > 64:
        return Config(block_b=32, block_n=min(16, small), block_k=min(32, small), num_warps=8)
    return Config(block_b=64 if b > 32 else 16, block_n=min(32, small), block_k=min(32, small), num_warps=4)


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
    config = config or default_config(b, d, c)
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

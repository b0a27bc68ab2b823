"""Mahalanobis and EDM scoring, each one fused SYCL kernel (``ood.cl``), run from SPIR-V."""

from __future__ import annotations

import ctypes

import torch

from . import _runtime

TILE = 16  # a work-group is TILE x TILE work-items
_X_KINDS = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}


def _local_bytes(rows_per_item: int, max_c: int, acc_bytes: int) -> int:
    rows = TILE * rows_per_item  # mirrors the __local arrays of ood.cl
    return (2 * rows * (TILE + 1) + TILE * TILE + rows * max_c + rows * TILE) * acc_bytes + rows * TILE * 4


def _layout(b: int, c: int, acc_bytes: int, local_bytes: int) -> tuple[int, int]:
    """(RB, MAX_C): rows per work-item, and the class count the local dot products are sized for.

    MAX_C is a power of two so that a handful of builds serve every C. Four rows per work-item
    (64 per group) reuse each tile of W; a small batch takes one.
    """
    max_c = 1
    while max_c < c:
        max_c *= 2
    rows_per_item = 4 if b > TILE else 1
    while rows_per_item and _local_bytes(rows_per_item, max_c, acc_bytes) > local_bytes:
        rows_per_item //= 2
    if not rows_per_item:
        raise NotImplementedError(f"sycl: {c} classes do not fit the device's {local_bytes} bytes of local memory")
    return rows_per_item, max_c


def _macros(x_dtype: torch.dtype, rows_per_item: int, max_c: int) -> dict[str, int]:
    return {"X_KIND": _X_KINDS[x_dtype], "ACC_F64": int(x_dtype == torch.float64),
            "TILE": TILE, "RB": rows_per_item, "MAX_C": max_c}


def mahalanobis_min(x, center, whitener, class_proj, class_sq):
    """The fused kernel on CPU tensors, run on the ``opencl:cpu`` SYCL device.

    Contract: ``torch_kernels.reference.ood.mahalanobis_min``. Accumulates in float32 (float64
    for float64 inputs), with the whitener in that dtype.
    """
    if x.device.type != "cpu":
        # Torch XPU tensors would be passed zero-copy through DLPack; that path is not built yet.
        raise NotImplementedError(f"sycl: only CPU tensors (run on the opencl:cpu device) are supported, got {x.device}")
    acc = center.dtype
    b, d = x.shape
    c = class_proj.shape[0]
    rows_per_item, max_c = _layout(b, c, torch.empty((), dtype=acc).element_size(), _runtime.local_memory_bytes())
    kernel = _runtime.kernel("ood.cl", "mahalanobis_min", **_macros(x.dtype, rows_per_item, max_c))
    inputs = [_runtime.usm_copy(t.contiguous()) for t in (x, center, whitener.to(acc), class_proj, class_sq)]
    score_mem, score = _runtime.usm_empty((b,), acc)
    nearest_mem, nearest = _runtime.usm_empty((b,), torch.int64)
    args = [mem for mem, _ in inputs] + [score_mem, nearest_mem, ctypes.c_int(b), ctypes.c_int(d), ctypes.c_int(c)]
    groups = -(-b // (TILE * rows_per_item))
    # SYCL ranges list the slowest dimension first: OpenCL dimension 0 (columns, row blocks) is last.
    _runtime.host_queue().submit(kernel, args, [TILE, groups * TILE], [TILE, TILE]).wait()
    return score, nearest


def self_check() -> None:
    """Runs the kernel once against the definition (the distance of each row to its nearest class
    mean, whitened: ``min_c ||(x - mean_c) W||^2``); raises if the two disagree."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 5, generator=gen)
    means = torch.randn(3, 5, generator=gen)
    whitener = torch.randn(5, 5, generator=gen).triu()
    center = means.mean(dim=0)
    class_proj = (means - center) @ whitener
    distances = ((x[:, None, :] - means[None]) @ whitener).square().sum(dim=-1)
    expected = distances.min(dim=1)
    got = mahalanobis_min(x, center, whitener, class_proj, class_proj.square().sum(dim=1))
    if not (torch.allclose(got[0], expected[0], rtol=1e-4, atol=1e-4) and torch.equal(got[1], expected[1])):
        raise RuntimeError("the SYCL self-check disagrees with the reference")


def spirv_binaries() -> list[bytes]:
    """The SPIR-V modules for every x dtype at one layout (built, cached)."""
    return [_runtime.spirv("ood.cl", _macros(dtype, 4, 256)) for dtype in _X_KINDS]


# ---- EDM diffusion scoring ----

EDM_WORK_GROUP = 64  # work-items per group: each owns columns lid, lid + 64, ... of every layer


def _edm_local_bytes(rows: int, max_h: int, scoped: bool, acc_bytes: int) -> int:
    # mirrors the __local arrays of edm_score_levels: three (six with tangents) [RB][MAX_H], and red
    return ((6 if scoped else 3) * rows * max_h + rows * EDM_WORK_GROUP) * acc_bytes


def _edm_layout(b: int, h: int, scoped: bool, acc_bytes: int, local_bytes: int) -> tuple[int, int]:
    """(RB, MAX_H): rows per work-group (4, or 1 for a single row; fewer if local memory is short)
    and the hidden width the local arrays are sized for (a power of two, so few builds serve all)."""
    max_h = 16
    while max_h < h:
        max_h *= 2
    rows = 4 if b > 1 else 1
    while rows and _edm_local_bytes(rows, max_h, scoped, acc_bytes) > local_bytes:
        rows //= 2
    if not rows:
        raise NotImplementedError(f"sycl: hidden width {h} does not fit the device's {local_bytes} bytes of local memory")
    return rows, max_h


def _edm_macros(x_dtype: torch.dtype, rows: int, max_h: int, scoped: bool) -> dict[str, int]:
    return {"X_KIND": _X_KINDS[x_dtype], "ACC_F64": int(x_dtype == torch.float64), "RB": rows, "MAX_H": max_h,
            "WG": EDM_WORK_GROUP, "SCOPED": int(scoped)}


def edm_score_levels(x, mean, inv_scale, coefficients, noise, level_weights, level_bias, w_in, w1, b1, w2, b2,
                     w_out, b_out, scoped):
    """The fused kernel on CPU tensors, run on the ``opencl:cpu`` SYCL device.

    Contract: ``torch_kernels.reference.ood.edm_score_levels``. Computes in float32 (float64 for
    float64 inputs).
    """
    if x.device.type != "cpu":
        raise NotImplementedError(f"sycl: only CPU tensors (run on the opencl:cpu device) are supported, got {x.device}")
    acc = coefficients.dtype
    b, d = x.shape
    h, k = w_in.shape[1], w1.shape[0]
    rows, max_h = _edm_layout(b, h, scoped, torch.empty((), dtype=acc).element_size(), _runtime.local_memory_bytes())
    kernel = _runtime.kernel("ood.cl", "edm_score_levels", **_edm_macros(x.dtype, rows, max_h, scoped))
    tensors = (x, mean, inv_scale, coefficients, noise, level_weights, level_bias, w_in, w1, b1, w2, b2, w_out, b_out)
    inputs = [_runtime.usm_copy(t.contiguous()) for t in tensors]
    score_mem, score = _runtime.usm_empty((b,), acc)
    args = [mem for mem, _ in inputs] + [score_mem] + [ctypes.c_int(v) for v in (b, d, h, coefficients.shape[0], k)]
    groups = -(-b // rows)
    _runtime.host_queue().submit(kernel, args, [groups * EDM_WORK_GROUP], [EDM_WORK_GROUP]).wait()
    return score


def edm_spirv_binaries() -> list[bytes]:
    """The SPIR-V modules of ``edm_score_levels`` for every x dtype and statistic at one layout."""
    return [_runtime.spirv("ood.cl", _edm_macros(dtype, 4, 512, scoped)) for dtype in _X_KINDS
            for scoped in (False, True)]

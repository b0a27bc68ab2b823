"""Mahalanobis scoring as one fused SYCL kernel (``ood.cl``), run from SPIR-V."""

from __future__ import annotations

import ctypes

import torch

from . import _runtime

GROUP = 64  # work-items per work-group
_X_KINDS = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}


def _layout(b: int, d: int, acc_bytes: int, local_bytes: int) -> tuple[int, int]:
    """(ROWS, MAX_D): rows per work-group and the padded feature size of the local arrays.

    MAX_D is a power of two so that a handful of builds serve every D. Several rows per group
    reuse each read of the whitener; a tiny batch takes one.
    """
    max_d = 32
    while max_d < d:
        max_d *= 2
    rows = 8 if b >= 8 else 1
    while rows and (2 * rows * max_d + rows * GROUP) * acc_bytes + rows * GROUP * 4 > local_bytes:
        rows //= 2
    if not rows:
        raise NotImplementedError(f"sycl: D={d} does not fit the device's {local_bytes} bytes of local memory")
    return rows, max_d


def _macros(x_dtype: torch.dtype, rows: int, max_d: int) -> dict[str, int]:
    return {"X_KIND": _X_KINDS[x_dtype], "ACC_F64": int(x_dtype == torch.float64),
            "ROWS": rows, "GROUP": GROUP, "MAX_D": max_d}


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
    rows, max_d = _layout(b, d, torch.empty((), dtype=acc).element_size(), _runtime.local_memory_bytes())
    kernel = _runtime.kernel("ood.cl", "mahalanobis_min", **_macros(x.dtype, rows, max_d))
    inputs = [_runtime.usm_copy(t.contiguous()) for t in (x, center, whitener.to(acc), class_proj, class_sq)]
    score_mem, score = _runtime.usm_empty((b,), acc)
    nearest_mem, nearest = _runtime.usm_empty((b,), torch.int64)
    args = [mem for mem, _ in inputs] + [score_mem, nearest_mem, ctypes.c_int(b), ctypes.c_int(d), ctypes.c_int(c)]
    groups = -(-b // rows)
    _runtime.host_queue().submit(kernel, args, [groups * GROUP], [GROUP]).wait()
    return score, nearest


def self_check() -> None:
    """Runs the kernel once against the reference; raises if the two disagree."""
    from torch_kernels.reference import ood as reference

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 5, generator=gen)
    means = torch.randn(3, 5, generator=gen)
    whitener = torch.randn(5, 5, generator=gen).triu()
    terms = reference.class_terms(means, whitener, torch.float32)
    expected = reference.mahalanobis_min(x, terms[0], whitener, *terms[1:])
    got = mahalanobis_min(x, terms[0], whitener, *terms[1:])
    if not (torch.allclose(got[0], expected[0], rtol=1e-4, atol=1e-4) and torch.equal(got[1], expected[1])):
        raise RuntimeError("the SYCL self-check disagrees with the reference")


def spirv_binaries() -> list[bytes]:
    """The SPIR-V modules for every x dtype at one batch and feature layout (built, cached)."""
    return [_runtime.spirv("ood.cl", _macros(dtype, 8, 128)) for dtype in _X_KINDS]

"""Mahalanobis scoring in plain PyTorch.

``mahalanobis_score_naive`` is the definition, written for reading. ``mahalanobis_min`` is the
reference backend's kernel (the CPU default): the same numbers in the form every backend's fused
kernel computes, checked against the definition in the tests.
"""

from __future__ import annotations

import functools

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores and accumulators are float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without its cost (about 0.6 us) when ``t`` already has that dtype."""
    return t if t.dtype == dtype else t.to(dtype)


def mahalanobis_score_naive(x: torch.Tensor, means: torch.Tensor, whitener: torch.Tensor) -> torch.Tensor:
    """min over classes c of ||(x - means[c]) @ whitener||^2, one class at a time."""
    dtype = compute_dtype(x.dtype)
    x, means, whitener = x.to(dtype), means.to(dtype), whitener.to(dtype)
    per_class = [((x - mean) @ whitener).square().sum(dim=1) for mean in means]
    return torch.stack(per_class, dim=1).min(dim=1).values


def class_terms(means: torch.Tensor, whitener: torch.Tensor, dtype: torch.dtype):
    """The per-class part of the fused form, computed once per call.

    Rows are centred on the mean of the class means before whitening, so that for one class the
    fused form is exactly ||(x - mean) W||^2 and for several the expansion
    ||y||^2 - 2 y.p_c + ||p_c||^2 cancels only the (small) spread of the class means.
    Returns ``center [D]``, ``class_proj [C, D]`` (= (means - center) W) and ``class_sq [C]``.
    """
    means = as_dtype(means, dtype)
    if means.shape[0] == 1:  # the common label-free case: nothing to whiten
        return (means[0], *_zero_class_terms(means.shape[1], dtype, means.device))
    center = means.mean(dim=0)
    class_proj = (means - center) @ as_dtype(whitener, dtype)
    return center, class_proj, class_proj.square().sum(dim=1)


@functools.lru_cache(maxsize=32)
def _zero_class_terms(d: int, dtype: torch.dtype, device: torch.device):
    # Read-only inputs of the kernels, shared by every label-free call instead of allocated per call
    # (made outside inference mode so that they may meet autograd-tracked tensors).
    with torch.inference_mode(False):
        return torch.zeros(1, d, dtype=dtype, device=device), torch.zeros(1, dtype=dtype, device=device)


def mahalanobis_min(
    x: torch.Tensor,
    center: torch.Tensor,
    whitener: torch.Tensor,
    class_proj: torch.Tensor,
    class_sq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend kernel contract of ``mahalanobis_score``.

    ``y = (x - center) @ whitener``; ``d[b, c] = ||y_b||^2 - 2 y_b . class_proj[c] + class_sq[c]``;
    returns ``(max(min_c d, 0), argmin_c d)`` as (float32 or float64 ``[B]``, int64 ``[B]``).
    """
    dtype = center.dtype
    y = (as_dtype(x, dtype) - center) @ as_dtype(whitener, dtype)
    if class_proj.shape[0] == 1:  # y . (y - 2 p) + ||p||^2, without a [B, 1] matrix
        score = torch.linalg.vecdot(y, torch.sub(y, class_proj, alpha=2.0)).add_(class_sq)
        return score.clamp_(min=0.0), torch.zeros(y.shape[0], dtype=torch.int64, device=y.device)
    distances = torch.addmm(class_sq, y, class_proj.T, alpha=-2.0)
    distances += y.square().sum(dim=1, keepdim=True)
    score, nearest = distances.min(dim=1)
    return score.clamp_(min=0.0), nearest

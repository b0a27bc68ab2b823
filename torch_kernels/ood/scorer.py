"""What every fitted OOD scorer module shares: fitted state that keeps its dtype, and thresholds."""

from __future__ import annotations

import torch
from torch import nn


class FittedScorer(nn.Module):
    """Base of ``MahalanobisScorer`` and ``EDMScorer``: a subclass defines ``fitted`` and
    ``forward`` (its ``[B]`` scores, higher meaning less in-distribution).

    The protocol both share: ``score(x)`` gives plain scores, ready for ``.numpy()``, ``.tolist()``
    or a comparison, with no autograd graph through the scorer's own weights; when ``x`` requires
    grad the scores do too, differentiable in ``x`` alone. Calling the module (``forward``) is
    differentiable in ``x`` and in the scorer's parameters (an EDM scorer fine-tuned inside a model).
    """

    @property
    def fitted(self) -> bool:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        # .half(), .double() or .to(dtype) on a model holding a scorer must not round the fitted
        # state: it only follows the device (scoring converts what it needs per call).
        def move_only(t):
            moved = fn(t)
            return moved if moved.dtype == t.dtype else t.to(device=moved.device)

        return super()._apply(move_only, recurse)

    def _require_fitted(self) -> None:
        if not self.fitted:
            raise RuntimeError(f"{type(self).__name__}: call fit() (or load_state_dict()) before scoring")

    def score(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """``[B]`` scores of ``x [B, D]``, the module's ``forward`` (same arguments) without a graph
        through the scorer's parameters: one to ``x`` only when ``x`` requires grad, none otherwise."""
        if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
            frozen = {name: p.detach() for name, p in self.named_parameters()}
            return torch.func.functional_call(self, frozen, (x, *args), kwargs)
        with torch.no_grad():
            return self(x, *args, **kwargs)

    def threshold(self, features: torch.Tensor, tpr: float = 0.95) -> float:
        """The score below which a fraction ``tpr`` of held-out in-distribution ``features`` fall."""
        if not isinstance(tpr, (int, float)) or isinstance(tpr, bool):
            raise TypeError(f"tpr: expected a float fraction in (0, 1], got {type(tpr).__name__} {tpr!r}")
        if not 0.0 < tpr <= 1.0:
            raise ValueError(f"tpr: expected a fraction in (0, 1], got {tpr!r}")
        scores = self.score(features).to(torch.float64)
        if scores.numel() == 0:
            raise ValueError("features: expected at least one row, got none")
        if not torch.isfinite(scores).all():
            raise ValueError("features: NaN or inf features give scores no threshold can be taken from")
        # torch.quantile's linear interpolation, by sorting (quantile refuses over 2**24 rows)
        ordered = scores.sort().values
        position = tpr * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return (ordered[low] + (position - low) * (ordered[high] - ordered[low])).item()

"""How well a scorer tells in-distribution features from out-of-distribution ones, in torch.

>>> metrics = evaluate(EDMScorer().fit(train), in_scope_test, out_of_scope_test)
>>> metrics.auroc, metrics.fpr95, metrics.aupr

The numbers equal scikit-learn's (``roc_auc_score``, ``roc_curve``, ``average_precision_score``),
ties included; the tests hold them to it.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch

from .. import _checks

__all__ = ["OODScorer", "OODMetrics", "evaluate", "ood_metrics", "roc_curve"]


@runtime_checkable
class OODScorer(Protocol):
    """What the evaluation and the serving gate need of a scorer (``MahalanobisScorer``, ``EDMScorer``)."""

    def fit(self, features, *args, **kwargs) -> "OODScorer":
        """Fit on in-distribution ``[N, D]`` features (or an iterable of batches); returns the scorer."""

    def score(self, x: torch.Tensor) -> torch.Tensor:
        """``[B]`` scores of ``x [B, D]``; higher means less in-distribution. A plain tensor (no
        graph through the scorer's weights) for an ``x`` that does not require grad."""

    def threshold(self, features: torch.Tensor, tpr: float = 0.95) -> float:
        """The score below which a fraction ``tpr`` of held-out in-distribution ``features`` fall."""


class OODMetrics(NamedTuple):
    """Detection quality, out-of-distribution being the positive class of a higher score.

    ``auroc``: area under the ROC curve. ``fpr95``: the fraction of out-of-distribution rows
    accepted at the first threshold that accepts 95% of the in-distribution rows (``roc_curve``
    with in-distribution positive). ``aupr``: average precision of detecting out-of-distribution
    rows (AUPR-Out); ``aupr_in``: of detecting in-distribution rows by a low score (AUPR-In).
    """

    auroc: float
    fpr95: float
    aupr: float
    aupr_in: float


def evaluate(scorer: OODScorer, id_x: torch.Tensor, ood_x: torch.Tensor) -> OODMetrics:
    """Score in-distribution rows ``id_x`` and out-of-distribution rows ``ood_x`` with ``scorer``;
    their :class:`OODMetrics`."""
    if not callable(getattr(scorer, "score", None)):
        raise TypeError(f"scorer: expected an object with score(x [B, D]) -> [B], got {type(scorer).__name__}")
    with torch.no_grad():
        return ood_metrics(scorer.score(id_x), scorer.score(ood_x))


def ood_metrics(id_scores: torch.Tensor, ood_scores: torch.Tensor) -> OODMetrics:
    """:class:`OODMetrics` of scores already computed (``[N_id]`` and ``[N_ood]``)."""
    id_scores, ood_scores = _check_scores(id_scores, ood_scores)
    fpr, tpr, _ = _curve(id_scores, ood_scores)
    auroc = torch.trapezoid(tpr, fpr).item()
    # in distribution positive, accepted by a low score: the first threshold accepting 95% of it
    _, id_accepted, ood_accepted = _counts(-id_scores, -ood_scores)
    first = torch.searchsorted(id_accepted / len(id_scores), torch.tensor(0.95, dtype=torch.float64))
    fpr95 = (ood_accepted[first] / len(ood_scores)).item()
    return OODMetrics(auroc, fpr95, _average_precision(ood_scores, id_scores), _average_precision(-id_scores, -ood_scores))


def roc_curve(id_scores: torch.Tensor, ood_scores: torch.Tensor):
    """``(fpr, tpr, thresholds)`` float64, out-of-distribution positive: row ``i`` counts the rows
    scored at or above ``thresholds[i]`` (descending; the first point is ``(0, 0)`` at ``inf``),
    as scikit-learn's ``roc_curve(..., drop_intermediate=False)``."""
    return _curve(*_check_scores(id_scores, ood_scores))


def _check_scores(id_scores, ood_scores):
    checked = []
    for name, scores in (("id_scores", id_scores), ("ood_scores", ood_scores)):
        _checks.tensor(name, scores, ndim=1, dtypes=_checks.FLOAT_DTYPES)
        if scores.numel() == 0:
            raise ValueError(f"{name}: expected at least one score, got none")
        if not torch.isfinite(scores).all():
            raise ValueError(f"{name}: expected finite scores, got NaN or inf")
        checked.append(scores.detach().to(device="cpu", dtype=torch.float64))
    return checked


def _counts(positive: torch.Tensor, negative: torch.Tensor):
    """At each distinct score, descending: the threshold, and how many positive and negative rows
    score at or above it."""
    scores = torch.cat([positive, negative])
    is_positive = torch.cat([torch.ones_like(positive), torch.zeros_like(negative)])
    scores, order = scores.sort(descending=True, stable=True)
    is_positive = is_positive[order]
    last_of_tie = torch.ones_like(scores, dtype=torch.bool)
    last_of_tie[:-1] = scores[1:] != scores[:-1]
    true = is_positive.cumsum(0)[last_of_tie]
    false = (torch.arange(1, len(scores) + 1, dtype=torch.float64) - is_positive.cumsum(0))[last_of_tie]
    return scores[last_of_tie], true, false


def _curve(id_scores: torch.Tensor, ood_scores: torch.Tensor):
    thresholds, true, false = _counts(ood_scores, id_scores)
    zero = torch.zeros(1, dtype=torch.float64)
    fpr = torch.cat([zero, false / len(id_scores)])
    tpr = torch.cat([zero, true / len(ood_scores)])
    return fpr, tpr, torch.cat([torch.full((1,), torch.inf, dtype=torch.float64), thresholds])


def _average_precision(positive: torch.Tensor, negative: torch.Tensor) -> float:
    """sum_n (R_n - R_{n-1}) P_n over the distinct thresholds, as scikit-learn computes it."""
    _, true, false = _counts(positive, negative)
    precision = true / (true + false)
    recall = true / len(positive)
    steps = torch.diff(recall, prepend=torch.zeros(1, dtype=torch.float64))
    return (steps * precision).sum().item()

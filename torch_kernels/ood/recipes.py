"""Feature recipes that survive a real LLM's activations, and their choice from in-distribution data.

A decoder's hidden states are a poor Gaussian as they come: the first token (the attention sink)
and a few channels carry activations hundreds of times larger than the rest, and a chat template
puts the same tokens in front of every prompt, so a plain mean over the prompt is dominated by
what every prompt shares. A recipe is what turns a prompt's hidden states into the row a scorer
fits, all of it from states the prefill already computed (no second forward pass):

* which positions are pooled: ``skip_first`` positions at the start (``1``: the sink; the
  template's prefix) and ``skip_last`` at the end (the template's suffix) are left out
  (:func:`shared_span` finds both from the prompts themselves);
* which hidden states: one layer, or several, averaged or concatenated (:func:`combine_layers`);
* a per-channel transform fitted on in-distribution rows (:class:`FeatureTransform`): standardizing,
  robust (median / IQR) standardizing, clipping the robust z-scores, L2 normalization.

:class:`TransformedScorer` puts a transform in front of any scorer, so that an
:class:`~torch_kernels.ood.OODGate` scores raw pooled features. :func:`intent_holdout_auroc` is
the label-free selection criterion (no out-of-scope example: held-out in-scope intents play the
unknown); :func:`select` takes the candidate with the best one.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Callable, Mapping, Sequence

import torch

from .. import _checks
from .evaluate import ood_metrics
from .features import check_span
from .scorer import FittedScorer

__all__ = ["Recipe", "FeatureTransform", "TransformedScorer", "TRANSFORMS", "COMBINES", "SCORERS",
           "combine_layers", "shared_span", "make_scorer", "intent_holdout_auroc", "select"]

TRANSFORMS = ("none", "standardize", "robust", "clip", "l2", "robust_l2", "clip_l2")
COMBINES = ("mean", "concat")
# "mahalanobis": one Gaussian (no labels); "mahalanobis_intents": one mean per in-scope intent and a
# tied covariance (Lee et al., 2018), so it uses the in-distribution rows' intent labels; "edm".
SCORERS = ("mahalanobis", "mahalanobis_intents", "edm")
_IQR_TO_SIGMA = 1.3489795  # the IQR of a standard normal: a robust scale reads as a standard deviation


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a prompt's hidden states become one feature row.

    ``layers``: hidden-state indices (as :func:`~torch_kernels.ood.extract_features`'s ``layer``);
    ``combine``: how several join (``"mean"`` of the pooled rows, or ``"concat"``); ``pooling``:
    ``"mean"`` or ``"last"`` over positions ``[skip_first, length - skip_last)``; ``transform``:
    one of :data:`TRANSFORMS`, fitted on in-distribution rows.
    """

    layers: tuple[int, ...] = (-1,)
    pooling: str = "mean"
    skip_first: int = 0
    skip_last: int = 0
    combine: str = "mean"
    transform: str = "none"

    def __post_init__(self):
        layers = (self.layers,) if isinstance(self.layers, numbers.Integral) else tuple(self.layers)
        if not layers or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in layers):
            raise TypeError(f"layers: expected an int or a non-empty sequence of ints, got {self.layers!r}")
        object.__setattr__(self, "layers", tuple(int(i) for i in layers))
        check_span(self.skip_first, self.skip_last)
        if self.combine not in COMBINES:
            raise ValueError(f"combine: expected one of {COMBINES}, got {self.combine!r}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform: expected one of {TRANSFORMS}, got {self.transform!r}")
        if self.pooling not in ("mean", "last"):
            raise ValueError(f"pooling: expected one of ('mean', 'last'), got {self.pooling!r}")

    def __str__(self) -> str:
        layers = "+".join(map(str, self.layers)) + (f" ({self.combine})" if len(self.layers) > 1 else "")
        return (f"layer {layers}, {self.pooling} of positions [{self.skip_first}, -{self.skip_last}), "
                f"{self.transform}")


def shared_span(prompts: Sequence[Sequence[int]]) -> tuple[int, int]:
    """``(prefix, suffix)``: how many leading and trailing token ids every prompt shares (a chat
    template's), limited so that every prompt keeps at least one position between them."""
    ids = [list(p) for p in prompts]
    if len(ids) < 2:
        raise ValueError(f"prompts: expected at least 2 prompts to find what they share, got {len(ids)}")
    shortest = min(map(len, ids))
    prefix = 0
    while prefix < shortest and all(p[prefix] == ids[0][prefix] for p in ids):
        prefix += 1
    suffix = 0
    while suffix < shortest and all(p[-1 - suffix] == ids[0][-1 - suffix] for p in ids):
        suffix += 1
    # a prompt that is only template (or two identical prompts) keeps one position
    prefix = min(prefix, shortest - 1)
    suffix = min(suffix, shortest - 1 - prefix)
    return prefix, suffix


def combine_layers(x: torch.Tensor, combine: str = "mean") -> torch.Tensor:
    """``[N, k, H]`` pooled rows of ``k`` layers as ``[N, H]`` (their mean) or ``[N, k * H]`` (``"concat"``)."""
    _checks.tensor("x", x, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    if combine not in COMBINES:
        raise ValueError(f"combine: expected one of {COMBINES}, got {combine!r}")
    return x.mean(dim=1) if combine == "mean" else x.reshape(x.shape[0], -1)


class FeatureTransform(torch.nn.Module):
    """A per-channel transform of ``[N, D]`` features, fitted on in-distribution rows.

    ``"standardize"``: ``(x - mean) / std``. ``"robust"``: ``(x - median) / (IQR / 1.349)``, which a
    few huge rows cannot move. ``"clip"``: the robust z-scores clamped to ``[-clip, clip]`` (an
    outlier channel of one prompt can then pull its distance only so far). ``"l2"``: each row
    divided by its norm (nothing to fit). ``"robust_l2"`` / ``"clip_l2"``: the robust (clipped)
    z-scores, then L2-normalized. ``"none"``: the identity. A channel with no spread gets scale 1.
    """

    def __init__(self, kind: str = "none", clip: float = 4.0):
        super().__init__()
        if kind not in TRANSFORMS:
            raise ValueError(f"kind: expected one of {TRANSFORMS}, got {kind!r}")
        if not isinstance(clip, numbers.Real) or isinstance(clip, bool) or not 0 < clip < float("inf"):
            raise ValueError(f"clip: expected a finite float > 0, got {clip!r}")
        self.kind, self.clip = kind, float(clip)
        self.register_buffer("center_", torch.empty(0))
        self.register_buffer("scale_", torch.empty(0))

    @property
    def needs_fit(self) -> bool:
        return self.kind not in ("none", "l2")

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}" + (f", clip={self.clip}" if "clip" in self.kind else "")

    def fit(self, x: torch.Tensor) -> "FeatureTransform":
        """Fit the per-channel centre and scale on in-distribution rows ``x [N, D]``; returns self."""
        _checks.tensor("x", x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
        if x.shape[0] < 2:
            raise ValueError(f"x: expected at least 2 rows to fit a scale, got {x.shape[0]}")
        if not torch.isfinite(x).all():
            raise ValueError("x: contains NaN or inf")
        x = x.detach().to(torch.float64)
        if self.kind == "standardize":
            center, scale = x.mean(dim=0), x.std(dim=0)
        elif self.needs_fit:
            q = torch.quantile(x, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64), dim=0)
            center, scale = q[1], (q[2] - q[0]) / _IQR_TO_SIGMA
        else:
            center = scale = torch.empty(0, dtype=torch.float64)
        if scale.numel():
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        self.center_, self.scale_ = center.float(), scale.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The transformed ``[N, D]`` rows (float32, or float64 for float64 input)."""
        if self.needs_fit and self.center_.numel() == 0:
            raise RuntimeError(f"FeatureTransform({self.kind!r}): call fit() before transforming")
        x = x if x.dtype == torch.float64 else x.float()
        if self.needs_fit:
            if x.shape[-1] != self.center_.shape[0]:
                raise ValueError(f"x: expected {self.center_.shape[0]} features (as fitted), got {x.shape[-1]}")
            x = (x - self.center_.to(x.dtype)) / self.scale_.to(x.dtype)
        if "clip" in self.kind:
            x = x.clamp(-self.clip, self.clip)
        if self.kind.endswith("l2"):
            x = x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
        return x


class TransformedScorer(FittedScorer):
    """``scorer`` (a ``MahalanobisScorer`` or ``EDMScorer``) fitted and scoring on ``transform(x)``:
    what an :class:`~torch_kernels.ood.OODGate` holds to score raw pooled features with a recipe."""

    def __init__(self, transform: FeatureTransform, scorer: FittedScorer):
        super().__init__()
        if not isinstance(transform, FeatureTransform):
            raise TypeError(f"transform: expected a FeatureTransform, got {type(transform).__name__}")
        if not callable(getattr(scorer, "score", None)):
            raise TypeError(f"scorer: expected a scorer with score(x), got {type(scorer).__name__}")
        self.transform, self.scorer = transform, scorer

    @property
    def fitted(self) -> bool:
        """Whether the scorer (and the transform, if it needs it) have been fitted."""
        return bool(self.scorer.fitted) and (not self.transform.needs_fit or self.transform.center_.numel() > 0)

    def fit(self, features: torch.Tensor, *args, **kwargs) -> "TransformedScorer":
        """Fit the transform on ``features [N, D]``, then the scorer on the transformed rows
        (``args``/``kwargs``, e.g. intent labels, go to the scorer's ``fit``); returns self."""
        if self.transform.needs_fit:
            self.transform.fit(features)
        with torch.no_grad():
            transformed = self.transform(features)
        self.scorer.fit(transformed, *args, **kwargs)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The scorer's ``[B]`` scores of the transformed ``x [B, D]``."""
        self._require_fitted()
        return self.scorer(self.transform(x))


def make_scorer(name: str, transform: str = "none", edm_steps: int | None = None, seed: int = 0):
    """A fresh, unfitted scorer of kind ``name`` (one of :data:`SCORERS`) behind ``transform``.

    Returns ``(scorer, fit)`` where ``fit(features, labels)`` fits it (``labels``: the rows'
    in-scope intent ids, read only by ``"mahalanobis_intents"``)."""
    from .edm import EDMScorer
    from .mahalanobis import MahalanobisScorer

    if name not in SCORERS:
        raise ValueError(f"name: expected one of {SCORERS}, got {name!r}")
    inner = EDMScorer() if name == "edm" else MahalanobisScorer("ledoit_wolf")
    scorer = TransformedScorer(FeatureTransform(transform), inner)

    def fit(features: torch.Tensor, labels: torch.Tensor | None = None):
        if name == "mahalanobis_intents":
            if labels is None:
                raise ValueError("labels: 'mahalanobis_intents' fits one mean per intent and needs the intent labels")
            return scorer.fit(features, _dense(labels))
        if name == "edm":
            return scorer.fit(features, edm_steps, seed=seed, progress=False)
        return scorer.fit(features)

    return scorer, fit


def _dense(labels: torch.Tensor) -> torch.Tensor:
    """Labels renumbered ``0..C-1`` in the order of their values (the classes present only)."""
    return torch.unique(labels, return_inverse=True)[1]


def intent_holdout_auroc(train: torch.Tensor, train_labels: torch.Tensor, heldout: torch.Tensor,
                         heldout_labels: torch.Tensor, scorer: str = "mahalanobis", transform: str = "none",
                         folds: int = 5, seed: int = 0, edm_steps: int | None = None) -> float:
    """The selection criterion: a stand-in OOD task built from in-distribution rows alone.

    The intents are split into ``folds`` groups; for each, the scorer is fitted on the training
    rows of the other intents and must tell held-out rows of those intents (in scope) from
    held-out rows of the hidden group (unseen intents, as out-of-scope queries are). Returns the
    mean AUROC; a fold whose features have a singular covariance (constant features, such as the
    last token's embedding when every prompt ends in the same template) counts as chance, 0.5. No out-of-scope example is read; the intent labels are in-distribution data."""
    for name, x, y in (("train", train, train_labels), ("heldout", heldout, heldout_labels)):
        _checks.tensor(name, x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
        _checks.tensor(f"{name}_labels", y, ndim=1)
        if y.shape[0] != x.shape[0]:
            raise ValueError(f"{name}_labels: expected {x.shape[0]} labels (one per row), got {y.shape[0]}")
    if not isinstance(folds, numbers.Integral) or isinstance(folds, bool) or folds < 2:
        raise ValueError(f"folds: expected an int >= 2, got {folds!r}")
    intents = torch.unique(train_labels)
    if len(intents) < folds:
        raise ValueError(f"train_labels: expected at least folds={folds} intents, got {len(intents)}")
    order = intents[torch.randperm(len(intents), generator=torch.Generator().manual_seed(seed))]
    aurocs = []
    for group in order.tensor_split(folds):
        hidden_train = torch.isin(train_labels, group)
        hidden_heldout = torch.isin(heldout_labels, group)
        if hidden_heldout.all() or not hidden_heldout.any():
            continue  # no row on one side: this fold says nothing
        model, fit = make_scorer(scorer, transform, edm_steps, seed)
        try:
            fit(train[~hidden_train], train_labels[~hidden_train])
        except ValueError as error:
            if "singular" not in str(error):
                raise
            aurocs.append(0.5)  # features no Gaussian fits (e.g. constant ones) separate nothing
            continue
        with torch.no_grad():
            scores = model.score(heldout)
        aurocs.append(ood_metrics(scores[~hidden_heldout], scores[hidden_heldout]).auroc)
    if not aurocs:
        raise ValueError("heldout_labels: no fold has held-out rows of both seen and hidden intents")
    return sum(aurocs) / len(aurocs)


def select(candidates: Mapping[object, Callable[[], float]]):
    """``(best key, {key: criterion})``: each candidate's criterion (a callable, evaluated once),
    the key with the highest (the first on a tie)."""
    if not candidates:
        raise ValueError("candidates: expected at least one candidate, got none")
    values = {key: float(criterion()) for key, criterion in candidates.items()}
    best = max(values, key=lambda k: values[k])
    return best, values

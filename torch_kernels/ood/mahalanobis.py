"""Fit a Gaussian on in-distribution features, score by Mahalanobis distance."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .. import _checks
from ..ops.ood import mahalanobis_score, mahalanobis_score_fitted
from ..reference.ood import class_terms
from .scorer import FittedScorer

__all__ = ["MahalanobisScorer", "mahalanobis_score", "COVARIANCE_ESTIMATORS"]

COVARIANCE_ESTIMATORS = ("empirical", "ledoit_wolf", "oas")


def _batches(features) -> Iterable[torch.Tensor]:
    return [features] if isinstance(features, torch.Tensor) else features


class _Moments:
    """One streaming pass of float64 sums, shifted by the first batch's mean for accuracy.

    Keeps per-class counts and sums, the pooled scatter matrix, and the two extra sums that
    Ledoit-Wolf needs (sum of ||u||^4 and of ||u||^2 u for shifted rows u); never an N x N matrix.
    """

    def __init__(self, num_classes: int | None):
        self.num_classes = num_classes
        self.count = 0
        self.shift = None

    def update(self, batch: torch.Tensor, labels: torch.Tensor | None) -> None:
        if batch.shape[0] == 0:  # nothing to add, and an empty batch has no mean to shift by
            return
        u = batch.to(torch.float64)
        if self.shift is None:
            d = u.shape[1]
            self.shift = u.mean(dim=0)
            c = self.num_classes or 1
            self.class_count = torch.zeros(c, dtype=torch.float64, device=u.device)
            self.class_sum = torch.zeros(c, d, dtype=torch.float64, device=u.device)
            self.scatter = torch.zeros(d, d, dtype=torch.float64, device=u.device)
            self.fourth = torch.zeros((), dtype=torch.float64, device=u.device)
            self.sq_weighted_sum = torch.zeros(d, dtype=torch.float64, device=u.device)
        u = u - self.shift
        index = torch.zeros(u.shape[0], dtype=torch.int64, device=u.device) if labels is None else labels
        self.count += u.shape[0]
        self.class_count.index_add_(0, index, torch.ones_like(u[:, 0]))
        self.class_sum.index_add_(0, index, u)
        self.scatter.addmm_(u.T, u)
        sq = u.square().sum(dim=1)
        self.fourth += sq.square().sum()
        self.sq_weighted_sum += sq @ u


def constant_features(variance: torch.Tensor) -> torch.Tensor:
    """Which features are constant in the fit data: a variance of zero or below ``D`` float64
    epsilons of the largest (the relative size at which a covariance is numerically singular)."""
    return variance <= variance.shape[0] * torch.finfo(torch.float64).eps * variance.max()


class MahalanobisScorer(FittedScorer):
    """Mahalanobis-distance OOD scorer over frozen features, usable as a module inside models.

    Args:
        covariance: ``"empirical"`` (maximum likelihood), ``"ledoit_wolf"`` or ``"oas"``
            (shrinkage towards a scaled identity, as scikit-learn's estimators of those names).
        ridge: added to the covariance's diagonal after shrinkage; needed when the covariance
            is singular (fewer samples than features, or collinear features).

    A feature constant in the fit data (zero variance, or below ``D`` float64 epsilons of the
    largest; the dead output dimensions some sentence encoders have) is centred and not scaled: the
    covariance gets a unit variance for it and no correlation, as scikit-learn's ``StandardScaler``
    gives such a feature scale 1, so the default fit does not refuse it.

    ``fit(features, labels=None)`` fits one Gaussian, or with labels one mean per class and a
    tied covariance (Lee et al., 2018). ``forward(x)`` / ``score(x)`` return ``[B]`` squared
    distances, the minimum over classes (as for every ``FittedScorer``, ``score`` gives plain scores,
    with a graph only to an ``x`` that requires grad; the fitted statistics are buffers, never
    differentiated, so ``forward`` gives the same). Fitted buffers are float64: ``means_``,
    ``covariance_``, ``precision_``, ``whitener_`` (upper triangular, ``whitener_ @ whitener_.T ==
    precision_``) and ``shrinkage_``; ``state_dict()`` / ``load_state_dict()`` carry them. What scoring
    reads is derived from them once, by ``fit`` and ``load_state_dict``: the class terms of
    :func:`~torch_kernels.mahalanobis_score_fitted` (each class mean whitened) and float32 copies, so
    that a call costs the rows' whitening alone; after writing to the fitted buffers in place, load
    them again (``load_state_dict(state_dict())``) to refresh what is derived.
    """

    # the buffers scoring reads for x of each compute dtype: mahalanobis_score_fitted's arguments after x
    _TERMS = {torch.float32: ("_center32", "_whitener32", "_class_proj32", "_class_sq32"),
              torch.float64: ("_center64", "whitener_", "_class_proj64", "_class_sq64")}

    def __init__(self, covariance: str = "empirical", ridge: float = 0.0):
        super().__init__()
        if covariance not in COVARIANCE_ESTIMATORS:
            raise ValueError(f"covariance: expected one of {COVARIANCE_ESTIMATORS}, got {covariance!r}")
        if not isinstance(ridge, (int, float)) or isinstance(ridge, bool) or not 0.0 <= ridge < float("inf"):
            raise ValueError(f"ridge: expected a finite float >= 0, got {ridge!r}")
        self.covariance = covariance
        self.ridge = float(ridge)
        for name in ("means_", "covariance_", "precision_", "whitener_", "shrinkage_"):
            self.register_buffer(name, torch.empty(0, dtype=torch.float64))
        # what the op reads, derived once per fit or load so that scoring converts and whitens nothing
        # per call: float32 (and float64) class terms, the whitener in float32
        for name in ("_center32", "_whitener32", "_class_proj32", "_class_sq32", "_center64", "_class_proj64",
                     "_class_sq64"):
            self.register_buffer(name, torch.empty(0), persistent=False)

    @property
    def fitted(self) -> bool:
        """Whether ``fit`` (or ``load_state_dict``) has given the scorer its statistics."""
        return self.whitener_.numel() > 0

    def extra_repr(self) -> str:
        shape = f", classes={self.means_.shape[0]}, features={self.means_.shape[1]}" if self.fitted else ""
        return f"covariance={self.covariance!r}, ridge={self.ridge}{shape}"

    def fit(self, features: torch.Tensor | Iterable[torch.Tensor], labels=None) -> "MahalanobisScorer":
        """Fit on ``[N, D]`` features, or an iterable of ``[n_i, D]`` batches, in one pass.

        ``labels``: ``None``, an int64 ``[N]`` tensor, or an iterable of per-batch label tensors
        (class ids ``0..C-1``). With labels and a shrinkage estimator the features are read
        twice (the shrinkage needs rows centred on their class mean), so they must then be a
        tensor or a re-iterable collection, not a one-shot iterator.
        """
        num_classes = None
        if labels is not None:
            label_list = [labels] if isinstance(labels, torch.Tensor) else list(labels)
            for i, lab in enumerate(label_list):
                _checks.tensor("labels", lab, ndim=1, dtypes=(torch.int64, torch.int32, torch.int16, torch.uint8))
                if lab.numel() and lab.min() < 0:
                    raise ValueError(f"labels: expected class ids >= 0, got {lab.min().item()} in batch {i}")
            num_labels = sum(lab.numel() for lab in label_list)
            if not num_labels:
                raise ValueError("labels: expected at least one label, got none")
            num_classes = int(max(lab.max().item() for lab in label_list if lab.numel())) + 1
            if num_classes > num_labels:  # every class 0..C-1 needs a sample; also bounds the allocation
                raise ValueError(f"labels: expected class ids 0..C-1 with every class present, got id "
                                 f"{num_classes - 1} among only {num_labels} labels")
        else:
            label_list = None
        if label_list is not None and self.covariance != "empirical" and not isinstance(features, (torch.Tensor, Sequence)):
            raise ValueError(
                "features: a one-shot iterator cannot be read twice; with labels and "
                f"covariance={self.covariance!r} pass a tensor or a list of batches"
            )
        moments = _Moments(num_classes)
        batches = _batches(features)
        label_iter = iter(label_list) if label_list is not None else None
        for i, batch in enumerate(batches):
            self._check_batch(batch, i, moments)
            lab = None
            if label_iter is not None:
                lab = next(label_iter, None)
                if lab is None or lab.shape[0] != batch.shape[0]:
                    raise ValueError(f"labels: batch {i} has {batch.shape[0]} rows but its labels do not match")
                lab = lab.to(device=batch.device, dtype=torch.int64)
            moments.update(batch, lab)
        if moments.count == 0:
            raise ValueError("features: expected at least one row, got none")
        if label_iter is not None and next(label_iter, None) is not None:
            raise ValueError("labels: more label batches than feature batches")
        if moments.count < 2:
            raise ValueError("features: expected at least 2 rows to estimate a covariance")
        self._finish(moments, batches if label_list is not None else None, label_list)
        return self

    @staticmethod
    def _check_batch(batch, i: int, moments: _Moments) -> None:
        _checks.tensor("features", batch, ndim=2, dtypes=_checks.FLOAT_DTYPES)
        if batch.shape[1] == 0:
            raise ValueError("features: expected at least one feature, got shape (N, 0)")
        if moments.shift is not None and batch.shape[1] != moments.shift.shape[0]:
            raise ValueError(f"features: batch {i} has {batch.shape[1]} features, the first had {moments.shift.shape[0]}")
        if not torch.isfinite(batch).all():
            raise ValueError(f"features: batch {i} contains NaN or inf")

    def _finish(self, m: _Moments, batches, label_list) -> None:
        n, d = m.count, m.shift.shape[0]
        present = m.class_count > 0
        if not present.all():
            missing = (~present).nonzero().flatten().tolist()[:5]
            raise ValueError(f"labels: classes {missing} have no samples (class ids must be 0..C-1, all present)")
        class_mean = m.class_sum / m.class_count[:, None]  # shifted
        # scatter about the class means: sum u u^T - sum_c n_c mu_c mu_c^T
        scatter = m.scatter - (class_mean.T * m.class_count) @ class_mean
        emp = scatter / n
        # a feature constant in the fit data (dead output dimensions of an encoder) is centred, not
        # scaled: unit variance, uncorrelated, as scikit-learn's StandardScaler gives it scale 1
        constant = constant_features(emp.diagonal() + self.ridge)  # a ridge makes none constant
        emp[constant] = 0.0
        emp[:, constant] = 0.0
        emp.diagonal()[constant] = 1.0
        mu = emp.diagonal().sum() / d
        if self.covariance == "empirical" or d == 1:
            shrinkage = 0.0
        elif self.covariance == "oas":
            alpha = emp.square().mean()
            den = (n + 1) * (alpha - mu * mu / d)
            shrinkage = 1.0 if den == 0 else min(float((alpha + mu * mu) / den), 1.0)
        else:
            fourth = self._centred_fourth_moment(m, class_mean, batches, label_list)
            frob = emp.square().sum()
            beta = (fourth / n - frob) / (d * n)
            delta = (frob - d * mu * mu) / d
            beta = min(float(beta), float(delta))
            shrinkage = 0.0 if beta == 0 else beta / float(delta)
        cov = (1.0 - shrinkage) * emp
        cov.diagonal().add_(shrinkage * mu + self.ridge)
        self._set(class_mean + m.shift, cov, shrinkage)

    @staticmethod
    def _centred_fourth_moment(m: _Moments, class_mean, batches, label_list) -> torch.Tensor:
        """sum_k ||x_k - mean_{c(k)}||^4, which Ledoit-Wolf's shrinkage needs."""
        if label_list is None:
            # expand ||u - v||^4 with v the shifted mean, from the streamed sums
            v = class_mean[0]
            vv = v @ v
            n = m.count
            sum_u = m.class_sum[0]
            sum_sq = m.scatter.diagonal().sum()
            return (m.fourth - 4 * (m.sq_weighted_sum @ v) + 4 * (v @ m.scatter @ v)
                    + 2 * vv * sum_sq - 4 * vv * (sum_u @ v) + n * vv * vv)
        total = torch.zeros((), dtype=torch.float64, device=class_mean.device)
        for batch, lab in zip(_batches(batches), label_list):
            centred = batch.to(torch.float64) - m.shift - class_mean[lab.to(device=batch.device, dtype=torch.int64)]
            total += centred.square().sum(dim=1).square().sum()
        return total

    def _set(self, means: torch.Tensor, cov: torch.Tensor, shrinkage: float) -> None:
        chol, info = torch.linalg.cholesky_ex(cov)
        diag = chol.diagonal()
        # a pivot this small against the largest means the covariance is numerically singular
        if info.item() != 0 or (diag.min() / diag.max()) ** 2 < cov.shape[0] * torch.finfo(torch.float64).eps:
            raise ValueError(
                "features: the covariance is singular (fewer samples than features, or collinear "
                "features); pass ridge > 0 or use covariance='ledoit_wolf' or 'oas'"
            )
        eye = torch.eye(cov.shape[0], dtype=torch.float64, device=cov.device)
        whitener = torch.linalg.solve_triangular(chol, eye, upper=False).T
        self.means_, self.covariance_ = means, cov
        self.precision_ = torch.cholesky_inverse(chol)
        self.whitener_ = whitener
        self.shrinkage_ = torch.tensor(shrinkage, dtype=torch.float64, device=cov.device)
        self._refresh_copies()

    def _refresh_copies(self) -> None:
        # the class terms in float64, each float32 one rounded from them (more accurate than whitening
        # the rounded means); clones, as the one-class terms are shared tables
        with torch.no_grad():
            center, class_proj, class_sq = (t.clone() for t in class_terms(self.means_, self.whitener_, torch.float64))
        self._center64, self._class_proj64, self._class_sq64 = center, class_proj, class_sq
        self._center32, self._class_proj32, self._class_sq32 = (t.to(torch.float32) for t in (center, class_proj, class_sq))
        self._whitener32 = self.whitener_.to(torch.float32)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # an unfitted scorer's buffers are empty: take the saved shapes
        for name in ("means_", "covariance_", "precision_", "whitener_", "shrinkage_"):
            if prefix + name in state_dict:
                setattr(self, name, torch.empty_like(state_dict[prefix + name], device=getattr(self, name).device))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.fitted:
            self._refresh_copies()

    def forward(self, x: torch.Tensor, implementation: str | Sequence[str] | None = None) -> torch.Tensor:
        """``[B]`` squared Mahalanobis distances of ``x [B, D]`` (min over classes), float32."""
        self._require_fitted()
        names = self._TERMS[torch.float64 if x.dtype == torch.float64 else torch.float32]
        return mahalanobis_score_fitted(x, *(getattr(self, name) for name in names), implementation)

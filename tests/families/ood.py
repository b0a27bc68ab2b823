"""ood's bad-input rows (Mahalanobis: the op and MahalanobisScorer; EDM: the op, EDMScorer and
evaluate) and device cases."""

from __future__ import annotations

import math
from typing import Callable

import torch

import torch_kernels
from families import LARGE, DeviceCase, K, Row, map_arg, set_arg, sized
from torch_kernels.ops import ood as family_ops
from torch_kernels.reference import ood as reference


# ---- bad inputs: Mahalanobis ----

def _ood_inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3, 4, generator=gen), torch.randn(2, 4, generator=gen), torch.eye(4) + 0.1


def _score(change) -> Callable[[str], object]:
    def call(backend):
        return torch_kernels.mahalanobis_score(*change(*_ood_inputs()), implementation=backend)
    return call


def _fitted(change) -> Callable[[str], object]:
    """``mahalanobis_score_fitted`` of ``_ood_inputs``' class terms, changed by ``change(x, center, whitener,
    class_proj, class_sq)``."""
    def call(backend):
        x, means, whitener = _ood_inputs()
        center, class_proj, class_sq = reference.class_terms(means, whitener, torch.float32)
        args = change(x, center, whitener, class_proj, class_sq)
        return torch_kernels.mahalanobis_score_fitted(*args, implementation=backend)
    return call


def _features(n=50, d=4, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def _scorer(method: str, *args, fit=True, **kwargs) -> Callable[[str], object]:
    """Call ``MahalanobisScorer()`` method ``method`` (``__init__`` for the constructor); its scores
    use ``backend``."""
    from torch_kernels.ood import MahalanobisScorer

    def call(backend):
        if method == "__init__":
            return MahalanobisScorer(*args, **kwargs)
        scorer = MahalanobisScorer()
        if fit:
            scorer.fit(_features())
        if method == "threshold":
            with torch_kernels.use_backend(backend):
                return scorer.threshold(*args, **kwargs)
        return getattr(scorer, method)(*args, **kwargs)
    return call


def _nan_row(x):
    x = x.clone()
    x[3, 1] = math.nan
    return x


OOD = [
    ("x 1-D", "x", ValueError, _score(lambda x, m, w: (x[0], m, w))),
    ("means 1-D", "means", ValueError, _score(lambda x, m, w: (x, m[0], w))),
    ("means features", "means", ValueError, _score(lambda x, m, w: (x, m[:, :3], w))),
    ("whitener rows", "whitener", ValueError, _score(lambda x, m, w: (x, m, w[:3]))),
    ("whitener columns", "whitener", ValueError, _score(lambda x, m, w: (x, m, w[:, :3]))),
    ("x int", "x", TypeError, _score(lambda x, m, w: (x.int(), m, w))),
    ("means float64 for float16 x", "means", TypeError, _score(lambda x, m, w: (x.half(), m.double(), w))),
    ("whitener float16 for float32 x", "whitener", TypeError, _score(lambda x, m, w: (x, m, w.half()))),
    ("means on meta", "means", ValueError, _score(lambda x, m, w: (x, m.to("meta"), w))),
    ("x not a tensor", "x", TypeError, _score(lambda x, m, w: (x.numpy(), m, w))),
    ("no classes", "means", ValueError, _score(lambda x, m, w: (x, m[:0], w))),
    ("no features", "x", ValueError, _score(lambda x, m, w: (x[:, :0], m[:, :0], w[:0, :0]))),
    ("fitted x 1-D", "x", ValueError, _fitted(lambda x, c, w, p, s: (x[0], c, w, p, s))),
    ("fitted center 2-D", "center", ValueError, _fitted(lambda x, c, w, p, s: (x, c[None], w, p, s))),
    ("fitted center features", "center", ValueError, _fitted(lambda x, c, w, p, s: (x, c[:3], w, p, s))),
    ("fitted whitener columns", "whitener", ValueError, _fitted(lambda x, c, w, p, s: (x, c, w[:, :3], p, s))),
    ("fitted class_proj features", "class_proj", ValueError, _fitted(lambda x, c, w, p, s: (x, c, w, p[:, :3], s))),
    ("fitted no classes", "class_proj", ValueError, _fitted(lambda x, c, w, p, s: (x, c, w, p[:0], s[:0]))),
    ("fitted class_sq classes", "class_sq", ValueError, _fitted(lambda x, c, w, p, s: (x, c, w, p, s[:1]))),
    ("fitted center float64 for float32 x", "center", TypeError,
     _fitted(lambda x, c, w, p, s: (x, c.double(), w, p, s))),
    ("fitted class_proj float16 for float16 x", "class_proj", TypeError,
     _fitted(lambda x, c, w, p, s: (x.half(), c, w, p.half(), s))),
    ("fitted class_sq on meta", "class_sq", ValueError, _fitted(lambda x, c, w, p, s: (x, c, w, p, s.to("meta")))),
    ("fitted class_sq not a tensor", "class_sq", TypeError, _fitted(lambda x, c, w, p, s: (x, c, w, p, s.tolist()))),
    ("covariance unknown", "covariance", ValueError, _scorer("__init__", covariance="shrunk")),
    ("ridge negative", "ridge", ValueError, _scorer("__init__", ridge=-1.0)),
    ("ridge nan", "ridge", ValueError, _scorer("__init__", ridge=math.nan)),
    ("fit singular", "features", ValueError, _scorer("fit", torch.randn(3, 8), fit=False)),
    ("fit NaN", "features", ValueError, _scorer("fit", _nan_row(_features()), fit=False)),
    ("fit inf in batch 1", "features", ValueError,
     _scorer("fit", [_features(), torch.full((2, 4), math.inf)], fit=False)),
    ("fit int features", "features", TypeError, _scorer("fit", torch.ones(5, 2, dtype=torch.int64), fit=False)),
    ("fit 1-D features", "features", ValueError, _scorer("fit", torch.ones(5), fit=False)),
    ("fit nothing", "features", ValueError, _scorer("fit", [_features()[:0]], fit=False)),
    ("fit batches of other widths", "features", ValueError, _scorer("fit", [_features(), _features(d=3)], fit=False)),
    ("labels none", "labels", ValueError, _scorer("fit", [_features()[:0]], [torch.zeros(0, dtype=torch.int64)],
                                                  fit=False)),
    ("labels count", "labels", ValueError, _scorer("fit", _features(), torch.zeros(49, dtype=torch.int64), fit=False)),
    ("labels missing class", "labels", ValueError,
     _scorer("fit", _features(), torch.where(torch.arange(50) < 25, 0, 2), fit=False)),
    ("labels id 2**40", "labels", ValueError,
     _scorer("fit", _features(), torch.where(torch.arange(50) < 25, 0, 2**40), fit=False)),
    ("labels negative", "labels", ValueError, _scorer("fit", _features(), -torch.ones(50, dtype=torch.int64), fit=False)),
    ("labels float", "labels", TypeError, _scorer("fit", _features(), torch.zeros(50), fit=False)),
    ("labels with a one-shot iterator", "features", ValueError,
     lambda backend: __import__("torch_kernels.ood", fromlist=["MahalanobisScorer"]).MahalanobisScorer("oas").fit(
         iter([_features()]), [torch.zeros(50, dtype=torch.int64)])),
    ("threshold tpr 1.5", "tpr", ValueError, _scorer("threshold", _features(), tpr=1.5)),
    ("threshold tpr 0", "tpr", ValueError, _scorer("threshold", _features(), tpr=0.0)),
    ("threshold tpr True", "tpr", TypeError, _scorer("threshold", _features(), tpr=True)),
    ("threshold tpr a string", "tpr", TypeError, _scorer("threshold", _features(), tpr="0.95")),
    ("threshold NaN features", "features", ValueError, _scorer("threshold", _nan_row(_features()))),
    ("threshold no rows", "features", ValueError, _scorer("threshold", _features()[:0])),
    ("score before fit", "MahalanobisScorer", RuntimeError, _scorer("score", _features(), fit=False)),
]


# ---- bad inputs: EDM (the EDM scorer, its op and evaluate) ----

def _edm_inputs() -> dict:
    """A good edm_score call: B = 3, D = 4, H = 5, K = 1, L = 2."""
    gen = torch.Generator().manual_seed(0)
    b, d, h, k, levels = 3, 4, 5, 1, 2
    shapes = {"mean": (d,), "inv_scale": (d,), "noise": (levels, d), "level_weights": (levels,),
              "level_bias": (levels, h), "w_in": (d, h), "w1": (k, h, h), "b1": (k, h), "w2": (k, h, h),
              "b2": (k, h), "w_out": (h, d), "b_out": (d,)}
    kw = {name: torch.randn(*shape, generator=gen) for name, shape in shapes.items()}
    return dict(x=torch.randn(b, d, generator=gen), **kw, sigmas=[0.5, 1.5], sigma_data=1.0)


def _edm_score(change) -> Callable[[str], object]:
    def call(backend):
        kw = _edm_inputs()
        change(kw)
        return torch_kernels.edm_score(**kw, implementation=backend)
    return call


def _edm_scorer(method: str, *args, fit=True, **kwargs) -> Callable[[str], object]:
    """Call ``EDMScorer()`` method ``method`` (``__init__`` for the constructor; a fit of two steps
    first unless ``fit=False``), scoring on ``backend``."""
    from torch_kernels.ood import EDMScorer

    def call(backend):
        if method == "__init__":
            return EDMScorer(*args, **kwargs)
        scorer = EDMScorer(width=8, depth=1, levels=2)
        if fit:
            scorer.fit(_features(), steps=2, progress=False)
        with torch_kernels.use_backend(backend):
            return getattr(scorer, method)(*args, **kwargs)
    return call


def _evaluate(id_scores, ood_scores) -> Callable[[str], object]:
    def call(backend):
        from torch_kernels.ood import ood_metrics
        return ood_metrics(id_scores, ood_scores)
    return call


EDM = [
    ("x 1-D", "x", ValueError, _edm_score(map_arg("x", lambda t: t[0]))),
    ("x int", "x", TypeError, _edm_score(map_arg("x", lambda t: t.int()))),
    ("x not a tensor", "x", TypeError, _edm_score(map_arg("x", lambda t: t.numpy()))),
    ("no features", "x", ValueError, _edm_score(map_arg("x", lambda t: t[:, :0]))),
    ("mean features", "mean", ValueError, _edm_score(map_arg("mean", lambda t: t[:3]))),
    ("noise levels", "noise", ValueError, _edm_score(map_arg("noise", lambda t: t[:1]))),
    ("level_bias width", "level_bias", ValueError, _edm_score(map_arg("level_bias", lambda t: t[:, :4]))),
    ("w1 not square", "w1", ValueError, _edm_score(map_arg("w1", lambda t: t[:, :, :4]))),
    ("b2 blocks", "b2", ValueError, _edm_score(map_arg("b2", lambda t: torch.cat([t, t])))),
    ("w_out 1-D", "w_out", ValueError, _edm_score(map_arg("w_out", lambda t: t[0]))),
    ("w_in float64 for float32 x", "w_in", TypeError, _edm_score(map_arg("w_in", lambda t: t.double()))),
    ("w_in no hidden width", "w_in", ValueError, _edm_score(map_arg("w_in", lambda t: t[:, :0]))),
    ("w2 on meta", "w2", ValueError, _edm_score(map_arg("w2", lambda t: t.to("meta")))),
    ("sigmas empty", "sigmas", ValueError, _edm_score(set_arg("sigmas", []))),
    ("sigma 0", "sigmas", ValueError, _edm_score(set_arg("sigmas", [0.0, 1.0]))),
    ("sigma nan", "sigmas", ValueError, _edm_score(set_arg("sigmas", [0.5, math.nan]))),
    ("sigmas a string", "sigmas", TypeError, _edm_score(set_arg("sigmas", "0.5"))),
    ("sigma_data negative", "sigma_data", ValueError, _edm_score(set_arg("sigma_data", -1.0))),
    ("statistic unknown", "statistic", ValueError, _edm_score(set_arg("statistic", "likelihood"))),
    ("width 0", "width", ValueError, _edm_scorer("__init__", width=0)),
    ("depth negative", "depth", ValueError, _edm_scorer("__init__", depth=-1)),
    ("levels 2.5", "levels", TypeError, _edm_scorer("__init__", levels=2.5)),
    ("sigma_min 0", "sigma_min", ValueError, _edm_scorer("__init__", sigma_min=0.0)),
    ("sigma_max below sigma_min", "sigma_max", ValueError, _edm_scorer("__init__", sigma_min=1.0, sigma_max=0.5)),
    ("scorer statistic unknown", "statistic", ValueError, _edm_scorer("__init__", statistic="likelihood")),
    ("ridge negative", "ridge", ValueError, _edm_scorer("__init__", ridge=-1.0)),
    ("fit NaN", "features", ValueError, _edm_scorer("fit", _nan_row(_features()), fit=False)),
    ("fit one row", "features", ValueError, _edm_scorer("fit", _features()[:1], fit=False)),
    ("fit int features", "features", TypeError, _edm_scorer("fit", torch.ones(5, 2, dtype=torch.int64), fit=False)),
    ("fit batches of other widths", "features", ValueError,
     _edm_scorer("fit", [_features(), _features(d=3)], fit=False)),
    ("fit constant features", "features", ValueError, _edm_scorer("fit", torch.ones(10, 3), fit=False)),
    ("fit steps 0", "steps", ValueError, _edm_scorer("fit", _features(), steps=0, fit=False)),
    ("fit steps and epochs", "steps", ValueError, _edm_scorer("fit", _features(), steps=5, epochs=1, fit=False)),
    ("fit batch_size 0", "batch_size", ValueError, _edm_scorer("fit", _features(), batch_size=0, fit=False)),
    ("fit lr negative", "lr", ValueError, _edm_scorer("fit", _features(), lr=-1e-3, fit=False)),
    ("fit ema 1", "ema", ValueError, _edm_scorer("fit", _features(), ema=1.0, fit=False)),
    ("score before fit", "EDMScorer", RuntimeError, _edm_scorer("score", _features(), fit=False)),
    ("score statistic unknown", "statistic", ValueError, _edm_scorer("score", _features(), "likelihood")),
    ("threshold tpr 0", "tpr", ValueError, _edm_scorer("threshold", _features(), tpr=0.0)),
    ("evaluate no OOD scores", "ood_scores", ValueError, _evaluate(torch.randn(5), torch.randn(0))),
    ("evaluate NaN score", "id_scores", ValueError, _evaluate(torch.tensor([0.0, math.nan]), torch.randn(3))),
    ("evaluate a scorer without score", "scorer", TypeError,
     lambda backend: __import__("torch_kernels.ood", fromlist=["evaluate"]).evaluate(object(), torch.randn(2, 3),
                                                                                      torch.randn(2, 3))),
]


def _rows(table, ops: dict) -> list[Row]:
    """``table``'s rows, each naming the op (of ``ops``, ``{op: the maker of its calls}``) whose call it
    makes (None: the rows that check the scorers)."""
    def op_of(call):
        return next((op for op, maker in ops.items() if call.__qualname__.startswith(f"{maker.__name__}.")), None)
    return [Row(*row, op=op_of(row[3])) for row in table]


BAD_INPUTS = {"ood": _rows(OOD, {"mahalanobis_score": _score, "mahalanobis_score_fitted": _fitted}),
              "edm": _rows(EDM, {"edm_score": _edm_score})}


# ---- device cases ----

DEVICE_CASES = [
    DeviceCase("mahalanobis_score", "mahalanobis_score", family_ops.mahalanobis_inputs, torch_kernels.mahalanobis_score,
               grads=(0, 1, 2)),
    DeviceCase("mahalanobis_score 4096 x 1024, 16 classes", "mahalanobis_score",
               sized(family_ops.mahalanobis_inputs, b=4 * K, d=K, c=16), torch_kernels.mahalanobis_score, grads=(0,),
               **LARGE),
    DeviceCase("mahalanobis_score_fitted", "mahalanobis_score_fitted", family_ops.mahalanobis_inputs,
               family_ops.fitted_score, grads=(0, 1, 2)),
    DeviceCase("edm_score", "edm_score", family_ops.edm_inputs, family_ops.edm_denoise_score, grads=tuple(range(13))),
    DeviceCase("edm_score 4096 x 384, width 512", "edm_score",
               sized(family_ops.edm_inputs, b=4 * K, d=384, h=512, blocks=2, levels=4), family_ops.edm_denoise_score, grads=(0,),
               **LARGE),
]

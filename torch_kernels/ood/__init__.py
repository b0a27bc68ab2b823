"""Out-of-distribution scoring on frozen model features.

>>> scorer = MahalanobisScorer(covariance="ledoit_wolf").fit(train_features)
>>> limit = scorer.threshold(validation_features, tpr=0.95)
>>> reject = scorer.score(query_features) > limit
"""

from .mahalanobis import COVARIANCE_ESTIMATORS, MahalanobisScorer, mahalanobis_score
from .edm import EDMScorer, edm_score
from .evaluate import OODMetrics, OODScorer, evaluate, ood_metrics, roc_curve
from .features import extract_features
from .gate import OODGate, record_tokens_saved
from .recipes import FeatureTransform, Recipe, TransformedScorer

__all__ = ["MahalanobisScorer", "mahalanobis_score", "COVARIANCE_ESTIMATORS"]
__all__ += ["EDMScorer", "edm_score", "OODScorer", "OODMetrics", "evaluate", "ood_metrics", "roc_curve"]
__all__ += ["extract_features", "OODGate", "record_tokens_saved"]
__all__ += ["Recipe", "FeatureTransform", "TransformedScorer"]

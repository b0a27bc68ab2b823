"""Out-of-distribution scoring on frozen model features.

>>> scorer = MahalanobisScorer(covariance="ledoit_wolf").fit(train_features)
>>> limit = scorer.threshold(validation_features, tpr=0.95)
>>> reject = scorer.score(query_features) > limit
"""

from .mahalanobis import COVARIANCE_ESTIMATORS, MahalanobisScorer, mahalanobis_score

__all__ = ["MahalanobisScorer", "mahalanobis_score", "COVARIANCE_ESTIMATORS"]

"""An out-of-distribution gate for the serving loop: refuse a prompt once its prefill is done.

>>> scorer = MahalanobisScorer("ledoit_wolf").fit(extract_features(model, tok, train_prompts, layer=15))
>>> gate = OODGate(scorer, scorer.threshold(extract_features(model, tok, val_prompts, layer=15)), layer=15)
>>> engine = Engine(model, ood_gate=gate)            # torch_kernels.serving.Engine
>>> outputs = engine.generate(prompts, 64)            # a refused prompt's output is empty

The engine pools each prompt's hidden states at ``layer`` from its own prefill forward passes
(over several chunked steps, a running sum per request for ``"mean"``), so the gate costs no
extra forward pass; the feature it scores equals :func:`~torch_kernels.ood.extract_features`'s
for the same prompt, layer and pooling. All prompts whose prefill ends in a step are scored in
one ``scorer.score`` call; one scoring over ``threshold`` (or NaN) finishes at once, refused,
with no generated token, and its cache blocks return to the free list.
"""

from __future__ import annotations

import math
import numbers
from typing import Mapping, Sequence

import torch

from .features import check_pooling

__all__ = ["OODGate", "record_tokens_saved"]


class OODGate:
    """``scorer`` (any object with ``score(x [B, D]) -> [B]``, higher meaning less in-distribution:
    :class:`~torch_kernels.ood.MahalanobisScorer`, ``EDMScorer``) and the ``threshold`` over which
    a prompt is refused, read at hidden state ``layer`` (indexed as in
    :func:`~torch_kernels.ood.extract_features`) with ``pooling`` ``"mean"`` or ``"last"``."""

    def __init__(self, scorer, threshold: float, layer: int = -1, pooling: str = "mean"):
        if not callable(getattr(scorer, "score", None)):
            raise TypeError(f"scorer: expected an object with score(x [B, D]) -> [B] (MahalanobisScorer, "
                            f"EDMScorer), got {type(scorer).__name__}")
        if not isinstance(threshold, numbers.Real) or isinstance(threshold, bool):
            raise TypeError(f"threshold: expected a float, got {type(threshold).__name__} {threshold!r}")
        if math.isnan(threshold):
            raise ValueError("threshold: expected a number, got NaN")
        if not isinstance(layer, numbers.Integral) or isinstance(layer, bool):
            raise TypeError(f"layer: expected an int, got {type(layer).__name__} {layer!r}")
        self.scorer, self.threshold = scorer, float(threshold)
        self.layer, self.pooling = int(layer), check_pooling(pooling)

    def __repr__(self) -> str:
        return (f"OODGate({type(self.scorer).__name__}, threshold={self.threshold:.6g}, layer={self.layer}, "
                f"pooling={self.pooling!r})")

    def score(self, features: torch.Tensor) -> list[float]:
        """The scorer's score of each row of ``features [B, D]`` (float32), as floats."""
        scores = self.scorer.score(features.float())
        if not isinstance(scores, torch.Tensor) or scores.shape != (features.shape[0],):
            raise ValueError(f"scorer: expected score() to return a [{features.shape[0]}] tensor, got "
                             f"{type(scores).__name__} {tuple(getattr(scores, 'shape', ()))}")
        return scores.tolist()

    def refuses(self, score: float) -> bool:
        """Whether a prompt with this score is refused: over the threshold, or NaN (no evidence it is in scope)."""
        return not score <= self.threshold


def record_tokens_saved(stats: Sequence, ungated_lengths: Mapping[int, int] | Sequence[int]) -> int:
    """Fill each step's ``decode_tokens_saved`` (``stats``: an engine's :class:`StepStats` list)
    with the tokens its refused requests generated in a run of the same requests without the
    gate (``ungated_lengths[request id]``), and return their total."""
    lengths = ungated_lengths if isinstance(ungated_lengths, Mapping) else dict(enumerate(ungated_lengths))
    total = 0
    for step in stats:
        missing = [i for i in step.refused_ids if i not in lengths]
        if missing:
            raise ValueError(f"ungated_lengths: expected the ungated output length of every refused request, "
                             f"missing request ids {missing}")
        step.decode_tokens_saved = sum(int(lengths[i]) for i in step.refused_ids)
        total += step.decode_tokens_saved
    return total

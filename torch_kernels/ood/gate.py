"""An out-of-distribution gate for the serving loop: refuse a prompt once its prefill is done.

>>> scorer = MahalanobisScorer("ledoit_wolf").fit(extract_features(model, tok, train_prompts, layer=15))
>>> gate = OODGate(scorer, scorer.threshold(extract_features(model, tok, val_prompts, layer=15)), layer=15)
>>> engine = Engine(model, ood_gate=gate)            # torch_kernels.serving.Engine
>>> outputs = engine.generate(prompts, 64)            # a refused prompt's output is empty

The engine pools each prompt's hidden states at ``layer`` (or at several layers, averaged or
concatenated: ``combine``) over positions ``[skip_first, length - skip_last)`` from its own
prefill forward passes (over several chunked steps, a running sum per request for ``"mean"``),
so the gate costs no extra forward pass; the feature it scores equals
:func:`~torch_kernels.ood.extract_features`'s for the same prompt, layers, pooling and span
(then :func:`~torch_kernels.ood.recipes.combine_layers`). A recipe's per-channel transform lives
in the scorer (:class:`~torch_kernels.ood.recipes.TransformedScorer`).

>>> gate = OODGate.fit(model, tok, train_prompts, val_prompts, train_labels=intents)  # layer="auto"

chooses the recipe (layers, span, transform) from in-distribution prompts alone (see
:meth:`OODGate.fit`). All prompts whose prefill ends in a step are scored in
one ``scorer.score`` call; one scoring over ``threshold`` (or NaN) finishes at once, refused,
with no generated token, and its cache blocks return to the free list.
"""

from __future__ import annotations

import math
import numbers
from typing import Mapping, Sequence

import torch

from .features import check_pooling, check_span
from .recipes import COMBINES, Recipe

__all__ = ["OODGate", "record_tokens_saved"]


class OODGate:
    """``scorer`` (any object with ``score(x [B, D]) -> [B]``, higher meaning less in-distribution:
    :class:`~torch_kernels.ood.MahalanobisScorer`, ``EDMScorer``, a ``TransformedScorer``) and the
    ``threshold`` over which a prompt is refused, read at hidden state ``layer`` (indexed as in
    :func:`~torch_kernels.ood.extract_features`; a sequence of layers is joined by ``combine``,
    ``"mean"`` or ``"concat"``) with ``pooling`` ``"mean"`` or ``"last"`` over positions
    ``[skip_first, length - skip_last)``."""

    def __init__(self, scorer, threshold: float, layer: int | Sequence[int] = -1, pooling: str = "mean",
                 skip_first: int = 0, skip_last: int = 0, combine: str = "mean"):
        if not callable(getattr(scorer, "score", None)):
            raise TypeError(f"scorer: expected an object with score(x [B, D]) -> [B] (MahalanobisScorer, "
                            f"EDMScorer), got {type(scorer).__name__}")
        if not isinstance(threshold, numbers.Real) or isinstance(threshold, bool):
            raise TypeError(f"threshold: expected a float, got {type(threshold).__name__} {threshold!r}")
        if math.isnan(threshold):
            raise ValueError("threshold: expected a number, got NaN")
        several = isinstance(layer, Sequence) and not isinstance(layer, (str, bytes))
        for i in (layer if several else [layer]):
            if not isinstance(i, numbers.Integral) or isinstance(i, bool):
                what = "an int or a sequence of ints" if several else "an int"
                raise TypeError(f"layer: expected {what}, got {type(i).__name__} {i!r}")
        if several and not layer:
            raise ValueError("layer: expected an int or a non-empty sequence of ints, got an empty sequence")
        check_span(skip_first, skip_last)
        if combine not in COMBINES:
            raise ValueError(f"combine: expected one of {COMBINES}, got {combine!r}")
        self.scorer, self.threshold = scorer, float(threshold)
        self.layer = tuple(int(i) for i in layer) if several else int(layer)
        self.pooling = check_pooling(pooling)
        self.skip_first, self.skip_last, self.combine = int(skip_first), int(skip_last), combine

    @property
    def layers(self) -> tuple[int, ...]:
        """The gate's layers as a tuple (one for a single ``layer``)."""
        return self.layer if isinstance(self.layer, tuple) else (self.layer,)

    @classmethod
    def from_recipe(cls, scorer, threshold: float, recipe: Recipe) -> "OODGate":
        """A gate reading ``recipe``'s layers, pooling and span (its transform belongs in ``scorer``)."""
        layer = recipe.layers if len(recipe.layers) > 1 else recipe.layers[0]
        return cls(scorer, threshold, layer, recipe.pooling, recipe.skip_first, recipe.skip_last, recipe.combine)

    @classmethod
    def fit(cls, model, tokenizer, train_texts, heldout_texts, train_labels=None, heldout_labels=None,
            layer="auto", pooling="mean", span="auto", transform="auto", scorer: str = "mahalanobis",
            tpr: float = 0.95, **kwargs) -> "OODGate":
        """A fitted gate whose recipe is chosen from in-distribution prompts alone; see
        :func:`torch_kernels.ood.select.fit_recipe` for the arguments and the criterion. The threshold
        accepts a fraction ``tpr`` of ``heldout_texts``. The chosen recipe and every candidate's
        criterion are in ``gate.recipe`` and ``gate.selection``."""
        from .select import fit_recipe

        fitted, threshold, recipe, selection = fit_recipe(
            model, tokenizer, train_texts, heldout_texts, train_labels, heldout_labels, layer=layer,
            pooling=pooling, span=span, transform=transform, scorer=scorer, tpr=tpr, **kwargs)
        gate = cls.from_recipe(fitted, threshold, recipe)
        gate.recipe, gate.selection = recipe, selection
        return gate

    def __repr__(self) -> str:
        span = f", skip_first={self.skip_first}, skip_last={self.skip_last}" if self.skip_first or self.skip_last else ""
        combine = f", combine={self.combine!r}" if isinstance(self.layer, tuple) else ""
        return (f"OODGate({type(self.scorer).__name__}, threshold={self.threshold:.6g}, layer={self.layer}, "
                f"pooling={self.pooling!r}{span}{combine})")

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

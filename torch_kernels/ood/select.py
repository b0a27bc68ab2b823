"""Choosing a gate's recipe from in-distribution prompts alone (``OODGate.fit(..., layer="auto")``).

The criterion is :func:`~torch_kernels.ood.recipes.intent_holdout_auroc`: how well a scorer fitted
on some in-scope intents tells held-out rows of those intents from held-out rows of the other
intents. No out-of-scope example is read; the in-scope rows' intent labels are. The search runs in
three stages, so that it costs tens of fits rather than thousands:

1. each pooling (and span) x each candidate layer, with per-channel standardization;
2. each transform of :data:`~torch_kernels.ood.recipes.TRANSFORMS` on stage 1's best;
3. the mean and the concatenation of stage 1's two and three best layers (same pooling).
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

import torch

from .features import _layer_list, _token_ids, extract_features, normalize_layers
from .recipes import TRANSFORMS, Recipe, combine_layers, intent_holdout_auroc, make_scorer, shared_span

__all__ = ["choose_recipe", "fit_recipe"]


def choose_recipe(pooled: Callable[[Hashable, tuple[int, ...], str], torch.Tensor], keys: Sequence[Hashable],
                  layers: Sequence[int], train_rows: torch.Tensor, heldout_rows: torch.Tensor,
                  labels: torch.Tensor, transforms: Sequence[str] = TRANSFORMS, folds: int = 3,
                  seed: int = 0, scorer: str = "mahalanobis") -> dict:
    """The three-stage search (module docstring) over features ``pooled(key, layers, combine) -> [N, D]``.

    ``keys``: the pooling candidates (any hashable naming a pooling and span); ``layers``: the
    layer candidates; ``train_rows`` / ``heldout_rows``: which of the ``N`` rows the criterion fits
    on and scores; ``labels [N]``: their intent ids. Returns the chosen ``key``, ``layers``,
    ``combine``, ``transform``, its ``criterion`` and every stage's values."""
    if not keys or not layers:
        raise ValueError("keys: expected at least one pooling and one layer candidate")

    def value(x, transform):
        return intent_holdout_auroc(x[train_rows], labels[train_rows], x[heldout_rows], labels[heldout_rows],
                                    scorer, transform, folds=folds, seed=seed)

    stage1 = {(key, layer): value(pooled(key, (layer,), "mean"), "standardize") for key in keys for layer in layers}
    key, layer = max(stage1, key=stage1.get)
    x = pooled(key, (layer,), "mean")
    stage2 = {t: value(x, t) for t in transforms}
    transform = max(stage2, key=stage2.get)
    ranked = sorted((k for k in stage1 if k[0] == key), key=stage1.get, reverse=True)
    stage3 = {((layer,), "mean"): stage2[transform]}
    for n in (2, 3):
        if len(ranked) >= n:
            several = tuple(sorted(l for _, l in ranked[:n]))
            for combine in ("mean", "concat"):
                stage3[(several, combine)] = value(pooled(key, several, combine), transform)
    chosen_layers, combine = max(stage3, key=stage3.get)
    return {"key": key, "layers": chosen_layers, "combine": combine, "transform": transform,
            "criterion": stage3[(chosen_layers, combine)], "stage1": stage1, "stage2": stage2, "stage3": stage3}


def fit_recipe(model, tokenizer, train_texts, heldout_texts, train_labels, heldout_labels, layer="auto",
               pooling="mean", span="auto", transform="auto", scorer: str = "mahalanobis", tpr: float = 0.95,
               folds: int = 3, seed: int = 0, batch_size: int = 16, progress: bool = False, cache_dir=None,
               edm_steps: int | None = None):
    """``(fitted scorer, threshold, Recipe, selection)`` for an :class:`~torch_kernels.ood.OODGate`.

    ``layer``: ``"auto"`` (every hidden state is a candidate), an int, or a sequence of candidate
    ints. ``pooling``: ``"mean"``, ``"last"`` or ``"auto"`` (both). ``span``: ``"auto"`` (all
    positions; all but the first, the sink; all but the prompts' shared prefix and suffix, the chat
    template, as :func:`~torch_kernels.ood.recipes.shared_span` finds it) or a fixed
    ``(skip_first, skip_last)``. ``transform``: ``"auto"`` or one of
    :data:`~torch_kernels.ood.recipes.TRANSFORMS`. The criterion needs the in-scope rows' intent
    labels (``train_labels``, ``heldout_labels``: int tensors or sequences of hashables) whenever
    something is ``"auto"``; ``scorer`` (one of :data:`~torch_kernels.ood.recipes.SCORERS`) is what
    the gate then fits, on ``train_texts``; its threshold accepts a fraction ``tpr`` of
    ``heldout_texts``. Each span candidate costs one forward pass over the texts (all candidate
    layers come from it); the served gate then pools from the prefill's own states.
    """
    train_ids, heldout_ids = _token_ids(tokenizer, train_texts), _token_ids(tokenizer, heldout_texts)
    ids = train_ids + heldout_ids
    num_layers = len(_layer_list(model))
    layer_candidates = list(range(num_layers + 1)) if layer == "auto" else list(normalize_layers(layer, num_layers))
    if pooling not in ("mean", "last", "auto"):
        raise ValueError(f"pooling: expected 'mean', 'last' or 'auto', got {pooling!r}")
    poolings = ["mean", "last"] if pooling == "auto" else [pooling]
    if span == "auto":
        prefix, suffix = shared_span(ids)
        spans = list(dict.fromkeys([(0, 0), (1, 0), (prefix, suffix)]))
    elif isinstance(span, tuple) and len(span) == 2:
        spans = [span]
    else:
        raise ValueError(f"span: expected 'auto' or a (skip_first, skip_last) tuple, got {span!r}")
    if transform != "auto" and transform not in TRANSFORMS:
        raise ValueError(f"transform: expected 'auto' or one of {TRANSFORMS}, got {transform!r}")
    automatic = len(layer_candidates) > 1 or len(poolings) > 1 or len(spans) > 1 or transform == "auto"

    features = {}
    for skip in spans:
        for p in poolings:
            features[(p, skip)] = extract_features(model, None, ids, layer=layer_candidates, pooling=p,
                                                   batch_size=batch_size, progress=progress, cache_dir=cache_dir,
                                                   skip_first=skip[0], skip_last=skip[1])
    position = {l: i for i, l in enumerate(layer_candidates)}

    def pooled(key, layers, combine):
        return combine_layers(features[key][:, [position[l] for l in layers]], combine)

    n_train = len(train_ids)
    train_rows, heldout_rows = torch.arange(n_train), torch.arange(n_train, len(ids))
    labels = None
    if automatic or scorer == "mahalanobis_intents":
        labels = _intent_ids(train_labels, heldout_labels, n_train, len(heldout_ids))
    if automatic:
        transforms = TRANSFORMS if transform == "auto" else (transform,)
        selection = choose_recipe(pooled, list(features), layer_candidates, train_rows, heldout_rows, labels,
                                  transforms, folds=folds, seed=seed)
        (p, skip), layers, combine, chosen = (selection["key"], selection["layers"], selection["combine"],
                                              selection["transform"])
    else:
        selection = None
        (p, skip), layers, combine, chosen = next(iter(features)), tuple(layer_candidates), "mean", transform
    recipe = Recipe(layers, p, skip[0], skip[1], combine, chosen)
    x = pooled((p, skip), recipe.layers, combine)
    fitted, fit = make_scorer(scorer, chosen, edm_steps, seed)
    fit(x[train_rows], None if labels is None else labels[train_rows])
    threshold = fitted.threshold(x[heldout_rows], tpr=tpr)
    return fitted, threshold, recipe, selection


def _intent_ids(train_labels, heldout_labels, n_train: int, n_heldout: int) -> torch.Tensor:
    """The labels of both sets as one int64 tensor of ids ``0..C-1`` (any hashable labels)."""
    for name, labels, n in (("train_labels", train_labels, n_train), ("heldout_labels", heldout_labels, n_heldout)):
        if labels is None:
            raise ValueError(f"{name}: choosing a recipe (or fitting 'mahalanobis_intents') needs the in-scope "
                             f"rows' intent labels, got None")
        if len(labels) != n:
            raise ValueError(f"{name}: expected one label per text ({n}), got {len(labels)}")
    values = [v.item() if isinstance(v, torch.Tensor) else v for v in [*train_labels, *heldout_labels]]
    index = {v: i for i, v in enumerate(dict.fromkeys(values))}
    return torch.tensor([index[v] for v in values], dtype=torch.int64)

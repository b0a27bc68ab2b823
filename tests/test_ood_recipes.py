"""torch_kernels.ood.recipes and the recipe choice (torch_kernels.ood.select), on synthetic tensors:

- each FeatureTransform against its definition computed directly (sorted order statistics for
  the median and quartiles, per-row norms); TransformedScorer equals the scorer on transformed rows;
- shared_span and combine_layers against hand-worked cases;
- the selection criterion and the staged choice on features whose right answer is known (one
  layer carries the intents, another none; one pooling has a few huge channels);
- OODGate.fit end to end on a tiny Llama: its engine scores equal the chosen recipe's offline ones.
"""

from __future__ import annotations

import pytest
import torch

from torch_kernels.ood import MahalanobisScorer, OODGate, extract_features
from torch_kernels.ood.recipes import (FeatureTransform, Recipe, TransformedScorer, combine_layers,
                                       intent_holdout_auroc, shared_span)
from torch_kernels.ood.select import choose_recipe


def _quantile(column: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default), written out."""
    ordered = sorted(column)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def _direct(kind: str, train: torch.Tensor, x: torch.Tensor, clip: float = 4.0) -> torch.Tensor:
    n, d = train.shape
    out = x.double().clone()
    for j in range(d):
        column = train[:, j].double().tolist()
        if kind == "standardize":
            center = sum(column) / n
            scale = (sum((v - center) ** 2 for v in column) / (n - 1)) ** 0.5
        elif kind in ("robust", "clip", "robust_l2", "clip_l2"):
            center = _quantile(column, 0.5)
            scale = (_quantile(column, 0.75) - _quantile(column, 0.25)) / 1.3489795
        else:
            continue
        scale = scale if scale > 0 else 1.0
        out[:, j] = (out[:, j] - center) / scale
    if "clip" in kind:
        out = torch.tensor([[min(max(v, -clip), clip) for v in row] for row in out.tolist()], dtype=torch.float64)
    if kind.endswith("l2"):
        out = torch.stack([row / sum(v * v for v in row.tolist()) ** 0.5 for row in out])
    return out


@pytest.mark.parametrize("kind", ["none", "standardize", "robust", "clip", "l2", "robust_l2", "clip_l2"])
def test_transforms_match_their_definition(kind):
    gen = torch.Generator().manual_seed(0)
    train = torch.randn(41, 6, generator=gen) * torch.tensor([1.0, 50.0, 0.1, 3.0, 1.0, 1.0])
    train[0, 1] = 5e4  # a huge activation: moves the mean and std, not the median or the IQR
    train[:, 5] = 2.0  # a channel with no spread keeps scale 1
    x = torch.randn(9, 6, generator=gen) * 20
    got = FeatureTransform(kind).fit(train)(x)
    torch.testing.assert_close(got.double(), _direct(kind, train, x), rtol=1e-5, atol=1e-5)
    if kind in ("robust", "clip"):  # the one huge row did not set the scale
        assert FeatureTransform(kind).fit(train).scale_[1] < 200


def test_transformed_scorer_is_the_scorer_on_transformed_rows():
    gen = torch.Generator().manual_seed(1)
    train, x = torch.randn(200, 5, generator=gen), torch.randn(7, 5, generator=gen)
    transform = FeatureTransform("clip", clip=1.5).fit(train)
    want = MahalanobisScorer("ledoit_wolf").fit(transform(train)).score(transform(x))
    scorer = TransformedScorer(FeatureTransform("clip", clip=1.5), MahalanobisScorer("ledoit_wolf")).fit(train)
    torch.testing.assert_close(scorer.score(x), want)
    assert scorer.threshold(train, tpr=1.0) == pytest.approx(scorer.score(train).max().item())


def test_shared_span_and_combine_layers():
    prompts = [[1, 2, 3, 7, 8, 9], [1, 2, 3, 5, 5, 8, 9], [1, 2, 3, 6, 8, 9]]
    assert shared_span(prompts) == (3, 2)
    assert shared_span([[1, 2, 3], [1, 2, 3]]) == (2, 0)  # identical prompts keep one position
    assert shared_span([[4, 1], [4, 2, 1]]) == (1, 0)  # the shorter one needs a position between
    with pytest.raises(ValueError, match=r"^prompts: expected at least 2"):
        shared_span([[1]])
    x = torch.arange(24.0).reshape(2, 3, 4)
    torch.testing.assert_close(combine_layers(x, "mean"), (x[:, 0] + x[:, 1] + x[:, 2]) / 3)
    torch.testing.assert_close(combine_layers(x, "concat"), torch.cat([x[:, 0], x[:, 1], x[:, 2]], dim=1))
    with pytest.raises(ValueError, match=r"^combine: expected one of"):
        combine_layers(x, "sum")


def _intents(n: int, num_intents: int, dim: int, spread: float, seed: int):
    """Rows around one centre per intent (``spread``: the centres' distance against a unit noise)."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_intents, dim, generator=gen) * spread
    labels = torch.arange(n) % num_intents
    return centres[labels] + torch.randn(n, dim, generator=gen), labels


def test_intent_holdout_criterion_separates_signal_from_noise():
    # more dimensions than intents: the seen intents' centres leave directions the unseen ones take
    x, labels = _intents(600, 20, 32, spread=4.0, seed=0)
    train, heldout = torch.arange(400), torch.arange(400, 600)
    signal = intent_holdout_auroc(x[train], labels[train], x[heldout], labels[heldout], folds=4)
    noise = torch.randn(600, 32, generator=torch.Generator().manual_seed(1))
    chance = intent_holdout_auroc(noise[train], labels[train], noise[heldout], labels[heldout], folds=4)
    assert signal > 0.9 and abs(chance - 0.5) < 0.1


def test_staged_choice_finds_the_informative_layer_and_pooling():
    """Layer 1 of pooling "clean" carries the intents; layer 0 is noise; pooling "sink" is layer 1
    with a few channels a thousand times larger and intent-free (the attention sink's)."""
    n, dim = 600, 32
    signal, labels = _intents(n, 20, dim, spread=4.0, seed=2)
    gen = torch.Generator().manual_seed(3)
    noise = torch.randn(n, dim, generator=gen)
    sink = signal.clone()
    sink[:, :3] = torch.randn(n, 3, generator=gen) * 1e3 + 5e3
    sink[:, 3:] = torch.randn(n, dim - 3, generator=gen)  # intents drowned
    table = {("clean", 0): noise, ("clean", 1): signal, ("sink", 0): noise, ("sink", 1): sink}

    def pooled(key, layers, combine):
        return combine_layers(torch.stack([table[(key, l)] for l in layers], dim=1), combine)

    pick = choose_recipe(pooled, ["sink", "clean"], [0, 1], torch.arange(400), torch.arange(400, n), labels,
                         transforms=("none", "clip", "l2"), folds=4)
    assert (pick["key"], pick["layers"]) == ("clean", (1,))
    assert pick["stage1"][("clean", 1)] > 0.9 > 0.6 > pick["stage1"][("clean", 0)]
    assert set(pick["stage2"]) == {"none", "clip", "l2"} and pick["criterion"] == max(pick["stage3"].values())


def test_gate_fit_chooses_a_recipe_the_engine_reproduces():
    transformers = pytest.importorskip("transformers")
    from torch_kernels.serving import Engine

    config = transformers.LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(4)
    template, suffix = [1, 2, 3], [4]

    def prompts(n, intent_offset):
        # a shared template around a question whose tokens come from its intent's own vocabulary
        labels = torch.arange(n) % 6
        return [template + (torch.randint(0, 6, (5,), generator=gen) + 10 + 6 * int(l) + intent_offset).tolist()
                + suffix for l in labels], labels

    train, train_labels = prompts(90, 0)
    heldout, heldout_labels = prompts(48, 0)
    gate = OODGate.fit(model, None, train, heldout, train_labels, heldout_labels, layer=[1, 2], span="auto",
                       transform="clip", folds=2)  # the transform stage is tested above
    assert gate.recipe.transform == "clip" and len(gate.selection["stage1"]) == 2 * 3  # layers x spans
    assert isinstance(gate.recipe, Recipe) and gate.selection["criterion"] > 0.5
    assert (gate.skip_first, gate.skip_last) in {(0, 0), (1, 0), (3, 1)}
    assert gate.threshold == pytest.approx(gate.scorer.threshold(_offline(model, gate, heldout), 0.95))
    queries = heldout[:4]
    engine = Engine(model, num_blocks=32, block_size=4, max_batched_tokens=8, implementation="reference",
                    ood_gate=gate)
    requests = [engine.add_request(q, 2) for q in queries]
    while engine.waiting or engine.running:
        engine.step()
    want = gate.scorer.score(_offline(model, gate, queries))
    torch.testing.assert_close(torch.tensor([r.ood_score for r in requests]), want, rtol=1e-4, atol=1e-4)


def _offline(model, gate, texts):
    x = extract_features(model, None, texts, layer=list(gate.layers), pooling=gate.pooling, progress=False,
                         skip_first=gate.skip_first, skip_last=gate.skip_last)
    return combine_layers(x, gate.combine)

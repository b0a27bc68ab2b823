"""The OOD gate inside the serving loop (torch_kernels.ood.OODGate in torch_kernels.serving.Engine):

- the pooled feature the gate scores equals extract_features's on the same prompt, layer and
  pooling, over chunked prefill (prompts split over several steps, mixed with decodes);
- a prompt scored over the threshold finishes in the step its prefill ends, with no generated
  token, and its blocks are back on the free list; every other request's output is token for
  token that of the same engine without the gate (and transformers' generate);
- the step statistics count scored and refused prompts, and tokens saved against a run without
  the gate; bad arguments are rejected naming the argument;
- the goodput demo runs in its smoke mode and writes its files.
"""

from __future__ import annotations

import json

import pytest
import torch

from torch_kernels import models
from torch_kernels.ood import MahalanobisScorer, OODGate, extract_features, record_tokens_saved
from torch_kernels.ood.recipes import combine_layers
from torch_kernels.serving import Engine


transformers = pytest.importorskip("transformers")  # a test dependency ([test] extra)

LENGTHS = (3, 19, 5, 11, 30, 8)  # with 8 tokens a step, the 19- and 30-token prompts take 3 and 4 steps


def _llama():
    """Two layers, so that 0 (embeddings), 1 (between layers) and 2 (after the final norm) all differ."""
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)  # wide weights, so that the top logits lie well apart
    return transformers.LlamaForCausalLM(config).eval()


def _prompts(lengths=LENGTHS, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=gen).tolist() for n in lengths]


def _in_order_of(seen, want):
    """The rows of ``seen`` (features in the order the gate scored them: by end of prefill)
    reordered to match ``want``'s rows, each to its nearest; they must pair one to one."""
    nearest = torch.cdist(want, seen).argmin(dim=1)
    assert sorted(nearest.tolist()) == list(range(len(seen))), "features do not pair one to one"
    return seen[nearest]


class RecordingScorer:
    """Scores as ``inner`` does and keeps every batch of features it was asked to score."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def score(self, x):
        self.calls.append(x.clone())
        return self.inner.score(x)


def _fitted_scorer(model, layer, pooling):
    train = _prompts([10] * 80, seed=2)
    return MahalanobisScorer("ledoit_wolf").fit(extract_features(model, None, train, layer=layer, pooling=pooling,
                                                                 progress=False))


def _engine(model, gate=None, **kwargs):
    return Engine(model, num_blocks=24, block_size=4, max_batched_tokens=8, max_seqs=3,
                  implementation="reference", ood_gate=gate, **kwargs)


def _serve(engine, prompts, max_new_tokens):
    """Requests in order; after each step, a check that every finished request's blocks are free."""
    requests = [engine.add_request(p, max_new_tokens) for p in prompts]
    while engine.waiting or engine.running:
        for done in engine.step():
            assert set(done.blocks) <= set(engine.cache.free), f"request {done.id}: blocks not returned"
    return requests


@pytest.mark.parametrize("pooling", ["mean", "last"])
@pytest.mark.parametrize("layer", [0, 1, -1])
def test_gate_features_equal_extract_features_over_chunked_prefill(layer, pooling):
    model, prompts = _llama(), _prompts()
    scorer = RecordingScorer(_fitted_scorer(model, layer, pooling))
    engine = _engine(model, OODGate(scorer, float("inf"), layer=layer, pooling=pooling))
    requests = _serve(engine, prompts, 6)
    assert any(s.prefill_tokens and s.decode_tokens for s in engine.stats), "no step mixed prefill and decode"
    assert max(LENGTHS) > 3 * engine.max_batched_tokens, "no prompt was split over several steps"

    seen = torch.cat(scorer.calls)
    assert seen.shape == (len(prompts), 32) and sum(s.gated for s in engine.stats) == len(prompts)
    want = extract_features(model, None, prompts, layer=layer, pooling=pooling, progress=False)
    torch.testing.assert_close(_in_order_of(seen, want), want, rtol=1e-4, atol=1e-5)
    assert not any(r.refused for r in requests)


class SumScorer:
    def score(self, x):
        return x.sum(dim=1)


@pytest.mark.parametrize("layer, pooling, skip, combine", [
    ((0, 2), "mean", (1, 1), "concat"),  # skip the first token (sink) and the last
    ((1, -1), "last", (0, 2), "mean"),  # the last pooled position lies before the prompt's end
    (1, "mean", (2, 0), "mean"),
])
def test_gate_recipes_equal_extract_features_over_chunked_prefill(layer, pooling, skip, combine):
    """Spans and several layers: the gate pools the prefill's own states as extract_features does."""
    model, prompts = _llama(), _prompts()
    scorer = RecordingScorer(SumScorer())
    gate = OODGate(scorer, float("inf"), layer=layer, pooling=pooling, skip_first=skip[0], skip_last=skip[1],
                   combine=combine)
    _serve(_engine(model, gate), prompts, 3)
    want = extract_features(model, None, prompts, layer=layer if isinstance(layer, int) else list(layer),
                            pooling=pooling, skip_first=skip[0], skip_last=skip[1], progress=False)
    if not isinstance(layer, int):
        want = combine_layers(want, combine)
    seen = torch.cat(scorer.calls)
    torch.testing.assert_close(_in_order_of(seen, want), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"^prompt: expected more than skip_first \+ skip_last"):
        _engine(model, gate).add_request([5] * sum(skip), 2)  # nothing left to pool


def test_refused_prompts_decode_nothing_and_the_rest_match_the_ungated_run():
    model, prompts = _llama(), _prompts()
    layer, pooling = 1, "mean"
    scorer = _fitted_scorer(model, layer, pooling)
    scores = scorer.score(extract_features(model, None, prompts, layer=layer, pooling=pooling, progress=False))
    # a threshold between the 3rd and 4th highest scores refuses three prompts, with room to spare
    ranked = scores.sort(descending=True).values
    threshold = float(ranked[2:4].mean())
    assert float(ranked[2] - ranked[3]) > 1e-3 * float(ranked[0])
    expect_refused = {i for i, s in enumerate(scores.tolist()) if s > threshold}
    assert len(expect_refused) == 3

    ungated_engine = _engine(model)
    ungated = _serve(ungated_engine, prompts, 6)
    engine = _engine(model, OODGate(scorer, threshold, layer=layer, pooling=pooling))
    gated = _serve(engine, prompts, 6)

    assert {r.id for r in gated if r.refused} == expect_refused
    for r, plain in zip(gated, ungated):
        assert r.finished and r.ood_score == pytest.approx(scores[r.id].item(), rel=1e-4)
        if r.refused:
            assert r.output == [] and r.num_cached == len(r.prompt), f"refused request {r.id} went on"
        else:
            assert r.output == plain.output, f"request {r.id}: {r.output} != ungated {plain.output}"
    assert sorted(engine.cache.free) == list(range(24)), "blocks leaked"
    assert not engine.running and not engine.waiting

    # steps: every prompt scored once; refusals recorded in the step their prefill ended
    assert sum(s.gated for s in engine.stats) == len(prompts)
    assert sorted(i for s in engine.stats for i in s.refused_ids) == sorted(expect_refused)
    # with mean pooling the gate also works (sums chunks) in prefill steps where no prompt ends
    assert all((s.gate_s > 0) == (s.prefill_tokens > 0) and s.forward_s > 0 for s in engine.stats)
    assert all(s.gated == 0 and s.gate_s == 0 and not s.refused_ids for s in ungated_engine.stats)
    ungated_lengths = [len(r.output) for r in ungated]
    saved = record_tokens_saved(engine.stats, ungated_lengths)
    assert saved == sum(ungated_lengths[i] for i in expect_refused) > 0
    assert all(s.decode_tokens_saved == sum(ungated_lengths[i] for i in s.refused_ids) for s in engine.stats)
    assert sum(len(r.output) for r in gated) + saved == sum(ungated_lengths)
    # a request feeds back every generated token but its last: the decode steps shrink by as much
    fed = lambda stats: sum(s.decode_tokens for s in stats)  # noqa: E731
    assert fed(ungated_engine.stats) - fed(engine.stats) == sum(ungated_lengths[i] - 1 for i in expect_refused)
    with pytest.raises(ValueError, match=r"^ungated_lengths: .*missing request ids"):
        record_tokens_saved(engine.stats, {})


def test_a_refused_request_frees_its_blocks_for_a_waiting_one():
    """The cache holds one request at a time: a refusal admits the next request at the next step."""
    model = _llama()
    prompts = _prompts((6, 6))
    scorer = RecordingScorer(_fitted_scorer(model, -1, "last"))
    engine = Engine(model, num_blocks=3, block_size=4, max_batched_tokens=8, implementation="reference",
                    ood_gate=OODGate(scorer, float("-inf"), layer=-1, pooling="last"))  # refuses everything
    first, second = (engine.add_request(p, 6) for p in prompts)  # each needs all 3 blocks
    assert engine.step() == [first] and first.refused and first.output == []
    assert sorted(engine.cache.free) == [0, 1, 2] and list(engine.waiting) == [second]
    assert engine.step() == [second] and second.refused
    assert len(engine.stats) == 2 and all(s.decode_tokens == 0 for s in engine.stats)


def test_nan_scores_are_refused_and_a_failing_scorer_frees_the_step():
    model, prompts = _llama(), _prompts((4, 5))

    class Scores:
        def __init__(self, value):
            self.value = value

        def score(self, x):
            return self.value(x)

    engine = _engine(model, OODGate(Scores(lambda x: torch.full((len(x),), float("nan"))), 1.0))
    assert engine.generate(prompts, 4) == [[], []]
    engine = _engine(model, OODGate(Scores(lambda x: torch.zeros(len(x) + 1)), 1.0))
    with pytest.raises(ValueError, match=r"^scorer: expected score\(\) to return a \[\d\] tensor"):
        engine.generate(prompts, 4)
    assert not engine.running and not engine.waiting and sorted(engine.cache.free) == list(range(24))


def test_bad_gate_arguments_name_them():
    scorer = MahalanobisScorer()
    for kwargs, error, match in [
        (dict(scorer=object()), TypeError, r"^scorer: expected an object with score"),
        (dict(threshold="1.0"), TypeError, r"^threshold: expected a float, got str"),
        (dict(threshold=True), TypeError, r"^threshold: expected a float, got bool"),
        (dict(threshold=float("nan")), ValueError, r"^threshold: expected a number, got NaN"),
        (dict(layer=1.5), TypeError, r"^layer: expected an int, got float"),
        (dict(pooling="max"), ValueError, r"^pooling: expected one of \('mean', 'last'\)"),
        (dict(layer=[]), ValueError, r"^layer: expected an int or a non-empty sequence"),
        (dict(layer=[1, 2.0]), TypeError, r"^layer: expected an int or a sequence of ints, got float"),
        (dict(skip_first=-1), ValueError, r"^skip_first: expected an int >= 0, got -1"),
        (dict(skip_last=1.0), TypeError, r"^skip_last: expected an int, got float"),
        (dict(combine="sum"), ValueError, r"^combine: expected one of \('mean', 'concat'\)"),
    ]:
        with pytest.raises(error, match=match):
            OODGate(**(dict(scorer=scorer, threshold=1.0) | kwargs))
    model = _llama()
    with pytest.raises(TypeError, match=r"^ood_gate: expected a torch_kernels.ood.OODGate or None, got str"):
        Engine(model, ood_gate="gate")
    with pytest.raises(ValueError, match=r"^layer: expected an index in \[-3, 2\] .*got 3"):
        Engine(model, ood_gate=OODGate(scorer, 1.0, layer=3))


# ---- on the real model and data: SmolLM2 with chat prompts, and the goodput demo ----


def test_smollm2_gate_features_equal_extract_features(smollm2):
    model, tokenizer = smollm2
    prompts = [models.chat_prompt(tokenizer, q) for q in ("what is my checking balance", "play some jazz music")]
    layer = 12
    scorer = RecordingScorer(MahalanobisScorer("ledoit_wolf").fit(torch.randn(64, model.config.hidden_size)))
    engine = Engine(model, num_blocks=16, block_size=16, max_batched_tokens=24, implementation="reference",
                    ood_gate=OODGate(scorer, float("inf"), layer=layer, pooling="mean"))
    engine.generate(prompts, 2)
    assert min(map(len, prompts)) > 24, "no prompt was chunked"
    want = extract_features(model, tokenizer, prompts, layer=layer, progress=False)
    got = torch.cat(scorer.calls)
    torch.testing.assert_close(_in_order_of(got, want), want, rtol=1e-4, atol=1e-4)


def test_goodput_smoke_writes_its_files(smollm2, tmp_path, monkeypatch, capsys):
    """``python -m torch_kernels goodput --smoke --out DIR``, on the loaded model and an empty feature cache."""
    from torch_kernels.__main__ import main

    monkeypatch.setenv("TORCH_KERNELS_SMOLLM2", str(models.smollm2_path()))
    monkeypatch.setenv("TORCH_KERNELS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "load_smollm2", lambda dtype=None: smollm2)
    assert main(["goodput", "--smoke", "--out", str(tmp_path)]) == 0
    for suffix in (".md", ".json", ".png"):
        assert (tmp_path / f"goodput-smoke{suffix}").stat().st_size > 0
    assert len(list((tmp_path / "cache" / "features").glob("features-*.pt"))) == 4  # one per split
    assert capsys.readouterr().out.startswith((tmp_path / "goodput-smoke.md").read_text())
    saved = json.loads((tmp_path / "goodput-smoke.json").read_text())
    plain = saved["serving"]["no gate"]
    gated = [run for name, run in saved["serving"].items() if name != "no gate"]
    assert list(saved["scorers"]) == ["Mahalanobis", "Mahalanobis, intents", "EDM"] and len(gated) == 3  # one each
    for run in gated:
        assert run["tokens_generated"] + run["tokens_saved"] == plain["tokens_generated"]
        assert run["kept_outputs_identical"] and run["requests"] == plain["requests"] == 4
        assert run["in_scope_tokens"] + run["out_of_scope_tokens"] == run["tokens_generated"]
        assert run["gate_ms_per_request"] > 0
        assert run["gate_score_max_rel_diff"] < 1e-3  # the gate's scores are extract_features's
    for scorer in saved["scorers"].values():
        assert 0.0 <= scorer["auroc"] <= 1.0 and 0.0 <= scorer["fpr95"] <= 1.0
    assert "| Mahalanobis |" in (tmp_path / "goodput-smoke.md").read_text()

"""The goodput demo: ``python -m torch_kernels goodput [--smoke | --full] [--out DIR]``.

CLINC150's queries (150 in-scope intents, and out-of-scope queries; packaged in
``torch_kernels/data/clinc150``) go as chat prompts to SmolLM2-135M-Instruct through the paged
serving loop (:class:`torch_kernels.serving.Engine`) with an OOD gate
(:class:`torch_kernels.ood.OODGate`):

1. Features: each prompt's hidden states by the gate's recipe (:mod:`torch_kernels.ood.recipes`;
   default :data:`RECIPE`, which ``benchmarks/ood_recipes.py`` chose from in-scope data alone):
   hidden states pooled over the question's tokens (the chat template's shared prefix and suffix
   left out), from the same forward pass as the prefill (:func:`torch_kernels.ood.extract_features`,
   cached on disk after the first run).
2. Scorers, fitted on in-scope training queries' features behind the recipe's per-channel
   transform: a Gaussian (:class:`~torch_kernels.ood.MahalanobisScorer`, Ledoit-Wolf; label-free),
   the same with one mean per in-scope intent (it reads the training queries' intent labels, never
   an out-of-scope query) and an EDM diffusion model (:class:`~torch_kernels.ood.EDMScorer`);
   each threshold at 95% TPR on in-scope validation queries. AUROC, FPR at 95% TPR and AUPR on
   in-scope test against out-of-scope test queries.
3. Serving: the same requests (in-scope and out-of-scope test queries, shuffled) without a gate
   and with each scorer's gate; tokens generated, tokens saved by refusals, and goodput (the
   share of generated tokens spent on in-scope requests); the gate's latency per request against
   the prefill forward's.

Results: Markdown, JSON and a PNG (ROC curves, tokens per run) in the output folder.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import statistics
import sys
import time

import torch

from ._cache import cache_dir

DATA = pathlib.Path(__file__).resolve().parent / "data" / "clinc150" / "data_full.json"
ROOT = pathlib.Path(__file__).resolve().parent.parent
# The recipe benchmarks/ood_recipes.py chose on in-scope rows alone (results/ood_recipes.md): the
# mean over the prompt after the chat template's shared prefix, of hidden states 8, 9 and 10
# concatenated, robust z-scores clipped then L2-normalized. span: "prefix" leaves out the shared
# prefix, "template" also the shared suffix, "sink" position 0, "all" nothing.
RECIPE = {"layers": (8, 9, 10), "pooling": "mean", "span": "prefix", "combine": "concat", "transform": "clip_l2"}
SEED = 0


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How much of CLINC150 a run uses: random subsets (``None``: the whole split)."""

    name: str
    train: int | None  # in-scope training queries the scorers fit on (of 15000)
    val: int | None  # in-scope validation queries the thresholds come from (of 3000)
    test: int | None  # in-scope test queries (of 4500)
    oos_test: int | None  # out-of-scope test queries (of 1000)
    served_in_scope: int  # of the test queries above, served through the engine
    served_out_of_scope: int
    max_new_tokens: int
    edm_steps: int | None = None  # EDMScorer's training steps (None: its default)


SIZES = {
    "smoke": Sizes("smoke", train=32, val=16, test=8, oos_test=8, served_in_scope=2, served_out_of_scope=2,
                   max_new_tokens=4, edm_steps=50),
    "default": Sizes("default", train=1500, val=600, test=900, oos_test=900, served_in_scope=16,
                     served_out_of_scope=16, max_new_tokens=48, edm_steps=1000),
    "full": Sizes("full", train=None, val=None, test=None, oos_test=None, served_in_scope=32,
                  served_out_of_scope=32, max_new_tokens=64),
}


def load_clinc150(sizes: Sizes, path: pathlib.Path = DATA, with_intents: bool = False):
    """The queries of each split a run uses (random subsets drawn with a fixed seed); with
    ``with_intents``, also each split's intent labels: ``(queries, intents)``."""
    data = json.loads(path.read_text())
    rng = random.Random(SEED)

    def sample(split: str, n: int | None) -> list[tuple[str, str]]:
        rows = data[split]
        return rows if n is None or n >= len(rows) else rng.sample(rows, n)

    rows = {"train": sample("train", sizes.train), "val": sample("val", sizes.val),
            "test": sample("test", sizes.test), "oos_test": sample("oos_test", sizes.oos_test)}
    queries = {split: [text for text, _ in r] for split, r in rows.items()}
    return (queries, {split: [label for _, label in r] for split, r in rows.items()}) if with_intents else queries


def _cache_dir() -> pathlib.Path:
    return cache_dir("features")


SCORERS = {"Mahalanobis": "mahalanobis", "Mahalanobis, intents": "mahalanobis_intents", "EDM": "edm"}


def _scorers(train: torch.Tensor, intents: list[str], transform: str, sizes: Sizes) -> dict[str, tuple[object, float]]:
    """Each scorer of :data:`SCORERS` behind ``transform``, fitted on ``train`` (the intents scorer
    also on its rows' ``intents``), each with its fit time in seconds."""
    from .ood.recipes import make_scorer

    ids = {name: i for i, name in enumerate(sorted(set(intents)))}
    labels = torch.tensor([ids[name] for name in intents])
    out = {}
    for name, kind in SCORERS.items():
        start = time.perf_counter()
        scorer, fit = make_scorer(kind, transform, sizes.edm_steps, SEED)
        fit(train, labels)
        out[name] = (scorer, time.perf_counter() - start)
    return out


def recipe_for(prompts: list[list[int]], layers=None, pooling=None, span=None, combine=None, transform=None):
    """:data:`RECIPE` (each argument given overrides its entry) as a :class:`~torch_kernels.ood.recipes.Recipe`,
    its span counted on ``prompts`` (the chat template's shared prefix and suffix)."""
    from .ood.recipes import Recipe, shared_span

    span = span or RECIPE["span"]
    shared = shared_span(prompts)
    skips = {"prefix": (shared[0], 0), "template": shared, "sink": (1, 0), "all": (0, 0)}
    if span not in skips:
        raise ValueError(f"span: expected one of {tuple(skips)}, got {span!r}")
    return Recipe(layers if layers is not None else RECIPE["layers"], pooling or RECIPE["pooling"], *skips[span],
                  combine or RECIPE["combine"], transform or RECIPE["transform"])


def _serve(model, prompts, sizes: Sizes, name: str, gate=None, progress: bool = True):
    """Serve ``prompts`` to the end: the engine, its requests and the wall time in seconds."""
    from tqdm.auto import tqdm  # a dependency of transformers, which the demo needs

    from .serving import Engine

    engine = Engine(model, num_blocks=160, block_size=16, max_batched_tokens=256, max_seqs=16, ood_gate=gate)
    requests = [engine.add_request(p, sizes.max_new_tokens) for p in prompts]
    bar = tqdm(total=len(requests), desc=f"serving ({name})", unit="request", disable=not progress)
    start = time.perf_counter()
    while engine.waiting or engine.running:
        bar.update(len(engine.step()))
    bar.close()
    return engine, requests, time.perf_counter() - start


def _prefill_latency(model, prompts, repeats: int = 8) -> float:
    """Median wall time of one prompt's prefill forward pass, alone in the engine (seconds)."""
    from .serving import Engine

    times = []
    for prompt in prompts[:repeats]:
        engine = Engine(model, num_blocks=16, block_size=16, max_batched_tokens=256)
        engine.generate([prompt], 1)
        times.append(engine.stats[0].forward_s)
    return statistics.median(times)


@torch.inference_mode()  # as the gate scores inside the engine's step
def _score_latency(scorer, row: torch.Tensor, repeats: int = 10) -> float:
    """The fastest of ``repeats`` calls of ``scorer.score`` on one row, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        scorer.score(row)
        best = min(best, time.perf_counter() - start)
    return best


def run(sizes: Sizes, out_dir: pathlib.Path, model=None, tokenizer=None, layer=None, pooling: str | None = None,
        cache_dir: pathlib.Path | None = None, progress: bool = True, span: str | None = None,
        transform: str | None = None) -> dict:
    """Run the demo at ``sizes``, write ``goodput[-<mode>].{md,json,png}`` into ``out_dir`` and
    return the report (the JSON's content). ``model``/``tokenizer`` default to SmolLM2; ``layer``
    (an int or a tuple), ``pooling``, ``span`` and ``transform`` override :data:`RECIPE`'s."""
    from . import models
    from .ood import OODGate, extract_features, ood_metrics, record_tokens_saved, roc_curve
    from .ood.recipes import combine_layers

    total_start = time.perf_counter()
    if model is None:
        model, tokenizer = models.load_smollm2(torch.float32)
    queries, intents = load_clinc150(sizes, with_intents=True)
    prompts = {split: [models.chat_prompt(tokenizer, q) for q in texts] for split, texts in queries.items()}
    layers = None if layer is None else (layer if isinstance(layer, tuple) else (layer,))
    recipe = recipe_for(prompts["train"], layers, pooling, span, transform=transform)

    start = time.perf_counter()
    cache = cache_dir or _cache_dir()
    features = {split: combine_layers(extract_features(
        model, tokenizer, p, layer=list(recipe.layers), pooling=recipe.pooling, cache_dir=cache, progress=progress,
        skip_first=recipe.skip_first, skip_last=recipe.skip_last), recipe.combine) for split, p in prompts.items()}
    features_s = time.perf_counter() - start

    scorers = {}
    for name, (scorer, fit_s) in _scorers(features["train"], intents["train"], recipe.transform, sizes).items():
        threshold = scorer.threshold(features["val"], tpr=0.95)
        with torch.no_grad():
            in_scores, oos_scores = scorer.score(features["test"]), scorer.score(features["oos_test"])
        metrics = ood_metrics(in_scores, oos_scores)
        fpr, tpr, _ = roc_curve(in_scores, oos_scores)
        scorers[name] = dict(scorer=scorer, threshold=threshold, fit_s=fit_s, auroc=metrics.auroc,
                             fpr95=metrics.fpr95, aupr=metrics.aupr,
                             test_in_scope_accepted=(in_scores <= threshold).double().mean().item(),
                             test_out_of_scope_accepted=(oos_scores <= threshold).double().mean().item(),
                             roc=(fpr.tolist(), tpr.tolist()), scores={"test": in_scores, "oos_test": oos_scores})

    # the served traffic: in-scope and out-of-scope test queries (split, index), shuffled together
    served = ([("test", i) for i in range(min(sizes.served_in_scope, len(prompts["test"])))]
              + [("oos_test", i) for i in range(min(sizes.served_out_of_scope, len(prompts["oos_test"])))])
    random.Random(SEED).shuffle(served)
    served_prompts = [prompts[split][i] for split, i in served]
    in_scope = [split == "test" for split, _ in served]
    plain_engine, plain, plain_s = _serve(model, served_prompts, sizes, "no gate", progress=progress)
    plain_lengths = [len(r.output) for r in plain]
    runs = {"no gate": _serving_row(plain_engine, plain, in_scope, plain_s)}
    for name, s in scorers.items():
        gate = OODGate.from_recipe(s["scorer"], s["threshold"], recipe)
        engine, requests, seconds = _serve(model, served_prompts, sizes, f"{name} gate", gate, progress)
        mismatched = [r.id for r, p in zip(requests, plain) if not r.refused and r.output != p.output]
        row = _serving_row(engine, requests, in_scope, seconds)
        row["tokens_saved"] = record_tokens_saved(engine.stats, plain_lengths)
        row["kept_outputs_identical"] = not mismatched
        # the scores the gate gave from the engine's own forward passes, against extract_features's
        offline = torch.stack([s["scores"][split][i] for split, i in served]).double()
        online = torch.tensor([r.ood_score for r in requests], dtype=torch.float64)
        row["gate_score_max_rel_diff"] = ((online - offline).abs().max() / offline.abs().max()).item()
        gated = sum(st.gated for st in engine.stats)
        row["gate_ms_per_request"] = 1e3 * sum(st.gate_s for st in engine.stats) / gated
        row["score_ms_one_row"] = 1e3 * _score_latency(s["scorer"], features["test"][:1])
        runs[f"{name} gate"] = row

    report = {
        "mode": sizes.name, "sizes": dataclasses.asdict(sizes), "model": "SmolLM2-135M-Instruct (float32)",
        "recipe": str(recipe), "layer": list(recipe.layers), "pooling": recipe.pooling,
        "skip": [recipe.skip_first, recipe.skip_last], "transform": recipe.transform,
        "torch_threads": torch.get_num_threads(),
        "split_sizes": {k: len(v) for k, v in queries.items()},
        "features_s": features_s, "prompt_tokens_mean": statistics.mean(map(len, served_prompts)),
        "scorers": {name: {k: v for k, v in s.items() if k not in ("scorer", "roc", "scores")}
                    for name, s in scorers.items()},
        "serving": runs,
        "prefill_ms_one_prompt": 1e3 * _prefill_latency(model, served_prompts),
    }
    report["total_s"] = time.perf_counter() - total_start
    _write(report, scorers, out_dir)
    return report


def _serving_row(engine, requests, in_scope: list[bool], seconds: float) -> dict:
    tokens = [len(r.output) for r in requests]
    total = sum(tokens)
    in_tokens = sum(n for n, s in zip(tokens, in_scope) if s)
    return {
        "requests": len(requests), "tokens_generated": total, "in_scope_tokens": in_tokens,
        "out_of_scope_tokens": total - in_tokens, "goodput": in_tokens / total if total else 0.0,
        "in_scope_refused": sum(r.refused and s for r, s in zip(requests, in_scope)),
        "out_of_scope_refused": sum(r.refused and not s for r, s in zip(requests, in_scope)),
        "steps": len(engine.stats), "seconds": seconds,
    }


def _stem(mode: str) -> str:
    return "goodput" if mode == "default" else f"goodput-{mode}"


def _write(report: dict, scorers: dict, out_dir: pathlib.Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / _stem(report["mode"])
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    _plot(report, scorers, stem.with_suffix(".png"))


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def markdown(report: dict) -> str:
    """The report as Markdown: what ran, then tables of detection, tokens and latency."""
    n, sizes, serving = report["split_sizes"], report["sizes"], report["serving"]
    subsets = "All of CLINC150" if report["mode"] == "full" else "Random subsets of CLINC150 (seed 0)"
    intro = (
        f"SmolLM2-135M-Instruct (float32) on CLINC150 chat prompts; the gate's recipe: {report['recipe']} "
        f"(positions {report['skip'][0]} and {report['skip'][1]} from the end left out: the chat template). "
        f"{subsets}: fit on {n['train']} in-scope training queries, "
        f"thresholds at 95% TPR on {n['val']} in-scope validation queries, scored on {n['test']} in-scope test vs "
        f"{n['oos_test']} out-of-scope test queries. Served: {sizes['served_in_scope']} in-scope and "
        f"{sizes['served_out_of_scope']} out-of-scope test queries, shuffled, greedy, up to "
        f"{sizes['max_new_tokens']} new tokens each. Torch CPU threads: {report['torch_threads']}; whole run "
        f"{report['total_s']:.0f} s (features {report['features_s']:.0f} s; cached on disk for later runs)."
    )
    detection = _table(
        ["scorer (no out-of-scope data)", "AUROC", "FPR at 95% TPR", "AUPR", "fit s", "threshold (val)",
         "test in-scope accepted", "test out-of-scope accepted"],
        [[name, f"{s['auroc']:.4f}", f"{s['fpr95']:.4f}", f"{s['aupr']:.4f}", f"{s['fit_s']:.2f}",
          f"{s['threshold']:.4g}", f"{s['test_in_scope_accepted']:.3f}", f"{s['test_out_of_scope_accepted']:.3f}"]
         for name, s in report["scorers"].items()])
    identical = {True: "yes", False: "NO", None: "-"}
    tokens = _table(
        ["run", "tokens generated", "in-scope tokens", "out-of-scope tokens", "goodput", "tokens saved",
         "refused in / out of scope", "kept outputs = ungated", "serving s"],
        [[name, r["tokens_generated"], r["in_scope_tokens"], r["out_of_scope_tokens"], f"{r['goodput']:.1%}",
          r.get("tokens_saved", "-"), f"{r['in_scope_refused']} / {r['out_of_scope_refused']}",
          identical[r.get("kept_outputs_identical")], f"{r['seconds']:.1f}"] for name, r in serving.items()])
    prefill_ms = report["prefill_ms_one_prompt"]
    latency = _table(
        ["gate", "in the serving loop, ms per request (pooling + scoring, batched)", "score of one row, ms",
         "against one prefill", "its scores vs. extract_features's, max rel. diff"],
        [[name, f"{r['gate_ms_per_request']:.3f}", f"{r['score_ms_one_row']:.3f}",
          f"{r['gate_ms_per_request'] / prefill_ms:.2%}", f"{r['gate_score_max_rel_diff']:.1e}"]
         for name, r in serving.items() if "gate_ms_per_request" in r])
    lines = [f"# Goodput: an OOD gate in the serving loop ({report['mode']} run)", "", intro, "", *detection, "",
             *tokens, "", f"Latency: a prompt's prefill forward pass (alone, {report['prompt_tokens_mean']:.0f} "
             f"tokens on average) {prefill_ms:.1f} ms (median of 8).", "", *latency]
    return "\n".join(lines) + "\n"


def _plot(report: dict, scorers: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (roc_ax, bar_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, s in scorers.items():
        roc_ax.plot(*s["roc"], label=f"{name} (AUROC {s['auroc']:.3f})")
    roc_ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls=":")
    roc_ax.set(xlabel="in-scope flagged (FPR)", ylabel="out-of-scope flagged (TPR)",
               title=f"CLINC150, SmolLM2 hidden state {'+'.join(map(str, report['layer']))} "
                     f"({report['pooling']}, {report['transform']})")
    roc_ax.legend(loc="lower right")
    names = list(report["serving"])
    rows = [report["serving"][n] for n in names]
    inside = [r["in_scope_tokens"] for r in rows]
    outside = [r["out_of_scope_tokens"] for r in rows]
    bar_ax.bar(names, inside, label="in-scope requests", color="tab:green")
    bar_ax.bar(names, outside, bottom=inside, label="out-of-scope requests", color="tab:red")
    for i, r in enumerate(rows):
        bar_ax.annotate(f"goodput {r['goodput']:.0%}", (i, r["tokens_generated"]), ha="center", va="bottom")
    bar_ax.set(ylabel="tokens generated", title="Tokens generated by the serving loop",
               ylim=(0, 1.25 * max(r["tokens_generated"] for r in rows)))
    bar_ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def default_out_dir() -> pathlib.Path:
    """``benchmarks/results`` of a source checkout, else the working directory."""
    results = ROOT / "benchmarks" / "results"
    return results if results.is_dir() else pathlib.Path.cwd()


def main(mode: str, out_dir: pathlib.Path | None = None, layer: int | None = None, pooling: str | None = None,
         threads: int | None = None, span: str | None = None, transform: str | None = None) -> int:
    """The CLI: run, print the Markdown report, say where the files went."""
    from . import models

    if (reason := models.missing_reason()) is not None:
        print(f"goodput: {reason}", file=sys.stderr)
        return 2
    if threads is not None:
        if threads < 1:
            print(f"goodput: --threads: expected an int >= 1, got {threads}", file=sys.stderr)
            return 2
        torch.set_num_threads(threads)
    out_dir = out_dir or default_out_dir()
    from .ood.recipes import TRANSFORMS

    if transform is not None and transform not in TRANSFORMS:
        print(f"goodput: --transform: expected one of {TRANSFORMS}, got {transform!r}", file=sys.stderr)
        return 2
    report = run(SIZES[mode], out_dir, layer=layer, pooling=pooling, span=span, transform=transform)
    print(markdown(report))
    print(f"written: {out_dir / _stem(mode)}.{{md,json,png}}")
    return 0

"""Feature recipes for an OOD gate on SmolLM2-135M's own hidden states, swept on CLINC150.

    python benchmarks/ood_recipes.py [--cache DIR] [--seeds 3] [--edm-steps N] [--out DIR] [--part P]

1. Extraction, once (cached in ``--cache``, default ``/tmp/ood_recipes``): CLINC150 chat prompts
   (3,500 in-scope training rows, 1,125 in-scope and 500 out-of-scope test rows, fixed random
   subsets) through SmolLM2-135M-Instruct in float32. The chat template's shared prefix runs once
   and its keys and values are reused, so each prompt runs only its own tokens; all 31 hidden
   states come from that one forward. Per row and hidden state it keeps the sum of the question's
   states, the sum of the template suffix's states and the last state; with the prefix's states
   that gives every pooling below exactly.
2. Sweep, per seed (a random 2,500 of the training rows to fit on, the other 1,000 held out):
   poolings (``all`` positions, ``nosink`` without position 0, ``question`` without the template's
   prefix and suffix, ``tail`` question plus suffix, ``last`` token) x all 31 hidden states x
   transforms x scorers (Mahalanobis with Ledoit-Wolf: one Gaussian, or one mean per intent;
   EDM for the chosen recipes). AUROC of in-scope test against out-of-scope test rows.
3. Label-free choice, per seed: the intent-holdout criterion
   (:func:`torch_kernels.ood.recipes.intent_holdout_auroc`) on the training and held-out rows only,
   in three stages (layer and pooling; transform; averaging or concatenating the best layers).

Writes ``benchmarks/results/ood_recipes.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import random
import sys
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, machine_line, markdown_table  # noqa: E402

from torch_kernels.ood import ood_metrics  # noqa: E402
from torch_kernels.ood.recipes import combine_layers, make_scorer  # noqa: E402
from torch_kernels.ood.select import choose_recipe  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parent.parent / "torch_kernels" / "data" / "clinc150" / "data_full.json"
SIZES = {"train": 3500, "test": 1125, "oos_test": 500}
FIT, HELDOUT = 2500, 1000
POOLINGS = ("all", "nosink", "question", "tail", "last")
GRID_TRANSFORMS = ("none", "standardize", "clip", "l2", "robust_l2")
SELECT_TRANSFORMS = ("none", "standardize", "robust", "clip", "l2", "robust_l2", "clip_l2")
GRID_SCORERS = ("mahalanobis", "mahalanobis_intents")


# ---------------------------------------------------------------------------------- extraction


def extract(cache: pathlib.Path) -> None:
    """Run SmolLM2 once over the rows and store the per-row sums (see the module docstring)."""
    from torch_kernels import models
    from torch_kernels.ood.recipes import shared_span

    cache.mkdir(parents=True, exist_ok=True)
    model, tokenizer = models.load_smollm2(torch.float32)
    data = json.loads(DATA.read_text())
    rng = random.Random(27)
    rows = [(split, text, label) for split, n in SIZES.items() for text, label in rng.sample(data[split], n)]
    (cache / "rows.json").write_text(json.dumps({"rows": rows}))
    prompts = [models.chat_prompt(tokenizer, text) for _, text, _ in rows]
    prefix, suffix = shared_span(prompts)
    num_states, hidden = model.config.num_hidden_layers + 1, model.config.hidden_size
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([prompts[0][:prefix]]), use_cache=True, output_hidden_states=True)
    np.save(cache / "prefix_states.npy", torch.stack(out.hidden_states)[:, 0].numpy())  # [L, prefix, H]
    sums = {name: np.zeros((len(rows), num_states, hidden), np.float32) for name in ("question", "suffix", "last")}
    order = sorted(range(len(rows)), key=lambda i: len(prompts[i]))
    start = time.perf_counter()
    with torch.no_grad():
        for first in range(0, len(order), 32):
            batch = order[first:first + 32]
            tails = [prompts[i][prefix:] for i in batch]
            lengths = torch.tensor([len(t) for t in tails])
            width = int(lengths.max())
            ids = torch.tensor([t + [0] * (width - len(t)) for t in tails])
            mask = torch.cat([torch.ones(len(batch), prefix, dtype=torch.long),
                              (torch.arange(width)[None] < lengths[:, None]).long()], dim=1)
            past = copy.deepcopy(out.past_key_values)
            past.batch_repeat_interleave(len(batch))
            states = torch.stack(model.model(input_ids=ids, attention_mask=mask, past_key_values=past, use_cache=True,
                                             output_hidden_states=True).hidden_states, dim=1)  # [B, L, w, H]
            for k, i in enumerate(batch):
                n = int(lengths[k])
                sums["question"][i] = states[k, :, :n - suffix].sum(1).numpy()
                sums["suffix"][i] = states[k, :, n - suffix:n].sum(1).numpy()
                sums["last"][i] = states[k, :, n - 1].numpy()
            print(f"extract: {first + len(batch)}/{len(rows)} rows, {time.perf_counter() - start:.0f} s", flush=True)
    for name, array in sums.items():
        np.save(cache / f"{name}_sum.npy" if name != "last" else cache / "last.npy", array)
    np.save(cache / "lengths.npy", np.array([len(p) for p in prompts]))
    (cache / "meta.json").write_text(json.dumps({"prefix": prefix, "suffix": suffix,
                                                 "extract_s": time.perf_counter() - start}))


class Features:
    """The cached sums, pooled on demand: ``pool(pooling, layer) -> [N, H]`` float32."""

    def __init__(self, cache: pathlib.Path):
        meta = json.loads((cache / "meta.json").read_text())
        self.prefix, self.suffix = meta["prefix"], meta["suffix"]
        self.prefix_states = torch.from_numpy(np.load(cache / "prefix_states.npy")).double()
        self.question = torch.from_numpy(np.load(cache / "content_sum.npy" if (cache / "content_sum.npy").exists()
                                                 else cache / "question_sum.npy"))
        self.suffix_sum = torch.from_numpy(np.load(cache / "suffix_sum.npy"))
        self.last = torch.from_numpy(np.load(cache / "last.npy"))
        self.lengths = torch.from_numpy(np.load(cache / "lengths.npy")).double()
        rows = json.loads((cache / "rows.json").read_text())["rows"]
        self.split = np.array([r[0] for r in rows])
        intents = sorted({r[2] for r in rows if r[0] == "train"})
        index = {name: i for i, name in enumerate(intents)}
        self.labels = torch.tensor([index.get(r[2], -1) for r in rows])
        self.num_states = self.question.shape[1]

    def pool(self, pooling: str, layer: int) -> torch.Tensor:
        q, s = self.question[:, layer].double(), self.suffix_sum[:, layer].double()
        n_question = (self.lengths - self.prefix - self.suffix)[:, None]
        prefix = self.prefix_states[layer]
        if pooling == "all":
            out = (prefix.sum(0) + q + s) / self.lengths[:, None]
        elif pooling == "nosink":
            out = (prefix[1:].sum(0) + q + s) / (self.lengths[:, None] - 1)
        elif pooling == "question":
            out = q / n_question
        elif pooling == "tail":
            out = (q + s) / (n_question + self.suffix)
        elif pooling == "last":
            out = self.last[:, layer].double()
        else:
            raise ValueError(f"pooling: expected one of {POOLINGS}, got {pooling!r}")
        return out.float()

    def recipe(self, pooling: str, layers: tuple[int, ...], combine: str = "mean") -> torch.Tensor:
        return combine_layers(torch.stack([self.pool(pooling, i) for i in layers], dim=1), combine)


# ---------------------------------------------------------------------------------- sweep


def split_indices(f: Features, seed: int):
    """(fit rows, held-out rows, in-scope test rows, out-of-scope test rows) for one seed."""
    train = np.flatnonzero(f.split == "train")
    perm = np.random.default_rng(seed).permutation(train)
    return perm[:FIT], perm[FIT:FIT + HELDOUT], np.flatnonzero(f.split == "test"), np.flatnonzero(f.split == "oos_test")


def auroc(x: torch.Tensor, f: Features, idx, scorer: str, transform: str, edm_steps=None, seed=0) -> float:
    fit_rows, _, test, oos = idx
    model, fit = make_scorer(scorer, transform, edm_steps, seed)
    try:
        fit(x[fit_rows], f.labels[fit_rows])
    except ValueError as error:  # constant features (the last token at the embeddings): nothing to fit
        if "singular" not in str(error):
            raise
        return float("nan")
    with torch.no_grad():
        return ood_metrics(model.score(x[test]), model.score(x[oos])).auroc


def choose(f: Features, idx, seed: int, folds: int, log) -> dict:
    """The three-stage label-free choice (torch_kernels.ood.select.choose_recipe) on the seed's
    fit and held-out rows; each stage's criterion values."""
    fit_rows, heldout, _, _ = idx
    start = time.perf_counter()
    pick = choose_recipe(lambda pooling, layers, combine: f.recipe(pooling, layers, combine), POOLINGS,
                         list(range(f.num_states)), torch.from_numpy(fit_rows), torch.from_numpy(heldout), f.labels,
                         SELECT_TRANSFORMS, folds=folds, seed=seed)
    log(f"seed {seed}: {pick['key']} layers {pick['layers']} {pick['combine']} {pick['transform']} "
        f"({pick['criterion']:.4f}), {time.perf_counter() - start:.0f} s")
    return {"pooling": pick["key"], "layers": list(pick["layers"]), "combine": pick["combine"],
            "transform": pick["transform"], "criterion": pick["criterion"], "select_s": time.perf_counter() - start,
            "stage1": {f"{p}/{l}": v for (p, l), v in pick["stage1"].items()}, "stage2": pick["stage2"],
            "stage3": {f"{'+'.join(map(str, ls))}/{c}": v for (ls, c), v in pick["stage3"].items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=pathlib.Path, default=pathlib.Path("/tmp/ood_recipes"))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--folds", type=int, default=3, help="intent groups of the selection criterion")
    parser.add_argument("--edm-steps", type=int, default=1000)
    parser.add_argument("--grid-seeds", type=int, default=1, help="seeds of the full layer x recipe x scorer grid")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--part", choices=("all", "grid", "choose", "report"), default="all",
                        help="run the grid and the choice as separate processes, then the report")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (args.cache / "meta.json").exists():
        extract(args.cache)
    f = Features(args.cache)
    log = lambda m: print(m, flush=True)  # noqa: E731
    seeds = list(range(args.seeds))
    idx = {s: split_indices(f, s) for s in seeds}
    if args.part in ("grid", "all"):
        start = time.perf_counter()
        _save(args.cache / "grid.json", {"grid": grid_sweep(f, idx, seeds[:args.grid_seeds], log),
                                         "grid_s": time.perf_counter() - start})
    if args.part in ("choose", "all"):
        start = time.perf_counter()
        chosen = [choose_and_score(f, idx[seed], seed, args, log) for seed in seeds]
        _save(args.cache / "chosen.json", {"chosen": chosen, "choose_s": time.perf_counter() - start})
    if args.part not in ("report", "all"):
        return 0
    grid, chosen = json.loads((args.cache / "grid.json").read_text()), json.loads((args.cache / "chosen.json").read_text())
    start = time.perf_counter()
    # the best fixed recipes of the grid on every seed (3-seed means)
    fixed = {}
    for name, pooling, layers, combine, transform in fixed_recipes(grid["grid"], f.num_states - 1):
        x = f.recipe(pooling, layers, combine)
        fixed[name] = {s: [auroc(x, f, idx[seed], s, transform) for seed in seeds] for s in GRID_SCORERS}
        log(f"fixed {name}: {fixed[name]}")
    report = {"machine": machine_line(), "seeds": seeds, "sizes": SIZES, "fit": FIT, "heldout": HELDOUT,
              "folds": args.folds, "edm_steps": args.edm_steps, "prefix": f.prefix, "suffix": f.suffix,
              "grid": grid["grid"], "chosen": chosen["chosen"], "fixed": fixed, "costs": costs(f, idx[0]),
              "sweep_s": grid["grid_s"] + chosen["choose_s"] + time.perf_counter() - start,
              "extract_s": json.loads((args.cache / "meta.json").read_text()).get("extract_s")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ood_recipes.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "ood_recipes.md").write_text(markdown(report))
    plot(report, args.out / "ood_recipes.png")
    print(markdown(report))
    return 0


@torch.inference_mode()
def costs(f: Features, idx) -> dict:
    """Microseconds to transform and score one pooled row (the gate's work after pooling), per
    transform on one layer and for three layers averaged or concatenated (clip); best of 50."""
    fit_rows = idx[0]
    mid = f.num_states // 2
    three = tuple(sorted({max(0, mid - 5), mid, min(f.num_states - 1, mid + 5)}))
    cases = [(t, (mid,), "mean") for t in GRID_TRANSFORMS] + [("clip", three, c) for c in ("mean", "concat")]
    out = {}
    for transform, layers, combine in cases:
        x = f.recipe("question", layers, combine)
        model, fit = make_scorer("mahalanobis", transform)
        fit(x[fit_rows])
        row = x[:1]
        best = float("inf")
        for _ in range(50):
            t0 = time.perf_counter()
            model.score(row)
            best = min(best, time.perf_counter() - t0)
        out[f"{transform}, {len(layers)} layer(s) {combine}, D={x.shape[1]}"] = 1e6 * best
    return out


def _save(path: pathlib.Path, content: dict) -> None:
    path.write_text(json.dumps(content))


def grid_sweep(f: Features, idx, seeds, log) -> list[dict]:
    """Every hidden state x pooling x transform x scorer (EDM left out: minutes per fit)."""
    start, grid = time.perf_counter(), []
    for seed in seeds:
        for pooling in POOLINGS:
            for layer in range(f.num_states):
                x = f.pool(pooling, layer)
                for transform in GRID_TRANSFORMS:
                    for scorer in GRID_SCORERS:
                        grid.append({"seed": seed, "pooling": pooling, "layer": layer, "transform": transform,
                                     "scorer": scorer, "auroc": auroc(x, f, idx[seed], scorer, transform)})
            log(f"grid seed {seed} {pooling}: {time.perf_counter() - start:.0f} s")
    return grid


def choose_and_score(f: Features, idx, seed: int, args, log) -> dict:
    """The label-free choice for one seed, then its AUROC with each scorer (EDM included)."""
    pick = choose(f, idx, seed, args.folds, log)
    x = f.recipe(pick["pooling"], tuple(pick["layers"]), pick["combine"])
    pick["auroc"] = {s: auroc(x, f, idx, s, pick["transform"]) for s in GRID_SCORERS}
    start = time.perf_counter()
    pick["auroc"]["edm"] = auroc(x, f, idx, "edm", pick["transform"], args.edm_steps, seed)
    pick["edm_fit_s"] = time.perf_counter() - start
    log(f"seed {seed} chosen AUROC {pick['auroc']}")
    return pick


def fixed_recipes(grid, last_layer: int):
    """The issue's baseline (mean of all positions, last hidden state) and the grid's best recipe
    per pooling (seed 0, one Gaussian: chosen with the test rows, an oracle to compare with)."""
    out = [(f"baseline: all positions, layer {last_layer}, none", "all", (last_layer,), "mean", "none")]
    for pooling in POOLINGS:
        rows = [r for r in grid if r["pooling"] == pooling and r["scorer"] == "mahalanobis" and r["seed"] == 0
                and r["auroc"] == r["auroc"]]  # not NaN: constant features, nothing fitted
        if rows:
            best = max(rows, key=lambda r: r["auroc"])
            out.append((f"grid best (oracle) {pooling}: layer {best['layer']}, {best['transform']}", pooling,
                        (best["layer"],), "mean", best["transform"]))
    return out


def markdown(report: dict) -> str:
    grid = report["grid"]
    lines = [
        "# OOD feature recipes on SmolLM2-135M's own hidden states (CLINC150)", "",
        f"{report['machine']}. SmolLM2-135M-Instruct (float32), CLINC150 chat prompts: {report['fit']} in-scope "
        f"training rows to fit on and {report['heldout']} held out (a random split of 3,500 per seed), "
        f"{report['sizes']['test']} in-scope and {report['sizes']['oos_test']} out-of-scope test rows. "
        f"Template: {report['prefix']} shared prefix tokens, {report['suffix']} suffix tokens. "
        f"Scorers: `mahalanobis` (Ledoit-Wolf, one Gaussian: no labels at all), `mahalanobis_intents` (one mean "
        f"per in-scope intent, tied covariance: uses the training rows' intent labels), `edm`. Out-of-scope rows "
        f"are used for the AUROC only, never to choose. Extraction {report['extract_s'] or 0:.0f} s (one forward per "
        f"batch, all hidden states, on a machine shared with other jobs), sweep {report['sweep_s']:.0f} s. "
        f"NaN: constant features (the last token is the same template token in every prompt, so at the "
        f"embeddings it is one vector), which no Gaussian fits.", "",
        "Poolings: `all` = mean over every position; `nosink` = without position 0; `question` = the user's "
        "text only (template prefix and suffix skipped); `tail` = question and template suffix; `last` = the "
        "last token. Transforms (fitted on in-scope training rows): `standardize` per channel, `clip` = robust "
        "(median/IQR) z-scores clamped to +-4, `l2` = row L2 normalization, `robust_l2` = robust z then L2.", "",
        "## The label-free choice per seed (criterion: intent-holdout AUROC on training/held-out rows only)", ""]
    rows = []
    for seed, pick in zip(report["seeds"], report["chosen"]):
        rows.append([seed, pick["pooling"], "+".join(map(str, pick["layers"])), pick["combine"], pick["transform"],
                     f"{pick['criterion']:.4f}", *(f"{pick['auroc'].get(s, float('nan')):.4f}"
                                                   for s in (*GRID_SCORERS, "edm")), f"{pick['select_s']:.0f}"])
    lines += _table(["seed", "pooling", "layers", "combine", "transform", "criterion",
                             "AUROC mahalanobis", "AUROC mahalanobis_intents", "AUROC edm", "select s"], rows)
    means = {s: np.mean([p["auroc"][s] for p in report["chosen"] if s in p["auroc"]]) for s in (*GRID_SCORERS, "edm")}
    lines += ["", "Mean over seeds of the chosen recipes: " + ", ".join(f"{s} {v:.4f}" for s, v in means.items()), ""]
    lines += ["## Fixed recipes on every seed (mean +- std over seeds)", ""]
    lines += _table(["recipe", *GRID_SCORERS], [
        [name, *(f"{np.mean(v[s]):.4f} +- {np.std(v[s]):.4f}" for s in GRID_SCORERS)]
        for name, v in report["fixed"].items()])
    lines += ["", "## Cost: transform and score one pooled row (Mahalanobis, best of 50), microseconds", "",
              "Pooling itself is a masked sum over the positions the prefill already computed (the span only "
              "changes which rows are summed); several layers add one such sum per layer.", ""]
    lines += _table(["recipe", "us per row"], [[k, f"{v:.0f}"] for k, v in report["costs"].items()])
    for scorer in GRID_SCORERS:
        seed0 = [r for r in grid if r["scorer"] == scorer and r["seed"] == 0]
        if not seed0:
            continue
        lines += ["", f"## AUROC per hidden state x recipe, `{scorer}` (seed 0)", ""]
        columns = [(p, t) for p in POOLINGS for t in GRID_TRANSFORMS]
        table = {(r["pooling"], r["transform"], r["layer"]): r["auroc"] for r in seed0}
        layers = sorted({r["layer"] for r in seed0})
        lines += _table(["layer", *(f"{p} {t}" for p, t in columns)],
                                [[layer, *(f"{table[(p, t, layer)]:.3f}" for p, t in columns)] for layer in layers])
    return "\n".join(lines) + "\n"


def _table(header, rows) -> list[str]:
    return markdown_table(header, rows).splitlines()


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, scorer in zip(axes, GRID_SCORERS):
        for pooling, color in zip(POOLINGS, ("tab:grey", "tab:blue", "tab:green", "tab:orange", "tab:red")):
            for transform, style in (("none", ":"), ("robust_l2", "-")):
                rows = sorted((r for r in report["grid"] if r["scorer"] == scorer and r["seed"] == 0
                               and r["pooling"] == pooling and r["transform"] == transform), key=lambda r: r["layer"])
                if rows:
                    ax.plot([r["layer"] for r in rows], [r["auroc"] for r in rows], style, color=color,
                            label=f"{pooling}, {transform}")
        ax.axhline(0.949, color="black", lw=0.8, ls="--", label="all-MiniLM-L6-v2 (0.949)")
        ax.set(xlabel="hidden state", title=f"CLINC150 AUROC, {scorer} (seed 0)")
    axes[0].set_ylabel("AUROC")
    axes[1].legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

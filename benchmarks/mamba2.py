"""Mamba-2 SSD against transformers' torch fallback: the chunked scan forward, forward+backward, and the decode step.

    python benchmarks/mamba2.py [--quick | --gpu] [--device cpu|cuda] [--budget S] [--out DIR]

At Mamba-2 2.7B's sizes (80 heads of 64 channels, one group of dstate 128; the CPU runs 8 of
those heads). Timed in one run on the same inputs, as the models call them (dt before dt_bias
and softplus, ``A = -exp(A_log)``, a skip D per head): ``mamba_chunk_scan_combined`` (the
backend a user gets there: triton on CUDA, the reference on CPU) and what transformers runs
without mamba_ssm, ``modeling_mamba2.mamba2_chunk_scan`` (a segment-sum scan in chunks of 256);
forward, and forward+backward with x, dt, A, B, C, D and dt_bias requiring grad. Decode: one
``selective_state_update`` step against ``modeling_mamba2.mamba2_selective_state_update``, both
given dt, A, D and dt_bias as the expanded views the models pass, over batches of sequences.
Speeds are ratios over the fallback (> 1: ours is faster); each row carries its accuracy, the
largest error of the output relative to its largest value, against the fallback run in float32.
Writes ``mamba2{-quick,-gpu,}.{md,json,png}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import (cuda_missing, family_parser, family_run, machine_line, markdown_table,  # noqa: E402
                    seconds_per_call, worst_speedup_goal, write_results)

import torch_kernels  # noqa: E402

K = 1024
HEADDIM, DSTATE, GROUPS, CHUNK = 64, 128, 1, 256
# transformers' functions call mamba_ssm where it is installed: the rows then say so
THEIRS = "torch fallback" if importlib.util.find_spec("mamba_ssm") is None else "transformers (mamba_ssm)"

BENCHMARK = {  # for the scripts that run or summarize every family (common.family_benchmarks)
    "gpu_step": {"position": 70, "cap_s": 90, "autotuned": True},  # the scan's kernels: chunk_simple_gla's
    "summary_position": 60,
    "summary_goals": [["mamba_chunk_scan_combined vs torch fallback",
                       "forward+backward faster than the segment-sum scan at T >= 4k"],
                      ["selective_state_update vs torch fallback", "decode step faster than the fallback at every batch"]],
    "quick_compile_group": "mamba2",
    "bench": True,
}


def sizes(cuda: bool, quick: bool, gpu: bool):
    """(heads, prefill (batch, T) pairs, decode batches)."""
    if cuda:
        return (80, [(1, 4 * K), (4, 4 * K), (1, 16 * K)], (1, 8, 64, 256)) if not quick else (80, [(1, 4 * K)], (8,))
    if gpu:  # the GPU preset's dry run on the CPU: tiny
        return 2, [(1, 256)], (2,)
    return (8, [(1, 512)], (8,)) if quick else (8, [(1, 512), (1, 2 * K)], (1, 16))


def _transformers():
    from transformers.models.mamba2 import modeling_mamba2

    return modeling_mamba2


def scan_inputs(heads: int, batch: int, length: int, device, dtype) -> dict:
    """A 2.7B layer's scan inputs: x, dt, B and C in the model's dtype, A, D and dt_bias float32."""
    gen = torch.Generator().manual_seed(length + heads)
    return dict(x=torch.randn(batch, length, heads, HEADDIM, generator=gen).to(device, dtype),
                dt=(torch.randn(batch, length, heads, generator=gen) - 2.0).to(device, dtype),
                A=-torch.exp(torch.rand(heads, generator=gen) * 2.7).to(device),
                B=torch.randn(batch, length, GROUPS, DSTATE, generator=gen).to(device, dtype),
                C=torch.randn(batch, length, GROUPS, DSTATE, generator=gen).to(device, dtype),
                D=torch.randn(heads, generator=gen).to(device), dt_bias=torch.randn(heads, generator=gen).to(device))


def ours_scan(x, dt, A, B, C, D, dt_bias):
    return torch_kernels.mamba_chunk_scan_combined(x, dt, A, B, C, CHUNK, D, dt_bias=dt_bias, dt_softplus=True)


def their_scan(x, dt, A, B, C, D, dt_bias):
    return _transformers().mamba2_chunk_scan(x, dt, A, B, C, CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True)


def update_inputs(heads: int, batch: int, device, dtype) -> dict:
    """One decode step of a 2.7B layer: dt, A, D and dt_bias expanded from per-head values; a float32 state."""
    gen = torch.Generator().manual_seed(batch + heads)
    return dict(state=torch.randn(batch, heads, HEADDIM, DSTATE, generator=gen).to(device),
                x=torch.randn(batch, heads, HEADDIM, generator=gen).to(device, dtype),
                dt=(torch.randn(batch, heads, 1, generator=gen) - 2.0).to(device, dtype).expand(-1, -1, HEADDIM),
                A=(-torch.exp(torch.rand(heads, 1, 1, generator=gen) * 2.7)).to(device).expand(-1, HEADDIM, DSTATE),
                B=torch.randn(batch, GROUPS, DSTATE, generator=gen).to(device, dtype),
                C=torch.randn(batch, GROUPS, DSTATE, generator=gen).to(device, dtype),
                D=torch.randn(heads, 1, generator=gen).to(device).expand(-1, HEADDIM),
                dt_bias=torch.randn(heads, 1, generator=gen).to(device).expand(-1, HEADDIM))


def ours_update(state, x, dt, A, B, C, D, dt_bias):
    return torch_kernels.selective_state_update(state, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=True)


def their_update(state, x, dt, A, B, C, D, dt_bias):
    return _transformers().mamba2_selective_state_update(state, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=True)


def error_over(out, truth) -> float:
    """max |out - truth| / max |truth|."""
    return ((out.double() - truth.double()).abs().max() / truth.double().abs().max()).item()


def _wide(kw: dict) -> dict:
    return {n: t.float() for n, t in kw.items()}


def measure_scan(heads: int, batch: int, length: int, device, dtype, budget: float) -> list[dict]:
    kw = scan_inputs(heads, batch, length, device, dtype)
    with torch.no_grad():
        truth = their_scan(**_wide(kw))
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    rows = []
    for path, fn in (("ours", ours_scan), (THEIRS, their_scan)):
        with torch.no_grad():
            out = fn(**kw)
            forward_s = seconds_per_call(lambda: fn(**kw), budget, sync)
        leaves = {n: t.detach().clone().requires_grad_() for n, t in kw.items()}
        grad = torch.randn_like(out)
        fwd_bwd_s = seconds_per_call(lambda: fn(**leaves).backward(grad), budget, sync)
        rows.append({"kind": "scan", "heads": heads, "batch": batch, "length": length, "path": path,
                     "forward_s": forward_s, "fwd_bwd_s": fwd_bwd_s, "error": error_over(out, truth)})
    return rows


def measure_update(heads: int, batch: int, device, dtype, budget: float) -> list[dict]:
    kw = update_inputs(heads, batch, device, dtype)
    with torch.no_grad():
        truth = their_update(**{**_wide(kw), "state": kw["state"].clone()})
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    moved = 2 * kw["state"].numel() * kw["state"].element_size()  # the state read and written: the rest is small
    rows = []
    with torch.no_grad():
        for path, fn in (("ours", ours_update), (THEIRS, their_update)):
            out = fn(**{**kw, "state": kw["state"].clone()})
            work = {**kw, "state": kw["state"].clone()}  # each timed step decays it again: the values stay finite
            step_s = seconds_per_call(lambda: fn(**work), budget, sync)
            rows.append({"kind": "decode", "heads": heads, "batch": batch, "path": path, "step_s": step_s,
                         "GBps": moved / step_s / 1e9, "error": error_over(out, truth)})
    return rows


def _theirs(rows, row, key):
    return next(r[key] for r in rows if r["path"] != "ours" and r["kind"] == row["kind"]
                and r["batch"] == row["batch"] and r.get("length") == row.get("length"))


def tables(rows: list[dict]) -> str:
    scan = [[r["heads"], r["batch"], r["length"], r["path"], f"{r['forward_s'] * 1e3:.2f}",
             f"{_theirs(rows, r, 'forward_s') / r['forward_s']:.2f}x", f"{r['fwd_bwd_s'] * 1e3:.2f}",
             f"{_theirs(rows, r, 'fwd_bwd_s') / r['fwd_bwd_s']:.2f}x", f"{r['error']:.1e}"]
            for r in rows if r["kind"] == "scan"]
    decode = [[r["heads"], r["batch"], r["path"], f"{r['step_s'] * 1e6:.1f}", f"{r['GBps']:.1f}",
               f"{_theirs(rows, r, 'step_s') / r['step_s']:.2f}x", f"{r['error']:.1e}"]
              for r in rows if r["kind"] == "decode"]
    return ("## Chunked scan (mamba_chunk_scan_combined)\n\n" + markdown_table(
        ["heads", "B", "T", "path", "forward ms", "vs fallback", "fwd+bwd ms", "vs fallback", "max rel error"], scan)
        + "\n\n## Decode step (selective_state_update)\n\n" + markdown_table(
        ["heads", "batch", "path", "step us", "state GB/s", "vs fallback", "max rel error"], decode))


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    scans = [r for r in rows if r["path"] == "ours" and r["kind"] == "scan"]
    labels = [f"B{r['batch']} T{r['length']}" for r in scans]
    for key, style, name in (("forward_s", "o-", "forward"), ("fwd_bwd_s", "s--", "fwd+bwd")):
        left.plot(labels, [_theirs(rows, r, key) / r[key] for r in scans], style, label=name)
    steps = [r for r in rows if r["path"] == "ours" and r["kind"] == "decode"]
    right.plot([r["batch"] for r in steps], [_theirs(rows, r, "step_s") / r["step_s"] for r in steps], "o-",
               label="decode step")
    for ax, title in ((left, "chunked scan"), (right, "decode step")):
        ax.axhline(1.0, color="0.6", lw=0.8)
        ax.set_title(f"Mamba-2 2.7B layer sizes, {rows[0]['heads']} heads: {title}")
        ax.set_ylabel(f"speed over the {THEIRS}")
        ax.legend(fontsize=8)
    right.set_xscale("log", base=2)
    right.set_xlabel("batch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def gpu_goals(data: dict) -> list:
    """BENCHMARK's summary goals from ``mamba2-gpu.json``: ours over the fallback in
    forward+backward time at T >= 4k, and in decode-step time at every batch."""
    rows = data["rows"]
    ours = [r for r in rows if r["path"] == "ours"]
    measured = (
        ([(_theirs(rows, r, "fwd_bwd_s") / r["fwd_bwd_s"], f"B{r['batch']} T{r['length']}")
          for r in ours if r["kind"] == "scan" and r["length"] >= 4 * K], "no scan at T >= 4k in this run"),
        ([(_theirs(rows, r, "step_s") / r["step_s"], f"batch {r['batch']}") for r in ours if r["kind"] == "decode"],
         "no decode step in this run"))
    return [worst_speedup_goal(speedups, empty) for speedups, empty in measured]


def main(argv=None) -> int:
    parser = family_parser(__doc__.splitlines()[0], quick="one small size (a smoke test)",
                           gpu="benchmarks/gpu.sh's sizes (with --device cpu: tiny, its dry run); writes -gpu files")
    args = parser.parse_args(argv)
    if cuda_missing(args.device):
        return 2
    device, on_gpu, dtype, budget = family_run(args)
    heads, prefills, batches = sizes(on_gpu, args.quick, args.gpu)
    rows = [row for batch, length in prefills for row in measure_scan(heads, batch, length, device, dtype, budget)]
    rows += [row for batch in batches for row in measure_update(heads, batch, device, dtype, budget)]
    text = (f"# Mamba-2 SSD\n\n{machine_line()}; {args.device}, {dtype}; {heads} heads of {HEADDIM}, {GROUPS} group "
            f"of dstate {DSTATE}; ours: {'triton' if on_gpu else 'reference'} backend. Ratios over transformers' "
            f"{THEIRS} (> 1: ours faster); errors against it in float32.\n\n" + tables(rows) + "\n")
    print(text)
    stem = f"mamba2{'-gpu' if args.gpu else '-quick' if args.quick else ''}"
    data = {"machine": machine_line(), "device": args.device, "dtype": str(dtype), "rows": rows}
    write_results(args.out, stem, text, data, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Causal depthwise conv1d against the models' torch fallback: prefill forward, forward+backward, decode.

    python benchmarks/causal_conv1d.py [--quick | --gpu] [--device cpu|cuda] [--budget S] [--out DIR]

At the channel counts of real models, width 4: Mamba-2 2.7B's convolved xBC (5120 + 2 * 128 =
5376 channels) and Qwen3-Next-80B's Gated DeltaNet q, k, v (2 * 16 * 128 + 32 * 128 = 8192).
Timed in one run on the same inputs (x channel-last, a transposed ``[B, T, D]`` projection, as the
models pass it): ``causal_conv1d_fn`` with SiLU (the backend a user gets
there: triton on CUDA, the reference on CPU) and what transformers runs without the
causal-conv1d package, ``F.conv1d(x, weight[:, None], bias, padding=W - 1, groups=D)[..., :T]``
then SiLU; forward, and forward+backward with x, weight and bias requiring grad. Decode: one step
of ``causal_conv1d_update`` against the fallback's ``cat`` + ``conv1d`` + ``conv_state.copy_``
over batches of sequences. Speeds are ratios over the fallback (> 1: ours is faster) and GB/s of
the bytes each call must move; each row carries its accuracy, the largest error of the output
relative to its largest value, against the fallback in float32. Writes
``causal_conv1d{-quick,-gpu,}.{md,json,png}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import (cuda_missing, family_parser, family_run, machine_line, markdown_table,  # noqa: E402
                    seconds_per_call, worst_speedup_goal, write_results)

import torch_kernels  # noqa: E402

K = 1024
WIDTH = 4
MODELS = {"Mamba-2 2.7B xBC": 5120 + 2 * 128, "Qwen3-Next q,k,v": 2 * 16 * 128 + 32 * 128}

BENCHMARK = {  # for the scripts that run or summarize every family (common.family_benchmarks)
    "gpu_step": {"position": 60, "cap_s": 60, "autotuned": True},  # no search here: the pass runs it once more
    "summary_position": 50,
    "summary_goals": [["causal_conv1d vs torch fallback", "forward+backward faster than F.conv1d + SiLU at T >= 4k"],
                      ["causal_conv1d_update vs torch fallback", "decode step faster than the fallback at every batch"]],
    "quick_compile_group": "causal_conv1d",
    "bench": True,
}


def sizes(cuda: bool, quick: bool, gpu: bool):
    """(prefill (batch, T) pairs, decode batches)."""
    if cuda:
        return ([(1, 4 * K), (4, 4 * K), (1, 16 * K)], (1, 8, 64, 256)) if not quick else ([(1, 4 * K)], (8,))
    if gpu:  # the GPU preset's dry run on the CPU: tiny
        return [(1, 256)], (4,)
    return ([(1, 512)], (8,)) if quick else ([(1, 512), (1, 2 * K)], (1, 16))


def fallback_fn(x, weight, bias):
    """transformers' torch path (modeling_mamba2 / modeling_qwen3_next ``causal_conv1d_fn``)."""
    length = x.shape[-1]
    out = F.conv1d(x.to(weight.dtype), weight[:, None], bias, padding=weight.shape[1] - 1, groups=x.shape[1])
    return F.silu(out[..., :length]).to(x.dtype)


def fallback_update(x, conv_state, weight, bias):
    """transformers' torch path of ``causal_conv1d_update`` (one step: x ``[B, D, 1]``)."""
    state_len = conv_state.shape[-1]
    joined = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    conv_state.copy_(joined[..., -state_len:])
    out = F.conv1d(joined, weight[:, None], bias, groups=x.shape[1])[..., -x.shape[-1]:]
    return F.silu(out).to(x.dtype)


def ours_fn(x, weight, bias):
    return torch_kernels.causal_conv1d_fn(x, weight, bias, activation="silu")


def ours_update(x, conv_state, weight, bias):
    return torch_kernels.causal_conv1d_update(x, conv_state, weight, bias, "silu")


def relative_error(out, truth) -> float:
    return ((out.double() - truth.double()).abs().max() / truth.double().abs().max()).item()


def measure_prefill(model: str, dim: int, batch: int, length: int, device, dtype, budget: float) -> list[dict]:
    gen = torch.Generator().manual_seed(length + dim)
    # as the models pass it: their [B, T, D] projection transposed (channel-last), not a copy
    x = torch.randn(batch, length, dim, generator=gen).to(device, dtype).transpose(1, 2)
    weight = (torch.randn(dim, WIDTH, generator=gen) * WIDTH ** -0.5).to(device, dtype)
    bias = torch.randn(dim, generator=gen).to(device, dtype)
    truth = fallback_fn(x.float(), weight.float(), bias.float())
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    moved = 2 * x.numel() * x.element_size()  # x read, out written (the filter is a few KB)
    rows = []
    for name, fn in (("ours", ours_fn), ("torch fallback", fallback_fn)):
        with torch.no_grad():
            out = fn(x, weight, bias)
            forward_s = seconds_per_call(lambda: fn(x, weight, bias), budget, sync)
        leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]  # clone keeps x's layout
        grad = torch.randn_like(out)
        backward_s = seconds_per_call(lambda: fn(*leaves).backward(grad), budget, sync)
        rows.append({"kind": "prefill", "model": model, "dim": dim, "batch": batch, "length": length, "path": name,
                     "forward_s": forward_s, "fwd_bwd_s": backward_s, "forward_GBps": moved / forward_s / 1e9,
                     "error": relative_error(out, truth)})
    return rows


def measure_decode(model: str, dim: int, batch: int, device, dtype, budget: float) -> list[dict]:
    gen = torch.Generator().manual_seed(batch + dim)
    x = torch.randn(batch, dim, 1, generator=gen).to(device, dtype)
    state = torch.randn(batch, dim, WIDTH - 1, generator=gen).to(device, dtype)
    weight = (torch.randn(dim, WIDTH, generator=gen) * WIDTH ** -0.5).to(device, dtype)
    bias = torch.randn(dim, generator=gen).to(device, dtype)
    truth = fallback_update(x.float(), state.float().clone(), weight.float(), bias.float())
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    moved = (2 * x.numel() + 2 * state.numel()) * x.element_size()  # x, out; the state read and rewritten
    rows = []
    with torch.no_grad():
        for name, fn in (("ours", ours_update), ("torch fallback", fallback_update)):
            out = fn(x, state.clone(), weight, bias)
            work = state.clone()  # each timed step shifts it again: the values stay finite
            step_s = seconds_per_call(lambda: fn(x, work, weight, bias), budget, sync)
            rows.append({"kind": "decode", "model": model, "dim": dim, "batch": batch, "path": name,
                         "step_s": step_s, "GBps": moved / step_s / 1e9, "error": relative_error(out, truth)})
    return rows


def _fallback_of(rows, row, key):
    for r in rows:
        if r["path"] == "torch fallback" and all(r.get(k) == row.get(k) for k in ("kind", "model", "batch", "length")):
            return r[key]
    raise KeyError(row)


def tables(rows: list[dict]) -> str:
    prefill = [[r["model"], r["batch"], r["length"], r["path"], f"{r['forward_s'] * 1e3:.3f}",
                f"{r['forward_GBps']:.1f}", f"{_fallback_of(rows, r, 'forward_s') / r['forward_s']:.2f}x",
                f"{r['fwd_bwd_s'] * 1e3:.3f}", f"{_fallback_of(rows, r, 'fwd_bwd_s') / r['fwd_bwd_s']:.2f}x",
                f"{r['error']:.1e}"] for r in rows if r["kind"] == "prefill"]
    decode = [[r["model"], r["batch"], r["path"], f"{r['step_s'] * 1e6:.1f}", f"{r['GBps']:.2f}",
               f"{_fallback_of(rows, r, 'step_s') / r['step_s']:.2f}x", f"{r['error']:.1e}"]
              for r in rows if r["kind"] == "decode"]
    return ("## Prefill (SiLU)\n\n" + markdown_table(
        ["model", "B", "T", "path", "forward ms", "forward GB/s", "vs fallback", "fwd+bwd ms", "vs fallback",
         "max rel error"], prefill)
        + "\n\n## Decode step (causal_conv1d_update)\n\n" + markdown_table(
        ["model", "batch", "path", "step us", "GB/s", "vs fallback", "max rel error"], decode))


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    ours = [r for r in rows if r["path"] == "ours"]
    for model in MODELS:
        picked = [r for r in ours if r["kind"] == "prefill" and r["model"] == model]
        labels = [f"B{r['batch']} T{r['length']}" for r in picked]
        left.plot(labels, [_fallback_of(rows, r, "forward_s") / r["forward_s"] for r in picked], "o-",
                  label=f"{model}, forward")
        left.plot(labels, [_fallback_of(rows, r, "fwd_bwd_s") / r["fwd_bwd_s"] for r in picked], "s--",
                  label=f"{model}, fwd+bwd")
        picked = [r for r in ours if r["kind"] == "decode" and r["model"] == model]
        right.plot([r["batch"] for r in picked], [_fallback_of(rows, r, "step_s") / r["step_s"] for r in picked],
                   "o-", label=model)
    for ax, title in ((left, "prefill"), (right, "decode step")):
        ax.axhline(1.0, color="0.6", lw=0.8)
        ax.set_title(title)
        ax.set_ylabel("speed over the torch fallback")
        ax.legend(fontsize=8)
    right.set_xscale("log", base=2)
    right.set_xlabel("batch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def gpu_goals(data: dict) -> list:
    """BENCHMARK's summary goals from ``causal_conv1d-gpu.json``: ours over the fallback in
    forward+backward time at T >= 4k, and in decode-step time at every batch."""
    rows = data["rows"]
    prefill = [(_fallback_of(rows, r, "fwd_bwd_s") / r["fwd_bwd_s"], f"{r['model']} B{r['batch']} T{r['length']}")
               for r in rows if r["path"] == "ours" and r["kind"] == "prefill" and r["length"] >= 4 * K]
    decode = [(_fallback_of(rows, r, "step_s") / r["step_s"], f"{r['model']} batch {r['batch']}")
              for r in rows if r["path"] == "ours" and r["kind"] == "decode"]
    return [worst_speedup_goal(prefill, "no prefill at T >= 4k in this run"),
            worst_speedup_goal(decode, "no decode step in this run")]


def main(argv=None) -> int:
    parser = family_parser(__doc__.splitlines()[0], quick="one small size (a smoke test)",
                           gpu="benchmarks/gpu.sh's sizes (with --device cpu: tiny, its dry run); writes -gpu files")
    args = parser.parse_args(argv)
    if cuda_missing(args.device):
        return 2
    device, on_gpu, dtype, budget = family_run(args)
    prefills, batches = sizes(on_gpu, args.quick, args.gpu)
    rows = []
    for model, dim in MODELS.items():
        rows += [row for batch, length in prefills
                 for row in measure_prefill(model, dim, batch, length, device, dtype, budget)]
        rows += [row for batch in batches for row in measure_decode(model, dim, batch, device, dtype, budget)]
        print(f"{model}: done", flush=True)
    text = (f"# Causal conv1d\n\n{machine_line()}; {args.device}, {dtype}, width {WIDTH}; ours: "
            f"{'triton' if on_gpu else 'reference'} backend. Ratios over transformers' torch fallback (> 1: ours "
            "faster); errors against the fallback in float32.\n\n" + tables(rows) + "\n")
    print(text)
    preset = "-gpu" if args.gpu else "-quick" if args.quick else ""
    write_results(args.out, f"causal_conv1d{preset}", text,
                  {"machine": machine_line(), "device": args.device, "dtype": str(dtype), "rows": rows}, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""MLA decode against decompressed GQA: ragged_paged_mla on the latent cache vs ragged_paged_attention on the decompressed one.

    python benchmarks/mla.py [--quick | --gpu] [--device cpu|cuda] [--budget S] [--out DIR]

DeepSeek-V3's attention (128 heads, latent Lr 512, RoPE key R 64, nope head size 128, value head
size 128) at decode: a batch of sequences with one new query each. Two ways to serve it, timed in
one run on the same tokens: ours, ``ragged_paged_mla`` over the paged latent cache (one
``Lr + R`` row per token, the up-projections absorbed into the query and applied to the output
after), and what an engine without an MLA kernel does, ``ragged_paged_attention`` over keys
``[c W_UK, k_pe]`` and values ``c W_UV`` decompressed once into a per-head paged cache (128 kv
heads of 192, values padded to the key's size, as that op needs). The projections are not timed
on either side: only the attention call. Reported: the cache bytes per token each reads (the
latent cache's win; the decompressed path's counted without its value padding, ``H * (192 + 128)``
entries), time per step, their ratios, and each path's error after ``W_UV`` against
the float32 uncompressed attention. Writes ``mla{-quick,-gpu,}.{md,json,png}`` to ``--out``
(default ``benchmarks/results``).
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import (cuda_missing, family_parser, machine_line, markdown_table, seconds_per_call,  # noqa: E402
                    worst_speedup_goal, write_results)

import torch_kernels  # noqa: E402

K = 1024
LATENT, ROPE, NOPE, VALUE = 512, 64, 128, 128
BLOCK = 64

BENCHMARK = {  # for the scripts that run or summarize every family (common.family_benchmarks)
    "gpu_step": {"position": 15, "cap_s": 60, "autotuned": True},  # no search here: the pass runs it once more
    "summary_position": 15,
    "summary_goals": [["mla decode vs decompressed GQA",
                       "ragged_paged_mla faster than ragged_paged_attention on the decompressed cache at every context"]],
    "quick_compile_group": "mla",
    "bench": True,
}


def sizes(cuda: bool, quick: bool, gpu: bool):
    """(heads, batch, contexts)."""
    if cuda:
        # batch 8 at 8k: float32 decompressed caches (built for the truth) of 12.6 GB
        return (128, 8, (1 * K,)) if quick else (128, 8, (1 * K, 4 * K, 8 * K))
    if gpu:  # the GPU preset's dry run on the CPU: tiny
        return 16, 2, (64,)
    return (16, 2, (256,)) if quick else (128, 4, (256, 1 * K))


class Decode:
    """One decode step of ``batch`` sequences at ``context`` tokens: the latent cache, the
    decompressed caches and both forms of the queries."""

    def __init__(self, heads: int, batch: int, context: int, device, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed + context)
        self.heads = heads
        pages = -(-context // BLOCK)
        num_blocks = batch * pages
        tokens = num_blocks * BLOCK  # every slot of the cache holds a token of some sequence
        c = torch.randn(tokens, LATENT, generator=gen)
        k_pe = torch.randn(tokens, ROPE, generator=gen)
        w_uk = torch.randn(heads, LATENT, NOPE, generator=gen) * LATENT ** -0.5
        w_uv = torch.randn(heads, LATENT, VALUE, generator=gen) * LATENT ** -0.5
        q_nope = torch.randn(batch, heads, NOPE, generator=gen)
        q_pe = torch.randn(batch, heads, ROPE, generator=gen)
        self.scale = (NOPE + ROPE) ** -0.5
        self.block_table = torch.randperm(num_blocks, generator=gen).to(torch.int32).reshape(batch, pages).to(device)
        self.cu_q_lens = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.kv_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        c, k_pe, w_uk, w_uv = (t.to(device) for t in (c, k_pe, w_uk, w_uv))
        q_nope, q_pe = q_nope.to(device), q_pe.to(device)
        self.w_uv = w_uv
        self.latent_cache = torch.cat([c, k_pe], -1).reshape(num_blocks, BLOCK, LATENT + ROPE).to(dtype)
        # decompressed on the device, in float32: the truth first (the uncompressed attention on the
        # reference backend), then the caches the GQA path reads in the timed dtype
        shape = (num_blocks, BLOCK, heads, NOPE + ROPE)
        key_cache = torch.cat([torch.einsum("sl,hld->shd", c, w_uk), k_pe[:, None].expand(tokens, heads, ROPE)],
                              -1).reshape(shape)
        value_cache = torch.nn.functional.pad(torch.einsum("sl,hlv->shv", c, w_uv),
                                              (0, NOPE + ROPE - VALUE)).reshape(shape)
        self.query = torch.cat([q_nope, q_pe], -1)
        self.truth = torch_kernels.ragged_paged_attention(
            self.query, key_cache, value_cache, self.cu_q_lens, self.kv_lens, self.block_table, self.scale,
            implementation="reference")[..., :VALUE]
        self.key_cache, self.value_cache = key_cache.to(dtype), value_cache.to(dtype)
        del key_cache, value_cache
        self.q_absorbed = torch.einsum("thd,hld->thl", q_nope, w_uk).to(dtype)
        self.q_pe = q_pe.to(dtype)
        self.query = self.query.to(dtype)

    def mla(self):
        out = torch_kernels.ragged_paged_mla(self.q_absorbed, self.q_pe, self.latent_cache, self.cu_q_lens,
                                             self.kv_lens, self.block_table, self.scale)
        return out

    def gqa(self):
        return torch_kernels.ragged_paged_attention(self.query, self.key_cache, self.value_cache, self.cu_q_lens,
                                                    self.kv_lens, self.block_table, self.scale)

    def error(self, out, latent: bool) -> float:
        got = torch.einsum("thl,hlv->thv", out.float(), self.w_uv) if latent else out.float()[..., :VALUE]
        return ((got.double() - self.truth.double()).abs().max() / self.truth.double().abs().max()).item()


def measure(heads: int, batch: int, context: int, device, dtype, budget: float) -> list[dict]:
    case = Decode(heads, batch, context, device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    item = case.latent_cache.element_size()
    per_token = {"mla": (LATENT + ROPE) * item, "decompressed GQA": heads * (NOPE + ROPE + VALUE) * item}
    rows = []
    with torch.no_grad():
        for path, fn, latent in (("mla", case.mla, True), ("decompressed GQA", case.gqa, False)):
            out = fn()
            step_s = seconds_per_call(fn, budget, sync)
            rows.append({"heads": heads, "batch": batch, "context": context, "path": path, "step_s": step_s,
                         "cache_bytes_per_token": per_token[path],
                         "GBps": per_token[path] * batch * context / step_s / 1e9,
                         "error": case.error(out, latent)})
    return rows


def _other(rows, row, key):
    for r in rows:
        if r["path"] == "decompressed GQA" and all(r[k] == row[k] for k in ("heads", "batch", "context")):
            return r[key]
    raise KeyError(row)


def tables(rows: list[dict]) -> str:
    body = [[r["heads"], r["batch"], r["context"], r["path"], r["cache_bytes_per_token"],
             f"{_other(rows, r, 'cache_bytes_per_token') / r['cache_bytes_per_token']:.1f}x",
             f"{r['step_s'] * 1e3:.3f}", f"{_other(rows, r, 'step_s') / r['step_s']:.2f}x", f"{r['GBps']:.1f}",
             f"{r['error']:.1e}"] for r in rows]
    return markdown_table(["H", "batch", "context", "path", "cache B/token", "fewer bytes", "step ms",
                           "speed vs decompressed", "cache GB/s", "max rel error"], body)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ours = [r for r in rows if r["path"] == "mla"]
    ax.plot([r["context"] for r in ours], [_other(rows, r, "step_s") / r["step_s"] for r in ours], "o-",
            label="time: decompressed / mla")
    ax.plot([r["context"] for r in ours], [_other(rows, r, "cache_bytes_per_token") / r["cache_bytes_per_token"]
                                           for r in ours], "s--", label="cache bytes: decompressed / mla")
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context")
    ax.set_ylabel("ratio (> 1: mla better)")
    ax.set_title("MLA decode vs decompressed GQA")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def gpu_goals(data: dict) -> list:
    """BENCHMARK's summary goal from ``mla-gpu.json``: mla's step time over the decompressed
    path's, worst over the contexts."""
    rows = data["rows"]
    speedups = [(_other(rows, r, "step_s") / r["step_s"], f"context {r['context']}") for r in rows if r["path"] == "mla"]
    return [worst_speedup_goal(speedups, "no decode step in this run")]


def main(argv=None) -> int:
    parser = family_parser(__doc__.splitlines()[0], quick="one small size (a smoke test)",
                           gpu="benchmarks/gpu.sh's sizes (with --device cpu: tiny, its dry run); writes -gpu files")
    args = parser.parse_args(argv)
    if cuda_missing(args.device):
        return 2
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if not on_gpu:  # one thread, as the other CPU benchmarks: the machine's cores are shared
        torch.set_num_threads(1)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    budget = args.budget or (0.02 if args.gpu and not on_gpu else 0.1 if args.gpu else 0.2 if args.quick else 0.5)
    heads, batch, contexts = sizes(on_gpu, args.quick, args.gpu)
    rows = []
    for context in contexts:
        rows += measure(heads, batch, context, device, dtype, budget)
        print(f"context {context}: done", flush=True)
    text = (f"# MLA decode vs decompressed GQA\n\n{machine_line()}; {args.device}, {dtype}; DeepSeek-V3 attention "
            f"({heads} heads, Lr {LATENT}, R {ROPE}, nope {NOPE}, value {VALUE}), one query per sequence; "
            f"backend: {'triton' if on_gpu else 'reference'}. Ratios: the decompressed path's over mla's (> 1: mla "
            "better); errors after W_UV against the float32 uncompressed attention.\n\n" + tables(rows) + "\n")
    print(text)
    preset = "-gpu" if args.gpu else "-quick" if args.quick else ""
    write_results(args.out, f"mla{preset}", text,
                  {"machine": machine_line(), "device": args.device, "dtype": str(dtype), "rows": rows}, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

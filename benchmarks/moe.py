"""Mixture of experts: grouped_mm TFLOP/s and fused_moe tokens/s at decode and prefill sizes.

    python benchmarks/moe.py [--quick | --gpu] [--device cpu|cuda] [--budget S] [--threads N] [--out DIR]

Sizes of Qwen3-30B-A3B (E 128, k 8, H 2048, I 768, softmax top-8) and DeepSeek-V3 (E 256, k 8,
H 7168, I 2048, grouped sigmoid top-8 with a correction bias), decode (T = 1 to 256) and prefill
(T = 4k to 16k) on CUDA. On CPU (2 cores) the sizes are scaled down, and every table row says
how: fewer experts, with prefill tokens cut in proportion so that each expert keeps the rows per
expert of T = 4k (the shape a grouped GEMM's speed depends on); DeepSeek-V3 also with H and I
quartered at prefill. One CPU thread by default (``--threads``): on shared cores a second
thread's wake-ups stall every parallel region, which would rank paths by how many ops they
launch rather than by their work. Routing: random router logits through
``torch_kernels.router_topk`` (not timed), the same for every path. Timed in one run:

- grouped_mm, the gate/up GEMM ``[T k, H] x [E, H, 2I]`` of the dispatched rows: ours
  (``torch_kernels.grouped_mm``), ``torch.nn.functional.grouped_mm``, a per-expert loop of
  matmuls, and a dense matmul of the same M, K, N (the GPU goal: grouped_mm at 70% of its rate at
  prefill sizes). TFLOP/s.
- the experts block: ours ``fused_moe``, ours unfused (``moe_dispatch -> grouped_mm -> SwiGLU ->
  grouped_mm -> moe_combine``) and transformers' ``grouped_mm_experts_forward`` on the model's own
  experts module holding the same weights. Tokens/s.

Forward, and forward+backward (a random cotangent; gradients of the tokens, the expert weights
and the routing weights). Every path's output and gradients are compared with a baseline's (the
per-expert loop; transformers), the largest relative difference reported. "Ours" is the backend a
user gets, chosen with ``implementation=``: reference on CPU (Triton and Pallas run interpreted
there, correctness tools: not timed), triton on CUDA, bfloat16 on both. Writes
``moe{-quick,}.{md,json,png}`` to ``benchmarks/results``.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import os
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import (NOT_MEASURED, all_met, cuda_missing, family_parser, goal_result, machine_line,  # noqa: E402
                    markdown_table, seconds_per_call)

import torch_kernels  # noqa: E402
from torch_kernels.ops.moe import fused_moe_flops  # noqa: E402

K = 1024
PREFILL_GOAL = 0.70  # grouped_mm's fraction of the dense matmul rate at prefill sizes (GPU goal)
DTYPE = torch.bfloat16
COMPARE_CHUNK = 1 << 26  # elements upcast at a time when comparing (DeepSeek's gradients are GBs)

BENCHMARK = {  # for the scripts that run or summarize every family (common.family_benchmarks)
    "gpu_step": {"position": 30, "cap_s": 75, "autotuned": True},
    "summary_position": 30,
    "summary_goals": [["grouped_mm vs matmul rate", ">= 70% of the dense matmul of the same M, K, N at prefill sizes"],
                      ["fused_moe vs unfused", "faster at every size"]],
    "quick_compile_group": "moe-deepseek-v3-float16-T1",
    "bench": True,
}


# -------------------------------------------------------------------------------------- sizes


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    experts: int
    top_k: int
    hidden: int
    intermediate: int
    router: tuple  # router_topk keywords beyond top_k, as (name, value) pairs
    transformers_module: str  # the transformers.models package holding its experts class
    experts_class: str


QWEN3 = Model("Qwen3-30B-A3B", 128, 8, 2048, 768, (("scoring", "softmax"), ("renormalize", True)),
              "qwen3_moe", "Qwen3MoeExperts")
DEEPSEEK_V3 = Model("DeepSeek-V3", 256, 8, 7168, 2048,
                    (("scoring", "sigmoid"), ("renormalize", True), ("num_expert_groups", 8), ("topk_groups", 4),
                     ("routed_scaling_factor", 2.5)),
                    "deepseek_v3", "DeepseekV3Experts")


def tokens(n: int) -> str:
    return f"{n // K}k" if n >= K and n % K == 0 else str(n)


@dataclasses.dataclass(frozen=True)
class Case:
    model: Model
    phase: str  # "decode" or "prefill"
    tokens: int
    experts: int  # as run: the model's, or fewer where scaled down
    hidden: int
    intermediate: int
    backward: bool  # forward+backward measured too

    @property
    def rows(self) -> int:
        return self.tokens * self.model.top_k

    @property
    def label(self) -> str:
        return f"{self.model.name} {self.phase} T {tokens(self.tokens)}"

    @property
    def short(self) -> str:
        return f"{self.phase} {tokens(self.tokens)}" + ("*" if self.scaling() else "")

    def router(self) -> dict:
        kwargs = dict(self.model.router)
        groups = kwargs.get("num_expert_groups")
        # fewer experts: keep the groups only where they still leave top_k experts to choose from
        if groups and (self.experts % groups or kwargs["topk_groups"] * self.experts // groups < self.model.top_k):
            kwargs.pop("num_expert_groups")
            kwargs.pop("topk_groups")
        return kwargs

    def scaling(self) -> str:
        m, parts = self.model, []
        for what, run, real in (("E", self.experts, m.experts), ("H", self.hidden, m.hidden),
                                ("I", self.intermediate, m.intermediate)):
            if run != real:
                parts.append(f"{what} {run} of {real}")
        if self.phase == "prefill" and self.experts != m.experts:
            parts.append(f"{self.rows // self.experts} rows per expert, as T = "
                         f"{tokens(self.tokens * m.experts // self.experts)} with all {m.experts} experts")
        return "; ".join(parts)


def real_case(model: Model, phase: str, t: int, backward: bool = True) -> Case:
    return Case(model, phase, t, model.experts, model.hidden, model.intermediate, backward)


def build_cases(cuda: bool, quick: bool, gpu: bool = False) -> list:
    if gpu and not cuda:  # benchmarks/gpu.sh's dry run: every path once, tiny
        return [Case(m, phase, t, 8, m.hidden // 32, m.intermediate // 32, phase == "prefill")
                for m in (QWEN3, DEEPSEEK_V3) for phase, t in (("decode", 4), ("prefill", 32))]
    if cuda:  # the real sizes
        decode, prefill = ((1, 64), (4 * K,)) if quick or gpu else ((1, 4, 16, 64, 256), (4 * K, 8 * K, 16 * K))
        return [real_case(m, phase, t) for m in (QWEN3, DEEPSEEK_V3)
                for phase, ts in (("decode", decode), ("prefill", prefill)) for t in ts]
    # CPU, 2 cores: the whole run in minutes. Backward only at prefill (training) sizes; Qwen3's
    # decode keeps all 128 experts (1.2 GB of weights); DeepSeek-V3 has 32 of its 256.
    q, d = QWEN3, DEEPSEEK_V3
    if quick:  # every path once, on toy sizes
        return [Case(m, phase, t, 16, m.hidden // 8, m.intermediate // 8, phase == "prefill")
                for m in (q, d) for phase, t in (("decode", 1), ("prefill", 64))]
    cases = [Case(q, "decode", t, q.experts, q.hidden, q.intermediate, False) for t in (1, 4, 16, 64, 256)]
    cases.append(Case(q, "prefill", 4 * K * 16 // q.experts, 16, q.hidden, q.intermediate, True))
    cases += [Case(d, "decode", t, 32, d.hidden, d.intermediate, False) for t in (1, 16, 64, 256)]
    cases.append(Case(d, "prefill", 4 * K * 32 // d.experts, 32, d.hidden // 4, d.intermediate // 4, True))
    return cases


# ------------------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class Inputs:
    x: torch.Tensor  # [T, H]
    w13: nn.Parameter  # [E, 2I, H]
    w2: nn.Parameter  # [E, H, I]
    weights: torch.Tensor  # float32 [T, k]
    ids: torch.Tensor  # int32 [T, k]
    rows: torch.Tensor  # [T k, H], dispatched (sorted by expert)
    offsets: torch.Tensor  # int32 [E]
    module: nn.Module  # transformers' experts module holding w13 and w2
    dense_w: nn.Parameter  # [2I, H], a copy of expert 0's gate/up matrix for the dense matmul


def experts_module(case: Case, w13: nn.Parameter, w2: nn.Parameter) -> nn.Module:
    """The model's own transformers experts class, built without weights, then given ours (shared)."""
    import importlib

    import transformers

    m = case.model
    config_class = {"qwen3_moe": transformers.Qwen3MoeConfig, "deepseek_v3": transformers.DeepseekV3Config}
    sizes = dict(hidden_size=case.hidden, moe_intermediate_size=case.intermediate, num_experts_per_tok=m.top_k)
    experts = {"qwen3_moe": "num_experts", "deepseek_v3": "n_routed_experts"}[m.transformers_module]
    config = config_class[m.transformers_module](**sizes, **{experts: case.experts})
    cls = getattr(importlib.import_module(f"transformers.models.{m.transformers_module}.modeling_"
                                          f"{m.transformers_module}"), m.experts_class)
    with torch.device("meta"):
        module = cls(config)
    module.gate_up_proj, module.down_proj = w13, w2
    return module


_weights_cache: dict = {}  # the latest sizes' expert weights: the cases of one model and phase share them


def expert_weights(e: int, h: int, i: int, device: torch.device, seed: int = 0):
    """``(w13 [E, 2I, H], w2 [E, H, I])`` parameters; one set held at a time (DeepSeek-V3's take GBs)."""
    key = (e, h, i, str(device), seed)
    if key not in _weights_cache:
        _weights_cache.clear()
        gen = torch.Generator(device).manual_seed(seed)
        # unit-variance activations through both GEMMs, as a trained layer keeps them
        w13 = torch.randn(e, 2 * i, h, generator=gen, device=device, dtype=DTYPE).mul_(h ** -0.5)
        w2 = torch.randn(e, h, i, generator=gen, device=device, dtype=DTYPE).mul_(i ** -0.5)
        _weights_cache[key] = nn.Parameter(w13), nn.Parameter(w2)
    return _weights_cache[key]


def make_inputs(case: Case, device: torch.device, seed: int = 0) -> Inputs:
    gen = torch.Generator(device).manual_seed(seed + case.tokens)
    e, h, i, t = case.experts, case.hidden, case.intermediate, case.tokens

    def randn(*shape, scale=1.0, dtype=DTYPE):
        return torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(scale)

    x = randn(t, h)
    w13, w2 = expert_weights(e, h, i, device, seed)
    router = case.router()
    bias = randn(e, scale=0.1, dtype=torch.float32) if router["scoring"] == "sigmoid" else None
    # setup, not timed: on the reference backend, so that a backend being written cannot stop the run here
    weights, ids = torch_kernels.router_topk(randn(t, e, dtype=torch.float32), case.model.top_k,
                                             correction_bias=bias, implementation="reference", **router)
    rows, offsets, _ = torch_kernels.moe_dispatch(x, ids, e, implementation="reference")
    return Inputs(x, w13, w2, weights, ids, rows, offsets,
                  experts_module(case, w13, w2) if transformers_note() is None else None,
                  nn.Parameter(w13.detach()[0].clone()))


@functools.cache  # a failed import is retried on every call otherwise
def transformers_note() -> str | None:
    """Why transformers' experts (the block's baseline) are left out, or None when they import."""
    try:
        from transformers.integrations.moe import grouped_mm_experts_forward  # noqa: F401
    except Exception as e:  # ImportError, or a version that lacks it
        return f"transformers' experts left out: {type(e).__name__}: {str(e)[:150]}"
    return None


# ------------------------------------------------------------------------------ implementations


@dataclasses.dataclass(frozen=True)
class Path:
    name: str
    run: object  # Inputs -> output tensor
    leaves: tuple  # the Inputs fields whose gradients forward+backward computes
    baseline: bool = False  # the output the others are compared with
    compared: bool = True  # its output is the same quantity as the baseline's


def per_expert_loop(rows, w, offsets):
    """One matmul per expert that has rows, in the inputs' dtype (a model without a grouped GEMM)."""
    ends = offsets.tolist()  # one host sync
    starts = [0] + ends[:-1]
    matrices = w.unbind(0)  # its backward stacks the experts' gradients once (indexing w[n] would add E full-size ones)
    return torch.cat([rows[s:e] @ matrices[n] for n, (s, e) in enumerate(zip(starts, ends)) if e > s])


def grouped_paths(backend: str) -> list:
    leaves = ("rows", "w13")
    paths = [Path("per-expert loop", lambda x: per_expert_loop(x.rows, x.w13.transpose(1, 2), x.offsets),
                  leaves, baseline=True),
             Path(f"ours grouped_mm ({backend})", lambda x: torch_kernels.grouped_mm(
                 x.rows, x.w13.transpose(1, 2), x.offsets, implementation=backend), leaves)]
    if hasattr(F, "grouped_mm"):
        paths.append(Path("torch F.grouped_mm", lambda x: F.grouped_mm(x.rows, x.w13.transpose(1, 2), offs=x.offsets),
                          leaves))
    # one expert's matrix for every row: the same M, K, N and layout as a dense layer
    paths.append(Path("dense matmul, same M K N", lambda x: x.rows @ x.dense_w.t(), ("rows", "dense_w"),
                      compared=False))
    return paths


def unfused(x: Inputs, backend: str):
    rows, offsets, handle = torch_kernels.moe_dispatch(x.x, x.ids, x.w13.shape[0], implementation=backend)
    gate, up = torch_kernels.grouped_mm(rows, x.w13.transpose(1, 2), offsets, implementation=backend).chunk(2, dim=-1)
    y = torch_kernels.grouped_mm(F.silu(gate) * up, x.w2.transpose(1, 2), offsets, implementation=backend)
    return torch_kernels.moe_combine(y, handle, x.weights, implementation=backend)


def block_paths(backend: str) -> list:
    leaves = ("x", "w13", "w2", "weights")
    # without transformers, ours fused is the baseline the unfused path is compared with
    fused_baseline = transformers_note() is not None
    paths = [Path(f"ours fused_moe ({backend})", lambda x: torch_kernels.fused_moe(
                 x.x, x.w13, x.w2, x.weights, x.ids, implementation=backend), leaves, baseline=fused_baseline),
             Path(f"ours unfused ({backend})", lambda x: unfused(x, backend), leaves)]
    if not fused_baseline:
        from transformers.integrations.moe import grouped_mm_experts_forward

        paths.insert(0, Path("transformers grouped_mm",
                             lambda x: grouped_mm_experts_forward(x.module, x.x, x.ids, x.weights), leaves,
                             baseline=True))
    return paths


# -------------------------------------------------------------------------------------- timing


def with_leaves(x: Inputs, names) -> Inputs:
    """``x`` with fresh gradient-requiring copies of the non-parameter inputs in ``names``."""
    fresh = {n: getattr(x, n).detach().clone().requires_grad_() for n in names
             if not isinstance(getattr(x, n), nn.Parameter)}
    return dataclasses.replace(x, **fresh)


def measure(path: Path, x: Inputs, backward: bool, budget_s: float, sync):
    """(seconds per call, the last call's output followed by its gradients)."""
    last = {}
    if not backward:
        def call():
            with torch.no_grad():
                last["out"] = path.run(x)
        seconds = seconds_per_call(call, budget_s, sync)
        return seconds, [last.pop("out")]
    x = with_leaves(x, path.leaves)
    leaves = [getattr(x, n) for n in path.leaves]
    cotangent = torch.randn(x.rows.shape[0] if "rows" in path.leaves else x.x.shape[0],
                            x.w13.shape[1] if "rows" in path.leaves else x.x.shape[1],
                            generator=torch.Generator(x.x.device).manual_seed(1), device=x.x.device, dtype=DTYPE)

    def call():
        for t in leaves:
            t.grad = None
        out = path.run(x)
        out.backward(cotangent)
        last["out"] = out.detach()
    seconds = seconds_per_call(call, budget_s, sync)
    outputs = [last.pop("out")] + [t.grad for t in leaves]
    for t in leaves:
        t.grad = None  # the caller holds them now
    return seconds, outputs


def relative_difference(got: list, want: list) -> float:
    """Largest over the tensors of max |got - want| / max |want| (upcast a chunk at a time); inf
    for a missing gradient or a non-finite value on either side, so that neither can hide."""
    worst = 0.0
    for g, w in zip(got, want):
        if g is None or w is None:
            if g is not w:
                return math.inf
            continue
        g, w = g.reshape(-1), w.reshape(-1)
        diff = scale = 0.0
        for start in range(0, w.numel(), COMPARE_CHUNK):
            g_chunk, w_chunk = g[start:start + COMPARE_CHUNK].float(), w[start:start + COMPARE_CHUNK].float()
            d, s = (g_chunk - w_chunk).abs().max().item(), w_chunk.abs().max().item()
            if not (math.isfinite(d) and math.isfinite(s)):  # max() would drop a NaN
                return math.inf
            diff, scale = max(diff, d), max(scale, s)
        worst = max(worst, diff / scale if scale else diff)
    return worst


def run_case(case: Case, device: torch.device, backend: str, budget_s: float, sync, log) -> list:
    x = make_inputs(case, device)
    rows = []
    sections = (("grouped_mm", grouped_paths(backend), 2 * case.rows * case.hidden * 2 * case.intermediate),
                ("block", block_paths(backend), fused_moe_flops(case.rows, case.hidden, case.intermediate)))
    for section, paths, flops in sections:
        baseline = {}
        for path in paths:
            row = {"case": case.label, "section": section, "impl": path.name, "flops_fwd": flops,
                   "flops_fwd_bwd": 3 * flops, "fwd_s": None, "fwd_bwd_s": None, "fwd_rel_diff": None,
                   "fwd_bwd_rel_diff": None, "error": None}
            for mode in ("fwd", "fwd_bwd") if case.backward else ("fwd",):
                try:
                    seconds, outputs = measure(path, x, mode == "fwd_bwd", budget_s, sync)
                except Exception as e:  # a backend that cannot run here, out of memory: the row says so
                    x.w13.grad = x.w2.grad = x.dense_w.grad = None
                    message = f"{mode}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                    row["error"] = f"{row['error']}; {message}" if row["error"] else message
                    log(f"  {case.label:34s} {section:10s} {path.name:30s} {mode:7s} {row['error']}")
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    continue
                row[f"{mode}_s"] = seconds
                if path.baseline:
                    baseline[mode] = outputs
                elif path.compared and mode in baseline:
                    row[f"{mode}_rel_diff"] = relative_difference(outputs, baseline[mode])
                del outputs
                diff = row[f"{mode}_rel_diff"]
                log(f"  {case.label:34s} {section:10s} {path.name:30s} {mode:7s} {seconds * 1e3:10.2f} ms "
                    f"{flops * (3 if mode == 'fwd_bwd' else 1) / seconds / 1e12:8.3f} TFLOP/s"
                    + (f"  rel diff {diff:.1e}" if diff is not None else ""))
            rows.append(row)
        del baseline
    del x
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def square_matmul_rate(device: torch.device, budget_s: float, sync, quick: bool, tiny: bool = False) -> dict:
    """The device's bf16 matmul rate on one large square product, measured now."""
    n = 256 if tiny else (8192 if device.type == "cuda" else 2048) // (2 if quick else 1)
    a, b = (torch.randn(n, n, device=device, dtype=DTYPE) for _ in range(2))
    seconds = seconds_per_call(lambda: a @ b, budget_s, sync)
    return {"n": n, "TFLOPs": 2 * n ** 3 / seconds / 1e12}


# ------------------------------------------------------------------------------------- report


def fmt(x: float) -> str:
    return "-" if x is None else f"{x:,.3g}" if x < 100 else f"{x:,.0f}"


def find(rows, case, section, impl_start):
    return next((r for r in rows if r["case"] == case and r["section"] == section
                 and r["impl"].startswith(impl_start)), None)


def cell_ms(s):
    return "-" if s is None else f"{s * 1e3:,.3g}" if s < 0.1 else f"{s * 1e3:,.0f}"


def diff_cell(r, mode):
    d = r[f"{mode}_rel_diff"]
    return "-" if d is None else f"{d:.1e}"


def grouped_table(rows, cases) -> str:
    header = ["model", "case", "impl", "fwd ms", "fwd TFLOP/s", "of dense", "fwd+bwd ms", "fwd+bwd TFLOP/s", "of dense",
              "rel diff (fwd / fwd+bwd)"]
    table = []
    for case in cases:
        dense = find(rows, case.label, "grouped_mm", "dense")
        for r in (r for r in rows if r["case"] == case.label and r["section"] == "grouped_mm"):
            cells = [case.model.name, case.short, r["impl"] + (" (failed: see below)" if r["error"] else "")]
            for mode in ("fwd", "fwd_bwd"):
                s, flops = r[f"{mode}_s"], r[f"flops_{mode}"]
                of_dense = (dense[f"{mode}_s"] / s if s and dense and dense[f"{mode}_s"] and r is not dense else None)
                cells += [cell_ms(s), fmt(flops / s / 1e12 if s else None),
                          "-" if of_dense is None else f"{of_dense:.0%}"]
            cells.append("baseline" if r["impl"] == "per-expert loop" else
                         "-" if r["impl"].startswith("dense") else f"{diff_cell(r, 'fwd')} / {diff_cell(r, 'fwd_bwd')}")
            table.append(cells)
    return markdown_table(header, table)


def block_table(rows, cases) -> str:
    header = ["model", "case", "impl", "fwd ms", "fwd tokens/s", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd tokens/s",
              "fwd+bwd TFLOP/s", "this / fused (fwd, fwd+bwd)", "rel diff (fwd / fwd+bwd)"]
    table = []
    for case in cases:
        fused = find(rows, case.label, "block", "ours fused_moe")
        for r in (r for r in rows if r["case"] == case.label and r["section"] == "block"):
            cells = [case.model.name, case.short, r["impl"] + (" (failed: see below)" if r["error"] else "")]
            ratios = []
            for mode in ("fwd", "fwd_bwd"):
                s = r[f"{mode}_s"]
                cells += [cell_ms(s), fmt(case.tokens / s if s else None),
                          fmt(r[f"flops_{mode}"] / s / 1e12 if s else None)]
                f = fused and fused[f"{mode}_s"]
                ratios.append(f"{s / f:.2f}x" if s and f else "-")
            cells.append(", ".join(ratios))
            cells.append("baseline" if r["impl"].startswith("transformers") else
                         f"{diff_cell(r, 'fwd')} / {diff_cell(r, 'fwd_bwd')}")
            table.append(cells)
    return markdown_table(header, table)


def goals(rows, cases) -> list:
    lines = []
    for case in (c for c in cases if c.phase == "prefill"):
        ours = find(rows, case.label, "grouped_mm", "ours")
        dense = find(rows, case.label, "grouped_mm", "dense")
        parts = []
        for mode, what in (("fwd", "forward"), ("fwd_bwd", "forward+backward")):
            if ours and dense and ours[f"{mode}_s"] and dense[f"{mode}_s"]:
                frac = dense[f"{mode}_s"] / ours[f"{mode}_s"]
                parts.append(f"{what} {frac:.0%} ({'met' if frac >= PREFILL_GOAL else 'not met'})")
            elif case.backward or mode == "fwd":
                parts.append(f"{what}: no measurement")
        lines.append({"case": case.label, "text": f"{case.label}" + (f" ({case.scaling()})" if case.scaling() else "")
                      + ": ours grouped_mm at " + ", ".join(parts) + " of the dense matmul of the same M, K, N"})
    return lines


def worst_differences(rows) -> dict:
    worst = {}
    for r in rows:
        for mode in ("fwd", "fwd_bwd"):
            d = r[f"{mode}_rel_diff"]
            if d is not None:
                worst[r["impl"]] = max(worst.get(r["impl"], 0.0), d)
    return worst


def markdown(args, cases, rows, square, backend, runtime_s, load) -> str:
    device, quick = args.device, args.quick
    out = [f"# Mixture-of-experts benchmark\n\n{machine_line()}; device {device_name(device)}, bfloat16"
           + (" (--quick)" if quick else "")]
    out.append(f"\nOurs: the `{backend}` backend (`implementation=\"{backend}\"`)"
               + ("; the triton and pallas backends run interpreted on CPU (correctness tools), so they are not "
                  "timed here" if device == "cpu" else "")
               + f". Routing: random router logits through `torch_kernels.router_topk` (not timed), the same for "
               f"every path; no slot dropped. Time per call: the fastest block of calls in {args.budget_s:g} s (a "
               "call slower than that is timed once after a warm-up call)"
               + (", `torch.cuda.synchronize()` before each clock reading" if device == "cuda" else "")
               + f". Run took {runtime_s:.0f} s; 1-minute load average {load[0]:.1f} at the start, {load[1]:.1f} at "
               "the end" + (" (other processes shared these cores: CPU figures are noisy)"
                            if device == "cpu" and max(load) > 0.5 * (os.cpu_count() or 1) else "")
               + f". Measured now: bf16 matmul {fmt(square['TFLOPs'])} TFLOP/s ({square['n']}^3).")
    out.append("\n## Sizes\n")
    size_rows = []
    for c in cases:
        size_rows.append([c.model.name, c.short, c.phase, c.tokens, c.experts, c.model.top_k, c.hidden, c.intermediate,
                          f"{c.rows / c.experts:.3g}", "yes" if c.backward else "no", c.scaling() or "real size"])
    out.append(markdown_table(["model", "case", "phase", "T", "E", "k", "H", "I", "rows per expert (mean)",
                               "fwd+bwd", "scaled down"], size_rows))
    if (note := transformers_note()) is not None:
        out.append(f"\n{note}; the experts block's baseline is ours fused_moe.")
    if args.gpu and device == "cpu":
        out.append("\n--gpu on the CPU: benchmarks/gpu.sh's dry run at toy sizes (E 8, H and I a 32nd of the "
                   "model's), a test of every path, not a measurement.")
    elif quick:
        out.append("\n`*`: --quick runs toy sizes (E 16, H and I an eighth of the model's): a smoke test of every "
                   "path, not a measurement.")
    elif device == "cpu":
        real = {m.name: fused_moe_flops(4 * K * m.top_k, m.hidden, m.intermediate) / 1e12 for m in (QWEN3, DEEPSEEK_V3)}
        weights_gb = DEEPSEEK_V3.experts * 3 * DEEPSEEK_V3.hidden * DEEPSEEK_V3.intermediate * 2 / 1e9
        out.append("\n`*`: scaled down, as the last column says, so that the CPU run takes minutes on 2 shared cores. "
                   "At T = 4k one forward of the real experts block is "
                   + " and ".join(f"{v:.2g} TFLOP ({k})" for k, v in real.items())
                   + f", minutes per call at this CPU's rates, and DeepSeek-V3's experts are {weights_gb:.0f} GB of "
                   "bf16 weights per layer. Prefill: fewer experts and tokens with the rows per expert of T = 4k, so "
                   "each expert's GEMM keeps its shape (Qwen3 at its real H and I: its tokens/s stand for the model's; "
                   "DeepSeek-V3 also with H and I quartered). Decode: Qwen3 at its real size; DeepSeek-V3 with 32 of "
                   "its 256 experts at its real H and I. Forward+backward at prefill (training) sizes only. "
                   "`--device cuda` runs the real sizes.")
    out.append("\n## Goal (GPU): grouped_mm at 70% of the dense bf16 matmul rate at prefill sizes\n")
    if device != "cuda":
        out.append("(Set for an H200; on this CPU it only shows where the CPU path stands.)\n")
    out += [f"- {g['text']}" for g in goals(rows, cases)]
    out.append("\n## grouped_mm: the gate/up GEMM `[T k, H] x [E, H, 2I]` of the dispatched rows\n")
    out.append(grouped_table(rows, cases))
    out.append("\n`of dense`: this path's TFLOP/s over the dense matmul's of the same M = T k, K = H, N = 2I "
               "(one expert's matrix for all rows). `rel diff`: max |this - baseline| / max |baseline| over the "
               "output and, forward+backward, the gradients of the rows and the weights; baseline: the per-expert "
               "loop (one matmul per expert in bf16). TFLOP/s count 2 M K N forward, three times that with backward.")
    out.append("\n## Experts block: fused_moe against the unfused ops and transformers\n")
    out.append(block_table(rows, cases))
    out.append("\nBaseline: transformers' `grouped_mm_experts_forward` on the model's experts class "
               "(`Qwen3MoeExperts`, `DeepseekV3Experts`) holding the same weights, given the same float32 routing "
               "weights. `ours unfused`: `moe_dispatch -> grouped_mm -> silu(gate) * up -> grouped_mm -> "
               "moe_combine`. `this / fused`: this path's time over ours `fused_moe`'s (above 1: fused is faster). "
               "`rel diff` as above, over the output and the gradients of the tokens, both weight tensors and the "
               "routing weights. TFLOP/s count the two expert GEMMs, 6 T k H I forward.")
    worst = worst_differences(rows)
    if worst:
        out.append("\nLargest relative difference from the baseline over the run: "
                   + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + ".")
    errors = [f"- {r['case']}, {r['impl']}: {r['error']}" for r in rows if r["error"]]
    if errors:
        out.append("\nNot measured:\n")
        out += errors
    return "\n".join(out) + "\n"


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def plot(rows, cases, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(c.model.name for c in cases))
    fig, axes = plt.subplots(2, len(models), figsize=(7 * len(models), 9), squeeze=False)
    for col, model in enumerate(models):
        model_cases = [c for c in cases if c.model.name == model]
        for row, (section, unit, title) in enumerate((("grouped_mm", "TFLOP/s", "grouped_mm (gate/up GEMM)"),
                                                      ("block", "tokens/s", "experts block"))):
            ax = axes[row][col]
            impls = list(dict.fromkeys(r["impl"] for r in rows if r["section"] == section))
            for n, impl in enumerate(impls):
                for mode, style, face in (("fwd", "-", None), ("fwd_bwd", "--", "none")):
                    label = f"{impl}{', fwd+bwd' if mode == 'fwd_bwd' else ''}"
                    for phase in ("decode", "prefill"):  # a line per phase: their sizes do not continue
                        points = []
                        for k, c in enumerate(model_cases):
                            r = find(rows, c.label, section, impl)
                            if c.phase == phase and r and r[f"{mode}_s"]:
                                work = r[f"flops_{mode}"] / 1e12 if section == "grouped_mm" else c.tokens
                                points.append((k, work / r[f"{mode}_s"]))
                        if points:
                            ax.plot(*zip(*points), style, marker="o" if face is None else "s", color=f"C{n}",
                                    markerfacecolor=face, label=label)
                            label = None
            ax.set_xticks(range(len(model_cases)))
            ax.set_xticklabels([c.short for c in model_cases])
            ax.set(yscale="log", ylabel=unit, title=f"{model}: {title}", xlabel="case (* scaled down)")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------- main


def gpu_goals(data: dict) -> list:
    """BENCHMARK's summary goals from ``moe-gpu.json``: grouped_mm's time against the dense matmul of the
    same M, K, N at the prefill cases (forward, forward+backward), and fused_moe's against the unfused
    ops at every case."""
    rows = data["rows"]
    fractions = []
    for case in (c["label"] for c in data["cases"] if c["phase"] == "prefill"):
        ours, dense = find(rows, case, "grouped_mm", "ours"), find(rows, case, "grouped_mm", "dense")
        for mode in ("fwd", "fwd_bwd"):
            if ours and dense and ours[f"{mode}_s"] and dense[f"{mode}_s"]:
                fractions.append((f"{case} {mode}", dense[f"{mode}_s"] / ours[f"{mode}_s"]))
    speedups = []
    for case in (c["label"] for c in data["cases"]):
        fused, unfused = find(rows, case, "block", "ours fused_moe"), find(rows, case, "block", "ours unfused")
        if fused and unfused and fused["fwd_s"] and unfused["fwd_s"]:
            speedups.append((case, unfused["fwd_s"] / fused["fwd_s"]))
    results = []
    for pairs, threshold, fmt in ((fractions, PREFILL_GOAL, "{:.0%}"), (speedups, 1.0, "{:.2f}x")):
        if not pairs:
            results.append(goal_result(None, NOT_MEASURED, "no case measured"))
            continue
        worst = min(v for _, v in pairs)
        results.append(goal_result(fmt.format(worst) + " (worst)", all_met([v for _, v in pairs], threshold),
                                   "; ".join(f"{k}: {fmt.format(v)}" for k, v in pairs)))
    return results


def main(argv=None) -> int:
    parser = family_parser(__doc__.splitlines()[0], quick="a few small cases (a smoke test)",
                           gpu="benchmarks/gpu.sh's cases (with --device cpu: tiny, its dry run); writes -gpu files")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default on CPU: 1, steady on shared cores; on CUDA: torch's)")
    args = parser.parse_args(argv)
    start, load = time.time(), [os.getloadavg()[0]]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda_missing(args.device):
        return 2
    if args.threads or not cuda:
        # under load, eight small matmuls took 150 ms on two threads and 0.3 ms on one
        torch.set_num_threads(args.threads or 1)
    sync = torch.cuda.synchronize if cuda else None
    backend = "triton" if cuda else "reference"
    args.budget_s = args.budget or (0.05 if args.quick else 0.1 if args.gpu else 0.2 if cuda else 0.3)
    if args.gpu and not cuda:
        args.budget_s = args.budget or 0.01
    cases = build_cases(cuda, args.quick, args.gpu)

    def log(line):
        print(line, flush=True)

    log(f"# moe benchmark: {machine_line()}, {device_name(args.device)}, bfloat16, ours on {backend}")
    square = square_matmul_rate(device, args.budget_s, sync, args.quick, tiny=args.gpu and not cuda)
    log(f"  bf16 matmul {square['n']}^3: {square['TFLOPs']:.3f} TFLOP/s")
    rows = []
    for case in cases:
        rows += run_case(case, device, backend, args.budget_s, sync, log)
    load.append(os.getloadavg()[0])
    runtime = time.time() - start
    report = markdown(args, cases, rows, square, backend, runtime, load)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"moe{'-gpu' if args.gpu else '-quick' if args.quick else ''}"
    stem.with_suffix(".md").write_text(report)
    stem.with_suffix(".json").write_text(json.dumps({
        "machine": machine_line(), "device": device_name(args.device), "dtype": str(DTYPE), "backend": backend,
        "quick": args.quick, "budget_s": args.budget_s, "runtime_s": runtime, "load_average": load,
        "square_matmul": square, "goal_fraction_of_dense": PREFILL_GOAL, "goals": goals(rows, cases),
        "cases": [{"label": c.label, "model": c.model.name, "phase": c.phase, "T": c.tokens, "E": c.experts,
                   "k": c.model.top_k, "H": c.hidden, "I": c.intermediate, "router": c.router(),
                   "backward": c.backward, "scaled_down": c.scaling() or None} for c in cases],
        "rows": rows}, indent=1))
    try:
        plot(rows, cases, stem.with_suffix(".png"))
    except ImportError as e:  # matplotlib is in the [bench] extra: the tables still stand
        print(f"plot: {e}", file=sys.stderr)
    print()
    print(report)
    print(f"written: {stem}.md, .json, .png ({runtime:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

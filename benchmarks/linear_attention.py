"""Linear attention against causal softmax attention: forward and forward+backward over length.

    python benchmarks/linear_attention.py [--quick | --gpu] [--device cpu|cuda] [--budget S] [--out DIR]

B = 1, H = 16, D = 128 (K = V = 128), T = 1k to 16k. Timed, on the same device in the same run:
``chunk_gated_delta_rule`` and ``chunk_simple_gla`` (the backend a user gets there: the reference
chunked form on CPU, Triton on CUDA), ``scaled_dot_product_attention(is_causal=True)``, and fla's
chunked kernels (``fla-core``) where they import (CUDA only: they are Triton kernels with
autotuning, which the CPU interpreter cannot run), and transformers' torch Gated DeltaNet (Qwen3-Next's
fallback without fla, what ``kernelize`` replaces) up to T = 4k. Forward+backward is one forward and the
backward of a random cotangent, every input requiring grad. Reports time, tokens/s, ratios, the
length from which Gated DeltaNet is faster than attention, and ours vs the naive recurrence.

Then Kimi Delta Attention at Kimi Linear's sizes (H = 32, K = V = 128): ``chunk_kda`` (on CUDA
Triton's kernels, and the reference backend up to T = 4k) against transformers' torch version of
Kimi Linear's chunked KDA (its fallback without fla) and fla's ``chunk_kda`` where it imports
(CUDA), forward and forward+backward, with the time ratios from one run; and each one's error
against the float64 step-by-step recurrence under weak, strong (-5 to -20 per step on a quarter of
the channels) and resetting (-inf) per-channel decays.
Writes ``linear_attention{-quick,-gpu,}.{md,json,png}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import (NOT_MEASURED, all_met, cuda_missing, family_parser, goal_result,  # noqa: E402
                    machine_line, markdown_table, seconds_per_call)

import torch_kernels  # noqa: E402
from torch_kernels import backends  # noqa: E402
from torch_kernels.reference.linear_attention import recurrence_naive  # noqa: E402

HEADS, HEAD_SIZE = 16, 128
KDA_HEADS = 32  # Kimi Linear's linear-attention heads (head size 128)
KDA_REFERENCE = "ours: chunk_kda, reference backend"
KDA_REFERENCE_MAX_T = 4096  # bounds the GPU step's time: a Python loop over chunks, autograd through it
K = 1024

BENCHMARK = {  # for the scripts that run or summarize every family (common.family_benchmarks)
    "gpu_step": {"position": 40, "cap_s": 150, "autotuned": True},  # fla's kernels autotune on their first calls
    "summary_position": 20,
    "summary_goals": [["Gated DeltaNet vs fla", "forward+backward at least as fast as fla's for T >= 4k"]],
    "quick_compile_group": "linear_attention-K64",
    "bench": True,
}


def inputs(length: int, device, dtype, seed=0):
    """Gated DeltaNet inputs ``[1, T, H, D]`` as a model feeds them (normalized keys, decays near 1)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, length, HEADS, HEAD_SIZE)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    k = F.normalize(k, dim=-1)
    g = -0.05 * torch.rand(1, length, HEADS, generator=gen)
    beta = torch.rand(1, length, HEADS, generator=gen)
    return {n: t.to(device, dtype if n in "qkv" else torch.float32) for n, t in
            dict(q=q, k=k, v=v, g=g, beta=beta).items()}


def ours_delta(x):
    return torch_kernels.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])[0]


def ours_gla(x):
    return torch_kernels.chunk_simple_gla(x["q"], x["k"] * HEAD_SIZE ** -0.5, x["v"], x["g"])[0]


def sdpa(x):
    q, k, v = (x[n].transpose(1, 2) for n in "qkv")
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


TRANSFORMERS_GDN = "transformers torch gated delta rule"
TRANSFORMERS_GDN_MAX_T = 4096  # a Python loop over chunks; the drop-in comparison needs no more


def transformers_delta():
    """transformers' torch Gated DeltaNet (Qwen3-Next's fallback without fla), what kernelize's
    drop-in replaces on CPU; None when it does not import."""
    try:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
    except Exception:  # an older transformers without Qwen3-Next
        return None
    return lambda x: torch_chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])[0]


def fla_implementations():
    """fla's chunked ops, or the reason they are left out."""
    if not torch.cuda.is_available():
        return {}, "fla: left out on CPU (its Triton kernels autotune, which the interpreter cannot run)"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # ImportError, or a build for another torch raising anything
        return {}, f"fla: does not import here ({type(e).__name__}: {e})"
    return {
        "fla gated delta rule": lambda x: chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])[0],
        "fla simple gla": lambda x: chunk_simple_gla(x["q"], x["k"] * HEAD_SIZE ** -0.5, x["v"], x["g"])[0],
    }, None


def kda_inputs(length: int, device, dtype, heads=KDA_HEADS, decay="weak", seed=0):
    """KDA inputs ``[1, T, H, 128]`` as Kimi Linear feeds them (the op l2-normalizes q and k), with a
    per-channel decay ``g [1, T, H, 128]``: "weak" (-0.05..0), "strong" (a quarter of the channels
    -5..-20 per step) or "reset" (weak, and -inf on a quarter of the channels at one step)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, length, heads, HEAD_SIZE)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    g = -0.05 * torch.rand(shape, generator=gen)
    if decay == "strong":
        strong = torch.rand(heads, HEAD_SIZE, generator=gen) < 0.25
        g = torch.where(strong, -5.0 - 15.0 * torch.rand(shape, generator=gen), g)
    if decay == "reset":
        g[0, length // 3] = torch.where(torch.rand(heads, HEAD_SIZE, generator=gen) < 0.25, float("-inf"), 0.0)
    beta = torch.rand(1, length, heads, generator=gen)
    return {n: t.to(device, dtype if n in "qkv" else torch.float32) for n, t in
            dict(q=q, k=k, v=v, g=g, beta=beta).items()}


def ours_kda(implementation=None):
    """chunk_kda as Kimi Linear calls it, on ``implementation`` (None: the default backend)."""
    return lambda x: torch_kernels.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True,
                                             implementation=implementation)[0]


def kda_implementations(device):
    """{name: fn(inputs) -> o} for ours (the device's default backend; on CUDA, where that is
    Triton's chunked kernels, the reference backend too, up to ``KDA_REFERENCE_MAX_T``) and the peers
    that import here, and notes on those left out."""
    impls = {"ours: chunk_kda": ours_kda()}
    if device.type == "cuda":
        impls[KDA_REFERENCE] = ours_kda("reference")
    notes = []
    try:
        import inspect

        from transformers.models.kimi_linear import modeling_kimi_linear
        # the module-level name is a hub-kernel wrapper that picks fla where it imports: take the torch function
        wrapper = type(modeling_kimi_linear.chunk_kimi_delta_attention).forward
        torch_version = inspect.unwrap(inspect.getclosurevars(wrapper).nonlocals["func"])
        impls["transformers torch KDA"] = lambda x: torch_version(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                                                  use_qk_l2norm_in_kernel=True)[0]
    except Exception as e:  # an older transformers without Kimi Linear, or another wrapping
        notes.append(f"transformers' torch KDA: left out ({type(e).__name__}: {e})")
    if torch.cuda.is_available():
        try:
            from fla.ops.kda import chunk_kda as fla_chunk_kda
            impls["fla chunk_kda"] = lambda x: fla_chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                             use_qk_l2norm_in_kernel=True)[0]
        except Exception as e:
            notes.append(f"fla: does not import here ({type(e).__name__}: {e})")
    else:
        notes.append("fla: left out on CPU (its Triton kernels autotune, which the interpreter cannot run)")
    return impls, notes


def kda_section(lengths, device, dtype, budget, sync, heads=KDA_HEADS):
    """(markdown, rows, errors): KDA timings with ratios to ours, and errors against the recurrence."""
    impls, notes = kda_implementations(device)
    rows = []
    for length in lengths:
        x = kda_inputs(length, device, dtype, heads=heads)
        for impl, fn in impls.items():
            if impl == KDA_REFERENCE and length > KDA_REFERENCE_MAX_T:
                continue
            fwd, fwd_bwd = timed(fn, x, False, budget, sync), timed(fn, x, True, budget, sync)
            rows.append({"impl": impl, "T": length, "fwd_s": fwd, "fwd_bwd_s": fwd_bwd})
            print(f"  KDA T={length:6d} {impl:24s} fwd {fwd * 1e3:9.1f} ms  fwd+bwd {fwd_bwd * 1e3:9.1f} ms",
                  flush=True)
    table = []
    for r in rows:
        ours = next(p for p in rows if p["T"] == r["T"] and p["impl"] == "ours: chunk_kda")
        table.append([r["T"], r["impl"], f"{r['fwd_s'] * 1e3:,.1f}", f"{r['fwd_bwd_s'] * 1e3:,.1f}",
                      f"{r['fwd_s'] / ours['fwd_s']:.2f}x", f"{r['fwd_bwd_s'] / ours['fwd_bwd_s']:.2f}x"])
    errors = {}
    for decay in ("weak", "strong", "reset"):
        x = kda_inputs(256, device, dtype, heads=2, decay=decay, seed=1)
        want, _ = recurrence_naive(*(x[n].double().cpu() for n in ("q", "k", "v", "g", "beta")), HEAD_SIZE ** -0.5,
                                   use_qk_l2norm=True)
        for impl, fn in impls.items():
            got = fn(x).double().cpu()
            error = (got - want).square().mean().sqrt() / want.square().mean().sqrt()
            errors[f"{impl}, {decay} decay"] = error.item()
    out = [f"\n## Kimi Delta Attention\n\nB = 1, H = {heads}, K = V = {HEAD_SIZE}, g per channel, l2 norm in "
           "the op; "
           f"ours ran on the `{backends.last_backend('chunk_kda')}` backend. The last two columns: this one's time "
           "over ours (above 1x: ours is faster).\n",
           markdown_table(["T", "impl", "fwd ms", "fwd+bwd ms", "time / ours (fwd)", "time / ours (fwd+bwd)"], table),
           "\nRelative RMSE of the output against the float64 step-by-step recurrence (T = 256, H = 2; strong: "
           "a quarter of the channels -5 to -20 per step; reset: -inf on a quarter of the channels at one step, "
           "which zeroes those rows of the state):\n",
           markdown_table(["impl, decay", "relative RMSE"], [[n, f"{e:.1e}"] for n, e in errors.items()])]
    if notes:
        out.append("\n" + "; ".join(notes) + ".")
    return "\n".join(out), rows, errors


def timed(fn, x, backward: bool, budget_s: float, sync) -> float:
    if not backward:
        def call():
            with torch.no_grad():
                fn(x)
        return seconds_per_call(call, budget_s, sync)
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    cotangent = torch.randn_like(x["v"])

    def call():
        for t in leaves.values():
            t.grad = None
        fn(leaves).backward(cotangent)
    return seconds_per_call(call, budget_s, sync)


def accuracy(device, dtype, length: int = 1 * K) -> float:
    """Relative RMSE of our Gated DeltaNet output against the naive float64 recurrence."""
    x = inputs(length, device, dtype, seed=1)
    want, _ = recurrence_naive(*(x[n].double().cpu() for n in ("q", "k", "v", "g", "beta")), HEAD_SIZE ** -0.5)
    got = ours_delta(x).double().cpu()
    return ((got - want).square().mean().sqrt() / want.square().mean().sqrt()).item()


def crossover(rows, ours: str, peer: str, key: str):
    """The shortest measured length from which ``ours`` is faster than ``peer`` at every longer one."""
    lengths = sorted({r["T"] for r in rows})
    found = None
    for t in reversed(lengths):
        a = next((r[key] for r in rows if r["T"] == t and r["impl"] == ours), None)
        b = next((r[key] for r in rows if r["T"] == t and r["impl"] == peer), None)
        if a is None or b is None or a > b:
            break
        found = t
    return found


def plot(rows, impls, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, title in zip(axes, ("fwd_s", "fwd_bwd_s"), ("forward", "forward + backward")):
        for impl in impls:
            points = [(r["T"], r[key] * 1e3) for r in rows if r["impl"] == impl and r[key]]
            if points:
                ax.plot(*zip(*points), marker="o", label=impl, linestyle="--" if "sdpa" in impl else "-")
        ax.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel="ms per call",
               title=f"{title}, B=1, H={HEADS}, D={HEAD_SIZE}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def gpu_goals(data: dict) -> list:
    """BENCHMARK's summary goal from ``linear_attention-gpu.json``: fla's forward+backward time over ours
    at each length from 4k."""
    rows = data["rows"]
    ratios = []
    for t in sorted({r["T"] for r in rows if r["T"] >= 4 * K}):
        ours = next((r for r in rows if r["T"] == t and r["impl"] == "ours: gated delta rule"), None)
        fla = next((r for r in rows if r["T"] == t and r["impl"] == "fla gated delta rule"), None)
        if ours and fla and ours["fwd_bwd_s"] and fla["fwd_bwd_s"]:
            ratios.append((t, fla["fwd_bwd_s"] / ours["fwd_bwd_s"]))
    if not ratios:
        return [goal_result(None, NOT_MEASURED, data.get("fla") if data.get("fla") != "timed"
                            else "no length >= 4k measured")]
    return [goal_result(f"{min(r for _, r in ratios):.2f}x fla's speed (worst)", all_met([r for _, r in ratios], 1.0),
                        "; ".join(f"T = {t // K}k: {r:.2f}x" for t, r in ratios))]


def main(argv=None) -> int:
    parser = family_parser(__doc__.splitlines()[0], quick="T = 1k and 2k only (a smoke test)",
                           gpu="benchmarks/gpu.sh's lengths (with --device cpu: tiny, its dry run); writes -gpu files")
    args = parser.parse_args(argv)
    if cuda_missing(args.device):
        return 2
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else None
    if args.gpu:  # the goal is at T >= 4k
        lengths = (1 * K, 4 * K, 16 * K) if cuda else (64, 128)
    else:
        lengths = (1 * K, 2 * K) if args.quick else (1 * K, 2 * K, 4 * K, 8 * K, 16 * K)
    budget = args.budget or (0.1 if cuda and args.gpu else 0.02 if args.gpu else 0.1 if args.quick else 0.5)
    fla, fla_note = fla_implementations()
    impls = {"ours: gated delta rule": ours_delta, "ours: simple gla": ours_gla, "sdpa causal": sdpa, **fla}
    if (peer := transformers_delta()) is not None:
        impls[TRANSFORMERS_GDN] = peer

    print(f"# linear attention benchmark: {machine_line()}, {device}, {dtype}", flush=True)
    rows = []
    for length in lengths:
        x = inputs(length, device, dtype)
        for impl, fn in list(impls.items()):
            if impl not in impls or (impl == TRANSFORMERS_GDN and length > TRANSFORMERS_GDN_MAX_T):
                continue  # a peer dropped at this length
            try:
                fwd, fwd_bwd = timed(fn, x, False, budget, sync), timed(fn, x, True, budget, sync)
            except Exception as e:  # a peer that refuses here (fla on some Triton versions) leaves its columns out
                if impl not in fla:
                    raise
                fla, fla_note = {}, f"fla: left out, it failed here ({type(e).__name__}: {str(e)[:300]})"
                impls = {name: f for name, f in impls.items() if not name.startswith("fla")}
                rows = [r for r in rows if not r["impl"].startswith("fla")]
                print(f"  {fla_note}", flush=True)
                continue
            rows.append({"impl": impl, "T": length, "fwd_s": fwd, "fwd_bwd_s": fwd_bwd})
            print(f"  T={length:6d} {impl:24s} fwd {fwd * 1e3:9.1f} ms  fwd+bwd {fwd_bwd * 1e3:9.1f} ms", flush=True)
    backend = backends.last_backend("chunk_gated_delta_rule")
    accuracy_length = 128 if args.gpu and not cuda else 1 * K
    error = accuracy(device, dtype, accuracy_length)

    header = ["T", "impl", "fwd ms", "fwd tokens/s", "fwd+bwd ms", "fwd+bwd tokens/s", "sdpa / this (fwd)",
              "sdpa / this (fwd+bwd)"]
    table = []
    for r in rows:
        peer = next(p for p in rows if p["T"] == r["T"] and p["impl"] == "sdpa causal")
        table.append([f"{r['T'] // K}k", r["impl"], f"{r['fwd_s'] * 1e3:,.1f}", f"{r['T'] / r['fwd_s']:,.0f}",
                      f"{r['fwd_bwd_s'] * 1e3:,.1f}", f"{r['T'] / r['fwd_bwd_s']:,.0f}",
                      f"{peer['fwd_s'] / r['fwd_s']:.2f}x", f"{peer['fwd_bwd_s'] / r['fwd_bwd_s']:.2f}x"])
    out = [f"# Linear attention benchmark\n\n{machine_line()}; device {device}, {dtype}"
           + (" (--quick)" if args.quick else ""),
           f"\nB = 1, H = {HEADS}, K = V = {HEAD_SIZE}; ours ran on the `{backend}` backend. Time per call: the "
           f"fastest block of calls in {budget} s (a call slower than that is timed once). Above 1x in the "
           "last two columns: faster than causal attention.\n", markdown_table(header, table)]
    bullets = []
    for key, what in (("fwd_s", "forward"), ("fwd_bwd_s", "forward+backward")):
        for ours in ("ours: gated delta rule", "ours: simple gla"):
            t = crossover(rows, ours, "sdpa causal", key)
            bullets.append(f"- {what}: {ours} is faster than causal attention "
                           + (f"from T = {t // K}k on (at every measured length from there)." if t else
                              "at none of the measured lengths (or not at every longer one)."))
    for r in (r for r in rows if r["impl"] == TRANSFORMERS_GDN):
        a = next(o for o in rows if o["T"] == r["T"] and o["impl"] == "ours: gated delta rule")
        bullets.append(f"- T = {r['T'] // K}k: transformers' torch / ours, gated delta rule: forward "
                       f"{r['fwd_s'] / a['fwd_s']:.2f}x, forward+backward {r['fwd_bwd_s'] / a['fwd_bwd_s']:.2f}x "
                       "(above 1x: ours is faster)")
    for t in lengths if fla else ():
        a = next(r for r in rows if r["T"] == t and r["impl"] == "ours: gated delta rule")
        b = next(r for r in rows if r["T"] == t and r["impl"] == "fla gated delta rule")
        bullets.append(f"- T = {t // K}k: fla / ours, gated delta rule forward+backward: "
                       f"{b['fwd_bwd_s'] / a['fwd_bwd_s']:.2f}x (above 1x: ours is faster)")
    out.append("\n" + "\n".join(bullets))
    if fla_note:
        out.append(f"\n{fla_note}.")
    out.append(f"\nOurs against the naive float64 recurrence at T = {accuracy_length}: relative RMSE {error:.1e} "
               "(output).")
    if args.gpu:
        kda_lengths = (1 * K, 4 * K, 16 * K) if cuda else (64,)
    else:
        kda_lengths = (512,) if args.quick else (512, 1 * K)
    kda_heads = 2 if args.gpu and not cuda else KDA_HEADS  # the GPU script's dry run: tiny
    kda_report, kda_rows, kda_errors = kda_section(kda_lengths, device, dtype, budget, sync, kda_heads)
    out.append(kda_report)
    report = "\n".join(out) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-gpu" if args.gpu else ("-quick" if args.quick else "") + ("-cuda" if cuda else "")
    (args.out / f"linear_attention{suffix}.md").write_text(report)
    (args.out / f"linear_attention{suffix}.json").write_text(json.dumps(
        {"machine": machine_line(), "device": str(device), "backend": backend, "rows": rows, "fla": fla_note or "timed",
         "relative_rmse_vs_naive": error, "kda_rows": kda_rows, "kda_relative_rmse_vs_naive": kda_errors},
        indent=1))
    try:
        plot(rows, list(impls), args.out / f"linear_attention{suffix}.png")
    except ImportError as e:  # matplotlib is in the [bench] extra: the tables still stand
        print(f"plot: {e}", file=sys.stderr)
    print(report)
    print(f"written: {args.out}/linear_attention{suffix}.md, .json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

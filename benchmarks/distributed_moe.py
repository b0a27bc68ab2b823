"""Distributed MoE: dispatch/combine over torch.distributed, the disaggregated runner, and a model
of FFN batch size and utilization against context length and the M:N ratio.

    python benchmarks/distributed_moe.py [--quick]

1. **Exchange.** ``moe_dispatch``/``moe_combine`` with a process group of 2 and 4 ranks (one
   process each, gloo over loopback; 4 ranks on this 2-core machine share the cores), token rows
   of DeepSeek-V3 (H 7168, E 256, top-8) and Qwen3-30B-A3B (H 2048, E 128, top-8) in bfloat16,
   uniformly random routing, exact vs fixed-capacity vs fp8 dispatch. Latency is the slowest
   rank's, per call (the fastest of the repeats); GB/s is the bytes a rank sends to *other* ranks
   (its rows for remote experts; fixed capacity sends its whole buffers) over that latency.
2. **Disaggregated runner.** A small Qwen3-MoE (random weights) served with M attention ranks and
   N FFN ranks: step time and each rank's busy fraction with one microbatch and with two
   (ping-pong), and a per-rank timeline PNG.
3. **Model.** Decode batch per attention device is capped by its KV memory, so the experts' rows
   per expert shrink as context grows; disaggregation gathers M attention devices' tokens into one
   expert batch. A roofline (utilization = min(1, rows per expert / ridge)) gives FFN utilization
   against context and M:N on an H200; the roofline itself is checked against ``fused_moe``
   timings on this machine.

Writes ``distributed_moe{-quick,}.{md,json,png}`` and ``distributed_moe_timeline{-quick,}.png`` to
``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, machine_line, markdown_table, seconds_per_call  # noqa: E402

import torch_kernels  # noqa: E402
from torch_kernels.distributed import exchange  # noqa: E402
from torch_kernels.distributed.launch import run_local  # noqa: E402

MODELS = {"DeepSeek-V3": (7168, 256, 8), "Qwen3-30B-A3B": (2048, 128, 8)}  # H, E, k
MODES = ("exact", "fixed capacity", "fp8")
DTYPE = torch.bfloat16


# ------------------------------------------------------------------------------- 1. exchange

def _mode_kwargs(mode: str, tokens: int) -> dict:
    return {"exact": {}, "fixed capacity": {"max_tokens_per_rank": tokens},
            "fp8": {"dispatch_dtype": torch.float8_e4m3fn}}[mode]


def _row_bytes(mode: str, hidden: int) -> int:
    return hidden + 4 * math.ceil(hidden / exchange.FP8_BLOCK) if mode == "fp8" else hidden * DTYPE.itemsize


def exchange_worker(rank, world, cases, repeats):
    """Per case: (dispatch seconds, combine seconds, bytes sent off-rank), slowest rank's."""
    group = dist.group.WORLD
    out = []
    for model, tokens, mode in cases:
        hidden, experts, k = MODELS[model]
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(tokens, hidden, generator=gen).to(DTYPE)
        ids = torch.rand(tokens, experts, generator=gen).topk(k, dim=-1).indices.to(torch.int32)
        weights = torch.rand(tokens, k, generator=gen).softmax(-1)
        kwargs = _mode_kwargs(mode, tokens)
        times = []
        with torch.no_grad():
            for _ in range(repeats + 1):  # the first call is not timed
                dist.barrier(group)
                start = time.perf_counter()
                rows, offsets, handle = torch_kernels.moe_dispatch(x, ids, experts, group=group, **kwargs)
                middle = time.perf_counter()
                torch_kernels.moe_combine(rows, handle, weights)
                times.append((middle - start, time.perf_counter() - middle))
        local = handle.layout.local_experts()
        owner = ids.long() // (experts // world)
        if mode == "fixed capacity":
            sent_rows = (world - 1) * tokens * k
        else:
            sent_rows = int((owner != rank).sum())
        slowest = torch.tensor(times[1:] + [(sent_rows * _row_bytes(mode, hidden), 0.0)], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        dispatch, combine = slowest[:-1, 0].min().item(), slowest[:-1, 1].min().item()
        out.append({"model": model, "tokens": tokens, "mode": mode, "world": world, "dispatch_s": dispatch,
                    "combine_s": combine, "dispatch_bytes": slowest[-1, 0].item(), "local_experts": len(local)})
    return out


def measure_exchange(quick: bool) -> list[dict]:
    tokens = (64,) if quick else (128, 512)
    worlds = (2,) if quick else (2, 4)
    repeats = 2 if quick else 5
    cases = [(m, t, mode) for m in MODELS for t in tokens for mode in MODES]
    rows = []
    for world in worlds:
        rows += run_local(exchange_worker, world, cases, repeats, timeout=600)[0]
    for row in rows:
        # combine returns the same rows in the activation dtype (fp8 dispatches return bfloat16)
        combine_bytes = row["dispatch_bytes"] / _row_bytes(row["mode"], MODELS[row["model"]][0]) * \
            _row_bytes("exact", MODELS[row["model"]][0])
        row["dispatch_gbs"] = row["dispatch_bytes"] / row["dispatch_s"] / 1e9
        row["combine_gbs"] = combine_bytes / row["combine_s"] / 1e9
    return rows


def exchange_table(rows: list[dict]) -> str:
    header = ["model", "ranks", "T per rank", "mode", "dispatch ms", "dispatch GB/s", "combine ms", "combine GB/s"]
    body = [[r["model"], r["world"], r["tokens"], r["mode"], f"{r['dispatch_s'] * 1e3:.2f}", f"{r['dispatch_gbs']:.2f}",
             f"{r['combine_s'] * 1e3:.2f}", f"{r['combine_gbs']:.2f}"] for r in rows]
    return markdown_table(header, body)


# --------------------------------------------------------------------- 2. disaggregated runner

RUNNER_MODEL = dict(vocab_size=1024, hidden_size=512, head_dim=64, num_attention_heads=8, num_key_value_heads=4,
                    intermediate_size=1024, moe_intermediate_size=512, num_hidden_layers=4, num_experts=16,
                    num_experts_per_tok=4)
RUNNER_PROMPTS = {False: ((2, 128), 4), True: ((2, 32), 2)}  # quick: (prompts, tokens each) per attention rank, new tokens


def _runner_model():
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                         attn_implementation="sdpa", **RUNNER_MODEL)
    return transformers.Qwen3MoeForCausalLM(config).float().eval()


def runner_worker(rank, world, num_attention, prompt_shape, new_tokens):
    """Per microbatch count: (seconds for the prefill and decode steps, this rank's event log)."""
    from torch_kernels.distributed import disaggregated

    layout = disaggregated.make_attention_ffn_layout(num_attention, world - num_attention)
    prompts = torch.randint(0, RUNNER_MODEL["vocab_size"], prompt_shape, generator=torch.Generator().manual_seed(rank))
    out = {}
    for microbatches in (1, 2, 1, 2):  # twice each: the first of each is a warm-up
        model, log = _runner_model(), disaggregated.EventLog()  # the runner takes the model's experts apart
        dist.barrier()
        start = time.perf_counter()
        disaggregated.run_disaggregated(model, layout, prompts if rank < num_attention else None, new_tokens,
                                        microbatches=microbatches, event_log=log)
        dist.barrier()
        out[microbatches] = (time.perf_counter() - start, log.events)
    return out


def _total(events, kind: str) -> float:
    return sum(end - start for name, start, end in events if name.split(" ", 1)[0] == kind)


def measure_runner(quick: bool) -> tuple[list[dict], dict]:
    """Rows of the runner table, and the event logs of the timeline run."""
    from torch_kernels.distributed import disaggregated

    layouts = ((1, 1),) if quick else ((1, 1), (2, 1))
    prompt_shape, new_tokens = RUNNER_PROMPTS[quick]
    rows, timeline = [], None
    for m, n in layouts:
        results = run_local(runner_worker, m + n, m, prompt_shape, new_tokens, timeout=600, threads=1)
        for microbatches in (1, 2):
            seconds = max(r[microbatches][0] for r in results)
            logs = [r[microbatches][1] for r in results]
            busy = disaggregated.busy_fractions(logs)
            attention = max(_total(logs[r], "attention") for r in range(m))
            experts = max(_total(logs[r], "experts") for r in range(m, m + n))
            rows.append({"M": m, "N": n, "microbatches": microbatches, "seconds": seconds,
                         "attention_busy": [busy[r] for r in range(m)], "ffn_busy": [busy[r] for r in range(m, m + n)],
                         "attention_s": attention, "experts_s": experts,
                         # serial: the two sides take turns; ping-pong with b microbatches hides all
                         # but one microbatch's worth of the shorter side (fill and drain)
                         "predicted_serial_s": attention + experts,
                         "predicted_overlap_s": max(attention, experts) + min(attention, experts) / microbatches})
            if (m, n, microbatches) == (layouts[-1] + (2,)):
                timeline = {"logs": logs, "labels": [f"attention {r}" for r in range(m)] + [f"FFN {r}" for r in range(n)]}
    return rows, timeline


def runner_table(rows: list[dict]) -> str:
    body = [[f"{r['M']}:{r['N']}", r["microbatches"], f"{r['seconds'] * 1e3:.0f}",
             " ".join(f"{b:.0%}" for b in r["attention_busy"]), " ".join(f"{b:.0%}" for b in r["ffn_busy"]),
             f"{r['attention_s'] * 1e3:.0f}", f"{r['experts_s'] * 1e3:.0f}",
             f"{(r['predicted_serial_s'] if r['microbatches'] == 1 else r['predicted_overlap_s']) * 1e3:.0f}"]
            for r in rows]
    return markdown_table(["M:N", "microbatches", "generation ms", "attention ranks busy", "FFN ranks busy",
                           "attention compute ms", "expert compute ms", "model ms (serial / ping-pong)"], body)


# ---------------------------------------------------------------------------------- 3. model

H200 = {"name": "H200", "peak_flops": 790e12, "bandwidth": 4.3e12, "memory": 141e9}
QWEN3_30B = {  # Qwen3-30B-A3B: 48 layers, GQA 4 KV heads of 128, experts 128 x (2048 -> 768), top-8
    "layers": 48, "kv_bytes_per_token": 48 * 2 * 4 * 128 * 2, "experts": 128, "top_k": 8,
    "expert_bytes": 48 * 128 * 3 * 2048 * 768 * 2, "dense_bytes": 2 * 1.5e9,  # attention, embeddings, head
}


def ffn_utilization(rows_per_expert: float, device: dict) -> float:
    """Roofline of an expert GEMM in bfloat16 whose weights are read once: ``2 m`` FLOPs per two
    weight bytes, so ``m`` FLOP/byte against a ridge of ``peak / bandwidth``."""
    return min(1.0, rows_per_expert / (device["peak_flops"] / device["bandwidth"]))


def decode_batch(context: int, kv_memory: float, model: dict) -> int:
    return max(1, int(kv_memory // (context * model["kv_bytes_per_token"])))


def model_rows(contexts, device=H200, model=QWEN3_30B, colocated: int = 8, splits=((8, 1), (16, 2), (32, 4))) -> list[dict]:
    """Per context: FFN rows per expert per layer and the roofline utilization they allow.

    Colocated expert parallelism over ``colocated`` devices: each keeps 90% of its memory, less
    its slice of the experts and the dense weights, for KV; every device's decode batch reaches
    every expert. Disaggregated M:N: the M attention devices keep all but the dense weights for KV,
    the N FFN devices hold the experts (which must fit), and each expert sees the M attention
    devices' batches. Rows per expert = devices pooled x decode batch x top-k / experts."""
    usable = 0.9 * device["memory"]
    out = []
    for context in contexts:
        batch = decode_batch(context, usable - model["expert_bytes"] / colocated - model["dense_bytes"], model)
        m = colocated * batch * model["top_k"] / model["experts"]
        row = {"context": context, "colocated_batch": batch, "colocated_rows_per_expert": m,
               "colocated_utilization": ffn_utilization(m, device)}
        for attn, ffn in splits:
            assert model["expert_bytes"] / ffn <= usable, "the experts must fit the FFN devices"
            batch = decode_batch(context, usable - model["dense_bytes"], model)
            m = attn * batch * model["top_k"] / model["experts"]
            row[f"{attn}:{ffn}"] = {"batch": batch, "rows_per_expert": m, "utilization": ffn_utilization(m, device)}
        out.append(row)
    return out


def roofline_check(quick: bool) -> dict:
    """Fit this machine's expert-GEMM roofline (peak FLOP/s and weight-read bandwidth) from
    ``fused_moe`` timings at growing rows per expert, then report each point's measured time
    against the fitted roofline's prediction."""
    experts, hidden, inter = 8, 1024, 512
    gen = torch.Generator().manual_seed(0)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen).to(DTYPE)
    w2 = torch.randn(experts, hidden, inter, generator=gen).to(DTYPE)
    points = []
    for m in ((1, 8, 64) if quick else (1, 4, 16, 64, 256)):
        tokens = m * experts
        x = torch.randn(tokens, hidden, generator=gen).to(DTYPE)
        ids = torch.arange(tokens, dtype=torch.int32)[:, None] % experts  # exactly m rows per expert
        weights = torch.ones(tokens, 1)
        with torch.no_grad():
            seconds = seconds_per_call(lambda: torch_kernels.fused_moe(x, w13, w2, weights, ids), 0.2 if quick else 0.5)
        points.append({"rows_per_expert": m, "seconds": seconds,
                       "flops": 6 * tokens * hidden * inter, "weight_bytes": 3 * experts * hidden * inter * 2})
    # A CPU does not overlap reading weights with arithmetic the way a GPU's roofline assumes,
    # so the fit here is additive: a weight-read time (from the smallest m) plus a FLOP time
    # (from the largest); the points between say how far that simple model is off.
    first, last = points[0], points[-1]
    per_flop = (last["seconds"] - first["seconds"]) / (last["flops"] - first["flops"])
    read_s = first["seconds"] - first["flops"] * per_flop
    for p in points:
        p["predicted_s"] = read_s + p["flops"] * per_flop
        p["error"] = p["seconds"] / p["predicted_s"] - 1
    return {"bandwidth": first["weight_bytes"] / read_s, "peak_flops": 1 / per_flop, "points": points}


def model_table(rows: list[dict]) -> str:
    splits = [key for key in rows[0] if ":" in key]
    header = ["context", "colocated batch/dev", "colocated rows/expert", "colocated FFN util"]
    for s in splits:
        header += [f"{s} batch/attn dev", f"{s} rows/expert", f"{s} FFN util"]
    body = []
    for r in rows:
        line = [f"{r['context'] // 1024}k", r["colocated_batch"], f"{r['colocated_rows_per_expert']:.1f}",
                f"{r['colocated_utilization']:.1%}"]
        for s in splits:
            line += [r[s]["batch"], f"{r[s]['rows_per_expert']:.1f}", f"{r[s]['utilization']:.1%}"]
        body.append(line)
    return markdown_table(header, body)


def roofline_table(check: dict) -> str:
    body = [[p["rows_per_expert"], f"{p['seconds'] * 1e3:.2f}", f"{p['predicted_s'] * 1e3:.2f}", f"{p['error']:+.0%}",
             f"{p['flops'] / p['seconds'] / 1e9:.1f}"] for p in check["points"]]
    return markdown_table(["rows per expert", "measured ms", "model ms", "measured / model - 1", "GFLOP/s"],
                          body)


# ------------------------------------------------------------------------------------ output

def plot(exchange_rows: list[dict], model: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [f"{r['model'].split('-')[0]} {r['world']}r T{r['tokens']}" for r in exchange_rows if r["mode"] == "exact"]
    width = 0.27
    for i, mode in enumerate(MODES):
        values = [r["dispatch_gbs"] for r in exchange_rows if r["mode"] == mode]
        right_positions = [j + (i - 1) * width for j in range(len(values))]
        left.bar(right_positions, values, width, label=mode)
    left.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    left.set_ylabel("dispatch GB/s (bytes sent off-rank)")
    left.set_title("dispatch over gloo (loopback)")
    left.legend()
    contexts = [r["context"] / 1024 for r in model]
    right.plot(contexts, [r["colocated_utilization"] for r in model], "o-", label="colocated EP over 8 devices")
    for key in [k for k in model[0] if ":" in k]:
        right.plot(contexts, [r[key]["utilization"] for r in model], "o-", label=f"disaggregated {key}")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("context (k tokens)")
    right.set_ylabel("FFN utilization (roofline)")
    right.set_title("Qwen3-30B-A3B decode on H200s (model)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    stem = RESULTS / ("distributed_moe-quick" if args.quick else "distributed_moe")

    RESULTS.mkdir(parents=True, exist_ok=True)
    timeline_path = RESULTS / f"{stem.name}_timeline.png"
    started = time.perf_counter()
    exchange_rows = measure_exchange(args.quick)
    print(exchange_table(exchange_rows), flush=True)
    runner_rows, timeline = measure_runner(args.quick)
    print(runner_table(runner_rows), flush=True)
    model = model_rows([1024, 4096, 16384, 65536, 131072])
    check = roofline_check(args.quick)
    sections = [
        f"# Distributed MoE\n\n{machine_line()}; {time.perf_counter() - started:.0f} s.\n",
        "## Dispatch and combine (gloo, loopback)\n\n" + exchange_table(exchange_rows),
        ("## Disaggregated runner (Qwen3-MoE, random weights: H 512, 4 layers, 16 experts, top-4; "
         f"{RUNNER_PROMPTS[args.quick][0][0]} prompts of {RUNNER_PROMPTS[args.quick][0][1]} tokens per attention rank, "
         f"prefill and {RUNNER_PROMPTS[args.quick][1] - 1} decode steps; one process per rank on this machine's cores)\n\n" + runner_table(runner_rows)
         + f"\n\nTimeline of the last 2-microbatch run: `{timeline_path.name}`."),
        "## FFN rows per expert and utilization against context (model: Qwen3-30B-A3B decode on H200s)\n\n" + model_table(model),
        ("## The roofline checked on this machine\n\n``fused_moe`` (bfloat16, E 8, H 1024, I 512) at exactly m rows "
         f"per expert; fitted weight bandwidth {check['bandwidth'] / 1e9:.1f} GB/s, peak "
         f"{check['peak_flops'] / 1e9:.1f} GFLOP/s (time = weight bytes / bandwidth + FLOPs / peak).\n\n"
         + roofline_table(check)),
    ]
    text = "\n\n".join(sections) + "\n"
    from torch_kernels.distributed import disaggregated

    disaggregated.timeline_png(timeline["logs"], timeline_path, labels=timeline["labels"],
                               title="attention-FFN ping-pong, 2 microbatches")
    print(text)
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps(
        {"machine": machine_line(), "exchange": exchange_rows, "runner": runner_rows, "model": model,
         "roofline_check": check}, indent=1))
    plot(exchange_rows, model, stem.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

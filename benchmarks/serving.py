"""Paged attention in a vLLM-style server: one layer of a CPU serving step, ours against vLLM's CPU attention.

    python benchmarks/serving.py [--quick] [--threads N] [--budget S] [--out DIR]

Times what a vLLM-style server pays per layer and step on the CPU, on SmolLM2-135M's heads (Hq 9,
Hkv 3, D 64, block 16) in float32 and bfloat16: the step's new keys and values written and the
batch attended (one fused ``ragged_paged_attention`` call, the op's checks included), for decode
batches and chunked-prefill batches, on a vLLM-style cache tensor per layer (the halves of
``[num_blocks, block_size, Hkv, 2 * D]``, NHD, and of ``[num_blocks, Hkv, block_size, 2 * D]``,
HND). The peer, where vLLM imports (run it with the Python of ``scripts/setup_vllm.sh``'s
environment), is vLLM's own CPU attention on its own cache layout: ``cpu_attn_reshape_and_cache`` +
``cpu_attention_with_kv_cache``, its per-step scheduler metadata built outside the timing. With one
thread (``--threads 1``, the default) a call's time is the CPU time of that thread, which other
processes on a shared machine do not inflate; with more, the wall clock. Writes
``paged_attention-serving{-quick,}.{md,json}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pathlib
import random
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, machine_line, markdown_table, seconds_per_call  # noqa: E402

import torch_kernels  # noqa: E402

SERVING_HEADS = (9, 3, 64)  # SmolLM2-135M: Hq, Hkv, D
SERVING_BLOCK = 16


def serving_steps(quick: bool) -> list:
    """(label, q_lens, kv_lens) of one step's batch: decodes with 100-1000 tokens of context, and
    chunked prefill (prompt chunks of 32-256 tokens beside decodes)."""
    rng = random.Random(0)
    steps = []
    for seqs in (8,) if quick else (8, 32):
        steps.append((f"decode {seqs} x 100-1000", (1,) * seqs, tuple(rng.randint(100, 1000) for _ in range(seqs))))
    mixes = [((64,), 7)] if quick else [((256, 256), 14), ((32, 64, 96, 128), 28)]
    for chunks, decodes in mixes:
        q_lens = chunks + (1,) * decodes
        kv_lens = tuple(q + rng.randint(0, 512) for q in chunks) + tuple(rng.randint(100, 1000) for _ in range(decodes))
        sizes = "-".join(map(str, sorted(set(chunks))))
        steps.append((f"{len(chunks)} chunk{'s' if len(chunks) > 1 else ''} of {sizes} + {decodes} decodes",
                      q_lens, kv_lens))
    return steps


def serving_inputs(q_lens, kv_lens, dtype, seed: int = 0) -> dict:
    """A step's tensors: pages scattered over a pool with room to spare, the new tokens' slots."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d = SERVING_HEADS
    bs = SERVING_BLOCK
    pages = [-(-kv // bs) for kv in kv_lens]
    num_blocks = sum(pages) + 16
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.zeros(len(kv_lens), max(pages), dtype=torch.int32)
    for s, n in enumerate(pages):
        block_table[s, :n] = torch.tensor(order[:n], dtype=torch.int32)
        del order[:n]
    slots = [int(block_table[s, p // bs]) * bs + p % bs
             for s, (q, kv) in enumerate(zip(q_lens, kv_lens)) for p in range(kv - q, kv)]
    num_tokens = sum(q_lens)
    return dict(num_blocks=num_blocks,
                query=torch.randn(num_tokens, hq, d, generator=gen).to(dtype),
                key=torch.randn(num_tokens, hkv, d, generator=gen).to(dtype),
                value=torch.randn(num_tokens, hkv, d, generator=gen).to(dtype),
                cu_q_lens=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32),
                kv_lens=torch.tensor(kv_lens, dtype=torch.int32), block_table=block_table,
                slot_mapping=torch.tensor(slots, dtype=torch.int64))


def ours_serving(x: dict, dtype, head_major: bool):
    """Our fused write + attention on the halves of one cache tensor per layer (NHD or HND)."""
    _, hkv, d = SERVING_HEADS
    shape = (x["num_blocks"], hkv, SERVING_BLOCK, 2 * d) if head_major else (x["num_blocks"], SERVING_BLOCK, hkv, 2 * d)
    kv = torch.randn(shape).to(dtype)
    key_cache, value_cache = kv[..., :d], kv[..., d:]
    if head_major:
        key_cache, value_cache = key_cache.permute(0, 2, 1, 3), value_cache.permute(0, 2, 1, 3)
    return lambda: torch_kernels.ragged_paged_attention(
        x["query"], key_cache, value_cache, x["cu_q_lens"], x["kv_lens"], x["block_table"], d ** -0.5,
        key=x["key"], value=x["value"], slot_mapping=x["slot_mapping"])


def vllm_cpu_serving(x: dict, dtype):
    """vLLM's CPU attention backend's two calls on its own cache layout (keys then values in
    each block and head)."""
    from vllm import _custom_ops as vllm_ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    hq, hkv, d = SERVING_HEADS
    isa = _get_attn_isa(dtype, SERVING_BLOCK, d, "auto")
    kv = torch.randn(x["num_blocks"], hkv, 2 * SERVING_BLOCK, d).to(dtype)
    key_cache, value_cache = kv.chunk(2, dim=2)
    out = torch.empty_like(x["query"])
    metadata = vllm_ops.cpu_attn_get_scheduler_metadata(
        len(x["kv_lens"]), hq, hkv, d, x["kv_lens"], dtype, x["cu_q_lens"], True, -1, isa, False)

    def step():
        vllm_ops.cpu_attn_reshape_and_cache(x["key"], x["value"], key_cache, value_cache, x["slot_mapping"], isa)
        vllm_ops.cpu_attention_with_kv_cache(x["query"], key_cache, value_cache, out, x["cu_q_lens"], x["kv_lens"],
                                             d ** -0.5, True, None, -1, x["block_table"], 0.0, metadata, None)
        return out
    return step


def vllm_status() -> str:
    try:
        import vllm
        from vllm import _custom_ops  # noqa: F401

        return f"vLLM {vllm.__version__}"
    except Exception as e:
        return f"not installed ({type(e).__name__}: {str(e)[:120]})"


def thread_seconds_per_call(fn, budget_s: float) -> float:
    """CPU time of this thread for one ``fn()``: the least over calls for ``budget_s`` of it (at
    least three), after an untimed first call."""
    fn()
    best, spent, calls = math.inf, 0.0, 0
    while calls < 3 or spent < budget_s:
        start = time.thread_time()
        fn()
        took = time.thread_time() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best


def main(argv=None) -> int:
    """Times the serving steps (see the module docstring) and writes their table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer, smaller steps (a smoke test)")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timing per measurement")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: timed in CPU time)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="folder for the .md and .json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    peer = vllm_status()
    clock = "thread CPU time" if args.threads == 1 else "wall clock"
    print(f"# paged attention, serving steps: {machine_line()}; peer: {peer}; {clock}")
    budget = args.budget or (0.2 if args.quick else 1.0)
    timer = thread_seconds_per_call if args.threads == 1 else seconds_per_call
    rows, records = [], []
    for dtype in (torch.float32, torch.bfloat16):
        for label, q_lens, kv_lens in serving_steps(args.quick):
            x = serving_inputs(q_lens, kv_lens, dtype)
            calls = {"ours, NHD halves": ours_serving(x, dtype, head_major=False),
                     "ours, HND halves": ours_serving(x, dtype, head_major=True)}
            if peer.startswith("vLLM"):
                calls["vLLM CPU_ATTN"] = vllm_cpu_serving(x, dtype)
            with torch.inference_mode():
                ms = {name: timer(fn, budget) * 1e3 for name, fn in calls.items()}
            peer_ms = ms.get("vLLM CPU_ATTN")
            ratio = f"{peer_ms / ms['ours, NHD halves']:.2f}x" if peer_ms else "-"
            rows.append([str(dtype).removeprefix("torch."), label, *(f"{ms[n]:.3g}" for n in calls),
                         *(["-"] if peer_ms is None else []), ratio])
            records.append({"dtype": str(dtype), "step": label, "q_lens": q_lens, "kv_lens": kv_lens, "ms": ms})
            print(" | ".join(rows[-1]), flush=True)
    header = ["dtype", "step (one layer)", "ours, NHD halves (ms)", "ours, HND halves (ms)", "vLLM CPU_ATTN (ms)",
              "vLLM / ours (NHD)"]
    md = "\n".join([
        "# Paged attention: one layer of a CPU serving step (SmolLM2-135M heads)", "",
        f"{machine_line()}; Hq, Hkv, D = {SERVING_HEADS}, block {SERVING_BLOCK}; peer: {peer}; times: {clock}.", "",
        "Each time is the step's write of its new keys and values plus the attention of its batch: ours one fused "
        "`ragged_paged_attention` call through the op (its checks included) on the halves of one cache tensor per "
        "layer; vLLM's CPU backend's `cpu_attn_reshape_and_cache` + `cpu_attention_with_kv_cache` on its own layout "
        "(scheduler metadata built outside the timing). Ratio above 1x: ours is faster.", "",
        markdown_table(header, rows), ""])
    suffix = "-quick" if args.quick else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"paged_attention-serving{suffix}.md").write_text(md)
    (args.out / f"paged_attention-serving{suffix}.json").write_text(json.dumps(
        {"machine": machine_line(), "peer": peer, "clock": clock, "heads": SERVING_HEADS,
         "block_size": SERVING_BLOCK, "steps": records}, indent=1))
    print()
    print(md)
    return 0



if __name__ == "__main__":
    sys.exit(main())

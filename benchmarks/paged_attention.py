"""Ragged paged attention: decode, prefill and mixed batches against the device's roofline and peers.

    python benchmarks/paged_attention.py [--quick | --gpu] [--device cpu|cuda] [--out DIR] [--budget S]

In one run it measures the device's copy bandwidth (a large ``copy_``; GB/s counts the bytes read
and the bytes written) and its matmul rate (a large matmul in the attention dtype), then times, on
the same inputs, our op, the reference backend and the peers that import here:

- decode (one new token per sequence): GB/s of the bytes the op must move (``attention_bytes``);
- prefill (whole prompts, causal): TFLOP/s of the visible pairs (``attention_flops``);
- mixed batches (decodes and prefill chunks in one call): time, and the fraction of the roofline
  time ``max(bytes / copy bandwidth, flops / matmul rate)``.

Peers: ``scaled_dot_product_attention`` over each sequence's pages gathered into padded
``[S, H, max_len, D]`` tensors, timed with the gather in the call ("gather + sdpa") and without it
("sdpa, pre-gathered"); on NVIDIA also FlashAttention's ``flash_attn_varlen_func`` on pre-gathered
contiguous keys and vLLM's paged flash-attention, when they import. Ratios are ours / peer in
throughput: above 1, ours is faster.

"Ours" is the backend a user gets on the device: on CPU the reference backend's vectorized kernel
(triton there is the interpreter, not timed), on CUDA the triton backend, in bfloat16. On CUDA each
run of the cases is a child process, so a kernel that faults costs only the call that faulted.
Writes ``paged_attention{-quick,}.{md,json,png}`` to ``--out`` (default ``benchmarks/results``).

One layer of a CPU serving step against vLLM's CPU attention: benchmarks/serving.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import random
import selectors
import subprocess
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import (MET, MISSED, NOT_MEASURED, cuda_missing, family_parser, goal_result, machine_line,  # noqa: E402
                    markdown_table, seconds_per_call)

import torch_kernels  # noqa: E402
from torch_kernels import backends  # noqa: E402
from torch_kernels.ops import paged_attention as ops  # noqa: E402

SECTIONS = ("decode", "prefill", "mixed")
DECODE_GOAL, PREFILL_GOAL = 0.85, 0.60  # of measured copy bandwidth, of measured matmul rate
K = 1024
GOAL_LIMIT_FACTOR = 4  # calls in the goal cases may take this many times the per-call limit

BENCHMARK = {  # for the scripts that run or summarize every family (common.family_benchmarks)
    "gpu_step": {"position": 10, "cap_s": 90, "args": ["--time-limit", "60"],
                 "autotuned": True, "autotune_args": ["--time-limit", "15"]},
    "summary_position": 10,
    "summary_goals": [["paged attention decode", ">= 85% of the measured copy bandwidth (decode 64 x 8k)"],
                      ["paged attention prefill", ">= 60% of the measured matmul rate"]],
    "quick_compile_group": "paged_attention-D128",
    "bench": True,
}


# -------------------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    section: str
    label: str
    q_lens: tuple
    kv_lens: tuple
    block_size: int
    priority: bool = False  # run first where time is short (the goal cases)

    @property
    def key(self) -> str:
        return f"{self.section}: {self.label}, block {self.block_size}"

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens)


@dataclasses.dataclass(frozen=True)
class Config:
    device: str
    dtype: torch.dtype
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    cases: tuple
    budget_s: float
    call_limit_s: float

    @property
    def heads(self) -> str:
        return f"Hq={self.num_q_heads}, Hkv={self.num_kv_heads}, D={self.head_size}"

    def bytes(self, case: Case) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return ops.attention_bytes(self.num_q_heads, self.num_kv_heads, self.head_size, case.q_lens,
                                   case.kv_lens, item, item)

    def flops(self, case: Case) -> int:
        return ops.attention_flops(self.num_q_heads, self.head_size, case.q_lens, case.kv_lens)


def tokens(n: int) -> str:
    return f"{n // K}k" if n % K == 0 else str(n)


def decode_case(seqs, context, block_size, priority=False) -> Case:
    return Case("decode", f"{seqs} x {tokens(context)}", (1,) * seqs, (context,) * seqs, block_size, priority)


def prefill_case(seqs, length, block_size, priority=False) -> Case:
    return Case("prefill", f"{seqs} x {tokens(length)}", (length,) * seqs, (length,) * seqs, block_size, priority)


def mixed_case(decodes, decode_kv, chunks, chunk, chunk_kv, block_size, seed=0) -> Case:
    """``decodes`` decode rows with kv lengths drawn from ``decode_kv`` plus ``chunks`` prefill chunks."""
    rng = random.Random(seed)
    lo, hi = decode_kv
    kv = [rng.randint(lo, hi) for _ in range(decodes)] + [chunk_kv] * chunks
    plural = "s" if chunks > 1 else ""
    kind = f"prompt{plural}" if chunk == chunk_kv else f"chunk{plural} of {chunk} at kv {chunk_kv}"
    label = f"{decodes} decodes (kv {lo}-{hi}) + {chunks} {kind}"
    return Case("mixed", label, (1,) * decodes + (chunk,) * chunks, tuple(kv), block_size)


def build_config(args) -> Config:
    cuda = args.device == "cuda"
    if cuda:  # a Llama-ish head configuration in bfloat16
        hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
        bs = args.block_size or 16
        if args.gpu:  # benchmarks/gpu.sh: the goal cases first, within its time limit
            seqs, contexts, lengths, max_tokens = (1, 64), (1 * K, 8 * K, 32 * K), (2 * K, 8 * K), 1 << 20
        elif args.quick:
            seqs, contexts, lengths, max_tokens = (1, 64), (1 * K, 8 * K), (2 * K, 8 * K), 1 << 20
        else:
            seqs, contexts, lengths, max_tokens = (1, 8, 64, 256), (1 * K, 4 * K, 8 * K, 32 * K), \
                (2 * K, 4 * K, 8 * K, 16 * K), 1 << 21
        prefill_tokens = 16 * K
        mixed = [mixed_case(60, (2 * K, 8 * K), 4, 1 * K, 4 * K, bs)]
        if not (args.quick or args.gpu):
            mixed.append(mixed_case(126, (1 * K, 16 * K), 2, 8 * K, 8 * K, bs, seed=1))
    else:  # a smaller configuration and grid, so that the CPU run takes minutes
        hq, hkv, d, dtype = 8, 2, 64, torch.float32
        bs = args.block_size or 16
        if args.gpu:  # the GPU script's dry run: every section once, tiny
            seqs, contexts, lengths, max_tokens = (1, 4), (256,), (128,), 1 << 12
        elif args.quick:
            seqs, contexts, lengths, max_tokens = (1, 16), (1 * K, 4 * K), (2 * K,), 1 << 16
        else:
            seqs, contexts, lengths, max_tokens = (1, 16, 64, 256), (1 * K, 4 * K, 8 * K, 32 * K), \
                (2 * K, 4 * K, 8 * K, 16 * K), 1 << 19
        prefill_tokens = 0  # one prompt per length
        mixed = [mixed_case(3, (64, 256), 1, 32, 128, bs)] if args.gpu else \
            [mixed_case(6, (256, 1 * K), 1, 128, 512, bs)] if args.quick else \
            [mixed_case(14, (512, 4 * K), 2, 256, 2 * K, bs), mixed_case(30, (1 * K, 8 * K), 1, 2 * K, 2 * K, bs, seed=1)]
    if args.dtype:
        dtype = getattr(torch, args.dtype)
    goal = (64, 8 * K)
    cases = []
    for s in seqs:
        for c in contexts:
            if s * c <= max_tokens:
                cases.append(decode_case(s, c, bs, priority=(s, c) == goal))
    if cuda and not args.quick and bs != 32:
        cases.append(decode_case(*goal, 32, priority=True))
    cases += [prefill_case(max(1, prefill_tokens // n), n, bs, priority=True) for n in lengths]
    cases += mixed
    budget = args.budget or (0.2 if cuda else 0.02 if args.gpu else 0.05 if args.quick else 0.4)
    limit = args.call_limit or (2.0 if cuda else 1.0 if args.quick or args.gpu else 8.0)
    return Config(args.device, dtype, hq, hkv, d, tuple(cases), budget, limit)


@dataclasses.dataclass
class Inputs:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    cu_q_lens: torch.Tensor
    kv_lens: torch.Tensor
    block_table: torch.Tensor
    sm_scale: float


def make_inputs(cfg: Config, case: Case, seed: int) -> Inputs:
    """Random caches whose pages are scattered over the pool, as a serving engine's end up."""
    device, bs = torch.device(cfg.device), case.block_size
    gen = torch.Generator(device).manual_seed(seed)
    pages = [-(-kv // bs) for kv in case.kv_lens]
    num_blocks = sum(pages)
    shape = (num_blocks, bs, cfg.num_kv_heads, cfg.head_size)
    key_cache = torch.randn(shape, generator=gen, device=device, dtype=cfg.dtype)
    value_cache = torch.randn(shape, generator=gen, device=device, dtype=cfg.dtype)
    order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_table = torch.zeros(case.num_seqs, max(pages), dtype=torch.int32, device=device)  # unused: 0
    first = 0
    for s, n in enumerate(pages):
        block_table[s, :n] = order[first:first + n]
        first += n
    cu = [0]
    for q in case.q_lens:
        cu.append(cu[-1] + q)
    query = torch.randn(cu[-1], cfg.num_q_heads, cfg.head_size, generator=gen, device=device, dtype=cfg.dtype)
    return Inputs(query, key_cache, value_cache, torch.tensor(cu, dtype=torch.int32, device=device),
                  torch.tensor(case.kv_lens, dtype=torch.int32, device=device), block_table, cfg.head_size ** -0.5)


# ------------------------------------------------------------------------------ implementations


def ours_backend(device: str) -> str:
    return "triton" if device == "cuda" else "reference"


def op_call(backend, checks: str | None = None):
    """The op on ``backend``, its value checks in the device's default mode or in ``checks``."""
    def prepare(x: Inputs, case: Case):
        def call():
            return torch_kernels.ragged_paged_attention(
                x.query, x.key_cache, x.value_cache, x.cu_q_lens, x.kv_lens, x.block_table, x.sm_scale,
                implementation=backend)
        if checks is None:
            return call

        def checked():
            with torch_kernels.checks(checks):
                return call()
        return checked
    return prepare


def kernel_call(backend):
    """The backend's kernel called as the op calls it, without the op's checks (their host syncs)."""
    def prepare(x: Inputs, case: Case):
        kernel = backends._kernel(ops.OP, backend)
        ones = ops._scales(None, x.key_cache.shape[2], x.query.device)
        return lambda: kernel(x.query, x.key_cache, x.value_cache, x.cu_q_lens, x.kv_lens, x.block_table,
                              x.sm_scale, None, None, ones, ones, None, None, None)
    return prepare


def padded_pages(cache: torch.Tensor, block_table: torch.Tensor, seqs: torch.Tensor, max_len: int) -> torch.Tensor:
    """Sequences ``seqs``' first ``max_len`` cached tokens, ``[n, max_len, Hkv, D]`` (pages gathered)."""
    pages = -(-max_len // cache.shape[1])
    return cache[block_table[seqs, :pages].long()].flatten(1, 2)[:, :max_len]


class SdpaGroup:
    """Sequences with one query length, attended by one padded SDPA call.

    Decode rows (one query) put a kv head's query heads on SDPA's query axis, so keys are read
    once per kv head and no mask is needed when lengths agree. Whole prompts of one length use
    ``is_causal`` with grouped-query heads; anything else (prefill chunks, ragged lengths) gets an
    explicit mask, the causal diagonal aligned to the last key, and keys repeated per query head.
    """

    def __init__(self, x: Inputs, seqs: list, q_len: int, kv_lens: list):
        device = x.query.device
        self.seqs = torch.tensor(seqs, device=device)
        cu = x.cu_q_lens.long()
        self.rows = (cu[self.seqs][:, None] + torch.arange(q_len, device=device)).flatten()
        self.q_len, self.max_len = q_len, max(kv_lens)
        self.heads, self.kv_heads = x.query.shape[1], x.key_cache.shape[2]
        self.mode = ("decode" if q_len == 1 else
                     "prompt" if all(kv == q_len for kv in kv_lens) else "masked")
        kv = torch.tensor(kv_lens, device=device)
        k_pos = torch.arange(self.max_len, device=device)
        self.mask = None
        if self.mode == "decode" and min(kv_lens) != self.max_len:
            self.mask = (k_pos < kv[:, None])[:, None, None]
        elif self.mode == "masked":
            q_pos = kv[:, None] - q_len + torch.arange(q_len, device=device)
            self.mask = (k_pos <= q_pos[..., None])[:, None]

    def gather(self, x: Inputs):
        n, d = len(self.seqs), x.query.shape[2]
        q = x.query[self.rows]
        k = padded_pages(x.key_cache, x.block_table, self.seqs, self.max_len)
        v = padded_pages(x.value_cache, x.block_table, self.seqs, self.max_len)
        if self.mode == "decode":
            q = q.view(n, self.kv_heads, self.heads // self.kv_heads, d)
        else:
            q = q.view(n, self.q_len, self.heads, d).transpose(1, 2)
            if self.mode == "masked":
                group = self.heads // self.kv_heads
                k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        return q, k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, q, k, v, sm_scale):
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask, is_causal=self.mode == "prompt", scale=sm_scale,
            enable_gqa=q.shape[1] != k.shape[1])
        n, d = len(self.seqs), q.shape[-1]
        if self.mode == "decode":
            return out.reshape(n, self.heads, d)
        return out.transpose(1, 2).reshape(n * self.q_len, self.heads, d)


def sdpa_groups(x: Inputs, case: Case) -> list:
    by_q_len = {}
    for s, q_len in enumerate(case.q_lens):
        by_q_len.setdefault(q_len, []).append(s)
    return [SdpaGroup(x, seqs, q_len, [case.kv_lens[s] for s in seqs]) for q_len, seqs in by_q_len.items()]


def sdpa_pregathered(x: Inputs, case: Case):
    groups = sdpa_groups(x, case)
    gathered = [g.gather(x) for g in groups]

    def call():
        out = torch.empty_like(x.query)
        for g, (q, k, v) in zip(groups, gathered):
            out[g.rows] = g.attend(q, k, v, x.sm_scale)
        return out
    return call


def sdpa_with_gather(x: Inputs, case: Case):
    groups = sdpa_groups(x, case)

    def call():
        out = torch.empty_like(x.query)
        for g in groups:
            out[g.rows] = g.attend(*g.gather(x), x.sm_scale)
        return out
    return call


def contiguous_kv(x: Inputs):
    """Every sequence's keys and values back to back, ``[sum(kv_lens), Hkv, D]``, and their offsets."""
    bs = x.key_cache.shape[1]
    kv = x.kv_lens.long()
    seq = torch.repeat_interleave(torch.arange(len(kv), device=kv.device), kv)
    starts = torch.cumsum(kv, 0) - kv
    pos = torch.arange(int(kv.sum()), device=kv.device) - starts[seq]
    slots = x.block_table[seq, pos // bs].long() * bs + pos % bs
    flat = (-1,) + tuple(x.key_cache.shape[2:])
    cu_k = torch.nn.functional.pad(torch.cumsum(kv, 0), (1, 0)).to(torch.int32)
    return x.key_cache.reshape(flat)[slots], x.value_cache.reshape(flat)[slots], cu_k


def flash_attn_varlen(x: Inputs, case: Case):
    from flash_attn import flash_attn_varlen_func

    k, v, cu_k = contiguous_kv(x)
    max_q, max_k = max(case.q_lens), max(case.kv_lens)
    return lambda: flash_attn_varlen_func(q=x.query, k=k, v=v, cu_seqlens_q=x.cu_q_lens, cu_seqlens_k=cu_k,
                                          max_seqlen_q=max_q, max_seqlen_k=max_k, softmax_scale=x.sm_scale,
                                          causal=True)


def vllm_flash_attn_paged(x: Inputs, case: Case):
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    max_q, max_k = max(case.q_lens), max(case.kv_lens)
    return lambda: flash_attn_varlen_func(q=x.query, k=x.key_cache, v=x.value_cache, max_seqlen_q=max_q,
                                          cu_seqlens_q=x.cu_q_lens, max_seqlen_k=max_k, seqused_k=x.kv_lens,
                                          softmax_scale=x.sm_scale, causal=True, block_table=x.block_table)


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    prepare: object  # (inputs, case) -> a function of no arguments returning the [T, Hq, D] output
    role: str  # "ours", "reference" (the golden output), "ours-kernel", "ours-full-checks" or "peer"


def peer_status(device: str) -> dict:
    """Each optional peer: its version, or why it is not here."""
    if device != "cuda":
        return {"flash-attn": "CUDA only", "vLLM": "CUDA only"}
    status = {}
    try:
        import flash_attn
        from flash_attn import flash_attn_varlen_func  # noqa: F401

        status["flash-attn"] = f"flash-attn {flash_attn.__version__}"
    except Exception as e:  # ImportError, or a build for another torch raising anything
        status["flash-attn"] = f"not installed ({type(e).__name__}: {str(e)[:120]})"
    try:
        import vllm
        from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: F401,F811

        status["vLLM"] = f"vLLM {vllm.__version__}"
    except Exception as e:
        status["vLLM"] = f"not installed ({type(e).__name__}: {str(e)[:120]})"
    return status


def implementations(device: str, peers: dict) -> list:
    ours = ours_backend(device)
    impls = [Impl("ours: reference" if ours == "reference" else "reference", op_call("reference"), "reference")]
    if ours != "reference":
        impls.append(Impl(f"ours: {ours}", op_call(ours), "ours"))
    if device == "cuda":  # the default there is deferred: what the full mode's host sync costs
        impls.append(Impl(f"ours: {ours}, full checks", op_call(ours, "full"), "ours-full-checks"))
    impls.append(Impl(f"{ours} kernel, no op checks", kernel_call(ours), "ours-kernel"))
    impls.append(Impl("sdpa, pre-gathered", sdpa_pregathered, "peer"))
    impls.append(Impl("gather + sdpa", sdpa_with_gather, "peer"))
    if peers.get("flash-attn", "").startswith("flash-attn "):
        impls.append(Impl("flash-attn varlen, pre-gathered", flash_attn_varlen, "peer"))
    if peers.get("vLLM", "").startswith("vLLM "):
        impls.append(Impl("vLLM flash-attn, paged", vllm_flash_attn_paged, "peer"))
    return impls


def ours_name(impls) -> str:
    return next(i.name for i in impls if i.name.startswith("ours"))


# -------------------------------------------------------------------------------- calibration


def calibrate(device: str, dtype: torch.dtype, quick: bool, budget_s: float) -> dict:
    """The device's copy bandwidth and matmul rate, measured now."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    size = (2 << 30 if cuda else 256 << 20) // (4 if quick else 1)
    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    copy_s = seconds_per_call(lambda: dst.copy_(src), budget_s, sync)
    del src, dst
    n = (8192 if cuda else 2048) // (2 if quick else 1)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    matmul_s = seconds_per_call(lambda: a @ b, budget_s, sync)
    del a, b
    if cuda:
        torch.cuda.empty_cache()
    return {"copy_bytes": size, "copy_GBps": 2 * size / copy_s / 1e9, "matmul_n": n, "matmul_dtype": str(dtype),
            "matmul_TFLOPs": 2 * n ** 3 / matmul_s / 1e12}


def device_line(device: str) -> dict:
    if device != "cuda":
        return {"name": "cpu", "l2_bytes": None}
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "memory_GiB": round(props.total_memory / 2 ** 30, 1),
            "l2_bytes": getattr(props, "L2_cache_size", None), "torch_cuda": torch.version.cuda}


# ---------------------------------------------------------------------------------- the runs


def unit_id(case: Case, impl: Impl) -> str:
    return f"{case.key} | {impl.name}"


def ordered_units(cfg: Config, impls: list) -> list:
    """(case, impl) pairs, each case's reference first (its output is the others' truth).

    On CUDA the goal cases go first, so that a short time limit still reaches them.
    """
    cases = list(cfg.cases)
    if cfg.device == "cuda":
        cases.sort(key=lambda c: not c.priority)
    order = sorted(impls, key=lambda i: i.role != "reference")
    return [(c, i) for c in cases for i in order]


def work(cfg: Config, case: Case, calibration: dict) -> float:
    """A case's size in the unit its section scales with: seconds at the roofline."""
    return max(cfg.bytes(case) / (calibration["copy_GBps"] * 1e9),
               cfg.flops(case) / (calibration["matmul_TFLOPs"] * 1e12))


def estimate(history: list, size: float) -> float | None:
    """Seconds a call of ``size`` should take, from the measured call closest in size."""
    if not history:
        return None
    near_size, near_s = min(history, key=lambda h: abs(math.log(h[0] / size)))
    return near_s * size / near_size


def measure(fn, budget_s: float, sync, alone_s: float | None = None):
    """(output, seconds per call, note): the first call gives the output and warms up, then timed calls.

    A first call longer than ``alone_s`` (for code with nothing to compile) is the measurement.
    """
    start = time.perf_counter()
    out = fn()
    if sync:
        sync()
    first = time.perf_counter() - start
    if alone_s is not None and first > alone_s:
        return out, first, "one call, over the per-call limit"
    if first >= budget_s:  # slow: one more call, alone
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        return out, time.perf_counter() - start, None
    return out, seconds_per_call(fn, budget_s, sync), None


def run_units(cfg, impls, calibration, done_rows, deadline, emit, started=lambda uid: None) -> None:
    """Runs every unit not in ``done_rows``, calling ``emit(row)`` as each one ends.

    A call estimated (from the same implementation's closest measured case) to take longer than
    the per-call limit is left out, as is everything once the deadline has passed.
    """
    cuda = cfg.device == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    done = {r["unit"] for r in done_rows}
    history = {}
    for r in done_rows:
        if r["status"] == "ok":
            history.setdefault((r["section"], r["impl"]), []).append((r["work"], r["seconds"]))
    # the op of the backend whose bare kernel is also timed
    op_role = "ours" if any(i.role == "ours" for i in impls) else "reference"
    measured = {(r["case"], r["role"]): r["seconds"] for r in done_rows if r["status"] == "ok"}
    current, inputs, golden, inputs_error = None, None, None, None
    for case, impl in ordered_units(cfg, impls):
        uid = unit_id(case, impl)
        if uid in done:
            continue
        size = work(cfg, case, calibration)
        row = {"unit": uid, "section": case.section, "case": case.key, "impl": impl.name, "role": impl.role,
               "work": size, "status": "ok", "seconds": None, "max_abs_diff": None, "error": None, "note": None}
        guess = estimate(history.get((case.section, impl.name), []), size)
        if impl.role == "ours-kernel" and measured.get((case.key, op_role)):
            guess = measured[(case.key, op_role)]  # the op minus its checks: about as long
        # the goal lines need ours (and the reference, the others' truth) in the goal cases
        limit = cfg.call_limit_s * (GOAL_LIMIT_FACTOR if case.priority and impl.role in ("ours", "reference") else 1)
        if time.time() > deadline:
            row.update(status="not run", error="time limit")
        elif guess is not None and guess > limit:
            row.update(status="skipped", error=f"estimated {guess:.3g} s per call, over the {limit:g} s limit")
        if row["status"] != "ok":
            emit(row)
            continue
        started(uid)
        try:
            if case is not current:
                current, inputs, golden, inputs_error = case, None, None, None
                if cuda:
                    torch.cuda.empty_cache()
                try:
                    inputs = make_inputs(cfg, case, seed=cfg.cases.index(case))
                except Exception as e:  # e.g. out of memory: every unit of the case says so
                    inputs_error = e
            if inputs_error is not None:
                raise inputs_error
            with torch.inference_mode():
                fn = impl.prepare(inputs, case)
                out, seconds, row["note"] = measure(fn, cfg.budget_s, sync, None if cuda else limit)
                del fn
            row["seconds"] = seconds
            measured[(case.key, impl.role)] = seconds
            history.setdefault((case.section, impl.name), []).append((size, seconds))
            if impl.role == "reference":
                golden = out
            elif golden is not None:
                row["max_abs_diff"] = (out.float() - golden.float()).abs().max().item()
            del out
        except Exception as e:  # a row fails, the run goes on
            row.update(status="failed", error=error_text(e))
            if os.environ.get("TORCH_KERNELS_BENCH_TRACEBACKS"):
                traceback.print_exc()
            if cuda and not cuda_alive():
                row["error"] += " (CUDA context lost; restarting the worker)"
                emit(row)
                sys.exit(3)
        emit(row)


def error_text(e: Exception) -> str:
    """The exception's type, first and last lines (a compiler's error is often on its last)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = type(e).__name__ + (f": {lines[0][:200]}" if lines else "")
    if len(lines) > 1:
        text += f" ... {lines[-1][:200]}"
    return text.replace("|", "/")  # the text lands in markdown


def cuda_alive() -> bool:
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return True
    except Exception:
        return False


def worker(args) -> int:
    """Child process: runs the units the parent sends, one ``@@row`` line of JSON per unit."""
    request = json.loads(sys.stdin.read())
    cfg = build_config(args)
    impls = implementations(cfg.device, request["peers"])

    def emit(row):
        print("@@row " + json.dumps(row), flush=True)

    run_units(cfg, impls, request["calibration"], request["rows"], request["deadline"], emit,
              started=lambda uid: print("@@start " + uid, flush=True))
    return 0


def run_isolated(argv, cfg, impls, calibration, peers, deadline, hang_s, emit) -> None:
    """Runs the units in child processes; a child that dies or hangs fails its current unit only."""
    rows = {}
    units = [unit_id(c, i) for c, i in ordered_units(cfg, impls)]
    for attempt in range(8):
        if len(rows) == len(units):
            return
        request = {"rows": list(rows.values()), "deadline": deadline, "calibration": calibration, "peers": peers}
        with tempfile.TemporaryFile("w+") as err:
            child = subprocess.Popen([sys.executable, __file__, *argv, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=err)
            child.stdin.write(json.dumps(request).encode())
            child.stdin.close()
            started, buffer, why = None, b"", None
            selector = selectors.DefaultSelector()
            selector.register(child.stdout, selectors.EVENT_READ)
            fd = child.stdout.fileno()
            while True:
                if not selector.select(timeout=hang_s):
                    child.kill()
                    why = f"no progress for {hang_s:g} s; worker killed"
                    break
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    break
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    text = line.decode(errors="replace")
                    if text.startswith("@@start "):
                        started = text[len("@@start "):]
                    elif text.startswith("@@row "):
                        row = json.loads(text[len("@@row "):])
                        rows[row["unit"]] = row
                        started = None
                        emit(row)
                    else:
                        print(text, flush=True)
            code = child.wait()
            err.seek(0)
            tail = err.read()[-1500:]
        if started is not None:
            case, _, name = started.partition(" | ")
            section = case.split(":", 1)[0]
            detail = why or f"worker died (exit code {code})"
            lines = [ln for ln in tail.strip().splitlines() if ln.strip()]
            row = {"unit": started, "section": section, "case": case, "impl": name, "role": None, "work": None,
                   "status": "failed", "seconds": None, "max_abs_diff": None,
                   "error": detail + (f": {lines[-1][:300]}" if lines else "")}
            rows[started] = row
            emit(row)
        elif code != 0 and len(rows) < len(units):
            print(f"worker exited with code {code} between units:\n{tail}", file=sys.stderr)
    for c, i in ordered_units(cfg, impls):
        uid = unit_id(c, i)
        if uid not in rows:
            emit({"unit": uid, "section": c.section, "case": c.key, "impl": i.name, "role": i.role, "work": None,
                  "status": "not run", "seconds": None, "max_abs_diff": None, "error": "workers kept failing"})


# -------------------------------------------------------------------------------- the report


def fmt(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


class Report:
    def __init__(self, cfg, impls, calibration, peers, device, args):
        self.cfg, self.impls, self.calibration, self.peers, self.device, self.args = \
            cfg, impls, calibration, peers, device, args
        self.rows = {}
        self.ours = ours_name(impls)
        self.notes = []
        self.load = []  # the 1-minute load average at the start (and the end)

    def add(self, row):
        self.rows[row["unit"]] = row

    def row(self, case, name):
        return self.rows.get(f"{case.key} | {name}")

    def seconds(self, case, name):
        r = self.row(case, name)
        return r["seconds"] if r and r["status"] == "ok" else None

    def footnote(self, text) -> str:
        if text not in self.notes:
            self.notes.append(text)
        return f"[{self.notes.index(text) + 1}]"

    def note(self, r) -> str:
        mark = {"skipped": "-", "not run": "n/r"}.get(r["status"], "err")
        return mark + self.footnote(f"{r['status']}: {r['error']}")

    def cell(self, case, name, metric) -> str:
        """``metric(seconds)`` with the ratio ours / this in throughput."""
        r = self.row(case, name)
        if r is None:
            return ""
        if r["status"] != "ok":
            return self.note(r)
        ours = self.seconds(case, self.ours)
        ratio = f" ({r['seconds'] / ours:.2f}x)" if ours and name != self.ours else ""
        return metric(r["seconds"]) + ratio + (self.footnote(r["note"]) if r.get("note") else "")

    def l2_mark(self, case) -> str:
        l2 = self.device.get("l2_bytes")
        return " (L2)" if l2 and self.cfg.bytes(case) <= 2 * l2 else ""

    def section_table(self, section) -> str:
        cfg, cal = self.cfg, self.calibration
        others = [i.name for i in self.impls if i.name != self.ours]
        cases = [c for c in cfg.cases if c.section == section]
        body = []
        for c in cases:
            s = self.seconds(c, self.ours)
            gbps = (lambda t: fmt(cfg.bytes(c) / t / 1e9))
            tflops = (lambda t: fmt(cfg.flops(c) / t / 1e12))
            ms = (lambda t: fmt(t * 1e3))
            if section == "decode":
                head = [c.label + self.l2_mark(c), c.block_size, fmt(cfg.bytes(c) / 1e6)]
                ours = [self.cell(c, self.ours, ms), gbps(s) if s else "",
                        f"{cfg.bytes(c) / s / 1e9 / cal['copy_GBps']:.0%}" if s else ""]
                metric = gbps
            elif section == "prefill":
                head = [c.label, c.block_size, fmt(cfg.flops(c) / 1e12)]
                ours = [self.cell(c, self.ours, ms), tflops(s) if s else "",
                        f"{cfg.flops(c) / s / 1e12 / cal['matmul_TFLOPs']:.0%}" if s else ""]
                metric = tflops
            else:
                head = [c.label, c.block_size, fmt(cfg.bytes(c) / 1e6), fmt(cfg.flops(c) / 1e12)]
                ours = [self.cell(c, self.ours, ms), gbps(s) if s else "", tflops(s) if s else "",
                        f"{work(cfg, c, cal) / s:.0%}" if s else ""]
                metric = ms
            body.append(head + ours + [self.cell(c, name, metric) for name in others])
        unit = {"decode": "GB/s", "prefill": "TFLOP/s", "mixed": "ms"}[section]
        if section == "decode":
            header = ["sequences x context", "block", "MB moved", f"{self.ours} ms", "GB/s", "of copy BW"]
        elif section == "prefill":
            header = ["sequences x length", "block", "TFLOP", f"{self.ours} ms", "TFLOP/s", "of matmul"]
        else:
            header = ["batch", "block", "MB moved", "TFLOP", f"{self.ours} ms", "GB/s", "TFLOP/s", "of roofline"]
        return markdown_table(header + [f"{n} {unit} (ours/this)" for n in others], body)

    def goals(self) -> list:
        """A line per goal case: decode's priority cases against the measured copy bandwidth, every
        prefill case against the measured matmul rate."""
        cfg, cal, lines = self.cfg, self.calibration, []
        for c in cfg.cases:
            if c.section == "decode" and c.priority:
                fraction, peak, unit, what, amount, scale = \
                    DECODE_GOAL, cal["copy_GBps"], "GB/s", "copy bandwidth", cfg.bytes(c), 1e9
                unmeasured = f"decode {c.label}, block {c.block_size}: no measurement"
            elif c.section == "prefill":
                fraction, peak, unit, what, amount, scale = \
                    PREFILL_GOAL, cal["matmul_TFLOPs"], "TFLOP/s", "matmul rate", cfg.flops(c), 1e12
                unmeasured = f"prefill {c.label}: no measurement"
            else:
                continue
            target, s = fraction * peak, self.seconds(c, self.ours)
            if s is None:
                lines.append({"case": c.key, "text": unmeasured})
                continue
            got = amount / s / scale
            lines.append({"case": c.key, "achieved": got, "goal": target, "met": got >= target,
                          "text": f"{c.section} {c.label}, block {c.block_size}: {fmt(got)} {unit} = "
                                  f"{got / peak:.0%} of the measured {what} {fmt(peak)} {unit}; goal {fraction:.0%} "
                                  f"({fmt(target)} {unit}): "
                                  f"{'met' if got >= target else f'not met ({got / target:.0%} of it)'}"})
        return lines

    def markdown(self, runtime_s) -> str:
        cfg, cal, args = self.cfg, self.calibration, self.args
        self.notes = []
        dev = self.device
        where = dev["name"] + (f", {dev['memory_GiB']} GiB, L2 {dev['l2_bytes'] / 2 ** 20:.0f} MiB"
                               if dev.get("l2_bytes") else "")
        out = [f"# Ragged paged attention benchmark\n\n{machine_line()}; device {where}"
               + (" (--quick)" if args.quick else "")]
        out.append(f"\nHeads {cfg.heads}, {str(cfg.dtype).removeprefix('torch.')}; caches "
                   "`[num_blocks, block_size, Hkv, D]` with each sequence's pages scattered at random over "
                   f"the pool; decode and prefill batches have equal lengths. Ours: `{self.ours}` "
                   "(`torch_kernels.ragged_paged_attention`, checks included). Time per call: the fastest block "
                   f"of calls in {cfg.budget_s:g} s"
                   + (", `torch.cuda.synchronize()` before each clock reading" if cfg.device == "cuda" else "")
                   + f". Run took {runtime_s:.0f} s; 1-minute load average "
                   + " at the start, ".join(f"{x:.1f}" for x in self.load)
                   + (" at the end." if len(self.load) > 1 else " at the start.")
                   + (" Other processes shared these cores: the CPU figures are noisy." if self.load
                      and self.load[0] > 0.5 * (os.cpu_count() or 1) and cfg.device == "cpu" else ""))
        out.append(f"\nMeasured in this run: copy bandwidth {fmt(cal['copy_GBps'])} GB/s "
                   f"(`copy_` of {cal['copy_bytes'] / 2 ** 20:.0f} MiB, read + write), matmul "
                   f"{fmt(cal['matmul_TFLOPs'])} TFLOP/s ({cal['matmul_n']}^3, "
                   f"{cal['matmul_dtype'].removeprefix('torch.')}).")
        out.append("\n## Goals\n")
        if cfg.device != "cuda":
            out.append("(The goals are set for an H200; on this CPU they only show where the CPU path stands.)\n")
        out += [f"- {g['text']}" for g in self.goals()]
        if not any(c.section == "decode" and c.priority for c in cfg.cases):
            out.append("- decode 64 x 8k: not in this grid")
        titles = {"decode": "Decode (one query per sequence): GB/s of the bytes the op must move",
                  "prefill": "Prefill (whole causal prompts): TFLOP/s",
                  "mixed": "Mixed batches (decodes and prefill chunks in one call): ms per call"}
        for section in SECTIONS:
            out.append(f"\n## {titles[section]}\n")
            out.append(self.section_table(section))
        out.append("\nCells: the measure, then (ours/this): this implementation's time over ours, so above 1 "
                   "ours is faster. `sdpa, pre-gathered` times only SDPA on pages gathered before the timing "
                   "(padded `[S, H, max_len, D]`, one call per query length; decode puts a kv head's query heads "
                   "on SDPA's query axis); `gather + sdpa` times the gather too, as a padded-SDPA server pays it. "
                   "`kernel, no op checks` calls the backend's kernel directly: the difference to ours is the "
                   "op's input checks (they read the lengths on the host, one device sync per call).")
        if dev.get("l2_bytes"):
            out.append(f"\n(L2): the bytes fit in twice the L2 cache ({dev['l2_bytes'] / 2 ** 20:.0f} MiB), "
                       "so repeated calls read partly from L2, not HBM.")
        out.append("\nPeers: " + "; ".join(f"{k}: {v}" for k, v in self.peers.items()) + "."
                   + (" FlashAttention's paged `flash_attn_with_kvcache` takes pages of 256 tokens only, so it "
                      "is not timed on these page sizes; its varlen kernel reads the keys gathered contiguous "
                      "before the timing." if cfg.device == "cuda" else ""))
        worst = {}
        for r in self.rows.values():
            if r["max_abs_diff"] is not None:
                worst[r["impl"]] = max(worst.get(r["impl"], 0.0), r["max_abs_diff"])
        if worst:
            out.append("\nLargest |difference| from the reference backend's output on the same inputs: "
                       + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()) + ".")
        if self.notes:
            out.append("\nNotes:\n")
            out += [f"{n}. {text}" for n, text in enumerate(self.notes, 1)]
        return "\n".join(out) + "\n"

    def write(self, directory, suffix, runtime_s, final):
        directory.mkdir(parents=True, exist_ok=True)
        stem = directory / f"paged_attention{suffix}"
        md = self.markdown(runtime_s)
        stem.with_suffix(".md").write_text(md)
        cfg = self.cfg
        cases = [{**dataclasses.asdict(c), "key": c.key, "bytes": cfg.bytes(c), "flops": cfg.flops(c)}
                 for c in cfg.cases]
        stem.with_suffix(".json").write_text(json.dumps({
            "machine": machine_line(), "device": self.device, "quick": self.args.quick, "runtime_s": runtime_s,
            "load_average": self.load,
            "config": {"device": cfg.device, "dtype": str(cfg.dtype), "num_q_heads": cfg.num_q_heads,
                       "num_kv_heads": cfg.num_kv_heads, "head_size": cfg.head_size, "budget_s": cfg.budget_s,
                       "call_limit_s": cfg.call_limit_s},
            "calibration": self.calibration, "peers": self.peers, "ours": self.ours, "cases": cases,
            "rows": list(self.rows.values()), "goals": self.goals(), "complete": final}, indent=1))
        if final:
            try:
                self.plot(stem.with_suffix(".png"))
            except Exception as e:  # matplotlib missing: tables still stand
                print(f"plot: {type(e).__name__}: {e}", file=sys.stderr)
        return md

    def plot(self, path):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.lines import Line2D

        cfg, cal = self.cfg, self.calibration
        fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
        names = [i.name for i in self.impls]
        colors = {name: f"C{k}" for k, name in enumerate(names)}
        width = {name: 2.5 if name == self.ours else 1.2 for name in names}
        # decode: GB/s over context, one line per implementation and batch size (the default page size)
        ax = axes[0]
        block = cfg.cases[0].block_size
        decode = [c for c in cfg.cases if c.section == "decode" and c.block_size == block]
        batch_sizes = sorted({c.num_seqs for c in decode})
        markers = dict(zip(batch_sizes, "osD^vP"))
        for name in names:
            for seqs in batch_sizes:
                points = [(c.kv_lens[0], cfg.bytes(c) / self.seconds(c, name) / 1e9)
                          for c in sorted(decode, key=lambda c: c.kv_lens[0])
                          if c.num_seqs == seqs and self.seconds(c, name)]
                if points:
                    ax.plot(*zip(*points), marker=markers[seqs], color=colors[name], linewidth=width[name])
        handles = [Line2D([], [], color=colors[n], linewidth=width[n], label=n) for n in names]
        handles += [Line2D([], [], color="grey", marker=markers[s], linestyle="", label=f"{s} seqs")
                    for s in batch_sizes]
        handles.append(ax.axhline(cal["copy_GBps"], color="k", linestyle=":", label="measured copy BW"))
        handles.append(ax.axhline(DECODE_GOAL * cal["copy_GBps"], color="r", linestyle="--",
                                  label=f"{DECODE_GOAL:.0%} goal"))
        ax.set(xscale="log", yscale="log", xlabel="context (tokens per sequence)", ylabel="GB/s",
               title=f"decode, {cfg.heads}, block {block}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(handles=handles, fontsize=7)
        ax = axes[1]
        prefill = sorted((c for c in cfg.cases if c.section == "prefill"), key=cfg.flops)
        for name in names:
            points = [(cfg.flops(c) / 1e12, cfg.flops(c) / self.seconds(c, name) / 1e12)
                      for c in prefill if self.seconds(c, name)]
            if points:
                ax.plot(*zip(*points), marker="o", label=name, color=colors[name], linewidth=width[name])
        ax.axhline(cal["matmul_TFLOPs"], color="k", linestyle=":", label="measured matmul")
        ax.axhline(PREFILL_GOAL * cal["matmul_TFLOPs"], color="r", linestyle="--", label=f"{PREFILL_GOAL:.0%} goal")
        ax.set(xscale="log", yscale="log", xlabel="TFLOP per call", ylabel="TFLOP/s", title=f"prefill, {cfg.heads}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[2]
        mixed = [c for c in cfg.cases if c.section == "mixed"]
        bar = 0.8 / max(1, len(names))
        for k, name in enumerate(names):
            ys = [(self.seconds(c, name) or math.nan) * 1e3 for c in mixed]
            ax.bar([j + k * bar for j in range(len(mixed))], ys, bar, label=name, color=colors[name])
        ax.set_xticks([j + 0.4 - bar / 2 for j in range(len(mixed))])
        ax.set_xticklabels([c.label.replace(" + ", "\n+ ") for c in mixed], fontsize=7)
        ax.set(ylabel="ms per call (lower is better)", yscale="log", title="mixed batches")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def progress_line(row, cfg, cases) -> str:
    case = cases.get(row["case"])
    if row["status"] != "ok":
        return f"  {row['case']} | {row['impl']}: {row['status']}: {row['error']}"
    s = row["seconds"]
    extra = ""
    if case is not None:
        extra = f"  {cfg.bytes(case) / s / 1e9:9.1f} GB/s  {cfg.flops(case) / s / 1e12:8.3f} TFLOP/s"
    diff = "" if row["max_abs_diff"] is None else f"  |diff| {row['max_abs_diff']:.1e}"
    note = f"  ({row['note']})" if row.get("note") else ""
    return f"  {row['case']} | {row['impl']}: {s * 1e3:.3f} ms{extra}{diff}{note}"


# ------------------------------------------------------------------------- the GPU script's summary


def gpu_goals(data: dict) -> list:
    """BENCHMARK's summary goals from ``paged_attention-gpu.json``: the goal lines of each section
    against the copy and matmul rates this run measured."""
    cal = data["calibration"]
    results = []
    for section, peak, unit in (("decode", cal["copy_GBps"], "GB/s"), ("prefill", cal["matmul_TFLOPs"], "TFLOP/s")):
        lines = [g for g in data["goals"] if g["case"].startswith(section)]
        measured = [g for g in lines if "achieved" in g]
        if not measured:
            results.append(goal_result(None, NOT_MEASURED, "; ".join(g["text"] for g in lines)
                                       or "no goal case in this grid"))
            continue
        fractions = [g["achieved"] / peak for g in measured]
        results.append(goal_result(f"{min(fractions):.0%} (worst of {len(fractions)})",
                                   MET if all(g["met"] for g in measured) else MISSED,
                                   "; ".join(f"{g['case']}: {g['achieved']:.4g} {unit} = {f:.0%}"
                                             for g, f in zip(measured, fractions))))
    return results


# --------------------------------------------------------------------------------------- main


def parse(argv):
    parser = family_parser(__doc__.splitlines()[0], quick="a few small cases (a CI smoke test)",
                           gpu="benchmarks/gpu.sh's grid (with --device cpu: tiny, its dry run); writes -gpu files")
    parser.add_argument("--call-limit", type=float, default=None,
                        help="leave out calls estimated to take longer than this (s)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="stop starting new measurements after this many seconds (default: 180 on cuda)")
    parser.add_argument("--block-size", type=int, default=None, help="page size (default 16)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="run the cases in worker processes, so a fault fails one call only (default: on cuda)")
    parser.add_argument("--hang", type=float, default=120.0, help="kill a worker silent this long (s)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        return worker(args)
    start = time.time()
    load = os.getloadavg()[0]
    if cuda_missing(args.device):
        return 2
    cfg = build_config(args)
    device = device_line(args.device)
    peers = peer_status(args.device)
    impls = implementations(args.device, peers)
    print(f"# paged attention benchmark: {machine_line()}; device {device['name']}; {cfg.heads}, {cfg.dtype}")
    print(f"peers: {peers}")
    calibration = calibrate(args.device, cfg.dtype, args.quick or (args.gpu and args.device == "cpu"),
                            max(cfg.budget_s, 0.2))
    print(f"measured: copy {fmt(calibration['copy_GBps'])} GB/s, matmul {fmt(calibration['matmul_TFLOPs'])} TFLOP/s",
          flush=True)
    time_limit = args.time_limit or (180.0 if args.device == "cuda" else 1e9)
    deadline = start + time_limit
    report = Report(cfg, impls, calibration, peers, device, args)
    report.load = [load]
    suffix = "-gpu" if args.gpu else "-quick" if args.quick else ""
    cases = {c.key: c for c in cfg.cases}

    def emit(row):
        report.add(row)
        print(progress_line(row, cfg, cases), flush=True)
        report.write(args.out, suffix, time.time() - start, final=False)

    if args.isolate if args.isolate is not None else args.device == "cuda":
        child_argv = [a for a in argv if a != "--worker"]
        run_isolated(child_argv, cfg, impls, calibration, peers, deadline, args.hang, emit)
    else:
        run_units(cfg, impls, calibration, [], deadline, emit)
    report.load.append(os.getloadavg()[0])
    md = report.write(args.out, suffix, time.time() - start, final=True)
    print()
    print(md)
    print(f"written: {args.out}/paged_attention{suffix}.md, .json, .png ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Host cost of an op call: what the op adds over its kernel launcher, in each check mode.

    python benchmarks/overhead.py [--quick] [--budget S] [--out DIR]

For every op's doctor case (``families.selftest_cases``), on CPU tensors with the Triton backend,
each backend kernel is replaced by a no-op that hands back the output the real kernel gave once:
so a call's time is all host work (the dispatcher, the op's checks, argument preparation, its
Python) and none of the kernel's. That is compared with a bare call of the same no-op launcher.
Rows per mode: ``deferred`` (the accelerator default: no host read; its value checks run as small
torch ops, here on the CPU, where on a GPU they would be kernel launches, or as one launch of the
backend's own check kernel where it has one) and ``full`` (the CPU default; on the CPU its index
checks are skipped for a batch equal to the last that passed, as in a model's layers). Per call
also the device launches it would make: its backend launchers and its computing torch ops, counted
by the profiler. Also ``ragged_paged_attention`` with its cache write (key, value, slot_mapping),
and a serving step of the ``Engine`` (a tiny random Llama, decode-only steps, the reference
backend). Goals (one thread): at most 10 us added in deferred mode for a single-kernel op, 20 us
for ``ragged_paged_attention`` with its write. Times are thread CPU time, the fastest of several
blocks. Writes ``overhead{-quick,}.{md,json,png}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from common import RESULTS, machine_line, markdown_table, write_results  # noqa: E402

import torch_kernels  # noqa: E402
from torch_kernels import backends, families  # noqa: E402

GOAL_US = {"ragged_paged_attention + write": 20.0}
DEFAULT_GOAL_US = 10.0


def thread_seconds_per_call(fn, budget_s: float) -> float:
    """Thread CPU time of one ``fn()``: the fastest of blocks of calls filling ``budget_s``."""
    fn()
    start = time.thread_time()
    fn()
    once = max(time.thread_time() - start, 1e-7)
    calls = max(1, int(budget_s / 20 / once))
    best, deadline = once, time.perf_counter() + budget_s
    while time.perf_counter() < deadline:
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls)
    return best


class NoOpKernels:
    """Within the block every registered kernel of the backend runs for real once per op, then
    hands back that output without running: the launch replaced by a no-op."""

    def __init__(self, backend: str):
        self.backend, self.outputs, self._saved, self.calls = backend, {}, {}, 0

    def launcher(self, op: str):
        real = backends._kernel(op, self.backend)

        def no_op(*args, **kwargs):
            self.calls += 1
            out = self.outputs.get(op)
            if out is None:
                out = self.outputs[op] = (real(*args, **kwargs),)
            return out[0]

        return no_op

    def __enter__(self):
        for op, kernels in backends._impls.items():
            if self.backend in kernels:
                self._saved[op] = kernels[self.backend]
                kernels[self.backend] = self.launcher(op)
        backends._plans.clear()
        return self

    def __exit__(self, *exc):
        for op, fn in self._saved.items():
            backends._impls[op][self.backend] = fn
        backends._plans.clear()


def op_calls() -> list[tuple[str, callable]]:
    """(name, a call of the op on fresh inputs) for every op's doctor case, and the paged
    attention with its write."""
    calls = []
    for case in families.selftest_cases():
        if any(name == case.op for name, _ in calls):
            continue
        inputs = case.make_inputs(torch.Generator().manual_seed(0), torch.float32, "cpu")
        calls.append((case.op, lambda case=case, inputs=inputs: case.run(*inputs, implementation="triton")))
    from torch_kernels.ops.paged_attention import paged_attention_inputs

    query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, scale = paged_attention_inputs(
        torch.Generator().manual_seed(0), torch.float32, "cpu")
    key, value = torch.randn(query.shape[0], *key_cache.shape[2:]), torch.randn(query.shape[0], *key_cache.shape[2:])
    slots = torch.randperm(key_cache.shape[0] * key_cache.shape[1])[:query.shape[0]]
    calls.append(("ragged_paged_attention + write", lambda: torch_kernels.ragged_paged_attention(
        query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, scale, key=key, value=value,
        slot_mapping=slots, implementation="triton")))
    return calls


# aten ops that launch nothing on a device: views, metadata, allocations, host scalars
_NO_LAUNCH = {"aten::" + name for name in (
    "as_strided", "view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "reshape", "_reshape_alias",
    "expand", "alias", "detach", "lift_fresh", "empty", "empty_strided", "empty_like", "resize_", "t", "transpose",
    "permute", "contiguous", "to", "_to_copy", "item", "_local_scalar_dense", "is_nonzero", "result_type",
    "scalar_tensor", "resolve_conj", "resolve_neg", "clone")}


def device_launches(call, no_ops: NoOpKernels) -> int:
    """How many kernels one ``call`` would launch on a device: its backend launchers (each counted
    once, though a launcher may launch more: a merge, the MoE routing's three) and its computing
    torch ops (from the profiler: the outermost aten op that is not a view, an allocation or a
    host scalar; a copy inside ``to`` or ``clone`` counts, a reduction's inner steps do not)."""
    calls = no_ops.calls
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call()
    counted, total = set(), 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):  # parents before children
        if not event.name.startswith("aten::") or event.name in _NO_LAUNCH:
            continue
        parent = event.cpu_parent
        while parent is not None and parent.id not in counted:
            parent = parent.cpu_parent
        if parent is None:
            counted.add(event.id)
            total += 1
    return total + no_ops.calls - calls


def measure_ops(budget_s: float) -> list[dict]:
    rows = []
    with NoOpKernels("triton") as no_ops:
        for name, call in op_calls():
            row = {"op": name}
            for mode in ("deferred", "full"):
                with torch_kernels.checks(mode):
                    row[f"{mode}_us"] = thread_seconds_per_call(call, budget_s) * 1e6
                    row[f"{mode}_launches"] = device_launches(call, no_ops)
            torch_kernels.raise_deferred_errors()
            # the bare launch: each no-op the call ran, called directly
            bare = [(op, out[0]) for op, out in no_ops.outputs.items()]
            row["bare_us"] = thread_seconds_per_call(lambda: [no_ops.outputs.get(op) for op, _ in bare], budget_s) * 1e6
            no_ops.outputs.clear()
            row["goal_us"] = GOAL_US.get(name, DEFAULT_GOAL_US)
            rows.append(row)
    return rows


def measure_engine(budget_s: float, steps: int = 24) -> dict:
    """Wall time of an Engine decode step (a tiny Llama, 8 sequences, the reference backend)."""
    import transformers

    from torch_kernels.serving import Engine

    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    result = {}
    for label, kwargs in (("eager", {}), ("padded decode (cuda_graphs=True, uncaptured)", {"cuda_graphs": True})):
        engine = Engine(model, num_blocks=128, block_size=16, max_batched_tokens=256,
                                              max_seqs=8, implementation="reference", **kwargs)
        for i in range(8):
            engine.add_request([1 + i, 2, 3, 4, 5], steps + 8)
        engine.step()  # the prefill
        best = float("inf")
        deadline = time.perf_counter() + budget_s * 4
        while time.perf_counter() < deadline and engine.running:
            start = time.perf_counter()
            engine.step()
            best = min(best, time.perf_counter() - start)
        result[label] = best * 1e3
    return result


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["op"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.2))
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [r["deferred_us"] - r["bare_us"] for r in rows], 0.4, label="deferred")
    ax.barh([i - 0.2 for i in y], [r["full_us"] - r["bare_us"] for r in rows], 0.4, label="full")
    ax.scatter([r["goal_us"] for r in rows], list(y), marker="|", color="k", s=120, label="goal (deferred)")
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xlabel("host time added over the bare launch (us per call, one thread)")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short timing blocks")
    parser.add_argument("--budget", type=float, default=None, help="seconds of timing per measurement")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    budget = args.budget or (0.05 if args.quick else 0.4)
    rows = measure_ops(budget)
    engine = measure_engine(budget)
    table = markdown_table(
        ["op", "bare launch us", "deferred: added us", "goal us", "met", "deferred: launches", "full: added us",
         "full: launches"],
        [[r["op"], f"{r['bare_us']:.2f}", f"{r['deferred_us'] - r['bare_us']:.1f}", f"{r['goal_us']:.0f}",
          "yes" if r["deferred_us"] - r["bare_us"] <= r["goal_us"] else "no", r["deferred_launches"],
          f"{r['full_us'] - r['bare_us']:.1f}", r["full_launches"]]
         for r in rows])
    steps = markdown_table(["Engine decode step (8 sequences)", "ms"], [[k, f"{v:.2f}"] for k, v in engine.items()])
    text = (f"# Host cost per op call\n\n{machine_line()}\n\nTriton backend's launchers replaced by no-ops "
            f"(CPU tensors, one thread, thread CPU time).\n\n{table}\n\n{steps}\n")
    print(text)
    write_results(args.out, "overhead-quick" if args.quick else "overhead", text, {"rows": rows, "engine": engine},
                  plot)


if __name__ == "__main__":
    main()

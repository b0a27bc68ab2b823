"""What the always-on telemetry (``torch_kernels.profile.continuous``) costs per op call on the CPU.

    python benchmarks/telemetry.py [--quick] [--rounds N] [--calls N] [--out DIR]

Times blocks of calls of probe ops (defined here: a kernel that returns its input through
``backends.dispatch``, with 1, 3 and 6 tensor arguments, so the table shows the cost per tensor
argument; and the 3-argument one off the fastest path, see :func:`other_paths`) and of
``mahalanobis_score`` at a small shape, with the telemetry off, on (with and
without ``shapes``), and inside a ``torch_kernels.profile`` block for comparison. The modes
alternate within each round and the overhead is the fastest block of a mode less the fastest block
off, each block timed in this thread's CPU time (``time.thread_time``: other processes' load on a
shared machine does not count, as it did on the wall clock); the recording wrapper is also timed alone, around
a kernel that does nothing. Also checks that the ring holds at most ``max_events`` calls however
many run. Writes ``telemetry{-quick,}.{md,json}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import statistics
import sys
import time
import timeit

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import RESULTS, machine_line, markdown_table  # noqa: E402

import torch_kernels  # noqa: E402
from torch_kernels import _library, backends  # noqa: E402

PROBE_ARITIES = (1, 3, 6)


def define_probes() -> dict[int, callable]:
    """``{tensor arguments: call}`` of the probe ops: a dispatch to a kernel that returns its first input."""
    library = torch.library.Library("torch_kernels", "FRAGMENT")
    define_probes.library = library  # kept alive with the ops
    calls = {}
    for arity in PROBE_ARITIES:
        name = f"telemetry_probe{arity}"
        names = [f"x{i}" for i in range(arity)]

        def kernel(*tensors, name=name):
            return backends.dispatch(name, "cpu", None, *tensors)

        op = _library.define(f"{name}({', '.join(f'Tensor {n}' for n in names)}) -> Tensor", kernel,
                             lambda *tensors: torch.empty_like(tensors[0]), library=library)
        _library.register_cost(op, flops=lambda a, out: 0, bytes=_library.io_bytes)
        backends.register(name, "reference", lambda *tensors: tensors[0])
        tensors = [torch.ones(4, 8) for _ in range(arity)]
        calls[arity] = lambda op=op, tensors=tensors: op(*tensors)
    return calls


def other_paths() -> dict[str, callable]:
    """Calls of the 3-argument probe off the telemetry's fastest path: several signatures in turn (up to
    ``SIGNATURE_PROBES``, each matched by its own probe), more signatures in turn than probes (each call
    then misses them all and takes the memo), and calls in ``torch.inference_mode()`` (no autograd key:
    recorded at the device key, one Python frame more)."""
    op = torch.ops.torch_kernels.telemetry_probe3.default
    probes = torch_kernels.profiling.SIGNATURE_PROBES
    calls = {}
    for count in (probes, 2 * probes):
        sets = [[torch.ones(4, 8 + i) for _ in range(3)] for i in range(count)]
        turns = itertools.cycle(sets)
        calls[f"probe, 3 tensor arguments, {count} shapes in turn"] = lambda turns=turns: op(*next(turns))
    tensors = [torch.ones(4, 8) for _ in range(3)]

    def in_inference_mode():
        with torch.inference_mode():
            return op(*tensors)

    calls["probe, 3 tensor arguments, in inference_mode"] = in_inference_mode
    return calls


def per_call_seconds(call, n: int) -> float:
    """CPU seconds of this thread per call, over ``n`` calls."""
    start = time.thread_time()
    for _ in range(n):
        call()
    return (time.thread_time() - start) / n


def measure(call, rounds: int, n: int) -> dict:
    """Per-call seconds off, with the telemetry on and in a profile block: the fastest block of each, and
    the overheads as differences of those."""
    samples: dict[str, list[float]] = {"off": [], "telemetry": [], "no_shapes": [], "profile": []}
    call()
    for _ in range(rounds):
        samples["off"].append(per_call_seconds(call, n))
        for mode, shapes in (("telemetry", True), ("no_shapes", False)):
            telemetry = torch_kernels.profile.continuous(seconds=60, max_events=10_000, shapes=shapes)
            call()
            samples[mode].append(per_call_seconds(call, n))
            telemetry.stop()
        with torch_kernels.profile(calibrate=False, activities=[torch.profiler.ProfilerActivity.CPU]):
            call()
            samples["profile"].append(per_call_seconds(call, n))
    off = min(samples["off"])
    return {"off_us": off * 1e6, **{f"{mode}_overhead_us": (min(samples[mode]) - off) * 1e6
                                     for mode in ("telemetry", "no_shapes", "profile")},
            "off_median_us": statistics.median(samples["off"]) * 1e6,
            "telemetry_median_us": statistics.median(samples["telemetry"]) * 1e6,
            "rounds": rounds, "calls_per_block": n}


def hot_path(rounds: int, n: int) -> dict[int, float]:
    """The recording wrapper alone, in place of the autograd kernel (as the telemetry registers it) around a
    kernel that does nothing but report its backend (as backends.dispatch does), against that autograd
    kernel: ``{tensor arguments: added microseconds per call}``, fastest blocks."""
    telemetry = torch_kernels.profile.continuous(seconds=60, max_events=10_000)
    telemetry.stop()
    backends._observer = torch_kernels.profiling._running  # as while it runs

    def kernel(*tensors):
        observer = backends._observer
        if observer is not None and observer.calls and not observer.calls[-1]:
            observer.calls[-1] = "reference"
        return tensors[0]

    added = {}
    try:
        for arity in PROBE_ARITIES:
            op = getattr(torch.ops.torch_kernels, f"telemetry_probe{arity}").default
            autograd = _library._autograd_kernel(op, kernel, None, None)
            telemetry._recording(op, kernel)  # the device keys' wrapper, which makes the op's probes
            recorded = telemetry._recording(op, kernel, autograd)
            tensors = [torch.ones(4, 8) for _ in range(arity)]
            recorded(*tensors), recorded(*tensors)  # the signature seen twice: a probe
            bare = [per_call_seconds(lambda: autograd(*tensors), n) for _ in range(rounds)]
            wrapped = [per_call_seconds(lambda: recorded(*tensors), n) for _ in range(rounds)]
            added[arity] = (min(wrapped) - min(bare)) * 1e6
    finally:
        backends._observer = None
    return added


def bounded_ring(max_events: int, calls: int, call) -> int:
    """How many calls the ring holds after ``calls`` calls with room for ``max_events``."""
    telemetry = torch_kernels.profile.continuous(seconds=3600, max_events=max_events)
    try:
        for _ in range(calls):
            call()
        return len(telemetry.events())
    finally:
        telemetry.stop()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few rounds (a smoke test)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds per case (default 30, quick 5)")
    parser.add_argument("--calls", type=int, default=None, help="calls per timed block (default 500, quick 200)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="folder for the .md and .json")
    args = parser.parse_args(argv)
    rounds = args.rounds or (5 if args.quick else 30)
    n = args.calls or (200 if args.quick else 500)
    torch.set_num_threads(1)  # the tiny ops gain nothing from threads; a busy pool only adds noise

    probes = define_probes()
    x, means, whitener = torch.randn(8, 16), torch.randn(2, 16), torch.randn(16, 16)
    cases = {f"probe, {k} tensor argument{'s' if k > 1 else ''}": call for k, call in probes.items()}
    cases.update(other_paths())
    cases["mahalanobis_score 8x16, 2 means"] = lambda: torch_kernels.mahalanobis_score(x, means, whitener)
    results = {}
    for label, call in cases.items():
        results[label] = measure(call, rounds, n)
        print(f"{label}: {results[label]}", flush=True)
    checks = timeit.repeat("_observer is not None", globals=vars(backends), number=100_000, repeat=5)
    off_check_ns = min(checks) / 1e5 * 1e9
    held = bounded_ring(1000, 5000, probes[3])

    alone = hot_path(rounds, n)
    header = ["case", "off, us/call", "telemetry on, +us/call", "shapes=False, +us/call", "profile block, +us/call",
              "median off / on, us"]
    rows = [[label, f"{r['off_us']:.2f}", f"{r['telemetry_overhead_us']:.2f}", f"{r['no_shapes_overhead_us']:.2f}",
             f"{r['profile_overhead_us']:.2f}",
             f"{r['off_median_us']:.2f} / {r['telemetry_median_us']:.2f}"] for label, r in results.items()]
    report = "\n".join([
        "# Always-on telemetry: overhead per op call (CPU)", "",
        f"{machine_line()}; load average {os.getloadavg()[0]:.1f} when it ended (the machine is shared)", "",
        f"Fastest of {rounds} blocks of {n} calls per mode (the modes alternating), one torch thread; "
        "the last column the medians, for the machine's noise.", "",
        markdown_table(header, rows), "",
        "The recording wrapper alone (in place of the autograd kernel, around a kernel that only reports its "
        "backend), added per call: "
        + ", ".join(f"{k} tensor argument{'s' if k > 1 else ''} {us:.2f} us" for k, us in alone.items()) + ".", "",
        f"Off, the only cost on an op call is backends.dispatch's observer check: {off_check_ns:.0f} ns "
        "(timeit of the expression).",
        f"Bounded memory: after 5000 calls with max_events=1000 the ring holds {held} calls.", ""])
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"telemetry{'-quick' if args.quick else ''}"
    stem.with_suffix(".md").write_text(report)
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine_line(), "cases": results,
                                                     "hot_path_us": alone,
                                                     "off_check_ns": off_check_ns, "ring_held": held}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

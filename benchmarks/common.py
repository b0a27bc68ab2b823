"""What every benchmark script shares: timing, tables, the results folder, peer environments.

Only the standard library and torch, so that peer scripts run in their own environments can
import it too.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# pytorch-ood needs torchvision, which does not install beside the CPU torch the project pins;
# benchmarks/setup.sh gives it an environment of its own.
PEERS_PYTHON = pathlib.Path(os.environ.get("TORCH_KERNELS_PEERS_PYTHON", ROOT / ".venv-peers" / "bin" / "python"))


def seconds_per_call(fn, budget_s: float = 0.5, sync=None) -> float:
    """Wall time of one ``fn()``: the fastest of about ten timed blocks of calls in ``budget_s``.

    The minimum, not the mean, because this machine's noise only ever adds time. The first
    call (compiles, caches, kernel loads) is not timed; a call slower than the budget after it
    is timed once, alone. ``sync`` (e.g. ``torch.cuda.synchronize``) waits for an asynchronous
    device: it runs before each clock reading, so a block counts the work it queued.
    """
    fn()
    if sync:
        sync()
    start = time.perf_counter()
    fn()
    if sync:
        sync()
    best = time.perf_counter() - start
    if best >= budget_s:
        return best
    calls = max(1, int(budget_s / 10 / best))
    deadline = time.perf_counter() + budget_s
    blocks = 0
    while blocks < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if sync:
            sync()
        best = min(best, (time.perf_counter() - start) / calls)
        blocks += 1
    return best


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def run_peer(script: str, request: dict, timeout_s: float = 3600) -> dict | None:
    """Runs ``benchmarks/<script>`` under the peers' Python with ``request`` as JSON on stdin.

    Returns its JSON answer, or ``None`` (with the reason printed) when the environment is missing.
    """
    if not PEERS_PYTHON.exists():
        print(f"  peers: {PEERS_PYTHON} not found (run benchmarks/setup.sh); peer columns left out", file=sys.stderr)
        return None
    done = subprocess.run([str(PEERS_PYTHON), str(ROOT / "benchmarks" / script)], input=json.dumps(request),
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        print(f"  peers: {script} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine_line() -> str:
    import platform

    import torch

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}, {time.strftime('%Y-%m-%d')}")

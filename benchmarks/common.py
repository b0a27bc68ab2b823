"""What every benchmark script shares: timing, tables, the results folder, peer environments, the
family scripts' common options, and what each family script declares for the scripts that run or
summarize all of them (``family_benchmarks``).

Only the standard library and torch, so that peer scripts run in their own environments can
import it too; torch only inside functions, so that ``python benchmarks/common.py gpu-steps``
(benchmarks/gpu.sh's list of family steps) starts in no time.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
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


# ---------------------------------------------------------------------- the family scripts' options


def family_parser(description: str, quick: str, gpu: str, gpu_only: bool = False) -> argparse.ArgumentParser:
    """An argument parser with the options every family script takes: --quick, --gpu, --device, --budget, --out.

    ``quick`` and ``gpu`` say what those presets run; ``gpu_only``: --device and --out serve --gpu alone.
    """
    scope = "--gpu: " if gpu_only else ""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--gpu", action="store_true", help=gpu)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help=f"{scope}where the inputs live" if gpu_only else None)
    parser.add_argument("--budget", type=float, default=None, help="seconds of timing per measurement")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help=f"{scope}folder for the .md, .json and .png")
    return parser


def cuda_missing(device: str) -> bool:
    """True, with the reason printed, when ``device`` is cuda and this machine has none (the script exits 2)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch.cuda.is_available() is False here", file=sys.stderr)
        return True
    return False


# ------------------------------------------------------------------ what each family script declares

DECLARATION = "BENCHMARK"


def family_benchmarks() -> dict[str, dict]:
    """``{family: its declaration}`` for every ``benchmarks/<family>.py`` that assigns a literal dict to
    ``BENCHMARK`` at module level, in the order of the file names.

    Read from the source, not imported (the scripts import torch and torch_kernels). The keys, each optional:

    - ``gpu_step``: its step in benchmarks/gpu.sh, ``<family>.py --gpu --device D --out OUT *args`` capped at
      ``cap_s`` seconds; the steps run in the order of ``position`` (it decides which step the script's
      time budget cuts); ``autotuned``: it also runs in the autotuning pass, with ``autotune_args`` added;
    - ``summary_goals``: ``[[goal, target], ...]``, which benchmarks/gpu_summary.py reports from
      ``<family>-gpu.json`` in the order of ``summary_position``; the script's ``gpu_goals(data)``
      measures them, one ``goal_result`` each;
    - ``quick_compile_group``: its group of builds in ``benchmarks/compiled_kernels.py --quick``;
    - ``bench``: ``python -m torch_kernels bench`` (benchmarks/run.py) runs it.
    """
    found = {}
    for path in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == DECLARATION for t in node.targets):
                found[path.stem] = ast.literal_eval(node.value)
    return found


def declaring(key: str, order: str | None = None) -> list[tuple[str, dict]]:
    """``(family, declaration)`` of the family scripts that declare ``key``, by ``declaration[order]``
    (then by name) when given, else by name."""
    found = [(family, declared) for family, declared in family_benchmarks().items() if key in declared]
    if order is not None:
        found.sort(key=lambda item: (item[1][order], item[0]))
    return found


def gpu_steps(kind: str, dry_run: bool = False) -> list[list[str]]:
    """benchmarks/gpu.sh's family steps in run order, each a list of fields. ``bench``: the family, its cap
    in seconds, its extra arguments. ``autotune``: the family and its autotuning pass's extra arguments;
    in the dry run only the family with the smallest cap (CPU tensors never search: one pass shows the logic)."""
    steps = [(family, declared["gpu_step"]) for family, declared in declaring("gpu_step")]
    steps.sort(key=lambda item: (item[1]["position"], item[0]))
    if kind == "bench":
        return [[family, str(step["cap_s"]), *step.get("args", ())] for family, step in steps]
    tuned = [(family, step) for family, step in steps if step.get("autotuned")]
    if dry_run and tuned:
        tuned = [min(tuned, key=lambda item: item[1]["cap_s"])]
    return [[family, *step.get("autotune_args", ())] for family, step in tuned]


# ------------------------------------------------------------------------------ the summary's goals

MET, MISSED, NOT_MEASURED = "met", "missed", "not measured"


def goal_result(measured: str | None, status: str, detail: str) -> dict:
    """One goal's outcome in benchmarks/gpu_summary.py: the value shown, met / missed / not measured, and how."""
    return {"measured": measured, "status": status, "detail": detail}


def all_met(values, threshold) -> str:
    return MET if all(v >= threshold for v in values) else MISSED


if __name__ == "__main__":  # benchmarks/gpu.sh: its family steps, a line each, fields tab-separated
    cli = argparse.ArgumentParser(description="benchmarks/gpu.sh's family steps, a line each, fields tab-separated")
    cli.add_argument("command", choices=("gpu-steps",))
    cli.add_argument("kind", choices=("bench", "autotune"))
    cli.add_argument("--dry-run", action="store_true")
    cli_args = cli.parse_args()
    for fields in gpu_steps(cli_args.kind, cli_args.dry_run):
        print("\t".join(fields))

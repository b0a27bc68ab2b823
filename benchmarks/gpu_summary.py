"""One page for benchmarks/gpu.sh: every goal, its measured value, met / missed / not measured.

    python benchmarks/gpu_summary.py OUT_DIR [--device cuda|cpu]

Reads the ``*-gpu.json`` files the family benchmarks wrote to OUT_DIR (and ``steps.tsv``, the
script's record of each step), looks up the device's peaks (``torch_kernels.profiling.calibrate_device``, for
the page; each goal uses the rates its benchmark measured), and writes ``summary.md`` and ``summary.json``.
Goals: those the family scripts declare (``summary_goals`` in their ``BENCHMARK``, set for an H200
in the family issues), each measured by its script's ``gpu_goals`` from the script's JSON, in the
order of their ``summary_position``. On a CPU (the dry run) the values are computed the same way;
they only show the logic works.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import NOT_MEASURED, declaring, goal_result  # noqa: E402


def load(out: pathlib.Path, family: str):
    path = out / f"{family}-gpu.json"
    if not path.exists():
        return None, f"{path.name} missing (the benchmark failed or ran out of time: see steps)"
    try:
        return json.loads(path.read_text()), None
    except json.JSONDecodeError as e:
        return None, f"{path.name} unreadable: {e}"


def family_goals(out: pathlib.Path) -> list:
    """Every declared goal with its outcome: measured by its family script's ``gpu_goals`` from
    ``<family>-gpu.json``, else not measured, and why."""
    goals = []
    for family, declared in declaring("summary_goals", order="summary_position"):
        targets = declared["summary_goals"]
        data, why = load(out, family)
        if data is not None:
            try:
                measure = importlib.import_module(family).gpu_goals
            except Exception as e:  # the summary still stands without this family
                data, why = None, f"benchmarks/{family}.py does not import: {type(e).__name__}: {e}"
        results = [goal_result(None, NOT_MEASURED, why)] * len(targets) if data is None else measure(data)
        goals += [{"goal": name, "target": target, **result}
                  for (name, target), result in zip(targets, results, strict=True)]
    return goals


def peaks(device: str) -> dict:
    """The device's copy bandwidth and matmul rate, from the shared calibration (cached per device)."""
    from torch_kernels.profiling import calibrate_device

    measured = calibrate_device(device)
    return {"source": "torch_kernels.profiling.calibrate_device", "copy_GBps": measured.bytes_per_s / 1e9,
            "matmul_TFLOPs": measured.flops_per_s / 1e12, "matmul_dtype": measured.matmul_dtype}


def steps(out) -> list:
    path = out / "steps.tsv"
    if not path.exists():
        return []
    return [dict(zip(("step", "status", "seconds", "note"), line.split("\t", 3)))
            for line in path.read_text().splitlines() if line.strip()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path, help="the folder benchmarks/gpu.sh writes")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    goals = family_goals(args.out)
    try:
        device_peaks = peaks(args.device)
    except Exception as e:  # the summary still stands without them
        device_peaks = {"source": f"not measured: {type(e).__name__}: {e}"}
    ran = steps(args.out)
    lines = [f"# GPU script summary ({args.device})", "", time.strftime("%Y-%m-%d %H:%M"), "", "## Goals", "",
             "| goal | target | measured | status |", "|---|---|---|---|"]
    lines += [f"| {g['goal']} | {g['target']} | {g['measured'] or '-'} | {g['status']} |" for g in goals]
    lines += ["", "Details:", ""] + [f"- {g['goal']}: {g['detail']}" for g in goals]
    lines += ["", "## Device peaks", "", "; ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}"
                                                   for k, v in device_peaks.items())]
    if ran:
        lines += ["", "## Steps", "", "| step | status | seconds | note |", "|---|---|---|---|"]
        lines += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s.get('note', '')} |" for s in ran]
    if args.device != "cuda":
        lines += ["", "Dry run on the CPU: the values above test the script's logic and measure nothing."]
    text = "\n".join(lines) + "\n"
    (args.out / "summary.md").write_text(text)
    (args.out / "summary.json").write_text(json.dumps({"device": args.device, "goals": goals, "peaks": device_peaks,
                                                       "steps": ran}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

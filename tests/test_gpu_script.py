"""benchmarks/gpu.sh's dry run: every step of the GPU script, tiny on the CPU, writing the files a
GPU run writes (their names are binding), and a summary that lists every goal."""

from __future__ import annotations

import json
import os
import pathlib
import pkgutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import declaring  # noqa: E402

# every op family (a module of torch_kernels/ops, read from the folder: no torch import) has a GPU step
FAMILIES = tuple(sorted(info.name for info in pkgutil.iter_modules([str(ROOT / "torch_kernels" / "ops")])
                        if not info.name.startswith("_")))
FILES = ("summary.md", "summary.json", "steps.tsv", "doctor.txt", "device_tests.txt",
         *(f"{family}-gpu.{ext}" for family in FAMILIES for ext in ("md", "json", "png")))
# the goals the family scripts declare, in the summary's order
GOALS = tuple(goal for _, declared in declaring("summary_goals", order="summary_position")
              for goal, _ in declared["summary_goals"])


def test_dry_run_writes_every_file_and_every_goal(tmp_path):
    out, wheels = tmp_path / "out", tmp_path / "wheels"
    wheels.mkdir()  # an empty wheel folder: the peers' install path runs and notes their absence
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", "--wheels", str(wheels), str(out)],
                          capture_output=True, text=True, timeout=3600,  # a hang guard only
                          env={**os.environ, "PYTHON": sys.executable, "TORCH_KERNELS_BENCH_TRACEBACKS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    missing = [name for name in FILES if not (out / name).is_file() or not (out / name).stat().st_size]
    assert not missing, f"missing or empty: {missing}\n{done.stdout[-3000:]}"

    steps = {}
    for line in (out / "steps.tsv").read_text().splitlines():
        step, status, *_ = line.split("\t")
        steps.setdefault(step, []).append(status)
    for step in ("install", "doctor", "device_tests", *FAMILIES):
        assert steps.get(step) == ["ok"], f"{step}: {steps.get(step)}; see {out}/logs/{step}.log"
    assert steps.get("autotune-ood") == ["ok"] and steps.get("autotune-save") == ["ok"], steps
    saved = json.loads((out / "autotune" / "cpu.json").read_text())  # CPU tensors never search: empty
    assert saved == {"format": 1, "device": "cpu", "configs": {}}
    for peer in ("peer-fla-core", "peer-sageattention"):
        assert "note" in steps[peer], steps[peer]

    assert "all passed" in (out / "doctor.txt").read_text()
    tests = (out / "device_tests.txt").read_text()
    assert " passed" in tests and "failed" not in tests and "error" not in tests.lower(), tests[-2000:]

    summary = json.loads((out / "summary.json").read_text())
    assert [g["goal"] for g in summary["goals"]] == list(GOALS)
    assert all(g["status"] in ("met", "missed", "not measured") for g in summary["goals"])
    # measured on the CPU too (the logic, not the speed): the goals the tiny grids reach
    measured = {g["goal"] for g in summary["goals"] if g["measured"] is not None}
    assert {"paged attention prefill", "grouped_mm vs matmul rate", "fused_moe vs unfused"} <= measured
    assert summary["peaks"]["copy_GBps"] > 0 and summary["peaks"]["matmul_TFLOPs"] > 0
    text = (out / "summary.md").read_text()
    assert all(goal in text for goal in GOALS)


def test_family_scripts_declare_the_gpu_steps():
    """gpu.sh's family steps are those the family scripts declare (benchmarks/common.py lists them): one per
    family, each with its autotuning pass, and the dry run tunes one family only."""
    def listed(*args):
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "common.py"), "gpu-steps", *args],
                              capture_output=True, text=True, timeout=60, check=True)
        return [line.split("\t")[0] for line in done.stdout.splitlines()]

    assert sorted(listed("bench")) == sorted(FAMILIES)
    assert listed("autotune") == listed("bench")
    assert len(listed("autotune", "--dry-run")) == 1

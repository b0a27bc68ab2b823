"""Runs every benchmark script: ``python benchmarks/run.py [--quick] [--history [PATH]]`` (or ``python -m
torch_kernels bench``); ``compare`` and ``bisect`` read the history back (benchmarks/history.py).

Every family script whose ``BENCHMARK`` declares ``"bench": True`` (common.family_benchmarks), by name.
"""

import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # runpy.run_path does not add it
from common import BENCHMARKS, declaring  # noqa: E402


def main() -> int:
    if sys.argv[1:2] and sys.argv[1] in ("compare", "bisect", "bisect-step", "false-alarms"):
        import history

        return history.main(sys.argv[1:])
    scripts = [f"{family}.py" for family, declared in declaring("bench") if declared["bench"]]
    failed = [s for s in scripts
              if subprocess.run([sys.executable, str(BENCHMARKS / s), *sys.argv[1:]]).returncode != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Runs every benchmark script: ``python benchmarks/run.py [--quick]`` (or ``python -m torch_kernels bench``)."""

import pathlib
import subprocess
import sys

SCRIPTS = ["ood.py", "paged_attention.py", "linear_attention.py", "moe.py"]


def main() -> int:
    here = pathlib.Path(__file__).resolve().parent
    failed = [s for s in SCRIPTS if subprocess.run([sys.executable, str(here / s), *sys.argv[1:]]).returncode != 0]
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

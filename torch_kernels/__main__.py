"""Command line: ``python -m torch_kernels doctor`` | ``bench [args]``."""

from __future__ import annotations

import argparse
import pathlib
import runpy
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("doctor", help="list the backends that run here and check every op on each")
    bench = sub.add_parser("bench", help="run the benchmarks (from a source checkout)")
    bench.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)

    if args.command == "doctor":
        from .selftest import doctor

        return 0 if doctor() else 1
    runner = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
    if not runner.exists():
        print(f"bench: {runner} not found; the benchmarks ship with the source checkout", file=sys.stderr)
        return 2
    sys.argv = [str(runner), *args.args]
    runpy.run_path(str(runner), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())

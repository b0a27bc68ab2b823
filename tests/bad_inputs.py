"""Runs bad-input tables on one backend: ``python tests/bad_inputs.py BACKEND MODE TABLE...`` prints,
as each table ends, a JSON line ``{"table": TABLE, "results": [(case, exception type name, message),
...]}``. ``MODE``: the check mode, ``full`` or ``deferred``; in ``deferred`` mode an error the call does
not raise itself is the one ``torch_kernels.raise_deferred_errors()`` raises after it.

The tables are the families' (``BAD_INPUTS`` in each module of ``tests/families``);
``tests/test_bad_inputs.py`` runs every table of a backend in a process of its own, so that a crash
or a hang fails the tests of the tables it did not finish instead of ending the run.
"""

from __future__ import annotations

import json
import sys

import families
import torch_kernels


def run(table: str, backend: str, mode: str = "full") -> list[tuple[str, str, str]]:
    """``(case, exception type name, message)`` of every row of ``table`` on ``backend``, checked in ``mode``."""
    results = []
    for row in families.bad_input_tables()[table]:
        try:
            with torch_kernels.checks(mode):
                try:
                    row.call(backend)
                finally:
                    if mode == "deferred":
                        torch_kernels.raise_deferred_errors()
        except Exception as e:  # noqa: BLE001 - recorded and judged by the test
            results.append((row.case, type(e).__name__, str(e)))
        else:
            results.append((row.case, "no error", ""))
    return results


if __name__ == "__main__":
    backend, mode, *tables = sys.argv[1:]
    for table in tables:
        print(json.dumps({"table": table, "results": run(table, backend, mode)}), flush=True)

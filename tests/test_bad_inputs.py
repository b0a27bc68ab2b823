"""Every family's bad-input tables (``BAD_INPUTS`` in ``tests/families``) on every backend, and
every message pinned.

Each backend's tables run in a process of their own (``tests/bad_inputs.py``) with a time limit, so
a kernel that crashes or hangs fails the tests of the tables that process did not finish rather
than taking the run down. Every row must
raise its error type with a message starting with its argument's name, and every backend must
give the same messages as the reference. The reference's messages are pinned in full in
``tests/families/messages/<table>.txt``: a reworded message, or a table without that file, fails
here until it is reviewed and accepted (``EXPECTTEST_ACCEPT=1 pytest tests/test_bad_inputs.py -k
pinned`` writes the files). ``check_table_on_backend`` and ``check_pinned_messages`` are the checks,
for any table the runner finds (tests/test_families.py runs them on a toy family's).
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import bad_inputs
import families
from harness import require_backend
from torch_kernels import backends

TESTS = pathlib.Path(__file__).resolve().parent
TIME_LIMIT_S = 600  # a hang guard for all of one backend's tables
TABLES = families.bad_input_tables()
ACCEPT = os.environ.get("EXPECTTEST_ACCEPT", "") not in ("", "0")


def _in_subprocess(table: str, backend: str, mode: str = "full", tables: tuple[str, ...] | None = None) -> list[list[str]]:
    """``table``'s results on ``backend`` in ``mode``, from a process that runs ``tables`` (default:
    ``table`` alone) and is shared by every table it runs."""
    tables = tables or (table,)
    results, ending = _tables_in_subprocess(backend, mode, tables)
    # a table the process did not finish fails, and so does the last one where it ended badly after it
    if table not in results or (ending and table == tables[-1]):
        pytest.fail(f"{table} table on {backend}: the process running the tables {ending}")
    return results[table]


@functools.cache
def _tables_in_subprocess(backend: str, mode: str, tables: tuple[str, ...]) -> tuple[dict, str | None]:
    """``({table: results}, how the process ended: None when it exited cleanly)`` for the tables it
    finished: one process per backend and mode (importing the backends costs seconds a process),
    each table printed as it ends."""
    path = os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, str(TESTS / "bad_inputs.py"), backend, mode, *tables]
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=TESTS.parent,
                              env={**os.environ, "PYTHONPATH": path}, timeout=TIME_LIMIT_S)
        output = done.stdout
        ending = None if done.returncode == 0 else f"crashed (exit {done.returncode}):\n{done.stderr[-4000:]}"
    except subprocess.TimeoutExpired as e:
        output, ending = e.stdout or "", f"hung for over {TIME_LIMIT_S} s"
        output = output.decode() if isinstance(output, bytes) else output
    results = {}
    for line in output.splitlines():
        if line.startswith('{"table": '):
            finished = json.loads(line)
            results[finished["table"]] = finished["results"]
    return results, ending


@functools.cache
def _reference_text(table: str) -> str:
    return _format(bad_inputs.run(table, "reference"))


def _format(results) -> str:
    return "\n".join(f"{case} -> {error}: {message}" for case, error, message in results) + "\n"


def check_table_on_backend(table: str, backend: str, tables: tuple[str, ...] | None = None) -> None:
    """Fails unless every row of ``table`` raises its error naming its argument on ``backend``, in
    a process of its own (shared with ``tables``), with the reference's messages."""
    results = _in_subprocess(table, backend, tables=tables)
    rows = families.bad_input_tables()[table]
    assert [case for case, _, _ in results] == [row.case for row in rows]
    wrong = [f"{row.case}: expected {row.error.__name__} naming {row.argument!r}, got {error}: {message}"
             for row, (_, error, message) in zip(rows, results)
             if error != row.error.__name__ or not message.startswith(f"{row.argument}:")]
    assert not wrong, "\n".join(wrong)
    assert _format(results) == _reference_text(table), f"{backend}'s messages differ from the reference's"


def check_pinned_messages(table: str) -> None:
    """Fails unless the reference's messages for ``table`` are, word for word, what its pinned file
    holds (with ``EXPECTTEST_ACCEPT=1``, writes them there instead)."""
    pinned = families.pinned_messages(table)
    text = _reference_text(table)
    if ACCEPT:
        pinned.parent.mkdir(exist_ok=True)
        pinned.write_text(text)
        return
    assert pinned.exists(), (f"{table}: no pinned messages in {pinned}; review the reference's messages and "
                             f"accept them with EXPECTTEST_ACCEPT=1 pytest tests/test_bad_inputs.py -k pinned")
    assert text == pinned.read_text(), f"{table}: the messages differ from {pinned} (accept a reviewed change " \
        "with EXPECTTEST_ACCEPT=1)"


@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.xdist_group(f"bad-inputs-{b}"))
                                     for b in backends.BACKENDS])
@pytest.mark.parametrize("table", TABLES)
def test_table_on_backend(table, backend):
    require_backend(backend)
    check_table_on_backend(table, backend, tuple(TABLES))


@pytest.mark.parametrize("table", TABLES)
def test_pinned_messages(table):
    """The reference's messages, word for word, as ``messages/<table>.txt`` pins them."""
    check_pinned_messages(table)


DEFERRED = re.compile(r" \(found by a deferred check\)( \(and \d+ other failed checks?\))?$")


# on Triton, the accelerators' default (the checks and what they make safe live in the op layer,
# shared by every backend; each family's tests hold the others' deferred results)
@pytest.mark.parametrize("backend", [pytest.param("triton", marks=pytest.mark.xdist_group("bad-inputs-deferred"))])
@pytest.mark.parametrize("table", TABLES)
def test_table_in_deferred_mode(table, backend):
    """In the deferred check mode every row still fails with its full-mode error: a shape, dtype
    or device error at the call, a value error from ``raise_deferred_errors()`` after it, naming the
    same argument with the full mode's message less the offending value."""
    require_backend(backend)
    full = {case: (error, message) for case, error, message in bad_inputs.run(table, "reference")}
    wrong = []
    for case, error, message in _in_subprocess(table, backend, "deferred", tuple(TABLES)):
        want_error, want = full[case]
        deferred = DEFERRED.search(message)
        prefix = message[:deferred.start()] if deferred else message
        if error != want_error or not (want == message or (deferred and want.startswith(prefix) and prefix)):
            wrong.append(f"{case}: expected {want_error}: {want}, got {error}: {message}")
    assert not wrong, "\n".join(wrong)

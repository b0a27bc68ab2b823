"""The two check modes (``TORCH_KERNELS_CHECKS``, ``torch_kernels.checks``): which applies, the
deferred mode's error word, no host read of tensor data in deferred mode for any op, and safe
results for bad entries. The bad-input tables in deferred mode: ``tests/test_bad_inputs.py``."""

from __future__ import annotations

import math

import pytest
import torch

import torch_kernels
from harness import HostReads, require_backend
from torch_kernels import _checks, families

CASES = {case.op: case for case in families.selftest_cases()}  # one doctor case per op (the first)


@pytest.fixture(autouse=True)
def _no_errors_left():
    torch_kernels.raise_deferred_errors()  # a test starts and ends with a clear word
    yield
    torch_kernels.raise_deferred_errors()


def test_mode_by_device_environment_and_block(monkeypatch):
    monkeypatch.delenv(_checks.CHECKS_ENV_VAR, raising=False)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert (_checks.mode_for(cpu), _checks.mode_for(cuda)) == ("full", "deferred")
    monkeypatch.setenv(_checks.CHECKS_ENV_VAR, "deferred")
    assert _checks.mode_for(cpu) == "deferred"
    with torch_kernels.checks("full"):
        assert _checks.mode_for(cuda) == "full"
        with torch_kernels.checks("deferred"):
            assert _checks.mode_for(cpu) == "deferred"
        assert _checks.mode_for(cpu) == "full"
    monkeypatch.setenv(_checks.CHECKS_ENV_VAR, "lazy")
    with pytest.raises(ValueError, match="^TORCH_KERNELS_CHECKS: expected one of"):
        _checks.mode_for(cpu)
    with pytest.raises(ValueError, match="^checks: expected one of"):
        with torch_kernels.checks("off"):
            pass


def test_raise_deferred_errors_reads_once_raises_the_first_and_clears():
    with torch_kernels.checks("deferred"):
        for bad in (torch.tensor([False, True]), torch.tensor(False), torch.tensor([True])):
            checks = _checks.ValueChecks(torch.device("cpu"))
            checks.add(bad, "alpha: expected something")
            checks.add(torch.tensor(True), "beta: expected something else")
            checks.finish()  # records, raises nothing
    with pytest.raises(ValueError, match=r"^alpha: expected something \(found by a deferred check\) "
                                         r"\(and 1 other failed check\)$"):
        torch_kernels.raise_deferred_errors()
    torch_kernels.raise_deferred_errors()  # cleared: nothing left
    with torch_kernels.checks("full"):
        checks = _checks.ValueChecks(torch.device("cpu"))
        checks.add(torch.tensor([False, True]), "alpha: expected something", lambda: "got 7")
        with pytest.raises(ValueError, match="^alpha: expected something, got 7$"):
            checks.finish()


@pytest.mark.parametrize("op", sorted(CASES))
def test_deferred_mode_reads_no_tensor_data_on_the_host(op):
    """Every op's doctor case on the Triton backend (the accelerator's path, here interpreted):
    no call from the project's code brings tensor data to the host in deferred mode, and the
    result equals the full mode's."""
    require_backend("triton")
    case = CASES[op]
    inputs = case.make_inputs(torch.Generator().manual_seed(0), torch.float32, "cpu")
    with torch_kernels.checks("full"):
        want = case.run(*inputs, implementation="triton")
    inputs = case.make_inputs(torch.Generator().manual_seed(0), torch.float32, "cpu")
    with torch_kernels.checks("deferred"), HostReads() as guard:
        got = case.run(*inputs, implementation="triton")
    assert not guard.reads, f"{op} read tensor data on the host in deferred mode: {guard.reads}"
    for g, w in zip(*(x if isinstance(x, (tuple, list)) else (x,) for x in (got, want))):
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)

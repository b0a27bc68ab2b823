"""torch_kernels.profile: every op's FLOP and byte formulas, the per-op roofline table, the Chrome
trace, the cached device calibration, and nothing left behind when the block ends."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.flop_counter import flop_registry

import torch_kernels
from torch_kernels import _library, backends, profiling
from torch_kernels.ops import ood as ood_ops

from harness import (
    FLOAT32_BYTES, compiled_fullgraph, counted_flops, nbytes, only_row, profiled, random_tensor, require_backend,
)

# ---- every op has both formulas ----

def test_every_op_has_flop_and_byte_formulas():
    """Every op in the torch_kernels namespace (as the dispatcher lists them, so an op defined
    without formulas fails here) has a byte formula and a FLOP formula FlopCounterMode uses."""
    names = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
                   if n.startswith("torch_kernels::"))
    assert set(names) == set(_library._definitions), "every op is defined through _library.define"
    missing = [n for n in names if _library.cost_of(n) is None]
    assert not missing, f"ops without register_cost: {missing}"
    uncounted = [n for n in names if getattr(torch.ops.torch_kernels, n) not in flop_registry]
    assert not uncounted, f"ops FlopCounterMode cannot count: {uncounted}"


# ---- byte formulas (each family's own are in its test file) ----

def test_backward_ops_are_recorded_with_their_formulas():
    """Training steps record each backward op, with the FLOPs FlopCounterMode counts for it."""
    x = random_tensor(7, 5, seed=19).requires_grad_()
    w = random_tensor(2, 5, 3, seed=20).requires_grad_()
    offsets = torch.tensor([3, 6], dtype=torch.int32)
    step = lambda: torch_kernels.grouped_mm(x, w, offsets).square().sum().backward()  # noqa: E731
    prof, _ = profiled(step)
    assert [r["calls"] for r in prof.rows if r["op"] == "grouped_mm"] == [2]  # the forward and d x
    grad = only_row(prof, "grouped_mm_weight_grad")
    assert grad["flops"] == 2 * 6 * 5 * 3
    assert grad["bytes"] == 6 * 5 * FLOAT32_BYTES + 6 * 3 * FLOAT32_BYTES + nbytes(offsets, w)
    assert sum(r["flops"] for r in prof.rows) == counted_flops(step)


# ---- the profile ----

def test_profile_counts_calls_per_op_and_backend(tmp_path, monkeypatch):
    require_backend("triton")
    peaks = profiling.DevicePeaks("stub", flops_per_s=2e9, bytes_per_s=1e9, matmul_dtype="float32")
    monkeypatch.setattr(profiling, "calibrate_device", lambda device: peaks)
    x, means, whitener = random_tensor(24, 16, seed=21), random_tensor(3, 16, seed=22), random_tensor(16, 16, seed=23)
    trace = tmp_path / "trace.json"
    with torch_kernels.profile(trace=trace) as prof:
        for _ in range(3):
            torch_kernels.mahalanobis_score(x, means, whitener)
        torch_kernels.mahalanobis_score(x, means, whitener, implementation="triton")
    calls = {(r["op"], r["backend"]): r["calls"] for r in prof.rows}
    assert calls == {("mahalanobis_score", "reference"): 3, ("mahalanobis_score", "triton"): 1}
    for row in prof.rows:
        assert row["seconds"] > 0 and row["mean_seconds"] == pytest.approx(row["seconds"] / row["calls"])
        assert row["flops"] == row["calls"] * ood_ops.score_flops(24, 3, 16)
        assert row["flops_per_s"] == pytest.approx(row["flops"] / row["seconds"])
        assert row["bytes_per_s"] == pytest.approx(row["bytes"] / row["seconds"])
        assert row["peak_flops_fraction"] == pytest.approx(row["flops_per_s"] / 2e9)
        assert row["peak_bandwidth_fraction"] == pytest.approx(row["bytes_per_s"] / 1e9)
    table = str(prof)
    assert "GFLOP/s" in table and "% peak GB/s" in table
    lines = table.splitlines()
    for backend in ("reference", "triton"):
        row = next(r for r in prof.rows if r["backend"] == backend)
        line = next(line for line in lines if line.split()[:2] == ["mahalanobis_score", backend])
        assert line.split()[2] == str(row["calls"])
        assert f"{row['peak_bandwidth_fraction'] * 100:,.1f}" == line.split()[-1]
    json.dumps(prof.rows)  # plain data
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"torch_kernels::mahalanobis_score[reference]", "torch_kernels::mahalanobis_score[triton]"} <= names
    second = tmp_path / "again.json"
    prof.export_chrome_trace(second)
    copied = {e.get("name") for e in json.loads(second.read_text())["traceEvents"]}
    assert "torch_kernels::mahalanobis_score[triton]" in copied


def test_a_call_without_a_backend_kernel_is_labelled():
    """edm_score_backward computes the reference gradients in the op itself, on every backend."""
    x = random_tensor(5, 4, seed=24).requires_grad_()
    params = [torch.rand(*s, generator=torch.Generator().manual_seed(25)) * 0.3 + 0.1
              for s in [(4,), (4,), (1, 4), (1,), (1, 6), (4, 6), (0, 6, 6), (0, 6), (0, 6, 6), (0, 6), (6, 4), (4,)]]
    prof, _ = profiled(lambda: torch_kernels.edm_score(x, *params, [0.5], 0.8).sum().backward())
    assert {(r["op"], r["backend"]) for r in prof.rows} == {("edm_score", "reference"),
                                                           ("edm_score_backward", profiling.NO_KERNEL)}


def test_profile_records_compiled_code():
    """Code compiled before the block and code compiled inside it (traced while it is active)."""
    x, means, whitener = random_tensor(12, 8, seed=26), random_tensor(2, 8, seed=27), random_tensor(8, 8, seed=28)
    compiled = compiled_fullgraph(lambda x: torch_kernels.mahalanobis_score(2 * x, means, whitener).sum())
    compiled(x)

    def run():
        compiled(x)
        compiled(x)
        return torch.compile(lambda x: torch_kernels.mahalanobis_score(x + 1, means, whitener), fullgraph=True)(x)

    prof, out = profiled(run)
    row = only_row(prof, "mahalanobis_score")
    assert (row["backend"], row["calls"], row["flops"]) == ("reference", 3, 3 * ood_ops.score_flops(12, 2, 8))
    torch.testing.assert_close(out, torch_kernels.mahalanobis_score(x + 1, means, whitener))


def test_nothing_is_recorded_or_swapped_outside_the_block():
    ops = sorted(_library._definitions)
    before = {name: torch._C._dispatch_dump(f"torch_kernels::{name}") for name in ops}
    x, means, whitener = random_tensor(6, 4, seed=29), random_tensor(2, 4, seed=30), random_tensor(4, 4, seed=31)
    with torch_kernels.profile(calibrate=False) as prof:
        torch_kernels.mahalanobis_score(x, means, whitener)
        assert backends._observer is not None
        assert torch._C._dispatch_dump("torch_kernels::mahalanobis_score") != before["mahalanobis_score"]
        with pytest.raises(RuntimeError, match="do not nest"):
            with torch_kernels.profile(calibrate=False):
                pass
    torch_kernels.mahalanobis_score(x, means, whitener)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        torch_kernels.mahalanobis_score(x, means, whitener)  # the profiler alone records nothing here
    assert [r["calls"] for r in prof.rows] == [1] and len(prof._calls) == 1
    assert backends._observer is None and profiling._active is None
    assert {name: torch._C._dispatch_dump(f"torch_kernels::{name}") for name in ops} == before

    with pytest.raises(ValueError, match="x"):  # an op's error inside the block leaves nothing behind either
        with torch_kernels.profile(calibrate=False):
            torch_kernels.mahalanobis_score(x[:, :3], means, whitener)
    assert backends._observer is None and profiling._active is None
    assert {name: torch._C._dispatch_dump(f"torch_kernels::{name}") for name in ops} == before


def test_empty_profile_says_so():
    prof, _ = profiled(lambda: torch.ones(3).sum())
    assert prof.rows == [] and "no torch_kernels op ran" in str(prof)


# ---- calibration ----

def test_calibration_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_KERNELS_CACHE", str(tmp_path))
    measured = []

    def stub(device):
        measured.append(device)
        return profiling.DevicePeaks(profiling.device_name(device), 1e11 * len(measured), 5e9, "float32")

    monkeypatch.setattr(profiling, "measure_peaks", stub)
    first = torch_kernels.calibrate_device("cpu")
    assert len(measured) == 1 and first.flops_per_s == 1e11
    cached = json.loads((tmp_path / profiling.CACHE_FILE).read_text())
    assert cached[profiling.device_name("cpu")]["flops_per_s"] == 1e11
    assert torch_kernels.calibrate_device("cpu") == first and len(measured) == 1  # read back from the file
    assert torch_kernels.calibrate_device("cpu", refresh=True).flops_per_s == 2e11 and len(measured) == 2

    (tmp_path / profiling.CACHE_FILE).write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable peaks cache"):
        assert torch_kernels.calibrate_device("cpu").flops_per_s == 3e11
    assert torch_kernels.calibrate_device("cpu").flops_per_s == 3e11 and len(measured) == 3

    with torch_kernels.profile() as prof:  # the profile looks the peaks up through the same cache
        torch_kernels.mahalanobis_score(random_tensor(4, 4, seed=32), random_tensor(1, 4, seed=33), torch.eye(4))
    assert len(measured) == 3 and prof.peaks[profiling.device_name("cpu")].flops_per_s == 3e11
    assert "300.0 GFLOP/s (float32 matmul)" in str(prof)


def test_measured_peaks_are_plausible():
    peaks = profiling.measure_peaks("cpu")
    assert peaks.device == profiling.device_name("cpu") and peaks.matmul_dtype == "float32"
    # a CPU core does at least 1e8 FLOP/s and copies at least 1e8 B/s, and no machine reaches 1e16
    for rate in (peaks.flops_per_s, peaks.bytes_per_s):
        assert math.isfinite(rate) and 1e8 < rate < 1e16

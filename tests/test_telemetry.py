"""torch_kernels.profile.continuous: the always-on telemetry's records, its bounds, its snapshot's
table, rows and Chrome trace, and that nothing stays swapped once it stops."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import torch_kernels
from torch_kernels import _library, backends, profiling
from torch_kernels.ops import ood as ood_ops

from harness import nbytes, random_tensor, require_backend, run_isolated


def dispatch_dumps() -> dict[str, str]:
    return {name: torch._C._dispatch_dump(f"torch_kernels::{name}") for name in sorted(_library._definitions)}


@pytest.fixture
def inputs():
    return random_tensor(24, 16, seed=41), random_tensor(3, 16, seed=42), random_tensor(16, 16, seed=43)


def test_each_call_is_recorded_with_its_backend_shapes_and_costs(inputs):
    require_backend("triton")
    x, means, whitener = inputs
    before = dispatch_dumps()
    telemetry = torch_kernels.profile.continuous(seconds=60, max_events=100)
    try:
        assert torch_kernels.profile.telemetry() is telemetry and backends._observer is not None
        for _ in range(3):
            out = torch_kernels.mahalanobis_score(x, means, whitener)
        torch_kernels.mahalanobis_score(x[:8], means, whitener, implementation="triton")
        snap = torch_kernels.profile.snapshot()
    finally:
        telemetry.stop()
    assert dispatch_dumps() == before and backends._observer is None and torch_kernels.profile.telemetry() is None
    torch_kernels.mahalanobis_score(x, means, whitener)  # after stop: not recorded
    assert len(telemetry.events()) == 4

    events = snap.events
    assert [(e["op"], e["backend"]) for e in events] == [("mahalanobis_score", "reference")] * 3 + [
        ("mahalanobis_score", "triton")]
    assert events[0]["shapes"] == [[24, 16], [3, 16], [16, 16]] and events[0]["dtypes"] == ["float32"] * 3
    assert events[3]["shapes"][0] == [8, 16] and events[3]["arguments"] == ["triton"]
    assert events[0]["flops"] == ood_ops.score_flops(24, 3, 16)
    assert events[0]["bytes"] == nbytes(x, means, whitener, out)
    assert events[3]["flops"] == ood_ops.score_flops(8, 3, 16)
    assert all(e["seconds"] > 0 for e in events) and events[0]["start"] <= events[3]["start"] <= time.time()
    json.dumps(events)

    rows = {(r["op"], r["backend"]): r for r in snap.rows}
    assert rows[("mahalanobis_score", "reference")]["calls"] == 3
    assert rows[("mahalanobis_score", "reference")]["flops"] == 3 * ood_ops.score_flops(24, 3, 16)
    assert rows[("mahalanobis_score", "reference")]["seconds"] == pytest.approx(sum(e["seconds"] for e in events[:3]))
    table = str(snap)
    assert table.startswith("torch_kernels telemetry: 4 op calls") and "% peak GB/s" in table
    trace = snap.chrome_trace()["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert [e["name"] for e in spans] == ["torch_kernels::mahalanobis_score[reference]"] * 3 + [
        "torch_kernels::mahalanobis_score[triton]"]
    assert spans[0]["dur"] == pytest.approx(events[0]["seconds"] * 1e6)


def test_memory_and_time_are_bounded(inputs):
    x, means, whitener = inputs
    with torch_kernels.profile.continuous(seconds=60, max_events=5) as telemetry:
        for _ in range(12):
            torch_kernels.mahalanobis_score(x, means, whitener)
        assert len(telemetry._ring) == 5 and len(telemetry.events()) == 5
        time.sleep(0.05)
        torch_kernels.mahalanobis_score(x[:4], means, whitener)
        recent = telemetry.events(seconds=0.04)  # only the call after the pause
        assert [e["shapes"][0] for e in recent] == [[4, 16]]
    with torch_kernels.profile.continuous(shapes=False) as telemetry:  # op, backend and time only
        torch_kernels.mahalanobis_score(x, means, whitener)
        (event,) = telemetry.events()
    assert (event["op"], event["backend"], event["shapes"], event["flops"]) == ("mahalanobis_score", "reference", [],
                                                                                None)
    with pytest.raises(ValueError, match="^max_events: "):
        torch_kernels.profile.continuous(max_events=0)
    with pytest.raises(ValueError, match="^seconds: "):
        torch_kernels.profile.continuous(seconds=0)
    with pytest.raises(RuntimeError, match="telemetry is off"):
        torch_kernels.profile.snapshot()


def test_each_record_describes_its_own_call_whichever_path_takes_it():
    """A call matching a recent signature (checked in C, recorded at the autograd key) and the calls that
    do not (another shape, dtype or argument, more signatures than probes, inference mode, a gradient, a
    dispatch mode): each record has its own call's shapes, dtypes and arguments, and each call one record."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert profiling._guard_maker() is not None  # this torch's TensorGuards behave as the probes need
    means, whitener = random_tensor(3, 16, seed=46), random_tensor(16, 16, seed=47)
    expected = []

    def call(x, m=means, w=whitener, **kwargs):
        torch_kernels.mahalanobis_score(x, m, w, **kwargs)
        expected.append(([list(t.shape) for t in (x, m, w)], [str(t.dtype).removeprefix("torch.") for t in (x, m, w)],
                         list(kwargs.values())))

    with torch_kernels.profile.continuous() as telemetry:
        for rows in (4, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 4, 5, 9, 6, 7, 8, 4):  # 6 signatures in turn: more than probes
            call(random_tensor(rows, 16, seed=rows))
        probes = telemetry._describers["mahalanobis_score"]  # probes made: their function first, not the memo
        assert [f.__name__ for f in probes] == ["<lambda>", "<lambda>"]
        x = random_tensor(4, 16, seed=48)
        call(x.double(), means.double(), whitener.double())
        call(x, w=whitener.t().contiguous().t())  # other strides: the same description
        call(x, implementation="reference")
        call(x.clone().requires_grad_())  # through the autograd kernel, recorded at the device key
        with torch.inference_mode():  # no autograd key: recorded at the device key
            call(x)
        with PassThrough():
            call(x)
        call(x)
        # an optional tensor given or None between other arguments: probes for both
        conv_x, conv_w, bias = random_tensor(1, 4, 6, seed=49), random_tensor(4, 3, seed=50), random_tensor(4, seed=51)
        for given in (None, None, None, bias, bias, bias, None, bias, None):
            torch_kernels.causal_conv1d_fn(conv_x, conv_w, given, activation="silu")
            tensors = (conv_x, conv_w) if given is None else (conv_x, conv_w, given)
            expected.append(([list(t.shape) for t in tensors], ["float32"] * len(tensors), ["silu"]))
        events = telemetry.events()
        ring = list(telemetry._ring)
    assert [(e["shapes"], e["dtypes"], e["arguments"]) for e in events] == expected
    assert all(e["backend"] == "reference" for e in events)
    assert ring[0][4] is ring[2][4] and ring[-1][4] is ring[-3][4]  # one description shared by a signature's records

    def untrackable(value) -> bool:  # what the garbage collector stops tracking after a pass
        return type(value) in (str, float, int, type(None), torch.dtype) or (
            type(value) is tuple and all(untrackable(v) for v in value))

    assert all(untrackable(record) for record in ring)


def test_a_small_index_view_does_not_keep_its_buffer_alive():
    """A record keeps small integer tensors (cost formulas read them); a few rows sliced from a large
    buffer are copied, or the ring would hold every step's buffer."""
    import gc
    import weakref

    with torch_kernels.profile.continuous() as telemetry:
        buffer = torch.tensor([3, 1] + [0] * 99_998, dtype=torch.int32)
        alive = weakref.ref(buffer)
        torch_kernels.causal_conv1d_update(torch.randn(2, 8), torch.randn(2, 8, 5), torch.randn(8, 4),
                                           cache_seqlens=buffer[:2])
        del buffer
        gc.collect()
        assert alive() is None
        assert [e["op"] for e in telemetry.events()] == ["causal_conv1d_update"]


def test_a_profile_block_inside_feeds_it_and_nests_cleanly(inputs):
    x, means, whitener = inputs
    before = dispatch_dumps()
    with torch_kernels.profile.continuous() as telemetry:
        torch_kernels.mahalanobis_score(x, means, whitener)
        with torch_kernels.profile(calibrate=False) as prof:
            torch_kernels.mahalanobis_score(x, means, whitener)
        torch_kernels.mahalanobis_score(x, means, whitener)  # the telemetry's kernels are back
        with pytest.raises(RuntimeError, match="outside a profile block"):
            with torch_kernels.profile(calibrate=False):
                torch_kernels.profile.continuous()
        assert torch_kernels.profile.telemetry() is telemetry
        events = telemetry.events()
    assert [r["calls"] for r in prof.rows] == [1]
    assert len(events) == 3 and {e["flops"] for e in events} == {ood_ops.score_flops(24, 3, 16)}
    assert events[1]["seconds"] == pytest.approx(prof.rows[0]["seconds"])
    assert dispatch_dumps() == before and backends._observer is None and profiling._active is None


def test_calls_from_several_threads_keep_their_own_backend():
    """Two threads, one on each backend, many calls each: every record names its own thread's backend."""
    require_backend("triton")
    x, w = random_tensor(6, 8, seed=44), random_tensor(2, 8, 4, seed=45)
    offsets = torch.tensor([2, 6], dtype=torch.int32)

    def work(backend):
        for _ in range(30):
            torch_kernels.grouped_mm(x, w, offsets, implementation=backend)

    with torch_kernels.profile.continuous() as telemetry:
        threads = [threading.Thread(target=work, args=(b,)) for b in ("reference", "triton")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        events = telemetry.events()
    assert len(events) == 60
    for backend in ("reference", "triton"):
        mine = [e for e in events if e["arguments"] == [backend]]
        assert len(mine) == 30 and {e["backend"] for e in mine} == {backend}
        assert {e["flops"] for e in mine} == {2 * 6 * 8 * 4}


def test_on_from_the_environment_and_the_overhead_benchmark_runs(tmp_path):
    """``TORCH_KERNELS_TELEMETRY=1`` at import; benchmarks/telemetry.py's smoke (its figures are reported,
    not asserted: a busy machine's timings are no test)."""
    out = run_isolated(
        "import os, subprocess, sys, json\n"
        "os.environ['TORCH_KERNELS_TELEMETRY'] = '1'\n"
        "import torch, torch_kernels\n"
        "t = torch_kernels.profile.telemetry()\n"
        "torch_kernels.mahalanobis_score(torch.ones(2, 3), torch.ones(1, 3), torch.eye(3))\n"
        "print(t is not None, len(t.events()))\n"
        "del os.environ['TORCH_KERNELS_TELEMETRY']\n"
        f"done = subprocess.run([sys.executable, 'benchmarks/telemetry.py', '--quick', '--rounds', '2', '--calls', "
        f"'20', '--out', {str(tmp_path)!r}], capture_output=True, text=True)\n"
        "assert done.returncode == 0, done.stderr\n")
    assert out.split() == ["True", "1"]
    data = json.loads((tmp_path / "telemetry-quick.json").read_text())
    assert data["ring_held"] == 1000
    assert set(data["hot_path_us"]) == {"1", "3", "6"}
    assert all(isinstance(c["telemetry_overhead_us"], float) for c in data["cases"].values())

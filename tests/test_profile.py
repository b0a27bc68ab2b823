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
from torch_kernels.ops import paged_attention as paged_ops
from torch_kernels.ops import quantized_attention as quantized_ops

from harness import compiled_fullgraph, counted_flops, require_backend

FLOAT = 4  # bytes of a float32


def profiled(fn, **kwargs):
    """(the profile, fn's result) of ``fn`` run inside ``torch_kernels.profile`` (no calibration)."""
    with torch_kernels.profile(calibrate=False, **kwargs) as prof:
        out = fn()
    return prof, out


def only_row(prof, op):
    rows = [r for r in prof.rows if r["op"] == op]
    assert len(rows) == 1, f"{op}: {prof.rows}"
    return rows[0]


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _random(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


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


# ---- byte formulas against counts made here ----

def test_ood_bytes_are_every_input_and_output():
    b, c, d = 20, 3, 16
    x, means, whitener = _random(b, d, seed=1), _random(c, d, seed=2), _random(d, d, seed=3)
    prof, _ = profiled(lambda: torch_kernels.mahalanobis_score(x, means, whitener))
    row = only_row(prof, "mahalanobis_score")
    assert row["bytes"] == ood_ops.score_bytes(b, c, d, FLOAT, FLOAT) == nbytes(x, means, whitener) + b * FLOAT
    assert row["flops"] == ood_ops.score_flops(b, c, d)

    xg = x.clone().requires_grad_()
    prof, _ = profiled(lambda: torch_kernels.mahalanobis_score(xg, means, whitener).sum().backward())
    backward = only_row(prof, "mahalanobis_score_backward")
    # reads the score's gradient, x, means and whitener; writes a gradient of each of the three
    assert backward["bytes"] == b * FLOAT + 2 * nbytes(x, means, whitener)
    assert backward["flops"] == ood_ops.score_flops(b, c, d) + 6 * b * d * d


def test_edm_bytes_match_the_analytic_count():
    b, d, h, k, levels = 9, 6, 8, 2, 3
    gen = torch.Generator().manual_seed(4)
    shapes = [(d,), (d,), (levels, d), (levels,), (levels, h), (d, h), (k, h, h), (k, h), (k, h, h), (k, h),
              (h, d), (d,)]
    params = [torch.rand(*s, generator=gen) * 0.3 + 0.1 for s in shapes]
    x = torch.randn(b, d, generator=gen)
    sigmas = [0.2, 0.6, 1.8]
    prof, _ = profiled(lambda: torch_kernels.edm_score(x, *params, sigmas, 0.8, "scoped"))
    row = only_row(prof, "edm_score")
    assert row["bytes"] == ood_ops.edm_score_bytes(b, d, h, k, levels, FLOAT, FLOAT)
    assert row["flops"] == ood_ops.edm_score_flops(b, d, h, k, levels, True)


def test_quantized_attention_bytes_match_the_analytic_count():
    b, hq, hkv, nq, nk, d = 2, 4, 2, 10, 14, 64
    q, k, v = _random(b, hq, nq, d, seed=5), _random(b, hkv, nk, d, seed=6), _random(b, hkv, nk, d, seed=7)
    prof, _ = profiled(lambda: torch_kernels.quantized_attention(q, k, v, causal=True))
    row = only_row(prof, "quantized_attention")
    assert row["bytes"] == quantized_ops.quantized_attention_bytes(hq, hkv, d, [(nq, nk)] * b, FLOAT)
    assert row["flops"] == 4 * hq * d * b * sum(min(nk, i + nk - nq + 1) for i in range(nq))


def test_linear_attention_bytes_are_every_input_and_output():
    batch, length, heads, k_dim, v_dim = 1, 9, 2, 8, 4
    q, k = _random(batch, length, heads, k_dim, seed=8), _random(batch, length, heads, k_dim, seed=9)
    v = _random(batch, length, heads, v_dim, seed=10)
    g = -0.1 * torch.rand(batch, length, heads, generator=torch.Generator().manual_seed(11))
    prof, (o, _) = profiled(lambda: torch_kernels.chunk_simple_gla(q, k, v, g, output_final_state=True))
    state = batch * heads * k_dim * v_dim * FLOAT  # the final state, float32, always written
    assert only_row(prof, "chunk_simple_gla")["bytes"] == nbytes(q, k, v, g, o) + state


def _paged_batch(sliding_window=None, fused=False):
    """Two sequences over 4-slot pages in a shuffled pool: (kwargs of ragged_paged_attention,
    query lengths, kv lengths, page size)."""
    q_lens, kv_lens, page, hq, hkv, d = [3, 1], [7, 10], 4, 4, 2, 8
    gen = torch.Generator().manual_seed(12)
    pool = 8
    caches = [torch.randn(pool, page, hkv, d, generator=gen) for _ in range(2)]
    block_table = torch.randperm(pool, generator=gen, dtype=torch.int32)[:6].view(2, 3)
    args = dict(query=torch.randn(sum(q_lens), hq, d, generator=gen), key_cache=caches[0], value_cache=caches[1],
                cu_q_lens=torch.tensor([0, 3, 4], dtype=torch.int32), kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
                block_table=block_table, sm_scale=d ** -0.5, sliding_window=sliding_window)
    if fused:  # the new tokens' keys and values written by the same call; the last token is padding
        positions = [(s, p) for s in range(2) for p in range(kv_lens[s] - q_lens[s], kv_lens[s])]
        slots = [int(block_table[s, p // page]) * page + p % page for s, p in positions]
        slots[-1] = -1
        key, value = (torch.randn(sum(q_lens), hkv, d, generator=gen) for _ in range(2))
        args.update(key=key, value=value, slot_mapping=torch.tensor(slots, dtype=torch.int64))
    return args, q_lens, kv_lens, page


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_paged_attention_bytes_count_the_cache_rows_read(sliding_window):
    args, q_lens, kv_lens, _ = _paged_batch(sliding_window)
    prof, out = profiled(lambda: torch_kernels.ragged_paged_attention(**args))
    hkv, d = args["key_cache"].shape[2:]
    rows_read = 0
    for q_len, kv_len in zip(q_lens, kv_lens):  # the key positions any of the sequence's queries sees
        seen = {j for p in range(kv_len - q_len, kv_len) for j in range(p + 1)
                if sliding_window is None or j > p - sliding_window}
        rows_read += len(seen)
    row = only_row(prof, "ragged_paged_attention")
    assert row["bytes"] == 2 * rows_read * hkv * d * FLOAT + nbytes(args["query"], out)
    assert row["flops"] == paged_ops.attention_flops(args["query"].shape[1], d, q_lens, kv_lens, sliding_window)


def test_cache_writes_count_the_real_slots():
    args, _, _, _ = _paged_batch(fused=True)
    key, value, slots = args["key"], args["value"], args["slot_mapping"]
    real = slots >= 0
    written = nbytes(key[real], value[real], key[real], value[real])  # read from the inputs, then into the caches
    caches = args["key_cache"], args["value_cache"]
    prof, _ = profiled(lambda: torch_kernels.reshape_and_cache(key, value, *caches, slots))
    row = only_row(prof, "reshape_and_cache")
    assert (row["bytes"], row["flops"]) == (written + nbytes(slots), 0)

    prof, out = profiled(lambda: torch_kernels.ragged_paged_attention(**args))
    without_write, _ = profiled(lambda: torch_kernels.ragged_paged_attention(
        **{k: v for k, v in args.items() if k not in ("key", "value", "slot_mapping")}))
    assert only_row(prof, "ragged_paged_attention")["bytes"] == \
        only_row(without_write, "ragged_paged_attention")["bytes"] + written + nbytes(slots)


def test_moe_bytes_count_routed_rows_and_used_experts():
    tokens, hidden, inter, experts = 4, 6, 5, 4
    x = _random(tokens, hidden, seed=13)
    ids = torch.tensor([[0, 2], [-1, -1], [2, 0], [0, -1]], dtype=torch.int32)  # token 1 dropped; expert 1, 3 idle
    weights = torch.rand(tokens, 2, generator=torch.Generator().manual_seed(14))
    routed_tokens, routed_slots, used_experts = 3, 5, 2

    def moe_layer():
        rows, offsets, handle = torch_kernels.moe_dispatch(x, ids, experts)
        w = _random(experts, hidden, inter, seed=15)
        y = torch_kernels.grouped_mm(rows, w, offsets)
        return rows, offsets, w, y, torch_kernels.moe_combine(y, handle, weights)

    prof, (rows, offsets, w, y, out) = profiled(moe_layer)
    handle_bytes = tokens * 2 * 8  # int64 sorted-row -> token map
    assert only_row(prof, "moe_gather")["bytes"] == routed_tokens * hidden * FLOAT + handle_bytes + nbytes(rows)
    assert only_row(prof, "grouped_mm")["bytes"] == (routed_slots * hidden * FLOAT
                                                     + used_experts * hidden * inter * FLOAT + nbytes(offsets, y))
    assert only_row(prof, "grouped_mm")["flops"] == 2 * routed_slots * hidden * inter
    combine = only_row(prof, "moe_combine")
    assert combine["bytes"] == routed_slots * inter * FLOAT + tokens * 2 * 8 + nbytes(weights, out)
    assert combine["flops"] == 2 * routed_slots * inter

    w13, w2 = _random(experts, 2 * inter, hidden, seed=16), _random(experts, hidden, inter, seed=17)
    prof, out = profiled(lambda: torch_kernels.fused_moe(x, w13, w2, weights, ids))
    fused = only_row(prof, "fused_moe")
    assert fused["bytes"] == nbytes(x, weights, ids, out) + used_experts * 3 * inter * hidden * FLOAT
    assert fused["flops"] == counted_flops(lambda: torch_kernels.fused_moe(x, w13, w2, weights, ids))

    logits = _random(tokens, experts, seed=18)
    prof, (topk_weights, topk_ids) = profiled(lambda: torch_kernels.router_topk(logits, 2))
    assert only_row(prof, "router_topk")["bytes"] == nbytes(logits, topk_weights, topk_ids)


def test_backward_ops_are_recorded_with_their_formulas():
    """Training steps record each backward op, with the FLOPs FlopCounterMode counts for it."""
    x = _random(7, 5, seed=19).requires_grad_()
    w = _random(2, 5, 3, seed=20).requires_grad_()
    offsets = torch.tensor([3, 6], dtype=torch.int32)
    step = lambda: torch_kernels.grouped_mm(x, w, offsets).square().sum().backward()  # noqa: E731
    prof, _ = profiled(step)
    assert [r["calls"] for r in prof.rows if r["op"] == "grouped_mm"] == [2]  # the forward and d x
    grad = only_row(prof, "grouped_mm_weight_grad")
    assert grad["flops"] == 2 * 6 * 5 * 3
    assert grad["bytes"] == 6 * 5 * FLOAT + 6 * 3 * FLOAT + nbytes(offsets, w)
    assert sum(r["flops"] for r in prof.rows) == counted_flops(step)


# ---- the profile ----

def test_profile_counts_calls_per_op_and_backend(tmp_path, monkeypatch):
    require_backend("triton")
    peaks = profiling.DevicePeaks("stub", flops_per_s=2e9, bytes_per_s=1e9, matmul_dtype="float32")
    monkeypatch.setattr(profiling, "calibrate_device", lambda device: peaks)
    x, means, whitener = _random(24, 16, seed=21), _random(3, 16, seed=22), _random(16, 16, seed=23)
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
    x = _random(5, 4, seed=24).requires_grad_()
    params = [torch.rand(*s, generator=torch.Generator().manual_seed(25)) * 0.3 + 0.1
              for s in [(4,), (4,), (1, 4), (1,), (1, 6), (4, 6), (0, 6, 6), (0, 6), (0, 6, 6), (0, 6), (6, 4), (4,)]]
    prof, _ = profiled(lambda: torch_kernels.edm_score(x, *params, [0.5], 0.8).sum().backward())
    assert {(r["op"], r["backend"]) for r in prof.rows} == {("edm_score", "reference"),
                                                           ("edm_score_backward", profiling.NO_KERNEL)}


def test_profile_records_compiled_code():
    """Code compiled before the block and code compiled inside it (traced while it is active)."""
    x, means, whitener = _random(12, 8, seed=26), _random(2, 8, seed=27), _random(8, 8, seed=28)
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
    x, means, whitener = _random(6, 4, seed=29), _random(2, 4, seed=30), _random(4, 4, seed=31)
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
        torch_kernels.mahalanobis_score(_random(4, 4, seed=32), _random(1, 4, seed=33), torch.eye(4))
    assert len(measured) == 3 and prof.peaks[profiling.device_name("cpu")].flops_per_s == 3e11
    assert "300.0 GFLOP/s (float32 matmul)" in str(prof)


def test_measured_peaks_are_plausible():
    peaks = profiling.measure_peaks("cpu")
    assert peaks.device == profiling.device_name("cpu") and peaks.matmul_dtype == "float32"
    # a CPU core does at least 1e8 FLOP/s and copies at least 1e8 B/s, and no machine reaches 1e16
    for rate in (peaks.flops_per_s, peaks.bytes_per_s):
        assert math.isfinite(rate) and 1e8 < rate < 1e16

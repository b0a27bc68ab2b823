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


# ---- bad entries made safe: paged attention and MLA ----

PAGED_BACKENDS = ("reference", "triton", "pallas", "sycl")


def _paged_batch(gen):
    """Four sequences (decodes, a prompt, a chunk) over shuffled pages, new tokens to write."""
    from torch_kernels.ops.paged_attention import paged_attention_inputs

    query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, scale = paged_attention_inputs(
        gen, torch.float32, "cpu", heads=(4, 2), head_size=16)
    block_size = key_cache.shape[1]
    slots = []
    for s in range(kv_lens.shape[0]):
        for p in range(int(kv_lens[s]) - int(cu_q_lens[s + 1] - cu_q_lens[s]), int(kv_lens[s])):
            slots.append(int(block_table[s, p // block_size]) * block_size + p % block_size)
    key = torch.randn(query.shape[0], 2, 16, generator=gen)
    value = torch.randn(query.shape[0], 2, 16, generator=gen)
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, cu_q_lens=cu_q_lens, kv_lens=kv_lens,
                block_table=block_table, sm_scale=scale, key=key, value=value,
                slot_mapping=torch.tensor(slots, dtype=torch.int64))


def _rows(cu_q_lens, s):
    return slice(int(cu_q_lens[s]), int(cu_q_lens[s + 1]))


@pytest.mark.parametrize("backend", PAGED_BACKENDS)
def test_deferred_paged_attention_makes_a_bad_page_and_slot_safe(backend):
    """A page id past the cache in sequence 2 and a slot past the cache in sequence 3, in deferred
    mode: sequence 2's rows are NaN, the other rows equal the good batch's, the cache changes only
    at the good slots, nothing is raised until ``raise_deferred_errors``."""
    require_backend(backend)
    good = _paged_batch(torch.Generator().manual_seed(1))
    want = torch_kernels.ragged_paged_attention(**{n: t.clone() if isinstance(t, torch.Tensor) else t
                                                  for n, t in good.items()}, implementation=backend)
    bad = {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in good.items()}
    num_blocks = bad["key_cache"].shape[0]
    bad["block_table"][2, 0] = num_blocks + 5
    last = _rows(bad["cu_q_lens"], 3)
    bad["slot_mapping"][last.stop - 1] = 10**9
    before = bad["key_cache"].clone(), bad["value_cache"].clone()
    with torch_kernels.checks("deferred"):
        got = torch_kernels.ragged_paged_attention(**bad, implementation=backend)
    with pytest.raises(ValueError, match=r"^(block_table|slot_mapping): expected .*\(and 1 other failed check\)$"):
        torch_kernels.raise_deferred_errors()
    nan = torch.zeros(got.shape[0], dtype=torch.bool)
    nan[_rows(bad["cu_q_lens"], 2)] = True
    assert torch.isnan(got[nan]).all()
    # sequence 3's last new token was not written: its rows may differ where they read that slot
    keep = ~nan
    keep[last] = False
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)
    block_size = bad["key_cache"].shape[1]
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    good_slots = bad["slot_mapping"][bad["slot_mapping"] < num_blocks * block_size]
    written[good_slots] = True
    for cache, old, new in ((bad["key_cache"], before[0], bad["key"]), (bad["value_cache"], before[1], bad["value"])):
        flat, flat_old = cache.reshape(num_blocks * block_size, -1), old.reshape(num_blocks * block_size, -1)
        assert torch.equal(flat[~written], flat_old[~written])
        rows = torch.arange(new.shape[0])[bad["slot_mapping"] < num_blocks * block_size]
        assert torch.equal(flat[good_slots], new[rows].reshape(rows.shape[0], -1))


@pytest.mark.parametrize("backend", PAGED_BACKENDS)
def test_deferred_paged_attention_makes_bad_lengths_safe(backend):
    """Offsets that do not add up make every row NaN; a kv length past the block table makes its
    sequence's rows NaN, whatever the backend; both raise later."""
    require_backend(backend)
    good = _paged_batch(torch.Generator().manual_seed(2))
    for name, edit, nan_seqs in (("cu_q_lens", lambda b: b["cu_q_lens"].__setitem__(2, 40), "all"),
                                 ("kv_lens", lambda b: b["kv_lens"].__setitem__(1, 10**6), [1])):
        bad = {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in good.items()}
        edit(bad)
        del bad["key"], bad["value"], bad["slot_mapping"]
        with torch_kernels.checks("deferred"):
            got = torch_kernels.ragged_paged_attention(**bad, implementation=backend)
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            torch_kernels.raise_deferred_errors()
        if nan_seqs == "all":
            assert torch.isnan(got).all()
        else:
            for s in range(good["kv_lens"].shape[0]):
                rows = got[_rows(good["cu_q_lens"], s)]
                assert torch.isnan(rows).all() if s in nan_seqs else torch.isfinite(rows).all()


def test_deferred_fused_write_reads_nothing_on_the_host():
    """The attention with its cache write (key, value, slot_mapping) on the Triton backend: no
    host read in deferred mode (the write runs first rather than deciding to fuse by reading the
    block table), and the same output and caches as the full mode's fused call."""
    require_backend("triton")
    runs = []
    for mode in ("full", "deferred"):
        batch = _paged_batch(torch.Generator().manual_seed(3))
        with torch_kernels.checks(mode), HostReads() as guard:
            out = torch_kernels.ragged_paged_attention(**batch, implementation="triton")
        runs.append((out, batch["key_cache"], batch["value_cache"], guard.reads))
    assert runs[0][3], "the full mode's checks read on the host (this test's guard sees nothing?)"
    assert not runs[1][3], f"deferred mode read on the host: {runs[1][3]}"
    for full, deferred in zip(runs[0][:3], runs[1][:3]):
        torch.testing.assert_close(deferred, full, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", PAGED_BACKENDS)
def test_deferred_mla_makes_a_bad_index_and_page_safe(backend):
    """ragged_paged_mla in deferred mode: a top-k index past its sequence is dropped (as -1), a
    bad page id NaNs its sequence's rows and lse, indexer_topk gives -1 rows there."""
    require_backend(backend)
    from torch_kernels.ops import mla

    case = next(c for c in families.selftest_cases() if c.op == "ragged_paged_mla")
    inputs = list(case.make_inputs(torch.Generator().manual_seed(4), torch.float32, "cpu"))
    q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, sm_scale = inputs[:7]
    topk = torch.full((q_nope.shape[0], 4), -1, dtype=torch.int32)
    topk[:, 0] = 0
    want = mla.ragged_paged_mla(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                                topk_indices=topk, return_lse=True, implementation=backend)
    bad_topk = topk.clone()
    bad_topk[0, 1] = 10**6
    bad_table = block_table.clone()
    bad_table[1, 0] = -3
    with torch_kernels.checks("deferred"):
        out, lse = mla.ragged_paged_mla(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, bad_table, sm_scale,
                                        topk_indices=bad_topk, return_lse=True, implementation=backend)
    with pytest.raises(ValueError, match=r"^(block_table|topk_indices): expected"):
        torch_kernels.raise_deferred_errors()
    nan = torch.zeros(out.shape[0], dtype=torch.bool)
    nan[_rows(cu_q_lens, 1)] = True
    assert torch.isnan(out[nan]).all() and torch.isnan(lse[nan]).all()
    torch.testing.assert_close(out[~nan], want[0][~nan], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse[~nan], want[1][~nan], rtol=1e-5, atol=1e-5)

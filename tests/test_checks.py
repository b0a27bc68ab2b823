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


@pytest.mark.parametrize("splits", [1, 4])
def test_triton_attention_makes_the_bad_rows_nan_in_its_kernel(splits):
    """The Triton kernel takes the deferred checks' ``bad_rows`` itself (no fill launch after it):
    exactly those rows come out NaN, with and without a split key range (whose merge keeps them
    NaN), and every other row equals the call without them."""
    require_backend("triton")
    from triton_impl import paged_attention as kernels

    batch = _paged_batch(torch.Generator().manual_seed(4))
    args = [batch[name] for name in ("query", "key_cache", "value_cache", "cu_q_lens", "kv_lens", "block_table")]
    heads = batch["key_cache"].shape[2]
    args += [batch["sm_scale"], None, None, torch.ones(heads), torch.ones(heads), None, None, None]
    config = kernels.Config(block_q=4, block_n=16, num_splits=splits, num_warps=4, num_stages=1)
    bad_rows = torch.zeros(batch["query"].shape[0], dtype=torch.bool)
    bad_rows[[0, 3, 4]] = True  # a decode's row and two rows of a prompt
    want = kernels.ragged_paged_attention(*args, config=config)
    got = kernels.ragged_paged_attention(*args, config=config, bad_rows=bad_rows)
    assert torch.isnan(got[bad_rows]).all()
    assert torch.equal(got[~bad_rows], want[~bad_rows]) and torch.isfinite(want).all()


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


def _failed_messages() -> set[str]:
    """The messages the error word holds now (cleared)."""
    word = _checks.error_word(torch.device("cpu"))
    failed = {_checks._messages[code] for code in word.nonzero().flatten().tolist()}
    word.zero_()
    return failed


def _corrupted_batches():
    """(label, query, key_cache, cu_q_lens, kv_lens, block_table): good batches of 3 and 150
    sequences (three of the device checks' programs), and each check's failure on them."""
    g = torch.Generator().manual_seed(5)
    for num_seqs in (3, 150):
        q_lens = torch.randint(0, 4, (num_seqs,), generator=g)
        kv_lens = q_lens + torch.randint(0, 40, (num_seqs,), generator=g)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(torch.int32)
        num_blocks, block_size, max_blocks = 64, 4, 12
        table = torch.randint(0, num_blocks, (num_seqs, max_blocks), generator=g, dtype=torch.int32)
        query, cache = torch.empty(int(cu[-1]), 1, 1), torch.empty(num_blocks, block_size, 1, 1)
        edits = {
            "good": lambda cu, kv, t: None,
            "starts off": lambda cu, kv, t: cu.__setitem__(0, 1),
            "decreases": lambda cu, kv, t: cu.__setitem__(1, cu[2] + 1),
            "ends off": lambda cu, kv, t: cu.__setitem__(-1, cu[-1] + 1),
            "negative kv": lambda cu, kv, t: kv.__setitem__(-1, -5),
            "short kv": lambda cu, kv, t: (cu.__setitem__(slice(2, None), cu[2:] + 9), kv.__setitem__(1, 0)),
            "kv past the table": lambda cu, kv, t: kv.__setitem__(0, max_blocks * block_size + 1),
            "bad page": lambda cu, kv, t: t.__setitem__((num_seqs - 1, 0), num_blocks),
            "negative page past the used ones": lambda cu, kv, t: t.__setitem__((0, max_blocks - 1), -7),
        }
        for label, edit in edits.items():
            c, k, t = cu.clone(), kv_lens.to(torch.int32), table.clone()
            edit(c, k, t)
            q = query if label != "short kv" else torch.empty(int(c[-1]), 1, 1)
            yield f"{num_seqs} sequences, {label}", q, cache, c, k, t


@pytest.mark.parametrize("batch", list(_corrupted_batches()), ids=lambda b: b[0])
def test_device_lengths_check_agrees_with_the_torch_checks(batch):
    """The Triton backend's one-launch deferred check of a paged batch (``check_batch_kernel``)
    against the same checks as torch ops: the same failed messages in the error word, the same
    ``bad_rows``; with offsets that hold, the same safe lengths and block table too (with bad
    offsets every row is NaN either way, and the launch gives every row to sequence 0 over page 0,
    so that a kernel still writes each row)."""
    require_backend("triton")
    from torch_kernels.ops import paged_attention as paged

    _, query, cache, cu, kv, table = batch
    want = paged.check_lengths(query, cache, cu, kv, table, torch_checks := _checks.ValueChecks(cache.device, "deferred"))
    torch_checks.finish()
    want_failed = _failed_messages()
    got = paged.check_lengths(query, cache, cu, kv, table, _checks.ValueChecks(cache.device, "deferred", "triton"))
    assert _failed_messages() == want_failed
    assert torch.equal(got[3], want[3]), "bad_rows"
    offsets_hold = not any(m.startswith("cu_q_lens") for m in want_failed)
    if offsets_hold:
        for name, g, w in zip(("cu_q_lens", "kv_lens", "block_table"), got[:3], want[:3]):
            assert torch.equal(g, w.to(g.dtype)), name
    else:
        rows, seqs = query.shape[0], kv.shape[0]
        assert got[0].tolist() == [0] + [rows] * seqs and got[1].tolist() == [rows] + [0] * (seqs - 1)
        assert not got[2].any()
    passes = batch[0].endswith(("good", "past the used ones"))  # a page no sequence reads may be anything
    assert passes == (not want_failed)


@pytest.mark.parametrize("slots, failed", [([3, -1, 7, 0], ()), ([3, 9, -1, 3, 3], (1,)), ([2, 64, -2, 5], (0,)),
                                           ([1, 100, 1], (0, 1)), (list(range(40))[::-1] * 1, ())])
def test_device_slots_check_agrees_with_the_torch_checks(slots, failed):
    """The one-launch deferred check of ``slot_mapping`` (out of range: made -1; a repeat: recorded):
    the same failed messages and safe slots as the torch ops', run twice so that the per-slot
    owner entries left by the first call cannot hide or invent a repeat in the second."""
    require_backend("triton")
    from torch_kernels.ops import paged_attention as paged

    cache = torch.empty(16, 4, 1, 1)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    want = paged.check_slots(slot_mapping, cache, torch_checks := _checks.ValueChecks(cache.device, "deferred"))
    torch_checks.finish()
    want_failed = _failed_messages()
    assert want_failed == {paged._slots_messages(64)[i] for i in failed}
    for _ in range(2):
        got = paged.check_slots(slot_mapping, cache, _checks.ValueChecks(cache.device, "deferred", "triton"))
        assert _failed_messages() == want_failed
        assert torch.equal(got, want)


_LONG = torch.arange(0, 3000, 2)  # 1,500 offsets: two of the device check's tiles


@pytest.mark.parametrize("offsets, total", [
    ([0, 3, 3, 9], 9), ([1, 3, 3, 9], 9), ([0, 5, 3, 9], 9), ([0, 3, 12], 9), ([0], 0), ([4], 9), ([-3, 2, 7], 7),
    (_LONG.tolist(), 2998), (torch.cat([_LONG[:1100], _LONG[1100:] - 1000]).tolist(), 1998)],
    ids=["good", "starts off", "decreases", "past the end", "no sequence", "no sequence, rows left", "negative",
         "two tiles", "two tiles, decreasing in the second"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_device_offsets_check_agrees_with_the_torch_checks(offsets, total, dtype):
    """``_checks.packed_offsets`` as one Triton launch (``check_offsets_kernel``) against the torch
    ops: the same failed messages, the same safe offsets and flag."""
    require_backend("triton")
    given = torch.tensor(offsets, dtype=dtype)
    results = []
    for backend in (None, "triton"):
        checks = _checks.ValueChecks(given.device, "deferred", backend)
        safe, bad = _checks.packed_offsets("cu_seqlens", given, total, f"T={total}", checks)
        checks.finish()
        results.append((safe, bool(bad), _failed_messages()))
    (want, want_bad, want_failed), (got, got_bad, got_failed) = results
    assert got.dtype == dtype and torch.equal(got, want)
    assert (got_bad, got_failed) == (want_bad, want_failed)
    assert want_bad == bool(want_failed)


@pytest.mark.parametrize("rows", [[2, -1, 0, 5], [2, 7, -3, 2], [0, 2**40, -(2**40), 1], [2**31 + 5, 3],
                                  list(range(1500)), [5] + list(range(1500))],
                         ids=["good", "past and repeated", "outside int32", "above int32", "two tiles",
                              "two tiles, a repeat"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_device_rows_check_agrees_with_the_torch_checks(rows, dtype):
    """``_checks.state_rows`` then ``int32_values`` (what the state-update ops run) as one Triton
    launch (``check_indices_kernel``) against the torch ops: the same failed messages, the same
    rows for the kernels (int32) and the same entries marked for NaN output."""
    require_backend("triton")
    if dtype == torch.int32 and any(not _checks.INT32_MIN <= r <= _checks.INT32_MAX for r in rows):
        pytest.skip("int32 cannot hold these rows")
    given = torch.tensor(rows, dtype=dtype)
    results = []
    for backend in (None, "triton"):
        checks = _checks.ValueChecks(given.device, "deferred", backend)
        safe, bad = _checks.state_rows("state_batch_indices", given, "state", 1500, checks)
        safe = _checks.int32_values("state_batch_indices", safe, checks)
        checks.finish()
        results.append((safe, bad, _failed_messages()))
    (want, want_bad, want_failed), (got, got_bad, got_failed) = results
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert torch.equal(got_bad, want_bad) and got_failed == want_failed


@pytest.mark.parametrize("ids", [[[0, 3], [1, -1]], [[0, 4], [-2, 1]], [[2, 2], [9, 0]]],
                         ids=["good", "past and below -1", "repeated in a token, past"])
def test_device_expert_ids_check_agrees_with_the_torch_checks(ids):
    """``check_ids_range`` (MoE routing) as one launch of the shared index check, repeats allowed:
    the same failed messages and routed ids as the torch ops'."""
    require_backend("triton")
    from torch_kernels.ops.moe.dispatch import check_ids_range

    given = torch.tensor(ids, dtype=torch.int32)
    results = []
    for backend in (None, "triton"):
        checks = _checks.ValueChecks(given.device, "deferred", backend)
        routed = check_ids_range(given, 4, checks)
        checks.finish()
        results.append((routed, _failed_messages()))
    (want, want_failed), (got, got_failed) = results
    assert torch.equal(got, want) and got_failed == want_failed


@pytest.mark.parametrize("scale", [[0.5], [0.5, 2.0, 1.0], [0.5, 0.0, -1.0], [float("nan"), float("inf"), 3.0], []],
                         ids=["one", "per head", "zero and negative", "nan and inf", "empty"])
def test_device_scales_check_agrees_with_the_torch_checks(scale):
    """``scale_checks`` (cache scales) as one launch of the shared scale check: the same failed
    messages and the same scales, a bad one NaN."""
    require_backend("triton")
    from torch_kernels.ops import paged_attention as paged

    given = torch.tensor(scale, dtype=torch.float32)
    results = []
    for backend in (None, "triton"):
        checks = _checks.ValueChecks(given.device, "deferred", backend)
        safe = paged.scale_checks(checks, k_scale=given, v_scale=None)
        checks.finish()
        results.append((safe, _failed_messages()))
    (want, want_failed), (got, got_failed) = results
    assert got["v_scale"] is None and got_failed == want_failed
    torch.testing.assert_close(got["k_scale"], want["k_scale"], equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("offsets", [[2, 2, 7], [-1, 3, 7], [3, 1, 7], [0, 4, 9], [5], (_LONG[:1100] // 2).tolist()],
                         ids=["good", "negative first", "decreasing", "past the rows", "one group", "two tiles"])
def test_device_group_ends_check_agrees_with_the_torch_checks(offsets):
    """``grouped_mm``'s cumulative group ends as one launch of the shared offsets check (its
    ``ends`` form): the same failed messages, safe ends and flag as the torch ops'."""
    require_backend("triton")
    from torch_kernels.ops.moe.grouped_gemm import check_offsets

    given = torch.tensor(offsets, dtype=torch.int32)
    rows = 7 if len(offsets) < 100 else 600
    results = []
    for backend in (None, "triton"):
        checks = _checks.ValueChecks(given.device, "deferred", backend)
        safe, bad = check_offsets(given, rows, checks)
        checks.finish()
        results.append((safe, bool(bad), _failed_messages()))
    (want, want_bad, want_failed), (got, got_bad, got_failed) = results
    assert torch.equal(got, want) and (got_bad, got_failed) == (want_bad, want_failed)
    assert want_bad == bool(want_failed)


@pytest.mark.parametrize("positive_at, value", [(None, None), (0, 0.5), (20_000, 0.5), (7, math.inf)],
                         ids=["none", "first", "in a later program", "+inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_device_log_decay_check_agrees_with_the_torch_checks(positive_at, value, dtype):
    """Linear attention's ``g <= 0`` as one launch over 3 programs: recorded exactly when a value
    is positive (NaN, -0.0 and -inf are not), as the torch ops record it."""
    require_backend("triton")
    from torch_kernels.ops import linear_attention

    g = -torch.rand(2, 10_000, 3, generator=torch.Generator().manual_seed(6)).to(dtype)
    g.view(-1)[1:4] = torch.tensor([math.nan, -0.0, -math.inf], dtype=dtype)
    if positive_at is not None:
        g.view(-1)[positive_at] = value
    results = []
    for backend in (None, "triton"):
        checks = _checks.ValueChecks(g.device, "deferred", backend)
        linear_attention.check_values(None, g.shape[1], g, checks)
        checks.finish()
        results.append(_failed_messages())
    assert results[0] == results[1] and bool(results[0]) == (positive_at is not None)


def test_nothing_made_inside_a_graph_capture_is_kept_for_eager_calls(monkeypatch):
    """Inside a CUDA-graph capture kernels are recorded, not run: a tensor filled there holds
    nothing until a replay. So the error word is not made there (a clear error), and the codes
    and the ones of a missing scale made there are used by that call only, not kept for eager
    calls (checked here with the capture state faked on the CPU)."""
    from torch_kernels.ops import paged_attention as paged

    cpu = torch.device("cpu")
    monkeypatch.setattr(_checks, "capturing", lambda device: True)
    monkeypatch.setattr(_checks, "_words", {})
    with pytest.raises(RuntimeError, match="run the ops once before capturing a CUDA graph"):
        _checks.error_word(cpu)
    messages = ("test: a message only this test records",)
    codes = _checks.message_codes(cpu, messages)
    assert codes.tolist() == [_checks._codes[messages[0]]]
    assert (cpu, tuple(codes.tolist())) not in _checks._indices and (cpu, messages) not in _checks._message_indices
    ones = paged._scales(None, 7, cpu)
    assert ones.tolist() == [1.0] * 7 and (cpu, 7) not in paged._ones



def test_device_checks_take_strided_inputs():
    """Strided views (every other entry, a transposed block table) checked in one launch give what
    the torch ops give: the launchers make them contiguous, the kernels never step past them."""
    require_backend("triton")
    from torch_kernels.ops import paged_attention as paged

    _, query, cache, cu, kv, table = next(b for b in _corrupted_batches() if b[0] == "150 sequences, bad page")
    strided = (torch.stack([cu, cu + 10**6], 1)[:, 0], torch.stack([kv, -kv], 1)[:, 0], table.t().contiguous().t())
    assert not any(t.is_contiguous() for t in strided)
    slots = torch.arange(40, dtype=torch.int64).flip(0)[::2]
    results = []
    for backend in (None, "triton"):
        checks = _checks.ValueChecks(cache.device, "deferred", backend)
        lengths = paged.check_lengths(query, cache, *strided, checks)
        safe_slots = paged.check_slots(slots, cache, checks)
        offsets = _checks.packed_offsets("cu_seqlens", strided[0], query.shape[0], "T", checks)
        checks.finish()
        results.append((lengths, safe_slots, offsets, _failed_messages()))
    (want_lengths, want_slots, want_offsets, want_failed), (lengths, slots_got, offsets, failed) = results
    assert failed == want_failed and len(failed) == 1
    assert torch.equal(lengths[3], want_lengths[3]) and torch.equal(lengths[2], want_lengths[2])
    assert torch.equal(slots_got, want_slots) and torch.equal(offsets[0], want_offsets[0])


@pytest.mark.parametrize("lengths", [[0, 5, 9], [3, -1, 2], [2**31 + 4, 1], [-(2**40), 2**40]],
                         ids=["good", "negative", "past int32", "both, wide"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_device_conv_lengths_check_agrees_with_the_torch_checks(lengths, dtype):
    """causal_conv1d_update's ``cache_seqlens`` (>= 0, within int32) as one launch, then the int32
    form its kernels take: the same failed messages, lengths and entries marked for NaN output as
    the torch ops'."""
    require_backend("triton")
    from torch_kernels.ops import causal_conv1d

    if dtype == torch.int32 and any(not _checks.INT32_MIN <= n <= _checks.INT32_MAX for n in lengths):
        pytest.skip("int32 cannot hold these lengths")
    given = torch.tensor(lengths, dtype=dtype)
    conv_state = torch.empty(len(lengths), 2, 3)
    results = []
    for backend in (None, "triton"):
        checks = _checks.ValueChecks(given.device, "deferred", backend)
        safe, _, bad = causal_conv1d.check_update_values(conv_state, given, None, checks)
        safe = _checks.int32_values("cache_seqlens", safe, checks)
        checks.finish()
        results.append((safe, bad, _failed_messages()))
    (want, want_bad, want_failed), (got, got_bad, got_failed) = results
    assert torch.equal(got, want) and torch.equal(got_bad, want_bad) and got_failed == want_failed


def test_the_triton_backend_has_every_one_launch_check():
    """The agreement tests above compare the torch-op checks (backend None) with the Triton
    backend's: they would compare the torch ops with themselves if a name lost its registration."""
    from torch_kernels import backends
    from torch_kernels.ops import paged_attention as paged
    from torch_kernels.ops.moe import _common

    names = (paged.BATCH_CHECK, _checks.OFFSETS_CHECK, _checks.INDICES_CHECK, _checks.SCALES_CHECK,
             _checks.NOT_POSITIVE_CHECK, _checks.LENGTHS_CHECK, _common.SORT_BY_EXPERT)
    assert all(backends.helper(name, "triton") is not None for name in names)
    assert all(backends.helper(name, backend) is None for name in names for backend in ("reference", None))
    checks = _checks.ValueChecks(torch.device("cpu"), "full", "triton")
    assert checks.device_check(_checks.OFFSETS_CHECK, ("x",)) is None  # full mode: the torch ops, read at once


def test_a_layout_remembered_check_skips_only_what_passed():
    """``_checks.remembers_layouts``: a metadata check runs once per layout that passes; a call
    differing in any tensor's dtype, shape, strides or device, or in a plain value or its type
    (``True`` is not ``1``), runs it again; a failing call is not remembered; arguments of other
    kinds (lists) run it every time."""
    calls = []

    @_checks.remembers_layouts
    def check(x, size, flag=None):
        calls.append(1)
        if x.shape[0] != size or flag is True:
            raise ValueError("x: bad")
        return x.dim()

    x = torch.zeros(4, 3)
    assert check(x, 4) == 2 and check(torch.ones(4, 3), 4) == 2 and len(calls) == 1
    for other in ((torch.zeros(5, 3), 5), (x, 4.0), (x.t().contiguous().t(), 4), (x.double(), 4)):
        check(*other)  # shape, a value's type, strides, dtype: each checked
    with pytest.raises(ValueError):
        check(x, 4, flag=True)
    check(x, 4, flag=1)
    with pytest.raises(ValueError):
        check(torch.zeros(5, 3), 5, flag=True)
    with pytest.raises(ValueError):  # failed before: checked again, fails again
        check(torch.zeros(5, 3), 5, flag=True)
    assert len(calls) == 9
    calls.clear()
    check(x, 4, flag=[1])
    check(x, 4, flag=[1])
    assert len(calls) == 2


def test_the_paged_shape_checks_still_refuse_a_new_bad_layout():
    """After a call that passed, a cache view whose entries overlap (same shape, other strides)
    still raises: the remembered layout keys on the strides."""
    from torch_kernels.ops.paged_attention import paged_attention_inputs

    query, key_cache, value_cache, cu, kv, table, scale = paged_attention_inputs(torch.Generator().manual_seed(0),
                                                                                  torch.float32, "cpu")
    torch_kernels.ragged_paged_attention(query, key_cache, value_cache, cu, kv, table, scale)
    shared = key_cache[:1].expand_as(key_cache)  # every block the same memory
    with pytest.raises(ValueError, match="^key_cache: expected a stride-1 last dimension and no two entries"):
        torch_kernels.ragged_paged_attention(query, shared, value_cache, cu, kv, table, scale)

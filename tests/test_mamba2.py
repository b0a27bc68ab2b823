"""The mamba2 ops (mamba_chunk_scan_combined, selective_state_update) through their public API on
every backend, against the definition: the loops over time, heads and state entries of
``torch_kernels.ops.mamba2`` (``naive_scan``, ``naive_update``, float64), and autograd through
``naive_scan`` for every gradient; then against transformers' own torch fallbacks (the segment-sum
scan and the decode step Mamba-2, Bamba, NemotronH, FalconH1, GraniteMoeHybrid and Zamba2 run
without mamba_ssm, and a Mamba-2 mixer's forward), and the op contract (opcheck, torch.compile
with no graph break, inference-only update, FLOPs).

Float32 outputs and gradients are held to the float32 tolerance of ``harness.assert_close``
(2e-5 relative). The Pallas kernels compile every new shape (seconds in interpret mode), so
they run a share of the cases, said where skipped.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import torch_kernels
from harness import HostReads, assert_close, backend_params, compiled_fullgraph, counted_flops, require_backend, \
    run_isolated, run_opcheck
from torch_kernels import backends
from torch_kernels.ops.mamba2 import naive_scan, naive_update

SCAN, UPDATE = "chunk_simple_gla", "selective_state_update"  # the scan runs on chunk_simple_gla's backends


# ---- inputs ----

def make_scan_inputs(batch=2, length=21, heads=4, headdim=8, groups=2, dstate=8, D="head", z=True, dt_bias=True,
                     h0=False, seq=None, cu=None, dtype=torch.float32, seed=0):
    """Keyword arguments of mamba_chunk_scan_combined (no chunk_size); ``seq``: each batch entry's
    sequence lengths (seq_idx); ``cu``: packed sequence lengths (batch 1, cu_seqlens); ``D``:
    "head" ``[H]``, "channel" ``[H, P]`` or None."""
    gen = torch.Generator().manual_seed(seed)
    if cu is not None:
        batch, length = 1, sum(cu)
    sequences = len(cu) if cu is not None else batch
    kw = dict(x=torch.randn(batch, length, heads, headdim, generator=gen).to(dtype),
              dt=torch.randn(batch, length, heads, generator=gen) - 1.0,
              A=-torch.rand(heads, generator=gen) * 2 - 0.1,
              B=(torch.randn(batch, length, groups, dstate, generator=gen) * dstate ** -0.5).to(dtype),
              C=torch.randn(batch, length, groups, dstate, generator=gen).to(dtype),
              D={"head": torch.randn(heads, generator=gen), "channel": torch.randn(heads, headdim, generator=gen),
                 None: None}[D],
              z=torch.randn(batch, length, heads, headdim, generator=gen).to(dtype) if z else None,
              dt_bias=torch.randn(heads, generator=gen) * 0.5 if dt_bias else None,
              initial_states=torch.randn(sequences, heads, headdim, dstate, generator=gen) if h0 else None)
    if seq is not None:
        kw["seq_idx"] = torch.tensor([[i for i, n in enumerate(lengths) for _ in range(n)] for lengths in seq],
                                     dtype=torch.int32)
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(cu).cumsum(0).tolist()], dtype=torch.int32)
    return kw


def with_grads(kw):
    """A copy of ``kw`` whose float tensors require grad: (copy, {name: leaf})."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in kw.items()
              if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return {**kw, **leaves}, leaves


def naive_packed(kw, **options):
    """naive_scan over each packed sequence of ``kw["cu_seqlens"]`` (or the whole batch): (y, final states)."""
    names = ("x", "dt", "B", "C", "z")
    if kw.get("cu_seqlens") is None:
        return naive_scan(kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["dt_bias"],
                          kw["initial_states"], kw.get("seq_idx"), **options)
    offsets = kw["cu_seqlens"].tolist()
    ys, finals = [], []
    for i, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        part = {n: None if kw[n] is None else kw[n][:, start:end] for n in names}
        h0 = None if kw["initial_states"] is None else kw["initial_states"][i:i + 1]
        y, final = naive_scan(part["x"], part["dt"], kw["A"], part["B"], part["C"], kw["D"], part["z"],
                              kw["dt_bias"], h0, **options)
        ys.append(y)
        finals.append(final)
    return torch.cat(ys, 1), torch.cat(finals)


# ---- mamba_chunk_scan_combined ----

SCAN_CASES = {
    "h0-final-gate-softplus": dict(make=dict(h0=True), options=dict(dt_softplus=True)),
    "seq_idx-channel-D-limit": dict(make=dict(D="channel", z=False, seq=((5, 1, 15), (21,))),
                                    options=dict(dt_softplus=True, dt_limit=(0.05, 0.8))),
    "cu_seqlens-h0-one-group": dict(make=dict(cu=(9, 1, 13), h0=True, groups=1, dt_bias=False),
                                    options=dict(dt_softplus=True)),
    "plain-no-softplus": dict(make=dict(D=None, z=False, dt_bias=False), options=dict()),
}
# on the interpreted backends, the cases that reach the scan's kernels with resets (-inf log decays) and
# packed sequences with initial and final states; the others differ only in the composite's torch parts
INTERPRETED_SCAN_CASES = ("seq_idx-channel-D-limit", "cu_seqlens-h0-one-group")
PALLAS_SKIP = ("pallas compiles each new shape (seconds in interpret mode): the scan's Pallas forward runs in "
               "test_mamba2_fuzz, chunk_simple_gla's Pallas gradients in test_linear_attention_pallas")


def pallas_share(backend, case, share):
    if backend == "pallas" and case not in share:
        pytest.skip(f"pallas compiles each new shape (seconds in interpret mode): its share here is {share}")


@pytest.mark.parametrize("case", list(SCAN_CASES))
@pytest.mark.parametrize("backend", backend_params(SCAN))
def test_scan_and_its_gradients_match_the_definition(backend, case):
    require_backend(backend)
    if backend == "pallas":
        pytest.skip(PALLAS_SKIP)
    if backend != "reference" and case not in INTERPRETED_SCAN_CASES:
        pytest.skip(f"interpreted backends run {INTERPRETED_SCAN_CASES} here (seconds each); this case differs "
                    "from those in the composite's torch parts, which the reference runs")
    spec = SCAN_CASES[case]
    kw = make_scan_inputs(**spec["make"])
    if spec["options"].get("dt_softplus") is not True:
        kw["dt"] = kw["dt"].abs()  # steps >= 0 without softplus
    final = "seq_idx" not in kw
    got_kw, got_leaves = with_grads(kw)
    result = torch_kernels.mamba_chunk_scan_combined(**got_kw, chunk_size=8, return_final_states=final,
                                                     implementation=backend, **spec["options"])
    y, states = result if final else (result, None)
    assert backends.last_backend(SCAN) == backend and y.dtype == kw["x"].dtype
    gen = torch.Generator().manual_seed(1)
    outputs, cotangents = [y], [torch.randn(y.shape, generator=gen)]
    if final:
        assert states.dtype == torch.float32
        outputs.append(states)
        cotangents.append(torch.randn(states.shape, generator=gen))
    grads = torch.autograd.grad(outputs, list(got_leaves.values()), cotangents)

    want_kw, want_leaves = with_grads(kw)
    want_y, want_states = naive_packed(want_kw, **spec["options"])
    assert_close(y, want_y, torch.float32, what="y")
    want_outputs = [want_y]
    if final:
        assert_close(states, want_states, torch.float32, what="final states")
        want_outputs.append(want_states)
    want_grads = torch.autograd.grad(want_outputs, list(want_leaves.values()), [c.double() for c in cotangents])
    for name, got, expected in zip(got_leaves, grads, want_grads):
        assert got.dtype == kw[name].dtype, name
        assert_close(got, expected, torch.float32, what=f"d{name}")


@pytest.mark.parametrize("backend", backend_params(SCAN))
def test_scan_in_bfloat16(backend):
    """16-bit x, B, C and z (float32 dt, A, D as models keep them): y in bfloat16 within its tolerance."""
    require_backend(backend)
    if backend in ("pallas", "sycl"):
        pytest.skip(f"{backend} runs chunk_simple_gla's 16-bit kernels, which test_linear_attention checks; the "
                    "composite's bfloat16 path is the same on every backend")
    kw = make_scan_inputs(h0=True, dtype=torch.bfloat16)
    y = torch_kernels.mamba_chunk_scan_combined(**kw, chunk_size=256, dt_softplus=True, implementation=backend)
    assert y.dtype == torch.bfloat16
    assert_close(y, naive_packed(kw, dt_softplus=True)[0], torch.bfloat16, what="y")


def test_seq_idx_and_cu_seqlens_agree_and_keep_sequences_apart():
    """Packed sequences by seq_idx (one batch row) or by cu_seqlens give the same y, and each
    sequence's y is what it gets alone (default backend)."""
    kw = make_scan_inputs(cu=(6, 1, 9))
    by_cu = torch_kernels.mamba_chunk_scan_combined(**kw, chunk_size=4, dt_softplus=True)
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([6, 1, 9]))[None].to(torch.int32)
    by_ids = torch_kernels.mamba_chunk_scan_combined(**{**kw, "cu_seqlens": None}, seq_idx=ids, chunk_size=4,
                                                     dt_softplus=True)
    torch.testing.assert_close(by_ids, by_cu)
    alone = torch_kernels.mamba_chunk_scan_combined(
        **{n: t[:, 7:] if n in ("x", "dt", "B", "C", "z") else t for n, t in kw.items() if n != "cu_seqlens"},
        chunk_size=4, dt_softplus=True)
    torch.testing.assert_close(by_cu[:, 7:], alone)


def test_prefill_then_decode_continues_one_scan():
    """The scan's final states handed to selective_state_update steps (called as models call it:
    expanded per-head dt, A, D and dt_bias) give what one scan over the whole sequence gives."""
    kw = make_scan_inputs(length=12, h0=True)
    whole = torch_kernels.mamba_chunk_scan_combined(**kw, chunk_size=4, dt_softplus=True)
    head = {n: t[:, :9] if n in ("x", "dt", "B", "C", "z") else t for n, t in kw.items()}
    y, state = torch_kernels.mamba_chunk_scan_combined(**head, chunk_size=4, dt_softplus=True,
                                                       return_final_states=True)
    _, _, heads, headdim = kw["x"].shape
    dstate = kw["B"].shape[-1]
    steps = []
    for t in range(9, 12):
        steps.append(torch_kernels.selective_state_update(
            state, kw["x"][:, t], kw["dt"][:, t, :, None].expand(-1, -1, headdim),
            kw["A"][:, None, None].expand(-1, headdim, dstate), kw["B"][:, t], kw["C"][:, t],
            kw["D"][:, None].expand(-1, headdim), kw["z"][:, t], kw["dt_bias"][:, None].expand(-1, headdim),
            dt_softplus=True))
    torch.testing.assert_close(torch.cat([y, torch.stack(steps, 1)], 1), whole, rtol=1e-5, atol=1e-5)


# ---- selective_state_update ----

def make_update_inputs(batch=3, heads=4, headdim=8, groups=2, dstate=8, rows=None, padding=False, expanded=True,
                       D=True, z=True, dt_bias=True, dtype=torch.float32, state_dtype=torch.float32, seed=0):
    """Keyword arguments of selective_state_update; ``expanded``: dt, A, D and dt_bias per-head
    values broadcast with stride 0 (as models pass them), else full tensors; ``rows``: the entries
    use shuffled rows of a larger state (the last one a padding entry with ``padding``)."""
    gen = torch.Generator().manual_seed(seed)

    def channel(*shape, low=0.0):
        if expanded:
            small = torch.randn(*shape[:-1], 1, generator=gen) + low
            return small.expand(*shape)
        return torch.randn(*shape, generator=gen) + low

    A = -(channel(heads, headdim, dstate).abs() + 0.1)
    kw = dict(state=torch.randn(rows or batch, heads, headdim, dstate, generator=gen).to(state_dtype),
              x=torch.randn(batch, heads, headdim, generator=gen).to(dtype),
              dt=channel(batch, heads, headdim, low=-1.0), A=A,
              B=(torch.randn(batch, groups, dstate, generator=gen) * dstate ** -0.5).to(dtype),
              C=torch.randn(batch, groups, dstate, generator=gen).to(dtype),
              D=channel(heads, headdim) if D else None,
              z=torch.randn(batch, heads, headdim, generator=gen).to(dtype) if z else None,
              dt_bias=channel(heads, headdim) * 0.5 if dt_bias else None)
    if rows:
        indices = torch.randperm(rows, generator=gen)[:batch].to(torch.int32)
        if padding:
            indices[-1] = -1
        kw["state_batch_indices"] = indices
    return kw


UPDATE_CASES = {
    "models-call-rows-padding": dict(make=dict(rows=6, padding=True), softplus=True),
    "full-tensors-one-group": dict(make=dict(expanded=False, groups=1, dstate=20), softplus=True),
    "no-skip-gate-bias-softplus": dict(make=dict(D=False, z=False, dt_bias=False, headdim=5), softplus=False),
    "bf16-x-fp32-state-rows": dict(make=dict(dtype=torch.bfloat16, rows=4), softplus=True),
}
PALLAS_UPDATE_CASES = ("models-call-rows-padding", "no-skip-gate-bias-softplus")


@pytest.mark.parametrize("case", list(UPDATE_CASES))
@pytest.mark.parametrize("backend", backend_params(UPDATE))
def test_update_matches_the_definition_and_writes_only_its_rows(backend, case):
    require_backend(backend)
    pallas_share(backend, case, PALLAS_UPDATE_CASES)
    spec = UPDATE_CASES[case]
    kw = make_update_inputs(**spec["make"])
    if not spec["softplus"]:
        kw["dt"] = kw["dt"].abs()
    want_out, want_state = naive_update(**kw, dt_softplus=spec["softplus"])
    state = kw["state"].clone()
    out = torch_kernels.selective_state_update(**{**kw, "state": state}, dt_softplus=spec["softplus"],
                                               implementation=backend)
    assert backends.last_backend(UPDATE) == backend and out.dtype == kw["x"].dtype
    assert_close(out, want_out, kw["x"].dtype, what="out")
    assert_close(state, want_state, torch.float32, what="state")
    rows = kw.get("state_batch_indices")
    used = set(range(state.shape[0])) if rows is None else {r for r in rows.tolist() if r >= 0}
    idle = [r for r in range(state.shape[0]) if r not in used]
    assert torch.equal(state[idle], kw["state"][idle])


@pytest.mark.parametrize("backend", backend_params(UPDATE))
def test_update_on_a_strided_state_view_with_head_vectors(backend):
    """state a strided bfloat16 view into a larger cache, D and dt_bias given per head ``[H]``:
    only the view's used rows change; every other byte of the cache keeps its value."""
    require_backend(backend)
    kw = make_update_inputs(rows=4, padding=True, state_dtype=torch.bfloat16)
    cache = torch.randn(4, 2, 4, 8, 10).to(torch.bfloat16)
    state = cache[:, 1, :, :, 1:9]  # [4, 4, 8, 8], strided
    state.copy_(kw["state"])
    before, start = cache.clone(), state.clone()
    D, dt_bias = kw["D"][:, 0], kw["dt_bias"][:, 0]
    out = torch_kernels.selective_state_update(state, kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], D, kw["z"],
                                               dt_bias, True, kw["state_batch_indices"], implementation=backend)
    want_out, want_state = naive_update(**{**kw, "state": start}, dt_softplus=True)
    assert_close(out, want_out, torch.float32, what="out")  # read before the state is rounded
    assert_close(state, want_state, torch.bfloat16, what="state")
    outside = torch.ones(cache.shape, dtype=torch.bool)
    outside[:, 1, :, :, 1:9] = False
    assert torch.equal(cache[outside], before[outside])
    idle = [r for r in range(4) if r not in kw["state_batch_indices"].tolist()]
    assert torch.equal(state[idle], before[:, 1, :, :, 1:9][idle])


SENTINEL = -1234.5  # what the state rows no good entry names hold, before and after


@pytest.mark.parametrize("backend", backend_params(UPDATE))
def test_update_in_deferred_mode_makes_a_bad_row_padding(backend):
    """Deferred checks: entry 1's row is past the state's, entry 3 is padding. The call raises
    nothing; entry 1 is skipped as padding and its output is NaN, entry 3's is zeros, the others'
    are the definition's; only rows 3 and 0 are written, every other row keeps its sentinel; on
    Triton (the accelerator's path) nothing is read on the host; ``raise_deferred_errors`` then
    names state_batch_indices."""
    require_backend(backend)
    kw = make_update_inputs(batch=4, rows=6)
    kw["state_batch_indices"] = torch.tensor([3, 6, 0, -1], dtype=torch.int32)
    idle = [1, 2, 4, 5]
    kw["state"][idle] = SENTINEL
    want_out, want_state = naive_update(**{**kw, "state_batch_indices": torch.tensor([3, -1, 0, -1])},
                                        dt_softplus=True)
    state = kw["state"].clone()
    with torch_kernels.checks("deferred"), HostReads() as guard:
        out = torch_kernels.selective_state_update(**{**kw, "state": state}, dt_softplus=True, implementation=backend)
    assert backend != "triton" or not guard.reads, guard.reads
    with pytest.raises(ValueError, match=r"^state_batch_indices: expected rows below state's 6 \(found by a "
                                         r"deferred check\)$"):
        torch_kernels.raise_deferred_errors()
    assert torch.isnan(out[1]).all() and torch.equal(out[3], torch.zeros_like(out[3]))
    assert_close(out[[0, 2]], want_out[[0, 2]], torch.float32, what="good entries' out")
    assert_close(state[[3, 0]], want_state[[3, 0]], torch.float32, what="written rows")
    assert (state[idle] == SENTINEL).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_scan_in_deferred_mode_nans_a_head_whose_state_grows(backend):
    """A positive A in head 2 (a growing state), deferred checks: the call raises nothing, head 2's
    y and final states are NaN, the other heads' are those of the same call with a decaying head 2
    (heads are independent), nothing is read on the host on Triton; ``raise_deferred_errors`` then
    names A."""
    require_backend(backend)
    kw = make_scan_inputs(h0=True)
    want_y, want_states = torch_kernels.mamba_chunk_scan_combined(**kw, chunk_size=8, dt_softplus=True,
                                                                  return_final_states=True, implementation=backend)
    kw["A"][2] = 0.5
    with torch_kernels.checks("deferred"), HostReads() as guard:
        y, states = torch_kernels.mamba_chunk_scan_combined(**kw, chunk_size=8, dt_softplus=True,
                                                            return_final_states=True, implementation=backend)
    assert backend != "triton" or not guard.reads, guard.reads
    with pytest.raises(ValueError, match=r"^A: expected A \* dt <= 0 \(A <= 0: a decaying state\) \(found by a "
                                         r"deferred check\)$"):
        torch_kernels.raise_deferred_errors()
    assert torch.isnan(y[:, :, 2]).all() and torch.isnan(states[:, 2]).all()
    others = [0, 1, 3]
    torch.testing.assert_close(y[:, :, others], want_y[:, :, others], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(states[:, others], want_states[:, others], rtol=1e-6, atol=1e-6)


# ---- transformers' torch fallbacks ----

MODELS = ["mamba2", "bamba", "nemotron_h", "falcon_h1", "granitemoehybrid", "zamba2"]


@pytest.mark.parametrize("model", MODELS)
def test_matches_transformers_torch_fallbacks(model):
    """These models call ``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=, D=, z=None,
    dt_bias=, dt_softplus=True, initial_states=, dt_limit=, return_final_states=)`` and
    ``selective_state_update(state, x, dt, A, B, C, D, z=None, dt_bias=, dt_softplus=True)`` with
    expanded dt, A, D and dt_bias; without mamba_ssm (as here) they run their torch fallbacks
    (a segment-sum scan in chunks, a broadcast decode step), which these ops must equal."""
    modeling = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    kw = make_scan_inputs(length=19, h0=True, z=False)
    args = dict(dt=kw["dt"], A=kw["A"], B=kw["B"], C=kw["C"], chunk_size=8, D=kw["D"], dt_bias=kw["dt_bias"],
                initial_states=kw["initial_states"], dt_softplus=True, dt_limit=(0.0, 5.0), return_final_states=True)
    theirs_y, theirs_state = modeling.mamba2_chunk_scan(kw["x"], **args)
    ours_y, ours_state = torch_kernels.mamba_chunk_scan_combined(kw["x"], **args)
    torch.testing.assert_close(ours_y, theirs_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_state, theirs_state, rtol=1e-4, atol=1e-4)
    up = make_update_inputs(z=False)
    theirs_state, ours_state = up["state"].clone(), up["state"].clone()
    common = (up["x"], up["dt"], up["A"], up["B"], up["C"], up["D"])
    theirs = modeling.mamba2_selective_state_update(theirs_state, *common, dt_bias=up["dt_bias"], dt_softplus=True)
    ours = torch_kernels.selective_state_update(ours_state, *common, dt_bias=up["dt_bias"], dt_softplus=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_state, theirs_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["mamba", "jamba"])
def test_mamba1_decode_form_matches_transformers_torch_fallback(model):
    """Mamba-1 models call ``selective_state_update(state [B, D, N], x [B, D], dt [B, D], A [D, N],
    B [B, N], C [B, N], D [D], z=, dt_bias=, dt_softplus=True)``: one head of all channels."""
    require_backend("triton")
    modeling = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    up = make_update_inputs(batch=2, heads=1, groups=1, dstate=6, headdim=10, expanded=False)
    args = [up["x"][:, 0], up["dt"][:, 0], up["A"][0], up["B"][:, 0], up["C"][:, 0], up["D"][0]]
    kwargs = dict(z=up["z"][:, 0], dt_bias=up["dt_bias"][0], dt_softplus=True)
    theirs_state, ours_state = up["state"][:, 0].clone(), up["state"][:, 0].clone()
    theirs = modeling.mamba_selective_state_update(theirs_state, *args, **kwargs)
    ours = torch_kernels.selective_state_update(ours_state, *args, **kwargs, implementation="triton")
    assert ours.shape == args[0].shape and backends.last_backend(UPDATE) == "triton"
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_state, theirs_state, rtol=1e-5, atol=1e-5)


def test_a_mamba2_mixer_on_these_ops_matches_its_torch_path(monkeypatch):
    """A tiny Mamba2Mixer (random weights) run on its torch path, then with its scan function
    replaced by mamba_chunk_scan_combined (as transformers' kernel lookup does): the same output."""
    from transformers import Mamba2Config
    from transformers.models.mamba2 import modeling_mamba2 as modeling

    config = Mamba2Config(hidden_size=32, num_heads=8, head_dim=8, n_groups=2, state_size=8, expand=2, chunk_size=8,
                          num_hidden_layers=1, vocab_size=16)
    torch.manual_seed(0)
    mixer = modeling.Mamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        mixer.A_log.uniform_(-1, 1)
        mixer.dt_bias.normal_()
        mixer.D.normal_()
    hidden = torch.randn(2, 13, 32)
    with torch.no_grad():
        theirs = mixer(hidden)
        monkeypatch.setattr(modeling, "mamba2_chunk_scan", torch_kernels.mamba_chunk_scan_combined)
        ours = mixer(hidden)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


# ---- the op contract ----

def test_opcheck_update():
    kw = make_update_inputs(rows=5, padding=True)
    run_opcheck(torch.ops.torch_kernels.selective_state_update.default,
                (kw["state"], kw["x"], kw["dt"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"], kw["dt_bias"], True,
                 kw["state_batch_indices"]))


def test_compile_fullgraph_scan_gradients_and_update():
    """One compiled function: the scan with final states and its gradients, then a decode step
    writing the state; no graph break, eager's values."""
    def step(x, dt, A, B, C, D, dt_bias, h0, state, up):
        y, final = torch_kernels.mamba_chunk_scan_combined(x, dt, A, B, C, 8, D, dt_bias=dt_bias, initial_states=h0,
                                                           dt_softplus=True, return_final_states=True)
        out = torch_kernels.selective_state_update(state, *up, dt_softplus=True)
        return y.square().sum() + final.sum(), out

    kw = make_scan_inputs(length=10, h0=True, z=False)
    up = make_update_inputs()
    up_args = (up["x"], up["dt"], up["A"], up["B"], up["C"], up["D"], up["z"], up["dt_bias"])
    names = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_states")
    results = {}
    for name, fn in (("eager", step), ("compiled", compiled_fullgraph(step))):
        leaves = [kw[n].clone().requires_grad_() for n in names]
        state = up["state"].clone()
        loss, out = fn(*leaves, state, up_args)
        results[name] = (loss.detach(), out, state, *torch.autograd.grad(loss, leaves))
    for got, want in zip(results["compiled"], results["eager"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_update_is_inference_only_and_counts_its_flops():
    kw = make_update_inputs()
    with pytest.raises(RuntimeError, match="inference-only"):
        torch_kernels.selective_state_update(**{**kw, "x": kw["x"].clone().requires_grad_()})
    batch, heads, headdim = kw["x"].shape
    assert counted_flops(lambda: torch_kernels.selective_state_update(**kw)) == 6 * batch * heads * headdim * 8


def test_sycl_kernels_build_spirv():
    require_backend("sycl")
    from oneapi_impl import mamba2

    binaries = mamba2.spirv_binaries()
    assert len(binaries) == 3 and all(int.from_bytes(b[:4], "little") == 0x07230203 for b in binaries)


def test_torchax_tensors_run_both_ops_with_gradients():
    require_backend("pallas")
    run_isolated(TORCHAX_CHECK)


TORCHAX_CHECK = """
import torch, torch_kernels
from harness import assert_close
from test_mamba2 import make_scan_inputs, make_update_inputs, naive_packed, naive_update

env = torch_kernels.torchax_environment()
kw = make_scan_inputs(length=12, heads=2, seq=((5, 7), (12,)), h0=True)
up = make_update_inputs(rows=5, padding=True)
names = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
want_kw = {**kw, **{n: kw[n].double().requires_grad_() for n in names}}
want, _ = naive_packed(want_kw, dt_softplus=True)
want_grads = torch.autograd.grad(want.square().sum(), [want_kw[n] for n in names])
want_out, want_state = naive_update(**up, dt_softplus=True)
with env:
    # the composite on torchax tensors, autograd through its torch parts (chunk_simple_gla's jnp form: its
    # Pallas kernels run in test_linear_attention_pallas)
    leaves = {n: kw[n].to("jax").requires_grad_() for n in names}
    y = torch_kernels.mamba_chunk_scan_combined(**leaves, seq_idx=kw["seq_idx"].to("jax"), chunk_size=8,
                                                dt_softplus=True, implementation="reference")
    assert type(y).__module__.startswith("torchax"), type(y)
    grads = torch.autograd.grad(y.square().sum(), list(leaves.values()))
    assert_close(y.detach().to("cpu"), want, torch.float32, what="y")
    for name, g, w in zip(names, grads, want_grads):
        assert_close(g.to("cpu"), w, torch.float32, what=f"d{name}")
    # the update writes the state's torchax tensor (its jnp form: the Pallas one runs in the CPU tests)
    state = up["state"].to("jax")
    args = {n: t.to("jax") if isinstance(t, torch.Tensor) else t for n, t in up.items() if n != "state"}
    got = torch_kernels.selective_state_update(state, **args, dt_softplus=True, implementation="reference")
    assert_close(got.to("cpu"), want_out, torch.float32, what="update out")
    assert_close(state.to("cpu"), want_state, torch.float32, what="state")
print("torchax ok")
"""


@pytest.mark.parametrize("backend", backend_params(UPDATE))
def test_an_empty_batch_gives_an_empty_result_on_every_backend(backend):
    """No entry: an empty output and the state untouched (Pallas read out of bounds before)."""
    require_backend(backend)
    state = torch.full((2, 2, 3, 4), 5.0)
    out = torch_kernels.selective_state_update(state, torch.zeros(0, 2, 3), torch.zeros(0, 2, 3), -torch.ones(2, 3, 4),
                                               torch.zeros(0, 1, 4), torch.zeros(0, 1, 4),
                                               state_batch_indices=torch.zeros(0, dtype=torch.int32),
                                               implementation=backend)
    assert out.shape == (0, 2, 3) and (state == 5.0).all()

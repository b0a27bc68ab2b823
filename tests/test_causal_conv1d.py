"""The causal_conv1d ops (causal_conv1d_fn, causal_conv1d_update) through their public API on every
backend, against the definition: loops over time written from the math (``naive_conv``,
``naive_update``) in float64, and autograd through ``naive_conv`` for every gradient; then
against transformers' own torch fallbacks (the F.conv1d expressions Mamba-2 and Qwen3-Next run
without the causal-conv1d package), and the op contract (opcheck, torch.compile with no graph
break, inference-only update, FLOPs, checked inputs, torchax tensors).

Float32 outputs and gradients are held to the float32 tolerance of ``harness.assert_close``
(2e-5 relative); measured errors are about 1e-7. The Pallas kernels compile every new shape
(about 1.5 s each in interpret mode), so they run a share of the cases, said where skipped.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_kernels
from harness import HostReads, assert_close, backend_params, compiled_fullgraph, counted_flops, require_backend, \
    run_isolated, run_opcheck
from torch_kernels import backends

FN, UPDATE = "causal_conv1d_fn", "causal_conv1d_update"


# ---- the definition ----

def naive_conv(x, weight, bias=None, seq_idx=None, initial_states=None, silu=False):
    """``out[b, :, t] = act(bias + sum_k weight[:, k] * input[t - (W - 1 - k)])``, the input before
    ``t = 0`` from the initial states (or zero), an input of another sequence counting zero: a loop
    over batch, time and taps in float64 (differentiable)."""
    batch, dim, length = x.shape
    width = weight.shape[1]
    ids = None if seq_idx is None else seq_idx.tolist()
    w = weight.double()
    rows = []
    for b in range(batch):
        steps = []
        for t in range(length):
            acc = torch.zeros(dim, dtype=torch.float64) if bias is None else bias.double()
            for k in range(width):
                s = t - (width - 1 - k)
                if s >= 0 and (ids is None or ids[b][s] == ids[b][t]):
                    acc = acc + w[:, k] * x[b, :, s].double()
                elif s < 0 and initial_states is not None:
                    acc = acc + w[:, k] * initial_states[b, :, width - 1 + s].double()
            steps.append(F.silu(acc) if silu else acc)
        rows.append(torch.stack(steps, -1))
    return torch.stack(rows)


def naive_update(x, conv_state, weight, bias=None, silu=False, cache_seqlens=None, conv_state_indices=None):
    """(out, new conv_state) in float64: for each live entry, its window read from its row, the new
    inputs convolved one by one, then written into the row one by one."""
    batch, dim, length = x.shape
    width, state_len = weight.shape[1], conv_state.shape[2]
    state = conv_state.double().clone()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for b in range(batch):
        row = b if conv_state_indices is None else int(conv_state_indices[b])
        if row < 0:
            continue
        start = 0 if cache_seqlens is None else int(cache_seqlens[b])
        positions = [(start - (width - 1) + i) % state_len if cache_seqlens is not None
                     else state_len - (width - 1) + i for i in range(width - 1)]
        window = [state[row, :, p].clone() for p in positions]
        for step in range(length):
            window.append(x[b, :, step].double())
            acc = sum(weight[:, k].double() * window[-width + k] for k in range(width))
            acc = acc + (0 if bias is None else bias.double())
            out[b, :, step] = F.silu(acc) if silu else acc
        for step in range(length):
            if cache_seqlens is None:
                state[row] = torch.cat([state[row, :, 1:], x[b, :, step:step + 1].double()], -1)
            else:
                state[row, :, (start + step) % state_len] = x[b, :, step].double()
    return out, state


# ---- inputs ----

def make_fn_inputs(batch=2, dim=20, length=37, width=4, bias=True, h0=False, seq=None, channel_last=False,
                   dtype=torch.float32, seed=0):
    """Keyword arguments of causal_conv1d_fn; ``seq``: each batch entry's sequence lengths;
    ``channel_last``: x a transposed ``[B, T, D]`` tensor, as models pass their projection."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, dim, generator=gen).transpose(1, 2) if channel_last else \
        torch.randn(batch, dim, length, generator=gen)
    kw = dict(x=x.to(dtype),
              weight=torch.randn(dim, width, generator=gen) * width ** -0.5,
              bias=torch.randn(dim, generator=gen) if bias else None,
              initial_states=torch.randn(batch, dim, width - 1, generator=gen).to(dtype) if h0 else None)
    if seq is not None:
        kw["seq_idx"] = torch.tensor([[i for i, n in enumerate(lengths) for _ in range(n)] for lengths in seq],
                                     dtype=torch.int32)
    return kw


FN_CASES = {  # sizes off the Triton blocks (16 channels, up to 256 steps)
    "h0-silu": dict(make=dict(h0=True), activation="silu"),
    "seq_idx-silu-channel-last": dict(make=dict(seq=((10, 1, 26), (37,)), channel_last=True), activation="silu"),
    "W2-T1-no-bias": dict(make=dict(width=2, length=1, bias=False), activation=None),
    "T2-below-W-h0-W5": dict(make=dict(width=5, length=2, h0=True), activation="swish"),
}
PALLAS_FN_CASES = ("h0-silu",)  # seq_idx on pallas: test_torchax_tensors_run_both_ops_with_gradients


def pallas_share(backend, case, share):
    if backend == "pallas" and case not in share:
        pytest.skip(f"pallas compiles each new shape (seconds in interpret mode): its share here is {share}")


def with_grads(kw):
    """A copy of ``kw`` whose float tensors require grad: (copy, {name: leaf})."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in kw.items()
              if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return {**kw, **leaves}, leaves


@pytest.mark.parametrize("case", list(FN_CASES))
@pytest.mark.parametrize("backend", backend_params(FN))
def test_fn_and_its_gradients_match_the_definition(backend, case):
    require_backend(backend)
    pallas_share(backend, case, PALLAS_FN_CASES)
    spec = FN_CASES[case]
    kw = make_fn_inputs(**spec["make"])
    final = "seq_idx" not in kw
    got_kw, got_leaves = with_grads(kw)
    assert got_kw["x"].stride(1) == 1 or not spec["make"].get("channel_last")  # the leaf keeps x's layout
    result = torch_kernels.causal_conv1d_fn(**got_kw, activation=spec["activation"], return_final_states=final,
                                            implementation=backend)
    out, states = result if final else (result, None)
    assert backends.last_backend(FN) == backend and out.dtype == kw["x"].dtype
    gen = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=gen)
    outputs, cotangents = [out], [dout]
    if final:  # the final states are the last W - 1 inputs: their gradient flows back to x / h0
        dstates = torch.randn(states.shape, generator=gen)
        outputs.append(states)
        cotangents.append(dstates)
    grads = torch.autograd.grad(outputs, list(got_leaves.values()), cotangents)

    want_kw, want_leaves = with_grads(kw)
    want = naive_conv(want_kw["x"], want_kw["weight"], want_kw["bias"], want_kw.get("seq_idx"),
                      want_kw["initial_states"], silu=spec["activation"] is not None)
    assert_close(out, want, torch.float32, what="out")
    want_outputs = [want]
    if final:
        width = kw["weight"].shape[1]
        head = want_kw["initial_states"] if want_kw["initial_states"] is not None else \
            torch.zeros(kw["x"].shape[0], kw["x"].shape[1], width - 1)
        want_states = torch.cat([head.double(), want_kw["x"].double()], -1)[..., -(width - 1):]
        assert_close(states, want_states, torch.float32, what="final states")
        want_outputs.append(want_states)
    want_grads = torch.autograd.grad(want_outputs, list(want_leaves.values()), [c.double() for c in cotangents])
    for name, got, expected in zip(got_leaves, grads, want_grads):
        assert got.dtype == kw[name].dtype, name
        assert_close(got, expected, torch.float32, what=f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", backend_params(FN))
def test_fn_half_precision(backend, dtype):
    """16-bit x and initial states, a float32 filter (as models keep it): out in x's dtype within its tolerance."""
    require_backend(backend)
    if backend == "pallas" and dtype == torch.float16:
        pytest.skip("pallas compiles each new shape (seconds in interpret mode): its share here is bfloat16")
    kw = make_fn_inputs(h0=True, dtype=dtype)
    out = torch_kernels.causal_conv1d_fn(**kw, activation="silu", implementation=backend)
    assert out.dtype == dtype
    want = naive_conv(kw["x"], kw["weight"], kw["bias"], None, kw["initial_states"], silu=True)
    assert_close(out, want, dtype, what=str(dtype))


# ---- the update ----

def make_update_inputs(batch=3, dim=20, steps=1, state_len=3, width=4, lines=None, ring=False, padding=False,
                       dtype=torch.float32, seed=0):
    """Keyword arguments of causal_conv1d_update; with ``lines`` the entries use shuffled rows of a
    larger conv_state (the last one a padding entry with ``padding``)."""
    gen = torch.Generator().manual_seed(seed)
    kw = dict(x=torch.randn(batch, dim, steps, generator=gen).to(dtype),
              conv_state=torch.randn(lines or batch, dim, state_len, generator=gen).to(dtype),
              weight=torch.randn(dim, width, generator=gen) * width ** -0.5, bias=torch.randn(dim, generator=gen))
    if ring:
        kw["cache_seqlens"] = torch.randint(0, 4 * state_len, (batch,), generator=gen, dtype=torch.int32)
    if lines:
        rows = torch.randperm(lines, generator=gen)[:batch].to(torch.int32)
        if padding:
            rows[-1] = -1
        kw["conv_state_indices"] = rows
    return kw


UPDATE_CASES = {
    "one-step": dict(),
    "3-steps-long-state-rows": dict(steps=3, state_len=6, lines=5, padding=True),
    "ring-one-step-rows": dict(ring=True, state_len=5, lines=6, padding=True),
    "ring-more-steps-than-state-W3": dict(ring=True, steps=7, state_len=4, width=3),
}
PALLAS_UPDATE_CASES = ("ring-one-step-rows",)  # and the shift form in the strided test


@pytest.mark.parametrize("case", list(UPDATE_CASES))
@pytest.mark.parametrize("backend", backend_params(UPDATE))
def test_update_matches_the_definition_and_writes_only_its_rows(backend, case):
    require_backend(backend)
    pallas_share(backend, case, PALLAS_UPDATE_CASES)
    kw = make_update_inputs(**UPDATE_CASES[case])
    want_out, want_state = naive_update(kw["x"], kw["conv_state"], kw["weight"], kw["bias"], True,
                                        kw.get("cache_seqlens"), kw.get("conv_state_indices"))
    state = kw["conv_state"].clone()
    out = torch_kernels.causal_conv1d_update(**{**kw, "conv_state": state}, activation="silu", implementation=backend)
    assert backends.last_backend(UPDATE) == backend
    assert_close(out, want_out, torch.float32, what="out")
    # inputs are stored exactly; rows no entry uses keep every bit
    assert torch.equal(state, want_state.float()), (state - want_state).abs().max()


@pytest.mark.parametrize("backend", backend_params(UPDATE))
def test_update_on_strided_state_with_one_step_x_in_bfloat16(backend):
    """x ``[B, D]`` (one step), conv_state a strided view of a larger cache: only its rows change."""
    require_backend(backend)
    kw = make_update_inputs(dtype=torch.bfloat16, lines=4, padding=True)
    cache = torch.randn(4, 2, 20, 5).to(torch.bfloat16)
    state = cache[:, 1, :, 1:4]  # [4, 20, 3], strided
    state.copy_(kw["conv_state"])
    before = cache.clone()
    x = kw["x"][..., 0]
    out = torch_kernels.causal_conv1d_update(x, state, kw["weight"], kw["bias"], "silu",
                                             conv_state_indices=kw["conv_state_indices"], implementation=backend)
    want_out, want_state = naive_update(kw["x"], kw["conv_state"], kw["weight"], kw["bias"], True, None,
                                        kw["conv_state_indices"])
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert_close(out, want_out[..., 0], torch.bfloat16, what="out")
    assert torch.equal(state, want_state.to(torch.bfloat16))
    outside = torch.ones(cache.shape, dtype=torch.bool)
    outside[:, 1, :, 1:4] = False
    assert torch.equal(cache[outside], before[outside])


SENTINEL = -1234.5  # what the conv_state rows no good entry names hold, before and after


@pytest.mark.parametrize("backend", backend_params(UPDATE))
def test_update_in_deferred_mode_makes_bad_entries_safe(backend):
    """Deferred checks: entry 1's row is past conv_state's (skipped as padding), entry 3's
    cache_seqlens is negative (read as 0). The call raises nothing; those entries' outputs are NaN,
    the others' are the definition's; only the good entries' rows are written (entry 3's at ring
    position 0), every other row keeps its sentinel, and on Triton (the accelerator's path) nothing
    is read on the host; ``raise_deferred_errors`` then names the argument."""
    require_backend(backend)
    kw = make_update_inputs(batch=4, steps=2, state_len=5, lines=8, ring=True)
    kw["conv_state_indices"] = torch.tensor([5, 99, 2, 6], dtype=torch.int32)
    kw["cache_seqlens"][3] = -3
    used = [5, 2, 6]
    kw["conv_state"][[r for r in range(8) if r not in used]] = SENTINEL
    safe_seqlens = kw["cache_seqlens"].clamp(min=0)
    want_out, want_state = naive_update(kw["x"], kw["conv_state"], kw["weight"], kw["bias"], True, safe_seqlens,
                                        torch.tensor([5, -1, 2, 6]))
    state = kw["conv_state"].clone()
    with torch_kernels.checks("deferred"), HostReads() as guard:
        out = torch_kernels.causal_conv1d_update(**{**kw, "conv_state": state}, activation="silu",
                                                 implementation=backend)
    assert backend != "triton" or not guard.reads, guard.reads
    with pytest.raises(ValueError, match=r"^(conv_state_indices|cache_seqlens): expected .*"
                                         r"\(and 1 other failed check\)$"):
        torch_kernels.raise_deferred_errors()
    assert torch.isnan(out[[1, 3]]).all()
    assert_close(out[[0, 2]], want_out[[0, 2]], torch.float32, what="good entries' out")
    assert torch.equal(state, want_state.float()), (state - want_state).abs().max()
    assert (state[[r for r in range(8) if r not in used]] == SENTINEL).all()


@pytest.mark.parametrize("backend", backend_params(FN))
def test_fn_in_deferred_mode_nans_the_entry_with_a_seq_idx_past_int32(backend):
    """An int64 seq_idx past int32's range in batch entry 1: no raise at the call, entry 1's output
    NaN, entry 0's as the full mode gives it, nothing read on the host on Triton;
    ``raise_deferred_errors`` names seq_idx."""
    require_backend(backend)
    kw = make_fn_inputs(seq=((10, 27), (5, 32)))
    want = torch_kernels.causal_conv1d_fn(**kw, activation="silu", implementation=backend)
    kw["seq_idx"] = kw["seq_idx"].long()
    kw["seq_idx"][1, 5:] = 2 ** 32
    with torch_kernels.checks("deferred"), HostReads() as guard:
        out = torch_kernels.causal_conv1d_fn(**kw, activation="silu", implementation=backend)
    assert backend != "triton" or not guard.reads, guard.reads
    with pytest.raises(ValueError, match=r"^seq_idx: expected values in int32's range"):
        torch_kernels.raise_deferred_errors()
    assert torch.isnan(out[1]).all()
    torch.testing.assert_close(out[0], want[0], rtol=0, atol=0)


def test_prefill_then_decode_continues_one_run():
    """A prefill's final states handed to decode steps (shift form) give what one run over the whole
    sequence gives, on the default backend."""
    kw = make_fn_inputs(length=12)
    whole = torch_kernels.causal_conv1d_fn(kw["x"], kw["weight"], kw["bias"], activation="silu")
    head, states = torch_kernels.causal_conv1d_fn(kw["x"][..., :9], kw["weight"], kw["bias"], activation="silu",
                                                  return_final_states=True)
    steps = [torch_kernels.causal_conv1d_update(kw["x"][..., t], states, kw["weight"], kw["bias"], "silu")
             for t in range(9, 12)]
    torch.testing.assert_close(torch.cat([head, torch.stack(steps, -1)], -1), whole)


# ---- transformers' torch fallbacks ----

@pytest.mark.parametrize("model", ["mamba2", "qwen3_next"])
def test_matches_transformers_torch_fallbacks(model):
    """Mamba-2 and Qwen3-Next call ``causal_conv1d_fn(x, weight, bias, activation=...)`` and
    ``causal_conv1d_update(x, conv_state, weight, bias, activation=...)``; without the
    causal-conv1d package (as here) they run their F.conv1d fallbacks, which these ops must equal."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    kw = make_fn_inputs(dim=24, length=19)
    x, weight, bias = kw["x"], kw["weight"], kw["bias"]
    torch.testing.assert_close(torch_kernels.causal_conv1d_fn(x, weight, bias, activation="silu"),
                               modeling.causal_conv1d_fn(x, weight, bias, activation="silu"))
    state = torch.randn(2, 24, 3)
    theirs_state, ours_state = state.clone(), state.clone()
    step = torch.randn(2, 24, 1)
    theirs = modeling.causal_conv1d_update(step, theirs_state, weight, bias, activation="silu")
    ours = torch_kernels.causal_conv1d_update(step, ours_state, weight, bias, activation="silu")
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours_state, theirs_state)


# ---- the op contract ----

def test_opcheck_both_ops():
    kw = make_fn_inputs(dim=8, length=6, h0=True)
    run_opcheck(torch.ops.torch_kernels.causal_conv1d_fn.default,
                (kw["x"].requires_grad_(), kw["weight"].requires_grad_(), kw["bias"], None, kw["initial_states"],
                 "silu"))
    kw = make_update_inputs(dim=8, ring=True, lines=4, padding=True)
    run_opcheck(torch.ops.torch_kernels.causal_conv1d_update.default,
                (kw["x"], kw["conv_state"], kw["weight"], kw["bias"], "silu", kw["cache_seqlens"],
                 kw["conv_state_indices"]))


def test_compile_fullgraph_forward_backward_and_update():
    """One compiled function: the convolution with final states and its gradients, then a decode
    step writing the state; no graph break, eager's values."""
    def step(x, weight, bias, h0, conv_state, nxt):
        out, final = torch_kernels.causal_conv1d_fn(x, weight, bias, initial_states=h0, return_final_states=True,
                                                    activation="silu")
        decoded = torch_kernels.causal_conv1d_update(nxt, conv_state, weight.detach(), bias.detach(), "silu")
        return out.square().sum() + final.sum(), decoded

    kw = make_fn_inputs(dim=8, length=10, h0=True)
    nxt = torch.randn(2, 8)
    results = {}
    for name, fn in (("eager", step), ("compiled", compiled_fullgraph(step))):
        leaves = [t.clone().requires_grad_() for t in (kw["x"], kw["weight"], kw["bias"], kw["initial_states"])]
        state = torch.zeros(2, 8, 3)
        loss, decoded = fn(*leaves, state, nxt)
        results[name] = (loss.detach(), decoded, state, *torch.autograd.grad(loss, leaves))
    for got, want in zip(results["compiled"], results["eager"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_update_is_inference_only_and_fn_counts_its_flops():
    kw = make_update_inputs()
    with pytest.raises(RuntimeError, match="inference-only"):
        torch_kernels.causal_conv1d_update(kw["x"].requires_grad_(), kw["conv_state"], kw["weight"])
    fn = make_fn_inputs()
    b, d, t = fn["x"].shape
    assert counted_flops(lambda: torch_kernels.causal_conv1d_fn(fn["x"], fn["weight"])) == 2 * b * d * t * 4


def test_sycl_kernels_build_spirv():
    require_backend("sycl")
    from oneapi_impl import causal_conv1d

    binaries = causal_conv1d.spirv_binaries()
    assert len(binaries) == 9 and all(int.from_bytes(b[:4], "little") == 0x07230203 for b in binaries)


def test_torchax_tensors_run_both_ops_with_gradients():
    require_backend("pallas")
    run_isolated(TORCHAX_CHECK)


TORCHAX_CHECK = """
import torch, torch_kernels
from harness import assert_close
from test_causal_conv1d import make_fn_inputs, make_update_inputs, naive_conv, naive_update

env = torch_kernels.torchax_environment()
kw = make_fn_inputs(dim=16, length=12, seq=((5, 7), (12,)))
up = make_update_inputs(dim=16, ring=True, lines=4, padding=True)
leaves = [t.double().requires_grad_() for t in (kw["x"], kw["weight"], kw["bias"])]
want = naive_conv(*leaves, kw["seq_idx"])
want_grads = torch.autograd.grad(want.square().sum(), leaves)
want_out, want_state = naive_update(up["x"], up["conv_state"], up["weight"], up["bias"], True, up["cache_seqlens"],
                                    up["conv_state_indices"])
with env:
    # the convolution's Pallas kernel and its custom_vjp (packed sequences: the backward runs backwards in time)
    jx, jw, jb = (t.to("jax").requires_grad_() for t in (kw["x"], kw["weight"], kw["bias"]))
    out = torch_kernels.causal_conv1d_fn(jx, jw, jb, kw["seq_idx"].to("jax"), implementation="pallas")
    assert type(out).__module__.startswith("torchax"), type(out)
    grads = torch.autograd.grad(out.square().sum(), [jx, jw, jb])
    assert_close(out.detach().to("cpu"), want, torch.float32, what="out")
    for name, g, w in zip("xwb", grads, want_grads):
        assert_close(g.to("cpu"), w, torch.float32, what=f"d{name}")
    # the update writes the state's torchax tensor (its jnp form: the Pallas one runs in the CPU tests)
    state = up["conv_state"].to("jax")
    got = torch_kernels.causal_conv1d_update(up["x"].to("jax"), state, up["weight"].to("jax"), up["bias"].to("jax"),
                                             "silu", up["cache_seqlens"].to("jax"), up["conv_state_indices"].to("jax"),
                                             implementation="reference")
    assert_close(got.to("cpu"), want_out, torch.float32, what="update out")
    assert torch.equal(state.to("cpu"), want_state.float())
print("torchax ok")
"""


@pytest.mark.parametrize("backend", backend_params(UPDATE))
def test_ring_position_near_int32s_end(backend):
    """cache_seqlens + L past 2**31 - 1: the two new steps land at ring positions 1 and 2 of a
    3-column state (Pallas' int32 sum wrapped and wrote [0, 2, 0])."""
    require_backend(backend)
    state = torch.zeros(1, 1, 3)
    out = torch_kernels.causal_conv1d_update(torch.tensor([[[1.0, 2.0]]]), state, torch.ones(1, 2),
                                             cache_seqlens=torch.tensor([2**31 - 1], dtype=torch.int32),
                                             implementation=backend)
    assert state.tolist() == [[[0.0, 1.0, 2.0]]] and out.tolist() == [[[1.0, 3.0]]]


@pytest.mark.parametrize("backend", backend_params(FN))
def test_empty_sizes_give_empty_results_on_every_backend(backend):
    """One rule for empty sizes: an empty result (and the state untouched). Before: Pallas read out
    of bounds at batch 0 and divided by zero at T or D 0, the reference raised torch's conv errors."""
    require_backend(backend)
    for x, weight in ((torch.zeros(0, 4, 5), torch.ones(4, 3)), (torch.zeros(2, 4, 0), torch.ones(4, 3)),
                      (torch.zeros(2, 0, 5), torch.ones(0, 3))):
        assert torch_kernels.causal_conv1d_fn(x, weight, implementation=backend).shape == x.shape
    out, final = torch_kernels.causal_conv1d_fn(torch.zeros(2, 4, 0), torch.ones(4, 3), initial_states=torch.ones(2, 4, 2),
                                                return_final_states=True, implementation=backend)
    assert out.shape == (2, 4, 0) and torch.equal(final, torch.ones(2, 4, 2))
    x = torch.zeros(2, 4, 0, requires_grad=True)
    torch_kernels.causal_conv1d_fn(x, torch.ones(4, 3), implementation=backend).sum().backward()
    assert x.grad.shape == x.shape
    for x, state in ((torch.zeros(0, 4), torch.zeros(0, 4, 3)), (torch.zeros(2, 4, 0), torch.full((2, 4, 3), 5.0))):
        before = state.clone()
        out = torch_kernels.causal_conv1d_update(x, state, torch.ones(4, 3), implementation=backend)
        assert out.shape == x.shape and torch.equal(state, before)

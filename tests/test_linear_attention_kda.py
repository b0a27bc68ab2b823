"""Kimi Delta Attention (chunk_kda, fused_recurrent_kda): the delta rule with a log decay per key
channel, through the public API on every backend that registers it, against a step-by-step
recurrence written here from the definition (float64) and autograd through it; against
transformers' own torch versions of Kimi Linear's KDA; a per-head decay broadcast over K equals
Gated DeltaNet; strong per-channel decays stay exact in float32; the op contract (opcheck,
torch.compile forward and backward, FLOP counts).

Errors are relative RMSE, held to the bounds of ``test_linear_attention`` (a tenth of them).
"""

from __future__ import annotations

import functools

import pytest
import torch

import torch_kernels
from harness import backend_params, compiled_fullgraph, counted_flops, require_backend, run_opcheck
from torch_kernels import backends
import test_linear_attention as la_tests
from test_linear_attention import assert_within, relative_rmse, with_grads

CHUNK, RECURRENT = "chunk_kda", "fused_recurrent_kda"
OPS = (CHUNK, RECURRENT)
# every (backend, op) registered
OP_BACKENDS = [pytest.param(b, op, id=f"{b}-{op}") for op in OPS for b in backends.implementations(op)]


def naive_kda(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, l2norm=False):
    """The definition, per sequence and step: ``S = diag(exp(g_t)) S``, ``S += k_t (beta_t (v_t -
    S^T k_t))^T``, ``o_t = S^T (scale q_t)``; float64. (o, final states [N, H, K, V])."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if l2norm:
        q = q / (q.square().sum(-1, keepdim=True) + 1e-6).sqrt()
        k = k / (k.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    batch, length, heads, k_dim = q.shape
    bounds = [0, length] if cu_seqlens is None else [int(b) for b in cu_seqlens]
    rows = range(batch) if cu_seqlens is None else [0] * (len(bounds) - 1)
    spans = [(0, length)] * batch if cu_seqlens is None else list(zip(bounds[:-1], bounds[1:]))
    out = torch.zeros_like(v)
    finals = []
    for n, (b, (start, end)) in enumerate(zip(rows, spans)):
        state = torch.zeros(heads, k_dim, v.shape[-1], dtype=torch.float64) if initial_state is None \
            else initial_state[n].double()
        for t in range(start, end):
            state = state * g[b, t].exp()[:, :, None]
            error = v[b, t] - torch.einsum("hkv,hk->hv", state, k[b, t])
            state = state + k[b, t][:, :, None] * (beta[b, t][:, None] * error)[:, None, :]
            out[b, t] = torch.einsum("hkv,hk->hv", state, scale * q[b, t])
        finals.append(state)
    return out, torch.stack(finals)


def make_inputs(*, batch=1, length=75, heads=2, k_dim=32, v_dim=32, decay="weak", initial_state=True, l2norm=True,
                cu_seqlens=None, seed=0, dtype=torch.float32):
    """Keyword arguments of the KDA ops. ``decay``: "weak" (-0.05..0), "strong" (a quarter of
    the channels -5..-20 per step, the rest weak), or a tensor."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, k_dim, generator=gen)
    k = torch.randn(batch, length, heads, k_dim, generator=gen)
    if not l2norm:
        k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(batch, length, heads, v_dim, generator=gen)
    g = -0.05 * torch.rand(batch, length, heads, k_dim, generator=gen)
    if decay == "strong":
        strong = torch.rand(heads, k_dim, generator=gen) < 0.25
        g = torch.where(strong, -5.0 - 15.0 * torch.rand(g.shape, generator=gen), g)
    num_states = batch if cu_seqlens is None else len(cu_seqlens) - 1
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), g=g, beta=torch.rand(batch, length, heads, generator=gen),
                scale=k_dim ** -0.5,
                initial_state=torch.randn(num_states, heads, k_dim, v_dim, generator=gen) if initial_state else None,
                cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32),
                use_qk_l2norm_in_kernel=l2norm)


def run_op(op, x, **extra):
    return getattr(torch_kernels, op)(**x, output_final_state=True, **extra)


def definition(x):
    return naive_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["initial_state"], x["cu_seqlens"],
                     x["use_qk_l2norm_in_kernel"])


def errors_against_definition(op, x, backend):
    """Relative RMSE of o, the final state and every gradient: the op on ``backend`` against
    autograd through ``naive_kda``."""
    return la_tests.errors_against_definition(op, x, backend, truth=definition)


# Odd lengths around the 64-step chunk, K = 20 / V = 36, packed sequences (an empty one and a
# single step included) and batch rows, with and without the in-op l2 norm and the initial state
CASES = {
    "T75-packed-K20-V36": dict(length=75, heads=1, k_dim=20, v_dim=36, cu_seqlens=[0, 11, 11, 12, 75]),
    "T100-B2-no-state": dict(length=100, batch=2, heads=1, k_dim=16, v_dim=16, initial_state=False, l2norm=False),
}
# the interpreted kernels (pallas, sycl) take batch rows as packed sequences, as their Gated
# DeltaNet tests cover: the packed case is theirs
PACKED_ONLY = ("pallas-fused_recurrent_kda", "sycl-fused_recurrent_kda")


@pytest.mark.parametrize("backend, op, case", [pytest.param(*p.values, case, id=f"{p.id}-{case}")
                                               for p in OP_BACKENDS for case in CASES
                                               if p.id not in PACKED_ONLY or case == "T75-packed-K20-V36"])
def test_matches_definition(backend, op, case):
    require_backend(backend)
    assert_within(errors_against_definition(op, make_inputs(**CASES[case]), backend))


@pytest.mark.parametrize("backend, op", [p for p in OP_BACKENDS if p.values[:2] != ("pallas", RECURRENT)])
def test_strong_per_channel_decay_stays_exact(backend, op):
    """A quarter of the channels decay by -5 to -20 per step (exp(-1280) over a chunk), one by
    -inf at some steps (a reset of that channel), one by -1e4 (real gates reach it) on the first
    and last steps of chunks and of the 16-step blocks the chunked kernels split them in (the last
    packed sequence starts at step 2 and crosses a 64-step chunk at step 66, so the per-channel
    state is carried from one chunk to the next): outputs, final states and every gradient equal
    the float64 recurrence to float32 precision, with no inf or NaN anywhere. On the chunked forms
    and the hand-written backward kernels; pallas's step form is a JAX scan multiplying by exp(g_t)
    and differentiated by JAX, with nothing a strong decay could cancel. The packed case's shapes:
    test_matches_definition has compiled their interpreted kernels."""
    require_backend(backend)
    x = make_inputs(**dict(CASES["T75-packed-K20-V36"], cu_seqlens=[0, 1, 1, 2, 75]), decay="strong", seed=8)
    x["g"][0, [28, 59, 66, 70], 0, 3] = float("-inf")
    x["g"][0, [0, 1, 2, 17, 18, 33, 34, 49, 50, 65, 66, 74], 0, 5] = -1e4
    x["beta"] = torch.ones_like(x["beta"])
    errors = errors_against_definition(op, x, backend)
    bad = {n: f"{e:.1e}" for n, e in errors.items() if not e <= 1e-5}
    assert not bad, f"relative RMSE above 1e-5: {bad}"


@pytest.mark.parametrize("backend, op", [p for p in OP_BACKENDS if p.values[0] in ("reference", "triton")])
def test_per_head_decay_broadcast_over_channels_is_gated_deltanet(backend, op):
    """KDA with the same decay on every channel is Gated DeltaNet (its special case), forward and
    backward (dg summed over the channels is Gated DeltaNet's dg), on the code the two share:
    the reference's chunks, Triton's chunk and step kernels. (SYCL's and pallas's step forms differ from
    their Gated DeltaNet ones in one line each; ``test_matches_definition`` covers them.)"""
    require_backend(backend)
    x = make_inputs(length=20, heads=2, k_dim=16, v_dim=16, seed=2)
    scalar_g = x["g"][..., 0]
    kda_x, kda_leaves = with_grads({**x, "g": scalar_g[..., None].expand_as(x["g"]).contiguous()})
    gdn_x, gdn_leaves = with_grads({**x, "g": scalar_g})
    gdn = op.replace("kda", "gated_delta_rule")
    o, ht = run_op(op, kda_x, implementation=backend)
    o_gdn, ht_gdn = run_op(gdn, gdn_x, implementation=backend)
    (o.square().sum() + ht.sum()).backward()
    (o_gdn.square().sum() + ht_gdn.sum()).backward()
    for name, leaf in kda_leaves.items():
        got = leaf.grad.sum(-1) if name == "g" else leaf.grad
        torch.testing.assert_close(got, gdn_leaves[name].grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"d{name}: {m}")
    torch.testing.assert_close(o, o_gdn, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht, ht_gdn, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", backend_params(CHUNK, skip={
    "pallas": "pallas' kernels load every input as float32, as its Gated DeltaNet kernels do: a bfloat16 compile of "
              "its interpreted kernels would cost more test time than it adds"}))
def test_bfloat16_inputs(backend):
    """bfloat16 q, k, v through chunk_kda: o in bfloat16, the state and arithmetic float32; the
    gradients against the definition on the same rounded inputs within the family's bounds."""
    require_backend(backend)
    x = make_inputs(**CASES["T75-packed-K20-V36"], seed=4, dtype=torch.bfloat16)
    errors = errors_against_definition(CHUNK, x, backend)
    assert_within({n: e for n, e in errors.items() if n != "o"}, margin=1.0)
    assert errors["o"] <= 1e-2


@pytest.mark.parametrize("backend", backend_params(CHUNK, skip={
    "pallas": "pallas' two forms each match the definition (test_matches_definition); two more compiles of its "
              "interpreted kernels (prompt and prompt + token) would cost more test time than they add"}))
def test_decode_step_continues_the_chunked_prefill(backend):
    """A prompt through chunk_kda, then one token through fused_recurrent_kda from its final
    state: the token's output equals the chunked form's over prompt + token."""
    require_backend(backend)
    x = make_inputs(length=70, heads=1, k_dim=20, v_dim=36, seed=6)  # the packed case's kernel builds
    prompt = {**x, **{n: x[n][:, :69] for n in ("q", "k", "v", "g", "beta")}}
    token = {**x, **{n: x[n][:, 69:] for n in ("q", "k", "v", "g", "beta")}}
    _, state = run_op(CHUNK, prompt, implementation=backend)
    o_step, ht_step = run_op(RECURRENT, {**token, "initial_state": state}, implementation=backend)
    o_all, ht_all = run_op(CHUNK, x, implementation=backend)
    torch.testing.assert_close(o_step, o_all[:, 69:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ht_step, ht_all, rtol=1e-5, atol=1e-5)


def _transformers_kda():
    modeling = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear",
                                   reason="transformers without Kimi Linear: no peer to compare with")
    return modeling.chunk_kimi_delta_attention, modeling.recurrent_kimi_delta_attention


@pytest.mark.parametrize("op", OPS)
def test_matches_transformers_kimi_linear(op):
    """transformers' torch versions of Kimi Linear's chunked and recurrent KDA (its fallback when
    fla is absent; default scale, l2 norm in the op, no packed sequences) give our numbers."""
    chunked, recurrent = _transformers_kda()
    x = make_inputs(batch=2, length=66, heads=1, seed=3)
    # 16-step chunks in the peer's chunked form: its intra-chunk inverse is a Python loop per row
    peer = functools.partial(chunked, chunk_size=16) if op == CHUNK else recurrent
    want_o, want_ht = peer(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"],
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, ht = getattr(torch_kernels, op)(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert relative_rmse(o, want_o) <= 1e-5 and relative_rmse(ht, want_ht) <= 1e-5


@pytest.mark.parametrize("op", OPS)
def test_opcheck(op):
    x, _ = with_grads(make_inputs(length=20, heads=2, k_dim=8, v_dim=8, cu_seqlens=[0, 7, 20]))
    run_opcheck(getattr(torch.ops.torch_kernels, op).default,
                (x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["initial_state"], x["cu_seqlens"], True,
                 "reference"))


def test_compile_fullgraph():
    """chunk_kda compiles with fullgraph=True (no graph break) and gives eager's output and every
    input's gradient (the op's fake and autograd formula under the compiler)."""
    x = make_inputs(length=70, heads=2, k_dim=16, v_dim=16, seed=5)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def loss(*tensors):
        o, ht = torch_kernels.chunk_kda(*tensors[:5], initial_state=tensors[5], output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
        return o.square().sum() + ht.sum()

    results = []
    for fn in (loss, compiled_fullgraph(loss)):
        leaves = [x[n].detach().clone().requires_grad_() for n in names]
        value = fn(*leaves)
        results.append((value, torch.autograd.grad(value, leaves)))
    (eager, eager_grads), (compiled, compiled_grads) = results
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for name, got, want in zip(names, compiled_grads, eager_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"d{name}: {m}")


@pytest.mark.parametrize("op", OPS)
def test_flop_counter_counts_the_op(op):
    x = make_inputs(batch=2, length=10, heads=3, k_dim=8, v_dim=4)
    assert counted_flops(lambda: run_op(op, x)) == 2 * 10 * 3 * 6 * 8 * 4


def test_default_scale_and_optional_final_state():
    x = make_inputs(length=12)
    o, ht = torch_kernels.chunk_kda(**{**x, "scale": None})
    assert ht is None
    torch.testing.assert_close(o, run_op(CHUNK, {**x, "scale": 32 ** -0.5})[0])

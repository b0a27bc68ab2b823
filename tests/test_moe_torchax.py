"""The moe family on torchax ('jax') tensors: router_topk, moe_dispatch, grouped_mm, moe_combine and
fused_moe run the Pallas kernels (TPU interpret mode here) and the jnp references, against the
torch reference on CPU: forward, gradients (fused_moe's and the unfused chain's), the input checks.

torchax registers a 'jax' device for the whole process, so the checks run in a process of their own.
"""

from __future__ import annotations

import torch

import torch_kernels
from harness import require_backend, run_isolated

T, H, I, E, K = 6, 32, 16, 4, 2


def inputs():
    """Router logits, tokens, a grouped_mm weight, w13, w2 and fused_moe's output gradient."""
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(T, E, generator=gen), torch.randn(T, H, generator=gen),
            torch.randn(E, H, 8, generator=gen) / H ** 0.5, torch.randn(E, 2 * I, H, generator=gen) / H ** 0.5,
            torch.randn(E, H, I, generator=gen) / I ** 0.5, torch.randn(T, H, generator=gen))


def chain(logits, x, w, implementation, ids=None):
    """router -> dispatch -> grouped_mm -> combine; ``ids`` (with a dropped slot) replace the router's."""
    weights, router_ids = torch_kernels.router_topk(logits, K, implementation=implementation)
    rows, offsets, handle = torch_kernels.moe_dispatch(x, router_ids if ids is None else ids, E,
                                                       implementation=implementation)
    y = torch_kernels.grouped_mm(rows, w, offsets, implementation=implementation)
    return (weights, router_ids), (rows, offsets, handle), y, torch_kernels.moe_combine(y, handle, weights,
                                                                                         implementation=implementation)


def test_torchax_tensors_run_moe_with_gradients():
    require_backend("pallas")
    run_isolated(TORCHAX_CHECK)


TORCHAX_CHECK = """
import pytest, torch, torch_kernels
from harness import assert_close
from test_moe_torchax import E, K, chain, inputs

def error(fn):
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)

def grads(fn, tensors, d_out):
    leaves = [t.clone().detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(d_out)
    return out.detach(), [t.grad for t in leaves]

env = torch_kernels.torchax_environment()
logits, x, w, w13, w2, d_out = inputs()
weights, ids = torch_kernels.router_topk(logits, K, implementation="reference")
dropped = ids.clone()
dropped[1, -1] = -1
bias = torch.linspace(-0.1, 0.1, E)
grouped = torch_kernels.router_topk(logits, K, scoring="sigmoid", num_expert_groups=2, topk_groups=1,
                                    correction_bias=bias, routed_scaling_factor=2.5, implementation="reference")
want = chain(logits, x, w, "reference", dropped)
want_fused = grads(lambda *a: torch_kernels.fused_moe(*a, dropped, implementation="reference"), (x, w13, w2, weights),
                   d_out)
want_chain = grads(lambda *a: chain(*a, "reference")[-1], (logits, x, w), d_out[:, :8])
bad_ids = dropped.clone()
bad_ids[2, 0] = E
messages = [error(lambda: torch_kernels.fused_moe(x, w13, w2, weights, bad_ids)),
            error(lambda: torch_kernels.grouped_mm(want[1][0], w, want[1][1].flip(0)))]

to_jax = lambda *ts: [t.to("jax") for t in ts]  # noqa: E731
with env:
    jl, jx, jw, jw13, jw2, jd, jbias, jdropped, jweights = to_jax(logits, x, w, w13, w2, d_out, bias, dropped, weights)
    got = {}
    for impl in ("pallas", "reference"):
        (gw, gids), (rows, offsets, handle), y, out = chain(jl, jx, jw, impl, jdropped)
        assert type(out).__module__.startswith("torchax"), type(out)
        gg = torch_kernels.router_topk(jl, K, scoring="sigmoid", num_expert_groups=2, topk_groups=1,
                                       correction_bias=jbias, routed_scaling_factor=2.5, implementation=impl)
        fused = grads(lambda *a: torch_kernels.fused_moe(*a, jdropped, implementation=impl), (jx, jw13, jw2, jweights),
                      jd)
        unfused = grads(lambda *a: chain(*a, impl)[-1], (jl, jx, jw), jd[:, :8])
        cpu = lambda ts: [t.detach().to("cpu") for t in ts]  # noqa: E731
        got[impl] = (cpu((gw, gids)), cpu((rows, offsets, handle.token_of_row, handle.row_of_slot)), cpu((y, out)),
                     cpu(gg), cpu([fused[0], *fused[1]]), cpu([unfused[0], *unfused[1]]))
    # the dispatcher's own call, trailing defaults left out
    default_weights, default_ids = torch.ops.torch_kernels.router_topk(jl, K)
    assert torch.equal(default_ids.to("cpu"), ids)
    got_messages = [error(lambda: torch_kernels.fused_moe(jx, jw13, jw2, jweights, bad_ids.to("jax"))),
                    error(lambda: torch_kernels.grouped_mm(*to_jax(want[1][0], w, want[1][1].flip(0))))]
    with pytest.raises(NotImplementedError, match="torchax tensors run"):
        torch_kernels.fused_moe(jx, jw13, jw2, jweights, jdropped, implementation="triton")

assert got_messages == messages, (got_messages, messages)
(want_w, want_ids), (want_rows, want_offsets, want_handle), want_y, want_out = want
for impl, ((gw, gids), (rows, offsets, tok, ros), (y, out), gg, fused, unfused) in got.items():
    assert torch.equal(gids, want_ids) and torch.equal(gg[1], grouped[1]), impl
    assert_close(gw, want_w, torch.float32, what=f"{impl} router weights")
    assert_close(gg[0], grouped[0], torch.float32, what=f"{impl} grouped router weights")
    assert torch.equal(offsets, want_offsets), impl
    assert torch.equal(tok.long(), want_handle.token_of_row) and torch.equal(ros.long(), want_handle.row_of_slot), impl
    assert_close(rows, want_rows, torch.float32, what=f"{impl} dispatch")
    assert_close(y, want_y, torch.float32, what=f"{impl} grouped_mm")
    assert_close(out, want_out, torch.float32, what=f"{impl} combine")
    names = ("out", "d x", "d w13", "d w2", "d weights")
    for name, g, w_ in zip(names, fused, [want_fused[0], *want_fused[1]]):
        assert_close(g, w_, torch.float32, what=f"{impl} fused_moe {name}")
    for name, g, w_ in zip(("out", "d logits", "d x", "d w"), unfused, [want_chain[0], *want_chain[1]]):
        assert_close(g, w_, torch.float32, what=f"{impl} chain {name}")
print("torchax ok")
"""

"""Randomized differential test of the linear-attention ops: hypothesis draws unusual but valid
inputs and every backend must agree with the float64 recurrence on them.

Drawn together: T = 1, K = 1, very strong decay (g = -1e4, -inf), beta 0 and 1, empty packed
sequences, B = 0. Examples per backend: ``harness.fuzz_settings``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import torch_kernels
from harness import backend_params, fuzz_settings, require_backend
from torch_kernels.reference import linear_attention as linear_reference


LINEAR_OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_simple_gla")
BOUNDS = {"o": 5e-4, "final_state": 5e-4, "dq": 8e-4, "dk": 8e-4, "dv": 8e-4, "dh0": 8e-4, "dg": 2e-3, "dbeta": 2e-3}
LEAVES = ("q", "k", "v", "g", "beta", "initial_state")


@st.composite
def linear_cases(draw):
    op = draw(st.sampled_from(LINEAR_OPS))
    delta = op != "chunk_simple_gla"
    packed = draw(st.booleans())
    if packed:
        lens = draw(st.lists(st.integers(0, 70), min_size=1, max_size=3))
        batch, length = 1, sum(lens)
        cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    else:
        batch, length, cu = draw(st.integers(0, 2)), draw(st.sampled_from((1, 2, 17, 64, 65, 130))), None
    heads = draw(st.integers(1, 2))
    k_dim = draw(st.sampled_from((1, 16, 40)))
    return dict(op=op, batch=batch, length=length, cu_seqlens=cu, heads=heads,
                value_heads=heads * (draw(st.integers(1, 2)) if delta else 1),
                k_dim=k_dim, v_dim=draw(st.sampled_from((1, 16, 24))),
                decay=draw(st.sampled_from(("none", "weak", "strong", "spiky", "reset"))),
                beta=draw(st.sampled_from(("zero", "one", "random"))),
                # with K = 1 the l2 norm's gradient, eps / (q^2 + eps)^1.5, is a float32 cancellation
                l2norm=delta and k_dim > 1 and draw(st.booleans()),
                initial_state=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


def make_linear(case):
    gen = torch.Generator().manual_seed(case["seed"])
    b, t, h, hv, k_dim, v_dim = (case[n] for n in ("batch", "length", "heads", "value_heads", "k_dim", "v_dim"))
    q = torch.randn(b, t, h, k_dim, generator=gen)
    k = torch.randn(b, t, h, k_dim, generator=gen)
    if not case["l2norm"]:  # keys of norm at most 1 keep the recurrence bounded
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1.0)
    gate = (b, t, hv)
    g = {"none": lambda: torch.zeros(gate), "weak": lambda: -0.05 * torch.rand(gate, generator=gen),
         "strong": lambda: -8 * torch.rand(gate, generator=gen)}.get(case["decay"], lambda: torch.full(gate, -0.1))()
    if case["decay"] in ("spiky", "reset"):
        g[:, 4::7] = -1e4 if case["decay"] == "spiky" else -math.inf
    n = b if case["cu_seqlens"] is None else len(case["cu_seqlens"]) - 1
    x = dict(q=q, k=k, v=torch.randn(b, t, hv, v_dim, generator=gen), g=g, scale=max(k_dim, 1) ** -0.5,
             initial_state=torch.randn(n, hv, k_dim, v_dim, generator=gen) if case["initial_state"] else None,
             cu_seqlens=None if case["cu_seqlens"] is None else torch.tensor(case["cu_seqlens"], dtype=torch.int32))
    if case["op"] != "chunk_simple_gla":
        x["beta"] = {"zero": torch.zeros, "one": torch.ones}.get(
            case["beta"], lambda shape: torch.rand(shape, generator=gen))(gate)
        x["use_qk_l2norm_in_kernel"] = case["l2norm"]
    return x


def _relative_rmse(got, want, floor: float = 1e-12) -> float:
    got, want = got.detach().double(), want.detach().double()
    if want.numel() == 0:
        return 0.0
    return ((got - want).square().mean().sqrt() / want.square().mean().sqrt().clamp_min(floor)).item()


def _outputs_and_grads(op, x, backend=None):
    """(o, final state, gradients of a fixed loss) of the op, or of the float64 recurrence."""
    leaves = {n: x[n].detach().clone().double().requires_grad_() if backend is None
              else x[n].detach().clone().requires_grad_() for n in LEAVES if x.get(n) is not None}
    args = {**x, **leaves}
    if backend is None:
        o, ht = linear_reference.recurrence_naive(args["q"], args["k"], args["v"], args["g"], args.get("beta"),
                                                  x["scale"], args["initial_state"], x["cu_seqlens"],
                                                  x.get("use_qk_l2norm_in_kernel", False))
    else:
        o, ht = getattr(torch_kernels, op)(**args, output_final_state=True, implementation=backend)
    gen = torch.Generator().manual_seed(1)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    pairs = [(out, grad.to(out.dtype)) for out, grad in ((o, do), (ht, dht)) if out.requires_grad]
    grads = [None] * len(leaves)
    if pairs:
        grads = torch.autograd.grad([out for out, _ in pairs], list(leaves.values()), [grad for _, grad in pairs],
                                    allow_unused=True)
    # what no output depends on (empty sequences without a state) has a zero gradient
    return o, ht, {f"d{n}".replace("dinitial_state", "dh0"): torch.zeros_like(leaf) if g is None else g
                   for (n, leaf), g in zip(leaves.items(), grads)}


@pytest.mark.parametrize("backend", backend_params("chunk_gated_delta_rule"))
def test_linear_attention_fuzz(backend):
    """Outputs, final states and every gradient against the float64 recurrence, by relative RMSE
    within a tenth of the family's bounds; nothing non-finite where the truth is finite."""
    require_backend(backend)

    @fuzz_settings(backend)
    @given(case=linear_cases())
    def check(case):
        x = make_linear(case)
        got_o, got_ht, got = _outputs_and_grads(case["op"], x, backend)
        want_o, want_ht, want = _outputs_and_grads(case["op"], x)
        errors = {"o": _relative_rmse(got_o, want_o), "final_state": _relative_rmse(got_ht, want_ht)}
        # a gradient that is exactly zero in float64 (g = 0, beta = 1, K = 1) comes out as float32
        # rounding residue: measure it against a thousandth of the output's scale, not against zero
        floor = 1e-3 * want_o.detach().double().square().mean().sqrt().item() if want_o.numel() else 1e-12
        for name, g in want.items():
            errors[name] = _relative_rmse(got[name], g, max(floor, 1e-12))
        bad = {n: f"{e:.1e}" for n, e in errors.items() if not e <= BOUNDS[n]}
        assert not bad, f"relative RMSE over bounds: {bad}"

    check()

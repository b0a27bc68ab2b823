"""``fused_moe``: the experts block (gather, gate/up GEMM, activation, down GEMM, weighted
combine) as one op; its backward recomputes the forward through the unfused ops."""

from __future__ import annotations

import math

import torch

from ... import _checks, backends
from ..._library import define, register_cost, tensor_bytes
from ...reference import moe as reference
from ._common import FLOAT_DTYPES, FP8_DTYPES, backward_order, device_type, is_int, per_expert_bytes, sort_by_expert
from .dispatch import check_ids, check_ids_range, combine_backward, gather_backward, moe_gather_op, routed_ids
from .grouped_gemm import grouped_mm_op, grouped_mm_weight_grad_op

FUSED = "fused_moe"
backends.register(FUSED, "reference", reference.fused_moe)
backends.register(FUSED, "triton", "triton_impl.moe:fused_moe")
backends.register(FUSED, "pallas", "torch_kernels.pallas.moe:pallas_fused_moe")
backends.register(FUSED, "sycl", "oneapi_impl.moe:fused_moe")


@_checks.remembers_layouts
def _check_fused(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block_shape) -> None:
    _checks.tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    quantized = w13.dtype in FP8_DTYPES if isinstance(w13, torch.Tensor) else False
    _checks.tensor("w13", w13, ndim=3, dtypes=(x.dtype, *FP8_DTYPES))
    _checks.tensor("w2", w2, ndim=3, dtypes=(w13.dtype,))
    num_experts, two_i, hidden = w13.shape
    _checks.size("w13", 2, hidden, x.shape[1], "hidden size H of x")
    if two_i % 2 or two_i == 0:
        raise ValueError(f"w13: expected an even, non-zero size 2I in dimension 1 (gate and up), got {two_i}")
    expected_w2 = (num_experts, hidden, two_i // 2)
    if tuple(w2.shape) != expected_w2:
        raise ValueError(f"w2: expected shape {expected_w2} (E, H, I of w13), got {tuple(w2.shape)}")
    check_ids(topk_ids, num_experts, x.shape[0])
    _checks.tensor("topk_weights", topk_weights, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights: expected shape {tuple(topk_ids.shape)} (as topk_ids), got {tuple(topk_weights.shape)}")
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"activation: expected one of {reference.ACTIVATIONS}, got {activation!r}")
    if quantized:
        if w13_scale is None or w2_scale is None:
            raise ValueError("w13_scale, w2_scale: expected float32 scales for float8_e4m3fn weights, got None")
        if block_shape is not None:
            if len(block_shape) != 2 or not all(is_int(b) and b > 0 for b in block_shape):
                raise ValueError(f"block_shape: expected [block_n, block_k] of positive ints, got {block_shape!r}")
        for name, scale, (n, k) in (("w13_scale", w13_scale, (two_i, hidden)), ("w2_scale", w2_scale, (hidden, two_i // 2))):
            _checks.tensor(name, scale, dtypes=(torch.float32,))
            want = (num_experts, n) if block_shape is None else (
                num_experts, -(-n // block_shape[0]), -(-k // block_shape[1]))
            if tuple(scale.shape) != want:
                kind = "per output channel" if block_shape is None else f"per {list(block_shape)} block"
                raise ValueError(f"{name}: expected shape {want} ({kind}), got {tuple(scale.shape)}")
    elif w13_scale is not None or w2_scale is not None or block_shape is not None:
        raise ValueError("w13_scale, w2_scale, block_shape: expected None for unquantized weights "
                         f"(scales go with float8_e4m3fn weights), got weights of {w13.dtype}")
    _checks.same_device(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
                        **{n: t for n, t in (("w13_scale", w13_scale), ("w2_scale", w2_scale)) if t is not None})


def _fused_kernel(x, w13, w2, topk_weights, topk_ids, activation="silu", w13_scale=None, w2_scale=None,
                  block_shape=None, implementation=None):
    _check_fused(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block_shape)
    backend = backends.planned(FUSED, device_type(x), implementation)
    topk_ids = _checks.checked(x.device, check_ids_range, topk_ids, w13.shape[0], backend=backend)
    token_of_row, row_of_slot, offsets = sort_by_expert(topk_ids, w13.shape[0], backend)
    plain = lambda t: None if t is None else t.detach().contiguous()  # noqa: E731
    return backends.dispatch(
        FUSED, device_type(x), implementation, plain(x), plain(w13), plain(w2), topk_weights.detach().to(reference.compute_dtype(x.dtype)).contiguous(),
        token_of_row, row_of_slot, offsets.long(), activation, plain(w13_scale), plain(w2_scale),
        None if block_shape is None else tuple(block_shape))


def _fused_fake(x, w13, w2, topk_weights, topk_ids, activation="silu", w13_scale=None, w2_scale=None,
                block_shape=None, implementation=None):
    _check_fused(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block_shape)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fused_setup(ctx, inputs, output):
    x, w13, w2, topk_weights, topk_ids = inputs[:5]
    rest = tuple(inputs[5:]) + (None,) * (10 - len(inputs))
    activation, w13_scale = rest[0] or "silu", rest[1]
    if w13_scale is not None:
        ctx.quantized = True
        return
    ctx.quantized = False
    ctx.save_for_backward(x, w13, w2, topk_weights, topk_ids)
    ctx.activation = activation
    ctx.implementation = backward_order(x, rest[4])


def activation_backward(gate_up: torch.Tensor, d_h: torch.Tensor, activation: str) -> torch.Tensor:
    """``d gate_up`` from ``d h`` for ``h = activate(gate_up)`` (float32), written out so that it compiles."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        sig = torch.sigmoid(gate)
        act, d_act = gate * sig, sig * (1 + gate * (1 - sig))
        return torch.cat([d_h * up * d_act, d_h * act], dim=-1)
    if activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(gate * math.sqrt(0.5)))
        pdf = torch.exp(-0.5 * gate * gate) / math.sqrt(2 * math.pi)
        return torch.cat([d_h * up * (cdf + gate * pdf), d_h * gate * cdf], dim=-1)
    alpha, limit = reference.SWIGLUOAI_ALPHA, reference.SWIGLUOAI_LIMIT
    g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
    sig = torch.sigmoid(alpha * g)
    glu = g * sig
    d_g = d_h * (u + 1) * (sig + alpha * g * sig * (1 - sig)) * (gate <= limit)
    d_u = d_h * glu * ((up >= -limit) & (up <= limit))
    return torch.cat([d_g, d_u], dim=-1)


def _fused_backward(ctx, d_out):
    if ctx.quantized:
        raise RuntimeError("fused_moe: float8 weights are inference-only; call it under torch.no_grad()")
    x, w13, w2, topk_weights, topk_ids = ctx.saved_tensors
    impl = ctx.implementation
    # routed as the forward was: a bad id the deferred checks let through is dropped
    token_of_row, row_of_slot, offsets = reference.sort_by_expert(routed_ids(topk_ids, w13.shape[0]), w13.shape[0])
    # the forward recomputed through the unfused ops, then each op's backward, also ops
    acc = reference.compute_dtype(x.dtype)
    rows = moe_gather_op(x, token_of_row, row_of_slot, impl)
    gate_up = grouped_mm_op(rows, w13.transpose(1, 2), offsets, acc, impl)
    h = reference.activate(gate_up, ctx.activation).to(x.dtype)
    y = grouped_mm_op(h, w2.transpose(1, 2), offsets, acc, impl)
    d_y, d_weights = combine_backward(d_out, y, token_of_row, row_of_slot, topk_weights, impl, x.dtype)
    d_h = grouped_mm_op(d_y, w2, offsets, acc, impl)
    d_w2 = grouped_mm_weight_grad_op(d_y, h, offsets, w2.shape[0], w2.dtype, impl)
    d_gate_up = activation_backward(gate_up, d_h, ctx.activation).to(x.dtype)
    d_rows = grouped_mm_op(d_gate_up, w13, offsets, x.dtype, impl)
    d_w13 = grouped_mm_weight_grad_op(d_gate_up, rows, offsets, w13.shape[0], w13.dtype, impl)
    d_x = gather_backward(d_rows, token_of_row, row_of_slot, impl)
    return d_x, d_w13, d_w2, d_weights, None, None, None, None, None, None


fused_moe_op = define(
    "fused_moe(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, str activation=\"silu\", "
    "Tensor? w13_scale=None, Tensor? w2_scale=None, int[]? block_shape=None, str? implementation=None) -> Tensor",
    _fused_kernel, _fused_fake, setup_context=_fused_setup, backward=_fused_backward)


def fused_moe(x, w13, w2, topk_weights, topk_ids, activation="silu", w13_scale=None, w2_scale=None,
              block_shape=None, implementation=None):
    """The experts block in as few launches as the backend allows: for each token and each of its
    ``k`` experts ``e``, ``h = act(w13[e, :I] x) * (w13[e, I:] x)``, then ``w2[e] h`` weighted by
    the routing weight and summed over the token's experts (float32 accumulation).

    Args:
        x: ``[T, H]``, float16, bfloat16 or float32.
        w13: ``[E, 2I, H]`` gate (first half) and up projections (vLLM's ``w13``, transformers'
            ``gate_up_proj``), x's dtype or ``float8_e4m3fn``.
        w2: ``[E, H, I]`` down projection (``down_proj``), w13's dtype.
        topk_weights, topk_ids: ``[T, k]`` as :func:`router_topk` returns them; id -1 is dropped.
        activation: ``"silu"`` (SwiGLU), ``"gelu"`` (GeGLU, exact erf) or ``"swigluoai"``
            (gpt-oss: ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)``, ``g = min(gate, 7)``).
        w13_scale, w2_scale: float32 dequantization scales of float8 weights, per output channel
            (``[E, 2I]``, ``[E, H]``) or per ``block_shape = [bn, bk]`` block (``[E, ceil(2I/bn),
            ceil(H/bk)]``, ``[E, ceil(H/bn), ceil(I/bk)]``); a weight means ``entry * scale``.

    Returns:
        ``[T, H]`` in x's dtype; the intermediate ``h`` is rounded to x's dtype between the two
        GEMMs (as vLLM does). Equals ``moe_dispatch -> grouped_mm -> activation -> grouped_mm ->
        moe_combine``; differentiable in x, w13, w2 and topk_weights for unquantized weights.

    In the deferred check mode (``torch_kernels.checks``) an id that is neither -1 nor an expert
    is recorded, not raised, and dropped as -1 is: that choice adds nothing to its token's output.
    """
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids),
                    ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if t is not None or name in ("x", "w13", "w2", "topk_weights", "topk_ids"):
            _checks.tensor(name, t)
    if block_shape is not None and not (isinstance(block_shape, (list, tuple)) and all(is_int(b) for b in block_shape)):
        raise TypeError(f"block_shape: expected None or [block_n, block_k] ints, got {block_shape!r}")
    _check_fused(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block_shape)
    return fused_moe_op(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale,
                        None if block_shape is None else [int(b) for b in block_shape],
                        backends.implementation_arg(implementation))


def _fused_bytes(a, out) -> int:
    used = int(torch.unique(a.topk_ids[a.topk_ids >= 0]).numel())
    weights = sum(per_expert_bytes(t, used) for t in (a.w13, a.w2, a.w13_scale, a.w2_scale))
    return weights + tensor_bytes(a.x, a.topk_weights, a.topk_ids, out)


def _fused_flops(a, out) -> int:
    return fused_moe_flops(int((a.topk_ids >= 0).sum()), a.x.shape[1], a.w2.shape[2])


register_cost(fused_moe_op, flops=_fused_flops, bytes=_fused_bytes)


def fused_moe_flops(routed_rows: int, hidden: int, intermediate: int) -> int:
    """The two expert GEMMs over the routed rows: ``2 R H 2I + 2 R I H``."""
    return 6 * routed_rows * hidden * intermediate


def moe_inputs(gen, dtype, device, tokens=37, hidden=64, inter=48, experts=8, top_k=2):
    """Tokens, gate/up and down weights, and a softmax top-k routing of random router logits."""
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    scores = torch.randn(tokens, experts, generator=gen).softmax(dim=-1)
    weights, ids = scores.topk(top_k, dim=-1)
    return (x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype), weights.to(device),
            ids.to(device, torch.int32))


def fused_moe_definition(x, w13, w2, weights, ids):
    """The self-test's truth for :func:`fused_moe`: the naive definition in float64."""
    return reference.fused_moe_naive(x.double(), w13.double(), w2.double(), weights.double(), ids, "silu")

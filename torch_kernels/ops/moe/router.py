"""``router_topk``: each token's ``top_k`` experts and their weights from router logits."""

from __future__ import annotations

import math

import torch

from ... import _checks, backends
from ..._library import define, io_bytes, register_cost
from ...reference import moe as reference
from ._common import device_type, is_int, is_real

ROUTER = "router_topk"
backends.register(ROUTER, "reference", reference.router_topk)
backends.register(ROUTER, "triton", "triton_impl.moe:router_topk")
backends.register(ROUTER, "pallas", "torch_kernels.pallas.moe:pallas_router_topk")
backends.register(ROUTER, "sycl", "oneapi_impl.moe:router_topk")

SCORINGS = ("softmax", "sigmoid")


@_checks.remembers_layouts
def _check_router(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, correction_bias,
                  routed_scaling_factor) -> None:
    _checks.tensor("logits", logits, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    num_experts = logits.shape[1]
    if not is_int(top_k):
        raise TypeError(f"top_k: expected an int, got {type(top_k).__name__} {top_k!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected 1 <= top_k <= {num_experts} (experts in logits), got {top_k}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring: expected one of {SCORINGS}, got {scoring!r}")
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize: expected a bool, got {type(renormalize).__name__}")
    if (num_expert_groups is None) != (topk_groups is None):
        raise ValueError(f"num_expert_groups, topk_groups: expected both or neither, got {num_expert_groups!r} "
                         f"and {topk_groups!r}")
    if num_expert_groups is not None:
        for name, n in (("num_expert_groups", num_expert_groups), ("topk_groups", topk_groups)):
            if not is_int(n):
                raise TypeError(f"{name}: expected an int, got {type(n).__name__} {n!r}")
        if num_expert_groups < 1 or num_experts % num_expert_groups:
            raise ValueError(f"num_expert_groups: expected a divisor of the {num_experts} experts, got {num_expert_groups}")
        if not 1 <= topk_groups <= num_expert_groups:
            raise ValueError(f"topk_groups: expected 1 <= topk_groups <= num_expert_groups ({num_expert_groups}), "
                             f"got {topk_groups}")
        if top_k > topk_groups * (num_experts // num_expert_groups):
            raise ValueError(f"top_k: expected at most the {topk_groups * (num_experts // num_expert_groups)} experts "
                             f"of the topk_groups kept groups, got {top_k}")
    if correction_bias is not None:
        _checks.tensor("correction_bias", correction_bias, ndim=1, dtypes=_checks.FLOAT_DTYPES)
        _checks.size("correction_bias", 0, correction_bias.shape[0], num_experts, "experts E of logits")
        _checks.same_device(logits=logits, correction_bias=correction_bias)
    if not is_real(routed_scaling_factor):
        raise TypeError(f"routed_scaling_factor: expected a float, got {type(routed_scaling_factor).__name__}")
    if not math.isfinite(routed_scaling_factor):
        raise ValueError(f"routed_scaling_factor: expected a finite number, got {routed_scaling_factor!r}")


def _router_kernel(logits, top_k, scoring="softmax", renormalize=True, num_expert_groups=None, topk_groups=None,
                   correction_bias=None, routed_scaling_factor=1.0, implementation=None):
    _check_router(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, correction_bias,
                  routed_scaling_factor)
    weights, ids = backends.dispatch(
        ROUTER, device_type(logits), implementation, logits.detach().contiguous(), top_k, scoring, renormalize,
        num_expert_groups, topk_groups, None if correction_bias is None else correction_bias.detach().contiguous(),
        float(routed_scaling_factor))
    return weights.to(reference.compute_dtype(logits.dtype)), ids.to(torch.int32)


def _router_fake(logits, top_k, scoring="softmax", renormalize=True, num_expert_groups=None, topk_groups=None,
                 correction_bias=None, routed_scaling_factor=1.0, implementation=None):
    _check_router(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, correction_bias,
                  routed_scaling_factor)
    return (logits.new_empty(logits.shape[0], top_k, dtype=reference.compute_dtype(logits.dtype)),
            logits.new_empty(logits.shape[0], top_k, dtype=torch.int32))


_ROUTER_DEFAULTS = ("softmax", True, None, None, None, 1.0, None)  # the schema's, from scoring on


def _router_setup(ctx, inputs, output):
    logits, _, scoring, renormalize, _, _, _, scale, _ = tuple(inputs) + _ROUTER_DEFAULTS[len(inputs) - 2:]
    ctx.save_for_backward(logits, output[1])
    ctx.scoring, ctx.renormalize, ctx.scale = scoring, renormalize, scale


def _router_backward(ctx, d_weights, d_ids):
    logits, ids = ctx.saved_tensors
    # the weights' vector-Jacobian product written out (autograd.grad would not compile)
    acc = logits.to(reference.compute_dtype(logits.dtype))
    scores = acc.softmax(dim=-1) if ctx.scoring == "softmax" else acc.sigmoid()
    picked = scores.gather(1, ids.long())
    d_picked = d_weights.to(acc.dtype) * ctx.scale
    if ctx.renormalize:
        total = picked.sum(dim=-1, keepdim=True)
        d_picked = (d_picked - (d_picked * picked).sum(dim=-1, keepdim=True) / total) / total
    d_scores = torch.zeros_like(scores).scatter_add_(1, ids.long(), d_picked)
    if ctx.scoring == "softmax":
        d_logits = scores * (d_scores - (d_scores * scores).sum(dim=-1, keepdim=True))
    else:
        d_logits = d_scores * scores * (1 - scores)
    return (d_logits.to(logits.dtype),) + (None,) * 8


router_topk_op = define(
    "router_topk(Tensor logits, int top_k, str scoring=\"softmax\", bool renormalize=True, "
    "int? num_expert_groups=None, int? topk_groups=None, Tensor? correction_bias=None, "
    "float routed_scaling_factor=1.0, str? implementation=None) -> (Tensor, Tensor)",
    _router_kernel, _router_fake, setup_context=_router_setup, backward=_router_backward)


def router_topk(logits, top_k, *, scoring="softmax", renormalize=True, num_expert_groups=None, topk_groups=None,
                correction_bias=None, routed_scaling_factor=1.0, implementation=None):
    """Choose ``top_k`` experts per token from router ``logits [T, E]``.

    ``scoring="softmax"`` (Mixtral, Qwen-MoE): softmax over all experts, the ``top_k`` largest,
    divided by their sum when ``renormalize``. ``scoring="sigmoid"`` with ``num_expert_groups``,
    ``topk_groups`` and ``correction_bias`` (DeepSeek-V3): sigmoid scores; the experts are chosen
    by ``score + correction_bias`` among the ``topk_groups`` groups whose two best biased scores
    sum highest, and weighted by their unbiased scores. Weights are then multiplied by
    ``routed_scaling_factor``.

    The choice, the same on every backend: without ``correction_bias`` experts are ranked by their
    logits (softmax and sigmoid keep their order, and probabilities that underflowed or rounded
    alike would tie), with it by ``score + correction_bias`` in float32; groups by the sum of
    their two best float32 ``score (+ correction_bias)``. Among equal values the lowest index
    comes first (not ``torch.topk``'s unspecified order), and NaN ranks as -inf, so the ids are
    always ``top_k`` distinct experts. A row with a NaN logit gets NaN weights (under either
    scoring); a softmax row with an infinite logit, or all -inf, gets NaN weights as softmax does.

    Returns:
        ``(topk_weights float32 [T, k] (float64 for float64 logits), topk_ids int32 [T, k])``.
        Differentiable in ``logits``
        (``correction_bias`` only steers the choice and gets no gradient).
    """
    _checks.tensor("logits", logits)
    if correction_bias is not None:
        _checks.tensor("correction_bias", correction_bias)
    _check_router(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, correction_bias,
                  routed_scaling_factor)
    return router_topk_op(logits, int(top_k), scoring, renormalize, num_expert_groups, topk_groups,
                          correction_bias, float(routed_scaling_factor), backends.implementation_arg(implementation))


# routing is elementwise and selection work only, which FLOP counts leave out
register_cost(router_topk_op, flops=lambda a, out: 0, bytes=io_bytes)


def router_inputs(gen, dtype, device, tokens=37, experts=8):
    """Router logits ``[T, E]`` and a correction bias (for the grouped sigmoid router)."""
    logits = torch.randn(tokens, experts, generator=gen)
    bias = 0.1 * torch.randn(experts, generator=gen)
    return logits.to(device, dtype), bias.to(device, torch.float32)

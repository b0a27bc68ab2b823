"""Mixture-of-experts ops: ``router_topk``, ``moe_dispatch``, ``grouped_mm``, ``moe_combine`` and
``fused_moe``.

Layouts are what users hold: tokens ``[T, H]``; expert weights ``[E, K, N]`` for ``grouped_mm``
(``torch.nn.functional.grouped_mm``'s contract, with cumulative int32 row ``offsets``), and vLLM's
``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` for ``fused_moe`` (transformers' ``gate_up_proj`` and
``down_proj``). Routing metadata (which token each sorted row comes from, which row each of a
token's choices went to) is computed once on the device by ``reference.sort_by_expert``, with no
host sync, and carried from dispatch to combine by a :class:`MoEHandle`.

Ops with a backend kernel (``torch.ops.torch_kernels.*``): ``router_topk``, ``moe_gather``,
``moe_combine``, ``grouped_mm``, ``grouped_mm_weight_grad`` and ``fused_moe``. Their backwards are
compositions of these ops (the backward of a gather is a combine and the reverse; a grouped GEMM's
are a grouped GEMM and a weight-gradient GEMM), so training runs on the chosen backend and
compiles without graph breaks.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from .. import _checks, backends
from .._library import define, io_bytes, register_cost, tensor_bytes
from ..reference import moe as reference

ROUTER, GATHER, COMBINE, GROUPED_MM, WEIGHT_GRAD, FUSED = (
    "router_topk", "moe_gather", "moe_combine", "grouped_mm", "grouped_mm_weight_grad", "fused_moe")
KERNELS = (ROUTER, GATHER, COMBINE, GROUPED_MM, WEIGHT_GRAD, FUSED)
for _op in KERNELS:
    backends.register(_op, "reference", getattr(reference, _op))
    backends.register(_op, "triton", f"triton_impl.moe:{_op}")
    backends.register(_op, "pallas", f"torch_kernels._jax_interop:pallas_{_op}")
    backends.register(_op, "sycl", f"oneapi_impl.moe:{_op}")

FLOAT_DTYPES = _checks.FLOAT_DTYPES  # backends decline float64; the reference takes it (gradcheck)
FP8_DTYPES = (torch.float8_e4m3fn,)
SCORINGS = ("softmax", "sigmoid")


def _device_type(t: torch.Tensor) -> str:
    return "cpu" if t.is_cpu else t.device.type


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _raise_first(tests) -> None:
    """``tests``: ``(flag tensor, message function)`` pairs, read with one host sync."""
    if not tests:
        return
    flags = torch.stack([flag for flag, _ in tests]).tolist()
    for failed, (_, message) in zip(flags, tests):
        if failed:
            raise ValueError(message())


# ---- router_topk ----

def _check_router(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, correction_bias,
                  routed_scaling_factor) -> None:
    _checks.tensor("logits", logits, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    num_experts = logits.shape[1]
    if not _is_int(top_k):
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
            if not _is_int(n):
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
    if not _is_real(routed_scaling_factor):
        raise TypeError(f"routed_scaling_factor: expected a float, got {type(routed_scaling_factor).__name__}")
    if not math.isfinite(routed_scaling_factor):
        raise ValueError(f"routed_scaling_factor: expected a finite number, got {routed_scaling_factor!r}")


def _router_kernel(logits, top_k, scoring="softmax", renormalize=True, num_expert_groups=None, topk_groups=None,
                   correction_bias=None, routed_scaling_factor=1.0, implementation=None):
    _check_router(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, correction_bias,
                  routed_scaling_factor)
    weights, ids = backends.dispatch(
        ROUTER, _device_type(logits), implementation, logits.detach().contiguous(), top_k, scoring, renormalize,
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


# ---- dispatch and combine ----

@dataclasses.dataclass(frozen=True)
class MoEHandle:
    """What :func:`moe_combine` needs from :func:`moe_dispatch`: the token of each sorted row
    (``-1`` past the routed rows) and the row of each of a token's ``k`` choices (``-1`` if dropped)."""

    token_of_row: torch.Tensor  # int64 [T * k]
    row_of_slot: torch.Tensor  # int64 [T, k]
    num_experts: int

    @property
    def num_tokens(self) -> int:
        return self.row_of_slot.shape[0]

    @property
    def top_k(self) -> int:
        return self.row_of_slot.shape[1]


def _check_routing_map(token_of_row, row_of_slot, rows: int) -> None:
    _checks.tensor("token_of_row", token_of_row, ndim=1, dtypes=(torch.int64,))
    _checks.tensor("row_of_slot", row_of_slot, ndim=2, dtypes=(torch.int64,))
    if token_of_row.shape[0] != rows or row_of_slot.numel() != rows:
        raise ValueError(f"handle: expected {rows} rows (T * k), got token_of_row {tuple(token_of_row.shape)} "
                         f"and row_of_slot {tuple(row_of_slot.shape)}")


def _gather_kernel(x, token_of_row, row_of_slot, implementation=None):
    _check_routing_map(token_of_row, row_of_slot, token_of_row.shape[0])
    return backends.dispatch(GATHER, _device_type(x), implementation, x.contiguous(), token_of_row.contiguous())


def _gather_fake(x, token_of_row, row_of_slot, implementation=None):
    return x.new_empty(token_of_row.shape[0], x.shape[1])


def _gather_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])
    ctx.implementation = _backward_order(inputs[0], inputs[3] if len(inputs) > 3 else None)


def gather_backward(d_rows, token_of_row, row_of_slot, implementation):
    """d x of a gather: each token's rows summed back, a combine with unit weights."""
    ones = torch.ones(row_of_slot.shape, dtype=reference.compute_dtype(d_rows.dtype), device=d_rows.device)
    return moe_combine_op(d_rows, token_of_row, row_of_slot, ones, implementation)


def _gather_backward(ctx, d_rows):
    token_of_row, row_of_slot = ctx.saved_tensors
    return gather_backward(d_rows, token_of_row, row_of_slot, ctx.implementation), None, None, None


moe_gather_op = define(
    "moe_gather(Tensor x, Tensor token_of_row, Tensor row_of_slot, str? implementation=None) -> Tensor",
    _gather_kernel, _gather_fake, setup_context=_gather_setup, backward=_gather_backward)


def _backward_order(t: torch.Tensor, implementation) -> str | None:
    """The backends a backward should try: those chosen at forward time (as linear attention does)."""
    order, explicit = backends.resolve(_device_type(t), implementation)
    return ",".join(order) if explicit else None


def _combine_kernel(y, token_of_row, row_of_slot, topk_weights, implementation=None):
    _check_routing_map(token_of_row, row_of_slot, y.shape[0])
    return backends.dispatch(COMBINE, _device_type(y), implementation, y.contiguous(), row_of_slot.contiguous(),
                             topk_weights.to(reference.compute_dtype(y.dtype)).contiguous(), y.dtype)


def _combine_fake(y, token_of_row, row_of_slot, topk_weights, implementation=None):
    return y.new_empty(row_of_slot.shape[0], y.shape[1])


def _combine_setup(ctx, inputs, output):
    y, token_of_row, row_of_slot, topk_weights = inputs[:4]
    ctx.save_for_backward(y, token_of_row, row_of_slot, topk_weights)
    ctx.implementation = _backward_order(y, inputs[4] if len(inputs) > 4 else None)


def combine_backward(d_out, y, token_of_row, row_of_slot, topk_weights, implementation, d_y_dtype,
                     need_y=True, need_weights=True):
    """(d y, d topk_weights) of a combine: each row gets its token's gradient times the row's
    routing weight (a gather, i.e. a dispatch), and d weight = <d out, y row>; None where not needed."""
    used = row_of_slot >= 0
    acc = reference.compute_dtype(y.dtype)
    d_y = d_weights = None
    if need_y:
        weight_of_row = torch.zeros(y.shape[0], dtype=acc, device=y.device).index_put_(
            (row_of_slot.clamp(min=0).reshape(-1),), torch.where(used, topk_weights.to(acc), 0).reshape(-1),
            accumulate=True)
        d_y = (moe_gather_op(d_out, token_of_row, row_of_slot, implementation).to(acc)
               * weight_of_row[:, None]).to(d_y_dtype)
    if need_weights:
        rows = y.index_select(0, row_of_slot.clamp(min=0).reshape(-1)).view(*row_of_slot.shape, y.shape[1])
        d_weights = torch.where(used, (rows.to(acc) * d_out.to(acc)[:, None, :]).sum(dim=-1), 0).to(topk_weights.dtype)
    return d_y, d_weights


def _combine_backward(ctx, d_out):
    y, token_of_row, row_of_slot, topk_weights = ctx.saved_tensors
    d_y, d_weights = combine_backward(d_out, y, token_of_row, row_of_slot, topk_weights, ctx.implementation,
                                      y.dtype, ctx.needs_input_grad[0], ctx.needs_input_grad[3])
    return d_y, None, None, d_weights, None


moe_combine_op = define(
    "moe_combine(Tensor y, Tensor token_of_row, Tensor row_of_slot, Tensor topk_weights, str? implementation=None) "
    "-> Tensor",
    _combine_kernel, _combine_fake, setup_context=_combine_setup, backward=_combine_backward)


def _check_ids(topk_ids, num_experts, num_tokens: int | None = None) -> None:
    _checks.tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    if num_tokens is not None:
        _checks.size("topk_ids", 0, topk_ids.shape[0], num_tokens, "tokens T of x")
    if topk_ids.shape[1] == 0:
        raise ValueError(f"topk_ids: expected at least one expert per token, got shape {tuple(topk_ids.shape)}")


def check_ids_range(topk_ids, num_experts: int) -> None:
    """Every id is -1 (dropped) or an expert (one host sync)."""
    bad = (topk_ids < -1) | (topk_ids >= num_experts)
    _raise_first([(bad.any(), lambda: f"topk_ids: expected expert ids in [0, {num_experts}) or -1 (dropped), "
                                      f"got {int(topk_ids[bad][0])} at {tuple(bad.nonzero()[0].tolist())}")])


def moe_dispatch(x, topk_ids, num_experts, implementation=None, *, group=None, max_tokens_per_rank=None,
                 dispatch_dtype=None):
    """Copies of each token's row, one per chosen expert, sorted by expert.

    With a ``torch.distributed`` ``group``, the experts are split contiguously over its ranks and
    each copy goes to the rank holding its expert: see
    :func:`torch_kernels.distributed.moe_dispatch` (which also takes ``max_tokens_per_rank`` for
    fixed-capacity buffers and ``dispatch_dtype=torch.float8_e4m3fn``); the result has the same
    shape of ``(rows, offsets, handle)`` with this rank's experts only.

    Args:
        x: ``[T, H]`` tokens, float16, bfloat16 or float32.
        topk_ids: ``[T, k]`` int32 or int64 expert ids (``router_topk``'s); -1 is a dropped slot,
            routed nowhere.
        num_experts: ``E``.

    Returns:
        ``(x_sorted [T * k, H], offsets int32 [E], handle)``: expert ``e``'s rows are
        ``offsets[e-1]:offsets[e]`` (tokens in order), rows past ``offsets[-1]`` (dropped slots)
        are zero; ``offsets`` is what :func:`grouped_mm` and ``torch.nn.functional.grouped_mm``
        take; the :class:`MoEHandle` is what :func:`moe_combine` needs. Differentiable in ``x``
        (its backward is a combine).
    """
    if group is not None:
        from ..distributed import exchange

        return exchange.moe_dispatch(x, topk_ids, num_experts, group, max_tokens_per_rank=max_tokens_per_rank,
                                     dispatch_dtype=dispatch_dtype, implementation=implementation)
    if max_tokens_per_rank is not None or dispatch_dtype is not None:
        raise ValueError("max_tokens_per_rank, dispatch_dtype: expected None without a group (they size and "
                         f"encode the exchange between ranks), got {max_tokens_per_rank!r} and {dispatch_dtype!r}")
    _checks.tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if not _is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts: expected an int >= 1, got {num_experts!r}")
    _check_ids(topk_ids, num_experts, x.shape[0])
    _checks.same_device(x=x, topk_ids=topk_ids)
    if not torch.compiler.is_compiling():
        check_ids_range(topk_ids, num_experts)
    token_of_row, row_of_slot, offsets = reference.sort_by_expert(topk_ids, num_experts)
    x_sorted = moe_gather_op(x, token_of_row, row_of_slot, backends.implementation_arg(implementation))
    return x_sorted, offsets, MoEHandle(token_of_row, row_of_slot, int(num_experts))


def moe_combine(y, handle, topk_weights, implementation=None):
    """Each token's expert outputs, weighted and summed: ``out[t] = sum_j topk_weights[t, j] *
    y[row of (t, j)]``, accumulated in float32 in the order of ``j`` (deterministic, no atomics);
    dropped slots are not read.

    Args:
        y: ``[T * k, N]`` expert outputs in the order :func:`moe_dispatch` returned the rows.
        handle: the :class:`MoEHandle` of that dispatch (or the ``EPHandle`` of a dispatch with a
            group: the outputs then return to the ranks the tokens came from and are reduced
            there, see :func:`torch_kernels.distributed.moe_combine`).
        topk_weights: ``[T, k]`` routing weights (any float dtype; used in float32).

    Returns:
        ``[T, N]`` in ``y``'s dtype; differentiable in ``y`` (a dispatch) and ``topk_weights``.
    """
    if not isinstance(handle, MoEHandle):  # the single-device path never imports torch.distributed
        from ..distributed import exchange

        if isinstance(handle, exchange.EPHandle):
            return exchange.moe_combine(y, handle, topk_weights)
        raise TypeError(f"handle: expected the MoEHandle that moe_dispatch returned, got {type(handle).__name__}")
    _checks.tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES)
    _checks.tensor("topk_weights", topk_weights, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    _checks.size("y", 0, y.shape[0], handle.token_of_row.shape[0], "rows T * k of the dispatch")
    if tuple(topk_weights.shape) != tuple(handle.row_of_slot.shape):
        raise ValueError(f"topk_weights: expected shape {tuple(handle.row_of_slot.shape)} (T, k of the dispatch), "
                         f"got {tuple(topk_weights.shape)}")
    _checks.same_device(y=y, topk_weights=topk_weights, handle=handle.row_of_slot)
    return moe_combine_op(y, handle.token_of_row, handle.row_of_slot, topk_weights,
                          backends.implementation_arg(implementation))


# ---- grouped_mm ----

def _check_grouped(x, w, offsets, out_dtype) -> None:
    _checks.tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    _checks.tensor("w", w, ndim=3, dtypes=(x.dtype,))
    _checks.size("w", 1, w.shape[1], x.shape[1], "K of x")
    _checks.tensor("offsets", offsets, ndim=1, dtypes=(torch.int32,))
    _checks.size("offsets", 0, offsets.shape[0], w.shape[0], "experts E of w")
    if w.shape[0] == 0 and x.shape[0]:
        raise ValueError(f"w: expected at least one expert for the {x.shape[0]} rows of x (offsets assign rows to "
                         f"experts), got shape {tuple(w.shape)}")
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype: expected None or a float dtype, got {out_dtype}")
    _checks.same_device(x=x, w=w, offsets=offsets)


def check_offsets(offsets, rows: int) -> None:
    """Offsets never decrease and stay within the rows (one host sync)."""
    if offsets.numel() == 0:
        return
    decreasing = offsets[1:] < offsets[:-1]
    _raise_first([
        (offsets[0] < 0, lambda: f"offsets: expected cumulative row ends >= 0, got {int(offsets[0])} first"),
        (decreasing.any(), lambda: f"offsets: expected non-decreasing cumulative row ends, got "
                                   f"{int(offsets[1:][decreasing][0])} after {int(offsets[:-1][decreasing][0])}"),
        (offsets[-1] > rows, lambda: f"offsets: expected to end at most at the {rows} rows of x, got {int(offsets[-1])}"),
    ])


def _weight_layout(w):
    """``(tensor, transposed)``: ``w`` itself if contiguous ``[E, K, N]``, its ``[E, N, K]`` base if it
    is that transposed (as ``w13.transpose(1, 2)``), else a contiguous copy."""
    if w.is_contiguous():
        return w, False
    if w.transpose(1, 2).is_contiguous():
        return w.transpose(1, 2), True
    return w.contiguous(), False


def _grouped_kernel(x, w, offsets, out_dtype=None, implementation=None):
    _check_grouped(x, w, offsets, out_dtype)
    check_offsets(offsets, x.shape[0])
    if not x.shape[1] or not w.shape[2]:  # nothing to multiply: the same zeros on every backend
        return x.new_zeros(x.shape[0], w.shape[2], dtype=out_dtype or x.dtype)
    tensor, transposed = _weight_layout(w)
    return backends.dispatch(GROUPED_MM, _device_type(x), implementation, x.contiguous(), tensor,
                             offsets.long().contiguous(), out_dtype or x.dtype, transposed)


def _grouped_fake(x, w, offsets, out_dtype=None, implementation=None):
    _check_grouped(x, w, offsets, out_dtype)
    return x.new_empty(x.shape[0], w.shape[2], dtype=out_dtype or x.dtype)


def _grouped_setup(ctx, inputs, output):
    x, w, offsets = inputs[:3]
    ctx.save_for_backward(x, w, offsets)
    ctx.implementation = _backward_order(x, inputs[4] if len(inputs) > 4 else None)


def _grouped_backward(ctx, d_out):
    x, w, offsets = ctx.saved_tensors
    d_out = d_out.to(x.dtype)
    d_x = d_w = None
    if ctx.needs_input_grad[0]:
        d_x = grouped_mm_op(d_out, w.transpose(1, 2), offsets, x.dtype, ctx.implementation)
    if ctx.needs_input_grad[1]:
        d_w = grouped_mm_weight_grad_op(x, d_out, offsets, w.shape[0], w.dtype, ctx.implementation)
    return d_x, d_w, None, None, None


def _weight_grad_kernel(x, dy, offsets, num_experts, out_dtype, implementation=None):
    if not (x.shape[1] and dy.shape[1] and num_experts):  # an empty gradient (grouped_mm with K, N or E 0)
        return x.new_zeros(num_experts, x.shape[1], dy.shape[1], dtype=out_dtype)
    return backends.dispatch(WEIGHT_GRAD, _device_type(x), implementation, x.contiguous(), dy.contiguous(),
                             offsets.long().contiguous(), num_experts, out_dtype)


def _weight_grad_fake(x, dy, offsets, num_experts, out_dtype, implementation=None):
    return x.new_empty(num_experts, x.shape[1], dy.shape[1], dtype=out_dtype)


grouped_mm_weight_grad_op = define(
    "grouped_mm_weight_grad(Tensor x, Tensor dy, Tensor offsets, int num_experts, ScalarType out_dtype, "
    "str? implementation=None) -> Tensor",
    _weight_grad_kernel, _weight_grad_fake)

grouped_mm_op = define(
    "grouped_mm(Tensor x, Tensor w, Tensor offsets, ScalarType? out_dtype=None, str? implementation=None) -> Tensor",
    _grouped_kernel, _grouped_fake, setup_context=_grouped_setup, backward=_grouped_backward)


def grouped_mm(x, w, offsets, out_dtype=None, implementation=None):
    """``torch.nn.functional.grouped_mm``'s contract: rows ``offsets[e-1]:offsets[e]`` of ``x``
    times expert ``e``'s matrix ``w[e]``.

    Args:
        x: ``[M, K]``, float16, bfloat16 or float32.
        w: ``[E, K, N]`` of x's dtype, any strides; a transposed view of ``[E, N, K]`` weights
            (``w13.transpose(1, 2)``) is read as it lies, without a copy.
        offsets: int32 ``[E]`` cumulative row ends, non-decreasing, at most ``M``.
        out_dtype: the result's dtype (default x's); accumulation is float32.

    Returns:
        ``[M, N]``; rows past ``offsets[-1]`` are zero. Differentiable in ``x``
        (``grouped_mm(dy, w^T)``) and ``w`` (``x_e^T dy_e`` per expert).
    """
    _checks.tensor("x", x)
    _checks.tensor("w", w)
    _checks.tensor("offsets", offsets)
    _check_grouped(x, w, offsets, out_dtype)
    return grouped_mm_op(x, w, offsets, out_dtype, backends.implementation_arg(implementation))


# ---- fused_moe ----

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
    _check_ids(topk_ids, num_experts, x.shape[0])
    _checks.tensor("topk_weights", topk_weights, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_weights: expected shape {tuple(topk_ids.shape)} (as topk_ids), got {tuple(topk_weights.shape)}")
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"activation: expected one of {reference.ACTIVATIONS}, got {activation!r}")
    if quantized:
        if w13_scale is None or w2_scale is None:
            raise ValueError("w13_scale, w2_scale: expected float32 scales for float8_e4m3fn weights, got None")
        if block_shape is not None:
            if len(block_shape) != 2 or not all(_is_int(b) and b > 0 for b in block_shape):
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
    check_ids_range(topk_ids, w13.shape[0])
    token_of_row, row_of_slot, offsets = reference.sort_by_expert(topk_ids, w13.shape[0])
    plain = lambda t: None if t is None else t.detach().contiguous()  # noqa: E731
    return backends.dispatch(
        FUSED, _device_type(x), implementation, plain(x), plain(w13), plain(w2), topk_weights.detach().to(reference.compute_dtype(x.dtype)).contiguous(),
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
    ctx.implementation = _backward_order(x, rest[4])


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
    token_of_row, row_of_slot, offsets = reference.sort_by_expert(topk_ids, w13.shape[0])
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
    """
    for name, t in (("x", x), ("w13", w13), ("w2", w2), ("topk_weights", topk_weights), ("topk_ids", topk_ids),
                    ("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if t is not None or name in ("x", "w13", "w2", "topk_weights", "topk_ids"):
            _checks.tensor(name, t)
    if block_shape is not None and not (isinstance(block_shape, (list, tuple)) and all(_is_int(b) for b in block_shape)):
        raise TypeError(f"block_shape: expected None or [block_n, block_k] ints, got {block_shape!r}")
    _check_fused(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block_shape)
    return fused_moe_op(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale,
                        None if block_shape is None else [int(b) for b in block_shape],
                        backends.implementation_arg(implementation))


# ---- FLOP and byte formulas ----

def _grouped_rows(offsets) -> int:
    return int(offsets[-1]) if offsets.numel() else 0


def _experts_used(offsets) -> int:
    """Experts with at least one row: only their weights need reading."""
    return int((torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0).sum())


def _per_expert_bytes(t, used: int) -> int:
    """The bytes of ``used`` of the experts of ``t`` (``[E, ...]``, or None)."""
    return 0 if t is None else tensor_bytes(t) // t.shape[0] * used


def _grouped_bytes(a, out) -> int:
    rows = _grouped_rows(a.offsets)
    return (rows * a.x.shape[1] * a.x.element_size() + _per_expert_bytes(a.w, _experts_used(a.offsets))
            + tensor_bytes(a.offsets, out))


def _weight_grad_bytes(a, out) -> int:
    rows = _grouped_rows(a.offsets)
    return (rows * (a.x.shape[1] * a.x.element_size() + a.dy.shape[1] * a.dy.element_size())
            + tensor_bytes(a.offsets, out))


def _gather_bytes(a, out) -> int:
    # each routed token read once (rows past the routed ones are written as zeros), every row written
    tokens = int((a.row_of_slot >= 0).any(dim=1).sum())
    return tokens * a.x.shape[1] * a.x.element_size() + tensor_bytes(a.token_of_row, out)


def _combine_bytes(a, out) -> int:
    rows = int((a.row_of_slot >= 0).sum())  # dropped slots are not read
    return rows * a.y.shape[1] * a.y.element_size() + tensor_bytes(a.row_of_slot, a.topk_weights, out)


def _fused_bytes(a, out) -> int:
    used = int(torch.unique(a.topk_ids[a.topk_ids >= 0]).numel())
    weights = sum(_per_expert_bytes(t, used) for t in (a.w13, a.w2, a.w13_scale, a.w2_scale))
    return weights + tensor_bytes(a.x, a.topk_weights, a.topk_ids, out)


def _fused_flops(a, out) -> int:
    return fused_moe_flops(int((a.topk_ids >= 0).sum()), a.x.shape[1], a.w2.shape[2])


# routing and moving rows: elementwise and selection work only, which FLOP counts leave out
register_cost(router_topk_op, flops=lambda a, out: 0, bytes=io_bytes)
register_cost(moe_gather_op, flops=lambda a, out: 0, bytes=_gather_bytes)
register_cost(moe_combine_op, bytes=_combine_bytes,
              flops=lambda a, out: 2 * int((a.row_of_slot >= 0).sum()) * a.y.shape[1])
register_cost(grouped_mm_op, bytes=_grouped_bytes,
              flops=lambda a, out: 2 * _grouped_rows(a.offsets) * a.x.shape[1] * a.w.shape[2])
register_cost(grouped_mm_weight_grad_op, bytes=_weight_grad_bytes,
              flops=lambda a, out: 2 * _grouped_rows(a.offsets) * a.x.shape[1] * a.dy.shape[1])
register_cost(fused_moe_op, flops=_fused_flops, bytes=_fused_bytes)


def fused_moe_flops(routed_rows: int, hidden: int, intermediate: int) -> int:
    """The two expert GEMMs over the routed rows: ``2 R H 2I + 2 R I H``."""
    return 6 * routed_rows * hidden * intermediate

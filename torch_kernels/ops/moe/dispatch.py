"""``moe_dispatch`` and ``moe_combine``: token copies sorted by expert, and back.

``moe_dispatch`` computes the routing maps (``_common.sort_by_expert``) and runs the op
``moe_gather`` (``torch.ops.torch_kernels.moe_gather``), which copies the rows; ``moe_combine``
runs the op of the same name. The backward of a gather is a combine with unit weights, and that
of a combine is a gather. With a ``torch.distributed`` group, both go to the :class:`GroupPath`
that :mod:`torch_kernels.distributed` registers (this module never imports it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch

from ... import _checks, backends
from ..._library import define, register_cost, tensor_bytes
from ...reference import moe as reference
from ._common import FLOAT_DTYPES, backward_order, device_type, is_int, sort_by_expert

GATHER, COMBINE = "moe_gather", "moe_combine"
backends.register(GATHER, "reference", reference.moe_gather)
backends.register(GATHER, "triton", "triton_impl.moe:moe_gather")
backends.register(GATHER, "pallas", "torch_kernels.pallas.moe:pallas_moe_gather")
backends.register(GATHER, "sycl", "oneapi_impl.moe:moe_gather")
backends.register(COMBINE, "reference", reference.moe_combine)
backends.register(COMBINE, "triton", "triton_impl.moe:moe_combine")
backends.register(COMBINE, "pallas", "torch_kernels.pallas.moe:pallas_moe_combine")
backends.register(COMBINE, "sycl", "oneapi_impl.moe:moe_combine")


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
    return backends.dispatch(GATHER, device_type(x), implementation, x.contiguous(), token_of_row.contiguous())


def _gather_fake(x, token_of_row, row_of_slot, implementation=None):
    return x.new_empty(token_of_row.shape[0], x.shape[1])


def _gather_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])
    ctx.implementation = backward_order(inputs[0], inputs[3] if len(inputs) > 3 else None)


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


def _combine_kernel(y, token_of_row, row_of_slot, topk_weights, implementation=None):
    _check_routing_map(token_of_row, row_of_slot, y.shape[0])
    return backends.dispatch(COMBINE, device_type(y), implementation, y.contiguous(), row_of_slot.contiguous(),
                             topk_weights.to(reference.compute_dtype(y.dtype)).contiguous(), y.dtype)


def _combine_fake(y, token_of_row, row_of_slot, topk_weights, implementation=None):
    return y.new_empty(row_of_slot.shape[0], y.shape[1])


def _combine_setup(ctx, inputs, output):
    y, token_of_row, row_of_slot, topk_weights = inputs[:4]
    ctx.save_for_backward(y, token_of_row, row_of_slot, topk_weights)
    ctx.implementation = backward_order(y, inputs[4] if len(inputs) > 4 else None)


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


def check_ids(topk_ids, num_experts, num_tokens: int | None = None) -> None:
    _checks.tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    if num_tokens is not None:
        _checks.size("topk_ids", 0, topk_ids.shape[0], num_tokens, "tokens T of x")
    if topk_ids.shape[1] == 0:
        raise ValueError(f"topk_ids: expected at least one expert per token, got shape {tuple(topk_ids.shape)}")


def routed_ids(topk_ids, num_experts: int) -> torch.Tensor:
    """``topk_ids`` with every id that is neither -1 nor an expert made -1 (dropped): how the
    deferred check mode routes bad ids."""
    return torch.where((topk_ids < -1) | (topk_ids >= num_experts), -1, topk_ids)


@functools.lru_cache(maxsize=64)
def _ids_message(num_experts: int) -> str:
    return f"topk_ids: expected expert ids in [0, {num_experts}) or -1 (dropped)"


def check_ids_range(topk_ids, num_experts: int, checks: _checks.ValueChecks | None = None) -> torch.Tensor:
    """Every id is -1 (dropped) or an expert. Returns the ids to route: in deferred mode a bad id
    becomes -1 (:func:`routed_ids`). Without ``checks``, checks fully now."""
    own = checks is None
    checks = checks or _checks.ValueChecks(topk_ids.device, "full")
    message = _ids_message(num_experts)
    if (device_check := checks.device_check(_checks.INDICES_CHECK, (message,))) is not None:
        routed, _ = device_check(topk_ids.reshape(-1), num_experts, only_minus_one_pads=True, with_bad=False,
                                 unique=False)
        return routed.view(topk_ids.shape)
    bad = (topk_ids < -1) | (topk_ids >= num_experts)
    checks.add(bad, message, lambda: f"got {int(topk_ids[bad][0])} at {tuple(bad.nonzero()[0].tolist())}")
    if own:
        checks.finish()
    return routed_ids(topk_ids, num_experts) if checks.deferred else topk_ids


@dataclasses.dataclass(frozen=True)
class GroupPath:
    """A dispatch with a ``torch.distributed`` group and the combine of the handle it returns,
    plugged in by :mod:`torch_kernels.distributed` when it is imported: the ops sit below the
    distributed package and never import it."""

    dispatch: Callable  # (x, topk_ids, num_experts, group, *, max_tokens_per_rank, dispatch_dtype, implementation)
    combine: Callable  # (y, handle, topk_weights)
    handle_type: type | tuple  # what dispatch returns as its handle (() before any is made)


_group_path: GroupPath | None = None  # set by the package on import (torch_kernels/__init__.py)


def register_group_path(path: GroupPath) -> None:
    """Routes :func:`moe_dispatch` with a group, and :func:`moe_combine` of its handles, to ``path``."""
    global _group_path
    _group_path = path


def group_path() -> GroupPath | None:
    """The path :func:`moe_dispatch` takes with a group (None until one is registered)."""
    return _group_path


def moe_dispatch(x, topk_ids, num_experts, implementation=None, *, group=None, max_tokens_per_rank=None,
                 dispatch_dtype=None):
    """Copies of each token's row, one per chosen expert, sorted by expert.

    Computes the routing maps, then runs the op ``torch.ops.torch_kernels.moe_gather`` (the name
    the profiler and the op's checks show), which copies the rows; this wrapper is the public face
    and the maps' owner, the op only moves rows.

    With a ``torch.distributed`` ``group``, the experts are split contiguously over its ranks and
    each copy goes to the rank holding its expert: see
    :func:`torch_kernels.distributed.dispatch_across_ranks` (which also takes ``max_tokens_per_rank`` for
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

    In the deferred check mode (``torch_kernels.checks``) an id that is neither -1 nor an expert
    is recorded, not raised, and dropped as -1 is: that copy of its token goes nowhere and adds
    nothing to the token's combined output.
    """
    if group is not None:
        return _group_path.dispatch(x, topk_ids, num_experts, group, max_tokens_per_rank=max_tokens_per_rank,
                                    dispatch_dtype=dispatch_dtype, implementation=implementation)
    if max_tokens_per_rank is not None or dispatch_dtype is not None:
        raise ValueError("max_tokens_per_rank, dispatch_dtype: expected None without a group (they size and "
                         f"encode the exchange between ranks), got {max_tokens_per_rank!r} and {dispatch_dtype!r}")
    _checks.tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if not is_int(num_experts) or num_experts < 1:
        raise ValueError(f"num_experts: expected an int >= 1, got {num_experts!r}")
    check_ids(topk_ids, num_experts, x.shape[0])
    _checks.same_device(x=x, topk_ids=topk_ids)
    backend = None  # traced by torch.compile: the maps as torch ops, which it compiles
    if not torch.compiler.is_compiling():
        backend = backends.planned(GATHER, device_type(x), implementation)
        topk_ids = _checks.checked(x.device, check_ids_range, topk_ids, num_experts, backend=backend)
    token_of_row, row_of_slot, offsets = sort_by_expert(topk_ids, num_experts, backend)
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
            there, see :func:`torch_kernels.distributed.combine_across_ranks`).
        topk_weights: ``[T, k]`` routing weights (any float dtype; used in float32).

    Returns:
        ``[T, N]`` in ``y``'s dtype; differentiable in ``y`` (a dispatch) and ``topk_weights``.
    """
    if not isinstance(handle, MoEHandle):
        if isinstance(handle, _group_path.handle_type):
            return _group_path.combine(y, handle, topk_weights)
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


def _gather_bytes(a, out) -> int:
    # each routed token read once (rows past the routed ones are written as zeros), every row written
    tokens = int((a.row_of_slot >= 0).any(dim=1).sum())
    return tokens * a.x.shape[1] * a.x.element_size() + tensor_bytes(a.token_of_row, out)


def _combine_bytes(a, out) -> int:
    rows = int((a.row_of_slot >= 0).sum())  # dropped slots are not read
    return rows * a.y.shape[1] * a.y.element_size() + tensor_bytes(a.row_of_slot, a.topk_weights, out)


# moving rows is no arithmetic; a combine multiplies and adds once per routed row element
register_cost(moe_gather_op, flops=lambda a, out: 0, bytes=_gather_bytes)
register_cost(moe_combine_op, bytes=_combine_bytes,
              flops=lambda a, out: 2 * int((a.row_of_slot >= 0).sum()) * a.y.shape[1])

"""``grouped_mm``: rows of ``x`` times their expert's matrix (``torch.nn.functional.grouped_mm``'s
contract), and ``grouped_mm_weight_grad``, the per-expert ``x_e^T dy_e`` its backward needs."""

from __future__ import annotations

import functools

import torch

from ... import _checks, backends
from ..._library import define, register_cost, tensor_bytes
from ...reference import moe as reference
from ._common import FLOAT_DTYPES, backward_order, device_type, per_expert_bytes

GROUPED_MM, WEIGHT_GRAD = "grouped_mm", "grouped_mm_weight_grad"
backends.register(GROUPED_MM, "reference", reference.grouped_mm)
backends.register(GROUPED_MM, "triton", "triton_impl.moe:grouped_mm")
backends.register(GROUPED_MM, "pallas", "torch_kernels.pallas.moe:pallas_grouped_mm")
backends.register(GROUPED_MM, "sycl", "oneapi_impl.moe:grouped_mm")
backends.register(WEIGHT_GRAD, "reference", reference.grouped_mm_weight_grad)
backends.register(WEIGHT_GRAD, "triton", "triton_impl.moe:grouped_mm_weight_grad")
backends.register(WEIGHT_GRAD, "pallas", "torch_kernels.pallas.moe:pallas_grouped_mm_weight_grad")
backends.register(WEIGHT_GRAD, "sycl", "oneapi_impl.moe:grouped_mm_weight_grad")


@_checks.remembers_layouts
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


@functools.lru_cache(maxsize=256)
def _offsets_messages(rows: int) -> tuple[str, ...]:
    return ("offsets: expected cumulative row ends >= 0", "offsets: expected non-decreasing cumulative row ends",
            f"offsets: expected to end at most at the {rows} rows of x")


def check_offsets(offsets, rows: int, checks: _checks.ValueChecks | None = None) -> tuple:
    """Offsets never decrease and stay within the rows. Returns ``(offsets, bad)``: as given in full
    mode (``bad`` None); in deferred mode clamped into ``[0, rows]`` and made non-decreasing, with
    ``bad`` a 0-d flag set if any offset was bad (the rows' experts cannot then be told apart: the
    whole output is NaN). Without ``checks``, checks fully now."""
    if offsets.numel() == 0:
        return offsets, None
    own = checks is None
    checks = checks or _checks.ValueChecks(offsets.device, "full")
    messages = _offsets_messages(rows)
    if (device_check := checks.device_check(_checks.OFFSETS_CHECK, messages)) is not None:
        return device_check(offsets, rows, ends=True)
    decreasing = offsets[1:] < offsets[:-1]
    failed = [
        checks.add(offsets[0] < 0, messages[0], lambda: f"got {int(offsets[0])} first"),
        checks.add(decreasing, messages[1],
                   lambda: f"got {int(offsets[1:][decreasing][0])} after {int(offsets[:-1][decreasing][0])}"),
        checks.add(offsets[-1] > rows, messages[2], lambda: f"got {int(offsets[-1])}"),
    ]
    if own:
        checks.finish()
    if not checks.deferred:
        return offsets, None
    return offsets.clamp(0, rows).cummax(0).values, torch.stack(failed).any()


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
    offsets, bad = _checks.checked(x.device, check_offsets, offsets, x.shape[0],
                                   backend=backends.planned(GROUPED_MM, device_type(x), implementation))
    if not x.shape[1] or not w.shape[2]:  # nothing to multiply: the same zeros on every backend
        out = x.new_zeros(x.shape[0], w.shape[2], dtype=out_dtype or x.dtype)
    else:
        tensor, transposed = _weight_layout(w)
        out = backends.dispatch(GROUPED_MM, device_type(x), implementation, x.contiguous(), tensor,
                                offsets.long().contiguous(), out_dtype or x.dtype, transposed)
    return _checks.nan_where(bad, out)[0]


def _grouped_fake(x, w, offsets, out_dtype=None, implementation=None):
    _check_grouped(x, w, offsets, out_dtype)
    return x.new_empty(x.shape[0], w.shape[2], dtype=out_dtype or x.dtype)


def _grouped_setup(ctx, inputs, output):
    x, w, offsets = inputs[:3]
    ctx.save_for_backward(x, w, offsets)
    ctx.implementation = backward_order(x, inputs[4] if len(inputs) > 4 else None)


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
    offsets, bad = _checks.checked(x.device, check_offsets, offsets, x.shape[0],
                                   backend=backends.planned(WEIGHT_GRAD, device_type(x), implementation))
    if not (x.shape[1] and dy.shape[1] and num_experts):  # an empty gradient (grouped_mm with K, N or E 0)
        grad = x.new_zeros(num_experts, x.shape[1], dy.shape[1], dtype=out_dtype)
    else:
        grad = backends.dispatch(WEIGHT_GRAD, device_type(x), implementation, x.contiguous(), dy.contiguous(),
                                 offsets.long().contiguous(), num_experts, out_dtype)
    return _checks.nan_where(bad, grad)[0]


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

    In the deferred check mode (``torch_kernels.checks``) bad offsets are recorded, not raised, and
    the kernels get them clamped into ``[0, M]`` and non-decreasing; the whole output (and the
    gradients) is then NaN, since which rows went to which expert is unknown.
    """
    _checks.tensor("x", x)
    _checks.tensor("w", w)
    _checks.tensor("offsets", offsets)
    _check_grouped(x, w, offsets, out_dtype)
    return grouped_mm_op(x, w, offsets, out_dtype, backends.implementation_arg(implementation))


def _grouped_rows(offsets) -> int:
    return int(offsets[-1]) if offsets.numel() else 0


def _experts_used(offsets) -> int:
    """Experts with at least one row: only their weights need reading."""
    return int((torch.diff(offsets, prepend=offsets.new_zeros(1)) > 0).sum())


def _grouped_bytes(a, out) -> int:
    rows = _grouped_rows(a.offsets)
    return (rows * a.x.shape[1] * a.x.element_size() + per_expert_bytes(a.w, _experts_used(a.offsets))
            + tensor_bytes(a.offsets, out))


def _weight_grad_bytes(a, out) -> int:
    rows = _grouped_rows(a.offsets)
    return (rows * (a.x.shape[1] * a.x.element_size() + a.dy.shape[1] * a.dy.element_size())
            + tensor_bytes(a.offsets, out))


register_cost(grouped_mm_op, bytes=_grouped_bytes,
              flops=lambda a, out: 2 * _grouped_rows(a.offsets) * a.x.shape[1] * a.w.shape[2])
register_cost(grouped_mm_weight_grad_op, bytes=_weight_grad_bytes,
              flops=lambda a, out: 2 * _grouped_rows(a.offsets) * a.x.shape[1] * a.dy.shape[1])


def grouped_mm_inputs(gen, dtype, device, rows=61, k_dim=40, n_dim=24, experts=6):
    """Rows split unevenly over experts (the second one empty), the last rows belonging to none."""
    x = torch.randn(rows, k_dim, generator=gen)
    w = torch.randn(experts, k_dim, n_dim, generator=gen) * k_dim ** -0.5
    ends = torch.randint(0, rows * 9 // 10 + 1, (experts,), generator=gen).sort().values
    ends[1:2] = ends[:1]
    return x.to(device, dtype), w.to(device, dtype), ends.to(device, torch.int32)


def grouped_mm_definition(x, w, offsets):
    """The self-test's truth for :func:`grouped_mm`: one matmul per expert in float64."""
    return reference.grouped_mm_naive(x.double(), w.double(), offsets, torch.float64)

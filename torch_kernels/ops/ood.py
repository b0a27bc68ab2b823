"""``torch_kernels::mahalanobis_score``: the op, its fake, autograd, FLOP formula and wrapper."""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.flop_counter import register_flop_formula

from .. import _checks, backends
from .._library import define
from ..reference import ood as reference

OP = "mahalanobis_score"

backends.register(OP, "reference", reference.mahalanobis_min)
backends.register(OP, "triton", "triton_impl.ood:mahalanobis_min")
backends.register(OP, "pallas", "torch_kernels._jax_interop:pallas_mahalanobis_min")
backends.register(OP, "sycl", "oneapi_impl.ood:mahalanobis_min")


# x's dtype -> the dtypes means and whitener may have
_PARAM_DTYPES = {dtype: (torch.float64,) if dtype == torch.float64 else tuple(dict.fromkeys((dtype, torch.float32)))
                 for dtype in _checks.FLOAT_DTYPES}


def check_inputs(x, means, whitener) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless the inputs fit the op."""
    xs, ms, ws = x.shape, means.shape, whitener.shape
    param_dtypes = _PARAM_DTYPES.get(x.dtype)
    # the common case in one comparison; the detailed checks below say what is wrong
    if (len(xs) == len(ms) == len(ws) == 2 and xs[1] == ms[1] == ws[0] == ws[1] > 0 and ms[0] > 0
            and param_dtypes is not None and means.dtype in param_dtypes and whitener.dtype in param_dtypes
            and x.device == means.device == whitener.device):
        return
    _checks.tensor("x", x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    param_dtypes = _PARAM_DTYPES[x.dtype]
    _checks.tensor("means", means, ndim=2, dtypes=param_dtypes)
    _checks.tensor("whitener", whitener, ndim=2, dtypes=param_dtypes)
    d = x.shape[1]
    if d == 0:
        raise ValueError("x: expected at least one feature, got shape (B, 0)")
    if means.shape[0] == 0:
        raise ValueError("means: expected at least one class, got shape (0, D)")
    _checks.size("means", 1, means.shape[1], d, "features D of x")
    _checks.size("whitener", 0, whitener.shape[0], d, "features D of x")
    _checks.size("whitener", 1, whitener.shape[1], d, "features D of x")
    _checks.same_device(x=x, means=means, whitener=whitener)


def _nearest(x, means, whitener, implementation):
    """(scores, nearest class) from the chosen backend's fused kernel."""
    dtype = reference.compute_dtype(x.dtype)
    if x.shape[0] == 0:
        return x.new_empty(0, dtype=dtype), x.new_empty(0, dtype=torch.int64)
    if x.requires_grad or means.requires_grad or whitener.requires_grad:
        # kernels take plain tensors (DLPack and USM copies refuse grad-requiring ones)
        x, means, whitener = x.detach(), means.detach(), whitener.detach()
    center, class_proj, class_sq = reference.class_terms(means, whitener, dtype)
    return backends.dispatch(  # kernels index their inputs as dense row-major arrays
        OP, "cpu" if x.is_cpu else x.device.type, implementation,  # is_cpu is the cheaper question
        x.contiguous(), center.contiguous(), whitener.contiguous(), class_proj, class_sq,
    )


def _score_kernel(x, means, whitener, implementation=None):
    check_inputs(x, means, whitener)
    return _nearest(x, means, whitener, implementation)[0]


def _score_fake(x, means, whitener, implementation=None):
    check_inputs(x, means, whitener)
    return x.new_empty(x.shape[0], dtype=reference.compute_dtype(x.dtype))


def _gradients(grad, x, means, whitener, nearest):
    """d score / d (x, means, whitener) given each row's nearest class, in plain torch ops
    (differentiable themselves, for higher-order gradients)."""
    dtype = reference.compute_dtype(x.dtype)
    w = whitener.to(dtype)
    diff = x.to(dtype) - means.to(dtype)[nearest]
    weighted = (diff @ w) * (2.0 * grad.to(dtype))[:, None]
    grad_x = weighted @ w.T
    grad_means = torch.zeros(means.shape, dtype=dtype, device=x.device).index_add(0, nearest, grad_x, alpha=-1.0)
    grad_whitener = diff.T @ weighted
    return grad_x.to(x.dtype), grad_means.to(means.dtype), grad_whitener.to(whitener.dtype)


def _check_grad(grad, x) -> None:
    _checks.tensor("grad", grad, ndim=1, dtypes=_checks.FLOAT_DTYPES)
    _checks.size("grad", 0, grad.shape[0], x.shape[0], "rows B of x")


def _backward_kernel(grad, x, means, whitener, implementation=None):
    check_inputs(x, means, whitener)
    _check_grad(grad, x)
    # Recomputes the nearest class rather than saving it: the op's one output stays the score.
    _, nearest = _nearest(x, means, whitener, implementation)
    return tuple(g.contiguous() for g in _gradients(grad, x, means, whitener, nearest))


def _backward_fake(grad, x, means, whitener, implementation=None):
    check_inputs(x, means, whitener)
    _check_grad(grad, x)
    return x.new_empty(x.shape), means.new_empty(means.shape), whitener.new_empty(whitener.shape)


mahalanobis_score_backward = define(
    "mahalanobis_score_backward(Tensor grad, Tensor x, Tensor means, Tensor whitener, "
    "str? implementation=None) -> (Tensor, Tensor, Tensor)",
    _backward_kernel,
    _backward_fake,
)


def _setup_context(ctx, inputs, output):
    x, means, whitener, implementation = (inputs + (None,))[:4]
    ctx.save_for_backward(x, means, whitener)
    # the backward runs on the backends chosen now, even outside this call's use_backend block
    order, explicit = backends.resolve(x.device.type, implementation)
    ctx.implementation = ",".join(order) if explicit else None


def _backward(ctx, grad):
    x, means, whitener = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: build the gradients from differentiable ops
        with torch.no_grad():
            _, nearest = _nearest(x, means, whitener, ctx.implementation)
        grads = _gradients(grad, x, means, whitener, nearest)
    else:
        grads = mahalanobis_score_backward(grad, x, means, whitener, ctx.implementation)
    return (*(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad)), None)


mahalanobis_score_op = define(
    "mahalanobis_score(Tensor x, Tensor means, Tensor whitener, str? implementation=None) -> Tensor",
    _score_kernel,
    _score_fake,
    setup_context=_setup_context,
    backward=_backward,
)


def score_flops(b: int, c: int, d: int) -> int:
    """Whitening GEMM, per-class GEMM and norms: 2BD^2 + 2CD^2 + 2BCD + 2BD."""
    return 2 * b * d * d + 2 * c * d * d + 2 * b * c * d + 2 * b * d


def score_bytes(b: int, c: int, d: int, x_itemsize: int, param_itemsize: int) -> int:
    """What one call must move at least: x, whitener and means in, scores out."""
    return b * d * x_itemsize + (d * d + c * d) * param_itemsize + b * 4


@register_flop_formula(mahalanobis_score_op.overloadpacket)
def _score_flop_formula(x_shape, means_shape, whitener_shape, *args, **kwargs) -> int:
    return score_flops(x_shape[0], means_shape[0], x_shape[1])


@register_flop_formula(mahalanobis_score_backward.overloadpacket)
def _backward_flop_formula(grad_shape, x_shape, means_shape, whitener_shape, *args, **kwargs) -> int:
    # the recomputed forward, then diff @ W, (.) @ W^T and diff^T @ (.)
    b, d = x_shape
    return score_flops(b, means_shape[0], d) + 3 * 2 * b * d * d


def mahalanobis_score(
    x: torch.Tensor,
    means: torch.Tensor,
    whitener: torch.Tensor,
    implementation: str | Sequence[str] | None = None,
) -> torch.Tensor:
    """Squared Mahalanobis distance of each row of ``x`` to its nearest class mean.

    ``score[b] = min_c ||(x[b] - means[c]) @ whitener||^2``, where ``whitener @ whitener.T`` is
    the precision matrix (``torch_kernels.ood.MahalanobisScorer`` fits both).

    Args:
        x: ``[B, D]`` features, float16, bfloat16, float32 or float64.
        means: ``[C, D]`` class means (``C = 1`` for one Gaussian), x's dtype or float32.
        whitener: ``[D, D]``, x's dtype or float32. float16/bfloat16 inputs are multiplied in
            their own precision with float32 accumulation on GPU backends.
        implementation: a backend name or ordered list of names (``"reference"``, ``"triton"``,
            ``"pallas"``, ``"sycl"``); ``None`` chooses by device (see ``torch_kernels.backends``).

    Returns:
        ``[B]`` scores, float32 (float64 for float64 ``x``). Differentiable in all three inputs
        (higher orders too; ``torch.func`` transforms are not supported). A row with NaN scores
        NaN, as ``torch.min`` would.

    Accuracy: with several classes the kernels expand ``||y - p_c||^2`` as
    ``||y||^2 - 2 y.p_c + ||p_c||^2`` about the mean of the class means, so when the means lie
    many within-class standard deviations apart a float32 score loses relative precision (about
    1e-4 at 100). One class, and every gradient, use the difference itself.
    """
    for name, value in (("x", x), ("means", means), ("whitener", whitener)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return mahalanobis_score_op(x, means, whitener, backends.implementation_arg(implementation))

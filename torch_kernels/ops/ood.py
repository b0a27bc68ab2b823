"""The ood family's ops, ``torch_kernels::mahalanobis_score`` (and ``mahalanobis_score_fitted``, the same
score from class terms computed once) and ``torch_kernels::edm_score``: their schemas, fakes, autograd,
FLOP and byte formulas and wrappers."""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from .. import _checks, backends
from .._library import define, io_bytes, register_cost
from ..families import Case
from ..reference import ood as reference

__all__ = ["mahalanobis_score", "mahalanobis_score_fitted", "edm_score"]

OP = "mahalanobis_score"

backends.register(OP, "reference", reference.mahalanobis_min)
backends.register(OP, "triton", "triton_impl.ood:mahalanobis_min")
backends.register(OP, "pallas", "torch_kernels.pallas.ood:pallas_mahalanobis_min")
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
    d = _check_x_and_whitener(x, whitener)
    _checks.tensor("means", means, ndim=2, dtypes=_PARAM_DTYPES[x.dtype])
    if means.shape[0] == 0:
        raise ValueError("means: expected at least one class, got shape (0, D)")
    _checks.size("means", 1, means.shape[1], d, "features D of x")
    _checks.same_device(x=x, means=means, whitener=whitener)


def _check_x_and_whitener(x, whitener) -> int:
    """``x [B, D]`` and ``whitener [D, D]`` of dtypes that go together, ``D > 0``; returns ``D``."""
    _checks.tensor("x", x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    _checks.tensor("whitener", whitener, ndim=2, dtypes=_PARAM_DTYPES[x.dtype])
    d = x.shape[1]
    if d == 0:
        raise ValueError("x: expected at least one feature, got shape (B, 0)")
    _checks.size("whitener", 0, whitener.shape[0], d, "features D of x")
    _checks.size("whitener", 1, whitener.shape[1], d, "features D of x")
    return d


def _nearest(x, means, whitener, implementation):
    """(scores, nearest class) from the chosen backend's fused kernel."""
    if means.requires_grad or whitener.requires_grad:
        means, whitener = means.detach(), whitener.detach()
    center, class_proj, class_sq = _class_terms(x, means, whitener)
    return _nearest_fitted(x, center, whitener, class_proj, class_sq, implementation, OP)


def _class_terms(x, means, whitener):
    """``(center, class_proj, class_sq)`` of ``means`` in the compute dtype of ``x``."""
    return reference.class_terms(means, whitener, reference.compute_dtype(x.dtype))


def _nearest_fitted(x, center, whitener, class_proj, class_sq, implementation, op):
    """(scores, nearest class) from ``op``'s chosen backend's fused kernel, given the class terms."""
    if x.shape[0] == 0:
        return x.new_empty(0, dtype=reference.compute_dtype(x.dtype)), x.new_empty(0, dtype=torch.int64)
    terms = (x, center, whitener, class_proj, class_sq)
    if any(t.requires_grad for t in terms):
        # kernels take plain tensors (DLPack and USM copies refuse grad-requiring ones)
        terms = tuple(t.detach() for t in terms)
    return backends.dispatch(  # kernels index their inputs as dense row-major arrays
        op, "cpu" if x.is_cpu else x.device.type, implementation,  # is_cpu is the cheaper question
        *(t.contiguous() for t in terms),
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


def _backward_flops(a, out) -> int:
    # the recomputed forward, then diff @ W, (.) @ W^T and diff^T @ (.)
    b, d = a.x.shape
    return score_flops(b, a.means.shape[0], d) + 3 * 2 * b * d * d


register_cost(mahalanobis_score_op, bytes=io_bytes,
              flops=lambda a, out: score_flops(a.x.shape[0], a.means.shape[0], a.x.shape[1]))
register_cost(mahalanobis_score_backward, flops=_backward_flops, bytes=io_bytes)


def mahalanobis_score(
    x: torch.Tensor,
    means: torch.Tensor,
    whitener: torch.Tensor,
    implementation: str | Sequence[str] | None = None,
) -> torch.Tensor:
    """Squared Mahalanobis distance of each row of ``x`` to its nearest class mean.

    ``score[b] = min_c ||(x[b] - means[c]) @ whitener||^2``, where ``whitener @ whitener.T`` is
    the precision matrix (``torch_kernels.ood.MahalanobisScorer`` fits both). Each call whitens the
    means too (``C D^2`` multiply-adds); scoring again and again against one fit,
    :func:`mahalanobis_score_fitted` takes them whitened once.

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


# ---- mahalanobis_score_fitted ----
#
# The same score as mahalanobis_score, from the class terms the kernels take (center, class_proj,
# class_sq) rather than the means: a fitted scorer computes them once instead of whitening every class
# mean (O(C D^2)) on every call. A separate op rather than optional arguments of mahalanobis_score, so
# that each op is a function of its own inputs: no terms can disagree with the means they came from, and
# each op's gradients are those of what it computed.

FITTED_OP = "mahalanobis_score_fitted"

# the same kernels as mahalanobis_score's, which take the class terms already
backends.register(FITTED_OP, "reference", reference.mahalanobis_min)
backends.register(FITTED_OP, "triton", "triton_impl.ood:mahalanobis_min")
backends.register(FITTED_OP, "pallas", "torch_kernels.pallas.ood:pallas_mahalanobis_min")
backends.register(FITTED_OP, "sycl", "oneapi_impl.ood:mahalanobis_min")


@_checks.remembers_layouts
def check_fitted_inputs(x, center, whitener, class_proj, class_sq) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless the inputs fit ``mahalanobis_score_fitted``."""
    dtype = reference.compute_dtype(x.dtype)
    param_dtypes = _PARAM_DTYPES.get(x.dtype)
    xs, ws, ps = x.shape, whitener.shape, class_proj.shape
    # the common case in one comparison; the detailed checks below say what is wrong
    if (len(xs) == len(ws) == len(ps) == 2 and center.dim() == class_sq.dim() == 1
            and xs[1] == ws[0] == ws[1] == ps[1] == center.shape[0] > 0 and ps[0] == class_sq.shape[0] > 0
            and param_dtypes is not None and whitener.dtype in param_dtypes
            and center.dtype == class_proj.dtype == class_sq.dtype == dtype
            and x.device == center.device == whitener.device == class_proj.device == class_sq.device):
        return
    d = _check_x_and_whitener(x, whitener)
    _checks.tensor("center", center, ndim=1, dtypes=(dtype,))
    _checks.tensor("class_proj", class_proj, ndim=2, dtypes=(dtype,))
    _checks.tensor("class_sq", class_sq, ndim=1, dtypes=(dtype,))
    if class_proj.shape[0] == 0:
        raise ValueError("class_proj: expected at least one class, got shape (0, D)")
    _checks.size("center", 0, center.shape[0], d, "features D of x")
    _checks.size("class_proj", 1, class_proj.shape[1], d, "features D of x")
    _checks.size("class_sq", 0, class_sq.shape[0], class_proj.shape[0], "classes C of class_proj")
    _checks.same_device(x=x, center=center, whitener=whitener, class_proj=class_proj, class_sq=class_sq)


def _fitted_kernel(x, center, whitener, class_proj, class_sq, implementation=None):
    check_fitted_inputs(x, center, whitener, class_proj, class_sq)
    return _nearest_fitted(x, center, whitener, class_proj, class_sq, implementation, FITTED_OP)[0]


def _fitted_fake(x, center, whitener, class_proj, class_sq, implementation=None):
    check_fitted_inputs(x, center, whitener, class_proj, class_sq)
    return x.new_empty(x.shape[0], dtype=reference.compute_dtype(x.dtype))


def _fitted_gradients(grad, x, center, whitener, class_proj, class_sq, nearest):
    """d score / d (x, center, whitener, class_proj, class_sq) given each row's nearest class, in plain
    torch ops (differentiable themselves). With ``y = (x - center) W`` the score is
    ``||y||^2 - 2 y.class_proj[n] + class_sq[n]`` for the nearest class ``n``."""
    dtype = reference.compute_dtype(x.dtype)
    w = whitener.to(dtype)
    centred = x.to(dtype) - center
    y = centred @ w
    g = grad.to(dtype)
    weighted = (y - class_proj[nearest]) * (2.0 * g)[:, None]  # (x - means[n]) W for consistent terms
    grad_x = weighted @ w.T
    grad_proj = torch.zeros_like(class_proj).index_add(0, nearest, y * g[:, None], alpha=-2.0)
    grad_sq = torch.zeros_like(class_sq).index_add(0, nearest, g)
    return grad_x.to(x.dtype), -grad_x.sum(dim=0), (centred.T @ weighted).to(whitener.dtype), grad_proj, grad_sq


def _fitted_backward_kernel(grad, x, center, whitener, class_proj, class_sq, implementation=None):
    check_fitted_inputs(x, center, whitener, class_proj, class_sq)
    _check_grad(grad, x)
    _, nearest = _nearest_fitted(x, center, whitener, class_proj, class_sq, implementation, FITTED_OP)
    return tuple(g.contiguous() for g in _fitted_gradients(grad, x, center, whitener, class_proj, class_sq, nearest))


def _fitted_backward_fake(grad, x, center, whitener, class_proj, class_sq, implementation=None):
    check_fitted_inputs(x, center, whitener, class_proj, class_sq)
    _check_grad(grad, x)
    return tuple(t.new_empty(t.shape) for t in (x, center, whitener, class_proj, class_sq))


_FITTED_SIGNATURE = "Tensor x, Tensor center, Tensor whitener, Tensor class_proj, Tensor class_sq, str? implementation=None"

mahalanobis_score_fitted_backward = define(
    f"mahalanobis_score_fitted_backward(Tensor grad, {_FITTED_SIGNATURE}) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    _fitted_backward_kernel,
    _fitted_backward_fake,
)


def _fitted_setup_context(ctx, inputs, output):
    x, center, whitener, class_proj, class_sq, implementation = (inputs + (None,))[:6]
    ctx.save_for_backward(x, center, whitener, class_proj, class_sq)
    order, explicit = backends.resolve(x.device.type, implementation)
    ctx.implementation = ",".join(order) if explicit else None


def _fitted_backward(ctx, grad):
    tensors = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: build the gradients from differentiable ops
        with torch.no_grad():
            _, nearest = _nearest_fitted(*tensors, ctx.implementation, FITTED_OP)
        grads = _fitted_gradients(grad, *tensors, nearest)
    else:
        grads = mahalanobis_score_fitted_backward(grad, *tensors, ctx.implementation)
    return (*(g if needed else None for g, needed in zip(grads, ctx.needs_input_grad)), None)


mahalanobis_score_fitted_op = define(
    f"mahalanobis_score_fitted({_FITTED_SIGNATURE}) -> Tensor",
    _fitted_kernel,
    _fitted_fake,
    setup_context=_fitted_setup_context,
    backward=_fitted_backward,
)


def fitted_score_flops(b: int, c: int, d: int) -> int:
    """Whitening GEMM, the products with the class terms and norms: 2BD^2 + 2BCD + 2BD."""
    return 2 * b * d * d + 2 * b * c * d + 2 * b * d


def _fitted_sizes(a):
    return a.x.shape[0], a.class_proj.shape[0], a.x.shape[1]


register_cost(mahalanobis_score_fitted_op, bytes=io_bytes, flops=lambda a, out: fitted_score_flops(*_fitted_sizes(a)))
# the recomputed forward, then y, (.) @ W^T and (x - center)^T @ (.)
register_cost(mahalanobis_score_fitted_backward, bytes=io_bytes,
              flops=lambda a, out: fitted_score_flops(*_fitted_sizes(a)) + 3 * 2 * a.x.shape[0] * a.x.shape[1] ** 2)


def mahalanobis_score_fitted(
    x: torch.Tensor,
    center: torch.Tensor,
    whitener: torch.Tensor,
    class_proj: torch.Tensor,
    class_sq: torch.Tensor,
    implementation: str | Sequence[str] | None = None,
) -> torch.Tensor:
    """:func:`mahalanobis_score` from class terms computed once: what a fitted scorer calls.

    ``mahalanobis_score(x, means, whitener)`` whitens every class mean on every call (``O(C D^2)``,
    more than scoring a few rows costs); this op takes the result. With
    ``center, class_proj, class_sq = torch_kernels.reference.ood.class_terms(means, whitener, dtype)``
    (``dtype`` float32, or float64 for float64 ``x``) it gives ``mahalanobis_score(x, means, whitener)``:
    ``y = (x - center) @ whitener``, ``score[b] = max(min_c ||y_b||^2 - 2 y_b . class_proj[c] + class_sq[c], 0)``.
    ``torch_kernels.ood.MahalanobisScorer`` keeps these terms from its fit.

    Args:
        x: ``[B, D]`` features, float16, bfloat16, float32 or float64.
        center: ``[D]``, ``class_proj``: ``[C, D]``, ``class_sq``: ``[C]``; float32 (float64 for float64 ``x``).
        whitener: ``[D, D]``, x's dtype or float32 (as for :func:`mahalanobis_score`).
        implementation: a backend name or ordered list of names (``"reference"``, ``"triton"``,
            ``"pallas"``, ``"sycl"``); ``None`` chooses by device (see ``torch_kernels.backends``).

    Returns:
        ``[B]`` scores, float32 (float64 for float64 ``x``). Differentiable in all five tensors, as
        functions of this op's inputs (higher orders too; ``torch.func`` transforms are not
        supported); the gradient to ``x`` equals :func:`mahalanobis_score`'s for terms made from its means.
    """
    for name, value in (("x", x), ("center", center), ("whitener", whitener), ("class_proj", class_proj),
                        ("class_sq", class_sq)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return mahalanobis_score_fitted_op(x, center, whitener, class_proj, class_sq,
                                       backends.implementation_arg(implementation))


# ---- edm_score ----

EDM_OP = "edm_score"

backends.register(EDM_OP, "reference", reference.edm_score_levels)
backends.register(EDM_OP, "triton", "triton_impl.ood:edm_score_levels")
backends.register(EDM_OP, "pallas", "torch_kernels.pallas.ood:pallas_edm_score_levels")
backends.register(EDM_OP, "sycl", "oneapi_impl.ood:edm_score_levels")

# the op's tensor arguments after x, in schema order, and the shape of each ("K" blocks, "L" levels,
# "H" hidden width, "D" features)
EDM_TENSORS = ("mean", "inv_scale", "noise", "level_weights", "level_bias", "w_in", "w1", "b1", "w2", "b2",
               "w_out", "b_out")
_EDM_SHAPES = {"mean": ("D",), "inv_scale": ("D",), "noise": ("L", "D"), "level_weights": ("L",),
               "level_bias": ("L", "H"), "w_in": ("D", "H"), "w1": ("K", "H", "H"), "b1": ("K", "H"),
               "w2": ("K", "H", "H"), "b2": ("K", "H"), "w_out": ("H", "D"), "b_out": ("D",)}
_EDM_SIZE_NAMES = {"D": "features D of x", "L": "noise levels L, len(sigmas)", "H": "hidden width H of w_in",
                   "K": "blocks K of w1"}


def _check_positive(name: str, value) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} {value!r}")
    if not 0.0 < value < float("inf"):
        raise ValueError(f"{name}: expected a finite float > 0, got {value!r}")
    return float(value)


def check_edm_inputs(x, params, sigmas, sigma_data, statistic) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument unless the inputs fit ``edm_score``.

    ``params`` holds the tensors named in ``EDM_TENSORS``, in that order.
    """
    _checks.tensor("x", x, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    if x.shape[1] == 0:
        raise ValueError("x: expected at least one feature, got shape (B, 0)")
    if statistic not in reference.EDM_STATISTICS:
        raise ValueError(f"statistic: expected one of {reference.EDM_STATISTICS}, got {statistic!r}")
    if not isinstance(sigmas, (list, tuple)) or not sigmas:
        raise ValueError(f"sigmas: expected a non-empty list of noise levels, got {sigmas!r}")
    for sigma in sigmas:
        _check_positive("sigmas", sigma)
    _check_positive("sigma_data", sigma_data)
    param_dtypes = _PARAM_DTYPES[x.dtype]
    w1 = params[EDM_TENSORS.index("w1")]
    w_in = params[EDM_TENSORS.index("w_in")]
    for name, t in zip(EDM_TENSORS, params):
        _checks.tensor(name, t, ndim=len(_EDM_SHAPES[name]), dtypes=param_dtypes)
    sizes = {"D": x.shape[1], "L": len(sigmas), "H": w_in.shape[1], "K": w1.shape[0]}
    if sizes["H"] == 0:
        raise ValueError("w_in: expected a hidden width H of at least 1, got shape (D, 0)")
    for name, t in zip(EDM_TENSORS, params):
        for dim, (size_name, got) in enumerate(zip(_EDM_SHAPES[name], t.shape)):
            _checks.size(name, dim, got, sizes[size_name], _EDM_SIZE_NAMES[size_name])
    _checks.same_device(x=x, **dict(zip(EDM_TENSORS, params)))


@functools.lru_cache(maxsize=64)
def _level_coefficients(sigmas: tuple, sigma_data: float, dtype: torch.dtype, device: torch.device):
    # one small table per grid, shared by every call (made outside inference mode, as _zero_class_terms)
    with torch.inference_mode(False):
        return reference.edm_level_coefficients(torch.tensor(sigmas, dtype=torch.float64), sigma_data,
                                                dtype).to(device)


def _edm_levels(x, params, sigmas, sigma_data, statistic, implementation):
    """Scores from the chosen backend's fused kernel."""
    dtype = reference.compute_dtype(x.dtype)
    if x.shape[0] == 0:
        return x.new_empty(0, dtype=dtype)
    # kernels take plain, dense row-major tensors in the compute dtype (x keeps its own)
    params = [reference.as_dtype(t.detach(), dtype).contiguous() for t in params]
    coefficients = _level_coefficients(tuple(sigmas), sigma_data, dtype, x.device)
    return backends.dispatch(EDM_OP, "cpu" if x.is_cpu else x.device.type, implementation,
                             x.detach().contiguous(), *params[:2], coefficients, *params[2:], statistic == "scoped")


def _edm_kernel(x, *args, **kwargs):
    *params, sigmas, sigma_data, statistic, implementation = _edm_arguments(args, kwargs)
    check_edm_inputs(x, params, sigmas, sigma_data, statistic)
    return _edm_levels(x, params, sigmas, sigma_data, statistic, implementation)


def _edm_fake(x, *args, **kwargs):
    *params, sigmas, sigma_data, statistic, _ = _edm_arguments(args, kwargs)
    check_edm_inputs(x, params, sigmas, sigma_data, statistic)
    return x.new_empty(x.shape[0], dtype=reference.compute_dtype(x.dtype))


def _edm_arguments(args, kwargs=None) -> list:
    """The arguments after x, positional or by keyword, with the defaults (statistic, implementation) filled in."""
    names = (*EDM_TENSORS, "sigmas", "sigma_data", "statistic", "implementation")
    given = dict(zip(names, args), **(kwargs or {}))
    return [given.get(name, {"statistic": "denoise"}.get(name)) for name in names]


def _edm_gradients(grad, x, params, sigmas, sigma_data, statistic):
    """d score / d (x, *params): reverse mode of the reference math written out in torch ops
    (``reference.edm_score_levels_backward``; differentiable again, for higher orders)."""
    dtype = reference.compute_dtype(x.dtype)
    coefficients = _level_coefficients(tuple(sigmas), sigma_data, dtype, x.device)
    cast = [reference.as_dtype(t, dtype) for t in params]
    grads = reference.edm_score_levels_backward(grad, x, *cast[:2], coefficients, *cast[2:], statistic == "scoped")
    return [g.to(t.dtype) for g, t in zip(grads, (x, *params))]


def _check_edm_grad(grad, x) -> None:
    _checks.tensor("grad", grad, ndim=1, dtypes=_checks.FLOAT_DTYPES)
    _checks.size("grad", 0, grad.shape[0], x.shape[0], "rows B of x")


def _edm_backward_kernel(grad, x, *args, **kwargs):
    *params, sigmas, sigma_data, statistic, _ = _edm_arguments(args, kwargs)
    check_edm_inputs(x, params, sigmas, sigma_data, statistic)
    _check_edm_grad(grad, x)
    return tuple(g.contiguous() for g in _edm_gradients(grad, x, params, sigmas, sigma_data, statistic))


def _edm_backward_fake(grad, x, *args, **kwargs):
    *params, sigmas, sigma_data, statistic, _ = _edm_arguments(args, kwargs)
    check_edm_inputs(x, params, sigmas, sigma_data, statistic)
    _check_edm_grad(grad, x)
    return tuple(t.new_empty(t.shape) for t in (x, *params))


_EDM_SIGNATURE = ("Tensor x, " + ", ".join(f"Tensor {name}" for name in EDM_TENSORS)
                  + ", float[] sigmas, float sigma_data, str statistic=\"denoise\", str? implementation=None")

edm_score_backward = define(
    f"edm_score_backward(Tensor grad, {_EDM_SIGNATURE}) -> ({', '.join(['Tensor'] * (len(EDM_TENSORS) + 1))})",
    _edm_backward_kernel,
    _edm_backward_fake,
)


def _edm_setup_context(ctx, inputs, output):
    x, *rest = inputs
    *params, sigmas, sigma_data, statistic, implementation = _edm_arguments(rest)
    ctx.save_for_backward(x, *params)
    ctx.grid = (list(sigmas), sigma_data, statistic)
    ctx.num_tensors = 1 + len(params)


def _edm_backward(ctx, grad):
    x, *params = ctx.saved_tensors
    sigmas, sigma_data, statistic = ctx.grid
    if torch.is_grad_enabled():  # create_graph=True: gradients from differentiable ops
        grads = _edm_gradients(grad, x, params, sigmas, sigma_data, statistic)
    else:
        grads = edm_score_backward(grad, x, *params, sigmas, sigma_data, statistic)
    grads = [g if needed else None for g, needed in zip(grads, ctx.needs_input_grad)]
    return (*grads, *([None] * (len(ctx.needs_input_grad) - len(grads))))


edm_score_op = define(
    f"edm_score({_EDM_SIGNATURE}) -> Tensor",
    _edm_kernel,
    _edm_fake,
    setup_context=_edm_setup_context,
    backward=_edm_backward,
)


def edm_score_flops(b: int, d: int, h: int, k: int, levels: int, scoped: bool) -> int:
    """The GEMMs of the denoiser at every level: ``B L (2DH + 4KH^2 + 2HD)``, twice that for
    ``"scoped"`` (the tangent goes through the same GEMMs). Elementwise work is not counted."""
    return b * levels * (4 * d * h + 4 * k * h * h) * (2 if scoped else 1)


def edm_score_bytes(b: int, d: int, h: int, k: int, levels: int, x_itemsize: int, param_itemsize: int) -> int:
    """What one call must move at least: x, the weights, the noise and the level terms in, scores out."""
    params = 2 * d * h + 2 * k * h * h + 2 * k * h + levels * (d + h + 1) + 3 * d
    return b * d * x_itemsize + params * param_itemsize + b * 4


def _edm_sizes(x_shape, w_in_shape, w1_shape, sigmas):
    return x_shape[0], x_shape[1], w_in_shape[1], w1_shape[0], len(sigmas)


def _edm_flop_formula(a, out) -> int:
    return edm_score_flops(*_edm_sizes(a.x.shape, a.w_in.shape, a.w1.shape, a.sigmas), a.statistic == "scoped")


register_cost(edm_score_op, flops=_edm_flop_formula, bytes=io_bytes)
# reverse mode costs about twice the forward, after the forward it recomputes
register_cost(edm_score_backward, flops=lambda a, out: 3 * _edm_flop_formula(a, out), bytes=io_bytes)


def edm_score(
    x: torch.Tensor,
    mean: torch.Tensor,
    inv_scale: torch.Tensor,
    noise: torch.Tensor,
    level_weights: torch.Tensor,
    level_bias: torch.Tensor,
    w_in: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    w_out: torch.Tensor,
    b_out: torch.Tensor,
    sigmas: Sequence[float],
    sigma_data: float,
    statistic: str = "denoise",
    implementation: str | Sequence[str] | None = None,
) -> torch.Tensor:
    """EDM diffusion score of each row of ``x``: the denoiser at every noise level, summed per row.

    ``torch_kernels.ood.EDMScorer`` fits every argument; its ``score`` calls this op. With
    ``y = (x - mean) * inv_scale``, ``c_skip, c_out, c_in`` EDM's preconditioning at
    ``sigmas[l]`` and ``sigma_data``, and ``F`` the residual MLP
    (``torch_kernels.reference.ood.edm_mlp``: ``h = u @ w_in + level_bias[l]``, ``K`` blocks
    ``h += silu(silu(h) @ w1[k] + b1[k]) @ w2[k] + b2[k]``, ``F = silu(h) @ w_out + b_out``), the
    denoiser at level ``l`` is ``D_l(v) = c_skip v + c_out F(c_in v)`` and

    - ``statistic="denoise"``: ``score = sum_l level_weights[l] ||D_l(y + sigmas[l] noise[l]) - y||^2``;
    - ``statistic="scoped"``: ``score = sum_l level_weights[l] (||D_l(y) - y||^2 / sigmas[l]^2
      + noise[l] . J_{D_l}(y) noise[l] - ||noise[l]||^2)``: ``sigma^2 (||s||^2 + div s)`` of the
      score function ``s = (D_l(y) - y) / sigma^2``, the divergence by Hutchinson's estimator with
      the probe ``noise[l]`` (one Jacobian-vector product per level, carried through the MLP).

    Args:
        x: ``[B, D]`` features, float16, bfloat16, float32 or float64.
        mean, inv_scale: ``[D]`` standardization; noise ``[L, D]``; level_weights ``[L]``;
            level_bias ``[L, H]`` (the input bias plus each level's noise embedding); w_in
            ``[D, H]``; w1, w2 ``[K, H, H]``; b1, b2 ``[K, H]`` (``K >= 0``); w_out ``[H, D]``;
            b_out ``[D]``: float32, or x's dtype.
        sigmas: the ``L`` noise levels (floats > 0); sigma_data: the data's standard deviation.
        implementation: a backend name or ordered list (``"reference"``, ``"triton"``,
            ``"pallas"``, ``"sycl"``); ``None`` chooses by device.

    Returns:
        ``[B]`` scores, float32 (float64 for float64 ``x``), each backend one fused kernel over
        all levels. Differentiable in every tensor (the backward is the vector-Jacobian product
        of the reference math, higher orders too).
    """
    for name, value in (("x", x), *zip(EDM_TENSORS, (mean, inv_scale, noise, level_weights, level_bias, w_in,
                                                       w1, b1, w2, b2, w_out, b_out))):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if not isinstance(statistic, str):
        raise TypeError(f"statistic: expected one of {reference.EDM_STATISTICS}, got {type(statistic).__name__}")
    if isinstance(sigmas, torch.Tensor):
        sigmas = sigmas.tolist()
    if not isinstance(sigmas, (list, tuple)):
        raise TypeError(f"sigmas: expected a list of floats, got {type(sigmas).__name__}")
    return edm_score_op(x, mean, inv_scale, noise, level_weights, level_bias, w_in, w1, b1, w2, b2, w_out, b_out,
                        [float(s) if isinstance(s, int) and not isinstance(s, bool) else s for s in sigmas],
                        sigma_data, statistic, backends.implementation_arg(implementation))


# ---- self-test cases ----

def mahalanobis_inputs(gen, dtype, device, b=257, d=127, c=3):
    """Features around class means, and a whitener of a well-conditioned covariance."""
    means = torch.randn(c, d, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, c, (b,), generator=gen)
    x = means[labels] + torch.randn(b, d, generator=gen, dtype=torch.float64)
    factor = torch.randn(d, d, generator=gen, dtype=torch.float64) / d**0.5 + torch.eye(d, dtype=torch.float64)
    whitener = torch.linalg.qr(factor).R.T.contiguous() if d > 1 else factor
    param = torch.float64 if dtype == torch.float64 else torch.float32
    return x.to(device, dtype), means.to(device, param), whitener.to(device, param)


def edm_inputs(gen, dtype, device, b=9, d=13, h=20, blocks=2, levels=3):
    """Features and a random denoiser of moderate gain, in ``EDM_TENSORS`` order after ``x``."""
    def randn(*size, scale=1.0):
        return torch.randn(*size, generator=gen, dtype=torch.float64) * scale

    x = randn(b, d) * 2 + 0.5
    params = [randn(d) * 2, randn(d).abs() * 0.5 + 0.25, randn(levels, d), randn(levels).abs() + 0.1,
              randn(levels, h), randn(d, h, scale=d**-0.5), randn(blocks, h, h, scale=h**-0.5),
              randn(blocks, h, scale=0.1), randn(blocks, h, h, scale=h**-0.5), randn(blocks, h, scale=0.1),
              randn(h, d, scale=h**-0.5), randn(d, scale=0.1)]
    param = torch.float64 if dtype == torch.float64 else torch.float32
    return (x.to(device, dtype), *(p.to(device, param) for p in params))


EDM_SIGMA_DATA = 0.8


def edm_sigmas(levels: int) -> list[float]:
    """Noise levels from 0.2 up by factors of 3."""
    return [0.2 * 3**i for i in range(levels)]


def edm_denoise_score(x, *params, implementation=None):
    """``edm_score`` of :func:`edm_inputs`' tensors: the ``denoise`` statistic at :func:`edm_sigmas`' levels."""
    return edm_score(x, *params, edm_sigmas(params[2].shape[0]), EDM_SIGMA_DATA, "denoise",
                     implementation=implementation)


def _edm_definition(x, *params):
    return reference.edm_score_naive(x.double(), *(p.double() for p in params), edm_sigmas(params[2].shape[0]),
                                     EDM_SIGMA_DATA, "denoise")


def fitted_score(x, means, whitener, implementation=None):
    """:func:`mahalanobis_score_fitted` on the class terms of ``means`` (the doctor's check)."""
    center, class_proj, class_sq = _class_terms(x, means, whitener)
    return mahalanobis_score_fitted(x, center, whitener, class_proj, class_sq, implementation)


def selftest_cases() -> list[Case]:
    """The doctor's checks of this family's ops against their float64 definitions."""
    return [Case(OP, mahalanobis_inputs, mahalanobis_score, reference.mahalanobis_score_naive),
            Case(FITTED_OP, mahalanobis_inputs, fitted_score, reference.mahalanobis_score_naive),
            Case(EDM_OP, edm_inputs, edm_denoise_score, _edm_definition)]

"""Quantized attention: ``quantized_attention`` (SageAttention's API) and ``quantized_sdpa``
(``scaled_dot_product_attention``'s signature).

Two ops, ``torch.ops.torch_kernels.quantized_attention`` (the quantized forward, ``[B, H, N, D]``
inputs, returning the output and the log-sum-exp) and ``quantized_attention_backward`` (the
gradient of exact attention, FlashAttention-2 style). The forward is quantized and the backward
is not: a straight-through estimator, so models train through the op. The numbers (quantization
groups, scales, smoothing, the online softmax) are defined in
``torch_kernels.reference.quantized_attention``.

Kernels: the reference and those registered below, among them Triton's
(``triton_impl.quantized_attention``: INT8 ``tl.dot``, FP8 P.V on compute capability 8.9+,
FlashAttention-2 backward kernels; head sizes 64, 96 and 128, other calls declined to the next
backend) and Pallas's (``jax_impl.quantized_attention``: INT8 dots on the MXU with int32
accumulation, FlashAttention-2 backward kernels, under ``jax.custom_vjp``; CPU tensors run it in
TPU interpret mode, torchax tensors on the TPU; the same head sizes) and SYCL's
(``oneapi_impl.quantized_attention``: OpenCL C kernels with int32-exact int8 dot products, fp8
emulated bit for bit, FlashAttention-2-style backward kernels; CPU tensors on the ``opencl:cpu``
SYCL device; head sizes 1 to 256). A backend is registered only once its module exists: a lazy
``"module:function"`` for a missing module would raise ``ModuleNotFoundError`` (not
``NotImplementedError``) wherever that backend is available, instead of falling back.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Sequence

import torch
import torch.nn.functional as F

from .. import _checks, backends
from .._library import define, io_bytes, register_cost
from ..families import Case
from ..reference import quantized_attention as reference

__all__ = ["quantized_attention", "quantized_sdpa"]

OP = "quantized_attention"
BACKWARD_OP = "quantized_attention_backward"
backends.register(OP, "reference", reference.quantized_attention)
backends.register(OP, "pallas", "torch_kernels.pallas.quantized_attention:pallas_quantized_attention")
backends.register(OP, "triton", "triton_impl.quantized_attention:quantized_attention")
backends.register(OP, "sycl", "oneapi_impl.quantized_attention:quantized_attention")
backends.register(BACKWARD_OP, "reference", reference.attention_backward)
backends.register(BACKWARD_OP, "pallas", "torch_kernels.pallas.quantized_attention:pallas_quantized_attention_backward")
backends.register(BACKWARD_OP, "triton", "triton_impl.quantized_attention:quantized_attention_backward")
backends.register(BACKWARD_OP, "sycl", "oneapi_impl.quantized_attention:quantized_attention_backward")

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
LAYOUTS = ("HND", "NHD")
GRANULARITIES = reference.GRANULARITIES
PV_DTYPES = reference.PV_DTYPES


def _device_type(t: torch.Tensor) -> str:
    return "cpu" if t.is_cpu else t.device.type


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


# ---- checks ----

def _check_bool(name: str, flag) -> None:
    if not isinstance(flag, bool):
        raise TypeError(f"{name}: expected a bool, got {type(flag).__name__} {flag!r}")


def check_options(*, granularity="per_block", pv_dtype="fp16", smooth_k=True, smooth_q=True) -> None:
    """Checks the quantization options (no tensor read; one not given is its default); errors name
    the argument."""
    _check_bool("smooth_k", smooth_k)
    _check_bool("smooth_q", smooth_q)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if pv_dtype not in PV_DTYPES:
        raise ValueError(f"pv_dtype: expected one of {PV_DTYPES}, got {pv_dtype!r}")


@_checks.remembers_layouts
def check_inputs(q, k, v, *, causal, sm_scale, granularity, pv_dtype, smooth_k, cu_seqlens_q, cu_seqlens_k,
                 smooth_q=True, layout="HND", names=("q", "k", "v")) -> None:
    """Types, shapes, dtypes, devices and options (no data read); errors name the argument."""
    qn, kn, vn = names
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    dims = "[B, H, N, D]" if layout == "HND" else "[B, N, H, D]"
    h_dim, n_dim = (1, 2) if layout == "HND" else (2, 1)
    for name, t in ((qn, q), (kn, k), (vn, v)):
        _checks.tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dimensions {dims} (layout {layout!r}), got shape {tuple(t.shape)}")
    _checks.tensor(qn, q, dtypes=INPUT_DTYPES)
    for name, t in ((kn, k), (vn, v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} (as {qn}), got {t.dtype}")
    _checks.size(kn, 0, k.shape[0], q.shape[0], f"batch B of {qn}")
    _checks.size(kn, 3, k.shape[3], q.shape[3], f"head size D of {qn}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"{vn}: expected shape {tuple(k.shape)} (as {kn}), got {tuple(v.shape)}")
    heads, kv_heads, head_size = q.shape[h_dim], k.shape[h_dim], q.shape[3]
    if head_size == 0:
        raise ValueError(f"{qn}: expected a non-empty head size D, got shape {tuple(q.shape)}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{kn}: expected a number of heads dividing {qn}'s {heads} (GQA/MQA) in dimension {h_dim}, "
                         f"got {kv_heads}")
    _check_bool("causal", causal)
    if sm_scale is not None:  # None: the public functions' default, D ** -0.5 (D > 0 checked above)
        if not _is_real(sm_scale):
            raise TypeError(f"sm_scale: expected a float or None, got {type(sm_scale).__name__} {sm_scale!r}")
        if not abs(sm_scale) < math.inf:  # not math.isfinite: that breaks the graph on a symbolic float
            raise ValueError(f"sm_scale: expected a finite number, got {sm_scale!r}")
    check_options(granularity=granularity, pv_dtype=pv_dtype, smooth_k=smooth_k, smooth_q=smooth_q)
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError(f"cu_seqlens_q, cu_seqlens_k: expected both or neither, got "
                         f"{type(cu_seqlens_q).__name__} and {type(cu_seqlens_k).__name__}")
    present = {}
    if cu_seqlens_q is not None:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            _checks.tensor(name, cu, ndim=1, dtypes=INDEX_DTYPES)
            if cu.shape[0] < 2:
                raise ValueError(f"{name}: expected at least two offsets [0, N], got shape {tuple(cu.shape)}")
            present[name] = cu
        _checks.size("cu_seqlens_k", 0, cu_seqlens_k.shape[0], cu_seqlens_q.shape[0], "sequences + 1 of cu_seqlens_q")
        if q.shape[0] != 1:
            raise ValueError(f"cu_seqlens_q: packed sequences need batch size 1, got {qn} of shape {tuple(q.shape)}")
    _checks.same_device(**{qn: q, kn: k, vn: v}, **present)


def check_lengths(cu_seqlens_q, cu_seqlens_k, nq: int, nk: int, checks: _checks.ValueChecks | None = None):
    """Offsets start at 0, never decrease and end at the packed lengths.

    Returns ``(cu_seqlens_q, cu_seqlens_k, offsets_bad)`` for the kernels: as given in full mode
    (``offsets_bad`` None); in deferred mode each made safe (clamped into ``[0, N]``,
    non-decreasing, from 0 to N) and ``offsets_bad`` a 0-dim flag: the outputs must then be NaN, as
    the sequences' rows cannot be told apart. Without ``checks``, checks fully now (one host read)."""
    if cu_seqlens_q is None:
        return None, None, None
    own = checks is None
    checks = checks or _checks.ValueChecks(cu_seqlens_q.device, "full")
    cu_q, bad_q = _checks.packed_offsets("cu_seqlens_q", cu_seqlens_q, nq, f"the {nq} packed tokens", checks)
    cu_k, bad_k = _checks.packed_offsets("cu_seqlens_k", cu_seqlens_k, nk, f"the {nk} packed tokens", checks)
    if own:
        checks.finish()
    return cu_q, cu_k, None if bad_q is None else bad_q | bad_k


def _index(cu):
    return None if cu is None else cu.long().contiguous()


# ---- forward ----

_DEFAULTS = (False, "per_block", "fp16", True, None, None, None, True)  # the schema's, from causal on


def _forward_args(args):
    q, k, v, sm_scale = args[:4]
    return (q, k, v, sm_scale) + tuple(args[4:]) + _DEFAULTS[len(args) - 4:]


def _forward_kernel(*args):
    q, k, v, sm_scale, causal, granularity, pv_dtype, smooth_k, cu_q, cu_k, implementation, smooth_q = \
        _forward_args(args)
    check_inputs(q, k, v, causal=causal, sm_scale=sm_scale, granularity=granularity, pv_dtype=pv_dtype,
                 smooth_k=smooth_k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, smooth_q=smooth_q)
    cu_q, cu_k, offsets_bad = _checks.checked(q.device, check_lengths, cu_q, cu_k, q.shape[2], k.shape[2],
                                              backend=backends.planned(OP, _device_type(q), implementation))
    q, k, v = (t.detach().contiguous() for t in (q, k, v))
    cu_q, cu_k = _index(cu_q), _index(cu_k)
    # once here, so every backend smooths with the same numbers
    k_mean, q_mean, key_bias = reference.smoothing(q, k, float(sm_scale), smooth_q, smooth_k, cu_q, cu_k)
    # float16 P.V: V beyond float16's range would round to inf (NaN rows), so every backend gets it
    # divided by a power of two (1 where it fits, so results in range are unchanged) and the
    # output is multiplied back, both exact; float16 inputs always fit
    fits = pv_dtype != "fp16" or v.dtype == torch.float16 or v.numel() == 0
    scale = None if fits else reference.value_scale(v, cu_k)
    if scale is not None:
        v = v / reference.per_token(scale, cu_k, v.shape[2]).to(v.dtype)
    out, lse = backends.dispatch(OP, _device_type(q), implementation, q, k, v, k_mean, q_mean, key_bias,
                                 float(sm_scale), causal, granularity, pv_dtype, cu_q, cu_k)
    if scale is not None:
        scale = scale.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # per query head
        out = out * reference.per_token(scale, cu_q, q.shape[2]).to(out.dtype)
    return _checks.nan_where(offsets_bad, out, lse)


def _forward_fake(*args):
    q, k, v, sm_scale, causal, granularity, pv_dtype, smooth_k, cu_q, cu_k, _, smooth_q = _forward_args(args)
    check_inputs(q, k, v, causal=causal, sm_scale=sm_scale, granularity=granularity, pv_dtype=pv_dtype,
                 smooth_k=smooth_k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, smooth_q=smooth_q)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(q.shape[:3], dtype=torch.float32))


def _backward_order(t: torch.Tensor, implementation) -> str | None:
    """The backends the backward tries: those chosen at forward time, if chosen explicitly."""
    order, explicit = backends.resolve(_device_type(t), implementation)
    return ",".join(order) if explicit else None


def _setup(ctx, inputs, output):
    q, k, v, sm_scale, causal, _, _, _, cu_q, cu_k, implementation, _ = _forward_args(tuple(inputs))
    ctx.save_for_backward(q, k, v, cu_q, cu_k)
    ctx.sm_scale, ctx.causal = sm_scale, causal
    ctx.implementation = _backward_order(q, implementation)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = quantized_attention_backward_op(grad_out, grad_lse, q, k, v, ctx.sm_scale, ctx.causal, cu_q, cu_k,
                                                 ctx.implementation)
    return (dq, dk, dv) + (None,) * 9


# ---- backward ----

def _backward_kernel(grad_out, grad_lse, q, k, v, sm_scale, causal, cu_q=None, cu_k=None, implementation=None):
    cu_q, cu_k, offsets_bad = _checks.checked(q.device, check_lengths, cu_q, cu_k, q.shape[2], k.shape[2],
                                              backend=backends.planned(BACKWARD_OP, _device_type(q), implementation))
    prep = lambda t: None if t is None else t.detach().contiguous()  # noqa: E731
    grads = backends.dispatch(BACKWARD_OP, _device_type(q), implementation, prep(grad_out).to(q.dtype),
                              prep(grad_lse), prep(q), prep(k), prep(v), float(sm_scale), causal, _index(cu_q),
                              _index(cu_k))
    return _checks.nan_where(offsets_bad, *grads)


def _backward_fake(grad_out, grad_lse, q, k, v, sm_scale, causal, cu_q=None, cu_k=None, implementation=None):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


quantized_attention_backward_op = define(
    "quantized_attention_backward(Tensor grad_out, Tensor? grad_lse, Tensor q, Tensor k, Tensor v, float sm_scale, "
    "bool causal, Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, str? implementation=None) "
    "-> (Tensor, Tensor, Tensor)",
    _backward_kernel, _backward_fake)

quantized_attention_op = define(
    "quantized_attention(Tensor q, Tensor k, Tensor v, float sm_scale, bool causal=False, "
    "str granularity=\"per_block\", str pv_dtype=\"fp16\", bool smooth_k=True, Tensor? cu_seqlens_q=None, "
    "Tensor? cu_seqlens_k=None, str? implementation=None, bool smooth_q=True) -> (Tensor, Tensor)",
    _forward_kernel, _forward_fake, setup_context=_setup, backward=_backward)


# ---- FLOP and byte formulas ----

def visible_pairs(nq: int, nk: int, causal: bool) -> int:
    """How many (query, key) pairs one sequence attends over (bottom-right causal)."""
    if not causal:
        return nq * nk
    # query i sees max(0, i + nk - nq + 1) keys: the last t = min(nq, nk) rows see nk - t + 1, ..., nk
    t = min(nq, nk)
    return t * (nk - t) + t * (t + 1) // 2


def _lengths(q, k, cu_q, cu_k) -> list[tuple[int, int]]:
    if cu_q is None:
        return [(q.shape[2], k.shape[2])] * q.shape[0]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(cq[s + 1] - cq[s], ck[s + 1] - ck[s]) for s in range(len(cq) - 1)]


def quantized_attention_flops(num_q_heads: int, head_size: int, lengths, causal: bool) -> int:
    """QK^T and P.V over the visible pairs, ``4 Hq D`` per pair; ``lengths`` is ``[(Nq, Nk)]`` per sequence."""
    return 4 * num_q_heads * head_size * sum(visible_pairs(nq, nk, causal) for nq, nk in lengths)


def quantized_attention_bytes(num_q_heads: int, num_kv_heads: int, head_size: int, lengths, itemsize: int) -> int:
    """What a forward must move at least: q, k, v read once, the output written, the float32 lse."""
    tokens_q = sum(nq for nq, _ in lengths)
    tokens_k = sum(nk for _, nk in lengths)
    inputs_and_output = (2 * tokens_q * num_q_heads + 2 * tokens_k * num_kv_heads) * head_size * itemsize
    return inputs_and_output + 4 * tokens_q * num_q_heads


def _forward_flops(a, out) -> int:
    return quantized_attention_flops(a.q.shape[1], a.q.shape[3], _lengths(a.q, a.k, a.cu_seqlens_q, a.cu_seqlens_k),
                                     a.causal)


# q, k, v (and the offsets) read once, the outputs written: quantized_attention_bytes, for the forward
register_cost(quantized_attention_op, flops=_forward_flops, bytes=io_bytes)
# recompute QK^T, then dV, dP, dQ, dK: five products to the forward's two (FlashAttention-2's 2.5x)
register_cost(quantized_attention_backward_op, bytes=io_bytes, flops=lambda a, out: 5 * _forward_flops(a, out) // 2)


# ---- public API ----

def quantized_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    sm_scale: float | None = None,
    layout: str = "HND",
    granularity: str = "per_block",
    pv_dtype: str = "fp16",
    smooth_k: bool = True,
    smooth_q: bool = True,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    return_lse: bool = False,
    implementation: str | Sequence[str] | None = None,
):
    """Softmax attention with INT8 ``Q K^T`` and a low-precision ``P V`` (SageAttention's recipe).

    Queries and keys are quantized to INT8 with one float32 scale per group of rows, both first
    smoothed (each one's per-channel mean over the sequence's tokens subtracted: for K this leaves
    the softmax unchanged, for Q the subtracted part returns as an exact per-key bias); ``Q K^T`` is exact in int32, the online softmax is
    float32 in base 2 with ``sm_scale * log2(e)`` folded into Q's scales. The groups, scales and
    rounding are fixed in ``torch_kernels.reference.quantized_attention`` so that every backend
    produces the same int8 values.

    Args:
        q: ``[B, Hq, Nq, D]`` (``layout="HND"``) or ``[B, Nq, Hq, D]`` (``"NHD"``), float16,
            bfloat16 or float32 (float32 is quantized the same way).
        k, v: ``[B, Hkv, Nk, D]`` / ``[B, Nk, Hkv, D]`` of q's dtype; ``Hq`` a multiple of ``Hkv``
            (GQA / MQA). Any head size the backend takes (the reference takes every ``D``;
            kernels decline other sizes than 64, 96 and 128 to the next backend).
        causal: query ``i`` sees key ``j`` iff ``j <= i + Nk - Nq`` (bottom-right aligned, as
            FlashAttention; rows that see no key give 0 and an lse of -inf).
        sm_scale: multiplies the scores; default ``D ** -0.5``.
        granularity: ``"per_block"`` (one scale per 128 query rows / 64 key rows),
            ``"per_warp"`` (per 32 query rows) or ``"per_thread"`` (finer: the rows one MMA
            thread holds, SageAttention 2's grouping).
        pv_dtype: ``"fp16"`` (P and V in float16, float32 accumulation flushed each tile; V
            beyond float16's range, as bfloat16 and float32 inputs may hold, is first divided by
            a power of two per sequence, kv head and channel, and the output multiplied back),
            ``"fp8"`` (V in ``float8_e4m3fn`` with per-channel scales, P in ``float8_e4m3fn``
            scaled by 448) or ``"none"`` (P.V in the inputs' precision).
        smooth_k: subtract the keys' mean first (recommended; it matters for keys with large
            per-channel offsets, as in many LLMs).
        smooth_q: quantize the queries minus their mean and add the part taken out back exactly,
            as a float32 bias per key (SageAttention 2; recommended: real queries carry per-channel
            offsets that would otherwise set the int8 scales).
        cu_seqlens_q, cu_seqlens_k: int32 (or int64) ``[S + 1]`` offsets of ``S`` packed
            sequences (FlashAttention's varlen convention) with ``B = 1``; a sequence attends
            only within itself, and its quantization groups start at its first token. In the
            deferred check mode (``torch_kernels.checks``) offsets that do not add up raise
            nothing at the call: the output, the lse and the gradients are all NaN, and
            ``torch_kernels.raise_deferred_errors()`` raises later.
        return_lse: also return the natural-log ``logsumexp`` of each row's scores, float32
            ``[B, Hq, Nq]`` in both layouts, corrected for the smoothing, so that partial results
            combine as in ring / context-parallel attention.
        implementation: a backend name or ordered list (see ``torch_kernels.backends``).

    Returns:
        The output in q's layout and dtype, and the lse if ``return_lse``.

    Backward: the gradient of exact (unquantized) attention at the same inputs, recomputed from
    the saved q, k, v with float32 accumulation, FlashAttention-2 style: a straight-through
    estimator, the quantization treated as the identity. Gradients flow through the lse too.
    Against float32 SDPA's gradients on the same inputs only the inputs' precision differs:
    relative RMSE about 5e-7 for float32 inputs, 3e-4 for float16, 2e-3 for bfloat16.

    Accuracy against float32 ``scaled_dot_product_attention`` on the same inputs (gates in
    ``tests/test_quantized_attention.py``): cosine similarity >= 0.999 and relative L1 <= 0.03
    for ``pv_dtype="fp16"`` and ``"none"`` (measured on random inputs: cosine 0.9999, relative
    L1 0.010-0.014, the int8 Q K^T's share); cosine >= 0.998 and relative L1 <= 0.06 for
    ``"fp8"`` (measured 0.9993 and 0.035, which is what rounding P and V to float8_e4m3fn's 3
    mantissa bits costs even with exact scores). A NaN or inf in a query makes every output row
    of its quantization group NaN; in a key, every row that sees its key group (its whole head
    with ``smooth_k``, through the mean); in a value, every row that attends to it (and possibly
    other rows of its head: a tile multiplies it by a zero probability, fp8 shares its channel's
    scale).

    Speed: the win is on accelerators (int8 tensor-core / MXU products). On CPU tensors the
    reference kernel runs, about 5-6x slower than float32 ``scaled_dot_product_attention`` at
    N = 1k-4k for the same accuracy target: use it there to check the quantized numbers, not for
    speed. The drop-ins (:func:`quantized_sdpa`, transformers' ``"torch_kernels_quantized"``)
    therefore run exact SDPA on CPU unless told ``force_quantized=True`` (or
    ``TORCH_KERNELS_FORCE_QUANTIZED=1``); this op always quantizes.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _checks.tensor(name, t)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__} {return_lse!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    check_inputs(q, k, v, causal=causal, sm_scale=sm_scale, granularity=granularity, pv_dtype=pv_dtype,
                 smooth_k=smooth_k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, smooth_q=smooth_q,
                 layout=layout)
    if sm_scale is None:  # after the checks: they reject D = 0
        sm_scale = q.shape[3] ** -0.5
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out, lse = quantized_attention_op(q, k, v, float(sm_scale), causal, granularity, pv_dtype, smooth_k,
                                      cu_seqlens_q, cu_seqlens_k, backends.implementation_arg(implementation),
                                      smooth_q)
    if layout == "NHD":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


# Devices whose tensors the drop-ins send to exact SDPA: there the quantized kernels cannot beat
# it (CPU: the reference, 5-6x slower than float32 SDPA at N = 1k-4k, benchmarks/quantized_attention.py).
EXACT_SDPA_DEVICES = ("cpu",)
# =1 forces the quantized path everywhere, for callers that cannot pass force_quantized (generate())
FORCE_ENV_VAR = "TORCH_KERNELS_FORCE_QUANTIZED"


def quantizing_pays(t: torch.Tensor, force_quantized: bool = False) -> bool:
    """Whether the drop-ins take the quantized path for tensors like ``t``: on devices not in
    ``EXACT_SDPA_DEVICES``, or anywhere with ``force_quantized`` or ``TORCH_KERNELS_FORCE_QUANTIZED=1``."""
    _check_bool("force_quantized", force_quantized)
    return force_quantized or _device_type(t) not in EXACT_SDPA_DEVICES or os.environ.get(FORCE_ENV_VAR) == "1"


def quantized_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
                   granularity: str = "per_block", pv_dtype: str = "fp16", smooth_k: bool = True,
                   smooth_q: bool = True, implementation: str | Sequence[str] | None = None,
                   force_quantized: bool = False):
    """``torch.nn.functional.scaled_dot_product_attention`` with :func:`quantized_attention` inside,
    for code that swaps SDPA wholesale (same signature, same ``[B, H, L, E]`` layout).

    The quantized path runs for 4-dimensional float16 / bfloat16 / float32 inputs with equal head
    sizes, no ``attn_mask``, ``dropout_p == 0``, equal query and key heads (or a multiple with
    ``enable_gqa=True``) and, with ``is_causal``, equal query and key lengths (SDPA's causal mask
    is top-left aligned, ``quantized_attention``'s bottom-right), on a device where quantizing
    pays: not on CPU, where the quantized kernel is 5-6x slower than exact SDPA (see
    :func:`quantized_attention`), unless ``force_quantized=True``. Every other call, a boolean or
    additive mask and dropout included, falls back to ``scaled_dot_product_attention`` itself,
    unquantized, which also raises SDPA's own errors. Gradients are those of
    :func:`quantized_attention`.

    Keyword-only options of the quantized path, as in :func:`quantized_attention`:
    ``granularity`` (default ``"per_block"``), ``pv_dtype`` (``"fp16"``), ``smooth_k`` and
    ``smooth_q`` (both True) and ``implementation`` (the backend or ordered list of backends);
    ``force_quantized`` takes the quantized path on CPU too (to check its numbers there; or set
    ``TORCH_KERNELS_FORCE_QUANTIZED=1``). The options are checked on every path.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        _checks.tensor(name, t)
    check_options(granularity=granularity, pv_dtype=pv_dtype, smooth_k=smooth_k, smooth_q=smooth_q)
    implementation = backends.implementation_arg(implementation)
    quantizable = (
        attn_mask is None and dropout_p == 0.0 and query.dim() == key.dim() == value.dim() == 4
        and query.dtype in INPUT_DTYPES and key.dtype == value.dtype == query.dtype
        and key.shape == value.shape and key.shape[3] == query.shape[3] and key.shape[0] == query.shape[0]
        and key.shape[1] > 0 and query.shape[3] > 0
        and (query.shape[1] == key.shape[1] or (enable_gqa and query.shape[1] % key.shape[1] == 0))
        and (not is_causal or query.shape[2] == key.shape[2])
    )
    if not (quantizing_pays(query, force_quantized) and quantizable):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    sm_scale = query.shape[3] ** -0.5 if scale is None else scale
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {type(is_causal).__name__} {is_causal!r}")
    if not _is_real(sm_scale):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__} {scale!r}")
    check_inputs(query, key, value, causal=is_causal, sm_scale=sm_scale, granularity=granularity, pv_dtype=pv_dtype,
                 smooth_k=smooth_k, cu_seqlens_q=None, cu_seqlens_k=None, smooth_q=smooth_q,
                 names=("query", "key", "value"))
    return quantized_attention_op(query, key, value, float(sm_scale), is_causal, granularity, pv_dtype, smooth_k,
                                  None, None, implementation, smooth_q)[0]


# ---- self-test cases ----

def quantized_attention_inputs(gen, dtype, device, b=2, heads=(4, 2), nq=67, nk=131, head_size=64):
    """GQA, more keys than queries (bottom-right causal), keys with per-channel offsets."""
    q = torch.randn(b, heads[0], nq, head_size, generator=gen)
    k = torch.randn(b, heads[1], nk, head_size, generator=gen) + 5 * torch.randn(1, heads[1], 1, head_size, generator=gen)
    v = torch.randn(b, heads[1], nk, head_size, generator=gen)
    return tuple(t.to(device, dtype) for t in (q, k, v))


def _selftest_run(q, k, v, implementation=None):
    # P.V in the inputs' precision: the check is then of the int8 scores and the softmax alone
    return quantized_attention(q, k, v, causal=True, pv_dtype="none", implementation=implementation)


def _selftest_definition(q, k, v):
    """The same int8 scores, one float64 softmax over the whole row."""
    sm_scale = q.shape[-1] ** -0.5
    smoothing = reference.smoothing(q, k, sm_scale, True, True)
    return reference.quantized_attention_naive(q, k, v, *smoothing, sm_scale, True, "per_block", "none")[0]


def selftest_cases() -> list[Case]:
    """The doctor's check of the int8 attention against the same scores with a float64 softmax."""
    return [Case(OP, quantized_attention_inputs, _selftest_run, _selftest_definition)]

"""The quantized_attention family on the pallas backend: the int8 attention and its backward.

CPU torch tensors: ``pallas_quantized_attention`` and ``pallas_quantized_attention_backward``, the
kernels ``torch_kernels.ops.quantized_attention`` registers. Torchax tensors:
:func:`torchax_implementations`.
"""

from __future__ import annotations

from ..ops import quantized_attention as op
from .torch_tensors import check_cpu, to_jax, to_torch
from .torchax_tensors import first_backend, schema_arguments


def _offsets(cu_seqlens_q, cu_seqlens_k):
    """Packed offsets as host ints (they decide the kernels' block layout), None where absent."""
    return [None if cu is None else tuple(cu.tolist()) for cu in (cu_seqlens_q, cu_seqlens_k)]


def _kernels(q):
    """The kernels' module, after declining what they do not take."""
    check_cpu(q)
    from jax_impl import quantized_attention

    if q.shape[3] not in quantized_attention.HEAD_SIZES:
        raise NotImplementedError(f"pallas: head size {q.shape[3]} is not supported "
                                  f"(takes {quantized_attention.HEAD_SIZES})")
    return quantized_attention


def pallas_quantized_attention(q, k, v, k_mean, q_mean, key_bias, sm_scale, causal, granularity, pv_dtype,
                               cu_seqlens_q, cu_seqlens_k):
    kernels = _kernels(q)
    cu_q, cu_k = _offsets(cu_seqlens_q, cu_seqlens_k)
    k_mean, q_mean, key_bias = (None if t is None else to_jax(t) for t in (k_mean, q_mean, key_bias))
    out, lse = kernels.quantized_attention(*map(to_jax, (q, k, v)), sm_scale, causal, granularity, pv_dtype,
                                           k_mean is not None, cu_q, cu_k, smooth_q=q_mean is not None,
                                           k_mean=k_mean, q_mean=q_mean, key_bias=key_bias)
    return to_torch(out), to_torch(lse)


def pallas_quantized_attention_backward(grad_out, grad_lse, q, k, v, sm_scale, causal, cu_seqlens_q, cu_seqlens_k):
    kernels = _kernels(q)
    grads = kernels.attention_backward(to_jax(grad_out), None if grad_lse is None else to_jax(grad_lse),
                                       *map(to_jax, (q, k, v)), sm_scale, causal, *_offsets(cu_seqlens_q, cu_seqlens_k))
    return tuple(map(to_torch, grads))


def torchax_implementations() -> dict:
    """quantized_attention and its backward op on torchax tensors (pallas: the reference backend
    is torch code), by op name.

    The forward is the kernels' ``jax.custom_vjp``, so gradients flow through it (the exact
    attention backward kernels). Packed offsets cross as host ints. The smoothing (means and key
    bias) is computed in JAX here (the op's device path computes it in torch): summation order may
    move an int8 key or query at a rounding tie by one.
    """
    from jax_impl import quantized_attention as kernels
    from torchax.interop import j2t_autograd, jax_view, torch_view

    forwards = {"pallas": j2t_autograd(torch_view(kernels.quantized_attention))}
    backwards = {"pallas": kernels.attention_backward}

    def quantized_attention(*args, **kwargs):
        q, k, v, sm_scale, causal, granularity, pv_dtype, smooth_k, cu_q, cu_k, choice, smooth_q = \
            schema_arguments(op.quantized_attention_op, args, kwargs)
        op.check_inputs(q, k, v, causal=causal, sm_scale=sm_scale, granularity=granularity, pv_dtype=pv_dtype,
                        smooth_k=smooth_k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, smooth_q=smooth_q)
        op.check_lengths(cu_q, cu_k, q.shape[2], k.shape[2])
        run = first_backend(choice, forwards)
        return run(q, k, v, float(sm_scale), causal, granularity, pv_dtype, smooth_k, *_offsets(cu_q, cu_k),
                   smooth_q=smooth_q)

    def quantized_attention_backward(*args, **kwargs):
        do, dlse, q, k, v, sm_scale, causal, cu_q, cu_k, choice = schema_arguments(
            op.quantized_attention_backward_op, args, kwargs)
        op.check_inputs(q, k, v, causal=causal, sm_scale=sm_scale, granularity="per_block", pv_dtype="fp16",
                        smooth_k=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        op.check_lengths(cu_q, cu_k, q.shape[2], k.shape[2])
        run = first_backend(choice, backwards)
        return torch_view(run(*jax_view((do, dlse, q, k, v)), float(sm_scale), causal, *_offsets(cu_q, cu_k)))

    return {op.OP: quantized_attention, op.BACKWARD_OP: quantized_attention_backward}

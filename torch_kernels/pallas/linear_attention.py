"""The linear_attention family on the pallas backend: the chunked and recurrent forms.

CPU torch tensors: ``pallas_chunk_forward``/``_backward`` (the chunked ops; ``beta=None`` is
simple GLA, a ``g`` per key channel Kimi Delta Attention)
and ``pallas_recurrent_forward``/``_backward``, the kernels
``torch_kernels.ops.linear_attention`` registers. Torchax tensors: :func:`torchax_implementations`.
"""

from __future__ import annotations

from ..ops import linear_attention as op
from .torch_tensors import check_cpu, check_no_float64, to_jax, to_torch
from .torchax_tensors import schema_arguments, torchax_implementation


def _arrays(q, k, v, g, beta, initial_state, cu_seqlens):
    """JAX arrays of the linear attention inputs (None stays None), offsets as host ints."""
    check_cpu(q)
    check_no_float64(q)
    arrays = tuple(None if t is None else to_jax(t) for t in (q, k, v, g, beta, initial_state))
    return arrays, None if cu_seqlens is None else tuple(cu_seqlens.tolist())


def _grads(grads, g, beta, initial_state):
    """Torch gradients; None for inputs that were absent."""
    present = (True, True, True, g is not None, beta is not None, initial_state is not None)
    return tuple(to_torch(grad) if grad is not None and keep else None for grad, keep in zip(grads, present))


def pallas_chunk_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    from jax_impl import linear_attention

    (q, k, v, g, beta, h0), cu = _arrays(q, k, v, g, beta, initial_state, cu_seqlens)
    if beta is None:
        o, ht = linear_attention.chunk_simple_gla(q, k, v, g, scale, h0, cu)
    elif g is not None and g.ndim == 4:
        o, ht = linear_attention.chunk_kda(q, k, v, g, beta, scale, h0, cu, use_qk_l2norm)
    else:
        o, ht = linear_attention.chunk_gated_delta_rule(q, k, v, g, beta, scale, h0, cu, use_qk_l2norm)
    return to_torch(o), to_torch(ht)


def pallas_chunk_backward(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    from jax_impl import linear_attention

    arrays, cu = _arrays(q, k, v, g, beta, initial_state, cu_seqlens)
    grads = linear_attention.chunk_backward(to_jax(do), None if dht is None else to_jax(dht), *arrays[:5], scale,
                                            arrays[5], cu, use_qk_l2norm)
    return _grads(grads, g, beta, initial_state)


def pallas_recurrent_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    from jax_impl import linear_attention

    (q, k, v, g, beta, h0), cu = _arrays(q, k, v, g, beta, initial_state, cu_seqlens)
    o, ht = linear_attention.fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, h0, cu, use_qk_l2norm)
    return to_torch(o), to_torch(ht)


def pallas_recurrent_backward(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    from jax_impl import linear_attention

    arrays, cu = _arrays(q, k, v, g, beta, initial_state, cu_seqlens)
    grads = linear_attention.recurrent_backward(to_jax(do), None if dht is None else to_jax(dht), *arrays[:5],
                                                scale, arrays[5], cu, use_qk_l2norm)
    return _grads(grads, g, beta, initial_state)


def torchax_implementations() -> dict:
    """The linear attention ops on torchax tensors, by op name, with gradients.

    The JAX functions are differentiable (the chunked kernels' ``jax.custom_vjp``; the recurrent
    form, also the reference here, is a ``lax.scan``). Packed offsets decide the kernels' chunk
    layout, so ``cu_seqlens`` crosses as host ints, not as an array that ``jax.vjp`` would trace.
    """
    from jax_impl import linear_attention as kernels

    def gla_reference(q, k, v, g, scale, initial_state, cu_seqlens):
        return kernels.fused_recurrent_gated_delta_rule(q, k, v, g, None, scale, initial_state, cu_seqlens)

    def implementation(family, pallas, reference):
        run = torchax_implementation(lambda *args: None, pallas=pallas, reference=reference)  # checked below

        def impl(*args, **kwargs):
            q, k, v, g, beta, scale, h0, cu, l2norm, choice = family._unpack(
                schema_arguments(family.forward_op, args, kwargs))
            family._check(q, k, v, g, beta, scale, h0, cu)
            op.check_values(cu, q.shape[1], g)
            offsets = None if cu is None else tuple(cu.tolist())
            head = (q, k, v, g, beta) if family.delta else (q, k, v, g)
            tail = (bool(l2norm),) if family.delta else ()
            return run(*head, float(scale), h0, offsets, *tail, choice)  # choice last: run strips it

        return impl

    recurrent = kernels.fused_recurrent_gated_delta_rule
    return {
        op.CHUNK_DELTA: implementation(op.chunk_gated_delta_rule_family, kernels.chunk_gated_delta_rule, recurrent),
        op.RECURRENT_DELTA: implementation(op.fused_recurrent_gated_delta_rule_family, recurrent, recurrent),
        op.CHUNK_GLA: implementation(op.chunk_simple_gla_family, kernels.chunk_simple_gla, gla_reference),
        # Kimi Delta Attention: the same scan with g per key channel, and the chunked forward
        op.RECURRENT_KDA: implementation(op.fused_recurrent_kda_family, recurrent, recurrent),
        op.CHUNK_KDA: implementation(op.chunk_kda_family, kernels.chunk_kda, recurrent),
    }

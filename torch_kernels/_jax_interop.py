"""Running jax_impl kernels on ordinary torch tensors (the pallas backend outside torchax).

Tensors cross by DLPack without copies where both sides allow it. On CPU this is how the tests
and the doctor exercise the Pallas kernels (in interpret mode); on a TPU, users pass torchax
tensors instead and ``torch_kernels._torchax`` calls the kernels on the JAX arrays directly.
"""

from __future__ import annotations

import torch


# DLPack has no float8 codes: these cross as uint8 and are bitcast on the JAX side
_FLOAT8 = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def to_jax(t: torch.Tensor):
    import jax.dlpack

    t = t.detach()  # DLPack refuses tensors that require grad (inference-only ops see them under no_grad)
    if t.dtype in _FLOAT8:
        return jax.lax.bitcast_convert_type(jax.dlpack.from_dlpack(t.contiguous().view(torch.uint8)), _FLOAT8[t.dtype])
    return jax.dlpack.from_dlpack(t.contiguous())


def to_torch(a) -> torch.Tensor:
    for dtype, name in _FLOAT8.items():
        if a.dtype == name:
            import jax

            return torch.from_dlpack(jax.lax.bitcast_convert_type(a, "uint8")).view(dtype)
    return torch.from_dlpack(a)


def pallas_mahalanobis_min(x, center, whitener, class_proj, class_sq):
    if x.device.type != "cpu":
        raise NotImplementedError(f"pallas: takes torchax tensors or CPU tensors, got {x.device.type}")
    from jax_impl import ood

    if x.dtype == torch.float64:
        raise NotImplementedError("pallas: float64 is not supported (TPUs have no float64)")
    score, nearest = ood.mahalanobis_min(*map(to_jax, (x, center, whitener, class_proj, class_sq)))
    return to_torch(score), to_torch(nearest).to(torch.int64)


def pallas_edm_score_levels(x, *tensors_and_scoped):
    *tensors, scoped = tensors_and_scoped
    if x.device.type != "cpu":
        raise NotImplementedError(f"pallas: takes torchax tensors or CPU tensors, got {x.device.type}")
    from jax_impl import ood

    if x.dtype == torch.float64:
        raise NotImplementedError("pallas: float64 is not supported (TPUs have no float64)")
    return to_torch(ood.edm_score_levels(*map(to_jax, (x, *tensors)), scoped=scoped))


_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8, *_FLOAT8)


def _cpu_only(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise NotImplementedError(f"pallas: takes torchax tensors or CPU tensors, got {t.device.type}")


def _check_cache_dtype(cache: torch.Tensor) -> None:
    if cache.dtype not in _CACHE_DTYPES:
        raise NotImplementedError(f"pallas: caches of dtype {cache.dtype} are not supported")


def _store_slots(cache: torch.Tensor, new, slot_mapping: torch.Tensor) -> None:
    """Copy the slots ``slot_mapping`` wrote from the kernel's updated cache ``new`` back into
    ``cache`` in place, byte for byte (NaN payloads included). JAX arrays have no strides, so a
    strided cache (any view whose last dimension is contiguous) crossed as a contiguous copy; only
    its written slots come back, so nothing else in its storage is written."""
    slots = slot_mapping[slot_mapping >= 0]
    blocks, offsets = slots // cache.shape[1], slots % cache.shape[1]
    cache.view(torch.uint8)[blocks, offsets] = to_torch(new).view(torch.uint8)[blocks, offsets]


def _slots(slot_mapping: torch.Tensor) -> torch.Tensor:
    return slot_mapping.to(torch.int32)  # JAX runs without 64-bit ints; slots fit in 32 bits


def pallas_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale) -> None:
    _cpu_only(key, key_cache)
    _check_cache_dtype(key_cache)
    from jax_impl import paged_attention

    new_k, new_v = paged_attention.reshape_and_cache(
        *map(to_jax, (key, value, key_cache, value_cache, _slots(slot_mapping), k_scale, v_scale)))
    _store_slots(key_cache, new_k, slot_mapping)
    _store_slots(value_cache, new_v, slot_mapping)


def pallas_ragged_paged_attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                                  sliding_window, soft_cap, k_scale, v_scale, key, value, slot_mapping):
    _cpu_only(query, key_cache)
    _check_cache_dtype(key_cache)
    from jax_impl import paged_attention

    new = None if key is None else (to_jax(key), to_jax(value), to_jax(_slots(slot_mapping)))
    out, new_k, new_v = paged_attention.ragged_paged_attention(
        *map(to_jax, (query, key_cache, value_cache, cu_q_lens, kv_lens, block_table)), sm_scale,
        sliding_window, soft_cap, to_jax(k_scale), to_jax(v_scale), *(new or (None, None, None)))
    if new is not None:
        _store_slots(key_cache, new_k, slot_mapping)
        _store_slots(value_cache, new_v, slot_mapping)
    return to_torch(out)


def _linear_attention_inputs(q, k, v, g, beta, initial_state, cu_seqlens):
    """JAX arrays of the linear attention inputs (None stays None), offsets as host ints."""
    _cpu_only(q)
    if q.dtype == torch.float64:
        raise NotImplementedError("pallas: float64 is not supported (TPUs have no float64)")
    arrays = tuple(None if t is None else to_jax(t) for t in (q, k, v, g, beta, initial_state))
    return arrays, None if cu_seqlens is None else tuple(cu_seqlens.tolist())


def _linear_attention_grads(grads, g, beta, initial_state):
    """Torch gradients; None for inputs that were absent."""
    present = (True, True, True, g is not None, beta is not None, initial_state is not None)
    return tuple(to_torch(grad) if grad is not None and keep else None for grad, keep in zip(grads, present))


def pallas_chunk_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    from jax_impl import linear_attention

    (q, k, v, g, beta, h0), cu = _linear_attention_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if beta is None:
        o, ht = linear_attention.chunk_simple_gla(q, k, v, g, scale, h0, cu)
    else:
        o, ht = linear_attention.chunk_gated_delta_rule(q, k, v, g, beta, scale, h0, cu, use_qk_l2norm)
    return to_torch(o), to_torch(ht)


def pallas_chunk_backward(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    from jax_impl import linear_attention

    arrays, cu = _linear_attention_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    grads = linear_attention.chunk_backward(to_jax(do), None if dht is None else to_jax(dht), *arrays[:5], scale,
                                            arrays[5], cu, use_qk_l2norm)
    return _linear_attention_grads(grads, g, beta, initial_state)


def pallas_recurrent_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    from jax_impl import linear_attention

    (q, k, v, g, beta, h0), cu = _linear_attention_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    o, ht = linear_attention.fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, h0, cu, use_qk_l2norm)
    return to_torch(o), to_torch(ht)


def pallas_recurrent_backward(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    from jax_impl import linear_attention

    arrays, cu = _linear_attention_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    grads = linear_attention.recurrent_backward(to_jax(do), None if dht is None else to_jax(dht), *arrays[:5],
                                                scale, arrays[5], cu, use_qk_l2norm)
    return _linear_attention_grads(grads, g, beta, initial_state)


# ---- mixture of experts ----

def _moe_arrays(*tensors):
    """JAX arrays of the MoE kernels' inputs (None stays None); int64 indices cross as int32
    (JAX runs without 64-bit ints; row and token counts fit in 32 bits)."""
    present = [t for t in tensors if t is not None]
    _cpu_only(*present)
    if any(t.dtype == torch.float64 for t in present):
        raise NotImplementedError("pallas: float64 is not supported (TPUs have no float64)")
    return tuple(None if t is None else to_jax(t.to(torch.int32) if t.dtype == torch.int64 else t) for t in tensors)


def _jax_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pallas_router_topk(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, correction_bias,
                       routed_scaling_factor):
    from jax_impl import moe

    logits, bias = _moe_arrays(logits, correction_bias)
    weights, ids = moe.router_topk(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, bias,
                                   routed_scaling_factor)
    return to_torch(weights), to_torch(ids)


def pallas_moe_gather(x, token_of_row):
    from jax_impl import moe

    return to_torch(moe.moe_gather(*_moe_arrays(x, token_of_row)))


def pallas_moe_combine(y, row_of_slot, weights, out_dtype):
    from jax_impl import moe

    return to_torch(moe.moe_combine(*_moe_arrays(y, row_of_slot, weights), _jax_dtype(out_dtype)))


def pallas_grouped_mm(x, w, offsets, out_dtype, w_transposed):
    from jax_impl import moe

    return to_torch(moe.grouped_mm(*_moe_arrays(x, w, offsets), _jax_dtype(out_dtype), w_transposed))


def pallas_grouped_mm_weight_grad(x, dy, offsets, num_experts, out_dtype):
    from jax_impl import moe

    return to_torch(moe.grouped_mm_weight_grad(*_moe_arrays(x, dy, offsets), num_experts, _jax_dtype(out_dtype)))


def pallas_fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets, activation, w13_scale, w2_scale,
                     block_shape):
    from jax_impl import moe

    arrays = _moe_arrays(x, w13, w2, weights, token_of_row, row_of_slot, offsets, w13_scale, w2_scale)
    return to_torch(moe.fused_moe(*arrays[:7], activation, *arrays[7:],
                                  None if block_shape is None else tuple(block_shape)))


# ---- quantized attention ----

def _quantized_attention_args(q, cu_seqlens_q, cu_seqlens_k):
    """The kernels' module, after declining what they do not take; offsets as host ints."""
    _cpu_only(q)
    from jax_impl import quantized_attention

    if q.shape[3] not in quantized_attention.HEAD_SIZES:
        raise NotImplementedError(f"pallas: head size {q.shape[3]} is not supported "
                                  f"(takes {quantized_attention.HEAD_SIZES})")
    offsets = [None if cu is None else tuple(cu.tolist()) for cu in (cu_seqlens_q, cu_seqlens_k)]
    return quantized_attention, offsets


def pallas_quantized_attention(q, k, v, k_mean, q_mean, key_bias, sm_scale, causal, granularity, pv_dtype,
                               cu_seqlens_q, cu_seqlens_k):
    kernels, (cu_q, cu_k) = _quantized_attention_args(q, cu_seqlens_q, cu_seqlens_k)
    k_mean, q_mean, key_bias = (None if t is None else to_jax(t) for t in (k_mean, q_mean, key_bias))
    out, lse = kernels.quantized_attention(*map(to_jax, (q, k, v)), sm_scale, causal, granularity, pv_dtype,
                                           k_mean is not None, cu_q, cu_k, smooth_q=q_mean is not None,
                                           k_mean=k_mean, q_mean=q_mean, key_bias=key_bias)
    return to_torch(out), to_torch(lse)


def pallas_quantized_attention_backward(grad_out, grad_lse, q, k, v, sm_scale, causal, cu_seqlens_q, cu_seqlens_k):
    kernels, (cu_q, cu_k) = _quantized_attention_args(q, cu_seqlens_q, cu_seqlens_k)
    grads = kernels.attention_backward(to_jax(grad_out), None if grad_lse is None else to_jax(grad_lse),
                                       *map(to_jax, (q, k, v)), sm_scale, causal, cu_q, cu_k)
    return tuple(map(to_torch, grads))

"""The moe family on the pallas backend: router, dispatch/combine maps, grouped GEMM, fused block.

CPU torch tensors: ``pallas_<kernel>`` for each kernel ``torch_kernels.ops.moe`` registers.
Torchax tensors: :func:`torchax_implementations`.
"""

from __future__ import annotations

import functools

import torch

from ..ops.moe import dispatch, fused, grouped_gemm, router
from .torch_tensors import check_cpu, check_no_float64, to_jax, to_torch
from .torchax_tensors import first_backend, schema_arguments


def _arrays(*tensors):
    """JAX arrays of the MoE kernels' inputs (None stays None); int64 indices cross as int32
    (JAX runs without 64-bit ints; row and token counts fit in 32 bits)."""
    present = [t for t in tensors if t is not None]
    check_cpu(*present)
    check_no_float64(*present)
    return tuple(None if t is None else to_jax(t.to(torch.int32) if t.dtype == torch.int64 else t) for t in tensors)


def _jax_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pallas_router_topk(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, correction_bias,
                       routed_scaling_factor):
    from jax_impl import moe

    logits, bias = _arrays(logits, correction_bias)
    weights, ids = moe.router_topk(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, bias,
                                   routed_scaling_factor)
    return to_torch(weights), to_torch(ids)


def pallas_moe_gather(x, token_of_row):
    from jax_impl import moe

    return to_torch(moe.moe_gather(*_arrays(x, token_of_row)))


def pallas_moe_combine(y, row_of_slot, weights, out_dtype):
    from jax_impl import moe

    return to_torch(moe.moe_combine(*_arrays(y, row_of_slot, weights), _jax_dtype(out_dtype)))


def pallas_grouped_mm(x, w, offsets, out_dtype, w_transposed):
    from jax_impl import moe

    return to_torch(moe.grouped_mm(*_arrays(x, w, offsets), _jax_dtype(out_dtype), w_transposed))


def pallas_grouped_mm_weight_grad(x, dy, offsets, num_experts, out_dtype):
    from jax_impl import moe

    return to_torch(moe.grouped_mm_weight_grad(*_arrays(x, dy, offsets), num_experts, _jax_dtype(out_dtype)))


def pallas_fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets, activation, w13_scale, w2_scale,
                     block_shape):
    from jax_impl import moe

    arrays = _arrays(x, w13, w2, weights, token_of_row, row_of_slot, offsets, w13_scale, w2_scale)
    return to_torch(moe.fused_moe(*arrays[:7], activation, *arrays[7:],
                                  None if block_shape is None else tuple(block_shape)))


def torchax_implementations() -> dict:
    """The mixture-of-experts ops on torchax tensors, by op name, with gradients.

    Each runs the op's checks, then the ``jax.custom_vjp`` form of jax_impl.moe over the Pallas
    kernels or the jnp references, whose backward composes that backend's kernels as the op
    layer's backward composes the ops. Index arrays cross as JAX arrays, so ``jax.vjp`` leaves
    them out. ``moe_dispatch`` makes its routing maps with torch ops, which torchax runs;
    ``fused_moe`` makes them with jax_impl's ``sort_by_expert``. ``grouped_mm_weight_grad`` is
    inference-only, as on other devices.
    """
    import jax
    import jax.numpy as jnp
    from jax_impl import moe as kernels
    from torchax.interop import j2t_autograd, jax_view, torch_view

    by_backend = {"pallas": kernels.PALLAS, "reference": kernels.REFERENCE}
    int64_element = torch.zeros(1, dtype=torch.int64)  # made here: in the environment, constructors make JAX arrays
    no_int64 = jax.dtypes.canonicalize_dtype(jnp.int64) == jnp.int32

    def differentiable(form):
        return {name: j2t_autograd(torch_view(functools.partial(form, ks))) for name, ks in by_backend.items()}

    routers = differentiable(kernels.differentiable_router_topk)
    gathers = differentiable(kernels.differentiable_moe_gather)
    combines = differentiable(kernels.differentiable_moe_combine)
    grouped = differentiable(kernels.differentiable_grouped_mm)
    fused_blocks = differentiable(kernels.differentiable_fused_moe)
    weight_grads = {name: ks.grouped_mm_weight_grad for name, ks in by_backend.items()}

    def router_topk(*args, **kwargs):
        logits, top_k, scoring, renormalize, groups, topk_groups, bias, scale, choice = schema_arguments(
            router.router_topk_op, args, kwargs)
        router._check_router(logits, top_k, scoring, renormalize, groups, topk_groups, bias, scale)
        return first_backend(choice, routers)(logits, jax_view(bias), top_k, scoring, renormalize, groups,
                                              topk_groups, float(scale))

    def int64_stand_in(t):
        """JAX without x64 holds int64 as int32 (the maps moe_dispatch made with ``.long()``): the
        int64 checks see an int64 tensor of t's shape, one element expanded, for such a map."""
        if no_int64 and t.dtype == torch.int32:
            return int64_element.view((1,) * t.dim()).expand(t.shape)
        return t

    def check_routing_map(token_of_row, row_of_slot, rows):
        dispatch._check_routing_map(int64_stand_in(token_of_row), int64_stand_in(row_of_slot), rows)

    def moe_gather(*args, **kwargs):
        x, token_of_row, row_of_slot, choice = schema_arguments(dispatch.moe_gather_op, args, kwargs)
        check_routing_map(token_of_row, row_of_slot, token_of_row.shape[0])
        return first_backend(choice, gathers)(x, *jax_view((token_of_row, row_of_slot)))

    def moe_combine(*args, **kwargs):
        y, token_of_row, row_of_slot, weights, choice = schema_arguments(dispatch.moe_combine_op, args, kwargs)
        check_routing_map(token_of_row, row_of_slot, y.shape[0])
        return first_backend(choice, combines)(y, *jax_view((token_of_row, row_of_slot)), weights)

    def grouped_mm(*args, **kwargs):
        x, w, offsets, out_dtype, choice = schema_arguments(grouped_gemm.grouped_mm_op, args, kwargs)
        grouped_gemm._check_grouped(x, w, offsets, out_dtype)
        grouped_gemm.check_offsets(offsets, x.shape[0])
        return first_backend(choice, grouped)(x, w, jax_view(offsets), jax_view(out_dtype or x.dtype))

    def grouped_mm_weight_grad(*args, **kwargs):
        x, dy, offsets, num_experts, out_dtype, choice = schema_arguments(
            grouped_gemm.grouped_mm_weight_grad_op, args, kwargs)
        kernel = first_backend(choice, weight_grads)
        return torch_view(kernel(*jax_view((x, dy, offsets)), num_experts, jax_view(out_dtype)))

    def fused_moe(*args, **kwargs):
        x, w13, w2, weights, ids, activation, w13_scale, w2_scale, block_shape, choice = schema_arguments(
            fused.fused_moe_op, args, kwargs)
        fused._check_fused(x, w13, w2, weights, ids, activation, w13_scale, w2_scale, block_shape)
        dispatch.check_ids_range(ids, w13.shape[0])
        run = first_backend(choice, fused_blocks)
        maps = kernels.sort_by_expert(jax_view(ids), w13.shape[0])
        experts = (w13, w2) if w13_scale is None else jax_view((w13, w2))  # float8 weights get no gradient
        return run(x, *experts, weights, *maps, activation, *jax_view((w13_scale, w2_scale)),
                   None if block_shape is None else tuple(block_shape))

    return {router.ROUTER: router_topk, dispatch.GATHER: moe_gather, dispatch.COMBINE: moe_combine,
            grouped_gemm.GROUPED_MM: grouped_mm, grouped_gemm.WEIGHT_GRAD: grouped_mm_weight_grad,
            fused.FUSED: fused_moe}

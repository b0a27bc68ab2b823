"""The torchax bridge: torch_kernels ops on torchax ('jax') tensors run their JAX kernels.

Importing torchax registers a 'jax' device with torch for the whole process, so this module is
imported only when torchax tensors are wanted, never by ``import torch_kernels``.

``register(env)`` installs, for each op, a function that takes the torchax tensors' JAX arrays,
runs the jax_impl kernel (Pallas) on them and wraps the result back, with gradients from the
kernel's ``jax.custom_vjp``; ops that write a KV cache point the cache's torchax tensor at the
updated array. ``environment()`` imports torchax, works around its import failure on
recent torch, and returns its default environment with the ops registered.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_REMOVED_OVERLOAD_MARKERS = ("dimname", "names")


class _RemovedOverload:
    """Stands in for an operator overload that this torch no longer has."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<overload {self.name} removed from torch>"

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} does not exist in torch {torch.__version__}")


def _needs_import_shim(torch_version: str | None = None, torchax_version: str | None = None) -> bool:
    """torchax <= 0.0.13 names the named-tensor overloads that torch 2.13 removed."""
    from importlib.metadata import version

    from packaging.version import Version

    torch_version = torch_version or torch.__version__
    torchax_version = torchax_version or version("torchax")
    return Version(torch_version.split("+")[0]) >= Version("2.13") and Version(torchax_version) <= Version("0.0.13")


@contextlib.contextmanager
def _removed_overloads_resolve():
    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__

    def getattr_or_placeholder(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if any(marker in key.lower() for marker in _REMOVED_OVERLOAD_MARKERS):
                return _RemovedOverload(f"{self._qualified_op_name}.{key}")
            raise

    packet.__getattr__ = getattr_or_placeholder
    try:
        yield
    finally:
        packet.__getattr__ = original


@functools.cache
def environment():
    """torchax's default environment with every torch_kernels op registered."""
    shim = _removed_overloads_resolve() if _needs_import_shim() else contextlib.nullcontext()
    with shim:
        import torchax

        env = torchax.default_env()  # loads torchax's op tables, which name the removed overloads
    register(env)
    return env


def _jax_implementations(check, **by_backend):
    """One op implementation for torchax tensors from JAX functions of arrays, by backend name.

    ``check(*tensors)`` validates the inputs as the op's device kernels do; the backend comes from
    ``implementation=``, ``use_backend``, ``TORCH_KERNELS_BACKEND`` or the default (pallas).
    """
    from torchax.interop import j2t_autograd, torch_view

    wrapped = {name: j2t_autograd(torch_view(fn)) for name, fn in by_backend.items()}

    def impl(*args, implementation=None):
        if args and (args[-1] is None or isinstance(args[-1], str)):  # the schema's last argument
            *args, implementation = args
        check(*args)
        return _first_backend(implementation, wrapped)(*args)

    return impl


def _first_backend(implementation, by_backend: dict):
    """The first of the call's backends (``backends.resolve``) that ``by_backend`` has."""
    from . import backends

    order, _ = backends.resolve("jax", implementation)
    for name in order:
        if name in by_backend:
            return by_backend[name]
    raise NotImplementedError(f"implementation: torchax tensors run {sorted(by_backend)}, not {','.join(order)!r}")


def _paged_attention_implementations():
    """The torchax implementations of reshape_and_cache and ragged_paged_attention.

    Both write the caches: JAX arrays are immutable, so the kernels return updated caches and the
    caches' torchax tensors are pointed at them (a torchax tensor keeps its array in ``_elem``).
    Inference only: no gradients.
    """
    from jax_impl import paged_attention as kernels
    from torchax.interop import jax_view, torch_view

    from .ops import paged_attention as op

    writes = {"pallas": kernels.reshape_and_cache, "reference": kernels.reshape_and_cache_reference}
    attentions = {"pallas": kernels.ragged_paged_attention, "reference": kernels.ragged_paged_attention_reference}

    def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale=None, v_scale=None,
                          implementation=None):
        op.check_write_inputs(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
        op.check_slots(slot_mapping, key_cache, k_scale, v_scale)
        write = _first_backend(implementation, writes)
        key_cache._elem, value_cache._elem = write(
            *jax_view((key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)))

    def ragged_paged_attention(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale,
                               sliding_window=None, soft_cap=None, k_scale=None, v_scale=None, key=None,
                               value=None, slot_mapping=None, implementation=None):
        op.check_inputs(query, key_cache, value_cache, cu_q_lens, kv_lens, block_table, sm_scale, sliding_window,
                        soft_cap, k_scale, v_scale, key, value, slot_mapping)
        op.check_lengths(query, key_cache, cu_q_lens, kv_lens, block_table, k_scale, v_scale)
        if key is not None:
            op.check_slots(slot_mapping, key_cache)
        attention = _first_backend(implementation, attentions)
        out, new_k, new_v = attention(
            *jax_view((query, key_cache, value_cache, cu_q_lens, kv_lens, block_table)), float(sm_scale),
            sliding_window, None if soft_cap is None else float(soft_cap),
            *jax_view((k_scale, v_scale, key, value, slot_mapping)))
        if key is not None:
            key_cache._elem, value_cache._elem = new_k, new_v
        return torch_view(out)

    return reshape_and_cache, ragged_paged_attention


def _linear_attention_implementations():
    """The torchax implementations of the linear attention ops, by op name, with gradients.

    The JAX functions are differentiable (the chunked kernels' ``jax.custom_vjp``; the recurrent
    form, also the reference here, is a ``lax.scan``). Packed offsets decide the kernels' chunk
    layout, so ``cu_seqlens`` crosses as host ints, not as an array that ``jax.vjp`` would trace.
    Arguments the caller left at their defaults are filled in from the schema.
    """
    from jax_impl import linear_attention as kernels

    from .ops import linear_attention as op

    def gla_reference(q, k, v, g, scale, initial_state, cu_seqlens):
        return kernels.fused_recurrent_gated_delta_rule(q, k, v, g, None, scale, initial_state, cu_seqlens)

    def implementation(family, pallas, reference):
        arguments = family.forward_op._schema.arguments
        defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}
        run = _jax_implementations(lambda *args: None, pallas=pallas, reference=reference)  # checked below

        def impl(*args, **kwargs):
            args = list(args) + [kwargs.get(a.name, defaults.get(a.name)) for a in arguments[len(args):]]
            q, k, v, g, beta, scale, h0, cu, l2norm, choice = family._unpack(args)
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
    }


def _schema_arguments(overload, args, kwargs) -> list:
    """Every schema argument of a call to ``overload``, those left out at their defaults."""
    arguments = overload._schema.arguments
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}
    return list(args) + [kwargs.get(a.name, defaults.get(a.name)) for a in arguments[len(args):]]


def _moe_implementations():
    """The torchax implementations of the mixture-of-experts ops, by op name, with gradients.

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

    from .ops import moe as op

    by_backend = {"pallas": kernels.PALLAS, "reference": kernels.REFERENCE}
    int64_element = torch.zeros(1, dtype=torch.int64)  # made here: in the environment, constructors make JAX arrays
    no_int64 = jax.dtypes.canonicalize_dtype(jnp.int64) == jnp.int32

    def differentiable(form):
        return {name: j2t_autograd(torch_view(functools.partial(form, ks))) for name, ks in by_backend.items()}

    routers = differentiable(kernels.differentiable_router_topk)
    gathers = differentiable(kernels.differentiable_moe_gather)
    combines = differentiable(kernels.differentiable_moe_combine)
    grouped = differentiable(kernels.differentiable_grouped_mm)
    fused = differentiable(kernels.differentiable_fused_moe)
    weight_grads = {name: ks.grouped_mm_weight_grad for name, ks in by_backend.items()}

    def router_topk(*args, **kwargs):
        logits, top_k, scoring, renormalize, groups, topk_groups, bias, scale, choice = _schema_arguments(
            op.router_topk_op, args, kwargs)
        op._check_router(logits, top_k, scoring, renormalize, groups, topk_groups, bias, scale)
        return _first_backend(choice, routers)(logits, jax_view(bias), top_k, scoring, renormalize, groups,
                                               topk_groups, float(scale))

    def int64_stand_in(t):
        """JAX without x64 holds int64 as int32 (the maps moe_dispatch made with ``.long()``): the
        int64 checks see an int64 tensor of t's shape, one element expanded, for such a map."""
        if no_int64 and t.dtype == torch.int32:
            return int64_element.view((1,) * t.dim()).expand(t.shape)
        return t

    def check_routing_map(token_of_row, row_of_slot, rows):
        op._check_routing_map(int64_stand_in(token_of_row), int64_stand_in(row_of_slot), rows)

    def moe_gather(*args, **kwargs):
        x, token_of_row, row_of_slot, choice = _schema_arguments(op.moe_gather_op, args, kwargs)
        check_routing_map(token_of_row, row_of_slot, token_of_row.shape[0])
        return _first_backend(choice, gathers)(x, *jax_view((token_of_row, row_of_slot)))

    def moe_combine(*args, **kwargs):
        y, token_of_row, row_of_slot, weights, choice = _schema_arguments(op.moe_combine_op, args, kwargs)
        check_routing_map(token_of_row, row_of_slot, y.shape[0])
        return _first_backend(choice, combines)(y, *jax_view((token_of_row, row_of_slot)), weights)

    def grouped_mm(*args, **kwargs):
        x, w, offsets, out_dtype, choice = _schema_arguments(op.grouped_mm_op, args, kwargs)
        op._check_grouped(x, w, offsets, out_dtype)
        op.check_offsets(offsets, x.shape[0])
        return _first_backend(choice, grouped)(x, w, jax_view(offsets), jax_view(out_dtype or x.dtype))

    def grouped_mm_weight_grad(*args, **kwargs):
        x, dy, offsets, num_experts, out_dtype, choice = _schema_arguments(op.grouped_mm_weight_grad_op, args,
                                                                             kwargs)
        kernel = _first_backend(choice, weight_grads)
        return torch_view(kernel(*jax_view((x, dy, offsets)), num_experts, jax_view(out_dtype)))

    def fused_moe(*args, **kwargs):
        x, w13, w2, weights, ids, activation, w13_scale, w2_scale, block_shape, choice = _schema_arguments(
            op.fused_moe_op, args, kwargs)
        op._check_fused(x, w13, w2, weights, ids, activation, w13_scale, w2_scale, block_shape)
        op.check_ids_range(ids, w13.shape[0])
        run = _first_backend(choice, fused)
        maps = kernels.sort_by_expert(jax_view(ids), w13.shape[0])
        experts = (w13, w2) if w13_scale is None else jax_view((w13, w2))  # float8 weights get no gradient
        return run(x, *experts, weights, *maps, activation, *jax_view((w13_scale, w2_scale)),
                   None if block_shape is None else tuple(block_shape))

    return {op.ROUTER: router_topk, op.GATHER: moe_gather, op.COMBINE: moe_combine, op.GROUPED_MM: grouped_mm,
            op.WEIGHT_GRAD: grouped_mm_weight_grad, op.FUSED: fused_moe}


def _quantized_attention_implementations():
    """The torchax implementations of quantized_attention and its backward op (pallas: the
    reference backend is torch code), by op name.

    The forward is the kernels' ``jax.custom_vjp``, so gradients flow through it (the exact
    attention backward kernels). Packed offsets decide the kernels' block layout: they cross as
    host ints. The smoothing (means and key bias) is computed in JAX here (the op's device path
    computes it in torch): summation order may move an int8 key or query at a rounding tie by one.
    """
    from jax_impl import quantized_attention as kernels
    from torchax.interop import j2t_autograd, jax_view, torch_view

    from .ops import quantized_attention as op

    forwards = {"pallas": j2t_autograd(torch_view(kernels.quantized_attention))}
    backwards = {"pallas": kernels.attention_backward}

    def offsets(cu_q, cu_k):
        return [None if cu is None else tuple(cu.tolist()) for cu in (cu_q, cu_k)]

    def quantized_attention(*args, **kwargs):
        q, k, v, sm_scale, causal, granularity, pv_dtype, smooth_k, cu_q, cu_k, choice, smooth_q = \
            _schema_arguments(op.quantized_attention_op, args, kwargs)
        op.check_inputs(q, k, v, causal=causal, sm_scale=sm_scale, granularity=granularity, pv_dtype=pv_dtype,
                        smooth_k=smooth_k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, smooth_q=smooth_q)
        op.check_lengths(cu_q, cu_k, q.shape[2], k.shape[2])
        run = _first_backend(choice, forwards)
        return run(q, k, v, float(sm_scale), causal, granularity, pv_dtype, smooth_k, *offsets(cu_q, cu_k),
                   smooth_q=smooth_q)

    def quantized_attention_backward(*args, **kwargs):
        do, dlse, q, k, v, sm_scale, causal, cu_q, cu_k, choice = _schema_arguments(
            op.quantized_attention_backward_op, args, kwargs)
        op.check_inputs(q, k, v, causal=causal, sm_scale=sm_scale, granularity="per_block", pv_dtype="fp16",
                        smooth_k=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        op.check_lengths(cu_q, cu_k, q.shape[2], k.shape[2])
        run = _first_backend(choice, backwards)
        return torch_view(run(*jax_view((do, dlse, q, k, v)), float(sm_scale), causal, *offsets(cu_q, cu_k)))

    return {op.OP: quantized_attention, op.BACKWARD_OP: quantized_attention_backward}


def _edm_score_implementation():
    """The torchax implementation of edm_score, with gradients: the Pallas kernel's
    ``jax.custom_vjp`` or the jnp reference, the level coefficients made in JAX from the grid."""
    from jax_impl import ood as kernels
    from torchax.interop import j2t_autograd, torch_view

    from .ops import ood as op

    forms = {"pallas": lambda *arrays, scoped: kernels.edm_score(*arrays, scoped),
             "reference": kernels.edm_score_reference}

    def edm_score(*args, **kwargs):
        x, *params, sigmas, sigma_data, statistic, choice = _schema_arguments(op.edm_score_op, args, kwargs)
        op.check_edm_inputs(x, params, sigmas, sigma_data, statistic)
        form = _first_backend(choice, forms)
        coefficients = kernels.edm_level_coefficients(tuple(sigmas), float(sigma_data))

        def score(x, mean, inv_scale, *rest):
            return form(x, mean, inv_scale, coefficients, *rest, scoped=statistic == "scoped")

        return j2t_autograd(torch_view(score))(x, *params)

    return edm_score


def register(env) -> None:
    """Register the JAX implementations of every op with torchax environment ``env``."""
    from jax_impl import ood

    from .ops import ood as ood_op

    env.override_op_definition(
        torch.ops.torch_kernels.mahalanobis_score.default,
        _jax_implementations(ood_op.check_inputs, pallas=ood.mahalanobis_score,
                             reference=ood.mahalanobis_score_reference),
    )
    env.override_op_definition(torch.ops.torch_kernels.edm_score.default, _edm_score_implementation())
    write, attention = _paged_attention_implementations()
    env.override_op_definition(torch.ops.torch_kernels.reshape_and_cache.default, write)
    env.override_op_definition(torch.ops.torch_kernels.ragged_paged_attention.default, attention)
    for name, impl in _linear_attention_implementations().items():
        env.override_op_definition(getattr(torch.ops.torch_kernels, name).default, impl)
    for name, impl in (*_moe_implementations().items(), *_quantized_attention_implementations().items()):
        env.override_op_definition(getattr(torch.ops.torch_kernels, name).default, impl)

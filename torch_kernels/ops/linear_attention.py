"""Linear attention ops: ``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``,
``chunk_simple_gla`` and Kimi Delta Attention's ``chunk_kda`` and ``fused_recurrent_kda``, with
fla's names, argument order and layout.

Each is a ``torch.ops.torch_kernels`` op with a fake, FLOP and byte formulas and an autograd formula whose
backward is an op too (``<name>_backward``), so both directions run on the chosen backend and
compile without graph breaks. The math is in ``torch_kernels.reference.linear_attention``.

A backend implements, per op, ``forward(q, k, v, g, beta, scale, initial_state, cu_seqlens,
use_qk_l2norm) -> (o, final_state)`` and ``backward(do, dht, <the same inputs>) -> (dq, dk, dv,
dg, dbeta, dh0)``; inputs arrive checked and contiguous, ``g``/``beta``/``initial_state``/``dht``
may be None (no gate, linear attention, zero state, unused final state), and a gradient for an
absent input may be None.
"""

from __future__ import annotations

import math
import numbers

import torch

from .. import _checks, backends
from .._library import define, io_bytes, register_cost
from ..families import Case
from ..reference import linear_attention as reference

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_simple_gla", "chunk_kda",
           "fused_recurrent_kda"]

CHUNK_DELTA = "chunk_gated_delta_rule"
RECURRENT_DELTA = "fused_recurrent_gated_delta_rule"
CHUNK_GLA = "chunk_simple_gla"
CHUNK_KDA = "chunk_kda"
RECURRENT_KDA = "fused_recurrent_kda"
OPS = (CHUNK_DELTA, RECURRENT_DELTA, CHUNK_GLA, CHUNK_KDA, RECURRENT_KDA)
PER_CHANNEL_OPS = (CHUNK_KDA, RECURRENT_KDA)

INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def _reference_forward(form: str):
    stepwise = form in (RECURRENT_DELTA, RECURRENT_KDA)
    recurrence = reference.recurrence_naive if stepwise else reference.recurrence_chunked

    def forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
        return recurrence(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm)

    return forward


def reference_backward(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """Gradients by autograd through the chunked form, recomputed here rather than saved."""
    with torch.enable_grad():
        leaves = [None if t is None else t.detach().requires_grad_() for t in (q, k, v, g, beta, initial_state)]
        o, ht = reference.recurrence_chunked(*leaves[:5], scale, leaves[5], cu_seqlens, use_qk_l2norm)
        # an output no input reaches (the zero state of empty sequences, an empty o) has no gradient
        pairs = [(out, grad) for out, grad in ((o, do), (ht, dht)) if grad is not None and out.requires_grad]
        wanted = [t for t in leaves if t is not None]
        if not pairs:
            return (None,) * len(leaves)
        found = iter(torch.autograd.grad([out for out, _ in pairs], wanted, [grad for _, grad in pairs],
                                         allow_unused=True))
    return tuple(None if t is None else next(found) for t in leaves)


# the chunked kernels serve both chunked ops (beta=None is simple GLA); the recurrent ones the recurrent op
for _op, _backward in ((CHUNK_DELTA, "chunk_gated_delta_rule_backward"), (CHUNK_GLA, "chunk_simple_gla_backward")):
    backends.register(_op, "reference", _reference_forward(_op))
    backends.register(_op, "triton", "triton_impl.linear_attention:chunk_forward")
    backends.register(_op, "pallas", "torch_kernels.pallas.linear_attention:pallas_chunk_forward")
    backends.register(_op, "sycl", "oneapi_impl.linear_attention:chunk_forward")
    backends.register(_backward, "reference", reference_backward)
    backends.register(_backward, "triton", "triton_impl.linear_attention:chunk_backward")
    backends.register(_backward, "pallas", "torch_kernels.pallas.linear_attention:pallas_chunk_backward")
    backends.register(_backward, "sycl", "oneapi_impl.linear_attention:chunk_backward")
backends.register(RECURRENT_DELTA, "reference", _reference_forward(RECURRENT_DELTA))
backends.register(RECURRENT_DELTA, "triton", "triton_impl.linear_attention:recurrent_forward")
backends.register(RECURRENT_DELTA, "pallas", "torch_kernels.pallas.linear_attention:pallas_recurrent_forward")
backends.register(RECURRENT_DELTA, "sycl", "oneapi_impl.linear_attention:recurrent_forward")
backends.register("fused_recurrent_gated_delta_rule_backward", "reference", reference_backward)
backends.register("fused_recurrent_gated_delta_rule_backward", "triton", "triton_impl.linear_attention:recurrent_backward")
backends.register("fused_recurrent_gated_delta_rule_backward", "pallas",
                  "torch_kernels.pallas.linear_attention:pallas_recurrent_backward")
backends.register("fused_recurrent_gated_delta_rule_backward", "sycl", "oneapi_impl.linear_attention:recurrent_backward")
# Kimi Delta Attention: the reference's shared chunked and step-by-step forms, the step-by-step
# kernels of triton, pallas (a scan) and sycl, and the chunked kernels of every backend (those of the
# delta rule above with a decay per key channel; triton's read the per-channel products)
for _op in PER_CHANNEL_OPS:
    backends.register(_op, "reference", _reference_forward(_op))
    backends.register(f"{_op}_backward", "reference", reference_backward)
backends.register(CHUNK_KDA, "triton", "triton_impl.linear_attention:chunk_forward")
backends.register("chunk_kda_backward", "triton", "triton_impl.linear_attention:chunk_backward")
backends.register(CHUNK_KDA, "pallas", "torch_kernels.pallas.linear_attention:pallas_chunk_forward")
backends.register("chunk_kda_backward", "pallas", "torch_kernels.pallas.linear_attention:pallas_chunk_backward")
backends.register(CHUNK_KDA, "sycl", "oneapi_impl.linear_attention:chunk_forward")
backends.register("chunk_kda_backward", "sycl", "oneapi_impl.linear_attention:chunk_backward")
backends.register(RECURRENT_KDA, "triton", "triton_impl.linear_attention:recurrent_forward")
backends.register("fused_recurrent_kda_backward", "triton", "triton_impl.linear_attention:recurrent_backward")
backends.register(RECURRENT_KDA, "pallas", "torch_kernels.pallas.linear_attention:pallas_recurrent_forward")
backends.register("fused_recurrent_kda_backward", "pallas",
                  "torch_kernels.pallas.linear_attention:pallas_recurrent_backward")
backends.register(RECURRENT_KDA, "sycl", "oneapi_impl.linear_attention:recurrent_forward")
backends.register("fused_recurrent_kda_backward", "sycl", "oneapi_impl.linear_attention:recurrent_backward")
del _op, _backward

@_checks.remembers_layouts
def check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, *, needs_beta: bool, grouped: bool,
                 per_channel: bool = False) -> None:
    """Shapes, dtypes, devices and the scale (no data read); ``per_channel``: ``g`` has a decay
    per key channel (``[B, T, HV, K]``)."""
    _checks.tensor("q", q, ndim=4, dtypes=INPUT_DTYPES)
    _checks.tensor("k", k, ndim=4, dtypes=(q.dtype,))
    _checks.tensor("v", v, ndim=4, dtypes=(q.dtype,))
    batch, length, heads, k_dim = q.shape
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k: expected shape {tuple(q.shape)} (as q), got {tuple(k.shape)}")
    _checks.size("v", 0, v.shape[0], batch, "batch B of q")
    _checks.size("v", 1, v.shape[1], length, "time T of q")
    value_heads = v.shape[2]
    if grouped:
        if value_heads % heads:
            raise ValueError(f"v: expected a number of value heads divisible by q's {heads} heads, got {value_heads}")
    else:
        _checks.size("v", 2, value_heads, heads, "heads H of q")
    if k_dim == 0 or v.shape[3] == 0 or heads == 0:
        raise ValueError(f"q, v: expected non-empty head dimensions, got q {tuple(q.shape)} and v {tuple(v.shape)}")
    gate_shape = (batch, length, value_heads)
    decay_shape, decay_dims = ((*gate_shape, k_dim), "B, T, heads of v and K of q") if per_channel \
        else (gate_shape, "B, T and value heads of v")
    gates = (("g", g, decay_shape, decay_dims), ("beta", beta, gate_shape, "B, T and value heads of v"))
    for name, t, shape, dims in gates:
        if t is None:
            if name == "beta" and needs_beta:
                raise TypeError("beta: expected a torch.Tensor, got None")
            continue
        _checks.tensor(name, t, ndim=len(shape), dtypes=_checks.FLOAT_DTYPES)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} ({dims}), got {tuple(t.shape)}")
    if not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {scale!r}")
    num_states = batch
    if cu_seqlens is not None:
        _checks.tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES)
        if batch != 1:
            raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got q of shape {tuple(q.shape)}")
        if cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens: expected at least two offsets [0, T], got shape {tuple(cu_seqlens.shape)}")
        num_states = cu_seqlens.shape[0] - 1
    if initial_state is not None:
        _checks.tensor("initial_state", initial_state, ndim=4, dtypes=_checks.FLOAT_DTYPES)
        expected = (num_states, value_heads, k_dim, v.shape[3])
        if tuple(initial_state.shape) != expected:
            raise ValueError(f"initial_state: expected shape {expected} (sequences, value heads, K, V), "
                             f"got {tuple(initial_state.shape)}")
    present = {name: t for name, t in (("g", g), ("beta", beta), ("initial_state", initial_state),
                                       ("cu_seqlens", cu_seqlens)) if t is not None}
    _checks.same_device(q=q, k=k, v=v, **present)


def check_values(cu_seqlens, length: int, g, checks: _checks.ValueChecks | None = None):
    """No log decay is positive, and packed sequence offsets start at 0, never decrease and end at T.

    Returns ``(cu_seqlens, offsets_bad)`` for the kernels: as given in full mode (``offsets_bad``
    None); in deferred mode the offsets made safe (clamped into ``[0, T]``, non-decreasing, from 0
    to T) and ``offsets_bad`` a 0-dim flag: the outputs must then be NaN, as the sequences' rows
    cannot be told apart. A positive ``g`` is recorded only: it reads nothing out of bounds, and the
    recurrence then grows the state. Without ``checks``, checks fully now."""
    if g is None and cu_seqlens is None:
        return None, None
    own = checks is None
    checks = checks or _checks.ValueChecks((cu_seqlens if g is None else g).device, "full")
    if g is not None:
        message = "g: expected log decays <= 0 (exp(g) scales the state down)"
        if (device_check := checks.device_check(_checks.NOT_POSITIVE_CHECK, (message,))) is not None:
            device_check(g)
        else:
            positive = g > 0
            checks.add(positive, message,
                       lambda: f"got {g[positive][0].item()} at index {tuple(positive.nonzero()[0].tolist())}")
    offsets_bad = None
    if cu_seqlens is not None:
        cu_seqlens, offsets_bad = _checks.packed_offsets("cu_seqlens", cu_seqlens, length,
                                                         f"the time length T={length}", checks)
    if own:
        checks.finish()
    return cu_seqlens, offsets_bad


def _state_shape(q, v, cu_seqlens):
    n = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return (n, v.shape[2], q.shape[3], v.shape[3])


def _contiguous(t):
    return None if t is None else t.contiguous()


def _device_type(t: torch.Tensor) -> str:
    return "cpu" if t.is_cpu else t.device.type


def _strip_grad(*tensors):
    """Kernels take plain tensors (DLPack and USM copies refuse grad-requiring ones)."""
    return tuple(None if t is None else t.detach() for t in tensors)


class _Family:
    """The forward op, backward op, autograd and cost formulas shared by the ops."""

    def __init__(self, name: str, *, delta: bool, grouped: bool, per_channel: bool = False):
        self.name, self.delta, self.grouped, self.per_channel = name, delta, grouped, per_channel
        gate = "Tensor g, Tensor beta" if delta else "Tensor? g"
        inputs = f"Tensor q, Tensor k, Tensor v, {gate}, float scale, Tensor? initial_state=None, " \
                 f"Tensor? cu_seqlens=None{', bool use_qk_l2norm=False' if delta else ''}, str? implementation=None"
        self.backward_op = define(
            f"{name}_backward(Tensor do, Tensor? dht, {inputs}) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
            self._backward_kernel, self._backward_fake)
        self.forward_op = define(f"{name}({inputs}) -> (Tensor, Tensor)", self._forward_kernel, self._forward_fake,
                                 setup_context=self._setup_context, backward=self._backward)
        register_cost(self.forward_op, flops=self._flops, bytes=io_bytes)
        # the backward recomputes the forward's states, then takes two products for each of its one
        register_cost(self.backward_op, flops=lambda a, out: 3 * self._flops(a, out), bytes=io_bytes)

    def _unpack(self, args):
        """(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, implementation) from
        the schema's arguments (the dispatcher leaves out trailing ones at their defaults)."""
        if self.delta:
            return tuple(args) + (None, None, False, None)[len(args) - 6:]
        q, k, v, g, scale, initial_state, cu_seqlens, implementation = tuple(args) + (None, None, None)[len(args) - 5:]
        return q, k, v, g, None, scale, initial_state, cu_seqlens, False, implementation

    def _check(self, q, k, v, g, beta, scale, initial_state, cu_seqlens):
        check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens, needs_beta=self.delta, grouped=self.grouped,
                     per_channel=self.per_channel)

    def _run(self, op, implementation, q, *args):
        return backends.dispatch(op, _device_type(q), implementation, q, *args)

    def _forward_kernel(self, *args):
        q, k, v, g, beta, scale, h0, cu, l2norm, implementation = self._unpack(args)
        self._check(q, k, v, g, beta, scale, h0, cu)
        cu, offsets_bad = _checks.checked(q.device, check_values, cu, q.shape[1], g,
                                          backend=backends.planned(self.name, _device_type(q), implementation))
        q, k, v, g, beta, h0 = _strip_grad(q, k, v, g, beta, h0)
        o, ht = self._run(self.name, implementation, *map(_contiguous, (q, k, v, g, beta)), float(scale),
                          _contiguous(h0), _contiguous(cu), l2norm)
        if o.dtype != v.dtype or ht.dtype != reference.compute_dtype(v.dtype):
            raise RuntimeError(f"{backends.last_backend(self.name)}: returned o {o.dtype} and final state {ht.dtype} "
                               f"for {v.dtype} inputs (expected {v.dtype}, {reference.compute_dtype(v.dtype)})")
        # contiguous as the fake promises (a kernel may work head-major)
        return _checks.nan_where(offsets_bad, o.contiguous(), ht.contiguous())

    def _forward_fake(self, *args):
        q, k, v, g, beta, scale, h0, cu, _, _ = self._unpack(args)
        self._check(q, k, v, g, beta, scale, h0, cu)
        return (torch.empty_like(v, memory_format=torch.contiguous_format),
                v.new_empty(_state_shape(q, v, cu), dtype=reference.compute_dtype(v.dtype)))

    def _grad_shapes(self, q, k, v, g, beta, h0, cu):
        gate = (v.shape[0], v.shape[1], v.shape[2])
        decay = (*gate, q.shape[3]) if self.per_channel else gate
        return [(q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype),
                (decay, q.dtype if g is None else g.dtype), (gate, q.dtype if beta is None else beta.dtype),
                (_state_shape(q, v, cu), reference.compute_dtype(v.dtype) if h0 is None else h0.dtype)]

    def _backward_kernel(self, do, dht, *args):
        q, k, v, g, beta, scale, h0, cu, l2norm, implementation = self._unpack(args)
        self._check(q, k, v, g, beta, scale, h0, cu)
        safe_cu, offsets_bad = _checks.checked(  # the forward checked g
            q.device, check_values, cu, q.shape[1], None,
            backend=backends.planned(f"{self.name}_backward", _device_type(q), implementation))
        grads = self._run(f"{self.name}_backward", implementation, do.contiguous(), _contiguous(dht),
                          *map(_contiguous, (q, k, v, g, beta)), float(scale), _contiguous(h0), _contiguous(safe_cu),
                          l2norm)
        # the schema returns six tensors: an absent input's gradient is zeros
        return _checks.nan_where(offsets_bad, *(
            torch.zeros(shape, dtype=dtype, device=q.device) if grad is None else grad.to(dtype).contiguous()
            for grad, (shape, dtype) in zip(grads, self._grad_shapes(q, k, v, g, beta, h0, cu))))

    def _backward_fake(self, do, dht, *args):
        q, k, v, g, beta, scale, h0, cu, _, _ = self._unpack(args)
        self._check(q, k, v, g, beta, scale, h0, cu)
        return tuple(q.new_empty(shape, dtype=dtype) for shape, dtype in self._grad_shapes(q, k, v, g, beta, h0, cu))

    def _setup_context(self, ctx, inputs, output):
        q, k, v, g, beta, scale, h0, cu, l2norm, implementation = self._unpack(tuple(inputs))
        ctx.save_for_backward(q, k, v, g, beta, h0, cu)
        ctx.scale, ctx.l2norm = scale, l2norm
        # the backward runs on the backends chosen now, even outside this call's use_backend block
        order, explicit = backends.resolve(q.device.type, implementation)
        ctx.implementation = ",".join(order) if explicit else None

    def _backward(self, ctx, do, dht):
        q, k, v, g, beta, h0, cu = ctx.saved_tensors
        if self.delta:
            inputs = (q, k, v, g, beta, ctx.scale, h0, cu, ctx.l2norm, ctx.implementation)
        else:
            inputs = (q, k, v, g, ctx.scale, h0, cu, ctx.implementation)
        if do is None:
            do = torch.zeros_like(v)
        dq, dk, dv, dg, dbeta, dh0 = self.backward_op(do, dht, *inputs)
        grads = {"q": dq, "k": dk, "v": dv, "g": dg, "beta": dbeta, "initial_state": dh0}
        names = ["q", "k", "v", "g", "beta", "scale", "initial_state", "cu_seqlens", "l2norm", "implementation"]
        if not self.delta:
            names = ["q", "k", "v", "g", "scale", "initial_state", "cu_seqlens", "implementation"]
        return tuple(grads.get(name) if needed else None for name, needed in zip(names, ctx.needs_input_grad))

    def _flops(self, a, out) -> int:
        batch, length, _, k_dim = a.q.shape
        value_heads, v_dim = a.v.shape[2], a.v.shape[3]
        # per step and value head: the state update and the read-out (delta adds S^T k)
        per_step = (6 if self.delta else 4) * k_dim * v_dim
        return batch * length * value_heads * per_step


chunk_gated_delta_rule_family = _Family(CHUNK_DELTA, delta=True, grouped=True)
fused_recurrent_gated_delta_rule_family = _Family(RECURRENT_DELTA, delta=True, grouped=True)
chunk_simple_gla_family = _Family(CHUNK_GLA, delta=False, grouped=False)
chunk_kda_family = _Family(CHUNK_KDA, delta=True, grouped=False, per_channel=True)
fused_recurrent_kda_family = _Family(RECURRENT_KDA, delta=True, grouped=False, per_channel=True)


def _default_scale(q, scale):
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if scale is None:
        if q.dim() == 4 and q.shape[-1] == 0:
            raise ValueError(f"q: expected a key head size K >= 1, got shape {tuple(q.shape)}")
        return q.shape[-1] ** -0.5 if q.dim() and q.shape[-1] else 1.0  # else the op's checks say what is wrong
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale: expected None or a float, got {type(scale).__name__} {scale!r}")
    return float(scale)


def _call_delta(family, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                cu_seqlens, implementation):
    for name, t, meaning in (("g", g, "the log decay; zeros for none"), ("beta", beta, "the update strength")):
        if not isinstance(t, torch.Tensor):  # the dispatcher would let None through as an undefined tensor
            raise TypeError(f"{name}: expected a torch.Tensor ({meaning}), got {type(t).__name__}")
    o, final_state = family.forward_op(q, k, v, g, beta, _default_scale(q, scale), initial_state, cu_seqlens,
                                       bool(use_qk_l2norm_in_kernel), backends.implementation_arg(implementation))
    return o, (final_state if output_final_state else None)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, implementation=None):
    """Gated DeltaNet (the delta rule with a scalar decay per step and head), in chunks.

    Per value head, with state ``S [K, V]`` (float32) starting from ``initial_state``::

        S_t = exp(g_t) * S_{t-1}
        S_t = S_t + beta_t * k_t (v_t - S_t^T k_t)^T
        o_t = S_t^T (scale * q_t)

    Args:
        q, k: ``[B, T, H, K]``; with ``use_qk_l2norm_in_kernel`` each is divided by
            ``sqrt(sum(x^2) + 1e-6)`` over K first (inside the op, gradients included).
        v: ``[B, T, HV, V]``, ``HV`` a multiple of ``H``: value head ``j`` uses q/k head
            ``j // (HV / H)`` (Qwen3-Next's grouped value heads). q, k and v share a dtype.
        g: ``[B, T, HV]`` log decay, ``<= 0`` (``exp(g)`` multiplies the state; checked, in the
            full check mode by reading ``g`` once on the host). Large negative values are exact
            (pairwise decays are summed directly, never as differences of cumulative sums) and
            ``-inf`` resets the state.
        beta: ``[B, T, HV]`` update strength, usually in (0, 1).
        scale: multiplies q; default ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``N = B``, or the number of packed sequences).
        output_final_state: return the final states (else None).
        cu_seqlens: ``[N + 1]`` int offsets of packed sequences along T (needs ``B = 1``); each
            starts from its own initial state.
        implementation: a backend name or ordered list (see ``torch_kernels.backends``).

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32 or None)``.
        Differentiable in q, k, v, g, beta and initial_state. A NaN or inf in an input reaches
        every output it feeds (the rest of its sequence and its final state), on every backend.
        In the deferred check mode (``torch_kernels.checks``) bad values raise nothing at the call
        (``torch_kernels.raise_deferred_errors()`` raises later): ``cu_seqlens`` that do not add
        up make o, the final states and every gradient NaN, and a positive ``g`` is used as given.
    """
    return _call_delta(chunk_gated_delta_rule_family, q, k, v, g, beta, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, cu_seqlens, implementation)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, implementation=None):
    """The same recurrence as :func:`chunk_gated_delta_rule`, one step at a time: the form for
    decoding a few tokens from a carried state. It has a backward too. Arguments, and what the
    deferred check mode does with bad values, as there."""
    return _call_delta(fused_recurrent_gated_delta_rule_family, q, k, v, g, beta, scale, initial_state,
                       output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, implementation)


def chunk_simple_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                     implementation=None):
    """Gated linear attention with one scalar log decay per head and step, in chunks.

    ``S_t = exp(g_t) S_{t-1} + k_t v_t^T`` and ``o_t = S_t^T (scale q_t)``: Mamba-2's SSD, RetNet
    and Lightning-style decays; ``g=None`` is plain causal linear attention.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]`` (one dtype); g: ``[B, T, H]`` log decay
            ``<= 0`` (checked; ``-inf`` resets the state) or None.
        scale, initial_state, output_final_state, cu_seqlens, implementation: as in
            :func:`chunk_gated_delta_rule`.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] float32 or None)``;
        differentiable in q, k, v, g and initial_state. In the deferred check mode bad values
        are handled as :func:`chunk_gated_delta_rule` says (NaN outputs for bad ``cu_seqlens``).
    """
    o, final_state = chunk_simple_gla_family.forward_op(q, k, v, g, _default_scale(q, scale), initial_state,
                                                        cu_seqlens, backends.implementation_arg(implementation))
    return o, (final_state if output_final_state else None)


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, implementation=None):
    """Kimi Delta Attention (the delta rule with a decay per key channel), in chunks.

    :func:`chunk_gated_delta_rule` with row ``c`` of each head's state ``S [K, V]`` decaying by
    its own ``exp(g_tc)``: ``S_t = diag(exp(g_t)) S_{t-1}``, then the same delta-rule write and
    read-out. Arguments as there, except:

    - v: ``[B, T, H, V]``, one value head per query/key head;
    - g: ``[B, T, H, K]`` log decay per key channel, ``<= 0`` (checked). Strong decays are exact:
      every decay the chunks apply is summed over its span, never a quotient of cumulative
      decays; ``-inf`` resets that channel;
    - beta ``[B, T, H]``, initial_state ``[N, H, K, V]``.

    Returns:
        ``(o [B, T, H, V] in v's dtype, final_state [N, H, K, V] float32 or None)``.
        Differentiable in q, k, v, g, beta and initial_state. In the deferred check mode bad
        values are handled as :func:`chunk_gated_delta_rule` says (NaN outputs for bad ``cu_seqlens``).
    """
    return _call_delta(chunk_kda_family, q, k, v, g, beta, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, cu_seqlens, implementation)


def fused_recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, cu_seqlens=None, implementation=None):
    """The same recurrence as :func:`chunk_kda`, one step at a time: the form for decoding a few
    tokens from a carried state. It has a backward too. Arguments, and what the deferred check
    mode does with bad values, as there."""
    return _call_delta(fused_recurrent_kda_family, q, k, v, g, beta, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, cu_seqlens, implementation)


# transformers' hub kernel names these ops serve (``torch_kernels.integrations.transformers.kernelize``
# routes a model's calls of them here): fla's names, argument names and layouts
TRANSFORMERS_HUB_FUNCTIONS = {"chunk_gated_delta_rule": chunk_gated_delta_rule,
                              "fused_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
                              "chunk_kda": chunk_kda, "fused_recurrent_kda": fused_recurrent_kda}


# ---- self-test cases ----

def linear_attention_inputs(gen, dtype, device, delta=True, cu_seqlens=(0, 30, 75), heads=(2, 4), k_dim=32, v_dim=48,
                            per_channel=False):
    """Two packed sequences with their own initial states; grouped value heads for the delta rule
    (one head count for a decay per channel, ``per_channel``, as Kimi Delta Attention)."""
    num_heads, value_heads = heads if delta and not per_channel else (heads[0], heads[0])
    length = cu_seqlens[-1]
    q = torch.randn(1, length, num_heads, k_dim, generator=gen)
    k = torch.randn(1, length, num_heads, k_dim, generator=gen)
    v = torch.randn(1, length, value_heads, v_dim, generator=gen)
    g = -0.1 * torch.rand(1, length, value_heads, *((k_dim,) if per_channel else ()), generator=gen)
    h0 = torch.randn(len(cu_seqlens) - 1, value_heads, k_dim, v_dim, generator=gen)
    if not delta:  # without the delta rule's l2 norm the state grows with the keys' size
        k = k * k_dim ** -0.5
    tensors = [q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), g.to(device)]
    if delta:
        tensors.append(torch.rand(1, length, value_heads, generator=gen).to(device))
    return (*tensors, h0.to(device), torch.tensor(cu_seqlens, dtype=torch.int32, device=device))


def _selftest_case(op: str) -> Case:
    delta = op != CHUNK_GLA
    public = globals()[op]

    def run(*inputs, implementation=None):
        *tensors, h0, cu = inputs
        kwargs = {"use_qk_l2norm_in_kernel": True} if delta else {}
        return public(*tensors, initial_state=h0, cu_seqlens=cu, implementation=implementation, **kwargs)[0]

    def definition(*inputs):
        *tensors, h0, cu = (t.double() if t.is_floating_point() else t for t in inputs)
        q, k, v, g, beta = tensors if delta else (*tensors, None)
        return reference.recurrence_naive(q, k, v, g, beta, q.shape[-1] ** -0.5, h0, cu, use_qk_l2norm=delta)[0]

    per_channel = op in PER_CHANNEL_OPS
    return Case(op, lambda gen, dtype, device: linear_attention_inputs(gen, dtype, device, delta,
                                                                       per_channel=per_channel), run, definition)


def selftest_cases() -> list[Case]:
    """The doctor's check of each op's output against the float64 step-by-step recurrence."""
    return [_selftest_case(op) for op in OPS]

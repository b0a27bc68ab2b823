"""Gated DeltaNet and simple gated linear attention as chunked Pallas TPU kernels, and a
step-by-step recurrent form; all differentiable JAX functions.

Layout as fla: q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` (value head ``j`` reads q/k head
``j // (HV / H)``), g and beta ``[B, T, HV]``, states ``[N, HV, K, V]`` float32. Per value head,
with state ``S [K, V]``::

    S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T  (delta rule)
                             or S_t += k_t v_t^T                     (linear attention, no beta)
    o_t = S_t^T (scale q_t)

**Chunked kernels.** Outside the kernels (jnp, so autodiff covers it) q and k are optionally
L2-normalized and every sequence (a batch row, or a packed sequence of ``cu_seqlens``) is padded
to a multiple of ``CHUNK`` steps; the sequences are laid end to end as one list of chunks, heads
first (``[heads, chunks * CHUNK, K]``), K and V padded to 128 lanes. Padding steps have k = v = 0,
beta = 0 and g = 0, so they leave the state as it is; the gates reach the kernels as one row
per chunk. Packed sequences are thus handled on the host side (their offsets are concrete): three
scalar-prefetched int32 lists say, per chunk, its sequence and whether it is that sequence's
first or last chunk, and the kernels reset the state there.

The forward kernel's grid is (value head: parallel, chunk: arbitrary); the state lives in a VMEM
scratch across the chunks of a head. A chunk with start state ``S0``, ``D_ts = exp(g_{s+1} + ...
+ g_t)`` (``s <= t``), ``E_t = exp(g_1 + ... + g_t)``, ``F_t = exp(g_{t+1} + ... + g_C)`` and
``G = exp(g_1 + ... + g_C)``, in the WY representation:

- ``A = strict_lower(D * diag(beta) K K^T)``; ``Tinv = (I + A)^{-1}`` by recursive doubling of
  inverted diagonal blocks (1, 2, 4, ... 64 wide: two 64x64 matmuls per level), a stable blocked
  forward substitution;
- effective values ``W = Tinv diag(beta) (V - E * K S0)`` (or ``W = V`` without beta);
- ``O = scale (E * Q S0 + (D * Q K^T) W)``; ``S_end = G S0 + (K * F)^T W``.

Each exponent is summed over its own gates, never taken as a difference ``b_t - b_s`` of
cumulative sums: that cancels in float32 once gates are large (g = -1e4 left errors of 1e-3) and
is NaN for g = -inf, a full state reset. The gates' gradient is summed the same way.

**A decay per key channel** (Kimi Delta Attention, ``g [B, T, HV, K]``, ``_Config.per_channel``):
the gates reach the kernels laid out as k, ``e``, ``f`` become ``[C, K]``, ``G`` a per-row
``[K, 1]``, and ``D`` gains a channel: the products ``P(X, Y)_ts = sum_c X_tc Y_sc D_tsc`` no
longer factor into one matmul. Within sub-chunks of ``SUB`` rows they are taken elementwise on
``[SUB, SUB, K]``; below them, for row block ``i`` starting at row ``r + 1``, ``D_tsc = exp(g_{r+1}
+ ... + g_t) exp(g_{s+1} + ... + g_r)`` for ``s <= r < t``, so ``P = (X * exp(...)) (Y *
exp(...))^T``, a matmul with both exponents sums of gates of one sign (each <= 0, no overflow,
no cancellation). ``A`` and ``O`` then use ``P(K, K)`` and ``P(Q, K)``, and ``E * K S0`` becomes
``(E * K) S0``. The backward kernel takes the vjp of that chunk math where the kernel is traced
(the vjp of a masked gate sum ``mask @ g`` is ``mask^T @ d``: the gradients are summed over the
same spans, with no differences either), in place of the hand-written per-head formulas.

The backward (a ``jax.custom_vjp``) stores nothing from the forward but its inputs: it recomputes
the chunk start states with the forward kernel (states only, no output), then runs a second kernel
over the chunks in reverse order that carries dS (the state's gradient) in VMEM, recomputes the
chunk's WY quantities and writes dq, dk, dv, dg and dbeta; the padding, normalization and head
grouping are undone by JAX's autodiff. With no sequences or no value heads no kernel runs.

**Recurrent form.** ``fused_recurrent_gated_delta_rule`` is a ``lax.scan`` over time steps in
jnp (the decode form: a few tokens from a carried state), differentiated by JAX; it is also the
reference these kernels are compared with in pure JAX. It multiplies by ``exp(g_t)`` step by
step, so it is exact and finite for any g <= 0, -inf included. Given ``g [B, T, HV, K]`` it is
Kimi Delta Attention's ``fused_recurrent_kda``: row c of the state decays by ``exp(g_tc)``.

All arithmetic is float32 (matmuls at HIGHEST precision); outputs are in v's dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import interpret_params, round_up

CHUNK = 64
SUB = 16  # rows of the sub-chunks whose per-channel decays are taken elementwise
LANES = 128
EPS = 1e-6
_GATE_FLOOR = -1e30  # a chunk's sum of 64 such gates still fits in float32
_HIGHEST = jax.lax.Precision.HIGHEST
_F32 = jnp.float32


# ---------------------------------------------------------------- in-kernel math

def _dot(a, b, *, ta=False, tb=False):
    """``a @ b`` in float32, ``a`` or ``b`` taken transposed (no transpose is materialized)."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=_HIGHEST, preferred_element_type=_F32)


def _iota(shape, axis):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _unit_lower_inverse(a):
    """``(I + a)^{-1}`` for strictly lower triangular ``a [C, C]`` (C a power of two).

    Level ``s`` holds the inverses of the diagonal blocks of width ``s``; two neighbours merge
    as ``[[T1, 0], [-T2 A21 T1, T2]]``, i.e. ``T - T X T`` with ``X`` the ``A21`` blocks. Unlike a
    Neumann series this never forms large powers of ``a`` that must cancel.
    """
    size = a.shape[0]
    apart = _iota(a.shape, 0) ^ _iota(a.shape, 1)  # < 2s: same 2s-block; >= s: different s-block
    inverse = (apart == 0).astype(_F32)
    width = 1
    while width < size:
        below = jnp.where((apart >= width) & (apart < 2 * width), a, 0.0)
        inverse = inverse - _dot(_dot(inverse, below), inverse)
        width *= 2
    return inverse


def _chunk_decays(g_row):
    """Masks and decays of a chunk with gates ``g_row [1, C]``: ``decay_ts = exp(g_{s+1} + ... +
    g_t)`` (0 above the diagonal), ``e_t = exp(g_1 + ... + g_t)``, ``f_t = exp(g_{t+1} + ... + g_C)``
    and ``total = exp(g_1 + ... + g_C)``, each exponent summed over its own gates (no differences
    of cumulative sums: see the module docstring)."""
    shape = (g_row.shape[1], g_row.shape[1])
    rows, cols = _iota(shape, 0), _iota(shape, 1)
    upto = cols <= rows
    start = _row_sum(jnp.where(upto, g_row, 0.0))  # g_1 + ... + g_t
    to_end = _row_sum(jnp.where(upto, 0.0, g_row))  # g_{t+1} + ... + g_C
    # seg_ts = g_{s+1} + ... + g_t by a 0/1 matmul; its gates kept finite since 0 * -inf is NaN
    # (exp underflows to 0 long before _GATE_FLOOR, so the result is the same)
    finite = jnp.where(upto, jnp.maximum(g_row, _GATE_FLOOR), 0.0)
    seg = _dot(finite, (rows > cols).astype(_F32))
    lower = rows >= cols
    return dict(lower=lower, strict=rows > cols, decay=jnp.exp(jnp.where(lower, seg, -jnp.inf)),
                e=jnp.exp(start), f=jnp.exp(to_end), total=jnp.exp(start[-1:, :]))


def _channel_decays(g):
    """:func:`_chunk_decays` for gates per key channel ``g [C, K]``: ``e``, ``f [C, K]``, ``total
    [K, 1]`` (a decay per state row) and ``sums(mask)``, ``mask @ g`` for a 0/1 ``mask [R, C]``:
    the sum of the gates each row of ``mask`` picks, per channel."""
    shape = (g.shape[0], g.shape[0])
    rows, cols = _iota(shape, 0), _iota(shape, 1)
    finite = jnp.maximum(g, _GATE_FLOOR)  # as in _chunk_decays: 0 * -inf is NaN in the matmuls

    def sums(mask):
        return _dot(mask.astype(_F32), finite)

    total = _dot(finite, jnp.ones((g.shape[0], 1), _F32), ta=True)
    return dict(lower=rows >= cols, strict=rows > cols, e=jnp.exp(sums(cols <= rows)), f=jnp.exp(sums(cols > rows)),
                total=jnp.exp(total), sums=sums)


def _channel_products(xs, y, sums):
    """``P(x, y)_ts = sum_c x_tc y_sc D_tsc`` on and below the diagonal (0 above) for each ``x`` of
    ``xs``, all ``[C, K]``, with ``D_tsc = exp(g_{s+1,c} + ... + g_tc)`` from :func:`_channel_decays`'
    ``sums`` (module docstring: elementwise within ``SUB``-row blocks, by a reference row below)."""
    size = y.shape[0]
    sub = min(SUB, size)
    rows, cols = _iota((size, size), 0), _iota((size, size), 1)
    # exp(g_{r+1} + ... + g_t), r + 1 the first row of t's block: the left factors of every block
    same_block = jax.lax.div(rows, jnp.int32(sub)) == jax.lax.div(cols, jnp.int32(sub))
    to_row = jnp.exp(sums(same_block & (cols <= rows)))
    t3, s3, u3 = (_iota((sub, sub, size), axis) for axis in range(3))
    on_or_below = (_iota((sub, sub, 1), 1) <= _iota((sub, sub, 1), 0))
    block_cols = _iota((sub, size), 1)
    blocks = [[] for _ in xs]
    for first in range(0, size, sub):
        rows_b = slice(first, first + sub)
        # inside the block: D_tsc for t, s in it, elementwise
        span = (s3 + first < u3) & (u3 <= t3 + first)  # [t, s, u]: u in s + 1 .. t
        seg = sums(span.reshape(sub * sub, size)).reshape(sub, sub, -1)
        decay = jnp.exp(jnp.where(on_or_below, seg, -jnp.inf))
        place = (block_cols == _iota((sub, size), 0) + first).astype(_F32)  # block column s -> chunk column
        inside = [_dot(jnp.sum(x[rows_b][:, None, :] * y[rows_b][None, :, :] * decay, axis=-1), place) for x in xs]
        if first:
            # below it: exp(g_{s+1} + ... + g_r) on the right, r = first - 1, for s < first
            below = y * jnp.exp(sums((rows < cols) & (cols < first)))
            left = [x[rows_b] * to_row[rows_b] for x in xs]
            inside = [p + jnp.where(block_cols < first, _dot(a, below, tb=True), 0.0) for p, a in zip(inside, left)]
        for out, p in zip(blocks, inside):
            out.append(p)
    return [jnp.concatenate(b, axis=0) for b in blocks]


def _chunk_terms(k, v, g, beta, s0, q=None, per_channel=False):
    """What forward and backward both need of a chunk: :func:`_chunk_decays` (or
    :func:`_channel_decays` with ``per_channel``) and the effective values; with ``q``, also
    ``qk``, the output's decayed ``Q K^T`` (lower)."""
    if per_channel:
        terms = _channel_decays(g)
        products = _channel_products([k] if q is None else [k, q], k, terms["sums"])
        kk_decayed = products[0]
        if q is not None:
            terms["qk"] = products[1]
    else:
        terms = _chunk_decays(g)
        if q is not None:
            terms["qk"] = terms["decay"] * _dot(q, k, tb=True)
    if beta is None:
        terms["w"] = v
        return terms
    if per_channel:
        u = v - _dot(k * terms["e"], s0)
        terms.update(u=u, inverse=_unit_lower_inverse(jnp.where(terms["strict"], kk_decayed * beta, 0.0)))
    else:
        kk = _dot(k, k, tb=True)
        ks = _dot(k, s0)
        u = v - terms["e"] * ks
        terms.update(kk=kk, ks=ks, u=u,
                     inverse=_unit_lower_inverse(jnp.where(terms["strict"], terms["decay"] * kk * beta, 0.0)))
    terms["w"] = _dot(terms["inverse"], beta * u)
    return terms


def _chunk_outputs(q, k, v, g, beta, s0, per_channel):
    """(o or None without ``q``, end state) of a chunk from its start state ``s0``."""
    terms = _chunk_terms(k, v, g, beta, s0, q=q, per_channel=per_channel)
    w = terms["w"]
    o = None if q is None else _dot(q * terms["e"], s0) + _dot(terms["qk"], w)
    return o, terms["total"] * s0 + _dot(k * terms["f"], w, ta=True)


def _take(refs, present):
    return refs.pop(0) if present else None


def _forward_kernel(seq_ref, first_ref, last_ref, *refs, scale, delta, per_channel, with_output, with_states):
    del seq_ref  # used by the index maps only
    refs = list(refs)
    q_ref = _take(refs, with_output)
    k_ref, v_ref, g_ref = (refs.pop(0) for _ in range(3))
    beta_ref = _take(refs, delta)
    h0_ref = refs.pop(0)
    o_ref = _take(refs, with_output)
    ht_ref = refs.pop(0)
    states_ref = _take(refs, with_states)
    (state_ref,) = refs
    c = pl.program_id(1)

    @pl.when(first_ref[c] == 1)
    def _():
        state_ref[...] = h0_ref[...]

    s0 = state_ref[...]
    if with_states:
        states_ref[...] = s0
    k, v = k_ref[...].astype(_F32), v_ref[...].astype(_F32)
    beta = beta_ref[...].astype(_F32) if delta else None
    q = q_ref[...].astype(_F32) * scale if with_output else None
    o, s1 = _chunk_outputs(q, k, v, g_ref[...], beta, s0, per_channel)
    if with_output:
        o_ref[...] = o.astype(o_ref.dtype)
    state_ref[...] = s1

    @pl.when(last_ref[c] == 1)
    def _():
        ht_ref[...] = s1


def _row_sum(x):
    return jnp.sum(x, axis=1, keepdims=True)


def _gate_grad(d_seg, d_start, d_to_end, d_total):
    """The gates' gradient ``[1, C]`` from those of the sums in :func:`_chunk_decays`: gate ``j`` is
    in ``seg_ts`` for ``s < j <= t``, in ``start_t`` for ``t >= j``, in ``to_end_t`` for ``t < j``
    and in the total; summed directly, as the forward does."""
    rows, cols = _iota(d_seg.shape, 0), _iota(d_seg.shape, 1)
    before = _dot(d_seg, (rows < cols).astype(_F32))  # [t, j]: d_seg_ts summed over s < j
    per_step = jnp.where(rows >= cols, before + d_start, d_to_end)
    return jnp.sum(per_step, axis=0, keepdims=True) + d_total


def _backward_kernel(seq_ref, first_ref, last_ref, *refs, scale, delta, per_channel, num_chunks):
    del seq_ref
    refs = list(refs)
    q_ref, k_ref, v_ref, g_ref = (refs.pop(0) for _ in range(4))
    beta_ref = _take(refs, delta)
    s0_ref, do_ref, dht_ref, dq_ref, dk_ref, dv_ref, dg_ref = (refs.pop(0) for _ in range(7))
    dbeta_ref = _take(refs, delta)
    dh0_ref, dstate_ref = refs
    c = num_chunks - 1 - pl.program_id(1)

    @pl.when(last_ref[c] == 1)
    def _():
        dstate_ref[...] = dht_ref[...]

    ds1, s0 = dstate_ref[...], s0_ref[...]
    q = q_ref[...].astype(_F32) * scale
    k, v, do = k_ref[...].astype(_F32), v_ref[...].astype(_F32), do_ref[...].astype(_F32)
    beta = beta_ref[...].astype(_F32) if delta else None
    if per_channel:
        # the chunk's math differentiated where it is traced (its gates' sums are masked matmuls,
        # whose transposes sum the gradients over the same spans: nothing cancels)
        _, chunk_vjp = jax.vjp(functools.partial(_chunk_outputs, per_channel=True), q, k, v, g_ref[...], beta, s0)
        dq, dk, dv, dg, dbeta, ds0 = chunk_vjp((do, ds1))
        if delta:
            dbeta_ref[...] = dbeta
        _store_chunk_grads(first_ref[c], dq * scale, dk, dv, dg, ds0, dq_ref, dk_ref, dv_ref, dg_ref, dstate_ref,
                           dh0_ref)
        return
    t = _chunk_terms(k, v, g_ref[...], beta, s0)
    decay, e, f, w = t["decay"], t["e"], t["f"], t["w"]

    # o = e * (q S0) + (decay * q k^T) W and S1 = total S0 + (k f)^T W; d_start, d_to_end and
    # d_total are the gradients of the log decays e, f and total, d_decay that of decay
    qk = _dot(q, k, tb=True)
    dw = _dot(decay * qk, do, ta=True) + _dot(k * f, ds1)
    dp = jnp.where(t["lower"], _dot(do, w, tb=True), 0.0)
    dqk = dp * decay
    dq = e * _dot(do, s0, tb=True) + _dot(dqk, k)
    w_ds = _dot(w, ds1, tb=True)
    dk = _dot(dqk, q, ta=True) + f * w_ds
    ds0 = _dot(q * e, do, ta=True) + t["total"] * ds1
    d_decay = dp * qk
    d_to_end = f * _row_sum(k * w_ds)
    d_start = e * _row_sum(do * _dot(q, s0))
    d_total = t["total"] * jnp.sum(_row_sum(s0 * ds1), axis=0, keepdims=True)
    if delta:
        # W = Tinv (beta u), u = v - e * (k S0), Tinv = (I + strict(decay * beta k k^T))^{-1}
        dr = _dot(t["inverse"], dw, ta=True)
        da = jnp.where(t["strict"], -_dot(dr, w, tb=True), 0.0)
        kk = t["kk"]
        dbeta_ref[...] = _row_sum(dr * t["u"]) + _row_sum(da * decay * kk)
        du = beta * dr
        dv = du
        d_start = d_start - e * _row_sum(du * t["ks"])
        dk = dk - _dot(e * du, s0, tb=True)
        ds0 = ds0 - _dot(k * e, du, ta=True)
        d_decay = d_decay + da * beta * kk
        dkk = da * decay * beta
        dk = dk + _dot(dkk, k) + _dot(dkk, k, ta=True)
    else:
        dv = dw
    _store_chunk_grads(first_ref[c], dq * scale, dk, dv, _gate_grad(d_decay * decay, d_start, d_to_end, d_total),
                       ds0, dq_ref, dk_ref, dv_ref, dg_ref, dstate_ref, dh0_ref)


def _store_chunk_grads(first, dq, dk, dv, dg, ds0, dq_ref, dk_ref, dv_ref, dg_ref, dstate_ref, dh0_ref):
    """A chunk's gradients out; ``ds0`` carried to the chunk before, or out as dh0 at a first chunk."""
    dq_ref[...] = dq
    dk_ref[...] = dk
    dv_ref[...] = dv
    dg_ref[...] = dg
    dstate_ref[...] = ds0

    @pl.when(first == 1)
    def _():
        dh0_ref[...] = ds0


# ---------------------------------------------------------------- pallas_calls on the chunk list

@dataclasses.dataclass(frozen=True)
class _Config:
    """The kernels' static settings (hashable: a jit and custom_vjp static argument)."""

    scale: float
    delta: bool
    interpret: bool | None
    per_channel: bool = False  # g per key channel


def _specs(heads, value_heads, num_chunks, k_dim, v_dim, *, reverse=False):
    """BlockSpec makers over the (value head, chunk) grid; ``reverse`` walks the chunks backwards."""
    group = value_heads // heads
    chunk = (lambda c: num_chunks - 1 - c) if reverse else (lambda c: c)
    return dict(
        # lax.div, not //: floor division of signed ints lowers through sign, which needs a TPU
        qk=pl.BlockSpec((None, CHUNK, k_dim), lambda h, c, *_: (jax.lax.div(h, jnp.int32(group)), chunk(c), 0)),
        per_head_k=pl.BlockSpec((None, CHUNK, k_dim), lambda h, c, *_: (h, chunk(c), 0)),
        v=pl.BlockSpec((None, CHUNK, v_dim), lambda h, c, *_: (h, chunk(c), 0)),
        col=pl.BlockSpec((None, CHUNK, 1), lambda h, c, *_: (h, chunk(c), 0)),
        row=pl.BlockSpec((None, None, 1, CHUNK), lambda h, c, *_: (h, chunk(c), 0, 0)),
        seq_state=pl.BlockSpec((None, None, k_dim, v_dim), lambda h, c, seq, *_: (seq[chunk(c)], h, 0, 0)),
        chunk_state=pl.BlockSpec((None, None, k_dim, v_dim), lambda h, c, *_: (h, chunk(c), 0, 0)),
    )


def _launch(kernel, cfg, grid, in_specs, out_specs, out_shape, state_shape, scalars, inputs):
    """``pallas_call`` of ``kernel`` over ``grid`` with one VMEM state; a grid without steps (no
    sequences or no value heads) launches nothing: its outputs are all empty, and Pallas would
    still evaluate a first step's index maps, reading past the empty scalar-prefetch lists."""
    if 0 in grid:
        return [jnp.zeros(shape.shape, shape.dtype) for shape in out_shape]
    return list(pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars), grid=grid, in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM(state_shape, _F32)]),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret_params(cfg.interpret),
    )(*scalars, *inputs))


def _run_forward(cfg, q, k, v, g, beta, h0, seq, first, last, *, with_output, with_states):
    """The forward kernel on the chunk list: (o or None, final states, chunk start states or None)."""
    heads, length, k_dim = k.shape
    value_heads, _, v_dim = v.shape
    num_chunks = length // CHUNK
    spec = _specs(heads, value_heads, num_chunks, k_dim, v_dim)
    inputs = ([q] if with_output else []) + [k, v, g] + ([beta] if cfg.delta else []) + [h0]
    gates = spec["per_head_k"] if cfg.per_channel else spec["row"]
    in_specs = (([spec["qk"]] if with_output else []) + [spec["qk"], spec["v"], gates]
                + ([spec["col"]] if cfg.delta else []) + [spec["seq_state"]])
    out_specs, out_shape = [], []
    if with_output:
        out_specs.append(spec["v"])
        out_shape.append(jax.ShapeDtypeStruct(v.shape, v.dtype))
    out_specs.append(spec["seq_state"])
    out_shape.append(jax.ShapeDtypeStruct(h0.shape, _F32))
    if with_states:
        out_specs.append(spec["chunk_state"])
        out_shape.append(jax.ShapeDtypeStruct((value_heads, num_chunks, k_dim, v_dim), _F32))
    kernel = functools.partial(_forward_kernel, scale=cfg.scale, delta=cfg.delta, per_channel=cfg.per_channel,
                               with_output=with_output, with_states=with_states)
    outs = _launch(kernel, cfg, (value_heads, num_chunks), in_specs, out_specs, out_shape, (k_dim, v_dim),
                   (seq, first, last), inputs)
    o = outs.pop(0) if with_output else None
    ht = outs.pop(0)
    return o, ht, (outs.pop(0) if with_states else None)


def _run_backward(cfg, q, k, v, g, beta, h0, seq, first, last, do, dht):
    """Gradients on the chunk list: (dq, dk, dv, dg, dbeta or None, dh0), in the inputs' dtypes."""
    heads, length, k_dim = k.shape
    value_heads, _, v_dim = v.shape
    num_chunks = length // CHUNK
    _, _, starts = _run_forward(cfg, q, k, v, g, beta, h0, seq, first, last, with_output=False, with_states=True)
    spec = _specs(heads, value_heads, num_chunks, k_dim, v_dim, reverse=True)
    inputs = [q, k, v, g] + ([beta] if cfg.delta else []) + [starts, do, dht]
    gates = spec["per_head_k"] if cfg.per_channel else spec["row"]
    in_specs = ([spec["qk"], spec["qk"], spec["v"], gates] + ([spec["col"]] if cfg.delta else [])
                + [spec["chunk_state"], spec["v"], spec["seq_state"]])
    per_head_k = jax.ShapeDtypeStruct((value_heads, length, k_dim), _F32)
    out_shape = [per_head_k, per_head_k, jax.ShapeDtypeStruct(v.shape, _F32), jax.ShapeDtypeStruct(g.shape, _F32)]
    out_specs = [spec["per_head_k"], spec["per_head_k"], spec["v"], gates]
    if cfg.delta:
        out_shape.append(jax.ShapeDtypeStruct((value_heads, length, 1), _F32))
        out_specs.append(spec["col"])
    out_shape.append(jax.ShapeDtypeStruct(h0.shape, _F32))
    out_specs.append(spec["seq_state"])
    kernel = functools.partial(_backward_kernel, scale=cfg.scale, delta=cfg.delta, per_channel=cfg.per_channel,
                               num_chunks=num_chunks)
    outs = _launch(kernel, cfg, (value_heads, num_chunks), in_specs, out_specs, out_shape, (k_dim, v_dim),
                   (seq, first, last), inputs)
    dq, dk, dv, dg = outs[:4]
    dbeta = outs[4] if cfg.delta else None
    dh0 = outs[-1]
    group = value_heads // heads
    dq = dq.reshape(heads, group, length, k_dim).sum(axis=1)  # value heads sharing a q/k head
    dk = dk.reshape(heads, group, length, k_dim).sum(axis=1)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dg,
            None if dbeta is None else dbeta.astype(beta.dtype), dh0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk_core(cfg, q, k, v, g, beta, h0, seq, first, last):
    """(o, final states) on the chunk list (see the module docstring); differentiable."""
    o, ht, _ = _run_forward(cfg, q, k, v, g, beta, h0, seq, first, last, with_output=True, with_states=False)
    return o, ht


def _chunk_core_fwd(cfg, *args):
    return _chunk_core(cfg, *args), args


def _chunk_core_bwd(cfg, args, cotangents):
    do, dht = cotangents
    return _run_backward(cfg, *args, do, dht) + (None, None, None)


_chunk_core.defvjp(_chunk_core_fwd, _chunk_core_bwd)


# ---------------------------------------------------------------- host-side layout

def _offsets(cu_seqlens) -> tuple[int, ...]:
    if isinstance(cu_seqlens, jax.core.Tracer):
        raise ValueError("cu_seqlens: expected concrete offsets (they decide the kernels' chunk layout); "
                         "pass them as a NumPy array or tuple, not a traced value")
    return tuple(int(x) for x in np.asarray(cu_seqlens).reshape(-1))


def _spans(cu_seqlens, batch: int, length: int) -> tuple[tuple[int, int], ...]:
    """(start, end) of each sequence in the flattened ``B * T`` tokens."""
    if cu_seqlens is None:
        return tuple((i * length, (i + 1) * length) for i in range(batch))
    bounds = _offsets(cu_seqlens)
    return tuple(zip(bounds[:-1], bounds[1:]))


def _device_arrays(*arrays):
    # JAX arrays, not NumPy ones: they become vjp residuals, which torchax must hold as tensors;
    # concrete even when made while tracing (they are cached)
    with jax.ensure_compile_time_eval():
        return tuple(jnp.asarray(a) for a in arrays)


@functools.lru_cache(maxsize=256)
def _chunk_layout(spans, num_tokens: int):
    """Each sequence padded to whole chunks (at least one: an empty sequence passes its state on).

    Returns gather (per padded position, its token, or ``num_tokens`` for a zero row), scatter
    (per token, its padded position), and per chunk its sequence and first / last flags.
    """
    chunks = np.array([max(1, round_up(end - start, CHUNK) // CHUNK) for start, end in spans], np.int64)
    starts = np.concatenate([[0], np.cumsum(chunks)[:-1]]) * CHUNK
    gather = np.full(int(chunks.sum()) * CHUNK, num_tokens, np.int32)
    scatter = np.zeros(num_tokens, np.int32)
    for (start, end), at in zip(spans, starts):
        gather[at:at + end - start] = np.arange(start, end)
        scatter[start:end] = np.arange(at, at + end - start)
    seq = np.repeat(np.arange(len(spans), dtype=np.int32), chunks)
    ends = np.cumsum(chunks)
    first = np.zeros(seq.shape, np.int32)
    first[ends - chunks] = 1
    last = np.zeros(seq.shape, np.int32)
    last[ends - 1] = 1
    return _device_arrays(gather, scatter, seq, first, last)


@functools.lru_cache(maxsize=256)
def _step_layout(spans, num_tokens: int):
    """Sequences stacked as rows padded to the longest: gather ``[N, L]`` and scatter (per token)."""
    longest = max([end - start for start, end in spans] + [0])
    gather = np.full((len(spans), longest), num_tokens, np.int32)
    scatter = np.zeros(num_tokens, np.int32)
    for n, (start, end) in enumerate(spans):
        gather[n, :end - start] = np.arange(start, end)
        scatter[start:end] = n * longest + np.arange(end - start)
    return _device_arrays(gather, scatter)


def l2_normalize(x):
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last axis, in float32."""
    x = x.astype(_F32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + EPS)


def _pack(x, gather):
    """Rows of ``x [B, T, ...]`` picked by ``gather`` from the flattened tokens (past the end: 0)."""
    flat = x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])  # not -1: ambiguous for empty x
    flat = jnp.concatenate([flat, jnp.zeros((1,) + flat.shape[1:], flat.dtype)])
    return flat[gather]


def _pad_last(x, size):
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def _states(initial_state, num_states, value_heads, k_dim, v_dim):
    if initial_state is None:
        return jnp.zeros((num_states, value_heads, k_dim, v_dim), _F32)
    return initial_state.astype(_F32)


def _prepare_chunks(q, k, v, g, beta, initial_state, gather, *, l2norm, num_states):
    """The chunk list's operands of ``_chunk_core`` from the user's layout (differentiable)."""
    value_heads, v_dim = v.shape[2:]
    k_dim = q.shape[3]
    kp, vp = round_up(k_dim, LANES), round_up(v_dim, LANES)
    if l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    heads_first = lambda x, size: _pad_last(jnp.moveaxis(_pack(x, gather), 1, 0), size)  # noqa: E731
    gates = (value_heads, gather.shape[0] // CHUNK, 1, CHUNK)  # a row per chunk
    if g is None:
        g = jnp.zeros(gates, _F32)
    elif g.ndim == 4:  # per key channel: laid out as k
        g = heads_first(g.astype(_F32), kp)
    else:
        g = _pack(g.astype(_F32), gather).T.reshape(gates)
    beta = None if beta is None else _pack(beta, gather).T[..., None]
    h0 = _states(initial_state, num_states, value_heads, k_dim, v_dim)
    h0 = jnp.pad(h0, ((0, 0), (0, 0), (0, kp - k_dim), (0, vp - v_dim)))
    return heads_first(q, kp), heads_first(k, kp), heads_first(v, vp), g, beta, h0


def _finish_chunks(o, ht, scatter, v_shape, k_dim):
    """(o [B, T, HV, V], final states [N, HV, K, V]) from the chunk list's outputs."""
    v_dim = v_shape[3]
    o = jnp.moveaxis(o[:, scatter, :v_dim], 0, 1).reshape(v_shape)
    return o, ht[:, :, :k_dim, :v_dim]


def _chunk_args(q, v, cu_seqlens):
    batch, length = q.shape[:2]
    spans = _spans(cu_seqlens, batch, length)
    return spans, _chunk_layout(spans, batch * length)


@functools.partial(jax.jit, static_argnames=("cfg", "l2norm", "num_states"))
def _chunk_forward(q, k, v, g, beta, initial_state, gather, scatter, seq, first, last, *, cfg, l2norm, num_states):
    prepared = _prepare_chunks(q, k, v, g, beta, initial_state, gather, l2norm=l2norm, num_states=num_states)
    o, ht = _chunk_core(cfg, *prepared, seq, first, last)
    return _finish_chunks(o, ht, scatter, v.shape, q.shape[3])


@functools.partial(jax.jit, static_argnames=("cfg", "l2norm", "num_states"))
def _chunk_backward(do, dht, q, k, v, g, beta, initial_state, gather, scatter, seq, first, last, *, cfg, l2norm,
                    num_states):
    """The gradients without running the forward kernel: the layout maps are linear or cheap, so
    their vjps wrap ``_run_backward`` directly."""
    def prepare(*inputs):
        return _prepare_chunks(*inputs, gather, l2norm=l2norm, num_states=num_states)

    prepared, prepare_vjp = jax.vjp(prepare, q, k, v, g, beta, initial_state)
    vc, h0c = prepared[2], prepared[5]
    _, finish_vjp = jax.vjp(lambda o, ht: _finish_chunks(o, ht, scatter, v.shape, q.shape[3]),
                            jnp.zeros(vc.shape, vc.dtype), jnp.zeros(h0c.shape, _F32))
    if dht is None:
        dht = jnp.zeros(h0c.shape[:2] + (q.shape[3], v.shape[3]), _F32)
    d_o, d_ht = finish_vjp((do.astype(v.dtype), dht.astype(_F32)))
    grads = _run_backward(cfg, *prepared, seq, first, last, d_o, d_ht)
    return prepare_vjp(grads)


def _config(q, g, scale, delta, interpret):
    if q.dtype == jnp.float64:
        raise NotImplementedError("pallas: float64 is not supported (TPUs have no float64)")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _Config(scale=scale, delta=delta, interpret=interpret, per_channel=g is not None and g.ndim == 4)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False,
                           *, interpret=None):
    """Gated DeltaNet by the chunked Pallas kernels; ``(o [B, T, HV, V], final states [N, HV, K, V])``.

    ``g=None`` means no decay. ``cu_seqlens`` (B = 1) must be concrete (NumPy, a tuple or an
    unjitted array). Differentiable in q, k, v, g, beta and initial_state (``jax.grad``).
    """
    cfg = _config(q, g, scale, True, interpret)
    spans, layout = _chunk_args(q, v, cu_seqlens)
    return _chunk_forward(q, k, v, g, beta, initial_state, *layout, cfg=cfg, l2norm=bool(use_qk_l2norm),
                          num_states=len(spans))


def chunk_simple_gla(q, k, v, g=None, scale=None, initial_state=None, cu_seqlens=None, *, interpret=None):
    """Simple gated linear attention (one log decay per head and step, or none) by the chunked
    Pallas kernels; arguments and results as :func:`chunk_gated_delta_rule` without beta."""
    cfg = _config(q, g, scale, False, interpret)
    spans, layout = _chunk_args(q, v, cu_seqlens)
    return _chunk_forward(q, k, v, g, None, initial_state, *layout, cfg=cfg, l2norm=False, num_states=len(spans))


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False, *,
              interpret=None):
    """Kimi Delta Attention: :func:`chunk_gated_delta_rule` with a log decay per key channel, ``g
    [B, T, HV, K]``, by the same chunked kernels (both directions)."""
    if g is None or g.ndim != 4:
        got = "None" if g is None else f"shape {tuple(g.shape)}"
        raise ValueError(f"g: expected a decay per key channel [B, T, HV, K], got {got}")
    return chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm,
                                  interpret=interpret)


def chunk_backward(do, dht, q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False,
                   *, interpret=None):
    """``(dq, dk, dv, dg, dbeta, dh0)`` of the chunked op (``beta=None``: simple GLA) for output
    gradient ``do`` and final-state gradient ``dht`` (None: unused), by the backward kernels.
    Gradients of absent inputs are None."""
    cfg = _config(q, g, scale, beta is not None, interpret)
    spans, layout = _chunk_args(q, v, cu_seqlens)
    return _chunk_backward(do, dht, q, k, v, g, beta, initial_state, *layout, cfg=cfg,
                           l2norm=bool(use_qk_l2norm) and beta is not None, num_states=len(spans))


# ---------------------------------------------------------------- the recurrent (step) form

def _scan(q, k, v, g, beta, h0, scale):
    """The recurrence over axis 1 of ``[N, L, HV, *]`` float32 inputs from states ``h0``; ``g``
    ``[N, L, HV]`` per head or ``[N, L, HV, K]`` per key channel (row c of the state by its own)."""
    def step(state, x):
        q_t, k_t, v_t, g_t, beta_t = x
        decay = jnp.exp(g_t)
        state = state * (decay[..., None] if decay.ndim == state.ndim - 1 else decay[..., None, None])
        if beta_t is None:
            update = v_t
        else:
            error = v_t - jnp.einsum("nhkv,nhk->nhv", state, k_t, precision=_HIGHEST)
            update = beta_t[..., None] * error
        state = state + k_t[..., :, None] * update[..., None, :]
        return state, jnp.einsum("nhkv,nhk->nhv", state, scale * q_t, precision=_HIGHEST)

    time_first = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)  # noqa: E731
    final, o = jax.lax.scan(step, h0, tuple(map(time_first, (q, k, v, g, beta))))
    return jnp.moveaxis(o, 0, 1), final


@functools.partial(jax.jit, static_argnames=("scale", "l2norm", "num_states"))
def _recurrent(q, k, v, g, beta, initial_state, gather, scatter, *, scale, l2norm, num_states):
    batch, length, heads, k_dim = q.shape
    value_heads, v_dim = v.shape[2:]
    out_dtype = v.dtype
    q, k, v = (x.astype(_F32) for x in (q, k, v))
    if l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q, k = (jnp.repeat(x, value_heads // heads, axis=2) for x in (q, k))
    g = jnp.zeros(v.shape[:3], _F32) if g is None else g.astype(_F32)
    beta = None if beta is None else beta.astype(_F32)
    h0 = _states(initial_state, num_states, value_heads, k_dim, v_dim)
    packed = [None if x is None else _pack(x, gather) for x in (q, k, v, g, beta)]
    o, final = _scan(*packed, h0, scale)
    o = o.reshape((o.shape[0] * o.shape[1], value_heads, v_dim))[scatter].reshape(batch, length, value_heads, v_dim)
    return o.astype(out_dtype), final


def _recurrent_args(q, v, scale, cu_seqlens):
    if q.dtype == jnp.float64:
        raise NotImplementedError("pallas: float64 is not supported (TPUs have no float64)")
    batch, length = q.shape[:2]
    spans = _spans(cu_seqlens, batch, length)
    return spans, _step_layout(spans, batch * length), q.shape[-1] ** -0.5 if scale is None else float(scale)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                                     use_qk_l2norm=False):
    """The recurrence one step at a time (``lax.scan``; ``beta=None``: linear attention); as
    :func:`chunk_gated_delta_rule`. Differentiable by JAX."""
    spans, layout, scale = _recurrent_args(q, v, scale, cu_seqlens)
    return _recurrent(q, k, v, g, beta, initial_state, *layout, scale=scale, l2norm=bool(use_qk_l2norm),
                      num_states=len(spans))


def recurrent_backward(do, dht, q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None,
                       use_qk_l2norm=False):
    """``(dq, dk, dv, dg, dbeta, dh0)`` of :func:`fused_recurrent_gated_delta_rule` (None for
    absent inputs)."""
    spans, layout, scale = _recurrent_args(q, v, scale, cu_seqlens)

    def forward(*inputs):
        return _recurrent(*inputs, *layout, scale=scale, l2norm=bool(use_qk_l2norm), num_states=len(spans))

    (o, ht), vjp = jax.vjp(forward, q, k, v, g, beta, initial_state)
    dht = jnp.zeros_like(ht) if dht is None else dht.astype(ht.dtype)
    return vjp((do.astype(o.dtype), dht))

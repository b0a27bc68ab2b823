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
beta = 0 and g = 0, so they leave the state as it is. The log decays become per-chunk cumulative
sums ``b`` (given to the kernel both as a column and as a row, so that no in-kernel transpose is
needed for ``b_t - b_s``). Packed sequences are thus handled on the host side (their offsets are
concrete): three scalar-prefetched int32 lists say, per chunk, its sequence and whether it is
that sequence's first or last chunk, and the kernels reset the state there.

The forward kernel's grid is (value head: parallel, chunk: arbitrary); the state lives in a VMEM
scratch across the chunks of a head. A chunk with start state ``S0``, ``D_ts = exp(b_t - b_s)``
(``s <= t``) and ``E = exp(b)``, in the WY representation:

- ``A = strict_lower(D * diag(beta) K K^T)``; ``Tinv = (I + A)^{-1}`` by recursive doubling of
  inverted diagonal blocks (1, 2, 4, ... 64 wide: two 64x64 matmuls per level), a stable blocked
  forward substitution;
- effective values ``W = Tinv diag(beta) (V - E * K S0)`` (or ``W = V`` without beta);
- ``O = scale (E * Q S0 + (D * Q K^T) W)``; ``S_end = exp(b_C) S0 + (K * exp(b_C - b))^T W``.

The backward (a ``jax.custom_vjp``) stores nothing from the forward but its inputs: it recomputes
the chunk start states with the forward kernel (states only, no output), then runs a second kernel
over the chunks in reverse order that carries dS (the state's gradient) in VMEM, recomputes the
chunk's WY quantities and writes dq, dk, dv, d(b) (as a column and a row part) and dbeta; the
cumulative sums, padding, normalization and head grouping are undone by JAX's autodiff.

**Recurrent form.** ``fused_recurrent_gated_delta_rule`` is a ``lax.scan`` over time steps in
jnp (the decode form: a few tokens from a carried state), differentiated by JAX; it is also the
reference these kernels are compared with in pure JAX.

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
LANES = 128
EPS = 1e-6
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


def _chunk_terms(k, v, b_col, b_row, beta, s0):
    """What forward and backward both need of a chunk: masks, decays and the effective values."""
    shape = (k.shape[0], k.shape[0])
    rows, cols = _iota(shape, 0), _iota(shape, 1)
    lower, strict = rows >= cols, rows > cols
    # masked before exp: above the diagonal b_t - b_s > 0 may overflow
    decay = jnp.exp(jnp.where(lower, b_col - b_row, -jnp.inf))
    terms = dict(lower=lower, strict=strict, decay=decay, e=jnp.exp(b_col))
    if beta is None:
        terms["w"] = v
        return terms
    kk = _dot(k, k, tb=True)
    inverse = _unit_lower_inverse(jnp.where(strict, decay * kk * beta, 0.0))
    ks = _dot(k, s0)
    u = v - terms["e"] * ks
    terms.update(kk=kk, inverse=inverse, ks=ks, u=u, w=_dot(inverse, beta * u))
    return terms


def _take(refs, present):
    return refs.pop(0) if present else None


def _forward_kernel(seq_ref, first_ref, last_ref, *refs, scale, delta, with_output, with_states):
    del seq_ref  # used by the index maps only
    refs = list(refs)
    q_ref = _take(refs, with_output)
    k_ref, v_ref, b_col_ref, b_row_ref = (refs.pop(0) for _ in range(4))
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
    b_col = b_col_ref[...]
    beta = beta_ref[...].astype(_F32) if delta else None
    terms = _chunk_terms(k, v, b_col, b_row_ref[...], beta, s0)
    w = terms["w"]
    if with_output:
        q = q_ref[...].astype(_F32) * scale
        o = terms["e"] * _dot(q, s0) + _dot(terms["decay"] * _dot(q, k, tb=True), w)
        o_ref[...] = o.astype(o_ref.dtype)
    last_b = b_col[-1:, :]
    s1 = jnp.exp(last_b) * s0 + _dot(k * jnp.exp(last_b - b_col), w, ta=True)
    state_ref[...] = s1

    @pl.when(last_ref[c] == 1)
    def _():
        ht_ref[...] = s1


def _row_sum(x):
    return jnp.sum(x, axis=1, keepdims=True)


def _backward_kernel(seq_ref, first_ref, last_ref, *refs, scale, delta, num_chunks):
    del seq_ref
    refs = list(refs)
    q_ref, k_ref, v_ref, b_col_ref, b_row_ref = (refs.pop(0) for _ in range(5))
    beta_ref = _take(refs, delta)
    s0_ref, do_ref, dht_ref, dq_ref, dk_ref, dv_ref, db_col_ref, db_row_ref = (refs.pop(0) for _ in range(8))
    dbeta_ref = _take(refs, delta)
    dh0_ref, dstate_ref = refs
    c = num_chunks - 1 - pl.program_id(1)

    @pl.when(last_ref[c] == 1)
    def _():
        dstate_ref[...] = dht_ref[...]

    ds1, s0 = dstate_ref[...], s0_ref[...]
    q = q_ref[...].astype(_F32) * scale
    k, v, do = k_ref[...].astype(_F32), v_ref[...].astype(_F32), do_ref[...].astype(_F32)
    b_col = b_col_ref[...]
    beta = beta_ref[...].astype(_F32) if delta else None
    t = _chunk_terms(k, v, b_col, b_row_ref[...], beta, s0)
    decay, e, w = t["decay"], t["e"], t["w"]
    last_b = b_col[-1:, :]
    f = jnp.exp(last_b - b_col)

    # o = e * (q S0) + (decay * q k^T) W and S1 = exp(b_C) S0 + (k f)^T W
    qk = _dot(q, k, tb=True)
    dw = _dot(decay * qk, do, ta=True) + _dot(k * f, ds1)
    dp = jnp.where(t["lower"], _dot(do, w, tb=True), 0.0)
    dqk = dp * decay
    dq = e * _dot(do, s0, tb=True) + _dot(dqk, k)
    w_ds = _dot(w, ds1, tb=True)
    dk = _dot(dqk, q, ta=True) + f * w_ds
    ds0 = _dot(q * e, do, ta=True) + jnp.exp(last_b) * ds1
    d_decay = dp * qk
    df = f * _row_sum(k * w_ds)
    db = e * _row_sum(do * _dot(q, s0)) - df
    d_last = jnp.sum(df, axis=0, keepdims=True) + jnp.exp(last_b) * jnp.sum(_row_sum(s0 * ds1), axis=0, keepdims=True)
    if delta:
        # W = Tinv (beta u), u = v - e * (k S0), Tinv = (I + strict(decay * beta k k^T))^{-1}
        dr = _dot(t["inverse"], dw, ta=True)
        da = jnp.where(t["strict"], -_dot(dr, w, tb=True), 0.0)
        kk = t["kk"]
        dbeta_ref[...] = _row_sum(dr * t["u"]) + _row_sum(da * decay * kk)
        du = beta * dr
        dv = du
        db = db - e * _row_sum(du * t["ks"])
        dk = dk - _dot(e * du, s0, tb=True)
        ds0 = ds0 - _dot(k * e, du, ta=True)
        d_decay = d_decay + da * beta * kk
        dkk = da * decay * beta
        dk = dk + _dot(dkk, k) + _dot(dkk, k, ta=True)
    else:
        dv = dw
    # decay_ts = exp(b_t - b_s): its gradient goes to b_t (row sums) and -b_s (column sums)
    dz = d_decay * decay
    rows = _iota(db.shape, 0)
    db_col_ref[...] = db + _row_sum(dz) + jnp.where(rows == db.shape[0] - 1, d_last, 0.0)
    db_row_ref[...] = -jnp.sum(dz, axis=0, keepdims=True)
    dq_ref[...] = dq * scale
    dk_ref[...] = dk
    dv_ref[...] = dv
    dstate_ref[...] = ds0

    @pl.when(first_ref[c] == 1)
    def _():
        dh0_ref[...] = ds0


# ---------------------------------------------------------------- pallas_calls on the chunk list

@dataclasses.dataclass(frozen=True)
class _Config:
    """The kernels' static settings (hashable: a jit and custom_vjp static argument)."""

    scale: float
    delta: bool
    interpret: bool | None


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


def _compiler_params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"))


def _run_forward(cfg, q, k, v, b, beta, h0, seq, first, last, *, with_output, with_states):
    """The forward kernel on the chunk list: (o or None, final states, chunk start states or None)."""
    heads, length, k_dim = k.shape
    value_heads, _, v_dim = v.shape
    num_chunks = length // CHUNK
    spec = _specs(heads, value_heads, num_chunks, k_dim, v_dim)
    b_col, b_row = b.reshape(value_heads, length, 1), b.reshape(value_heads, num_chunks, 1, CHUNK)
    inputs = ([q] if with_output else []) + [k, v, b_col, b_row] + ([beta] if cfg.delta else []) + [h0]
    in_specs = (([spec["qk"]] if with_output else []) + [spec["qk"], spec["v"], spec["col"], spec["row"]]
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
    outs = pl.pallas_call(
        functools.partial(_forward_kernel, scale=cfg.scale, delta=cfg.delta, with_output=with_output,
                          with_states=with_states),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(value_heads, num_chunks), in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((k_dim, v_dim), _F32)]),
        out_shape=out_shape,
        compiler_params=_compiler_params(),
        interpret=interpret_params(cfg.interpret),
    )(seq, first, last, *inputs)
    outs = list(outs)
    o = outs.pop(0) if with_output else None
    ht = outs.pop(0)
    return o, ht, (outs.pop(0) if with_states else None)


def _run_backward(cfg, q, k, v, b, beta, h0, seq, first, last, do, dht):
    """Gradients on the chunk list: (dq, dk, dv, db, dbeta or None, dh0), in the inputs' dtypes."""
    heads, length, k_dim = k.shape
    value_heads, _, v_dim = v.shape
    num_chunks = length // CHUNK
    _, _, starts = _run_forward(cfg, q, k, v, b, beta, h0, seq, first, last, with_output=False, with_states=True)
    spec = _specs(heads, value_heads, num_chunks, k_dim, v_dim, reverse=True)
    b_col, b_row = b.reshape(value_heads, length, 1), b.reshape(value_heads, num_chunks, 1, CHUNK)
    inputs = [q, k, v, b_col, b_row] + ([beta] if cfg.delta else []) + [starts, do, dht]
    in_specs = ([spec["qk"], spec["qk"], spec["v"], spec["col"], spec["row"]] + ([spec["col"]] if cfg.delta else [])
                + [spec["chunk_state"], spec["v"], spec["seq_state"]])
    per_head_k = jax.ShapeDtypeStruct((value_heads, length, k_dim), _F32)
    col = jax.ShapeDtypeStruct((value_heads, length, 1), _F32)
    out_shape = [per_head_k, per_head_k, jax.ShapeDtypeStruct(v.shape, _F32), col,
                 jax.ShapeDtypeStruct((value_heads, num_chunks, 1, CHUNK), _F32)]
    out_specs = [spec["per_head_k"], spec["per_head_k"], spec["v"], spec["col"], spec["row"]]
    if cfg.delta:
        out_shape.append(col)
        out_specs.append(spec["col"])
    out_shape.append(jax.ShapeDtypeStruct(h0.shape, _F32))
    out_specs.append(spec["seq_state"])
    outs = list(pl.pallas_call(
        functools.partial(_backward_kernel, scale=cfg.scale, delta=cfg.delta, num_chunks=num_chunks),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(value_heads, num_chunks), in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=[pltpu.VMEM((k_dim, v_dim), _F32)]),
        out_shape=out_shape,
        compiler_params=_compiler_params(),
        interpret=interpret_params(cfg.interpret),
    )(seq, first, last, *inputs))
    dq, dk, dv, db_col, db_row = outs[:5]
    dbeta = outs[5] if cfg.delta else None
    dh0 = outs[-1]
    group = value_heads // heads
    dq = dq.reshape(heads, group, length, k_dim).sum(axis=1)  # value heads sharing a q/k head
    dk = dk.reshape(heads, group, length, k_dim).sum(axis=1)
    db = db_col.reshape(b.shape) + db_row.reshape(b.shape)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), db,
            None if dbeta is None else dbeta.astype(beta.dtype), dh0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunk_core(cfg, q, k, v, b, beta, h0, seq, first, last):
    """(o, final states) on the chunk list (see the module docstring); differentiable."""
    o, ht, _ = _run_forward(cfg, q, k, v, b, beta, h0, seq, first, last, with_output=True, with_states=False)
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
    flat = x.reshape((-1,) + x.shape[2:])
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
    length = gather.shape[0]
    if g is None:
        b = jnp.zeros((value_heads, length // CHUNK, CHUNK), _F32)
    else:
        b = jnp.cumsum(_pack(g.astype(_F32), gather).T.reshape(value_heads, -1, CHUNK), axis=-1)
    beta = None if beta is None else _pack(beta, gather).T[..., None]
    h0 = _states(initial_state, num_states, value_heads, k_dim, v_dim)
    h0 = jnp.pad(h0, ((0, 0), (0, 0), (0, kp - k_dim), (0, vp - v_dim)))
    return heads_first(q, kp), heads_first(k, kp), heads_first(v, vp), b, beta, h0


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


def _config(q, scale, delta, interpret):
    if q.dtype == jnp.float64:
        raise NotImplementedError("pallas: float64 is not supported (TPUs have no float64)")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _Config(scale=scale, delta=delta, interpret=interpret)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False,
                           *, interpret=None):
    """Gated DeltaNet by the chunked Pallas kernels; ``(o [B, T, HV, V], final states [N, HV, K, V])``.

    ``g=None`` means no decay. ``cu_seqlens`` (B = 1) must be concrete (NumPy, a tuple or an
    unjitted array). Differentiable in q, k, v, g, beta and initial_state (``jax.grad``).
    """
    cfg = _config(q, scale, True, interpret)
    spans, layout = _chunk_args(q, v, cu_seqlens)
    return _chunk_forward(q, k, v, g, beta, initial_state, *layout, cfg=cfg, l2norm=bool(use_qk_l2norm),
                          num_states=len(spans))


def chunk_simple_gla(q, k, v, g=None, scale=None, initial_state=None, cu_seqlens=None, *, interpret=None):
    """Simple gated linear attention (one log decay per head and step, or none) by the chunked
    Pallas kernels; arguments and results as :func:`chunk_gated_delta_rule` without beta."""
    cfg = _config(q, scale, False, interpret)
    spans, layout = _chunk_args(q, v, cu_seqlens)
    return _chunk_forward(q, k, v, g, None, initial_state, *layout, cfg=cfg, l2norm=False, num_states=len(spans))


def chunk_backward(do, dht, q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False,
                   *, interpret=None):
    """``(dq, dk, dv, dg, dbeta, dh0)`` of the chunked op (``beta=None``: simple GLA) for output
    gradient ``do`` and final-state gradient ``dht`` (None: unused), by the backward kernels.
    Gradients of absent inputs are None."""
    cfg = _config(q, scale, beta is not None, interpret)
    spans, layout = _chunk_args(q, v, cu_seqlens)
    return _chunk_backward(do, dht, q, k, v, g, beta, initial_state, *layout, cfg=cfg,
                           l2norm=bool(use_qk_l2norm) and beta is not None, num_states=len(spans))


# ---------------------------------------------------------------- the recurrent (step) form

def _scan(q, k, v, g, beta, h0, scale):
    """The recurrence over axis 1 of ``[N, L, HV, *]`` float32 inputs from states ``h0``."""
    def step(state, x):
        q_t, k_t, v_t, g_t, beta_t = x
        state = state * jnp.exp(g_t)[..., None, None]
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
    o = o.reshape((-1, value_heads, v_dim))[scatter].reshape(batch, length, value_heads, v_dim)
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

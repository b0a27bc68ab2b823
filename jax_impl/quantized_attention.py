"""Quantized attention (SageAttention's recipe) as Pallas TPU kernels: INT8 ``Q K^T`` on the MXU
with int32 accumulation, a float32 base-2 online softmax, ``P V`` per ``pv_dtype``; and the exact
attention gradient (FlashAttention-2) as Pallas kernels, under ``jax.custom_vjp``.

The numbers are those of ``torch_kernels.reference.quantized_attention`` (its module docstring
defines them): the int8 values and scales are the reference's bit for bit, the softmax and P.V
agree to float32 rounding (accumulation order, exp2 / log2 / division to an ulp).

**Layout.** Inputs are ``[B, H, N, D]`` (the op's HND), or one packed batch (``B = 1``) with
concrete ``cu_seqlens`` offsets. Outside the kernels (jnp) every sequence's queries are padded
to whole query blocks and its keys to whole key blocks, with zero rows, heads first; the query
heads that share a kv head are stacked, ``[Hkv, G, rows, D]``. A sequence thus starts at a
multiple of 128 rows, so every quantization group is a fixed reshape of the rows, and zero
padding changes no group's amax. Keys and queries are smoothed (minus their sequence's mean, the
op's ``k_mean`` and ``q_mean``) before padding, so padding rows stay zero.

**Quantization** (jnp, fused by XLA; :func:`quantize_inputs` returns it): smoothed queries
``(float32(q) - q_mean) * float32(sm_scale log2 e)`` (the constant rounded once, on the host) and
smoothed keys, per group ``scale = amax / 127`` (1 where 0; a NaN makes amax inf), entries
``round_half_even(x / scale)`` clamped to +-127, NaN stored as 0. The divisions are true
divisions (XLA would otherwise multiply by a reciprocal, an ulp off; see :func:`_divide`), which
is what makes the int8 values the reference's bit for bit on CPU; a TPU's float32 division is
not checked here. Values for ``pv_dtype``: ``"fp16"`` V rounded to float16 (held as float32:
Mosaic has no float16; bfloat16 and float32 V first divided by a power of two per (sequence,
head, channel), 1 where it fits float16's range, so that none rounds to inf), ``"fp8"`` V per
(sequence, head, channel) scaled to float8_e4m3fn (held as bfloat16, exact), ``"none"`` V as given (float16 as float32). The granularity, the smoothing
(K's a flag, Q's means and key bias zeros when off, which change no number), the mask and
sm_scale are traced values, not static ones: they change no shape, and in interpret mode every
compile costs seconds (on a TPU, unsmoothed queries still read a zero key bias).

**Forward kernel.** Grid (kv head, query block, key block): a step holds the ``G`` query heads
of its kv head as one ``[G * block_q, D]`` int8 matrix and walks its key block in 64-key tiles,
the reference's softmax tiles: ``s = (float32(q8 k8^T) * q_scale) * k_scale + key_bias`` (int8
x int8 -> int32 dot; the key bias, Q smoothing's scores, per query head and key), masked to -inf
outside the sequence and causal window, ``m' = max(m, rowmax s)``, ``p = exp2(s - m')``,
``l = l exp2(m - m') + rowsum p``, ``acc = acc exp2(m - m') + P V`` with P rounded as the MMA
would read it: to float16 (``"fp16"``, and ``"none"`` for float16 inputs; by
integer rounding of the bits, Mosaic having no float16), ``e4m3fn(448 p)`` (``"fp8"``, also by
bits, then exact in bfloat16), bfloat16, or float32. Scalar prefetch gives each query block its
sequence, its first row, and the key blocks it sees (bottom-right causal blocks past the
diagonal are neither fetched nor computed). The last step writes ``acc / l`` (times
``v_scale / 448`` for fp8, ``v_scale`` for fp16's power of two) and ``m + log2 l``; jnp turns
the latter into the natural lse and adds the smoothing's ``sm_scale q . k_mean``.

**Backward** (the straight-through estimator: exact attention's gradient at the same inputs,
float32 from the inputs' values): the forward kernel in exact mode (float32 scores, float32
P.V) gives the exact lse and output, ``delta = rowsum(dO * O)`` in jnp, then a key-block kernel
walks the query blocks that see it for ``dK``, ``dV`` (summed over the ``G`` heads, which share
its rows) and a query-block kernel walks the key blocks for ``dQ``; ``dS = P (dP - delta +
dlse)``. Float32 matmuls run at HIGHEST precision. Gradients come in the inputs' dtypes.

Head sizes 64, 96 and 128 are taken (others raise NotImplementedError, so the op tries the next
backend); inputs float16, bfloat16 or float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import interpret_params, round_up

HEAD_SIZES = (64, 96, 128)
GRANULARITIES = ("per_block", "per_warp", "per_thread")
PV_DTYPES = ("fp16", "fp8", "none")
TILE_K = 64  # the softmax's key tile (the reference's BLOCK_K)
GROUP_Q, WARP_Q = 128, 32  # the query groups of per_block and per_warp
ALIGN = 128  # sequences start at multiples of this many padded rows (every group size divides it)
MAX_BLOCK_K = 512
INT8_MAX = 127
FP8_MAX = 448.0
FP16_MAX = 65504.0
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_F32 = jnp.float32
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Config:
    """Block sizes; 0 picks the heuristic default. Neither changes the numbers (the softmax
    walks 64-key tiles whatever the block).

    block_q: query rows per grid step and query head, a multiple of 128 (default 128).
    block_k: keys per grid step, a multiple of 128 (default: the longest key sequence rounded
        up to 128, at most 512).
    """

    block_q: int = 0
    block_k: int = 0


def _resolve_config(config: Config | None, longest_k: int) -> Config:
    config = config or Config()
    block_q = config.block_q or ALIGN
    block_k = config.block_k or min(MAX_BLOCK_K, round_up(max(longest_k, 1), ALIGN))
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value <= 0 or value % ALIGN:
            raise ValueError(f"config.{name}: expected a positive multiple of {ALIGN}, got {value}")
    return Config(block_q=block_q, block_k=block_k)


# ---------------------------------------------------------------- host-side layout

def _offsets(cu_seqlens, name: str) -> tuple[int, ...]:
    if isinstance(cu_seqlens, jax.core.Tracer):
        raise ValueError(f"{name}: expected concrete offsets (they decide the kernels' block layout); "
                         "pass them as a NumPy array or tuple, not a traced value")
    return tuple(int(x) for x in np.asarray(cu_seqlens).reshape(-1))


def _spans(batch: int, nq: int, nk: int, cu_seqlens_q, cu_seqlens_k):
    """((q start, q end), ...), ((k start, k end), ...) of every sequence in the flattened tokens."""
    if cu_seqlens_q is None:
        return (tuple((b * nq, (b + 1) * nq) for b in range(batch)),
                tuple((b * nk, (b + 1) * nk) for b in range(batch)))
    cq, ck = _offsets(cu_seqlens_q, "cu_seqlens_q"), _offsets(cu_seqlens_k, "cu_seqlens_k")
    return tuple(zip(cq[:-1], cq[1:])), tuple(zip(ck[:-1], ck[1:]))


class _Layout(typing.NamedTuple):
    """Host-side maps between tokens and padded rows, and the kernels' schedules: device arrays (a
    pytree the jitted functions take as traced arguments)."""

    q_gather: object  # [Pq] token of each padded query row (``q_tokens``: a zero row)
    q_scatter: object  # [q_tokens] padded row of each query token
    q_seq: object  # [Pq] sequence of each padded query row
    k_gather: object
    k_scatter: object
    k_seq: object  # [Pk] sequence of each padded key row (``num_seqs`` for padding rows)
    q_len: object  # [S] per sequence
    k_len: object
    causal: object  # [1] int32: 1 for bottom-right causal (the kernels mask by it)
    forward: tuple  # per query block: sequence, first row, first / last key block, key blocks seen
    keys: tuple  # per key block: sequence, first key, first query block (in the sequence), first /
    # last query block (global), query blocks that see it


def _device_arrays(*arrays):
    # JAX arrays, not NumPy ones: they become vjp residuals, which torchax must hold as tensors;
    # concrete even when made while tracing (they are cached)
    with jax.ensure_compile_time_eval():
        return tuple(jnp.asarray(a) for a in arrays)


@functools.lru_cache(maxsize=256)
def _layout(spans_q, spans_k, q_tokens: int, k_tokens: int, block_q: int, block_k: int, causal: bool):
    """(the :class:`_Layout`, the forward / dq grids' key extent, the dk / dv grid's query extent).

    The extents are those without the causal mask (the most key blocks of a sequence, the most
    query blocks): a causal sequence's last query block sees all its keys anyway, and with equal
    extents the causal and full calls share one compiled program."""
    num_seqs = len(spans_q)
    nq = np.array([e - s for s, e in spans_q], np.int64).reshape(-1)
    nk = np.array([e - s for s, e in spans_k], np.int64).reshape(-1)
    q_blocks, k_blocks = -(-nq // block_q), -(-nk // block_k)
    q_first = np.concatenate([[0], np.cumsum(q_blocks)[:-1]]).astype(np.int64)
    k_first = np.concatenate([[0], np.cumsum(k_blocks)[:-1]]).astype(np.int64)
    total_q = int(q_blocks.sum())
    total_k = max(1, int(k_blocks.sum()))  # one block of zeros when no sequence has keys

    q_gather = np.full(total_q * block_q, q_tokens, np.int32)
    q_scatter = np.zeros(q_tokens, np.int32)
    q_seq = np.zeros(total_q * block_q, np.int32)
    k_gather = np.full(total_k * block_k, k_tokens, np.int32)
    k_scatter = np.zeros(k_tokens, np.int32)
    k_seq = np.full(total_k * block_k, num_seqs, np.int32)
    for s, ((q0, q1), (k0, k1)) in enumerate(zip(spans_q, spans_k)):
        at = q_first[s] * block_q
        q_gather[at:at + q1 - q0] = np.arange(q0, q1)
        q_scatter[q0:q1] = np.arange(at, at + q1 - q0)
        q_seq[at:at + q_blocks[s] * block_q] = s
        at = k_first[s] * block_k
        k_gather[at:at + k1 - k0] = np.arange(k0, k1)
        k_scatter[k0:k1] = np.arange(at, at + k1 - k0)
        k_seq[at:at + k1 - k0] = s

    forward = np.zeros((5, total_q), np.int32)  # seq, first row, first / last key block, blocks seen
    for s in range(num_seqs):
        for b in range(q_blocks[s]):
            row0 = b * block_q
            keys = nk[s]
            if causal:  # the block's last real row sees keys up to row + nk - nq
                keys = int(np.clip(min(row0 + block_q, nq[s]) + nk[s] - nq[s], 0, nk[s]))
            seen = -(-keys // block_k)
            first = min(k_first[s], total_k - 1)
            forward[:, q_first[s] + b] = (s, row0, first, min(first + max(seen - 1, 0), total_k - 1), seen)

    keys = np.zeros((6, total_k), np.int32)  # seq, first key, first q block (local), first / last (global), count
    for s in range(num_seqs):
        for t in range(k_blocks[s]):
            key0 = t * block_k
            first_row = max(0, key0 - int(nk[s] - nq[s])) if causal else 0
            first_block = min(first_row // block_q, q_blocks[s]) if first_row < nq[s] else q_blocks[s]
            count = q_blocks[s] - first_block
            first = min(q_first[s] + first_block, max(total_q - 1, 0))
            keys[:, k_first[s] + t] = (s, key0, first_block, first, min(first + max(count - 1, 0),
                                                                         max(total_q - 1, 0)), count)
    arrays = _device_arrays(q_gather, q_scatter, q_seq, k_gather, k_scatter, k_seq, nq.astype(np.int32),
                            nk.astype(np.int32), np.array([int(causal)], np.int32), *forward, *keys)
    return (_Layout(*arrays[:9], forward=arrays[9:14], keys=arrays[14:20]),
            max(1, int(k_blocks.max(initial=0))), max(1, int(q_blocks.max(initial=0))))


def _rows(x, gather):
    """``x [B, H, N, D]`` as padded rows ``[H, P, D]`` (zero rows where ``gather`` is past the tokens)."""
    batch, heads, length = x.shape[:3]
    flat = jnp.moveaxis(x, 1, 0).reshape((heads, batch * length) + x.shape[3:])
    flat = jnp.concatenate([flat, jnp.zeros((heads, 1) + x.shape[3:], x.dtype)], axis=1)
    return flat[:, gather]


def _tokens(rows, scatter, batch: int, length: int):
    """Padded rows ``[H, P, ...]`` back to ``[B, H, N, ...]``."""
    heads = rows.shape[0]
    return jnp.moveaxis(rows[:, scatter].reshape((heads, batch, length) + rows.shape[2:]), 1, 0)


# ---------------------------------------------------------------- quantization (jnp)

def _divide(a, b):
    """``a / b`` correctly rounded, as the reference divides. XLA rewrites a division by a broadcast
    value as a multiplication by its reciprocal (an ulp off, and an ulp moves an int8 value that
    sits at a rounding tie); a divisor that comes out of an optimization barrier is divided by."""
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
    return a / jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, _F32), shape))


def _max_over(row_amax, shape, axes):
    """The max of ``row_amax [H, P]`` viewed as ``[H, *shape]`` over ``axes``, broadcast back to rows."""
    heads, rows = row_amax.shape
    g = row_amax.reshape((heads,) + shape).max(axis=axes, keepdims=True)
    return jnp.broadcast_to(g, (heads,) + shape).reshape(heads, rows)


def _group_max(row_amax, role: str, granularity):
    """Each row's group amax, ``row_amax [H, P]`` with P a multiple of 128 and sequences aligned to
    it; ``granularity`` a name or its index in GRANULARITIES (traced: every grouping is computed, one
    kept, so that the granularity does not make a program of its own)."""
    rows = row_amax.shape[1]
    if role == "k":  # per_block and per_warp: 64 keys; per_thread: key j = 64 t + 8 a + 2 b + c, group (t, b)
        groups = (_max_over(row_amax, (rows // TILE_K, TILE_K), (2,)),) * 2 + (
            _max_over(row_amax, (rows // TILE_K, 8, 4, 2), (2, 4)),)
    else:  # per_thread: query i = 32 w + 8 a + b, group (w, b)
        groups = (_max_over(row_amax, (rows // GROUP_Q, GROUP_Q), (2,)),
                  _max_over(row_amax, (rows // WARP_Q, WARP_Q), (2,)),
                  _max_over(row_amax, (rows // WARP_Q, 4, 8), (2,)))
    if isinstance(granularity, str):
        return groups[GRANULARITIES.index(granularity)]
    return jnp.select([granularity == i for i in range(len(groups))], groups)


def quantize_int8(x, role: str, granularity):
    """``(int8 [H, P, D], float32 per-row scale [H, P])`` of float32 rows ``x [H, P, D]`` grouped
    as the reference's ``row_groups`` (role ``"q"`` or ``"k"``; ``granularity`` a name or its
    index); P a multiple of 128, every sequence starting at a multiple of 128 rows, padding rows zero."""
    row_amax = jnp.max(jnp.abs(x), axis=-1)
    row_amax = jnp.where(jnp.any(jnp.isnan(x), axis=-1), jnp.inf, row_amax)  # a NaN is not dropped
    amax = _group_max(row_amax, role, granularity)
    scale = jnp.where(amax > 0, _divide(amax, INT8_MAX), jnp.float32(1.0))
    y = jnp.clip(jnp.round(_divide(x, scale[..., None])), -INT8_MAX, INT8_MAX)
    return jnp.where(jnp.isnan(y), 0.0, y).astype(jnp.int8), scale


def folded_scale(sm_scale: float) -> float:
    """``float32(sm_scale * log2(e))``, the constant folded into the queries (rounded once, on the host)."""
    return float(np.float32(float(sm_scale) * LOG2E))


def _value_amax(vf, k_seq, num_seqs: int):
    """float32 V rows ``[Hkv, Pk, D]``: max |v| per sequence, head and channel ``[S, Hkv, D]``, NaN
    where a NaN is (segment_max drops it)."""
    by_row = jnp.moveaxis(jnp.abs(vf), 1, 0)  # [Pk, Hkv, D]; padding rows are segment num_seqs
    amax = jax.ops.segment_max(by_row, k_seq, num_segments=num_seqs + 1)[:num_seqs]
    nan = jax.ops.segment_max(jnp.isnan(by_row).astype(_F32), k_seq, num_segments=num_seqs + 1)[:num_seqs] > 0
    return jnp.where(nan, jnp.nan, amax)


def _per_row(scale, k_seq):
    """``scale [S, Hkv, D]`` per row ``[Hkv, Pk, D]`` (padding rows 1)."""
    return jnp.moveaxis(jnp.concatenate([scale, jnp.ones((1,) + scale.shape[1:], _F32)])[k_seq], 0, 1)


def _fp8_values(v_rows, k_seq, num_seqs: int):
    """V rows ``[Hkv, Pk, D]`` as float8_e4m3fn values (held in bfloat16) and ``v_scale [S, Hkv, D]``
    per sequence, head and channel (``amax / 448``, 1 where 0 or NaN)."""
    vf = v_rows.astype(_F32)
    amax = _value_amax(vf, k_seq, num_seqs)
    scale = jnp.where(amax > 0, _divide(amax, FP8_MAX), jnp.float32(1.0))  # [S, Hkv, D]
    v8 = jnp.clip(_divide(vf, _per_row(scale, k_seq)), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return v8.astype(jnp.bfloat16), scale


def _fp16_values(v_rows, k_seq, num_seqs: int):
    """V rows ``[Hkv, Pk, D]`` of bfloat16 or float32 as float16 values (held in float32) after
    division by ``v_scale [S, Hkv, D]``, which it returns: per sequence, head and channel the
    least power of two ``2^e`` (``e >= 0``) with ``max |v| / 2^e <= 65504``, 1 where V fits float16
    (or the max is inf or NaN), so that V past float16's range makes no inf (the reference's
    ``value_scale``; exact, and the plain rounding wherever V fits)."""
    vf = v_rows.astype(_F32)
    amax = _value_amax(vf, k_seq, num_seqs)
    # amax = mantissa 2^exponent, mantissa in [0.5, 1): amax / 2^(exponent - 16) is in [32768, 65536)
    mantissa, exponent = jnp.frexp(amax)
    exponent = exponent - 16 + (mantissa * 65536.0 > FP16_MAX).astype(exponent.dtype)
    beyond = (amax > FP16_MAX) & jnp.isfinite(amax)
    scale = jnp.where(beyond, jnp.ldexp(jnp.ones_like(amax), exponent), jnp.float32(1.0))
    return _divide(vf, _per_row(scale, k_seq)).astype(jnp.float16).astype(_F32), scale


# ---------------------------------------------------------------- in-kernel math

def _bits(x):
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def _float(bits):
    return jax.lax.bitcast_convert_type(bits, _F32)


def _round_mantissa(x, drop: int, min_normal: float):
    """Non-negative float32 ``x`` (or NaN) rounded half to even to ``23 - drop`` mantissa bits, and
    below ``min_normal`` to multiples of ``min_normal * 2^(drop - 23)`` (the narrow type's
    subnormals): float16 is ``drop=13, 2^-14``, float8_e4m3fn ``drop=20, 2^-6``. Integer and
    float32 arithmetic only (Mosaic converts to neither type)."""
    bits = _bits(x)
    half = (1 << (drop - 1)) - 1
    normal = _float((bits + half + ((bits >> drop) & 1)) & ~((1 << drop) - 1))
    step = min_normal * 2.0 ** (drop - 23)
    # x + M with ulp(M) = step rounds x half to even to a multiple of step; the multiple is read off
    # the bits (a float (x + M) - M would be simplified back to x by the compiler)
    magic = step * 2.0 ** 23
    multiple = _bits(x + jnp.float32(magic)) - np.int32(np.float32(magic).view(np.int32))
    subnormal = multiple.astype(_F32) * jnp.float32(step)
    return jnp.where(x < jnp.float32(min_normal), subnormal, normal)


def round_to_float16(x):
    """``float32(float16(x))`` for ``x`` in [0, 65504] or NaN, without float16."""
    return _round_mantissa(x, 13, 2.0 ** -14)


def round_to_e4m3(x):
    """``float32(float8_e4m3fn(x))`` for ``x`` in [0, 448] or NaN, without float8."""
    return _round_mantissa(x, 20, 2.0 ** -6)


def _dot_t(a, b, precision=None, out=_F32):
    """``a @ b^T`` (no transpose materialized)."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=out)


def _dot(a, b, precision=None):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=_F32)


def _dot_tn(a, b):
    """``a^T @ b`` in float32 (HIGHEST)."""
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=_HIGHEST, preferred_element_type=_F32)


def _p_times_v(p, v, p_form: str):
    """One tile's ``P V`` as the MMA reads P: rounded per ``p_form``, products summed in float32."""
    if p_form == "e4m3":
        return _dot(round_to_e4m3(p * jnp.float32(FP8_MAX)).astype(jnp.bfloat16), v)  # exact in bfloat16
    if p_form == "bf16":
        return _dot(p.astype(jnp.bfloat16), v)
    if p_form == "f16":
        p = round_to_float16(p)
    return _dot(p, v, _HIGHEST)  # float16 values multiply exactly in float32


def _row_index(shape, block_q: int, first):
    """The query row within its sequence of each entry of a ``[G * block_q, cols]`` tile (rows G-major)."""
    return first + jax.lax.rem(jax.lax.broadcasted_iota(jnp.int32, shape, 0), jnp.int32(block_q))


def _visible(q_pos, k_pos, nq, nk, causal):
    """Which keys each query sees: in its sequence, and bottom-right causal where ``causal`` (an int32 flag)."""
    return (k_pos < nk) & (q_pos < nq) & ((causal == 0) | (k_pos <= q_pos + (nk - nq)))


@dataclasses.dataclass(frozen=True)
class _Static:
    """The kernels' static settings (hashable: a jit and custom_vjp static argument). The mask,
    granularity and smoothing are traced values instead: they change no shape, and each static
    setting costs a compile (seconds in interpret mode)."""

    pv_dtype: str
    dtype: str  # the inputs'
    group: int
    block_q: int
    block_k: int
    k_steps: int
    q_steps: int
    num_seqs: int
    interpret: bool | None


def _forward_kernel(seq_ref, row0_ref, first_ref, last_ref, seen_ref, q_len_ref, k_len_ref, causal_ref, *refs,
                    quantized, p_form, scaled, group, block_q, block_k):
    del first_ref, last_ref  # used by the index maps only
    refs = list(refs)
    if quantized:
        q_ref, qs_ref, k_ref, ks_ref, bias_ref, v_ref = refs[:6]
        refs = refs[6:]
    else:
        c_ref, q_ref, k_ref, v_ref = refs[:4]
        refs = refs[4:]
    vf_ref = refs.pop(0) if scaled else None
    o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
    i, j = pl.program_id(1), pl.program_id(2)
    rows, head_size = group * block_q, q_ref.shape[-1]

    @pl.when(j == 0)
    def _():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    s_id = seq_ref[i]
    nq, nk = q_len_ref[s_id], k_len_ref[s_id]

    @pl.when(j < seen_ref[i])
    def _():
        q = q_ref[...].reshape(rows, head_size)
        if quantized:
            q_scale = qs_ref[...].reshape(rows, 1)
        q_pos = _row_index((rows, TILE_K), block_q, row0_ref[i])
        for t in range(block_k // TILE_K):
            k = k_ref[pl.ds(t * TILE_K, TILE_K), :]
            if quantized:
                s_int = _dot_t(q, k, out=jnp.int32)  # int8 x int8 -> int32 on the MXU, exact
                # Q smoothing's key bias [G, 64] (zeros without it), row g * block_q + i taking head g's
                bias = jnp.broadcast_to(bias_ref[:, pl.ds(t, 1), :], (group, block_q, TILE_K)).reshape(rows, TILE_K)
                s = s_int.astype(_F32) * q_scale * ks_ref[pl.ds(t, 1), :] + bias
            else:
                s = _dot_t(q, k, _HIGHEST) * c_ref[0]
            k_pos = j * block_k + t * TILE_K + jax.lax.broadcasted_iota(jnp.int32, (rows, TILE_K), 1)
            s = jnp.where(_visible(q_pos, k_pos, nq, nk, causal_ref[0]), s, -jnp.inf)
            m = m_ref[...]
            m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with no key yet: exp2(-inf) = 0
            p = jnp.exp2(s - m_safe)
            alpha = jnp.exp2(m - m_safe)
            l_ref[...] = l_ref[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
            acc_ref[...] = acc_ref[...] * alpha + _p_times_v(p, v_ref[pl.ds(t * TILE_K, TILE_K), :], p_form)
            m_ref[...] = m_new

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        l = l_ref[...]
        out = acc_ref[...] / jnp.where(l == 0.0, 1.0, l)  # a row with no key has acc = 0; NaN stays NaN
        if scaled:
            out = out * vf_ref[...]
        o_ref[...] = out.reshape(o_ref.shape).astype(o_ref.dtype)
        lse_ref[...] = (m_ref[...] + jnp.log2(l)).reshape(lse_ref.shape)


def _p_form(pv_dtype: str, dtype) -> str:
    if pv_dtype == "fp8":
        return "e4m3"
    if pv_dtype == "fp16" or dtype == jnp.float16:
        return "f16"
    return "bf16" if dtype == jnp.bfloat16 else "f32"


def _run_forward(st: _Static, lay: _Layout, q, k, v, q_scale=None, k_scale=None, bias=None, v_factor=None, c=None):
    """The forward kernel: (out ``[Hkv, G, Pq, D]``, ``m + log2 l`` ``[Hkv, G, Pq, 1]``).

    Quantized: q, k int8 with scales ``[Hkv, G, Pq, 1]`` / ``[Hkv, Pk / block_k, block_k / 64, 64]``,
    the key bias ``[Hkv, G, Pk / block_k, block_k / 64, 64]``, v as the MMA reads it, ``v_factor``
    ``[S, Hkv, 1, D]`` multiplying the output (fp8, and fp16 of bfloat16 / float32 inputs). Exact
    (``c`` given: float32 ``[1]`` holding ``sm_scale log2 e``): float32 q, k, v."""
    kv_heads, group, q_rows, head_size = q.shape
    bq, bk = st.block_q, st.block_k
    quantized = c is None
    scaled = v_factor is not None
    p_form = _p_form(st.pv_dtype, jnp.dtype(st.dtype)) if quantized else "f32"

    def k_block(h, i, j, seq, row0, first, last, *_):
        return jnp.minimum(first[i] + j, last[i])

    q_spec = pl.BlockSpec((None, group, bq, head_size), lambda h, i, j, *_: (h, 0, i, 0))
    col_spec = pl.BlockSpec((None, group, bq, 1), lambda h, i, j, *_: (h, 0, i, 0))
    kv_spec = pl.BlockSpec((None, bk, head_size), lambda h, i, j, *r: (h, k_block(h, i, j, *r), 0))
    if quantized:
        ks_spec = pl.BlockSpec((None, None, bk // TILE_K, TILE_K), lambda h, i, j, *r: (h, k_block(h, i, j, *r), 0, 0))
        bias_spec = pl.BlockSpec((None, group, None, bk // TILE_K, TILE_K),
                                 lambda h, i, j, *r: (h, 0, k_block(h, i, j, *r), 0, 0))
        in_specs = [q_spec, col_spec, kv_spec, ks_spec, bias_spec, kv_spec]
        operands = [q, q_scale, k, k_scale, bias, v]
    else:
        in_specs = [pl.BlockSpec(memory_space=pltpu.SMEM), q_spec, kv_spec, kv_spec]
        operands = [c, q, k, v]
    if scaled:
        in_specs.append(pl.BlockSpec((None, None, 1, head_size), lambda h, i, j, seq, *_: (seq[i], h, 0, 0)))
        operands.append(v_factor)
    out_dtype = jnp.bfloat16 if quantized and st.dtype == "bfloat16" else _F32
    kernel = functools.partial(_forward_kernel, quantized=quantized, p_form=p_form, scaled=scaled, group=group,
                               block_q=bq, block_k=bk)
    rows = group * bq
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=8, grid=(kv_heads, q_rows // bq, st.k_steps), in_specs=in_specs,
            out_specs=[q_spec, col_spec],
            scratch_shapes=[pltpu.VMEM((rows, 1), _F32), pltpu.VMEM((rows, 1), _F32),
                            pltpu.VMEM((rows, head_size), _F32)]),
        out_shape=[jax.ShapeDtypeStruct(q.shape, out_dtype), jax.ShapeDtypeStruct(q.shape[:3] + (1,), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret_params(st.interpret),
    )(*lay.forward, lay.q_len, lay.k_len, lay.causal, *operands)


def _probabilities(c_ref, q, k, lse2, q_pos, k_pos, nq, nk, causal):
    """Exact attention's ``P`` of a tile: ``exp2(q k^T sm_scale log2 e - lse2)``, 0 where not seen."""
    s = _dot_t(q, k, _HIGHEST) * c_ref[0]
    return jnp.where(_visible(q_pos, k_pos, nq, nk, causal), jnp.exp2(s - lse2), 0.0)


def _dkdv_kernel(seq_ref, key0_ref, block0_ref, first_ref, last_ref, count_ref, q_len_ref, k_len_ref, causal_ref,
                 c_ref, q_ref, do_ref, lse_ref, dd_ref, k_ref, v_ref, dk_ref, dv_ref, dk_acc, dv_acc, *, group, block_q,
                 block_k):
    del first_ref, last_ref
    kb, i = pl.program_id(1), pl.program_id(2)
    rows, head_size = group * block_q, q_ref.shape[-1]

    @pl.when(i == 0)
    def _():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    s_id = seq_ref[kb]

    @pl.when(i < count_ref[kb])
    def _():
        q = q_ref[...].reshape(rows, head_size)
        do = do_ref[...].reshape(rows, head_size)
        k, v = k_ref[...], v_ref[...]
        q_pos = _row_index((rows, block_k), block_q, (block0_ref[kb] + i) * block_q)
        k_pos = key0_ref[kb] + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        p = _probabilities(c_ref, q, k, lse_ref[...].reshape(rows, 1), q_pos, k_pos, q_len_ref[s_id],
                           k_len_ref[s_id], causal_ref[0])
        dv_acc[...] += _dot_tn(p, do)  # rows of all G heads: summed over the group
        ds = p * (_dot_t(do, v, _HIGHEST) - dd_ref[...].reshape(rows, 1))
        dk_acc[...] += _dot_tn(ds, q)

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        dk_ref[...] = dk_acc[...] * c_ref[1]
        dv_ref[...] = dv_acc[...]


def _dq_kernel(seq_ref, row0_ref, first_ref, last_ref, seen_ref, q_len_ref, k_len_ref, causal_ref, c_ref, q_ref,
               do_ref, lse_ref, dd_ref, k_ref, v_ref, dq_ref, dq_acc, *, group, block_q, block_k):
    del first_ref, last_ref
    i, j = pl.program_id(1), pl.program_id(2)
    rows, head_size = group * block_q, q_ref.shape[-1]

    @pl.when(j == 0)
    def _():
        dq_acc[...] = jnp.zeros_like(dq_acc)

    s_id = seq_ref[i]

    @pl.when(j < seen_ref[i])
    def _():
        q = q_ref[...].reshape(rows, head_size)
        do = do_ref[...].reshape(rows, head_size)
        k, v = k_ref[...], v_ref[...]
        q_pos = _row_index((rows, block_k), block_q, row0_ref[i])
        k_pos = j * block_k + jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        p = _probabilities(c_ref, q, k, lse_ref[...].reshape(rows, 1), q_pos, k_pos, q_len_ref[s_id],
                           k_len_ref[s_id], causal_ref[0])
        ds = p * (_dot_t(do, v, _HIGHEST) - dd_ref[...].reshape(rows, 1))
        dq_acc[...] += _dot(ds, k, _HIGHEST)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        dq_ref[...] = (dq_acc[...] * c_ref[1]).reshape(dq_ref.shape)


def _run_backward_kernels(st: _Static, lay: _Layout, c, q, k, v, do, lse2, dd):
    """(dq ``[Hkv, G, Pq, D]``, dk, dv ``[Hkv, Pk, D]``) float32 from float32 padded rows."""
    kv_heads, group, q_rows, head_size = q.shape
    k_rows = k.shape[1]
    bq, bk = st.block_q, st.block_k
    rows = group * bq
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))

    def q_block(h, kb, i, seq, key0, block0, first, last, *_):
        return jnp.minimum(first[kb] + i, last[kb])

    q_spec = pl.BlockSpec((None, group, bq, head_size), lambda h, kb, i, *r: (h, 0, q_block(h, kb, i, *r), 0))
    col_spec = pl.BlockSpec((None, group, bq, 1), lambda h, kb, i, *r: (h, 0, q_block(h, kb, i, *r), 0))
    kv_spec = pl.BlockSpec((None, bk, head_size), lambda h, kb, i, *_: (h, kb, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, group=group, block_q=bq, block_k=bk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=9, grid=(kv_heads, k_rows // bk, st.q_steps),
            in_specs=[smem, q_spec, q_spec, col_spec, col_spec, kv_spec, kv_spec], out_specs=[kv_spec, kv_spec],
            scratch_shapes=[pltpu.VMEM((bk, head_size), _F32), pltpu.VMEM((bk, head_size), _F32)]),
        out_shape=[jax.ShapeDtypeStruct(k.shape, _F32)] * 2,
        compiler_params=params,
        interpret=interpret_params(st.interpret),
    )(*lay.keys, lay.q_len, lay.k_len, lay.causal, c, q, do, lse2, dd, k, v)

    def k_block(h, i, j, seq, row0, first, last, *_):
        return jnp.minimum(first[i] + j, last[i])

    q_spec = pl.BlockSpec((None, group, bq, head_size), lambda h, i, j, *_: (h, 0, i, 0))
    col_spec = pl.BlockSpec((None, group, bq, 1), lambda h, i, j, *_: (h, 0, i, 0))
    kv_spec = pl.BlockSpec((None, bk, head_size), lambda h, i, j, *r: (h, k_block(h, i, j, *r), 0))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, group=group, block_q=bq, block_k=bk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=8, grid=(kv_heads, q_rows // bq, st.k_steps),
            in_specs=[smem, q_spec, q_spec, col_spec, col_spec, kv_spec, kv_spec], out_specs=q_spec,
            scratch_shapes=[pltpu.VMEM((rows, head_size), _F32)]),
        out_shape=jax.ShapeDtypeStruct(q.shape, _F32),
        compiler_params=params,
        interpret=interpret_params(st.interpret),
    )(*lay.forward, lay.q_len, lay.k_len, lay.causal, c, q, do, lse2, dd, k, v)
    return dq, dk, dv


# ---------------------------------------------------------------- the computations on padded rows

def _grouped(rows, kv_heads: int):
    """``[Hq, P, ...]`` -> ``[Hkv, G, P, ...]``."""
    return rows.reshape((kv_heads, rows.shape[0] // kv_heads) + rows.shape[1:])


def _prepare(st: _Static, lay: _Layout, q, k, v, k_mean, q_mean, options):
    """The kernel's quantized operands on padded rows: float32 query rows ``[Hq, Pq, D]`` (for the
    smoothing's lse term), int8 q ``[Hq, Pq, D]`` and its scales ``[Hq, Pq]``, int8 k ``[Hkv, Pk,
    D]`` and its scales ``[Hkv, Pk]``, V as the MMA reads it and, for fp8 (and fp16 of bfloat16 or
    float32 inputs), ``v_scale [S, Hkv, D]``.
    ``options``: float32 ``[folded scale, sm_scale, granularity index, smoothing flag]``; the key
    mean is subtracted only where the flag is set (so that without it the keys are exact). The
    query mean ``[S, Hq, D]`` is always subtracted (zeros without Q smoothing: exact too)."""
    granularity = options[2].astype(jnp.int32)
    q_rows = _rows(q, lay.q_gather).astype(_F32)
    k_rows = _rows(k, lay.k_gather).astype(_F32)
    mean = jnp.moveaxis(jnp.concatenate([k_mean.astype(_F32), jnp.zeros((1,) + k_mean.shape[1:], _F32)]), 0, 1)
    smoothed = (lay.k_seq < st.num_seqs)[None, :, None] & (options[3] > 0)  # padding rows stay zero
    k_rows = jnp.where(smoothed, k_rows - mean[:, lay.k_seq], k_rows)
    real = (lay.q_gather < q.shape[0] * q.shape[2])[None, :, None]  # padding rows stay zero
    q_smoothed = jnp.where(real, q_rows - jnp.moveaxis(q_mean.astype(_F32)[lay.q_seq], 0, 1), q_rows)
    q8, q_scale = quantize_int8(q_smoothed * options[0], "q", granularity)
    k8, k_scale = quantize_int8(k_rows, "k", granularity)
    v_rows = _rows(v, lay.k_gather)
    v_scale = None
    if st.pv_dtype == "fp8":
        v_read, v_scale = _fp8_values(v_rows, lay.k_seq, st.num_seqs)
    elif st.pv_dtype == "fp16" and v.dtype != jnp.float16:
        v_read, v_scale = _fp16_values(v_rows, lay.k_seq, st.num_seqs)
    elif st.pv_dtype == "fp16" or v.dtype == jnp.float16:
        v_read = v_rows.astype(jnp.float16).astype(_F32)
    else:
        v_read = v_rows
    return q_rows, q8, q_scale, k8, k_scale, v_read, v_scale


def _forward(st: _Static, lay: _Layout, q, k, v, k_mean, q_mean, key_bias, options):
    """(out in q's dtype, natural lse float32) of the quantized attention, ``[B, H, N, ...]``."""
    batch, _, nq, _ = q.shape
    kv_heads = k.shape[1]
    q_rows, q8, q_scale, k8, k_scale, v_read, v_scale = _prepare(st, lay, q, k, v, k_mean, q_mean, options)
    v_factor = None
    if v_scale is not None:  # fp8: v_scale / 448; fp16: the power of two V was divided by
        v_factor = (_divide(v_scale, FP8_MAX) if st.pv_dtype == "fp8" else v_scale)[:, :, None, :]
    tiles = (k8.shape[1] // st.block_k, st.block_k // TILE_K, TILE_K)
    bias = _grouped(_rows(key_bias[..., None], lay.k_gather)[..., 0], kv_heads)  # [Hkv, G, Pk], padding rows 0
    out, lse2 = _run_forward(st, lay, _grouped(q8, kv_heads), k8, v_read, _grouped(q_scale, kv_heads)[..., None],
                             k_scale.reshape((kv_heads,) + tiles), bias.reshape(bias.shape[:2] + tiles), v_factor)
    lse = lse2.reshape(q8.shape[:2]) * jnp.float32(LN2)
    # smoothing shifted row i's scores by sm_scale q_i . k_mean; a sequence without keys keeps -inf
    k_mean_rows = jnp.moveaxis(k_mean.astype(_F32)[lay.q_seq], 0, 1)  # [Hkv, Pq, D]
    shift = jnp.einsum("hgpd,hpd->hgp", _grouped(q_rows, kv_heads), k_mean_rows, precision=_HIGHEST)
    shifted = (lay.k_len[lay.q_seq] > 0)[None] & (options[3] > 0)
    lse = jnp.where(shifted, lse + options[1] * shift.reshape(lse.shape), lse)
    out = out.reshape(q8.shape).astype(q.dtype)
    return _tokens(out, lay.q_scatter, batch, nq), _tokens(lse, lay.q_scatter, batch, nq)


def _backward(st: _Static, lay: _Layout, do, dlse, q, k, v, options):
    """(dq, dk, dv) of exact attention, in the inputs' dtypes."""
    kv_heads = k.shape[1]
    sm_scale = options[1]
    c = jnp.stack([sm_scale * jnp.float32(LOG2E), sm_scale])
    q_rows = _grouped(_rows(q, lay.q_gather).astype(_F32), kv_heads)
    do_rows = _grouped(_rows(do, lay.q_gather).astype(_F32), kv_heads)
    k_rows = _rows(k, lay.k_gather).astype(_F32)
    v_rows = _rows(v, lay.k_gather).astype(_F32)
    out, lse2 = _run_forward(st, lay, q_rows, k_rows, v_rows, c=c[:1])
    dd = jnp.sum(do_rows * out, axis=-1, keepdims=True)
    if dlse is not None:
        dd = dd - _grouped(_rows(dlse.astype(_F32), lay.q_gather), kv_heads)[..., None]
    dq, dk, dv = _run_backward_kernels(st, lay, c, q_rows, k_rows, v_rows, do_rows, lse2, dd)
    batch, _, nq, _ = q.shape
    nk = k.shape[2]
    return (_tokens(dq.reshape((-1,) + dq.shape[2:]), lay.q_scatter, batch, nq).astype(q.dtype),
            _tokens(dk, lay.k_scatter, batch, nk).astype(k.dtype),
            _tokens(dv, lay.k_scatter, batch, nk).astype(v.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(st, lay, q, k, v, k_mean, q_mean, key_bias, options):
    return _forward(st, lay, q, k, v, k_mean, q_mean, key_bias, options)


def _attention_fwd(st, lay, q, k, v, k_mean, q_mean, key_bias, options):
    residuals = (lay, q, k, v, k_mean, q_mean, key_bias, options)
    return _forward(st, lay, q, k, v, k_mean, q_mean, key_bias, options), residuals


def _attention_bwd(st, residuals, cotangents):
    lay, q, k, v, *smoothing, options = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = _backward(st, lay, d_out, d_lse, q, k, v, options)
    # straight-through: the quantization (and the smoothing, which the key bias and the lse
    # correction undo) is treated as the identity, so the means and the key bias get no gradient
    return (None, dq, dk, dv, *map(jnp.zeros_like, smoothing), jnp.zeros_like(options))


_attention.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------- public API

def _interpreting(interpret) -> bool:
    return interpret is not False and (interpret is not None or jax.default_backend() != "tpu")


def _compiled(fn):
    """``jax.jit(fn)`` with the static settings first. In interpret mode (CPU) the program is small
    and compiling it is most of a call's time: a top-level call turns XLA's backend optimizations
    off there (about a third less compile time; a traced call is part of its caller's program)."""
    plain = jax.jit(fn, static_argnums=(0,))
    quick = jax.jit(fn, static_argnums=(0,), compiler_options={"xla_backend_optimization_level": 0})

    @functools.wraps(fn)
    def call(st, *args):
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
        return (quick if _interpreting(st.interpret) and not traced else plain)(st, *args)

    return call


def _static(q, k, sm_scale, causal, granularity, pv_dtype, smooth, cu_seqlens_q, cu_seqlens_k, interpret,
            config):
    """(static settings, layout, traced options ``[folded scale, sm_scale, granularity, smooth]``)."""
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(f"q, k: expected [B, H, N, D], got shapes {q.shape} and {k.shape}")
    head_size = q.shape[3]
    if head_size not in HEAD_SIZES:
        raise NotImplementedError(f"pallas: head size {head_size} is not supported (takes {HEAD_SIZES})")
    if jnp.dtype(q.dtype) not in (jnp.float16, jnp.bfloat16, jnp.float32):
        raise NotImplementedError(f"pallas: {jnp.dtype(q.dtype)} inputs are not supported")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    if pv_dtype not in PV_DTYPES:
        raise ValueError(f"pv_dtype: expected one of {PV_DTYPES}, got {pv_dtype!r}")
    batch, heads, nq, _ = q.shape
    kv_heads, nk = k.shape[1], k.shape[2]
    spans_q, spans_k = _spans(batch, nq, nk, cu_seqlens_q, cu_seqlens_k)
    cfg = _resolve_config(config, max([e - s for s, e in spans_k] + [0]))
    lay, k_steps, q_steps = _layout(spans_q, spans_k, batch * nq, batch * nk, cfg.block_q, cfg.block_k,
                                    bool(causal))
    sm_scale = _default_scale(q, sm_scale)
    st = _Static(pv_dtype=pv_dtype, dtype=jnp.dtype(q.dtype).name, group=heads // kv_heads, block_q=cfg.block_q,
                 block_k=cfg.block_k, k_steps=k_steps, q_steps=q_steps, num_seqs=len(spans_q), interpret=interpret)
    options = jnp.array([folded_scale(sm_scale), sm_scale, GRANULARITIES.index(granularity), float(bool(smooth))],
                        _F32)
    return st, lay, options


def _nothing_to_do(q, lay):
    return q.shape[0] * q.shape[2] == 0 or lay.q_gather.shape[0] == 0


def _token_sequences(batch: int, length: int, cu_seqlens) -> np.ndarray:
    """The sequence of each of the ``batch * length`` tokens: its batch element, or by the offsets
    (``S``, one past the last sequence, beyond them)."""
    if cu_seqlens is None:
        return np.repeat(np.arange(batch, dtype=np.int32), length)
    ends = np.asarray(_offsets(cu_seqlens, "cu_seqlens")[1:], np.int64)
    return np.searchsorted(ends, np.arange(batch * length), side="right").astype(np.int32)


def sequence_mean(x, cu_seqlens=None):
    """float32 ``[S, H, D]``: each sequence's mean row per head of ``x [B, H, N, D]`` (0 for an
    empty sequence); the smoothing means of keys and of queries."""
    batch, heads, length, head_size = x.shape
    if cu_seqlens is None:
        return x.astype(_F32).mean(axis=2) if length else jnp.zeros((batch, heads, head_size), _F32)
    bounds = np.asarray(_offsets(cu_seqlens, "cu_seqlens"), np.int64)
    rows = jnp.moveaxis(x[0].astype(_F32), 1, 0)  # [N, H, D]
    sums = jax.ops.segment_sum(rows, _token_sequences(1, length, cu_seqlens), num_segments=len(bounds))[:-1]
    return sums / np.maximum(np.diff(bounds), 1).astype(np.float32)[:, None, None]


def key_bias(k, k_mean, q_mean, sm_scale, cu_seqlens_k=None):
    """float32 ``[B, Hq, Nk]``: the scores Q smoothing takes out of the queries, ``(q_mean[s, h] .
    k_s[j]) * float32(sm_scale log2 e)`` for every key ``j`` of sequence ``s``, ``k_s`` the keys
    minus ``k_mean`` (if given); ``q_mean [S, Hq, D]``, ``k_mean [S, Hkv, D]``."""
    batch, kv_heads, nk, head_size = k.shape
    heads = q_mean.shape[1]
    seq = _token_sequences(batch, nk, cu_seqlens_k)
    pad = jnp.zeros((1, heads, head_size), _F32)  # the means of tokens past the last sequence
    keys = jnp.moveaxis(k.astype(_F32), 1, 2).reshape(-1, kv_heads, head_size)  # [tokens, Hkv, D]
    if k_mean is not None:
        keys = keys - jnp.concatenate([k_mean.astype(_F32), pad[:, :kv_heads]])[seq]
    means = jnp.concatenate([q_mean.astype(_F32), pad])[seq].reshape(-1, kv_heads, heads // kv_heads, head_size)
    bias = jnp.einsum("thgd,thd->thg", means, keys, precision=_HIGHEST) * jnp.float32(folded_scale(sm_scale))
    return jnp.moveaxis(bias.reshape(batch, nk, heads), 2, 1)


def _default_scale(q, sm_scale) -> float:
    return q.shape[3] ** -0.5 if sm_scale is None else float(sm_scale)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 8, 9, 10))
def _smoothing(q, k, sm_scale, smooth_q, smooth_k, k_mean, q_mean, bias, cu_seqlens_q, cu_seqlens_k, num_seqs):
    """``(k_mean, q_mean, key_bias)``: those given, else computed where ``smooth_k`` / ``smooth_q``
    ask (the bias from the key mean in use), else None, or zeros where ``num_seqs`` is given (with
    zeros the kernels' numbers are exactly those without that smoothing). One program, rather than
    an eager op (each a compile) per step; the offsets are tuples (static)."""
    # the gradient treats the smoothing as a constant (straight-through), so the vjp keeps no
    # residuals of it (NumPy ones, such as the sequences' sizes, which torchax could not hold)
    q, k, k_mean, q_mean, bias = jax.lax.stop_gradient((q, k, k_mean, q_mean, bias))
    if k_mean is None and smooth_k:
        k_mean = sequence_mean(k, cu_seqlens_k)
    if q_mean is None and smooth_q:
        q_mean = sequence_mean(q, cu_seqlens_q)
        bias = key_bias(k, k_mean, q_mean, _default_scale(q, sm_scale), cu_seqlens_k)
    if num_seqs is None:
        return k_mean, q_mean, bias
    (batch, heads, _, head_size), (kv_heads, nk) = q.shape, k.shape[1:3]
    return (jnp.zeros((num_seqs, kv_heads, head_size), _F32) if k_mean is None else k_mean,
            jnp.zeros((num_seqs, heads, head_size), _F32) if q_mean is None else q_mean,
            jnp.zeros((batch, heads, nk), _F32) if bias is None else bias)


def _static_offsets(*cu_seqlens):
    return [None if cu is None else _offsets(cu, "cu_seqlens") for cu in cu_seqlens]


def smoothing(q, k, sm_scale=None, smooth_q=True, smooth_k=True, cu_seqlens_q=None, cu_seqlens_k=None):
    """``(k_mean [S, Hkv, D], q_mean [S, Hq, D], key_bias [B, Hq, Nk])``, the smoothing the kernels
    apply (None where that smoothing is off): each sequence's mean key and query, and the scores
    that subtracting the query mean takes out, which the kernels add back per key."""
    return _smoothing(q, k, sm_scale, bool(smooth_q), bool(smooth_k), None, None, None,
                      *_static_offsets(cu_seqlens_q, cu_seqlens_k), None)


_attention_call = _compiled(_attention)


def quantized_attention(q, k, v, sm_scale=None, causal=False, granularity="per_block", pv_dtype="fp16",
                        smooth_k=True, cu_seqlens_q=None, cu_seqlens_k=None, *, smooth_q=True, k_mean=None,
                        q_mean=None, key_bias=None, interpret=None, config: Config | None = None):
    """SageAttention's quantized attention by the Pallas kernels: ``(out [B, Hq, Nq, D] in q's
    dtype, natural-log lse float32 [B, Hq, Nq])``.

    q ``[B, Hq, Nq, D]``, k and v ``[B, Hkv, Nk, D]`` (float16, bfloat16, float32; ``Hq`` a
    multiple of ``Hkv``; D in 64, 96, 128); options as ``torch_kernels.quantized_attention``.
    ``cu_seqlens_*`` (B = 1) must be concrete (NumPy, a tuple or an unjitted array). The smoothing
    to use, default :func:`smoothing`'s where ``smooth_k`` / ``smooth_q`` ask for it (giving one
    turns its smoothing on): ``k_mean [S, Hkv, D]``; ``q_mean [S, Hq, D]`` and ``key_bias [B, Hq,
    Nk]`` together. Differentiable in q, k and v (``jax.grad``): the gradient of exact attention
    (straight-through).
    """
    if (q_mean is None) != (key_bias is None):
        raise ValueError("q_mean, key_bias: expected both (Q smoothing) or neither, got "
                         f"{'q_mean' if key_bias is None else 'key_bias'} alone")
    smooth = bool(smooth_k) or k_mean is not None
    st, lay, options = _static(q, k, sm_scale, causal, granularity, pv_dtype, smooth, cu_seqlens_q, cu_seqlens_k,
                               interpret, config)
    smoothing_operands = _smoothing(q, k, sm_scale, bool(smooth_q), bool(smooth_k), k_mean, q_mean, key_bias,
                                    *_static_offsets(cu_seqlens_q, cu_seqlens_k), st.num_seqs)
    if not isinstance(q, jax.core.Tracer):  # placed alike whether given or made here: else a jit compiles again
        smoothing_operands = jax.device_put(smoothing_operands, q.sharding)
    if _nothing_to_do(q, lay):
        return jnp.zeros(q.shape, q.dtype), jnp.full(q.shape[:3], -jnp.inf, _F32)
    return _attention_call(st, lay, q, k, v, *smoothing_operands, options)


def _quantize(st, lay, q, k, v, k_mean, q_mean, options):
    _, q8, q_scale, k8, k_scale, v_read, v_scale = _prepare(st, lay, q, k, v, k_mean, q_mean, options)
    (batch, _, nq, _), nk = q.shape, k.shape[2]
    q_side = [_tokens(x, lay.q_scatter, batch, nq) for x in (q8, q_scale)]
    k_side = [_tokens(x, lay.k_scatter, batch, nk) for x in (k8, k_scale, v_read)]
    return (*q_side, *k_side, v_scale)


_quantize_call = _compiled(_quantize)


def quantize_inputs(q, k, v, sm_scale=None, granularity="per_block", pv_dtype="fp16", smooth_k=True,
                    cu_seqlens_q=None, cu_seqlens_k=None, *, smooth_q=True, k_mean=None, q_mean=None):
    """What the forward kernel reads, in the inputs' layout: ``(q_int8 [B, Hq, Nq, D], q_scale
    [B, Hq, Nq], k_int8 [B, Hkv, Nk, D], k_scale [B, Hkv, Nk], V as P.V reads it [B, Hkv, Nk, D]
    (float32, or bfloat16 holding float8_e4m3fn values), v_scale [S, Hkv, D] (fp8, and fp16 of
    bfloat16 / float32 inputs; else None))``;
    arguments as :func:`quantized_attention` (the key bias is not quantized). The int8 values and
    scales are the reference's."""
    smooth = bool(smooth_k) or k_mean is not None
    st, lay, options = _static(q, k, sm_scale, False, granularity, pv_dtype, smooth, cu_seqlens_q, cu_seqlens_k,
                               None, None)
    k_mean, q_mean, _ = _smoothing(q, k, sm_scale, bool(smooth_q), bool(smooth_k), k_mean, q_mean, None,
                                   *_static_offsets(cu_seqlens_q, cu_seqlens_k), st.num_seqs)
    return _quantize_call(st, lay, q, k, v, k_mean, q_mean, options)


_backward_call = _compiled(_backward)


def attention_backward(grad_out, grad_lse, q, k, v, sm_scale=None, causal=False, cu_seqlens_q=None,
                       cu_seqlens_k=None, *, interpret=None, config: Config | None = None):
    """``(dq, dk, dv)`` of exact softmax attention at q, k, v (the straight-through backward of
    :func:`quantized_attention`) for cotangents ``grad_out`` and ``grad_lse`` (None: unused)."""
    st, lay, options = _static(q, k, sm_scale, causal, "per_block", "none", False, cu_seqlens_q, cu_seqlens_k,
                               interpret, config)
    if _nothing_to_do(q, lay) or k.shape[0] * k.shape[2] == 0:
        return jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, k.dtype), jnp.zeros(v.shape, v.dtype)
    return _backward_call(st, lay, grad_out.astype(q.dtype), grad_lse, q, k, v, options)

"""Quantized attention (SageAttention's recipe) in plain PyTorch: INT8 QK^T, float32 online softmax.

The kernel contract every backend follows (inputs already checked and contiguous by
``torch_kernels.ops.quantized_attention``):

- ``quantized_attention(q [B, Hq, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, D], k_mean, q_mean,
  key_bias, sm_scale, causal, granularity, pv_dtype, cu_seqlens_q, cu_seqlens_k) -> (out
  [B, Hq, Nq, D] in q's dtype, lse float32 [B, Hq, Nq])``. ``k_mean`` float32 ``[S, Hkv, D]``,
  ``q_mean`` float32 ``[S, Hq, D]`` and ``key_bias`` float32 ``[B, Hq, Nk]`` come from
  :func:`smoothing`, computed once by the op so that every backend smooths with the same numbers;
  each is None when its smoothing is off (``q_mean`` and ``key_bias`` together).
  ``cu_seqlens_*`` are int64 ``[S + 1]`` with ``B = 1``, or None (then ``S = B``). With
  ``pv_dtype="fp16"``, ``v`` is within float16's range (the op divides it by :func:`value_scale`).
- ``quantized_attention_backward(grad_out, grad_lse, q, k, v, sm_scale, causal, cu_seqlens_q,
  cu_seqlens_k) -> (dq, dk, dv)``: the gradient of exact attention (see :func:`attention_backward`).

The numbers, fixed so that Triton / Pallas / SYCL kernels reproduce the int8 values and scales
bit for bit (P.V and the softmax agree to rounding, not bitwise):

1. Sequences. Without ``cu_seqlens`` each batch element is one sequence; with them, sequence
   ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and key rows likewise. Row
   indices below (``i`` for queries, ``j`` for keys) count from the sequence's first token, so
   quantization groups never straddle two sequences.
2. K smoothing: ``k_s = float32(k) - k_mean[s, h]``, the mean over the sequence's tokens. Softmax
   is invariant to a shift of a row's scores, and smoothing shifts row ``i`` by
   ``sm_scale * q_i . k_mean`` only; the lse adds that back.
   Q smoothing (SageAttention 2): ``q_s = float32(q) - q_mean[s, h]``, the mean over the
   sequence's query rows, is what gets quantized, and the part taken out returns exactly as a
   per-key bias ``key_bias[b, h, j] = float32((q_mean[s, h] . k_s[j]) * c)`` (float32 dot
   products, ``k_s = float32(k)`` without K smoothing). Real queries carry large per-channel
   offsets; without this, the offset sets every group's int8 scale and the rest of each query
   loses its precision.
3. Queries: ``q' = q_s * c`` with ``c = float32(sm_scale * log2(e))`` (so scores come out
   in base 2 and the softmax uses exp2; ``q_s = float32(q)`` without Q smoothing). Per group ``g``
   of rows: ``amax = max |q'|``,
   ``scale = amax / 127`` (1 where amax is 0), ``q_int8 = clamp(round_half_even(q' / scale),
   -127, 127)`` with IEEE float32 division. Keys: the same on ``k_s`` with ``c = 1``.
4. Groups (``granularity``), with ``BLOCK_Q = 128``, ``BLOCK_K = 64``, ``WARP_Q = 32``:

   ============  ==========================================  ======================================
   granularity   query row ``i`` belongs to group            key row ``j`` belongs to group
   ============  ==========================================  ======================================
   per_block     ``i // 128``                                ``j // 64``
   per_warp      ``i // 32`` (a 128-row tile, 4 warps)       ``j // 64`` (every warp reads the tile)
   per_thread    ``(i // 32, i % 8)``: 8 groups of 4 rows    ``(j // 64, (j % 8) // 2)``: 4 groups of
                 per warp, the rows one thread of an         16 keys per tile, the columns one
                 m16n8 MMA accumulator holds                 thread of the accumulator holds
   ============  ==========================================  ======================================

5. Scores: ``s_int = q_int8 @ k_int8^T`` exactly (int32 accumulation; emulated here in float64,
   exact since ``|s_int| <= 127^2 D < 2^53``), then ``s = (float32(s_int) * q_scale[i]) *
   k_scale[j] + key_bias[j]`` in float32 (no ``+ key_bias`` without Q smoothing). Causal: key ``j`` is visible from query ``i`` iff
   ``j <= i + Nk - Nq`` (bottom-right aligned, as FlashAttention); masked scores are -inf.
6. Online softmax in float32 over key tiles of ``BLOCK_K``: ``m' = max(m, rowmax s)``,
   ``p = exp2(s - m')``, ``l = l * exp2(m - m') + rowsum p``, ``acc = acc * exp2(m - m') + P V``.
   ``out = acc / l`` (0 for a row that sees no key), ``lse = ln(2) (m + log2 l) + sm_scale q . k_mean``
   (-inf for a row that sees no key).
7. ``P V`` per tile, accumulated into the float32 ``acc`` (``pv_dtype``):
   ``"fp16"``: P and V rounded to float16, products summed in float32 (a kernel whose MMA
   accumulates a tile in float16 before flushing it matches to rounding). V beyond float16's
   range (bfloat16 and float32 inputs) would round to inf and make its rows NaN, so the op
   divides V by :func:`value_scale` first, a power of two per (sequence, kv head, channel)
   that is 1 wherever V already fits, and multiplies the output back: exact, and bit for bit
   the unscaled result for V within range; kernels receive V within float16's range;
   ``"fp8"``: V quantized per channel, ``v_scale[s, h, d] = amax_j |v| / 448`` (1 where 0),
   ``v8 = e4m3fn(clamp(v / v_scale, +-448))``; P enters the FP8 MMA as ``e4m3fn(448 p)``, and
   ``out = acc / l * (v_scale / 448)``; ``l`` sums the float32 ``p``;
   ``"none"``: P rounded to the inputs' dtype and V as given, products summed in float32.
8. NaN and inf are never dropped: a quantization group holding one gets an infinite scale and
   all-zero entries (NaN stored as 0, as float -> int8 of NaN differs by device), so every score
   computed from it is NaN. That reaches the outputs of its query group (through the query mean
   and the key bias, its whole head with Q smoothing), or of every query that sees its key group
   (through the key mean, its whole head with K smoothing). A NaN value reaches
   every row attending to it, and possibly others of its head (masked probabilities are 0 and
   0 * NaN is NaN; with ``"fp8"`` its channel's scale is NaN).

:func:`quantized_attention` is the reference backend's kernel and the CPU default, written for
reading (loops over sequences and key tiles, vectorized over heads and query rows).
:func:`quantized_attention_naive` is the definition without tiles: the same int8 values, one
full softmax in float64; the tests pin the online softmax to it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

BLOCK_Q, BLOCK_K, WARP_Q = 128, 64, 32
GRANULARITIES = ("per_block", "per_warp", "per_thread")
PV_DTYPES = ("fp16", "fp8", "none")
INT8_MAX = 127
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP16_MAX = 65504.0  # largest finite float16
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_KEY_BIAS_TILE = 2 ** 24  # elements of key_bias's per-key copy of the query means, per tile of keys


def folded_scale(sm_scale: float) -> float:
    """``sm_scale * log2(e)`` rounded to float32 (inf past its range): the constant every backend
    folds into Q, rounded on the host."""
    with np.errstate(over="ignore"):
        return float(np.float32(sm_scale * LOG2E))


# ---- sequences ----

def sequences(batch: int, nq: int, nk: int, cu_seqlens_q, cu_seqlens_k) -> list[tuple[int, int, int, int, int]]:
    """``(batch index, q start, q end, k start, k end)`` of every sequence (one host read of
    cu_seqlens): the reference kernel's loop."""
    if cu_seqlens_q is None:
        return [(b, 0, nq, 0, nk) for b in range(batch)]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(0, cq[s], cq[s + 1], ck[s], ck[s + 1]) for s in range(len(cq) - 1)]


def _rows_by_sequence(x: torch.Tensor, cu_seqlens: torch.Tensor | None):
    """``x [B, H, N, D]`` as float32 rows ``[B N, H, D]``, the sequence of each row and the
    sequences' offsets into the rows: the packed ones, or the batch elements'. One form for both, so
    that a sequence's smoothing is the same bits packed or alone."""
    batch, heads, n, d = x.shape
    rows = x.transpose(1, 2).reshape(batch * n, heads, d).float()
    offsets = torch.arange(batch + 1, device=x.device) * n if cu_seqlens is None else cu_seqlens.long()
    return rows, token_sequence(offsets, batch * n), offsets


def _with_zero_row(means: torch.Tensor) -> torch.Tensor:
    """``means [S, ...]`` and a row of zeros, the means of tokens past the last offset."""
    return torch.cat([means, means.new_zeros(1, *means.shape[1:])])


def sequence_mean(x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[S, H, D]``: each sequence's mean row per head of ``x [B, H, N, D]`` (0 for an
    empty sequence); the smoothing means of keys and of queries. Summed by an accumulating scatter
    in token order (deterministic, no host read of ``cu_seqlens``) as differences from the
    sequence's first row: a float32 sum of the large offsets smoothing is for would round away
    digits of the mean. Tokens past the last offset belong to no sequence."""
    rows, seq, offsets = _rows_by_sequence(x, cu_seqlens)
    total, heads, d = rows.shape
    num_seqs = offsets.shape[0] - 1
    first = rows[offsets[:-1].clamp(0, max(total - 1, 0))] if total else rows.new_zeros(num_seqs, heads, d)
    first = _with_zero_row(first)
    sums = torch.zeros_like(first).index_put_((seq,), rows - first[seq], accumulate=True)
    bounds = offsets.clamp(0, total)
    counts = (bounds[1:] - bounds[:-1])[:, None, None]
    return torch.where(counts > 0, first[:num_seqs] + sums[:num_seqs] / counts.clamp(min=1), 0.0)


def key_bias(k: torch.Tensor, k_mean: torch.Tensor | None, q_mean: torch.Tensor, sm_scale: float,
             cu_seqlens_k: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[B, Hq, Nk]``: the scores Q smoothing takes out, ``(q_mean[s, h] . k_s[j]) * c``
    for every key ``j`` of sequence ``s`` (step 2 of the module docstring). Each key's dot
    products with its sequence's means, gathered per key (no host read of the offsets), a tile of
    keys at a time; keys past the last offset take zero means."""
    batch, hkv, nk, d = k.shape
    hq = q_mean.shape[1]
    folded = folded_scale(sm_scale)
    rows, seq, _ = _rows_by_sequence(k, cu_seqlens_k)
    q_mean = _with_zero_row(q_mean)
    k_mean = None if k_mean is None else _with_zero_row(k_mean)
    bias = rows.new_empty(batch * nk, hkv, hq // hkv)  # each kv head serves hq // hkv query heads
    tile = max(1, _KEY_BIAS_TILE // (hq * d))
    for start in range(0, batch * nk, tile):
        owner = seq[start:start + tile]
        keys = rows[start:start + tile]
        if k_mean is not None:
            keys = keys - k_mean[owner]
        means = q_mean[owner].view(-1, hkv, hq // hkv, d)
        bias[start:start + tile] = (means * keys[:, :, None, :]).sum(-1) * folded
    return bias.view(batch, nk, hq).transpose(1, 2).contiguous()


def smoothing(q: torch.Tensor, k: torch.Tensor, sm_scale: float, smooth_q: bool, smooth_k: bool,
              cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None):
    """``(k_mean, q_mean, key_bias)`` for the kernels (None where that smoothing is off)."""
    k_mean = sequence_mean(k, cu_seqlens_k) if smooth_k else None
    if not smooth_q:
        return k_mean, None, None
    q_mean = sequence_mean(q, cu_seqlens_q)
    return k_mean, q_mean, key_bias(k, k_mean, q_mean, sm_scale, cu_seqlens_k)


def visible(nq: int, nk: int, causal: bool, device) -> torch.Tensor | None:
    """Bool ``[nq, nk]``: which keys each query sees (bottom-right causal), or None for all of them."""
    if not causal:
        return None
    rows = torch.arange(nq, device=device)[:, None]
    cols = torch.arange(nk, device=device)[None, :]
    return cols <= rows + (nk - nq)


# ---- quantization ----

def row_groups(n: int, role: str, granularity: str, device=None) -> tuple[torch.Tensor, int]:
    """The quantization group of each of ``n`` query (``role="q"``) or key (``"k"``) rows of one
    sequence, and the number of groups (the table in the module docstring)."""
    i = torch.arange(n, device=device)
    if role == "k":
        if granularity == "per_thread":
            return (i // BLOCK_K) * 4 + (i % 8) // 2, -(-n // BLOCK_K) * 4
        return i // BLOCK_K, -(-n // BLOCK_K)
    if granularity == "per_block":
        return i // BLOCK_Q, -(-n // BLOCK_Q)
    if granularity == "per_warp":
        return i // WARP_Q, -(-n // WARP_Q)
    return (i // WARP_Q) * 8 + i % 8, -(-n // WARP_Q) * 8


def quantize_int8(x: torch.Tensor, group: torch.Tensor, num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 [H, N, D], float32 per-row scale [H, N])`` of float32 ``x [H, N, D]``, one scale per
    group of rows: ``amax / 127`` (1 where amax is 0), entries ``round_half_even(x / scale)``.
    A NaN makes its group's amax inf, so that NaN is not quietly dropped (amax reductions skip it)."""
    heads, n, _ = x.shape
    row_amax = x.abs().amax(dim=-1)
    row_amax = torch.where(row_amax.isnan(), math.inf, row_amax)
    amax = x.new_zeros(heads, num_groups).scatter_reduce(1, group.expand(heads, n), row_amax, "amax")
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))[:, group]
    y = (x / scale[..., None]).round().clamp(-INT8_MAX, INT8_MAX)
    return y.masked_fill(y.isnan(), 0).to(torch.int8), scale


def quantize_queries(q: torch.Tensor, mean: torch.Tensor | None, sm_scale: float, granularity: str):
    """Queries ``[H, N, D]`` of one sequence, minus ``mean [H, D]`` if given, with ``sm_scale *
    log2(e)`` folded in: ``(int8, scale [H, N])``."""
    folded = folded_scale(sm_scale)
    smoothed = q.float() if mean is None else q.float() - mean[:, None, :]
    return quantize_int8(smoothed * folded, *row_groups(q.shape[1], "q", granularity, q.device))


def quantize_keys(k: torch.Tensor, mean: torch.Tensor | None, granularity: str):
    """Keys ``[H, N, D]`` of one sequence, minus ``mean [H, D]`` if given: ``(int8, scale [H, N])``."""
    smoothed = k.float() if mean is None else k.float() - mean[:, None, :]
    return quantize_int8(smoothed, *row_groups(k.shape[1], "k", granularity, k.device))


def quantize_values_fp8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values ``[H, N, D]`` (``N > 0``) of one sequence as ``(float8_e4m3fn, per-channel scale [H, D])``."""
    amax = v.float().abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (v.float() / scale[:, None, :]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def value_scale(v: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[S, H, D]``: for ``pv_dtype="fp16"``, per sequence, head and channel of ``v
    [B, H, N, D]`` the least power of two ``2^e`` (``e >= 0``) with ``max |v| / 2^e <= 65504``;
    1 where V fits float16 already, or where the max is inf or NaN (those stay as they are).
    No host sync: the packed sequences' maxima by a scatter reduction."""
    batch, heads, n, d = v.shape
    if cu_seqlens is None:
        amax = v.abs().amax(dim=2).float() if n else v.new_zeros(batch, heads, d, dtype=torch.float32)
    else:
        index = token_sequence(cu_seqlens, n)[:, None, None].expand(n, heads, d)
        amax = v.new_zeros(cu_seqlens.shape[0] - 1, heads, d, dtype=torch.float32).scatter_reduce_(
            0, index, v[0].abs().float().transpose(0, 1), "amax")
    # amax = mantissa 2^exponent, mantissa in [0.5, 1): amax / 2^(exponent - 16) = mantissa 2^16 is
    # in [32768, 65536), within range unless above 65504
    mantissa, exponent = torch.frexp(amax)
    exponent = exponent - 16 + (mantissa * 65536.0 > FP16_MAX).to(exponent.dtype)
    beyond = (amax > FP16_MAX) & amax.isfinite()
    return torch.where(beyond, torch.ldexp(torch.ones_like(amax), exponent), torch.ones_like(amax))


def token_sequence(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """int64 ``[n]``: the sequence each of ``n`` packed tokens belongs to (empty sequences own none)."""
    tokens = torch.arange(n, dtype=cu_seqlens.dtype, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:], tokens, right=True)


def per_token(x: torch.Tensor, cu_seqlens: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x [S, H, D]`` per sequence as ``[B, H, n, D]``-broadcastable per token."""
    if cu_seqlens is None:
        return x[:, :, None, :]
    return x[token_sequence(cu_seqlens, n)].transpose(0, 1)[None]


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of int8 tensors, exactly, as int32 (float64 holds every partial sum of <= 2^53)."""
    return (a.double() @ b.double()).to(torch.int32)


def _pv_operands(v: torch.Tensor, pv_dtype: str):
    """V as the P.V product reads it (float32 values), its per-channel scale (None if unscaled) and
    how P enters the product (rounded, and for fp8 multiplied by 448, which ``acc / l`` divides out)."""
    if pv_dtype == "fp8":
        v8, scale = quantize_values_fp8(v)
        return v8.float(), scale, lambda p: (p * FP8_MAX).to(torch.float8_e4m3fn).float()
    rounded = torch.float16 if pv_dtype == "fp16" else v.dtype
    return v.to(rounded).float(), None, lambda p: p.to(rounded).float()


# ---- attention ----

def _attend(q, k, v, mean, q_mean, bias, sm_scale, causal, granularity, pv_dtype):
    """One sequence: q ``[Hq, Nq, D]``, k and v ``[Hkv, Nk, D]``, the smoothing means ``[H, D]``
    and key bias ``[Hq, Nk]`` (or None) -> (out ``[Hq, Nq, D]`` float32, lse ``[Hq, Nq]``)."""
    hq, nq, d = q.shape
    hkv, nk = k.shape[:2]
    group = hq // hkv
    q8, q_scale = quantize_queries(q, q_mean, sm_scale, granularity)
    k8, k_scale = quantize_keys(k, mean, granularity)
    v_read, v_scale, round_p = _pv_operands(v, pv_dtype)
    # query heads grouped under their kv head: [Hkv, G, Nq, ...]
    q8, q_scale = q8.view(hkv, group, nq, d), q_scale.view(hkv, group, nq, 1)
    m = q.new_full((hkv, group, nq), -math.inf, dtype=torch.float32)
    l = torch.zeros_like(m)
    acc = q.new_zeros(hkv, group, nq, d, dtype=torch.float32)
    mask = visible(nq, nk, causal, q.device)
    for start in range(0, nk, BLOCK_K):
        end = min(start + BLOCK_K, nk)
        s_int = int8_matmul(q8, k8[:, None, start:end].transpose(-1, -2))
        s = s_int.float() * q_scale * k_scale[:, None, None, start:end]
        if bias is not None:
            s = s + bias.view(hkv, group, 1, nk)[..., start:end]
        if mask is not None:
            s = s.masked_fill(~mask[:, start:end], -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(m_new == -math.inf, 0.0, m_new)  # a row with no key yet: exp2(-inf) = 0
        p = torch.exp2(s - m_safe[..., None])
        alpha = torch.exp2(m - m_safe)
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + round_p(p) @ v_read[:, None, start:end]
        m = m_new
    out = acc / torch.where(l == 0, 1.0, l)[..., None]  # a row with no key has acc = 0; NaN stays NaN
    if v_scale is not None:
        out = out * (v_scale / FP8_MAX)[:, None, None, :]
    lse = (m + torch.log2(l)) * LN2
    if mean is not None:  # smoothing shifted every score of row i by sm_scale q_i . k_mean
        lse = lse + sm_scale * (q.float().view(hkv, group, nq, d) @ mean[:, None, :, None]).squeeze(-1)
    return out.reshape(hq, nq, d), lse.reshape(hq, nq)


def _run(attend, q, k, v, k_mean, q_mean, key_bias, sm_scale, causal, granularity, pv_dtype, cu_seqlens_q,
         cu_seqlens_k):
    batch, hq, nq, d = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, hq, nq), -math.inf, dtype=torch.float32, device=q.device)
    for s, (b, q0, q1, k0, k1) in enumerate(sequences(batch, nq, k.shape[2], cu_seqlens_q, cu_seqlens_k)):
        if q1 == q0 or k1 == k0:  # no queries, or nothing to attend to: zeros and -inf
            continue
        means = (None if k_mean is None else k_mean[s], None if q_mean is None else q_mean[s],
                 None if key_bias is None else key_bias[b, :, k0:k1])
        out[b, :, q0:q1], lse[b, :, q0:q1] = attend(q[b, :, q0:q1], k[b, :, k0:k1], v[b, :, k0:k1], *means,
                                                   sm_scale, causal, granularity, pv_dtype)
    return out.to(q.dtype), lse


def quantized_attention(q, k, v, k_mean, q_mean, key_bias, sm_scale, causal, granularity, pv_dtype, cu_seqlens_q,
                        cu_seqlens_k):
    """The reference backend's kernel: INT8 QK^T, float32 online softmax over key tiles, P.V per
    ``pv_dtype`` (module docstring, steps 1-7). Returns ``(out in q's dtype, lse float32)``."""
    return _run(_attend, q, k, v, k_mean, q_mean, key_bias, sm_scale, causal, granularity, pv_dtype, cu_seqlens_q,
                cu_seqlens_k)


def _attend_naive(q, k, v, mean, q_mean, bias, sm_scale, causal, granularity, pv_dtype):
    """One sequence, no tiles: dequantized scores, one float64 softmax (natural base), P.V with V
    as the kernel reads it (P unrounded, the difference the tests allow for)."""
    hq, nq, d = q.shape
    hkv, nk = k.shape[:2]
    q8, q_scale = quantize_queries(q, q_mean, sm_scale, granularity)
    k8, k_scale = quantize_keys(k, mean, granularity)
    v_read, v_scale, _ = _pv_operands(v, pv_dtype)
    group = hq // hkv
    scores = (q8.double() * q_scale.double()[..., None]).view(hkv, group, nq, d) @ \
        (k8.double() * k_scale.double()[..., None])[:, None].transpose(-1, -2) * LN2  # base 2 -> natural
    if bias is not None:
        scores = scores + bias.double().view(hkv, group, 1, nk) * LN2
    if mean is not None:
        scores = scores + sm_scale * (q.double().view(hkv, group, nq, d) @ mean.double()[:, None, :, None])
    mask = visible(nq, nk, causal, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - torch.where(lse == -math.inf, 0.0, lse)[..., None])
    out = p @ (v_read.double() if v_scale is None else v_read.double() * v_scale.double()[:, None, :])[:, None]
    return out.reshape(hq, nq, d), lse.reshape(hq, nq)


def quantized_attention_naive(q, k, v, k_mean, q_mean, key_bias, sm_scale, causal, granularity, pv_dtype,
                              cu_seqlens_q=None, cu_seqlens_k=None):
    """The definition the kernel tiles: the same int8 values and scales, the whole row's softmax at
    once in float64 (lse includes the smoothing correction). Same arguments and results as
    :func:`quantized_attention`."""
    return _run(_attend_naive, q, k, v, k_mean, q_mean, key_bias, sm_scale, causal, granularity, pv_dtype,
                cu_seqlens_q, cu_seqlens_k)


# ---- backward ----

def _attention_grads(do, dlse, q, k, v, sm_scale, causal):
    """One sequence's exact attention gradient (float32, from the inputs' values)."""
    hq, nq, d = q.shape
    hkv, nk = k.shape[:2]
    group = hq // hkv
    qf = q.float().view(hkv, group, nq, d)
    kf, vf = k.float()[:, None], v.float()[:, None]
    do = do.float().view(hkv, group, nq, d)
    s = qf @ kf.transpose(-1, -2) * sm_scale
    mask = visible(nq, nk, causal, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    p = torch.exp(s - torch.where(lse == -math.inf, 0.0, lse))
    o = p @ vf
    dv = (p.transpose(-1, -2) @ do).sum(dim=1)
    dp = do @ vf.transpose(-1, -2)
    delta = (do * o).sum(dim=-1, keepdim=True)
    ds = p * (dp - delta + dlse.float().view(hkv, group, nq, 1))  # d lse / d s = p
    dq = (ds @ kf) * sm_scale
    dk = (ds.transpose(-1, -2) @ qf).sum(dim=1) * sm_scale
    return dq.reshape(hq, nq, d), dk, dv


def attention_backward(grad_out, grad_lse, q, k, v, sm_scale, causal, cu_seqlens_q, cu_seqlens_k):
    """``(dq, dk, dv)`` of exact softmax attention (not of the quantized forward: a straight-through
    estimator), FlashAttention-2's formulas: scores recomputed from the saved inputs in float32,
    ``dS = P * (dO V^T - rowsum(dO * O) + d lse)``. ``grad_lse`` may be None. Gradients come in
    the inputs' dtypes; GQA sums each kv head's gradient over its query heads."""
    batch, hq, nq, d = q.shape
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    if grad_lse is None:
        grad_lse = q.new_zeros(batch, hq, nq, dtype=torch.float32)
    for b, q0, q1, k0, k1 in sequences(batch, nq, k.shape[2], cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        dq[b, :, q0:q1], dk[b, :, k0:k1], dv[b, :, k0:k1] = _attention_grads(
            grad_out[b, :, q0:q1], grad_lse[b, :, q0:q1], q[b, :, q0:q1], k[b, :, k0:k1], v[b, :, k0:k1],
            sm_scale, causal)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

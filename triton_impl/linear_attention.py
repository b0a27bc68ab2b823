"""Gated DeltaNet and gated linear attention as Triton kernels, chunked and step by step.

Layout: every launcher flattens ``[B, T, *]`` to token-major ``[B*T, *]`` and treats the batch rows
as packed sequences, so one set of kernels serves both layouts. Around the kernels, in torch: the
optional l2 normalization of q, k (and its backward), and the sums of ``dq``, ``dk`` over the value
heads that share a query/key head (the kernels write them per value head). The math and its notation
are in ``torch_kernels.reference.linear_attention``: per chunk of ``C = 64`` steps, ``b_t = g_1 +
... + g_t`` is the cumulative log decay inside the chunk, ``D_ts = exp(b_t - b_s)`` (``s <= t``),
``S0`` the state at its start.

Chunked forward (three launches; ``beta=None`` skips the WY step, ``W = V``):

1. ``wy_kernel``: ``T = (I + strict_lower(diag(beta) D * K K^T))^-1`` in the chunk's two halves
   (``[C/2, C/2]`` tiles: ``[C, C]`` float32 ones spilled registers on sm_80), each half's
   inverse by forward substitution on its two 16x16 diagonal blocks (both at once, a row of each
   per dot) and a block merge, and the block below them as ``-T22 A21 T11``; then
   ``U = T diag(beta) V`` and ``Wk = T diag(beta exp(b)) K``, so that the effective values are
   ``W = U - Wk S0``.
2. ``chunk_state_kernel``: one program per (sequence, value head, V block) walks the chunks: stores
   ``S0`` of each chunk to ``h``, ``W`` (over ``U``, in place) and the final state.
3. ``chunk_output_kernel``: ``O = scale (exp(b) Q S0 + (D * Q K^T) W)`` per chunk, in parallel.

Chunked backward recomputes 1-2 from the inputs (``T`` kept this time), then:

4. ``chunk_state_backward_kernel`` walks the chunks backwards with ``dS`` (the gradient of the
   chunk's end state): ``dW = (K exp(b_C - b)) dS + scale (D * Q K^T)^T dO`` and
   ``dS0 = exp(b_C) dS + scale (exp(b) Q)^T dO - Wk^T dW``; stores ``dS`` per chunk, ``dW``, ``dh0``.
5. ``chunk_grad_pairs_kernel`` per chunk: the ``[C, C]`` gradients ``dP = scale (dO W^T) * D`` and,
   for the delta rule, ``dA * D = -(dR W^T) * D`` from the triangular solve's adjoint (``dR = T^T
   dW`` is the gradient of its right-hand side ``diag(beta)(V - exp(b) K S0)``), with ``dv =
   diag(beta) dR`` and the ``V . dR`` part of ``dbeta``.
6. ``chunk_grad_kernel`` per chunk and K block: ``dq``, ``dk``, and this block's parts of ``dbeta``
   and of ``dL/db`` (summed over the blocks in torch); ``dg`` is the reverse cumulative sum of
   ``dL/db`` inside each chunk (``reverse_cumsum_kernel``), as ``b`` is ``g``'s cumulative sum there.

Tiles (``default_config``): no kernel holds a whole ``[C, K]`` or ``[K, V]`` tile, so shared memory
and registers do not grow with K and V (up to ``MAX_K`` = 256). The chunk kernels loop over K and V
in blocks; the two walks keep their state in ``h`` / ``dh`` (in L2) rather than in registers, each
chunk reading it back in K blocks after a barrier and writing the next one.

Strong decay: every ``exp`` takes a sum of gates of one sign, never a difference of cumulative
sums: ``D_ts`` from ``g_{s+1} + ... + g_t`` summed directly, ``exp(b_t)`` from a prefix sum and
``exp(b_C - b_t)`` from a suffix sum. ``b_t - b_s`` cancels in float32 once gates are large (g =
-1e4 left outputs ~2e-3 off) and is ``-inf - -inf = NaN`` after g = -inf, a full state reset.
``dL/db`` is taken term by term as pairs (a write at step s, a read at step t > s) that carry their
decay, or reads of ``S0``; the pairs of a step with itself carry none and cancel exactly, so they
are left out, and what remains adds no large terms that would cancel in float32.

Recurrent forms (``recurrent_kernel``, one program per (sequence, value head, V block), the
``[K, BV]`` state in registers, multiplied by ``exp(g_t) <= 1`` at each step, so g = -inf zeroes it
and nothing overflows). The backward stores no states: the gradient ``dS`` obeys a backward
recurrence free of ``S`` (``dS_{t-1} = a_t (dS_t - k_t de_t^T) + scale q_{t-1} do_{t-1}^T``), so it
replays the forward once for the errors ``e_t = v_t - S'_t^T k_t`` (delta rule only), walks back once
(``recurrent_backward_kernel``: ``dv``, ``dbeta``, the write part ``dS_t u_t`` of ``dk``, ``dh0``) and
replays forward once more for what needs ``S`` (``dq = scale S_t do_t``, the read part ``-S'_t de_t``
of ``dk``). ``dg`` needs no product of a state and its gradient: the decay between a write at step s
and a read at step r is ``exp(g_{s+1} + ... + g_r)``, so ``dL/dg_t`` sums the pairs with ``s < t <=
r``. The walks give each step's read terms (``q.dq + k.dk_read``, and ``<dht, S_T>`` at the last
step) minus its write terms (``k.dk_write``), each term a pair carrying its decay (a step's own
write and read, which cancel exactly, left out); ``dg`` is the reverse cumulative sum of those
(``reverse_cumsum_kernel``), in which the pairs on one side of t cancel. No exponential of a
cumulative decay is ever formed.

Kimi Delta Attention (``PER_CHANNEL``): ``g`` holds a log decay per key channel, row c of the
state is multiplied by ``exp(g_tc)``, and each ``dL/dB`` term above is kept per channel (a per-head
decay's is the sum of those over K), so ``dg`` is the same reverse cumulative sum taken per channel.
The chunked forms: ``D_tsc = exp(b_tc - b_sc)`` does not factor out of a sum over channels, so the
products ``D * Q K^T`` and ``D * K K^T`` become ``P(X, Y)_ts = sum_c X_tc Y_sc D_tsc``, taken by
``channel_products_kernel`` in 16-step blocks: for rows t of block i and columns s of an earlier
block, through the last step r before block i, ``D_tsc = exp(g_{r+1} + ... + g_t) exp(g_{s+1} +
... + g_r)`` (both sums of gates, so both factors are <= 1 and the block is one matmul); the
diagonal blocks elementwise. ``wy_kernel`` and ``chunk_output_kernel`` read them in place of their
own products, and every ``exp(b)``, ``exp(b_C - b)``, ``exp(b_C)`` is per channel (``[C, BK]``
tiles, a ``[BK]`` vector). Backward: the state walk reads ``P(Q, K)``, the ``[C, C]`` gradients are
left undecayed, and ``chunk_grad_channel_kernel`` takes their products with Q and K by the same
16-step blocks (``dP D`` per channel has no matmul form either).

Precision: as the reference's, whatever the inputs' dtype: float32 states, intermediates and
accumulation, and q, k normalized in float32 (``use_qk_l2norm``). On a GPU every product with a
float32 operand (a state or its gradient, a decayed or solved tile, ``T``, ``W``) is tf32x3
(``common.dot_tf32x3``), never rounded to a 16-bit input dtype: rounded (bfloat16 inputs on an H200), the chunk
kernels' outputs were ~35x and their final states ~10^4x further from the truth than the
reference's, element by element. Only products of two input tiles as loaded take 16-bit operands
(``common.dot_inputs``, exact products): ``Q K^T`` in the output kernel and gated linear attention's ``dO V^T``.
A decay that multiplies a state step after step (each step of the recurrent forms, each chunk of
the walks) takes the math library's ``exp``, as torch does, not ``tl.exp``'s approximation, whose
ulps compound. The interpreter (CPU tensors) computes everything in float32 (its bfloat16 is wrong)
and has no math library.
"""

from __future__ import annotations

import dataclasses
import functools
import typing

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import arch_of, autotune, for_device
from .common import dot_inputs, dot_tf32x3

CHUNK = 64
SUB = 16  # the WY inverse's diagonal blocks (tl.dot's smallest tile)
MAX_K = 256  # the recurrent kernels keep a [K, BV] state in registers
EPS = 1e-6  # the l2 normalization's, as the reference


@dataclasses.dataclass(frozen=True)
class Config:
    """One kernel's launch: ``block_v`` (a program's share of V in the state walks, the output and
    the recurrent kernels; the step of the V loops elsewhere), ``block_k`` (the step of the K
    loops), warps, and pipeline stages (each stage keeps one more copy of a loop's tiles in shared
    memory)."""

    block_v: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 1


KERNELS = ("channel_products", "wy", "wy_per_channel", "chunk_state", "chunk_output", "chunk_state_backward",
           "chunk_state_backward_per_channel", "chunk_grad_pairs", "chunk_grad", "chunk_grad_channel", "recurrent")


def _splits_narrow_dots(kernel: str, block_k: int, block_v: int, num_warps: int, k_dim: int, v_dim: int,
                        arch: int | None) -> bool:
    """Whether ``num_warps`` would split one of ``kernel``'s 64-row dots 16 wide (``block_k`` wide
    in ``chunk_grad``, ``block_v`` wide in the other chunk kernels: no wider than K, V padded) into
    8-wide tf32 wgmma tiles on sm_90 (``arch`` None: taken as sm_90), which Triton from 3.6 on can
    read past their shared memory with (triton-lang/triton#10629): the float32 ``chunk_grad`` built
    so, all its dots m64n8k8, is where an H200 run hit an illegal memory access. The WY step's dots
    are 32 rows and the per-channel kernels' 16 (mma.sync); the recurrent kernels have none."""
    if (arch is not None and arch < 90) or num_warps < 8 or kernel in (
            "wy", "wy_per_channel", "recurrent", "channel_products", "chunk_grad_channel"):
        return False
    width = min(block_k, _padded(k_dim)) if kernel == "chunk_grad" else min(block_v, _padded(v_dim))
    return width < 32


def default_config(kernel: str, k_dim: int, v_dim: int, dtype: torch.dtype, interpreted: bool = False,
                   arch: int | None = None) -> Config:
    """Heuristic per kernel (``KERNELS``; "recurrent" covers the three recurrent launches, which
    must split V alike). The chunk kernels loop over K and V in blocks and keep no whole ``[C, K]``
    or ``[K, V]`` tile, so their shared memory does not grow with K, V (tests/test_device_compile.py
    holds it to the A100's and H100's limits). What limits the tiles is registers: nearly every dot
    is tf32x3 whatever the inputs' dtype (module docstring, Precision), which splits each operand in
    two, on sm_80 a warp holds a dot's operands over the whole depth of the product, and ptxas falls
    back to spilling nearly everything once a kernel wants far more than 255 registers. So: 32-wide K
    blocks and 8 warps, V blocks of 32 (16 in the kernels holding two ``[C, C]`` sums and ``T``, or
    ``Q K^T`` and ``dS``), one pipeline stage where a loop reads back what it stored or holds the
    most (and in the WY step, whose inverse sits at the edge of 255 registers: 2 stages spilled);
    16-wide K blocks for ``dq``, ``dk`` and the WY step (16-wide V blocks there too), and for the
    state backward with 16-bit inputs (32 spilled at K = 64). ``arch``, the GPU's compute capability
    (``triton_impl.arch_of``; None: not CUDA, taken as sm_90): on sm_90 a kernel whose dots are 16
    wide (the state backward, ``dq``/``dk``, the ``[C, C]`` gradients, any at V <= 16) takes 4 warps,
    as 8 would split them into 8-wide tf32 wgmma tiles (:func:`_splits_narrow_dots`), and the
    ``[C, C]`` gradients one stage (two spilled there); the WY step takes 4 warps for 16-bit inputs (8
    spilled) and 8 for float32 (4 spilled), and 8 for a per-channel decay (``wy_per_channel``, which
    reads ``P(K, K)``: 4 spilled on sm_90). Kimi Delta Attention's block products take 16-wide K
    blocks (their diagonal blocks hold ``[16, 16, BK]`` tiles) and 4 warps; its state backward
    (``chunk_state_backward_per_channel``) 32-wide V blocks and 8 warps (4 spilled on sm_90), and
    its ``dq``/``dk`` (``chunk_grad_channel``) 16-wide K and V blocks and 8 warps (4, or V blocks
    of 32, spilled). The interpreter, whose
    cost is per program and step, takes 64-wide tiles. The recurrent form takes narrow V blocks on a
    GPU (16: more programs, and at 32 a float16 state of K = 128 spilled).
    """
    padded_v = max(16, triton.next_power_of_2(v_dim))
    if kernel == "recurrent":
        return Config(block_v=min(64 if interpreted else 16, padded_v), num_warps=4, num_stages=2)
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")
    if kernel == "channel_products":  # [SB, SB] dots; its diagonal blocks hold [SB, SB, BK] tiles
        return Config(block_v=16, block_k=64 if interpreted else 16, num_warps=4, num_stages=1)
    if kernel == "chunk_state_backward_per_channel" and not interpreted:  # 8 warps: 4 spilled on sm_90
        warps = 4 if _splits_narrow_dots(kernel, 16, 32, 8, k_dim, v_dim, arch) else 8
        return Config(block_v=min(32, padded_v), block_k=16, num_warps=warps, num_stages=1)
    if kernel == "chunk_grad_channel":  # SB-row dots
        return Config(block_v=min(64 if interpreted else 16, padded_v), block_k=64 if interpreted else 16,
                      num_warps=4 if interpreted else 8, num_stages=1)
    if interpreted:
        return Config(block_v=min(64, padded_v), block_k=64, num_warps=4, num_stages=1)
    wide = dtype == torch.float32
    block_v = {"chunk_grad_pairs": 16, "wy": 16, "wy_per_channel": 16, "chunk_state_backward": 16}.get(kernel, 32)
    block_k = 16 if kernel in ("chunk_grad", "wy", "wy_per_channel") or (
        kernel == "chunk_state_backward" and not wide) else 32
    hopper = arch is None or arch >= 90
    stages = 1 if kernel in ("chunk_state", "chunk_state_backward", "chunk_grad", "wy", "wy_per_channel") or \
        hopper and kernel == "chunk_grad_pairs" else 2
    if kernel == "wy":
        warps = 8 if wide else 4
    elif kernel == "wy_per_channel":
        warps = 8
    else:
        warps = 4 if _splits_narrow_dots(kernel, block_k, block_v, 8, k_dim, v_dim, arch) else 8
    return Config(block_v=min(block_v, padded_v), block_k=block_k, num_warps=warps, num_stages=stages)


@triton.jit
def _exp(x, ACCURATE: tl.constexpr):
    """``exp(x)`` for a decay that multiplies a state step after step (the errors compound): the
    math library's (as torch's) when ACCURATE, not ``tl.exp``'s fast approximation (``ex2.approx``
    on NVIDIA, a few ulp). The interpreter has no math library; its ``tl.exp`` is numpy's."""
    if ACCURATE:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _rows(ptr, rows, valid, head, HEADS: tl.constexpr, cols, col_mask, WIDTH: tl.constexpr):
    """Load ``[rows, cols]`` of head ``head`` from a token-major ``[tokens, HEADS, WIDTH]`` tensor."""
    offs = (rows.to(tl.int64)[:, None] * HEADS + head) * WIDTH + cols[None, :]
    return tl.load(ptr + offs, mask=valid[:, None] & col_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, x, rows, valid, head, HEADS: tl.constexpr, cols, col_mask, WIDTH: tl.constexpr):
    offs = (rows.to(tl.int64)[:, None] * HEADS + head) * WIDTH + cols[None, :]
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=valid[:, None] & col_mask[None, :])


@triton.jit
def _gates(g_ptr, rows, valid, head, HEADS: tl.constexpr, HAS_G: tl.constexpr, N: tl.constexpr):
    """``g`` of ``rows``, 0 where not ``valid`` (no decay past a sequence's end)."""
    if HAS_G:
        return tl.load(g_ptr + rows.to(tl.int64) * HEADS + head, mask=valid, other=0.0).to(tl.float32)
    return tl.zeros([N], tl.float32)


@triton.jit
def _chunk_gates(g_ptr, rows, end, head, HEADS: tl.constexpr, HAS_G: tl.constexpr, C: tl.constexpr):
    """A chunk's log decays, each summed directly over its own steps (module docstring,
    Strong decay): ``(g, b, to_end)`` with ``b_t = g_1 + ... + g_t`` from the chunk's start and
    ``to_end_t = g_{t+1} + ... + g_C`` to its end; ``tl.sum(g)`` is the whole chunk's."""
    g = _gates(g_ptr, rows, rows < end, head, HEADS, HAS_G, C)
    after = _gates(g_ptr, rows + 1, (rows + 1 < end) & (tl.arange(0, C) < C - 1), head, HEADS, HAS_G, C)
    return g, tl.cumsum(g, axis=0), tl.cumsum(after, axis=0, reverse=True)


@triton.jit
def _decay(g, t_ok, s_ok, STRICT: tl.constexpr, N: tl.constexpr):
    """``D_ts = exp(g_{s+1} + ... + g_t)`` for ``s <= t`` (``s < t`` when STRICT), 0 elsewhere: the
    segment's gates summed directly, not as ``b_t - b_s`` (module docstring, Strong decay)."""
    idx = tl.arange(0, N)
    segment = tl.cumsum(tl.where(idx[:, None] > idx[None, :], g[:, None], 0.0), axis=0)
    if STRICT:
        keep = idx[:, None] > idx[None, :]
    else:
        keep = idx[:, None] >= idx[None, :]
    keep = keep & t_ok[:, None] & s_ok[None, :]
    return tl.where(keep, tl.exp(segment), 0.0)


@triton.jit
def _channel_gates(g_ptr, rows, end, head, HEADS: tl.constexpr, dims, k_ok, K: tl.constexpr, N: tl.constexpr):
    """:func:`_chunk_gates` of a per-channel decay (``[tokens, HEADS, K]``) for channels ``dims``:
    ``(g, b, to_end)``, each ``[N, len(dims)]`` and summed over its own steps per channel."""
    g = _rows(g_ptr, rows, rows < end, head, HEADS, dims, k_ok, K)
    after_ok = (rows + 1 < end) & (tl.arange(0, N) < N - 1)
    after = _rows(g_ptr, rows + 1, after_ok, head, HEADS, dims, k_ok, K)
    return g, tl.cumsum(g, axis=0), tl.cumsum(after, axis=0, reverse=True)


@triton.jit
def _chunk_of(chunk_seq_ptr, chunk_start_ptr, cu_ptr, c):
    """``(first token, end of its sequence)`` of chunk slot ``c``; ``first >= end`` for a slot past
    the last chunk (:func:`_chunks`), whose programs return at once (or mask every row)."""
    n = tl.load(chunk_seq_ptr + c)
    t0 = tl.load(chunk_start_ptr + c)
    end = tl.load(cu_ptr + n + 1)
    return t0, end


@triton.jit
def _block_diagonal_inverse(a, SB: tl.constexpr, N: tl.constexpr):
    """The inverse of the block diagonal of ``I + a`` (blocks of ``SB``; ``a [N, N]`` strictly
    lower): forward substitution in all blocks at once, row ``r`` of each block per step as one
    ``[N, N]`` dot, so only 2D ``[N, N]`` tiles live in registers."""
    idx = tl.arange(0, N)
    diag = tl.where(idx[:, None] // SB == idx[None, :] // SB, a, 0.0)
    eye = tl.where(idx[:, None] == idx[None, :], 1.0, 0.0)
    x = eye
    for r in range(1, SB):
        step = (idx % SB == r)[:, None]
        x = tl.where(step, eye - dot_tf32x3(tl.where(step, diag, 0.0), x), x)
    return x


@triton.jit
def _unit_lower_inverse(a, SB: tl.constexpr, N: tl.constexpr):
    """``(I + a)^-1`` for ``a [N, N]`` strictly lower. ``I + a = Lb (I + M)`` with ``Lb`` its block
    diagonal (blocks of ``SB``) and ``M = Lb^-1`` (the blocks below it), strictly block lower, so
    ``M^(N / SB) = 0`` and the inverse is ``(I - M + M^2 - ...) Lb^-1`` exactly, taken by Horner."""
    idx = tl.arange(0, N)
    lb_inv = _block_diagonal_inverse(a, SB, N)
    m = dot_tf32x3(lb_inv, tl.where(idx[:, None] // SB > idx[None, :] // SB, a, 0.0))
    x = lb_inv
    for _ in tl.static_range(N // SB - 1):
        x = lb_inv - dot_tf32x3(m, x)
    return x


@triton.jit
def channel_products_kernel(
    q_ptr, k_ptr, g_ptr, pqk_ptr, pkk_ptr, chunk_seq_ptr, chunk_start_ptr, cu_ptr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, SB: tl.constexpr,
):
    """A per-channel decay's ``P(Q, K)`` and ``P(K, K)`` (``sum_c X_tc K_sc D_tsc``, ``s <= t``) of
    chunk ``program_id(0)``, value head ``program_id(1)``: the ``[SB, SB]`` block of row sub-chunk
    ``i`` and column sub-chunk ``j <= i`` numbered ``program_id(2)`` (``C/SB (C/SB + 1) / 2`` of
    them), to ``[tokens, HV, C]`` rows as ``T``; blocks above the diagonal are not written (module
    docstring, Kimi Delta Attention)."""
    t0, end = _chunk_of(chunk_seq_ptr, chunk_start_ptr, cu_ptr, tl.program_id(0))
    if t0 >= end:
        return
    hv = tl.program_id(1)
    kh = hv // (HV // H)
    pair = tl.program_id(2)
    i = 0
    for level in tl.static_range(1, C // SB):  # pair = i (i + 1) / 2 + j
        i += (pair >= level * (level + 1) // 2).to(tl.int32)
    j = pair - i * (i + 1) // 2
    idx = tl.arange(0, SB)
    rows_i = t0 + i * SB + idx
    rows_j = t0 + j * SB + idx
    ok_i = rows_i < end
    ok_j = rows_j < end
    lower = idx[:, None] >= idx[None, :]
    pqk = tl.zeros([SB, SB], tl.float32)
    pkk = tl.zeros([SB, SB], tl.float32)
    for k0 in range(0, K, BK):
        dims = k0 + tl.arange(0, BK)
        k_ok = dims < K
        q_i = _rows(q_ptr, rows_i, ok_i, kh, H, dims, k_ok, K)
        k_i = _rows(k_ptr, rows_i, ok_i, kh, H, dims, k_ok, K)
        k_j = _rows(k_ptr, rows_j, ok_j, kh, H, dims, k_ok, K)
        g_i = _rows(g_ptr, rows_i, ok_i, hv, HV, dims, k_ok, K)
        if i == j:
            # D_tsc = exp(g_{s+1,c} + ... + g_{t,c}) summed directly: a [SB, SB, BK] tile
            segment = tl.cumsum(tl.where((idx[:, None] > idx[None, :])[:, :, None], g_i[:, None, :], 0.0), axis=0)
            k_decayed = tl.where(lower[:, :, None], tl.exp(segment), 0.0) * k_j[None, :, :]
            pqk += tl.sum(q_i[:, None, :] * k_decayed, axis=2)
            pkk += tl.sum(k_i[:, None, :] * k_decayed, axis=2)
        else:
            # through step r, the last of sub-chunk i - 1: D_tsc = exp(b_tc - b_rc) exp(b_rc - b_sc),
            # g_{r+1} + ... + g_t over sub-chunk i and g_{s+1} + ... + g_r from sub-chunk j to r,
            # both <= 0, so the product is one matmul and neither factor can overflow
            to_r = _channel_gates(g_ptr, rows_j, end, hv, HV, dims, k_ok, K, SB)[2]
            for m in range(j + 1, i):  # the whole sub-chunks between
                rows_m = t0 + m * SB + idx
                to_r += tl.sum(_rows(g_ptr, rows_m, rows_m < end, hv, HV, dims, k_ok, K), axis=0)[None, :]
            k_from = k_j * tl.exp(to_r)
            from_r = tl.exp(tl.cumsum(g_i, axis=0))
            pqk += dot_tf32x3(q_i * from_r, tl.trans(k_from))
            pkk += dot_tf32x3(k_i * from_r, tl.trans(k_from))
    cols = j * SB + idx
    _store_rows(pqk_ptr, pqk, rows_i, ok_i, hv, HV, cols, cols < C, C)
    _store_rows(pkk_ptr, pkk, rows_i, ok_i, hv, HV, cols, cols < C, C)


@triton.jit
def wy_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, pkk_ptr, t_ptr, u_ptr, wk_ptr, chunk_seq_ptr, chunk_start_ptr, cu_ptr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, SB: tl.constexpr, HAS_G: tl.constexpr, STORE_T: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
):
    """``T``, ``U = T diag(beta) V`` and ``Wk = T diag(beta exp(b)) K`` of chunk ``program_id(0)``
    and value head ``program_id(1)`` (module docstring, step 1), in the chunk's two halves of
    ``C / 2`` rows: ``[C, C]`` float32 tiles, whose tf32x3 operands sm_80's mma.sync holds over the
    whole product depth, spilled registers; halves do not. PER_CHANNEL: ``D * K K^T`` is ``P(K, K)``
    from :func:`channel_products_kernel` (``pkk``) and ``exp(b)`` is per channel."""
    # no early return for a slot past the last chunk (it made sm_90 spill at K = V = 128): its
    # rows are all masked, so it reads and writes nothing
    t0, end = _chunk_of(chunk_seq_ptr, chunk_start_ptr, cu_ptr, tl.program_id(0))
    hv = tl.program_id(1)
    kh = hv // (HV // H)
    HALF: tl.constexpr = C // 2
    steps = tl.arange(0, HALF)
    rows1 = t0 + steps
    rows2 = rows1 + HALF
    ok1 = rows1 < end
    ok2 = rows2 < end
    # A = strict_lower(diag(beta) D * K K^T) by blocks [[A11, 0], [A21, A22]];
    # T = [[T11, 0], [T21, T22]]: T11 = (I + A11)^-1, T22 = (I + A22)^-1, T21 = -T22 A21 T11
    if PER_CHANNEL:  # D * K K^T is P(K, K), each block read where it is needed (the inverses hold 255 registers)
        beta1 = tl.load(beta_ptr + rows1.to(tl.int64) * HV + hv, mask=ok1, other=0.0)
        beta2 = tl.load(beta_ptr + rows2.to(tl.int64) * HV + hv, mask=ok2, other=0.0)
        strict = steps[:, None] > steps[None, :]
        kk11 = _rows(pkk_ptr, rows1, ok1, hv, HV, steps, steps < HALF, C)
        t11 = _unit_lower_inverse(beta1[:, None] * tl.where(strict, kk11, 0.0), SB, HALF)
        kk22 = _rows(pkk_ptr, rows2, ok2, hv, HV, HALF + steps, steps < HALF, C)
        t22 = _unit_lower_inverse(beta2[:, None] * tl.where(strict, kk22, 0.0), SB, HALF)
        a21 = beta2[:, None] * _rows(pkk_ptr, rows2, ok2, hv, HV, steps, steps < HALF, C)
    else:
        kk11 = tl.zeros([HALF, HALF], tl.float32)
        kk21 = tl.zeros([HALF, HALF], tl.float32)
        kk22 = tl.zeros([HALF, HALF], tl.float32)
        for k0 in range(0, K, BK):
            dims = k0 + tl.arange(0, BK)
            k1 = _rows(k_ptr, rows1, ok1, kh, H, dims, dims < K, K)
            k2 = _rows(k_ptr, rows2, ok2, kh, H, dims, dims < K, K)
            kk11 += dot_tf32x3(k1, tl.trans(k1))
            kk21 += dot_tf32x3(k2, tl.trans(k1))
            kk22 += dot_tf32x3(k2, tl.trans(k2))
        # read after the K loop: loaded before it, the betas pushed the per-head kernel to a spill at K = 128
        beta1 = tl.load(beta_ptr + rows1.to(tl.int64) * HV + hv, mask=ok1, other=0.0)
        beta2 = tl.load(beta_ptr + rows2.to(tl.int64) * HV + hv, mask=ok2, other=0.0)
        g1, b1, to_end1 = _chunk_gates(g_ptr, rows1, end, hv, HV, HAS_G, HALF)
        g2, b2, _ = _chunk_gates(g_ptr, rows2, end, hv, HV, HAS_G, HALF)
        # across the halves D_ts = exp((g_{s+1} + ... + g_HALF) + (g_{HALF+1} + ... + g_t))
        across = tl.where(ok2[:, None] & ok1[None, :], tl.exp(b2[:, None] + to_end1[None, :]), 0.0)
        b2 += tl.sum(g1, axis=0)  # from the chunk's start: gates of one sign
        t11 = _unit_lower_inverse(beta1[:, None] * _decay(g1, ok1, ok1, True, HALF) * kk11, SB, HALF)
        t22 = _unit_lower_inverse(beta2[:, None] * _decay(g2, ok2, ok2, True, HALF) * kk22, SB, HALF)
        a21 = beta2[:, None] * across * kk21
    t21 = -dot_tf32x3(t22, dot_tf32x3(a21, t11))
    if STORE_T:
        _store_rows(t_ptr, t11, rows1, ok1, hv, HV, steps, steps < HALF, C)
        _store_rows(t_ptr, tl.zeros([HALF, HALF], tl.float32), rows1, ok1, hv, HV, HALF + steps, steps < HALF, C)
        _store_rows(t_ptr, t21, rows2, ok2, hv, HV, steps, steps < HALF, C)
        _store_rows(t_ptr, t22, rows2, ok2, hv, HV, HALF + steps, steps < HALF, C)
    for k0 in range(0, K, BK):
        dims = k0 + tl.arange(0, BK)
        k_ok = dims < K
        if PER_CHANNEL:
            gk1, bk1, to_end_k1 = _channel_gates(g_ptr, rows1, end, hv, HV, dims, k_ok, K, HALF)
            gk2, bk2, to_end_k2 = _channel_gates(g_ptr, rows2, end, hv, HV, dims, k_ok, K, HALF)
            decay1 = tl.exp(bk1)
            decay2 = tl.exp(bk2 + tl.sum(gk1, axis=0)[None, :])  # from the chunk's start: gates of one sign
        else:
            decay1 = tl.exp(b1)[:, None]
            decay2 = tl.exp(b2)[:, None]
        k1 = _rows(k_ptr, rows1, ok1, kh, H, dims, k_ok, K) * beta1[:, None] * decay1
        k2 = _rows(k_ptr, rows2, ok2, kh, H, dims, k_ok, K) * beta2[:, None] * decay2
        _store_rows(wk_ptr, dot_tf32x3(t11, k1), rows1, ok1, hv, HV, dims, k_ok, K)
        _store_rows(wk_ptr, dot_tf32x3(t21, k1) + dot_tf32x3(t22, k2), rows2, ok2, hv, HV, dims, k_ok, K)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        v_ok = cols < V
        v1 = _rows(v_ptr, rows1, ok1, hv, HV, cols, v_ok, V) * beta1[:, None]
        v2 = _rows(v_ptr, rows2, ok2, hv, HV, cols, v_ok, V) * beta2[:, None]
        _store_rows(u_ptr, dot_tf32x3(t11, v1), rows1, ok1, hv, HV, cols, v_ok, V)
        _store_rows(u_ptr, dot_tf32x3(t21, v1) + dot_tf32x3(t22, v2), rows2, ok2, hv, HV, cols, v_ok, V)


@triton.jit
def _state_block(slab, block, cols, K: tl.constexpr, V: tl.constexpr):
    """Rows ``block`` (of K), columns ``cols`` (of V) of a float32 ``[K, V]`` state at ``slab``."""
    mask = (block < K)[:, None] & (cols < V)[None, :]
    return tl.load(slab + block[:, None] * V + cols[None, :], mask=mask, other=0.0)


@triton.jit
def _store_state_block(slab, x, block, cols, K: tl.constexpr, V: tl.constexpr):
    tl.store(slab + block[:, None] * V + cols[None, :], x, mask=(block < K)[:, None] & (cols < V)[None, :])


@triton.jit
def chunk_state_kernel(
    k_ptr, v_ptr, g_ptr, u_ptr, wk_ptr, h0_ptr, h_ptr, ht_ptr, cu_ptr, first_chunk_ptr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, HAS_G: tl.constexpr, HAS_H0: tl.constexpr, DELTA: tl.constexpr,
    ACCURATE_EXP: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """The chunk walk of sequence ``program_id(0)``, value head ``program_id(1)``, V block
    ``program_id(2)`` (module docstring, step 2): each chunk's start state to ``h``, ``W = U - Wk S0``
    over ``U`` (delta rule; else ``W = V``), the final state to ``ht``. PER_CHANNEL: row c of the
    state decays by channel c's gates."""
    n = tl.program_id(0)
    hv = tl.program_id(1)
    kh = hv // (HV // H)
    start = tl.load(cu_ptr + n)
    end = tl.load(cu_ptr + n + 1)
    num_chunks = tl.cdiv(end - start, C)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    v_ok = cols < V
    slab = K * V  # one [K, V] state
    final = ht_ptr + (n * HV + hv).to(tl.int64) * slab
    state = h_ptr + (tl.load(first_chunk_ptr + n).to(tl.int64) * HV + hv) * slab  # this chunk's start state
    if num_chunks == 0:
        state = final
    for k0 in range(0, K, BK):
        block = k0 + tl.arange(0, BK)
        if HAS_H0:
            initial = _state_block(h0_ptr + (n * HV + hv).to(tl.int64) * slab, block, cols, K, V)
        else:
            initial = tl.zeros([BK, BV], tl.float32)
        _store_state_block(state, initial, block, cols, K, V)
    for i in range(num_chunks):
        following = state + HV * slab  # the next chunk's start state, or the final one
        if i == num_chunks - 1:
            following = final
        t0 = start + i * C
        rows = t0 + tl.arange(0, C)
        ok = rows < end
        g, _, to_end = _chunk_gates(g_ptr, rows, end, hv, HV, HAS_G and not PER_CHANNEL, C)
        tl.debug_barrier()  # the state, stored by every thread, is read back by others
        if DELTA:
            w = _rows(u_ptr, rows, ok, hv, HV, cols, v_ok, V)
            for k0 in range(0, K, BK):
                block = k0 + tl.arange(0, BK)
                wk = _rows(wk_ptr, rows, ok, hv, HV, block, block < K, K)
                w -= dot_tf32x3(wk, _state_block(state, block, cols, K, V))
            _store_rows(u_ptr, w, rows, ok, hv, HV, cols, v_ok, V)
        else:
            w = _rows(v_ptr, rows, ok, hv, HV, cols, v_ok, V)
        chunk_decay = _exp(tl.sum(g, axis=0), ACCURATE_EXP)
        end_decay = tl.where(ok, tl.exp(to_end), 0.0)
        for k0 in range(0, K, BK):
            block = k0 + tl.arange(0, BK)
            if PER_CHANNEL:
                gk, bk, to_end_k = _channel_gates(g_ptr, rows, end, hv, HV, block, block < K, K, C)
                block_decay = _exp(tl.sum(gk, axis=0), ACCURATE_EXP)[:, None]
                k_end_decay = tl.where(ok[:, None], tl.exp(to_end_k), 0.0)
            else:
                block_decay = chunk_decay
                k_end_decay = end_decay[:, None]
            k_decayed = _rows(k_ptr, rows, ok, kh, H, block, block < K, K) * k_end_decay
            updated = block_decay * _state_block(state, block, cols, K, V) + dot_tf32x3(tl.trans(k_decayed), w)
            _store_state_block(following, updated, block, cols, K, V)
        state = following


@triton.jit
def chunk_output_kernel(
    q_ptr, k_ptr, w_ptr, g_ptr, pqk_ptr, h_ptr, o_ptr, chunk_seq_ptr, chunk_start_ptr, cu_ptr, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, HAS_G: tl.constexpr, SIXTEEN_BIT: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """``O = scale (exp(b) Q S0 + (D * Q K^T) W)`` of chunk ``program_id(0)``, value head
    ``program_id(1)``, V block ``program_id(2)``; PER_CHANNEL: ``O = scale ((Q * exp(b)) S0 + P(Q, K)
    W)``, ``P(Q, K)`` from :func:`channel_products_kernel` (``pqk``)."""
    c = tl.program_id(0)
    hv = tl.program_id(1)
    kh = hv // (HV // H)
    DT = q_ptr.dtype.element_ty
    t0, end = _chunk_of(chunk_seq_ptr, chunk_start_ptr, cu_ptr, c)
    if t0 >= end:
        return
    rows = t0 + tl.arange(0, C)
    ok = rows < end
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    v_ok = cols < V
    state_base = (c.to(tl.int64) * HV + hv) * K * V
    qk = tl.zeros([C, C], tl.float32)
    qs = tl.zeros([C, BV], tl.float32)
    for k0 in range(0, K, BK):
        dims = k0 + tl.arange(0, BK)
        k_ok = dims < K
        q = _rows(q_ptr, rows, ok, kh, H, dims, k_ok, K)
        state = tl.load(h_ptr + state_base + dims[:, None] * V + cols[None, :],
                        mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        if PER_CHANNEL:
            gk, bk, to_end_k = _channel_gates(g_ptr, rows, end, hv, HV, dims, k_ok, K, C)
            qs += dot_tf32x3(q * tl.exp(bk), state)
        else:
            qk += dot_inputs(q, tl.trans(_rows(k_ptr, rows, ok, kh, H, dims, k_ok, K)), SIXTEEN_BIT, DT)
            qs += dot_tf32x3(q, state)
    w = _rows(w_ptr, rows, ok, hv, HV, cols, v_ok, V)
    if PER_CHANNEL:
        steps = tl.arange(0, C)
        pqk = _rows(pqk_ptr, rows, ok, hv, HV, steps, steps < C, C)
        o = scale * (qs + dot_tf32x3(tl.where(steps[:, None] >= steps[None, :], pqk, 0.0), w))
    else:
        g, b, _ = _chunk_gates(g_ptr, rows, end, hv, HV, HAS_G, C)
        o = scale * (tl.exp(b)[:, None] * qs + dot_tf32x3(qk * _decay(g, ok, ok, False, C), w))
    _store_rows(o_ptr, o, rows, ok, hv, HV, cols, v_ok, V)


@triton.jit
def chunk_state_backward_kernel(
    q_ptr, k_ptr, wk_ptr, g_ptr, pqk_ptr, do_ptr, dht_ptr, dh_ptr, dh0_ptr, dw_ptr, cu_ptr, first_chunk_ptr, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, SB: tl.constexpr, HAS_G: tl.constexpr, HAS_DHT: tl.constexpr,
    DELTA: tl.constexpr, ACCURATE_EXP: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """The backward chunk walk of sequence ``program_id(0)``, value head ``program_id(1)``, V block
    ``program_id(2)`` (module docstring, step 4): ``dS`` of each chunk's end state to ``dh``, ``dW``
    to ``dw``, the initial state's gradient to ``dh0``; ``dS`` lives in those, as the state in
    :func:`chunk_state_kernel`. PER_CHANNEL: ``D * Q K^T`` is ``P(Q, K)`` (``pqk``), the decays per
    channel."""
    n = tl.program_id(0)
    hv = tl.program_id(1)
    kh = hv // (HV // H)
    start = tl.load(cu_ptr + n)
    end = tl.load(cu_ptr + n + 1)
    num_chunks = tl.cdiv(end - start, C)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    v_ok = cols < V
    slab = K * V
    initial = dh0_ptr + (n * HV + hv).to(tl.int64) * slab
    d_state = dh_ptr + ((tl.load(first_chunk_ptr + n).to(tl.int64) + num_chunks - 1) * HV + hv) * slab
    if num_chunks == 0:
        d_state = initial
    for k0 in range(0, K, BK):
        block = k0 + tl.arange(0, BK)
        if HAS_DHT:
            last = _state_block(dht_ptr + (n * HV + hv).to(tl.int64) * slab, block, cols, K, V)
        else:
            last = tl.zeros([BK, BV], tl.float32)
        _store_state_block(d_state, last, block, cols, K, V)
    for j in range(num_chunks):
        i = num_chunks - 1 - j
        preceding = d_state - HV * slab  # the gradient of this chunk's start state
        if i == 0:
            preceding = initial
        t0 = start + i * C
        rows = t0 + tl.arange(0, C)
        ok = rows < end
        g, b, to_end = _chunk_gates(g_ptr, rows, end, hv, HV, HAS_G and not PER_CHANNEL, C)
        end_decay = tl.where(ok, tl.exp(to_end), 0.0)
        tl.debug_barrier()  # dS, stored by every thread, is read back by others
        qk = tl.zeros([C, C], tl.float32)
        dw = tl.zeros([C, BV], tl.float32)
        if PER_CHANNEL:  # P(Q, K)^T dO by SB-row slices: a [C, C] tile held whole spilled
            steps = tl.arange(0, C)
            for s0 in range(0, C, SB):
                part = s0 + tl.arange(0, SB)
                part_rows = t0 + part
                part_ok = part_rows < end
                pqk = tl.where(part[:, None] >= steps[None, :],
                               _rows(pqk_ptr, part_rows, part_ok, hv, HV, steps, steps < C, C), 0.0)
                dw += scale * dot_tf32x3(tl.trans(pqk), _rows(do_ptr, part_rows, part_ok, hv, HV, cols, v_ok, V))
        for k0 in range(0, K, BK):
            block = k0 + tl.arange(0, BK)
            k = _rows(k_ptr, rows, ok, kh, H, block, block < K, K)
            if PER_CHANNEL:
                gk, bk, to_end_k = _channel_gates(g_ptr, rows, end, hv, HV, block, block < K, K, C)
                k_end_decay = tl.where(ok[:, None], tl.exp(to_end_k), 0.0)
            else:
                qk += dot_tf32x3(_rows(q_ptr, rows, ok, kh, H, block, block < K, K), tl.trans(k))
                k_end_decay = end_decay[:, None]
            dw += dot_tf32x3(k * k_end_decay, _state_block(d_state, block, cols, K, V))
        do = _rows(do_ptr, rows, ok, hv, HV, cols, v_ok, V)
        if not PER_CHANNEL:
            dw += scale * dot_tf32x3(tl.trans(qk * _decay(g, ok, ok, False, C)), do)
        _store_rows(dw_ptr, dw, rows, ok, hv, HV, cols, v_ok, V)
        chunk_decay = _exp(tl.sum(g, axis=0), ACCURATE_EXP)
        exp_b = tl.exp(b)
        for k0 in range(0, K, BK):
            block = k0 + tl.arange(0, BK)
            if PER_CHANNEL:
                gk, bk, to_end_k = _channel_gates(g_ptr, rows, end, hv, HV, block, block < K, K, C)
                block_decay = _exp(tl.sum(gk, axis=0), ACCURATE_EXP)[:, None]
                q_decay = tl.exp(bk)
            else:
                block_decay = chunk_decay
                q_decay = exp_b[:, None]
            q_decayed = _rows(q_ptr, rows, ok, kh, H, block, block < K, K) * q_decay
            updated = block_decay * _state_block(d_state, block, cols, K, V)
            updated += scale * dot_tf32x3(tl.trans(q_decayed), do)
            if DELTA:
                updated -= dot_tf32x3(tl.trans(_rows(wk_ptr, rows, ok, hv, HV, block, block < K, K)), dw)
            _store_state_block(preceding, updated, block, cols, K, V)
        d_state = preceding


@triton.jit
def chunk_grad_pairs_kernel(
    v_ptr, w_ptr, g_ptr, beta_ptr, t_ptr, do_ptr, dw_ptr, dp_ptr, da_ptr, dv_ptr, dbeta_ptr,
    chunk_seq_ptr, chunk_start_ptr, cu_ptr, scale,
    HV: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, HAS_G: tl.constexpr,
    DELTA: tl.constexpr, SIXTEEN_BIT: tl.constexpr,
):
    """The ``[C, C]`` products with ``W`` of chunk ``program_id(0)``, value head ``program_id(1)``
    (module docstring, step 5): ``dP = scale (dO W^T) * D`` (lower) to ``dp``; for the delta rule
    ``dR = T^T dW`` (over ``dW``), ``dv = diag(beta) dR``, the ``V . dR`` rows of ``dbeta`` and
    ``dA * D = -(dR W^T) * D`` (strictly lower) to ``da``."""
    c = tl.program_id(0)
    hv = tl.program_id(1)
    DT = v_ptr.dtype.element_ty
    t0, end = _chunk_of(chunk_seq_ptr, chunk_start_ptr, cu_ptr, c)
    if t0 >= end:
        return
    rows = t0 + tl.arange(0, C)
    ok = rows < end
    steps = tl.arange(0, C)
    do_w = tl.zeros([C, C], tl.float32)  # dO W^T
    if DELTA:
        beta = tl.load(beta_ptr + rows.to(tl.int64) * HV + hv, mask=ok, other=0.0)
        t_inv_t = tl.trans(_rows(t_ptr, rows, ok, hv, HV, steps, steps < C, C))
        dr_w = tl.zeros([C, C], tl.float32)  # dR W^T
        dbeta = tl.zeros([C], tl.float32)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        v_ok = cols < V
        w = _rows(w_ptr, rows, ok, hv, HV, cols, v_ok, V)
        do_w += dot_inputs(_rows(do_ptr, rows, ok, hv, HV, cols, v_ok, V), tl.trans(w), SIXTEEN_BIT and not DELTA, DT)
        if DELTA:
            dr = dot_tf32x3(t_inv_t, _rows(dw_ptr, rows, ok, hv, HV, cols, v_ok, V))
            _store_rows(dw_ptr, dr, rows, ok, hv, HV, cols, v_ok, V)
            _store_rows(dv_ptr, beta[:, None] * dr, rows, ok, hv, HV, cols, v_ok, V)
            dbeta += tl.sum(_rows(v_ptr, rows, ok, hv, HV, cols, v_ok, V) * dr, axis=1)
            dr_w += dot_tf32x3(dr, tl.trans(w))
    g = _gates(g_ptr, rows, ok, hv, HV, HAS_G, C)
    decay = _decay(g, ok, ok, False, C)
    _store_rows(dp_ptr, scale * do_w * decay, rows, ok, hv, HV, steps, steps < C, C)
    if DELTA:
        da = -dr_w * tl.where(steps[:, None] > steps[None, :], decay, 0.0)
        _store_rows(da_ptr, da, rows, ok, hv, HV, steps, steps < C, C)
        tl.store(dbeta_ptr + rows.to(tl.int64) * HV + hv, dbeta, mask=ok)


@triton.jit
def _state_products(h_ptr, dh_ptr, do_ptr, w_ptr, dr_ptr, state_base, rows, ok, hv, HV: tl.constexpr, dims, k_ok,
                    V: tl.constexpr, BV: tl.constexpr, N: tl.constexpr, BK: tl.constexpr, HAS_G: tl.constexpr,
                    DELTA: tl.constexpr):
    """A chunk's products over V with its start state ``S0`` (``h``) and the gradient ``dS`` of its
    end state (``dh``), for ``rows`` (``N`` of them) and K dimensions ``dims``: ``(dO S0^T, W dS^T,
    dR S0^T`` (DELTA; else 0), ``<dS, S0>`` per channel (HAS_G; else 0))."""
    do_s = tl.zeros([N, BK], tl.float32)
    w_ds = tl.zeros([N, BK], tl.float32)
    dr_s = tl.zeros([N, BK], tl.float32)
    ds_s = tl.zeros([BK], tl.float32)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        v_ok = cols < V
        state_offs = state_base + dims[:, None] * V + cols[None, :]
        state_ok = k_ok[:, None] & v_ok[None, :]
        state = tl.load(h_ptr + state_offs, mask=state_ok, other=0.0)
        d_state = tl.load(dh_ptr + state_offs, mask=state_ok, other=0.0)
        do_s += dot_tf32x3(_rows(do_ptr, rows, ok, hv, HV, cols, v_ok, V), tl.trans(state))
        w_ds += dot_tf32x3(_rows(w_ptr, rows, ok, hv, HV, cols, v_ok, V), tl.trans(d_state))
        if HAS_G:
            ds_s += tl.sum(d_state * state, axis=1)
        if DELTA:
            dr_s += dot_tf32x3(_rows(dr_ptr, rows, ok, hv, HV, cols, v_ok, V), tl.trans(state))
    return do_s, w_ds, dr_s, ds_s


@triton.jit
def chunk_grad_kernel(
    q_ptr, k_ptr, w_ptr, g_ptr, beta_ptr, h_ptr, dh_ptr, do_ptr, dr_ptr, dp_ptr, da_ptr,
    dq_ptr, dk_ptr, dbeta_ptr, db_ptr, chunk_seq_ptr, chunk_start_ptr, cu_ptr, scale, num_tokens,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, SB: tl.constexpr, HAS_G: tl.constexpr, DELTA: tl.constexpr,
):
    """``dq``, ``dk`` (per value head) of chunk ``program_id(0)``, value head ``program_id(1)``, K
    block ``program_id(2)`` (module docstring, step 6), and this K block's parts
    (``[K blocks, tokens, HV]``) of ``dbeta`` (delta rule) and of ``dL/db`` (``db``)."""
    c = tl.program_id(0)
    hv = tl.program_id(1)
    kb = tl.program_id(2)
    kh = hv // (HV // H)
    t0, end = _chunk_of(chunk_seq_ptr, chunk_start_ptr, cu_ptr, c)
    if t0 >= end:
        return
    rows = t0 + tl.arange(0, C)
    ok = rows < end
    steps = tl.arange(0, C)
    dims = kb * BK + tl.arange(0, BK)
    k_ok = dims < K
    state_base = (c.to(tl.int64) * HV + hv) * K * V
    part = (kb * num_tokens + rows.to(tl.int64)) * HV + hv  # this K block's part of a [K blocks, tokens, HV] sum
    # dO S0^T, W dS^T, dR S0^T, and <dS, S0> over this K block
    do_s, w_ds, dr_s, ds_s = _state_products(h_ptr, dh_ptr, do_ptr, w_ptr, dr_ptr, state_base, rows, ok, hv, HV, dims,
                                             k_ok, V, BV, C, BK, HAS_G, DELTA)
    ds_s = tl.sum(ds_s, axis=0)
    g, b, to_end = _chunk_gates(g_ptr, rows, end, hv, HV, HAS_G, C)
    exp_b = tl.where(ok, tl.exp(b), 0.0)
    end_decay = tl.where(ok, tl.exp(to_end), 0.0)
    q = _rows(q_ptr, rows, ok, kh, H, dims, k_ok, K)
    k = _rows(k_ptr, rows, ok, kh, H, dims, k_ok, K)
    # dP split into its diagonal and its strictly lower part: the products of that and of dA * D
    # with Q and K give dq, dk and the pair terms of dL/db without any [C, C] product of Q and K.
    # Each product is taken SB steps deep, reading the [C, SB] slices from memory: a [C, C] operand
    # held whole spilled (tf32x3 doubles it; mma.sync holds the whole depth per warp)
    dp_diag = tl.zeros([C], tl.float32)
    dp_k = tl.zeros([C, BK], tl.float32)  # (dP strictly lower) K
    dp_q = tl.zeros([C, BK], tl.float32)  # (dP strictly lower)^T Q
    if DELTA:
        beta = tl.load(beta_ptr + rows.to(tl.int64) * HV + hv, mask=ok, other=0.0)
        da_k = tl.zeros([C, BK], tl.float32)  # (dA * D) K
        da_bk = tl.zeros([C, BK], tl.float32)  # (diag(beta) dA * D)^T K
    for s0 in range(0, C, SB):
        part_steps = s0 + tl.arange(0, SB)
        part_rows = t0 + part_steps
        part_ok = part_rows < end
        below = steps[:, None] > part_steps[None, :]  # [C, SB]: (t, s) with s in this slice
        above = part_steps[:, None] > steps[None, :]  # [SB, C]: (t, s) with t in this slice
        k_part = _rows(k_ptr, part_rows, part_ok, kh, H, dims, k_ok, K)
        dp_cols = _rows(dp_ptr, rows, ok, hv, HV, part_steps, part_steps < C, C)
        dp_diag += tl.sum(tl.where(steps[:, None] == part_steps[None, :], dp_cols, 0.0), axis=1)
        dp_k += dot_tf32x3(tl.where(below, dp_cols, 0.0), k_part)
        dp_rows = tl.where(above, _rows(dp_ptr, part_rows, part_ok, hv, HV, steps, steps < C, C), 0.0)
        dp_q += dot_tf32x3(tl.trans(dp_rows), _rows(q_ptr, part_rows, part_ok, kh, H, dims, k_ok, K))
        if DELTA:
            beta_part = tl.load(beta_ptr + part_rows.to(tl.int64) * HV + hv, mask=part_ok, other=0.0)
            da_k += dot_tf32x3(_rows(da_ptr, rows, ok, hv, HV, part_steps, part_steps < C, C), k_part)
            da_rows = _rows(da_ptr, part_rows, part_ok, hv, HV, steps, steps < C, C)
            da_bk += dot_tf32x3(tl.trans(da_rows), k_part * beta_part[:, None])
    dq = scale * exp_b[:, None] * do_s + dp_k + dp_diag[:, None] * k
    dk = dp_q + dp_diag[:, None] * q + end_decay[:, None] * w_ds
    # dL/db_t term by term: each is a pair (write s, read t > s) carrying its decay, or a read of
    # S0, so strong decays leave no large terms that cancel (the diagonal pairs of P and of the end
    # state's last row cancel exactly and are left out)
    db = scale * exp_b * tl.sum(q * do_s, axis=1) + tl.sum(q * dp_k, axis=1) - tl.sum(k * dp_q, axis=1)
    if DELTA:
        dk += -(beta * exp_b)[:, None] * dr_s + beta[:, None] * da_k + da_bk
        dbeta = tl.sum(k * da_k, axis=1) - exp_b * tl.sum(k * dr_s, axis=1)
        tl.store(dbeta_ptr + part, dbeta, mask=ok)
        db += beta * dbeta - tl.sum(k * da_bk, axis=1)
    _store_rows(dq_ptr, dq, rows, ok, hv, HV, dims, k_ok, K)
    _store_rows(dk_ptr, dk, rows, ok, hv, HV, dims, k_ok, K)
    if HAS_G:
        last = tl.minimum(C, end - t0) - 1
        written = tl.where(steps < last, end_decay * tl.sum(k * w_ds, axis=1), 0.0)
        db += tl.where(steps == last, tl.sum(written, axis=0) + tl.exp(tl.sum(g, axis=0)) * ds_s, 0.0) - written
        tl.store(db_ptr + part, db, mask=ok)


@triton.jit
def chunk_grad_channel_kernel(
    q_ptr, k_ptr, w_ptr, g_ptr, beta_ptr, h_ptr, dh_ptr, do_ptr, dr_ptr, dp_ptr, da_ptr,
    dq_ptr, dk_ptr, dbeta_ptr, db_ptr, chunk_seq_ptr, chunk_start_ptr, cu_ptr, scale, num_tokens,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, SB: tl.constexpr,
):
    """:func:`chunk_grad_kernel` for a per-channel decay and the delta rule (Kimi Delta Attention):
    ``dP`` and ``dA`` come undecayed, and their products with Q and K take ``D_tsc`` per channel by
    ``SB``-row blocks as :func:`channel_products_kernel` does (through the last step before the
    block of rows, both exponents sums of gates; the diagonal blocks elementwise). ``dL/db`` is
    per channel (``db [tokens, HV, K]``), each K block writing its own channels."""
    c = tl.program_id(0)
    hv = tl.program_id(1)
    kb = tl.program_id(2)
    kh = hv // (HV // H)
    t0, end = _chunk_of(chunk_seq_ptr, chunk_start_ptr, cu_ptr, c)
    if t0 >= end:
        return
    steps = tl.arange(0, C)
    rows = t0 + steps
    ok = rows < end
    idx = tl.arange(0, SB)
    dims = kb * BK + tl.arange(0, BK)
    k_ok = dims < K
    state_base = (c.to(tl.int64) * HV + hv) * K * V
    last = tl.minimum(C, end - t0) - 1
    written_total = tl.zeros([BK], tl.float32)
    for i in range(C // SB):  # the chunk's [C, BK] tiles are read where needed: held across, they spilled
        g = _rows(g_ptr, rows, ok, hv, HV, dims, k_ok, K)
        rows_i = t0 + i * SB + idx
        ok_i = rows_i < end
        steps_i = i * SB + idx
        q_i = _rows(q_ptr, rows_i, ok_i, kh, H, dims, k_ok, K)
        k_i = _rows(k_ptr, rows_i, ok_i, kh, H, dims, k_ok, K)
        # within_to_end: g_{t+1} + ... to this block's end
        g_i, b_i, within_to_end = _channel_gates(g_ptr, rows_i, end, hv, HV, dims, k_ok, K, SB)
        beta_i = tl.load(beta_ptr + rows_i.to(tl.int64) * HV + hv, mask=ok_i, other=0.0)
        # this block's rows of exp(b) and exp(b_C - b): the steps before it (after it) summed
        before = tl.sum(tl.where((steps < i * SB)[:, None], g, 0.0), axis=0)
        exp_b = tl.where(ok_i[:, None], tl.exp(before[None, :] + b_i), 0.0)
        later = tl.sum(tl.where((steps >= (i + 1) * SB)[:, None], g, 0.0), axis=0)
        end_decay = tl.where(ok_i[:, None], tl.exp(within_to_end + later[None, :]), 0.0)
        # dO S0^T, W dS^T, dR S0^T of this block's rows, and <dS, S0> per channel
        do_s, w_ds, dr_s, ds_s = _state_products(h_ptr, dh_ptr, do_ptr, w_ptr, dr_ptr, state_base, rows_i, ok_i, hv,
                                                 HV, dims, k_ok, V, BV, SB, BK, True, True)
        # the diagonal block, a column s at a time (no [SB, SB, BK] tile: those spilled):
        # D_tsc = exp(g_{s+1} + ... + g_t) for s < t in this block
        dp_d = _rows(dp_ptr, rows_i, ok_i, hv, HV, steps_i, steps_i < C, C)  # [SB, SB]: dP_ts, s in this block
        da_d = _rows(da_ptr, rows_i, ok_i, hv, HV, steps_i, steps_i < C, C)
        dp_diag = tl.sum(tl.where(idx[:, None] == idx[None, :], dp_d, 0.0), axis=1)
        beta_k_i = beta_i[:, None] * k_i
        dp_k = tl.zeros([SB, BK], tl.float32)  # sum_s dP_ts D_tsc K_sc
        da_k = tl.zeros([SB, BK], tl.float32)
        dp_q = tl.zeros([SB, BK], tl.float32)  # sum_t dP_ts D_tsc Q_tc
        da_bk = tl.zeros([SB, BK], tl.float32)
        for s in range(SB - 1):
            pick = idx == s
            later_rows = (idx > s)[:, None]
            decay = tl.where(later_rows, tl.exp(tl.cumsum(tl.where(later_rows, g_i, 0.0), axis=0)), 0.0)
            k_s = tl.sum(tl.where(pick[:, None], k_i, 0.0), axis=0)[None, :]
            dp_col = tl.sum(tl.where(pick[None, :], dp_d, 0.0), axis=1)[:, None] * decay
            da_col = tl.sum(tl.where(pick[None, :], da_d, 0.0), axis=1)[:, None] * decay
            dp_k += dp_col * k_s
            da_k += da_col * k_s
            dp_q += tl.where(pick[:, None], tl.sum(dp_col * q_i, axis=0)[None, :], 0.0)
            da_bk += tl.where(pick[:, None], tl.sum(da_col * beta_k_i, axis=0)[None, :], 0.0)
        # the blocks before (columns s) and after (rows t) this one, SB steps deep each (a [SB, C]
        # operand held whole spilled): through step r, the last before the block of rows t,
        # D_tsc = exp(g_{r+1} + ... + g_t) exp(g_{s+1} + ... + g_r), sums of gates of one sign
        from_r = tl.exp(b_i)
        for j in range(0, i):
            rows_j = t0 + j * SB + idx
            ok_j = rows_j < end
            steps_j = j * SB + idx
            between = tl.sum(tl.where(((steps >= (j + 1) * SB) & (steps < i * SB))[:, None], g, 0.0), axis=0)
            to_r = tl.exp(_channel_gates(g_ptr, rows_j, end, hv, HV, dims, k_ok, K, SB)[2] + between[None, :])
            k_to_r = _rows(k_ptr, rows_j, ok_j, kh, H, dims, k_ok, K) * to_r
            dp_k += from_r * dot_tf32x3(_rows(dp_ptr, rows_i, ok_i, hv, HV, steps_j, steps_j < C, C), k_to_r)
            da_k += from_r * dot_tf32x3(_rows(da_ptr, rows_i, ok_i, hv, HV, steps_j, steps_j < C, C), k_to_r)
        to_r = tl.exp(within_to_end)
        for m in range(i + 1, C // SB):
            rows_m = t0 + m * SB + idx
            ok_m = rows_m < end
            between = tl.sum(tl.where(((steps >= (i + 1) * SB) & (steps < m * SB))[:, None], g, 0.0), axis=0)
            g_m = _rows(g_ptr, rows_m, ok_m, hv, HV, dims, k_ok, K)
            from_r_m = tl.where(ok_m[:, None], tl.exp(between[None, :] + tl.cumsum(g_m, axis=0)), 0.0)
            beta_m = tl.load(beta_ptr + rows_m.to(tl.int64) * HV + hv, mask=ok_m, other=0.0)
            dp_m = tl.trans(_rows(dp_ptr, rows_m, ok_m, hv, HV, steps_i, steps_i < C, C))
            da_m = tl.trans(_rows(da_ptr, rows_m, ok_m, hv, HV, steps_i, steps_i < C, C))
            dp_q += to_r * dot_tf32x3(dp_m, _rows(q_ptr, rows_m, ok_m, kh, H, dims, k_ok, K) * from_r_m)
            da_bk += to_r * dot_tf32x3(da_m, _rows(k_ptr, rows_m, ok_m, kh, H, dims, k_ok, K)
                                       * (beta_m[:, None] * from_r_m))
        dq = scale * exp_b * do_s + dp_k + dp_diag[:, None] * k_i
        dk = dp_q + dp_diag[:, None] * q_i + end_decay * w_ds - (beta_i[:, None] * exp_b) * dr_s \
            + beta_i[:, None] * da_k + da_bk
        _store_rows(dq_ptr, dq, rows_i, ok_i, hv, HV, dims, k_ok, K)
        _store_rows(dk_ptr, dk, rows_i, ok_i, hv, HV, dims, k_ok, K)
        dbeta_terms = k_i * da_k - exp_b * k_i * dr_s
        part = (kb * num_tokens + rows_i.to(tl.int64)) * HV + hv
        tl.store(dbeta_ptr + part, tl.sum(dbeta_terms, axis=1), mask=ok_i)
        # dL/db per channel, term by term as chunk_grad_kernel's (its sums over K left out)
        db = scale * exp_b * q_i * do_s + q_i * dp_k - k_i * dp_q + beta_i[:, None] * dbeta_terms - k_i * da_bk
        written = tl.where((steps_i < last)[:, None], end_decay * k_i * w_ds, 0.0)
        written_total += tl.sum(written, axis=0)
        at_last = (steps_i == last)[:, None]
        db += tl.where(at_last, written_total[None, :] + tl.exp(tl.sum(g, axis=0))[None, :] * ds_s[None, :], 0.0)
        _store_rows(db_ptr, db - written, rows_i, ok_i, hv, HV, dims, k_ok, K)


@triton.jit
def reverse_cumsum_kernel(x_ptr, y_ptr, cu_ptr, HV: tl.constexpr, C: tl.constexpr, WITHIN_CHUNKS: tl.constexpr):
    """``y_t = sum_{s >= t} x_s`` within sequence ``program_id(0)``, value head ``program_id(1)``
    (within each ``C``-step chunk of it when WITHIN_CHUNKS)."""
    n = tl.program_id(0)
    hv = tl.program_id(1)
    start = tl.load(cu_ptr + n)
    end = tl.load(cu_ptr + n + 1)
    carry = 0.0
    num_chunks = tl.cdiv(end - start, C)
    for j in range(num_chunks):
        rows = start + (num_chunks - 1 - j) * C + tl.arange(0, C)
        ok = rows < end
        offs = rows.to(tl.int64) * HV + hv
        x = tl.load(x_ptr + offs, mask=ok, other=0.0)
        tl.store(y_ptr + offs, carry + tl.cumsum(x, axis=0, reverse=True), mask=ok)
        if not WITHIN_CHUNKS:
            carry += tl.sum(x, axis=0)


# What a recurrent_kernel launch writes besides the final state (its WRITES): the outputs, the
# delta rule's errors e_t (which the backward replays), or the backward's read terms.
WRITES_OUTPUTS, WRITES_ERRORS, WRITES_READ_GRADIENTS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _recurrent_program(cu_ptr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       KP: tl.constexpr, BV: tl.constexpr):
    """Where a recurrent kernel's program works: sequence ``n``, value head ``hv`` (of key head
    ``kh``), V block ``vb``; the sequence's tokens ``start:end``; the K dimensions and this block's V
    columns (and which are real); the offsets of its ``[KP, BV]`` part of a ``[K, V]`` state (and
    which are real)."""
    n = tl.program_id(0)
    hv = tl.program_id(1)
    vb = tl.program_id(2)
    kh = hv // (HV // H)
    start = tl.load(cu_ptr + n)
    end = tl.load(cu_ptr + n + 1)
    dims = tl.arange(0, KP)
    k_ok = dims < K
    cols = vb * BV + tl.arange(0, BV)
    v_ok = cols < V
    state_offs = dims[:, None] * V + cols[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    return n, hv, vb, kh, start, end, dims, k_ok, cols, v_ok, state_offs, state_ok


@triton.jit
def _step_decay(g_ptr, t, hv, dims, k_ok, HV: tl.constexpr, K: tl.constexpr, PER_CHANNEL: tl.constexpr,
                ACCURATE_EXP: tl.constexpr):
    """``exp(g_t)`` of value head ``hv``: a scalar, or ``[KP, 1]`` rows of a per-channel decay."""
    if PER_CHANNEL:
        decay = _exp(tl.load(g_ptr + (t * HV + hv) * K + dims, mask=k_ok, other=0.0), ACCURATE_EXP)[:, None]
    else:
        decay = _exp(tl.load(g_ptr + t * HV + hv), ACCURATE_EXP)
    return decay


@triton.jit
def _store_decay_grad(db_ptr, part, db, dims, k_ok, K: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """A step's ``dL/dB`` terms ``db [KP]`` per channel: stored so, or summed for a per-head decay."""
    if PER_CHANNEL:
        tl.store(db_ptr + part * K + dims, db, mask=k_ok)
    else:
        tl.store(db_ptr + part, tl.sum(db, axis=0))


@triton.jit
def recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, out_ptr, ht_ptr, do_ptr, dht_ptr, dv_ptr, dq_ptr, dk_ptr, db_ptr,
    cu_ptr, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
    BV: tl.constexpr, WRITES: tl.constexpr, HAS_G: tl.constexpr, DELTA: tl.constexpr, HAS_H0: tl.constexpr,
    HAS_DHT: tl.constexpr, ACCURATE_EXP: tl.constexpr, PER_CHANNEL: tl.constexpr,
):
    """The recurrence step by step for sequence ``program_id(0)``, value head ``program_id(1)``, V
    block ``program_id(2)``, ending with the final state in ``ht``. WRITES_OUTPUTS: the outputs to
    ``out``; WRITES_ERRORS: the delta rule's errors ``e_t`` to ``out``; WRITES_READ_GRADIENTS
    (backward, ``dv`` holding ``de``): this V block's parts (``[V blocks, tokens, HV, *]``) of
    ``dq``, of ``dk``'s read term and of ``dL/dB``'s read terms (``db``). PER_CHANNEL: ``g`` holds a
    log decay per key channel (``[tokens, HV, K]``, Kimi Delta Attention), row c of the state
    decays by its own, and ``db`` is per channel too (a per-head decay's is its sum over them)."""
    n, hv, vb, kh, start, end, dims, k_ok, cols, v_ok, state_offs, state_ok = _recurrent_program(
        cu_ptr, H, HV, K, V, KP, BV)
    state_base = (n * HV + hv).to(tl.int64) * K * V
    if HAS_H0:
        state = tl.load(h0_ptr + state_base + state_offs, mask=state_ok, other=0.0)
    else:
        state = tl.zeros([KP, BV], tl.float32)
    if WRITES == WRITES_READ_GRADIENTS and HAS_DHT:
        d_final = tl.load(dht_ptr + state_base + state_offs, mask=state_ok, other=0.0)
    num_tokens = tl.load(cu_ptr + tl.num_programs(0))
    for j in range(end - start):
        t = start.to(tl.int64) + j
        qk_offs = (t * H + kh) * K + dims
        v_offs = (t * HV + hv) * V + cols
        k = tl.load(k_ptr + qk_offs, mask=k_ok, other=0.0).to(tl.float32)
        u = tl.load(v_ptr + v_offs, mask=v_ok, other=0.0).to(tl.float32)
        if HAS_G:
            state *= _step_decay(g_ptr, t, hv, dims, k_ok, HV, K, PER_CHANNEL, ACCURATE_EXP)
        if DELTA:
            e = u - tl.sum(state * k[:, None], axis=0)
            if WRITES == WRITES_ERRORS:
                tl.store(out_ptr + v_offs, e, mask=v_ok)
            u = tl.load(beta_ptr + t * HV + hv) * e
        if WRITES == WRITES_READ_GRADIENTS:
            # the read terms before this step's write: each then carries a decay (see db below)
            part = (vb * num_tokens + t) * HV + hv
            q = tl.load(q_ptr + qk_offs, mask=k_ok, other=0.0).to(tl.float32)
            do = tl.load(do_ptr + v_offs, mask=v_ok, other=0.0).to(tl.float32)
            dq = scale * tl.sum(state * do[None, :], axis=1)
            db = q * dq  # per channel, summed below for a per-head decay
            if DELTA:
                dk = -tl.sum(state * tl.load(dv_ptr + v_offs, mask=v_ok, other=0.0)[None, :], axis=1)
                tl.store(dk_ptr + part * K + dims, dk, mask=k_ok)
                db += k * dk
            if HAS_DHT:
                if j == end - start - 1:
                    db += tl.sum(d_final * state, axis=1)
            _store_decay_grad(db_ptr, part, db, dims, k_ok, K, PER_CHANNEL)
            tl.store(dq_ptr + part * K + dims, dq + scale * k * tl.sum(u * do, axis=0), mask=k_ok)
        state += k[:, None] * u[None, :]
        if WRITES == WRITES_OUTPUTS:
            q = tl.load(q_ptr + qk_offs, mask=k_ok, other=0.0).to(tl.float32)
            o = scale * tl.sum(state * q[:, None], axis=0)
            tl.store(out_ptr + v_offs, o.to(out_ptr.dtype.element_ty), mask=v_ok)
    tl.store(ht_ptr + state_base + state_offs, state, mask=state_ok)


@triton.jit
def recurrent_backward_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, e_ptr, do_ptr, dht_ptr, dv_ptr, dk_ptr, dbeta_ptr, db_ptr, dh0_ptr,
    cu_ptr, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
    BV: tl.constexpr, HAS_G: tl.constexpr, DELTA: tl.constexpr, HAS_DHT: tl.constexpr, ACCURATE_EXP: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
):
    """The backward walk of sequence ``program_id(0)``, value head ``program_id(1)``, V block
    ``program_id(2)`` with ``dS`` in registers: ``dv`` (= ``de`` for the delta rule), this V
    block's parts of ``dbeta``, of ``dk``'s write term and of ``dL/dB``'s write terms, and ``dh0``
    (PER_CHANNEL: as in :func:`recurrent_kernel`)."""
    n, hv, vb, kh, start, end, dims, k_ok, cols, v_ok, state_offs, state_ok = _recurrent_program(
        cu_ptr, H, HV, K, V, KP, BV)
    if HAS_DHT:
        d_state = tl.load(dht_ptr + (n * HV + hv).to(tl.int64) * K * V + state_offs, mask=state_ok, other=0.0)
    else:
        d_state = tl.zeros([KP, BV], tl.float32)
    num_tokens = tl.load(cu_ptr + tl.num_programs(0))
    for j in range(end - start):
        t = (end - 1 - j).to(tl.int64)
        qk_offs = (t * H + kh) * K + dims
        v_offs = (t * HV + hv) * V + cols
        part = (vb * num_tokens + t) * HV + hv
        q = tl.load(q_ptr + qk_offs, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_offs, mask=k_ok, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + v_offs, mask=v_ok, other=0.0).to(tl.float32)
        if DELTA:
            beta = tl.load(beta_ptr + t * HV + hv)
            e = tl.load(e_ptr + v_offs, mask=v_ok, other=0.0)
            u = beta * e
        else:
            u = tl.load(v_ptr + v_offs, mask=v_ok, other=0.0).to(tl.float32)
        # later reads of this write, as dL/dB's write terms (the final state's read of the last
        # step's write is left to the replay, which adds <dht, S'_T>, so that no undecayed term
        # enters dL/dB): r_later . u, or per channel c, k_c (dS u)_c (whose sum over c it is)
        r_later = tl.sum(d_state * k[:, None], axis=0)
        if PER_CHANNEL:
            write_terms = k * tl.sum(d_state * u[None, :], axis=1)
            tl.store(db_ptr + part * K + dims, -tl.where(j == 0, 0.0, write_terms), mask=k_ok)
        else:
            tl.store(db_ptr + part, -tl.where(j == 0, 0.0, tl.sum(r_later * u, axis=0)))
        # the gradient of this step's written value: later reads (r_later), then this step's own
        d_state += scale * q[:, None] * do[None, :]
        r = r_later + scale * tl.sum(q * k, axis=0) * do
        if DELTA:
            dv = beta * r
            tl.store(dbeta_ptr + part, tl.sum(e * r, axis=0))
            d_state_e = tl.sum(d_state * e[None, :], axis=1)
            dk = beta * d_state_e
            d_state -= k[:, None] * dv[None, :]
        else:
            dv = r
            dk = tl.sum(d_state * u[None, :], axis=1)
        tl.store(dv_ptr + v_offs, dv, mask=v_ok)
        tl.store(dk_ptr + part * K + dims, dk, mask=k_ok)
        if HAS_G:
            d_state *= _step_decay(g_ptr, t, hv, dims, k_ok, HV, K, PER_CHANNEL, ACCURATE_EXP)
    tl.store(dh0_ptr + (n * HV + hv).to(tl.int64) * K * V + state_offs, d_state, mask=state_ok)


@dataclasses.dataclass
class _Problem:
    """The inputs as the kernels take them: token-major, q/k normalized, gates float32."""

    batch: int
    length: int
    q: torch.Tensor  # [tokens, H, K] (l2-normalized when asked)
    k: torch.Tensor
    v: torch.Tensor  # [tokens, HV, V]
    g: torch.Tensor | None  # [tokens, HV] float32, or [tokens, HV, K] per channel
    beta: torch.Tensor | None
    h0: torch.Tensor | None  # [N, HV, K, V] float32
    cu: torch.Tensor  # [N + 1] int32
    q_raw: torch.Tensor | None  # float32 inputs before the l2 normalization (for its backward)
    k_raw: torch.Tensor | None
    rerun: typing.Callable[[], object] | None = None  # the entry point again on the same inputs, for a tuner

    @property
    def num_seqs(self) -> int:
        return self.cu.shape[0] - 1

    @property
    def shape(self):
        """(tokens, H, HV, K, V)."""
        return self.q.shape[0], self.q.shape[1], self.v.shape[1], self.q.shape[2], self.v.shape[2]

    @property
    def per_channel(self) -> bool:
        """Whether the decay is per key channel (Kimi Delta Attention)."""
        return self.g is not None and self.g.dim() == 3

    @property
    def interpreted(self) -> bool:
        return self.q.device.type == "cpu"

    @property
    def low_qk(self) -> bool:
        """Whether the output kernel's ``Q K^T`` takes 16-bit operands: q, k as given (normalized
        ones are float32)."""
        return _low_precision(self.q.dtype, self.interpreted)

    @property
    def low_v(self) -> bool:
        """Whether gated linear attention's ``dO V^T`` takes 16-bit operands (``dO`` in v's dtype)."""
        return _low_precision(self.v.dtype, self.interpreted)

    def config(self, kernel: str) -> Config:
        """``kernel``'s config: tuned or cached per device (``triton_impl.autotune``), else the heuristic."""
        tokens, heads, value_heads, k_dim, v_dim = self.shape
        sizes = (kernel, k_dim, v_dim, self.v.dtype, self.interpreted, arch_of(self.q.device))
        if self.rerun is None:
            return default_config(*sizes)
        key = dict(tokens=tokens, seqs=self.num_seqs, heads=heads, value_heads=value_heads, k=k_dim, v=v_dim,
                   dtype=self.v.dtype, gated=self.g is not None, delta=self.beta is not None,
                   per_channel=self.per_channel)
        return autotune.choose(f"linear_attention.{kernel}", self.q.device, key, lambda: default_config(*sizes),
                               lambda: config_space(*sizes), self.rerun)

    def launch(self, kernel, config: Config, grid, *args, **flags):
        """``kernel`` on ``grid`` with ``config``, this problem's sizes and ``flags``."""
        _, heads, value_heads, k_dim, v_dim = self.shape
        for_device(kernel, self.q.device)[grid](
            *args, **_constexprs(kernel, heads, value_heads, k_dim, v_dim, config, **flags),
            num_warps=config.num_warps, num_stages=config.num_stages)


def _constexprs(kernel, heads: int, value_heads: int, k_dim: int, v_dim: int, config: Config, **flags) -> dict:
    """The sizes ``kernel`` takes (each takes its own subset) for ``config``, and ``flags``."""
    padded = _padded(k_dim)
    sizes = dict(H=heads, HV=value_heads, K=k_dim, V=v_dim, KP=padded, BK=min(config.block_k, padded),
                 BV=config.block_v, C=CHUNK, SB=SUB)
    return {**{name: size for name, size in sizes.items() if name in kernel.arg_names}, **flags}


def _padded(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _low_precision(dtype: torch.dtype, interpreted: bool) -> bool:
    """Whether dots take 16-bit operands (on a GPU); the interpreter mishandles bfloat16."""
    return not interpreted and dtype in (torch.float16, torch.bfloat16)


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + EPS)


def _l2_normalize_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of ``x / sqrt(|x|^2 + eps)`` (float32 ``x``, ``grad``)."""
    inv = torch.rsqrt(x.square().sum(-1, keepdim=True) + EPS)
    unit = x * inv
    return inv * (grad - unit * (unit * grad).sum(-1, keepdim=True))


def config_space(kernel: str, k_dim: int, v_dim: int, dtype: torch.dtype, interpreted: bool = False,
                 arch: int | None = None) -> list[Config]:
    """The configs an autotuner may try (``triton_impl.autotune``; arguments as :func:`default_config`):
    the heuristic's, then V blocks of 16 to 64 (no wider than V), K steps of 32 or 64, 4 or 8 warps,
    1 or 2 stages, less those that would split a dot into 8-wide tf32 wgmma tiles
    (:func:`_splits_narrow_dots`: an illegal memory access is no failure a search can skip). A config
    out of shared memory fails to launch and is skipped."""
    padded_v = _padded(v_dim)

    def keep(config: Config) -> bool:
        return config.block_v <= padded_v and not _splits_narrow_dots(
            kernel, config.block_k, config.block_v, config.num_warps, k_dim, v_dim, arch)

    return autotune.space(default_config(kernel, k_dim, v_dim, dtype, interpreted, arch), keep, block_v=(16, 32, 64),
                          block_k=(64,) if kernel == "recurrent" else (32, 64), num_warps=(4, 8), num_stages=(1, 2))


def _setup(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm) -> _Problem:
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise NotImplementedError(f"triton: {q.dtype} inputs are not supported")
    batch, length, heads, k_dim = q.shape
    value_heads, v_dim = v.shape[2], v.shape[3]
    if k_dim > MAX_K:
        raise NotImplementedError(f"triton: key head size at most {MAX_K}, got {k_dim}")
    tokens = batch * length
    q_raw = k_raw = None
    if use_qk_l2norm:
        q_raw, k_raw = q.reshape(tokens, heads, k_dim).float(), k.reshape(tokens, heads, k_dim).float()
        # kept in float32, as the reference keeps them: rounded to a 16-bit q.dtype they left the
        # outputs ~20x and the final states ~1000x further from the truth than the reference's
        q, k = _l2_normalize(q_raw), _l2_normalize(k_raw)
    if cu_seqlens is None:
        cu = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * length
    else:
        cu = cu_seqlens.to(torch.int32)
    gate = lambda x: None if x is None else x.reshape(tokens, *x.shape[2:]).float().contiguous()  # noqa: E731
    return _Problem(batch, length, q.reshape(tokens, heads, k_dim).contiguous(),
                    k.reshape(tokens, heads, k_dim).contiguous(), v.reshape(tokens, value_heads, v_dim).contiguous(),
                    gate(g), gate(beta), None if initial_state is None else initial_state.float().contiguous(), cu,
                    q_raw, k_raw)


def _chunks(cu: torch.Tensor, tokens: int):
    """(chunk -> sequence, chunk -> first token, sequence -> first chunk, chunk slots), made on the
    device without reading ``cu``: the grid has ``tokens // CHUNK + N`` slots, a bound on the
    number of chunks from shapes alone (each of the N sequences adds at most one partial chunk).
    A slot past the last chunk starts at ``tokens``, at or past its sequence's end."""
    num_seqs = cu.shape[0] - 1
    lengths = (cu[1:] - cu[:-1]).long()
    counts = (lengths + CHUNK - 1) // CHUNK
    first = torch.zeros(cu.shape[0], dtype=torch.int64, device=cu.device)
    first[1:] = counts.cumsum(0)
    slots = tokens // CHUNK + num_seqs
    chunk = torch.arange(slots, device=cu.device)
    seq = torch.searchsorted(first[1:], chunk, right=True).clamp(max=max(num_seqs - 1, 0))
    start = torch.where(chunk < first[-1], cu.long()[seq] + (chunk - first[seq]) * CHUNK, tokens)
    return seq.to(torch.int32), start.to(torch.int32), first.to(torch.int32), slots


def _chunk_recompute(x: _Problem, store_t: bool):
    """Steps 1-2 of the module docstring: (T, W, Wk, P(Q, K) of a per-channel decay, chunk start
    states, final states, chunk tables)."""
    tokens, _, value_heads, k_dim, v_dim = x.shape
    device = x.q.device
    chunk_seq, chunk_start, first_chunk, chunk_slots = _chunks(x.cu, tokens)
    f32 = dict(dtype=torch.float32, device=device)
    t_inv = w = wk = pqk = pkk = None
    if x.per_channel and chunk_slots:  # P(Q, K) and P(K, K), the blocks on and below the diagonal
        pqk = torch.empty(tokens, value_heads, CHUNK, **f32)
        pkk = torch.empty(tokens, value_heads, CHUNK, **f32)
        blocks = CHUNK // SUB
        x.launch(channel_products_kernel, x.config("channel_products"),
                 (chunk_slots, value_heads, blocks * (blocks + 1) // 2), x.q, x.k, x.g, pqk, pkk, chunk_seq,
                 chunk_start, x.cu)
    if x.beta is not None:
        w = torch.empty(tokens, value_heads, v_dim, **f32)  # U, then W in place
        wk = torch.empty(tokens, value_heads, k_dim, **f32)
        t_inv = torch.empty(tokens, value_heads, CHUNK, **f32) if store_t else w
        if chunk_slots:
            x.launch(wy_kernel, x.config("wy_per_channel" if x.per_channel else "wy"), (chunk_slots, value_heads),
                     x.k, x.v, _or(x.g, x.beta), x.beta, _or(pkk, w), t_inv, w, wk, chunk_seq, chunk_start, x.cu,
                     HAS_G=x.g is not None, STORE_T=store_t, PER_CHANNEL=x.per_channel)
    h = torch.empty(chunk_slots, value_heads, k_dim, v_dim, **f32)
    ht = torch.empty(x.num_seqs, value_heads, k_dim, v_dim, **f32)
    config = x.config("chunk_state")
    x.launch(chunk_state_kernel, config, (x.num_seqs, value_heads, triton.cdiv(v_dim, config.block_v)),
             x.k, x.v, _or(x.g, x.k), _or(w, x.v), _or(wk, x.k), _or(x.h0, ht), h, ht, x.cu, first_chunk,
             HAS_G=x.g is not None, HAS_H0=x.h0 is not None, DELTA=w is not None,
             ACCURATE_EXP=not x.interpreted, PER_CHANNEL=x.per_channel)
    return t_inv, _or(w, x.v), wk, pqk, h, ht, (chunk_seq, chunk_start, first_chunk, chunk_slots)


def _or(t, placeholder):
    """``t``, or a tensor the kernel does not read in its place (a pointer argument is needed)."""
    return placeholder if t is None else t


def chunk_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """The chunked kernels' forward: ``(o [B, T, HV, V] in v's dtype, final states [N, HV, K, V]
    float32)``. Contract: ``torch_kernels.ops.linear_attention`` (``beta=None``: gated linear
    attention; ``g=None``: no decay)."""
    x = _setup(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm)
    x.rerun = functools.partial(chunk_forward, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm)
    tokens, _, value_heads, k_dim, v_dim = x.shape
    _, w, _, pqk, h, ht, (chunk_seq, chunk_start, _, chunk_slots) = _chunk_recompute(x, store_t=False)
    o = torch.empty_like(x.v)
    if chunk_slots:
        config = x.config("chunk_output")
        x.launch(chunk_output_kernel, config, (chunk_slots, value_heads, triton.cdiv(v_dim, config.block_v)),
                 x.q, x.k, w, _or(x.g, x.k), _or(pqk, h), h, o, chunk_seq, chunk_start, x.cu, scale,
                 HAS_G=x.g is not None, SIXTEEN_BIT=x.low_qk, PER_CHANNEL=x.per_channel)
    return o.view(v.shape), ht


def _finish(x: _Problem, dq, dk, dv, dg, dbeta, dh0, has_h0: bool):
    """Per-value-head float32 gradients to the inputs' shapes: query/key groups summed, the l2
    normalization differentiated."""
    tokens, heads, value_heads, k_dim, v_dim = x.shape
    dq = dq.view(tokens, heads, value_heads // heads, k_dim).sum(2)
    dk = dk.view(tokens, heads, value_heads // heads, k_dim).sum(2)
    if x.q_raw is not None:
        dq, dk = _l2_normalize_backward(x.q_raw, dq), _l2_normalize_backward(x.k_raw, dk)
    qk_shape = (x.batch, x.length, heads, k_dim)
    gate_shape = (x.batch, x.length, value_heads)
    decay_shape = (*gate_shape, k_dim) if x.per_channel else gate_shape
    return (dq.view(qk_shape), dk.view(qk_shape), dv.view(x.batch, x.length, value_heads, v_dim),
            None if dg is None else dg.view(decay_shape), None if dbeta is None else dbeta.view(gate_shape),
            dh0 if has_h0 else None)


def chunk_backward(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """The chunked kernels' backward: ``(dq, dk, dv, dg, dbeta, dh0)`` (float32; None for an absent
    ``g``, ``beta`` or ``initial_state``), chunk states recomputed from the inputs."""
    x = _setup(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm)
    x.rerun = functools.partial(chunk_backward, do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                use_qk_l2norm)
    tokens, _, value_heads, k_dim, v_dim = x.shape
    device = x.q.device
    delta = x.beta is not None
    if x.per_channel and not delta:
        raise NotImplementedError("triton: a per-channel decay's chunked backward is the delta rule's only")
    t_inv, w, wk, pqk, h, _, (chunk_seq, chunk_start, first_chunk, chunk_slots) = _chunk_recompute(x, True)
    do = do.reshape(tokens, value_heads, v_dim).contiguous()
    f32 = dict(dtype=torch.float32, device=device)
    dh = torch.empty(chunk_slots, value_heads, k_dim, v_dim, **f32)
    dh0 = torch.empty(x.num_seqs, value_heads, k_dim, v_dim, **f32)
    dw = torch.empty(tokens, value_heads, v_dim, **f32)  # dW, then dR in place (delta rule); dv itself for GLA
    dht = None if dht is None else dht.float().contiguous()
    config = x.config("chunk_state_backward_per_channel" if x.per_channel else "chunk_state_backward")
    x.launch(chunk_state_backward_kernel, config, (x.num_seqs, value_heads, triton.cdiv(v_dim, config.block_v)),
             x.q, x.k, _or(wk, x.k), _or(x.g, x.k), _or(pqk, dh0), do, _or(dht, dh0), dh, dh0, dw, x.cu, first_chunk,
             scale, HAS_G=x.g is not None, HAS_DHT=dht is not None, DELTA=delta, ACCURATE_EXP=not x.interpreted,
             PER_CHANNEL=x.per_channel)
    dq = torch.empty(tokens, value_heads, k_dim, **f32)
    dk = torch.empty(tokens, value_heads, k_dim, **f32)
    dv = torch.empty(tokens, value_heads, v_dim, **f32) if delta else dw
    dbeta = torch.empty(tokens, value_heads, **f32) if delta else None
    decay_parts = (k_dim,) if x.per_channel else ()  # dL/db per channel for a per-channel decay
    dg = torch.empty(tokens, value_heads, *decay_parts, **f32) if x.g is not None else None
    if chunk_slots:
        dp = torch.empty(tokens, value_heads, CHUNK, **f32)
        da = torch.empty(tokens, value_heads, CHUNK, **f32) if delta else None
        x.launch(chunk_grad_pairs_kernel, x.config("chunk_grad_pairs"), (chunk_slots, value_heads),
                 x.v, w, _or(x.g, dp), _or(x.beta, dp), _or(t_inv, dp), do, dw, dp, _or(da, dp), dv, _or(dbeta, dp),
                 chunk_seq, chunk_start, x.cu, scale, HAS_G=x.g is not None and not x.per_channel, DELTA=delta,
                 SIXTEEN_BIT=x.low_v and do.dtype == x.v.dtype)  # a per-channel decay: dP, dA undecayed
        config = x.config("chunk_grad_channel" if x.per_channel else "chunk_grad")
        blocks = triton.cdiv(k_dim, config.block_k)
        dbeta_parts = torch.empty(blocks, tokens, value_heads, **f32) if delta else None
        if x.per_channel:  # each K block writes its own channels of db
            db = torch.empty(tokens, value_heads, k_dim, **f32)
            x.launch(chunk_grad_channel_kernel, config, (chunk_slots, value_heads, blocks),
                     x.q, x.k, w, x.g, x.beta, h, dh, do, dw, dp, da, dq, dk, dbeta_parts, db, chunk_seq, chunk_start,
                     x.cu, scale, tokens)
        else:
            db_parts = torch.empty(blocks, tokens, value_heads, **f32) if x.g is not None else None
            x.launch(chunk_grad_kernel, config, (chunk_slots, value_heads, blocks),
                     x.q, x.k, w, _or(x.g, dq), _or(x.beta, dq), h, dh, do, dw, dp, _or(da, dp), dq, dk,
                     _or(dbeta_parts, dq), _or(db_parts, dq), chunk_seq, chunk_start, x.cu, scale, tokens,
                     HAS_G=x.g is not None, DELTA=delta)
            db = None if db_parts is None else db_parts.sum(0)
        if delta:
            dbeta += dbeta_parts.sum(0)
        if x.g is not None:
            # b is the cumulative sum of g within each chunk: dg is the reverse cumulative sum of db there
            # (each channel of a per-channel decay a column of its own)
            columns = value_heads * (k_dim if x.per_channel else 1)
            x.launch(reverse_cumsum_kernel, Config(), (x.num_seqs, columns), db, dg, x.cu, WITHIN_CHUNKS=True,
                     HV=columns)
    return _finish(x, dq, dk, dv, dg, dbeta, dh0, initial_state is not None)


def _recurrent(x: _Problem, writes: tl.constexpr, scale: float, out=None, ht=None, do=None, dht=None, dv=None, dq=None,
               dk=None, db=None):
    _, _, value_heads, _, v_dim = x.shape
    config = x.config("recurrent")
    unread = x.v
    x.launch(recurrent_kernel, config, (x.num_seqs, value_heads, triton.cdiv(v_dim, config.block_v)),
             x.q, x.k, x.v, _or(x.g, unread), _or(x.beta, unread), _or(x.h0, unread), _or(out, unread), ht,
             _or(do, unread), _or(dht, unread), _or(dv, unread), _or(dq, unread), _or(dk, unread), _or(db, unread),
             x.cu, scale, WRITES=writes.value, HAS_G=x.g is not None, DELTA=x.beta is not None, HAS_H0=x.h0 is not None,
             HAS_DHT=dht is not None, ACCURATE_EXP=not x.interpreted, PER_CHANNEL=x.per_channel)


def recurrent_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """The step-by-step kernel's forward; contract as :func:`chunk_forward`."""
    x = _setup(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm)
    x.rerun = functools.partial(recurrent_forward, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm)
    tokens, _, value_heads, k_dim, v_dim = x.shape
    o = torch.empty_like(x.v)
    ht = torch.empty(x.num_seqs, value_heads, k_dim, v_dim, dtype=torch.float32, device=x.q.device)
    _recurrent(x, WRITES_OUTPUTS, scale, out=o, ht=ht)
    return o.view(v.shape), ht


def recurrent_backward(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """The step-by-step kernels' backward (replay, backward walk, replay; module docstring);
    returns as :func:`chunk_backward`."""
    x = _setup(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm)
    x.rerun = functools.partial(recurrent_backward, do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                use_qk_l2norm)
    tokens, _, value_heads, k_dim, v_dim = x.shape
    device = x.q.device
    config = x.config("recurrent")  # the replays' and the walk's parts are summed over the same V blocks
    blocks = triton.cdiv(v_dim, config.block_v)
    delta = x.beta is not None
    f32 = dict(dtype=torch.float32, device=device)
    do = do.reshape(tokens, value_heads, v_dim).contiguous()
    dht = None if dht is None else dht.float().contiguous()
    ht = torch.empty(x.num_seqs, value_heads, k_dim, v_dim, **f32)  # written, not needed
    e = None
    if delta:
        e = torch.empty(tokens, value_heads, v_dim, **f32)
        _recurrent(x, WRITES_ERRORS, scale, out=e, ht=ht)
    dv = torch.empty(tokens, value_heads, v_dim, **f32)
    dk_write = torch.empty(blocks, tokens, value_heads, k_dim, **f32)
    decay_parts = (k_dim,) if x.per_channel else ()  # dL/dB's terms, per channel for a per-channel decay
    db_write = torch.empty(blocks, tokens, value_heads, *decay_parts, **f32)
    dbeta = torch.empty(blocks, tokens, value_heads, **f32) if delta else None
    dh0 = torch.empty(x.num_seqs, value_heads, k_dim, v_dim, **f32)
    x.launch(recurrent_backward_kernel, config, (x.num_seqs, value_heads, blocks),
             x.q, x.k, x.v, _or(x.g, dv), _or(x.beta, dv), _or(e, dv), do, _or(dht, dh0), dv, dk_write,
             _or(dbeta, dv), db_write, dh0, x.cu, scale, HAS_G=x.g is not None, DELTA=delta, HAS_DHT=dht is not None,
             ACCURATE_EXP=not x.interpreted, PER_CHANNEL=x.per_channel)
    dq = torch.empty(blocks, tokens, value_heads, k_dim, **f32)
    dk_read = torch.empty(blocks, tokens, value_heads, k_dim, **f32) if delta else None
    db_read = torch.empty(blocks, tokens, value_heads, *decay_parts, **f32)
    _recurrent(x, WRITES_READ_GRADIENTS, scale, ht=ht, do=do, dht=dht, dv=dv, dq=dq, dk=dk_read, db=db_read)
    dk = dk_write.sum(0) if dk_read is None else dk_write.sum(0) + dk_read.sum(0)
    dg = None
    if x.g is not None:
        db = db_write.sum(0) + db_read.sum(0)
        dg = torch.empty_like(db)
        if tokens:  # each channel of a per-channel decay is a column of its own
            columns = value_heads * (k_dim if x.per_channel else 1)
            x.launch(reverse_cumsum_kernel, Config(), (x.num_seqs, columns), db, dg, x.cu, WITHIN_CHUNKS=False,
                     HV=columns)
    return _finish(x, dq.sum(0), dk, dv, dg, None if dbeta is None else dbeta.sum(0), dh0, initial_state is not None)


# the kernels with a PER_CHANNEL flag
PER_CHANNEL_KERNELS = (wy_kernel, chunk_state_kernel, chunk_output_kernel, chunk_state_backward_kernel,
                       recurrent_kernel, recurrent_backward_kernel)
_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_INDEX_POINTERS = ("cu_ptr", "chunk_seq_ptr", "chunk_start_ptr", "first_chunk_ptr")
_INPUT_POINTERS = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "o_ptr")
_VALUE_POINTERS = ("w_ptr", "u_ptr")  # W, U (float32) for the delta rule; v itself for linear attention


def _signature(kernel, dtype: torch.dtype, constexprs: dict, delta: bool, out_type: str | None = None) -> dict:
    """Types of ``kernel``'s arguments: inputs in ``dtype``, indices int32, the rest float32."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _INDEX_POINTERS:
            signature[name] = "*i32"
        elif name == "num_tokens":
            signature[name] = "i32"
        elif name in _INPUT_POINTERS or (name in _VALUE_POINTERS and not delta):
            signature[name] = "*" + _TRITON_TYPES[dtype]
        elif name == "out_ptr":
            signature[name] = out_type
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32"  # scale
    return signature


def compile_targets(dtype: torch.dtype, delta: bool = True, k_dim: int = 128, v_dim: int = 128, heads: int = 16,
                    value_heads: int = 32, arch: int = 90, per_channel: bool = False):
    """``[(name, kernel, signature, constexprs, config, has_dots)]``: every kernel of one problem
    (Qwen3-Next-like head sizes by default) at its default config for compute capability ``arch``,
    to build ahead of time for inputs of ``dtype``; ``per_channel`` (with ``delta``) adds the
    builds for a per-channel decay (Kimi Delta Attention): its products kernel, and the chunked
    forward's and the step-by-step kernels with PER_CHANNEL."""
    low = _low_precision(dtype, interpreted=False)
    accurate = dict(ACCURATE_EXP=True)
    cases = [  # (name, kernel, config name, flags, has dots, type of out_ptr)
        ("chunk_state", chunk_state_kernel, "chunk_state",
         dict(HAS_G=True, HAS_H0=True, DELTA=delta, PER_CHANNEL=False, **accurate), True, None),
        ("chunk_output", chunk_output_kernel, "chunk_output", dict(HAS_G=True, SIXTEEN_BIT=low, PER_CHANNEL=False),
         True, None),
        ("chunk_state_backward", chunk_state_backward_kernel, "chunk_state_backward",
         dict(HAS_G=True, HAS_DHT=True, DELTA=delta, PER_CHANNEL=False, **accurate), True, None),
        ("chunk_grad_pairs", chunk_grad_pairs_kernel, "chunk_grad_pairs",
         dict(HAS_G=True, DELTA=delta, SIXTEEN_BIT=low), True, None),
        ("chunk_grad", chunk_grad_kernel, "chunk_grad", dict(HAS_G=True, DELTA=delta), True, None),
        ("reverse_cumsum", reverse_cumsum_kernel, None, dict(WITHIN_CHUNKS=True), False, None),
        ("recurrent_backward", recurrent_backward_kernel, "recurrent",
         dict(HAS_G=True, DELTA=delta, HAS_DHT=True, PER_CHANNEL=False, **accurate), False, None),
    ]
    if delta:
        cases.append(("wy", wy_kernel, "wy", dict(HAS_G=True, STORE_T=True, PER_CHANNEL=False), True, None))
    for writes, out_type in ((WRITES_OUTPUTS, "*" + _TRITON_TYPES[dtype]), (WRITES_ERRORS, "*fp32"),
                             (WRITES_READ_GRADIENTS, "*fp32")):
        if writes is not WRITES_ERRORS or delta:
            cases.append((f"recurrent_mode{writes.value}", recurrent_kernel, "recurrent",
                          dict(WRITES=writes.value, HAS_G=True, DELTA=delta, HAS_H0=True, HAS_DHT=True,
                               PER_CHANNEL=False, **accurate), False, out_type))
    if delta and per_channel:
        own = {"wy": "wy_per_channel", "chunk_state_backward": "chunk_state_backward_per_channel"}
        cases += [(f"{name}_per_channel", kernel, own.get(config, config),
                   {**flags, "PER_CHANNEL": True}, dots, out_type)
                  for name, kernel, config, flags, dots, out_type in cases if kernel in PER_CHANNEL_KERNELS]
        cases += [("channel_products", channel_products_kernel, "channel_products", {}, True, None),
                  ("chunk_grad_pairs_per_channel", chunk_grad_pairs_kernel, "chunk_grad_pairs",  # dP, dA undecayed
                   dict(HAS_G=False, DELTA=True, SIXTEEN_BIT=low), True, None),
                  ("chunk_grad_channel", chunk_grad_channel_kernel, "chunk_grad_channel", {}, True, None)]
    targets = []
    for name, kernel, config_name, kernel_flags, dots, out_type in cases:
        config = Config() if config_name is None else default_config(config_name, k_dim, v_dim, dtype, arch=arch)
        constexprs = _constexprs(kernel, heads, value_heads, k_dim, v_dim, config, **kernel_flags)
        targets.append((name, kernel, _signature(kernel, dtype, constexprs, delta, out_type), constexprs, config, dots))
    return targets


def compile_groups(everything: bool) -> dict:
    """The compile report's builds of this family: ``{group id: function of an arch returning its
    builds}``, a build being ``compile_report.Build``'s fields but ``family``. A group per K = V.
    By default the share CI builds: float32 and bfloat16 at K = V = 256 (the widest state), float16
    at 128, bfloat16 at 64 (the chunk kernels' tiles do not change with K, V, and float16 and
    bfloat16 share them), and the per-channel decay's kernels (Kimi Delta Attention) in bfloat16 at
    Kimi Linear's K = V = 128, a group of their own ahead of the widest, so that only the newest arch
    builds them: at 251-255 registers ptxas takes minutes over them, and a CI run on two cores
    cannot spend that twice; ``everything``: every dtype at every size, per-channel builds in each,
    for every arch."""
    from . import dtype_name

    shares = {64: (torch.bfloat16,), 128: (torch.float16,), 256: (torch.float32, torch.bfloat16)}

    def builds(size: int, dtypes, arch: int = 90, kda_only: bool = False) -> list[dict]:
        return [dict(label=f"{name} {dtype_name(dtype)} {'delta' if delta else 'gla'} K=V={size}", kernel=kernel,
                     signature=signature, constexprs=constexprs, num_warps=config.num_warps,
                     num_stages=config.num_stages)
                for dtype in dtypes for delta in ((True,) if kda_only else (True, False))
                for name, kernel, signature, constexprs, config, _ in compile_targets(
                    dtype, delta, size, size, arch=arch, per_channel=everything or kda_only)
                if not kda_only or "channel" in name]

    groups = {}
    for size, dtypes in shares.items():
        if size == 256 and not everything:
            groups["linear_attention-KDA128"] = functools.partial(builds, 128, (torch.bfloat16,), kda_only=True)
        groups[f"linear_attention-K{size}"] = functools.partial(builds, size, tuple(_TRITON_TYPES) if everything
                                                                else dtypes)
    return groups

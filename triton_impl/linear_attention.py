"""Gated DeltaNet and gated linear attention as Triton kernels, chunked and step by step.

Layout: every launcher flattens ``[B, T, *]`` to token-major ``[B*T, *]`` and treats the batch rows
as packed sequences, so one set of kernels serves both layouts. Around the kernels, in torch: the
optional l2 normalization of q, k (and its backward), and the sums of ``dq``, ``dk`` over the value
heads that share a query/key head (the kernels write them per value head). The math and its notation are in
``torch_kernels.reference.linear_attention``: per chunk of ``C = 64`` steps, ``b`` is the cumulative
log decay inside the chunk, ``D_ts = exp(b_t - b_s)`` (``s <= t``), ``S0`` the state at its start.

Chunked forward (four launches; ``beta=None`` skips the WY step, ``W = V``; ``g=None`` the cumsum):

1. ``chunk_cumsum_kernel``: ``b`` per chunk and value head.
2. ``wy_kernel``: ``T = (I + strict_lower(diag(beta) D * K K^T))^-1`` by forward substitution on
   its four 16x16 diagonal blocks (all four at once) and a block merge by four ``tl.dot``s; then
   ``U = T diag(beta) V`` and ``Wk = T diag(beta exp(b)) K``, so that the effective values are
   ``W = U - Wk S0``.
3. ``chunk_state_kernel``: one program per (sequence, value head, V block) walks the chunks with
   the state in registers: stores ``S0`` of each chunk, ``W`` (over ``U``, in place) and the final
   state.
4. ``chunk_output_kernel``: ``O = scale (exp(b) Q S0 + (D * Q K^T) W)`` per chunk, in parallel.

Chunked backward recomputes 1-3 from the inputs (``T`` kept this time), then:

5. ``chunk_state_backward_kernel`` walks the chunks backwards with ``dS`` (the gradient of the
   chunk's end state) in registers: ``dW = (K exp(b_C - b)) dS + scale (D * Q K^T)^T dO`` and
   ``dS0 = exp(b_C) dS + scale (exp(b) Q)^T dO - Wk^T dW``; stores ``dS`` per chunk, ``dW``, ``dh0``.
6. ``chunk_grad_kernel`` per chunk: ``dQ``, ``dK``, ``dV``, ``dbeta`` from the triangular solve's
   adjoint (``dR = T^T dW`` is the gradient of the right-hand side ``diag(beta)(V - exp(b) K S0)``,
   ``dA = -dR W^T``) and the output and state terms; ``dL/db`` term by term, and ``dg`` as its
   reverse cumulative sum inside the chunk (``b`` is ``g``'s cumulative sum there).

Recurrent forms (``recurrent_kernel``, one program per (sequence, value head, V block), the
``[K, BV]`` state in registers). The backward stores no states: the gradient ``dS`` obeys a
backward recurrence free of ``S`` (``dS_{t-1} = a_t (dS_t - k_t de_t^T) + scale q_{t-1} do_{t-1}^T``),
so it replays the forward once for the errors ``e_t = v_t - S'_t^T k_t`` (delta rule only), walks
back once (``recurrent_backward_kernel``: ``dv``, ``dbeta``, the write part ``dS_t u_t`` of ``dk``,
``dh0``) and replays forward once more for what needs ``S`` (``dq = scale S_t do_t``, the read part
``-S'_t de_t`` of ``dk``). For ``dg`` without products of states and their gradients: with ``B_t``
the cumulative log decay of the sequence, the recurrence sees ``B`` only through ``exp(B) q``,
``exp(B) k`` (a key reading the state), ``exp(-B) k`` (a key writing it) and ``exp(B_T)`` on the
final state, so ``dL/dB_t = q.dq + k.(dk_read - dk_write)`` (plus ``<dht, S_T>`` at the last step)
and ``dg`` is its reverse cumulative sum (``reverse_cumsum_kernel``). The walks leave out of each
term the pair (this step's write, this step's read), which cancels exactly: what remains carries
a decay, so strong decays add no large terms that would cancel in float32.

Precision: float32 state and accumulation. On a GPU float16/bfloat16 operands enter ``tl.dot`` in
their dtype (float32 intermediates rounded to it), float32 ones as tf32x3; the triangular inverse is
always float32. Under the interpreter (CPU tensors) everything is float32, as its bfloat16 is wrong.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import for_device

CHUNK = 64
SUB = 16  # the WY inverse's diagonal blocks (tl.dot's smallest tile)
MAX_K = 256  # a [K, BV] state, [64, K] key tiles live in registers
EPS = 1e-6  # the l2 normalization's, as the reference


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of a launch: the V block of the state walks and output tiles, warps."""

    block_v: int = 64
    num_warps: int = 4


def default_config(k_dim: int, v_dim: int, recurrent: bool = False, interpreted: bool = False) -> Config:
    """Heuristic: wider keys get more warps for the chunk tiles; the recurrent form takes narrow V
    blocks on a GPU, for more programs (the interpreter, whose cost is per program step, wide ones)."""
    widest = 64 if interpreted or not recurrent else 32
    block_v = min(widest, max(16, triton.next_power_of_2(v_dim)))
    return Config(block_v=block_v, num_warps=4 if recurrent or _padded(k_dim) <= 64 else 8)


@triton.jit
def _dot(a, b, LOW: tl.constexpr, DT: tl.constexpr):
    """``a @ b`` accumulated in float32: operands in the input dtype ``DT`` when LOW, else tf32x3."""
    if LOW:
        return tl.dot(a.to(DT), b.to(DT))
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")


@triton.jit
def _dot32(a, b):
    """float32 ``a @ b`` for the WY inverse, whatever the inputs' dtype (its entries may be large)."""
    return tl.dot(a, b, input_precision="tf32x3")


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
def _gates(b_ptr, rows, valid, head, HEADS: tl.constexpr, HAS_G: tl.constexpr, N: tl.constexpr):
    if HAS_G:
        return tl.load(b_ptr + rows.to(tl.int64) * HEADS + head, mask=valid, other=0.0).to(tl.float32)
    return tl.zeros([N], tl.float32)


@triton.jit
def _last_gate(b_ptr, t0, end, head, HEADS: tl.constexpr, C: tl.constexpr, HAS_G: tl.constexpr):
    """``b`` at the chunk's last step (the chunk's whole decay)."""
    if HAS_G:
        return tl.load(b_ptr + (tl.minimum(t0 + C, end) - 1).to(tl.int64) * HEADS + head)
    return 0.0


@triton.jit
def _decay(b, t_ok, s_ok, STRICT: tl.constexpr, N: tl.constexpr):
    """``D_ts = exp(b_t - b_s)`` for ``s <= t`` (``s < t`` when STRICT), 0 elsewhere (exp never
    sees the upper triangle, where it may overflow)."""
    idx = tl.arange(0, N)
    if STRICT:
        keep = idx[:, None] > idx[None, :]
    else:
        keep = idx[:, None] >= idx[None, :]
    keep = keep & t_ok[:, None] & s_ok[None, :]
    return tl.where(keep, tl.exp(tl.where(keep, b[:, None] - b[None, :], 0.0)), 0.0)


@triton.jit
def _chunk_of(chunk_seq_ptr, chunk_start_ptr, cu_ptr, c):
    n = tl.load(chunk_seq_ptr + c)
    t0 = tl.load(chunk_start_ptr + c)
    end = tl.load(cu_ptr + n + 1)
    return t0, end


@triton.jit
def chunk_cumsum_kernel(g_ptr, b_ptr, chunk_seq_ptr, chunk_start_ptr, cu_ptr,
                        HV: tl.constexpr, HVP: tl.constexpr, C: tl.constexpr):
    """``b``: the cumulative sum of ``g`` inside chunk ``program_id(0)``, every value head."""
    t0, end = _chunk_of(chunk_seq_ptr, chunk_start_ptr, cu_ptr, tl.program_id(0))
    rows = t0 + tl.arange(0, C)
    heads = tl.arange(0, HVP)
    mask = (rows < end)[:, None] & (heads < HV)[None, :]
    offs = rows.to(tl.int64)[:, None] * HV + heads[None, :]
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(b_ptr + offs, tl.cumsum(g, axis=0), mask=mask)


@triton.jit
def _block_diagonal_inverse(a, NB: tl.constexpr, SB: tl.constexpr):
    """The inverse of the block diagonal of ``I + a`` (``NB`` blocks of ``SB``; ``a [NB*SB, NB*SB]``
    strictly lower): forward substitution in all blocks at once, one row of each per step."""
    C: tl.constexpr = NB * SB
    blocks = tl.arange(0, NB)
    same = blocks[:, None, None, None] == blocks[None, None, :, None]
    diag = tl.sum(tl.where(same, tl.reshape(a, [NB, SB, NB, SB]), 0.0), axis=2)  # [NB, SB, SB]
    idx = tl.arange(0, SB)
    x = tl.where(idx[None, :, None] == idx[None, None, :], 1.0, 0.0) + tl.zeros([NB, SB, SB], tl.float32)
    for i in tl.static_range(1, SB):
        coeff = tl.sum(tl.where(idx[None, :, None] == i, diag, 0.0), axis=1)  # row i of each block
        row = tl.where(idx[None, :] == i, 1.0, 0.0) - tl.sum(coeff[:, :, None] * x, axis=1)
        x = tl.where(idx[None, :, None] == i, row[:, None, :], x)
    return tl.reshape(tl.where(same, tl.broadcast_to(x[:, :, None, :], [NB, SB, NB, SB]), 0.0), [C, C])


@triton.jit
def wy_kernel(
    k_ptr, v_ptr, b_ptr, beta_ptr, t_ptr, u_ptr, wk_ptr, chunk_seq_ptr, chunk_start_ptr, cu_ptr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, SB: tl.constexpr, HAS_G: tl.constexpr, STORE_T: tl.constexpr,
    LOW: tl.constexpr,
):
    """``T``, ``U = T diag(beta) V`` and ``Wk = T diag(beta exp(b)) K`` of chunk ``program_id(0)``
    and value head ``program_id(1)`` (module docstring, step 2)."""
    t0, end = _chunk_of(chunk_seq_ptr, chunk_start_ptr, cu_ptr, tl.program_id(0))
    hv = tl.program_id(1)
    kh = hv // (HV // H)
    DT = k_ptr.dtype.element_ty
    rows = t0 + tl.arange(0, C)
    ok = rows < end
    dims = tl.arange(0, KP)
    k_ok = dims < K
    k = _rows(k_ptr, rows, ok, kh, H, dims, k_ok, K)
    beta = tl.load(beta_ptr + rows.to(tl.int64) * HV + hv, mask=ok, other=0.0)
    b = _gates(b_ptr, rows, ok, hv, HV, HAS_G, C)
    a = beta[:, None] * _decay(b, ok, ok, True, C) * _dot(k, tl.trans(k), LOW, DT)
    # I + A = Lb (I + M) with Lb its block diagonal and M = Lb^-1 (the blocks below it), strictly
    # block lower: with C / SB = 4 blocks M^4 = 0, so T = (I - M)(I + M^2) Lb^-1 exactly.
    lb_inv = _block_diagonal_inverse(a, C // SB, SB)
    steps = tl.arange(0, C)
    m = _dot32(lb_inv, tl.where(steps[:, None] // SB > steps[None, :] // SB, a, 0.0))
    eye = tl.where(steps[:, None] == steps[None, :], 1.0, 0.0)
    t_inv = _dot32(_dot32(eye - m, eye + _dot32(m, m)), lb_inv)
    if STORE_T:
        _store_rows(t_ptr, t_inv, rows, ok, hv, HV, steps, steps < C, C)
    _store_rows(wk_ptr, _dot(t_inv, k * (beta * tl.exp(b))[:, None], LOW, DT), rows, ok, hv, HV, dims, k_ok, K)
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        v_ok = cols < V
        v = _rows(v_ptr, rows, ok, hv, HV, cols, v_ok, V)
        _store_rows(u_ptr, _dot(t_inv, v * beta[:, None], LOW, DT), rows, ok, hv, HV, cols, v_ok, V)


@triton.jit
def chunk_state_kernel(
    k_ptr, v_ptr, b_ptr, u_ptr, wk_ptr, h0_ptr, h_ptr, ht_ptr, cu_ptr, first_chunk_ptr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, HAS_G: tl.constexpr, HAS_H0: tl.constexpr, DELTA: tl.constexpr,
    LOW: tl.constexpr,
):
    """The chunk walk of sequence ``program_id(0)``, value head ``program_id(1)``, V block
    ``program_id(2)``: each chunk's start state to ``h``, ``W = U - Wk S0`` over ``U`` (delta rule;
    else ``W = V``), the final state to ``ht``."""
    n = tl.program_id(0)
    hv = tl.program_id(1)
    kh = hv // (HV // H)
    DT = k_ptr.dtype.element_ty
    start = tl.load(cu_ptr + n)
    end = tl.load(cu_ptr + n + 1)
    first = tl.load(first_chunk_ptr + n).to(tl.int64)
    dims = tl.arange(0, KP)
    k_ok = dims < K
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    v_ok = cols < V
    state_offs = dims[:, None] * V + cols[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    if HAS_H0:
        state = tl.load(h0_ptr + (n * HV + hv).to(tl.int64) * K * V + state_offs, mask=state_ok, other=0.0)
    else:
        state = tl.zeros([KP, BV], tl.float32)
    for i in range(tl.cdiv(end - start, C)):
        tl.store(h_ptr + ((first + i) * HV + hv) * K * V + state_offs, state, mask=state_ok)
        t0 = start + i * C
        rows = t0 + tl.arange(0, C)
        ok = rows < end
        k = _rows(k_ptr, rows, ok, kh, H, dims, k_ok, K)
        b = _gates(b_ptr, rows, ok, hv, HV, HAS_G, C)
        b_last = _last_gate(b_ptr, t0, end, hv, HV, C, HAS_G)
        if DELTA:
            w = _rows(u_ptr, rows, ok, hv, HV, cols, v_ok, V)
            w -= _dot(_rows(wk_ptr, rows, ok, hv, HV, dims, k_ok, K), state, LOW, DT)
            _store_rows(u_ptr, w, rows, ok, hv, HV, cols, v_ok, V)
        else:
            w = _rows(v_ptr, rows, ok, hv, HV, cols, v_ok, V)
        k_decayed = k * tl.where(ok, tl.exp(b_last - b), 0.0)[:, None]
        state = tl.exp(b_last) * state + _dot(tl.trans(k_decayed), w, LOW, DT)
    tl.store(ht_ptr + (n * HV + hv).to(tl.int64) * K * V + state_offs, state, mask=state_ok)


@triton.jit
def chunk_output_kernel(
    q_ptr, k_ptr, w_ptr, b_ptr, h_ptr, o_ptr, chunk_seq_ptr, chunk_start_ptr, cu_ptr, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, HAS_G: tl.constexpr, LOW: tl.constexpr,
):
    """``O = scale (exp(b) Q S0 + (D * Q K^T) W)`` of chunk ``program_id(0)``, value head
    ``program_id(1)``, V block ``program_id(2)``."""
    c = tl.program_id(0)
    hv = tl.program_id(1)
    kh = hv // (HV // H)
    DT = k_ptr.dtype.element_ty
    t0, end = _chunk_of(chunk_seq_ptr, chunk_start_ptr, cu_ptr, c)
    rows = t0 + tl.arange(0, C)
    ok = rows < end
    dims = tl.arange(0, KP)
    k_ok = dims < K
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    v_ok = cols < V
    q = _rows(q_ptr, rows, ok, kh, H, dims, k_ok, K)
    k = _rows(k_ptr, rows, ok, kh, H, dims, k_ok, K)
    b = _gates(b_ptr, rows, ok, hv, HV, HAS_G, C)
    state = tl.load(h_ptr + (c.to(tl.int64) * HV + hv) * K * V + dims[:, None] * V + cols[None, :],
                    mask=k_ok[:, None] & v_ok[None, :], other=0.0)
    w = _rows(w_ptr, rows, ok, hv, HV, cols, v_ok, V)
    p = _dot(q, tl.trans(k), LOW, DT) * _decay(b, ok, ok, False, C)
    o = scale * (tl.exp(b)[:, None] * _dot(q, state, LOW, DT) + _dot(p, w, LOW, DT))
    _store_rows(o_ptr, o, rows, ok, hv, HV, cols, v_ok, V)


@triton.jit
def chunk_state_backward_kernel(
    q_ptr, k_ptr, wk_ptr, b_ptr, do_ptr, dht_ptr, dh_ptr, dh0_ptr, dw_ptr, cu_ptr, first_chunk_ptr, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, HAS_G: tl.constexpr, HAS_DHT: tl.constexpr, DELTA: tl.constexpr,
    LOW: tl.constexpr,
):
    """The backward chunk walk of sequence ``program_id(0)``, value head ``program_id(1)``, V block
    ``program_id(2)`` (module docstring, step 5): ``dS`` of each chunk's end state to ``dh``, ``dW``
    to ``dw``, the initial state's gradient to ``dh0``."""
    n = tl.program_id(0)
    hv = tl.program_id(1)
    kh = hv // (HV // H)
    DT = k_ptr.dtype.element_ty
    start = tl.load(cu_ptr + n)
    end = tl.load(cu_ptr + n + 1)
    first = tl.load(first_chunk_ptr + n).to(tl.int64)
    dims = tl.arange(0, KP)
    k_ok = dims < K
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    v_ok = cols < V
    state_offs = dims[:, None] * V + cols[None, :]
    state_ok = k_ok[:, None] & v_ok[None, :]
    if HAS_DHT:
        d_state = tl.load(dht_ptr + (n * HV + hv).to(tl.int64) * K * V + state_offs, mask=state_ok, other=0.0)
    else:
        d_state = tl.zeros([KP, BV], tl.float32)
    num_chunks = tl.cdiv(end - start, C)
    for j in range(num_chunks):
        i = num_chunks - 1 - j
        tl.store(dh_ptr + ((first + i) * HV + hv) * K * V + state_offs, d_state, mask=state_ok)
        t0 = start + i * C
        rows = t0 + tl.arange(0, C)
        ok = rows < end
        q = _rows(q_ptr, rows, ok, kh, H, dims, k_ok, K)
        k = _rows(k_ptr, rows, ok, kh, H, dims, k_ok, K)
        do = _rows(do_ptr, rows, ok, hv, HV, cols, v_ok, V)
        b = _gates(b_ptr, rows, ok, hv, HV, HAS_G, C)
        b_last = _last_gate(b_ptr, t0, end, hv, HV, C, HAS_G)
        p = _dot(q, tl.trans(k), LOW, DT) * _decay(b, ok, ok, False, C)
        k_decayed = k * tl.where(ok, tl.exp(b_last - b), 0.0)[:, None]
        dw = _dot(k_decayed, d_state, LOW, DT) + scale * _dot(tl.trans(p), do, LOW, DT)
        _store_rows(dw_ptr, dw, rows, ok, hv, HV, cols, v_ok, V)
        q_decayed = q * tl.exp(b)[:, None]
        d_state = tl.exp(b_last) * d_state + scale * _dot(tl.trans(q_decayed), do, LOW, DT)
        if DELTA:
            d_state -= _dot(tl.trans(_rows(wk_ptr, rows, ok, hv, HV, dims, k_ok, K)), dw, LOW, DT)
    tl.store(dh0_ptr + (n * HV + hv).to(tl.int64) * K * V + state_offs, d_state, mask=state_ok)


@triton.jit
def chunk_grad_kernel(
    q_ptr, k_ptr, v_ptr, w_ptr, b_ptr, beta_ptr, t_ptr, h_ptr, dh_ptr, do_ptr, dw_ptr,
    dq_ptr, dk_ptr, dv_ptr, dbeta_ptr, dg_ptr, chunk_seq_ptr, chunk_start_ptr, cu_ptr, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
    BV: tl.constexpr, C: tl.constexpr, HAS_G: tl.constexpr, DELTA: tl.constexpr, LOW: tl.constexpr,
):
    """Per-value-head ``dq``, ``dk``, ``dv`` (delta rule), ``dbeta`` and ``dg`` of chunk
    ``program_id(0)``, value head ``program_id(1)`` (module docstring, steps 6-7)."""
    c = tl.program_id(0)
    hv = tl.program_id(1)
    kh = hv // (HV // H)
    DT = k_ptr.dtype.element_ty
    t0, end = _chunk_of(chunk_seq_ptr, chunk_start_ptr, cu_ptr, c)
    rows = t0 + tl.arange(0, C)
    ok = rows < end
    dims = tl.arange(0, KP)
    k_ok = dims < K
    steps = tl.arange(0, C)
    q = _rows(q_ptr, rows, ok, kh, H, dims, k_ok, K)
    k = _rows(k_ptr, rows, ok, kh, H, dims, k_ok, K)
    b = _gates(b_ptr, rows, ok, hv, HV, HAS_G, C)
    b_last = _last_gate(b_ptr, t0, end, hv, HV, C, HAS_G)
    exp_b = tl.where(ok, tl.exp(b), 0.0)
    state_base = (c.to(tl.int64) * HV + hv) * K * V
    do_s = tl.zeros([C, KP], tl.float32)  # dO S0^T
    do_w = tl.zeros([C, C], tl.float32)  # dO W^T
    w_ds = tl.zeros([C, KP], tl.float32)  # W dS^T
    ds_s = 0.0  # <dS, S0>
    if DELTA:
        beta = tl.load(beta_ptr + rows.to(tl.int64) * HV + hv, mask=ok, other=0.0)
        t_inv_t = tl.trans(_rows(t_ptr, rows, ok, hv, HV, steps, steps < C, C))
        dr_s = tl.zeros([C, KP], tl.float32)  # dR S0^T
        dr_w = tl.zeros([C, C], tl.float32)  # dR W^T
        dbeta = tl.zeros([C], tl.float32)
        ks_dr = tl.zeros([C], tl.float32)  # rows of (K S0) . dR
    for v0 in range(0, V, BV):
        cols = v0 + tl.arange(0, BV)
        v_ok = cols < V
        state_offs = state_base + dims[:, None] * V + cols[None, :]
        state_ok = k_ok[:, None] & v_ok[None, :]
        state = tl.load(h_ptr + state_offs, mask=state_ok, other=0.0)
        d_state = tl.load(dh_ptr + state_offs, mask=state_ok, other=0.0)
        do = _rows(do_ptr, rows, ok, hv, HV, cols, v_ok, V)
        w = _rows(w_ptr, rows, ok, hv, HV, cols, v_ok, V)
        do_s += _dot(do, tl.trans(state), LOW, DT)
        do_w += _dot(do, tl.trans(w), LOW, DT)
        w_ds += _dot(w, tl.trans(d_state), LOW, DT)
        if HAS_G:
            ds_s += tl.sum(tl.sum(d_state * state, axis=1), axis=0)
        if DELTA:
            dr = _dot(t_inv_t, _rows(dw_ptr, rows, ok, hv, HV, cols, v_ok, V), LOW, DT)
            _store_rows(dv_ptr, beta[:, None] * dr, rows, ok, hv, HV, cols, v_ok, V)
            ks = _dot(k, state, LOW, DT)
            dbeta += tl.sum((_rows(v_ptr, rows, ok, hv, HV, cols, v_ok, V) - exp_b[:, None] * ks) * dr, axis=1)
            ks_dr += tl.sum(ks * dr, axis=1)
            dr_s += _dot(dr, tl.trans(state), LOW, DT)
            dr_w += _dot(dr, tl.trans(w), LOW, DT)
    dp = scale * do_w * _decay(b, ok, ok, False, C)
    dq = scale * exp_b[:, None] * do_s + _dot(dp, k, LOW, DT)
    end_decay = tl.where(ok, tl.exp(b_last - b), 0.0)
    dk = _dot(tl.trans(dp), q, LOW, DT) + end_decay[:, None] * w_ds
    if DELTA:
        da = -dr_w * _decay(b, ok, ok, True, C)  # dA * D (dA is strictly lower: so is D here)
        ga = da * beta[:, None]
        kk = _dot(k, tl.trans(k), LOW, DT)
        tl.store(dbeta_ptr + rows.to(tl.int64) * HV + hv, dbeta + tl.sum(da * kk, axis=1), mask=ok)
        dk += -(beta * exp_b)[:, None] * dr_s + _dot(ga, k, LOW, DT) + _dot(tl.trans(ga), k, LOW, DT)
    _store_rows(dq_ptr, dq, rows, ok, hv, HV, dims, k_ok, K)
    _store_rows(dk_ptr, dk, rows, ok, hv, HV, dims, k_ok, K)
    if HAS_G:
        # dL/db_t term by term: each is a pair (write s, read t > s) carrying its decay, or a read
        # of S0, so strong decays leave no large terms that cancel (the diagonal pairs of P and of
        # the end state's last row cancel exactly and are left out)
        pairs = tl.where(steps[:, None] > steps[None, :], dp, 0.0) * _dot(q, tl.trans(k), LOW, DT)
        if DELTA:
            pairs += ga * kk
        db = scale * exp_b * tl.sum(q * do_s, axis=1) + tl.sum(pairs, axis=1) - tl.sum(pairs, axis=0)
        if DELTA:
            db -= beta * exp_b * ks_dr
        last = tl.minimum(C, end - t0) - 1
        written = tl.where(steps < last, end_decay * tl.sum(k * w_ds, axis=1), 0.0)
        db += tl.where(steps == last, tl.sum(written, axis=0) + tl.exp(b_last) * ds_s, 0.0) - written
        # b is the cumulative sum of g within the chunk: dg is the reverse cumulative sum of db
        dg = tl.sum(db, axis=0) - tl.cumsum(db, axis=0) + db
        tl.store(dg_ptr + rows.to(tl.int64) * HV + hv, dg, mask=ok)


@triton.jit
def reverse_cumsum_kernel(x_ptr, y_ptr, cu_ptr, HV: tl.constexpr, C: tl.constexpr):
    """``y_t = sum_{s >= t} x_s`` within sequence ``program_id(0)``, value head ``program_id(1)``."""
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
        total = tl.sum(x, axis=0)
        tl.store(y_ptr + offs, carry + total - tl.cumsum(x, axis=0) + x, mask=ok)
        carry += total


@triton.jit
def recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, h0_ptr, out_ptr, ht_ptr, do_ptr, dht_ptr, dv_ptr, dq_ptr, dk_ptr, db_ptr,
    cu_ptr, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
    BV: tl.constexpr, MODE: tl.constexpr, HAS_G: tl.constexpr, DELTA: tl.constexpr, HAS_H0: tl.constexpr,
    HAS_DHT: tl.constexpr,
):
    """The recurrence step by step for sequence ``program_id(0)``, value head ``program_id(1)``, V
    block ``program_id(2)``, ending with the final state in ``ht``. MODE 0: the outputs to ``out``;
    MODE 1: the delta rule's errors ``e_t`` to ``out``; MODE 2 (backward, ``dv`` holding ``de``):
    this V block's parts (``[V blocks, tokens, HV, *]``) of ``dq``, of ``dk``'s read term and of
    ``dL/dB``'s read terms (``db``)."""
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
    state_base = (n * HV + hv).to(tl.int64) * K * V
    if HAS_H0:
        state = tl.load(h0_ptr + state_base + state_offs, mask=state_ok, other=0.0)
    else:
        state = tl.zeros([KP, BV], tl.float32)
    if MODE == 2 and HAS_DHT:
        d_final = tl.load(dht_ptr + state_base + state_offs, mask=state_ok, other=0.0)
    num_tokens = tl.load(cu_ptr + tl.num_programs(0))
    for j in range(end - start):
        t = start.to(tl.int64) + j
        qk_offs = (t * H + kh) * K + dims
        v_offs = (t * HV + hv) * V + cols
        k = tl.load(k_ptr + qk_offs, mask=k_ok, other=0.0).to(tl.float32)
        u = tl.load(v_ptr + v_offs, mask=v_ok, other=0.0).to(tl.float32)
        if HAS_G:
            state *= tl.exp(tl.load(g_ptr + t * HV + hv))
        if DELTA:
            e = u - tl.sum(state * k[:, None], axis=0)
            if MODE == 1:
                tl.store(out_ptr + v_offs, e, mask=v_ok)
            u = tl.load(beta_ptr + t * HV + hv) * e
        if MODE == 2:
            # the read terms before this step's write: each then carries a decay (see db below)
            part = (vb * num_tokens + t) * HV + hv
            q = tl.load(q_ptr + qk_offs, mask=k_ok, other=0.0).to(tl.float32)
            do = tl.load(do_ptr + v_offs, mask=v_ok, other=0.0).to(tl.float32)
            dq = scale * tl.sum(state * do[None, :], axis=1)
            db = tl.sum(q * dq, axis=0)
            if DELTA:
                dk = -tl.sum(state * tl.load(dv_ptr + v_offs, mask=v_ok, other=0.0)[None, :], axis=1)
                tl.store(dk_ptr + part * K + dims, dk, mask=k_ok)
                db += tl.sum(k * dk, axis=0)
            if HAS_DHT:
                if j == end - start - 1:
                    db += tl.sum(tl.sum(d_final * state, axis=1), axis=0)
            tl.store(db_ptr + part, db)
            tl.store(dq_ptr + part * K + dims, dq + scale * k * tl.sum(u * do, axis=0), mask=k_ok)
        state += k[:, None] * u[None, :]
        if MODE == 0:
            q = tl.load(q_ptr + qk_offs, mask=k_ok, other=0.0).to(tl.float32)
            o = scale * tl.sum(state * q[:, None], axis=0)
            tl.store(out_ptr + v_offs, o.to(out_ptr.dtype.element_ty), mask=v_ok)
    tl.store(ht_ptr + state_base + state_offs, state, mask=state_ok)


@triton.jit
def recurrent_backward_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, e_ptr, do_ptr, dht_ptr, dv_ptr, dk_ptr, dbeta_ptr, db_ptr, dh0_ptr,
    cu_ptr, scale, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, KP: tl.constexpr,
    BV: tl.constexpr, HAS_G: tl.constexpr, DELTA: tl.constexpr, HAS_DHT: tl.constexpr,
):
    """The backward walk of sequence ``program_id(0)``, value head ``program_id(1)``, V block
    ``program_id(2)`` with ``dS`` in registers: ``dv`` (= ``de`` for the delta rule), this V
    block's parts of ``dbeta``, of ``dk``'s write term and of ``dL/dB``'s write terms, and ``dh0``."""
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
        # the gradient of this step's written value: later reads (r_later), then this step's own
        r_later = tl.sum(d_state * k[:, None], axis=0)
        d_state += scale * q[:, None] * do[None, :]
        r = r_later + scale * tl.sum(q * k, axis=0) * do
        if DELTA:
            beta = tl.load(beta_ptr + t * HV + hv)
            e = tl.load(e_ptr + v_offs, mask=v_ok, other=0.0)
            u = beta * e
            dv = beta * r
            tl.store(dbeta_ptr + part, tl.sum(e * r, axis=0))
            d_state_e = tl.sum(d_state * e[None, :], axis=1)
            dk = beta * d_state_e
            d_state -= k[:, None] * dv[None, :]
        else:
            u = tl.load(v_ptr + v_offs, mask=v_ok, other=0.0).to(tl.float32)
            dv = r
            dk = tl.sum(d_state * u[None, :], axis=1)
        # later reads of this write: the final state's read of the last step's write is left to
        # the replay (it adds <dht, S'_T>), so that no undecayed term enters dL/dB
        tl.store(db_ptr + part, -tl.where(j == 0, 0.0, tl.sum(r_later * u, axis=0)))
        tl.store(dv_ptr + v_offs, dv, mask=v_ok)
        tl.store(dk_ptr + part * K + dims, dk, mask=k_ok)
        if HAS_G:
            d_state *= tl.exp(tl.load(g_ptr + t * HV + hv))
    tl.store(dh0_ptr + (n * HV + hv).to(tl.int64) * K * V + state_offs, d_state, mask=state_ok)


@dataclasses.dataclass
class _Problem:
    """The inputs as the kernels take them: token-major, q/k normalized, gates float32."""

    batch: int
    length: int
    q: torch.Tensor  # [tokens, H, K] (l2-normalized when asked)
    k: torch.Tensor
    v: torch.Tensor  # [tokens, HV, V]
    g: torch.Tensor | None  # [tokens, HV] float32
    beta: torch.Tensor | None
    h0: torch.Tensor | None  # [N, HV, K, V] float32
    cu: torch.Tensor  # [N + 1] int32
    q_raw: torch.Tensor | None  # float32 inputs before the l2 normalization (for its backward)
    k_raw: torch.Tensor | None

    @property
    def num_seqs(self) -> int:
        return self.cu.shape[0] - 1

    @property
    def shape(self):
        """(tokens, H, HV, K, V)."""
        return self.q.shape[0], self.q.shape[1], self.v.shape[1], self.q.shape[2], self.v.shape[2]

    def constexprs(self, config: Config) -> dict:
        _, heads, value_heads, k_dim, v_dim = self.shape
        return dict(H=heads, HV=value_heads, K=k_dim, V=v_dim, KP=_padded(k_dim), BV=config.block_v)

    @property
    def low(self) -> bool:
        return _low_precision(self.q.dtype, self.q.device.type == "cpu")


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
        q, k = _l2_normalize(q_raw).to(q.dtype), _l2_normalize(k_raw).to(k.dtype)
    if cu_seqlens is None:
        cu = torch.arange(batch + 1, dtype=torch.int32, device=q.device) * length
    else:
        cu = cu_seqlens.to(torch.int32)
    gate = lambda x: None if x is None else x.reshape(tokens, value_heads).float().contiguous()  # noqa: E731
    return _Problem(batch, length, q.reshape(tokens, heads, k_dim).contiguous(),
                    k.reshape(tokens, heads, k_dim).contiguous(), v.reshape(tokens, value_heads, v_dim).contiguous(),
                    gate(g), gate(beta), None if initial_state is None else initial_state.float().contiguous(), cu,
                    q_raw, k_raw)


def _chunks(cu: torch.Tensor):
    """(chunk -> sequence, chunk -> first token, sequence -> first chunk, number of chunks)."""
    lengths = (cu[1:] - cu[:-1]).long()
    counts = (lengths + CHUNK - 1) // CHUNK
    first = torch.zeros(cu.shape[0], dtype=torch.int64, device=cu.device)
    first[1:] = counts.cumsum(0)
    num_chunks = int(first[-1].item())
    seq = torch.repeat_interleave(torch.arange(counts.shape[0], device=cu.device), counts, output_size=num_chunks)
    start = cu.long()[seq] + (torch.arange(num_chunks, device=cu.device) - first[seq]) * CHUNK
    return seq.to(torch.int32), start.to(torch.int32), first.to(torch.int32), num_chunks


def _chunk_recompute(x: _Problem, config: Config, store_t: bool):
    """Steps 1-3 of the module docstring: (b, T, W, Wk, chunk start states, final states, chunk tables)."""
    tokens, _, value_heads, k_dim, v_dim = x.shape
    device = x.q.device
    chunk_seq, chunk_start, first_chunk, num_chunks = _chunks(x.cu)
    dims = x.constexprs(config)
    f32 = dict(dtype=torch.float32, device=device)
    b = t_inv = None
    if x.g is not None and num_chunks:
        b = torch.empty(tokens, value_heads, **f32)
        for_device(chunk_cumsum_kernel, device)[(num_chunks,)](
            x.g, b, chunk_seq, chunk_start, x.cu, HV=value_heads, HVP=triton.next_power_of_2(value_heads), C=CHUNK)
    w = wk = None
    if x.beta is not None:
        w = torch.empty(tokens, value_heads, v_dim, **f32)  # U, then W in place
        wk = torch.empty(tokens, value_heads, k_dim, **f32)
        t_inv = torch.empty(tokens, value_heads, CHUNK, **f32) if store_t else w
        if num_chunks:
            for_device(wy_kernel, device)[(num_chunks, value_heads)](
                x.k, x.v, _or(b, x.beta), x.beta, t_inv, w, wk, chunk_seq, chunk_start, x.cu, **dims, C=CHUNK,
                SB=SUB, HAS_G=b is not None, STORE_T=store_t, LOW=x.low, num_warps=config.num_warps)
    h = torch.empty(num_chunks, value_heads, k_dim, v_dim, **f32)
    ht = torch.empty(x.num_seqs, value_heads, k_dim, v_dim, **f32)
    grid = (x.num_seqs, value_heads, triton.cdiv(v_dim, config.block_v))
    for_device(chunk_state_kernel, device)[grid](
        x.k, x.v, _or(b, x.k), _or(w, x.v), _or(wk, x.k), _or(x.h0, ht), h, ht, x.cu, first_chunk, **dims, C=CHUNK,
        HAS_G=b is not None, HAS_H0=x.h0 is not None, DELTA=w is not None, LOW=x.low, num_warps=config.num_warps)
    return b, t_inv, _or(w, x.v), wk, h, ht, (chunk_seq, chunk_start, first_chunk, num_chunks)


def _or(t, placeholder):
    """``t``, or a tensor the kernel does not read in its place (a pointer argument is needed)."""
    return placeholder if t is None else t


def chunk_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """The chunked kernels' forward: ``(o [B, T, HV, V] in v's dtype, final states [N, HV, K, V]
    float32)``. Contract: ``torch_kernels.ops.linear_attention`` (``beta=None``: gated linear
    attention; ``g=None``: no decay)."""
    x = _setup(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm)
    tokens, _, value_heads, k_dim, v_dim = x.shape
    config = default_config(k_dim, v_dim)
    b, _, w, _, h, ht, (chunk_seq, chunk_start, _, num_chunks) = _chunk_recompute(x, config, store_t=False)
    o = torch.empty_like(x.v)
    if num_chunks:
        grid = (num_chunks, value_heads, triton.cdiv(v_dim, config.block_v))
        for_device(chunk_output_kernel, x.q.device)[grid](
            x.q, x.k, w, _or(b, x.k), h, o, chunk_seq, chunk_start, x.cu, scale, **x.constexprs(config), C=CHUNK,
            HAS_G=b is not None, LOW=x.low, num_warps=config.num_warps)
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
    return (dq.view(qk_shape), dk.view(qk_shape), dv.view(x.batch, x.length, value_heads, v_dim),
            None if dg is None else dg.view(gate_shape), None if dbeta is None else dbeta.view(gate_shape),
            dh0 if has_h0 else None)


def chunk_backward(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """The chunked kernels' backward: ``(dq, dk, dv, dg, dbeta, dh0)`` (float32; None for an absent
    ``g``, ``beta`` or ``initial_state``), chunk states recomputed from the inputs."""
    x = _setup(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm)
    tokens, _, value_heads, k_dim, v_dim = x.shape
    device = x.q.device
    config = default_config(k_dim, v_dim)
    dims = x.constexprs(config)
    delta = x.beta is not None
    b, t_inv, w, wk, h, _, (chunk_seq, chunk_start, first_chunk, num_chunks) = _chunk_recompute(x, config, True)
    do = do.reshape(tokens, value_heads, v_dim).contiguous()
    f32 = dict(dtype=torch.float32, device=device)
    dh = torch.empty(num_chunks, value_heads, k_dim, v_dim, **f32)
    dh0 = torch.empty(x.num_seqs, value_heads, k_dim, v_dim, **f32)
    dw = torch.empty(tokens, value_heads, v_dim, **f32)  # dW; dv itself for linear attention
    dht = None if dht is None else dht.float().contiguous()
    grid = (x.num_seqs, value_heads, triton.cdiv(v_dim, config.block_v))
    for_device(chunk_state_backward_kernel, device)[grid](
        x.q, x.k, _or(wk, x.k), _or(b, x.k), do, _or(dht, dh0), dh, dh0, dw, x.cu, first_chunk, scale, **dims,
        C=CHUNK, HAS_G=b is not None, HAS_DHT=dht is not None, DELTA=delta, LOW=x.low, num_warps=config.num_warps)
    dq = torch.empty(tokens, value_heads, k_dim, **f32)
    dk = torch.empty(tokens, value_heads, k_dim, **f32)
    dv = torch.empty(tokens, value_heads, v_dim, **f32) if delta else dw
    dbeta = torch.empty(tokens, value_heads, **f32) if delta else None
    dg = torch.empty(tokens, value_heads, **f32) if x.g is not None else None
    if num_chunks:
        for_device(chunk_grad_kernel, device)[(num_chunks, value_heads)](
            x.q, x.k, x.v, w, _or(b, x.k), _or(x.beta, x.k), _or(t_inv, x.k), h, dh, do, dw, dq, dk, dv,
            _or(dbeta, dq), _or(dg, dq), chunk_seq, chunk_start, x.cu, scale, **dims, C=CHUNK, HAS_G=b is not None,
            DELTA=delta, LOW=x.low, num_warps=config.num_warps)
    return _finish(x, dq, dk, dv, dg, dbeta, dh0, initial_state is not None)


def _recurrent_config(x: _Problem) -> Config:
    _, _, _, k_dim, v_dim = x.shape
    return default_config(k_dim, v_dim, recurrent=True, interpreted=x.q.device.type == "cpu")


def _recurrent(x: _Problem, config: Config, mode: int, scale: float, out=None, ht=None, do=None, dht=None,
               dv=None, dq=None, dk=None, db=None):
    tokens, _, value_heads, k_dim, v_dim = x.shape
    grid = (x.num_seqs, value_heads, triton.cdiv(v_dim, config.block_v))
    unread = x.v
    for_device(recurrent_kernel, x.q.device)[grid](
        x.q, x.k, x.v, _or(x.g, unread), _or(x.beta, unread), _or(x.h0, unread), _or(out, unread), ht,
        _or(do, unread), _or(dht, unread), _or(dv, unread), _or(dq, unread), _or(dk, unread), _or(db, unread), x.cu,
        scale, **x.constexprs(config), MODE=mode, HAS_G=x.g is not None, DELTA=x.beta is not None,
        HAS_H0=x.h0 is not None, HAS_DHT=dht is not None, num_warps=config.num_warps)


def recurrent_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """The step-by-step kernel's forward; contract as :func:`chunk_forward`."""
    x = _setup(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm)
    tokens, _, value_heads, k_dim, v_dim = x.shape
    o = torch.empty_like(x.v)
    ht = torch.empty(x.num_seqs, value_heads, k_dim, v_dim, dtype=torch.float32, device=x.q.device)
    _recurrent(x, _recurrent_config(x), 0, scale, out=o, ht=ht)
    return o.view(v.shape), ht


def recurrent_backward(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """The step-by-step kernels' backward (replay, backward walk, replay; module docstring);
    returns as :func:`chunk_backward`."""
    x = _setup(q, k, v, g, beta, initial_state, cu_seqlens, use_qk_l2norm)
    tokens, _, value_heads, k_dim, v_dim = x.shape
    device = x.q.device
    config = _recurrent_config(x)
    blocks = triton.cdiv(v_dim, config.block_v)
    delta = x.beta is not None
    f32 = dict(dtype=torch.float32, device=device)
    do = do.reshape(tokens, value_heads, v_dim).contiguous()
    dht = None if dht is None else dht.float().contiguous()
    ht = torch.empty(x.num_seqs, value_heads, k_dim, v_dim, **f32)  # written, not needed
    e = None
    if delta:
        e = torch.empty(tokens, value_heads, v_dim, **f32)
        _recurrent(x, config, 1, scale, out=e, ht=ht)
    dv = torch.empty(tokens, value_heads, v_dim, **f32)
    dk_write = torch.empty(blocks, tokens, value_heads, k_dim, **f32)
    db_write = torch.empty(blocks, tokens, value_heads, **f32)
    dbeta = torch.empty(blocks, tokens, value_heads, **f32) if delta else None
    dh0 = torch.empty(x.num_seqs, value_heads, k_dim, v_dim, **f32)
    for_device(recurrent_backward_kernel, device)[(x.num_seqs, value_heads, blocks)](
        x.q, x.k, x.v, _or(x.g, dv), _or(x.beta, dv), _or(e, dv), do, _or(dht, dh0), dv, dk_write, _or(dbeta, dv),
        db_write, dh0, x.cu, scale, **x.constexprs(config), HAS_G=x.g is not None, DELTA=delta,
        HAS_DHT=dht is not None, num_warps=config.num_warps)
    dq = torch.empty(blocks, tokens, value_heads, k_dim, **f32)
    dk_read = torch.empty(blocks, tokens, value_heads, k_dim, **f32) if delta else None
    db_read = torch.empty(blocks, tokens, value_heads, **f32)
    _recurrent(x, config, 2, scale, ht=ht, do=do, dht=dht, dv=dv, dq=dq, dk=dk_read, db=db_read)
    dk = dk_write.sum(0) if dk_read is None else dk_write.sum(0) + dk_read.sum(0)
    dg = None
    if x.g is not None:
        db = db_write.sum(0) + db_read.sum(0)
        dg = torch.empty_like(db)
        if tokens:
            for_device(reverse_cumsum_kernel, device)[(x.num_seqs, value_heads)](db, dg, x.cu, HV=value_heads,
                                                                                 C=CHUNK)
    return _finish(x, dq.sum(0), dk, dv, dg, None if dbeta is None else dbeta.sum(0), dh0, initial_state is not None)


_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_INDEX_POINTERS = ("cu_ptr", "chunk_seq_ptr", "chunk_start_ptr", "first_chunk_ptr")
_INPUT_POINTERS = ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "o_ptr")


def _signature(kernel, dtype: torch.dtype, constexprs: dict, out_type: str | None = None) -> dict:
    """Types of ``kernel``'s arguments: inputs in ``dtype``, indices int32, the rest float32."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in _INDEX_POINTERS:
            signature[name] = "*i32"
        elif name in _INPUT_POINTERS:
            signature[name] = "*" + _TRITON_TYPES[dtype]
        elif name == "out_ptr":
            signature[name] = out_type
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32"  # scale
    return signature


def compile_targets(dtype: torch.dtype, delta: bool = True, k_dim: int = 128, v_dim: int = 128, heads: int = 16,
                    value_heads: int = 32):
    """``[(name, kernel, signature, constexprs, num_warps, has_dots)]``: every kernel of one problem
    (Qwen3-Next-like head sizes by default) to build ahead of time for inputs of ``dtype``."""
    low = _low_precision(dtype, interpreted=False)
    chunk, rec = default_config(k_dim, v_dim), default_config(k_dim, v_dim, recurrent=True)
    shape = dict(H=heads, HV=value_heads, K=k_dim, V=v_dim, KP=_padded(k_dim))
    flags = dict(HAS_G=True, LOW=low)
    cases = [
        ("chunk_cumsum", chunk_cumsum_kernel, dict(HV=value_heads, HVP=triton.next_power_of_2(value_heads), C=CHUNK),
         chunk, False, None),
        ("chunk_state", chunk_state_kernel, dict(shape, BV=chunk.block_v, C=CHUNK, HAS_H0=True, DELTA=delta, **flags),
         chunk, True, None),
        ("chunk_output", chunk_output_kernel, dict(shape, BV=chunk.block_v, C=CHUNK, **flags), chunk, True, None),
        ("chunk_state_backward", chunk_state_backward_kernel,
         dict(shape, BV=chunk.block_v, C=CHUNK, HAS_DHT=True, DELTA=delta, **flags), chunk, True, None),
        ("chunk_grad", chunk_grad_kernel, dict(shape, BV=chunk.block_v, C=CHUNK, DELTA=delta, **flags), chunk, True,
         None),
        ("reverse_cumsum", reverse_cumsum_kernel, dict(HV=value_heads, C=CHUNK), chunk, False, None),
        ("recurrent_backward", recurrent_backward_kernel,
         dict(shape, BV=rec.block_v, HAS_G=True, DELTA=delta, HAS_DHT=True), rec, False, None),
    ]
    if delta:
        cases.append(("wy", wy_kernel, dict(shape, BV=chunk.block_v, C=CHUNK, SB=SUB, STORE_T=True, **flags), chunk,
                      True, None))
    for mode, out_type in ((0, "*" + _TRITON_TYPES[dtype]), (1, "*fp32"), (2, "*fp32")):
        if mode != 1 or delta:
            cases.append((f"recurrent_mode{mode}", recurrent_kernel,
                          dict(shape, BV=rec.block_v, MODE=mode, HAS_G=True, DELTA=delta, HAS_H0=True, HAS_DHT=True),
                          rec, False, out_type))
    return [(name, kernel, _signature(kernel, dtype, constexprs, out_type), constexprs, config.num_warps, dots)
            for name, kernel, constexprs, config, dots, out_type in cases]

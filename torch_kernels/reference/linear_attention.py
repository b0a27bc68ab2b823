"""Gated DeltaNet and gated linear attention in plain PyTorch.

One recurrence covers both, per value head, with state ``S [K, V]`` (float32):

- gated linear attention (``delta=False``): ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``;
- gated delta rule (``delta=True``): ``S_t = exp(g_t) S_{t-1}``, then
  ``S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T``;

where the decay ``g_t`` is one number per head (``g [B, T, HV]``) or one per key channel
(``g [B, T, HV, K]``, Kimi Delta Attention: ``S_t = diag(exp(g_t)) S_{t-1}``, each row of the
state decaying at its own rate). Inside, a per-head decay is the one-channel case ``[..., 1]``
that broadcasts over K, so both run through the same code.

and in both ``o_t = S_t^T (scale q_t)``. With grouped value heads (``HV = r H``) value head ``j``
reads query/key head ``j // r``. With ``cu_seqlens`` (``B = 1``) the rows of each packed sequence
run from that sequence's own initial state.

``recurrence_naive`` is the definition, a loop over time steps (the truth in tests).
``recurrence_chunked`` is the reference backend's kernel and the CPU default: chunks of
``chunk_size`` steps, inside which the delta rule's updates are folded into one triangular solve
(the WY form), so the Python loop runs over chunks, not steps. A per-channel decay takes shorter
chunks: its decayed products hold ``C x C x K`` factors per chunk, so their work grows with the
chunk length ``C`` (16 steps ran Kimi Linear's sizes about 10x faster than 64, forward and backward).

The chunked form, for a chunk with start state ``S0``, cumulative log decay ``b_t`` (``b_t =
g_1 + ... + g_t`` within the chunk, per channel for a per-channel decay) and
``D_tsc = exp(b_tc - b_sc)`` for ``s <= t``, with the decayed products
``P(X, Y)_ts = sum_c X_tc Y_sc D_tsc`` (``(X Y^T) * D`` for a per-head decay):

- the chunk's effective values ``W`` solve ``(I + diag(beta) strict_lower(P(K, K))) W =
  diag(beta) (V - (K * exp(b)) S0)`` (delta rule) or are ``V`` (linear attention);
- ``O = scale ((Q * exp(b)) S0 + P(Q, K) W)``;
- ``S_end = diag(exp(b_C)) S0 + (K * exp(b_C - b))^T W``.

Every exponent there is a sum of log decays over a span, so it is ``<= 0`` and no exp() can
overflow however strong the decay: ``D`` is summed over each span directly (``segment_sums``),
never formed as ``exp(b_t) * exp(-b_s)`` or from differences of cumulative sums.
"""

from __future__ import annotations

import torch

CHUNK_SIZE = 64  # with a per-head decay, whose decayed products are matrix products
PER_CHANNEL_CHUNK_SIZE = 16


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """States and accumulation are float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the ``use_qk_l2norm_in_kernel`` step)."""
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, use_qk_l2norm):
    """float32 copies with query/key heads repeated onto their value heads, and default gates."""
    dtype = compute_dtype(q.dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    repeats = v.shape[2] // q.shape[2]
    if repeats > 1:
        q, k = q.repeat_interleave(repeats, dim=2), k.repeat_interleave(repeats, dim=2)
    g = torch.zeros(v.shape[:3], dtype=dtype, device=v.device) if g is None else g.to(dtype)
    if g.dim() == 3:  # a per-head decay is the one-channel case
        g = g[..., None]
    beta = None if beta is None else beta.to(dtype)
    return q, k, v, g, beta


def _sequences(cu_seqlens, length: int):
    """(start, end) of each sequence: packed ones, or the whole time axis."""
    if cu_seqlens is None:
        return [(0, length)]
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _initial(initial_state, batch, num_heads, k_dim, v_dim, n, dtype, device):
    if initial_state is None:
        return torch.zeros(n, num_heads, k_dim, v_dim, dtype=dtype, device=device)
    return initial_state.to(dtype)


def recurrence_naive(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, use_qk_l2norm=False):
    """The definition, one time step at a time. ``beta=None`` is linear attention, else the delta
    rule; ``g`` is ``[B, T, HV]`` (per head) or ``[B, T, HV, K]`` (per key channel).
    Returns ``(o [B, T, HV, V] in v's dtype, final states [N, HV, K, V] float32)``."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    batch, length, num_heads, k_dim = k.shape
    v_dim = v.shape[-1]
    spans = _sequences(cu_seqlens, length)
    states = _initial(initial_state, batch, num_heads, k_dim, v_dim, len(spans) if cu_seqlens is not None else batch,
                      q.dtype, q.device)
    out = torch.zeros_like(v)
    finals = []
    for n, (start, end) in enumerate(spans):
        rows = slice(None) if cu_seqlens is None else slice(0, 1)
        state = (states if cu_seqlens is None else states[n:n + 1]).clone()  # [B, HV, K, V]
        for t in range(start, end):
            q_t, k_t, v_t = q[rows, t], k[rows, t], v[rows, t]  # [B, HV, K] / [B, HV, V]
            state = state * g[rows, t].exp()[..., None]  # [B, HV, K or 1, 1]: row c of S by exp(g_tc)
            if beta is not None:
                error = v_t - torch.einsum("bhkv,bhk->bhv", state, k_t)
                state = state + torch.einsum("bhk,bhv->bhkv", k_t, beta[rows, t][..., None] * error)
            else:
                state = state + torch.einsum("bhk,bhv->bhkv", k_t, v_t)
            out[rows, t] = torch.einsum("bhkv,bhk->bhv", state, scale * q_t)
        finals.append(state)
    return out.to(out_dtype), torch.cat(finals)


def segment_sums(g: torch.Tensor) -> torch.Tensor:
    """``seg[..., t, s, c] = g_{s+1,c} + ... + g_{t,c}`` for ``s <= t`` (0 on the diagonal), -inf
    above, from ``g [..., C, channels]``.

    Summed directly rather than as ``b_t - b_s`` of cumulative sums: those cancel in float32
    once gates grow large (g = -1e4 left the chunked forms ~1e-3 off) and give NaN for g = -inf,
    a full state reset.
    """
    steps = torch.arange(g.shape[-2], device=g.device)
    strictly_lower = (steps[:, None] > steps[None, :])[..., None]
    seg = torch.where(strictly_lower, g[..., :, None, :], 0.0).cumsum(dim=-3)
    lower = strictly_lower | torch.eye(len(steps), dtype=torch.bool, device=g.device)[..., None]
    return seg.masked_fill(~lower, float("-inf"))


def _decayed_products(x, y, decay):
    """``sum_c x_tc y_sc decay_tsc``: a matrix product for a per-head decay (one channel), an
    elementwise sum over K for a per-channel one (no decay factors out of it exactly)."""
    if decay.shape[-1] == 1:
        return (x @ y.transpose(-1, -2)) * decay[..., 0]
    return torch.einsum("...tc,...sc,...tsc->...ts", x, y, decay)


def _chunk(q, k, v, g, beta, scale, state):
    """One chunk of every (batch, head): inputs ``[B, HV, C, *]`` (``g [B, HV, C, K or 1]``),
    state ``[B, HV, K, V]``."""
    seg = segment_sums(g)  # [B, HV, C, C, K or 1]
    decay = seg.exp()  # exp(b_t - b_s) for s <= t, 0 above the diagonal
    start_decay = g.cumsum(dim=-2).exp()  # exp(b_t): from the chunk's start
    end_decay = seg[..., -1, :, :].exp()  # exp(b_C - b_t): to its end
    if beta is None:
        values = v
    else:
        k_beta = k * beta[..., None]
        system = torch.tril(_decayed_products(k_beta, k, decay), diagonal=-1)
        system = system + torch.eye(g.shape[-2], dtype=g.dtype, device=g.device)
        rhs = beta[..., None] * (v - (k * start_decay) @ state)
        values = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = scale * ((q * start_decay) @ state + _decayed_products(q, k, decay) @ values)
    state = g.sum(dim=-2).exp()[..., None] * state + (k * end_decay).transpose(-1, -2) @ values
    return out, state


def _chunked_span(q, k, v, g, beta, scale, state, chunk_size):
    """One span of equal-length sequences ``[B, L, HV, *]`` from ``state``; (out, final state)."""
    if q.shape[1] == 0:  # an empty packed sequence hands its state through
        return v, state
    heads_first = lambda x: None if x is None else x.transpose(1, 2)  # noqa: E731 - [B, HV, L, *]
    q, k, v, g, beta = map(heads_first, (q, k, v, g, beta))
    # split once rather than slice per chunk: the backward of a slice is a whole-size zero tensor
    chunks = [x.split(chunk_size, dim=2) for x in (q, k, v, g)]
    chunks.append([None] * len(chunks[0]) if beta is None else beta.split(chunk_size, dim=2))
    outs = []
    for q_c, k_c, v_c, g_c, beta_c in zip(*chunks):
        out, state = _chunk(q_c, k_c, v_c, g_c, beta_c, scale, state)
        outs.append(out)
    out = torch.cat(outs, dim=2)
    return out.transpose(1, 2), state


def recurrence_chunked(q, k, v, g, beta, scale, initial_state=None, cu_seqlens=None, use_qk_l2norm=False,
                       chunk_size=None):
    """The same numbers as ``recurrence_naive`` from chunks (module docstring); differentiable by
    autograd, which the reference backward uses. ``chunk_size``: by default ``CHUNK_SIZE`` for a
    per-head decay, ``PER_CHANNEL_CHUNK_SIZE`` for a per-channel one."""
    out_dtype = v.dtype
    if chunk_size is None:
        chunk_size = PER_CHANNEL_CHUNK_SIZE if g is not None and g.dim() == 4 else CHUNK_SIZE
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    batch, length, num_heads, k_dim = k.shape
    spans = _sequences(cu_seqlens, length)
    states = _initial(initial_state, batch, num_heads, k_dim, v.shape[-1],
                      len(spans) if cu_seqlens is not None else batch, q.dtype, q.device)
    if cu_seqlens is None:
        out, final = _chunked_span(q, k, v, g, beta, scale, states, chunk_size)
        return out.to(out_dtype), final
    lens = [end - start for start, end in spans]
    pieces = [x.split(lens, dim=1) for x in (q, k, v, g)]  # split, not slice: see _chunked_span
    pieces.append([None] * len(spans) if beta is None else beta.split(lens, dim=1))
    outs, finals = [], []
    for n, (q_n, k_n, v_n, g_n, beta_n) in enumerate(zip(*pieces)):
        out, final = _chunked_span(q_n, k_n, v_n, g_n, beta_n, scale, states[n:n + 1], chunk_size)
        outs.append(out)
        finals.append(final)
    return torch.cat(outs, dim=1).to(out_dtype), torch.cat(finals)

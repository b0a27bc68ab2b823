"""Causal depthwise conv1d in plain PyTorch: the reference backend's kernels and the CPU default.

Per channel ``c`` with filter ``w = weight[c]`` of width ``W``, over ``xx = cat(h0, x)`` (the
``W - 1`` inputs before the first, ``h0`` = ``initial_states`` or zeros)::

    out[t] = act(bias[c] + sum_k w[k] * xx[t + k])       (xx[t + W - 1] is x[t])

With ``seq_idx`` the input ``x[t - j]`` enters ``out[t]`` only where ``seq_idx[t - j] ==
seq_idx[t]``: packed sequences restart the convolution. Arithmetic in float32 (float64 for
float64 inputs); out in x's dtype. Without seq_idx this is torch's grouped ``conv1d`` (one group
per channel) of the padded input; with it, a loop over the ``W`` taps, not over time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def padded_input(x: torch.Tensor, width: int, initial_states: torch.Tensor | None) -> torch.Tensor:
    """``cat(initial_states or zeros, x)`` along time, in the compute dtype: ``[B, D, W - 1 + T]``."""
    wide = compute_dtype(x.dtype)
    if initial_states is None:
        return F.pad(x.to(wide), (width - 1, 0))
    return torch.cat([initial_states.to(wide), x.to(wide)], dim=-1)


def same_sequence(seq_idx: torch.Tensor, lag: int) -> torch.Tensor:
    """``[B, T]`` bool: ``seq_idx[t - lag] == seq_idx[t]`` (False where ``t < lag``)."""
    length = seq_idx.shape[-1]
    same = torch.zeros(seq_idx.shape, dtype=torch.bool, device=seq_idx.device)
    if lag < length:
        same[:, lag:] = seq_idx[:, lag:] == seq_idx[:, :length - lag]
    return same


def causal_conv1d(x, weight, bias, seq_idx, initial_states, silu: bool) -> torch.Tensor:
    """The forward: ``out [B, D, T]`` in x's dtype (see the module docstring)."""
    width, length = weight.shape[1], x.shape[-1]
    wide = compute_dtype(x.dtype)
    xx = padded_input(x, width, initial_states)
    w = weight.to(wide)
    b = None if bias is None else bias.to(wide)
    if seq_idx is None:  # a grouped convolution, one group per channel: torch's own kernel
        out = F.conv1d(xx, w[:, None, :], b, groups=x.shape[1])
    else:
        out = torch.zeros(x.shape, dtype=wide, device=x.device) if b is None else b[:, None].expand(x.shape).clone()
        for k in range(width):  # tap k reads x[t - (W - 1 - k)], zero across a sequence boundary
            out += w[:, k, None] * xx[..., k:k + length] * same_sequence(seq_idx, width - 1 - k)[:, None, :]
    if silu:
        out = F.silu(out)
    return out.to(x.dtype)


def state_lines(conv_state: torch.Tensor, batch: int, conv_state_indices: torch.Tensor | None) -> torch.Tensor:
    """int64 ``[B]``: the conv_state row each batch entry uses (negative: a padding entry)."""
    if conv_state_indices is None:
        return torch.arange(batch, device=conv_state.device)
    return conv_state_indices.to(torch.int64)


def history_positions(state_len: int, width: int, batch: int, cache_seqlens, device) -> torch.Tensor:
    """int64 ``[B, W - 1]``: where in its state row each entry's last ``W - 1`` inputs lie, oldest
    first (the row's end, or the ring positions before ``cache_seqlens % state_len``)."""
    taps = torch.arange(-(width - 1), 0, device=device)
    if cache_seqlens is None:
        return (state_len + taps).expand(batch, -1)
    return torch.remainder(cache_seqlens.to(torch.int64)[:, None] + taps, state_len)


def causal_conv1d_update(x, conv_state, weight, bias, silu: bool, cache_seqlens, conv_state_indices) -> torch.Tensor:
    """One decode step (or a few): ``x [B, D, L]``; ``conv_state [N, D, S]`` written in place.

    Entry ``b`` uses row ``r = conv_state_indices[b]`` (or ``b``); a negative ``r`` is padding:
    its out is zeros and no row changes. The last ``W - 1`` inputs before ``x`` come from the row
    (its end, or with ``cache_seqlens`` the ring positions ``(p - W + 1 .. p - 1) % S``, ``p =
    cache_seqlens[b]``); then the row takes ``x``: shifted left by ``L``, or with ``cache_seqlens``
    written at ``(p + l) % S`` (the last ``S`` of them when ``L > S``).
    """
    batch, dim, length = x.shape
    width, state_len = weight.shape[1], conv_state.shape[-1]
    if cache_seqlens is None and conv_state_indices is None:  # every row, shifted: no gathers
        out = causal_conv1d(x, weight, bias, None, conv_state[..., state_len - width + 1:], silu)
        conv_state.copy_(torch.cat([conv_state, x], dim=-1)[..., -state_len:])
        return out
    lines = state_lines(conv_state, batch, conv_state_indices)
    live = (lines >= 0).nonzero().flatten()
    out = torch.zeros_like(x)
    if live.numel() == 0:
        return out
    rows, xs = lines[live], x[live]
    seqlens = None if cache_seqlens is None else cache_seqlens[live]
    positions = history_positions(state_len, width, live.numel(), seqlens, x.device)
    history = conv_state[rows].gather(2, positions[:, None, :].expand(-1, dim, -1))
    out[live] = causal_conv1d(xs, weight, bias, None, history, silu)
    if cache_seqlens is None:
        conv_state[rows] = torch.cat([conv_state[rows], xs], dim=-1)[..., -state_len:]
    else:
        kept = min(length, state_len)  # later inputs overwrite earlier ones on the same ring position
        steps = torch.arange(length - kept, length, device=x.device)
        ring = torch.remainder(seqlens.to(torch.int64)[:, None] + steps, state_len)
        updated = conv_state[rows]
        updated.scatter_(2, ring[:, None, :].expand(-1, dim, -1), xs[..., length - kept:])
        conv_state[rows] = updated
    return out

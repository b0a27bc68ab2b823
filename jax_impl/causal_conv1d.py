"""Causal depthwise conv1d in JAX: a Pallas kernel for the convolution, differentiable through a
``jax.custom_vjp`` whose backward runs the same kernel, and the decode update around it.

The kernel takes the input already padded on the left with the ``W - 1`` earlier inputs
(``xx = cat(h0, x)``), one block of channels and the whole time axis per program, and sums the
``W`` shifted taps in float32 (``masks[k]`` zeroes tap ``k`` across packed-sequence boundaries).
Time is not tiled: a block holds ``T + W - 1`` steps of its channels.

The backward (as in ``torch_kernels.ops.causal_conv1d``): the input gradient is the convolution
of the output gradient padded with ``W - 1`` zeros at the end with the filter reversed (its first
``W - 1`` steps are the initial states' gradient); with sequence ids it is the convolution of the
time-reversed gradient with the filter as is. The filter and bias gradients are sums over batch
and time. ``causal_conv1d_reference`` is the same math in plain ``jnp`` (autodiff for gradients).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import interpret_params, round_up

BLOCK_CHANNELS = 128


def same_sequence_masks(seq_idx, width: int):
    """float32 ``[W, B, T]``: 1 where tap ``k``'s input ``t - (W - 1 - k)`` is in ``t``'s sequence."""
    length = seq_idx.shape[-1]
    masks = []
    for k in range(width):
        lag = width - 1 - k
        earlier = jnp.pad(seq_idx, ((0, 0), (lag, 0)), constant_values=-1)[:, :length]
        same = (earlier == seq_idx) & (jnp.arange(length) >= lag)
        masks.append(same.astype(jnp.float32))
    return jnp.stack(masks)


def _conv_kernel(xx_ref, w_ref, b_ref, *refs, width: int, length: int, silu: bool, masked: bool):
    out_ref = refs[-1]
    xx = xx_ref[0].astype(jnp.float32)
    w = w_ref[...].astype(jnp.float32)
    acc = jnp.broadcast_to(b_ref[...].astype(jnp.float32), (xx.shape[0], length))
    for k in range(width):
        term = w[:, k:k + 1] * xx[:, k:k + length]
        if masked:
            term = term * refs[0][k]
        acc = acc + term
    if silu:
        acc = acc * jax.nn.sigmoid(acc)
    out_ref[0] = acc.astype(out_ref.dtype)


def conv_padded(xx, weight, bias, masks, silu: bool, out_dtype, interpret=None):
    """The Pallas convolution of a left-padded input ``xx [B, D, T + W - 1]``: ``[B, D, T]``.
    ``bias [D]``; ``masks`` ``[W, B, T]`` or None."""
    batch, dim, padded = xx.shape
    width = weight.shape[1]
    length = padded - width + 1
    block = min(BLOCK_CHANNELS, round_up(dim, 8))
    channels = round_up(dim, block)
    extra = channels - dim
    xx = jnp.pad(xx, ((0, 0), (0, extra), (0, 0)))
    weight = jnp.pad(weight, ((0, extra), (0, 0)))
    bias = jnp.pad(bias, (0, extra))[:, None]
    inputs = [xx, weight, bias]
    in_specs = [pl.BlockSpec((1, block, padded), lambda b, d: (b, d, 0)),
                pl.BlockSpec((block, width), lambda b, d: (d, 0)),
                pl.BlockSpec((block, 1), lambda b, d: (d, 0))]
    if masks is not None:
        inputs.append(masks[:, :, None, :])  # [W, B, 1, T]: one row broadcast over the block's channels
        in_specs.append(pl.BlockSpec((width, None, 1, length), lambda b, d: (0, b, 0, 0)))
    out = pl.pallas_call(
        functools.partial(_conv_kernel, width=width, length=length, silu=silu, masked=masks is not None),
        grid=(batch, channels // block),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((1, block, length), lambda b, d: (b, d, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, channels, length), out_dtype),
        interpret=interpret_params(interpret),
    )(*inputs)
    return out[:, :dim]


def _padded(x, h0):
    return jnp.concatenate([h0.astype(jnp.float32), x.astype(jnp.float32)], axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _conv(x, weight, bias, h0, masks, silu, interpret):
    return conv_padded(_padded(x, h0), weight, bias, None if masks is None else masks[0], silu, x.dtype, interpret)


def _conv_fwd(x, weight, bias, h0, masks, silu, interpret):
    return _conv(x, weight, bias, h0, masks, silu, interpret), (x, weight, bias, h0, masks)


def _conv_bwd(silu, interpret, residuals, dout):
    x, weight, bias, h0, masks = residuals
    width, length = weight.shape[1], x.shape[-1]
    xx = _padded(x, h0)
    g = dout.astype(jnp.float32)
    if silu:
        pre = conv_padded(xx, weight, bias, None if masks is None else masks[0], False, jnp.float32, interpret)
        sigmoid = jax.nn.sigmoid(pre)
        g = g * sigmoid * (1 + pre * (1 - sigmoid))
    no_bias = jnp.zeros_like(bias, dtype=jnp.float32)
    if masks is None:
        dxx = conv_padded(jnp.pad(g, ((0, 0), (0, 0), (width - 1, width - 1))), weight[:, ::-1], no_bias, None, False,
                          jnp.float32, interpret)
        dx, dh0 = dxx[..., width - 1:], dxx[..., :width - 1]
    else:
        dx = conv_padded(jnp.pad(g[..., ::-1], ((0, 0), (0, 0), (width - 1, 0))), weight, no_bias, masks[1], False,
                         jnp.float32, interpret)[..., ::-1]
        dh0 = jnp.zeros(h0.shape, jnp.float32)
    taps = []
    for k in range(width):
        product = g * xx[..., k:k + length]
        if masks is not None:
            product = product * masks[0][k][:, None, :]
        taps.append(product.sum((0, 2)))
    dmasks = None if masks is None else jax.tree.map(jnp.zeros_like, masks)
    return (dx.astype(x.dtype), jnp.stack(taps, 1).astype(weight.dtype), g.sum((0, 2)).astype(bias.dtype),
            dh0.astype(h0.dtype), dmasks)


_conv.defvjp(_conv_fwd, _conv_bwd)


def _filled(x, weight, bias, initial_states):
    """bias and initial states as arrays (zeros when absent)."""
    dim, width = weight.shape
    bias = jnp.zeros((dim,), jnp.float32) if bias is None else bias
    h0 = jnp.zeros((x.shape[0], dim, width - 1), x.dtype) if initial_states is None else initial_states
    return bias, h0


def causal_conv1d(x, weight, bias=None, seq_idx=None, initial_states=None, silu=False, interpret=None):
    """``out [B, D, T]`` in x's dtype of ``x [B, D, T]``, ``weight [D, W]``, ``bias [D]``,
    ``seq_idx [B, T]`` (int), ``initial_states [B, D, W - 1]`` (see ``torch_kernels.reference.
    causal_conv1d``); differentiable in x, weight, bias and initial_states."""
    bias, h0 = _filled(x, weight, bias, initial_states)
    masks = None
    if seq_idx is not None:
        width = weight.shape[1]
        masks = (same_sequence_masks(seq_idx, width), same_sequence_masks(seq_idx[:, ::-1], width))
    return _conv(x, weight, bias, h0, masks, bool(silu), interpret)


def causal_conv1d_reference(x, weight, bias=None, seq_idx=None, initial_states=None, silu=False):
    """The same in plain ``jnp``, a sum of shifted taps."""
    bias, h0 = _filled(x, weight, bias, initial_states)
    width, length = weight.shape[1], x.shape[-1]
    xx = _padded(x, h0)
    masks = None if seq_idx is None else same_sequence_masks(seq_idx, width)
    out = jnp.broadcast_to(bias.astype(jnp.float32)[:, None], x.shape)
    for k in range(width):
        term = weight[:, k:k + 1].astype(jnp.float32) * xx[..., k:k + length]
        out = out + (term if masks is None else term * masks[k][:, None, :])
    if silu:
        out = out * jax.nn.sigmoid(out)
    return out.astype(x.dtype)


def _update(convolve, x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices):
    """``(out, new conv_state)`` of the decode update with ``convolve`` for the convolution (see
    ``torch_kernels.reference.causal_conv1d.causal_conv1d_update``); padding entries write nothing."""
    batch, dim, length = x.shape
    lines_total, _, state_len = conv_state.shape
    width = weight.shape[1]
    lines = jnp.arange(batch) if conv_state_indices is None else conv_state_indices.astype(jnp.int32)
    live = lines >= 0
    rows = conv_state[jnp.where(live, lines, 0)]
    taps = jnp.arange(-(width - 1), 0)
    if cache_seqlens is None:
        history = rows[..., state_len - width + 1:]
    else:
        # the ring position first: the count plus the new steps may pass int32's range
        start = jnp.remainder(cache_seqlens.astype(jnp.int32), state_len)
        positions = jnp.remainder(start[:, None] + taps, state_len)
        history = jnp.take_along_axis(rows, positions[:, None, :], axis=2)
    out = convolve(x, weight, bias, None, history, silu)
    out = jnp.where(live[:, None, None], out, jnp.zeros_like(out))
    if cache_seqlens is None:
        new_rows = jnp.concatenate([rows, x], axis=-1)[..., -state_len:]
    else:
        kept = min(length, state_len)  # later inputs overwrite earlier ones on the same ring position
        steps = jnp.arange(length - kept, length)

        def write(row, new, first):
            return row.at[:, jnp.remainder(first + steps, state_len)].set(new[:, length - kept:])

        new_rows = jax.vmap(write)(rows, x, start)
    # padding entries point past the last row, and "drop" leaves them out
    targets = jnp.where(live, lines, lines_total)
    return out, conv_state.at[targets].set(new_rows.astype(conv_state.dtype), mode="drop")


def causal_conv1d_update(x, conv_state, weight, bias=None, silu=False, cache_seqlens=None, conv_state_indices=None,
                         interpret=None):
    """The decode update with the Pallas convolution: ``(out [B, D, L], new conv_state)``."""
    def convolve(x, weight, bias, seq_idx, h0, silu):
        return causal_conv1d(x, weight, bias, seq_idx, h0, silu, interpret)

    return _update(convolve, x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices)


def causal_conv1d_update_reference(x, conv_state, weight, bias=None, silu=False, cache_seqlens=None,
                                   conv_state_indices=None):
    """The decode update in plain ``jnp``."""
    return _update(causal_conv1d_reference, x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices)

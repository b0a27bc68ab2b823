"""Mamba-2's decode step in JAX: ``selective_state_update`` as a Pallas kernel, and the same math
in plain ``jnp`` (``selective_state_update_reference``).

The rows the batch uses are gathered first (a padding entry, negative row, reads row 0 and is
dropped after), then a program per (batch entry, head) decays its ``[headdim, dstate]`` state
tile, adds the input and reduces against C over dstate, in float32; the new rows are scattered
back with ``mode="drop"`` so that padding entries write nothing. B and C arrive expanded from
groups to heads, dt, D and dt_bias as full ``[.., headdim]`` arrays (zeros for none: both are
identities), so the kernel has one form but the gate's and softplus's flags.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import interpret_params


def _update_kernel(s_ref, x_ref, dt_ref, a_ref, b_ref, c_ref, d_ref, z_ref, bias_ref, s_out, y_out, *,
                   softplus: bool, gated: bool):
    d = dt_ref[0, 0].astype(jnp.float32) + bias_ref[0].astype(jnp.float32)  # [1, P]
    if softplus:
        d = jnp.where(d <= 20.0, jnp.log1p(jnp.exp(jnp.minimum(d, 20.0))), d)
    d = d.T  # [P, 1]
    x = x_ref[0, 0].astype(jnp.float32).T
    s = s_ref[0, 0].astype(jnp.float32)  # [P, N]
    s = s * jnp.exp(d * a_ref[0].astype(jnp.float32)) + (d * x) * b_ref[0, 0].astype(jnp.float32)
    s_out[0, 0] = s.astype(s_out.dtype)
    y = jnp.sum(s * c_ref[0, 0].astype(jnp.float32), axis=1, keepdims=True) + d_ref[0].astype(jnp.float32).T * x
    if gated:
        zz = z_ref[0, 0].astype(jnp.float32).T
        y = y * zz * jax.nn.sigmoid(zz)
    y_out[0, 0] = y.T.astype(y_out.dtype)


def _prepared(state, x, dt, A, B, C, D, z, dt_bias, rows):
    batch, heads, headdim = x.shape
    lines = jnp.arange(batch, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
    live = lines >= 0
    repeat = heads // B.shape[1]
    zeros = jnp.zeros((heads, headdim), jnp.float32)
    return (lines, live, state[jnp.where(live, lines, 0)], jnp.repeat(B, repeat, axis=1),
            jnp.repeat(C, repeat, axis=1), zeros if D is None else D, zeros if dt_bias is None else dt_bias)


def _finish(state, lines, live, new_rows, out):
    out = jnp.where(live[:, None, None], out, jnp.zeros_like(out))
    targets = jnp.where(live, lines, state.shape[0])  # padding entries point past the last row: dropped
    return out, state.at[targets].set(new_rows.astype(state.dtype), mode="drop")


@functools.partial(jax.jit, static_argnames=("softplus", "interpret"))
def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, softplus=False, rows=None,
                           interpret=None):
    """``(out [Bt, H, P], new state)`` of one decode step (see ``torch_kernels.reference.mamba2``),
    the state math in a Pallas kernel; jitted (a decode loop calls it again and again on one shape)."""
    batch, heads, headdim = x.shape
    dstate = B.shape[-1]
    lines, live, old, Bh, Ch, D, dt_bias = _prepared(state, x, dt, A, B, C, D, z, dt_bias, rows)
    per_channel = lambda t: t.reshape(batch, heads, 1, headdim)  # noqa: E731 - one reshape, four inputs
    channel_spec = pl.BlockSpec((1, 1, 1, headdim), lambda b, h: (b, h, 0, 0))
    state_spec = pl.BlockSpec((1, 1, headdim, dstate), lambda b, h: (b, h, 0, 0))
    group_spec = pl.BlockSpec((1, 1, 1, dstate), lambda b, h: (b, h, 0, 0))
    head_spec = pl.BlockSpec((1, 1, headdim), lambda b, h: (h, 0, 0))
    new_rows, out = pl.pallas_call(
        functools.partial(_update_kernel, softplus=bool(softplus), gated=z is not None),
        grid=(batch, heads),
        in_specs=[state_spec, channel_spec, channel_spec, pl.BlockSpec((1, headdim, dstate), lambda b, h: (h, 0, 0)),
                  group_spec, group_spec, head_spec, channel_spec, head_spec],
        out_specs=[state_spec, channel_spec],
        out_shape=[jax.ShapeDtypeStruct(old.shape, jnp.float32),
                   jax.ShapeDtypeStruct((batch, heads, 1, headdim), x.dtype)],
        interpret=interpret_params(interpret),
    )(old, per_channel(x), per_channel(dt), A, Bh[:, :, None, :], Ch[:, :, None, :], D[:, None, :],
      per_channel(x if z is None else z), dt_bias[:, None, :])
    return _finish(state, lines, live, new_rows, out.reshape(x.shape))


@functools.partial(jax.jit, static_argnames=("softplus",))
def selective_state_update_reference(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, softplus=False,
                                     rows=None):
    """The decode step in plain ``jnp``: ``(out, new state)``."""
    lines, live, old, Bh, Ch, D, dt_bias = _prepared(state, x, dt, A, B, C, D, z, dt_bias, rows)
    d = dt.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    if softplus:
        d = jax.nn.softplus(d)
    xs = x.astype(jnp.float32)
    new = old.astype(jnp.float32) * jnp.exp(d[..., None] * A.astype(jnp.float32)) \
        + (d * xs)[..., None] * Bh.astype(jnp.float32)[:, :, None, :]
    out = jnp.sum(new * Ch.astype(jnp.float32)[:, :, None, :], axis=-1) + D.astype(jnp.float32) * xs
    if z is not None:
        out = out * jax.nn.silu(z.astype(jnp.float32))
    return _finish(state, lines, live, new, out.astype(x.dtype))

"""Causal depthwise conv1d as Triton kernels: the convolution over a whole sequence and the decode update.

Contract: ``torch_kernels.ops.causal_conv1d`` (the backend functions) and
``torch_kernels.reference.causal_conv1d`` (the math). Both kernels widen every load to float32
(the interpreter's bfloat16 arithmetic is wrong, and the sums want it anyway).

- ``causal_conv1d_fwd_kernel``: a program per (time block, channel block, batch entry) over
  ``x [B, D, T]`` with any strides (contiguous, or channel-last as a transposed ``[B, T, D]``
  projection, which models pass, read in place); the ``W`` taps are unrolled,
  each a shifted load, the shift reaching into ``initial_states`` before ``t = 0`` and masked by
  ``seq_idx`` across sequence boundaries. The backward runs this kernel too (see the ops module).
- ``causal_conv1d_update_kernel``: a program per (batch entry, channel block); it reads the
  entry's window from its conv_state row (its end, or ring positions with ``cache_seqlens``), then
  after a barrier writes the new inputs into the row. Padding entries (negative row) read and
  write no row.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from . import for_device

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclasses.dataclass(frozen=True)
class Config:
    """Channels and time steps per program, and warps."""

    block_d: int = 4
    block_t: int = 256
    num_warps: int = 4


def default_config(length: int, channel_last: bool = False) -> Config:
    """Up to 256 steps of 4 channels per program: 8 elements per thread at 4 warps (16 per thread
    spill on sm_90: the W shifted tiles are live together). Channel-last x: 64 channels of 16
    steps, so that loads run along its contiguous channels."""
    if channel_last:
        return Config(block_d=64, block_t=16)
    return Config(block_t=max(16, min(256, triton.next_power_of_2(length))))


@triton.jit
def _silu(v):
    return v / (1.0 + tl.exp(-v))


@triton.jit
def causal_conv1d_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, seq_ptr, h0_ptr, out_ptr, D, T, stride_x_batch, stride_x_ch, stride_x_t,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, HAS_H0: tl.constexpr,
    SILU: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    first = tl.program_id(1) * BLOCK_D
    ch = first + tl.arange(0, BLOCK_D)
    b = tl.program_id(2).to(tl.int64)
    t_in, ch_in = t < T, ch < D
    # 64-bit bases per program, 32-bit offsets per element (half the registers of 64-bit ones);
    # x may be channel-last (a transposed [B, T, D] projection, as models pass it)
    row0 = b * D + first
    local = tl.arange(0, BLOCK_D)[:, None] * T
    x_base = x_ptr + b * stride_x_batch + first.to(tl.int64) * stride_x_ch
    x_local = tl.arange(0, BLOCK_D)[:, None] * stride_x_ch
    inside = ch_in[:, None] & t_in[None, :]
    acc = tl.zeros((BLOCK_D, BLOCK_T), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=ch_in, other=0.0).to(tl.float32)[:, None]
    if HAS_SEQ:
        own = tl.load(seq_ptr + b * T + t, mask=t_in, other=0)
    for k in tl.static_range(WIDTH):
        src = t - (WIDTH - 1 - k)  # tap k reads x[t - (W - 1 - k)]
        w = tl.load(w_ptr + ch * WIDTH + k, mask=ch_in, other=0.0).to(tl.float32)
        value = tl.load(x_base + (x_local + src[None, :] * stride_x_t), mask=inside & (src >= 0)[None, :],
                        other=0.0).to(tl.float32)
        if HAS_H0:  # positions before the first input come from the initial states
            if tl.program_id(0) == 0:
                value += tl.load(h0_ptr + row0 * (WIDTH - 1) + (tl.arange(0, BLOCK_D)[:, None] * (WIDTH - 1)
                                                                 + (src + WIDTH - 1)[None, :]),
                                 mask=inside & (src < 0)[None, :], other=0.0).to(tl.float32)
        if HAS_SEQ:
            other = tl.load(seq_ptr + b * T + src, mask=t_in & (src >= 0), other=0)
            value = tl.where((other == own)[None, :], value, 0.0)
        acc += w[:, None] * value
    if SILU:
        acc = _silu(acc)
    tl.store(out_ptr + row0 * T + (local + t[None, :]), acc.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def causal_conv1d_update_kernel(
    x_ptr, state_ptr, w_ptr, bias_ptr, seqlens_ptr, rows_ptr, out_ptr, D, L, S,
    stride_state_row, stride_state_ch, stride_state_pos,
    WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, CIRCULAR: tl.constexpr, HAS_ROWS: tl.constexpr,
    SILU: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ch_in = ch < D
    step = tl.arange(0, BLOCK_L)
    step_in = step < L
    if HAS_ROWS:
        row = tl.load(rows_ptr + b).to(tl.int64)
    else:
        row = b
    # a negative row is a padding entry: no state is read or written (per channel, as masks want vectors)
    live = ch_in & ((tl.zeros((BLOCK_D,), dtype=tl.int64) + row) >= 0)
    row = tl.maximum(row, 0)
    if CIRCULAR:
        start = tl.load(seqlens_ptr + b) % S
    else:
        start = 0
    x_rows = x_ptr + (b * D + ch)[:, None] * L
    state_rows = state_ptr + row * stride_state_row + ch[:, None].to(tl.int64) * stride_state_ch
    inside = live[:, None] & step_in[None, :]
    acc = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=ch_in, other=0.0).to(tl.float32)[:, None]
    for k in tl.static_range(WIDTH):
        src = step - (WIDTH - 1 - k)  # < 0: the input -src steps before x, from the state row
        w = tl.load(w_ptr + ch * WIDTH + k, mask=ch_in, other=0.0).to(tl.float32)
        value = tl.load(x_rows + src[None, :], mask=inside & (src >= 0)[None, :], other=0.0).to(tl.float32)
        if CIRCULAR:
            position = (start + src + S) % S
        else:
            position = S + src
        value += tl.load(state_rows + position[None, :] * stride_state_pos, mask=inside & (src < 0)[None, :],
                         other=0.0).to(tl.float32)
        acc += w[:, None] * value
    if SILU:
        acc = _silu(acc)
    tl.store(out_ptr + (b * D + ch)[:, None] * L + step[None, :], tl.where(live[:, None], acc, 0.0).to(out_ptr.dtype.element_ty),
             mask=ch_in[:, None] & step_in[None, :])
    if CIRCULAR:
        # inputs written at ring positions start + l; only the last S of them survive
        kept = step_in & (step >= L - S)
        new = tl.load(x_rows + step[None, :], mask=inside & kept[None, :], other=0.0).to(tl.float32)
        tl.debug_barrier()  # every window read above precedes the writes
        tl.store(state_rows + ((start + step) % S)[None, :] * stride_state_pos,
                 new.to(state_ptr.dtype.element_ty), mask=inside & kept[None, :])
    else:
        # the row shifted left by L: position s takes old s + L, or x[s + L - S] past the row's end
        pos = tl.arange(0, BLOCK_S)
        src = pos + L
        keep = live[:, None] & (pos < S)[None, :]
        old = tl.load(state_rows + src[None, :] * stride_state_pos, mask=keep & (src < S)[None, :],
                      other=0.0).to(tl.float32)
        new = tl.load(x_rows + (src - S)[None, :], mask=keep & (src >= S)[None, :], other=0.0).to(tl.float32)
        tl.debug_barrier()  # every read of the row precedes the writes
        tl.store(state_rows + pos[None, :] * stride_state_pos, (old + new).to(state_ptr.dtype.element_ty), mask=keep)


def _supported(x: torch.Tensor) -> None:
    if x.dtype not in _TYPES:
        raise NotImplementedError(f"triton: {x.dtype} inputs are not supported (float32, float16, bfloat16)")


def causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, silu, config: Config | None = None):
    """The convolution on CUDA/XPU tensors, or interpreted on CPU tensors."""
    _supported(x)
    batch, dim, length = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if max(abs(s) for s in x.stride()[1:]) * max(dim, length) >= 2**31:  # beyond the kernel's 32-bit offsets
        x = x.contiguous()
    config = config or default_config(length, channel_last=x.stride(1) == 1 and dim > 1)
    grid = (triton.cdiv(length, config.block_t), triton.cdiv(dim, config.block_d), batch)
    for_device(causal_conv1d_fwd_kernel, x.device)[grid](
        x, weight, x if bias is None else bias, x if seq_idx is None else seq_idx,
        x if initial_states is None else initial_states, out, dim, length, *x.stride(),
        WIDTH=weight.shape[1], HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None,
        HAS_H0=initial_states is not None, SILU=silu, BLOCK_D=config.block_d, BLOCK_T=config.block_t,
        num_warps=config.num_warps,
    )
    return out


UPDATE_BLOCK_D = 64


def causal_conv1d_update(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices):
    """The decode update on CUDA/XPU tensors, or interpreted on CPU tensors; writes ``conv_state``."""
    _supported(x)
    batch, dim, steps = x.shape
    out = torch.empty_like(x)
    if out.numel() == 0:
        return out
    state_len = conv_state.shape[2]
    grid = (batch, triton.cdiv(dim, UPDATE_BLOCK_D))
    for_device(causal_conv1d_update_kernel, x.device)[grid](
        x, conv_state, weight, x if bias is None else bias, x if cache_seqlens is None else cache_seqlens,
        x if conv_state_indices is None else conv_state_indices, out, dim, steps, state_len, *conv_state.stride(),
        WIDTH=weight.shape[1], HAS_BIAS=bias is not None, CIRCULAR=cache_seqlens is not None,
        HAS_ROWS=conv_state_indices is not None, SILU=silu, BLOCK_D=UPDATE_BLOCK_D,
        BLOCK_L=max(2, triton.next_power_of_2(steps)), BLOCK_S=max(2, triton.next_power_of_2(state_len)),
        num_warps=4,
    )
    return out


def compile_targets(dtype: torch.dtype, width: int = 4):
    """[(label, kernel, signature, constexprs, num_warps)] of both kernels for ``dtype`` inputs and a
    float32 filter: the forward with bias and SiLU, with initial states, with seq_idx and in the
    channel-last tiles (the backward's runs have neither bias nor activation), and one-step decode,
    plain and ring."""
    x_type = "*" + _TYPES[dtype]
    targets = []
    for variant, flags, config in (
            ("h0", dict(HAS_H0=True, HAS_SEQ=False, HAS_BIAS=True, SILU=True), default_config(4096)),
            ("seq_idx", dict(HAS_H0=False, HAS_SEQ=True, HAS_BIAS=True, SILU=True), default_config(4096)),
            ("channel-last", dict(HAS_H0=False, HAS_SEQ=False, HAS_BIAS=True, SILU=True),
             default_config(4096, channel_last=True)),
            ("backward", dict(HAS_H0=False, HAS_SEQ=False, HAS_BIAS=False, SILU=False), default_config(4096))):
        signature = {"x_ptr": x_type, "w_ptr": "*fp32", "bias_ptr": "*fp32", "seq_ptr": "*i32", "h0_ptr": x_type,
                     "out_ptr": x_type, "D": "i32", "T": "i32", "stride_x_batch": "i64", "stride_x_ch": "i32",
                     "stride_x_t": "i32"}
        signature.update(dict.fromkeys(("WIDTH", "HAS_BIAS", "HAS_SEQ", "HAS_H0", "SILU", "BLOCK_D", "BLOCK_T"),
                                       "constexpr"))
        constexprs = dict(WIDTH=width, BLOCK_D=config.block_d, BLOCK_T=config.block_t, **flags)
        targets.append((f"fwd {variant}", causal_conv1d_fwd_kernel, signature, constexprs, config.num_warps))
    for circular in (False, True):
        signature = {"x_ptr": x_type, "state_ptr": x_type, "w_ptr": "*fp32", "bias_ptr": "*fp32",
                     "seqlens_ptr": "*i32", "rows_ptr": "*i32", "out_ptr": x_type, "D": "i32", "L": "i32", "S": "i32",
                     "stride_state_row": "i32", "stride_state_ch": "i32", "stride_state_pos": "i32"}
        signature.update(dict.fromkeys(("WIDTH", "HAS_BIAS", "CIRCULAR", "HAS_ROWS", "SILU", "BLOCK_D", "BLOCK_L",
                                        "BLOCK_S"), "constexpr"))
        constexprs = dict(WIDTH=width, HAS_BIAS=True, CIRCULAR=circular, HAS_ROWS=True, SILU=True,
                          BLOCK_D=UPDATE_BLOCK_D, BLOCK_L=2, BLOCK_S=4)
        targets.append((f"update {'ring' if circular else 'shift'}", causal_conv1d_update_kernel, signature,
                        constexprs, 4))
    return targets


def compile_groups(everything: bool) -> dict:
    """The compile report's builds of this family: ``{group id: function of an arch returning its
    builds}``, a build being ``compile_report.Build``'s fields but ``family``. One group at width 4:
    by default every kernel in bfloat16 and the backward's float32 run (the share CI builds; float16
    compiles as bfloat16 does); ``everything``: every kernel for every dtype."""
    from . import dtype_name

    def builds(arch: int = 90) -> list[dict]:
        return [dict(label=f"causal_conv1d {label} {dtype_name(dtype)} W=4", kernel=kernel, signature=signature,
                     constexprs=constexprs, num_warps=num_warps, num_stages=None)
                for dtype in _TYPES for label, kernel, signature, constexprs, num_warps in compile_targets(dtype)
                if everything or dtype == torch.bfloat16 or (dtype == torch.float32 and label == "fwd backward")]

    return {"causal_conv1d": builds}

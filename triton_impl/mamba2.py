"""Mamba-2's decode step as a Triton kernel: ``selective_state_update``.

Contract: ``torch_kernels.ops.mamba2`` (the backend function) and ``torch_kernels.reference.mamba2``
(the math). The chunked scan has no kernel here: it runs ``chunk_simple_gla``'s.

``selective_state_update_kernel``: a program per (batch entry, head, block of head channels); it
loads the entry's ``[BLOCK_P, dstate]`` tile of its state row, decays it and adds the input
(an elementwise map), stores it, and reduces it against C over dstate for out. dt, A, D and
dt_bias are read through their strides, so the broadcast views models pass (stride 0) cost no
copy. Every load widens to float32. A padding entry (negative row) reads and writes no row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import for_device

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@triton.jit
def selective_state_update_kernel(
    state_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, z_ptr, bias_ptr, rows_ptr, out_ptr,
    H, P, N, HEADS_PER_GROUP,
    s_row, s_head, s_p, s_n, dt_b, dt_h, dt_p, a_h, a_p, a_n, d_h, d_p, bias_h, bias_p,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
    HAS_ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_in, n_in = p < P, n < N
    if HAS_ROWS:
        row = tl.load(rows_ptr + b).to(tl.int64)
    else:
        row = b
    # per channel, as masks want vectors: a negative row is a padding entry
    live = p_in & ((tl.zeros((BLOCK_P,), dtype=tl.int64) + row) >= 0)
    row = tl.maximum(row, 0)
    tile = live[:, None] & n_in[None, :]
    group = h // HEADS_PER_GROUP
    d = tl.load(dt_ptr + b * dt_b + h * dt_h + p * dt_p, mask=live, other=0.0).to(tl.float32)
    if HAS_BIAS:
        d += tl.load(bias_ptr + h * bias_h + p * bias_p, mask=live, other=0.0).to(tl.float32)
    if SOFTPLUS:
        d = tl.where(d <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(d, 20.0))), d)
    x = tl.load(x_ptr + (b * H + h) * P + p, mask=live, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + h * a_h + p[:, None] * a_p + n[None, :] * a_n, mask=tile, other=0.0).to(tl.float32)
    bb = tl.load(b_ptr + (b * (H // HEADS_PER_GROUP) + group) * N + n, mask=n_in, other=0.0).to(tl.float32)
    cc = tl.load(c_ptr + (b * (H // HEADS_PER_GROUP) + group) * N + n, mask=n_in, other=0.0).to(tl.float32)
    states = state_ptr + row * s_row + h * s_head + p[:, None].to(tl.int64) * s_p + n[None, :] * s_n
    s = tl.load(states, mask=tile, other=0.0).to(tl.float32)
    s = s * tl.exp(d[:, None] * a) + (d * x)[:, None] * bb[None, :]
    tl.store(states, s.to(state_ptr.dtype.element_ty), mask=tile)
    out = tl.sum(s * cc[None, :], axis=1)
    if HAS_D:
        out += x * tl.load(d_ptr + h * d_h + p * d_p, mask=live, other=0.0).to(tl.float32)
    if HAS_Z:
        zz = tl.load(z_ptr + (b * H + h) * P + p, mask=live, other=0.0).to(tl.float32)
        out = out * zz / (1.0 + tl.exp(-zz))
    tl.store(out_ptr + (b * H + h) * P + p, tl.where(live, out, 0.0).to(out_ptr.dtype.element_ty), mask=p_in)


def block_p(dstate: int) -> int:
    """Head channels per program: a tile of at most 2048 state entries (16 per thread at 4 warps)."""
    return max(1, min(64, 2048 // triton.next_power_of_2(dstate)))


def _supported(*tensors) -> None:
    for t in tensors:
        if t is not None and t.dtype not in _TYPES:
            raise NotImplementedError(f"triton: {t.dtype} inputs are not supported (float32, float16, bfloat16)")


def selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, softplus, rows):
    """The decode step on CUDA/XPU tensors, or interpreted on CPU tensors; writes the used rows of ``state``."""
    _supported(state, x, dt, A, B, C, D, z, dt_bias)
    batch, heads, headdim = x.shape
    groups, dstate = B.shape[1:]
    out = torch.empty_like(x)
    if out.numel() == 0:
        return out
    size_p = min(block_p(dstate), triton.next_power_of_2(headdim))
    grid = (batch, heads, triton.cdiv(headdim, size_p))
    none = (0, 0)
    for_device(selective_state_update_kernel, x.device)[grid](
        state, x, dt, A, B, C, x if D is None else D, x if z is None else z, x if dt_bias is None else dt_bias,
        x if rows is None else rows, out, heads, headdim, dstate, heads // groups,
        *state.stride(), *dt.stride(), *A.stride(), *(none if D is None else D.stride()),
        *(none if dt_bias is None else dt_bias.stride()),
        HAS_D=D is not None, HAS_Z=z is not None, HAS_BIAS=dt_bias is not None, SOFTPLUS=softplus,
        HAS_ROWS=rows is not None, BLOCK_P=size_p, BLOCK_N=triton.next_power_of_2(dstate), num_warps=4,
    )
    return out


def compile_targets(dtype: torch.dtype, headdim: int = 64, dstate: int = 128):
    """[(label, kernel, signature, constexprs, num_warps)] of the decode step for ``dtype`` x, B, C
    and z, a float32 state and float32 dt, A, D and dt_bias (as models keep them): with rows, skip,
    gate, bias and softplus (Mamba-2 2.7B's call)."""
    x_type = "*" + _TYPES[dtype]
    signature = {"state_ptr": "*fp32", "x_ptr": x_type, "dt_ptr": "*fp32", "a_ptr": "*fp32", "b_ptr": x_type,
                 "c_ptr": x_type, "d_ptr": "*fp32", "z_ptr": x_type, "bias_ptr": "*fp32", "rows_ptr": "*i32",
                 "out_ptr": x_type}
    signature.update(dict.fromkeys(("H", "P", "N", "HEADS_PER_GROUP"), "i32"))
    signature.update(dict.fromkeys(("s_row", "s_head", "s_p", "s_n", "dt_b", "dt_h", "dt_p", "a_h", "a_p", "a_n",
                                    "d_h", "d_p", "bias_h", "bias_p"), "i64"))
    signature.update(dict.fromkeys(("HAS_D", "HAS_Z", "HAS_BIAS", "SOFTPLUS", "HAS_ROWS", "BLOCK_P", "BLOCK_N"),
                                   "constexpr"))
    constexprs = dict(HAS_D=True, HAS_Z=True, HAS_BIAS=True, SOFTPLUS=True, HAS_ROWS=True,
                      BLOCK_P=min(block_p(dstate), headdim), BLOCK_N=dstate)
    return [(f"update P={headdim} N={dstate}", selective_state_update_kernel, signature, constexprs, 4)]


def compile_groups(everything: bool) -> dict:
    """The compile report's builds of this family: ``{group id: function of an arch returning its
    builds}``, a build being ``compile_report.Build``'s fields but ``family``. One group, the decode
    step at Mamba-2's head sizes: by default for bfloat16 inputs; ``everything``: every dtype."""
    from . import dtype_name

    def builds(arch: int = 90) -> list[dict]:
        return [dict(label=f"mamba2 {label} {dtype_name(dtype)}", kernel=kernel, signature=signature,
                     constexprs=constexprs, num_warps=num_warps, num_stages=None)
                for dtype in _TYPES if everything or dtype == torch.bfloat16
                for label, kernel, signature, constexprs, num_warps in compile_targets(dtype)]

    return {"mamba2": builds}

"""Triton helpers that the kernels of more than one family call, defined once under public names
(a family's own helpers stay private to its module)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot_tf32x3(a, b):
    """``a @ b`` of float32 values (states, decayed or solved intermediates) as tf32x3: three tf32
    tensor-core products, about float32's accuracy."""
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")


@triton.jit
def dot_inputs(a, b, SIXTEEN_BIT: tl.constexpr, DT: tl.constexpr):
    """``a @ b`` accumulated in float32 for two input tiles as loaded (``Q K^T``, ``dO V^T``):
    operands in the 16-bit input dtype ``DT`` when SIXTEEN_BIT (their products are exact), else as
    :func:`dot_tf32x3`."""
    if SIXTEEN_BIT:
        return tl.dot(a.to(DT), b.to(DT))
    return dot_tf32x3(a, b)


@triton.jit
def round_to_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """``x`` rounded half to even onto the fp8 values, still in float32 (so the cast after it is
    exact; the interpreter's own fp8 cast does not carry a rounding into the next binade)."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_exponent = tl.maximum(exponent, MIN_EXPONENT) - MANTISSA_BITS  # subnormals share the lowest
    ulp = ((ulp_exponent + 127) << 23).to(tl.float32, bitcast=True)
    rounded = ((x / ulp + 12582912.0) - 12582912.0) * ulp  # 1.5 * 2**23 rounds to an integer, half to even
    return tl.where(rounded == 0.0, x * 0.0, rounded)  # keeps the sign of a zero


@triton.jit
def sequence_of(cu_q_lens_ptr, num_seqs, block, BLOCK_Q: tl.constexpr):
    """The sequence owning query block ``block`` of a ragged batch whose sequence s starts at
    token ``cu_q_lens[s]``: sequence s's blocks start at cu[s] // BLOCK_Q + s."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_q_lens_ptr + mid) // BLOCK_Q + mid <= block:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def round_to_cache(x, CACHE_KIND: tl.constexpr, cache_dtype):
    """float32 ``x`` (already divided by its scale) rounded to the cache dtype, as stored."""
    if CACHE_KIND == 1:  # int8: round half to even, saturate
        x = tl.where(x != x, 0.0, x)  # int8 has no NaN: 0 (a float -> int cast of NaN varies by device)
        x = tl.minimum(tl.maximum(x, -128.0), 127.0)
        x = (x + 12582912.0) - 12582912.0  # 1.5 * 2**23 rounds to an integer, half to even
    elif CACHE_KIND == 2:  # fp8: saturate to the largest finite value; NaN stays NaN (a plain min/max drops it)
        if cache_dtype == tl.float8e4nv:
            y = round_to_fp8_grid(tl.clamp(x, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL), 3, -6)
        else:
            y = round_to_fp8_grid(tl.clamp(x, -57344.0, 57344.0, propagate_nan=tl.PropagateNan.ALL), 2, -14)
        # NaN as all exponent and mantissa bits (the interpreter's cast makes NaN a finite code)
        code = y.to(cache_dtype).to(tl.uint8, bitcast=True)
        return tl.where(x != x, code | 0x7F, code).to(tl.uint8).to(cache_dtype, bitcast=True)
    return x.to(cache_dtype)


@triton.jit
def entry_offset(slot, block_stride, slot_stride, BLOCK_SIZE: tl.constexpr):
    """Offset of slot ``slot``'s row (kv head 0, dimension 0) in a cache with these strides."""
    slot = slot.to(tl.int64)
    return slot // BLOCK_SIZE * block_stride + slot % BLOCK_SIZE * slot_stride

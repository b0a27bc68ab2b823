"""Quantized attention (SageAttention's recipe) and its exact backward as SYCL kernels
(``quantized_attention.cl``).

Contract: the module docstring of ``torch_kernels.reference.quantized_attention``. One SPIR-V
build per (input dtype, head size) holds every kernel. Forward, three launches (four with
``pv_dtype="fp8"``):

1. ``quantize_rows`` for Q (``q_mean`` subtracted, ``sm_scale * log2(e)`` folded in) and for K
   (``k_mean`` subtracted): a work-group per tile of 128 query or 64 key rows of one sequence and
   head (every quantization group of the reference lies in one tile), a work-item per row. It
   writes the int8 values and one float32 scale per row (the group's, repeated).
2. ``quantize_values_fp8`` (``"fp8"`` only): per sequence and kv head, V's per-channel scales and
   its float8_e4m3fn codes.
3. ``attention_forward``: a work-group per 64 query rows of one sequence and query head (GQA:
   its kv head is ``h // group``), walking the reference's key tiles of 64 (bottom-right causal:
   none past the last row's diagonal) through local memory, its work-items taking in turn a key
   each (int32-exact ``q8 . k8``, scores ``(s_int * q_scale) * k_scale + key_bias``), a row each
   (the exp2 online softmax in float32, P rounded per ``pv_dtype``) and an output column each
   (P.V accumulated in float32); then the lse with the smoothing's correction.

The int8 values and scales and V's e4m3 codes and scales equal the reference's bit for bit:
divisions are IEEE-exact in integer arithmetic (``div_rn``), rounding is half to even, the
kernels are built without fused multiply-adds and a NaN is tracked by hand (OpenCL's ``fmax``
drops it). Scores take the reference's float32 operations in its order; the rest differs from it
in float32 summation order and in ``exp2`` / ``log2`` rounding. NaN and inf reach the rows the
reference's reach, except that a NaN value does not reach the rows of a work-group whose causal
range ends before its key tile (the reference's masked 0 * NaN, the contract's "possibly others").

Backward (the gradient of exact attention, ``reference.attention_backward``, in float32 from the
inputs' values), two launches: ``attention_backward_dq`` (a work-item per query row: the exact
lse and ``delta = rowsum(dO * O) - d lse`` from an online softmax that rebuilds O, then dQ) and
``attention_backward_dkdv`` (a work-item per key of a kv head: dK and dV summed over every query
head of its group, so no atomics).

CPU tensors run on the ``opencl:cpu`` SYCL device through USM copies. Head sizes 1 to 256 (one
build each); larger ones, other dtypes and other devices are declined (``NotImplementedError``).
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import torch

from . import _runtime

SOURCE = "quantized_attention.cl"
QUERY_TILE, KEY_TILE = 128, 64  # quantization tiles (QT, KT of the .cl); KEY_TILE is the softmax's key tile too
ROWS = 64  # rows (work-items) of an attention work-group: BM of the .cl
MAX_HEAD_SIZE = 256  # each work-item keeps a few rows of D floats in private memory
LOG2E = math.log2(math.e)
_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_PV_MODES = {"fp16": 0, "fp8": 1, "none": 2}
# (role, granularity) -> grouping of quantize_rows: the reference's row_groups within one tile
GROUPINGS = {("q", "per_block"): 0, ("q", "per_warp"): 1, ("q", "per_thread"): 2,
             ("k", "per_block"): 0, ("k", "per_warp"): 0, ("k", "per_thread"): 3}
_ROLES = {"q": 0, "k": 1}
_NONE = torch.zeros(1)  # what an absent optional input is passed as
_INT_MAX = 2 ** 31 - 1


def _local_bytes(head_size: int) -> int:
    """The largest kernel's __local arrays, as quantized_attention.cl sizes them."""
    forward = 2 * ROWS * head_size + 4 * ROWS * head_size + 4 * ROWS * (ROWS + 1) + 5 * 4 * ROWS
    backward = 2 * 4 * ROWS * head_size + 2 * 4 * ROWS  # the dK/dV kernel's queries and dO
    return max(forward, backward)


def _supported(q: torch.Tensor, *tensors) -> None:
    """Raise NotImplementedError (the next backend runs) for what no kernel here takes: the
    dtype and sizes of ``q``, the device of every tensor given."""
    for t in (q, *tensors):
        if t is not None and t.device.type != "cpu":
            # Torch XPU tensors would be passed zero-copy through DLPack; that path is not built yet.
            raise NotImplementedError(
                f"sycl: only CPU tensors (run on the opencl:cpu device) are supported, got {t.device}")
    if q.dtype not in _KINDS:
        raise NotImplementedError(f"sycl: no kernel for {q.dtype} inputs (float32, float16, bfloat16 only)")
    if max(q.shape) > _INT_MAX:
        raise NotImplementedError(f"sycl: a dimension of {tuple(q.shape)} exceeds the kernels' int32 sizes")
    head_size = q.shape[-1]
    if not 1 <= head_size <= MAX_HEAD_SIZE:
        raise NotImplementedError(f"sycl: head size {head_size} is not supported (1 to {MAX_HEAD_SIZE})")
    if _local_bytes(head_size) > _runtime.local_memory_bytes():
        raise NotImplementedError(f"sycl: head size {head_size} does not fit the device's local memory")


def _macros(dtype: torch.dtype, head_size: int) -> dict[str, int]:
    return {"X_KIND": _KINDS[dtype], "HEAD_SIZE": head_size}


def _usm(t: torch.Tensor):
    return _runtime.usm_copy(t.contiguous())[0]


def _launch(name: str, dtype: torch.dtype, head_size: int, args: list, global_range, local_range) -> None:
    kernel = _runtime.kernel(SOURCE, name, **_macros(dtype, head_size))
    _runtime.host_queue().submit(kernel, args, global_range, local_range).wait()


# ---- sequences and tiles ----

def sequence_table(batch: int, nq: int, nk: int, cu_seqlens_q, cu_seqlens_k) -> torch.Tensor:
    """int32 ``[S, 5]``: each sequence's (batch element, first and end query row, first and end key
    row), as ``reference.sequences`` lists them."""
    if cu_seqlens_q is None:
        b = torch.arange(batch, dtype=torch.int32)
        zeros = torch.zeros_like(b)
        return torch.stack([b, zeros, zeros + nq, zeros, zeros + nk], dim=1)
    cq, ck = cu_seqlens_q.to(torch.int32), cu_seqlens_k.to(torch.int32)
    return torch.stack([torch.zeros_like(cq[1:]), cq[:-1], cq[1:], ck[:-1], ck[1:]], dim=1)


def tile_table(seqs: torch.Tensor, role: str, rows: int) -> torch.Tensor:
    """int32 ``[T, 2]``: (sequence, first row) of every tile of ``rows`` query (``role="q"``) or key
    (``"k"``) rows, each sequence's tiles starting at its first row."""
    begin, end = seqs[:, 1 + 2 * _ROLES[role]], seqs[:, 2 + 2 * _ROLES[role]]
    counts = (end - begin + rows - 1) // rows
    sequence = torch.repeat_interleave(torch.arange(seqs.shape[0], dtype=torch.int32), counts)
    first_tile = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    starts = begin[sequence] + (torch.arange(sequence.shape[0], dtype=torch.int32) - first_tile) * rows
    return torch.stack([sequence, starts.to(torch.int32)], dim=1)


# ---- quantization ----

def _quantize(x_mem, x: torch.Tensor, mean, multiplier: float, role: str, granularity: str, seqs: torch.Tensor):
    """USM ``(int8 values, float32 per-row scales)`` of ``x`` (already in USM as ``x_mem``)."""
    batch, heads, n, d = x.shape
    x8_mem, x8 = _runtime.usm_empty(tuple(x.shape), torch.int8)
    scale_mem, scale = _runtime.usm_empty(tuple(x.shape[:3]), torch.float32)
    rows = QUERY_TILE if role == "q" else KEY_TILE
    tiles = tile_table(seqs, role, rows)
    if tiles.shape[0] and heads:
        args = [x_mem, _usm(_NONE if mean is None else mean), x8_mem, scale_mem, _usm(seqs), _usm(tiles),
                ctypes.c_int(n), ctypes.c_int(_ROLES[role]), ctypes.c_int(GROUPINGS[role, granularity]),
                ctypes.c_float(multiplier), ctypes.c_int(int(mean is not None))]
        _launch("quantize_rows", x.dtype, d, args, [heads, tiles.shape[0] * rows], [1, rows])
    return (x8_mem, x8), (scale_mem, scale)


def _folded(sm_scale: float) -> float:
    """``sm_scale * log2(e)`` as the float32 constant the reference folds into Q."""
    with np.errstate(over="ignore"):  # inf past float32's range, as a float32 cast gives
        return float(np.float32(sm_scale * LOG2E))


def quantize(x: torch.Tensor, mean: torch.Tensor | None, multiplier: float, role: str, granularity: str,
             cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 [B, H, N, D], float32 per-row scale [B, H, N])`` of queries (``role="q"``) or keys
    (``"k"``): ``x' = (x - mean) * multiplier`` (``mean [S, H, D]`` the sequences' means, or None),
    quantized per group of the reference's ``row_groups``, groups counted from each sequence's
    first row. Queries pass ``sm_scale * log2(e)`` as a float32 value, keys 1."""
    _supported(x, mean, cu_seqlens)
    batch, _, n, _ = x.shape
    seqs = sequence_table(batch, n, n, cu_seqlens, cu_seqlens)
    (_, x8), (_, scale) = _quantize(_usm(x), x, mean, multiplier, role, granularity, seqs)
    return x8, scale


def _quantize_values(v_mem, v: torch.Tensor, seqs: torch.Tensor):
    """USM ``(e4m3fn codes as uint8 [B, H, N, D], per-channel scales float32 [S, H, D])``."""
    _, heads, n, d = v.shape
    v8_mem, v8 = _runtime.usm_empty(tuple(v.shape), torch.uint8)
    scale_mem, scale = _runtime.usm_empty((seqs.shape[0], heads, d), torch.float32)
    if seqs.shape[0] and heads:
        args = [v_mem, v8_mem, scale_mem, _usm(seqs), ctypes.c_int(n)]
        _launch("quantize_values_fp8", v.dtype, d, args, [heads, seqs.shape[0] * 64], [1, 64])
    return (v8_mem, v8), (scale_mem, scale)


def quantize_values_fp8(v: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn [B, H, N, D], per-channel scale float32 [S, H, D])``: the reference's
    ``quantize_values_fp8`` per sequence (scale 1 for a sequence with no rows)."""
    _supported(v, cu_seqlens)
    batch, _, n, _ = v.shape
    (_, v8), (_, scale) = _quantize_values(_usm(v), v, sequence_table(batch, n, n, cu_seqlens, cu_seqlens))
    return v8.view(torch.float8_e4m3fn), scale


# ---- forward ----

def quantized_attention(q, k, v, k_mean, q_mean, key_bias, sm_scale, causal, granularity, pv_dtype, cu_seqlens_q,
                        cu_seqlens_k):
    """The forward (module docstring): ``(out [B, Hq, Nq, D] in q's dtype, lse float32 [B, Hq, Nq])``.

    Contract: ``torch_kernels.reference.quantized_attention.quantized_attention``. Declines
    non-CPU tensors, dtypes other than float32 / float16 / bfloat16 and head sizes past 256.
    """
    _supported(q, k, v, k_mean, q_mean, key_bias, cu_seqlens_q, cu_seqlens_k)
    batch, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    out_mem, out = _runtime.usm_empty(tuple(q.shape), q.dtype)
    lse_mem, lse = _runtime.usm_empty((batch, hq, nq), torch.float32)
    if q.numel() == 0 or k.numel() == 0:
        return out.zero_(), lse.fill_(-math.inf)
    seqs = sequence_table(batch, nq, nk, cu_seqlens_q, cu_seqlens_k)
    q_mem, k_mem, v_mem = _usm(q), _usm(k), _usm(v)
    (q8_mem, _), (q_scale_mem, _) = _quantize(q_mem, q, q_mean, _folded(sm_scale), "q", granularity, seqs)
    (k8_mem, _), (k_scale_mem, _) = _quantize(k_mem, k, k_mean, 1.0, "k", granularity, seqs)
    if pv_dtype == "fp8":
        (v8_mem, _), (v_scale_mem, _) = _quantize_values(v_mem, v, seqs)
    else:
        v8_mem = v_scale_mem = _usm(_NONE)
    tiles = tile_table(seqs, "q", ROWS)  # every row lies in one: packed sequences cover their rows
    args = [q8_mem, q_scale_mem, k8_mem, k_scale_mem, v_mem, v8_mem, v_scale_mem,
            _usm(_NONE if key_bias is None else key_bias), _usm(_NONE if k_mean is None else k_mean), q_mem,
            out_mem, lse_mem, _usm(seqs), _usm(tiles), ctypes.c_int(nq), ctypes.c_int(nk), ctypes.c_int(hkv),
            ctypes.c_float(sm_scale), ctypes.c_int(int(causal)), ctypes.c_int(_PV_MODES[pv_dtype]),
            ctypes.c_int(int(key_bias is not None)), ctypes.c_int(int(k_mean is not None))]
    _launch("attention_forward", q.dtype, d, args, [hq, tiles.shape[0] * ROWS], [1, ROWS])
    return out, lse


# ---- backward ----

def quantized_attention_backward(grad_out, grad_lse, q, k, v, sm_scale, causal, cu_seqlens_q, cu_seqlens_k):
    """``(dq, dk, dv)`` of exact attention in the inputs' dtype (module docstring).

    Contract: ``torch_kernels.reference.quantized_attention.attention_backward``; declines as the
    forward does.
    """
    _supported(q, grad_out, grad_lse, k, v, cu_seqlens_q, cu_seqlens_k)
    batch, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    grads = [_runtime.usm_empty(tuple(t.shape), t.dtype) for t in (q, k, v)]
    if q.numel() == 0 or k.numel() == 0:
        return tuple(grad.zero_() for _, grad in grads)
    (dq_mem, dq), (dk_mem, dk), (dv_mem, dv) = grads
    seqs = sequence_table(batch, nq, nk, cu_seqlens_q, cu_seqlens_k)
    # every row lies in a tile (packed sequences cover their rows), so every gradient row is written
    q_tiles, k_tiles = tile_table(seqs, "q", ROWS), tile_table(seqs, "k", ROWS)
    inputs = [_usm(t) for t in (q, k, v, grad_out.to(q.dtype))]
    seqs_mem = _usm(seqs)
    lse_mem, _ = _runtime.usm_empty((batch, hq, nq), torch.float32)
    delta_mem, _ = _runtime.usm_empty((batch, hq, nq), torch.float32)
    sizes = [ctypes.c_int(nq), ctypes.c_int(nk)]
    args = [*inputs, _usm(_NONE if grad_lse is None else grad_lse.float()), lse_mem, delta_mem, dq_mem, seqs_mem,
            _usm(q_tiles), *sizes, ctypes.c_int(hkv), ctypes.c_float(sm_scale), ctypes.c_int(int(causal)),
            ctypes.c_int(int(grad_lse is not None))]
    _launch("attention_backward_dq", q.dtype, d, args, [hq, q_tiles.shape[0] * ROWS], [1, ROWS])
    args = [*inputs, lse_mem, delta_mem, dk_mem, dv_mem, seqs_mem, _usm(k_tiles), *sizes, ctypes.c_int(hq),
            ctypes.c_float(sm_scale), ctypes.c_int(int(causal))]
    _launch("attention_backward_dkdv", q.dtype, d, args, [hkv, k_tiles.shape[0] * ROWS], [1, ROWS])
    return dq, dk, dv


def spirv_binaries() -> list[bytes]:
    """The SPIR-V modules for every input dtype at head size 128 (built, cached)."""
    return [_runtime.spirv(SOURCE, _macros(dtype, 128)) for dtype in _KINDS]

"""Mixture-of-experts kernels as SYCL kernels (``moe.cl``).

Contract: the module docstring of ``torch_kernels.reference.moe``. One SPIR-V build per
(activation dtype, weight dtype, tile rows) holds all six kernels:

- ``grouped_mm``: a work-group per (row tile of one expert, 64 output columns), row tiles found
  from the offsets (each expert's rows cut into tiles of ``tile_rows``), local-memory tiles;
  weights ``[E, K, N]`` or ``[E, N, K]``;
- ``grouped_mm_weight_grad``: a work-group per (expert, K tile, N tile) walks the expert's rows;
- ``fused_moe``: the gate/up GEMM gathers token rows itself and applies the activation in its
  epilogue (h rounded to x's dtype), the down GEMM is ``grouped_mm`` on h, and ``moe_combine``
  weights and sums each token's rows in slot order; float8_e4m3fn weights are decoded from their
  bits in the kernels and scaled per output channel or per ``[bn, bk]`` block;
- ``router_topk``, ``moe_gather``, ``moe_combine``: a work-item per token / element.

CPU tensors run on the ``opencl:cpu`` SYCL device through USM copies; only the experts that have
rows are copied. ``default_layout`` picks the tile height from the rows per busy expert (4 for
decode steps, 16, 64 for prefill). float64 is declined.
"""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from . import _runtime

SOURCE = "moe.cl"
TILE_ROWS = (4, 16, 64)  # the TM builds
_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_FP8_KIND = 4
_ACTIVATIONS = {"silu": 0, "gelu": 1, "swigluoai": 2}
_INT_MAX = 2 ** 31 - 1
_NO_SCALE = torch.ones(1)


@dataclasses.dataclass(frozen=True)
class Layout:
    """``tile_rows``: rows of a GEMM work-group's tile (one of ``TILE_ROWS``)."""

    tile_rows: int

    @property
    def work_group(self) -> tuple[int, int]:
        """(rows, columns) of work-items: WY, WX of moe.cl."""
        rows = min(self.tile_rows, 16)
        return rows, 256 // rows

    @property
    def tile_columns(self) -> int:
        return max(64, self.work_group[1])  # TN of moe.cl


def default_layout(routed_rows: int, busy_experts: int) -> Layout:
    """Short tiles when experts hold few rows each (decode), so that little of a tile is padding."""
    per_expert = routed_rows / max(busy_experts, 1)
    return Layout(4 if per_expert <= 4 else 16 if per_expert <= 24 else 64)


def _macros(a_dtype: torch.dtype, w_dtype: torch.dtype, layout: Layout) -> dict[str, int]:
    w_kind = _FP8_KIND if w_dtype == torch.float8_e4m3fn else _KINDS[w_dtype]
    return {"A_KIND": _KINDS[a_dtype], "W_KIND": w_kind, "TM": layout.tile_rows}


def _supported(*tensors, expert_weights=()) -> None:
    for t in (*tensors, *expert_weights):
        if t is not None and t.device.type != "cpu":
            # Torch XPU tensors would be passed zero-copy through DLPack; that path is not built yet.
            raise NotImplementedError(
                f"sycl: only CPU tensors (run on the opencl:cpu device) are supported, got {t.device}")
    for t in tensors:
        if t is not None and t.is_floating_point() and t.dtype not in _KINDS:
            raise NotImplementedError(f"sycl: no kernel for {t.dtype} inputs (float32, float16, bfloat16 only)")
    for t in expert_weights:
        if t.dtype not in _KINDS and t.dtype != torch.float8_e4m3fn:
            raise NotImplementedError(f"sycl: no kernel for {t.dtype} weights")
    for t in (*tensors, *expert_weights):
        if t is not None and any(s > _INT_MAX for s in t.shape):
            raise NotImplementedError(f"sycl: a dimension of {tuple(t.shape)} exceeds the kernels' int32 sizes")


def _out_kind(out_dtype: torch.dtype) -> int:
    if out_dtype not in _KINDS:
        raise NotImplementedError(f"sycl: no kernel writes {out_dtype}")
    return _KINDS[out_dtype]


def _usm(t: torch.Tensor):
    return _runtime.usm_copy(t.contiguous())[0]


@dataclasses.dataclass(frozen=True)
class _Routing:
    """The experts that have rows, their row ends and the GEMM row tiles over them. The other
    experts are never read, so their weights are not copied to USM: in a decode step most of E
    experts are idle, and copying their weights would cost more than the GEMMs."""

    busy: torch.Tensor | None  # ids of the experts with rows; None: all have rows
    offsets: torch.Tensor  # int64 row ends of those experts
    tile_ends: torch.Tensor  # int64 cumulative row-tile counts: expert i owns tiles tile_ends[i-1] ..
    layout: Layout

    @property
    def tiles(self) -> int:
        return int(self.tile_ends[-1]) if self.tile_ends.numel() else 0

    def expert_copy(self, t: torch.Tensor | None):
        """A USM copy of the busy experts of ``t`` (``[E, ...]``), or of a stand-in if None."""
        if t is None:
            return _usm(_NO_SCALE)
        if t.dtype == torch.float8_e4m3fn:
            t = t.view(torch.uint8)  # the kernels decode the bits
        if self.busy is None:
            return _usm(t)
        memory, view = _runtime.usm_empty((self.busy.shape[0], *t.shape[1:]), t.dtype)
        for i, expert in enumerate(self.busy.tolist()):  # one memcpy each: index_select is far slower here
            view[i].copy_(t[expert])
        return memory


def _routing(offsets: torch.Tensor, layout: Layout | None) -> _Routing:
    offsets = offsets.long()
    rows = torch.diff(offsets, prepend=offsets.new_zeros(1))
    busy = (rows > 0).nonzero()[:, 0]
    if layout is None:
        layout = default_layout(int(offsets[-1]) if offsets.numel() else 0, busy.shape[0])
    elif layout.tile_rows not in TILE_ROWS:
        raise ValueError(f"layout: expected tile_rows in {TILE_ROWS}, got {layout.tile_rows}")
    tile_ends = ((rows[busy] + layout.tile_rows - 1) // layout.tile_rows).cumsum(0)
    every = busy.shape[0] == offsets.shape[0]
    return _Routing(None if every else busy, offsets if every else offsets[busy].contiguous(), tile_ends, layout)


def _scale_args(scale, block_shape) -> list:
    mode = 0 if scale is None else 1 if block_shape is None else 2
    bn, bk = block_shape or (1, 1)
    return [ctypes.c_int(mode), ctypes.c_int(bn), ctypes.c_int(bk)]


def _launch(name: str, macros: dict[str, int], args: list, global_range: list[int], local_range=None) -> None:
    kernel = _runtime.kernel(SOURCE, name, **macros)
    if local_range is None:
        _runtime.host_queue().submit(kernel, args, global_range).wait()
    else:
        _runtime.host_queue().submit(kernel, args, global_range, local_range).wait()


def _gemm_range(routing: _Routing, columns: int) -> tuple[list[int], list[int]]:
    """(global, local) ranges of a row-tiled GEMM, slowest dimension first as SYCL lists them."""
    wy, wx = routing.layout.work_group
    column_tiles = -(-columns // routing.layout.tile_columns)
    return [routing.tiles * wy, column_tiles * wx], [wy, wx]


def _run_grouped_mm(a_mem, a_dtype, w, scale, block_shape, routing: _Routing, out_mem, out_kind, transposed) -> None:
    """out[r] = a[r] @ W_e over the routed rows r of a (USM), the rest of out untouched."""
    n, k = (w.shape[1], w.shape[2]) if transposed else (w.shape[2], w.shape[1])
    if routing.tiles == 0 or n == 0:
        return
    args = [a_mem, routing.expert_copy(w), routing.expert_copy(scale), _usm(routing.offsets),
            _usm(routing.tile_ends), out_mem, ctypes.c_int(routing.offsets.shape[0]), ctypes.c_int(n), ctypes.c_int(k),
            ctypes.c_int(int(transposed)), *_scale_args(scale, block_shape), ctypes.c_int(out_kind)]
    _launch("grouped_mm", _macros(a_dtype, w.dtype, routing.layout), args, *_gemm_range(routing, n))


def grouped_mm(x, w, offsets, out_dtype, w_transposed, layout: Layout | None = None):
    """``[M, N]``: rows ``offsets[e-1]:offsets[e]`` of ``x`` times expert ``e``'s ``[K, N]`` matrix
    (``w [E, K, N]``, or ``[E, N, K]`` when ``w_transposed``), float32 accumulation; rows past
    ``offsets[-1]`` zero. ``layout`` overrides ``default_layout``."""
    _supported(x, w)
    out_kind = _out_kind(out_dtype)
    routing = _routing(offsets, layout)
    n = w.shape[1] if w_transposed else w.shape[2]
    out_mem, out = _runtime.usm_empty((x.shape[0], n), out_dtype)
    out[int(offsets[-1]) if offsets.numel() else 0:].zero_()
    _run_grouped_mm(_usm(x), x.dtype, w, None, None, routing, out_mem, out_kind, w_transposed)
    return out


def grouped_mm_weight_grad(x, dy, offsets, num_experts, out_dtype, layout: Layout | None = None):
    """``[E, K, N]``: ``x_e^T dy_e`` per expert, float32 accumulation, zero for an expert with no
    rows. ``layout.tile_rows`` here tiles K (default: 64 unless K is small)."""
    _supported(x, dy)
    out_kind = _out_kind(out_dtype)
    if x.dtype != dy.dtype:  # one operand kind per build; float32 holds both exactly
        x, dy = x.float(), dy.float()
    k, n = x.shape[1], dy.shape[1]
    layout = layout or Layout(64 if k > 16 else 16)
    out_mem, out = _runtime.usm_empty((num_experts, k, n), out_dtype)
    if out.numel() == 0:
        return out
    if offsets.shape[0] < num_experts:  # the experts past the offsets have no rows, as in the reference
        end = offsets[-1:] if offsets.numel() else offsets.new_zeros(1)
        offsets = torch.cat([offsets, end.expand(num_experts - offsets.shape[0])])
    args = [_usm(x), _usm(dy), _usm(offsets.long()), out_mem, ctypes.c_int(k), ctypes.c_int(n), ctypes.c_int(out_kind)]
    wy, wx = layout.work_group
    _launch("grouped_mm_weight_grad", _macros(x.dtype, x.dtype, layout), args,
            [num_experts, -(-k // layout.tile_rows) * wy, -(-n // layout.tile_columns) * wx], [1, wy, wx])
    return out


def fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets, activation, w13_scale, w2_scale,
              block_shape, layout: Layout | None = None):
    """``[T, H]`` in x's dtype: the experts block of ``reference.fused_moe_naive`` in three
    launches (gather + gate/up GEMM + activation, down GEMM, weighted combine in slot order)."""
    _supported(x, weights, w13_scale, w2_scale, expert_weights=(w13, w2))
    if w13.dtype != x.dtype and w13.dtype != torch.float8_e4m3fn:
        raise NotImplementedError(f"sycl: no kernel for {w13.dtype} weights with {x.dtype} tokens")
    if w13.dtype == torch.float8_e4m3fn and (w13_scale is None or w2_scale is None):
        raise NotImplementedError("sycl: float8_e4m3fn weights need their float32 scales")
    routing = _routing(offsets, layout)
    macros = _macros(x.dtype, w13.dtype, routing.layout)
    num_tokens, hidden = x.shape
    intermediate = w2.shape[2]
    rows = token_of_row.shape[0]
    out_mem, out = _runtime.usm_empty((num_tokens, hidden), x.dtype)
    if out.numel() == 0:
        return out
    h_mem, _ = _runtime.usm_empty((rows, intermediate), x.dtype)
    y_mem, _ = _runtime.usm_empty((rows, hidden), torch.float32)  # rows past offsets[-1] are never read
    if routing.tiles and intermediate:
        args = [_usm(x), routing.expert_copy(w13), routing.expert_copy(w13_scale), _usm(token_of_row.long()),
                _usm(routing.offsets), _usm(routing.tile_ends), h_mem, ctypes.c_int(routing.offsets.shape[0]),
                ctypes.c_int(intermediate), ctypes.c_int(hidden), *_scale_args(w13_scale, block_shape),
                ctypes.c_int(_ACTIVATIONS[activation])]
        _launch("gate_up", macros, args, *_gemm_range(routing, intermediate))
    _run_grouped_mm(h_mem, x.dtype, w2, w2_scale, block_shape, routing, y_mem, _KINDS[torch.float32], True)
    args = [y_mem, _usm(row_of_slot.long()), _usm(weights.float()), out_mem, ctypes.c_int(row_of_slot.shape[1]),
            ctypes.c_int(hidden), ctypes.c_int(_KINDS[torch.float32]), ctypes.c_int(_KINDS[x.dtype])]
    _launch("moe_combine", macros, args, [num_tokens, hidden])
    return out


def moe_gather(x, token_of_row):
    """``[R, H]``: row ``r`` is ``x[token_of_row[r]]`` bit for bit, zero where it is -1."""
    _supported(x)
    out_mem, out = _runtime.usm_empty((token_of_row.shape[0], x.shape[1]), x.dtype)
    if out.numel() == 0:
        return out
    row_units = x.shape[1] * x.element_size() // 2  # the kernel copies 16-bit units
    args = [_usm(x), _usm(token_of_row.long()), out_mem, ctypes.c_int(row_units)]
    _launch("moe_gather", _macros(x.dtype, x.dtype, Layout(16)), args, [out.shape[0], row_units])
    return out


def moe_combine(y, row_of_slot, weights, out_dtype):
    """``[T, N]``: ``sum_j weights[t, j] * y[row_of_slot[t, j]]`` in float32 in slot order."""
    _supported(y, weights)
    out_kind = _out_kind(out_dtype)
    num_tokens, top_k = row_of_slot.shape
    out_mem, out = _runtime.usm_empty((num_tokens, y.shape[1]), out_dtype)
    if out.numel() == 0:
        return out
    args = [_usm(y), _usm(row_of_slot.long()), _usm(weights.float()), out_mem, ctypes.c_int(top_k),
            ctypes.c_int(y.shape[1]), ctypes.c_int(_KINDS[y.dtype]), ctypes.c_int(out_kind)]
    _launch("moe_combine", _macros(y.dtype, y.dtype, Layout(16)), args, list(out.shape))
    return out


def router_topk(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, correction_bias,
                routed_scaling_factor):
    """``(weights float32 [T, k], ids int64 [T, k])`` as ``reference.router_topk`` chooses them."""
    _supported(logits)
    num_tokens, num_experts = logits.shape
    groups = num_expert_groups or 0
    weights_mem, weights = _runtime.usm_empty((num_tokens, top_k), torch.float32)
    ids_mem, ids = _runtime.usm_empty((num_tokens, top_k), torch.int64)
    if weights.numel() == 0:
        return weights, ids
    bias = torch.zeros(num_experts) if correction_bias is None else correction_bias.float()
    scratch_mem, _ = _runtime.usm_empty((num_tokens, num_experts + groups), torch.float32)
    flags = (scoring == "sigmoid", correction_bias is not None, renormalize)
    args = [_usm(logits), _usm(bias), scratch_mem, weights_mem, ids_mem, ctypes.c_int(num_experts),
            ctypes.c_int(top_k), *(ctypes.c_int(int(flag)) for flag in flags), ctypes.c_int(groups),
            ctypes.c_int(topk_groups or 0), ctypes.c_float(routed_scaling_factor)]
    _launch("router_topk", _macros(logits.dtype, logits.dtype, Layout(16)), args, [num_tokens])
    return weights, ids


def spirv_binaries() -> list[bytes]:
    """The SPIR-V modules of every (activation dtype, weight dtype, tile rows) build."""
    return [_runtime.spirv(SOURCE, _macros(a, w, Layout(rows)))
            for a in _KINDS for w in (a, torch.float8_e4m3fn) for rows in TILE_ROWS]

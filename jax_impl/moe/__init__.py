"""Mixture of experts as Pallas TPU kernels: routing, row gather, grouped GEMMs, combine, the fused layer.

Every piece is a Pallas kernel; plain jnp only builds metadata (the group schedule, the routing
maps of :func:`sort_by_expert`), widens float16 and pads index arrays around the kernels.

- ``router_topk``: one grid step per block of tokens holds all E scores: softmax or sigmoid,
  the group limit (top-2 sum per group, ``topk_groups`` rounds of argmax over groups), then
  ``top_k`` rounds of argmax, weights from the unbiased scores. The choice rule is
  ``reference.router_topk``'s: by the logits, or by ``scores + bias`` with a bias; NaN ranks as
  -inf; equal values go to the lowest index; a row with a NaN logit gets NaN weights.
- ``moe_gather`` / ``moe_combine``: rows fetched from HBM by DMA at indices read from SMEM.
  16-bit rows are widened to float32 before the kernel, so that every row copy moves whole
  32-bit sublanes (a single 16-bit row is half of a packed sublane). The combine adds a token's
  slots in slot order in float32 (deterministic) and never uses a dropped slot's row.
- ``grouped_mm`` and the GEMMs of ``fused_moe``: megablox's grouped matmul idea. Rows are sorted
  by expert; the grid walks (column tile, step, inner tile), and a step is one (expert, row tile)
  pair from a schedule in scalar prefetch: a row tile shared by two experts is visited once per
  expert, consecutively, each visit storing only its rows, so the output block stays in VMEM
  across them. Rows past the last expert form one more group whose steps store zeros. The
  step count is the grid's dynamic extent.
- ``grouped_mm_weight_grad``: the transposed form (tgmm): the grid walks (K tile, N tile,
  step); an expert's steps accumulate ``x_e^T dy_e`` in VMEM and its last step stores it; an
  empty expert gets one step that stores zeros.
- ``fused_moe``: gather -> grouped GEMM with w13 as two operands (gate rows, up rows) and the
  activation in its epilogue, h stored in x's dtype -> grouped GEMM with w2 storing float32 ->
  combine, which applies the routing weights. float8_e4m3fn weights are cast in VMEM (exact in
  bfloat16 and float32); per-channel scales multiply the float32 accumulator in the epilogue;
  ``[bn, bk]`` block scales (read from SMEM) scale each inner tile's partial product per
  K block, so dequantized weights are never rounded.

Tiles obey the TPU block rules: a dimension up to the preferred tile is one full-dimension
block; a larger one is tiled by a power-of-two multiple of 128, the largest up to the preferred
that divides it, else the preferred with a ragged last block whose extra columns the GEMMs mask
in K (rows and output columns past an array are dropped on store): no weight is ever copied.
Mosaic has no float16 on any TPU generation: float16 operands are widened to float32 before a
kernel and results narrowed after (in ``fused_moe`` h is rounded to float16 between the GEMMs).
bfloat16 multiplies in bfloat16, float16 and float32 in float32 (HIGHEST precision);
accumulation is always float32. float64 is declined (NotImplementedError).

Modules: :mod:`.router` (routing and its maps), :mod:`.gather_combine`, :mod:`.grouped_gemm`,
:mod:`.fused`, :mod:`.references` (each kernel in plain jnp) and :mod:`.differentiable` (the
``jax.custom_vjp`` forms over either set), sharing :mod:`._common`.
"""

from __future__ import annotations

from ._common import Config
from .differentiable import (
    PALLAS, REFERENCE, Kernels, differentiable_fused_moe, differentiable_grouped_mm, differentiable_moe_combine,
    differentiable_moe_gather, differentiable_router_topk,
)
from .fused import fused_moe
from .gather_combine import moe_combine, moe_gather
from .grouped_gemm import grouped_mm, grouped_mm_weight_grad
from .references import (
    fused_moe_reference, grouped_mm_reference, grouped_mm_weight_grad_reference, moe_combine_reference,
    moe_gather_reference, router_topk_reference,
)
from .router import router_topk, sort_by_expert

__all__ = [
    "Config", "router_topk", "sort_by_expert", "moe_gather", "moe_combine", "grouped_mm", "grouped_mm_weight_grad",
    "fused_moe", "router_topk_reference", "moe_gather_reference", "moe_combine_reference", "grouped_mm_reference",
    "grouped_mm_weight_grad_reference", "fused_moe_reference", "Kernels", "PALLAS", "REFERENCE",
    "differentiable_router_topk", "differentiable_moe_gather", "differentiable_moe_combine",
    "differentiable_grouped_mm", "differentiable_fused_moe",
]

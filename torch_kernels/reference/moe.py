"""Mixture of experts in plain PyTorch: routing, dispatch, grouped GEMM, combine, the fused layer.

The kernel contract every backend follows (inputs already checked and contiguous, indices int64,
``torch_kernels.ops.moe`` computes the routing metadata once with :func:`sort_by_expert`):

- ``router_topk(logits [T, E], top_k, scoring, renormalize, num_expert_groups, topk_groups,
  correction_bias [E] or None, routed_scaling_factor) -> (weights float32 [T, k], ids int64 [T, k])``.
- ``moe_gather(x [T, H], token_of_row [R]) -> [R, H]``: ``x[token_of_row[r]]``, zero where it is -1.
- ``moe_combine(y [R, N], row_of_slot [T, k], weights float32 [T, k], out_dtype) -> [T, N]``:
  ``sum_j weights[t, j] * y[row_of_slot[t, j]]`` in float32, slot by slot in order ``j``, slots
  whose row is -1 left out (never read).
- ``grouped_mm(x [M, K], w, offsets int64 [E], out_dtype, w_transposed) -> [M, N]``: rows
  ``offsets[e-1]:offsets[e]`` times expert ``e``'s ``[K, N]`` matrix, float32 accumulation, rows
  past ``offsets[-1]`` zero. ``w`` is ``[E, K, N]``, or ``[E, N, K]`` (each expert's transpose)
  when ``w_transposed``.
- ``grouped_mm_weight_grad(x [M, K], dy [M, N], offsets, num_experts, out_dtype) -> [E, K, N]``:
  ``x_e^T dy_e`` per expert (zero for an expert with no rows).
- ``fused_moe(x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights float32 [T, k], token_of_row,
  row_of_slot, offsets, activation, w13_scale, w2_scale, block_shape) -> [T, H]``: the whole
  experts block (see :func:`fused_moe_naive`), routing metadata as ``sort_by_expert`` makes it.

``*_naive`` functions are the definitions, loops over experts written for reading; the others are
the reference backend's vectorized kernels, tested against them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("silu", "gelu", "swigluoai")
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0  # gpt-oss's clamped GLU


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- routing ----

def ranked(values, excluded=None):
    """Each row's indices, best first: larger values first, NaN counted as -inf, equal values
    (-0.0 and 0.0 too) by lowest index, positions where ``excluded`` is True after all others.
    Stable sorts, not ``torch.topk``, whose order of equal values is unspecified (and differs
    between CPU and CUDA)."""
    values = values.masked_fill(values.isnan(), float("-inf")).masked_fill(values == 0, 0.0)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    if excluded is not None:
        order = order.gather(-1, torch.sort(excluded.gather(-1, order).to(torch.uint8), dim=-1, stable=True).indices)
    return order


def router_topk(logits, top_k, scoring, renormalize, num_expert_groups, topk_groups, correction_bias,
                routed_scaling_factor):
    """Scores by softmax or sigmoid over the experts; experts chosen by ``scores + correction_bias``
    (DeepSeek-V3: the bias only steers the choice), optionally only within the ``topk_groups`` groups
    whose two best experts score highest; weights from the unbiased scores. Differentiable in
    ``logits`` by autograd (the choice itself is not).

    The choice rule every backend follows: without a bias, experts are ranked by their logits
    (both scorings are monotone, and probabilities that underflowed or rounded alike would tie);
    with one, by ``scores + correction_bias`` in float32. Group scores are sums of float32
    ``scores (+ correction_bias)``. Every ranking counts NaN as -inf and puts equal values in
    index order (see :func:`ranked`). A row with a NaN logit gets NaN weights."""
    logits = logits.to(compute_dtype(logits.dtype))
    scores = logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()
    biased = scores.detach() if correction_bias is None else scores.detach() + correction_bias.to(scores.dtype)
    choice = logits.detach() if correction_bias is None else biased
    excluded = None
    if num_expert_groups is not None:
        t, e = choice.shape
        size = e // num_expert_groups
        grouped = biased.masked_fill(biased.isnan(), float("-inf")).view(t, num_expert_groups, size)
        group_score = grouped.sort(dim=-1, descending=True).values[..., :2].sum(dim=-1)  # values: order moot
        kept = ranked(group_score)[:, :topk_groups]
        excluded = torch.ones_like(group_score, dtype=torch.bool).scatter_(1, kept, False)
        excluded = excluded.repeat_interleave(size, dim=1)
    ids = ranked(choice, excluded)[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.masked_fill(logits.detach().isnan().any(dim=-1, keepdim=True), float("nan"))
    return weights * routed_scaling_factor, ids


# ---- dispatch and combine ----

def sort_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """``(token_of_row [R], row_of_slot [T, k], offsets int32 [E])`` with ``R = T * k``.

    Slots (token ``t``'s ``j``-th choice, slot ``t * k + j``) sorted by expert, stably (tokens in
    order within an expert); dropped slots (id -1) go past ``offsets[-1]``, where ``token_of_row``
    is -1 and ``row_of_slot`` of the slot is -1. Everything stays on the device: no host sync.
    """
    t, k = topk_ids.shape
    ids = topk_ids.reshape(-1).long()
    key = torch.where(ids < 0, num_experts, ids)
    order = torch.sort(key, stable=True).indices  # slot of each row
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, key, torch.ones_like(key))
    offsets = counts[:num_experts].cumsum(0).to(torch.int32)
    dropped = ids < 0
    token_of_row = torch.where(dropped[order], -1, order // k)
    row_of_slot = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=ids.device))
    row_of_slot = row_of_slot.masked_fill(dropped, -1).view(t, k)
    return token_of_row, row_of_slot, offsets


def moe_gather(x, token_of_row):
    rows = x.index_select(0, token_of_row.clamp(min=0))
    return rows.masked_fill_((token_of_row < 0)[:, None], 0)


def moe_combine(y, row_of_slot, weights, out_dtype):
    acc_dtype = compute_dtype(y.dtype)
    out = None
    # one choice at a time, in slot order (deterministic, as the kernels), [T, N] at a time so that
    # the float32 terms stay in cache
    for j in range(row_of_slot.shape[1]):
        slot = row_of_slot[:, j]
        term = y.index_select(0, slot.clamp(min=0)).to(acc_dtype).mul_(weights[:, j, None].to(acc_dtype))
        term.masked_fill_((slot < 0)[:, None], 0)  # a dropped slot's row is never read
        out = term if out is None else out.add_(term)
    return out.to(out_dtype)


# ---- grouped GEMM ----

def _segments(offsets: torch.Tensor):
    ends = offsets.tolist()
    return list(zip([0, *ends[:-1]], ends))


def grouped_mm_naive(x, w, offsets, out_dtype):
    """The definition: one matmul per expert's rows; ``w [E, K, N]`` (any strides)."""
    acc = compute_dtype(x.dtype)
    out = torch.zeros(x.shape[0], w.shape[2], dtype=acc, device=x.device)
    for e, (start, end) in enumerate(_segments(offsets)):
        if end > start:  # an idle expert's weights are not even converted
            out[start:end] = x[start:end].to(acc) @ w[e].to(acc)
    return out.to(out_dtype)


def _expert_matrices(w, w_transposed):
    return w.transpose(1, 2) if w_transposed else w


def _aligned(t: torch.Tensor) -> bool:
    """What ``torch.nn.functional.grouped_mm`` asks of its operands: 16-byte strides and start."""
    return t.data_ptr() % 16 == 0 and all(s == 1 or s * t.element_size() % 16 == 0 for s in t.stride())


def grouped_mm(x, w, offsets, out_dtype, w_transposed):
    """The reference backend's kernel: ``torch.nn.functional.grouped_mm`` where it takes the inputs
    (its output in x's dtype, aligned operands), else one float32-accumulated matmul per expert."""
    w = _expert_matrices(w, w_transposed)
    if (out_dtype == x.dtype != torch.float64 and x.shape[0] and _aligned(x) and _aligned(w)
            and hasattr(F, "grouped_mm")):
        out = F.grouped_mm(x, w, offs=offsets.to(torch.int32))
        return out.masked_fill_((torch.arange(x.shape[0], device=x.device) >= offsets[-1])[:, None], 0)
    return grouped_mm_naive(x, w, offsets, out_dtype)


def grouped_mm_weight_grad(x, dy, offsets, num_experts, out_dtype):
    acc = compute_dtype(x.dtype)
    out = torch.zeros(num_experts, x.shape[1], dy.shape[1], dtype=out_dtype, device=x.device)
    for e, (start, end) in enumerate(_segments(offsets)):
        if end > start:
            out[e] = (x[start:end].to(acc).T @ dy[start:end].to(acc)).to(out_dtype)
    return out


# ---- the fused layer ----

def activate(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``[.., 2I] -> [.., I]``: the gate half (first) through the activation, times the up half."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    gate = gate.clamp(max=SWIGLUOAI_LIMIT)
    up = up.clamp(-SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
    return (up + 1) * gate * torch.sigmoid(SWIGLUOAI_ALPHA * gate)


def dequantize_weights(w, scale, block_shape):
    """float32 ``[E, N, K]`` weights from fp8 entries: ``scale`` per output channel ``[E, N]``, or
    per ``block_shape = [bn, bk]`` block ``[E, ceil(N / bn), ceil(K / bk)]``; None: not quantized."""
    if scale is None:
        return w
    w = w.float()
    if block_shape is None:
        return w * scale[..., None]
    bn, bk = block_shape
    full = scale.repeat_interleave(bn, dim=1)[:, :w.shape[1]].repeat_interleave(bk, dim=2)[:, :, :w.shape[2]]
    return w * full


def fused_moe_naive(x, w13, w2, topk_weights, topk_ids, activation, w13_scale=None, w2_scale=None, block_shape=None):
    """The definition: for each token and each of its experts, gate/up projection, activation,
    down projection, weighted by the routing weight, summed over the token's experts in float32."""
    acc = compute_dtype(x.dtype)
    w13 = dequantize_weights(w13, w13_scale, block_shape).to(acc)
    w2 = dequantize_weights(w2, w2_scale, block_shape).to(acc)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            h = activate(w13[e] @ x[t].to(acc), activation)
            if x.dtype != acc:  # kernels hand the intermediate to the second GEMM in x's dtype
                h = h.to(x.dtype).to(acc)
            out[t] += topk_weights[t, j].to(acc) * (w2[e] @ h)
    return out.to(x.dtype)


def _product(a, b):
    """``a @ b.T`` in float32 (float64 for float64 ``b``), ``b`` a weight read in its own dtype.

    A 16-bit ``b`` is not widened (decode reads each weight once, and widening it took longer than
    the GEMMs): the product accumulates in float32 and is rounded once to 16 bits, as transformers'
    experts round theirs; the layer is then as accurate as theirs against a float64 truth
    (tests/test_moe_transformers.py), at a third of the time a float32-accurate correction cost."""
    return (a.to(b.dtype) @ b.T).to(compute_dtype(b.dtype))


def fused_moe(x, w13, w2, topk_weights, token_of_row, row_of_slot, offsets, activation, w13_scale, w2_scale,
              block_shape):
    """The reference backend's kernel: the unfused composition, expert by expert over the experts
    that have rows; both GEMMs accumulate in float32 (:func:`_product`), the intermediate rounded to
    x's dtype between them. Float8 weights are dequantized only for the experts that have rows."""
    acc = compute_dtype(x.dtype)
    rows = moe_gather(x, token_of_row)
    y = torch.zeros(rows.shape[0], x.shape[1], dtype=acc, device=x.device)
    for e, (start, end) in enumerate(_segments(offsets)):
        if end == start:
            continue
        if w13_scale is None:
            w13_e, w2_e = w13[e], w2[e]
        else:
            w13_e, w2_e = (dequantize_weights(w[e:e + 1], s[e:e + 1], block_shape)[0].to(acc)
                           for w, s in ((w13, w13_scale), (w2, w2_scale)))
        h = activate(_product(rows[start:end], w13_e), activation).to(x.dtype)
        y[start:end] = _product(h, w2_e)
    return moe_combine(y, row_of_slot, topk_weights, x.dtype)

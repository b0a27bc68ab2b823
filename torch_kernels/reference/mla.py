"""Multi-head latent attention (MLA) over a paged latent cache, in plain PyTorch.

DeepSeek-V2/V3 cache one latent row per token: the compressed key-value latent ``c`` (``Lr``
values) followed by the shared RoPE key ``k_pe`` (``R`` values), in a cache
``[num_blocks, block_size, Lr + R]`` addressed as the paged attention family's caches are (slot
``block * block_size + offset``, pages through ``block_table``). With the up-projections absorbed
into the query and the output, attention runs in the latent space: the logit of query ``t``, head
``h`` and position ``s`` is ``q_nope[t, h] . c[s] + q_pe[t, h] . k_pe[s]``, and the values are the
latents ``c[s]`` themselves, so one cache row serves as key (all ``Lr + R``) and value (its first
``Lr``).

Kernel contract (inputs checked by ``torch_kernels.ops.mla``; the cache is read and written in
place, never copied; ``scale`` is float32 ``[1]``):

- ``mla_reshape_and_cache(kv_c, k_pe, kv_cache, slot_mapping, scale)`` stores
  ``cat(kv_c[t], k_pe[t]) / scale``, rounded to the cache dtype as
  ``torch_kernels.reference.paged_attention.quantize`` rounds, at slot ``slot_mapping[t]`` for
  every slot >= 0, and touches nothing else.
- ``ragged_paged_mla(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, sm_scale,
  topk_indices, scale)`` returns ``(out [T, H, Lr] in q_nope's dtype, lse [T, H] float32)``:
  causal attention (query ``i`` of a sequence with ``q_len`` queries and ``kv_len`` keys sees
  positions ``<= kv_len - q_len + i``), restricted to the positions ``topk_indices[t]`` lists when
  given (-1 entries list nothing; a position listed twice counts once; the op passes each row
  sorted, a repeat replaced by -1, so kernels need not look for repeats). ``lse`` is the natural
  log-sum-exp of the scaled logits a query attends over; a query attending to nothing gets zeros
  and ``lse = -inf``. Logits, softmax and sums are float32.
"""

from __future__ import annotations

import torch

from .paged_attention import quantize


def mla_reshape_and_cache(kv_c, k_pe, kv_cache, slot_mapping, scale) -> None:
    """Write each token's latent and RoPE key to its slot; slot -1 (padding) is skipped."""
    real = slot_mapping >= 0
    slots = slot_mapping[real]
    rows = torch.cat([kv_c[real], k_pe[real]], dim=-1)[:, None]  # one "kv head"
    block_size = kv_cache.shape[1]
    kv_cache[slots // block_size, slots % block_size] = quantize(rows, scale, kv_cache.dtype)[:, 0]


def sequence_rows(kv_cache, block_table, seq: int, kv_len: int, scale) -> torch.Tensor:
    """Sequence ``seq``'s first ``kv_len`` cache rows, float32 and dequantized: ``[kv_len, Lr + R]``."""
    block_size = kv_cache.shape[1]
    pages = block_table[seq, : -(-kv_len // block_size)].long()
    return kv_cache[pages].flatten(0, 1)[:kv_len].float() * scale


def visible(q_len: int, kv_len: int, topk=None) -> torch.Tensor:
    """``[q_len, kv_len]``: which positions each query of a sequence attends to (causal, and
    among its ``topk`` ``[q_len, k]`` positions when given)."""
    positions = torch.arange(kv_len)
    seen = positions[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
    if topk is not None:
        chosen = torch.zeros(q_len, kv_len + 1, dtype=torch.bool)  # the last column takes the -1s
        chosen.scatter_(1, torch.where(topk < 0, kv_len, topk).long().cpu(), True)
        seen &= chosen[:, :kv_len]
    return seen


def ragged_paged_mla(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, sm_scale, topk_indices, scale):
    """The definition and the reference backend: per sequence, its rows gathered once, every
    head's logits in one einsum, the masked softmax, the latents weighted."""
    latent = q_nope.shape[-1]
    out = torch.zeros(q_nope.shape, dtype=torch.float32, device=q_nope.device)
    lse = torch.full(q_nope.shape[:2], float("-inf"), device=q_nope.device)
    cu, lens = cu_q_lens.tolist(), kv_lens.tolist()
    for s, kv_len in enumerate(lens):
        start, end = cu[s], cu[s + 1]
        if start == end:
            continue
        rows = sequence_rows(kv_cache, block_table, s, kv_len, scale)
        c, k_pe = rows[:, :latent], rows[:, latent:]
        logits = (torch.einsum("qhl,kl->hqk", q_nope[start:end].float(), c)
                  + torch.einsum("qhr,kr->hqk", q_pe[start:end].float(), k_pe)) * sm_scale
        topk = None if topk_indices is None else topk_indices[start:end]
        seen = visible(end - start, kv_len, topk).to(logits.device)
        logits = logits.masked_fill(~seen, float("-inf"))
        top = logits.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)  # finite for empty rows
        weights = torch.where(seen, (logits - top).exp(), 0.0)  # zero, not NaN, where nothing is seen
        total = weights.sum(-1)
        rows_out = torch.einsum("hqk,kl->qhl", weights, c) / total.clamp_min(torch.finfo(torch.float32).tiny).T[..., None]
        out[start:end] = rows_out
        lse[start:end] = (total.log() + top[..., 0]).T  # log 0 = -inf for empty rows
    return out.to(q_nope.dtype), lse


def indexer_topk(q, k_cache, weights, cu_q_lens, kv_lens, block_table, top_k: int) -> torch.Tensor:
    """DeepSeek-V3.2's lightning indexer fused with the selection: for each query, the ``top_k``
    visible positions of highest ``sum_h weights[t, h] * relu(q[t, h] . k[s])`` (float32), best
    first, equal scores lower position first, NaN scores as -inf; -1 past the visible count."""
    out = torch.full((q.shape[0], top_k), -1, dtype=torch.int32, device=q.device)
    cu, lens = cu_q_lens.tolist(), kv_lens.tolist()
    for s, kv_len in enumerate(lens):
        start, end = cu[s], cu[s + 1]
        if start == end:
            continue
        keys = sequence_rows(k_cache, block_table, s, kv_len, 1.0)
        terms = torch.einsum("qhd,kd->qhk", q[start:end].float(), keys).relu() * weights[start:end, :, None].float()
        # the positive and negative weights' terms summed apart: an overflow is +inf or -inf, both ways NaN
        down = weights[start:end, :, None] < 0
        scores = terms.masked_fill(down, 0.0).sum(1) + terms.masked_fill(~down, 0.0).sum(1)
        scores = scores.nan_to_num(nan=float("-inf"))
        seen = visible(end - start, kv_len).to(scores.device)
        # a stable sort keeps equal scores in position order; unseen positions follow every seen one
        # of equal score because they come later in the row, and are then replaced by -1
        order = scores.masked_fill(~seen, float("-inf")).sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
        chosen = torch.where(seen.gather(1, order), order, -1)
        out[start:end, : chosen.shape[1]] = chosen.to(torch.int32)
    return out

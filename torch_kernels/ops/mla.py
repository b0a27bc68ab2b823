"""``torch_kernels::mla_reshape_and_cache`` and ``torch_kernels::ragged_paged_mla``: multi-head
latent attention (DeepSeek-V2/V3, Kimi K2) over a paged latent cache, in the absorbed form that
inference runs (the math and the kernel contract: ``torch_kernels.reference.mla``).

The batch description (``cu_q_lens``, ``kv_lens``, ``block_table``, ``slot_mapping``) and its
checks are the paged attention family's: the latent cache ``[num_blocks, block_size, Lr + R]`` is
addressed as its caches are, one latent row per token instead of ``Hkv`` key and value rows.
Both ops are inference-only; the write mutates the cache in place (declared in its schema).
"""

from __future__ import annotations

import math
import sys
from typing import Sequence

import torch

from .. import _checks, backends
from .._library import define, register_cost, tensor_bytes
from ..families import Case
from ..reference import mla as reference
from . import paged_attention as paged

__all__ = ["mla_reshape_and_cache", "ragged_paged_mla", "indexer_topk"]

WRITE_OP = "mla_reshape_and_cache"
OP = "ragged_paged_mla"
INDEXER_OP = "indexer_topk"

backends.register(WRITE_OP, "reference", reference.mla_reshape_and_cache)
backends.register(WRITE_OP, "triton", "triton_impl.mla:mla_reshape_and_cache")
backends.register(WRITE_OP, "pallas", "torch_kernels.pallas.mla:pallas_mla_reshape_and_cache")
backends.register(WRITE_OP, "sycl", "oneapi_impl.mla:mla_reshape_and_cache")
backends.register(OP, "reference", reference.ragged_paged_mla)
backends.register(OP, "triton", "triton_impl.mla:ragged_paged_mla")
backends.register(OP, "pallas", "torch_kernels.pallas.mla:pallas_ragged_paged_mla")
backends.register(OP, "sycl", "oneapi_impl.mla:ragged_paged_mla")
backends.register(INDEXER_OP, "reference", reference.indexer_topk)
backends.register(INDEXER_OP, "triton", "triton_impl.mla:indexer_topk")
backends.register(INDEXER_OP, "sycl", "oneapi_impl.mla:indexer_topk")
backends.register(INDEXER_OP, "pallas", "torch_kernels.pallas.mla:pallas_indexer_topk")

CACHE_DTYPES = paged.reference.QUANTIZED_DTYPES  # besides the inputs' own dtype


def _check_cache(kv_cache, dtype, width: int, width_what: str) -> None:
    _checks.tensor("kv_cache", kv_cache, ndim=3, dtypes=(dtype, *CACHE_DTYPES))
    _checks.size("kv_cache", 2, kv_cache.shape[2], width, width_what)
    if not paged.is_cache_layout(kv_cache):  # a copy would lose the write
        raise ValueError(f"kv_cache: expected a stride-1 last dimension and no two entries sharing memory (it is "
                         f"written in place), got strides {kv_cache.stride()} for shape {tuple(kv_cache.shape)}")
    if min(kv_cache.shape) == 0:
        raise ValueError(f"kv_cache: expected no empty dimension, got shape {tuple(kv_cache.shape)}")


def _check_scale(name: str, scale) -> None:
    if scale is None:
        return
    _checks.tensor(name, scale, dtypes=(torch.float32,))
    if scale.numel() != 1 or scale.dim() > 1:
        raise ValueError(f"{name}: expected one float32 scale ([] or [1]), got shape {tuple(scale.shape)}")


def _check_parts(latent_name: str, latent: torch.Tensor, rope_name: str, rope: torch.Tensor) -> None:
    """An empty latent or RoPE part is no MLA layer (DeepSeek's are 512 and 64); the kernels tile both."""
    if latent.shape[-1] == 0:
        raise ValueError(f"{latent_name}: expected a latent size Lr >= 1, got shape {tuple(latent.shape)}")
    if rope.shape[-1] == 0:
        raise ValueError(f"{rope_name}: expected a RoPE size R >= 1, got shape {tuple(rope.shape)}")


@_checks.remembers_layouts
def check_write_inputs(kv_c, k_pe, kv_cache, slot_mapping, scale=None) -> None:
    """Shapes, dtypes and devices of a ``mla_reshape_and_cache`` call (no data read)."""
    _checks.tensor("kv_c", kv_c, ndim=2, dtypes=paged.QUERY_DTYPES)
    _checks.tensor("k_pe", k_pe, ndim=2, dtypes=(kv_c.dtype,))
    _checks.size("k_pe", 0, k_pe.shape[0], kv_c.shape[0], "tokens T of kv_c")
    _check_parts("kv_c", kv_c, "k_pe", k_pe)
    _check_cache(kv_cache, kv_c.dtype, kv_c.shape[1] + k_pe.shape[1], "Lr + R of kv_c and k_pe")
    _checks.tensor("slot_mapping", slot_mapping, ndim=1, dtypes=paged.SLOT_DTYPES)
    _checks.size("slot_mapping", 0, slot_mapping.shape[0], kv_c.shape[0], "tokens T of kv_c")
    _check_scale("scale", scale)
    _checks.same_device(kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping,
                        **({} if scale is None else {"scale": scale}))


@_checks.remembers_layouts
def check_inputs(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, sm_scale, topk_indices=None,
                 kv_scale=None) -> None:
    """Shapes, dtypes, devices and scalars of a ``ragged_paged_mla`` call (no data read)."""
    _checks.tensor("q_nope", q_nope, ndim=3, dtypes=paged.QUERY_DTYPES)
    _checks.tensor("q_pe", q_pe, ndim=3, dtypes=(q_nope.dtype,))
    num_tokens, num_heads, _ = q_nope.shape
    if tuple(q_pe.shape[:2]) != (num_tokens, num_heads):
        raise ValueError(f"q_pe: expected tokens and heads {(num_tokens, num_heads)} (as q_nope), "
                         f"got shape {tuple(q_pe.shape)}")
    _check_parts("q_nope", q_nope, "q_pe", q_pe)
    _check_cache(kv_cache, q_nope.dtype, q_nope.shape[2] + q_pe.shape[2], "Lr + R of q_nope and q_pe")
    _checks.tensor("cu_q_lens", cu_q_lens, ndim=1, dtypes=(paged.INDEX_DTYPE,))
    _checks.tensor("kv_lens", kv_lens, ndim=1, dtypes=(paged.INDEX_DTYPE,))
    _checks.tensor("block_table", block_table, ndim=2, dtypes=(paged.INDEX_DTYPE,))
    num_seqs = kv_lens.shape[0]
    _checks.size("cu_q_lens", 0, cu_q_lens.shape[0], num_seqs + 1, "sequences S of kv_lens, plus one")
    _checks.size("block_table", 0, block_table.shape[0], num_seqs, "sequences S of kv_lens")
    paged.check_scalars(sm_scale)
    if topk_indices is not None:
        _checks.tensor("topk_indices", topk_indices, ndim=2, dtypes=(paged.INDEX_DTYPE,))
        _checks.size("topk_indices", 0, topk_indices.shape[0], num_tokens, "tokens T of q_nope")
        if topk_indices.shape[1] == 0:
            raise ValueError("topk_indices: expected at least one index per token, got shape "
                             f"{tuple(topk_indices.shape)}")
    _check_scale("kv_scale", kv_scale)
    _checks.same_device(q_nope=q_nope, q_pe=q_pe, kv_cache=kv_cache, cu_q_lens=cu_q_lens, kv_lens=kv_lens,
                        block_table=block_table,
                        **{name: t for name, t in (("topk_indices", topk_indices), ("kv_scale", kv_scale))
                           if t is not None})


def check_topk(topk_indices, cu_q_lens, kv_lens, checks: _checks.ValueChecks) -> torch.Tensor:
    """Each index is -1 (none) or a position of its token's sequence, in ``[0, kv_len)``; in
    deferred mode a bad one becomes -1."""
    num_tokens, num_seqs = topk_indices.shape[0], kv_lens.shape[0]
    if num_seqs:
        rows = torch.arange(num_tokens, device=cu_q_lens.device, dtype=cu_q_lens.dtype)
        seq = torch.searchsorted(cu_q_lens[1:], rows, right=True).clamp(max=num_seqs - 1)
        limit = kv_lens.long()[seq][:, None]
    else:  # no sequence: no position is anyone's (the lengths' check reports the rows)
        limit = torch.zeros(num_tokens, 1, dtype=torch.long, device=kv_lens.device)
    bad = (topk_indices < -1) | (topk_indices >= limit)

    def detail() -> str:
        token, column = (int(i) for i in bad.nonzero()[0])
        return f"got {int(topk_indices[token, column])} at [{token}, {column}] (kv_len {int(limit[token, 0])})"

    checks.add(bad, "topk_indices: expected -1 or a position in [0, kv_len) of the token's sequence", detail)
    return torch.where(bad, -1, topk_indices) if checks.deferred else topk_indices


def _scale(scale, device) -> torch.Tensor:
    """The kernels' form of a scale: float32 ``[1]`` (one for None)."""
    return torch.ones(1, device=device) if scale is None else scale.reshape(1).contiguous()


def deduplicated(topk_indices: torch.Tensor) -> torch.Tensor:
    """Each row sorted, a position listed twice kept once (the rest -1): the form every kernel
    receives, so that none has to find repeats."""
    ordered = topk_indices.sort(dim=1).values
    repeated = torch.zeros_like(ordered, dtype=torch.bool)
    repeated[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    return ordered.masked_fill(repeated, -1).contiguous()


def _device_type(t: torch.Tensor) -> str:
    return "cpu" if t.is_cpu else t.device.type


def _write_kernel(kv_c, k_pe, kv_cache, slot_mapping, scale=None, implementation=None):
    check_write_inputs(kv_c, k_pe, kv_cache, slot_mapping, scale)
    checks = _checks.ValueChecks(kv_c.device, backend=backends.planned(WRITE_OP, _device_type(kv_c), implementation))
    slot_mapping = paged.check_slots(slot_mapping, kv_cache, checks)
    scale = paged.scale_checks(checks, scale=scale)["scale"]
    checks.finish()
    backends.dispatch(WRITE_OP, _device_type(kv_c), implementation, kv_c.contiguous(), k_pe.contiguous(), kv_cache,
                      slot_mapping.to(torch.int64).contiguous(), _scale(scale, kv_c.device))


def _write_fake(kv_c, k_pe, kv_cache, slot_mapping, scale=None, implementation=None):
    check_write_inputs(kv_c, k_pe, kv_cache, slot_mapping, scale)


mla_reshape_and_cache_op = define(
    "mla_reshape_and_cache(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "Tensor? scale=None, str? implementation=None) -> ()",
    _write_kernel,
    _write_fake,
)


def _attention_kernel(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, sm_scale, topk_indices=None,
                      kv_scale=None, implementation=None):
    check_inputs(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, sm_scale, topk_indices, kv_scale)
    checks = _checks.ValueChecks(q_nope.device, backend=backends.planned(OP, _device_type(q_nope), implementation))
    given = cu_q_lens, kv_lens  # the indices are checked against these: made safe, they could hide a bad index
    cu_q_lens, kv_lens, block_table, bad_rows = paged.check_lengths(q_nope, kv_cache, cu_q_lens, kv_lens,
                                                                    block_table, checks)
    if topk_indices is not None:
        topk_indices = check_topk(topk_indices, *given, checks)
    kv_scale = paged.scale_checks(checks, kv_scale=kv_scale)["kv_scale"]
    checks.finish()
    if topk_indices is not None:
        topk_indices = deduplicated(topk_indices)
    if q_nope.shape[1] == 0:  # no head: an empty result on every backend alike
        return (torch.empty_like(q_nope, memory_format=torch.contiguous_format),
                q_nope.new_empty(q_nope.shape[:2], dtype=torch.float32))
    out, lse = backends.dispatch(OP, _device_type(q_nope), implementation, q_nope.contiguous(), q_pe.contiguous(),
                                 kv_cache, cu_q_lens.contiguous(), kv_lens.contiguous(), block_table.contiguous(),
                                 float(sm_scale), topk_indices, _scale(kv_scale, q_nope.device))
    return paged.nan_rows(out, bad_rows), paged.nan_rows(lse, bad_rows)


def _attention_fake(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, sm_scale, topk_indices=None,
                    kv_scale=None, implementation=None):
    check_inputs(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, sm_scale, topk_indices, kv_scale)
    return (torch.empty_like(q_nope, memory_format=torch.contiguous_format),
            q_nope.new_empty(q_nope.shape[:2], dtype=torch.float32))


ragged_paged_mla_op = define(
    "ragged_paged_mla(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor cu_q_lens, Tensor kv_lens, "
    "Tensor block_table, float sm_scale, Tensor? topk_indices=None, Tensor? kv_scale=None, "
    "str? implementation=None) -> (Tensor, Tensor)",
    _attention_kernel,
    _attention_fake,
)


@_checks.remembers_layouts
def check_indexer_inputs(q, k_cache, weights, cu_q_lens, kv_lens, block_table, top_k) -> None:
    """Shapes, dtypes, devices and scalars of an ``indexer_topk`` call (no data read)."""
    _checks.tensor("q", q, ndim=3, dtypes=paged.QUERY_DTYPES)
    _checks.tensor("k_cache", k_cache, ndim=3, dtypes=(q.dtype,))
    _checks.size("k_cache", 2, k_cache.shape[2], q.shape[2], "head size Di of q")
    if min(k_cache.shape) == 0 or (k_cache.stride(-1) != 1 and k_cache.shape[-1] > 1):
        raise ValueError(f"k_cache: expected no empty dimension and a stride-1 last dimension, got shape "
                         f"{tuple(k_cache.shape)} and strides {k_cache.stride()}")
    _checks.tensor("weights", weights, ndim=2, dtypes=tuple(dict.fromkeys((q.dtype, torch.float32))))
    if tuple(weights.shape) != tuple(q.shape[:2]):
        raise ValueError(f"weights: expected shape {tuple(q.shape[:2])} (tokens and heads of q), got {tuple(weights.shape)}")
    _checks.tensor("cu_q_lens", cu_q_lens, ndim=1, dtypes=(paged.INDEX_DTYPE,))
    _checks.tensor("kv_lens", kv_lens, ndim=1, dtypes=(paged.INDEX_DTYPE,))
    _checks.tensor("block_table", block_table, ndim=2, dtypes=(paged.INDEX_DTYPE,))
    _checks.size("cu_q_lens", 0, cu_q_lens.shape[0], kv_lens.shape[0] + 1, "sequences S of kv_lens, plus one")
    _checks.size("block_table", 0, block_table.shape[0], kv_lens.shape[0], "sequences S of kv_lens")
    check_top_k(top_k)
    _checks.same_device(q=q, k_cache=k_cache, weights=weights, cu_q_lens=cu_q_lens, kv_lens=kv_lens,
                        block_table=block_table)


def check_top_k(top_k) -> None:
    """An int in [1, 2**31 - 1]: positions are int32 (and the dispatcher takes no int past int64)."""
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise TypeError(f"top_k: expected an int, got {type(top_k).__name__} {top_k!r}")
    if not 1 <= top_k <= _checks.INT32_MAX:
        raise ValueError(f"top_k: expected an int in [1, {_checks.INT32_MAX}] (positions are int32), got {top_k}")


def _indexer_kernel(q, k_cache, weights, cu_q_lens, kv_lens, block_table, top_k, implementation=None):
    check_indexer_inputs(q, k_cache, weights, cu_q_lens, kv_lens, block_table, top_k)
    checks = _checks.ValueChecks(q.device, backend=backends.planned(INDEXER_OP, _device_type(q), implementation))
    cu_q_lens, kv_lens, block_table, bad_rows = paged.check_lengths(q, k_cache, cu_q_lens, kv_lens, block_table,
                                                                    checks)
    checks.finish()
    if q.shape[0] == 0:  # no query: an empty result on every backend alike
        return q.new_empty((0, top_k), dtype=torch.int32)
    if q.shape[1] == 0:  # no head: every score is the empty sum 0 (one zero head gives the same ranking)
        q, weights = q.new_zeros(q.shape[0], 1, q.shape[2]), weights.new_zeros(q.shape[0], 1)
    indices = backends.dispatch(INDEXER_OP, _device_type(q), implementation, q.contiguous(), k_cache,
                                weights.contiguous(), cu_q_lens.contiguous(), kv_lens.contiguous(),
                                block_table.contiguous(), top_k)
    return paged.nan_rows(indices, bad_rows)


def _indexer_fake(q, k_cache, weights, cu_q_lens, kv_lens, block_table, top_k, implementation=None):
    check_indexer_inputs(q, k_cache, weights, cu_q_lens, kv_lens, block_table, top_k)
    return q.new_empty((q.shape[0], top_k), dtype=torch.int32)


indexer_topk_op = define(
    "indexer_topk(Tensor q, Tensor k_cache, Tensor weights, Tensor cu_q_lens, Tensor kv_lens, Tensor block_table, "
    "int top_k, str? implementation=None) -> Tensor",
    _indexer_kernel,
    _indexer_fake,
)


def attended_pairs(q_lens: Sequence[int], kv_lens: Sequence[int], top_k: int | None = None) -> int:
    """How many (query, position) pairs a batch attends over at most (causal; at most ``top_k``
    per query when sparse)."""
    total = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        seen = range(kv_len - q_len + 1, kv_len + 1)  # query i sees kv_len - q_len + i + 1 positions
        total += sum(n if top_k is None else min(n, top_k) for n in seen)
    return total


def mla_bytes(num_heads: int, latent: int, rope: int, q_lens, kv_lens, query_itemsize: int,
              cache_itemsize: int) -> int:
    """What a dense call must move at least: each sequence's latent rows once, queries in, output
    out (the log-sum-exp and page tables, a few bytes per row, are left out)."""
    tokens = sum(q_lens)
    return (sum(kv_lens) * (latent + rope) * cache_itemsize
            + tokens * num_heads * (2 * latent + rope) * query_itemsize)


def _lengths(a) -> tuple[list[int], list[int]]:
    cu = a.cu_q_lens.tolist()
    return [e - s for s, e in zip(cu[:-1], cu[1:])], a.kv_lens.tolist()


def _attention_flops(a, out) -> int:
    """Logits over Lr + R and the weighted latents over Lr: 2 * H * (2 Lr + R) per attended pair."""
    top_k = None if a.topk_indices is None else a.topk_indices.shape[1]
    _, heads, latent = a.q_nope.shape
    return 2 * heads * (2 * latent + a.q_pe.shape[2]) * attended_pairs(*_lengths(a), top_k)


def _attention_bytes(a, out) -> int:
    _, heads, latent = a.q_nope.shape
    return (mla_bytes(heads, latent, a.q_pe.shape[2], *_lengths(a), a.q_nope.element_size(),
                      a.kv_cache.element_size()) + tensor_bytes(a.topk_indices, a.kv_scale))


def _write_bytes(a, out) -> int:
    """The real (slot >= 0) rows read and written, the slots read."""
    rows = int((a.slot_mapping >= 0).sum())
    width = a.kv_cache.shape[2]
    return rows * width * (a.kv_c.element_size() + a.kv_cache.element_size()) + tensor_bytes(a.slot_mapping, a.scale)


register_cost(ragged_paged_mla_op, flops=_attention_flops, bytes=_attention_bytes)
register_cost(mla_reshape_and_cache_op, flops=lambda a, out: 0, bytes=_write_bytes)  # a copy
register_cost(indexer_topk_op,  # the scores: 2 * Hi * Di per visible pair, plus the weighting
              flops=lambda a, out: (2 * a.q.shape[2] + 2) * a.q.shape[1] * attended_pairs(*_lengths(a)),
              bytes=lambda a, out: (sum(_lengths(a)[1]) * a.k_cache.shape[2] * a.k_cache.element_size()
                                    + tensor_bytes(a.q, a.weights, out)))


def mla_reshape_and_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor | None = None,
    implementation: str | Sequence[str] | None = None,
) -> None:
    """Write new tokens' latents and RoPE keys into a paged latent cache, in place.

    Token ``t``'s row ``cat(kv_c[t], k_pe[t])`` goes to slot ``slot_mapping[t]`` =
    ``block * block_size + offset``, i.e. ``kv_cache[block, offset]``; slot ``-1`` marks padding
    and is skipped. No other cache entry changes.

    Args:
        kv_c: ``[T, Lr]``, the compressed key-value latents; float16, bfloat16 or float32.
        k_pe: ``[T, R]`` of kv_c's dtype, the RoPE keys (shared by every head).
        kv_cache: ``[num_blocks, block_size, Lr + R]`` of kv_c's dtype or quantized (``int8``,
            ``float8_e4m3fn``, ``float8_e5m2``); any strides whose last is 1 and that keep entries
            apart (``torch_kernels.ops.paged_attention.is_cache_layout``).
        slot_mapping: int64 (or int32) ``[T]``; -1 or a slot, each slot at most once.
        scale: optional float32 ``[]`` or ``[1]``, finite and > 0: the cache stores
            ``value / scale`` rounded to its dtype, as ``reshape_and_cache`` does (NaN kept, as 0 in
            int8; fp8 and int8 saturate). ``None`` means 1.
        implementation: a backend name or ordered list (see ``torch_kernels.backends``).
    """
    paged.check_tensors(kv_c=kv_c, k_pe=k_pe, kv_cache=kv_cache, slot_mapping=slot_mapping, scale=scale)
    mla_reshape_and_cache_op(kv_c, k_pe, kv_cache, slot_mapping, scale, backends.implementation_arg(implementation))


def ragged_paged_mla(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    sm_scale: float,
    topk_indices: torch.Tensor | None = None,
    return_lse: bool = False,
    kv_scale: torch.Tensor | None = None,
    implementation: str | Sequence[str] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal multi-head latent attention for a ragged batch over a paged latent cache.

    The logit of query ``t``, head ``h`` and position ``s`` is
    ``(q_nope[t, h] . c[s] + q_pe[t, h] . k_pe[s]) * sm_scale``, where the cache row of ``s`` is
    ``cat(c[s], k_pe[s])``, and the output is the softmax-weighted sum of the latents ``c[s]``.
    With DeepSeek-V3's up-projections ``W_UK``, ``W_UV`` absorbed (``q_nope = q @ W_UK^T`` per
    head before, ``out @ W_UV`` after) this is its attention. Sequences and pages are described as
    for ``ragged_paged_attention``: sequence ``s`` owns query rows ``cu_q_lens[s]:cu_q_lens[s+1]``,
    its last positions of ``kv_lens[s]``, so one batch mixes decodes, prefill chunks and prompts;
    query ``i`` of a sequence with ``q_len`` queries sees positions ``<= kv_len - q_len + i``.

    Args:
        q_nope: ``[T, H, Lr]``, float16, bfloat16 or float32 (absorbed queries).
        q_pe: ``[T, H, R]`` of q_nope's dtype (RoPE queries).
        kv_cache: ``[num_blocks, block_size, Lr + R]`` of q_nope's dtype or quantized (``int8``,
            ``float8_e4m3fn``, ``float8_e5m2``; see ``kv_scale``), as ``mla_reshape_and_cache`` writes it.
        cu_q_lens: int32 ``[S+1]``; kv_lens: int32 ``[S]``; block_table: int32 ``[S, max_blocks]``.
        sm_scale: multiplies the logits (DeepSeek-V3: ``(dn + R) ** -0.5`` of the uncompressed heads).
        topk_indices: optional int32 ``[T, k]`` (DeepSeek-V3.2's sparse attention): each query attends
            only to the positions of its sequence it lists, still causally; -1 lists nothing and a
            position listed twice counts once. A query left with no position gets zeros (lse -inf).
        return_lse: also return the log-sum-exp of each query's scaled logits, float32 ``[T, H]``.
        kv_scale: optional float32 ``[]`` or ``[1]``, finite and > 0: a cache entry means ``entry * kv_scale``.
        implementation: a backend name or ordered list (see ``torch_kernels.backends``).

    Returns:
        ``[T, H, Lr]`` in q_nope's dtype (and ``lse`` with ``return_lse``). Softmax and sums are float32.

    NaN and inf: rows outside a sequence's first ``kv_len`` positions are never read; a NaN or inf
    inside them may reach every query of its sequence. In the deferred check mode
    (``torch_kernels.checks``) a sequence with a bad length or page id gets NaN rows (and lse) and a
    top-k index out of range is dropped, recorded for ``raise_deferred_errors``. Inference only: no
    backward.
    """
    paged.check_tensors(q_nope=q_nope, q_pe=q_pe, kv_cache=kv_cache, cu_q_lens=cu_q_lens, kv_lens=kv_lens,
                        block_table=block_table, topk_indices=topk_indices, kv_scale=kv_scale)
    paged.check_scalars(sm_scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__} {return_lse!r}")
    out, lse = ragged_paged_mla_op(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, float(sm_scale),
                                   topk_indices, kv_scale, backends.implementation_arg(implementation))
    return (out, lse) if return_lse else out


def indexer_topk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    weights: torch.Tensor,
    cu_q_lens: torch.Tensor,
    kv_lens: torch.Tensor,
    block_table: torch.Tensor,
    top_k: int,
    implementation: str | Sequence[str] | None = None,
) -> torch.Tensor:
    """DeepSeek-V3.2's lightning indexer fused with its top-k: which positions each query's sparse
    attention reads (``topk_indices`` of :func:`ragged_paged_mla`).

    The score of query ``t`` for position ``s`` of its sequence is
    ``sum_h weights[t, h] * relu(q[t, h] . k[s])`` in float32, over the positions it sees causally
    (as :func:`ragged_paged_mla` defines them). Each row lists the ``top_k`` best, highest score
    first, equal scores lower position first (deterministic on every backend), then -1 where the
    query sees fewer than ``top_k`` positions. NaN scores rank as -inf. Overflow, on every backend
    alike: a score is the float32 sum of its positive-weight heads' terms plus that of its
    negative-weight heads' terms, so finite inputs whose score passes float32's range score +inf
    (ranked first) or -inf (last), and NaN (last) when both sums overflow. In the deferred check
    mode (``torch_kernels.checks``) a sequence with a bad length or page id gets rows of -1.

    Args:
        q: ``[T, Hi, Di]``, float16, bfloat16 or float32 (the indexer's queries).
        k_cache: ``[num_blocks, block_size, Di]`` of q's dtype, the indexer's keys in pages addressed as
            the latent cache is (one row per token; a stride-1 last dimension).
        weights: ``[T, Hi]``, q's dtype or float32 (the per-head weights, softmax scale folded in).
        cu_q_lens, kv_lens, block_table: the batch, as for :func:`ragged_paged_mla`.
        top_k: how many positions per query (2048 in DeepSeek-V3.2).
        implementation: a backend name or ordered list (see ``torch_kernels.backends``).

    Returns:
        int32 ``[T, top_k]``. Inference only.
    """
    paged.check_tensors(q=q, k_cache=k_cache, weights=weights, cu_q_lens=cu_q_lens, kv_lens=kv_lens,
                        block_table=block_table)
    check_top_k(top_k)  # before the dispatcher parses it less clearly
    return indexer_topk_op(q, k_cache, weights, cu_q_lens, kv_lens, block_table, top_k,
                           backends.implementation_arg(implementation))


# ---- self-test cases ----

def mla_inputs(gen, dtype, device, q_lens=(1, 5, 1, 9), contexts=(30, 0, 45, 7), heads=4, latent=32, rope=16,
               block_size=16):
    """A ragged batch (decodes, a fresh prompt, a prefill chunk) over shuffled pages of a latent cache."""
    query, cache, _, cu_q_lens, kv_lens, block_table, _ = paged.paged_attention_inputs(
        gen, dtype, device, q_lens, contexts, heads=(heads, 1), head_size=latent + rope, block_size=block_size)
    return (query[..., :latent].contiguous(), query[..., latent:].contiguous(), cache[:, :, 0], cu_q_lens,
            kv_lens, block_table, (latent + rope) ** -0.5)


def mla_write_inputs(gen, dtype, device, tokens=23, latent=32, rope=16, block_size=16, num_blocks=5):
    """New latents and RoPE keys, a random cache, distinct slots (one of them -1, padding)."""
    kv_c = torch.randn(tokens, latent, generator=gen)
    k_pe = torch.randn(tokens, rope, generator=gen)
    cache = torch.randn(num_blocks, block_size, latent + rope, generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[tokens // 2] = -1
    return kv_c.to(device, dtype), k_pe.to(device, dtype), cache.to(device, dtype), slots.to(device)


def indexer_inputs(gen, dtype, device, q_lens=(1, 5, 1, 9), contexts=(30, 0, 45, 7), heads=4, head_size=32,
                   block_size=16, top_k=12):
    """A ragged batch of indexer queries, a paged key cache, positive per-head weights, ``top_k``."""
    q, k_cache, _, cu_q_lens, kv_lens, block_table, _ = paged.paged_attention_inputs(
        gen, dtype, device, q_lens, contexts, heads=(heads, 1), head_size=head_size, block_size=block_size)
    weights = torch.rand(q.shape[0], heads, generator=gen).to(device)
    return q, k_cache[:, :, 0], weights, cu_q_lens, kv_lens, block_table, top_k


def _indexer_definition(q, k_cache, weights, cu_q_lens, kv_lens, block_table, top_k):
    """A loop over queries and positions in float64: scores, then best first, lower position first."""
    out = torch.full((q.shape[0], top_k), -1, dtype=torch.int32)
    block_size = k_cache.shape[1]
    for s in range(len(kv_lens)):
        start, end, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
        for t in range(start, end):
            scored = []
            for pos in range(kv_len - (end - start) + (t - start) + 1):
                key = k_cache[int(block_table[s, pos // block_size]), pos % block_size].double()
                score = sum(float(weights[t, h]) * max(float(q[t, h].double() @ key), 0.0) for h in range(q.shape[1]))
                scored.append((-score, pos))
            for column, (_, pos) in enumerate(sorted(scored)[:top_k]):
                out[t, column] = pos
    return out.float()


def _indexer_run(*inputs, implementation=None):
    return indexer_topk(*inputs, implementation=implementation).float()


def _attention_definition(*inputs):
    return reference.ragged_paged_mla(*inputs, None, torch.ones(1, device=inputs[0].device))[0].float()


def _written(kv_c, k_pe, kv_cache, slot_mapping, implementation=None):
    cache = kv_cache.clone()
    mla_reshape_and_cache(kv_c, k_pe, cache, slot_mapping, implementation=implementation)
    return cache


def _write_definition(kv_c, k_pe, kv_cache, slot_mapping):
    cache = kv_cache.clone()
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            cache[slot // cache.shape[1], slot % cache.shape[1]] = torch.cat([kv_c[t], k_pe[t]])
    return cache


def selftest_cases() -> list[Case]:
    """The doctor's checks: attention against the reference, the write against a loop over slots,
    the indexer against a loop over queries and positions (equal indices: error 0)."""
    return [Case(OP, mla_inputs, ragged_paged_mla, _attention_definition),
            Case(WRITE_OP, mla_write_inputs, _written, _write_definition),
            Case(INDEXER_OP, indexer_inputs, _indexer_run, _indexer_definition)]


# ---- transformers' MLA layers, for kernelize ----
#
# transformers' MLA layers (DeepSeek-V3, V3.2, Kimi Linear) cache the compressed latent ``c`` and
# the shared RoPE key ``k_pe`` per token, then expand every cached token to per-head keys and
# values through ``kv_b_proj`` at each call. The forwards here stay in the latent space (the
# absorbed form): ``kv_b_proj``'s weight is ``[W_UK; W_UV]`` per head, the query's no-RoPE part
# becomes ``q_nope W_UK`` (``[T, H, Lr]``), ``ragged_paged_mla`` attends over the latents written by
# ``mla_reshape_and_cache``, and ``W_UV`` is applied to its output; V3.2's indexer picks each
# query's positions with ``indexer_topk``. The model's cache stays the record of the past (the
# layer still calls ``cache.update``); each call lays every batch row's latents into pages, one
# sequence a row (a left-padded row's real positions first: decoding a padded batch). A call the
# ops do not describe (a padded query, a packing mask, gradients, attention dropout, a static
# cache's mask over unwritten rows) runs the layer's own forward before anything is written, so
# such models keep working and stay exact.
#
# ``TRANSFORMERS_LAYERS`` maps each layer class to its forward, which
# ``torch_kernels.integrations.transformers.kernelize`` installs per instance, calling it as
# ``forward(module, original, implementation, *args, **kwargs)`` (``original``: the class's own
# forward); ``forward.ops`` lists the ops it runs, ``forward.unsupported(module)`` says why an
# instance cannot take it (None: it can).

LAYER_BLOCK_SIZE = 16  # pages of the per-call latent cache


def padding_starts(mask: torch.Tensor | None, batch: int, q_len: int) -> torch.Tensor | None:
    """Where each batch row's real positions start, int64 ``[B]``, if ``mask`` (transformers' 4D
    ``[B or 1, 1, T, S]``: bool, True attends, or additive, 0 attends and the dtype's min or -inf
    hides) is causal over the last ``T`` of ``S`` positions with each row's first ``starts[b]``
    hidden (left padding) and every query real; None for any other mask (a padded query, packed
    rows, a bias). No mask (transformers leaving causality to the attention) starts every row at 0."""
    if mask is None:
        return torch.zeros(batch, dtype=torch.int64)
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[0] not in (1, batch) or mask.shape[2] != q_len:
        return None
    if mask.dtype == torch.bool:
        seen = mask[:, 0]
    else:
        seen = mask[:, 0] == 0
        if not bool((seen | (mask[:, 0] == float("-inf")) | (mask[:, 0] == torch.finfo(mask.dtype).min)).all()):
            return None  # a bias, not a mask
    kv_len = mask.shape[-1]
    starts = (~seen[:, -1]).long().cumprod(-1).sum(-1)  # the last query's leading hidden positions
    positions = torch.arange(kv_len, device=mask.device)
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril(kv_len - q_len)
    expected = causal & (positions >= starts[:, None])[:, None, :]
    if not bool((seen == expected).all()) or bool((starts > kv_len - q_len).any()):
        return None
    return starts.expand(batch).cpu()


def _latent_path(module, hidden_states, attention_mask, cache, kwargs) -> torch.Tensor | None:
    """Each batch row's first real position if this call is one the ops describe, else None (the
    layer's own forward runs). Decided before anything is written to ``cache``."""
    if torch.is_grad_enabled() and (hidden_states.requires_grad or any(p.requires_grad for p in module.parameters())):
        return None  # the ops are inference-only
    if module.training and module.attention_dropout > 0:
        return None
    if kwargs.get("cu_seq_lens_q") is not None:
        return None  # packed rows: the mask (or the flash kwargs) describe them, not plain causality
    if attention_mask is not None:
        past = 0 if cache is None else cache.get_seq_length(module.layer_idx)
        if attention_mask.shape[-1] != past + hidden_states.shape[1]:
            return None  # a mask wider than the positions (a static cache's): which are real is its to say
    return padding_starts(attention_mask, *hidden_states.shape[:2])


def project_queries(module, hidden_states, q_resid=None):
    """``(q_nope [B, H, T, dn], q_pe [B, H, T, R])``, as the layer projects them (RoPE not applied);
    ``q_resid``: the low-rank query's normed latent, ``q_a_layernorm(q_a_proj(x))``, where the caller
    has it already (DeepSeek-V3.2's indexer reads it too)."""
    batch, length = hidden_states.shape[:2]
    if getattr(module, "q_lora_rank", None) is None:
        q = module.q_proj(hidden_states)
    else:
        if q_resid is None:
            q_resid = module.q_a_layernorm(module.q_a_proj(hidden_states))
        q = module.q_b_proj(q_resid)
    q = q.view(batch, length, -1, module.qk_head_dim).transpose(1, 2)
    return q.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)


def project_latents(module, hidden_states):
    """``(c [B, 1, T, Lr]`` normed, ``k_pe [B, 1, T, R])`` (RoPE not applied), the cache's entries."""
    batch, length = hidden_states.shape[:2]
    c, k_pe = module.kv_a_proj_with_mqa(hidden_states).split([module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    return (module.kv_a_layernorm(c).view(batch, 1, length, module.kv_lora_rank),
            k_pe.view(batch, 1, length, module.qk_rope_head_dim))


def absorbed_query(module, q_nope: torch.Tensor) -> torch.Tensor:
    """``q_nope [N, H, dn]`` (token-major) times each head's ``W_UK``: the latent-space query
    ``[N, H, Lr]`` that :func:`ragged_paged_mla` takes."""
    heads, nope = q_nope.shape[1:]
    weight = module.kv_b_proj.weight.view(heads, nope + module.v_head_dim, -1)
    return torch.einsum("thd,hdl->thl", q_nope, weight[:, :nope])


def value_output(module, out: torch.Tensor) -> torch.Tensor:
    """The attention's latent output ``[N, H, Lr]`` times each head's ``W_UV``: ``[N, H * dv]``,
    the input of ``o_proj``."""
    heads = out.shape[1]
    weight = module.kv_b_proj.weight.view(heads, -1, out.shape[2])
    return torch.einsum("thl,hvl->thv", out, weight[:, -module.v_head_dim:]).reshape(out.shape[0], -1)


def _batch(q_len: int, kv_lens: torch.Tensor, width: int, device):
    """``(cu_q_lens, kv_lens, block_table)`` of one sequence a batch row, ``q_len`` queries over
    ``kv_lens[b]`` positions, row ``b`` on pages ``b * nb ... (b + 1) * nb - 1`` (``nb`` pages hold
    ``width`` positions)."""
    batch, per_row = kv_lens.shape[0], math.ceil(width / LAYER_BLOCK_SIZE)
    cu_q_lens = torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
    table = torch.arange(batch * per_row, dtype=torch.int32, device=device).view(batch, per_row)
    return cu_q_lens, kv_lens.to(device, torch.int32), table


def _paged(rows: torch.Tensor, starts: torch.Tensor, written: int = 0) -> torch.Tensor:
    """``rows [B, S, W]`` in pages as :func:`_batch` addresses them, each row's real positions
    (from ``starts[b]``, CPU int64) first, all but the last ``written`` of them (left to the cache
    write); the rest of the pages zero."""
    batch, length, width = rows.shape
    per_row = math.ceil(length / LAYER_BLOCK_SIZE)
    cache = rows.new_zeros(batch * per_row, LAYER_BLOCK_SIZE, width)
    pages = cache.view(batch, per_row * LAYER_BLOCK_SIZE, width)
    for b, start in enumerate(starts.tolist()):  # a plain copy a row: no gather for the common unpadded batch
        pages[b, :length - start - written] = rows[b, start:length - written]
    return cache


def latent_attention(module, q_nope, q_pe, c, k_pe, starts, implementation, topk_indices=None) -> torch.Tensor:
    """The layer's attention output after ``o_proj``, ``[B, T, hidden]``, from ``q_nope``/``q_pe``
    ``[B, H, T, dn / R]`` (RoPE applied) and every cached position's ``c [B, 1, S, Lr]`` and
    ``k_pe [B, 1, S, R]``, row ``b``'s real ones from ``starts[b]``, causal (query ``i`` sees
    positions ``<= S - T + i``)."""
    batch, heads, q_len, nope = q_nope.shape
    kv_len, latent = c.shape[2:]
    cu_q_lens, kv_lens, table = _batch(q_len, kv_len - starts, kv_len, c.device)
    # the positions cached before this call are copied in; this call's own go through the cache write
    c, k_pe = c[:, 0], k_pe[:, 0]
    cache = _paged(torch.cat([c, k_pe], dim=-1), starts, written=q_len)
    slots = (table.long()[:, :1] * LAYER_BLOCK_SIZE + kv_lens.long()[:, None] - q_len
             + torch.arange(q_len, device=c.device)).flatten()
    new = slice(kv_len - q_len, kv_len)  # every query is real: the last T positions of each row
    out = absorbed_attention(
        module, q_nope.transpose(1, 2).reshape(batch * q_len, heads, nope),
        q_pe.transpose(1, 2).reshape(batch * q_len, heads, -1), c[:, new].reshape(batch * q_len, latent),
        k_pe[:, new].reshape(batch * q_len, -1), cache, cu_q_lens, kv_lens, table, slots, implementation, topk_indices)
    return out.view(batch, q_len, -1)


def absorbed_attention(module, q_nope, q_pe, c, k_pe, kv_cache, cu_q_lens, kv_lens, block_table, slot_mapping,
                       implementation, topk_indices=None) -> torch.Tensor:
    """The layer's attention output after ``o_proj``, ``[N, hidden]``, of a ragged batch of ``N``
    token-major queries ``q_nope [N, H, dn]``, ``q_pe [N, H, R]`` (RoPE applied): this call's latents
    ``c [N, Lr]`` and RoPE keys ``k_pe [N, R]`` written into ``kv_cache`` at ``slot_mapping``, then
    attention in the latent space (``W_UK`` absorbed into the query, ``W_UV`` applied after)."""
    mla_reshape_and_cache(c, k_pe, kv_cache, slot_mapping, implementation=implementation)
    out = ragged_paged_mla(absorbed_query(module, q_nope), q_pe, kv_cache, cu_q_lens, kv_lens, block_table,
                           module.scaling, topk_indices=topk_indices, implementation=implementation)
    return module.o_proj(value_output(module, out))


def _cached(module, cache, c, k_pe, attention_mask, kwargs):
    """Every position's ``(c, k_pe)``: this call's through the model's cache, as the layer does."""
    if cache is not None:
        c, k_pe = cache.update(c, k_pe, module.layer_idx, kwargs=kwargs)
    if attention_mask is not None and attention_mask.shape[-1] != c.shape[2]:
        # the mask was checked causal over its own width before the cache was touched
        raise RuntimeError(f"the attention mask covers {attention_mask.shape[-1]} positions, the cache "
                           f"{c.shape[2]}: the latent path cannot tell which are real")
    return c, k_pe


def _modeling(original):
    """The modeling module of the layer's class (its RoPE functions)."""
    return sys.modules[original.__module__]


def deepseek_v3_rope(module, original=None):
    """The RoPE function DeepSeek-V3's layer applies to ``(q_pe, k_pe, cos, sin)``: interleaved pairs
    or halves, as its config says (``original``: a function of its modeling module, else the
    layer's class's)."""
    modeling = _modeling(original if original is not None else type(module))
    return modeling.apply_rotary_pos_emb_interleave if module.config.rope_interleave else modeling.apply_rotary_pos_emb


def deepseek_v3_attention(module, original, implementation, hidden_states, position_embeddings=None,
                          attention_mask=None, cache=None, **kwargs):
    """``DeepseekV3Attention.forward`` in the latent space (``(out, None)``: no attention weights)."""
    starts = _latent_path(module, hidden_states, attention_mask, cache, kwargs)
    if starts is None:
        return original(module, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    q_nope, q_pe = project_queries(module, hidden_states)
    c, k_pe = project_latents(module, hidden_states)
    q_pe, k_pe = deepseek_v3_rope(module, original)(q_pe, k_pe, *position_embeddings)
    c, k_pe = _cached(module, cache, c, k_pe, attention_mask, kwargs)
    return latent_attention(module, q_nope, q_pe, c, k_pe, starts, implementation), None


def kimi_linear_attention(module, original, implementation, hidden_states, attention_mask=None, cache=None, **kwargs):
    """``KimiLinearAttention.forward`` (MLA without RoPE: the shared key part is not rotated) in the
    latent space."""
    starts = _latent_path(module, hidden_states, attention_mask, cache, kwargs)
    if starts is None:
        return original(module, hidden_states, attention_mask, cache=cache, **kwargs)
    q_nope, q_pe = project_queries(module, hidden_states)
    c, k_pe = project_latents(module, hidden_states)
    c, k_pe = _cached(module, cache, c, k_pe, attention_mask, kwargs)
    return latent_attention(module, q_nope, q_pe, c, k_pe, starts, implementation), None


def project_indexer(indexer, hidden_states, q_resid, position_embeddings, modeling):
    """DeepSeek-V3.2's indexer inputs as its forward projects them: ``(q [B, T, Hi, Di], k [B, T, Di],
    weights [B, T, Hi])``, half-split RoPE on the first R dims of ``q`` and ``k``, the per-head weights
    float32 with both of the indexer's scales folded in (``modeling``: the layer's modeling module)."""
    batch, length = hidden_states.shape[:2]
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(batch, length, indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    q_rot, k_rot = modeling.apply_rotary_pos_emb(q[..., :rope], k[..., :rope], *position_embeddings, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rope:]], dim=-1)
    k = torch.cat([k_rot, k[..., rope:]], dim=-1).squeeze(2)
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    return q, k, weights * (indexer.n_heads ** -0.5 * indexer.softmax_scale)


def _indexer_topk(indexer, hidden_states, q_resid, position_embeddings, cache, kv_len, starts, implementation,
                  modeling):
    """DeepSeek-V3.2's indexer selection through :func:`indexer_topk`, its keys through the cache's
    indexer store. Returns int32 ``[B*T, k]``."""
    batch, length = hidden_states.shape[:2]
    q, k, weights = project_indexer(indexer, hidden_states, q_resid, position_embeddings, modeling)
    if cache is not None:
        k = cache.update_indexer(k, indexer.layer_idx)
    if k.shape[1] != kv_len:
        raise RuntimeError(f"the indexer's cache holds {k.shape[1]} positions, the latent cache {kv_len}")
    cu_q_lens, kv_lens, table = _batch(length, kv_len - starts, kv_len, k.device)
    top_k = min(indexer.index_topk, kv_len)  # as the indexer takes it (positions it cannot see come out -1)
    return indexer_topk(q.reshape(batch * length, indexer.n_heads, -1), _paged(k, starts),
                        weights.reshape(batch * length, -1), cu_q_lens, kv_lens, table, top_k,
                        implementation=implementation)


def deepseek_v32_attention(module, original, implementation, hidden_states, position_embeddings=None,
                           attention_mask=None, cache=None, position_ids=None, **kwargs):
    """``DeepseekV32Attention.forward``: the indexer's top-k through :func:`indexer_topk`, then
    sparse latent attention over the selected positions (``topk_indices``)."""
    starts = _latent_path(module, hidden_states, attention_mask, cache, kwargs)
    if starts is None:
        return original(module, hidden_states, position_embeddings, attention_mask, cache=cache,
                        position_ids=position_ids, **kwargs)
    q_resid = module.q_a_layernorm(module.q_a_proj(hidden_states))
    q_nope, q_pe = project_queries(module, hidden_states, q_resid)
    c, k_pe = project_latents(module, hidden_states)
    modeling = _modeling(original)
    q_pe, k_pe = modeling.apply_rotary_pos_emb_interleave(q_pe, k_pe, *position_embeddings)
    c, k_pe = _cached(module, cache, c, k_pe, attention_mask, kwargs)
    topk = _indexer_topk(module.indexer, hidden_states, q_resid, position_embeddings, cache, c.shape[2], starts,
                         implementation, modeling)
    return latent_attention(module, q_nope, q_pe, c, k_pe, starts, implementation, topk_indices=topk), None


def unsupported(module) -> str | None:
    """Why ``module``'s weights cannot be absorbed (None if they can): ``kv_b_proj`` must be a plain
    ``Linear`` (a quantized checkpoint's layer holds no float matrix to split into W_UK and W_UV)."""
    if type(module.kv_b_proj) is not torch.nn.Linear or module.kv_b_proj.bias is not None:
        return (f"kv_b_proj is a {type(module.kv_b_proj).__name__} (with bias: {module.kv_b_proj.bias is not None}), "
                f"not a plain bias-free Linear whose weight splits into W_UK and W_UV")
    return None


deepseek_v3_attention.ops = kimi_linear_attention.ops = (ragged_paged_mla, mla_reshape_and_cache)
deepseek_v32_attention.ops = (ragged_paged_mla, mla_reshape_and_cache, indexer_topk)
for _forward in (deepseek_v3_attention, kimi_linear_attention, deepseek_v32_attention):
    _forward.unsupported = unsupported

_MODELS = "transformers.models."
TRANSFORMERS_LAYERS = {
    _MODELS + "deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention": deepseek_v3_attention,
    _MODELS + "deepseek_v32.modeling_deepseek_v32.DeepseekV32Attention": deepseek_v32_attention,
    _MODELS + "kimi_linear.modeling_kimi_linear.KimiLinearAttention": kimi_linear_attention,
}

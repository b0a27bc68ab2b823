"""Randomized differential test of ragged_paged_attention: hypothesis draws unusual but valid
inputs and every backend must agree with the definition on them.

Drawn together: block size 1, head sizes 80 and 96, GQA ratios 1..8, prefix pages shared by
several sequences, sliding window 1, extreme quantization scales, NaN garbage in every cache slot
no query may read, the poison check on every cache write. Examples per backend: ``harness.fuzz_settings``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, strategies as st

import torch_kernels
from harness import assert_close, backend_params, fuzz_settings, require_backend
from torch_kernels import backends
from torch_kernels.reference import paged_attention as paged_reference

QUANTIZED = paged_reference.QUANTIZED_DTYPES


@dataclasses.dataclass(frozen=True)
class PagedCase:
    q_lens: tuple[int, ...]
    contexts: tuple[int, ...]  # tokens already cached before the new ones
    shared_pages: int  # leading pages every sequence's block table shares (a cached prefix)
    block_size: int
    num_kv_heads: int
    group: int
    head_size: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    scales: tuple[float, ...] | None  # per kv head, for k and v
    sliding_window: int | None
    soft_cap: float | None
    fused: bool
    padding: tuple[int, ...]
    seed: int


@st.composite
def paged_cases(draw):
    block_size = draw(st.sampled_from((1, 2, 16, 32)))
    shared_pages = draw(st.integers(0, 2 if block_size > 2 else 6))
    num_seqs = draw(st.integers(1, 3))
    q_lens = tuple(draw(st.integers(0, 6)) for _ in range(num_seqs))
    # a sequence past its shared prefix: its new tokens land on pages of its own
    contexts = tuple(shared_pages * block_size + draw(st.integers(0, 40)) for _ in range(num_seqs))
    num_kv_heads = draw(st.integers(1, 2))
    dtype = draw(st.sampled_from((torch.float32, torch.float16, torch.bfloat16)))
    cache_dtype = draw(st.sampled_from((dtype, dtype, *QUANTIZED)))
    extreme = st.sampled_from((1e-3, 0.02, 1.0, 250.0))
    scales = tuple(draw(extreme) for _ in range(num_kv_heads)) if cache_dtype in QUANTIZED or draw(st.booleans()) \
        else None
    num_tokens = sum(q_lens)
    fused = draw(st.booleans())
    return PagedCase(
        q_lens=q_lens, contexts=contexts, shared_pages=shared_pages, block_size=block_size,
        num_kv_heads=num_kv_heads, group=draw(st.integers(1, 8)),
        head_size=draw(st.sampled_from((64, 80, 96, 128))), dtype=dtype, cache_dtype=cache_dtype, scales=scales,
        sliding_window=draw(st.none() | st.just(1) | st.integers(2, 30)),
        soft_cap=draw(st.none() | st.just(5.0)), fused=fused,
        padding=tuple(sorted(draw(st.sets(st.integers(0, num_tokens - 1), max_size=2)))) if fused and num_tokens
        else (),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _garbage(cache: torch.Tensor, where: torch.Tensor) -> None:
    """NaN (int8: random bytes) in the slots ``where`` of a ``[blocks, block_size, Hkv, D]`` cache."""
    flat = cache.view(-1, *cache.shape[2:])
    if cache.dtype == torch.int8:
        flat[where] = torch.randint(-128, 128, flat[where].shape, dtype=torch.int8)
    else:
        flat.view(torch.uint8)[where] = 0xFF  # NaN in every float dtype here


def make_paged(case: PagedCase):
    """Keyword arguments of ragged_paged_attention, and a mask of the slots it may write."""
    gen = torch.Generator().manual_seed(case.seed)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_size
    kv_lens = [c + q for c, q in zip(case.contexts, case.q_lens)]
    own_pages = [-(-kv // bs) - case.shared_pages for kv in kv_lens]
    num_blocks = case.shared_pages + sum(own_pages) + 2
    order = torch.randperm(num_blocks, generator=gen)
    shared, taken = order[:case.shared_pages].tolist(), case.shared_pages
    width = max(case.shared_pages + n for n in own_pages) + 1
    table = torch.full((len(kv_lens), width), num_blocks + 5, dtype=torch.int32)  # past the pages: garbage ids
    for s, n in enumerate(own_pages):
        table[s, :case.shared_pages] = torch.tensor(shared, dtype=torch.int32)
        table[s, case.shared_pages:case.shared_pages + n] = order[taken:taken + n].int()
        taken += n
    scale = None if case.scales is None else torch.tensor(case.scales)
    heads_scale = torch.ones(hkv) if scale is None else scale
    shape = (num_blocks, bs, hkv, d)
    caches = [paged_reference.quantize(torch.randn(shape, generator=gen) * heads_scale[:, None], heads_scale,
                                       case.cache_dtype) for _ in range(2)]
    slots = [int(table[s, p // bs]) * bs + p % bs
             for s, (c, q) in enumerate(zip(case.contexts, case.q_lens)) for p in range(c, c + q)]
    # entries some query attends to hold valid values; everything else holds NaN, which no query
    # may read: slots past kv_len, pages no sequence uses, positions outside every query's window
    read = torch.zeros(num_blocks * bs, dtype=torch.bool)
    for s, (c, q) in enumerate(zip(case.contexts, case.q_lens)):
        for p in range(c, c + q):
            for j in range(max(0, p - case.sliding_window + 1) if case.sliding_window else 0, p + 1):
                read[int(table[s, j // bs]) * bs + j % bs] = True
    valid = read.clone()
    valid[slots] = False  # the new tokens are written before they are read
    valid[[slots[i] for i in case.padding]] = True  # a padding token writes nothing: its slot keeps its entry
    for cache in caches:
        _garbage(cache, ~valid)
    t = sum(case.q_lens)
    kw = dict(
        query=torch.randn(t, hkv * case.group, d, generator=gen).to(case.dtype),
        key_cache=caches[0], value_cache=caches[1],
        cu_q_lens=torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32), block_table=table, sm_scale=d ** -0.5,
        sliding_window=case.sliding_window, soft_cap=case.soft_cap, k_scale=scale, v_scale=scale,
        key=torch.randn(t, hkv, d, generator=gen).to(case.dtype) * heads_scale[:, None].to(case.dtype),
        value=torch.randn(t, hkv, d, generator=gen).to(case.dtype) * heads_scale[:, None].to(case.dtype),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).reshape(-1),
    )
    kw["slot_mapping"][list(case.padding)] = -1
    if not case.fused:  # the new tokens are in the cache already
        paged_reference.reshape_and_cache(kw["key"], kw["value"], caches[0], caches[1], kw["slot_mapping"],
                                          heads_scale, heads_scale)
        for name in ("key", "value", "slot_mapping"):
            kw[name] = None
    return kw


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]).to(torch.int32)


@pytest.mark.parametrize("backend", backend_params("ragged_paged_attention"))
def test_paged_attention_fuzz(backend):
    """Output within the query dtype's tolerance of the definition's (float32 gets 10x: the
    definition's own float32 rounding); the cache written only at slot_mapping's slots, each holding
    its token quantized as the reference does (one step off at most where the write is fused)."""
    require_backend(backend)

    @fuzz_settings(backend)
    @given(case=paged_cases())
    def check(case):
        kw = make_paged(case)
        want_caches = [c.clone() for c in (kw["key_cache"], kw["value_cache"])]
        want = paged_reference.ragged_paged_attention_naive(
            **{**kw, "query": kw["query"].float(), "key_cache": want_caches[0], "value_cache": want_caches[1]})
        before = [c.clone() for c in (kw["key_cache"], kw["value_cache"])]
        out = torch_kernels.ragged_paged_attention(**kw, implementation=backend)
        assert backends.last_backend("ragged_paged_attention") == backend
        if out.numel():
            assert_close(out, want, case.dtype, scale=10 if case.dtype == torch.float32 else 1, what="output")
        written = torch.zeros(before[0].shape[0] * case.block_size, dtype=torch.bool)
        if case.fused:
            written[kw["slot_mapping"][kw["slot_mapping"] >= 0]] = True
        for name, got, old, expected in zip(("key_cache", "value_cache"), (kw["key_cache"], kw["value_cache"]),
                                            before, want_caches):
            flat, old_flat, want_flat = (c.view(-1, *c.shape[2:]) for c in (got, old, expected))
            assert torch.equal(_bits(flat[~written]), _bits(old_flat[~written])), f"{name}: a slot outside slot_mapping changed"
            off = (_bits(flat[written]) - _bits(want_flat[written])).abs()
            assert off.numel() == 0 or off.max() <= (0 if backend == "reference" else 1), f"{name}: written entries"

    check()

"""The SYCL paged-attention kernels (oneapi_impl.paged_attention) against the reference.

Random ragged batches (decode and prefill mixed, shuffled block tables with garbage past the
used pages, partial last pages), sliding window, soft cap, GQA, quantized caches with per-head
scales; the cache write bit for bit (encoders over edge values, poisoned caches), decoders over
every code, the fused write against write-then-attend, and the SPIR-V modules.
"""

from __future__ import annotations

import math

import pytest
import torch

from harness import require_backend
from torch_kernels.reference import paged_attention as reference

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
CACHE_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}  # of max |reference|


@pytest.fixture(scope="module")
def sycl():
    require_backend("sycl")
    from oneapi_impl import paged_attention

    return paged_attention


def _relative_error(out, expected):
    return ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def _scales(gen, num_kv_heads, cache_dtype):
    scale = torch.rand(num_kv_heads, generator=gen) + 0.5
    return scale / 32 if cache_dtype == torch.int8 else scale  # int8 entries then span about +-100


def _cache(gen, shape, dtype, scale):
    """Random cache entries: values quantized with the per-head scale (no NaN codes)."""
    values = torch.randn(shape, generator=gen) * scale[:, None]
    if dtype in FLOATS:
        return values.to(dtype)
    return reference.quantize(values, scale, dtype)


def _lengths(gen, num_seqs, max_context):
    """Query lengths: decodes (even s), prefills (odd s), one empty (s = 3); kv lengths: those
    plus some context (sequence 0 has at least one key)."""
    q_lens = [1 if s % 2 == 0 else int(torch.randint(2, 40, (1,), generator=gen)) for s in range(num_seqs)]
    if num_seqs > 3:
        q_lens[3] = 0
    kv_lens = [q + int(torch.randint(0, max_context, (1,), generator=gen)) for q in q_lens]
    kv_lens[0] = max(kv_lens[0], 1)
    return q_lens, kv_lens


def _batch(seed, query_dtype, cache_dtype, num_q_heads, num_kv_heads, head_size, block_size,
           num_seqs=7, max_context=70):
    gen = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = _lengths(gen, num_seqs, max_context)
    pages = [-(-k // block_size) for k in kv_lens]
    max_blocks = max(pages) + 2
    num_blocks = sum(pages) + 5
    order = torch.randperm(num_blocks, generator=gen).int()
    # entries past a sequence's pages are garbage: negative, out of range, anything
    block_table = torch.randint(-(2 ** 31), 2 ** 31 - 1, (num_seqs, max_blocks), generator=gen, dtype=torch.int32)
    used = 0
    for s, n in enumerate(pages):
        block_table[s, :n] = order[used:used + n]
        used += n
    k_scale, v_scale = (_scales(gen, num_kv_heads, cache_dtype) for _ in range(2))
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache, value_cache = _cache(gen, shape, cache_dtype, k_scale), _cache(gen, shape, cache_dtype, v_scale)
    query = torch.randn(sum(q_lens), num_q_heads, head_size, generator=gen).to(query_dtype)
    cu_q_lens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, cu_q_lens=cu_q_lens,
                kv_lens=torch.tensor(kv_lens, dtype=torch.int32), block_table=block_table,
                k_scale=k_scale, v_scale=v_scale)


def _new_tokens(seed, batch, padding=2):
    """Keys and values for the query tokens and their slots (a few -1: padding, not written)."""
    gen = torch.Generator().manual_seed(seed)
    query, key_cache = batch["query"], batch["key_cache"]
    block_size, num_kv_heads, head_size = key_cache.shape[1:]
    slots = []
    cu, kv_lens, table = batch["cu_q_lens"].tolist(), batch["kv_lens"].tolist(), batch["block_table"]
    for s in range(len(kv_lens)):
        for p in range(kv_lens[s] - (cu[s + 1] - cu[s]), kv_lens[s]):
            slots.append(int(table[s, p // block_size]) * block_size + p % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    slot_mapping[torch.randperm(len(slots), generator=gen)[:padding]] = -1
    shape = (query.shape[0], num_kv_heads, head_size)
    key = (torch.randn(shape, generator=gen) * batch["k_scale"][:, None]).to(query.dtype)
    value = (torch.randn(shape, generator=gen) * batch["v_scale"][:, None]).to(query.dtype)
    return dict(key=key, value=value, slot_mapping=slot_mapping)


def _attend(module, batch, sm_scale, window, cap, new=None, **kw):
    new = new or dict(key=None, value=None, slot_mapping=None)
    b = batch
    return module.ragged_paged_attention(b["query"], b["key_cache"], b["value_cache"], b["cu_q_lens"], b["kv_lens"],
                                         b["block_table"], sm_scale, window, cap, b["k_scale"], b["v_scale"],
                                         new["key"], new["value"], new["slot_mapping"], **kw)


def _naive(batch, sm_scale, window, cap, new=None):
    new = new or {}
    return reference.ragged_paged_attention_naive(**batch, sm_scale=sm_scale, sliding_window=window, soft_cap=cap, **new)


# (query dtype, cache dtype, head size, block size, Hq, Hkv, window, soft cap); few distinct
# (query dtype, cache dtype, head size) triples, as each is a SPIR-V build
CASES = [
    (torch.float32, torch.float32, 64, 16, 2, 2, None, None),
    (torch.float32, torch.float32, 128, 32, 4, 2, 9, None),
    (torch.float32, torch.int8, 64, 16, 8, 2, None, 20.0),
    (torch.float16, torch.float16, 128, 16, 4, 2, 30, 30.0),
    (torch.bfloat16, torch.bfloat16, 256, 32, 2, 2, None, None),
    (torch.float16, torch.float8_e4m3fn, 64, 32, 4, 2, None, None),
    (torch.bfloat16, torch.float8_e5m2, 128, 16, 8, 2, 5, None),
    (torch.float32, torch.float8_e4m3fn, 256, 16, 4, 1, None, 8.0),
    (torch.bfloat16, torch.int8, 256, 32, 4, 2, 17, None),
    (torch.float32, torch.float8_e5m2, 64, 32, 2, 2, 1, 3.0),
    (torch.float32, torch.float32, 64, 16, 32, 1, None, None),  # G = 32: two head chunks
    (torch.float32, torch.float32, 80, 24, 4, 2, 6, None),  # neither a power of two
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_attention_matches_reference(sycl, case):
    query_dtype, cache_dtype, head_size, block_size, hq, hkv, window, cap = case
    batch = _batch(1, query_dtype, cache_dtype, hq, hkv, head_size, block_size)
    sm_scale = head_size ** -0.5
    expected = _naive(batch, sm_scale, window, cap)
    out = _attend(sycl, batch, sm_scale, window, cap)
    assert out.dtype == query_dtype and out.shape == batch["query"].shape
    assert torch.isfinite(out).all()
    assert _relative_error(out, expected) <= TOLERANCE[query_dtype]


@pytest.mark.parametrize("layout", [(1, 6), (3, 4), (16, 1), (2, 5)], ids=str)
def test_layouts(sycl, layout):
    """Query blocks of other sizes and head chunks that split the group unevenly (G = 6)."""
    batch = _batch(2, torch.float32, torch.float32, 12, 2, 64, 16)
    expected = _naive(batch, 0.125, 11, None)
    out = _attend(sycl, batch, 0.125, 11, None, layout=sycl.Layout(*layout))
    assert _relative_error(out, expected) <= TOLERANCE[torch.float32]


def test_long_prefill_and_decode(sycl):
    """Thousands of keys in one sequence (many tiles, many pages) beside short ones."""
    batch = _batch(3, torch.float32, torch.float8_e4m3fn, 4, 2, 64, 128, num_seqs=3, max_context=1500)
    expected = _naive(batch, 0.125, None, None)
    assert _relative_error(_attend(sycl, batch, 0.125, None, None), expected) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("query_dtype, cache_dtype, head_size", [
    (torch.float32, torch.int8, 64), (torch.float16, torch.float8_e4m3fn, 64), (torch.bfloat16, torch.bfloat16, 256),
], ids=str)
def test_fused_write_equals_write_then_attend(sycl, query_dtype, cache_dtype, head_size):
    batch = _batch(4, query_dtype, cache_dtype, 4, 2, head_size, 16)
    new = _new_tokens(5, batch)
    separate = {k: v.clone() if k.endswith("cache") else v for k, v in batch.items()}
    truth = {k: v.clone() if k.endswith("cache") else v for k, v in batch.items()}

    fused_out = _attend(sycl, batch, 0.1, 13, 25.0, new)
    sycl.reshape_and_cache(new["key"], new["value"], separate["key_cache"], separate["value_cache"],
                           new["slot_mapping"], separate["k_scale"], separate["v_scale"])
    separate_out = _attend(sycl, separate, 0.1, 13, 25.0)
    expected = _naive(truth, 0.1, 13, 25.0, new)  # writes truth's caches the reference way

    assert torch.equal(fused_out, separate_out)
    for name in ("key_cache", "value_cache"):
        assert torch.equal(batch[name].view(torch.uint8), separate[name].view(torch.uint8))
        assert torch.equal(batch[name].view(torch.uint8), truth[name].view(torch.uint8))
    assert _relative_error(fused_out, expected) <= TOLERANCE[query_dtype]


def _poisoned(gen, shape, dtype):
    size = torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=gen, dtype=torch.uint8).view(dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float16, torch.int8], ids=str)
def test_write_touches_only_its_slots(sycl, cache_dtype):
    """Every cache byte outside slot_mapping is bit-identical after the write; the slots hold
    exactly the reference's bytes."""
    gen = torch.Generator().manual_seed(6)
    shape = (9, 16, 2, 64)
    key_cache, value_cache = _poisoned(gen, shape, cache_dtype), _poisoned(gen, shape, cache_dtype)
    before = [key_cache.clone(), value_cache.clone()]
    slot_mapping = torch.randperm(9 * 16, generator=gen)[:40]
    slot_mapping[::7] = -1
    key, value = (torch.randn(40, 2, 64, generator=gen).to(torch.float16) for _ in range(2))
    k_scale, v_scale = torch.tensor([0.02, 0.5]), torch.tensor([1.5, 0.03])
    sycl.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    reference.reshape_and_cache(key, value, before[0], before[1], slot_mapping, k_scale, v_scale)
    for got, want in zip((key_cache, value_cache), before):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_attention_ignores_poison_past_kv_lens(sycl):
    """Pages not in use and slots past kv_len hold random bytes (NaN codes too); attention,
    fused write included, reads none of them."""
    batch = _batch(7, torch.float16, torch.float8_e4m3fn, 4, 2, 64, 16)
    gen = torch.Generator().manual_seed(8)
    for name, scale in (("key_cache", "k_scale"), ("value_cache", "v_scale")):
        clean = batch[name]
        poisoned = _poisoned(gen, clean.shape, clean.dtype)
        # copy in the rows that sequences hold, position by position
        block_size = clean.shape[1]
        for s, kv_len in enumerate(batch["kv_lens"].tolist()):
            for p in range(kv_len):
                block = int(batch["block_table"][s, p // block_size])
                poisoned[block, p % block_size] = clean[block, p % block_size]
        batch[name] = poisoned
    new = _new_tokens(9, batch, padding=0)
    truth = {k: v.clone() if k.endswith("cache") else v for k, v in batch.items()}
    out = _attend(sycl, batch, 0.125, None, 10.0, new)
    assert torch.isfinite(out).all()
    assert _relative_error(out, _naive(truth, 0.125, None, 10.0, new)) <= TOLERANCE[torch.float16]


def _edge_values() -> torch.Tensor:
    """float32 values that probe every encoder: random bit patterns (subnormals, inf, NaN
    included), the cache formats' codes, their midpoints and the floats next to those, the
    saturation and overflow thresholds, int8's halves."""
    gen = torch.Generator().manual_seed(10)
    parts = [torch.randint(-(2 ** 31), 2 ** 31 - 1, (1 << 17,), generator=gen, dtype=torch.int64).int().view(torch.float32),
             torch.randn(1 << 15, generator=gen) * torch.exp2(torch.randint(-40, 20, (1 << 15,), generator=gen).float()),
             torch.linspace(-300, 300, 4801)]
    inf = torch.tensor(math.inf)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16):
        bits = torch.arange(1 << (8 * dtype.itemsize), dtype=torch.int32)
        codes = (bits.to(torch.uint8) if dtype.itemsize == 1 else bits.to(torch.int16)).view(dtype).float()
        codes = codes[torch.isfinite(codes)].unique()
        middle = ((codes[1:].double() + codes[:-1].double()) / 2).float()
        parts += [codes, middle, middle.nextafter(inf), middle.nextafter(-inf)]
    parts.append(torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 448, 464, 480, 57344, 61440, 65504, 65520,
                               2 ** -149, 2 ** -126, 2 ** -133, 1.5 * 2 ** -133, 1e-40, 2.5, -2.5, 127.5, -128.5, 3e38]))
    return torch.cat(parts)


@pytest.mark.parametrize("query_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("cache_dtype", ["query", *CACHE_DTYPES], ids=str)
def test_write_encoders_match_torch(sycl, query_dtype, cache_dtype):
    """x / scale in float32, then rounded to the cache dtype, bit for bit as the reference (a
    NaN only needs to stay a NaN in float16 / bfloat16 caches: torch itself gives different bits
    on its scalar and vector paths)."""
    cache_dtype = query_dtype if cache_dtype == "query" else cache_dtype
    values = _edge_values().to(query_dtype)
    head_size = 64
    rows = values.numel() // (2 * head_size)
    key = values[: rows * 2 * head_size].view(rows, 2, head_size)
    value = -key.flip(0)
    gen = torch.Generator().manual_seed(11)
    slot_mapping = torch.randperm(rows, generator=gen)
    slot_mapping[::97] = -1
    # per-head scales: one, and one that moves quotients onto other roundings (and subnormals)
    k_scale, v_scale = torch.tensor([1.0, 0.37]), torch.tensor([3.1e-3, 1.0])
    shape = (rows // 8 + 1, 8, 2, head_size)
    got = [torch.zeros(shape, dtype=cache_dtype) for _ in range(2)]
    want = [torch.zeros(shape, dtype=cache_dtype) for _ in range(2)]
    sycl.reshape_and_cache(key, value, *got, slot_mapping, k_scale, v_scale)
    reference.reshape_and_cache(key, value, *want, slot_mapping, k_scale, v_scale)  # int8 of NaN: 0, as the policy
    for g, w in zip(got, want):
        same = g.view(torch.uint8).view(-1, g.element_size()) == w.view(torch.uint8).view(-1, w.element_size())
        same = same.all(dim=1)
        if cache_dtype in FLOATS:
            same |= g.flatten().float().isnan() & w.flatten().float().isnan()
        bad = (~same).nonzero()[:5, 0]
        assert not len(bad), f"{len(bad)} codes differ, first at {bad.tolist()}: got {g.flatten()[bad]}, want {w.flatten()[bad]}"


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16,
                                         torch.bfloat16], ids=str)
def test_every_cache_code_decodes_as_torch(sycl, cache_dtype):
    """A sequence with one key attends to it with weight 1, so its output row is the value row:
    lay every finite code of the cache dtype out as value rows and read them back through
    attention; each NaN or inf code sits alone in a row of zeros, which must come back all NaN."""
    query_dtype = cache_dtype if cache_dtype in FLOATS else torch.float32
    head_size = 64
    bits = torch.arange(1 << (8 * cache_dtype.itemsize), dtype=torch.int32)
    codes = (bits.to(torch.uint8) if cache_dtype.itemsize == 1 else bits.to(torch.int16)).view(cache_dtype)
    finite, special = codes[torch.isfinite(codes.float())], codes[~torch.isfinite(codes.float())]
    finite = torch.cat([finite, torch.zeros(-finite.numel() % head_size, dtype=cache_dtype)]).view(-1, head_size)
    alone = torch.zeros(special.numel(), head_size, dtype=cache_dtype)
    alone[:, 0] = special
    rows = torch.cat([finite, alone])
    num_seqs = rows.shape[0]
    value_cache = rows.view(num_seqs, 1, 1, head_size)
    key_cache = torch.zeros_like(value_cache)
    ones = torch.ones(num_seqs, dtype=torch.int32)
    out = sycl.ragged_paged_attention(
        torch.ones(num_seqs, 1, head_size, dtype=query_dtype), key_cache, value_cache,
        torch.arange(num_seqs + 1, dtype=torch.int32), ones, torch.arange(num_seqs, dtype=torch.int32)[:, None],
        1.0, None, None, torch.ones(1), torch.ones(1), None, None, None).float().view(num_seqs, head_size)
    decoded, want = out[:len(finite)], finite.float()
    same = decoded == want  # -0 reads back as +0: fine
    assert same.all(), f"codes {finite[~same][:5]} decode to {decoded[~same][:5]}"
    assert out[len(finite):].isnan().all(), f"NaN / inf codes {special[~out[len(finite):].isnan().all(dim=1)][:5]}"


def test_empty_and_unsupported(sycl):
    batch = _batch(12, torch.float32, torch.float32, 2, 2, 64, 16)
    batch["query"] = batch["query"][:0]
    batch["cu_q_lens"] = torch.zeros_like(batch["cu_q_lens"])
    assert _attend(sycl, batch, 1.0, None, None).shape == (0, 2, 64)
    meta = {k: v.to("meta") for k, v in batch.items()}
    with pytest.raises(NotImplementedError, match="sycl"):
        _attend(sycl, meta, 1.0, None, None)
    with pytest.raises(NotImplementedError, match="sycl: soft_cap"):
        _attend(sycl, batch, 1.0, None, 1e300)


def test_spirv_binaries(sycl):
    binaries = sycl.spirv_binaries()
    assert len(binaries) == 12
    for spv in binaries:
        assert int.from_bytes(spv[:4], "little") == 0x07230203  # the SPIR-V magic number

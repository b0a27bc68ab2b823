"""The paged_attention family: ragged_paged_attention and reshape_and_cache on every backend.

Every backend is held to ``ragged_paged_attention_naive`` (the readable definition) on random
ragged batches drawn by hypothesis; the writes are held to ``reference.quantize`` bit for bit and
must leave every other cache byte alone; every backend follows the NaN/inf policy (entries a query
does not see never matter, a NaN or inf it sees makes exactly its rows NaN, writes keep NaN and
saturate); the op contract (input checks, inference-only autograd, opcheck, torch.compile,
profiler names, FLOP formula) is checked on top.

Examples are kept small (few tokens, few pages): triton runs in its CPU interpreter and pallas in
interpret mode, where a call costs about 0.1-1 s, and pallas compiles each new shape (about 4 s),
so the per-backend tests share the shapes of ``_fused_spec``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings, strategies as st

import torch_kernels
from torch_kernels import backends
from torch_kernels.ops import paged_attention as ops
from torch_kernels.reference import paged_attention as reference
from torch_kernels.selftest import relative_error

from harness import (
    FLOAT32_BYTES, assert_close, backend_params, compiled_fullgraph, counted_flops, nbytes, only_row, profiled,
    profiled_names, require_backend, run_opcheck,
)

OP, WRITE_OP = ops.OP, ops.WRITE_OP
BACKENDS = backend_params(OP)
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED = reference.QUANTIZED_DTYPES
BLOCK_SIZES = (16, 32, 64, 128)
SCALE_KINDS = ("none", "scalar", "one", "head")  # no scale, shape [], shape [1], shape [Hkv]
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# The definition computes in float32 too, so for float32 queries the outputs near zero carry both
# computations' rounding: up to ~1e-4 of the largest output (seen on the reference), 5x the float32
# tolerance; the max-norm error stays near 1e-6.
F32_SLACK = 10

# Generated examples per backend in the property test (the explicit ones run on top of these).
# Pallas compiles each new shape (about 4 s in interpret mode), so it gets the fewest.
EXAMPLES = {"reference": 40, "triton": 10, "pallas": 3, "sycl": 16}


def _dtype_id(dtype) -> str:
    return "same" if dtype is None else str(dtype).removeprefix("torch.")


# ---- random ragged batches ----

@dataclasses.dataclass(frozen=True)
class Spec:
    """What a batch looks like. Sequence ``s`` has ``q_lens[s]`` new tokens, the last of its
    ``kv_lens[s]`` positions; hypothesis draws these and ``make_batch`` builds the tensors."""

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_kv_heads: int = 1
    group: int = 1  # query heads per kv head: 1 is MHA, Hkv == 1 and group > 1 is MQA
    head_size: int = 64
    block_size: int = 16
    dtype: torch.dtype = torch.float32  # query (and new key/value) dtype
    cache_dtype: torch.dtype | None = None  # None: query's dtype
    scale: str = "none"  # one of SCALE_KINDS, for k_scale and v_scale
    sliding_window: int | None = None
    soft_cap: float | None = None
    logit_scale: float = 1.0  # sm_scale = logit_scale / sqrt(head_size)
    fused: bool = False  # pass the new tokens' key/value/slot_mapping to the attention call
    padding: tuple[int, ...] = ()  # tokens whose slot is -1 (they write nothing)
    spare_blocks: int = 2  # cache blocks no sequence uses
    extra_pages: int = 1  # block_table columns past the longest sequence's pages (garbage)
    seed: int = 0


@dataclasses.dataclass
class Batch:
    spec: Spec
    query: torch.Tensor  # [T, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], every slot holds a valid entry
    value_cache: torch.Tensor
    cu_q_lens: torch.Tensor  # int32 [S+1]
    kv_lens: torch.Tensor  # int32 [S]
    block_table: torch.Tensor  # int32 [S, max_blocks]; garbage past each sequence's pages
    sm_scale: float
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    key: torch.Tensor  # [T, Hkv, D] the new tokens, in query's dtype
    value: torch.Tensor
    slot_mapping: torch.Tensor  # int64 [T]: each new token's slot, -1 for spec.padding

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]

    def heads_scale(self, which: str) -> torch.Tensor:
        """k_scale or v_scale as the kernels see it: float32 [Hkv]."""
        scale = self.k_scale if which == "k" else self.v_scale
        hkv = self.spec.num_kv_heads
        return torch.ones(hkv) if scale is None else scale.reshape(-1).expand(hkv)

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_cache.clone(), self.value_cache.clone()

    def inputs(self, fused: bool | None = None, caches=None, query=None) -> dict:
        """Keyword arguments of ``torch_kernels.ragged_paged_attention`` for this batch."""
        fused = self.spec.fused if fused is None else fused
        key_cache, value_cache = caches if caches is not None else (self.key_cache, self.value_cache)
        kw = dict(query=self.query if query is None else query, key_cache=key_cache, value_cache=value_cache,
                  cu_q_lens=self.cu_q_lens, kv_lens=self.kv_lens, block_table=self.block_table,
                  sm_scale=self.sm_scale, sliding_window=self.spec.sliding_window, soft_cap=self.spec.soft_cap,
                  k_scale=self.k_scale, v_scale=self.v_scale)
        if fused:
            kw.update(key=self.key, value=self.value, slot_mapping=self.slot_mapping)
        return kw

    def attend(self, caches, fused=None, **extra) -> torch.Tensor:
        return torch_kernels.ragged_paged_attention(**self.inputs(fused, caches), **extra)

    def write(self, caches, **extra) -> None:
        torch_kernels.reshape_and_cache(self.key, self.value, *caches, self.slot_mapping, self.k_scale,
                                        self.v_scale, **extra)

    def expected(self, fused=None):
        """The definition's float32 output and the caches it leaves (on copies of this batch's)."""
        caches = self.caches()
        out = reference.ragged_paged_attention_naive(**self.inputs(fused, caches, query=self.query.float()))
        return out, caches


def _scale(kind: str, num_kv_heads: int, gen) -> torch.Tensor | None:
    if kind == "none":
        return None
    values = 1 / 48 + torch.rand(num_kv_heads if kind == "head" else 1, generator=gen) * (1 / 16 - 1 / 48)
    return values.reshape(()) if kind == "scalar" else values


def _cache_entries(gen, shape, dtype, heads_scale) -> torch.Tensor:
    values = torch.randn(shape, generator=gen)
    return reference.quantize(values, heads_scale, dtype) if dtype in QUANTIZED else values.to(dtype)


def slot_of(block_table, block_size: int, seq: int, position: int) -> int:
    return int(block_table[seq, position // block_size]) * block_size + position % block_size


def make_batch(spec: Spec) -> Batch:
    """Random tensors for ``spec``: each sequence's pages are scattered over a shuffled cache,
    block-table entries past a sequence's pages hold any int32, caches hold valid entries."""
    gen = torch.Generator().manual_seed(spec.seed)
    num_seqs, hkv, d, bs = len(spec.q_lens), spec.num_kv_heads, spec.head_size, spec.block_size
    hq = hkv * spec.group
    cache_dtype = spec.cache_dtype or spec.dtype
    pages = [-(-kv // bs) for kv in spec.kv_lens]
    num_blocks = sum(pages) + spec.spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    block_table = torch.randint(INT32_MIN, INT32_MAX, (num_seqs, max(pages, default=0) + spec.extra_pages),
                                generator=gen, dtype=torch.int64).to(torch.int32)
    taken = 0
    for s, n in enumerate(pages):
        block_table[s, :n] = order[taken:taken + n]
        taken += n
    k_scale, v_scale = _scale(spec.scale, hkv, gen), _scale(spec.scale, hkv, gen)
    batch = Batch(
        spec=spec,
        query=torch.randn(sum(spec.q_lens), hq, d, generator=gen).to(spec.dtype),
        key_cache=None, value_cache=None,
        cu_q_lens=torch.tensor([0, *torch.tensor(spec.q_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32),
        kv_lens=torch.tensor(spec.kv_lens, dtype=torch.int32),
        block_table=block_table,
        sm_scale=spec.logit_scale / math.sqrt(d),
        k_scale=k_scale, v_scale=v_scale,
        key=torch.randn(sum(spec.q_lens), hkv, d, generator=gen).to(spec.dtype),
        value=torch.randn(sum(spec.q_lens), hkv, d, generator=gen).to(spec.dtype),
        slot_mapping=None,
    )
    shape = (num_blocks, bs, hkv, d)
    batch.key_cache = _cache_entries(gen, shape, cache_dtype, batch.heads_scale("k"))
    batch.value_cache = _cache_entries(gen, shape, cache_dtype, batch.heads_scale("v"))
    slots = [slot_of(block_table, bs, s, kv - q + r)
             for s, (q, kv) in enumerate(zip(spec.q_lens, spec.kv_lens)) for r in range(q)]
    batch.slot_mapping = torch.tensor(slots, dtype=torch.int64)
    batch.slot_mapping[list(spec.padding)] = -1
    return batch


@st.composite
def specs(draw, max_seqs=4, max_q=8, max_ctx=160, head_sizes=(64, 64, 64, 128, 128, 256)):
    """Ragged batches mixing decode (one token), prefill (no context), chunked prefill and idle
    sequences (no new token), with partial or exactly full last pages."""
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    q_lens, kv_lens = [], []
    for _ in range(draw(st.integers(1, max_seqs))):
        kind = draw(st.sampled_from(("decode", "prefill", "chunk", "idle")))
        q = {"decode": 1, "idle": 0}[kind] if kind in ("decode", "idle") else draw(st.integers(1, max_q))
        kv = q if kind == "prefill" else q + draw(st.integers(1 if kind == "chunk" else 0, max_ctx))
        if kind != "prefill" and kv and draw(st.booleans()):  # a full last page
            kv = -(-kv // block_size) * block_size
        q_lens.append(q)
        kv_lens.append(kv)
    group = draw(st.sampled_from((1, 2, 4, 8)))
    num_kv_heads = 1 if group == 8 else draw(st.sampled_from((1, 2) if group == 4 else (1, 2, 3)))
    num_tokens = sum(q_lens)
    fused = draw(st.booleans())
    return Spec(
        q_lens=tuple(q_lens), kv_lens=tuple(kv_lens), num_kv_heads=num_kv_heads, group=group,
        head_size=draw(st.sampled_from(head_sizes)), block_size=block_size,
        dtype=draw(st.sampled_from(QUERY_DTYPES)),
        cache_dtype=draw(st.sampled_from((None, None, *QUANTIZED))),
        scale=draw(st.sampled_from(SCALE_KINDS)),
        sliding_window=draw(st.none() | st.integers(1, 64)),
        soft_cap=draw(st.none() | st.sampled_from((2.0, 10.0, 50.0))),
        logit_scale=draw(st.sampled_from((1.0, 0.5, 4.0))),
        fused=fused,
        padding=tuple(sorted(draw(st.sets(st.integers(0, num_tokens - 1), max_size=2)))) if fused and num_tokens else (),
        spare_blocks=draw(st.integers(1, 3)), extra_pages=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


# Run on every backend whatever hypothesis draws: together they cover MQA, GQA, every cache
# dtype and scale shape, windows, soft caps, padding, idle sequences and the big head size.
EXPLICIT_SPECS = [
    Spec(q_lens=(1, 1, 1, 1), kv_lens=(1, 17, 33, 100), num_kv_heads=1, group=8, head_size=128, block_size=16,
         dtype=torch.bfloat16, cache_dtype=torch.float8_e5m2, scale="head", fused=True, seed=1),
    Spec(q_lens=(0, 7, 0, 5, 1, 0), kv_lens=(9, 7, 40, 69, 64, 0), num_kv_heads=2, group=2, head_size=64,
         block_size=32, dtype=torch.float16, cache_dtype=torch.int8, scale="scalar", sliding_window=9, fused=True,
         padding=(3,), seed=2),
    Spec(q_lens=(3, 1), kv_lens=(130, 129), num_kv_heads=1, group=4, head_size=256, block_size=128,
         dtype=torch.float32, cache_dtype=torch.float8_e4m3fn, scale="one", soft_cap=10.0, logit_scale=4.0, seed=3),
    Spec(q_lens=(4, 2), kv_lens=(4, 50), num_kv_heads=3, group=1, head_size=64, block_size=64,
         dtype=torch.float32, sliding_window=1, extra_pages=2, seed=4),
    Spec(q_lens=(2, 6), kv_lens=(31, 6), num_kv_heads=2, group=4, head_size=64, block_size=16,
         dtype=torch.float16, scale="head", sliding_window=20, soft_cap=5.0, fused=True, padding=(0, 7), seed=5),
]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]).to(torch.int32)


def assert_entries_match(got: torch.Tensor, want: torch.Tensor, ulps: int = 0, what: str = "") -> None:
    """Bit for bit, or with ``ulps`` > 0 within that many steps of the entry dtype."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    if ulps == 0:
        equal = _bits(got) == _bits(want)
    else:
        equal = (_bits(got) == _bits(want)) | (got.float() == want.float()) | ((_bits(got) - _bits(want)).abs() <= ulps)
    if not equal.all():
        bad = (~equal).nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int((~equal).sum())} of {equal.numel()} entries differ, first at {bad}: "
                             f"got {got[tuple(bad)].item()} want {want[tuple(bad)].item()}")


def assert_attention_close(out, want, dtype, what=""):
    """harness.assert_close against the definition, with F32_SLACK for float32 queries."""
    assert_close(out, want, dtype, scale=F32_SLACK if dtype == torch.float32 else 1.0, what=what)


def _check_on_backend(spec: Spec, backend: str, ulps: int) -> None:
    batch = make_batch(spec)
    want, want_caches = batch.expected()
    caches = batch.caches()
    out = batch.attend(caches, implementation=backend)
    assert backends.last_backend(OP) == backend
    assert out.dtype == spec.dtype and out.shape == batch.query.shape
    if batch.num_tokens:
        assert_attention_close(out, want, spec.dtype, what=f"{backend} output")
    for name, got, expected in zip(("key_cache", "value_cache"), caches, want_caches):
        assert_entries_match(got, expected, ulps if spec.fused else 0, what=f"{backend} {name}")


def _property_settings(backend: str):
    fast = backend == "reference"  # a failure shrinks only where calls are cheap
    return settings(max_examples=EXAMPLES.get(backend, 12), deadline=None, derandomize=True, database=None,
                    phases=tuple(Phase) if fast else (Phase.explicit, Phase.generate),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_matches_definition(backend):
    """Random ragged batches on ``backend`` against ragged_paged_attention_naive: output within the
    query dtype's tolerance, caches written exactly (within one step off the reference)."""
    require_backend(backend)

    @_property_settings(backend)
    @given(spec=specs())
    def check(spec):
        _check_on_backend(spec, backend, ulps=0 if backend == "reference" else 1)

    for spec in EXPLICIT_SPECS:
        check = example(spec=spec)(check)
    check()


# The CPU default's tiling knobs: (query rows per unit, gathered key elements and logits elements
# per tile, the padding waste that closes a group); None keeps the default. Tiny budgets make it
# walk every page in a tile of its own (merging the tiles' softmax partials) and batch nothing;
# a waste of 1 batches every unit of a row count together.
REFERENCE_TILES = [None, (1, 1, 1, 0.0), (4, 3000, 200, 1.0), (7, 20000, 5000, 0.25), (256, 1 << 15, 1 << 12, 1.0)]


def _reference_tiles(tile):
    """A context where the CPU default tiles as ``tile`` (an entry of REFERENCE_TILES) says."""
    if tile is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for name, value in zip(("_MAX_Q_TILE", "_KEY_TILE_ELEMENTS", "_LOGIT_TILE_ELEMENTS", "_GROUP_WASTE"), tile):
        stack.enter_context(mock.patch.object(reference, name, value))
    return stack


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=specs(max_seqs=6, max_q=24, max_ctx=250, head_sizes=(64, 128)), tile=st.sampled_from(REFERENCE_TILES))
def test_vectorized_reference_matches_definition(spec, tile):
    """The CPU default against the definition on more and longer batches, with small tiles too
    (many units, groups and page tiles)."""
    with _reference_tiles(tile):
        _check_on_backend(spec, "reference", ulps=0)


def test_reference_plans_follow_the_batch_by_value():
    """The CPU default keeps the last batch's plan (a model's layers share one batch); a batch
    that differs only in block table entries, changed in place behind torch's back (through a
    numpy view, as serving engines fill their tables), or only in lengths, gets a plan of its own."""
    batch = make_batch(_fused_spec(fused=False))
    first = batch.attend(batch.caches(), implementation="reference")
    table = batch.block_table.numpy()
    table[3, :2] = table[3, :2][::-1].copy()  # the chunk's first two pages swapped, no version bump
    swapped = batch.attend(batch.caches(), implementation="reference")
    assert_attention_close(swapped, batch.expected()[0], torch.float32)
    assert not torch.equal(swapped, first)
    batch.kv_lens[3] -= 1  # one key fewer: the chunk's positions move
    shorter = batch.attend(batch.caches(), implementation="reference")
    assert_attention_close(shorter, batch.expected()[0], torch.float32)


def test_checks_follow_the_batch_by_value():
    """On the CPU a batch that passed the index checks is not checked again while it stays equal
    (a model's layers repeat it); a table, length or slot made invalid in place behind torch's back
    (numpy views: no version bump) after passing is caught on the next call, and so is a new scale."""
    batch = make_batch(_fused_spec())
    batch.attend(batch.caches())  # passes: remembered
    table = batch.block_table.numpy()
    table[3, 0] = batch.key_cache.shape[0]  # past the cache
    with pytest.raises(ValueError, match="block_table: expected block ids"):
        batch.attend(batch.caches())
    table[3, 0] = batch.block_table[1, 0]
    batch.attend(batch.caches(), fused=False)
    batch.kv_lens.numpy()[3] = batch.block_table.shape[1] * batch.spec.block_size + 1  # more pages than the table
    with pytest.raises(ValueError, match="kv_lens: expected at most"):
        batch.attend(batch.caches(), fused=False)
    batch = make_batch(_fused_spec())
    batch.attend(batch.caches())
    slots = batch.slot_mapping.numpy()
    slots[0] = slots[2]  # two tokens, one slot
    with pytest.raises(ValueError, match="slot_mapping: expected each slot at most once"):
        batch.attend(batch.caches())
    with pytest.raises(ValueError, match="slot_mapping: expected each slot at most once"):
        batch.write(batch.caches())
    batch = make_batch(_fused_spec(cache_dtype=torch.int8))
    batch.attend(batch.caches())
    with pytest.raises(ValueError, match="k_scale: expected finite scales > 0"):
        torch_kernels.ragged_paged_attention(**{**batch.inputs(caches=batch.caches()), "k_scale": -batch.k_scale})


# ---- the fused write, and what writes may touch ----

# (query dtype, cache dtype) of the per-backend tests below; they all use _fused_spec's shapes,
# so a backend that compiles per shape (pallas) compiles each pair once.
FUSED_CASES = [
    (torch.float32, None), (torch.float16, None), (torch.float32, torch.int8), (torch.float32, torch.float8_e4m3fn),
    (torch.bfloat16, torch.float8_e5m2),
]


def _fused_spec(dtype=torch.float32, cache_dtype=None, **changes) -> Spec:
    """Prefill, decode, an idle sequence and chunked prefill over 9 shuffled blocks of 16; tokens
    1 and 6 are padding (slot -1)."""
    base = Spec(q_lens=(3, 1, 0, 5), kv_lens=(3, 18, 7, 37), num_kv_heads=2, group=2, head_size=64, block_size=16,
                dtype=dtype, cache_dtype=cache_dtype, scale="head" if cache_dtype in QUANTIZED else "none",
                sliding_window=24, fused=True, padding=(1, 6), seed=11)
    return dataclasses.replace(base, **changes)


def _token_position(batch: Batch, t: int) -> tuple[int, int]:
    """(sequence, position) of query token ``t``."""
    s = int(torch.searchsorted(batch.cu_q_lens, t, right=True)) - 1
    return s, int(batch.kv_lens[s]) - int(batch.cu_q_lens[s + 1]) + t


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, cache_dtype", FUSED_CASES, ids=lambda x: _dtype_id(x))
def test_fused_write_equals_write_then_attention(backend, dtype, cache_dtype):
    require_backend(backend)
    batch = make_batch(_fused_spec(dtype, cache_dtype))
    fused_caches, separate_caches = batch.caches(), batch.caches()
    fused = batch.attend(fused_caches, fused=True, implementation=backend)
    batch.write(separate_caches, implementation=backend)
    separate = batch.attend(separate_caches, fused=False, implementation=backend)
    for name, a, b in zip(("key_cache", "value_cache"), fused_caches, separate_caches):
        assert_entries_match(a, b, what=name)
    # a fused kernel attends over the quantized new keys, as the write then attention does
    assert_attention_close(fused, separate.float(), dtype, what="fused vs separate")
    want, _ = batch.expected()
    assert_attention_close(fused, want, dtype, what="fused vs definition")
    # the padding tokens' positions keep what was cached there
    for t in batch.spec.padding:
        slot = slot_of(batch.block_table, batch.spec.block_size, *_token_position(batch, t))
        assert torch.equal(fused_caches[0].flatten(0, 1)[slot].view(torch.uint8),
                           batch.key_cache.flatten(0, 1)[slot].view(torch.uint8))


@pytest.mark.parametrize("dtype, cache_dtype", FUSED_CASES, ids=lambda x: _dtype_id(x))
def test_triton_fuses_the_write_into_attention(dtype, cache_dtype, monkeypatch):
    """Without padding tokens each slot is its own position's, so triton writes inside the attention
    launch (the separate write launch is made to fail): whole caches bit-identical to the
    reference's write, the output as the definition's."""
    require_backend("triton")
    from triton_impl import paged_attention as kernels

    batch = make_batch(_fused_spec(dtype, cache_dtype, padding=()))
    fused_caches, separate_caches = batch.caches(), batch.caches()
    batch.write(separate_caches, implementation="reference")
    with monkeypatch.context() as m:
        m.setattr(kernels, "reshape_and_cache", lambda *a: pytest.fail("triton ran a separate write launch"))
        fused = batch.attend(fused_caches, fused=True, implementation="triton")
    for name, a, b in zip(("key_cache", "value_cache"), fused_caches, separate_caches):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    want, _ = batch.expected()
    assert_attention_close(fused, want, dtype, what="fused vs definition")


def _poisoned(cache: torch.Tensor, gen) -> torch.Tensor:
    """Random bytes, with the first blocks all 0xff (NaN in every float dtype)."""
    raw = torch.randint(0, 256, (cache.numel() * cache.element_size(),), generator=gen, dtype=torch.uint8)
    poisoned = raw.view(cache.dtype).view(cache.shape).clone()
    poisoned[: max(1, cache.shape[0] // 2)].view(torch.uint8).fill_(0xFF)
    return poisoned


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["reshape_and_cache", "fused"])
@pytest.mark.parametrize("dtype, cache_dtype", FUSED_CASES, ids=lambda x: _dtype_id(x))
def test_writes_touch_only_their_slots(backend, how, dtype, cache_dtype):
    """Over caches of garbage (NaN included): every byte outside slot_mapping stays as it was, and
    each written slot holds reference.quantize of its token."""
    require_backend(backend)
    batch = make_batch(_fused_spec(dtype, cache_dtype))
    gen = torch.Generator().manual_seed(12)
    caches = tuple(_poisoned(c, gen) for c in (batch.key_cache, batch.value_cache))
    before = tuple(c.clone() for c in caches)
    if how == "fused":
        batch.attend(caches, fused=True, implementation=backend)
    else:
        batch.write(caches, implementation=backend)
    real = batch.slot_mapping >= 0
    slots = batch.slot_mapping[real]
    untouched = torch.ones(caches[0].shape[0] * caches[0].shape[1], dtype=torch.bool)
    untouched[slots] = False
    for name, cache, old, new, which in zip(("key_cache", "value_cache"), caches, before,
                                           (batch.key, batch.value), "kv"):
        flat, old_flat = cache.flatten(0, 1), old.flatten(0, 1)
        assert torch.equal(flat[untouched].view(torch.uint8), old_flat[untouched].view(torch.uint8)), \
            f"{name}: a slot outside slot_mapping changed"
        want = reference.quantize(new[real], batch.heads_scale(which), cache.dtype)
        assert_entries_match(flat[slots], want, what=f"{name} written slots")


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_slot_mapping_writes_as_int64(backend):
    """torchax hands int64 tensors over as int32 (jax without x64): both index dtypes write alike."""
    require_backend(backend)
    batch = make_batch(_fused_spec(torch.float32, torch.float32))
    wide_caches, narrow_caches = batch.caches(), batch.caches()
    wide = batch.attend(wide_caches, fused=True, implementation=backend)
    batch.slot_mapping = batch.slot_mapping.int()
    narrow = batch.attend(narrow_caches, fused=True, implementation=backend)
    assert torch.equal(wide, narrow)
    for name, a, b in zip(("key_cache", "value_cache"), wide_caches, narrow_caches):
        assert torch.equal(a, b), name


GARBAGE_BYTE = {torch.int8: 0x7F}  # int8 has no NaN: its largest value; 0xff is NaN in every float dtype


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [False, True], ids=["cached", "fused"])
@pytest.mark.parametrize("dtype, cache_dtype", FUSED_CASES, ids=lambda x: _dtype_id(x))
def test_attention_ignores_cache_slots_past_kv_len(backend, fused, dtype, cache_dtype):
    """Caches come from torch.empty in a server: slots past a sequence's kv length (the tail of its
    last page, pages it does not use) may hold NaN, and must not reach the output."""
    require_backend(backend)
    batch = make_batch(_fused_spec(dtype, cache_dtype, fused=fused))
    want, _ = batch.expected()
    caches = batch.caches()
    valid = torch.zeros(caches[0].shape[0] * caches[0].shape[1], dtype=torch.bool)
    for s, kv in enumerate(batch.spec.kv_lens):
        for p in range(kv):
            valid[slot_of(batch.block_table, batch.spec.block_size, s, p)] = True
    if fused:  # the call writes these itself
        valid[batch.slot_mapping[batch.slot_mapping >= 0]] = False
    for cache in caches:
        cache.flatten(0, 1).view(torch.uint8)[~valid] = GARBAGE_BYTE.get(cache.dtype, 0xFF)
    assert caches[0].isnan().any() or caches[0].dtype == torch.int8
    out = batch.attend(caches, implementation=backend)
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} non-finite outputs"
    assert_attention_close(out, want, dtype, what=backend)


# ---- NaN and inf: what attention reads, and what writes store ----
# The policy (README, the op docstrings): entries a query does not attend to are never read; a NaN
# or inf in the query or in an attended key or value entry makes the row of each query head that
# reads that kv head all NaN; writes keep NaN (int8: 0) and saturate fp8 and int8.

NAN, INF = math.nan, math.inf


def _sees(batch: Batch, s: int, p: int, j: int) -> bool:
    """Whether the query at position ``p`` of sequence ``s`` attends to key position ``j``."""
    window = batch.spec.sliding_window
    return j < int(batch.kv_lens[s]) and j <= p and (window is None or j > p - window)


def _new_token_rows(batch: Batch) -> dict[int, int]:
    """slot -> the query token whose new key/value the call writes there."""
    return {int(slot): t for t, slot in enumerate(batch.slot_mapping.tolist()) if slot >= 0}


def _fill_slots(batch: Batch, slots, value: float):
    """Copies of the caches (and of key, value) with every entry of ``slots`` set to ``value``;
    in a fused call a new token's slot is written by the call, so its key and value get it too."""
    caches = batch.caches()
    for cache in caches:
        cache.flatten(0, 1)[slots] = value
    key, value_rows = batch.key.clone(), batch.value.clone()
    if batch.spec.fused:
        filled = set(slots.tolist())
        rows = [t for slot, t in _new_token_rows(batch).items() if slot in filled]
        key[rows] = value
        value_rows[rows] = value
    return caches, key, value_rows


def _attend_with(batch: Batch, caches, key, value, backend: str, query=None) -> torch.Tensor:
    kw = batch.inputs(caches=caches, query=query)
    if batch.spec.fused:
        kw.update(key=key, value=value)
    return torch_kernels.ragged_paged_attention(**kw, implementation=backend)


def _policy_nan_rows(batch: Batch, caches, query) -> torch.Tensor:
    """[T, Hq]: the rows the NaN policy makes NaN, worked out position by position."""
    rows = ~torch.isfinite(query.float()).all(dim=-1)
    cu, bs = batch.cu_q_lens.tolist(), batch.spec.block_size
    for s, kv_len in enumerate(batch.kv_lens.tolist()):
        slots = [slot_of(batch.block_table, bs, s, j) for j in range(kv_len)]
        bad = torch.zeros(kv_len, batch.spec.num_kv_heads, dtype=torch.bool)
        for cache in caches:
            bad |= ~torch.isfinite(cache.flatten(0, 1)[slots].float()).all(dim=-1)
        for t in range(cu[s], cu[s + 1]):
            p = _token_position(batch, t)[1]
            seen = torch.tensor([_sees(batch, s, p, j) for j in range(kv_len)], dtype=torch.bool)
            rows[t] |= bad[seen].any(dim=0).repeat_interleave(batch.spec.group)
    return rows


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=specs(max_seqs=5, max_q=12, max_ctx=120, head_sizes=(64,)), tile=st.sampled_from(REFERENCE_TILES[:4]),
       data=st.data())
def test_reference_and_definition_follow_the_nan_policy(spec, tile, data):
    """NaN and inf planted at random (in entries some query sees, in ones none sees, in the
    query): the CPU default and the definition give NaN rows exactly where the policy says (whole
    rows), and agree elsewhere."""
    batch = make_batch(dataclasses.replace(spec, fused=False, padding=()))
    caches, query = batch.caches(), batch.query.clone()
    bs, (hkv, d) = batch.spec.block_size, batch.key_cache.shape[2:]
    used = [(s, kv) for s, kv in enumerate(spec.kv_lens) if kv]
    for _ in range(data.draw(st.integers(0, 4), label="planted entries")):
        if used and data.draw(st.booleans()):
            s, kv = data.draw(st.sampled_from(used))
            slot = slot_of(batch.block_table, bs, s, data.draw(st.integers(0, kv - 1)))
        else:
            slot = data.draw(st.integers(0, caches[0].shape[0] * bs - 1))
        cache = caches[data.draw(st.integers(0, 1))]
        if cache.dtype != torch.int8:  # int8 has no NaN or inf
            cache.flatten(0, 1)[slot, data.draw(st.integers(0, hkv - 1)), data.draw(st.integers(0, d - 1))] = \
                data.draw(st.sampled_from((NAN, INF, -INF)))
    if batch.num_tokens and data.draw(st.booleans()):
        t = data.draw(st.integers(0, batch.num_tokens - 1))
        query[t, data.draw(st.integers(0, query.shape[1] - 1)), 0] = data.draw(st.sampled_from((NAN, INF)))
    with _reference_tiles(tile):
        out = torch_kernels.ragged_paged_attention(**batch.inputs(caches=caches, query=query),
                                                   implementation="reference")
    want = reference.ragged_paged_attention_naive(**batch.inputs(caches=caches, query=query.float()))
    nan_rows = _policy_nan_rows(batch, caches, query)
    for name, result in (("reference", out), ("definition", want)):
        assert torch.equal(result.isnan().all(dim=-1), nan_rows), f"{name}: NaN rows differ from the policy's"
        assert torch.isfinite(result[~nan_rows]).all(), f"{name}: a non-finite value outside the NaN rows"
    if (~nan_rows).any():
        assert_attention_close(out[~nan_rows], want[~nan_rows], spec.dtype)


@pytest.mark.covering
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("target", ["first", "last"])
@pytest.mark.parametrize("poison", [NAN, INF], ids=["nan", "inf"])
@pytest.mark.parametrize("window", [None, 8], ids=["causal", "window8"])
@pytest.mark.parametrize("fused", [False, True], ids=["cached", "fused"])
def test_entries_a_query_does_not_see_never_matter(backend, target, poison, window, fused):
    """A prompt, a decode and a prefill chunk: for each sequence's first (or last) query, every
    cache entry it does not attend to (past its position, outside its window, past kv_len, other
    sequences' pages, spare blocks; in a fused call the new keys and values of those positions
    too) holds NaN (or inf): its output equals, bit for bit, the output with those entries zeroed."""
    require_backend(backend)
    batch = make_batch(_fused_spec(torch.float32, None, sliding_window=window, fused=fused, padding=()))
    cu = batch.cu_q_lens.tolist()
    rows, seen = [], set()
    for s, kv_len in enumerate(batch.kv_lens.tolist()):
        if cu[s + 1] == cu[s]:
            continue
        t = cu[s] if target == "first" else cu[s + 1] - 1
        rows.append(t)
        _, p = _token_position(batch, t)
        seen.update(slot_of(batch.block_table, batch.spec.block_size, s, j) for j in range(kv_len)
                    if _sees(batch, s, p, j))
    hidden = torch.tensor(sorted(set(range(batch.key_cache.shape[0] * batch.spec.block_size)) - seen))
    poisoned = _attend_with(batch, *_fill_slots(batch, hidden, poison), backend)
    zeroed = _attend_with(batch, *_fill_slots(batch, hidden, 0.0), backend)
    assert torch.isfinite(zeroed[rows]).all()
    assert torch.equal(poisoned[rows], zeroed[rows]), \
        f"rows {rows}: max difference {(poisoned[rows] - zeroed[rows]).abs().max().item()}"


# (id, what is planted: "key" / "value" / "query", its value, (sequence, position) of the entry
# (of the query token for "query"), cache dtype, window, soft cap, fused); the kv head is 1, the
# query head 3 (it reads kv head 1). _fused_spec's chunk is sequence 3 at positions 32..36 (query
# tokens 4..8), its decode sequence 1 at position 17, its prompt sequence 0 at 0..2.
VISIBLE_POISON = [
    ("key-nan-causal", "key", NAN, (3, 33), None, None, None, False),
    ("value-nan-window", "value", NAN, (3, 28), None, 8, None, False),
    ("key-minus-inf", "key", -INF, (3, 33), None, 8, None, False),  # some rows' logit is -inf: weight 0
    ("key-inf-soft-cap", "key", INF, (3, 30), None, None, 5.0, False),  # the cap makes a logit finite
    ("value-inf", "value", INF, (1, 12), None, 8, None, False),  # a decode
    ("value-minus-inf-prompt", "value", -INF, (0, 1), None, None, None, False),
    ("key-nan-fused", "key", NAN, (3, 34), None, 8, None, True),  # a new token: read from the input
    ("value-inf-fused", "value", INF, (3, 33), None, None, None, True),
    ("fp8-key-nan", "key", NAN, (3, 31), torch.float8_e5m2, None, None, False),
    ("fp8-value-nan", "value", NAN, (1, 12), torch.float8_e4m3fn, 8, None, False),
    ("query-nan", "query", NAN, (3, 34), None, 8, None, False),
    ("query-inf", "query", INF, (3, 33), None, None, 5.0, True),
]
POISON_KV_HEAD, POISON_Q_HEAD, POISON_DIM = 1, 3, 5


@pytest.mark.covering
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case, where, value, entry, cache_dtype, window, soft_cap, fused", VISIBLE_POISON,
                         ids=[c[0] for c in VISIBLE_POISON])
def test_a_non_finite_entry_poisons_exactly_the_rows_that_read_it(backend, case, where, value, entry, cache_dtype,
                                                                   window, soft_cap, fused):
    """One NaN or inf in one element of one visible entry: the rows of the queries that attend to
    it, for the query heads of its kv head, are all NaN; every other output element is unchanged
    (bit for bit)."""
    require_backend(backend)
    batch = make_batch(_fused_spec(torch.float32, cache_dtype, sliding_window=window, soft_cap=soft_cap,
                                   fused=fused, padding=()))
    clean = batch.attend(batch.caches(), implementation=backend)
    s, j = entry
    group = batch.spec.group
    cu = batch.cu_q_lens.tolist()
    affected = torch.zeros(batch.query.shape[:2], dtype=torch.bool)
    caches, key, value_rows, query = batch.caches(), batch.key.clone(), batch.value.clone(), batch.query.clone()
    if where == "query":
        t = cu[s] + j - (int(batch.kv_lens[s]) - (cu[s + 1] - cu[s]))
        query[t, POISON_Q_HEAD, POISON_DIM] = value
        affected[t, POISON_Q_HEAD] = True
    else:
        slot = slot_of(batch.block_table, batch.spec.block_size, s, j)
        new_row = _new_token_rows(batch).get(slot) if fused else None
        if new_row is not None:  # the call writes this entry from its key / value input
            (key if where == "key" else value_rows)[new_row, POISON_KV_HEAD, POISON_DIM] = value
        else:
            cache = caches[0 if where == "key" else 1]
            cache.flatten(0, 1)[slot, POISON_KV_HEAD, POISON_DIM] = value
        for t in range(cu[s], cu[s + 1]):
            if _sees(batch, s, _token_position(batch, t)[1], j):
                affected[t, POISON_KV_HEAD * group:(POISON_KV_HEAD + 1) * group] = True
    assert affected.any() and not affected.all()
    out = _attend_with(batch, caches, key, value_rows, backend, query=query)
    assert out[affected].isnan().all(), f"{int((~out[affected].isnan()).sum())} elements of the affected rows not NaN"
    assert torch.equal(out[~affected], clean[~affected]), "rows that do not read the entry changed"


def _stored(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the policy stores for float32 ``x`` (already divided by its scale), as float32."""
    if dtype == torch.int8:
        return x.nan_to_num(0.0).round().clamp(-128, 127)
    if dtype in FP8:
        largest = torch.finfo(dtype).max
        return torch.where(x.isnan(), x, x.clamp(-largest, largest)).to(dtype).float()
    return x.to(dtype).float()  # float caches: the dtype's own conversion (overflow is inf)


# float32 values after the scale: NaN, infinities, out of every cache dtype's range, ordinary
STORE_PROBE = [NAN, -NAN, INF, -INF, 1e30, -1e30, 3e38, -3e38, 70000.0, -500.0, 200.0, 2.5, -1.5, 0.0, 1e-3]


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["reshape_and_cache", "fused"])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16, *QUANTIZED], ids=_dtype_id)
def test_writes_store_nan_and_saturate(backend, how, cache_dtype):
    """NaN stays NaN (int8: 0); +-inf and values past the dtype's range saturate to its largest
    finite value in fp8 and int8 caches (float caches round as the dtype does: overflow is inf).
    Keys in the cache's dtype (float caches) or float32 with a scale that pushes one head's
    ordinary values out of range (quantized ones); in a fused call, without padding, triton writes
    inside its attention launch."""
    require_backend(backend)
    quantized = cache_dtype in QUANTIZED
    dtype = torch.float32 if quantized else cache_dtype
    batch = make_batch(_fused_spec(dtype, cache_dtype, padding=(), fused=how == "fused"))
    scale = torch.tensor([1.0, 2.0 ** -120]) if quantized else None
    batch.k_scale = batch.v_scale = scale
    num_tokens, hkv, d = batch.key.shape
    probe = torch.tensor(STORE_PROBE)
    gen = torch.Generator().manual_seed(41)
    batch.key = probe[torch.randint(0, len(probe), (num_tokens, hkv, d), generator=gen)].to(dtype)
    batch.value = probe[torch.randint(0, len(probe), (num_tokens, hkv, d), generator=gen)].to(dtype)
    caches = batch.caches()
    if how == "fused":
        batch.attend(caches, implementation=backend)
    else:
        batch.write(caches, implementation=backend)
    heads = batch.heads_scale("k")
    slots = batch.slot_mapping
    for name, cache, new in (("key_cache", caches[0], batch.key), ("value_cache", caches[1], batch.value)):
        got = cache.flatten(0, 1)[slots].float()
        want = _stored(new.float() / heads[:, None], cache_dtype)
        same = (got == want) | (got.isnan() & want.isnan())
        assert same.all(), (f"{name}: {int((~same).sum())} entries differ, e.g. from "
                            f"{(new.float() / heads[:, None])[~same][:4].tolist()}: got {got[~same][:4].tolist()}, "
                            f"want {want[~same][:4].tolist()}")
        if cache_dtype == torch.int8:
            assert not cache.flatten(0, 1)[slots][new.isnan()].any(), f"{name}: NaN not stored as 0"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", QUANTIZED, ids=_dtype_id)
def test_write_kernels_store_nan_for_a_nan_scale(backend, cache_dtype):
    """The op rejects a NaN scale, but a kernel called directly (its contract) gives x / NaN the
    NaN rule: NaN in fp8, 0 in int8; never a saturated value."""
    require_backend(backend)
    batch = make_batch(_fused_spec(torch.float32, cache_dtype, padding=()))
    caches = batch.caches()
    k_scale = torch.tensor([1.0, NAN])
    backends._kernel(WRITE_OP, backend)(batch.key, batch.value, *caches, batch.slot_mapping, k_scale, torch.ones(2))
    written = caches[0].flatten(0, 1)[batch.slot_mapping][:, 1].float()
    if cache_dtype == torch.int8:
        assert (written == 0).all()
    else:
        assert written.isnan().all()


TRITON_CONFIGS = [(8, 16, 4), (16, 32, 2), (8, 16, 1)]  # (block_q, block_n, num_splits)


@pytest.mark.parametrize("block_q, block_n, num_splits", TRITON_CONFIGS, ids=str)
@pytest.mark.parametrize("window", [None, 8], ids=["causal", "window8"])
def test_triton_nan_policy_with_small_tiles_and_key_splits(block_q, block_n, num_splits, window):
    """The triton kernel with many tiles and split key ranges (partials merged by the second
    kernel): a NaN hidden on the chunk's diagonal, an inf value a decode sees, a NaN query
    element. NaN rows exactly as the definition's, the rest close to it."""
    require_backend("triton")
    from triton_impl import paged_attention as kernels

    batch = make_batch(_fused_spec(torch.float32, None, sliding_window=window, fused=False, padding=()))
    caches, query = batch.caches(), batch.query.clone()
    block_size = batch.spec.block_size
    caches[0].flatten(0, 1)[slot_of(batch.block_table, block_size, 3, 36), 0, 2] = NAN  # the chunk's last position
    caches[1].flatten(0, 1)[slot_of(batch.block_table, block_size, 1, 13), 1, 9] = INF  # the decode at 17 sees it
    query[2, 1, 0] = NAN
    want = reference.ragged_paged_attention_naive(**batch.inputs(caches=caches, query=query))
    out = kernels.ragged_paged_attention(
        query, *caches, batch.cu_q_lens, batch.kv_lens, batch.block_table, batch.sm_scale, window, None,
        batch.heads_scale("k").contiguous(), batch.heads_scale("v").contiguous(), None, None, None,
        config=kernels.Config(block_q=block_q, block_n=block_n, num_splits=num_splits))
    nan_rows = want.isnan().all(dim=-1)
    assert nan_rows.any() and not nan_rows.all()
    assert torch.equal(out.isnan().all(dim=-1), nan_rows)
    assert_attention_close(out[~nan_rows], want[~nan_rows], torch.float32)


# ---- quantization ----

def _quantization_probe(cache_dtype, count: int, gen) -> torch.Tensor:
    """Values where rounding is decided: exact ties (half-way between two cache values), values
    past the largest (saturation), tiny ones, signed zeros, and ordinary ones."""
    if cache_dtype == torch.int8:
        ties = torch.arange(-140, 141, dtype=torch.float32) + 0.5
        largest = 127.0
    else:
        grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(cache_dtype).float()
        grid = grid[torch.isfinite(grid)].unique()
        ties = (grid[1:] + grid[:-1]) / 2
        largest = torch.finfo(cache_dtype).max
    specials = torch.tensor([0.0, -0.0, largest, -largest, largest * 1.01, -largest * 1.01, largest * 8, -1e30, 1e30,
                             1e-30, -1e-30, 0.49, 0.5, 1.5, 2.5, -0.5, -1.5])
    ordinary = torch.randn(count, generator=gen) * largest / 4
    pool = torch.cat([ties, specials, ordinary])
    return pool[torch.randint(0, len(pool), (count,), generator=gen)]


@pytest.mark.covering(strength=1)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache_dtype", QUANTIZED, ids=_dtype_id)
@pytest.mark.parametrize("scale_kind", ["none", "scalar", "head"])
def test_reshape_and_cache_quantizes_as_reference(backend, cache_dtype, scale_kind):
    """Entries are key / scale rounded to the cache dtype: int8 half to even with saturation, fp8
    to nearest even with saturation, bit for bit as reference.quantize."""
    require_backend(backend)
    gen = torch.Generator().manual_seed(21)
    num_tokens, hkv, d, num_blocks, bs = 24, 3, 64, 4, 16
    # powers-of-two scales keep value * scale / scale exact, so the ties stay ties
    heads = {"none": torch.ones(hkv), "scalar": torch.full((hkv,), 0.25),
             "head": torch.tensor([0.25, 2.0, 0.0625])}[scale_kind]
    scale = {"none": None, "scalar": torch.tensor(0.25), "head": heads}[scale_kind]
    slot_mapping = torch.randperm(num_blocks * bs, generator=gen)[:num_tokens]

    def tokens(key_dtype):
        probe = _quantization_probe(cache_dtype, num_tokens * hkv * d, gen).view(num_tokens, hkv, d)
        return (probe * heads[:, None]).to(key_dtype)

    for key_dtype in (torch.float32, torch.bfloat16):
        key, value = tokens(key_dtype), tokens(key_dtype)
        key_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=cache_dtype)
        value_cache = torch.zeros_like(key_cache)
        torch_kernels.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, scale, scale,
                                        implementation=backend)
        assert backends.last_backend(WRITE_OP) == backend
        for name, cache, new in (("key_cache", key_cache, key), ("value_cache", value_cache, value)):
            assert_entries_match(cache.flatten(0, 1)[slot_mapping], reference.quantize(new, heads, cache_dtype),
                                 what=f"{name} from {key_dtype}")


def test_quantize_rounds_half_to_even_and_saturates():
    """The reference's own rounding rules, on hand-picked values."""
    one = torch.ones(1)
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, 200.0, -128.5, -300.0]])
    assert reference.quantize(x, one, torch.int8).tolist() == [[0, 2, 2, 0, -2, -2, 126, 127, 127, -128, -128]]
    for dtype in FP8:
        largest = torch.finfo(dtype).max
        big = torch.tensor([[largest * 4, -largest * 4, 1e30]])
        assert reference.quantize(big, one, dtype).float().tolist() == [[largest, -largest, largest]]
    scaled = reference.quantize(torch.tensor([[8.0, -3.0]]), torch.tensor([4.0]), torch.int8)
    assert scaled.tolist() == [[2, -1]]  # divided by the scale: 2.0 and -0.75


QUANTIZED_ATTENTION = [  # (query dtype, cache dtype, tolerance), pairs of FUSED_CASES
    (torch.float32, torch.int8, 2e-2), (torch.float32, torch.float8_e4m3fn, 8e-2),
    (torch.bfloat16, torch.float8_e5m2, 2.5e-1),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, cache_dtype, tolerance", QUANTIZED_ATTENTION,
                         ids=[_dtype_id(c) for _, c, _ in QUANTIZED_ATTENTION])
@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_quantized_attention_close_to_full_precision(backend, dtype, cache_dtype, tolerance, per_head):
    """Quantized caches (scale from the absmax, per tensor or per head) attend close to the float32
    caches they came from. (The write itself is held to reference.quantize bit for bit above.)"""
    require_backend(backend)
    batch = make_batch(_fused_spec(dtype, cache_dtype, fused=False))
    gen = torch.Generator().manual_seed(31)
    shape = batch.key_cache.shape
    full_caches = (torch.randn(shape, generator=gen) * torch.tensor([0.5, 2.0])[:, None],  # heads of different ranges
                   torch.randn(shape, generator=gen) * torch.tensor([0.3, 2.0])[:, None])
    full = reference.ragged_paged_attention_naive(**{**batch.inputs(caches=full_caches, query=batch.query.float()),
                                                     "k_scale": None, "v_scale": None})
    largest = 127.0 if cache_dtype == torch.int8 else torch.finfo(cache_dtype).max
    caches, scales = [], []
    for cache in full_caches:
        absmax = cache.abs().amax(dim=(0, 1, 3)) if per_head else cache.abs().max().reshape(1)
        scale = (absmax / largest).float()
        caches.append(reference.quantize(cache, scale.expand(2), cache_dtype))
        scales.append(scale)
    out = torch_kernels.ragged_paged_attention(**{**batch.inputs(caches=tuple(caches)), "k_scale": scales[0],
                                                  "v_scale": scales[1]}, implementation=backend)
    err = relative_error(out, full)
    assert err <= tolerance, f"{cache_dtype}: relative error {err:.3e} > {tolerance}"
    assert err > 0  # the cache really was quantized


# ---- empty and idle sequences ----

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [False, True], ids=["cached", "fused"])
def test_no_query_tokens(backend, fused):
    require_backend(backend)
    for spec in (Spec(q_lens=(0, 0, 0), kv_lens=(0, 5, 17), num_kv_heads=2, group=2, fused=fused),
                 Spec(q_lens=(), kv_lens=(), num_kv_heads=2, group=2, fused=fused, extra_pages=2)):
        batch = make_batch(spec)
        caches = batch.caches()
        out = batch.attend(caches, implementation=backend)
        assert out.shape == (0, 4, 64) and out.dtype == torch.float32
        assert torch.equal(caches[0], batch.key_cache) and torch.equal(caches[1], batch.value_cache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reshape_and_cache_of_nothing(backend):
    require_backend(backend)
    batch = make_batch(_fused_spec(padding=tuple(range(9))))
    caches = batch.caches()
    batch.write(caches, implementation=backend)  # every token padding
    torch_kernels.reshape_and_cache(batch.key[:0], batch.value[:0], *caches, batch.slot_mapping[:0],
                                    implementation=backend)  # no token at all
    assert torch.equal(caches[0], batch.key_cache) and torch.equal(caches[1], batch.value_cache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs(backend):
    """Index tensors, queries and new keys may be views with any strides (the caches too: see
    test_paged_attention_strided.py)."""
    require_backend(backend)
    batch = make_batch(_fused_spec())
    wide = torch.stack([batch.block_table, batch.block_table], dim=2)[:, :, 0]
    query = torch.stack([batch.query, batch.query], dim=-1)[..., 1]
    key = batch.key.transpose(0, 1).contiguous().transpose(0, 1)
    cu = torch.stack([batch.cu_q_lens, batch.cu_q_lens], 1)[:, 1]
    assert not (wide.is_contiguous() or query.is_contiguous() or key.is_contiguous() or cu.is_contiguous())
    want, want_caches = batch.expected()
    caches = batch.caches()
    out = torch_kernels.ragged_paged_attention(**{**batch.inputs(caches=caches), "query": query, "key": key,
                                                  "block_table": wide, "cu_q_lens": cu}, implementation=backend)
    assert_attention_close(out, want, torch.float32)
    assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])


# ---- inputs that must be accepted (the bad ones are in tests/families/paged_attention.py) ----

def _check_batch() -> Batch:
    # S=3, T=5, pages (1, 1, 2) of 16, 6 blocks (capacity 96), block_table [3, 3], Hkv=2, Hq=4, D=64
    return make_batch(Spec(q_lens=(2, 0, 3), kv_lens=(5, 7, 20), num_kv_heads=2, group=2, head_size=64,
                           block_size=16, fused=True, spare_blocks=2, extra_pages=1, seed=51))


def _set(name, value):
    return lambda kw: kw.__setitem__(name, value)


def _edit(name, edit):
    """Change one element (or slice) of a copy of argument ``name``: ``edit(tensor)`` mutates it."""
    def change(kw):
        kw[name] = kw[name].clone()
        edit(kw[name])
    return change


ACCEPTED = [
    ("garbage past used pages", lambda kw: kw.update(block_table=_garbage_table(kw))),
    ("padding slots twice", _edit("slot_mapping", lambda t: t.__setitem__(slice(0, 2), -1))),
    ("scale shapes [] and [1]", lambda kw: kw.update(k_scale=torch.tensor(0.5), v_scale=torch.tensor([2.0]))),
    ("window wider than every sequence", _set("sliding_window", 10_000)),
    ("window past int32", _set("sliding_window", 2**40)),
    ("integer sm_scale", _set("sm_scale", 1)),
]


def _garbage_table(kw):
    """Past each sequence's pages: the extremes of int32, -1 and the first id past the cache."""
    table = kw["block_table"].clone()
    num_blocks, block_size = kw["key_cache"].shape[:2]
    extremes = [INT32_MIN, -1, num_blocks, INT32_MAX]
    for s, kv in enumerate(kw["kv_lens"].tolist()):
        for i, column in enumerate(range(-(-kv // block_size), table.shape[1])):
            table[s, column] = extremes[(s + i) % len(extremes)]
    return table


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case, change", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_attention_accepts(backend, case, change):
    require_backend(backend)
    batch = make_batch(_fused_spec())
    kw = batch.inputs(fused=True, caches=batch.caches())
    change(kw)
    out = torch_kernels.ragged_paged_attention(**kw, implementation=backend)
    naive_kw = {**kw, "key_cache": batch.key_cache.clone(), "value_cache": batch.value_cache.clone(),
                "query": kw["query"].float()}
    assert_attention_close(out, reference.ragged_paged_attention_naive(**naive_kw), torch.float32, what=case)


# ---- autograd: inference only ----

@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_only(backend):
    """Inputs that require grad under grad mode raise; under no_grad or inference_mode the call runs."""
    require_backend(backend)
    batch = make_batch(_fused_spec())
    query = batch.query.clone().requires_grad_()
    key = batch.key.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="ragged_paged_attention is inference-only"):
        torch_kernels.ragged_paged_attention(**batch.inputs(caches=batch.caches(), query=query), implementation=backend)
    with pytest.raises(RuntimeError, match="reshape_and_cache is inference-only"):
        torch_kernels.reshape_and_cache(key, batch.value, *batch.caches(), batch.slot_mapping, implementation=backend)
    want, want_caches = batch.expected()
    for mode in (torch.no_grad, torch.inference_mode):
        caches = batch.caches()
        with mode():
            out = torch_kernels.ragged_paged_attention(**{**batch.inputs(caches=caches, query=query), "key": key},
                                                       implementation=backend)
        assert not out.requires_grad
        assert_attention_close(out, want, torch.float32, what=mode.__name__)
        assert torch.equal(caches[0], want_caches[0]) and torch.equal(caches[1], want_caches[1])
        with mode():
            torch_kernels.reshape_and_cache(key, batch.value, *caches, batch.slot_mapping, implementation=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("argument", ["key", "value", "k_scale", "v_scale"])
def test_inference_only_optional_tensors(backend, argument):
    """The output depends on the new tokens and the scales too: their requiring grad must raise
    rather than silently give an output without a gradient."""
    batch = _check_batch()
    kw = batch.inputs(caches=batch.caches())
    kw[argument] = (torch.ones(2) if kw[argument] is None else kw[argument].clone()).requires_grad_()
    with pytest.raises(RuntimeError, match="ragged_paged_attention is inference-only"):
        torch_kernels.ragged_paged_attention(**kw, implementation=backend)
    if argument.endswith("scale"):
        with pytest.raises(RuntimeError, match="reshape_and_cache is inference-only"):
            torch_kernels.reshape_and_cache(batch.key, batch.value, *batch.caches(), batch.slot_mapping,
                                            **{argument: kw[argument]}, implementation=backend)


# ---- the op contract: opcheck, compile, profiler, FLOPs ----

def _schema_args(batch: Batch, backend: str) -> tuple:
    kw = batch.inputs(caches=batch.caches())
    return (kw["query"], kw["key_cache"], kw["value_cache"], kw["cu_q_lens"], kw["kv_lens"], kw["block_table"],
            kw["sm_scale"], kw["sliding_window"], kw["soft_cap"], kw["k_scale"], kw["v_scale"], kw.get("key"),
            kw.get("value"), kw.get("slot_mapping"), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    require_backend(backend)
    fused = make_batch(_fused_spec(torch.float32, torch.int8))  # a fused write into int8, with padding
    run_opcheck(ops.ragged_paged_attention_op, _schema_args(fused, backend))
    plain = make_batch(_fused_spec(torch.float16, None, fused=False))
    run_opcheck(ops.ragged_paged_attention_op, _schema_args(plain, backend))
    key_cache, value_cache = fused.caches()
    run_opcheck(ops.reshape_and_cache_op, (fused.key, fused.value, key_cache, value_cache, fused.slot_mapping,
                                           fused.k_scale, fused.v_scale, backend))
    out = torch.empty_like(fused.query)
    run_opcheck(ops.ragged_paged_attention_out_op, (out, *_schema_args(fused, backend)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_receives_what_the_op_returns(backend):
    """``out=``: the output written into the given buffer, bit for bit what the call returns without
    it (with the fused write: the caches too), returned as it is; a strided ``out`` gets a copy; in
    deferred mode a bad sequence's rows of ``out`` are NaN."""
    require_backend(backend)
    batch = make_batch(_fused_spec(torch.float32, torch.int8))
    want_caches, got_caches, strided_caches = batch.caches(), batch.caches(), batch.caches()
    want = batch.attend(want_caches, implementation=backend)
    out = torch.full_like(want, 7.0)
    assert batch.attend(got_caches, implementation=backend, out=out) is out
    assert torch.equal(out, want)
    for got, expected in zip(got_caches, want_caches):
        assert torch.equal(got, expected)
    strided = torch.full((*want.shape[:-1], 2 * want.shape[-1]), 7.0)[..., ::2]
    assert batch.attend(strided_caches, implementation=backend, out=strided) is strided
    assert torch.equal(strided, want)

    plain = make_batch(_fused_spec(torch.float32, None, fused=False))
    kw = plain.inputs(caches=plain.caches())
    kw["kv_lens"] = kw["kv_lens"].clone()
    kw["kv_lens"][0] = -1  # sequence 0's rows become NaN, the others stay
    with torch_kernels.checks("deferred"):
        out = torch.full_like(plain.query, 7.0)
        torch_kernels.ragged_paged_attention(**kw, implementation=backend, out=out)
    with pytest.raises(ValueError, match="^kv_lens: expected lengths >= 0"):
        torch_kernels.raise_deferred_errors()
    rows = int(plain.cu_q_lens[1])
    assert rows and out[:rows].isnan().all() and not out[rows:].isnan().any()


class DecoderLayer(torch.nn.Module):
    """Attention of a decoder layer over a paged KV cache, as a serving engine runs it."""

    def __init__(self, hidden: int, num_q_heads: int, num_kv_heads: int, head_size: int):
        super().__init__()
        self.shape = (num_q_heads, num_kv_heads, head_size)
        self.q_proj = torch.nn.Linear(hidden, num_q_heads * head_size)
        self.k_proj = torch.nn.Linear(hidden, num_kv_heads * head_size)
        self.v_proj = torch.nn.Linear(hidden, num_kv_heads * head_size)
        self.o_proj = torch.nn.Linear(num_q_heads * head_size, hidden)

    def forward(self, x, key_cache, value_cache, cu_q_lens, kv_lens, block_table, slot_mapping):
        hq, hkv, d = self.shape
        t = x.shape[0]
        out = torch_kernels.ragged_paged_attention(
            self.q_proj(x).view(t, hq, d), key_cache, value_cache, cu_q_lens, kv_lens, block_table, d**-0.5,
            key=self.k_proj(x).view(t, hkv, d), value=self.v_proj(x).view(t, hkv, d), slot_mapping=slot_mapping,
            implementation="reference",
        )
        return x + self.o_proj(out.reshape(t, hq * d))


def test_compile_fullgraph_writes_into_out():
    """``out=`` inside a compiled function: the op mutates the buffer (functionalized), eager's values."""
    batch = make_batch(_fused_spec(torch.float32, None))

    def attend(out, *caches):
        torch_kernels.ragged_paged_attention(**batch.inputs(caches=caches), out=out)
        return out * 2

    eager_out, compiled_out = torch.zeros_like(batch.query), torch.zeros_like(batch.query)
    want = attend(eager_out, *batch.caches())
    got = compiled_fullgraph(attend)(compiled_out, *batch.caches())
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(compiled_out, eager_out)


def test_compile_fullgraph_decoder_layer():
    torch.manual_seed(71)
    batch = make_batch(Spec(q_lens=(3, 1, 0, 2), kv_lens=(3, 18, 5, 40), num_kv_heads=2, group=2, head_size=32,
                            block_size=16, fused=True, padding=(4,), seed=72))
    layer = DecoderLayer(48, 4, 2, 32).eval().requires_grad_(False)
    x = torch.randn(batch.num_tokens, 48)
    meta = (batch.cu_q_lens, batch.kv_lens, batch.block_table, batch.slot_mapping)
    eager_caches, compiled_caches = batch.caches(), batch.caches()
    compiled = compiled_fullgraph(layer)
    with torch.no_grad():
        want = layer(x, *eager_caches, *meta)
        got = compiled(x, *compiled_caches, *meta)
    torch.testing.assert_close(got, want)
    for name, c, e, before in zip(("key_cache", "value_cache"), compiled_caches, eager_caches, batch.caches()):
        torch.testing.assert_close(c, e, msg=lambda m: f"{name}: {m}")
        real = batch.slot_mapping[batch.slot_mapping >= 0]
        assert not torch.equal(c.flatten(0, 1)[real], before.flatten(0, 1)[real]), f"{name}: nothing written"


@pytest.mark.parametrize("backend", BACKENDS)
def test_profiler_names_op_and_backend(backend):
    require_backend(backend)
    batch = make_batch(_fused_spec())
    caches = batch.caches()

    def run():
        batch.write(caches, implementation=backend)
        batch.attend(caches, fused=False, implementation=backend)

    names = profiled_names(run)
    for op in (WRITE_OP, OP):
        assert f"torch_kernels::{op}" in names
        assert f"torch_kernels::{op}[{backend}]" in names


def test_cpu_default_is_reference():
    batch = _check_batch()
    batch.attend(batch.caches())
    batch.write(batch.caches())
    assert backends.last_backend(OP) == backends.last_backend(WRITE_OP) == "reference"


def _brute_force_visible(q_lens, kv_lens, window) -> int:
    return sum(1 for q, kv in zip(q_lens, kv_lens) for p in range(kv - q, kv) for j in range(kv)
               if j <= p and (window is None or j > p - window))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(lens=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 40)), max_size=5),
       window=st.none() | st.integers(1, 50))
def test_visible_keys_counts_the_pairs(lens, window):
    q_lens = [q for q, _ in lens]
    kv_lens = [q + ctx for q, ctx in lens]
    assert ops.visible_keys(q_lens, kv_lens, window) == _brute_force_visible(q_lens, kv_lens, window)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("fused", [False, True], ids=["cached", "fused"])
def test_flop_counter_counts_the_op(window, fused):
    batch = make_batch(dataclasses.replace(_check_batch().spec, sliding_window=window, fused=fused))
    hq, d = batch.query.shape[1:]
    flops = counted_flops(lambda: batch.attend(batch.caches()))
    visible = _brute_force_visible(batch.spec.q_lens, batch.spec.kv_lens, window)
    assert flops == ops.attention_flops(hq, d, batch.spec.q_lens, batch.spec.kv_lens, window) == 4 * hq * d * visible


# ---- the byte formula, against counts made here ----

def _paged_batch(sliding_window=None, fused=False):
    """Two sequences over 4-slot pages in a shuffled pool: (kwargs of ragged_paged_attention,
    query lengths, kv lengths, page size)."""
    q_lens, kv_lens, page, hq, hkv, d = [3, 1], [7, 10], 4, 4, 2, 8
    gen = torch.Generator().manual_seed(12)
    pool = 8
    caches = [torch.randn(pool, page, hkv, d, generator=gen) for _ in range(2)]
    block_table = torch.randperm(pool, generator=gen, dtype=torch.int32)[:6].view(2, 3)
    args = dict(query=torch.randn(sum(q_lens), hq, d, generator=gen), key_cache=caches[0], value_cache=caches[1],
                cu_q_lens=torch.tensor([0, 3, 4], dtype=torch.int32), kv_lens=torch.tensor(kv_lens, dtype=torch.int32),
                block_table=block_table, sm_scale=d ** -0.5, sliding_window=sliding_window)
    if fused:  # the new tokens' keys and values written by the same call; the last token is padding
        positions = [(s, p) for s in range(2) for p in range(kv_lens[s] - q_lens[s], kv_lens[s])]
        slots = [int(block_table[s, p // page]) * page + p % page for s, p in positions]
        slots[-1] = -1
        key, value = (torch.randn(sum(q_lens), hkv, d, generator=gen) for _ in range(2))
        args.update(key=key, value=value, slot_mapping=torch.tensor(slots, dtype=torch.int64))
    return args, q_lens, kv_lens, page


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_paged_attention_bytes_count_the_cache_rows_read(sliding_window):
    args, q_lens, kv_lens, _ = _paged_batch(sliding_window)
    prof, out = profiled(lambda: torch_kernels.ragged_paged_attention(**args))
    hkv, d = args["key_cache"].shape[2:]
    rows_read = 0
    for q_len, kv_len in zip(q_lens, kv_lens):  # the key positions any of the sequence's queries sees
        seen = {j for p in range(kv_len - q_len, kv_len) for j in range(p + 1)
                if sliding_window is None or j > p - sliding_window}
        rows_read += len(seen)
    row = only_row(prof, "ragged_paged_attention")
    assert row["bytes"] == 2 * rows_read * hkv * d * FLOAT32_BYTES + nbytes(args["query"], out)
    assert row["flops"] == ops.attention_flops(args["query"].shape[1], d, q_lens, kv_lens, sliding_window)


def test_cache_writes_count_the_real_slots():
    args, _, _, _ = _paged_batch(fused=True)
    key, value, slots = args["key"], args["value"], args["slot_mapping"]
    real = slots >= 0
    written = nbytes(key[real], value[real], key[real], value[real])  # read from the inputs, then into the caches
    caches = args["key_cache"], args["value_cache"]
    prof, _ = profiled(lambda: torch_kernels.reshape_and_cache(key, value, *caches, slots))
    row = only_row(prof, "reshape_and_cache")
    assert (row["bytes"], row["flops"]) == (written + nbytes(slots), 0)

    prof, out = profiled(lambda: torch_kernels.ragged_paged_attention(**args))
    without_write, _ = profiled(lambda: torch_kernels.ragged_paged_attention(
        **{k: v for k, v in args.items() if k not in ("key", "value", "slot_mapping")}))
    assert only_row(prof, "ragged_paged_attention")["bytes"] == \
        only_row(without_write, "ragged_paged_attention")["bytes"] + written + nbytes(slots)

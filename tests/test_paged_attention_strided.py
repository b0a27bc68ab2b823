"""Paged attention on caches that are strided views: every backend reads and writes them in place.

vLLM hands a layer one tensor, logically ``[num_blocks, Hkv, block_size, 2 * D]`` in the physical
order its KV-cache layout sets; the key and value caches are views of it, permuted to
``[num_blocks, block_size, Hkv, D]``: their last dimension is contiguous, their other strides are
not. Each layout below builds such views over a tensor of random bytes (NaN patterns included),
copies a batch's caches into them, and runs the fused write + attention and the standalone write
on them: the output and the written caches equal, bit for bit, the same backend's on contiguous
copies, and every other element of the underlying tensors (the other half, other layers, gaps)
is unchanged bit for bit. Caches whose last dimension is not contiguous, or whose entries share
memory, are refused by the op (``tests/families/paged_attention.py`` lists those calls, run on every backend).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torch_kernels
from torch_kernels import backends
from torch_kernels.ops import paged_attention as ops

from harness import require_backend
from test_paged_attention import BACKENDS, OP, Spec, _fused_spec, assert_attention_close, make_batch


def _random_bytes(shape, dtype, gen) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` holding random bytes (NaN and inf codes too)."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=gen, dtype=torch.uint8)
    return raw.view(dtype)


def _halves(layer: torch.Tensor, head_size: int, head_major: bool):
    """Key and value caches ``[num_blocks, block_size, Hkv, D]`` of a ``[..., 2 * D]`` layer."""
    key, value = layer[..., :head_size], layer[..., head_size:]
    return (key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3)) if head_major else (key, value)


def _views(layout: str, shape, dtype, gen):
    """(key view, value view, the tensors they view) for ``layout``, over random bytes."""
    num_blocks, block_size, num_kv_heads, head_size = shape
    if layout == "vllm-hnd-halves":  # vLLM's LBHNC: [num_blocks, Hkv, block_size, 2 * D]
        base = _random_bytes((num_blocks, num_kv_heads, block_size, 2 * head_size), dtype, gen)
        return (*_halves(base, head_size, head_major=True), [base])
    if layout == "nhd-halves":  # vLLM's LBNHC: [num_blocks, block_size, Hkv, 2 * D]
        base = _random_bytes((num_blocks, block_size, num_kv_heads, 2 * head_size), dtype, gen)
        return (*_halves(base, head_size, head_major=False), [base])
    if layout == "cpu-attn-split":  # vLLM's CPU backend: keys, then values, in each (block, head)
        base = _random_bytes((num_blocks, num_kv_heads, 2 * block_size, head_size), dtype, gen)
        key, value = base[:, :, :block_size], base[:, :, block_size:]
        return key.permute(0, 2, 1, 3), value.permute(0, 2, 1, 3), [base]
    if layout == "cross-layer":  # vLLM's BLHNC: blocks outermost, layer 1 of 3
        base = _random_bytes((num_blocks, 3, num_kv_heads, block_size, 2 * head_size), dtype, gen)
        return (*_halves(base[:, 1], head_size, head_major=True), [base])
    if layout == "sliced":  # from larger buffers: skipped blocks, a spare head, padded rows
        bases = [_random_bytes((num_blocks + 3, block_size, num_kv_heads + 1, head_size + 16), dtype, gen)
                 for _ in range(2)]
        key, value = (b[2:2 + num_blocks, :, 1:, 8:8 + head_size] for b in bases)
        return key, value, bases
    raise ValueError(layout)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


# (layout, what the batch looks like): together GQA, MQA-ish groups, odd sizes (Hkv 3, D 80), a
# window, a soft cap, float and fp8 (vLLM's per-tensor k_scale / v_scale) and int8 caches.
CASES = [
    ("vllm-hnd-halves", _fused_spec(torch.float32, None, soft_cap=5.0)),
    ("nhd-halves", _fused_spec(torch.float16, None, sliding_window=None)),
    ("cpu-attn-split", _fused_spec(torch.bfloat16, torch.float8_e4m3fn, scale="one")),
    ("cross-layer", _fused_spec(torch.float32, torch.float8_e5m2, scale="scalar", sliding_window=7)),
    ("sliced", Spec(q_lens=(2, 1, 5, 0), kv_lens=(19, 33, 5, 4), num_kv_heads=3, group=3, head_size=80,
                    block_size=16, dtype=torch.float32, cache_dtype=torch.int8, scale="head", soft_cap=20.0,
                    fused=True, seed=13)),
]


# pallas crosses every cache to JAX as a contiguous copy (JAX arrays have no strides), so beyond
# vLLM's halves, the fp8 case and the odd sizes another layout tests nothing more there
PALLAS_LAYOUTS = ("vllm-hnd-halves", "cpu-attn-split", "sliced")
STRIDED_PARAMS = [pytest.param(backend.id, layout, spec, id=f"{layout}-{backend.id}")
                  for layout, spec in CASES for backend in BACKENDS
                  if backend.id != "pallas" or layout in PALLAS_LAYOUTS]


@pytest.mark.parametrize("backend, layout, spec", STRIDED_PARAMS)
def test_strided_caches_read_and_written_in_place(backend, layout, spec):
    """The fused write + attention (each slot its own position's, so triton fuses the write into
    its attention launch) and the standalone write (with padding tokens) on strided views: equal
    bit for bit to the same backend on contiguous copies, close to the definition, and nothing
    outside the written slots changes in the tensors the views share."""
    require_backend(backend)
    batch = make_batch(dataclasses.replace(spec, padding=()))
    gen = torch.Generator().manual_seed(spec.seed + 100)
    key_view, value_view, bases = _views(layout, batch.key_cache.shape, batch.key_cache.dtype, gen)
    assert not key_view.is_contiguous() and ops.is_cache_layout(key_view) and ops.is_cache_layout(value_view)
    key_view.copy_(batch.key_cache)
    value_view.copy_(batch.value_cache)
    before = [b.clone() for b in bases]

    contiguous = batch.caches()
    want = batch.attend(contiguous, implementation=backend)
    got = batch.attend((key_view, value_view), implementation=backend)
    assert backends.last_backend(OP) == backend
    assert torch.equal(_bits(got), _bits(want)), f"max difference {(got.float() - want.float()).abs().max()}"
    assert_attention_close(got, batch.expected()[0], spec.dtype, what=f"{backend} on {layout}")

    # the standalone write of other tokens, two of them padding, over the same views
    batch.slot_mapping = batch.slot_mapping.flip(0)
    batch.slot_mapping[[0, 3]] = -1
    batch.key, batch.value = batch.value, batch.key
    batch.write(contiguous, implementation=backend)
    batch.write((key_view, value_view), implementation=backend)
    assert torch.equal(_bits(key_view), _bits(contiguous[0])) and torch.equal(_bits(value_view), _bits(contiguous[1]))

    # every other element of the shared tensors as it was: the copies before the calls, with the
    # contiguous run's caches put through the same views, are the tensors after them
    expected = [b.clone() for b in before]
    for view, cache in zip((key_view, value_view), contiguous):
        _same_view(view, bases, expected).copy_(cache)
    for i, (base, want_base) in enumerate(zip(bases, expected)):
        assert torch.equal(_bits(base), _bits(want_base)), f"{layout}: tensor {i} changed outside the caches' slots"


def _same_view(view: torch.Tensor, bases: list, others: list) -> torch.Tensor:
    """The view ``view`` has of one of ``bases``, taken of the matching one of ``others``."""
    i = next(i for i, b in enumerate(bases) if b.untyped_storage().data_ptr() == view.untyped_storage().data_ptr())
    return others[i].as_strided(view.shape, view.stride(), view.storage_offset() - bases[i].storage_offset())


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_policy_on_strided_caches(backend):
    """NaN past a sequence's kv_len and one NaN key a chunk sees, in vLLM's NHD halves (where the
    CPU default gathers keys and values together): the same output, bit for bit, as on contiguous
    copies, whose NaN policy the other tests hold; and it does have NaN rows to compare."""
    require_backend(backend)
    batch = make_batch(_fused_spec(torch.float32, None, fused=False, padding=()))
    contiguous = batch.caches()
    block_size = batch.spec.block_size
    past_kv_len = int(batch.block_table[1, 1]) * block_size + 5  # the decode's kv_len is 18: page 1, offset 2
    seen = int(batch.block_table[3, 2]) * block_size + 1  # the chunk's position 33
    for cache in contiguous:
        cache.flatten(0, 1)[past_kv_len] = float("nan")
    contiguous[0].flatten(0, 1)[seen, 1, 7] = float("nan")
    key_view, value_view, _ = _views("nhd-halves", batch.key_cache.shape, torch.float32, torch.Generator())
    key_view.copy_(contiguous[0])
    value_view.copy_(contiguous[1])
    want = batch.attend(contiguous, implementation=backend)
    got = batch.attend((key_view, value_view), implementation=backend)
    assert want.isnan().any() and not want.isnan().all()
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_of_one_half_leaves_the_other_alone(backend):
    """vLLM's halves: a write changes exactly the written slots' key and value rows, nothing else
    of the shared tensor (bit for bit); a write with no real token changes nothing."""
    require_backend(backend)
    batch = make_batch(_fused_spec(torch.float32, None))
    gen = torch.Generator().manual_seed(5)
    key_view, value_view, (base,) = _views("vllm-hnd-halves", batch.key_cache.shape, torch.float32, gen)
    before = base.clone()
    slots = batch.slot_mapping.clone()
    torch_kernels.reshape_and_cache(batch.key, batch.value, key_view, value_view, torch.full_like(slots, -1),
                                    implementation=backend)
    assert torch.equal(_bits(base), _bits(before))
    torch_kernels.reshape_and_cache(batch.key, batch.value, key_view, value_view, slots, implementation=backend)
    block_size = batch.spec.block_size
    real = slots[slots >= 0]
    blocks, offsets = real // block_size, real % block_size
    written = torch.zeros(base.shape[:3], dtype=torch.bool)  # [num_blocks, Hkv, block_size]
    written[blocks, :, offsets] = True
    assert torch.equal(_bits(base[~written]), _bits(before[~written]))
    assert torch.equal(key_view[blocks, offsets], batch.key[slots >= 0])
    assert torch.equal(value_view[blocks, offsets], batch.value[slots >= 0])


# (strides, whether the op takes them) for a [4, 16, 2, 8] cache
STRIDE_CASES = [
    ((256, 16, 8, 1), True),  # contiguous
    ((512, 32, 16, 1), True),  # the first half of [..., 16] rows
    ((512, 16, 256, 1), True),  # head-major blocks (HND)
    ((1024, 16, 256, 1), True),  # gaps between blocks
    ((256, 16, 8, 2), False),  # the last dimension strided
    ((0, 16, 8, 1), False),  # every block the same memory
    ((256, 8, 8, 1), False),  # slots overlapping heads
    ((128, 16, 8, 1), False),  # blocks overlapping
]


@pytest.mark.parametrize("strides, accepted", STRIDE_CASES, ids=[str(s) for s, _ in STRIDE_CASES])
def test_which_strides_the_op_takes(strides, accepted):
    """Any strides whose last is 1 and that keep distinct entries apart in memory."""
    storage = torch.zeros(8192)
    cache = storage.as_strided((4, 16, 2, 8), strides)
    assert ops.is_cache_layout(cache) == accepted
    value_cache = torch.zeros(4, 16, 2, 8)
    call = lambda: torch_kernels.reshape_and_cache(torch.ones(1, 2, 8), torch.ones(1, 2, 8), cache, value_cache,
                                                   torch.tensor([3]), implementation="reference")
    if accepted:
        call()
        assert torch.equal(cache[0, 3], torch.ones(2, 8))
    else:
        with pytest.raises(ValueError, match=r"^key_cache: expected a stride-1 last dimension"):
            call()

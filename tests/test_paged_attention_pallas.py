"""The pallas backend of paged_attention: the Pallas kernels (interpret mode) against the definition.

Covers ragged batches (decode, chunked prefill, whole prompts, sequences with no queries),
shuffled block tables with garbage past each sequence's pages, partial last pages holding NaN
bytes, sliding windows, soft caps, GQA, int8 / fp8 caches, the fused write (equal to a write
then attention), cache bytes outside the written slots, the NaN/inf policy of the kernel and of
the jnp definition, the TPU lowering, and torchax tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_kernels
from torch_kernels.reference import paged_attention as reference

from torch_kernels.selftest import TOLERANCES, relative_error

from harness import require_backend, run_isolated

pytestmark = pytest.mark.usefixtures("pallas")

# (q_len, kv_len) per sequence: decode, no queries (with and without keys), whole prompt,
# chunked prefill, a one-token prompt, a partial last page
LENS = [(1, 37), (0, 0), (20, 20), (0, 9), (5, 70), (1, 1), (3, 33)]
POISON = 0xFF  # NaN in every float dtype here (and -1 in int8)


@pytest.fixture(scope="module")
def pallas():
    require_backend("pallas")


def _jax():
    from jax_impl import paged_attention as kernels
    from torch_kernels.pallas.torch_tensors import to_jax, to_torch

    return kernels, to_jax, to_torch


def _random_entries(gen, shape, scale, dtype):
    values = torch.randn(shape, generator=gen) * 2
    if dtype in reference.QUANTIZED_DTYPES:
        return reference.quantize(values * scale[:, None], scale, dtype)
    return values.to(dtype)


def make_batch(seed, num_kv_heads, group, head_size, block_size, cache_dtype, query_dtype=torch.float32,
               lens=LENS):
    """A ragged batch whose pages are shuffled; table entries past a sequence's pages, slots past
    its kv_len and blocks no sequence uses hold garbage (NaN bytes in the caches)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-kv // block_size) for _, kv in lens]
    max_pages = max(pages) + 2
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks, generator=gen).int()
    table = torch.randint(-(10**6), 10**6, (len(lens), max_pages), generator=gen, dtype=torch.int32)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    taken = 0
    for s, (n, (_, kv_len)) in enumerate(zip(pages, lens)):
        table[s, :n] = order[taken:taken + n]
        taken += n
        for p in range(kv_len):
            used[table[s, p // block_size], p % block_size] = True
    cu_q_lens = torch.tensor([0, *np.cumsum([q for q, _ in lens])], dtype=torch.int32)
    kv_lens = torch.tensor([kv for _, kv in lens], dtype=torch.int32)
    k_scale = torch.rand(num_kv_heads, generator=gen) + 0.5
    v_scale = torch.rand(num_kv_heads, generator=gen) + 0.5
    if cache_dtype not in reference.QUANTIZED_DTYPES:
        k_scale, v_scale = torch.ones(num_kv_heads), torch.ones(num_kv_heads)
    caches = []
    for scale in (k_scale, v_scale):
        cache = _random_entries(gen, (num_blocks, block_size, num_kv_heads, head_size), scale, cache_dtype)
        cache.view(torch.uint8)[~used] = POISON
        caches.append(cache)
    query = torch.randn(int(cu_q_lens[-1]), num_kv_heads * group, head_size, generator=gen).to(query_dtype)
    return dict(query=query, key_cache=caches[0], value_cache=caches[1], cu_q_lens=cu_q_lens, kv_lens=kv_lens,
                block_table=table, k_scale=k_scale, v_scale=v_scale)


def new_tokens(batch, seed, skip=(1, 4)):
    """Keys and values for every query token, written to its own position (tokens ``skip``: -1)."""
    gen = torch.Generator().manual_seed(seed)
    query, key_cache = batch["query"], batch["key_cache"]
    block_size, num_kv_heads, head_size = key_cache.shape[1:]
    shape = (query.shape[0], num_kv_heads, head_size)
    key = (torch.randn(shape, generator=gen) * batch["k_scale"][:, None] * 40).to(query.dtype)
    value = (torch.randn(shape, generator=gen) * batch["v_scale"][:, None] * 40).to(query.dtype)
    slots = torch.full((query.shape[0],), -1, dtype=torch.int64)
    cu, kv = batch["cu_q_lens"].tolist(), batch["kv_lens"].tolist()
    for s in range(len(kv)):
        for t in range(cu[s], cu[s + 1]):
            position = kv[s] - (cu[s + 1] - t)
            slots[t] = int(batch["block_table"][s, position // block_size]) * block_size + position % block_size
    slots[list(skip)] = -1
    return key, value, slots


def naive(batch, sm_scale, sliding_window=None, soft_cap=None, key=None, value=None, slot_mapping=None):
    """The definition in float32 on copies of the caches: (out, key_cache, value_cache)."""
    kc, vc = batch["key_cache"].clone(), batch["value_cache"].clone()
    out = reference.ragged_paged_attention_naive(
        batch["query"].float(), kc, vc, batch["cu_q_lens"], batch["kv_lens"], batch["block_table"], sm_scale,
        sliding_window, soft_cap, batch["k_scale"], batch["v_scale"], key, value, slot_mapping)
    return out, kc, vc


def run_kernel(batch, sm_scale, sliding_window=None, soft_cap=None, key=None, value=None, slot_mapping=None,
               config=None):
    """The Pallas kernel on the batch: (out, key_cache, value_cache) as torch tensors."""
    kernels, to_jax, to_torch = _jax()
    names = ("query", "key_cache", "value_cache", "cu_q_lens", "kv_lens", "block_table")
    new = [None if t is None else to_jax(t) for t in (key, value, None if slot_mapping is None else slot_mapping.int())]
    out, kc, vc = kernels.ragged_paged_attention(
        *(to_jax(batch[n]) for n in names), sm_scale, sliding_window, soft_cap, to_jax(batch["k_scale"]),
        to_jax(batch["v_scale"]), *new, config=config)
    return to_torch(out), to_torch(kc), to_torch(vc)


def assert_close(out, expected, dtype, what=""):
    """max |out - expected| / max |expected| within the tolerance of ``dtype``."""
    assert out.shape == expected.shape, f"{what}: shape {tuple(out.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err, tol = relative_error(out, expected), TOLERANCES[dtype][0]
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e} for {dtype}"


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def config(**kw):
    from jax_impl.paged_attention import Config

    return Config(**kw)


# (Hkv, G, D, block_size, cache dtype, query dtype, window, soft cap, config); kv_pages=2 makes
# several double-buffered tiles per sequence. Each case costs a compile of about 2 s.
CASES = {
    "f32-gqa2-d64-bs16": (2, 2, 64, 16, torch.float32, torch.float32, None, None, dict(kv_pages=2)),
    "f32-mha-d128-bs32-window-cap": (2, 1, 128, 32, torch.float32, torch.float32, 20, 30.0, dict(kv_pages=1)),
    "e5m2-d64-bs16-head-blocks": (4, 1, 64, 16, torch.float8_e5m2, torch.float32, 16, None,
                                  dict(kv_pages=2, kv_heads_per_block=2)),
    "bf16-gqa2-d64-bs16": (2, 2, 64, 16, torch.bfloat16, torch.bfloat16, None, None, dict(kv_pages=2)),
    "f16-gqa2-d64-bs16-window": (2, 2, 64, 16, torch.float16, torch.float16, 7, None, dict(kv_pages=2)),
    "bf16-int8-q16-cap": (2, 2, 64, 16, torch.int8, torch.bfloat16, None, 20.0, dict(q_block=16, kv_pages=3)),
}
FUSED_CASES = {
    "int8-gqa4-d128-bs16-window": (1, 4, 128, 16, torch.int8, torch.float32, 9, None, dict(kv_pages=2)),
    "e4m3-gqa2-d64-bs32-cap": (2, 2, 64, 32, torch.float8_e4m3fn, torch.float32, None, 5.0, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_definition(case):
    heads, group, d, bs, cache_dtype, query_dtype, window, cap, cfg = CASES[case]
    batch = make_batch(1, heads, group, d, bs, cache_dtype, query_dtype)
    out, kc, vc = run_kernel(batch, d ** -0.5, window, cap, config=config(**cfg))
    expected, _, _ = naive(batch, d ** -0.5, window, cap)
    assert out.dtype == query_dtype
    assert_close(out, expected, query_dtype, what=case)
    assert same_bytes(kc, batch["key_cache"]) and same_bytes(vc, batch["value_cache"])


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fused_write_equals_write_then_attention(case):
    heads, group, d, bs, cache_dtype, query_dtype, window, cap, cfg = FUSED_CASES[case]
    batch = make_batch(2, heads, group, d, bs, cache_dtype, query_dtype)
    key, value, slots = new_tokens(batch, 3)
    out, kc, vc = run_kernel(batch, d ** -0.5, window, cap, key, value, slots, config=config(**cfg))
    expected, want_k, want_v = naive(batch, d ** -0.5, window, cap, key, value, slots)
    assert same_bytes(kc, want_k) and same_bytes(vc, want_v)  # the written slots, and nothing else
    assert_close(out, expected, query_dtype, what=case)
    if cache_dtype != torch.int8:
        return  # two more compiles: once is enough
    # the same kernel, unfused, after the standalone write: the same numbers exactly
    kernels, to_jax, to_torch = _jax()
    new_k, new_v = kernels.reshape_and_cache(*map(to_jax, (key, value, batch["key_cache"], batch["value_cache"],
                                                           slots.int(), batch["k_scale"], batch["v_scale"])))
    written = dict(batch, key_cache=to_torch(new_k), value_cache=to_torch(new_v))
    unfused, _, _ = run_kernel(written, d ** -0.5, window, cap, config=config(**cfg))
    assert torch.equal(out, unfused)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_reshape_and_cache_bitwise(cache_dtype):
    """Rounding (int8 halves to even), saturation and skipped tokens exactly as the reference;
    every byte outside the written slots (NaN patterns included) untouched."""
    kernels, to_jax, to_torch = _jax()
    gen = torch.Generator().manual_seed(4)
    num_blocks, block_size, heads, d, tokens = 5, 16, 2, 64, 23
    size = torch.tensor([], dtype=cache_dtype).element_size()
    caches = [torch.randint(0, 256, (num_blocks, block_size, heads, d * size), generator=gen, dtype=torch.uint8)
              .view(cache_dtype) for _ in range(2)]
    scale = torch.tensor([0.5, 0.25])
    halves = (torch.randint(-300, 300, (tokens, heads, d), generator=gen) + 0.5) * scale[:, None]
    key = torch.where(torch.rand(tokens, heads, d, generator=gen) < 0.1, torch.tensor(1e6), halves)
    value = torch.randn(tokens, heads, d, generator=gen) * 1e3
    if cache_dtype == torch.bfloat16:
        key, value, scale = key.bfloat16(), value.bfloat16(), torch.ones(heads)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[0, 7, 8]] = -1
    want_k, want_v = caches[0].clone(), caches[1].clone()
    reference.reshape_and_cache(key, value, want_k, want_v, slots, scale, scale * 2)
    new_k, new_v = kernels.reshape_and_cache(*map(to_jax, (key, value, *caches, slots.int(), scale, scale * 2)))
    assert same_bytes(to_torch(new_k), want_k) and same_bytes(to_torch(new_v), want_v)


def _plant_non_finite(batch):
    """NaN and inf in a few entries sequences see (the prompt's, the chunk's) and in one query
    element; the caches already hold NaN bytes past every kv_len."""
    block_size = batch["key_cache"].shape[1]

    def slot(s, position):
        return int(batch["block_table"][s, position // block_size]), position % block_size

    batch = dict(batch, key_cache=batch["key_cache"].clone(), value_cache=batch["value_cache"].clone(),
                 query=batch["query"].clone())
    batch["key_cache"][slot(4, 66) + (1, 3)] = float("nan")  # the chunk at 65..69
    batch["value_cache"][slot(2, 3) + (0, 7)] = float("-inf")  # the prompt at 0..19
    batch["key_cache"][slot(0, 30) + (1, 0)] = float("inf")  # the decode at 36
    batch["query"][int(batch["cu_q_lens"][6]) + 1, 2, 5] = float("nan")
    return batch


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e5m2])
def test_nan_policy_of_kernel_and_jnp_definition(cache_dtype):
    """Rows that see a NaN or inf (or whose query holds one) are NaN, whole, in the Pallas kernel
    (several double-buffered tiles, heads split over grid steps) and in the jnp definition (the
    reference on torchax tensors) as in the torch definition; every other row matches it."""
    kernels, to_jax, to_torch = _jax()
    batch = _plant_non_finite(make_batch(10, 2, 2, 64, 16, cache_dtype))
    expected, _, _ = naive(batch, 0.125, 24, 10.0)
    nan_rows = expected.isnan().all(dim=-1)
    assert nan_rows.any() and not nan_rows.all() and not expected[~nan_rows].isnan().any()
    out, _, _ = run_kernel(batch, 0.125, 24, 10.0, config=config(kv_pages=2, kv_heads_per_block=1))
    names = ("query", "key_cache", "value_cache", "cu_q_lens", "kv_lens", "block_table")
    jnp_out, _, _ = kernels.ragged_paged_attention_reference(*(to_jax(batch[n]) for n in names), 0.125, 24, 10.0,
                                                             to_jax(batch["k_scale"]), to_jax(batch["v_scale"]))
    for name, result in (("pallas", out), ("jnp definition", to_torch(jnp_out))):
        assert torch.equal(result.isnan().all(dim=-1), nan_rows), name
        assert_close(result[~nan_rows], expected[~nan_rows], torch.float32, what=name)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16])
def test_jnp_write_stores_nan_and_saturates(cache_dtype):
    """The jnp write (the reference on torchax tensors) stores as the torch reference: NaN kept
    (int8: 0), +-inf and huge values saturated in fp8 and int8."""
    kernels, to_jax, to_torch = _jax()
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 3e38, 1.5, -2.5, 0.0, 300.0])
    dtype = torch.float16 if cache_dtype == torch.float16 else torch.float32
    key = values.repeat(2, 2, 7)[:, :, :64].to(dtype)
    value = -key
    caches = [torch.zeros(2, 16, 2, 64, dtype=cache_dtype) for _ in range(2)]
    slots = torch.tensor([3, 20])
    scale = torch.tensor([1.0, 0.5])
    new_k, new_v = kernels.reshape_and_cache_reference(*map(to_jax, (key, value, *caches, slots.int(), scale, scale)))
    reference.reshape_and_cache(key, value, *caches, slots, scale, scale)
    for got, want in zip((to_torch(new_k), to_torch(new_v)), caches):
        same = (got.float() == want.float()) | (got.float().isnan() & want.float().isnan())
        assert same.all(), f"got {got.float()[~same][:4]}, want {want.float()[~same][:4]}"
    if cache_dtype == torch.int8:
        assert (caches[0].flatten(0, 1)[slots][key.isnan()] == 0).all()


def test_torch_ops_run_pallas_in_place():
    """Through the op layer on CPU tensors: the caches are updated in place, other bytes kept."""
    batch = make_batch(5, 2, 2, 64, 16, torch.float32)
    key, value, slots = new_tokens(batch, 6)
    expected, want_k, want_v = naive(batch, 0.125, None, 10.0, key, value, slots)
    kc, vc = batch["key_cache"].clone(), batch["value_cache"].clone()
    out = torch_kernels.ragged_paged_attention(
        batch["query"], kc, vc, batch["cu_q_lens"], batch["kv_lens"], batch["block_table"], 0.125, None, 10.0,
        batch["k_scale"], batch["v_scale"], key, value, slots, implementation="pallas")
    assert_close(out, expected, torch.float32)
    assert same_bytes(kc, want_k) and same_bytes(vc, want_v)
    kc, vc = batch["key_cache"].clone(), batch["value_cache"].clone()
    torch_kernels.reshape_and_cache(key, value, kc, vc, slots, batch["k_scale"], batch["v_scale"],
                                    implementation="pallas")
    assert same_bytes(kc, want_k) and same_bytes(vc, want_v)


def test_empty_batch_and_unsupported_inputs():
    from torch_kernels.pallas import paged_attention

    batch = make_batch(7, 1, 1, 64, 16, torch.float32, lens=[(0, 0), (0, 5)])
    out, kc, _ = run_kernel(batch, 0.125)
    assert out.shape == (0, 1, 64) and same_bytes(kc, batch["key_cache"])
    meta = torch.empty(3, 1, 64, device="meta")
    with pytest.raises(NotImplementedError, match="pallas: takes torchax tensors or CPU tensors"):
        paged_attention.pallas_ragged_paged_attention(meta, meta, *[None] * 12)
    with pytest.raises(NotImplementedError, match="pallas: caches of dtype torch.float64"):
        paged_attention.pallas_reshape_and_cache(torch.zeros(1, 1, 8, dtype=torch.float64), None,
                                                 torch.zeros(1, 1, 1, 8, dtype=torch.float64), *[None] * 4)


# (T, S, Hq, Hkv, D, block_size, query dtype, cache dtype, fused, window, soft cap)
LOWERINGS = [
    (64, 4, 8, 2, 128, 16, "bfloat16", "bfloat16", False, None, None),
    (64, 4, 8, 2, 128, 16, "bfloat16", "int8", True, 64, 30.0),
    (32, 8, 4, 4, 64, 32, "float32", "float8_e4m3fn", True, None, None),
    (16, 16, 16, 4, 256, 128, "float16", "float8_e5m2", False, 128, None),
    (48, 2, 32, 16, 128, 64, "bfloat16", "bfloat16", True, None, 50.0),
]


@pytest.mark.parametrize("shape", LOWERINGS, ids=lambda s: "-".join(map(str, s)))
def test_lowers_for_tpu(shape):
    import jax

    from jax_impl import paged_attention as kernels

    t, s, hq, hkv, d, bs, qdt, cdt, fused, window, cap = shape
    num_blocks, max_pages = 64, 8
    spec = jax.ShapeDtypeStruct
    args = [spec((t, hq, d), qdt), spec((num_blocks, bs, hkv, d), cdt), spec((num_blocks, bs, hkv, d), cdt),
            spec((s + 1,), "int32"), spec((s,), "int32"), spec((s, max_pages), "int32"),
            spec((hkv,), "float32"), spec((hkv,), "float32")]
    if fused:
        args += [spec((t, hkv, d), qdt), spec((t, hkv, d), qdt), spec((t,), "int32")]

    def attention(*a):
        return kernels.ragged_paged_attention(*a[:6], d ** -0.5, window, cap, *a[6:], interpret=False)

    exported = jax.export.export(jax.jit(attention), platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exported.mlir_module()
    if fused:
        def write(*a):
            return kernels.reshape_and_cache(*a, interpret=False)

        exported = jax.export.export(jax.jit(write), platforms=["tpu"])(*args[8:10], *args[1:3], args[10], *args[6:8])
        assert "tpu_custom_call" in exported.mlir_module()


def test_torchax_tensors_run_pallas_and_update_caches():
    run_isolated(TORCHAX_CHECK)


# In a process of its own (torchax registers a device for the whole process). JAX runs without
# 64-bit ints, as by default: the int64 slot_mapping arrives as int32.
TORCHAX_CHECK = """
import pytest, torch, torch_kernels
from test_paged_attention_pallas import assert_close, make_batch, naive, new_tokens, same_bytes

env = torch_kernels.torchax_environment()
batch = make_batch(8, 2, 2, 64, 16, torch.int8)
key, value, slots = new_tokens(batch, 9)
expected, want_k, want_v = naive(batch, 0.125, 24, None, key, value, slots)
names = ("query", "key_cache", "value_cache", "cu_q_lens", "kv_lens", "block_table")
with env:
    q, kc, vc, cu, kv, table = (batch[n].to("jax") for n in names)
    ks, vs, jk, jv, js = (t.to("jax") for t in (batch["k_scale"], batch["v_scale"], key, value, slots))
    results = {}
    for impl in ("pallas", "reference"):
        kci, vci = kc.clone(), vc.clone()
        out = torch_kernels.ragged_paged_attention(q, kci, vci, cu, kv, table, 0.125, 24, None, ks, vs, jk, jv, js,
                                                   implementation=impl)
        assert type(out).__module__.startswith("torchax"), type(out)
        results[impl] = (out.to("cpu"), kci.to("cpu"), vci.to("cpu"))
    kci, vci = kc.clone(), vc.clone()
    torch.ops.torch_kernels.reshape_and_cache(jk, jv, kci, vci, js, ks, vs)
    written = (kci.to("cpu"), vci.to("cpu"))
    kci, vci, into = kc.clone(), vc.clone(), torch.zeros_like(q)
    assert torch_kernels.ragged_paged_attention(q, kci, vci, cu, kv, table, 0.125, 24, None, ks, vs, jk, jv, js,
                                                out=into) is into
    into_written = (into.to("cpu"), kci.to("cpu"), vci.to("cpu"))
    with pytest.raises(TypeError, match="^out: expected dtype"):
        torch_kernels.ragged_paged_attention(q, kc, vc, cu, kv, table, 0.125, out=torch.zeros_like(q).half())
    with pytest.raises(NotImplementedError, match="torchax tensors run"):
        torch_kernels.ragged_paged_attention(q, kc, vc, cu, kv, table, 0.125, implementation="triton")
    with pytest.raises(ValueError, match="block_table"):
        torch_kernels.ragged_paged_attention(q, kc, vc, cu, kv, table[:1], 0.125)
for impl, (out, kci, vci) in results.items():
    assert_close(out, expected, torch.float32, what=impl)
    assert same_bytes(kci, want_k) and same_bytes(vci, want_v), impl
assert same_bytes(written[0], want_k) and same_bytes(written[1], want_v)
assert torch.equal(into_written[0], results["pallas"][0]), "out= on torchax"
assert same_bytes(into_written[1], want_k) and same_bytes(into_written[2], want_v)
print("torchax ok")
"""

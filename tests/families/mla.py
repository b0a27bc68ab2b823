"""mla's bad-input rows (ragged_paged_mla, mla_reshape_and_cache) and device cases.

A rejected write must also leave the cache as it was (an ``AssertionError`` then replaces the
expected error).
"""

from __future__ import annotations

from typing import Callable

import torch

import torch_kernels
from families import FP8, LARGE, DeviceCase, K, Row, interpreter_sizes, map_arg, set_arg, set_at, sized
from torch_kernels.ops import mla as family_ops


# ---- bad inputs ----

def _batch() -> dict:
    """S = 3 sequences (q_lens 2, 0, 3; kv_lens 5, 7, 20), T = 5, H = 4, Lr = 32, R = 16, pages of
    16 in a cache of 6 blocks, block_table with garbage past each sequence's pages."""
    gen = torch.Generator().manual_seed(0)
    return dict(
        q_nope=torch.randn(5, 4, 32, generator=gen), q_pe=torch.randn(5, 4, 16, generator=gen),
        kv_cache=torch.randn(6, 16, 48, generator=gen),
        cu_q_lens=torch.tensor([0, 2, 2, 5], dtype=torch.int32), kv_lens=torch.tensor([5, 7, 20], dtype=torch.int32),
        block_table=torch.tensor([[3, -7, 2**31 - 1], [0, 9, -1], [5, 1, 6]], dtype=torch.int32), sm_scale=0.125,
        topk_indices=torch.tensor([[0, 4], [-1, 1], [19, 3], [0, -1], [2, 2]], dtype=torch.int32),
    )


def _write_batch() -> dict:
    """T = 5 new rows (Lr = 32, R = 16) for a 6-block cache of 16-slot pages, one padding slot."""
    gen = torch.Generator().manual_seed(0)
    return dict(kv_c=torch.randn(5, 32, generator=gen), k_pe=torch.randn(5, 16, generator=gen),
                kv_cache=torch.randn(6, 16, 48, generator=gen), slot_mapping=torch.tensor([51, 52, -1, 17, 95]))


def _indexer_batch() -> dict:
    """The attention batch's lengths and pages; Hi = 3 indexer heads of Di = 8, top_k 4."""
    gen = torch.Generator().manual_seed(0)
    kw = {name: t for name, t in _batch().items() if name in ("cu_q_lens", "kv_lens", "block_table")}
    return dict(q=torch.randn(5, 3, 8, generator=gen), k_cache=torch.randn(6, 16, 8, generator=gen),
                weights=torch.rand(5, 3, generator=gen), **kw, top_k=4)


def _indexer(change) -> Callable[[str], object]:
    def call(backend):
        kw = _indexer_batch()
        change(kw)
        return torch_kernels.indexer_topk(**kw, implementation=backend)
    return call


def _attention(change) -> Callable[[str], object]:
    def call(backend):
        kw = _batch()
        change(kw)
        return torch_kernels.ragged_paged_mla(**kw, implementation=backend)
    return call


def _write(change) -> Callable[[str], object]:
    def call(backend):
        kw = _write_batch()
        change(kw)
        cache = kw["kv_cache"]
        before = cache.clone() if isinstance(cache, torch.Tensor) and cache.device.type != "meta" else None
        try:
            return torch_kernels.mla_reshape_and_cache(**kw, implementation=backend)
        finally:
            if before is not None and before.shape == cache.shape and before.dtype == cache.dtype \
                    and not torch.equal(cache, before):
                raise AssertionError("kv_cache: a rejected call wrote to it")
    return call


def _strided(t):
    return torch.cat([t, t], dim=-1)[..., ::2]


ATTENTION = [  # (case, argument, error, change of the good call's keyword arguments)
    ("q_nope 2-D", "q_nope", ValueError, map_arg("q_nope", lambda t: t[0])),
    ("q_nope int", "q_nope", TypeError, map_arg("q_nope", lambda t: t.int())),
    ("q_nope a list", "q_nope", TypeError, map_arg("q_nope", lambda t: t.tolist())),
    ("q_pe dtype", "q_pe", TypeError, map_arg("q_pe", lambda t: t.half())),
    ("q_pe heads", "q_pe", ValueError, map_arg("q_pe", lambda t: t[:, :3])),
    ("no RoPE part", "q_pe", ValueError,
     lambda kw: kw.update(q_pe=kw["q_pe"][..., :0], kv_cache=kw["kv_cache"][..., :32].contiguous())),
    ("no latent part", "q_nope", ValueError,
     lambda kw: kw.update(q_nope=kw["q_nope"][..., :0], kv_cache=kw["kv_cache"][..., :16].contiguous())),
    ("kv_cache width", "kv_cache", ValueError, map_arg("kv_cache", lambda t: t[..., :40])),
    ("kv_cache 4-D", "kv_cache", ValueError, map_arg("kv_cache", lambda t: t[:, :, None])),
    ("kv_cache float16 for float32 queries", "kv_cache", TypeError, map_arg("kv_cache", lambda t: t.half())),
    ("kv_cache strided last dimension", "kv_cache", ValueError, map_arg("kv_cache", _strided)),
    ("cu_q_lens int64", "cu_q_lens", TypeError, map_arg("cu_q_lens", lambda t: t.long())),
    ("cu_q_lens length", "cu_q_lens", ValueError, map_arg("cu_q_lens", lambda t: t[:3])),
    ("cu_q_lens not ending at T", "cu_q_lens", ValueError, set_at("cu_q_lens", 3, 4)),
    ("kv_lens below the query length", "kv_lens", ValueError, set_at("kv_lens", 2, 2)),
    ("kv_lens past the block table", "kv_lens", ValueError, set_at("kv_lens", 2, 49)),
    ("block_table page out of range", "block_table", ValueError, set_at("block_table", 2, torch.tensor([5, 6, 1]))),
    ("block_table rows", "block_table", ValueError, map_arg("block_table", lambda t: t[:2])),
    ("sm_scale zero", "sm_scale", ValueError, set_arg("sm_scale", 0.0)),
    ("sm_scale a string", "sm_scale", TypeError, set_arg("sm_scale", "0.1")),
    ("topk_indices past kv_len", "topk_indices", ValueError, set_at("topk_indices", 0, torch.tensor([0, 5]))),
    ("topk_indices below -1", "topk_indices", ValueError, set_at("topk_indices", 1, torch.tensor([-2, 0]))),
    ("topk_indices rows", "topk_indices", ValueError, map_arg("topk_indices", lambda t: t[:4])),
    ("topk_indices int64", "topk_indices", TypeError, map_arg("topk_indices", lambda t: t.long())),
    ("topk_indices empty", "topk_indices", ValueError, map_arg("topk_indices", lambda t: t[:, :0])),
    ("return_lse 1", "return_lse", TypeError, set_arg("return_lse", 1)),
    ("kv_scale two", "kv_scale", ValueError, set_arg("kv_scale", torch.ones(2))),
    ("kv_scale zero", "kv_scale", ValueError, set_arg("kv_scale", torch.zeros(1))),
    ("kv_scale float64", "kv_scale", TypeError, set_arg("kv_scale", torch.ones(1, dtype=torch.float64))),
    ("kv_lens on meta", "kv_lens", ValueError, map_arg("kv_lens", lambda t: t.to("meta"))),
]

WRITE = [
    ("kv_c 3-D", "kv_c", ValueError, map_arg("kv_c", lambda t: t[:, None])),
    ("kv_c int", "kv_c", TypeError, map_arg("kv_c", lambda t: t.int())),
    ("k_pe dtype", "k_pe", TypeError, map_arg("k_pe", lambda t: t.half())),
    ("k_pe tokens", "k_pe", ValueError, map_arg("k_pe", lambda t: t[:4])),
    ("no RoPE part", "k_pe", ValueError,
     lambda kw: kw.update(k_pe=kw["k_pe"][:, :0], kv_cache=kw["kv_cache"][..., :32].contiguous())),
    ("kv_cache width", "kv_cache", ValueError, map_arg("kv_cache", lambda t: t[..., :47])),
    ("kv_cache float16 for float32 rows", "kv_cache", TypeError, map_arg("kv_cache", lambda t: t.half())),
    ("kv_cache blocks sharing memory", "kv_cache", ValueError, map_arg("kv_cache", lambda t: t[:1].expand(t.shape))),
    ("kv_cache strided last dimension", "kv_cache", ValueError, map_arg("kv_cache", _strided)),
    ("slot_mapping past the cache", "slot_mapping", ValueError, set_at("slot_mapping", 1, 96)),
    ("slot_mapping below -1", "slot_mapping", ValueError, set_at("slot_mapping", 1, -2)),
    ("slot_mapping repeated", "slot_mapping", ValueError, set_at("slot_mapping", 1, 51)),
    ("slot_mapping length", "slot_mapping", ValueError, map_arg("slot_mapping", lambda t: t[:4])),
    ("slot_mapping float", "slot_mapping", TypeError, map_arg("slot_mapping", lambda t: t.float())),
    ("scale negative", "scale", ValueError, set_arg("scale", torch.tensor([-1.0]))),
    ("scale nan", "scale", ValueError, set_arg("scale", torch.tensor(float("nan")))),
    ("scale per row", "scale", ValueError, set_arg("scale", torch.ones(48))),
    ("kv_cache a list", "kv_cache", TypeError, map_arg("kv_cache", lambda t: t.tolist())),
]

INDEXER = [
    ("q 2-D", "q", ValueError, map_arg("q", lambda t: t[0])),
    ("q int", "q", TypeError, map_arg("q", lambda t: t.int())),
    ("k_cache head size", "k_cache", ValueError, map_arg("k_cache", lambda t: t[..., :4])),
    ("k_cache dtype", "k_cache", TypeError, map_arg("k_cache", lambda t: t.half())),
    ("k_cache strided last dimension", "k_cache", ValueError, map_arg("k_cache", _strided)),
    ("weights shape", "weights", ValueError, map_arg("weights", lambda t: t[:, :2])),
    ("weights int", "weights", TypeError, map_arg("weights", lambda t: t.int())),
    ("cu_q_lens not starting at 0", "cu_q_lens", ValueError, set_at("cu_q_lens", 0, 1)),
    ("kv_lens length", "cu_q_lens", ValueError, map_arg("kv_lens", lambda t: t[:2])),
    ("block_table page out of range", "block_table", ValueError, set_at("block_table", 0, torch.tensor([6, 0, 0]))),
    ("top_k zero", "top_k", ValueError, set_arg("top_k", 0)),
    ("top_k a float", "top_k", TypeError, set_arg("top_k", 4.0)),
    ("top_k past int32", "top_k", ValueError, set_arg("top_k", 2**40)),
    ("top_k past int64", "top_k", ValueError, set_arg("top_k", 2**63)),
    ("weights on meta", "weights", ValueError, map_arg("weights", lambda t: t.to("meta"))),
]

BAD_INPUTS = {"mla": [Row(f"indexer_topk: {c}", a, e, _indexer(ch), "indexer_topk") for c, a, e, ch in INDEXER] + [Row(f"ragged_paged_mla: {c}", a, e, _attention(ch), "ragged_paged_mla")
                      for c, a, e, ch in ATTENTION]
              + [Row(f"mla_reshape_and_cache: {c}", a, e, _write(ch), "mla_reshape_and_cache")
                 for c, a, e, ch in WRITE]}


# ---- device cases ----

def _attention_run(*inputs, implementation=None):
    *tensors, sm_scale, topk, kv_scale = inputs if len(inputs) == 9 else (*inputs, None, None)
    return torch_kernels.ragged_paged_mla(*tensors, sm_scale, topk_indices=topk, kv_scale=kv_scale,
                                          return_lse=True, implementation=implementation)


def with_topk(maker, top_k=8):
    """``maker``'s inputs and random top-k indices per query (some -1, some past its position; the
    first always 0, so that every output is finite, as the device test demands)."""
    def make(gen, dtype, device):
        inputs = maker(gen, dtype, device)
        q_lens = (inputs[3][1:] - inputs[3][:-1]).tolist()
        rows = torch.cat([torch.randint(-1, kv, (q_len, top_k), generator=gen)
                          for q_len, kv in zip(q_lens, inputs[4].tolist())])
        rows[:, 0] = 0
        return (*inputs, rows.to(device, torch.int32), None)
    return make


def fp8_cache(maker):
    """``maker``'s inputs with the cache in float8_e4m3fn and its scale."""
    def make(gen, dtype, device):
        q_nope, q_pe, cache, *rest = maker(gen, dtype, device)
        scale = cache.float().abs().amax().reshape(1) / torch.finfo(FP8).max
        return (q_nope, q_pe, (cache.float() / scale).to(FP8), *rest, None, scale)
    return make


def _indexer_run(*inputs, implementation=None):
    return torch_kernels.indexer_topk(*inputs, implementation=implementation)


def _write_run(kv_c, k_pe, kv_cache, slots, scale=None, implementation=None):
    kv_cache = kv_cache.clone()
    torch_kernels.mla_reshape_and_cache(kv_c, k_pe, kv_cache, slots, scale, implementation=implementation)
    return kv_cache


def _fp8_write(gen, dtype, device):
    kv_c, k_pe, cache, slots = family_ops.mla_write_inputs(gen, dtype, device)
    return kv_c, k_pe, cache.to(FP8), slots, torch.tensor([0.02], device=device)


_DEEPSEEK = dict(heads=128, latent=512, rope=64, block_size=64)

DEVICE_CASES = [
    DeviceCase("ragged_paged_mla", "ragged_paged_mla", family_ops.mla_inputs, _attention_run, wide=torch.float32),
    DeviceCase("ragged_paged_mla top-k", "ragged_paged_mla",
               with_topk(sized(family_ops.mla_inputs, **interpreter_sizes(heads=2))), _attention_run,
               wide=torch.float32),
    DeviceCase("ragged_paged_mla fp8 cache", "ragged_paged_mla", fp8_cache(family_ops.mla_inputs), _attention_run,
               wide=torch.float32, capability=(8, 9), dtypes=(torch.bfloat16,)),
    DeviceCase("ragged_paged_mla DeepSeek-V3 decode and chunk, 8k context", "ragged_paged_mla",
               sized(family_ops.mla_inputs, q_lens=(1, 1, 64, 1), contexts=(8 * K, 3000, 2000, 0), **_DEEPSEEK),
               _attention_run, wide=torch.float32, **LARGE),
    DeviceCase("ragged_paged_mla DeepSeek-V3.2 top-2048", "ragged_paged_mla",
               with_topk(sized(family_ops.mla_inputs, q_lens=(1, 1, 16), contexts=(8 * K, 3000, 2000),
                               **_DEEPSEEK), top_k=2048), _attention_run, wide=torch.float32, **LARGE),
    DeviceCase("indexer_topk", "indexer_topk", family_ops.indexer_inputs, _indexer_run, wide=torch.float32,
               exact=(0,)),
    DeviceCase("mla_reshape_and_cache", "mla_reshape_and_cache", family_ops.mla_write_inputs, _write_run,
               wide=torch.float32, exact=(0,)),
    DeviceCase("mla_reshape_and_cache fp8 cache", "mla_reshape_and_cache", _fp8_write, _write_run,
               wide=torch.float32, exact=(0,), capability=(8, 9), dtypes=(torch.bfloat16,)),
]

"""paged_attention's bad-input rows (ragged_paged_attention, reshape_and_cache) and device cases.

A rejected call that writes a KV cache must also leave the caches as they were (an
``AssertionError`` then replaces the expected error).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

import torch_kernels
from families import FP8, LARGE, DeviceCase, K, Row, map_arg, set_arg, set_at, sized
from torch_kernels.ops import paged_attention as family_ops


# ---- bad inputs ----

def _both_caches(fn):
    return lambda kw: kw.update(key_cache=fn(kw["key_cache"]), value_cache=fn(kw["value_cache"]))


def _non_contiguous(t):
    return torch.cat([t, t], dim=-1)[..., ::2]


def _one_block_for_all(cache):
    """A cache whose blocks are all one block's memory (stride 0): writes would collide."""
    return cache[:1].expand(cache.shape)


def _paged_batch() -> dict:
    """S = 3 sequences (q_lens 2, 0, 3; kv_lens 5, 7, 20), T = 5, Hq = 4, Hkv = 2, D = 64, pages of
    16 in a cache of 6 blocks (96 slots), block_table [3, 3] with garbage past each sequence's pages."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, hkv, d = 6, 16, 2, 64
    block_table = torch.tensor([[3, -7, 2**31 - 1], [0, 9, -1], [5, 1, 6]], dtype=torch.int32)
    slots = [3 * 16 + 3, 3 * 16 + 4, 1 * 16 + 1, 1 * 16 + 2, 1 * 16 + 3]  # positions 3, 4 and 17, 18, 19
    return dict(
        query=torch.randn(5, 4, d, generator=gen),
        key_cache=torch.randn(num_blocks, block_size, hkv, d, generator=gen),
        value_cache=torch.randn(num_blocks, block_size, hkv, d, generator=gen),
        cu_q_lens=torch.tensor([0, 2, 2, 5], dtype=torch.int32),
        kv_lens=torch.tensor([5, 7, 20], dtype=torch.int32),
        block_table=block_table, sm_scale=0.125, sliding_window=None, soft_cap=None, k_scale=None, v_scale=None,
        key=torch.randn(5, hkv, d, generator=gen), value=torch.randn(5, hkv, d, generator=gen),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )


def _unchanged(before: tuple, after: tuple) -> None:
    for name, b, a in zip(("key_cache", "value_cache"), before, after):
        if a.device.type != "meta" and b.shape == a.shape and b.dtype == a.dtype and not torch.equal(a, b):
            raise AssertionError(f"{name}: a rejected call wrote to the cache")


def _paged(op: str, change) -> Callable[[str], object]:
    """A call of ``op`` (``ragged_paged_attention`` or ``reshape_and_cache``) on the good batch after
    ``change``; a rejected call must leave the caches as they were."""
    def call(backend):
        kw = _paged_batch()
        if op == "reshape_and_cache":
            kw = {n: kw[n] for n in ("key", "value", "key_cache", "value_cache", "slot_mapping")}
            kw.update(k_scale=torch.ones(2), v_scale=None)
        change(kw)
        before = [kw[n].clone() if isinstance(kw[n], torch.Tensor) else None for n in ("key_cache", "value_cache")]
        try:
            return getattr(torch_kernels, op)(**kw, implementation=backend)
        finally:
            if all(isinstance(b, torch.Tensor) for b in before):
                _unchanged(before, (kw["key_cache"], kw["value_cache"]))
    return call


ATTENTION = [  # (case, argument, error, change of the good call's keyword arguments)
    ("q_len above kv_len", "kv_lens", ValueError, set_at("kv_lens", 0, 1)),
    ("negative kv_len", "kv_lens", ValueError, set_at("kv_lens", 1, -1)),
    ("kv_len past block_table", "kv_lens", ValueError, set_at("kv_lens", 2, 49)),
    ("block id past the cache", "block_table", ValueError, set_at("block_table", (2, 1), 6)),
    ("negative block id", "block_table", ValueError, set_at("block_table", (0, 0), -1)),
    ("cu_q_lens decreasing", "cu_q_lens", ValueError, set_arg("cu_q_lens", torch.tensor([0, 3, 2, 5], dtype=torch.int32))),
    ("cu_q_lens not from 0", "cu_q_lens", ValueError, set_arg("cu_q_lens", torch.tensor([1, 2, 2, 5], dtype=torch.int32))),
    ("cu_q_lens not to T", "cu_q_lens", ValueError, set_arg("cu_q_lens", torch.tensor([0, 2, 2, 4], dtype=torch.int32))),
    ("cu_q_lens size", "cu_q_lens", ValueError, map_arg("cu_q_lens", lambda t: t[:-1])),
    ("block_table rows", "block_table", ValueError, map_arg("block_table", lambda t: t[:2])),
    ("block_table 1-D", "block_table", ValueError, map_arg("block_table", lambda t: t[0])),
    ("slot past the cache", "slot_mapping", ValueError, set_at("slot_mapping", 0, 96)),
    ("slot below -1", "slot_mapping", ValueError, set_at("slot_mapping", 4, -2)),
    ("slot twice", "slot_mapping", ValueError, set_at("slot_mapping", 3, 3 * 16 + 4)),
    ("slot_mapping size", "slot_mapping", ValueError, map_arg("slot_mapping", lambda t: t[:4])),
    ("cu_q_lens int64", "cu_q_lens", TypeError, map_arg("cu_q_lens", lambda t: t.long())),
    ("kv_lens int64", "kv_lens", TypeError, map_arg("kv_lens", lambda t: t.long())),
    ("block_table int64", "block_table", TypeError, map_arg("block_table", lambda t: t.long())),
    ("slot_mapping int16", "slot_mapping", TypeError, map_arg("slot_mapping", lambda t: t.short())),
    ("slot_mapping float", "slot_mapping", TypeError, map_arg("slot_mapping", lambda t: t.float())),
    ("query int", "query", TypeError, map_arg("query", lambda t: t.int())),
    ("query float64", "query", TypeError, map_arg("query", lambda t: t.double())),
    ("query 2-D", "query", ValueError, map_arg("query", lambda t: t[:, 0])),
    ("query not a tensor", "query", TypeError, map_arg("query", lambda t: t.numpy())),
    ("heads not a multiple", "query", ValueError, map_arg("query", lambda t: t[:, :3])),
    ("head size", "key_cache", ValueError, map_arg("query", lambda t: t[..., :32])),
    ("caches in another float dtype", "key_cache", TypeError, _both_caches(lambda t: t.half())),
    ("caches float64", "key_cache", TypeError, _both_caches(lambda t: t.double())),
    ("caches uint8", "key_cache", TypeError, _both_caches(lambda t: t.to(torch.uint8))),
    ("value_cache dtype", "value_cache", TypeError, map_arg("value_cache", lambda t: t.to(torch.int8))),
    ("value_cache shape", "value_cache", ValueError, map_arg("value_cache", lambda t: t[:5].contiguous())),
    ("key_cache 3-D", "key_cache", ValueError, map_arg("key_cache", lambda t: t[0])),
    ("key_cache last dimension strided", "key_cache", ValueError, map_arg("key_cache", _non_contiguous)),
    ("value_cache last dimension strided", "value_cache", ValueError, map_arg("value_cache", _non_contiguous)),
    ("key_cache blocks sharing memory", "key_cache", ValueError, map_arg("key_cache", _one_block_for_all)),
    ("no cache blocks", "key_cache", ValueError, _both_caches(lambda t: t[:0])),
    ("key dtype", "key", TypeError, map_arg("key", lambda t: t.half())),
    ("value dtype", "value", TypeError, map_arg("value", lambda t: t.half())),
    ("key shape", "key", ValueError, map_arg("key", lambda t: t[:, :1])),
    ("value shape", "value", ValueError, map_arg("value", lambda t: t[:4])),
    ("key without value", "key, value, slot_mapping", ValueError, set_arg("value", None)),
    ("key without slot_mapping", "key, value, slot_mapping", ValueError, set_arg("slot_mapping", None)),
    ("kv_lens on meta", "kv_lens", ValueError, map_arg("kv_lens", lambda t: t.to("meta"))),
    ("k_scale on meta", "k_scale", ValueError, set_arg("k_scale", torch.ones(2, device="meta"))),
    ("slot_mapping on meta", "slot_mapping", ValueError, map_arg("slot_mapping", lambda t: t.to("meta"))),
    ("sliding_window 0", "sliding_window", ValueError, set_arg("sliding_window", 0)),
    ("sliding_window negative", "sliding_window", ValueError, set_arg("sliding_window", -4)),
    ("sliding_window 2.5", "sliding_window", TypeError, set_arg("sliding_window", 2.5)),
    ("sliding_window True", "sliding_window", TypeError, set_arg("sliding_window", True)),
    ("soft_cap 0", "soft_cap", ValueError, set_arg("soft_cap", 0.0)),
    ("soft_cap negative", "soft_cap", ValueError, set_arg("soft_cap", -30.0)),
    ("soft_cap inf", "soft_cap", ValueError, set_arg("soft_cap", math.inf)),
    ("soft_cap nan", "soft_cap", ValueError, set_arg("soft_cap", math.nan)),
    ("soft_cap past float32", "soft_cap", ValueError, set_arg("soft_cap", 1e39)),
    ("soft_cap True", "soft_cap", TypeError, set_arg("soft_cap", True)),
    ("sm_scale inf", "sm_scale", ValueError, set_arg("sm_scale", math.inf)),
    ("sm_scale nan", "sm_scale", ValueError, set_arg("sm_scale", math.nan)),
    ("sm_scale 0", "sm_scale", ValueError, set_arg("sm_scale", 0.0)),
    ("sm_scale negative", "sm_scale", ValueError, set_arg("sm_scale", -0.125)),
    ("sm_scale past float32", "sm_scale", ValueError, set_arg("sm_scale", 1e39)),
    ("sm_scale a string", "sm_scale", TypeError, set_arg("sm_scale", "0.25")),
    ("sm_scale None", "sm_scale", TypeError, set_arg("sm_scale", None)),
    ("sm_scale a tensor", "sm_scale", TypeError, set_arg("sm_scale", torch.tensor(0.125))),
    ("k_scale per wrong heads", "k_scale", ValueError, set_arg("k_scale", torch.ones(3))),
    ("k_scale 2-D", "k_scale", ValueError, set_arg("k_scale", torch.ones(1, 1))),
    ("k_scale [Hkv, 1]", "k_scale", ValueError, set_arg("k_scale", torch.ones(2, 1))),
    ("v_scale per wrong heads", "v_scale", ValueError, set_arg("v_scale", torch.ones(4))),
    ("k_scale float64", "k_scale", TypeError, set_arg("k_scale", torch.ones(2, dtype=torch.float64))),
    ("v_scale float16", "v_scale", TypeError, set_arg("v_scale", torch.ones((), dtype=torch.float16))),
    ("k_scale 0", "k_scale", ValueError, set_arg("k_scale", torch.tensor([1.0, 0.0]))),
    ("k_scale negative", "k_scale", ValueError, set_arg("k_scale", torch.tensor(-0.5))),
    ("v_scale nan", "v_scale", ValueError, set_arg("v_scale", torch.tensor([math.nan, 1.0]))),
    ("v_scale inf", "v_scale", ValueError, set_arg("v_scale", torch.tensor([math.inf]))),
    ("out dtype", "out", TypeError, set_arg("out", torch.empty(5, 4, 64, dtype=torch.float16))),
    ("out shape", "out", ValueError, set_arg("out", torch.empty(5, 4, 32))),
    ("out not a tensor", "out", TypeError, set_arg("out", [0.0] * 5)),
    ("out on meta", "out", ValueError, set_arg("out", torch.empty(5, 4, 64, device="meta"))),
    ("out entries sharing memory", "out", ValueError, set_arg("out", torch.empty(1, 1, 64).expand(5, 4, 64))),
    ("out is the query", "out", ValueError, lambda kw: kw.update(out=kw["query"])),
    ("out inside the key cache", "out", ValueError,
     lambda kw: kw.update(out=kw["key_cache"].reshape(-1)[64:64 + 5 * 4 * 64].view(5, 4, 64))),
]

WRITE = [
    ("key 2-D", "key", ValueError, map_arg("key", lambda t: t[0])),
    ("key int", "key", TypeError, map_arg("key", lambda t: t.int())),
    ("key not a tensor", "key", TypeError, map_arg("key", lambda t: t.tolist())),
    ("value dtype", "value", TypeError, map_arg("value", lambda t: t.bfloat16())),
    ("value shape", "value", ValueError, map_arg("value", lambda t: t[:, :, :32])),
    ("key heads", "key", ValueError, map_arg("key", lambda t: torch.cat([t, t], 1))),
    ("cache dtype", "key_cache", TypeError, _both_caches(lambda t: t.half())),
    ("value_cache dtype", "value_cache", TypeError, map_arg("value_cache", lambda t: t.to(torch.float8_e4m3fn))),
    ("value_cache last dimension strided", "value_cache", ValueError, map_arg("value_cache", _non_contiguous)),
    ("value_cache blocks sharing memory", "value_cache", ValueError, map_arg("value_cache", _one_block_for_all)),
    ("slot_mapping int16", "slot_mapping", TypeError, map_arg("slot_mapping", lambda t: t.short())),
    ("slot_mapping size", "slot_mapping", ValueError, map_arg("slot_mapping", lambda t: t[1:])),
    ("slot past the cache", "slot_mapping", ValueError, set_at("slot_mapping", 2, 1 << 40)),
    ("slot twice", "slot_mapping", ValueError, set_at("slot_mapping", 0, 1 * 16 + 3)),
    ("k_scale shape", "k_scale", ValueError, set_arg("k_scale", torch.ones(5))),
    ("v_scale dtype", "v_scale", TypeError, set_arg("v_scale", torch.ones(2, dtype=torch.bfloat16))),
    ("k_scale 0", "k_scale", ValueError, set_arg("k_scale", torch.zeros(2))),
    ("v_scale nan", "v_scale", ValueError, set_arg("v_scale", torch.tensor(math.nan))),
    ("v_scale negative inf", "v_scale", ValueError, set_arg("v_scale", torch.tensor([1.0, -math.inf]))),
    ("slot_mapping on meta", "slot_mapping", ValueError, map_arg("slot_mapping", lambda t: t.to("meta"))),
    ("key_cache on meta", "key_cache", ValueError, _both_caches(lambda t: t.to("meta"))),
]


BAD_INPUTS = {"paged_attention": [Row(f"{op}: {c}", a, e, _paged(op, ch), op)
                                  for op, rows in (("ragged_paged_attention", ATTENTION), ("reshape_and_cache", WRITE))
                                  for c, a, e, ch in rows]}


# ---- device cases ----

def paged_attention_run(*inputs, implementation=None):
    *tensors, k_scale, v_scale = inputs if len(inputs) == 9 else (*inputs, None, None)
    return torch_kernels.ragged_paged_attention(*tensors, k_scale=k_scale, v_scale=v_scale,
                                                implementation=implementation)


def fp8_caches(maker):
    """``maker``'s paged-attention inputs with the caches in float8_e4m3fn and per-head scales."""
    def make(gen, dtype, device):
        query, key_cache, value_cache, *rest = maker(gen, dtype, device)
        quantized, scales = [], []
        for cache in (key_cache, value_cache):
            scale = cache.float().abs().amax(dim=(0, 1, 3)) / torch.finfo(FP8).max
            quantized.append((cache.float() / scale[:, None]).to(FP8))
            scales.append(scale)
        return (query, *quantized, *rest, *scales)
    return make


def reshape_and_cache_run(key, value, key_cache, value_cache, slots, *scales, implementation=None):
    key_cache, value_cache = key_cache.clone(), value_cache.clone()
    torch_kernels.reshape_and_cache(key, value, key_cache, value_cache, slots, *scales, implementation=implementation)
    return key_cache, value_cache


def fp8_write(gen, dtype, device):
    key, value, key_cache, value_cache, slots = family_ops.reshape_and_cache_inputs(gen, dtype, device)
    scale = torch.tensor([0.01, 0.02], device=device)
    return key, value, key_cache.to(FP8), value_cache.to(FP8), slots, scale, scale * 2


DEVICE_CASES = [
    DeviceCase("ragged_paged_attention", "ragged_paged_attention", family_ops.paged_attention_inputs,
               paged_attention_run, wide=torch.float32),
    DeviceCase("ragged_paged_attention 32k context, D 128", "ragged_paged_attention",
               sized(family_ops.paged_attention_inputs, q_lens=(1, 1, 64, 1), contexts=(32 * K, 5000, 2000, 0),
                     heads=(32, 8), head_size=128),
               paged_attention_run, wide=torch.float32, **LARGE),
    DeviceCase("ragged_paged_attention fp8 caches", "ragged_paged_attention",
               fp8_caches(family_ops.paged_attention_inputs), paged_attention_run, wide=torch.float32,
               capability=(8, 9), dtypes=(torch.bfloat16, torch.float16)),
    DeviceCase("reshape_and_cache", "reshape_and_cache", family_ops.reshape_and_cache_inputs, reshape_and_cache_run,
               wide=torch.float32, exact=(0, 1)),
    DeviceCase("reshape_and_cache fp8 caches", "reshape_and_cache", fp8_write, reshape_and_cache_run,
               wide=torch.float32, exact=(0, 1), capability=(8, 9), dtypes=(torch.bfloat16,)),
]

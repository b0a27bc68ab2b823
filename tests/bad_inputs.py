"""The bad-input tables: for every op family, calls a user might get wrong, each with the
exception it must raise and the argument its message must start with.

``tests/test_bad_inputs.py`` runs each family's table on every backend (``run(family, backend)``,
in a process of its own so that a crash or a hang fails the test instead of ending the run) and
pins every message in full. A row is ``Row(case, argument, error, call)``; ``call(backend)``
makes the bad call with ``implementation=backend``. Calls that write a KV cache also check that
a rejected call wrote nothing (an ``AssertionError`` then replaces the expected error).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from typing import Callable

import torch

import torch_kernels
from harness import tiny_llama


@dataclasses.dataclass(frozen=True)
class Row:
    case: str
    argument: str  # the message starts with "<argument>:"
    error: type
    call: Callable[[str], object]


def _set(name, value):
    return lambda kw: kw.__setitem__(name, value)


def _map(name, fn):
    return lambda kw: kw.__setitem__(name, fn(kw[name]))


def _index(name, index, value):
    def change(kw):
        kw[name] = kw[name].clone()
        kw[name][index] = value
    return change


def _both_caches(fn):
    return lambda kw: kw.update(key_cache=fn(kw["key_cache"]), value_cache=fn(kw["value_cache"]))


def _non_contiguous(t):
    return torch.cat([t, t], dim=-1)[..., ::2]


def _one_block_for_all(cache):
    """A cache whose blocks are all one block's memory (stride 0): writes would collide."""
    return cache[:1].expand(cache.shape)


# ---- paged attention ----

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
    ("q_len above kv_len", "kv_lens", ValueError, _index("kv_lens", 0, 1)),
    ("negative kv_len", "kv_lens", ValueError, _index("kv_lens", 1, -1)),
    ("kv_len past block_table", "kv_lens", ValueError, _index("kv_lens", 2, 49)),
    ("block id past the cache", "block_table", ValueError, _index("block_table", (2, 1), 6)),
    ("negative block id", "block_table", ValueError, _index("block_table", (0, 0), -1)),
    ("cu_q_lens decreasing", "cu_q_lens", ValueError, _set("cu_q_lens", torch.tensor([0, 3, 2, 5], dtype=torch.int32))),
    ("cu_q_lens not from 0", "cu_q_lens", ValueError, _set("cu_q_lens", torch.tensor([1, 2, 2, 5], dtype=torch.int32))),
    ("cu_q_lens not to T", "cu_q_lens", ValueError, _set("cu_q_lens", torch.tensor([0, 2, 2, 4], dtype=torch.int32))),
    ("cu_q_lens size", "cu_q_lens", ValueError, _map("cu_q_lens", lambda t: t[:-1])),
    ("block_table rows", "block_table", ValueError, _map("block_table", lambda t: t[:2])),
    ("block_table 1-D", "block_table", ValueError, _map("block_table", lambda t: t[0])),
    ("slot past the cache", "slot_mapping", ValueError, _index("slot_mapping", 0, 96)),
    ("slot below -1", "slot_mapping", ValueError, _index("slot_mapping", 4, -2)),
    ("slot twice", "slot_mapping", ValueError, _index("slot_mapping", 3, 3 * 16 + 4)),
    ("slot_mapping size", "slot_mapping", ValueError, _map("slot_mapping", lambda t: t[:4])),
    ("cu_q_lens int64", "cu_q_lens", TypeError, _map("cu_q_lens", lambda t: t.long())),
    ("kv_lens int64", "kv_lens", TypeError, _map("kv_lens", lambda t: t.long())),
    ("block_table int64", "block_table", TypeError, _map("block_table", lambda t: t.long())),
    ("slot_mapping int16", "slot_mapping", TypeError, _map("slot_mapping", lambda t: t.short())),
    ("slot_mapping float", "slot_mapping", TypeError, _map("slot_mapping", lambda t: t.float())),
    ("query int", "query", TypeError, _map("query", lambda t: t.int())),
    ("query float64", "query", TypeError, _map("query", lambda t: t.double())),
    ("query 2-D", "query", ValueError, _map("query", lambda t: t[:, 0])),
    ("query not a tensor", "query", TypeError, _map("query", lambda t: t.numpy())),
    ("heads not a multiple", "query", ValueError, _map("query", lambda t: t[:, :3])),
    ("head size", "key_cache", ValueError, _map("query", lambda t: t[..., :32])),
    ("caches in another float dtype", "key_cache", TypeError, _both_caches(lambda t: t.half())),
    ("caches float64", "key_cache", TypeError, _both_caches(lambda t: t.double())),
    ("caches uint8", "key_cache", TypeError, _both_caches(lambda t: t.to(torch.uint8))),
    ("value_cache dtype", "value_cache", TypeError, _map("value_cache", lambda t: t.to(torch.int8))),
    ("value_cache shape", "value_cache", ValueError, _map("value_cache", lambda t: t[:5].contiguous())),
    ("key_cache 3-D", "key_cache", ValueError, _map("key_cache", lambda t: t[0])),
    ("key_cache last dimension strided", "key_cache", ValueError, _map("key_cache", _non_contiguous)),
    ("value_cache last dimension strided", "value_cache", ValueError, _map("value_cache", _non_contiguous)),
    ("key_cache blocks sharing memory", "key_cache", ValueError, _map("key_cache", _one_block_for_all)),
    ("no cache blocks", "key_cache", ValueError, _both_caches(lambda t: t[:0])),
    ("key dtype", "key", TypeError, _map("key", lambda t: t.half())),
    ("value dtype", "value", TypeError, _map("value", lambda t: t.half())),
    ("key shape", "key", ValueError, _map("key", lambda t: t[:, :1])),
    ("value shape", "value", ValueError, _map("value", lambda t: t[:4])),
    ("key without value", "key, value, slot_mapping", ValueError, _set("value", None)),
    ("key without slot_mapping", "key, value, slot_mapping", ValueError, _set("slot_mapping", None)),
    ("kv_lens on meta", "kv_lens", ValueError, _map("kv_lens", lambda t: t.to("meta"))),
    ("k_scale on meta", "k_scale", ValueError, _set("k_scale", torch.ones(2, device="meta"))),
    ("slot_mapping on meta", "slot_mapping", ValueError, _map("slot_mapping", lambda t: t.to("meta"))),
    ("sliding_window 0", "sliding_window", ValueError, _set("sliding_window", 0)),
    ("sliding_window negative", "sliding_window", ValueError, _set("sliding_window", -4)),
    ("sliding_window 2.5", "sliding_window", TypeError, _set("sliding_window", 2.5)),
    ("sliding_window True", "sliding_window", TypeError, _set("sliding_window", True)),
    ("soft_cap 0", "soft_cap", ValueError, _set("soft_cap", 0.0)),
    ("soft_cap negative", "soft_cap", ValueError, _set("soft_cap", -30.0)),
    ("soft_cap inf", "soft_cap", ValueError, _set("soft_cap", math.inf)),
    ("soft_cap nan", "soft_cap", ValueError, _set("soft_cap", math.nan)),
    ("soft_cap past float32", "soft_cap", ValueError, _set("soft_cap", 1e39)),
    ("soft_cap True", "soft_cap", TypeError, _set("soft_cap", True)),
    ("sm_scale inf", "sm_scale", ValueError, _set("sm_scale", math.inf)),
    ("sm_scale nan", "sm_scale", ValueError, _set("sm_scale", math.nan)),
    ("sm_scale 0", "sm_scale", ValueError, _set("sm_scale", 0.0)),
    ("sm_scale negative", "sm_scale", ValueError, _set("sm_scale", -0.125)),
    ("sm_scale past float32", "sm_scale", ValueError, _set("sm_scale", 1e39)),
    ("sm_scale a string", "sm_scale", TypeError, _set("sm_scale", "0.25")),
    ("sm_scale None", "sm_scale", TypeError, _set("sm_scale", None)),
    ("sm_scale a tensor", "sm_scale", TypeError, _set("sm_scale", torch.tensor(0.125))),
    ("k_scale per wrong heads", "k_scale", ValueError, _set("k_scale", torch.ones(3))),
    ("k_scale 2-D", "k_scale", ValueError, _set("k_scale", torch.ones(1, 1))),
    ("k_scale [Hkv, 1]", "k_scale", ValueError, _set("k_scale", torch.ones(2, 1))),
    ("v_scale per wrong heads", "v_scale", ValueError, _set("v_scale", torch.ones(4))),
    ("k_scale float64", "k_scale", TypeError, _set("k_scale", torch.ones(2, dtype=torch.float64))),
    ("v_scale float16", "v_scale", TypeError, _set("v_scale", torch.ones((), dtype=torch.float16))),
    ("k_scale 0", "k_scale", ValueError, _set("k_scale", torch.tensor([1.0, 0.0]))),
    ("k_scale negative", "k_scale", ValueError, _set("k_scale", torch.tensor(-0.5))),
    ("v_scale nan", "v_scale", ValueError, _set("v_scale", torch.tensor([math.nan, 1.0]))),
    ("v_scale inf", "v_scale", ValueError, _set("v_scale", torch.tensor([math.inf]))),
]

WRITE = [
    ("key 2-D", "key", ValueError, _map("key", lambda t: t[0])),
    ("key int", "key", TypeError, _map("key", lambda t: t.int())),
    ("key not a tensor", "key", TypeError, _map("key", lambda t: t.tolist())),
    ("value dtype", "value", TypeError, _map("value", lambda t: t.bfloat16())),
    ("value shape", "value", ValueError, _map("value", lambda t: t[:, :, :32])),
    ("key heads", "key", ValueError, _map("key", lambda t: torch.cat([t, t], 1))),
    ("cache dtype", "key_cache", TypeError, _both_caches(lambda t: t.half())),
    ("value_cache dtype", "value_cache", TypeError, _map("value_cache", lambda t: t.to(torch.float8_e4m3fn))),
    ("value_cache last dimension strided", "value_cache", ValueError, _map("value_cache", _non_contiguous)),
    ("value_cache blocks sharing memory", "value_cache", ValueError, _map("value_cache", _one_block_for_all)),
    ("slot_mapping int16", "slot_mapping", TypeError, _map("slot_mapping", lambda t: t.short())),
    ("slot_mapping size", "slot_mapping", ValueError, _map("slot_mapping", lambda t: t[1:])),
    ("slot past the cache", "slot_mapping", ValueError, _index("slot_mapping", 2, 1 << 40)),
    ("slot twice", "slot_mapping", ValueError, _index("slot_mapping", 0, 1 * 16 + 3)),
    ("k_scale shape", "k_scale", ValueError, _set("k_scale", torch.ones(5))),
    ("v_scale dtype", "v_scale", TypeError, _set("v_scale", torch.ones(2, dtype=torch.bfloat16))),
    ("k_scale 0", "k_scale", ValueError, _set("k_scale", torch.zeros(2))),
    ("v_scale nan", "v_scale", ValueError, _set("v_scale", torch.tensor(math.nan))),
    ("v_scale negative inf", "v_scale", ValueError, _set("v_scale", torch.tensor([1.0, -math.inf]))),
    ("slot_mapping on meta", "slot_mapping", ValueError, _map("slot_mapping", lambda t: t.to("meta"))),
    ("key_cache on meta", "key_cache", ValueError, _both_caches(lambda t: t.to("meta"))),
]


# ---- linear attention ----

LINEAR_OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_simple_gla")
DELTA_OPS = LINEAR_OPS[:2]


def _linear_inputs(op: str) -> dict:
    """B = 1, T = 6, H = 2 (value heads 4 for the delta rule), K = V = 8."""
    gen = torch.Generator().manual_seed(0)
    value_heads = 4 if op in DELTA_OPS else 2
    x = dict(q=torch.randn(1, 6, 2, 8, generator=gen), k=torch.randn(1, 6, 2, 8, generator=gen),
             v=torch.randn(1, 6, value_heads, 8, generator=gen), g=-torch.rand(1, 6, value_heads, generator=gen),
             initial_state=torch.randn(1, value_heads, 8, 8, generator=gen))
    if op in DELTA_OPS:
        x["beta"] = torch.rand(1, 6, value_heads, generator=gen)
    return x


def _linear(op, change) -> Callable[[str], object]:
    def call(backend):
        x = _linear_inputs(op)
        change(x)
        return getattr(torch_kernels, op)(**x, output_final_state=True, implementation=backend)
    return call


def _stack_batch(x):
    x.update({n: torch.cat([x[n]] * 2) for n in ("q", "k", "v", "g", "beta") if n in x},
             cu_seqlens=torch.tensor([0, 6], dtype=torch.int32))


LINEAR = [  # (case, ops, argument, error, change)
    ("k shape", LINEAR_OPS, "k", ValueError, _map("k", lambda t: t[..., :4])),
    ("v time", LINEAR_OPS, "v", ValueError, _map("v", lambda t: t[:, :5])),
    ("v heads not a multiple", DELTA_OPS, "v", ValueError, _map("v", lambda t: t[:, :, :3])),
    ("gla v heads", LINEAR_OPS[2:], "v", ValueError, _map("v", lambda t: torch.cat([t, t], 2))),
    ("v dtype", LINEAR_OPS, "v", TypeError, _map("v", lambda t: t.half())),
    ("q int", LINEAR_OPS, "q", TypeError, _map("q", lambda t: t.int())),
    ("q 3-D", LINEAR_OPS, "q", ValueError, _map("q", lambda t: t[0])),
    ("q not a tensor", LINEAR_OPS, "q", TypeError, _map("q", lambda t: t.tolist())),
    ("K = 0", LINEAR_OPS, "q", ValueError, lambda x: x.update(q=x["q"][..., :0], k=x["k"][..., :0],
                                                               initial_state=x["initial_state"][:, :, :0])),
    ("V = 0", LINEAR_OPS, "q, v", ValueError, lambda x: x.update(v=x["v"][..., :0],
                                                                  initial_state=x["initial_state"][..., :0])),
    ("g shape", LINEAR_OPS, "g", ValueError, _map("g", lambda t: t[:, :, :1])),
    ("g int", LINEAR_OPS, "g", TypeError, _map("g", lambda t: t.int())),
    ("g positive", LINEAR_OPS, "g", ValueError, _index("g", (0, 3, 1), 0.5)),
    ("beta missing", DELTA_OPS, "beta", TypeError, _set("beta", None)),
    ("g missing", DELTA_OPS, "g", TypeError, _set("g", None)),
    ("initial_state shape", LINEAR_OPS, "initial_state", ValueError, _map("initial_state", lambda t: t[..., :4])),
    ("initial_state int", LINEAR_OPS, "initial_state", TypeError, _map("initial_state", lambda t: t.int())),
    ("cu_seqlens with batch 2", LINEAR_OPS, "cu_seqlens", ValueError, _stack_batch),
    ("cu_seqlens not to T", LINEAR_OPS, "cu_seqlens", ValueError,
     _set("cu_seqlens", torch.tensor([0, 5], dtype=torch.int32))),
    ("cu_seqlens not from 0", LINEAR_OPS, "cu_seqlens", ValueError,
     _set("cu_seqlens", torch.tensor([1, 6], dtype=torch.int32))),
    ("cu_seqlens decreasing", LINEAR_OPS, "cu_seqlens", ValueError,
     lambda x: x.update(cu_seqlens=torch.tensor([0, 4, 2, 6], dtype=torch.int32), initial_state=None)),
    ("cu_seqlens float", LINEAR_OPS, "cu_seqlens", TypeError, _set("cu_seqlens", torch.tensor([0.0, 6.0]))),
    ("cu_seqlens one offset", LINEAR_OPS, "cu_seqlens", ValueError, _set("cu_seqlens", torch.tensor([0]))),
    ("scale nan", LINEAR_OPS, "scale", ValueError, _set("scale", math.nan)),
    ("scale a string", LINEAR_OPS, "scale", TypeError, _set("scale", "0.5")),
    ("scale True", LINEAR_OPS, "scale", TypeError, _set("scale", True)),
    ("k on meta", LINEAR_OPS, "k", ValueError, _map("k", lambda t: t.to("meta"))),
]


# ---- ood ----

def _ood_inputs():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(3, 4, generator=gen), torch.randn(2, 4, generator=gen), torch.eye(4) + 0.1


def _score(change) -> Callable[[str], object]:
    def call(backend):
        return torch_kernels.mahalanobis_score(*change(*_ood_inputs()), implementation=backend)
    return call


def _features(n=50, d=4, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def _scorer(method: str, *args, fit=True, **kwargs) -> Callable[[str], object]:
    """Call ``MahalanobisScorer()`` method ``method`` (``__init__`` for the constructor); its scores
    use ``backend``."""
    from torch_kernels.ood import MahalanobisScorer

    def call(backend):
        if method == "__init__":
            return MahalanobisScorer(*args, **kwargs)
        scorer = MahalanobisScorer()
        if fit:
            scorer.fit(_features())
        if method == "threshold":
            with torch_kernels.use_backend(backend):
                return scorer.threshold(*args, **kwargs)
        return getattr(scorer, method)(*args, **kwargs)
    return call


def _nan_row(x):
    x = x.clone()
    x[3, 1] = math.nan
    return x


OOD = [
    ("x 1-D", "x", ValueError, _score(lambda x, m, w: (x[0], m, w))),
    ("means 1-D", "means", ValueError, _score(lambda x, m, w: (x, m[0], w))),
    ("means features", "means", ValueError, _score(lambda x, m, w: (x, m[:, :3], w))),
    ("whitener rows", "whitener", ValueError, _score(lambda x, m, w: (x, m, w[:3]))),
    ("whitener columns", "whitener", ValueError, _score(lambda x, m, w: (x, m, w[:, :3]))),
    ("x int", "x", TypeError, _score(lambda x, m, w: (x.int(), m, w))),
    ("means float64 for float16 x", "means", TypeError, _score(lambda x, m, w: (x.half(), m.double(), w))),
    ("whitener float16 for float32 x", "whitener", TypeError, _score(lambda x, m, w: (x, m, w.half()))),
    ("means on meta", "means", ValueError, _score(lambda x, m, w: (x, m.to("meta"), w))),
    ("x not a tensor", "x", TypeError, _score(lambda x, m, w: (x.numpy(), m, w))),
    ("no classes", "means", ValueError, _score(lambda x, m, w: (x, m[:0], w))),
    ("no features", "x", ValueError, _score(lambda x, m, w: (x[:, :0], m[:, :0], w[:0, :0]))),
    ("covariance unknown", "covariance", ValueError, _scorer("__init__", covariance="shrunk")),
    ("ridge negative", "ridge", ValueError, _scorer("__init__", ridge=-1.0)),
    ("ridge nan", "ridge", ValueError, _scorer("__init__", ridge=math.nan)),
    ("fit singular", "features", ValueError, _scorer("fit", torch.randn(3, 8), fit=False)),
    ("fit NaN", "features", ValueError, _scorer("fit", _nan_row(_features()), fit=False)),
    ("fit inf in batch 1", "features", ValueError,
     _scorer("fit", [_features(), torch.full((2, 4), math.inf)], fit=False)),
    ("fit int features", "features", TypeError, _scorer("fit", torch.ones(5, 2, dtype=torch.int64), fit=False)),
    ("fit 1-D features", "features", ValueError, _scorer("fit", torch.ones(5), fit=False)),
    ("fit nothing", "features", ValueError, _scorer("fit", [_features()[:0]], fit=False)),
    ("fit batches of other widths", "features", ValueError, _scorer("fit", [_features(), _features(d=3)], fit=False)),
    ("labels none", "labels", ValueError, _scorer("fit", [_features()[:0]], [torch.zeros(0, dtype=torch.int64)],
                                                  fit=False)),
    ("labels count", "labels", ValueError, _scorer("fit", _features(), torch.zeros(49, dtype=torch.int64), fit=False)),
    ("labels missing class", "labels", ValueError,
     _scorer("fit", _features(), torch.where(torch.arange(50) < 25, 0, 2), fit=False)),
    ("labels id 2**40", "labels", ValueError,
     _scorer("fit", _features(), torch.where(torch.arange(50) < 25, 0, 2**40), fit=False)),
    ("labels negative", "labels", ValueError, _scorer("fit", _features(), -torch.ones(50, dtype=torch.int64), fit=False)),
    ("labels float", "labels", TypeError, _scorer("fit", _features(), torch.zeros(50), fit=False)),
    ("labels with a one-shot iterator", "features", ValueError,
     lambda backend: __import__("torch_kernels.ood", fromlist=["MahalanobisScorer"]).MahalanobisScorer("oas").fit(
         iter([_features()]), [torch.zeros(50, dtype=torch.int64)])),
    ("threshold tpr 1.5", "tpr", ValueError, _scorer("threshold", _features(), tpr=1.5)),
    ("threshold tpr 0", "tpr", ValueError, _scorer("threshold", _features(), tpr=0.0)),
    ("threshold tpr True", "tpr", TypeError, _scorer("threshold", _features(), tpr=True)),
    ("threshold tpr a string", "tpr", TypeError, _scorer("threshold", _features(), tpr="0.95")),
    ("threshold NaN features", "features", ValueError, _scorer("threshold", _nan_row(_features()))),
    ("threshold no rows", "features", ValueError, _scorer("threshold", _features()[:0])),
    ("score before fit", "MahalanobisScorer", RuntimeError, _scorer("score", _features(), fit=False)),
]


# ---- edm (the EDM scorer, its op and evaluate) ----

def _edm_inputs() -> dict:
    """A good edm_score call: B = 3, D = 4, H = 5, K = 1, L = 2."""
    gen = torch.Generator().manual_seed(0)
    b, d, h, k, levels = 3, 4, 5, 1, 2
    shapes = {"mean": (d,), "inv_scale": (d,), "noise": (levels, d), "level_weights": (levels,),
              "level_bias": (levels, h), "w_in": (d, h), "w1": (k, h, h), "b1": (k, h), "w2": (k, h, h),
              "b2": (k, h), "w_out": (h, d), "b_out": (d,)}
    kw = {name: torch.randn(*shape, generator=gen) for name, shape in shapes.items()}
    return dict(x=torch.randn(b, d, generator=gen), **kw, sigmas=[0.5, 1.5], sigma_data=1.0)


def _edm_score(change) -> Callable[[str], object]:
    def call(backend):
        kw = _edm_inputs()
        change(kw)
        return torch_kernels.edm_score(**kw, implementation=backend)
    return call


def _edm_scorer(method: str, *args, fit=True, **kwargs) -> Callable[[str], object]:
    """Call ``EDMScorer()`` method ``method`` (``__init__`` for the constructor; a fit of two steps
    first unless ``fit=False``), scoring on ``backend``."""
    from torch_kernels.ood import EDMScorer

    def call(backend):
        if method == "__init__":
            return EDMScorer(*args, **kwargs)
        scorer = EDMScorer(width=8, depth=1, levels=2)
        if fit:
            scorer.fit(_features(), steps=2, progress=False)
        with torch_kernels.use_backend(backend):
            return getattr(scorer, method)(*args, **kwargs)
    return call


def _evaluate(id_scores, ood_scores) -> Callable[[str], object]:
    def call(backend):
        from torch_kernels.ood import ood_metrics
        return ood_metrics(id_scores, ood_scores)
    return call


EDM = [
    ("x 1-D", "x", ValueError, _edm_score(_map("x", lambda t: t[0]))),
    ("x int", "x", TypeError, _edm_score(_map("x", lambda t: t.int()))),
    ("x not a tensor", "x", TypeError, _edm_score(_map("x", lambda t: t.numpy()))),
    ("no features", "x", ValueError, _edm_score(_map("x", lambda t: t[:, :0]))),
    ("mean features", "mean", ValueError, _edm_score(_map("mean", lambda t: t[:3]))),
    ("noise levels", "noise", ValueError, _edm_score(_map("noise", lambda t: t[:1]))),
    ("level_bias width", "level_bias", ValueError, _edm_score(_map("level_bias", lambda t: t[:, :4]))),
    ("w1 not square", "w1", ValueError, _edm_score(_map("w1", lambda t: t[:, :, :4]))),
    ("b2 blocks", "b2", ValueError, _edm_score(_map("b2", lambda t: torch.cat([t, t])))),
    ("w_out 1-D", "w_out", ValueError, _edm_score(_map("w_out", lambda t: t[0]))),
    ("w_in float64 for float32 x", "w_in", TypeError, _edm_score(_map("w_in", lambda t: t.double()))),
    ("w_in no hidden width", "w_in", ValueError, _edm_score(_map("w_in", lambda t: t[:, :0]))),
    ("w2 on meta", "w2", ValueError, _edm_score(_map("w2", lambda t: t.to("meta")))),
    ("sigmas empty", "sigmas", ValueError, _edm_score(_set("sigmas", []))),
    ("sigma 0", "sigmas", ValueError, _edm_score(_set("sigmas", [0.0, 1.0]))),
    ("sigma nan", "sigmas", ValueError, _edm_score(_set("sigmas", [0.5, math.nan]))),
    ("sigmas a string", "sigmas", TypeError, _edm_score(_set("sigmas", "0.5"))),
    ("sigma_data negative", "sigma_data", ValueError, _edm_score(_set("sigma_data", -1.0))),
    ("statistic unknown", "statistic", ValueError, _edm_score(_set("statistic", "likelihood"))),
    ("width 0", "width", ValueError, _edm_scorer("__init__", width=0)),
    ("depth negative", "depth", ValueError, _edm_scorer("__init__", depth=-1)),
    ("levels 2.5", "levels", TypeError, _edm_scorer("__init__", levels=2.5)),
    ("sigma_min 0", "sigma_min", ValueError, _edm_scorer("__init__", sigma_min=0.0)),
    ("sigma_max below sigma_min", "sigma_max", ValueError, _edm_scorer("__init__", sigma_min=1.0, sigma_max=0.5)),
    ("scorer statistic unknown", "statistic", ValueError, _edm_scorer("__init__", statistic="likelihood")),
    ("ridge negative", "ridge", ValueError, _edm_scorer("__init__", ridge=-1.0)),
    ("fit NaN", "features", ValueError, _edm_scorer("fit", _nan_row(_features()), fit=False)),
    ("fit one row", "features", ValueError, _edm_scorer("fit", _features()[:1], fit=False)),
    ("fit int features", "features", TypeError, _edm_scorer("fit", torch.ones(5, 2, dtype=torch.int64), fit=False)),
    ("fit batches of other widths", "features", ValueError,
     _edm_scorer("fit", [_features(), _features(d=3)], fit=False)),
    ("fit constant features", "features", ValueError, _edm_scorer("fit", torch.ones(10, 3), fit=False)),
    ("fit a constant feature", "features", ValueError,
     _edm_scorer("fit", torch.cat([_features(), torch.ones(50, 1)], dim=1), fit=False)),
    ("fit steps 0", "steps", ValueError, _edm_scorer("fit", _features(), steps=0, fit=False)),
    ("fit steps and epochs", "steps", ValueError, _edm_scorer("fit", _features(), steps=5, epochs=1, fit=False)),
    ("fit batch_size 0", "batch_size", ValueError, _edm_scorer("fit", _features(), batch_size=0, fit=False)),
    ("fit lr negative", "lr", ValueError, _edm_scorer("fit", _features(), lr=-1e-3, fit=False)),
    ("fit ema 1", "ema", ValueError, _edm_scorer("fit", _features(), ema=1.0, fit=False)),
    ("score before fit", "EDMScorer", RuntimeError, _edm_scorer("score", _features(), fit=False)),
    ("score statistic unknown", "statistic", ValueError, _edm_scorer("score", _features(), "likelihood")),
    ("threshold tpr 0", "tpr", ValueError, _edm_scorer("threshold", _features(), tpr=0.0)),
    ("evaluate no OOD scores", "ood_scores", ValueError, _evaluate(torch.randn(5), torch.randn(0))),
    ("evaluate NaN score", "id_scores", ValueError, _evaluate(torch.tensor([0.0, math.nan]), torch.randn(3))),
    ("evaluate a scorer without score", "scorer", TypeError,
     lambda backend: __import__("torch_kernels.ood", fromlist=["evaluate"]).evaluate(object(), torch.randn(2, 3),
                                                                                      torch.randn(2, 3))),
]


# ---- serving ----

def _engine(*, generate=None, **kwargs) -> Callable[[str], object]:
    """``Engine(tiny llama, **kwargs)``, then ``generate(*generate)`` if given."""
    def call(backend):
        from torch_kernels.serving import Engine
        engine = Engine(tiny_llama(), **{"num_blocks": 8, "block_size": 4, **kwargs}, implementation=backend)
        if generate is not None:
            return engine.generate(*generate)
    return call


SERVING = [
    ("block_size 0", "block_size", ValueError, _engine(block_size=0)),
    ("block_size negative", "block_size", ValueError, _engine(block_size=-16)),
    ("block_size 2.5", "block_size", TypeError, _engine(block_size=2.5)),
    ("num_blocks 0", "num_blocks", ValueError, _engine(num_blocks=0)),
    ("max_seqs True", "max_seqs", TypeError, _engine(max_seqs=True)),
    ("max_batched_tokens 0", "max_batched_tokens", ValueError, _engine(max_batched_tokens=0)),
    ("max_new_tokens 2.5", "max_new_tokens", TypeError, _engine(generate=([[1, 2]], 2.5))),
    ("max_new_tokens 0", "max_new_tokens", ValueError, _engine(generate=([[1, 2]], 0))),
    ("max_new_tokens per prompt", "max_new_tokens", ValueError, _engine(generate=([[1, 2], [3]], [2]))),
    ("prompts a string", "prompts", TypeError, _engine(generate=("text", 2))),
    ("a prompt a string", "prompts[0]", TypeError, _engine(generate=(["text"], 2))),
    ("token id past the vocabulary", "prompts[0]", ValueError, _engine(generate=([[1, 97]], 2))),
    ("negative token id", "prompts[1]", ValueError, _engine(generate=([[1], [-3]], 2))),
    ("float token id", "prompts[0]", TypeError, _engine(generate=([[1, 2.0]], 2))),
    ("empty prompt", "prompts[0]", ValueError, _engine(generate=([[]], 2))),
    ("float tensor prompt", "prompts[0]", TypeError, _engine(generate=([torch.tensor([1.0])], 2))),
    ("more blocks than the cache", "prompts[0]", ValueError, _engine(generate=([list(range(30))], 8))),
]


# ---- moe ----

def _moe_inputs() -> dict:
    """T = 5 tokens, H = 16, I = 8, E = 4 experts, k = 2."""
    gen = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(5, 16, generator=gen), w13=torch.randn(4, 16, 16, generator=gen),
                w2=torch.randn(4, 16, 8, generator=gen), topk_weights=torch.rand(5, 2, generator=gen),
                topk_ids=torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0], [2, 1]], dtype=torch.int32))


def _moe(op: str, change) -> Callable[[str], object]:
    def call(backend):
        kw = _moe_inputs()
        if op == "router_topk":
            kw = dict(logits=torch.randn(5, 4), top_k=2)
        elif op == "moe_dispatch":
            kw = dict(x=kw["x"], topk_ids=kw["topk_ids"], num_experts=4)
        elif op == "moe_combine":
            x_sorted, _, handle = torch_kernels.moe_dispatch(kw["x"], kw["topk_ids"], 4)
            kw = dict(y=x_sorted, handle=handle, topk_weights=kw["topk_weights"])
        elif op == "grouped_mm":
            kw = dict(x=torch.randn(10, 16), w=torch.randn(4, 16, 8), offsets=torch.tensor([2, 2, 7, 9], dtype=torch.int32))
        change(kw)
        return getattr(torch_kernels, op)(**kw, implementation=backend)
    return call


def _fp8(kw, block_shape=None):
    kw.update(w13=kw["w13"].to(torch.float8_e4m3fn), w2=kw["w2"].to(torch.float8_e4m3fn), w13_scale=torch.ones(4, 16),
              w2_scale=torch.ones(4, 16), block_shape=block_shape)


MOE = [  # (op, case, argument, error, change)
    ("router_topk", "logits int", "logits", TypeError, _map("logits", lambda t: t.int())),
    ("router_topk", "logits 1-D", "logits", ValueError, _map("logits", lambda t: t[0])),
    ("router_topk", "top_k 0", "top_k", ValueError, _set("top_k", 0)),
    ("router_topk", "top_k past the experts", "top_k", ValueError, _set("top_k", 5)),
    ("router_topk", "top_k 2.5", "top_k", TypeError, _set("top_k", 2.5)),
    ("router_topk", "scoring unknown", "scoring", ValueError, _set("scoring", "relu")),
    ("router_topk", "renormalize a string", "renormalize", TypeError, _set("renormalize", "yes")),
    ("router_topk", "groups without topk_groups", "num_expert_groups, topk_groups", ValueError,
     _set("num_expert_groups", 2)),
    ("router_topk", "groups not dividing the experts", "num_expert_groups", ValueError,
     lambda kw: kw.update(num_expert_groups=3, topk_groups=1)),
    ("router_topk", "topk_groups past the groups", "topk_groups", ValueError,
     lambda kw: kw.update(num_expert_groups=2, topk_groups=3)),
    ("router_topk", "top_k past the kept groups", "top_k", ValueError,
     lambda kw: kw.update(num_expert_groups=4, topk_groups=1)),
    ("router_topk", "correction_bias size", "correction_bias", ValueError, _set("correction_bias", torch.zeros(3))),
    ("router_topk", "routed_scaling_factor nan", "routed_scaling_factor", ValueError,
     _set("routed_scaling_factor", math.nan)),
    ("moe_dispatch", "x int", "x", TypeError, _map("x", lambda t: t.int())),
    ("moe_dispatch", "topk_ids float", "topk_ids", TypeError, _map("topk_ids", lambda t: t.float())),
    ("moe_dispatch", "expert id past the experts", "topk_ids", ValueError, _index("topk_ids", (1, 1), 4)),
    ("moe_dispatch", "expert id below -1", "topk_ids", ValueError, _index("topk_ids", (0, 0), -2)),
    ("moe_dispatch", "topk_ids rows", "topk_ids", ValueError, _map("topk_ids", lambda t: t[:4])),
    ("moe_dispatch", "num_experts 0", "num_experts", ValueError, _set("num_experts", 0)),
    ("moe_combine", "handle a tuple", "handle", TypeError, lambda kw: kw.update(handle=(1, 2))),
    ("moe_combine", "y rows", "y", ValueError, _map("y", lambda t: t[:9])),
    ("moe_combine", "topk_weights shape", "topk_weights", ValueError, _map("topk_weights", lambda t: t[:, :1])),
    ("grouped_mm", "x 1-D", "x", ValueError, _map("x", lambda t: t[0])),
    ("grouped_mm", "w dtype", "w", TypeError, _map("w", lambda t: t.half())),
    ("grouped_mm", "w K", "w", ValueError, _map("w", lambda t: t[:, :8])),
    ("grouped_mm", "offsets int64", "offsets", TypeError, _map("offsets", lambda t: t.long())),
    ("grouped_mm", "offsets per expert", "offsets", ValueError, _map("offsets", lambda t: t[:3])),
    ("grouped_mm", "offsets decreasing", "offsets", ValueError, _index("offsets", 2, 1)),
    ("grouped_mm", "offsets past the rows", "offsets", ValueError, _index("offsets", 3, 11)),
    ("grouped_mm", "out_dtype int", "out_dtype", TypeError, _set("out_dtype", torch.int32)),
    ("grouped_mm", "no experts for the rows", "w", ValueError,
     lambda kw: kw.update(w=kw["w"][:0], offsets=kw["offsets"][:0])),
    ("fused_moe", "x hidden size", "w13", ValueError, _map("x", lambda t: t[:, :15])),
    ("fused_moe", "w13 odd 2I", "w13", ValueError, _map("w13", lambda t: t[:, :15])),
    ("fused_moe", "w2 shape", "w2", ValueError, _map("w2", lambda t: t[:, :, :4])),
    ("fused_moe", "w2 dtype", "w2", TypeError, _map("w2", lambda t: t.half())),
    ("fused_moe", "activation unknown", "activation", ValueError, _set("activation", "relu")),
    ("fused_moe", "expert id past the experts", "topk_ids", ValueError, _index("topk_ids", (4, 0), 7)),
    ("fused_moe", "topk_weights shape", "topk_weights", ValueError, _map("topk_weights", lambda t: t[:, :1])),
    ("fused_moe", "fp8 without scales", "w13_scale, w2_scale", ValueError,
     lambda kw: kw.update(w13=kw["w13"].to(torch.float8_e4m3fn), w2=kw["w2"].to(torch.float8_e4m3fn))),
    ("fused_moe", "fp8 scale shape", "w2_scale", ValueError, lambda kw: (_fp8(kw), kw.update(w2_scale=torch.ones(4, 8)))),
    ("fused_moe", "fp8 block scales of another block", "w13_scale", ValueError, lambda kw: _fp8(kw, [8, 8])),
    ("fused_moe", "block_shape of three", "block_shape", ValueError, lambda kw: _fp8(kw, [8, 8, 8])),
    ("fused_moe", "scales for unquantized weights", "w13_scale, w2_scale, block_shape", ValueError,
     _set("w13_scale", torch.ones(4, 16))),
    ("fused_moe", "fp8 scale float16", "w13_scale", TypeError,
     lambda kw: (_fp8(kw), kw.update(w13_scale=torch.ones(4, 16, dtype=torch.float16)))),
]


def table(family: str) -> list[Row]:
    """The rows of ``family``: one of ``FAMILIES``."""
    if family == "paged_attention":
        return [Row(f"{op}: {c}", a, e, _paged(op, ch))
                for op, rows in (("ragged_paged_attention", ATTENTION), ("reshape_and_cache", WRITE))
                for c, a, e, ch in rows]
    if family == "linear_attention":
        return [Row(f"{op}: {c}", a, e, _linear(op, ch)) for c, ops, a, e, ch in LINEAR for op in ops]
    if family == "ood":
        return [Row(*row) for row in OOD]
    if family == "edm":
        return [Row(*row) for row in EDM]
    if family == "serving":
        return [Row(*row) for row in SERVING]
    if family == "moe":
        return [Row(f"{op}: {c}", a, e, _moe(op, ch)) for op, c, a, e, ch in MOE]
    raise ValueError(f"family: unknown {family!r}")


FAMILIES = ("paged_attention", "linear_attention", "ood", "edm", "serving", "moe")


def run(family: str, backend: str) -> list[tuple[str, str, str]]:
    """``(case, exception type name, message)`` of every row of ``family`` on ``backend``."""
    results = []
    for row in table(family):
        try:
            row.call(backend)
        except Exception as e:  # noqa: BLE001 - recorded and judged by the test
            results.append((row.case, type(e).__name__, str(e)))
        else:
            results.append((row.case, "no error", ""))
    return results


if __name__ == "__main__":  # python bad_inputs.py FAMILY BACKEND: the results as JSON on stdout
    print(json.dumps(run(sys.argv[1], sys.argv[2])))

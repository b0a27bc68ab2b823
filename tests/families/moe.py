"""moe's bad-input rows (router_topk, moe_dispatch, moe_combine, grouped_mm, fused_moe) and
device cases."""

from __future__ import annotations

import math
from typing import Callable

import torch

import torch_kernels
from families import LARGE, DeviceCase, K, Row, map_arg, set_arg, set_at, sized
from torch_kernels.ops import moe as family_ops


# ---- bad inputs ----

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
    ("router_topk", "logits int", "logits", TypeError, map_arg("logits", lambda t: t.int())),
    ("router_topk", "logits 1-D", "logits", ValueError, map_arg("logits", lambda t: t[0])),
    ("router_topk", "top_k 0", "top_k", ValueError, set_arg("top_k", 0)),
    ("router_topk", "top_k past the experts", "top_k", ValueError, set_arg("top_k", 5)),
    ("router_topk", "top_k 2.5", "top_k", TypeError, set_arg("top_k", 2.5)),
    ("router_topk", "scoring unknown", "scoring", ValueError, set_arg("scoring", "relu")),
    ("router_topk", "renormalize a string", "renormalize", TypeError, set_arg("renormalize", "yes")),
    ("router_topk", "groups without topk_groups", "num_expert_groups, topk_groups", ValueError,
     set_arg("num_expert_groups", 2)),
    ("router_topk", "groups not dividing the experts", "num_expert_groups", ValueError,
     lambda kw: kw.update(num_expert_groups=3, topk_groups=1)),
    ("router_topk", "topk_groups past the groups", "topk_groups", ValueError,
     lambda kw: kw.update(num_expert_groups=2, topk_groups=3)),
    ("router_topk", "top_k past the kept groups", "top_k", ValueError,
     lambda kw: kw.update(num_expert_groups=4, topk_groups=1)),
    ("router_topk", "correction_bias size", "correction_bias", ValueError, set_arg("correction_bias", torch.zeros(3))),
    ("router_topk", "routed_scaling_factor nan", "routed_scaling_factor", ValueError,
     set_arg("routed_scaling_factor", math.nan)),
    ("moe_dispatch", "x int", "x", TypeError, map_arg("x", lambda t: t.int())),
    ("moe_dispatch", "topk_ids float", "topk_ids", TypeError, map_arg("topk_ids", lambda t: t.float())),
    ("moe_dispatch", "expert id past the experts", "topk_ids", ValueError, set_at("topk_ids", (1, 1), 4)),
    ("moe_dispatch", "expert id below -1", "topk_ids", ValueError, set_at("topk_ids", (0, 0), -2)),
    ("moe_dispatch", "topk_ids rows", "topk_ids", ValueError, map_arg("topk_ids", lambda t: t[:4])),
    ("moe_dispatch", "num_experts 0", "num_experts", ValueError, set_arg("num_experts", 0)),
    ("moe_combine", "handle a tuple", "handle", TypeError, lambda kw: kw.update(handle=(1, 2))),
    ("moe_combine", "y rows", "y", ValueError, map_arg("y", lambda t: t[:9])),
    ("moe_combine", "topk_weights shape", "topk_weights", ValueError, map_arg("topk_weights", lambda t: t[:, :1])),
    ("grouped_mm", "x 1-D", "x", ValueError, map_arg("x", lambda t: t[0])),
    ("grouped_mm", "w dtype", "w", TypeError, map_arg("w", lambda t: t.half())),
    ("grouped_mm", "w K", "w", ValueError, map_arg("w", lambda t: t[:, :8])),
    ("grouped_mm", "offsets int64", "offsets", TypeError, map_arg("offsets", lambda t: t.long())),
    ("grouped_mm", "offsets per expert", "offsets", ValueError, map_arg("offsets", lambda t: t[:3])),
    ("grouped_mm", "offsets decreasing", "offsets", ValueError, set_at("offsets", 2, 1)),
    ("grouped_mm", "offsets past the rows", "offsets", ValueError, set_at("offsets", 3, 11)),
    ("grouped_mm", "out_dtype int", "out_dtype", TypeError, set_arg("out_dtype", torch.int32)),
    ("grouped_mm", "no experts for the rows", "w", ValueError,
     lambda kw: kw.update(w=kw["w"][:0], offsets=kw["offsets"][:0])),
    ("fused_moe", "x hidden size", "w13", ValueError, map_arg("x", lambda t: t[:, :15])),
    ("fused_moe", "w13 odd 2I", "w13", ValueError, map_arg("w13", lambda t: t[:, :15])),
    ("fused_moe", "w2 shape", "w2", ValueError, map_arg("w2", lambda t: t[:, :, :4])),
    ("fused_moe", "w2 dtype", "w2", TypeError, map_arg("w2", lambda t: t.half())),
    ("fused_moe", "activation unknown", "activation", ValueError, set_arg("activation", "relu")),
    ("fused_moe", "expert id past the experts", "topk_ids", ValueError, set_at("topk_ids", (4, 0), 7)),
    ("fused_moe", "topk_weights shape", "topk_weights", ValueError, map_arg("topk_weights", lambda t: t[:, :1])),
    ("fused_moe", "fp8 without scales", "w13_scale, w2_scale", ValueError,
     lambda kw: kw.update(w13=kw["w13"].to(torch.float8_e4m3fn), w2=kw["w2"].to(torch.float8_e4m3fn))),
    ("fused_moe", "fp8 scale shape", "w2_scale", ValueError, lambda kw: (_fp8(kw), kw.update(w2_scale=torch.ones(4, 8)))),
    ("fused_moe", "fp8 block scales of another block", "w13_scale", ValueError, lambda kw: _fp8(kw, [8, 8])),
    ("fused_moe", "block_shape of three", "block_shape", ValueError, lambda kw: _fp8(kw, [8, 8, 8])),
    ("fused_moe", "scales for unquantized weights", "w13_scale, w2_scale, block_shape", ValueError,
     set_arg("w13_scale", torch.ones(4, 16))),
    ("fused_moe", "fp8 scale float16", "w13_scale", TypeError,
     lambda kw: (_fp8(kw), kw.update(w13_scale=torch.ones(4, 16, dtype=torch.float16)))),
]


BAD_INPUTS = {"moe": [Row(f"{op}: {c}", a, e, _moe(op, ch), op) for op, c, a, e, ch in MOE]}


# ---- device cases ----

def router_run(scoring: str, top_k: int, **groups):
    def run(logits, bias, implementation=None):
        return torch_kernels.router_topk(logits, top_k, scoring=scoring, correction_bias=bias if groups else None,
                                         implementation=implementation, **groups)
    return run


def dispatch_combine_run(x, w13, w2, weights, ids, implementation=None):
    """The dispatched rows (moe_gather) and their weighted sum back per token (moe_combine)."""
    rows, _, handle = torch_kernels.moe_dispatch(x, ids, w13.shape[0], implementation=implementation)
    return rows, torch_kernels.moe_combine(rows, handle, weights, implementation=implementation)


def fused_moe_run(x, w13, w2, weights, ids, implementation=None):
    return torch_kernels.fused_moe(x, w13, w2, weights, ids, implementation=implementation)


DEVICE_CASES = [
    DeviceCase("router_topk softmax", "router_topk", family_ops.router_inputs, router_run("softmax", 2), grads=(0,),
               exact=(1,)),
    DeviceCase("router_topk grouped sigmoid", "router_topk", family_ops.router_inputs,
               router_run("sigmoid", 2, num_expert_groups=4, topk_groups=2), grads=(0,), exact=(1,)),
    DeviceCase("router_topk 128 experts, top 8", "router_topk", sized(family_ops.router_inputs, tokens=4 * K, experts=128),
               router_run("softmax", 8), grads=(0,), exact=(1,), **LARGE),
    DeviceCase("moe_dispatch + moe_combine", "moe_combine", family_ops.moe_inputs, dispatch_combine_run, grads=(0, 3),
               exact=(0,), covers=("moe_gather",)),
    DeviceCase("moe_dispatch + moe_combine 128 experts", "moe_combine",
               sized(family_ops.moe_inputs, tokens=4 * K, hidden=2 * K, inter=16, experts=128, top_k=8),
               dispatch_combine_run, grads=(0, 3), exact=(0,), covers=("moe_gather",), **LARGE),
    DeviceCase("grouped_mm", "grouped_mm", family_ops.grouped_mm_inputs, torch_kernels.grouped_mm, grads=(0, 1)),
    DeviceCase("grouped_mm 128 experts", "grouped_mm",
               sized(family_ops.grouped_mm_inputs, rows=16 * K, k_dim=2 * K, n_dim=1536, experts=128),
               torch_kernels.grouped_mm, grads=(0, 1), **LARGE),
    DeviceCase("fused_moe", "fused_moe", family_ops.moe_inputs, fused_moe_run, grads=(0, 1, 2, 3)),
    DeviceCase("fused_moe 128 experts, top 8", "fused_moe",
               sized(family_ops.moe_inputs, tokens=2 * K, hidden=K, inter=768, experts=128, top_k=8),
               fused_moe_run, grads=(0, 1, 2, 3), **LARGE),
]

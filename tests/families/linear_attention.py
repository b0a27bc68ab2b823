"""linear_attention's bad-input rows (the delta rule, its recurrent form, gated linear attention,
Kimi Delta Attention's two forms) and device cases."""

from __future__ import annotations

import math
from typing import Callable

import torch

import torch_kernels
from families import LARGE, DeviceCase, K, Row, interpreter_sizes, map_arg, set_arg, set_at, sized
from torch_kernels.ops import linear_attention as family_ops


# ---- bad inputs ----

KDA_OPS = ("chunk_kda", "fused_recurrent_kda")
LINEAR_OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_simple_gla", *KDA_OPS)
DELTA_OPS = LINEAR_OPS[:2]  # grouped value heads
WITH_BETA = DELTA_OPS + KDA_OPS
ONE_HEAD_COUNT = ("chunk_simple_gla", *KDA_OPS)


def _linear_inputs(op: str) -> dict:
    """B = 1, T = 6, H = 2 (value heads 4 for the delta rule), K = V = 8; KDA's g per channel."""
    gen = torch.Generator().manual_seed(0)
    value_heads = 4 if op in DELTA_OPS else 2
    channels = (8,) if op in KDA_OPS else ()
    x = dict(q=torch.randn(1, 6, 2, 8, generator=gen), k=torch.randn(1, 6, 2, 8, generator=gen),
             v=torch.randn(1, 6, value_heads, 8, generator=gen),
             g=-torch.rand(1, 6, value_heads, *channels, generator=gen),
             initial_state=torch.randn(1, value_heads, 8, 8, generator=gen))
    if op in WITH_BETA:
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
    ("k shape", LINEAR_OPS, "k", ValueError, map_arg("k", lambda t: t[..., :4])),
    ("v time", LINEAR_OPS, "v", ValueError, map_arg("v", lambda t: t[:, :5])),
    ("v heads not a multiple", DELTA_OPS, "v", ValueError, map_arg("v", lambda t: t[:, :, :3])),
    ("v heads not those of q", ONE_HEAD_COUNT, "v", ValueError, map_arg("v", lambda t: torch.cat([t, t], 2))),
    ("v dtype", LINEAR_OPS, "v", TypeError, map_arg("v", lambda t: t.half())),
    ("q int", LINEAR_OPS, "q", TypeError, map_arg("q", lambda t: t.int())),
    ("q 3-D", LINEAR_OPS, "q", ValueError, map_arg("q", lambda t: t[0])),
    ("q not a tensor", LINEAR_OPS, "q", TypeError, map_arg("q", lambda t: t.tolist())),
    ("K = 0", LINEAR_OPS, "q", ValueError, lambda x: x.update(q=x["q"][..., :0], k=x["k"][..., :0],
                                                               initial_state=x["initial_state"][:, :, :0])),
    ("V = 0", LINEAR_OPS, "q, v", ValueError, lambda x: x.update(v=x["v"][..., :0],
                                                                  initial_state=x["initial_state"][..., :0])),
    ("g shape", LINEAR_OPS, "g", ValueError, map_arg("g", lambda t: t[:, :, :1])),
    ("g channels", KDA_OPS, "g", ValueError, map_arg("g", lambda t: t[..., :4])),
    ("g per head", KDA_OPS, "g", ValueError, map_arg("g", lambda t: t[..., 0])),
    ("g int", LINEAR_OPS, "g", TypeError, map_arg("g", lambda t: t.int())),
    ("g positive", LINEAR_OPS, "g", ValueError, set_at("g", (0, 3, 1), 0.5)),
    ("beta missing", WITH_BETA, "beta", TypeError, set_arg("beta", None)),
    ("beta shape", KDA_OPS, "beta", ValueError, map_arg("beta", lambda t: t[..., None])),
    ("g missing", WITH_BETA, "g", TypeError, set_arg("g", None)),
    ("initial_state shape", LINEAR_OPS, "initial_state", ValueError, map_arg("initial_state", lambda t: t[..., :4])),
    ("initial_state int", LINEAR_OPS, "initial_state", TypeError, map_arg("initial_state", lambda t: t.int())),
    ("cu_seqlens with batch 2", LINEAR_OPS, "cu_seqlens", ValueError, _stack_batch),
    ("cu_seqlens not to T", LINEAR_OPS, "cu_seqlens", ValueError,
     set_arg("cu_seqlens", torch.tensor([0, 5], dtype=torch.int32))),
    ("cu_seqlens not from 0", LINEAR_OPS, "cu_seqlens", ValueError,
     set_arg("cu_seqlens", torch.tensor([1, 6], dtype=torch.int32))),
    ("cu_seqlens decreasing", LINEAR_OPS, "cu_seqlens", ValueError,
     lambda x: x.update(cu_seqlens=torch.tensor([0, 4, 2, 6], dtype=torch.int32), initial_state=None)),
    ("cu_seqlens float", LINEAR_OPS, "cu_seqlens", TypeError, set_arg("cu_seqlens", torch.tensor([0.0, 6.0]))),
    ("cu_seqlens one offset", LINEAR_OPS, "cu_seqlens", ValueError, set_arg("cu_seqlens", torch.tensor([0]))),
    ("scale nan", LINEAR_OPS, "scale", ValueError, set_arg("scale", math.nan)),
    ("scale a string", LINEAR_OPS, "scale", TypeError, set_arg("scale", "0.5")),
    ("scale True", LINEAR_OPS, "scale", TypeError, set_arg("scale", True)),
    ("k on meta", LINEAR_OPS, "k", ValueError, map_arg("k", lambda t: t.to("meta"))),
]


BAD_INPUTS = {"linear_attention": [Row(f"{op}: {c}", a, e, _linear(op, ch), op)
                                   for c, ops, a, e, ch in LINEAR for op in ops]}


# ---- device cases ----

def linear_attention_run(op: str):
    delta = op != "chunk_simple_gla"  # KDA's two forms have the delta rule too
    public = getattr(torch_kernels, op)

    def run(*inputs, implementation=None):
        *tensors, h0, cu = inputs
        kwargs = {"use_qk_l2norm_in_kernel": True} if delta else {}
        return public(*tensors, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                      implementation=implementation, **kwargs)

    return run


DEVICE_CASES = [
    *(DeviceCase(op, op, sized(family_ops.linear_attention_inputs, delta=op != "chunk_simple_gla",
                                   per_channel=op in KDA_OPS, **interpreter_sizes(cu_seqlens=(0, 9, 24)),
                                   **(interpreter_sizes(heads=(1, 1), k_dim=16, v_dim=16) if op in KDA_OPS else {})),
                 linear_attention_run(op), grads=tuple(range(6 if op != "chunk_simple_gla" else 5)))
      for op in LINEAR_OPS),
    *(DeviceCase(f"{op} 5k tokens, K = V = 128", op,
                 sized(family_ops.linear_attention_inputs, delta=op != "chunk_simple_gla", cu_seqlens=(0, 1000, 5 * K),
                       heads=(4, 8), k_dim=128, v_dim=128, per_channel=op in KDA_OPS),
                 linear_attention_run(op), grads=tuple(range(6 if op != "chunk_simple_gla" else 5)), **LARGE)
      for op in ("chunk_gated_delta_rule", "chunk_simple_gla", "chunk_kda")),
]

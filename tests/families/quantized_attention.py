"""quantized_attention's bad-input rows (quantized_attention, quantized_sdpa) and device cases."""

from __future__ import annotations

import torch

import torch_kernels
from families import LARGE, DeviceCase, K, Row, interpreter_sizes, sized
from torch_kernels.ops import quantized_attention as family_ops


# ---- bad inputs ----

def _packed():
    """Valid keyword arguments: two packed sequences, GQA 4:2, float16."""
    gen = torch.Generator().manual_seed(25)
    q = torch.randn(1, 4, 30, 64, generator=gen).half()
    k = torch.randn(1, 2, 40, 64, generator=gen).half()
    return dict(q=q, k=k, v=k.clone(), cu_seqlens_q=torch.tensor([0, 10, 30], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 25, 40], dtype=torch.int32))


def _call(**changes):
    """A call of quantized_attention on a backend with ``changes`` made to :func:`_packed`'s arguments."""
    kwargs = _packed()
    kwargs.update(changes)
    return lambda backend: torch_kernels.quantized_attention(**kwargs, implementation=backend)


def _sdpa(**kwargs):
    """A call of quantized_sdpa on a backend, forced onto the quantized path unless ``kwargs`` say."""
    x = torch.randn(1, 1, 2, 8)
    kwargs = dict(query=x, key=x, value=x, force_quantized=True) | kwargs
    return lambda backend: torch_kernels.quantized_sdpa(**kwargs, implementation=backend)


_ROWS = {  # case: (argument, error, call)
    "q not a tensor": ("q", TypeError, _call(q=[1.0])),
    "q 3-D": ("q", ValueError, _call(q=torch.randn(4, 30, 64).half())),
    "q int": ("q", TypeError, _call(q=torch.zeros(1, 4, 30, 64, dtype=torch.int8))),
    "k float32 with q float16": ("k", TypeError, _call(k=torch.randn(1, 2, 40, 64))),
    "v dtype": ("v", TypeError, _call(v=torch.randn(1, 2, 40, 64).bfloat16())),
    "k head size": ("k", ValueError, _call(k=torch.randn(1, 2, 40, 32).half())),
    "v shape": ("v", ValueError, _call(v=torch.randn(1, 2, 39, 64).half())),
    "heads not a multiple": ("k", ValueError, _call(k=torch.randn(1, 3, 40, 64).half(),
                                                    v=torch.randn(1, 3, 40, 64).half())),
    "k batch": ("k", ValueError, lambda backend: torch_kernels.quantized_attention(
        torch.randn(2, 4, 8, 64), torch.randn(1, 2, 8, 64), torch.randn(1, 2, 8, 64), implementation=backend)),
    "head size 0": ("q", ValueError, _call(q=torch.randn(1, 4, 30, 0).half(), k=torch.randn(1, 2, 40, 0).half(),
                                           v=torch.randn(1, 2, 40, 0).half())),
    "layout": ("layout", ValueError, _call(layout="BHSD")),
    "granularity": ("granularity", ValueError, _call(granularity="per_tensor")),
    "pv_dtype": ("pv_dtype", ValueError, _call(pv_dtype="fp32")),
    "causal not bool": ("causal", TypeError, _call(causal=1)),
    "smooth_k not bool": ("smooth_k", TypeError, _call(smooth_k="yes")),
    "return_lse not bool": ("return_lse", TypeError, _call(return_lse=None)),
    "sm_scale string": ("sm_scale", TypeError, _call(sm_scale="0.1")),
    "sm_scale nan": ("sm_scale", ValueError, _call(sm_scale=float("nan"))),
    "one cu_seqlens": ("cu_seqlens_q, cu_seqlens_k", ValueError, _call(cu_seqlens_k=None)),
    "cu_seqlens float": ("cu_seqlens_q", TypeError, _call(cu_seqlens_q=torch.tensor([0.0, 10.0, 30.0]))),
    "cu_seqlens 2-D": ("cu_seqlens_k", ValueError, _call(cu_seqlens_k=torch.tensor([[0, 25, 40]], dtype=torch.int32))),
    "cu_seqlens lengths differ": ("cu_seqlens_k", ValueError,
                                  _call(cu_seqlens_k=torch.tensor([0, 40], dtype=torch.int32))),
    "cu_seqlens short": ("cu_seqlens_q", ValueError, _call(cu_seqlens_q=torch.tensor([0], dtype=torch.int32),
                                                          cu_seqlens_k=torch.tensor([0], dtype=torch.int32))),
    "cu_seqlens start": ("cu_seqlens_q", ValueError, _call(cu_seqlens_q=torch.tensor([1, 10, 30], dtype=torch.int32))),
    "cu_seqlens decreasing": ("cu_seqlens_k", ValueError,
                              _call(cu_seqlens_k=torch.tensor([0, 41, 40], dtype=torch.int32))),
    "cu_seqlens end": ("cu_seqlens_k", ValueError, _call(cu_seqlens_k=torch.tensor([0, 25, 39], dtype=torch.int32))),
    "cu_seqlens with batch 2": ("cu_seqlens_q", ValueError, _call(q=torch.randn(2, 4, 30, 64).half(),
                                                                  k=torch.randn(2, 2, 40, 64).half(),
                                                                  v=torch.randn(2, 2, 40, 64).half())),
    "NHD heads": ("k", ValueError, _call(layout="NHD", cu_seqlens_q=None, cu_seqlens_k=None)),
    "sdpa query": ("query", TypeError, _sdpa(query=None)),
    "sdpa scale": ("scale", TypeError, _sdpa(scale="x")),
    # the options are checked on the SDPA route too
    "sdpa pv_dtype": ("pv_dtype", ValueError, _sdpa(pv_dtype="fp32", force_quantized=False)),
    "sdpa granularity": ("granularity", ValueError, _sdpa(granularity="per_tensor", attn_mask=torch.ones(2, 2) > 0)),
    "sdpa smooth_q not bool": ("smooth_q", TypeError, _sdpa(smooth_q=1)),
    "sdpa force_quantized not bool": ("force_quantized", TypeError, _sdpa(force_quantized="yes")),
}

BAD_INPUTS = {"quantized_attention": [
    Row(case, argument, error, call, "quantized_sdpa" if case.startswith("sdpa ") else "quantized_attention")
    for case, (argument, error, call) in _ROWS.items()]}


# ---- device cases ----

# float8_e4m3fn keeps 3 mantissa bits: the family's fp8 gate (tests/test_quantized_attention.py)
FP8_GATE = (0.998, 0.06)


def quantized_attention_run(pv_dtype: str):
    def run(q, k, v, implementation=None):
        return torch_kernels.quantized_attention(q, k, v, causal=True, pv_dtype=pv_dtype, implementation=implementation)
    return run


DEVICE_CASES = [
    DeviceCase("quantized_attention", "quantized_attention",
               sized(family_ops.quantized_attention_inputs, **interpreter_sizes(b=1, nq=19, nk=45)),
               quantized_attention_run("fp16"), grads=(0, 1, 2), wide=torch.float32, coarsest=torch.float16),
    DeviceCase("quantized_attention 4k, D 128", "quantized_attention",
               sized(family_ops.quantized_attention_inputs, b=1, heads=(8, 2), nq=4 * K, nk=4 * K, head_size=128),
               quantized_attention_run("fp16"), grads=(0, 1, 2), wide=torch.float32, coarsest=torch.float16, **LARGE),
    DeviceCase("quantized_attention fp8 P.V", "quantized_attention", family_ops.quantized_attention_inputs,
               quantized_attention_run("fp8"), wide=torch.float32, capability=(8, 9), dtypes=(torch.bfloat16,),
               gate=FP8_GATE),
]

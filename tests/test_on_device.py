"""Every op's Triton kernels on one device's tensors, against the reference backend on that device.

``TORCH_KERNELS_TEST_DEVICE`` (default ``cpu``) names the device. On ``cuda`` the Triton kernels
run compiled, in float32, float16 and bfloat16, forward and (where the op is differentiable)
backward, plus the cases only a GPU can run: fp8 KV caches and fp8 P.V (compute capability 8.9+),
and sizes the interpreter cannot reach (32k-token contexts, 128 experts, bfloat16 tensor-core
tiles). On ``cpu`` the same tests run in float32 at the small sizes under the Triton interpreter:
they prove this module's logic; the families' own tests cover the CPU backends in depth (every
dtype, backend and edge case), so nothing more is repeated here, and the GPU-only cases skip.

The truth is the reference backend on the same device, given the inputs widened (float16 and
bfloat16 to float32, float32 to float64 where the op takes float64; fp8 and integer tensors as
they are). Outputs are held to the shared tolerances (``harness.assert_close``, keyed by the
inputs' dtype); where the reference itself, run on the inputs as they are, misses them (an
ill-conditioned output, such as EDM's residual where it cancels), to no more than four times
the reference's own error, element by element. Routing ids, gathered rows and cache writes must
match exactly. Gradients: of ``sum(out * cotangent)`` for a fixed random cotangent, every
differentiable input, under the same rule.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import pytest
import torch

import torch_kernels
from harness import assert_close, require_backend
from torch_kernels import backends, selftest
from torch_kernels.selftest import TOLERANCES

DEVICE = torch.device(os.environ.get("TORCH_KERNELS_TEST_DEVICE", "cpu"))
# Unset, on CPU, the comparisons would repeat the families' interpreter tests in the main run;
# benchmarks/gpu.sh sets it (its dry run, in tests/test_gpu_script.py, to cpu).
device_chosen = pytest.mark.skipif("TORCH_KERNELS_TEST_DEVICE" not in os.environ,
                                   reason="TORCH_KERNELS_TEST_DEVICE unset: on CPU the families' own tests cover this")
CUDA = DEVICE.type == "cuda"
DTYPES = (torch.float32, torch.float16, torch.bfloat16) if CUDA else (torch.float32,)
FP8 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class DeviceCase:
    name: str
    op: str  # the registered op whose backend is checked
    make: Callable  # (generator, dtype, device) -> inputs
    run: Callable  # (*inputs, implementation=) -> a tensor or a tuple of tensors
    grads: tuple = ()  # positions of the inputs that get gradients (empty: inference only)
    wide: torch.dtype = torch.float64  # float32 inputs widen to this for the truth
    exact: tuple = ()  # positions of the outputs that must match exactly
    large: bool = False  # a size only a GPU reaches
    capability: tuple | None = None  # the least CUDA compute capability it needs
    dtypes: tuple | None = None  # None: DTYPES; GPU-only cases run in bfloat16
    coarsest: torch.dtype | None = None  # an inner rounding (fp16 P.V): its tolerance when looser
    gate: tuple | None = None  # (min cosine, max relative L1) instead of the tolerance (fp8 P.V)

    def tolerance_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.coarsest is not None and TOLERANCES[self.coarsest][0] > TOLERANCES[dtype][0]:
            return self.coarsest
        return dtype

    @property
    def gpu_only(self) -> bool:
        return self.large or self.capability is not None


def sized(maker, **sizes):
    return lambda gen, dtype, device: maker(gen, dtype, device, **sizes)


def interpreter_sizes(**sizes) -> dict:
    """``sizes`` under the interpreter (its cost is per step), none (selftest's) on a GPU."""
    return {} if CUDA else sizes


# ---------------------------------------------------------------------------------- runners


def linear_attention_run(op: str):
    delta = op != "chunk_simple_gla"
    public = getattr(torch_kernels, op)

    def run(*inputs, implementation=None):
        *tensors, h0, cu = inputs
        kwargs = {"use_qk_l2norm_in_kernel": True} if delta else {}
        return public(*tensors, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                      implementation=implementation, **kwargs)

    return run


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
    key, value, key_cache, value_cache, slots = selftest.reshape_and_cache_inputs(gen, dtype, device)
    scale = torch.tensor([0.01, 0.02], device=device)
    return key, value, key_cache.to(FP8), value_cache.to(FP8), slots, scale, scale * 2


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


def quantized_attention_run(pv_dtype: str):
    def run(q, k, v, implementation=None):
        return torch_kernels.quantized_attention(q, k, v, causal=True, pv_dtype=pv_dtype, implementation=implementation)
    return run


K = 1024
# float8_e4m3fn keeps 3 mantissa bits: the quantized-attention family's fp8 gate (tests/test_quantized_attention.py)
FP8_GATE = (0.998, 0.06)
LARGE = dict(large=True, dtypes=(torch.bfloat16,))
CASES = [
    DeviceCase("mahalanobis_score", "mahalanobis_score", selftest.mahalanobis_inputs, torch_kernels.mahalanobis_score,
               grads=(0, 1, 2)),
    DeviceCase("mahalanobis_score 4096 x 1024, 16 classes", "mahalanobis_score",
               sized(selftest.mahalanobis_inputs, b=4 * K, d=K, c=16), torch_kernels.mahalanobis_score, grads=(0,),
               **LARGE),
    DeviceCase("edm_score", "edm_score", selftest.edm_inputs, selftest._edm_run, grads=tuple(range(13))),
    DeviceCase("edm_score 4096 x 384, width 512", "edm_score",
               sized(selftest.edm_inputs, b=4 * K, d=384, h=512, blocks=2, levels=4), selftest._edm_run, grads=(0,),
               **LARGE),
    DeviceCase("ragged_paged_attention", "ragged_paged_attention", selftest.paged_attention_inputs,
               paged_attention_run, wide=torch.float32),
    DeviceCase("ragged_paged_attention 32k context, D 128", "ragged_paged_attention",
               sized(selftest.paged_attention_inputs, q_lens=(1, 1, 64, 1), contexts=(32 * K, 5000, 2000, 0),
                     heads=(32, 8), head_size=128),
               paged_attention_run, wide=torch.float32, **LARGE),
    DeviceCase("ragged_paged_attention fp8 caches", "ragged_paged_attention",
               fp8_caches(selftest.paged_attention_inputs), paged_attention_run, wide=torch.float32,
               capability=(8, 9), dtypes=(torch.bfloat16, torch.float16)),
    DeviceCase("reshape_and_cache", "reshape_and_cache", selftest.reshape_and_cache_inputs, reshape_and_cache_run,
               wide=torch.float32, exact=(0, 1)),
    DeviceCase("reshape_and_cache fp8 caches", "reshape_and_cache", fp8_write, reshape_and_cache_run,
               wide=torch.float32, exact=(0, 1), capability=(8, 9), dtypes=(torch.bfloat16,)),
    *(DeviceCase(op, op, sized(selftest.linear_attention_inputs, delta=op != "chunk_simple_gla",
                                   **interpreter_sizes(cu_seqlens=(0, 9, 24))),
                 linear_attention_run(op), grads=tuple(range(6 if op != "chunk_simple_gla" else 5)))
      for op in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_simple_gla")),
    *(DeviceCase(f"{op} 5k tokens, K = V = 128", op,
                 sized(selftest.linear_attention_inputs, delta=op != "chunk_simple_gla", cu_seqlens=(0, 1000, 5 * K),
                       heads=(4, 8), k_dim=128, v_dim=128),
                 linear_attention_run(op), grads=tuple(range(6 if op != "chunk_simple_gla" else 5)), **LARGE)
      for op in ("chunk_gated_delta_rule", "chunk_simple_gla")),
    DeviceCase("router_topk softmax", "router_topk", selftest.router_inputs, router_run("softmax", 2), grads=(0,),
               exact=(1,)),
    DeviceCase("router_topk grouped sigmoid", "router_topk", selftest.router_inputs,
               router_run("sigmoid", 2, num_expert_groups=4, topk_groups=2), grads=(0,), exact=(1,)),
    DeviceCase("router_topk 128 experts, top 8", "router_topk", sized(selftest.router_inputs, tokens=4 * K, experts=128),
               router_run("softmax", 8), grads=(0,), exact=(1,), **LARGE),
    DeviceCase("moe_dispatch + moe_combine", "moe_combine", selftest.moe_inputs, dispatch_combine_run, grads=(0, 3),
               exact=(0,)),
    DeviceCase("moe_dispatch + moe_combine 128 experts", "moe_combine",
               sized(selftest.moe_inputs, tokens=4 * K, hidden=2 * K, inter=16, experts=128, top_k=8),
               dispatch_combine_run, grads=(0, 3), exact=(0,), **LARGE),
    DeviceCase("grouped_mm", "grouped_mm", selftest.grouped_mm_inputs, torch_kernels.grouped_mm, grads=(0, 1)),
    DeviceCase("grouped_mm 128 experts", "grouped_mm",
               sized(selftest.grouped_mm_inputs, rows=16 * K, k_dim=2 * K, n_dim=1536, experts=128),
               torch_kernels.grouped_mm, grads=(0, 1), **LARGE),
    DeviceCase("fused_moe", "fused_moe", selftest.moe_inputs, fused_moe_run, grads=(0, 1, 2, 3)),
    DeviceCase("fused_moe 128 experts, top 8", "fused_moe",
               sized(selftest.moe_inputs, tokens=2 * K, hidden=K, inter=768, experts=128, top_k=8),
               fused_moe_run, grads=(0, 1, 2, 3), **LARGE),
    DeviceCase("quantized_attention", "quantized_attention",
               sized(selftest.quantized_attention_inputs, **interpreter_sizes(b=1, nq=19, nk=45)),
               quantized_attention_run("fp16"), grads=(0, 1, 2), wide=torch.float32, coarsest=torch.float16),
    DeviceCase("quantized_attention 4k, D 128", "quantized_attention",
               sized(selftest.quantized_attention_inputs, b=1, heads=(8, 2), nq=4 * K, nk=4 * K, head_size=128),
               quantized_attention_run("fp16"), grads=(0, 1, 2), wide=torch.float32, coarsest=torch.float16, **LARGE),
    DeviceCase("quantized_attention fp8 P.V", "quantized_attention", selftest.quantized_attention_inputs,
               quantized_attention_run("fp8"), wide=torch.float32, capability=(8, 9), dtypes=(torch.bfloat16,),
               gate=FP8_GATE),
]


def skip_reason(case: DeviceCase) -> str | None:
    if case.gpu_only and not CUDA:
        return (f"GPU only ({'a size the Triton interpreter cannot reach' if case.large else 'fp8 tensor cores'}): "
                "set TORCH_KERNELS_TEST_DEVICE=cuda on a GPU machine")
    if case.capability and torch.cuda.get_device_capability(DEVICE) < case.capability:
        return f"needs CUDA compute capability {case.capability[0]}.{case.capability[1]}+ (float8_e4m3fn MMA)"
    return None


def params(cases):
    out = []
    for case in cases:
        reason = skip_reason(case)
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        for dtype in case.dtypes or DTYPES:
            out.append(pytest.param(case, dtype, marks=marks, id=f"{case.name}-{str(dtype).removeprefix('torch.')}"))
    return out


# ------------------------------------------------------------------------------ the comparison


def widened(inputs, wide: torch.dtype):
    low = (torch.float16, torch.bfloat16, torch.float32)
    return tuple(t.to(wide) if isinstance(t, torch.Tensor) and t.dtype in low else t for t in inputs)


def as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def assert_as_accurate(out, truth, reference, dtype, what, exact=False):
    """``out`` within the shared tolerance of ``truth``, or no further from it than 4x ``reference``
    (the reference backend on the unwidened inputs) is, element by element (module docstring)."""
    if out is None or truth is None:
        assert out is None and truth is None, f"{what}: gradient present on one side only"
        return
    if exact:
        as_number = torch.float64 if truth.is_floating_point() else torch.int64  # fp8 has no torch.equal
        assert torch.equal(out.to(as_number), truth.to(as_number)), f"{what}: not equal to the reference's"
        return
    try:
        assert_close(out, truth, dtype, what=what)
        return
    except AssertionError as missed:
        try:
            assert_close(reference, truth, dtype, what=what)
        except AssertionError:
            pass
        else:
            raise missed  # the reference meets the tolerance here: so must the kernel
        error = (out.double() - truth.double()).abs()
        allowed = 4 * (reference.double() - truth.double()).abs() + TOLERANCES[dtype][0] * truth.double().abs().max()
        assert torch.isfinite(out).all() and (error <= allowed).all(), (
            f"{missed}; and beyond 4x the reference's own error (worst element {error.max().item():.2e})")


def assert_within_gate(out, truth, gate, what):
    cosine = torch.nn.functional.cosine_similarity(out.double().flatten(), truth.double().flatten(), dim=0).item()
    l1 = ((out.double() - truth.double()).abs().sum() / truth.double().abs().sum()).item()
    assert cosine >= gate[0] and l1 <= gate[1], f"{what}: cosine {cosine:.5f}, relative L1 {l1:.4f}; gate {gate}"


def outputs_and_grads(case, inputs, implementation, cotangents=None):
    """The case's outputs, and with ``cotangents`` the gradients of the inputs in ``case.grads``."""
    if cotangents is None:
        with torch.no_grad():
            return as_tuple(case.run(*inputs, implementation=implementation)), None
    inputs = list(inputs)
    leaves = []
    for i in case.grads:
        inputs[i] = inputs[i].detach().clone().requires_grad_()
        leaves.append(inputs[i])
    outs = as_tuple(case.run(*inputs, implementation=implementation))
    pairs = [(o, c.to(o.dtype)) for o, c in zip(outs, cotangents) if c is not None]
    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [c for _, c in pairs], allow_unused=True)
    return tuple(o.detach() for o in outs), grads


def cotangents_for(outs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen).to(o.device) if o.is_floating_point() else None for o in outs]


def run_three(case, dtype, backward: bool):
    """(triton's, the widened reference's, the reference's) outputs (and gradients)."""
    require_backend("triton")
    inputs = case.make(torch.Generator().manual_seed(0), dtype, DEVICE)
    cot = None
    if backward:
        with torch.no_grad():
            cot = cotangents_for(as_tuple(case.run(*inputs, implementation="reference")))
    got = outputs_and_grads(case, inputs, "triton", cot)
    assert backends.last_backend(case.op) == "triton"
    truth = outputs_and_grads(case, widened(inputs, case.wide), "reference", cot)
    reference = outputs_and_grads(case, inputs, "reference", cot)
    return got, truth, reference


@device_chosen
@pytest.mark.parametrize("case, dtype", params(CASES))
def test_forward_matches_reference_on_device(case, dtype):
    (outs, _), (truth, _), (reference, _) = run_three(case, dtype, backward=False)
    assert len(outs) == len(truth)
    for n, (o, t, r) in enumerate(zip(outs, truth, reference)):
        assert o.device.type == DEVICE.type, f"output {n} on {o.device}"
        assert o.dtype == r.dtype, f"output {n}: {o.dtype}, the reference gives {r.dtype}"
        if case.gate:
            assert_within_gate(o, t, case.gate, f"{case.name} output {n}")
        else:
            assert_as_accurate(o, t, r, case.tolerance_dtype(dtype), f"{case.name} output {n}", exact=n in case.exact)


@device_chosen
@pytest.mark.parametrize("case, dtype", params([c for c in CASES if c.grads]))
def test_backward_matches_reference_on_device(case, dtype):
    (_, grads), (_, truth), (_, reference) = run_three(case, dtype, backward=True)
    for i, g, t, r in zip(case.grads, grads, truth, reference):
        assert_as_accurate(g, t, r, case.tolerance_dtype(dtype), f"{case.name} gradient of input {i}")


def test_every_op_with_a_triton_kernel_is_covered():
    """A new op (or a Triton kernel for one) fails here until it has a case above."""
    covered = {case.op for case in CASES} | {"moe_gather"}  # moe_gather: inside moe_dispatch
    backward_ops = {op for op in backends._impls if op.endswith(("_backward", "_weight_grad"))}
    with_triton = {op for op in backends._impls if "triton" in backends.implementations(op)} - backward_ops
    assert with_triton <= covered, f"ops with a Triton kernel and no device case: {sorted(with_triton - covered)}"

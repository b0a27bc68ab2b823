"""Every op's Triton kernels on one device's tensors, against the reference backend on that device:
the cases each family declares (``DEVICE_CASES`` in ``tests/families``).

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

import os

import pytest
import torch

import families
from families import CUDA, DEVICE, DeviceCase
from harness import assert_close, require_backend
from torch_kernels import backends
from torch_kernels.selftest import TOLERANCES

# Unset, on CPU, the comparisons would repeat the families' interpreter tests in the main run;
# benchmarks/gpu.sh sets it (its dry run, in tests/test_gpu_script.py, to cpu).
device_chosen = pytest.mark.skipif("TORCH_KERNELS_TEST_DEVICE" not in os.environ,
                                   reason="TORCH_KERNELS_TEST_DEVICE unset: on CPU the families' own tests cover this")
DTYPES = (torch.float32, torch.float16, torch.bfloat16) if CUDA else (torch.float32,)
CASES = [case for module in families.modules().values() for case in getattr(module, "DEVICE_CASES", ())]


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

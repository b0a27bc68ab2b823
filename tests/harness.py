"""The shared test harness every op family uses.

- ``backend_params(op)``: one pytest param per backend with a kernel for ``op``. A backend that
  cannot run here is skipped with its reason, unless TORCH_KERNELS_REQUIRE_ALL_BACKENDS=1 (CI sets
  it), where that is a failure: CI must exercise every backend.
- ``assert_close``: dtype-keyed relative tolerances against a float32/float64 truth.
- ``run_opcheck``, ``compiled_fullgraph``, ``assert_compiled_matches_eager``, ``profiled_names``,
  ``counted_flops``: the op contract's checks (opcheck, torch.compile with no graph break, profiler
  names, FLOP formulas).
- ``tiny_llama``: a small random model for the serving loop.
- ``run_isolated``: code that changes process-wide state (torchax) runs in a process of its own.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from torch_kernels import backends
from torch_kernels.selftest import TOLERANCES, relative_error

REQUIRE_ALL = os.environ.get("TORCH_KERNELS_REQUIRE_ALL_BACKENDS") == "1"


def require_backend(name: str) -> None:
    reason = backends.unavailable_reason(name)
    if reason is None:
        return
    if REQUIRE_ALL:
        pytest.fail(f"backend {name} must run here but is unavailable: {reason}")
    pytest.skip(f"backend {name} unavailable here: {reason}")


def backend_params(op: str, exclude=()):
    return [pytest.param(b, id=b) for b in backends.implementations(op) if b not in exclude]


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0, what: str = "") -> None:
    """Within the tolerance for inputs of ``dtype``: max |out - expected| / max |expected|, and
    element by element relative to |expected| (floored at 1% of the largest, so that small
    values are held to account without demanding more than the dtype gives near zero)."""
    assert out.shape == expected.shape, f"{what}: shape {tuple(out.shape)} != {tuple(expected.shape)}"
    if not expected.numel():
        return
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = relative_error(out, expected)
    tol = TOLERANCES[dtype][0] * scale
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.1e} for {dtype}"
    if expected.numel():
        floor = 0.01 * expected.abs().max()
        worst = ((out.to(expected.dtype) - expected).abs() / (expected.abs() + floor).clamp_min(1e-30)).max().item()
        assert worst <= tol, f"{what}: element-wise relative error {worst:.3e} > {tol:.1e} for {dtype}"


def run_opcheck(op, args, kwargs=None) -> None:
    torch.library.opcheck(op, args, kwargs or {})


def compiled_fullgraph(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="inductor")


def assert_compiled_matches_eager(module: torch.nn.Module, x: torch.Tensor) -> None:
    """``module`` compiled with ``fullgraph=True`` gives eager's output and gradients (of x and of
    every parameter) for the loss ``sum(out^2)``."""
    eager_x, compiled_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    eager = module(eager_x)
    eager.square().sum().backward()
    eager_grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    compiled = compiled_fullgraph(module)(compiled_x)
    compiled.square().sum().backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(compiled_x.grad, eager_x.grad, rtol=1e-4, atol=1e-5)
    for (name, p), want in zip(module.named_parameters(), eager_grads):
        torch.testing.assert_close(p.grad, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def tiny_llama():
    """A one-layer random Llama (vocabulary 97, hidden 32, GQA 2:1) for serving-loop tests."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def profiled_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()]


def counted_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def run_isolated(code: str) -> str:
    """Run ``code`` in a fresh Python process (with the project and tests importable); its stdout."""
    tests = pathlib.Path(__file__).resolve().parent
    path = os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tests.parent, env={**os.environ, "PYTHONPATH": path}, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout

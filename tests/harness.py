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
- ``assert_lowers_for_tpu``, ``assert_compiles_for_tpu_generations``: a Pallas kernel through
  Mosaic's TPU lowering, and through the TPU compiler ahead of time (with libtpu), on this CPU.
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


def backend_params(op: str, exclude=(), skip: dict[str, str] | None = None):
    """``op``'s backends as parameters, less ``exclude`` (backends the test does not concern, such
    as the reference it compares against); each of ``skip`` (``{backend: reason}``) stays a
    parameter that skips with its reason, so a backend left out for time shows in the report."""
    skip = skip or {}
    return [pytest.param(b, id=b, marks=[pytest.mark.skip(reason=skip[b])] if b in skip else [])
            for b in backends.implementations(op) if b not in exclude]


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


FUZZ_SCALE = int(os.environ.get("TORCH_KERNELS_FUZZ_EXAMPLES", "1"))
# Pallas compiles every new shape (seconds each in interpret mode), the Triton interpreter is slow.
FUZZ_EXAMPLES = {"reference": 40, "triton": 8, "pallas": 4, "sycl": 12}


def fuzz_settings(backend: str):
    """Hypothesis settings of the families' randomized tests (``tests/test_<family>_fuzz.py``) on
    ``backend``: few examples in CI (the interpreters are slow), ``TORCH_KERNELS_FUZZ_EXAMPLES=N``
    times more for a longer hunt; derandomized, so a CI failure reproduces; shrinking on the
    reference only."""
    from hypothesis import HealthCheck, Phase, settings

    return settings(max_examples=FUZZ_EXAMPLES[backend] * FUZZ_SCALE, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink) if backend == "reference"
                    else (Phase.explicit, Phase.generate),
                    suppress_health_check=list(HealthCheck))


FLOAT32_BYTES = 4


def profiled(fn, **kwargs):
    """(the profile, fn's result) of ``fn`` run inside ``torch_kernels.profile`` (no calibration)."""
    import torch_kernels

    with torch_kernels.profile(calibrate=False, **kwargs) as prof:
        out = fn()
    return prof, out


def only_row(prof, op: str) -> dict:
    """The one row of ``op`` in a profile."""
    rows = [r for r in prof.rows if r["op"] == op]
    assert len(rows) == 1, f"{op}: {prof.rows}"
    return rows[0]


def nbytes(*tensors) -> int:
    """Bytes of the tensors (None counts nothing)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def random_tensor(*shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    """A standard normal tensor of ``shape`` from generator seed ``seed``, in ``dtype``."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_lowers_for_tpu(fn, args) -> None:
    """``fn`` exports for TPU through Mosaic's lowering on this CPU, which enforces the TPU
    block-shape rules; ``args`` are arrays or ``jax.ShapeDtypeStruct``s."""
    import jax

    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
    assert "tpu_custom_call" in exported.mlir_module()


TPU_GENERATIONS = ("v5e:2x2", "v6e:2x2", "v5p:2x2x1")

# {module}._lowerings(): {name: (function, its argument shapes)}
_TPU_COMPILE_CHECK = """
import jax
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding
from {module} import _lowerings

cases = _lowerings()
for generation in {generations!r}:
    sharding = SingleDeviceSharding(topologies.get_topology_desc(platform="tpu", topology_name=generation).devices[0])
    for name in {names!r} or cases:
        fn, shapes = cases[name]
        args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) for s in shapes]
        jax.jit(fn).trace(*args).lower().compile()
    print(generation, "compiled")
"""


def assert_compiles_for_tpu_generations(monkeypatch, module: str, names=()) -> None:
    """The lowerings of test module ``module`` (its ``_lowerings()``; only ``names`` when given) through
    Mosaic and the TPU compiler ahead of time for each of TPU_GENERATIONS, no TPU needed: they reject
    what the export lets through (float16 vectors, unaligned slices). Needs libtpu, which the project
    does not install: set TORCH_KERNELS_LIBTPU to a folder holding it (for example
    ``pip install --no-deps --target DIR libtpu``); skipped otherwise."""
    folder = os.environ.get("TORCH_KERNELS_LIBTPU")
    if not folder:
        pytest.skip("set TORCH_KERNELS_LIBTPU to a folder with libtpu installed to compile for real TPUs")
    monkeypatch.setenv("PYTHONPATH", folder)
    for name, value in (("TPU_ACCELERATOR_TYPE", "v5litepod-4"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                        ("TPU_SKIP_MDS_QUERY", "1")):
        monkeypatch.setenv(name, value)
    out = run_isolated(_TPU_COMPILE_CHECK.format(module=module, generations=TPU_GENERATIONS, names=tuple(names)))
    assert out.count("compiled") == len(TPU_GENERATIONS), out


# ---- host reads: what the deferred check mode must never do ----

_PROJECT = tuple(str(pathlib.Path(__file__).resolve().parent.parent / p) + os.sep
                 for p in ("torch_kernels", "triton_impl", "jax_impl", "oneapi_impl"))
# Tensor methods and torch functions that bring tensor data to the host (on an accelerator, a
# synchronisation): read when called, or, for __getitem__, with a boolean mask (a data-dependent shape)
_READING_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu",
                    "equal", "unique", "unique_consecutive", "masked_select", "nonzero_static")
_READING_FUNCTIONS = ("equal", "nonzero", "unique", "unique_consecutive", "masked_select", "argwhere")


class HostReads:
    """Within ``with HostReads() as reads:``, every call that reads tensor data on the host made
    directly from the project's own code (its four packages) is counted in ``reads`` by
    ``file:line method``; reads made inside torch, triton or jax (a kernel launch) are not."""

    def __init__(self):
        self.reads: dict[str, int] = {}
        self._saved: list[tuple[object, str, object]] = []

    def _count(self, name: str) -> None:
        frame = sys._getframe(2)
        if frame.f_code.co_filename.startswith(_PROJECT):
            where = f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno} {name}"
            self.reads[where] = self.reads.get(where, 0) + 1

    def _wrap(self, owner, name: str, reads=lambda *args: True) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))

        def counted(*args, **kwargs):
            if reads(*args):
                self._count(name)
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    def __enter__(self):
        for name in _READING_METHODS:
            self._wrap(torch.Tensor, name)
        for name in _READING_FUNCTIONS:
            self._wrap(torch, name)
        self._wrap(torch.Tensor, "__getitem__",
                   lambda t, index, *rest: any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                               for i in (index if isinstance(index, tuple) else (index,))))
        self._wrap(torch, "repeat_interleave", lambda *args: len(args) > 1 and isinstance(args[1], torch.Tensor))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)

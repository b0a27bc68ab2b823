"""The self-test: each op on random inputs against its readable definition.

Each family declares its cases (``selftest_cases()`` in ``torch_kernels/ops/<family>.py``, found
through :mod:`torch_kernels.families`); the doctor runs them on every available backend, families
in name order; the tests use the same input makers and more.
"""

from __future__ import annotations

import time

import torch

from . import backends, families
from .families import Case

# dtype -> (rtol, atol) against the float32/float64 definition; low precision covers the
# whitening GEMM multiplied in x's own precision.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}

def __getattr__(name: str):
    """``CASES``: every family's cases, found now (a family registered later is included)."""
    if name == "CASES":
        return families.selftest_cases()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """max |out - expected| over max |expected| (0 when both vanish)."""
    scale = expected.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return ((out.to(expected.dtype) - expected).abs().max() / scale).item()


def check(case: Case, backend: str, dtype: torch.dtype, device: str = "cpu", seed: int = 0, repeats: int = 3):
    """Run ``case`` on ``backend``; returns (relative error, tolerance, seconds per call)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = case.make_inputs(gen, dtype, device)
    expected = case.definition(*inputs)
    out = case.run(*inputs, implementation=backend)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        case.run(*inputs, implementation=backend)
    sync()
    seconds = (time.perf_counter() - start) / max(repeats, 1)
    return relative_error(out, expected), TOLERANCES[dtype][0], seconds


# the backends whose kernels take a device's own tensors (pallas takes torchax tensors, sycl XPU ones)
DEVICE_BACKENDS = {"cuda": ("reference", "triton")}


def doctor(dtypes=(torch.float32, torch.float16, torch.bfloat16), print_fn=print, device: str = "cpu",
           backend_names=None, family_names=None) -> bool:
    """Print which backends run here and every op on each against its definition; True if all pass.

    ``device``: where the inputs live (``"cuda"`` runs the compiled Triton kernels and the reference
    on the GPU); ``backend_names``: only these backends (default: every one that takes that
    device's tensors); ``family_names``: only these families' ops (default: every family's).
    """
    print_fn(f"torch {torch.__version__}; device {device}; backends:")
    reasons = dict(backends.unavailable_reasons())
    for name in reasons:
        if backend_names is not None and name not in backend_names:
            reasons[name] = reasons[name] or "not selected"
        elif device in DEVICE_BACKENDS and name not in DEVICE_BACKENDS[device]:
            reasons[name] = reasons[name] or f"its kernels do not take {device} tensors"
    for name, reason in reasons.items():
        print_fn(f"  {name:<10} {'available' if reason is None else 'unavailable: ' + reason}")
    print_fn("")
    header = f"{'op':<32} {'backend':<10} {'device':<7} {'dtype':<9} {'max rel err':>12} {'tol':>8} {'result':<6} {'time/call':>11}"
    print_fn(header)
    print_fn("-" * len(header))
    all_pass = True
    for case in families.selftest_cases(family_names):
        for backend in backends.implementations(case.op):
            if reasons[backend] is not None:
                continue
            for dtype in dtypes:
                try:
                    err, tol, seconds = check(case, backend, dtype, device)
                    ok = err <= tol
                    row = f"{err:>12.2e} {tol:>8.0e} {'pass' if ok else 'FAIL':<6} {seconds * 1e3:>9.2f}ms"
                except Exception as e:  # the doctor reports every failure and carries on
                    ok = False
                    row = f"{'error':>12} {'':>8} {'FAIL':<6} {type(e).__name__}: {e}"
                all_pass &= ok
                print_fn(f"{case.op:<32} {backend:<10} {device:<7} {str(dtype).removeprefix('torch.'):<9} {row}")
    print_fn("")
    print_fn("all passed" if all_pass else "SOME CHECKS FAILED")
    return all_pass

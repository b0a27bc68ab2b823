"""Self-test cases: each op on random inputs against its readable definition.

The doctor runs them on every available backend; the tests use the same cases and more.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from . import backends
from .ops import ood as ood_ops
from .reference import ood as ood_reference

# dtype -> (rtol, atol) against the float32/float64 definition; low precision covers the
# whitening GEMM multiplied in x's own precision.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    make_inputs: Callable[[torch.Generator, torch.dtype, str], tuple]
    run: Callable[..., torch.Tensor]  # (inputs..., implementation=) -> output
    definition: Callable[..., torch.Tensor]


def mahalanobis_inputs(gen, dtype, device, b=257, d=127, c=3):
    """Features around class means, and a whitener of a well-conditioned covariance."""
    means = torch.randn(c, d, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, c, (b,), generator=gen)
    x = means[labels] + torch.randn(b, d, generator=gen, dtype=torch.float64)
    factor = torch.randn(d, d, generator=gen, dtype=torch.float64) / d**0.5 + torch.eye(d, dtype=torch.float64)
    whitener = torch.linalg.qr(factor).R.T.contiguous() if d > 1 else factor
    param = torch.float64 if dtype == torch.float64 else torch.float32
    return x.to(device, dtype), means.to(device, param), whitener.to(device, param)


CASES = [
    Case("mahalanobis_score", mahalanobis_inputs, ood_ops.mahalanobis_score, ood_reference.mahalanobis_score_naive),
]


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
    start = time.perf_counter()
    for _ in range(repeats):
        case.run(*inputs, implementation=backend)
    seconds = (time.perf_counter() - start) / repeats
    return relative_error(out, expected), TOLERANCES[dtype][0], seconds


def doctor(dtypes=(torch.float32, torch.float16, torch.bfloat16), print_fn=print) -> bool:
    """Print which backends run here and every op on each against its definition; True if all pass."""
    print_fn(f"torch {torch.__version__}; backends:")
    reasons = backends.unavailable_reasons()
    for name, reason in reasons.items():
        print_fn(f"  {name:<10} {'available' if reason is None else 'unavailable: ' + reason}")
    print_fn("")
    header = f"{'op':<20} {'backend':<10} {'device':<7} {'dtype':<9} {'max rel err':>12} {'tol':>8} {'result':<6} {'time/call':>11}"
    print_fn(header)
    print_fn("-" * len(header))
    all_pass = True
    for case in CASES:
        for backend in backends.implementations(case.op):
            if reasons[backend] is not None:
                continue
            for dtype in dtypes:
                try:
                    err, tol, seconds = check(case, backend, dtype)
                    ok = err <= tol
                    row = f"{err:>12.2e} {tol:>8.0e} {'pass' if ok else 'FAIL':<6} {seconds * 1e3:>9.2f}ms"
                except Exception as e:  # the doctor reports every failure and carries on
                    ok = False
                    row = f"{'error':>12} {'':>8} {'FAIL':<6} {type(e).__name__}: {e}"
                all_pass &= ok
                print_fn(f"{case.op:<20} {backend:<10} {'cpu':<7} {str(dtype).removeprefix('torch.'):<9} {row}")
    print_fn("")
    print_fn("all passed" if all_pass else "SOME CHECKS FAILED")
    return all_pass

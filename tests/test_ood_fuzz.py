"""Randomized differential test of mahalanobis_score: hypothesis draws unusual but valid inputs
and every backend must agree with the float64 definition on them.

Drawn together: one feature, one row, many classes, far-apart means. Examples per backend:
``harness.fuzz_settings``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import torch_kernels
from harness import assert_close, backend_params, fuzz_settings, require_backend
from torch_kernels.reference import ood as ood_reference


@st.composite
def ood_cases(draw):
    return dict(b=draw(st.sampled_from((0, 1, 7, 300))), d=draw(st.sampled_from((1, 3, 17, 64, 130))),
                c=draw(st.sampled_from((1, 2, 5, 150, 256))), spread=draw(st.sampled_from((0.0, 1.0, 10.0))),
                dtype=draw(st.sampled_from((torch.float32, torch.float16, torch.bfloat16))),
                nan_row=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


@pytest.mark.parametrize("backend", backend_params("mahalanobis_score"))
def test_ood_fuzz(backend):
    """Scores within the dtype's tolerance of the float64 definition; a NaN row scores NaN and
    leaves the other rows alone."""
    require_backend(backend)

    @fuzz_settings(backend)
    @given(case=ood_cases())
    def check(case):
        gen = torch.Generator().manual_seed(case["seed"])
        b, d, c = case["b"], case["d"], case["c"]
        means = case["spread"] * torch.randn(c, d, generator=gen)
        whitener = torch.eye(d) + 0.1 * torch.randn(d, d, generator=gen).triu()
        x = means[torch.randint(0, c, (b,), generator=gen)] + torch.randn(b, d, generator=gen)
        if case["nan_row"] and b:
            x[b // 2, 0] = math.nan
        x = x.to(case["dtype"])
        params = case["dtype"] if case["dtype"] != torch.bfloat16 else torch.float32
        got = torch_kernels.mahalanobis_score(x, means.to(params), whitener.to(params), implementation=backend)
        want = ood_reference.mahalanobis_score_naive(x.double(), means.to(params).double(), whitener.to(params).double())
        nan_rows = want.isnan()
        assert torch.equal(got.isnan(), nan_rows)
        ok = ~nan_rows
        if not ok.any():
            return
        if c == 1:
            assert_close(got[ok].double(), want[ok], case["dtype"], what="scores")
            return
        # several classes: the fused ||y||^2 - 2 y.p + ||p||^2 (README) cancels, so the error is
        # held to the size of those terms rather than to the distance left after cancelling
        w64 = whitener.to(params).double()
        terms = (x[ok].double() @ w64).square().sum(1) + (means.to(params).double() @ w64).square().sum(1).max()
        tol = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[case["dtype"]]
        error = ((got[ok].double() - want[ok]).abs() / terms.clamp_min(1e-30)).max().item()
        assert error <= tol, f"scores: error {error:.2e} of the cancelled terms > {tol:.0e}"

    check()

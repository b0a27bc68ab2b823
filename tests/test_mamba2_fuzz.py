"""Randomized differential test of mamba_chunk_scan_combined and selective_state_update:
hypothesis draws unusual but valid inputs and every backend must agree with the loops of
``torch_kernels.ops.mamba2`` (``naive_scan``, ``naive_update``) on them.

Drawn together: sequences of length 1 and lengths off every chunk, one group or one per head,
head sizes and state sizes off the kernels' blocks (1, odd, past a power of two), packed
sequences (some of length 1) by seq_idx, initial states or none, a skip per head or per
channel, the gate, dt_bias, softplus and dt limits or none; decode steps on rows of a larger
state with padding entries, expanded or full dt and A. Examples per backend:
``harness.fuzz_settings``, but a quarter of pallas's: each example compiles new shapes there
(the scan's kernels and the update's).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import torch_kernels
from harness import assert_close, backend_params, fuzz_settings, require_backend
from torch_kernels.ops.mamba2 import naive_scan, naive_update


@st.composite
def cases(draw):
    batch, length = draw(st.integers(1, 2)), draw(st.integers(1, 40))
    groups = draw(st.integers(1, 3))
    heads = groups * draw(st.integers(1, 3))
    headdim, dstate = draw(st.sampled_from((1, 3, 8, 17))), draw(st.sampled_from((1, 5, 16, 33)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    softplus = draw(st.booleans())
    dt = torch.randn(batch, length, heads, generator=gen) - (1.0 if softplus else 0.0)
    if not softplus:
        dt = dt.abs()
    D = draw(st.sampled_from((None, "head", "channel")))
    scan = dict(x=torch.randn(batch, length, heads, headdim, generator=gen), dt=dt,
                A=-torch.rand(heads, generator=gen) * 3,
                B=torch.randn(batch, length, groups, dstate, generator=gen) * dstate ** -0.5,
                C=torch.randn(batch, length, groups, dstate, generator=gen),
                D=None if D is None else torch.randn(*((heads,) if D == "head" else (heads, headdim)), generator=gen),
                z=torch.randn(batch, length, heads, headdim, generator=gen) if draw(st.booleans()) else None,
                dt_bias=torch.randn(heads, generator=gen) * 0.5 if draw(st.booleans()) else None,
                initial_states=torch.randn(batch, heads, headdim, dstate, generator=gen)
                if draw(st.booleans()) else None,
                seq_idx=torch.randint(0, 4, (batch, length), generator=gen, dtype=torch.int32).sort(-1).values
                if draw(st.booleans()) else None)
    limit = draw(st.sampled_from(((0.0, float("inf")), (0.1, 1.5))))
    rows = batch + draw(st.integers(0, 3))
    indices = torch.randperm(rows, generator=gen)[:batch].to(torch.int32)
    if draw(st.booleans()):
        indices[draw(st.integers(0, batch - 1))] = -1
    full = draw(st.booleans())
    step = torch.randn(batch, heads, headdim if full else 1, generator=gen)
    decay = -torch.rand(heads, headdim if full else 1, dstate if full else 1, generator=gen) * 3
    update = dict(state=torch.randn(rows, heads, headdim, dstate, generator=gen),
                  x=torch.randn(batch, heads, headdim, generator=gen),
                  dt=step.expand(batch, heads, headdim), A=decay.expand(heads, headdim, dstate),
                  B=torch.randn(batch, groups, dstate, generator=gen) * dstate ** -0.5,
                  C=torch.randn(batch, groups, dstate, generator=gen),
                  D=torch.randn(heads, headdim, generator=gen) if D else None,
                  z=scan["z"][:, 0] if scan["z"] is not None else None,
                  dt_bias=torch.randn(heads, headdim, generator=gen) if scan["dt_bias"] is not None else None,
                  state_batch_indices=indices)
    return scan, dict(dt_softplus=softplus, dt_limit=limit), update


@pytest.mark.parametrize("backend", backend_params("selective_state_update"))
def test_both_ops_match_the_definition_on_drawn_inputs(backend):
    require_backend(backend)
    chosen = fuzz_settings(backend)
    if backend == "pallas":
        chosen = settings(chosen, max_examples=max(1, chosen.max_examples // 4))

    @chosen
    @given(cases())
    def check(case):
        scan, options, update = case
        y, final = torch_kernels.mamba_chunk_scan_combined(**scan, chunk_size=16, return_final_states=True,
                                                           implementation=backend, **options)
        want_y, want_final = naive_scan(**scan, **options)
        assert_close(y, want_y, torch.float32, what="y")
        assert_close(final, want_final, torch.float32, what="final states")  # with seq_idx: the last sequence's
        state = update["state"].clone()
        out = torch_kernels.selective_state_update(**{**update, "state": state}, dt_softplus=True,
                                                   implementation=backend)
        want_out, want_state = naive_update(**update, dt_softplus=True)
        assert_close(out, want_out, torch.float32, what="update out")
        assert_close(state, want_state, torch.float32, what="state")

    check()

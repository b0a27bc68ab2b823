"""Randomized differential test of causal_conv1d_fn and causal_conv1d_update: hypothesis draws
unusual but valid inputs and every backend must agree with the loops over time of
tests/test_causal_conv1d.py on them.

Drawn together: widths 2..8, sequences shorter than the filter (T = 1), channel counts off every
block size, packed sequences of length 1, initial states or none, no bias, SiLU or none; decode
steps of 1..9 inputs into states as short as ``W - 1`` or longer, the shift and ring forms (ring
lengths far past the state length), rows picked from a larger state with padding entries.
Examples per backend: ``harness.fuzz_settings``, but half of pallas's: each example compiles two
new shapes there (seconds each in interpret mode).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import torch_kernels
from harness import assert_close, backend_params, fuzz_settings, require_backend
from test_causal_conv1d import naive_conv, naive_update


@st.composite
def conv_cases(draw):
    batch, dim = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    length, width = draw(st.integers(1, 70)), draw(st.integers(2, 8))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mode = draw(st.sampled_from(("h0", "seq_idx", "none")))
    x = torch.randn(batch, dim, length, generator=gen)
    weight = torch.randn(dim, width, generator=gen) * width ** -0.5
    bias = torch.randn(dim, generator=gen) if draw(st.booleans()) else None
    h0 = torch.randn(batch, dim, width - 1, generator=gen) if mode == "h0" else None
    seq_idx = None
    if mode == "seq_idx":  # sorted ids: runs of a sequence, some of length 1
        seq_idx = torch.randint(0, 4, (batch, length), generator=gen, dtype=torch.int32).sort(-1).values
    silu = draw(st.booleans())
    steps, state_len = draw(st.integers(1, 9)), width - 1 + draw(st.integers(0, 4))
    lines = batch + draw(st.integers(0, 3))
    rows = torch.randperm(lines, generator=gen)[:batch].to(torch.int32)
    if draw(st.booleans()):
        rows[draw(st.integers(0, batch - 1))] = -1
    update = dict(x=torch.randn(batch, dim, steps, generator=gen),
                  conv_state=torch.randn(lines, dim, state_len, generator=gen), weight=weight, bias=bias,
                  activation="silu" if silu else None, conv_state_indices=rows,
                  cache_seqlens=torch.randint(0, 50, (batch,), generator=gen, dtype=torch.int32)
                  if draw(st.booleans()) else None)
    return dict(x=x, weight=weight, bias=bias, seq_idx=seq_idx, initial_states=h0,
                activation="silu" if silu else None), update


@pytest.mark.parametrize("backend", backend_params("causal_conv1d_fn"))
def test_both_ops_match_the_definition_on_drawn_inputs(backend):
    require_backend(backend)

    chosen = fuzz_settings(backend)
    if backend == "pallas":
        chosen = settings(chosen, max_examples=max(1, chosen.max_examples // 2))

    @chosen
    @given(conv_cases())
    def check(case):
        conv, update = case
        out = torch_kernels.causal_conv1d_fn(**conv, implementation=backend)
        want = naive_conv(conv["x"], conv["weight"], conv["bias"], conv["seq_idx"], conv["initial_states"],
                          silu=conv["activation"] is not None)
        assert_close(out, want, torch.float32, what="causal_conv1d_fn")
        state = update["conv_state"].clone()
        got = torch_kernels.causal_conv1d_update(**{**update, "conv_state": state}, implementation=backend)
        want_out, want_state = naive_update(update["x"], update["conv_state"], update["weight"], update["bias"],
                                            update["activation"] is not None, update["cache_seqlens"],
                                            update["conv_state_indices"])
        assert_close(got, want_out, torch.float32, what="causal_conv1d_update")
        assert torch.equal(state, want_state.float())

    check()

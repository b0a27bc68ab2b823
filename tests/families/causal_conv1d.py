"""causal_conv1d's bad-input rows (causal_conv1d_fn, causal_conv1d_update) and device cases.

An update that raises must also leave conv_state as it was (an ``AssertionError`` then replaces
the expected error). In the deferred check mode a bad value does not make the call raise, and
the good entries' rows are written (tests/test_causal_conv1d.py checks which).
"""

from __future__ import annotations

from typing import Callable

import torch

import torch_kernels
from families import LARGE, DeviceCase, K, Row, map_arg, set_arg, set_at, sized
from torch_kernels.ops import causal_conv1d as family_ops


# ---- bad inputs ----

def _fn_inputs() -> dict:
    """B = 2, D = 6, T = 5, W = 4, initial states."""
    gen = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(2, 6, 5, generator=gen), weight=torch.randn(6, 4, generator=gen),
                bias=torch.randn(6, generator=gen), initial_states=torch.randn(2, 6, 3, generator=gen),
                activation="silu")


def _update_inputs() -> dict:
    """B = 2 one-step entries on rows 3 and 0 of a 4-row ring-buffer conv_state (D = 6, S = 5)."""
    gen = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(2, 6, generator=gen), conv_state=torch.randn(4, 6, 5, generator=gen),
                weight=torch.randn(6, 4, generator=gen), bias=torch.randn(6, generator=gen), activation="silu",
                cache_seqlens=torch.tensor([7, 0], dtype=torch.int32),
                conv_state_indices=torch.tensor([3, 0], dtype=torch.int32))


def _fn(change) -> Callable[[str], object]:
    def call(backend):
        kw = _fn_inputs()
        change(kw)
        return torch_kernels.causal_conv1d_fn(**kw, implementation=backend)
    return call


def _update(change) -> Callable[[str], object]:
    def call(backend):
        kw = _update_inputs()
        change(kw)
        state = kw["conv_state"]
        before = state.clone() if isinstance(state, torch.Tensor) and state.device.type != "meta" else None
        try:
            return torch_kernels.causal_conv1d_update(**kw, implementation=backend)
        except Exception:
            if before is not None and not torch.equal(state, before):
                raise AssertionError("conv_state: a rejected call wrote to it") from None
            raise
    return call


def _packed(kw):
    kw.update(seq_idx=torch.zeros(2, 5, dtype=torch.int32))


FN = [  # (case, argument, error, change of the good call's keyword arguments)
    ("x 2-D", "x", ValueError, map_arg("x", lambda t: t[0])),
    ("x int", "x", TypeError, map_arg("x", lambda t: t.int())),
    ("x a list", "x", TypeError, map_arg("x", lambda t: t.tolist())),
    ("weight channels", "weight", ValueError, map_arg("weight", lambda t: t[:5])),
    ("weight 3-D", "weight", ValueError, map_arg("weight", lambda t: t[:, None])),
    ("width 1", "weight", ValueError, lambda kw: kw.update(weight=kw["weight"][:, :1], initial_states=None)),
    ("width 9", "weight", ValueError, lambda kw: kw.update(weight=torch.randn(6, 9), initial_states=None)),
    ("weight int", "weight", TypeError, map_arg("weight", lambda t: t.int())),
    ("bias shape", "bias", ValueError, map_arg("bias", lambda t: t[:4])),
    ("bias int", "bias", TypeError, map_arg("bias", lambda t: t.int())),
    ("initial_states width", "initial_states", ValueError, map_arg("initial_states", lambda t: t[..., :2])),
    ("initial_states batch", "initial_states", ValueError, map_arg("initial_states", lambda t: t[:1])),
    ("initial_states dtype", "initial_states", TypeError, map_arg("initial_states", lambda t: t.half())),
    ("seq_idx with initial_states", "initial_states", ValueError, _packed),
    ("seq_idx shape", "seq_idx", ValueError,
     lambda kw: kw.update(seq_idx=torch.zeros(2, 4, dtype=torch.int32), initial_states=None)),
    ("seq_idx float", "seq_idx", TypeError, lambda kw: kw.update(seq_idx=torch.zeros(2, 5), initial_states=None)),
    ("seq_idx past int32", "seq_idx", ValueError,
     lambda kw: kw.update(seq_idx=torch.tensor([[0, 0, 2 ** 32, 2 ** 32, 2 ** 32]] * 2), initial_states=None)),
    ("seq_idx with final states", "return_final_states", ValueError,
     lambda kw: (kw.update(initial_states=None, return_final_states=True), _packed(kw))),
    ("final_states_out shape", "final_states_out", ValueError, set_arg("final_states_out", torch.empty(2, 6, 4))),
    ("activation gelu", "activation", ValueError, set_arg("activation", "gelu")),
    ("activation True", "activation", TypeError, set_arg("activation", True)),
    ("weight on meta", "weight", ValueError, map_arg("weight", lambda t: t.to("meta"))),
]

UPDATE = [
    ("x 4-D", "x", ValueError, map_arg("x", lambda t: t[:, :, None, None])),
    ("x float64 state float32", "conv_state", TypeError, map_arg("x", lambda t: t.double())),
    ("x channels", "weight", ValueError, map_arg("x", lambda t: t[:, :5])),
    ("conv_state channels", "conv_state", ValueError, map_arg("conv_state", lambda t: t[:, :5])),
    ("conv_state shorter than width - 1", "conv_state", ValueError, map_arg("conv_state", lambda t: t[..., :2])),
    ("conv_state 2-D", "conv_state", ValueError, map_arg("conv_state", lambda t: t[0])),
    ("conv_state rows sharing memory", "conv_state", ValueError, map_arg("conv_state", lambda t: t[:1].expand(t.shape))),
    ("conv_state rows without indices", "conv_state", ValueError, set_arg("conv_state_indices", None)),
    ("conv_state_indices past the rows", "conv_state_indices", ValueError, set_at("conv_state_indices", 1, 4)),
    ("conv_state_indices repeated", "conv_state_indices", ValueError, set_at("conv_state_indices", 1, 3)),
    ("conv_state_indices length", "conv_state_indices", ValueError,
     set_arg("conv_state_indices", torch.tensor([3], dtype=torch.int32))),
    ("conv_state_indices float", "conv_state_indices", TypeError, map_arg("conv_state_indices", lambda t: t.float())),
    ("cache_seqlens negative", "cache_seqlens", ValueError, set_at("cache_seqlens", 0, -1)),
    # an int32 cast would wrap these into valid-looking values (a padding row into row 0)
    ("cache_seqlens past int32", "cache_seqlens", ValueError,
     set_arg("cache_seqlens", torch.tensor([2 ** 32 + 3, 0]))),
    ("conv_state_indices past int32", "conv_state_indices", ValueError,
     set_arg("conv_state_indices", torch.tensor([-2 ** 32, 0]))),
    ("cache_seqlens length", "cache_seqlens", ValueError, map_arg("cache_seqlens", lambda t: t[:1])),
    ("cache_seqlens 2-D", "cache_seqlens", ValueError, map_arg("cache_seqlens", lambda t: t[:, None])),
    ("weight width 9", "weight", ValueError, set_arg("weight", torch.randn(6, 9))),
    ("bias 2-D", "bias", ValueError, map_arg("bias", lambda t: t[None])),
    ("activation relu", "activation", ValueError, set_arg("activation", "relu")),
    ("activation a number", "activation", TypeError, set_arg("activation", 1)),
    ("conv_state a list", "conv_state", TypeError, map_arg("conv_state", lambda t: t.tolist())),
    ("cache_seqlens on meta", "cache_seqlens", ValueError, map_arg("cache_seqlens", lambda t: t.to("meta"))),
]


BAD_INPUTS = {"causal_conv1d": [Row(f"causal_conv1d_fn: {c}", a, e, _fn(ch), "causal_conv1d_fn")
                                for c, a, e, ch in FN]
              + [Row(f"causal_conv1d_update: {c}", a, e, _update(ch), "causal_conv1d_update")
                 for c, a, e, ch in UPDATE]}


# ---- device cases ----

def _fn_run(x, weight, bias, h0, implementation=None):
    return torch_kernels.causal_conv1d_fn(x, weight, bias, initial_states=h0, return_final_states=True,
                                          activation="silu", implementation=implementation)


def packed_inputs(gen, dtype, device, batch=2, dim=40, length=300, width=4):
    """x with each batch entry cut into three packed sequences by seq_idx, a float32 filter and bias."""
    x = torch.randn(batch, dim, length, generator=gen)
    weight = torch.randn(dim, width, generator=gen) * width ** -0.5
    cuts = torch.sort(torch.randint(1, length, (batch, 2), generator=gen), -1).values
    seq_idx = (torch.arange(length)[None, None, :] >= cuts[:, :, None]).sum(1).to(torch.int32)
    return x.to(device, dtype), weight.to(device), torch.randn(dim, generator=gen).to(device), seq_idx.to(device)


def _packed_run(x, weight, bias, seq_idx, implementation=None):
    return torch_kernels.causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation="silu",
                                          implementation=implementation)


def _update_run(x, conv_state, weight, bias, seqlens, rows, implementation=None):
    state = conv_state.clone()
    out = torch_kernels.causal_conv1d_update(x, state, weight, bias, "silu", seqlens, rows,
                                             implementation=implementation)
    return out, state


DEVICE_CASES = [
    DeviceCase("causal_conv1d_fn with initial states", "causal_conv1d_fn", family_ops.conv1d_inputs, _fn_run,
               grads=(0, 1, 2, 3)),
    DeviceCase("causal_conv1d_fn packed sequences", "causal_conv1d_fn", packed_inputs, _packed_run, grads=(0, 1, 2)),
    DeviceCase("causal_conv1d_update ring buffer, rows", "causal_conv1d_update", family_ops.update_inputs,
               _update_run, exact=(1,)),
    DeviceCase("causal_conv1d_fn Mamba-2 2.7B xBC, 4k tokens", "causal_conv1d_fn",
               sized(family_ops.conv1d_inputs, batch=2, dim=5120 + 2 * 128, length=4 * K), _fn_run,
               grads=(0, 1, 2, 3), **LARGE),
    DeviceCase("causal_conv1d_update Mamba-2 2.7B xBC, batch 64", "causal_conv1d_update",
               sized(family_ops.update_inputs, batch=64, dim=5120 + 2 * 128, steps=1, state_len=3, lines=80),
               _update_run, exact=(1,), **LARGE),
]

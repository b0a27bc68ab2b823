"""mamba2's bad-input rows (mamba_chunk_scan_combined, selective_state_update) and device cases.

An update that raises must also leave state as it was (an ``AssertionError`` then replaces
the expected error). In the deferred check mode a bad value does not make the call raise, and
the good entries' rows are written (tests/test_mamba2.py checks which).
"""

from __future__ import annotations

from typing import Callable

import torch

import torch_kernels
from families import LARGE, DeviceCase, K, Row, map_arg, set_arg, set_at, sized
from torch_kernels.ops import mamba2 as family_ops


# ---- bad inputs ----

def _scan_inputs() -> dict:
    """batch 2, seqlen 5, 4 heads of 3 channels, 2 groups of dstate 6, D per head, z, dt_bias, initial states."""
    gen = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(2, 5, 4, 3, generator=gen), dt=torch.randn(2, 5, 4, generator=gen),
                A=-torch.rand(4, generator=gen), B=torch.randn(2, 5, 2, 6, generator=gen),
                C=torch.randn(2, 5, 2, 6, generator=gen), chunk_size=4, D=torch.randn(4, generator=gen),
                z=torch.randn(2, 5, 4, 3, generator=gen), dt_bias=torch.randn(4, generator=gen),
                initial_states=torch.randn(2, 4, 3, 6, generator=gen), dt_softplus=True)


def _update_inputs() -> dict:
    """batch 2 on rows 3 and 0 of a 4-row state (4 heads of 3 channels, 2 groups of dstate 6),
    dt, A, D and dt_bias expanded as models pass them."""
    gen = torch.Generator().manual_seed(0)
    return dict(state=torch.randn(4, 4, 3, 6, generator=gen), x=torch.randn(2, 4, 3, generator=gen),
                dt=torch.randn(2, 4, 1, generator=gen).expand(2, 4, 3),
                A=-torch.rand(4, 1, 1, generator=gen).expand(4, 3, 6), B=torch.randn(2, 2, 6, generator=gen),
                C=torch.randn(2, 2, 6, generator=gen), D=torch.randn(4, 1, generator=gen).expand(4, 3),
                z=torch.randn(2, 4, 3, generator=gen), dt_bias=torch.randn(4, 1, generator=gen).expand(4, 3),
                dt_softplus=True, state_batch_indices=torch.tensor([3, 0], dtype=torch.int32))


def _scan(change) -> Callable[[str], object]:
    def call(backend):
        kw = _scan_inputs()
        change(kw)
        return torch_kernels.mamba_chunk_scan_combined(**kw, implementation=backend)
    return call


def _update(change) -> Callable[[str], object]:
    def call(backend):
        kw = _update_inputs()
        change(kw)
        state = kw["state"]
        before = state.clone() if isinstance(state, torch.Tensor) and state.device.type != "meta" else None
        try:
            return torch_kernels.selective_state_update(**kw, implementation=backend)
        except Exception:
            if before is not None and not torch.equal(state, before):
                raise AssertionError("state: a rejected call wrote to it") from None
            raise
    return call


def _packed(kw):
    """One batch row of packed sequences (cu_seqlens [0, 2, 5])."""
    kw.update({n: kw[n][:1] for n in ("x", "dt", "B", "C", "z")})
    kw.update(cu_seqlens=torch.tensor([0, 2, 5], dtype=torch.int32), initial_states=kw["initial_states"][:2])


SCAN = [  # (case, argument, error, change of the good call's keyword arguments)
    ("x 3-D", "x", ValueError, map_arg("x", lambda t: t[0])),
    ("x int", "x", TypeError, map_arg("x", lambda t: t.int())),
    ("x a list", "x", TypeError, map_arg("x", lambda t: t.tolist())),
    ("dt heads", "dt", ValueError, map_arg("dt", lambda t: t[..., :3])),
    ("dt 4-D", "dt", ValueError, map_arg("dt", lambda t: t[..., None])),
    ("A 2-D", "A", ValueError, map_arg("A", lambda t: t[:, None])),
    ("A heads", "A", ValueError, map_arg("A", lambda t: t[:3])),
    ("A positive", "A", ValueError, map_arg("A", lambda t: -t)),
    ("B groups not dividing heads", "B", ValueError, lambda kw: kw.update(B=torch.randn(2, 5, 3, 6),
                                                                          C=torch.randn(2, 5, 3, 6))),
    ("B seqlen", "B", ValueError, map_arg("B", lambda t: t[:, :4])),
    ("C dstate", "C", ValueError, map_arg("C", lambda t: t[..., :5])),
    ("C groups", "C", ValueError, map_arg("C", lambda t: t[:, :, :1])),
    ("C int", "C", TypeError, map_arg("C", lambda t: t.int())),
    ("D shape", "D", ValueError, set_arg("D", torch.randn(4, 2))),
    ("z shape", "z", ValueError, map_arg("z", lambda t: t[..., :2])),
    ("dt_bias 2-D", "dt_bias", ValueError, map_arg("dt_bias", lambda t: t[None])),
    ("initial_states dstate", "initial_states", ValueError, map_arg("initial_states", lambda t: t[..., :5])),
    ("initial_states batch", "initial_states", ValueError, map_arg("initial_states", lambda t: t[:1])),
    ("seq_idx shape", "seq_idx", ValueError, set_arg("seq_idx", torch.zeros(2, 4, dtype=torch.int32))),
    ("seq_idx float", "seq_idx", TypeError, set_arg("seq_idx", torch.zeros(2, 5))),
    ("cu_seqlens with batch 2", "cu_seqlens", ValueError, set_arg("cu_seqlens", torch.tensor([0, 5]))),
    ("cu_seqlens not ending at seqlen", "cu_seqlens", ValueError,
     lambda kw: (_packed(kw), kw.update(cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32)))),
    ("cu_seqlens decreasing", "cu_seqlens", ValueError,
     lambda kw: (_packed(kw), kw.update(cu_seqlens=torch.tensor([0, 3, 2, 5], dtype=torch.int32),
                                        initial_states=None))),
    ("initial_states per packed sequence", "initial_states", ValueError,
     lambda kw: (_packed(kw), kw.update(initial_states=kw["initial_states"][:1]))),
    ("chunk_size 0", "chunk_size", ValueError, set_arg("chunk_size", 0)),
    ("chunk_size a float", "chunk_size", TypeError, set_arg("chunk_size", 64.0)),
    ("dt_limit reversed", "dt_limit", ValueError, set_arg("dt_limit", (1.0, 0.5))),
    ("dt_limit negative", "dt_limit", ValueError, set_arg("dt_limit", (-1.0, 0.5))),
    ("dt_limit one number", "dt_limit", TypeError, set_arg("dt_limit", 0.5)),
    ("dt_softplus a string", "dt_softplus", TypeError, set_arg("dt_softplus", "yes")),
    ("B on meta", "B", ValueError, map_arg("B", lambda t: t.to("meta"))),
]

UPDATE = [
    ("x 4-D", "x", ValueError, map_arg("x", lambda t: t[:, :, None])),
    ("x Mamba-1's 2-D with a 4-D state", "state", ValueError, map_arg("x", lambda t: t[:, 0])),
    ("x int", "x", TypeError, map_arg("x", lambda t: t.int())),
    ("state 3-D", "state", ValueError, map_arg("state", lambda t: t[0])),
    ("state rows sharing memory", "state", ValueError, map_arg("state", lambda t: t[:1].expand(t.shape))),
    ("state dstate", "state", ValueError, map_arg("state", lambda t: t[..., :5])),
    ("state rows without indices", "state", ValueError, set_arg("state_batch_indices", None)),
    ("state a list", "state", TypeError, map_arg("state", lambda t: t.tolist())),
    ("dt shape", "dt", ValueError, map_arg("dt", lambda t: t[..., :2])),
    ("A per head", "A", ValueError, map_arg("A", lambda t: t[:, 0, 0])),
    ("B batch", "B", ValueError, map_arg("B", lambda t: t[:1])),
    ("B groups not dividing heads", "B", ValueError, lambda kw: kw.update(B=torch.randn(2, 3, 6),
                                                                          C=torch.randn(2, 3, 6))),
    ("C dstate", "C", ValueError, map_arg("C", lambda t: t[..., :4])),
    ("D shape", "D", ValueError, set_arg("D", torch.randn(4, 2))),
    ("dt_bias shape", "dt_bias", ValueError, set_arg("dt_bias", torch.randn(3))),
    ("z shape", "z", ValueError, map_arg("z", lambda t: t[:1])),
    ("dt_softplus None", "dt_softplus", TypeError, set_arg("dt_softplus", None)),
    ("state_batch_indices past the rows", "state_batch_indices", ValueError, set_at("state_batch_indices", 1, 4)),
    ("state_batch_indices repeated", "state_batch_indices", ValueError, set_at("state_batch_indices", 1, 3)),
    ("state_batch_indices length", "state_batch_indices", ValueError,
     set_arg("state_batch_indices", torch.tensor([3], dtype=torch.int32))),
    ("state_batch_indices past int32", "state_batch_indices", ValueError,  # a cast would wrap it to row 0
     set_arg("state_batch_indices", torch.tensor([-2 ** 32, 0]))),
    ("state_batch_indices float", "state_batch_indices", TypeError,
     map_arg("state_batch_indices", lambda t: t.float())),
    ("C on meta", "C", ValueError, map_arg("C", lambda t: t.to("meta"))),
]


BAD_INPUTS = {"mamba2": [Row(f"mamba_chunk_scan_combined: {c}", a, e, _scan(ch), "mamba_chunk_scan_combined")
                         for c, a, e, ch in SCAN]
              + [Row(f"selective_state_update: {c}", a, e, _update(ch), "selective_state_update")
                 for c, a, e, ch in UPDATE]}


# ---- device cases ----

def _scan_run(x, dt, A, B, C, D, z, dt_bias, h0, implementation=None):
    return torch_kernels.mamba_chunk_scan_combined(x, dt, A, B, C, 256, D, z, dt_bias, h0, dt_softplus=True,
                                                   return_final_states=True, implementation=implementation)


def _update_run(state, x, dt, A, B, C, D, z, dt_bias, rows, implementation=None):
    state = state.clone()
    out = torch_kernels.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, True, rows,
                                               implementation=implementation)
    return out, state


# Mamba-2 2.7B: 80 heads of 64 channels, one group of dstate 128
_27B = dict(heads=80, headdim=64, groups=1, dstate=128)

DEVICE_CASES = [
    DeviceCase("selective_state_update rows, padding, broadcast views", "selective_state_update",
               family_ops.update_inputs, _update_run),
    DeviceCase("mamba_chunk_scan_combined grouped, gate, initial states", "chunk_simple_gla", family_ops.scan_inputs,
               _scan_run, grads=(0, 1, 2, 3, 4, 5, 6, 7, 8)),
    DeviceCase("selective_state_update Mamba-2 2.7B, batch 64", "selective_state_update",
               sized(family_ops.update_inputs, batch=64, rows=96, **_27B), _update_run, **LARGE),
    DeviceCase("mamba_chunk_scan_combined Mamba-2 2.7B, 4k tokens", "chunk_simple_gla",
               sized(family_ops.scan_inputs, batch=1, length=4 * K, **_27B), _scan_run, grads=(0, 1, 2, 3, 4),
               **LARGE),
]

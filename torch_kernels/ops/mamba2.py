"""Mamba-2's state space duality (SSD) ops, with mamba_ssm's names, argument order, layouts and
semantics: ``mamba_chunk_scan_combined`` (a whole sequence, differentiable) and
``selective_state_update`` (one decode step, writing the state in place).

The SSD recurrence is ``chunk_simple_gla``'s: per head, with state ``S [N, P]`` (mamba's
``[P, N]`` transposed), ``S_t = exp(A dt_t) S_{t-1} + B_t (dt_t x_t)^T`` and ``y_t = S_t^T C_t``.
So ``mamba_chunk_scan_combined`` is a composite: its elementwise parts (the step size, the skip
``D x``, the gate ``silu(z)``, the group-to-head expansion of B and C) are torch expressions
around one ``chunk_simple_gla`` call, whose backends, autograd and compile support it inherits.
Packed sequences by ``seq_idx`` reset the state with a log decay of ``-inf`` where the id
changes (no host read of its own: chunk_simple_gla reads the log decays once to check them).

``selective_state_update`` is its own op with a kernel per backend: ``update(state, x, dt, A, B,
C, D, z, dt_bias, softplus, rows) -> out`` writing the used rows of ``state``; x, B, C and z
arrive contiguous, state, dt, A, D and dt_bias as the caller's (models pass dt, A, D and dt_bias
as broadcast views with stride 0), rows as int32. The math is in
``torch_kernels.reference.mamba2``.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from .. import _checks, backends
from .._library import define, register_cost, tensor_bytes
from ..families import Case
from ..reference import mamba2 as reference
from .linear_attention import chunk_simple_gla

__all__ = ["mamba_chunk_scan_combined", "selective_state_update"]

UPDATE_OP = "selective_state_update"
INDEX_DTYPES = (torch.int32, torch.int64)

backends.register(UPDATE_OP, "reference", reference.selective_state_update)
backends.register(UPDATE_OP, "triton", "triton_impl.mamba2:selective_state_update")
backends.register(UPDATE_OP, "pallas", "torch_kernels.pallas.mamba2:pallas_selective_state_update")
backends.register(UPDATE_OP, "sycl", "oneapi_impl.mamba2:selective_state_update")


# ---- checks ----

def _require_tensors(**tensors) -> None:
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def _shape(name: str, t, expected: tuple, what: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)} ({what}), got {tuple(t.shape)}")


def _check_groups(name: str, t, batch_dims: tuple, heads: int, dstate: int | None) -> int:
    """B or C ``[*batch_dims, G, N]`` with ``G`` dividing the heads; returns N."""
    _checks.tensor(name, t, ndim=len(batch_dims) + 2, dtypes=_checks.FLOAT_DTYPES)
    if tuple(t.shape[:-2]) != batch_dims:
        raise ValueError(f"{name}: expected leading sizes {batch_dims} (as x), got shape {tuple(t.shape)}")
    groups = t.shape[-2]
    if groups == 0 or heads % groups:
        raise ValueError(f"{name}: expected a number of groups dividing the {heads} heads, got shape {tuple(t.shape)}")
    if dstate is not None and t.shape[-1] != dstate:
        raise ValueError(f"{name}: expected dstate {dstate} (as B), got shape {tuple(t.shape)}")
    if t.shape[-1] == 0:
        raise ValueError(f"{name}: expected dstate >= 1, got shape {tuple(t.shape)}")
    return t.shape[-1]


def check_chunk_size(chunk_size) -> int:
    """A positive int (the result does not depend on it)."""
    if not isinstance(chunk_size, numbers.Integral) or isinstance(chunk_size, bool):
        raise TypeError(f"chunk_size: expected an int, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
    return int(chunk_size)


def check_dt_limit(dt_limit) -> tuple[float, float]:
    """``(low, high)`` numbers, ``0 <= low <= high`` (a negative step would grow the state)."""
    if not isinstance(dt_limit, (tuple, list)) or len(dt_limit) != 2 or \
            not all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in dt_limit):
        raise TypeError(f"dt_limit: expected a pair of numbers (low, high), got {dt_limit!r}")
    low, high = float(dt_limit[0]), float(dt_limit[1])
    if math.isnan(low) or math.isnan(high) or not 0.0 <= low <= high:
        raise ValueError(f"dt_limit: expected 0 <= low <= high, got {dt_limit!r}")
    return low, high


@_checks.remembers_layouts
def check_scan_inputs(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens) -> None:
    """Shapes, dtypes and devices of a ``mamba_chunk_scan_combined`` call (no data read)."""
    _checks.tensor("x", x, ndim=4, dtypes=_checks.FLOAT_DTYPES)
    batch, length, heads, headdim = x.shape
    if heads == 0 or headdim == 0:
        raise ValueError(f"x: expected nheads and headdim >= 1, got shape {tuple(x.shape)}")
    _checks.tensor("dt", dt, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    _shape("dt", dt, (batch, length, heads), "batch, seqlen, nheads of x")
    _checks.tensor("A", A, ndim=1, dtypes=_checks.FLOAT_DTYPES)
    _shape("A", A, (heads,), "nheads of x")
    dstate = _check_groups("B", B, (batch, length), heads, None)
    _check_groups("C", C, (batch, length), heads, dstate)
    if C.shape[2] != B.shape[2]:
        raise ValueError(f"C: expected {B.shape[2]} groups (as B), got shape {tuple(C.shape)}")
    if D is not None:
        _checks.tensor("D", D, dtypes=_checks.FLOAT_DTYPES)
        if tuple(D.shape) not in ((heads,), (heads, headdim)):
            raise ValueError(f"D: expected shape {(heads,)} or {(heads, headdim)}, got {tuple(D.shape)}")
    if z is not None:
        _checks.tensor("z", z, ndim=4, dtypes=_checks.FLOAT_DTYPES)
        _shape("z", z, x.shape, "as x")
    if dt_bias is not None:
        _checks.tensor("dt_bias", dt_bias, ndim=1, dtypes=_checks.FLOAT_DTYPES)
        _shape("dt_bias", dt_bias, (heads,), "nheads of x")
    if seq_idx is not None:
        _checks.tensor("seq_idx", seq_idx, ndim=2, dtypes=INDEX_DTYPES)
        _shape("seq_idx", seq_idx, (batch, length), "batch, seqlen of x")
    sequences = batch
    if cu_seqlens is not None:
        _checks.tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=INDEX_DTYPES)
        if batch != 1:
            raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got x of shape {tuple(x.shape)}")
        if cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens: expected at least two offsets [0, seqlen], got shape "
                             f"{tuple(cu_seqlens.shape)}")
        sequences = cu_seqlens.shape[0] - 1
    if initial_states is not None:
        _checks.tensor("initial_states", initial_states, ndim=4, dtypes=_checks.FLOAT_DTYPES)
        _shape("initial_states", initial_states, (sequences, heads, headdim, dstate),
               "sequences, nheads, headdim, dstate")
    present = {n: t for n, t in (("D", D), ("z", z), ("dt_bias", dt_bias), ("initial_states", initial_states),
                                 ("seq_idx", seq_idx), ("cu_seqlens", cu_seqlens)) if t is not None}
    _checks.same_device(x=x, dt=dt, A=A, B=B, C=C, **present)


def _per_channel(name: str, t, heads: int, headdim: int):
    """D or dt_bias of the update: ``[H, P]``, or ``[H]`` broadcast over the head's channels."""
    if t is None:
        return None
    _checks.tensor(name, t, dtypes=_checks.FLOAT_DTYPES)
    if tuple(t.shape) == (heads,):
        return t[:, None].expand(heads, headdim)
    if tuple(t.shape) != (heads, headdim):
        raise ValueError(f"{name}: expected shape {(heads, headdim)} (nheads, headdim of x) or {(heads,)}, "
                         f"got {tuple(t.shape)}")
    return t


@_checks.remembers_layouts
def check_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices) -> None:
    """Shapes, dtypes and devices of a ``selective_state_update`` call (no data read); D and
    dt_bias as ``[H, P]``."""
    _checks.tensor("x", x, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    batch, heads, headdim = x.shape
    if heads == 0 or headdim == 0:
        raise ValueError(f"x: expected nheads and headdim >= 1, got shape {tuple(x.shape)}")
    _checks.tensor("state", state, ndim=4, dtypes=_checks.FLOAT_DTYPES)
    _checks.written_in_place("state", state)
    dstate = _check_groups("B", B, (batch,), heads, None)
    _check_groups("C", C, (batch,), heads, dstate)
    if C.shape[1] != B.shape[1]:
        raise ValueError(f"C: expected {B.shape[1]} groups (as B), got shape {tuple(C.shape)}")
    if tuple(state.shape[1:]) != (heads, headdim, dstate):
        raise ValueError(f"state: expected shape [rows, {heads}, {headdim}, {dstate}] (nheads, headdim of x, "
                         f"dstate of B), got {tuple(state.shape)}")
    _checks.tensor("dt", dt, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    _shape("dt", dt, x.shape, "as x")
    _checks.tensor("A", A, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    _shape("A", A, (heads, headdim, dstate), "nheads, headdim of x, dstate of B")
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t is not None:
            _checks.tensor(name, t, ndim=2, dtypes=_checks.FLOAT_DTYPES)
            _shape(name, t, (heads, headdim), "nheads, headdim of x")
    if z is not None:
        _checks.tensor("z", z, ndim=3, dtypes=_checks.FLOAT_DTYPES)
        _shape("z", z, x.shape, "as x")
    if state_batch_indices is None:
        _checks.size("state", 0, state.shape[0], batch, "batch of x, without state_batch_indices")
    else:
        _checks.tensor("state_batch_indices", state_batch_indices, ndim=1, dtypes=INDEX_DTYPES)
        _checks.size("state_batch_indices", 0, state_batch_indices.shape[0], batch, "batch of x")
    present = {n: t for n, t in (("D", D), ("z", z), ("dt_bias", dt_bias),
                                 ("state_batch_indices", state_batch_indices)) if t is not None}
    _checks.same_device(state=state, x=x, dt=dt, A=A, B=B, C=C, **present)


def check_update_values(state, state_batch_indices, checks: _checks.ValueChecks | None = None) -> tuple:
    """Rows below the state's and each at most once (negative: padding). Returns
    ``(state_batch_indices, bad_entries)``: as given in full mode (``bad_entries`` None); in
    deferred mode a row past the state's becomes padding and ``bad_entries`` ``[batch]`` marks the
    entries whose output must be NaN (an int64 row below int32's range too, which the kernel's
    int32 cast saturates to padding). Without ``checks``, checks fully now."""
    if state_batch_indices is None:
        return None, None
    own = checks is None
    checks = checks or _checks.ValueChecks(state.device, "full")
    checked = _checks.state_rows("state_batch_indices", state_batch_indices, "state", state.shape[0], checks)
    if own:
        checks.finish()
    return checked


# ---- selective_state_update ----

def _device_type(t: torch.Tensor) -> str:
    return "cpu" if t.is_cpu else t.device.type


def _contiguous(t):
    return None if t is None else t.contiguous()


def _update_kernel(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None,
                   implementation=None):
    check_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    checks = _checks.ValueChecks(x.device, backend=backends.planned(UPDATE_OP, _device_type(x), implementation))
    rows, bad_entries = check_update_values(state, state_batch_indices, checks)
    rows = _checks.int32_values("state_batch_indices", rows, checks)
    checks.finish()
    if x.numel() == 0:  # no entry, head or channel: the state stays as it is, on every backend alike
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    out = backends.dispatch(UPDATE_OP, _device_type(x), implementation, state, x.contiguous(), dt, A,
                            B.contiguous(), C.contiguous(), D, _contiguous(z), dt_bias, bool(dt_softplus), rows)
    if bad_entries is not None:
        out = out.masked_fill(bad_entries[:, None, None], torch.nan)
    return out.contiguous()


def _update_fake(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None,
                 implementation=None):
    check_update_inputs(state, x, dt, A, B, C, D, z, dt_bias, state_batch_indices)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


selective_state_update_op = define(
    "selective_state_update(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D=None, "
    "Tensor? z=None, Tensor? dt_bias=None, bool dt_softplus=False, Tensor? state_batch_indices=None, "
    "str? implementation=None) -> Tensor",
    _update_kernel, _update_fake)


def _update_flops(a, out) -> int:
    """Per state entry: the decay and the input (two multiply-adds), and the read-out (one)."""
    return 6 * a.state[0].numel() * a.x.shape[0]


def _update_bytes(a, out) -> int:
    """The inputs and out once, and per entry its state row read and written; broadcast views
    count their stored elements."""
    row = a.state[0].numel() * a.state.element_size()
    return tensor_bytes(a.x, a.B, a.C, a.z, a.state_batch_indices, out) + 2 * a.x.shape[0] * row \
        + sum(_stored_bytes(t) for t in (a.dt, a.A, a.D, a.dt_bias))


def _stored_bytes(t) -> int:
    """The bytes of ``t``'s distinct elements (a broadcast dimension, stride 0, counts once)."""
    if t is None:
        return 0
    return math.prod(n for n, s in zip(t.shape, t.stride()) if s != 0) * t.element_size()


register_cost(selective_state_update_op, flops=_update_flops, bytes=_update_bytes)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, implementation=None):
    """One Mamba-2 decode step, as mamba_ssm's ``selective_state_update``: the state decays and
    takes the new input, in place, and is read out. Inference-only.

    Entry ``b`` uses state row ``r = state_batch_indices[b]`` (or ``b``); head ``h`` reads group
    ``h // (nheads / ngroups)`` of B and C. With ``d = dt[b, h, p] + dt_bias[h, p]`` (softplus of
    it with ``dt_softplus``)::

        state[r, h, p, :] = exp(d * A[h, p, :]) * state[r, h, p, :] + d * x[b, h, p] * B[b, g, :]
        out[b, h, p] = sum_n state[r, h, p, n] * C[b, g, n] + D[h, p] * x[b, h, p]   (* silu(z[b, h, p]))

    Arithmetic in float32 (float64 for float64 x); out reads the new state before it is rounded
    to the state's dtype. No ``dt_limit`` clamp (as upstream's decode step). Mamba-1's form, as
    upstream: ``state [rows, dim, dstate]``, x, dt and z ``[batch, dim]``, ``A [dim, dstate]``,
    B and C ``[batch, dstate]``, D and dt_bias ``[dim]`` (one head of ``dim`` channels).

    Args:
        state: ``[rows, nheads, headdim, dstate]``, any float dtype and strides (a view into a
            larger cache works: only the rows used change).
        x: ``[batch, nheads, headdim]``.
        dt: ``[batch, nheads, headdim]`` (models pass ``dt[:, :, None].expand(...)``, stride 0).
        A: ``[nheads, headdim, dstate]`` (models pass an expanded ``[nheads]``).
        B, C: ``[batch, ngroups, dstate]``, ``nheads % ngroups == 0``.
        D: ``[nheads, headdim]`` (or ``[nheads]``) skip, or None.
        z: like x, the gate, or None.
        dt_bias: ``[nheads, headdim]`` (or ``[nheads]``), or None.
        dt_softplus: softplus of ``dt + dt_bias``.
        state_batch_indices: int ``[batch]``, each entry's state row (continuous batching); each
            row at most once, rows below state's; a negative row marks a padding entry (out
            zeros, no row read or written).
        implementation: a backend name or ordered list (see ``torch_kernels.backends``).

    Returns:
        out ``[batch, nheads, headdim]`` in x's dtype.

    In the deferred check mode (``torch_kernels.checks``) bad rows are recorded, not raised: an
    entry whose row is past the state's is skipped as padding and its output is NaN; a repeated
    row is only recorded.
    """
    _require_tensors(state=state, x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias,
                     state_batch_indices=state_batch_indices)
    if not isinstance(dt_softplus, bool):
        raise TypeError(f"dt_softplus: expected a bool, got {type(dt_softplus).__name__}")
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES)
    if x.dim() == 2:  # Mamba-1's form: one head of all channels (views, so state is still written in place)
        if state.dim() != 3:
            raise ValueError(f"state: expected [rows, dim, dstate] with x [batch, dim], got shape {tuple(state.shape)}")
        state, x, dt, B, C = (t.unsqueeze(1) if t.dim() >= 1 else t for t in (state, x, dt, B, C))
        A = A.unsqueeze(0) if A.dim() >= 1 else A
        D = None if D is None else D.unsqueeze(0)
        dt_bias = None if dt_bias is None else dt_bias.unsqueeze(0)
        z = None if z is None else z.unsqueeze(1)
        return selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                                      implementation).squeeze(1)
    if x.dim() != 3:
        raise ValueError(f"x: expected [batch, nheads, headdim] (or Mamba-1's [batch, dim]), got shape {tuple(x.shape)}")
    heads, headdim = x.shape[1:]
    D, dt_bias = _per_channel("D", D, heads, headdim), _per_channel("dt_bias", dt_bias, heads, headdim)
    return selective_state_update_op(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                                     backends.implementation_arg(implementation))


# ---- mamba_chunk_scan_combined ----

def _boundaries(seq_idx) -> torch.Tensor:
    """True at each step whose sequence id differs from the step before's."""
    changed = torch.zeros(seq_idx.shape, dtype=torch.bool, device=seq_idx.device)
    changed[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    return changed


def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False, implementation=None):
    """Mamba-2's SSD scan over whole sequences, as mamba_ssm's ``mamba_chunk_scan_combined``.

    Per batch entry and head ``h`` (group ``g = h // (nheads / ngroups)`` of B and C), with the
    step ``d_t = clamp(softplus?(dt_t + dt_bias), *dt_limit)`` and the state ``h_t [headdim,
    dstate]`` starting from ``initial_states`` (or zeros)::

        h_t = exp(A d_t) h_{t-1} + d_t x_t B_t^T
        y_t = h_t C_t + D x_t,   then   y_t *= silu(z_t)

    A composite of torch expressions around one ``chunk_simple_gla`` call (its backend, chunking,
    autograd and compile support); ``chunk_size`` is validated, and the result does not depend on
    it (the backend chooses its own chunking). Arithmetic in float32 (float64 for float64 x):
    16-bit x, B and C enter the scan in their dtype, everything else in float32.

    Args:
        x: ``[batch, seqlen, nheads, headdim]``.
        dt: ``[batch, seqlen, nheads]`` step sizes (before dt_bias and softplus).
        A: ``[nheads]``, ``<= 0`` (models: ``-exp(A_log)``); ``A * d_t <= 0`` is checked (in the
            full check mode, one host read), since the state may not grow.
        B, C: ``[batch, seqlen, ngroups, dstate]``, ``nheads % ngroups == 0``.
        chunk_size: a positive int (mamba's kernels' block length; no effect on the result).
        D: ``[nheads]`` or ``[nheads, headdim]`` skip, or None.
        z: like x, the gate, or None.
        dt_bias: ``[nheads]`` or None.
        initial_states: ``[sequences, nheads, headdim, dstate]`` (sequences: batch, or the number
            of packed sequences with cu_seqlens), or None for zeros.
        seq_idx: int ``[batch, seqlen]`` sequence ids of packed sequences: the state restarts from
            zero where the id changes (initial states apply to each row's first sequence).
        cu_seqlens: int ``[sequences + 1]`` offsets of packed sequences along seqlen (batch 1):
            each sequence starts from its own initial state and has its own final state.
        dt_softplus: softplus of ``dt + dt_bias``.
        dt_limit: ``(low, high)``, ``0 <= low <= high``: the step is clamped to it (always, as
            transformers' fallback does; upstream skips the clamp at the default limits, which
            differs only for negative steps).
        return_final_states: also return the final states.
        implementation: a backend name or ordered list for the scan (see ``torch_kernels.backends``).

    Returns:
        y ``[batch, seqlen, nheads, headdim]`` in x's dtype, or ``(y, final_states)`` with
        ``return_final_states``: float32 (float64 for float64 x) ``[sequences, nheads, headdim,
        dstate]``. Differentiable in x, dt, A, B, C, D, z, dt_bias and initial_states.

    In the deferred check mode (``torch_kernels.checks``) a positive ``A * dt`` is recorded, not
    raised, and its head's y and final states are NaN; bad packing is as in :func:`chunk_simple_gla`.
    """
    _require_tensors(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=initial_states,
                     seq_idx=seq_idx, cu_seqlens=cu_seqlens)
    check_chunk_size(chunk_size)
    low, high = check_dt_limit(dt_limit)
    if not isinstance(dt_softplus, bool):
        raise TypeError(f"dt_softplus: expected a bool, got {type(dt_softplus).__name__}")
    check_scan_inputs(x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens)
    heads = x.shape[2]
    wide = reference.compute_dtype(x.dtype)
    scan_dtype = x.dtype if x.dtype in (torch.float16, torch.bfloat16) else wide
    # clamp_min then clamp_max: their backwards are plain selects (torchax lowers them, not clamp's)
    step = reference.step_size(dt, dt_bias, dt_softplus, wide).clamp_min(low).clamp_max(high)
    g = A.to(wide) * step
    growing_heads = _growing_heads(g, x.device)
    if growing_heads is not None:
        g = g.clamp_max(0)  # checked here, under A's name: the scan gets no positive decay to record again
    if seq_idx is not None:
        g = g.masked_fill(_boundaries(seq_idx).unsqueeze(-1), float("-inf"))
    q = reference.heads_of_groups(C.to(scan_dtype), heads)
    k = reference.heads_of_groups(B.to(scan_dtype), heads)
    v = (x.to(wide) * step.unsqueeze(-1)).to(scan_dtype)  # unsqueeze, not [..., None]: see heads_of_groups
    h0 = None if initial_states is None else initial_states.transpose(-1, -2)
    try:
        o, final = chunk_simple_gla(q, k, v, g, 1.0, h0, return_final_states, cu_seqlens, implementation)
    except ValueError as error:
        if str(error).startswith("g:"):  # the scan's log decay is A * dt: name the argument it came from
            raise ValueError("A: expected A * dt <= 0 (A <= 0: a decaying state), got a positive product") from None
        raise
    y = o.to(wide)
    if D is not None:
        y = y + (D.to(wide).unsqueeze(-1) if D.dim() == 1 else D.to(wide)) * x.to(wide)
    if z is not None:
        y = y * F.silu(z.to(wide))
    y = y.to(x.dtype)
    if growing_heads is not None:
        y = y.masked_fill(growing_heads[:, None], torch.nan)
    if not return_final_states:
        return y
    final = final.transpose(-1, -2)
    if growing_heads is not None:
        final = final.masked_fill(growing_heads[:, None, None], torch.nan)
    return y, final


def _growing_heads(g: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """In the deferred check mode, the heads ``[H]`` whose log decay ``g = A * dt`` is positive
    somewhere (recorded as a bad A); None in full mode, where the scan's own check of g finds them
    (one host read) and the error is renamed to A, and under torch.compile, where the scan's op
    checks g when it runs."""
    if torch.compiler.is_compiling():
        return None
    checks = _checks.ValueChecks(device)
    if not checks.deferred:
        return None
    positive = g > 0
    checks.add(positive, "A: expected A * dt <= 0 (A <= 0: a decaying state)")
    checks.finish()
    return positive.flatten(0, 1).any(0)


# transformers' hub kernel names these ops serve (``torch_kernels.integrations.transformers.kernelize``):
# mamba_ssm's names, argument names and layouts
TRANSFORMERS_HUB_FUNCTIONS = {"mamba_chunk_scan_combined": mamba_chunk_scan_combined,
                              "selective_state_update": selective_state_update}


# ---- self-test cases ----

def scan_inputs(gen, dtype, device, batch=2, length=37, heads=4, headdim=8, groups=2, dstate=16):
    """x, dt (pre-softplus), A < 0, B, C, D, z, dt_bias and initial states: sizes off the kernels' blocks."""
    x = torch.randn(batch, length, heads, headdim, generator=gen)
    dt = torch.randn(batch, length, heads, generator=gen) - 1.0
    A = -torch.rand(heads, generator=gen) * 2 - 0.1
    B = torch.randn(batch, length, groups, dstate, generator=gen) * dstate ** -0.5
    C = torch.randn(batch, length, groups, dstate, generator=gen)
    D = torch.randn(heads, generator=gen)
    z = torch.randn(batch, length, heads, headdim, generator=gen)
    dt_bias = torch.randn(heads, generator=gen) * 0.5
    h0 = torch.randn(batch, heads, headdim, dstate, generator=gen)
    return (x.to(device, dtype), dt.to(device), A.to(device), B.to(device, dtype), C.to(device, dtype), D.to(device),
            z.to(device, dtype), dt_bias.to(device), h0.to(device))


def naive_scan(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None, dt_softplus=False,
               dt_limit=(0.0, float("inf"))):
    """``(y, final states)`` by a loop over time and heads, from the definition, in float64
    (differentiable; ``seq_idx`` restarts the state from zero where the id changes)."""
    batch, length, heads, headdim = x.shape
    per_group = heads // B.shape[2]
    step = dt.double() + (0 if dt_bias is None else dt_bias.double())
    step = (F.softplus(step) if dt_softplus else step).clamp(*dt_limit)
    state = [[torch.zeros(headdim, B.shape[-1], dtype=torch.float64) if initial_states is None
              else initial_states[b, h].double() for h in range(heads)] for b in range(batch)]
    y = []
    for b in range(batch):
        for t in range(length):
            restart = seq_idx is not None and t > 0 and int(seq_idx[b, t]) != int(seq_idx[b, t - 1])
            for h in range(heads):
                g = h // per_group
                d = step[b, t, h]
                decay = 0.0 if restart else torch.exp(A[h].double() * d)
                state[b][h] = decay * state[b][h] + torch.outer(d * x[b, t, h].double(), B[b, t, g].double())
                y.append(state[b][h] @ C[b, t, g].double())
    y = torch.stack(y).reshape(batch, length, heads, headdim)
    if D is not None:
        y = y + (D.double()[:, None] if D.dim() == 1 else D.double()) * x.double()
    if z is not None:
        y = y * F.silu(z.double())
    return y, torch.stack([torch.stack(row) for row in state])


def _scan_run(x, dt, A, B, C, D, z, dt_bias, h0, implementation=None):
    return mamba_chunk_scan_combined(x, dt, A, B, C, 16, D, z, dt_bias, h0, dt_softplus=True,
                                     implementation=implementation)


def _scan_definition(x, dt, A, B, C, D, z, dt_bias, h0):
    return naive_scan(x, dt, A, B, C, D, z, dt_bias, h0, dt_softplus=True)[0]


def update_inputs(gen, dtype, device, batch=3, heads=4, headdim=8, groups=2, dstate=16, rows=5):
    """A decode step as models call it (dt, A, D, dt_bias expanded from per-head values), z, rows
    of a larger state with one padding entry."""
    x = torch.randn(batch, heads, headdim, generator=gen)
    dt = (torch.randn(batch, heads, 1, generator=gen) - 1.0).expand(batch, heads, headdim)
    A = (-torch.rand(heads, 1, 1, generator=gen) * 2 - 0.1).expand(heads, headdim, dstate)
    B = torch.randn(batch, groups, dstate, generator=gen) * dstate ** -0.5
    C = torch.randn(batch, groups, dstate, generator=gen)
    D = torch.randn(heads, 1, generator=gen).expand(heads, headdim)
    z = torch.randn(batch, heads, headdim, generator=gen)
    dt_bias = (torch.randn(heads, 1, generator=gen) * 0.5).expand(heads, headdim)
    state = torch.randn(rows, heads, headdim, dstate, generator=gen)
    indices = torch.randperm(rows, generator=gen)[:batch].to(torch.int32)
    indices[-1] = -1
    return (state.to(device), x.to(device, dtype), dt.to(device), A.to(device), B.to(device, dtype),
            C.to(device, dtype), D.to(device), z.to(device, dtype), dt_bias.to(device), indices.to(device))


def naive_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None):
    """``(out, new state)`` in float64, entry by entry and state entry by state entry."""
    batch, heads, headdim = x.shape
    groups, dstate = B.shape[1:]
    new = state.double().clone()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for b in range(batch):
        row = b if state_batch_indices is None else int(state_batch_indices[b])
        if row < 0:
            continue
        for h in range(heads):
            g = h // (heads // groups)
            d = dt[b, h].double() + (0 if dt_bias is None else dt_bias[h].double())
            d = F.softplus(d) if dt_softplus else d
            for n in range(dstate):
                new[row, h, :, n] = torch.exp(d * A[h, :, n].double()) * new[row, h, :, n] \
                    + d * x[b, h].double() * B[b, g, n].double()
            y = new[row, h] @ C[b, g].double()
            if D is not None:
                y = y + D[h].double() * x[b, h].double()
            if z is not None:
                y = y * F.silu(z[b, h].double())
            out[b, h] = y
    return out, new


def _update_run(state, x, dt, A, B, C, D, z, dt_bias, rows, implementation=None):
    return selective_state_update(state.clone(), x, dt, A, B, C, D, z, dt_bias, True, rows,
                                  implementation=implementation)


def _update_definition(state, x, dt, A, B, C, D, z, dt_bias, rows):
    return naive_update(state, x, dt, A, B, C, D, z, dt_bias, True, rows)[0]


def selftest_cases() -> list[Case]:
    """The doctor's checks, against loops from the definition in float64: the chunked scan with
    grouped B/C, skip, gate, dt_bias, softplus and initial states (it runs on ``chunk_simple_gla``'s
    backends), and a decode step over rows picked by state_batch_indices."""
    return [Case("chunk_simple_gla", scan_inputs, _scan_run, _scan_definition),
            Case(UPDATE_OP, update_inputs, _update_run, _update_definition)]

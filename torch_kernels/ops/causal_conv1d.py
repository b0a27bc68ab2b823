"""Causal depthwise conv1d ops: ``causal_conv1d_fn`` and ``causal_conv1d_update``, with the
causal-conv1d package's names, argument order, layouts and semantics (Mamba, Mamba-2, Qwen3-Next's
Gated DeltaNet, LFM2 and the other hybrid models call them).

``causal_conv1d_fn`` is differentiable in x, weight, bias and initial_states. Its backward is
built from the forward op (the gradient of x is the same convolution run backwards in time, the
filter reversed) plus the filter and bias gradients as sums over batch and time, so every
backend's forward kernel serves the backward too. ``causal_conv1d_update`` is inference-only
and writes ``conv_state`` in place (declared in its schema).

A backend implements ``forward(x, weight, bias, seq_idx, initial_states, silu) -> out`` and
``update(x, conv_state, weight, bias, silu, cache_seqlens, conv_state_indices) -> out`` (writing
``conv_state``); inputs arrive checked and contiguous, but the forward's x and conv_state as the
caller's (any strides: models pass x as a transposed ``[B, T, D]`` projection), index tensors as
int32, x of the update as ``[B, D, L]``. The math is in
``torch_kernels.reference.causal_conv1d``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _checks, backends
from .._library import define, io_bytes, register_cost, tensor_bytes
from ..families import Case
from ..reference import causal_conv1d as reference

__all__ = ["causal_conv1d_fn", "causal_conv1d_update"]

FORWARD_OP = "causal_conv1d_fn"
UPDATE_OP = "causal_conv1d_update"
INDEX_DTYPES = (torch.int32, torch.int64)
ACTIVATIONS = (None, "silu", "swish")
MAX_WIDTH = 8

backends.register(FORWARD_OP, "reference", reference.causal_conv1d)
backends.register(FORWARD_OP, "triton", "triton_impl.causal_conv1d:causal_conv1d_fn")
backends.register(FORWARD_OP, "pallas", "torch_kernels.pallas.causal_conv1d:pallas_causal_conv1d_fn")
backends.register(FORWARD_OP, "sycl", "oneapi_impl.causal_conv1d:causal_conv1d_fn")
backends.register(UPDATE_OP, "reference", reference.causal_conv1d_update)
backends.register(UPDATE_OP, "triton", "triton_impl.causal_conv1d:causal_conv1d_update")
backends.register(UPDATE_OP, "pallas", "torch_kernels.pallas.causal_conv1d:pallas_causal_conv1d_update")
backends.register(UPDATE_OP, "sycl", "oneapi_impl.causal_conv1d:causal_conv1d_update")


# ---- checks ----

def check_activation(activation) -> bool:
    """True for SiLU (``"silu"``/``"swish"``), False for none."""
    if activation is not None and not isinstance(activation, str):
        raise TypeError(f"activation: expected None or a string ('silu', 'swish'), got {type(activation).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected None, 'silu' or 'swish', got {activation!r}")
    return activation is not None


def check_filter(weight, bias, dim: int) -> int:
    """weight ``[D, W]`` and bias ``[D]``; returns W."""
    _checks.tensor("weight", weight, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    _checks.size("weight", 0, weight.shape[0], dim, "channels D of x")
    width = weight.shape[1]
    if not 2 <= width <= MAX_WIDTH:
        raise ValueError(f"weight: expected a filter width between 2 and {MAX_WIDTH}, got shape {tuple(weight.shape)}")
    if bias is not None:
        _checks.tensor("bias", bias, ndim=1, dtypes=_checks.FLOAT_DTYPES)
        _checks.size("bias", 0, bias.shape[0], dim, "channels D of x")
    return width


@_checks.remembers_layouts
def check_inputs(x, weight, bias, seq_idx, initial_states, activation) -> None:
    """Shapes, dtypes and devices of a ``causal_conv1d_fn`` call (no data read)."""
    _checks.tensor("x", x, ndim=3, dtypes=_checks.FLOAT_DTYPES)
    batch, dim, length = x.shape
    width = check_filter(weight, bias, dim)
    if seq_idx is not None:
        _checks.tensor("seq_idx", seq_idx, ndim=2, dtypes=INDEX_DTYPES)
        if tuple(seq_idx.shape) != (batch, length):
            raise ValueError(f"seq_idx: expected shape {(batch, length)} (B and T of x), got {tuple(seq_idx.shape)}")
        if initial_states is not None:
            raise ValueError("initial_states: expected None when seq_idx is given (packed sequences start from zeros)")
    if initial_states is not None:
        _checks.tensor("initial_states", initial_states, ndim=3, dtypes=(x.dtype,))
        if tuple(initial_states.shape) != (batch, dim, width - 1):
            raise ValueError(f"initial_states: expected shape {(batch, dim, width - 1)} (B, D of x, width - 1), "
                             f"got {tuple(initial_states.shape)}")
    check_activation(activation)
    present = {n: t for n, t in (("bias", bias), ("seq_idx", seq_idx), ("initial_states", initial_states))
               if t is not None}
    _checks.same_device(x=x, weight=weight, **present)


@_checks.remembers_layouts
def check_update_inputs(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices) -> None:
    """Shapes, dtypes and devices of a ``causal_conv1d_update`` call (no data read)."""
    _checks.tensor("x", x, dtypes=_checks.FLOAT_DTYPES)
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected [B, D] or [B, D, L], got shape {tuple(x.shape)}")
    batch, dim = x.shape[:2]
    width = check_filter(weight, bias, dim)
    _checks.tensor("conv_state", conv_state, ndim=3, dtypes=(x.dtype,))
    _checks.size("conv_state", 1, conv_state.shape[1], dim, "channels D of x")
    _checks.written_in_place("conv_state", conv_state)
    if conv_state.shape[2] < width - 1:
        raise ValueError(f"conv_state: expected a state length of at least width - 1 = {width - 1}, "
                         f"got shape {tuple(conv_state.shape)}")
    if conv_state_indices is None:
        _checks.size("conv_state", 0, conv_state.shape[0], batch, "batch B of x, without conv_state_indices")
    else:
        _checks.tensor("conv_state_indices", conv_state_indices, ndim=1, dtypes=INDEX_DTYPES)
        _checks.size("conv_state_indices", 0, conv_state_indices.shape[0], batch, "batch B of x")
    if cache_seqlens is not None:
        _checks.tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=INDEX_DTYPES)
        _checks.size("cache_seqlens", 0, cache_seqlens.shape[0], batch, "batch B of x")
    check_activation(activation)
    present = {n: t for n, t in (("bias", bias), ("cache_seqlens", cache_seqlens),
                                 ("conv_state_indices", conv_state_indices)) if t is not None}
    _checks.same_device(x=x, conv_state=conv_state, weight=weight, **present)


def check_update_values(conv_state, cache_seqlens, conv_state_indices,
                        checks: _checks.ValueChecks | None = None) -> tuple:
    """Rows below conv_state's and each at most once (negative: padding), ring positions >= 0.
    Returns ``(cache_seqlens, conv_state_indices, bad_entries)``: as given in full mode
    (``bad_entries`` None); in deferred mode made safe (a row past conv_state's becomes padding, a
    negative length 0) and ``bad_entries`` ``[B]`` marks the entries whose output must be NaN (an
    int64 value past int32's range too, which the kernel's int32 cast saturates). Without
    ``checks``, checks fully now."""
    own = checks is None
    checks = checks or _checks.ValueChecks(conv_state.device, "full")
    bad_entries = None
    if conv_state_indices is not None:
        conv_state_indices, bad_entries = _checks.state_rows("conv_state_indices", conv_state_indices, "conv_state",
                                                             conv_state.shape[0], checks)
    if cache_seqlens is not None:
        message = "cache_seqlens: expected lengths >= 0"
        device_check = checks.device_check(_checks.LENGTHS_CHECK, (message, _checks.int32_message("cache_seqlens")))
        bad_lengths = None
        if device_check is not None:  # int32 lengths straight away, their int32 range checked there too
            cache_seqlens, bad_lengths = device_check(cache_seqlens)
        else:
            negative = cache_seqlens < 0
            checks.add(negative, message, lambda: f"got {cache_seqlens.tolist()}")
            if checks.deferred:
                # an int64 length past int32's range saturates to a valid-looking one: bad
                bad_lengths = negative
                if cache_seqlens.dtype == torch.int64:
                    bad_lengths = negative | (cache_seqlens > _checks.INT32_MAX)
                cache_seqlens = cache_seqlens.clamp(min=0)
        if bad_lengths is not None:
            bad_entries = bad_lengths if bad_entries is None else bad_entries | bad_lengths
    if own:
        checks.finish()
    return cache_seqlens, conv_state_indices, bad_entries


# ---- causal_conv1d_fn ----

def _device_type(t: torch.Tensor) -> str:
    return "cpu" if t.is_cpu else t.device.type


def _contiguous(t):
    return None if t is None else t.detach().contiguous()


def _forward_kernel(x, weight, bias=None, seq_idx=None, initial_states=None, activation=None, implementation=None):
    check_inputs(x, weight, bias, seq_idx, initial_states, activation)
    checks = _checks.ValueChecks(x.device)
    ids = _checks.int32_values("seq_idx", seq_idx, checks)
    checks.finish()
    if x.numel() == 0:  # no batch, channel or step: nothing to convolve, on every backend alike
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    out = backends.dispatch(FORWARD_OP, _device_type(x), implementation, x.detach(), _contiguous(weight),
                            _contiguous(bias), ids, _contiguous(initial_states), check_activation(activation))
    if checks.deferred and seq_idx is not None and seq_idx.dtype == torch.int64:
        # an id past int32's range was saturated (sequences may merge): its batch entry is NaN
        past = (seq_idx < _checks.INT32_MIN) | (seq_idx > _checks.INT32_MAX)
        out = out.masked_fill(past.any(-1)[:, None, None], torch.nan)
    return out.contiguous()


def _forward_fake(x, weight, bias=None, seq_idx=None, initial_states=None, activation=None, implementation=None):
    check_inputs(x, weight, bias, seq_idx, initial_states, activation)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    x, weight, bias, seq_idx, initial_states, activation, implementation = \
        tuple(inputs) + (None,) * (7 - len(inputs))
    ctx.save_for_backward(x, weight, bias, seq_idx, initial_states)
    ctx.activation = activation
    # the backward runs on the backends chosen now, even outside this call's use_backend block
    order, explicit = backends.resolve(x.device.type, implementation)
    ctx.implementation = ",".join(order) if explicit else None


def conv1d_backward(dout, x, weight, bias, seq_idx, initial_states, activation, implementation=None):
    """(dx, dweight, dbias, dinitial_states) of ``causal_conv1d_fn``, each in its input's dtype
    (None for an absent input), from forward-op calls and sums.

    With ``g`` the gradient before the activation, ``dxx[s] = sum_k w[k] g[s - k]`` over the padded
    input ``xx``: the forward of ``g`` padded with ``W - 1`` zeros at the end, filter reversed
    (its first ``W - 1`` entries are the initial states' gradient). With seq_idx the same sum runs
    on time-reversed ``g`` with the filter as is, so that each position keeps its sequence id.
    """
    width, length = weight.shape[1], x.shape[-1]
    wide = reference.compute_dtype(x.dtype)
    g = dout.to(wide)
    if check_activation(activation):
        pre = causal_conv1d_fn_op(x, weight, bias, seq_idx, initial_states, None, implementation).to(wide)
        sigmoid = torch.sigmoid(pre)
        g = g * sigmoid * (1 + pre * (1 - sigmoid))
    if seq_idx is None:
        dxx = causal_conv1d_fn_op(F.pad(g, (0, width - 1)), weight.flip(-1), None, None, None, None, implementation)
        dx, dinitial = dxx[..., width - 1:], dxx[..., :width - 1]
    else:
        dx = causal_conv1d_fn_op(g.flip(-1), weight, None, seq_idx.flip(-1), None, None, implementation).flip(-1)
        dinitial = None
    xx = reference.padded_input(x, width, initial_states)
    taps = []
    for k in range(width):
        product = g * xx[..., k:k + length]
        if seq_idx is not None:
            product = product * reference.same_sequence(seq_idx, width - 1 - k)[:, None, :]
        taps.append(product.sum((0, 2)))
    dweight = torch.stack(taps, dim=1)
    dbias = None if bias is None else g.sum((0, 2)).to(bias.dtype)
    dinitial = None if initial_states is None else dinitial.to(initial_states.dtype)
    return dx.to(x.dtype), dweight.to(weight.dtype), dbias, dinitial


def _backward(ctx, dout):
    x, weight, bias, seq_idx, initial_states = ctx.saved_tensors
    dx, dweight, dbias, dinitial = conv1d_backward(dout, x, weight, bias, seq_idx, initial_states, ctx.activation,
                                                   ctx.implementation)
    grads = (dx, dweight, dbias, None, dinitial, None, None)
    return tuple(grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad))


causal_conv1d_fn_op = define(
    "causal_conv1d_fn(Tensor x, Tensor weight, Tensor? bias=None, Tensor? seq_idx=None, "
    "Tensor? initial_states=None, str? activation=None, str? implementation=None) -> Tensor",
    _forward_kernel, _forward_fake, setup_context=_setup_context, backward=_backward)


def _conv_flops(a, out) -> int:
    """A multiply-add per tap and output element."""
    return 2 * a.x.numel() * a.weight.shape[1]


register_cost(causal_conv1d_fn_op, flops=_conv_flops, bytes=io_bytes)


# ---- causal_conv1d_update ----

def _update_kernel(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, conv_state_indices=None,
                   implementation=None):
    check_update_inputs(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)
    checks = _checks.ValueChecks(x.device, backend=backends.planned(UPDATE_OP, _device_type(x), implementation))
    cache_seqlens, conv_state_indices, bad_entries = check_update_values(conv_state, cache_seqlens,
                                                                         conv_state_indices, checks)
    cache_seqlens = _checks.int32_values("cache_seqlens", cache_seqlens, checks)
    conv_state_indices = _checks.int32_values("conv_state_indices", conv_state_indices, checks)
    checks.finish()
    if x.numel() == 0:  # no entry, channel or step: the state stays as it is, on every backend alike
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    steps = x if x.dim() == 3 else x[..., None]
    out = backends.dispatch(UPDATE_OP, _device_type(x), implementation, steps.contiguous(), conv_state,
                            weight.contiguous(), _contiguous(bias), check_activation(activation),
                            cache_seqlens, conv_state_indices)
    if bad_entries is not None:
        out.masked_fill_(bad_entries[:, None, None], torch.nan)
    return out.reshape(x.shape)


def _update_fake(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, conv_state_indices=None,
                 implementation=None):
    check_update_inputs(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


causal_conv1d_update_op = define(
    "causal_conv1d_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias=None, str? activation=None, "
    "Tensor? cache_seqlens=None, Tensor? conv_state_indices=None, str? implementation=None) -> Tensor",
    _update_kernel, _update_fake)


def _update_bytes(a, out) -> int:
    """x and the filter read, out written, and per live row the last W - 1 state entries read
    and the new inputs (at most the state length) written."""
    steps = a.x.shape[2] if a.x.dim() == 3 else 1
    kept = min(steps, a.conv_state.shape[2])
    row = a.conv_state.shape[1] * a.conv_state.element_size()
    state = a.x.shape[0] * row * (a.weight.shape[1] - 1 + kept)
    return tensor_bytes(a.x, a.weight, a.bias, a.cache_seqlens, a.conv_state_indices, out) + state


register_cost(causal_conv1d_update_op, flops=_conv_flops, bytes=_update_bytes)


# ---- public wrappers ----

def _require_tensors(**tensors) -> None:
    for name, t in tensors.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None, implementation=None):
    """Causal depthwise 1-D convolution over time, as causal-conv1d's ``causal_conv1d_fn``.

    Per channel ``c``, ``out[b, c, t] = act(bias[c] + sum_k weight[c, k] * xx[b, c, t + k])``
    where ``xx = cat(initial_states, x)`` along time (zeros for no initial states): output ``t``
    sees inputs ``t - W + 1 .. t``. Arithmetic in float32 (float64 for float64 x).

    Args:
        x: ``[B, D, T]`` (any strides), float16, bfloat16, float32 or float64.
        weight: ``[D, W]``, ``2 <= W <= 8``, any float dtype (a model's ``conv1d.weight[:, 0]``).
        bias: ``[D]`` or None.
        seq_idx: int32 ``[B, T]`` sequence ids of packed sequences: input ``x[t - j]`` enters
            ``out[t]`` only where ``seq_idx[t - j] == seq_idx[t]``. Not with initial states.
        initial_states: ``[B, D, W - 1]`` in x's dtype, the inputs before ``x[..., 0]``.
        return_final_states: also return ``[B, D, W - 1]``, the last ``W - 1`` inputs of ``xx``
            (the state a following call or decode step starts from). Not with seq_idx.
        final_states_out: a ``[B, D, W - 1]`` tensor to write the final states into (implies
            ``return_final_states``; returned as the second output).
        activation: None, ``"silu"`` or ``"swish"`` (the same).
        implementation: a backend name or ordered list (see ``torch_kernels.backends``).

    Returns:
        ``out [B, D, T]`` in x's dtype, or ``(out, final_states)`` with ``return_final_states``.
        Differentiable in x, weight, bias, initial_states (and through the final states).

    In the deferred check mode (``torch_kernels.checks``) an int64 seq_idx past int32's range is
    recorded, not raised, and its batch entry's output is NaN.
    """
    _require_tensors(x=x, weight=weight, bias=bias, seq_idx=seq_idx, initial_states=initial_states,
                     final_states_out=final_states_out)
    check_activation(activation)  # before the dispatcher, which refuses a non-string with its own error
    wants_final = bool(return_final_states) or final_states_out is not None
    if wants_final and seq_idx is not None:
        raise ValueError("return_final_states: expected False with seq_idx (packed sequences have no one final state)")
    out = causal_conv1d_fn_op(x, weight, bias, seq_idx, initial_states, activation,
                              backends.implementation_arg(implementation))
    if not wants_final:
        return out
    width = weight.shape[1]
    head = initial_states if initial_states is not None else x.new_zeros(x.shape[0], x.shape[1], width - 1)
    final = torch.cat([head, x], dim=-1)[..., -(width - 1):]
    if final_states_out is not None:
        if final_states_out.shape != final.shape or final_states_out.dtype != x.dtype:
            raise ValueError(f"final_states_out: expected shape {tuple(final.shape)} and dtype {x.dtype}, got "
                             f"{tuple(final_states_out.shape)} {final_states_out.dtype}")
        final = final_states_out.copy_(final)
    return out, final


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None, implementation=None):
    """The decode form: convolve a few new inputs with the stored last ones and store the new
    ones, as causal-conv1d's ``causal_conv1d_update``. Inference-only; ``conv_state`` is written
    in place, only in the rows this batch uses.

    Entry ``b`` uses row ``r = conv_state_indices[b]`` (or ``b``). Its inputs before ``x`` are the
    last ``W - 1`` of the row (with ``cache_seqlens`` the row is a ring buffer: those before
    position ``cache_seqlens[b] % S``); out is as :func:`causal_conv1d_fn` over them and ``x``.
    Then the row takes ``x``: shifted left by ``L`` with ``x`` at its end, or with
    ``cache_seqlens`` written from ring position ``cache_seqlens[b] % S`` on.

    Args:
        x: ``[B, D]`` (one step) or ``[B, D, L]``.
        conv_state: ``[N, D, S]`` in x's dtype, ``S >= W - 1``, any strides; ``N = B`` without
            ``conv_state_indices``.
        weight, bias, activation: as in :func:`causal_conv1d_fn`.
        cache_seqlens: int32 ``[B]`` (>= 0), each row's count of inputs so far: the ring form.
        conv_state_indices: int32 ``[B]``, the row of each entry (continuous batching); each row
            at most once, a negative index marks a padding entry (out zeros, no row written).
        implementation: a backend name or ordered list (see ``torch_kernels.backends``).

    Returns:
        out in x's shape and dtype.

    In the deferred check mode (``torch_kernels.checks``) bad values are recorded, not raised: an
    entry whose row is past conv_state's is skipped as padding, a negative cache_seqlens is read
    as 0, and those entries' outputs are NaN; a repeated row is only recorded.
    """
    _require_tensors(x=x, conv_state=conv_state, weight=weight, bias=bias, cache_seqlens=cache_seqlens,
                     conv_state_indices=conv_state_indices)
    check_activation(activation)
    return causal_conv1d_update_op(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices,
                                   backends.implementation_arg(implementation))


# transformers' hub kernel names these ops serve (``torch_kernels.integrations.transformers.kernelize``):
# causal-conv1d's names, argument names and layouts
TRANSFORMERS_HUB_FUNCTIONS = {"causal_conv1d_fn": causal_conv1d_fn, "causal_conv1d_update": causal_conv1d_update}


# ---- self-test cases ----

def conv1d_inputs(gen, dtype, device, batch=2, dim=40, length=37, width=4):
    """x ``[B, D, T]``, a float32 filter with bias, initial states: sizes off the kernels' blocks."""
    x = torch.randn(batch, dim, length, generator=gen)
    weight = torch.randn(dim, width, generator=gen) * width ** -0.5
    bias = torch.randn(dim, generator=gen)
    h0 = torch.randn(batch, dim, width - 1, generator=gen)
    return x.to(device, dtype), weight.to(device), bias.to(device), h0.to(device, dtype)


def update_inputs(gen, dtype, device, batch=3, dim=40, steps=2, state_len=5, width=4, lines=5):
    """x ``[B, D, L]``, a conv_state of ``lines`` rows, the filter, ring lengths and rows (one padding)."""
    x = torch.randn(batch, dim, steps, generator=gen)
    conv_state = torch.randn(lines, dim, state_len, generator=gen)
    weight = torch.randn(dim, width, generator=gen) * width ** -0.5
    bias = torch.randn(dim, generator=gen)
    seqlens = torch.randint(0, 3 * state_len, (batch,), generator=gen, dtype=torch.int32)
    rows = torch.randperm(lines, generator=gen)[:batch].to(torch.int32)
    rows[-1] = -1
    return (x.to(device, dtype), conv_state.to(device, dtype), weight.to(device), bias.to(device),
            seqlens.to(device), rows.to(device))


def _naive(x, weight, bias, h0, silu=True):
    """A loop over time steps, from the definition, in float64."""
    width = weight.shape[1]
    xx = torch.cat([h0.double(), x.double()], dim=-1)
    out = torch.stack([bias.double() + (xx[..., t:t + width] * weight.double()).sum(-1) for t in range(x.shape[-1])], -1)
    return F.silu(out) if silu else out


def _fn_run(x, weight, bias, h0, implementation=None):
    return causal_conv1d_fn(x, weight, bias, initial_states=h0, activation="silu", implementation=implementation)


def _update_run(x, conv_state, weight, bias, seqlens, rows, implementation=None):
    return causal_conv1d_update(x, conv_state.clone(), weight, bias, "silu", seqlens, rows,
                                implementation=implementation)


def _update_definition(x, conv_state, weight, bias, seqlens, rows):
    """Each live entry's window read from its ring, step by step."""
    width, state_len = weight.shape[1], conv_state.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for b, row in enumerate(rows.tolist()):
        if row < 0:
            continue
        ring = conv_state[row].double()
        start = int(seqlens[b])
        history = torch.stack([ring[:, (start - width + 1 + i) % state_len] for i in range(width - 1)], -1)
        out[b] = _naive(x[b:b + 1], weight, bias, history[None])[0]
    return out


def selftest_cases() -> list[Case]:
    """The doctor's checks: the convolution with initial states and SiLU, and a ring-buffer decode
    step over rows picked by conv_state_indices, against loops over time in float64."""
    return [Case(FORWARD_OP, conv1d_inputs, _fn_run, _naive),
            Case(UPDATE_OP, update_inputs, _update_run, _update_definition)]

"""Gated DeltaNet and gated linear attention as SYCL kernels (``linear_attention.cl``); every
kernel also takes Kimi Delta Attention's decay per key channel (``g [B, T, HV, K]``).

Contract: ``torch_kernels.ops.linear_attention`` (the backend functions) and
``torch_kernels.reference.linear_attention`` (the math). Four kernels share one SPIR-V build per
(q/k dtype, v dtype, delta rule or not, K bound, state block, decay per key channel or per head):

- ``chunk_forward``: a work-group per (sequence, value head, block of state columns) walks the
  sequence in chunks of 64 rows with its state block in local memory, using the WY form;
- ``chunk_backward``: reruns that forward to checkpoint each chunk's start state, then walks the
  chunks in reverse carrying dS in local memory;
- ``recurrent_forward`` / ``recurrent_backward``: a work-item per state column steps through the
  rows (the backward recomputes each 64-row segment's states from checkpoints, then walks back).

CPU tensors run on the ``opencl:cpu`` SYCL device through USM copies. The q/k l2 normalization
runs in torch around the kernels (its gradient by autograd). Gradients of q, k, g and beta come
back per state block and per value head and are summed here.
"""

from __future__ import annotations

import ctypes
import dataclasses

import torch

from . import _runtime

SOURCE = "linear_attention.cl"
CHUNK = 64  # rows per chunk, and work-items per chunk work-group (CHUNK and WG of the .cl)
_KINDS = _runtime.FLOAT_KINDS


@dataclasses.dataclass(frozen=True)
class Layout:
    """``k_max``: a power of two >= K (the kernels' array bound); ``v_block``: state columns per
    work-group, a power of two."""

    k_max: int
    v_block: int


def _power_of_two_at_least(x: int, floor: int = 1) -> int:
    p = floor
    while p < x:
        p *= 2
    return p


def _local_bytes(layout: Layout, per_channel: bool = False) -> int:
    """The largest kernel's __local arrays (chunk_backward), as linear_attention.cl sizes them
    (its gates, e and r per key channel with ``per_channel``)."""
    k, vb = layout.k_max, layout.v_block
    decay_channels = k if per_channel else 1
    floats = 2 * k * vb + 2 * CHUNK * k + 4 * CHUNK * vb + 4 * CHUNK * CHUNK + 4 * CHUNK + 3 * CHUNK * decay_channels
    return 4 * floats


def default_layout(k_dim: int, v_dim: int, local_bytes: int, per_channel: bool = False) -> Layout:
    """The widest state block (up to 64 columns) whose chunk backward fits in local memory (8
    columns are the least: a decay per key channel at K = 128 takes 96 KiB of its 256)."""
    k_max = _power_of_two_at_least(k_dim, 16)
    v_block = min(64, _power_of_two_at_least(v_dim, 16))
    while v_block >= 8:
        layout = Layout(k_max, v_block)
        if _local_bytes(layout, per_channel) <= local_bytes:
            return layout
        v_block //= 2
    raise NotImplementedError(f"sycl: K={k_dim} does not fit the device's {local_bytes} bytes of local memory")


def _macros(qk_dtype: torch.dtype, v_dtype: torch.dtype, delta: bool, layout: Layout,
            per_channel: bool = False) -> dict[str, int]:
    return {"QK_KIND": _KINDS[qk_dtype], "V_KIND": _KINDS[v_dtype], "DELTA": int(delta),
            "K_MAX": layout.k_max, "VB": layout.v_block, "PER_CHANNEL": int(per_channel)}


def _l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """As the reference: in float32, ``x / sqrt(sum(x^2) + 1e-6)`` over K."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + 1e-6)


@dataclasses.dataclass
class _Problem:
    """The shapes, the sequence offsets and the USM copies of the inputs of one call."""

    batch: int
    length: int
    heads: int
    value_heads: int
    k_dim: int
    v_dim: int
    num_seqs: int
    layout: Layout
    macros: dict
    per_channel: bool  # g [B, T, HV, K], a decay per key channel
    inputs: list  # USM memories: q, k, v, g, beta, h0, cu
    chunk_first: torch.Tensor  # [N + 1] int32: each sequence's first chunk

    @property
    def rows(self) -> int:
        return self.batch * self.length

    @property
    def blocks(self) -> int:
        return -(-self.v_dim // self.layout.v_block)

    def state_shape(self) -> tuple[int, ...]:
        return (self.num_seqs, self.value_heads, self.k_dim, self.v_dim)


def _problem(q, k, v, g, beta, initial_state, cu_seqlens) -> _Problem:
    batch, length, heads, k_dim = q.shape
    value_heads, v_dim = v.shape[2], v.shape[3]
    if cu_seqlens is None:  # B sequences of T rows on the flat [B * T] row axis
        offsets = torch.arange(batch + 1, dtype=torch.int32) * length
    else:
        offsets = cu_seqlens.to(torch.int32)
    num_seqs = offsets.shape[0] - 1
    chunks = (offsets[1:] - offsets[:-1] + CHUNK - 1) // CHUNK
    chunk_first = torch.cat([torch.zeros(1, dtype=torch.int32), chunks.cumsum(0).to(torch.int32)])
    per_channel = g is not None and g.dim() == 4
    layout = default_layout(k_dim, v_dim, _runtime.local_memory_bytes(), per_channel)
    macros = _macros(q.dtype, v.dtype, beta is not None, layout, per_channel)
    gates = (batch, length, value_heads)
    g = torch.zeros(gates) if g is None else g.float()
    beta = torch.zeros(1) if beta is None else beta.float()  # unused by the linear attention build
    h0 = torch.zeros(num_seqs, value_heads, k_dim, v_dim) if initial_state is None else initial_state.float()
    inputs = [_runtime.usm_copy(t.contiguous())[0] for t in (q, k, v, g, beta, h0, offsets)]
    return _Problem(batch, length, heads, value_heads, k_dim, v_dim, num_seqs, layout, macros, per_channel, inputs,
                    chunk_first)


def _sizes(p: _Problem) -> list:
    return [ctypes.c_int(p.heads), ctypes.c_int(p.value_heads), ctypes.c_int(p.k_dim), ctypes.c_int(p.v_dim)]


def _forward(name: str, q, k, v, g, beta, scale, initial_state, cu_seqlens):
    p = _problem(q, k, v, g, beta, initial_state, cu_seqlens)
    out_mem, out = _runtime.usm_empty(tuple(v.shape), v.dtype)
    state_mem, state = _runtime.usm_empty(p.state_shape(), torch.float32)
    if state.numel() == 0:  # no sequences (B = 0)
        return out, state
    kernel = _runtime.kernel(SOURCE, name, **p.macros)
    local = CHUNK if name == "chunk_forward" else p.layout.v_block
    args = [*p.inputs, out_mem, state_mem, *_sizes(p), ctypes.c_float(scale)]
    # OpenCL dimensions (state block, value head, sequence), listed slowest first as SYCL does
    _runtime.host_queue().submit(kernel, args, [p.num_seqs, p.value_heads, p.blocks * local], [1, 1, local]).wait()
    return out, state


def _backward(name: str, do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """(dq, dk, dv, dg, dbeta, dh0) in float32; dq/dk summed onto the q/k heads."""
    p = _problem(q, k, v, g, beta, initial_state, cu_seqlens)
    chunked = name == "chunk_backward"
    local = CHUNK if chunked else p.layout.v_block
    blocks, rows, hv = p.blocks, p.rows, p.value_heads
    decay_channels = (p.k_dim,) if p.per_channel else ()
    grads = {
        "dq": _runtime.usm_empty((blocks, rows, hv, p.k_dim), torch.float32),
        "dk": _runtime.usm_empty((blocks, rows, hv, p.k_dim), torch.float32),
        "dv": _runtime.usm_empty((rows, hv, p.v_dim), torch.float32),
        "dg": _runtime.usm_empty((blocks, rows, hv, *decay_channels), torch.float32),
        "dbeta": _runtime.usm_empty((blocks, rows, hv), torch.float32),
        "dh0": _runtime.usm_empty(p.state_shape(), torch.float32),
    }
    for _, view in grads.values():
        view.zero_()  # rows of empty sequences are never visited
    if grads["dh0"][1].numel():  # else no sequences (B = 0)
        dht = torch.zeros(p.state_shape()) if dht is None else dht.float()
        upstream = [_runtime.usm_copy(t.contiguous())[0] for t in (p.chunk_first, do.float(), dht)]
        checkpoints, _ = _runtime.usm_empty((max(int(p.chunk_first[-1]), 1), hv, p.k_dim, p.v_dim), torch.float32)
        scratch = [checkpoints]
        if not chunked:  # one segment of recomputed states per work-group
            groups = p.num_seqs * hv * blocks
            scratch.append(_runtime.usm_empty((groups, CHUNK, p.layout.k_max, p.layout.v_block), torch.float32)[0])
        args = [*p.inputs, upstream[0], upstream[1], upstream[2], *scratch, *(mem for mem, _ in grads.values()),
                *_sizes(p), ctypes.c_float(scale), ctypes.c_int(rows)]
        kernel = _runtime.kernel(SOURCE, name, **p.macros)
        _runtime.host_queue().submit(kernel, args, [p.num_seqs, hv, blocks * local], [1, 1, local]).wait()

    b, t, h, group = p.batch, p.length, p.heads, hv // p.heads
    dq, dk = (grads[n][1].sum(0).view(b, t, h, group, p.k_dim).sum(3) for n in ("dq", "dk"))
    dv = grads["dv"][1].view(b, t, hv, p.v_dim)
    dg = grads["dg"][1].sum(0).view(b, t, hv, *decay_channels) if g is not None else None
    dbeta = grads["dbeta"][1].sum(0).view(b, t, hv) if beta is not None else None
    dh0 = grads["dh0"][1] if initial_state is not None else None
    return dq, dk, dv, dg, dbeta, dh0


def _run_forward(name, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    _runtime.require_supported(q, k, v, g, beta, initial_state, cu_seqlens)
    if use_qk_l2norm:
        q, k = _l2_normalize(q), _l2_normalize(k)
    return _forward(name, q, k, v, g, beta, scale, initial_state, cu_seqlens)


def _run_backward(name, do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    _runtime.require_supported(do, dht, q, k, v, g, beta, initial_state, cu_seqlens)
    if not use_qk_l2norm:
        return _backward(name, do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens)
    with torch.enable_grad():
        q_in, k_in = q.detach().requires_grad_(), k.detach().requires_grad_()
        q_unit, k_unit = _l2_normalize(q_in), _l2_normalize(k_in)
    dq, dk, *rest = _backward(name, do, dht, q_unit.detach(), k_unit.detach(), v, g, beta, scale,
                              initial_state, cu_seqlens)
    dq, dk = torch.autograd.grad((q_unit, k_unit), (q_in, k_in), (dq, dk))
    return (dq, dk, *rest)


def chunk_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """``(o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] float32)`` by the chunked kernel."""
    return _run_forward("chunk_forward", q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm)


def chunk_backward(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """``(dq, dk, dv, dg, dbeta, dh0)`` by the chunked kernel (float32; None for absent inputs)."""
    return _run_backward("chunk_backward", do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens,
                         use_qk_l2norm)


def recurrent_forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """As :func:`chunk_forward`, one step at a time (a work-item per state column)."""
    return _run_forward("recurrent_forward", q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm)


def recurrent_backward(do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm):
    """As :func:`chunk_backward`, stepping back through recomputed states."""
    return _run_backward("recurrent_backward", do, dht, q, k, v, g, beta, scale, initial_state, cu_seqlens,
                         use_qk_l2norm)


def spirv_binaries() -> list[bytes]:
    """The SPIR-V modules for K = V = 128, every input dtype, delta rule and linear attention, and
    the delta rule with a per-channel decay in float32."""
    layout = default_layout(128, 128, 256 * 1024)
    builds = [_macros(dtype, dtype, delta, layout) for dtype in _KINDS for delta in (True, False)]
    builds.append(_macros(torch.float32, torch.float32, True, default_layout(128, 128, 256 * 1024, True),
                          per_channel=True))
    return [_runtime.spirv(SOURCE, macros) for macros in builds]

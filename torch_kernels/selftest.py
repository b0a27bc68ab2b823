"""Self-test cases: each op on random inputs against its readable definition.

The doctor runs them on every available backend; the tests use the same cases and more.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from . import backends
from .ops import linear_attention as linear_attention_ops
from .ops import moe as moe_ops
from .ops import ood as ood_ops
from .ops import paged_attention as paged_attention_ops
from .ops import quantized_attention as quantized_attention_ops
from .reference import linear_attention as linear_attention_reference
from .reference import moe as moe_reference
from .reference import ood as ood_reference
from .reference import paged_attention as paged_attention_reference
from .reference import quantized_attention as quantized_attention_reference

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


def paged_attention_inputs(gen, dtype, device, q_lens=(1, 7, 1, 19), contexts=(40, 0, 70, 13),
                           heads=(8, 2), head_size=64, block_size=16):
    """A ragged batch (decodes, a fresh prompt, a chunk of a prompt) over shuffled pages."""
    num_q_heads, num_kv_heads = heads
    kv_lens = torch.tensor(q_lens) + torch.tensor(contexts)
    pages = -(-kv_lens // block_size)
    num_blocks = int(pages.sum()) + 3
    block_table = torch.zeros(len(q_lens), int(pages.max()), dtype=torch.int32)
    ids = torch.randperm(num_blocks, generator=gen)
    start = 0
    for s, n in enumerate(pages.tolist()):
        block_table[s, :n] = ids[start:start + n]
        start += n
    cu_q_lens = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu_q_lens[1:] = torch.tensor(q_lens).cumsum(0)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(device, dtype)
    query = torch.randn(int(cu_q_lens[-1]), num_q_heads, head_size, generator=gen).to(device, dtype)
    return (query, key_cache, value_cache, cu_q_lens.to(device), kv_lens.to(device, torch.int32),
            block_table.to(device), head_size**-0.5)


def _paged_attention_definition(*inputs):
    return paged_attention_reference.ragged_paged_attention_naive(*inputs).float()


def linear_attention_inputs(gen, dtype, device, delta=True, cu_seqlens=(0, 30, 75), heads=(2, 4), k_dim=32, v_dim=48):
    """Two packed sequences with their own initial states; grouped value heads for the delta rule."""
    num_heads, value_heads = heads if delta else (heads[0], heads[0])
    length = cu_seqlens[-1]
    q = torch.randn(1, length, num_heads, k_dim, generator=gen)
    k = torch.randn(1, length, num_heads, k_dim, generator=gen)
    v = torch.randn(1, length, value_heads, v_dim, generator=gen)
    g = -0.1 * torch.rand(1, length, value_heads, generator=gen)
    h0 = torch.randn(len(cu_seqlens) - 1, value_heads, k_dim, v_dim, generator=gen)
    if not delta:  # without the delta rule's l2 norm the state grows with the keys' size
        k = k * k_dim ** -0.5
    tensors = [q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), g.to(device)]
    if delta:
        tensors.append(torch.rand(1, length, value_heads, generator=gen).to(device))
    return (*tensors, h0.to(device), torch.tensor(cu_seqlens, dtype=torch.int32, device=device))


def _linear_attention_case(op: str) -> Case:
    delta = op != linear_attention_ops.CHUNK_GLA
    public = getattr(linear_attention_ops, op)

    def run(*inputs, implementation=None):
        *tensors, h0, cu = inputs
        kwargs = {"use_qk_l2norm_in_kernel": True} if delta else {}
        return public(*tensors, initial_state=h0, cu_seqlens=cu, implementation=implementation, **kwargs)[0]

    def definition(*inputs):
        *tensors, h0, cu = (t.double() if t.is_floating_point() else t for t in inputs)
        q, k, v, g, beta = tensors if delta else (*tensors, None)
        return linear_attention_reference.recurrence_naive(q, k, v, g, beta, q.shape[-1] ** -0.5, h0, cu,
                                                           use_qk_l2norm=delta)[0]

    return Case(op, lambda gen, dtype, device: linear_attention_inputs(gen, dtype, device, delta), run, definition)


def moe_inputs(gen, dtype, device, tokens=37, hidden=64, inter=48, experts=8, top_k=2):
    """Tokens, gate/up and down weights, and a softmax top-k routing of random router logits."""
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5
    scores = torch.randn(tokens, experts, generator=gen).softmax(dim=-1)
    weights, ids = scores.topk(top_k, dim=-1)
    return (x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype), weights.to(device),
            ids.to(device, torch.int32))


def _fused_moe_definition(x, w13, w2, weights, ids):
    return moe_reference.fused_moe_naive(x.double(), w13.double(), w2.double(), weights.double(), ids, "silu")


def grouped_mm_inputs(gen, dtype, device, rows=61, k_dim=40, n_dim=24, experts=6):
    """Rows split unevenly over experts (the second one empty), the last rows belonging to none."""
    x = torch.randn(rows, k_dim, generator=gen)
    w = torch.randn(experts, k_dim, n_dim, generator=gen) * k_dim ** -0.5
    ends = torch.randint(0, rows * 9 // 10 + 1, (experts,), generator=gen).sort().values
    ends[1:2] = ends[:1]
    return x.to(device, dtype), w.to(device, dtype), ends.to(device, torch.int32)


def _grouped_mm_definition(x, w, offsets):
    return moe_reference.grouped_mm_naive(x.double(), w.double(), offsets, torch.float64)


def quantized_attention_inputs(gen, dtype, device, b=2, heads=(4, 2), nq=67, nk=131, head_size=64):
    """GQA, more keys than queries (bottom-right causal), keys with per-channel offsets."""
    q = torch.randn(b, heads[0], nq, head_size, generator=gen)
    k = torch.randn(b, heads[1], nk, head_size, generator=gen) + 5 * torch.randn(1, heads[1], 1, head_size, generator=gen)
    v = torch.randn(b, heads[1], nk, head_size, generator=gen)
    return tuple(t.to(device, dtype) for t in (q, k, v))


def _quantized_attention_run(q, k, v, implementation=None):
    # P.V in the inputs' precision: the check is then of the int8 scores and the softmax alone
    return quantized_attention_ops.quantized_attention(q, k, v, causal=True, pv_dtype="none",
                                                       implementation=implementation)


def _quantized_attention_definition(q, k, v):
    """The same int8 scores, one float64 softmax over the whole row."""
    sm_scale = q.shape[-1] ** -0.5
    smoothing = quantized_attention_reference.smoothing(q, k, sm_scale, True, True)
    return quantized_attention_reference.quantized_attention_naive(q, k, v, *smoothing, sm_scale, True, "per_block",
                                                                   "none")[0]


def edm_inputs(gen, dtype, device, b=9, d=13, h=20, blocks=2, levels=3):
    """Features and a random denoiser of moderate gain, in ``EDM_TENSORS`` order after ``x``."""
    def randn(*size, scale=1.0):
        return torch.randn(*size, generator=gen, dtype=torch.float64) * scale

    x = randn(b, d) * 2 + 0.5
    params = [randn(d) * 2, randn(d).abs() * 0.5 + 0.25, randn(levels, d), randn(levels).abs() + 0.1,
              randn(levels, h), randn(d, h, scale=d**-0.5), randn(blocks, h, h, scale=h**-0.5),
              randn(blocks, h, scale=0.1), randn(blocks, h, h, scale=h**-0.5), randn(blocks, h, scale=0.1),
              randn(h, d, scale=h**-0.5), randn(d, scale=0.1)]
    param = torch.float64 if dtype == torch.float64 else torch.float32
    return (x.to(device, dtype), *(p.to(device, param) for p in params))


EDM_SIGMA_DATA = 0.8


def edm_sigmas(levels: int) -> list[float]:
    """Noise levels from 0.2 up by factors of 3."""
    return [0.2 * 3**i for i in range(levels)]


def _edm_run(x, *params, implementation=None):
    return ood_ops.edm_score(x, *params, edm_sigmas(params[2].shape[0]), EDM_SIGMA_DATA, "denoise",
                             implementation=implementation)


def _edm_definition(x, *params):
    return ood_reference.edm_score_naive(x.double(), *(p.double() for p in params), edm_sigmas(params[2].shape[0]),
                                         EDM_SIGMA_DATA, "denoise")


def reshape_and_cache_inputs(gen, dtype, device, tokens=23, heads=2, head_size=64, block_size=16, num_blocks=5):
    """New keys and values, random caches to write them into, distinct slots (one of them -1, padding)."""
    key, value = (torch.randn(tokens, heads, head_size, generator=gen) for _ in range(2))
    cache_shape = (num_blocks, block_size, heads, head_size)
    key_cache, value_cache = (torch.randn(cache_shape, generator=gen) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[tokens // 2] = -1
    return (key.to(device, dtype), value.to(device, dtype), key_cache.to(device, dtype), value_cache.to(device, dtype),
            slots.to(device))


def router_inputs(gen, dtype, device, tokens=37, experts=8):
    """Router logits ``[T, E]`` and a correction bias (for the grouped sigmoid router)."""
    logits = torch.randn(tokens, experts, generator=gen)
    bias = 0.1 * torch.randn(experts, generator=gen)
    return logits.to(device, dtype), bias.to(device, torch.float32)


CASES = [
    Case("mahalanobis_score", mahalanobis_inputs, ood_ops.mahalanobis_score, ood_reference.mahalanobis_score_naive),
    Case("edm_score", edm_inputs, _edm_run, _edm_definition),
    Case("ragged_paged_attention", paged_attention_inputs, paged_attention_ops.ragged_paged_attention,
         _paged_attention_definition),
    *(_linear_attention_case(op) for op in linear_attention_ops.OPS),
    Case("fused_moe", moe_inputs, moe_ops.fused_moe, _fused_moe_definition),
    Case("grouped_mm", grouped_mm_inputs, moe_ops.grouped_mm, _grouped_mm_definition),
    Case("quantized_attention", quantized_attention_inputs, _quantized_attention_run, _quantized_attention_definition),
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
           backend_names=None) -> bool:
    """Print which backends run here and every op on each against its definition; True if all pass.

    ``device``: where the inputs live (``"cuda"`` runs the compiled Triton kernels and the reference
    on the GPU); ``backend_names``: only these backends (default: every one that takes that
    device's tensors).
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
    for case in CASES:
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

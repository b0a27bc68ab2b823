"""The SYCL backend of quantized_attention (``oneapi_impl.quantized_attention``) against the
reference, tightly, on the ``opencl:cpu`` SYCL device.

Both get the same inputs and the same smoothing numbers (the op computes them once), so the int8
values and scales of Q and K and V's e4m3 codes and scales are the reference's bit for bit
(checked directly: every granularity, packed sequences, NaN, inf, all-zero heads and subnormal
inputs whose scales are subnormal). The float -> float8_e4m3fn conversion, which OpenCL has no
type for, equals torch's cast on every finite float16 value it can meet and on float32 values
beside every rounding boundary. Measured on the inputs below: float16 / bfloat16 outputs within
0.4 ulp of the largest output, float32 outputs within 3 float32 ulps, except that with
``pv_dtype="fp16"`` an ulp of ``exp2`` now and then moves a P across a float16 rounding boundary
(below 2^-11 of the largest output); the lse within 3e-6; gradients within 0.4 ulp of the largest
gradient for 16-bit inputs and 25 float32 ulps of it for float32. Run with ``-s`` to see the figures.
"""

from __future__ import annotations

import math

import pytest
import torch

import torch_kernels
from harness import require_backend
from test_quantized_attention import make_qkv
from torch_kernels import backends
from torch_kernels.reference import quantized_attention as reference

# (head size, dtype): the builds the shared tests make too (each is a SPIR-V build and a JIT)
CASES = [(64, torch.float16), (96, torch.bfloat16), (128, torch.float32)]
CASE_IDS = [f"D{d}-{str(t).removeprefix('torch.')}" for d, t in CASES]


@pytest.fixture(scope="module")
def sycl():
    require_backend("sycl")
    from oneapi_impl import quantized_attention

    return quantized_attention


def error_in_ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """max |got - want| in ulps of ``dtype`` at the largest finite |want|; NaN and inf only where
    ``want`` has them (and the same ones)."""
    got, want = got.double(), want.double()
    finite = want.isfinite()
    assert torch.equal(got.isfinite(), finite) and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[want.isinf()], want[want.isinf()])
    if not finite.any():
        return 0.0
    largest = want[finite].abs().max().clamp_min(1e-30)
    return ((got[finite] - want[finite]).abs().max() / (largest * torch.finfo(dtype).eps)).item()


def allowed_ulps(dtype: torch.dtype, pv_dtype: str) -> float:
    """Output ulps allowed (module docstring): float32 outputs of float16 P may differ by a P moved
    across a float16 rounding boundary, below 2^-11 of the largest output."""
    if dtype != torch.float32:
        return 1.0
    return 2.0 ** -11 / torch.finfo(torch.float32).eps if pv_dtype == "fp16" else 8.0


def lse_error(lse: torch.Tensor, want: torch.Tensor) -> float:
    """max |lse - want| over the rows that see a key; -inf exactly where ``want`` has it."""
    assert torch.equal(lse == -math.inf, want == -math.inf) and not lse.isnan().any()
    seen = want > -math.inf
    return (lse[seen] - want[seen]).abs().max().item() if seen.any() else 0.0


def both(sycl, args):
    """(sycl, reference) results of the forward on the kernel contract's ``args``."""
    return sycl.quantized_attention(*args), reference.quantized_attention(*args)


def folded(sm_scale: float) -> float:
    """``sm_scale * log2(e)`` as the float32 value the reference folds into the queries."""
    return torch.tensor(sm_scale * reference.LOG2E, dtype=torch.float32).item()


# ---- the int8 values and scales ----

@pytest.mark.parametrize("head_size, dtype", CASES, ids=CASE_IDS)
def test_quantization_is_the_references_bit_for_bit(sycl, head_size, dtype):
    """Queries (their mean subtracted or not, sm_scale * log2(e) folded in) and keys (smoothed or
    not), every granularity, lengths 1 and 200, an all-zero head, a NaN and an inf (their groups'
    scales inf, entries 0), and a head of subnormal-sized values (float32 and bfloat16), whose
    amax / 127 and quotients are subnormal."""
    for n in (1, 200):
        gen = torch.Generator().manual_seed(n)
        x = (3 * torch.randn(2, 3, n, head_size, generator=gen) + torch.randn(1, 3, 1, head_size, generator=gen))
        x = x.to(dtype)
        x[1, 2] = 0
        x[0, 1, n // 2, 3] = float("nan")
        x[1, 0, n - 1, 0] = float("inf")
        if dtype != torch.float16:
            x[1, 1] = (x[1, 1].float() * 1e-38).to(dtype)
        mean = reference.sequence_mean(x)
        for granularity in reference.GRANULARITIES:
            for smoothing in (mean, None):
                q8, q_scale = sycl.quantize(x, smoothing, folded(0.1), "q", granularity)
                k8, k_scale = sycl.quantize(x, smoothing, 1.0, "k", granularity)
                for b in range(2):
                    b_mean = None if smoothing is None else smoothing[b]
                    want_q8, want_q_scale = reference.quantize_queries(x[b], b_mean, 0.1, granularity)
                    want_k8, want_k_scale = reference.quantize_keys(x[b], b_mean, granularity)
                    assert torch.equal(q8[b], want_q8) and torch.equal(q_scale[b], want_q_scale), (n, granularity)
                    assert torch.equal(k8[b], want_k8) and torch.equal(k_scale[b], want_k_scale), (n, granularity)
        if dtype != torch.float16:
            assert (q_scale[1, 1] < torch.finfo(torch.float32).tiny).all()  # the subnormal path ran
        v8, v_scale = sycl.quantize_values_fp8(x)
        for b in range(2):
            want_v8, want_scale = reference.quantize_values_fp8(x[b])
            assert torch.equal(v_scale[b], want_scale)
            assert torch.equal(v8[b].view(torch.uint8), want_v8.view(torch.uint8))


def test_quantization_of_packed_sequences(sycl):
    """Groups count from each sequence's first row, means and V's scales are per sequence, empty
    sequences are skipped (a V scale of 1)."""
    lengths = [37, 0, 130, 70, 5, 9]
    cu = torch.tensor([0] + lengths).cumsum(0)
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(1, 2, sum(lengths), 64, generator=gen) + 3 * torch.randn(1, 2, 1, 64, generator=gen)).half()
    mean = reference.sequence_mean(x, cu)
    v8, v_scale = sycl.quantize_values_fp8(x, cu)
    for granularity in reference.GRANULARITIES:
        q8, q_scale = sycl.quantize(x, mean, folded(0.25), "q", granularity, cu)
        k8, k_scale = sycl.quantize(x, mean, 1.0, "k", granularity, cu)
        for s in range(len(lengths)):
            rows = slice(int(cu[s]), int(cu[s + 1]))
            want = reference.quantize_queries(x[0, :, rows], mean[s], 0.25, granularity)
            assert torch.equal(q8[0, :, rows], want[0]) and torch.equal(q_scale[0, :, rows], want[1])
            want = reference.quantize_keys(x[0, :, rows], mean[s], granularity)
            assert torch.equal(k8[0, :, rows], want[0]) and torch.equal(k_scale[0, :, rows], want[1])
            if lengths[s]:
                want = reference.quantize_values_fp8(x[0, :, rows])
                assert torch.equal(v8[0, :, rows].view(torch.uint8), want[0].view(torch.uint8))
                assert torch.equal(v_scale[s], want[1])
            else:
                assert torch.all(v_scale[s] == 1)


# ---- float -> float8_e4m3fn, emulated ----

def _codes_at_scale_one(sycl, values: torch.Tensor) -> torch.Tensor:
    """The kernel's e4m3fn codes of ``values`` (|x| <= 448) converted as they are: a channel whose
    amax is 448 has scale 1, and x / 1 = x."""
    column = torch.cat([values, torch.tensor([448.0], dtype=values.dtype)])
    v8, scale = sycl.quantize_values_fp8(column.view(1, 1, -1, 1).expand(1, 1, -1, 64).contiguous())
    assert torch.all(scale == 1)
    return v8[0, 0, :-1, 0].view(torch.uint8)


def test_e4m3fn_conversion_equals_torchs_cast(sycl):
    """Every finite float16 value up to 448 (so every e4m3fn value, every midpoint between two and
    its float16 neighbours, the subnormals, +-0), float32 values one ulp beside each midpoint, and
    NaN, against torch's cast; every finite float16 value past 448 through V's scaling, whose
    quotient may land an ulp past 448 (saturated, as the reference's clamp does), against the
    reference."""
    halves = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    halves = halves[halves.isfinite()]
    small = halves[halves.abs() <= 448]
    assert torch.equal(_codes_at_scale_one(sycl, small), small.float().to(torch.float8_e4m3fn).view(torch.uint8))

    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    edges = torch.cat([mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e9)), torch.tensor([2.0 ** -127])])
    edges = torch.cat([edges, -edges])
    assert torch.equal(_codes_at_scale_one(sycl, edges), edges.to(torch.float8_e4m3fn).view(torch.uint8))
    nan_codes = _codes_at_scale_one(sycl, torch.tensor([float("nan"), -float("nan")]))
    assert torch.equal(nan_codes.view(torch.float8_e4m3fn).float().isnan(), torch.tensor([True, True]))

    # every finite float16 value, 64 neighbours a channel (zeros pad the last): scales from 65504 / 448 down
    channels = torch.cat([halves, halves.new_zeros(2 ** 16 - halves.numel())]).view(16, 64, 64)  # head, channel, token
    values = channels.transpose(1, 2).unsqueeze(0).contiguous()
    v8, scale = sycl.quantize_values_fp8(values)
    want_v8, want_scale = reference.quantize_values_fp8(values[0])
    assert torch.equal(scale[0], want_scale) and torch.equal(v8[0].view(torch.uint8), want_v8.view(torch.uint8))
    saturated = (values[0].float() / want_scale[:, None, :]).abs() > 448
    assert saturated.any()  # the clamp mattered somewhere


# ---- forward ----

@pytest.mark.parametrize("pv_dtype", reference.PV_DTYPES)
@pytest.mark.parametrize("head_size, dtype", CASES, ids=CASE_IDS)
def test_forward_matches_reference(sycl, head_size, dtype, pv_dtype):
    """GQA 4:2, Nq != Nk, full and bottom-right causal, Q and K smoothed and not, every
    granularity with every pv_dtype over the head sizes."""
    q, k, v = make_qkv(1, 4, 2, 131, 197, head_size, dtype, key_offset=2.0, query_offset=3.0, seed=head_size)
    sm_scale = head_size ** -0.5
    turn = reference.PV_DTYPES.index(pv_dtype)
    granularities = reference.GRANULARITIES[turn:] + reference.GRANULARITIES[:turn]
    for causal, granularity, smooth in ((False, granularities[0], True), (True, granularities[1], False),
                                        (True, granularities[2], True)):
        smoothing = reference.smoothing(q, k, sm_scale, smooth, smooth)
        args = (q, k, v, *smoothing, sm_scale, causal, granularity, pv_dtype, None, None)
        (out, lse), (want, want_lse) = both(sycl, args)
        error, lse_diff = error_in_ulps(out, want, dtype), lse_error(lse, want_lse)
        print(f"\n{dtype} D={head_size} {pv_dtype} causal={causal} {granularity} smooth={smooth}: "
              f"out {error:.2f} ulp, lse {lse_diff:.1e}", end="")
        assert out.dtype == dtype and error <= allowed_ulps(dtype, pv_dtype), (causal, granularity, error)
        assert lse_diff < 1e-5


def test_packed_sequences_match_reference(sycl):
    """Packed sequences with an empty query sequence, Nq > Nk (causal rows that see no key: 0 and
    lse -inf), an empty key sequence (0 and -inf), MQA."""
    q_lens, k_lens = [37, 0, 130, 70, 5, 9], [50, 20, 130, 70, 3, 0]
    cu_q, cu_k = (torch.tensor([0] + lens).cumsum(0) for lens in (q_lens, k_lens))
    q, _, _ = make_qkv(1, 4, 1, sum(q_lens), 1, 64, torch.float16, seed=4, query_offset=3.0)
    _, k, v = make_qkv(1, 4, 1, 1, sum(k_lens), 64, torch.float16, seed=5, key_offset=5.0)
    smoothing = reference.smoothing(q, k, 0.125, True, True, cu_q, cu_k)
    for causal, granularity, pv_dtype in ((True, "per_thread", "fp16"), (False, "per_block", "fp8"),
                                          (True, "per_warp", "none")):
        args = (q, k, v, *smoothing, 0.125, causal, granularity, pv_dtype, cu_q, cu_k)
        (out, lse), (want, want_lse) = both(sycl, args)
        assert error_in_ulps(out, want, torch.float16) <= 1.0 and lse_error(lse, want_lse) < 1e-5
        assert torch.all(out[0, :, int(cu_q[5]):] == 0) and torch.all(lse[0, :, int(cu_q[5]):] == -math.inf)
    assert (lse == -math.inf).sum() > 4 * 3  # causal rows with no key, beside the keyless sequence


def test_nan_and_inf_reach_the_references_rows(sycl):
    """A NaN in a query or an inf in a key makes exactly the reference's rows NaN (its query group
    through the query mean's smoothing, the rows seeing its key group); a NaN value reaches at
    least every row attending to it (the kernel skips tiles past a work-group's diagonal, whose 0 *
    NaN the reference adds)."""
    q, k, v = make_qkv(1, 2, 1, 200, 200, 64, torch.float32, seed=26)
    for smooth in (False, True):
        for where in ("q", "k"):
            qq, kk = q.clone(), k.clone()
            if where == "q":
                qq[0, 1, 5, 3] = float("nan")
            else:
                kk[0, 0, 70, 1] = float("inf")
            smoothing = reference.smoothing(qq, kk, 0.125, smooth, smooth)
            args = (qq, kk, v, *smoothing, 0.125, True, "per_block", "fp16", None, None)
            (out, lse), (want, want_lse) = both(sycl, args)
            assert want.isnan().any() and torch.equal(out.isnan(), want.isnan()), (smooth, where)
            assert torch.equal(lse.isnan(), want_lse.isnan()), (smooth, where)
    v[0, 0, 150, 2] = float("nan")
    for pv_dtype in reference.PV_DTYPES:
        args = (q, k, v, None, None, None, 0.125, True, "per_warp", pv_dtype, None, None)
        out, _ = sycl.quantized_attention(*args)
        assert out[0, :, 150:].isnan().any(dim=-1).all() and not out[0, :, :128].isnan().any(), pv_dtype


def test_other_head_sizes(sycl):
    """The largest head size (256, which no other kernel takes) runs here too, forward and
    backward, through the op; past 256 the backend declines and the next one runs."""
    q, k, v = make_qkv(1, 2, 1, 70, 90, 256, torch.float16, seed=12, requires_grad=True)
    out, lse = torch_kernels.quantized_attention(q, k, v, causal=True, return_lse=True, implementation="sycl")
    want, want_lse = torch_kernels.quantized_attention(q, k, v, causal=True, return_lse=True,
                                                       implementation="reference")
    assert error_in_ulps(out, want, torch.float16) <= 1.0 and lse_error(lse, want_lse) < 1e-5
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.float().sum(), (q, k, v))
    for got, expected in zip(grads, want_grads):
        assert error_in_ulps(got, expected, torch.float16) <= 1.0
    big = make_qkv(1, 2, 1, 3, 3, 264, torch.float32, seed=13)
    with pytest.raises(NotImplementedError, match="head size 264"):
        sycl.quantized_attention(*big, None, None, None, 0.1, False, "per_block", "fp16", None, None)
    with pytest.raises(NotImplementedError, match="head size 264"):
        sycl.quantized_attention_backward(big[0], None, *big, 0.1, False, None, None)
    torch_kernels.quantized_attention(*big, implementation=["sycl", "reference"])
    assert backends.last_backend("quantized_attention") == "reference"
    with pytest.raises(RuntimeError, match="head size 264"):
        torch_kernels.quantized_attention(*big, implementation="sycl")


def test_other_devices_and_dtypes_are_declined(sycl):
    """Tensors off the CPU (no XPU path yet) and float64 go to the next backend."""
    meta = [torch.empty(1, 2, 10, 64, device="meta") for _ in range(3)]
    with pytest.raises(NotImplementedError, match="only CPU tensors"):
        sycl.quantized_attention(*meta, None, None, None, 0.1, False, "per_block", "fp16", None, None)
    doubles = [torch.zeros(1, 2, 10, 64, dtype=torch.float64) for _ in range(3)]
    with pytest.raises(NotImplementedError, match="float64"):
        sycl.quantized_attention_backward(doubles[0], None, *doubles, 0.1, False, None, None)


def test_nothing_to_attend(sycl):
    """No keys at all: zeros and lse -inf; no queries: empty results; gradients zero."""
    q, k, v = make_qkv(2, 2, 1, 20, 0, 64, torch.float16, seed=6)
    out, lse = sycl.quantized_attention(q, k, v, None, None, None, 0.125, False, "per_block", "fp16", None, None)
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    assert all(torch.all(g == 0) for g in sycl.quantized_attention_backward(q, None, q, k, v, 0.125, True, None, None))
    q, k, v = make_qkv(2, 2, 1, 0, 30, 64, torch.float16, seed=6)
    out, lse = sycl.quantized_attention(q, k, v, None, None, None, 0.125, True, "per_block", "fp8", None, None)
    assert out.shape == q.shape and lse.shape == (2, 2, 0)


# ---- backward ----

@pytest.mark.parametrize("head_size, dtype", CASES, ids=CASE_IDS)
def test_backward_matches_reference(sycl, head_size, dtype):
    """dq, dk, dv of exact attention: GQA, full and causal (Nq < Nk and Nq > Nk), with and
    without the lse's gradient."""
    gen = torch.Generator().manual_seed(8)
    for causal, nq, nk, lse_grad in ((False, 70, 101, False), (True, 70, 101, True), (True, 130, 67, True)):
        q, k, v = make_qkv(1, 4, 2, nq, nk, head_size, dtype, key_offset=2.0, seed=7)
        grad_out = torch.randn(q.shape, generator=gen).to(dtype)
        grad_lse = torch.randn(q.shape[:3], generator=gen) if lse_grad else None
        args = (grad_out, grad_lse, q, k, v, head_size ** -0.5, causal, None, None)
        got, want = sycl.quantized_attention_backward(*args), reference.attention_backward(*args)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            error = error_in_ulps(a, b, dtype)
            print(f"\n{dtype} causal={causal} Nq={nq} Nk={nk} {name}: {error:.2f} ulp", end="")
            assert a.dtype == dtype and error <= (1.0 if dtype != torch.float32 else 64.0), (name, causal, error)


def test_backward_of_packed_sequences(sycl):
    """Empty query and key sequences; gradients of rows in no attention are 0."""
    q_lens, k_lens = [20, 0, 45, 7], [30, 10, 45, 0]
    cu_q, cu_k = (torch.tensor([0] + lens).cumsum(0) for lens in (q_lens, k_lens))
    q, _, _ = make_qkv(1, 4, 2, sum(q_lens), 1, 128, torch.float32, seed=9)
    _, k, v = make_qkv(1, 4, 2, 1, sum(k_lens), 128, torch.float32, seed=10)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))
    args = (grad_out, None, q, k, v, 0.1, True, cu_q, cu_k)
    got = sycl.quantized_attention_backward(*args)
    for a, b in zip(got, reference.attention_backward(*args)):
        assert error_in_ulps(a, b, torch.float32) <= 64.0
    assert torch.all(got[0][:, :, 65:] == 0) and torch.all(got[1][:, :, 30:40] == 0)

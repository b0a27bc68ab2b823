"""The Triton backend of quantized_attention (``triton_impl.quantized_attention``) against the
reference, tightly, under the Triton interpreter (CPU tensors).

Both backends get the same inputs and the same smoothing (key and query means, and the key bias
that returns what Q smoothing took out), so the int8 values and scales (and V's e4m3 values and
scales) are the reference's bit for bit, checked directly, NaN and inf included.
The rest differs only in float32 rounding: summation order, and ``exp2`` / ``log2`` to an ulp.
Measured on these inputs: float16 and bfloat16 outputs within 0.4 ulp of the largest output
(about 0.1% of them differ at all), float32 outputs within 2 float32 ulps, except that with
``pv_dtype="fp16"`` an ulp of ``exp2`` now and then moves a P across a float16 rounding boundary
(about 450 float32 ulps of the largest output, a tenth of one float16 step of P); the lse within
3e-6; gradients (exact attention, FlashAttention-2 kernels) within 0.3 ulp of the largest
gradient for 16-bit inputs and 12 float32 ulps (relative RMSE 1e-6) for float32.

The interpreter takes blocks of up to 512 rows (its cost is per program); the tiles a GPU launch
uses (``default_config(..., interpreted=False)``: 128 query rows, several per sequence, 32-row
steps in the dK/dV kernel) run here too, explicitly. Run with ``-s`` to see the measured figures.
"""

from __future__ import annotations

import functools

import math

import pytest
import torch

import torch_kernels
from test_quantized_attention import make_qkv
from harness import require_backend
from torch_kernels import backends
from torch_kernels.reference import quantized_attention as reference

pytestmark = pytest.mark.usefixtures("triton_available")

CASES = [(64, torch.float16), (96, torch.bfloat16), (128, torch.float32)]  # (head size, dtype)
EPS = {dtype: torch.finfo(dtype).eps for dtype in (torch.float16, torch.bfloat16, torch.float32)}


@pytest.fixture
def triton_available():
    require_backend("triton")


@pytest.fixture
def kernels():
    from triton_impl import quantized_attention

    return quantized_attention


def ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest difference in ulps of ``dtype`` at the largest |want| (NaN, inf where ``want``'s are)."""
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    assert torch.equal(got[~finite].nan_to_num(), want[~finite].nan_to_num())  # NaN where NaN, inf where inf
    if not finite.any():
        return 0.0
    scale = want[finite].abs().max().clamp_min(1e-30)
    return ((got[finite] - want[finite]).abs().max() / scale / EPS[dtype]).item()


def lse_error(lse: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |difference| of the finite entries; -inf (rows that see no key) where ``want``'s."""
    assert torch.equal(lse == -math.inf, want == -math.inf) and not lse.isnan().any()
    finite = want.isfinite()
    return (lse[finite] - want[finite]).abs().max().item() if finite.any() else 0.0


def out_tolerance(dtype: torch.dtype, pv_dtype: str) -> float:
    """Output ulps allowed (module docstring): float32 outputs of float16 P may differ by a P moved
    across a float16 rounding boundary, a float16 ulp of P (2^-11) at most."""
    if dtype != torch.float32:
        return 1.0
    return 2.0 ** -11 / EPS[torch.float32] if pv_dtype == "fp16" else 8.0


qkv = functools.partial(make_qkv, key_offset=2.0)  # keys offset per channel by default
SMOOTHINGS = [(True, True), (False, False), (True, False), (False, True)]  # (smooth_q, smooth_k)


def kernel_args(q, k, v, sm_scale, causal, granularity, pv_dtype, smooth_q=True, smooth_k=True, cu_seqlens_q=None,
                cu_seqlens_k=None):
    """The backends' arguments, smoothed as the op smooths (``reference.smoothing``)."""
    smoothing = reference.smoothing(q, k, sm_scale, smooth_q, smooth_k, cu_seqlens_q, cu_seqlens_k)
    return (q, k, v, *smoothing, sm_scale, causal, granularity, pv_dtype, cu_seqlens_q, cu_seqlens_k)


# ---- quantization ----

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_quantization_is_the_references_bit_for_bit(kernels, dtype):
    """int8 values and per-row scales of queries (sm_scale * log2(e) folded in) and smoothed keys,
    every granularity, odd lengths, an all-zero head, a NaN and an inf (their groups' scales inf,
    entries 0); V's e4m3 values and per-channel scales (a NaN channel's scale 1, as the reference's)."""
    for n, d in ((1, 64), (200, 96)):
        gen = torch.Generator().manual_seed(n)
        x = (3 * torch.randn(2, 3, n, d, generator=gen)).to(dtype)
        x[1, 2] = 0
        x[0, 1, n // 2, 3] = float("nan")
        x[1, 0, n - 1, 0] = float("inf")
        mean = reference.sequence_mean(x)
        folded = torch.tensor(0.1 * reference.LOG2E, dtype=torch.float32).item()
        for granularity in reference.GRANULARITIES:
            k8, k_scale = kernels.quantize(x, mean, 1.0, "k", granularity)
            for q_mean in (None, mean):  # queries unsmoothed and smoothed
                q8, q_scale = kernels.quantize(x, q_mean, folded, "q", granularity)
                for b in range(2):
                    want = reference.quantize_queries(x[b], None if q_mean is None else q_mean[b], 0.1, granularity)
                    assert torch.equal(q8[b], want[0]) and torch.equal(q_scale[b], want[1]), (n, granularity)
            for b in range(2):
                want_k8, want_k_scale = reference.quantize_keys(x[b], mean[b], granularity)
                assert torch.equal(k8[b], want_k8) and torch.equal(k_scale[b], want_k_scale), (n, granularity)
        v8, v_scale = kernels.quantize_values_fp8(x)
        for b in range(2):
            want_v8, want_scale = reference.quantize_values_fp8(x[b])
            assert torch.equal(v_scale[b], want_scale)
            assert torch.equal(v8[b].nan_to_num(1234.0), want_v8.float().nan_to_num(1234.0))


def test_quantization_of_packed_sequences(kernels):
    """Groups start at each sequence's first token, each sequence smoothed by its own mean (queries
    too); empty sequences; V's scales per sequence."""
    lengths = [37, 0, 130, 70, 5, 9]
    cu = torch.tensor([0] + lengths).cumsum(0)
    x = (torch.randn(1, 2, sum(lengths), 64, generator=torch.Generator().manual_seed(1)) + 3).half()
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    x += (sequence[:, None] * torch.linspace(-1, 1, 64)).half()  # means that differ between the sequences
    mean = reference.sequence_mean(x, cu)
    v8, v_scale = kernels.quantize_values_fp8(x, cu)
    for granularity in reference.GRANULARITIES:
        q8, q_scale = kernels.quantize(x, mean, 0.25, "q", granularity, cu)
        k8, k_scale = kernels.quantize(x, mean, 1.0, "k", granularity, cu)
        for s in range(len(lengths)):
            rows = slice(int(cu[s]), int(cu[s + 1]))
            want = reference.quantize_int8((x[0, :, rows].float() - mean[s][:, None]) * 0.25,
                                           *reference.row_groups(lengths[s], "q", granularity))
            assert torch.equal(q8[0, :, rows], want[0]) and torch.equal(q_scale[0, :, rows], want[1])
            want = reference.quantize_keys(x[0, :, rows], mean[s], granularity)
            assert torch.equal(k8[0, :, rows], want[0]) and torch.equal(k_scale[0, :, rows], want[1])
            if lengths[s]:
                want = reference.quantize_values_fp8(x[0, :, rows])
                assert torch.equal(v8[0, :, rows], want[0].float()) and torch.equal(v_scale[s], want[1])


def test_e4m3_rounding_at_every_boundary(kernels):
    """V's rounding onto e4m3 (done in float32 under the interpreter, whose own cast is wrong)
    equals torch's cast at every midpoint between e4m3 values, just beside each, and in the
    subnormals; the channel's amax is 448, so its scale is 1 and the values are rounded as given."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0)].unique()
    mid = (grid[1:] + grid[:-1]) / 2
    values = torch.cat([grid, mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e9)),
                        torch.rand(2000, generator=torch.Generator().manual_seed(2)) * 2 ** -6])
    values = torch.cat([values, -values])
    v = values.view(1, 1, -1, 1).expand(1, 1, -1, 64).contiguous()
    v8, scale = kernels.quantize_values_fp8(v)
    assert torch.all(scale == 1)
    assert torch.equal(v8[0, 0, :, 0], values.to(torch.float8_e4m3fn).float())


# ---- forward ----

@pytest.mark.parametrize("pv_dtype", reference.PV_DTYPES)
@pytest.mark.parametrize("head_size, dtype", CASES, ids=[f"D{d}-{str(t)[6:]}" for d, t in CASES])
def test_forward_matches_reference(kernels, head_size, dtype, pv_dtype):
    """GQA 4:2, Nq != Nk, full and bottom-right causal, queries with per-channel offsets, every
    granularity and every combination of Q and K smoothing."""
    q, k, v = qkv(1, 4, 2, 131, 197, head_size, dtype, seed=head_size, query_offset=4.0)
    turn = reference.PV_DTYPES.index(pv_dtype)  # every granularity with every pv_dtype over the head sizes
    granularities = reference.GRANULARITIES[turn:] + reference.GRANULARITIES[:turn]
    smoothing = SMOOTHINGS[1 + (turn + CASES.index((head_size, dtype))) % 3]  # the other three over the cases
    for causal, granularity, (smooth_q, smooth_k) in ((False, granularities[0], SMOOTHINGS[0]),
                                                      (True, granularities[1], smoothing)):
        args = kernel_args(q, k, v, head_size ** -0.5, causal, granularity, pv_dtype, smooth_q, smooth_k)
        out, lse = kernels.quantized_attention(*args)
        want, want_lse = reference.quantized_attention(*args)
        error = ulps(out, want, dtype)
        lse_diff = lse_error(lse, want_lse)
        print(f"\n{dtype} D={head_size} {pv_dtype} causal={causal} {granularity} smooth_q={smooth_q} "
              f"smooth_k={smooth_k}: out {error:.2f} ulp, lse {lse_diff:.1e}", end="")
        assert out.dtype == dtype and error <= out_tolerance(dtype, pv_dtype), (causal, granularity, error)
        assert lse_diff < 1e-5


def test_forward_with_a_gpus_tiles(kernels):
    """The launch a GPU makes (128 query rows a program, several tiles per sequence, each walking
    only the key tiles its last row sees; 32 or 64 rows for float32 P.V) equals the reference too."""
    for (head_size, dtype), pv_dtype in zip(CASES, ("fp8", "fp16", "none")):
        q, k, v = qkv(1, 4, 1, 300, 280, head_size, dtype, seed=3, query_offset=4.0)
        config = kernels.default_config("forward", head_size, dtype, pv_dtype)
        for causal in (False, True):
            args = kernel_args(q, k, v, 0.1, causal, "per_thread", pv_dtype)
            out, lse = kernels.quantized_attention(*args, config=config)
            want, want_lse = reference.quantized_attention(*args)
            assert ulps(out, want, dtype) <= out_tolerance(dtype, pv_dtype), (dtype, causal)
            assert lse_error(lse, want_lse) < 1e-5
    with pytest.raises(ValueError, match="block_n"):
        kernels.quantized_attention(*args, config=kernels.Config(block_m=64, block_n=32))


def test_packed_sequences_match_reference(kernels):
    """Packed sequences with an empty query sequence, Nq > Nk (causal rows that see no key: 0 and
    lse -inf), an empty key sequence, at the interpreter's blocks and at a GPU's; GQA 4:2, queries
    offset differently in each sequence, smoothed by their own sequence's mean, whose scores every
    key gets back through its sequence's key bias (dropping the bias changes the results)."""
    q_lens, k_lens = [37, 0, 130, 70, 5, 9], [50, 20, 130, 70, 3, 0]
    cu_q = torch.tensor([0] + q_lens).cumsum(0)
    cu_k = torch.tensor([0] + k_lens).cumsum(0)
    q, _, _ = qkv(1, 4, 2, sum(q_lens), 1, 64, torch.float16, seed=4)
    _, k, v = qkv(1, 4, 2, 1, sum(k_lens), 64, torch.float16, seed=5, key_offset=5.0)
    offsets = 3 * torch.randn(len(q_lens), 4, 64, generator=torch.Generator().manual_seed(6))  # per sequence, head
    q = (q + offsets.repeat_interleave(torch.tensor(q_lens), dim=0).transpose(0, 1)).half()
    for pv_dtype, config in (("fp16", None), ("fp8", kernels.default_config("forward", 64))):
        args = kernel_args(q, k, v, 0.125, True, "per_thread", pv_dtype, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        out, lse = kernels.quantized_attention(*args, config=config)
        want, want_lse = reference.quantized_attention(*args)
        assert ulps(out, want, torch.float16) <= 1.0
        assert (lse == -math.inf).any() and lse_error(lse, want_lse) < 1e-5
        assert torch.all(out[0, :, int(cu_q[5]):] == 0)  # the sequence with no keys
    without_bias, _ = kernels.quantized_attention(*args[:5], None, *args[6:])
    assert ulps(without_bias, want, torch.float16) > 100


def test_nothing_to_attend(kernels):
    """No keys at all: zeros and lse -inf; no queries: empty results."""
    q, k, v = qkv(2, 2, 1, 20, 0, 64, torch.float16, seed=6)
    out, lse = kernels.quantized_attention(*kernel_args(q, k, v, 0.125, False, "per_block", "fp16"))
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    q, k, v = qkv(2, 2, 1, 0, 30, 64, torch.float16, seed=6)
    out, lse = kernels.quantized_attention(*kernel_args(q, k, v, 0.125, True, "per_block", "fp8"))
    assert out.shape == q.shape and lse.shape == (2, 2, 0)


# ---- backward ----

@pytest.mark.parametrize("head_size, dtype", CASES, ids=[f"D{d}-{str(t)[6:]}" for d, t in CASES])
def test_backward_matches_reference(kernels, head_size, dtype):
    """dq, dk, dv of exact attention: GQA, full and causal, with and without the lse's gradient, at
    the interpreter's blocks and a GPU's."""
    q, k, v = qkv(2, 4, 2, 70, 101, head_size, dtype, seed=7)
    gen = torch.Generator().manual_seed(8)
    grad_out, grad_lse = torch.randn(q.shape, generator=gen).to(dtype), torch.randn(q.shape[:3], generator=gen)
    gpu = tuple(kernels.default_config(kernel, head_size, dtype) for kernel in ("backward_dq", "backward_dkdv"))
    tolerance = 1.0 if dtype != torch.float32 else 32.0
    for causal, lse_grad, configs in ((False, None, None), (True, grad_lse, None), (True, grad_lse, gpu)):
        batch = 1 if configs else 2  # a GPU's float32 tiles are 16 rows: many programs for the interpreter
        args = (grad_out[:batch], None if lse_grad is None else lse_grad[:batch], q[:batch], k[:batch], v[:batch],
                head_size ** -0.5, causal, None, None)
        got = kernels.quantized_attention_backward(*args, configs=configs)
        want = reference.attention_backward(*args)
        for name, a, b in zip(("dq", "dk", "dv"), got, want):
            error = ulps(a, b, dtype)
            print(f"\n{dtype} causal={causal} {'gpu tiles' if configs else ''} {name}: {error:.2f} ulp", end="")
            assert a.dtype == dtype and error <= tolerance, (name, causal, configs, error)


def test_backward_with_a_gpus_16_bit_products_is_as_accurate_as_the_reference(kernels, monkeypatch):
    """The GPU's float16 arithmetic, run here: the interpreter's float16 ``tl.dot`` multiplies
    exactly and accumulates in float32, as the MMA does, so with 16-bit operands forced (on CPU
    tensors the backward otherwise computes in float32) each gradient must be as close to the
    float32 truth as the reference's own, element by element (tests/harness.py's measure). Keys
    and queries with shared offsets: P or dS rounded once to float16 made dQ 7 to 24x worse here
    (and on an H200), as ``dS K`` cancels the keys' mean but not dS's rounding errors."""
    monkeypatch.setattr(kernels, "_low_precision", lambda dtype, interpreted: dtype == torch.float16)
    dtype = torch.float16
    q, k, v = make_qkv(2, 4, 2, 70, 101, 64, dtype, key_offset=5.0, query_offset=5.0, seed=7)
    gen = torch.Generator().manual_seed(8)
    grad_out, grad_lse = torch.randn(q.shape, generator=gen), torch.randn(q.shape[:3], generator=gen)
    gpu = tuple(kernels.default_config(kernel, 64, dtype) for kernel in ("backward_dq", "backward_dkdv"))

    def error(got, truth):
        floor = 0.01 * truth.abs().max()
        return ((got.double() - truth.double()).abs() / (truth.double().abs() + floor)).max().item()

    for causal, lse_grad, configs in ((True, None, None), (False, grad_lse, gpu)):
        args = (grad_out.to(dtype), lse_grad, q, k, v, 0.125, causal, None, None)
        got = kernels.quantized_attention_backward(*args, configs=configs)
        want = reference.attention_backward(*args)
        truth = reference.attention_backward(grad_out, lse_grad, q.float(), k.float(), v.float(), 0.125, causal,
                                             None, None)
        for name, a, b, t in zip(("dq", "dk", "dv"), got, want, truth):
            print(f"\nfloat16 products causal={causal} {name}: {error(a, t):.2e}, reference {error(b, t):.2e}", end="")
            assert error(a, t) <= 1.1 * error(b, t), (name, causal, error(a, t), error(b, t))


def test_backward_of_packed_sequences(kernels):
    q_lens, k_lens = [20, 0, 45, 7], [30, 10, 45, 0]
    cu_q = torch.tensor([0] + q_lens).cumsum(0)
    cu_k = torch.tensor([0] + k_lens).cumsum(0)
    q, _, _ = qkv(1, 4, 2, sum(q_lens), 1, 96, torch.float32, seed=9)
    _, k, v = qkv(1, 4, 2, 1, sum(k_lens), 96, torch.float32, seed=10)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))
    args = (grad_out, None, q, k, v, 0.1, True, cu_q, cu_k)
    for got, want in zip(kernels.quantized_attention_backward(*args), reference.attention_backward(*args)):
        assert ulps(got, want, torch.float32) <= 32.0


# ---- declining ----

def test_other_head_sizes_and_fp8_without_hardware_are_declined(kernels):
    """Head size 32 goes to the next backend; fp8 P.V is declined on a device without e4m3 MMA."""
    q, k, v = qkv(1, 2, 1, 10, 10, 32, torch.float16, seed=12)
    with pytest.raises(NotImplementedError, match="head size 32"):
        kernels.quantized_attention(q, k, v, None, None, None, 0.1, False, "per_block", "fp16", None, None)
    with pytest.raises(NotImplementedError, match="head size 32"):
        kernels.quantized_attention_backward(q, None, q, k, v, 0.1, False, None, None)
    torch_kernels.quantized_attention(q, k, v, implementation=["triton", "reference"])
    assert backends.last_backend("quantized_attention") == "reference"
    with pytest.raises(RuntimeError, match="head size 32"):
        torch_kernels.quantized_attention(q, k, v, implementation="triton")
    with pytest.raises(NotImplementedError, match="fp8"):
        kernels.quantized_attention(*(torch.empty(1, 2, 10, 64, device="meta") for _ in range(3)), None, None, None,
                                    0.1, False, "per_block", "fp8", None, None)

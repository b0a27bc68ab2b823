"""The pallas backend of quantized_attention: the Pallas kernels (TPU interpret mode) against the
torch reference, tightly.

Both backends get the same inputs and the same smoothing (the op computes the key and query means
and the key bias once), so they quantize to the same int8 values and scales, bit for bit (checked
directly); what may differ is float32 rounding in the softmax and P.V: accumulation order, and
exp2 / log2 / division to an ulp. An exp2 an ulp off can also move a P across a rounding boundary
of float16 (about one P in 5000) or e4m3, which moves its row by up to one step of P times |v|.
Measured: 16-bit outputs 99.8% to 100% identical, the rest one ulp apart except rows with such a P
(up to 4 float16 ulps, in 0.3% of the rows); float32 outputs within 2 ulps of the largest (3e-5
where P is rounded to float16); the lse within 2.4e-6 relative; gradients (exact attention,
FlashAttention-2 kernels) within 6e-7 relative RMSE in float32 (4e-5 for bfloat16 gradients, which
round to bfloat16). Also: the rounding of P done with integer arithmetic (Mosaic has no float16 or
float8 conversions) against real casts, packed sequences with empty ones and causal rows that see
nothing, GQA and MQA, Q smoothing on and off (each key's bias from its own sequence's query mean),
the smoothing pure JAX computes, small blocks that skip causal blocks, head sizes declined,
nothing to compute, ``jax.grad`` in pure JAX, the TPU lowering (and, where TORCH_KERNELS_LIBTPU names a folder holding libtpu, Mosaic's compile
for TPU v5e, v6e and v5p), and torchax tensors.

Run with ``-s`` to see the measured differences.
"""

from __future__ import annotations

import functools

import math

import numpy as np
import pytest
import torch

import torch_kernels
from torch_kernels import backends
from torch_kernels.reference import quantized_attention as reference

from harness import assert_compiles_for_tpu_generations, assert_lowers_for_tpu, require_backend, run_isolated
from test_quantized_attention import each_channel_at, make_qkv as shared_make_qkv

pytestmark = pytest.mark.usefixtures("pallas")

DTYPES = {64: torch.float16, 96: torch.bfloat16, 128: torch.float32}


@pytest.fixture(scope="module")
def pallas():
    require_backend("pallas")


def _kernels():
    from jax_impl import quantized_attention

    return quantized_attention


def ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest difference in units in the last place of ``dtype`` at ``want``, floored at the
    ulp of a 64th of the largest |want| (an output near 0 is a sum that cancels: float32 summation
    order moves it by float32 ulps of its terms, not of itself); float32 outputs: in float32 ulps
    of the largest |want|."""
    got, want = got.double(), want.double()
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and torch.equal(got[~finite].isnan(), want[~finite].isnan())
    got, want = got[finite], want[finite]
    if not want.numel():
        return 0.0
    info = torch.finfo(dtype)
    if dtype == torch.float32:
        return ((got - want).abs().max() / (want.abs().max() * info.eps)).item()
    magnitude = want.abs().clamp_min(max(info.smallest_normal, want.abs().max().item() / 64))
    ulp = info.eps * torch.exp2(torch.floor(torch.log2(magnitude)))
    return ((got - want).abs() / ulp).max().item()


make_qkv = functools.partial(shared_make_qkv, key_offset=3.0)  # keys offset per channel by default


def both(q, k, v, **kwargs):
    """(pallas, reference) results of the op: each ``(out, lse)``."""
    results = []
    for backend in ("pallas", "reference"):
        results.append(torch_kernels.quantized_attention(q, k, v, return_lse=True, implementation=backend, **kwargs))
        assert backends.last_backend("quantized_attention") == backend
    return results


def p_step(pv_dtype: str, dtype: torch.dtype) -> float:
    """The relative spacing of P as P.V reads it (float16: 2^-10, e4m3: 2^-3, bfloat16: 2^-7)."""
    if pv_dtype == "fp8":
        return 2.0 ** -3
    if pv_dtype == "fp16" or dtype == torch.float16:
        return 2.0 ** -10
    return 2.0 ** -7 if dtype == torch.bfloat16 else 0.0


def assert_tight(name, got, want, dtype, pv_dtype, v, lse_error=3e-6):
    """Outputs within one ulp of ``dtype`` (float32: two float32 ulps of the largest output) but
    in at most 5% of the rows, and those within what one P moved by one step of its rounding
    costs: exp2 differs by an ulp between implementations (in 80% of arguments), and an ulp can
    cross a rounding boundary of P (about one P in 5000 for float16), which moves a whole row by
    up to ``step * max |v|``. The lse within ``lse_error`` relative to max(1, |lse|), -inf where
    the reference has it."""
    (out, lse), (want_out, want_lse) = got, want
    assert out.dtype == want_out.dtype and out.shape == want_out.shape and lse.shape == want_lse.shape
    assert torch.equal(lse == -math.inf, want_lse == -math.inf), name
    seen = want_lse > -math.inf
    lse_diff = ((lse[seen] - want_lse[seen]).abs() / want_lse[seen].abs().clamp_min(1)).max().item() if seen.any() \
        else 0.0
    error = ulps(out, want_out, dtype)
    one_ulp = 2.0 if dtype == torch.float32 else 1.0
    per_element = (out.double() - want_out.double()).abs()
    finite = torch.isfinite(want_out)
    beyond = ((per_element > ulps_allowance(want_out, dtype)) & finite).any(dim=-1).double().mean().item()
    flip = p_step(pv_dtype, dtype) * v.double().abs().max().item()
    same = (out == want_out).double().mean().item()
    print(f"\n{name}: out {error:.2f} ulp max, {100 * same:.2f}% identical, rows beyond {one_ulp:g} ulp "
          f"{100 * beyond:.2f}% (max |diff| {per_element[finite].max().item():.1e}, one P step {flip:.1e}), "
          f"lse {lse_diff:.1e}", end="")
    assert error <= one_ulp or (beyond <= 0.05 and per_element[finite].max().item() <= flip), (name, error, beyond)
    assert lse_diff <= lse_error, (name, lse_diff)


def ulps_allowance(want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One ulp of ``dtype`` at each |want| as :func:`ulps` measures it (float32: two of the largest)."""
    want = want.double()
    info = torch.finfo(dtype)
    largest = want[torch.isfinite(want)].abs().max().item() if torch.isfinite(want).any() else 0.0
    if dtype == torch.float32:
        return torch.full_like(want, 2 * largest * info.eps)
    magnitude = want.abs().clamp_min(max(info.smallest_normal, largest / 64))
    return info.eps * torch.exp2(torch.floor(torch.log2(magnitude)))


# ---- the rounding of P without float16 or float8 ----

def test_rounding_emulation_equals_casts():
    """Every float32 bit pattern class that P takes (0, subnormals of the narrow type, normals,
    ties both ways, the top of the range, NaN), against real float16 / e4m3fn casts."""
    import jax
    import jax.numpy as jnp

    kernels = _kernels()
    gen = np.random.default_rng(0)
    for fn, dtype, top, smallest in ((kernels.round_to_float16, jnp.float16, 1.0, 2.0 ** -24),
                                     (kernels.round_to_e4m3, jnp.float8_e4m3fn, 448.0, 2.0 ** -9)):
        grid = np.concatenate([
            gen.uniform(0, top, 200_000), top * gen.uniform(0, 1, 100_000) ** 8,  # dense near 0
            np.exp2(gen.uniform(np.log2(smallest) - 3, np.log2(top), 100_000)),
            np.arange(0, 2 ** 12) * smallest / 2,  # ties and subnormals, exactly
            [0.0, top, smallest / 2, smallest * 1.5, smallest * 2.5, np.nan]]).astype(np.float32)
        grid = np.concatenate([grid, np.nextafter(grid, np.float32(np.inf)), np.nextafter(grid, np.float32(0))])
        grid = grid[~(grid > top)]
        got = np.asarray(jax.jit(fn)(grid))
        want = np.asarray(jnp.asarray(grid).astype(dtype).astype(jnp.float32))
        np.testing.assert_array_equal(got, want)


# ---- the int8 values and scales ----

@pytest.mark.parametrize("granularity", reference.GRANULARITIES)
def test_quantization_is_the_references_bit_for_bit(granularity):
    """Packed sequences (an empty one, lengths off the group sizes), GQA, float16, keys and queries
    with offsets, queries smoothed by their sequence's mean and not; the fp8 values of V and their
    per-channel scales too."""
    import jax.numpy as jnp

    kernels = _kernels()
    q_lens, k_lens = [70, 0, 131, 33], [65, 9, 200, 1]
    q, k, v = make_qkv(1, 4, 2, sum(q_lens), sum(k_lens), 64, torch.float16, seed=1, query_offset=5.0)
    k[0, 0, 3, 5] = float("nan")  # its group: infinite scale, entries 0
    cu_q, cu_k = (torch.tensor([0] + lens).cumsum(0) for lens in (q_lens, k_lens))
    k_mean, q_mean = reference.sequence_mean(k, cu_k), reference.sequence_mean(q, cu_q)
    arrays = [jnp.asarray(t.numpy()) for t in (q, k, v)]
    means = dict(k_mean=jnp.asarray(k_mean.numpy()), q_mean=jnp.asarray(q_mean.numpy()))
    for smooth_q in (True, False):
        q8, q_scale, k8, k_scale, v_read, v_scale = kernels.quantize_inputs(
            *arrays, 0.1, granularity, "fp8", cu_seqlens_q=tuple(cu_q.tolist()), cu_seqlens_k=tuple(cu_k.tolist()),
            smooth_q=smooth_q, k_mean=means["k_mean"], q_mean=means["q_mean"] if smooth_q else None)
        as_torch = [torch.from_numpy(np.asarray(x.astype(jnp.float32)).copy()) for x in (q8, q_scale)]
        for s, (q0, q1) in enumerate(zip(cu_q[:-1], cu_q[1:])):
            want_q8, want_qs = reference.quantize_queries(q[0, :, q0:q1], q_mean[s] if smooth_q else None, 0.1,
                                                          granularity)
            assert torch.equal(as_torch[0][0, :, q0:q1], want_q8.float()), (s, smooth_q)
            assert torch.equal(as_torch[1][0, :, q0:q1], want_qs), (s, smooth_q)
    as_torch = [torch.from_numpy(np.asarray(x.astype(jnp.float32)).copy()) for x in (k8, k_scale, v_read)]
    for s, (k0, k1) in enumerate(zip(cu_k[:-1], cu_k[1:])):
        want_k8, want_ks = reference.quantize_keys(k[0, :, k0:k1], k_mean[s], granularity)
        assert torch.equal(as_torch[0][0, :, k0:k1], want_k8.float())
        assert torch.equal(as_torch[1][0, :, k0:k1].isinf(), want_ks.isinf())
        assert torch.equal(as_torch[1][0, :, k0:k1], want_ks)
        if k1 > k0:
            want_v8, want_vs = reference.quantize_values_fp8(v[0, :, k0:k1])
            assert torch.equal(as_torch[2][0, :, k0:k1], want_v8.float())
            assert torch.equal(torch.from_numpy(np.asarray(v_scale[s]).copy()), want_vs)


# ---- forward against the reference ----

# (pv_dtype, head size, granularity, causal): every pv_dtype with every input dtype, every
# granularity and both masks (one program compiles per case: about 3 s in interpret mode)
CASES = [
    ("fp16", 64, "per_block", True), ("fp16", 96, "per_warp", False), ("fp16", 128, "per_thread", True),
    ("fp8", 64, "per_warp", True), ("fp8", 96, "per_thread", True), ("fp8", 128, "per_block", False),
    ("none", 64, "per_thread", False), ("none", 96, "per_block", True), ("none", 128, "per_warp", True),
]


@pytest.mark.parametrize("pv_dtype, head_size, granularity, causal", CASES,
                         ids=[f"{p}-D{d}-{g}-{'causal' if c else 'full'}" for p, d, g, c in CASES])
def test_forward_matches_reference(pv_dtype, head_size, granularity, causal):
    """GQA 6:2, Nq < Nk (bottom-right causal), odd lengths over several query and key blocks,
    queries with per-channel offsets smoothed and not (one program: Q smoothing off is a zero
    mean and bias)."""
    dtype = DTYPES[head_size]
    q, k, v = make_qkv(2, 6, 2, 150, 301, head_size, dtype, seed=head_size, query_offset=4.0)
    for smooth_q in (True, False):
        got, want = both(q, k, v, causal=causal, granularity=granularity, pv_dtype=pv_dtype, smooth_q=smooth_q)
        assert_tight(f"{dtype} D={head_size} {granularity} {pv_dtype} causal={causal} smooth_q={smooth_q}", got, want,
                     dtype, pv_dtype, v)


@pytest.mark.parametrize("pv_dtype", ["fp16", "fp8"])
def test_packed_sequences_match_reference(pv_dtype):
    """Packed (NHD): an empty query sequence, Nq > Nk (causal rows that see nothing), an empty
    key sequence, sequences longer than a block; MQA 8:1; a NaN in one key group of one sequence;
    queries offset differently in each sequence and head, smoothed by their sequence's mean, whose
    scores each key gets back through its own sequence's key bias (without it the results differ)."""
    import jax.numpy as jnp

    q_lens, k_lens = [37, 0, 300, 70, 5, 9, 129], [50, 20, 280, 70, 3, 0, 600]
    hq, hkv, d = 8, 1, 64
    q, k, v = make_qkv(1, hq, hkv, sum(q_lens), sum(k_lens), d, torch.bfloat16, seed=2)
    offsets = 3 * torch.randn(len(q_lens), hq, d, generator=torch.Generator().manual_seed(3))
    q = (q + offsets.repeat_interleave(torch.tensor(q_lens), dim=0).transpose(0, 1)).to(q.dtype)
    k[0, 0, 100] = float("nan")  # sequence 2's first key group
    cu_q = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + k_lens).cumsum(0).to(torch.int32)
    nhd = [t.transpose(1, 2) for t in (q, k, v)]
    got, want = both(*nhd, causal=True, layout="NHD", granularity="per_thread", pv_dtype=pv_dtype,
                     cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert torch.equal(got[0].isnan(), want[0].isnan()) and want[0].isnan().any()
    assert_tight(f"packed {pv_dtype}", got, want, torch.bfloat16, pv_dtype, v)
    k_mean, q_mean, bias = reference.smoothing(q, k, d ** -0.5, True, True, cu_q, cu_k)
    offsets = [tuple(cu.tolist()) for cu in (cu_q, cu_k)]
    without_bias, _ = _kernels().quantized_attention(
        *(jnp.asarray(t.float().numpy()).astype(jnp.bfloat16) for t in (q, k, v)), None, True, "per_thread", pv_dtype,
        True, *offsets, k_mean=jnp.asarray(k_mean.numpy()), q_mean=jnp.asarray(q_mean.numpy()),
        key_bias=jnp.zeros(bias.shape))
    without_bias = torch.from_numpy(np.array(without_bias.astype(jnp.float32)))
    assert ulps(without_bias, want[0].transpose(1, 2).float(), torch.bfloat16) > 100


def test_smoothing_off_and_explicit_scale():
    q, k, v = make_qkv(1, 2, 2, 64, 64, 128, torch.float16, seed=3, key_offset=0.5, query_offset=2.0)
    for smooth_q in (False, True):
        got, want = both(q, k, v, smooth_k=False, smooth_q=smooth_q, sm_scale=0.3, pv_dtype="none")
        assert_tight(f"unsmoothed keys, smooth_q={smooth_q}", got, want, torch.float16, "none", v)


def test_jax_smoothing_is_the_references():
    """Pure JAX computes the smoothing itself (``smoothing``, as the op does in torch): the same
    means and key bias up to float32 summation order, packed (with empty sequences) and not, GQA;
    ``q_mean`` and ``key_bias`` go together."""
    import jax.numpy as jnp

    kernels = _kernels()
    q, k, _ = make_qkv(2, 6, 2, 50, 70, 64, torch.float32, seed=13, query_offset=5.0)
    packed = (torch.tensor([0, 20, 20, 50]), torch.tensor([0, 0, 30, 70]))
    for cu_q, cu_k, batch in ((None, None, 2), (*packed, 1)):
        for smooth_q, smooth_k in ((True, True), (True, False), (False, True)):
            want = reference.smoothing(q[:batch], k[:batch], 0.3, smooth_q, smooth_k, cu_q, cu_k)
            offsets = [None if cu is None else tuple(cu.tolist()) for cu in (cu_q, cu_k)]
            got = kernels.smoothing(jnp.asarray(q[:batch].numpy()), jnp.asarray(k[:batch].numpy()), 0.3, smooth_q,
                                    smooth_k, *offsets)
            for a, b in zip(got, want):
                assert (a is None) == (b is None)
                if b is not None:
                    torch.testing.assert_close(torch.from_numpy(np.array(a)), b, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="q_mean, key_bias: expected both"):
        kernels.quantized_attention(*(jnp.asarray(t.numpy()) for t in (q, k, k)), q_mean=jnp.zeros((2, 6, 64)))


def test_other_head_sizes_go_to_the_next_backend():
    q, k, v = make_qkv(1, 2, 1, 10, 10, 80, torch.float32, seed=4)
    out = torch_kernels.quantized_attention(q, k, v, implementation=["pallas", "reference"])
    assert backends.last_backend("quantized_attention") == "reference"
    assert torch.equal(out, torch_kernels.quantized_attention(q, k, v, implementation="reference"))
    with pytest.raises(RuntimeError, match="pallas: head size 80 is not supported"):
        torch_kernels.quantized_attention(q, k, v, implementation="pallas")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pure_jax_values_beyond_float16_range(dtype):
    """Pure JAX (and torchax, which calls it), where the op's scaling of V does not run: fp16 P.V
    divides V past float16's range by a power of two per (sequence, head, channel) itself, so
    channels at max |v| 60000 multiplied by 2^20 give exactly 2^20 times their output, no NaN;
    V that fits is not scaled (v_scale 1)."""
    import jax.numpy as jnp

    kernels = _kernels()
    q, k, v = make_qkv(1, 4, 2, 70, 70, 64, torch.float32, seed=13)
    cu = (0, 30, 70)
    v = each_channel_at(v, 60000.0, list(cu))
    arrays = [jnp.asarray(t.numpy()).astype(dtype) for t in (q, k, v, v * 2**20)]
    fits, _ = kernels.quantized_attention(*arrays[:3], None, True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    big, _ = kernels.quantized_attention(*arrays[:2], arrays[3], None, True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    fits, big = (torch.from_numpy(np.array(x.astype(jnp.float32))) for x in (fits, big))
    assert not big.isnan().any()
    assert torch.equal(big, fits * 2**20)
    for values, want in ((arrays[2], 1.0), (arrays[3], 2.0**20)):
        v_scale = kernels.quantize_inputs(*arrays[:2], values, cu_seqlens_q=cu, cu_seqlens_k=cu)[-1]
        assert (np.asarray(v_scale) == want).all()


def test_nothing_to_compute():
    """No batch, no queries, no keys: the reference's zeros and -inf, and zero gradients."""
    for b, nq, nk in ((0, 5, 5), (1, 0, 5), (1, 5, 0)):
        q, k, v = make_qkv(b, 2, 1, nq, nk, 64, torch.float32, seed=5)
        got, want = both(q, k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        grads = torch.ops.torch_kernels.quantized_attention_backward(torch.ones(q.shape), None, q, k, v, 0.125, True,
                                                                    None, None, "pallas")
        assert all(g.shape == t.shape and not g.any() for g, t in zip(grads, (q, k, v)))


# ---- backward against the reference ----

def relative_rmse(got, want) -> float:
    got, want = got.double(), want.double()
    return ((got - want).square().mean().sqrt() / want.square().mean().sqrt().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_matches_reference(dtype):
    """The backward op on packed sequences (causal, GQA 4:2, an empty key sequence, rows that see
    nothing) with an lse cotangent, against the reference's; float32 arithmetic in both."""
    q_lens, k_lens = [150, 7, 40, 3], [260, 0, 30, 130]
    q, k, v = make_qkv(1, 4, 2, sum(q_lens), sum(k_lens), 64, dtype, seed=6)
    gen = torch.Generator().manual_seed(7)
    d_out, d_lse = torch.randn(q.shape, generator=gen).to(dtype), torch.randn(q.shape[:3], generator=gen)
    cu_q = torch.tensor([0] + q_lens).cumsum(0)
    cu_k = torch.tensor([0] + k_lens).cumsum(0)
    op = torch.ops.torch_kernels.quantized_attention_backward
    got = op(d_out, d_lse, q, k, v, 0.125, True, cu_q, cu_k, "pallas")
    assert backends.last_backend("quantized_attention_backward") == "pallas"
    want = op(d_out, d_lse, q, k, v, 0.125, True, cu_q, cu_k, "reference")
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        error = relative_rmse(a, b)
        print(f"\n{dtype} {name}: relative RMSE {error:.1e}", end="")
        assert a.dtype == dtype and error <= (1e-6 if dtype == torch.float32 else 2e-4), (name, error)
    assert not got[0][0, :, 157:167].any()  # rows of sequence 2 that see no key (and sequence 1's: no keys)
    assert not got[0][0, :, 150:157].any()


def test_autograd_through_the_op():
    """Gradients of out and lse through the op (the backward op on pallas) equal the reference's."""
    q, k, v = make_qkv(2, 4, 1, 70, 101, 96, torch.float32, seed=8)
    grads = {}
    for backend in ("pallas", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = torch_kernels.quantized_attention(*leaves, causal=True, return_lse=True, implementation=backend)
        (out.sum() + lse.sum()).backward()
        grads[backend] = [t.grad for t in leaves]
    for a, b in zip(grads["pallas"], grads["reference"]):
        assert relative_rmse(a, b) <= 1e-6


def test_jax_grad_is_the_backward():
    """Pure JAX: jax.grad through the custom_vjp equals attention_backward's gradients."""
    import jax
    import jax.numpy as jnp

    kernels = _kernels()
    q, k, v = (jnp.asarray(t.numpy()) for t in make_qkv(1, 2, 2, 40, 50, 64, torch.float32, seed=9))

    def loss(q, k, v):
        out, lse = kernels.quantized_attention(q, k, v, 0.2, True, "per_warp", "fp8")
        return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    out, lse = kernels.quantized_attention(q, k, v, 0.2, True, "per_warp", "fp8")
    want = kernels.attention_backward(2 * out, jnp.where(jnp.isfinite(lse), 1.0, 0.0), q, k, v, 0.2, True)
    for a, b in zip(grads, want):  # one program against three (fusion may round differently)
        assert relative_rmse(torch.from_numpy(np.array(a)), torch.from_numpy(np.array(b))) <= 1e-6


# ---- the TPU ----

def _lowerings():
    """Forward and gradient at a realistic size for every P.V form (bfloat16 with fp16, fp8 and
    none; float16; float32), GQA 8:2, causal, packed."""
    import jax
    import jax.numpy as jnp

    kernels = _kernels()
    spec = jax.ShapeDtypeStruct
    cases = {}
    for dtype, pv_dtype, head_size in (("bfloat16", "fp16", 128), ("bfloat16", "fp8", 64), ("bfloat16", "none", 96),
                                       ("float16", "none", 64), ("float32", "none", 128)):
        shapes = [spec((1, 8, 2000, head_size), dtype)] + [spec((1, 2, 2000, head_size), dtype)] * 2
        cu = (0, 1000, 1500, 2000)

        def forward(q, k, v, pv_dtype=pv_dtype):
            return kernels.quantized_attention(q, k, v, None, True, "per_thread", pv_dtype, cu_seqlens_q=cu,
                                               cu_seqlens_k=cu, interpret=False)

        def loss(q, k, v, forward=forward):
            out, lse = forward(q, k, v)
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

        cases[f"{dtype}-{pv_dtype}-D{head_size}"] = (forward, shapes)
        cases[f"{dtype}-{pv_dtype}-D{head_size}-grad"] = (jax.grad(loss, argnums=(0, 1, 2)), shapes)
    return cases


LOWERINGS = ["bfloat16-fp16-D128", "bfloat16-fp8-D64-grad", "bfloat16-none-D96", "float16-none-D64-grad",
             "float32-none-D128"]


@pytest.mark.parametrize("name", LOWERINGS)
def test_lowers_for_tpu(name):
    """Mosaic's TPU lowering on CPU (which enforces the TPU block-shape rules)."""
    assert_lowers_for_tpu(*_lowerings()[name])


def test_mosaic_compiles_for_tpu_generations(monkeypatch):
    """Every lowering above (all forms, forward and gradient) through Mosaic and the TPU compiler,
    with libtpu (harness). Minutes: Mosaic compiles 30 programs."""
    assert_compiles_for_tpu_generations(monkeypatch, "test_quantized_attention_pallas")


# ---- torchax ----

def test_torchax_tensors_run_pallas_with_gradients():
    run_isolated(TORCHAX_CHECK)


# torchax registers a 'jax' device for the whole process: a process of its own
TORCHAX_CHECK = """
import pytest, torch, torch_kernels
from test_quantized_attention_pallas import each_channel_at, make_qkv, relative_rmse

env = torch_kernels.torchax_environment()
q, k, v = make_qkv(1, 4, 2, 90, 120, 64, torch.float32, seed=10)
cu = torch.tensor([0, 40, 90]), torch.tensor([0, 70, 120])
want_out, want_lse = torch_kernels.quantized_attention(q, k, v, causal=True, pv_dtype="fp8", cu_seqlens_q=cu[0],
                                                       cu_seqlens_k=cu[1], return_lse=True, implementation="reference")
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
out, lse = torch_kernels.quantized_attention(*leaves, causal=True, pv_dtype="fp8", cu_seqlens_q=cu[0],
                                             cu_seqlens_k=cu[1], return_lse=True, implementation="reference")
(out.sum() + lse.sum()).backward()
want_grads = [t.grad for t in leaves]
with env:
    leaves = [t.to("jax").requires_grad_() for t in (q, k, v)]
    out, lse = torch_kernels.quantized_attention(*leaves, causal=True, pv_dtype="fp8", cu_seqlens_q=cu[0].to("jax"),
                                                 cu_seqlens_k=cu[1].to("jax"), return_lse=True)
    assert type(out).__module__.startswith("torchax"), type(out)
    (out.sum() + lse.sum()).backward()
    grads = [t.grad.to("cpu") for t in leaves]
    out, lse = out.detach().to("cpu"), lse.detach().to("cpu")
    # the dispatcher's own call, trailing defaults left out; the backward op
    default_out, _ = torch.ops.torch_kernels.quantized_attention(leaves[0], leaves[1], leaves[2], 0.125)
    assert tuple(default_out.shape) == tuple(q.shape)
    dq, dk, dv = torch.ops.torch_kernels.quantized_attention_backward(
        *(t.to("jax") for t in (torch.ones(q.shape), torch.ones(q.shape[:3]), q, k, v)), 0.125, True,
        *(c.to("jax") for c in cu))
    assert relative_rmse(dk.to("cpu"), want_grads[1]) < 1e-5
    with pytest.raises(ValueError, match="cu_seqlens_q: expected to end at the 90 packed tokens"):
        torch_kernels.quantized_attention(*leaves, cu_seqlens_q=torch.tensor([0, 40, 89]).to("jax"),
                                          cu_seqlens_k=cu[1].to("jax"))
    with pytest.raises(NotImplementedError, match="torchax tensors run"):
        torch_kernels.quantized_attention(*leaves, implementation="triton")
    # V past float16's range (fp16 P.V), scaled in JAX here, not by the op: channels at max |v|
    # 60000 times 2^20 give 2^20 times their output
    fits = each_channel_at(v, 60000.0, [0, 120])
    big_out, fits_out = (torch_kernels.quantized_attention(*(t.to("jax") for t in (q, k, values))).to("cpu")
                         for values in (fits * 2**20, fits))
assert not big_out.isnan().any() and torch.equal(big_out, fits_out * 2**20)
# the key mean is computed in JAX here (summation order): the same int8 values but at rare ties
assert relative_rmse(out, want_out) < 1e-5 and (lse - want_lse).abs().max() < 1e-4
for got, want in zip(grads, want_grads):
    assert relative_rmse(got, want) < 1e-5
print("torchax ok")
"""


def test_small_blocks_skip_causal_blocks():
    """Blocks of 128 queries and 128 keys on causal sequences of 300: query blocks see one to
    three key blocks and key blocks are seen by three to one query blocks (those past the
    diagonal neither fetched nor computed), forward and backward; 256-row query blocks too. The
    same numbers as the reference's (the softmax walks 64-key tiles whatever the block)."""
    import jax.numpy as jnp

    kernels = _kernels()
    q, k, v = make_qkv(2, 4, 2, 300, 300, 64, torch.float32, seed=11, query_offset=3.0)
    smoothing = reference.smoothing(q, k, 0.125, True, True)
    want = reference.quantized_attention(q, k, v, *smoothing, 0.125, True, "per_warp", "none", None, None)
    gen = torch.Generator().manual_seed(12)
    d_out, d_lse = torch.randn(q.shape, generator=gen), torch.randn(q.shape[:3], generator=gen)
    want_grads = reference.attention_backward(d_out, d_lse, q, k, v, 0.125, True, None, None)
    arrays = [jnp.asarray(t.numpy()) for t in (q, k, v, d_out, d_lse)]
    for block_q in (128, 256):
        config = kernels.Config(block_q=block_q, block_k=128)
        out, lse = kernels.quantized_attention(*arrays[:3], 0.125, True, "per_warp", "none", config=config,
                                               **dict(zip(("k_mean", "q_mean", "key_bias"),
                                                          (jnp.asarray(t.numpy()) for t in smoothing))))
        got = (torch.from_numpy(np.array(out)), torch.from_numpy(np.array(lse)))
        assert_tight(f"block_q={block_q} block_k=128", got, want, torch.float32, "none", v)
        grads = kernels.attention_backward(arrays[3], arrays[4], *arrays[:3], 0.125, True, config=config)
        for a, b in zip(grads, want_grads):
            assert relative_rmse(torch.from_numpy(np.array(a)), b) <= 1e-6

"""The Triton MoE kernels (triton_impl.moe): run by the Triton interpreter on CPU tensors against
the reference definitions, and built for Hopper (sm_90) and Ampere (sm_80) at the real shapes of
Qwen3-30B-A3B and DeepSeek-V3.

The interpreter computes in float32 whatever the input dtype (its bfloat16 arithmetic is wrong, so
the kernels widen every load there, and round bfloat16 stores to nearest even by hand). Float32
inputs are compared with the definitions evaluated in float64 (against the float32 definitions,
float32 summation order alone makes element-wise errors of 2e-5, the shared tolerance), held to
1e-5 relative (max error over max value); float16 and bfloat16 ones with the definitions as they
are (float32 accumulation, the intermediate rounded to the dtype), within about one unit in the
last place (1e-3, 8e-3), far inside the shared tests' 1e-2 and 5e-2. Routing ids, gathers and
combines must match exactly. Shapes stay small: the interpreter's cost is per program and per op.

The builds for sm_90 and sm_80 at the models' shapes (tensor cores, shared memory, no spills) are
tests/test_device_compile.py's, with every family's (triton_impl/compile_report.py lists them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import assert_close, require_backend
from torch_kernels.reference import moe as reference

pytestmark = pytest.mark.usefixtures("triton_available")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TIGHT = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.fixture
def triton_available():
    require_backend("triton")


@pytest.fixture
def kernels():
    from triton_impl import moe

    return moe


def check_close(out, expected, dtype, what=""):
    """The shared tolerance and the interpreter's tighter one (module docstring)."""
    assert_close(out.double(), expected.double(), dtype, what=what)
    if expected.numel():
        err = ((out.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-30)).item()
        assert err <= TIGHT[dtype], f"{what}: relative error {err:.2e} > {TIGHT[dtype]:.0e}"


def widened(*tensors):
    """float32 tensors as float64 (the truth for float32 inputs), the others as they are."""
    return [t.double() if t is not None and t.dtype == torch.float32 else t for t in tensors]


def routing(num_tokens, num_experts, top_k, seed=0, dropped=0, skew=False):
    """``(topk_ids int64 [T, k], weights float32 [T, k], token_of_row, row_of_slot, offsets int64)``:
    distinct experts per token (with ``skew`` mostly the first few, leaving others empty), the
    first ``dropped`` tokens' last slot dropped (-1)."""
    gen = torch.Generator().manual_seed(seed)
    preference = torch.rand(num_tokens, num_experts, generator=gen)
    if skew:
        preference[:, : max(top_k, 3)] += 1
    ids = preference.topk(top_k, dim=-1).indices
    ids[:dropped, -1] = -1
    weights = torch.rand(num_tokens, top_k, generator=gen)
    token_of_row, row_of_slot, offsets = reference.sort_by_expert(ids, num_experts)
    return ids, weights, token_of_row, row_of_slot, offsets.long()


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# ---- router_topk ----

ROUTER_CASES = {  # (T, E, k, scoring, renormalize, groups, kept groups, bias, scaling)
    "softmax-E128-k8-few-tokens": (5, 128, 8, "softmax", True, None, None, False, 1.0),
    "softmax-k1-no-renorm": (9, 6, 1, "softmax", False, None, None, False, 1.0),
    "softmax-k-all": (3, 5, 5, "softmax", True, None, None, False, 1.0),
    "deepseek-v3": (19, 256, 8, "sigmoid", True, 8, 4, True, 2.5),
    "sigmoid-groups-of-one": (7, 12, 3, "sigmoid", False, 12, 5, True, 1.0),
    "softmax-groups": (33, 64, 6, "softmax", True, 4, 2, False, 1.0),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROUTER_CASES)
def test_router_topk(kernels, case, dtype):
    tokens, experts, top_k, scoring, renormalize, groups, kept, bias, scaling = ROUTER_CASES[case]
    gen = torch.Generator().manual_seed(1)
    # distinct logits in every dtype (k/16, exact in bfloat16 up to 256 experts): ties are not tested
    logits = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]).sub(experts / 2).div(16)
    logits = logits.reshape(tokens, experts).to(dtype)
    bias = randn(experts, seed=2, scale=0.1) if bias else None
    args = (logits, top_k, scoring, renormalize, groups, kept, bias, scaling)
    weights, ids = kernels.router_topk(*args)
    expected_weights, expected_ids = reference.router_topk(*args)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), expected_ids)
    check_close(weights, expected_weights, torch.float32, "weights")


def test_router_topk_no_tokens(kernels):
    weights, ids = kernels.router_topk(torch.empty(0, 16), 4, "softmax", True, None, None, None, 1.0)
    assert weights.shape == ids.shape == (0, 4)


# ---- gather and combine ----

@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_and_combine_exact(kernels, dtype):
    """Rows copied bit for bit, dropped ones zero; combine in slot order equals the reference's."""
    ids, weights, token_of_row, row_of_slot, _ = routing(11, 7, 3, dropped=4)
    x = randn(11, 33, dtype=dtype)
    rows = kernels.moe_gather(x, token_of_row)
    assert torch.equal(rows, reference.moe_gather(x, token_of_row))
    y = randn(rows.shape[0], 1030, dtype=dtype)  # two column blocks
    y[token_of_row < 0] = float("nan")  # dropped rows are never read
    for out_dtype in (dtype, torch.float32):
        out = kernels.moe_combine(y, row_of_slot, weights, out_dtype)
        assert out.dtype == out_dtype
        assert torch.equal(out, reference.moe_combine(y, row_of_slot, weights, out_dtype))


def test_gather_and_combine_no_tokens(kernels):
    x = torch.empty(0, 8)
    empty = torch.empty(0, dtype=torch.int64)
    assert kernels.moe_gather(x, empty).shape == (0, 8)
    assert kernels.moe_combine(x, empty.view(0, 2), torch.empty(0, 2), torch.float16).shape == (0, 8)


# ---- grouped GEMMs ----

GROUPED_CASES = {  # (rows M, K, N, experts, tokens routed, top_k, dropped slots)
    "odd-empty-experts-tail": (33, 20, 6, 11, 3, 4),
    "E128-few-rows": (48, 40, 128, 3, 8, 0),
    "K1-N1": (1, 1, 3, 4, 2, 1),
}


def grouped_inputs(case, dtype):
    k_dim, n_dim, experts, tokens, top_k, dropped = GROUPED_CASES[case]
    _, _, token_of_row, _, offsets = routing(tokens, experts, top_k, dropped=dropped, skew=True)
    x = randn(token_of_row.shape[0], k_dim, dtype=dtype, seed=3)
    w = randn(experts, k_dim, n_dim, dtype=dtype, seed=4, scale=k_dim ** -0.5)
    return x, w, offsets


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GROUPED_CASES)
def test_grouped_mm(kernels, case, dtype):
    x, w, offsets = grouped_inputs(case, dtype)
    expected = reference.grouped_mm_naive(*widened(x, w), offsets, torch.float32)
    for transposed, out_dtype in ((False, dtype), (True, torch.float32)):
        weights = w.transpose(1, 2).contiguous() if transposed else w
        out = kernels.grouped_mm(x, weights, offsets, out_dtype, transposed)
        assert out.dtype == out_dtype
        assert not out[int(offsets[-1]):].any(), "rows past offsets[-1] must be zero"
        check_close(out, expected, dtype, f"transposed={transposed} out={out_dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", GROUPED_CASES)
def test_grouped_mm_weight_grad(kernels, case, dtype):
    x, w, offsets = grouped_inputs(case, dtype)
    dy = randn(x.shape[0], w.shape[2], dtype=dtype, seed=5)
    out = kernels.grouped_mm_weight_grad(x, dy, offsets, w.shape[0], dtype)
    expected = reference.grouped_mm_weight_grad(*widened(x, dy), offsets, w.shape[0], torch.float32)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    assert not out[counts == 0].any(), "an expert with no rows gets zeros"
    check_close(out, expected.to(dtype), dtype)


def test_grouped_no_rows(kernels):
    x, w = torch.empty(0, 8), torch.ones(3, 8, 5)
    offsets = torch.zeros(3, dtype=torch.int64)
    assert kernels.grouped_mm(x, w, offsets, torch.float32, False).shape == (0, 5)
    assert not kernels.grouped_mm_weight_grad(x, torch.empty(0, 5), offsets, 3, torch.float32).any()


# ---- fused_moe ----

FUSED_CASES = {  # (T, E, k, H, I, dropped slots)
    "odd-H33-I20": (6, 5, 2, 33, 20, 2),
    "E128-k8-few-tokens": (3, 128, 8, 24, 16, 0),
    "T1": (1, 8, 8, 16, 48, 0),
}


def fused_inputs(case, dtype, weight_dtype=None, block_shape=None):
    tokens, experts, top_k, hidden, inter, dropped = FUSED_CASES[case]
    ids, weights, token_of_row, row_of_slot, offsets = routing(tokens, experts, top_k, dropped=dropped,
                                                               skew=experts > 8)
    x = randn(tokens, hidden, dtype=dtype, seed=6)
    w13 = randn(experts, 2 * inter, hidden, seed=7, scale=hidden ** -0.5)
    w2 = randn(experts, hidden, inter, seed=8, scale=inter ** -0.5)
    scales = [None, None]
    if weight_dtype is not None:  # entries spread over the float8 range, scales bring them back
        for i, (w, (n, k)) in enumerate(((w13, (2 * inter, hidden)), (w2, (hidden, inter)))):
            shape = (experts, n) if block_shape is None else (experts, -(-n // block_shape[0]), -(-k // block_shape[1]))
            scales[i] = (torch.rand(shape, generator=torch.Generator().manual_seed(9 + i)) + 0.5) / 64
        w13 = (w13 * 64).to(weight_dtype)
        w2 = (w2 * 64).to(weight_dtype)
    else:
        w13, w2 = w13.to(dtype), w2.to(dtype)
    args = (x, w13, w2, weights, token_of_row, row_of_slot, offsets)
    return args, ids, scales


@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", FUSED_CASES)
def test_fused_moe(kernels, case, dtype, activation):
    (x, w13, w2, weights, *meta), ids, _ = fused_inputs(case, dtype)
    if activation == "swigluoai":
        w13 = w13 * 4  # gate and up beyond the clamps at 7
    out = kernels.fused_moe(x, w13, w2, weights, *meta, activation, None, None, None)
    assert out.dtype == dtype
    expected = reference.fused_moe_naive(*widened(x, w13, w2, weights), ids, activation)
    check_close(out, expected, dtype, activation)


# block shapes: one scale per K step (bk a multiple of 16, larger than the K step or not), per entry
# (bk = 20), blocks larger than the matrices
@pytest.mark.parametrize("block_shape", [None, (16, 16), (8, 20), (32, 48), (128, 128)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_fp8(kernels, dtype, block_shape):
    (x, w13, w2, weights, *meta), ids, (s13, s2) = fused_inputs("odd-H33-I20", dtype, torch.float8_e4m3fn,
                                                                 block_shape)
    out = kernels.fused_moe(x, w13, w2, weights, *meta, "silu", s13, s2, block_shape)
    expected = reference.fused_moe_naive(*widened(x, w13, w2, weights), ids, "silu", *widened(s13, s2), block_shape)
    check_close(out, expected, dtype)


def test_fused_moe_no_tokens(kernels):
    (x, w13, w2, *_), _, _ = fused_inputs("odd-H33-I20", torch.float32)
    empty = torch.empty(0, dtype=torch.int64)
    offsets = torch.zeros(5, dtype=torch.int64)
    out = kernels.fused_moe(x[:0], w13, w2, torch.empty(0, 2), empty, empty.view(0, 2), offsets, "silu", None, None, None)
    assert out.shape == (0, 33)


def test_small_tiles(kernels, monkeypatch):
    """16-wide tiles and group_m 2, so that experts span several row tiles (a skewed routing puts
    ~40 rows on each of a few experts), every K loop runs several steps with a ragged last one, and
    the swizzle walks several groups."""
    default = kernels.default_config
    monkeypatch.setattr(kernels, "default_config", lambda *args, **kwargs: dataclasses.replace(
        default(*args, **kwargs), block_m=16, block_n=16, block_k=16, group_m=2))
    tokens, experts, top_k, hidden, inter = 40, 6, 2, 50, 36
    ids, weights, token_of_row, row_of_slot, offsets = routing(tokens, experts, top_k, dropped=3, skew=True)
    x = randn(tokens, hidden, seed=10)
    w13 = randn(experts, 2 * inter, hidden, seed=11, scale=hidden ** -0.5)
    w2 = randn(experts, hidden, inter, seed=12, scale=inter ** -0.5)
    out = kernels.fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets, "gelu", None, None, None)
    check_close(out, reference.fused_moe_naive(*widened(x, w13, w2, weights), ids, "gelu"), torch.float32)
    rows = reference.moe_gather(x, token_of_row)
    out = kernels.grouped_mm(rows, w13, offsets, torch.float32, True)
    check_close(out, reference.grouped_mm_naive(*widened(rows, w13.transpose(1, 2)), offsets, torch.float32),
                torch.float32)
    dy = randn(rows.shape[0], 2 * inter, seed=13)
    check_close(kernels.grouped_mm_weight_grad(rows, dy, offsets, experts, torch.float32),
                reference.grouped_mm_weight_grad(*widened(rows, dy), offsets, experts, torch.float32), torch.float32)


def test_declines(kernels):
    """float64 and sizes beyond the kernels pass the call on (NotImplementedError)."""
    (x, w13, w2, weights, *meta), _, _ = fused_inputs("odd-H33-I20", torch.float32)
    with pytest.raises(NotImplementedError, match="float64"):
        kernels.fused_moe(x.double(), w13.double(), w2.double(), weights, *meta, "silu", None, None, None)
    with pytest.raises(NotImplementedError, match="float64"):
        kernels.grouped_mm(x.double(), w13.double(), meta[-1], torch.float64, True)
    with pytest.raises(NotImplementedError, match="experts"):
        kernels.router_topk(torch.zeros(2, kernels.MAX_EXPERTS + 1), 2, "softmax", True, None, None, None, 1.0)


def test_ops_reach_triton():
    """The op layer's ``implementation="triton"`` runs this module (forward and backward)."""
    import torch_kernels

    ids, weights, *_ = routing(4, 6, 2)
    x = randn(4, 16, seed=14).requires_grad_()
    w13 = randn(6, 32, 16, seed=15, scale=0.25).requires_grad_()
    w2 = randn(6, 16, 16, seed=16, scale=0.25).requires_grad_()
    out = torch_kernels.fused_moe(x, w13, w2, weights, ids, implementation="triton")
    leaves = [t.detach().double().requires_grad_() for t in (x, w13, w2)]
    expected = reference.fused_moe_naive(*leaves, weights.double(), ids, "silu")
    check_close(out.detach(), expected.detach(), torch.float32)
    grads = torch.autograd.grad(out.sum(), (x, w13, w2))
    expected_grads = torch.autograd.grad(expected.sum(), leaves)
    for grad, expected_grad in zip(grads, expected_grads):
        check_close(grad, expected_grad, torch.float32)

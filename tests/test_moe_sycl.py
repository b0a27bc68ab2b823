"""The SYCL moe kernels (oneapi_impl.moe) against the reference, called directly.

Odd shapes (H = 33, I = 20), empty experts, rows past the routed ones, T = 0, k up to 8, E = 128
with few tokens (most experts idle: their weights are never copied), each GEMM tile height
forced, fp8 weights with per-channel and block scales (blocks that do not divide the matrix),
every activation; gather and combine bit for bit; float64 and non-CPU inputs declined; the
SPIR-V modules of every build.
"""

from __future__ import annotations

import pytest
import torch

import torch_kernels
from harness import assert_close, require_backend
from torch_kernels import backends
from torch_kernels.reference import moe as reference

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TILE_ROWS = (4, 16, 64)


@pytest.fixture(scope="module")
def sycl():
    require_backend("sycl")
    from oneapi_impl import moe

    return moe


def routing(gen, tokens, experts, k, drop=0.0, busy=None):
    """``(ids [T, k], token_of_row, row_of_slot, offsets int64)``: distinct experts per token,
    chosen among ``busy`` experts if given (the others get no rows), a fraction ``drop`` dropped."""
    scores = torch.rand(tokens, experts, generator=gen)
    if busy is not None:
        scores[:, busy:] = -1.0
    ids = scores.topk(k, dim=-1).indices
    ids[torch.rand(tokens, k, generator=gen) < drop] = -1
    token_of_row, row_of_slot, offsets = reference.sort_by_expert(ids, experts)
    return ids, token_of_row, row_of_slot, offsets.long()


def ragged_offsets(counts) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64).cumsum(0)


def layer(gen, tokens, hidden, inter, experts, dtype):
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    return x, w13, w2


def quantize_fp8(gen, w, block_shape):
    """float8_e4m3fn entries and float32 scales per output channel or per (bn, bk) block."""
    e, n, k = w.shape
    if block_shape is None:
        scale = w.abs().amax(dim=2).clamp(min=1e-12) / 448
        full = scale[..., None]
    else:
        bn, bk = block_shape
        scale = torch.rand(e, -(-n // bn), -(-k // bk), generator=gen) * 4e-3 + 1e-3
        full = scale.repeat_interleave(bn, 1)[:, :n].repeat_interleave(bk, 2)[:, :, :k]
    return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale


# ---- grouped GEMMs ----

GROUPED_COUNTS = [7, 0, 70, 3, 0, 1]  # empty experts at 1 and 4, expert 2 over two 64-row tiles; 81 rows


@pytest.mark.parametrize("tile_rows", TILE_ROWS)
@pytest.mark.parametrize("transposed", [False, True], ids=["w", "w-transposed"])
def test_grouped_mm_tiles(sycl, transposed, tile_rows):
    gen = torch.Generator().manual_seed(1)
    offsets = ragged_offsets(GROUPED_COUNTS)
    x = torch.randn(91, 33, generator=gen)  # 10 rows past offsets[-1]
    w = torch.randn(len(GROUPED_COUNTS), 33, 130, generator=gen)  # N = 130: three column tiles of 64
    stored = w.transpose(1, 2).contiguous() if transposed else w
    out = sycl.grouped_mm(x, stored, offsets, torch.float32, transposed, layout=sycl.Layout(tile_rows))
    want = reference.grouped_mm_naive(x.double(), w.double(), offsets, torch.float64)
    assert_close(out, want, torch.float32, what=f"tile rows {tile_rows}")
    assert (out[int(offsets[-1]):] == 0).all()


@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_mm_dtypes(sycl, dtype, out_dtype):
    gen = torch.Generator().manual_seed(2)
    offsets = ragged_offsets(GROUPED_COUNTS)
    x = torch.randn(85, 20, generator=gen).to(dtype)
    w = torch.randn(len(GROUPED_COUNTS), 20, 33, generator=gen).to(dtype)
    out = sycl.grouped_mm(x, w, offsets, out_dtype, False)
    assert out.dtype == out_dtype
    want = reference.grouped_mm_naive(x.double(), w.double(), offsets, torch.float64)
    assert_close(out, want, out_dtype if out_dtype != torch.float32 else dtype, what=f"{dtype} -> {out_dtype}")


def test_grouped_mm_many_experts_few_rows(sycl):
    """E = 128 with 5 rows: most experts idle (their weights are not copied), M = 0, E = 1."""
    gen = torch.Generator().manual_seed(3)
    counts = [0] * 128
    for e, c in ((3, 2), (64, 1), (127, 2)):
        counts[e] = c
    offsets = ragged_offsets(counts)
    x = torch.randn(5, 24, generator=gen).to(torch.bfloat16)
    w = torch.randn(128, 24, 12, generator=gen).to(torch.bfloat16)
    out = sycl.grouped_mm(x, w, offsets, torch.float32, False)
    assert_close(out, reference.grouped_mm_naive(x.double(), w.double(), offsets, torch.float64), torch.bfloat16)
    empty = sycl.grouped_mm(x[:0], w, torch.zeros(128, dtype=torch.int64), torch.float32, False)
    assert empty.shape == (0, 12)
    one = sycl.grouped_mm(x, w[:1], torch.tensor([3]), torch.bfloat16, False)
    assert_close(one, reference.grouped_mm_naive(x.double(), w[:1].double(), torch.tensor([3]), torch.float64),
                 torch.bfloat16)
    assert (one[3:] == 0).all()


@pytest.mark.parametrize("dtype, tile_rows", [(torch.float32, 16), (torch.float32, 64), (torch.float16, 64),
                                              (torch.bfloat16, 64)], ids=str)
def test_weight_grad(sycl, dtype, tile_rows):
    gen = torch.Generator().manual_seed(4)
    counts = [7, 0, 20, 3, 0, 0]  # experts 1, 4 and 5 have no rows
    offsets = ragged_offsets(counts)
    x = torch.randn(33, 67, generator=gen).to(dtype)  # K over two tiles of 64
    dy = torch.randn(33, 20, generator=gen).to(dtype)
    for out_dtype in (torch.float32, dtype):
        out = sycl.grouped_mm_weight_grad(x, dy, offsets, 6, out_dtype, layout=sycl.Layout(tile_rows))
        want = reference.grouped_mm_weight_grad(x.double(), dy.double(), offsets, 6, torch.float64)
        assert_close(out, want, dtype, what=f"{dtype} -> {out_dtype}")
        assert (out[[1, 4, 5]] == 0).all()
    shorter = sycl.grouped_mm_weight_grad(x, dy, offsets[:4], 6, torch.float32)  # experts 4, 5 past the offsets
    assert torch.equal(shorter, sycl.grouped_mm_weight_grad(x, dy, offsets, 6, torch.float32))


# ---- fused_moe ----

@pytest.mark.parametrize("activation", reference.ACTIVATIONS)
@pytest.mark.parametrize("tile_rows", TILE_ROWS)
def test_fused_moe_tiles_and_activations(sycl, tile_rows, activation):
    gen = torch.Generator().manual_seed(5)
    x, w13, w2 = layer(gen, 13, 33, 20, 6, torch.float32)
    ids, token_of_row, row_of_slot, offsets = routing(gen, 13, 6, 3, drop=0.2)
    weights = torch.rand(13, 3, generator=gen)
    out = sycl.fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets, activation, None, None, None,
                         layout=sycl.Layout(tile_rows))
    want = reference.fused_moe_naive(x.double(), w13.double(), w2.double(), weights, ids, activation)
    assert_close(out, want, torch.float32, what=f"{activation}, tile rows {tile_rows}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fused_moe_half_precision(sycl, dtype):
    """h is rounded to x's dtype between the GEMMs, as the definition does."""
    gen = torch.Generator().manual_seed(6)
    x, w13, w2 = layer(gen, 21, 33, 20, 5, dtype)
    ids, token_of_row, row_of_slot, offsets = routing(gen, 21, 5, 2)
    weights = torch.rand(21, 2, generator=gen)
    for activation in reference.ACTIVATIONS:
        out = sycl.fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets, activation, None, None, None)
        assert out.dtype == dtype
        want = reference.fused_moe_naive(x, w13, w2, weights, ids, activation)
        assert_close(out, want.float(), dtype, what=activation)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_moe_many_experts_k8(sycl, dtype):
    """E = 128, k = 8, 3 tokens: decode-sized tiles, most experts idle."""
    gen = torch.Generator().manual_seed(7)
    x, w13, w2 = layer(gen, 3, 33, 20, 128, dtype)
    ids, token_of_row, row_of_slot, offsets = routing(gen, 3, 128, 8)
    weights = torch.rand(3, 8, generator=gen).softmax(dim=-1)
    out = sycl.fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets, "silu", None, None, None)
    assert_close(out, reference.fused_moe_naive(x, w13, w2, weights, ids, "silu").float(), dtype)


# block shapes: dividing neither dimension, larger than both, and (1, 1)
@pytest.mark.parametrize("block_shape", [None, (16, 8), (7, 5), (128, 128), (1, 1)],
                         ids=["per-channel", "16x8", "7x5", "128x128", "1x1"])
def test_fused_moe_fp8(sycl, block_shape):
    gen = torch.Generator().manual_seed(8)
    x, w13, w2 = layer(gen, 11, 33, 20, 5, torch.float32)
    q13, s13 = quantize_fp8(gen, w13, block_shape)
    q2, s2 = quantize_fp8(gen, w2, block_shape)
    ids, token_of_row, row_of_slot, offsets = routing(gen, 11, 5, 2, drop=0.1, busy=4)
    weights = torch.rand(11, 2, generator=gen)
    for dtype in DTYPES if block_shape in (None, (7, 5)) else (torch.float32,):
        xd = x.to(dtype)
        out = sycl.fused_moe(xd, q13, q2, weights, token_of_row, row_of_slot, offsets, "gelu", s13, s2, block_shape)
        want = reference.fused_moe_naive(xd, q13, q2, weights, ids, "gelu", s13, s2, block_shape)
        assert_close(out, want.float(), dtype, what=f"{dtype}")


def test_fp8_codes_decode_exactly(sycl):
    """All 256 float8_e4m3fn codes (subnormals, +-448, -0, NaN) through the kernels' decoder:
    w2 holds the codes, h = silu(448) * 1 = 448 exactly, and every product code * 448 fits in
    float32's significand, so the output is the decoded code times 448 with no rounding."""
    codes = torch.arange(256, dtype=torch.uint8)
    hidden = codes.shape[0]
    w13 = torch.zeros(1, 2, hidden, dtype=torch.uint8)
    w13[0, 0, 0], w13[0, 1, 0] = 0x7E, 0x38  # gate row: 448, up row: 1.0, at column 0
    w2 = codes.view(1, hidden, 1)  # output channel c of the down projection is code c
    x = torch.zeros(1, hidden)
    x[0, 0] = 1.0
    ids = torch.zeros(1, 1, dtype=torch.int64)
    token_of_row, row_of_slot, offsets = reference.sort_by_expert(ids, 1)
    out = sycl.fused_moe(x, w13.view(torch.float8_e4m3fn), w2.view(torch.float8_e4m3fn), torch.ones(1, 1),
                         token_of_row, row_of_slot, offsets.long(), "silu", torch.ones(1, 2), torch.ones(1, hidden),
                         None, layout=sycl.Layout(16))[0]
    want = codes.view(torch.float8_e4m3fn).float() * 448
    nan = want.isnan()
    assert torch.equal(out[~nan], want[~nan])
    assert out[nan].isnan().all() and nan.sum() == 2


# ---- router, gather, combine ----

ROUTER_CASES = {
    "softmax renormalized": dict(scoring="softmax", renormalize=True),
    "softmax raw scaled": dict(scoring="softmax", renormalize=False, routed_scaling_factor=1.5),
    "sigmoid bias": dict(scoring="sigmoid", renormalize=False, bias=True),
    "deepseek groups": dict(scoring="sigmoid", renormalize=True, groups=(8, 4), bias=True, routed_scaling_factor=2.5),
    "one group of all": dict(scoring="softmax", renormalize=True, groups=(1, 1)),
    "groups of one": dict(scoring="sigmoid", renormalize=True, groups=(128, 8)),
}


@pytest.mark.parametrize("case", ROUTER_CASES)
@pytest.mark.parametrize("top_k", [1, 8])
def test_router_topk(sycl, case, top_k):
    spec = dict(ROUTER_CASES[case])
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(37, 128, generator=gen) * 2
    bias = torch.randn(128, generator=gen) * 0.1 if spec.pop("bias", False) else None
    groups, kept = spec.pop("groups", (None, None))
    args = (top_k, spec["scoring"], spec["renormalize"], groups, kept, bias, spec.get("routed_scaling_factor", 1.0))
    weights, ids = sycl.router_topk(logits, *args)
    want_weights, want_ids = reference.router_topk(logits, *args)
    assert torch.equal(ids, want_ids)
    assert_close(weights, want_weights, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_router_topk_half_logits(sycl, dtype):
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(16, 60, generator=gen).to(dtype)
    weights, ids = sycl.router_topk(logits, 6, "softmax", True, None, None, None, 1.0)
    want_weights, want_ids = reference.router_topk(logits, 6, "softmax", True, None, None, None, 1.0)
    # 16-bit logits tie often, and torch.topk orders ties as its sort leaves them: compare the
    # chosen logits, which are the same whichever of two tied experts comes first
    assert torch.equal(logits.gather(1, ids), logits.gather(1, want_ids))
    assert_close(weights, want_weights, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_and_combine_bit_exact(sycl, dtype):
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(9, 33, generator=gen).to(dtype)
    ids, token_of_row, row_of_slot, _ = routing(gen, 9, 7, 3, drop=0.3)
    assert torch.equal(sycl.moe_gather(x, token_of_row), reference.moe_gather(x, token_of_row))
    y = torch.randn(27, 33, generator=gen).to(dtype)
    y[token_of_row < 0] = float("nan")  # a dropped slot's row is never read
    weights = torch.rand(9, 3, generator=gen)
    for y_in, out_dtype in ((y, dtype), (y.float(), dtype), (y, torch.float32)):
        out = sycl.moe_combine(y_in, row_of_slot, weights, out_dtype)
        assert out.dtype == out_dtype
        assert torch.equal(out, reference.moe_combine(y_in, row_of_slot, weights, out_dtype))


def test_no_tokens(sycl):
    gen = torch.Generator().manual_seed(12)
    x, w13, w2 = layer(gen, 0, 16, 8, 4, torch.float32)
    ids, token_of_row, row_of_slot, offsets = routing(gen, 0, 4, 2)
    weights = torch.rand(0, 2)
    out = sycl.fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets, "silu", None, None, None)
    assert out.shape == (0, 16)
    assert sycl.moe_gather(x, token_of_row).shape == (0, 16)
    assert sycl.moe_combine(x, row_of_slot, weights, torch.float32).shape == (0, 16)
    assert sycl.grouped_mm(x, w2, offsets, torch.float32, False).shape == (0, 8)
    assert sycl.grouped_mm_weight_grad(x, x, offsets, 4, torch.float32).eq(0).all()
    weights, ids = sycl.router_topk(torch.randn(0, 8), 2, "softmax", True, None, None, None, 1.0)
    assert weights.shape == ids.shape == (0, 2)


def test_every_slot_dropped(sycl):
    gen = torch.Generator().manual_seed(13)
    x, w13, w2 = layer(gen, 5, 16, 8, 4, torch.bfloat16)
    ids = torch.full((5, 2), -1)
    token_of_row, row_of_slot, offsets = reference.sort_by_expert(ids, 4)
    out = sycl.fused_moe(x, w13, w2, torch.rand(5, 2), token_of_row, row_of_slot, offsets.long(), "silu", None, None,
                         None)
    assert out.dtype == torch.bfloat16 and (out == 0).all()


def test_declines_what_it_cannot_run(sycl):
    gen = torch.Generator().manual_seed(14)
    x, w13, w2 = layer(gen, 4, 16, 8, 3, torch.float64)
    ids, token_of_row, row_of_slot, offsets = routing(gen, 4, 3, 2)
    weights = torch.rand(4, 2)
    with pytest.raises(NotImplementedError, match="sycl: .*float64"):
        sycl.fused_moe(x, w13, w2, weights, token_of_row, row_of_slot, offsets, "silu", None, None, None)
    with pytest.raises(NotImplementedError, match="sycl: .*float64"):
        sycl.grouped_mm(x, w13, offsets, torch.float64, True)
    with pytest.raises(NotImplementedError, match="sycl: .*float64"):
        sycl.router_topk(x, 2, "softmax", True, None, None, None, 1.0)
    with pytest.raises(NotImplementedError, match="sycl: .*float64"):
        sycl.grouped_mm(x.float(), w13.float(), offsets, torch.float64, True)
    with pytest.raises(NotImplementedError, match="sycl: only CPU"):
        sycl.moe_gather(x.float().to("meta"), token_of_row.to("meta"))


def test_through_the_op(sycl):
    """``torch_kernels.fused_moe(..., implementation="sycl")`` reaches these kernels; float64
    declined there passes to the next backend of the list."""
    gen = torch.Generator().manual_seed(15)
    x, w13, w2 = layer(gen, 7, 33, 20, 6, torch.bfloat16)
    logits = torch.randn(7, 6, generator=gen)
    weights, ids = torch_kernels.router_topk(logits, 2, implementation="sycl")
    assert backends.last_backend("router_topk") == "sycl"
    out = torch_kernels.fused_moe(x, w13, w2, weights, ids, "swigluoai", implementation="sycl")
    assert backends.last_backend("fused_moe") == "sycl"
    assert_close(out, reference.fused_moe_naive(x, w13, w2, weights, ids, "swigluoai").float(), torch.bfloat16)
    torch_kernels.fused_moe(x.double(), w13.double(), w2.double(), weights, ids, implementation=["sycl", "reference"])
    assert backends.last_backend("fused_moe") == "reference"


def test_spirv_binaries(sycl):
    binaries = sycl.spirv_binaries()
    assert len(binaries) == 3 * 2 * len(TILE_ROWS)  # x dtypes, x's or fp8 weights, tile heights
    for spv in binaries:
        assert int.from_bytes(spv[:4], "little") == 0x07230203  # the SPIR-V magic number

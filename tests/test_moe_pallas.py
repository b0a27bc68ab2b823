"""The pallas backend of moe: the Pallas kernels (TPU interpret mode) against the reference.

Covers odd sizes (H = 33, I = 20: full-dimension blocks), empty experts, dropped slots, T = 0,
k up to 8, E = 128 with few tokens, rows past the last expert holding inf (zero out, never read),
every activation, float32 / bfloat16 / float16, float8_e4m3fn weights with per-channel and
misaligned [bn, bk] block scales, the router's group limit and correction bias; with small tiles,
several ragged tiles per dimension (experts straddling row tiles, a ragged K masked, the scale
paths of aligned [128, 128] blocks); the ops with ``implementation="pallas"`` (grouped_mm's
gradients included); float64 declined; every kernel lowered for the TPU at realistic sizes (E 128,
H 2048, I 768, bfloat16) and, where TORCH_KERNELS_LIBTPU names a folder holding libtpu, compiled
by Mosaic for TPU v5e, v6e and v5p.

Errors are max |out - ref| / max |ref| against the torch reference (float32 accumulation there):
float32 within 2e-6, float16 1e-3, bfloat16 (where h is rounded to bfloat16 between the GEMMs)
1e-2; routing ids exactly.
"""

from __future__ import annotations

import functools

import pytest
import torch

import torch_kernels
from torch_kernels.reference import moe as reference

from harness import assert_compiles_for_tpu_generations, assert_lowers_for_tpu, require_backend

pytestmark = pytest.mark.usefixtures("pallas")

TOL = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}
E, H, I = 5, 33, 20


@pytest.fixture(scope="module")
def pallas():
    require_backend("pallas")


def _interop():
    from torch_kernels.pallas import moe

    return moe


def max_error(out, expected) -> float:
    assert out.shape == expected.shape, (tuple(out.shape), tuple(expected.shape))
    if expected.numel() == 0:
        return 0.0
    out, expected = out.double(), expected.double()
    return ((out - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def assert_close(out, expected, dtype, what=""):
    assert out.dtype == expected.dtype, (out.dtype, expected.dtype)
    err = max_error(out, expected)
    assert err <= TOL[dtype], f"{what}: error {err:.2e} > {TOL[dtype]:.0e}"


def routing(num_tokens, top_k, num_experts, seed, drop=True, experts=None):
    """topk ids (distinct per token, some -1 when ``drop``, only ``experts`` used if given) and the
    routing maps of ``reference.sort_by_expert`` (offsets as int64, as the op layer passes them)."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts if experts is not None else range(num_experts))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:top_k]] for _ in range(num_tokens)]) \
        if num_tokens else torch.zeros(0, top_k, dtype=torch.int64)
    if drop and num_tokens > 1:
        ids[1, -1] = -1
    token_of_row, row_of_slot, offsets = reference.sort_by_expert(ids, num_experts)
    return ids, token_of_row, row_of_slot, offsets.long()


@functools.lru_cache(maxsize=None)
def fused_problem(num_tokens, top_k, num_experts, dtype, quant, seed=0):
    """(x, w13, w2, weights, ids, maps, scales, block_shape); experts 1 and 3 of 5 left empty."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen).to(dtype)
    w13 = torch.randn(num_experts, 2 * I, H, generator=gen) / H ** 0.5
    w2 = torch.randn(num_experts, H, I, generator=gen) / I ** 0.5
    experts = [0, 2, 4] if num_experts == E else None
    ids, token_of_row, row_of_slot, offsets = routing(num_tokens, top_k, num_experts, seed, experts=experts)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    scales, block_shape = (None, None), None
    if quant is None:
        w13, w2 = w13.to(dtype), w2.to(dtype)
    else:
        block_shape = None if quant == "channel" else (16, 32)  # the up half starts inside a block
        shapes = ([(num_experts, 2 * I), (num_experts, H)] if block_shape is None else
                  [(num_experts, -(-2 * I // 16), -(-H // 32)), (num_experts, -(-H // 16), -(-I // 32))])
        scales = tuple(torch.rand(s, generator=gen) * 0.1 + 0.02 for s in shapes)
        w13, w2 = (w13 * 8).to(torch.float8_e4m3fn), (w2 * 8).to(torch.float8_e4m3fn)
    return x, w13, w2, weights, ids, (token_of_row, row_of_slot, offsets), scales, block_shape


FUSED_CASES = [  # (dtype, activation, quantization)
    (torch.float32, "silu", None),
    (torch.float16, "swigluoai", None),
    (torch.bfloat16, "silu", "channel"),
    (torch.float32, "gelu", "block"),
    (torch.bfloat16, "swigluoai", "block"),
]


@pytest.mark.parametrize("dtype, activation, quant", FUSED_CASES,
                         ids=[f"{str(d)[6:]}-{a}-{q}" for d, a, q in FUSED_CASES])
def test_fused_moe_matches_definition(dtype, activation, quant):
    x, w13, w2, weights, ids, maps, scales, block_shape = fused_problem(6, 2, E, dtype, quant)
    out = _interop().pallas_fused_moe(x, w13, w2, weights, *maps, activation, *scales, block_shape)
    want = reference.fused_moe_naive(x, w13, w2, weights, ids, activation, *scales, block_shape)
    assert_close(out, want, dtype, f"{dtype} {activation} {quant}")


def test_fused_moe_many_experts_few_tokens_and_no_tokens():
    x, w13, w2, weights, ids, maps, _, _ = fused_problem(3, 8, 128, torch.bfloat16, None)
    out = _interop().pallas_fused_moe(x, w13, w2, weights, *maps, "silu", None, None, None)
    assert_close(out, reference.fused_moe_naive(x, w13, w2, weights, ids, "silu"), torch.bfloat16)
    x, w13, w2, weights, ids, maps, _, _ = fused_problem(0, 2, E, torch.float32, None)
    out = _interop().pallas_fused_moe(x, w13, w2, weights, *maps, "silu", None, None, None)
    assert out.shape == (0, H) and out.dtype == torch.float32


def test_fused_moe_through_the_op():
    x, w13, w2, weights, ids, _, _, _ = fused_problem(6, 2, E, torch.float32, None)
    out = torch_kernels.fused_moe(x, w13, w2, weights, ids, "silu", implementation="pallas")
    assert_close(out, reference.fused_moe_naive(x, w13, w2, weights, ids, "silu"), torch.float32)


ROUTER_CASES = [  # (T, E, k, scoring, renormalize, groups, topk_groups, bias, scale, dtype)
    (7, 5, 2, "softmax", True, None, None, False, 1.0, torch.float32),
    (9, 16, 4, "sigmoid", True, 4, 2, True, 2.5, torch.bfloat16),
    (3, 128, 8, "softmax", False, None, None, False, 1.0, torch.float16),
    (4, 6, 2, "sigmoid", False, 6, 3, True, 1.0, torch.float32),  # groups of one expert
]


@pytest.mark.parametrize("case", ROUTER_CASES, ids=lambda c: f"T{c[0]}-E{c[1]}-k{c[2]}-{c[3]}-g{c[5]}")
def test_router_topk_matches_reference(case):
    t, e, k, scoring, renormalize, groups, topk_groups, with_bias, scale, dtype = case
    gen = torch.Generator().manual_seed(t * e)
    logits = (torch.randn(t, e, generator=gen) * 2).to(dtype)
    bias = torch.randn(e, generator=gen) * 0.1 if with_bias else None
    args = (k, scoring, renormalize, groups, topk_groups, bias, scale)
    weights, ids = _interop().pallas_router_topk(logits, *args)
    want_weights, want_ids = reference.router_topk(logits, *args)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), want_ids)
    assert max_error(weights, want_weights) <= 1e-6


def test_router_topk_through_the_op_and_no_tokens():
    logits = torch.randn(7, 5, generator=torch.Generator().manual_seed(1))
    weights, ids = torch_kernels.router_topk(logits, 2, implementation="pallas")
    want_weights, want_ids = reference.router_topk(logits, 2, "softmax", True, None, None, None, 1.0)
    assert torch.equal(ids.long(), want_ids) and max_error(weights, want_weights) <= 1e-6
    weights, ids = _interop().pallas_router_topk(torch.zeros(0, 5), 2, "softmax", True, None, None, None, 1.0)
    assert weights.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_gather_and_combine_match_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    _, token_of_row, row_of_slot, _ = routing(6, 3, E, 2)
    x = torch.randn(6, H, generator=gen).to(dtype)
    rows = _interop().pallas_moe_gather(x, token_of_row)
    assert torch.equal(rows, reference.moe_gather(x, token_of_row))
    y = torch.randn(18, H, generator=gen).to(dtype)
    y[token_of_row < 0] = float("nan")  # rows of dropped slots: never read
    weights = torch.rand(6, 3, generator=gen)
    out = _interop().pallas_moe_combine(y, row_of_slot, weights, dtype)
    want = reference.moe_combine(y, row_of_slot, weights, dtype)
    # float32: a fused multiply-add where the reference rounds the product first
    assert torch.isfinite(out).all() and max_error(out, want) <= (1e-6 if dtype == torch.float32 else TOL[dtype])


def test_gather_and_combine_with_nothing_to_move():
    interop = _interop()
    empty = torch.zeros(0, dtype=torch.int64)
    assert interop.pallas_moe_gather(torch.randn(4, H), empty).shape == (0, H)
    out = interop.pallas_moe_combine(torch.randn(0, H), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2),
                                     torch.float32)
    assert out.shape == (0, H)


def grouped_problem(dtype, seed=3):
    """x [23, H] whose rows past the last expert hold inf, weights [E, H, I], offsets with experts
    1 and 3 empty."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(23, H, generator=gen).to(dtype)
    ends = torch.tensor([4, 4, 15, 15, 19])
    x[int(ends[-1]):] = float("inf")
    w = (torch.randn(E, H, I, generator=gen) / H ** 0.5).to(dtype)
    return x, w, ends


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_grouped_mm_both_layouts(dtype):
    x, w, offsets = grouped_problem(dtype)
    want = reference.grouped_mm_naive(x, w, offsets, torch.float32)
    want[int(offsets[-1]):] = 0  # the naive loop leaves them as they start: zero
    interop = _interop()
    out = interop.pallas_grouped_mm(x, w, offsets, dtype, False)
    assert (out[int(offsets[-1]):] == 0).all()
    assert_close(out, want.to(dtype), dtype, "[E, K, N]")
    out = interop.pallas_grouped_mm(x, w.transpose(1, 2).contiguous(), offsets, torch.float32, True)
    assert max_error(out, want) <= 2e-6


def test_grouped_mm_with_no_rows():
    x, w, _ = grouped_problem(torch.float32)
    out = _interop().pallas_grouped_mm(x[:0], w, torch.zeros(E, dtype=torch.int64), torch.float32, False)
    assert out.shape == (0, I)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_weight_grad_matches_reference(dtype):
    x, _, offsets = grouped_problem(dtype)
    dy = torch.randn(x.shape[0], I, generator=torch.Generator().manual_seed(4)).to(dtype)
    dy[int(offsets[-1]):] = float("inf")
    out = _interop().pallas_grouped_mm_weight_grad(x, dy, offsets, E, torch.float32)
    want = reference.grouped_mm_weight_grad(x, dy, offsets, E, torch.float32)
    assert (out[1] == 0).all() and (out[3] == 0).all()  # empty experts
    assert max_error(out, want) <= TOL[dtype] / 4
    none = _interop().pallas_grouped_mm_weight_grad(x[:0], dy[:0], torch.zeros(E, dtype=torch.int64), E, dtype)
    assert none.shape == (E, H, I) and (none == 0).all()


def test_grouped_mm_through_the_op_with_gradients():
    x, w, offsets = grouped_problem(torch.float32)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = torch_kernels.grouped_mm(x, w, offsets.int(), implementation="pallas")
    dx, dw = torch.autograd.grad(out, (x, w), torch.ones_like(out))
    x_ref, w_ref = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = reference.grouped_mm_naive(x_ref, w_ref, offsets, torch.float32)  # never reads the inf rows
    want_dx, want_dw = torch.autograd.grad(want, (x_ref, w_ref), torch.ones_like(want))
    for got, expected in ((out, want), (dx, want_dx), (dw, want_dw)):
        assert max_error(got.detach(), expected) <= 2e-6


# ---- several tiles per dimension: small preferred tiles, ragged last blocks ----

TILED = dict(block_m=16, block_n=128, block_k=128)
ENDS = [0, 17, 17, 40, 41, 60]  # experts straddling row tiles, empty ones, 10 rows past the last


def _jax_call(fn, *args, **kwargs):
    """``fn`` of jax_impl.moe on torch tensors (int64 as int32), its result as a torch tensor."""
    from torch_kernels.pallas.torch_tensors import to_jax, to_torch

    def convert(a):
        return to_jax(a.int() if a.dtype == torch.int64 else a) if isinstance(a, torch.Tensor) else a

    return to_torch(fn(*map(convert, args), **{name: convert(a) for name, a in kwargs.items()}))


def test_grouped_gemms_over_many_ragged_tiles():
    from jax_impl import moe

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(70, 200, generator=gen)
    x[60:] = float("inf")
    w = torch.randn(6, 200, 150, generator=gen) / 200 ** 0.5
    offsets = torch.tensor(ENDS)
    want = reference.grouped_mm_naive(x, w, offsets, torch.float32)
    config = moe.Config(**TILED)
    out = _jax_call(moe.grouped_mm, x, w, offsets, config=config)
    assert max_error(out, want) <= 2e-6
    out = _jax_call(moe.grouped_mm, x, w.transpose(1, 2).contiguous(), offsets, w_transposed=True, config=config)
    assert max_error(out, want) <= 2e-6
    dy = torch.randn(70, 150, generator=gen)
    out = _jax_call(moe.grouped_mm_weight_grad, x, dy, offsets, num_experts=6, config=config)
    assert max_error(out, reference.grouped_mm_weight_grad(x, dy, offsets, 6, torch.float32)) <= 2e-6


@pytest.mark.parametrize("quant", [None, "block"])
def test_fused_moe_over_many_ragged_tiles(quant):
    """bfloat16: K and N ragged in both GEMMs (H 200, I 136); float8 with [128, 128] blocks (H 256):
    whole scale blocks per K tile in the gate/up GEMM, misaligned ones in the down GEMM, the up
    rows starting inside a scale block."""
    from jax_impl import moe

    hidden, inter, experts, tokens, k = (200 if quant is None else 256), 136, 6, 20, 3
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    ids, *maps = routing(tokens, k, experts, 6, experts=[0, 2, 3, 4, 5])  # expert 1 empty, a slot dropped
    weights = torch.rand(tokens, k, generator=gen)
    scales, block_shape = (None, None), None
    if quant is None:
        w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    else:
        block_shape = (128, 128)
        scales = (torch.rand(experts, 3, 2, generator=gen) * 0.1 + 0.02,
                  torch.rand(experts, 2, 2, generator=gen) * 0.1 + 0.02)
        w13, w2 = (w13 * 8).to(torch.float8_e4m3fn), (w2 * 8).to(torch.float8_e4m3fn)
    config = moe.Config(block_m=16, block_n=128, block_k=128 if quant is None else 256)
    out = _jax_call(moe.fused_moe, x, w13, w2, weights, *maps, activation="silu", w13_scale=scales[0],
                    w2_scale=scales[1], block_shape=block_shape, config=config)
    want = reference.fused_moe_naive(x, w13, w2, weights, ids, "silu", *scales, block_shape)
    assert max_error(out, want) <= TOL[torch.bfloat16]


def test_float64_is_declined():
    interop = _interop()
    x = torch.zeros(2, 8, dtype=torch.float64)
    offsets = torch.tensor([2])
    with pytest.raises(NotImplementedError, match="pallas: float64"):
        interop.pallas_grouped_mm(x, torch.zeros(1, 8, 4, dtype=torch.float64), offsets, torch.float64, False)
    with pytest.raises(NotImplementedError, match="pallas: float64"):
        interop.pallas_router_topk(x, 2, "softmax", True, None, None, None, 1.0)
    with pytest.raises(NotImplementedError, match="pallas: float64"):
        interop.pallas_moe_gather(x, torch.zeros(2, dtype=torch.int64))


def _lowerings():
    import jax

    from jax_impl import moe

    spec = jax.ShapeDtypeStruct
    e, h, i, t, k = 128, 2048, 768, 256, 8
    r, bf16, f32, i32, fp8 = t * k, "bfloat16", "float32", "int32", "float8_e4m3fn"
    maps = [spec((t, k), f32), spec((r,), i32), spec((t, k), i32), spec((e,), i32)]
    return {
        "router_topk": (lambda lg, b: moe.router_topk(lg, k, "sigmoid", True, 8, 4, b, 2.5, interpret=False),
                        [spec((t, e), bf16), spec((e,), f32)]),
        "moe_gather": (lambda x, tok: moe.moe_gather(x, tok, interpret=False), [spec((t, h), bf16), spec((r,), i32)]),
        "moe_combine": (lambda y, rows, wts: moe.moe_combine(y, rows, wts, bf16, interpret=False),
                        [spec((r, h), bf16), spec((t, k), i32), spec((t, k), f32)]),
        "grouped_mm": (lambda x, w, o: moe.grouped_mm(x, w, o, interpret=False),
                       [spec((r, h), bf16), spec((e, h, i), bf16), spec((e,), i32)]),
        "grouped_mm_transposed": (lambda x, w, o: moe.grouped_mm(x, w, o, f32, True, interpret=False),
                                  [spec((r, h), bf16), spec((e, i, h), bf16), spec((e,), i32)]),
        "grouped_mm_weight_grad": (lambda x, dy, o: moe.grouped_mm_weight_grad(x, dy, o, e, bf16, interpret=False),
                                   [spec((r, h), bf16), spec((r, i), bf16), spec((e,), i32)]),
        "fused_moe": (lambda *a: moe.fused_moe(*a, "silu", interpret=False),
                      [spec((t, h), bf16), spec((e, 2 * i, h), bf16), spec((e, h, i), bf16), *maps]),
        "fused_moe_fp8_channel": (lambda *a: moe.fused_moe(*a[:7], "swigluoai", *a[7:], interpret=False),
                                  [spec((t, h), bf16), spec((e, 2 * i, h), fp8), spec((e, h, i), fp8), *maps,
                                   spec((e, 2 * i), f32), spec((e, h), f32)]),
        "fused_moe_fp8_block": (lambda *a: moe.fused_moe(*a[:7], "gelu", *a[7:], (128, 128), interpret=False),
                                [spec((t, h), bf16), spec((e, 2 * i, h), fp8), spec((e, h, i), fp8), *maps,
                                 spec((e, 12, 16), f32), spec((e, 16, 6), f32)]),
    }


LOWERINGS = ["router_topk", "moe_gather", "moe_combine", "grouped_mm", "grouped_mm_transposed",
             "grouped_mm_weight_grad", "fused_moe", "fused_moe_fp8_channel", "fused_moe_fp8_block"]


@pytest.mark.parametrize("name", LOWERINGS)
def test_lowers_for_tpu(name):
    assert_lowers_for_tpu(*_lowerings()[name])


def test_mosaic_compiles_for_tpu_generations(monkeypatch):
    """The lowerings above through Mosaic and the TPU compiler, with libtpu (harness)."""
    assert_compiles_for_tpu_generations(monkeypatch, "test_moe_pallas", LOWERINGS)

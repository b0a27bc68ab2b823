"""Randomized differential tests, one per op family: hypothesis draws unusual but valid inputs and
every backend must agree with the definition on them.

Drawn together: block size 1, head sizes 80 and 96, GQA ratios 1..8, prefix pages shared by
several sequences, sliding window 1, extreme quantization scales, NaN garbage in every cache slot
no query may read, the poison check on every cache write (paged attention); T = 1, K = 1, very
strong decay (g = -1e4, -inf), beta 0 and 1, empty packed sequences, B = 0 (linear attention);
one feature, one row, many classes, far-apart means (ood).

Examples per backend are few in CI (the interpreters are slow); ``TORCH_KERNELS_FUZZ_EXAMPLES=N``
multiplies them by N for a longer hunt. Generation is derandomized, so a CI failure reproduces.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import torch_kernels
from harness import assert_close, backend_params, require_backend
from torch_kernels import backends
from torch_kernels.reference import linear_attention as linear_reference
from torch_kernels.reference import paged_attention as paged_reference
from torch_kernels.reference import ood as ood_reference

SCALE = int(os.environ.get("TORCH_KERNELS_FUZZ_EXAMPLES", "1"))
# Pallas compiles every new shape (seconds each in interpret mode), the Triton interpreter is slow.
EXAMPLES = {"reference": 40, "triton": 8, "pallas": 4, "sycl": 12}
QUANTIZED = paged_reference.QUANTIZED_DTYPES


def fuzz_settings(backend: str):
    return settings(max_examples=EXAMPLES[backend] * SCALE, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink) if backend == "reference"
                    else (Phase.explicit, Phase.generate),
                    suppress_health_check=list(HealthCheck))


# ---- paged attention ----

@dataclasses.dataclass(frozen=True)
class PagedCase:
    q_lens: tuple[int, ...]
    contexts: tuple[int, ...]  # tokens already cached before the new ones
    shared_pages: int  # leading pages every sequence's block table shares (a cached prefix)
    block_size: int
    num_kv_heads: int
    group: int
    head_size: int
    dtype: torch.dtype
    cache_dtype: torch.dtype
    scales: tuple[float, ...] | None  # per kv head, for k and v
    sliding_window: int | None
    soft_cap: float | None
    fused: bool
    padding: tuple[int, ...]
    seed: int


@st.composite
def paged_cases(draw):
    block_size = draw(st.sampled_from((1, 2, 16, 32)))
    shared_pages = draw(st.integers(0, 2 if block_size > 2 else 6))
    num_seqs = draw(st.integers(1, 3))
    q_lens = tuple(draw(st.integers(0, 6)) for _ in range(num_seqs))
    # a sequence past its shared prefix: its new tokens land on pages of its own
    contexts = tuple(shared_pages * block_size + draw(st.integers(0, 40)) for _ in range(num_seqs))
    num_kv_heads = draw(st.integers(1, 2))
    dtype = draw(st.sampled_from((torch.float32, torch.float16, torch.bfloat16)))
    cache_dtype = draw(st.sampled_from((dtype, dtype, *QUANTIZED)))
    extreme = st.sampled_from((1e-3, 0.02, 1.0, 250.0))
    scales = tuple(draw(extreme) for _ in range(num_kv_heads)) if cache_dtype in QUANTIZED or draw(st.booleans()) \
        else None
    num_tokens = sum(q_lens)
    fused = draw(st.booleans())
    return PagedCase(
        q_lens=q_lens, contexts=contexts, shared_pages=shared_pages, block_size=block_size,
        num_kv_heads=num_kv_heads, group=draw(st.integers(1, 8)),
        head_size=draw(st.sampled_from((64, 80, 96, 128))), dtype=dtype, cache_dtype=cache_dtype, scales=scales,
        sliding_window=draw(st.none() | st.just(1) | st.integers(2, 30)),
        soft_cap=draw(st.none() | st.just(5.0)), fused=fused,
        padding=tuple(sorted(draw(st.sets(st.integers(0, num_tokens - 1), max_size=2)))) if fused and num_tokens
        else (),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _garbage(cache: torch.Tensor, where: torch.Tensor) -> None:
    """NaN (int8: random bytes) in the slots ``where`` of a ``[blocks, block_size, Hkv, D]`` cache."""
    flat = cache.view(-1, *cache.shape[2:])
    if cache.dtype == torch.int8:
        flat[where] = torch.randint(-128, 128, flat[where].shape, dtype=torch.int8)
    else:
        flat.view(torch.uint8)[where] = 0xFF  # NaN in every float dtype here


def make_paged(case: PagedCase):
    """Keyword arguments of ragged_paged_attention, and a mask of the slots it may write."""
    gen = torch.Generator().manual_seed(case.seed)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_size
    kv_lens = [c + q for c, q in zip(case.contexts, case.q_lens)]
    own_pages = [-(-kv // bs) - case.shared_pages for kv in kv_lens]
    num_blocks = case.shared_pages + sum(own_pages) + 2
    order = torch.randperm(num_blocks, generator=gen)
    shared, taken = order[:case.shared_pages].tolist(), case.shared_pages
    width = max(case.shared_pages + n for n in own_pages) + 1
    table = torch.full((len(kv_lens), width), num_blocks + 5, dtype=torch.int32)  # past the pages: garbage ids
    for s, n in enumerate(own_pages):
        table[s, :case.shared_pages] = torch.tensor(shared, dtype=torch.int32)
        table[s, case.shared_pages:case.shared_pages + n] = order[taken:taken + n].int()
        taken += n
    scale = None if case.scales is None else torch.tensor(case.scales)
    heads_scale = torch.ones(hkv) if scale is None else scale
    shape = (num_blocks, bs, hkv, d)
    caches = [paged_reference.quantize(torch.randn(shape, generator=gen) * heads_scale[:, None], heads_scale,
                                       case.cache_dtype) for _ in range(2)]
    slots = [int(table[s, p // bs]) * bs + p % bs
             for s, (c, q) in enumerate(zip(case.contexts, case.q_lens)) for p in range(c, c + q)]
    # entries some query attends to hold valid values; everything else holds NaN, which no query
    # may read: slots past kv_len, pages no sequence uses, positions outside every query's window
    read = torch.zeros(num_blocks * bs, dtype=torch.bool)
    for s, (c, q) in enumerate(zip(case.contexts, case.q_lens)):
        for p in range(c, c + q):
            for j in range(max(0, p - case.sliding_window + 1) if case.sliding_window else 0, p + 1):
                read[int(table[s, j // bs]) * bs + j % bs] = True
    valid = read.clone()
    valid[slots] = False  # the new tokens are written before they are read
    valid[[slots[i] for i in case.padding]] = True  # a padding token writes nothing: its slot keeps its entry
    for cache in caches:
        _garbage(cache, ~valid)
    t = sum(case.q_lens)
    kw = dict(
        query=torch.randn(t, hkv * case.group, d, generator=gen).to(case.dtype),
        key_cache=caches[0], value_cache=caches[1],
        cu_q_lens=torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()], dtype=torch.int32),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32), block_table=table, sm_scale=d ** -0.5,
        sliding_window=case.sliding_window, soft_cap=case.soft_cap, k_scale=scale, v_scale=scale,
        key=torch.randn(t, hkv, d, generator=gen).to(case.dtype) * heads_scale[:, None].to(case.dtype),
        value=torch.randn(t, hkv, d, generator=gen).to(case.dtype) * heads_scale[:, None].to(case.dtype),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).reshape(-1),
    )
    kw["slot_mapping"][list(case.padding)] = -1
    if not case.fused:  # the new tokens are in the cache already
        paged_reference.reshape_and_cache(kw["key"], kw["value"], caches[0], caches[1], kw["slot_mapping"],
                                          heads_scale, heads_scale)
        for name in ("key", "value", "slot_mapping"):
            kw[name] = None
    return kw


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()]).to(torch.int32)


@pytest.mark.parametrize("backend", backend_params("ragged_paged_attention"))
def test_paged_attention_fuzz(backend):
    """Output within the query dtype's tolerance of the definition's (float32 gets 10x: the
    definition's own float32 rounding); the cache written only at slot_mapping's slots, each holding
    its token quantized as the reference does (one step off at most where the write is fused)."""
    require_backend(backend)

    @fuzz_settings(backend)
    @given(case=paged_cases())
    def check(case):
        kw = make_paged(case)
        want_caches = [c.clone() for c in (kw["key_cache"], kw["value_cache"])]
        want = paged_reference.ragged_paged_attention_naive(
            **{**kw, "query": kw["query"].float(), "key_cache": want_caches[0], "value_cache": want_caches[1]})
        before = [c.clone() for c in (kw["key_cache"], kw["value_cache"])]
        out = torch_kernels.ragged_paged_attention(**kw, implementation=backend)
        assert backends.last_backend("ragged_paged_attention") == backend
        if out.numel():
            assert_close(out, want, case.dtype, scale=10 if case.dtype == torch.float32 else 1, what="output")
        written = torch.zeros(before[0].shape[0] * case.block_size, dtype=torch.bool)
        if case.fused:
            written[kw["slot_mapping"][kw["slot_mapping"] >= 0]] = True
        for name, got, old, expected in zip(("key_cache", "value_cache"), (kw["key_cache"], kw["value_cache"]),
                                            before, want_caches):
            flat, old_flat, want_flat = (c.view(-1, *c.shape[2:]) for c in (got, old, expected))
            assert torch.equal(_bits(flat[~written]), _bits(old_flat[~written])), f"{name}: a slot outside slot_mapping changed"
            off = (_bits(flat[written]) - _bits(want_flat[written])).abs()
            assert off.numel() == 0 or off.max() <= (0 if backend == "reference" else 1), f"{name}: written entries"

    check()


# ---- linear attention ----

LINEAR_OPS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_simple_gla")
BOUNDS = {"o": 5e-4, "final_state": 5e-4, "dq": 8e-4, "dk": 8e-4, "dv": 8e-4, "dh0": 8e-4, "dg": 2e-3, "dbeta": 2e-3}
LEAVES = ("q", "k", "v", "g", "beta", "initial_state")


@st.composite
def linear_cases(draw):
    op = draw(st.sampled_from(LINEAR_OPS))
    delta = op != "chunk_simple_gla"
    packed = draw(st.booleans())
    if packed:
        lens = draw(st.lists(st.integers(0, 70), min_size=1, max_size=3))
        batch, length = 1, sum(lens)
        cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    else:
        batch, length, cu = draw(st.integers(0, 2)), draw(st.sampled_from((1, 2, 17, 64, 65, 130))), None
    heads = draw(st.integers(1, 2))
    k_dim = draw(st.sampled_from((1, 16, 40)))
    return dict(op=op, batch=batch, length=length, cu_seqlens=cu, heads=heads,
                value_heads=heads * (draw(st.integers(1, 2)) if delta else 1),
                k_dim=k_dim, v_dim=draw(st.sampled_from((1, 16, 24))),
                decay=draw(st.sampled_from(("none", "weak", "strong", "spiky", "reset"))),
                beta=draw(st.sampled_from(("zero", "one", "random"))),
                # with K = 1 the l2 norm's gradient, eps / (q^2 + eps)^1.5, is a float32 cancellation
                l2norm=delta and k_dim > 1 and draw(st.booleans()),
                initial_state=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


def make_linear(case):
    gen = torch.Generator().manual_seed(case["seed"])
    b, t, h, hv, k_dim, v_dim = (case[n] for n in ("batch", "length", "heads", "value_heads", "k_dim", "v_dim"))
    q = torch.randn(b, t, h, k_dim, generator=gen)
    k = torch.randn(b, t, h, k_dim, generator=gen)
    if not case["l2norm"]:  # keys of norm at most 1 keep the recurrence bounded
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1.0)
    gate = (b, t, hv)
    g = {"none": lambda: torch.zeros(gate), "weak": lambda: -0.05 * torch.rand(gate, generator=gen),
         "strong": lambda: -8 * torch.rand(gate, generator=gen)}.get(case["decay"], lambda: torch.full(gate, -0.1))()
    if case["decay"] in ("spiky", "reset"):
        g[:, 4::7] = -1e4 if case["decay"] == "spiky" else -math.inf
    n = b if case["cu_seqlens"] is None else len(case["cu_seqlens"]) - 1
    x = dict(q=q, k=k, v=torch.randn(b, t, hv, v_dim, generator=gen), g=g, scale=max(k_dim, 1) ** -0.5,
             initial_state=torch.randn(n, hv, k_dim, v_dim, generator=gen) if case["initial_state"] else None,
             cu_seqlens=None if case["cu_seqlens"] is None else torch.tensor(case["cu_seqlens"], dtype=torch.int32))
    if case["op"] != "chunk_simple_gla":
        x["beta"] = {"zero": torch.zeros, "one": torch.ones}.get(
            case["beta"], lambda shape: torch.rand(shape, generator=gen))(gate)
        x["use_qk_l2norm_in_kernel"] = case["l2norm"]
    return x


def _relative_rmse(got, want, floor: float = 1e-12) -> float:
    got, want = got.detach().double(), want.detach().double()
    if want.numel() == 0:
        return 0.0
    return ((got - want).square().mean().sqrt() / want.square().mean().sqrt().clamp_min(floor)).item()


def _outputs_and_grads(op, x, backend=None):
    """(o, final state, gradients of a fixed loss) of the op, or of the float64 recurrence."""
    leaves = {n: x[n].detach().clone().double().requires_grad_() if backend is None
              else x[n].detach().clone().requires_grad_() for n in LEAVES if x.get(n) is not None}
    args = {**x, **leaves}
    if backend is None:
        o, ht = linear_reference.recurrence_naive(args["q"], args["k"], args["v"], args["g"], args.get("beta"),
                                                  x["scale"], args["initial_state"], x["cu_seqlens"],
                                                  x.get("use_qk_l2norm_in_kernel", False))
    else:
        o, ht = getattr(torch_kernels, op)(**args, output_final_state=True, implementation=backend)
    gen = torch.Generator().manual_seed(1)
    do, dht = torch.randn(o.shape, generator=gen), torch.randn(ht.shape, generator=gen)
    pairs = [(out, grad.to(out.dtype)) for out, grad in ((o, do), (ht, dht)) if out.requires_grad]
    grads = [None] * len(leaves)
    if pairs:
        grads = torch.autograd.grad([out for out, _ in pairs], list(leaves.values()), [grad for _, grad in pairs],
                                    allow_unused=True)
    # what no output depends on (empty sequences without a state) has a zero gradient
    return o, ht, {f"d{n}".replace("dinitial_state", "dh0"): torch.zeros_like(leaf) if g is None else g
                   for (n, leaf), g in zip(leaves.items(), grads)}


@pytest.mark.parametrize("backend", backend_params("chunk_gated_delta_rule"))
def test_linear_attention_fuzz(backend):
    """Outputs, final states and every gradient against the float64 recurrence, by relative RMSE
    within a tenth of the family's bounds; nothing non-finite where the truth is finite."""
    require_backend(backend)

    @fuzz_settings(backend)
    @given(case=linear_cases())
    def check(case):
        x = make_linear(case)
        got_o, got_ht, got = _outputs_and_grads(case["op"], x, backend)
        want_o, want_ht, want = _outputs_and_grads(case["op"], x)
        errors = {"o": _relative_rmse(got_o, want_o), "final_state": _relative_rmse(got_ht, want_ht)}
        # a gradient that is exactly zero in float64 (g = 0, beta = 1, K = 1) comes out as float32
        # rounding residue: measure it against a thousandth of the output's scale, not against zero
        floor = 1e-3 * want_o.detach().double().square().mean().sqrt().item() if want_o.numel() else 1e-12
        for name, g in want.items():
            errors[name] = _relative_rmse(got[name], g, max(floor, 1e-12))
        bad = {n: f"{e:.1e}" for n, e in errors.items() if not e <= BOUNDS[n]}
        assert not bad, f"relative RMSE over bounds: {bad}"

    check()


# ---- ood ----

@st.composite
def ood_cases(draw):
    return dict(b=draw(st.sampled_from((0, 1, 7, 300))), d=draw(st.sampled_from((1, 3, 17, 64, 130))),
                c=draw(st.sampled_from((1, 2, 5, 150, 256))), spread=draw(st.sampled_from((0.0, 1.0, 10.0))),
                dtype=draw(st.sampled_from((torch.float32, torch.float16, torch.bfloat16))),
                nan_row=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


@pytest.mark.parametrize("backend", backend_params("mahalanobis_score"))
def test_ood_fuzz(backend):
    """Scores within the dtype's tolerance of the float64 definition; a NaN row scores NaN and
    leaves the other rows alone."""
    require_backend(backend)

    @fuzz_settings(backend)
    @given(case=ood_cases())
    def check(case):
        gen = torch.Generator().manual_seed(case["seed"])
        b, d, c = case["b"], case["d"], case["c"]
        means = case["spread"] * torch.randn(c, d, generator=gen)
        whitener = torch.eye(d) + 0.1 * torch.randn(d, d, generator=gen).triu()
        x = means[torch.randint(0, c, (b,), generator=gen)] + torch.randn(b, d, generator=gen)
        if case["nan_row"] and b:
            x[b // 2, 0] = math.nan
        x = x.to(case["dtype"])
        params = case["dtype"] if case["dtype"] != torch.bfloat16 else torch.float32
        got = torch_kernels.mahalanobis_score(x, means.to(params), whitener.to(params), implementation=backend)
        want = ood_reference.mahalanobis_score_naive(x.double(), means.to(params).double(), whitener.to(params).double())
        nan_rows = want.isnan()
        assert torch.equal(got.isnan(), nan_rows)
        ok = ~nan_rows
        if not ok.any():
            return
        if c == 1:
            assert_close(got[ok].double(), want[ok], case["dtype"], what="scores")
            return
        # several classes: the fused ||y||^2 - 2 y.p + ||p||^2 (README) cancels, so the error is
        # held to the size of those terms rather than to the distance left after cancelling
        w64 = whitener.to(params).double()
        terms = (x[ok].double() @ w64).square().sum(1) + (means.to(params).double() @ w64).square().sum(1).max()
        tol = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[case["dtype"]]
        error = ((got[ok].double() - want[ok]).abs() / terms.clamp_min(1e-30)).max().item()
        assert error <= tol, f"scores: error {error:.2e} of the cancelled terms > {tol:.0e}"

    check()

"""The mla ops (mla_reshape_and_cache, ragged_paged_mla) on every backend, against DeepSeek-V3's
attention written here from its equations, uncompressed: per head, keys
``[c_s W_UK_h, k_pe_s]`` and values ``c_s W_UV_h`` from the latents ``c_s``, queries
``[q_nope_h, q_pe_h]``, causal softmax, in float64. The op runs the absorbed form
(``q_nope_h W_UK_h^T`` in, ``W_UV_h`` applied to its output) on a cache the write op filled, so
the two together must give that attention. Then: the sparse path against the same attention
under the mask its indices describe, the cache write's slots (only they change, -1 skipped, fp8
round trip), and the op contract (opcheck, torch.compile with no graph break, checked inputs).
"""

from __future__ import annotations

import pytest
import torch

import torch_kernels
from torch_kernels import backends
from harness import assert_close, backend_params, compiled_fullgraph, require_backend, run_isolated, run_opcheck
from torch_kernels.ops import mla as ops
from torch_kernels.selftest import TOLERANCES

HEADS, LATENT, ROPE, NOPE, VALUE = 4, 32, 16, 16, 16
BLOCK = 8
FP8 = torch.float8_e4m3fn


# ---- the definition: uncompressed MLA ----

def uncompressed_mla(q_nope, q_pe, c, k_pe, w_uk, w_uv, q_lens, kv_lens, scale, chosen=None):
    """(out ``[T, H, dv]``, lse ``[T, H]``) in float64 from the paper's per-head projections:
    sequence ``s`` owns the next ``q_lens[s]`` queries, its tokens are rows ``offset:offset +
    kv_lens[s]`` of ``c`` and ``k_pe``, query ``i`` sees positions ``<= kv_len - q_len + i``
    (and, given ``chosen``, only those ``chosen[t]`` lists)."""
    q_nope, q_pe, c, k_pe, w_uk, w_uv = (t.double() for t in (q_nope, q_pe, c, k_pe, w_uk, w_uv))
    heads, rope = q_nope.shape[1], k_pe.shape[1]
    out = torch.zeros(q_nope.shape[0], heads, w_uv.shape[2], dtype=torch.float64)
    lse = torch.full((q_nope.shape[0], heads), float("-inf"), dtype=torch.float64)
    token, row = 0, 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        keys = torch.cat([torch.einsum("sl,hld->shd", c[row:row + kv_len], w_uk),
                          k_pe[row:row + kv_len, None, :].expand(kv_len, heads, rope)], dim=-1)
        values = torch.einsum("sl,hlv->shv", c[row:row + kv_len], w_uv)
        for i in range(q_len):
            t = token + i
            query = torch.cat([q_nope[t], q_pe[t]], dim=-1)  # [H, dn + R]
            seen = [p for p in range(kv_len - q_len + i + 1) if chosen is None or p in chosen[t]]
            if not seen:
                continue
            logits = torch.einsum("hd,shd->hs", query, keys[seen]) * scale
            out[t] = torch.einsum("hs,shv->hv", logits.softmax(-1), values[seen])
            lse[t] = logits.logsumexp(-1)
        token, row = token + q_len, row + kv_len
    return out, lse


class Batch:
    """A ragged batch over shuffled pages: every token's latent and RoPE key (sequences one after
    another), its slot, the queries in both forms and the projections."""

    def __init__(self, q_lens, contexts, seed=0, dtype=torch.float32):
        gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.kv_lens = list(q_lens), [q + c for q, c in zip(q_lens, contexts)]
        tokens, kv_total = sum(self.q_lens), sum(self.kv_lens)
        pages = [-(-n // BLOCK) for n in self.kv_lens]
        num_blocks = sum(pages) + 2
        ids = torch.randperm(num_blocks, generator=gen).tolist()
        self.block_table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
        slots = []
        for s, (n, kv_len) in enumerate(zip(pages, self.kv_lens)):
            self.block_table[s, :n] = torch.tensor(ids[:n], dtype=torch.int32)
            slots += [ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(kv_len)]
            ids = ids[n:]
        self.slots = torch.tensor(slots)
        self.c = torch.randn(kv_total, LATENT, generator=gen).to(dtype)
        self.k_pe = torch.randn(kv_total, ROPE, generator=gen).to(dtype)
        self.q_nope = torch.randn(tokens, HEADS, NOPE, generator=gen).to(dtype)
        self.q_pe = torch.randn(tokens, HEADS, ROPE, generator=gen).to(dtype)
        self.w_uk = (torch.randn(HEADS, LATENT, NOPE, generator=gen) * LATENT ** -0.5).to(dtype)
        self.w_uv = (torch.randn(HEADS, LATENT, VALUE, generator=gen) * LATENT ** -0.5).to(dtype)
        self.cu_q_lens = torch.tensor([0, *torch.tensor(self.q_lens).cumsum(0).tolist()], dtype=torch.int32)
        self.kv_len_tensor = torch.tensor(self.kv_lens, dtype=torch.int32)
        self.cache = torch.full((num_blocks, BLOCK, LATENT + ROPE), float("nan")).to(dtype)  # unwritten rows: NaN
        self.scale = (NOPE + ROPE) ** -0.5
        self.dtype = dtype

    def absorbed_query(self):
        """``q_nope_h W_UK_h^T``, rounded to the batch's dtype (what a model feeds the op)."""
        return torch.einsum("thd,hld->thl", self.q_nope.double(), self.w_uk.double()).to(self.dtype)

    def truth(self, chosen=None):
        return uncompressed_mla(self.q_nope, self.q_pe, self.c, self.k_pe, self.w_uk, self.w_uv, self.q_lens,
                                self.kv_lens, self.scale, chosen)

    def attend(self, backend, query=None, topk=None, cache=None, kv_scale=None):
        return torch_kernels.ragged_paged_mla(
            self.absorbed_query() if query is None else query, self.q_pe, self.cache if cache is None else cache,
            self.cu_q_lens, self.kv_len_tensor, self.block_table, self.scale, topk_indices=topk, return_lse=True,
            kv_scale=kv_scale, implementation=backend)


# decodes, a prefill chunk over a context, whole prompts: one batch
MIXED = dict(q_lens=(1, 6, 1, 9, 3), contexts=(20, 11, 33, 0, 0))


def skip_pallas_compiles(backend, covered_by):
    """The pallas attention compiles every new shape and dtype for about 5 s in interpret mode:
    its cases are the float32 dense and the sparse tests; the others say what covers them."""
    if backend == "pallas":
        pytest.skip(f"pallas: another interpret-mode compile (~5 s); {covered_by}")


def _lse_close(lse, truth, dtype):
    finite = torch.isfinite(truth)
    assert torch.equal(torch.isfinite(lse), finite)
    error = ((lse.double() - truth).abs()[finite] / truth.abs()[finite].clamp_min(1.0)).max().item()
    assert error <= TOLERANCES[dtype][0], error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("backend", backend_params(ops.OP))
def test_absorbed_mla_equals_uncompressed_attention(backend, dtype):
    if dtype != torch.float32:
        skip_pallas_compiles(backend, "bfloat16 dots are jnp.dot's, as in its float32 case")
    batch = Batch(**MIXED, dtype=dtype)
    torch_kernels.mla_reshape_and_cache(batch.c, batch.k_pe, batch.cache, batch.slots, implementation=backend)
    out, lse = batch.attend(backend)
    assert out.dtype == dtype and out.shape == (sum(batch.q_lens), HEADS, LATENT) and lse.dtype == torch.float32
    expected, expected_lse = batch.truth()
    got = torch.einsum("thl,hlv->thv", out.double(), batch.w_uv.double())
    # bfloat16: the absorbed query and the output are each rounded to 8 bits once more than the
    # uncompressed form is (measured: 6.7e-2 element-wise against the 5e-2 of one rounding)
    assert_close(got, expected, dtype, scale=2.0 if dtype == torch.bfloat16 else 1.0, what="W_UV(out)")
    _lse_close(lse, expected_lse, dtype)


def _selection(batch, gen, top_k=5):
    """Random indices per query: positions of its sequence (future ones too, which causality
    drops), -1s and repeats; the last query of the first sequence selects nothing."""
    rows = []
    for q_len, kv_len in zip(batch.q_lens, batch.kv_lens):
        for _ in range(q_len):
            rows.append(torch.randint(-1, kv_len, (top_k,), generator=gen).tolist())
    rows[0] = [rows[0][1]] * top_k  # one position, listed five times
    rows[batch.q_lens[0] - 1 + 1] = [-1] * top_k  # the prefill chunk's first query: nothing
    return torch.tensor(rows, dtype=torch.int32), [set(r) - {-1} for r in rows]


@pytest.mark.parametrize("backend", backend_params(ops.OP))
def test_sparse_attention_equals_masked_dense_attention(backend):
    batch = Batch(**MIXED, seed=1)
    torch_kernels.mla_reshape_and_cache(batch.c, batch.k_pe, batch.cache, batch.slots)
    topk, chosen = _selection(batch, torch.Generator().manual_seed(2))
    out, lse = batch.attend(backend, topk=topk)
    expected, expected_lse = batch.truth(chosen)
    assert_close(torch.einsum("thl,hlv->thv", out.double(), batch.w_uv.double()), expected, torch.float32)
    _lse_close(lse, expected_lse, torch.float32)
    empty = batch.q_lens[0]
    assert torch.equal(out[empty], torch.zeros_like(out[empty])) and lse[empty].eq(float("-inf")).all()
    if backend == "pallas":  # its dense path is held to the truth above; this would compile a third shape (~5 s)
        return
    # every position of a sequence listed: the dense result
    everything = torch.full((sum(batch.q_lens), max(batch.kv_lens)), -1, dtype=torch.int32)
    token = 0
    for q_len, kv_len in zip(batch.q_lens, batch.kv_lens):
        everything[token:token + q_len, :kv_len] = torch.arange(kv_len, dtype=torch.int32)
        token += q_len
    dense_out, dense_lse = batch.attend(backend)
    sparse_out, sparse_lse = batch.attend(backend, topk=everything)
    torch.testing.assert_close(sparse_out, dense_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sparse_lse, dense_lse, rtol=1e-6, atol=1e-6)


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8, torch.float32], ids=["bfloat16", "fp8", "float32"])
@pytest.mark.parametrize("backend", backend_params(ops.WRITE_OP))
def test_write_touches_only_its_slots(backend, cache_dtype):
    gen = torch.Generator().manual_seed(3)
    new_dtype = torch.float32 if cache_dtype != torch.bfloat16 else torch.bfloat16
    kv_c, k_pe, _, slots = ops.mla_write_inputs(gen, new_dtype, "cpu", tokens=19)
    slots[3] = -1  # two padding tokens (mla_write_inputs pads the middle one)
    cache = torch.randn(5, 16, LATENT + ROPE, generator=gen).to(cache_dtype)
    before = cache.clone()
    scale = torch.tensor([0.25]) if cache_dtype == FP8 else None
    torch_kernels.mla_reshape_and_cache(kv_c, k_pe, cache, slots, scale, implementation=backend)
    written = torch.zeros(5 * 16, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    flat, flat_before = _bits(cache).reshape(80, -1), _bits(before).reshape(80, -1)
    assert torch.equal(flat[~written], flat_before[~written])  # bitwise: every other row untouched
    rows = torch.cat([kv_c, k_pe], dim=-1)[slots >= 0].float()
    stored = cache.reshape(80, -1)[slots[slots >= 0]].float()
    if cache_dtype == FP8:  # stored = value / scale, within fp8's half step (3 mantissa bits)
        torch.testing.assert_close(stored * 0.25, rows, rtol=2 ** -4, atol=2 ** -9 * 0.25)
        assert (stored * 0.25 - rows).abs().max() > 0  # it did round
    else:
        assert torch.equal(stored, rows)


@pytest.mark.parametrize("backend", backend_params(ops.WRITE_OP))
def test_write_matches_the_reference_bitwise_with_nan_inf_and_saturation(backend):
    gen = torch.Generator().manual_seed(4)
    kv_c, k_pe, _, slots = ops.mla_write_inputs(gen, torch.float32, "cpu", tokens=9)
    kv_c[0, 0], kv_c[1, 1], k_pe[2, 2], k_pe[5, 0] = float("nan"), float("inf"), -1e6, float("-inf")
    caches = [torch.zeros(5, 16, LATENT + ROPE, dtype=FP8) for _ in range(2)]
    for cache, impl in zip(caches, ("reference", backend)):
        torch_kernels.mla_reshape_and_cache(kv_c, k_pe, cache, slots, torch.tensor(2.0), implementation=impl)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    block, offset = divmod(int(slots[0]), 16)
    assert caches[1][block, offset, 0].float().isnan()
    block, offset = divmod(int(slots[1]), 16)
    assert caches[1][block, offset, 1].float() == 448  # saturated
    block, offset = divmod(int(slots[5]), 16)
    assert caches[1][block, offset, LATENT].float() == -448


@pytest.mark.parametrize("backend", backend_params(ops.OP))
def test_fp8_cache_attention_equals_attention_over_its_values(backend):
    batch = Batch(q_lens=(1, 4), contexts=(17, 3), seed=5)
    cache = torch.zeros(batch.cache.shape, dtype=FP8)
    scale = torch.tensor([0.5])
    torch_kernels.mla_reshape_and_cache(batch.c, batch.k_pe, cache, batch.slots, scale)
    out, lse = batch.attend(backend, cache=cache, kv_scale=scale)
    widened = cache.float() * 0.5  # the values the fp8 cache holds
    exact, exact_lse = batch.attend("reference", cache=widened)
    assert_close(out.double(), exact.double(), torch.float32)
    _lse_close(lse, exact_lse.double(), torch.float32)
    # and the round trip costs fp8's precision only
    torch_kernels.mla_reshape_and_cache(batch.c, batch.k_pe, batch.cache, batch.slots)
    truth = batch.attend("reference")[0]
    assert ((out - truth).abs().max() / truth.abs().max()).item() < 0.1


# ---- the op contract ----

def _write_args(backend):
    batch = Batch(q_lens=(1, 3), contexts=(5, 2))
    return batch, (batch.c, batch.k_pe, batch.cache.nan_to_num(), batch.slots, None, backend)


@pytest.mark.parametrize("backend", backend_params(ops.OP))
def test_opcheck(backend):
    skip_pallas_compiles(backend, "the op's registration is checked on the other backends")
    batch, write_args = _write_args(backend)
    run_opcheck(ops.mla_reshape_and_cache_op, write_args)
    torch_kernels.mla_reshape_and_cache(*write_args[:4])
    topk = torch.tensor([[0, 3, -1]] * 4, dtype=torch.int32)
    for chosen in (None, topk):
        run_opcheck(ops.ragged_paged_mla_op, (batch.absorbed_query(), batch.q_pe, write_args[2], batch.cu_q_lens,
                                              batch.kv_len_tensor, batch.block_table, batch.scale, chosen, None,
                                              backend))


def test_compiles_with_no_graph_break():
    batch, (c, k_pe, cache, slots, _, _) = _write_args(None)

    def step(c, k_pe, cache, query, q_pe):
        torch_kernels.mla_reshape_and_cache(c, k_pe, cache, slots)
        return torch_kernels.ragged_paged_mla(query, q_pe, cache, batch.cu_q_lens, batch.kv_len_tensor,
                                              batch.block_table, batch.scale, return_lse=True)

    eager_cache, compiled_cache = cache.clone(), cache.clone()
    expected = step(c, k_pe, eager_cache, batch.absorbed_query(), batch.q_pe)
    got = compiled_fullgraph(step)(c, k_pe, compiled_cache, batch.absorbed_query(), batch.q_pe)
    assert torch.equal(compiled_cache, eager_cache)
    torch.testing.assert_close(got, expected)


def test_inference_only_and_cost():
    batch, (c, k_pe, cache, slots, _, _) = _write_args(None)
    torch_kernels.mla_reshape_and_cache(c, k_pe, cache, slots)
    query = batch.absorbed_query().requires_grad_()
    with pytest.raises(RuntimeError):
        torch_kernels.ragged_paged_mla(query, batch.q_pe, cache, batch.cu_q_lens, batch.kv_len_tensor,
                                       batch.block_table, batch.scale).sum().backward()
    # 2 * H * (2 Lr + R) flops per attended pair; sequences (1 query, 6 keys) and (3, 5): 6 + 3 + 4 + 5
    assert ops.attended_pairs([1, 3], [6, 5]) == 18
    assert ops.attended_pairs([1, 3], [6, 5], top_k=4) == 4 + 3 + 4 + 4


# ---- DeepSeek's own sizes ----

def _deepseek_batch(gen, q_lens=(1, 3, 1), contexts=(37, 20, 100)):
    """A decode, a prefill chunk and a long decode over shuffled 16-token pages: ``(cu_q_lens,
    kv_lens, block_table, num_blocks)``."""
    kv_lens = [q + c for q, c in zip(q_lens, contexts)]
    pages = [-(-n // BLOCK) for n in kv_lens]
    ids = torch.randperm(sum(pages) + 1, generator=gen).to(torch.int32)
    table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    for s, n in enumerate(pages):
        table[s, :n], ids = ids[:n], ids[n:]
    cu_q_lens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return cu_q_lens, torch.tensor(kv_lens, dtype=torch.int32), table, sum(pages) + 1


@pytest.mark.parametrize("backend", [b for b in backends.implementations(ops.OP) if b != "reference"])
def test_every_backend_equals_the_reference_at_deepseek_sizes(backend):
    """DeepSeek-V3's latent 512 and RoPE 64 at 16 and 128 heads (128 only on pallas: each head count is
    another interpret-mode compile), dense and top-8; DeepSeek-V3.2's indexer, 64 heads of 128, top 64
    of up to 101 positions: the reference's indices exactly."""
    gen = torch.Generator().manual_seed(11)
    cu_q_lens, kv_lens, table, num_blocks = _deepseek_batch(gen)
    cache = torch.randn(num_blocks, BLOCK, 512 + 64, generator=gen)
    tokens = int(cu_q_lens[-1])
    topk = torch.randint(-1, 38, (tokens, 8), generator=gen, dtype=torch.int32)
    topk[1:4] = topk[1:4].clamp(max=20)  # within the chunk's sequence (kv_len 23)
    for heads in (128,) if backend == "pallas" else (16, 128):
        q_nope = torch.randn(tokens, heads, 512, generator=gen) * 512 ** -0.5
        q_pe = torch.randn(tokens, heads, 64, generator=gen)
        args = (q_nope, q_pe, cache, cu_q_lens, kv_lens, table, 192 ** -0.5)
        for chosen in (None, topk):
            got = torch_kernels.ragged_paged_mla(*args, topk_indices=chosen, implementation=backend)
            want = torch_kernels.ragged_paged_mla(*args, topk_indices=chosen, implementation="reference")
            assert_close(got, want, torch.float32, what=f"{heads} heads, {'dense' if chosen is None else 'top-8'}")
    if backend in backends.implementations(ops.INDEXER_OP):
        keys = torch.randn(num_blocks, BLOCK, 128, generator=gen)
        q, weights = torch.randn(tokens, 64, 128, generator=gen), torch.randn(tokens, 64, generator=gen)
        index = (q, keys, weights, cu_q_lens, kv_lens, table, 64)
        assert torch.equal(torch_kernels.indexer_topk(*index, implementation=backend),
                           torch_kernels.indexer_topk(*index, implementation="reference"))


# ---- the indexer ----

def _indexer_batch(seed=6, heads=3, dim=8):
    """A mixed batch's indexer queries, weights and keys (rows in sequence order, written to their
    slots of a paged cache)."""
    batch = Batch(**MIXED, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(sum(batch.kv_lens), dim, generator=gen)
    k_cache = torch.full((batch.cache.shape[0], BLOCK, dim), float("nan"))
    k_cache[batch.slots // BLOCK, batch.slots % BLOCK] = keys
    q = torch.randn(sum(batch.q_lens), heads, dim, generator=gen)
    weights = torch.randn(sum(batch.q_lens), heads, generator=gen)
    return batch, keys, k_cache, q, weights


def _best_positions(batch, keys, q, weights, top_k):
    """Each query's visible positions ranked by ``sum_h w_h relu(q_h . k_s)`` (float64), best first,
    lower position first among equals, -1 padded: loops."""
    rows, token, row = [], 0, 0
    for q_len, kv_len in zip(batch.q_lens, batch.kv_lens):
        for i in range(q_len):
            t = token + i
            scores = [(-sum(float(weights[t, h]) * max(float(q[t, h].double() @ keys[row + s].double()), 0.0)
                            for h in range(q.shape[1])), s) for s in range(kv_len - q_len + i + 1)]
            ranked = [s for _, s in sorted(scores)][:top_k]
            rows.append(ranked + [-1] * (top_k - len(ranked)))
        token, row = token + q_len, row + kv_len
    return torch.tensor(rows, dtype=torch.int32)


def _index(batch, k_cache, q, weights, top_k, backend=None):
    return torch_kernels.indexer_topk(q, k_cache, weights, batch.cu_q_lens, batch.kv_len_tensor, batch.block_table,
                                      top_k, implementation=backend)


# the interpreted kernels are slow: one case each, top_k 7 (three 16-position chunks merged for
# the longest sequence, -1 padding for the first queries of the prompts)
_INDEXER_CASES = [*(pytest.param("reference", k, id=f"reference-{k}") for k in (1, 7, 40)),
                  *(pytest.param(b, 7, id=f"{b}-7") for b in backends.implementations(ops.INDEXER_OP)
                    if b != "reference")]


@pytest.mark.parametrize("backend,top_k", _INDEXER_CASES)
def test_indexer_topk_ranks_the_visible_positions(backend, top_k):
    batch, keys, k_cache, q, weights = _indexer_batch()
    got = _index(batch, k_cache, q, weights, top_k, backend)  # 40: more than any query sees, -1 padded
    assert got.dtype == torch.int32 and torch.equal(got, _best_positions(batch, keys, q, weights, top_k))


@pytest.mark.parametrize("backend", backend_params(ops.INDEXER_OP))
def test_indexer_topk_breaks_ties_by_position_and_ranks_nan_last(backend):
    batch, keys, k_cache, q, weights = _indexer_batch(seed=7)
    tied = _index(batch, k_cache, q, torch.zeros_like(weights), 4, backend)  # every score 0
    expected = _best_positions(batch, keys, q, torch.zeros_like(weights), 4)
    assert torch.equal(tied, expected) and tied[0].tolist() == [0, 1, 2, 3]
    k_cache[batch.block_table[0, 0], 2] = float("nan")  # position 2 of the first sequence
    got = _index(batch, k_cache, q, weights.abs(), batch.kv_lens[0] + 3, backend)  # every position, then -1s
    first = got[0][got[0] >= 0]
    assert first[-1] == 2 and sorted(first.tolist()) == list(range(batch.kv_lens[0]))
    assert (got[0][batch.kv_lens[0]:] == -1).all()


def test_sycl_indexer_reads_queries_from_global_where_local_memory_is_short(monkeypatch):
    """DeepSeek-V3.2's 64 x 128 queries and top 2048 take 65,792 bytes of local memory staged, over
    a GPU's 64 KiB: the kernel then reads the queries where they are, with the same indices."""
    require_backend("sycl")
    from oneapi_impl import _runtime
    from oneapi_impl import mla as sycl_mla

    choose = sycl_mla._indexer_macros
    assert "Q_IN_GLOBAL" not in choose(torch.bfloat16, 64, 128, 2048, 128 * 1024)
    assert choose(torch.bfloat16, 64, 128, 2048, 64 * 1024)["Q_IN_GLOBAL"] == 1
    with pytest.raises(NotImplementedError, match="top_k 4096"):
        choose(torch.bfloat16, 64, 128, 4096, 64 * 1024)
    batch, keys, k_cache, q, weights = _indexer_batch()
    # 3 x 8 queries (96 bytes) do not fit beside 16 keys and 3 weights (268 bytes) in 300 bytes
    monkeypatch.setattr(_runtime, "local_memory_bytes", lambda: 300)
    assert choose(q.dtype, 3, 8, 7, 300)["Q_IN_GLOBAL"] == 1
    got = _index(batch, k_cache, q, weights, 7, "sycl")
    assert torch.equal(got, _best_positions(batch, keys, q, weights, 7))


def test_indexer_selection_feeds_sparse_attention():
    batch, keys, k_cache, q, weights = _indexer_batch(seed=8)
    torch_kernels.mla_reshape_and_cache(batch.c, batch.k_pe, batch.cache, batch.slots)
    topk = _index(batch, k_cache, q, weights, 6)
    chosen = [set(row) - {-1} for row in topk.tolist()]
    out, _ = batch.attend("reference", topk=topk)
    expected, _ = batch.truth(chosen)
    assert_close(torch.einsum("thl,hlv->thv", out.double(), batch.w_uv.double()), expected, torch.float32)


def test_indexer_opcheck_and_compile():
    batch, _, k_cache, q, weights = _indexer_batch()
    args = (q, k_cache, weights, batch.cu_q_lens, batch.kv_len_tensor, batch.block_table, 5)
    run_opcheck(ops.indexer_topk_op, (*args, None))
    compiled = compiled_fullgraph(lambda *a: torch_kernels.indexer_topk(*a, 5))
    assert torch.equal(compiled(*args[:-1]), torch_kernels.indexer_topk(*args))


# In a process of its own (torchax registers a device for the whole process).
TORCHAX_WRITE = """
import torch, torch_kernels
from torch_kernels.ops import mla
kv_c, k_pe, cache, slots = mla.mla_write_inputs(torch.Generator().manual_seed(0), torch.float32, "cpu")
int8 = cache.to(torch.int8)  # torchax does not carry float8 arrays back to torch
want, want_int8 = cache.clone(), int8.clone()
torch_kernels.mla_reshape_and_cache(kv_c, k_pe, want, slots, implementation="reference")
torch_kernels.mla_reshape_and_cache(kv_c, k_pe, want_int8, slots, torch.tensor([0.05]), implementation="reference")
env = torch_kernels.torchax_environment()
with env:
    for impl in ("pallas", "reference"):
        c, pe, s = kv_c.to("jax"), k_pe.to("jax"), slots.to("jax")
        got, got_int8 = cache.to("jax"), int8.to("jax")
        torch_kernels.mla_reshape_and_cache(c, pe, got, s, implementation=impl)
        torch_kernels.mla_reshape_and_cache(c, pe, got_int8, s, torch.tensor([0.05]).to("jax"), implementation=impl)
        assert torch.equal(got.to("cpu"), want), impl
        assert torch.equal(got_int8.to("cpu"), want_int8), impl
print("torchax ok")
"""


def test_torchax_tensors_write_the_latent_cache():
    require_backend("pallas")
    assert "torchax ok" in run_isolated(TORCHAX_WRITE)


@pytest.mark.parametrize("backend", backend_params(ops.INDEXER_OP))
def test_indexer_topk_ranks_inf_scores_first_whatever_the_head_count(backend):
    """Scores [inf, 1, inf, 2] rank [0, 2, 3, 1] with 3 indexer heads (not a multiple of 16: padded
    head lanes must add nothing, not 0 * inf = NaN)."""
    require_backend(backend)
    k_cache = torch.zeros(1, 16, 16)
    k_cache[0, :4, 0] = torch.tensor([float("inf"), 1.0, float("inf"), 2.0])
    q = torch.zeros(1, 3, 16)
    q[0, :, 0] = 1.0  # every head scores the keys' first dimension
    weights = torch.ones(1, 3)
    got = ops.indexer_topk(q, k_cache, weights, torch.tensor([0, 1], dtype=torch.int32),
                           torch.tensor([4], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 4,
                           implementation=backend)
    assert got.tolist() == [[0, 2, 3, 1]]


@pytest.mark.parametrize("backend", backend_params(ops.OP))
def test_lse_is_nan_for_a_nan_query_or_an_inf_key(backend):
    """The NaN policy for the log-sum-exp: a NaN query row or an attended inf key gives NaN (not
    -inf, which means "attended nothing"), on every backend; a row that attends nothing gives -inf."""
    require_backend(backend)
    gen = torch.Generator().manual_seed(9)
    q_nope, q_pe = torch.randn(2, 2, 16, generator=gen), torch.randn(2, 2, 8, generator=gen)
    kv_cache = torch.randn(2, 8, 24, generator=gen)
    q_nope[0, 1, 3] = float("nan")
    kv_cache[1, 0, 5] = float("inf")  # position 0 of the second sequence: a +inf logit for its query
    q_nope[1, :, 5] = 1.0
    cu_q_lens, kv_lens = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([5, 3], dtype=torch.int32)
    block_table = torch.tensor([[0], [1]], dtype=torch.int32)
    topk = torch.tensor([[0, 1], [-1, -1]], dtype=torch.int32)
    _, lse = ops.ragged_paged_mla(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, 0.25, return_lse=True,
                                  implementation=backend)
    assert torch.isnan(lse[0, 1]) and torch.isfinite(lse[0, 0]) and torch.isnan(lse[1]).all()
    _, lse = ops.ragged_paged_mla(q_nope, q_pe, kv_cache, cu_q_lens, kv_lens, block_table, 0.25, topk_indices=topk,
                                  return_lse=True, implementation=backend)
    assert torch.isnan(lse[0, 1]) and torch.isfinite(lse[0, 0]) and (lse[1] == float("-inf")).all()


@pytest.mark.parametrize("backend", backend_params(ops.OP))
def test_empty_sizes_follow_one_rule_on_every_backend(backend):
    """No head: empty results; no query or sequence: empty results; an indexer with no head ranks
    by position (every score the empty sum 0). Before: ZeroDivisionError and interpreter errors on
    some backends, results on others."""
    require_backend(backend)
    gen = torch.Generator().manual_seed(3)
    cache, k_cache = torch.randn(4, 8, 24, generator=gen), torch.randn(4, 8, 8, generator=gen)
    cu, kv = torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    out, lse = ops.ragged_paged_mla(torch.randn(3, 0, 16), torch.randn(3, 0, 8), cache, cu, kv, table, 0.2,
                                    return_lse=True, implementation=backend)
    assert out.shape == (3, 0, 16) and lse.shape == (3, 0)
    none = torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int32)
    out, lse = ops.ragged_paged_mla(torch.randn(0, 2, 16), torch.randn(0, 2, 8), cache, *none, 0.2, return_lse=True,
                                    implementation=backend)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)
    got = ops.indexer_topk(torch.randn(0, 2, 8), k_cache, torch.randn(0, 2), *none, 4, implementation=backend)
    assert got.shape == (0, 4) and got.dtype == torch.int32
    got = ops.indexer_topk(torch.randn(3, 0, 8), k_cache, torch.randn(3, 0), cu, kv, table, 4, implementation=backend)
    assert got.tolist() == [[0, 1, 2, 3]] * 3


@pytest.mark.parametrize("backend", backend_params(ops.INDEXER_OP))
def test_indexer_overflow_follows_one_rule(backend):
    """Finite inputs whose score overflows float32: positive-weight overflow ranks first, and terms
    overflowing both ways (weights +-1e30 on a 1e10 dot) give NaN, ranked last, on every backend
    (the fused multiply-adds of some backends made it +inf there, ranked first)."""
    require_backend(backend)
    k_cache = torch.zeros(1, 16, 16)
    k_cache[0, :4, 0] = torch.tensor([1.0, 1e10, 2.0, 3.0])
    q = torch.zeros(1, 2, 16)
    q[0, :, 0] = 1.0
    args = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([4], dtype=torch.int32),
            torch.zeros(1, 1, dtype=torch.int32), 4)
    both_ways = ops.indexer_topk(q, k_cache, torch.tensor([[1e30, -1e30]]), *args, implementation=backend)
    assert both_ways.tolist() == [[0, 2, 3, 1]]  # the finite scores cancel to 0: position order, NaN last
    one_way = ops.indexer_topk(q, k_cache, torch.tensor([[1e30, 1e30]]), *args, implementation=backend)
    assert one_way.tolist() == [[1, 3, 2, 0]]

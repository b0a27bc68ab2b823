"""The mla ops as transformers' DeepSeek-V3 and V3.2 attention.

First one layer: absorbed MLA written here from the DeepSeek-V3 paper's equations (section 2.1.1:
``c_KV = W_DKV h``, ``k_C = W_UK c_KV``, ``v_C = W_UV c_KV``, ``k_R = RoPE(W_KR h)``, the queries
likewise from ``c_Q``; with ``W_UK`` absorbed into the query, ``q_C^T k_C = (W_UK^T q_C)^T c_KV``,
and ``W_UV`` applied after the softmax), in float64; ``ragged_paged_mla`` over a latent cache
filled by ``mla_reshape_and_cache`` must equal it, and both must equal transformers' own
``DeepseekV3Attention`` with the same random weights. Then whole tiny random-weight models through
``kernelize``: float32 logits within 1e-4 relative of transformers' path and 32 greedy tokens
identical, on the reference and the Triton backend.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from harness import backend_params, profiled_names, require_backend
from torch_kernels.ops import mla as ops

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (the [test] extra)")
integration = pytest.importorskip("torch_kernels.integrations.transformers")

HIDDEN, HEADS, Q_RANK, LATENT, ROPE, NOPE, VALUE = 32, 4, 16, 16, 8, 8, 8
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
COMMON = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS,
              num_key_value_heads=HEADS, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
              num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
              q_lora_rank=Q_RANK, kv_lora_rank=LATENT, qk_rope_head_dim=ROPE, qk_nope_head_dim=NOPE,
              v_head_dim=VALUE, bos_token_id=None, eos_token_id=None, pad_token_id=None)
TOKENS = 32
# the Triton interpreter pays per kernel call: 6 decode steps there (still prefill, then the cached
# decode path); TORCH_KERNELS_FULL_MATRIX=1 runs all 32, as test_kernelize.py does
INTERPRETED_TOKENS = TOKENS if os.environ.get("TORCH_KERNELS_FULL_MATRIX") == "1" else 6


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


# ---- the definition: absorbed MLA from the paper ----

def _rms(x, weight, eps=1e-6):
    return x * (x.square().mean(-1, keepdim=True) + eps).rsqrt() * weight


def _rotate(x, angles, magnitude):
    """RoPE on consecutive pairs ``(x_2i, x_2i+1)``, pair ``i`` at position ``t`` turned by
    ``angles[t, i]`` (YaRN also scales the result by ``magnitude``)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = angles.cos() * magnitude, angles.sin() * magnitude
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def softmax_scale(rope_parameters) -> float:
    """``1 / sqrt(dn + R)``, times ``m^2`` with YaRN's ``m = 0.1 mscale_all_dim ln(factor) + 1``
    (DeepSeek-V3's long-context scale, applied to every dimension of the logits)."""
    m = 0.1 * rope_parameters["mscale_all_dim"] * math.log(rope_parameters["factor"]) + 1.0
    return (NOPE + ROPE) ** -0.5 * m * m


def weights_of(layer) -> dict:
    """The paper's matrices of a transformers layer, per head where the paper indexes heads, float64."""
    w = {name: p.detach().double() for name, p in layer.named_parameters()}
    q_b = w["q_b_proj.weight"].view(HEADS, NOPE + ROPE, Q_RANK)
    kv_b = w["kv_b_proj.weight"].view(HEADS, NOPE + VALUE, LATENT)
    kv_a = w["kv_a_proj_with_mqa.weight"]
    return {"W_DQ": w["q_a_proj.weight"], "q_norm": w["q_a_layernorm.weight"], "W_UQ": q_b[:, :NOPE],
            "W_QR": q_b[:, NOPE:], "W_DKV": kv_a[:LATENT], "kv_norm": w["kv_a_layernorm.weight"],
            "W_KR": kv_a[LATENT:], "W_UK": kv_b[:, :NOPE], "W_UV": kv_b[:, NOPE:], "W_O": w["o_proj.weight"]}


def absorbed_mla(h, W, angles, magnitude, scale):
    """One sequence ``h [T, d]``, causal: ``(u [T, d], the op's inputs: q_absorbed [T, H, Lr],
    q_R [T, H, R], c_KV [T, Lr], k_R [T, R])``. The released model normalizes ``c_Q`` and ``c_KV``
    (RMSNorm), which the paper's equations leave out."""
    h = h.double()
    c_q = _rms(h @ W["W_DQ"].T, W["q_norm"])
    q_c = torch.einsum("tq,hdq->thd", c_q, W["W_UQ"])
    q_r = _rotate(torch.einsum("tq,hrq->thr", c_q, W["W_QR"]), angles[:, None], magnitude)
    c_kv = _rms(h @ W["W_DKV"].T, W["kv_norm"])
    k_r = _rotate(h @ W["W_KR"].T, angles, magnitude)
    q_absorbed = torch.einsum("thd,hdl->thl", q_c, W["W_UK"])  # W_UK^T q_C: the query in the latent space
    logits = (torch.einsum("thl,sl->hts", q_absorbed, c_kv) + torch.einsum("thr,sr->hts", q_r, k_r)) * scale
    length = h.shape[0]
    logits = logits.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    o_latent = torch.einsum("hts,sl->thl", logits.softmax(-1), c_kv)
    o = torch.einsum("thl,hvl->thv", o_latent, W["W_UV"])  # W_UV after the softmax
    return o.flatten(1) @ W["W_O"].T, (q_absorbed, q_r, c_kv, k_r)


def _one_layer():
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**COMMON, max_position_embeddings=128, rope_parameters=YARN)
    config._attn_implementation = "eager"
    layer = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():  # norms away from their all-ones start, so that their weights count
        layer.q_a_layernorm.weight.uniform_(0.5, 1.5)
        layer.kv_a_layernorm.weight.uniform_(0.5, 1.5)
    rotary = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config)
    return config, layer, rotary


@pytest.mark.parametrize("backend", backend_params(ops.OP))
def test_ragged_paged_mla_is_absorbed_mla_and_transformers_attention(backend):
    """Two sequences of 9 tokens: the first a whole prompt, the second a prefill chunk of its last
    4 queries over a cache holding all 9 (a ragged batch over shuffled pages)."""
    require_backend(backend)
    config, layer, rotary = _one_layer()
    length, chunk = 9, 4
    h = torch.randn(2, length, HIDDEN, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(length)[None]
    cos, sin = rotary(h, positions)
    mask = torch.zeros(length, length).masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(),
                                                    torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        theirs = layer(h, position_embeddings=(cos, sin), attention_mask=mask)[0]
    scale = softmax_scale(YARN)
    assert scale == pytest.approx(layer.scaling, rel=1e-12)
    angles = positions[0, :, None].double() * rotary.inv_freq.double()[None]
    W = weights_of(layer)
    defined = [absorbed_mla(h[b], W, angles, rotary.attention_scaling, scale) for b in range(2)]
    assert _relative(torch.stack([u for u, _ in defined]), theirs) <= 1e-5

    # the op: every token's latent row written to shuffled pages, then the ragged batch
    block, pages = 4, torch.randperm(8, generator=torch.Generator().manual_seed(2)).to(torch.int32)
    table = pages.view(2, 4)
    cache = torch.full((8, block, LATENT + ROPE), float("nan"))  # never-written rows must stay unread
    slots = (table.long()[:, torch.arange(length) // block] * block + torch.arange(length) % block).flatten()
    c_kv = torch.cat([inputs[2] for _, inputs in defined]).float()
    k_r = torch.cat([inputs[3] for _, inputs in defined]).float()
    ops.mla_reshape_and_cache(c_kv, k_r, cache, slots, implementation=backend)
    q_absorbed = torch.cat([defined[0][1][0], defined[1][1][0][-chunk:]]).float()
    q_r = torch.cat([defined[0][1][1], defined[1][1][1][-chunk:]]).float()
    cu_q_lens = torch.tensor([0, length, length + chunk], dtype=torch.int32)
    kv_lens = torch.tensor([length, length], dtype=torch.int32)
    o_latent = ops.ragged_paged_mla(q_absorbed, q_r, cache, cu_q_lens, kv_lens, table, scale, implementation=backend)
    u = torch.einsum("thl,hvl->thv", o_latent.double(), W["W_UV"]).flatten(1) @ W["W_O"].T
    expected = torch.cat([defined[0][0], defined[1][0][-chunk:]])
    assert _relative(u, expected) <= 1e-5
    assert _relative(u, torch.cat([theirs[0], theirs[1, -chunk:]])) <= 1e-5


# ---- whole models through kernelize ----

def _deepseek_v3():
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **COMMON, max_position_embeddings=128, rope_parameters=YARN))


def _deepseek_v32():
    # index_topk 8 of up to 44 positions: most queries attend to a strict subset
    return transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(
        **COMMON, index_topk=8, index_head_dim=16, index_n_heads=4))


MODELS = {"deepseek_v3": (_deepseek_v3, "DeepseekV3Attention", {"ragged_paged_mla", "mla_reshape_and_cache"}),
          "deepseek_v32": (_deepseek_v32, "DeepseekV32Attention",
                           {"ragged_paged_mla", "mla_reshape_and_cache", "indexer_topk"})}


def _model(architecture: str):
    torch.manual_seed(0)
    return MODELS[architecture][0]().float().eval()


def _ids(batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(1))


def _ops_run(model, ids) -> tuple[set[str], torch.Tensor]:
    """The torch_kernels ops (with their backend) a no-grad forward of ``model`` runs, and its logits."""
    logits = []
    with torch.no_grad():
        names = profiled_names(lambda: logits.append(model(ids).logits))
    return {n.split("::")[1] for n in names if n.startswith("torch_kernels::")}, logits[0]


# whole models: both on the reference, V3 on Triton and SYCL too. Interpreted, V3.2's indexer costs
# about 40 s of decode steps here (its kernels equal the reference's indices exactly in test_mla.py),
# and Pallas's interpret mode compiles each decode step's new shapes anew: the one-layer test above
# holds every backend to transformers' attention
MODEL_BACKENDS = [pytest.param(b, a, id=f"{b}-{a}") for b in ("reference", "triton", "sycl") for a in MODELS
                  if b == "reference" or a == "deepseek_v3"]


@pytest.mark.parametrize("backend, architecture", MODEL_BACKENDS)
def test_kernelized_deepseek_matches_transformers(backend, architecture):
    """Logits and 32 greedy tokens (prefill, then decode over transformers' cache; 6 interpreted) of a 2-layer
    random model (one MoE layer), kernelized vs transformers' own path, float32. The interpreted runs
    keep transformers' experts (the fused-MoE drop-in is test_moe_transformers.py's); every MLA op,
    the indexer's too, runs on the backend asked for."""
    require_backend(backend)
    interpreted = backend != "reference"
    model, ids = _model(architecture), _ids()
    new_tokens = INTERPRETED_TOKENS if interpreted else TOKENS
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    layer, used = MODELS[architecture][1:]
    implementation = f"{backend},reference" if interpreted else backend
    with integration.kernelize(model, implementation, experts=not interpreted) as report:
        assert report.where[layer] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        ran, out = _ops_run(model, ids)
        error = _relative(out, logits)
        same = torch.equal(model.generate(ids, max_new_tokens=new_tokens, do_sample=False), tokens)
    assert {f"{op}[{backend}]" for op in used} <= ran, ran
    assert error <= 1e-4, f"{architecture} on {backend}: logits relative error {error:.2e}"
    assert same, f"{architecture} on {backend}: greedy tokens differ"
    assert type(model.model.layers[0].self_attn).__module__.startswith("transformers.")


def test_padding_starts_reads_causal_and_left_padded_masks_only():
    """The latent path runs under masks that say causality, with rows left-padded and every query
    real (a padded batch's decode steps): it returns where each row's real positions start; None
    for anything else."""
    starts = ops.padding_starts
    seen = torch.ones(3, 5, dtype=torch.bool).tril(2)[None, None].expand(2, 1, 3, 5)
    additive = torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)
    for mask in (None, seen, additive, additive.masked_fill(~seen, float("-inf")), seen[:1]):
        assert starts(mask, 2, 3).tolist() == [0, 0]
    padded = seen.clone()
    padded[1, :, :, :2] = False  # row 1's first two positions are padding; its queries (2, 3, 4) are real
    assert starts(padded, 2, 3).tolist() == [0, 2]
    assert starts(additive.masked_fill(~padded, -torch.inf), 2, 3).tolist() == [0, 2]
    padded[1, :, :, 2] = False  # now query 2 of row 1 is padding too
    assert starts(padded, 2, 3) is None
    holed = seen.clone()
    holed[0, :, :, 1] = False  # a hidden position that is not a prefix
    assert starts(holed, 2, 3) is None
    assert starts(additive - 0.5, 2, 3) is None  # a bias is not a mask
    assert starts(torch.ones(2, 1, 3, 5, dtype=torch.bool), 2, 3) is None  # bidirectional
    assert starts(seen, 2, 2) is None  # not this call's queries


def _grad(p) -> torch.Tensor:
    return p.grad.clone() if p.grad is not None else torch.zeros_like(p)


def test_kernelize_mla_layers_only_this_instance_and_exact_elsewhere(monkeypatch):
    """Only this model's layers change class, and back on undo; a left-padded batch decodes on the
    ops with transformers' tokens; calls the ops do not describe run the layer's own forward,
    exactly: the padded batch's prefill (padded queries), a training step (the ops have no
    backward). A layer whose weights cannot be absorbed and a backend without the indexer's kernel
    are reported, not replaced."""
    model, other, ids = _model("deepseek_v32"), _model("deepseek_v32"), _ids(length=8)
    other.model.layers[1].self_attn.kv_b_proj.__class__ = type("QuantizedLinear", (torch.nn.Linear,), {})
    with integration.kernelize(other, experts=False) as report:  # a weight that cannot be absorbed
        assert report.where["DeepseekV32Attention"] == ["model.layers.0.self_attn"]
        assert "model.layers.1.self_attn: kv_b_proj is a QuantizedLinear" in \
            dict(report.not_replaced)["DeepseekV32Attention"]
    padding = torch.ones_like(ids)
    padding[1, :3] = 0
    with torch.no_grad():
        padded = model(ids, attention_mask=padding).logits
    padded_tokens = model.generate(ids, attention_mask=padding, max_new_tokens=8, do_sample=False)
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    grads = [_grad(p) for p in model.parameters()]
    originals = [type(m) for m in model.modules()]

    report = integration.kernelize(model)
    assert "DeepseekV32Attention" in report.replaced
    attend = ops.ragged_paged_mla
    assert _ops_run(other, ids)[0] == set()
    assert {"ragged_paged_mla[reference]", "indexer_topk[reference]"} <= _ops_run(model, ids)[0]
    with torch.no_grad():  # padded queries: the layer's own forward
        assert _relative(model(ids, attention_mask=padding).logits, padded) <= 1e-6
    calls = []  # counted, not profiled: the profiler over generate costs seconds
    monkeypatch.setattr(ops, "ragged_paged_mla", lambda *a, **k: calls.append(k) or attend(*a, **k))
    tokens = model.generate(ids, attention_mask=padding, max_new_tokens=8, do_sample=False)
    monkeypatch.undo()
    assert torch.equal(tokens, padded_tokens), "a left-padded batch's greedy tokens differ"
    assert len(calls) == 2 * 7  # decoding on the ops (2 layers, 7 steps), the padded prefill not
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    assert max(_relative(_grad(p), g) for p, g in zip(model.parameters(), grads) if g.any()) <= 1e-5
    assert [bool(_grad(p).any()) for p in model.parameters()] == [bool(g.any()) for g in grads]
    report.undo()
    assert [type(m) for m in model.modules()] == originals
    assert _ops_run(model, ids)[0] == set()

    # a backend without the indexer keeps V3.2's layer and says why (every backend has it now: one hidden)
    monkeypatch.setattr(integration.backends, "implementations",
                        lambda op, real=integration.backends.implementations: [
                            b for b in real(op) if not (op == ops.INDEXER_OP and b == "reference")])
    with integration.kernelize(model, "reference", experts=False) as partial:
        assert "DeepseekV32Attention" not in partial.replaced
        assert "indexer_topk: no reference kernel" in dict(partial.not_replaced)["DeepseekV32Attention"]
    monkeypatch.undo()

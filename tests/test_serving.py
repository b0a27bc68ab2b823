"""The paged-KV serving loop (torch_kernels.serving) equals transformers' own greedy ``generate``
token for token: on a real LLM (SmolLM2-135M-Instruct, float32) with continuous batching and
chunked prefill on the reference backend, on every other backend for one short prompt, on tiny
random Mistral (sliding window) and Qwen2 (q/k/v biases) models, and on a tiny random DeepSeek-V3
(MLA over a paged latent cache, one MoE layer), chunked, on the reference, Triton and SYCL backends.

Exact equality is a stable test here: along these generations the closest gap between the top
two logits is 0.08 (SmolLM2), 0.008 (the tiny Llama-architecture models) and 0.0015 (DeepSeek-V3,
logits up to 0.6), far above float32 rounding."""

from __future__ import annotations

import os

import pytest
import torch

import torch_kernels
from torch_kernels import models
from torch_kernels.serving import Engine, PagedDeepseekV3, PagedDeepseekV32, PagedLatentCache

from harness import backend_params, require_backend, tiny_llama

OP = "ragged_paged_attention"
QUESTIONS = [  # chat-templated prompts of 32 to 91 tokens
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue, and then list three colours that appear at sunset, "
    "with a short note on each of them. Please be concise but friendly, and mention Rayleigh scattering "
    "by name. Also say what happens on Mars, where the sunsets are famously blue rather than red.",
    "Hi!",
    "Name three prime numbers.",
]
MAX_NEW_TOKENS = [24, 12, 30, 8, 16]
SHORT_PROMPT, SHORT_NEW_TOKENS = "The capital of France is", 4  # the interpreted backends are slow


@torch.inference_mode()
def _generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def chat_prompts(smollm2):
    model, tokenizer = smollm2
    prompts = [models.chat_prompt(tokenizer, q) for q in QUESTIONS]
    return prompts, [_generate(model, p, m) for p, m in zip(prompts, MAX_NEW_TOKENS)]


@pytest.mark.parametrize("fused_write", [True, False], ids=["fused-write", "reshape_and_cache"])
def test_continuous_batching_matches_generate(smollm2, chat_prompts, fused_write):
    model, tokenizer = smollm2
    prompts, expected = chat_prompts
    # 16 blocks of 16 tokens hold at most 4 of the requests at once (they need 23 blocks in all),
    # and 40 tokens a step split the 91-token prompt over three steps
    engine = Engine(model, num_blocks=16, block_size=16, max_batched_tokens=40, max_seqs=4,
                    implementation="reference", fused_write=fused_write)
    requests = [engine.add_request(p, m) for p, m in zip(prompts, MAX_NEW_TOKENS)]
    order = []
    while engine.waiting or engine.running:
        order += [r.id for r in engine.step()]

    for r, want in zip(requests, expected):
        assert r.output == want, f"prompt {r.id}: {tokenizer.decode(r.output)!r} != generate's {tokenizer.decode(want)!r}"
    assert any(s.prefill_tokens and s.decode_tokens for s in engine.stats), "no step mixed prefill and decode"
    assert max(map(len, prompts)) > 2 * 40, "no prompt was long enough to be chunked"
    blocks_used = [b for r in requests for b in r.blocks]
    assert len(blocks_used) > len(set(blocks_used)), "no block was reused by a later request"
    assert sorted(engine.cache.free) == list(range(16)), "blocks leaked"
    eos = model.generation_config.eos_token_id
    assert any(r.output[-1] == eos for r in requests), "no request ended on eos"
    assert any(len(r.output) == r.max_new_tokens for r in requests), "no request ended on max_new_tokens"
    assert order != sorted(order), "requests finished in arrival order"


def test_rejects_a_request_the_cache_cannot_hold(smollm2):
    engine = Engine(smollm2[0], num_blocks=2, block_size=16, implementation="reference")
    with pytest.raises(ValueError, match="need 3 blocks"):
        engine.add_request(list(range(30)), max_new_tokens=4)
    for name in ("max_seqs", "max_batched_tokens"):
        with pytest.raises(ValueError, match=f"^{name}: expected an int >= 1"):
            Engine(smollm2[0], num_blocks=2, **{name: 0})


@pytest.mark.parametrize("backend", backend_params(OP, exclude=("reference",)))
def test_backend_matches_generate(smollm2, backend):
    require_backend(backend)
    model, tokenizer = smollm2
    prompt = tokenizer.encode(SHORT_PROMPT)
    engine = Engine(model, num_blocks=4, block_size=16, max_batched_tokens=16, implementation=backend)
    assert engine.generate([prompt], SHORT_NEW_TOKENS) == [_generate(model, prompt, SHORT_NEW_TOKENS)]


@pytest.mark.parametrize("architecture", ["mistral", "qwen2", "qwen2-window-in-layer-1"])
def test_other_llama_architectures_match_generate(architecture):
    import transformers  # a test dependency: its absence is a failure, not a skip
    config_class, model_class, extra = {
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=7)),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(sliding_window=None)),  # q/k/v biases
        # a window in the second layer only: each layer's kind comes from config.layer_types
        "qwen2-window-in-layer-1": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                                    dict(sliding_window=7, use_sliding_window=True, max_window_layers=1)),
    }[architecture]
    config = config_class(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                          bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)
    torch.manual_seed(0)  # wide weights, so that the top logits lie well apart
    model = model_class(config).eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 19, 30)]
    engine = Engine(model, num_blocks=16, block_size=4, max_batched_tokens=10, max_seqs=2, implementation="reference")
    assert engine.generate(prompts, 12) == [_generate(model, p, 12) for p in prompts]


@pytest.mark.parametrize("prompt, max_new_tokens, error, match", [
    ([5, 97], 3, ValueError, r"prompts\[1\]: expected token ids in \[0, 97\) .*got 97 at index 1"),
    ([5, -1], 3, ValueError, r"prompts\[1\]: expected token ids in \[0, 97\)"),
    ([5, 2.0], 3, TypeError, r"prompts\[1\]: expected int token ids, got float 2.0 at index 1"),
    ("text", 3, TypeError, r"prompts\[1\]: expected a sequence of token ids"),
    ([], 3, ValueError, r"prompts\[1\]: expected at least one token"),
    (torch.tensor([1.0, 2.0]), 3, TypeError, r"prompts\[1\]: expected a 1-D integer tensor"),
    ([5, 6], 2.5, TypeError, r"max_new_tokens: expected an int, got float"),
    ([5, 6], 0, ValueError, r"max_new_tokens: expected an int >= 1"),
    (list(range(40)), 30, ValueError, r"prompts\[1\]: 40 tokens plus max_new_tokens=30 need 18 blocks"),
])
def test_a_bad_request_is_rejected_and_the_engine_stays_usable(prompt, max_new_tokens, error, match):
    """A bad request fails before any request of the call is queued or takes a block; the next
    call on the same engine serves as if nothing had happened."""
    model = tiny_llama()
    engine = Engine(model, num_blocks=16, block_size=4, max_batched_tokens=8, implementation="reference")
    with pytest.raises(error, match=match):
        engine.generate([[1, 2, 3], prompt], [3, max_new_tokens])
    assert not engine.waiting and not engine.running and sorted(engine.cache.free) == list(range(16))
    good = [[1, 2, 3], [4, 5]]
    assert engine.generate(good, 3) == [_generate(model, p, 3) for p in good]
    assert sorted(engine.cache.free) == list(range(16))


def test_bad_engine_arguments_name_them():
    model = tiny_llama()
    for name, value, error in [("block_size", 0, ValueError), ("block_size", -4, ValueError),
                               ("num_blocks", 0, ValueError), ("block_size", 2.5, TypeError),
                               ("max_seqs", True, TypeError)]:
        with pytest.raises(error, match=f"^{name}: expected an int"):
            Engine(model, **{name: value})
    engine = Engine(model, num_blocks=4, block_size=4)
    for prompts in ("text", torch.tensor([[1, 2]]), 7):
        with pytest.raises(TypeError, match="^prompts: expected a list of prompts"):
            engine.generate(prompts, 2)
    with pytest.raises(ValueError, match=r"^max_new_tokens: expected one limit per prompt \(2\), got 1"):
        engine.generate([[1], [2]], [3])


def test_a_failure_mid_step_releases_the_blocks(monkeypatch):
    """A step that raises (here the model, on its third call) aborts the sequences it ran, returns
    their blocks, and the engine then serves the next call normally."""
    model = tiny_llama()
    engine = Engine(model, num_blocks=16, block_size=4, max_batched_tokens=6, max_seqs=2, implementation="reference")
    run = engine.runner.forward
    calls = iter(range(100))

    def failing(*args, **kwargs):
        if next(calls) == 2:
            raise RuntimeError("device lost")
        return run(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", failing)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    with pytest.raises(RuntimeError, match="device lost"):
        engine.generate(prompts, 4)
    assert not engine.waiting and not engine.running
    assert sorted(engine.cache.free) == list(range(16)), "blocks leaked"
    assert engine.generate(prompts, 4) == [_generate(model, p, 4) for p in prompts]


MLA_OP, MLA_TOKENS = "ragged_paged_mla", 32
MLA_INTERPRETED_TOKENS = 6  # the Triton interpreter and the SYCL backend pay per kernel call


def _tiny_deepseek(config_class: str, **extra):
    """A 2-layer random DeepSeek model (layer 1 MoE), float32; prompts of 5 to 40 tokens and
    transformers' own greedy continuations of them (one left-padded batch: a quarter of the time
    of four calls, and the same tokens as each prompt alone)."""
    import transformers  # a test dependency: its absence is a failure, not a skip
    config = getattr(transformers, config_class)(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 23, 11, 40)]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=MLA_TOKENS, do_sample=False, pad_token_id=0)
    return model, prompts, out[:, width:].tolist()


@pytest.fixture(scope="module")
def tiny_deepseek_v3():
    return _tiny_deepseek("DeepseekV3Config")


@pytest.mark.parametrize("backend", backend_params(MLA_OP, skip={
    "pallas": "each step's new ragged shapes recompile its kernels (about 18 s for this run); test_mla_models.py "
              "holds pallas to transformers' DeepSeek-V3 through kernelize"}))
def test_deepseek_v3_matches_generate(tiny_deepseek_v3, backend):
    """Four prompts served together, 16 tokens a step (the 40-token prompt over three steps, beside
    decodes), greedy tokens identical to transformers' eager ``generate``: 32 on the reference, the
    first 6 on the interpreted backends."""
    require_backend(backend)
    model, prompts, expected = tiny_deepseek_v3
    new_tokens = MLA_TOKENS if backend == "reference" else MLA_INTERPRETED_TOKENS
    engine = Engine(model, num_blocks=24, block_size=8, max_batched_tokens=16, max_seqs=4, implementation=backend)
    assert isinstance(engine.runner, PagedDeepseekV3) and isinstance(engine.cache, PagedLatentCache)
    assert engine.cache.latent[0].shape == (24, 8, 32 + 16)
    assert engine.generate(prompts, new_tokens) == [want[:new_tokens] for want in expected]
    assert any(s.prefill_tokens and s.decode_tokens for s in engine.stats), "no step mixed prefill and decode"
    assert sum(s.prefill_tokens > 0 for s in engine.stats) >= 3, "no prompt was chunked"
    assert sorted(engine.cache.free) == list(range(24)), "blocks leaked"


# the indexer selects 8 of up to 72 positions: most queries attend to a strict subset. Triton is
# left out here: its interpreted indexer takes 18 s for these steps (test_mla.py holds its indices
# equal to the reference's)
@pytest.mark.parametrize("backend", ["reference", "sycl"])
def test_deepseek_v32_matches_generate(backend):
    """DeepSeek-V3.2 served as V3 is (the same prompts and step budget): each layer's indexer keys
    in the cache's blocks, its top-k through ``indexer_topk``, sparse latent attention; greedy
    tokens identical to transformers' eager ``generate`` (32 on the reference, 6 on SYCL)."""
    require_backend(backend)
    model, prompts, expected = _tiny_deepseek("DeepseekV32Config", index_topk=8, index_head_dim=32, index_n_heads=4)
    new_tokens = MLA_TOKENS if backend == "reference" else MLA_INTERPRETED_TOKENS
    engine = Engine(model, num_blocks=24, block_size=8, max_batched_tokens=16, max_seqs=4, implementation=backend)
    assert isinstance(engine.runner, PagedDeepseekV32)
    assert engine.cache.index_keys[1].shape == (24, 8, 32)
    assert engine.generate(prompts, new_tokens) == [want[:new_tokens] for want in expected]
    assert sorted(engine.cache.free) == list(range(24)), "blocks leaked"
    # the selection matters: served densely (V3's runner on the same weights), the tokens differ
    dense = Engine(model, num_blocks=24, block_size=8, max_batched_tokens=16, max_seqs=4, implementation=backend)
    dense.runner = PagedDeepseekV3(model, backend)
    dense.runner.rotate = engine.runner.rotate
    assert dense.generate(prompts, new_tokens) != [want[:new_tokens] for want in expected]


@torch.inference_mode()
def test_deepseek_v3_runner_hidden_states_match_transformers(tiny_deepseek_v3):
    """The OOD gate's capture: every layer's hidden states of a two-sequence ragged batch equal
    transformers' ``output_hidden_states`` of each sequence alone (float32 rounding apart)."""
    model, prompts, _ = tiny_deepseek_v3
    engine = Engine(model, num_blocks=24, block_size=8, implementation="reference")
    seqs, blocks = prompts[:2], [list(range(0, 3)), list(range(3, 6))]
    ids = torch.tensor(seqs[0] + seqs[1])
    positions = torch.tensor([*range(len(seqs[0])), *range(len(seqs[1]))])
    slots = torch.tensor([b[p // 8] * 8 + p % 8 for s, b in zip(seqs, blocks) for p in range(len(s))])
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int32)
    cu = torch.tensor([0, *lens.cumsum(0).tolist()], dtype=torch.int32)
    layers = (0, 1, 2)
    logits, hidden = engine.runner(engine.cache, ids, positions, cu, lens, torch.tensor(blocks, dtype=torch.int32),
                                   slots, cu[1:].long() - 1, hidden_layer=layers)
    for j, s in enumerate(seqs):
        out = model(torch.tensor([s]), output_hidden_states=True)
        rows = slice(int(cu[j]), int(cu[j + 1]))
        for k, layer in enumerate(layers):
            want = out.hidden_states[layer][0]
            assert (hidden[k, rows] - want).abs().max() <= 1e-4 * want.abs().max(), f"sequence {j}, layer {layer}"
        assert (logits[j] - out.logits[0, -1]).abs().max() <= 1e-4 * out.logits[0, -1].abs().max()


@pytest.mark.parametrize("layer", [0, 1])
def test_deepseek_v3_with_weights_that_cannot_be_absorbed_is_refused(tiny_deepseek_v3, layer):
    import copy
    model = copy.deepcopy(tiny_deepseek_v3[0])
    attn = model.model.layers[layer].self_attn
    attn.kv_b_proj = torch.nn.Linear(attn.kv_b_proj.in_features, attn.kv_b_proj.out_features, bias=True)
    with pytest.raises(TypeError, match="^model: its MLA weights cannot be absorbed: kv_b_proj is a Linear"):
        Engine(model, num_blocks=4, block_size=8)


# ---- the hot path: deferred checks, vectorised metadata, captured decode steps ----

CUDA_TEST = os.environ.get("TORCH_KERNELS_TEST_DEVICE") == "cuda"


@pytest.mark.parametrize("architecture", ["llama", "deepseek_v32"])
def test_cuda_graph_path_equals_generate_uncaptured_on_cpu(architecture):
    """``cuda_graphs=True`` on the CPU runs the captured path's code uncaptured: decode-only steps
    as batches padded to a power of two from persistent buffers, the padding rows in reserved
    blocks; in deferred check mode (no host read in the ops) the tokens equal ``generate``'s and
    the reserved blocks are never handed out."""
    if architecture == "llama":
        model = tiny_llama()
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 9, 3)]
        expected, new_tokens = [_generate(model, p, 7) for p in prompts], [7, 4, 6]
        expected = [want[:n] for want, n in zip(expected, new_tokens)]
        num_blocks, block_size = 16, 4
    else:  # the indexer's keys are written by index_copy_: a padding row must have a slot of its own
        model, prompts, expected = _tiny_deepseek("DeepseekV32Config", index_topk=8, index_head_dim=32,
                                                  index_n_heads=4)
        prompts, expected, new_tokens = prompts[:3], [want[:5] for want in expected[:3]], 5
        num_blocks, block_size = 24, 8
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size, max_batched_tokens=16, max_seqs=4,
                    implementation="reference", cuda_graphs=True)
    with torch_kernels.checks("deferred"):
        assert engine.generate(prompts, new_tokens) == expected
    torch_kernels.raise_deferred_errors()
    # three sequences decode as four rows (one padding), and as fewer once some finish
    assert 4 in engine._decode_buffers and len(engine._decode_buffers) >= 2
    assert sorted(engine.cache.free) == list(range(num_blocks)) and engine.cache.reserved == [num_blocks]


def test_a_deferred_error_fails_the_step_at_its_read():
    """In deferred mode a bad block id (here written into a running request's table row, as an
    engine bug would) raises the ops' ValueError at the step's one read; its sequences are aborted
    and the engine serves the next call."""
    model = tiny_llama()
    engine = Engine(model, num_blocks=16, block_size=4, max_batched_tokens=8, implementation="reference")
    engine.add_request([1, 2, 3], 4)
    with torch_kernels.checks("deferred"):
        engine.step()
        engine.block_table[engine.running[0].table_row, 0] = 1000
        # the slots the engine derives from that row fail too: the error names either (the word
        # keeps counts per message, not which failed first), and counts the other
        with pytest.raises(ValueError, match=r"^(block_table: expected block ids in \[0, 16\)|slot_mapping: expected "
                                             r"-1 \(padding\) or a slot in \[0, 64\)) .*deferred check\) "
                                             r"\(and 1 other failed check\)$"):
            engine.step()
    assert not engine.running and sorted(engine.cache.free) == list(range(16))
    assert engine.generate([[4, 5]], 3) == [_generate(model, [4, 5], 3)]


@pytest.mark.skipif(not CUDA_TEST, reason="captures CUDA graphs: set TORCH_KERNELS_TEST_DEVICE=cuda on a GPU machine")
def test_captured_decode_replays_as_eager_with_no_sync():
    """On a GPU: the ops make no host sync in the captured steps' eager warm-up (sync debug mode
    "error"), and the replayed graph gives the eager engine's tokens as lengths and block tables
    change between replays."""
    model = tiny_llama().cuda()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 9, 3, 12)]
    eager = Engine(model, num_blocks=32, block_size=4, max_batched_tokens=16, max_seqs=4)
    captured = Engine(model, num_blocks=32, block_size=4, max_batched_tokens=16, max_seqs=4, cuda_graphs=True)
    run = captured._decode_forward

    def no_sync(size):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return run(size)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    captured._decode_forward = no_sync
    assert captured.generate(prompts, [9, 6, 12, 3]) == eager.generate(prompts, [9, 6, 12, 3])
    assert captured._graphs, "no decode step was captured"

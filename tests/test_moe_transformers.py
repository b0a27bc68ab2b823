"""``experts_implementation="torch_kernels"`` in real transformers architectures (small random
configs of Qwen3-MoE, Mixtral, DeepSeek-V3 with its grouped sigmoid router and shared experts, and
OLMoE): logits and every parameter's gradient equal the model's own eager experts, on every backend,
and greedy decoding gives the same tokens. gpt-oss's experts (biases, a clamped gate of its own)
are not what fused_moe computes: they keep transformers' path, and still give the same numbers."""

from __future__ import annotations

import pytest
import torch

from harness import backend_params, require_backend
from torch_kernels import backends, use_backend

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (the [test] extra)")
integration = pytest.importorskip("torch_kernels.integrations.transformers")

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
ARCHITECTURES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=48, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, head_dim=8)),
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, intermediate_size=40, num_local_experts=6, num_experts_per_tok=2)),
    "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5)),
    "olmoe": lambda: transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **COMMON, intermediate_size=24, num_experts=8, num_experts_per_tok=3)),
}


def _model(architecture: str):
    torch.manual_seed(0)
    model = ARCHITECTURES[architecture]().float().eval()
    for p in model.parameters():  # wide weights: the routers' choices lie well apart
        p.data.mul_(3.0)
    return model


def _logits_and_grads(model, ids, implementation: str):
    model.set_experts_implementation(implementation)
    model.zero_grad()
    logits = model(ids).logits
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# interpreted Pallas compiles every call: there, one architecture per router kind (softmax top-k,
# DeepSeek's grouped sigmoid); every architecture on the other backends
PALLAS_ARCHITECTURES = ("qwen3_moe", "deepseek_v3")


@pytest.mark.parametrize("backend, architecture", [
    pytest.param(b, a, id=f"{b}-{a}") for b in (p.values[0] for p in backend_params("fused_moe"))
    for a in ARCHITECTURES if b != "pallas" or a in PALLAS_ARCHITECTURES])
def test_logits_and_gradients_equal_eager(backend, architecture):
    require_backend(backend)
    model = _model(architecture)
    assert any(integration.supports(m) for m in model.modules() if hasattr(m, "gate_up_proj"))
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    want_logits, want_grads = _logits_and_grads(model, ids, "eager")
    with use_backend(backend):
        logits, grads = _logits_and_grads(model, ids, "torch_kernels")
    assert backends.last_backend("fused_moe") == backend
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("architecture", ["qwen3_moe", "deepseek_v3"])
def test_greedy_tokens_equal_eager(architecture):
    model = _model(architecture)
    prompt = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    outputs = {}
    for implementation in ("eager", "torch_kernels"):
        model.set_experts_implementation(implementation)
        with torch.no_grad():
            outputs[implementation] = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                                     max_new_tokens=6, do_sample=False)
    assert torch.equal(outputs["torch_kernels"], outputs["eager"])


def test_gpt_oss_experts_keep_their_own_path():
    config = transformers.GptOssConfig(**COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                       head_dim=8, layer_types=["full_attention"] * 2)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).float().eval()
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj")]
    assert experts and not any(integration.supports(m) for m in experts)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        want = model(ids).logits
        model.set_experts_implementation("torch_kernels")
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-4, atol=1e-5)


def test_bfloat16_experts_as_accurate_as_transformers_own():
    """Qwen3-MoE's experts in bfloat16 on fixed routing, both against the same experts in float64:
    fused_moe on the CPU default (the reference) is no less accurate than transformers' eager
    experts (the gate its 16-bit GEMMs are held to, rather than an absolute bound the peer misses)."""
    import copy

    import torch_kernels

    config = transformers.Qwen3MoeConfig(**{**COMMON, "hidden_size": 256}, intermediate_size=384,
                                         moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4, head_dim=64)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=gen).bfloat16()
    weights, ids = torch_kernels.router_topk(torch.randn(64, 16, generator=gen), 4)

    def experts(dtype, implementation):
        copied = copy.deepcopy(model).to(dtype)
        copied.set_experts_implementation(implementation)
        with torch.no_grad(), use_backend("reference"):
            return copied.model.layers[0].mlp.experts(x.to(dtype), ids.long(), weights.to(dtype)).double()

    truth = experts(torch.float64, "eager")
    errors = {name: ((experts(torch.bfloat16, name) - truth).norm() / truth.norm()).item()
              for name in ("eager", "torch_kernels")}
    assert errors["torch_kernels"] <= errors["eager"], errors

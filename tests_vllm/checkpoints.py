"""Hugging Face checkpoints for the vLLM tests and benchmark, made once and cached.

vLLM cannot read the packaged SmolLM2 GGUF file, so :func:`smollm2_hf` is the plain float32 Llama
folder ``torch_kernels.models`` keeps of it; :func:`tiny_moe`
saves a small random-weight Qwen3-MoE and :func:`tiny_deepseek_v3` a small random-weight DeepSeek-V3
(multi-head latent attention), both with SmolLM2's tokenizer. All live beside the GGUF file in
``$TORCH_KERNELS_CACHE/models`` (default ``~/.cache/torch_kernels/models``), outside the work
tree, and are written to a temporary folder first, so a reader never sees half a checkpoint.
"""

from __future__ import annotations

import pathlib

from torch_kernels import models

TINY_MOE_DIR = "tiny-qwen3-moe-random"
TINY_DEEPSEEK_V3_DIR = "tiny-deepseek-v3-random"


def smollm2_hf() -> pathlib.Path:
    """SmolLM2-135M-Instruct as a float32 Hugging Face folder (about 540 MB; made once, by
    whichever of the test runs loads it first: ``torch_kernels.models.hf_folder``)."""
    return models.hf_folder()


def tiny_moe() -> pathlib.Path:
    """A 2-layer Qwen3-MoE (8 experts, top 2, hidden 64, head size 32) with fixed random weights
    and SmolLM2's tokenizer. Its weights are scaled up so that greedy choices are not near-ties."""
    tokenizer_dir = smollm2_hf()

    def make(folder: pathlib.Path) -> None:
        import torch
        from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config = Qwen3MoeConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            max_position_embeddings=2048, initializer_range=0.15, tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, torch_dtype="float32")
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(config).eval()
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return models.cached_folder(TINY_MOE_DIR, make)


def tiny_deepseek_v3() -> pathlib.Path:
    """A 2-layer DeepSeek-V3 (a dense layer, then a MoE layer of 8 routed experts in 2 groups, top 2,
    and a shared expert; hidden 64, 4 heads) with fixed random float32 weights and SmolLM2's
    tokenizer. Its latent cache row is DeepSeek-V3's own (``kv_lora_rank`` 512 + ``qk_rope_head_dim``
    64), the only size vLLM's CPU MLA decode kernel takes. Weights are scaled up so that greedy
    choices are not near-ties."""
    tokenizer_dir = smollm2_hf()

    def make(folder: pathlib.Path) -> None:
        import torch
        from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config = DeepseekV3Config(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
            q_lora_rank=48, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
            routed_scaling_factor=1.0, max_position_embeddings=2048, initializer_range=0.15,
            # transformers always routes as DeepSeek-V3 does; vLLM reads how from these (as in its config.json)
            topk_method="noaux_tc", scoring_func="sigmoid",
            tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            torch_dtype="float32")
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(config).eval()
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return models.cached_folder(TINY_DEEPSEEK_V3_DIR, make)

"""Whole models, kernelized against not: one transformers model forward and a greedy decode, timed
with ``torch_kernels.integrations.transformers.kernelize(model)`` and without, on the same weights.

    python benchmarks/kernelize.py [--quick | --gpu] [--device cpu|cuda] [--budget S] [--out DIR]

Small random-weight models built from transformers' own config classes, one per hybrid or
compressed-attention family kernelize covers (Qwen3-Next: Gated DeltaNet; Kimi Linear: KDA and
MLA; Mamba-2; Granite-4 hybrid: Mamba-2 and experts; LFM2: the short convolution; DeepSeek-V3:
MLA and experts), at head sizes of the real models (128 for linear attention, 64 for Mamba-2
heads, Lr 512 + R 64 for MLA) with few layers and a small hidden size, so a CPU run stays short.
Per model: the prefill forward of ``--tokens`` tokens (batch 1) and a greedy ``generate`` of
``--new`` tokens after it (the decode path with the model's caches), each timed kernelized and
not, in one run; speed-up = transformers' time / kernelized time (> 1: kernelizing pays), with the
largest relative difference of the prefill logits and whether the generated tokens are identical.
The backend is each op's device default (the reference on CPU, triton on CUDA); one torch thread
on the CPU. Writes
``kernelize{-quick,-gpu,}.{md,json,png}`` to ``--out`` (default ``benchmarks/results``).
"""

from __future__ import annotations

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import cuda_missing, family_parser, machine_line, markdown_table, seconds_per_call, write_results  # noqa: E402

COMMON = dict(vocab_size=1024, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def models(hidden: int, layers: int) -> dict:
    """``{name: build()}``: each a random-weight causal LM of ``layers`` layers (two kinds alternating)."""
    import transformers

    both = lambda a, b: [a, b] * (layers // 2)  # noqa: E731 - each hybrid's two layer kinds, in turn
    base = dict(COMMON, hidden_size=hidden, num_hidden_layers=layers)
    return {
        "qwen3_next": lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
            **base, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=2 * hidden,
            moe_intermediate_size=hidden // 2, num_experts=8, num_experts_per_tok=2,
            shared_expert_intermediate_size=hidden // 2, linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            layer_types=both("linear_attention", "full_attention"))),
        "kimi_linear": lambda: transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(
            **base, num_attention_heads=4, num_key_value_heads=4, intermediate_size=2 * hidden,
            moe_intermediate_size=hidden // 2, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
            first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128, linear_attn_config={"kda_layers": list(range(1, layers + 1, 2)),
                                                "full_attn_layers": list(range(2, layers + 1, 2)),
                                                "num_heads": 4, "head_dim": 128, "short_conv_kernel_size": 4})),
        "mamba2": lambda: transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
            **base, num_heads=2 * hidden // 64, head_dim=64, state_size=128, n_groups=1, expand=2, conv_kernel=4,
            chunk_size=64)),
        "granitemoehybrid": lambda: transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(
            **base, num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * hidden, num_local_experts=8,
            num_experts_per_tok=2, shared_intermediate_size=hidden, layer_types=both("mamba", "attention"),
            mamba_n_heads=2 * hidden // 64, mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_expand=2,
            mamba_d_conv=4, mamba_chunk_size=64)),
        "lfm2": lambda: transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
            **base, num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * hidden,
            layer_types=both("conv", "full_attention"))),
        "deepseek_v3": lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
            **base, num_attention_heads=4, num_key_value_heads=4, intermediate_size=2 * hidden,
            moe_intermediate_size=hidden // 2, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
            n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)),
    }


def measure(name: str, build, device: str, tokens: int, new: int, budget: float, sync) -> dict:
    from torch_kernels.integrations.transformers import kernelize

    torch.manual_seed(0)
    model = build().float().eval().to(device)
    ids = torch.randint(0, COMMON["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(1)).to(device)
    greedy = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    def forward():
        return model(ids).logits

    def generate():
        return model.generate(ids, **greedy)

    row = {"model": name, "tokens": tokens, "new_tokens": new}
    with torch.inference_mode():
        plain_logits, plain_tokens = forward(), generate()
        row["transformers_forward_s"] = seconds_per_call(forward, budget, sync)
        row["transformers_generate_s"] = seconds_per_call(generate, budget, sync)
        with kernelize(model) as report:
            logits, out = forward(), generate()
            row["kernelized_forward_s"] = seconds_per_call(forward, budget, sync)
            row["kernelized_generate_s"] = seconds_per_call(generate, budget, sync)
    row["replaced"] = list(report.replaced)
    row["not_replaced"] = [[name, why] for name, why in report.not_replaced]
    row["logits_max_rel_diff"] = float((logits - plain_logits).abs().max() / plain_logits.abs().max())
    row["tokens_identical"] = bool(torch.equal(out, plain_tokens))
    for what in ("forward", "generate"):
        row[f"{what}_speedup"] = row[f"transformers_{what}_s"] / row[f"kernelized_{what}_s"]
    return row


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [r["model"] for r in rows]
    x = range(len(rows))
    for offset, what in ((-0.2, "forward"), (0.2, "generate")):
        ax.bar([i + offset for i in x], [r[f"{what}_speedup"] for r in rows], width=0.4, label=what)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(x), names, rotation=20)
    ax.set_ylabel("transformers time / kernelized time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = family_parser(__doc__.splitlines()[0], quick="two models, short prompt (a smoke test)",
                           gpu="the sizes for a GPU (--device cuda); with --device cpu a tiny dry run")
    parser.add_argument("--tokens", type=int, default=None, help="prefill length (default 256; quick 32)")
    parser.add_argument("--new", type=int, default=None, help="generated tokens (default 16; quick 4)")
    args = parser.parse_args(argv)
    if cuda_missing(args.device):
        return 2
    cuda = args.device == "cuda"
    small = args.quick or (args.gpu and not cuda)
    tokens = args.tokens or (32 if small else 2048 if cuda else 256)
    new = args.new or (4 if small else 32 if cuda else 16)
    budget = args.budget or (0.2 if small else 1.0)
    hidden, layers = (128, 2) if small else (1024, 4) if cuda else (256, 2)
    sync = torch.cuda.synchronize if cuda else None
    if not cuda:  # tiny ops on a busy pool of threads time the machine's load, not the code
        torch.set_num_threads(1)
    built = models(hidden, layers)
    if small:
        built = {name: built[name] for name in ("qwen3_next", "mamba2")}
    rows = []
    for name, build in built.items():
        row = measure(name, build, args.device, tokens, new, budget, sync)
        rows.append(row)
        print(f"{name}: forward {row['forward_speedup']:.2f}x, generate {row['generate_speedup']:.2f}x, "
              f"logits {row['logits_max_rel_diff']:.1e}, tokens identical {row['tokens_identical']}", flush=True)
    header = ["model", "prefill forward: transformers / kernelized, ms", "speed-up",
              f"generate {new} tokens: transformers / kernelized, ms", "speed-up", "logits max rel diff",
              "tokens identical", "not replaced"]
    table = [[r["model"], f"{r['transformers_forward_s'] * 1e3:.1f} / {r['kernelized_forward_s'] * 1e3:.1f}",
              f"{r['forward_speedup']:.2f}x",
              f"{r['transformers_generate_s'] * 1e3:.1f} / {r['kernelized_generate_s'] * 1e3:.1f}",
              f"{r['generate_speedup']:.2f}x", f"{r['logits_max_rel_diff']:.1e}", "yes" if r["tokens_identical"] else "NO",
              ", ".join(n for n, _ in r["not_replaced"]) or "-"] for r in rows]
    text = "\n".join([
        "# Whole models: kernelized against transformers' own path", "",
        f"{machine_line()}; device {args.device}; hidden {hidden}, {layers} layers, prompt {tokens} tokens, "
        f"batch 1, float32; fastest of repeated runs.", "", markdown_table(header, table), ""])
    print(text)
    stem = "kernelize" + ("-quick" if args.quick else "-gpu" if args.gpu else "")
    write_results(args.out, stem, text, {"machine": machine_line(), "device": args.device, "rows": rows}, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

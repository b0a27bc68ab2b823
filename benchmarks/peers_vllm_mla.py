"""vLLM's CPU MLA backend (CPU_MLA) at decode on the inputs ``mla.py`` saved; run under .venv-vllm's Python.

Reads ``{"inputs": path, "outputs": path, "budget_s": s}`` as JSON on stdin. For each saved case
(absorbed queries ``q_nope [B, H, Lr]``, ``q_pe [B, H, R]``, the latent cache ``[num_blocks, 16,
Lr + R]``, its block table and sequence lengths, the softmax scale) it builds vLLM's
``CPUMLAImpl`` (vllm/v1/attention/backends/mla/cpu_mla.py) as the engine would for DeepSeek-V3's
sizes and times its decode step, ``forward_mqa``: what that backend runs for a batch of decodes
once the queries are absorbed (it joins the two query parts, allocates the output and calls
``torch.ops._C.mla_decode_kvcache``). That kernel alone is timed too. Saves the outputs ``[B, H,
Lr]`` to ``outputs`` and prints one JSON line: vLLM's version and each case's seconds per call.
One torch thread, as ``mla.py``.
"""

import json
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch and vLLM's kernels start OpenMP
import torch  # noqa: E402

from common import seconds_per_call  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    import vllm
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    request = json.loads(sys.stdin.read())
    cases = torch.load(request["inputs"])
    answer = {"version": vllm.__version__, "torch": torch.__version__, "threads": torch.get_num_threads(), "cases": []}
    outputs = []
    with torch.no_grad():
        for case in cases:
            q_nope, q_pe, cache = case["q_nope"], case["q_pe"], case["kv_cache"]
            batch, heads, latent = q_nope.shape
            rope = q_pe.shape[-1]
            # the constructor arguments vLLM's MLAAttention layer passes for DeepSeek-V3 (q_lora_rank
            # 1536, nope 128, value 128); the decode step reads only the scale, the ranks and heads
            impl = CPUMLAImpl(heads, latent + rope, case["scale"], 1, None, None, "auto", None, "decoder", None,
                              q_lora_rank=1536, kv_lora_rank=latent, qk_nope_head_dim=128, qk_rope_head_dim=rope,
                              qk_head_dim=128 + rope, v_head_dim=128, kv_b_proj=None)
            # the fields of MLACommonMetadata that forward_mqa reads
            metadata = SimpleNamespace(decode=SimpleNamespace(block_table=case["block_table"],
                                                              seq_lens=case["kv_lens"]))
            out, _ = impl.forward_mqa((q_nope, q_pe), cache, metadata, None)
            step_s = seconds_per_call(lambda: impl.forward_mqa((q_nope, q_pe), cache, metadata, None),
                                      request["budget_s"])
            query = torch.cat([q_nope, q_pe], -1).contiguous()
            kernel_out = torch.zeros_like(out)
            kernel_s = seconds_per_call(
                lambda: ops.mla_decode_kvcache_cpu(kernel_out, query, cache, impl.scale, case["block_table"],
                                                   case["kv_lens"]), request["budget_s"])
            outputs.append(out)
            answer["cases"].append({"batch": batch, "heads": heads, "context": int(case["kv_lens"].max()),
                                    "step_s": step_s, "kernel_s": kernel_s})
    torch.save(outputs, request["outputs"])
    print(json.dumps(answer))


if __name__ == "__main__":
    main()

"""transformers' plug-in points: every MoE layer through :func:`torch_kernels.fused_moe`, every
attention layer through :func:`torch_kernels.quantized_attention`.

>>> import torch_kernels.integrations.transformers  # registers both names
>>> model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="torch_kernels")
>>> model.set_experts_implementation("torch_kernels")  # or on a loaded model
>>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="torch_kernels_quantized")

transformers' experts modules hold ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, the
layout ``fused_moe`` takes, and call the registered function with the tokens, the router's
``top_k_index`` and ``top_k_weights``. Experts this op does not describe (biases, transposed or
interleaved weights, no gate, a post-expert norm, a custom gate such as gpt-oss's, an activation
other than SiLU or GELU) run transformers' own ``grouped_mm`` path instead, so every model keeps
working; :func:`supports` says which path a module takes.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.moe import fused_moe
from ..ops.quantized_attention import check_options, quantized_attention, quantizing_pays
from ..transformers_experts import activation_of, supports, unsupported_reasons

NAME = "torch_kernels"
QUANTIZED_ATTENTION = "torch_kernels_quantized"
__all__ = ["NAME", "QUANTIZED_ATTENTION", "register", "supports", "unsupported_reasons", "experts_forward", "activation_of",
           "quantized_attention_forward"]


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts block of ``module`` through ``fused_moe`` (an ``ExpertsInterface`` function)."""
    if not supports(module):
        from transformers.integrations import moe

        return moe.grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    out = fused_moe(hidden_states, module.gate_up_proj, module.down_proj, top_k_weights, top_k_index,
                    activation_of(module))
    return out.to(hidden_states.dtype)


def quantized_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, scaling: float | None = None,
                                dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: ``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, S, D]``
    -> ``(out [B, T, Hq, D], None)`` through :func:`~torch_kernels.quantized_attention`.

    Causal attention is aligned bottom-right, so prefill, chunked prefill over a cache and decoding
    all take the quantized path. A padding mask, dropout, a sliding window or a soft cap go to
    transformers' SDPA path instead (the op has none of them), and so do CPU tensors, where the
    quantized kernel is 5-6x slower than exact SDPA, unless the call passes ``force_quantized=True``
    or ``TORCH_KERNELS_FORCE_QUANTIZED=1`` is set (``generate()`` rejects the keyword; see
    ``torch_kernels.ops.quantized_attention.quantizing_pays``). ``granularity``, ``pv_dtype``,
    ``smooth_k``, ``smooth_q`` and ``force_quantized`` pass through the model's call as attention
    kwargs, e.g. ``model(input_ids, granularity="per_thread", pv_dtype="fp8")``; the options are
    checked on either path."""
    options = {name: kwargs.pop(name) for name in ("granularity", "pv_dtype", "smooth_k", "smooth_q")
               if name in kwargs}
    check_options(**options)
    plain = (attention_mask is None and (dropout == 0.0 or not module.training) and not kwargs.get("sliding_window")
             and not kwargs.get("softcap") and query.shape[-1] == key.shape[-1] == value.shape[-1])
    if not (quantizing_pays(query, kwargs.pop("force_quantized", False)) and plain):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    out = quantized_attention(query, key, value, causal=bool(getattr(module, "is_causal", True)), sm_scale=scaling,
                              **options)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``experts_forward`` as ``experts_implementation="torch_kernels"`` and
    ``quantized_attention_forward`` as ``attn_implementation="torch_kernels_quantized"`` (idempotent).

    The attention name takes SDPA's mask function, so a causal batch without padding gets no mask
    (the quantized path) and a padded batch gets SDPA's mask (and SDPA)."""
    from transformers import AttentionInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)
    AttentionInterface.register(QUANTIZED_ATTENTION, quantized_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(QUANTIZED_ATTENTION, sdpa_mask)


register()

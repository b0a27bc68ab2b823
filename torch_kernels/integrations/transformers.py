"""transformers' experts interface: every MoE layer of a model through :func:`torch_kernels.fused_moe`.

>>> import torch_kernels.integrations.transformers  # registers "torch_kernels"
>>> model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="torch_kernels")
>>> model.set_experts_implementation("torch_kernels")  # or on a loaded model

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

NAME = "torch_kernels"
__all__ = ["NAME", "register", "supports", "experts_forward", "activation_of"]


def activation_of(module: nn.Module) -> str | None:
    """The ``fused_moe`` activation of ``module.act_fn``, or None if it has none."""
    act = getattr(module, "act_fn", None)
    if isinstance(act, nn.SiLU):
        return "silu"
    if isinstance(act, nn.GELU) and act.approximate == "none":
        return "gelu"
    name = type(act).__name__
    return {"SiLUActivation": "silu", "GELUActivation": "gelu"}.get(name)


def supports(module: nn.Module) -> bool:
    """Whether ``module``'s experts are what ``fused_moe`` computes."""
    from transformers.integrations import moe

    plain = (getattr(module, "has_gate", True) and not getattr(module, "has_bias", False)
             and not getattr(module, "is_transposed", False) and getattr(module, "is_concatenated", True)
             and not getattr(module, "has_post_expert_norm", False))
    default_gate = getattr(type(module), "_apply_gate", moe._default_apply_gate) is moe._default_apply_gate
    weights = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (plain and default_gate and activation_of(module) is not None
            and all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights))


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts block of ``module`` through ``fused_moe`` (an ``ExpertsInterface`` function)."""
    if not supports(module):
        from transformers.integrations import moe

        return moe.grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    out = fused_moe(hidden_states, module.gate_up_proj, module.down_proj, top_k_weights, top_k_index,
                    activation_of(module))
    return out.to(hidden_states.dtype)


def register() -> None:
    """Register ``experts_forward`` as ``experts_implementation="torch_kernels"`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)


register()

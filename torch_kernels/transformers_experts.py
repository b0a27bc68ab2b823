"""Which transformers experts modules ``fused_moe`` computes, and with which activation: what both
the transformers integration and expert parallelism ask of a module (imports transformers only
when asked).

transformers' experts modules hold ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, the
layout ``fused_moe`` takes; biases, transposed or interleaved weights, no gate, a post-expert norm,
a custom gate such as gpt-oss's or an activation other than SiLU or exact GELU it does not.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["activation_of", "supports", "unsupported_reasons"]


def activation_of(module: nn.Module) -> str | None:
    """The ``fused_moe`` activation of ``module.act_fn``, or None if it has none."""
    act = getattr(module, "act_fn", None)
    if isinstance(act, nn.SiLU):
        return "silu"
    if isinstance(act, nn.GELU) and act.approximate == "none":
        return "gelu"
    name = type(act).__name__
    return {"SiLUActivation": "silu", "GELUActivation": "gelu"}.get(name)


def unsupported_reasons(module: nn.Module) -> list[str]:
    """Why ``fused_moe`` does not compute ``module``'s experts (empty if it does)."""
    from transformers.integrations import moe

    weights = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
    reasons = {
        "no gate (an up projection only)": not getattr(module, "has_gate", True),
        "expert biases": getattr(module, "has_bias", False),
        "transposed weights": getattr(module, "is_transposed", False),
        "interleaved gate and up weights": not getattr(module, "is_concatenated", True),
        "a norm after each expert": getattr(module, "has_post_expert_norm", False),
        "a gate function of its own (_apply_gate)":
            getattr(type(module), "_apply_gate", moe._default_apply_gate) is not moe._default_apply_gate,
        f"activation {type(getattr(module, 'act_fn', None)).__name__} (fused_moe computes SiLU or exact GELU)":
            activation_of(module) is None,
        "no 3-D gate_up_proj and down_proj tensors": not all(isinstance(w, torch.Tensor) and w.dim() == 3
                                                             for w in weights),
    }
    return [reason for reason, applies in reasons.items() if applies]


def supports(module: nn.Module) -> bool:
    """Whether ``module``'s experts are what ``fused_moe`` computes."""
    return not unsupported_reasons(module)

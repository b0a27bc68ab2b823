"""torch_kernels: LLM serving and training kernels as ``torch.ops.torch_kernels.*`` ops.

Every op runs on a pure-PyTorch reference anywhere, on Triton (NVIDIA), on Pallas through
torchax (TPU) and on SYCL (Intel); see :mod:`torch_kernels.backends` for how a call picks one.
Importing this package needs only torch and numpy; backends import their own dependencies on
first use and report themselves unavailable, with the reason, when those are missing.
"""

from . import backends
from .backends import available_backends, unavailable_reasons, use_backend
from .ops.ood import edm_score, mahalanobis_score
from .ops.linear_attention import chunk_gated_delta_rule, chunk_simple_gla, fused_recurrent_gated_delta_rule
from .ops.paged_attention import ragged_paged_attention, reshape_and_cache
from .ops.moe import MoEHandle, fused_moe, grouped_mm, moe_combine, moe_dispatch, router_topk
from .ops.quantized_attention import quantized_attention, quantized_sdpa
from . import ood
from .profiling import calibrate_device, profile
from .autotune import autotune


def torchax_environment():
    """torchax's default environment with every torch_kernels op registered (needs ``[jax]``).

    Ops called on torchax tensors inside ``with torchax_environment():`` run their JAX/Pallas
    implementation on the JAX arrays, gradients included.
    """
    from ._torchax import environment

    return environment()


__all__ = [
    "backends",
    "available_backends",
    "unavailable_reasons",
    "use_backend",
    "mahalanobis_score",
    "edm_score",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "chunk_simple_gla",
    "ragged_paged_attention",
    "reshape_and_cache",
    "router_topk",
    "moe_dispatch",
    "grouped_mm",
    "moe_combine",
    "fused_moe",
    "MoEHandle",
    "quantized_attention",
    "quantized_sdpa",
    "ood",
    "profile",
    "calibrate_device",
    "torchax_environment",
    "autotune",
]
__version__ = "0.1.0"

"""torch_kernels: LLM serving and training kernels as ``torch.ops.torch_kernels.*`` ops.

Every op runs on a pure-PyTorch reference anywhere, on Triton (NVIDIA), on Pallas through
torchax (TPU) and on SYCL (Intel); see :mod:`torch_kernels.backends` for how a call picks one.
Importing this package needs only torch and numpy; backends import their own dependencies on
first use and report themselves unavailable, with the reason, when those are missing.

The ops' public wrappers (``mahalanobis_score``, ``ragged_paged_attention``, ``fused_moe``, ...)
come from the op families: each module of ``torch_kernels.ops`` lists its public names in its
``__all__`` and this package exports them all (see :mod:`torch_kernels.families`).
"""

from . import backends, families
from .backends import available_backends, unavailable_reasons, use_backend
from ._checks import checks, raise_deferred_errors
from . import ood
from . import profiling
from .profiling import calibrate_device, profile
from .autotune import autotune


def torchax_environment():
    """torchax's default environment with every torch_kernels op registered (needs ``[jax]``).

    Ops called on torchax tensors inside ``with torchax_environment():`` run their JAX/Pallas
    implementation on the JAX arrays, gradients included.
    """
    from .pallas.torchax_tensors import environment

    return environment()


def _wire_the_distributed_exchange() -> None:
    """The ops sit below :mod:`torch_kernels.distributed`, so the package on top plugs it in:
    ``moe_dispatch(..., group=)`` imports it on first use (which registers its exchange in place
    of this one), then the call goes there."""
    from .ops.moe import GroupPath, group_path, register_group_path

    def dispatch_across_ranks(*args, **kwargs):
        from . import distributed  # noqa: F401

        return group_path().dispatch(*args, **kwargs)

    register_group_path(GroupPath(dispatch_across_ranks, None, handle_type=()))


_wire_the_distributed_exchange()

# each family's public wrappers: the names in its ops module's __all__
_family_exports = {name: getattr(module, name) for module in families.families().values()
                   for name in getattr(module, "__all__", ())}
globals().update(_family_exports)

__all__ = [
    "backends",
    "available_backends",
    "unavailable_reasons",
    "use_backend",
    "checks",
    "raise_deferred_errors",
    *_family_exports,
    "ood",
    "profile",
    "calibrate_device",
    "torchax_environment",
    "autotune",
]
del _family_exports
__version__ = "0.1.0"


def _telemetry_from_the_environment() -> None:
    """``TORCH_KERNELS_TELEMETRY=1`` turns the always-on telemetry on at import (``profile.continuous()``)."""
    import os

    if os.environ.get(profiling.ENV_TELEMETRY, "0").strip() not in ("", "0"):
        profile.continuous()


_telemetry_from_the_environment()

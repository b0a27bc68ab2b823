"""What the moe family's op modules share: dtypes, argument tests, the backward's backend order
and the per-expert byte count of the cost formulas."""

from __future__ import annotations

import numbers

import torch

from ... import _checks, backends
from ..._library import tensor_bytes
from ...reference import moe as reference

FLOAT_DTYPES = _checks.FLOAT_DTYPES  # backends decline float64; the reference takes it (gradcheck)
FP8_DTYPES = (torch.float8_e4m3fn,)


def device_type(t: torch.Tensor) -> str:
    """The device key ``backends.dispatch`` picks a backend by."""
    return "cpu" if t.is_cpu else t.device.type


def is_int(x) -> bool:
    """An integer that is not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x) -> bool:
    """A real number that is not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def backward_order(t: torch.Tensor, implementation) -> str | None:
    """The backends a backward should try: those chosen at forward time (as linear attention does)."""
    order, explicit = backends.resolve(device_type(t), implementation)
    return ",".join(order) if explicit else None


def per_expert_bytes(t, used: int) -> int:
    """The bytes of ``used`` of the experts of ``t`` (``[E, ...]``, or None)."""
    return 0 if t is None else tensor_bytes(t) // t.shape[0] * used


# the routing maps (``reference.sort_by_expert``) in the backend's own launches where it has them
SORT_BY_EXPERT = "moe.sort_by_expert"
backends.register(SORT_BY_EXPERT, "triton", "triton_impl.moe:sort_by_expert")


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, backend: str | None):
    """``reference.sort_by_expert``'s maps (the same, bit for bit), made by ``backend``'s routing
    kernels where it has them (Triton: three launches), else by torch ops (about fourteen). Every
    id must be -1 or an expert (the op's checks see to that)."""
    device_sort = backends.helper(SORT_BY_EXPERT, backend)
    return (device_sort or reference.sort_by_expert)(topk_ids, num_experts)

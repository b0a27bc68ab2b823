"""Mixture-of-experts ops: ``router_topk``, ``moe_dispatch``, ``grouped_mm``, ``moe_combine`` and
``fused_moe``, one module per story:

- :mod:`.router`: ``router_topk``, each token's experts and weights;
- :mod:`.dispatch`: ``moe_dispatch`` (the op ``moe_gather``) and ``moe_combine``, token copies
  sorted by expert and back, and the hook through which a ``torch.distributed`` group plugs in;
- :mod:`.grouped_gemm`: ``grouped_mm`` and its weight gradient ``grouped_mm_weight_grad``;
- :mod:`.fused`: ``fused_moe``, the experts block as one op.

Layouts are what users hold: tokens ``[T, H]``; expert weights ``[E, K, N]`` for ``grouped_mm``
(``torch.nn.functional.grouped_mm``'s contract, with cumulative int32 row ``offsets``), and vLLM's
``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` for ``fused_moe`` (transformers' ``gate_up_proj`` and
``down_proj``). Routing metadata (which token each sorted row comes from, which row each of a
token's choices went to) is computed once on the device by ``_common.sort_by_expert`` (the
backend's routing kernels, or ``reference.sort_by_expert``'s torch ops), with no host sync, and
carried from dispatch to combine by a :class:`MoEHandle`.

Ops with a backend kernel (``torch.ops.torch_kernels.*``): ``router_topk``, ``moe_gather``,
``moe_combine``, ``grouped_mm``, ``grouped_mm_weight_grad`` and ``fused_moe``. Their backwards are
compositions of these ops (the backward of a gather is a combine and the reverse; a grouped GEMM's
are a grouped GEMM and a weight-gradient GEMM), so training runs on the chosen backend and
compiles without graph breaks.
"""

from __future__ import annotations

from ...families import Case
from .router import router_topk
from .dispatch import MoEHandle, moe_combine, moe_dispatch
from .grouped_gemm import GROUPED_MM, grouped_mm, grouped_mm_definition, grouped_mm_inputs
from .fused import FUSED, fused_moe, fused_moe_definition, moe_inputs

# names code outside the family takes from the package: the input makers and FLOP count (tests,
# benchmarks), and the hook and ops torch_kernels.distributed plugs in and runs
from ._common import FLOAT_DTYPES  # noqa: F401
from .router import router_inputs  # noqa: F401
from .fused import fused_moe_flops  # noqa: F401
from .dispatch import (  # noqa: F401
    GroupPath, check_ids_range, group_path, moe_combine_op, moe_gather_op, register_group_path,
)

__all__ = ["router_topk", "moe_dispatch", "grouped_mm", "moe_combine", "fused_moe", "MoEHandle"]


def selftest_cases() -> list[Case]:
    """The doctor's checks of the fused block and the grouped GEMM against float64 loops (the
    router, dispatch and combine are checked through them and by the tests)."""
    return [Case(FUSED, moe_inputs, fused_moe, fused_moe_definition),
            Case(GROUPED_MM, grouped_mm_inputs, grouped_mm, grouped_mm_definition)]

"""MoE across ranks on ``torch.distributed``: expert parallelism and attention-FFN disaggregation.

:mod:`.exchange` moves token copies to the ranks holding their experts and back
(``moe_dispatch`` / ``moe_combine`` with a process group).
"""

from .exchange import (
    EPHandle, Layout, PendingCombine, PendingDispatch, expert_forward, make_layout, moe_combine, moe_dispatch,
    start_combine, start_dispatch,
)

__all__ = [
    "EPHandle", "Layout", "PendingCombine", "PendingDispatch", "expert_forward", "make_layout", "moe_combine",
    "moe_dispatch", "start_combine", "start_dispatch",
]

"""MoE across ranks on ``torch.distributed``: expert parallelism and attention-FFN disaggregation.

- :mod:`.exchange`: token copies to the ranks holding their experts and back
  (``dispatch_across_ranks`` / ``combine_across_ranks``, what ``moe_dispatch`` / ``moe_combine``
  with a process group run), exact, fixed-capacity or fp8 on the wire.
- :mod:`.expert_parallel`: :class:`ExpertParallel` shards a transformers MoE model's experts.
- :mod:`.disaggregated`: M attention ranks and N FFN ranks serve one MoE transformer
  (:func:`run_disaggregated`), with microbatch ping-pong and a per-rank timeline.
- :mod:`.launch`: :func:`run_local` runs a function on local processes joined in a group.
"""

from .exchange import (
    EPHandle, Layout, PendingCombine, PendingDispatch, combine_across_ranks, dispatch_across_ranks, expert_forward,
    make_layout, moe_combine, moe_dispatch, start_combine, start_dispatch,
)
from .disaggregated import (
    AttentionFFNLayout, AttentionRunner, EventLog, FFNServer, busy_fractions, make_attention_ffn_layout,
    run_disaggregated, timeline_png,
)
from .expert_parallel import ExpertParallel, ExpertShard, all_reduce_replicated_grads, replicated_parameters
from .launch import RankFailed, run_local

__all__ = [
    "EPHandle", "Layout", "PendingCombine", "PendingDispatch", "combine_across_ranks", "dispatch_across_ranks",
    "expert_forward", "make_layout", "start_combine", "start_dispatch",
    "moe_combine", "moe_dispatch",  # deprecated names of the two above
    "AttentionFFNLayout", "AttentionRunner", "EventLog", "FFNServer", "busy_fractions", "make_attention_ffn_layout",
    "run_disaggregated", "timeline_png",
    "ExpertParallel", "ExpertShard", "all_reduce_replicated_grads", "replicated_parameters",
    "RankFailed", "run_local",
]

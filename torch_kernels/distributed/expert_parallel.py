"""Expert parallelism for transformers MoE models: each rank of a group keeps a slice of every
experts module and runs its own batch.

>>> model = ExpertParallel(group).shard(model)   # on every rank, before building the optimizer
>>> model(input_ids).logits.sum().backward()       # every rank, its own batch
>>> all_reduce_replicated_grads(model)             # as DDP would for the non-expert parameters

:meth:`ExpertParallel.shard` replaces each experts module's ``gate_up_proj [E, 2I, H]`` and
``down_proj [E, H, I]`` by this rank's contiguous slice ``[E / R, ...]`` (rank ``r`` of ``R`` keeps
experts ``r E / R .. (r + 1) E / R - 1``, the split :func:`~.exchange.dispatch_across_ranks` uses) and
switches the model's experts implementation to ``"torch_kernels_ep"``. That forward sends each
token copy to the rank holding its expert (:func:`~.exchange.dispatch_across_ranks`), runs the local slice
(:func:`~.exchange.expert_forward`, i.e. ``fused_moe``) and brings the outputs back
(:func:`~.exchange.combine_across_ranks`); the router stays where the tokens are, so attention and routing
are data-parallel and only the experts are split. Every MoE layer is a collective: every rank must
run the same number of forwards and, under autograd, call backward.

The expert slices' gradients come out of backward already summed over every rank's tokens. The
other parameters are replicated and see only this rank's batch: sum their gradients over the group
(:func:`all_reduce_replicated_grads`) so that both together are the gradient of the sum of the
ranks' losses; divide each rank's loss by the group size for the mean, as DDP's averaging would.
"""

from __future__ import annotations

import dataclasses
import numbers

import torch
import torch.distributed as dist
from torch import nn

from ..transformers_experts import activation_of, supports, unsupported_reasons
from .exchange import FP8, dispatch_across_ranks, expert_forward, start_combine

NAME = "torch_kernels_ep"
SHARD_ATTRIBUTE = "expert_parallel"  # the ExpertShard an experts module carries once sharded

__all__ = ["NAME", "ExpertParallel", "ExpertShard", "all_reduce_replicated_grads", "experts_forward", "register",
           "replicated_parameters"]


@dataclasses.dataclass(frozen=True)
class ExpertShard:
    """What a sharded experts module remembers: its group, the global expert count ``num_experts``,
    the experts this rank keeps, and how its forward exchanges rows."""

    group: dist.ProcessGroup
    num_experts: int
    first_expert: int
    local_experts: int
    activation: str
    max_tokens_per_rank: int | None
    dispatch_dtype: torch.dtype | None

    @property
    def experts(self) -> range:
        """The global ids of the experts this rank keeps."""
        return range(self.first_expert, self.first_expert + self.local_experts)


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts block of a module sharded by :meth:`ExpertParallel.shard`: dispatch over its
    group, this rank's experts, combine (an ``ExpertsInterface`` function; a collective)."""
    shard = getattr(module, SHARD_ATTRIBUTE, None)
    if not isinstance(shard, ExpertShard):
        raise RuntimeError(f"{type(module).__name__}: experts_implementation={NAME!r} runs only experts modules "
                           f"sharded by ExpertParallel.shard, and this one holds all its experts")
    rows, offsets, handle = dispatch_across_ranks(hidden_states, top_k_index, shard.num_experts, shard.group,
                                         max_tokens_per_rank=shard.max_tokens_per_rank,
                                         dispatch_dtype=shard.dispatch_dtype)
    out = expert_forward(rows, offsets, module.gate_up_proj, module.down_proj, shard.activation)
    # agreed: out has the width and dtype of the dispatched rows, which the dispatch made every rank agree on
    return start_combine(out, handle, top_k_weights, agreed=True).wait().to(hidden_states.dtype)


def register() -> None:
    """Register :func:`experts_forward` as ``experts_implementation="torch_kernels_ep"`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)


def _uses_experts_interface(module: nn.Module) -> bool:
    # Instances of @use_experts_implementation classes carry these flags.
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed")


def _is_experts_module(module: nn.Module) -> bool:
    # An experts module without the interface still shows itself by its stacked weights.
    stacked = any(isinstance(getattr(module, name, None), torch.Tensor) and getattr(module, name).dim() == 3
                  for name in ("gate_up_proj", "down_proj"))
    return _uses_experts_interface(module) or stacked


def _why_unsupported(module: nn.Module) -> str:
    """Why the "torch_kernels" integration does not run ``module`` (called once it said it does not)."""
    if not _uses_experts_interface(module):
        return "its class does not call transformers' experts interface (@use_experts_implementation)"
    return ", ".join(unsupported_reasons(module))


def _check_group(group) -> dist.ProcessGroup:
    if group is None:
        if not dist.is_initialized():
            raise ValueError("group: None means the default process group, but torch.distributed is not "
                             "initialized (call torch.distributed.init_process_group first or pass a group)")
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return group


class ExpertParallel:
    """Shards the experts of transformers MoE models over ``group`` (default: the default group).

    Args:
        group: the ranks that split the experts; each runs its own batch through the whole model.
        max_tokens_per_rank: fixed-capacity exchange (eager: one small header round trip per
            layer, which checks that the ranks agree; compiled: no host sync): the most tokens
            (batch x sequence) any rank passes to one forward; the same on every rank.
        dispatch_dtype: ``torch.float8_e4m3fn`` sends the rows to the experts as float8 with block
            scales; None sends them in the model's dtype.
    """

    def __init__(self, group=None, *, max_tokens_per_rank: int | None = None,
                 dispatch_dtype: torch.dtype | None = None):
        self.group = _check_group(group)
        if max_tokens_per_rank is not None:
            if not isinstance(max_tokens_per_rank, numbers.Integral) or isinstance(max_tokens_per_rank, bool):
                raise TypeError(f"max_tokens_per_rank: expected None or an int, got "
                                f"{type(max_tokens_per_rank).__name__}")
            if max_tokens_per_rank < 1:
                raise ValueError(f"max_tokens_per_rank: expected an int >= 1, got {max_tokens_per_rank}")
        if dispatch_dtype not in (None, FP8):
            raise TypeError(f"dispatch_dtype: expected None (the model's dtype) or torch.float8_e4m3fn, "
                            f"got {dispatch_dtype}")
        self.max_tokens_per_rank = None if max_tokens_per_rank is None else int(max_tokens_per_rank)
        self.dispatch_dtype = dispatch_dtype
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def shard(self, model: nn.Module) -> nn.Module:
        """Keep this rank's slice of every experts module of ``model`` and route them through
        ``"torch_kernels_ep"``; returns ``model``, changed in place. Call it on every rank of the
        group, with the same model, before building the optimizer (the old weights are freed).

        Raises ``ValueError`` (and changes nothing) when ``model`` has no experts module, one that
        ``fused_moe`` does not compute (see :func:`torch_kernels.transformers_experts.supports`),
        one already sharded, or an expert count that is not a multiple of the group size. Afterwards
        ``state_dict()`` holds this rank's slices only, and the experts must keep this implementation
        (another one would read the local slice with global expert ids).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        found = [(name, m) for name, m in model.named_modules() if _is_experts_module(m)]
        if not found:
            raise ValueError(f"model: {type(model).__name__} has no MoE experts module (one with stacked 3-D "
                             f"gate_up_proj / down_proj weights), so there is nothing to shard")
        unsupported = [f"{name} ({type(m).__name__}): {_why_unsupported(m)}"
                       for name, m in found if not (_uses_experts_interface(m) and supports(m))]
        if unsupported:
            raise ValueError("model: expert parallelism runs experts through fused_moe, which does not compute "
                             "these experts modules: " + "; ".join(unsupported))
        already = [name for name, m in found if isinstance(getattr(m, SHARD_ATTRIBUTE, None), ExpertShard)]
        if already:
            raise ValueError(f"model: experts modules {already} are already sharded (shard a model once)")
        for name, m in found:
            experts = m.gate_up_proj.shape[0]
            if m.down_proj.shape[0] != experts:
                raise ValueError(f"model: {name}.down_proj holds {m.down_proj.shape[0]} experts but "
                                 f"{name}.gate_up_proj holds {experts}")
            if experts % self.world_size:
                raise ValueError(f"model: {name} has num_experts={experts}, which is not a multiple of the group "
                                 f"size {self.world_size} (each rank keeps num_experts / group size experts)")

        register()
        for _, m in found:
            experts = m.gate_up_proj.shape[0]
            local = experts // self.world_size
            first = self.rank * local
            with torch.no_grad():
                for name in ("gate_up_proj", "down_proj"):
                    full = getattr(m, name)
                    # clone: a view would keep the whole stack alive
                    setattr(m, name, nn.Parameter(full.detach()[first:first + local].clone(),
                                                  requires_grad=full.requires_grad))
            setattr(m, SHARD_ATTRIBUTE, ExpertShard(self.group, experts, first, local, activation_of(m),
                                                    self.max_tokens_per_rank, self.dispatch_dtype))
            # The experts interface reads the implementation from the module's own config, shared by
            # its model's experts; setting it there also covers models whose class cannot switch it.
            m.config._experts_implementation = NAME
        return model


def _sharded_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, SHARD_ATTRIBUTE, None), ExpertShard)]


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` that every rank holds whole (all but the sharded experts' slices)."""
    sharded = {id(p) for m in _sharded_modules(model) for p in (m.gate_up_proj, m.down_proj)}
    return [p for p in model.parameters() if id(p) not in sharded]


def all_reduce_replicated_grads(model: nn.Module, group=None) -> None:
    """Sum the gradients of the replicated parameters over the group, in place (a collective).

    After each rank's ``backward``, this makes every gradient that of the sum of the ranks' losses,
    the gradient the expert slices already have. A parameter that requires grad but got none on
    this rank takes part with zeros (a peer may have one), so its ``.grad`` is set afterwards.
    ``group`` defaults to the one ``model`` was sharded over.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if group is None:
        groups = {id(getattr(m, SHARD_ATTRIBUTE).group): getattr(m, SHARD_ATTRIBUTE).group
                  for m in _sharded_modules(model)}
        if len(groups) != 1:
            raise ValueError(f"group: None means the group model was sharded over, but model has "
                             f"{'no sharded experts' if not groups else f'experts sharded over {len(groups)} groups'}; "
                             f"pass the group")
        (group,) = groups.values()
    group = _check_group(group)
    params = [p for p in replicated_parameters(model) if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    # One all-reduce per dtype and device instead of one per parameter.
    buckets: dict[tuple, list[nn.Parameter]] = {}
    for p in params:
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for bucket in buckets.values():
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        dist.all_reduce(flat, group=group)
        for p, summed in zip(bucket, flat.split([p.grad.numel() for p in bucket])):
            p.grad.copy_(summed.view_as(p.grad))

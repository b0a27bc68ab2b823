"""Expert-parallel dispatch and combine over a ``torch.distributed`` process group.

The group's ranks play two parts: *token ranks* hold tokens and route them, *expert ranks* hold
the experts, split contiguously (expert ``e`` lives on ``expert_ranks[e // (E / N)]``). Expert
parallelism is every rank playing both; attention-FFN disaggregation is attention ranks holding
tokens and FFN ranks holding experts. Both run on this one mechanism:

1. every rank sends every rank a small header: the arguments all ranks must agree on (hidden size,
   dtype, ``num_experts``, ``max_tokens_per_rank``, ...) and how many rows it routes there, so a
   rank whose arguments differ makes every rank raise the same ``ValueError`` instead of sending
   buffers of sizes its peers do not expect (which gloo answers by aborting the process);
2. each token rank sorts its token copies by expert (``sort_by_expert``, as on one device), so the
   rows for each destination rank are contiguous, and ``all_to_all_single`` sends the per-expert
   counts and the rows;
3. each expert rank reorders what it received by local expert (sources in rank order, tokens in
   order within a source) and returns it with local ``offsets``, as ``moe_dispatch`` does;
4. combine runs the same exchange backwards and reduces each token's rows with the single-device
   ``moe_combine``, so the reduction order (and hence the result) is the one-device one.

An exchange is a placement of rows into a send buffer, one ``all_to_all_single``, and a gather
from the receive buffer, all differentiable, so the backward of a dispatch is a combine-direction
exchange and the reverse. Collectives are PyTorch's functional ones: they are issued at once and
waited for when their result is used (``PendingDispatch.wait``), so a caller can compute while
rows travel, and they trace under ``torch.compile``.

Exact mode learns the split sizes from the header (one host sync). Fixed-capacity mode
(``max_tokens_per_rank``) sends each expert rank a buffer of ``max_tokens_per_rank * k`` rows, the
most a rank can route to it, so nothing can overflow; in eager mode it still waits for the header
(one small round trip, the only host sync), under ``torch.compile``, while a CUDA graph is
captured, or with ``agreed=True`` (a caller that made the ranks agree already) it sends no header
and never waits on the host. A combine sends a header of ``y``'s width and dtype the same way.
The header also carries whether each rank's expert ids are in range and, in fixed-capacity mode,
its token count, so a rank with bad ids or too many tokens fails every rank, none left waiting.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .. import _checks, backends
from ..ops import moe as moe_ops
from ..reference import moe as reference

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128  # columns per float32 scale, as DeepEP sends


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which ranks of ``group`` send tokens and which hold experts (group ranks, ascending)."""

    group: dist.ProcessGroup
    rank: int
    world: int
    num_experts: int
    expert_ranks: tuple[int, ...]
    token_ranks: tuple[int, ...]

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // len(self.expert_ranks)

    def local_experts(self, rank: int | None = None) -> range:
        """The experts ``rank`` (default this one) holds; empty for a rank without experts."""
        rank = self.rank if rank is None else rank
        if rank not in self.expert_ranks:
            return range(0)
        first = self.expert_ranks.index(rank) * self.experts_per_rank
        return range(first, first + self.experts_per_rank)


def _ranks(name: str, ranks, world: int) -> tuple[int, ...]:
    if ranks is None:
        return tuple(range(world))
    ranks = tuple(ranks)
    if not ranks or not all(isinstance(r, numbers.Integral) and not isinstance(r, bool) for r in ranks):
        raise TypeError(f"{name}: expected a non-empty sequence of group ranks, got {ranks!r}")
    if list(ranks) != sorted(set(ranks)) or ranks[0] < 0 or ranks[-1] >= world:
        raise ValueError(f"{name}: expected distinct ascending ranks in [0, {world}), got {list(ranks)}")
    return tuple(int(r) for r in ranks)


def make_layout(group, num_experts: int, expert_ranks=None, token_ranks=None) -> Layout:
    """A :class:`Layout`, checked: ``num_experts`` must split evenly over the expert ranks."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
    world = dist.get_world_size(group)
    experts, tokens = _ranks("expert_ranks", expert_ranks, world), _ranks("token_ranks", token_ranks, world)
    if not isinstance(num_experts, numbers.Integral) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"num_experts: expected an int >= 1, got {num_experts!r}")
    if num_experts % len(experts):
        raise ValueError(f"num_experts: expected a multiple of the {len(experts)} expert ranks of the group "
                         f"(each holds E / {len(experts)} experts), got {num_experts}")
    return Layout(group, dist.get_rank(group), world, int(num_experts), experts, tokens)


@dataclasses.dataclass(frozen=True)
class Route:
    """One direction of an exchange: input row ``i`` goes to row ``send_pos[i]`` of a send buffer
    split ``send_splits`` over the ranks (position ``sum(send_splits)``: not sent); output row ``o``
    is row ``recv_pos[o]`` of the receive buffer (position ``sum(recv_splits)``: a zero row)."""

    send_pos: torch.Tensor
    send_splits: list[int]
    recv_pos: torch.Tensor
    recv_splits: list[int]

    def reverse(self) -> Route:
        return Route(self.recv_pos, self.recv_splits, self.send_pos, self.send_splits)


def _place(rows: torch.Tensor, pos: torch.Tensor, size: int) -> torch.Tensor:
    """Rows at their positions in a ``[size, ...]`` buffer; position ``size`` is discarded."""
    return rows.new_zeros(size + 1, *rows.shape[1:]).index_copy_(0, pos, rows)[:size]


def _pick(buffer: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Buffer rows at ``pos``; position ``len(buffer)`` reads a zero row."""
    size = buffer.shape[0]
    if size == 0:  # still from the buffer: its backward exchange must run on every rank
        return torch.cat([buffer, buffer.new_zeros(1, *buffer.shape[1:])]).index_select(0, pos)
    return buffer.index_select(0, pos.clamp(max=size - 1)).masked_fill_((pos == size)[:, None], 0)


def _all_to_all(buffer: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Issued now, waited for when the result is used. Under grad mode every rank takes part in
    the backward exchange, even one whose own rows need no gradient: its peers' rows do."""
    if not torch.is_grad_enabled():
        return funcol.all_to_all_single(buffer, recv_splits, send_splits, group)
    if not buffer.requires_grad:
        buffer = buffer.detach().requires_grad_()
    return funcol.all_to_all_single_autograd(buffer, recv_splits, send_splits, group)


def _failed(what: str, layout: Layout, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"{what}: the all-to-all over the group failed on rank {layout.rank} of {layout.world} (a peer rank "
        f"failed, left, or did not reach the exchange within the group's timeout): {error}")


def _waited(tensor: torch.Tensor, what: str, layout: Layout) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return tensor
    try:
        return funcol.wait_tensor(tensor)
    except (RuntimeError, dist.DistBackendError) as error:
        raise _failed(what, layout, error) from error


# ---- the header: what every rank must agree on, checked before any buffer is sized ----

@dataclasses.dataclass(frozen=True)
class _Agreed:
    """One value every rank of the group must pass alike: ``argument`` names it in the error."""

    argument: str
    what: str
    value: int
    show: object = str  # int -> the text an error shows; None: show this rank's ``detail`` instead
    detail: str = ""


def _dtype_code(dtype: torch.dtype) -> int:
    return moe_ops.FLOAT_DTYPES.index(dtype)


def _show_dtype(code: int) -> str:
    return str(moe_ops.FLOAT_DTYPES[code])


def _disagreement(item: _Agreed, column: list[int], rank: int) -> str:
    first_rank = {}
    for r, value in enumerate(column):
        first_rank.setdefault(value, r)
    if item.show is None:
        other = next(r for r, value in enumerate(column) if value != column[rank])
        got = f"{item.detail} on rank {rank} and others on rank {other}"
    else:
        got = " and ".join(f"{item.show(value)} on rank {r}" for value, r in first_rank.items())
    return f"{item.argument}: expected the same {item.what} on every rank of the group, got {got}"


def _exchange_header(layout: Layout, agreed: list[_Agreed], what: str, device, data=None) -> list[list[int]]:
    """Every rank's header, read on the host (one small all-to-all, one sync): row ``s`` is what
    rank ``s`` sent this rank, the ``agreed`` values then its ``data`` (int64 ``[world, C]``, row
    ``r`` for rank ``r``). Raises the same ``ValueError`` on every rank, naming the argument, for
    the first ``agreed`` value on which the ranks differ."""
    values = torch.tensor([item.value for item in agreed], dtype=torch.int64, device=device)
    sent = values.expand(layout.world, -1)
    if data is not None:
        sent = torch.cat([sent, data], dim=1)
    received = funcol.all_to_all_single(sent.reshape(-1).contiguous(), None, None, layout.group)
    table = _waited(received, what, layout).view(layout.world, -1).tolist()
    for i, item in enumerate(agreed):
        column = [row[i] for row in table]
        if len(set(column)) > 1:
            raise ValueError(_disagreement(item, column, layout.rank))
    return [row[len(agreed):] for row in table]


# ---- fp8 rows on the wire ----

def pack_fp8(rows: torch.Tensor) -> torch.Tensor:
    """``[n, H]`` -> uint8 ``[n, H + 4 ceil(H / 128)]``: float8_e4m3fn entries, then one float32
    scale (``amax / 448``) per 128 columns, so one exchange carries both."""
    n, hidden = rows.shape
    blocks = -(-hidden // FP8_BLOCK)
    padded = torch.nn.functional.pad(rows.float(), (0, blocks * FP8_BLOCK - hidden)).view(n, blocks, FP8_BLOCK)
    amax = padded.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    entries = (padded / scale[..., None]).to(FP8).view(n, blocks * FP8_BLOCK)[:, :hidden]
    return torch.cat([entries.view(torch.uint8), scale.view(torch.uint8).view(n, 4 * blocks)], dim=1)


def unpack_fp8(packed: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of :func:`pack_fp8`, in ``dtype``."""
    n = packed.shape[0]
    blocks = -(-hidden // FP8_BLOCK)
    entries = packed[:, :hidden].contiguous().view(FP8).float()
    scale = packed[:, hidden:].contiguous().view(torch.float32).view(n, blocks)
    padded = torch.nn.functional.pad(entries, (0, blocks * FP8_BLOCK - hidden)).view(n, blocks, FP8_BLOCK)
    return (padded * scale[..., None]).view(n, blocks * FP8_BLOCK)[:, :hidden].to(dtype)


class _Fp8Exchange(torch.autograd.Function):
    """Rows sent as float8 with block scales; the gradient returns in full precision (the
    quantization is treated as the identity, a straight-through estimator)."""

    @staticmethod
    def forward(ctx, rows, route, layout):
        ctx.route, ctx.layout = route, layout
        sent = _all_to_all(_place(pack_fp8(rows), route.send_pos, sum(route.send_splits)), route.send_splits,
                           route.recv_splits, layout.group)
        received = _waited(sent, "moe_dispatch", layout)
        return unpack_fp8(_pick(received, route.recv_pos), rows.shape[1], rows.dtype)

    @staticmethod
    def backward(ctx, d_out):
        return exchange(d_out, ctx.route.reverse(), ctx.layout, "moe_dispatch backward"), None, None


def exchange(rows: torch.Tensor, route: Route, layout: Layout, what: str) -> torch.Tensor:
    """Rows moved along ``route`` (differentiable; the backward is the reverse route)."""
    sent = _all_to_all(_place(rows, route.send_pos, sum(route.send_splits)), route.send_splits, route.recv_splits,
                       layout.group)
    return _pick(_waited(sent, what, layout), route.recv_pos)


# ---- dispatch ----

@dataclasses.dataclass(frozen=True)
class EPHandle:
    """What :func:`combine_across_ranks` needs from an expert-parallel :func:`dispatch_across_ranks`: the local
    sort (a single-device :class:`~torch_kernels.MoEHandle`), the route the rows took, the layout."""

    local: moe_ops.MoEHandle
    route: Route
    layout: Layout
    implementation: str | None

    @property
    def num_received(self) -> int:
        """Rows this rank received (its experts' batch, padding included in fixed-capacity mode)."""
        return self.route.recv_pos.shape[0]


def _counts_to_send(offsets: torch.Tensor, layout: Layout) -> torch.Tensor:
    """int64 ``[world, E / N]``: how many of this rank's rows go to each expert of each rank."""
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
    per_rank = counts.new_zeros(layout.world, layout.experts_per_rank)
    return per_rank.index_copy(0, torch.tensor(layout.expert_ranks, device=counts.device),
                               counts.view(len(layout.expert_ranks), -1))


def _receive_order(counts: torch.Tensor, recv_splits: list[int], rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(recv_pos [rows], offsets int32 [E / N])``: the received rows (source blocks, each sorted by
    local expert) reordered by local expert, sources in rank order within an expert.

    ``counts[s, e]`` is how many rows source ``s`` sent for local expert ``e``; ``rows`` is the
    output length (the receive buffer's, padding included)."""
    device = counts.device
    size = sum(recv_splits)
    ends = torch.tensor(recv_splits, device=device).cumsum(0)
    pos = torch.arange(size, device=device)
    source = torch.searchsorted(ends, pos, right=True)
    within = pos - (ends - torch.tensor(recv_splits, device=device))[source]  # row index inside its source block
    ends_by_expert = counts.cumsum(1)  # [world, E/N], per source
    expert = torch.searchsorted(ends_by_expert[source], within[:, None], right=True).squeeze(1)
    valid = within < ends_by_expert[source, -1]
    expert = expert.clamp(max=counts.shape[1] - 1)
    index_in_run = within - (ends_by_expert - counts)[source, expert]
    per_expert = counts.sum(0)
    expert_start = per_expert.cumsum(0) - per_expert
    earlier_sources = counts.cumsum(0) - counts  # rows of the same expert from lower ranks
    out = expert_start[expert] + earlier_sources[source, expert] + index_in_run
    recv_pos = torch.full((rows + 1,), size, dtype=torch.int64, device=device)
    recv_pos = recv_pos.scatter(0, torch.where(valid, out, rows), pos)[:rows]
    return recv_pos, per_expert.cumsum(0).to(torch.int32)


class PendingDispatch:
    """A dispatch in flight: :meth:`wait` returns ``(rows, offsets, handle)``."""

    def __init__(self, x_sorted, local, layout, counts, send_splits, recv_splits, send_pos, payload, fp8,
                 implementation):
        self._x_sorted, self._local, self._layout = x_sorted, local, layout
        self._counts, self._send_splits, self._recv_splits = counts, send_splits, recv_splits
        self._send_pos, self._payload, self._fp8, self._implementation = send_pos, payload, fp8, implementation

    def wait(self):
        layout = self._layout
        counts = _waited(self._counts, "moe_dispatch", layout).view(layout.world, layout.experts_per_rank)
        recv_pos, offsets = _receive_order(counts, self._recv_splits, sum(self._recv_splits))
        if layout.rank not in layout.expert_ranks:
            offsets = offsets[:0]
        route = Route(self._send_pos, self._send_splits, recv_pos, self._recv_splits)
        if self._fp8:
            rows = _Fp8Exchange.apply(self._x_sorted, route, layout)
        else:
            rows = _pick(_waited(self._payload, "moe_dispatch", layout), recv_pos)
        return rows, offsets, EPHandle(self._local, route, layout, self._implementation)


def _check_dispatch(x, topk_ids, layout: Layout, max_tokens_per_rank, dispatch_dtype) -> None:
    _checks.tensor("x", x, ndim=2, dtypes=moe_ops.FLOAT_DTYPES)
    _checks.tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    _checks.size("topk_ids", 0, topk_ids.shape[0], x.shape[0], "tokens T of x")
    if layout.rank not in layout.token_ranks and x.shape[0]:
        raise ValueError(f"x: rank {layout.rank} is not one of the token ranks {list(layout.token_ranks)}, so it "
                         f"routes no tokens; expected 0 rows, got {x.shape[0]}")
    if max_tokens_per_rank is not None:
        if not isinstance(max_tokens_per_rank, numbers.Integral) or isinstance(max_tokens_per_rank, bool):
            raise TypeError(f"max_tokens_per_rank: expected None or an int, got {type(max_tokens_per_rank).__name__}")
        if max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank: expected an int >= 1, got {max_tokens_per_rank}")
    if dispatch_dtype not in (None, FP8, x.dtype):
        raise TypeError(f"dispatch_dtype: expected None, x's dtype or torch.float8_e4m3fn, got {dispatch_dtype}")


def _no_readback(t: torch.Tensor) -> bool:
    """Under ``torch.compile`` or while a CUDA graph is captured: nothing may be read back."""
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _over_capacity(max_tokens_per_rank: int, tokens: int, rank: int) -> ValueError:
    return ValueError(f"x: expected at most max_tokens_per_rank={max_tokens_per_rank} tokens on every rank (the "
                      f"capacity every rank's buffers are sized for), got {tokens} on rank {rank}")


def _rows_to_ranks(topk_ids: torch.Tensor, layout: Layout) -> torch.Tensor:
    """int64 ``[world]``: the copies this rank routes to each rank (ids out of range left out)."""
    ids = topk_ids.reshape(-1).long()
    expert_ranks = len(layout.expert_ranks)
    owner = torch.where((ids >= 0) & (ids < layout.num_experts), ids // layout.experts_per_rank, expert_ranks)
    per_owner = torch.zeros(expert_ranks + 1, dtype=torch.int64, device=ids.device).scatter_add_(
        0, owner, torch.ones_like(owner))[:expert_ranks]
    return torch.zeros(layout.world, dtype=torch.int64, device=ids.device).index_copy_(
        0, torch.tensor(layout.expert_ranks, device=ids.device), per_owner)


def _agree_on_dispatch(x, topk_ids, layout: Layout, max_tokens_per_rank, dispatch_dtype) -> tuple[list, list]:
    """The dispatch's header (:func:`_exchange_header`): raises on every rank when the arguments differ
    across ranks, or any rank's ids are out of range or its tokens over capacity; else returns
    ``(send_splits, recv_splits)``, the rows this rank sends each rank and receives from each."""
    fixed = max_tokens_per_rank is not None
    agreed = [
        _Agreed("num_experts", "number of experts", layout.num_experts),
        _Agreed("expert_ranks, token_ranks", "expert and token ranks", hash((layout.expert_ranks, layout.token_ranks)),
               show=None, detail=f"expert_ranks {list(layout.expert_ranks)}, token_ranks {list(layout.token_ranks)}"),
        _Agreed("x", "hidden size (x.shape[1])", x.shape[1]),
        _Agreed("x", "dtype", _dtype_code(x.dtype), show=_show_dtype),
        _Agreed("max_tokens_per_rank", "max_tokens_per_rank", max_tokens_per_rank if fixed else -1,
               show=lambda v: "None" if v < 0 else str(v)),
        # k sizes the fixed-capacity buffers (max_tokens_per_rank * k rows); exact mode lets it differ
        _Agreed("topk_ids", "experts per token (topk_ids.shape[1]) in fixed-capacity mode",
               topk_ids.shape[1] if fixed else -1),
        _Agreed("dispatch_dtype", "dispatch dtype", int(dispatch_dtype == FP8),
               show=lambda v: "torch.float8_e4m3fn" if v else "None (x's dtype)"),
    ]
    bad_ids = ((topk_ids < -1) | (topk_ids >= layout.num_experts)).any()
    sends = _rows_to_ranks(topk_ids, layout)
    per_rank = torch.stack([torch.full_like(sends, x.shape[0]), bad_ids.long().expand(layout.world), sends], dim=1)
    table = _exchange_header(layout, agreed, "moe_dispatch", x.device, per_rank)
    tokens, bad, recv_splits = ([row[i] for row in table] for i in range(3))
    if fixed:
        for rank, t in enumerate(tokens):
            if t > max_tokens_per_rank:
                raise _over_capacity(max_tokens_per_rank, t, rank)
    if bad[layout.rank]:
        moe_ops.check_ids_range(topk_ids, layout.num_experts)  # raises, with this rank's first bad id
    if any(bad):
        raise ValueError(f"topk_ids: expected expert ids in [0, {layout.num_experts}) or -1 (dropped) on every rank, "
                         f"got others on rank {bad.index(1)}")
    return sends.tolist(), recv_splits


def start_dispatch(x, topk_ids, num_experts, group, *, expert_ranks=None, token_ranks=None,
                   max_tokens_per_rank=None, dispatch_dtype=None, implementation=None,
                   agreed: bool = False) -> PendingDispatch:
    """Issue an expert-parallel dispatch; see :func:`dispatch_across_ranks` for the arguments.

    Waits for the header (module docstring) first, except in fixed-capacity mode under
    ``torch.compile``, while a CUDA graph is captured, or with ``agreed=True``: the caller has made
    every rank agree on the arguments and the token counts already (as the disaggregated runner's
    step header does), and the dispatch returns at once, never waiting on the host."""
    layout = make_layout(group, num_experts, expert_ranks, token_ranks)
    _check_dispatch(x, topk_ids, layout, max_tokens_per_rank, dispatch_dtype)
    _checks.same_device(x=x, topk_ids=topk_ids)
    implementation = backends.implementation_arg(implementation)
    if max_tokens_per_rank is not None and (agreed or _no_readback(x)):
        if x.shape[0] > max_tokens_per_rank:
            raise _over_capacity(max_tokens_per_rank, x.shape[0], layout.rank)
        if not _no_readback(x):
            moe_ops.check_ids_range(topk_ids, num_experts)
    else:
        send_splits, recv_splits = _agree_on_dispatch(x, topk_ids, layout, max_tokens_per_rank, dispatch_dtype)
    token_of_row, row_of_slot, offsets = reference.sort_by_expert(topk_ids, num_experts)
    local = moe_ops.MoEHandle(token_of_row, row_of_slot, int(num_experts))
    x_sorted = moe_ops.moe_gather_op(x, token_of_row, row_of_slot, implementation)
    send_counts = _counts_to_send(offsets, layout)
    recv_counts = funcol.all_to_all_single(send_counts.view(-1), None, None, group)
    rows = x_sorted.shape[0]
    if max_tokens_per_rank is None:
        send_pos = torch.arange(rows, device=x.device).clamp_(max=sum(send_splits))
    else:
        capacity = max_tokens_per_rank * topk_ids.shape[1]
        sending, receiving = layout.rank in layout.token_ranks, layout.rank in layout.expert_ranks
        send_splits = [capacity if sending and r in layout.expert_ranks else 0 for r in range(layout.world)]
        recv_splits = [capacity if receiving and s in layout.token_ranks else 0 for s in range(layout.world)]
        send_pos = _capacity_positions(offsets, rows, layout, capacity)
    fp8 = dispatch_dtype == FP8
    payload = None if fp8 else _all_to_all(_place(x_sorted, send_pos, sum(send_splits)), send_splits, recv_splits,
                                           group)
    return PendingDispatch(x_sorted, local, layout, recv_counts, send_splits, recv_splits, send_pos, payload, fp8,
                           implementation)


def _capacity_positions(offsets: torch.Tensor, rows: int, layout: Layout, capacity: int) -> torch.Tensor:
    """Row ``j`` of the sorted rows -> its place in the send buffer, ``capacity`` rows per expert
    rank (dropped rows: past the buffer)."""
    device = offsets.device
    ends = offsets.long()
    j = torch.arange(rows, device=device)
    expert = torch.searchsorted(ends, j, right=True)  # num_experts for dropped rows
    destination = expert // layout.experts_per_rank
    per_rank = layout.experts_per_rank
    first_row = torch.cat([ends.new_zeros(1), ends])[::per_rank]  # first sorted row of each expert rank
    pos = destination * capacity + j - first_row[destination.clamp(max=len(first_row) - 1)]
    return torch.where(expert < layout.num_experts, pos, capacity * len(layout.expert_ranks))


def dispatch_across_ranks(x, topk_ids, num_experts, group, *, expert_ranks=None, token_ranks=None,
                          max_tokens_per_rank=None, dispatch_dtype=None, implementation=None):
    """Send each token copy to the rank holding its expert: what ``torch_kernels.moe_dispatch(...,
    group=)`` runs (formerly named ``moe_dispatch`` here, a name kept as a deprecated alias).

    Args:
        x: ``[T, H]`` this rank's tokens (``T`` may differ across ranks; 0 on ranks without tokens).
        topk_ids: ``[T, k]`` global expert ids; -1 is a dropped slot.
        num_experts: ``E``, a multiple of the number of expert ranks ``N``.
        group: the ``torch.distributed`` process group; every rank of it must call this.
        expert_ranks, token_ranks: group ranks holding experts and tokens (default: all of them).
        max_tokens_per_rank: fixed-capacity mode (traceable by ``torch.compile``, and no host sync
            there or in a CUDA graph; in eager mode one, for the header): the most tokens any rank
            passes; every rank must pass the same value.
        dispatch_dtype: ``torch.float8_e4m3fn`` sends the rows as float8 with a float32 scale per
            128 columns (about half the bytes of bfloat16); received rows come back in x's dtype.

    Returns:
        ``(rows [n, H], offsets int32 [E / N], handle)``: the rows for this rank's experts sorted
        by local expert (sources in rank order, then token order), with cumulative ``offsets`` as
        :func:`~torch_kernels.grouped_mm` takes them; in fixed-capacity mode ``n`` is the receive
        buffer's size and rows past ``offsets[-1]`` are zero. ``offsets`` is empty on a rank
        without experts. Differentiable in ``x`` (the backward is a combine-direction exchange).

    Arguments that size the exchange (``x``'s hidden size and dtype, ``num_experts``,
    ``expert_ranks``, ``token_ranks``, ``max_tokens_per_rank``, ``dispatch_dtype``, and ``k`` in
    fixed-capacity mode) must be the same on every rank: where they differ, every rank raises a
    ``ValueError`` naming the argument (in eager mode; see the module docstring).
    """
    return start_dispatch(x, topk_ids, num_experts, group, expert_ranks=expert_ranks, token_ranks=token_ranks,
                          max_tokens_per_rank=max_tokens_per_rank, dispatch_dtype=dispatch_dtype,
                          implementation=implementation).wait()


# ---- combine ----

class PendingCombine:
    """A combine in flight: :meth:`wait` returns the combined ``[T, N]``."""

    def __init__(self, returned, handle: EPHandle, topk_weights):
        self._returned, self._handle, self._weights = returned, handle, topk_weights

    def wait(self) -> torch.Tensor:
        handle = self._handle
        rows = _pick(_waited(self._returned, "moe_combine", handle.layout), handle.route.send_pos)
        return moe_ops.moe_combine_op(rows, handle.local.token_of_row, handle.local.row_of_slot, self._weights,
                                      handle.implementation)


def start_combine(y, handle: EPHandle, topk_weights, *, agreed: bool = False) -> PendingCombine:
    """Issue the return of expert outputs; see :func:`combine_across_ranks`.

    First exchanges a header of ``y``'s width and dtype (one small round trip): a rank whose ``y``
    differs makes every rank raise the same ``ValueError``. Left out under ``torch.compile``, while
    a CUDA graph is captured, and with ``agreed=True`` (the caller made the ranks agree on them)."""
    _checks.tensor("y", y, ndim=2, dtypes=moe_ops.FLOAT_DTYPES)
    if not isinstance(handle, EPHandle):
        raise TypeError(f"handle: expected the EPHandle of a moe_dispatch with a group, got {type(handle).__name__}")
    _checks.size("y", 0, y.shape[0], handle.num_received, "rows this rank received in the dispatch")
    _checks.tensor("topk_weights", topk_weights, ndim=2, dtypes=_checks.FLOAT_DTYPES)
    if tuple(topk_weights.shape) != tuple(handle.local.row_of_slot.shape):
        raise ValueError(f"topk_weights: expected shape {tuple(handle.local.row_of_slot.shape)} (T, k of the "
                         f"dispatch), got {tuple(topk_weights.shape)}")
    if not (agreed or _no_readback(y)):
        _exchange_header(handle.layout, [_Agreed("y", "width (y.shape[1])", y.shape[1]),
                                        _Agreed("y", "dtype", _dtype_code(y.dtype), show=_show_dtype)],
                        "moe_combine", y.device)
    back = handle.route.reverse()
    returned = _all_to_all(_place(y, back.send_pos, sum(back.send_splits)), back.send_splits, back.recv_splits,
                           handle.layout.group)
    return PendingCombine(returned, handle, topk_weights)


def combine_across_ranks(y, handle: EPHandle, topk_weights) -> torch.Tensor:
    """Return expert outputs to the ranks that sent the tokens and reduce them there.

    Args:
        y: ``[n, N]`` outputs for the rows :func:`dispatch_across_ranks` returned on this rank, same order.
        handle: that dispatch's :class:`EPHandle`.
        topk_weights: ``[T, k]`` this rank's routing weights (``[0, k]`` on a rank without tokens).

    Returns:
        ``[T, N]`` in y's dtype, reduced exactly as the single-device ``moe_combine`` (float32, in
        the order of each token's choices). Differentiable in ``y`` (a dispatch-direction exchange)
        and ``topk_weights``.
    """
    return start_combine(y, handle, topk_weights).wait()


# torch_kernels.moe_dispatch with a group, and moe_combine of its handle, run here
moe_ops.register_group_path(moe_ops.GroupPath(dispatch_across_ranks, combine_across_ranks, EPHandle))


def _deprecated_alias(function, old_name: str):
    """``function`` under the name it had, warning that the name is deprecated."""
    @functools.wraps(function)
    def alias(*args, **kwargs):
        warnings.warn(f"torch_kernels.distributed.{old_name} is deprecated: call {function.__name__} (the same "
                      f"exchange) or torch_kernels.{old_name}(..., group=)", DeprecationWarning, stacklevel=2)
        return function(*args, **kwargs)
    alias.__name__ = alias.__qualname__ = old_name
    return alias


# the former names, which read as the single-device ops' own
moe_dispatch = _deprecated_alias(dispatch_across_ranks, "moe_dispatch")
moe_combine = _deprecated_alias(combine_across_ranks, "moe_combine")


# ---- the experts on the received rows ----

def local_expert_ids(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """int64 ``[rows, 1]``: each sorted row's local expert, -1 past ``offsets[-1]`` (no host sync)."""
    expert = torch.searchsorted(offsets.long(), torch.arange(rows, device=offsets.device), right=True)
    return torch.where(expert < offsets.shape[0], expert, -1)[:, None]


def expert_forward(rows, offsets, w13, w2, activation: str = "silu", implementation=None) -> torch.Tensor:
    """This rank's experts on the rows a dispatch returned: :func:`~torch_kernels.fused_moe` with
    each row routed to its local expert at weight 1 (padding rows give zeros).

    ``w13 [E / N, 2I, H]`` and ``w2 [E / N, H, I]`` are this rank's slices of the experts."""
    ids = local_expert_ids(offsets, rows.shape[0])
    ones = torch.ones(ids.shape, dtype=reference.compute_dtype(rows.dtype), device=rows.device)
    return moe_ops.fused_moe(rows, w13, w2, ones, ids, activation, implementation=implementation)

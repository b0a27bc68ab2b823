"""Attention-FFN disaggregation: M attention ranks and N FFN ranks serve one MoE transformer.

Roles. A group of ``M + N`` ranks (any ``M >= 1``, ``N >= 1``) splits in two: group ranks
``0 .. M-1`` are *attention ranks*, ``M .. M+N-1`` are *FFN ranks* (:func:`make_attention_ffn_layout`).
Attention ranks hold the embeddings, every layer's norms, attention and router, the final norm and
the LM head, and their own sequences with their KV caches (:class:`AttentionRunner`). FFN ranks
hold the routed experts, split contiguously (expert ``e`` on FFN rank ``e // (E / N)``), and no
tokens (:class:`FFNServer`). Per MoE layer each attention rank routes its tokens, sends every token
copy to the FFN rank owning its expert (:func:`~.exchange.start_dispatch` with ``token_ranks`` the
attention ranks and ``expert_ranks`` the FFN ranks), the FFN ranks run their experts on the union of
all attention ranks' rows as one batch, send the outputs back, and each attention rank combines
them with its routing weights (:func:`~.exchange.start_combine`). Dense MLP layers (Qwen3-MoE's
``mlp_only_layers``) run on the attention ranks and exchange nothing.

Shared experts would run on the attention ranks, between issuing a microbatch's dispatch and
waiting its combine: they are dense, need no routing, and so hide behind the exchange instead of
adding to the FFN ranks' batch. Qwen3-MoE has none; a model whose MoE blocks have them is refused
(``ValueError``) rather than run without them.

Order of collectives (every rank of the group issues the same sequence, which gloo and NCCL
require). With ``m`` microbatches, per step::

    header all_reduce (from the attention ranks: stop flag, m, mode, capacity, model fingerprint)
    per MoE layer:  D(mb0), D(mb1), ..., D(mb m-1), C(mb0), C(mb1), ..., C(mb m-1)

where each ``D``/``C`` is one dispatch/combine (a count all-to-all and a row all-to-all). The
attention side posts ``D(mb i)`` right after mb i's attention half and goes on with mb i+1's
attention while the FFN ranks compute mb i's experts (ping-pong); it waits ``C(mb i)`` only right
before mb i's next attention half, so the next layer's attention of mb 0 overlaps the experts of
the last microbatch. The FFN side waits each dispatch, computes, and posts the combines as soon as
every dispatch of the layer has been posted. In fixed-capacity mode (the default) no exchange waits
on the host, so the FFN ranks post all of a layer's dispatches at once; the buffers are sized for
the largest microbatch of any attention rank (the padding rows carry expert id -1 and cost no
expert compute). Exact mode sends exactly the routed rows but each dispatch first waits for the
counts, so mb i+1's dispatch cannot start before the FFN ranks finish mb i's experts.

Every rank can record an event log (:class:`EventLog`: ``(name, start, end)`` spans from
``time.perf_counter``, comparable across the processes of one machine); :func:`timeline_png` draws
the logs of all ranks as one timeline and :func:`busy_fractions` summarizes them.

This path is for inference (``torch.no_grad``; no backward). Prompts of one batch have equal
lengths (no padding mask); every attention rank runs the same number of steps with the same number
of microbatches, and the header checks that (a mismatch raises the same error on every rank).
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import time

import torch
import torch.distributed as dist

from .. import _checks
from . import exchange

ATTENTION, FFN = "attention", "ffn"
# Span kinds (a name's first word) that are computation; the rest are communication or waiting.
COMPUTE_KINDS = ("attention", "experts", "mlp", "embed", "head")
KIND_COLORS = {"attention": "tab:blue", "experts": "tab:orange", "mlp": "tab:purple", "embed": "tab:cyan",
               "head": "tab:cyan", "dispatch": "tab:green", "combine": "tab:olive", "wait": "0.85"}
_NONE = -(2 ** 62)  # the identity of the header's max-reduction: what FFN ranks contribute to attention fields


@dataclasses.dataclass(frozen=True)
class AttentionFFNLayout:
    """Which ranks of ``group`` are attention ranks and which are FFN ranks (group ranks, ascending)."""

    group: dist.ProcessGroup
    rank: int
    world: int
    attention_ranks: tuple[int, ...]
    ffn_ranks: tuple[int, ...]

    @property
    def role(self) -> str:
        """``"attention"`` or ``"ffn"``: this rank's part."""
        return ATTENTION if self.rank in self.attention_ranks else FFN


def make_attention_ffn_layout(num_attention: int, num_ffn: int, group=None) -> AttentionFFNLayout:
    """Group ranks ``0 .. num_attention-1`` attend, the next ``num_ffn`` hold the experts.

    Args:
        num_attention, num_ffn: ``M >= 1`` and ``N >= 1``; ``M + N`` must be the group's size.
        group: a ``torch.distributed`` process group (default: the world); every rank of it takes
            part in every step.
    """
    group = dist.group.WORLD if group is None else group
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected None or a torch.distributed ProcessGroup, got {type(group).__name__}")
    for name, value in (("num_attention", num_attention), ("num_ffn", num_ffn)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value}")
    world = dist.get_world_size(group)
    if num_attention + num_ffn != world:
        raise ValueError(f"num_attention + num_ffn: expected the group's size {world} (every rank plays one "
                         f"part), got {num_attention} + {num_ffn}")
    return AttentionFFNLayout(group, dist.get_rank(group), world, tuple(range(num_attention)),
                              tuple(range(num_attention, world)))


class EventLog:
    """Spans ``(name, start, end)`` in ``time.perf_counter`` seconds; a name's first word is its kind."""

    def __init__(self):
        self.events: list[tuple[str, float, float]] = []

    @contextlib.contextmanager
    def span(self, name: str):
        """Record the time the ``with`` body takes under ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.events.append((name, start, time.perf_counter()))


class _NoLog:
    @contextlib.contextmanager
    def span(self, name: str):
        yield


def _log(event_log):
    if event_log is None:
        return _NoLog()
    if not isinstance(event_log, EventLog):
        raise TypeError(f"event_log: expected None or an EventLog, got {type(event_log).__name__}")
    return event_log


# ---- the model's parts ----

def _check_model(model, layout) -> None:
    if not isinstance(layout, AttentionFFNLayout):
        raise TypeError(f"layout: expected an AttentionFFNLayout (make_attention_ffn_layout), got "
                        f"{type(layout).__name__}")
    parts = ("model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb", "lm_head", "config")
    for part in parts:
        owner = model
        for attribute in part.split("."):
            if not hasattr(owner, attribute):
                raise TypeError(f"model: expected a Qwen3-MoE-style causal LM (with {', '.join(parts)}), "
                                f"{type(model).__name__} has no {part}")
            owner = getattr(owner, attribute)
    for index, layer in enumerate(model.model.layers):
        if any(hasattr(layer.mlp, name) for name in ("shared_expert", "shared_experts")):
            raise ValueError(f"model: layer {index} has shared experts, which the disaggregated path does not "
                             f"run yet (they belong on the attention ranks, overlapped with the exchange)")
    if model.lm_head.weight.dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"model: expected floating-point weights, got {model.lm_head.weight.dtype}")
    if model.config.hidden_act != "silu":
        raise ValueError(f"model: expected experts with SiLU (config.hidden_act 'silu'), got "
                         f"{model.config.hidden_act!r}")
    num_experts = model.config.num_experts
    if num_experts % len(layout.ffn_ranks):
        raise ValueError(f"layout: the model's {num_experts} experts do not split evenly over "
                         f"{len(layout.ffn_ranks)} FFN ranks")


def _is_moe(layer) -> bool:
    return hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts")


def _fingerprint(model) -> list[int]:
    """What both roles must agree on, or the exchange would mismatch: MoE layers, sizes, dtype."""
    config = model.config
    return [sum(_is_moe(layer) for layer in model.model.layers), config.hidden_size, config.num_experts,
            config.num_experts_per_tok, _checks.FLOAT_DTYPES.index(model.lm_head.weight.dtype)]


@dataclasses.dataclass(frozen=True)
class _Header:
    stop: bool
    microbatches: int
    max_tokens_per_rank: int | None  # None: exact mode


def _exchange_header(layout, fingerprint, device, stop=None, microbatches=None, fixed=None, tokens=None) -> _Header:
    """One all_reduce(max) of ``[v, -v]`` pairs, so every rank sees each field's max and min and
    all raise the same error when ranks disagree (no rank is left waiting in a collective)."""
    attention = layout.role == ATTENTION
    checked = [*fingerprint, *([int(stop), microbatches, int(fixed)] if attention else [_NONE] * 3)]
    values = [v for value in checked for v in ((value, -value) if value != _NONE else (_NONE, _NONE))]
    header = torch.tensor([*values, tokens if attention else _NONE], dtype=torch.int64, device=device)
    dist.all_reduce(header, op=dist.ReduceOp.MAX, group=layout.group)
    pairs = header[:-1].view(-1, 2).tolist()
    names = ("MoE layers", "hidden size", "experts", "experts per token", "dtype", "stop (close)",
             "microbatches", "fixed capacity")
    for name, (high, neg_low) in zip(names, pairs):
        if high != -neg_low:
            raise ValueError(f"the ranks of the group disagree on {name} (from {-neg_low} to {high}): every "
                             f"attention rank must run the same steps with the same microbatches and mode, "
                             f"on the same model as the FFN ranks")
    stop, microbatches, fixed = (pair[0] for pair in pairs[len(fingerprint):])
    return _Header(bool(stop), microbatches, int(header[-1]) if fixed else None)


class _RemoteExperts(torch.nn.Module):
    """Stands in for the experts on an attention rank: they live on the FFN ranks."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("these experts live on the FFN ranks; run the model with AttentionRunner")


@dataclasses.dataclass
class _Microbatch:
    rows: slice
    cache: object
    hidden: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    mask: object = None
    position_embeddings: tuple | None = None
    pending: object = None  # the combine in flight for the last MoE layer

    @property
    def empty(self) -> bool:
        return self.rows.start == self.rows.stop


class AttentionRunner:
    """The attention side: runs this rank's sequences through the model, experts remote.

    Args:
        model: a transformers ``Qwen3MoeForCausalLM`` (or a model of the same shape), built the same
            on every rank. Its experts are replaced in place by a stand-in (their weights are freed).
        layout: an attention rank's :class:`AttentionFFNLayout`.
        microbatches: how many microbatches each step's batch is split into (by sequence); the
            same on every attention rank.
        fixed_capacity: send fixed-size buffers (no host sync inside the exchange; the capacity is
            the largest microbatch of any attention rank, learned from the step header) instead of
            exact ones.
        event_log: an :class:`EventLog` to record spans into, or None.

    Every attention rank must make the same sequence of :meth:`forward` calls (one collective step
    each) and then call :meth:`close` (or use the runner as a context manager), which lets the FFN
    ranks' :meth:`FFNServer.serve` return.
    """

    def __init__(self, model, layout: AttentionFFNLayout, *, microbatches: int = 1, fixed_capacity: bool = True,
                 event_log: EventLog | None = None):
        _check_model(model, layout)
        if layout.role != ATTENTION:
            raise ValueError(f"layout: rank {layout.rank} is an FFN rank (attention ranks: "
                             f"{list(layout.attention_ranks)}); it runs FFNServer")
        if not isinstance(microbatches, numbers.Integral) or isinstance(microbatches, bool):
            raise TypeError(f"microbatches: expected an int, got {type(microbatches).__name__}")
        if microbatches < 1:
            raise ValueError(f"microbatches: expected an int >= 1, got {microbatches}")
        if not isinstance(fixed_capacity, bool):
            raise TypeError(f"fixed_capacity: expected a bool, got {type(fixed_capacity).__name__}")
        self.model, self.layout = model, layout
        self.microbatches, self.fixed_capacity = int(microbatches), fixed_capacity
        self.event_log = event_log
        self._log = _log(event_log)
        self._fingerprint = _fingerprint(model)
        self._dtype, self._device = model.lm_head.weight.dtype, model.lm_head.weight.device
        for layer in model.model.layers:
            if _is_moe(layer):
                layer.mlp.experts = _RemoteExperts()
        self._batch: list[_Microbatch] | None = None
        self._steps, self._closed = 0, False

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        # After an error the peers may be inside a collective: a stop header would pair with it.
        if kind is None:
            self.close()

    def reset(self) -> None:
        """Forget the current batch and its KV caches (local: no collective)."""
        self._batch = None

    def close(self) -> None:
        """Tell the FFN ranks to stop (a collective step: every attention rank calls it once)."""
        if self._closed:
            return
        self._closed = True
        with self._log.span("wait header"):
            _exchange_header(self.layout, self._fingerprint, self._device, stop=True, microbatches=self.microbatches,
                             fixed=self.fixed_capacity, tokens=0)

    def _start_batch(self, batch: int) -> list[_Microbatch]:
        from transformers import DynamicCache

        return [_Microbatch(slice(int(rows[0]), int(rows[0]) + len(rows)) if len(rows) else slice(batch, batch),
                            DynamicCache(config=self.model.config))
                for rows in torch.arange(batch).tensor_split(self.microbatches)]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One step over this rank's batch: ``[B, S]`` token ids -> ``[B, S, vocab]`` logits.

        The first call after construction or :meth:`reset` is the prefill and fixes ``B``; later
        calls append to the KV caches (decode steps pass ``[B, 1]``)."""
        if self._closed:
            raise RuntimeError("forward: this runner is closed (close() ended the FFN ranks' serving loop)")
        _checks.tensor("input_ids", input_ids, ndim=2, dtypes=(torch.int32, torch.int64))
        if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids: expected at least one sequence and one token, got shape "
                             f"{tuple(input_ids.shape)}")
        if input_ids.device != self._device:
            raise ValueError(f"input_ids: expected the model's device {self._device}, got {input_ids.device}")
        if self._batch is None:
            self._batch = self._start_batch(input_ids.shape[0])
        elif input_ids.shape[0] != self._batch[-1].rows.stop:
            raise ValueError(f"input_ids: expected the {self._batch[-1].rows.stop} sequences of the current batch "
                             f"(reset() starts a new one), got {input_ids.shape[0]}")
        tokens = max(mb.rows.stop - mb.rows.start for mb in self._batch) * input_ids.shape[1]
        with self._log.span("wait header"):
            header = _exchange_header(self.layout, self._fingerprint, self._device, stop=False,
                                      microbatches=self.microbatches, fixed=self.fixed_capacity, tokens=tokens)
        with torch.no_grad():
            logits = self._step(input_ids, header)
        self._steps += 1
        return logits

    def greedy(self, input_ids: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Greedy decoding of a new batch: ``(tokens [B, new_tokens], logits)`` where ``logits`` holds
        the prefill's ``[B, S, vocab]`` and each decode step's ``[B, 1, vocab]`` (``new_tokens`` steps
        in all, each one collective step)."""
        if not isinstance(new_tokens, numbers.Integral) or isinstance(new_tokens, bool) or new_tokens < 1:
            raise ValueError(f"new_tokens: expected an int >= 1, got {new_tokens!r}")
        self.reset()
        logits, tokens = [], []
        step_ids = input_ids
        for _ in range(new_tokens):
            logits.append(self.forward(step_ids))
            step_ids = logits[-1][:, -1].argmax(-1, keepdim=True)
            tokens.append(step_ids)
        return torch.cat(tokens, dim=1), logits

    # ---- one step ----

    def _step(self, input_ids, header: _Header) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        model, config, step = self.model.model, self.model.config, self._steps
        mask_function = create_causal_mask if config.sliding_window is None else create_sliding_window_causal_mask
        for i, mb in enumerate(self._batch):
            if mb.empty:
                continue
            with self._log.span(f"embed s{step} mb{i}"):
                mb.hidden = model.embed_tokens(input_ids[mb.rows])
                past = mb.cache.get_seq_length()
                mb.position_ids = (torch.arange(mb.hidden.shape[1], device=self._device) + past).unsqueeze(0)
                mb.mask = mask_function(config=config, inputs_embeds=mb.hidden, attention_mask=None, cache=mb.cache,
                                        position_ids=mb.position_ids)
                mb.position_embeddings = model.rotary_emb(mb.hidden, position_ids=mb.position_ids)
        for index, layer in enumerate(model.layers):
            if _is_moe(layer):
                self._moe_layer(layer, index, header, step)
                continue
            for i, mb in enumerate(self._batch):
                self._finish(mb, i, index, step)
                if not mb.empty:
                    normed = self._attention_half(layer, mb, i, index, step)
                    with self._log.span(f"mlp s{step} L{index} mb{i}"):
                        mb.hidden = mb.hidden + layer.mlp(normed)
        logits = []
        for i, mb in enumerate(self._batch):
            self._finish(mb, i, len(model.layers), step)
            if not mb.empty:
                with self._log.span(f"head s{step} mb{i}"):
                    logits.append(self.model.lm_head(model.norm(mb.hidden)))
        return torch.cat(logits)

    def _finish(self, mb: _Microbatch, i: int, index: int, step: int) -> None:
        """Before layer ``index``: add the previous layer's expert output (its combine) to mb's residual."""
        if mb.pending is None:
            return
        with self._log.span(f"wait s{step} L{index - 1} mb{i} combine"):
            out = mb.pending.wait()
        mb.pending = None
        if not mb.empty:
            mb.hidden = mb.hidden + out.view(mb.hidden.shape)

    def _attention_half(self, layer, mb: _Microbatch, i: int, index: int, step: int, route: bool = False):
        """Norm, attention and residual into ``mb.hidden``; returns the post-attention norm, or with
        ``route`` its token rows and the router's ``(topk_weights, topk_ids)``."""
        with self._log.span(f"attention s{step} L{index} mb{i}"):
            attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(mb.hidden),
                                          position_embeddings=mb.position_embeddings, attention_mask=mb.mask,
                                          cache=mb.cache, position_ids=mb.position_ids)
            mb.hidden = mb.hidden + attended
            normed = layer.post_attention_layernorm(mb.hidden)
            if not route:
                return normed
            rows = normed.reshape(-1, normed.shape[-1])
            _, topk_weights, topk_ids = layer.mlp.gate(rows)
            return rows, topk_weights, topk_ids

    def _moe_layer(self, layer, index: int, header: _Header, step: int) -> None:
        config, layout = self.model.config, self.layout
        hidden, k = config.hidden_size, config.num_experts_per_tok
        dispatches, weights = [], []
        for i, mb in enumerate(self._batch):
            self._finish(mb, i, index, step)
            if mb.empty:  # still takes part: every rank posts the same exchanges
                rows = torch.empty(0, hidden, dtype=self._dtype, device=self._device)
                topk_weights = torch.empty(0, k, dtype=self._dtype, device=self._device)
                topk_ids = torch.empty(0, k, dtype=torch.int64, device=self._device)
            else:
                rows, topk_weights, topk_ids = self._attention_half(layer, mb, i, index, step, route=True)
            with self._log.span(f"dispatch s{step} L{index} mb{i}"):
                # agreed: the step header made every rank agree on the model and the capacity
                dispatches.append(exchange.start_dispatch(
                    rows, topk_ids, config.num_experts, layout.group, expert_ranks=layout.ffn_ranks,
                    token_ranks=layout.attention_ranks, max_tokens_per_rank=header.max_tokens_per_rank,
                    agreed=True))
            weights.append(topk_weights)
        with self._log.span(f"wait s{step} L{index} dispatch"):
            handles = [pending.wait()[2] for pending in dispatches]
        with self._log.span(f"combine s{step} L{index}"):
            nothing = torch.empty(0, hidden, dtype=self._dtype, device=self._device)  # attention ranks hold no experts
            for mb, handle, topk_weights in zip(self._batch, handles, weights):
                mb.pending = exchange.start_combine(nothing, handle, topk_weights, agreed=True)


class FFNServer:
    """The FFN side: holds this rank's slice of every MoE layer's experts and serves the attention
    ranks' steps until they close.

    Args:
        model: the same model the attention ranks build; this rank copies its experts
            ``[r E / N, (r + 1) E / N)`` (``r``: its index among the FFN ranks) of each MoE layer,
            and the model can be dropped afterwards.
        layout: an FFN rank's :class:`AttentionFFNLayout`.
        event_log: an :class:`EventLog` to record spans into, or None.
    """

    def __init__(self, model, layout: AttentionFFNLayout, *, event_log: EventLog | None = None):
        _check_model(model, layout)
        if layout.role != FFN:
            raise ValueError(f"layout: rank {layout.rank} is an attention rank (FFN ranks: "
                             f"{list(layout.ffn_ranks)}); it runs AttentionRunner")
        config = model.config
        self.layout, self.event_log = layout, event_log
        self._log = _log(event_log)
        self._fingerprint = _fingerprint(model)
        self._num_experts, self._top_k = config.num_experts, config.num_experts_per_tok
        self._hidden = config.hidden_size
        per_rank = config.num_experts // len(layout.ffn_ranks)
        first = layout.ffn_ranks.index(layout.rank) * per_rank
        self._experts = [(index, layer.mlp.experts.gate_up_proj.detach()[first:first + per_rank].clone(),
                         layer.mlp.experts.down_proj.detach()[first:first + per_rank].clone())
                        for index, layer in enumerate(model.model.layers) if _is_moe(layer)]
        self._dtype, self._device = model.lm_head.weight.dtype, model.lm_head.weight.device
        self.steps = 0

    def serve(self) -> int:
        """Serve steps until the attention ranks close; returns how many steps were served."""
        with torch.no_grad():
            while True:
                with self._log.span("wait header"):
                    header = _exchange_header(self.layout, self._fingerprint, self._device)
                if header.stop:
                    return self.steps
                for index, w13, w2 in self._experts:
                    self._layer(index, w13, w2, header)
                self.steps += 1

    def _layer(self, index: int, w13, w2, header: _Header) -> None:
        layout, step, m = self.layout, self.steps, header.microbatches
        x = torch.empty(0, self._hidden, dtype=self._dtype, device=self._device)
        topk_ids = torch.empty(0, self._top_k, dtype=torch.int64, device=self._device)
        no_weights = torch.empty(0, self._top_k, dtype=self._dtype, device=self._device)
        dispatches, ready, combines = [], [], []

        def issue(i):
            with self._log.span(f"dispatch s{step} L{index} mb{i}"):
                # agreed (the step header): posting in fixed-capacity mode never waits on the host
                dispatches.append(exchange.start_dispatch(
                    x, topk_ids, self._num_experts, layout.group, expert_ranks=layout.ffn_ranks,
                    token_ranks=layout.attention_ranks, max_tokens_per_rank=header.max_tokens_per_rank,
                    agreed=True))

        def post_ready():
            # A combine may follow only the layer's last dispatch (the order every rank keeps).
            if len(dispatches) == m:
                for i, y, handle in ready:
                    with self._log.span(f"combine s{step} L{index} mb{i}"):
                        combines.append(exchange.start_combine(y, handle, no_weights, agreed=True))
                ready.clear()

        if header.max_tokens_per_rank is not None:  # fixed capacity: posting never waits on the host
            for i in range(m):
                issue(i)
        for i in range(m):
            if len(dispatches) == i:  # exact mode: posting waits for mb i's counts
                issue(i)
            post_ready()
            with self._log.span(f"wait s{step} L{index} mb{i} dispatch"):
                rows, offsets, handle = dispatches[i].wait()
            with self._log.span(f"experts s{step} L{index} mb{i}"):
                ready.append((i, exchange.expert_forward(rows, offsets, w13, w2), handle))
            post_ready()
        with self._log.span(f"wait s{step} L{index} combine"):
            for pending in combines:
                pending.wait()


def run_disaggregated(model, layout: AttentionFFNLayout, input_ids: torch.Tensor | None, new_tokens: int, *,
                      microbatches: int = 1, fixed_capacity: bool = True, event_log: EventLog | None = None):
    """Greedy generation, each rank in its role: on an attention rank ``(tokens, logits)`` as
    :meth:`AttentionRunner.greedy` returns them for its ``input_ids``; on an FFN rank (``input_ids``
    None) the number of steps it served."""
    if not isinstance(layout, AttentionFFNLayout):
        raise TypeError(f"layout: expected an AttentionFFNLayout (make_attention_ffn_layout), got "
                        f"{type(layout).__name__}")
    if layout.role == FFN:
        if input_ids is not None:
            raise ValueError(f"input_ids: rank {layout.rank} is an FFN rank and holds no sequences; expected None")
        return FFNServer(model, layout, event_log=event_log).serve()
    with AttentionRunner(model, layout, microbatches=microbatches, fixed_capacity=fixed_capacity,
                         event_log=event_log) as runner:
        return runner.greedy(input_ids, new_tokens)


# ---- timelines ----

def _kind(name: str) -> str:
    return name.split(" ", 1)[0]


def _by_rank(event_logs_by_rank) -> dict:
    items = event_logs_by_rank.items() if isinstance(event_logs_by_rank, dict) else enumerate(event_logs_by_rank)
    out = {}
    for rank, events in items:
        events = events.events if isinstance(events, EventLog) else events
        for event in events:
            if not (isinstance(event, (tuple, list)) and len(event) == 3 and isinstance(event[0], str)):
                raise TypeError(f"event_logs_by_rank: rank {rank}: expected (name, start, end) spans, got {event!r}")
        out[rank] = list(events)
    if not out:
        raise ValueError("event_logs_by_rank: expected the event logs of at least one rank, got none")
    return out


def _covered(spans) -> float:
    """Seconds covered by the union of ``(start, end)`` spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def busy_fractions(event_logs_by_rank) -> dict:
    """Per rank, the fraction of its logged time (first start to last end) spent computing
    (spans whose kind is in :data:`COMPUTE_KINDS`); the rest is communication and waiting.

    ``event_logs_by_rank``: a list (index = rank) or dict of event lists or :class:`EventLog`."""
    fractions = {}
    for rank, events in _by_rank(event_logs_by_rank).items():
        if not events:
            fractions[rank] = 0.0
            continue
        span = max(e for _, _, e in events) - min(s for _, s, _ in events)
        busy = _covered([(s, e) for name, s, e in events if _kind(name) in COMPUTE_KINDS])
        fractions[rank] = busy / span if span > 0 else 0.0
    return fractions


def timeline_png(event_logs_by_rank, path, *, labels=None, title: str | None = None) -> None:
    """Draw the ranks' event logs as one timeline (one row per rank, spans coloured by kind, time
    from the earliest span of any rank) and save it as a PNG at ``path``.

    ``event_logs_by_rank``: a list (index = rank) or dict of event lists or :class:`EventLog`;
    ``labels``: a row label per rank (default ``"rank r"``). Needs matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    logs = _by_rank(event_logs_by_rank)
    ranks = sorted(logs)
    if labels is not None and len(labels) != len(ranks):
        raise ValueError(f"labels: expected one per rank ({len(ranks)}), got {len(labels)}")
    labels = [f"rank {r}" for r in ranks] if labels is None else list(labels)
    starts = [s for events in logs.values() for _, s, _ in events]
    origin = min(starts) if starts else 0.0
    figure = Figure(figsize=(12, 1.2 + 0.6 * max(len(ranks), 3)))
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    fractions = busy_fractions(logs)
    for row, rank in enumerate(ranks):
        for name, start, end in logs[rank]:
            kind = _kind(name)
            height = 0.3 if kind == "wait" else 0.7
            axes.barh(row, (end - start) * 1e3, left=(start - origin) * 1e3, height=height,
                      color=KIND_COLORS.get(kind, "0.5"), linewidth=0)
    axes.set_yticks(range(len(ranks)), [f"{label}\n{fractions[r]:.0%} busy" for label, r in zip(labels, ranks)])
    axes.invert_yaxis()
    axes.set_xlabel("time (ms)")
    kinds = sorted({_kind(name) for events in logs.values() for name, _, _ in events})
    axes.legend(handles=[Patch(color=KIND_COLORS.get(k, "0.5"), label=k) for k in kinds], loc="center left",
                bbox_to_anchor=(1.0, 0.5), frameon=False)
    if title:
        axes.set_title(title)
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=120)

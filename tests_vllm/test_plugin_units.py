"""The plugin's pieces without an engine: selection, the version pin, what it declares, and its
attention impl reading and writing a vLLM-shaped KV cache in place (checked against the ops'
readable definition on plain copies)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from . import conftest

vllm = pytest.importorskip("vllm", reason=conftest.SKIP_REASON)

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.custom_op import op_registry_oot  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

import torch_kernels  # noqa: E402

from torch_kernels.integrations import vllm as plugin  # noqa: E402
from torch_kernels.reference.paged_attention import ragged_paged_attention_naive  # noqa: E402

MOE_NAME = "UnquantizedFusedMoEMethod"


@pytest.fixture
def clean_registries():
    """Undo what register() may do in this process."""
    platform_cls = type(current_platform)
    config_check = platform_cls.__dict__.get("check_and_update_config")
    yield
    for member in (AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.CPU_MLA, AttentionBackendEnum.AMX_MLA):
        member.clear_override()
    op_registry_oot.pop(MOE_NAME, None)
    if config_check is not None:
        platform_cls.check_and_update_config = config_check


@pytest.mark.parametrize("value, selected", [(None, False), ("", False), ("0", False), ("1", True)])
def test_env_var_selects(monkeypatch, value, selected):
    if value is None:
        monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(plugin.ENV_VAR, value)
    assert plugin.selected_by_env() is selected


def test_env_var_other_values_are_refused(monkeypatch):
    monkeypatch.setenv(plugin.ENV_VAR, "yes")
    with pytest.raises(ValueError, match="TORCH_KERNELS_VLLM: expected 1"):
        plugin.selected_by_env()


def test_register_not_selected_replaces_nothing(monkeypatch, clean_registries):
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    plugin.register()
    plugin.register()  # vLLM may call it again; nothing changes
    assert AttentionBackendEnum[plugin.BACKEND_NAME].get_path() == plugin.BACKEND_PATH
    assert AttentionBackendEnum[plugin.MLA_BACKEND_NAME].get_path() == plugin.MLA_BACKEND_PATH
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()
    assert not AttentionBackendEnum.CPU_MLA.is_overridden() and not AttentionBackendEnum.AMX_MLA.is_overridden()
    assert MOE_NAME not in op_registry_oot


def test_register_selected_takes_cpu_attention_and_moe(monkeypatch, clean_registries):
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    plugin.register()
    plugin.register()
    assert AttentionBackendEnum.CPU_ATTN.get_class() is plugin.TorchKernelsAttentionBackend
    # whichever MLA backend the CPU platform picks (AMX_MLA where the CPU has AMX)
    assert AttentionBackendEnum.CPU_MLA.get_class() is plugin.TorchKernelsMLABackend
    assert AttentionBackendEnum.AMX_MLA.get_class() is plugin.TorchKernelsMLABackend
    assert op_registry_oot[MOE_NAME] is plugin.TorchKernelsFusedMoEMethod


def test_selected_under_another_vllm_version_refuses(monkeypatch, clean_registries):
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    with pytest.raises(RuntimeError, match=r"tested with vllm 0\.32\.0 and this is vllm 0\.31\.9"):
        plugin.register()
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()
    with pytest.raises(RuntimeError, match="tested with vllm"), set_current_vllm_config(VllmConfig()):
        plugin.TorchKernelsAttentionImpl(4, 32, 32 ** -0.5, 2)  # attention_backend="TORCH_KERNELS" reaches this


def test_env_var_prefers_torch_kernels_where_the_platform_chooses():
    class Platform:  # a platform that returns what it was asked for, as CUDA's does after validating it
        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            return selected_backend

    plugin._prefer_torch_kernels(Platform)
    plugin._prefer_torch_kernels(Platform)  # once is enough
    plain = AttentionSelectorConfig(head_size=64, dtype=torch.float16, kv_cache_dtype="auto", block_size=16)
    ours = AttentionBackendEnum[plugin.BACKEND_NAME]
    assert Platform.get_attn_backend_cls(None, plain) is ours
    mla = plain._replace(use_mla=True)
    assert Platform.get_attn_backend_cls(None, mla) is AttentionBackendEnum[plugin.MLA_BACKEND_NAME]
    sparse = plain._replace(use_mla=True, use_sparse=True)
    assert Platform.get_attn_backend_cls(None, sparse) is None  # sparse MLA: the platform's own
    chosen = AttentionBackendEnum.FLASH_ATTN
    assert Platform.get_attn_backend_cls(chosen, plain) is chosen  # an explicit choice stands


@pytest.mark.parametrize("kwargs, reason", [
    ({"alibi_slopes": [0.5, 0.25, 0.125, 0.0625]}, "ALiBi not supported"),
    ({"attn_type": AttentionType.ENCODER_ONLY}, "attention type .*ENCODER_ONLY.* not supported"),
    ({"sinks": torch.zeros(4)}, "attention sinks not supported"),
    ({"kv_cache_dtype": "bfloat16"}, "a bfloat16 KV cache with a torch.float32 model"),
    ({"kv_cache_dtype": "int8_per_token_head"}, "kv_cache_dtype not supported"),
])
def test_impl_refuses_what_it_does_not_support(kwargs, reason):
    with set_current_vllm_config(VllmConfig()), pytest.raises(NotImplementedError, match=reason):
        plugin.TorchKernelsAttentionImpl(4, 32, 32 ** -0.5, 2, **kwargs)


class _Layer:
    """What the impl reads from vLLM's Attention layer: the KV-cache scales."""

    def __init__(self, k_scale: float, v_scale: float):
        self._k_scale = torch.tensor(k_scale)
        self._v_scale = torch.tensor(v_scale)


def _vllm_cache(num_blocks, num_kv_heads, block_size, head_size, dtype, physical_order):
    """A layer's cache as vLLM makes it: logically [B, H, N, 2 * D], stored in ``physical_order``
    of those axes (LBNHC: (0, 2, 1, 3); LBHNC: (0, 1, 2, 3)), filled with garbage."""
    logical = (num_blocks, num_kv_heads, block_size, 2 * head_size)
    storage = torch.randn([logical[axis] for axis in physical_order]).to(dtype)
    return storage.permute([physical_order.index(axis) for axis in range(4)])


@pytest.mark.parametrize("layout", [(0, 2, 1, 3), (0, 1, 2, 3)], ids=["LBNHC", "LBHNC"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_impl_writes_and_reads_vllm_cache_in_place(layout, kv_cache_dtype):
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_size, block_size, num_blocks = 6, 2, 32, 8, 12
    k_scale, v_scale = (0.5, 0.25) if kv_cache_dtype == "fp8" else (1.0, 1.0)
    storage_dtype = torch.uint8 if kv_cache_dtype == "fp8" else torch.float32
    kv_cache = _vllm_cache(num_blocks, num_kv_heads, block_size, head_size, torch.float32, layout)
    if kv_cache_dtype == "fp8":  # bytes of finite fp8 values, as a uint8 cache holds them
        kv_cache = (kv_cache.clamp(-4, 4).to(torch.float8_e4m3fn).view(torch.uint8))
    assert kv_cache.dtype == storage_dtype
    before = kv_cache.clone()
    # two sequences: 5 cached tokens + a chunk of 7 new ones; 10 cached + 1 new (a decode)
    q_lens, kv_lens = [7, 1], [12, 11]
    block_table = torch.tensor([[3, 7, 0], [9, 1, 5]], dtype=torch.int32)
    slots = [int(block_table[s, p // block_size]) * block_size + p % block_size
             for s in range(2) for p in range(kv_lens[s] - q_lens[s], kv_lens[s])]
    metadata = plugin.TorchKernelsAttentionMetadata(
        num_actual_tokens=8, cu_q_lens=torch.tensor([0, 7, 8], dtype=torch.int32),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32), block_table=block_table,
        slot_mapping=torch.tensor(slots))
    tokens = 10  # two padding rows past num_actual_tokens
    query = torch.randn(tokens, num_heads, head_size)
    key, value = torch.randn(tokens, num_kv_heads, head_size), torch.randn(tokens, num_kv_heads, head_size)
    output = torch.full((tokens, num_heads, head_size), 7.0)
    with set_current_vllm_config(VllmConfig()):
        impl = plugin.TorchKernelsAttentionImpl(num_heads, head_size, head_size ** -0.5, num_kv_heads,
                                                kv_cache_dtype=kv_cache_dtype, sliding_window=6, logits_soft_cap=3.0)
    impl.forward(_Layer(k_scale, v_scale), query, key, value, kv_cache, metadata, output)

    # the expected result on plain float32 copies in the ops' layout, by the readable definition
    def plain(half: slice, scale: float) -> torch.Tensor:
        pages = before.view(torch.float8_e4m3fn) if kv_cache_dtype == "fp8" else before
        return (pages.permute(0, 2, 1, 3)[..., half].float() * scale).contiguous()

    key_cache, value_cache = plain(slice(0, head_size), k_scale), plain(slice(head_size, None), v_scale)
    stored_key, stored_value = key[:8], value[:8]
    if kv_cache_dtype == "fp8":  # what an fp8 cache gives back
        stored_key = (key[:8] / k_scale).to(torch.float8_e4m3fn).float() * k_scale
        stored_value = (value[:8] / v_scale).to(torch.float8_e4m3fn).float() * v_scale
    expected = ragged_paged_attention_naive(
        query[:8], key_cache, value_cache, metadata.cu_q_lens, metadata.kv_lens, block_table, head_size ** -0.5,
        sliding_window=6, soft_cap=3.0, key=stored_key, value=stored_value, slot_mapping=metadata.slot_mapping)
    torch.testing.assert_close(output[:8], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(output[8:], torch.full((2, num_heads, head_size), 7.0))  # padding rows untouched
    assert impl.calls == 1

    # the new tokens landed in vLLM's own tensor: keys in the first D of the last dimension, values in
    # the second, at [block, kv head, offset]; every other entry kept its bytes
    expected_cache = before.clone()
    for token, slot in enumerate(slots):
        block, offset = divmod(slot, block_size)
        for half, new, scale in ((slice(0, head_size), key, k_scale), (slice(head_size, None), value, v_scale)):
            entry = new[token] / scale
            if kv_cache_dtype == "fp8":
                entry = entry.to(torch.float8_e4m3fn).view(torch.uint8)
            expected_cache[block, :, offset, half] = entry
    assert torch.equal(kv_cache, expected_cache)
    assert math.isclose(impl.scale, head_size ** -0.5)


def test_mla_models_keep_chunked_prefill_and_prefix_caching():
    class Platform:  # turns them off for MLA models, as vLLM's CPU platform does for its reference backend
        @classmethod
        def check_and_update_config(cls, vllm_config):
            vllm_config.scheduler_config.enable_chunked_prefill = False
            vllm_config.scheduler_config.max_num_batched_tokens = 2048
            vllm_config.cache_config.enable_prefix_caching = False
            vllm_config.cache_config.block_size = 16

    plugin._keep_mla_scheduling(Platform)
    plugin._keep_mla_scheduling(Platform)  # once is enough
    for use_mla in (True, False):
        config = SimpleNamespace(
            scheduler_config=SimpleNamespace(enable_chunked_prefill=True, max_num_batched_tokens=64),
            cache_config=SimpleNamespace(enable_prefix_caching=True, block_size=32),
            model_config=SimpleNamespace(use_mla=use_mla))
        Platform.check_and_update_config(config)
        kept = (config.scheduler_config.enable_chunked_prefill, config.scheduler_config.max_num_batched_tokens,
                config.cache_config.enable_prefix_caching)
        assert kept == ((True, 64, True) if use_mla else (False, 2048, False))
        assert config.cache_config.block_size == 16  # the rest of the platform's decisions stand


LATENT, ROPE = 32, 16


def _mla_impl(**kwargs):
    args = dict(num_heads=4, head_size=LATENT + ROPE, scale=0.2, num_kv_heads=1, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                kv_sharing_target_layer_name=None, q_lora_rank=None, kv_lora_rank=LATENT, qk_nope_head_dim=8,
                qk_rope_head_dim=ROPE, qk_head_dim=8 + ROPE, v_head_dim=8, kv_b_proj=None)
    with set_current_vllm_config(VllmConfig()):
        return plugin.TorchKernelsMLAImpl(**{**args, **kwargs})


@pytest.mark.parametrize("kwargs, reason", [
    ({"indexer": object()}, "sparse MLA"),
    ({"sliding_window": 64}, "sliding window"),
    ({"kv_sharing_target_layer_name": "model.layers.0.self_attn"}, "KV sharing"),
    ({"kv_cache_dtype": "bfloat16"}, "a bfloat16 KV cache with a torch.float32 model"),
    ({"head_size": LATENT}, "a latent cache of another width"),
])
def test_mla_impl_refuses_what_it_does_not_support(kwargs, reason):
    with pytest.raises(NotImplementedError, match=f"TORCH_KERNELS_MLA attention cannot run this layer: .*{reason}"):
        _mla_impl(**kwargs)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_mla_impl_writes_and_reads_vllm_latent_cache_in_place(kv_cache_dtype):
    """The two calls vLLM's MLA layer makes per step (the latent write, then the absorbed
    attention) on a latent cache shaped as vLLM binds it, against a loop over queries and positions."""
    torch.manual_seed(0)
    num_heads, block_size, num_blocks, scale = 4, 8, 12, 0.2
    k_scale = 0.5 if kv_cache_dtype == "fp8" else 1.0
    kv_cache = torch.randn(num_blocks, block_size, LATENT + ROPE)
    if kv_cache_dtype == "fp8":  # bytes of finite fp8 values, as vLLM's uint8 cache holds them
        kv_cache = kv_cache.clamp(-4, 4).to(torch.float8_e4m3fn).view(torch.uint8)
    before = kv_cache.clone()
    q_lens, kv_lens = [7, 1], [12, 11]  # a prefill chunk after 5 cached tokens; a decode after 10
    block_table = torch.tensor([[3, 7, 0], [9, 1, 5]], dtype=torch.int32)
    slots = [int(block_table[s, p // block_size]) * block_size + p % block_size
             for s in range(2) for p in range(kv_lens[s] - q_lens[s], kv_lens[s])]
    metadata = plugin.TorchKernelsMLAMetadata(
        num_actual_tokens=8, cu_q_lens=torch.tensor([0, 7, 8], dtype=torch.int32),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32), block_table=block_table, slot_mapping=torch.tensor(slots),
        num_decodes=2, num_decode_tokens=8)
    assert metadata.decode is metadata and metadata.prefill is None and metadata.num_prefills == 0
    kv_c, k_pe = torch.randn(10, LATENT), torch.randn(10, 1, ROPE)  # two padding rows past the slots
    q_nope, q_pe = torch.randn(8, num_heads, LATENT), torch.randn(8, num_heads, ROPE)
    impl = _mla_impl(kv_cache_dtype=kv_cache_dtype, scale=scale)
    layer = SimpleNamespace(_k_scale=torch.tensor(k_scale))
    impl.do_kv_cache_update(kv_c, k_pe, kv_cache, metadata.slot_mapping, kv_cache_dtype, layer._k_scale)
    # the layer hands fp8 caches to the attention call viewed as the platform's fp8 dtype
    read_view = kv_cache.view(torch.float8_e4m3fn) if kv_cache_dtype == "fp8" else kv_cache
    out, lse = impl.forward_mqa((q_nope, q_pe), read_view, metadata, layer)
    assert lse is None and impl.calls == 1

    # the new rows landed in vLLM's own tensor at [block, offset]; every other entry kept its bytes
    expected_cache = before.clone()
    for token, slot in enumerate(slots):
        row = torch.cat([kv_c[token], k_pe[token, 0]]) / k_scale
        if kv_cache_dtype == "fp8":
            row = row.to(torch.float8_e4m3fn).view(torch.uint8)
        expected_cache[slot // block_size, slot % block_size] = row
    assert torch.equal(kv_cache, expected_cache)

    # attention by its definition: logits q_nope . c + q_pe . k_pe, causal, values the latents c
    rows = (expected_cache.view(torch.float8_e4m3fn) if kv_cache_dtype == "fp8" else expected_cache).float() * k_scale
    expected = torch.zeros(8, num_heads, LATENT)
    token = 0
    for s in range(2):
        for i in range(q_lens[s]):
            positions = range(kv_lens[s] - q_lens[s] + i + 1)
            cached = torch.stack([rows[int(block_table[s, p // block_size]), p % block_size] for p in positions])
            c, pe = cached[:, :LATENT], cached[:, LATENT:]
            weights = ((q_nope[token] @ c.T + q_pe[token] @ pe.T) * scale).softmax(-1)
            expected[token] = weights @ c
            token += 1
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# ---- CUDA graphs: the builders' declared support and their persistent buffers ----

BUILDERS = [plugin.TorchKernelsAttentionMetadataBuilder, plugin.TorchKernelsMLAMetadataBuilder]
GRAPH_BLOCK_SIZE = 8


def _builder(builder_cls, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=64):
    """A builder as vLLM makes one per KV-cache group, on a config of the fields it reads."""
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
        model_config=SimpleNamespace(max_model_len=max_model_len), device_config=SimpleNamespace(device="cpu"))
    spec = FullAttentionSpec(block_size=GRAPH_BLOCK_SIZE, num_kv_heads=2, head_size=32, dtype=torch.float32)
    return builder_cls(spec, ["model.layers.0.self_attn.attn"], config, torch.device("cpu")), config, spec


def _vllm_batch(q_lens, kv_lens, block_table, num_actual_tokens=None, slots=None, max_seq_len=None):
    """vLLM's description of a step as its model runner fills it: views of its persistent buffers.
    Under a full CUDA graph vLLM pads the tokens to the captured count (``num_actual_tokens``, the
    padded rows' slots -1) and adds padding requests (no query tokens, length 0, block table rows of
    the null block 0); ``query_start_loc`` ends at the real tokens."""
    offsets = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    real = int(offsets[-1])
    rows = num_actual_tokens or real
    slot_mapping = torch.full((rows,), -1, dtype=torch.int64)
    if slots is not None:
        slot_mapping[:real] = torch.tensor(slots)
    return CommonAttentionMetadata(
        query_start_loc=offsets, query_start_loc_cpu=offsets.clone(), seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        num_reqs=len(q_lens), num_actual_tokens=rows, max_query_len=max(q_lens),
        max_seq_len=max_seq_len or max(kv_lens), block_table_tensor=torch.tensor(block_table, dtype=torch.int32),
        slot_mapping=slot_mapping)


@pytest.mark.parametrize("builder_cls", BUILDERS, ids=["attention", "mla"])
def test_builders_declare_cudagraph_support(builder_cls):
    """ALWAYS (full graphs of mixed batches) in the deferred check mode, the default on accelerators;
    NEVER in the full mode, whose host reads a graph cannot hold."""
    assert builder_cls._cudagraph_support is AttentionCGSupport.ALWAYS
    _, config, spec = _builder(builder_cls)
    with torch_kernels.checks("deferred"):
        assert builder_cls.get_cudagraph_support(config, spec) is AttentionCGSupport.ALWAYS
    with torch_kernels.checks("full"):
        assert builder_cls.get_cudagraph_support(config, spec) is AttentionCGSupport.NEVER


@pytest.mark.parametrize("builder_cls", BUILDERS, ids=["attention", "mla"])
def test_builder_metadata_lives_in_persistent_buffers(builder_cls):
    """Every build, capture included, hands out views of the same buffers (a captured graph reads
    later steps' metadata from them), filled with the step's batch; the slots stay vLLM's tensor."""
    builder, _, _ = _builder(builder_cls)
    # a mixed step: a prefill chunk after 5 cached tokens, a decode after 10; the rows of padding
    # requests in vLLM's block table are the null block 0
    mixed = _vllm_batch([7, 1], [12, 11], [[3, 7, 0, 0, 0, 0, 0, 0], [9, 1, 5, 0, 0, 0, 0, 0]])
    # a full graph's step: two decodes and two padding requests, the tokens padded from 2 to 5
    padded = _vllm_batch([1, 1, 0, 0], [20, 3, 0, 0],
                         [[4, 2, 6, 0, 0, 0, 0, 0], [8, 0, 0, 0, 0, 0, 0, 0]] + [[0] * 8] * 2, num_actual_tokens=5)
    captured = builder.build_for_cudagraph_capture(padded)
    fields = ("cu_q_lens", "kv_lens", "block_table")
    pointers = {name: getattr(captured, name).data_ptr() for name in fields}
    # a graph captured over the padded step; each capture sequence's kv length cut to its query length
    assert captured.cu_q_lens.tolist() == [0, 1, 2, 2, 2, 5] and captured.kv_lens.tolist() == [1, 1, 0, 0, 3]
    for batch in (mixed, padded):
        metadata = builder.build(0, batch)
        assert {name: getattr(metadata, name).data_ptr() for name in fields} == pointers
        assert metadata.slot_mapping.data_ptr() == batch.slot_mapping.data_ptr()
        assert metadata.block_table.is_contiguous()  # the op makes no copy of it
        n = batch.num_reqs
        # vLLM's requests, then a sequence holding the rows past vLLM's last offset (none: empty)
        assert metadata.num_actual_tokens == batch.num_actual_tokens
        assert metadata.cu_q_lens.tolist() == [*batch.query_start_loc.tolist(), batch.num_actual_tokens]
        padding_rows = batch.num_actual_tokens - int(batch.query_start_loc[-1])
        assert metadata.kv_lens.tolist() == [*batch.seq_lens.tolist(), padding_rows]
        pages = -(-batch.max_seq_len // GRAPH_BLOCK_SIZE)
        assert torch.equal(metadata.block_table[:n, :pages], batch.block_table_tensor[:, :pages])
        assert not metadata.block_table[n, :-(-padding_rows // GRAPH_BLOCK_SIZE)].any()  # the null block
    assert builder.build(0, mixed).kv_lens.tolist() == [12, 11, 0]
    assert builder.build(0, padded).kv_lens.tolist() == [20, 3, 0, 0, 3]


@pytest.mark.parametrize("mode", ["full", "deferred"])
def test_impl_runs_a_full_graph_padded_step(mode):
    """A step as a full CUDA graph replays it (tokens padded, padding requests) gives the real rows
    the unpadded step's output, in both check modes (the deferred checks record nothing: the
    padding is a legal batch), and writes only the real tokens into the cache."""
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_size, num_blocks = 4, 2, 32, 12
    builder, _, _ = _builder(plugin.TorchKernelsAttentionMetadataBuilder)
    table = [[3, 7, 0, 0, 0, 0, 0, 0], [9, 1, 5, 0, 0, 0, 0, 0]]
    slots = [int(table[s][p // GRAPH_BLOCK_SIZE]) * GRAPH_BLOCK_SIZE + p % GRAPH_BLOCK_SIZE
             for s, (q, kv) in enumerate([(7, 12), (1, 11)]) for p in range(kv - q, kv)]
    real = _vllm_batch([7, 1], [12, 11], table, slots=slots)
    padded = _vllm_batch([7, 1, 0], [12, 11, 0], table + [[0] * 8], num_actual_tokens=12, slots=slots)
    query = torch.randn(12, num_heads, head_size)
    key, value = torch.randn(12, num_kv_heads, head_size), torch.randn(12, num_kv_heads, head_size)
    cache = _vllm_cache(num_blocks, num_kv_heads, GRAPH_BLOCK_SIZE, head_size, torch.float32, (0, 2, 1, 3))
    with set_current_vllm_config(VllmConfig()):
        impl = plugin.TorchKernelsAttentionImpl(num_heads, head_size, head_size ** -0.5, num_kv_heads)
    layer = _Layer(1.0, 1.0)
    expected, expected_cache = torch.zeros(8, num_heads, head_size), cache.clone()
    impl.forward(layer, query[:8], key[:8], value[:8], expected_cache, builder.build(0, real), expected)
    output = torch.full((12, num_heads, head_size), 7.0)
    with torch_kernels.checks(mode):
        impl.forward(layer, query, key, value, cache, builder.build(0, padded), output)
        torch_kernels.raise_deferred_errors()
    torch.testing.assert_close(output[:8], expected, rtol=0, atol=0)
    assert torch.equal(cache, expected_cache)

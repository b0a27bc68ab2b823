"""transformers' multi-head latent attention layers on the mla ops, in the latent space.

transformers' MLA layers (DeepSeek-V3, DeepSeek-V3.2, Kimi Linear) cache the compressed latent
``c`` and the shared RoPE key ``k_pe`` per token, then expand every cached token to per-head keys
and values through ``kv_b_proj`` at each call. The forwards here keep attention in the latent
space instead (DeepSeek-V3's absorbed form): ``kv_b_proj``'s weight is ``[W_UK; W_UV]`` per head,
the query's no-RoPE part becomes ``q_nope W_UK`` (``[T, H, Lr]``), :func:`ragged_paged_mla` attends
over the latents written by :func:`mla_reshape_and_cache`, and ``W_UV`` is applied to its output.
DeepSeek-V3.2's indexer picks each query's positions with :func:`indexer_topk`.

The model's own cache stays the record of the past (the layer still calls ``cache.update``); each
call writes the latents of every batch row into a paged latent cache, one row a sequence. A call
the ops do not describe (a padding or packing mask, gradients, attention dropout, a static cache's
mask over unwritten rows) runs the layer's own forward before anything is written, so such
models keep working and stay exact.

``TRANSFORMERS_LAYERS`` (declared by the family in ``torch_kernels.ops.mla``) maps each layer class
to its forward; ``torch_kernels.integrations.transformers.kernelize`` installs them per instance.
Each forward is called as ``forward(module, original, implementation, *args, **kwargs)``, with
``original`` the class's own forward, lists the ops it runs in ``forward.ops``, and says in
``forward.unsupported(module)`` why a layer instance cannot take it (None: it can).
"""

from __future__ import annotations

import math
import sys

import torch

from . import mla as ops

BLOCK_SIZE = 16  # pages of the per-call latent cache


def plain_causal(mask: torch.Tensor | None) -> bool:
    """Whether ``mask`` (transformers' 4D ``[B, 1, T, S]``: bool, True attends, or additive, 0 attends)
    lets each of the ``T`` queries see exactly the keys up to its own position, the last ``T`` of
    ``S`` (None: transformers left the causal mask to the attention)."""
    if mask is None:
        return True
    if mask.dim() != 4:
        return False
    q_len, kv_len = mask.shape[-2:]
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril(kv_len - q_len)
    if mask.dtype == torch.bool:
        return bool((mask == causal).all())
    # additive: 0 where seen, the dtype's min (or -inf) elsewhere; any other bias is not causal only
    hidden = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
    return bool(torch.where(causal, mask == 0, hidden).all())


def _latent_path(module, hidden_states, attention_mask, kwargs) -> bool:
    """Whether this call is one the ops describe (else the layer's own forward runs)."""
    if torch.is_grad_enabled() and (hidden_states.requires_grad or any(p.requires_grad for p in module.parameters())):
        return False  # the ops are inference-only
    if module.training and module.attention_dropout > 0:
        return False
    if kwargs.get("cu_seq_lens_q") is not None:
        return False  # packed rows: the mask (or the flash kwargs) describe them, not plain causality
    return plain_causal(attention_mask)


def _queries(module, hidden_states):
    """``(q_nope [B, H, T, dn], q_pe [B, H, T, R])``, as the layer projects them (RoPE not applied)."""
    batch, length = hidden_states.shape[:2]
    if getattr(module, "q_lora_rank", None) is None:
        q = module.q_proj(hidden_states)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q = q.view(batch, length, -1, module.qk_head_dim).transpose(1, 2)
    return q.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)


def _latents(module, hidden_states):
    """``(c [B, 1, T, Lr]`` normed, ``k_pe [B, 1, T, R])`` (RoPE not applied), the cache's entries."""
    batch, length = hidden_states.shape[:2]
    c, k_pe = module.kv_a_proj_with_mqa(hidden_states).split([module.kv_lora_rank, module.qk_rope_head_dim], dim=-1)
    return (module.kv_a_layernorm(c).view(batch, 1, length, module.kv_lora_rank),
            k_pe.view(batch, 1, length, module.qk_rope_head_dim))


def _batch(batch: int, q_len: int, kv_len: int, device):
    """``(cu_q_lens, kv_lens, block_table)`` of ``batch`` sequences of ``q_len`` queries over
    ``kv_len`` positions, sequence ``b`` on pages ``b * nb ... (b + 1) * nb - 1``."""
    per_row = math.ceil(kv_len / BLOCK_SIZE)
    cu_q_lens = torch.arange(batch + 1, dtype=torch.int32, device=device) * q_len
    kv_lens = torch.full((batch,), kv_len, dtype=torch.int32, device=device)
    return cu_q_lens, kv_lens, torch.arange(batch * per_row, dtype=torch.int32, device=device).view(batch, per_row)


def _paged(rows: torch.Tensor, written: int = 0) -> torch.Tensor:
    """``rows [B, S, W]`` in pages as :func:`_batch` addresses them, all but the last ``written``
    positions of each sequence (left to the cache write)."""
    batch, length, width = rows.shape
    per_row = math.ceil(length / BLOCK_SIZE)
    cache = rows.new_zeros(batch * per_row, BLOCK_SIZE, width)
    cache.view(batch, per_row * BLOCK_SIZE, width)[:, :length - written] = rows[:, :length - written]
    return cache


def latent_attention(module, q_nope, q_pe, c, k_pe, implementation, topk_indices=None) -> torch.Tensor:
    """The layer's attention output after ``o_proj``, ``[B, T, hidden]``, from ``q_nope``/``q_pe``
    ``[B, H, T, dn / R]`` (RoPE applied) and every cached position's ``c [B, 1, S, Lr]`` and
    ``k_pe [B, 1, S, R]``, causal (query ``i`` sees positions ``<= S - T + i``)."""
    batch, heads, q_len, nope = q_nope.shape
    kv_len, latent = c.shape[2:]
    weight = module.kv_b_proj.weight.view(heads, nope + module.v_head_dim, latent)
    w_uk, w_uv = weight[:, :nope], weight[:, nope:]
    q_latent = torch.einsum("bhtd,hdl->bthl", q_nope, w_uk).reshape(batch * q_len, heads, latent)
    q_rope = q_pe.transpose(1, 2).reshape(batch * q_len, heads, -1)
    cu_q_lens, kv_lens, table = _batch(batch, q_len, kv_len, c.device)
    # the positions cached before this call are copied in; this call's own go through the cache write
    c, k_pe = c[:, 0], k_pe[:, 0]
    cache = _paged(torch.cat([c, k_pe], dim=-1), written=q_len)
    new = slice(kv_len - q_len, kv_len)
    slots = table.long()[:, :1] * BLOCK_SIZE + torch.arange(new.start, new.stop, device=c.device)
    ops.mla_reshape_and_cache(c[:, new].reshape(batch * q_len, latent), k_pe[:, new].reshape(batch * q_len, -1),
                              cache, slots.flatten(), implementation=implementation)
    out = ops.ragged_paged_mla(q_latent, q_rope, cache, cu_q_lens, kv_lens, table, module.scaling,
                               topk_indices=topk_indices, implementation=implementation)
    out = torch.einsum("thl,hvl->thv", out, w_uv).reshape(batch, q_len, heads * module.v_head_dim)
    return module.o_proj(out)


def _cached(module, cache, c, k_pe, attention_mask, kwargs):
    """Every position's ``(c, k_pe)``: this call's through the model's cache, as the layer does."""
    if cache is not None:
        c, k_pe = cache.update(c, k_pe, module.layer_idx, kwargs=kwargs)
    if attention_mask is not None and attention_mask.shape[-1] != c.shape[2]:
        # the mask was checked causal over its own width before the cache was touched
        raise RuntimeError(f"the attention mask covers {attention_mask.shape[-1]} positions, the cache "
                           f"{c.shape[2]}: the latent path cannot tell which are real")
    return c, k_pe


def _modeling(original):
    """The modeling module of the layer's class (its RoPE functions)."""
    return sys.modules[original.__module__]


def deepseek_v3_attention(module, original, implementation, hidden_states, position_embeddings=None,
                          attention_mask=None, cache=None, **kwargs):
    """``DeepseekV3Attention.forward`` in the latent space (``(out, None)``: no attention weights)."""
    if not _latent_path(module, hidden_states, attention_mask, kwargs):
        return original(module, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    q_nope, q_pe = _queries(module, hidden_states)
    c, k_pe = _latents(module, hidden_states)
    modeling = _modeling(original)
    rope = modeling.apply_rotary_pos_emb_interleave if module.config.rope_interleave else modeling.apply_rotary_pos_emb
    q_pe, k_pe = rope(q_pe, k_pe, *position_embeddings)
    c, k_pe = _cached(module, cache, c, k_pe, attention_mask, kwargs)
    return latent_attention(module, q_nope, q_pe, c, k_pe, implementation), None


def kimi_linear_attention(module, original, implementation, hidden_states, attention_mask=None, cache=None, **kwargs):
    """``KimiLinearAttention.forward`` (MLA without RoPE: the shared key part is not rotated) in the
    latent space."""
    if not _latent_path(module, hidden_states, attention_mask, kwargs):
        return original(module, hidden_states, attention_mask, cache=cache, **kwargs)
    q_nope, q_pe = _queries(module, hidden_states)
    c, k_pe = _latents(module, hidden_states)
    c, k_pe = _cached(module, cache, c, k_pe, attention_mask, kwargs)
    return latent_attention(module, q_nope, q_pe, c, k_pe, implementation), None


def _indexer_topk(indexer, hidden_states, q_resid, position_embeddings, cache, kv_len, implementation, modeling):
    """DeepSeek-V3.2's indexer selection through :func:`indexer_topk`: its queries and keys as its
    forward projects them (half-split RoPE on the first R dims), the keys through the cache's
    indexer store, the per-head weights with both of its scales folded in. Returns int32 ``[B*T, k]``."""
    batch, length = hidden_states.shape[:2]
    rope = indexer.qk_rope_head_dim
    q = indexer.wq_b(q_resid).view(batch, length, indexer.n_heads, indexer.head_dim)
    k = indexer.k_norm(indexer.wk(hidden_states)).unsqueeze(2)
    q_rot, k_rot = modeling.apply_rotary_pos_emb(q[..., :rope], k[..., :rope], *position_embeddings, unsqueeze_dim=2)
    q = torch.cat([q_rot, q[..., rope:]], dim=-1)
    k = torch.cat([k_rot, k[..., rope:]], dim=-1).squeeze(2)
    if cache is not None:
        k = cache.update_indexer(k, indexer.layer_idx)
    if k.shape[1] != kv_len:
        raise RuntimeError(f"the indexer's cache holds {k.shape[1]} positions, the latent cache {kv_len}")
    weights = indexer.weights_proj(hidden_states.to(indexer.weights_proj.weight.dtype)).float()
    weights = weights * (indexer.n_heads ** -0.5 * indexer.softmax_scale)
    cu_q_lens, kv_lens, table = _batch(batch, length, kv_len, k.device)
    return ops.indexer_topk(q.reshape(batch * length, indexer.n_heads, -1), _paged(k),
                            weights.reshape(batch * length, -1), cu_q_lens, kv_lens, table,
                            min(indexer.index_topk, kv_len), implementation=implementation)


def deepseek_v32_attention(module, original, implementation, hidden_states, position_embeddings=None,
                           attention_mask=None, cache=None, position_ids=None, **kwargs):
    """``DeepseekV32Attention.forward``: the indexer's top-k through :func:`indexer_topk`, then
    sparse latent attention over the selected positions (``topk_indices``)."""
    if not _latent_path(module, hidden_states, attention_mask, kwargs):
        return original(module, hidden_states, position_embeddings, attention_mask, cache=cache,
                        position_ids=position_ids, **kwargs)
    batch, length = hidden_states.shape[:2]
    q_resid = module.q_a_layernorm(module.q_a_proj(hidden_states))
    q = module.q_b_proj(q_resid).view(batch, length, -1, module.qk_head_dim).transpose(1, 2)
    q_nope, q_pe = q.split([module.qk_nope_head_dim, module.qk_rope_head_dim], dim=-1)
    c, k_pe = _latents(module, hidden_states)
    modeling = _modeling(original)
    q_pe, k_pe = modeling.apply_rotary_pos_emb_interleave(q_pe, k_pe, *position_embeddings)
    c, k_pe = _cached(module, cache, c, k_pe, attention_mask, kwargs)
    topk = _indexer_topk(module.indexer, hidden_states, q_resid, position_embeddings, cache, c.shape[2],
                         implementation, modeling)
    return latent_attention(module, q_nope, q_pe, c, k_pe, implementation, topk_indices=topk), None


def unsupported(module) -> str | None:
    """Why ``module``'s weights cannot be absorbed (None if they can): ``kv_b_proj`` must be a plain
    ``Linear`` (a quantized checkpoint's layer holds no float matrix to split into W_UK and W_UV)."""
    if type(module.kv_b_proj) is not torch.nn.Linear or module.kv_b_proj.bias is not None:
        return (f"kv_b_proj is a {type(module.kv_b_proj).__name__} (with bias: {module.kv_b_proj.bias is not None}), "
                f"not a plain bias-free Linear whose weight splits into W_UK and W_UV")
    return None


deepseek_v3_attention.ops = kimi_linear_attention.ops = (ops.ragged_paged_mla, ops.mla_reshape_and_cache)
deepseek_v32_attention.ops = (ops.ragged_paged_mla, ops.mla_reshape_and_cache, ops.indexer_topk)
for _forward in (deepseek_v3_attention, kimi_linear_attention, deepseek_v32_attention):
    _forward.unsupported = unsupported

_MODELS = "transformers.models."
TRANSFORMERS_LAYERS = {
    _MODELS + "deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention": deepseek_v3_attention,
    _MODELS + "deepseek_v32.modeling_deepseek_v32.DeepseekV32Attention": deepseek_v32_attention,
    _MODELS + "kimi_linear.modeling_kimi_linear.KimiLinearAttention": kimi_linear_attention,
}

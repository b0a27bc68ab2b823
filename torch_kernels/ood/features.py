"""Pooled hidden states of a transformers model: the frozen features the OOD scorers fit and score.

>>> features = extract_features(model, tokenizer, ["book a flight to Paris", ...], layer=15, pooling="mean")

``layer`` indexes the hidden states as transformers returns them with ``output_hidden_states=True``:
``0`` is the embedding output (the first layer's input), ``i`` the output of layer ``i`` (the input
of layer ``i + 1``), and the last, ``num_hidden_layers`` or ``-1``, the model's
``last_hidden_state`` (after the final norm in a causal LM). The forward stops at the requested
layer, so an early layer costs only the layers before it. Several layers (``layer=[2, 8, 30]``)
come from one forward pass, as ``[N, len(layer), hidden]``.

``skip_first`` / ``skip_last`` leave positions at either end out of the pooling: ``skip_first=1``
the first token, whose states are the attention sink's few huge activations; a chat template's
shared prefix and suffix (:func:`torch_kernels.ood.recipes.shared_span` counts them), which are
the same in every prompt and only dilute what the question itself does to the states. For a
causal LM, a prefix that every text shares and the pooling skips runs once, its keys and values
reused for every batch (its states cannot depend on the tokens after it), which makes
chat-templated prompts several times cheaper to extract.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import numbers
import os
import pathlib
from typing import Sequence

import torch
from torch import nn

__all__ = ["extract_features", "POOLINGS", "normalize_layer", "normalize_layers", "pool_span"]

POOLINGS = ("mean", "last")


def normalize_layer(layer, num_layers: int) -> int:
    """``layer`` as an index in ``0..num_layers`` (negative counts from the end), checked."""
    if not isinstance(layer, numbers.Integral) or isinstance(layer, bool):
        raise TypeError(f"layer: expected an int, got {type(layer).__name__} {layer!r}")
    if not -(num_layers + 1) <= layer <= num_layers:
        raise ValueError(f"layer: expected an index in [{-(num_layers + 1)}, {num_layers}] (the model has "
                         f"{num_layers} layers, so {num_layers + 1} hidden states), got {layer}")
    return int(layer) % (num_layers + 1)


def normalize_layers(layer, num_layers: int) -> tuple[int, ...]:
    """``layer`` (an int or a non-empty sequence of ints) as a tuple of indices in ``0..num_layers``."""
    if isinstance(layer, Sequence) and not isinstance(layer, (str, bytes)):
        if not layer:
            raise ValueError("layer: expected an int or a non-empty sequence of ints, got an empty sequence")
        return tuple(normalize_layer(i, num_layers) for i in layer)
    return (normalize_layer(layer, num_layers),)


def pool_span(length: int, skip_first: int, skip_last: int, name: str = "texts") -> tuple[int, int]:
    """``(start, stop)``: the positions of a ``length``-token text that are pooled; a ValueError
    naming ``name`` when none is left."""
    start, stop = skip_first, length - skip_last
    if stop <= start:
        raise ValueError(f"{name}: expected more than skip_first + skip_last = {skip_first + skip_last} tokens "
                         f"(positions to pool), got {length}")
    return start, stop


def check_span(skip_first, skip_last) -> None:
    """``skip_first`` and ``skip_last`` as ints >= 0, else an error naming the bad one."""
    for name, n in (("skip_first", skip_first), ("skip_last", skip_last)):
        if not isinstance(n, numbers.Integral) or isinstance(n, bool):
            raise TypeError(f"{name}: expected an int, got {type(n).__name__} {n!r}")
        if n < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {n}")


def check_pooling(pooling) -> str:
    """``pooling`` if it is one of :data:`POOLINGS`, else a ValueError naming it."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling: expected one of {POOLINGS}, got {pooling!r}")
    return pooling


class _Stop(Exception):
    """Raised by the capture hook once the wanted layer's input is in hand: skips the rest."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


def _layer_list(model: nn.Module) -> nn.ModuleList:
    """The base model's stack of ``config.num_hidden_layers`` layers (Llama's ``layers``, BERT's ``encoder.layer``)."""
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    if num_layers is not None:
        for module in model.base_model.modules():
            if isinstance(module, nn.ModuleList) and len(module) == num_layers:
                return module
    raise TypeError(f"model: expected a transformers model with a list of config.num_hidden_layers layers, "
                    f"got {type(model).__name__}")


def _hidden_states(model: nn.Module, layers: nn.ModuleList, wanted: tuple[int, ...], input_ids,
                   attention_mask, **kwargs) -> list[torch.Tensor]:
    """``[B, T, hidden]`` at each index of ``wanted`` (in ``0..len(layers)``), from one forward pass
    that runs no layer past the last one wanted."""
    base = model.base_model
    captured = {}
    last = max(wanted)

    def capture(index):
        def hook(module, args, kwargs):
            captured[index] = args[0] if args else kwargs["hidden_states"]
            if index == last:
                raise _Stop(captured[index])
        return hook

    handles = [layers[i].register_forward_pre_hook(capture(i), with_kwargs=True) for i in set(wanted)
               if i < len(layers)]
    try:
        output = base(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        captured[len(layers)] = output.last_hidden_state
    except _Stop:
        pass
    finally:
        for handle in handles:
            handle.remove()
    missing = [i for i in wanted if i not in captured]
    if missing:
        raise RuntimeError(f"model: layers {missing} never ran")
    return [captured[i] for i in wanted]


def _reusable_prefix(model: nn.Module, ids: list[list[int]], skip_first: int) -> int:
    """How many leading tokens every text shares and the pooling skips, for a causal LM (0 for
    other models): their states depend on nothing after them, so they can run once."""
    can_generate = getattr(model, "can_generate", None)
    if not callable(can_generate) or not can_generate():
        return 0
    shared = 0
    while shared < skip_first and all(len(seq) > shared + 1 and seq[shared] == ids[0][shared] for seq in ids):
        shared += 1
    return shared


def _token_ids(tokenizer, texts) -> list[list[int]]:
    """Each text's token ids: strings through ``tokenizer`` (its special tokens added), token ids as given."""
    if isinstance(texts, (str, bytes, torch.Tensor)) or not isinstance(texts, Sequence):
        raise TypeError(f"texts: expected a list of strings or of token-id lists, got {type(texts).__name__}")
    if not texts:
        raise ValueError("texts: expected at least one text, got none")
    out = []
    for i, text in enumerate(texts):
        if isinstance(text, str):
            if tokenizer is None:
                raise TypeError(f"tokenizer: expected a tokenizer to encode texts[{i}] (a string), got None")
            ids = tokenizer(text)["input_ids"]
        elif isinstance(text, torch.Tensor):
            if text.dim() != 1 or text.is_floating_point() or text.is_complex() or text.dtype == torch.bool:
                raise TypeError(f"texts[{i}]: expected a 1-D integer tensor of token ids, got {text.dtype} "
                                f"of shape {tuple(text.shape)}")
            ids = text.tolist()
        elif isinstance(text, Sequence) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                for t in text):
            ids = [int(t) for t in text]
        else:
            raise TypeError(f"texts[{i}]: expected a string or a sequence of int token ids, got {type(text).__name__}")
        if not ids:
            raise ValueError(f"texts[{i}]: expected at least one token, got none")
        out.append(ids)
    return out


def _model_fingerprint(model: nn.Module) -> str:
    """What identifies a model's function: its class, config and a strided sample of every parameter."""
    digest = hashlib.sha256(type(model).__qualname__.encode())
    config = getattr(model, "config", None)
    if config is not None:
        digest.update(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 64)][:64].to(device="cpu", dtype=torch.float64)
        digest.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def _cache_path(cache_dir, model, layer, pooling: str, ids: list[list[int]], span=(0, 0)) -> pathlib.Path:
    key = f"{_model_fingerprint(model)}|layer={layer}|pooling={pooling}"
    if span != (0, 0):  # the key of an unskipped call is unchanged, so earlier caches stay valid
        key += f"|skip={span}"
    digest = hashlib.sha256(key.encode())
    for seq in ids:
        digest.update(torch.tensor(seq, dtype=torch.int64).numpy().tobytes())
        digest.update(b"|")
    return pathlib.Path(cache_dir) / f"features-{digest.hexdigest()[:32]}.pt"


@torch.no_grad()  # not inference_mode: the features must stay usable as inputs of a training fit
def extract_features(model: nn.Module, tokenizer, texts, layer: int | Sequence[int] = -1, pooling: str = "mean",
                     batch_size: int = 16, progress: bool = True, cache_dir=None, skip_first: int = 0,
                     skip_last: int = 0) -> torch.Tensor:
    """``[len(texts), hidden]`` float32: each text's hidden states at ``layer``, pooled over its tokens
    (``[len(texts), len(layer), hidden]`` for a sequence of layers, all from one forward pass).

    Args:
        model: a transformers model (a causal LM such as ``LlamaForCausalLM``, or an encoder such
            as ``BertModel``); its base model runs, never the language-model head.
        tokenizer: encodes the string entries of ``texts`` (special tokens added as the tokenizer
            does by default); may be ``None`` when every entry is already token ids.
        texts: strings, or token-id sequences (e.g. chat-templated prompts), or a mix.
        layer: which hidden state (see the module docstring), or a sequence of them; negative
            counts from the end.
        pooling: ``"mean"`` over the text's pooled positions or the ``"last"`` of them; padding
            never counts.
        batch_size: texts per forward pass; texts are batched by length (less padding) and padded
            on the right, so a causal LM's positions are those of the text alone.
        progress: a tqdm bar over the batches (if tqdm is installed).
        cache_dir: if given, the result is stored there under a hash of the model (class, config,
            a parameter sample), ``layer``, ``pooling`` and the token ids, and read back on a later
            call with the same content.
        skip_first, skip_last: positions left out of the pooling at the start and at the end of
            each text (see the module docstring); every text needs at least one left.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a transformers model (an nn.Module), got {type(model).__name__}")
    layers = _layer_list(model)
    several = isinstance(layer, Sequence) and not isinstance(layer, (str, bytes))
    wanted = normalize_layers(layer, len(layers))
    check_pooling(pooling)
    check_span(skip_first, skip_last)
    if not isinstance(batch_size, numbers.Integral) or isinstance(batch_size, bool):
        raise TypeError(f"batch_size: expected an int, got {type(batch_size).__name__} {batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size: expected an int >= 1, got {batch_size}")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir: expected a path or None, got {type(cache_dir).__name__}")
    ids = _token_ids(tokenizer, texts)
    spans = [pool_span(len(seq), skip_first, skip_last, f"texts[{i}]") for i, seq in enumerate(ids)]

    key_layer = list(wanted) if several else wanted[0]
    path = (_cache_path(cache_dir, model, key_layer, pooling, ids, (skip_first, skip_last))
            if cache_dir is not None else None)
    if path is not None and path.is_file():
        return torch.load(path)

    device = next(model.parameters()).device
    pad = getattr(tokenizer, "pad_token_id", None) or 0  # any id: padded positions are masked out
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = torch.empty(len(ids), len(wanted), model.config.hidden_size, dtype=torch.float32)
    starts = range(0, len(order), batch_size)
    try:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=f"features (layer {key_layer}, {pooling})", unit="batch", disable=not progress)
    except ImportError:
        pass
    # a shared prefix the pooling skips (a chat template's) runs once; its keys and values are reused
    reuse = _reusable_prefix(model, ids, skip_first)
    prefix_cache = None
    if reuse:
        # transformers 5 renamed the argument past_key_values to cache
        cache_arg = "cache" if "cache" in inspect.signature(model.base_model.forward).parameters else "past_key_values"
        output = model.base_model(input_ids=torch.tensor([ids[0][:reuse]], device=device), use_cache=True)
        prefix_cache = getattr(output, "past_key_values", None) or output.cache
    for start in starts:
        batch = order[start:start + batch_size]
        lengths = torch.tensor([len(ids[i]) - reuse for i in batch], device=device)
        width = int(lengths.max())
        input_ids = torch.tensor([ids[i][reuse:] + [pad] * (width - len(ids[i]) + reuse) for i in batch], device=device)
        positions = torch.arange(width, device=device)[None, :]
        mask = (positions < lengths[:, None]).long()
        first = torch.tensor([spans[i][0] - reuse for i in batch], device=device)[:, None]
        stop = torch.tensor([spans[i][1] - reuse for i in batch], device=device)
        pooled_mask = (positions >= first) & (positions < stop[:, None])
        extra = {}
        if reuse:
            past = copy.deepcopy(prefix_cache)
            past.batch_repeat_interleave(len(batch))
            mask = torch.cat([torch.ones(len(batch), reuse, dtype=mask.dtype, device=device), mask], dim=1)
            extra = {cache_arg: past, "use_cache": True}
        for k, hidden in enumerate(_hidden_states(model, layers, wanted, input_ids, mask, **extra)):
            hidden = hidden.float()
            if pooling == "mean":
                pooled = (hidden * pooled_mask[..., None]).sum(dim=1) / (stop - first[:, 0])[:, None]
            else:
                pooled = hidden[torch.arange(len(batch), device=device), stop - 1]
            out[batch, k] = pooled.cpu()
    if not several:
        out = out[:, 0]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(out, partial)
        os.replace(partial, path)  # atomic: a concurrent reader never sees half a file
    return out

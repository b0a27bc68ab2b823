"""transformers' plug-in points: every MoE layer through :func:`torch_kernels.fused_moe`, every
attention layer through :func:`torch_kernels.quantized_attention`.

>>> import torch_kernels.integrations.transformers  # registers both names
>>> model = AutoModelForCausalLM.from_pretrained(name, experts_implementation="torch_kernels")
>>> model.set_experts_implementation("torch_kernels")  # or on a loaded model
>>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="torch_kernels_quantized")

transformers' experts modules hold ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, the
layout ``fused_moe`` takes, and call the registered function with the tokens, the router's
``top_k_index`` and ``top_k_weights``. Experts this op does not describe (biases, transposed or
interleaved weights, no gate, a post-expert norm, a custom gate such as gpt-oss's, an activation
other than SiLU or GELU) run transformers' own ``grouped_mm`` path instead, so every model keeps
working; :func:`supports` says which path a module takes.

:func:`kernelize` does all of it for one model instance in one call, with the hub-named functions
of the linear-attention and state-space layers (Gated DeltaNet, causal conv1d, ...) too:

>>> with kernelize(model) as report:   # or report = kernelize(model); ...; report.undo()
...     model.generate(ids)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

import torch
from torch import nn

from .. import backends, families

from ..ops.moe import fused_moe
from ..ops.quantized_attention import check_options, quantized_attention, quantizing_pays
from ..transformers_experts import activation_of, supports, unsupported_reasons

NAME = "torch_kernels"
QUANTIZED_ATTENTION = "torch_kernels_quantized"
__all__ = ["NAME", "QUANTIZED_ATTENTION", "register", "supports", "unsupported_reasons", "experts_forward", "activation_of",
           "quantized_attention_forward", "hub_functions", "layer_forwards", "kernelize", "KernelizeReport"]


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, implementation: str | None = None) -> torch.Tensor:
    """The experts block of ``module`` through ``fused_moe`` (an ``ExpertsInterface`` function;
    ``implementation`` picks the backend, as in the ops)."""
    if not supports(module):
        from transformers.integrations import moe

        return moe.grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    out = fused_moe(hidden_states, module.gate_up_proj, module.down_proj, top_k_weights, top_k_index,
                    activation_of(module), implementation=implementation)
    return out.to(hidden_states.dtype)


def quantized_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                attention_mask: torch.Tensor | None, scaling: float | None = None,
                                dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: ``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, S, D]``
    -> ``(out [B, T, Hq, D], None)`` through :func:`~torch_kernels.quantized_attention`.

    Causal attention is aligned bottom-right, so prefill, chunked prefill over a cache and decoding
    all take the quantized path. A padding mask, dropout, a sliding window or a soft cap go to
    transformers' SDPA path instead (the op has none of them), and so do CPU tensors, where the
    quantized kernel is 5-6x slower than exact SDPA, unless the call passes ``force_quantized=True``
    or ``TORCH_KERNELS_FORCE_QUANTIZED=1`` is set (``generate()`` rejects the keyword; see
    ``torch_kernels.ops.quantized_attention.quantizing_pays``). ``granularity``, ``pv_dtype``,
    ``smooth_k``, ``smooth_q`` and ``force_quantized`` pass through the model's call as attention
    kwargs, e.g. ``model(input_ids, granularity="per_thread", pv_dtype="fp8")``; the options are
    checked on either path."""
    options = {name: kwargs.pop(name) for name in ("granularity", "pv_dtype", "smooth_k", "smooth_q")
               if name in kwargs}
    check_options(**options)
    plain = (attention_mask is None and (dropout == 0.0 or not module.training) and not kwargs.get("sliding_window")
             and not kwargs.get("softcap") and query.shape[-1] == key.shape[-1] == value.shape[-1])
    if not (quantizing_pays(query, kwargs.pop("force_quantized", False)) and plain):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    out = quantized_attention(query, key, value, causal=bool(getattr(module, "is_causal", True)), sm_scale=scaling,
                              **options)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``experts_forward`` as ``experts_implementation="torch_kernels"`` and
    ``quantized_attention_forward`` as ``attn_implementation="torch_kernels_quantized"`` (idempotent).

    The attention name takes SDPA's mask function, so a causal batch without padding gets no mask
    (the quantized path) and a padded batch gets SDPA's mask (and SDPA)."""
    from transformers import AttentionInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)
    AttentionInterface.register(QUANTIZED_ATTENTION, quantized_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(QUANTIZED_ATTENTION, sdpa_mask)


# ---- kernelize: one model instance's hub-named functions, experts and attention ----

# what a family declares: {transformers hub function name: its op}, the op taking the hub
# function's arguments (fla's, causal-conv1d's, mamba_ssm's names) and implementation=
HUB_DECLARATION = "TRANSFORMERS_HUB_FUNCTIONS"


def _merged(declaration: str) -> dict:
    """The families' ``declaration`` tables merged; a key declared by two families is a ValueError."""
    found = {}
    for family, table in families.declared(declaration).items():
        for name, value in table.items():
            if name in found:
                raise ValueError(f"{declaration}: {name!r} is declared by two families (the second: {family})")
            found[name] = value
    return found


def hub_functions() -> dict:
    """Every transformers hub function name some family serves, with its op: the families'
    ``TRANSFORMERS_HUB_FUNCTIONS`` tables (found through :mod:`torch_kernels.families`), merged."""
    return _merged(HUB_DECLARATION)


# what a family declares for whole layers: {"<transformers module>.<layer class>": forward}, the
# forward called as forward(module, original, implementation, *args, **kwargs) (original: the
# class's own forward, for calls the ops do not describe), listing its ops in forward.ops and,
# optionally, saying in forward.unsupported(module) why an instance cannot take it
LAYER_DECLARATION = "TRANSFORMERS_LAYERS"


def layer_forwards() -> dict:
    """Every transformers layer class (by ``module.ClassName``) some family runs on its ops, with
    the forward that does: the families' ``TRANSFORMERS_LAYERS`` tables, merged."""
    return _merged(LAYER_DECLARATION)


def _seq_idx(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """``[1, T]`` int32 sequence ids of packed sequences from their offsets ``[N + 1]``."""
    positions = torch.arange(length, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:-1].contiguous(), positions, right=True).to(torch.int32)[None]


def _packing(name: str, parameters: frozenset, args: tuple, kwargs: dict) -> dict:
    """``kwargs`` with the call's packed sequences in the form the op takes: the model's ``seq_idx``
    if it passes one and the op takes it; else ``cu_seqlens`` (from the model's ``cu_seq_lens_q``
    when it passes only that, as Kimi Linear does); else ``seq_idx`` ids from the offsets (Qwen3-Next
    passes its convolution only ``cu_seq_lens_q``; transformers packs sequences only without a
    cache, so the call's time axis is the packed row's). Packing the op cannot take raises rather
    than mixing sequences."""
    offsets = kwargs.get("cu_seqlens")
    offsets = offsets if offsets is not None else kwargs.get("cu_seq_lens_q")
    given = {key for key in ("cu_seqlens", "seq_idx", "cu_seq_lens_q") if kwargs.get(key) is not None}
    if not given or "seq_idx" in parameters and "seq_idx" in given:
        return kwargs  # the model's own ids where the op takes them (Mamba-2's form)
    if "cu_seqlens" in parameters and offsets is not None:
        return {**kwargs, "cu_seqlens": offsets}
    if "seq_idx" in parameters and offsets is not None:
        x = args[0] if args else kwargs["x"]
        if x.shape[0] != 1:
            raise ValueError(f"cu_seq_lens_q: packed sequences need batch 1, got {name} input {tuple(x.shape)}")
        return {**kwargs, "seq_idx": _seq_idx(offsets, x.shape[-1])}
    argument = sorted(given)[0]
    raise ValueError(f"{argument}: torch_kernels' {name} takes no packed sequences in this form")


def _call_hub_op(name: str, op, parameters: frozenset, implementation: str | None, args: tuple, kwargs: dict):
    """``op`` called as the model calls the hub function ``name``: with its packed sequences (see
    :func:`_packing`), then, as transformers does for a hub function, without the keyword
    arguments the op does not name (the model's own, such as ``position_ids``)."""
    kwargs = _packing(name, parameters, args, kwargs)
    if "**" not in parameters:
        kwargs = {key: value for key, value in kwargs.items() if key in parameters}
    return op(*args, **kwargs, implementation=implementation)


_REPLACEMENTS: dict[tuple, type] = {}


def _replacement_class(base: type, name: str, op, implementation: str | None) -> type:
    """A subclass of the hub wrapper class ``base`` (kernels' per-layer function module) whose
    forward runs ``op``, made once per (base, op, implementation).

    Its ``kernel_layer_name`` is its own, so that a later hub ``kernelize`` of the model (which
    transformers repeats on ``model.train()``/``eval()`` for a model loaded with hub kernels on)
    finds no mapping for it and keeps this forward rather than resetting it."""
    key = (base, name, op, implementation)
    if key not in _REPLACEMENTS:
        signature = inspect.signature(op).parameters.values()
        # "**": the op takes any keyword (and sees the model's own)
        parameters = frozenset(p.name if p.kind != p.VAR_KEYWORD else "**" for p in signature)

        def forward(self, *args, **kwargs):
            # under torch.compile kernels calls this with the model-wide wrapper as self: use none of it
            return _call_hub_op(name, op, parameters, implementation, args, kwargs)

        _REPLACEMENTS[key] = type(base.__name__, (base,), {
            "forward": forward, "kernel_layer_name": f"{NAME}:{name}", "__module__": __name__,
            "torch_kernels_base": base, "torch_kernels_op": op, "torch_kernels_implementation": implementation})
    return _REPLACEMENTS[key]


_LAYER_CLASSES: dict[tuple, type] = {}


def _layer_class(base: type, forward, implementation: str | None) -> type:
    """A subclass of the layer class ``base`` whose forward is the family's ``forward`` on
    ``implementation`` (made once per (base, forward, implementation)); a layer instance takes it as
    its ``__class__``, so other instances, and the class itself, stay as they were."""
    key = (base, forward, implementation)
    if key not in _LAYER_CLASSES:
        def layer_forward(self, *args, **kwargs):
            return forward(self, base.forward, implementation, *args, **kwargs)

        _LAYER_CLASSES[key] = type(base.__name__, (base,), {
            "forward": layer_forward, "__module__": __name__, "torch_kernels_base": base,
            "torch_kernels_op": forward, "torch_kernels_implementation": implementation})
    return _LAYER_CLASSES[key]


@dataclasses.dataclass
class KernelizeReport:
    """What :func:`kernelize` did to one model: ``replaced``, the names now running on torch_kernels
    (hub function names, layer class names such as ``"DeepseekV3Attention"``, ``"experts"``,
    ``"attention"``), ``where`` each was replaced (module paths),
    and ``not_replaced``, ``(name, why)`` for every hub-named function or layer, experts or attention
    path of the model left as it was. :meth:`undo` (or leaving it as a context manager) restores the
    model exactly; the reports of a model kernelized more than once may be undone in any order."""

    replaced: list = dataclasses.field(default_factory=list)
    not_replaced: list = dataclasses.field(default_factory=list)
    where: dict = dataclasses.field(default_factory=dict)
    _undo: list = dataclasses.field(default_factory=list, repr=False)

    def _add(self, name: str, path: str) -> None:
        if name not in self.where:
            self.replaced.append(name)
        self.where.setdefault(name, []).append(path)

    def _skip(self, name: str, why: str) -> None:
        if (name, why) not in self.not_replaced:
            self.not_replaced.append((name, why))

    def undo(self) -> None:
        """Put back what :func:`kernelize` replaced (a second call does nothing)."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> "KernelizeReport":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def _record(report: KernelizeReport, model: nn.Module, slot, previous, restore) -> None:
    """Record that ``report`` replaced ``previous`` in ``slot`` of ``model`` (``restore(value)`` puts a
    value back). Kernelizing a model again stacks replacements per slot; undoing one splices it out
    of its slot's stack, so the reports may be undone in any order and the last undo restores the
    model as it was."""
    stack = model.__dict__.setdefault("_torch_kernels_replaced", {}).setdefault(slot, [])
    entry = [previous]
    stack.append(entry)

    def undo() -> None:
        i = next(i for i, e in enumerate(stack) if e is entry)
        if i == len(stack) - 1:  # on top: what it replaced comes back
            restore(entry[0])
        else:  # under a later replacement: that one will put back what this one replaced
            stack[i + 1][0] = entry[0]
        del stack[i]

    report._undo.append(undo)


def _checked_implementation(implementation) -> str | None:
    chosen = backends.implementation_arg(implementation)
    if chosen is not None:
        reasons = {name: backends.unavailable_reason(name) for name in chosen.split(",")}
        if all(reasons.values()):
            raise ValueError(f"implementation: no backend of {chosen!r} runs here: {reasons}")
    return chosen


def _missing_kernels(op, implementation: str | None) -> str | None:
    """Why ``op`` cannot run on the chosen backends (None if it can, or if none was chosen: the
    device default ends with the reference)."""
    registered = backends.implementations(getattr(op, "__name__", ""))
    if implementation is None or not registered or set(implementation.split(",")) & set(registered):
        return None
    return f"no {implementation} kernel (it has {', '.join(registered)}): transformers' path kept"


def _experts_name(implementation: str | None) -> str:
    """The experts implementation name for ``implementation`` (registered on first use)."""
    if implementation is None:
        return NAME
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    name = f"{NAME}[{implementation}]"
    if name not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(name, functools.partial(experts_forward, implementation=implementation))
    return name


def _replace_hub_functions(model: nn.Module, implementation: str | None, report: KernelizeReport) -> None:
    provided = hub_functions()
    listed = set()
    modeling = {}
    for path, module in model.named_modules():
        modeling.setdefault(type(module).__module__, None)
        layer_name = getattr(type(module), "kernel_layer_name", None)
        if layer_name is not None:
            report._skip(str(layer_name), "a hub layer (a module class): torch_kernels has no layer of that name")
        wrappers = module.__dict__.get("_kernel_funcs")
        for name, wrapper in list((wrappers or {}).items()):
            listed.add(name)
            if name not in provided:
                report._skip(name, "no torch_kernels family provides it")
                continue
            missing = _missing_kernels(provided[name], implementation)
            if missing:
                report._skip(name, missing)
                continue
            base = getattr(type(wrapper), "torch_kernels_base", type(wrapper))
            wrappers[name] = _replacement_class(base, name, provided[name], implementation)()
            _record(report, model, (path, name), wrapper, functools.partial(wrappers.__setitem__, name))
            report._add(name, path)
    # a hub function the modeling code calls without listing it in a layer's use_kernelized_func is
    # one module global for every model: replacing it would touch them all
    for module_name in modeling:
        for value in vars(sys.modules.get(module_name, object)).values():
            name = getattr(value, "kernel_layer_name", None) if isinstance(value, nn.Module) else None
            if name in provided and name not in listed:
                report._skip(name, "a module global no layer lists in use_kernelized_func: only patching the global, "
                                   "which every model shares, would route it")


def _replace_layers(model: nn.Module, implementation: str | None, report: KernelizeReport) -> None:
    """Each layer of a class some family declares in ``TRANSFORMERS_LAYERS`` takes the family's
    forward (a per-instance subclass; a layer replaced before is replaced again from its base)."""
    declared = layer_forwards()
    for path, module in model.named_modules():
        current = type(module)
        base = getattr(current, "torch_kernels_base", current)
        forward = declared.get(f"{base.__module__}.{base.__qualname__}")
        if forward is None:
            continue
        missing = [f"{op.__name__}: {why}" for op in forward.ops if (why := _missing_kernels(op, implementation))]
        unsupported = None if missing else getattr(forward, "unsupported", lambda m: None)(module)
        if missing or unsupported:
            report._skip(base.__name__, "; ".join(missing) or f"{path}: {unsupported}")
            continue
        module.__class__ = _layer_class(base, forward, implementation)
        _record(report, model, (path, "__class__"), current, functools.partial(setattr, module, "__class__"))
        report._add(base.__name__, path)


def _implementations(config, attribute: str):
    """``config``'s ``attribute`` (``_attn_implementation``, ``_experts_implementation``) and those of its
    sub-configs, nested as transformers' setters take them back (``{"": own, sub-config key: ...}``)."""
    subs = {key: getattr(config, key, None) for key in getattr(config, "sub_configs", {})}
    own = getattr(config, attribute)
    subs = {key: sub for key, sub in subs.items() if sub is not None}
    return {"": own, **{key: _implementations(sub, attribute) for key, sub in subs.items()}} if subs else own


def _replace_experts(model: nn.Module, implementation: str | None, report: KernelizeReport) -> None:
    experts = [(path, m) for path, m in model.named_modules()
               if hasattr(m, "is_concatenated") and hasattr(m, "has_gate")]  # use_experts_implementation's
    if not experts:
        return
    for path, module in experts:
        if not supports(module):
            report._skip("experts", f"{path}: {'; '.join(unsupported_reasons(module))} (runs transformers' grouped_mm)")
    previous = _implementations(model.config, "_experts_implementation")
    try:
        model.set_experts_implementation(_experts_name(implementation))
    except (ValueError, RuntimeError) as e:  # e.g. experts fixed at load time
        report._skip("experts", f"transformers refuses a new experts implementation for this model: {e}")
        return
    _record(report, model, "experts", previous, model.set_experts_implementation)
    for path, module in experts:
        if supports(module):
            report._add("experts", path)


def _replace_attention(model: nn.Module, report: KernelizeReport) -> None:
    if not hasattr(model, "set_attn_implementation") or not hasattr(model, "config"):
        report._skip("attention", f"{type(model).__name__} is not a transformers model (no attention "
                                  "implementation to set)")
        return
    previous = _implementations(model.config, "_attn_implementation")
    try:
        model.set_attn_implementation(QUANTIZED_ATTENTION)
    except (ValueError, ImportError) as e:
        report._skip("attention", f"transformers refuses {QUANTIZED_ATTENTION!r} for this model: {e}")
        return
    _record(report, model, "attention", previous, model.set_attn_implementation)
    if model.config._attn_implementation != QUANTIZED_ATTENTION:  # transformers only warns for some models
        report._skip("attention", f"{type(model).__name__} cannot set its attention implementation after loading "
                                  f"(it does not use transformers' attention interface)")
        return
    report._add("attention", "model")


def kernelize(model: nn.Module, implementation=None, *, experts: bool = True,
              quantized_attention: bool = False) -> KernelizeReport:
    """Run every hub-named function and layer of ``model`` that torch_kernels covers on its ops,
    for this model instance only, on whatever device the model is; returns a
    :class:`KernelizeReport` (what was replaced, what was not and why) whose ``undo()``, or the
    end of its ``with`` block, restores the model.

    - Hub functions (``chunk_gated_delta_rule``, ``causal_conv1d_fn``, ... : every name a family
      declares in ``TRANSFORMERS_HUB_FUNCTIONS``): transformers' layers list them in
      ``use_kernelized_func``, which gives each layer instance private wrappers of the module-level
      functions (kernels' per-model routing). Those wrappers are swapped for wrappers running the
      ops; the module globals, and so every other model, stay untouched. A hub function called
      without such a listing is reported, not patched.
    - Layers (every class a family declares in ``TRANSFORMERS_LAYERS``: DeepSeek-V3's, V3.2's and
      Kimi Linear's multi-head latent attention): each instance takes a subclass whose forward
      runs the family's ops (MLA in the latent space over a paged latent cache, V3.2's indexer
      top-k); calls the ops do not describe (padded queries, packing masks, gradients) run the
      layer's own forward, and a layer the family cannot take (a quantized ``kv_b_proj``) is reported.
    - Experts (``experts=True``): ``set_experts_implementation`` to ``fused_moe`` for this model
      (experts ``fused_moe`` does not describe keep transformers' path and are reported).
    - Attention: only with ``quantized_attention=True`` (it quantizes Q and K to int8, so it is not
      exact): ``attn_implementation="torch_kernels_quantized"``.

    ``implementation`` picks the backend of every op call (a name or ordered list, as the ops'
    ``implementation=``; None: each op's device default; quantized attention takes the device
    default). Works without network: nothing is downloaded and transformers' hub kernel mapping
    is not consulted. Packed sequences pass through: ``cu_seqlens`` to ops that take it, sequence
    ids from the model's ``cu_seq_lens_q`` to those that take ``seq_idx``; a packing argument an
    op cannot take raises ``ValueError`` rather than mixing sequences.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    implementation = _checked_implementation(implementation)
    report = KernelizeReport()
    try:
        _replace_hub_functions(model, implementation, report)
        _replace_layers(model, implementation, report)
        if experts and hasattr(model, "set_experts_implementation"):
            _replace_experts(model, implementation, report)
        if quantized_attention:
            _replace_attention(model, report)
        else:
            report._skip("attention", "quantized attention (int8 Q and K) is not exact: pass quantized_attention=True")
    except BaseException:
        report.undo()
        raise
    return report


register()

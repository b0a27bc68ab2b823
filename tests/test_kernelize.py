"""``torch_kernels.integrations.transformers.kernelize`` on real architectures, built from
transformers' own config classes with tiny random weights: float32 logits within 1e-4 relative of
the model's own torch path, greedy ``generate`` token for token (the decode path with its caches),
one training step's gradients within 1e-4 relative, on every backend; under ``torch.compile``;
packed sequences; other model instances untouched; ``undo`` restores.

Every hub function a layer of the model lists that some family declares, and every layer of a
class some family declares (Kimi Linear's MLA), with a kernel on the backend asked for, must be
replaced; the rest are reported with why (a family that starts to
declare one is held to the same equalities with no edit here).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from harness import backend_params, profiled_names, require_backend
from torch_kernels import backends, families

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency (the [test] extra)")
integration = pytest.importorskip("torch_kernels.integrations.transformers")
kernelize = integration.kernelize

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, bos_token_id=None, eos_token_id=None,
              pad_token_id=None)
ARCHITECTURES = {
    "qwen3_next": lambda: transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=16,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])),
    "lfm2": lambda: transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        layer_types=["conv", "full_attention"])),
    "mamba2": lambda: transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        **{**COMMON, "num_hidden_layers": 1}, num_heads=4, head_dim=16, state_size=8, n_groups=1, expand=2,
        conv_kernel=4, chunk_size=8)),
    "granitemoehybrid": lambda: transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=32, layer_types=["mamba", "attention"], mamba_n_heads=4,
        mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=8)),
    "kimi_linear": lambda: transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(
        **COMMON, num_attention_heads=4, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
        num_experts=4, num_experts_per_token=2, num_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "num_heads": 4, "head_dim": 8,
                            "short_conv_kernel_size": 4})),
}
# hub functions of each architecture that the families on main serve (where the backend has their
# kernel); the rest of each model's listed names must appear in replaced as soon as some family
# declares them (checked generically)
SERVED_NOW = {
    "qwen3_next": {"chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn",
                   "causal_conv1d_update", "experts"},
    "lfm2": {"causal_conv1d_fn", "causal_conv1d_update"},
    "mamba2": {"mamba_chunk_scan_combined", "selective_state_update", "causal_conv1d_fn", "causal_conv1d_update"},
    "granitemoehybrid": {"mamba_chunk_scan_combined", "selective_state_update", "causal_conv1d_fn",
                         "causal_conv1d_update", "experts"},
    "kimi_linear": {"chunk_kda", "fused_recurrent_kda", "causal_conv1d_fn", "causal_conv1d_update", "experts"},
}
TOKENS = 32
CHECKS = ("logits", "generate", "gradients")
# The interpreters pay per kernel call (Pallas' about a second per decode step of the convolution,
# 15 s for its first Gated DeltaNet trace): there, fewer decode steps (still prefill, then the
# cached decode path), every check of Qwen3-Next (which reaches every op served so far) and a share
# of the other architectures (Triton's experts are test_moe_transformers.py's); the README's table
# is the full matrix, which TORCH_KERNELS_FULL_MATRIX=1 runs.
INTERPRETED_TOKENS = {"triton": 6, "sycl": 6, "pallas": 3}
FULL_MATRIX = os.environ.get("TORCH_KERNELS_FULL_MATRIX") == "1"
_SHARE = {("qwen3_next", check) for check in CHECKS} | {("lfm2", "generate"), ("mamba2", "gradients")}
INTERPRETED_SHARE = {
    "triton": _SHARE,
    "sycl": _SHARE | {("granitemoehybrid", "logits"), ("kimi_linear", "generate")},
    "pallas": {("qwen3_next", "logits"), ("lfm2", "generate"), ("lfm2", "gradients"), ("kimi_linear", "logits")}}


def _model(architecture: str):
    torch.manual_seed(0)
    return ARCHITECTURES[architecture]().float().eval()


@functools.cache
def _shared(architecture: str, check: str, tokens: int):
    """One model per architecture for the backends' tests, and transformers' own result of each
    check on it, computed once (kernelize is undone after each use)."""
    model = _shared_model(architecture)
    return model, _run(model, check, tokens)


@functools.cache
def _shared_model(architecture: str):
    return _model(architecture)


def _ids(batch: int = 2, length: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    diff = (out - ref).abs().max().item()
    return diff / scale if scale else diff


def _listed(model) -> set[str]:
    return {name for m in model.modules() for name in m.__dict__.get("_kernel_funcs", {})}


def _training_gradients(model, ids) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    model.eval()
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


def _run(model, check: str, tokens: int):
    ids = _ids()
    if check == "logits":
        with torch.no_grad():
            return model(ids).logits
    if check == "generate":
        out = model.generate(ids, max_new_tokens=tokens, do_sample=False)
        assert out.shape == (ids.shape[0], ids.shape[1] + tokens)
        return out
    return _training_gradients(model, ids)



def _assert_replaced(model, report, architecture: str, backend: str) -> None:
    """Every name the model lists that a family serves with a kernel on ``backend`` is replaced;
    every other listed name is reported with its reason."""
    provided = integration.hub_functions()

    def has_kernel(name):  # "experts" and toy ops have no registry entry
        return name not in provided or backend in (backends.implementations(provided[name].__name__) or (backend,))

    expected = {name for name in (_listed(model) & set(provided)) | SERVED_NOW[architecture] if has_kernel(name)}
    assert set(report.replaced) >= expected, report
    for name in _listed(model) - set(report.replaced):
        assert name in dict(report.not_replaced), (name, report)
    # every layer of a class some family declares: replaced where all its ops have the kernel, else reported
    declared = integration.layer_forwards()
    for m in model.modules():
        base = getattr(type(m), "torch_kernels_base", type(m))
        forward = declared.get(f"{base.__module__}.{base.__qualname__}")
        if forward is not None:
            served = all(backend in backends.implementations(op.__name__) for op in forward.ops)
            assert base.__name__ in (set(report.replaced) if served else dict(report.not_replaced)), report


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
@pytest.mark.parametrize("backend", backend_params("causal_conv1d_fn"))
def test_kernelized_model_matches_transformers(backend, architecture, check):
    require_backend(backend)
    if backend != "reference" and (architecture, check) not in INTERPRETED_SHARE[backend] and not FULL_MATRIX:
        pytest.skip(f"outside the {backend} interpreter's share (TORCH_KERNELS_FULL_MATRIX=1 runs it)")
    tokens = TOKENS if backend == "reference" else INTERPRETED_TOKENS[backend]
    model, ref = _shared(architecture, check, tokens)
    with kernelize(model, backend) as report:
        out = _run(model, check, tokens)
    _assert_replaced(model, report, architecture, backend)
    if check == "generate":
        assert torch.equal(out, ref), f"{architecture} on {backend}: greedy tokens differ"
    else:
        error = max(_relative(out[n], ref[n]) for n in ref) if check == "gradients" else _relative(out, ref)
        assert error <= 1e-4, f"{architecture} on {backend}: {check} relative error {error:.2e}"


def _op_calls(model, ids) -> set[str]:
    """The torch_kernels ops a forward of ``model`` runs (profiler names ``torch_kernels::op[...]``)."""
    names = profiled_names(lambda: model(ids))
    return {n.split("::")[1].split("[")[0] for n in names if n.startswith("torch_kernels::")}


def test_other_models_untouched_and_undo_restores():
    model, other = _model("qwen3_next"), _model("qwen3_next")
    ids = _ids(length=8)
    before = [dict(m.__dict__.get("_kernel_funcs", {})) for m in model.modules()]
    experts_before = model.config._experts_implementation
    report = kernelize(model)
    assert _op_calls(model, ids) >= {"chunk_gated_delta_rule", "causal_conv1d_fn", "fused_moe"}
    assert _op_calls(other, ids) == set(), "a second instance of the same class must keep transformers' path"
    assert report.where["chunk_gated_delta_rule"] == ["model.layers.0.linear_attn"]
    kernelized = [dict(m.__dict__.get("_kernel_funcs", {})) for m in model.modules()]
    again = kernelize(model, "reference")  # a second kernelize stacks: its undo returns to the first
    assert type(model.model.layers[0].linear_attn._kernel_funcs["causal_conv1d_fn"]).torch_kernels_implementation \
        == "reference"
    again.undo()
    assert [dict(m.__dict__.get("_kernel_funcs", {})) for m in model.modules()] == kernelized
    report.undo()
    assert [dict(m.__dict__.get("_kernel_funcs", {})) for m in model.modules()] == before
    assert model.config._experts_implementation == experts_before
    assert _op_calls(model, ids) == set()
    report.undo()  # a second undo does nothing


@pytest.mark.parametrize("order", ["first-first", "last-first"])
def test_kernelized_twice_undone_in_any_order_restores_the_model(order):
    """Two kernelize reports of one model, undone in creation order or the other: the model's hub
    wrappers, layer classes and experts implementation end as they were (creation order left
    causal_conv1d_fn and _update routed to torch_kernels)."""
    model, ids = _model("lfm2"), _ids(length=8)
    before = [dict(m.__dict__.get("_kernel_funcs", {})) for m in model.modules()]
    classes = [type(m) for m in model.modules()]
    first, second = kernelize(model), kernelize(model, "reference")
    assert _op_calls(model, ids) == {"causal_conv1d_fn"}
    for report in (first, second) if order == "first-first" else (second, first):
        report.undo()
    assert [dict(m.__dict__.get("_kernel_funcs", {})) for m in model.modules()] == before
    assert [type(m) for m in model.modules()] == classes
    assert _op_calls(model, ids) == set()


def test_quantized_attention_of_a_plain_module_is_reported():
    report = kernelize(torch.nn.Linear(2, 2), quantized_attention=True)
    assert "not a transformers model" in dict(report.not_replaced)["attention"]


def test_survives_a_hub_kernelize_of_the_model():
    """transformers repeats the hub kernelize on train()/eval() of a model loaded with hub kernels:
    it finds no mapping for the replaced wrappers' own names and keeps them."""
    kernels = pytest.importorskip("kernels", reason="the kernels package comes with transformers")
    model, ids = _model("lfm2"), _ids(length=8)
    with kernelize(model):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")
        assert _op_calls(model, ids) == {"causal_conv1d_fn"}


def _packed(lengths):
    ids = torch.cat([_ids(1, n, seed=n) for n in lengths], dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None]
    return ids, positions, cu, seq_idx


# the hub functions that mix time in each architecture besides the convolution: transformers'
# torch path of each mixes packed sequences (or refuses them), so packing waits for their family
PACKED_NEEDS = {"kimi_linear": {"chunk_kda"}, "mamba2": {"mamba_chunk_scan_combined"}}


# transformers 5.25's GraniteMoeHybrid builds its attention mask without the positions, so its own
# attention layers mix packed sequences (an attention-only one: 0.46 relative off separate runs)
PACKED_ARCHITECTURES = [a for a in ARCHITECTURES if a != "granitemoehybrid"]


@pytest.mark.parametrize("architecture", PACKED_ARCHITECTURES)
def test_packed_sequences_match_separate_runs(architecture):
    """One packed row (transformers' flattening collator's arguments: positions restarting,
    ``cu_seq_lens_q/k``, ``seq_idx``) gives each sequence's logits as its own run: the ops keep
    them apart (Gated DeltaNet by offsets, the convolution by sequence ids)."""
    missing = PACKED_NEEDS.get(architecture, set()) - set(integration.hub_functions())
    if missing:
        pytest.skip(f"{sorted(missing)} not served yet: transformers' torch path refuses packed sequences there")
    model, lengths = _model(architecture), (5, 7, 4)
    ids, positions, cu, seq_idx = _packed(lengths)
    with torch.no_grad():
        separate = torch.cat([model(ids[:, cu[i]:cu[i + 1]]).logits for i in range(len(lengths))], dim=1)
        with kernelize(model):
            # no cache: transformers builds the attention's block mask from the positions only then
            packed = model(ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, seq_idx=seq_idx,
                           use_cache=False, max_length_q=max(lengths), max_length_k=max(lengths)).logits
    assert _relative(packed, separate) <= 1e-4


def test_compiled_kernelized_layer():
    """Qwen3-Next's Gated DeltaNet layer kernelized, under torch.compile with no graph break (the
    kernels routing, the convolution and the delta rule ops in one graph): its output and its
    parameters' gradients equal eager. AOT-eager: dynamo and AOT autograd through the ops' fake
    kernels; inductor's code for the ops is each family's compile test (here it would cost 30 s,
    the whole model two minutes)."""
    model = _model("qwen3_next")
    layer = model.model.layers[0].linear_attn
    x = torch.randn(2, 8, COMMON["hidden_size"], generator=torch.Generator().manual_seed(2))
    with kernelize(model) as report:
        assert report.where["chunk_gated_delta_rule"] == ["model.layers.0.linear_attn"]
        grads = []
        for run in (layer, torch.compile(layer, fullgraph=True, backend="aot_eager")):
            layer.zero_grad()
            out = run(x)
            out.square().sum().backward()
            grads.append((out.detach(), [p.grad.clone() for p in layer.parameters()]))
        torch._dynamo.reset()
    (eager, eager_grads), (compiled, compiled_grads) = grads
    assert _relative(compiled, eager) <= 1e-5
    assert max(_relative(c, e) for c, e in zip(compiled_grads, eager_grads)) <= 1e-4


def test_a_family_declaring_a_hub_name_plugs_in():
    """A family declaring ``TRANSFORMERS_HUB_FUNCTIONS`` (here a toy one registered at run time, for
    Mamba-2's fused ``mamba_split_conv1d_scan_combined``, which no family serves) is found and
    replaces the name with no other edit."""
    from transformers.models.mamba2 import modeling_mamba2

    calls = []
    # transformers' torch function, which the model-wide wrapper's forward closes over (it returns
    # None: the mixer then takes its unfused path)
    cells = [c.cell_contents for c in type(modeling_mamba2.mamba2_split_conv1d_scan_combined).forward.__closure__]
    torch_path = next(c for c in cells if hasattr(c, "__wrapped__")).__wrapped__

    def mamba_split_conv1d_scan_combined(*args, implementation=None, **kwargs):
        calls.append(implementation)
        return torch_path(*args, **kwargs)

    class Toy:
        TRANSFORMERS_HUB_FUNCTIONS = {"mamba_split_conv1d_scan_combined": mamba_split_conv1d_scan_combined}

    families.register("toy_hub", Toy)
    try:
        model, ids = _model("mamba2").train(), _ids()
        ref = model(ids, use_cache=False).logits
        with kernelize(model, "reference") as report:
            out = model(ids, use_cache=False).logits  # training, no cache: the mixer calls it
        assert "mamba_split_conv1d_scan_combined" in report.replaced
        assert _relative(out, ref) <= 1e-4 and calls and set(calls) == {"reference"}
    finally:
        families.unregister("toy_hub")


def test_report_names_what_is_not_replaced_and_bad_arguments():
    report = kernelize(_model("mamba2"))
    reasons = dict(report.not_replaced)
    assert "causal_conv1d_forward" in reasons and "attention" in reasons
    report.undo()
    with pytest.raises(TypeError, match="^model:"):
        kernelize("qwen3_next")
    with pytest.raises(ValueError, match="^implementation"):
        kernelize(_model("lfm2"), "cuda_graphs")
    model = _model("lfm2")
    with kernelize(model):
        wrapper = model.model.layers[0].conv._kernel_funcs["causal_conv1d_update"]
        x, state, weight = torch.zeros(1, 4, 1), torch.zeros(1, 4, 3), torch.zeros(4, 3)
        with pytest.raises(ValueError, match="^cu_seqlens: "):
            wrapper(x, state, weight, cu_seqlens=torch.tensor([0, 1]))
        with pytest.raises(ValueError, match="^cu_seq_lens_q: "):
            model.model.layers[0].conv._kernel_funcs["causal_conv1d_fn"](
                torch.zeros(2, 4, 3), weight, cu_seq_lens_q=torch.tensor([0, 1, 3]))
    gdn = _model("qwen3_next")
    with kernelize(gdn), pytest.raises(ValueError, match="^seq_idx: "):  # it takes offsets, not ids
        gdn.model.layers[0].linear_attn._kernel_funcs["chunk_gated_delta_rule"](
            x, x, x, x, x, seq_idx=torch.zeros(1, 1, dtype=torch.int32))


def test_quantized_attention_on_request_and_undone():
    """quantized_attention=True sets this model's attention to the quantized interface (on CPU
    tensors it runs exact SDPA, so the logits stay); undo puts SDPA back."""
    model, ids = _model("lfm2"), _ids(length=8)
    with torch.no_grad():
        ref = model(ids).logits
        with kernelize(model, quantized_attention=True) as report:
            assert "attention" in report.replaced and "attention" not in dict(report.not_replaced)
            assert model.config._attn_implementation == integration.QUANTIZED_ATTENTION
            assert _relative(model(ids).logits, ref) <= 1e-5
    assert model.config._attn_implementation == "sdpa"


def test_undo_restores_each_sub_configs_attention():
    """A model whose sub-models run different attention implementations gets each back on undo."""
    import transformers

    text = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, vocab_size=64)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=28, patch_size=14)
    model = transformers.LlavaForConditionalGeneration(
        transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=5))
    model.set_attn_implementation({"text_config": "sdpa", "vision_config": "eager"})
    configs = (model.config, model.config.text_config, model.config.vision_config)
    before = [c._attn_implementation for c in configs]
    with kernelize(model, quantized_attention=True, experts=False) as report:
        assert "attention" in report.replaced
        assert model.config.text_config._attn_implementation == integration.QUANTIZED_ATTENTION
    assert [c._attn_implementation for c in configs] == before == ["sdpa", "sdpa", "eager"]


def test_declarations_are_public_wrappers_and_unique():
    """Each family's TRANSFORMERS_HUB_FUNCTIONS maps to wrappers it exports, each TRANSFORMERS_LAYERS
    forward lists only such wrappers in its ``ops`` and names a ``module.Class`` of transformers; a
    name declared twice is refused."""
    for name, table in families.declared(integration.HUB_DECLARATION).items():
        family = families.families()[name]
        assert all(op in [getattr(family, n) for n in family.__all__] for op in table.values()), name
    for name, table in families.declared(integration.LAYER_DECLARATION).items():
        family = families.families()[name]
        for layer, forward in table.items():
            assert layer.startswith("transformers.") and forward.ops, (name, layer)
            assert all(op in [getattr(family, n) for n in family.__all__] for op in forward.ops), (name, layer)

    class Twice:
        TRANSFORMERS_HUB_FUNCTIONS = {"causal_conv1d_fn": lambda *a, **k: None}

    families.register("toy_twice", Twice)
    try:
        with pytest.raises(ValueError, match="causal_conv1d_fn"):
            kernelize(_model("lfm2"))
    finally:
        families.unregister("toy_twice")
    layer = next(iter(integration.layer_forwards()))

    class LayerTwice:
        TRANSFORMERS_LAYERS = {layer: lambda *a, **k: None}

    families.register("toy_layer_twice", LayerTwice)
    try:
        with pytest.raises(ValueError, match=layer.rsplit(".", 1)[1]):
            kernelize(_model("lfm2"))
    finally:
        families.unregister("toy_layer_twice")

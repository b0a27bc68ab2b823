"""``ExpertParallel`` on real transformers models (small random Qwen3-MoE and Mixtral, float32):
2 and 4 gloo ranks, each with its own batch of its own length, give the logits of the unsharded
model on that batch; the expert slices' gradients are the slices of the unsharded model's gradient
of the summed losses, and the replicated parameters' gradients are that gradient after the
all-reduce. Layer 0's router is skewed so that the upper half of the ranks receive no rows there.
The argument errors run in-process on a 1-rank group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import transformers

import torch_kernels.integrations.transformers  # noqa: E402,F401 - registers "torch_kernels", the reference
from torch_kernels.distributed import expert_parallel as ep  # noqa: E402
from torch_kernels.distributed.launch import run_local  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
BATCH_SHAPES = [(1, 5), (2, 3), (1, 4), (3, 2)]  # rank r's (batch, sequence): a different T per rank
MAX_TOKENS = max(b * s for b, s in BATCH_SHAPES)


def _model(architecture: str, num_experts: int = 8):
    torch.manual_seed(0)
    if architecture == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=24,
                                             num_experts=num_experts, num_experts_per_tok=2, head_dim=8)
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.MixtralConfig(**COMMON, intermediate_size=40, num_local_experts=num_experts,
                                            num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    model = model.float().eval()
    with torch.no_grad():
        for p in model.parameters():  # wide weights: the routers' choices lie well apart
            p.mul_(3.0)
        if num_experts == 8:
            # Layer 0 routes only to experts 0-3: their logits come in pairs (a, -a), (b, -b), which
            # beat the zero logits of experts 4-7 unless a or b is exactly 0.
            router = model.model.layers[0].mlp.gate.weight
            router[1], router[3] = -router[0], -router[2]
            router[4:] = 0
    return model


def _batch(rank: int) -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], BATCH_SHAPES[rank], generator=torch.Generator().manual_seed(rank))


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.square().mean()


def _ep_rank(rank: int, world_size: int, cases) -> list:
    """Each case on this rank: the sharded model's logits, gradients and slices, or the error text."""
    results = []
    for architecture, num_experts, options in cases:
        model = _model(architecture, num_experts)
        try:
            ep.ExpertParallel(**options).shard(model)
        except ValueError as error:
            results.append(str(error))
            continue
        logits = model(_batch(rank)).logits
        _loss(logits).backward()
        ep.all_reduce_replicated_grads(model)
        slices = {name: (m.expert_parallel.first_expert, m.expert_parallel.local_experts,
                         m.gate_up_proj.untyped_storage().nbytes() == m.gate_up_proj.nbytes)
                  for name, m in model.named_modules() if hasattr(m, "expert_parallel")}
        results.append(dict(logits=logits.detach(), slices=slices,
                            grads={n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                            implementation=model.config._experts_implementation))
    return results


def _reference(architecture: str, world_size: int):
    """The unsharded model on every rank's batch: each batch's logits, the gradient of the summed losses."""
    model = _model(architecture)
    model.set_experts_implementation("torch_kernels")
    logits = [model(_batch(rank)).logits for rank in range(world_size)]
    sum(_loss(each) for each in logits).backward()
    return [each.detach() for each in logits], {n: p.grad for n, p in model.named_parameters()}


def _check_against_reference(per_rank: list[dict], architecture: str) -> None:
    want_logits, want_grads = _reference(architecture, len(per_rank))
    for rank, got in enumerate(per_rank):
        assert got["implementation"] == ep.NAME
        torch.testing.assert_close(got["logits"], want_logits[rank], rtol=1e-5, atol=1e-5)
        assert got["grads"].keys() == want_grads.keys()
        assert len(got["slices"]) == COMMON["num_hidden_layers"]
        for module, (first, local, owns_storage) in got["slices"].items():
            assert (first, local) == (rank * 8 // len(per_rank), 8 // len(per_rank))
            assert owns_storage  # the other ranks' experts were freed, not kept behind a view
        for name, want in want_grads.items():
            module, _, leaf = name.rpartition(".")
            if module in got["slices"] and leaf in ("gate_up_proj", "down_proj"):
                first, local, _ = got["slices"][module]
                want = want[first:first + local]
            # The ranks' sums of gradient contributions come in another order: atol on the tensor's scale.
            torch.testing.assert_close(got["grads"][name], want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                       msg=lambda m, name=name, rank=rank: f"rank {rank}, {name}: {m}")
    # The skew held: experts 4-7 of layer 0 saw no token, so their gradient is zero.
    skewed = want_grads["model.layers.0.mlp.experts.gate_up_proj"]
    assert skewed[4:].abs().max() == 0 and skewed[:4].abs().max() > 0


TWO_RANK_CASES = [
    ("qwen3_moe", 8, {}),
    ("qwen3_moe", 8, {"max_tokens_per_rank": MAX_TOKENS}),
    ("mixtral", 8, {}),
    ("mixtral", 3, {}),
    ("qwen3_moe", 8, {"dispatch_dtype": torch.float8_e4m3fn}),
]


@pytest.fixture(scope="module")
def two_ranks():
    """One spawn of 2 ranks for every 2-rank case (each spawn costs seconds)."""
    per_rank = run_local(_ep_rank, 2, TWO_RANK_CASES)
    return [[per_rank[rank][case] for rank in range(2)] for case in range(len(TWO_RANK_CASES))]


@pytest.mark.parametrize("case", [0, 2], ids=["qwen3_moe", "mixtral"])
def test_two_ranks_equal_the_unsharded_model(two_ranks, case):
    _check_against_reference(two_ranks[case], TWO_RANK_CASES[case][0])


def test_fixed_capacity_equals_exact(two_ranks):
    exact, fixed = two_ranks[0], two_ranks[1]
    _check_against_reference(fixed, "qwen3_moe")
    for rank in range(2):
        torch.testing.assert_close(fixed[rank]["logits"], exact[rank]["logits"], rtol=1e-6, atol=1e-6)
        for name, grad in exact[rank]["grads"].items():
            torch.testing.assert_close(fixed[rank]["grads"][name], grad, rtol=1e-6, atol=1e-7)


def test_float8_dispatch_is_close(two_ranks):
    want_logits, _ = _reference("qwen3_moe", 2)
    for rank, got in enumerate(two_ranks[4]):
        # float8 rows carry about 2 significant digits; the logits move by a few percent of their scale
        scale = want_logits[rank].abs().max().item()
        torch.testing.assert_close(got["logits"], want_logits[rank], rtol=0, atol=0.1 * scale)
        assert got["grads"].keys() == two_ranks[0][rank]["grads"].keys()


def test_experts_not_divisible_by_group_size(two_ranks):
    for message in two_ranks[3]:
        assert "num_experts=3" in message and "group size 2" in message and "model.layers.0.mlp.experts" in message


def test_four_ranks_equal_the_unsharded_model():
    per_rank = run_local(_ep_rank, 4, [("qwen3_moe", 8, {})])
    _check_against_reference([result[0] for result in per_rank], "qwen3_moe")


# ---- argument errors, in-process on a 1-rank group ----

@pytest.fixture(scope="module")
def group():
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_model_without_experts(group):
    dense = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, intermediate_size=48, head_dim=8))
    with pytest.raises(ValueError, match=r"model: Qwen3ForCausalLM has no MoE experts module"):
        ep.ExpertParallel(group).shard(dense)


def test_unsupported_experts_say_which_and_why(group):
    config = transformers.GptOssConfig(**COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                       head_dim=8, layer_types=["full_attention"] * 2)
    model = transformers.GptOssForCausalLM(config)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts \(GptOssExperts\): expert biases.*"
                                         r"a gate function of its own") as caught:
        ep.ExpertParallel(group).shard(model)
    assert "model.layers.1.mlp.experts" in str(caught.value)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4  # nothing changed


def test_one_rank_in_process_and_shard_once(group):
    want = _reference("qwen3_moe", 2)[0][1]
    model = ep.ExpertParallel(group).shard(_model("qwen3_moe"))
    with torch.no_grad():
        torch.testing.assert_close(model(_batch(1)).logits, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"already sharded"):
        ep.ExpertParallel(group).shard(model)


def test_unsharded_experts_refuse_the_implementation():
    model = _model("qwen3_moe")
    ep.register()
    model.set_experts_implementation(ep.NAME)
    with pytest.raises(RuntimeError, match=r"Qwen3MoeExperts: experts_implementation='torch_kernels_ep' runs only"):
        model(_batch(0))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(group="world"), TypeError, r"group: expected a torch.distributed ProcessGroup or None, got str"),
    (dict(max_tokens_per_rank=0), ValueError, r"max_tokens_per_rank: expected an int >= 1, got 0"),
    (dict(max_tokens_per_rank=2.0), TypeError, r"max_tokens_per_rank: expected None or an int, got float"),
    (dict(dispatch_dtype=torch.bfloat16), TypeError, r"dispatch_dtype: expected None .* got torch.bfloat16"),
])
def test_bad_arguments(group, kwargs, error, match):
    with pytest.raises(error, match=match):
        ep.ExpertParallel(**{"group": group, **kwargs})


def test_all_reduce_needs_a_group(group):
    with pytest.raises(ValueError, match=r"group: None means the group model was sharded over, but model has "
                                         r"no sharded experts"):
        ep.all_reduce_replicated_grads(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"model: expected a torch.nn.Module, got int"):
        ep.all_reduce_replicated_grads(3, group)

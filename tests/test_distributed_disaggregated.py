"""Attention-FFN disaggregation (``torch_kernels.distributed.disaggregated``) on gloo processes: a
small random Qwen3-MoE served by M attention ranks and N FFN ranks gives the colocated
single-process model's prefill logits and greedy decode steps, for every (M, N) below, with and
without microbatch ping-pong, in fixed-capacity and exact exchange modes.

Every spawned process pays for importing torch and transformers (seconds on a shared CPU), so one
world of five processes runs every layout: each (M, N) on a subgroup of the first M + N ranks (the
largest on the whole world, the default group), one after the other."""

from __future__ import annotations

import functools
import pickle

import filelock

import pytest
import torch
import torch.distributed as dist

import transformers

from torch_kernels.distributed import disaggregated  # noqa: E402
from torch_kernels.distributed.launch import run_local  # noqa: E402


LAYOUTS = [(1, 1), (2, 1), (2, 2), (3, 2)]
WORLD = max(m + n for m, n in LAYOUTS)
SETTINGS = [(1, True), (2, True), (1, False), (2, False)]  # (microbatches, fixed_capacity)
NEW_TOKENS = 4  # the prefill's token, then 3 decode steps
PROMPT_LENGTH = 6
VOCAB = 128

SMALL = dict(hidden_size=32, head_dim=8, moe_intermediate_size=24, num_hidden_layers=2)
MODELS = {
    "small": SMALL,
    "dense middle": dict(SMALL, num_hidden_layers=3, mlp_only_layers=[1]),  # a dense MLP between MoE layers
    # wide enough that one microbatch's attention (a few ms) outlasts the exchange's latency, so the
    # timeline shows the ping-pong overlap through a shared machine's noise
    "wide": dict(hidden_size=256, head_dim=64, moe_intermediate_size=256, num_hidden_layers=2),
}
WIDE_PROMPT = (2, 256)  # two sequences: one per microbatch


def _model(name: str = "small"):
    """The same random model on every call (and so on every rank), float32 with SDPA attention."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        num_experts=8, num_experts_per_tok=2, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        attn_implementation="sdpa", **MODELS[name])
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    for p in model.parameters():  # wide weights: router choices and greedy tokens lie well apart
        p.data.mul_(3.0)
    return model


def _batch_sizes(num_attention: int) -> list[int]:
    """3, 2, 1 sequences: uneven microbatches (2 + 1) and, on the third rank, an empty one."""
    return [3 - r for r in range(num_attention)]


def _prompts(num_attention: int) -> list[torch.Tensor]:
    sizes = _batch_sizes(num_attention)
    ids = torch.randint(0, VOCAB, (sum(sizes), PROMPT_LENGTH), generator=torch.Generator().manual_seed(1))
    return list(ids.split(sizes))


def _errors() -> dict:
    """Checks that need an initialized world but no collective."""
    found = {}
    try:
        disaggregated.make_attention_ffn_layout(2, 2)
    except ValueError as error:
        found["layout size"] = str(error)
    layout = disaggregated.make_attention_ffn_layout(WORLD - 1, 1)
    other_role = disaggregated.AttentionRunner if layout.role == "ffn" else disaggregated.FFNServer
    try:
        other_role(_model(), layout)
    except ValueError as error:
        found["wrong role"] = str(error)
    if layout.role == "attention":
        try:
            disaggregated.AttentionRunner(_model(), layout, microbatches=0)
        except ValueError as error:
            found["microbatches"] = str(error)
    try:  # 8 experts over 3 FFN ranks
        disaggregated.FFNServer(_model(), disaggregated.make_attention_ffn_layout(2, 3))
    except ValueError as error:
        found["uneven experts"] = str(error)
    return found


def _world(rank: int, world_size: int) -> dict:
    # new_group is collective over the world: every rank creates every subgroup, in the same order.
    groups = {(m, n): dist.new_group(list(range(m + n))) if m + n < world_size else None for m, n in LAYOUTS}
    results = {"errors": _errors()}
    for (m, n), group in groups.items():
        if rank >= m + n:
            continue
        layout = disaggregated.make_attention_ffn_layout(m, n, group)
        prompts = _prompts(m)[rank] if rank < m else None
        for microbatches, fixed in SETTINGS:
            log = disaggregated.EventLog()
            out = disaggregated.run_disaggregated(_model(), layout, prompts, NEW_TOKENS, microbatches=microbatches,
                                                  fixed_capacity=fixed, event_log=log)
            results[m, n, microbatches, fixed] = (out, log.events)
        if (m, n) == (1, 1):  # a prefill of the wide model, for the timeline
            log = disaggregated.EventLog()
            wide = torch.randint(0, VOCAB, WIDE_PROMPT, generator=torch.Generator().manual_seed(2))
            disaggregated.run_disaggregated(_model("wide"), layout, wide if rank == 0 else None, 1, microbatches=2,
                                            event_log=log)
            results["wide"] = log.events
        if (m, n) == (2, 1):
            results["dense"] = disaggregated.run_disaggregated(_model("dense middle"), layout, prompts, NEW_TOKENS,
                                                               microbatches=2)
            try:  # attention ranks that disagree on microbatches: every rank raises the same error
                disaggregated.run_disaggregated(_model(), layout, prompts, 1, microbatches=1 + rank % 2)
            except ValueError as error:
                results["mismatch"] = str(error)
    return results


def _world_results() -> list[dict]:
    return run_local(_world, WORLD, timeout=600.0)  # a hang guard, far above the normal time


@functools.cache
def _colocated(num_attention: int, name: str = "small") -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy tokens and per-step logits of the single-process model on all attention ranks' prompts."""
    model = _model(name)
    step_ids, cache = torch.cat(_prompts(num_attention)), None
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            out = model(step_ids, cache=cache, use_cache=True)
            cache = out.cache
            logits.append(out.logits)
            step_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(step_ids)
    return torch.cat(tokens, dim=1), logits


@pytest.fixture(scope="session")
def world(tmp_path_factory, worker_id):
    """The spawned world's results, computed once per test run: under pytest-xdist the first worker
    to need them runs the world and the others read its pickled results."""
    if worker_id == "master":
        return _world_results()
    shared = tmp_path_factory.getbasetemp().parent / "disaggregated-world.pkl"
    with filelock.FileLock(f"{shared}.lock"):
        if not shared.is_file():
            shared.write_bytes(pickle.dumps(_world_results()))
        return pickle.loads(shared.read_bytes())


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"M{m}-N{n}" for m, n in LAYOUTS])
def test_logits_and_greedy_tokens_equal_colocated(world, layout):
    m, n = layout
    want_tokens, want_logits = _colocated(m)
    starts = [0, *torch.tensor(_batch_sizes(m)).cumsum(0).tolist()]
    for microbatches, fixed in SETTINGS:
        setting = f"microbatches={microbatches} fixed_capacity={fixed}"
        for rank in range(m):
            (tokens, logits), _ = world[rank][m, n, microbatches, fixed]
            rows = slice(starts[rank], starts[rank + 1])
            assert torch.equal(tokens, want_tokens[rows]), f"{setting}, attention rank {rank}: greedy tokens"
            assert len(logits) == NEW_TOKENS
            for step, (got, want) in enumerate(zip(logits, want_logits)):
                torch.testing.assert_close(got, want[rows], rtol=1e-5, atol=1e-5,
                                           msg=lambda text: f"{setting}, attention rank {rank}, step {step}: {text}")
        for rank in range(m, m + n):
            steps, _ = world[rank][m, n, microbatches, fixed]
            assert steps == NEW_TOKENS, f"{setting}: FFN rank {rank} served {steps} steps"


def test_dense_layers_run_on_the_attention_ranks(world):
    """A dense MLP layer between MoE layers (Qwen3-MoE's mlp_only_layers) exchanges nothing."""
    want_tokens, want_logits = _colocated(2, "dense middle")
    starts = [0, *torch.tensor(_batch_sizes(2)).cumsum(0).tolist()]
    for rank in range(2):
        tokens, logits = world[rank]["dense"]
        rows = slice(starts[rank], starts[rank + 1])
        assert torch.equal(tokens, want_tokens[rows])
        for got, want in zip(logits, want_logits, strict=True):
            torch.testing.assert_close(got, want[rows], rtol=1e-5, atol=1e-5)
    assert world[2]["dense"] == NEW_TOKENS


def test_disagreeing_attention_ranks_raise_on_every_rank(world):
    messages = [world[rank].get("mismatch") for rank in range(3)]
    assert all(message and "microbatches" in message for message in messages), messages
    assert "mismatch" not in world[3] and "mismatch" not in world[4]


def test_bad_layouts_and_roles_name_the_argument(world):
    for rank, results in enumerate(world):
        errors = results["errors"]
        assert "num_attention + num_ffn" in errors["layout size"]
        assert errors["wrong role"].startswith("layout:")
        assert "8 experts" in errors["uneven experts"] and errors["uneven experts"].startswith("layout:")
        if rank < WORLD - 1:
            assert errors["microbatches"].startswith("microbatches: expected an int >= 1")


def _events(world, layout, setting):
    m, n = layout
    return {rank: world[rank][(m, n, *setting)][1] for rank in range(m + n)}


def _index(events, name):
    names = [event[0] for event in events]
    assert name in names, f"no event {name!r}"
    return names.index(name)


def test_ping_pong_order_and_timeline(world, tmp_path):
    """Each rank keeps the ping-pong order; the timeline PNG and busy fractions come out."""
    m, n = 2, 2
    logs = _events(world, (m, n), (2, True))
    for step in range(NEW_TOKENS):
        for layer in range(2):
            at = f"s{step} L{layer}"
            for rank in range(m):
                events = logs[rank]
                # mb1's attention between mb0's dispatch and the wait for mb0's combine
                assert (_index(events, f"attention {at} mb0") < _index(events, f"dispatch {at} mb0")
                        < _index(events, f"attention {at} mb1") < _index(events, f"dispatch {at} mb1")
                        < _index(events, f"combine {at}") < _index(events, f"wait {at} mb0 combine"))
                if layer == 0:  # the next layer's attention of mb0 before the wait for mb1's experts
                    assert (_index(events, f"attention s{step} L1 mb0")
                            < _index(events, f"wait s{step} L0 mb1 combine"))
            for rank in range(m, m + n):
                events = logs[rank]
                # fixed capacity: both dispatches posted, then mb0's combine posted before mb1's experts
                assert (_index(events, f"dispatch {at} mb1") < _index(events, f"experts {at} mb0")
                        < _index(events, f"combine {at} mb0") < _index(events, f"experts {at} mb1"))
    wide = {rank: world[rank]["wide"] for rank in range(2)}
    for logs, labels in ((logs, [f"attention {r}" for r in range(m)] + [f"ffn {r}" for r in range(n)]),
                         (wide, ["attention 0", "ffn 0"])):
        path = tmp_path / f"timeline{len(logs)}.png"
        disaggregated.timeline_png(logs, path, labels=labels, title="2 microbatches")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
        fractions = disaggregated.busy_fractions(logs)
        assert sorted(fractions) == list(range(len(logs))), fractions
        assert all(0 < f <= 1 for f in fractions.values()), fractions


def _overlaps(logs, attention_ranks, ffn_ranks, steps) -> int:
    """How often an attention rank's attention of one microbatch overlaps in wall-clock time an FFN
    rank's experts of the other: mb1's attention with mb0's experts of the same layer, and mb0's
    attention of layer 1 with mb1's experts of layer 0."""
    found = 0
    for step in range(steps):
        for attention_at, experts_at in (("L0 mb1", "L0 mb0"), ("L1 mb1", "L1 mb0"), ("L1 mb0", "L0 mb1")):
            for a in attention_ranks:
                attention = [e for e in logs[a] if e[0] == f"attention s{step} {attention_at}"]
                for f in ffn_ranks:
                    experts = [e for e in logs[f] if e[0] == f"experts s{step} {experts_at}"]
                    found += sum(s[1] < e[2] and e[1] < s[2] for s in attention for e in experts)
    return found


def test_attention_overlaps_experts_in_wall_clock_time(world):
    """The attention rank computes mb1's attention while the FFN rank computes mb0's experts.

    Measured in wall-clock time on a shared two-core machine, where a process can be descheduled at
    the wrong moment; the wide model's prefill gives each span milliseconds (the exchange's latency
    is about one), and it suffices that one of its layers, or of the small runs' layers, overlaps.
    Without ping-pong (the next attention only after the experts returned) none would."""
    wide = {rank: world[rank]["wide"] for rank in range(2)}
    found = _overlaps(wide, [0], [1], 1)
    for m, n in LAYOUTS:
        found += _overlaps(_events(world, (m, n), (2, True)), range(m), range(m, m + n), NEW_TOKENS)
    assert found > 0

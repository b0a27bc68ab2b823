"""Autotuning with a per-device cache (torch_kernels.autotune over triton_impl.autotune.choose).

The search runs here on CPU tensors with a stubbed timer (milliseconds per config, chosen by the
test), so these tests check what the tuner decides and keeps, not how fast anything is.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

import torch_kernels  # noqa: F401  (installs the tuner)
from harness import require_backend
from torch_kernels.reference import ood as reference_ood
from triton_impl import autotune as hook  # the hook alone: the standard library, no triton

tuning = importlib.import_module("torch_kernels.autotune")
CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Tile:
    block: int = 16


class Kernel:
    """A launcher as the Triton ones are written: it picks its config through ``choose`` and
    records every config it launched. ``block=64`` computes a wrong result, ``block=128`` fails to
    launch (as a config out of shared memory does)."""

    blocks = (16, 32, 64, 128)

    def __init__(self):
        self.launched = []

    def __call__(self, x, config=None):
        config = config or hook.choose("test.double", x.device, dict(n=x.numel(), dtype=x.dtype), lambda: Tile(16),
                                       lambda: [Tile(b) for b in self.blocks], lambda: self(x))
        self.launched.append(config)
        if config.block == 128:
            raise RuntimeError("out of resources: shared memory")
        return x * 2 + (1 if config.block == 64 else 0)


def stub_timer(milliseconds: dict):
    """A timer that reports ``milliseconds[config.block]`` and records what it timed."""
    def timer(run, config):
        timer.timed.append(config)
        return milliseconds[config.block]

    timer.timed = []
    return timer


@pytest.fixture
def make_tuner(tmp_path, monkeypatch):
    """Installs a fresh tuner over ``tmp_path``'s cache folders (the installed one is restored),
    with no TORCH_KERNELS_AUTOTUNE from the environment."""
    require_backend("triton")
    monkeypatch.delenv(tuning.ENV_VAR, raising=False)
    installed = []

    def make(timer=None, search_interpreted=True):
        tuner = tuning.Autotune(cache_dir=tmp_path / "user", shipped_dir=tmp_path / "shipped",
                                timer=timer or stub_timer({}), search_interpreted=search_interpreted)
        installed.append(hook.install(tuner.choose))
        return tuner

    yield make
    if installed:
        hook.install(installed[0])


def test_search_picks_the_fastest_config_that_runs_correctly(make_tuner):
    timer = stub_timer({16: 3.0, 32: 1.0, 64: 0.1, 128: 0.05})
    tuner = make_tuner(timer)
    kernel = Kernel()
    x = torch.arange(100.0)
    with pytest.warns(UserWarning, match="disagrees with the heuristic"), tuner():
        out = kernel(x)
    torch.testing.assert_close(out, x * 2)
    # 128 raised and 64 computed something else: neither was timed; 32 is the fastest left
    assert [config.block for config in timer.timed] == [16, 32]
    assert kernel.launched[-1] == Tile(32)
    record = tuner.entries("cpu")["test.double|n=128,dtype=float32"]
    assert record == {"config": {"block": 32}, "ms": 1.0, "heuristic_ms": 3.0}


@pytest.mark.filterwarnings("ignore:autotune.*disagrees with the heuristic")
def test_the_cache_file_is_read_back_by_a_fresh_tuner(make_tuner, tmp_path):
    with make_tuner(stub_timer({16: 3.0, 32: 2.0, 64: 9.0, 128: 9.0}))():
        Kernel()(torch.arange(100.0))
    path = tmp_path / "user" / "cpu.json"
    contents = json.loads(path.read_text())
    assert contents["device"] == "cpu" and contents["format"] == tuning.FORMAT
    assert contents["configs"]["test.double|n=128,dtype=float32"]["config"] == {"block": 32}

    timer = stub_timer({})
    make_tuner(timer)  # search on, but a hit needs none
    kernel = Kernel()
    out = kernel(torch.arange(120.0))  # 120 rounds up to the same bucket as 100
    torch.testing.assert_close(out, torch.arange(120.0) * 2)
    assert kernel.launched == [Tile(32)] and timer.timed == []


def test_a_miss_without_search_takes_the_heuristic(make_tuner, tmp_path):
    timer = stub_timer({})
    make_tuner(timer)
    kernel = Kernel()
    kernel(torch.arange(10.0))
    assert kernel.launched == [Tile(16)] and timer.timed == []
    assert not (tmp_path / "user").exists()


def test_memory_stays_bounded_over_ever_new_sizes(make_tuner, monkeypatch):
    """A server calls with ever new token counts: the tuner keeps at most MEMO_SIZE answers and
    misses, and sizes of one bucket share the cached entry."""
    monkeypatch.setattr(tuning, "MEMO_SIZE", 8)
    timer = stub_timer({16: 3.0, 32: 2.0, 64: 9.0, 128: 9.0})
    tuner = make_tuner(timer)
    with pytest.warns(UserWarning, match="disagrees"), tuner():
        Kernel()(torch.arange(100.0))  # the bucket of 65..128 elements: block 32
    kernel = Kernel()
    for n in range(1, 200):
        kernel(torch.arange(float(n)))
    assert len(tuner._memo) <= 8 and len(tuner._misses) <= 8
    assert kernel.launched[64:128] == [Tile(32)] * 64  # n = 65..128: the searched bucket's entry
    assert set(kernel.launched[:64] + kernel.launched[128:]) == {Tile(16)}


def test_no_search_under_the_interpreter_unless_asked(make_tuner):
    timer = stub_timer({16: 2.0, 32: 1.0})
    kernel = Kernel()
    with make_tuner(timer, search_interpreted=False)():
        kernel(torch.arange(10.0))
    assert kernel.launched == [Tile(16)] and timer.timed == []


@pytest.mark.filterwarnings("ignore:autotune.*disagrees with the heuristic")
def test_the_environment_variable_turns_the_search_on_and_caches_off(make_tuner, monkeypatch):
    timer = stub_timer({16: 2.0, 32: 1.0, 64: 9.0, 128: 9.0})
    make_tuner(timer)
    kernel = Kernel()
    monkeypatch.setenv(tuning.ENV_VAR, "1")
    kernel(torch.arange(10.0))
    assert kernel.launched[-1] == Tile(32) and timer.timed
    monkeypatch.setenv(tuning.ENV_VAR, "0")  # heuristics only: the cached entry is not used
    kernel(torch.arange(10.0))
    assert kernel.launched[-1] == Tile(16)


def test_a_corrupt_cache_file_is_ignored_with_a_warning(make_tuner, tmp_path):
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "cpu.json").write_text('{"format": 1, "configs": {"test.double|n=16')
    make_tuner()
    kernel = Kernel()
    with pytest.warns(UserWarning, match="ignoring the unreadable cache file"):
        out = kernel(torch.arange(10.0))
    torch.testing.assert_close(out, torch.arange(10.0) * 2)
    assert kernel.launched == [Tile(16)]


def test_a_cached_config_that_is_not_a_candidate_is_not_launched(make_tuner, tmp_path):
    (tmp_path / "shipped").mkdir()
    (tmp_path / "shipped" / "cpu.json").write_text(json.dumps(
        {"format": 1, "device": "cpu", "configs": {"test.double|n=16,dtype=float32": {"config": {"block": 7}}}}))
    make_tuner()
    kernel = Kernel()
    with pytest.warns(UserWarning, match="not one of its candidates"):
        kernel(torch.arange(10.0))
    assert kernel.launched == [Tile(16)]


@dataclasses.dataclass(frozen=True)
class OuterTile:
    block: int = 16


def test_no_second_search_starts_inside_a_search(make_tuner):
    inner = Kernel()
    timer = stub_timer({16: 2.0, 32: 1.0, 64: 9.0, 128: 9.0})
    tuner = make_tuner(timer)

    def outer(x, config=None):
        config = config or hook.choose("test.outer", x.device, dict(n=x.numel()), lambda: OuterTile(16),
                                       lambda: [OuterTile(16), OuterTile(32)], lambda: outer(x))
        return inner(x)

    with pytest.warns(UserWarning, match="disagrees"), tuner():
        outer(torch.arange(10.0))
    # while the outer search ran (its reference run and two candidates), inner took its heuristic;
    # inner searched only at its own launch after that
    assert [type(config) for config in timer.timed] == [OuterTile] * 2 + [Tile] * 2
    assert inner.launched[:3] == [Tile(16)] * 3
    assert set(tuner.entries("cpu")) == {"test.outer|n=16", "test.double|n=16,dtype=float32"}


@pytest.mark.filterwarnings("ignore:autotune.*disagrees with the heuristic")
def test_save_writes_one_file_per_device(make_tuner, tmp_path):
    tuner = make_tuner(stub_timer({16: 2.0, 32: 1.0, 64: 9.0, 128: 9.0}))
    with tuner():
        Kernel()(torch.arange(10.0))
    (path,) = tuner.save(tmp_path / "out")
    assert path == tmp_path / "out" / "cpu.json"
    assert json.loads(path.read_text())["configs"]["test.double|n=16,dtype=float32"]["config"] == {"block": 32}


def _mahalanobis_inputs(b=5, d=12, c=3):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(b, d, generator=generator)
    center = torch.randn(d, generator=generator)
    whitener = torch.randn(d, d, generator=generator) / d ** 0.5
    class_proj = torch.randn(c, d, generator=generator)
    class_sq = class_proj.square().sum(1)
    return x, center, whitener, class_proj, class_sq


def _recording_launches(monkeypatch):
    """The constexprs of every mahalanobis kernel launch from now on."""
    ood = importlib.import_module("triton_impl.ood")
    launches, for_device = [], ood.for_device

    def recording(kernel, device):
        launcher = for_device(kernel, device)

        class Recorder:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launches.append(kwargs)
                    return launcher[grid](*args, **kwargs)
                return launch
        return Recorder()

    monkeypatch.setattr(ood, "for_device", recording)
    return ood, launches


def test_a_cached_config_reaches_the_kernel_launch(make_tuner, tmp_path, monkeypatch):
    ood, launches = _recording_launches(monkeypatch)
    inputs = _mahalanobis_inputs()
    chosen = ood.Config(block_b=32, block_n=16, block_k=16, num_warps=8)
    assert chosen != ood.default_config(5, 12, 3) and chosen in ood.config_space(5, 12, 3)
    (tmp_path / "shipped").mkdir()  # the package's file for this device kind
    (tmp_path / "shipped" / "cpu.json").write_text(json.dumps({"format": 1, "device": "cpu", "configs": {
        "ood.mahalanobis_min|b=8,d=16,c=4,dtype=float32": {"config": dataclasses.asdict(chosen)}}}))
    make_tuner()
    score, nearest = ood.mahalanobis_min(*inputs)
    expected_score, expected_nearest = reference_ood.mahalanobis_min(*inputs)
    torch.testing.assert_close(score, expected_score, rtol=1e-4, atol=1e-4)
    assert torch.equal(nearest, expected_nearest)
    assert [(launch["BLOCK_B"], launch["BLOCK_N"], launch["BLOCK_K"], launch["num_warps"]) for launch in launches] \
        == [(32, 16, 16, 8)]


def test_a_search_over_a_real_kernel(make_tuner, monkeypatch):
    """The interpreted Mahalanobis kernel, each candidate run and checked; the stub times block_b=16
    with 8 warps fastest."""
    ood, launches = _recording_launches(monkeypatch)
    inputs = _mahalanobis_inputs(b=3, d=8, c=2)
    space = ood.config_space(3, 8, 2)
    fastest = ood.Config(block_b=16, block_n=16, block_k=16, num_warps=8)
    assert fastest in space and fastest != space[0]

    def timer(run, config):
        return 1.0 if config == fastest else 2.0

    tuner = make_tuner(timer)
    with tuner():
        score, nearest = ood.mahalanobis_min(*inputs)
    assert len(launches) == 2 + len(space)  # the heuristic's reference run, every candidate, the call
    assert (launches[-1]["BLOCK_B"], launches[-1]["num_warps"]) == (16, 8)
    expected_score, expected_nearest = reference_ood.mahalanobis_min(*inputs)
    torch.testing.assert_close(score, expected_score, rtol=1e-4, atol=1e-4)
    assert torch.equal(nearest, expected_nearest)
    assert tuner.entries("cpu")["ood.mahalanobis_min|b=4,d=8,c=2,dtype=float32"]["config"] \
        == dataclasses.asdict(fastest)


def test_the_installed_tuner_is_the_public_one():
    assert torch_kernels.autotune is tuning.autotune
    assert hook._tuner == tuning.autotune.choose


def test_a_new_process_reads_the_user_cache(tmp_path):
    """The user cache under $TORCH_KERNELS_CACHE, read by another process at its first call."""
    folder = tmp_path / "autotune"
    folder.mkdir()
    chosen = {"block_b": 32, "block_n": 16, "block_k": 16, "num_warps": 8}
    (folder / "cpu.json").write_text(json.dumps({"format": 1, "device": "cpu", "configs": {
        "ood.mahalanobis_min|b=8,d=16,c=4,dtype=float32": {"config": chosen}}}))
    script = (
        "import dataclasses, torch, torch_kernels\n"
        "from triton_impl import autotune as hook, ood\n"
        "print(dataclasses.asdict(hook.choose('ood.mahalanobis_min', torch.device('cpu'),"
        " dict(b=5, d=12, c=3, dtype=torch.float32), lambda: ood.default_config(5, 12, 3),"
        " lambda: ood.config_space(5, 12, 3), None)))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                            env={**os.environ, "TORCH_KERNELS_CACHE": str(tmp_path), tuning.ENV_VAR: ""})
    assert result.stdout.strip() == str(chosen)

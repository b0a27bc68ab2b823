"""The benchmark history (benchmarks/common.py), its compare and its bisect (benchmarks/history.py).

The statistical test is checked against a brute-force count over every arrangement of the timings;
compare on seeded timings with a known slowdown and with none; bisect on a scratch repository whose
planted commit makes its tiny benchmark slow.
"""

from __future__ import annotations

import itertools
import json
import math
import pathlib
import random
import statistics
import subprocess
import sys

import pytest
import torch

import torch_kernels

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import common  # noqa: E402
import history  # noqa: E402

from harness import random_tensor  # noqa: E402


# ---- writing the history ----

def test_a_measurement_appends_one_line_with_every_timing(tmp_path, monkeypatch):
    path = tmp_path / "h.jsonl"
    monkeypatch.setenv(common.HISTORY_ENV, "0")
    args = common.family_parser("x", quick="q", gpu="g").parse_args(["--history", str(path)])
    assert args.history == str(path) and common.history_path() == path
    x, means, whitener = random_tensor(6, 4, seed=1), random_tensor(2, 4, seed=2), random_tensor(4, 4, seed=3)
    call = lambda: torch_kernels.mahalanobis_score(x, means, whitener)  # noqa: E731
    best = common.seconds_per_call(call, 0.02)
    common.seconds_per_call(call, 0.02)  # the same case again in this run: a row of its own
    common.seconds_per_call(lambda: x @ whitener, 0.01)  # no torch_kernels op, no label: not recorded
    common.seconds_per_call(lambda: x @ whitener, 0.01, case={"op": "matmul", "backend": "torch",
                                                                "shape": "6x4,4x4", "dtype": "float32"})
    lines = history.load(path)
    assert len(lines[0]["control"]) == 5 and all(c > 0 for c in lines[0]["control"])  # the machine's speed then
    assert [line["case"] for line in lines] == ["mahalanobis_score/reference/6x4,2x4,4x4/float32",
                                                "mahalanobis_score/reference/6x4,2x4,4x4/float32#2",
                                                "matmul/torch/6x4,4x4/float32"]
    first = lines[0]
    assert (first["op"], first["backend"], first["dtype"]) == ("mahalanobis_score", "reference", "float32")
    assert first["device"] == torch_kernels.profiling.device_name("cpu")
    assert first["commit"] == common.git_commit() and first["library"] == torch_kernels.__version__
    assert first["versions"]["torch"] == torch.__version__ and set(first["versions"]) == {"torch", "triton", "jax",
                                                                                        "python"}
    # blocks of calls, or one call alone when one took longer than the budget (a busy machine)
    assert (len(first["seconds"]) >= 3 and best <= min(first["seconds"])) or first["seconds"] == [best]
    assert lines[0]["run"] == lines[2]["run"] and first["script"] == pathlib.Path(sys.argv[0]).stem

    # bisect's filter: another case is run once and not timed or recorded
    monkeypatch.setenv(common.CASE_ENV, "matmul/*")
    common.seconds_per_call(call, 5.0)  # would take 5 s if it were timed
    assert len(history.load(path)) == 3
    assert common.default_history_path("cpu: Some CPU (2 threads)").name == "cpu-Some-CPU.jsonl"
    assert common.default_history_path("cuda: NVIDIA H200").name == "cuda-NVIDIA-H200.jsonl"


# ---- the test ----

def brute_force_p(x, y) -> float:
    """P(U >= observed U) over every way to split the pooled timings into len(x) and len(y)."""
    def u(a, b):
        return sum((p > q) + 0.5 * (p == q) for p in a for q in b)

    pooled, observed = x + y, u(x, y)
    splits = list(itertools.combinations(range(len(pooled)), len(x)))
    hits = 0
    for chosen in splits:
        a = [pooled[i] for i in chosen]
        b = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        hits += u(a, b) >= observed - 1e-12
    return hits / len(splits)


@pytest.mark.parametrize("shift", [0.0, 0.3, 1.0, -0.5])
def test_mann_whitney_matches_the_count_over_every_arrangement(shift):
    gen = random.Random(7)
    x = [gen.gauss(shift, 1) for _ in range(6)]
    y = [gen.gauss(0, 1) for _ in range(7)]
    assert history.mann_whitney_greater(x, y) == pytest.approx(brute_force_p(x, y), abs=1e-12)


def test_the_normal_approximation_for_many_timings():
    gen = random.Random(8)
    x, y = [gen.gauss(0.4, 1) for _ in range(30)], [gen.gauss(0, 1) for _ in range(25)]
    u = sum(a > b for a in x for b in y)
    z = (u - 30 * 25 / 2 - 0.5) / math.sqrt(30 * 25 * 56 / 12)
    assert history.mann_whitney_greater(x, y) == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)), rel=1e-9)


def test_noise_is_the_scaled_median_absolute_deviation():
    samples = [1.0, 1.1, 0.9, 1.3, 1.0]
    assert history.relative_noise(samples) == pytest.approx(1.96 * 1.4826 * 0.1 / 1.0)


# ---- compare ----

def fake_line(commit, run, case, seconds, device="cpu: test", torch_version="2.13.0"):
    return {"run": run, "commit": commit, "script": "bench", "case": case, "device": device,
            "versions": {"torch": torch_version, "triton": None, "jax": None, "python": "3.11"}, "seconds": seconds}


def timings(gen, scale, n=10, noise=0.03):
    """Seeded timings as a busy machine gives them: a floor with occasional spikes added."""
    return [scale * (1 + abs(gen.gauss(0, noise)) + (gen.random() < 0.2) * gen.random() * 0.3) for _ in range(n)]


def write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_compare_finds_an_injected_slowdown_and_nothing_else(tmp_path, capsys):
    gen = random.Random(9)
    lines = [fake_line("a" * 40, f"r{run}", case, timings(gen, scale))
             for run in range(3) for case, scale in (("fast/ref/8/float32", 1e-5), ("steady/ref/8/float32", 2e-3))]
    lines.append(fake_line("a" * 40, "r0", "elsewhere/ref/8/float32", timings(gen, 1e-3), device="cuda: other"))
    lines += [fake_line("b" * 40, "r9", "fast/ref/8/float32", timings(gen, 1.4e-5)),  # 40% slower
              fake_line("b" * 40, "r9", "steady/ref/8/float32", timings(gen, 2e-3)),
              fake_line("b" * 40, "r9", "elsewhere/ref/8/float32", timings(gen, 5e-3), torch_version="2.14.0")]
    path = write(tmp_path / "h.jsonl", lines)
    png = tmp_path / "compare.png"
    status = history.main(["compare", "--history", str(path), "--png", str(png)])
    out = capsys.readouterr().out
    assert status == 1 and png.stat().st_size > 0
    rows = history.compare(history.load(path))
    # other device or other torch: never compared
    assert {r["case"]: r["verdict"] for r in rows} == {"fast/ref/8/float32": history.SLOWER,
                                                       "steady/ref/8/float32": history.SAME}
    slow = rows[0]
    assert slow["base_runs"] == 3 and slow["base_n"] == 30 and slow["new_n"] == 10
    base = [s for line in lines[:6:2] for s in line["seconds"]]  # the three runs of the fast case
    assert slow["change"] == pytest.approx(statistics.median(lines[-3]["seconds"]) / statistics.median(base) - 1)
    assert "| slower | bench | `fast/ref/8/float32`" in out and "1 slower" in out

    # the same history with no slowdown: exit 0; and a slowdown under the threshold is not one
    unchanged = write(tmp_path / "same.jsonl", lines[:7] + [fake_line("b" * 40, "r9", "fast/ref/8/float32",
                                                                       timings(gen, 1.05e-5))])
    assert history.main(["compare", "--history", str(unchanged), "--png", str(tmp_path / "s.png")]) == 0
    assert history.main(["compare", "--history", str(path), "--threshold", "50", "--png", str(png)]) == 0


def test_the_control_timings_tell_a_busy_machine_from_slower_code():
    gen = random.Random(12)
    quiet = lambda scale, n=8: [scale * (1 + gen.random() * 0.01) for _ in range(n)]  # noqa: E731

    def line(commit, run, scale, machine):
        return {**fake_line(commit, run, "op/ref/8/float32", quiet(scale * machine)), "control": quiet(machine, 5)}

    base = [line("a" * 40, f"r{i}", 1e-3, 1.0) for i in range(2)]
    busy = base + [line("b" * 40, "r9", 1e-3, 1.8)]  # everything 1.8x slower: the machine
    row = history.compare(busy, control=True)[0]
    assert row["verdict"] == history.SAME and row["machine"] == pytest.approx(0.8, abs=0.03)
    assert row["new_median"] == pytest.approx(1.8e-3, rel=0.02) and abs(row["change"]) < 0.03
    slower = history.compare(base + [line("b" * 40, "r9", 1.5e-3, 1.0)], control=True)[0]  # the code 1.5x slower
    assert slower["verdict"] == history.SLOWER and slower["change"] == pytest.approx(0.5, abs=0.03)
    # by default, and without controls on every line, the timings as measured: the busy machine reads as slower
    row = history.compare(busy)[0]
    assert row["verdict"] == history.SLOWER and row["machine"] == pytest.approx(0.8, abs=0.03)
    raw = history.compare([*base, {**line("b" * 40, "r9", 1e-3, 1.8), "control": None}], control=True)[0]
    assert raw["verdict"] == history.SLOWER and raw["machine"] is None


def test_compare_against_a_commit_or_another_file(tmp_path):
    gen = random.Random(10)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    base = [fake_line(head, "r0", "op/ref/8/float32", timings(gen, 1e-4))]
    middle = [fake_line("c" * 40, "r1", "op/ref/8/float32", timings(gen, 2e-4))]
    new = [fake_line("d" * 40, "r2", "op/ref/8/float32", timings(gen, 2e-4))]
    path = write(tmp_path / "h.jsonl", base + middle + new)
    assert history.compare(history.load(path))[0]["verdict"] == history.SAME  # default base: the commit before
    assert history.compare(history.load(path), base="HEAD")[0]["verdict"] == history.SLOWER
    other = write(tmp_path / "other.jsonl", base)
    assert history.compare(history.load(path), base=str(other))[0]["verdict"] == history.SLOWER
    with pytest.raises(ValueError, match="^base: "):
        history.compare(history.load(path), base="no-such-revision")
    few = write(tmp_path / "few.jsonl", [fake_line("e" * 40, "r", "op/ref/8/float32", [1.0, 1.1]),
                                         fake_line("f" * 40, "s", "op/ref/8/float32", [3.0, 3.1])])
    assert history.compare(history.load(few))[0]["verdict"] == history.TOO_FEW  # p can never reach alpha


def test_false_alarms_replays_the_runs_of_one_commit(tmp_path):
    gen = random.Random(11)
    quiet = lambda scale: [scale * (1 + gen.random() * 0.01) for _ in range(8)]  # noqa: E731
    lines = [fake_line("0" * 40, "old", "a/ref/8/float32", quiet(5.0))]  # another commit: not replayed
    for run in range(4):
        lines += [fake_line("1" * 40, f"r{run}", "a/ref/8/float32", quiet(2.0 if run == 3 else 1.0)),
                  fake_line("1" * 40, f"r{run}", "b/ref/8/float32", quiet(1.0))]
    found = history.false_alarms(lines)
    assert found["runs"] == 4
    # each of runs 1-3 against run 0-2 (3 x 2 cases), and against all runs before it: only run 3's a is slower
    for counts in found["counts"].values():
        assert counts == {"compared": 6, history.SLOWER: 1, history.FASTER: 0, history.TOO_FEW: 0}


# ---- bisect ----

BENCH = '''import json, statistics, sys, time
delay = float(open("delay.txt").read())
samples = []
for _ in range(5):
    start = time.perf_counter()
    time.sleep(delay)
    samples.append(time.perf_counter() - start)
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"script": "bench", "case": "sleep/python/1/none", "seconds": samples}) + "\\n")
'''


def test_bisect_names_the_planted_slow_commit_and_leaves_the_checkout_alone(tmp_path, monkeypatch):
    for key in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{key}_NAME", "test")
        monkeypatch.setenv(f"GIT_{key}_EMAIL", "test@example.com")
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()

    git("init", "--quiet", "--initial-branch=main")
    (repo / "bench.py").write_text(BENCH)
    shas = []
    for i, delay in enumerate([0.001, 0.001, 0.001, 0.001, 0.03, 0.03, 0.03]):  # slow from the fifth commit
        (repo / "delay.txt").write_text(str(delay))
        (repo / "notes.txt").write_text(f"commit {i}\n")
        git("add", "-A")
        git("commit", "--quiet", "-m", f"commit {i}")
        shas.append(git("rev-parse", "HEAD"))
    (repo / "notes.txt").write_text("uncommitted work\n")
    status_before = git("status", "--porcelain")

    found = history.bisect(shas[0], shas[-1], "sleep/*", repo=repo, command="{python} bench.py {history}",
                           timeout_s=60)
    assert found["first_bad"] == shas[4], found["log"]
    assert found["good_median"] < found["cut"] < found["bad_median"]
    assert git("rev-parse", "HEAD") == shas[-1] and git("status", "--porcelain") == status_before
    assert (repo / "notes.txt").read_text() == "uncommitted work\n"
    assert len(git("worktree", "list").splitlines()) == 1 and not (repo / ".git" / "BISECT_LOG").exists()

    with pytest.raises(ValueError, match="^case: .* is not slower"):
        history.bisect(shas[4], shas[-1], "sleep/*", repo=repo, command="{python} bench.py {history}", timeout_s=60)
    with pytest.raises(ValueError, match="^case: 'nothing' wrote no timings"):
        history.bisect(shas[0], shas[-1], "nothing", repo=repo, command="{python} bench.py {history}", timeout_s=60)

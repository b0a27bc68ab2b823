"""The benchmark history, read back: what got slower or faster (``compare``) and which commit did it (``bisect``).

    python -m torch_kernels bench compare [--base REV|FILE] [--threshold PCT] [--history FILE] [--png FILE]
    python -m torch_kernels bench bisect GOOD BAD --case "op/backend/shape/dtype" [--script NAME] [--command CMD]
    python -m torch_kernels bench false-alarms [--history FILE]   # runs of one commit against each other

The history is what the benchmark scripts append with ``--history`` (``common.record_history``): one
JSON line per measurement, holding every timed block's seconds per call and, for CPU cases, the
timings of a fixed control workload run just after (``common.control_timings``). Lines are compared
only with lines of the same script, case, device and torch/triton/jax/Python versions.

``compare`` takes, for every case, its newest line and a base: the lines of commit ``REV``, the
newest commit's lines of another history ``FILE``, or by default the lines of the latest earlier
commit (the earlier runs of the same commit if there is none), all of them pooled, so that the
base's spread includes how much runs differ from each other. The table shows how much the control
workload's time changed between the runs ("machine"); ``--control`` divides each line's timings by
its control's median first, so that a machine busier during one run than another would not read as
a change of the code. It is not the default: on the shared 2-core machine this was built on, the
control's short matrix products did not follow the load the benchmarks saw (a run with both cores
kept busy by other processes was 3-8x slower; the control 2-10%). A case is slower when all three hold:
a one-sided Mann-Whitney U test over the two sets of timings gives p < ``--alpha`` (no assumption
about the shape of the noise, which on a shared machine is anything but normal), the change of the
median exceeds ``--threshold``, and it exceeds the measured noise (the larger side's 95% band,
1.96 x 1.4826 x the median absolute deviation, relative to the median). The exit status is 1 when
any case is slower, so CI or a cron job can gate on it.

``bisect`` checks a commit out in a temporary worktree (the user's checkout stays as it is), runs
one case there at GOOD and at BAD (until it has ``END_TIMINGS`` timings of each, at most ``END_RUNS``
runs), checks with compare's test that BAD is slower, and then runs ``git bisect`` with that case as
the test: a commit is bad when the case's median is closer to BAD's than to GOOD's (the geometric
middle).
The command that measures defaults to the case's script with ``--quick`` and only that case timed
(``$TORCH_KERNELS_BENCH_CASE``), the commit's own code imported; a commit where it fails is skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import CASE_ENV, HISTORY_ENV, RESULTS, ROOT, case_matches, markdown_table  # noqa: E402

SLOWER, FASTER, SAME, TOO_FEW = "slower", "faster", "same", "too few timings"
DEFAULT_COMMAND = "{python} benchmarks/{script}.py --quick --history {history}"
END_TIMINGS, END_RUNS = 8, 3  # bisect measures GOOD and BAD until it has this many timings, at most this many runs


# ------------------------------------------------------------------------------------------ reading

def load(path: str | os.PathLike) -> list[dict]:
    """The history's lines, in the order written (a line that is not JSON is skipped with a warning)."""
    lines = []
    for number, text in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        if text.strip():
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                print(f"{path}:{number}: not a JSON line, skipped", file=sys.stderr)
    return lines


def key(line: dict) -> tuple:
    """What must be equal for two lines to be compared: script, case, device and environment versions."""
    versions = line.get("versions") or {}
    return (line.get("script"), line.get("case"), line.get("device"),
            tuple(sorted((k, v) for k, v in versions.items())))


def _commit(line: dict) -> str:
    return str(line.get("commit") or "unknown")


def resolve_revision(revision: str, repo: pathlib.Path = ROOT) -> str:
    """``revision``'s full commit hash in ``repo``; a ValueError naming it when git does not know it."""
    done = subprocess.run(["git", "rev-parse", "--verify", f"{revision}^{{commit}}"], cwd=repo,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"base: {revision!r} is neither a history file nor a commit git knows: {done.stderr.strip()}")
    return done.stdout.strip()


def pairs(lines: list[dict], base: str | None = None, repo: pathlib.Path = ROOT) -> list[tuple[dict, list[dict]]]:
    """``(newest line, base lines)`` of every case in ``lines`` that has a base (see the module's docstring)."""
    base_lines = None
    if base is not None and pathlib.Path(base).is_file():
        other = load(base)
        newest = _commit(other[-1]) if other else None
        base_lines = [line for line in other if _commit(line) == newest]
    elif base is not None:
        sha = resolve_revision(base, repo)
        base_lines = [line for line in lines if _commit(line).split("+")[0] == sha]
    newest_of: dict[tuple, int] = {}
    for i, line in enumerate(lines):
        newest_of[key(line)] = i
    found = []
    for k, i in newest_of.items():
        new = lines[i]
        if base_lines is not None:
            chosen = [line for line in base_lines if key(line) == k and line is not new]
        else:
            earlier = [line for line in lines[:i] if key(line) == k]
            others = [line for line in earlier if _commit(line) != _commit(new)]
            chosen = [line for line in others if _commit(line) == _commit(others[-1])] if others else earlier
        if chosen:
            found.append((new, chosen))
    return found


# ----------------------------------------------------------------------------------------- the test

def mann_whitney_greater(x: list[float], y: list[float]) -> float:
    """One-sided p-value of the Mann-Whitney U test that ``x`` tends to be larger than ``y``.

    U counts the pairs with x > y (ties a half). Exact (the distribution of U over every arrangement,
    by the usual recursion) when there are at most 400 pairs, else the normal approximation with the
    tie correction and a continuity correction.
    """
    n, m = len(x), len(y)
    if not n or not m:
        raise ValueError("x: both samples need at least one timing")
    u = sum((a > b) + 0.5 * (a == b) for a in x for b in y)
    if n * m <= 400:
        counts = _u_counts(n, m)
        total = sum(counts)
        return sum(counts[math.ceil(u - 1e-9):]) / total
    values = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    ties = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1][0] == values[i][0]:
            j += 1
        ties.append(j - i + 1)
        i = j + 1
    total = n + m
    variance = n * m / 12 * ((total + 1) - sum(t**3 - t for t in ties) / (total * (total - 1)))
    if variance <= 0:
        return 1.0
    z = (u - n * m / 2 - 0.5) / math.sqrt(variance)
    return 0.5 * math.erfc(z / math.sqrt(2))


def _u_counts(n: int, m: int) -> list[int]:
    """How many of the C(n+m, n) arrangements of n x's and m y's give each U = 0 .. n*m."""
    # table[i][j] = the counts for i x's and j y's: the largest value is an x (it beats all j y's) or a y
    table = [[[1] for _ in range(m + 1)] for _ in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            with_x, with_y = table[i - 1][j], table[i][j - 1]
            counts = [0] * (i * j + 1)
            for u, c in enumerate(with_x):
                counts[u + j] += c
            for u, c in enumerate(with_y):
                counts[u] += c
            table[i][j] = counts
    return table[n][m]


def relative_noise(samples: list[float]) -> float:
    """The spread of ``samples`` relative to their median: the half-width of a 95% band, 1.96 x the
    median absolute deviation scaled to a standard deviation (x 1.4826), over the median."""
    if len(samples) < 2:
        return 0.0
    middle = statistics.median(samples)
    deviation = statistics.median(abs(s - middle) for s in samples)
    return 1.96 * 1.4826 * deviation / middle if middle > 0 else 0.0


def compare_case(new: list[float], base: list[float], threshold: float, alpha: float) -> dict:
    """One case's verdict: medians, relative change, noise, the two one-sided p-values and ``verdict``."""
    new_median, base_median = statistics.median(new), statistics.median(base)
    change = new_median / base_median - 1
    noise = max(relative_noise(new), relative_noise(base))
    p_slower, p_faster = mann_whitney_greater(new, base), mann_whitney_greater(base, new)
    smallest_p = 1 / math.comb(len(new) + len(base), len(new))  # the exact test's floor
    if smallest_p >= alpha:
        verdict = TOO_FEW
    elif p_slower < alpha and change > threshold and change > noise:
        verdict = SLOWER
    elif p_faster < alpha and -change > threshold and -change > noise:
        verdict = FASTER
    else:
        verdict = SAME
    return {"base_median": base_median, "new_median": new_median, "change": change, "noise": noise,
            "p_slower": p_slower, "p_faster": p_faster, "verdict": verdict, "new_n": len(new), "base_n": len(base)}


def scaled(new: dict, base_lines: list[dict],
           control: bool = False) -> tuple[list[float], list[float], float | None]:
    """The timings to test, and the machine's change between the runs (the new line's control median
    over the base lines', less 1; None unless every line has control timings). ``control``: each
    line's timings divided by its own control median (the machine's speed just then), else as measured."""
    lines = [new, *base_lines]
    if not all(line.get("control") for line in lines):
        return list(new["seconds"]), [s for line in base_lines for s in line["seconds"]], None
    speed = {id(line): statistics.median(line["control"]) for line in lines}
    machine = speed[id(new)] / statistics.median(speed[id(line)] for line in base_lines) - 1
    if not control:
        return list(new["seconds"]), [s for line in base_lines for s in line["seconds"]], machine
    return ([s / speed[id(new)] for s in new["seconds"]],
            [s / speed[id(line)] for line in base_lines for s in line["seconds"]], machine)


def compare(lines: list[dict], base: str | None = None, threshold: float = 0.1, alpha: float = 0.01,
            repo: pathlib.Path = ROOT, control: bool = False) -> list[dict]:
    """Every case with a base, compared (:func:`compare_case` on :func:`scaled` timings), with its script,
    case, device, commits, the measured medians in seconds and the machine's own change (``machine``)."""
    rows = []
    for new, base_lines in pairs(lines, base, repo):
        new_scaled, base_scaled, machine = scaled(new, base_lines, control)
        row = compare_case(new_scaled, base_scaled, threshold, alpha)
        row["new_median"] = statistics.median(new["seconds"])
        row["base_median"] = statistics.median(s for line in base_lines for s in line["seconds"])
        rows.append({"script": new.get("script"), "case": new.get("case"), "device": new.get("device"),
                     "new_commit": _commit(new), "base_commits": sorted({_commit(b) for b in base_lines}),
                     "base_runs": len(base_lines), "machine": machine, **row})
    order = {SLOWER: 0, FASTER: 1, TOO_FEW: 2, SAME: 3}
    rows.sort(key=lambda r: (order[r["verdict"]], -abs(r["change"])))
    return rows


def _seconds(value: float) -> str:
    for unit, scale in (("s", 1), ("ms", 1e-3), ("us", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def table(rows: list[dict]) -> str:
    """The comparison as a Markdown table, slower cases first."""
    header = ["verdict", "script", "case", "base", "new", "machine", "change", "noise", "p (slower)",
              "timings new/base"]
    body = [[r["verdict"], r["script"], f"`{r['case']}`", _seconds(r["base_median"]), _seconds(r["new_median"]),
             "-" if r["machine"] is None else f"{r['machine'] * 100:+.0f}%",
             f"{r['change'] * 100:+.1f}%", f"±{r['noise'] * 100:.1f}%", f"{r['p_slower']:.2g}",
             f"{r['new_n']}/{r['base_n']} ({r['base_runs']} run{'s' if r['base_runs'] > 1 else ''})"] for r in rows]
    return markdown_table(header, body)


def plot(rows: list[dict], path: pathlib.Path) -> bool:
    """The changes as a bar chart with the noise as error bars; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    colors = {SLOWER: "tab:red", FASTER: "tab:green", SAME: "tab:gray", TOO_FEW: "lightgray"}
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(rows) + 1.5))
    names = [_shortened(f"{r['script']}: {r['case']}", 56) for r in rows]
    ax.barh(range(len(rows)), [r["change"] * 100 for r in rows], xerr=[r["noise"] * 100 for r in rows],
            color=[colors[r["verdict"]] for r in rows], capsize=2)
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("change of the median time, % (bars: noise, 95% band)")
    ax.set_title("red: slower, green: faster, gray: within the noise, light gray: too few timings", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _shortened(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 12] + "..." + text[-9:]


def default_history() -> pathlib.Path:
    """This machine's default history file (``benchmarks/history/<device>.jsonl``)."""
    from common import default_history_path

    return default_history_path()


def main_compare(args) -> int:
    path = args.history or default_history()
    if not pathlib.Path(path).is_file():
        print(f"compare: no history at {path} (run a benchmark with --history first)", file=sys.stderr)
        return 2
    lines = load(path)
    rows = compare(lines, args.base, args.threshold / 100, args.alpha, control=args.control)
    unmatched = len({key(line) for line in lines}) - len(rows)
    if not rows:
        print(f"compare: no case in {path} has a base to compare with", file=sys.stderr)
        return 2
    print(table(rows))
    slower = [r for r in rows if r["verdict"] == SLOWER]
    print(f"\n{len(slower)} slower, {sum(r['verdict'] == FASTER for r in rows)} faster, {len(rows)} compared "
          f"(threshold {args.threshold:g}%, alpha {args.alpha:g})"
          + (f"; {unmatched} without a base (new cases, or no line of the same device and versions)" if unmatched else ""))
    if args.png and plot(rows, args.png):
        print(f"chart: {args.png}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 1 if slower else 0


def false_alarms(lines: list[dict], threshold: float = 0.1, alpha: float = 0.01, control: bool = False) -> dict:
    """How often the test flags runs of one unchanged commit: every run of the history's newest commit
    after its first, compared case by case with the run just before it and with all earlier runs pooled.
    Returns the counts of comparisons, slower and faster flags (and too-few-timings rows) for each."""
    commit = _commit(lines[-1])
    runs = list(dict.fromkeys(line.get("run") for line in lines if _commit(line) == commit))
    by_run = {run: {key(line): line for line in lines if line.get("run") == run and _commit(line) == commit}
              for run in runs}
    counts = {mode: {"compared": 0, SLOWER: 0, FASTER: 0, TOO_FEW: 0} for mode in ("previous run", "earlier runs")}
    for i, run in enumerate(runs[1:], 1):
        for k, new in by_run[run].items():
            bases = {"previous run": [by_run[runs[i - 1]].get(k)],
                     "earlier runs": [by_run[r].get(k) for r in runs[:i]]}
            for mode, chosen in bases.items():
                chosen = [line for line in chosen if line is not None]
                if not chosen:
                    continue
                verdict = compare_case(*scaled(new, chosen, control)[:2], threshold, alpha)["verdict"]
                counts[mode]["compared"] += verdict != TOO_FEW
                if verdict != SAME:
                    counts[mode][verdict] += 1
    return {"commit": commit, "runs": len(runs), "counts": counts}


def main_false_alarms(args) -> int:
    path = args.history or default_history()
    found = false_alarms(load(path), args.threshold / 100, args.alpha, args.control)
    print(f"{found['runs']} runs of {found['commit'][:12]} in {path} "
          f"(threshold {args.threshold:g}%, alpha {args.alpha:g})")
    for mode, c in found["counts"].items():
        flagged = c[SLOWER] + c[FASTER]
        rate = flagged / c["compared"] if c["compared"] else float("nan")
        print(f"  each run against the {mode}: {flagged} of {c['compared']} case comparisons flagged ({rate:.1%}): "
              f"{c[SLOWER]} slower, {c[FASTER]} faster; {c[TOO_FEW]} with too few timings to test")
    return 0


# ---------------------------------------------------------------------------------------- bisection

def measure_case(tree: pathlib.Path, command: str, case: str, script: str | None, timeout_s: float) -> dict | None:
    """Run ``command`` in ``tree`` with a fresh history file and return the line of ``case`` it wrote
    (None when the command fails or writes no such line)."""
    with tempfile.TemporaryDirectory() as scratch:
        history = pathlib.Path(scratch) / "history.jsonl"
        text = command.format(python=shlex.quote(sys.executable), history=shlex.quote(str(history)),
                              script=script or "", tree=shlex.quote(str(tree)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]),
               CASE_ENV: case, HISTORY_ENV: str(history)}
        try:
            done = subprocess.run(text, shell=True, cwd=tree, env=env, capture_output=True, text=True,
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"  {text}: timed out after {timeout_s:g} s", file=sys.stderr)
            return None
        if done.returncode != 0:
            print(f"  {text}: exit {done.returncode}\n{done.stderr[-1500:]}", file=sys.stderr)
        found = [line for line in (load(history) if history.is_file() else [])
                 if case_matches(case, line, line.get("script"))]
        return found[-1] if found else None


def _git(repo: pathlib.Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=check)


def bisect(good: str, bad: str, case: str, repo: pathlib.Path = ROOT, script: str | None = None,
           command: str = DEFAULT_COMMAND, timeout_s: float = 1800, threshold: float = 0.1,
           alpha: float = 0.01) -> dict:
    """The first commit between ``good`` and ``bad`` where ``case`` got slow (see the module's docstring).

    Returns ``{"first_bad": sha or None, "good_median", "bad_median", "cut", "log"}``; a ValueError when
    the case does not run at either end or is not slower at ``bad`` by compare's test
    (:func:`compare_case` with ``threshold`` and ``alpha``).
    """
    good_sha, bad_sha = resolve_revision(good, repo), resolve_revision(bad, repo)
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="bench-bisect-"))
    tree = scratch / "tree"
    _git(repo, "worktree", "add", "--detach", str(tree), bad_sha)
    try:
        ends = {}
        for name, sha in (("bad", bad_sha), ("good", good_sha)):
            _git(tree, "checkout", "--quiet", "--detach", sha)
            ends[name] = []
            for _ in range(END_RUNS):  # a slow case gives few timings a run: enough for the test at the ends
                line = measure_case(tree, command, case, script, timeout_s)
                if line is None:
                    raise ValueError(f"case: {case!r} wrote no timings at {name} ({sha[:12]})")
                ends[name] += line["seconds"]
                if len(ends[name]) >= END_TIMINGS:
                    break
        verdict = compare_case(ends["bad"], ends["good"], threshold, alpha)
        ends = {name: statistics.median(seconds) for name, seconds in ends.items()}
        if verdict["verdict"] != SLOWER:
            raise ValueError(f"case: {case!r} is not slower at {bad} ({_format(ends['bad'])}) than at {good} "
                             f"({_format(ends['good'])}): change {verdict['change']:+.1%}, noise "
                             f"±{verdict['noise']:.1%}, p {verdict['p_slower']:.2g} ({verdict['verdict']}); "
                             "nothing to bisect")
        cut = math.sqrt(ends["good"] * ends["bad"])
        _git(tree, "bisect", "start", bad_sha, good_sha)
        step = [sys.executable, str(pathlib.Path(__file__).resolve()), "bisect-step", "--case", case,
                "--cut", repr(cut), "--command", command, "--timeout", str(timeout_s),
                *(["--script", script] if script else [])]
        run = _git(tree, "bisect", "run", *step, check=False)
        log = run.stdout + run.stderr
        first = None
        for text in log.splitlines():
            if text.endswith("is the first bad commit"):
                first = text.split()[0]
        _git(tree, "bisect", "reset", check=False)
        return {"first_bad": first, "good_median": ends["good"], "bad_median": ends["bad"], "cut": cut, "log": log}
    finally:
        _git(repo, "worktree", "remove", "--force", str(tree), check=False)
        _git(repo, "worktree", "prune", check=False)
        shutil.rmtree(scratch, ignore_errors=True)


def _format(seconds: float) -> str:
    return _seconds(seconds)


def main_bisect_step(args) -> int:
    """``git bisect run``'s test: 0 (good) when the case's median is under the cut, 1 (bad) over, 125 (skip)
    when the case does not run at this commit."""
    tree = pathlib.Path.cwd()
    line = measure_case(tree, args.command, args.case, args.script, args.timeout)
    if line is None:
        return 125
    median = statistics.median(line["seconds"])
    print(f"bisect step: {args.case} median {_format(median)}, cut {_format(args.cut)}")
    return 1 if median > args.cut else 0


def script_of(case: str, path: pathlib.Path | None) -> str | None:
    """The script of the newest history line ``case`` names, for the default command."""
    if path is None or not pathlib.Path(path).is_file():
        return None
    found = [line for line in load(path) if case_matches(case, line, line.get("script"))]
    return found[-1].get("script") if found else None


def main_bisect(args) -> int:
    script = args.script
    if script is None and "{script}" in args.command:
        script = script_of(args.case, args.history or default_history())
        if script is None:
            print("bisect: --script: no line of the history names this case; say which benchmark script runs it",
                  file=sys.stderr)
            return 2
    repo = pathlib.Path(args.repo) if args.repo else ROOT
    try:
        found = bisect(args.good, args.bad, args.case, repo, script, args.command, args.timeout,
                       args.threshold / 100, args.alpha)
    except ValueError as error:
        print(f"bisect: {error}", file=sys.stderr)
        return 2
    print(f"{args.case}: {_format(found['good_median'])} at {args.good}, {_format(found['bad_median'])} at {args.bad}; "
          f"a commit is slow over {_format(found['cut'])}")
    if found["first_bad"] is None:
        print(f"bisect: git bisect named no first bad commit:\n{found['log'][-3000:]}", file=sys.stderr)
        return 1
    subject = _git(repo, "log", "-1", "--format=%h %s", found["first_bad"], check=False).stdout.strip()
    print(f"first slow commit: {found['first_bad']}\n  {subject}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_kernels bench",
                                     description="compare the benchmark history with a base, or bisect a slowdown")
    sub = parser.add_subparsers(dest="action", required=True)
    cmp = sub.add_parser("compare", help="what got slower or faster than a base (exit 1 on a slowdown)")
    cmp.add_argument("--base", default=None, help="a commit (REV) or another history FILE (default: the latest "
                                                   "earlier commit in the history)")
    cmp.add_argument("--threshold", type=float, default=10.0, help="percent a median must change by (default 10)")
    cmp.add_argument("--alpha", type=float, default=0.01, help="the test's significance level (default 0.01)")
    cmp.add_argument("--history", type=pathlib.Path, default=None, help="history file (default: this device's)")
    cmp.add_argument("--control", action="store_true", help="divide each line's timings by its control timings' median")
    cmp.add_argument("--png", type=pathlib.Path, default=RESULTS / "bench-compare.png", help="chart to write")
    cmp.add_argument("--json", type=pathlib.Path, default=None, help="write the rows as JSON too")
    bis = sub.add_parser("bisect", help="the first commit between GOOD and BAD where a case got slow")
    bis.add_argument("good")
    bis.add_argument("bad")
    bis.add_argument("--case", required=True, help="the case, as in the compare table (shell patterns allowed)")
    bis.add_argument("--script", default=None, help="the benchmark script that runs it (default: from the history)")
    bis.add_argument("--command", default=DEFAULT_COMMAND,
                     help="what measures a commit, run in its worktree ({python}, {script}, {history}, {tree} "
                          f"filled in; default {DEFAULT_COMMAND!r})")
    bis.add_argument("--repo", default=None, help="the repository (default: this checkout)")
    bis.add_argument("--history", type=pathlib.Path, default=None, help="history to find the case's script in")
    bis.add_argument("--timeout", type=float, default=1800, help="seconds one measurement may take")
    bis.add_argument("--threshold", type=float, default=10.0, help="percent BAD must be slower by, as for compare")
    bis.add_argument("--alpha", type=float, default=0.01, help="as for compare (default 0.01)")
    fa = sub.add_parser("false-alarms", help="how often compare flags runs of one unchanged commit "
                                             "(record several runs of it first)")
    fa.add_argument("--history", type=pathlib.Path, default=None, help="history file (default: this device's)")
    fa.add_argument("--threshold", type=float, default=10.0, help="percent, as for compare (default 10)")
    fa.add_argument("--alpha", type=float, default=0.01, help="as for compare (default 0.01)")
    fa.add_argument("--control", action="store_true", help="as for compare")
    step = sub.add_parser("bisect-step", help=argparse.SUPPRESS)
    step.add_argument("--case", required=True)
    step.add_argument("--cut", type=float, required=True)
    step.add_argument("--command", required=True)
    step.add_argument("--script", default=None)
    step.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    if args.action in ("compare", "bisect", "false-alarms") and args.threshold < 0:
        parser.error("--threshold: expected a percentage >= 0")
    if args.action == "bisect-step":
        try:
            return main_bisect_step(args)
        except Exception:  # noqa: BLE001 - a broken step stops git bisect (>= 128) instead of marking a commit bad
            import traceback

            traceback.print_exc()
            return 255
    return {"compare": main_compare, "bisect": main_bisect, "false-alarms": main_false_alarms}[args.action](args)


if __name__ == "__main__":
    sys.exit(main())

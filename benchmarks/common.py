"""What every benchmark script shares: timing, tables, the results folder, peer environments, the
family scripts' common options, the benchmark history (``--history``: every measurement's timings
appended as a JSON line, which benchmarks/history.py compares and bisects), and what each family
script declares for the scripts that run or summarize all of them (``family_benchmarks``).

Only the standard library and torch, so that peer scripts run in their own environments can
import it too; torch only inside functions, so that ``python benchmarks/common.py gpu-steps``
(benchmarks/gpu.sh's list of family steps) starts in no time.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
# pytorch-ood needs torchvision, which does not install beside the CPU torch the project pins;
# benchmarks/setup.sh gives it an environment of its own.
PEERS_PYTHON = pathlib.Path(os.environ.get("TORCH_KERNELS_PEERS_PYTHON", ROOT / ".venv-peers" / "bin" / "python"))
# vLLM pins its own torch and transformers: scripts/setup_vllm.sh makes this environment.
VLLM_PYTHON = pathlib.Path(os.environ.get("TORCH_KERNELS_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def seconds_per_call(fn, budget_s: float = 0.5, sync=None, case: dict | None = None) -> float:
    """Wall time of one ``fn()``: the fastest of about ten timed blocks of calls in ``budget_s``.

    The minimum, not the mean, because this machine's noise only ever adds time. The first
    call (compiles, caches, kernel loads) is not timed; a call slower than the budget after it
    is timed once, alone. ``sync`` (e.g. ``torch.cuda.synchronize``) waits for an asynchronous
    device: it runs before each clock reading, so a block counts the work it queued.

    With the benchmark history on (``--history``, or ``$TORCH_KERNELS_BENCH_HISTORY``), every block's
    time per call is appended to it as one line for this measurement (:func:`record_history`): its
    case is the ``torch_kernels`` op calls the first call made (:func:`case_of`), or ``case`` (a dict
    of ``op``, ``backend``, ``shape``, ``dtype``) for code that calls none; code that calls none and
    has no ``case`` is timed but not recorded. With ``$TORCH_KERNELS_BENCH_CASE`` set (``bench
    bisect``), a measurement of another case returns its first call's time without timing more.
    """
    recording = history_path() is not None or os.environ.get(CASE_ENV)
    if recording:
        start = time.perf_counter()
        found = case_of(fn, sync)
        first = time.perf_counter() - start
        case = case or found
        if case is not None:
            case = _unique_case(case)
        if os.environ.get(CASE_ENV) and (case is None or not case_matches(os.environ[CASE_ENV], case)):
            return first
    else:
        fn()
        if sync:
            sync()
    start = time.perf_counter()
    fn()
    if sync:
        sync()
    best = time.perf_counter() - start
    samples = [best]
    if best < budget_s:
        calls = max(1, int(budget_s / 10 / best))
        deadline = time.perf_counter() + budget_s
        samples = []
        while len(samples) < 3 or time.perf_counter() < deadline:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            if sync:
                sync()
            samples.append((time.perf_counter() - start) / calls)
        best = min(best, *samples)
    if recording and case is not None:
        on_cpu = str(case.get("device") or "cpu").startswith("cpu")
        record_history(case, samples, control=control_timings() if on_cpu else None)
    return best


_control_input = None


def control_timings(blocks: int = 5) -> list[float]:
    """Seconds of each of ``blocks`` runs of a fixed CPU workload (float32 matrix products), timed right
    after a measurement and recorded beside it: how fast the machine was just then. On a shared
    machine other processes' load comes and goes; compare shows the control's change between runs,
    and ``--control`` divides by it."""
    global _control_input
    import torch

    if _control_input is None:
        _control_input = torch.randn(192, 192, generator=torch.Generator().manual_seed(0))
    a = _control_input

    def work():
        for _ in range(4):
            torch.mm(a, a)

    work()
    timings = []
    for _ in range(blocks):
        start = time.perf_counter()
        work()
        timings.append(time.perf_counter() - start)
    return timings


# ------------------------------------------------------------------------------ the benchmark history

HISTORY = BENCHMARKS / "history"
HISTORY_ENV = "TORCH_KERNELS_BENCH_HISTORY"  # a history file, or 1 for the default one
CASE_ENV = "TORCH_KERNELS_BENCH_CASE"  # only the measurements of this case are timed (bench bisect)
_RUN = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"  # this process's measurements, one run
_cases_seen: dict[str, int] = {}


def history_path() -> pathlib.Path | None:
    """The history file this process appends to, or None: ``$TORCH_KERNELS_BENCH_HISTORY`` (set by the
    scripts' ``--history [PATH]``), ``1`` meaning ``benchmarks/history/<device>.jsonl``."""
    setting = os.environ.get(HISTORY_ENV, "").strip()
    if setting in ("", "0"):
        return None
    return default_history_path() if setting == "1" else pathlib.Path(setting)


def default_history_path(device: str | None = None) -> pathlib.Path:
    """``benchmarks/history/<device name, as a file name>.jsonl`` for ``device`` (default: this machine's
    accelerator, else its CPU); a CPU's thread count is left out of the file name (measurements with
    other counts share the file, and each line's device, which compare matches, keeps it)."""
    name = re.sub(r"\s*\(\d+ threads?\)", "", device or device_label())
    return HISTORY / (re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") + ".jsonl")


def device_label(device_type: str | None = None) -> str:
    """The device results are recorded under: the accelerator's model, or the CPU's model and threads
    (torch_kernels.profiling.device_name, which the profile's peaks use too)."""
    import torch

    from torch_kernels.profiling import device_name

    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return device_name(device_type)


def case_of(fn, sync=None) -> dict | None:
    """Calls ``fn()`` once with the ``torch_kernels`` op calls recorded, and names its case from them:
    ``op`` and ``backend`` (each distinct one in call order, joined by ``+``), and the first call's
    ``shape`` (its tensor arguments' shapes, then its other arguments), ``dtype`` (its first floating
    tensor's) and ``device``. None when ``fn`` called no op (or a profile or the telemetry is already
    recording, which would miss them)."""
    try:
        from torch_kernels import profiling
    except ImportError:
        profiling = None
    if profiling is None or profiling._telemetry is not None or profiling._active is not None:
        fn()
        if sync:
            sync()
        return None
    telemetry = profiling.Telemetry(seconds=1e9, max_events=10_000)._start()
    try:
        fn()
        if sync:
            sync()
    finally:
        telemetry.stop()
    events = telemetry.events()
    if not events:
        return None
    first = events[0]
    floating = [d for d in first["dtypes"] if d.startswith(("float", "bfloat"))] or first["dtypes"] or ["-"]
    shape = ",".join("x".join(map(str, s)) or "scalar" for s in first["shapes"])
    if first["arguments"]:
        shape += ";" + ",".join(map(str, first["arguments"]))
    return {"op": "+".join(dict.fromkeys(e["op"] for e in events)),
            "backend": "+".join(dict.fromkeys(e["backend"] for e in events)),
            "shape": shape, "dtype": floating[0], "device": first["device"]}


def case_name(case: dict) -> str:
    """``op/backend/shape/dtype``: how a case is named in the history, the compare table and ``--case``."""
    return "/".join(str(case.get(key, "-")) for key in ("op", "backend", "shape", "dtype"))


def case_matches(pattern: str, case: dict, script: str | None = None) -> bool:
    """Whether ``pattern`` (shell-style: ``*`` and ``?``) names ``case``, written as
    ``op/backend/shape/dtype`` or with the script first, ``script/op/backend/shape/dtype``."""
    name = case.get("case") or case_name(case)
    script = script or case.get("script") or _script()
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(f"{script}/{name}", pattern)


def _unique_case(case: dict) -> dict:
    """``case`` with ``case`` (its name) added; a second measurement of the same case in this run gets
    ``#2`` after its name, and so on, so each stays a row of its own in every run."""
    name = case_name(case)
    _cases_seen[name] = seen = _cases_seen.get(name, 0) + 1
    return {**case, "case": name if seen == 1 else f"{name}#{seen}"}


def _script() -> str:
    return pathlib.Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else "python"


def environment_versions() -> dict[str, str | None]:
    """The versions results depend on besides the code: torch, triton, jax, Python (read from the
    installed packages' metadata, importing nothing)."""
    import importlib.metadata
    import platform

    versions = {}
    for package in ("torch", "triton", "jax"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    versions["python"] = platform.python_version()
    return versions


def git_commit(root: pathlib.Path = ROOT) -> str | None:
    """The checkout's commit, with ``+dirty`` when tracked files differ from it; None outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")


_context: dict | None = None


def record_history(case: dict, samples: list[float], path: pathlib.Path | None = None,
                   control: list[float] | None = None) -> dict:
    """Append one measurement to the history (``path``, default :func:`history_path`) as a JSON line:
    the run, time, commit, script, case (its name and fields), device, library and environment versions,
    ``seconds``, every timed block's seconds per call, and ``control``, :func:`control_timings` taken
    just after (CPU cases). Returns the line's dict."""
    global _context
    if _context is None:
        try:
            import torch_kernels

            library = torch_kernels.__version__
        except ImportError:  # a peer script in an environment of its own
            library = None
        _context = {"commit": git_commit(), "library": library, "versions": environment_versions()}
    device = case.get("device") or device_label()
    line = {"run": _RUN, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": _context["commit"],
            "script": _script(), **{key: case.get(key) for key in ("case", "op", "backend", "shape", "dtype")},
            "device": device, "library": _context["library"], "versions": _context["versions"],
            "seconds": [float(s) for s in samples],
            "control": None if control is None else [float(c) for c in control]}
    line["case"] = line["case"] or case_name(case)
    if path is None:
        setting = os.environ.get(HISTORY_ENV, "").strip()
        path = default_history_path(device) if setting in ("", "0", "1") else pathlib.Path(setting)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as file:
        file.write(json.dumps(line) + "\n")
    return line


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def run_peer(script: str, request: dict, timeout_s: float = 3600, python: pathlib.Path = PEERS_PYTHON,
             setup: str = "benchmarks/setup.sh") -> dict | None:
    """Runs ``benchmarks/<script>`` under ``python`` (the peers' Python unless told) with ``request``
    as JSON on stdin.

    Returns its JSON answer (its last line of output), or ``None`` (with the reason printed) when
    the environment is missing (``setup`` makes it) or the script fails.
    """
    if not python.exists():
        print(f"  peers: {python} not found (run {setup}); peer columns left out", file=sys.stderr)
        return None
    done = subprocess.run([str(python), str(ROOT / "benchmarks" / script)], input=json.dumps(request),
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        print(f"  peers: {script} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine_line() -> str:
    import platform

    import torch

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}, {time.strftime('%Y-%m-%d')}")


def family_run(args):
    """``(device, on_gpu, dtype, budget)`` of a family script's run from its parsed options: one
    torch thread on the CPU (the machine's cores are shared), bfloat16 on a GPU and float32 on the
    CPU, ``--budget`` or the preset's seconds of timing per measurement."""
    import torch

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    if not on_gpu:
        torch.set_num_threads(1)
    budget = args.budget or (0.02 if args.gpu and not on_gpu else 0.1 if args.gpu else 0.2 if args.quick else 0.5)
    return device, on_gpu, torch.bfloat16 if on_gpu else torch.float32, budget


# ---------------------------------------------------------------------- the family scripts' options


def family_parser(description: str, quick: str, gpu: str, gpu_only: bool = False) -> argparse.ArgumentParser:
    """An argument parser with the options every family script takes: --quick, --gpu, --device, --budget, --out.

    ``quick`` and ``gpu`` say what those presets run; ``gpu_only``: --device and --out serve --gpu alone.
    """
    scope = "--gpu: " if gpu_only else ""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--gpu", action="store_true", help=gpu)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help=f"{scope}where the inputs live" if gpu_only else None)
    parser.add_argument("--budget", type=float, default=None, help="seconds of timing per measurement")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help=f"{scope}folder for the .md, .json and .png")
    add_history_option(parser)
    return parser


class _HistoryOption(argparse.Action):
    def __call__(self, parser, namespace, value, option_string=None):
        setattr(namespace, self.dest, value)
        os.environ[HISTORY_ENV] = str(value)  # seconds_per_call reads it; child processes inherit it


def add_history_option(parser: argparse.ArgumentParser) -> None:
    """``--history [PATH]``: append every measurement to the benchmark history (``PATH``, default
    ``benchmarks/history/<device>.jsonl``); ``python -m torch_kernels bench compare`` reads it."""
    parser.add_argument("--history", nargs="?", const="1", default=None, action=_HistoryOption, metavar="PATH",
                        help="append each measurement's timings to PATH (default benchmarks/history/<device>.jsonl)")


def cuda_missing(device: str) -> bool:
    """True, with the reason printed, when ``device`` is cuda and this machine has none (the script exits 2)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch.cuda.is_available() is False here", file=sys.stderr)
        return True
    return False


# ------------------------------------------------------------------ what each family script declares

DECLARATION = "BENCHMARK"


def family_benchmarks() -> dict[str, dict]:
    """``{family: its declaration}`` for every ``benchmarks/<family>.py`` that assigns a literal dict to
    ``BENCHMARK`` at module level, in the order of the file names.

    Read from the source, not imported (the scripts import torch and torch_kernels). The keys, each optional:

    - ``gpu_step``: its step in benchmarks/gpu.sh, ``<family>.py --gpu --device D --out OUT *args`` capped at
      ``cap_s`` seconds; the steps run in the order of ``position`` (it decides which step the script's
      time budget cuts); ``autotuned``: it also runs in the autotuning pass, with ``autotune_args`` added;
    - ``summary_goals``: ``[[goal, target], ...]``, which benchmarks/gpu_summary.py reports from
      ``<family>-gpu.json`` in the order of ``summary_position``; the script's ``gpu_goals(data)``
      measures them, one ``goal_result`` each;
    - ``quick_compile_group``: its group of builds in ``benchmarks/compiled_kernels.py --quick``;
    - ``bench``: ``python -m torch_kernels bench`` (benchmarks/run.py) runs it.
    """
    found = {}
    for path in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == DECLARATION for t in node.targets):
                found[path.stem] = ast.literal_eval(node.value)
    return found


def declaring(key: str, order: str | None = None) -> list[tuple[str, dict]]:
    """``(family, declaration)`` of the family scripts that declare ``key``, by ``declaration[order]``
    (then by name) when given, else by name."""
    found = [(family, declared) for family, declared in family_benchmarks().items() if key in declared]
    if order is not None:
        found.sort(key=lambda item: (item[1][order], item[0]))
    return found


def gpu_steps(kind: str, dry_run: bool = False) -> list[list[str]]:
    """benchmarks/gpu.sh's family steps in run order, each a list of fields. ``bench``: the family, its cap
    in seconds, its extra arguments. ``autotune``: the family and its autotuning pass's extra arguments;
    in the dry run only the family with the smallest cap (CPU tensors never search: one pass shows the logic)."""
    steps = [(family, declared["gpu_step"]) for family, declared in declaring("gpu_step")]
    steps.sort(key=lambda item: (item[1]["position"], item[0]))
    if kind == "bench":
        return [[family, str(step["cap_s"]), *step.get("args", ())] for family, step in steps]
    tuned = [(family, step) for family, step in steps if step.get("autotuned")]
    if dry_run and tuned:
        tuned = [min(tuned, key=lambda item: item[1]["cap_s"])]
    return [[family, *step.get("autotune_args", ())] for family, step in tuned]


# ------------------------------------------------------------------------------ the summary's goals

MET, MISSED, NOT_MEASURED = "met", "missed", "not measured"


def goal_result(measured: str | None, status: str, detail: str) -> dict:
    """One goal's outcome in benchmarks/gpu_summary.py: the value shown, met / missed / not measured, and how."""
    return {"measured": measured, "status": status, "detail": detail}


def all_met(values, threshold) -> str:
    return MET if all(v >= threshold for v in values) else MISSED


def worst_speedup_goal(speedups: list[tuple[float, str]], empty: str) -> dict:
    """A "faster everywhere" goal from ``[(speedup over the baseline, what), ...]``: met when the worst
    exceeds 1; ``empty`` says why nothing was measured."""
    if not speedups:
        return goal_result(None, NOT_MEASURED, empty)
    worst = min(s for s, _ in speedups)
    return goal_result(f"{worst:.2f}x (worst)", MET if worst > 1 else MISSED,
                       "; ".join(f"{what}: {s:.2f}x" for s, what in speedups))


def write_results(out_dir: pathlib.Path, stem: str, text: str, data: dict, plot) -> None:
    """``<stem>.md`` (``text``), ``.json`` (``data``) and ``.png`` (``plot(data["rows"], path)``) in
    ``out_dir``; the plot only where matplotlib imports (the [bench] extra): the tables still stand."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.md").write_text(text)
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=1))
    try:
        plot(data["rows"], out_dir / f"{stem}.png")
    except ImportError as e:
        print(f"plot: {e}", file=sys.stderr)


if __name__ == "__main__":  # benchmarks/gpu.sh: its family steps, a line each, fields tab-separated
    cli = argparse.ArgumentParser(description="benchmarks/gpu.sh's family steps, a line each, fields tab-separated")
    cli.add_argument("command", choices=("gpu-steps",))
    cli.add_argument("kind", choices=("bench", "autotune"))
    cli.add_argument("--dry-run", action="store_true")
    cli_args = cli.parse_args()
    for fields in gpu_steps(cli_args.kind, cli_args.dry_run):
        print("\t".join(fields))

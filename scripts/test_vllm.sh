#!/usr/bin/env bash
# The vLLM plugin's tests (tests_vllm/) in their own environment: sets up .venv-vllm when needed
# (scripts/setup_vllm.sh), then runs pytest there. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm.sh
exec .venv-vllm/bin/python -m pytest -q tests_vllm "$@"

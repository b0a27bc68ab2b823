"""Triton kernels and their launchers. Imports torch and triton, never torch_kernels.

Each kernel is written once with ``@triton.jit``. Launchers run it compiled on GPU tensors and
under the Triton interpreter on CPU tensors (for tests), choosing per call by the tensors'
device, so one process can do both (interpreted launches patch ``triton.language`` for the whole
process while they run, as Triton's interpreter does, so keep them off threads that compile GPU
kernels at the same moment). ``compile_for`` builds a kernel ahead of time for a GPU
architecture without a GPU, which the tests use to prove every kernel compiles for real devices.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import triton
import triton.language as tl
from triton.language import core as tl_core
from triton.runtime import interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_lock = threading.Lock()


@functools.cache
def _interpreted_function(fn) -> InterpretedFunction:
    return InterpretedFunction(fn)


def _call_interpreted(jit_function, *args, **kwargs):
    return _interpreted_function(jit_function.fn).rewrite()(*args, **kwargs)


def _both_languages():
    """Its globals hold ``tl`` and ``tl.core``: patching for it patches every language module a
    jitted helper can see (the interpreter looks for those two)."""
    return tl, tl_core


@contextlib.contextmanager
def _interpreting():
    # Without TRITON_INTERPRET=1 at import, triton.language's own helpers (tl.sum, tl.zeros, ...)
    # are JITFunctions, which refuse to be called from Python; while a kernel is interpreted,
    # they are interpreted too. The language is patched once for the whole launch, not at each
    # helper call (a third of an interpreted test's time went to re-patching).
    with _lock:
        original = JITFunction.__call__
        JITFunction.__call__ = _call_interpreted
        scope = interpreter._patch_lang(_both_languages)
        try:
            yield
        finally:
            scope.restore()  # else the patched triton.language would break later GPU compiles
            JITFunction.__call__ = original


class _InterpretedLauncher:
    def __init__(self, kernel):
        self.function = kernel if isinstance(kernel, InterpretedFunction) else _interpreted_function(kernel.fn)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with _interpreting():
                return self.function[grid](*args, **kwargs)

        return launch


@functools.cache
def _cuda_arch(index: int) -> int:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def arch_of(device) -> int | None:
    """The CUDA compute capability of ``device`` as ``compile_for`` takes it (90 for 9.0), or None
    for any other device (CPU tensors run interpreted): what arch-aware default configs key on."""
    if device.type != "cuda":
        return None
    import torch

    return _cuda_arch(torch.cuda.current_device() if device.index is None else device.index)


def for_device(kernel, device):
    """``kernel`` compiled for a GPU device, or interpreted for CPU tensors."""
    return _InterpretedLauncher(kernel) if device.type == "cpu" else kernel


def compile_for(kernel, signature: dict, constexprs: dict, arch: int = 90, num_warps: int = 4,
                num_stages: int | None = None, divisible: tuple[str, ...] = ()):
    """Compile ``kernel`` for CUDA compute capability ``arch`` (no GPU needed); returns the
    compiled kernel, whose ``asm`` holds its ``ptx`` and ``cubin``. ``num_stages`` as the launch
    passes it (None: Triton's default).

    Built as a launch specializes it: every pointer argument 16-byte aligned (as torch allocates),
    and the integer arguments named in ``divisible`` multiples of 16. Without that Triton neither
    vectorizes nor pipelines the loads, and its shared memory and registers are not those of the
    kernel that runs.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    aligned = [name for name, kind in signature.items() if kind.startswith("*")] + list(divisible)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def resource_usage(compiled) -> dict:
    """What a kernel from :func:`compile_for` needs per launch: ``shared`` bytes per block (from
    Triton's metadata); ``registers`` per thread and ``stack`` bytes per thread, where ptxas puts
    spilled registers (from the cubin, read by the ``cuobjdump`` that ships with Triton); and
    ``spill_stores``, ``spill_loads``, the bytes of spill instructions per thread (from ``ptxas -v``
    run again on the PTX with the options Triton built it with, where the stack is not empty: with
    no stack frame there is nowhere to spill to)."""
    import re
    import subprocess
    import tempfile

    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        report = subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", cubin.name], check=True,
                                capture_output=True, text=True).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+)", report)
    found = {"shared": compiled.metadata.shared, "registers": int(usage[1]), "stack": int(usage[2]),
             "spill_stores": 0, "spill_loads": 0}
    if found["stack"]:
        arch = compiled.metadata.target.arch
        options = ["-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(arch)}"]
        if not compiled.metadata.enable_fp_fusion:
            options.append("--fmad=false")
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(compiled.asm["ptx"])
            ptx.flush()
            log = subprocess.run([get_ptxas(arch).path, *options, ptx.name, "-o", "/dev/null"], check=True,
                                 capture_output=True, text=True).stderr
        if int(re.search(r"Used (\d+) registers", log)[1]) != found["registers"]:
            raise RuntimeError(f"ptxas -v did not reproduce the build of {compiled.metadata.name}")
        stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups()
        found.update(spill_stores=int(stores), spill_loads=int(loads))
    return found


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how compile-report labels name a dtype."""
    return str(dtype).removeprefix("torch.")

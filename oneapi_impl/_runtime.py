"""Build OpenCL C to SPIR-V, load it into a SYCL queue, move torch tensors in and out of USM.

SPIR-V comes from ``clang -target spir64`` and ``llvm-spirv`` (overridable with the
``TORCH_KERNELS_CLANG`` and ``TORCH_KERNELS_LLVM_SPIRV`` environment variables) and is cached on
disk under ``$TORCH_KERNELS_CACHE`` (default ``~/.cache/torch_kernels``), keyed by the source and
its build macros. The SYCL runtime refuses raw host pointers as kernel arguments, so CPU tensors
are copied into USM shared memory, which torch then views without a copy for the outputs.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

import numpy as np
import torch

_SOURCES = pathlib.Path(__file__).parent
_lock = threading.Lock()


def _tool(env_var: str, name: str) -> str | None:
    return os.environ.get(env_var) or shutil.which(name)


def _tools() -> tuple[str, str]:
    clang = _tool("TORCH_KERNELS_CLANG", "clang-14")
    llvm_spirv = _tool("TORCH_KERNELS_LLVM_SPIRV", "llvm-spirv-14")
    if not clang or not llvm_spirv:
        raise RuntimeError(
            "clang-14 and llvm-spirv-14 are needed to build SPIR-V (Debian packages clang-14, "
            "llvm-spirv-14; or set TORCH_KERNELS_CLANG / TORCH_KERNELS_LLVM_SPIRV)")
    return clang, llvm_spirv


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("TORCH_KERNELS_CACHE") or pathlib.Path.home() / ".cache" / "torch_kernels"
    return pathlib.Path(root) / "spirv"


def spirv(source: str, macros: dict[str, int]) -> bytes:
    """The SPIR-V module of kernel source file ``source`` built with ``-D`` ``macros``."""
    clang, llvm_spirv = _tools()
    shared = _SOURCES / "dtypes.cl"  # the dtype helpers every source uses, included first
    text = shared.read_text() + (_SOURCES / source).read_text()
    flags = [f"-D{name}={value}" for name, value in sorted(macros.items())]
    key = hashlib.sha256("\0".join([text, clang, llvm_spirv, *flags]).encode()).hexdigest()[:32]
    cached = _cache_dir() / f"{key}.spv"
    if cached.exists():
        return cached.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        bitcode, module = pathlib.Path(tmp, "k.bc"), pathlib.Path(tmp, "k.spv")
        steps = (
            [clang, "-c", "-target", "spir64", "-cl-std=CL2.0", "-O2", "-emit-llvm", *flags,
             "-include", str(shared), "-o", str(bitcode), str(_SOURCES / source)],
            [llvm_spirv, str(bitcode), "-o", str(module)],
        )
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"building {source} failed: {' '.join(step)}\n{done.stderr}")
        binary = module.read_bytes()
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(f".{os.getpid()}.tmp")
    partial.write_bytes(binary)
    os.replace(partial, cached)  # atomic, so concurrent builders never see half a file
    return binary


def _point_icd_loader_at_venv_runtime() -> None:
    # pip's intel-opencl-rt puts the driver in <prefix>/lib, where the ICD loader does not look.
    if "OCL_ICD_FILENAMES" not in os.environ:
        driver = pathlib.Path(sys.prefix, "lib", "libintelocl.so")
        if driver.exists():
            os.environ["OCL_ICD_FILENAMES"] = str(driver)


@functools.cache
def host_queue():
    """A queue on an OpenCL CPU device that can allocate USM (PoCL, for one, cannot)."""
    _point_icd_loader_at_venv_runtime()
    import dpctl
    import dpctl.memory

    refusals = []
    for device in dpctl.get_devices(backend="opencl", device_type="cpu"):
        try:
            queue = dpctl.SyclQueue(device)
            dpctl.memory.MemoryUSMShared(8, queue=queue)
            return queue
        except Exception as e:
            refusals.append(f"{device.name}: {e}")
    raise RuntimeError("no OpenCL CPU device that allocates USM"
                       + (f" ({'; '.join(refusals)})" if refusals else " (is intel-opencl-rt installed?)"))


@functools.cache
def _program(source: str, macros: tuple[tuple[str, int], ...]):
    """One program per source and macros, shared by its kernels: each program costs a JIT build."""
    import dpctl.program

    return dpctl.program.create_program_from_spirv(host_queue(), spirv(source, dict(macros)))


@functools.cache
def _kernel(source: str, name: str, macros: tuple[tuple[str, int], ...]):
    return _program(source, macros).get_sycl_kernel(name)


def kernel(source: str, name: str, **macros: int):
    """Kernel ``name`` of ``source`` built with ``macros``, loaded on the host queue (cached)."""
    with _lock:
        return _kernel(source, name, tuple(sorted(macros.items())))


def usm_empty(shape: tuple[int, ...], dtype: torch.dtype):
    """(USM allocation, a torch CPU tensor viewing it). The tensor keeps the allocation alive."""
    import dpctl.memory

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    memory = dpctl.memory.MemoryUSMShared(max(nbytes, 1), queue=host_queue())
    view = torch.from_numpy(np.frombuffer(memory, dtype=np.uint8)[:nbytes]).view(dtype).view(shape)
    return memory, view


def usm_copy(tensor: torch.Tensor):
    """A USM copy of CPU tensor ``tensor``, as in ``usm_empty``."""
    memory, view = usm_empty(tuple(tensor.shape), tensor.dtype)
    view.copy_(tensor)
    return memory, view


# the kernels' X_KIND macro: the floating-point dtypes they are built for
FLOAT_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def require_supported(*tensors) -> None:
    """NotImplementedError (the dispatcher tries the next backend) for tensors off the CPU or of a
    floating-point dtype the kernels are not built for; None entries are skipped."""
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu":
            # Torch XPU tensors would be passed zero-copy through DLPack; that path is not built yet.
            raise NotImplementedError(
                f"sycl: only CPU tensors (run on the opencl:cpu device) are supported, got {t.device}")
        if t.is_floating_point() and t.dtype not in FLOAT_KINDS:
            raise NotImplementedError(f"sycl: no kernel for {t.dtype} inputs (float32, float16, bfloat16 only)")


def local_memory_bytes() -> int:
    return host_queue().sycl_device.local_mem_size


def unavailable_reason() -> str | None:
    """``None`` if the compilers, the SYCL runtime and its CPU device are here, else why not."""
    try:
        _tools()
        _point_icd_loader_at_venv_runtime()
        import dpctl  # noqa: F401
    except Exception as e:
        return str(e)
    try:
        host_queue()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None

"""The SYCL backend: OpenCL C kernels built to SPIR-V and run through the SYCL runtime (dpctl).

SPIR-V is the form an Intel GPU's Level Zero driver loads; on a machine without one the same
binaries run on the ``opencl:cpu`` SYCL device (Intel's OpenCL CPU runtime), which is how CI
tests them. Kernel sources live next to this file as ``*.cl``; ``_runtime`` builds, caches and
launches them.
"""

from __future__ import annotations


def unavailable_reason() -> str | None:
    """``None`` if SYCL kernels can be built and run in this process, else why not: the toolchain
    and device are there, and one kernel, built and run, agrees with its own reference math."""
    from . import _runtime

    reason = _runtime.unavailable_reason()
    if reason is not None:
        return reason
    try:
        from . import ood

        ood.self_check()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None

"""Backend registry: which backends exist, whether they run here, and which one an op call uses.

Four backends, in the order a call may try them:

- ``reference``: pure PyTorch, runs on any device; the golden reference and the last resort.
- ``triton``: Triton kernels (NVIDIA GPUs; Intel GPUs via triton-xpu). On CPU tensors the kernels
  run under the Triton interpreter, for testing.
- ``pallas``: JAX/Pallas kernels (TPU). Chosen for torchax ('jax') tensors; on CPU tensors the
  kernels run in Pallas interpret mode on CPU JAX, for testing.
- ``sycl``: SYCL kernels loaded from SPIR-V (Intel GPUs); on CPU tensors they run on the
  ``opencl:cpu`` SYCL device.

Which backends a call tries, first match wins:

1. the call's ``implementation=`` argument;
2. the innermost :func:`use_backend` context;
3. the ``TORCH_KERNELS_BACKEND`` environment variable (comma-separated names);
4. the inputs' device: cpu -> reference; cuda -> triton, reference; xpu -> sycl, triton, reference;
   torchax ('jax') tensors -> pallas, reference. Torchax tensors never reach the kernels
   registered here: torchax runs the op's JAX implementation of the chosen name (pallas, or
   reference in plain jnp; see ``torch_kernels.pallas.torchax_tensors``).

An explicit choice (1-3) is tried in the order given and nothing else: if every named backend is
unavailable or raises ``NotImplementedError`` for these inputs, the call fails and says why. The
device default always ends with the reference. The backend that ran is logged (logger
``torch_kernels``, DEBUG) and appears in ``torch.profiler`` as ``torch_kernels::<op>[<backend>]``.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import os
import threading
from typing import Callable, Iterable, Sequence

import torch

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "unavailable_reason",
    "unavailable_reasons",
    "available_backends",
    "use_backend",
    "register",
    "unregister",
    "implementations",
    "resolve",
    "dispatch",
    "last_backend",
]

BACKENDS = ("reference", "triton", "pallas", "sycl")
ENV_VAR = "TORCH_KERNELS_BACKEND"
DEVICE_DEFAULTS = {
    "cpu": ("reference",),
    "cuda": ("triton", "reference"),
    "xpu": ("sycl", "triton", "reference"),
    "jax": ("pallas", "reference"),  # torchax tensors (their JAX implementations)
}

log = logging.getLogger("torch_kernels")
_REFERENCE_ONLY = ("reference",)
_profiler = torch.autograd.profiler
# set while torch_kernels.profile or its telemetry records: a threading.local whose ``calls`` lists, on
# this thread, the op calls being recorded, innermost last, each as the backends that ran for it so far
# ("" before any). Written here inline: a Python callback per kernel cost about 0.15 us.
_observer: threading.local | None = None


def _probe_reference() -> str | None:
    return None


def _probe_triton() -> str | None:
    try:
        import triton  # noqa: F401
        from triton.runtime.interpreter import InterpretedFunction  # noqa: F401
    except Exception as e:  # an ImportError, or a broken install raising anything
        return f"triton does not import: {e}"
    return None


def _probe_pallas() -> str | None:
    try:
        import jax  # noqa: F401
        from jax.experimental import pallas  # noqa: F401
        from jax.experimental.pallas import tpu  # noqa: F401
    except Exception as e:
        return f"jax / pallas does not import: {e}"
    return None


def _probe_sycl() -> str | None:
    try:
        import oneapi_impl
    except Exception as e:
        return f"oneapi_impl does not import: {e}"
    return oneapi_impl.unavailable_reason()


_PROBES = {
    "reference": _probe_reference,
    "triton": _probe_triton,
    "pallas": _probe_pallas,
    "sycl": _probe_sycl,
}
_probe_results: dict[str, str | None] = {}
_probe_lock = threading.Lock()


def unavailable_reason(name: str) -> str | None:
    """``None`` if backend ``name`` can run in this process, else why not (probed once, cached)."""
    if name not in _PROBES:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")
    if name not in _probe_results:
        with _probe_lock:
            if name not in _probe_results:
                _probe_results[name] = _PROBES[name]()
    return _probe_results[name]


def unavailable_reasons() -> dict[str, str | None]:
    """Every backend's name mapped to ``None`` (available) or the reason it is not."""
    return {name: unavailable_reason(name) for name in BACKENDS}


def available_backends() -> list[str]:
    """Names of the backends that can run here, in registry order."""
    return [name for name in BACKENDS if unavailable_reason(name) is None]


_parsed: dict[str, tuple[str, ...]] = {}  # a call's implementation string is parsed on each dispatch


def _parse(names: str | Sequence[str] | None, what: str) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str):
        parsed = _parsed.get(names)
        if parsed is not None:
            return parsed
        parsed = tuple(n.strip() for n in names.split(",") if n.strip())
    elif isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names):
        parsed = tuple(names)
    else:
        raise TypeError(f"{what}: expected a backend name or a sequence of names, got {names!r}")
    if not parsed:
        raise ValueError(f"{what}: expected at least one backend name, got {names!r}")
    for n in parsed:
        if n not in BACKENDS:
            raise ValueError(f"{what}: unknown backend {n!r}; expected one of {BACKENDS}")
    if isinstance(names, str) and len(_parsed) < 256:
        _parsed[names] = parsed
    return parsed


_context: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "torch_kernels_backend", default=None
)


@contextlib.contextmanager
def use_backend(names: str | Sequence[str]):
    """Within this block, ops without an ``implementation=`` argument try ``names`` in order.

    >>> with torch_kernels.use_backend(["triton", "reference"]):
    ...     scores = torch_kernels.mahalanobis_score(x, means, whitener)
    """
    token = _context.set(_parse(names, "use_backend"))
    try:
        yield
    finally:
        _context.reset(token)


def implementation_arg(implementation: str | Sequence[str] | None) -> str | None:
    """The ``implementation=`` argument as the op schema carries it: a comma-separated string."""
    parsed = _parse(implementation, "implementation")
    return None if parsed is None else ",".join(parsed)


# os.environ.get re-encodes the key on every call (about 0.5 us); the raw mapping does not.
_environ = getattr(os.environ, "_data", None)
_env_key = os.environ.encodekey(ENV_VAR) if _environ is not None else ENV_VAR


def _env_setting() -> str | None:
    if _environ is None:
        return os.environ.get(ENV_VAR)
    value = _environ.get(_env_key)
    return os.environ.decodevalue(value) if value is not None else None


def resolve(device_type: str, implementation: str | None) -> tuple[tuple[str, ...], bool]:
    """The backends to try for a call on ``device_type`` and whether that order was explicit."""
    if implementation is not None:
        explicit = _parse(implementation, "implementation")
    else:  # the common call: no argument, context or variable, nothing parsed
        explicit = _context.get()
        if explicit is None:
            env = _env_setting()
            if env:
                explicit = _parse(env, ENV_VAR)
    if explicit is not None:
        return explicit, True
    return DEVICE_DEFAULTS.get(device_type, _REFERENCE_ONLY), False


# op name -> backend name -> callable, or "module:function" until first use
_impls: dict[str, dict[str, Callable | str]] = {}
_last: dict[str, str] = {}


def register(op: str, backend: str, fn: Callable | str) -> None:
    """Register ``fn`` (or a lazy ``"module:function"`` path) as ``backend``'s kernel for ``op``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown backend {backend!r}; expected one of {BACKENDS}")
    _impls.setdefault(op, {})[backend] = fn
    _plans.clear()


def unregister(op: str) -> None:
    """Forget every kernel registered for ``op`` (an op defined for a while, as a test's is)."""
    _impls.pop(op, None)
    _last.pop(op, None)
    _plans.clear()


def implementations(op: str) -> tuple[str, ...]:
    """The backends that have a kernel registered for ``op``."""
    return tuple(b for b in BACKENDS if b in _impls.get(op, {}))


def _kernel(op: str, backend: str) -> Callable:
    fn = _impls[op][backend]
    if isinstance(fn, str):
        module, _, attr = fn.partition(":")
        fn = getattr(importlib.import_module(module), attr)
        _impls[op][backend] = fn
    return fn


# (op, backend order) -> ((backend, kernel, None) or (backend, None, why it cannot run), ...)
_plans: dict[tuple[str, tuple[str, ...]], tuple] = {}


def _plan(op: str, order: tuple[str, ...]) -> tuple:
    plan = _plans.get((op, order))
    if plan is None:
        steps = []
        for backend in order:
            if backend not in _impls.get(op, {}):
                steps.append((backend, None, f"no kernel registered for {op}"))
            elif (reason := unavailable_reason(backend)) is not None:
                steps.append((backend, None, reason))
            else:
                steps.append((backend, _kernel(op, backend), None))
        plan = _plans[(op, order)] = tuple(steps)
    return plan


def planned(op: str, device_type: str, implementation: str | None) -> str | None:
    """The backend :func:`dispatch` tries first for this call of ``op``: the first of its order with
    a kernel registered that can run here (None: none). A kernel may still refuse the call and pass
    it on; a helper chosen by this backend (:func:`helper`) must give what any backend can take."""
    for backend, fn, _ in _plan(op, resolve(device_type, implementation)[0]):
        if fn is not None:
            return backend
    return None


def helper(name: str, backend: str | None) -> Callable | None:
    """``backend``'s function registered (:func:`register`) under ``name``, a helper of an op rather
    than an op (its deferred value checks in one device launch, say), or None where it has none."""
    if backend is None or backend not in _impls.get(name, {}):
        return None
    return _kernel(name, backend)


def last_backend(op: str) -> str | None:
    """The backend that ran the latest call of ``op`` in this process (for diagnostics)."""
    return _last.get(op)


def _joined(ran: str, backend: str) -> str:
    """The backends of a call whose kernel dispatched again: ``"a+b"``, each named once."""
    return ran if backend in ran.split("+") else f"{ran}+{backend}"


def dispatch(op: str, device_type: str, implementation: str | None, *args, **kwargs):
    """Run ``op``'s kernel on the first usable backend for this call, with ``args`` and ``kwargs``;
    see the module docstring."""
    order, explicit = resolve(device_type, implementation)
    why: list[str] = []
    for backend, fn, reason in _plan(op, order):
        if fn is None:
            why.append(f"{backend}: {reason}")
            continue
        try:
            if _profiler._is_profiler_enabled:
                with torch.profiler.record_function(f"torch_kernels::{op}[{backend}]"):
                    out = fn(*args, **kwargs)
            else:
                out = fn(*args, **kwargs)
            observer = _observer
            if observer is not None and (calls := observer.calls) and (ran := calls[-1]) != backend:
                calls[-1] = backend if not ran else _joined(ran, backend)
        except NotImplementedError as e:
            message = str(e)  # kernels usually name their backend already
            why.append(message if message.startswith(f"{backend}:") else f"{backend}: {message}")
            continue
        if _last.get(op) != backend:
            log.debug("%s ran on backend %s", op, backend)
            _last[op] = backend
        return out
    raise RuntimeError(
        f"torch_kernels::{op}: no backend could run this call on {device_type} "
        f"(tried {', '.join(order)}; {'explicitly chosen' if explicit else 'device default'}): "
        + "; ".join(why)
    )

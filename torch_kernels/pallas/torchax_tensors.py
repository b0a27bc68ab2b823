"""torch_kernels ops on torchax ('jax') tensors: the torchax environment that runs their JAX kernels.

Importing torchax registers a 'jax' device with torch for the whole process, so this module
imports it only when torchax tensors are wanted (:func:`environment`), never on
``import torch_kernels``.

:func:`register` installs, for each op, a function that takes the torchax tensors' JAX arrays,
runs the jax_impl kernel (Pallas) on them and wraps the result back, with gradients from the
kernel's ``jax.custom_vjp``; ops that write a KV cache point the cache's torchax tensor at the
updated array. Each family's functions come from ``torchax_implementations()`` in its module
of this package. :func:`environment` imports torchax, works around its import failure on recent
torch, and returns its default environment with the ops registered.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util

import torch

from .. import backends, families

_REMOVED_OVERLOAD_MARKERS = ("dimname", "names")


class _RemovedOverload:
    """Stands in for an operator overload that this torch no longer has."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<overload {self.name} removed from torch>"

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} does not exist in torch {torch.__version__}")


def _needs_import_shim(torch_version: str | None = None, torchax_version: str | None = None) -> bool:
    """torchax <= 0.0.13 names the named-tensor overloads that torch 2.13 removed."""
    from importlib.metadata import version

    from packaging.version import Version

    torch_version = torch_version or torch.__version__
    torchax_version = torchax_version or version("torchax")
    return Version(torch_version.split("+")[0]) >= Version("2.13") and Version(torchax_version) <= Version("0.0.13")


@contextlib.contextmanager
def _removed_overloads_resolve():
    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__

    def getattr_or_placeholder(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if any(marker in key.lower() for marker in _REMOVED_OVERLOAD_MARKERS):
                return _RemovedOverload(f"{self._qualified_op_name}.{key}")
            raise

    packet.__getattr__ = getattr_or_placeholder
    try:
        yield
    finally:
        packet.__getattr__ = original


@functools.cache
def environment():
    """torchax's default environment with every torch_kernels op registered."""
    shim = _removed_overloads_resolve() if _needs_import_shim() else contextlib.nullcontext()
    with shim:
        import torchax

        env = torchax.default_env()  # loads torchax's op tables, which name the removed overloads
    register(env)
    return env


def register(env) -> None:
    """Register with torchax environment ``env`` the torchax implementations of every family that
    has a module in this package (its ``torchax_implementations()``: op name -> implementation)."""
    for family in families.names():
        module = f"{__package__}.{family}"
        if importlib.util.find_spec(module) is None:  # a family without a Pallas backend
            continue
        for op, implementation in importlib.import_module(module).torchax_implementations().items():
            env.override_op_definition(getattr(torch.ops.torch_kernels, op).default, implementation)


def torchax_implementation(check, **by_backend):
    """One op implementation for torchax tensors from JAX functions of arrays, by backend name.

    ``check(*tensors)`` validates the inputs as the op's device kernels do; the backend comes from
    ``implementation=``, ``use_backend``, ``TORCH_KERNELS_BACKEND`` or the default (pallas).
    """
    from torchax.interop import j2t_autograd, torch_view

    wrapped = {name: j2t_autograd(torch_view(fn)) for name, fn in by_backend.items()}

    def impl(*args, implementation=None):
        if args and (args[-1] is None or isinstance(args[-1], str)):  # the schema's last argument
            *args, implementation = args
        check(*args)
        return first_backend(implementation, wrapped)(*args)

    return impl


def first_backend(implementation, by_backend: dict):
    """The first of the call's backends (``backends.resolve``) that ``by_backend`` has."""
    order, _ = backends.resolve("jax", implementation)
    for name in order:
        if name in by_backend:
            return by_backend[name]
    raise NotImplementedError(f"implementation: torchax tensors run {sorted(by_backend)}, not {','.join(order)!r}")


def schema_arguments(overload, args, kwargs) -> list:
    """Every schema argument of a call to ``overload``, those left out at their defaults."""
    arguments = overload._schema.arguments
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}
    return list(args) + [kwargs.get(a.name, defaults.get(a.name)) for a in arguments[len(args):]]

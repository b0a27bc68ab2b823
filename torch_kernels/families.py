"""The op families, found rather than listed.

Every public module of :mod:`torch_kernels.ops` is a family (``ood``, ``paged_attention``, ...),
in name order; a family defined at run time (a test's toy op) joins with :func:`register`. A
family declares, by attribute name, what the code around the ops needs from it:

- ``__all__``: its public wrappers, which ``torch_kernels`` exports;
- ``selftest_cases()``: its :class:`Case` list, which the doctor and the self-test run;
- ``TRANSFORMERS_HUB_FUNCTIONS`` (optional): ``{transformers hub function name: public wrapper}``,
  which ``torch_kernels.integrations.transformers.kernelize`` routes a model's calls to;
- ``TRANSFORMERS_LAYERS`` (optional): ``{"<transformers module>.<layer class>": forward}``, whose
  layers ``kernelize`` runs through ``forward(module, original, implementation, *args, **kwargs)``
  (``original``: the class's own forward; ``forward.ops``: the ops it calls; optionally
  ``forward.unsupported(module)``: why an instance cannot take it, or None);

and the Pallas backend's torch face for family ``f`` lives in ``torch_kernels.pallas.f``
(found by the same name). Nothing here lists a family by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
from typing import Any, Callable

import torch

__all__ = ["Case", "names", "families", "declared", "register", "unregister", "selftest_cases"]

_OPS_PACKAGE = "torch_kernels.ops"


@dataclasses.dataclass(frozen=True)
class Case:
    """One self-test check: ``run(*inputs, implementation=)`` against ``definition(*inputs)``,
    both on ``make_inputs(generator, dtype, device)``."""

    op: str
    make_inputs: Callable[[torch.Generator, torch.dtype, str], tuple]
    run: Callable[..., torch.Tensor]
    definition: Callable[..., torch.Tensor]


# families added at run time, by name, after the discovered ones
_registered: dict[str, Any] = {}


@functools.cache
def _discovered() -> tuple[str, ...]:
    from . import ops

    return tuple(sorted(m.name for m in pkgutil.iter_modules(ops.__path__) if not m.name.startswith("_")))


def names() -> tuple[str, ...]:
    """Every family's name: the modules of ``torch_kernels.ops`` in name order, then the registered."""
    return (*_discovered(), *_registered)


def families() -> dict[str, Any]:
    """Every family by name (see :func:`names`): its ops module, or what :func:`register` was given."""
    found = {name: importlib.import_module(f"{_OPS_PACKAGE}.{name}") for name in _discovered()}
    return {**found, **_registered}


def declared(attribute: str) -> dict[str, Any]:
    """``attribute`` of every family that declares it, by family name, in :func:`names` order."""
    return {name: getattr(family, attribute) for name, family in families().items() if hasattr(family, attribute)}


def register(name: str, family: Any) -> None:
    """Add a family defined at run time: ``family`` is a module, or any object with the attributes
    a family module declares (its ops already defined and their kernels registered)."""
    if name in names():
        raise ValueError(f"family {name!r} exists already")
    _registered[name] = family


def unregister(name: str) -> None:
    """Remove a family added by :func:`register` (the discovered ones stay)."""
    if name not in _registered:
        raise ValueError(f"family {name!r} was not added by register()")
    del _registered[name]


def selftest_cases(only: tuple[str, ...] | None = None) -> list[Case]:
    """Every family's self-test cases (or those of the families named in ``only``), families in
    :func:`names` order."""
    return [case for name, cases in declared("selftest_cases").items() if only is None or name in only
            for case in cases()]

"""What the cross-cutting tests need from each family, one module per family.

A module here named after a family of ``torch_kernels/ops`` (``serving``, the serving loop's
table, is the one that is not an op family) declares:

- ``BAD_INPUTS``: ``{table name: [Row, ...]}``, calls a user might get wrong, each with the
  exception it must raise and the argument its message must start with. tests/test_bad_inputs.py
  runs every table on every backend and pins the reference's messages in
  ``messages/<table name>.txt``.
- ``DEVICE_CASES``: ``[DeviceCase, ...]``, the family's Triton kernels on one device's tensors
  against the reference there (tests/test_on_device.py).

The tests find the modules with :func:`modules`; tests/test_family_coverage.py fails where an op
family lacks its module, a public op has no bad-input row or an op with a Triton kernel no device
case. Adding a family is adding its module here: no list elsewhere names the families. A family
defined outside the project (tests/test_families.py's toy) keeps its module in a directory named
by ``TORCH_KERNELS_TEST_FAMILIES_PATH`` (``os.pathsep``-separated), which subprocesses inherit.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pathlib
import pkgutil
import types
from typing import Callable

import torch

from torch_kernels.selftest import TOLERANCES

HOME = pathlib.Path(__file__).resolve().parent
EXTRA_PATH_VARIABLE = "TORCH_KERNELS_TEST_FAMILIES_PATH"


def modules() -> dict[str, types.ModuleType]:
    """``{family: module}`` for every module of this package (names not starting with "_"), this
    directory's and those of the directories in ``$TORCH_KERNELS_TEST_FAMILIES_PATH``."""
    extra = [path for path in os.environ.get(EXTRA_PATH_VARIABLE, "").split(os.pathsep) if path]
    __path__[:] = [str(HOME), *extra]  # the package's search path, so that the import finds them too
    return {info.name: importlib.import_module(f"{__name__}.{info.name}")
            for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")}


# ---- bad inputs ----

@dataclasses.dataclass(frozen=True)
class Row:
    """A bad call: ``call(backend)`` makes it with ``implementation=backend``."""

    case: str
    argument: str  # the message starts with "<argument>:"
    error: type
    call: Callable[[str], object]
    op: str | None = None  # the public op the call checks (None: a class or helper built on the ops)


def _declaring_modules() -> dict[str, types.ModuleType]:
    """``{table name: the module declaring it}``; a table name is declared once."""
    declaring = {}
    for family, module in modules().items():
        for name in getattr(module, "BAD_INPUTS", {}):
            if name in declaring:
                raise ValueError(f"bad-input table {name!r} of {family} is declared by another family too")
            declaring[name] = module
    return declaring


def bad_input_tables() -> dict[str, list[Row]]:
    """Every family's bad-input tables, ``{table name: rows}``."""
    return {name: module.BAD_INPUTS[name] for name, module in _declaring_modules().items()}


def pinned_messages(table: str) -> pathlib.Path:
    """The file pinning ``table``'s reference messages: ``messages/<table>.txt`` beside its module."""
    return pathlib.Path(_declaring_modules()[table].__file__).resolve().parent / "messages" / f"{table}.txt"


def set_arg(name, value):
    """A change of a call's keyword arguments: ``name`` set to ``value``."""
    return lambda kw: kw.__setitem__(name, value)


def map_arg(name, fn):
    """A change of a call's keyword arguments: ``name`` replaced by ``fn`` of it."""
    return lambda kw: kw.__setitem__(name, fn(kw[name]))


def set_at(name, index, value):
    """A change of a call's keyword arguments: a copy of tensor ``name`` with ``[index] = value``."""
    def change(kw):
        kw[name] = kw[name].clone()
        kw[name][index] = value
    return change


# ---- device cases ----

DEVICE = torch.device(os.environ.get("TORCH_KERNELS_TEST_DEVICE", "cpu"))
CUDA = DEVICE.type == "cuda"
FP8 = torch.float8_e4m3fn
K = 1024


@dataclasses.dataclass(frozen=True)
class DeviceCase:
    """One op's Triton kernels on one device against the reference (tests/test_on_device.py)."""

    name: str
    op: str  # the registered op whose backend is checked
    make: Callable  # (generator, dtype, device) -> inputs
    run: Callable  # (*inputs, implementation=) -> a tensor or a tuple of tensors
    grads: tuple = ()  # positions of the inputs that get gradients (empty: inference only)
    wide: torch.dtype = torch.float64  # float32 inputs widen to this for the truth
    exact: tuple = ()  # positions of the outputs that must match exactly
    large: bool = False  # a size only a GPU reaches
    capability: tuple | None = None  # the least CUDA compute capability it needs
    dtypes: tuple | None = None  # None: every dtype the device runs; GPU-only cases run in bfloat16
    coarsest: torch.dtype | None = None  # an inner rounding (fp16 P.V): its tolerance when looser
    gate: tuple | None = None  # (min cosine, max relative L1) instead of the tolerance (fp8 P.V)
    covers: tuple = ()  # other registered ops the case runs (their kernels are checked by its outputs)

    def tolerance_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self.coarsest is not None and TOLERANCES[self.coarsest][0] > TOLERANCES[dtype][0]:
            return self.coarsest
        return dtype

    @property
    def gpu_only(self) -> bool:
        return self.large or self.capability is not None


LARGE = dict(large=True, dtypes=(torch.bfloat16,))  # a GPU-only size, run in bfloat16


def sized(maker, **sizes):
    """``maker(gen, dtype, device)`` with ``sizes`` passed on."""
    return lambda gen, dtype, device: maker(gen, dtype, device, **sizes)


def interpreter_sizes(**sizes) -> dict:
    """``sizes`` under the interpreter (its cost is per step), none (selftest's) on a GPU."""
    return {} if CUDA else sizes

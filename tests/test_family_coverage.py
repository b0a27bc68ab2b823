"""Every op family has its module in ``tests/families``, with a bad-input row for each of its
public ops and a device case for each of its ops with a Triton kernel: a new family, or a new op,
fails here until the cross-cutting tests see it. :func:`check_family` is the check, for any family
:mod:`torch_kernels.families` knows (tests/test_families.py runs it on a toy family)."""

from __future__ import annotations

import inspect

import pytest

import families
import torch_kernels.families
from torch_kernels import _library, backends

OP_FAMILIES = torch_kernels.families.names()


def _belongs_to(module_name: str, family: str) -> bool:
    package = torch_kernels.families.families()[family].__name__
    return module_name == package or module_name.startswith(f"{package}.")


def public_ops(family: str) -> set[str]:
    """The functions among ``family``'s public names (its ``__all__``, which ``torch_kernels`` exports)."""
    module = torch_kernels.families.families()[family]
    return {name for name in module.__all__ if inspect.isfunction(getattr(module, name))}


def ops_with_a_triton_kernel(family: str) -> set[str]:
    """The registered forward ops whose kernel ``family``'s module (``__name__``) defines and that
    have a Triton implementation."""
    return {name for name, definition in _library._definitions.items()
            if _belongs_to(definition.kernel.__module__, family) and not name.endswith(("_backward", "_weight_grad"))
            and "triton" in backends.implementations(name)}


def check_family(family: str) -> None:
    """Fails unless ``family`` has its tests module, a bad-input row for each public op and a device
    case for each op with a Triton kernel."""
    module = families.modules().get(family)
    assert module is not None, f"{family}: no tests/families/{family}.py declaring its BAD_INPUTS and DEVICE_CASES"
    ops = public_ops(family)
    assert ops, f"{family}: torch_kernels exports no function of torch_kernels.ops.{family}"
    checked = {row.op for rows in getattr(module, "BAD_INPUTS", {}).values() for row in rows}
    assert ops <= checked, f"{family}: public ops without a bad-input row (Row.op): {sorted(ops - checked)}"
    covered = {op for case in getattr(module, "DEVICE_CASES", ()) for op in (case.op, *case.covers)}
    missing = ops_with_a_triton_kernel(family) - covered
    assert not missing, f"{family}: ops with a Triton kernel and no device case: {sorted(missing)}"


def test_op_families_are_found():
    assert OP_FAMILIES and set(OP_FAMILIES) <= set(families.modules())


@pytest.mark.parametrize("family", OP_FAMILIES)
def test_every_family_is_covered(family):
    check_family(family)

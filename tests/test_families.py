"""Op families are found, not listed.

A toy family defined inside a test (an op, a reference kernel, a Pallas kernel, its self-test
case, and a tests module with its bad-input rows written to a temporary directory) reaches the
doctor, the bad-input runner and the coverage checks with no other edit; every module of
``torch_kernels.ops`` declares what a family must, and names its backend kernels by literal
strings that lead to them.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import sys
import types

import pytest
import torch

import families as tests_families
import torch_kernels
from torch_kernels import _library, backends, families, selftest
from torch_kernels.families import Case

from harness import require_backend

ROOT = pathlib.Path(torch_kernels.__file__).resolve().parent.parent
TOY_FAMILY = "toy"
TOY_OP = "toy_scale"

# the toy's tests/families module; the bad-input runner's subprocess imports it and so defines the toy there too
TOY_TESTS_MODULE = f'''"""The toy family's bad-input rows (written by tests/test_families.py)."""
import torch

import test_families
from families import Row

test_families.define_toy_family()
BAD_INPUTS = {{"{TOY_FAMILY}": [
    Row("integer x", "x", TypeError, lambda backend: test_families.toy_scale(torch.arange(3), 2.0, backend), "{TOY_OP}"),
    Row("scalar x", "x", ValueError, lambda backend: test_families.toy_scale(torch.tensor(1.0), 2.0, backend), "{TOY_OP}"),
]}}
'''
TOY_MESSAGES = ("integer x -> TypeError: x: expected a floating-point tensor, got torch.int64\n"
                "scalar x -> ValueError: x: expected at least one dimension, got a 0-d tensor\n")


def toy_scale_reference(x, alpha):
    return x * alpha


def toy_scale_pallas(x, alpha):
    """``x * alpha`` as a Pallas kernel, run in interpret mode on the CPU tensor's JAX array."""
    import jax
    from jax.experimental import pallas as pl

    from torch_kernels.pallas.torch_tensors import check_cpu, to_jax, to_torch

    check_cpu(x)

    def kernel(x_ref, out_ref):
        out_ref[...] = x_ref[...] * alpha

    shape = jax.ShapeDtypeStruct(tuple(x.shape), to_jax(x).dtype)
    return to_torch(pl.pallas_call(kernel, out_shape=shape, interpret=True)(to_jax(x)))


def toy_scale(x, alpha, implementation=None):
    """The toy family's public wrapper: ``x * alpha``."""
    return getattr(torch.ops.torch_kernels, TOY_OP)(x, alpha, backends.implementation_arg(implementation))


def _toy_inputs(gen, dtype, device):
    return torch.randn(5, 33, generator=gen).to(device, dtype), 1.5


def _check_toy_input(x):
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("x: expected at least one dimension, got a 0-d tensor")


_toy_libraries: list[torch.library.Library] = []  # the fragment defining the toy op: kept alive while defined


def define_toy_family() -> None:
    """Define ``torch_kernels::toy_scale``, register its kernels and its family (once)."""
    if TOY_FAMILY in families.names():
        return
    library = torch.library.Library("torch_kernels", "FRAGMENT")

    def kernel(x, alpha, implementation=None):
        _check_toy_input(x)
        return backends.dispatch(TOY_OP, x.device.type, implementation, x.contiguous(), alpha)

    def fake(x, alpha, implementation=None):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    _library.define(f"{TOY_OP}(Tensor x, float alpha, str? implementation=None) -> Tensor", kernel, fake,
                    library=library)
    _toy_libraries.append(library)
    backends.register(TOY_OP, "reference", toy_scale_reference)
    backends.register(TOY_OP, "pallas", "test_families:toy_scale_pallas")

    def definition(x, alpha):
        return x.double() * alpha

    # what an ops module declares; __name__ is where its kernels are defined (the coverage checks look there)
    families.register(TOY_FAMILY, types.SimpleNamespace(
        __name__=__name__, __all__=[TOY_OP], toy_scale=toy_scale,
        selftest_cases=lambda: [Case(TOY_OP, _toy_inputs, toy_scale, definition)]))


def remove_toy_family() -> None:
    """Undo :func:`define_toy_family` (whatever part of it ran)."""
    if TOY_FAMILY in families.names():
        families.unregister(TOY_FAMILY)
    backends.unregister(TOY_OP)
    while _toy_libraries:
        library = _toy_libraries.pop()
        if TOY_OP in _library._definitions:
            _library.undefine(TOY_OP, library)


def test_a_family_defined_in_a_test_reaches_the_doctor_the_bad_input_runner_and_the_coverage_checks(tmp_path):
    require_backend("pallas")
    from test_bad_inputs import check_pinned_messages, check_table_on_backend
    from test_family_coverage import check_family

    path_before = os.environ.get(tests_families.EXTRA_PATH_VARIABLE)
    try:
        define_toy_family()
        assert families.names()[-1] == TOY_FAMILY
        assert TOY_FAMILY in families.declared("selftest_cases")
        lines = []
        assert selftest.doctor(print_fn=lines.append, backend_names=("reference", "pallas"),
                               family_names=(TOY_FAMILY,))
        rows = [line.split() for line in lines if line.startswith(TOY_OP)]
        assert [row[:4] for row in rows] == [[TOY_OP, backend, "cpu", dtype] for backend in ("reference", "pallas")
                                             for dtype in ("float32", "float16", "bfloat16")]
        assert all(row[6] == "pass" for row in rows)

        with pytest.raises(AssertionError, match=f"{TOY_FAMILY}: no tests/families/{TOY_FAMILY}.py"):
            check_family(TOY_FAMILY)
        (tmp_path / f"{TOY_FAMILY}.py").write_text(TOY_TESTS_MODULE)
        (tmp_path / "messages").mkdir()
        (tmp_path / "messages" / f"{TOY_FAMILY}.txt").write_text(TOY_MESSAGES)
        os.environ[tests_families.EXTRA_PATH_VARIABLE] = str(tmp_path)
        check_family(TOY_FAMILY)
        check_pinned_messages(TOY_FAMILY)
        for backend in ("reference", "pallas"):
            check_table_on_backend(TOY_FAMILY, backend)
    finally:
        if path_before is None:
            os.environ.pop(tests_families.EXTRA_PATH_VARIABLE, None)
        else:
            os.environ[tests_families.EXTRA_PATH_VARIABLE] = path_before
        sys.modules.pop(f"{tests_families.__name__}.{TOY_FAMILY}", None)
        remove_toy_family()
    assert TOY_FAMILY not in families.names() and not backends.implementations(TOY_OP)
    assert not hasattr(torch.ops.torch_kernels, TOY_OP)
    assert TOY_FAMILY not in tests_families.modules()


def test_register_refuses_a_taken_name_and_unregister_an_unknown_one():
    with pytest.raises(ValueError, match="exists already"):
        families.register("moe", types.SimpleNamespace())
    with pytest.raises(ValueError, match="was not added by register"):
        families.unregister("moe")


def test_selftest_cases_are_every_family_s_in_name_order():
    assert families.names() == tuple(sorted(families.names()))
    ops = [case.op for case in selftest.CASES]
    assert ops == [case.op for name in families.names() for case in families.families()[name].selftest_cases()]
    assert {"mahalanobis_score", "ragged_paged_attention", "fused_moe", "quantized_attention"} <= set(ops)



def _registrations(path: pathlib.Path) -> list[tuple[pathlib.Path, str, ast.expr]]:
    """(path, backend, implementation expression) of every ``backends.register(op, backend, fn)`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "backends"):
            backend, fn = node.args[1], node.args[2]
            assert isinstance(backend, ast.Constant), f"{path.name}:{node.lineno}: backend is not a literal"
            found.append((path, backend.value, fn))
    return found


def _ops_files(family: str) -> list[pathlib.Path]:
    """The files of ``family``'s ops: ``ops/<family>.py``, or every module of the package ``ops/<family>/``."""
    package = ROOT / "torch_kernels" / "ops" / family
    return sorted(package.glob("*.py")) if package.is_dir() else [package.with_suffix(".py")]


@pytest.mark.parametrize("family", families.names())
def test_every_ops_module_is_a_family(family):
    module = families.families()[family]
    cases = module.selftest_cases()
    assert cases and all(isinstance(case, Case) and backends.implementations(case.op) for case in cases)
    assert module.__all__ and all(name in torch_kernels.__all__ and getattr(torch_kernels, name) is
                                  getattr(module, name) for name in module.__all__)

    registrations = [found for path in _ops_files(family) for found in _registrations(path)]
    assert registrations
    for path, backend, fn in registrations:
        where = f"{path.relative_to(ROOT)}:{fn.lineno}"
        if isinstance(fn, (ast.JoinedStr, ast.BinOp)):
            pytest.fail(f"{where}: {backend} kernel named by a composed string")
        if not isinstance(fn, ast.Constant):
            continue  # a function object (the reference kernels)
        target, _, function = fn.value.partition(":")
        source = ROOT.joinpath(*target.split(".")).with_suffix(".py")
        assert source.exists() and re.search(rf"^def {function}\(", source.read_text(), re.M), \
            f"{where}: {fn.value} names no function"
        if backend == "pallas":
            assert target == f"torch_kernels.pallas.{family}"
    if any(backend == "pallas" for _, backend, _ in registrations):
        assert callable(__import__(f"torch_kernels.pallas.{family}", fromlist=["_"]).torchax_implementations)

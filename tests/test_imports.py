"""Imports go one way. Read statically (no module is imported): every ``import`` of every module
of the four packages, at module level or inside a function, relative ones resolved, makes the
graph this test holds to the rules below; each failure names both files."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("torch_kernels", "triton_impl", "jax_impl", "oneapi_impl")

# (importers, importers exempted, imported, why): a module under one of `importers` and under none
# of the exempted may not import a module under `imported`. "" is every module.
UPWARD_IMPORTS = [
    (("triton_impl", "jax_impl", "oneapi_impl"), (), "torch_kernels",
     "a backend package imports nothing from torch_kernels (it receives what it needs as arguments)"),
    (("torch_kernels.ops",), (), "torch_kernels.distributed",
     "the distributed path plugs into the ops through the hooks it registers"),
    (("torch_kernels.ops",), (), "torch_kernels.integrations", "integrations sit on top of the ops"),
    (("",), ("torch_kernels.integrations",), "torch_kernels.integrations",
     "integrations sit on top: nothing below them imports them"),
]
# Packages whose modules may not import each other's underscore-private names (what two of them
# share is a public name of a shared module).
PRIVATE_NAMES_STAY_HOME = ("triton_impl",)


def _modules() -> dict[str, pathlib.Path]:
    """``{dotted name: file}`` for every module of PACKAGES."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _under(module: str, prefix: str) -> bool:
    return prefix == "" or module == prefix or module.startswith(prefix + ".")


def _known(dotted: str) -> str | None:
    """The module of ours that ``dotted`` names (its longest prefix that is one), or None."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return None


def _imports(module: str, source: str, is_package: bool = False) -> list[tuple[str, str, int]]:
    """``(imported module, name taken from it or "", line)`` for each import in ``source`` (the
    text of ``module``; ``is_package``: of its ``__init__.py``) that reaches a module of ours."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name)
                if target:
                    found.append((target, "", node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in MODULES:
                    found.append((submodule, "", node.lineno))
                elif _known(source):
                    found.append((_known(source), alias.name, node.lineno))
    return found


GRAPH = {module: _imports(module, path.read_text(), path.name == "__init__.py") for module, path in MODULES.items()}


def _where(module: str, line: int | None = None) -> str:
    where = str(MODULES[module].relative_to(ROOT))
    return f"{where}:{line}" if line else where


def _cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each as the
    modules in it, sorted."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target, _, _ in GRAPH[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for module in MODULES:
        if module not in index:
            visit(module)
    return components


def test_the_walk_sees_every_kind_of_import():
    """A guard on the walk itself, so that the rules below are not passed by seeing nothing."""
    assert {module.partition(".")[0] for module in MODULES} == set(PACKAGES)
    source = """
import torch
import triton_impl.moe
from .. import _checks, backends
from ..reference import moe as reference
from . import paged_attention


def lazy():
    from triton_impl.paged_attention import _sequence_of
    import torch_kernels.distributed.exchange as exchange
"""
    assert _imports("torch_kernels.ops.moe", source) == [
        ("triton_impl.moe", "", 3), ("torch_kernels._checks", "", 4), ("torch_kernels.backends", "", 4),
        ("torch_kernels.reference.moe", "", 5), ("torch_kernels.ops.paged_attention", "", 6),
        ("triton_impl.paged_attention", "_sequence_of", 10), ("torch_kernels.distributed.exchange", "", 11)]
    assert _imports("triton_impl", "from . import autotune, for_device", is_package=True) == [
        ("triton_impl.autotune", "", 1), ("triton_impl", "for_device", 1)]


def test_no_import_cycles():
    failures = []
    for component in _cycles():
        members = set(component)
        edges = [f"{_where(module, line)} imports {target}" for module in component
                 for target, _, line in GRAPH[module] if target in members]
        failures.append(f"import cycle through {', '.join(_where(m) for m in component)}:\n  "
                        + "\n  ".join(edges))
    assert not failures, "\n".join(failures)


def test_no_upward_imports():
    failures = []
    for importers, exempted, imported, why in UPWARD_IMPORTS:
        for module, edges in GRAPH.items():
            if not any(_under(module, p) for p in importers) or any(_under(module, p) for p in exempted):
                continue
            for target, _, line in edges:
                if _under(target, imported) and not _under(module, imported):
                    failures.append(f"{_where(module, line)} imports {_where(target)}: {why}")
    assert not failures, "\n".join(failures)


def test_no_private_names_borrowed_across_modules():
    failures = []
    for package in PRIVATE_NAMES_STAY_HOME:
        for module, edges in GRAPH.items():
            if not _under(module, package):
                continue
            for target, name, line in edges:
                if target != module and _under(target, package) and name.startswith("_"):
                    failures.append(f"{_where(module, line)} imports {name} from {_where(target)}: a helper two "
                                    f"modules share is a public name of a shared module")
    assert not failures, "\n".join(failures)

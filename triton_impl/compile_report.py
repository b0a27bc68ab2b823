"""Every Triton kernel of every family built ahead of time for a GPU (no GPU needed), and what
each build asks of it: registers, spilled bytes, shared memory, the tensor-core instructions its
matmuls became, and the occupancy that implies.

Builds are each kernel at its default config for the benchmark shapes (a share of them, or all
with ``everything=True``), which each family module of this package declares in its
``compile_groups`` and the target architecture, whose compute capability the default
configs take as a launch takes its device's. :func:`analyze` compiles one build for an architecture and returns a
plain dict (picklable, so builds can run in a process pool); tests/test_device_compile.py holds
the rows to the GPU's limits and benchmarks/compiled_kernels.py writes them as a table.

Tensor cores: for each ``tt.dot`` Triton kept (tf32x3 ones already split into three tf32 dots),
its operand type, tile and the warps decide the best instruction the GPU offers: ``wgmma`` on sm_90
for 8-bit, 16-bit and tf32 operands when the tile's M is a multiple of 64, N of 8 and the warps a
multiple of 4 (a warp group), else ``mma`` (``mma.sync``); float32 operands with
``input_precision="ieee"`` have no tensor-core form (a kernel asks for that on purpose). Each dot
is compared with what Triton made of it (``ttng.warp_group_dot``, a ``tt.dot`` with an mma
layout, or one with a blocked layout: FMAs).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import re

ARCHS = (90, 80)


@dataclasses.dataclass(frozen=True)
class GPU:
    """The per-SM limits occupancy depends on (CUDA's occupancy rules for compute capability 8.0
    and 9.0): registers are allocated per warp in units of 256 from one of four 16,384-register
    sub-partitions; each block also reserves 1 KiB of shared memory for the runtime."""

    name: str
    shared_per_sm: int  # the largest shared-memory carveout
    shared_per_block: int  # cudaDevAttrMaxSharedMemoryPerBlockOptin, the limit Triton launches with
    registers: int = 65_536
    max_warps: int = 64
    max_blocks: int = 32
    register_unit: int = 256
    sub_partitions: int = 4
    reserved_shared: int = 1024
    shared_unit: int = 128


GPUS = {90: GPU("sm_90 (H100, H200)", 233_472, 232_448), 80: GPU("sm_80 (A100)", 167_936, 166_912)}


def occupancy(registers: int, shared: int, num_warps: int, arch: int) -> dict:
    """Blocks and warps one SM holds at once for a kernel of ``registers`` per thread and
    ``shared`` bytes per block launched with ``num_warps``, and what limits them."""
    gpu = GPUS[arch]
    per_warp = -(-max(1, registers) * 32 // gpu.register_unit) * gpu.register_unit
    warps_by_registers = gpu.registers // gpu.sub_partitions // per_warp * gpu.sub_partitions
    block_shared = -(-shared // gpu.shared_unit) * gpu.shared_unit + gpu.reserved_shared
    limits = {"registers": warps_by_registers // num_warps, "shared": gpu.shared_per_sm // block_shared,
              "warps": gpu.max_warps // num_warps, "blocks": gpu.max_blocks}
    blocks = min(limits.values())
    limiter = min(limits, key=limits.get)  # first of the equals: registers before the fixed caps
    return {"blocks_per_sm": blocks, "warps_per_sm": blocks * num_warps,
            "occupancy": blocks * num_warps / gpu.max_warps, "occupancy_limiter": limiter}


@dataclasses.dataclass(frozen=True)
class Build:
    """One kernel to compile as a launch would: its arguments' types, constexprs and config;
    ``divisible`` names the integer arguments a launch on these shapes has multiples of 16."""

    family: str
    label: str
    kernel: object
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int | None  # None: Triton's default, as launches that pass none
    divisible: tuple = ()

    def key(self):
        """What makes two builds the same binary."""
        return (self.kernel, tuple(sorted(self.signature.items())), tuple(sorted(self.constexprs.items())),
                self.num_warps, self.num_stages, self.divisible)

    def needs_fp8e4nv(self) -> bool:
        """Triton has no float8_e4m3fn before sm_89; the ops pass such calls to the next backend."""
        return any("fp8e4nv" in kind for kind in self.signature.values())

    def config(self) -> str:
        """The launch config as text: tile constexprs, warps, stages."""
        tiles = [f"{name}={value}" for name, value in self.constexprs.items()
                 if isinstance(value, int) and not isinstance(value, bool)
                 and (name.startswith("B") or name in ("NUM_SPLITS", "GROUP_M"))]
        stages = "default" if self.num_stages is None else self.num_stages
        return " ".join(tiles + [f"warps={self.num_warps}", f"stages={stages}"])


def family_modules() -> dict:
    """``{family: module}`` for every module of this package that declares ``compile_groups``."""
    import pkgutil

    modules = {}
    for info in pkgutil.iter_modules(importlib.import_module(__package__).__path__):
        if not info.name.startswith("_"):
            module = importlib.import_module(f"{__package__}.{info.name}")
            if hasattr(module, "compile_groups"):
                modules[info.name] = module
    return modules


def build_groups(everything: bool = False) -> dict:
    """``{group id: function of an arch returning its builds}``: every family's groups (its
    ``compile_groups(everything)``, whose docstring says what CI's share of it is). By default the
    share CI builds; ``everything``: every size for every dtype (about 400 builds)."""
    groups = {}
    for family, module in family_modules().items():
        for group, make in module.compile_groups(everything).items():
            groups[group] = functools.partial(_family_builds, family, make)
    return groups


def _family_builds(family: str, make, arch: int = 90) -> list[Build]:
    return [Build(family=family, **fields) for fields in make(arch)]


def builds_for(group_builds, arch: int) -> list[Build]:
    """A group's builds that exist on ``arch``, each distinct binary once."""
    unique = {}
    for build in group_builds:
        if arch < 89 and build.needs_fp8e4nv():
            continue
        unique.setdefault(build.key(), build)
    return list(unique.values())


# ---- one build, analyzed ----

_DOT_OPS = ("= tt.dot ", "= ttng.warp_group_dot ")  # Triton's own dot, and Hopper's wgmma form of it


def _shape_and_type(text: str) -> tuple[list[int], str]:
    """``([dims], element type)`` of an MLIR tensor or memdesc type's text."""
    body = text[text.index("<") + 1:]
    parts = body.split(",")[0].split("x")
    dims = [int(part) for part in parts[:-1]]
    return dims, parts[-1].strip()


def _dot_lowering(line: str, result: str) -> str:
    if "ttng.warp_group_dot" in line:
        return "wgmma"
    return "mma" if "#mma" in result.split(" loc(")[0] else "fma"


def _best_instruction(a_type: str, precision: str, m: int, n: int, k: int, bits: int, num_warps: int,
                      arch: int) -> tuple[str, str]:
    """(the best instruction a dot of these operands and tile can be on ``arch``, why not better)."""
    if a_type == "f32" and precision == "ieee":
        return "fma", "float32 ieee operands"
    if arch >= 90:
        if num_warps % 4:
            return "mma", f"{num_warps} warps, no warp group"
        if m % 64:
            return "mma", f"M={m}: wgmma takes 64-row tiles"
        if n % 8 or k < 256 // bits:
            return "mma", f"N={n}, K={k}: below wgmma's tile"
        return "wgmma", ""
    return "mma", ""


_ORDER = {"fma": 0, "mma": 1, "wgmma": 2}


def dots(ttgir: str, num_warps: int, arch: int) -> list[dict]:
    """Each matrix product in a kernel's TTGIR: its tile, operand type, what it became and the
    best it could be (module docstring)."""
    found = []
    for line in ttgir.splitlines():
        if not any(op in line for op in _DOT_OPS):
            continue
        types = line.rsplit(" : ", 1)[1]  # "A * B -> C loc(...)"
        a_text, rest = types.split(" * ", 1)
        b_text, result = rest.split(" -> ", 1)
        (m, k), a_type = _shape_and_type(a_text)
        (_, n), _ = _shape_and_type(b_text)
        # printed by name on tt.dot, by number on wgmma; left out where it is the default, ieee
        precision = re.search(r"inputPrecision = (\w+)", line)
        precision = {"0": "tf32", "1": "tf32x3", "2": "ieee"}.get(precision[1], precision[1]) if precision else "ieee"
        bits = {"f32": 32, "f16": 16, "bf16": 16, "i8": 8}.get(a_type, 8)  # float8 types: 8
        best, reason = _best_instruction(a_type, precision, m, n, k, bits, num_warps, arch)
        found.append({"m": m, "n": n, "k": k, "operands": a_type, "precision": precision,
                      "instruction": _dot_lowering(line, result), "best": best, "reason": reason})
    return found


def _tensor_core_summary(found: list[dict], ptx: str) -> tuple[str, str]:
    """(the tensor-core instructions in the PTX, or "none"; "-" for a kernel without dots, and
    why dots fall short of wgmma where some do)."""
    if not found:
        return "-", ""
    used = [name for name, text in (("wgmma", "wgmma.mma_async"), ("mma", "mma.sync")) if text in ptx]
    reasons = sorted({dot["reason"] for dot in found if dot["reason"]})
    return "+".join(used) or "none", "; ".join(reasons)


_TMA_COPY = re.compile(r"\bcp\.async\.bulk\.tensor\b")
_ASYNC_COPY = re.compile(r"\bcp\.async\.(?:ca|cg)\b")
_COPY_WAIT = re.compile(r"\bcp\.async\.wait_group\s+(\d+)")


def async_copies(ptx: str) -> dict:
    """How a kernel's loads reach shared memory: ``async_copies`` is ``"tma"`` (Hopper's tensor
    memory accelerator, ``cp.async.bulk.tensor``), ``"cp.async"`` (Ampere's asynchronous copies,
    which Triton's software pipeliner emits for a loop's loads) or ``"none"`` (plain loads, nothing
    overlapped with compute); ``async_copy_instructions`` counts them; ``copies_in_flight`` is the
    most copy groups a ``cp.async.wait_group`` leaves outstanding (0: each wait drains every copy,
    so loads and compute do not overlap)."""
    tma, plain = len(_TMA_COPY.findall(ptx)), len(_ASYNC_COPY.findall(ptx))
    waits = [int(n) for n in _COPY_WAIT.findall(ptx)]
    return {"async_copies": "tma" if tma else "cp.async" if plain else "none",
            "async_copy_instructions": tma + plain, "copies_in_flight": max(waits, default=0)}


# tf32 wgmma tiles 8 wide (as when 8 warps split a 16-wide float32 dot in two): Triton from 3.6 on can
# read past their shared memory with them (triton-lang/triton#10629); a linear-attention kernel built
# so is where an H200 run hit an illegal memory access
_NARROW_TF32_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n8k8\.f32\.tf32\.tf32")


def build_key(build: Build, arch: int) -> str:
    """What a build's report row stands for: a hash of the kernel's source with every jitted
    function and constexpr global it uses (Triton's ``cache_key``), the build's arguments, the
    target, the Triton version, and the source of this module and of the package's ``compile_for``
    and ``resource_usage`` (not the rest of the package's ``__init__``: how CPU tensors are
    interpreted builds nothing). Two builds with one key compile to the same binary with the same
    analysis, so a committed row with this key is what compiling it again would give."""
    import hashlib
    import inspect

    import triton

    from . import compile_for, resource_usage

    sources = [inspect.getsource(compile_for), inspect.getsource(resource_usage),
               inspect.getsource(importlib.import_module(__name__))]
    parts = (triton.__version__, build.kernel.cache_key, repr(build.key()[1:]), arch, *sources)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def analyze(build: Build, arch: int) -> dict:
    """Compile ``build`` for ``arch`` and return its report row (the module docstring's columns;
    ``spill_bytes`` is spill stores plus spill loads, per thread; ``build_key`` is :func:`build_key`)."""
    from . import compile_for, resource_usage

    compiled = compile_for(build.kernel, build.signature, build.constexprs, arch, build.num_warps, build.num_stages,
                           divisible=build.divisible)
    usage = resource_usage(compiled)
    ptx = compiled.asm["ptx"]
    found = dots(compiled.asm["ttgir"], build.num_warps, arch)
    tensor_cores, reason = _tensor_core_summary(found, ptx)
    return {
        "family": build.family, "kernel": build.label, "function": build.kernel.fn.__name__, "arch": f"sm_{arch}",
        "config": build.config(), "num_warps": build.num_warps, "registers": usage["registers"],
        "spill_bytes": usage["spill_stores"] + usage["spill_loads"], "spill_stores": usage["spill_stores"],
        "spill_loads": usage["spill_loads"], "stack_bytes": usage["stack"],
        "shared_bytes": usage["shared"], "shared_limit": GPUS[arch].shared_per_block,
        "tensor_cores": tensor_cores, "tensor_core_note": reason,
        "dots": len(found), "dots_short": sum(_ORDER[d["instruction"]] < _ORDER[d["best"]] for d in found),
        "num_stages": compiled.metadata.num_stages, **async_copies(ptx),
        "dot_detail": found, "narrow_tf32_wgmma": len(_NARROW_TF32_WGMMA.findall(ptx)),
        **occupancy(usage["registers"], usage["shared"], build.num_warps, arch),
        "targets_arch": f".target sm_{arch}" in ptx, "cubin_bytes": len(compiled.asm["cubin"]),
        "build_key": build_key(build, arch),
    }


def analyze_by_name(module: str, name: str, build_fields: dict, arch: int) -> dict:
    """:func:`analyze` for a build whose kernel is named (module, attribute): what a worker process
    receives, as a jitted kernel does not pickle."""
    kernel = getattr(importlib.import_module(module), name)
    return analyze(Build(kernel=kernel, **build_fields), arch)


def submit(pool, build: Build, arch: int):
    """``pool.submit`` of :func:`analyze` for ``build`` on ``arch`` (a concurrent.futures pool)."""
    fields = {field.name: getattr(build, field.name) for field in dataclasses.fields(build) if field.name != "kernel"}
    return pool.submit(analyze_by_name, build.kernel.fn.__module__, build.kernel.fn.__name__, fields, arch)


def problems(row: dict) -> list[str]:
    """What is wrong with one row: any spill (a spilled byte or stack frame), more shared memory
    than a block may have, a dot short of the tensor-core instruction its operands and tile allow,
    tf32 wgmma tiles 8 wide (``_NARROW_TF32_WGMMA``), a PTX not for its target."""
    found = []
    if not row["targets_arch"]:
        found.append(f"PTX not for {row['arch']}")
    if row["spill_bytes"] or row["stack_bytes"]:
        found.append(f"spills ({row['spill_stores']} bytes stored, {row['spill_loads']} loaded, "
                     f"{row['stack_bytes']} bytes of stack) at {row['registers']} registers")
    if row.get("narrow_tf32_wgmma"):
        found.append(f"{row['narrow_tf32_wgmma']} tf32 wgmma tiles 8 wide (m64n8k8), which Triton >= 3.6 can read "
                     "past their shared memory with (triton-lang/triton#10629): fewer warps or a wider dot")
    if row["shared_bytes"] > row["shared_limit"]:
        found.append(f"{row['shared_bytes']:,} bytes of shared memory, over {row['shared_limit']:,}")
    if "dot_detail" not in row and row["dots_short"]:  # a committed row keeps the count only
        found.append(f"{row['dots_short']} dot(s) short of the tensor-core instruction their operands and tile allow")
    for dot in row.get("dot_detail", ()):
        if _ORDER[dot["instruction"]] < _ORDER[dot["best"]]:
            found.append(f"a {dot['m']}x{dot['n']}x{dot['k']} {dot['operands']} ({dot['precision']}) dot became "
                         f"{dot['instruction']}, where {dot['best']} was possible")
    return found


def worst(rows: list[dict]) -> list[dict]:
    """Per family and architecture: the most registers and spilled bytes, the lowest occupancy, and
    how many builds with matrix products do not overlap their loads with compute (no asynchronous
    copy, or ``cp.async`` copies every wait drains)."""
    summary = {}
    for row in rows:
        key = (row["family"], row["arch"])
        entry = summary.setdefault(key, {"family": row["family"], "arch": row["arch"], "builds": 0, "registers": 0,
                                         "spill_bytes": 0, "shared_bytes": 0, "occupancy": math.inf,
                                         "lowest_occupancy_kernel": "", "tensor_core_misses": 0,
                                         "dot_builds": 0, "dot_builds_unpipelined": 0})
        entry["builds"] += 1
        if row["dots"]:
            entry["dot_builds"] += 1
            entry["dot_builds_unpipelined"] += row["async_copies"] == "none" or (
                row["async_copies"] == "cp.async" and row["copies_in_flight"] == 0)
        entry["registers"] = max(entry["registers"], row["registers"])
        entry["spill_bytes"] = max(entry["spill_bytes"], row["spill_bytes"])
        entry["shared_bytes"] = max(entry["shared_bytes"], row["shared_bytes"])
        entry["tensor_core_misses"] += row["dots_short"]
        if row["occupancy"] < entry["occupancy"]:
            entry["occupancy"], entry["lowest_occupancy_kernel"] = row["occupancy"], row["kernel"]
    return list(summary.values())


def process_pool(workers: int | None = None):
    """A pool for :func:`submit`: spawned processes (a forked one would inherit this process's
    Triton state), one per core up to 8; each build is seconds of single-threaded compiling."""
    import concurrent.futures
    import multiprocessing
    import os

    workers = workers or min(os.cpu_count() or 1, 8)
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))

"""Every Triton kernel of every family built ahead of time for a GPU (no GPU needed), and what
each build asks of it: registers, spilled bytes, shared memory, the tensor-core instructions its
matmuls became, and the occupancy that implies.

Builds are each kernel at its default config for the benchmark shapes (a share of them, or all
with ``everything=True``) and the target architecture, whose compute capability the default
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

import torch

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


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- the builds of each family ----

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LINEAR_ATTENTION_SIZES = (64, 128, 256)
PAGED_HEAD_SIZES = (64, 128, 256)
QUANTIZED_ATTENTION_HEAD_SIZES = (64, 96, 128)
MAX_SPLITS = 16  # the most key-range splits paged attention's config takes: the merge's widest tile
PAGED_CASES = [  # (query dtype, cache dtype, decode batch, fused write)
    (torch.bfloat16, torch.bfloat16, True, False),
    (torch.bfloat16, torch.bfloat16, False, True),
    (torch.float16, torch.float8_e4m3fn, True, True),
    (torch.bfloat16, torch.float8_e5m2, False, False),
    (torch.float16, torch.int8, True, False),
    (torch.float32, torch.float32, True, False),
]
MOE_GEMMS = ("fused_gate_up", "fused_down", "grouped_mm_kn", "grouped_mm_nk", "weight_grad")
MOE_CASES = [  # (model, dtype, float8 weights, block shape, tokens, the kernels built (None: all))
    ("qwen3-30b-a3b", torch.bfloat16, None, None, 4096, None),
    ("deepseek-v3", torch.bfloat16, None, None, 4096, ("router_topk", "fused_gate_up", "fused_down")),
    ("qwen3-30b-a3b", torch.float32, None, None, 4096, MOE_GEMMS),  # tf32x3
    ("deepseek-v3", torch.float16, None, None, 1, MOE_GEMMS),  # decode: 16-row tiles
    ("deepseek-v3", torch.bfloat16, torch.float8_e4m3fn, (128, 128), 4096, MOE_GEMMS),
    ("qwen3-30b-a3b", torch.float16, torch.float8_e4m3fn, None, 1, MOE_GEMMS),
]


def linear_attention_builds(size: int, dtypes, arch: int = 90) -> list[Build]:
    """Every kernel of the delta rule and gated linear attention at K = V = ``size``, configured for
    ``arch`` (as every family's builds: a launch takes its device's compute capability)."""
    from . import linear_attention

    return [Build("linear_attention", f"{name} {_name(dtype)} {'delta' if delta else 'gla'} K=V={size}", kernel,
                  signature, constexprs, config.num_warps, config.num_stages)
            for dtype in dtypes for delta in (True, False)
            for name, kernel, signature, constexprs, config, _ in linear_attention.compile_targets(
                dtype, delta, size, size, arch=arch)]


def paged_attention_builds(head_size: int, cases, arch: int = 90) -> list[Build]:
    """Attention, the cache write and the split merge for each (query, cache, decode, fused) case."""
    from . import paged_attention as pa

    builds = []
    for query_dtype, cache_dtype, decode, fused in cases:
        signature, constexprs, config = pa.compile_targets(query_dtype, cache_dtype, head_size=head_size,
                                                           decode=decode, fused=fused, arch=arch)
        label = (f"{_name(query_dtype)} q, {_name(cache_dtype)} cache, {'decode' if decode else 'prefill'}"
                 f"{', fused' if fused else ''}, D={head_size}")
        builds.append(Build("paged_attention", f"paged_attention {label}", pa.paged_attention_kernel, signature,
                            constexprs, config.num_warps, config.num_stages))
        write_signature, write_constexprs = pa.write_compile_targets(query_dtype, cache_dtype, head_size,
                                                                     constexprs["HKV"], constexprs["BLOCK_SIZE"])
        builds.append(Build("paged_attention", f"reshape_and_cache {label}", pa.reshape_and_cache_kernel,
                            write_signature, write_constexprs, 4, None))
        builds.append(Build("paged_attention", f"merge_splits {_name(query_dtype)} out, {MAX_SPLITS} splits, "
                            f"D={head_size}", pa.merge_splits_kernel, {
                                "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
                                "out_ptr": "*" + pa._TRITON_TYPES[query_dtype], "num_rows": "i32",
                                "NUM_SPLITS": "constexpr", "D": "constexpr", "DP": "constexpr"},
                            dict(NUM_SPLITS=MAX_SPLITS, D=head_size, DP=constexprs["DP"]), 4, None))
    return builds


def ood_builds(dtypes, arch: int = 90) -> list[Build]:
    """Mahalanobis scoring at 1 and 150 classes and EDM scoring (denoise and scoped) per dtype (the
    same configs on every ``arch``)."""
    from . import ood

    builds = []
    for dtype in dtypes:
        for classes in (1, 150):
            signature, constexprs, num_warps = ood.compile_targets(dtype, classes)
            builds.append(Build("ood", f"mahalanobis_min {_name(dtype)} C={classes}", ood.mahalanobis_min_kernel,
                                signature, constexprs, num_warps, None))
        for scoped in (False, True):
            signature, constexprs, config = ood.edm_compile_targets(dtype, scoped)
            builds.append(Build("ood", f"edm_score {_name(dtype)} {'scoped' if scoped else 'denoise'} H=512",
                                ood.edm_score_kernel, signature, constexprs, config.num_warps, config.num_stages))
    return builds


def quantized_attention_builds(head_size: int, dtypes, arch: int = 90) -> list[Build]:
    """Every kernel of the forward (each P.V dtype) and backward at ``head_size``."""
    from . import quantized_attention

    return [Build("quantized_attention", f"{label} {_name(dtype)} D={head_size}", kernel, signature, constexprs,
                  num_warps, num_stages)
            for dtype in dtypes
            for label, kernel, signature, constexprs, num_warps, num_stages, _ in
            quantized_attention.compile_targets(dtype, head_size, arch=arch)]


def moe_builds(model: str, dtype: torch.dtype, weight_dtype, block_shape, tokens: int, only,
               arch: int = 90) -> list[Build]:
    """One MoE layer of ``model``'s kernels (those named in ``only``; None: all), built as a launch
    on these shapes specializes them; the row-wise kernels, with no loads to pipeline, as plain
    builds (the same configs on every ``arch``)."""
    from . import moe

    weights = f" {_name(weight_dtype)} weights {block_shape or 'per channel'}" if weight_dtype else ""
    return [Build("moe", f"{target.name} {model} {_name(dtype)}{weights} T={tokens}", target.kernel, target.signature,
                  target.constexprs, target.config.num_warps, target.config.num_stages if target.has_dots else None,
                  tuple(target.divisible) if target.has_dots else ())
            for target in moe.compile_targets(model, dtype, weight_dtype, block_shape, num_tokens=tokens)
            if only is None or target.name in only]


def build_groups(everything: bool = False) -> dict:
    """``{group id: function of an arch returning its builds}``, a group per family and size. By default the
    share CI builds: every kernel at every size, for a share of the dtypes (linear attention
    float32 and bfloat16 at K = V = 256, the widest state, float16 at 128, bfloat16 at 64: the chunk
    kernels' tiles do not change with K, V, and float16 and bfloat16 share them; paged attention
    every case at head size 256 and a few at 64 and 128; quantized attention every kernel at head
    sizes 64, 96 and 128, float32 at 128 only; MoE the GEMMs at prefill and decode, 16-bit,
    float32 and float8 weights). ``everything``: every size for every dtype (about 400 builds)."""
    shares = {64: (torch.bfloat16,), 128: (torch.float16,), 256: (torch.float32, torch.bfloat16)}
    groups = {f"linear_attention-K{size}": functools.partial(linear_attention_builds, size,
                                                             DTYPES if everything else shares[size])
              for size in LINEAR_ATTENTION_SIZES}
    few = [PAGED_CASES[0], PAGED_CASES[1], PAGED_CASES[5]]  # 16-bit decode, prefill; float32 (most shared)
    groups.update({f"paged_attention-D{size}": functools.partial(
        paged_attention_builds, size, PAGED_CASES if everything or size == 256 else few) for size in PAGED_HEAD_SIZES})
    groups["ood"] = functools.partial(ood_builds, DTYPES)
    quantized_shares = {64: (torch.float16,), 96: (torch.bfloat16,), 128: (torch.bfloat16, torch.float32)}
    groups.update({f"quantized_attention-D{size}": functools.partial(
        quantized_attention_builds, size, DTYPES if everything else quantized_shares[size])
        for size in QUANTIZED_ATTENTION_HEAD_SIZES})
    for number, case in enumerate(MOE_CASES):
        model, dtype, weight_dtype, block_shape, tokens, only = case
        groups[f"moe-{model}-{_name(dtype)}{'-fp8' if weight_dtype else ''}-T{tokens}"] = functools.partial(
            moe_builds, model, dtype, weight_dtype, block_shape, tokens, None if everything else only)
    return groups


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


# tf32 wgmma tiles 8 wide (as when 8 warps split a 16-wide float32 dot in two): Triton from 3.6 on can
# read past their shared memory with them (triton-lang/triton#10629); a linear-attention kernel built
# so is where an H200 run hit an illegal memory access
_NARROW_TF32_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n8k8\.f32\.tf32\.tf32")


def analyze(build: Build, arch: int) -> dict:
    """Compile ``build`` for ``arch`` and return its report row (the module docstring's columns;
    ``spill_bytes`` is spill stores plus spill loads, per thread)."""
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
        "dot_detail": found, "narrow_tf32_wgmma": len(_NARROW_TF32_WGMMA.findall(ptx)),
        **occupancy(usage["registers"], usage["shared"], build.num_warps, arch),
        "targets_arch": f".target sm_{arch}" in ptx, "cubin_bytes": len(compiled.asm["cubin"]),
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
    for dot in row["dot_detail"]:
        if _ORDER[dot["instruction"]] < _ORDER[dot["best"]]:
            found.append(f"a {dot['m']}x{dot['n']}x{dot['k']} {dot['operands']} ({dot['precision']}) dot became "
                         f"{dot['instruction']}, where {dot['best']} was possible")
    return found


def worst(rows: list[dict]) -> list[dict]:
    """Per family and architecture: the most registers and spilled bytes, the lowest occupancy."""
    summary = {}
    for row in rows:
        key = (row["family"], row["arch"])
        entry = summary.setdefault(key, {"family": row["family"], "arch": row["arch"], "builds": 0, "registers": 0,
                                         "spill_bytes": 0, "shared_bytes": 0, "occupancy": math.inf,
                                         "lowest_occupancy_kernel": "", "tensor_core_misses": 0})
        entry["builds"] += 1
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

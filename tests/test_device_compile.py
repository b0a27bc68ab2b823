"""Every kernel builds for its real device here, with no device: Triton for Hopper (sm_90) and
Ampere (sm_80), each kernel at its default config, held to no register spills, the target's
shared memory per block (a kernel over it compiles but fails to launch) and tensor cores for every
dot whose operands allow them, Pallas lowered for TPU (which enforces the TPU
block-shape rules that interpret mode does not), SYCL kernels as SPIR-V, the form an Intel GPU
loads."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import pathlib

import pytest

from harness import require_backend


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("b, d, c", [(1, 1, 1), (1000, 385, 3), (64, 1024, 150)])
def test_pallas_ood_lowers_for_tpu(dtype, b, d, c):
    require_backend("pallas")
    import jax
    import jax.numpy as jnp

    from jax_impl import ood

    f32 = jnp.float32
    shapes = (
        jax.ShapeDtypeStruct((b, d), jnp.dtype(dtype)), jax.ShapeDtypeStruct((d,), f32),
        jax.ShapeDtypeStruct((d, d), jnp.dtype(dtype)), jax.ShapeDtypeStruct((c, d), f32),
        jax.ShapeDtypeStruct((c,), f32),
    )
    kernel = functools.partial(ood.mahalanobis_min, interpret=False)
    exported = jax.export.export(jax.jit(kernel), platforms=["tpu"])(*shapes)
    assert "tpu_custom_call" in exported.mlir_module()


def test_sycl_ood_builds_spirv():
    require_backend("sycl")
    from oneapi_impl import ood

    binaries = ood.spirv_binaries()
    assert binaries
    for spv in binaries:
        assert int.from_bytes(spv[:4], "little") == 0x07230203  # the SPIR-V magic number


def test_sycl_edm_builds_spirv():
    require_backend("sycl")
    from oneapi_impl import ood

    binaries = ood.edm_spirv_binaries()
    assert len(binaries) == 8  # four x dtypes, two statistics
    for spv in binaries:
        assert int.from_bytes(spv[:4], "little") == 0x07230203  # the SPIR-V magic number


def test_sycl_linear_attention_builds_spirv():
    require_backend("sycl")
    from oneapi_impl import linear_attention

    binaries = linear_attention.spirv_binaries()
    assert len(binaries) == 7  # three dtypes, delta rule and gated linear attention; KDA's per-channel decay
    for spv in binaries:
        assert int.from_bytes(spv[:4], "little") == 0x07230203  # the SPIR-V magic number


def test_sycl_quantized_attention_builds_spirv():
    require_backend("sycl")
    from oneapi_impl import quantized_attention

    binaries = quantized_attention.spirv_binaries()
    assert len(binaries) == 3  # three input dtypes
    for spv in binaries:
        assert int.from_bytes(spv[:4], "little") == 0x07230203  # the SPIR-V magic number


def test_sycl_mla_builds_spirv():
    require_backend("sycl")
    from oneapi_impl import mla

    binaries = mla.spirv_binaries()
    assert len(binaries) == 4  # bfloat16 over bfloat16 and fp8, float32; the indexer
    for spv in binaries:
        assert int.from_bytes(spv[:4], "little") == 0x07230203  # the SPIR-V magic number


# --- Triton: every kernel at its default config, compiled for sm_90 and sm_80 ---------------------
#
# The builds and their analysis live in triton_impl/compile_report.py (benchmarks/compiled_kernels.py
# writes the same rows as a report, every build for both archs, and commits it). CI checks every kernel
# at every size it serves, for a share of the dtypes, for sm_90, and for sm_80 the groups whose committed
# report comes near sm_80's shared memory; TORCH_KERNELS_COMPILE_ALL=1 builds every size for every dtype
# for both (about 400 builds, minutes). A build whose key (compile_report.build_key: the kernel's source
# and everything it uses, the build's arguments, the target, Triton's version) has a row in the committed
# report is checked on that row, which compiling it again would give (test_committed_rows_are_what_builds_give);
# a build the report lacks, as after a kernel changed, is compiled here.

COMPILE_ALL = os.environ.get("TORCH_KERNELS_COMPILE_ALL") == "1"
REPORT = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "compiled_kernels.json"
NEAR_THE_LIMIT = 0.75  # of an arch's shared memory per block, in the committed report
try:
    from triton_impl import compile_report
except ImportError:  # no Triton: the tests below skip (or fail, where every backend is required)
    compile_report = None
GROUPS = compile_report.build_groups(COMPILE_ALL) if compile_report else {"triton": None}
ARCHS = compile_report.ARCHS if compile_report else (90, 80)


def _committed_rows() -> list[dict]:
    return json.loads(REPORT.read_text())


def _group_archs() -> list:
    """(group, arch) pairs CI checks: every group for the first arch (sm_90, the GPU the kernels are
    tuned on); for the others the groups with a build whose committed report row uses over
    ``NEAR_THE_LIMIT`` of that arch's shared memory per block (the ones a change could push past it;
    the report has every build for every arch). TORCH_KERNELS_COMPILE_ALL=1: every group for every arch."""
    if compile_report is None:
        return [(group, arch) for arch in ARCHS for group in GROUPS]
    near = {(row["family"], row["kernel"], row["arch"]) for row in _committed_rows()
            if row["shared_bytes"] > NEAR_THE_LIMIT * row["shared_limit"]}
    return [(group, arch) for arch in ARCHS for group, make in GROUPS.items()
            if COMPILE_ALL or arch == ARCHS[0] or any((b.family, b.label, f"sm_{arch}") in near for b in make(arch))]


@pytest.fixture(scope="module")
def build_pool():
    """Worker processes for the builds (each is a few seconds of single-threaded compiling), started
    by the first test with something to build."""
    require_backend("triton")
    with contextlib.ExitStack() as stack:
        yield functools.cache(lambda: stack.enter_context(compile_report.process_pool()))


@pytest.fixture(scope="module")
def committed():
    """The committed report's rows by build key (COMPILE_ALL: none, everything is built)."""
    return {} if COMPILE_ALL else {row["build_key"]: row for row in _committed_rows() if "build_key" in row}


@pytest.mark.parametrize("group, arch", _group_archs(), ids=[f"{group}-{arch}" for group, arch in _group_archs()])
def test_triton_kernels_build_and_fit_the_gpu(group, arch, build_pool, committed, record_property):
    """Each build's PTX targets ``arch`` and its cubin exists; no build spills a register, asks for
    more shared memory than a block of ``arch`` may have (it would compile, then fail to launch),
    leaves a dot short of the tensor-core instruction its operands and tile allow, or takes 8-wide
    tf32 wgmma tiles, which Triton reads past their shared memory with (``compile_report.problems``).
    Builds the committed report lacks are compiled; the rows are printed and recorded."""
    every_build = GROUPS[group](arch)
    assert every_build, group
    builds = compile_report.builds_for(every_build, arch)
    if not builds:
        pytest.skip(f"every build takes float8_e4m3fn, which Triton has from sm_89 on, not sm_{arch}")
    keys = [compile_report.build_key(build, arch) for build in builds]
    jobs = {key: compile_report.submit(build_pool(), build, arch) for key, build in zip(keys, builds)
            if key not in committed}
    rows = [committed[key] if key not in jobs else jobs[key].result() for key in keys]
    table = "\n".join([f"sm_{arch}, shared memory limit {compile_report.GPUS[arch].shared_per_block:,} bytes; "
                       f"{len(jobs)} of {len(rows)} builds compiled here (the others' rows are the committed ones)",
                       f"{'kernel':70s} {'shared':>8s} {'regs':>5s} {'spill':>6s} {'tensor cores':>12s} {'occupancy':>9s}"]
                      + [f"{row['kernel']:70s} {row['shared_bytes']:8d} {row['registers']:5d} {row['spill_bytes']:6d} "
                         f"{row['tensor_cores']:>12s} {row['occupancy']:9.0%}" for row in rows])
    print(table)
    record_property("resources", table)
    assert all(row["cubin_bytes"] > 1000 for row in rows), group
    problems = [f"{row['kernel']}: {problem}" for row in rows for problem in compile_report.problems(row)]
    assert not problems, f"sm_{arch}:\n" + "\n".join(problems)


@pytest.mark.parametrize("arch", ARCHS)
def test_committed_rows_are_what_builds_give(arch, committed):
    """A committed row is what compiling its build gives now: one build per arch (the smallest
    family's first, a few seconds) compiled and compared with its row, field by field. Keeps the
    toolchain path running in every run and the keys honest."""
    require_backend("triton")
    build = min((b for make in GROUPS.values() for b in compile_report.builds_for(make(arch), arch)),
                key=lambda b: (b.family != "ood", b.family, b.label))
    key = compile_report.build_key(build, arch)
    assert key in committed, "regenerate the report: python benchmarks/compiled_kernels.py"
    fresh = compile_report.analyze(build, arch)
    assert {k: v for k, v in fresh.items() if k != "dot_detail"} == committed[key]


def test_committed_report_is_current(committed):
    """Every build CI checks has its row, under its current key, in the committed report: a kernel
    changed or added lands with its report regenerated (python benchmarks/compiled_kernels.py)."""
    require_backend("triton")
    if COMPILE_ALL:
        pytest.skip("TORCH_KERNELS_COMPILE_ALL=1 builds every kernel instead of reading the report")
    stale = sorted({f"{build.family} {build.label} sm_{arch}" for group, arch in _group_archs()
                    for build in compile_report.builds_for(GROUPS[group](arch), arch)
                    if compile_report.build_key(build, arch) not in committed})
    assert not stale, ("builds without a current row in benchmarks/results/compiled_kernels.json (regenerate it: "
                       f"python benchmarks/compiled_kernels.py): {stale}")


def test_every_triton_kernel_is_built():
    """Every ``@triton.jit`` kernel a module of triton_impl defines is among the builds (building
    none): a family module with kernels declares them in its ``compile_groups``."""
    require_backend("triton")
    import importlib
    import pkgutil

    import triton_impl
    from triton.runtime.jit import JITFunction

    defined = set()
    for info in pkgutil.iter_modules(triton_impl.__path__):
        module = importlib.import_module(f"triton_impl.{info.name}")
        defined |= {(info.name, name) for name, value in vars(module).items()
                    if isinstance(value, JITFunction) and name.endswith("_kernel")
                    and value.fn.__module__ == module.__name__}
    assert defined, "no Triton kernel found"
    built = {(build.family, build.kernel.fn.__name__) for make in GROUPS.values() for build in make()}
    assert defined - built == set()
    # and in the committed report (python benchmarks/compiled_kernels.py regenerates it)
    reported = {(row["family"], row["function"]) for row in json.loads(REPORT.read_text())}
    assert defined - reported == set(), "kernels missing from the committed compiled-kernel report"


@pytest.mark.parametrize("registers, shared, warps, arch, blocks, limiter", [
    (255, 0, 8, 90, 1, "registers"),  # 8 warps x 8,192 registers: the whole register file
    (255, 0, 4, 90, 2, "registers"),
    (128, 0, 4, 90, 4, "registers"),  # 4,096 a warp: 4 a sub-partition, 16 warps
    (168, 0, 4, 80, 3, "registers"),  # 5,376 a warp: 3 a sub-partition, 12 warps
    (24, 0, 4, 90, 16, "warps"),  # 64 warps an SM (84 by registers)
    (32, 0, 1, 80, 32, "blocks"),  # 32 blocks an SM
    (64, 100_000, 4, 90, 2, "shared"),  # 2 x (100,096 + 1,024 reserved) of 233,472
    (64, 100_000, 4, 80, 1, "shared"),  # of 167,936
    (64, 0, 4, 80, 8, "registers"),  # 2,048 a warp: 8 a sub-partition, 32 warps
])
def test_occupancy(registers, shared, warps, arch, blocks, limiter):
    """Blocks per SM as CUDA's occupancy calculator gives them for compute capability 8.0 and 9.0."""
    require_backend("triton")
    found = compile_report.occupancy(registers, shared, warps, arch)
    assert (found["blocks_per_sm"], found["occupancy_limiter"]) == (blocks, limiter)
    assert found["warps_per_sm"] == blocks * warps
    assert found["occupancy"] == blocks * warps / 64


TTGIR_DOTS = """
    %a = ttng.warp_group_dot %q, %k, %c {inputPrecision = 0 : i32, isAsync = true} : !ttg.memdesc<128x64xbf16, #shared, #smem> * !ttg.memdesc<64x32xbf16, #shared2, #smem> -> tensor<128x32xf32, #mma1> loc(#loc1)
    %w:3 = ttng.warp_group_dot_wait %a, %q, %k {pendings = 0 : i32} : tensor<128x32xf32, #mma1>, !ttg.memdesc<128x64xbf16, #shared, #smem>, !ttg.memdesc<64x32xbf16, #shared2, #smem> loc(#loc1)
    %b = tt.dot %p, %v, %c2, inputPrecision = tf32 : tensor<16x32xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>> * tensor<32x128xbf16, #ttg.dot_op<{opIdx = 1, parent = #mma, kWidth = 2}>> -> tensor<16x128xf32, #mma> loc(#loc2)
    %c = tt.dot %x, %y, %c3 : tensor<64x32xf32, #ttg.dot_op<{opIdx = 0, parent = #blocked}>> * tensor<32x16xf32, #ttg.dot_op<{opIdx = 1, parent = #blocked}>> -> tensor<64x16xf32, #blocked> loc(#loc3)
    %d = tt.dot %x, %y, %c3, inputPrecision = tf32 : tensor<64x32xf16, #ttg.dot_op<{opIdx = 0, parent = #blocked}>> * tensor<32x16xf16, #ttg.dot_op<{opIdx = 1, parent = #blocked}>> -> tensor<64x16xf32, #blocked> loc(#loc4)
"""


def test_dots_read_from_ttgir():
    """Each dot's tile, operands, instruction and the best its operands allow; the short one found."""
    require_backend("triton")
    found = compile_report.dots(TTGIR_DOTS, num_warps=4, arch=90)
    assert [(d["m"], d["n"], d["k"], d["operands"], d["precision"], d["instruction"], d["best"]) for d in found] == [
        (128, 32, 64, "bf16", "tf32", "wgmma", "wgmma"),
        (16, 128, 32, "bf16", "tf32", "mma", "mma"),  # 16 rows: no wgmma
        (64, 16, 32, "f32", "ieee", "fma", "fma"),  # asked for float32 ieee: no tensor cores exist for it
        (64, 16, 32, "f16", "tf32", "fma", "wgmma"),  # short
    ]
    assert [d["best"] for d in compile_report.dots(TTGIR_DOTS, num_warps=4, arch=80)] == ["mma", "mma", "fma", "mma"]
    row = {"targets_arch": True, "arch": "sm_90", "spill_bytes": 8, "spill_stores": 4, "spill_loads": 4,
           "stack_bytes": 8, "registers": 255, "shared_bytes": 300_000, "shared_limit": 232_448, "dot_detail": found,
           "narrow_tf32_wgmma": 2}
    problems = compile_report.problems(row)
    assert len(problems) == 4 and "spills" in problems[0] and "8 wide" in problems[1] and "300,000" in problems[2]
    assert "became fma" in problems[3]

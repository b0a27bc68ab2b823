"""Every kernel builds for its real device here, with no device: Triton for Hopper (sm_90) and
Ampere (sm_80), each kernel at its default config and held to the target's shared memory per block
(a kernel over it compiles but fails to launch), Pallas lowered for TPU (which enforces the TPU
block-shape rules that interpret mode does not), SYCL kernels as SPIR-V, the form an Intel GPU
loads."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import multiprocessing
import os

import pytest
import torch

from harness import require_backend

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


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
    assert len(binaries) == 6  # three dtypes, delta rule and gated linear attention
    for spv in binaries:
        assert int.from_bytes(spv[:4], "little") == 0x07230203  # the SPIR-V magic number


def test_sycl_quantized_attention_builds_spirv():
    require_backend("sycl")
    from oneapi_impl import quantized_attention

    binaries = quantized_attention.spirv_binaries()
    assert len(binaries) == 3  # three input dtypes
    for spv in binaries:
        assert int.from_bytes(spv[:4], "little") == 0x07230203  # the SPIR-V magic number


# --- Triton: every kernel at its default config, compiled for sm_90 and sm_80 ---------------------

# The most shared memory one block may use, in bytes (cudaDevAttrMaxSharedMemoryPerBlockOptin, the
# opt-in limit Triton launches with): sm_90 (H100, H200) 227 KiB, sm_80 (A100) 163 KiB. A kernel
# asking for more compiles, then fails to launch.
SHARED_MEMORY_LIMITS = {90: 232_448, 80: 166_912}

# CI builds every kernel at every size it serves, for a share of the dtypes, within about a minute
# and a half: linear attention float32 and bfloat16 at K = V = 256 (the most blocks, the widest
# recurrent state), float16 at 128, bfloat16 at 64 (the chunk kernels' tiles do not change with K,
# V, and float16 and bfloat16 share them: measured, their shared memory is the same at every size
# and for both), paged attention every case at head size 256 and a few at 64 and 128, quantized
# attention every kernel at head sizes 64, 96 and 128 (float32 at 128 only).
# TORCH_KERNELS_COMPILE_ALL=1 builds every size for every dtype (about 400 builds, minutes).
COMPILE_ALL = os.environ.get("TORCH_KERNELS_COMPILE_ALL") == "1"
LINEAR_ATTENTION_SIZES = (64, 128, 256)
HEAD_SIZES = (64, 128, 256)
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


@dataclasses.dataclass(frozen=True)
class Build:
    """One kernel to compile as a launch would: its arguments' types, constexprs and config."""

    label: str
    kernel: object
    signature: dict
    constexprs: dict
    num_warps: int
    num_stages: int | None  # None: Triton's default, as launches that pass none
    tensor_cores: bool  # whether its PTX must hold mma instructions

    def key(self):
        return (self.kernel, tuple(sorted(self.signature.items())), tuple(sorted(self.constexprs.items())),
                self.num_warps, self.num_stages)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def linear_attention_builds(size: int, dtypes) -> list[Build]:
    from triton_impl import linear_attention

    return [Build(f"{name} {_name(dtype)} {'delta' if delta else 'gla'} K=V={size}", kernel, signature,
                  constexprs, config.num_warps, config.num_stages, dots)
            for dtype in dtypes for delta in (True, False)
            for name, kernel, signature, constexprs, config, dots in linear_attention.compile_targets(
                dtype, delta, size, size)]


def paged_attention_builds(head_size: int, cases) -> list[Build]:
    from triton_impl import paged_attention as pa

    types = pa._TRITON_TYPES
    builds = []
    for query_dtype, cache_dtype, decode, fused in cases:
        signature, constexprs, num_warps = pa.compile_targets(query_dtype, cache_dtype, head_size=head_size,
                                                              decode=decode, fused=fused)
        # the config compile_targets chose: its stages are not in what it returns
        config = pa.default_config(64 if decode else 4096, 64, constexprs["G"], head_size, 8192, constexprs["HKV"],
                                   sm_count=132)
        label = (f"{_name(query_dtype)} q, {_name(cache_dtype)} cache, {'decode' if decode else 'prefill'}"
                 f"{', fused' if fused else ''}, D={head_size}")
        builds.append(Build(f"paged_attention {label}", pa.paged_attention_kernel, signature, constexprs, num_warps,
                            config.num_stages, True))
        dims = dict(D=head_size, DP=constexprs["DP"])
        write_signature, write_constexprs = pa.write_compile_targets(query_dtype, cache_dtype, head_size,
                                                                     constexprs["HKV"], constexprs["BLOCK_SIZE"])
        builds.append(Build(f"reshape_and_cache {label}", pa.reshape_and_cache_kernel, write_signature,
                            write_constexprs, 4, None, False))
        builds.append(Build(f"merge_splits {_name(query_dtype)} out, {MAX_SPLITS} splits, D={head_size}",
                            pa.merge_splits_kernel, {
                                "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
                                "out_ptr": "*" + types[query_dtype], "num_rows": "i32",
                                "NUM_SPLITS": "constexpr", "D": "constexpr", "DP": "constexpr"},
                            dict(NUM_SPLITS=MAX_SPLITS, **dims), 4, None, False))
    return builds


def ood_builds(dtypes) -> list[Build]:
    from triton_impl import ood

    builds = []
    for dtype in dtypes:
        for classes in (1, 150):
            signature, constexprs, num_warps = ood.compile_targets(dtype, classes)
            builds.append(Build(f"mahalanobis_min {_name(dtype)} C={classes}", ood.mahalanobis_min_kernel, signature,
                                constexprs, num_warps, None, True))
        for scoped in (False, True):
            signature, constexprs, config = ood.edm_compile_targets(dtype, scoped)
            builds.append(Build(f"edm_score {_name(dtype)} {'scoped' if scoped else 'denoise'} H=512",
                                ood.edm_score_kernel, signature, constexprs, config.num_warps, config.num_stages, True))
    return builds


def quantized_attention_builds(head_size: int, dtypes) -> list[Build]:
    from triton_impl import quantized_attention

    return [Build(f"quantized_attention {label} {_name(dtype)} D={head_size}", kernel, signature, constexprs,
                  num_warps, num_stages, dots)
            for dtype in dtypes
            for label, kernel, signature, constexprs, num_warps, num_stages, dots in
            quantized_attention.compile_targets(dtype, head_size)]


def _families():
    """(id, function returning the builds): the share CI builds, or everything under COMPILE_ALL."""
    shares = {64: (torch.bfloat16,), 128: (torch.float16,), 256: (torch.float32, torch.bfloat16)}
    cases = {f"linear_attention-K{size}": functools.partial(linear_attention_builds, size,
                                                            DTYPES if COMPILE_ALL else shares[size])
             for size in LINEAR_ATTENTION_SIZES}
    cases["paged_attention-D256"] = lambda: paged_attention_builds(256, PAGED_CASES)
    few = [PAGED_CASES[0], PAGED_CASES[1], PAGED_CASES[5]]  # 16-bit decode, prefill; float32 (most shared)
    cases.update({f"paged_attention-D{size}": functools.partial(
        paged_attention_builds, size, PAGED_CASES if COMPILE_ALL else few) for size in HEAD_SIZES if size != 256})
    cases["ood"] = lambda: ood_builds(DTYPES)
    # quantized attention: every kernel at each head size, 16-bit inputs at 64 and 96, float32 too at
    # 128 (its tf32x3 tiles are the largest)
    quantized_shares = {64: (torch.float16,), 96: (torch.bfloat16,), 128: (torch.bfloat16, torch.float32)}
    cases.update({f"quantized_attention-D{size}": functools.partial(
        quantized_attention_builds, size, DTYPES if COMPILE_ALL else quantized_shares[size])
        for size in QUANTIZED_ATTENTION_HEAD_SIZES})
    return cases


FAMILIES = _families()


def _build(kernel_module: str, kernel_name: str, signature: dict, constexprs: dict, num_warps: int,
           num_stages: int | None, arch: int):
    """Compile one kernel (in a worker process): (PTX targets arch, PTX has mma, cubin bytes, usage)."""
    import importlib

    from triton_impl import compile_for, resource_usage

    kernel = getattr(importlib.import_module(kernel_module), kernel_name)
    compiled = compile_for(kernel, signature, constexprs, arch, num_warps, num_stages)
    ptx = compiled.asm["ptx"]
    return f".target sm_{arch}" in ptx, "mma" in ptx, len(compiled.asm["cubin"]), resource_usage(compiled)


@pytest.fixture(scope="module")
def build_pool():
    """Worker processes for the builds: each is a few seconds of single-threaded compiling."""
    require_backend("triton")
    workers = min(os.cpu_count() or 1, 8)
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


@pytest.mark.parametrize("arch", sorted(SHARED_MEMORY_LIMITS, reverse=True))
@pytest.mark.parametrize("family", FAMILIES)
def test_triton_kernels_build_and_fit_the_gpu(family, arch, build_pool, record_property):
    """Each build's PTX targets ``arch`` (with mma instructions where the kernel multiplies
    tiles), its cubin exists, and the shared memory a block asks for (Triton's metadata) fits the
    target. Registers and the stack bytes spilled registers take (read from the cubin) are
    printed and recorded, not judged."""
    limit = SHARED_MEMORY_LIMITS[arch]
    builds = {}
    for build in FAMILIES[family]():
        if arch < 89 and any("fp8e4nv" in kind for kind in build.signature.values()):
            continue  # Triton has no float8_e4m3fn before sm_89; the op passes such calls on
        builds.setdefault(build.key(), build)
    jobs = [build_pool.submit(_build, b.kernel.fn.__module__, b.kernel.fn.__name__, b.signature, b.constexprs,
                              b.num_warps, b.num_stages, arch) for b in builds.values()]
    rows, too_big = [], []
    for build, job in zip(builds.values(), jobs):
        targets_arch, has_mma, cubin_bytes, usage = job.result()
        assert targets_arch, build.label
        assert has_mma or not build.tensor_cores, f"{build.label}: no tensor-core instructions"
        assert cubin_bytes > 1000, build.label
        rows.append((build.label, usage["shared"], usage["registers"], usage["stack"]))
        if usage["shared"] > limit:
            too_big.append(f"{build.label}: {usage['shared']:,} bytes")
    table = "\n".join([f"sm_{arch}, shared memory limit {limit:,} bytes",
                       f"{'kernel':70s} {'shared':>8s} {'regs':>5s} {'spill stack':>11s}"]
                      + [f"{label:70s} {shared:8d} {regs:5d} {stack:11d}" for label, shared, regs, stack in rows])
    print(table)
    record_property("resources", table)
    assert not too_big, f"more shared memory than sm_{arch} gives a block ({limit:,} bytes):\n" + "\n".join(too_big)

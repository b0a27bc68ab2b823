"""Every kernel builds for its real device here, with no device: Triton for Hopper (sm_90) and
Ampere (sm_80), Pallas lowered for TPU (which enforces the TPU block-shape rules that interpret
mode does not), SYCL kernels as SPIR-V, the form an Intel GPU loads."""

from __future__ import annotations

import functools

import pytest
import torch

from harness import require_backend

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("classes", [1, 150])
def test_triton_ood_compiles_for_gpu(arch, dtype, classes):
    require_backend("triton")
    from triton_impl import compile_for
    from triton_impl import ood

    signature, constexprs, num_warps = ood.compile_targets(dtype, classes)
    kernel = compile_for(ood.mahalanobis_min_kernel, signature, constexprs, arch, num_warps)
    ptx = kernel.asm["ptx"]
    assert f".target sm_{arch}" in ptx
    assert "mma" in ptx  # the whitening GEMM runs on tensor cores
    assert len(kernel.asm["cubin"]) > 1000


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


PAGED_CASES = [  # (query dtype, cache dtype, decode batch, fused write)
    (torch.bfloat16, torch.bfloat16, True, False),
    (torch.bfloat16, torch.bfloat16, False, True),
    (torch.float16, torch.float8_e4m3fn, True, True),
    (torch.bfloat16, torch.float8_e5m2, False, False),
    (torch.float16, torch.int8, True, False),
    (torch.float32, torch.float32, True, False),
]


# Triton has no float8_e4m3fn before sm_89; there the op passes such calls to the next backend.
@pytest.mark.parametrize("arch, query_dtype, cache_dtype, decode, fused", [
    (arch, *case) for arch in (90, 80) for case in PAGED_CASES if arch >= 89 or case[1] != torch.float8_e4m3fn])
def test_triton_paged_attention_compiles_for_gpu(arch, query_dtype, cache_dtype, decode, fused):
    require_backend("triton")
    from triton_impl import compile_for
    from triton_impl import paged_attention

    signature, constexprs, num_warps = paged_attention.compile_targets(query_dtype, cache_dtype, decode=decode, fused=fused)
    kernel = compile_for(paged_attention.paged_attention_kernel, signature, constexprs, arch, num_warps)
    ptx = kernel.asm["ptx"]
    assert f".target sm_{arch}" in ptx
    assert "mma" in ptx  # QK^T and PV run on tensor cores
    assert len(kernel.asm["cubin"]) > 1000


def test_sycl_linear_attention_builds_spirv():
    require_backend("sycl")
    from oneapi_impl import linear_attention

    binaries = linear_attention.spirv_binaries()
    assert len(binaries) == 6  # three dtypes, delta rule and gated linear attention
    for spv in binaries:
        assert int.from_bytes(spv[:4], "little") == 0x07230203  # the SPIR-V magic number


# float32 (tf32x3 dots) and bfloat16 for the delta rule, float16 for gated linear attention
@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("dtype, delta", [(torch.float32, True), (torch.bfloat16, True), (torch.float16, False)])
def test_triton_linear_attention_compiles_for_gpu(arch, dtype, delta):
    require_backend("triton")
    from triton_impl import compile_for
    from triton_impl import linear_attention

    for name, kernel, signature, constexprs, num_warps, has_dots in linear_attention.compile_targets(dtype, delta):
        compiled = compile_for(kernel, signature, constexprs, arch, num_warps)
        ptx = compiled.asm["ptx"]
        assert f".target sm_{arch}" in ptx, name
        if has_dots:
            assert "mma" in ptx, name  # the chunk matmuls run on tensor cores
        assert len(compiled.asm["cubin"]) > 1000, name

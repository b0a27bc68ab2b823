"""The pallas backend of edm_score beyond what tests/test_edm.py runs on every backend: the kernel
lowered for TPU, its ``jax.custom_vjp`` in pure JAX, and torchax tensors (forward and gradients)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from harness import require_backend, run_isolated
from test_edm import edm_inputs

pytestmark = pytest.mark.usefixtures("pallas")


@pytest.fixture(scope="module")
def pallas():
    require_backend("pallas")


def _shapes(b, d, h, k, levels, dtype):
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    struct = jax.ShapeDtypeStruct
    return (struct((b, d), jnp.dtype(dtype)), struct((d,), f32), struct((d,), f32), struct((levels, 4), f32),
            struct((levels, d), f32), struct((levels,), f32), struct((levels, h), f32), struct((d, h), f32),
            struct((k, h, h), f32), struct((k, h), f32), struct((k, h, h), f32), struct((k, h), f32),
            struct((h, d), f32), struct((d,), f32))


@pytest.mark.parametrize("scoped", [False, True], ids=["denoise", "scoped"])
@pytest.mark.parametrize("dtype, shape", [("float32", (1, 1, 1, 0, 1)), ("bfloat16", (1000, 385, 512, 2, 8)),
                                          ("float32", (64, 1024, 256, 2, 8))], ids=str)
def test_lowers_for_tpu(dtype, shape, scoped):
    """The Mosaic TPU lowering accepts the kernel's blocks (interpret mode would not check them)."""
    import jax

    from jax_impl import ood

    kernel = functools.partial(ood.edm_score_levels, scoped=scoped, interpret=False)
    exported = jax.export.export(jax.jit(kernel), platforms=["tpu"])(*_shapes(*shape, dtype))
    assert "tpu_custom_call" in exported.mlir_module()


def _jax_inputs(seed, shape):
    import jax.numpy as jnp

    from jax_impl import ood

    x, params, sigmas, sd = edm_inputs(seed, torch.float32, shape)
    arrays = [jnp.asarray(t.numpy()) for t in (x, *params)]
    return arrays[:3] + [ood.edm_level_coefficients(sigmas, sd)] + arrays[3:]


@pytest.mark.parametrize("scoped", [False, True], ids=["denoise", "scoped"])
def test_custom_vjp_matches_the_jnp_reference(scoped):
    """Values and every gradient of the kernel's custom_vjp against autodiff through the reference."""
    import jax
    import jax.numpy as jnp

    from jax_impl import ood

    arrays = _jax_inputs(1, (6, 5, 9, 1, 2))
    weights = jnp.linspace(0.5, 1.5, 6)

    def loss(fn, *a):
        return jnp.sum(weights * fn(*a))

    kernel = functools.partial(ood.edm_score, scoped=scoped, interpret=True)
    reference = functools.partial(ood.edm_score_reference, scoped=scoped)
    np.testing.assert_allclose(kernel(*arrays), reference(*arrays), rtol=2e-5, atol=1e-5)
    argnums = tuple(range(len(arrays)))
    got = jax.grad(functools.partial(loss, kernel), argnums)(*arrays)
    want = jax.grad(functools.partial(loss, reference), argnums)(*arrays)
    for i, (g, w) in enumerate(zip(got, want)):
        scale = float(jnp.max(jnp.abs(w))) or 1.0
        assert float(jnp.max(jnp.abs(g - w))) <= 1e-4 * scale, f"gradient of argument {i}"


def test_level_coefficients_match_the_torch_ones():
    from jax_impl import ood

    from torch_kernels.reference import ood as reference

    sigmas = [0.01, 0.3, 2.0, 50.0]
    want = reference.edm_level_coefficients(torch.tensor(sigmas, dtype=torch.float64), 0.9, torch.float64)
    np.testing.assert_allclose(np.asarray(ood.edm_level_coefficients(sigmas, 0.9)), want.numpy(), rtol=1e-6)


def test_torchax_tensors_run_pallas_with_gradients():
    run_isolated(TORCHAX_CHECK)


# torchax registers a 'jax' device for the whole process (see tests/test_ood.py): a process of its own.
TORCHAX_CHECK = """
import pytest, torch, torch_kernels
from harness import assert_close
from test_edm import edm_inputs

x, params, sigmas, sd = edm_inputs(2, torch.float32, (13, 7, 12, 1, 2))

def run(tensors, statistic, implementation=None):
    args = [t.clone().requires_grad_() for t in tensors]
    out = torch_kernels.edm_score(*args, sigmas, sd, statistic, implementation=implementation)
    (out * torch.linspace(0.5, 1.5, 13, device=out.device)).sum().backward()
    return out.detach(), [a.grad for a in args]

env = torch_kernels.torchax_environment()
for statistic in ("denoise", "scoped"):
    want, want_grads = run((x, *params), statistic, "reference")
    for implementation in ("pallas", "reference") if statistic == "scoped" else ("pallas",):
        with env:
            out, grads = run([t.to("jax") for t in (x, *params)], statistic, implementation)
            assert type(out).__module__.startswith("torchax"), type(out)
            out, grads = out.to("cpu"), [g.to("cpu") for g in grads]
        assert_close(out, want, torch.float32, scale=5)
        for g, w in zip(grads, want_grads):
            assert_close(g, w, torch.float32, scale=10)
with env:
    jx = x.to("jax")
    jparams = [p.to("jax") for p in params]
    with pytest.raises(NotImplementedError, match="torchax tensors run"):
        torch_kernels.edm_score(jx, *jparams, sigmas, sd, implementation="triton")
    with pytest.raises(ValueError, match="w_in: expected size 7 in dimension 0"):
        torch_kernels.edm_score(jx, *jparams[:5], jparams[5][:3], *jparams[6:], sigmas, sd)
    with pytest.raises(ValueError, match="statistic: expected one of"):
        torch_kernels.edm_score(jx, *jparams, sigmas, sd, "likelihood")
print("torchax ok")
"""

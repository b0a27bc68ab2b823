"""The ood family on the pallas backend: ``mahalanobis_score`` (and ``mahalanobis_score_fitted``) and ``edm_score``.

CPU torch tensors: ``pallas_mahalanobis_min`` and ``pallas_edm_score_levels``, the kernels
``torch_kernels.ops.ood`` registers. Torchax tensors: :func:`torchax_implementations`.
"""

from __future__ import annotations

import torch

from ..ops import ood as op
from .torch_tensors import check_cpu, check_no_float64, to_jax, to_torch
from .torchax_tensors import first_backend, schema_arguments, torchax_implementation


def pallas_mahalanobis_min(x, center, whitener, class_proj, class_sq):
    check_cpu(x)
    from jax_impl import ood

    check_no_float64(x)
    score, nearest = ood.mahalanobis_min(*map(to_jax, (x, center, whitener, class_proj, class_sq)))
    return to_torch(score), to_torch(nearest).to(torch.int64)


def pallas_edm_score_levels(x, *tensors_and_scoped):
    *tensors, scoped = tensors_and_scoped
    check_cpu(x)
    from jax_impl import ood

    check_no_float64(x)
    return to_torch(ood.edm_score_levels(*map(to_jax, (x, *tensors)), scoped=scoped))


def _edm_score_implementation():
    """edm_score on torchax tensors, with gradients: the Pallas kernel's ``jax.custom_vjp`` or the
    jnp reference, the level coefficients made in JAX from the grid."""
    from jax_impl import ood as kernels
    from torchax.interop import j2t_autograd, torch_view

    forms = {"pallas": lambda *arrays, scoped: kernels.edm_score(*arrays, scoped),
             "reference": kernels.edm_score_reference}

    def edm_score(*args, **kwargs):
        x, *params, sigmas, sigma_data, statistic, choice = schema_arguments(op.edm_score_op, args, kwargs)
        op.check_edm_inputs(x, params, sigmas, sigma_data, statistic)
        form = first_backend(choice, forms)
        coefficients = kernels.edm_level_coefficients(tuple(sigmas), float(sigma_data))

        def score(x, mean, inv_scale, *rest):
            return form(x, mean, inv_scale, coefficients, *rest, scoped=statistic == "scoped")

        return j2t_autograd(torch_view(score))(x, *params)

    return edm_score


def torchax_implementations() -> dict:
    """The family's ops on torchax tensors, by op name."""
    from jax_impl import ood as kernels

    mahalanobis = torchax_implementation(op.check_inputs, pallas=kernels.mahalanobis_score,
                                         reference=kernels.mahalanobis_score_reference)
    fitted = torchax_implementation(op.check_fitted_inputs, pallas=kernels.mahalanobis_score_fitted,
                                    reference=kernels.mahalanobis_score_fitted_reference)
    return {op.OP: mahalanobis, op.FITTED_OP: fitted, op.EDM_OP: _edm_score_implementation()}

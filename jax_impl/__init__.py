"""JAX and Pallas kernels. Imports jax only (never torch), so it is usable from pure JAX."""

import jax


def interpret_params(interpret):
    """``interpret=None`` means: compile for TPU on a TPU, else run in Pallas TPU interpret mode."""
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    if interpret is True:
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.InterpretParams()
    return interpret


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple

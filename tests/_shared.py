"""Helpers shared by the test modules."""

import jax.numpy as jnp
import numpy as np
import pytest

# The heavier tests (Hessians, nested transformations) run in one single and
# one double precision dtype, one real and one complex, to keep the suite fast.
two_dtypes = pytest.mark.parametrize(
    "dtype", [np.dtype(np.float32), np.dtype(np.complex128)], ids=lambda d: d.name
)


def squared_norm(y):
    """A real-valued loss, so that ``jax.grad`` accepts complex ops too."""
    return jnp.sum(jnp.abs(y) ** 2)

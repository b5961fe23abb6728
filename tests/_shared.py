"""Helpers shared by the test modules."""

import threading

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


def errors_in_threads(check, n_threads):
    """Run ``check(seed)`` in ``n_threads`` threads at once; the exceptions they raised."""
    errors = []

    def worker(seed):
        try:
            check(seed)
        except Exception as err:  # collected for the caller's assertion
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(100 * t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors

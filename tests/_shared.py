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


def sample(dtype, shape, seed=0, full_range=False):
    """Random data of any dtype: genuinely complex for complex dtypes; integers
    in [-100, 100] (clipped to the dtype), or over the dtype's whole range."""
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) > 0.5
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        low, high = (info.min, info.max) if full_range else (max(info.min, -100), min(info.max, 100))
        return rng.integers(low, high, shape, dtype=dtype, endpoint=True)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)

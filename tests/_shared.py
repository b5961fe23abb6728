"""Helpers shared by the test modules."""

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The heavier tests (Hessians, nested transformations) run in one single and
# one double precision dtype, one real and one complex, to keep the suite fast.
two_dtypes = pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.complex128)], ids=lambda d: d.name)

# The calls that the callbacks of a test module record, for the test to count or inspect; the ``calls``
# fixture (conftest.py) empties it before and after each test of a module that uses it.
CALLS = []


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


def shard_map(f, *, mesh, in_specs, out_specs, axis_names=None, check_vma=True):
    """``jax.shard_map`` (jax >= 0.7), or before it ``jax.experimental.shard_map.shard_map``, whose
    arguments name the same things differently (``auto``, the axes left automatic; ``check_rep``)."""
    if hasattr(jax, "shard_map"):
        names = {} if axis_names is None else {"axis_names": axis_names}
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma, **names)
    from jax.experimental.shard_map import shard_map as experimental_shard_map

    auto = frozenset() if axis_names is None else frozenset(mesh.axis_names) - frozenset(axis_names)
    return experimental_shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check_vma, auto=auto)


@contextlib.contextmanager
def checking_unwritten():
    """jaxbind's checking mode (``config.check_unwritten``) on inside the block, as it was after."""
    import jaxbind

    before = jaxbind.config.check_unwritten
    jaxbind.config.check_unwritten = True
    try:
        yield
    finally:
        jaxbind.config.check_unwritten = before


class Planted:
    """A value whose unpickling runs code (it calls :func:`plant`): what a forged program's kwargs
    must never get to do. ``Planted.called`` says whether it did."""

    called = False

    def __reduce__(self):
        return (plant, ())


def plant():
    Planted.called = True
    return 0

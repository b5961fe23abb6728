"""Batch walks: a vmapped native kernel spreads its batch over XLA's intra-op threads; empty
batches call nothing.

The walk times its first element and splits the rest into chunks only when it is long, so
these tests use a kernel of ~0.2 ms per element (``jb_busy_thread``), which also reports the
thread each element ran on. Results are checked against the input (the kernel copies it).
"""

import ctypes

import _kernels
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind

LIB = _kernels.load()


def copy_and_thread(x, **kwargs):
    return ((x.shape, x.dtype), ((), np.int64))


busy_thread = jaxbind.get_nonlinear_call(
    LIB.jb_busy_thread, (LIB.jb_busy_thread, LIB.jb_busy_thread), copy_and_thread, copy_and_thread
)


def walk(x, **kwargs):
    return jax.jit(jax.vmap(lambda r: busy_thread(r, **kwargs)))(x)


def test_long_walk_is_correct_and_uses_more_than_one_thread():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 5)))
    y, threads = walk(x, iterations=20000)
    np.testing.assert_array_equal(y, x)  # every element written once, at its own place
    assert len(set(np.asarray(threads).tolist())) > 1, "the walk ran on one thread only"


def test_a_parallel_walk_calls_the_kernel_once_per_element():
    # Counted in the kernel: a chunk that ran past the batch end and wrapped onto element 0
    # would call it twice there (with correct values, so only the count shows it).
    LIB.jb_busy_thread_calls.restype = ctypes.c_int64
    LIB.jb_busy_thread_calls.argtypes = [ctypes.c_int]
    x = jnp.asarray(np.random.default_rng(3).standard_normal((64, 5)))
    f = jax.jit(jax.vmap(lambda r: busy_thread(r, iterations=20000)))
    jax.block_until_ready(f(x))  # compiled, and the counter
    LIB.jb_busy_thread_calls(1)  # reset
    for _ in range(3):
        y, threads = jax.block_until_ready(f(x))
        np.testing.assert_array_equal(y, x)
        assert LIB.jb_busy_thread_calls(1) == 64
    assert len(set(np.asarray(threads).tolist())) > 1, "the walk ran on one thread only"
    # Nested: 4 x 16 elements in one walk.
    g = jax.jit(jax.vmap(jax.vmap(lambda r: busy_thread(r, iterations=20000)[0])))
    np.testing.assert_array_equal(jax.block_until_ready(g(x.reshape(4, 16, 5))), x.reshape(4, 16, 5))
    assert LIB.jb_busy_thread_calls(1) == 64


@pytest.mark.parametrize("shape", [(3, 2, 4), (2, 1, 3, 5), (17, 1)])
def test_nested_and_odd_batches(shape):
    x = jnp.asarray(np.random.default_rng(1).standard_normal(shape))
    f = jax.jit(jax.vmap(jax.vmap(lambda r: busy_thread(r, iterations=20000)[0])))
    if len(shape) == 2:
        f = jax.jit(jax.vmap(lambda r: busy_thread(r, iterations=20000)[0]))
    np.testing.assert_array_equal(f(x), x)


@pytest.mark.parametrize("n", [1, 2, 3, 64, 1000])
def test_short_elements(n):
    # Short walks stay on the calling thread (not asserted: a preempted element may look long).
    x = jnp.arange(float(n)).reshape(n, 1)
    y, _ = walk(x, iterations=1)
    np.testing.assert_array_equal(y, x)


def test_a_failing_element_in_a_parallel_walk_is_an_error_naming_the_op():
    x = np.abs(np.random.default_rng(2).standard_normal((64, 3))) + 1.0
    x[50, 0] = -5.0  # far from the first element, in a chunk another thread may run
    with pytest.raises(Exception, match=r"jb_busy_thread.*element -5 is below 0"):
        jax.block_until_ready(walk(jnp.asarray(x), iterations=20000, fail_below=0.0))
    # The op stays usable afterwards.
    y, _ = walk(jnp.asarray(np.abs(x)), iterations=20000, fail_below=0.0)
    np.testing.assert_array_equal(y, np.abs(x))


def _python_copy(out, args, kwargs_dump):
    np.copyto(out[0], args[0])


def _like(x, **kwargs):
    return ((x.shape, x.dtype),)


python_copy = jaxbind.get_linear_call(_python_copy, _python_copy, _like, _like)


@pytest.mark.parametrize("shape", [(0, 3), (2, 0, 3), (0, 0, 1)])
def test_empty_batches_call_nothing(shape):
    x = jnp.zeros(shape)
    nested = lambda f: jax.vmap(f) if len(shape) == 2 else jax.vmap(jax.vmap(f))
    y, threads = jax.jit(nested(lambda r: busy_thread(r, fail_below=1.0)))(x)  # would fail if called
    assert y.shape == shape and threads.shape == shape[:-1]
    assert jax.jit(nested(lambda r: python_copy(r)[0]))(x).shape == shape

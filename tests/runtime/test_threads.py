"""Many Python threads at once: calling, defining and dropping ops, keeping views, clearing caches.

On a free-threaded CPython (CI's free-threaded lane, .ci/freethreaded.sh) nothing serialises these
threads: the site registry, the eager cache and its fast path, the kept-view check and the sites'
lifetimes run truly at once; on a GIL build the same test switches threads wherever CPython does.
Every result is checked against NumPy.
"""

import gc
import sys
import sysconfig
import threading
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind
from jaxbind import _trampoline

FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def like(x, **kwargs):
    return ((x.shape, x.dtype),)


def scale(out, args, kwargs_dump):
    """out = factor * x; with keep=True it also keeps its input view (jaxbind refuses that and cuts it off)."""
    kwargs = jaxbind.load_kwargs(kwargs_dump)
    out[0][...] = kwargs.get("factor", 2.0) * args[0]
    if kwargs.get("keep"):
        KEPT.setdefault(threading.get_ident(), []).append(args[0])


KEPT: dict = {}  # thread -> the views its callbacks kept


@pytest.fixture
def jax_cache_keys_one_at_a_time(monkeypatch):
    """JAX's own race, not jaxbind's: on free-threaded 3.13t, jax 0.10.2's compilation-cache key
    deep-copies the compile options, and two threads compiling at once failed there with
    "SystemError: Objects/tupleobject.c:919: bad argument to internal function" (once in a full
    suite). The test serialises that one JAX function so that what it finds is ours."""
    try:
        from jax._src import cache_key
    except ImportError:
        return
    original = getattr(cache_key, "_hash_serialized_compile_options", None)
    if original is None:
        return
    lock = threading.Lock()

    def one_at_a_time(*args, **kwargs):
        with lock:
            return original(*args, **kwargs)

    monkeypatch.setattr(cache_key, "_hash_serialized_compile_options", one_at_a_time)


@pytest.mark.usefixtures("jax_cache_keys_one_at_a_time")
def test_many_threads_calling_defining_and_dropping_ops_agree_with_numpy():
    n_threads, rounds = 4, 4
    gc.collect()
    live_before = _trampoline.num_live_sites()
    barrier = threading.Barrier(n_threads)
    errors, done = [], []
    # an op every thread calls (its eager fast path: no kwargs)
    ops = {"shared": jaxbind.get_linear_call(scale, scale, like, like, name="stress_shared", thread_safe=True)}

    def work(t):
        r = -1
        try:
            barrier.wait(timeout=120)
            for r in range(rounds):
                factor = float(t * rounds + r + 1)
                x = np.arange(12.0).reshape(4, 3) + t
                # an op defined by every thread under three shared names (the registry's indices)
                op = jaxbind.get_linear_call(scale, scale, like, like, name=f"stress_{r % 3}", thread_safe=r % 2 == 1)
                np.testing.assert_array_equal(op(x, factor=factor)[0], factor * x)  # eager
                for _ in range(3):
                    np.testing.assert_array_equal(ops["shared"](jnp.asarray(x))[0], 2.0 * x)
                jitted = jax.jit(lambda v, op=op, factor=factor: op(v, factor=factor)[0])
                np.testing.assert_array_equal(jitted(x), factor * x)
                walked = jax.jit(jax.vmap(lambda v, op=op, factor=factor: op(v, factor=factor)[0]))
                np.testing.assert_array_equal(walked(x), factor * x)
                grad = jax.grad(lambda v, op=op, factor=factor: jnp.sum(op(v, factor=factor)[0]))(x)
                np.testing.assert_array_equal(grad, np.full_like(x, factor))
                # a view kept by the callback fails the call and is cut off
                with pytest.raises((RuntimeError, ValueError), match="kept a reference"):
                    op(x, factor=factor, keep=True)
                kept = KEPT[threading.get_ident()].pop()
                assert kept.size == 0 and not kept.flags.writeable, kept
                del op, jitted, walked
                if r % 3 == t % 3:
                    jax.clear_caches()
                if r % 2 == t % 2:
                    gc.collect()
                done.append((t, r))
        except BaseException:
            errors.append(f"thread {t}, round {r}:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not any(thread.is_alive() for thread in threads), "a thread did not finish"
    assert not errors, "\n".join(errors)
    assert len(done) == n_threads * rounds
    if FREE_THREADED:  # the test ran what it means to run: nothing turned the GIL back on
        assert not sys._is_gil_enabled()
    # Every op, program and site made here goes with its holders (the shared op's stay with it).
    ops.clear()
    jax.clear_caches()
    gc.collect()
    assert _trampoline.num_live_sites() <= live_before

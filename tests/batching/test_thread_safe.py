"""thread_safe=True: a vmapped Python callback walked over XLA's threads, with the
guarantees of the one-thread walk (results, errors, kept views, the checking mode)."""

import sys
import sysconfig
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import checking_unwritten

import jaxbind
from jaxbind.testing import check_op

like = lambda *args, **kwargs: ((args[-1].shape, args[-1].dtype),)
THREADS = []
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def slow_scale(out, args, kwargs_dump):
    """y = factor x, slowly (sleeping releases the GIL, as NumPy on large arrays does)."""
    THREADS.append(threading.get_ident())
    time.sleep(0.001)
    out[0][...] = jaxbind.load_kwargs(kwargs_dump).get("factor", 2.0) * args[-1]


def make(thread_safe, f=slow_scale, name="slow_scale"):
    return jaxbind.get_linear_call(f, f, like, like, thread_safe=thread_safe, name=name)


@pytest.mark.parametrize("dtype", [np.float32, np.complex128])
def test_a_thread_safe_walk_runs_on_several_threads_with_the_same_results(dtype):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(24, 5)) + (1j * rng.normal(size=(24, 5)) if dtype == np.complex128 else 0)).astype(dtype)
    results = {}
    for thread_safe in (False, True):
        op = make(thread_safe)
        f = jax.jit(jax.vmap(lambda v: op(v, factor=1.5)[0]))
        f(x)  # compiled
        THREADS.clear()
        results[thread_safe] = np.asarray(f(x))
        assert len(THREADS) == 24
        threads = len(set(THREADS))
        assert threads == 1 if not thread_safe else threads > 1, (thread_safe, threads)
        np.testing.assert_allclose(results[thread_safe], 1.5 * x, rtol=1e-6)
    # nested vmap and grad walk alike
    op = make(True)
    y = x.reshape(4, 6, 5)
    nested = jax.jit(jax.vmap(jax.vmap(lambda v: op(v)[0])))(y)
    np.testing.assert_allclose(nested, 2 * y, rtol=1e-6)
    grad = jax.jit(jax.vmap(jax.grad(lambda v: jnp.real(jnp.sum(op(v)[0] * jnp.conj(op(v)[0]))))))(x.real)
    np.testing.assert_allclose(grad, 8 * x.real, rtol=1e-5)


def test_short_elements_stay_on_one_thread():
    def quick(out, args, kwargs_dump):
        THREADS.append(threading.get_ident())
        out[0][...] = 3 * args[0]

    # A walk spreads when the rest of it, timed by its first elements, would take 100 us or more:
    # 8 elements of a few microseconds stay on one thread. The first elements' time is a clock's:
    # on a loaded machine a preempted one can make a walk spread where the GIL does not keep the
    # helpers out (a free-threaded build), so of five walks one staying on one thread is asked.
    op = make(True, quick, "quick")
    f = jax.jit(jax.vmap(lambda v: op(v)[0]))
    x = jnp.ones((8, 3))
    f(x)
    threads_per_walk = []
    for _ in range(5):
        THREADS.clear()
        np.testing.assert_allclose(f(x), 3 * np.ones((8, 3)))
        threads_per_walk.append(len(set(THREADS)))
    assert min(threads_per_walk) == 1, threads_per_walk


@pytest.mark.skipif(FREE_THREADED, reason="no GIL to hold on a free-threaded build (see the test after this one)")
def test_a_body_that_holds_the_gil_stays_on_one_thread_until_it_releases_it():
    """A walk no helper could join (the body held the GIL throughout) makes the
    next walks of its site stay on the calling thread; later ones try again."""
    mode = {"hold": True}

    def body(out, args, kwargs_dump):
        THREADS.append(threading.get_ident())
        if mode["hold"]:  # ~0.1 ms of pure Python: no other thread gets the GIL
            deadline = time.perf_counter() + 1e-4
            while time.perf_counter() < deadline:
                pass
        else:
            time.sleep(0.002)
        out[0][...] = 3 * args[0]

    op = make(True, body, "holds_then_releases")
    f = jax.jit(jax.vmap(lambda v: op(v)[0]))
    x = jnp.asarray(np.arange(36.0).reshape(12, 3))
    previous = sys.getswitchinterval()
    sys.setswitchinterval(10.0)  # no forced hand-over of the GIL inside a walk
    try:
        np.testing.assert_allclose(f(x), 3 * x)  # compiled, and walked on one thread: no help
        mode["hold"] = False
        per_walk = []
        for _ in range(24):
            THREADS.clear()
            np.testing.assert_allclose(f(x), 3 * x)
            per_walk.append(len(set(THREADS)))
    finally:
        sys.setswitchinterval(previous)
    assert per_walk[0] == 1, per_walk  # the site remembers that no helper joined
    assert max(per_walk) > 1, per_walk  # and gives its walks the threads back


@pytest.mark.skipif(not FREE_THREADED, reason="a GIL build runs one pure-Python element at a time (the test before)")
def test_a_pure_python_body_is_walked_on_several_threads_with_the_gil_off():
    """The body of the test before, which holds the GIL throughout on a GIL build: without a GIL
    its elements run on several threads at once, with the same results."""

    def body(out, args, kwargs_dump):
        THREADS.append(threading.get_ident())
        deadline = time.perf_counter() + 5e-4  # pure Python: no GIL release anywhere
        while time.perf_counter() < deadline:
            pass
        out[0][...] = 3 * args[0]

    op = make(True, body, "pure_python_without_gil")
    f = jax.jit(jax.vmap(lambda v: op(v)[0]))
    x = jnp.asarray(np.arange(96.0).reshape(32, 3))
    previous = sys.getswitchinterval()
    sys.setswitchinterval(10.0)  # (as in the test before; nothing to switch without a GIL)
    try:
        per_walk = []
        for _ in range(4):
            THREADS.clear()
            np.testing.assert_allclose(f(x), 3 * x)
            per_walk.append(len(set(THREADS)))
    finally:
        sys.setswitchinterval(previous)
    assert max(per_walk) > 1, per_walk
    assert not sys._is_gil_enabled()


def test_a_failing_element_is_an_error_naming_the_op():
    def fails_at_seven(out, args, kwargs_dump):
        time.sleep(0.001)
        if float(args[0][0]) == 7:
            raise ValueError("element seven is refused")
        out[0][...] = args[0]

    op = make(True, fails_at_seven, "fails_at_seven")
    x = jnp.arange(20.0)[:, None] * jnp.ones((1, 3))
    with pytest.raises(Exception, match=r"op 'fails_at_seven'.*element seven is refused"):
        jax.block_until_ready(jax.jit(jax.vmap(lambda v: op(v)[0]))(x))
    # the op goes on working
    np.testing.assert_allclose(jax.jit(jax.vmap(lambda v: op(v)[0]))(x + 100), x + 100)


KEPT = []


def test_a_kept_view_in_a_parallel_walk_is_refused_and_cut_off():
    def keeps_one(out, args, kwargs_dump):
        time.sleep(0.001)
        out[0][...] = args[0]
        if float(args[0][0]) == 11:
            KEPT.append(out[0])

    op = make(True, keeps_one, "keeps_one")
    x = jnp.arange(16.0)[:, None] * jnp.ones((1, 4))
    with pytest.raises(Exception, match=r"op 'keeps_one'.*kept a reference"):
        jax.block_until_ready(jax.jit(jax.vmap(lambda v: op(v)[0]))(x))
    assert KEPT and KEPT[0].size == 0 and not KEPT[0].flags.writeable
    KEPT.clear()


def test_the_checking_mode_finds_unwritten_outputs_in_a_parallel_walk():
    def skips_one(out, args, kwargs_dump):
        time.sleep(0.001)
        if float(args[0][0]) != 5:
            out[0][...] = args[0]

    op = make(True, skips_one, "skips_one")
    x = jnp.arange(12.0)[:, None] * jnp.ones((1, 2))
    with checking_unwritten():
        with pytest.raises(Exception, match=r"op 'skips_one'.*unwritten|op 'skips_one'.*not written"):
            jax.block_until_ready(jax.jit(jax.vmap(lambda v: op(v)[0]))(x))


def test_check_op_passes_a_thread_safe_op():
    report = check_op(make(True), np.linspace(-1.0, 1.0, 6))
    assert report.checks and not report.skipped, report  # (check_op raises on a failure)


def test_thread_safe_must_be_a_bool():
    with pytest.raises(TypeError, match=r"op 'slow_scale'.*thread_safe must be a bool"):
        make("yes")
    with pytest.raises(TypeError, match=r"op 'f'.*thread_safe must be a bool"):
        jaxbind.get_nonlinear_call(lambda o, a, k: None, None, like, None, name="f", thread_safe=1)


# ---------------------------------------------------------------------------
# check_op runs a thread-safe op's walk on several threads at once
# ---------------------------------------------------------------------------


def _shares_a_scratch_array():
    scratch = np.zeros(4096)

    def shared(out, args, kwargs_dump):  # not thread-safe: every call writes the same scratch
        np.sin(args[0], out=scratch)  # (NumPy releases the GIL over large arrays: calls interleave)
        out[0][...] = 2.0 * scratch + 1.0

    return shared


def _own_scratch(out, args, kwargs_dump):  # thread-safe: each call has its own
    scratch = np.sin(args[0]) * 2.0
    out[0][...] = scratch + 1.0


def _same(*args, **kwargs):
    return ((args[0].shape, args[0].dtype),)


def test_check_op_finds_a_thread_safe_op_whose_body_shares_a_scratch_array():
    x = np.linspace(0.0, 1.0, 4096)
    racy = jaxbind.get_nonlinear_call(_shares_a_scratch_array(), None, _same, None, thread_safe=True, name="racy")
    np.testing.assert_allclose(racy(x)[0], np.sin(x) * 2 + 1)  # one call at a time: right
    with pytest.raises(
        AssertionError,
        match=r"op 'racy': thread_safe: the walk on several threads.*"
        r"not thread-safe.*thread_safe=False",
    ):
        check_op(racy, x)
    # The same body without thread_safe, and a body with its own scratch, pass.
    assert check_op(jaxbind.get_nonlinear_call(_shares_a_scratch_array(), None, _same, None), x)
    report = check_op(jaxbind.get_nonlinear_call(_own_scratch, None, _same, None, thread_safe=True), x)
    assert report and "thread_safe: the walk on several threads against a loop" in str(report)
    assert sys.getswitchinterval() > 1e-4  # restored

"""Lifetimes at the edge of a call: interpreter exit during a callback, arrays kept after one, the view cache."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import _subprocesses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind

# Where the jaxbind under test was imported from (the source tree or site-packages):
# subprocesses import the same one.
JAXBIND_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(jaxbind.__file__)))


def same_shape(*args, **kwargs):
    return tuple((a.shape, a.dtype) for a in args)


# ---------------------------------------------------------------------------
# Exit while a callback runs
# ---------------------------------------------------------------------------

# A program with other work beside the op runs on an XLA worker thread; the
# script ends (or calls sys.exit) while the callback still runs there.
EXIT_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    import jax, jax.numpy as jnp, numpy as np
    import jaxbind, jaxbind._runtime
    jaxbind._runtime.EXIT_TIMEOUT_SECONDS = float(sys.argv[2])

    def slow_double(out, args, kwargs_dump):
        time.sleep(0.3)  # releases the GIL: the main thread goes on to exit
        np.multiply(args[0], 2, out=out[0])

    def same_shape(x):
        return ((x.shape, x.dtype),)

    op = jaxbind.get_linear_call(slow_double, slow_double, same_shape, same_shape)

    @jax.jit
    def program(x, y):
        return op(x)[0], jnp.sin(y) @ jnp.cos(y).T

    x, y = jnp.ones(10), jnp.ones((300, 300))
    assert float(program(x, y)[0][0]) == 2.0
    pending = program(x, y)  # not waited for
    time.sleep(0.05)
    print("exiting", flush=True)
    if sys.argv[1] == "sys.exit":
        sys.exit(0)
    if sys.argv[1] == "Ctrl-C":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # interrupted: KeyboardInterrupt ends the script
""")


@pytest.mark.parametrize("how", ["end of script", "sys.exit", "Ctrl-C"])
@pytest.mark.parametrize("timeout", [10.0, 0.0], ids=["exit waits", "exit does not wait"])
def test_exit_while_a_callback_runs_on_a_worker_thread_is_clean(tmp_path, how, timeout):
    # Before: "Fatal Python error: PyEval_SaveThread ... finalizing", exit 134 or 139,
    # in about half the runs. With the exit hook waiting, the callback finishes; when it
    # does not wait (a callback that outlives the timeout), CPython ends the thread and
    # jaxbind does not touch the GIL of the dying interpreter. On CPython >= 3.13.8 (the free-threaded
    # lane) the thread is parked instead, and "exit does not wait" hangs unless the exit hook keeps JAX's
    # clients alive (test_exit_keeps_clients.py tests that it does).
    script = tmp_path / "exit_during_callback.py"
    script.write_text(EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": JAXBIND_PARENT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    runs = [
        subprocess.Popen(
            [sys.executable, str(script), how, str(timeout)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = _subprocesses.communicate_all(runs, 120, "the exit script")  # all, before any assert
    for run, (out, err) in zip(runs, outputs):
        # an uncaught KeyboardInterrupt ends Python by SIGINT, as the shell expects
        assert run.returncode == (-signal.SIGINT if how == "Ctrl-C" else 0), err[-2000:]
        assert "exiting" in out
        assert "Fatal Python error" not in err


# A factorization made by a callback on an XLA worker thread and kept in a module-level cache (the
# workaround users reach for to reuse it in the vjp). SciPy's SuperLU records its allocations in a
# table in the thread's per-thread dict, whose destructor, run at finalization on another thread,
# left a TypeError that failed the flush of stdout: exit status 120.
KEPT_FACTORIZATION_SCRIPT = textwrap.dedent("""
    import threading
    import jax, jax.numpy as jnp, numpy as np, scipy.sparse as sp, scipy.sparse.linalg as spla
    import jaxbind
    jax.config.update("jax_enable_x64", True)
    n = 2000
    laplacian = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n), format="csc")
    CACHE, THREADS = {}, set()

    def solve(out, args, kwargs_dump):
        THREADS.add(threading.get_ident())
        CACHE["lu"] = spla.splu((laplacian * (1.0 + args[0][0])).tocsc())
        out[0][...] = CACHE["lu"].solve(np.ones(n))

    def solve_jvp(out, args, kwargs_dump):
        out[0][...] = -args[1][0] / (1.0 + args[0][0]) * CACHE["lu"].solve(np.ones(n))

    def solve_vjp(out, args, kwargs_dump):
        u = CACHE["lu"].solve(np.ones(n))
        out[0][...] = -np.dot(args[1], u) / (1.0 + args[0][0])

    def abstract(k, *tangent):
        return (((n,), k.dtype),)

    def abstract_reverse(k, cotangent):
        return ((k.shape, k.dtype),)

    op = jaxbind.get_nonlinear_call(solve, (solve_jvp, solve_vjp), abstract, abstract_reverse)

    @jax.jit
    def loss_and_busy_work(k, y):  # the work beside the op: XLA runs it on a worker thread
        return jnp.sum(op(k)[0]), jnp.sin(y) @ jnp.cos(y).T

    k, y = jnp.array([0.5]), jnp.ones((300, 300))
    (value, _), grad = jax.value_and_grad(loss_and_busy_work, has_aux=True)(k, y)
    u = spla.spsolve(laplacian * 1.5, np.ones(n))
    assert np.isclose(float(value), u.sum()) and np.isclose(float(grad[0]), -u.sum() / 1.5)
    print("worker thread:", threading.get_ident() not in THREADS, flush=True)
""")


def test_a_factorization_kept_from_a_worker_thread_exits_cleanly(tmp_path):
    pytest.importorskip("scipy")
    script = tmp_path / "kept_factorization.py"
    script.write_text(KEPT_FACTORIZATION_SCRIPT)
    env = {**os.environ, "PYTHONPATH": JAXBIND_PARENT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert "worker thread: True" in run.stdout, run.stdout + run.stderr[-2000:]
    assert run.returncode == 0 and "Exception ignored" not in run.stderr, run.stderr[-2000:]


# ---------------------------------------------------------------------------
# Arrays a callback keeps after returning
# ---------------------------------------------------------------------------

# (Arrays kept in every other way, and what happens to them: test_kept_views.py.)


def test_a_kept_zero_dimensional_view_cannot_write_into_results():
    kept = []

    def hoard(out, args, kwargs_dump):
        out[0][...] = args[0] + 1
        kept.append(weakref.ref(out[0]))

    op = jaxbind.get_nonlinear_call(hoard, (hoard, hoard), same_shape, same_shape)
    with pytest.raises(RuntimeError, match=r"op 'hoard'.*weak reference"):
        jax.block_until_ready(op(jnp.float64(1.0))[0])
    view = kept[0]()
    assert view is None or (not view.flags.writeable and view.ndim == 0)


def test_a_callback_that_raises_leaves_no_array_on_xla_memory():
    kept = []

    def fails(out, args, kwargs_dump):
        kept.append(out[0][::2])
        raise ValueError("on purpose")

    op = jaxbind.get_linear_call(fails, fails, same_shape, same_shape)
    with pytest.raises(RuntimeError, match=r"(?s)ValueError: on purpose.*kept a reference"):
        jax.block_until_ready(op(jnp.ones(6))[0])
    assert kept[0].size == 0 and not kept[0].flags.writeable


# ---------------------------------------------------------------------------
# The view cache after overlapping calls
# ---------------------------------------------------------------------------


def test_view_cache_survives_calls_that_overlap_on_two_threads():
    # The callback of the first thread releases the GIL while a second thread
    # runs the same call site (with views of its own) and finishes last. A
    # cached tuple of views is also held by the cache, so a callback sees one
    # more reference to it than to a new one. Before: the cache stayed off for
    # good after such an overlap.
    first_inside, second_inside, first_done = threading.Event(), threading.Event(), threading.Event()
    refcounts = []

    def double(out, args, kwargs_dump):
        who = threading.current_thread().name
        refcounts.append((who, sys.getrefcount(out)))
        if who == "first":
            first_inside.set()
            second_inside.wait(10)
        elif who == "second":
            second_inside.set()
            first_done.wait(10)
            time.sleep(0.1)  # the first call's handler has returned by now
        np.multiply(args[0], 2, out=out[0])

    op = jaxbind.get_linear_call(double, double, same_shape, same_shape)
    f = jax.jit(lambda x: op(x)[0])
    x = jnp.arange(3.0)
    f(x), f(x)  # compiled; the second call ran on cached views

    def first():
        f(x).block_until_ready()
        first_done.set()

    def second():
        first_inside.wait(10)
        f(x).block_until_ready()

    threads = [threading.Thread(target=first, name="first"), threading.Thread(target=second, name="second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    during = dict(refcounts[2:])
    assert during["first"] == during["second"] + 1  # cached views, and new ones
    del refcounts[:]
    for _ in range(3):
        np.testing.assert_array_equal(f(x), 2 * np.arange(3.0))
    assert [count for _, count in refcounts] == [during["first"]] * 3


def test_an_exit_hook_may_still_call_ops_on_the_exiting_thread(tmp_path):
    # Hooks registered before jaxbind was imported run after jaxbind's own.
    script = tmp_path / "op_in_exit_hook.py"
    script.write_text(
        textwrap.dedent("""
        import atexit
        def late_hook():
            import jax.numpy as jnp
            print("at exit:", [float(v) for v in op(jnp.arange(3.0))[0]], flush=True)
        atexit.register(late_hook)

        import numpy as np
        import jaxbind

        def double(out, args, kwargs_dump):
            np.multiply(args[0], 2, out=out[0])

        def same_shape(x):
            return ((x.shape, x.dtype),)

        op = jaxbind.get_linear_call(double, double, same_shape, same_shape)
    """)
    )
    env = {**os.environ, "PYTHONPATH": JAXBIND_PARENT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "at exit: [0.0, 2.0, 4.0]" in run.stdout

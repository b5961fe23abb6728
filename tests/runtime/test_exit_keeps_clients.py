"""The exit hook keeps JAX's clients alive when a callback outlives its wait (issue 40, item 13).

Since CPython 3.13.8 (gh-87135) a thread that takes the interpreter back after finalization began is
parked for ever. A callback still running when jaxbind's exit hook stops waiting parks its XLA worker
that way, and the client whose thread pool owns that worker joins it when destroyed: on the
free-threaded build (CPython 3.13.15t, the lane .ci/freethreaded.sh runs) finalization destroyed jaxlib's
CPU client and the process hung at exit, 9 runs of 9, in
tests/runtime/test_lifetime.py::test_exit_while_a_callback_runs_on_a_worker_thread_is_clean[exit does
not wait-...]. That hang is the lane's test; this one pins the mechanism on every build, 3.11 included:
after JAX's own exit hook has cleared its backends and caches, a client is still alive if and only if
a callback outlived the wait. The reference is the same script with a callback that ends in time, or
with a wait long enough for it: there the client is freed, so what keeps it is jaxbind's hook.
"""

import ast
import os
import sys
import textwrap

import _subprocesses
import jax
import pytest

import jaxbind

JAXBIND_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(jaxbind.__file__)))

# atexit hooks run last-registered first: `drop` (registered last) lets go of the script's arrays and
# programs, then jaxbind's hook runs, then JAX's (clear_backends, clear_caches), then `last_hook`
# (registered before JAX was imported) reports which clients a weak reference still finds.
SCRIPT = textwrap.dedent("""
    import atexit, gc, sys, time, weakref

    clients = []

    def last_hook():
        gc.collect()
        print("clients alive:", [client() is not None for client in clients], flush=True)

    atexit.register(last_hook)

    import jax, jax.extend.backend, jax.numpy as jnp, numpy as np
    import jaxbind, jaxbind._runtime

    jaxbind._runtime.EXIT_TIMEOUT_SECONDS = float(sys.argv[1])

    def slow_double(out, args, kwargs_dump):
        time.sleep(float(sys.argv[2]))  # releases the GIL: the main thread goes on to exit
        np.multiply(args[0], 2, out=out[0])

    def same_shape(x):
        return ((x.shape, x.dtype),)

    op = jaxbind.get_linear_call(slow_double, slow_double, same_shape, same_shape)

    @jax.jit
    def program(x, y):  # other work beside the op: the callback runs on an XLA worker thread
        return op(x)[0], jnp.sin(y) @ jnp.cos(y).T

    x, y = jnp.ones(10), jnp.ones((300, 300))
    assert float(program(x, y)[0][0]) == 2.0
    clients += [weakref.ref(client) for client in jax.extend.backend.backends().values()]
    pending = program(x, y)  # not waited for
    time.sleep(0.05)

    def drop():
        global x, y, pending, program
        del x, y, pending, program
        gc.collect()

    atexit.register(drop)
    print("exiting", flush=True)
""")


def clients_alive_at_exit(tmp_path, wait: float, callback_seconds: float) -> list[bool]:
    script = tmp_path / "keep_clients.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": JAXBIND_PARENT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code, out, err = _subprocesses.run(
        [sys.executable, str(script), str(wait), str(callback_seconds)], 120, "the exit script", env=env
    )
    assert code == 0 and "exiting" in out, err[-2000:]
    (line,) = [line for line in out.splitlines() if line.startswith("clients alive:")]
    return ast.literal_eval(line.removeprefix("clients alive:").strip())


@pytest.mark.parametrize(
    "wait, callback_seconds, kept",
    [
        (0.0, 0.3, True),  # the callback outlives the wait: the hook keeps the clients
        (10.0, 0.3, False),  # the hook waits for it: nothing kept, JAX frees its client
        (0.0, 0.0, False),  # it ended before the exit: nothing kept
    ],
    ids=["callback outlives the wait", "the hook waits for it", "no callback left"],
)
def test_the_exit_hook_keeps_the_clients_when_a_callback_outlives_its_wait(tmp_path, wait, callback_seconds, kept):
    reference = clients_alive_at_exit(tmp_path, 0.0, 0.0)  # no callback left: JAX's own exit frees them
    if reference and all(reference):
        pytest.skip(f"JAX {jax.__version__} keeps its clients past its exit hook: nothing to tell a kept one by")
    alive = clients_alive_at_exit(tmp_path, wait, callback_seconds)
    assert alive and alive == [kept] * len(alive)

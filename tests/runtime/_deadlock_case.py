"""A test that deadlocks on purpose inside a jaxbind walk, to show that the suite's time limits end it.

Not collected by ``pytest`` (the file name does not start with ``test_``); ``test_hang_limit.py``
runs it in a subprocess with short limits. By hand, from the repository's root:

    pytest tests/runtime/_deadlock_case.py -p no:cacheprovider --timeout=20

ends after 20 s, printing every thread's stack (``--timeout=0 -o faulthandler_timeout=20``: the same
by faulthandler's watchdog, the limit for a hang that holds the GIL).

A ``thread_safe`` op under ``jax.jit(jax.vmap(...))`` walks its batch on XLA's threads. The first
two elements return after 2 ms, so the walk spreads the rest over the threads; every later element
waits on a barrier with more parties than the batch has elements: the walk's threads all wait,
inside XLA's custom call (the GIL released), for a party that never comes.
"""

import threading
import time

import jax
import jax.numpy as jnp

import jaxbind

N = 64
NEVER = threading.Barrier(N + 1)  # trips when N + 1 callers wait: never, the walk has N elements
ENTERED = []


def wait_for_the_others(out, args, kwargs_dump):
    ENTERED.append(threading.get_ident())
    if len(ENTERED) > 2:  # (the first two: timed by the walk, long enough for it to spread)
        NEVER.wait()
    time.sleep(0.002)
    out[0][...] = args[0]


def test_a_walk_whose_elements_wait_for_each_other_hangs():
    op = jaxbind.get_nonlinear_call(
        wait_for_the_others, None, lambda x: ((x.shape, x.dtype),), None, thread_safe=True, name="wait_for_the_others"
    )
    walk = jax.jit(jax.vmap(lambda x: op(x)[0]))
    jax.block_until_ready(walk(jnp.ones((N, 8))))
    raise AssertionError("the walk returned: its elements did not deadlock")

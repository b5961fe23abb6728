"""A walk of a pure-Python body with the GIL off: thread_safe=True against 64 calls in a loop.

Run:  python bench/free_threaded.py [--quick] [--json out.json]

Run it on a free-threaded CPython (3.13t, 3.14t) and on the GIL build of the same CPython; each run
prints which one it is. Method, in one run: an op whose callback is a pure-Python loop (no NumPy, no
sleep: on a GIL build it holds the GIL throughout) of about 3 ms; a jitted ``vmap`` over 64 elements
against one jitted ``lax.fori_loop`` that calls the op 64 times, one element after another, for the
same op bound with ``thread_safe=True`` and with ``thread_safe=False``; the medians of interleaved
repetitions after a warm-up (``bench/_timing.py``). Then the cost of one element of a walk of an empty
body: a jitted ``vmap`` over 4,096 elements, per element. The goal (issue 36), on 2 idle cores: the
thread_safe ratio at most 0.6 with the GIL off (about 1.0 with it), thread_safe=False about 1.0 on
both, the empty element at most 1.3x the GIL build's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np

import jaxbind

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import cpu_model, load_average, median_seconds

ELEMENTS = 64


def pure_python(out, args, kwargs_dump):
    """About 3 ms of Python arithmetic on Python floats (its length in the kwargs)."""
    steps = jaxbind.load_kwargs(kwargs_dump)["steps"]
    total, x = 0.0, float(args[0][0])
    for i in range(steps):
        total += (x + i) * 0.5
    out[0][...] = total


def empty(out, args, kwargs_dump):
    pass


def like(x, **kwargs):
    return ((x.shape, x.dtype),)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    repeats = 9 if args.quick else 21
    free_threaded = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    gil = sys._is_gil_enabled() if hasattr(sys, "_is_gil_enabled") else True
    steps = calibrate(3e-3)
    x = jnp.asarray(np.arange(ELEMENTS, dtype=np.float64).reshape(ELEMENTS, 1))
    fns, rows = [], {}
    for thread_safe in (True, False):
        op = jaxbind.get_linear_call(
            pure_python, pure_python, like, like, name=f"pure_python_{thread_safe}", thread_safe=thread_safe
        )
        walk = jax.jit(jax.vmap(lambda v, op=op: op(v, steps=steps)[0]))

        def loop(v, op=op):
            return jax.lax.fori_loop(0, ELEMENTS, lambda i, y: y.at[i].set(op(v[i], steps=steps)[0]), v)

        loop = jax.jit(loop)
        np.testing.assert_allclose(walk(x), loop(x), rtol=1e-12)
        fns += [lambda walk=walk: walk(x), lambda loop=loop: loop(x)]
    times = median_seconds(fns, repeats)
    for k, thread_safe in enumerate((True, False)):
        walk_s, loop_s = times[2 * k], times[2 * k + 1]
        row = {"walk_ms": walk_s * 1e3, "loop_ms": loop_s * 1e3, "ratio": walk_s / loop_s}
        rows[f"thread_safe={thread_safe}"] = row
    empty_op = jaxbind.get_linear_call(empty, empty, like, like, name="empty")
    many = jnp.zeros((4096, 1))
    empty_walk = jax.jit(jax.vmap(lambda v: empty_op(v)[0]))
    (empty_s,) = median_seconds([lambda: empty_walk(many)], repeats * 3)
    rows["empty body, per element"] = {"us": empty_s / 4096 * 1e6}
    build = "free-threaded" if free_threaded else "GIL build"
    print(
        f"Python {sys.version.split()[0]} ({build}, GIL {'on' if gil else 'off'}), jax {jax.__version__}, "
        f"{os.cpu_count()} cores ({cpu_model()}), median of {repeats} interleaved repetitions"
    )
    print(f"pure-Python body of {steps} steps (~3 ms), {ELEMENTS} elements:")
    print(f"{'':<20}{'vmap walk, ms':>15}{'64-call loop, ms':>18}{'ratio':>8}")
    for label in ("thread_safe=True", "thread_safe=False"):
        row = rows[label]
        print(f"{label:<20}{row['walk_ms']:>15.1f}{row['loop_ms']:>18.1f}{row['ratio']:>8.2f}")
    print(f"empty body, per element of a 4,096-element walk: {rows['empty body, per element']['us']:.3f} us")
    print(f"load average at the end: {load_average():.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"build": build, "gil": gil, "python": sys.version.split()[0], "rows": rows}, f, indent=1)


def calibrate(seconds: float) -> int:
    """The loop length of ``pure_python`` that takes about ``seconds`` here (its loop run directly)."""
    steps = 1000
    while True:
        start = time.perf_counter()
        total = 0.0
        for i in range(steps):
            total += (1.0 + i) * 0.5
        spent = time.perf_counter() - start
        if spent > seconds / 4:
            return max(1, int(steps * seconds / spent))
        steps *= 4


if __name__ == "__main__":
    main()

"""What the exact kept-view check costs a callback that leaves garbage cycles behind.

Run:  python bench/kept_views.py [--repeats N]

Method: a callback solving x**3 + x = c with ``scipy.optimize.root`` on a
closure over its input (the closure ends in reference cycles that SciPy leaves
for the collector). It runs as a jitted jaxbind op, as the same callback called
directly on NumPy arrays, and, for comparison, as an op whose callback keeps
nothing and leaves no cycles (the check's normal path). Medians of interleaved
repetitions in a shuffled order (bench/_timing.py). The collections the check
asks for are counted by generation with ``gc.callbacks``, and one young
collection is timed alone (``gc.collect(0)`` on this process's heap).
"""

from __future__ import annotations

import argparse
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
from _timing import median_seconds

import jaxbind

jax.config.update("jax_enable_x64", True)


def same_shape(x):
    return ((x.shape, x.dtype),)


def root_callback(out, args, kwargs_dump):
    c = args[0]
    out[0][...] = scipy.optimize.root(lambda x: x**3 + x - c, np.zeros_like(c)).x


def newton_callback(out, args, kwargs_dump):  # the same answer, no closure and no cycles
    c = args[0]
    x = np.zeros_like(c)
    for _ in range(30):
        x -= (x**3 + x - c) / (3 * x**2 + 1)
    out[0][...] = x


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=301)
    options = parser.parse_args()

    c = jnp.array([0.5, 1.0, 2.0, 3.0])
    c_numpy = np.asarray(c)
    root_op = jaxbind.get_nonlinear_call(root_callback, None, same_shape, None)
    newton_op = jaxbind.get_nonlinear_call(newton_callback, None, same_shape, None)
    root_jit = jax.jit(lambda c: root_op(c)[0])
    newton_jit = jax.jit(lambda c: newton_op(c)[0])
    np.testing.assert_allclose(root_jit(c), newton_jit(c), rtol=1e-10)

    def root_direct():
        out = np.empty_like(c_numpy)
        root_callback((out,), (c_numpy,), b"")
        return out

    def newton_direct():
        out = np.empty_like(c_numpy)
        newton_callback((out,), (c_numpy,), b"")
        return out

    collections = {0: 0, 1: 0, 2: 0}

    def count(phase, info):
        if phase == "start":
            collections[info["generation"]] += 1

    fns = [lambda: root_jit(c), root_direct, lambda: newton_jit(c), newton_direct]
    gc.callbacks.append(count)
    times = median_seconds(fns, options.repeats)
    gc.callbacks.remove(count)

    start, n = time.perf_counter(), 200
    for _ in range(n):
        gc.collect(0)
    young = (time.perf_counter() - start) / n

    us = [t * 1e6 for t in times]
    print(f"{'case':<52} {'µs/call':>9}")
    print(f"{'scipy.optimize.root callback, jitted jaxbind op':<52} {us[0]:9.1f}")
    print(f"{'scipy.optimize.root callback, called directly':<52} {us[1]:9.1f}")
    print(f"{'  difference (op overhead + the check)':<52} {us[0] - us[1]:9.1f}")
    print(f"{'Newton callback without cycles, jitted jaxbind op':<52} {us[2]:9.1f}")
    print(f"{'Newton callback without cycles, called directly':<52} {us[3]:9.1f}")
    print(f"{'  difference (op overhead, the normal path)':<52} {us[2] - us[3]:9.1f}")
    print(f"{'one gc.collect(0) alone':<52} {young * 1e6:9.1f}")
    print(
        f"collections by generation during the timed runs ({options.repeats + 1} calls of each "
        f"case, the collector's own included): {collections}"
    )


if __name__ == "__main__":
    main()

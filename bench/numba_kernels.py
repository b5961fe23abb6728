"""numba kernels (``jaxbind.numba_kernel``) against C kernels: every core, and the cost of a call.

Run:  python bench/numba_kernels.py [--quick] [--json bench/results-numba.json]

(a) Every core. A numba kernel of ~150 µs per element (the computation of the C test kernel
    ``jb_busy``: out = x + sum_{k < n} sin(k) / n, n = 15000) vmapped over 64 elements (one
    custom call whose walk jaxbind spreads over XLA's intra-op threads) against the same 64
    single calls in a ``lax.fori_loop``; the C kernel ``jb_busy`` likewise, in the same run.
    Each time is one whole jitted call, the median of interleaved repetitions after a warm-up
    (``bench/_timing.py``), as in ``bench/scaling.py``.
(b) Per call. numba kernels against the equivalent C kernels of ``tests/kernels``
    (``jb_double``: y = 2 x; ``jb_scale``: y = factor x, a float kwarg the kernel looks up) on
    1 and 1,000 float64 numbers, by the method of ``bench/overhead.py``: the op runs K times in
    a jitted ``lax.fori_loop`` with a traced trip count, per call = (T(K) - T(0)) / K, K sized
    for ~0.1 s; the numba and the C version take turns, median of the repetitions.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numba
import numpy as np
from _timing import looped, median_seconds, timed, trip_count

import jaxbind

sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
import _kernels

KERNELS = _kernels.load()
TARGET_SECONDS = 0.1
ITERATIONS = 15000  # ~150 µs per element here (bench/scaling.py's 9000 took ~90 µs on this machine)


@jaxbind.numba_kernel
def nb_busy(out, args, kwargs):  # jb_busy
    n = kwargs.iterations
    acc = 0.0
    for k in range(n):
        acc += math.sin(float(k))
    x, y = args[0], out[0]
    for i in range(x.size):
        y.flat[i] = x.flat[i] + acc / n


@jaxbind.numba_kernel
def nb_double(out, args, kwargs):  # jb_double
    x, y = args[0], out[0]
    for i in range(x.size):
        y[i] = 2.0 * x[i]


@jaxbind.numba_kernel
def nb_scale(out, args, kwargs):  # jb_scale on float64
    x, y = args[-1], out[0]
    for i in range(x.size):
        y[i] = kwargs.factor * x[i]


def same_shape(x, **kwargs):
    return ((x.shape, x.dtype),)


def linear(kernel):
    return jaxbind.get_linear_call(kernel, kernel, same_shape, same_shape)


def every_core(repeats):
    rows = []
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 4)))
    for label, op in (("numba kernel (nb_busy)", linear(nb_busy)), ("C kernel (jb_busy)", linear(KERNELS.jb_busy))):
        walk = jax.jit(jax.vmap(lambda r, op=op: op(r, iterations=ITERATIONS)[0]))

        def body(i, c, op=op):
            return c.at[i].set(op(c[i], iterations=ITERATIONS)[0])

        loop = jax.jit(lambda a: jax.lax.fori_loop(0, x.shape[0], body, a))
        np.testing.assert_allclose(walk(x), loop(x), rtol=1e-12)
        rows.append((label, walk, loop))
    want = x + sum(math.sin(k) for k in range(ITERATIONS)) / ITERATIONS
    np.testing.assert_allclose(rows[0][1](x), want, rtol=1e-12)
    seconds = median_seconds(
        [fn for _, walk, loop in rows for fn in (lambda w=walk: w(x), lambda lp=loop: lp(x))], repeats
    )
    results = []
    for k, (label, _, _) in enumerate(rows):
        t_walk, t_loop = seconds[2 * k], seconds[2 * k + 1]
        results.append(
            dict(
                kernel=label,
                elements=64,
                vmap_us=1e6 * t_walk,
                loop_us=1e6 * t_loop,
                per_element_us=1e6 * t_loop / 64,
                ratio=t_walk / t_loop,
            )
        )
    return results


def per_call(bodies, x, repeats):
    """Seconds per call of each body, by the fori_loop difference method, the bodies taking turns."""
    fns = [looped(body) for body in bodies]
    for fn in fns:
        jax.block_until_ready(fn(x, 2))
    trips = [trip_count(fn, x, TARGET_SECONDS) for fn in fns]
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, k, out in zip(fns, trips, samples):
            t0 = timed(fn, x, 0)
            out.append((timed(fn, x, k) - t0) / k)
    return [statistics.median(s) for s in samples]


def per_call_rows(repeats):
    nb_double_op, c_double_op = linear(nb_double), linear(KERNELS.jb_double)
    nb_scale_op, c_scale_op = linear(nb_scale), linear(KERNELS.jb_scale)
    cases = [
        ("y = 2 x (jb_double)", lambda v: nb_double_op(v)[0], lambda v: c_double_op(v)[0]),
        (
            "y = factor x, a float kwarg (jb_scale)",
            lambda v: nb_scale_op(v, factor=0.5)[0],
            lambda v: c_scale_op(v, factor=0.5)[0],
        ),
    ]
    rows = []
    for label, numba_body, c_body in cases:
        for size in (1, 1000):
            x = jnp.asarray(np.random.default_rng(1).standard_normal(size))
            np.testing.assert_allclose(numba_body(x), c_body(x), rtol=1e-15)
            t_numba, t_c = per_call([numba_body, c_body], x, repeats)
            rows.append(dict(kernel=label, size=size, numba_us=1e6 * t_numba, c_us=1e6 * t_c, ratio=t_numba / t_c))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results-numba.json"))
    options = parser.parse_args()
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    cores = every_core(7 if options.quick else 25)
    calls = per_call_rows(5 if options.quick else 15)
    load_after = os.getloadavg()[0]

    print(
        f"Machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, Python "
        f"{platform.python_version()}, jax {jax.__version__}, numba {numba.__version__}; load average "
        f"{load_before:.1f} before, {load_after:.1f} after\n"
    )
    print("(a) vmap of a kernel over 64 elements against 64 single calls in a fori_loop")
    print("| kernel | per element, µs | vmap, µs | loop, µs | vmap / loop |\n|---|---:|---:|---:|---:|")
    for r in cores:
        print(
            f"| {r['kernel']} | {r['per_element_us']:.0f} | {r['vmap_us']:.0f} | {r['loop_us']:.0f} | "
            f"{r['ratio']:.2f} |"
        )
    print("\n(b) per call in a jitted fori_loop, float64")
    print("| kernel | numbers | numba, µs | C, µs | numba / C |\n|---|---:|---:|---:|---:|")
    for r in calls:
        print(f"| {r['kernel']} | {r['size']:,} | {r['numba_us']:.3f} | {r['c_us']:.3f} | {r['ratio']:.2f} |")
    results = dict(
        machine=dict(
            cpus=os.cpu_count(),
            python=platform.python_version(),
            jax=jax.__version__,
            numba=numba.__version__,
            numpy=np.__version__,
            load_average=[load_before, load_after],
        ),
        every_core=cores,
        per_call=calls,
        seconds=time.perf_counter() - started,
    )
    with open(options.json, "w") as handle:
        json.dump(results, handle, indent=1)
    print(f"\nwritten: {options.json} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()

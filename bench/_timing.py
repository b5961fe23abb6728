"""Timing shared by the benchmarks: medians of interleaved repetitions of jitted calls."""

import statistics
import time

import jax
import numpy as np


def median_seconds(fns, repeats):
    """Interleaved repetitions of each function (warmed up first); median seconds each.

    Each round runs the functions in a new random order: on a busy machine the
    call that follows a long one (or a non-JAX one) is measurably slower, and a
    fixed order would charge that to one row.
    """
    times = [[] for _ in fns]
    for fn in fns:
        jax.block_until_ready(fn())
    order = np.random.default_rng(1)
    for _ in range(repeats):
        for k in order.permutation(len(fns)):
            start = time.perf_counter()
            jax.block_until_ready(fns[k]())
            times[k].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]

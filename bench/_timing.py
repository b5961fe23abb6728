"""Timing shared by the benchmarks: medians of interleaved repetitions of jitted calls."""

import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def cpu_model() -> str:
    """The CPU's model name (what makes per-call ratios differ between machines of one kind)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(**extra) -> dict:
    """What a results file says of the machine and the versions it was measured with (``extra`` added)."""
    from importlib import metadata

    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": metadata.version("jaxlib"),
        "numpy": np.__version__,
        **extra,
    }


def load_average() -> float:
    """The 1-minute load average when the run ends (a busy machine skews every row)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


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


# ---- Per call inside one compiled loop (the fori_loop difference method) ----


def timed(fn, *args):
    """Seconds of one call of ``fn(*args)``, until its results are ready."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def looped(body, worker=False):
    """jit(x, k): ``body`` applied k times in a ``lax.fori_loop`` with a traced trip count (one
    executable for every k); with ``worker``, an independent ``sum(sin)`` beside the loop, so that XLA
    runs the program on its worker threads as it does real programs."""
    side = jnp.linspace(0.0, 1.0, 4096)

    def run(x, k):
        y = jax.lax.fori_loop(0, k, lambda i, v: body(v), x)
        if worker:
            return y, jnp.sum(jnp.sin(side * x.ravel()[0]))
        return y

    return jax.jit(run)


def trip_count(fn, x, target):
    """A trip count K for ``looped``'s ``fn`` whose run takes about ``target`` seconds."""
    k = 16
    while True:
        spent = timed(fn, x, k) - timed(fn, x, 0)
        if spent > target / 4 or k >= 1 << 22:
            break
        k *= 4
    return max(16, int(k * target / max(spent, 1e-9)))


def fori_per_call(body, x, worker, repeats, target):
    """Seconds per application of ``body`` to ``x``: (T(K) - T(0)) / K, the median of ``repeats``."""
    fn = looped(body, worker)
    jax.block_until_ready(fn(x, 2))  # compile and warm up
    k = trip_count(fn, x, target)
    samples = []
    for _ in range(repeats):
        t0 = timed(fn, x, 0)
        samples.append((timed(fn, x, k) - t0) / k)
    return statistics.median(samples)


def interleaved_per_call(bodies, x, worker, repeats, target, plain=()):
    """:func:`fori_per_call` for several bodies, their repetitions interleaved (a busy moment of the
    machine then falls on all of them). ``plain``: functions that return their own seconds per call,
    run once in every round too (first). Returns the medians: ``plain``'s, then the bodies'."""
    fns = [looped(body, worker) for body in bodies]
    for fn in fns:
        jax.block_until_ready(fn(x, 2))
    ks = [trip_count(fn, x, target) for fn in fns]
    samples = [[] for _ in (*plain, *fns)]
    for _ in range(repeats):
        for measure, sample in zip(plain, samples):
            sample.append(measure())
        for fn, k, sample in zip(fns, ks, samples[len(plain) :]):
            t0 = timed(fn, x, 0)
            sample.append((timed(fn, x, k) - t0) / k)
    return [statistics.median(sample) for sample in samples]


# ---- Per Python-level call ---------------------------------------------------


def timed_n(fn, args, n):
    """Seconds of ``n`` calls of ``fn(*args)`` from Python, the last one's results ready."""
    start = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return time.perf_counter() - start


def _calls_per_batch(fn, args, target):
    """How many calls of ``fn(*args)`` take about ``target`` seconds (after a warm-up call)."""
    jax.block_until_ready(fn(*args))
    n = 1
    while timed_n(fn, args, n) < target / 4:
        n *= 4
    return max(1, int(n * target / max(timed_n(fn, args, n), 1e-9)))


def plain_per_call(fn, *args, repeats, target):
    """Seconds per Python-level call of ``fn(*args)``: the median of ``repeats`` timed batches of
    about ``target`` seconds."""
    n = _calls_per_batch(fn, args, target)
    return statistics.median(timed_n(fn, args, n) / n for _ in range(repeats))


def interleaved_plain_per_call(calls, repeats, target):
    """:func:`plain_per_call` for several ``(fn, args)``, their batches interleaved (each round
    runs one batch of each): the medians, in order."""
    sizes = [_calls_per_batch(fn, args, target) for fn, args in calls]
    samples = [[] for _ in calls]
    for _ in range(repeats):
        for (fn, args), n, sample in zip(calls, sizes, samples):
            sample.append(timed_n(fn, args, n) / n)
    return [statistics.median(sample) for sample in samples]

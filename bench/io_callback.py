"""jaxbind.io_callback against jax.experimental.io_callback on the same callbacks, side by side in one run.

Run:  python bench/io_callback.py [--quick] [--json bench/results/io_callback.json]

Method, per call: as bench/pure_callback.py (``_timing.interleaved_per_call``): a
callback on one float64 that counts its calls in a Python-side counter and
returns x + 1 (``np.add``, as the callbacks of
bench/pure_callback.py are NumPy calls) runs K times in a jitted ``fori_loop`` with a traced trip count;
per call = (T(K) - T(0)) / K, the median of interleaved repetitions, K chosen
so that a run takes about 0.1 s (0.05 s with --quick); the four bodies (each
API, ordered=False and ordered=True) interleaved in one run, once alone (XLA
runs the tiny program on the calling thread) and once beside an independent
``sum(sin)`` (XLA runs it on a worker thread). Each body is checked first: K
calls return x + K and count K. Two references run in the same rounds: the
same callback through ``jaxbind.pure_callback`` (no effect: what the effect
adds) and the callback alone, called from Python on a read-only NumPy scalar.
A jitted call of one callback from Python, dispatch included, is timed too
(``_timing.interleaved_plain_per_call``).

Method, scan: a 10^5-step ``lax.scan`` whose every step makes one ordered
io_callback to a stateful host-side stepper (it logs its argument in a NumPy
array, updates a NumPy state and returns a float64 made from it, which becomes
the carry). End to end: one jitted call from Python until its results are ready,
compilation excluded (trace, lowering and compilation, ``jit(f).lower(c).compile()``,
is timed once on its own and reported apart); the stepper's state is reset
before every run (a few attribute stores). The median of interleaved
repetitions (``_timing.median_seconds``). Before timing, both APIs' runs are
checked against each other and against the same stepper run in a Python loop:
the scan's outputs and the stepper's log must be bitwise equal, so both do the
same work.
"""

from __future__ import annotations

import argparse
import json
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from _timing import interleaved_per_call, interleaved_plain_per_call, load_average, looped, machine, median_seconds
from jax.experimental import io_callback as jax_io_callback

import jaxbind

APIS = {"jax.experimental.io_callback": jax_io_callback, "jaxbind.io_callback": jaxbind.io_callback}
SCALAR = jax.ShapeDtypeStruct((), jnp.float64)
REFERENCE = "jaxbind.pure_callback"


class Counter:
    """x + 1, counting the calls on the Python side (the per-call callback)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return np.add(x, 1)


def counting(api, ordered, counter):
    def body(x):
        return api(counter, SCALAR, x, ordered=ordered)

    return body


class Stepper:
    """A stateful host-side stepper: it logs each argument, updates a NumPy state, and
    returns the next carry, computed from the state."""

    def __init__(self, steps):
        self.log = np.empty(steps)
        self.state = np.zeros(1)
        self.reset()

    def reset(self):
        self.n = 0
        self.state[0] = 0.0

    def __call__(self, c):
        c = np.asarray(c)  # JAX's io_callback passes a jax Array: the stepper works in NumPy
        self.log[self.n] = c
        self.n += 1
        self.state *= 0.5
        self.state += c
        return np.cos(self.state[0])


def scanned(api, stepper, steps):
    def step(c, _):
        c = api(stepper, SCALAR, c, ordered=True)
        return c, c

    return jax.jit(lambda c0: jax.lax.scan(step, c0, None, length=steps))


def body_alone(counter, x, calls=20000):
    """Seconds per call of the callback itself, from Python, on a read-only 0-d NumPy array."""
    start = time.perf_counter()
    for _ in range(calls):
        counter(x)
    return (time.perf_counter() - start) / calls


def per_call(results, repeats, target):
    x = jnp.asarray(0.25)
    counters = {}
    bodies = {}
    for ordered in (False, True):
        for name, api in APIS.items():
            counter = counters[name, ordered] = Counter()
            bodies[name, ordered] = counting(api, ordered, counter)
            before = counter.calls
            y = looped(bodies[name, ordered])(x, 5)
            jax.block_until_ready(y)
            assert float(y) == 5.25 and counter.calls - before == 5, (name, ordered, y, counter.calls)
    # References: the same callback through jaxbind.pure_callback (no effect: what the effect adds),
    # and called from Python on a NumPy scalar (what the callback itself costs).
    bodies[REFERENCE, None] = lambda x: jaxbind.pure_callback(Counter(), SCALAR, x)
    view = np.asarray(0.25)
    view.flags.writeable = False
    for where, worker in (("caller thread", False), ("worker thread", True)):
        alone, *seconds = interleaved_per_call(
            list(bodies.values()), x, worker, repeats, target, plain=(lambda: body_alone(Counter(), view),)
        )
        results["per_call_us"][f"references, {where}"] = {REFERENCE: seconds[-1] * 1e6, "callback alone": alone * 1e6}
        for ordered in (False, True):
            row = {name: s * 1e6 for (name, o), s in zip(bodies, seconds) if o == ordered}
            label = f"ordered={ordered}, {where}"
            results["per_call_us"][label] = row
            ratio = row["jaxbind.io_callback"] / row["jax.experimental.io_callback"]
            results["ratios"][f"per call, {label}"] = ratio
            print(
                f"per call, one float64, {label}: jax {row['jax.experimental.io_callback']:7.2f} us, "
                f"jaxbind {row['jaxbind.io_callback']:6.2f} us, ratio 1/{1 / ratio:.1f}"
            )
        print(
            f"    references, {where}: {REFERENCE} {seconds[-1] * 1e6:.2f} us, "
            f"the callback alone (from Python) {alone * 1e6:.2f} us"
        )


def jitted_call(results, repeats, target):
    """One jitted call from Python, dispatch included (JAX's own path for programs with effects)."""
    x = jnp.asarray(0.25)
    rows = {}
    calls = []
    for ordered in (False, True):
        for name, api in APIS.items():
            rows[name, ordered] = None
            calls.append((jax.jit(counting(api, ordered, Counter())), (x,)))
    seconds = interleaved_plain_per_call(calls, repeats, target)
    for ordered in (False, True):
        row = {name: s * 1e6 for (name, o), s in zip(rows, seconds) if o == ordered}
        results["jitted_call_us"][f"ordered={ordered}"] = row
        print(
            f"jitted call from Python, ordered={ordered}: jax {row['jax.experimental.io_callback']:7.1f} us, "
            f"jaxbind {row['jaxbind.io_callback']:7.1f} us"
        )


def scan(results, steps, repeats):
    c0 = jnp.asarray(0.25)
    steppers = {name: Stepper(steps) for name in APIS}
    fns = {name: scanned(api, steppers[name], steps) for name, api in APIS.items()}
    compile_s = {}
    for name, fn in fns.items():
        start = time.perf_counter()
        fn.lower(c0).compile()
        compile_s[name] = time.perf_counter() - start
    reference = Stepper(steps)
    c, expected = 0.25, np.empty(steps)
    start = time.perf_counter()
    for i in range(steps):
        c = expected[i] = reference(np.float64(c))
    python_loop_s = time.perf_counter() - start
    for name, fn in fns.items():
        steppers[name].reset()
        final, ys = jax.block_until_ready(fn(c0))
        assert steppers[name].n == steps, (name, steppers[name].n)
        np.testing.assert_array_equal(np.asarray(ys), expected, err_msg=name)
        np.testing.assert_array_equal(steppers[name].log, reference.log, err_msg=name)
        assert float(final) == expected[-1], name

    def run(name):
        steppers[name].reset()
        return fns[name](c0)

    seconds = median_seconds([lambda name=name: run(name) for name in fns], repeats)
    row = {name: s for name, s in zip(fns, seconds)}
    speedup = seconds[0] / seconds[1]
    results["scan"] = {
        "steps": steps,
        "end_to_end_s": row,
        "per_step_us": {name: s / steps * 1e6 for name, s in row.items()},
        "compile_s": compile_s,
        "stepper_in_a_python_loop_s": python_loop_s,
    }
    results["ratios"][f"scan of {steps} ordered steps, end to end (jax / jaxbind)"] = speedup
    print(
        f"lax.scan, {steps} steps, one ordered io_callback each, end to end: "
        f"jax {seconds[0]:.3f} s, jaxbind {seconds[1]:.3f} s, {speedup:.1f}x faster "
        f"(compile apart: jax {compile_s['jax.experimental.io_callback']:.2f} s, "
        f"jaxbind {compile_s['jaxbind.io_callback']:.2f} s; the stepper alone in a Python loop {python_loop_s:.3f} s)"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", help="write the results here")
    options = parser.parse_args()
    repeats, target, scan_repeats = (3, 0.05, 2) if options.quick else (9, 0.1, 7)
    results = {
        "machine": machine(),
        "method": __doc__.split("Method, per call: ")[1].strip(),
        "per_call_us": {},
        "jitted_call_us": {},
        "ratios": {},
    }
    per_call(results, repeats, target)
    jitted_call(results, repeats, target)
    scan(results, 10**5, scan_repeats)
    results["load_at_end"] = load_average()
    m = results["machine"]
    print(f"{m['cpu']}, {m['cpus']} cores, jax {jax.__version__}, load at the end {results['load_at_end']:.2f}")
    if options.json:
        with open(options.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

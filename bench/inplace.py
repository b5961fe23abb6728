"""In-place outputs (inplace=) against fresh ones, on a large loop carry, side by side in one run.

Run:  python bench/inplace.py [--quick] [--json bench/results/inplace.json]

Method: per step of a jitted ``fori_loop`` over 10^6 float64 whose carry goes
through the op, (T(K) - T(0)) / K with a traced trip count K
(``_timing.fori_per_call``), each row's repetitions interleaved with the
others'. The body is y = -x (``np.multiply(x, -1.0, out=y)``: one multiply per element,
as 2 x, but never overflowing: NumPy's floating-point warnings would cost more
than the call). Rows: the NumPy bodies alone (into a second array and in
place, ``out=x``, timed in a Python loop), the
op with each body (a fresh output, and in place), the
op with an empty body both ways, and ``-1.0 * x`` in jax.numpy. Then peak memory:
three in-place steps over a 1 GiB donated array, in a fresh process each, the
peak RSS (``ru_maxrss``) above the RSS with the array made, as a fraction of
the array, for the in-place op, the fresh-output op and jax.numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from _timing import interleaved_per_call

import jaxbind

N = 10**6
same = lambda *args, **kwargs: ((args[-1].shape, args[-1].dtype),)


def fresh_body(out, args, kwargs_dump):
    np.multiply(args[0], -1.0, out=out[0])


def inplace_body(out, args, kwargs_dump):
    np.multiply(out[0], -1.0, out=out[0])


def empty_body(out, args, kwargs_dump):
    pass


OPS = {
    "op, fresh output": jaxbind.get_nonlinear_call(fresh_body, None, same, None, name="double_fresh"),
    "op, in place": jaxbind.get_nonlinear_call(inplace_body, None, same, None, name="double_inplace", inplace={0: 0}),
    "empty op, fresh output": jaxbind.get_nonlinear_call(empty_body, None, same, None, name="empty_fresh"),
    "empty op, in place": jaxbind.get_nonlinear_call(
        empty_body, None, same, None, name="empty_inplace", inplace={0: 0}
    ),
}


def numpy_per_call(in_place):
    """Seconds of the body alone in a Python loop: into a second array, or where it stands."""
    x = np.ones(N)
    y = x if in_place else np.empty(N)
    start = time.perf_counter()
    for _ in range(50):
        np.multiply(x, -1.0, out=y)
    return (time.perf_counter() - start) / 50


PEAK = """
import resource, sys
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np
sys.path.insert(0, {here!r})
import inplace as bench
n = (1 << 30) // 8
x = jnp.ones(n)
x.block_until_ready()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kind = sys.argv[1]
if kind == "jnp":
    step = jax.jit(lambda v: -1.0 * v, donate_argnums=0)
else:
    op = bench.OPS[kind]
    step = jax.jit(lambda v: op(v)[0], donate_argnums=0)
for _ in range(3):
    x = step(x)
x.block_until_ready()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((peak - base) * 1024 / (n * 8))
"""


def peak_fraction(kind):
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", PEAK.format(here=here), kind], capture_output=True, text=True, check=True, timeout=600
    )
    return float(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", help="write the results here")
    options = parser.parse_args()
    repeats, target = (3, 0.1) if options.quick else (7, 0.3)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(N))
    bodies = {name: (lambda v, op=op: op(v)[0]) for name, op in OPS.items()}
    bodies["jnp -1.0 * x"] = lambda v: -1.0 * v
    for name, body in bodies.items():  # results first, outside the timing
        if name != "empty op, fresh output":  # (whose output is whatever the buffer held)
            np.testing.assert_allclose(jax.jit(body)(x), x if name.startswith("empty") else -x)
    numpy_rows = {
        "NumPy body alone, into a second array": lambda: numpy_per_call(False),
        "NumPy body alone, in place": lambda: numpy_per_call(True),
    }
    seconds = interleaved_per_call(list(bodies.values()), x, False, repeats, target, plain=list(numpy_rows.values()))
    per_step = {name: s * 1e6 for name, s in zip([*numpy_rows, *bodies], seconds)}
    for name, us in per_step.items():
        print(f"per step, {N:.0e} float64, {name:38}: {us:8.1f} us")
    ratios = {
        "op in place / NumPy body": per_step["op, in place"] / per_step["NumPy body alone, in place"],
        "op fresh / NumPy body": per_step["op, fresh output"] / per_step["NumPy body alone, into a second array"],
    }
    print(
        f"in-place op / its NumPy body: {ratios['op in place / NumPy body']:.2f}x; "
        f"fresh-output op: {ratios['op fresh / NumPy body']:.2f}x"
    )
    peaks = {kind: peak_fraction(kind) for kind in ("op, in place", "op, fresh output", "jnp")}
    for kind, fraction in peaks.items():
        print(f"3 donated steps over 1 GiB, {kind:17}: peak RSS +{fraction:.3f} of the array")
    if options.json:
        with open(options.json, "w") as f:
            json.dump(
                {
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                    "jax": jax.__version__,
                    "per_step_us": per_step,
                    "ratios": ratios,
                    "peak_rss_fraction": peaks,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()

"""jaxbind.pure_callback against jax.pure_callback on the same callbacks, side by side in one run.

Run:  python bench/pure_callback.py [--quick] [--json bench/results/pure_callback.json]

Method: per call inside one compiled program, as bench/overhead.py measures it
(``_timing.fori_per_call``): the call runs K times in a jitted ``fori_loop``
with a traced trip count, per call = (T(K) - T(0)) / K, the median of
interleaved repetitions; once alone (XLA runs the tiny program on the calling
thread) and once beside an independent ``sum(sin)`` (XLA runs it on a worker
thread). A jitted call from Python, dispatch included, is timed too
(``_timing.interleaved_plain_per_call``): JAX runs a program that holds a pure
callback before the call returns. The sequential vmap of 64 rows is timed per jitted call
(``_timing.median_seconds``, interleaved). Both APIs get the same callback
(``np.multiply(x, 2)``, returned as a new array, as pure_callback callbacks
are written); results are checked against jax.numpy before timing.

Last, the porting guide's worked example (docs/guides/porting.md: a SciPy solve
under custom_vjp, with jax.pure_callback, ported by name, and as an op with its
own derivatives): its testcode blocks are run here as they are, and the three
jitted gradients timed per call, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import warnings

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from _timing import cpu_model, interleaved_per_call, interleaved_plain_per_call, load_average, median_seconds

import jaxbind

# y = 2 x applied a million times overflows to inf: harmless here (and NumPy's
# error state is per thread, so silence the warning rather than np.seterr).
warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)


def double(a):
    return np.multiply(a, 2)


def via(api, vmap_method=None):
    def call(x):
        return api(double, jax.ShapeDtypeStruct(x.shape, x.dtype), x, vmap_method=vmap_method)

    return call


APIS = {"jax.pure_callback": jax.pure_callback, "jaxbind.pure_callback": jaxbind.pure_callback}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", help="write the results here")
    options = parser.parse_args()
    repeats, target = (3, 0.05) if options.quick else (9, 0.1)
    results = {
        "machine": f"{platform.machine()}, {cpu_model()}, {os.cpu_count()} cores",
        "jax": jax.__version__,
        "per_call_us": {},
        "vmap64_us": {},
        "ratios": {},
    }
    for n in (1, 1000):
        x = jnp.asarray(np.random.default_rng(0).standard_normal(n))
        for api in APIS.values():
            np.testing.assert_allclose(jax.jit(via(api))(x), 2 * x)
        for where, worker in (("caller thread", False), ("worker thread", True)):
            seconds = interleaved_per_call([via(api) for api in APIS.values()], x, worker, repeats, target)
            row = {name: s * 1e6 for name, s in zip(APIS, seconds)}
            results["per_call_us"][f"n={n}, {where}"] = row
            ratio = row["jaxbind.pure_callback"] / row["jax.pure_callback"]
            results["ratios"][f"per call, n={n}, {where}"] = ratio
            print(
                f"per call, n={n:>4}, {where}: jax {row['jax.pure_callback']:8.2f} us, "
                f"jaxbind {row['jaxbind.pure_callback']:6.2f} us, ratio 1/{1 / ratio:.1f}"
            )
    # A jitted call from Python, dispatch included: JAX runs a program that holds a pure callback
    # before the call returns (so that a failure raises there), off its C++ fast path (issue 40).
    results["jitted_call_us"] = {}
    for n in (1, 1000):
        x = jnp.asarray(np.random.default_rng(0).standard_normal(n))
        jitted = [jax.jit(via(api)) for api in APIS.values()]
        seconds = interleaved_plain_per_call([(f, (x,)) for f in jitted], repeats, target)
        row = results["jitted_call_us"][f"n={n}"] = {name: s * 1e6 for name, s in zip(APIS, seconds)}
        print(
            f"jitted call from Python, n={n:>4}: jax {row['jax.pure_callback']:8.2f} us, "
            f"jaxbind {row['jaxbind.pure_callback']:6.2f} us, ratio 1/{seconds[0] / seconds[1]:.1f}"
        )
    rows = jnp.asarray(np.random.default_rng(1).standard_normal((64, 1000)))
    vmapped = {name: jax.jit(jax.vmap(via(api, "sequential"))) for name, api in APIS.items()}
    for fn in vmapped.values():
        np.testing.assert_allclose(fn(rows), 2 * rows)
    seconds = median_seconds([lambda f=f: f(rows) for f in vmapped.values()], 20 if options.quick else 60)
    results["vmap64_us"] = {name: s * 1e6 for name, s in zip(vmapped, seconds)}
    ratio = seconds[1] / seconds[0]
    results["ratios"]["sequential vmap, 64 rows of 1000"] = ratio
    print(
        f"sequential vmap, 64 rows of 1000: jax {seconds[0] * 1e6:8.1f} us, jaxbind "
        f"{seconds[1] * 1e6:6.1f} us, ratio 1/{1 / ratio:.1f}"
    )
    guide = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "guides", "porting.md")
    with open(guide) as f:
        blocks = re.findall(r"```\{testcode\}\n(.*?)```", f.read(), re.S)
    space = {}
    for block in blocks:
        exec(block, space)  # the guide's own code (it checks its results against each other)
    a, b, loss = space["a"], space["b"], space["loss"]
    grads = {name: loss(space[name]) for name in ("solve_jax", "solve_port", "solve_own")}
    seconds = median_seconds([lambda g=g: g(a, b) for g in grads.values()], 50 if options.quick else 200)
    results["guide_example_grad_us"] = {name: s * 1e6 for name, s in zip(grads, seconds)}
    for name, s in zip(grads, seconds):
        print(f"guide example, jitted grad, {name}: {s * 1e6:7.1f} us, ratio 1/{seconds[0] / s:.1f}")
    results["load_at_end"] = load_average()
    print(f"{results['machine']}, jax {jax.__version__}, load at the end {results['load_at_end']:.2f}")
    if options.json:
        with open(options.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

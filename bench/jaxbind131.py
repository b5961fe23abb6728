"""Per-call cost of JAXbind 1.3.1 (the original package on PyPI), by the method of ``bench/overhead.py``.

JAXbind 1.3.1 has the import name ``jaxbind`` too, so it runs in a venv of its own:

    python3 -m venv /work/venv-jaxbind131
    . /work/venv-jaxbind131/bin/activate
    pip install jaxbind==1.3.1          # pulls the newest jax and jaxlib (0.10.2 on 2026-12-01: it runs there)
    cd /tmp && python /path/to/bench/jaxbind131.py [--quick] [--json results-jaxbind131.json]

(run it from outside this repository's root, whose ``jaxbind/`` folder would shadow the
installed package; the script refuses to measure anything but version 1.3.1). For the figures,
``bench/collect.py --jaxbind131-python /work/venv-jaxbind131/bin/python`` runs it, taking turns with
``bench/overhead.py``. JAXbind 1.3.1 registers its handler through ``jax.ffi`` and needs no pin:
on jax 0.10.2 its ops jit, differentiate and vmap (the script checks their results).

Method, the same as ``bench/overhead.py``'s per-call cases, with the same ops (y = 2 x as
``np.multiply(x, 2, out=out[0])``, and an empty body), bound by JAXbind's
``get_linear_call``: the op runs K times inside ONE jitted ``lax.fori_loop`` with a traced
trip count, so K=0 and K=K use the same executable; per call = (T(K) - T(0)) / K, the
median over repetitions after a warm-up, K chosen so that a run takes about 0.1 s; each case
alone (a tiny program, which XLA runs on the calling thread: "caller") and beside an
independent ``sum(sin(x))`` over 4096 elements ("worker"). ``jax.pure_callback`` is measured
in the same process too, as a common reference with ``bench/overhead.py``'s run. Then, as in
``bench/overhead.py``'s "other" rows (the median of timed batches of Python-level calls of a
jitted function): ``vmap`` over 64 x 1000 with and without ``func_can_batch``, a gradient step
against the forward call on 1,000 numbers, and an eager call on one number.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from importlib import metadata

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from _bodies import batched_abstract, empty_body, numpy_double, same_shape
from _timing import fori_per_call, load_average, machine, plain_per_call

import jaxbind

warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)

TARGET_SECONDS = 0.1
REPEATS = 5


def pure_callback_double(x):
    return jax.pure_callback(lambda a: np.multiply(a, 2), jax.ShapeDtypeStruct(x.shape, x.dtype), x)


python_op = jaxbind.get_linear_call(numpy_double, numpy_double, same_shape, same_shape)
empty_op = jaxbind.get_linear_call(empty_body, empty_body, same_shape, same_shape)
can_batch_op = jaxbind.get_linear_call(
    numpy_double, numpy_double, batched_abstract, batched_abstract, func_can_batch=True
)

# The names are those of bench/overhead.py's rows, prefixed where the op is JAXbind 1.3.1's.
CASES = {
    "jax.pure_callback": pure_callback_double,
    "JAXbind 1.3.1 python": lambda x: python_op(x)[0],
    "JAXbind 1.3.1 python, empty body": lambda x: empty_op(x)[0],
}


def per_call(body, x, worker: bool):
    """Seconds per application of ``body`` to ``x``: (T(K) - T(0)) / K, median of REPEATS."""
    return fori_per_call(body, x, worker, REPEATS, TARGET_SECONDS)


def per_call_plain(fn, *args):
    """Seconds per Python-level call of ``fn(*args)`` (``bench/overhead.py``'s "other" rows)."""
    return plain_per_call(fn, *args, repeats=REPEATS, target=TARGET_SECONDS)


def other(rng):
    """vmap over 64 x 1000, a gradient step and an eager call, as in ``bench/overhead.py``."""
    x = jnp.asarray(rng.standard_normal(1000))
    xs = jnp.asarray(rng.standard_normal((64, 1000)))
    x1 = jnp.asarray(rng.standard_normal(1))
    forward = jax.jit(lambda v: python_op(v)[0])
    grad = jax.jit(jax.grad(lambda v: 0.5 * jnp.sum(python_op(v)[0] ** 2)))
    walk = jax.jit(jax.vmap(lambda v: python_op(v)[0]))
    batched = jax.jit(jax.vmap(lambda v: can_batch_op(v)[0]))
    np.testing.assert_allclose(walk(xs), 2 * np.asarray(xs), rtol=1e-15)
    np.testing.assert_allclose(batched(xs), 2 * np.asarray(xs), rtol=1e-15)
    return {
        "forward 1000 (jit, called from Python)": per_call_plain(forward, x) * 1e6,
        "grad step 1000 (jit, called from Python)": per_call_plain(grad, x) * 1e6,
        "vmap 64x1000: JAXbind 1.3.1 (no func_can_batch)": per_call_plain(walk, xs) * 1e6,
        "vmap 64x1000: JAXbind 1.3.1 func_can_batch": per_call_plain(batched, xs) * 1e6,
        "eager op(x), 1 element": per_call_plain(lambda v: python_op(v)[0], x1) * 1e6,
    }


def check_results():
    x = jnp.asarray(np.random.default_rng(1).standard_normal(1000))
    for name, body in CASES.items():
        if "empty" not in name:
            np.testing.assert_allclose(jax.jit(body)(x), 2 * np.asarray(x), rtol=1e-15, err_msg=name)
    grad = jax.jit(jax.grad(lambda v: 0.5 * jnp.sum(python_op(v)[0] ** 2)))
    np.testing.assert_allclose(grad(x), 4 * np.asarray(x), rtol=1e-14)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--json", default="results-jaxbind131.json")
    options = parser.parse_args()
    version = metadata.version("jaxbind")
    if version != "1.3.1" or not hasattr(jaxbind, "jaxbind"):
        sys.exit(f"this is jaxbind {version} from {jaxbind.__file__}, not JAXbind 1.3.1: see the docstring")
    global REPEATS, TARGET_SECONDS
    sizes = [1, 1000, 1000000]
    if options.quick:
        REPEATS, TARGET_SECONDS, sizes = 3, 0.03, [1, 1000]
    started = time.time()
    check_results()
    load_before = os.getloadavg()
    results = {"machine": machine(jaxbind=version), "method": __doc__.split("Method, ")[1].strip(), "per_call_us": {}}
    rng = np.random.default_rng(0)
    for size in sizes:
        x = jnp.asarray(rng.standard_normal(size))
        row = {}
        for name, body in CASES.items():
            for worker in (False, True):
                row[f"{name} [{'worker' if worker else 'caller'}]"] = per_call(body, x, worker) * 1e6
        results["per_call_us"][str(size)] = row
    results["other_us"] = other(rng)
    results["load_average"] = {"before": load_before, "after": os.getloadavg()}
    results["seconds"] = time.time() - started
    results["machine"]["load_at_end"] = load_average()
    with open(options.json, "w") as handle:
        json.dump(results, handle, indent=2)

    m = results["machine"]
    print(
        f"# JAXbind {m['jaxbind']}: {m['cpu']}, {m['cpus']} CPUs, Python {m['python']}, jax {m['jax']}, "
        f"numpy {m['numpy']}, load at the end {m['load_at_end']:.2f}\n"
    )
    print("| per call, µs | " + " | ".join(f"{s} elements" for s in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for name in results["per_call_us"][str(sizes[0])]:
        print(f"| {name} | " + " | ".join(f"{results['per_call_us'][str(s)][name]:.3g}" for s in sizes) + " |")
    print("\n| other, µs per call | |\n|---|---:|")
    for name, value in results["other_us"].items():
        print(f"| {name} | {value:.3g} |")
    print(f"\nwritten: {options.json} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()

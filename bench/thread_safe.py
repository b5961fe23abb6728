"""thread_safe=True against the one-thread walk, measured side by side in one run.

Run:  python bench/thread_safe.py [--quick] [--json bench/thread_safe.json]

Method: one jitted ``vmap`` of an op over 64 elements, the same callback bound
twice (``thread_safe=True`` and not); the median of interleaved repetitions
after a warm-up (``bench/_timing.py``). Bodies: (a) NumPy over 10^5 numbers
(``np.sin`` then a scaled copy: NumPy releases the GIL inside), (b) a body that
holds the GIL (a Python loop over 300 numbers), where the parallel walk must
not be slower.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np

import jaxbind

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import median_seconds


def releases_gil(out, args, kwargs_dump):
    np.sin(args[0], out=out[0])
    np.multiply(out[0], 0.5, out=out[0])


def holds_gil(out, args, kwargs_dump):
    total = 0.0
    for value in args[0][:300].tolist():
        total += value * value
    out[0][...] = total


def like(x):
    return ((x.shape, x.dtype),)


def scalar_like(x):
    return (((), x.dtype),)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    repeats = 15 if args.quick else 41
    rows = {}
    cases = (
        ("NumPy over 10^5 numbers (releases the GIL)", releases_gil, like, (64, 100_000)),
        ("Python loop over 300 numbers (holds the GIL)", holds_gil, scalar_like, (64, 300)),
    )
    for label, body, abstract, shape in cases:
        x = jnp.asarray(np.random.default_rng(0).normal(size=shape))
        fns = []
        for thread_safe in (False, True):
            op = jaxbind.get_nonlinear_call(
                body, None, abstract, None, name=f"{body.__name__}_{thread_safe}", thread_safe=thread_safe
            )
            f = jax.jit(jax.vmap(lambda v, op=op: op(v)[0]))
            reference = f(x)
            fns.append(lambda f=f: f(x))
        np.testing.assert_allclose(fns[0](), fns[1](), rtol=1e-12)
        plain, parallel = median_seconds(fns, repeats)
        rows[label] = {"one_thread_ms": plain * 1e3, "thread_safe_ms": parallel * 1e3, "ratio": parallel / plain}
        del reference
    print(f"vmap over 64 elements, {os.cpu_count()} cores, median of {repeats} interleaved repetitions:")
    print(f"{'body':<48}{'one thread, ms':>15}{'thread_safe, ms':>17}{'ratio':>8}")
    for label, row in rows.items():
        print(f"{label:<48}{row['one_thread_ms']:>15.2f}{row['thread_safe_ms']:>17.2f}{row['ratio']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

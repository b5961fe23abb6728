"""vmap of a black box: scipy.special.kv over 1,000 scalars, per vmap_method.

Run:  python bench/black_box_vmap.py [--quick] [--json bench/results-vmap.json]

The op is ``K_v(x)`` with the order fixed (``demos/08_special_vmap.py``'s
callbacks, without their recording). Timed, in one run: one SciPy call on the
whole NumPy array (the floor), and ``jit(vmap(op))`` over the same 1,000 values
as a JAX array with ``vmap_method`` "expand_dims", "broadcast_all" and
"sequential" (the trampoline's walk, one callback call per element), and
``jax.pure_callback`` with ``vmap_method="expand_dims"`` for comparison; then
``jit(vmap(grad))`` likewise. Each time is one whole call (dispatch included,
``block_until_ready``), the median of interleaved repetitions (in a new random
order each round) after a warm-up.
Ratios are against the SciPy call measured interleaved with them, in the same
run: the whole-batch methods form one group, the slow ones (the walk,
pure_callback) another, as their long calls keep XLA's worker threads busy and
slow down the short calls measured beside them on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
import scipy
import scipy.special
from _timing import machine, median_seconds

import jaxbind

ORDER = 1.5
EMPTY = "jaxbind, expand_dims, empty callbacks (the fixed cost)"
METHODS = ("expand_dims", "broadcast_all", "sequential")


def kv_prime(v, x):
    return -0.5 * (scipy.special.kv(v - 1, x) + scipy.special.kv(v + 1, x))


def kv(out, args, kwargs_dump):
    scipy.special.kv(args[0], args[1], out=out[0])  # the order: one number per element here


def kv_derivative(out, args, kwargs_dump):  # jvp (v, x, dx) and vjp (v, x, ct) alike
    np.multiply(kv_prime(args[0], args[1]), args[2], out=out[0])


def kv_abstract(v, x, *tangents):
    return ((x.shape, x.dtype),)


def kv_reverse_abstract(v, x, ct):
    return ((x.shape, x.dtype),)


def empty(out, args, kwargs_dump):  # the fixed cost of a call: no work at all
    pass


def make_op(method):
    return jaxbind.get_nonlinear_call(
        kv,
        (kv_derivative, kv_derivative),
        kv_abstract,
        kv_reverse_abstract,
        first_n_args_fixed=1,
        vmap_method=method,
        name=f"kv_{method}",
    )


@jax.custom_jvp
def kv_pure_callback(x):
    return jax.pure_callback(
        lambda x: scipy.special.kv(ORDER, x).astype(x.dtype),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        x,
        vmap_method="expand_dims",
    )


@kv_pure_callback.defjvp
def _kv_pure_callback_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    slope = jax.pure_callback(
        lambda x: kv_prime(ORDER, x).astype(x.dtype),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        x,
        vmap_method="expand_dims",
    )
    return kv_pure_callback(x), slope * t


def timed_rows(x_np) -> tuple[dict, tuple]:
    """name -> (forward, gradient) of each method, and the empty op's pair (the fixed cost)."""
    rows = {"one SciPy call on the NumPy array": (lambda: scipy.special.kv(ORDER, x_np), None)}
    for method in METHODS:
        op = make_op(method)
        f = lambda x, op=op: op(ORDER, x)[0]
        rows[f"jaxbind, vmap_method={method!r}"] = (
            jax.jit(jax.vmap(f)).__call__,
            jax.jit(jax.vmap(jax.grad(f))).__call__,
        )
    rows["jax.pure_callback, vmap_method='expand_dims'"] = (
        jax.jit(jax.vmap(kv_pure_callback)).__call__,
        jax.jit(jax.vmap(jax.grad(kv_pure_callback))).__call__,
    )

    empty_op = jaxbind.get_nonlinear_call(
        empty,
        (empty, empty),
        kv_abstract,
        kv_reverse_abstract,
        first_n_args_fixed=1,
        vmap_method="expand_dims",
        name="empty",
    )
    empty_f = lambda x: empty_op(ORDER, x)[0]
    return rows, (jax.jit(jax.vmap(empty_f)).__call__, jax.jit(jax.vmap(jax.grad(empty_f))).__call__)


def measure(rows: dict, fixed_cost, x, x_np, repeats):
    """Per-call medians (µs) of every row and of its SciPy anchor, in the groups they are measured in."""
    # Two groups, each interleaved with its own SciPy call: the whole-batch
    # methods, and the slow ones (whose long calls keep XLA's worker threads
    # busy and would slow the short calls measured beside them on 2 cores).
    names_all = list(rows)
    scipy_name = names_all[0]
    rows = {**rows, EMPTY: fixed_cost}
    groups = [
        [n for n in names_all[1:] if "sequential" not in n and "pure_callback" not in n] + [EMPTY],
        [n for n in names_all[1:] if "sequential" in n or "pure_callback" in n],
    ]
    forward_us, grad_us, floor_us, grad_floor_us = {}, {}, {}, {}
    for group in groups:
        calls = [rows[scipy_name][0], lambda: kv_prime(ORDER, x_np)]
        calls += [lambda fn=rows[n][0]: fn(x) for n in group] + [lambda fn=rows[n][1]: fn(x) for n in group]
        seconds = [1e6 * s for s in median_seconds(calls, repeats)]
        for k, n in enumerate(group):
            floor_us[n], grad_floor_us[n] = seconds[0], seconds[1]
            forward_us[n], grad_us[n] = seconds[2 + k], seconds[2 + len(group) + k]

    return groups, forward_us, grad_us, floor_us, grad_floor_us


def print_table(groups, forward_us, grad_us, floor_us, grad_floor_us, repeats):
    print(
        f"scipy.special.kv over 1,000 float64 scalars; median of {repeats} interleaved repetitions, "
        "one run; ratio = time / the same SciPy code called once on the NumPy array, measured "
        "interleaved with it (kv for the op; the derivative -(k_{v-1} + k_{v+1})/2 for the grad).\n"
    )
    print("| method | jit(vmap(op)), µs | SciPy kv, µs | ratio | jit(vmap(grad(op))), µs | SciPy kv', µs | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for group in groups:
        for n in group:
            if n == EMPTY:
                print(f"| {n} | {forward_us[n]:.1f} | | | {grad_us[n]:.1f} | | |")
                continue
            print(
                f"| {n} | {forward_us[n]:.1f} | {floor_us[n]:.1f} | {forward_us[n] / floor_us[n]:.2f} | "
                f"{grad_us[n]:.1f} | {grad_floor_us[n]:.1f} | {grad_us[n] / grad_floor_us[n]:.2f} |"
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results-vmap.json"))
    options = parser.parse_args()
    repeats = 31 if options.quick else 301
    started = time.perf_counter()

    rng = np.random.default_rng(0)
    x_np = rng.uniform(0.5, 5.0, 1000)
    x = jnp.asarray(x_np)
    want = scipy.special.kv(ORDER, x_np)
    want_grad = kv_prime(ORDER, x_np)

    rows, fixed_cost = timed_rows(x_np)
    for _name, (forward, gradient) in rows.items():  # every row computes the right numbers
        np.testing.assert_allclose(np.asarray(forward() if gradient is None else forward(x)), want, rtol=1e-13)
        if gradient is not None:
            np.testing.assert_allclose(np.asarray(gradient(x)), want_grad, rtol=1e-13)

    groups, forward_us, grad_us, floor_us, grad_floor_us = measure(rows, fixed_cost, x, x_np, repeats)
    print_table(groups, forward_us, grad_us, floor_us, grad_floor_us, repeats)
    results = {
        "machine": machine(scipy=scipy.__version__),
        "repeats": repeats,
        "n": 1000,
        "scipy_us": floor_us,
        "forward_us": forward_us,
        "grad_us": grad_us,
        "scipy_derivative_us": grad_floor_us,
        "ratio_to_scipy": {n: forward_us[n] / floor_us[n] for n in forward_us if n != EMPTY},
        "grad_ratio_to_scipy_derivative": {n: grad_us[n] / grad_floor_us[n] for n in grad_us if n != EMPTY},
        "seconds": time.perf_counter() - started,
    }
    with open(options.json, "w") as handle:
        json.dump(results, handle, indent=2)
    print(f"\nwritten: {options.json} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()

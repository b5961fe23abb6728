"""Solver state kept by an op (``setup=``): what a gradient through a sparse solve costs with and without it.

Run:  python bench/setup_state.py [--quick] [--json bench/results-setup.json]

(a) The sparse Poisson problem of demo 11 (``-div(k grad u) = 1``, SciPy's ``splu``) on an
    ``n x n`` grid: ``jit(value_and_grad)`` of a loss through the op against ``jit`` of the loss
    alone (the forward solve), for the op with ``setup`` (the factorization made once, kept
    for the vjp) and for the same solver bound without it (its vjp factorizes again), and for
    the same two ways written with ``jax.pure_callback`` and ``jax.custom_vjp`` (the
    factorization made by the forward callback and again by the backward one, as a user
    without ``setup`` writes it). Every call gets a new ``k`` (a new factorization), the
    functions take turns in a shuffled order each round; the median of the rounds, as a
    ratio to the forward solve of the same op in the same run.
(b) Factorizations made by ``jax.jacrev`` over 8 outputs, with and without ``setup``.
(c) States alive after 1,000 calls on distinct inputs with ``setup_cache=8``, and after the
    op and its jitted function are dropped.
(d) Finding a kept state for an input of 10^5 float64 (a fingerprint and a byte comparison),
    against ``np.copy`` of the input: medians over interleaved repetitions.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import sys
import time
import weakref

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
import scipy.sparse.linalg as spla

import jaxbind
from jaxbind._state import state_cache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "demos"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
demo = importlib.import_module("11_sparse_solver_state")
from _timing import load_average, machine


def without_setup(grid):
    """The same solver bound without setup: each callback factorizes."""

    def solve(out, args, kwargs_dump):
        out[0][...] = spla.splu(grid.matrix(args[0])).solve(grid.rhs)

    def solve_vjp(out, args, kwargs_dump):
        lu = spla.splu(grid.matrix(args[0]))
        u = lu.solve(grid.rhs)
        out[0][...] = -grid.coefficient_gradient(lu.solve(np.asarray(args[1]), trans="T"), u)

    def abstract(k, *rest):
        return ((k.shape, k.dtype),)

    return jaxbind.get_nonlinear_call(solve, (solve_vjp, solve_vjp), abstract, abstract, name="poisson_no_setup")


def with_pure_callbacks(grid, pure_callback):
    """A user's custom_vjp around two pure_callbacks, each factorizing."""

    def forward_solve(k):
        return spla.splu(grid.matrix(np.asarray(k))).solve(grid.rhs)

    def backward(k, u_bar):
        lu = spla.splu(grid.matrix(np.asarray(k)))
        return -grid.coefficient_gradient(lu.solve(np.asarray(u_bar), trans="T"), lu.solve(grid.rhs))

    @jax.custom_vjp
    def solve(k):
        return pure_callback(forward_solve, jax.ShapeDtypeStruct(k.shape, k.dtype), k)

    solve.defvjp(
        lambda k: (solve(k), k),
        lambda k, u_bar: (pure_callback(backward, jax.ShapeDtypeStruct(k.shape, k.dtype), k, u_bar),),
    )
    return solve


def gradient_ratios(n, rounds):
    grid = demo.Poisson(n)
    stateful = demo.poisson_op(grid)
    plain = without_setup(grid)
    ways = {
        "op with setup": lambda k: stateful(k)[0],
        "op without setup (the vjp factorizes again)": lambda k: plain(k)[0],
        "custom_vjp of two jax.pure_callbacks": with_pure_callbacks(grid, jax.pure_callback),
        "custom_vjp of two jaxbind.pure_callbacks": with_pure_callbacks(grid, jaxbind.pure_callback),
    }
    functions = []
    for name, solve in ways.items():
        functions.append((name, "forward", jax.jit(lambda k, s=solve: jnp.sum(s(k) ** 2))))
        functions.append((name, "value_and_grad", jax.jit(jax.value_and_grad(lambda k, s=solve: jnp.sum(s(k) ** 2)))))
    k0 = np.random.default_rng(0).uniform(0.5, 2.0, n * n)
    for _, _, fn in functions:
        jax.block_until_ready(fn(jnp.asarray(k0)))
    times = {(name, what): [] for name, what, _ in functions}
    order = np.random.default_rng(1)
    draw = 0
    for _ in range(rounds):
        for i in order.permutation(len(functions)):
            name, what, fn = functions[i]
            draw += 1
            k = jnp.asarray(k0 * (1 + 1e-4 * draw))  # a new k: a new factorization
            start = time.perf_counter()
            jax.block_until_ready(fn(k))
            times[(name, what)].append(time.perf_counter() - start)
    start = time.perf_counter()
    spla.splu(grid.matrix(k0))
    factorization = time.perf_counter() - start
    rows = {}
    for name in ways:
        forward = statistics.median(times[(name, "forward")])
        gradient = statistics.median(times[(name, "value_and_grad")])
        rows[name] = {"forward_ms": 1e3 * forward, "value_and_grad_ms": 1e3 * gradient, "ratio": gradient / forward}
    return {"n": n, "unknowns": n * n, "factorization_ms": 1e3 * factorization, "ways": rows}


def jacrev_factorizations():
    grid = demo.Poisson(24)
    counts = {}
    for name, op in (("with setup", demo.poisson_op(grid)), ("without setup", without_setup(grid))):
        counter = {"n": 0}
        original = spla.splu

        def counting(*args, **kwargs):
            counter["n"] += 1
            return original(*args, **kwargs)

        spla.splu = counting
        try:
            k = jnp.asarray(np.random.default_rng(5).uniform(0.5, 2.0, grid.n**2))
            jax.jacrev(lambda k: op(k)[0][jnp.arange(0, 8 * 60, 60)])(k)
        finally:
            spla.splu = original
        counts[name] = counter["n"]
    return counts


def live_states():
    made = []

    def setup(args, kwargs):
        state = type("State", (), {})()
        made.append(weakref.ref(state))
        return state

    def f(out, args, kwargs_dump, state):
        out[0][...] = args[0]

    op = jaxbind.get_nonlinear_call(f, None, lambda x: ((x.shape, x.dtype),), None, setup=setup, setup_cache=8)
    call = jax.jit(lambda x: op(x)[0])  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
    for i in range(1000):
        call(jnp.full(4, float(i)))
    gc.collect()
    alive = sum(r() is not None for r in made)
    del op, call
    jax.clear_caches()
    gc.collect()
    return {
        "made": len(made),
        "alive with setup_cache=8": alive,
        "alive after the op is dropped": sum(r() is not None for r in made),
    }


def lookup_against_copy(rounds):
    op = jaxbind.get_nonlinear_call(
        lambda out, args, kd, state: None, None, lambda x: ((x.shape, x.dtype),), None, setup=lambda args, kwargs: 0
    )
    cache = state_cache(op.definition)
    x = np.random.default_rng(0).standard_normal(10**5)
    inputs, dump = (x,), jaxbind._kwargs.Kwargs({}, "op").dump
    cache.state_for(inputs, dump, False)  # kept
    lookup, copy = [], []
    for _ in range(rounds):
        for which in np.random.default_rng(len(lookup)).permutation(2):
            start = time.perf_counter()
            for _ in range(20):
                if which:
                    cache.state_for(inputs, dump, False)
                else:
                    np.copy(x)
            (lookup if which else copy).append((time.perf_counter() - start) / 20)
    assert cache.setups == 1
    found, copied = statistics.median(lookup), statistics.median(copy)
    return {"lookup_us": 1e6 * found, "np_copy_us": 1e6 * copied, "ratio": found / copied}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid and fewer rounds")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results-setup.json"))
    options = parser.parse_args()
    n, rounds = (96, 3) if options.quick else (192, 7)
    started = time.time()
    results = {"machine": machine(), "method": __doc__.split("\n\n", 2)[2].strip()}
    results["gradient"] = gradient_ratios(n, rounds)
    results["jacrev_8_outputs_factorizations"] = jacrev_factorizations()
    results["states"] = live_states()
    results["lookup_1e5_float64"] = lookup_against_copy(200 if not options.quick else 50)
    results["machine"]["load_at_end"] = load_average()
    results["seconds"] = time.time() - started
    with open(options.json, "w") as handle:
        json.dump(results, handle, indent=2)
    m, g = results["machine"], results["gradient"]
    print(f"# setup= state: {m['cpu']}, {m['cpus']} CPUs, jax {m['jax']}, load at the end {m['load_at_end']:.2f}\n")
    print(
        f"Sparse Poisson, {g['n']}x{g['n']} grid ({g['unknowns']} unknowns), one factorization "
        f"{g['factorization_ms']:.0f} ms; medians of {rounds} rounds:\n"
    )
    print("| way | forward ms | value_and_grad ms | ratio |\n|---|---:|---:|---:|")
    for name, row in g["ways"].items():
        print(f"| {name} | {row['forward_ms']:.0f} | {row['value_and_grad_ms']:.0f} | {row['ratio']:.2f} |")
    print(f"\nFactorizations, jacrev over 8 outputs: {results['jacrev_8_outputs_factorizations']}")
    print(f"States: {results['states']}")
    lookup = results["lookup_1e5_float64"]
    print(
        f"Finding a kept state (10^5 float64): {lookup['lookup_us']:.1f} us, np.copy {lookup['np_copy_us']:.1f} us: "
        f"{lookup['ratio']:.2f}x"
    )
    print(f"\nwritten: {options.json} ({results['seconds']:.0f} s)")


if __name__ == "__main__":
    main()

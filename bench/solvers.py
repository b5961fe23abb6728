"""External solvers: what residuals save when derivatives reuse the forward solve.

Run:  python bench/solvers.py [--quick] [--json bench/results-solvers.json]

(a) Root solve (demo 6: the Bratu problem, 16 unknowns, MINPACK's hybrj through
    ``scipy.optimize.root``). Three jitted functions, timed in one run: the forward solve
    alone (an op without residuals or derivatives: MINPACK only), ``jit(grad)`` of a loss
    through the op with residuals (the solution and the LU factors of dF/du: the vjp is
    one triangular solve), and ``jit(grad)`` through the same solver bound without
    residuals (its vjp must re-solve and re-factorize). Each time is the median over
    interleaved rounds (the three functions take turns, in a shuffled order) of the mean of
    20 calls, after a warm-up; ratios are to the forward solve of the same run. Reported as
    wall time, as the median of the ratios taken within each round, and as CPU time of
    the calling thread (these small programs run their callbacks on the calling thread,
    which the benchmark checks): on a loaded machine the CPU time is the steadier figure.
(b) ODE (demo 5: Lotka-Volterra by LSODA through ``scipy.integrate.odeint``, 21 time
    points, 2 states, 4 parameters and 2 initial values). The LSODA runs that
    ``jax.jacrev`` of the trajectory makes with the op whose residual is the forward
    sensitivity matrix, against the same model bound without residuals (its vjp solves the
    sensitivity system for each cotangent, and ``jacrev`` asks for one per output entry:
    21 x 2 = 42), and the time of each jacrev (median of interleaved repetitions).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import threading
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from scipy.integrate import odeint

import jaxbind

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "demos"))
ode = importlib.import_module("05_ode")
root = importlib.import_module("06_root_implicit")


# ---------------------------------------------------------------------------
# (a) The root solve, bound three ways
# ---------------------------------------------------------------------------


def plain_solve(out, args, kwargs_dump):
    lam, f = args
    out[0][...] = root.minpack_solve(float(lam), f)


def like_f(lam, f, *tangents):
    return ((f.shape, f.dtype),)


solve_only_op = jaxbind.get_nonlinear_call(plain_solve, None, like_f, None, name="bratu_solve_only")


def resolve_jvp(out, args, kwargs_dump):
    lam, f, d_lam, d_f = args
    u = root.minpack_solve(float(lam), f)  # no residuals: solve again
    out[0][...] = root.lu_solve(*root.lu_factor(root.jacobian(u, float(lam))), np.exp(u) * d_lam + d_f)


def resolve_vjp(out, args, kwargs_dump):
    lam, f, u_ct = args
    u = root.minpack_solve(float(lam), f)  # no residuals: solve again
    w = root.lu_solve(*root.lu_factor(root.jacobian(u, float(lam))), u_ct, trans=1)
    out[0][...] = np.exp(u) @ w
    out[1][...] = w


no_residuals_op = jaxbind.get_nonlinear_call(
    plain_solve,
    (resolve_jvp, resolve_vjp),
    like_f,
    lambda lam, f, ct: ((lam.shape, lam.dtype), (f.shape, f.dtype)),
    name="bratu_no_residuals",
)


def loss_through(op):
    grid = np.linspace(root.H, 1 - root.H, root.N)
    return lambda lam, f: jnp.sum(jnp.sin(op(lam, f)[0]) * grid)


def time_interleaved(functions, args, repeats, calls):
    """Per function: the median over ``repeats`` rounds of the mean wall time of ``calls`` calls,
    and of the calling thread's CPU time over the same calls.

    In each round every function runs once, in a shuffled order (so that none is
    always first after another's work). The rounds are returned too.
    """
    rounds = []
    order = list(functions)
    rng = np.random.default_rng(0)
    for fn in functions.values():  # warm-up: compile
        jax.block_until_ready(fn(*args))
    for _ in range(repeats):
        rng.shuffle(order)
        sample = {}
        for name in order:
            fn = functions[name]
            wall, cpu = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
            sample[name] = ((time.perf_counter() - wall) / calls, (time.thread_time() - cpu) / calls)
        rounds.append(sample)
    wall = {name: statistics.median(r[name][0] for r in rounds) for name in functions}
    cpu = {name: statistics.median(r[name][1] for r in rounds) for name in functions}
    return wall, cpu, rounds


def on_calling_thread(fn):
    """``fn`` recording whether each call ran on the main (calling) thread."""

    def spy(*args):
        CALLING_THREAD.append(threading.current_thread() is threading.main_thread())
        return fn(*args)

    return spy


CALLING_THREAD = []
# Every MINPACK solve, the demo op's too, goes through this spy.
root.minpack_solve = on_calling_thread(root.minpack_solve)


def root_solve(repeats):
    rng = np.random.default_rng(0)
    lam = np.float64(1.5)
    f = 2.0 * np.sin(np.pi * np.linspace(root.H, 1 - root.H, root.N)) + 0.1 * rng.standard_normal(root.N)
    functions = {
        "forward solve alone": jax.jit(lambda lam, f: solve_only_op(lam, f)[0]),
        "jit(grad), residuals": jax.jit(jax.grad(loss_through(root.bratu_op), argnums=(0, 1))),
        "jit(grad), no residuals": jax.jit(jax.grad(loss_through(no_residuals_op), argnums=(0, 1))),
    }
    # Same gradients from both ops, once, outside the timing.
    g_res = functions["jit(grad), residuals"](lam, f)
    g_nores = functions["jit(grad), no residuals"](lam, f)
    for a, b in zip(g_res, g_nores):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12)
    CALLING_THREAD.clear()
    wall, cpu, rounds = time_interleaved(functions, (lam, f), repeats, calls=20)
    # The CPU time of the calling thread counts the callbacks only if they ran there.
    cpu_valid = all(CALLING_THREAD)
    base = "forward solve alone"
    return {
        name: dict(
            seconds=wall[name],
            ratio=wall[name] / wall[base],
            ratio_per_round=statistics.median(r[name][0] / r[base][0] for r in rounds),
            cpu_seconds=cpu[name],
            cpu_ratio=cpu[name] / cpu[base] if cpu_valid else None,
        )
        for name in functions
    }


# ---------------------------------------------------------------------------
# (b) The ODE: LSODA runs in jax.jacrev
# ---------------------------------------------------------------------------

LSODA_RUNS = {"count": 0}


def trajectory_only(out, args, kwargs_dump):
    t, theta, y0 = args
    LSODA_RUNS["count"] += 1
    out[0][...] = odeint(lambda t, z: ode.rhs(z, theta), y0, t, tfirst=True, **ode.TOLERANCE)


def sensitivities(t, theta, y0):
    LSODA_RUNS["count"] += 1
    start = np.concatenate([y0, np.concatenate([np.zeros((2, 4)), np.eye(2)], axis=1).ravel()])
    states = odeint(ode.rhs_with_sensitivities, start, t, args=(theta,), tfirst=True, **ode.TOLERANCE)
    return states[:, 2:].reshape(len(t), 2, 6)


def resolve_ode_jvp(out, args, kwargs_dump):
    t, theta, y0, d_theta, d_y0 = args
    out[0][...] = sensitivities(t, theta, y0) @ np.concatenate([d_theta, d_y0])


def resolve_ode_vjp(out, args, kwargs_dump):
    t, theta, y0, ct = args
    p = np.einsum("tip,ti->p", sensitivities(t, theta, y0), ct)
    out[0][...] = p[:4]
    out[1][...] = p[4:]


ode_no_residuals = jaxbind.get_nonlinear_call(
    trajectory_only,
    (resolve_ode_jvp, resolve_ode_vjp),
    lambda t, theta, y0, *tangents: (((t.shape[0], 2), y0.dtype),),
    lambda t, theta, y0, ct: ((theta.shape, theta.dtype), (y0.shape, y0.dtype)),
    first_n_args_fixed=1,
    name="lotka_volterra_no_residuals",
)


def count_ode_solves(repeats):
    t = np.linspace(0.0, 15.0, 21)
    with_residuals = jax.jacrev(lambda theta, y0: ode.trajectory(t, theta, y0), argnums=(0, 1))
    without = jax.jacrev(lambda theta, y0: ode_no_residuals(t, theta, y0)[0], argnums=(0, 1))
    ode.SOLVES["forward"] = 0
    jac = with_residuals(ode.THETA_TRUE, ode.Y0)
    runs_with = ode.SOLVES["forward"]
    LSODA_RUNS["count"] = 0
    jac_without = without(ode.THETA_TRUE, ode.Y0)
    runs_without = LSODA_RUNS["count"]
    for a, b in zip(jac, jac_without):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    times, _, _ = time_interleaved(
        {"residuals": with_residuals, "no residuals": without}, (ode.THETA_TRUE, ode.Y0), repeats, calls=1
    )
    return dict(
        points=len(t),
        lsoda_runs_with_residuals=runs_with,
        lsoda_runs_without_residuals=runs_without,
        jacrev_seconds_with_residuals=times["residuals"],
        jacrev_seconds_without_residuals=times["no residuals"],
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results-solvers.json"))
    args = parser.parse_args()
    repeats = 9 if args.quick else 41

    roots = root_solve(repeats)
    print(
        f"\n(a) Root solve: Bratu problem, {root.N} unknowns, MINPACK hybrj; median of {repeats} interleaved rounds\n"
    )
    print(
        "| jitted function | wall, ms per call | / forward solve | per-round ratios, median | "
        "CPU of the calling thread, ms | / forward solve |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in roots.items():
        cpu_ratio = "n/a" if row["cpu_ratio"] is None else f"{row['cpu_ratio']:.2f}"
        print(
            f"| {name} | {1e3 * row['seconds']:.3f} | {row['ratio']:.2f} | {row['ratio_per_round']:.2f} | "
            f"{1e3 * row['cpu_seconds']:.3f} | {cpu_ratio} |"
        )

    odes = count_ode_solves(max(3, repeats // 5))
    print(
        f"\n(b) ODE: Lotka-Volterra by LSODA, {odes['points']} time points; jax.jacrev of the trajectory "
        f"in (theta, y0)\n"
    )
    print("| op | LSODA runs in jacrev | jacrev, s |")
    print("|---|---:|---:|")
    print(
        f"| residuals (sensitivities) | {odes['lsoda_runs_with_residuals']} | "
        f"{odes['jacrev_seconds_with_residuals']:.3f} |"
    )
    print(
        f"| no residuals (vjp re-solves) | {odes['lsoda_runs_without_residuals']} | "
        f"{odes['jacrev_seconds_without_residuals']:.3f} |"
    )
    speedup = odes["jacrev_seconds_without_residuals"] / odes["jacrev_seconds_with_residuals"]
    print(f"\njacrev with residuals is {speedup:.1f}x faster.")

    with open(args.json, "w") as handle:
        json.dump(
            dict(
                root_solve=roots,
                ode_jacrev=odes,
                repeats=repeats,
                jax=jax.__version__,
                numpy=np.__version__,
                python=platform.python_version(),
                machine=platform.machine(),
                cpus=os.cpu_count(),
            ),
            handle,
            indent=2,
        )
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

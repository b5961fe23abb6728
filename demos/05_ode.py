"""Demo 5: an ODE solved by ODEPACK (LSODA, via scipy.integrate.odeint) as a JAX op, fitted to data.

What you learn here
-------------------
* how an external ODE solver becomes an op of its parameters and initial state;
* how **residuals** (``n_residuals=1``) let the derivatives reuse the forward
  solve: the op solves the ODE together with its forward sensitivities
  ``S = d y(t) / d (theta, y0)`` in one LSODA run, returns the trajectory, and
  keeps ``S`` as a residual. ``f_jvp`` and ``f_vjp`` are then contractions with
  ``S``: no second solve. ``jax.grad`` of a fitting loss, ``jax.jacrev`` and
  ``jax.jacfwd`` each run LSODA once per parameter point (counted below);
* fitting the parameters to noisy synthetic data by gradient descent (Adam),
  and a plot of the data, the initial guess and the fit (``demos/out/05_ode.png``).

The model: Lotka-Volterra predator-prey equations, ``z = (prey, predator)``,

    prey'     = alpha prey - beta prey predator
    predator' = delta prey predator - gamma predator

with ``theta = (alpha, beta, delta, gamma)``. The sensitivities obey
``S' = (df/dz) S + [df/dtheta, 0]``, ``S(0) = [0, I]``.

Checks: the trajectory against an independent solver (scipy's DOP853
Runge-Kutta, not ODEPACK), gradients and the Jacobian against central finite
differences, solve counts, vmap against a loop, and that the fit recovers the
parameters.
"""

import os
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt
import numpy as np
from _checks import check, failures, finish, op_check
from scipy.integrate import odeint, solve_ivp

import jaxbind

TOLERANCE = dict(rtol=1e-10, atol=1e-10)
SOLVES = {"forward": 0}  # LSODA runs made by the op


def rhs(z, theta):
    prey, predator = z
    alpha, beta, delta, gamma = theta
    return np.array([alpha * prey - beta * prey * predator, delta * prey * predator - gamma * predator])


def rhs_with_sensitivities(t, state, theta):
    """The ODE and its forward sensitivities, as one system of 2 + 2*6 equations."""
    z, S = state[:2], state[2:].reshape(2, 6)
    prey, predator = z
    alpha, beta, delta, gamma = theta
    df_dz = np.array([[alpha - beta * predator, -beta * prey], [delta * predator, delta * prey - gamma]])
    df_dtheta = np.array([[prey, -prey * predator, 0.0, 0.0], [0.0, 0.0, prey * predator, -predator]])
    dS = df_dz @ S
    dS[:, :4] += df_dtheta
    return np.concatenate([rhs(z, theta), dS.ravel()])


# ---------------------------------------------------------------------------
# The op: (t fixed, theta, y0) -> trajectory (T, 2); residual S (T, 2, 6)
# ---------------------------------------------------------------------------


def solve(out, args, kwargs_dump):
    t, theta, y0 = args
    SOLVES["forward"] += 1
    start = np.concatenate([y0, np.concatenate([np.zeros((2, 4)), np.eye(2)], axis=1).ravel()])  # S(0) = [0 | I]
    states = odeint(rhs_with_sensitivities, start, t, args=(theta,), tfirst=True, **TOLERANCE)
    out[0][...] = states[:, :2]  # the trajectory: the op's output
    out[1][...] = states[:, 2:].reshape(len(t), 2, 6)  # the sensitivities: a residual


def solve_jvp(out, args, kwargs_dump):
    t, theta, y0, S, d_theta, d_y0 = args  # primals, residual, tangents
    out[0][...] = S @ np.concatenate([d_theta, d_y0])


def solve_vjp(out, args, kwargs_dump):
    t, theta, y0, S, trajectory_ct = args  # primals, residual, cotangent
    ct = np.einsum("tip,ti->p", S, trajectory_ct)
    out[0][...] = ct[:4]  # cotangent of theta
    out[1][...] = ct[4:]  # cotangent of y0


def solve_abstract(t, theta, y0):
    # the output, then the residual (called with the primals only)
    return (((t.shape[0], 2), y0.dtype), ((t.shape[0], 2, 6), y0.dtype))


def solve_abstract_reverse(t, theta, y0, S, trajectory_ct):
    return ((theta.shape, theta.dtype), (y0.shape, y0.dtype))


lotka_volterra = jaxbind.get_nonlinear_call(
    solve,
    (solve_jvp, solve_vjp),
    solve_abstract,
    solve_abstract_reverse,
    first_n_args_fixed=1,
    n_residuals=1,
    name="lotka_volterra",
)


def trajectory(t, theta, y0):
    return lotka_volterra(t, theta, y0)[0]


# ---------------------------------------------------------------------------
# The fit
# ---------------------------------------------------------------------------

T = np.linspace(0.0, 15.0, 41)
THETA_TRUE = np.array([1.1, 0.4, 0.1, 0.4])
Y0 = np.array([10.0, 5.0])


def loss(log_theta, t, data):
    """Mean squared misfit; the parameters are fitted in log space (they are positive)."""
    return jnp.mean((trajectory(t, jnp.exp(log_theta), Y0) - data) ** 2)


def reference_trajectory(t, theta, y0):
    """An independent solver: explicit Runge-Kutta (DOP853), no ODEPACK."""
    sol = solve_ivp(lambda t, z: rhs(z, theta), (t[0], t[-1]), y0, method="DOP853", t_eval=t, rtol=1e-12, atol=1e-12)
    return sol.y.T


def finite_difference_gradient(fun, x, eps=1e-6):
    g = np.zeros_like(x)
    for i in range(len(x)):
        e = np.zeros_like(x)
        e[i] = eps
        g[i] = (fun(x + e) - fun(x - e)) / (2 * eps)
    return g


def fit(log_theta, data, steps=60, rate=0.02):
    """Adam: gradient descent with per-parameter step sizes."""
    grad = jax.jit(jax.value_and_grad(loss))
    m = v = jnp.zeros_like(log_theta)
    history = []
    for k in range(1, steps + 1):
        value, g = grad(log_theta, T, data)
        history.append(float(value))
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g**2
        log_theta = log_theta - rate * (m / (1 - 0.9**k)) / (jnp.sqrt(v / (1 - 0.999**k)) + 1e-8)
    return log_theta, history


def main():
    rng = np.random.default_rng(0)
    clean = reference_trajectory(T, THETA_TRUE, Y0)
    data = clean + rng.normal(0.0, 0.5, clean.shape)

    # 1. Values against an independent solver
    check("trajectory vs DOP853", trajectory(T, THETA_TRUE, Y0), clean, rtol=1e-7, atol=1e-7)

    # 2. Gradient of the loss: one LSODA run, and equal to finite differences
    log_theta0 = np.log(np.array([0.95, 0.45, 0.085, 0.35]))
    SOLVES["forward"] = 0
    g = jax.jit(jax.grad(loss))(log_theta0, T, data)
    solves_grad = SOLVES["forward"]
    check("jit(grad) makes one forward solve", solves_grad, 1)
    reference_loss = lambda x: np.mean((reference_trajectory(T, np.exp(x), Y0) - data) ** 2)
    fd = finite_difference_gradient(reference_loss, log_theta0, eps=1e-5)
    print(f"     gradient {np.asarray(g).round(4)}, finite differences {fd.round(4)}")
    check("grad vs central finite differences (DOP853)", np.asarray(g), fd, rtol=1e-5, atol=1e-5)

    # 3. Jacobians of the trajectory: one solve each (without residuals, jacrev
    #    would re-solve for every cotangent)
    SOLVES["forward"] = 0
    jac = jax.jacrev(trajectory, argnums=(1, 2))(T, THETA_TRUE, Y0)
    solves_jacrev = SOLVES["forward"]
    check("jacrev makes one forward solve", solves_jacrev, 1)
    SOLVES["forward"] = 0
    jac_fwd = jax.jacfwd(trajectory, argnums=(1, 2))(T, THETA_TRUE, Y0)
    check("jacfwd makes one forward solve", SOLVES["forward"], 1)
    check("jacfwd == jacrev", jac_fwd, jac, rtol=1e-12, atol=1e-12)
    fd_theta = np.stack(
        [
            (reference_trajectory(T, THETA_TRUE + e, Y0) - reference_trajectory(T, THETA_TRUE - e, Y0)) / 2e-6
            for e in 1e-6 * np.eye(4)
        ],
        axis=-1,
    )
    check("d trajectory / d theta vs finite differences (DOP853)", np.asarray(jac[0]), fd_theta, rtol=1e-5, atol=1e-5)

    # 4. vmap over initial states: one walked call, against a loop
    starts = np.array([[10.0, 5.0], [8.0, 3.0], [12.0, 6.0]])
    check(
        "vmap over y0 vs a loop",
        jax.vmap(trajectory, in_axes=(None, None, 0))(T, THETA_TRUE, starts),
        np.stack([trajectory(T, THETA_TRUE, y0) for y0 in starts]),
        rtol=1e-14,
        atol=1e-14,
    )

    # 5. The op checker: abstract, unwritten outputs, jvp vs finite differences, vjp vs jvp, vmap, jit
    # (finite differences of LSODA agree with its sensitivities to its own tolerance, not to 1e-10)
    op_check("check_op", lotka_volterra, T, THETA_TRUE, Y0, fd_rtol=1e-6)

    # 6. The fit
    SOLVES["forward"] = 0
    started = time.perf_counter()
    log_theta, history = fit(jnp.asarray(log_theta0), data)
    seconds = time.perf_counter() - started
    theta = np.exp(np.asarray(log_theta))
    print(
        f"     fit: {len(history)} steps, {SOLVES['forward']} LSODA runs, {seconds:.2f} s; "
        f"loss {history[0]:.3g} -> {history[-1]:.3g}"
    )
    print(f"     theta true {THETA_TRUE}, initial {np.exp(log_theta0).round(3)}, fitted {theta.round(3)}")
    check("one LSODA run per gradient step", SOLVES["forward"], len(history))
    check("fitted parameters near the true ones (10%)", theta, THETA_TRUE, rtol=0.1, atol=0.0)
    final = float(loss(log_theta, T, data))
    floor = float(np.mean((clean - data) ** 2))  # the misfit of the true parameters
    ok = final < 1.5 * floor < history[0]
    print(
        f"{'OK  ' if ok else 'FAIL'} {'fit: loss down to the noise floor (< 1.5x)':50s} "
        f"{history[0]:.3g} -> {final:.3g} (true parameters: {floor:.3g})"
    )
    if not ok:
        failures.append("fit: loss down to the noise floor")

    # 7. The plot
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "05_ode.png")
    fine = np.linspace(T[0], T[-1], 400)
    initial = np.asarray(trajectory(fine, np.exp(log_theta0), Y0))
    fitted = np.asarray(trajectory(fine, theta, Y0))
    figure, axes = plt.subplots(figsize=(10, 4.5))
    for j, (label, color) in enumerate([("prey", "tab:blue"), ("predator", "tab:red")]):
        axes.plot(T, data[:, j], "o", color=color, ms=4, label=f"{label}: noisy data")
        axes.plot(fine, initial[:, j], ":", color=color, label=f"{label}: initial guess")
        axes.plot(fine, fitted[:, j], "-", color=color, label=f"{label}: fitted")
    axes.set_xlabel("t")
    axes.set_ylabel("population")
    axes.set_title("Lotka-Volterra fitted with jax.grad through LSODA (ODEPACK)")
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    ok = os.path.getsize(path) > 10_000
    print(f"{'OK  ' if ok else 'FAIL'} {'plot written':50s} {path}")
    if not ok:
        failures.append("plot written")
    finish()


if __name__ == "__main__":
    main()

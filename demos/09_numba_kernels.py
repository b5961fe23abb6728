"""Demo 9: numba kernels: an ODE integrator written in Python, vmapped over every core.

What you learn here
-------------------
* how a kernel is written in Python with numba's nopython subset and made a
  jaxbind kernel with ``jaxbind.numba_kernel``: XLA then calls it with no
  Python and no GIL, like a C kernel;
* how its jvp and vjp are kernels too, and the op is checked with
  ``jaxbind.testing.check_op``;
* how vmap walks a batch of such calls over XLA's threads (all the cores);
* how an exception the kernel raises reaches Python, naming the op.

The computation: the damped oscillator x'' + 2 gamma x' + omega^2 x = 0 from
(x0, v0), integrated by ``steps`` classical Runge-Kutta (RK4) steps up to
``t_end``. Per element, p = (omega, gamma, x0, v0) -> (x(t_end), v(t_end)). The
jvp kernel integrates the tangent system beside the state (RK4 of the augmented
system is the exact derivative of the RK4 map, so the derivatives are those of
the discrete solution); the vjp kernel does so for the four parameter
directions at once and returns J^T ct. The reference is the same RK4 in
``jax.numpy`` (a ``lax.fori_loop``), differentiated by JAX.
"""

import os
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numba
import numpy as np
from _checks import check, failures, finish, op_check

import jaxbind

T_END, STEPS = 10.0, 4000


# ---------------------------------------------------------------------------
# The kernels: plain Python, compiled by numba (nopython) when first called
# ---------------------------------------------------------------------------


@numba.njit(nogil=True)
def integrate(p, directions, t_end, steps, state, tangents):
    """RK4 of (x, v) from (x0, v0) and of the tangents along each row of ``directions``.

    state (2,): x, v at t_end; tangents (k, 2): their derivatives along direction k
    (a direction of p = (omega, gamma, x0, v0)).
    """
    omega, gamma = p[0], p[1]
    h = t_end / steps
    k = directions.shape[0]
    x, v = p[2], p[3]
    dx, dv = directions[:, 2].copy(), directions[:, 3].copy()
    dom, dga = directions[:, 0], directions[:, 1]
    for _ in range(steps):
        # the stages of (x, v) ...
        a1, b1 = v, -2 * gamma * v - omega * omega * x
        x2, v2 = x + 0.5 * h * a1, v + 0.5 * h * b1
        a2, b2 = v2, -2 * gamma * v2 - omega * omega * x2
        x3, v3 = x + 0.5 * h * a2, v + 0.5 * h * b2
        a3, b3 = v3, -2 * gamma * v3 - omega * omega * x3
        x4, v4 = x + h * a3, v + h * b3
        a4, b4 = v4, -2 * gamma * v4 - omega * omega * x4
        # ... and of each tangent (the derivative of every stage)
        for j in range(k):
            c1, d1 = dv[j], -2 * gamma * dv[j] - 2 * dga[j] * v - omega * omega * dx[j] - 2 * omega * dom[j] * x
            ex, ev = dx[j] + 0.5 * h * c1, dv[j] + 0.5 * h * d1
            c2, d2 = ev, -2 * gamma * ev - 2 * dga[j] * v2 - omega * omega * ex - 2 * omega * dom[j] * x2
            ex, ev = dx[j] + 0.5 * h * c2, dv[j] + 0.5 * h * d2
            c3, d3 = ev, -2 * gamma * ev - 2 * dga[j] * v3 - omega * omega * ex - 2 * omega * dom[j] * x3
            ex, ev = dx[j] + h * c3, dv[j] + h * d3
            c4, d4 = ev, -2 * gamma * ev - 2 * dga[j] * v4 - omega * omega * ex - 2 * omega * dom[j] * x4
            dx[j] += h / 6 * (c1 + 2 * c2 + 2 * c3 + c4)
            dv[j] += h / 6 * (d1 + 2 * d2 + 2 * d3 + d4)
        x += h / 6 * (a1 + 2 * a2 + 2 * a3 + a4)
        v += h / 6 * (b1 + 2 * b2 + 2 * b3 + b4)
    state[0], state[1] = x, v
    for j in range(k):
        tangents[j, 0], tangents[j, 1] = dx[j], dv[j]


@jaxbind.numba_kernel
def oscillator(out, args, kwargs):
    """(p,) -> (x, v) at t_end."""
    p = args[0]
    if p[0] <= 0.0:
        raise ValueError("oscillator: omega must be positive")
    integrate(p, np.zeros((0, 4)), kwargs.t_end, kwargs.steps, out[0], np.zeros((0, 2)))


@jaxbind.numba_kernel
def oscillator_jvp(out, args, kwargs):
    """(p, dp) -> the tangent of (x, v)."""
    p, dp = args
    tangents = np.empty((1, 2))
    integrate(p, dp.reshape(1, 4), kwargs.t_end, kwargs.steps, np.empty(2), tangents)
    out[0][0], out[0][1] = tangents[0, 0], tangents[0, 1]


@jaxbind.numba_kernel
def oscillator_vjp(out, args, kwargs):
    """(p, ct) -> J^T ct, J (2 x 4) from the four parameter directions."""
    p, ct = args
    jacobian_t = np.empty((4, 2))  # row j: d(x, v) / d p_j
    integrate(p, np.eye(4), kwargs.t_end, kwargs.steps, np.empty(2), jacobian_t)
    for j in range(4):
        out[0][j] = jacobian_t[j, 0] * ct[0] + jacobian_t[j, 1] * ct[1]


def abstract(p, *tangents, **kwargs):
    return (((2,), p.dtype),)


def abstract_reverse(p, ct, **kwargs):
    return ((p.shape, p.dtype),)


op = jaxbind.get_nonlinear_call(oscillator, (oscillator_jvp, oscillator_vjp), abstract, abstract_reverse)


def model(p):
    return op(p, t_end=T_END, steps=STEPS)[0]


# ---------------------------------------------------------------------------
# The reference: the same RK4 in jax.numpy
# ---------------------------------------------------------------------------


def reference(p):
    omega, gamma = p[0], p[1]
    h = T_END / STEPS

    def f(y):
        return jnp.stack([y[1], -2 * gamma * y[1] - omega**2 * y[0]])

    def step(_, y):
        k1 = f(y)
        k2 = f(y + 0.5 * h * k1)
        k3 = f(y + 0.5 * h * k2)
        k4 = f(y + h * k3)
        return y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)

    return jax.lax.fori_loop(0, STEPS, step, p[2:])


def main():
    rng = np.random.default_rng(0)
    n = 64
    params = jnp.asarray(
        np.column_stack(
            [rng.uniform(0.5, 3.0, n), rng.uniform(0.0, 0.4, n), rng.standard_normal(n), rng.standard_normal(n)]
        )
    )
    p = params[0]

    started = time.perf_counter()
    check("one element", jax.jit(model)(p), jax.jit(reference)(p), rtol=1e-11)
    batched, batched_ref = jax.jit(jax.vmap(model)), jax.jit(jax.vmap(reference))
    check(f"jit(vmap) over {n} elements (the walk on every core)", batched(params), batched_ref(params), rtol=1e-11)
    dp = jnp.asarray(rng.standard_normal(4))
    check("jvp", jax.jvp(model, (p,), (dp,)), jax.jvp(reference, (p,), (dp,)), rtol=1e-10)

    def loss(f):
        return lambda ps: jnp.sum(jnp.sin(jax.vmap(f)(ps)))

    check(
        "jit(grad) of a loss over the batch",
        jax.jit(jax.grad(loss(model)))(params),
        jax.jit(jax.grad(loss(reference)))(params),
        rtol=1e-9,
        atol=1e-12,
    )
    check("jacfwd (vmap of the jvp)", jax.jacfwd(model)(p), jax.jacfwd(reference)(p), rtol=1e-9)
    op_check("check_op", op, p, t_end=T_END, steps=STEPS)
    bad = params.at[5, 0].set(-1.0)  # a negative omega: the kernel raises
    try:
        jax.block_until_ready(batched(bad))
        message = "no error"
    except (RuntimeError, ValueError) as err:  # (which of the two is JAX's choice)
        message = str(err).splitlines()[0]
    ok = "op 'oscillator'" in message and "ValueError: oscillator: omega must be positive" in message
    print(f"{'OK  ' if ok else 'FAIL'} {'a kernel that raises: an error naming the op':50s} {message[:100]}")
    if not ok:
        failures.append("a kernel that raises")
    print(f"(the checks above compiled the kernels and ran in {time.perf_counter() - started:.1f} s)")

    # The walk spreads the 64 elements over XLA's threads: against the same calls one after
    # the other in a fori_loop (information only, not checked: timings vary).
    loop = jax.jit(lambda ps: jax.lax.fori_loop(0, n, lambda i, out: out.at[i].set(model(ps[i])), jnp.zeros((n, 2))))
    check("the same 64 calls in a fori_loop", loop(params), batched(params), rtol=1e-14)
    times = {}
    for name, fn in (("vmap", batched), ("fori_loop", loop)):
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(fn(params))
            samples.append(time.perf_counter() - start)
        times[name] = min(samples)
    print(
        f"{n} elements on {os.cpu_count()} cores: vmap {1e3 * times['vmap']:.1f} ms, "
        f"64 calls in a fori_loop {1e3 * times['fori_loop']:.1f} ms "
        f"(ratio {times['vmap'] / times['fori_loop']:.2f})"
    )
    finish()


if __name__ == "__main__":
    main()

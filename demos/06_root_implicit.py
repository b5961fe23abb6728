"""Demo 6: a nonlinear system solved by MINPACK, differentiated by the implicit function theorem.

What you learn here
-------------------
* how a black-box solver (``scipy.optimize.root``, MINPACK's ``hybrj``) becomes
  a JAX op of its parameters;
* how **residuals** carry what the derivatives need from the forward solve: the
  solution and an LU factorization of the Jacobian ``dF/du`` at it
  (LAPACK's ``getrf``: the factors, float64, and the pivots, int32).
  The derivatives are then one triangular solve each, by the implicit function
  theorem, never a second nonlinear solve:

      F(u; lam, f) = 0   =>   du = J^-1 (exp(u) dlam + df),   J = dF/du,

  and the vjp solves with ``J^T`` (LAPACK's ``getrs`` with ``trans=1``). The
  LAPACK routines are called directly (``scipy.linalg.lapack``): they do the same
  as ``scipy.linalg.lu_factor``/``lu_solve`` without their input checks, which
  here would cost more than the triangular solves themselves;
* that it vmaps over parameters (one solve per batch element) and differentiates
  under vmap.

The system: the Bratu problem ``-u'' = lam exp(u) + f`` on (0, 1), ``u = 0``
at both ends, with second-order finite differences on ``n`` interior points:

    F(u) = A u / h**2 - lam exp(u) - f = 0,    A = tridiag(-1, 2, -1).

Checks: the solution against a Newton iteration written in jax.numpy, the
jvp, grad and Jacobians against JAX differentiating that Newton iteration and
against central finite differences of the MINPACK solve, vmap against a loop,
and the solve counts.
"""

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
import scipy.linalg
import scipy.optimize
from _checks import check, finish, op_check

import jaxbind

N = 16
H = 1.0 / (N + 1)
A = (2 * np.eye(N) - np.eye(N, k=1) - np.eye(N, k=-1)) / H**2
SOLVES = {"forward": 0}  # MINPACK runs made by the op


def residual(u, lam, f):
    return A @ u - lam * np.exp(u) - f


def jacobian(u, lam):
    return A - lam * np.diag(np.exp(u))


def minpack_solve(lam, f):
    """The root of F by MINPACK's hybrj (Powell's hybrid method, with the Jacobian)."""
    result = scipy.optimize.root(
        residual, np.zeros(N), args=(lam, f), jac=lambda u, lam, f: jacobian(u, lam), method="hybr", tol=1e-13
    )
    if not result.success:
        raise RuntimeError(f"MINPACK did not converge: {result.message}")
    return result.x


# ---------------------------------------------------------------------------
# The op: (lam, f) -> u; residuals: u, the LU factors of J, the pivots (int32)
# ---------------------------------------------------------------------------


def lu_factor(matrix):
    lu, pivots, info = scipy.linalg.lapack.dgetrf(matrix)
    if info != 0:
        raise np.linalg.LinAlgError(f"dF/du is singular at the solution (getrf info {info})")
    return lu, pivots


def lu_solve(lu, pivots, rhs, trans=0):
    x, info = scipy.linalg.lapack.dgetrs(lu, pivots, rhs, trans=trans)
    if info != 0:
        raise ValueError(f"getrs failed (info {info})")
    return x


def bratu(out, args, kwargs_dump):
    lam, f = args
    SOLVES["forward"] += 1
    u = minpack_solve(float(lam), f)
    lu, pivots = lu_factor(jacobian(u, float(lam)))
    out[0][...] = u  # the output
    out[1][...] = u  # residuals: the solution, ...
    out[2][...] = lu  # ... the LU factors of dF/du at it ...
    out[3][...] = pivots  # ... and the pivots (int32)


def bratu_jvp(out, args, kwargs_dump):
    lam, f, u, lu, pivots, d_lam, d_f = args  # primals, residuals, tangents
    out[0][...] = lu_solve(lu, pivots, np.exp(u) * d_lam + d_f)


def bratu_vjp(out, args, kwargs_dump):
    lam, f, u, lu, pivots, u_ct = args  # primals, residuals, cotangent
    w = lu_solve(lu, pivots, u_ct, trans=1)  # J^T w = u_ct
    out[0][...] = np.exp(u) @ w  # cotangent of lam
    out[1][...] = w  # cotangent of f


def bratu_abstract(lam, f):
    n = f.shape[0]
    return (((n,), f.dtype), ((n,), f.dtype), ((n, n), f.dtype), ((n,), np.int32))


def bratu_abstract_reverse(lam, f, u, lu, pivots, u_ct):
    return ((lam.shape, lam.dtype), (f.shape, f.dtype))


bratu_op = jaxbind.get_nonlinear_call(
    bratu, (bratu_jvp, bratu_vjp), bratu_abstract, bratu_abstract_reverse, n_residuals=3, name="bratu"
)


def solve(lam, f):
    return bratu_op(lam, f)[0]


# ---------------------------------------------------------------------------
# The references
# ---------------------------------------------------------------------------


def newton_jnp(lam, f, steps=30):
    """Newton's method in jax.numpy: JAX differentiates it through its steps."""
    A_j = jnp.asarray(A)
    u = jnp.zeros(N)
    for _ in range(steps):
        F = A_j @ u - lam * jnp.exp(u) - f
        u = u - jnp.linalg.solve(A_j - lam * jnp.diag(jnp.exp(u)), F)
    return u


def central_differences(fun, x, eps=1e-6):
    """Columns d fun / d x_i of a function of a float64 vector (or scalar)."""
    x = np.atleast_1d(np.asarray(x, float))
    columns = []
    for i in range(x.size):
        e = np.zeros_like(x)
        e[i] = eps
        columns.append((fun((x + e).reshape(np.shape(x))) - fun((x - e).reshape(np.shape(x)))) / (2 * eps))
    return np.stack(columns, axis=-1)


def main():
    rng = np.random.default_rng(0)
    grid = np.linspace(H, 1 - H, N)
    lam = np.float64(1.5)
    f = 2.0 * np.sin(np.pi * grid) + 0.1 * rng.standard_normal(N)

    # 1. The solution
    u = solve(lam, f)
    check("u vs Newton in jax.numpy", u, newton_jnp(lam, f), rtol=1e-10, atol=1e-12)
    check("F(u) = 0", residual(np.asarray(u), lam, f), np.zeros(N), atol=1e-8)

    # 2. Derivatives: jvp, grad, Jacobians
    d_lam, d_f = np.float64(0.3), rng.standard_normal(N)
    check(
        "jvp vs jax.numpy Newton",
        jax.jvp(solve, (lam, f), (d_lam, d_f)),
        jax.jvp(newton_jnp, (lam, f), (d_lam, d_f)),
        rtol=1e-9,
        atol=1e-10,
    )

    def loss(lam, f, solver):
        return jnp.sum(jnp.sin(solver(lam, f)) * grid)

    SOLVES["forward"] = 0
    g = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(lam, f, solve)
    check("jit(grad) makes one MINPACK solve", SOLVES["forward"], 1)
    check("grad vs jax.numpy Newton", g, jax.grad(loss, argnums=(0, 1))(lam, f, newton_jnp), rtol=1e-9, atol=1e-10)
    minpack_loss = lambda lam, f: float(np.sum(np.sin(minpack_solve(float(lam), f)) * grid))
    check(
        "d loss / d lam vs finite differences (MINPACK)",
        np.atleast_1d(g[0]),
        central_differences(lambda x: minpack_loss(x[0], f), [lam]),
        rtol=1e-6,
        atol=1e-7,
    )
    check(
        "d loss / d f vs finite differences (MINPACK)",
        g[1],
        central_differences(lambda x: minpack_loss(lam, x), f),
        rtol=1e-6,
        atol=1e-7,
    )

    SOLVES["forward"] = 0
    jac_f = jax.jacrev(solve, argnums=1)(lam, f)
    check("jacrev makes one MINPACK solve", SOLVES["forward"], 1)
    check(
        "d u / d f (jacrev) vs finite differences (MINPACK)",
        jac_f,
        central_differences(lambda x: minpack_solve(float(lam), x), f),
        rtol=1e-6,
        atol=1e-7,
    )
    check("jacfwd == jacrev", jax.jacfwd(solve, argnums=1)(lam, f), jac_f, rtol=1e-12, atol=1e-13)

    # 3. vmap over parameters: one MINPACK solve per element, and derivatives under vmap
    lams = np.linspace(0.5, 2.5, 5)
    fs = f + 0.5 * rng.standard_normal((5, N))
    SOLVES["forward"] = 0
    us = jax.vmap(solve)(lams, fs)
    check("vmap makes one MINPACK solve per element", SOLVES["forward"], 5)
    check("vmap vs a loop", us, np.stack([solve(lam, x) for lam, x in zip(lams, fs)]), rtol=1e-14, atol=1e-14)
    check("vmap vs jax.numpy Newton", us, jax.vmap(newton_jnp)(lams, fs), rtol=1e-10, atol=1e-12)
    batched_grad = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, 0, None)), static_argnums=2)
    SOLVES["forward"] = 0
    got = batched_grad(lams, fs, solve)
    check("jit(vmap(grad)) makes one solve per element", SOLVES["forward"], 5)
    check("jit(vmap(grad)) vs jax.numpy Newton", got, batched_grad(lams, fs, newton_jnp), rtol=1e-9, atol=1e-10)
    check(
        "vmap over lam only (f shared)",
        jax.vmap(solve, in_axes=(0, None))(lams, f),
        jax.vmap(newton_jnp, in_axes=(0, None))(lams, f),
        rtol=1e-10,
        atol=1e-12,
    )

    # 4. The op checker: abstract, unwritten outputs, jvp vs finite differences, vjp vs jvp, vmap, jit
    op_check("check_op", bratu_op, lam, f)
    finish()


if __name__ == "__main__":
    main()

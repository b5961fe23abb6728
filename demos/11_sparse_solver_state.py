"""Demo 11: a sparse solve differentiated with its factorization kept (``setup=``).

What you learn here
-------------------
* how an op's **setup** makes a solver's state once (here SciPy's sparse LU,
  ``scipy.sparse.linalg.splu``, a ``SuperLU`` object, which no array can hold)
  and hands it to the forward solve and to every derivative: ``jit(value_and_grad)``
  factorizes once, ``jax.jacrev`` over several outputs once, a repeated call on
  the same coefficients not at all;
* that the kept factorization is a cache, never the owner of a result: with the
  states dropped (``setup_cache`` too small, another process) every value is the
  same, the factorization is only made again.

The problem: ``-div(k grad u) = 1`` on the unit square, ``u = 0`` on its boundary,
a coefficient ``k`` per cell of an ``n x n`` grid (five-point finite volumes, the
arithmetic mean of ``k`` across each cell face). The matrix is linear in ``k``,
``A(k) = sum_m k_m A_m``, so with ``u = A(k)^-1 b``:

    du = -A^-1 A(dk) u              (jvp: one solve with the kept factors)
    dk_m = -lam^T A_m u,  A^T lam = u_bar    (vjp: one solve with the kept factors)

Checks: the solution, the gradient and a Jacobian against the same problem written
in ``jax.numpy`` with a dense solve and differentiated by JAX, the gradient
against central finite differences, the number of factorizations under each
transformation, and the time of ``jit(value_and_grad)`` against the forward solve.
"""

import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
import scipy.sparse.linalg as spla
from _checks import check, failures, finish, op_check

import jaxbind


class Poisson:
    """The finite-volume matrix A(k) of an n x n grid, assembled from its faces."""

    def __init__(self, n: int):
        self.n = n
        cells = np.arange(n * n).reshape(n, n)
        # interior faces: (cell, neighbour) pairs, right and up
        self.left = np.concatenate([cells[:, :-1].ravel(), cells[:-1, :].ravel()])
        self.right = np.concatenate([cells[:, 1:].ravel(), cells[1:, :].ravel()])
        # boundary faces: one per cell side on the border (a cell in a corner has two)
        border = np.concatenate([cells[0, :], cells[-1, :], cells[:, 0], cells[:, -1]])
        self.border = border
        self.rhs = np.full(n * n, 1.0 / n**2)

    def matrix(self, k: np.ndarray) -> sp.csc_matrix:
        face = 0.5 * (k[self.left] + k[self.right])
        rows = np.concatenate([self.left, self.right, self.left, self.right, self.border])
        cols = np.concatenate([self.left, self.right, self.right, self.left, self.border])
        values = np.concatenate([face, face, -face, -face, k[self.border]])
        return sp.csc_matrix((values, (rows, cols)), shape=(self.n**2, self.n**2))

    def coefficient_gradient(self, lam: np.ndarray, u: np.ndarray) -> np.ndarray:
        """lam^T A_m u for every m: A(k) is linear in k."""
        du, dl = u[self.left] - u[self.right], lam[self.left] - lam[self.right]
        grad = np.zeros(self.n**2)
        np.add.at(grad, self.left, 0.5 * dl * du)
        np.add.at(grad, self.right, 0.5 * dl * du)
        np.add.at(grad, self.border, lam[self.border] * u[self.border])
        return grad


FACTORIZATIONS = {"count": 0}


def poisson_op(grid: Poisson, setup_cache: int = 8):
    """The op k -> u with the factorization of A(k) made once per k, by setup."""

    def factorize(args, kwargs):
        FACTORIZATIONS["count"] += 1
        return spla.splu(grid.matrix(args[0]))

    def solve(out, args, kwargs_dump, lu):
        out[0][...] = lu.solve(grid.rhs)

    def solve_jvp(out, args, kwargs_dump, lu):  # (k, dk) -> du
        u = lu.solve(grid.rhs)
        out[0][...] = -lu.solve(grid.matrix(args[1]) @ u)

    def solve_vjp(out, args, kwargs_dump, lu):  # (k, u_bar) -> k_bar
        u = lu.solve(grid.rhs)
        lam = lu.solve(np.asarray(args[1]), trans="T")
        out[0][...] = -grid.coefficient_gradient(lam, u)

    def abstract(k, *tangent):
        return ((k.shape, k.dtype),)

    return jaxbind.get_nonlinear_call(
        solve,
        (solve_jvp, solve_vjp),
        abstract,
        abstract,
        setup=factorize,
        setup_cache=setup_cache,
        name="poisson_solve",
    )


def dense_solve(grid: Poisson, k):
    """The same solve in jax.numpy (a dense matrix): JAX differentiates it."""
    face = 0.5 * (k[grid.left] + k[grid.right])
    a = jnp.zeros((grid.n**2, grid.n**2))
    a = a.at[grid.left, grid.left].add(face).at[grid.right, grid.right].add(face)
    a = a.at[grid.left, grid.right].add(-face).at[grid.right, grid.left].add(-face)
    a = a.at[grid.border, grid.border].add(k[grid.border])
    return jnp.linalg.solve(a, grid.rhs)


def loss(solve):
    return lambda k: jnp.sum(solve(k) ** 2)


def seconds(fn, *args):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main():
    # -----------------------------------------------------------------------
    # Against the dense solve, on a small grid
    # -----------------------------------------------------------------------
    small = Poisson(12)
    op = poisson_op(small)
    k = jnp.asarray(np.random.default_rng(0).uniform(0.5, 2.0, small.n**2))
    solve = lambda k: op(k)[0]
    reference = lambda k: dense_solve(small, k)

    value, grad = jax.jit(jax.value_and_grad(loss(solve)))(k)
    check("jit(value_and_grad) vs dense solve", (value, grad), jax.value_and_grad(loss(reference))(k))
    print(f"factorizations for jit(value_and_grad): {FACTORIZATIONS['count']}")
    if FACTORIZATIONS["count"] != 1:
        failures.append("one factorization for the forward and the vjp")
    check("solution vs dense solve", solve(k), reference(k))
    print(f"factorizations after a call at the same k: {FACTORIZATIONS['count']}")

    # central finite differences of the loss along a random direction
    direction = np.random.default_rng(1).standard_normal(small.n**2)
    step = 1e-6
    fd = (loss(solve)(k + step * direction) - loss(solve)(k - step * direction)) / (2 * step)
    check("grad vs finite differences", jnp.dot(grad, direction), fd, rtol=1e-6, atol=1e-12)

    FACTORIZATIONS["count"] = 0
    rows = jnp.array([0, 13, 40, 77, 100, 121, 130, 143])  # 8 outputs of u
    jacobian = jax.jacrev(lambda k: solve(k)[rows])(k + 1.0)
    check("jacrev of 8 outputs vs dense solve", jacobian, jax.jacrev(lambda k: reference(k)[rows])(k + 1.0))
    print(f"factorizations for jacrev over 8 outputs: {FACTORIZATIONS['count']}")
    if FACTORIZATIONS["count"] != 1:
        failures.append("one factorization for jacrev")

    FACTORIZATIONS["count"] = 0
    _, tangent = jax.jvp(solve, (k,), (jnp.asarray(direction),))
    check("jvp vs dense solve", tangent, jax.jvp(reference, (k,), (jnp.asarray(direction),))[1])
    print(f"factorizations for a jvp at a point already factorized: {FACTORIZATIONS['count']}")

    # with no state kept between the forward and the vjp, the same values
    forgetful = poisson_op(small, setup_cache=1)
    solve_forgetful = lambda k: forgetful(k)[0]
    _, pullback = jax.vjp(solve_forgetful, k)
    solve_forgetful(k + 1.0)  # another state takes the only place: the pullback makes k's again
    ones = jnp.ones(small.n**2)
    check("vjp after its state was evicted", pullback(ones), jax.vjp(reference, k)[1](ones))
    op_check("check_op (with the state kept and made again)", op, k)

    # -----------------------------------------------------------------------
    # The cost of the gradient, on a grid whose factorization takes a while
    # -----------------------------------------------------------------------

    large = Poisson(128)
    big_op = poisson_op(large)
    k_large = jnp.asarray(np.random.default_rng(2).uniform(0.5, 2.0, large.n**2))
    forward = jax.jit(lambda k: jnp.sum(big_op(k)[0] ** 2))
    gradient = jax.jit(jax.value_and_grad(lambda k: jnp.sum(big_op(k)[0] ** 2)))
    forward(k_large), gradient(k_large)  # compiled (and factorized once)
    # a new k each time (a new factorization), the two taking turns; the fastest of each
    perturbed = [k_large * (1 + 1e-3 * i) for i in range(1, 7)]
    times = [(seconds(forward, a), seconds(gradient, b)) for a, b in zip(perturbed[0::2], perturbed[1::2])]
    t_forward, t_gradient = (min(column) for column in zip(*times))
    print(
        f"{large.n}x{large.n} grid ({large.n**2} unknowns): forward {1e3 * t_forward:.0f} ms, "
        f"jit(value_and_grad) {1e3 * t_gradient:.0f} ms: {t_gradient / t_forward:.2f}x the forward solve"
    )

    finish()


if __name__ == "__main__":
    main()

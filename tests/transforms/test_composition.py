"""Ops inside JAX's other transformations and control flow: remat, linearize, jacobians, scan, cond, while."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind


def x_sin_x(out, args, kwargs_dump):
    np.multiply(np.sin(args[0]), args[0], out=out[0])


def x_sin_x_derivative(out, args, kwargs_dump):  # jvp and vjp: the Jacobian is diagonal
    x, v = args
    out[0][...] = (np.cos(x) * x + np.sin(x)) * v


def like_first(x, *rest, **kwargs):
    return ((x.shape, x.dtype),)


op = jaxbind.get_nonlinear_call(x_sin_x, (x_sin_x_derivative, x_sin_x_derivative), like_first, like_first)


def bound(x):
    return op(x)[0]


def reference(x):
    return jnp.sin(x) * x


def loop3_scan(f):
    return lambda x: jax.lax.scan(lambda c, _: (f(c), None), x, None, length=3)[0]


def loop3_while(f):
    return lambda x: jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (f(c[0]), c[1] + 1), (x, 0))[0]


def cond(f):
    return lambda x: jax.lax.cond(x[0] > 0, f, lambda v: -v, x)


CASES = {
    "checkpoint grad": lambda f: jax.grad(jax.checkpoint(lambda x: f(x).sum())),
    "linearize": lambda f: lambda x: jax.linearize(f, x)[1](jnp.cos(x)),
    "jacfwd": jax.jacfwd,
    "jacrev": jax.jacrev,
    "scan": loop3_scan,
    "grad of scan": lambda f: jax.grad(lambda x: loop3_scan(f)(x).sum()),
    "cond": cond,
    "grad of cond": lambda f: jax.grad(lambda x: cond(f)(x).sum()),
    "while": loop3_while,
    "vmap of jacrev": lambda f: jax.vmap(jax.jacrev(f)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_composition_matches_jax_numpy(name):
    x = jnp.linspace(0.1, 2.0, 5)
    if name.startswith("vmap"):
        x = jnp.stack([x, x + 1.0])
    transform = CASES[name]
    np.testing.assert_allclose(jax.jit(transform(bound))(x), transform(reference)(x), rtol=1e-12, atol=1e-12)


def test_callback_may_itself_run_jax():
    # A callback that runs JAX computations of its own, from XLA's worker thread
    # too (the second program has independent work beside the loop).
    def jax_inside(out, args, kwargs_dump):
        out[0][...] = np.asarray(jnp.sin(jnp.asarray(args[0])))

    inner = jaxbind.get_nonlinear_call(jax_inside, (x_sin_x_derivative, x_sin_x_derivative), like_first, like_first)
    x = jnp.linspace(0.0, 1.0, 3)
    np.testing.assert_allclose(jax.jit(lambda v: inner(v)[0])(x), np.sin(x), rtol=1e-12)
    side = jnp.linspace(0.0, 1.0, 1 << 16)
    looped, total = jax.jit(lambda v, s: (jax.lax.fori_loop(0, 3, lambda i, c: inner(c)[0], v), jnp.sum(jnp.sin(s))))(
        x, side
    )
    np.testing.assert_allclose(looped, np.sin(np.sin(np.sin(x))), rtol=1e-12)
    np.testing.assert_allclose(total, np.sin(np.asarray(side)).sum(), rtol=1e-10)

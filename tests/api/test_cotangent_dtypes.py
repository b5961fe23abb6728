"""Cotangents take the dtype of their primal, whatever dtype a transpose's abstract declares."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxbind

FACTOR = 1.5 - 0.5j


def rotate(out, args, kwargs_dump):
    out[0][...] = FACTOR * args[0]


def to_complex(x, **kwargs):
    return ((x.shape, np.complex128),)


def test_real_input_complex_output_gradient_is_real():
    op = jaxbind.get_linear_call(rotate, rotate, to_complex, to_complex)
    x = jnp.linspace(-1.0, 2.0, 4)

    def loss(v, f):
        y = f(v)
        return jnp.sum(jnp.imag(y) * jnp.arange(4.0) + jnp.real(y) ** 2)

    got = jax.grad(loss)(x, lambda v: op(v)[0])
    want = jax.grad(loss)(x, lambda v: FACTOR * v)
    assert got.dtype == jnp.float64
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_transpose_declaring_a_wider_dtype_is_cast_back():
    def double(out, args, kwargs_dump):
        out[0][...] = 2 * args[0]

    def same(x, **kwargs):
        return ((x.shape, x.dtype),)

    def as_float64(ct, **kwargs):
        return ((ct.shape, np.float64),)

    op = jaxbind.get_linear_call(double, double, same, as_float64)
    x = jnp.arange(3, dtype=jnp.float32)
    g = jax.grad(lambda v: jnp.sum(op(v)[0] * v))(x)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, 4 * np.arange(3, dtype=np.float32))

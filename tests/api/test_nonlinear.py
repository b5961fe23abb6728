"""Nonlinear jaxbind ops: a forward callback plus its jvp and vjp callbacks.

- ``sin_exp(a, x) = sin(x) * exp(a)`` with ``a`` a fixed argument
  (``first_n_args_fixed=1``): only ``x`` is differentiated;
- ``product_and_sine(x, y) = (x * y, sin(x) + y**2)``: two differentiable
  inputs, two outputs.

``f_jvp`` receives ``(*primals, *tangents of the non-fixed args)``, ``f_vjp``
``(*primals, *output cotangents)``. Both functions are holomorphic, so for
complex dtypes the vjp multiplies by the derivative without conjugation.
Derivatives are first order only: asking for a second-order derivative is an
error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import squared_norm, two_dtypes

import jaxbind

# ---------------------------------------------------------------------------
# The ops
# ---------------------------------------------------------------------------


def sin_exp(out, args, kwargs_dump):
    a, x = args
    out[0][...] = np.sin(x) * np.exp(a)


def sin_exp_jvp(out, args, kwargs_dump):
    a, x, x_dot = args  # primals, then the tangent of x (a is fixed)
    out[0][...] = np.cos(x) * np.exp(a) * x_dot


def sin_exp_vjp(out, args, kwargs_dump):
    a, x, y_ct = args  # primals, then the output cotangent
    out[0][...] = y_ct * np.cos(x) * np.exp(a)


def sin_exp_abstract(a, x, *x_dot):
    # describes the outputs of sin_exp(a, x) and of sin_exp_jvp(a, x, x_dot)
    return ((x.shape, np.result_type(a.dtype, x.dtype)),)


def sin_exp_abstract_reverse(a, x, y_ct):
    return ((x.shape, np.result_type(a.dtype, x.dtype)),)


sin_exp_op = jaxbind.get_nonlinear_call(
    sin_exp, (sin_exp_jvp, sin_exp_vjp), sin_exp_abstract, sin_exp_abstract_reverse, first_n_args_fixed=1
)


def apply_sin_exp(a, x):
    return sin_exp_op(a, x)[0]


def sin_exp_reference(a, x):
    return jnp.sin(x) * jnp.exp(a)


def product_and_sine(out, args, kwargs_dump):
    x, y = args
    out[0][...] = x * y
    out[1][...] = np.sin(x) + y**2


def product_and_sine_jvp(out, args, kwargs_dump):
    x, y, x_dot, y_dot = args
    out[0][...] = y * x_dot + x * y_dot
    out[1][...] = np.cos(x) * x_dot + 2 * y * y_dot


def product_and_sine_vjp(out, args, kwargs_dump):
    x, y, u_ct, v_ct = args
    out[0][...] = y * u_ct + np.cos(x) * v_ct  # cotangent of x
    out[1][...] = x * u_ct + 2 * y * v_ct  # cotangent of y


def product_and_sine_abstract(x, y, *tangents):
    dtype = np.result_type(x.dtype, y.dtype)
    return ((x.shape, dtype), (x.shape, dtype))


def product_and_sine_abstract_reverse(x, y, u_ct, v_ct):
    return ((x.shape, x.dtype), (y.shape, y.dtype))


product_and_sine_op = jaxbind.get_nonlinear_call(
    product_and_sine,
    (product_and_sine_jvp, product_and_sine_vjp),
    product_and_sine_abstract,
    product_and_sine_abstract_reverse,
)


def apply_product_and_sine(x, y):
    u, v = product_and_sine_op(x, y)
    return u, v


def product_and_sine_reference(x, y):
    return x * y, jnp.sin(x) + y**2


# ---------------------------------------------------------------------------
# sin_exp: one fixed and one differentiable argument
# ---------------------------------------------------------------------------


@pytest.fixture
def a_x(rand, dtype):
    return 0.3 * rand(4, dtype=dtype), rand(4, dtype=dtype)


def test_sin_exp_eager_and_jit(a_x, dtype, tol):
    a, x = a_x
    for fn in (apply_sin_exp, jax.jit(apply_sin_exp)):
        y = fn(a, x)
        assert y.dtype == dtype
        np.testing.assert_allclose(y, np.sin(x) * np.exp(a), **tol)


def test_sin_exp_jvp(a_x, rand, dtype, tol):
    a, x = a_x
    t = rand(4, dtype=dtype)
    y, y_dot = jax.jvp(lambda x: apply_sin_exp(a, x), (x,), (t,))
    np.testing.assert_allclose(y, np.sin(x) * np.exp(a), **tol)
    np.testing.assert_allclose(y_dot, np.cos(x) * np.exp(a) * t, **tol)


def test_sin_exp_vjp(a_x, rand, dtype, tol):
    a, x = a_x
    y_ct = rand(4, dtype=dtype)
    y, pullback = jax.vjp(lambda x: apply_sin_exp(a, x), x)
    (x_ct,) = pullback(y_ct)
    np.testing.assert_allclose(y, np.sin(x) * np.exp(a), **tol)
    np.testing.assert_allclose(x_ct, y_ct * np.cos(x) * np.exp(a), **tol)  # no conj


def test_sin_exp_grad_matches_jnp(a_x, tol):
    a, x = a_x
    grad = jax.grad(lambda x: squared_norm(apply_sin_exp(a, x)))(x)
    expected = jax.jit(jax.grad(lambda x: squared_norm(sin_exp_reference(a, x))))(x)
    np.testing.assert_allclose(grad, expected, **tol)


def test_sin_exp_jit_of_grad(a_x, tol):
    a, x = a_x

    def loss(a, x, f):
        return squared_norm(f(a, x))

    grad = jax.jit(jax.grad(loss, argnums=1), static_argnums=2)
    np.testing.assert_allclose(grad(a, x, apply_sin_exp), grad(a, x, sin_exp_reference), **tol)


def test_sin_exp_check_grads_first_order(a_x, check_grads):
    a, x = a_x
    check_grads(lambda x: apply_sin_exp(a, x), (x,), order=1, modes=("fwd", "rev"))


@pytest.mark.parametrize("in_axis", [0, 1, -1])
def test_sin_exp_vmap_over_x(rand, dtype, tol, in_axis):
    a = 0.3 * rand(4, dtype=dtype)
    xs = rand(5, 4, dtype=dtype) if in_axis == 0 else rand(4, 5, dtype=dtype)
    ys = jax.vmap(apply_sin_exp, in_axes=(None, in_axis))(a, xs)
    expected = jax.vmap(sin_exp_reference, in_axes=(None, in_axis))(a, xs)
    assert ys.shape == (5, 4)
    np.testing.assert_allclose(ys, expected, **tol)


def test_sin_exp_vmap_over_fixed_argument_only_with_out_axes(rand, dtype, tol):
    a_s, x = 0.3 * rand(5, 4, dtype=dtype), rand(4, dtype=dtype)
    ys = jax.vmap(apply_sin_exp, in_axes=(0, None), out_axes=1)(a_s, x)
    assert ys.shape == (4, 5)
    np.testing.assert_allclose(ys, (np.sin(x) * np.exp(a_s)).T, **tol)


@two_dtypes
def test_sin_exp_nested_vmap(rand, dtype, tol):
    a_s = 0.3 * rand(4, 6, dtype=dtype)  # batched at the outer level (axis 1)
    xs = rand(3, 4, dtype=dtype)  # batched at the inner level (axis 0)

    def nested(f):
        return jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(1, None))

    ys = nested(apply_sin_exp)(a_s, xs)
    assert ys.shape == (6, 3, 4)
    np.testing.assert_allclose(ys, jax.jit(nested(sin_exp_reference))(a_s, xs), **tol)
    np.testing.assert_allclose(jax.jit(nested(apply_sin_exp))(a_s, xs), ys, **tol)


@two_dtypes
def test_sin_exp_vmap_of_grad(rand, dtype, tol):
    a_s, xs = 0.3 * rand(5, 4, dtype=dtype), rand(4, 5, dtype=dtype)

    def loss(a, x, f):
        return squared_norm(f(a, x))

    vmapped_grad = jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, 1, None))
    grads = vmapped_grad(a_s, xs, apply_sin_exp)
    expected = jax.jit(vmapped_grad, static_argnums=2)(a_s, xs, sin_exp_reference)
    np.testing.assert_allclose(grads, expected, **tol)
    jitted = jax.jit(vmapped_grad, static_argnums=2)(a_s, xs, apply_sin_exp)
    np.testing.assert_allclose(jitted, expected, **tol)


@two_dtypes
def test_sin_exp_vmap_of_grad_with_unbatched_x(rand, dtype, tol):
    a_s, x = 0.3 * rand(5, 4, dtype=dtype), rand(4, dtype=dtype)

    def loss(a, x, f):
        return squared_norm(f(a, x))

    vmapped_grad = jax.jit(jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None, None)), static_argnums=2)
    grads = vmapped_grad(a_s, x, apply_sin_exp)
    assert grads.shape == (5, 4)
    np.testing.assert_allclose(grads, vmapped_grad(a_s, x, sin_exp_reference), **tol)


@two_dtypes
@pytest.mark.parametrize("in_axes", [(None, 0), (0, None), (0, 1)])
def test_sin_exp_grad_of_vmap(rand, dtype, tol, in_axes):
    shapes = {0: (5, 4), 1: (4, 5), None: (4,)}
    a = 0.3 * rand(*shapes[in_axes[0]], dtype=dtype)
    x = rand(*shapes[in_axes[1]], dtype=dtype)

    def loss(x, a, f):
        return squared_norm(jax.vmap(f, in_axes=in_axes)(a, x))

    grad = jax.grad(loss)(x, a, apply_sin_exp)  # eager
    expected = jax.jit(jax.grad(loss), static_argnums=2)(x, a, sin_exp_reference)
    assert grad.shape == x.shape
    np.testing.assert_allclose(grad, expected, **tol)


# The error tests use plain float64 data (they are not dtype-parametrized).
A_FIXED, X_POINT = np.full(4, 0.1), np.linspace(0.0, 1.0, 4)


def test_sin_exp_second_order_is_an_error():
    a, x = A_FIXED, X_POINT

    def loss(x):
        return jnp.sum(apply_sin_exp(a, x))

    with pytest.raises(ValueError, match=r"sin_exp.*second-order"):
        jax.hessian(loss)(x)
    with pytest.raises(ValueError, match=r"sin_exp.*second-order"):
        jax.grad(lambda x: jnp.sum(jax.grad(loss)(x)))(x)


def test_sin_exp_forward_over_forward_is_an_error():
    a, x = A_FIXED, X_POINT

    def first_derivative(x):
        return jax.jvp(lambda x: apply_sin_exp(a, x), (x,), (x,))[1]

    with pytest.raises(ValueError, match=r"sin_exp.*second-order"):
        jax.jvp(first_derivative, (x,), (x,))


def test_sin_exp_derivative_wrt_fixed_argument_is_an_error():
    a, x = A_FIXED, X_POINT
    with pytest.raises(ValueError, match=r"sin_exp.*fixed"):
        jax.jvp(lambda a: apply_sin_exp(a, x), (a,), (a,))
    with pytest.raises(ValueError, match=r"sin_exp.*fixed"):
        jax.grad(lambda a: jnp.sum(apply_sin_exp(a, x)))(a)


# ---------------------------------------------------------------------------
# product_and_sine: two inputs, two outputs
# ---------------------------------------------------------------------------


@pytest.fixture
def x_y(rand, dtype):
    return rand(4, dtype=dtype), rand(4, dtype=dtype)


def test_product_and_sine_eager_and_jit(x_y, tol):
    x, y = x_y
    for fn in (apply_product_and_sine, jax.jit(apply_product_and_sine)):
        u, v = fn(x, y)
        np.testing.assert_allclose(u, x * y, **tol)
        np.testing.assert_allclose(v, np.sin(x) + y**2, **tol)


def test_product_and_sine_jvp(x_y, rand, dtype, tol):
    x, y = x_y
    tx, ty = rand(4, dtype=dtype), rand(4, dtype=dtype)
    _, (u_dot, v_dot) = jax.jvp(apply_product_and_sine, (x, y), (tx, ty))
    np.testing.assert_allclose(u_dot, y * tx + x * ty, **tol)
    np.testing.assert_allclose(v_dot, np.cos(x) * tx + 2 * y * ty, **tol)
    # only x varies: the tangent of y is a symbolic zero
    _, (u_dot, v_dot) = jax.jvp(lambda x: apply_product_and_sine(x, y), (x,), (tx,))
    np.testing.assert_allclose(u_dot, y * tx, **tol)
    np.testing.assert_allclose(v_dot, np.cos(x) * tx, **tol)


def test_product_and_sine_vjp(x_y, rand, dtype, tol):
    x, y = x_y
    u_ct, v_ct = rand(4, dtype=dtype), rand(4, dtype=dtype)
    _, pullback = jax.vjp(apply_product_and_sine, x, y)
    x_ct, y_ct = pullback((u_ct, v_ct))
    np.testing.assert_allclose(x_ct, y * u_ct + np.cos(x) * v_ct, **tol)
    np.testing.assert_allclose(y_ct, x * u_ct + 2 * y * v_ct, **tol)
    # only v is used: u's cotangent is a symbolic zero
    _, pullback = jax.vjp(lambda x, y: apply_product_and_sine(x, y)[1], x, y)
    x_ct, y_ct = pullback(v_ct)
    np.testing.assert_allclose(x_ct, np.cos(x) * v_ct, **tol)
    np.testing.assert_allclose(y_ct, 2 * y * v_ct, **tol)


def test_product_and_sine_grad_matches_jnp(x_y, tol):
    def loss(x, y, f):
        u, v = f(x, y)
        return squared_norm(u) + squared_norm(v * u)

    grads = jax.grad(loss, argnums=(0, 1))(*x_y, apply_product_and_sine)
    expected = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(*x_y, product_and_sine_reference)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g, e, **tol)


def test_product_and_sine_check_grads_first_order(x_y, check_grads):
    check_grads(apply_product_and_sine, x_y, order=1, modes=("fwd", "rev"))


@pytest.mark.parametrize("in_axes", [(0, 0), (1, None), (None, -1)])
def test_product_and_sine_vmap(rand, dtype, tol, in_axes):
    shapes = {0: (3, 4), 1: (4, 3), -1: (4, 3), None: (4,)}
    x = rand(*shapes[in_axes[0]], dtype=dtype)
    y = rand(*shapes[in_axes[1]], dtype=dtype)
    u, v = jax.vmap(apply_product_and_sine, in_axes=in_axes)(x, y)
    ur, vr = jax.vmap(product_and_sine_reference, in_axes=in_axes)(x, y)
    assert u.shape == v.shape == (3, 4)
    np.testing.assert_allclose(u, ur, **tol)
    np.testing.assert_allclose(v, vr, **tol)


@two_dtypes
@pytest.mark.parametrize("in_axes", [(0, None), (None, 1)])
def test_product_and_sine_grad_of_vmap(rand, dtype, tol, in_axes):
    shapes = {0: (3, 4), 1: (4, 3), None: (4,)}
    x = rand(*shapes[in_axes[0]], dtype=dtype)
    y = rand(*shapes[in_axes[1]], dtype=dtype)

    def loss(x, y, f):
        u, v = jax.vmap(f, in_axes=in_axes)(x, y)
        return squared_norm(u + 2 * v)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    for g, e in zip(grads(x, y, apply_product_and_sine), grads(x, y, product_and_sine_reference)):
        np.testing.assert_allclose(g, e, **tol)


@two_dtypes
def test_product_and_sine_nested_vmap_of_grad(rand, dtype, tol):
    xs = rand(2, 4, 3, dtype=dtype)  # batched at both levels (axes 0 and 2)
    y = rand(4, dtype=dtype)  # batched at neither

    def loss(x, y, f):
        u, v = f(x, y)
        return squared_norm(u - v)

    def nested(f):
        per_element = jax.grad(loss, argnums=(0, 1))
        inner = jax.vmap(per_element, in_axes=(1, None, None))
        return jax.vmap(inner, in_axes=(0, None, None))(xs, y, f)

    grads = nested(apply_product_and_sine)
    expected = jax.jit(nested, static_argnums=0)(product_and_sine_reference)
    for g, e in zip(grads, expected):
        assert g.shape == (2, 3, 4)
        np.testing.assert_allclose(g, e, **tol)


def test_product_and_sine_second_order_is_an_error():
    x, y = X_POINT, X_POINT + 1

    def loss(x, y):
        u, v = apply_product_and_sine(x, y)
        return jnp.sum(u + v)

    with pytest.raises(ValueError, match=r"product_and_sine.*second-order"):
        jax.hessian(loss, argnums=(0, 1))(x, y)

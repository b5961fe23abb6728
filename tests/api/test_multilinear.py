"""Multilinear jaxbind ops: ``f_T`` is a tuple with one transpose per argument.

- ``multiply(x, y) = x * y`` (elementwise);
- ``matmul(X, Y) = X @ Y``, where the two transposes differ in shape;
- ``bilinear_form(M, x, y) = x @ M @ y`` (a scalar), with the matrix ``M`` as
  a fixed argument (``first_n_args_fixed=1``).

The ``i``-th transpose receives every argument except the ``i``-th (fixed
ones included, in order), then the output cotangents, and writes the
cotangent of argument ``i``. As for linear ops, transposes are not
conjugated.
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


def multiply(out, args, kwargs_dump):
    x, y = args
    out[0][...] = x * y


def multiply_T_x(out, args, kwargs_dump):
    y, z_ct = args  # everything but x, then the output cotangent
    out[0][...] = z_ct * y


def multiply_T_y(out, args, kwargs_dump):
    x, z_ct = args  # everything but y, then the output cotangent
    out[0][...] = x * z_ct


def elementwise_abstract(a, b):
    return ((a.shape, np.result_type(a.dtype, b.dtype)),)


multiply_op = jaxbind.get_linear_call(
    multiply, (multiply_T_x, multiply_T_y), elementwise_abstract, (elementwise_abstract, elementwise_abstract)
)


def apply_multiply(x, y):
    return multiply_op(x, y)[0]


def matmul(out, args, kwargs_dump):
    X, Y = args
    out[0][...] = X @ Y


def matmul_T_X(out, args, kwargs_dump):
    Y, Z_ct = args
    out[0][...] = Z_ct @ Y.T


def matmul_T_Y(out, args, kwargs_dump):
    X, Z_ct = args
    out[0][...] = X.T @ Z_ct


def matmul_abstract(X, Y):
    return (((X.shape[0], Y.shape[1]), np.result_type(X.dtype, Y.dtype)),)


def matmul_T_X_abstract(Y, Z_ct):
    return (((Z_ct.shape[0], Y.shape[0]), np.result_type(Y.dtype, Z_ct.dtype)),)


def matmul_T_Y_abstract(X, Z_ct):
    return (((X.shape[1], Z_ct.shape[1]), np.result_type(X.dtype, Z_ct.dtype)),)


matmul_op = jaxbind.get_linear_call(
    matmul, (matmul_T_X, matmul_T_Y), matmul_abstract, (matmul_T_X_abstract, matmul_T_Y_abstract)
)


def apply_matmul(X, Y):
    return matmul_op(X, Y)[0]


def bilinear_form(out, args, kwargs_dump):
    M, x, y = args
    out[0][...] = x @ M @ y


def bilinear_form_T_x(out, args, kwargs_dump):
    M, y, ct = args  # the fixed M, the other linear argument, the cotangent
    out[0][...] = ct * (M @ y)


def bilinear_form_T_y(out, args, kwargs_dump):
    M, x, ct = args
    out[0][...] = ct * (x @ M)


def bilinear_form_abstract(M, x, y):
    return (((), np.result_type(M.dtype, x.dtype, y.dtype)),)


def bilinear_form_T_x_abstract(M, y, ct):
    return (((M.shape[0],), np.result_type(M.dtype, y.dtype, ct.dtype)),)


def bilinear_form_T_y_abstract(M, x, ct):
    return (((M.shape[1],), np.result_type(M.dtype, x.dtype, ct.dtype)),)


bilinear_form_op = jaxbind.get_linear_call(
    bilinear_form,
    (bilinear_form_T_x, bilinear_form_T_y),
    bilinear_form_abstract,
    (bilinear_form_T_x_abstract, bilinear_form_T_y_abstract),
    first_n_args_fixed=1,
)


def apply_bilinear_form(M, x, y):
    return bilinear_form_op(M, x, y)[0]


# ---------------------------------------------------------------------------
# multiply
# ---------------------------------------------------------------------------


@pytest.fixture
def x_y(rand, dtype):
    return rand(5, dtype=dtype), rand(5, dtype=dtype)


def test_multiply_eager_and_jit(x_y, dtype, tol):
    x, y = x_y
    for fn in (apply_multiply, jax.jit(apply_multiply)):
        z = fn(x, y)
        assert z.dtype == dtype
        np.testing.assert_allclose(z, x * y, **tol)


def test_multiply_jvp(x_y, rand, dtype, tol):
    x, y = x_y
    tx, ty = rand(5, dtype=dtype), rand(5, dtype=dtype)
    z, z_dot = jax.jvp(apply_multiply, (x, y), (tx, ty))  # product rule
    np.testing.assert_allclose(z, x * y, **tol)
    np.testing.assert_allclose(z_dot, tx * y + x * ty, **tol)
    _, z_dot = jax.jvp(lambda x: apply_multiply(x, y), (x,), (tx,))
    np.testing.assert_allclose(z_dot, tx * y, **tol)
    _, z_dot = jax.jvp(lambda y: apply_multiply(x, y), (y,), (ty,))
    np.testing.assert_allclose(z_dot, x * ty, **tol)


def test_multiply_vjp(x_y, rand, dtype, tol):
    x, y = x_y
    z_ct = rand(5, dtype=dtype)
    _, pullback = jax.vjp(apply_multiply, x, y)
    x_ct, y_ct = pullback(z_ct)
    np.testing.assert_allclose(x_ct, z_ct * y, **tol)  # y, not conj(y)
    np.testing.assert_allclose(y_ct, z_ct * x, **tol)


def test_multiply_linear_transpose_in_one_argument(x_y, rand, dtype, tol):
    x, y = x_y
    z_ct = rand(5, dtype=dtype)
    (x_ct,) = jax.linear_transpose(lambda x: apply_multiply(x, y), x)(z_ct)
    np.testing.assert_allclose(x_ct, z_ct * y, **tol)
    (y_ct,) = jax.linear_transpose(lambda y: apply_multiply(x, y), y)(z_ct)
    np.testing.assert_allclose(y_ct, z_ct * x, **tol)


def test_multiply_linear_transpose_in_both_arguments_is_an_error(x_y):
    # x * y is bilinear, not jointly linear in (x, y)
    with pytest.raises(ValueError, match="multilinear"):
        jax.linear_transpose(apply_multiply, *x_y)(x_y[0])


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_multiply_grad_matches_jnp(x_y, tol, argnums):
    def loss(x, y, mul):
        return squared_norm(mul(x, y) + x)

    grad = jax.grad(loss, argnums=argnums)(*x_y, apply_multiply)
    expected = jax.jit(jax.grad(loss, argnums=argnums), static_argnums=2)(*x_y, jnp.multiply)
    for g, e in zip(jax.tree.leaves(grad), jax.tree.leaves(expected)):
        np.testing.assert_allclose(g, e, **tol)


def test_multiply_check_grads_second_order(x_y, check_grads):
    check_grads(apply_multiply, x_y, order=2, modes=("fwd", "rev"))


@two_dtypes
def test_multiply_hessian(x_y, dtype, tol):
    # f(x, y) = sum((x * y)^2): holomorphic, so complex dtypes work too
    def f(x, y, mul):
        return jnp.sum(mul(x, y) ** 2)

    hessian = jax.hessian(f, argnums=(0, 1), holomorphic=dtype.kind == "c")
    result = jax.jit(hessian, static_argnums=2)(*x_y, apply_multiply)
    expected = jax.jit(hessian, static_argnums=2)(*x_y, jnp.multiply)
    for r, e in zip(jax.tree.leaves(result), jax.tree.leaves(expected)):
        np.testing.assert_allclose(r, e, **tol)
    # the mixed block: d2f/dxdy = diag(4 x y)
    x, y = x_y
    np.testing.assert_allclose(result[0][1], np.diag(4 * x * y), **tol)


@pytest.mark.parametrize("in_axes", [(0, 0), (0, None), (None, 1), (1, -1)])
def test_multiply_vmap(rand, dtype, tol, in_axes):
    shapes = {0: (3, 5), 1: (5, 3), -1: (5, 3), None: (5,)}
    x = rand(*shapes[in_axes[0]], dtype=dtype)
    y = rand(*shapes[in_axes[1]], dtype=dtype)
    z = jax.vmap(apply_multiply, in_axes=in_axes)(x, y)
    expected = jax.vmap(jnp.multiply, in_axes=in_axes)(x, y)
    assert z.shape == (3, 5)
    np.testing.assert_allclose(z, expected, **tol)


@two_dtypes
@pytest.mark.parametrize("in_axes", [(0, None), (None, 1), (1, 0)])
def test_multiply_grad_of_vmap(rand, dtype, tol, in_axes):
    shapes = {0: (3, 5), 1: (5, 3), None: (5,)}
    x = rand(*shapes[in_axes[0]], dtype=dtype)
    y = rand(*shapes[in_axes[1]], dtype=dtype)

    def loss(x, y, mul):
        return squared_norm(jax.vmap(mul, in_axes=in_axes)(x, y) - 1)

    grads = jax.grad(loss, argnums=(0, 1))(x, y, apply_multiply)
    expected = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x, y, jnp.multiply)
    for g, e in zip(grads, expected):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, **tol)


@two_dtypes
def test_multiply_vmap_of_grad_with_unbatched_argument(rand, dtype, tol):
    xs, y = rand(3, 5, dtype=dtype), rand(5, dtype=dtype)

    def loss(x, y, mul):
        return squared_norm(mul(x, y) + y)

    vmapped = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None, None))
    grads = jax.jit(vmapped, static_argnums=2)(xs, y, apply_multiply)
    expected = jax.jit(vmapped, static_argnums=2)(xs, y, jnp.multiply)
    for g, e in zip(grads, expected):
        assert g.shape == (3, 5)
        np.testing.assert_allclose(g, e, **tol)


@two_dtypes
def test_multiply_nested_vmap_mixed_batching(rand, dtype, tol):
    x = rand(5, 4, dtype=dtype)  # batched at the outer level (axis 1)
    y = rand(3, 5, dtype=dtype)  # batched at the inner level (axis 0)

    def nested(mul):
        inner = jax.vmap(mul, in_axes=(None, 0))
        return jax.vmap(inner, in_axes=(1, None))

    z = nested(apply_multiply)(x, y)
    assert z.shape == (4, 3, 5)
    np.testing.assert_allclose(z, np.einsum("ja,bj->abj", x, y), **tol)
    # and its vjp: each argument's cotangent is summed over the level at which
    # it is broadcast
    z_ct = rand(4, 3, 5, dtype=dtype)
    _, pullback = jax.vjp(nested(apply_multiply), x, y)
    x_ct, y_ct = pullback(z_ct)
    np.testing.assert_allclose(x_ct, np.einsum("abj,bj->ja", z_ct, y), **tol)
    np.testing.assert_allclose(y_ct, np.einsum("abj,ja->bj", z_ct, x), **tol)


# ---------------------------------------------------------------------------
# matmul: transposes of different shapes
# ---------------------------------------------------------------------------


@pytest.fixture
def X_Y(rand, dtype):
    return rand(2, 3, dtype=dtype), rand(3, 4, dtype=dtype)


def test_matmul_eager_jvp_vjp(X_Y, rand, dtype, tol):
    X, Y = X_Y
    tX, tY, Z_ct = rand(2, 3, dtype=dtype), rand(3, 4, dtype=dtype), rand(2, 4, dtype=dtype)
    np.testing.assert_allclose(apply_matmul(X, Y), X @ Y, **tol)
    _, Z_dot = jax.jvp(apply_matmul, (X, Y), (tX, tY))
    np.testing.assert_allclose(Z_dot, tX @ Y + X @ tY, **tol)
    _, pullback = jax.vjp(apply_matmul, X, Y)
    X_ct, Y_ct = pullback(Z_ct)
    np.testing.assert_allclose(X_ct, Z_ct @ Y.T, **tol)
    np.testing.assert_allclose(Y_ct, X.T @ Z_ct, **tol)


def test_matmul_check_grads(X_Y, check_grads):
    check_grads(apply_matmul, X_Y, order=2, modes=("fwd", "rev"))


@two_dtypes
def test_matmul_jit_grad_of_vmap_with_shared_right_factor(rand, dtype, tol):
    Xs, Y = rand(6, 2, 3, dtype=dtype), rand(3, 4, dtype=dtype)

    def loss(Xs, Y, mm):
        return squared_norm(jax.vmap(mm, in_axes=(0, None))(Xs, Y))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
    for g, e in zip(grad(Xs, Y, apply_matmul), grad(Xs, Y, jnp.matmul)):
        np.testing.assert_allclose(g, e, **tol)


# ---------------------------------------------------------------------------
# bilinear_form: x @ M @ y with a fixed M
# ---------------------------------------------------------------------------


@pytest.fixture
def M_x_y(rand, dtype):
    return rand(3, 4, dtype=dtype), rand(3, dtype=dtype), rand(4, dtype=dtype)


def test_bilinear_form_eager_and_jit(M_x_y, dtype, tol):
    M, x, y = M_x_y
    for fn in (apply_bilinear_form, jax.jit(apply_bilinear_form)):
        value = fn(M, x, y)
        assert value.shape == () and value.dtype == dtype
        np.testing.assert_allclose(value, x @ M @ y, **tol)


def test_bilinear_form_jvp_and_vjp(M_x_y, rand, dtype, tol):
    M, x, y = M_x_y
    tx, ty = rand(3, dtype=dtype), rand(4, dtype=dtype)
    ct = rand(dtype=dtype)  # a scalar cotangent
    _, value_dot = jax.jvp(lambda x, y: apply_bilinear_form(M, x, y), (x, y), (tx, ty))
    np.testing.assert_allclose(value_dot, tx @ M @ y + x @ M @ ty, **tol)
    _, pullback = jax.vjp(lambda x, y: apply_bilinear_form(M, x, y), x, y)
    x_ct, y_ct = pullback(ct)
    np.testing.assert_allclose(x_ct, ct * (M @ y), **tol)
    np.testing.assert_allclose(y_ct, ct * (M.T @ x), **tol)


def test_bilinear_form_check_grads(M_x_y, check_grads):
    M, x, y = M_x_y
    check_grads(lambda x, y: apply_bilinear_form(M, x, y), (x, y), order=2, modes=("fwd", "rev"))


@two_dtypes
def test_bilinear_form_hessian(M_x_y, dtype, tol):
    M, x, y = M_x_y
    hessian = jax.hessian(lambda x, y: apply_bilinear_form(M, x, y), argnums=(0, 1), holomorphic=dtype.kind == "c")
    ((hxx, hxy), (hyx, hyy)) = jax.jit(hessian)(x, y)
    np.testing.assert_allclose(hxx, np.zeros((3, 3)), **tol)
    np.testing.assert_allclose(hxy, M, **tol)
    np.testing.assert_allclose(hyx, M.T, **tol)
    np.testing.assert_allclose(hyy, np.zeros((4, 4)), **tol)


@two_dtypes
def test_bilinear_form_vmap_over_fixed_argument_and_grad(rand, dtype, tol):
    Ms = rand(5, 3, 4, dtype=dtype)
    x, y = rand(3, dtype=dtype), rand(4, dtype=dtype)
    values = jax.vmap(apply_bilinear_form, in_axes=(0, None, None))(Ms, x, y)
    np.testing.assert_allclose(values, np.einsum("i,bij,j->b", x, Ms, y), **tol)

    # the cotangents of the unbatched x and y are summed over the batch
    def total(x, y):
        return jnp.sum(jax.vmap(apply_bilinear_form, in_axes=(0, None, None))(Ms, x, y))

    holomorphic = dtype.kind == "c"
    x_grad, y_grad = jax.grad(total, argnums=(0, 1), holomorphic=holomorphic)(x, y)
    np.testing.assert_allclose(x_grad, np.einsum("bij,j->i", Ms, y), **tol)
    np.testing.assert_allclose(y_grad, np.einsum("i,bij->j", x, Ms), **tol)


@two_dtypes
def test_bilinear_form_vmap_of_grad(rand, dtype, tol):
    M = rand(3, 4, dtype=dtype)
    xs, ys = rand(5, 3, dtype=dtype), rand(4, 5, dtype=dtype)

    def loss(x, y):
        return squared_norm(apply_bilinear_form(M, x, y))

    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, 1)))(xs, ys)
    reference = jax.vmap(jax.grad(lambda x, y: squared_norm(x @ M @ y), argnums=(0, 1)), in_axes=(0, 1))
    expected = jax.jit(reference)(xs, ys)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g, e, **tol)


def test_bilinear_form_grad_wrt_fixed_argument_is_an_error(M_x_y):
    M, x, y = M_x_y
    with pytest.raises(ValueError, match=r"bilinear_form.*fixed"):
        jax.grad(lambda M: squared_norm(apply_bilinear_form(M, x, y)))(M)

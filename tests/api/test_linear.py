"""Linear jaxbind ops under every JAX transformation.

Three example ops, each a NumPy callback plus its transpose:

- ``matvec(A, x) = A @ x`` with the matrix ``A`` as a fixed argument
  (``first_n_args_fixed=1``): linear in ``x`` only;
- ``scale(x, factor=c) = c * x`` with a static (keyword) complex factor;
- ``mix(x1, x2) = (x1 + 2 x2, 3 x1)``: two linear arguments, two outputs,
  jointly linear.

Every result is compared with the same computation written in jax.numpy or
NumPy. Transposes follow JAX's convention: the linear transpose, not the
adjoint, so there is no complex conjugation anywhere.
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


def matvec(out, args, kwargs_dump):
    A, x = args
    out[0][...] = A @ x


def matvec_T(out, args, kwargs_dump):
    A, y_ct = args  # the fixed args, then the output cotangents
    out[0][...] = A.T @ y_ct  # transpose, not adjoint: no conj


def matvec_abstract(A, x):
    return (((A.shape[0],), np.result_type(A.dtype, x.dtype)),)


def matvec_T_abstract(A, y_ct):
    return (((A.shape[1],), np.result_type(A.dtype, y_ct.dtype)),)


matvec_op = jaxbind.get_linear_call(matvec, matvec_T, matvec_abstract, matvec_T_abstract, first_n_args_fixed=1)


def apply_matvec(A, x):
    """``A @ x`` through the jaxbind op (ops return a list of outputs)."""
    (y,) = matvec_op(A, x)
    return y


def scale(out, args, kwargs_dump):
    factor = jaxbind.load_kwargs(kwargs_dump)["factor"]
    out[0][...] = factor * args[0]


def scale_abstract(x, *, factor):
    return ((x.shape, x.dtype),)


# scale is its own transpose (c * . is symmetric)
scale_op = jaxbind.get_linear_call(scale, scale, scale_abstract, scale_abstract)


def apply_scale(x, factor):
    return scale_op(x, factor=factor)[0]


def mix(out, args, kwargs_dump):
    x1, x2 = args
    out[0][...] = x1 + 2 * x2
    out[1][...] = 3 * x1


def mix_T(out, args, kwargs_dump):
    y1_ct, y2_ct = args
    out[0][...] = y1_ct + 3 * y2_ct  # cotangent of x1
    out[1][...] = 2 * y1_ct  # cotangent of x2


def mix_abstract(a, b):
    return ((a.shape, a.dtype), (b.shape, b.dtype))


mix_op = jaxbind.get_linear_call(mix, mix_T, mix_abstract, mix_abstract)


def mix_reference(x1, x2):
    return x1 + 2 * x2, 3 * x1


def factor_for(dtype):
    return 2.5 - 1.5j if dtype.kind == "c" else 2.5


# ---------------------------------------------------------------------------
# matvec: a fixed matrix and one linear argument
# ---------------------------------------------------------------------------


@pytest.fixture
def A(rand, dtype):
    return rand(3, 4, dtype=dtype)


@pytest.fixture
def x(rand, dtype):
    return rand(4, dtype=dtype)


def test_matvec_eager(A, x, dtype, tol):
    y = apply_matvec(A, x)
    assert y.shape == (3,) and y.dtype == dtype
    np.testing.assert_allclose(y, A @ x, **tol)


def test_matvec_jit(A, x, dtype, tol):
    y = jax.jit(apply_matvec)(A, x)
    assert y.dtype == dtype
    np.testing.assert_allclose(y, A @ x, **tol)


def test_matvec_jvp(A, x, rand, dtype, tol):
    t = rand(4, dtype=dtype)
    y, y_dot = jax.jvp(lambda x: apply_matvec(A, x), (x,), (t,))
    np.testing.assert_allclose(y, A @ x, **tol)
    np.testing.assert_allclose(y_dot, A @ t, **tol)


def test_matvec_vjp(A, x, rand, dtype, tol):
    y_ct = rand(3, dtype=dtype)
    y, pullback = jax.vjp(lambda x: apply_matvec(A, x), x)
    (x_ct,) = pullback(y_ct)
    np.testing.assert_allclose(y, A @ x, **tol)
    np.testing.assert_allclose(x_ct, A.T @ y_ct, **tol)


def test_matvec_linear_transpose_has_no_conjugation(A, x, rand, dtype, tol):
    y_ct = rand(3, dtype=dtype)
    transpose = jax.linear_transpose(lambda x: apply_matvec(A, x), x)
    (x_ct,) = transpose(y_ct)
    np.testing.assert_allclose(x_ct, A.T @ y_ct, **tol)
    # the same as JAX's own transpose of A @ x
    (x_ct_jax,) = jax.linear_transpose(lambda x: A @ x, x)(y_ct)
    np.testing.assert_allclose(x_ct, x_ct_jax, **tol)


def test_matvec_grad_matches_jnp(A, x, tol):
    grad = jax.grad(lambda x: squared_norm(apply_matvec(A, x)))(x)
    expected = jax.grad(lambda x: squared_norm(A @ x))(x)
    np.testing.assert_allclose(grad, expected, **tol)


def test_matvec_jit_of_grad(A, x, tol):
    grad = jax.jit(jax.grad(lambda x: squared_norm(apply_matvec(A, x))))(x)
    expected = jax.grad(lambda x: squared_norm(A @ x))(x)
    np.testing.assert_allclose(grad, expected, **tol)


def test_matvec_check_grads_second_order(A, x, check_grads):
    check_grads(lambda x: apply_matvec(A, x), (x,), order=2, modes=("fwd", "rev"))


@two_dtypes
def test_matvec_hessian(A, x, dtype, tol):
    # sum((A x)^2) = x^T A^T A x is holomorphic, so this works for complex
    # dtypes too (no conjugation: the Hessian is 2 A^T A).
    def f(x):
        return jnp.sum(apply_matvec(A, x) ** 2)

    hessian = jax.jit(jax.hessian(f, holomorphic=dtype.kind == "c"))(x)
    np.testing.assert_allclose(hessian, 2 * A.T @ A, **tol)


def test_matvec_grad_wrt_fixed_argument_is_an_error(A, x):
    with pytest.raises(ValueError, match=r"matvec.*fixed"):
        jax.grad(lambda A: squared_norm(apply_matvec(A, x)))(A)


def test_matvec_jvp_wrt_fixed_argument_is_an_error(A, x):
    with pytest.raises(ValueError, match=r"matvec.*fixed"):
        jax.jvp(lambda A: apply_matvec(A, x), (A,), (A,))


# --- vmap -------------------------------------------------------------------


@pytest.mark.parametrize("in_axis", [0, 1, -1])
def test_matvec_vmap_over_x(A, rand, dtype, tol, in_axis):
    xs = rand(4, 5, dtype=dtype) if in_axis != 0 else rand(5, 4, dtype=dtype)
    ys = jax.vmap(apply_matvec, in_axes=(None, in_axis))(A, xs)
    columns = xs if in_axis != 0 else xs.T  # shape (4, 5): one x per column
    np.testing.assert_allclose(ys, (A @ columns).T, **tol)


def test_matvec_vmap_out_axes(A, rand, dtype, tol):
    xs = rand(5, 4, dtype=dtype)
    ys = jax.vmap(apply_matvec, in_axes=(None, 0), out_axes=1)(A, xs)
    assert ys.shape == (3, 5)
    np.testing.assert_allclose(ys, A @ xs.T, **tol)


def test_matvec_vmap_over_A_only(rand, x, dtype, tol):
    As = rand(5, 3, 4, dtype=dtype)
    ys = jax.vmap(apply_matvec, in_axes=(0, None))(As, x)
    np.testing.assert_allclose(ys, np.einsum("bij,j->bi", As, x), **tol)


def test_matvec_vmap_over_A_and_x_on_different_axes(rand, dtype, tol):
    As = rand(3, 4, 5, dtype=dtype)  # batch axis last
    xs = rand(5, 4, dtype=dtype)  # batch axis first
    ys = jax.vmap(apply_matvec, in_axes=(2, 0))(As, xs)
    np.testing.assert_allclose(ys, np.einsum("ijb,bj->bi", As, xs), **tol)


def test_matvec_nested_vmap(A, rand, dtype, tol):
    # inner vmap over axis 1 of its input, outer over axis 2 of the full array
    xs = rand(4, 6, 5, dtype=dtype)  # x index, inner batch (6), outer batch (5)
    inner = jax.vmap(apply_matvec, in_axes=(None, 1))
    ys = jax.vmap(inner, in_axes=(None, 2))(A, xs)
    assert ys.shape == (5, 6, 3)
    np.testing.assert_allclose(ys, np.einsum("ij,jab->bai", A, xs), **tol)


def test_matvec_nested_vmap_jit(A, rand, dtype, tol):
    As = rand(5, 3, 4, dtype=dtype)  # batched at the outer level only
    xs = rand(4, 6, dtype=dtype)  # batched at the inner level only
    inner = jax.vmap(apply_matvec, in_axes=(None, 1))
    ys = jax.jit(jax.vmap(inner, in_axes=(0, None)))(As, xs)
    np.testing.assert_allclose(ys, np.einsum("bij,ja->bai", As, xs), **tol)


@two_dtypes
def test_matvec_vmap_of_grad(A, rand, tol):
    xs = rand(5, 4, dtype=A.dtype)
    grads = jax.jit(jax.vmap(jax.grad(lambda x: squared_norm(apply_matvec(A, x)))))(xs)
    expected = jax.jit(jax.vmap(jax.grad(lambda x: squared_norm(A @ x))))(xs)
    np.testing.assert_allclose(grads, expected, **tol)


@two_dtypes
def test_matvec_grad_of_vmap(A, rand, tol):
    xs = rand(4, 5, dtype=A.dtype)

    def loss(xs, matvec):
        return squared_norm(jax.vmap(matvec, in_axes=(None, 1))(A, xs))

    grad = jax.jit(jax.grad(loss), static_argnums=1)(xs, apply_matvec)
    expected = jax.jit(jax.grad(loss), static_argnums=1)(xs, jnp.matmul)
    np.testing.assert_allclose(grad, expected, **tol)


def test_matvec_grad_wrt_unbatched_x_of_vmap_over_A(rand, x, tol):
    """x is broadcast over the batch of matrices: its cotangent is summed."""
    As = rand(5, 3, 4, dtype=x.dtype)

    def loss(x, matvec):
        return squared_norm(jax.vmap(matvec, in_axes=(0, None))(As, x))

    grad = jax.grad(loss)(x, apply_matvec)
    expected = jax.jit(jax.grad(loss), static_argnums=1)(x, jnp.matmul)
    np.testing.assert_allclose(grad, expected, **tol)
    # and jitted
    np.testing.assert_allclose(jax.jit(jax.grad(loss), static_argnums=1)(x, apply_matvec), expected, **tol)


def test_matvec_grad_wrt_unbatched_x_of_nested_vmap(rand, x, tol):
    """Broadcast over two levels, mapped at none of them: summed over both."""
    As = rand(2, 5, 3, 4, dtype=x.dtype)
    ys_ct = rand(2, 5, 3, dtype=x.dtype)

    def batched(matvec):
        return lambda x: jax.vmap(jax.vmap(matvec, in_axes=(0, None)), in_axes=(0, None))(As, x)

    _, pullback = jax.vjp(batched(apply_matvec), x)
    (x_ct,) = pullback(ys_ct)
    np.testing.assert_allclose(x_ct, np.einsum("abij,abi->j", As, ys_ct), **tol)


def test_matvec_vmap_of_jvp_with_unbatched_tangent(A, rand, dtype, tol):
    xs = rand(5, 4, dtype=dtype)
    t = rand(4, dtype=dtype)  # the same tangent for every batch element

    def jvp_at(x):
        return jax.jvp(lambda x: apply_matvec(A, x), (x,), (t,))

    ys, ys_dot = jax.vmap(jvp_at)(xs)
    np.testing.assert_allclose(ys, xs @ A.T, **tol)
    np.testing.assert_allclose(ys_dot, np.broadcast_to(A @ t, (5, 3)), **tol)


def test_matvec_linear_transpose_of_vmap(A, rand, dtype, tol):
    xs = rand(5, 4, dtype=dtype)
    ys_ct = rand(3, 5, dtype=dtype)
    f = jax.vmap(lambda x: apply_matvec(A, x), in_axes=0, out_axes=1)
    (xs_ct,) = jax.linear_transpose(f, xs)(ys_ct)
    np.testing.assert_allclose(xs_ct, (A.T @ ys_ct).T, **tol)


# ---------------------------------------------------------------------------
# scale: a static complex factor, self-transposed
# ---------------------------------------------------------------------------


def test_scale_eager_and_jit(rand, dtype, tol):
    x = rand(6, dtype=dtype)
    c = factor_for(dtype)
    np.testing.assert_allclose(apply_scale(x, c), c * x, **tol)
    jitted = jax.jit(apply_scale, static_argnums=1)
    np.testing.assert_allclose(jitted(x, c), c * x, **tol)
    # a different static factor is a different computation
    np.testing.assert_allclose(jitted(x, 2 * c), 2 * c * x, **tol)


def test_scale_jvp_vjp_transpose(rand, dtype, tol):
    x, t, y_ct = rand(6, dtype=dtype), rand(6, dtype=dtype), rand(6, dtype=dtype)
    c = factor_for(dtype)

    def f(x):
        return apply_scale(x, c)

    _, y_dot = jax.jvp(f, (x,), (t,))
    np.testing.assert_allclose(y_dot, c * t, **tol)
    _, pullback = jax.vjp(f, x)
    np.testing.assert_allclose(pullback(y_ct)[0], c * y_ct, **tol)  # c, not conj(c)
    np.testing.assert_allclose(jax.linear_transpose(f, x)(y_ct)[0], c * y_ct, **tol)


def test_scale_grad_matches_jnp(rand, dtype, tol):
    x = rand(6, dtype=dtype)
    c = factor_for(dtype)
    grad = jax.jit(jax.grad(lambda x: squared_norm(apply_scale(x, c))))(x)
    expected = jax.jit(jax.grad(lambda x: squared_norm(c * x)))(x)
    np.testing.assert_allclose(grad, expected, **tol)


def test_scale_check_grads(rand, dtype, check_grads):
    x = rand(6, dtype=dtype)
    check_grads(lambda x: apply_scale(x, factor_for(dtype)), (x,), order=2, modes=("fwd", "rev"))


@two_dtypes
def test_scale_vmap_and_grad_of_vmap(rand, dtype, tol):
    xs = rand(6, 5, dtype=dtype)
    c = factor_for(dtype)
    f = jax.vmap(lambda x: apply_scale(x, c), in_axes=1, out_axes=1)
    np.testing.assert_allclose(f(xs), c * xs, **tol)
    grad = jax.jit(jax.grad(lambda xs: squared_norm(f(xs))))(xs)
    expected = jax.jit(jax.grad(lambda xs: squared_norm(c * xs)))(xs)
    np.testing.assert_allclose(grad, expected, **tol)


# ---------------------------------------------------------------------------
# mix: two linear arguments, two outputs
# ---------------------------------------------------------------------------


@pytest.fixture
def x1_x2(rand, dtype):
    return rand(4, dtype=dtype), rand(4, dtype=dtype)


def test_mix_eager_and_jit(x1_x2, tol):
    x1, x2 = x1_x2
    for fn in (mix_op, jax.jit(mix_op)):
        y1, y2 = fn(x1, x2)
        r1, r2 = mix_reference(x1, x2)
        np.testing.assert_allclose(y1, r1, **tol)
        np.testing.assert_allclose(y2, r2, **tol)


def test_mix_jvp_in_one_or_both_arguments(x1_x2, rand, dtype, tol):
    x1, x2 = x1_x2
    t1, t2 = rand(4, dtype=dtype), rand(4, dtype=dtype)
    _, (d1, d2) = jax.jvp(lambda a, b: tuple(mix_op(a, b)), (x1, x2), (t1, t2))
    np.testing.assert_allclose(d1, t1 + 2 * t2, **tol)
    np.testing.assert_allclose(d2, 3 * t1, **tol)
    # only x2 varies: the tangent of x1 is a symbolic zero
    _, (d1, d2) = jax.jvp(lambda b: tuple(mix_op(x1, b)), (x2,), (t2,))
    np.testing.assert_allclose(d1, 2 * t2, **tol)
    np.testing.assert_allclose(d2, np.zeros_like(t2), **tol)


def test_mix_vjp_and_linear_transpose(x1_x2, rand, dtype, tol):
    x1, x2 = x1_x2
    c1, c2 = rand(4, dtype=dtype), rand(4, dtype=dtype)
    _, pullback = jax.vjp(lambda a, b: tuple(mix_op(a, b)), x1, x2)
    g1, g2 = pullback((c1, c2))
    np.testing.assert_allclose(g1, c1 + 3 * c2, **tol)
    np.testing.assert_allclose(g2, 2 * c1, **tol)
    g1, g2 = jax.linear_transpose(lambda a, b: tuple(mix_op(a, b)), x1, x2)((c1, c2))
    np.testing.assert_allclose(g1, c1 + 3 * c2, **tol)
    np.testing.assert_allclose(g2, 2 * c1, **tol)


def test_mix_vjp_with_one_zero_cotangent(x1_x2, rand, dtype, tol):
    x1, x2 = x1_x2
    c2 = rand(4, dtype=dtype)
    # only the second output is used: the first output's cotangent is zero
    _, pullback = jax.vjp(lambda a, b: mix_op(a, b)[1], x1, x2)
    g1, g2 = pullback(c2)
    np.testing.assert_allclose(g1, 3 * c2, **tol)
    np.testing.assert_allclose(g2, np.zeros_like(c2), **tol)


def test_mix_grad_matches_jnp(x1_x2, tol):
    x1, x2 = x1_x2

    def loss(a, b, fn):
        y1, y2 = fn(a, b)
        return squared_norm(y1) + squared_norm(y2 * y1)

    grads = jax.grad(loss, argnums=(0, 1))(x1, x2, mix_op)
    expected = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x1, x2, mix_reference)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g, e, **tol)


def test_mix_check_grads(x1_x2, check_grads):
    check_grads(lambda a, b: tuple(mix_op(a, b)), x1_x2, order=2, modes=("fwd", "rev"))


@two_dtypes
def test_mix_hessian(x1_x2, dtype, tol):
    # f = sum(y1 * y2) with y1 = a + 2b, y2 = 3a: f = 3a.a + 6a.b, so
    # d2f/da2 = 6 I, d2f/dadb = 6 I, d2f/db2 = 0.
    def f(a, b):
        y1, y2 = mix_op(a, b)
        return jnp.sum(y1 * y2)

    holomorphic = dtype.kind == "c"
    ((haa, hab), (hba, hbb)) = jax.jit(jax.hessian(f, argnums=(0, 1), holomorphic=holomorphic))(*x1_x2)
    eye = np.eye(4)
    np.testing.assert_allclose(haa, 6 * eye, **tol)
    np.testing.assert_allclose(hab, 6 * eye, **tol)
    np.testing.assert_allclose(hba, 6 * eye, **tol)
    np.testing.assert_allclose(hbb, 0 * eye, **tol)


@two_dtypes
@pytest.mark.parametrize("in_axes", [(0, 0), (0, None), (None, 1), (1, 0)])
def test_mix_vmap(rand, dtype, tol, in_axes):
    shapes = {0: (5, 4), 1: (4, 5), None: (4,)}
    x1 = rand(*shapes[in_axes[0]], dtype=dtype)
    x2 = rand(*shapes[in_axes[1]], dtype=dtype)
    y1, y2 = jax.vmap(lambda a, b: tuple(mix_op(a, b)), in_axes=in_axes)(x1, x2)
    r1, r2 = jax.vmap(mix_reference, in_axes=in_axes)(x1, x2)
    assert y1.shape == y2.shape == (5, 4)
    np.testing.assert_allclose(y1, r1, **tol)
    np.testing.assert_allclose(y2, r2, **tol)


@two_dtypes
@pytest.mark.parametrize("in_axes", [(0, None), (None, 0)])
def test_mix_grad_of_vmap_with_one_unbatched_argument(rand, dtype, tol, in_axes):
    x1 = rand(5, 4, dtype=dtype) if in_axes[0] == 0 else rand(4, dtype=dtype)
    x2 = rand(5, 4, dtype=dtype) if in_axes[1] == 0 else rand(4, dtype=dtype)

    def loss(a, b, fn):
        y1, y2 = jax.vmap(fn, in_axes=in_axes)(a, b)
        return squared_norm(y1) + squared_norm(y1 * y2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x1, x2, mix_op)
    expected = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(x1, x2, mix_reference)
    for g, e in zip(grads, expected):
        assert g.shape == e.shape
        np.testing.assert_allclose(g, e, **tol)


@two_dtypes
def test_mix_vmap_of_grad(rand, dtype, tol):
    x1s, x2s = rand(5, 4, dtype=dtype), rand(4, 5, dtype=dtype)

    def loss(a, b, fn):
        y1, y2 = fn(a, b)
        return squared_norm(y1 - y2)

    vmapped_grad = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, 1, None))
    grads = vmapped_grad(x1s, x2s, mix_op)  # eager
    expected = jax.jit(vmapped_grad, static_argnums=2)(x1s, x2s, mix_reference)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g, e, **tol)


@two_dtypes
def test_mix_nested_vmap_jit(rand, dtype, tol):
    x1 = rand(3, 4, 5, dtype=dtype)  # batched over the 4 (inner) and the 5 (outer)
    x2 = rand(3, dtype=dtype)  # not batched

    def nested(fn):
        inner = jax.vmap(fn, in_axes=(1, None))  # over the 4
        return jax.vmap(inner, in_axes=(2, None))  # over the 5

    y1, y2 = jax.jit(nested(lambda a, b: tuple(mix_op(a, b))))(x1, x2)
    r1, r2 = jax.jit(nested(mix_reference))(x1, x2)
    assert y1.shape == (5, 4, 3)
    np.testing.assert_allclose(y1, r1, **tol)
    np.testing.assert_allclose(y2, r2, **tol)

"""Integer and bool outputs are not differentiable.

Their tangents and cotangents are symbolic zeros (``float0``) and never reach a
callback as such: a nonlinear op's ``f_jvp`` writes the tangents of its inexact
(float, complex) outputs only, in order, and ``f_vjp`` receives the cotangents
of those only (the abstract, where called for a jvp, still describes all of
``f``'s outputs). A linear op's transpose keeps its arguments: zeros of an
integer output's own dtype stand for its cotangent.

The nonlinear op is a solver that also returns how many function evaluations it
made (int32) and whether it converged (bool): the square root by Newton's
method, ``sqrt_counted(c) = (sqrt(c), evaluations, converged)``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import CALLS

import jaxbind

# The callbacks below record their calls in _shared.CALLS, emptied around each test (the calls fixture).
pytestmark = pytest.mark.usefixtures("calls")


def sqrt_counted(out, args, kwargs_dump):
    (c,) = args
    x, evaluations = np.maximum(c, 1.0), 0
    for _ in range(100):
        step = (x * x - c) / (2 * x)
        x, evaluations = x - step, evaluations + 1
        if np.all(np.abs(step) <= 1e-15 * x):
            break
    out[0][...] = x
    out[1][...] = evaluations
    out[2][...] = np.abs(x * x - c) <= 1e-12 * c


def sqrt_counted_jvp(out, args, kwargs_dump):
    c, dc = args
    CALLS.append(("jvp", len(out), [o.dtype for o in out]))
    out[0][...] = dc / (2 * np.sqrt(c))  # the tangent of the float output only


def sqrt_counted_vjp(out, args, kwargs_dump):
    c, x_ct = args  # the cotangent of the float output only
    CALLS.append(("vjp", len(args), [a.dtype for a in args]))
    out[0][...] = x_ct / (2 * np.sqrt(c))


def sqrt_counted_abstract(c, *tangents):
    # describes all of f's outputs, also when called for the jvp
    return ((c.shape, c.dtype), ((), np.int32), (c.shape, np.bool_))


def sqrt_counted_abstract_reverse(c, x_ct):
    return ((c.shape, c.dtype),)


sqrt_op = jaxbind.get_nonlinear_call(
    sqrt_counted, (sqrt_counted_jvp, sqrt_counted_vjp), sqrt_counted_abstract, sqrt_counted_abstract_reverse, name="f"
)


@pytest.fixture
def c(rng):
    return rng.uniform(0.5, 4.0, 5)


def test_grad_through_a_solver_with_an_int32_count(c):
    # Used to raise: "jaxbind op 'f' (vjp callback 'f_vjp'): argument 2 has dtype
    # [('float0', 'V')], which jaxbind cannot pass to a callback."
    loss = lambda c: jnp.sum(jnp.sin(sqrt_op(c)[0]))
    got = jax.grad(loss)(c)
    want = jax.grad(lambda c: jnp.sum(jnp.sin(jnp.sqrt(c))))(c)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(c), want, rtol=1e-12)
    assert CALLS == [("vjp", 2, [np.float64, np.float64])] * 2
    jax.test_util.check_grads(lambda c: sqrt_op(c)[0], (c,), order=1, modes=("fwd", "rev"), eps=1e-6)


def test_grad_of_a_loss_that_uses_the_count(c):
    loss = lambda c: jnp.sum(sqrt_op(c)[0]) * sqrt_op(c)[1]
    evaluations = sqrt_op(c)[1]
    assert evaluations.dtype == np.int32 and evaluations > 0
    np.testing.assert_allclose(jax.grad(loss)(c), evaluations / (2 * np.sqrt(c)), rtol=1e-12)


def test_jvp_tangents_of_int_and_bool_outputs_are_float0(c, rng):
    dc = rng.standard_normal(5)
    (x, evaluations, converged), (dx, d_evaluations, d_converged) = jax.jvp(sqrt_op, (c,), (dc,))
    np.testing.assert_allclose(x, np.sqrt(c), rtol=1e-14)
    np.testing.assert_allclose(dx, dc / (2 * np.sqrt(c)), rtol=1e-12)
    assert np.all(converged) and converged.dtype == np.bool_
    assert d_evaluations.dtype == jax.dtypes.float0 and d_evaluations.shape == ()
    assert d_converged.dtype == jax.dtypes.float0 and d_converged.shape == (5,)
    assert CALLS == [("jvp", 1, [np.float64])]  # f_jvp writes the float tangent only


def test_jacobians_and_vmap(c, rng):
    want = np.diag(1 / (2 * np.sqrt(c)))
    np.testing.assert_allclose(jax.jacfwd(lambda c: sqrt_op(c)[0])(c), want, rtol=1e-12)
    np.testing.assert_allclose(jax.jacrev(lambda c: sqrt_op(c)[0])(c), want, rtol=1e-12)
    # jax.jacrev refuses integer outputs; jax.vjp takes float0 cotangents for them
    outs, pullback = jax.vjp(sqrt_op, c)
    float0 = jax.dtypes.float0
    (c_ct,) = pullback([jnp.ones(5), np.zeros((), float0), np.zeros((5,), float0)])
    np.testing.assert_allclose(c_ct, 1 / (2 * np.sqrt(c)), rtol=1e-12)
    cs = rng.uniform(0.5, 4.0, (3, 5))
    loss = lambda c: jnp.sum(jnp.sin(sqrt_op(c)[0]))
    np.testing.assert_allclose(
        jax.jit(jax.vmap(jax.grad(loss)))(cs),
        jax.vmap(jax.grad(lambda c: jnp.sum(jnp.sin(jnp.sqrt(c)))))(cs),
        rtol=1e-12,
    )
    dcs = rng.standard_normal((3, 5))
    tangents = jax.jvp(jax.vmap(sqrt_op), (cs,), (dcs,))[1]
    np.testing.assert_allclose(tangents[0], dcs / (2 * np.sqrt(cs)), rtol=1e-12)
    assert tangents[1].dtype == jax.dtypes.float0 and tangents[1].shape == (3,)


def test_only_integer_outputs_call_no_derivative():
    def floor_count(out, args, kwargs_dump):
        out[0][...] = np.floor(args[0]).astype(np.int64)

    def never(out, args, kwargs_dump):
        raise AssertionError("a derivative callback ran for an op with integer outputs only")

    op = jaxbind.get_nonlinear_call(
        floor_count, (never, never), lambda x, *t: ((x.shape, np.int64),), lambda x, ct: ((x.shape, x.dtype),)
    )
    x = jnp.array([0.5, 1.5, 2.5])
    assert float(jax.grad(lambda x: jnp.sum(x) + jnp.sum(op(x)[0]).astype(float))(x)[0]) == 1.0
    assert jax.jvp(op, (x,), (x,))[1][0].dtype == jax.dtypes.float0


def test_complex_outputs_are_differentiable(rng):
    def rotate(out, args, kwargs_dump):
        (x,) = args
        out[0][...] = np.exp(1j * x)
        out[1][...] = x.size

    def rotate_jvp(out, args, kwargs_dump):
        x, dx = args
        out[0][...] = 1j * np.exp(1j * x) * dx

    def rotate_vjp(out, args, kwargs_dump):
        x, ct = args
        out[0][...] = np.real(1j * np.exp(1j * x) * ct)

    op = jaxbind.get_nonlinear_call(
        rotate,
        (rotate_jvp, rotate_vjp),
        lambda x, *t: ((x.shape, np.complex128), ((), np.int16)),
        lambda x, ct: ((x.shape, x.dtype),),
    )
    x = rng.standard_normal(4)
    loss = lambda x: jnp.sum(jnp.real(op(x)[0]) ** 2 + jnp.imag(op(x)[0]))
    np.testing.assert_allclose(
        jax.grad(loss)(x), jax.grad(lambda x: jnp.sum(jnp.cos(x) ** 2 + jnp.sin(x)))(x), rtol=1e-12
    )


# ---------------------------------------------------------------------------
# Linear and multilinear ops with an integer output
# ---------------------------------------------------------------------------


def scale_and_count(out, args, kwargs_dump):
    (x,) = args
    out[0][...] = 3 * x
    out[1][...] = np.count_nonzero(x)


def scale_and_count_T(out, args, kwargs_dump):
    y_ct, count_ct = args  # zeros of the count's own dtype stand for its cotangent
    CALLS.append(("transpose", count_ct.dtype, int(count_ct)))
    out[0][...] = 3 * y_ct


linear_op = jaxbind.get_linear_call(
    scale_and_count,
    scale_and_count_T,
    lambda x: ((x.shape, x.dtype), ((), np.int32)),
    lambda y_ct, count_ct: ((y_ct.shape, y_ct.dtype),),
)


def test_linear_op_with_an_int_output(rng):
    x = rng.standard_normal(4)
    loss = lambda x: jnp.sum(jnp.sin(linear_op(x)[0]))
    want = 3 * jnp.cos(3 * x)
    np.testing.assert_allclose(jax.grad(loss)(x), want, rtol=1e-12)
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(x), want, rtol=1e-12)
    assert CALLS == [("transpose", np.int32, 0)] * 2
    (y, n), (dy, dn) = jax.jvp(linear_op, (x,), (x,))
    np.testing.assert_allclose(dy, 3 * x, rtol=1e-14)
    assert int(n) == 4 and dn.dtype == jax.dtypes.float0
    xs = rng.standard_normal((3, 4))
    np.testing.assert_allclose(jax.vmap(jax.grad(loss))(xs), 3 * jnp.cos(3 * xs), rtol=1e-12)
    np.testing.assert_allclose(jax.jacrev(lambda x: linear_op(x)[0])(x), 3 * np.eye(4), rtol=1e-14)


def test_multilinear_op_with_a_bool_output(rng):
    def product(out, args, kwargs_dump):
        a, b = args
        out[0][...] = a * b
        out[1][...] = np.all(a * b >= 0)

    def product_T0(out, args, kwargs_dump):
        b, y_ct, flag_ct = args
        assert flag_ct.dtype == np.bool_ and not flag_ct
        out[0][...] = b * y_ct

    def product_T1(out, args, kwargs_dump):
        a, y_ct, flag_ct = args
        out[0][...] = a * y_ct

    op = jaxbind.get_linear_call(
        product,
        (product_T0, product_T1),
        lambda a, b: ((a.shape, a.dtype), ((), np.bool_)),
        (lambda b, y, f: ((b.shape, b.dtype),), lambda a, y, f: ((a.shape, a.dtype),)),
    )
    a, b = rng.standard_normal(4), rng.standard_normal(4)
    loss = lambda a, b: jnp.sum(jnp.sin(op(a, b)[0]))
    got = jax.grad(loss, argnums=(0, 1))(a, b)
    want = jax.grad(lambda a, b: jnp.sum(jnp.sin(a * b)), argnums=(0, 1))(a, b)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-12)
    tangents = jax.jvp(op, (a, b), (b, a))[1]
    np.testing.assert_allclose(tangents[0], b * b + a * a, rtol=1e-12)  # da = b, db = a
    assert tangents[1].dtype == jax.dtypes.float0

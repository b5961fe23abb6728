"""Residuals: ``get_nonlinear_call(..., n_residuals=k)``.

``f`` writes its outputs followed by ``k`` residual arrays; ``abstract(*primals)``
declares all of them, residuals last. Calling the op returns the outputs only;
``f_jvp`` receives ``(*primals, *residuals, *tangents)`` and ``f_vjp``
``(*primals, *residuals, *cotangents)``, so derivatives reuse the forward solve:
under jvp, grad, vmap and jit, ``f`` runs once per primal point.

The op here is a solver: the real root ``x`` of ``x**3 + a x = c``
(elementwise, ``a > 0``), by Newton's method in NumPy. Its residuals are the
solution and the slope ``dF/dx = 3 x**2 + a`` stacked in one ``(2, n)``
array, and the number of Newton steps as an int32 scalar (residuals of other
shapes and dtypes than the outputs). By the implicit function theorem
``dx = (dc - x da) / (3 x**2 + a)``. The reference is the same Newton
iteration in ``jax.numpy``, differentiated by JAX through its steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import CALLS

import jaxbind

# The callbacks below record (callback name, [(shape, dtype) of each argument]) in _shared.CALLS, emptied
# around each test (the calls fixture).
pytestmark = pytest.mark.usefixtures("calls")


def count(name):
    return sum(1 for called, _ in CALLS if called == name)


def record(name, args):
    CALLS.append((name, [(a.shape, a.dtype) for a in args]))


def newton(out, args, kwargs_dump):
    record("newton", args)
    a, c = args
    x = np.cbrt(c)
    steps = 0
    for steps in range(1, 100):  # noqa: B007  (the count of steps taken is read after the loop)
        step = (x**3 + a * x - c) / (3 * x**2 + a)
        x = x - step
        if np.all(np.abs(step) <= 1e-15 * (1 + np.abs(x))):
            break
    out[0][...] = x
    out[1][0] = x  # residual: the solution ...
    out[1][1] = 3 * x**2 + a  # ... and the slope dF/dx
    out[2][...] = steps  # residual: an int32 scalar


def newton_jvp(out, args, kwargs_dump):
    record("newton_jvp", args)
    a, c, solution, steps, da, dc = args  # primals, residuals, tangents
    assert steps.dtype == np.int32 and steps > 0
    x, slope = solution
    out[0][...] = (dc - x * da) / slope


def newton_vjp(out, args, kwargs_dump):
    record("newton_vjp", args)
    a, c, solution, steps, x_ct = args  # primals, residuals, cotangents
    assert steps.dtype == np.int32 and steps > 0
    x, slope = solution
    out[0][...] = -x * x_ct / slope  # cotangent of a
    out[1][...] = x_ct / slope  # cotangent of c


def newton_abstract(a, c):
    # called with the primals only: the output, then the residuals
    return ((c.shape, c.dtype), ((2,) + c.shape, c.dtype), ((), np.int32))


def newton_abstract_reverse(a, c, solution, steps, x_ct):
    # called with what newton_vjp receives
    assert solution.shape == (2,) + c.shape and steps.dtype == np.int32
    return ((a.shape, a.dtype), (c.shape, c.dtype))


root_op = jaxbind.get_nonlinear_call(
    newton, (newton_jvp, newton_vjp), newton_abstract, newton_abstract_reverse, n_residuals=2
)


def root(a, c):
    (x,) = root_op(a, c)  # the outputs only
    return x


def reference(a, c):
    """The same Newton iteration in jax.numpy (JAX differentiates through its steps)."""
    x = jnp.cbrt(c)
    for _ in range(40):
        x = x - (x**3 + a * x - c) / (3 * x**2 + a)
    return x


@pytest.fixture
def a_c(rng):
    return rng.uniform(0.5, 2.0, 5), rng.uniform(-3.0, 3.0, 5)


def loss(f):
    return lambda a, c: jnp.sum(jnp.sin(f(a, c)))


# ---------------------------------------------------------------------------
# Values: the op returns its outputs only; derivatives against jax.numpy and
# finite differences
# ---------------------------------------------------------------------------


def test_op_returns_outputs_only(a_c):
    a, c = a_c
    outs = root_op(a, c)
    assert len(outs) == 1
    np.testing.assert_allclose(outs[0], reference(a, c), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(jax.jit(root)(a, c), reference(a, c), rtol=1e-12, atol=1e-13)


def test_jvp_and_grad_against_jax_numpy(a_c, rng):
    a, c = a_c
    da, dc = rng.standard_normal(5), rng.standard_normal(5)
    x, dx = jax.jvp(root, (a, c), (da, dc))
    x_ref, dx_ref = jax.jvp(reference, (a, c), (da, dc))
    np.testing.assert_allclose(x, x_ref, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-10, atol=1e-12)
    got = jax.jit(jax.grad(loss(root), argnums=(0, 1)))(a, c)
    want = jax.grad(loss(reference), argnums=(0, 1))(a, c)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_gradient_against_finite_differences(a_c, rng):
    a, c = a_c
    jax.test_util.check_grads(root, (a, c), order=1, modes=("fwd", "rev"), eps=1e-6)


def test_jacobians(a_c):
    a, c = a_c
    for jac in (jax.jacfwd, jax.jacrev):
        got = jac(root, argnums=(0, 1))(a, c)
        want = jax.jacfwd(reference, argnums=(0, 1))(a, c)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_vmap_of_grad(rng):
    a = rng.uniform(0.5, 2.0, (4, 3))
    c = rng.uniform(-3.0, 3.0, 3)
    got = jax.jit(jax.vmap(jax.grad(loss(root), argnums=(0, 1)), in_axes=(0, None)))(a, c)
    want = jax.vmap(jax.grad(loss(reference), argnums=(0, 1)), in_axes=(0, None))(a, c)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_grad_of_vmap_and_jvp_of_vmap(rng):
    a = rng.uniform(0.5, 2.0, (4, 3))
    c = rng.uniform(-3.0, 3.0, (4, 3))
    batched = lambda a, c: jnp.sum(jnp.sin(jax.vmap(root)(a, c)))
    batched_ref = lambda a, c: jnp.sum(jnp.sin(jax.vmap(reference)(a, c)))
    for g, w in zip(jax.grad(batched, (0, 1))(a, c), jax.grad(batched_ref, (0, 1))(a, c)):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
    dc = rng.standard_normal((4, 3))
    got = jax.jvp(lambda c: jax.vmap(root)(a, c), (c,), (dc,))
    want = jax.jvp(lambda c: jax.vmap(reference)(a, c), (c,), (dc,))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------
# One forward solve per primal point
# ---------------------------------------------------------------------------


def test_jit_grad_solves_once(a_c):
    a, c = a_c
    jax.jit(jax.grad(loss(root), argnums=(0, 1)))(a, c)
    assert count("newton") == 1
    assert count("newton_vjp") == 1 and count("newton_jvp") == 0


def test_jacrev_solves_once(a_c):
    a, c = a_c
    jax.jacrev(root, argnums=(0, 1))(a, c)
    assert count("newton") == 1
    jax.jit(jax.jacrev(root))(a, c)
    assert count("newton") == 2


def test_jacfwd_and_jvp_solve_once(a_c):
    a, c = a_c
    jax.jacfwd(root, argnums=1)(a, c)
    assert count("newton") == 1
    jax.linearize(root, a, c)[1](a, c)
    assert count("newton") == 2


def test_vmap_grad_solves_once_per_element(rng):
    a = rng.uniform(0.5, 2.0, (6, 3))
    c = rng.uniform(-3.0, 3.0, (6, 3))
    jax.jit(jax.vmap(jax.grad(loss(root), argnums=(0, 1))))(a, c)
    assert count("newton") == 6  # the handler walks the batch: one call per element
    assert count("newton_vjp") == 6


# ---------------------------------------------------------------------------
# What the callbacks and abstracts receive
# ---------------------------------------------------------------------------


def test_callbacks_receive_primals_residuals_then_tangents(a_c):
    a, c = a_c
    jax.jvp(root, (a, c), (a, c))
    jax.grad(loss(root), argnums=(0, 1))(a, c)
    f64, i32 = np.dtype(np.float64), np.dtype(np.int32)
    args = {name: received for name, received in CALLS}
    assert args["newton_jvp"] == [((5,), f64), ((5,), f64), ((2, 5), f64), ((), i32), ((5,), f64), ((5,), f64)]
    assert args["newton_vjp"] == [((5,), f64), ((5,), f64), ((2, 5), f64), ((), i32), ((5,), f64)]


def test_vmapped_residuals_reach_the_derivative_batched(rng):
    # The residuals of each element reach that element's derivative call.
    a = rng.uniform(0.5, 2.0, (3, 4))
    c = rng.uniform(-3.0, 3.0, (3, 4))
    got = jax.vmap(jax.jacrev(root, argnums=1))(a, c)
    want = jax.vmap(jax.jacfwd(reference, argnums=1))(a, c)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert count("newton") == 3


def test_second_order_is_an_error(a_c):
    a, c = a_c
    with pytest.raises(ValueError, match="'newton'.*second-order"):
        jax.hessian(lambda c: jnp.sum(root(a, c)))(c)


# ---------------------------------------------------------------------------
# A fixed argument: the residuals come after all primals, fixed ones included
# ---------------------------------------------------------------------------


def newton_fixed_jvp(out, args, kwargs_dump):
    record("newton_fixed_jvp", args)
    a, c, solution, steps, dc = args  # primals (a fixed), residuals, the tangent of c
    out[0][...] = dc / solution[1]


def newton_fixed_vjp(out, args, kwargs_dump):
    record("newton_fixed_vjp", args)
    a, c, solution, steps, x_ct = args
    out[0][...] = x_ct / solution[1]  # the cotangent of c only


root_fixed_op = jaxbind.get_nonlinear_call(
    newton,
    (newton_fixed_jvp, newton_fixed_vjp),
    newton_abstract,
    lambda a, c, solution, steps, x_ct: ((c.shape, c.dtype),),
    first_n_args_fixed=1,
    n_residuals=2,
    name="root_fixed",
)


def test_fixed_argument_with_residuals(rng):
    a = rng.uniform(0.5, 2.0, (4, 3))
    c = rng.uniform(-3.0, 3.0, (4, 3))
    fixed = lambda a, c: jnp.sum(jnp.sin(root_fixed_op(a, c)[0]))
    got = jax.jit(jax.vmap(jax.grad(fixed, argnums=1)))(a, c)
    want = jax.vmap(jax.grad(loss(reference), argnums=1))(a, c)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert count("newton") == 4
    got = jax.vmap(jax.grad(fixed, argnums=1), in_axes=(0, None))(a, c[0])
    want = jax.vmap(jax.grad(loss(reference), argnums=1), in_axes=(0, None))(a, c[0])
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    f64, i32 = np.dtype(np.float64), np.dtype(np.int32)
    received = [args for name, args in CALLS if name == "newton_fixed_vjp"]
    assert received[0] == [((3,), f64), ((3,), f64), ((2, 3), f64), ((), i32), ((3,), f64)]
    with pytest.raises(ValueError, match="'root_fixed'.*fixed"):
        jax.grad(fixed, argnums=0)(a[0], c[0])


# ---------------------------------------------------------------------------
# func_can_batch: residuals keep the batch axes f gave them
# ---------------------------------------------------------------------------


def in_layout_of(which, args, batch_axes):
    """Every input in the layout of input ``which``, the one these elementwise callbacks'
    output has (the jvp's follows the tangent, the vjp's the primal): mapped inputs moved
    there, unmapped ones (the primal point under jacfwd) given size-1 axes there."""
    if not batch_axes:
        return args
    layout = batch_axes[which]
    return [
        np.moveaxis(a, axes, layout) if axes else np.expand_dims(a, sorted(layout)) for a, axes in zip(args, batch_axes)
    ]


def exp_batched(out, args, kwargs_dump):
    record("exp_batched", args)
    (x,) = args
    out[0][...] = np.exp(x)
    out[1][...] = np.exp(x)  # the residual: the derivative


def exp_batched_jvp(out, args, kwargs_dump):
    x, derivative, dx = in_layout_of(-1, args, jaxbind.load_kwargs(kwargs_dump)["batch_axes"])
    out[0][...] = derivative * dx


def exp_batched_vjp(out, args, kwargs_dump):
    x, derivative, y_ct = in_layout_of(0, args, jaxbind.load_kwargs(kwargs_dump)["batch_axes"])
    out[0][...] = derivative * y_ct


def exp_batched_abstract(x, *, batch_axes):
    axis = batch_axes[0][-1] if batch_axes else 0
    return ((x.shape, x.dtype, axis), (x.shape, x.dtype, axis))


def exp_batched_abstract_reverse(x, derivative, y_ct, *, batch_axes):
    axis = batch_axes[0][-1] if batch_axes else 0
    return ((x.shape, x.dtype, axis),)


exp_op = jaxbind.get_nonlinear_call(
    exp_batched,
    (exp_batched_jvp, exp_batched_vjp),
    exp_batched_abstract,
    exp_batched_abstract_reverse,
    func_can_batch=True,
    n_residuals=1,
)


def test_func_can_batch_with_residuals(rng):
    x = rng.standard_normal((3, 4, 2))
    f = lambda x: jnp.sum(jnp.sin(exp_op(x)[0]))
    f_ref = lambda x: jnp.sum(jnp.sin(jnp.exp(x)))
    got = jax.jit(jax.vmap(jax.vmap(jax.grad(f), in_axes=1), in_axes=2))(x)
    want = jax.vmap(jax.vmap(jax.grad(f_ref), in_axes=1), in_axes=2)(x)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert count("exp_batched") == 1  # one self-batched call
    dx = rng.standard_normal((3, 4, 2))
    got = jax.jvp(jax.vmap(lambda x: exp_op(x)[0], in_axes=1, out_axes=1), (x,), (dx,))
    np.testing.assert_allclose(got[1], jnp.exp(x) * dx, rtol=1e-12)
    got = jax.grad(lambda x: jnp.sum(jnp.sin(jax.vmap(lambda x: exp_op(x)[0], in_axes=1)(x))))(x)
    np.testing.assert_allclose(got, jnp.cos(jnp.exp(x)) * jnp.exp(x), rtol=1e-12)


def test_jacfwd_of_func_can_batch_with_residuals(rng):
    """jacfwd maps the tangents at one primal point: the jvp abstract learns their batch axis."""
    x = rng.standard_normal((3, 2))
    f = lambda x: exp_op(x)[0]
    np.testing.assert_allclose(jax.jacfwd(f)(x), jax.jacfwd(jnp.exp)(x), rtol=1e-12)
    np.testing.assert_allclose(jax.jit(jax.jacfwd(f))(x), jax.jacfwd(jnp.exp)(x), rtol=1e-12)
    np.testing.assert_allclose(
        jax.vmap(jax.jacfwd(f), in_axes=1)(x), jax.vmap(jax.jacfwd(jnp.exp), in_axes=1)(x), rtol=1e-12
    )
    np.testing.assert_allclose(
        jax.jacfwd(jax.vmap(f, in_axes=1))(x), jax.jacfwd(jax.vmap(jnp.exp, in_axes=1))(x), rtol=1e-12
    )


def _to_front(args, batch_axes):
    """Each input's (one) batch axis moved to the front, or a size-1 one added there."""
    return [np.moveaxis(a, axes[-1], 0) if axes else a[None] for a, axes in zip(args, batch_axes)]


def exp_transposed(out, args, kwargs_dump):
    """exp, its output's batch axis last and its residual's first (one level)."""
    (x,) = args
    axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"]
    if not axes:
        out[0][...] = out[1][...] = np.exp(x)
        return
    e = np.exp(np.moveaxis(x, axes[0][-1], 0))
    out[0][...] = np.moveaxis(e, 0, -1)
    out[1][...] = e


def exp_transposed_jvp(out, args, kwargs_dump):  # (x, residual, dx) -> dy, batch last
    axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"]
    if not axes:
        out[0][...] = args[1] * args[2]
        return
    _, r, dx = _to_front(args, axes)
    out[0][...] = np.moveaxis(r * dx, 0, -1)


def exp_transposed_vjp(out, args, kwargs_dump):  # (x, residual, y_ct) -> x_ct, in x's layout
    axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"]
    if not axes:
        out[0][...] = args[1] * args[2]
        return
    _, r, ct = _to_front(args, axes)
    out[0][...] = np.moveaxis(r * ct, 0, axes[0][-1]) if axes[0] else np.sum(r * ct, axis=0)


def _moved(shape, src, dst):
    return tuple(np.moveaxis(np.empty(shape, np.int8), src, dst).shape)


def exp_transposed_abstract(x, *, batch_axes):
    if not batch_axes:
        return ((x.shape, x.dtype, 0), (x.shape, x.dtype, 0))
    a = batch_axes[0][-1]
    return ((_moved(x.shape, a, -1), x.dtype, len(x.shape) - 1), (_moved(x.shape, a, 0), x.dtype, 0))


def exp_transposed_abstract_reverse(x, r, ct, *, batch_axes):
    return ((x.shape, x.dtype, batch_axes[0][-1] if batch_axes else 0),)


exp_transposed_op = jaxbind.get_nonlinear_call(
    exp_transposed,
    (exp_transposed_jvp, exp_transposed_vjp),
    exp_transposed_abstract,
    exp_transposed_abstract_reverse,
    func_can_batch=True,
    n_residuals=1,
)


def test_func_can_batch_residual_laid_out_unlike_the_output(rng):
    """The residual's batch axis first, the output's last: the jvp gets the residual where f
    put it (read as the output's layout, its values or shape come out wrong)."""
    x = rng.standard_normal((3, 4, 2))
    dx = rng.standard_normal((3, 4, 2))
    op = lambda x: exp_transposed_op(x)[0]
    got = jax.jvp(jax.vmap(op, in_axes=1), (x,), (dx,))
    want = jax.jvp(jax.vmap(jnp.exp, in_axes=1), (x,), (dx,))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-12)
    got = jax.jit(lambda x, dx: jax.jvp(jax.vmap(op, in_axes=1, out_axes=2), (x,), (dx,)))(x, dx)
    np.testing.assert_allclose(got[1], jnp.moveaxis(jnp.exp(x) * dx, 1, 2), rtol=1e-12)
    grad = jax.grad(lambda x: jnp.sum(jnp.sin(jax.vmap(op, in_axes=1)(x))))(x)
    np.testing.assert_allclose(grad, jnp.cos(jnp.exp(x)) * jnp.exp(x), rtol=1e-12)


# ---------------------------------------------------------------------------
# Errors name the op
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.0, TypeError), (True, TypeError), ("1", TypeError)])
def test_bad_n_residuals(bad, error):
    with pytest.raises(error, match="'newton'.*n_residuals"):
        jaxbind.get_nonlinear_call(
            newton, (newton_jvp, newton_vjp), newton_abstract, newton_abstract_reverse, n_residuals=bad
        )


@pytest.mark.parametrize("k", [3, 4])
def test_more_residuals_than_the_abstract_declares(a_c, k):
    # The abstract declares three arrays: at least one must be an output.
    op = jaxbind.get_nonlinear_call(
        newton, (newton_jvp, newton_vjp), newton_abstract, newton_abstract_reverse, n_residuals=k, name="too_many"
    )
    with pytest.raises(ValueError, match=f"'too_many': n_residuals={k}.*declares 3"):
        op(*a_c)
    assert count("newton") == 0


def test_n_residuals_is_part_of_the_op():
    same = jaxbind.get_nonlinear_call(
        newton, (newton_jvp, newton_vjp), newton_abstract, newton_abstract_reverse, n_residuals=2
    )
    other = jaxbind.get_nonlinear_call(
        newton, (newton_jvp, newton_vjp), newton_abstract, newton_abstract_reverse, n_residuals=1
    )
    assert same == root_op and hash(same) == hash(root_op)
    assert other != root_op


# ---------------------------------------------------------------------------
# A native kernel writes residuals like a Python callback
# ---------------------------------------------------------------------------


def test_native_forward_with_a_residual(rng, kernels):

    def triple_jvp(out, args, kwargs_dump):
        x, total, dx = args  # total = sum(x), written by the C kernel as a residual
        record("triple_jvp", args)
        np.testing.assert_allclose(total, np.sum(x), rtol=1e-14)
        out[0][...] = 3 * dx

    def triple_vjp(out, args, kwargs_dump):
        x, total, y_ct = args
        record("triple_vjp", args)
        np.testing.assert_allclose(total, np.sum(x), rtol=1e-14)
        out[0][...] = 3 * y_ct

    # jb_triple_and_sum writes (3 x, sum(x)): here the sum is the residual
    op = jaxbind.get_nonlinear_call(
        kernels.jb_triple_and_sum,
        (triple_jvp, triple_vjp),
        lambda x: ((x.shape, x.dtype), ((), x.dtype)),
        lambda x, total, ct: ((x.shape, x.dtype),),
        n_residuals=1,
        name="triple",
    )
    x = rng.standard_normal((3, 5))
    assert len(op(x[0])) == 1
    loss = lambda x: jnp.sum(jnp.sin(op(x)[0]))
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(loss)))(x), 3 * jnp.cos(3 * x), rtol=1e-14)
    np.testing.assert_allclose(jax.jvp(jax.vmap(lambda x: op(x)[0]), (x,), (x,))[1], 3 * x, rtol=1e-14)
    assert count("triple_vjp") == 3 and count("triple_jvp") == 3


def _sin_with_cos(out, args, kwargs_dump):
    record("sin", args)
    np.sin(args[0], out=out[0])
    np.cos(args[0], out=out[1])  # residual: the derivative


def _times_residual(out, args, kwargs_dump):  # jvp (x, cos x, t) and vjp (x, cos x, ct) alike
    np.multiply(args[1], args[2], out=out[0])


def _like_first_twice(x):
    return ((x.shape, x.dtype), (x.shape, x.dtype))


def _like_first(x, *rest):
    return ((x.shape, x.dtype),)


@pytest.mark.parametrize("vmap_method", ["sequential", "expand_dims", "broadcast_all"])
def test_residuals_under_every_vmap_method(vmap_method):
    # jit(vmap(grad)) and vmap(jvp): one forward call per batch (one per element when
    # walked), its residuals batched to the derivative callbacks, against jnp.cos.
    op = jaxbind.get_nonlinear_call(
        _sin_with_cos,
        (_times_residual, _times_residual),
        _like_first_twice,
        _like_first,
        n_residuals=1,
        vmap_method=vmap_method,
    )
    x = jnp.asarray(np.random.default_rng(5).standard_normal((6, 3)))
    per_batch = 6 if vmap_method == "sequential" else 1
    g = jax.jit(jax.vmap(jax.grad(lambda r: jnp.sum(op(r)[0]))))(x)
    np.testing.assert_allclose(g, jnp.cos(x), rtol=1e-13)
    assert count("sin") == per_batch
    CALLS.clear()
    t = jnp.ones_like(x) * 0.5
    y, dy = jax.vmap(lambda r, s: jax.jvp(lambda r: op(r)[0], (r,), (s,)))(x, t)
    np.testing.assert_allclose(y, jnp.sin(x), rtol=1e-13)
    np.testing.assert_allclose(dy, 0.5 * jnp.cos(x), rtol=1e-13)
    assert count("sin") == per_batch

"""How jaxbind batches ops under ``jax.vmap``.

(a) Without ``func_can_batch`` the callback sees one batch element at a time,
    but the whole vmapped op is still ONE custom call (no XLA loop): jaxbind's
    handler walks the batch and calls the callback once per element.
(b) With ``func_can_batch=True`` the callback gets the whole batch in a single
    call and learns where the batch axes are from the ``batch_axes`` kwarg.
(c) Tracing (``jax.eval_shape``, ``jax.make_jaxpr``, lowering) only runs the
    abstract functions, never the callbacks.

Every callback here records its calls, so the tests can count them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import CALLS

import jaxbind

# The callbacks below record (callback name, details) in _shared.CALLS, emptied around each test (the
# calls fixture).
pytestmark = pytest.mark.usefixtures("calls")


def names(calls):
    return [name for name, _ in calls]


# ---------------------------------------------------------------------------
# (a) An op without func_can_batch: scaled matvec y = A @ x
# ---------------------------------------------------------------------------


def counted_matvec(out, args, kwargs_dump):
    A, x = args
    CALLS.append(("counted_matvec", (A.shape, x.shape)))
    out[0][...] = A @ x


def counted_matvec_T(out, args, kwargs_dump):
    A, y_ct = args
    CALLS.append(("counted_matvec_T", (A.shape, y_ct.shape)))
    out[0][...] = A.T @ y_ct


def matvec_abstract(A, x):
    return (((A.shape[0],), x.dtype),)


def matvec_T_abstract(A, y_ct):
    return (((A.shape[1],), y_ct.dtype),)


matvec_op = jaxbind.get_linear_call(
    counted_matvec, counted_matvec_T, matvec_abstract, matvec_T_abstract, first_n_args_fixed=1
)


def apply_matvec(A, x):
    return matvec_op(A, x)[0]


@pytest.fixture
def A():
    return np.arange(12.0).reshape(3, 4) / 10


def test_vmap_calls_the_callback_once_per_batch_element(A, rng, calls):
    xs = rng.standard_normal((5, 4))
    ys = jax.vmap(apply_matvec, in_axes=(None, 0))(A, xs)
    np.testing.assert_allclose(ys, xs @ A.T, rtol=1e-12)
    # five calls, each on one element: the full A and one row of xs
    assert calls == [("counted_matvec", ((3, 4), (4,)))] * 5


def test_nested_vmap_calls_the_callback_once_per_element_of_both_levels(rng, calls):
    As = rng.standard_normal((2, 3, 4))  # batched at the outer level only
    xs = rng.standard_normal((4, 6))  # batched at the inner level only (axis 1)
    inner = jax.vmap(apply_matvec, in_axes=(None, 1))
    ys = jax.vmap(inner, in_axes=(0, None))(As, xs)
    np.testing.assert_allclose(ys, np.einsum("bij,ja->bai", As, xs), rtol=1e-12)
    assert calls == [("counted_matvec", ((3, 4), (4,)))] * 12


def test_grad_of_vmap_calls_the_transpose_once_per_batch_element(A, rng, calls):
    xs = rng.standard_normal((5, 4))
    ws = rng.standard_normal((5, 3))
    grad = jax.grad(lambda xs: jnp.sum(ws * jax.vmap(apply_matvec, in_axes=(None, 0))(A, xs)))(xs)
    np.testing.assert_allclose(grad, ws @ A, rtol=1e-12)
    # each transpose call gets the full A and one row of the cotangents
    assert [c for c in calls if c[0] == "counted_matvec_T"] == [("counted_matvec_T", ((3, 4), (3,)))] * 5


def test_jit_of_vmap_is_a_single_custom_call_without_loop(A, rng, calls):
    xs = rng.standard_normal((5, 4))
    batched = jax.jit(jax.vmap(apply_matvec, in_axes=(None, 0)))
    lowered = batched.lower(A, xs)
    text = lowered.as_text()
    assert text.count("jaxbind_dispatch") == 1
    assert text.count("custom_call") == 1
    assert "while" not in text
    compiled_text = lowered.compile().as_text()
    assert "while" not in compiled_text
    assert calls == []  # lowering and compiling run no callback

    np.testing.assert_allclose(batched(A, xs), xs @ A.T, rtol=1e-12)
    assert names(calls) == ["counted_matvec"] * 5


def test_jit_of_nested_vmap_is_a_single_custom_call(rng, calls):
    As = rng.standard_normal((2, 3, 4))
    xs = rng.standard_normal((2, 6, 4))
    batched = jax.jit(jax.vmap(jax.vmap(apply_matvec, in_axes=(None, 0)), in_axes=(0, 0)))
    text = batched.lower(As, xs).as_text()
    assert text.count("jaxbind_dispatch") == 1
    assert "while" not in text
    np.testing.assert_allclose(batched(As, xs), np.einsum("bij,baj->bai", As, xs), rtol=1e-12)
    assert calls == [("counted_matvec", ((3, 4), (4,)))] * 12


# ---------------------------------------------------------------------------
# (b) func_can_batch=True: an FFT over the non-batch axes
# ---------------------------------------------------------------------------


def core_axes(ndim, batch_axes):
    """The axes of an input that are not batch axes."""
    return tuple(axis for axis in range(ndim) if axis not in batch_axes)


def batched_fftn(out, args, kwargs_dump):
    """fftn over every axis but the batch axes, all batch elements in one call.

    The unnormalized DFT matrix is symmetric, so this is its own (linear,
    unconjugated) transpose.
    """
    batch_axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"]
    (x,) = args
    CALLS.append(("batched_fftn", batch_axes))
    x_batch_axes = () if batch_axes is None else batch_axes[0]
    out[0][...] = np.fft.fftn(x, axes=core_axes(x.ndim, x_batch_axes))


def fftn_abstract(x, *, batch_axes):
    if batch_axes is None:
        return ((x.shape, x.dtype),)
    # the output keeps the input's layout: the newest batch axis is the same
    return ((x.shape, x.dtype, batch_axes[0][-1]),)


fftn_op = jaxbind.get_linear_call(batched_fftn, batched_fftn, fftn_abstract, fftn_abstract, func_can_batch=True)


def apply_fftn(x):
    return fftn_op(x)[0]


def crand(rng, *shape):
    return rng.standard_normal(shape) + 1j * rng.standard_normal(shape)


def test_func_can_batch_unbatched_call_gets_batch_axes_none(rng, calls):
    x = crand(rng, 3, 4)
    np.testing.assert_allclose(apply_fftn(x), np.fft.fftn(x), rtol=1e-12)
    assert calls == [("batched_fftn", None)]


@pytest.mark.parametrize("in_axis, expected_axis", [(0, 0), (1, 1), (2, 2), (-1, 2)])
def test_func_can_batch_vmap_is_one_call_with_batch_axes(rng, calls, in_axis, expected_axis):
    shape = [3, 4]
    shape.insert(expected_axis, 5)  # the batch of 5 at in_axis
    x = crand(rng, *shape)
    y = jax.vmap(apply_fftn, in_axes=in_axis)(x)
    expected = jax.vmap(jnp.fft.fftn, in_axes=in_axis)(x)
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
    assert calls == [("batched_fftn", ((expected_axis,),))]


@pytest.mark.parametrize(
    "inner_axis, outer_axis, expected",
    [
        # inner level first; an outer axis at or before an inner one shifts it
        (0, 0, (1, 0)),
        (1, 0, (2, 0)),
        (0, 2, (0, 2)),
        (1, 1, (2, 1)),
    ],
)
def test_func_can_batch_nested_vmap(rng, calls, inner_axis, outer_axis, expected):
    x = crand(rng, 2, 3, 4, 5)

    def nested(f):
        return jax.vmap(jax.vmap(f, in_axes=inner_axis), in_axes=outer_axis)

    y = nested(apply_fftn)(x)
    np.testing.assert_allclose(y, nested(jnp.fft.fftn)(x), rtol=1e-12, atol=1e-11)
    assert calls == [("batched_fftn", (expected,))]


def test_func_can_batch_vmap_with_out_axes(rng, calls):
    x = crand(rng, 3, 5, 4)
    y = jax.vmap(apply_fftn, in_axes=1, out_axes=2)(x)
    expected = jax.vmap(jnp.fft.fftn, in_axes=1, out_axes=2)(x)
    np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-12)
    assert calls == [("batched_fftn", ((1,),))]  # out_axes moves the result afterwards


def test_func_can_batch_jit_of_vmap_is_one_custom_call(rng, calls):
    x = crand(rng, 3, 5, 4)
    batched = jax.jit(jax.vmap(apply_fftn, in_axes=1))
    assert batched.lower(x).as_text().count("jaxbind_dispatch") == 1
    np.testing.assert_allclose(batched(x), jax.vmap(jnp.fft.fftn, in_axes=1)(x), rtol=1e-12, atol=1e-12)
    assert calls == [("batched_fftn", ((1,),))]


def weighted_power(y, weights):
    """A real-valued loss whose gradient depends on the DFT's exact transpose."""
    return jnp.sum(jnp.abs(weights * y) ** 2) + jnp.sum(jnp.real(weights * y))


def test_func_can_batch_grad_of_vmap(rng, calls):
    x = crand(rng, 3, 5, 4)  # batch axis 1
    weights = crand(rng, 5, 3, 4)

    def loss(x, fft):
        return weighted_power(jax.vmap(fft, in_axes=1)(x), weights)

    grad = jax.grad(loss)(x, apply_fftn)
    expected = jax.jit(jax.grad(loss), static_argnums=1)(x, jnp.fft.fftn)
    np.testing.assert_allclose(grad, expected, rtol=1e-11, atol=1e-11)
    # forward once, transpose once, each on the whole batch; the transpose
    # receives the output cotangent in the layout the abstract declared
    assert calls == [("batched_fftn", ((1,),)), ("batched_fftn", ((1,),))]


def test_func_can_batch_vmap_of_grad(rng, calls):
    x = crand(rng, 5, 3, 4)
    weights = crand(rng, 3, 4)

    def loss(x, fft):
        return weighted_power(fft(x), weights)

    grads = jax.vmap(jax.grad(loss), in_axes=(0, None))(x, apply_fftn)
    expected = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)), static_argnums=1)(x, jnp.fft.fftn)
    np.testing.assert_allclose(grads, expected, rtol=1e-11, atol=1e-11)
    assert names(calls) == ["batched_fftn", "batched_fftn"]  # forward, transpose
    assert all(batch_axes == ((0,),) for _, batch_axes in calls)


def test_func_can_batch_jit_grad_of_nested_vmap(rng, calls):
    x = crand(rng, 2, 3, 4, 5)
    weights = crand(rng, 2, 5, 3, 4)

    def loss(x, fft):
        return weighted_power(jax.vmap(jax.vmap(fft, in_axes=2), in_axes=0)(x), weights)

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    np.testing.assert_allclose(grad(x, apply_fftn), grad(x, jnp.fft.fftn), rtol=1e-11, atol=1e-11)
    # inner level at axis 2 of an element (3 of x once the outer level shifts it),
    # outer level at 0; the transpose sees the cotangent in the forward's layout
    assert calls == [("batched_fftn", ((3, 0),)), ("batched_fftn", ((3, 0),))]


# The abstract may put the output batch axis anywhere. This op always writes
# the batch axes first, outermost level first ("batch-first"), wherever the
# input's batch axes are.


def batch_first_double(out, args, kwargs_dump):
    """2 * x; batched, with the batch axes moved to the front."""
    batch_axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"]
    (x,) = args
    CALLS.append(("batch_first_double", batch_axes))
    if batch_axes is not None:
        levels = batch_axes[0][::-1]  # batch_axes lists the innermost level first
        x = np.moveaxis(x, levels, range(len(levels)))
    out[0][...] = 2 * x


def batch_first_abstract(x, *, batch_axes):
    if batch_axes is None:
        return ((x.shape, x.dtype),)
    levels = batch_axes[0][::-1]
    shape = [x.shape[a] for a in levels] + [n for a, n in enumerate(x.shape) if a not in levels]
    return ((tuple(shape), x.dtype, 0),)  # the newest (outermost) level at axis 0


batch_first_op = jaxbind.get_linear_call(
    batch_first_double,
    batch_first_double,  # 2 * . is symmetric
    batch_first_abstract,
    batch_first_abstract,
    func_can_batch=True,
)


def apply_batch_first_double(x):
    return batch_first_op(x)[0]


@pytest.mark.parametrize("shape", [(3, 4), (3, 3)])
def test_func_can_batch_output_batch_axis_differs_from_input(rng, calls, shape):
    x = rng.standard_normal(shape)  # batch axis 1
    weights = rng.standard_normal(shape[::-1])
    batched = jax.vmap(apply_batch_first_double, in_axes=1)
    np.testing.assert_allclose(batched(x), 2 * x.T, rtol=1e-12)
    assert calls == [("batch_first_double", ((1,),))]

    # vmap of grad: the transpose is batched like any op, and declares its
    # own output batch axis
    per_row = jax.vmap(jax.grad(lambda v, w: jnp.sum(w * apply_batch_first_double(v))), in_axes=(1, 0))
    np.testing.assert_allclose(per_row(x, weights), 2 * weights, rtol=1e-12)

    # grad of vmap: the transpose of the batched op must give the cotangent
    # of x in x's layout (batch axis 1)
    grad = jax.grad(lambda x: jnp.sum(weights * batched(x)))(x)
    np.testing.assert_allclose(grad, 2 * weights.T, rtol=1e-12)


@pytest.mark.parametrize("shape", [(3, 4, 5), (3, 3, 3)])
def test_func_can_batch_nested_output_batch_axes_differ_from_input(rng, calls, shape):
    x = rng.standard_normal(shape)  # inner level: axis 1, outer level: axis 2
    weights = rng.standard_normal(shape[::-1])
    batched = jax.vmap(jax.vmap(apply_batch_first_double, in_axes=1), in_axes=2)
    np.testing.assert_allclose(batched(x), 2 * x.transpose(2, 1, 0), rtol=1e-12)
    assert calls == [("batch_first_double", ((1, 2),))]

    def loss(v, w):
        return jnp.sum(w * apply_batch_first_double(v))

    per_element = jax.vmap(jax.vmap(jax.grad(loss), in_axes=(1, 0)), in_axes=(2, 0))
    np.testing.assert_allclose(per_element(x, weights), 2 * weights, rtol=1e-12)

    grad = jax.grad(lambda x: jnp.sum(weights * batched(x)))(x)
    np.testing.assert_allclose(grad, 2 * weights.transpose(2, 1, 0), rtol=1e-12)


# A func_can_batch op with a fixed argument: y = w * x (elementwise), linear in x.
# A fixed argument is not broadcast over the levels at which it is not mapped:
# its batch axes can be fewer than those of x.


def batched_weighting(out, args, kwargs_dump):
    batch_axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"]
    w, x = args
    CALLS.append(("batched_weighting", batch_axes))
    w_axes, x_axes = batch_axes if batch_axes is not None else ((), ())
    if not w_axes:  # w is the same for every batch element
        w = np.expand_dims(w, x_axes)
    else:  # here: mapped at the same levels as x
        assert len(w_axes) == len(x_axes)
        w = np.moveaxis(w, w_axes, x_axes)
    out[0][...] = w * x


def weighting_abstract(w, x, *, batch_axes):
    if batch_axes is None:
        return ((x.shape, x.dtype),)
    return ((x.shape, x.dtype, batch_axes[1][-1]),)  # the layout of x


weighting_op = jaxbind.get_linear_call(
    batched_weighting,
    batched_weighting,  # w * . is symmetric
    weighting_abstract,
    weighting_abstract,
    first_n_args_fixed=1,
    func_can_batch=True,
)


def apply_weighting(w, x):
    return weighting_op(w, x)[0]


def test_func_can_batch_unbatched_fixed_argument_has_no_batch_axes(rng, calls):
    w, xs = rng.standard_normal(4), rng.standard_normal((4, 5))
    ys = jax.vmap(apply_weighting, in_axes=(None, 1))(w, xs)
    np.testing.assert_allclose(ys, (w[:, None] * xs).T, rtol=1e-12)
    assert calls == [("batched_weighting", ((), (1,)))]


def test_func_can_batch_unbatched_linear_argument_is_broadcast(rng, calls):
    ws, x = rng.standard_normal((4, 5)), rng.standard_normal(4)
    ys = jax.vmap(apply_weighting, in_axes=(1, None))(ws, x)
    np.testing.assert_allclose(ys, (ws * x[:, None]).T, rtol=1e-12)
    # x is differentiable, so jaxbind broadcasts it along a new leading axis
    assert calls == [("batched_weighting", ((1,), (0,)))]

    # its cotangent is summed over the batch
    grad = jax.grad(lambda x: jnp.sum(jax.vmap(apply_weighting, in_axes=(1, None))(ws, x)))(x)
    np.testing.assert_allclose(grad, ws.sum(axis=1), rtol=1e-12)


def test_func_can_batch_fixed_argument_in_nested_vmap(rng, calls):
    w = rng.standard_normal(4)
    xs = rng.standard_normal((2, 4, 3))
    f = jax.vmap(jax.vmap(apply_weighting, in_axes=(None, 1)), in_axes=(None, 0))
    np.testing.assert_allclose(f(w, xs), np.swapaxes(w[:, None] * xs, 1, 2), rtol=1e-12)
    assert calls == [("batched_weighting", ((), (2, 0)))]


def test_func_can_batch_fixed_argument_mapped_at_some_levels_is_mapped_at_all(rng, calls):
    # w varies along the inner vmap only. So that batch_axes says which level is
    # which, an input is mapped at every level or at none: jaxbind broadcasts w
    # along the outer level, and the callback sees two axes for it.
    ws = rng.standard_normal((3, 4))  # inner level first, of size 3
    xs = rng.standard_normal((2, 3, 4))  # outer level 2, inner level 3
    f = jax.vmap(jax.vmap(apply_weighting, in_axes=(0, 0)), in_axes=(None, 0))
    np.testing.assert_allclose(f(ws, xs), ws[None] * xs, rtol=1e-12)
    [(name, batch_axes)] = calls
    assert name == "batched_weighting"
    w_axes, x_axes = batch_axes
    assert len(w_axes) == len(x_axes) == 2
    grad = jax.grad(lambda xs: jnp.sum(jnp.cos(f(ws, xs))))(xs)
    np.testing.assert_allclose(grad, -np.sin(ws[None] * xs) * ws[None], rtol=1e-12)


# ---------------------------------------------------------------------------
# (c) Tracing never runs callbacks
# ---------------------------------------------------------------------------


def test_eval_shape_runs_no_callback(A, calls):
    x = jax.ShapeDtypeStruct((4,), np.float64)
    xs = jax.ShapeDtypeStruct((7, 4), np.float64)
    assert jax.eval_shape(apply_matvec, A, x).shape == (3,)
    assert jax.eval_shape(jax.vmap(apply_matvec, in_axes=(None, 0)), A, xs).shape == (7, 3)
    grad = jax.grad(lambda x: jnp.sum(apply_matvec(A, x) ** 2))
    assert jax.eval_shape(grad, x).shape == (4,)
    z = jax.ShapeDtypeStruct((5, 3, 4), np.complex128)
    assert jax.eval_shape(jax.vmap(apply_fftn), z).shape == (5, 3, 4)
    assert calls == []


def test_make_jaxpr_runs_no_callback_and_names_the_op(A, calls):
    x = np.ones(4)
    jaxpr = jax.make_jaxpr(lambda x: apply_matvec(A, x))(x)
    assert "counted_matvec" in str(jaxpr)
    batched = jax.make_jaxpr(jax.vmap(jax.grad(lambda x: jnp.sum(apply_matvec(A, x) ** 2))))(np.ones((5, 4)))
    assert "counted_matvec" in str(batched)
    fft = jax.make_jaxpr(jax.vmap(apply_fftn))(np.ones((2, 3), np.complex128))
    assert "batched_fftn" in str(fft)
    assert calls == []

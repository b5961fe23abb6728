"""Code written for the public JAXbind runs unchanged: its forms of the API beside jaxbind's own."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxbind


def square_times(out, args, kwargs_dump):
    """f(x; y) = (x * x * y, x * y): linear in y, with x fixed."""
    x, y = args
    out[0][()] = x * x * y
    out[1][()] = x * y


def square_times_T(out, args, kwargs_dump):
    x, da, db = args
    out[0][()] = x * x * da + x * db


def two_like_first(*args, **kwargs):
    return ((args[0].shape, args[0].dtype, None), (args[0].shape, args[0].dtype, None))


def like_first(*args, **kwargs):
    return ((args[0].shape, args[0].dtype, None),)


def reference(x, y):
    return [x * x * y, x * y]


@pytest.mark.parametrize("form", ["by argument position, None when fixed", "one per linear argument"])
def test_multilinear_transposes_indexed_by_argument_position(form):
    # JAXbind's test_mlin_fixed_arg: transposes indexed by argument position,
    # fixed arguments included, None in their places.
    if form.startswith("by argument"):
        f_T, abstract_T = (None, square_times_T), (None, like_first)
    else:
        f_T, abstract_T = (square_times_T,), (like_first,)
    op = jaxbind.get_linear_call(square_times, f_T, two_like_first, abstract_T, first_n_args_fixed=1)
    x, y = 4 + jnp.zeros((2, 2)), jnp.array([[1.0, -2.0], [0.5, 3.0]])
    partial_op = functools.partial(op, x, axes=(3, 4))
    for got, want in zip(partial_op(y), reference(x, y)):
        np.testing.assert_allclose(got, want)
    cts = [jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([[-1.0, 0.0], [2.0, 1.0]])]
    _, vjp = jax.vjp(partial_op, y)
    _, vjp_reference = jax.vjp(functools.partial(reference, x), y)
    np.testing.assert_allclose(vjp(cts)[0], vjp_reference(cts)[0])
    check_grads(partial_op, (y,), order=2, modes=["fwd"], eps=1.0)
    check_grads(partial_op, (y,), order=1, modes=["rev"], eps=1.0)


@pytest.mark.parametrize(
    "f_T, abstract_T, n_fixed",
    [
        ((square_times_T, None), (like_first, None), 1),  # None not in the fixed place
        ((None, square_times_T), (like_first, like_first), 1),  # abstract_T has no None there
        ((None, None, square_times_T), (None, None, like_first), 1),  # more None than fixed args
    ],
)
def test_misplaced_none_among_transposes_is_an_error(f_T, abstract_T, n_fixed):
    with pytest.raises(ValueError, match=r"op 'square_times': f_T and abstract_T have None at positions"):
        jaxbind.get_linear_call(square_times, f_T, two_like_first, abstract_T, first_n_args_fixed=n_fixed)


def test_ops_take_attributes_such_as_a_docstring():
    # JAXbind's contrib module does `genuine_fht.__doc__ = ducc0.fft.genuine_fht.__doc__`.
    op = jaxbind.get_linear_call(square_times, (square_times_T,), two_like_first, (like_first,), first_n_args_fixed=1)
    twin = jaxbind.get_linear_call(square_times, (square_times_T,), two_like_first, (like_first,), first_n_args_fixed=1)
    op.__doc__ = "Computes x * x * y and x * y."
    op.origin = "a test"
    assert op.__doc__ == "Computes x * x * y and x * y." and op.origin == "a test"
    assert twin.__doc__ != op.__doc__
    assert op == twin and hash(op) == hash(twin)
    np.testing.assert_allclose(op(jnp.full(2, 2.0), jnp.ones(2))[0], np.full(2, 4.0))


def batched_scale(out, args, kwargs_dump):
    """y = 3 x; self-batched, the batch axes arrive as a kwarg (and are ignored: elementwise)."""
    kwargs = jaxbind.load_kwargs(kwargs_dump)
    CALLS.append(kwargs.get("batch_axes"))
    out[0][...] = 3 * args[0]


def batched_like(x, batch_axes=None, **kwargs):
    if batch_axes:  # the output's batch axis: the input's
        return ((x.shape, x.dtype, batch_axes[0][0]),)
    return ((x.shape, x.dtype),)


CALLS = []


def test_an_op_is_a_partial_whose_func_variant_drops_self_batching():
    # JAXbind's ops are functools.partial(call, _func=<namedtuple>); its own
    # contrib tests make an op without self-batching from those parts.
    op = jaxbind.get_linear_call(
        batched_scale, batched_scale, batched_like, batched_like, func_can_batch=True, name="partial_form"
    )
    assert isinstance(op, functools.partial) and "_func" in op.keywords
    keywords = dict(op.keywords)
    keywords["_func"] = keywords["_func"]._replace(can_batch=False)
    walked = functools.partial(op.func, *op.args, **keywords)
    x = jnp.arange(12.0).reshape(4, 3)
    CALLS.clear()
    np.testing.assert_allclose(jax.vmap(lambda v: op(v)[0])(x), 3 * x)
    assert CALLS == [((0,),)]  # one call, the batch handed over whole
    CALLS.clear()
    np.testing.assert_allclose(jax.vmap(lambda v: walked(v)[0])(x), 3 * x)
    assert CALLS == [None] * 4  # walked: one call per element, no batch axes
    check_grads(lambda v: walked(v)[0], (x,), order=1, modes=("fwd", "rev"))
    # the unchanged parts call the op itself
    same = functools.partial(op.func, *op.args, **op.keywords)
    np.testing.assert_allclose(same(x)[0], 3 * x)
    assert hash(op) == hash(
        jaxbind.get_linear_call(
            batched_scale, batched_scale, batched_like, batched_like, func_can_batch=True, name="partial_form"
        )
    )

"""Misuse: each bad definition or call raises a Python exception that names the op and says what to fix."""

import functools
import pickle
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind


def same_shape(*args, **kwargs):
    return tuple((a.shape, a.dtype) for a in args[-1:])


def ident(out, args, kwargs_dump):
    out[0][...] = args[-1]


def test_op_and_f_must_be_callable():
    with pytest.raises(TypeError, match=r"op 'ident': f_T must be a Python callable or a native kernel"):
        jaxbind.get_linear_call(ident, "not a function", same_shape, same_shape)
    with pytest.raises(TypeError, match=r"op 'ident': abstract must be callable"):
        jaxbind.get_linear_call(ident, ident, None, same_shape)
    with pytest.raises(TypeError, match=r"op 'ident': f_derivative must be a pair"):
        jaxbind.get_nonlinear_call(ident, ident, same_shape, same_shape)


def test_transpose_tuple_of_wrong_length():
    with pytest.raises(ValueError, match=r"op 'ident': f_T is a tuple of 2 transposes.*abstract_T"):
        jaxbind.get_linear_call(ident, (ident, ident), same_shape, (same_shape,))
    with pytest.raises(ValueError, match=r"op 'ident': abstract_T is a tuple but f_T is a single"):
        jaxbind.get_linear_call(ident, ident, same_shape, (same_shape,))


def test_multilinear_op_called_with_wrong_number_of_arguments():
    op = jaxbind.get_linear_call(ident, (ident, ident), same_shape, (same_shape, same_shape))
    with pytest.raises(TypeError, match=r"op 'ident' takes 0 fixed and 2 multilinear.*called with 3"):
        op(jnp.ones(2), jnp.ones(2), jnp.ones(2))


def test_bad_first_n_args_fixed():
    with pytest.raises(ValueError, match=r"op 'ident': first_n_args_fixed must be a non-negative"):
        jaxbind.get_linear_call(ident, ident, same_shape, same_shape, first_n_args_fixed=-1)
    with pytest.raises(TypeError, match=r"op 'ident': func_can_batch must be a bool"):
        jaxbind.get_linear_call(ident, ident, same_shape, same_shape, func_can_batch="yes")


def test_first_n_args_fixed_larger_than_number_of_arguments():
    op = jaxbind.get_linear_call(ident, ident, same_shape, same_shape, first_n_args_fixed=2)
    with pytest.raises(TypeError, match=r"op 'ident' has first_n_args_fixed=2.*called with 2"):
        op(jnp.ones(2), jnp.ones(2))
    nonlinear = jaxbind.get_nonlinear_call(ident, (ident, ident), same_shape, same_shape, first_n_args_fixed=3)
    with pytest.raises(TypeError, match=r"op 'ident' has first_n_args_fixed=3.*only 1"):
        nonlinear(jnp.ones(2))


def test_wrong_number_of_arguments_for_abstract():
    def one_input(x, **kwargs):
        return ((x.shape, x.dtype),)

    op = jaxbind.get_linear_call(ident, ident, one_input, one_input)
    with pytest.raises(TypeError, match=r"op 'ident' was called with 2 array argument\(s\).*number of arguments"):
        op(jnp.ones(2), jnp.ones(2))


def test_non_array_arguments():
    op = jaxbind.get_linear_call(ident, ident, same_shape, same_shape)
    for bad in ("text", [1.0, 2.0], None, {"a": 1}):
        with pytest.raises(TypeError, match=r"op 'ident': argument 0 is a .*must be arrays"):
            op(bad)


@pytest.mark.parametrize(
    "returned, why",
    [
        (((2,), np.float64), "single pair; wrap it"),
        (None, "got a NoneType"),
        ([((2,), np.float64, 0, 1)], "entry 0 is not a"),
        ([("two", np.float64)], "entry 0 has no valid shape"),
        ([((2,), "not-a-dtype")], "entry 0 has no valid shape"),
        ([((-1,), np.float64)], "negative dimension"),
        ((), "got no outputs"),
    ],
)
def test_abstract_returning_the_wrong_structure(returned, why):
    op = jaxbind.get_linear_call(ident, ident, lambda *a, **k: returned, same_shape)
    with pytest.raises(TypeError, match=r"op 'ident'.*abstract function must return.*" + why):
        op(jnp.ones(2))


def test_abstract_declaring_fewer_outputs_than_the_callback_writes():
    def two_outputs(out, args, kwargs_dump):
        out[0][...] = args[0]
        out[1][...] = 2 * args[0]

    op = jaxbind.get_linear_call(two_outputs, two_outputs, same_shape, same_shape)
    with pytest.raises(RuntimeError, match=r"op 'two_outputs'.*IndexError: tuple index out of range"):
        jax.block_until_ready(op(jnp.arange(2.0)))


def test_abstract_raising():
    def picky(x, **kwargs):
        raise ValueError("only 3-vectors, please")

    op = jaxbind.get_linear_call(ident, ident, picky, picky)
    with pytest.raises(
        jaxbind.JaxbindError, match=r"op 'ident'.*abstract function raised ValueError: only 3-vectors"
    ) as info:
        op(jnp.ones(2))
    # the original exception is chained (JAX may put a simplified traceback between)
    chain, error = [], info.value
    while error is not None and len(chain) < 8:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(e, ValueError) and "only 3-vectors" in str(e) for e in chain)


class SolverConfigError(Exception):
    """A user's own exception type, with a constructor of its own."""

    def __init__(self, setting, value):
        super().__init__(f"{setting}={value} is not allowed")
        self.setting = setting


def _raising(exc):
    def abstract(x, **kwargs):
        if x.ndim != 1:
            raise exc
        return ((x.shape, x.dtype),)

    return abstract


ABSTRACT_FAILURES = {
    "ValueError": ValueError("need a 1-d input"),
    "TypeError": TypeError("need a 1-d input"),
    "AssertionError": AssertionError("need a 1-d input"),
    "KeyError": KeyError("need a 1-d input"),
    "user's own type": SolverConfigError("tol", -1),
}
PATHS = {
    "eager": lambda op, x: op(x),
    "jit": lambda op, x: jax.jit(lambda x: op(x)[0])(x),
    "grad": lambda op, x: jax.grad(lambda x: jnp.sum(op(x)[0]))(x),
    "vmap": lambda op, x: jax.vmap(lambda x: op(x)[0])(x[None]),
}


def test_a_class_from_code_without_a_module_name_is_the_users_own():
    """exec'd code (a doctest, a notebook cell run that way) makes classes whose
    __module__ is "builtins": still the user's type, raised itself with a note."""
    scope = {"__builtins__": __builtins__}
    exec("class PlanError(Exception):\n    pass\n", scope)
    plan_error = scope["PlanError"]
    assert plan_error.__module__ == "builtins"
    op = jaxbind.get_linear_call(
        ident, ident, _raising(plan_error("bad plan")), _raising(plan_error("bad plan")), name="planned"
    )
    with pytest.raises(plan_error) as info:
        op(jnp.ones((2, 2)))
    assert type(info.value) is plan_error and not isinstance(info.value, jaxbind.JaxbindError)
    assert any("op 'planned'" in note for note in info.value.__notes__)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("failure", list(ABSTRACT_FAILURES))
def test_an_abstract_exception_keeps_its_type_and_names_the_op(failure, path):
    exc = ABSTRACT_FAILURES[failure]
    op = jaxbind.get_linear_call(ident, ident, _raising(exc), _raising(exc), name="vector_op")
    with pytest.raises(type(exc)) as info:
        PATHS[path](op, jnp.ones((2, 2)))
    err = info.value
    if getattr(__import__("builtins"), type(exc).__name__, None) is type(
        exc
    ):  # also a JaxbindError, and its message names the op
        assert isinstance(err, jaxbind.JaxbindError)
        assert "jaxbind op 'vector_op': its abstract function raised" in str(err)
        assert type(err).__name__ == type(exc).__name__ and err.__cause__ is exc
    else:  # the user's exception itself, with a note naming the op
        assert err is exc and err.setting == "tol"
        assert any("jaxbind op 'vector_op'" in note for note in err.__notes__)
    # the op still works on inputs its abstract accepts
    np.testing.assert_array_equal(
        PATHS[path](op, jnp.arange(3.0))[0] if path == "eager" else PATHS[path](op, jnp.arange(3.0)),
        {"grad": np.ones(3), "vmap": np.arange(3.0)[None]}.get(path, np.arange(3.0)),
    )


def test_an_assert_in_an_abstract_is_catchable_with_pytest_raises():
    def abstract(x):
        assert x.ndim == 1, "need a 1-d input"
        return ((x.shape, x.dtype),)

    op = jaxbind.get_linear_call(ident, ident, abstract, abstract)
    with pytest.raises(AssertionError, match="need a 1-d input"):
        jax.jit(lambda x: op(x)[0])(jnp.ones((2, 2)))


def test_unsupported_dtype():
    op = jaxbind.get_linear_call(ident, ident, same_shape, same_shape)
    with pytest.raises(TypeError, match=r"op 'ident': argument 0 has dtype int4"):
        op(jnp.ones(2, jnp.int4))


def test_unpicklable_kwarg():
    op = jaxbind.get_linear_call(ident, ident, same_shape, same_shape)
    with pytest.raises(TypeError, match=r"op 'ident': keyword argument 'lock' cannot be pickled"):
        op(jnp.ones(2), lock=threading.Lock(), n=3)


def test_traced_kwarg():
    op = jaxbind.get_linear_call(ident, ident, same_shape, same_shape)
    with pytest.raises(TypeError, match=r"op 'ident': keyword argument 'scale' is a traced JAX value.*positional"):
        jax.jit(lambda x, s: op(x, scale=s)[0])(jnp.ones(2), 2.0)


def test_batch_axes_kwarg_is_reserved():
    op = jaxbind.get_linear_call(ident, ident, same_shape, same_shape, func_can_batch=True)
    with pytest.raises(TypeError, match=r"op 'ident': 'batch_axes' is reserved"):
        op(jnp.ones(2), batch_axes=((0,),))


def test_can_batch_abstract_without_output_axis():
    op = jaxbind.get_linear_call(ident, ident, same_shape, same_shape, func_can_batch=True)
    np.testing.assert_allclose(op(jnp.arange(2.0))[0], np.arange(2.0))  # fine unbatched
    with pytest.raises(TypeError, match=r"op 'ident'.*needs a valid output batch axis"):
        jax.vmap(lambda x: op(x)[0])(jnp.ones((3, 2)))


def test_load_kwargs_round_trip_from_bytes_and_arrays():
    dump = pickle.dumps({"a": 1, "b": [1, 2]})
    assert jaxbind.load_kwargs(dump) == {"a": 1, "b": [1, 2]}
    assert jaxbind.load_kwargs(np.frombuffer(dump, dtype=np.uint8)) == {"a": 1, "b": [1, 2]}


def test_transpose_declaring_the_wrong_cotangent_shape():
    def rotate(out, args, kwargs_dump):
        out[0][...] = (1 + 2j) * args[0]

    def forward_abstract(x, **kwargs):
        return ((x.shape, np.complex128),)

    def wrong_T_abstract(ct, **kwargs):
        return (((7,), np.complex128),)

    op = jaxbind.get_linear_call(rotate, rotate, forward_abstract, wrong_T_abstract)
    with pytest.raises(ValueError, match=r"op 'rotate' \(transpose callback 'rotate'\).*shape \(7,\).*shape \(3,\)"):
        jax.grad(lambda v: jnp.sum(jnp.imag(op(v)[0])))(jnp.ones(3))


@pytest.mark.parametrize(
    "shape, why",
    [
        ((3.7,), "dimensions are not all integers"),
        ((True, 2), "dimensions are not all integers"),
        ((np.float64(3),), "dimensions are not all integers"),
        (("3",), "dimensions are not all integers"),
        ((2**40, 2**40), r"bytes, more than this machine's memory"),
        ((2**64,), r"bytes, more than this machine's memory"),
        ((2**40,), r"bytes, more than this machine's memory"),
    ],
)
def test_abstract_declaring_an_absurd_shape_fails_before_xla_sees_it(shape, why):
    # Before: (3.7,) became (3,) and (True, 2) became (1, 2) silently; (2**40, 2**40)
    # aborted the process inside XLA; the others failed without the op's name.
    op = jaxbind.get_linear_call(ident, ident, lambda x: ((shape, x.dtype),), same_shape)
    with pytest.raises((TypeError, ValueError), match=r"op 'ident'.*" + why):
        jax.jit(lambda x: op(x)[0]).lower(jnp.ones(2))
    np_dims = lambda x: ((np.array([2, 3]), x.dtype),)  # NumPy integers are dimensions
    op = jaxbind.get_linear_call(ident, ident, np_dims, same_shape)
    assert jax.eval_shape(lambda x: op(x)[0], jnp.ones(2)).shape == (2, 3)


def product(out, args, kwargs_dump):
    out[0][...] = args[0] * args[1]


def two_like_first(a, b, ct):
    return ((a.shape, a.dtype), (b.shape, b.dtype))


@pytest.mark.parametrize("declared", [1, 3])
def test_reverse_abstract_declaring_too_few_or_too_many_cotangents(declared):
    # Before: too few died with a bare IndexError, too many were ignored.
    def abstract_reverse(a, b, ct):
        return ((a.shape, a.dtype),) * declared

    op = jaxbind.get_nonlinear_call(
        product, (product, product), lambda a, b, *t: ((a.shape, a.dtype),), abstract_reverse
    )
    with pytest.raises(
        ValueError,
        match=rf"op 'product' \(vjp callback 'product'\): its abstract function "
        rf"'abstract_reverse' declares {declared} output\(s\).*cotangents of "
        r"2 linear argument\(s\) \(argument 0, argument 1\)",
    ):
        jax.grad(lambda a, b: jnp.sum(op(a, b)[0]), argnums=1)(jnp.ones(3), jnp.ones(3))


def test_transpose_abstract_declaring_too_few_cotangents():
    def split(out, args, kwargs_dump):
        out[0][...] = args[0]
        out[1][...] = args[0]

    def add(out, args, kwargs_dump):
        out[0][...] = args[0] + args[1]

    op = jaxbind.get_linear_call(add, split, lambda a, b: ((a.shape, a.dtype),), same_shape)
    with pytest.raises(
        ValueError,
        match=r"op 'add' \(transpose callback 'split'\): its abstract function "
        r"'same_shape' declares 1 output\(s\).*2 linear argument\(s\)",
    ):
        jax.grad(lambda a, b: jnp.sum(op(a, b)[0]), argnums=1)(jnp.ones(3), jnp.ones(3))


def test_wrong_cotangent_shape_names_the_ops_own_argument():
    # Before: "argument 2" for an op with arguments 0 and 1 (the index among the vjp's inputs).
    def abstract_reverse(a, b, ct):
        return ((a.shape, a.dtype), ((5,), b.dtype))

    op = jaxbind.get_nonlinear_call(
        product, (product, product), lambda a, b, *t: ((a.shape, a.dtype),), abstract_reverse
    )
    with pytest.raises(
        ValueError, match=r"shape \(5,\) for the cotangent of argument 1, but that argument has shape \(3,\)"
    ):
        jax.grad(lambda a, b: jnp.sum(op(a, b)[0]), argnums=1)(jnp.ones(3), jnp.ones(3))


def test_abstract_that_does_not_take_the_tangents_says_so():
    def abstract(a, b):  # also describes f_jvp, which receives the tangents too
        return ((a.shape, a.dtype),)

    op = jaxbind.get_nonlinear_call(product, (product, product), abstract, two_like_first)
    np.testing.assert_array_equal(op(jnp.ones(2), jnp.full(2, 3.0))[0], np.full(2, 3.0))  # the call is right
    with pytest.raises(
        TypeError,
        match=r"op 'product' \(jvp callback 'product'\): its abstract function "
        r"'abstract' is called with 4 array arguments \(the 2 primal\(s\), then "
        r"the tangents of the 2 differentiable argument\(s\)\).*signature",
    ) as info:
        jax.jvp(lambda a, b: op(a, b)[0], (jnp.ones(2), jnp.ones(2)), (jnp.ones(2), jnp.ones(2)))
    assert "Check the number of arguments passed to the op" not in str(info.value)


def test_op_jointly_linear_in_an_int_and_a_float_argument_differentiates_in_the_float_one():
    # Before: "argument 0 has dtype float0, which jaxbind cannot pass to a callback".
    def add(out, args, kwargs_dump):
        out[0][...] = args[0] + args[1]

    def add_T(out, args, kwargs_dump):
        out[0][...] = args[0].astype(out[0].dtype)
        out[1][...] = args[0]

    op = jaxbind.get_linear_call(
        add, add_T, lambda a, b: ((b.shape, b.dtype),), lambda ct: ((ct.shape, np.int32), (ct.shape, ct.dtype))
    )
    counts = jnp.arange(3, dtype=jnp.int32)
    y = jnp.array([0.5, 1.5, 2.5])
    np.testing.assert_array_equal(op(counts, y)[0], np.arange(3) + np.array([0.5, 1.5, 2.5]))
    w = jnp.array([1.0, -2.0, 3.0])
    np.testing.assert_array_equal(jax.grad(lambda y: jnp.dot(w, op(counts, y)[0]))(y), w)
    _, tangent = jax.jvp(lambda y: op(counts, y)[0], (y,), (w,))
    np.testing.assert_array_equal(tangent, w)


@pytest.mark.parametrize("declared", [1, 3])
@pytest.mark.parametrize("batching", ["walked", "self"])
def test_cotangent_count_is_checked_under_vmap_too(declared, batching):
    self_batched = batching == "self"

    def axis_of(batch_axes):
        return () if batch_axes is None else (batch_axes[0][-1],)

    def forward_abstract(a, b, *tangents, batch_axes=None):
        return ((a.shape, a.dtype) + axis_of(batch_axes),)

    def abstract_reverse(a, b, ct, batch_axes=None):
        return ((a.shape, a.dtype) + axis_of(batch_axes),) * declared

    def product_any(out, args, kwargs_dump):
        out[0][...] = args[0] * args[1]

    op = jaxbind.get_nonlinear_call(
        product_any, (product_any, product_any), forward_abstract, abstract_reverse, func_can_batch=self_batched
    )
    loss = lambda a, b: jnp.sum(jax.vmap(lambda a, b: op(a, b)[0])(a, b))
    with pytest.raises(ValueError, match=rf"declares {declared} output\(s\).*2 linear argument\(s\)"):
        jax.grad(loss, argnums=1)(jnp.ones((2, 3)), jnp.ones((2, 3)))


def test_a_batch_of_outputs_larger_than_memory_fails_before_xla_sees_it():
    # Each element fits, the walked batch of them does not.
    op = jaxbind.get_linear_call(ident, ident, lambda x: (((2**15, 2**15), x.dtype),), same_shape)
    assert jax.eval_shape(lambda x: op(x)[0], jnp.ones(2, jnp.float32)).shape == (2**15, 2**15)  # 4 GiB
    big = jax.ShapeDtypeStruct((2**12, 2), jnp.float32)
    with pytest.raises(ValueError, match=r"op 'ident'.*bytes, more than this machine's memory"):
        jax.jit(jax.vmap(lambda x: op(x)[0])).lower(big)


# ---------------------------------------------------------------------------
# Callbacks that are not f(out, args, kwargs_dump); outputs of another shape than the abstract's
# ---------------------------------------------------------------------------

FORM = (
    r".*jaxbind calls a callback as f\(out, args, kwargs_dump\), with 3 positional arguments: it writes "
    r"its results into the arrays of `out`.*jaxbind\.pure_callback\(f, result_shape_dtypes, \*args\) "
    r"takes\."
)


def one_argument(x):
    return np.sin(x)


def keyword_only(out, args, kwargs_dump, *, mode):
    out[0][...] = args[-1]


# Each place a callback goes: (make an op with `bad` there, what the message calls it).
PLACES = {
    "nonlinear f": (lambda bad: jaxbind.get_nonlinear_call(bad, None, same_shape, None, name="e"), "f"),
    "linear f": (lambda bad: jaxbind.get_linear_call(bad, ident, same_shape, same_shape, name="e"), "f"),
    "f_T": (lambda bad: jaxbind.get_linear_call(ident, bad, same_shape, same_shape, name="e"), "f_T"),
    "f_T[1]": (
        lambda bad: jaxbind.get_linear_call(ident, (ident, bad), same_shape, (same_shape, same_shape), name="e"),
        r"f_T\[1\]",
    ),
    "f_jvp": (
        lambda bad: jaxbind.get_nonlinear_call(ident, (bad, ident), same_shape, same_shape, name="e"),
        r"f_jvp \(f_derivative\[0\]\)",
    ),
    "f_vjp": (
        lambda bad: jaxbind.get_nonlinear_call(ident, (ident, bad), same_shape, same_shape, name="e"),
        r"f_vjp \(f_derivative\[1\]\)",
    ),
}
NOT_CALLBACKS = {  # a callable that provably cannot be f(out, args, kwargs_dump), and why
    "np.sin": (
        np.sin,
        r"it is a NumPy ufunc of 1 input\(s\) and 1 output\(s\), which takes from 1 to 2 "
        r"positional arguments, not 3",
    ),
    "f(x)": (
        one_argument,
        r"its signature is \(x\), and a call with 3 positional arguments fails \(too many "
        r"positional arguments\)",
    ),
    # (Python 3.13 says "a required keyword-only argument")
    "keyword-only": (
        keyword_only,
        r"its signature is \(out, args, kwargs_dump, \*, mode\), and a call with 3 "
        r"positional arguments fails \(missing a required (keyword-only )?argument: 'mode'\)",
    ),
    "lambda x, y": (
        lambda x, y: x,
        r"its signature is \(x, y\), and a call with 3 positional arguments fails "
        r"\(too many positional arguments\)",
    ),
}


@pytest.mark.parametrize("bad", list(NOT_CALLBACKS))
@pytest.mark.parametrize("place", list(PLACES))
def test_a_callback_that_cannot_take_its_three_arguments_is_refused_when_the_op_is_made(place, bad):
    make, what = PLACES[place]
    callback, why = NOT_CALLBACKS[bad]
    name = callback.__name__
    with pytest.raises(
        TypeError,
        match=rf"^jaxbind op 'e': {what} \('{re.escape(name)}'\) cannot be called as "
        rf"a callback, f\(out, args, kwargs_dump\): {why}\. " + FORM + "$",
    ):
        make(callback)


class Unreadable:
    """A callable whose signature inspect cannot read (as some extension types')."""

    __signature__ = "not a signature"

    def __call__(self, x):
        return x


def test_callbacks_that_can_or_might_take_three_arguments_are_accepted():
    class Bound:
        def call(self, out, args, kwargs_dump):
            out[0][...] = 2 * args[0]

    accepted = [
        lambda *a: ident(*a),
        functools.partial(lambda scale, out, args, kd: ident(out, args, kd), 2),
        Bound().call,
        np.add,
        Unreadable(),
        lambda out, args, kwargs_dump, extra=None: None,
    ]
    for callback in accepted:
        jaxbind.get_nonlinear_call(callback, None, same_shape, None, name="accepted")
    op = jaxbind.get_nonlinear_call(Bound().call, None, same_shape, None)
    np.testing.assert_array_equal(op(jnp.arange(3.0))[0], 2 * np.arange(3.0))


def test_the_check_takes_the_number_of_arguments_a_callback_gets():
    from jaxbind._arguments import as_callback

    four = ("out", "args", "kwargs_dump", "state")
    assert as_callback(lambda out, args, kwargs_dump, state: None, "f", "e", four) is not None
    with pytest.raises(
        TypeError,
        match=r"cannot be called as a callback, f\(out, args, kwargs_dump, state\): "
        r".*with 4 positional arguments",
    ):
        as_callback(ident, "f", "e", four)


def test_a_callback_that_fails_to_take_its_arguments_says_what_a_callback_is():
    # Its signature could not be read when the op was made: the call fails, and says why.
    op = jaxbind.get_linear_call(ident, Unreadable(), same_shape, same_shape, name="unreadable")
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.grad(lambda x: jnp.sum(op(x)[0]))(jnp.ones(3))
    lines = str(info.value).splitlines()
    assert lines[0] == (
        "INTERNAL: jaxbind op 'unreadable' (transpose callback 'Unreadable'): the callback raised "
        "TypeError: Unreadable.__call__() takes 2 positional arguments but 4 were given"
    )
    assert re.match(r"^\(The callback could not be called with jaxbind's arguments\. " + FORM + r"\)$", lines[1])

    def calls_wrongly(out, args, kwargs_dump):  # a TypeError about arguments from its own code
        out[0][...] = one_argument(args[0], 2)

    op = jaxbind.get_nonlinear_call(calls_wrongly, None, same_shape, None)
    with pytest.raises(jax.errors.JaxRuntimeError, match="one_argument") as info:
        op(jnp.ones(3))
    assert "jaxbind calls a callback as" not in str(info.value)


def matvec(out, args, kwargs_dump):
    out[0][...] = args[0].sum(axis=-1)
    out[1][...] = args[0] @ args[1]


def declares_one_too_many(A, x):  # output 1's length taken from the wrong axis
    return (((A.shape[0],), A.dtype), ((A.shape[0] + 1,), np.dtype(np.float32)))


@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
def test_an_output_of_another_shape_than_declared_names_the_output_and_both_shapes(how):
    op = jaxbind.get_nonlinear_call(matvec, None, declares_one_too_many, None, name="mv")
    A, x = jnp.ones((3, 2)), jnp.ones(2)
    run = {
        "eager": lambda: op(A, x),
        "jit": lambda: jax.jit(op)(A, x),
        "vmap": lambda: jax.vmap(op, in_axes=(None, 0))(A, jnp.ones((5, 2))),
    }[how]
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.block_until_ready(run())
    lines = str(info.value).splitlines()
    assert lines[0] == (
        "INTERNAL: jaxbind op 'mv': the callback raised ValueError: could not broadcast input "
        "array from shape (3,) into shape (4,)"
    )
    assert lines[1] == (
        "(The callback wrote an array of shape (3,) into output 1, which the abstract declares "
        "with shape (4,) and dtype float32: check that the abstract declares the shape the "
        "callback computes.)"
    )


def test_a_ufunc_writing_into_an_output_of_another_shape_names_it_as_likely():
    def doubled(out, args, kwargs_dump):
        np.multiply(args[0], 2, out=out[0])

    op = jaxbind.get_nonlinear_call(doubled, None, lambda x: (((x.shape[0] + 1,), x.dtype),), None, name="dbl")
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        op(jnp.ones(3))
    assert str(info.value).splitlines()[1] == (
        "(If the last of these arrays is output 0, which the abstract declares with shape (4,) and dtype "
        "float64, the callback computed shape (3,) for it: check that the abstract declares the shape the "
        "callback computes.)"
    )


def test_a_broadcast_error_of_the_callbacks_own_arrays_gets_no_hint():
    def mismatched(out, args, kwargs_dump):
        out[0][...] = args[0] + np.ones(4)  # its own arrays do not broadcast; no output is involved

    op = jaxbind.get_nonlinear_call(mismatched, None, same_shape, None)
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        op(jnp.ones(3))
    lines = str(info.value).splitlines()
    assert "operands could not be broadcast together" in lines[0] and lines[1] == "Traceback (most recent call last):"

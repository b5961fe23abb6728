"""Eager calls, op(x) on concrete arrays: after the first call, a call without kwargs on JAX or
NumPy arrays goes straight to the op's jitted call. It must give the same values, raise the
same errors, compile nothing, leave traced calls alone and free what it holds with the op."""

import concurrent.futures
import gc
import inspect
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind
from jaxbind import _op

like = lambda *args, **kwargs: ((args[-1].shape, args[-1].dtype),)


def tripling(out, args, kwargs_dump):
    out[0][...] = 3 * args[-1]


def failing_on_negative(out, args, kwargs_dump):
    if np.any(args[0] < 0):
        raise ArithmeticError("negative input")
    out[0][...] = args[0]


def collect():
    for _ in range(3):
        gc.collect()


class CompileCounter:
    """Counts XLA compilations while active (JAX's monitoring events)."""

    def __enter__(self):
        self.n = 0

        def listen(event, _, **kwargs):
            if event.endswith("backend_compile_duration"):
                self.n += 1

        jax.monitoring.register_event_duration_secs_listener(listen)
        return self

    def __exit__(self, *exc):
        jax.monitoring.clear_event_listeners()


def test_repeated_eager_calls_match_and_compile_nothing():
    op = jaxbind.get_linear_call(tripling, tripling, like, like, name="eager_repeat")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 3)))
    n = np.asarray(rng.standard_normal((2, 3)))
    np.testing.assert_allclose(op(x)[0], 3 * np.asarray(x))
    np.testing.assert_allclose(op(n)[0], 3 * n)
    with CompileCounter() as counter:
        for _ in range(3):
            np.testing.assert_allclose(op(x)[0], 3 * np.asarray(x))
            np.testing.assert_allclose(op(n)[0], 3 * n)  # (a NumPy array: the same executable)
            np.testing.assert_allclose(op(x, factor=1)[0], 3 * np.asarray(x))  # kwargs: the keyed way
            np.testing.assert_allclose(op(2.5)[0], 7.5)  # a scalar: the checked way
    assert counter.n == 2  # the kwargs' call and the scalar's, once each
    # other shapes and dtypes are other programs of the same jitted call
    y = jnp.arange(5, dtype=jnp.float32)
    np.testing.assert_allclose(op(y)[0], 3 * np.arange(5, dtype=np.float32))
    assert op(y)[0].dtype == jnp.float32


def test_a_failing_callback_raises_alike_on_every_eager_call():
    op = jaxbind.get_nonlinear_call(failing_on_negative, None, like, None, name="eager_fails")
    np.testing.assert_allclose(op(jnp.ones(2))[0], np.ones(2))
    messages = []
    for _ in range(3):  # the first failing call, then calls that reuse the executable
        with pytest.raises(jax.errors.JaxRuntimeError, match="op 'eager_fails'") as info:
            jax.block_until_ready(op(-jnp.ones(2)))
        assert "ArithmeticError: negative input" in str(info.value)
        messages.append(str(info.value).split("\n")[0])
    assert len(set(messages)) == 1
    np.testing.assert_allclose(op(jnp.full(2, 4.0))[0], np.full(2, 4.0))  # and it still runs


def test_misuse_after_eager_calls_is_still_refused():
    op = jaxbind.get_linear_call(tripling, tripling, like, like, name="eager_misuse")
    op(jnp.ones(2))
    op(jnp.ones(2))
    with pytest.raises(TypeError, match="op 'eager_misuse': argument 0 is a list"):
        op([1.0, 2.0])
    with pytest.raises(TypeError, match="op 'eager_misuse'.*must be arrays"):
        op("text")


def test_traced_calls_after_eager_calls_bind_the_op_itself():
    op = jaxbind.get_linear_call(tripling, tripling, like, like, name="eager_then_traced")
    x = jnp.arange(3.0)
    op(x)
    op(x)
    jaxpr = jax.make_jaxpr(lambda v: op(v)[0])(x)
    assert [e.primitive.name for e in jaxpr.eqns] == ["jaxbind"]  # not a nested jitted call
    np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(op(v)[0] ** 2))(x), 18 * np.asarray(x))
    np.testing.assert_allclose(jax.vmap(lambda v: op(v)[0])(jnp.ones((2, 3))), 3 * np.ones((2, 3)))
    np.testing.assert_allclose(jax.jit(lambda v: op(v)[0])(x), 3 * np.asarray(x))


def test_an_entry_evicted_by_age_keeps_serving_its_op():
    op = jaxbind.get_linear_call(tripling, tripling, like, like, name="eager_evicted")
    x = jnp.ones(2)
    op(x)
    op(x)
    other = jaxbind.get_linear_call(tripling, tripling, like, like, name="eager_evictor")
    for k in range(_op.EAGER_CACHE_SIZE + 1):  # pushes op's entry out of the cache
        other(x, k=k)
    assert not any(key[0].op == op.definition for key in _op._EAGER)
    with CompileCounter() as counter:
        np.testing.assert_allclose(op(x)[0], 3 * np.ones(2))
    assert counter.n == 0


def test_an_op_whose_callback_holds_it_is_freed_after_eager_calls():
    big = np.full(10**6, 2.0)
    ref_big = weakref.ref(big)
    holder = {}

    def apply(out, args, kwargs_dump):  # holds the op, through `holder`
        assert holder["op"] is not None  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
        out[0][...] = big[: args[0].size] * args[0]  # noqa: F821  (a closure over a name deleted later, to drop its last reference)

    op = jaxbind.get_nonlinear_call(apply, None, like, None, name="eager_self_holding")
    holder["op"] = op
    for _ in range(3):
        np.testing.assert_allclose(op(jnp.ones(4))[0], 2 * np.ones(4))
    # the jitted call the fast path runs: a reference leaked anywhere (the compiled core, the
    # eager cache) keeps it, and JAX's caches with it, though the op and its callback are gone
    ref_call = weakref.ref(op._plain[1])
    ref_op = weakref.ref(op)
    del op, apply, big, holder
    collect()
    assert ref_op() is None and ref_big() is None
    assert ref_call() is None


def weighted_sum(out, args, kwargs_dump):
    weights = jaxbind.load_kwargs(kwargs_dump)["weights"]
    out[0][...] = sum(w * a for w, a in zip(weights, args))


def test_calls_with_many_arguments_and_kwargs_after_eager_calls():
    # Op.__call__ (the compiled core) hands every call it does not serve itself to the Python
    # method with all its positional and keyword arguments; eighteen of them (and self) overflow
    # its stack.
    op = jaxbind.get_nonlinear_call(
        weighted_sum, None, lambda *a, weights: ((a[0].shape, a[0].dtype),), None, name="eager_many"
    )
    rng = np.random.default_rng(3)
    xs = [jnp.asarray(rng.standard_normal(3)) for _ in range(17)]
    weights = [float(k + 1) for k in range(17)]
    expected = sum(w * np.asarray(x) for w, x in zip(weights, xs))
    for _ in range(3):
        np.testing.assert_allclose(op(*xs, weights=weights)[0], expected)
    # an arity the op has a jitted call for, then the same arguments with another kwarg value
    np.testing.assert_allclose(
        op(*xs, weights=weights[::-1])[0], sum(w * np.asarray(x) for w, x in zip(weights[::-1], xs))
    )


def test_op_call_is_a_method_with_the_documented_signature():
    op = jaxbind.get_linear_call(tripling, tripling, like, like, name="eager_method")
    x = jnp.arange(2.0)
    for call in (op, op.__call__, lambda v: type(op).__call__(op, v)):
        for _ in range(2):
            np.testing.assert_allclose(call(x)[0], 3 * np.arange(2.0))
    assert "Call the op" in jaxbind.Op.__call__.__doc__
    assert list(inspect.signature(jaxbind.Op.__call__).parameters) == ["self", "args", "kwargs"]
    with pytest.raises(TypeError, match="__call__"):
        jaxbind.Op.__call__(object(), x)  # not an op: refused, nothing read off it


def test_eager_calls_from_several_threads():
    op = jaxbind.get_linear_call(tripling, tripling, like, like, name="eager_threads")
    rng = np.random.default_rng(4)
    inputs = [jnp.asarray(rng.standard_normal(4)) for _ in range(8)]

    def run(k):
        x = inputs[k % len(inputs)]
        return all(np.allclose(op(x)[0], 3 * np.asarray(x)) for _ in range(100))

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(16)))


def adding(out, args, kwargs_dump):
    out[0][...] = args[0] + args[1]


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int32, np.complex128])
def test_numpy_arrays_in_the_other_byte_order_give_their_values_on_every_path(dtype):
    # JAX refuses such an array on a first call and reads its bytes as native ones on
    # a warm one (jax.jit(f)(x) then computes with garbage); an op copies it into native
    # order, the slow path and the fast path alike (which leaves such arrays to the slow one).
    op = jaxbind.get_nonlinear_call(adding, None, like, None, name="eager_byte_order")
    dtype = np.dtype(dtype)
    x = np.arange(6).astype(dtype) * (1 - 2j if dtype.kind == "c" else 1)
    swapped = x.astype(dtype.newbyteorder("S"))
    assert not swapped.dtype.isnative and np.array_equal(swapped, x)
    one = np.ones(6, dtype)
    results = [op(swapped, one)[0]]  # cold
    op(x, one)
    op(x, one)  # the fast path armed for two NumPy arrays
    results.append(op(swapped, one)[0])
    results.append(op(one, swapped)[0])
    results.append(op(swapped[::2], one[::2])[0])  # not contiguous either
    results.append(op(swapped, one, scale=1)[0])  # kwargs: the keyed way
    results.append(jax.jit(lambda v: op(swapped, v)[0])(jnp.asarray(one)))  # a constant of a traced call
    for got in results:
        assert got.dtype == dtype  # native: JAX's dtype of it
        want = x + 1 if got.shape == x.shape else x[::2] + 1
        np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize(
    "value",
    [
        np.array([1.0, 2.0], dtype=object),
        np.array(["a", "b"]),
        np.zeros(2, dtype=[("a", "<f8")]),
        np.arange(2).astype("M8[s]"),
        np.str_("a"),
    ],
    ids=["object", "str", "structured", "datetime", "np.str_"],
)
def test_numpy_dtypes_jax_has_no_type_for_are_refused_alike_on_every_path(value):
    op = jaxbind.get_nonlinear_call(adding, None, like, None, name="eager_no_jax_dtype")
    one = np.ones(2)
    op(one, one)
    messages = set()
    for _ in range(3):  # the fast path armed for two NumPy arrays: it leaves these to the slow one
        with pytest.raises(
            TypeError,
            match=rf"jaxbind op 'eager_no_jax_dtype': argument 1 is a NumPy "
            rf"{type(value).__name__} of dtype .*which JAX cannot pass",
        ):
            op(one, value)
        with pytest.raises(TypeError, match=r"jaxbind op 'eager_no_jax_dtype': argument 1 .*JAX cannot"):
            op(one, value, scale=1)
        with pytest.raises(TypeError) as info:
            op(one, value)
        messages.add(str(info.value))
    assert len(messages) == 1


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_numpy_arrays_of_ml_dtypes_pass_on_every_path(name):
    # NumPy gives these dtypes of JAX's the void kind, as it gives structured ones: they are
    # passed, as jax.jit passes them, not refused with the dtypes JAX has no type for.
    dtype = np.dtype(getattr(jnp, name))
    op = jaxbind.get_nonlinear_call(adding, None, like, None, name="eager_ml_dtypes")
    x, one = np.arange(4).astype(dtype), np.ones(4, dtype)
    want = jax.jit(jnp.add)(x, one)
    results = [op(x, one)[0], op(x, one)[0], op(x, one, scale=1)[0]]
    try:  # as a constant of a traced call, where JAX can embed one (jax 0.5's XLA fails on float8 ones)
        jax.jit(lambda v: jnp.add(x, v))(one)
    except Exception:
        pass
    else:
        results.append(jax.jit(lambda v: op(x, v)[0])(one))
    for got in results:
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_float0_numpy_arrays_pass_on_every_path():
    # float0 (the tangent dtype of integers) is a NumPy void dtype that JAX takes: it is not
    # refused with the structured ones (the fast path leaves it to the slow one, which passes it).
    def first(out, args, kwargs_dump):
        out[0][...] = args[0]

    op = jaxbind.get_nonlinear_call(first, None, lambda x, z: ((x.shape, x.dtype),), None, name="eager_float0")
    x, z = np.arange(2.0), np.zeros(2, jax.dtypes.float0)
    for _ in range(3):
        np.testing.assert_array_equal(op(x, z)[0], x)


def test_a_call_without_kwargs_never_runs_the_program_of_one_with_kwargs():
    # The fast path keeps one jitted call per arity, for calls without kwargs only: a call with
    # kwargs between them must neither fill it nor be served by it, in either order.
    def scaling(out, args, kwargs_dump):
        out[0][...] = jaxbind.load_kwargs(kwargs_dump).get("factor", 2.0) * args[0]

    op = jaxbind.get_nonlinear_call(scaling, None, like, None, name="eager_kwargs_between")
    x = np.arange(3.0)
    for _ in range(3):  # kwargs first, then none, then kwargs again, each on a warm path
        np.testing.assert_array_equal(op(x, factor=5.0)[0], 5 * x)
        np.testing.assert_array_equal(op(x)[0], 2 * x)
        np.testing.assert_array_equal(op(jnp.asarray(x))[0], 2 * x)
        np.testing.assert_array_equal(op(jnp.asarray(x), factor=7.0)[0], 7 * x)

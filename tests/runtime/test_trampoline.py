"""The compiled trampoline: dtypes, array views, call-site ids, errors from callbacks, threads."""

import ctypes
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo
from _shared import errors_in_threads, sample

import jaxbind

ALL_DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]


def same_shape(*args, **kwargs):
    return tuple((a.shape, a.dtype) for a in args)


def copy_into(out, args, kwargs_dump):
    for o, a in zip(out, args):
        o[...] = a


copy_op = jaxbind.get_linear_call(copy_into, copy_into, same_shape, same_shape)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_dtype_reaches_the_callback_and_back(dtype):
    seen = {}

    def negate_or_flip(out, args, kwargs_dump):
        seen["dtype"] = args[0].dtype
        seen["shape"] = args[0].shape
        if args[0].dtype == np.bool_:
            np.logical_not(args[0], out=out[0])
        else:
            out[0][...] = args[0] * 3

    op = jaxbind.get_linear_call(negate_or_flip, negate_or_flip, same_shape, same_shape)
    x = sample(dtype, (3, 4))
    y = np.asarray(jax.jit(op)(jnp.asarray(x))[0])
    expected = np.logical_not(x) if x.dtype == np.bool_ else (x * 3).astype(x.dtype)
    assert y.dtype == jnp.dtype(dtype)
    assert seen == {"dtype": jnp.dtype(dtype), "shape": (3, 4)}
    np.testing.assert_array_equal(
        y.astype(np.float64) if dtype == "bfloat16" else y,
        expected.astype(np.float64) if dtype == "bfloat16" else expected,
    )


def test_mixed_dtypes_many_inputs_and_outputs():
    def stats(out, args, kwargs_dump):
        ints, reals, flags = args
        out[0][...] = ints.sum()
        out[1][...] = reals * flags
        out[2][...] = reals.astype(np.complex64) * 1j

    def stats_abstract(ints, reals, flags, **kwargs):
        return (((), ints.dtype), (reals.shape, reals.dtype), (reals.shape, np.complex64))

    op = jaxbind.get_nonlinear_call(stats, (stats, stats), stats_abstract, stats_abstract, first_n_args_fixed=3)
    ints = np.arange(5, dtype=np.int32)
    reals = np.linspace(0, 1, 4, dtype=np.float32)
    flags = np.array([True, False, True, True])
    total, masked, imag = jax.jit(op)(ints, reals, flags)
    assert total.dtype == np.int32 and int(total) == 10
    np.testing.assert_array_equal(masked, reals * flags)
    np.testing.assert_array_equal(imag, reals.astype(np.complex64) * 1j)


def test_inputs_are_read_only_views_and_outputs_writable():
    report = {}

    def inspect_views(out, args, kwargs_dump):
        report["in_writeable"] = args[0].flags.writeable
        report["out_writeable"] = out[0].flags.writeable
        report["in_contiguous"] = args[0].flags.c_contiguous
        report["owns"] = args[0].flags.owndata or out[0].flags.owndata
        try:
            args[0][0] = 0.0
        except ValueError as err:
            report["write_error"] = str(err)
        out[0][...] = args[0]

    op = jaxbind.get_linear_call(inspect_views, inspect_views, same_shape, same_shape)
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(jax.jit(op)(x)[0], x)
    assert report["in_writeable"] is False and report["out_writeable"] is True
    assert report["in_contiguous"] and not report["owns"]
    assert "read-only" in report["write_error"]


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,)])
def test_zero_dim_and_zero_size_arrays(shape):
    calls = []

    def double(out, args, kwargs_dump):
        calls.append(args[0].shape)
        np.multiply(args[0], 2, out=out[0])

    op = jaxbind.get_linear_call(double, double, same_shape, same_shape)
    x = sample("float64", shape, seed=3)
    y = jax.jit(op)(jnp.asarray(x))[0]
    assert y.shape == shape
    np.testing.assert_allclose(y, 2 * x)
    # XLA may fold away a call whose outputs are empty; otherwise it runs once.
    assert calls == [shape] or (x.size == 0 and calls == [])


def test_kwargs_reach_callback_and_abstract():
    received = {}

    def shift(out, args, kwargs_dump):
        kw = jaxbind.load_kwargs(kwargs_dump)
        received.update(kw)
        out[0][...] = args[0] * kw["factor"] + np.asarray(kw["offsets"]).sum()

    def shift_abstract(x, *, factor, offsets, label):
        assert label == "tag"
        return ((x.shape, x.dtype),)

    op = jaxbind.get_linear_call(shift, shift, shift_abstract, shift_abstract)
    x = jnp.arange(3.0)
    offsets = np.array([1.0, 2.0])
    y = jax.jit(lambda x: op(x, factor=2.0, offsets=offsets, label="tag")[0])(x)
    np.testing.assert_allclose(y, 2 * np.arange(3.0) + 3.0)
    assert received["factor"] == 2.0 and received["label"] == "tag"
    np.testing.assert_array_equal(received["offsets"], offsets)


def test_repeated_kwargs_values_do_not_recompile():
    traces = []

    def scale(out, args, kwargs_dump):
        out[0][...] = args[0] * jaxbind.load_kwargs(kwargs_dump)["factors"][0]

    def scale_abstract(x, **kwargs):
        traces.append(1)
        return ((x.shape, x.dtype),)

    op = jaxbind.get_linear_call(scale, scale, scale_abstract, scale_abstract)
    x = jnp.ones(3)
    sites_before = jaxbind._trampoline.num_sites()
    for _ in range(3):
        np.testing.assert_allclose(op(x, factors=[2.0, 5.0])[0], 2 * np.ones(3))
    np.testing.assert_allclose(op(x, factors=np.array([4.0]))[0], 4 * np.ones(3))
    np.testing.assert_allclose(op(x, factors=np.array([4.0]))[0], 4 * np.ones(3))
    # the order kwargs are written in does not matter either
    np.testing.assert_allclose(op(x, factors=[3.0], tag="a")[0], 3 * np.ones(3))
    np.testing.assert_allclose(op(x, tag="a", factors=[3.0])[0], 3 * np.ones(3))
    # one trace and one call site per distinct value, none for repeats
    assert len(traces) == 3
    assert jaxbind._trampoline.num_sites() == sites_before + 3


def _triple(out, args, kwargs_dump):
    out[0][...] = 3 * args[0]


@pytest.mark.parametrize("kind", ["python", "native"])
def test_equal_ops_share_compiled_code(kind):
    traces = []

    def abstract(x, **kwargs):
        traces.append(1)
        return ((x.shape, x.dtype),)

    if kind == "python":
        f1 = f2 = _triple
        kwargs, factor = {}, 3.0
    else:  # two forms of one kernel (the forms that make equal kernels: test_user_kernels.py)
        lib = zoo.LIB
        f1, f2 = lib.jb_scale, jaxbind.native(ctypes.cast(lib.jb_scale, ctypes.c_void_p).value, name="jb_scale")
        kwargs, factor = {"factor": 3.0}, 3.0
    op1 = jaxbind.get_linear_call(f1, f1, abstract, abstract)
    op2 = jaxbind.get_linear_call(f2, f2, abstract, abstract)
    assert op1 == op2 and hash(op1) == hash(op2) and op1 is not op2
    other = jaxbind.get_linear_call(f1, f1, abstract, abstract, first_n_args_fixed=0, func_can_batch=True)
    assert op1 != other
    x = jnp.arange(4.0)
    np.testing.assert_allclose(op1(x, **kwargs)[0], factor * x)
    np.testing.assert_allclose(op2(x, **kwargs)[0], factor * x)
    assert len(traces) == 1


def test_ops_differing_only_in_their_callback_are_unequal_and_keep_their_own_code():
    def scaling_by(factor):
        def scale(out, args, kwargs_dump):  # the same __name__ for every factor
            out[0][...] = factor * args[0]

        return scale

    def abstract(x):
        return ((x.shape, x.dtype),)

    by_two, by_three = scaling_by(2.0), scaling_by(3.0)
    double = jaxbind.get_linear_call(by_two, by_two, abstract, abstract)
    triple = jaxbind.get_linear_call(by_three, by_three, abstract, abstract)
    assert double.name == triple.name == "scale"
    assert double != triple
    assert double == jaxbind.get_linear_call(by_two, by_two, abstract, abstract)
    x = jnp.arange(3.0)
    for call in (lambda op: op(x)[0], lambda op: jax.jit(lambda v: op(v)[0])(x)):
        np.testing.assert_array_equal(call(double), 2 * np.arange(3.0))
        np.testing.assert_array_equal(call(triple), 3 * np.arange(3.0))
    np.testing.assert_array_equal(jax.grad(lambda v: jnp.sum(triple(v)[0]))(x), np.full(3, 3.0))


def _fragile(out, args, kwargs_dump):
    if np.any(args[0] < 0):
        raise ZeroDivisionError("negative input is not allowed here")
    out[0][...] = args[0]


def _broken_T(out, args, kwargs_dump):
    raise KeyError("missing table")


@pytest.mark.parametrize("kind", ["python", "native"])
def test_a_failing_callback_names_the_op_and_the_process_survives(kind):
    """The error names the op and carries the callback's message (a Python exception, a
    kernel's jaxbind_fail), jitted, eager and under the batch walk; the next calls work."""
    if kind == "python":
        op = jaxbind.get_linear_call(_fragile, _fragile, same_shape, same_shape)
        kwargs, eager_kwargs = {}, {}
        message = eager_message = r"op '_fragile'.*ZeroDivisionError.*negative input is not allowed here"
        works = jax.jit(lambda x: op(x)[0])
    else:
        op = jaxbind.get_linear_call(zoo.LIB.jb_fail, zoo.LIB.jb_fail, same_shape, same_shape)
        kwargs, eager_kwargs = {"code": 42}, {}
        message = r"op 'jb_fail'.*kernel failed on purpose \(code=42\)"
        eager_message = r"op 'jb_fail'.*kernel failed on purpose \(code=-1\)"  # (the kwarg's default)
        works = jax.jit(lambda x: zoo.SCALE.apply("native", x)[0] / zoo.FACTOR)
    with pytest.raises(RuntimeError, match=message):
        jax.block_until_ready(jax.jit(lambda v: op(v, **kwargs)[0])(-jnp.ones(3)))
    with pytest.raises(RuntimeError, match=eager_message):
        jax.block_until_ready(op(-jnp.ones(3), **eager_kwargs)[0])
    with pytest.raises(RuntimeError, match=message):
        jax.block_until_ready(jax.vmap(lambda v: op(v, **kwargs)[0])(-jnp.ones((4, 2))))
    np.testing.assert_allclose(works(jnp.ones(3)), np.ones(3))


@pytest.mark.parametrize("kind", ["python", "native"])
def test_a_failing_transpose_is_named_as_the_ops_transpose(kind):
    if kind == "python":
        op = jaxbind.get_linear_call(_fragile, _broken_T, same_shape, same_shape)
        message = r"op '_fragile' \(transpose callback '_broken_T'\).*KeyError.*missing table"
    else:
        op = jaxbind.get_linear_call(zoo.LIB.jb_scale, zoo.LIB.jb_fail, same_shape, same_shape)
        message = r"op 'jb_scale' \(transpose callback 'jb_fail'\).*on purpose \(code=3\)"
    with pytest.raises(RuntimeError, match=message):
        jax.block_until_ready(jax.grad(lambda x: jnp.sum(op(x, code=3)[0]))(jnp.ones(2)))


def test_callback_returning_a_value_is_an_error():
    def returns(out, args, kwargs_dump):
        return args[0] * 2

    op = jaxbind.get_linear_call(returns, returns, same_shape, same_shape)
    with pytest.raises(RuntimeError, match=r"op 'returns'.*must return None.*out\[0\]\[\.\.\.\]"):
        jax.block_until_ready(op(jnp.ones(2))[0])


@pytest.mark.parametrize("kind", ["python", "native"])
def test_concurrent_calls_from_python_threads(kind):
    xsin = jax.jit(lambda v: zoo.NONLINEAR.apply(kind, v)[0])
    scale = jax.jit(lambda v: zoo.SCALE.apply(kind, v)[0])
    grad = jax.jit(jax.grad(lambda v: jnp.sum(zoo.NONLINEAR.apply(kind, v)[0])))
    # and kernels long enough to overlap (~0.1 ms of work per call)
    busy_op = jaxbind.get_linear_call(zoo.LIB.jb_busy, zoo.LIB.jb_busy, same_shape, same_shape)
    busy = jax.jit(lambda v: busy_op(v, iterations=2000)[0]) if kind == "native" else None
    busy_term = np.sin(np.arange(2000.0)).sum() / 2000
    for f in (xsin, scale, grad) + ((busy,) if busy else ()):
        f(jnp.ones(3))

    def calls(seed):
        for i in range(30):
            x = np.full(3, float(seed + i)) + np.arange(3.0)
            np.testing.assert_allclose(xsin(x), x * np.sin(x), rtol=1e-12)
            np.testing.assert_allclose(scale(x), zoo.FACTOR * x, rtol=1e-15)
            np.testing.assert_allclose(grad(x), np.sin(x) + x * np.cos(x), rtol=1e-12)
            if busy:
                np.testing.assert_allclose(busy(x), x + busy_term, rtol=1e-12, atol=1e-13)

    assert errors_in_threads(calls, 6) == []


def test_call_on_xla_worker_thread():
    # A program with independent work that XLA schedules on its own threads.
    threads = set()

    def add_one(out, args, kwargs_dump):
        threads.add(threading.get_ident())
        out[0][...] = args[0] + 1

    op = jaxbind.get_nonlinear_call(add_one, (add_one, add_one), same_shape, same_shape)

    @jax.jit
    def program(x, big):
        loop = jax.lax.fori_loop(0, 20, lambda i, v: op(v)[0], x)
        return loop, jnp.sum(jnp.sin(big))

    big = jnp.linspace(0, 1, 1 << 16)
    loop, total = program(jnp.zeros(4), big)
    np.testing.assert_allclose(loop, np.full(4, 20.0))
    np.testing.assert_allclose(total, np.sin(np.linspace(0, 1, 1 << 16)).sum(), rtol=1e-6)
    # the point of the test: the callback ran on a thread Python did not start
    assert threads and threading.main_thread().ident not in threads


def test_views_reused_between_calls_stay_correct_and_guarded():
    # The trampoline re-points the previous call's views when nobody holds
    # them; each call still sees its own data, and keeping one is still caught.
    kept = []

    def add_index(out, args, kwargs_dump):
        if jaxbind.load_kwargs(kwargs_dump)["keep"]:
            kept.append(out[0])
        out[0][...] = args[0] + np.arange(args[0].size).reshape(args[0].shape)

    op = jaxbind.get_linear_call(add_index, add_index, same_shape, same_shape)
    f = jax.jit(lambda x: op(x, keep=False)[0])
    for shape in [(3,), (3,), (2, 2), (3,)]:  # same site, new shapes on the way
        x = sample("float64", shape, seed=len(shape))
        np.testing.assert_allclose(f(jnp.asarray(x)), x + np.arange(x.size).reshape(shape))
    xs = sample("float64", (5, 3), seed=9)
    np.testing.assert_allclose(jax.vmap(f)(jnp.asarray(xs)), xs + np.arange(3))
    with pytest.raises(RuntimeError, match="kept a reference"):
        jax.block_until_ready(op(jnp.ones(3), keep=True)[0])
    kept.clear()
    np.testing.assert_allclose(f(jnp.ones(3)), 1 + np.arange(3))


def test_the_exception_type_a_failing_callback_raises_on_every_path():
    # What users get (jax 0.10.2): jax.errors.JaxRuntimeError, a RuntimeError, from
    # an eager call (first or cached), a jitted function's first call, and any call
    # whose program XLA runs on its worker threads. A jitted function that already
    # ran successfully, whose program XLA runs on the calling thread, raises what
    # JAX's C++ fast path makes of every runtime error: ValueError since jax 0.7.2
    # (jax-ml/jax#34083), exactly as for jax.pure_callback. The message is the same.
    def fails_on_negative(out, args, kwargs_dump):
        if args[0][0] < 0:
            raise ZeroDivisionError("negative input")
        out[0][...] = args[0]

    op = jaxbind.get_linear_call(fails_on_negative, fails_on_negative, same_shape, same_shape)
    message = r"op 'fails_on_negative'.*ZeroDivisionError: negative input"
    ok, bad = jnp.ones(3), -jnp.ones(3)

    def raised(fn, *args):
        with pytest.raises(Exception, match=message) as info:
            jax.block_until_ready(fn(*args))
        return type(info.value)

    def reference(x):  # the same failure through JAX's own callback
        def host(x):
            if x[0] < 0:
                raise ZeroDivisionError("negative input")
            return x

        return jax.pure_callback(host, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    eager = lambda x: op(x)[0]
    assert raised(eager, bad) is jax.errors.JaxRuntimeError  # first eager call
    eager(ok), eager(ok)
    assert raised(eager, bad) is jax.errors.JaxRuntimeError  # cached eager call

    first = jax.jit(lambda x: op(x)[0] * 2)
    assert raised(first, bad) is jax.errors.JaxRuntimeError  # a jitted function's first call

    y = jnp.ones((300, 300))  # other work: XLA runs the program on its worker threads
    wide = jax.jit(lambda x, y: (op(x)[0], jnp.sin(y) @ jnp.cos(y).T))
    wide(ok, y), wide(ok, y)
    assert raised(wide, bad, y) is jax.errors.JaxRuntimeError

    cached, cached_reference = jax.jit(lambda x: op(x)[0] * 3), jax.jit(reference)
    for fn in (cached, cached_reference):
        fn(ok), fn(ok)
    if JAX_VERSION >= (0, 7, 2):  # (before, jax.pure_callback's cached call raised the JaxRuntimeError)
        assert raised(cached, bad) is raised_reference_type(cached_reference, bad)
    assert issubclass(raised(cached, bad), (RuntimeError, ValueError))


JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3])


def raised_reference_type(fn, x):
    with pytest.raises(Exception, match="negative input") as info:
        jax.block_until_ready(fn(x))
    return type(info.value)

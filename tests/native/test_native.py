"""Native kernels: C functions that XLA calls with no Python and no GIL: dtype codes,
kwargs, errors, independent calls in one program.

The kernels come from ``tests/kernels/test_kernels.c`` (compiled for the tests by
``_kernels.py``). The op kinds under every transformation, native kernels beside Python
callbacks, are in ``transforms/test_zoo.py``; kernels compiled by the user, other forms of
a kernel, numba and concurrent kernels in ``test_user_kernels.py``. Every result is compared
with an independent reference written in jax.numpy or NumPy.
"""

import ctypes
import re

import _kernels
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from _shared import sample
from zoo import scale_op

import jaxbind

LIB = _kernels.load()


def assert_one_native_call(fn, *args):
    """The compiled program has one jaxbind custom call and no loop around it."""
    text = jax.jit(fn).lower(*args).as_text()
    assert text.count("@jaxbind_dispatch") == 1, text
    assert "stablehlo.while" not in text, text


def like_last(*args, **kwargs):
    """One output shaped like the last argument."""
    return ((args[-1].shape, args[-1].dtype),)


def like_first(*args, **kwargs):
    """One output shaped like the first argument."""
    return ((args[0].shape, args[0].dtype),)


# ---------------------------------------------------------------------------
# 4. jb_copy_any: every dtype reaches a kernel with its XLA code
# ---------------------------------------------------------------------------

DTYPE_CODES = {
    "bool": 1,
    "int8": 2,
    "int16": 3,
    "int32": 4,
    "int64": 5,
    "uint8": 6,
    "uint16": 7,
    "uint32": 8,
    "uint64": 9,
    "float16": 10,
    "float32": 11,
    "float64": 12,
    "complex64": 15,
    "bfloat16": 16,
    "complex128": 18,
    "float8_e5m2": 19,
    "float8_e4m3fn": 20,
    "float8_e4m3b11fnuz": 23,
    "float8_e5m2fnuz": 24,
    "float8_e4m3fnuz": 25,
    "float8_e4m3": 28,
    "float8_e3m4": 29,
}
FLOAT8 = [name for name in DTYPE_CODES if name.startswith("float8")]


def _have_dtype(name):
    try:
        jnp.dtype(name)
        return True
    except TypeError:
        return False


def copy_any_abstract(x, **kwargs):
    return ((x.shape, x.dtype), ((), np.int64))


copy_any_op = jaxbind.get_nonlinear_call(
    LIB.jb_copy_any, (LIB.jb_copy_any, LIB.jb_copy_any), copy_any_abstract, copy_any_abstract, first_n_args_fixed=1
)


@pytest.mark.parametrize("name", [n for n in DTYPE_CODES if _have_dtype(n)])
def test_copy_any_every_dtype(name):
    x = sample(name, (3, 5), full_range=True)
    y, code = jax.jit(lambda v: copy_any_op(v))(x)
    assert y.dtype == jnp.dtype(name) and y.shape == (3, 5)
    # byte for byte: no conversion on the way in or out
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8), x.view(np.uint8))
    assert code.dtype == np.int64 and code.shape == () and int(code) == DTYPE_CODES[name]


def test_every_non_float8_dtype_is_supported():
    # the brief: bool, int8..int64, uint8..uint64, float16, bfloat16, float32/64, complex64/128.
    # jaxbind itself maps each to its code (JAX having the dtype is not enough), and
    # an op passes each one through, both ways.
    from jaxbind._dtypes import SUPPORTED_DTYPES

    for name in DTYPE_CODES:
        if name not in FLOAT8:
            assert SUPPORTED_DTYPES.get(jnp.dtype(name)) == DTYPE_CODES[name], name
            x = sample(name, (2,), full_range=True)
            y, code = copy_any_op(x)
            np.testing.assert_array_equal(np.asarray(y).view(np.uint8), x.view(np.uint8))
            assert int(code) == DTYPE_CODES[name]


@pytest.mark.parametrize("name", ["bool", "float16", "bfloat16", "complex128", "uint64"])
def test_copy_any_under_vmap(name):
    xs = sample(name, (4, 2, 3), seed=1, full_range=True)
    y, codes = jax.vmap(lambda v: copy_any_op(v), in_axes=1)(xs)
    np.testing.assert_array_equal(
        np.asarray(y).view(np.uint8), np.ascontiguousarray(np.moveaxis(xs, 1, 0)).view(np.uint8)
    )
    np.testing.assert_array_equal(codes, np.full(2, DTYPE_CODES[name]))


# ---------------------------------------------------------------------------
# 5. kwargs reach a kernel with their types
# ---------------------------------------------------------------------------


def probe_abstract(x, **kwargs):
    return (((8,), np.float64),)


probe_op = jaxbind.get_nonlinear_call(
    LIB.jb_kwargs_probe,
    (LIB.jb_kwargs_probe, LIB.jb_kwargs_probe),
    probe_abstract,
    probe_abstract,
    first_n_args_fixed=1,
)


@pytest.mark.parametrize("variant", ["python", "numpy"])
def test_kwargs_probe(variant):
    if variant == "python":
        kwargs = dict(i=-7, f=2.5, b=True, s="hello", ints=[1, 2, 39], floats=np.array([0.5, 1.25]))
    else:
        kwargs = dict(
            i=np.int32(-7),
            f=np.float32(2.5),
            b=np.bool_(True),
            s="hello",
            ints=np.array([1, 2, 39], dtype=np.int16),
            floats=(0.5, 1.25),
        )
    report = jax.jit(lambda v: probe_op(v, **kwargs)[0])(np.zeros(1))
    np.testing.assert_array_equal(report, [-7, 2.5, 1, 5, ord("h"), 42, 1.75, 6])
    np.testing.assert_array_equal(probe_op(np.zeros(1), **kwargs)[0], report)  # eager too


def test_kwargs_probe_conversions():
    # a non-ASCII string arrives as UTF-8 (size in bytes); an int where a float
    # is read converts; bools are 0/1; an empty int list has size 0.
    report = probe_op(np.zeros(1), i=2**62, f=3, b=False, s="été", ints=[], floats=[-1.5], extra="not read")[0]
    np.testing.assert_array_equal(report, [float(2**62), 3.0, 0, len("été".encode()), 0xC3, 0, -1.5, 7])
    # a float list of integers is an int array: the kernel refuses it itself
    with pytest.raises(RuntimeError, match=r"op 'jb_kwargs_probe'.*kwargs of unexpected types"):
        jax.block_until_ready(probe_op(np.zeros(1), i=1, f=1.0, b=True, s="x", ints=[1], floats=[1, 2])[0])


def test_empty_float_array_kwarg_is_a_float_array():
    report = probe_op(
        np.zeros(1), i=1, f=1.0, b=True, s="x", ints=np.array([], np.int64), floats=np.array([], np.float64)
    )[0]
    np.testing.assert_array_equal(report, [1, 1.0, 1, 1, ord("x"), 0, 0.0, 6])


def test_kwarg_values_select_distinct_compiled_calls():
    f = lambda v, **kw: scale_op(v, **kw)[0]
    x = np.arange(3.0)
    for factor in (0.5, 4.0, 0.5):
        np.testing.assert_allclose(jax.jit(lambda v: f(v, factor=factor))(x), factor * x)


def n_outputs_like_first(*args, n_out, **kwargs):
    return tuple((args[0].shape, args[0].dtype) for _ in range(n_out))


sum_inputs_op = jaxbind.get_nonlinear_call(LIB.jb_sum_inputs, None, n_outputs_like_first, None)


# Calls of up to 16 inputs and 16 outputs take the handler's direct way to the kernel, more take
# the general one: the same results both ways, eager, jitted and walked by vmap.
@pytest.mark.parametrize("n_in,n_out", [(1, 1), (16, 16), (17, 2), (3, 17), (20, 20)])
def test_calls_of_many_buffers(n_in, n_out):
    rng = np.random.default_rng(n_in * 100 + n_out)
    xs = [rng.standard_normal((2, 3)) for _ in range(n_in)]
    expected = [sum(xs, np.full((2, 3), float(j))) for j in range(n_out)]  # (the kernel's order of sums)
    for outs in (
        sum_inputs_op(*xs, n_out=n_out),
        sum_inputs_op(*xs, n_out=n_out),
        jax.jit(lambda *v: sum_inputs_op(*v, n_out=n_out))(*xs),
    ):
        assert len(outs) == n_out
        for got, want in zip(outs, expected):
            np.testing.assert_allclose(got, want, rtol=1e-14)
    walked = jax.jit(jax.vmap(lambda *v: sum_inputs_op(*v, n_out=n_out)))(*xs)
    for got, want in zip(walked, expected):
        np.testing.assert_allclose(got, want, rtol=1e-14)


@pytest.mark.parametrize("n_in", [2, 17])
def test_a_kernel_message_reaches_python_either_way(n_in):
    xs = [np.ones(3)] * (n_in - 1) + [np.ones(4)]
    with pytest.raises(
        RuntimeError,
        match=rf"op 'jb_sum_inputs'.*native kernel failed: jb_sum_inputs: "
        rf"input {n_in - 1} is not float64 of one size",
    ):
        jax.block_until_ready(jax.jit(lambda *v: sum_inputs_op(*v, n_out=1))(*xs))


# ---------------------------------------------------------------------------
# 7. Errors
# ---------------------------------------------------------------------------

# (A kernel's failure under jit, eager and the batch walk, and a failing transpose, beside a
# Python callback's: runtime/test_trampoline.py.)
silent_op = jaxbind.get_linear_call(LIB.jb_fail_silently, LIB.jb_fail_silently, like_last, like_last)


def test_kernel_error_without_message():
    with pytest.raises(RuntimeError, match=r"op 'jb_fail_silently'.*returned 7 without a message"):
        jax.block_until_ready(jax.jit(lambda v: silent_op(v)[0])(np.ones(2)))


def test_native_refuses_null_and_non_integers():
    with pytest.raises(ValueError, match="null function pointer"):
        jaxbind.native(0)
    with pytest.raises(ValueError, match="not a valid address"):
        jaxbind.native(-1)
    with pytest.raises(ValueError, match="not a valid address"):
        jaxbind.native(1 << 64)
    for bad in (1.5, True, "0x1234", None):
        with pytest.raises(TypeError, match="expected an address or a native kernel"):
            jaxbind.native(bad)


def test_a_ctypes_callback_of_a_python_function_is_refused():
    def python_body(call):  # ctypes would run this with the GIL and swallow its exceptions
        raise ValueError("never seen")

    thunk = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(python_body)
    message = r"op 'jb_scale': f_T is a ctypes callback of a Python function.*jaxbind.numba_kernel"
    with pytest.raises(TypeError, match=message):
        jaxbind.get_linear_call(LIB.jb_scale, thunk, like_last, like_last)
    with pytest.raises(TypeError, match="ctypes callback of a Python function"):
        jaxbind.native(thunk)
    # a CFUNCTYPE over a compiled function's address is a kernel
    compiled = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(ctypes.cast(LIB.jb_scale, ctypes.c_void_p).value)
    op = jaxbind.get_linear_call(compiled, compiled, like_last, like_last, name="scale_by_cfunctype")
    np.testing.assert_allclose(op(np.ones(3), factor=2.5)[0], 2.5 * np.ones(3))


def test_null_ctypes_function_pointer_names_the_op():
    null = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)()
    with pytest.raises(ValueError, match=r"op 'jb_scale': f_T is a null function pointer"):
        jaxbind.get_linear_call(LIB.jb_scale, null, like_last, like_last)
    with pytest.raises(ValueError, match=r"op 'jb_xsin': f_vjp \(f_derivative\[1\]\) is a null"):
        jaxbind.get_nonlinear_call(LIB.jb_xsin, (LIB.jb_xsin_derivative, null), like_first, like_first)
    with pytest.raises(ValueError, match=r"f is a null function pointer"):
        jaxbind.get_linear_call(null, LIB.jb_scale, like_last, like_last)


@pytest.mark.parametrize("address", [1234, np.int64(1234)], ids=["int", "np.int64"])
def test_integer_callback_asks_for_native(address):
    with pytest.raises(TypeError, match=r"op 'jb_scale': f_T is an integer.*jaxbind\.native\(address\)"):
        jaxbind.get_linear_call(LIB.jb_scale, address, like_last, like_last)
    with pytest.raises(TypeError, match=r"f is an integer.*jaxbind\.native"):
        jaxbind.get_nonlinear_call(address, (LIB.jb_xsin, LIB.jb_xsin), like_first, like_first)


@pytest.mark.parametrize("bad", [3.5, "abc", None], ids=["float", "str", "None"])
def test_non_callable_non_kernel_is_a_type_error(bad):
    with pytest.raises(TypeError, match=r"op 'jb_scale': f_T must be a Python callable or a native kernel"):
        jaxbind.get_linear_call(LIB.jb_scale, bad, like_last, like_last)
    with pytest.raises(TypeError, match=r"f_jvp \(f_derivative\[0\]\) must be a Python callable"):
        jaxbind.get_nonlinear_call(LIB.jb_xsin, (bad, LIB.jb_xsin), like_first, like_first)


@pytest.mark.parametrize(
    "value, why",
    [
        ({"a": 1}, "dict"),
        ([[1, 2], [3, 4]], "of 2 dimensions"),
        ([[1, 2], [3]], "list"),
        (1 + 2j, "complex"),
        (np.ones((2, 2)), "of 2 dimensions"),
        (["a", "b"], "of dtype <U1"),
        (np.array([1 + 1j]), "of dtype complex128"),
        (None, "NoneType"),
        (2**63, "does not fit in 64 bits"),
        ("a\0b", "contains a NUL character"),
        (np.array([1, 2**63], dtype=np.uint64), "does not fit in a signed 64-bit integer"),
        ("a\ud800b", "contains a lone surrogate"),
    ],
    ids=[
        "dict",
        "nested_list",
        "ragged_list",
        "complex",
        "2d_array",
        "strings",
        "complex_array",
        "None",
        "int_too_big",
        "nul_string",
        "uint64_too_big",
        "lone_surrogate",
    ],
)
def test_unsupported_kwarg_is_a_type_error_at_call_time(value, why):
    x = np.ones(2)
    pattern = (
        rf"op 'jb_scale': keyword argument 'weird' \([^)]*{re.escape(why)}[^)]*\) cannot be passed to a native kernel"
    )
    with pytest.raises(TypeError, match=pattern):
        scale_op(x, weird=value)
    with pytest.raises(TypeError, match=pattern):
        jax.jit(lambda v: scale_op(v, weird=value)[0])(x)
    # only a native callback limits kwargs: a native transpose alone does it too
    python_scale = lambda out, args, kwargs_dump: out[0].__setitem__(..., 2 * args[-1])
    half_native = jaxbind.get_linear_call(python_scale, LIB.jb_scale, like_last, like_last)
    with pytest.raises(TypeError, match=r"keyword argument 'weird'.*native kernel"):
        half_native(x, weird=value)
    python_op = jaxbind.get_linear_call(python_scale, python_scale, like_last, like_last)
    np.testing.assert_allclose(python_op(x, weird=value)[0], 2 * x)


# ---------------------------------------------------------------------------
# 8. Threads: kernels run concurrently, without the GIL
# ---------------------------------------------------------------------------

busy_op = jaxbind.get_nonlinear_call(
    LIB.jb_busy, (LIB.jb_busy, LIB.jb_busy), like_first, like_first, first_n_args_fixed=1
)


def busy_reference(x, iterations):
    return x + np.sin(np.arange(iterations, dtype=np.float64)).sum() / iterations


def test_two_independent_native_calls_in_one_program(rand):
    @jax.jit
    def program(a, b):
        return busy_op(a, iterations=3000)[0], busy_op(b, iterations=5000)[0] * 2

    a, b = rand(4), rand(3, 2)
    ya, yb = program(a, b)
    np.testing.assert_allclose(ya, busy_reference(a, 3000), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(yb, 2 * busy_reference(b, 5000), rtol=1e-12, atol=1e-13)

"""Native kernels: C functions that XLA calls with no Python and no GIL.

The kernels come from ``tests/kernels/test_kernels.c`` (compiled for the tests by
``_kernels.py``), from a C file compiled here against the public
header, and from a numba cfunc. Every result is compared with an independent
reference written in jax.numpy or NumPy, or checked with
``jax.test_util.check_grads``.
"""

import ctypes
import os
import re
import shutil
import subprocess
import threading

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest

import _kernels
import jaxbind
from _shared import errors_in_threads, sample

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
# 1. jb_scale: out = factor * x, linear, its own transpose, four dtypes
# ---------------------------------------------------------------------------

FACTOR = -1.75

scale_op = jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_scale, like_last, like_last)
# jb_scale reads its last input, so with a fixed first argument it ignores it.
scale_fixed_op = jaxbind.get_linear_call(
    LIB.jb_scale, LIB.jb_scale, like_last, like_last, first_n_args_fixed=1
)


def native_scale(x):
    return scale_op(x, factor=FACTOR)[0]


def reference_scale(x):
    return FACTOR * x


def loss_of(f):
    """A real loss of a (possibly complex) array through ``f`` (the real*imag term
    catches a missing or spurious conjugation)."""

    def loss(x):
        y = f(x)
        return jnp.sum(jnp.abs(y) ** 2) + jnp.sum(jnp.real(y) * jnp.imag(y)) + jnp.sum(jnp.real(y))

    return loss


@pytest.fixture
def x(rand, dtype):
    return rand(3, 4, dtype=dtype)


def test_scale_eager(x, dtype, tol):
    y = native_scale(x)
    assert y.shape == x.shape and y.dtype == dtype
    np.testing.assert_allclose(y, FACTOR * x, **tol)
    # the default factor of the kernel is 2
    np.testing.assert_allclose(scale_op(x)[0], 2 * x, **tol)


def test_scale_jit(x, dtype, tol):
    y = jax.jit(native_scale)(x)
    assert y.dtype == dtype
    np.testing.assert_allclose(y, FACTOR * x, **tol)
    # an integer factor is converted to a float by the header's helper
    np.testing.assert_allclose(jax.jit(lambda v: scale_op(v, factor=3)[0])(x), 3 * x, **tol)


def test_scale_jvp(x, rand, dtype, tol):
    t = rand(*x.shape, dtype=dtype)
    y, y_dot = jax.jvp(native_scale, (x,), (t,))
    np.testing.assert_allclose(y, FACTOR * x, **tol)
    np.testing.assert_allclose(y_dot, FACTOR * t, **tol)
    y, y_dot = jax.jit(lambda a, b: jax.jvp(native_scale, (a,), (b,)))(x, t)
    np.testing.assert_allclose(y_dot, FACTOR * t, **tol)


def test_scale_vjp(x, rand, dtype, tol):
    ct = rand(*x.shape, dtype=dtype)
    y, pullback = jax.vjp(native_scale, x)
    (x_ct,) = pullback(ct)
    assert x_ct.dtype == dtype
    np.testing.assert_allclose(y, FACTOR * x, **tol)
    np.testing.assert_allclose(x_ct, FACTOR * ct, **tol)  # transpose, no conjugation


def test_scale_grad(x, tol):
    want = jax.jit(jax.grad(loss_of(reference_scale)))(x)
    np.testing.assert_allclose(jax.grad(loss_of(native_scale))(x), want, **tol)  # eager
    np.testing.assert_allclose(jax.jit(jax.grad(loss_of(native_scale)))(x), want, **tol)


def test_scale_linear_transpose(x, rand, dtype, tol):
    ct = rand(*x.shape, dtype=dtype)
    (x_ct,) = jax.linear_transpose(native_scale, x)(ct)
    (want,) = jax.linear_transpose(reference_scale, x)(ct)
    np.testing.assert_allclose(x_ct, want, **tol)


def test_scale_check_grads(x, check_grads):
    check_grads(native_scale, (x,), order=2, modes=("fwd", "rev"))


def test_scale_vmap_in_axes_0_and_1(rand, dtype, tol):
    xs = rand(5, 3, 4, dtype=dtype)
    np.testing.assert_allclose(jax.vmap(native_scale)(xs), FACTOR * xs, **tol)
    got = jax.jit(jax.vmap(native_scale, in_axes=1))(xs)
    np.testing.assert_allclose(got, FACTOR * np.moveaxis(xs, 1, 0), **tol)
    got = jax.vmap(native_scale, in_axes=2, out_axes=1)(xs)
    np.testing.assert_allclose(got, FACTOR * np.moveaxis(xs, 2, 1), **tol)


def test_scale_vmap_nested(rand, dtype, tol):
    xs = rand(2, 3, 4, dtype=dtype)
    f = jax.vmap(jax.vmap(native_scale, in_axes=1), in_axes=0)
    want = jax.vmap(jax.vmap(reference_scale, in_axes=1), in_axes=0)(xs)
    assert want.shape == (2, 4, 3)
    np.testing.assert_allclose(f(xs), want, **tol)
    np.testing.assert_allclose(jax.jit(f)(xs), want, **tol)
    g = jax.vmap(jax.vmap(native_scale, in_axes=0), in_axes=2)
    np.testing.assert_allclose(g(xs), jax.vmap(jax.vmap(reference_scale), in_axes=2)(xs), **tol)


def test_scale_vmap_with_fixed_argument(rand, dtype, tol):
    fixed = rand(7, dtype=dtype)  # ignored by the kernel
    fixed_batch = rand(5, 7, dtype=dtype)
    xs = rand(5, 3, dtype=dtype)

    def f(m, v):
        return scale_fixed_op(m, v, factor=FACTOR)[0]

    # the fixed argument unmapped (in_axes None), the linear one mapped
    np.testing.assert_allclose(jax.vmap(f, in_axes=(None, 0))(fixed, xs), FACTOR * xs, **tol)
    # the fixed argument mapped, the linear one broadcast
    got = jax.jit(jax.vmap(f, in_axes=(0, None)))(fixed_batch, xs[0])
    np.testing.assert_allclose(got, np.broadcast_to(FACTOR * xs[0], (5, 3)), **tol)
    # the cotangent of the broadcast argument is summed over the batch
    loss = loss_of(lambda v: jax.vmap(f, in_axes=(0, None))(fixed_batch, v))
    ref = loss_of(lambda v: jax.vmap(lambda m, u: FACTOR * u, in_axes=(0, None))(fixed_batch, v))
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(xs[0]), jax.jit(jax.grad(ref))(xs[0]), **tol)


def test_scale_vmap_of_grad_and_grad_of_vmap(rand, dtype, tol):
    xs = rand(4, 3, 2, dtype=dtype)
    for in_axes in (0, 1):
        got = jax.jit(jax.vmap(jax.grad(loss_of(native_scale)), in_axes=in_axes))(xs)
        want = jax.jit(jax.vmap(jax.grad(loss_of(reference_scale)), in_axes=in_axes))(xs)
        np.testing.assert_allclose(got, want, **tol)
        got = jax.jit(jax.grad(loss_of(jax.vmap(native_scale, in_axes=in_axes))))(xs)
        want = jax.jit(jax.grad(loss_of(jax.vmap(reference_scale, in_axes=in_axes))))(xs)
        np.testing.assert_allclose(got, want, **tol)


def test_scale_vmap_is_one_custom_call_without_loop(rand, dtype):
    xs = rand(5, 3, 4, dtype=dtype)
    assert_one_native_call(jax.vmap(native_scale), xs)
    assert_one_native_call(jax.vmap(native_scale, in_axes=1), xs)
    assert_one_native_call(jax.vmap(jax.vmap(native_scale), in_axes=2), xs)
    assert_one_native_call(lambda v: jax.vjp(jax.vmap(native_scale), v)[1](v)[0], xs)


# ---------------------------------------------------------------------------
# 2. jb_xsin: a nonlinear op, f(x) = x sin(x); native, Python and mixed
# ---------------------------------------------------------------------------


def xsin_py(out, args, kwargs_dump):
    out[0][...] = np.sin(args[0]) * args[0]


def xsin_derivative_py(out, args, kwargs_dump):  # the jvp (x, t) and the vjp (x, ct)
    x, t = args
    out[0][...] = (np.cos(x) * x + np.sin(x)) * t


XSIN_OPS = {
    "native": jaxbind.get_nonlinear_call(
        LIB.jb_xsin, (LIB.jb_xsin_derivative, LIB.jb_xsin_derivative), like_first, like_first),
    "native_f_python_derivatives": jaxbind.get_nonlinear_call(
        LIB.jb_xsin, (xsin_derivative_py, xsin_derivative_py), like_first, like_first),
    "python_f_native_derivatives": jaxbind.get_nonlinear_call(
        xsin_py, (LIB.jb_xsin_derivative, LIB.jb_xsin_derivative), like_first, like_first),
    "native_jvp_python_vjp": jaxbind.get_nonlinear_call(
        LIB.jb_xsin, (LIB.jb_xsin_derivative, xsin_derivative_py), like_first, like_first),
}
TIGHT = dict(rtol=1e-12, atol=1e-13)


@pytest.fixture(params=sorted(XSIN_OPS))
def xsin(request):
    op = XSIN_OPS[request.param]
    return lambda v: op(v)[0]


@pytest.fixture
def xr(rand):
    return rand(3, 4)


def test_xsin_value_and_jit(xsin, xr):
    np.testing.assert_allclose(xsin(xr), xr * np.sin(xr), **TIGHT)
    np.testing.assert_allclose(jax.jit(xsin)(xr), xr * np.sin(xr), **TIGHT)


def test_xsin_grad(xsin, xr):
    want = np.cos(xr) * xr + np.sin(xr)
    np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(xsin(v)))(xr), want, **TIGHT)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda v: jnp.sum(xsin(v))))(xr), want, **TIGHT)
    ref = jax.grad(lambda v: jnp.sum(jnp.sin(v) * v * jnp.cos(v)))(xr)
    got = jax.grad(lambda v: jnp.sum(xsin(v) * jnp.cos(v)))(xr)
    np.testing.assert_allclose(got, ref, **TIGHT)


def test_xsin_jvp_and_vjp(xsin, xr, rand):
    t = rand(*xr.shape)
    y, y_dot = jax.jvp(xsin, (xr,), (t,))
    np.testing.assert_allclose(y, xr * np.sin(xr), **TIGHT)
    np.testing.assert_allclose(y_dot, (np.cos(xr) * xr + np.sin(xr)) * t, **TIGHT)
    _, pullback = jax.vjp(xsin, xr)
    np.testing.assert_allclose(pullback(t)[0], (np.cos(xr) * xr + np.sin(xr)) * t, **TIGHT)


def test_xsin_check_grads(xsin, xr):
    jax.test_util.check_grads(xsin, (xr,), order=1, modes=("fwd", "rev"))


def test_xsin_vmap(xsin, rand):
    xs = rand(5, 3, 2)
    np.testing.assert_allclose(jax.vmap(xsin)(xs), xs * np.sin(xs), **TIGHT)
    got = jax.jit(jax.vmap(jax.vmap(xsin, in_axes=1), in_axes=2))(xs)
    np.testing.assert_allclose(got, np.transpose(xs * np.sin(xs), (2, 1, 0)), **TIGHT)
    got = jax.vmap(jax.grad(lambda v: jnp.sum(xsin(v))), in_axes=1)(xs)
    np.testing.assert_allclose(got, np.moveaxis(np.cos(xs) * xs + np.sin(xs), 1, 0), **TIGHT)
    t = rand(*xs.shape)
    _, y_dot = jax.vmap(lambda a, b: jax.jvp(xsin, (a,), (b,)))(xs, t)
    np.testing.assert_allclose(y_dot, (np.cos(xs) * xs + np.sin(xs)) * t, **TIGHT)


def test_xsin_native_and_mixed_ops_agree(rand):
    x = rand(6)
    grads = [jax.grad(lambda v: jnp.sum(op(v)[0] ** 2))(x) for op in XSIN_OPS.values()]
    want = jax.grad(lambda v: jnp.sum((v * jnp.sin(v)) ** 2))(x)
    for g in grads:
        np.testing.assert_allclose(g, want, **TIGHT)


# ---------------------------------------------------------------------------
# 3. jb_triple_and_sum: two outputs of different shapes (3 x, sum(x))
# ---------------------------------------------------------------------------


def triple_and_sum_abstract(x, **kwargs):
    return ((x.shape, x.dtype), ((), x.dtype))


def triple_and_sum_T_abstract(ct_y, ct_s, **kwargs):
    return ((ct_y.shape, ct_y.dtype),)


triple_and_sum_op = jaxbind.get_linear_call(
    LIB.jb_triple_and_sum, LIB.jb_triple_and_sum_T, triple_and_sum_abstract, triple_and_sum_T_abstract
)


def triple_and_sum(x):
    y, s = triple_and_sum_op(x)
    return y, s


def triple_and_sum_reference(x):
    return 3 * x, jnp.sum(x)


def test_triple_and_sum_value(rand):
    x = rand(3, 4)
    y, s = triple_and_sum(x)
    assert y.shape == (3, 4) and s.shape == () and s.dtype == np.float64
    np.testing.assert_allclose(y, 3 * x, **TIGHT)
    np.testing.assert_allclose(s, x.sum(), **TIGHT)
    y, s = jax.jit(triple_and_sum)(x)
    np.testing.assert_allclose(s, x.sum(), **TIGHT)


def test_triple_and_sum_vjp_grad_transpose(rand):
    x, ct_y, ct_s = rand(3, 4), rand(3, 4), 0.75
    _, pullback = jax.vjp(triple_and_sum, x)
    np.testing.assert_allclose(pullback((ct_y, ct_s))[0], 3 * ct_y + ct_s, **TIGHT)
    (x_ct,) = jax.linear_transpose(triple_and_sum, x)((ct_y, jnp.float64(ct_s)))
    np.testing.assert_allclose(x_ct, 3 * ct_y + ct_s, **TIGHT)

    def loss(f):
        return lambda v: jnp.sum(jnp.sin(f(v)[0])) + f(v)[1] ** 2

    np.testing.assert_allclose(
        jax.grad(loss(triple_and_sum))(x), jax.grad(loss(triple_and_sum_reference))(x), **TIGHT)
    jax.test_util.check_grads(triple_and_sum, (x,), order=2, modes=("fwd", "rev"))


def test_triple_and_sum_vmap(rand):
    xs = rand(5, 3, 4)
    y, s = jax.vmap(triple_and_sum)(xs)
    np.testing.assert_allclose(y, 3 * xs, **TIGHT)
    np.testing.assert_allclose(s, xs.sum(axis=(1, 2)), **TIGHT)
    y, s = jax.jit(jax.vmap(triple_and_sum, in_axes=2))(xs)
    np.testing.assert_allclose(y, 3 * np.moveaxis(xs, 2, 0), **TIGHT)
    np.testing.assert_allclose(s, xs.sum(axis=(0, 1)), **TIGHT)
    # the transpose kernel under vmap: scalar cotangents batched too
    ct_y, ct_s = rand(5, 3, 4), rand(5)
    got = jax.vmap(lambda v, a, b: jax.vjp(triple_and_sum, v)[1]((a, b))[0])(xs, ct_y, ct_s)
    np.testing.assert_allclose(got, 3 * ct_y + ct_s[:, None, None], **TIGHT)
    assert_one_native_call(jax.vmap(triple_and_sum), xs)


# ---------------------------------------------------------------------------
# 4. jb_copy_any: every dtype reaches a kernel with its XLA code
# ---------------------------------------------------------------------------

DTYPE_CODES = {
    "bool": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5,
    "uint8": 6, "uint16": 7, "uint32": 8, "uint64": 9,
    "float16": 10, "float32": 11, "float64": 12, "complex64": 15, "bfloat16": 16,
    "complex128": 18, "float8_e5m2": 19, "float8_e4m3fn": 20, "float8_e4m3b11fnuz": 23,
    "float8_e5m2fnuz": 24, "float8_e4m3fnuz": 25, "float8_e4m3": 28, "float8_e3m4": 29,
}
FLOAT8 = [name for name in DTYPE_CODES if name.startswith("float8")]


def _have_dtype(name):
    try:
        jnp.dtype(name)
        return True
    except TypeError:
        return False


def test_header_dtype_codes_match_xla():
    with open(os.path.join(jaxbind.get_include(), "jaxbind.h")) as header:
        text = header.read()
    enum = text[text.index("enum jaxbind_dtype"):]
    enum = enum[:enum.index("};")]
    codes = {name.lower(): int(code) for name, code in re.findall(r"JAXBIND_(\w+) = (\d+)", enum)}
    assert codes == DTYPE_CODES


def copy_any_abstract(x, **kwargs):
    return ((x.shape, x.dtype), ((), np.int64))


copy_any_op = jaxbind.get_nonlinear_call(
    LIB.jb_copy_any, (LIB.jb_copy_any, LIB.jb_copy_any), copy_any_abstract, copy_any_abstract,
    first_n_args_fixed=1,
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
    from jaxbind._primitive import SUPPORTED_DTYPES
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
    np.testing.assert_array_equal(np.asarray(y).view(np.uint8),
                                  np.ascontiguousarray(np.moveaxis(xs, 1, 0)).view(np.uint8))
    np.testing.assert_array_equal(codes, np.full(2, DTYPE_CODES[name]))


# ---------------------------------------------------------------------------
# 5. kwargs reach a kernel with their types
# ---------------------------------------------------------------------------


def probe_abstract(x, **kwargs):
    return (((8,), np.float64),)


probe_op = jaxbind.get_nonlinear_call(
    LIB.jb_kwargs_probe, (LIB.jb_kwargs_probe, LIB.jb_kwargs_probe), probe_abstract, probe_abstract,
    first_n_args_fixed=1,
)


@pytest.mark.parametrize("variant", ["python", "numpy"])
def test_kwargs_probe(variant):
    if variant == "python":
        kwargs = dict(i=-7, f=2.5, b=True, s="hello", ints=[1, 2, 39], floats=np.array([0.5, 1.25]))
    else:
        kwargs = dict(i=np.int32(-7), f=np.float32(2.5), b=np.bool_(True), s="hello",
                      ints=np.array([1, 2, 39], dtype=np.int16), floats=(0.5, 1.25))
    report = jax.jit(lambda v: probe_op(v, **kwargs)[0])(np.zeros(1))
    np.testing.assert_array_equal(report, [-7, 2.5, 1, 5, ord("h"), 42, 1.75, 6])
    np.testing.assert_array_equal(probe_op(np.zeros(1), **kwargs)[0], report)  # eager too


def test_kwargs_probe_conversions():
    # a non-ASCII string arrives as UTF-8 (size in bytes); an int where a float
    # is read converts; bools are 0/1; an empty int list has size 0.
    report = probe_op(np.zeros(1), i=2**62, f=3, b=False, s="été", ints=[], floats=[-1.5],
                      extra="not read")[0]
    np.testing.assert_array_equal(report, [float(2**62), 3.0, 0, len("été".encode()), 0xC3, 0, -1.5, 7])
    # a float list of integers is an int array: the kernel refuses it itself
    with pytest.raises(RuntimeError, match=r"op 'jb_kwargs_probe'.*kwargs of unexpected types"):
        jax.block_until_ready(probe_op(np.zeros(1), i=1, f=1.0, b=True, s="x", ints=[1], floats=[1, 2])[0])


def test_empty_float_array_kwarg_is_a_float_array():
    report = probe_op(np.zeros(1), i=1, f=1.0, b=True, s="x", ints=np.array([], np.int64),
                      floats=np.array([], np.float64))[0]
    np.testing.assert_array_equal(report, [1, 1.0, 1, 1, ord("x"), 0, 0.0, 6])


def test_kwarg_values_select_distinct_compiled_calls():
    f = lambda v, **kw: scale_op(v, **kw)[0]  # noqa: E731
    x = np.arange(3.0)
    for factor in (0.5, 4.0, 0.5):
        np.testing.assert_allclose(jax.jit(lambda v: f(v, factor=factor))(x), factor * x)


# ---------------------------------------------------------------------------
# 6. func_can_batch: jb_batched_scale sees the whole batch in one call
# ---------------------------------------------------------------------------


def batched_scale_abstract(x, *, batch_axes, factor=2.0):
    if batch_axes is None:  # not batched
        return ((x.shape, x.dtype), ((), np.int64))
    (axes,) = batch_axes  # the input's axis per level, oldest first
    sizes = tuple(x.shape[a] for a in axes)
    # out 1 carries one entry per batch element (the kernel writes the first)
    return ((x.shape, x.dtype, axes[-1]), (sizes, np.int64, len(sizes) - 1))


batched_scale_op = jaxbind.get_linear_call(
    LIB.jb_batched_scale, LIB.jb_batched_scale, batched_scale_abstract, batched_scale_abstract,
    func_can_batch=True,
)


def batched_scale(x):
    return batched_scale_op(x, factor=FACTOR)


def test_batched_scale_unbatched(rand):
    x = rand(3, 4)
    y, levels = jax.jit(batched_scale)(x)
    np.testing.assert_allclose(y, FACTOR * x, **TIGHT)
    assert levels.shape == () and int(levels) == 0


@pytest.mark.parametrize("in_axes", [0, 1, 2])
def test_batched_scale_vmap(rand, in_axes):
    xs = rand(5, 3, 4)
    f = jax.vmap(batched_scale, in_axes=in_axes)
    y, levels = f(xs)
    np.testing.assert_allclose(y, FACTOR * np.moveaxis(xs, in_axes, 0), **TIGHT)
    assert levels.shape == (xs.shape[in_axes],) and int(levels[0]) == 1
    y, levels = jax.jit(f)(xs)
    np.testing.assert_allclose(y, FACTOR * np.moveaxis(xs, in_axes, 0), **TIGHT)
    assert int(levels[0]) == 1
    assert_one_native_call(lambda v: f(v)[0], xs)


def test_batched_scale_vmap_nested(rand):
    xs = rand(2, 3, 4, 5)
    f = jax.vmap(jax.vmap(jax.vmap(batched_scale, in_axes=1), in_axes=1), in_axes=0)
    ref = jax.vmap(jax.vmap(jax.vmap(reference_scale, in_axes=1), in_axes=1), in_axes=0)
    y, levels = jax.jit(f)(xs)
    np.testing.assert_allclose(y, ref(xs), **TIGHT)
    assert levels.shape == (2, 4, 5) and int(levels[0, 0, 0]) == 3
    assert_one_native_call(lambda v: f(v)[0], xs)
    g = jax.vmap(jax.vmap(batched_scale, in_axes=1), in_axes=1)
    y, levels = g(xs)
    np.testing.assert_allclose(y, jax.vmap(jax.vmap(reference_scale, in_axes=1), in_axes=1)(xs), **TIGHT)
    assert int(levels[0, 0]) == 2


# ---------------------------------------------------------------------------
# 7. Errors
# ---------------------------------------------------------------------------

fail_op = jaxbind.get_linear_call(LIB.jb_fail, LIB.jb_fail, like_last, like_last)
silent_op = jaxbind.get_linear_call(LIB.jb_fail_silently, LIB.jb_fail_silently, like_last, like_last)


def test_kernel_error_message_reaches_python_and_process_survives():
    x = np.ones(3)
    with pytest.raises(RuntimeError, match=r"op 'jb_fail'.*kernel failed on purpose \(code=42\)"):
        jax.block_until_ready(jax.jit(lambda v: fail_op(v, code=42)[0])(x))
    with pytest.raises(RuntimeError, match=r"op 'jb_fail'.*kernel failed on purpose \(code=-1\)"):
        jax.block_until_ready(fail_op(x)[0])
    with pytest.raises(RuntimeError, match=r"op 'jb_fail'.*code=5"):  # under the batch walk
        jax.block_until_ready(jax.vmap(lambda v: fail_op(v, code=5)[0])(np.ones((4, 2))))
    # the next calls work
    np.testing.assert_allclose(jax.jit(native_scale)(x), FACTOR * x)
    assert fail_op.name == "jb_fail"


def test_kernel_error_without_message():
    with pytest.raises(RuntimeError, match=r"op 'jb_fail_silently'.*returned 7 without a message"):
        jax.block_until_ready(jax.jit(lambda v: silent_op(v)[0])(np.ones(2)))


def test_transpose_kernel_error_names_the_transpose():
    op = jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_fail, like_last, like_last)
    with pytest.raises(RuntimeError,
                       match=r"op 'jb_scale' \(transpose callback 'jb_fail'\).*on purpose \(code=3\)"):
        jax.block_until_ready(jax.grad(lambda v: jnp.sum(op(v, code=3)[0]))(np.ones(2)))


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


@pytest.mark.parametrize("value, why", [
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
], ids=["dict", "nested_list", "ragged_list", "complex", "2d_array", "strings", "complex_array",
        "None", "int_too_big", "nul_string", "uint64_too_big", "lone_surrogate"])
def test_unsupported_kwarg_is_a_type_error_at_call_time(value, why):
    x = np.ones(2)
    pattern = rf"op 'jb_scale': keyword argument 'weird' \([^)]*{re.escape(why)}[^)]*\) cannot be passed to a native kernel"
    with pytest.raises(TypeError, match=pattern):
        scale_op(x, weird=value)
    with pytest.raises(TypeError, match=pattern):
        jax.jit(lambda v: scale_op(v, weird=value)[0])(x)
    # only a native callback limits kwargs: a native transpose alone does it too
    python_scale = lambda out, args, kwargs_dump: out[0].__setitem__(..., 2 * args[-1])  # noqa: E731
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


def test_concurrent_native_calls_from_python_threads():
    f = jax.jit(lambda v: busy_op(v, iterations=2000)[0])
    f(np.zeros(3))
    def calls(seed):
        for i in range(20):
            x = np.full(3, float(seed + i))
            np.testing.assert_allclose(f(x), busy_reference(x, 2000), rtol=1e-12, atol=1e-13)
            np.testing.assert_allclose(jax.jit(native_scale)(x), FACTOR * x)

    assert errors_in_threads(calls, 6) == []


def test_native_kernel_runs_while_another_thread_holds_the_gil(user_lib):
    # A Python thread runs a compiled op whose kernel waits for a go. Once the
    # kernel has started, the main thread enters C through ctypes.PyDLL, which
    # keeps the GIL, gives the go and waits for the kernel to finish: that can
    # only happen if the kernel runs without the GIL.
    holding_gil = ctypes.PyDLL(user_lib._name)
    holding_gil.gil_go_and_wait_done.argtypes = [ctypes.c_double]
    user_lib.gil_wait_entered.argtypes = [ctypes.c_double]
    op = jaxbind.get_nonlinear_call(
        user_lib.gil_kernel, (user_lib.gil_kernel, user_lib.gil_kernel), like_first, like_first,
        first_n_args_fixed=1)
    x = np.arange(4.0)
    compiled = jax.jit(lambda v: op(v)[0]).lower(x).compile()  # compiling runs no kernel
    user_lib.gil_reset()
    result = {}

    def run():
        try:
            result["y"] = np.asarray(compiled(x))
        except Exception as err:  # reported below
            result["error"] = err

    thread = threading.Thread(target=run)
    thread.start()
    entered = user_lib.gil_wait_entered(10.0)  # a CDLL call: the GIL is released here
    finished = holding_gil.gil_go_and_wait_done(10.0) if entered else 0  # the GIL is held here
    thread.join()
    assert entered == 1, "the kernel did not start"
    assert finished == 1, "the kernel could not finish while the main thread held the GIL"
    assert "error" not in result, result.get("error")
    np.testing.assert_allclose(result["y"], 2 * x)


# ---------------------------------------------------------------------------
# 9. A kernel written and compiled by the user against the public header
# ---------------------------------------------------------------------------

USER_KERNELS = r"""
#define _POSIX_C_SOURCE 199309L
#include <time.h>
#include <jaxbind.h>

int64_t axpb_calls = 0; /* how many times the kernels ran, read from Python */

static int float64_only(const jaxbind_call *call, const char *who) {
  if (call->abi_version != JAXBIND_ABI_VERSION || call->struct_size < (int64_t)sizeof(jaxbind_call))
    return jaxbind_fail(call, "%s: ABI %lld, struct of %lld bytes", who,
                        (long long)call->abi_version, (long long)call->struct_size);
  for (int64_t i = 0; i < call->n_in; ++i) {
    if (call->in[i].dtype != JAXBIND_FLOAT64)
      return jaxbind_fail(call, "%s: input %lld has dtype code %lld, only float64 (%d) is supported",
                          who, (long long)i, (long long)call->in[i].dtype, JAXBIND_FLOAT64);
  }
  return 0;
}

/* y = a x + b, with float kwargs a and b. */
int axpb(const jaxbind_call *call) {
  __atomic_fetch_add(&axpb_calls, 1, __ATOMIC_RELAXED);
  if (float64_only(call, "axpb")) return 1;
  const double a = jaxbind_kwarg_float(call, "a", 1.0), b = jaxbind_kwarg_float(call, "b", 0.0);
  const double *x = call->in[0].data;
  double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[0]); i < n; ++i) y[i] = a * x[i] + b;
  return 0;
}

/* dy = a t for the last input t: the jvp (x, t) and vjp (x, ct) of axpb, and
 * the linear map x -> a x, which is its own transpose. */
int axpb_linear_part(const jaxbind_call *call) {
  if (float64_only(call, "axpb_linear_part")) return 1;
  const double a = jaxbind_kwarg_float(call, "a", 1.0);
  const jaxbind_array *t = &call->in[call->n_in - 1];
  const double *u = t->data;
  double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(t); i < n; ++i) y[i] = a * u[i];
  return 0;
}

/* func_can_batch: inputs (offset, a scalar; x, batched anywhere), out[0] =
 * a x + offset over the whole batch in one call; out[1] (int64, its first 8
 * entries) = [batch_levels, entries of batch_axes, those entries, -2...]. */
int axpb_batched(const jaxbind_call *call) {
  __atomic_fetch_add(&axpb_calls, 1, __ATOMIC_RELAXED);
  if (float64_only(call, "axpb_batched")) return 1;
  if (call->n_in != 2 || call->n_out != 2 || call->in[0].rank != 0 || call->out[1].dtype != JAXBIND_INT64)
    return jaxbind_fail(call, "axpb_batched: unexpected signature");
  const jaxbind_kwarg *levels = jaxbind_find_kwarg(call, "batch_levels");
  const jaxbind_kwarg *axes = jaxbind_find_kwarg(call, "batch_axes");
  if (!levels || levels->type != JAXBIND_KW_INT || !axes || axes->type != JAXBIND_KW_INT_ARRAY)
    return jaxbind_fail(call, "axpb_batched: no batch kwargs");
  int64_t *report = call->out[1].data;
  for (int k = 0; k < 8; ++k) report[k] = -2;
  report[0] = levels->int_value;
  report[1] = axes->size;
  for (int64_t k = 0; k < axes->size && k < 6; ++k) report[2 + k] = axes->int_array[k];
  const double a = jaxbind_kwarg_float(call, "a", 1.0), offset = *(const double *)call->in[0].data;
  const double *x = call->in[1].data;
  double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[1]); i < n; ++i) y[i] = a * x[i] + offset;
  return 0;
}

/* A handshake with a Python thread that holds the GIL (see the GIL test). */
static int gil_entered = 0, gil_go = 0, gil_done = 0;

static double seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int wait_for(int *flag, double timeout) {
  const double end = seconds() + timeout;
  while (!__atomic_load_n(flag, __ATOMIC_ACQUIRE)) {
    if (seconds() > end) return 0;
  }
  return 1;
}

void gil_reset(void) {
  __atomic_store_n(&gil_entered, 0, __ATOMIC_RELEASE);
  __atomic_store_n(&gil_go, 0, __ATOMIC_RELEASE);
  __atomic_store_n(&gil_done, 0, __ATOMIC_RELEASE);
}

int gil_wait_entered(double timeout) { return wait_for(&gil_entered, timeout); }

int gil_go_and_wait_done(double timeout) {
  __atomic_store_n(&gil_go, 1, __ATOMIC_RELEASE);
  return wait_for(&gil_done, timeout);
}

/* out = 2 in (float64), once the test says go. */
int gil_kernel(const jaxbind_call *call) {
  __atomic_store_n(&gil_entered, 1, __ATOMIC_RELEASE);
  if (!wait_for(&gil_go, 10.0)) return jaxbind_fail(call, "gil_kernel: no go within 10 s");
  const double *x = call->in[0].data;
  double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[0]); i < n; ++i) y[i] = 2.0 * x[i];
  __atomic_store_n(&gil_done, 1, __ATOMIC_RELEASE);
  return 0;
}
"""


@pytest.fixture(scope="module")
def user_lib(tmp_path_factory):
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (cc) found to build a user kernel")
    folder = tmp_path_factory.mktemp("user_kernel")
    source, library = folder / "axpb.c", folder / "libaxpb.so"
    source.write_text(USER_KERNELS)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", f"-I{jaxbind.get_include()}",
         str(source), "-o", str(library)],
        check=True, capture_output=True, text=True,
    )
    return ctypes.CDLL(str(library))


def calls_of(lib):
    return ctypes.c_int64.in_dll(lib, "axpb_calls").value


A, B = 1.5, -0.25


def test_user_kernel_affine_nonlinear_op(user_lib, rand):
    op = jaxbind.get_nonlinear_call(
        user_lib.axpb, (user_lib.axpb_linear_part, user_lib.axpb_linear_part), like_first, like_first)
    f = lambda v: op(v, a=A, b=B)[0]  # noqa: E731
    x = rand(3, 4)
    np.testing.assert_allclose(jax.jit(f)(x), A * x + B, **TIGHT)
    loss = lambda g: lambda v: jnp.sum(jnp.sin(g(v)))  # noqa: E731
    np.testing.assert_allclose(jax.jit(jax.grad(loss(f)))(x), jax.grad(loss(lambda v: A * v + B))(x), **TIGHT)
    jax.test_util.check_grads(f, (x,), order=1, modes=("fwd", "rev"))
    xs = rand(5, 3)
    before = calls_of(user_lib)
    np.testing.assert_allclose(jax.jit(jax.vmap(f, in_axes=1))(xs), (A * xs + B).T, **TIGHT)
    assert calls_of(user_lib) - before == 3  # walked by jaxbind: one call per element
    got = jax.vmap(jax.grad(loss(f)))(xs)
    np.testing.assert_allclose(got, jax.vmap(jax.grad(loss(lambda v: A * v + B)))(xs), **TIGHT)


def test_user_kernel_linear_part_and_its_transpose(user_lib, rand):
    op = jaxbind.get_linear_call(user_lib.axpb_linear_part, user_lib.axpb_linear_part, like_last, like_last)
    f = lambda v: op(v, a=A)[0]  # noqa: E731
    x, ct = rand(4, 2), rand(4, 2)
    np.testing.assert_allclose(jax.jit(f)(x), A * x, **TIGHT)
    np.testing.assert_allclose(jax.linear_transpose(f, x)(ct)[0], A * ct, **TIGHT)
    np.testing.assert_allclose(jax.vmap(jax.grad(lambda v: jnp.sum(f(v) ** 2)))(x), 2 * A * A * x, **TIGHT)
    jax.test_util.check_grads(f, (x,), order=2, modes=("fwd", "rev"))


def test_user_kernel_reports_dtype_error(user_lib):
    op = jaxbind.get_nonlinear_call(
        user_lib.axpb, (user_lib.axpb_linear_part, user_lib.axpb_linear_part), like_first, like_first)
    with pytest.raises(RuntimeError,
                       match=r"op 'axpb'.*axpb: input 0 has dtype code 11, only float64 \(12\) is supported"):
        jax.block_until_ready(jax.jit(lambda v: op(v, a=A, b=B)[0])(np.ones(3, np.float32)))
    np.testing.assert_allclose(op(np.ones(3), a=A, b=B)[0], np.full(3, A + B))


def axpb_batched_abstract(offset, x, *, batch_axes, a=1.0):
    if batch_axes is None:
        return ((x.shape, x.dtype), ((8,), np.int64))
    x_axes = batch_axes[1]
    assert batch_axes[0] == ()  # the fixed scalar is mapped at no level
    sizes = tuple(x.shape[axis] for axis in x_axes)
    return ((x.shape, x.dtype, x_axes[-1]), (sizes + (8,), np.int64, len(sizes) - 1))


def test_user_kernel_sees_batch_levels_and_axes(user_lib, rand):
    op = jaxbind.get_nonlinear_call(
        user_lib.axpb_batched, (user_lib.axpb_batched, user_lib.axpb_batched),
        axpb_batched_abstract, axpb_batched_abstract, first_n_args_fixed=2, func_can_batch=True)
    offset = np.float64(0.5)
    f = lambda o, v: op(o, v, a=A)  # noqa: E731
    x = rand(3, 4)

    y, report = jax.jit(f)(offset, x)
    np.testing.assert_allclose(y, A * x + offset, **TIGHT)
    np.testing.assert_array_equal(report, [0, 0, -2, -2, -2, -2, -2, -2])

    before = calls_of(user_lib)
    y, report = jax.jit(jax.vmap(f, in_axes=(None, 1)))(offset, x)
    assert calls_of(user_lib) - before == 1  # the whole batch in one call
    np.testing.assert_allclose(y, (A * x + offset).T, **TIGHT)
    # one level; flat batch_axes [offset: -1, x: 1]
    np.testing.assert_array_equal(report[0], [1, 2, -1, 1, -2, -2, -2, -2])

    xs = rand(2, 3, 4)
    g = jax.vmap(jax.vmap(f, in_axes=(None, 1)), in_axes=(None, 0))
    before = calls_of(user_lib)
    y, report = jax.jit(g)(offset, xs)
    assert calls_of(user_lib) - before == 1
    np.testing.assert_allclose(y, np.swapaxes(A * xs + offset, 1, 2), **TIGHT)
    # two levels, the inner vmap first: x's axes (2, 0) in the full array
    np.testing.assert_array_equal(report[0, 0], [2, 4, -1, -1, 2, 0, -2, -2])


# ---------------------------------------------------------------------------
# 10. Other forms of the same kernel: an address, a PyCapsule, a CFUNCTYPE
# ---------------------------------------------------------------------------

SCALE_ADDRESS = ctypes.cast(LIB.jb_scale, ctypes.c_void_p).value


def make_capsule(address, name=b"jaxbind_kernel"):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(address, name, None)


def kernel_forms():
    return {
        "ctypes": LIB.jb_scale,
        "native": jaxbind.native(SCALE_ADDRESS),
        "native_named": jaxbind.native(SCALE_ADDRESS, name="scale_by_address", keepalive=LIB),
        "capsule": make_capsule(SCALE_ADDRESS),
        "capsule_unnamed": make_capsule(SCALE_ADDRESS, None),
        "cfunctype": ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(SCALE_ADDRESS),
    }


@pytest.mark.parametrize("form", sorted(kernel_forms()))
def test_kernel_forms_give_the_same_results(form, rand):
    kernel = kernel_forms()[form]
    op = jaxbind.get_linear_call(kernel, kernel, like_last, like_last)
    x = rand(3, 2, dtype=np.complex128)
    f = lambda v: op(v, factor=FACTOR)[0]  # noqa: E731
    np.testing.assert_allclose(jax.jit(f)(x), FACTOR * x, **TIGHT)
    np.testing.assert_allclose(jax.vmap(f, in_axes=1)(x), FACTOR * x.T, **TIGHT)
    np.testing.assert_allclose(jax.grad(loss_of(f))(x), jax.grad(loss_of(reference_scale))(x), **TIGHT)


def test_kernel_form_names():
    assert jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_scale, like_last, like_last).name == "jb_scale"
    named = jaxbind.native(SCALE_ADDRESS, name="scale_by_address")
    op = jaxbind.get_linear_call(named, named, like_last, like_last)
    assert op.name == "scale_by_address"
    unnamed = jaxbind.get_linear_call(jaxbind.native(SCALE_ADDRESS), LIB.jb_scale, like_last, like_last)
    assert f"{SCALE_ADDRESS:#x}" in unnamed.name
    fails = jaxbind.native(ctypes.cast(LIB.jb_fail, ctypes.c_void_p).value, name="my_failing_kernel")
    bad = jaxbind.get_linear_call(fails, fails, like_first, like_first)  # not equal to fail_op
    with pytest.raises(RuntimeError, match=r"op 'my_failing_kernel'.*on purpose"):
        jax.block_until_ready(bad(np.ones(2))[0])
    with pytest.raises(RuntimeError, match=r"op 'my_failing_kernel'.*on purpose"):
        jax.block_until_ready(jax.jit(lambda v: bad(v)[0])(np.ones(2)))


def test_same_address_under_another_name_is_another_op():
    # Equal ops share compiled code, so kernels are equal by address *and*
    # name: an error always names the op that was called, eager or jitted.
    def abstract(x, **kwargs):  # a fresh abstract: no other test's op is equal to these
        return ((x.shape, x.dtype),)

    address = ctypes.cast(LIB.jb_fail, ctypes.c_void_p).value
    first = jaxbind.get_linear_call(LIB.jb_fail, LIB.jb_fail, abstract, abstract)
    second = jaxbind.get_linear_call(jaxbind.native(address, name="second"),
                                     jaxbind.native(address, name="second"), abstract, abstract)
    assert first != second and first.name == "jb_fail" and second.name == "second"
    for call in (lambda op, v: op(v)[0], lambda op, v: jax.jit(lambda u: op(u)[0])(v)):
        with pytest.raises(RuntimeError, match=r"op 'jb_fail'"):
            jax.block_until_ready(call(first, np.ones(2)))
        with pytest.raises(RuntimeError, match=r"op 'second'"):
            jax.block_until_ready(call(second, np.ones(2)))


def test_equal_kernels_make_equal_ops():
    forms = kernel_forms()
    address = jaxbind.native(SCALE_ADDRESS)
    assert address == jaxbind.native(SCALE_ADDRESS) and hash(address) == hash(jaxbind.native(SCALE_ADDRESS))
    named = jaxbind.native(SCALE_ADDRESS, name="jb_scale")
    assert named != address
    assert jaxbind.native(SCALE_ADDRESS) != jaxbind.native(ctypes.cast(LIB.jb_fail, ctypes.c_void_p).value)

    def op_of(f, f_T, **flags):
        return jaxbind.get_linear_call(f, f_T, like_last, like_last, **flags)

    # named like the ctypes function: the same kernel
    by_name = [op_of(LIB.jb_scale, LIB.jb_scale), op_of(named, named), op_of(LIB.jb_scale, named)]
    # unnamed forms of the address: equal to each other
    unnamed = [op_of(forms[k], forms[k]) for k in ("native", "capsule", "capsule_unnamed", "cfunctype")]
    unnamed.append(op_of(forms["native"], forms["capsule"]))
    for group in (by_name, unnamed):
        for op in group:
            assert op == group[0] and hash(op) == hash(group[0])
    assert by_name[0] != unnamed[0]
    assert op_of(LIB.jb_scale, LIB.jb_fail) != by_name[0]
    assert op_of(LIB.jb_scale, LIB.jb_scale, func_can_batch=True) != by_name[0]
    assert op_of(LIB.jb_scale, LIB.jb_scale, first_n_args_fixed=1) != by_name[0]


def test_equal_native_ops_share_compiled_code():
    traces = []

    def counting_abstract(x, **kwargs):
        traces.append(1)
        return ((x.shape, x.dtype),)

    forms = kernel_forms()
    op1 = jaxbind.get_linear_call(forms["cfunctype"], forms["cfunctype"], counting_abstract, counting_abstract)
    op2 = jaxbind.get_linear_call(forms["capsule"], forms["native"], counting_abstract, counting_abstract)
    assert op1 == op2
    x = np.arange(4.0)
    np.testing.assert_allclose(op1(x, factor=2.0)[0], 2 * x)
    np.testing.assert_allclose(op2(x, factor=2.0)[0], 2 * x)
    assert len(traces) == 1


# ---------------------------------------------------------------------------
# 11. A numba cfunc reading the call struct as int64 fields
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def numba_scale():
    """A numba cfunc: out[0] = factor * in[last] (float64; kwarg "factor", default 3).

    All fields of jaxbind_call, jaxbind_array and jaxbind_kwarg are 8 bytes, so
    the kernel reads them as int64 arrays and turns addresses into typed
    arrays with a small inttoptr intrinsic.
    """
    numba = pytest.importorskip("numba")
    from numba import carray, types
    from numba.extending import intrinsic

    def pointer_to(element):
        @intrinsic
        def as_pointer(typingctx, address):
            def codegen(context, builder, signature, args):
                return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

            return types.CPointer(element)(types.int64), codegen

        return as_pointer

    i64_ptr, f64_ptr, u8_ptr = pointer_to(types.int64), pointer_to(types.float64), pointer_to(types.uint8)
    factor_name = np.frombuffer(b"factor\0", np.uint8)
    message = np.frombuffer(b"numba kernel: float64 only\0", np.uint8)

    @numba.njit
    def has_name(address, expected):
        chars = carray(u8_ptr(address), expected.size)
        for k in range(expected.size):
            if chars[k] != expected[k]:
                return False
        return True

    @numba.cfunc(types.int32(types.CPointer(types.int64)), nopython=True)
    def numba_scale(call_address):
        call = carray(call_address, 10)  # struct_size, abi, n_out, out, n_in, in, n_kw, kw, error, error_size
        x = carray(i64_ptr(call[5] + 32 * (call[4] - 1)), 4)  # data, shape, rank, dtype
        y = carray(i64_ptr(call[3]), 4)
        if x[3] != 12 or y[3] != 12:
            error = carray(u8_ptr(call[8]), call[9])
            for k in range(min(message.size, call[9])):
                error[k] = message[k]
            return 1
        shape = carray(i64_ptr(x[1]), x[2])
        n = 1
        for d in range(x[2]):
            n *= shape[d]
        factor = 3.0
        kwargs = carray(i64_ptr(call[7]), 8 * call[6])  # name, type, size, int, float, str, ints, floats
        kwargs_f = carray(f64_ptr(call[7]), 8 * call[6])
        for k in range(call[6]):
            if has_name(kwargs[8 * k], factor_name):
                if kwargs[8 * k + 1] == 2:
                    factor = kwargs_f[8 * k + 4]
                elif kwargs[8 * k + 1] == 1:
                    factor = float(kwargs[8 * k + 3])
        xs = carray(f64_ptr(x[0]), n)
        ys = carray(f64_ptr(y[0]), n)
        for i in range(n):
            ys[i] = factor * xs[i]
        return 0

    return numba_scale


def test_numba_cfunc_kernel(numba_scale, rand):
    op = jaxbind.get_linear_call(numba_scale, numba_scale, like_last, like_last)
    assert op.name == "numba_scale"
    x = rand(3, 4)
    np.testing.assert_allclose(op(x)[0], 3 * x, **TIGHT)
    f = lambda v: op(v, factor=FACTOR)[0]  # noqa: E731
    np.testing.assert_allclose(jax.jit(f)(x), FACTOR * x, **TIGHT)
    np.testing.assert_allclose(op(x, factor=-2)[0], -2 * x, **TIGHT)  # an int kwarg
    np.testing.assert_allclose(jax.grad(loss_of(f))(x), jax.grad(loss_of(reference_scale))(x), **TIGHT)
    np.testing.assert_allclose(jax.vmap(f, in_axes=1)(x), FACTOR * x.T, **TIGHT)
    jax.test_util.check_grads(f, (x,), order=2, modes=("fwd", "rev"))
    # the same cfunc as an address with its name: an equal op
    same = jaxbind.native(numba_scale.address, name="numba_scale")
    assert jaxbind.get_linear_call(same, same, like_last, like_last) == op


def test_numba_cfunc_kernel_error(numba_scale):
    op = jaxbind.get_linear_call(numba_scale, numba_scale, like_last, like_last)
    with pytest.raises(RuntimeError, match=r"op 'numba_scale'.*numba kernel: float64 only"):
        jax.block_until_ready(jax.jit(lambda v: op(v)[0])(np.ones(3, np.float32)))


# ---------------------------------------------------------------------------
# Concurrent kernels: run on XLA's thread pool while XLA goes on
# ---------------------------------------------------------------------------


def concurrent_scale_op():
    kernel = jaxbind.native(LIB.jb_scale, concurrent=True)
    return jaxbind.get_linear_call(kernel, kernel, like_last, like_last)


def test_concurrent_kernel_under_every_transformation(rng):
    op = concurrent_scale_op()
    x = rng.standard_normal((4, 3))
    f = lambda v: op(v, factor=3.0)[0]  # noqa: E731
    np.testing.assert_allclose(jax.jit(f)(x), 3 * x)
    np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(f(v) ** 2))(x), 18 * x)
    np.testing.assert_allclose(jax.jit(jax.vmap(f, in_axes=1))(x), 3 * x.T)
    text = jax.jit(f).lower(x).as_text()
    assert "jaxbind_dispatch_async" in text


def test_concurrent_kernel_error_names_the_op():
    kernel = jaxbind.native(LIB.jb_fail, concurrent=True)
    op = jaxbind.get_linear_call(kernel, kernel, like_last, like_last)
    with pytest.raises(RuntimeError, match=r"op 'jb_fail'.*kernel failed on purpose \(code=5\)"):
        jax.block_until_ready(jax.jit(lambda v: op(v, code=5)[0])(np.ones(2)))
    np.testing.assert_allclose(jax.jit(lambda v: concurrent_scale_op()(v)[0])(np.ones(2)), 2 * np.ones(2))


def test_concurrent_and_plain_kernels_are_different_ops():
    plain = jaxbind.native(LIB.jb_scale)
    concurrent = jaxbind.native(LIB.jb_scale, concurrent=True)
    assert plain != concurrent and concurrent == jaxbind.native(LIB.jb_scale, concurrent=True)
    assert concurrent.__name__ == "jb_scale"


def test_independent_concurrent_chains_give_right_results():
    # Two independent chains of calls in a program XLA runs as a dataflow graph.
    kernel = jaxbind.native(LIB.jb_busy, concurrent=True)
    busy = jaxbind.get_linear_call(kernel, kernel, like_last, like_last)

    def chain(a):
        for _ in range(5):
            a = busy(a, iterations=3000)[0]
        return a

    x = np.linspace(0.0, 1.0, 1000)
    a, b = jax.jit(lambda u, v: (chain(u), chain(v)))(x, x + 1)
    step = np.sin(np.arange(3000.0)).sum() / 3000
    np.testing.assert_allclose(a, x + 5 * step, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(b, x + 1 + 5 * step, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["jb_xsin", "jb_busy", "jb_double", "jb_triple_and_sum"])
def test_test_kernels_refuse_a_dtype_they_do_not_handle(kernel):
    # A kernel that assumes float64 and gets float32 would read and write past
    # the ends of the buffers: it checks and fails instead.
    def abstract(x):
        outs = ((x.shape, x.dtype),)
        return outs + (((), x.dtype),) if kernel == "jb_triple_and_sum" else outs

    op = jaxbind.get_nonlinear_call(getattr(LIB, kernel), (LIB.jb_empty, LIB.jb_empty), abstract, abstract)
    with pytest.raises(RuntimeError, match=rf"op '{kernel}'.*(float64|dtype code 11)"):
        jax.block_until_ready(op(jnp.ones(3, jnp.float32)))

"""numba kernels (``jaxbind.numba_kernel``): kernels written in Python, compiled by numba per
signature and called like C kernels, with no Python and no GIL on the call path.

Linear, multilinear and nonlinear ops in float32, float64 and complex128 under jit, grad,
vmap (nested too) and ``check_op`` against ``jax.numpy``; kwargs of every kind the ABI
carries; ``func_can_batch``; a kernel that holds no GIL; the parallel walk; the native-kernels guide's
example. Errors (a raising kernel, a kernel numba cannot compile, kwargs and dtypes numba
cannot take) are in ``test_numba_kernel_errors.py``, the native-form checks and default
names in ``test_numba_kernel_forms.py``.
"""

import ctypes
import math
import os
import re
import threading
import time

import pytest

numba = pytest.importorskip("numba")

import _kernels
import jax
import jax.numpy as jnp
import numpy as np
from zoo import like_first, like_last, loss_of

import jaxbind
from jaxbind import _numba

LIB = _kernels.load()
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.complex128)]
FACTOR = -1.75


def tolerance(dtype):
    return dict(rtol=2e-6, atol=2e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-13)


@pytest.fixture
def data(rng):
    def make(*shape, dtype=np.float64):
        x = rng.standard_normal(shape)
        if np.dtype(dtype).kind == "c":
            x = x + 1j * rng.standard_normal(shape)  # genuinely complex
        return x.astype(dtype)

    return make


# ---------------------------------------------------------------------------
# The kernels (any rank: they go over .flat)
# ---------------------------------------------------------------------------


@jaxbind.numba_kernel
def nb_scale(out, args, kwargs):
    """y = factor * x (the last input): linear, its own transpose."""
    x, y = args[-1], out[0]
    for i in range(x.size):
        y.flat[i] = kwargs.factor * x.flat[i]


@jaxbind.numba_kernel
def nb_multiply(out, args, kwargs):
    """y = a * b elementwise: bilinear; each transpose is the other factor times the cotangent."""
    a, b, y = args[0], args[1], out[0]
    for i in range(y.size):
        y.flat[i] = a.flat[i] * b.flat[i]


@jaxbind.numba_kernel
def nb_xsin(out, args, kwargs):
    """y = x sin(x)."""
    x, y = args[0], out[0]
    for i in range(x.size):
        v = x.flat[i]
        y.flat[i] = v * np.sin(v)


@jaxbind.numba_kernel
def nb_xsin_derivative(out, args, kwargs):
    """The jvp (x, t) and the vjp (x, ct) alike: (sin x + x cos x) t."""
    x, t, y = args[0], args[1], out[0]
    for i in range(x.size):
        v = x.flat[i]
        y.flat[i] = (np.sin(v) + v * np.cos(v)) * t.flat[i]


scale_op = jaxbind.get_linear_call(nb_scale, nb_scale, like_last, like_last)
multiply_op = jaxbind.get_linear_call(nb_multiply, (nb_multiply, nb_multiply), like_last, (like_last, like_last))
xsin_op = jaxbind.get_nonlinear_call(nb_xsin, (nb_xsin_derivative, nb_xsin_derivative), like_first, like_first)


def apply_all(f, reference, x, tol, nested_shape):
    """f against reference under jit, grad of a real loss, vmap and nested vmap."""
    np.testing.assert_allclose(jax.jit(f)(x), reference(x), **tol)
    np.testing.assert_allclose(jax.grad(loss_of(f))(x), jax.grad(loss_of(reference))(x), **tol)
    np.testing.assert_allclose(jax.vmap(f, in_axes=1)(x), jax.vmap(reference, in_axes=1)(x), **tol)
    xs = x.reshape(nested_shape)
    nested = lambda g: jax.jit(jax.vmap(jax.vmap(g, in_axes=1), in_axes=2))
    np.testing.assert_allclose(nested(f)(xs), nested(reference)(xs), **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_linear_op(dtype, data):
    x = data(4, 6, dtype=dtype)
    tol = tolerance(dtype)
    f = lambda v: scale_op(v, factor=FACTOR)[0]
    apply_all(f, lambda v: FACTOR * v, x, tol, (2, 2, 6))
    np.testing.assert_allclose(jax.linear_transpose(f, x)(x)[0], FACTOR * x, **tol)
    jaxbind.testing.check_op(scale_op, x, factor=FACTOR)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_multilinear_op(dtype, data):
    a, b = data(3, 4, dtype=dtype), data(3, 4, dtype=dtype)
    tol = tolerance(dtype)
    np.testing.assert_allclose(jax.jit(lambda u, v: multiply_op(u, v)[0])(a, b), a * b, **tol)
    for argnum in (0, 1):
        got = jax.grad(lambda u, v: loss_of(lambda w: w)(multiply_op(u, v)[0]), argnums=argnum)(a, b)
        want = jax.grad(lambda u, v: loss_of(lambda w: w)(u * v), argnums=argnum)(a, b)
        np.testing.assert_allclose(got, want, **tol)
    # vmap with one factor unmapped, and nested
    got = jax.vmap(lambda u, v: multiply_op(u, v)[0], in_axes=(None, 1))(a[:, 0], b)
    np.testing.assert_allclose(got, (a[:, :1] * b).T, **tol)
    nested = jax.jit(jax.vmap(jax.vmap(lambda u, v: multiply_op(u, v)[0]), in_axes=(1, 1)))
    np.testing.assert_allclose(nested(a, b), (a * b).T, **tol)
    jaxbind.testing.check_op(multiply_op, a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_nonlinear_op(dtype, data):
    x = data(4, 6, dtype=dtype)
    tol = tolerance(dtype)
    f = lambda v: xsin_op(v)[0]
    apply_all(f, lambda v: v * jnp.sin(v), x, tol, (2, 2, 6))
    jvp_got = jax.jvp(f, (x,), (x[::-1],))[1]
    jvp_want = jax.jvp(lambda v: v * jnp.sin(v), (x,), (x[::-1],))[1]
    np.testing.assert_allclose(jvp_got, jvp_want, **tol)
    jaxbind.testing.check_op(xsin_op, x)


def python_xsin(out, args, kwargs_dump):
    out[0][...] = args[0] * np.sin(args[0])


def python_xsin_derivative(out, args, kwargs_dump):
    x, t = args
    out[0][...] = (np.sin(x) + x * np.cos(x)) * t


def test_numba_kernels_mix_with_python_callbacks_and_c_kernels(data):
    x = data(3, 5)
    reference = lambda v: v * jnp.sin(v)
    ops = [
        jaxbind.get_nonlinear_call(nb_xsin, (LIB.jb_xsin_derivative, python_xsin_derivative), like_first, like_first),
        jaxbind.get_nonlinear_call(LIB.jb_xsin, (nb_xsin_derivative, python_xsin_derivative), like_first, like_first),
        jaxbind.get_nonlinear_call(python_xsin, (nb_xsin_derivative, nb_xsin_derivative), like_first, like_first),
    ]
    for op in ops:
        f = lambda v, op=op: op(v)[0]
        np.testing.assert_allclose(jax.jit(f)(x), reference(x), rtol=1e-12)
        np.testing.assert_allclose(jax.grad(loss_of(f))(x), jax.grad(loss_of(reference))(x), rtol=1e-12)
        np.testing.assert_allclose(jax.vmap(f)(x), reference(x), rtol=1e-12)
    # a numba forward with a C transpose
    linear = jaxbind.get_linear_call(nb_scale, LIB.jb_scale, like_last, like_last)
    np.testing.assert_allclose(jax.linear_transpose(lambda v: linear(v, factor=3.0)[0], x)(x)[0], 3.0 * x)


def test_op_name_defaults_to_the_function_name_and_options():
    assert scale_op.name == "nb_scale" and nb_scale.__name__ == "nb_scale"
    assert isinstance(nb_scale, jaxbind.NativeKernel)

    @jaxbind.numba_kernel(name="renamed", concurrent=True)
    def copy(out, args, kwargs):
        for i in range(args[0].size):
            out[0].flat[i] = args[0].flat[i]

    op = jaxbind.get_linear_call(copy, copy, like_first, like_first)
    assert op.name == "renamed" and copy.concurrent
    x = np.arange(5.0)
    f = jax.jit(lambda v: op(v)[0])
    np.testing.assert_array_equal(f(x), x)
    assert "jaxbind_dispatch_async" in f.lower(x).as_text()


def test_an_njit_function_is_taken_with_its_options():
    def twice(out, args, kwargs):
        for i in range(args[0].size):
            out[0].flat[i] = 2 * args[0].flat[i]

    kernel = jaxbind.numba_kernel(numba.njit(fastmath=True)(twice))
    op = jaxbind.get_linear_call(kernel, kernel, like_first, like_first)
    assert op.name == "twice"
    np.testing.assert_array_equal(jax.jit(lambda v: op(v)[0])(np.arange(4.0)), 2 * np.arange(4.0))


def test_equal_kernels_make_equal_ops():
    def body(out, args, kwargs):
        for i in range(args[0].size):
            out[0].flat[i] = args[0].flat[i]

    a, b = jaxbind.numba_kernel(body), jaxbind.numba_kernel(body)
    assert a == b and hash(a) == hash(b)
    assert jaxbind.get_linear_call(a, a, like_first, like_first) == jaxbind.get_linear_call(
        b, b, like_first, like_first
    )
    assert a != jaxbind.numba_kernel(body, name="other") and a != jaxbind.numba_kernel(body, concurrent=True)
    assert a != jaxbind.numba_kernel(lambda out, args, kwargs: None)
    renamed = jaxbind.native(a, name="via_native", concurrent=True)  # keeps its kind
    assert isinstance(renamed, _numba.NumbaKernel) and renamed.__name__ == "via_native" and renamed.concurrent
    op = jaxbind.get_linear_call(renamed, renamed, like_first, like_first)
    np.testing.assert_array_equal(jax.jit(lambda v: op(v)[0])(np.arange(3.0)), np.arange(3.0))


# ---------------------------------------------------------------------------
# kwargs
# ---------------------------------------------------------------------------


@jaxbind.numba_kernel
def nb_kwargs_probe(out, args, kwargs):
    """out[0] (float64, 8) = what the kernel sees of its kwargs."""
    report = out[0]
    report[0] = kwargs.n
    report[1] = kwargs.r
    report[2] = 1.0 if kwargs.flag else -1.0
    report[3] = kwargs.ints.size
    report[4] = kwargs.ints[-1]
    report[5] = kwargs.floats.sum()
    report[6] = kwargs.empty.size
    report[7] = args[0][0]


def probe_abstract(x, **kwargs):
    return (((8,), np.float64),)


probe_op = jaxbind.get_nonlinear_call(nb_kwargs_probe, None, probe_abstract, None)


def test_kwargs_of_every_kind():
    kwargs = dict(n=2**62, r=-1.5, flag=True, ints=np.array([3, -7], np.int64), floats=[0.25, 0.5, 4.0], empty=[])
    report = jax.jit(lambda v: probe_op(v, **kwargs)[0])(np.array([9.0]))
    np.testing.assert_array_equal(report, [float(2**62), -1.5, 1.0, 2, -7, 4.75, 0, 9.0])
    # other types for the same names: another compiled variant, the right values
    kwargs.update(n=3.5, r=4, flag=False, ints=(np.int32(5),), floats=np.array([1.0]))
    report = probe_op(np.array([1.0]), **kwargs)[0]
    np.testing.assert_array_equal(report, [3.5, 4.0, -1.0, 1, 5, 1.0, 0, 1.0])
    # the kwargs in another order
    report = probe_op(np.array([2.0]), empty=[], floats=[2.0], ints=[1, 2, 3], flag=True, r=0.5, n=1)[0]
    np.testing.assert_array_equal(report, [1.0, 0.5, 1.0, 3, 3, 2.0, 0, 2.0])


# ---------------------------------------------------------------------------
# func_can_batch: the kernel sees the whole batch and batch_levels / batch_axes
# ---------------------------------------------------------------------------


@jaxbind.numba_kernel
def nb_batched_axpb(out, args, kwargs):
    """(offset scalar, x batched anywhere) -> a x + offset over the whole batch; out[1] (int64,
    its first 8 entries) = [batch_levels, entries of batch_axes, those entries, -2...]."""
    offset, x = args
    y, report = out
    for i in range(x.size):
        y.flat[i] = kwargs.a * x.flat[i] + offset[()]
    for k in range(8):
        report.flat[k] = -2
    report.flat[0] = kwargs.batch_levels
    report.flat[1] = kwargs.batch_axes.size
    for k in range(min(kwargs.batch_axes.size, 6)):
        report.flat[2 + k] = kwargs.batch_axes[k]


def batched_abstract(offset, x, *, batch_axes, a=1.0):
    if batch_axes is None:
        return ((x.shape, x.dtype), ((8,), np.int64))
    x_axes = batch_axes[1]
    sizes = tuple(x.shape[axis] for axis in x_axes)
    return ((x.shape, x.dtype, x_axes[-1]), (sizes + (8,), np.int64, len(sizes) - 1))


def test_func_can_batch_sees_batch_levels_and_axes(data):
    op = jaxbind.get_nonlinear_call(
        nb_batched_axpb, None, batched_abstract, None, first_n_args_fixed=2, func_can_batch=True
    )
    offset, a = np.float64(0.5), 1.5
    f = lambda o, v: op(o, v, a=a)
    x = data(3, 4)
    y, report = jax.jit(f)(offset, x)
    np.testing.assert_allclose(y, a * x + offset, rtol=1e-14)
    np.testing.assert_array_equal(report, [0, 0, -2, -2, -2, -2, -2, -2])
    y, report = jax.jit(jax.vmap(f, in_axes=(None, 1)))(offset, x)
    np.testing.assert_allclose(y, (a * x + offset).T, rtol=1e-14)
    np.testing.assert_array_equal(report[0], [1, 2, -1, 1, -2, -2, -2, -2])  # [offset: -1, x: 1]
    xs = data(2, 3, 4)
    y, report = jax.jit(jax.vmap(jax.vmap(f, in_axes=(None, 1)), in_axes=(None, 0)))(offset, xs)
    np.testing.assert_allclose(y, np.swapaxes(a * xs + offset, 1, 2), rtol=1e-14)
    np.testing.assert_array_equal(report[0, 0], [2, 4, -1, -1, 2, 0, -2, -2])


def test_batch_kwargs_exist_only_with_func_can_batch():
    def abstract(offset, x, a=1.0):
        return ((x.shape, x.dtype), ((8,), np.int64))

    op = jaxbind.get_nonlinear_call(nb_batched_axpb, None, abstract, None, first_n_args_fixed=2, name="not_batched")
    with pytest.raises(RuntimeError, match=r"(?s)op 'not_batched'.*Unknown attribute 'batch_levels'"):
        jax.block_until_ready(op(np.float64(0.5), np.ones(3), a=1.0)[0])


# ---------------------------------------------------------------------------
# No GIL, and the parallel walk
# ---------------------------------------------------------------------------


@jaxbind.numba_kernel
def nb_spin(out, args, kwargs):
    """y = x + sum_{k < n} sin(k h), n = kwargs.iterations, h = kwargs.h: busy work."""
    acc = 0.0
    for k in range(kwargs.iterations):
        acc += math.sin(k * kwargs.h)
    for i in range(args[0].size):
        out[0].flat[i] = args[0].flat[i] + acc


def sine_sum(n, h):
    return math.sin(n * h / 2) * math.sin((n - 1) * h / 2) / math.sin(h / 2)


spin_op = jaxbind.get_nonlinear_call(nb_spin, None, like_first, None)


def test_a_long_kernel_holds_no_gil():
    f = jax.jit(lambda v, n: spin_op(v, iterations=n, h=1e-3)[0], static_argnums=1)
    x = np.zeros(1)
    jax.block_until_ready(f(x, 10**6))  # the kernel compiled
    start = time.perf_counter()
    jax.block_until_ready(f(x, 10**6))
    n = max(10**6, int(10**6 * 0.5 / max(time.perf_counter() - start, 1e-4)))  # for about 0.5 s
    jax.block_until_ready(f(x, n))  # the program for this n compiled (the same kernel)
    stamps, stop = [], threading.Event()

    def count():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    thread = threading.Thread(target=count)
    thread.start()
    try:
        time.sleep(0.02)
        begin = time.perf_counter()
        y = jax.block_until_ready(f(x, n))
        end = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    np.testing.assert_allclose(y, [sine_sum(n, 1e-3)], rtol=1e-6, atol=1e-6)
    during = [t for t in stamps if begin <= t <= end]
    gaps = np.diff([begin] + during + [end])
    assert end - begin > 0.1, "the kernel was too short to tell"
    # Holding the GIL, the kernel would stop the counting thread for its whole run.
    assert len(during) > 100 and gaps.max() < 0.5 * (end - begin), (len(during), gaps.max(), end - begin)


_libc = ctypes.CDLL(None)
_pthread_self = _libc.pthread_self
_pthread_self.restype = ctypes.c_uint64
_pthread_self.argtypes = []


@jaxbind.numba_kernel
def nb_copy_and_thread(out, args, kwargs):
    """out[0] = in[0] after about kwargs.iterations sines; out[1] = the thread that ran it."""
    acc = 0.0
    for k in range(kwargs.iterations):
        acc += math.sin(k)
    for i in range(args[0].size):
        out[0].flat[i] = args[0].flat[i] + 0.0 * acc
    out[1][()] = np.int64(_pthread_self())


def copy_and_thread(x, **kwargs):
    return ((x.shape, x.dtype), ((), np.int64))


def test_a_vmapped_kernel_walks_on_more_than_one_thread():
    op = jaxbind.get_nonlinear_call(nb_copy_and_thread, None, copy_and_thread, None)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 5)))
    f = jax.jit(jax.vmap(lambda r: op(r, iterations=20000)))
    y, threads = f(x)
    np.testing.assert_array_equal(y, x)
    for _ in range(3):  # (a loaded machine may run a whole walk on one thread now and then)
        if len(set(np.asarray(threads).tolist())) > 1:
            break
        y, threads = f(x)
    assert len(set(np.asarray(threads).tolist())) > 1, "the walk ran on one thread only"
    nested = jax.jit(jax.vmap(jax.vmap(lambda r: op(r, iterations=20000)[0])))
    np.testing.assert_array_equal(nested(x.reshape(4, 16, 5)), x.reshape(4, 16, 5))


def test_the_guides_example_runs_and_is_right():
    guide = os.path.join(
        os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "docs", "guides", "native.md"
    )
    if not os.path.exists(guide):
        pytest.skip("no docs/ beside the tests")
    with open(guide) as f:
        text = f.read()
    code = re.search(r"```\{testcode\}\n(.*?)```", text[text.index("## numba") :], re.S).group(1)
    scope = {}
    exec(compile(code, "docs/guides/native.md (numba)", "exec"), scope)
    x = scope["x"]
    reference = lambda v: jnp.log1p(jnp.exp(3 * v))
    np.testing.assert_allclose(scope["y"], reference(x), rtol=1e-12)
    np.testing.assert_allclose(scope["g"], jax.grad(lambda v: jnp.sum(reference(v)))(x), rtol=1e-12)
    np.testing.assert_allclose(scope["ys"], jnp.stack([reference(x)] * 64), rtol=1e-12)

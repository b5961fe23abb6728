"""numba kernels that fail, and inputs they cannot take: every error names the op (or the kernel)
and says what to fix. A kernel that raises, a kernel numba cannot compile, kwargs and dtypes numba
cannot take, and jaxbind.numba_kernel without numba or given what is not a function.
"""

import sys

import pytest

numba = pytest.importorskip("numba")

import jax
import jax.numpy as jnp
import numpy as np
from zoo import like_last

import jaxbind
from jaxbind._numba import _checks


@jaxbind.numba_kernel
def nb_scale(out, args, kwargs):
    """y = factor * x (the last input): linear, its own transpose."""
    x, y = args[-1], out[0]
    for i in range(x.size):
        y.flat[i] = kwargs.factor * x.flat[i]


scale_op = jaxbind.get_linear_call(nb_scale, nb_scale, like_last, like_last)


# ---------------------------------------------------------------------------
# kwargs and dtypes numba cannot take, a kernel numba cannot compile
# ---------------------------------------------------------------------------


def test_a_kwarg_numba_cannot_take_is_refused_naming_it():
    x = np.ones(3)
    with pytest.raises(TypeError, match=r"numba kernel 'nb_scale'.*'mode' is a string"):
        scale_op(x, factor=2.0, mode="fast")
    with pytest.raises(TypeError, match=r"numba kernel 'nb_scale'.*'_private' cannot be a field"):
        jax.jit(lambda v: scale_op(v, factor=2.0, _private=1)[0])(x)
    with pytest.raises(TypeError, match=r"'grid'.*2 dimensions"):  # (refused for every native kernel)
        scale_op(x, factor=2.0, grid=[[1.0, 2.0]])


def test_a_kwarg_the_kernel_reads_but_the_call_lacks_is_an_error_naming_the_op():
    with pytest.raises(
        RuntimeError,
        match=r"(?s)op 'nb_scale'.*could not compile kernel 'nb_scale'.*"
        r"Unknown attribute 'factor'",
    ):
        jax.block_until_ready(scale_op(np.ones(3))[0])


def test_a_dtype_numba_cannot_take_is_refused():
    for dtype in (jnp.bfloat16, np.float16):
        with pytest.raises(
            TypeError,
            match=rf"numba kernel 'nb_scale': input 0 has dtype {np.dtype(dtype).name}, "
            "which numba does not support",
        ):
            scale_op(jnp.ones(3, dtype), factor=0.125)


# ---------------------------------------------------------------------------
# Errors a kernel raises
# ---------------------------------------------------------------------------


@jaxbind.numba_kernel
def nb_checked_sqrt(out, args, kwargs):
    x, y = args[-1], out[0]
    for i in range(x.size):
        if x.flat[i] < 0:
            raise ValueError("nb_checked_sqrt: a negative input")
        y.flat[i] = np.sqrt(x.flat[i])


@jaxbind.numba_kernel
def nb_fails_with_the_value(out, args, kwargs):
    for i in range(args[-1].size):
        if args[-1].flat[i] < 0:
            raise ValueError("negative:", args[-1].flat[i])  # a message numba formats at run time
    for i in range(args[-1].size):
        out[0].flat[i] = args[-1].flat[i]


def test_an_exception_in_a_kernel_is_an_error_naming_the_op():
    op = jaxbind.get_nonlinear_call(nb_checked_sqrt, None, like_last, None)
    good = np.array([4.0, 9.0])
    np.testing.assert_allclose(jax.jit(lambda v: op(v)[0])(good), [2.0, 3.0])
    message = (
        r"op 'nb_checked_sqrt': native kernel failed: numba kernel 'nb_checked_sqrt' raised "
        r"ValueError: nb_checked_sqrt: a negative input"
    )
    with pytest.raises(RuntimeError, match=message):
        jax.block_until_ready(op(-good)[0])
    with pytest.raises(RuntimeError, match=message):
        jax.block_until_ready(jax.jit(lambda v: op(v)[0])(-good))
    many = np.abs(np.random.default_rng(0).standard_normal((64, 3))) + 1
    many[50, 1] = -1  # in the walk, maybe on another thread
    with pytest.raises(RuntimeError, match=message):
        jax.block_until_ready(jax.jit(jax.vmap(lambda v: op(v)[0]))(many))
    np.testing.assert_allclose(jax.jit(lambda v: op(v)[0])(good), [2.0, 3.0])  # and it still runs


def test_a_failing_transpose_names_the_op_and_the_callback():
    op = jaxbind.get_linear_call(nb_scale, nb_fails_with_the_value, like_last, like_last, name="scale_checked")
    x = np.ones(3)
    np.testing.assert_allclose(jax.linear_transpose(lambda v: op(v, factor=2.0)[0], x)(x)[0], x)
    with pytest.raises(
        (RuntimeError, ValueError),  # (the exception type is JAX's choice here)
        match=r"op 'scale_checked' \(transpose callback 'nb_fails_with_the_value'\)"
        r".*raised ValueError: .*negative:.*-2\.5",
    ):
        jax.block_until_ready(jax.linear_transpose(lambda v: op(v, factor=2.0)[0], x)(np.array([1, -2.5, 3]))[0])


def test_kernels_dropped_take_their_variants_out_of_the_error_table():
    # The compiled code finds the name for a kernel's error message by its variant's id; a process
    # that makes kernels from closures and drops them must not keep a row per variant it compiled.
    import gc

    from jaxbind._numba._callbacks import REPORTS

    def closure(k):
        def scaled(out, args, kwargs):
            x, y = args[-1], out[0]
            for i in range(x.size):
                if x.flat[i] < 0:
                    raise ValueError("below zero")
                y.flat[i] = (k + 1) * x.flat[i]

        scaled.__name__ = f"dropped_closure_{k}"
        return scaled

    gc.collect()
    start = len(REPORTS)
    for k in range(4):
        op = jaxbind.get_nonlinear_call(jaxbind.numba_kernel(closure(k)), None, like_last, None)
        for dtype in (np.float32, np.float64):  # two variants
            x = np.arange(3, dtype=dtype)
            np.testing.assert_allclose(op(x)[0], (k + 1) * x)
        with pytest.raises(
            RuntimeError,
            match=rf"op 'dropped_closure_{k}': native kernel failed: numba "
            rf"kernel 'dropped_closure_{k}' raised ValueError: below zero",
        ):
            jax.block_until_ready(op(-np.ones(3))[0])
        assert len(REPORTS) >= start + 2  # this kernel's two variants, while it lives
        del op
        for _ in range(3):
            gc.collect()
        assert len(REPORTS) <= start, f"{len(REPORTS) - start} rows kept after {k + 1} kernels were dropped"
    # and errors are still reported by name (a kernel kept by the module)
    with pytest.raises(RuntimeError, match=r"numba kernel 'nb_checked_sqrt' raised ValueError"):
        jax.block_until_ready(jaxbind.get_nonlinear_call(nb_checked_sqrt, None, like_last, None)(-np.ones(2))[0])


# ---------------------------------------------------------------------------
# Without numba
# ---------------------------------------------------------------------------


def test_without_numba_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba now fails
    _checks.numba_or_raise.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"needs numba.*pip install numba$"):
            jaxbind.numba_kernel(lambda out, args, kwargs: None)
    finally:
        monkeypatch.undo()
        _checks.numba_or_raise.cache_clear()
    assert _checks.numba_or_raise() is numba


# Kept for the whole session: a numba cfunc that is freed leaves llvmlite a dead weakref proxy, which
# the kept-view tests' heap walk then trips over (a bug of that walk, reported; see tests/runtime).
A_CFUNC = numba.cfunc(numba.types.int32(numba.types.voidptr))(lambda call: 0)


def test_what_is_not_a_function_is_refused():
    with pytest.raises(TypeError, match="expected a Python function"):
        jaxbind.numba_kernel(42)
    with pytest.raises(TypeError, match="a numba.cfunc with the kernel signature is a kernel already"):
        jaxbind.numba_kernel(A_CFUNC)
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        jaxbind.numba_kernel(lambda out, args, kwargs: None, name="")


# ---------------------------------------------------------------------------
# Forms that cannot run without the GIL, and writes into what the kernel only reads
# ---------------------------------------------------------------------------


def _copy_body(out, args, kwargs):
    for i in range(args[0].size):
        out[0].flat[i] = args[0].flat[i]


def test_an_object_mode_function_is_refused_when_the_kernel_is_made():
    # (numba >= 0.59 ignores nopython=False: forceobj is the one way to object mode)
    with pytest.raises(TypeError, match=r"'_copy_body' is compiled in numba's object mode.*needs the GIL"):
        jaxbind.numba_kernel(numba.jit(forceobj=True)(_copy_body))
    np.testing.assert_array_equal(  # the same body in nopython mode is a kernel
        jaxbind.get_nonlinear_call(jaxbind.numba_kernel(numba.njit(_copy_body)), None, like_last, None)(np.arange(3.0))[
            0
        ],
        [0.0, 1.0, 2.0],
    )


def test_a_kernel_that_writes_an_input_does_not_compile_and_the_input_is_unchanged():
    @jaxbind.numba_kernel
    def writes_its_input(out, args, kwargs):
        args[0][0] = 99.0  # an input is XLA's buffer: here the caller's own jax.Array
        for i in range(args[0].size):
            out[0].flat[i] = args[0].flat[i]

    op = jaxbind.get_nonlinear_call(writes_its_input, None, like_last, None)
    x = jnp.arange(3.0)
    for call in (lambda v: op(v)[0], jax.jit(lambda v: op(v)[0])):
        with pytest.raises(
            RuntimeError,
            match=r"(?s)op 'writes_its_input'.*could not compile kernel "
            r"'writes_its_input'.*readonly",
        ):
            jax.block_until_ready(call(x))
    np.testing.assert_array_equal(x, [0.0, 1.0, 2.0])


def test_a_kernel_that_writes_an_array_kwarg_does_not_compile():
    @jaxbind.numba_kernel
    def bumps_its_kwarg(out, args, kwargs):
        kwargs.w[0] += 1.0  # an array kwarg is shared by every call with an equal value
        out[0].flat[0] = kwargs.w[0]

    def one(*args, **kwargs):
        return (((1,), np.float64),)

    op = jaxbind.get_nonlinear_call(bumps_its_kwarg, None, one, None)
    with pytest.raises(RuntimeError, match=r"(?s)op 'bumps_its_kwarg'.*could not compile.*readonly"):
        jax.block_until_ready(op(np.ones(1), w=[0.0, 0.0])[0])


def test_inputs_and_kwargs_are_read_only_and_still_read_everywhere():
    @jaxbind.numba_kernel
    def weighted(out, args, kwargs):
        x, w = args[0], kwargs.w  # reading read-only arrays: indexing, slicing, NumPy functions
        out[0][:] = x * w[0] + np.sum(x[1:]) * w[1]

    op = jaxbind.get_nonlinear_call(weighted, None, like_last, None)
    x = np.array([1.0, 2.0, 3.0])
    expected = x * 2.0 + (2.0 + 3.0) * 0.5
    np.testing.assert_allclose(op(x, w=[2.0, 0.5])[0], expected)
    np.testing.assert_allclose(jax.jit(lambda v: op(v, w=[2.0, 0.5])[0])(x), expected)
    batch = np.stack([x, 2 * x])
    np.testing.assert_allclose(jax.vmap(lambda v: op(v, w=[2.0, 0.5])[0])(batch), [expected, 2 * expected])

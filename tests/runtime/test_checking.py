"""The checking mode (``jaxbind.config.check_unwritten``): outputs a callback or kernel leaves unwritten."""

import os
import subprocess
import sys

import _kernels
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import checking_unwritten

import jaxbind

LIB = _kernels.load()


@pytest.fixture
def checking():
    with checking_unwritten():
        yield


def like_first(*args, **kwargs):
    return ((args[0].shape, args[0].dtype),)


def two_like_first(*args, **kwargs):
    return ((args[0].shape, args[0].dtype), (args[0].shape, args[0].dtype))


def writes(out, args, kwargs_dump):
    """Writes out[1] and the part of out[0] the kwarg `upto` says (all of it when None)."""
    upto = jaxbind.load_kwargs(kwargs_dump)["upto"]
    out[1][...] = args[0]
    out[0].reshape(-1)[:upto] = 1


written = jaxbind.get_nonlinear_call(writes, (writes, writes), two_like_first, two_like_first)


@pytest.mark.parametrize("dtype", ["float64", "float32", "complex128", "float16", "bfloat16", "int32", "uint8", "bool"])
@pytest.mark.parametrize("upto", [0, 3], ids=["none written", "partly written"])
def test_unwritten_output_elements_are_reported(checking, dtype, upto):
    x = jnp.zeros((2, 3), dtype)
    with pytest.raises(
        RuntimeError,
        match=rf"op 'writes'.*output 0 \(shape \(2, 3\)\) was not fully "
        rf"written: {6 - upto} element\(s\).*index \({upto // 3}, 0\)",
    ):
        jax.block_until_ready(written(x, upto=upto))


def test_fully_written_outputs_pass_and_the_mode_can_be_turned_off(checking):
    x = jnp.arange(6.0).reshape(2, 3)
    a, b = written(x, upto=None)
    np.testing.assert_array_equal(a, np.ones((2, 3)))
    np.testing.assert_array_equal(b, np.arange(6.0).reshape(2, 3))
    jaxbind.config.check_unwritten = False
    a, _ = written(x, upto=3)  # unchecked: the unwritten half holds whatever XLA left there
    np.testing.assert_array_equal(np.asarray(a).reshape(-1)[:3], np.ones(3))


def test_one_unwritten_batch_element_is_reported_under_vmap(checking):
    def skips_negative(out, args, kwargs_dump):
        if args[0][0] >= 0:  # the element with a negative first entry is left alone
            out[0][...] = 2 * args[0]

    op = jaxbind.get_linear_call(skips_negative, skips_negative, like_first, like_first)
    xs = jnp.array([[1.0, 2.0], [-1.0, 0.0], [3.0, 4.0]])
    with pytest.raises(RuntimeError, match=r"op 'skips_negative'.*output 0 \(shape \(3, 2\)\).*index \(1, 0\)"):
        jax.block_until_ready(jax.vmap(lambda x: op(x)[0])(xs))
    good = jnp.abs(xs)
    np.testing.assert_array_equal(jax.vmap(lambda x: op(x)[0])(good), 2 * np.abs(np.asarray(xs)))


@pytest.mark.parametrize("kernel", ["jb_empty", "jb_write_half"])
def test_unwritten_output_of_a_native_kernel_is_reported(checking, kernel):
    op = jaxbind.get_linear_call(getattr(LIB, kernel), LIB.jb_empty, like_first, like_first)
    first = 0 if kernel == "jb_empty" else 2
    with pytest.raises(
        RuntimeError, match=rf"op '{kernel}'.*native kernel: output 0 \(shape \(4\)\).*index \({first}\)"
    ):
        jax.block_until_ready(op(jnp.ones(4))[0])
    with pytest.raises(RuntimeError, match=rf"op '{kernel}'.*output 0 \(shape \(3, 4\)\)"):
        jax.block_until_ready(jax.vmap(lambda x: op(x)[0])(jnp.ones((3, 4))))
    scale = jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_scale, like_first, like_first)
    np.testing.assert_array_equal(scale(jnp.ones(4))[0], np.full(4, 2.0))


def test_environment_variable_turns_the_mode_on(tmp_path):
    code = "import jaxbind; print(jaxbind.config.check_unwritten)"
    imported_from = os.path.dirname(os.path.dirname(os.path.abspath(jaxbind.__file__)))
    env = {**os.environ, "PYTHONPATH": imported_from, "JAXBIND_CHECK_UNWRITTEN": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True"
    with pytest.raises(TypeError, match="True or False"):
        jaxbind.config.check_unwritten = "yes"


def test_an_output_updated_in_place_on_an_argument_other_than_the_first(checking):
    # inplace={0: 1}: output 0 is argument 1 updated where it stands. The checking mode must leave
    # that output alone (the elements the update keeps are argument 1's values, not unwritten), and
    # still check the other output.
    def axpy_first_half(out, args, kwargs_dump):  # y[:3] += 2 x[:3] in place; out[1] = 2 x
        ax = 2.0 * args[0]
        out[0][:3] += ax[:3]
        if not jaxbind.load_kwargs(kwargs_dump).get("skip_second"):
            out[1][...] = ax

    op = jaxbind.get_nonlinear_call(
        axpy_first_half,
        None,
        lambda x, y, **kwargs: ((y.shape, y.dtype), (x.shape, x.dtype)),
        None,
        inplace={0: 1},
        name="axpy_half",
    )
    x, y = jnp.arange(6.0), jnp.ones(6)
    want = np.concatenate([1 + 2 * np.arange(3.0), np.ones(3)])
    for run in (op, jax.jit(op)):
        updated, second = run(x, y)
        np.testing.assert_array_equal(updated, want)
        np.testing.assert_array_equal(second, 2 * np.arange(6.0))
    with pytest.raises(RuntimeError, match=r"op 'axpy_half'.*output 1 \(shape \(6\)\) was not fully written"):
        jax.block_until_ready(op(x, y, skip_second=True))
    np.testing.assert_array_equal(y, np.ones(6))  # the caller's argument is its own

"""``name=``: an op's name in its errors, its jaxprs and its compiled programs.

By default an op is named after its forward callback (``f.__name__``); callbacks
made by a factory all share one ``__name__``, so ``name=`` tells their ops
apart. The name is part of the op's identity: ops that differ only in name are
different ops, so each error and each program carries its own op's name.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind


def scaled_by(factor):
    """A factory: every callback it makes is called ``scale``."""

    def scale(out, args, kwargs_dump):
        np.multiply(args[0], factor, out=out[0])

    return scale


def like_last(*args, **kwargs):
    return ((args[-1].shape, args[-1].dtype),)


def matrix_abstract(x):
    if x.ndim != 2:
        raise ValueError(f"expected a matrix, got shape {x.shape}")
    return ((x.shape, x.dtype),)


def fail(out, args, kwargs_dump):
    raise ArithmeticError("no convergence")


def sin_jvp(out, args, kwargs_dump):
    x, x_dot = args
    out[0][...] = np.cos(x) * x_dot


def sin_vjp(out, args, kwargs_dump):
    x, y_ct = args
    out[0][...] = np.cos(x) * y_ct


def sine(out, args, kwargs_dump):
    out[0][...] = np.sin(args[0])


def linear_op(factor, name=None):
    scale = scaled_by(factor)
    return jaxbind.get_linear_call(scale, scale, like_last, like_last, name=name)


def test_default_name_is_the_callback_name():
    assert linear_op(2.0).name == "scale"
    assert jaxbind.get_nonlinear_call(sine, (sin_jvp, sin_vjp), like_last, like_last).name == "sine"


def test_named_ops_compute_under_every_transformation():
    double, triple = linear_op(2.0, name="double"), linear_op(3.0, name="triple")
    x = np.arange(1.0, 5.0)
    np.testing.assert_allclose(jax.jit(lambda v: double(v)[0])(x), 2 * x)
    np.testing.assert_allclose(jax.jit(lambda v: triple(v)[0])(x), 3 * x)
    np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(triple(v)[0] ** 2))(x), 18 * x)
    np.testing.assert_allclose(jax.vmap(lambda v: double(v)[0], in_axes=1)(np.outer(x, x)), 2 * np.outer(x, x).T)
    op = jaxbind.get_nonlinear_call(sine, (sin_jvp, sin_vjp), like_last, like_last, name="my_sine")
    np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(op(v)[0]))(x), jnp.cos(x))


def test_name_in_jaxprs():
    op = linear_op(2.0, name="double")
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda v: jnp.sum(op(v)[0])))(np.ones(3)))
    assert "role='double'" in jaxpr  # the forward call
    assert "'double' (transpose callback 'scale')" in jaxpr  # its transpose


def test_name_in_lowered_and_compiled_programs():
    op = linear_op(2.0, name="double")
    f = jax.jit(lambda v: op(v)[0])
    lowered = f.lower(np.ones(3))
    assert 'mhlo.frontend_attributes = {jaxbind_op = "double"}' in lowered.as_text()
    compiled = lowered.compile().as_text()
    assert 'frontend_attributes={jaxbind_op="double"}' in compiled
    # What profilers show (jax < 0.6 puts "jit(main)/" after the function's name).
    assert re.search(r'op_name="jit\(<lambda>\)/(jit\(main\)/)?double/jaxbind"', compiled)
    # Derived calls (the transpose, under vmap) carry the op's name too.
    grads = jax.jit(jax.vmap(jax.grad(lambda v: jnp.sum(op(v)[0])))).lower(np.ones((2, 3)))
    assert 'jaxbind_op = "double"' in grads.as_text()
    assert "transpose(jvp(double))" in grads.compile().as_text()


def test_name_in_a_callback_error():
    op = jaxbind.get_nonlinear_call(fail, (sin_jvp, sin_vjp), like_last, like_last, name="newton_solve")
    with pytest.raises(
        RuntimeError,
        match=r"jaxbind op 'newton_solve': the callback raised ArithmeticError: "
        r"no convergence",
    ):
        jax.block_until_ready(jax.jit(lambda v: op(v)[0])(np.ones(3)))


def test_name_in_trace_time_errors():
    op = linear_op(2.0, name="double")
    with pytest.raises(TypeError, match=r"jaxbind op 'double': argument 0 is a str"):
        op("x")
    matrices_only = jaxbind.get_linear_call(
        scaled_by(2.0), scaled_by(2.0), matrix_abstract, matrix_abstract, name="matrix_double"
    )
    with pytest.raises(
        jaxbind.JaxbindError,
        match=r"jaxbind op 'matrix_double': its abstract function raised "
        r"ValueError: expected a matrix",
    ):
        matrices_only(np.ones(3))
    nonlinear = jaxbind.get_nonlinear_call(sine, (sin_jvp, sin_vjp), like_last, like_last, name="my_sine")
    with pytest.raises(ValueError, match=r"jaxbind op 'my_sine': second-order derivatives"):
        jax.grad(jax.grad(lambda v: jnp.sum(nonlinear(v)[0])))(1.0)


def test_name_in_definition_errors():
    with pytest.raises(TypeError, match=r"jaxbind op 'double': abstract must be callable"):
        jaxbind.get_linear_call(scaled_by(2.0), scaled_by(2.0), None, like_last, name="double")
    with pytest.raises(TypeError, match=r"jaxbind op 'my_sine': f_derivative must be a pair"):
        jaxbind.get_nonlinear_call(sine, sin_jvp, like_last, like_last, name="my_sine")


def test_ops_with_different_names_are_different_ops():
    # Same callback, same flags: equal ops share compiled code; a different
    # name makes a different op, so that its errors and programs carry its name.
    scale = scaled_by(2.0)
    a = jaxbind.get_linear_call(scale, scale, like_last, like_last, name="a")
    a_again = jaxbind.get_linear_call(scale, scale, like_last, like_last, name="a")
    b = jaxbind.get_linear_call(scale, scale, like_last, like_last, name="b")
    unnamed = jaxbind.get_linear_call(scale, scale, like_last, like_last)
    named_scale = jaxbind.get_linear_call(scale, scale, like_last, like_last, name="scale")
    assert a == a_again and hash(a) == hash(a_again)
    assert a != b and a != unnamed
    assert unnamed == named_scale  # the default name is the callback's name
    x = np.ones(2)
    assert "a/jaxbind" in jax.jit(lambda v: a(v)[0]).lower(x).compile().as_text()
    assert "b/jaxbind" in jax.jit(lambda v: b(v)[0]).lower(x).compile().as_text()


def test_equally_built_ops_with_different_names_report_their_own_name():
    # Compile one, then the other: the second must not reuse the first's call.
    first = jaxbind.get_nonlinear_call(fail, (sin_jvp, sin_vjp), like_last, like_last, name="first_solver")
    second = jaxbind.get_nonlinear_call(fail, (sin_jvp, sin_vjp), like_last, like_last, name="second_solver")
    x = np.ones(3)
    for op in (first, second, first):
        with pytest.raises(RuntimeError, match=rf"jaxbind op '{op.name}': the callback raised"):
            jax.block_until_ready(op(x)[0])
        with pytest.raises(RuntimeError, match=rf"jaxbind op '{op.name}': the callback raised"):
            jax.block_until_ready(jax.jit(lambda v, op=op: op(v)[0])(x))


def test_native_kernel_op_takes_a_name(kernels):
    lib = kernels
    op = jaxbind.get_linear_call(lib.jb_scale, lib.jb_scale, like_last, like_last, name="native_scale")
    x = np.arange(3.0)
    np.testing.assert_allclose(jax.jit(lambda v: op(v, factor=4.0)[0])(x), 4 * x)
    assert 'jaxbind_op = "native_scale"' in jax.jit(lambda v: op(v, factor=4.0)[0]).lower(x).as_text()


@pytest.mark.parametrize(
    "name, error", [("", ValueError), ("   ", ValueError), (3, TypeError), (b"bytes", TypeError), (["a"], TypeError)]
)
def test_bad_name(name, error):
    scale = scaled_by(2.0)
    with pytest.raises(error, match=r"jaxbind op 'scale': name must be a non-empty string"):
        jaxbind.get_linear_call(scale, scale, like_last, like_last, name=name)
    with pytest.raises(error, match=r"jaxbind op 'sine': name must be a non-empty string"):
        jaxbind.get_nonlinear_call(sine, (sin_jvp, sin_vjp), like_last, like_last, name=name)

"""``jaxbind.testing.check_op``: it passes correct ops and catches each common mistake.

Each mistake below is a plausible bug in a user's op; check_op must raise an
AssertionError naming the op, the check and the argument, with the measured
error. The correct ops are checked on their own and their summaries read.
"""

import _kernels
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind
from jaxbind.testing import check_op

LIB = _kernels.load()
RNG = np.random.default_rng(7)
A = RNG.standard_normal((4, 3))
SQUARE = RNG.standard_normal((3, 3))  # not symmetric
X = RNG.standard_normal(3)


def like_last(*args, **kwargs):
    return ((args[-1].shape, args[-1].dtype),)


# ---------------------------------------------------------------------------
# Correct ops
# ---------------------------------------------------------------------------


def matvec(out, args, kwargs_dump):
    out[0][...] = args[0] @ args[1]


def matvec_T(out, args, kwargs_dump):
    out[0][...] = args[0].T @ args[1]


def matvec_abstract(A, x):
    return (((A.shape[0],), jnp.result_type(A.dtype, x.dtype)),)


def matvec_T_abstract(A, y):
    return (((A.shape[1],), jnp.result_type(A.dtype, y.dtype)),)


matvec_op = jaxbind.get_linear_call(matvec, matvec_T, matvec_abstract, matvec_T_abstract, first_n_args_fixed=1)


def test_linear_op_with_a_fixed_argument_passes_and_says_what_it_checked():
    summary = check_op(matvec_op, A, X)
    checks = [(c["check"], c["argument"]) for c in summary.checks]
    assert summary.op == "matvec" and summary.kind == "linear"
    assert ("dot product: <f x, y> == <x, f_T y>", "argument 1 (real data)") in checks
    assert {c for c, _ in checks} >= {
        "outputs: abstract, fully written",
        "eager against jit",
        "vmap against a Python loop",
        "vmap of the vjp against a loop",
    }
    assert [a for c, a in checks if c == "vmap against a Python loop"] == [
        "in_axes 0 (0, 0)",
        "in_axes 1 (1, 1)",
        "in_axes None-mixed (None, 0)",
        "in_axes None-mixed (0, None)",
    ]
    assert all(c["error"] <= c["tolerance"] for c in summary.checks)
    assert "checks passed" in str(summary)


def test_complex_linear_op_is_checked_with_real_and_complex_data():
    summary = check_op(matvec_op, A.astype(np.complex64), X.astype(np.complex64))
    arguments = [c["argument"] for c in summary.checks if c["check"].startswith("dot product")]
    assert arguments == ["argument 1 (real data)", "argument 1 (complex data)"]
    # Tolerances scale with the dtype: single precision's are looser than double's.
    single = max(c["tolerance"] for c in summary.checks)
    double = max(c["tolerance"] for c in check_op(matvec_op, A, X).checks)
    assert single > 1e6 * double


def product(out, args, kwargs_dump):
    np.multiply(args[0], args[1], out=out[0])


def test_multilinear_op_passes_in_every_argument():
    op = jaxbind.get_linear_call(product, (product, product), like_last, (like_last, like_last))
    summary = check_op(op, X, 2 * X)
    assert [c["argument"] for c in summary.checks if c["check"].startswith("dot product")] == [
        "argument 0 (real data)",
        "argument 1 (real data)",
    ]


def wsin(out, args, kwargs_dump):  # y = w sin(x), w fixed
    out[0][...] = args[0] * np.sin(args[1])


def wsin_jvp(out, args, kwargs_dump):
    w, x, dx = args
    out[0][...] = w * np.cos(x) * dx


wsin_vjp = wsin_jvp  # diagonal: the same product


def test_nonlinear_op_with_a_fixed_argument_passes():
    op = jaxbind.get_nonlinear_call(wsin, (wsin_jvp, wsin_vjp), like_last, like_last, first_n_args_fixed=1)
    summary = check_op(op, X, 2 * X)
    checks = [(c["check"], c["argument"]) for c in summary.checks]
    assert ("jvp against central differences", "argument 1") in checks
    assert ("vjp against jvp: <vjp(c),t> == <c,jvp(t)>", "argument 1") in checks
    assert not any(a == "argument 0" for _, a in checks)  # the fixed argument is not differentiated


def test_nonlinear_op_with_kwargs_and_two_outputs():
    def f(out, args, kwargs_dump):
        p = jaxbind.load_kwargs(kwargs_dump)["power"]
        out[0][...] = args[0] ** p
        out[1][...] = np.sum(args[0])

    def f_jvp(out, args, kwargs_dump):
        p = jaxbind.load_kwargs(kwargs_dump)["power"]
        x, dx = args
        out[0][...] = p * x ** (p - 1) * dx
        out[1][...] = np.sum(dx)

    def f_vjp(out, args, kwargs_dump):
        p = jaxbind.load_kwargs(kwargs_dump)["power"]
        x, c0, c1 = args
        out[0][...] = p * x ** (p - 1) * c0 + c1

    def abstract(x, *rest, power):
        return ((x.shape, x.dtype), ((), x.dtype))

    def abstract_reverse(x, c0, c1, power):
        return ((x.shape, x.dtype),)

    op = jaxbind.get_nonlinear_call(f, (f_jvp, f_vjp), abstract, abstract_reverse)
    check_op(op, np.abs(X) + 1, power=3)
    check_op(op, (np.abs(X) + 1).astype(np.float32), power=2)


def test_op_without_derivatives_is_checked_without_them():
    op = jaxbind.get_nonlinear_call(wsin, None, like_last, None)
    summary = check_op(op, X, 2 * X)
    assert not any("jvp" in c["check"] for c in summary.checks)
    assert summary.skipped == ["derivatives (the op was made without them)"]


def test_native_kernels_pass():
    scale = jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_scale, like_last, like_last)
    check_op(scale, X, factor=3.0)
    check_op(scale, X.astype(np.complex128), factor=3.0)
    xsin = jaxbind.get_nonlinear_call(
        LIB.jb_xsin, (LIB.jb_xsin_derivative, LIB.jb_xsin_derivative), like_last, like_last
    )
    summary = check_op(xsin, X)
    assert any(c["check"] == "jvp against central differences" for c in summary.checks)


def batched_reverse(out, args, kwargs_dump):
    """func_can_batch: y = x reversed along its core axis, wherever the batch axes are."""
    axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"]
    x = args[0]
    core = [a for a in range(x.ndim) if not axes or a not in axes[0]]
    out[0][...] = np.flip(x, axis=core)


def batched_abstract(x, *, batch_axes=None):
    return ((x.shape, x.dtype, batch_axes[0][-1] if batch_axes else None),)


def test_func_can_batch_op_passes():
    op = jaxbind.get_linear_call(
        batched_reverse, batched_reverse, batched_abstract, batched_abstract, func_can_batch=True
    )
    check_op(op, X)
    check_op(op, RNG.standard_normal((3, 3)))


def test_whole_batch_vmap_methods_pass():
    for method in ("expand_dims", "broadcast_all"):
        op = jaxbind.get_nonlinear_call(
            wsin, (wsin_jvp, wsin_vjp), like_last, like_last, first_n_args_fixed=1, vmap_method=method
        )
        check_op(op, X, 2 * X)


def test_check_op_restores_the_checking_mode():
    for previous in (False, True):
        jaxbind.config.check_unwritten = previous
        check_op(matvec_op, A, X)
        assert jaxbind.config.check_unwritten is previous
    jaxbind.config.check_unwritten = False


# ---------------------------------------------------------------------------
# Mistakes it catches
# ---------------------------------------------------------------------------


def test_catches_a_transpose_that_is_the_forward_map():
    op = jaxbind.get_linear_call(
        matvec, matvec, matvec_abstract, matvec_T_abstract, first_n_args_fixed=1, name="forward_as_transpose"
    )
    check_op(
        jaxbind.get_linear_call(matvec, matvec, matvec_abstract, matvec_T_abstract, first_n_args_fixed=1),
        SQUARE + SQUARE.T,
        X,
    )  # right for a symmetric matrix
    with pytest.raises(
        AssertionError,
        match=r"check_op: jaxbind op 'forward_as_transpose': dot product: "
        r"<f x, y> == <x, f_T y> failed for argument 1 \(real data\): "
        r".*Measured error [0-9.e+-]+, tolerance",
    ):
        check_op(op, SQUARE, X)


def test_catches_a_conjugated_transpose():
    def matvec_adjoint(out, args, kwargs_dump):  # the adjoint, not JAX's transpose
        out[0][...] = args[0].conj().T @ args[1]

    op = jaxbind.get_linear_call(
        matvec, matvec_adjoint, matvec_abstract, matvec_T_abstract, first_n_args_fixed=1, name="adjoint"
    )
    Z = A + 1j * RNG.standard_normal(A.shape)
    with pytest.raises(AssertionError, match=r"'adjoint': dot product.*argument 1 \(complex data\)"):
        check_op(op, Z, X.astype(complex))


def test_catches_a_jvp_off_by_a_factor():
    def wsin_jvp_twice(out, args, kwargs_dump):
        w, x, dx = args
        out[0][...] = 2 * w * np.cos(x) * dx

    op = jaxbind.get_nonlinear_call(
        wsin, (wsin_jvp_twice, wsin_vjp), like_last, like_last, first_n_args_fixed=1, name="jvp_twice"
    )
    with pytest.raises(
        AssertionError,
        match=r"'jvp_twice': jvp against central differences failed for "
        r"argument 1: .*Measured error 0\.5",
    ):
        check_op(op, X, 2 * X)


def test_catches_a_vjp_that_disagrees_with_the_jvp():
    def wsin_vjp_wrong(out, args, kwargs_dump):
        w, x, ct = args
        out[0][...] = w * np.sin(x) * ct

    op = jaxbind.get_nonlinear_call(
        wsin, (wsin_jvp, wsin_vjp_wrong), like_last, like_last, first_n_args_fixed=1, name="bad_vjp"
    )
    with pytest.raises(AssertionError, match=r"'bad_vjp': vjp against jvp.*failed for argument 1"):
        check_op(op, X, 2 * X)


def test_catches_an_abstract_with_the_wrong_shape():
    def too_long(A, x):
        return (((A.shape[0] + 1,), x.dtype),)

    op = jaxbind.get_linear_call(matvec, matvec_T, too_long, matvec_T_abstract, first_n_args_fixed=1, name="long")
    with pytest.raises(
        AssertionError,
        match=r"'long': outputs: abstract, fully written failed for the given "
        r"arguments: running it raised .*could not broadcast",
    ):
        check_op(op, A, X)

    def like_input(A, x):  # the output's shape taken from the wrong argument
        return ((x.shape, x.dtype),)

    op = jaxbind.get_linear_call(matvec, matvec_T, like_input, matvec_T_abstract, first_n_args_fixed=1, name="short")
    with pytest.raises(AssertionError, match=r"'short': outputs: abstract, fully written failed"):
        check_op(op, A, X)


def test_catches_an_output_left_unwritten():
    def writes_all_but_last(out, args, kwargs_dump):
        out[0][:-1] = (args[0] @ args[1])[:-1]

    op = jaxbind.get_linear_call(
        writes_all_but_last, matvec_T, matvec_abstract, matvec_T_abstract, first_n_args_fixed=1, name="unwritten"
    )
    jaxbind.config.check_unwritten = False
    with pytest.raises(
        AssertionError,
        match=r"'unwritten': outputs: abstract, fully written failed for the "
        r"given arguments: .*output 0 \(shape \(4\)\) was not fully written",
    ):
        check_op(op, A, X)
    assert jaxbind.config.check_unwritten is False


def test_catches_an_unwritten_transpose_output():
    def transpose_half(out, args, kwargs_dump):
        out[0][:1] = (args[0].T @ args[1])[:1]

    op = jaxbind.get_linear_call(
        matvec, transpose_half, matvec_abstract, matvec_T_abstract, first_n_args_fixed=1, name="half_T"
    )
    with pytest.raises(AssertionError, match=r"'half_T': dot product.*not fully written"):
        check_op(op, A, X)


def test_catches_func_can_batch_axes_the_callback_ignores():
    def reverse_last_axis(out, args, kwargs_dump):  # assumes the batch axes lead
        out[0][...] = args[0][..., ::-1]

    op = jaxbind.get_linear_call(
        reverse_last_axis,
        reverse_last_axis,
        batched_abstract,
        batched_abstract,
        func_can_batch=True,
        name="ignores_axes",
    )
    with pytest.raises(
        AssertionError,
        match=r"'ignores_axes': vmap against a Python loop failed for "
        r"in_axes 1 \(1,\): .*Measured error",
    ):
        check_op(op, X)


def test_catches_a_wrong_output_batch_axis():
    def abstract_axis_zero(x, *, batch_axes=None):  # claims the batch goes first; the callback keeps it in place
        return ((x.shape, x.dtype, 0 if batch_axes else None),)

    op = jaxbind.get_linear_call(
        batched_reverse, batched_reverse, abstract_axis_zero, abstract_axis_zero, func_can_batch=True, name="axis_zero"
    )
    with pytest.raises(AssertionError, match=r"'axis_zero': vmap .*in_axes 1"):
        check_op(op, RNG.standard_normal((3, 3)))


def test_refuses_what_is_not_an_op():
    with pytest.raises(TypeError, match="check_op takes a jaxbind op"):
        check_op(np.sin, X)


def test_catches_a_jvp_abstract_with_another_dtype():
    def sine(out, args, kwargs_dump):
        out[0][...] = np.sin(args[0])

    def sine_derivative(out, args, kwargs_dump):
        out[0][...] = np.cos(args[0]) * args[1]

    def abstract(x, *tangents):  # the mistake: the tangent declared in single precision
        return ((x.shape, np.float32 if tangents else x.dtype),)

    op = jaxbind.get_nonlinear_call(sine, (sine_derivative, sine_derivative), abstract, like_last, name="sine")
    with pytest.raises(
        AssertionError,
        match=r"'sine': jvp against central differences failed for argument 0: "
        r"the tangent of output 0 has shape \(3,\) and dtype float32",
    ):
        check_op(op, X)


def test_a_failing_pairing_prints_numbers_that_differ():
    from jaxbind.testing._checker import distinct_digits

    assert distinct_digits(0.943, 0.943) == ("0.943", "0.943")
    a, b = distinct_digits(0.94312345678, 0.94312349999)
    assert a != b and float(a) != float(b)  # at 6 digits both were 0.943123
    assert distinct_digits(3.36307, 7.27353) == ("3.36307", "7.27353")

"""``check_op``'s tolerances: a rounding model that catches 100 % errors at any precision and passes correct ops.

Tolerances follow from the dtypes' epsilons, the sizes and the magnitudes of
the values involved; norms are scaled (no overflow, no underflow); finite
differences take a step per element; a check the precision makes meaningless
is reported as skipped, never as passed.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import jaxbind
from jaxbind.testing import check_op

RNG = np.random.default_rng(11)
X = RNG.standard_normal(5)
FD = "jvp against central differences"
DOT = "dot product: <f x, y> == <x, f_T y>"
VJP = "vjp against jvp: <vjp(c),t> == <c,jvp(t)>"


def like_last(*args, **kwargs):
    return ((args[-1].shape, args[-1].dtype),)


def twice(out, args, kwargs_dump):
    out[0][...] = 2 * args[-1]


def zero(out, args, kwargs_dump):
    out[0][...] = 0


def sine(out, args, kwargs_dump):
    out[0][...] = np.sin(args[0])


def sine_derivative(out, args, kwargs_dump):  # jvp (x, dx) and vjp (x, ct) alike
    out[0][...] = np.cos(args[0]) * args[1]


def _checked(summary, check):
    return [c for c in summary.checks if c["check"] == check]


@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
def test_half_precisions_catch_zero_derivatives(dtype):
    x = jnp.asarray(X).astype(dtype)
    linear = jaxbind.get_linear_call(twice, twice, like_last, like_last, name="twice")
    np.testing.assert_allclose(np.asarray(linear(x)[0], np.float64), 2 * np.asarray(x, np.float64))
    summary = check_op(linear, x)
    assert all(c["tolerance"] < 0.5 for c in summary.checks)  # each would catch a 100 % error
    nonlinear = jaxbind.get_nonlinear_call(sine, (sine_derivative, sine_derivative), like_last, like_last, name="s")
    summary = check_op(nonlinear, x)
    assert _checked(summary, VJP)
    if dtype == np.float16:
        assert _checked(summary, FD) and not summary.skipped
    else:  # 8 bits: no step makes finite differences meaningful; said so, not passed
        assert not _checked(summary, FD)
        assert len(summary.skipped) == 1 and summary.skipped[0].startswith(
            f"{FD} for argument 0: bfloat16 outputs of bfloat16 arguments are too coarse for finite differences"
        )
        assert "would let a 100 % error pass" in summary.skipped[0] and "skipped" in str(summary)

    with pytest.raises(AssertionError, match=r"'zero_T': dot product.*Measured error 1,"):
        check_op(jaxbind.get_linear_call(twice, zero, like_last, like_last, name="zero_T"), x)
    with pytest.raises(
        AssertionError,
        match=r"'zero_jvp': (jvp against central differences|vjp against jvp).*"
        r"Measured error 1,",
    ):
        check_op(jaxbind.get_nonlinear_call(sine, (zero, sine_derivative), like_last, like_last, name="zero_jvp"), x)
    with pytest.raises(AssertionError, match=r"'zero_vjp': vjp against jvp.*Measured error 1,"):
        check_op(jaxbind.get_nonlinear_call(sine, (sine_derivative, zero), like_last, like_last, name="zero_vjp"), x)


def _with_a_bfloat16_sum(out, args, kwargs_dump):
    out[0][...] = 2 * args[0]
    out[1][...] = np.sum(args[0])


def _with_a_bfloat16_sum_T(out, args, kwargs_dump):
    out[0][...] = 2 * args[0] + args[1].astype(np.float64)


def test_a_low_precision_output_does_not_loosen_the_others():
    abstract = lambda x: ((x.shape, x.dtype), ((1,), jnp.bfloat16))
    abstract_T = lambda y, s: ((y.shape, y.dtype),)
    good = jaxbind.get_linear_call(_with_a_bfloat16_sum, _with_a_bfloat16_sum_T, abstract, abstract_T, name="sum16")
    check_op(good, X)
    # The float64 output is checked at float64's precision: a 1-element bfloat16 output was enough to admit
    # a zero transpose (all tolerances came from the least precise dtype).
    with pytest.raises(AssertionError, match=r"'sum16_zero_T': dot product.*with a cotangent on output 0 alone"):
        check_op(jaxbind.get_linear_call(_with_a_bfloat16_sum, zero, abstract, abstract_T, name="sum16_zero_T"), X)

    def one_percent_off(out, args, kwargs_dump):
        out[0][...] = 2.02 * args[0] + args[1].astype(np.float64)

    with pytest.raises(AssertionError, match=r"'sum16_off': dot product.*on output 0 alone.*Measured error 0\.0099"):
        check_op(
            jaxbind.get_linear_call(_with_a_bfloat16_sum, one_percent_off, abstract, abstract_T, name="sum16_off"), X
        )


def test_norms_neither_overflow_nor_underflow():
    def scale(factor):
        def f(out, args, kwargs_dump):
            out[0][...] = factor * args[0]

        return f

    big = jaxbind.get_linear_call(scale(1e200), scale(1e200), like_last, like_last, name="big")
    np.testing.assert_allclose(big(X)[0], 1e200 * X)
    check_op(big, X)
    with pytest.raises(AssertionError, match=r"'big_T_twice': dot product.*Measured error 0\.5,"):
        check_op(jaxbind.get_linear_call(scale(1e200), scale(2e200), like_last, like_last, name="big_T_twice"), X)
    tiny = jaxbind.get_linear_call(scale(1e-160), scale(1e-160), like_last, like_last, name="tiny")
    z = X + 1j * RNG.standard_normal(5)
    summary = check_op(tiny, z)  # used to fail: "error 1.58e+124"
    assert max(c["error"] for c in _checked(summary, DOT)) < 1e-14
    with pytest.raises(AssertionError, match=r"'tiny_T_twice': dot product"):
        check_op(jaxbind.get_linear_call(scale(1e-160), scale(2e-160), like_last, like_last, name="tiny_T_twice"), z)


def _offset_sine(out, args, kwargs_dump):
    out[0][...] = 1e4 + np.sin(args[0])


def test_a_large_offset_passes_and_a_wrong_jvp_is_still_caught():
    x = np.array([0.7, 1.3, -2.1, 2.6])
    op = jaxbind.get_nonlinear_call(
        _offset_sine, (sine_derivative, sine_derivative), like_last, like_last, name="offset"
    )
    np.testing.assert_allclose(op(x)[0], 1e4 + np.sin(x), rtol=1e-15)
    summary = check_op(op, x)  # used to fail: error 1.24e-9, tolerance 3e-10
    (fd,) = _checked(summary, FD)
    assert fd["error"] <= fd["tolerance"] < 1e-3
    summary = check_op(op, x.astype(np.float32))  # float32: a step large enough for |f| = 1e4
    (fd,) = _checked(summary, FD)
    assert fd["error"] <= fd["tolerance"] < 0.5

    def one_percent_off(out, args, kwargs_dump):
        out[0][...] = 1.01 * np.cos(args[0]) * args[1]

    wrong = jaxbind.get_nonlinear_call(
        _offset_sine, (one_percent_off, one_percent_off), like_last, like_last, name="offset_wrong"
    )
    with pytest.raises(
        AssertionError, match=r"'offset_wrong': jvp against central differences.*Measured error 0\.0099"
    ):
        check_op(wrong, x)


@pytest.mark.parametrize(
    "fn, derivative, wrong",
    [(np.log, lambda x: 1 / x, lambda x: 1 / (2 * x)), (np.sqrt, lambda x: 0.5 / np.sqrt(x), lambda x: 1 / np.sqrt(x))],
    ids=["log", "sqrt"],
)
def test_finite_difference_steps_stay_in_each_elements_domain(fn, derivative, wrong):
    x = np.array([1e-2, 1.0, 1e2])  # one step of the rms for all left the domain: error NaN

    def make(d, name):
        def f(out, args, kwargs_dump):
            out[0][...] = fn(args[0])

        def f_derivative(out, args, kwargs_dump):
            out[0][...] = d(args[0]) * args[1]

        return jaxbind.get_nonlinear_call(f, (f_derivative, f_derivative), like_last, like_last, name=name)

    summary = check_op(make(derivative, fn.__name__), x)
    (fd,) = _checked(summary, FD)
    assert fd["error"] <= fd["tolerance"] < 1e-6
    with pytest.raises(AssertionError, match=rf"'{fn.__name__}_wrong': jvp against central differences"):
        check_op(make(wrong, fn.__name__ + "_wrong"), x)


KNOTS = np.round(np.arange(9.0, 11.0001, 0.1), 10)
VALUES = np.sin(3 * KNOTS)


def _interpolate(out, args, kwargs_dump):
    out[0][...] = np.interp(args[0], KNOTS, VALUES)


def _slopes(x, shift=0):
    k = np.clip(np.searchsorted(KNOTS, x, side="right") - 1 + shift, 0, len(KNOTS) - 2)
    return (VALUES[k + 1] - VALUES[k]) / (KNOTS[k + 1] - KNOTS[k])


def test_a_kink_within_the_first_step_does_not_fail_a_correct_interpolant():
    def derivative(out, args, kwargs_dump):
        out[0][...] = _slopes(args[0]) * args[1]

    def neighbours_slope(out, args, kwargs_dump):
        out[0][...] = _slopes(args[0], shift=-1) * args[1]

    x = np.array([10.505, 9.895, 10.205])  # 0.005 from a knot: the first steps cross it
    op = jaxbind.get_nonlinear_call(_interpolate, (derivative, derivative), like_last, like_last, name="interp")
    np.testing.assert_allclose(jax.jacfwd(lambda x: op(x)[0])(x), np.diag(_slopes(x)), rtol=1e-12)
    (fd,) = _checked(check_op(op, x), FD)
    assert fd["error"] <= fd["tolerance"]
    wrong = jaxbind.get_nonlinear_call(
        _interpolate, (neighbours_slope, neighbours_slope), like_last, like_last, name="interp_wrong"
    )
    with pytest.raises(AssertionError, match=r"'interp_wrong': jvp against central differences.*every step tried"):
        check_op(wrong, x)


def _square_with_solver_error(out, args, kwargs_dump):
    # x**2 computed to ~1e-9, as an iterative solver would: exact derivative 2 x.
    out[0][...] = args[0] ** 2 + 1e-9 * np.sin(1e4 * args[0])


def _double_times(out, args, kwargs_dump):  # jvp (x, t) and vjp (x, ct) alike
    out[0][...] = 2 * args[0] * args[1]


def test_fd_rtol_admits_an_op_computed_to_its_own_accuracy():
    op = jaxbind.get_nonlinear_call(
        _square_with_solver_error, (_double_times, _double_times), like_last, like_last, name="inexact_square"
    )
    x = jnp.asarray([0.3, 1.1, -0.7])
    with pytest.raises(
        AssertionError,
        match=r"'inexact_square': jvp against central differences failed for "
        r"argument 0: .*no fd_rtol.*pass fd_rtol= its relative accuracy",
    ):
        check_op(op, x)
    summary = check_op(op, x, fd_rtol=1e-3)
    (fd,) = _checked(summary, FD)
    assert 0.99e-3 <= fd["tolerance"] < 1.01e-3 and fd["error"] <= fd["tolerance"]

    def four_times(out, args, kwargs_dump):  # wrong by more than fd_rtol: still caught
        out[0][...] = 4 * args[0] * args[1]

    op = jaxbind.get_nonlinear_call(
        _square_with_solver_error, (four_times, _double_times), like_last, like_last, name="inexact_square_wrong"
    )
    with pytest.raises(AssertionError, match=r"'inexact_square_wrong': jvp against.*fd_rtol=0\.001"):
        check_op(op, x, fd_rtol=1e-3)


A = RNG.standard_normal((4, 5))


def _to_single(out, args, kwargs_dump):  # float64 in, float32 out: accurate to float32 only
    out[0][...] = (A @ args[0]).astype(np.float32)


def _from_single(out, args, kwargs_dump):
    out[0][...] = A.T @ args[0].astype(np.float64)


def _from_single_off(out, args, kwargs_dump):
    out[0][...] = (1 + 1e-4) * (A.T @ args[0].astype(np.float64))


def test_mixed_float64_float32_op_is_held_to_float32():
    abstract = lambda x: (((4,), np.float32),)
    abstract_T = lambda y: (((5,), np.float64),)
    good = jaxbind.get_linear_call(_to_single, _from_single, abstract, abstract_T, name="single")
    np.testing.assert_allclose(good(X)[0], A @ X, rtol=1e-6)
    eps32, eps64 = float(np.finfo(np.float32).eps), float(np.finfo(np.float64).eps)
    dots = _checked(check_op(good, X), DOT)
    # the float32 rounding shows (a float64 tolerance would reject the op) and is admitted
    assert max(c["error"] for c in dots) > 1e3 * eps64
    assert all(eps32 < c["tolerance"] < 1e3 * eps32 for c in dots)
    off = jaxbind.get_linear_call(_to_single, _from_single_off, abstract, abstract_T, name="single_off")
    with pytest.raises(AssertionError, match=r"'single_off': dot product.*Measured error 0\.0001"):
        check_op(off, X)


def test_correct_ops_the_audit_passed_still_pass():
    # a solve with condition number 1e10, its transpose from the same factorization
    Q, _ = np.linalg.qr(RNG.standard_normal((6, 6)))
    M = Q @ np.diag(np.logspace(0, -10, 6)) @ Q.T + 1e-3 * np.triu(RNG.standard_normal((6, 6)), 1) * 1e-8

    def solve(out, args, kwargs_dump):
        out[0][...] = scipy.linalg.lu_solve(scipy.linalg.lu_factor(args[0]), args[1])

    def solve_T(out, args, kwargs_dump):
        out[0][...] = scipy.linalg.lu_solve(scipy.linalg.lu_factor(args[0]), args[1], trans=1)

    op = jaxbind.get_linear_call(solve, solve_T, like_last, like_last, first_n_args_fixed=1, name="solve")
    b = RNG.standard_normal(6)
    assert 1e9 < np.linalg.cond(M) < 1e11
    np.testing.assert_allclose(M @ op(M, b)[0], b, atol=1e-5)
    check_op(op, M, b)

    # fixed integer and bool arguments, zero-size arrays
    def shift(out, args, kwargs_dump):
        n, flip, x = args
        out[0][...] = (-1 if flip else 1) * int(n) * x

    op = jaxbind.get_linear_call(shift, shift, like_last, like_last, first_n_args_fixed=2, name="shift")
    for x in (X, np.zeros((0, 3))):
        summary = check_op(op, np.int32(3), np.bool_(True), x)
        assert _checked(summary, DOT)

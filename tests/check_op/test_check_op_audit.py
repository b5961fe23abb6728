"""``jaxbind.testing.check_op`` on the holes an audit of the checker found: each a wrong op it must
catch and a correct op it must pass (complex cotangents of real arguments, joint linearity, nested vmap,
batched jvps, integer outputs, any kwarg name, and behaviours a mutation audit of the checker pinned).
"""

import _kernels
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_check_op import batched_abstract, matvec, wsin, wsin_jvp  # the correct ops of the main checks

import jaxbind
from jaxbind.testing import check_op

LIB = _kernels.load()
RNG = np.random.default_rng(7)
A = RNG.standard_normal((4, 3))
X = RNG.standard_normal(3)


def like_last(*args, **kwargs):
    return ((args[-1].shape, args[-1].dtype),)


def _r2c_abstract(A, x):
    return (((A.shape[0],), np.complex128),)


def _r2c_T_abstract(A, y):
    return (((A.shape[1],), np.float64),)


def _r2c_T(out, args, kwargs_dump):  # JAX's rule: the cotangent of a real x is the real part
    out[0][...] = np.real(args[0].T @ args[1])


def _r2c_T_conjugated(out, args, kwargs_dump):  # the imaginary part's sign is wrong
    out[0][...] = np.real(args[0].T @ np.conj(args[1]))


def test_real_input_complex_output_transpose_is_checked_with_complex_cotangents():
    Z = A + 1j * RNG.standard_normal(A.shape)
    good = jaxbind.get_linear_call(matvec, _r2c_T, _r2c_abstract, _r2c_T_abstract, first_n_args_fixed=1, name="r2c")
    bad = jaxbind.get_linear_call(
        matvec, _r2c_T_conjugated, _r2c_abstract, _r2c_T_abstract, first_n_args_fixed=1, name="r2c_conj"
    )
    # What jax.grad makes of each, against the gradient of sum(Im(Z x)) over a real x, Im(Z)^T 1 (NumPy):
    # the wrong one flips its sign.
    loss = lambda f: lambda x: jnp.sum(jnp.imag(f(x)))
    want = np.imag(Z).sum(axis=0)
    np.testing.assert_allclose(jax.grad(loss(lambda x: good(Z, x)[0]))(X), want, rtol=1e-12)
    np.testing.assert_allclose(jax.grad(loss(lambda x: bad(Z, x)[0]))(X), -want, rtol=1e-12)
    summary = check_op(good, Z, X)  # the argument is real, the output complex: complex cotangents too
    assert [c["argument"] for c in summary.checks if c["check"].startswith("dot product")] == [
        "argument 1 (real data)",
        "argument 1 (complex data)",
    ]
    with pytest.raises(
        AssertionError,
        match=r"'r2c_conj': dot product.*argument 1 \(complex data\).*"
        r"not the transpose of f",
    ):
        check_op(bad, Z, X)


def _plus(out, args, kwargs_dump):  # y = a + b: jointly linear
    out[0][...] = args[0] + args[1]


def _plus_with_cross_term(out, args, kwargs_dump):  # y = a + b + a b: linear in each, not jointly
    out[0][...] = args[0] + args[1] + args[0] * args[1]


def _plus_T(out, args, kwargs_dump):
    out[0][...] = args[0]
    out[1][...] = args[0]


def _two_like_last(y):
    return ((y.shape, y.dtype),) * 2


def test_joint_linearity_catches_a_cross_term():
    good = jaxbind.get_linear_call(_plus, _plus_T, like_last, _two_like_last, name="plus")
    summary = check_op(good, X, 2 * X)
    checks = {(c["check"], c["argument"]) for c in summary.checks}
    assert ("linearity: f(a x + b x') == a f(x) + b f(x')", "arguments 0, 1 jointly") in checks
    assert ("dot product: <f x, y> == <x, f_T y>", "arguments 0, 1 jointly (real data)") in checks
    bad = jaxbind.get_linear_call(_plus_with_cross_term, _plus_T, like_last, _two_like_last, name="cross")
    np.testing.assert_allclose(bad(X, 0 * X)[0], X)  # right with either argument at zero
    with pytest.raises(AssertionError, match=r"'cross': linearity.*arguments 0, 1 jointly.*f is not linear"):
        check_op(bad, X, 2 * X)


def _reverse_innermost_level_only(out, args, kwargs_dump):
    """func_can_batch, the mistake: only the newest batch axis is kept out of the reversal."""
    axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"]
    x = args[0]
    core = [a for a in range(x.ndim) if not axes or a != axes[0][-1]]
    out[0][...] = np.flip(x, axis=core)


def _align_one_level(v, x):  # expand_dims, the mistake: right for no or one vmap level only
    return v[:, None] if v.ndim else v


def _align(v, x):
    return v.reshape(v.shape + (1,) * (x.ndim - v.ndim))


def _scaled_sine_ops(align, name, jvp_align=None):
    """y = v sin(x), v a scalar (fixed), under vmap_method="expand_dims"."""
    jvp_align = jvp_align or align

    def f(out, args, kwargs_dump):
        v, x = args
        out[0][...] = align(v, x) * np.sin(x)

    def f_jvp(out, args, kwargs_dump):
        v, x, dx = args
        out[0][...] = jvp_align(v, x) * np.cos(x) * dx

    def f_vjp(out, args, kwargs_dump):
        v, x, ct = args
        out[0][...] = align(v, x) * np.cos(x) * ct

    return jaxbind.get_nonlinear_call(
        f, (f_jvp, f_vjp), like_last, like_last, first_n_args_fixed=1, vmap_method="expand_dims", name=name
    )


def test_nested_vmap_is_checked():
    # func_can_batch, right for one level, wrong for two
    op = jaxbind.get_linear_call(
        _reverse_innermost_level_only,
        _reverse_innermost_level_only,
        batched_abstract,
        batched_abstract,
        func_can_batch=True,
        name="one_level",
    )
    Y = RNG.standard_normal((2, 3, 3))
    np.testing.assert_allclose(jax.vmap(lambda x: op(x)[0])(Y[0]), Y[0, :, ::-1])
    assert not np.allclose(jax.vmap(jax.vmap(lambda x: op(x)[0]))(Y), Y[:, :, ::-1])
    with pytest.raises(AssertionError, match=r"'one_level': vmap of vmap against a loop failed for outer 0, inner 1"):
        check_op(op, X)
    # expand_dims, right for one level, wrong for two (x of length 3, the inner batch's size: no error, wrong values)
    v = jnp.asarray(1.5)
    bad, good = _scaled_sine_ops(_align_one_level, "aligned_once"), _scaled_sine_ops(_align, "aligned")
    V = jnp.asarray(RNG.uniform(1, 2, (2, 3)))
    Xs = jnp.asarray(RNG.standard_normal((2, 3, 3)))
    want = V[..., None] * jnp.sin(Xs)
    np.testing.assert_allclose(jax.vmap(jax.vmap(lambda v, x: good(v, x)[0]))(V, Xs), want, rtol=1e-12)
    assert not np.allclose(jax.vmap(jax.vmap(lambda v, x: bad(v, x)[0]))(V, Xs), want)
    summary = check_op(good, v, X)
    assert [c["argument"] for c in summary.checks if c["check"] == "vmap of vmap against a loop"] == [
        "outer 0, inner 1 (0, 0) (0, 1)",
        "outer None-mixed, inner 1 (0, None) (0, 1)",
    ]
    with pytest.raises(AssertionError, match=r"'aligned_once': vmap of vmap against a loop failed for outer 0"):
        check_op(bad, v, X)


def _sin_flip(out, args, kwargs_dump):
    """func_can_batch: y = sin(x reversed along its core axis)."""
    axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"]
    x = args[0]
    core = [a for a in range(x.ndim) if not axes or a not in axes[0]]
    out[0][...] = np.sin(np.flip(x, axis=core))


def _front(axes, i, a):  # input i with its batch axes in front, in level order
    return np.moveaxis(a, axes[i], range(len(axes[i]))) if axes else a


def _to_layout_of(axes, i, a):  # a result with the batch in front, put in input i's layout
    return np.moveaxis(a, range(len(axes[i])), axes[i]) if axes else a


def _sin_flip_jvp(out, args, kwargs_dump):
    axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"]
    x, dx = _front(axes, 0, args[0]), _front(axes, 1, args[1])
    out[0][...] = _to_layout_of(axes, 1, np.cos(x[..., ::-1]) * dx[..., ::-1])


def _sin_flip_jvp_ignoring_axes(out, args, kwargs_dump):  # flips the batch axes too
    x, dx = args
    out[0][...] = np.cos(np.flip(x)) * np.flip(dx)


def _sin_flip_vjp(out, args, kwargs_dump):
    axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"]
    x, ct = _front(axes, 0, args[0]), _front(axes, 1, args[1])
    out[0][...] = _to_layout_of(axes, 1, (np.cos(x[..., ::-1]) * ct)[..., ::-1])


def _last_batch_axis_abstract(*args, batch_axes=None):  # the output keeps the last input's layout
    return ((args[-1].shape, args[-1].dtype, batch_axes[-1][-1] if batch_axes else None),)


def test_func_can_batch_jvp_is_run_batched():
    make = lambda jvp, name: jaxbind.get_nonlinear_call(
        _sin_flip,
        (jvp, _sin_flip_vjp),
        _last_batch_axis_abstract,
        _last_batch_axis_abstract,
        func_can_batch=True,
        name=name,
    )
    good, bad = make(_sin_flip_jvp, "sin_flip"), make(_sin_flip_jvp_ignoring_axes, "jvp_ignores_axes")
    want = jax.jacfwd(lambda x: jnp.sin(x[::-1]))(X)
    np.testing.assert_allclose(jax.jacfwd(lambda x: good(x)[0])(X), want, rtol=1e-12)
    assert not np.allclose(jax.jacfwd(lambda x: bad(x)[0])(X), want)  # jacfwd silently off
    summary = check_op(good, X)
    assert [c["argument"] for c in summary.checks if c["check"] == "batched jvp against a loop"] == [
        "vmap of jvp, tangents batched (jacfwd)",
        "vmap of jvp, in_axes (1, 1)",
        "jvp of vmap, in_axes (0,)",
    ]
    with pytest.raises(
        AssertionError,
        match=r"'jvp_ignores_axes': batched jvp against a loop failed for vmap of "
        r"jvp, tangents batched \(jacfwd\)",
    ):
        check_op(bad, X)


def test_expand_dims_rank_mistake_in_f_jvp_is_caught():
    v = jnp.asarray(1.5)
    bad = _scaled_sine_ops(_align, "jvp_unaligned", jvp_align=lambda v, x: v)
    with pytest.raises(
        AssertionError,
        match=r"'jvp_unaligned': batched jvp against a loop failed for vmap of jvp, "
        r"in_axes \(0, 1, 1\)",
    ):
        check_op(bad, v, X)


def _sqrt_counted(out, args, kwargs_dump):  # sqrt(c), an evaluation count and a convergence flag
    out[0][...] = np.sqrt(args[0])
    out[1][...] = 7
    out[2][...] = True


def _sqrt_counted_derivative(out, args, kwargs_dump):  # jvp (c, dc) and vjp (c, ct) alike
    out[0][...] = args[1] / (2 * np.sqrt(args[0]))


def _sqrt_counted_abstract(c, *tangents):
    return ((c.shape, c.dtype), ((), np.int32), (c.shape, np.bool_))


def test_integer_and_bool_outputs_are_not_differentiated():
    op = jaxbind.get_nonlinear_call(
        _sqrt_counted,
        (_sqrt_counted_derivative, _sqrt_counted_derivative),
        _sqrt_counted_abstract,
        like_last,
        name="sqrt_counted",
    )
    c = np.abs(X) + 1
    summary = check_op(op, c)  # used to raise "dtype=float0 is not a valid dtype" inside testing.py
    assert {
        "jvp against central differences",
        "vjp against jvp: <vjp(c),t> == <c,jvp(t)>",
        "batched jvp against a loop",
    } <= {e["check"] for e in summary.checks}

    def wrong(out, args, kwargs_dump):
        out[0][...] = args[1] / np.sqrt(args[0])

    op = jaxbind.get_nonlinear_call(
        _sqrt_counted,
        (wrong, _sqrt_counted_derivative),
        _sqrt_counted_abstract,
        like_last,
        name="sqrt_counted_wrong_jvp",
    )
    with pytest.raises(
        AssertionError,
        match=r"'sqrt_counted_wrong_jvp': jvp against central differences failed "
        r"for argument 0: .*Measured error 0\.5",
    ):
        check_op(op, c)

    def scale_and_count(out, args, kwargs_dump):
        out[0][...] = 3 * args[0]
        out[1][...] = np.count_nonzero(args[0])

    def scale_and_count_T(out, args, kwargs_dump):
        y_ct, count_ct = args
        assert count_ct.dtype == np.int32 and count_ct == 0  # zeros of the output's own dtype
        out[0][...] = 3 * y_ct

    count_abstract = lambda x: ((x.shape, x.dtype), ((), np.int32))
    op = jaxbind.get_linear_call(
        scale_and_count, scale_and_count_T, count_abstract, lambda y, n: ((y.shape, y.dtype),), name="scale_and_count"
    )
    check_op(op, X)  # used to fail: integer outputs were paired with random integer cotangents
    op = jaxbind.get_linear_call(
        scale_and_count, scale_and_count, count_abstract, lambda y, n: ((y.shape, y.dtype),), name="count_as_transpose"
    )
    with pytest.raises(AssertionError, match=r"'count_as_transpose': dot product"):
        check_op(op, X)  # the transpose is given f itself: 3 x_ct + nothing, but writes the count too


def test_any_keyword_argument_name_reaches_the_op():
    def apply(out, args, kwargs_dump):
        kwargs = jaxbind.load_kwargs(kwargs_dump)
        out[0][...] = {"double": 2.0, "same": 1.0}[kwargs["op"]] * kwargs["args"] * args[0]

    op = jaxbind.get_linear_call(apply, apply, like_last, like_last, name="apply")
    np.testing.assert_allclose(op(X, op="double", args=3.0)[0], 6 * X)
    summary = check_op(op, X, op="double", args=3.0)  # used to raise: got multiple values for argument 'op'
    assert summary.op == "apply"
    with pytest.raises(ValueError, match=r"check_op: jaxbind op 'apply': fd_rtol must be a finite non-negative"):
        check_op(op, X, op="same", args=1.0, fd_rtol=-1.0)
    with pytest.raises(TypeError, match=r"check_op: jaxbind op 'apply': argument 0 is a str"):
        check_op(op, "x", op="same", args=1.0)


# -- behaviours the checker's mutation audit found unpinned ---------------------


def _sine_and_square(out, args, kwargs_dump):
    out[0][...] = np.sin(args[0])
    out[1][...] = args[0] ** 2


def _sine_and_square_vjp(out, args, kwargs_dump):
    x, c0, c1 = args
    out[0][...] = np.cos(x) * c0 + 2 * x * c1


def _two_outputs_abstract(x, *tangents):
    return ((x.shape, x.dtype), (x.shape, x.dtype))


def test_a_jvp_wrong_in_its_second_output_only_is_caught():
    def jvp_wrong_in_output_1(out, args, kwargs_dump):
        x, dx = args
        out[0][...] = np.cos(x) * dx
        out[1][...] = 3 * x * dx  # 2 x dx

    op = jaxbind.get_nonlinear_call(
        _sine_and_square,
        (jvp_wrong_in_output_1, _sine_and_square_vjp),
        _two_outputs_abstract,
        like_last,
        name="second_output",
    )
    with pytest.raises(
        AssertionError,
        match=r"'second_output': jvp against central differences failed for "
        r"argument 0, output 1: .*Measured error 0\.3",
    ):
        check_op(op, X)


def test_a_nan_vjp_is_reported_by_the_vjp_check():
    def nan_vjp(out, args, kwargs_dump):
        out[0][...] = np.nan

    op = jaxbind.get_nonlinear_call(
        wsin, (wsin_jvp, nan_vjp), like_last, like_last, first_n_args_fixed=1, name="nan_vjp"
    )
    with pytest.raises(
        AssertionError,
        match=r"'nan_vjp': vjp against jvp: <vjp\(c\),t> == <c,jvp\(t\)> failed for "
        r"argument 1: vjp for argument 1 has 3 non-finite \(NaN or inf\)",
    ):
        check_op(op, X, 2 * X)


def test_vmap_of_the_vjp_with_an_unbatched_argument_is_checked():
    """expand_dims: a vjp that takes the batch size from w is right only when w is batched."""

    def f(out, args, kwargs_dump):
        w, x = args
        out[0][...] = w * np.sin(x)

    def f_jvp(out, args, kwargs_dump):
        w, x, dx = args
        out[0][...] = w * np.cos(x) * dx

    def f_vjp_looping_over_w(out, args, kwargs_dump):
        w, x, ct = args
        if w.ndim == 1:
            out[0][...] = w * np.cos(x) * ct
            return
        for b in range(w.shape[0]):  # an unbatched w has a size-1 axis here: rows left unwritten
            out[0][b] = w[b] * np.cos(x[b]) * ct[b]

    op = jaxbind.get_nonlinear_call(
        f,
        (f_jvp, f_vjp_looping_over_w),
        like_last,
        like_last,
        first_n_args_fixed=1,
        vmap_method="expand_dims",
        name="vjp_loops_over_w",
    )
    W = jnp.asarray(RNG.uniform(1, 2, (3, 3)))
    Xs = jnp.asarray(RNG.standard_normal((3, 3)))
    C = jnp.asarray(RNG.standard_normal((3, 3)))
    vjp = lambda w, x, c: jax.vjp(lambda x: op(w, x), x)[1]([c])[0]
    np.testing.assert_allclose(jax.vmap(vjp)(W, Xs, C), W * np.cos(Xs) * C, rtol=1e-12)  # all batched: right
    with pytest.raises(
        AssertionError,
        match=r"'vjp_loops_over_w': vmap of the vjp against a loop failed for "
        r"in_axes None-mixed \(None, 0\)",
    ):
        check_op(op, W[0], Xs[0])

"""``vmap_method``: how a vmapped op hands its batch to the callbacks.

- ``"sequential"`` (the default): the trampoline walks the batch and calls the
  callback once per element, inside one custom call.
- ``"expand_dims"``: one call; every vmap level is a leading axis of every
  input (outermost first), of size 1 where the input is not mapped.
- ``"broadcast_all"``: one call; every input is broadcast over every level.

The abstracts describe one element either way, and the method applies to every
callback of the op (transposes, jvp, vjp). The callbacks below are written with
NumPy broadcasting over leading axes, so the same callback serves all three.
Every result is compared with the same transformation of a jax.numpy reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind

METHODS = ("sequential", "expand_dims", "broadcast_all")
SEEN = []  # (callback, shapes of its inputs) for every call


@pytest.fixture(autouse=True)
def seen():
    SEEN.clear()
    yield SEEN
    SEEN.clear()


def _record(name, args):
    SEEN.append((name, tuple(a.shape for a in args)))


# ---------------------------------------------------------------------------
# The ops: a linear matvec with a fixed matrix, a bilinear product, a
# nonlinear p * sin(x) * w with p fixed. Core shapes: A (4, 3), vectors (3,).
# ---------------------------------------------------------------------------


def matvec(out, args, kwargs_dump):  # y = A x
    _record("matvec", args)
    out[0][...] = np.einsum("...ij,...j->...i", *args)


def matvec_T(out, args, kwargs_dump):  # x_ct = A^T y_ct
    _record("matvec_T", args)
    out[0][...] = np.einsum("...ij,...i->...j", *args)


def matvec_abstract(A, x):
    return (((A.shape[0],), x.dtype),)


def matvec_T_abstract(A, y):
    return (((A.shape[1],), y.dtype),)


def product(out, args, kwargs_dump):  # z = a * b; its transposes are the same product
    _record("product", args)
    np.multiply(args[0], args[1], out=out[0])


def like_last(*args, **kwargs):
    return ((args[-1].shape, args[-1].dtype),)


def wsin(out, args, kwargs_dump):  # y = p * sin(x) * w
    _record("wsin", args)
    p, x, w = args
    out[0][...] = p * np.sin(x) * w


def wsin_jvp(out, args, kwargs_dump):
    _record("wsin_jvp", args)
    p, x, w, dx, dw = args
    out[0][...] = p * (np.cos(x) * w * dx + np.sin(x) * dw)


def wsin_vjp(out, args, kwargs_dump):
    _record("wsin_vjp", args)
    p, x, w, ct = args
    out[0][...] = p * np.cos(x) * w * ct
    out[1][...] = p * np.sin(x) * ct


def wsin_abstract(p, x, w, *tangents):  # p, x and w have one shape
    return ((x.shape, x.dtype),)


def wsin_reverse(p, x, w, ct):
    return ((x.shape, x.dtype), (w.shape, w.dtype))


def make_ops(method):
    return {
        "linear": (
            jaxbind.get_linear_call(
                matvec, matvec_T, matvec_abstract, matvec_T_abstract, first_n_args_fixed=1, vmap_method=method
            ),
            lambda A, x: A @ x,
            [(4, 3), (3,)],
            (1,),
        ),
        "multilinear": (
            jaxbind.get_linear_call(product, (product, product), like_last, (like_last, like_last), vmap_method=method),
            lambda a, b: a * b,
            [(3,), (3,)],
            (0, 1),
        ),
        "nonlinear": (
            jaxbind.get_nonlinear_call(
                wsin, (wsin_jvp, wsin_vjp), wsin_abstract, wsin_reverse, first_n_args_fixed=1, vmap_method=method
            ),
            lambda p, x, w: p * jnp.sin(x) * w,
            [(3,), (3,), (3,)],
            (1, 2),
        ),
    }


OUTER, INNER = 3, 2
# (outer in_axes, inner in_axes) per argument count: mapped at 0, at 1, or not.
AXES = {
    2: [((0, 0), (0, 0)), ((None, 1), (0, None)), ((1, None), (None, 0))],
    3: [((0, 0, 0), (0, 0, 0)), ((None, 1, 0), (0, None, 1)), ((1, None, None), (None, 0, 1))],
}


def batched_args(cores, outer, inner, seed=0):
    """Random arguments of the given core shapes, with the inner then the outer vmap axis inserted."""
    rng = np.random.default_rng(seed)
    args = []
    for core, ao, ai in zip(cores, outer, inner):
        shape = list(core)
        if ai is not None:
            shape.insert(ai, INNER)
        if ao is not None:
            shape.insert(ao, OUTER)
        args.append(jnp.asarray(rng.standard_normal(shape)))
    return args


def nested(fn, outer, inner):
    return jax.vmap(jax.vmap(fn, in_axes=inner), in_axes=outer)


def assert_close(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12, atol=1e-12)


def loss_of(fn):
    return lambda *args: jnp.sum(jnp.sin(fn(*args)) ** 2)


def of_differentiable(fn, args, diff):
    """``fn`` as a function of the differentiable arguments, the others held at ``args``."""

    def partial(*values):
        return fn(*[values[diff.index(i)] if i in diff else v for i, v in enumerate(args)])

    return partial


def op_fn(op):
    return lambda *args: op(*args)[0]


@pytest.mark.parametrize("kind", ["linear", "multilinear", "nonlinear"])
@pytest.mark.parametrize("method", METHODS)
def test_jit_and_unbatched_grad(method, kind):
    op, ref, cores, diff = make_ops(method)[kind]
    args = batched_args(cores, (None,) * len(cores), (None,) * len(cores))
    assert_close(jax.jit(op_fn(op))(*args), ref(*args))
    assert_close(jax.jit(jax.grad(loss_of(op_fn(op)), diff))(*args), jax.grad(loss_of(ref), diff)(*args))


@pytest.mark.parametrize("kind", ["linear", "multilinear", "nonlinear"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("transform", ["vmap", "grad", "jvp", "vjp"])
def test_nested_vmap_with_mixed_axes(method, kind, transform):
    op, ref, cores, diff = make_ops(method)[kind]
    for outer, inner in AXES[len(cores)]:
        args = batched_args(cores, outer, inner)

        def transformed(fn):
            if transform == "vmap":
                return fn
            if transform == "grad":
                return jax.grad(loss_of(fn), diff)
            if transform == "jvp":

                def jvp(*a):
                    primals = tuple(a[i] for i in diff)
                    return jax.jvp(of_differentiable(fn, a, diff), primals, tuple(map(jnp.cos, primals)))

                return jvp

            def vjp(*a):
                out, pullback = jax.vjp(of_differentiable(fn, a, diff), *[a[i] for i in diff])
                return pullback(jnp.cos(out))

            return vjp

        got = jax.jit(nested(transformed(op_fn(op)), outer, inner))(*args)
        want = nested(transformed(ref), outer, inner)(*args)
        assert_close(got, want)


@pytest.mark.parametrize("method", METHODS)
def test_vmap_of_grad_of_vmap(method):
    op, ref, cores, diff = make_ops(method)["nonlinear"]
    p, x, w = batched_args(cores, (None, 0, None), (None, 0, 0))
    inner = lambda fn: lambda p, x, w: jnp.sum(jax.vmap(fn, in_axes=(None, 0, 0))(p, x, w) ** 2)
    got = jax.jit(jax.vmap(jax.grad(inner(op_fn(op)), (1, 2)), in_axes=(None, 0, None)))(p, x, w)
    assert_close(got, jax.vmap(jax.grad(inner(ref), (1, 2)), in_axes=(None, 0, None))(p, x, w))


def test_callbacks_see_the_layout_of_their_method(seen):
    """expand_dims really passes size-1 axes; broadcast_all full ones; sequential one element."""
    shapes = {}
    for method in METHODS:
        op, _, cores, _ = make_ops(method)["nonlinear"]
        p, x, w = batched_args(cores, (None, 0, None), (0, 0, None))  # p: inner only; w: none
        seen.clear()
        jax.jit(nested(op_fn(op), (None, 0, None), (0, 0, None)))(p, x, w)
        shapes[method] = list(seen)
    assert shapes["sequential"] == [("wsin", ((3,), (3,), (3,)))] * (OUTER * INNER)
    assert shapes["expand_dims"] == [("wsin", ((1, INNER, 3), (OUTER, INNER, 3), (1, 1, 3)))]
    assert shapes["broadcast_all"] == [("wsin", ((OUTER, INNER, 3),) * 3)]


def test_every_callback_of_the_op_gets_the_whole_batch(seen):
    """jvp, vjp and transposes are called once per batch too, with size-1 axes where unmapped."""
    op, _, cores, diff = make_ops("expand_dims")["nonlinear"]
    p, x, w = batched_args(cores, (None, 0, None), (None, None, None))
    seen.clear()
    jax.jit(jax.vmap(jax.grad(loss_of(op_fn(op)), diff), in_axes=(None, 0, None)))(p, x, w)
    assert seen == [("wsin", ((1, 3), (OUTER, 3), (1, 3))), ("wsin_vjp", ((1, 3), (OUTER, 3), (1, 3), (OUTER, 3)))]
    seen.clear()
    jvp = lambda p, x, w: jax.jvp(lambda x, w: op(p, x, w)[0], (x, w), (x, w))
    jax.jit(jax.vmap(jvp, in_axes=(None, 0, None)))(p, x, w)
    assert seen == [
        ("wsin", ((1, 3), (OUTER, 3), (1, 3))),
        ("wsin_jvp", ((1, 3), (OUTER, 3), (1, 3), (OUTER, 3), (1, 3))),
    ]
    lin, _, _, _ = make_ops("expand_dims")["linear"]
    A, x = batched_args([(4, 3), (3,)], (None, 0), (None, None))
    seen.clear()
    jax.jit(jax.vmap(jax.grad(loss_of(op_fn(lin)), 1), in_axes=(None, 0)))(A, x)
    assert seen == [("matvec", ((1, 4, 3), (OUTER, 3))), ("matvec_T", ((1, 4, 3), (OUTER, 4)))]


def test_unmapped_linear_argument_gets_the_summed_cotangent():
    """An argument a level does not map was broadcast over it: its cotangent sums over it."""
    for method in METHODS:
        op, ref, _, _ = make_ops(method)["multilinear"]
        a, b = batched_args([(3,), (3,)], (None, 0), (None, None))
        f = lambda fn: lambda a, b: jnp.sum(jax.vmap(fn, in_axes=(None, 0))(a, b) ** 3)
        assert_close(jax.jit(jax.grad(f(op_fn(op)), (0, 1)))(a, b), jax.grad(f(ref), (0, 1))(a, b))


def test_complex_linear_op_under_expand_dims():
    op, ref, _, _ = make_ops("expand_dims")["linear"]
    rng = np.random.default_rng(3)
    A = jnp.asarray(rng.standard_normal((4, 3)) + 1j * rng.standard_normal((4, 3)))
    X = jnp.asarray(rng.standard_normal((5, 3)) + 1j * rng.standard_normal((5, 3)))
    loss = lambda fn: lambda A, X: jnp.sum(jnp.abs(jax.vmap(fn, in_axes=(None, 0))(A, X)) ** 2)
    assert_close(jax.jit(jax.grad(loss(op_fn(op)), 1))(A, X), jax.grad(loss(ref), 1)(A, X))


def test_broadcast_all_jaxpr_and_single_call(seen):
    op, _, _, _ = make_ops("broadcast_all")["linear"]
    A, X = batched_args([(4, 3), (3,)], (None, 0), (None, None))
    jaxpr = str(jax.make_jaxpr(jax.vmap(op_fn(op), in_axes=(None, 0)))(A, X))
    assert "broadcast_in_dim" in jaxpr and jaxpr.count("jaxbind[") == 1
    jax.vmap(op_fn(op), in_axes=(None, 0))(A, X)
    assert seen == [("matvec", ((OUTER, 4, 3), (OUTER, 3)))]


def test_methods_are_part_of_the_op():
    ops = {m: make_ops(m)["linear"][0] for m in METHODS}
    assert len(set(ops.values())) == 3
    assert ops["sequential"] == make_ops("sequential")["linear"][0]
    default = jaxbind.get_linear_call(matvec, matvec_T, matvec_abstract, matvec_T_abstract, first_n_args_fixed=1)
    assert default == ops["sequential"]


@pytest.mark.parametrize("method", METHODS)
def test_python_scalar_argument_not_mapped(method, seen):
    op, ref, _, _ = make_ops(method)["nonlinear"]
    x = jnp.linspace(0.0, 1.0, 5)
    got = jax.jit(jax.vmap(jax.grad(lambda x: op(1.5, x, 2.0)[0]), in_axes=0))(x)
    assert_close(got, jax.vmap(jax.grad(lambda x: ref(1.5, x, 2.0)))(x))
    if method == "expand_dims":  # the cotangent of each scalar, 1.0, is not mapped either
        assert seen == [("wsin_vjp", ((1,), (5,), (1,), (1,)))]  # (the forward value is unused)


def test_empty_batch_calls_nothing(seen):
    op, ref, _, _ = make_ops("expand_dims")["linear"]
    A, X = jnp.ones((4, 3)), jnp.ones((0, 3))
    y = jax.vmap(op_fn(op), in_axes=(None, 0))(A, X)
    assert y.shape == (0, 4)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["expand_dims", "broadcast_all"])
def test_func_can_batch_with_another_method_is_an_error(method):
    with pytest.raises(ValueError, match=r"jaxbind op 'product': func_can_batch=True and vmap_method="):
        jaxbind.get_linear_call(product, product, like_last, like_last, func_can_batch=True, vmap_method=method)
    with pytest.raises(ValueError, match=r"jaxbind op 'wsin': func_can_batch=True"):
        jaxbind.get_nonlinear_call(
            wsin, (wsin_jvp, wsin_vjp), wsin_abstract, wsin_reverse, func_can_batch=True, vmap_method=method
        )


@pytest.mark.parametrize("bad", ["legacy_vectorized", "expand", None, 1])
def test_unknown_method_is_an_error(bad):
    with pytest.raises(
        ValueError,
        match=r"jaxbind op 'ew': vmap_method must be one of 'sequential', "
        r"'expand_dims', 'broadcast_all'",
    ):
        jaxbind.get_linear_call(product, product, like_last, like_last, name="ew", vmap_method=bad)


def scaled(out, args, kwargs_dump):  # func_can_batch: y = a * x, batch axes kept in place
    out[0][...] = args[0] * args[1]


def abstract_from_the_fixed_argument(a, x, *, batch_axes=None):
    # The mistake: the output's shape and batch axis read off the fixed argument,
    # which the batch does not map.
    return ((a.shape, x.dtype, 0),)


def test_func_can_batch_abstract_without_the_batch_levels_names_op_and_abstract():
    op = jaxbind.get_linear_call(
        scaled,
        scaled,
        abstract_from_the_fixed_argument,
        abstract_from_the_fixed_argument,
        first_n_args_fixed=1,
        func_can_batch=True,
        name="scaled",
    )
    a, X = jnp.ones(3), jnp.ones((5, 3))
    with pytest.raises(
        ValueError,
        match=r"jaxbind op 'scaled': its abstract function "
        r"'abstract_from_the_fixed_argument' declares output 0 with "
        r"shape \(3,\), which does not hold the batch: vmap level 0 "
        r"\(size 5\) is its axis 0",
    ):
        jax.jit(jax.vmap(lambda x: op(a, x)[0])).lower(X)
    # .lower traces and lowers only: no callback can have run.


def batched_sum_abstract(x, *, batch_axes=None):
    # Right for the forward call, wrong for the nested level: the second level's
    # output axis is given as the first's.
    if batch_axes and len(batch_axes[0]) == 2:
        return ((x.shape, x.dtype, 2),)
    return ((x.shape, x.dtype, batch_axes[0][-1] if batch_axes else None),)


def batched_twice(out, args, kwargs_dump):
    out[0][...] = 2 * args[0]


def test_nested_level_mismatch_names_the_level():
    op = jaxbind.get_linear_call(
        batched_twice, batched_twice, batched_sum_abstract, batched_sum_abstract, func_can_batch=True, name="twice"
    )
    X = jnp.ones((5, 2, 3))
    with pytest.raises(
        ValueError,
        match=r"jaxbind op 'twice': .* declares output 0 with shape \(5, 2, 3\), "
        r"which does not hold the batch",
    ):
        jax.jit(jax.vmap(jax.vmap(lambda x: op(x)[0]))).lower(X)


@pytest.mark.parametrize("method", ["expand_dims", "broadcast_all"])
def test_native_kernel_gets_the_whole_batch(method, kernels):
    """A native kernel is called once on the whole arrays, with no batch kwargs."""
    lib = kernels
    op = jaxbind.get_linear_call(
        lib.jb_scale, lib.jb_scale, like_last, like_last, first_n_args_fixed=1, vmap_method=method
    )  # out = factor * (the last input)
    w, X = jnp.ones(3), jnp.asarray(np.random.default_rng(0).standard_normal((5, 3)))
    f = lambda x: op(w, x, factor=3.0)[0]
    assert_close(jax.jit(jax.vmap(f))(X), 3.0 * X)
    assert_close(jax.jit(jax.vmap(jax.grad(lambda x: jnp.sum(f(x) ** 2))))(X), 18.0 * X)
    if method == "broadcast_all":
        jaxbind.testing.check_op(op, w, X[0], factor=3.0)
    else:
        # jb_scale does not broadcast: with x unmapped (a size-1 axis) it writes one
        # row of the batch. check_op finds it; such a kernel wants broadcast_all.
        with pytest.raises(
            AssertionError,
            match=r"'jb_scale': vmap against a Python loop failed for in_axes "
            r"None-mixed \(0, None\): .*"
            r"output 0 \(shape \(3, 3\)\) was not fully written",
        ):
            jaxbind.testing.check_op(op, w, X[0], factor=3.0)


# ---------------------------------------------------------------------------
# jaxbind.pure_callback's methods at two levels, against jax.pure_callback
# ---------------------------------------------------------------------------

PURE_CALLBACK_METHODS = METHODS + ("legacy_vectorized",)
# (outer in_axes, inner in_axes) of x, mapped at both levels, and y: y unmapped at
# the inner level, at the outer one, at both.
Y_UNMAPPED = {"inner": ((0, 0), (0, None)), "outer": ((0, None), (0, 0)), "both": ((0, None), (0, None))}


def pure_callback_run(api, method, where):
    """``api(np.add ...)`` under two vmaps: its result (or the exception) and the shapes the callback saw."""
    outer, inner = Y_UNMAPPED[where]
    x = jnp.arange(24.0).reshape(OUTER, INNER, 4)
    y = jnp.linspace(0.0, 1.0, 4 * (OUTER if outer[1] == 0 else 1) * (INNER if inner[1] == 0 else 1))
    y = y.reshape(((OUTER,) if outer[1] == 0 else ()) + ((INNER,) if inner[1] == 0 else ()) + (4,))
    seen = []

    def add(a, b):
        seen.append((np.shape(a), np.shape(b)))
        return np.add(a, b)

    def f(a, b):
        return api(add, jax.ShapeDtypeStruct(np.broadcast_shapes(a.shape, b.shape), a.dtype), a, b, vmap_method=method)

    try:
        result = jax.jit(nested(f, outer, inner))(x, y)
    except Exception as e:
        result = e
    return result, sorted(seen)


@pytest.mark.parametrize("where", sorted(Y_UNMAPPED))
@pytest.mark.parametrize("method", PURE_CALLBACK_METHODS)
def test_pure_callback_at_two_levels_is_jaxs(method, where):
    """Each method at two vmap levels, an input unmapped at one or both: what jax.pure_callback gives.

    With "legacy_vectorized" an unmapped input reaches the callback as it is, so
    its leading dimensions are its mapped levels only (the bug: every input was
    read as having every level in front, and a declared (2, 3, 4) became (2, 4, 4)).
    Where JAX's callback cannot broadcast what it gets (y mapped at the outer level
    only), both raise NumPy's error.
    """
    got, got_seen = pure_callback_run(jaxbind.pure_callback, method, where)
    want, want_seen = pure_callback_run(jax.pure_callback, method, where)
    assert got_seen == want_seen
    if isinstance(want, Exception):
        assert (method, where) == ("legacy_vectorized", "inner")
        assert "operands could not be broadcast together" in str(want)
        assert isinstance(got, Exception) and "operands could not be broadcast together" in str(got), got
    else:
        assert not isinstance(got, Exception), got
        assert got.shape == want.shape == (OUTER, INNER, 4)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_each_front_door_takes_the_methods_of_the_one_table_in_jaxs_words():
    from jaxbind import _vmap_methods

    x = jnp.ones(3)
    for bad in ("nope", "SEQUENTIAL", 0):
        with pytest.raises(ValueError) as theirs:
            jax.pure_callback(np.sin, x, x, vmap_method=bad)
        with pytest.raises(ValueError) as ours:
            jaxbind.pure_callback(np.sin, x, x, vmap_method=bad)
        assert str(ours.value) == str(theirs.value)
    # vmap_method=None under vmap: JAX's NotImplementedError, listing the same methods
    with pytest.raises(
        NotImplementedError,
        match=r"is one of 'sequential', 'sequential_unrolled', 'expand_dims', "
        r"'broadcast_all', or 'legacy_vectorized'. Got vmap_method=None",
    ):
        jax.vmap(lambda v: jaxbind.pure_callback(np.sin, v, v))(jnp.ones((2, 3)))
    # an op takes the table's methods of its door, and no other
    like = lambda x, **kwargs: ((x.shape, x.dtype),)
    for name in _vmap_methods.accepted(_vmap_methods.DOOR_OP):
        jaxbind.get_nonlinear_call(lambda out, args, kw: None, None, like, None, vmap_method=name)
    for name in ("sequential_unrolled", "legacy_vectorized", None):
        with pytest.raises(ValueError, match="vmap_method must be one of 'sequential', 'expand_dims', 'broadcast_all'"):
            jaxbind.get_nonlinear_call(lambda out, args, kw: None, None, like, None, vmap_method=name)
    # an alias is its method: the same op
    assert _vmap_methods.named("sequential_unrolled") == "sequential"

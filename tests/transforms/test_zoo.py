"""Every op of the zoo (``zoo.py``), as a Python callback and as a native kernel, through
JAX's transformations and ``check_op``, against its jax.numpy reference."""

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
import zoo

from jaxbind.testing import check_op

SINGLE = (np.dtype(np.float32), np.dtype(np.complex64))


def tolerance(dtype):
    if np.dtype(dtype) in SINGLE:
        return dict(rtol=2e-4, atol=2e-5)
    return dict(rtol=1e-11, atol=1e-12)


def sample(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    if np.dtype(dtype).kind == "c":
        x = x + 1j * rng.standard_normal(shape)
    return x.astype(dtype)


class Case:
    """One entry, one kind of callback, one dtype: the op, its reference and data."""

    def __init__(self, name, kind, dtype):
        self.entry = e = zoo.ENTRIES[name]
        self.kind, self.dtype, self.tol = kind, np.dtype(dtype), tolerance(dtype)
        self.f = lambda *args: e.apply(kind, *args)
        self.ref = e.reference
        self.args = [sample(s, dtype, 10 + i) for i, s in enumerate(e.shapes)]

    def batched_args(self, in_axes, size=5, seed=30):
        """Arguments with a batch of ``size`` at ``in_axes`` (an int, or one per argument)."""
        axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(self.args)
        return [
            a if ax is None else np.moveaxis(sample((size,) + a.shape, self.dtype, seed + i), 0, ax)
            for i, (a, ax) in enumerate(zip(self.args, axes))
        ]

    def close(self, got, want):
        got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert np.shape(g) == np.shape(w) and jnp.result_type(g) == jnp.result_type(w), (g, w)
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), **self.tol)

    def loss(self, f):
        """A real loss of the outputs (the real*imag term catches a wrong conjugation)."""

        def loss(*args):
            return sum(
                jnp.sum(jnp.abs(y) ** 2) + jnp.sum(jnp.real(y) * jnp.imag(y)) + jnp.sum(jnp.real(y)) for y in f(*args)
            )

        return loss

    def mixed_in_axes(self):
        """vmap's in_axes to try: all at 0 and 1, and each argument alone unmapped."""
        n = len(self.args)
        if n == 1:
            return [0, 1]
        return [1] + [tuple(None if j == i else 0 for j in range(n)) for i in range(n)]

    def unmapped_in_axes(self):
        """For vmap of grad and grad of vmap: 0 and 1, or (two arguments) each one unmapped."""
        n = len(self.args)
        return [0, 1] if n == 1 else [tuple(None if j == i else 1 for j in range(n)) for i in range(n)]


CASES = zoo.cases()
LINEAR = zoo.cases(linear_only=True)
REDUCED = zoo.cases(reduced=True)  # (the compositions of several transformations)


@pytest.fixture(params=CASES, ids=zoo.case_id)
def case(request):
    return Case(*request.param)


@pytest.fixture(params=REDUCED, ids=zoo.case_id)
def composed_case(request):
    return Case(*request.param)


@pytest.fixture(params=LINEAR, ids=zoo.case_id)
def linear_case(request):
    return Case(*request.param)


def test_eager_and_jit(case):
    case.close(case.f(*case.args), case.ref(*case.args))
    case.close(jax.jit(case.f)(*case.args), case.ref(*case.args))


def test_jvp(case):
    n = case.entry.argnums
    tangents = [sample(a.shape, case.dtype, 50 + i) for i, a in enumerate(case.args)]

    def jvp(f):
        def run(*args_and_tangents):
            args, ts = list(args_and_tangents[: len(case.args)]), args_and_tangents[len(case.args) :]
            return jax.jvp(
                lambda *d: f(*[d[n.index(i)] if i in n else a for i, a in enumerate(args)]),
                tuple(args[i] for i in n),
                tuple(ts[i] for i in n),
            )

        return run

    want = jvp(case.ref)(*case.args, *tangents)
    case.close(jvp(case.f)(*case.args, *tangents), want)
    case.close(jax.jit(jvp(case.f))(*case.args, *tangents), want)


def _pullback(f, args, argnums, cts):
    def g(*d):
        return f(*[d[argnums.index(i)] if i in argnums else a for i, a in enumerate(args)])

    y, pullback = jax.vjp(g, *[args[i] for i in argnums])
    return y, pullback(cts)


def test_vjp(case):
    ys = case.ref(*case.args)
    cts = tuple(sample(np.shape(y), case.dtype, 70 + i) for i, y in enumerate(ys))
    case.close(
        _pullback(case.f, case.args, case.entry.argnums, cts), _pullback(case.ref, case.args, case.entry.argnums, cts)
    )


def test_grad(case):
    argnums = case.entry.argnums
    want = jax.jit(jax.grad(case.loss(case.ref), argnums=argnums))(*case.args)
    case.close(jax.grad(case.loss(case.f), argnums=argnums)(*case.args), want)
    case.close(jax.jit(jax.grad(case.loss(case.f), argnums=argnums))(*case.args), want)


def test_linear_transpose(linear_case):
    c = linear_case
    for i in c.entry.argnums:  # (a multilinear op is linear in each argument alone)

        def g(f):
            return lambda v: f(*[v if j == i else a for j, a in enumerate(c.args)])

        ys = c.ref(*c.args)
        cts = tuple(sample(np.shape(y), c.dtype, 90 + k) for k, y in enumerate(ys))
        c.close(jax.linear_transpose(g(c.f), c.args[i])(cts), jax.linear_transpose(g(c.ref), c.args[i])(cts))


def test_check_grads(case):
    eps = 1e-2 if case.dtype in SINGLE else 1e-5
    order = 2 if case.entry.linear else 1  # (second order of a nonlinear op is an error)
    argnums = case.entry.argnums

    def f(*d):
        return case.f(*[d[argnums.index(i)] if i in argnums else a for i, a in enumerate(case.args)])

    jax.test_util.check_grads(f, tuple(case.args[i] for i in argnums), order=order, modes=("fwd", "rev"), eps=eps)


def test_vmap(case):
    for in_axes in case.mixed_in_axes():
        args = case.batched_args(in_axes)
        want = jax.vmap(case.ref, in_axes=in_axes)(*args)
        case.close(jax.vmap(case.f, in_axes=in_axes)(*args), want)
        case.close(jax.jit(jax.vmap(case.f, in_axes=in_axes))(*args), want)
    args = case.batched_args(2)
    case.close(jax.vmap(case.f, in_axes=2, out_axes=-1)(*args), jax.vmap(case.ref, in_axes=2, out_axes=-1)(*args))


def test_nested_vmap(composed_case):
    case = composed_case
    args = case.batched_args(0, size=2)
    args = [np.moveaxis(sample((3,) + a.shape, case.dtype, 40 + i), 0, 2) for i, a in enumerate(args)]
    for outer, inner in [(0, 1), (2, 0), (1, 1)]:

        def nest(f):
            return jax.vmap(jax.vmap(f, in_axes=inner), in_axes=outer)

        want = nest(case.ref)(*args)
        if (outer, inner) == (0, 1):
            case.close(nest(case.f)(*args), want)  # (eager once)
        case.close(jax.jit(nest(case.f))(*args), want)


def test_vmap_of_grad_and_grad_of_vmap(composed_case):
    case = composed_case
    argnums = case.entry.argnums
    for in_axes in case.unmapped_in_axes():
        args = case.batched_args(in_axes, size=4)
        if isinstance(in_axes, tuple) and all(in_axes[i] is None for i in argnums):
            continue
        vg = lambda f: jax.jit(jax.vmap(jax.grad(case.loss(f), argnums=argnums), in_axes=in_axes))
        case.close(vg(case.f)(*args), vg(case.ref)(*args))
        # an unmapped differentiated argument gets its cotangent summed over the batch
        gv = lambda f: jax.jit(jax.grad(case.loss(jax.vmap(f, in_axes=in_axes)), argnums=argnums))
        case.close(gv(case.f)(*args), gv(case.ref)(*args))


def test_vmap_of_jvp_and_vjp(composed_case):
    case = composed_case
    argnums = case.entry.argnums
    args = case.batched_args(0)
    tangents = case.batched_args(0, seed=60)
    cts = [sample((5,) + np.shape(y), case.dtype, 80 + i) for i, y in enumerate(case.ref(*case.args))]

    def jvp(f):
        def run(*a):
            args, ts = a[: len(case.args)], a[len(case.args) :]
            return jax.jvp(
                lambda *d: f(*[d[argnums.index(i)] if i in argnums else x for i, x in enumerate(args)]),
                tuple(args[i] for i in argnums),
                tuple(ts[i] for i in argnums),
            )

        return jax.vmap(run)

    def vjp(f):
        return jax.vmap(lambda *a: _pullback(f, a[: len(case.args)], argnums, tuple(a[len(case.args) :])))

    case.close(jvp(case.f)(*args, *tangents), jvp(case.ref)(*args, *tangents))
    case.close(jax.jit(vjp(case.f))(*args, *cts), vjp(case.ref)(*args, *cts))  # batched (scalar) cotangents


def test_vmapped_call_is_one_custom_call_without_loop(composed_case):
    case = composed_case

    def assert_one_call(fn, *args):
        text = jax.jit(fn).lower(*args).as_text()
        assert text.count("@jaxbind_dispatch") == 1, text
        assert "stablehlo.while" not in text, text

    args = case.batched_args(0)
    assert_one_call(jax.vmap(case.f), *args)
    assert_one_call(jax.vmap(case.f, in_axes=1), *case.batched_args(1))
    assert_one_call(jax.vmap(jax.vmap(case.f), in_axes=2), *case.batched_args(2))
    d = case.entry.argnums[-1]
    ys = jax.vmap(case.ref)(*args)
    assert_one_call(
        lambda *a: jax.vjp(lambda v: jax.vmap(case.f)(*[v if j == d else b for j, b in enumerate(a)]), a[d])[1](ys)[0],
        *args,
    )


@pytest.mark.parametrize("case_", [c for c in REDUCED if c[1] in ("python", "native")], ids=zoo.case_id)
def test_check_op(case_):
    case = Case(*case_)
    check_op(case.entry.ops[case.kind], *case.args, **case.entry.kwargs)


# ---------------------------------------------------------------------------
# What only some entries have
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(zoo.SCALE.ops))
def test_scale_default_and_integer_factor(kind):
    x = sample((3, 4), np.float64, 1)
    op = zoo.SCALE.ops[kind]
    np.testing.assert_allclose(op(x)[0], 2 * x, rtol=1e-15)  # the default factor is 2
    # an integer factor is a float to the kernel (the header's helper converts it)
    np.testing.assert_allclose(jax.jit(lambda v: op(v, factor=3)[0])(x), 3 * x, rtol=1e-15)


@pytest.mark.parametrize("kind", sorted(zoo.BATCHED_LEVELS))
def test_func_can_batch_sees_every_level_in_one_call(kind):
    op = zoo.BATCHED_LEVELS[kind]
    f = lambda v: op(v, factor=zoo.FACTOR)
    x = sample((3, 4), np.float64, 1)
    y, levels = jax.jit(f)(x)
    assert levels.shape == () and int(levels) == 0  # unbatched
    xs = sample((5, 3, 4), np.float64, 2)
    for in_axes in (0, 1, 2):
        for g in (jax.vmap(f, in_axes=in_axes), jax.jit(jax.vmap(f, in_axes=in_axes))):
            y, levels = g(xs)
            np.testing.assert_allclose(y, zoo.FACTOR * np.moveaxis(xs, in_axes, 0), rtol=1e-15)
            assert levels.shape == (xs.shape[in_axes],) and int(levels[0]) == 1
    xs = sample((2, 3, 4, 5), np.float64, 3)
    g = jax.vmap(jax.vmap(jax.vmap(f, in_axes=1), in_axes=1), in_axes=0)
    y, levels = jax.jit(g)(xs)
    assert levels.shape == (2, 4, 5) and np.all(np.asarray(levels) == 3)
    y, levels = jax.vmap(jax.vmap(f, in_axes=1), in_axes=1)(xs)
    assert levels.shape == (3, 4) and np.all(np.asarray(levels) == 2)

"""Property tests: random dtypes, shapes, inputs, kwargs and transformations against jax.numpy references.

Bounded for CI (40 examples per test, derandomized so that a run is reproducible);
set JAXBIND_PROPERTY_EXAMPLES to search further.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
import _kernels
from _shared import sample
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxbind

LIB = _kernels.load()
# Examples per test: JAXBIND_PROPERTY_EXAMPLES (default 40; each compiles a program or two).
EXAMPLES = int(os.environ.get("JAXBIND_PROPERTY_EXAMPLES", "40"))
BOUNDED = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None)

NUMERIC = ["int8", "int32", "uint16", "int64", "float16", "bfloat16", "float32", "float64", "complex64", "complex128"]
FLOATING = ["float32", "float64", "complex64", "complex128"]


def tolerance(dtype):
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.dtype("float16"), jnp.dtype("bfloat16")):
        return dict(rtol=2e-2, atol=2e-2)
    if dtype in (jnp.dtype("float32"), jnp.dtype("complex64")):
        return dict(rtol=1e-5, atol=1e-5)
    return dict(rtol=1e-12, atol=1e-12)


# A jointly linear op: y = sum_i c_i x_i, c from the kwargs; the transpose of
# input i is c_i * ct. The callback also records the kwargs it received.
RECEIVED = []


def combine(out, args, kwargs_dump):
    kwargs = jaxbind.load_kwargs(kwargs_dump)
    RECEIVED.append(kwargs["extra"])
    total = np.zeros(out[0].shape, out[0].dtype)
    with np.errstate(over="ignore"):  # integers wrap around, as in jax.numpy (NumPy warns for scalars)
        for c, x in zip(kwargs["coefficients"], args):
            total = total + (np.asarray(c).astype(x.dtype) * x)
    out[0][...] = total


def combine_T(out, args, kwargs_dump):
    coefficients = jaxbind.load_kwargs(kwargs_dump)["coefficients"]
    (ct,) = args
    with np.errstate(over="ignore"):  # integers wrap around, as in jax.numpy
        for c, o in zip(coefficients, out):
            o[...] = np.asarray(c).astype(ct.dtype) * ct


def combine_abstract(*args, coefficients, extra):
    return ((args[0].shape, args[0].dtype),)


def combine_T_abstract(ct, *, coefficients, extra):
    return tuple((ct.shape, ct.dtype) for _ in coefficients)


combine_op = jaxbind.get_linear_call(combine, combine_T, combine_abstract, combine_T_abstract)


def combine_reference(*args, coefficients):
    return sum(jnp.asarray(c).astype(x.dtype) * x for c, x in zip(coefficients, args))


picklable = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=6,
)
shapes = st.lists(st.integers(0, 3), max_size=3).map(tuple)


@st.composite
def batching(draw, n_inputs, ndim):
    """Nested vmap levels (outermost first): per level, an in_axes entry per input."""
    levels = []
    for _ in range(draw(st.integers(0, 2))):
        axes = [draw(st.none() | st.integers(0, ndim)) for _ in range(n_inputs)]
        if all(a is None for a in axes):
            axes[0] = 0
        levels.append((tuple(axes), draw(st.integers(1, 3))))
    return levels


def batched_inputs(cores, levels):
    """Insert each level's batch axis, innermost level first (the outer in_axes count the inner
    axes); the elements along a level differ (rolled copies)."""
    arrays = list(cores)
    for axes, size in reversed(levels):
        arrays = [
            x if a is None else np.stack([np.roll(x, k) for k in range(size)], axis=a) for x, a in zip(arrays, axes)
        ]
    return arrays


def vmapped(fn, levels):
    for axes, _ in reversed(levels):  # innermost vmap wraps first
        fn = jax.vmap(fn, in_axes=axes)
    return fn


@BOUNDED
@given(
    dtype=st.sampled_from(NUMERIC),
    shape=shapes,
    n_inputs=st.integers(1, 3),
    coefficients=st.lists(st.integers(-3, 3), min_size=3, max_size=3),
    extra=picklable,
    mode=st.sampled_from(["eager", "jit"]),
    data=st.data(),
)
def test_random_linear_op_matches_jax_numpy(dtype, shape, n_inputs, coefficients, extra, mode, data):
    coefficients = coefficients[:n_inputs]
    if jnp.dtype(dtype).kind == "u":
        coefficients = [abs(c) for c in coefficients]
    levels = data.draw(batching(n_inputs, len(shape)))
    cores = [sample(dtype, shape, seed=i) for i in range(n_inputs)]
    arrays = batched_inputs(cores, levels)
    ours = vmapped(lambda *xs: combine_op(*xs, coefficients=coefficients, extra=extra)[0], levels)
    reference = vmapped(lambda *xs: combine_reference(*xs, coefficients=coefficients), levels)
    if mode == "jit":
        ours = jax.jit(ours)
    RECEIVED.clear()
    got = ours(*arrays)
    want = reference(*arrays)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(
        np.asarray(got, np.complex128 if jnp.dtype(dtype).kind == "c" else np.float64),
        np.asarray(want, np.complex128 if jnp.dtype(dtype).kind == "c" else np.float64),
        **tolerance(dtype),
    )
    # the kwargs reach every call intact (one call per batch element; XLA skips
    # a call whose outputs are all empty)
    calls = int(np.prod([size for _, size in levels]))
    assert RECEIVED == [extra] * calls or (got.size == 0 and RECEIVED == [])


@BOUNDED
@given(
    dtype=st.sampled_from(FLOATING),
    shape=shapes,
    n_inputs=st.integers(1, 3),
    coefficients=st.lists(st.integers(-3, 3), min_size=3, max_size=3),
    data=st.data(),
)
def test_random_linear_op_gradients_match_jax_numpy(dtype, shape, n_inputs, coefficients, data):
    coefficients = coefficients[:n_inputs]
    levels = data.draw(batching(n_inputs, len(shape)))
    arrays = batched_inputs([sample(dtype, shape, seed=i) for i in range(n_inputs)], levels)
    weights = sample(
        dtype, np.shape(vmapped(lambda *xs: combine_reference(*xs, coefficients=coefficients), levels)(*arrays)), seed=7
    )

    def loss(fn):
        return lambda *xs: jnp.sum(jnp.real(weights * fn(*xs)))

    ours = vmapped(lambda *xs: combine_op(*xs, coefficients=coefficients, extra=None)[0], levels)
    reference = vmapped(lambda *xs: combine_reference(*xs, coefficients=coefficients), levels)
    argnums = tuple(range(n_inputs))
    got = jax.jit(jax.grad(loss(ours), argnums=argnums))(*arrays)
    want = jax.grad(loss(reference), argnums=argnums)(*arrays)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(g, w, **tolerance(dtype))


def scale_abstract(x, *, factor):
    return ((x.shape, x.dtype),)


native_scale = jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_scale, scale_abstract, scale_abstract)


@BOUNDED
@given(
    dtype=st.sampled_from(FLOATING),
    shape=shapes,
    factor=st.floats(-4, 4),
    mode=st.sampled_from(["eager", "jit", "vmap", "grad"]),
    data=st.data(),
)
def test_random_native_kernel_matches_jax_numpy(dtype, shape, factor, mode, data):
    x = sample(dtype, shape, seed=3)
    op = lambda v: native_scale(v, factor=factor)[0]
    reference = lambda v: (factor * v).astype(v.dtype)
    if mode == "jit":
        op = jax.jit(op)
    elif mode == "vmap":
        axis = data.draw(st.integers(0, len(shape)))
        x = np.stack([x, 2 * x], axis=axis)
        op, reference = jax.vmap(op, in_axes=axis), jax.vmap(reference, in_axes=axis)
    elif mode == "grad":
        weights = sample(dtype, shape, seed=4)
        op = jax.grad(lambda v: jnp.sum(jnp.real(weights * native_scale(v, factor=factor)[0])))
        reference = jax.grad(lambda v: jnp.sum(jnp.real(weights * (factor * v).astype(v.dtype))))
    got, want = op(x), reference(jnp.asarray(x))
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, **tolerance(dtype))

"""func_can_batch ops that put every output's batch axes last (a negative output axis):
a multilinear matmul whose transposes see the other slot's arrays, and a nonlinear op with
a fixed argument, under nested vmap. (The other func_can_batch tests: test_batching.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import CALLS

import jaxbind

# The callbacks below record (callback name, details) in _shared.CALLS, emptied around each test (the
# calls fixture).
pytestmark = pytest.mark.usefixtures("calls")


# ---------------------------------------------------------------------------
# (d) func_can_batch with batch axes last: a multilinear matmul, a nonlinear op
# ---------------------------------------------------------------------------
# These ops put every output's batch axes last, oldest level first, and their
# abstracts say so with a negative axis (-1: the newest level goes last). The
# product is not symmetric, so a transpose given the other slot's arrays, or a
# cotangent moved into its primal's layout the wrong way round, gives a wrong value.


def batch_last(a, axes):
    """``a`` with its batch axes (oldest level first) moved to the end, in that order."""
    return np.moveaxis(a, axes, range(a.ndim - len(axes), a.ndim)) if axes else a


def batch_last_shape(shape, axes):
    return tuple(n for k, n in enumerate(shape) if k not in axes) + tuple(shape[a] for a in axes)


def matmul_batched(out, args, kwargs_dump):
    """out = args[0] @ args[1] over the leading two axes; batch axes last."""
    batch_axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"] or ((), ())
    CALLS.append(("matmul_batched", batch_axes))
    a, b = (batch_last(x, axes) for x, axes in zip(args, batch_axes))
    out[0][...] = np.einsum("ij...,jk...->ik...", a, b)


def matmul_abstract(a, b, *, batch_axes):
    (m, _), (_, n) = (batch_last_shape(x.shape, axes)[:2] for x, axes in zip((a, b), batch_axes or ((), ())))
    levels = batch_last_shape(a.shape, batch_axes[0])[2:] if batch_axes else ()
    shape = (m, n) + levels
    return ((shape, a.dtype) if batch_axes is None else (shape, a.dtype, -1),)


def matmul_T_A(out, args, kwargs_dump):
    """Cotangent of A from (B, ct): ct @ B^T."""
    batch_axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"] or ((), ())
    CALLS.append(("matmul_T_A", batch_axes))
    b, ct = (batch_last(x, axes) for x, axes in zip(args, batch_axes))
    out[0][...] = np.einsum("ik...,jk...->ij...", ct, b)


def matmul_T_B(out, args, kwargs_dump):
    """Cotangent of B from (A, ct): A^T @ ct."""
    batch_axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"] or ((), ())
    CALLS.append(("matmul_T_B", batch_axes))
    a, ct = (batch_last(x, axes) for x, axes in zip(args, batch_axes))
    out[0][...] = np.einsum("ij...,ik...->jk...", a, ct)


def matmul_T_A_abstract(b, ct, *, batch_axes):
    (k, _), (m, _) = (batch_last_shape(x.shape, axes)[:2] for x, axes in zip((b, ct), batch_axes or ((), ())))
    levels = batch_last_shape(ct.shape, batch_axes[1])[2:] if batch_axes else ()
    return (((m, k) + levels, ct.dtype) if batch_axes is None else ((m, k) + levels, ct.dtype, -1),)


def matmul_T_B_abstract(a, ct, *, batch_axes):
    (_, k), (_, n) = (batch_last_shape(x.shape, axes)[:2] for x, axes in zip((a, ct), batch_axes or ((), ())))
    levels = batch_last_shape(ct.shape, batch_axes[1])[2:] if batch_axes else ()
    return (((k, n) + levels, ct.dtype) if batch_axes is None else ((k, n) + levels, ct.dtype, -1),)


matmul_op = jaxbind.get_linear_call(
    matmul_batched,
    (matmul_T_A, matmul_T_B),
    matmul_abstract,
    (matmul_T_A_abstract, matmul_T_B_abstract),
    func_can_batch=True,
)


def test_func_can_batch_negative_output_axis_puts_the_batch_last(rng, calls):
    a, b = rng.standard_normal((5, 2, 3)), rng.standard_normal((3, 4, 5))
    batched = jax.vmap(lambda a, b: matmul_op(a, b)[0], in_axes=(0, 2))
    y = batched(a, b)
    np.testing.assert_allclose(y, np.einsum("bij,jkb->bik", a, b), rtol=1e-12)
    assert calls == [("matmul_batched", ((0,), (2,)))]
    nested = jax.vmap(jax.vmap(lambda a, b: matmul_op(a, b)[0], in_axes=(0, 2)), in_axes=(1, 0))
    a2, b2 = rng.standard_normal((5, 6, 2, 3)), rng.standard_normal((6, 3, 4, 5))
    np.testing.assert_allclose(nested(a2, b2), np.einsum("bcij,cjkb->cbik", a2, b2), rtol=1e-12)


def nested_matmul(matmul):
    # A: both levels at axis 0 (batch axes (1, 0)); B: inner level at axis 2, outer at 1
    return jax.vmap(jax.vmap(matmul, in_axes=(0, 2)), in_axes=(0, 1))


def jnp_matmul(a, b):
    return a @ b


def test_func_can_batch_multilinear_transposes_under_nested_vmap(rng, calls):
    # Each transpose writes its cotangent batch-last; moving it into the layout of
    # its primal is a permutation that is not its own inverse.
    a, b = rng.standard_normal((6, 5, 2, 3)), rng.standard_normal((3, 6, 4, 5))
    weights = rng.standard_normal((6, 5, 2, 4))
    ours = nested_matmul(lambda a, b: matmul_op(a, b)[0])
    reference = nested_matmul(jnp_matmul)
    np.testing.assert_allclose(ours(a, b), reference(a, b), rtol=1e-12)

    def loss(matmul):
        return lambda a, b: jnp.sum(weights * matmul(a, b))

    for argnums in (0, 1, (0, 1)):
        got = jax.grad(loss(ours), argnums=argnums)(a, b)
        want = jax.grad(loss(reference), argnums=argnums)(a, b)
        for g, w in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, want))):
            np.testing.assert_allclose(g, w, rtol=1e-12)
    transposes = {name: axes for name, axes in calls if name != "matmul_batched"}
    # B and the output cotangent, A and the output cotangent: every input at both levels
    assert transposes == {"matmul_T_A": ((3, 1), (2, 3)), "matmul_T_B": ((1, 0), (2, 3))}

    per_element = jax.vmap(
        jax.vmap(jax.grad(lambda a, b, w: jnp.sum(w * matmul_op(a, b)[0]), argnums=(0, 1)), in_axes=(0, 2, 0)),
        in_axes=(0, 1, 0),
    )
    want = jax.vmap(
        jax.vmap(jax.grad(lambda a, b, w: jnp.sum(w * (a @ b)), argnums=(0, 1)), in_axes=(0, 2, 0)), in_axes=(0, 1, 0)
    )(a, b, weights)
    for g, w in zip(per_element(a, b, weights), want):
        np.testing.assert_allclose(g, w, rtol=1e-12)


def scaled_sine(out, args, kwargs_dump):
    """w * sin(x) with w fixed, elementwise; batch axes of x last, w broadcast."""
    batch_axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"] or ((), ())
    CALLS.append(("scaled_sine", batch_axes))
    assert len(batch_axes) == len(args) == 2, batch_axes
    w, x = (batch_last(a, axes) for a, axes in zip(args, batch_axes))
    levels = x.ndim - w.ndim
    out[0][...] = w.reshape(w.shape + (1,) * levels) * np.sin(x)


def scaled_sine_jvp(out, args, kwargs_dump):
    """w * cos(x) * dx: the primals (w fixed, x), then the tangent of x."""
    batch_axes = jaxbind.load_kwargs(kwargs_dump)["batch_axes"] or ((), (), ())
    CALLS.append(("scaled_sine_jvp", batch_axes))
    assert len(batch_axes) == len(args) == 3, batch_axes
    w, x, dx = (batch_last(a, axes) for a, axes in zip(args, batch_axes))
    levels = x.ndim - w.ndim
    out[0][...] = w.reshape(w.shape + (1,) * levels) * np.cos(x) * dx


def scaled_sine_abstract(w, x, *tangents, batch_axes):
    if batch_axes is None:
        return ((x.shape, x.dtype),)
    return ((batch_last_shape(x.shape, batch_axes[1]), x.dtype, -1),)


scaled_sine_op = jaxbind.get_nonlinear_call(
    scaled_sine,
    (scaled_sine_jvp, scaled_sine_jvp),
    scaled_sine_abstract,
    scaled_sine_abstract,
    first_n_args_fixed=1,
    func_can_batch=True,
)


def test_func_can_batch_nonlinear_jvp_with_a_fixed_argument(rng, calls):
    # The jvp of a batched op: its inputs are the primals (the fixed w among them)
    # and the tangent of x, batched like x; w's batch axes are not repeated.
    w, xs, dxs = rng.standard_normal(4), rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    batched = jax.vmap(lambda x: scaled_sine_op(w, x)[0], in_axes=1, out_axes=1)
    y, dy = jax.jvp(batched, (xs,), (dxs,))
    np.testing.assert_allclose(y, w[:, None] * np.sin(xs), rtol=1e-12)
    np.testing.assert_allclose(dy, w[:, None] * np.cos(xs) * dxs, rtol=1e-12)
    assert calls == [("scaled_sine", ((), (1,))), ("scaled_sine_jvp", ((), (1,), (1,)))]

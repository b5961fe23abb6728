"""Demo 1: a *linear* jaxbind op wrapping ``scipy.fft.fftn``.

What you learn here
-------------------
* ``jaxbind.get_linear_call(f, f_T, abstract, abstract_T, func_can_batch=True)``
* how a callback writes into ``out`` and reads static kwargs via
  ``jaxbind.load_kwargs``;
* how a callback that can handle batch axes itself (``func_can_batch=True``)
  receives ``batch_axes`` and tells JAX where the output batch axis is;
* how to derive the transpose of a linear map under JAX's convention.

The transpose
-------------
``fftn`` with ``norm`` is ``y = s * F x`` where ``F`` is the (unnormalized) DFT
matrix, ``F[k, n] = exp(-2 pi i k n / N)``, and ``s`` a scalar: 1 for
"backward", 1/sqrt(N) for "ortho", 1/N for "forward".  JAX's transpose is the
plain matrix transpose (no complex conjugation): ``x_ct = (s F)^T y_ct``.
``F`` is symmetric (``F[k, n] = F[n, k]``), so ``(s F)^T = s F``: the transpose
of ``fftn(norm=...)`` is ``fftn`` with the *same* norm.  (The conjugate-
transpose, i.e. the adjoint, would instead be an inverse FFT; that is *not* what
JAX wants here.)  For a multi-dimensional FFT the same holds axis by axis.
"""

import jax

jax.config.update("jax_enable_x64", True)  # float64 / complex128 everywhere

import jax.numpy as jnp
import numpy as np
import scipy.fft
from _checks import check, finish, op_check

import jaxbind

# ---------------------------------------------------------------------------
# 1. The callbacks.  Signature: cb(out, args, kwargs_dump) -> None.
#    ``args`` is a tuple of read-only NumPy views, ``out`` a tuple of writable
#    NumPy arrays; the result must be written *into* out[i][...].
# ---------------------------------------------------------------------------


def _fft_axes(ndim, batch_axes):
    """The axes to transform: every axis that is not a batch axis.

    ``batch_axes`` is None when the op is not vmapped; otherwise a tuple with,
    per input, the tuple of that input's batch axes (one per vmap level).
    """
    skip = set(batch_axes[0]) if batch_axes is not None else set()
    return tuple(a for a in range(ndim) if a not in skip)


def fftn_fwd(out, args, kwargs_dump):
    kw = jaxbind.load_kwargs(kwargs_dump)  # {"norm": ..., "batch_axes": ...}
    (x,) = args
    axes = _fft_axes(x.ndim, kw["batch_axes"])
    out[0][...] = scipy.fft.fftn(x, axes=axes, norm=kw["norm"])


def fftn_T(out, args, kwargs_dump):
    # Transpose: receives the output cotangent, writes the input cotangent.
    # As derived above it is the same FFT with the same norm.  The batch axes
    # of the cotangent are those of the forward output, i.e. the same axes.
    kw = jaxbind.load_kwargs(kwargs_dump)
    (y_ct,) = args
    axes = _fft_axes(y_ct.ndim, kw["batch_axes"])
    out[0][...] = scipy.fft.fftn(y_ct, axes=axes, norm=kw["norm"])


# ---------------------------------------------------------------------------
# 2. The abstract: output shape and dtype from the input's shape and dtype.
#    With func_can_batch=True a third entry gives the output batch axis of the
#    *newest* vmap level (the last entry of each input's batch_axes).  The FFT
#    keeps the shape, so the output batch axis is the input's.
# ---------------------------------------------------------------------------


def fftn_abstract(x, *, norm, batch_axes):
    # The op maps complex -> complex of the same dtype (see ``fftn`` below for
    # real inputs).
    if not jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise TypeError(f"fftn_op needs a complex input, got {x.dtype}")
    if batch_axes is None:
        return ((x.shape, x.dtype),)
    return ((x.shape, x.dtype, batch_axes[0][-1]),)


# Both directions map an array to an array of the same shape, so the same
# abstract serves the forward and the transpose.
fftn_op = jaxbind.get_linear_call(fftn_fwd, fftn_T, fftn_abstract, fftn_abstract, func_can_batch=True)


def fftn(x, norm):
    """The user-facing function: the op returns a list of outputs.

    Real inputs are cast to complex *in JAX*, before the op.  A linear op's
    transpose only sees the output cotangent, so it cannot know that the input
    was real; if the op itself accepted real input, its transpose would hand a
    complex cotangent to a real input.  Casting outside lets JAX's own cast
    rule take the real part of the cotangent, as for ``jnp.fft.fftn``.
    """
    x = jnp.asarray(x)
    x = x.astype(jnp.result_type(x.dtype, jnp.complex64))
    (y,) = fftn_op(x, norm=norm)  # norm is a static keyword argument
    return y


# ---------------------------------------------------------------------------
# 3. Checks against jax.numpy
# ---------------------------------------------------------------------------

rng = np.random.default_rng(0)
shape = (4, 6, 5)
x = jnp.asarray(rng.normal(size=shape) + 1j * rng.normal(size=shape))  # complex128

for norm in ("backward", "ortho", "forward"):
    print(f"--- norm={norm!r}")
    ref = lambda v, axes=None: jnp.fft.fftn(v, axes=axes, norm=norm)

    # Value, eager and under jit (norm is static, so it is closed over).
    check("value", fftn(x, norm), ref(x))
    check("jit value", jax.jit(lambda v: fftn(v, norm))(x), ref(x))

    # Real input: promoted to complex by the abstract (and by scipy).
    xr = jnp.real(x)
    check("real input", fftn(xr, norm), ref(xr))

    # vmap: the callback sees batch_axes and transforms over the other axes.
    xb = jnp.stack([x, 2 * x, x[::-1]])  # batch of 3 along axis 0
    check("vmap in_axes=0", jax.vmap(lambda v: fftn(v, norm))(xb), ref(xb, axes=(1, 2, 3)))
    xb1 = jnp.moveaxis(xb, 0, 2)  # batch axis in the middle
    check(
        "vmap in_axes=2, out_axes=2",
        jax.vmap(lambda v: fftn(v, norm), in_axes=2, out_axes=2)(xb1),
        ref(xb1, axes=(0, 1, 3)),
    )
    # nested vmap: two batch levels, the callback gets two batch axes
    xbb = jnp.stack([xb, 1j * xb])  # (2, 3, 4, 6, 5)
    check("nested vmap", jax.vmap(jax.vmap(lambda v: fftn(v, norm)))(xbb), ref(xbb, axes=(2, 3, 4)))

    # Transpose: compare with JAX's own transpose of jnp.fft.fftn.
    ct = jnp.asarray(rng.normal(size=shape) + 1j * rng.normal(size=shape))
    (xt_ours,) = jax.linear_transpose(lambda v: fftn(v, norm), x)(ct)
    (xt_ref,) = jax.linear_transpose(ref, x)(ct)
    check("linear_transpose", xt_ours, xt_ref)
    check("transpose == fftn itself (symmetric DFT)", xt_ours, ref(ct))
    _, vjp = jax.vjp(lambda v: fftn(v, norm), x)
    check("vjp", vjp(ct)[0], jax.vjp(ref, x)[1](ct)[0])
    # vjp of the vmapped op (transpose with batch axes)
    ctb = jnp.stack([ct, -ct, 3 * ct])
    _, vjp_b = jax.vjp(jax.vmap(lambda v: fftn(v, norm)), xb)
    _, vjp_b_ref = jax.vjp(lambda v: ref(v, axes=(1, 2, 3)), xb)
    check("vjp of vmap", vjp_b(ctb)[0], vjp_b_ref(ctb)[0])

    # jvp (a linear op's jvp is the op applied to the tangent)
    t = jnp.asarray(rng.normal(size=shape) + 1j * rng.normal(size=shape))
    check("jvp", jax.jvp(lambda v: fftn(v, norm), (x,), (t,))[1], ref(t))

    # grad of a real loss (complex input: JAX's conj convention, same for both)
    loss = lambda v: jnp.sum(jnp.abs(fftn(v, norm)) ** 2 * jnp.arange(5.0))
    loss_ref = lambda v: jnp.sum(jnp.abs(ref(v)) ** 2 * jnp.arange(5.0))
    check("grad of real loss", jax.grad(loss)(x), jax.grad(loss_ref)(x))
    check("jit(grad) of real loss", jax.jit(jax.grad(loss))(x), jax.grad(loss_ref)(x))
    # real-valued input: the gradient must be real (see ``fftn``); here also
    # per-example gradients via jit(vmap(grad))
    lossr = lambda v: jnp.sum(jnp.imag(fftn(v, norm)) + jnp.abs(fftn(v, norm)) ** 2 * jnp.arange(5.0))
    lossr_ref = lambda v: jnp.sum(jnp.imag(ref(v)) + jnp.abs(ref(v)) ** 2 * jnp.arange(5.0))
    g = jax.grad(lossr)(xr)
    check("grad, real input (real dtype)", g, jax.grad(lossr_ref)(xr))
    xrb = jnp.real(xb)
    check("jit(vmap(grad)), real input", jax.jit(jax.vmap(jax.grad(lossr)))(xrb), jax.vmap(jax.grad(lossr_ref))(xrb))

    # jaxbind's op checker: abstract, transpose (dot-product test), batching, jit.
    op_check("check_op (complex128)", fftn_op, x, norm=norm)
    op_check("check_op (complex64)", fftn_op, x.astype(jnp.complex64), norm=norm)

finish()

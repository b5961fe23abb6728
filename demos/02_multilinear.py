"""Demo 2: a *multilinear* (here bilinear) jaxbind op with a fixed argument.

The op computes, with NumPy,

    y = A @ (w * x)        A: (m, n),  x: (n,),  w: (n,)  ->  y: (m,)

* ``w`` is a *fixed* argument (``first_n_args_fixed=1``): it is passed to every
  callback but never differentiated.
* ``y`` is linear in ``A`` for fixed ``x`` and linear in ``x`` for fixed ``A``:
  a bilinear map.  Passing a *tuple* of transposes to ``get_linear_call``, one
  per linear argument, makes a multilinear op; JAX can then take derivatives of
  any order (the derivative of a bilinear map is built from the map itself and
  its transposes).

Transposes (JAX convention: plain transpose, no conjugation), for an output
cotangent ``y_ct`` of shape (m,):

    A_ct = outer(y_ct, w * x)      # d<y_ct, A (w x)>/dA
    x_ct = w * (A.T @ y_ct)        # d<y_ct, A (w x)>/dx

``f_T[i]`` receives all op arguments except the i-th (fixed ones first, in
order), then the output cotangents:

    f_T[0] (for A) receives (w, x, y_ct)
    f_T[1] (for x) receives (w, A, y_ct)

This op does not set ``func_can_batch``: under ``vmap`` jaxbind loops over the
batch and calls the callbacks once per element, so they only ever see the
unbatched shapes above.
"""

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from _checks import check, check_raises, finish, op_check

import jaxbind

# ---------------------------------------------------------------------------
# Callbacks: cb(out, args, kwargs_dump); write into out[i][...], return None.
# ---------------------------------------------------------------------------


def matvec(out, args, kwargs_dump):
    w, A, x = args
    out[0][...] = A @ (w * x)


def matvec_T_A(out, args, kwargs_dump):  # cotangent of A
    w, x, y_ct = args
    out[0][...] = np.outer(y_ct, w * x)


def matvec_T_x(out, args, kwargs_dump):  # cotangent of x
    w, A, y_ct = args
    out[0][...] = w * (A.T @ y_ct)


# ---------------------------------------------------------------------------
# Abstracts: one (shape, dtype) pair per output, from the callback's inputs
# (objects with .shape and .dtype).
# ---------------------------------------------------------------------------


def matvec_abstract(w, A, x):
    if A.ndim != 2 or A.shape[1] != x.shape[0] or w.shape != x.shape:
        raise ValueError(f"bad shapes: w{w.shape}, A{A.shape}, x{x.shape}")
    return (((A.shape[0],), jnp.result_type(A.dtype, x.dtype, w.dtype)),)


def matvec_T_A_abstract(w, x, y_ct):
    return (((y_ct.shape[0], x.shape[0]), y_ct.dtype),)


def matvec_T_x_abstract(w, A, y_ct):
    return (((A.shape[1],), y_ct.dtype),)


op = jaxbind.get_linear_call(
    matvec,
    (matvec_T_A, matvec_T_x),  # a tuple of transposes: multilinear
    matvec_abstract,
    (matvec_T_A_abstract, matvec_T_x_abstract),
    first_n_args_fixed=1,  # w
)


def weighted_matvec(w, A, x):
    (y,) = op(w, A, x)  # the op returns a list of outputs
    return y


def weighted_matvec_ref(w, A, x):  # the jax.numpy reference
    return A @ (w * x)


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------

rng = np.random.default_rng(1)
m, n = 4, 3
w = jnp.asarray(rng.uniform(0.5, 2.0, size=n))
A = jnp.asarray(rng.normal(size=(m, n)))
x = jnp.asarray(rng.normal(size=n))

f = weighted_matvec
f_ref = weighted_matvec_ref

# value, eager and jitted
check("value", f(w, A, x), f_ref(w, A, x))
check("jit value", jax.jit(f)(w, A, x), f_ref(w, A, x))

# jvp with tangents in both linear arguments: dy = dA (w x) + A (w dx)
dA, dx = jnp.asarray(rng.normal(size=(m, n))), jnp.asarray(rng.normal(size=n))
check(
    "jvp (A and x)",
    jax.jvp(lambda a, v: f(w, a, v), (A, x), (dA, dx)),
    jax.jvp(lambda a, v: f_ref(w, a, v), (A, x), (dA, dx)),
)
check("jvp (x only)", jax.jvp(lambda v: f(w, A, v), (x,), (dx,)), jax.jvp(lambda v: f_ref(w, A, v), (x,), (dx,)))


# a nonlinear scalar loss of the bilinear output
def loss(A, x, f=f):
    return jnp.sum(jnp.sin(f(w, A, x))) + 0.5 * jnp.sum(f(w, A, x) ** 2)


loss_ref = lambda A, x: loss(A, x, f=f_ref)

check("grad wrt (A, x)", jax.grad(loss, argnums=(0, 1))(A, x), jax.grad(loss_ref, argnums=(0, 1))(A, x))
check("jit(grad) wrt (A, x)", jax.jit(jax.grad(loss, argnums=(0, 1)))(A, x), jax.grad(loss_ref, argnums=(0, 1))(A, x))

# second derivatives: the full Hessian in (A, x), forward-over-reverse and
# reverse-over-reverse.  This needs the transposes to be differentiable,
# which jaxbind gets from the multilinear structure.  (The reference is
# jitted only because eager jnp Hessians compile slowly, op by op.)
H_ref = jax.jit(jax.hessian(loss_ref, argnums=(0, 1)))(A, x)
check("hessian (jacfwd(jacrev))", jax.hessian(loss, argnums=(0, 1))(A, x), H_ref)
check("jit(jacrev(jacrev))", jax.jit(jax.jacrev(jax.jacrev(loss, argnums=(0, 1)), argnums=(0, 1)))(A, x), H_ref)
check("jit(hessian)", jax.jit(jax.hessian(loss, argnums=(0, 1)))(A, x), H_ref)

# vmap: over x only, over A only, over everything (w included), and nested
B = 5
xs = jnp.asarray(rng.normal(size=(B, n)))
As = jnp.asarray(rng.normal(size=(B, m, n)))
ws = jnp.asarray(rng.uniform(0.5, 2.0, size=(B, n)))
check("vmap over x", jax.vmap(f, (None, None, 0))(w, A, xs), jax.vmap(f_ref, (None, None, 0))(w, A, xs))
check(
    "vmap over A (in_axes=2)",
    jax.vmap(f, (None, 2, None))(w, jnp.moveaxis(As, 0, 2), x),
    jax.vmap(f_ref, (None, 0, None))(w, As, x),
)
check("vmap over w, A, x", jax.vmap(f)(ws, As, xs), jax.vmap(f_ref)(ws, As, xs))
check(
    "nested vmap",
    jax.vmap(jax.vmap(f, (None, None, 0)), (None, 0, None))(w, As, xs),
    jax.vmap(jax.vmap(f_ref, (None, None, 0)), (None, 0, None))(w, As, xs),
)

# per-example gradients (vmap of grad): cotangents of the un-batched A are
# summed correctly over the batch inside grad-of-sum
check(
    "vmap(grad) per example",
    jax.vmap(jax.grad(loss, argnums=(0, 1)), (None, 0))(A, xs),
    jax.vmap(jax.grad(loss_ref, argnums=(0, 1)), (None, 0))(A, xs),
)
batch_loss = lambda A, xs, loss=loss: jnp.sum(jax.vmap(loss, (None, 0))(A, xs))
check(
    "grad of a vmapped loss",
    jax.grad(batch_loss, argnums=(0, 1))(A, xs),
    jax.grad(lambda A, xs: batch_loss(A, xs, loss_ref), argnums=(0, 1))(A, xs),
)
check(
    "jit(vmap(hessian))",
    jax.jit(jax.vmap(jax.hessian(loss, argnums=(0, 1)), (0, 0)))(As, xs),
    jax.jit(jax.vmap(jax.hessian(loss_ref, argnums=(0, 1)), (0, 0)))(As, xs),
)

# The fixed argument w cannot be differentiated: jaxbind says so clearly.
check_raises("grad wrt fixed arg w", lambda: jax.grad(lambda w_: jnp.sum(f(w_, A, x)))(w), ValueError)

# jaxbind's op checker: a dot-product test of each transpose, batching, jit.
op_check("check_op", op, w, A, x)

finish()

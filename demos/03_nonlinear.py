"""Demo 3: a *nonlinear* jaxbind op with a fixed argument and a static kwarg.

The op evaluates, with NumPy (think: an external solver JAX cannot trace),

    y = x**p * exp(-c * x)          elementwise; x, c: (n,) arrays, p: static int

* ``c`` is a *fixed* argument (``first_n_args_fixed=1``): passed to every
  callback, never differentiated.
* ``p`` is a static keyword argument of the op call (``op(c, x, p=3)``); the
  callbacks get it back with ``jaxbind.load_kwargs``.
* We supply the derivative by hand, as a Jacobian-vector product ``f_jvp`` and
  a vector-Jacobian product ``f_vjp``.  With ``g(x) = dy/dx`` (diagonal here),

      dy/dx = (p x**(p-1) - c x**p) exp(-c x)
      f_jvp(c, x, dx)   -> dy   = g * dx         (tangents of non-fixed args)
      f_vjp(c, x, y_ct) -> x_ct = g * y_ct       (JAX convention: g^T y_ct)

  so JAX can use the op in forward mode (jvp, jacfwd) and reverse mode (grad,
  vjp, jacrev).  Nonlinear ops support *first-order* derivatives only.
"""

import functools

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from _checks import check, check_raises, failures, finish, op_check
from jax.test_util import check_grads

import jaxbind

# ---------------------------------------------------------------------------
# Callbacks: cb(out, args, kwargs_dump), writing into out[i][...].
# ---------------------------------------------------------------------------


def _dy_dx(c, x, p):
    return (p * x ** (p - 1) - c * x**p) * np.exp(-c * x)


def peak(out, args, kwargs_dump):
    c, x = args
    p = jaxbind.load_kwargs(kwargs_dump)["p"]
    out[0][...] = x**p * np.exp(-c * x)


def peak_jvp(out, args, kwargs_dump):
    c, x, dx = args  # (*primals, *tangents of the non-fixed args)
    p = jaxbind.load_kwargs(kwargs_dump)["p"]
    out[0][...] = _dy_dx(c, x, p) * dx


def peak_vjp(out, args, kwargs_dump):
    c, x, y_ct = args  # (*primals, *output cotangents)
    p = jaxbind.load_kwargs(kwargs_dump)["p"]
    out[0][...] = _dy_dx(c, x, p) * y_ct  # cotangent of x only (c is fixed)


# ---------------------------------------------------------------------------
# Abstracts.  ``abstract`` describes the outputs of ``peak`` *and* of
# ``peak_jvp`` (the output tangent looks like the output), so it is called
# with (c, x) and with (c, x, dx): accept extra arguments.  ``abstract_reverse``
# describes ``peak_vjp``'s output (the cotangent of x) from (c, x, y_ct).
# Keyword arguments of the call (here p) reach the abstracts too.
# ---------------------------------------------------------------------------


def peak_abstract(c, x, *tangents, p):
    if c.shape != x.shape:
        raise ValueError(f"c and x must have the same shape, got {c.shape} and {x.shape}")
    return ((x.shape, jnp.result_type(c.dtype, x.dtype)),)


def peak_abstract_reverse(c, x, y_ct, *, p):
    return ((x.shape, x.dtype),)


op = jaxbind.get_nonlinear_call(peak, (peak_jvp, peak_vjp), peak_abstract, peak_abstract_reverse, first_n_args_fixed=1)


def peak_fn(c, x, p=3):
    (y,) = op(c, x, p=p)
    return y


def peak_ref(c, x, p=3):  # jax.numpy reference
    return x**p * jnp.exp(-c * x)


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------

# This demo compares with a tighter absolute tolerance than the shared default.
check = functools.partial(check, atol=1e-12)

rng = np.random.default_rng(2)
n = 6
c = jnp.asarray(rng.uniform(0.5, 1.5, size=n))
x = jnp.asarray(rng.uniform(-1.0, 4.0, size=n))
dx = jnp.asarray(rng.normal(size=n))

for p in (3, 2):
    print(f"--- p={p}")
    f = lambda x_, c_=c: peak_fn(c_, x_, p)  # differentiate w.r.t. x only
    f_ref = lambda x_, c_=c: peak_ref(c_, x_, p)
    loss = lambda x_: jnp.sum(jnp.tanh(f(x_)))
    loss_ref = lambda x_: jnp.sum(jnp.tanh(f_ref(x_)))

    check("value", f(x), f_ref(x))
    check("jit value", jax.jit(f)(x), f_ref(x))
    check("jvp", jax.jvp(f, (x,), (dx,)), jax.jvp(f_ref, (x,), (dx,)))
    check("vjp", jax.vjp(f, x)[1](dx)[0], jax.vjp(f_ref, x)[1](dx)[0])
    check("grad", jax.grad(loss)(x), jax.grad(loss_ref)(x))
    check("jit(grad)", jax.jit(jax.grad(loss))(x), jax.grad(loss_ref)(x))
    check("jacfwd", jax.jacfwd(f)(x), jax.jacfwd(f_ref)(x))
    check("jacrev", jax.jacrev(f)(x), jax.jacrev(f_ref)(x))

    # derivative vs central finite differences (an independent reference)
    eps = 1e-6
    fd = (np.asarray(f_ref(x + eps * dx)) - np.asarray(f_ref(x - eps * dx))) / (2 * eps)
    check("jvp vs finite differences", jax.jvp(f, (x,), (dx,))[1], fd, rtol=1e-6, atol=1e-7)
    # JAX's own numerical gradient checker (finite differences, fwd and rev)
    try:
        check_grads(f, (x,), order=1, modes=("fwd", "rev"))
        check_grads(loss, (x,), order=1, modes=("fwd", "rev"))
        print(f"OK   {'check_grads(order=1, fwd+rev)':50s}")
    except AssertionError as err:
        print(f"FAIL check_grads: {err}")
        failures.append("check_grads")

    # vmap: over x (c shared), over both c and x, nested; the callbacks are
    # called once per batch element (func_can_batch is False)
    B = 4
    xs = jnp.asarray(rng.uniform(-1.0, 4.0, size=(B, n)))
    cs = jnp.asarray(rng.uniform(0.5, 1.5, size=(B, n)))
    check("vmap over x", jax.vmap(f)(xs), jax.vmap(f_ref)(xs))
    check("vmap over (x, c)", jax.vmap(f)(xs, cs), jax.vmap(f_ref)(xs, cs))
    check("vmap over x, in_axes=1", jax.vmap(f, in_axes=1)(xs.T), jax.vmap(f_ref)(xs))
    check(
        "nested vmap",
        jax.vmap(jax.vmap(f, (0, None)), (None, 0))(xs, cs),
        jax.vmap(jax.vmap(f_ref, (0, None)), (None, 0))(xs, cs),
    )
    check("jit(vmap(grad))", jax.jit(jax.vmap(jax.grad(loss)))(xs), jax.vmap(jax.grad(loss_ref))(xs))
    check(
        "vmap(jvp) over (x, c, dx)",
        jax.vmap(lambda x_, c_, t: jax.jvp(lambda v: f(v, c_), (x_,), (t,))[1])(xs, cs, xs[::-1]),
        jax.vmap(lambda x_, c_, t: jax.jvp(lambda v: f_ref(v, c_), (x_,), (t,))[1])(xs, cs, xs[::-1]),
    )
    # jaxbind's op checker: jvp against finite differences, vjp against jvp, batching, jit.
    op_check("check_op", op, c, x, p=p)

# What is *not* allowed, with clear errors:
# - differentiating the fixed argument c,
check_raises("grad wrt fixed arg c", lambda: jax.grad(lambda c_: jnp.sum(peak_fn(c_, x)))(c), ValueError)
# - second derivatives of a nonlinear op (only first order is provided).
check_raises("second derivative", lambda: jax.hessian(lambda x_: jnp.sum(peak_fn(c, x_)))(x), ValueError)

finish()

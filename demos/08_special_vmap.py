"""Demo 8: scipy.special functions as JAX ops, vmapped as one SciPy call per batch.

What you learn here
-------------------
* how to bind an elementwise black box (here ``scipy.special.kv`` and
  ``scipy.special.erfcx``) with its derivative, as a nonlinear op;
* how ``vmap_method="expand_dims"`` hands the whole batch to the callback in
  one call: every vmap level becomes a leading axis, of size 1 where an input
  is not mapped, so NumPy broadcasting does the rest; the callbacks stay
  one-liners and need no batch bookkeeping (compare ``func_can_batch``);
* that ``jit(vmap(grad))`` and nested ``vmap`` then make one SciPy call each.

The derivatives:

* ``d/dx K_v(x) = -(K_{v-1}(x) + K_{v+1}(x)) / 2`` (the recurrence of the modified
  Bessel function of the second kind), with the order ``v`` a fixed argument;
* ``d/dx erfcx(x) = 2 x erfcx(x) - 2 / sqrt(pi)``.

Both are checked against central finite differences of SciPy, and ``erfcx``
against its jax.numpy form ``exp(x^2) erfc(x)``.
"""

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
import scipy.special
from _checks import check, check_raises, failures, finish, op_check

import jaxbind

SEEN = []  # the input shapes of every callback call


# ---------------------------------------------------------------------------
# 1. K_v(x), differentiable in x, the order v fixed
# ---------------------------------------------------------------------------


def kv_prime(v, x):
    return -0.5 * (scipy.special.kv(v - 1, x) + scipy.special.kv(v + 1, x))


def per_element(v, x):
    """The order lined up with x: a scalar order per element gets x's element axes.

    Under expand_dims both arrays carry the same leading batch axes, then their
    element's axes; NumPy aligns trailing axes, so a scalar order (fewer axes)
    must be given x's trailing axes explicitly (check_op catches the mistake).
    """
    return v.reshape(v.shape + (1,) * (x.ndim - v.ndim))


def kv(out, args, kwargs_dump):
    SEEN.append(("kv", tuple(a.shape for a in args)))
    v, x = args
    scipy.special.kv(per_element(v, x), x, out=out[0])  # broadcasts over the batch axes


def kv_jvp(out, args, kwargs_dump):  # (v, x, dx)
    SEEN.append(("kv_jvp", tuple(a.shape for a in args)))
    v, x, dx = args
    out[0][...] = kv_prime(per_element(v, x), x) * dx


def kv_vjp(out, args, kwargs_dump):  # (v, x, ct); same product: the derivative is diagonal
    SEEN.append(("kv_vjp", tuple(a.shape for a in args)))
    v, x, ct = args
    out[0][...] = kv_prime(per_element(v, x), x) * ct


def kv_abstract(v, x, *tangents):  # one element
    if v.shape not in ((), x.shape):
        raise ValueError(f"the order must be a scalar or have x's shape {x.shape}, got {v.shape}")
    return ((x.shape, jnp.result_type(v.dtype, x.dtype)),)


def elementwise_abstract(x, *tangents):
    return ((x.shape, x.dtype),)


def kv_reverse_abstract(v, x, ct):
    return ((x.shape, x.dtype),)


kv_op = jaxbind.get_nonlinear_call(
    kv, (kv_jvp, kv_vjp), kv_abstract, kv_reverse_abstract, first_n_args_fixed=1, vmap_method="expand_dims"
)


def bessel_k(v, x):
    return kv_op(v, x)[0]


# ---------------------------------------------------------------------------
# 2. erfcx(x) = exp(x^2) erfc(x)
# ---------------------------------------------------------------------------


def erfcx(out, args, kwargs_dump):
    SEEN.append(("erfcx", tuple(a.shape for a in args)))
    scipy.special.erfcx(args[0], out=out[0])


def erfcx_derivative(out, args, kwargs_dump):  # jvp (x, dx) and vjp (x, ct) alike
    SEEN.append(("erfcx_derivative", tuple(a.shape for a in args)))
    x, t = args
    out[0][...] = (2 * x * scipy.special.erfcx(x) - 2 / np.sqrt(np.pi)) * t


def erfcx_reverse_abstract(x, ct):
    return ((x.shape, x.dtype),)


erfcx_op = jaxbind.get_nonlinear_call(
    erfcx, (erfcx_derivative, erfcx_derivative), elementwise_abstract, erfcx_reverse_abstract, vmap_method="expand_dims"
)


def scaled_erfc(x):
    return erfcx_op(x)[0]


# ---------------------------------------------------------------------------
# 3. Checks
# ---------------------------------------------------------------------------


def central_difference(f, x, h=1e-6):
    return (f(x + h) - f(x - h)) / (2 * h)


def check_calls(name, want):
    """The callbacks were called exactly as ``want`` says (name, input shapes)."""
    ok = SEEN == want
    print(f"{'OK  ' if ok else 'FAIL'} {name:50s} {SEEN if not ok else want}")
    if not ok:
        failures.append(name)
    SEEN.clear()


rng = np.random.default_rng(8)
x = jnp.asarray(rng.uniform(0.5, 5.0, 1000))
v = 1.5

print("--- K_v(x)")
check("value", bessel_k(v, x), scipy.special.kv(v, np.asarray(x)))
SEEN.clear()
check(
    "jit(vmap) over 1000 points (v shared)",
    jax.jit(jax.vmap(bessel_k, (None, 0)))(v, x),
    scipy.special.kv(v, np.asarray(x)),
)
check_calls("  ... one SciPy call, v with a size-1 batch axis", [("kv", ((1,), (1000,)))])

grad_k = jax.grad(bessel_k, argnums=1)
check(
    "grad at one point vs central differences",
    grad_k(v, x[0]),
    central_difference(lambda y: scipy.special.kv(v, y), float(x[0])),
    rtol=1e-7,
    atol=1e-9,
)
fd = central_difference(lambda y: scipy.special.kv(v, y), np.asarray(x))
SEEN.clear()
check("jit(vmap(grad)) vs central differences", jax.jit(jax.vmap(grad_k, (None, 0)))(v, x), fd, rtol=1e-7, atol=1e-9)
# (grad needs no forward value here, and the cotangent of each scalar is the
# same 1.0: not mapped, so a size-1 axis too)
check_calls("  ... one vjp call for 1000 gradients", [("kv_vjp", ((1,), (1000,), (1,)))])
check(
    "jit(vmap(jvp))",
    jax.jit(jax.vmap(lambda x: jax.jvp(lambda y: bessel_k(v, y), (x,), (2.0 * x,))[1]))(x),
    2.0 * np.asarray(x) * kv_prime(v, np.asarray(x)),
)
check_calls("  ... one jvp call", [("kv_jvp", ((1,), (1000,), (1000,)))])

# Nested vmap over orders and points: the order grid maps the outer level, the
# points the inner one; each callback sees both levels, size 1 where unmapped.
orders = jnp.asarray([0.0, 0.5, 1.5, 2.5])
table = jax.jit(jax.vmap(jax.vmap(bessel_k, (None, 0)), (0, None)))(orders, x[:50])
check(
    "nested vmap: K_v(x) for 4 orders x 50 points",
    table,
    scipy.special.kv(np.asarray(orders)[:, None], np.asarray(x[:50])[None, :]),
)
check_calls("  ... one call, shapes (4, 1) and (1, 50)", [("kv", ((4, 1), (1, 50)))])
grads = jax.jit(jax.vmap(jax.vmap(grad_k, (None, 0)), (0, None)))(orders, x[:50])
check(
    "nested vmap of grad vs the recurrence", grads, kv_prime(np.asarray(orders)[:, None], np.asarray(x[:50])[None, :])
)
check(
    "nested vmap of grad vs central differences",
    grads,
    central_difference(lambda y: scipy.special.kv(np.asarray(orders)[:, None], y), np.asarray(x[:50])[None, :]),
    rtol=1e-6,
    atol=1e-8,
)
SEEN.clear()

print("--- erfcx(x)")
xe = jnp.asarray(rng.uniform(-2.0, 3.0, 1000))
reference = lambda y: jnp.exp(y**2) * jax.scipy.special.erfc(y)
check("jit(vmap) vs exp(x^2) erfc(x) in jax.numpy", jax.jit(jax.vmap(scaled_erfc))(xe), reference(xe), rtol=1e-12)
check(
    "jit(vmap(grad)) vs jax.grad of the jax.numpy form",
    jax.jit(jax.vmap(jax.grad(scaled_erfc)))(xe),
    jax.vmap(jax.grad(reference))(xe),
    rtol=1e-11,
    atol=1e-12,
)
check(
    "jit(vmap(grad)) vs central differences",
    jax.jit(jax.vmap(jax.grad(scaled_erfc)))(xe),
    central_difference(scipy.special.erfcx, np.asarray(xe)),
    rtol=1e-7,
    atol=1e-9,
)
xs2 = xe.reshape(20, 50)
check(
    "nested vmap of grad (in_axes 1 inside)",
    jax.jit(jax.vmap(jax.vmap(jax.grad(scaled_erfc)), in_axes=1))(xs2),
    jax.vmap(jax.vmap(jax.grad(reference)), in_axes=1)(xs2),
    rtol=1e-11,
    atol=1e-12,
)
SEEN.clear()

print("--- jaxbind.testing.check_op")
op_check("check_op kv", kv_op, jnp.asarray([0.5, 1.5, 2.5]), jnp.asarray([0.7, 1.9, 4.0]))
op_check("check_op kv (scalar order)", kv_op, 1.5, jnp.asarray([0.7, 1.9, 4.0]))
op_check("check_op erfcx", erfcx_op, xe[:5])


def kv_unaligned(out, args, kwargs_dump):  # the mistake per_element avoids
    out[0][...] = scipy.special.kv(args[0], args[1])


unaligned_op = jaxbind.get_nonlinear_call(
    kv_unaligned,
    (kv_jvp, kv_vjp),
    kv_abstract,
    kv_reverse_abstract,
    first_n_args_fixed=1,
    vmap_method="expand_dims",
    name="kv_unaligned",
)
check_raises(
    "check_op catches a scalar order not lined up with x",
    lambda: jaxbind.testing.check_op(unaligned_op, 1.5, jnp.asarray([0.7, 1.9, 4.0])),
    AssertionError,
)
SEEN.clear()
finish()

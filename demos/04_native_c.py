"""Demo 4: a compiled C routine as a JAX op, called from XLA with no Python and no GIL.

What you learn here
-------------------
* how a C function is written against jaxbind's header (``jaxbind.h``), with
  keyword arguments and an error message;
* how it is compiled (here with the system C compiler) and loaded with ctypes;
* how it is bound as a nonlinear op with C jvp and vjp kernels, then jitted,
  differentiated and vmapped like any JAX function.

The routine: ``y = x**2 * exp(-gamma t) cos(omega t)`` at the time points ``t``
(a fixed argument), with ``gamma`` and ``omega`` as static kwargs; its
derivative in ``x`` is ``2 x exp(-gamma t) cos(omega t)``, diagonal, so one C
kernel serves as both jvp and vjp.
"""

import ctypes
import os
import shutil
import subprocess
import tempfile

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from _checks import check, check_raises, finish, op_check

import jaxbind

C_SOURCE = r"""
#include <math.h>
#include <jaxbind.h>

/* g(t) = exp(-gamma t) cos(omega t) */
static double envelope(double t, double gamma, double omega) {
  return exp(-gamma * t) * cos(omega * t);
}

static int check_inputs(const jaxbind_call *call, int n_in) {
  if (call->n_in != n_in || call->n_out != 1) return jaxbind_fail(call, "wrong arity");
  for (int i = 0; i < n_in; ++i)
    if (call->in[i].dtype != JAXBIND_FLOAT64)
      return jaxbind_fail(call, "input %d must be float64", i);
  if (jaxbind_size(&call->in[0]) != jaxbind_size(&call->in[1]))
    return jaxbind_fail(call, "t and x must have the same size");
  return 0;
}

/* y = x^2 g(t); inputs (t, x) */
int oscillator(const jaxbind_call *call) {
  if (check_inputs(call, 2)) return 1;
  const double gamma = jaxbind_kwarg_float(call, "gamma", 0.0);
  const double omega = jaxbind_kwarg_float(call, "omega", 1.0);
  const double *t = call->in[0].data, *x = call->in[1].data;
  double *y = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[0]); i < n; ++i)
    y[i] = x[i] * x[i] * envelope(t[i], gamma, omega);
  return 0;
}

/* jvp and vjp alike (the Jacobian is diagonal): inputs (t, x, v); out = 2 x g(t) v */
int oscillator_derivative(const jaxbind_call *call) {
  if (check_inputs(call, 3)) return 1;
  const double gamma = jaxbind_kwarg_float(call, "gamma", 0.0);
  const double omega = jaxbind_kwarg_float(call, "omega", 1.0);
  const double *t = call->in[0].data, *x = call->in[1].data, *v = call->in[2].data;
  double *out = call->out[0].data;
  for (int64_t i = 0, n = jaxbind_size(&call->in[0]); i < n; ++i)
    out[i] = 2.0 * x[i] * envelope(t[i], gamma, omega) * v[i];
  return 0;
}
"""


def build_library(folder):
    """Compile the C source into a shared library with the system compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise SystemExit("this demo needs a C compiler (cc, gcc or clang)")
    source = os.path.join(folder, "oscillator.c")
    library = os.path.join(folder, "liboscillator.so")
    with open(source, "w") as handle:
        handle.write(C_SOURCE)
    subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", f"-I{jaxbind.get_include()}", source, "-o", library, "-lm"], check=True
    )
    return ctypes.CDLL(library)


def abstract(t, x, *tangents, **kwargs):
    """y has the shape and dtype of x (for f and for the jvp alike)."""
    return ((x.shape, x.dtype),)


def abstract_reverse(t, x, cotangent, **kwargs):
    """The vjp returns the cotangent of x (t is fixed)."""
    return ((x.shape, x.dtype),)


def reference(t, x, gamma, omega):
    return x**2 * jnp.exp(-gamma * t) * jnp.cos(omega * t)


def main():
    folder = tempfile.mkdtemp(prefix="jaxbind-demo-")
    try:
        lib = build_library(folder)
        # C kernels passed straight from the ctypes library: jaxbind calls them from XLA.
        oscillator = jaxbind.get_nonlinear_call(
            lib.oscillator,
            (lib.oscillator_derivative, lib.oscillator_derivative),
            abstract,
            abstract_reverse,
            first_n_args_fixed=1,
        )

        def model(t, x):
            return oscillator(t, x, gamma=0.3, omega=2.0)[0]

        rng = np.random.default_rng(0)
        t = jnp.linspace(0.0, 5.0, 50)
        x = jnp.asarray(rng.standard_normal(50))
        want = reference(t, x, 0.3, 2.0)
        check("value", model(t, x), want)
        check("jit", jax.jit(model)(t, x), want)

        def loss(x, f):
            return jnp.sum(jnp.sin(f(t, x)))

        ref_model = lambda t, x: reference(t, x, 0.3, 2.0)
        check("grad", jax.grad(loss)(x, model), jax.grad(loss)(x, ref_model))
        check("jit(grad)", jax.jit(jax.grad(loss), static_argnums=1)(x, model), jax.grad(loss)(x, ref_model))
        dx = jnp.asarray(rng.standard_normal(50))
        check("jvp", jax.jvp(lambda x: model(t, x), (x,), (dx,)), jax.jvp(lambda x: ref_model(t, x), (x,), (dx,)))
        xs = jnp.asarray(rng.standard_normal((8, 50)))
        check(
            "vmap over x (the C handler walks the batch)",
            jax.vmap(model, in_axes=(None, 0))(t, xs),
            jax.vmap(ref_model, in_axes=(None, 0))(t, xs),
        )
        check(
            "jit(vmap(grad))",
            jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)), static_argnums=1)(xs, model),
            jax.vmap(jax.grad(loss), in_axes=(0, None))(xs, ref_model),
        )
        # jaxbind's op checker on the C kernels.
        op_check("check_op", oscillator, t, x, gamma=0.3, omega=2.0)
        # The kernel's own error message reaches Python, naming the op.
        check_raises(
            "float32 input rejected by the C code",
            lambda: jax.block_until_ready(model(t.astype(jnp.float32), x.astype(jnp.float32))),
            RuntimeError,
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()

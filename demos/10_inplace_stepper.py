"""Demo 10: a legacy C time stepper that updates its grid in place, run for thousands of steps.

What you learn here
-------------------
* how ``inplace={0: 0}`` tells XLA that output 0 is argument 0 updated where
  it stands, so that a loop over a large state costs what the routine costs;
* how a C routine written to work in place (and out of place: the transpose
  runs so) reads each value before it overwrites it;
* that the in-place op gives the same numbers, differentiates, and needs no
  second copy of the state: time and memory against the same kernel out of
  place, measured here.

The routine: one explicit step of the heat equation on an n x n grid with zero
boundary values, ``u <- u + r (u_N + u_S + u_E + u_W - 4 u)``, with a two-row
buffer so that it can overwrite ``u`` as it goes. The step is linear in ``u``
and symmetric (its own transpose), so it is a linear op whose transpose is the
same kernel.
"""

import ctypes
import os
import shutil
import subprocess
import tempfile
import time

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from _checks import check, finish, op_check

import jaxbind

C_SOURCE = r"""
#include <stdlib.h>
#include <string.h>
#include <jaxbind.h>

/* One explicit heat step of an n x n grid (zero values outside it). `in` and
 * `out` may be one array: row i of the result needs rows i-1, i and i+1 as
 * they were, and the two rows it would overwrite first are kept in `above`
 * and `row`. */
int heat_step(const jaxbind_call *call) {
  const jaxbind_array *in = &call->in[0];
  jaxbind_array *out = &call->out[0];
  if (in->dtype != JAXBIND_FLOAT64 || in->rank != 2) return jaxbind_fail(call, "u must be 2-d float64");
  const int64_t n = in->shape[0], m = in->shape[1];
  const double r = jaxbind_kwarg_float(call, "r", 0.2);
  const double *u = in->data;
  double *v = out->data;
  double *above = calloc((size_t)m, sizeof(double)), *row = malloc((size_t)m * sizeof(double));
  if (above == NULL || row == NULL) { free(above); free(row); return jaxbind_fail(call, "out of memory"); }
  for (int64_t i = 0; i < n; ++i) {
    memcpy(row, u + i * m, (size_t)m * sizeof(double));          /* row i as it was */
    const double *below = i + 1 < n ? u + (i + 1) * m : NULL;    /* not yet overwritten */
    for (int64_t j = 0; j < m; ++j) {
      const double west = j > 0 ? row[j - 1] : 0.0, east = j + 1 < m ? row[j + 1] : 0.0;
      const double south = below != NULL ? below[j] : 0.0;
      v[i * m + j] = row[j] + r * (above[j] + south + west + east - 4.0 * row[j]);
    }
    double *swap = above; above = row; row = swap;               /* row i becomes the row above */
  }
  free(above);
  free(row);
  return 0;
}
"""


def build_library(folder):
    """Compile the C source into a shared library with the system compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise SystemExit("this demo needs a C compiler (cc, gcc or clang)")
    source, library = os.path.join(folder, "heat.c"), os.path.join(folder, "libheat.so")
    with open(source, "w") as handle:
        handle.write(C_SOURCE)
    subprocess.run(
        [compiler, "-O2", "-shared", "-fPIC", f"-I{jaxbind.get_include()}", source, "-o", library], check=True
    )
    return ctypes.CDLL(library)


def same(u, **kwargs):
    return ((u.shape, u.dtype),)


def reference_step(u, r):
    padded = jnp.pad(u, 1)
    return u + r * (padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:] - 4 * u)


def seconds(fn, *args, repeats=1):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def main():
    folder = tempfile.mkdtemp(prefix="jaxbind-demo-")
    try:
        lib = build_library(folder)
        in_place = jaxbind.get_linear_call(lib.heat_step, lib.heat_step, same, same, inplace={0: 0}, name="heat_step")
        fresh = jaxbind.get_linear_call(lib.heat_step, lib.heat_step, same, same, name="heat_step_fresh")

        def run(op, steps):
            return jax.jit(lambda u: jax.lax.fori_loop(0, steps, lambda i, v: op(v, r=0.2)[0], u))

        n, steps = 1024, 1000
        x = jnp.linspace(-1.0, 1.0, n)
        u0 = jnp.exp(-20 * (x[:, None] ** 2 + x[None, :] ** 2))
        ref = jax.jit(lambda u: jax.lax.fori_loop(0, 50, lambda i, v: reference_step(v, 0.2), u))(u0)
        check("50 steps in place against jax.numpy", run(in_place, 50)(u0), ref)
        check("50 steps out of place against jax.numpy", run(fresh, 50)(u0), ref)
        check("the initial state is unchanged", u0, jnp.exp(-20 * (x[:, None] ** 2 + x[None, :] ** 2)))

        # Differentiated: the sensitivity of the heat at the centre after 50 steps to the initial state.
        def centre(op, u):
            return jax.lax.fori_loop(0, 50, lambda i, v: op(v, r=0.2)[0], u)[n // 2, n // 2]

        check(
            "grad in place against jax.numpy",
            jax.jit(jax.grad(lambda u: centre(in_place, u)))(u0),
            jax.jit(
                jax.grad(lambda u: jax.lax.fori_loop(0, 50, lambda i, v: reference_step(v, 0.2), u)[n // 2, n // 2])
            )(u0),
        )

        # jaxbind's op checker: the transpose against the forward, vmap, jit (on a small grid).
        op_check("check_op", in_place, u0[::64, ::64], r=0.2)

        # Time and memory of the long run, in place and out of place.
        mib = u0.nbytes / 2**20
        for label, op in (("in place", in_place), ("out of place", fresh)):
            fn = run(op, steps)
            took = seconds(fn, u0)
            memory = fn.lower(u0).compile().memory_analysis()
            temp = getattr(memory, "temp_size_in_bytes", 0) / 2**20 if memory is not None else float("nan")
            print(
                f"{steps} steps of {n}x{n} ({mib:.0f} MiB), {label:12}: {took / steps * 1e6:7.0f} us per "
                f"step, {temp:5.1f} MiB of XLA temporaries"
            )
        np.testing.assert_allclose(run(in_place, steps)(u0), run(fresh, steps)(u0), rtol=1e-12)
        print("check: the long runs agree ... ok")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()

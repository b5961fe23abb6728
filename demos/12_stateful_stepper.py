"""Demo 12: a stateful C time stepper, its state in static variables, stepped inside ``lax.scan``.

What you learn here
-------------------
* how ``effect="ordered"`` tells XLA that an op's calls have side effects
  and must run in program order: never dropped when the result is unused,
  never merged when two calls look equal, never run two at a time;
* how a legacy routine that keeps its state between calls (static variables
  in C, ``SAVE`` or ``COMMON`` in Fortran) is stepped inside a jitted
  ``lax.scan`` and gives the numbers of the same loop in plain Python;
* that an op with an effect has no derivatives and no vmap (refused, naming
  the op);
* how ``jaxbind.io_callback``, a drop-in for ``jax.experimental.io_callback``,
  steps a stateful Python object the same way.

The routine: one classical Runge-Kutta step of the Lorenz system, forced by
``u`` in its first equation, advancing the state ``(x, y, z)`` it keeps in
static variables and counting its steps; a second routine resets the state.
Compiled with ``-ffp-contract=off``, the C code does exactly the operations
of the Python loop, so the trajectories are equal bit for bit, although the
system is chaotic.
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
from _checks import check, check_raises, failures, finish
from jax.experimental import io_callback as jax_io_callback

import jaxbind

C_SOURCE = r"""
#include <stdint.h>
#include <jaxbind.h>

/* The state of the legacy code: set by lorenz_reset, advanced by lorenz_step. */
static double state[3];
static int64_t steps_taken;

static void rhs(const double *s, double u, double *d) {
  d[0] = 10.0 * (s[1] - s[0]) + u;
  d[1] = s[0] * (28.0 - s[2]) - s[1];
  d[2] = s[0] * s[1] - 8.0 / 3.0 * s[2];
}

/* in: the new state (3,); out: the same. */
int lorenz_reset(const jaxbind_call *call) {
  const double *s0 = call->in[0].data;
  double *out = call->out[0].data;
  for (int i = 0; i < 3; ++i) out[i] = state[i] = s0[i];
  steps_taken = 0;
  return 0;
}

/* in: the forcing u (a scalar); kwarg dt; out: the state after one RK4 step. */
int lorenz_step(const jaxbind_call *call) {
  if (call->in[0].dtype != JAXBIND_FLOAT64) return jaxbind_fail(call, "u must be float64");
  const double u = *(const double *)call->in[0].data, dt = jaxbind_kwarg_float(call, "dt", 0.01);
  double k1[3], k2[3], k3[3], k4[3], t[3];
  rhs(state, u, k1);
  for (int i = 0; i < 3; ++i) t[i] = state[i] + 0.5 * dt * k1[i];
  rhs(t, u, k2);
  for (int i = 0; i < 3; ++i) t[i] = state[i] + 0.5 * dt * k2[i];
  rhs(t, u, k3);
  for (int i = 0; i < 3; ++i) t[i] = state[i] + dt * k3[i];
  rhs(t, u, k4);
  double *out = call->out[0].data;
  for (int i = 0; i < 3; ++i) out[i] = state[i] += dt / 6.0 * (k1[i] + 2.0 * k2[i] + 2.0 * k3[i] + k4[i]);
  steps_taken += 1;
  return 0;
}

int64_t lorenz_steps_taken(void) { return steps_taken; }
"""

DT, STEPS = 0.01, 2000


class Lorenz:
    """The same stepper in Python, its state in the object: the plain loop, and an io_callback's target."""

    def reset(self, s0):
        self.state, self.steps_taken = [float(v) for v in s0], 0
        return np.array(self.state)

    @staticmethod
    def rhs(s, u):
        return [10.0 * (s[1] - s[0]) + u, s[0] * (28.0 - s[2]) - s[1], s[0] * s[1] - 8.0 / 3.0 * s[2]]

    def step(self, u, dt=DT):
        s, u = self.state, float(u)
        k1 = self.rhs(s, u)
        k2 = self.rhs([s[i] + 0.5 * dt * k1[i] for i in range(3)], u)
        k3 = self.rhs([s[i] + 0.5 * dt * k2[i] for i in range(3)], u)
        k4 = self.rhs([s[i] + dt * k3[i] for i in range(3)], u)
        self.state = [s[i] + dt / 6.0 * (k1[i] + 2.0 * k2[i] + 2.0 * k3[i] + k4[i]) for i in range(3)]
        self.steps_taken += 1
        return np.array(self.state)


def build_library(folder):
    """Compile the C source into a shared library with the system compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise SystemExit("this demo needs a C compiler (cc, gcc or clang)")
    source, library = os.path.join(folder, "lorenz.c"), os.path.join(folder, "liblorenz.so")
    with open(source, "w") as handle:
        handle.write(C_SOURCE)
    flags = ["-O2", "-ffp-contract=off", "-shared", "-fPIC", f"-I{jaxbind.get_include()}"]
    subprocess.run([compiler, *flags, source, "-o", library], check=True)
    lib = ctypes.CDLL(library)
    lib.lorenz_steps_taken.restype = ctypes.c_int64
    return lib


def simulation(reset, step):
    """A jitted program: reset the stepper (its result unused), then step it once per forcing value."""

    def run(s0, forcing):
        reset(s0)
        return jax.lax.scan(lambda carry, u: (carry, step(u)), None, forcing)[1]

    return jax.jit(run)


def per_step(fn, *args):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / STEPS * 1e6


def main():
    folder = tempfile.mkdtemp(prefix="jaxbind-demo-")
    try:
        lib = build_library(folder)
        like = lambda x, **kwargs: ((x.shape, x.dtype),)
        three = lambda u, **kwargs: (((3,), u.dtype),)
        reset = jaxbind.get_nonlinear_call(lib.lorenz_reset, None, like, None, effect="ordered", name="lorenz_reset")
        step = jaxbind.get_nonlinear_call(lib.lorenz_step, None, three, None, effect="ordered", name="lorenz_step")
        s0, forcing = np.array([1.0, 1.0, 1.0]), 2.0 * np.sin(0.05 * np.arange(STEPS))
        print(f"Lorenz system, {STEPS} RK4 steps of {DT} in lax.scan, its state in C static variables")

        python = Lorenz()
        python.reset(s0)
        want = np.array([python.step(u) for u in forcing])  # the plain Python loop
        c_run = simulation(lambda s: reset(s), lambda u: step(u, dt=DT)[0])
        check("C stepper in lax.scan = the Python loop (bitwise)", c_run(s0, forcing), want, rtol=0, atol=0)
        check("again: the reset runs first (program order)", c_run(s0, forcing), want, rtol=0, atol=0)
        taken = lib.lorenz_steps_taken()
        jax.block_until_ready(jax.jit(lambda u: (step(u), u)[1])(0.0))  # its result unused
        jax.jit(lambda u: step(u)[0] + step(u)[0])(0.0)  # two equal calls
        jax.effects_barrier()
        print(f"steps counted in C: {taken}; after an unused step and two equal ones: {lib.lorenz_steps_taken()}")
        if (taken, lib.lorenz_steps_taken()) != (STEPS, STEPS + 3):
            failures.append("steps counted in C")
        check_raises(
            "grad through the ordered op", lambda: jax.grad(lambda f: c_run(s0, f)[-1, 0])(forcing), ValueError
        )
        check_raises("vmap of the ordered op", lambda: jax.vmap(lambda u: step(u)[0])(forcing[:4]), ValueError)

        # A stateful Python object, through jaxbind.io_callback and, for comparison, JAX's own.
        obj, shape = Lorenz(), jax.ShapeDtypeStruct((3,), jnp.float64)
        for label, io_callback in (("jaxbind.io_callback", jaxbind.io_callback), ("jax io_callback", jax_io_callback)):
            run = simulation(
                lambda s: io_callback(obj.reset, shape, s, ordered=True),
                lambda u: io_callback(obj.step, shape, u, ordered=True),
            )
            check(f"Python object through {label} = the loop", run(s0, forcing), want, rtol=0, atol=0)
            print(f"  per step, {label:22}: {per_step(run, s0, forcing):7.1f} us")
        print(f"  per step, {'the C op':22}: {per_step(c_run, s0, forcing):7.1f} us")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()

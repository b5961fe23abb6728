"""Stateful callbacks for the effect tests: a native C kernel keeping its state in static variables
and a Python object doing the same, with the same semantics, and the plain NumPy loop both are
checked against.

Both keep a running total: a call on ``x`` adds its elements one by one to the total and writes the
total after each (``out = total_before + cumsum(x)``), appends ``x``'s elements to a log, and counts how
many calls are inside at once (``most_inside``: more than 1 means two threads ran it at once). With
the kwarg ``wait`` (seconds) a call waits that long for a second call to come in (so that an overlap,
when allowed, is seen); with ``fail_on`` it fails, before touching its state, on an element equal to
it. The C source is compiled once per process (cached by a hash in the temporary folder) against the
header of the jaxbind under test, as ``tests/_kernels.py`` compiles the test kernels.
"""

import ctypes
import functools
import hashlib
import os
import shlex
import subprocess
import tempfile
import threading
import time

import numpy as np

import jaxbind

SOURCE = r"""
#include <stdint.h>
#include <time.h>
#include <jaxbind.h>

#define LOG_MAX 65536
static double total, log_values[LOG_MAX];
static int64_t n_log;
static int inside, most_inside;

int jbfx_running_total(const jaxbind_call *call) {
  const jaxbind_array *x = &call->in[call->n_in - 1];
  if (x->dtype != JAXBIND_FLOAT64) return jaxbind_fail(call, "running_total: x must be float64");
  const int64_t n = jaxbind_size(x);
  const double *xs = x->data;
  double *ys = call->out[0].data;
  int now = __atomic_add_fetch(&inside, 1, __ATOMIC_SEQ_CST);
  int seen = __atomic_load_n(&most_inside, __ATOMIC_SEQ_CST);
  while (now > seen && !__atomic_compare_exchange_n(&most_inside, &seen, now, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  const double wait = jaxbind_kwarg_float(call, "wait", 0.0);
  for (double waited = 0.0; waited < wait && __atomic_load_n(&inside, __ATOMIC_SEQ_CST) < 2; waited += 1e-3) {
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
  }
  int status = 0;
  if (jaxbind_find_kwarg(call, "fail_on") != NULL) {
    const double bad = jaxbind_kwarg_float(call, "fail_on", 0.0);
    for (int64_t i = 0; i < n; ++i)
      if (xs[i] == bad) status = jaxbind_fail(call, "running_total: got a %g", bad);
  }
  for (int64_t i = 0; status == 0 && i < n; ++i) {
    total += xs[i];
    ys[i] = total;
    if (n_log < LOG_MAX) log_values[n_log++] = xs[i];
  }
  __atomic_sub_fetch(&inside, 1, __ATOMIC_SEQ_CST);
  return status;
}

void jbfx_reset(void) { total = 0.0; n_log = 0; inside = 0; most_inside = 0; }
int64_t jbfx_log(double *dst, int64_t room) {
  for (int64_t i = 0; i < n_log && i < room; ++i) dst[i] = log_values[i];
  return n_log;
}
int jbfx_most_inside(void) { return most_inside; }
double jbfx_total(void) { return total; }
"""


def _command(source, output):
    compiler = shlex.split(os.environ.get("CC") or "cc")
    flags = ["-O2", "-std=gnu99", "-Wall", "-shared", "-fPIC", "-pthread"] + shlex.split(os.environ.get("CFLAGS", ""))
    return compiler + flags + ["-I", jaxbind.get_include(), source, "-o", output]


@functools.lru_cache(None)
def load():
    """The compiled C kernel as a ``ctypes.CDLL`` (compiled on first use in a process)."""
    with open(os.path.join(jaxbind.get_include(), "jaxbind.h"), "rb") as f:
        key = hashlib.sha256(SOURCE.encode() + f.read() + " ".join(_command("", "")).encode()).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"jaxbind-effects-kernels-{os.getuid()}")
    os.makedirs(folder, exist_ok=True)
    library = os.path.join(folder, f"effects-{key}.so")
    if not os.path.exists(library):
        source = os.path.join(folder, f"effects-{key}-{os.getpid()}.c")
        partial = library + f".{os.getpid()}.part"
        with open(source, "w") as f:
            f.write(SOURCE)
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        done = subprocess.run(_command(source, partial), env=env, capture_output=True, text=True)
        os.unlink(source)
        if done.returncode != 0:
            raise RuntimeError(f"compiling the effect kernels failed:\n{done.stdout}{done.stderr}")
        os.replace(partial, library)
    lib = ctypes.CDLL(library)
    lib.jbfx_log.restype = ctypes.c_int64
    lib.jbfx_log.argtypes = [ctypes.POINTER(ctypes.c_double), ctypes.c_int64]
    lib.jbfx_total.restype = ctypes.c_double
    return lib


class Native:
    """The C kernel's state, read and reset through ctypes."""

    def __init__(self):
        self.lib = load()
        self.kernel = self.lib.jbfx_running_total

    def reset(self):
        self.lib.jbfx_reset()

    def log(self):
        n = self.lib.jbfx_log(None, 0)
        buffer = (ctypes.c_double * max(n, 1))()
        self.lib.jbfx_log(buffer, n)
        return list(buffer[:n])

    def most_inside(self):
        return self.lib.jbfx_most_inside()


class Python:
    """The same running total in Python: the callback ``kernel(out, args, kwargs_dump)``."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.total, self.values, self.inside, self.most = 0.0, [], 0, 0
        self.lock = threading.Lock()

    def kernel(self, out, args, kwargs_dump=None):
        kwargs = {} if kwargs_dump is None else jaxbind.load_kwargs(kwargs_dump)
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        try:
            deadline = time.monotonic() + kwargs.get("wait", 0.0)
            while self.inside < 2 and time.monotonic() < deadline:
                time.sleep(1e-3)  # releases the GIL: another thread may come in
            x = np.asarray(args[-1], dtype=np.float64).ravel()
            if "fail_on" in kwargs and np.any(x == kwargs["fail_on"]):
                raise ValueError(f"running_total: got a {kwargs['fail_on']:g}")
            ys = out[0].reshape(-1)
            for i, value in enumerate(x):
                self.total += value
                ys[i] = self.total
                self.values.append(float(value))
        finally:
            with self.lock:
                self.inside -= 1

    def log(self):
        return list(self.values)

    def most_inside(self):
        return self.most


def reference(calls, total=0.0):
    """What a sequence of calls on the arrays ``calls`` returns, in a plain Python loop: a list of outputs."""
    outputs = []
    for x in calls:
        x = np.asarray(x, dtype=np.float64)
        y = np.empty(x.size)
        for i, value in enumerate(x.ravel()):
            total += value
            y[i] = total
        outputs.append(y.reshape(x.shape))
    return outputs


def plain(st):
    """``st``'s Python callback as a function of arrays, for ``jax.experimental.io_callback``."""

    def call(x):
        out = np.empty(np.shape(x), np.float64)
        st.kernel([out], [np.asarray(x)])
        return out

    return call


def like(*args, **kwargs):
    return ((args[-1].shape, args[-1].dtype),)


def state(kind):
    return Native() if kind == "native" else Python()

"""Soak test: many threads calling a mix of ops for a while, then exits while calls run.

    python bench/soak.py [--seconds 30] [--threads 8] [--exits 5]

Phase 1: ``--threads`` threads call a mix of ops (a Python linear op eager and
jitted, a nonlinear op under grad, a vmapped op, a native kernel, programs
big enough for XLA's worker threads), a tenth of them with inputs that make the
callback raise, each result checked against NumPy. Phase 2: ``--exits``
child processes run the same mix and exit (sys.exit) while programs are still
running callbacks on XLA's threads. Prints the calls, the expected and
unexpected errors, wrong results, the RSS growth after warm-up, and the exit
status of each child; exits non-zero when anything is off.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxbind

jax.config.update("jax_enable_x64", True)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
import _kernels

LIB = _kernels.load()


def same_shape(*args, **kwargs):
    return ((args[-1].shape, args[-1].dtype),)


def scale(out, args, kwargs_dump):
    """factor * x; raises for a negative first element (the failing calls)."""
    if args[-1].size and args[-1].reshape(-1)[0] < 0:
        raise ValueError("negative input (on purpose)")
    np.multiply(args[-1], jaxbind.load_kwargs(kwargs_dump).get("factor", 2.0), out=out[0])


def cube(out, args, kwargs_dump):
    if args[0].size and args[0].reshape(-1)[0] < 0:
        raise ValueError("negative input (on purpose)")
    np.power(args[0], 3, out=out[0])


def cube_jvp(out, args, kwargs_dump):
    out[0][...] = 3 * args[0] ** 2 * args[1]


linear = jaxbind.get_linear_call(scale, scale, same_shape, same_shape)
nonlinear = jaxbind.get_nonlinear_call(cube, (cube_jvp, cube_jvp), same_shape, same_shape)
native = jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_scale, same_shape, same_shape)

linear_jit = jax.jit(lambda x: linear(x, factor=3.0)[0])
cube_grad = jax.jit(jax.grad(lambda x: jnp.sum(nonlinear(x)[0])))
vmapped = jax.jit(jax.vmap(lambda x: linear(x, factor=0.5)[0]))
native_jit = jax.jit(lambda x: native(x, factor=4.0)[0])
wide = jax.jit(lambda x, y: (linear(x, factor=3.0)[0], jnp.sin(y) @ jnp.cos(y).T))  # XLA's worker threads
BIG = jnp.ones((200, 200))

# name -> (call, NumPy reference); every call takes a float64 array of shape (4, 3)
MIX = {
    "eager": (lambda x: linear(x, factor=2.0)[0], lambda x: 2 * x),
    "jit": (linear_jit, lambda x: 3 * x),
    "grad": (cube_grad, lambda x: 3 * x**2),
    "vmap": (vmapped, lambda x: 0.5 * x),
    "native": (native_jit, lambda x: 4 * x),
    "worker": (lambda x: wide(x, BIG)[0], lambda x: 3 * x),
}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Counts:
    def __init__(self):
        self.lock = threading.Lock()
        self.calls = self.expected_errors = self.unexpected_errors = self.wrong = 0
        self.examples = []

    def add(self, **kinds):
        with self.lock:
            for kind, n in kinds.items():
                setattr(self, kind, getattr(self, kind) + n)


def one_call(rng, counts: Counts):
    name = list(MIX)[rng.integers(len(MIX))]
    call, reference = MIX[name]
    x = rng.uniform(0.5, 2.0, (4, 3))
    # grad drops the forward call (its value is unused), so only these can fail on purpose
    fail = name in ("eager", "jit", "vmap", "worker") and rng.random() < 0.1
    if fail:
        x[0, 0] = -1.0
    try:
        y = np.asarray(call(jnp.asarray(x)))
    except Exception as err:  # the failing callbacks: (RuntimeError, ValueError), see README
        ok = fail and "negative input (on purpose)" in str(err)
        counts.add(calls=1, **{"expected_errors" if ok else "unexpected_errors": 1})
        if not ok and len(counts.examples) < 3:
            counts.examples.append(f"{name}: {type(err).__name__}: {str(err)[:200]}")
        return
    good = not fail and np.allclose(y, reference(x), rtol=1e-12)
    counts.add(calls=1, **{"wrong": 0 if good else 1})
    if not good and len(counts.examples) < 3:
        counts.examples.append(f"{name}: {'no error for a failing input' if fail else 'wrong value'}")


def run_threads(n_threads: int, seconds: float, counts: Counts, stop: threading.Event):
    def worker(seed):
        rng = np.random.default_rng(seed)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not stop.is_set():
            one_call(rng, counts)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(n_threads)]
    for t in threads:
        t.start()
    return threads


def child(n_threads: int):
    """Run the mix for a second, then exit while programs still run callbacks."""
    counts, stop = Counts(), threading.Event()
    threads = run_threads(n_threads, 60.0, counts, stop)
    time.sleep(1.0)
    stop.set()
    pending = [wide(jnp.ones((4, 3)), BIG) for _ in range(4)]  # noqa: F841  (not waited for)
    for t in threads:
        t.join()
    print(
        f"child: {counts.calls} calls, {counts.unexpected_errors} unexpected errors, {counts.wrong} wrong", flush=True
    )
    sys.exit(0 if counts.unexpected_errors == counts.wrong == 0 else 3)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--exits", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.threads)

    warmup = Counts()
    rng = np.random.default_rng(0)
    for _ in range(200):  # compile everything, settle the allocator
        one_call(rng, warmup)
    rss_before = rss_bytes()
    counts = Counts()
    started = time.monotonic()
    for t in run_threads(args.threads, args.seconds, counts, threading.Event()):
        t.join()
    elapsed = time.monotonic() - started
    rss_after = rss_bytes()

    print(f"jaxbind soak: {args.threads} threads, {elapsed:.1f} s, jax {jax.__version__}")
    print(f"  calls               {counts.calls:>10,}  ({counts.calls / elapsed:,.0f}/s)")
    print(f"  expected errors     {counts.expected_errors:>10,}  (callbacks failing on purpose)")
    print(f"  unexpected errors   {counts.unexpected_errors:>10,}")
    print(f"  wrong results       {counts.wrong:>10,}")
    print(f"  RSS after warm-up   {rss_before / 2**20:>10.1f} MiB")
    print(f"  RSS growth          {(rss_after - rss_before) / 2**20:>10.1f} MiB")
    for example in counts.examples:
        print("  e.g.", example)

    statuses = []
    for _ in range(args.exits):
        run = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", "--threads", str(args.threads)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        statuses.append(run.returncode)
        if run.returncode != 0:
            print("  child stderr:", run.stderr[-1500:])
    print(f"  exit while calls run: exit statuses {statuses}")
    bad = counts.unexpected_errors or counts.wrong or any(statuses)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

"""Programs that outlive the process, and ops that die with their last user: measured.

Run:  python bench/persistence.py [--quick] [--json bench/persistence.json]

1. Compile time, cold against warm (JAX's persistent compilation cache). A
   program of ~40 jax.numpy operations around a jaxbind op (forward and grad),
   and the same program with the op replaced by the jax.numpy function it
   computes. Each measurement is a fresh process: "cold" with an empty cache
   folder, "warm" with the folder a cold process filled. The time is that of
   the first call (trace, lower, compile or load, run) minus that of a second
   call. Cold and warm processes of both programs are interleaved; medians.
2. Memory per op created and dropped: in one process per kind, N ops made by a
   factory (each capturing a 1 KiB array), each called once eagerly and once
   under jit, then dropped; the growth of the resident set per op, after a
   warm-up of N/10 ops. Against ``jax.pure_callback`` doing the same.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.abspath(__file__)


def _child_compile(kind: str, cache: str) -> None:
    import time

    import jax

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import jax.numpy as jnp

    import jaxbind

    def scale(out, args, kwargs_dump):
        out[0][...] = 3.0 * args[0]

    like = lambda x: ((x.shape, x.dtype),)
    op = jaxbind.get_linear_call(scale, scale, like, like, name="bench_scale")
    middle = (lambda v: op(v)[0]) if kind == "op" else (lambda v: 3.0 * v)

    def program(v):
        for k in range(10):
            v = jnp.sin(v) * (1.0 + 0.01 * k) + jnp.cos(v) ** 2 - jnp.tanh(v) / (2.0 + k)
        return jnp.sum(middle(v) ** 2)

    fn = jax.jit(jax.value_and_grad(program))
    x = jnp.linspace(0.0, 1.0, 64)
    start = time.perf_counter()
    jax.block_until_ready(fn(x))
    first = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(fn(x))
    second = time.perf_counter() - start
    print(json.dumps({"seconds": first - second}))


def _child_memory(kind: str, n: int) -> None:
    import gc

    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxbind

    like = lambda x: ((x.shape, x.dtype),)

    def make(k):
        captured = np.full(128, float(k))  # 1 KiB the callback captures
        if kind == "jaxbind":

            def apply(out, args, kwargs_dump):
                out[0][...] = captured[0] * args[0]

            op = jaxbind.get_linear_call(apply, apply, like, like, name=f"op{k}")
            return lambda v: op(v)[0]

        def apply(v):
            return captured[0] * np.asarray(v)

        return lambda v: jax.pure_callback(apply, jax.ShapeDtypeStruct(v.shape, v.dtype), v)

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    x = jnp.ones(4)

    def churn(count):
        for k in range(count):
            f = make(k)
            jax.block_until_ready(f(x))  # eager
            jax.block_until_ready(jax.jit(lambda v: f(v) + 1)(x))  # under jit  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
            del f
        gc.collect()

    churn(max(n // 10, 10))  # warm-up: JAX's own caches fill
    before = rss()
    churn(n)
    print(json.dumps({"bytes_per_op": (rss() - before) / n}))


def _run(*args) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, HERE, *map(str, args)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(done.stdout + done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    n_ops = 300 if args.quick else 2000

    times = {(kind, state): [] for kind in ("op", "plain") for state in ("cold", "warm")}
    with tempfile.TemporaryDirectory() as root:
        for r in range(repeats):
            for kind in ("op", "plain"):
                cache = os.path.join(root, f"{kind}{r}")
                times[kind, "cold"].append(_run("--child-compile", kind, cache)["seconds"])
                times[kind, "warm"].append(_run("--child-compile", kind, cache)["seconds"])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"compile time (first call minus second), median of {repeats} fresh processes each:")
    print(f"{'program':<28}{'cold ms':>10}{'warm ms':>10}{'warm/cold':>11}")
    for kind, label in (("op", "with a jaxbind op"), ("plain", "same, jax.numpy only")):
        cold, warm = med[kind, "cold"], med[kind, "warm"]
        print(f"{label:<28}{cold * 1e3:>10.1f}{warm * 1e3:>10.1f}{warm / cold:>11.3f}")

    memory = {kind: _run("--child-memory", kind, n_ops)["bytes_per_op"] for kind in ("jaxbind", "pure_callback")}
    print(f"\nresident memory per op created, called (eager and jit) and dropped, {n_ops} ops:")
    for kind, value in memory.items():
        print(f"{kind:<28}{value / 1024:>10.1f} KiB")

    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "compile_seconds": {f"{k}/{s}": v for (k, s), v in times.items()},
                    "median_seconds": {f"{k}/{s}": v for (k, s), v in med.items()},
                    "bytes_per_op": memory,
                    "n_ops": n_ops,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child-compile":
        _child_compile(sys.argv[2], sys.argv[3])
    elif len(sys.argv) > 1 and sys.argv[1] == "--child-memory":
        _child_memory(sys.argv[2], int(sys.argv[3]))
    else:
        main()

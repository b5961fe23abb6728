"""Scaling: a vmapped native kernel over every core, and a vmapped op over a sharded batch.

Run:  python bench/scaling.py [--quick] [--json bench/results-scaling.json]

(a) Every core. A native kernel of ~100-200 µs per element (``jb_busy``), vmapped over 64
    elements (one custom call whose walk jaxbind spreads over XLA's intra-op thread pool),
    against the same 64 single calls in a ``lax.fori_loop`` (one after the other), in one run;
    and the same for an element of well under a microsecond (``jb_double`` on 4 numbers), where
    the walk must not be slower than the loop. Each timing is the median of interleaved
    repetitions of one whole jitted call after a warm-up.
(b) Partitioned batches. In a subprocess with 4 forced CPU devices: ``jit(vmap(op))`` over a
    (64, 1000) batch sharded along the batch, against the unpartitioned call (the same batch
    constrained to be replicated first, so that every device computes all 64 elements, which is
    what every call did before partitioning), for a Python callback and a native kernel:
    callback calls (counted after ``block_until_ready``) and time per call.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from _timing import median_seconds

import jaxbind

sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
import _kernels

KERNELS = _kernels.load()


def same_shape(x, **kwargs):
    return ((x.shape, x.dtype),)


busy_op = jaxbind.get_linear_call(KERNELS.jb_busy, KERNELS.jb_busy, same_shape, same_shape)
double_op = jaxbind.get_linear_call(KERNELS.jb_double, KERNELS.jb_double, same_shape, same_shape)


def every_core(repeats):
    rows = []
    cases = [
        ("~150 µs kernel (jb_busy)", busy_op, dict(iterations=9000), (64, 4)),
        ("<1 µs kernel (jb_double, 4 numbers)", double_op, {}, (64, 4)),
    ]
    for label, op, kwargs, shape in cases:
        x = jnp.asarray(np.random.default_rng(0).standard_normal(shape))
        walk = jax.jit(jax.vmap(lambda r: op(r, **kwargs)[0]))

        def body(i, c):
            return c.at[i].set(op(c[i], **kwargs)[0])

        loop = jax.jit(lambda a: jax.lax.fori_loop(0, shape[0], body, a))
        np.testing.assert_allclose(walk(x), loop(x), rtol=1e-12)
        t_walk, t_loop = median_seconds([lambda: walk(x), lambda: loop(x)], repeats)
        rows.append(
            dict(case=label, elements=shape[0], vmap_us=t_walk * 1e6, loop_us=t_loop * 1e6, ratio=t_walk / t_loop)
        )
    return rows


# ---------------------------------------------------------------------------
# (b): runs in a subprocess with 4 forced devices
# ---------------------------------------------------------------------------

CALLS = []  # one entry per callback call (list.append is atomic across the devices' threads)


def counted_sin(out, args, kwargs_dump):
    CALLS.append(1)
    np.sin(args[0], out=out[0])


def partitioned(repeats):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharded, whole = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    x = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal((64, 1000))), sharded)
    python_op = jaxbind.get_linear_call(counted_sin, counted_sin, same_shape, same_shape)
    rows = []
    for label, op, kwargs in [
        ("Python callback (np.sin on 1000)", python_op, {}),
        ("native kernel (jb_busy, ~50 µs)", busy_op, dict(iterations=3000)),
    ]:
        per_element = jax.vmap(lambda r: op(r, **kwargs)[0])
        split = jax.jit(per_element)
        gathered = jax.jit(lambda a: per_element(jax.lax.with_sharding_constraint(a, whole)))
        np.testing.assert_allclose(split(x), gathered(x), rtol=1e-12)
        calls = []
        for fn in (split, gathered):
            CALLS.clear()
            jax.block_until_ready(fn(x))
            calls.append(len(CALLS))
        t_split, t_gathered = median_seconds([lambda: split(x), lambda: gathered(x)], repeats)
        rows.append(
            dict(
                case=label,
                devices=4,
                batch=64,
                partitioned_calls=calls[0] if op is python_op else None,
                unpartitioned_calls=calls[1] if op is python_op else None,
                all_gather_partitioned="all-gather" in split.lower(x).compile().as_text(),
                partitioned_ms=t_split * 1e3,
                unpartitioned_ms=t_gathered * 1e3,
                ratio=t_split / t_gathered,
            )
        )
    return rows


def run_partitioned_subprocess(repeats):
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    out = subprocess.run(
        [sys.executable, __file__, "--partitioned-only", "--repeats", str(repeats)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results-scaling.json"))
    parser.add_argument("--partitioned-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    repeats = args.repeats or (5 if args.quick else 15)
    if args.partitioned_only:
        print(json.dumps(partitioned(repeats)))
        return
    cores = every_core(repeats)
    parts = run_partitioned_subprocess(repeats)
    print(
        f"Machine: {os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"Python {platform.python_version()}, jax {jax.__version__}\n"
    )
    print("(a) vmap of a native kernel over 64 elements against 64 single calls in a fori_loop")
    print("| kernel | vmap, µs | loop, µs | vmap / loop |\n|---|---:|---:|---:|")
    for r in cores:
        print(f"| {r['case']} | {r['vmap_us']:.0f} | {r['loop_us']:.0f} | {r['ratio']:.2f} |")
    print("\n(b) jit(vmap(op)) over a (64, 1000) batch sharded over 4 CPU devices, against the unpartitioned call")
    print("| op | callback calls (partitioned / not) | all-gather | partitioned, ms | not, ms | ratio |")
    print("|---|---:|---|---:|---:|---:|")
    for r in parts:
        calls = f"{r['partitioned_calls']} / {r['unpartitioned_calls']}" if r["partitioned_calls"] is not None else "—"
        print(
            f"| {r['case']} | {calls} | {'yes' if r['all_gather_partitioned'] else 'no'} | "
            f"{r['partitioned_ms']:.2f} | {r['unpartitioned_ms']:.2f} | {r['ratio']:.2f} |"
        )
    with open(args.json, "w") as f:
        json.dump(dict(every_core=cores, partitioned=parts, jax=jax.__version__, cores=os.cpu_count()), f, indent=1)


if __name__ == "__main__":
    main()

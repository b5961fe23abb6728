"""One process of test_effects_persist.py: an ordered op's program through jax.export and JAX's
persistent compilation cache, each in fresh processes.

    python _effects_job.py export BLOB    serialize the ordered program to BLOB
    python _effects_job.py import BLOB    define the ops (same names), deserialize BLOB, run it twice
    python _effects_job.py cache DIR      run the ordered program twice with DIR as JAX's persistent cache

The program: six calls of an ordered op on independent inputs, the first ones made late by work
before them, then a ``lax.scan`` of three more; once with a Python callback, once with the native
kernel (both keep a running total: ``_effects_kernels.py``). The last line printed is a JSON object
saying, per op, whether the calls ran in program order with the results of the same loop in Python.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax
import jax.experimental

jax.config.update("jax_enable_x64", True)

import jax.export
import jax.numpy as jnp
import numpy as np
from _effects_kernels import like, reference, state

import jaxbind

XS = np.arange(1.0, 13.0).reshape(6, 2)
STEPS = np.arange(20.0, 26.0).reshape(3, 2)
Y = np.linspace(0.0, 1.0, 240 * 240).reshape(240, 240)
EXPECTED_LOG = list(XS.ravel()) + list(STEPS.ravel())


def define():
    ops = {}
    for kind in ("python", "native"):
        st = state(kind)
        st.reset()
        op = jaxbind.get_nonlinear_call(st.kernel, None, like, None, effect="ordered", name=f"ordered_total_{kind}")
        ops[kind] = (st, op)
    return ops


def program(op):
    def run(xs, steps, y):
        outs = [op(xs[i] + 0.0 * jnp.sum(jnp.sin(y[: 40 * (6 - i)]) @ jnp.cos(y).T))[0] for i in range(6)]
        _, scanned = jax.lax.scan(lambda c, v: (c, op(v)[0]), 0.0, steps)
        return jnp.stack(outs), scanned

    return jax.jit(run)


def check(st, runs):
    """Whether the runs' results and the log are the loop's, run after run."""
    want = reference((list(XS) + list(STEPS)) * len(runs))
    got = [row for outs, scanned in runs for row in list(np.asarray(outs)) + list(np.asarray(scanned))]
    return {
        "log_in_order": st.log() == EXPECTED_LOG * len(runs),
        "results": all(np.array_equal(g, w) for g, w in zip(got, want)),
    }


def export_run(path):
    blobs = {}
    for kind, (_, op) in define().items():
        args = [jax.ShapeDtypeStruct(a.shape, jnp.float64) for a in (XS, STEPS, Y)]
        blobs[kind] = jaxbind.export(program(op))(*args)
    with open(path, "wb") as f:
        f.write(json.dumps({k: v.serialize().hex() for k, v in blobs.items()}).encode())
    return {kind: {"ordered_effects": len(e.ordered_effects)} for kind, e in blobs.items()}


def import_run(path):
    ops = define()
    with open(path, "rb") as f:
        blobs = json.loads(f.read())
    result = {}
    for kind, (st, _) in ops.items():
        exported = jax.export.deserialize(bytearray.fromhex(blobs[kind]))
        runs = [exported.call(XS, STEPS, Y) for _ in range(2)]  # the second dispatched before the first ends
        jax.effects_barrier()
        result[kind] = check(st, runs)
    return result


def cache_run(folder):
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
    )
    result = {}
    for kind, (st, op) in define().items():
        before, fn = len(hits), program(op)
        runs = [fn(XS, STEPS, Y) for _ in range(2)]  # the second dispatched before the first ends
        jax.effects_barrier()
        result[kind] = {**check(st, runs), "hit": len(hits) > before}
    # The reference: whether JAX caches a program with its own ordered io_callback (from jax 0.11 on)
    before = len(hits)
    reference = jax.jit(lambda x: jax.experimental.io_callback(lambda v: np.asarray(v) + 1, x, x, ordered=True))
    jax.block_until_ready(reference(np.arange(3.0)))
    result["jax"] = {"hit": len(hits) > before}
    return result


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    out = {"export": export_run, "import": import_run, "cache": cache_run}[mode](path)
    print(json.dumps(out), flush=True)

"""One process of test_effects_threads.py, on 4 forced CPU devices (XLA_FLAGS set by the test).

    python _effects_sharded.py threads          most calls of an op inside at once, per op
    python _effects_sharded.py raise [WORD...]  after a failing call, the next calls' results (of the
                                                cases named by every WORD: python, io, shard_map...)
    python _effects_sharded.py 37587 IMPL       jax-ml/jax#37587: shard_map, an ordered io_callback
                                                that raises on a 5; IMPL is "jaxbind" or "jax"
    python _effects_sharded.py last HOW EFFECT WHERE
                                                the script's last call fails and it ends: HOW is "op"
                                                or "io_callback", EFFECT "io" or "ordered", WHERE "jit"
                                                or "shard_map"

The last line printed is a JSON object; "done" is written to stderr when the script's work is over,
so that the test reads what is printed at exit alone.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]  # _effects_kernels; tests/: _shared

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from _effects_kernels import like, reference, state
from _shared import shard_map
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxbind

MESH = Mesh(np.array(jax.devices()[:4]), ("x",))
KINDS, EFFECTS = ("python", "native"), ("io", "ordered")


def make(kind, effect, **flags):
    st = state(kind)
    st.reset()
    name = f"total_{kind}_{effect}" + ("_safe" if flags.get("thread_safe") else "")
    return st, jaxbind.get_nonlinear_call(st.kernel, None, like, None, effect=effect, name=name, **flags)


def sharded(op, **kwargs):
    return jax.jit(shard_map(lambda v: op(v, **kwargs)[0], mesh=MESH, in_specs=P("x"), out_specs=P("x")))


def consistent(outs, log, xs, total=0.0):
    """Whether the outputs are what the calls (the rows of xs) give in the order the log shows them
    run, from the running total ``total``."""
    rows = [list(r) for r in np.asarray(xs)]
    calls = [log[i : i + len(rows[0])] for i in range(0, len(log), len(rows[0]))]
    if sorted(calls) != sorted(rows):
        return False
    outs = np.asarray(outs).reshape(len(rows), -1)
    want = reference(calls, total)
    return all(np.array_equal(outs[rows.index(c)], w) for c, w in zip(calls, want))


def threads():
    result = {}
    xs = np.arange(1.0, 9.0).reshape(4, 2)  # four calls of 2 elements
    for kind in KINDS:
        for effect in EFFECTS:
            for safe in (False, True):
                if safe and effect == "ordered":
                    continue
                st, op = make(kind, effect, thread_safe=safe)
                # Several independent calls in one program, then one call per device under shard_map.
                many = jax.jit(lambda a, b, c, d: [op(v, wait=0.2)[0] for v in (a, b, c, d)])
                outs = many(*xs)
                jax.effects_barrier()
                ok_many = consistent(outs, st.log(), xs)
                in_one_program = st.most_inside()
                st.reset()
                outs = sharded(op, wait=0.2)(xs.ravel())
                jax.effects_barrier()
                result[f"{kind}_{effect}" + ("_safe" if safe else "")] = {
                    "one_program": in_one_program,
                    "shard_map": st.most_inside(),
                    "ok": ok_many and consistent(outs, st.log(), xs),
                }
    return result


def raise_then_run(only=()):
    """The cases (kind, effect, where) whose names hold every word of ``only``."""
    result = {}
    for kind in KINDS:
        for effect in EFFECTS:
            for where in ("jit", "shard_map"):
                if not all(word in (kind, effect, where) for word in only):
                    continue
                st, op = make(kind, effect)
                if where == "jit":
                    program = jax.jit(lambda v: op(v, fail_on=5.0)[0])
                else:
                    program = sharded(op, fail_on=5.0)
                first, bad, after = np.arange(4.0), np.arange(4.0, 8.0), np.arange(8.0, 12.0)
                shape = (1, 4) if where == "jit" else (4, 1)  # the calls: one, or one per device
                outs = program(first)
                jax.effects_barrier()
                got = {"first_ok": consistent(outs, st.log(), first.reshape(shape))}
                try:
                    jax.block_until_ready(program(bad))
                    got["error"] = None
                except Exception as err:  # what is raised is the result
                    got["error"] = f"{type(err).__name__}: {err}"[-1500:]
                try:  # nothing is left behind for the barrier
                    jax.effects_barrier()
                    got["barrier_error"] = None
                except Exception as err:
                    got["barrier_error"] = f"{type(err).__name__}: {err}"[-1500:]
                before = st.log()
                try:
                    outs = program(after)
                    got["after"] = np.asarray(outs).tolist()
                    got["stale_error"] = None
                except Exception as err:
                    # jaxlib 0.5's CPU client now and then fails this program over several devices with the
                    # failure of the one before (test_effects_threads.py): recorded, the case ends.
                    got["stale_error"] = f"{type(err).__name__}: {err}"[-1500:]
                    result[f"{kind}_{effect}_{where}"] = got
                    continue
                jax.effects_barrier()
                got["after_ok"] = consistent(outs, st.log()[len(before) :], after.reshape(shape), float(sum(before)))
                result[f"{kind}_{effect}_{where}"] = got
    return result


def jax_37587(impl):
    """The reproducer of jax-ml/jax#37587, with JAX's io_callback or jaxbind's."""
    if impl == "jax":
        from jax.experimental import io_callback
    else:
        io_callback = jaxbind.io_callback
    seen = []

    def callback(x):
        x = np.asarray(x)
        seen.append(x.tolist())
        if (x == 5).any():
            raise ValueError("got a 5")
        return x * 2

    def body(v):
        return io_callback(callback, jax.ShapeDtypeStruct(v.shape, v.dtype), v, ordered=True)

    f = jax.jit(shard_map(body, mesh=MESH, in_specs=P("x"), out_specs=P("x")))
    results = []
    for start in (0, 4, 8, 12):
        try:
            results.append(np.asarray(f(jnp.arange(start, start + 4.0))).tolist())
        except Exception as err:
            results.append(f"{type(err).__name__}: {err}"[-1500:])
    return {"results": results, "seen": sorted(v for s in seen for v in s)}


def fails_last(how, effect, where):
    """A call that works, then one that fails, as the script's last."""
    st = state("python")
    if how == "op":
        op = jaxbind.get_nonlinear_call(st.kernel, None, like, None, effect=effect, name="fails_last")
        body = lambda v: op(v, fail_on=5.0)[0]
    else:

        def callback(v):
            if (np.asarray(v) == 5).any():
                raise ValueError("running_total: got a 5")
            return np.asarray(v) * 2

        body = lambda v: jaxbind.io_callback(
            callback, jax.ShapeDtypeStruct(v.shape, v.dtype), v, ordered=effect == "ordered"
        )
    program = jax.jit(body if where == "jit" else shard_map(body, mesh=MESH, in_specs=P("x"), out_specs=P("x")))
    result = {"first": np.asarray(program(np.arange(4.0))).tolist()}
    try:
        jax.block_until_ready(program(np.arange(4.0, 8.0)))
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {err}"[-1500:]
    return result


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "threads":
        out = threads()
    elif mode == "raise":
        out = raise_then_run(sys.argv[2:])
    elif mode == "last":
        out = fails_last(*sys.argv[2:5])
    else:
        out = jax_37587(sys.argv[2])
    print(json.dumps(out), flush=True)
    print("done", file=sys.stderr, flush=True)

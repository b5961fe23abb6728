"""One process of the persistence tests (test_persistence.py runs it in fresh subprocesses).

    python _persistence_job.py cache DIR VARIANT   compile and run programs with DIR as JAX's
                                                   persistent cache; print per program whether
                                                   its compilation was a cache hit and correct
    python _persistence_job.py export BLOB         serialize a program (forward and vjp) to BLOB
    python _persistence_job.py import BLOB DEFINE  deserialize BLOB and run it, eager, jitted and
                                                   differentiated, having defined the ops
                                                   (DEFINE: "all", "none", "dup")

The last line printed is a JSON object. VARIANT changes the Python callback's code
(not its op): "a" computes factor * x, "b" factor * x + 1.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: _kernels

import jax
import jax.export
import jax.numpy as jnp
import numpy as np

import jaxbind

MODE = sys.argv[1]
VARIANT = sys.argv[3] if MODE == "cache" else "a"
OFFSET = {"a": 0.0, "b": 1.0}[VARIANT]
like = lambda *args, **kwargs: ((args[-1].shape, args[-1].dtype),)


def scale(out, args, kwargs_dump):
    factor = jaxbind.load_kwargs(kwargs_dump)["factor"]
    out[0][...] = factor * args[-1] + OFFSET


def scale_T(out, args, kwargs_dump):
    out[0][...] = jaxbind.load_kwargs(kwargs_dump)["factor"] * args[-1]


def sin_with_residual(out, args, kwargs_dump):  # y = sin x, residual cos x
    out[0][...] = np.sin(args[0])
    out[1][...] = np.cos(args[0])


def sin_jvp(out, args, kwargs_dump):  # (x, cos x, dx)
    out[0][...] = args[1] * args[2]


def sin_vjp(out, args, kwargs_dump):  # (x, cos x, ct)
    out[0][...] = args[1] * args[2]


def define_ops(define="all"):
    ops = {}
    if define == "none":
        return ops
    if define == "dup":  # a second op of the same name, defined first
        ops["other"] = jaxbind.get_linear_call(scale_T, scale_T, like, like, name="scale")
    ops["unrelated"] = jaxbind.get_linear_call(scale_T, scale_T, like, like, name="unrelated")
    ops["sin"] = jaxbind.get_nonlinear_call(
        sin_with_residual,
        (sin_jvp, sin_vjp),
        lambda x: ((x.shape, x.dtype), (x.shape, x.dtype)),
        lambda x, residual, ct: ((x.shape, x.dtype),),
        name="sin_res",
        n_residuals=1,
    )
    ops["scale"] = jaxbind.get_linear_call(scale, scale_T, like, like, name="scale")
    return ops


def emit(result):
    print(json.dumps(result))


def cache_run(folder):
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None
    )
    from _kernels import load

    native = jaxbind.get_linear_call(load().jb_scale, load().jb_scale, like, like, name="native_scale")
    ops = define_ops()
    scale_op, sin = ops["scale"], ops["sin"]
    x = np.linspace(-1.0, 1.0, 12).reshape(4, 3)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("b",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("b"))
    programs = {
        "forward": (jax.jit(lambda v: scale_op(v, factor=3.0)[0]), x, 3.0 * x + OFFSET),
        "native": (jax.jit(lambda v: native(v, factor=-1.5)[0]), x, -1.5 * x),
        "grad_with_residuals": (jax.jit(jax.grad(lambda v: jnp.sum(sin(v)[0]))), x, np.cos(x)),
        "vmap": (jax.jit(jax.vmap(lambda v: scale_op(v, factor=2.0)[0])), x, 2.0 * x + OFFSET),
        "sharded_walk": (
            jax.jit(jax.vmap(lambda v: scale_op(v, factor=5.0)[0]), in_shardings=sharded),
            x,
            5.0 * x + OFFSET,
        ),
        "eager": (lambda v: scale_op(v, factor=7.0)[0], x, 7.0 * x + OFFSET),
    }
    result = {}
    for name, (fn, arg, expected) in programs.items():
        before = len(hits)
        value = np.asarray(fn(jnp.asarray(arg)))
        result[name] = {
            "hit": len(hits) > before,
            "ok": bool(np.allclose(value, expected, rtol=1e-12)),
            "error": float(np.max(np.abs(value - expected))),
        }
    text = programs["sharded_walk"][0].lower(jnp.asarray(x)).compile().as_text()
    result["partitioned"] = "[2,3]" in text or "f64[2,3]" in text  # each device walks its half
    return result


def export_run(path):
    ops = define_ops()
    scale_op, sin = ops["scale"], ops["sin"]
    fn = jax.jit(lambda v: jnp.sum(sin(scale_op(v, factor=3.0)[0])[0] ** 2))
    exported = jaxbind.export(fn)(jax.ShapeDtypeStruct((4, 3), jnp.float64))
    with open(path, "wb") as f:
        f.write(exported.serialize(vjp_order=1))
    return {"made": True}


def import_run(path, define):
    ops = define_ops(define)  # noqa: F841  (defined, so that the program resolves them)
    with open(path, "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    x = np.linspace(-1.0, 1.0, 12).reshape(4, 3)
    expected = np.sum(np.sin(3 * x) ** 2)
    expected_grad = 2 * np.sin(3 * x) * np.cos(3 * x) * 3
    try:
        eager = float(exported.call(jnp.asarray(x)))
        jitted = float(jax.jit(exported.call)(jnp.asarray(x)))
        grad = np.asarray(jax.jit(jax.grad(exported.call))(jnp.asarray(x)))
    except Exception as err:  # the test reads the message
        return {"error": f"{type(err).__name__}: {err}"}
    return {
        "eager": bool(abs(eager - expected) <= 1e-12 * abs(expected)),
        "jitted": bool(abs(jitted - expected) <= 1e-12 * abs(expected)),
        "grad": bool(np.allclose(grad, expected_grad, rtol=1e-12, atol=1e-14)),
    }


if __name__ == "__main__":
    jax.config.update("jax_enable_x64", True)
    if MODE == "cache":
        emit(cache_run(sys.argv[2]))
    elif MODE == "export":
        emit(export_run(sys.argv[2]))
    else:
        emit(import_run(sys.argv[2], sys.argv[3]))

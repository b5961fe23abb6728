"""Multi-device cases, run in a subprocess with its own forced CPU device count.

``python tests/_multidevice_cases.py [SHARD N_SHARDS]`` (with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
in its environment, set before JAX starts) runs every case in ``CASES`` and prints one JSON object:
``{case: {"ok": bool, "message": str}}``. ``test_multidevice.py`` runs it once and turns each
entry into a test. Every case compares a jaxbind op under a transformation with the same
transformation of a pure ``jax.numpy`` reference, or expects a specific error.

Each op is applied as ``body(x, w)``: ``x`` is the differentiated argument, ``w`` a second one
(the fixed argument, the other factor, ...). Inside ``shard_map`` each device holds a (2, 4)
block of ``x`` and of ``w``; an argument is sharded over the mesh or replicated.
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import sys
import time
import traceback

import _kernels
import jax
import jax.numpy as jnp
import numpy as np
from _shared import shard_map
from jax.sharding import PartitionSpec as P

import jaxbind

if __name__ == "__main__":  # the subprocess (test_multidevice.py imports this file too)
    # Hung: print every thread's stack and exit, before test_multidevice.py's limit kills this process.
    faulthandler.dump_traceback_later(float(os.environ.get("JAXBIND_TEST_CHILD_TIMEOUT", 660)), exit=True)

jax.config.update("jax_enable_x64", True)

LIB = _kernels.load()
Auto = jax.sharding.AxisType.Auto
set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh  # (jax.set_mesh from 0.7 on)

# ---------------------------------------------------------------------------
# The ops, each with its jax.numpy reference
# ---------------------------------------------------------------------------

CALLS = []  # one entry per callback call of the counted op (list.append is atomic across devices' threads)


def _like_last(*args, **kwargs):
    return ((args[-1].shape, args[-1].dtype),)


def _scale(out, args, kwargs_dump):
    np.multiply(args[0], 2.0, out=out[0])


def _counted_scale(out, args, kwargs_dump):
    CALLS.append(1)
    np.multiply(args[0], 2.0, out=out[0])


def _multiply(out, args, kwargs_dump):  # w * x, linear in x with w fixed, bilinear in (w, x)
    np.multiply(args[0], args[1], out=out[0])


def _wsin(out, args, kwargs_dump):  # w * sin(x)
    np.multiply(args[0], np.sin(args[1]), out=out[0])


def _wsin_derivative(out, args, kwargs_dump):  # jvp (w, x, t) and vjp (w, x, ct) alike
    np.multiply(args[0] * np.cos(args[1]), args[2], out=out[0])


def _batched_triple(out, args, kwargs_dump):  # func_can_batch: elementwise, axes kept
    np.multiply(args[0], 3.0, out=out[0])


def _batched_abstract(x, *, batch_axes=None):
    axis = batch_axes[0][-1] if batch_axes else None
    return ((x.shape, x.dtype, axis),)


linear_op = jaxbind.get_linear_call(_scale, _scale, _like_last, _like_last)
counted_op = jaxbind.get_linear_call(_counted_scale, _counted_scale, _like_last, _like_last)
fixed_op = jaxbind.get_linear_call(_multiply, _multiply, _like_last, _like_last, first_n_args_fixed=1)
bilinear_op = jaxbind.get_linear_call(_multiply, (_multiply, _multiply), _like_last, (_like_last, _like_last))
nonlinear_op = jaxbind.get_nonlinear_call(
    _wsin, (_wsin_derivative, _wsin_derivative), _like_last, _like_last, first_n_args_fixed=1
)
batching_op = jaxbind.get_linear_call(
    _batched_triple, _batched_triple, _batched_abstract, _batched_abstract, func_can_batch=True
)
native_op = jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_scale, _like_last, _like_last)
native_busy = jaxbind.get_linear_call(LIB.jb_busy, LIB.jb_busy, _like_last, _like_last)

# kind -> (jaxbind body, reference body, linear in x)
KINDS = {
    "linear": (lambda x, w: linear_op(x)[0], lambda x, w: 2.0 * x, True),
    "fixed": (lambda x, w: fixed_op(w, x)[0], lambda x, w: w * x, True),
    "multilinear": (lambda x, w: bilinear_op(w, x)[0], lambda x, w: w * x, True),
    "nonlinear": (lambda x, w: nonlinear_op(w, x)[0], lambda x, w: w * jnp.sin(x), False),
    "func_can_batch": (lambda x, w: batching_op(x)[0], lambda x, w: 3.0 * x, True),
    "native": (lambda x, w: native_op(x, factor=2.5)[0], lambda x, w: 2.5 * x, True),
}

# ---------------------------------------------------------------------------
# Meshes and data
# ---------------------------------------------------------------------------


@functools.lru_cache(None)
def mesh(name):
    if name == "1d":
        return jax.make_mesh((4,), ("d",), axis_types=(Auto,))
    return jax.make_mesh((2, 2), ("x", "y"), axis_types=(Auto, Auto))


# mesh name -> (mesh, spec of a sharded argument, the shard_map's manual axes or None for all)
LAYOUTS = {
    "1d": ("1d", P("d"), None),
    "2d": ("2d", P("x", "y"), None),
    "partial": ("2d", P("x"), frozenset({"x"})),  # 'y' stays automatic
}


def global_shape(spec, m):
    """The global shape whose per-device block (over the manual axes) is (2, 4)."""
    shape = [2, 4]
    for dim, axis in enumerate(tuple(spec)):
        if axis is not None:
            shape[dim] *= m.shape[axis]
    return tuple(shape)


def data(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


def shard_mapped(body, layout, x_sharded=True, w_sharded=True, out_replicated=False, check_vma=True):
    mesh_name, spec, axes = LAYOUTS[layout]
    m = mesh(mesh_name)
    specs = (spec if x_sharded else P(), spec if w_sharded else P())
    extra = {} if axes is None else {"axis_names": axes}
    f = shard_map(body, mesh=m, in_specs=specs, out_specs=P() if out_replicated else spec, check_vma=check_vma, **extra)
    x = data(global_shape(specs[0], m), 1)
    w = data(global_shape(specs[1], m), 2) + 2.0  # away from 0 (and from symmetry with x)
    return (jax.jit(f) if axes is not None else f), x, w


# ---------------------------------------------------------------------------
# Transformations: each maps (F, x, w) -> arrays, F(x, w) the shard_mapped op
# ---------------------------------------------------------------------------


def _ct(x):
    return jnp.cos(jnp.arange(x.size, dtype=x.dtype).reshape(x.shape))


OUTER = {  # applied to the shard_mapped function
    "forward": lambda F, x, w: F(x, w),
    "jvp": lambda F, x, w: jax.jvp(lambda x: F(x, w), (x,), (_ct(x),)),
    "vjp": lambda F, x, w: jax.vjp(lambda x: F(x, w), x)[1](_ct(F(x, w))),
    "grad": lambda F, x, w: jax.grad(lambda x: jnp.sum(F(x, w) ** 2))(x),
    "jit_grad": lambda F, x, w: jax.jit(jax.grad(lambda x: jnp.sum(F(x, w) ** 2)))(x),
    "grad_wrt_w": lambda F, x, w: jax.grad(lambda w: jnp.sum(F(x, w) ** 2))(w),
    "linear_transpose": lambda F, x, w: jax.linear_transpose(lambda x: F(x, w), x)(_ct(F(x, w))),
}

INNER = {  # applied to the body inside shard_map, then forward and grad outside
    "vmap_in_body": lambda b: lambda x, w: jax.vmap(b)(x, w),
    "vmap_in_body_w_unmapped": lambda b: lambda x, w: jax.vmap(b, in_axes=(0, None))(x, w[0]),
    "grad_in_body": lambda b: lambda x, w: jax.grad(lambda x: jnp.sum(b(x, w) ** 2))(x),
    "checkpoint": lambda b: jax.checkpoint(b),
    "fori_loop": lambda b: lambda x, w: jax.lax.fori_loop(0, 3, lambda i, c: b(c, w) * 0.5, x),
    "scan": lambda b: lambda x, w: jax.lax.scan(lambda c, _: (b(c, w) * 0.5, None), x, None, length=3)[0],
    "cond_op_branch": lambda b: lambda x, w: jax.lax.cond(jnp.sum(w) > -1e9, lambda x: b(x, w), jnp.negative, x),
    "cond_jnp_branch": lambda b: lambda x, w: jax.lax.cond(jnp.sum(w) < -1e9, lambda x: b(x, w), jnp.negative, x),
}


def compare(got, want, rtol=1e-10, atol=1e-10):
    got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves), (len(got_leaves), len(want_leaves))
    for g, r in zip(got_leaves, want_leaves):
        assert g.shape == r.shape, (g.shape, r.shape)
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=rtol, atol=atol)


CASES = {}


def case(name):
    def register(fn):
        CASES[name] = fn
        return fn

    return register


def _outer_case(kind, transform, layout, x_sharded=True, w_sharded=True):
    body, ref, linear = KINDS[kind]

    def run():
        F, x, w = shard_mapped(body, layout, x_sharded, w_sharded)
        R, _, _ = shard_mapped(ref, layout, x_sharded, w_sharded)
        compare(OUTER[transform](F, x, w), OUTER[transform](R, x, w))

    return run


# jax 0.5's shard_map (before jax.shard_map) refuses the grad of a cond with its replication check for
# jax's own ops too ("The branches of cond produced mismatched replication types"): there the cond
# cases run unchecked.
OLD_SHARD_MAP = not hasattr(jax, "shard_map")


def _inner_case(kind, transform, layout):
    body, ref, linear = KINDS[kind]
    check_vma = not (OLD_SHARD_MAP and transform.startswith("cond"))

    def run():
        F, x, w = shard_mapped(INNER[transform](body), layout, check_vma=check_vma)
        R, _, _ = shard_mapped(INNER[transform](ref), layout, check_vma=check_vma)
        compare(F(x, w), R(x, w))
        if transform != "grad_in_body":  # (a grad of that would be second order)
            compare(OUTER["grad"](F, x, w), OUTER["grad"](R, x, w))

    return run


def _psum_case(kind, layout):
    body, ref, _ = KINDS[kind]
    axes = tuple(a for a in LAYOUTS[layout][1] if a is not None)

    def run():
        F, x, w = shard_mapped(lambda x, w: jax.lax.psum(body(x, w), axes), layout, out_replicated=True)
        R, _, _ = shard_mapped(lambda x, w: jax.lax.psum(ref(x, w), axes), layout, out_replicated=True)
        compare(F(x, w), R(x, w))
        compare(OUTER["grad"](F, x, w), OUTER["grad"](R, x, w))

    return run


for _kind, (_, _, _linear) in KINDS.items():
    for _transform in OUTER:
        if _transform == "linear_transpose" and not _linear:
            continue
        if _transform == "grad_wrt_w" and _kind in ("fixed", "nonlinear"):
            continue  # w is a fixed argument there (its error is tested in the main suite)
        CASES[f"shard_map/1d/{_kind}/{_transform}"] = _outer_case(_kind, _transform, "1d")
    for _transform in INNER:
        CASES[f"shard_map/1d/{_kind}/{_transform}"] = _inner_case(_kind, _transform, "1d")
    CASES[f"shard_map/1d/{_kind}/psum"] = _psum_case(_kind, "1d")
    for _layout in ("2d", "partial"):
        for _transform in ("forward", "grad"):
            CASES[f"shard_map/{_layout}/{_kind}/{_transform}"] = _outer_case(_kind, _transform, _layout)
        CASES[f"shard_map/{_layout}/{_kind}/vmap_in_body"] = _inner_case(_kind, "vmap_in_body", _layout)
    # One argument replicated and the other sharded: the replicated one's cotangent
    # sums over the devices (once silently wrong).
    for _transform in ("grad", "jit_grad") + (("linear_transpose",) if _linear else ()):
        CASES[f"shard_map/1d/{_kind}/x_replicated_w_sharded/{_transform}"] = _outer_case(
            _kind, _transform, "1d", x_sharded=False
        )
    if _kind == "multilinear":
        CASES[f"shard_map/1d/{_kind}/w_replicated/grad_wrt_w"] = _outer_case(_kind, "grad_wrt_w", "1d", w_sharded=False)
        CASES[f"shard_map/1d/{_kind}/w_replicated/transpose_wrt_w"] = functools.partial(
            lambda: _transpose_wrt_w(w_sharded=False)
        )


def _mixed_case(kind, x_spec, w_spec, transform):
    """2-D mesh, one argument varying over 'x' only and the other over 'x' and 'y': the
    first one's cotangent sums over 'y'."""
    body, ref, _ = KINDS[kind]

    def run():
        m = mesh("2d")
        x = data(global_shape(x_spec, m), 1)
        w = data(global_shape(w_spec, m), 2) + 2.0
        F, R = (shard_map(b, mesh=m, in_specs=(x_spec, w_spec), out_specs=P("x", "y")) for b in (body, ref))
        compare(OUTER[transform](F, x, w), OUTER[transform](R, x, w))
        compare(OUTER["forward"](F, x, w), OUTER["forward"](R, x, w))

    return run


for _kind in ("fixed", "multilinear", "nonlinear"):  # (the other kinds do not take w)
    for _x_spec, _w_spec, _name in [
        (P("x"), P("x", "y"), "x_over_x_w_over_xy"),
        (P("x", "y"), P("x"), "x_over_xy_w_over_x"),
    ]:
        for _transform in ("grad", "jit_grad") + (("grad_wrt_w",) if _kind == "multilinear" else ()):
            CASES[f"shard_map/2d_mixed/{_kind}/{_name}/{_transform}"] = _mixed_case(_kind, _x_spec, _w_spec, _transform)


def _transpose_wrt_w(w_sharded):
    body, ref, _ = KINDS["multilinear"]
    F, x, w = shard_mapped(body, "1d", w_sharded=w_sharded)
    R, _, _ = shard_mapped(ref, "1d", w_sharded=w_sharded)
    ct = _ct(F(x, w))
    compare(jax.linear_transpose(lambda w: F(x, w), w)(ct), jax.linear_transpose(lambda w: R(x, w), w)(ct))


@case("shard_map/out_specs_P()_on_a_varying_result_raises")
def _replicated_out_spec():
    for kind in KINDS:
        F, x, w = shard_mapped(KINDS[kind][0], "1d", out_replicated=True)
        try:
            F(x, w)
        except ValueError as err:
            assert "out_specs" in str(err), err
        else:
            raise AssertionError(f"{kind}: out_specs=P() on a varying result did not raise")


# The cases of partitioned batches under sharded jit (no shard_map) register themselves.
import _multidevice_partition  # noqa: F401  (its cases register themselves on import)

# ---------------------------------------------------------------------------


def main(shard=0, n_shards=1):
    """Run every ``n_shards``-th case from ``shard`` on (the test runs shards side by side)."""
    results = {}
    for name, fn in list(CASES.items())[shard::n_shards]:
        start = time.perf_counter()
        try:
            fn()
            results[name] = {"ok": True, "message": "", "seconds": time.perf_counter() - start}
        except Exception as err:  # reported to the test, which fails with it
            results[name] = {
                "ok": False,
                "message": "".join(traceback.format_exception(type(err), err, err.__traceback__))[-3000:],
            }
    return results


if __name__ == "__main__":
    # Run from the module proper (which the partition cases import), not from __main__.
    import _multidevice_cases

    print(json.dumps(_multidevice_cases.main(*map(int, sys.argv[1:3]))))

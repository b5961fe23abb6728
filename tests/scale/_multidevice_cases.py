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

import contextlib
import functools
import json
import math
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import _kernels
import jaxbind

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
bilinear_op = jaxbind.get_linear_call(_multiply, (_multiply, _multiply), _like_last,
                                      (_like_last, _like_last))
nonlinear_op = jaxbind.get_nonlinear_call(_wsin, (_wsin_derivative, _wsin_derivative),
                                          _like_last, _like_last, first_n_args_fixed=1)
batching_op = jaxbind.get_linear_call(_batched_triple, _batched_triple, _batched_abstract,
                                      _batched_abstract, func_can_batch=True)
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


def shard_mapped(body, layout, x_sharded=True, w_sharded=True, out_replicated=False):
    mesh_name, spec, axes = LAYOUTS[layout]
    m = mesh(mesh_name)
    specs = (spec if x_sharded else P(), spec if w_sharded else P())
    extra = {} if axes is None else {"axis_names": axes}
    f = jax.shard_map(body, mesh=m, in_specs=specs, out_specs=P() if out_replicated else spec, **extra)
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


def _inner_case(kind, transform, layout):
    body, ref, linear = KINDS[kind]

    def run():
        F, x, w = shard_mapped(INNER[transform](body), layout)
        R, _, _ = shard_mapped(INNER[transform](ref), layout)
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
            _kind, _transform, "1d", x_sharded=False)
    if _kind == "multilinear":
        CASES[f"shard_map/1d/{_kind}/w_replicated/grad_wrt_w"] = _outer_case(
            _kind, "grad_wrt_w", "1d", w_sharded=False)
        CASES[f"shard_map/1d/{_kind}/w_replicated/transpose_wrt_w"] = functools.partial(
            lambda: _transpose_wrt_w(w_sharded=False))


def _mixed_case(kind, x_spec, w_spec, transform):
    """2-D mesh, one argument varying over 'x' only and the other over 'x' and 'y': the
    first one's cotangent sums over 'y'."""
    body, ref, _ = KINDS[kind]

    def run():
        m = mesh("2d")
        x = data(global_shape(x_spec, m), 1)
        w = data(global_shape(w_spec, m), 2) + 2.0
        F, R = (jax.shard_map(b, mesh=m, in_specs=(x_spec, w_spec), out_specs=P("x", "y"))
                for b in (body, ref))
        compare(OUTER[transform](F, x, w), OUTER[transform](R, x, w))
        compare(OUTER["forward"](F, x, w), OUTER["forward"](R, x, w))
    return run


for _kind in ("fixed", "multilinear", "nonlinear"):  # (the other kinds do not take w)
    for _x_spec, _w_spec, _name in [(P("x"), P("x", "y"), "x_over_x_w_over_xy"),
                                    (P("x", "y"), P("x"), "x_over_xy_w_over_x")]:
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


# ---------------------------------------------------------------------------
# Partitioned batches under sharded jit (no shard_map)
# ---------------------------------------------------------------------------


def _sharded_batch(spec=P("d"), shape=(64, 8), explicit=False):
    types = (jax.sharding.AxisType.Explicit,) if explicit else (Auto,)
    m = jax.make_mesh((4,), ("d",), axis_types=types)
    x = jax.device_put(data(shape, 3), NamedSharding(m, spec))
    return m, x


def _count_calls(f, *args):
    CALLS.clear()
    out = f(*args)
    jax.block_until_ready(out)
    return out, len(CALLS)


@case("partition/vmap_python_each_element_once_no_all_gather_result_sharded")
def _partitioned_vmap():
    m, x = _sharded_batch()
    f = jax.jit(jax.vmap(lambda r: counted_op(r)[0]))
    hlo = f.lower(x).compile().as_text()
    assert "all-gather" not in hlo, "the compiled program gathers the batch"
    assert "num_batch_dims" in f.lower(x).as_text()
    y, calls = _count_calls(f, x)
    assert calls == 64, f"{calls} callback calls for a batch of 64"
    assert y.sharding.spec[0] == "d", y.sharding
    assert len(y.addressable_shards) == 4 and all(s.data.shape == (16, 8) for s in y.addressable_shards)
    compare(y, 2.0 * x)


@case("partition/grad_of_vmap_each_element_once_per_pass")
def _partitioned_grad():
    m, x = _sharded_batch()
    f = jax.jit(jax.grad(lambda a: jnp.sum(jax.vmap(lambda r: counted_op(r)[0])(a) ** 2)))
    assert "all-gather" not in f.lower(x).compile().as_text()
    g, calls = _count_calls(f, x)
    assert calls == 128, f"{calls} callback calls for forward and transpose of 64 elements"
    assert g.sharding.spec[0] == "d", g.sharding
    compare(g, 8.0 * x)


@case("partition/nested_vmap_two_levels")
def _partitioned_nested():
    m, x = _sharded_batch(shape=(8, 8, 3))
    f = jax.jit(jax.vmap(jax.vmap(lambda r: counted_op(r)[0])))
    assert "all-gather" not in f.lower(x).compile().as_text()
    y, calls = _count_calls(f, x)
    assert calls == 64, calls
    assert y.sharding.spec[0] == "d"
    compare(y, 2.0 * x)


@case("partition/inner_level_sharded")
def _partitioned_inner_level():
    # The batch sharded along the second level: the handler gets blocks whose
    # inner level is a quarter of the compiled one and must walk what it got.
    m, x = _sharded_batch(spec=P(None, "d"), shape=(4, 16, 3))
    f = jax.jit(jax.vmap(jax.vmap(lambda r: counted_op(r)[0])))
    assert "all-gather" not in f.lower(x).compile().as_text(), "the compiled program gathers the batch"
    y, calls = _count_calls(f, x)
    assert calls == 64, calls
    assert y.sharding.is_equivalent_to(NamedSharding(m, P(None, "d")), y.ndim), y.sharding
    assert all(s.data.shape == (4, 4, 3) for s in y.addressable_shards), [s.data.shape for s in y.addressable_shards]
    compare(y, 2.0 * x)


@case("partition/native_kernel_vmap_and_grad")
def _partitioned_native():
    m, x = _sharded_batch()
    f = jax.jit(jax.vmap(lambda r: native_op(r, factor=2.5)[0]))
    assert "all-gather" not in f.lower(x).compile().as_text()
    y = f(x)
    assert y.sharding.spec[0] == "d"
    compare(y, 2.5 * x)
    g = jax.jit(jax.grad(lambda a: jnp.sum(jax.vmap(lambda r: native_op(r, factor=2.5)[0])(a) ** 2)))(x)
    compare(g, 12.5 * x)


@case("partition/concurrent_native_kernel")
def _partitioned_concurrent():
    m, x = _sharded_batch()
    kernel = jaxbind.native(LIB.jb_scale, concurrent=True)
    op = jaxbind.get_linear_call(kernel, kernel, _like_last, _like_last)
    f = jax.jit(jax.vmap(lambda r: op(r, factor=-1.5)[0]))
    assert "all-gather" not in f.lower(x).compile().as_text()
    y = f(x)
    assert y.sharding.spec[0] == "d"
    compare(y, -1.5 * x)


# Uneven batches: XLA pads each device's block (10 rows over 4 devices: 3, 3, 3 and
# 1 + 2 padding rows). Padding must never reach a callback or kernel.


@contextlib.contextmanager
def partitioner(shardy):
    """Shardy (jax's default) or GSPMD, for the programs compiled inside."""
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", old)


def _uneven(shape, spec, m=None):
    """jit(f) whose argument is constrained to ``spec`` (an uneven one cannot be device_put)."""
    m = m or mesh("1d")
    return lambda f: jax.jit(lambda a: f(jax.lax.with_sharding_constraint(a, NamedSharding(m, spec))))


def _positive(shape, seed=3):
    return 1.0 + jnp.abs(data(shape, seed))  # real rows are never zero, padding rows are


def _scale_nonzero(out, args, kwargs_dump):  # 2 x, refusing an element of zeros (linear)
    CALLS.append(1)
    if not np.any(args[-1]):
        raise ValueError(f"an element of zeros: {args[-1]}")
    np.multiply(args[-1], 2.0, out=out[0])


def _log(out, args, kwargs_dump):
    if np.any(args[0] <= 0):
        raise ValueError(f"log of a non-positive number: {args[0]}")
    np.log(args[0], out=out[0])


def _log_derivative(out, args, kwargs_dump):  # jvp (x, t) and vjp (x, ct) alike: t / x
    if np.any(args[0] <= 0):
        raise ValueError(f"derivative of log at a non-positive number: {args[0]}")
    np.divide(args[1], args[0], out=out[0])


nonzero_op = jaxbind.get_linear_call(_scale_nonzero, _scale_nonzero, _like_last, _like_last)
log_op = jaxbind.get_nonlinear_call(_log, (_log_derivative, _log_derivative), _like_last, _like_last)
native_nonzero = jaxbind.get_linear_call(LIB.jb_scale_nonzero, LIB.jb_scale_nonzero, _like_last, _like_last)
_concurrent_nonzero = jaxbind.native(LIB.jb_scale_nonzero, concurrent=True)
concurrent_nonzero = jaxbind.get_linear_call(_concurrent_nonzero, _concurrent_nonzero, _like_last,
                                             _like_last, name="concurrent_nonzero")


def _vmapped(op, depth=1):
    f = lambda r: op(r)[0]  # noqa: E731
    for _ in range(depth):
        f = jax.vmap(f)
    return f


def _sum_sq(f):
    return lambda a: jnp.sum(f(a) ** 2)


@case("padding/uneven_batch_calls_only_real_elements_shardy_and_gspmd")
def _padding_counts():
    x = _positive((10, 3))
    for shardy in (True, False):
        with partitioner(shardy):
            f = _uneven(x.shape, P("d"))(_vmapped(nonzero_op))
            assert "f64[3,3]{1,0} custom-call(" in f.lower(x).compile().as_text(), "not partitioned"
            y, calls = _count_calls(f, x)
            assert calls == 10, f"shardy={shardy}: {calls} callback calls for 10 rows"
            compare(y, 2.0 * x)
            g, calls = _count_calls(_uneven(x.shape, P("d"))(jax.grad(_sum_sq(_vmapped(nonzero_op)))), x)
            assert calls == 20, f"shardy={shardy}: {calls} calls for forward and transpose of 10 rows"
            compare(g, 8.0 * x)


@case("padding/domain_checking_callbacks_nested_and_grad")
def _padding_domain():
    for shardy in (True, False):
        with partitioner(shardy):
            for shape, spec, depth in [((10, 3), P("d"), 1), ((4, 6, 2), P(None, "d"), 2),
                                       ((3, 5, 2), P("d"), 2)]:
                x = _positive(shape)
                jit = _uneven(shape, spec)
                y, calls = _count_calls(jit(_vmapped(nonzero_op, depth)), x)
                assert calls == math.prod(shape[:depth]), (shape, spec, calls)
                compare(y, 2.0 * x)
                compare(jit(_vmapped(log_op, depth))(x), jnp.log(x))
                compare(jit(jax.grad(_sum_sq(_vmapped(log_op, depth))))(x), 2 * jnp.log(x) / x)
    # Several padded levels: a 2-D mesh, each level uneven over its axis.
    x = _positive((3, 5, 2))
    jit = _uneven(x.shape, P("x", "y"), mesh("2d"))
    y, calls = _count_calls(jit(_vmapped(nonzero_op, 2)), x)
    assert calls == 15, calls
    compare(y, 2.0 * x)
    compare(jit(jax.grad(_sum_sq(_vmapped(log_op, 2))))(x), 2 * jnp.log(x) / x)


@case("padding/native_kernels_plain_concurrent_and_parallel_walk")
def _padding_native():
    x = _positive((10, 3))
    for shardy in (True, False):
        with partitioner(shardy):
            for op in (native_nonzero, concurrent_nonzero):
                jit = _uneven(x.shape, P("d"))
                compare(jit(_vmapped(op))(x), 2.0 * x)
                compare(jit(jax.grad(_sum_sq(_vmapped(op))))(x), 8.0 * x)
            compare(_uneven((4, 6, 2), P(None, "d"))(_vmapped(native_nonzero, 2))(_positive((4, 6, 2))),
                    2.0 * _positive((4, 6, 2)))
    # A walk long enough to be spread over threads (30 rows: blocks of 8, the last
    # with 2 padding rows), with a kernel that fails on an element below 0.5.
    busy = jaxbind.get_nonlinear_call(LIB.jb_busy_thread, None,
                                      lambda x, **k: ((x.shape, x.dtype), ((), np.int64)), None)
    x = _positive((30, 2))
    y, threads = _uneven(x.shape, P("d"))(jax.vmap(lambda r: busy(r, iterations=20000, fail_below=0.5)))(x)
    compare(y, x)


WHOLE_CALLS = []  # (input shapes) of each call of the whole-batch op below


def _whole_nonzero(out, args, kwargs_dump):  # w * x, refusing a batch element of zeros
    WHOLE_CALLS.append(tuple(a.shape for a in args))
    w, x = args
    if not np.all(np.any(x.reshape(x.shape[:-1] + (-1,)), axis=-1)):
        raise ValueError(f"an element of zeros in {x}")
    np.multiply(w, x, out=out[0])


@case("padding/whole_batch_callbacks_get_the_real_elements_only")
def _padding_whole():
    op = jaxbind.get_linear_call(_whole_nonzero, _whole_nonzero, _like_last, _like_last,
                                 first_n_args_fixed=1, vmap_method="broadcast_all")
    w = data((3,), 4)
    for shardy in (True, False):
        with partitioner(shardy):
            # One level: a contiguous prefix of each block (3, 3, 3 and 1 rows).
            x = _positive((10, 3))
            f = _uneven(x.shape, P("d"))(jax.vmap(lambda r: op(w, r)[0]))
            WHOLE_CALLS.clear()
            compare(jax.block_until_ready(f(x)), w * x)
            assert sorted(s[1] for s in WHOLE_CALLS) == [(1, 3), (3, 3), (3, 3), (3, 3)], WHOLE_CALLS
            g = _uneven(x.shape, P("d"))(jax.grad(_sum_sq(jax.vmap(lambda r: op(w, r)[0]))))(x)
            compare(g, 2 * w * w * x)
            # The inner level sharded: 5 over 4 (2, 2, 1 and none): the real part of
            # the third block, (3, 1) of (3, 2), is gathered; the fourth is not called.
            x = _positive((3, 5, 2))
            f = _uneven(x.shape, P(None, "d"))(jax.vmap(jax.vmap(lambda r: op(w[:2], r)[0])))
            WHOLE_CALLS.clear()
            compare(jax.block_until_ready(f(x)), w[:2] * x)
            assert sorted(s[1] for s in WHOLE_CALLS) == [(3, 1, 2), (3, 2, 2), (3, 2, 2)], WHOLE_CALLS


@case("padding/shard_map_partial_manual_uneven_automatic_axis")
def _padding_partial_manual():
    m = mesh("2d")
    x = _positive((6, 4))  # a block of 3 rows per 'x', split over the automatic 'y' (2)

    def body(b):
        return _vmapped(nonzero_op)(jax.lax.with_sharding_constraint(b, P("y")))
    with set_mesh(m):
        f = jax.jit(jax.shard_map(body, mesh=m, in_specs=P("x"), out_specs=P("x"), axis_names=frozenset({"x"})))
        assert "iota" in f.lower(x).as_text()
        y, calls = _count_calls(f, x)
    assert calls == 6, calls
    compare(y, 2.0 * x)


def _jax_inside(out, args, kwargs_dump):  # one-device JAX inside a callback of a sharded program
    out[0][...] = np.asarray(jax.jit(lambda a: 2.0 * a)(np.array(args[0])))


@case("callbacks/one_device_jax_inside_a_sharded_programs_callback_works")
def _jax_in_callback():
    # (A multi-device program run from such a callback hangs: see the README.)
    op = jaxbind.get_linear_call(_jax_inside, _jax_inside, _like_last, _like_last)
    m, x = _sharded_batch(shape=(8, 3))
    compare(jax.jit(lambda a: jnp.sum(_vmapped(op)(a)))(x), 2.0 * jnp.sum(x))


@case("padding/no_validity_operand_when_no_padding_is_possible")
def _padding_only_when_needed():
    f = jax.jit(_vmapped(counted_op))
    assert "iota" not in f.lower(jnp.ones((10, 3))).as_text()  # one device
    m, x = _sharded_batch()  # 64 rows over 4 devices
    assert "iota" not in f.lower(x).as_text()
    assert "iota" in _uneven((10, 3), P("d"))(_vmapped(counted_op)).lower(jnp.ones((10, 3))).as_text()


@case("fallback/unmapped_input_is_gathered_and_correct")
def _fallback_unmapped():
    m, x = _sharded_batch()
    w = data((8,), 4)
    y, calls = _count_calls(jax.jit(jax.vmap(lambda r: fixed_op(w, r)[0])), x)
    compare(y, w * x)


@case("fallback/plain_op_on_sharded_array")
def _fallback_plain():
    m, x = _sharded_batch()
    y, calls = _count_calls(jax.jit(lambda a: counted_op(a)[0]), x)
    compare(y, 2.0 * x)


@case("fallback/func_can_batch_vmap_on_sharded_batch")
def _fallback_can_batch():
    m, x = _sharded_batch()
    compare(jax.jit(jax.vmap(lambda r: batching_op(r)[0]))(x), 3.0 * x)


@case("fallback/sharded_non_batch_dimension")
def _fallback_non_batch():
    m, x = _sharded_batch(spec=P(None, "d"))
    y, calls = _count_calls(jax.jit(jax.vmap(lambda r: counted_op(r)[0])), x)
    compare(y, 2.0 * x)


@case("explicit/vmap_keeps_batch_sharding_in_type")
def _explicit_vmap():
    m, x = _sharded_batch(explicit=True)
    with set_mesh(m):
        f = jax.jit(jax.vmap(lambda r: counted_op(r)[0]))
        y, calls = _count_calls(f, x)  # (it blocks: no call of another run is counted)
        assert jax.typeof(y).sharding.spec[0] == "d", jax.typeof(y)
        assert calls == 64, calls
        compare(y, 2.0 * x)
        g = jax.jit(jax.grad(lambda a: jnp.sum(jax.vmap(lambda r: counted_op(r)[0])(a) ** 2)))(x)
        assert jax.typeof(g).sharding.spec[0] == "d"
        compare(g, 8.0 * x)


@case("explicit/unpartitioned_op_grad_keeps_primal_sharding")
def _explicit_plain():
    m, x = _sharded_batch(explicit=True)
    with set_mesh(m):
        y = jax.jit(lambda a: linear_op(a)[0])(x)
        compare(y, 2.0 * x)
        g = jax.jit(jax.grad(lambda a: jnp.sum(linear_op(a)[0] ** 2)))(x)
        assert jax.typeof(g).sharding.spec[0] == "d", jax.typeof(g)
        compare(g, 8.0 * x)


@case("explicit/nonlinear_and_fixed_vmap")
def _explicit_nonlinear():
    m, x = _sharded_batch(explicit=True)
    w = jax.device_put(data((64, 8), 5) + 2.0, NamedSharding(m, P("d")))
    with set_mesh(m):
        f = jax.jit(jax.vmap(lambda w, r: nonlinear_op(w, r)[0]))
        compare(f(w, x), w * jnp.sin(x))
        g = jax.jit(jax.grad(lambda r: jnp.sum(jax.vmap(lambda w, r: nonlinear_op(w, r)[0])(w, r))))(x)
        compare(g, w * jnp.cos(x))


# vmap_method: a batch handed to the callback whole partitions when every array
# carries every level (broadcast_all always; expand_dims when all are mapped).
WHOLE_SHAPES = []  # input shapes each call of the whole-batch ops saw


def _whole_multiply(out, args, kwargs_dump):
    WHOLE_SHAPES.append(tuple(a.shape for a in args))
    np.multiply(args[0], args[1], out=out[0])


def _whole_op(method):
    return jaxbind.get_linear_call(_whole_multiply, _whole_multiply, _like_last, _like_last,
                                   first_n_args_fixed=1, vmap_method=method)


@case("partition/broadcast_all_each_device_its_block")
def _partitioned_broadcast_all():
    m, x = _sharded_batch()
    w = data((8,), 4)  # not mapped: broadcast over the batch, so the call still partitions
    f = jax.jit(jax.vmap(lambda r: _whole_op("broadcast_all")(w, r)[0]))
    assert "num_batch_dims" in f.lower(x).as_text()
    assert "all-gather" not in f.lower(x).compile().as_text()
    WHOLE_SHAPES.clear()
    y = jax.block_until_ready(f(x))
    assert sorted(WHOLE_SHAPES) == [((16, 8), (16, 8))] * 4, WHOLE_SHAPES
    assert y.sharding.spec[0] == "d", y.sharding
    compare(y, w * x)
    g = jax.jit(jax.grad(lambda a: jnp.sum(jax.vmap(lambda r: _whole_op("broadcast_all")(w, r)[0])(a) ** 2)))(x)
    compare(g, 2 * w * w * x)


@case("partition/expand_dims_all_mapped_partitions_unmapped_stays_whole")
def _partitioned_expand_dims():
    m, x = _sharded_batch()
    w = jax.device_put(data((64, 8), 5), NamedSharding(m, P("d")))
    f = jax.jit(jax.vmap(lambda w, r: _whole_op("expand_dims")(w, r)[0]))
    assert "num_batch_dims" in f.lower(w, x).as_text()
    WHOLE_SHAPES.clear()
    compare(f(w, x), w * x)
    assert sorted(WHOLE_SHAPES) == [((16, 8), (16, 8))] * 4, WHOLE_SHAPES
    w1 = data((8,), 4)  # not mapped: a size-1 level, so every call sees the whole batch
    f = jax.jit(jax.vmap(lambda r: _whole_op("expand_dims")(w1, r)[0]))
    assert "num_batch_dims" not in f.lower(x).as_text()
    WHOLE_SHAPES.clear()
    compare(f(x), w1 * x)
    assert WHOLE_SHAPES and set(WHOLE_SHAPES) == {((1, 8), (64, 8))}, WHOLE_SHAPES


@case("walk/handler_refuses_buffers_that_disagree_with_the_site")
def _walk_mismatch():
    # A program that names a walked site but hands it an input whose batch
    # dimension differs from its output's: an error, never a walk past the end.
    from jaxbind import _primitive as prim
    from jaxbind._definition import Role
    role = Role(linear_op.definition, 0, slot=1, n_fixed=0, in_sizes=(1,))
    batch = prim.WalkBatch(((True,),))
    site = prim.site_for(role, jaxbind._api._NO_KWARGS, batch, None)
    call = jax.ffi.ffi_call(prim.TARGET, jax.ShapeDtypeStruct((8, 4), jnp.float64))
    try:
        np.asarray(jax.jit(lambda a: call(a, session=prim._SESSION, site=np.int64(site)))(jnp.ones((3, 4))))
    except Exception as err:
        assert "batch dimensions of input 0" in str(err), err
    else:
        raise AssertionError("the handler walked buffers that disagree")


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
            results[name] = {"ok": False, "message": "".join(
                traceback.format_exception(type(err), err, err.__traceback__))[-3000:]}
    return results


if __name__ == "__main__":
    print(json.dumps(main(*map(int, sys.argv[1:3]))))

"""Multi-device cases of partitioned batches under sharded jit (no shard_map): calls per
element, no all-gather, shardings kept, padding of uneven batches never reaching a callback,
explicit sharding, vmap_method, and the fallbacks. Registered in ``_multidevice_cases.CASES``
(imported from there; see its docstring for how they run)."""

import contextlib
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _multidevice_cases import (
    CALLS,
    LIB,
    OLD_SHARD_MAP,
    Auto,
    _like_last,
    batching_op,
    case,
    compare,
    counted_op,
    data,
    fixed_op,
    linear_op,
    mesh,
    native_op,
    nonlinear_op,
    set_mesh,
)
from _shared import shard_map
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxbind

# ---------------------------------------------------------------------------
# Partitioned batches under sharded jit (no shard_map)
# ---------------------------------------------------------------------------


def _sharded_batch(spec=None, shape=(64, 8), explicit=False):
    spec = P("d") if spec is None else spec
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


_INTERVALS = []  # (start, end) of each call of the thread-safe op's callback


def _sleepy_scale(out, args, kwargs_dump):  # sleeping releases the GIL, as NumPy on large arrays does
    start = time.perf_counter()
    time.sleep(0.002)
    np.multiply(args[0], 3.0, out=out[0])
    _INTERVALS.append((start, time.perf_counter()))


@case("partition/thread_safe_python_walks_overlap_across_devices_and_threads")
def _partitioned_thread_safe():
    m, x = _sharded_batch(shape=(32, 8))
    op = jaxbind.get_linear_call(
        _sleepy_scale, _sleepy_scale, _like_last, _like_last, thread_safe=True, name="sleepy_scale"
    )
    f = jax.jit(jax.vmap(lambda r: op(r)[0]))
    compare(f(x), 3.0 * x)
    _INTERVALS.clear()
    compare(jax.block_until_ready(f(x)), 3.0 * x)
    assert len(_INTERVALS) == 32, len(_INTERVALS)  # each element once
    events = sorted([(a, 1) for a, _ in _INTERVALS] + [(b, -1) for _, b in _INTERVALS])
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    assert most >= 4, f"at most {most} calls at once"  # more than one device walk at once (one has 3 threads)


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
concurrent_nonzero = jaxbind.get_linear_call(
    _concurrent_nonzero, _concurrent_nonzero, _like_last, _like_last, name="concurrent_nonzero"
)


def _vmapped(op, depth=1):
    f = lambda r: op(r)[0]
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
            for shape, spec, depth in [((10, 3), P("d"), 1), ((4, 6, 2), P(None, "d"), 2), ((3, 5, 2), P("d"), 2)]:
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
            compare(
                _uneven((4, 6, 2), P(None, "d"))(_vmapped(native_nonzero, 2))(_positive((4, 6, 2))),
                2.0 * _positive((4, 6, 2)),
            )
    # A walk long enough to be spread over threads (30 rows: blocks of 8, the last
    # with 2 padding rows), with a kernel that fails on an element below 0.5.
    busy = jaxbind.get_nonlinear_call(
        LIB.jb_busy_thread, None, lambda x, **k: ((x.shape, x.dtype), ((), np.int64)), None
    )
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
    op = jaxbind.get_linear_call(
        _whole_nonzero, _whole_nonzero, _like_last, _like_last, first_n_args_fixed=1, vmap_method="broadcast_all"
    )
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

    if OLD_SHARD_MAP:  # jax 0.5 cannot lower a sharding constraint on an automatic axis in a partial
        # shard_map, with jax's own ops too: checked, and the case ends there.
        plain = shard_map(
            lambda b: 2.0 * jax.lax.with_sharding_constraint(b, P("y")),
            mesh=m,
            in_specs=P("x"),
            out_specs=P("x"),
            axis_names=frozenset({"x"}),
        )
        with set_mesh(m), pytest.raises(NotImplementedError, match="Unhandled OpSharding type"):
            jax.jit(plain).lower(x)
        return
    with set_mesh(m):
        f = jax.jit(shard_map(body, mesh=m, in_specs=P("x"), out_specs=P("x"), axis_names=frozenset({"x"})))
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
    return jaxbind.get_linear_call(
        _whole_multiply, _whole_multiply, _like_last, _like_last, first_n_args_fixed=1, vmap_method=method
    )


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
    from jaxbind._batch_types import WalkBatch
    from jaxbind._definition import Role
    from jaxbind._op import _NO_KWARGS
    from jaxbind._runtime import TARGET
    from jaxbind._sites import site_for

    role = Role(linear_op.definition, 0, slot=1, n_fixed=0, in_sizes=(1,))
    batch = WalkBatch(((True,),))
    aval = jax.core.ShapedArray((8, 4), jnp.float64)
    site = site_for(role, _NO_KWARGS, batch, [aval], [aval])
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((8, 4), jnp.float64))
    try:
        np.asarray(jax.jit(lambda a: call(a, jaxbind=site.description, site=np.int64(site.key)))(jnp.ones((3, 4))))
    except Exception as err:
        assert "passes input 0 as float64[3, 4], but its call site has float64[8, 4]" in str(err), err
    else:
        raise AssertionError("the handler walked buffers that disagree")

"""The one place jaxbind touches JAX internals (with ``_jax_effects``, its effects' part); everything else
imports from here."""

from __future__ import annotations

# What the other modules import from here (the rest is this module's own).
__all__ = [
    "ArrayImpl",
    "Primitive",
    "ad",
    "add_keepalive",
    "apply_primitive",
    "at_top_level",
    "auto_device_count",
    "batch_partitioning_attributes",
    "batching",
    "canonicalize_dtype",
    "cast_to_common_vma",
    "ffi_call_operation",
    "get_aval",
    "hold_as_host_callback",
    "hold_weakly_in_jax_caches",
    "lowering_for_export",
    "lru_cleared_with_jax_caches",
    "mlir",
    "needs_devices_to_lower",
    "place_callback",
    "register_batch_partitionable",
    "register_replication_rules",
    "reshard_like",
    "runtime_error_of_fast_path",
    "set_frontend_attribute",
    "uses_shardy",
    "shaped_array",
    "sharding_spec",
    "varying_axes",
]

import dataclasses
import inspect
import itertools

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

try:  # the eager implementation of a primitive: compile it alone and run it
    from jax._src.dispatch import apply_primitive
except ImportError:  # pragma: no cover - older layouts
    from jax.interpreters.xla import apply_primitive  # type: ignore[attr-defined,no-redef]

import jax
import numpy as np
from jax._src import core as _core
from jax._src import ffi as _ffi
from jax._src import lib as _lib

# The type of a concrete JAX array (jax.Array is an abstract base class over it).
from jax._src.array import ArrayImpl

# The abstract value of an array or tracer: jax.typeof from 0.6 on.
get_aval = getattr(jax, "typeof", None) or jax.core.get_aval

# ---------------------------------------------------------------------------
# Varying manual axes (shard_map's check_vma types)
# ---------------------------------------------------------------------------
# Inside shard_map a type says over which manual mesh axes a value varies. The
# field moved: `aval.vma` (jax 0.6 to 0.9), `aval.manual_axis_type.varying`
# (jax 0.10 on); jax 0.5 has no such types.

_SHAPED_PARAMS = inspect.signature(_core.ShapedArray).parameters  # (__new__ or __init__)
if "manual_axis_type" in _SHAPED_PARAMS:

    def varying_axes(aval) -> frozenset:
        mat = getattr(aval, "manual_axis_type", None)
        return getattr(mat, "varying", None) or frozenset()

    def _vma_params(vma):
        return {"manual_axis_type": _core.ManualAxisType(varying=vma)} if vma else {}
elif "vma" in _SHAPED_PARAMS:  # pragma: no cover - jax 0.6 to 0.9

    def varying_axes(aval) -> frozenset:
        return getattr(aval, "vma", None) or frozenset()  # (None on a ShapeDtypeStruct)

    def _vma_params(vma):
        return {"vma": frozenset(vma)}
else:  # pragma: no cover - jax 0.5

    def varying_axes(aval) -> frozenset:
        return frozenset()

    def _vma_params(vma):
        return {}


# The cast of a value to varying over more manual axes (its transpose is a psum).
_pvary = getattr(_core, "pvary", None) or getattr(jax.lax, "pvary", None)
_cur_mesh_sharding = getattr(_core, "get_cur_mesh_sharding", None)


def cast_to_common_vma(args):
    """Cast each array to vary over the union of the arrays' varying manual axes.

    Outside shard_map (or with check_vma off) this changes nothing. Inside, a
    primitive's inputs must agree, as for JAX's own primitives: a replicated
    input combined with a varying one is first cast to varying, whose
    transpose sums the cotangent over the devices, so gradients stay right.
    """
    vmas = [varying_axes(get_aval(a)) for a in args]
    union = frozenset().union(*vmas)
    if not union or _pvary is None:
        return list(args)
    return [a if vma == union else _pvary(a, tuple(sorted(union - vma, key=str))) for a, vma in zip(args, vmas)]


def sharding_spec(aval) -> tuple:
    """The mesh axes each dimension of an array type is sharded over (explicit axes only)."""
    spec = tuple(getattr(getattr(aval, "sharding", None), "spec", None) or ())
    return spec + (None,) * (len(aval.shape) - len(spec))


try:  # jax.sharding.reshard from jax 0.7 on
    from jax.sharding import reshard as _reshard
except ImportError:  # pragma: no cover - jax 0.6
    try:
        from jax.experimental.shard import reshard as _reshard
    except ImportError:  # jax 0.5
        _reshard = None


def reshard_like(x, aval):
    """``x`` resharded to the explicit sharding of ``aval`` (a cotangent to its primal's)."""
    want = sharding_spec(aval)
    if want == sharding_spec(get_aval(x)) or _reshard is None:
        return x
    return _reshard(x, jax.sharding.PartitionSpec(*want))


def shaped_array(shape, dtype, like=None, vma=frozenset(), spec=(), on_mesh=True):
    """An array type varying over ``vma``, on the mesh of ``like`` (an input's type).

    ``spec`` gives the sharding of its leading dimensions (it matters only for
    explicit mesh axes); the other dimensions are unsharded. ``on_mesh=False``:
    on no mesh, as JAX types its callbacks' results (a side-effecting call's
    results are made on one device, never replicated over a mesh).
    """
    if _cur_mesh_sharding is None:  # pragma: no cover - jax 0.5
        return _core.ShapedArray(shape, dtype)
    full = jax.sharding.PartitionSpec(*spec, *([None] * (len(shape) - len(spec))))
    if not on_mesh and not _cur_mesh_sharding(full).mesh._any_axis_manual:
        return _core.ShapedArray(shape, dtype)
    mesh = getattr(getattr(like, "sharding", None), "mesh", None)
    if mesh is None or mesh.empty:
        sharding = _cur_mesh_sharding(full)
    else:
        sharding = jax.sharding.NamedSharding(mesh, full)
    return _core.ShapedArray(shape, dtype, sharding=sharding, **_vma_params(frozenset(vma)))


# ---------------------------------------------------------------------------
# shard_map's replication rules (jax 0.5)
# ---------------------------------------------------------------------------
# Where values carry their varying axes in their types (above), shard_map needs
# nothing more. jax 0.5's shard_map instead checks replication with a rule per
# primitive and refuses one it has none for (unless check_rep=False). An op's
# outputs agree on the devices where all its inputs agree: they are replicated
# over the axes every input is replicated over, and the standard rewrite
# broadcasts the inputs to that common replication first (as cast_to_common_vma
# does with types).


def register_replication_rules(primitive) -> None:
    if hasattr(jax, "shard_map"):  # jax >= 0.7: typed varying axes only
        return
    try:
        from jax.experimental import shard_map as _shard_map
    except ImportError:  # pragma: no cover
        return
    rules = getattr(_shard_map, "_check_rules", None)
    if rules is None:  # pragma: no cover
        return

    def replication(mesh, *in_rep, **_):
        reps = [rep for rep in in_rep if rep is not None]  # (None: a literal)
        return set.intersection(*reps) if reps else set(mesh.axis_names)

    rules.setdefault(primitive, replication)
    _shard_map.register_standard_rewrite(primitive)


# ---------------------------------------------------------------------------
# Batch partitioning of a custom call
# ---------------------------------------------------------------------------
# A target registered as batch partitionable may be split by XLA along the
# leading `num_batch_dims` dimensions of all its operands and results (a
# frontend attribute of the call); the Shardy partitioner also needs the
# matching sharding rule on the call. Both exist from jax 0.5.1 on; without
# them calls stay whole (XLA gathers their inputs), which is still correct.

_register_partitionable = getattr(jax.ffi, "register_ffi_target_as_batch_partitionable", None)
try:
    from jax._src.custom_partitioning_sharding_rule import sdy_sharding_rule_to_mlir as _sdy_rule_to_mlir
    from jax._src.custom_partitioning_sharding_rule import str_to_sdy_sharding_rule as _sdy_rule
except ImportError:  # pragma: no cover - older jax
    _sdy_rule = None


if len(inspect.signature(mlir.aval_to_ir_type).parameters) == 2:  # (module context, aval)

    def _ir_type(ctx, aval):
        return mlir.aval_to_ir_type(ctx.module_context, aval)
else:  # pragma: no cover - older jax

    def _ir_type(ctx, aval):
        return mlir.aval_to_ir_type(aval)


def register_batch_partitionable(target: str) -> bool:
    if _register_partitionable is None:  # pragma: no cover - older jax
        return False
    _register_partitionable(target)
    return True


def auto_device_count(ctx) -> int:
    """How many devices XLA's partitioner may split the arrays of this lowering over.

    A jit over several devices: all of them; inside ``shard_map``: the devices
    of the mesh axes left automatic (none when all are manual); else 1.
    """
    try:
        from jax._src.sharding_impls import ShardingContext, SPMDAxisContext
    except ImportError:  # pragma: no cover - other layouts: assume padding is possible
        return 2
    context = ctx.module_context.axis_context
    if isinstance(context, ShardingContext):
        return context.num_devices
    if isinstance(context, SPMDAxisContext):
        manual = 1
        for axis in context.manual_axes:
            manual *= context.mesh.shape[axis]
        return context.mesh.size // manual
    return 1


def batch_partitioning_attributes(ctx, levels: int, avals_in=None) -> dict:
    """The custom-call attributes that let XLA split a call along ``levels`` leading dims.

    ``avals_in``: the call's operands, when they are not ``ctx.avals_in``.
    """
    attributes = {
        "mhlo.frontend_attributes": mlir.ir.DictAttr.get({"num_batch_dims": mlir.ir.StringAttr.get(str(levels))})
    }
    if _sdy_rule is not None and getattr(jax.config, "jax_use_shardy_partitioner", False):
        letters = (f"d{k}" for k in itertools.count())  # a factor per non-batch dimension

        def side(avals):
            return ", ".join(" ".join(["..."] + [next(letters) for _ in a.shape[levels:]]) for a in avals)

        avals_in = ctx.avals_in if avals_in is None else avals_in
        rule = _sdy_rule(f"{side(avals_in)} -> {side(ctx.avals_out)}")

        def types(avals):
            return [_ir_type(ctx, a) for a in avals]

        attributes["sdy.sharding_rule"] = _sdy_rule_to_mlir(rule, types(avals_in), types(ctx.avals_out))
    return attributes


def set_frontend_attribute(op, key: str, value: str) -> None:
    """Attach ``key = value`` to the frontend attributes of an operation.

    XLA keeps frontend attributes through compilation (``frontend_attributes=``
    in the compiled HLO), so they name the op in lowered and compiled programs.
    """
    attrs = {}
    if "mhlo.frontend_attributes" in op.attributes:  # keep any already there
        attrs = {a.name: a.attr for a in op.attributes["mhlo.frontend_attributes"]}
    attrs[key] = mlir.ir.StringAttr.get(value)
    op.attributes["mhlo.frontend_attributes"] = mlir.ir.DictAttr.get(attrs)


# ---------------------------------------------------------------------------
# Errors of a jitted call
# ---------------------------------------------------------------------------


def runtime_error_of_fast_path(err: ValueError, prefixes: tuple):
    """The ``JaxRuntimeError`` a jitted call's runtime error should have been, or None.

    JAX's C++ fast path for a jitted call that already ran raises every
    runtime error as ValueError (jax-ml/jax#34083), where the first call (and
    an eager one) raises JaxRuntimeError. ``prefixes``: how the messages of
    the runtime errors to restore begin; other ValueErrors are left alone.
    """
    if not str(err).startswith(prefixes):
        return None
    return jax.errors.JaxRuntimeError(str(err)).with_traceback(err.__traceback__)


def place_callback(ctx, op, sharding, tokened: bool = False) -> None:
    """Annotate a custom call (the operation) as ``jax.pure_callback`` annotates its own.

    A sharded program runs it once, on one device (``sharding``'s, default the
    first of the program's); inside ``shard_map`` on every device. Nothing
    outside a partitioned program. ``tokened``: its first operand and result
    are an ordered effect's token (``jax.experimental.io_callback(ordered=True)``'s
    annotation has one entry more for it).
    """
    from jax._src import callback as _callback
    from jax._src.interpreters import mlir as _mlir

    op_sharding = _callback._callback_op_sharding(ctx.module_context.axis_context, sharding, ctx.avals_out)
    if op_sharding is None:
        return
    shardings = getattr(op_sharding, "shardings", None)  # (Shardy's list, one per result)
    if tokened and shardings is not None and len(ctx.avals_out) > 0:
        token = dataclasses.replace(shardings[0], mesh_shape=(), dim_shardings=())
        op_sharding = dataclasses.replace(op_sharding, shardings=(token, *shardings))
    if "ctx" in inspect.signature(_mlir.set_sharding).parameters:
        _mlir.set_sharding(ctx.module_context, op, op_sharding)
    else:  # jax < 0.7: set_sharding(op, sharding)
        _mlir.set_sharding(op, op_sharding)


def ffi_call_operation(target: str, ctx, args, **options):
    """The custom call of an FFI target (the operation, which may have no results).

    ``options``: :func:`jax.ffi.ffi_lowering`'s keyword arguments, then the
    call's attributes.
    """
    build = getattr(_ffi, "build_ffi_lowering_function", None)
    attributes = {k: options.pop(k) for k in list(options) if k in ("jaxbind", "site")}
    if build is not None:
        return build(target, **options)(ctx, *args, **attributes)
    results = jax.ffi.ffi_lowering(target, **options)(ctx, *args, **attributes)  # pragma: no cover - jax < 0.6
    if not results:
        raise NotImplementedError("jaxbind: a call with no results needs jax 0.6 or newer")
    return results[0].owner


def needs_devices_to_lower(primitive) -> None:
    """Have JAX pass a program's devices to the lowering of programs that use ``primitive``."""
    from jax._src import dispatch as _dispatch

    _dispatch.prim_requires_devices_during_lowering.add(primitive)


def at_top_level() -> bool:
    """Whether no trace is active (a call runs eagerly, as JAX's impl rules do)."""
    from jax._src import core as _core

    return isinstance(_core.trace_ctx.trace, _core.EvalTrace)


def canonicalize_dtype(dtype):
    """The dtype JAX would give an array of ``dtype`` (64-bit types narrowed without x64)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def add_keepalive(ctx, obj) -> None:
    """Keep ``obj`` alive as long as the executable compiled from this lowering."""
    ctx.module_context.add_keepalive(obj)


# ---------------------------------------------------------------------------
# A program JAX runs as it runs one that holds jax.pure_callback
# ---------------------------------------------------------------------------
# JAX hands the host callbacks a lowering registered (ModuleContext.host_callbacks) to
# the compiler; an executable that holds any runs synchronously on CPU (XLA's IFRT
# executable sets ExecutionMode::kSynchronous "to avoid deadlocks with reentrant
# callbacks"), so a callback's failure comes out of the call itself. JAX's dispatch
# also runs it with tokens (pxla's ExecuteReplicated), keeps jit's C++ fast path from it
# before jax 0.7.2 (pjit._get_fastpath_data; jax-ml/jax#31319: ~180 us more per call of
# a tiny program on jax 0.5.3, as for jax.pure_callback), and writes no persistent-cache
# entry for it. What a host callback is: a Python callable where jaxlib's callbacks are
# FFI handlers (jaxlib extension > 320, so jax >= 0.6: the test JAX's emit_python_callback makes);
# before, a capsule the client makes (get_emit_python_callback_descriptor). XLA refuses
# a program that mixes the two, so ours is of the kind JAX's own callbacks are.
_FFI_HOST_CALLBACKS = getattr(_lib.xla_client, "_version", 0) > 320
_capsules: dict = {}  # id(backend) -> (backend, its capsule): one per client, as host callbacks are compared


def _never_called(*args):  # pragma: no cover - no custom call names it
    raise RuntimeError("jaxbind: the host callback that only marks a program was called")


def hold_as_host_callback(ctx) -> None:
    """Register a host callback nothing calls, once per program: JAX then runs the program as one
    that holds ``jax.pure_callback``'s (synchronously, so that the call raises a callback's failure)."""
    module = ctx.module_context
    if _FFI_HOST_CALLBACKS:
        entry = _never_called
    else:  # pragma: no cover - jaxlib 0.5
        backend = module.get_backend()
        held = _capsules.get(id(backend))
        if held is None or held[0] is not backend:
            held = _capsules[id(backend)] = (
                backend,
                backend.get_emit_python_callback_descriptor(_never_called, [], [])[1],
            )
        entry = held[1]
    if not any(h is entry for h in module.host_callbacks):
        module.add_host_callback(entry)


def lowering_for_export(ctx) -> bool:
    """Whether this lowering makes a program for ``jax.export`` (serialized, run elsewhere)."""
    parameters = getattr(ctx.module_context, "lowering_parameters", None)
    return bool(getattr(parameters, "for_export", False))


def hold_weakly_in_jax_caches(param_type: type) -> None:
    """Let JAX's caches keyed by primitive parameters hold ``param_type`` weakly.

    JAX caches the abstract evaluation of a primitive by its parameters
    (2048 entries, strong references except for the types it lists as weak
    keys, such as jaxprs): without this, an op's definition, and so its
    callbacks and what they capture, would outlive every program that uses
    it until 2048 newer entries pushed it out.
    """
    try:
        from jax._src import util as _util

        _util.weakref_cache_key_types.add(param_type)
    except (ImportError, AttributeError):  # a JAX without the set: nothing holds it there
        pass


def lru_cleared_with_jax_caches(max_size: int):
    """A ``functools.lru_cache(max_size)`` decorator whose entries ``jax.clear_caches()`` drops with
    JAX's own caches (``jax._src.util.cache``, whose registry of caches differs between versions)."""
    from jax._src import util as _util

    return _util.cache(max_size=max_size, trace_context_in_key=False)


def uses_shardy() -> bool:
    """Whether XLA partitions programs with Shardy (JAX's default from 0.7) rather than GSPMD."""
    return bool(getattr(jax.config, "jax_use_shardy_partitioner", False))

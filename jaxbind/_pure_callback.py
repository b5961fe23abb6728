"""``jaxbind.pure_callback``: ``jax.pure_callback``'s signature and semantics, run by the trampoline.

A call flattens ``(args, kwargs)`` and the result specs as JAX does and binds
an op made once per callback, argument structure, ``vmap_method`` and
``sharding``: a nonlinear op without derivatives whose one Python callback
unflattens the views of XLA's buffers, calls the user's function and writes
its results into XLA's output buffers (one copy). The result specs travel as
the op's kwargs, so one op serves every shape.

The ops of a callback are kept on the callback itself (or on the object a
bound method is bound to), so that they live exactly as long as it does: the
op holds the callback, and a table on the callback that holds the op is a
cycle the collector frees with it. Callables that take no attributes
(NumPy's ufuncs, builtins) live for the process anyway; their ops are kept in
a module table.
"""

from __future__ import annotations

import logging
import sys
import threading
import types
from typing import Any, Callable, Optional

import jax
import numpy as np

from ._definition import CallbackKind, Family, OpDef, OpKind
from ._jax_compat import at_top_level, canonicalize_dtype
from ._op import Op

__all__ = ["pure_callback", "VMAP_METHODS"]

# What jax.pure_callback accepts; "sequential_unrolled" walks like "sequential"
# (unrolling changes nothing a pure callback can see).
VMAP_METHODS = ("sequential", "sequential_unrolled", "expand_dims", "broadcast_all",
                "legacy_vectorized", None)
_OP_METHOD = {"sequential_unrolled": "sequential"}

_TABLE = "__jaxbind_pure_callback_ops__"
getrefcount = sys.getrefcount
copyto = np.copyto
_log = logging.getLogger("jaxbind")
_UNKEPT = 3  # references to an input view nobody kept: the tuple, the loop, getrefcount's argument
_lock = threading.Lock()
_permanent: dict = {}  # (callback, ...) -> op, for callables that take no attributes


def _name_of(callback) -> str:
    name = getattr(callback, "__qualname__", None) or getattr(callback, "__name__", None)
    return f"pure_callback({name or type(callback).__name__})"


class _OpTable(dict):
    """A callback's ops, kept in its ``__dict__``; pickled or deep-copied with the callback as an
    empty table (cloudpickle copies a closure's ``__dict__``: its ops belong to this process)."""

    __slots__ = ()

    def __reduce__(self):
        return (_OpTable, ())


def _holder(callback):
    """The object whose ``__dict__`` keeps the callback's ops, or None."""
    owner = callback.__self__ if isinstance(callback, types.MethodType) else callback
    if isinstance(owner, type):  # a classmethod's class: its __dict__ is a read-only mapping
        return None
    try:
        vars(owner)
    except TypeError:
        return None
    return owner


def _op_for(callback, in_tree, vmap_method, sharding) -> Op:
    key = (in_tree, _OP_METHOD.get(vmap_method, vmap_method), sharding)
    method = isinstance(callback, types.MethodType)  # a new object at each attribute access
    if method:
        key = (callback.__func__,) + key
    holder = _holder(callback)
    with _lock:
        if holder is None:
            table = _permanent
            key = (callback,) + key
        else:
            table = vars(holder).get(_TABLE)
            if table is None:
                table = _OpTable()
                try:
                    setattr(holder, _TABLE, table)
                except (AttributeError, TypeError):  # a __dict__ that refuses new names
                    table, key = _permanent, (callback,) + key
        entry = table.get(key)
        # (a wrapper made by functools.wraps copies the wrapped function's __dict__, table included)
        if entry is not None and (entry[0] is callback or (method and entry[0] == callback)):
            return entry[1]
        op = _make_op(callback, in_tree, key[-2], sharding)
        table[key] = (callback, op)
        return op


def _make_op(callback, in_tree, vmap_method, sharding) -> Op:
    name = _name_of(callback)
    unflatten = in_tree.unflatten
    leaves = jax.tree_util.tree_leaves
    n_args = in_tree.num_leaves
    # Positional arrays only, the common call: no pytree to rebuild.
    positional = in_tree == jax.tree_util.tree_structure((tuple(range(n_args)), {}))

    def run(out, args, kwargs_dump):
        # Views of the views: one the callback keeps (JAX's callbacks may keep
        # their inputs) gets a copy of its values when the call ends, instead
        # of being cut off.
        mine = tuple([v.view() for v in args]) if n_args != 1 else (args[0].view(),)
        try:
            if positional:
                result = callback(*mine)
            else:
                a, k = unflatten(mine)
                result = callback(*a, **k)
                a = k = None
            if (type(result) is np.ndarray and len(out) == 1 and result.shape == out[0].shape
                    and result.dtype == out[0].dtype):
                copyto(out[0], result)  # the common case, checked without flattening
            else:
                _write_results(name, out, result, leaves)
            result = None
        except BaseException:
            _log.exception("jax.pure_callback failed (run by jaxbind.pure_callback as op '%s')", name)
            raise
        finally:
            for view in mine:
                if getrefcount(view) > _UNKEPT:
                    view.__setstate__(view.__reduce__()[2])

    def abstract(*args, result):
        return result

    family = Family(callbacks=(run,), abstracts=(abstract,), kinds=(CallbackKind.FORWARD,),
                    labels=("forward",), linear=False)
    definition = OpDef(OpKind.NONLINEAR, name, (family,), 0, False, vmap_method,
                       callback_sharding=("pure_callback", sharding))
    return Op(definition)


def _write_results(name, out, result, leaves):
    """The callback's results into XLA's buffers, checked as JAX checks them."""
    results = leaves(result)
    if len(results) != len(out):
        raise RuntimeError(
            f"{name}: Mismatched number of outputs from callback. Expected: {len(out)}, "
            f"Actual: {len(results)}")
    for i, (o, r) in enumerate(zip(out, results)):
        r = np.asarray(r)
        if r.shape != o.shape:
            raise RuntimeError(
                f"{name}: Incorrect output shape for return value #{i}: Expected: {o.shape}, "
                f"Actual: {r.shape}")
        if r.dtype != o.dtype:
            if o.dtype == np.bool_ and r.dtype == jax.dtypes.float0:  # a float0 output: no data
                o[...] = False
                continue
            if canonicalize_dtype(r.dtype) != o.dtype:
                raise RuntimeError(
                    f"{name}: Incorrect output dtype for return value #{i}: Expected: {o.dtype}, "
                    f"Actual: {canonicalize_dtype(r.dtype)}")
        o[...] = r


def _check_spec(spec):
    try:
        shape, dtype = tuple(spec.shape), np.dtype(spec.dtype)
    except (AttributeError, TypeError) as err:
        raise TypeError(
            "jaxbind.pure_callback: each leaf of result_shape_dtypes needs .shape and .dtype "
            f"(a jax.ShapeDtypeStruct or an array), got {spec!r:.100}") from err
    if dtype != jax.dtypes.float0 and canonicalize_dtype(dtype) != dtype:
        raise ValueError(
            "result_shape_dtypes cannot specify 64-bit types when `jax_enable_x64` is disabled")
    return tuple(int(d) for d in shape), dtype


def _eager(callback, flat_args, in_tree, specs, out_tree):
    """Outside any trace, as JAX does: the callback gets jax Arrays on a CPU device."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError as err:
        raise RuntimeError(
            "jaxbind.pure_callback found no local CPU device to place the inputs on: list "
            "\"cpu\" in --jax_platforms or JAX_PLATFORMS.") from err
    args, kwargs = in_tree.unflatten(jax.device_put(list(flat_args), cpu))
    with jax.default_device(cpu):
        result = callback(*args, **kwargs)
    outs = [np.empty(shape, np.bool_ if dtype == jax.dtypes.float0 else dtype) for shape, dtype in specs]
    _write_results(_name_of(callback), outs, result, jax.tree_util.tree_leaves)
    arrays = [np.zeros(o.shape, jax.dtypes.float0) if dtype == jax.dtypes.float0 else jax.device_put(o, cpu)
              for o, (_, dtype) in zip(outs, specs)]
    return out_tree.unflatten(arrays)


def pure_callback(callback: Callable[..., Any], result_shape_dtypes: Any, *args: Any,
                  sharding: Optional[jax.sharding.Sharding] = None, vmap_method: Optional[str] = None,
                  **kwargs: Any):
    """Call a pure Python function from JAX: :func:`jax.pure_callback`, run by jaxbind's core.

    The signature and semantics are :func:`jax.pure_callback`'s, so that
    replacing the name is the whole port; the call goes through jaxbind's
    trampoline (about 1/40 of ``jax.pure_callback``'s cost per call; see the
    porting guide).

    Parameters
    ----------
    callback : callable
        ``callback(*args, **kwargs)`` with the pytrees of arrays given; returns
        a pytree of arrays (or NumPy scalars, or anything ``np.asarray``
        takes) with the structure, shapes and dtypes of
        ``result_shape_dtypes``. Inside compiled code it receives read-only
        NumPy arrays that view XLA's buffers (valid during the call: keep a
        copy, ``np.array(x)``, not the array); called outside any trace, jax
        Arrays on a CPU device, as JAX passes them. Assumed pure: it may run
        any number of times, or not at all when its results are unused.
    result_shape_dtypes : pytree
        Leaves with ``.shape`` and ``.dtype`` (``jax.ShapeDtypeStruct``, arrays).
    *args, **kwargs : pytrees
        The arguments, pytrees of arrays or scalars, every dtype JAX has
        (``float0`` arguments reach the callback as bool arrays of zeros).
    sharding : jax.sharding.SingleDeviceSharding, optional
        The device the callback runs on in a sharded program (default: the
        first of the program's devices).
    vmap_method : {None, "sequential", "sequential_unrolled", "expand_dims", "broadcast_all", "legacy_vectorized"}
        How ``vmap`` hands a batch to the callback: None raises
        ``NotImplementedError``; "sequential" (and "sequential_unrolled")
        calls it once per element, the loop run in jaxbind's compiled core;
        "expand_dims" calls it once with the batch as a leading axis and a
        size-1 axis where an argument is not mapped; "broadcast_all" with
        every argument broadcast over the batch; "legacy_vectorized" with
        unmapped arguments as they are.

    Returns
    -------
    pytree of jax.Array
        With the structure of ``result_shape_dtypes``.

    Raises
    ------
    TypeError
        If a leaf of ``result_shape_dtypes`` has no ``.shape`` or ``.dtype``, or
        ``sharding`` is not a ``jax.sharding.Sharding``.
    ValueError
        Under ``jax.grad``/``jax.jvp`` (as JAX's does: wrap it in
        ``jax.custom_jvp`` or ``jax.custom_vjp``), for an unknown
        ``vmap_method``, or for a 64-bit result type without ``jax_enable_x64``.
    NotImplementedError
        Under ``jax.vmap`` when ``vmap_method`` is None.
    jax.errors.JaxRuntimeError
        When the callback raises (its type and message are in the text) or
        returns results of another number, shape or dtype than declared.

    Examples
    --------
    >>> x = jnp.linspace(0.0, 1.0, 4)
    >>> f = jax.jit(lambda v: jaxbind.pure_callback(np.sin, v, v))
    >>> bool(jnp.allclose(f(x), jnp.sin(x)))
    True
    """
    if vmap_method not in VMAP_METHODS:
        raise ValueError(
            f"vmap_method must be on of the allowed methods {list(VMAP_METHODS)}, but got: {vmap_method}")
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(f"jaxbind.pure_callback: sharding must be a jax.sharding.Sharding, got {sharding!r:.100}")
    flat_args, in_tree = jax.tree_util.tree_flatten((args, kwargs))
    flat_specs, out_tree = jax.tree_util.tree_flatten(result_shape_dtypes)
    specs = tuple(_check_spec(s) for s in flat_specs)
    if at_top_level() and not any(isinstance(a, jax.core.Tracer) for a in flat_args):
        return _eager(callback, flat_args, in_tree, specs, out_tree)
    op = _op_for(callback, in_tree, vmap_method, sharding)
    if not flat_specs:  # nothing to compute: a pure callback with no results is never called
        return out_tree.unflatten([])
    outs = op(*flat_args, result=specs)
    return out_tree.unflatten(outs)

"""``jaxbind.pure_callback``: ``jax.pure_callback``'s signature and semantics, run by the trampoline.

A call flattens ``(args, kwargs)`` and the result specs as JAX does and binds
an op made for the callback, argument structure, ``vmap_method`` and
``sharding``: a nonlinear op without derivatives whose one Python callback, a
:class:`_Runner`, unflattens the views of XLA's buffers, calls the user's
function and writes its results into XLA's output buffers (one copy). The
result specs travel as the op's kwargs (dtypes by name), so one op serves
every shape.

Nothing is stored on the callback or its owner: the op's definition holds
the callback, and lives as long as something holds that (a jaxpr, a compiled
program, JAX's caches; and the definitions of the last 8 callbacks traced, a
cache ``jax.clear_caches()`` empties, see :func:`_recent`), as
``jax.pure_callback``'s callback lives as long as its programs. A weak table
finds the definition of a callback while it lives; runners compare by the
callback's identity, so a definition made again for the same callback is
equal to the first.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ._definition import CallbackKind, Family, JaxCallback, OpDef, OpKind
from ._effects import exclusive_for
from ._jax_compat import at_top_level, lru_cleared_with_jax_caches
from ._kept_views import BY_ITEM, UNKEPT, give_copies, held, own_copy
from ._op import Op
from ._pure_callback_checks import check_arguments, check_spec, dtype_named, flatten_arguments, write_results
from ._runtime import format_callback_error
from ._vmap_methods import DOOR_PURE_CALLBACK, accepted, named

__all__ = ["pure_callback"]

getrefcount = sys.getrefcount
copyto = np.copyto
# JAX's record of a failing callback, which code filters by logger and text (Equinox does).
_jax_log = logging.getLogger("jax._src.callback")
_lock = threading.Lock()
# (what identifies the callback, structure, vmap method, sharding) -> its op's definition, while
# something (a jaxpr, a compiled program, JAX's caches) holds that
_definitions: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _op_name_for(callback, door: str = "pure_callback") -> str:
    name = getattr(callback, "__qualname__", None) or getattr(callback, "__name__", None)
    return f"{door}({name or type(callback).__name__})"


def _identity(callback) -> tuple:
    """What tells a callback apart, by identity only (never the user's ``__eq__`` or ``__hash__``).

    A bound method is a new object at each attribute access, so it is its
    object and function; a builtin method (``rng.normal``) its object and
    name. Anything else is itself.
    """
    kind = type(callback)
    if kind is types.MethodType:
        return (id(callback.__self__), id(callback.__func__))
    if kind is types.BuiltinMethodType and not isinstance(callback.__self__, (types.ModuleType, type(None))):
        return (id(callback.__self__), callback.__qualname__)
    return (id(callback),)


def _same(a, b) -> bool:
    """Whether two callbacks are one: identical, or bound methods of one function to one object."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind is types.MethodType:
        return a.__self__ is b.__self__ and a.__func__ is b.__func__
    if kind is types.BuiltinMethodType:  # (its own comparison: the object by identity, the C function)
        return types.BuiltinMethodType.__eq__(a, b) is True
    return False


class _Runner(functools.partial):
    """The op's one Python callback: ``run(out, args, kwargs_dump)`` with the user's callback.

    Equal to another runner of the same callback (by identity, see
    :func:`_same`) and argument structure: the definitions of two ops made
    for one callback are equal, so JAX's caches and the call sites serve both.
    """

    # definition: the op's, which a call site holds through its runner, so that a program's call
    # made after its site was released (see _recent) finds the op as long as the site was alive
    __slots__ = ("target", "in_tree", "definition", "_hash")

    def __new__(cls, run, target, in_tree):
        self = super().__new__(cls, run)
        self.target, self.in_tree, self.definition = target, in_tree, None
        self._hash = hash((_identity(target), in_tree))
        return self

    def __eq__(self, other):
        return self is other or (
            isinstance(other, _Runner) and _same(self.target, other.target) and self.in_tree == other.in_tree
        )

    def __hash__(self):
        return self._hash

    def __copy__(self):  # a value, as the function it replaces was
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):  # (a runner calls a function of this process)
        raise TypeError(f"the op of jaxbind.{_op_name_for(self.target)} cannot be pickled")


def _op_for(callback, in_tree, vmap_method, sharding, effect=None) -> Op:
    """The op of a callback, structure, ``vmap_method``, ``sharding`` and effect (``jaxbind.io_callback``'s):
    of the live definition, or a new one."""
    method = named(vmap_method)  # (checked by pure_callback, in JAX's words)
    key = (_identity(callback), in_tree, method, sharding, effect)
    with _lock:
        definition = _definitions.get(key)
        # (the definition holds its callback, so while it lives no other object has the callback's id)
        if definition is None or not _same(definition.families[0].callbacks[0].target, callback):
            definition = _definitions[key] = _make_definition(callback, in_tree, method, sharding, effect)
    _recent(definition)
    return Op(definition)


@lru_cleared_with_jax_caches(max_size=8)
def _recent(definition: OpDef) -> OpDef:
    """Hold the definitions of the last few callbacks traced, until ``jax.clear_caches()``.

    A program's call sites live as long as JAX's Python half of its
    executable, and a temporary ``jax.jit`` drops that as soon as it has
    queued the program: a call XLA runs after that (on its worker threads, a
    sharded program) makes its site anew from the program's description,
    which needs the op's definition alive in this process. A jaxbind op's
    user holds the op; the definition of a pure callback is held by nothing
    else once the jaxpr is gone. (A site holds its definition while it lives:
    see :class:`_Runner`.)
    """
    return definition


def _abstract(*args, result):
    """The op's abstract: the result specs, their dtypes NumPy's own objects (never unpickled copies)."""
    return tuple((shape, dtype_named(name)) for shape, name in result)


def _make_definition(callback, in_tree, vmap_method, sharding, effect=None) -> OpDef:
    door = "pure_callback" if effect is None else "io_callback"
    name = _op_name_for(callback, door)
    runner = _Runner(_make_run(callback, in_tree, name, f"jax.{door} failed"), callback, in_tree)
    family = Family(
        callbacks=(runner,), abstracts=(_abstract,), kinds=(CallbackKind.FORWARD,), labels=("forward",), linear=False
    )
    runner.definition = OpDef(
        OpKind.NONLINEAR,
        name,
        (family,),
        0,
        False,
        vmap_method,
        jax_callback=JaxCallback(sharding),
        effect=effect,
        exclusive=None if effect is None else _exclusive(callback),
    )
    return runner.definition


# what identifies a callback -> the lock all calls of its io_callback ops hold, while one lives
_exclusives: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def exclusive_of(callback):
    """The lock of a callback's io_callback ops (one per callback, made on first use)."""
    with _lock:
        return _exclusive(callback)


def _exclusive(callback):
    """One lock per callback (under ``_lock``): its calls never overlap, whatever structure each passes.

    (A definition holds its callback and its lock: while the lock lives, no other object has the
    callback's id.)
    """
    key = _identity(callback)
    lock = _exclusives.get(key)
    if lock is None:
        lock = _exclusives[key] = exclusive_for("io", False)
    return lock


def _make_run(callback, in_tree, name, failed):
    unflatten = in_tree.unflatten
    leaves = jax.tree_util.tree_leaves
    n_args = in_tree.num_leaves
    # Positional arrays only, the common call: no pytree to rebuild.
    positional = in_tree == jax.tree_util.tree_structure((tuple(range(n_args)), {}))

    def run(out, args, kwargs_dump):
        # Views of the views: one the callback keeps (JAX's callbacks may keep
        # their inputs) gets a copy of its values when the call ends, instead
        # of being cut off; so does a view derived from one (see _keep_values).
        mine = tuple([v.view() for v in args]) if n_args != 1 else (args[0].view(),)
        a = k = result = None
        try:
            try:
                if positional:
                    result = callback(*mine)
                else:
                    a, k = unflatten(mine)
                    result = callback(*a, **k)
            except BaseException:
                _jax_log.exception(failed)
                raise
            a = k = None
            if (
                type(result) is np.ndarray
                and len(out) == 1
                and result.shape == out[0].shape
                and result.dtype == out[0].dtype
            ):
                copyto(out[0], result)  # the common case, checked without flattening
            elif len(out) == 1 and type(result) is out[0].dtype.type and not out[0].shape:
                out[0][()] = result  # a NumPy scalar of the dtype (a ufunc's result on a 0-d input)
            else:
                write_results(name, out, result, leaves)
            result = None
        finally:
            a = k = result = None
            # An input held by more than its tuple and our view (its base) is held by a view
            # derived from ours, since NumPy points every view of a view at the first array with
            # no base. The counts' baselines are measured (_kept_views): one input's are read
            # through its tuple's item, the common case's fast path.
            if n_args == 1:
                if getrefcount(args[0]) > BY_ITEM + 1:
                    mine = None
                    _keep_values(args)
                elif getrefcount(mine[0]) > BY_ITEM:
                    own_copy(mine[0])
            elif held(args, UNKEPT + 1):
                mine = None
                _keep_values(args)
            else:
                for view in held(mine, UNKEPT):
                    own_copy(view)

    return run


def _keep_values(views) -> None:
    """Give every array the callback kept that views an input a copy of its values, or nothing.

    Garbage first (a closure over a slice, left in a cycle) is not keeping:
    the youngest generations are collected, as the core does. Whatever is
    still held is searched for on the heap (only now: it costs a walk of the
    heap); if something that cannot be given a copy reaches the memory (a
    memoryview, an iterator, ``a.ctypes``), nothing is copied and the call
    fails as an ordinary op's does (the core's kept-view error).
    """
    for generation in (0, 1):
        gc.collect(generation)
        if not _still_held(views):
            return
    give_copies(views)


def _still_held(views) -> bool:
    return bool(held(views, UNKEPT))


def _eager(callback, flat_args, in_tree, specs, out_tree, door="pure_callback", exclusive=None):
    """Outside any trace, as JAX does: the callback gets jax Arrays on a CPU device, and its
    failure is a ``JaxRuntimeError`` with the jitted call's text, logged as JAX logs it."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError as err:
        raise RuntimeError(
            f"jaxbind.{door} found no local CPU device to place the inputs on: list "
            '"cpu" in --jax_platforms or JAX_PLATFORMS.'
        ) from err
    name = _op_name_for(callback, door)
    args, kwargs = in_tree.unflatten(jax.device_put(list(flat_args), cpu))
    try:
        try:
            with jax.default_device(cpu), exclusive or contextlib.nullcontext():
                result = callback(*args, **kwargs)
        except BaseException:
            _jax_log.exception(f"jax.{door} failed")
            raise
        outs = [np.empty(shape, np.bool_ if dtype == jax.dtypes.float0 else dtype) for shape, dtype, _ in specs]
        write_results(name, outs, result, jax.tree_util.tree_leaves)
    except Exception as err:
        # (what the jitted call raises: the core formats a callback's exception the same way)
        raise jax.errors.JaxRuntimeError("INTERNAL: " + format_callback_error(f"op '{name}'", err)) from err
    arrays = [
        np.zeros(o.shape, jax.dtypes.float0) if dtype == jax.dtypes.float0 else jax.device_put(o, cpu)
        for o, (_, dtype, _) in zip(outs, specs)
    ]
    return out_tree.unflatten(arrays)


def pure_callback(
    callback: Callable[..., Any],
    result_shape_dtypes: Any,
    *args: Any,
    sharding: jax.sharding.Sharding | None = None,
    vmap_method: str | None = None,
    **kwargs: Any,
):
    """Call a pure Python function from JAX: :func:`jax.pure_callback`, run by jaxbind's core.

    The signature and semantics are :func:`jax.pure_callback`'s, so that
    replacing the name is the whole port; the call goes through jaxbind's
    trampoline (about 1/18 to 1/23 of ``jax.pure_callback``'s cost per call; see the
    porting guide).

    Parameters
    ----------
    callback : callable
        ``callback(*args, **kwargs)`` with the pytrees of arrays given; returns
        a pytree of arrays (or NumPy scalars, or anything ``np.asarray``
        takes) with the structure, shapes and dtypes of
        ``result_shape_dtypes``. Inside compiled code it receives read-only
        NumPy arrays that view XLA's buffers; one it keeps past the call (or
        a view of one, ``x[1:]``) is given a copy of its values then, while a
        memoryview, iterator or ``x.ctypes`` of one kept past the call fails
        it (keep ``np.array(x)`` there). Called outside any trace, it receives
        jax Arrays on a CPU device, as JAX passes them. Assumed pure: it may
        run any number of times, or not at all when its results are unused.
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
        a byte-swapped dtype (``>f8`` on this machine: JAX has no such arrays);
        if a leaf of the arguments is not an array or scalar (a function
        passed as ``setup=``, which only jaxbind's ops take); or if
        ``sharding`` is not a ``jax.sharding.Sharding``.
    ValueError
        Under ``jax.grad``/``jax.jvp`` (as JAX's does: wrap it in
        ``jax.custom_jvp`` or ``jax.custom_vjp``), for an unknown
        ``vmap_method``, or for a 64-bit result type without ``jax_enable_x64``.
    NotImplementedError
        Under ``jax.vmap`` when ``vmap_method`` is None; when a program that
        calls it is exported (``jaxbind.export``), as ``jax.export`` refuses
        ``jax.pure_callback``.
    jax.errors.JaxRuntimeError
        From the call itself, as JAX's: a program that calls a pure callback
        runs before the call returns. When the callback raises (its type, message and traceback are in the
        text; an eager call chains the original exception too; the failure is
        logged as JAX logs it, "jax.pure_callback failed" on the logger
        ``jax._src.callback``) or returns results of another number, shape or
        dtype than declared.

    Examples
    --------
    >>> x = jnp.linspace(0.0, 1.0, 4)
    >>> f = jax.jit(lambda v: jaxbind.pure_callback(np.sin, v, v))
    >>> bool(jnp.allclose(f(x), jnp.sin(x)))
    True
    """
    if vmap_method not in accepted(DOOR_PURE_CALLBACK):  # (JAX's words, its typo included)
        raise ValueError(
            f"vmap_method must be on of the allowed methods {list(accepted(DOOR_PURE_CALLBACK))}, "
            f"but got: {vmap_method}"
        )
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(f"jaxbind.pure_callback: sharding must be a jax.sharding.Sharding, got {sharding!r:.100}")
    name = _op_name_for(callback)
    flat_args, in_tree = flatten_arguments(args, kwargs, name)
    check_arguments(flat_args, args, kwargs, name)
    flat_specs, out_tree = jax.tree_util.tree_flatten(result_shape_dtypes)
    specs = tuple(check_spec(s, i, name) for i, s in enumerate(flat_specs))
    if at_top_level() and not any(isinstance(a, jax.core.Tracer) for a in flat_args):
        return _eager(callback, flat_args, in_tree, specs, out_tree)
    op = _op_for(callback, in_tree, vmap_method, sharding)
    if not flat_specs:  # nothing to compute: a pure callback with no results is never called
        return out_tree.unflatten([])
    outs = op(*flat_args, result=tuple((shape, name) for shape, _, name in specs))
    return out_tree.unflatten(outs)

"""Views a callback kept: the heap sweep that cuts off everything else that reaches their memory,
and, for ``jaxbind.pure_callback``, private copies for the arrays its callback kept.

The compiled core (``views.cc``) calls :func:`retire_overlapping`, which
``_runtime`` hands it at import, when a callback kept one of its arrays, and
only then: the sweep walks the heap. ``jaxbind.pure_callback``'s callback may
keep its inputs, as ``jax.pure_callback``'s may: :func:`own_copy` and
:func:`give_copies` give what it kept copies of their values before the core
looks (an ordinary op's callback that keeps a view fails, as its API says).
"""

from __future__ import annotations

import collections
import functools
import gc
import itertools
import sys
import threading
import types
import weakref

import jax
import numpy as np

from . import _trampoline

__all__ = ["UNKEPT", "give_copies", "held", "own_copy", "retire_overlapping"]

_PROXY_TYPES = (weakref.ProxyType, weakref.CallableProxyType)
_CTYPES_TYPE = type(np.empty(0).ctypes)  # what ``array.ctypes`` is (a class private to NumPy)
# One heap sweep at a time: a sweep's lists hold every object of the heap, and a sweep running
# beside it on another thread finds those lists in the heap and follows them (each of several
# callbacks that kept a view at once swept the others' lists: the process grew past 20 GB). Re-entrant:
# a sweep may run a finalizer whose callback keeps a view.
_SWEEP_LOCK = threading.RLock()


def _one_sweep_at_a_time(sweep):
    @functools.wraps(sweep)
    def locked(*args):
        with _SWEEP_LOCK:
            return sweep(*args)

    return locked


@_one_sweep_at_a_time
def retire_overlapping(views):
    """Cut off every other array and memoryview that reaches the memory of ``views``.

    Called by the trampoline when a callback kept one of its arrays (only then:
    it walks the heap), before the views themselves are retired. An overlapping array is a
    NumPy array whose memory overlaps a view's, whatever its ``base`` chain (a
    slice, ``np.frombuffer``, a DLPack import), unless that chain ends at a JAX
    array (the memory is that array's: the user's own zero-copy view of an
    input) or at nothing (another call's view); a memoryview of either; a
    JAX array that imported an output's memory without copying; and the
    objects that copied a pointer into that memory (:func:`_pointer_holders`).
    """
    ranges = [r for r in map(_byte_range, views) if r is not None]
    kept_ids = {id(v) for v in views}
    holders = _heap_containers()

    def overlaps(array):
        r = _byte_range(array)
        return r is not None and any(r[0] < high and low < r[1] for low, high in ranges)

    referents = gc.get_referents(*holders)
    overlapping = {}
    for obj in referents:
        if type(obj) in _PROXY_TYPES:
            continue
        if (
            isinstance(obj, np.ndarray)
            and id(obj) not in kept_ids
            and not obj.flags.owndata
            and id(obj) not in overlapping
            and overlaps(obj)
        ):
            owner = _owner(obj, kept_ids)
            if owner is True or (owner is not None and not isinstance(owner, jax.Array)):
                overlapping[id(obj)] = obj
    reaching = kept_ids | set(overlapping)
    memoryviews = []
    for holder in holders:
        if isinstance(holder, memoryview):
            try:
                if id(holder.obj) in reaching:
                    memoryviews.append(holder)
            except ValueError:  # released
                pass
    holders_of_pointers = _pointer_holders(itertools.chain(holders, referents), reaching, overlaps)
    for array in overlapping.values():
        _trampoline.retire(array)
    # A JAX array imported without a copy (jnp.from_dlpack of an output) is
    # deleted. Only outputs' memory counts: an input's may be the caller's own
    # JAX array, and arrays still being computed are never touched.
    out_ranges = [_byte_range(v) for v in views if v.flags.writeable and v.size]
    for holder in holders:
        if isinstance(holder, jax.Array) and out_ranges and _shares_memory(holder, out_ranges):
            holder.delete()
    for view in memoryviews:
        try:
            view.release()
        except BufferError:  # exported further: its users are arrays, retired above
            pass
    _cut_off_pointer_holders(holders_of_pointers, views)


def held(views, unkept: int) -> tuple:
    """The ``views`` that more than ``unkept`` references hold (see :data:`UNKEPT`); mostly ``()``."""
    found = ()
    for view in views:
        if getrefcount(view) > unkept:
            found += (view,)
    return found


def _measure_unkept() -> int:
    """What :func:`held` counts of an object that only its tuple holds (the tuple, the loop's name,
    and getrefcount's argument where the interpreter counts it), measured by :func:`held` itself.

    Never assumed: CPython 3.14 passes a local name to a call as a borrowed reference, one fewer
    than 3.11 and 3.13 count, and borrows or not by the shape of the code around the call (inside
    a ``finally`` an exception passes through, it does not), so the count is read by the one
    function every count of a view is read by.
    """
    lone = (object(),)
    return next(count for count in range(16) if not held(lone, count))


def _measure_by_item() -> int:
    """What ``getrefcount(items[i])`` says of an object only the tuple ``items`` holds (an item's
    reference is the caller's own, borrowed by no interpreter so far): measured all the same."""
    lone = (object(),)
    return getrefcount(lone[0])


getrefcount = sys.getrefcount
UNKEPT = _measure_unkept()
BY_ITEM = _measure_by_item()


def own_copy(array) -> None:
    """Give an array that views XLA's memory a private copy of its values (read-only if it was)."""
    writeable = array.flags.writeable
    np.ndarray.__setstate__(array, np.ndarray.__reduce__(array)[2])
    if not writeable:
        array.flags.writeable = False


@_one_sweep_at_a_time
def give_copies(views) -> bool:
    """Give every array that reaches the memory of ``views`` a private copy of its values, or none.

    For ``jaxbind.pure_callback``, whose callback may keep its inputs and views
    derived from them (``x[1:]``, ``x.reshape(2, -1)``, ``x.view(np.int64)``):
    called when something still holds the trampoline's input ``views`` after
    the call (refcounts say so, only then: it walks the heap). Copies are
    given only if every holder is accounted for and reaches the memory only
    through the array it holds (a list, a dict, an attribute, a frame), so
    that re-pointing the array is all it takes: a memoryview, an iterator
    (``x.flat``, ``np.nditer``), ``x.ctypes`` or anything the collector cannot
    see copied a pointer into the memory, and then nothing is copied and the
    core refuses the call as it refuses an ordinary op's (and cuts everything
    off). Returns whether the copies were given.
    """
    if any(weakref.getweakrefcount(view) for view in views):  # a weak reference to the core's own view
        return False
    view_ids = {id(view) for view in views}
    referents = gc.get_referents(*_heap_containers())
    # The arrays the heap holds, each as often as it is held (types first: a weak proxy's
    # type is its own, and the referents are many).
    kinds = frozenset(kind for kind in set(map(type, referents)) if issubclass(kind, np.ndarray))
    arrays = [obj for obj in referents if type(obj) in kinds]
    referents = None
    refs = collections.Counter(map(id, arrays))
    found = {}
    for array in arrays:
        key = id(array)
        if key not in found and key not in view_ids and _owner(array, view_ids) is True:
            found[key] = array
    arrays = array = None
    if not all(map(_plain_holder, gc.get_referrers(*found.values()))):
        return False
    # Every reference must be one of those counted: the heap's, and the bases of the arrays found.
    bases = collections.Counter(id(array.base) for array in found.values())
    for key in found:
        if getrefcount(found[key]) != BY_ITEM + refs[key] + bases[key]:  # (+ `found`)
            return False
    for i in range(len(views)):
        if getrefcount(views[i]) != BY_ITEM + bases[id(views[i])]:  # (+ their tuple)
            return False
    for array in found.values():
        own_copy(array)
    return True


# Holders that reach an array only through their reference to it, so that the copy the array is
# given is what they see; instances of classes written in Python too (their attributes).
_PLAIN_HOLDERS = frozenset(
    {
        list,
        tuple,
        dict,
        set,
        frozenset,
        collections.deque,
        collections.OrderedDict,
        collections.defaultdict,
        types.CellType,
        types.FrameType,
        types.GeneratorType,
        types.CoroutineType,
        types.AsyncGeneratorType,
        types.MethodType,
        types.BuiltinMethodType,
        types.SimpleNamespace,
        object,
        np.ndarray,
    }
)
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement (or type())


def _plain_holder(obj) -> bool:
    kind = type(obj)
    if kind in _PLAIN_HOLDERS:
        return True
    if kind is _CTYPES_TYPE or kind in _PROXY_TYPES:  # `x.ctypes` holds a pointer besides its array
        return False
    return all(base.__flags__ & _HEAP_TYPE or base in _PLAIN_HOLDERS for base in kind.__mro__)


def _heap_containers():
    """Every object that can hold a reference the collector can see.

    The collector tracks most containers; it stops tracking tuples and dicts
    that hold only objects it does not track (NumPy arrays among them), so
    ``(x[1:],)`` kept in a list is found by following those too.
    """
    # A weak proxy whose object died raises on isinstance(): none holds anything.
    containers = [obj for obj in gc.get_objects() if type(obj) not in _PROXY_TYPES]
    seen = set(map(id, containers))
    frontier = containers
    while frontier:
        found = []
        # (tuples and dicts picked first: the referents are several times the containers)
        for obj in [obj for obj in gc.get_referents(*frontier) if type(obj) in _UNTRACKED_KINDS]:
            if not gc.is_tracked(obj) and id(obj) not in seen:
                seen.add(id(obj))
                found.append(obj)
        containers.extend(found)
        frontier = found
    return containers


_UNTRACKED_KINDS = frozenset({tuple, dict})


def _byte_range(array):
    """The first and one-past-last byte addresses of an array's memory (None if it has none)."""
    if array.size == 0:
        return None
    start = array.__array_interface__["data"][0]
    low = high = start
    for n, stride in zip(array.shape, array.strides):
        extent = (n - 1) * stride
        low, high = (low + extent, high) if extent < 0 else (low, high + extent)
    return low, high + array.itemsize


def _owner(array, kept_ids):
    """Follow an array's ``base`` chain (through memoryviews too) to its end.

    Returns True if the chain passes through a kept view, else the object at its end.
    """
    obj = array.base
    while obj is not None:
        if id(obj) in kept_ids:
            return True
        if isinstance(obj, np.ndarray):
            obj = obj.base
        elif isinstance(obj, memoryview):
            try:
                obj = obj.obj
            except ValueError:  # released
                return None
        else:
            return obj
    return None


def _shares_memory(array, ranges) -> bool:
    """Whether a computed, single-buffer JAX array's memory starts inside one of ``ranges``."""
    try:
        if array.is_deleted() or not array.is_ready():
            return False
        start = array.unsafe_buffer_pointer()
    except Exception:  # sharded over several devices, or not on the CPU
        return False
    return any(low <= start < high for low, high in ranges)


def _pointer_holders(objects, reaching, overlaps):
    """Objects that copied a pointer into a kept view's memory when they were made, so that
    retiring the arrays does not cut them off: flat iterators (``a.flat``), ``np.broadcast`` and
    ``np.nditer`` objects, ``a.ctypes`` objects, numba typed Lists and Dicts holding such an array.
    Returns ``[(object, hit), ...]``: ``hit`` is true, for a numba container the keys of its items that reach it.
    """

    def reaches(array):
        return isinstance(array, np.ndarray) and (id(array) in reaching or overlaps(array))

    numba_types = _numba_containers()
    found, seen = [], set()
    for obj in objects:
        kind = type(obj)
        if kind in _PROXY_TYPES or id(obj) in seen:
            continue
        seen.add(id(obj))
        try:
            if kind is np.flatiter:
                hit = reaches(obj.base)
            elif kind is np.broadcast:
                hit = any(reaches(it.base) for it in obj.iters)
            elif kind is np.nditer:
                hit = any(reaches(op) for op in obj.operands)
            elif kind is _CTYPES_TYPE:
                hit = reaches(obj._arr)
            elif numba_types and isinstance(obj, numba_types):
                keys = obj.keys() if isinstance(obj, numba_types[1]) else range(len(obj))
                hit = [key for key in keys if reaches(obj[key])]  # (its items as numba boxes them)
            else:
                continue
        except Exception:  # a closed nditer, a typed container of another item type: nothing to cut off
            continue
        if hit:
            found.append((obj, hit))
    return found


def _numba_containers():
    """numba's typed List and Dict classes, if numba is imported (else nothing to look for)."""
    typed = sys.modules.get("numba.typed")
    return (typed.List, typed.Dict) if typed is not None else ()


def _cut_off_pointer_holders(found, views):
    """Cut off what :func:`_pointer_holders` found, after the arrays themselves are retired:
    an nditer is closed (it then refuses every use), a flat iterator or broadcast object iterates
    nothing, a ``ctypes`` object points at its retired array, a numba container's item that
    reaches the memory becomes an empty array of its dtype."""
    for view in views:
        _trampoline.retire(view)  # (now rather than after this function: the ctypes objects read it)
    for obj, hit in found:
        try:
            if type(obj) is np.nditer:
                obj.close()
            elif type(obj) in (np.flatiter, np.broadcast):
                _trampoline.retire(obj)
            elif type(obj) is _CTYPES_TYPE:
                obj._data = obj._ctypes.c_void_p(obj._arr.__array_interface__["data"][0])
            else:  # a numba container: it keeps its own copy of each array's pointer and shape
                for key in hit:
                    item = obj[key]
                    empty = np.empty((0,) * item.ndim, item.dtype)
                    empty.flags.writeable = item.flags.writeable
                    obj[key] = empty
        except Exception:  # (best effort: each kind above is cut off by the means it offers)
            pass

"""Keyword arguments of an op call, in every form they take: the ``Kwargs`` the primitive carries (pickled
once, canonically, and keyed by value), the dump a Python callback reads back (:func:`load_kwargs`),
and the plain data read from a program made elsewhere (:func:`load_plain`). The typed entries a native
kernel gets are ``_native_kwargs``'s."""

from __future__ import annotations

import io
import pickle
from typing import Any

import jax
import numpy as np

from . import _plain_data
from ._errors import JaxbindError

__all__ = ["Kwargs", "load_kwargs", "load_plain", "short_repr"]


def load_kwargs(kwargs_dump) -> dict:
    """Turn the ``kwargs_dump`` a callback receives back into the kwargs dict.

    Call it inside a Python callback ``f(out, args, kwargs_dump)`` to read the
    keyword arguments the op was called with (a fresh dict each time).

    Parameters
    ----------
    kwargs_dump : bytes or buffer
        The third argument of a jaxbind callback (bytes, or any buffer such
        as a uint8 NumPy array holding the same bytes): the call's keyword
        arguments, pickled. With ``func_can_batch=True`` it also holds
        ``batch_axes``.

    Returns
    -------
    dict
        The op call's keyword arguments by name.

    Raises
    ------
    TypeError
        If ``kwargs_dump`` is neither bytes nor an object supporting the
        buffer protocol.
    pickle.UnpicklingError
        If the bytes are not a pickle (``pickle.loads`` may raise other
        exceptions for truncated or corrupt data as well).

    Examples
    --------
    >>> import numpy as np, jaxbind
    >>> def scale(out, args, kwargs_dump):
    ...     factor = jaxbind.load_kwargs(kwargs_dump)["factor"]
    ...     np.multiply(args[0], factor, out=out[0])
    """
    if not isinstance(kwargs_dump, bytes):
        kwargs_dump = memoryview(kwargs_dump).tobytes()
    return pickle.loads(kwargs_dump)


class _OrderedSet(set):
    """A set written with its members in a canonical order (see :func:`_canonical_dumps`)."""


class _OrderedFrozenset(frozenset):
    """A frozenset written with its members in a canonical order."""


def _canonical(value):
    """``value`` with every set and frozenset inside lists, tuples, dicts and sets marked for
    canonical writing (other objects are written as pickle writes them)."""
    kind = type(value)
    if kind in (set, frozenset):
        return (_OrderedSet if kind is set else _OrderedFrozenset)(_canonical(v) for v in value)
    if kind is dict:
        return {_canonical(k): _canonical(v) for k, v in value.items()}
    if kind in (list, tuple):
        return kind(_canonical(v) for v in value)
    return value


class _CanonicalPickler(pickle.Pickler):
    def reducer_override(self, obj):
        # (pickle calls this only for types without a fast path: exact sets never get here)
        if type(obj) in (_OrderedSet, _OrderedFrozenset):
            plain = set if type(obj) is _OrderedSet else frozenset
            return plain, (sorted(obj, key=_pickled),)
        return NotImplemented


def _pickled(value) -> bytes:
    buffer = io.BytesIO()
    _CanonicalPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def _canonical_dumps(values) -> bytes:
    """The pickle of ``values``, whose bytes depend on the values only: the members of a set or
    frozenset (whose iteration order follows string hashes, which differ from process to
    process) are written in the order of their own pickles. Equal kwargs then give equal bytes
    in every process: one call site for equal values, and the persistent cache hits."""
    return _pickled(_canonical(values))


def _contains_tracer(value: Any) -> bool:
    # A dict's values are walked here, not by JAX: JAX sorts a dict's keys to flatten it, and keys
    # of mixed types ({1: 'a', 'b': 2}, a fine kwarg) do not sort.
    stack = [value]
    while stack:
        for leaf in jax.tree_util.tree_leaves(stack.pop(), is_leaf=lambda v: isinstance(v, dict)):
            if isinstance(leaf, dict):
                stack.extend(leaf.values())
            elif isinstance(leaf, jax.core.Tracer):
                return True
    return False


class Kwargs:
    """A kwargs dict held as its pickled bytes; equal and hashed by those bytes.

    Because equality is by value, a repeated value (even a new list or NumPy
    array with the same contents) maps to the same compiled code. Only the
    bytes are kept (one copy of each value, which the callbacks receive):
    ``values`` unpickles a fresh dict, so a caller who mutates a list it
    passed changes nothing that was traced or compiled with it.
    """

    __slots__ = ("dump", "_hash", "_immutable")

    def __init__(self, values: dict, op_name: str):
        for key, value in values.items():
            if _contains_tracer(value):
                raise TypeError(
                    f"jaxbind op '{op_name}': keyword argument '{key}' is a traced JAX value. "
                    "Keyword arguments are static (compile-time) parameters; pass arrays that "
                    "change from call to call as positional arguments instead."
                )
        try:
            # Sorted by name, so that the order the kwargs were written in
            # does not make a new compiled call.
            values = dict(sorted(values.items()))
            dump = _canonical_dumps(values)
        except Exception as err:  # pickle raises many types (TypeError, PicklingError, AttributeError)
            bad = [k for k, v in values.items() if not _picklable(v)]
            which = f"keyword argument '{bad[0]}'" if bad else "the keyword arguments"
            raise TypeError(
                f"jaxbind op '{op_name}': {which} cannot be pickled ({type(err).__name__}: {err}). "
                "Keyword arguments reach the callbacks serialized with pickle; pass values "
                "pickle can handle (numbers, strings, lists, dicts, NumPy arrays, ...)."
            ) from err
        self.dump = dump
        self._hash = hash(dump)
        self._immutable = _UNREAD

    @classmethod
    def from_dump(cls, dump: bytes) -> Kwargs:
        """Kwargs from bytes an earlier ``Kwargs`` of this process made (never foreign bytes)."""
        kwargs = cls.__new__(cls)
        kwargs.dump, kwargs._hash, kwargs._immutable = dump, hash(dump), _UNREAD
        return kwargs

    @classmethod
    def from_program(cls, dump: bytes, op_name: str, ours: bool) -> Kwargs:
        """Kwargs from the bytes a program's description carries.

        ``ours``: the program's key is one this process registered, so the bytes
        are this process's own (the key is their digest) and are read as the op
        wrote them; other bytes are read as plain data only (:func:`load_plain`).
        """
        if ours:
            return cls.from_dump(dump)
        return cls(load_plain(dump, f"op '{op_name}'"), op_name)

    @property
    def values(self) -> dict:
        """The kwargs as a fresh dict (a snapshot taken when the op was called).

        Values that cannot change (numbers, strings, tuples of them, ...) are
        unpickled once and the dict copied; others (a list, an array, which an
        abstract could change) are unpickled anew each time.
        """
        kept = self._immutable
        if kept is _UNREAD:
            values = pickle.loads(self.dump)
            kept = self._immutable = values if all(map(_cannot_change, values.values())) else None
            return dict(values) if kept is not None else values
        return dict(kept) if kept is not None else pickle.loads(self.dump)

    def with_values(self, **extra) -> Kwargs:
        """A copy with more entries (used for ``batch_axes``)."""
        return Kwargs({**self.values, **extra}, op_name="")

    def __eq__(self, other):
        return isinstance(other, Kwargs) and self.dump == other.dump

    def __hash__(self):
        return self._hash

    def __repr__(self):
        text = ", ".join(f"{k}={short_repr(v)}" for k, v in self.values.items())
        return "{" + text + "}"


_UNREAD = object()
_UNCHANGING = (int, float, complex, str, bytes, type(None), np.generic, np.dtype, range, slice)


def _cannot_change(value) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(map(_cannot_change, value))
    if isinstance(value, slice):  # (which may hold a list)
        return all(map(_cannot_change, (value.start, value.stop, value.step)))
    return isinstance(value, _UNCHANGING) and not isinstance(value, np.void)


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
        return True
    except Exception:
        return False


def short_repr(value) -> str:
    if isinstance(value, np.ndarray):
        return f"array{list(value.shape)}:{value.dtype}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------
# Kwargs from a program made elsewhere
# ---------------------------------------------------------------------------

# What kwargs read from a program may be made of: plain data, read by our own reader of pickle's
# opcodes, bounded in size and in work by the program's bytes (_plain_data).


def load_plain(dump: bytes, label: str) -> dict:
    """Kwargs from a program's bytes, built only from plain data types, of a size the bytes bound."""
    try:
        values = _plain_data.load(dump, budget=len(dump) + 64)
        if type(values) is not dict or not all(type(name) is str for name in values):
            raise pickle.UnpicklingError("not a dict of names")
    except Exception as err:
        raise JaxbindError(
            f"jaxbind {label}: the program's kwargs cannot be read here ({type(err).__name__}: "
            f"{str(err)[:200]}): kwargs travel in a serialized program only as plain data (numbers, "
            "strings, bools, None, lists, tuples, dicts, sets and NumPy arrays or scalars), at most "
            f"{_plain_data.MAX_DEPTH} levels deep."
        ) from None
    return values

"""Keyword arguments of an op call, in every form they take: the ``Kwargs`` the primitive carries (pickled
once, canonically, and keyed by value), the dump a Python callback reads back (:func:`load_kwargs`),
the plain data read from a program made elsewhere (:func:`load_plain`), and the typed entries a native
kernel gets (:func:`kernel_kwargs`)."""

from __future__ import annotations

import collections
import io
import itertools
import numbers
import pickle
import pickletools
from typing import Any

import jax
import numpy as np

from . import _trampoline
from ._definition import JaxbindError

__all__ = [
    "KW_BOOL",
    "KW_FLOAT",
    "KW_FLOAT_ARRAY",
    "KW_INT",
    "KW_INT_ARRAY",
    "KW_STRING",
    "Kwargs",
    "kernel_kwargs",
    "load_kwargs",
    "load_plain",
    "native_kwarg_entry",
]


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
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(value))


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
        text = ", ".join(f"{k}={_short_repr(v)}" for k, v in self.values.items())
        return "{" + text + "}"


_UNREAD = object()
_UNCHANGING = (int, float, complex, str, bytes, type(None), np.generic, np.dtype, range, slice)


def _cannot_change(value) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(map(_cannot_change, value))
    return isinstance(value, _UNCHANGING) and not isinstance(value, np.void)


def _picklable(value) -> bool:
    try:
        pickle.dumps(value)
        return True
    except Exception:
        return False


def _short_repr(value) -> str:
    if isinstance(value, np.ndarray):
        return f"array{list(value.shape)}:{value.dtype}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------
# Kwargs from a program made elsewhere
# ---------------------------------------------------------------------------

# What kwargs read from a program may be made of: plain data, never a callable of the program's
# choosing, and nothing that allocates from a count the program gives (a forged program's 53
# bytes once made ``bytearray(2**31)``). Bytes, strings and arrays come from the program's own
# bytes; the constructors below are wrapped to take only what the pickler writes for plain data.


def _members(kind):
    def build(items=()):
        if type(items) not in (list, tuple):  # (a range would make a set as large as it says)
            raise pickle.UnpicklingError(f"{kind.__name__} of a {type(items).__name__}")
        return kind(items)

    return build


def _ordered_dict():  # (its items follow as SETITEMS, from the program's bytes)
    return collections.OrderedDict()


class _NdarrayClass:
    """Stands for ``numpy.ndarray`` in a program's kwargs: only ``_reconstruct`` may take it."""


def _reconstruct(cls, shape, dtype):
    # NumPy pickles an array as an empty one, whose state (shape, data) BUILD then sets from the
    # program's bytes; any other shape would allocate what the program says.
    if cls is not _NdarrayClass or tuple(shape) != (0,) or dtype != b"b":
        raise pickle.UnpicklingError("numpy._reconstruct of anything but an empty array")
    return np.ndarray.__new__(np.ndarray, (0,), "b")


_NUMPY_MODULES = (
    "numpy",
    "numpy.core.multiarray",
    "numpy._core.multiarray",
    "numpy.core.numeric",
    "numpy._core.numeric",
)
_PLAIN_GLOBALS = {
    ("builtins", "complex"): complex,
    ("builtins", "slice"): slice,
    ("builtins", "range"): range,
    ("builtins", "set"): _members(set),
    ("builtins", "frozenset"): _members(frozenset),
    ("collections", "OrderedDict"): _ordered_dict,
    **{(module, "_reconstruct"): _reconstruct for module in _NUMPY_MODULES},
    **{(module, "ndarray"): _NdarrayClass for module in _NUMPY_MODULES},
    **{(module, "dtype"): np.dtype for module in _NUMPY_MODULES},
    **{
        (module, "scalar"): getattr(np, "_core", getattr(np, "core", None)).multiarray.scalar
        for module in _NUMPY_MODULES
    },
    **{
        (module, "_frombuffer"): getattr(np, "_core", getattr(np, "core", None)).numeric._frombuffer
        for module in _NUMPY_MODULES
    },
}

# The opcodes pickle writes for such data. Left out: persistent ids and the extension registry
# (objects found by a number), INST/OBJ/NEWOBJ (an instance of any class) and out-of-band buffers.
# Not formatted: a table read by kind, a row per kind.
# fmt: off
_PLAIN_OPCODES = frozenset({
    "PROTO", "FRAME", "STOP", "MARK", "POP", "POP_MARK", "DUP", "NONE", "NEWTRUE", "NEWFALSE",
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
    "STRING", "BINSTRING", "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
    "BYTEARRAY8", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
    "EMPTY_LIST", "APPEND", "APPENDS", "LIST", "EMPTY_TUPLE", "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3",
    "EMPTY_DICT", "DICT", "SETITEM", "SETITEMS", "EMPTY_SET", "ADDITEMS", "FROZENSET",
    "GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE",
    "GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD",
})
# fmt: on
_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
MAX_PROGRAM_KWARGS_DEPTH = 100  # containers in containers, in a program's kwargs


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        found = _PLAIN_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return found


def _check_opcodes(dump: bytes) -> None:
    """Refuse a pickle that uses more than plain data's opcodes, or memo slots it never filled.

    Read before unpickling, by the standard library's pure-Python opcode reader, which never
    allocates what an opcode's count says: CPython's unpickler allocates a counted string before
    it checks that the bytes are there, and a memo index sizes its memo table.
    """
    for n, (opcode, arg, _) in enumerate(pickletools.genops(dump)):
        if opcode.name not in _PLAIN_OPCODES:
            raise pickle.UnpicklingError(f"opcode {opcode.name}")
        if opcode.name in _PUTS and not 0 <= arg <= n:
            raise pickle.UnpicklingError(f"memo index {arg} at opcode {n}")


def _check_size(values, budget: int) -> None:
    """Refuse values deeper than MAX_PROGRAM_KWARGS_DEPTH or with more than ``budget`` items, each
    counted as often as it is reached (a value shared k times is read, pickled and copied k
    times: a few bytes that refer to themselves over and over would expand without end)."""
    stack, count = [(values, 0)], 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > budget:
            raise pickle.UnpicklingError(f"they expand to more than {budget} values (parts of them repeat themselves)")
        if depth > MAX_PROGRAM_KWARGS_DEPTH:
            raise pickle.UnpicklingError(f"they nest more than {MAX_PROGRAM_KWARGS_DEPTH} levels deep")
        kind = type(value)
        if kind in (list, tuple, set, frozenset):
            children = value
        elif kind in (dict, collections.OrderedDict):
            children = itertools.chain(value.keys(), value.values())
        elif kind is np.ndarray and value.dtype.hasobject:
            children = value.ravel().tolist() if value.dtype.names is None else ()
        else:
            continue
        stack.extend((child, depth + 1) for child in children)


def load_plain(dump: bytes, label: str) -> dict:
    """Kwargs from a program's bytes, built only from plain data types, of a size the bytes bound."""
    try:
        _check_opcodes(dump)
        values = _PlainUnpickler(io.BytesIO(dump)).load()
        if not isinstance(values, dict):
            raise pickle.UnpicklingError("not a dict")
        _check_size(values, budget=len(dump) + 64)
    except Exception as err:
        raise JaxbindError(
            f"jaxbind {label}: the program's kwargs cannot be read here ({type(err).__name__}: "
            f"{str(err)[:200]}): kwargs travel in a serialized program only as plain data (numbers, "
            "strings, bools, None, lists, tuples, dicts, sets and NumPy arrays or scalars), at most "
            f"{MAX_PROGRAM_KWARGS_DEPTH} levels deep."
        ) from None
    return values


# ---------------------------------------------------------------------------
# Kwargs of a native kernel: typed entries (jaxbind.h)
# ---------------------------------------------------------------------------

# enum jaxbind_kwarg_type in jaxbind.h
KW_INT, KW_FLOAT, KW_BOOL, KW_STRING, KW_INT_ARRAY, KW_FLOAT_ARRAY = (
    _trampoline.KWARG_TYPES[name] for name in ("int", "float", "bool", "string", "int_array", "float_array")
)


def kernel_kwargs(values: dict, label: str, batch_axes=None, n_in: int = 0, can_batch=False, kernel=None):
    """The op call's kwargs as ``(name, type, value)`` entries for a native kernel.

    A ``kernel`` that declares its kwargs gets them as it declares them
    (converted, defaults added: ``_native_kwargs.Declared.entries``, which
    refuses what the declaration does not take). With ``can_batch``, adds
    ``batch_levels`` and the flat ``batch_axes`` the header describes (from a
    tuple per input of its batch axes, or None).
    """
    declared = getattr(kernel, "declared", None)
    if declared is not None:
        entries = declared.entries(values, label, kernel)
    else:
        entries = [native_kwarg_entry(key, value, label) for key, value in values.items()]
    if can_batch:
        levels = max((len(axes) for axes in batch_axes), default=0) if batch_axes else 0
        flat = []
        for axes in batch_axes or ((),) * n_in:
            flat += list(axes) if axes else [-1] * levels
        entries += [("batch_levels", KW_INT, levels), ("batch_axes", KW_INT_ARRAY, flat)]
    return entries


def native_kwarg_entry(key, value, label: str):
    """``(name, type code, value)`` of one kwarg for a native kernel; refuses what a kernel cannot take."""

    def refuse(why=""):
        return TypeError(
            f"jaxbind {label}: keyword argument '{key}' ({type(value).__name__}{why}) cannot be "
            "passed to a native kernel, which takes ints, floats, bools, strings and 1-d "
            "sequences or arrays of ints or floats."
        )

    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "biuf":
        value = value[()]  # a 0-d array is the scalar it holds: a NumPy bool, int or float, typed by its dtype
    if isinstance(value, (bool, np.bool_)):
        return (key, KW_BOOL, int(value))
    if isinstance(value, (numbers.Integral, np.integer)):
        if not -(1 << 63) <= int(value) < (1 << 63):
            raise refuse(": does not fit in 64 bits")
        return (key, KW_INT, int(value))
    if isinstance(value, (numbers.Real, np.floating)):
        return (key, KW_FLOAT, float(value))
    if isinstance(value, str):
        if "\0" in value:
            raise refuse(": contains a NUL character")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise refuse(": not valid UTF-8, it contains a lone surrogate") from None
        return (key, KW_STRING, value)
    if isinstance(value, (list, tuple, np.ndarray)):
        try:
            array = np.asarray(value)
        except Exception:
            raise refuse() from None
        if array.ndim != 1:
            raise refuse(f" of {array.ndim} dimensions")
        if (
            np.issubdtype(array.dtype, np.integer)
            or array.dtype == np.bool_
            or (array.size == 0 and not isinstance(value, np.ndarray))
        ):  # [] counts as ints
            ints = [int(v) for v in array]
            if not all(-(1 << 63) <= v < (1 << 63) for v in ints):
                raise refuse(f" of dtype {array.dtype}: an entry does not fit in a signed 64-bit integer")
            return (key, KW_INT_ARRAY, ints)
        if np.issubdtype(array.dtype, np.floating):
            return (key, KW_FLOAT_ARRAY, [float(v) for v in array])
        raise refuse(f" of dtype {array.dtype}")
    raise refuse()

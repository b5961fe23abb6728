"""The kwargs a native kernel declares (``jaxbind.native(kernel, kwargs={"r": float})``): the declaration,
checked when the kernel is made, and what it does to an op call's kwargs: a name the kernel does not
declare, or a value of a type it cannot take, is refused when the op is called, naming the op, the kernel
and the kwarg; a value it takes is converted to the declared type (an int declared float reaches the
kernel as a float); an omitted kwarg gets its declared default, if it has one."""

from __future__ import annotations

import collections.abc
import keyword
import numbers
import typing

import numpy as np

from . import _trampoline
from ._kwargs import short_repr

__all__ = [
    "KW_BOOL",
    "KW_FLOAT",
    "KW_FLOAT_ARRAY",
    "KW_INT",
    "KW_INT_ARRAY",
    "KW_STRING",
    "Declared",
    "declare",
    "kernel_kwargs",
    "native_kwarg_entry",
]

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


# How a declaration and the messages write each kind.
KIND_NAMES = {
    KW_INT: "int",
    KW_FLOAT: "float",
    KW_BOOL: "bool",
    KW_STRING: "str",
    KW_INT_ARRAY: "list[int]",
    KW_FLOAT_ARRAY: "list[float]",
}
_SCALAR_KINDS = {int: KW_INT, float: KW_FLOAT, bool: KW_BOOL, str: KW_STRING}
# What each kind takes, for "pass ..." (the conversions of _converted).
_TAKES = {
    KW_INT: "an int (or a bool)",
    KW_FLOAT: "a float (or an int)",
    KW_BOOL: "a bool (or the int 0 or 1)",
    KW_STRING: "a string",
    KW_INT_ARRAY: "a 1-d sequence or array of ints",
    KW_FLOAT_ARRAY: "a 1-d sequence or array of floats (or of ints)",
}
# Strings that spell a kind (or a C or NumPy type): a declaration refuses them as defaults, being
# meant as the kind they name far more often than as the default of a str kwarg.
_TYPE_SPELLINGS = frozenset(
    ("int", "float", "bool", "str", "string", "double", "integer", "boolean", "list[int]", "list[float]")
    + ("int32", "int64", "float32", "float64", "list[str]", "list", "tuple[int]", "tuple[float]")
)
# Passed by jaxbind itself to the kernels of ops with func_can_batch=True.
_RESERVED = ("batch_levels", "batch_axes")


def _kind_of(spec) -> int | None:
    """The code of a kind (``float``, ``list[int]``, ...), or None when ``spec`` is not one."""
    if isinstance(spec, type) and spec in _SCALAR_KINDS:
        return _SCALAR_KINDS[spec]
    if typing.get_origin(spec) in (list, tuple) and typing.get_args(spec) in (
        (int,),
        (float,),
        (int, ...),
        (float, ...),
    ):
        return KW_INT_ARRAY if typing.get_args(spec)[0] is int else KW_FLOAT_ARRAY
    return None


def declare(spec, where: str, fields: bool = False) -> Declared | None:
    """The declaration ``spec`` (a dict: name -> kind or default value) as a :class:`Declared`.

    ``where`` begins the messages (``jaxbind.native``); ``fields``: the names
    become attribute names (numba kernels). None stays None (nothing declared).
    """
    if spec is None or isinstance(spec, Declared):
        return spec
    if not isinstance(spec, collections.abc.Mapping):
        raise TypeError(
            f"{where}: kwargs must be a dict of name -> type (int, float, bool, str, list[int], "
            f"list[float]) or default value, got {type(spec).__name__}."
        )
    declared = []
    for name, kind in spec.items():
        if not isinstance(name, str) or not name or "\0" in name or not _encodable(name):
            raise TypeError(f"{where}: kwargs declares {name!r:.60}, which is not a keyword argument name.")
        if name in _RESERVED:
            raise ValueError(
                f"{where}: kwargs declares '{name}', which jaxbind passes itself to the kernels of "
                "ops with func_can_batch=True; declare only the kwargs the op is called with."
            )
        if fields and (not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_")):
            raise ValueError(
                f"{where}: kwargs declares '{name}', which cannot be a field of the kernel's kwargs "
                "(an attribute name that does not begin with an underscore and is not a Python "
                "keyword); rename it."
            )
        code, default = _kind_of(kind), None
        if isinstance(kind, str) and kind.strip().lower().replace(" ", "") in _TYPE_SPELLINGS:
            raise TypeError(
                f"{where}: kwargs declares '{name}' as the string {kind!r}, which would declare a str whose "
                f"default is {kind!r}; to declare the kind, write the type itself, not in quotes (int, float, "
                "bool, str, list[int], list[float]). (A str kwarg whose default spells a type: declare it str, "
                "and have the kernel's accessor fall back to that default.)"
            )
        if code is None:
            try:
                _, code, default = native_kwarg_entry(name, kind, where)
            except TypeError:
                raise TypeError(
                    f"{where}: kwargs declares '{name}' as {kind!r:.60}, which is neither a kind a native kernel "
                    "takes (int, float, bool, str, list[int], list[float]) nor a default value of one (an int, a "
                    "float, a bool, a string or a 1-d sequence of ints or floats)."
                ) from None
            default = tuple(default) if isinstance(default, list) else default
        if fields and code == KW_STRING:
            raise TypeError(
                f"{where}: kwargs declares '{name}' a string, which a numba kernel cannot take; "
                "numba kernels take ints, floats, bools and 1-d sequences of ints or floats."
            )
        declared.append((name, code, default))
    return Declared(tuple(sorted(declared)))


def _encodable(name: str) -> bool:
    try:
        name.encode("utf-8")  # (a lone surrogate cannot reach a kernel)
        return True
    except UnicodeEncodeError:
        return False


class Declared:
    """The kwargs a kernel declares: ``(name, code, default)`` each, by name; ``default`` is the value of
    its entry (the header's type), or None when it has none. Equal and hashed by value: a kernel's
    declaration is part of its identity (it changes what the kernel receives and which calls it takes)."""

    __slots__ = ("kwargs", "_by_name")

    def __init__(self, kwargs: tuple):
        self.kwargs = kwargs
        self._by_name = {name: (code, default) for name, code, default in kwargs}

    def __eq__(self, other):
        return isinstance(other, Declared) and self.kwargs == other.kwargs

    def __hash__(self):
        return hash(("jaxbind-declared",) + self.kwargs)

    def __repr__(self):
        return "{" + self.describe() + "}"

    def describe(self) -> str:
        """``r: float, n: int = 3``, or ``none``."""

        def shown(code, default):
            return str(bool(default)) if code == KW_BOOL else short_repr(default)

        text = [
            f"{name}: {KIND_NAMES[code]}" + ("" if default is None else f" = {shown(code, default)}")
            for name, code, default in self.kwargs
        ]
        return ", ".join(text) or "none"

    def entries(self, values: dict, label: str, kernel) -> list:
        """The entries ``kernel`` (which declares these) gets for an op call's ``values``.

        Refuses, naming the op (``label``), the kernel and the kwarg: a name it
        does not declare, a value its declared kind does not take and, for a
        kernel that reads its kwargs as fields (numba), an omitted kwarg with no
        default. Converts what it takes; adds the defaults of omitted kwargs.
        """
        what = f"{kernel._kind} '{kernel.__name__}'"
        entries = []
        for name, value in values.items():
            if name not in self._by_name:
                raise TypeError(
                    f"jaxbind {label}: keyword argument '{name}' is not one that {what} declares "
                    f"({self.describe()}); check its name, or add it to the kernel's kwargs={{...}} (every "
                    "callback of an op gets every keyword argument of its call)."
                )
            code = self._by_name[name][0]
            entry = _converted(native_kwarg_entry(name, value, label), code)
            if entry is None:
                kind = type(value).__name__
                raise TypeError(
                    f"jaxbind {label}: keyword argument '{name}' is {'an' if kind[0] in 'aeiou' else 'a'} {kind} "
                    f"({short_repr(value)}), but {what} declares it {KIND_NAMES[code]}: pass {_TAKES[code]}."
                )
            entries.append(entry)
        for name, code, default in self.kwargs:
            if name in values:
                continue
            if default is not None:
                entries.append((name, code, list(default) if isinstance(default, tuple) else default))
            elif kernel._fields:
                raise TypeError(
                    f"jaxbind {label}: {what} declares keyword argument '{name}' ({KIND_NAMES[code]}) without "
                    "a default, and the call does not pass it; a numba kernel reads its kwargs as fields, "
                    f"which every call must give: pass it, or declare a default (kwargs={{'{name}': ...}})."
                )
        return entries


def _converted(entry: tuple, code: int) -> tuple | None:
    """A native kwarg entry as the kind ``code``, or None when the kind does not take it.

    The conversions of the header's accessors (a bool read as an int, an int
    as a float, the ints 0 and 1 as bools), and, since jaxbind can make the
    copy an accessor cannot, an int array as a float array.
    """
    name, have, value = entry
    if have == code:
        return entry
    if code == KW_INT and have == KW_BOOL:
        return (name, KW_INT, value)
    if code == KW_FLOAT and have == KW_INT:
        return (name, KW_FLOAT, float(value))
    if code == KW_BOOL and have == KW_INT and value in (0, 1):
        return (name, KW_BOOL, value)
    if code == KW_FLOAT_ARRAY and have == KW_INT_ARRAY:
        return (name, KW_FLOAT_ARRAY, [float(v) for v in value])
    if code == KW_INT_ARRAY and have == KW_FLOAT_ARRAY and not value:
        return (name, KW_INT_ARRAY, [])
    return None

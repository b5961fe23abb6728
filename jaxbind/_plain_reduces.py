"""What a REDUCE in a program's kwargs pickle may make (see :mod:`jaxbind._plain_data`): each
callable a pickle may name, as a function of its arguments, which it checks before it makes
anything; NumPy dtypes and arrays from their description only."""

from __future__ import annotations

import collections
import pickle
import re
import sys

import numpy as np

_NUMERIC = getattr(np, "_core", getattr(np, "core", None))
NUMPY_MODULES = (
    "numpy",
    "numpy.core.multiarray",
    "numpy._core.multiarray",
    "numpy.core.numeric",
    "numpy._core.numeric",
)


def _refuse(why: str):
    return pickle.UnpicklingError(why)


class _Global:
    """A global the pickle names: only the callable of a REDUCE may be one."""

    __slots__ = ("name", "reduce")

    def __init__(self, name, reduce):
        self.name, self.reduce = name, reduce


class _Draft:
    """A dtype or array made by a REDUCE, whose description the following BUILD gives."""

    __slots__ = ("finish", "slots")

    def __init__(self, finish):
        self.finish, self.slots = finish, []


class _Args(tuple):
    """A tuple holding a global (``_reconstruct``'s ``ndarray``): only a REDUCE may take it."""


# ---------------------------------------------------------------------------
# Dtypes and arrays, from their description
# ---------------------------------------------------------------------------

_TYPE_CODE = re.compile(r"[A-Za-z?][0-9]{0,9}")
_TIME_UNITS = frozenset(("Y", "M", "W", "D", "h", "m", "s", "ms", "us", "ns", "ps", "fs", "as", "generic"))
_SWAPPED = ">" if sys.byteorder == "little" else "<"
_ALIGNED_STRUCT = 0x80  # NPY_ALIGNED_STRUCT, in a dtype's flags


def _ints(shape, what):
    if type(shape) is not tuple or not all(type(n) is int and 0 <= n < 2**62 for n in shape):
        raise _refuse(f"{what} is not a tuple of sizes")
    size = 1
    for n in shape:
        size *= n
    return size


def _dtype(args):
    if len(args) != 3 or type(args[0]) is not str or not _TYPE_CODE.fullmatch(args[0]):
        raise _refuse("numpy.dtype of anything but a type code")
    code = args[0]
    return _Draft(lambda state: _dtype_from(code, state))


def _dtype_from(code: str, state) -> np.dtype:
    if type(state) is not tuple or len(state) not in (8, 9):
        raise _refuse("a dtype's description is not numpy's")
    _, order, sub, names, fields, elsize, _, flags, *meta = state
    base = np.dtype(code)
    if base.hasobject:
        raise _refuse("an object dtype")
    if order not in ("<", ">", "|", "=") or type(elsize) is not int or type(flags) is not int:
        raise _refuse("a dtype's description is not numpy's")
    if sub is not None:
        if type(sub) is not tuple or len(sub) != 2 or not isinstance(sub[0], np.dtype):
            raise _refuse("a subarray dtype's description is not numpy's")
        _ints(sub[1], "a subarray dtype's shape")
        result = np.dtype((sub[0], sub[1]))
    elif names is not None:
        if type(names) is not tuple or type(fields) is not dict:
            raise _refuse("a structured dtype's description is not numpy's")
        spec = {"names": [], "formats": [], "offsets": [], "titles": [], "itemsize": elsize}
        for name in names:
            field = fields.get(name) if type(name) is str else None
            if type(field) is not tuple or len(field) not in (2, 3) or not isinstance(field[0], np.dtype):
                raise _refuse("a structured dtype's description is not numpy's")
            if type(field[1]) is not int or (len(field) == 3 and type(field[2]) is not str):
                raise _refuse("a structured dtype's description is not numpy's")
            for part, item in zip(("names", "formats", "offsets", "titles"), (name, *field, None)):
                spec[part].append(item)
        result = np.dtype(spec, align=bool(flags & _ALIGNED_STRUCT))
    elif base.kind in "mM":
        unit = meta[0][1] if meta and type(meta[0]) is tuple and len(meta[0]) == 2 else None
        if type(unit) is not tuple or len(unit) != 4 or type(unit[0]) is not bytes or type(unit[1]) is not int:
            raise _refuse("a datetime dtype without its unit")
        name, count = unit[0].decode("ascii", "replace"), unit[1]
        if name not in _TIME_UNITS or not 0 < count < 2**31:
            raise _refuse("a datetime dtype of an unknown unit")
        suffix = "" if name == "generic" else f"[{'' if count == 1 else count}{name}]"
        result = np.dtype(f"{_SWAPPED if order == _SWAPPED else '='}{base.char}8{suffix}")
    else:
        result = base.newbyteorder(order) if order == _SWAPPED and base.byteorder != "|" else base
    if result.hasobject:
        raise _refuse("an object dtype")
    if elsize not in (-1, result.itemsize) or (names is not None and base.itemsize != result.itemsize):
        raise _refuse("a dtype's description gives two sizes")
    return result


def _checked_data(dtype, shape, data, what):
    if not isinstance(dtype, np.dtype) or dtype.hasobject:
        raise _refuse(f"{what} of an object dtype" if isinstance(dtype, np.dtype) else f"{what} without a dtype")
    if type(data) not in (bytes, bytearray) or _ints(shape, f"{what}'s shape") * dtype.itemsize != len(data):
        raise _refuse(f"{what} whose data does not match its shape")
    if dtype.itemsize == 0 and _ints(shape, "") != 0:
        raise _refuse(f"{what} of items of no size")


def _frombuffer(args):
    if len(args) != 4 or args[3] not in ("C", "F"):
        raise _refuse("numpy._frombuffer of anything but an array's data")
    data, dtype, shape, order = args
    _checked_data(dtype, shape, data, "an array")
    if not len(data):
        return np.empty(shape, dtype, order)
    return _NUMERIC.numeric._frombuffer(data, dtype, shape, order)


def _reconstruct(args):
    # NumPy pickles an array as an empty one, whose description (shape, dtype, data) BUILD gives.
    if len(args) != 3 or type(args[0]) is not _Global or args[0].name != "numpy.ndarray" or args[1:] != ((0,), b"b"):
        raise _refuse("numpy._reconstruct of anything but an empty array")
    return _Draft(_array_from)


def _array_from(state) -> np.ndarray:
    if type(state) is not tuple or len(state) != 5 or state[0] != 1 or type(state[3]) is not bool:
        raise _refuse("an array's description is not numpy's")
    _, shape, dtype, fortran, data = state
    _checked_data(dtype, shape, data, "an array")
    order = "F" if fortran else "C"
    if not len(data):
        return np.empty(shape, dtype, order)
    array = np.frombuffer(bytearray(data), dtype).reshape(shape, order=order)  # (writable, as pickle's)
    if dtype.byteorder not in "=|" and dtype.names is None and dtype.subdtype is None:
        array = array.astype(dtype.newbyteorder("="))  # (as ndarray.__setstate__ makes it)
    return array


def _scalar(args):
    if len(args) != 2 or type(args[1]) is not bytes:
        raise _refuse("numpy scalar of anything but its bytes")
    _checked_data(args[0], (), args[1], "a NumPy scalar")
    return _NUMERIC.multiarray.scalar(*args)


# ---------------------------------------------------------------------------
# The callables a REDUCE may name, each of arguments it checks
# ---------------------------------------------------------------------------


def _numbers(args, kinds, counts, what):
    if len(args) not in counts or not all(type(a) in kinds for a in args):
        raise _refuse(f"{what} of anything but numbers")
    return args


def _bytearray(args):  # (never of a count: bytearray(2**31) allocates what it says)
    if len(args) > 1 or (args and type(args[0]) is not bytes):
        raise _refuse("builtins.bytearray of anything but bytes")
    return bytearray(*args)


def _ordered_dict(args):  # (its items follow as SETITEMS)
    if args != ():
        raise _refuse("collections.OrderedDict of arguments")
    return collections.OrderedDict()


def _ndarray(args):  # (only _reconstruct may take it, as an argument)
    raise _refuse("numpy.ndarray takes no arguments here (only _reconstruct takes it)")


def _named(table):
    return {(module, name): reduce for (modules, name), reduce in table.items() for module in modules}


REDUCES = _named(
    {
        (("builtins",), "complex"): lambda a: complex(*_numbers(a, (int, float, bool), (1, 2), "complex")),
        (("builtins",), "bytearray"): _bytearray,
        (("builtins",), "range"): lambda a: range(*_numbers(a, (int, bool), (1, 2, 3), "range")),
        (("builtins",), "slice"): lambda a: slice(*_numbers(a, (int, type(None)), (1, 2, 3), "slice")),
        (("builtins",), "set"): None,  # (made by the reader: their members are hashed)
        (("builtins",), "frozenset"): None,
        (("collections",), "OrderedDict"): _ordered_dict,
        (NUMPY_MODULES, "dtype"): _dtype,
        (NUMPY_MODULES, "scalar"): _scalar,
        (NUMPY_MODULES, "_frombuffer"): _frombuffer,
        (NUMPY_MODULES, "_reconstruct"): _reconstruct,
        (NUMPY_MODULES, "ndarray"): _ndarray,
    }
)

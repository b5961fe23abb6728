"""What a numba kernel may be and take: numba itself (imported on first use), the forms of ``fn``, and the
dtypes and kwargs of a call, each refused with a message that says what to do instead."""

from __future__ import annotations

import functools
import keyword

import numpy as np

from .. import _trampoline
from .._native_kwargs import KW_BOOL, KW_FLOAT, KW_FLOAT_ARRAY, KW_INT, KW_INT_ARRAY, KW_STRING

__all__ = [
    "INSTALL_HINT",
    "KWARG_KINDS",
    "NUMPY_DTYPES",
    "check_dtype",
    "is_dispatcher",
    "kwarg_signature",
    "numba_or_raise",
    "object_mode_refusal",
]

INSTALL_HINT = "pip install numba"

# kwarg type code -> the type of the kernel's kwargs field (for messages)
KWARG_KINDS = {
    KW_INT: "int64",
    KW_FLOAT: "float64",
    KW_BOOL: "bool",
    KW_INT_ARRAY: "int64[::1]",
    KW_FLOAT_ARRAY: "float64[::1]",
}


@functools.lru_cache(None)
def numba_or_raise():
    try:
        import numba
    except ImportError as err:
        raise ImportError(f"jaxbind.numba_kernel needs numba, which is not installed: {INSTALL_HINT}") from err
    return numba


def is_dispatcher(fn) -> bool:
    from numba.core.registry import CPUDispatcher

    return isinstance(fn, CPUDispatcher)


def object_mode_refusal(py_func) -> str:
    """Why a numba function compiled in object mode is not a kernel."""
    name = getattr(py_func, "__name__", None) or type(py_func).__name__
    return (
        f"jaxbind.numba_kernel: '{name}' is compiled in numba's object mode (forceobj=True), whose "
        "code handles Python objects and needs the GIL, which "
        "a native kernel runs without; compile it in nopython mode (numba.njit, or pass the plain Python "
        "function), or make the op from a Python callback instead."
    )


def check_dtype(dtype, what: str, code: int | None = None) -> np.dtype:
    """``dtype`` if numba takes it (None: the dtype of the code ``code``, which NumPy lacks)."""
    numba = numba_or_raise()
    try:
        if dtype is None or np.dtype(dtype) == np.float16:  # (numba types float16 arrays, but cannot compute with them)
            raise TypeError
        numba.from_dtype(np.dtype(dtype))
    except Exception:
        name = np.dtype(dtype).name if dtype is not None else _DTYPE_NAMES.get(code, f"code {code}")
        raise TypeError(
            f"{what} has dtype {name}, which numba does not support; numba kernels take bool, "
            "integer, float32, float64, complex64 and complex128 arrays (cast the argument, or use a C "
            "kernel or a Python callback)."
        ) from None
    return np.dtype(dtype)


def kwarg_signature(entries: list, where: str) -> tuple:
    """``((name, type code), ...)`` of an op call's kwarg entries; refuses what a numba kernel cannot take."""
    signature = []
    for key, code, _ in entries:
        if code == KW_STRING:
            raise TypeError(
                f"{where}: keyword argument '{key}' is a string, which a numba kernel cannot take; numba "
                "kernels take ints, floats, bools and 1-d sequences of ints or floats (pass a number "
                "that stands for the option instead)."
            )
        if not key.isidentifier() or keyword.iskeyword(key) or key.startswith("_"):
            raise TypeError(
                f"{where}: keyword argument '{key}' cannot be a field of the kernel's kwargs (an "
                "attribute name that does not begin with an underscore and is not a Python keyword); "
                "rename it."
            )
        signature.append((key, code))
    return tuple(signature)


def _numpy_dtypes() -> dict:
    """dtype code -> NumPy dtype, for the codes of dtypes NumPy itself has."""
    dtypes = {}
    for name, code in _trampoline.DTYPE_CODES.items():
        try:
            dtypes[code] = np.dtype(name)
        except TypeError:
            pass
    return dtypes


NUMPY_DTYPES = _numpy_dtypes()
_DTYPE_NAMES = {code: name for name, code in _trampoline.DTYPE_CODES.items()}

"""The Python the compiled code calls, with the GIL: the hook that compiles a new signature, the reporter
of a kernel's exception; and the flag that stops both once Python is exiting.

The compiled code finds them by address (:data:`HOOK_ADDRESS`, ``id(report)``,
:data:`EXITING`), and finds the objects they act on by number: an entry's id
in :data:`ENTRIES`, a variant's in :data:`REPORTS`. Both tables hold their
objects weakly: an entry or a variant leaves its table when it is freed (with
its kernel), so that a process that makes and drops kernels does not grow them.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import weakref

import numpy as np

from ._call_struct import write_error

__all__ = ["ENTRIES", "EXITING", "HOOK_ADDRESS", "REPORTS", "new_entry_id", "new_variant_id", "report"]

EXITING = np.zeros(1, np.int64)  # set at exit: the compiled code then calls no Python
ENTRIES: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()  # entry id -> Entry
REPORTS: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()  # variant id -> Variant
new_entry_id = itertools.count(1).__next__
new_variant_id = itertools.count(1).__next__


def _hook(entry_id: int, call_address: int) -> int:
    """Called (with the GIL, by ctypes) by an entry that met a call signature new to it."""
    try:
        entry = ENTRIES.get(entry_id)
        if entry is None:
            raise RuntimeError("the kernel's compiled state is gone")
        return entry.variant_address(call_address)
    except BaseException as err:  # nothing may escape into XLA's thread
        try:
            write_error(call_address, str(err))
        except BaseException:
            pass
        return 0


_HOOK = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)(_hook)
HOOK_ADDRESS = ctypes.cast(_HOOK, ctypes.c_void_p).value


def report(exc_type, exc_value, call_address, variant_id):
    """Called with the GIL by a variant whose fn raised: the exception's message into the call's error buffer."""
    exc = exc_value
    if not isinstance(exc, BaseException):
        try:
            args = exc if isinstance(exc, tuple) else (() if exc is None else (exc,))
            exc = exc_type(*args)
        except Exception:
            exc = None
    # (found: a variant's code runs only while its kernel, and so the variant, is alive)
    name = getattr(REPORTS.get(variant_id), "fn_name", "?")
    if exc is None:
        text = f"numba kernel '{name}' raised an exception"
    else:
        text = f"numba kernel '{name}' raised {type(exc).__name__}: {exc}"
    write_error(call_address, text)


def _at_exit():
    EXITING[0] = 1


atexit.register(_at_exit)  # (runs before jaxbind's own exit hook, registered earlier)

"""One function's compiled state: its numba dispatcher, an entry per kwarg signature and a variant per
call signature, found or made under the program's lock."""

from __future__ import annotations

import threading
import weakref

from ._checks import check_dtype, is_dispatcher, kwarg_signature, numba_or_raise
from ._entry import Entry
from ._variant import Variant

__all__ = ["Program"]


class Program:
    """The numba dispatcher of one function, and everything compiled from it."""

    # Kernels of the same function share it; it lives as long as a kernel (and so a call site)
    # holds it, and its function with it (a closure's captured arrays too).
    _by_fn: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
    _lock = threading.Lock()

    @classmethod
    def of(cls, fn) -> Program:
        with cls._lock:
            program = cls._by_fn.get(fn)
            if program is None:
                program = cls._by_fn[fn] = cls(fn)
            return program

    def __init__(self, fn):
        numba = numba_or_raise()
        self.fn = fn
        self.fn_name = getattr(fn, "__name__", None) or type(fn).__name__
        self.dispatcher = fn if is_dispatcher(fn) else numba.njit(nogil=True, error_model="numpy")(fn)
        self.lock = threading.RLock()  # compiling, and the tables (writers only)
        self.entries = {}
        self.variants = {}

    # -- at lowering ---------------------------------------------------------

    def entry_for(self, kernel_name: str, in_avals, out_avals, entries: list) -> Entry:
        """The entry for a call site's kwarg entries (``(name, type code, value)``); refuses, naming them,
        dtypes and kwargs numba cannot take."""
        where = f"jaxbind numba kernel '{kernel_name}'"
        for side, avals in (("input", in_avals), ("output", out_avals)):
            for k, aval in enumerate(avals):
                check_dtype(aval.dtype, f"{where}: {side} {k}")
        signature = kwarg_signature(entries, where)
        with self.lock:
            entry = self.entries.get(signature)
            if entry is None:
                entry = self.entries[signature] = Entry(self)
            return entry

    # -- at run time, from the hook ------------------------------------------

    def variant(self, in_sig, out_sig, kwargs) -> Variant:
        """The variant for ``(dtype code, rank)`` per input and output and ``(name, type)`` per kwarg."""
        key = (in_sig, out_sig, kwargs)
        with self.lock:
            variant = self.variants.get(key)
            if variant is None:
                try:
                    variant = Variant(self, in_sig, out_sig, kwargs)
                except Exception as err:  # kept: the next call fails as fast, with the same message
                    variant = err
                self.variants[key] = variant
            if isinstance(variant, Exception):
                raise variant
            return variant

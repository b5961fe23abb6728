"""The call struct of ``jaxbind.h``, mirrored with ctypes, and what Python reads and writes in a call.

The offsets the generated code reads come from here (tests check them against
the C header). Every field is 8 bytes (``int64_t``, a pointer or a double), so
the generated code reads the structs as int64 words: :data:`CALL`,
:data:`ARRAY` and :data:`KWARG` give each field's word.
"""

from __future__ import annotations

import ctypes

__all__ = [
    "ARRAY",
    "ARRAY_WORDS",
    "CALL",
    "CALL_WORDS",
    "KWARG",
    "KWARG_WORDS",
    "Array",
    "Call",
    "Kwarg",
    "call_signature",
    "write_error",
]


class Array(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("shape", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("dtype", ctypes.c_int64),
    ]


class Kwarg(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_void_p),
        ("type", ctypes.c_int64),
        ("size", ctypes.c_int64),
        ("int_value", ctypes.c_int64),
        ("float_value", ctypes.c_double),
        ("string_value", ctypes.c_void_p),
        ("int_array", ctypes.c_void_p),
        ("float_array", ctypes.c_void_p),
    ]


class Call(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_int64),
        ("abi_version", ctypes.c_int64),
        ("n_out", ctypes.c_int64),
        ("out", ctypes.c_void_p),
        ("n_in", ctypes.c_int64),
        ("in_", ctypes.c_void_p),
        ("n_kwargs", ctypes.c_int64),
        ("kwargs", ctypes.c_void_p),
        ("error", ctypes.c_void_p),
        ("error_size", ctypes.c_int64),
        ("kwarg_error", ctypes.c_void_p),
        ("kwarg_error_size", ctypes.c_int64),
    ]


def _words(struct) -> dict:
    """Field name -> the index of its 8-byte word."""
    assert all(ctypes.sizeof(t) == 8 for _, t in struct._fields_)
    return {name: getattr(struct, name).offset // 8 for name, _ in struct._fields_}


CALL, ARRAY, KWARG = _words(Call), _words(Array), _words(Kwarg)
CALL_WORDS, ARRAY_WORDS, KWARG_WORDS = (ctypes.sizeof(s) // 8 for s in (Call, Array, Kwarg))


def call_signature(call_address: int):
    """What a call carries: ``(dtype code, rank)`` of each input and output, ``(name, type)`` of each kwarg."""
    call = Call.from_address(call_address)
    ins = (Array * call.n_in).from_address(call.in_) if call.n_in else ()
    outs = (Array * call.n_out).from_address(call.out) if call.n_out else ()
    kwargs = (Kwarg * call.n_kwargs).from_address(call.kwargs) if call.n_kwargs else ()
    return (
        tuple((a.dtype, a.rank) for a in ins),
        tuple((a.dtype, a.rank) for a in outs),
        tuple((ctypes.string_at(k.name).decode("utf-8", "replace"), k.type) for k in kwargs),
    )


def write_error(call_address: int, text: str) -> None:
    """Write ``text`` (truncated, NUL-terminated UTF-8) into a call's error buffer."""
    call = Call.from_address(call_address)
    if not call.error or call.error_size <= 0:
        return
    data = text.encode("utf-8", "replace")[: call.error_size - 1]
    data = data.decode("utf-8", "ignore").encode("utf-8") + b"\0"  # (no character cut in half)
    ctypes.memmove(call.error, data, len(data))

"""The native kernel ABI's structs (``jaxbind.h``: ``jaxbind_array``, ``jaxbind_kwarg``, ``jaxbind_call``) as
ctypes mirrors, for the tests that build a call by hand or compare layouts (the Fortran module's derived
types, a caller of an older ABI version). ``test_fortran.py`` checks these against the header's own
offsets."""

import ctypes


class Array(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("rank", ctypes.c_int64),
        ("dtype", ctypes.c_int64),
    ]


class Kwarg(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("type", ctypes.c_int64),
        ("size", ctypes.c_int64),
        ("int_value", ctypes.c_int64),
        ("float_value", ctypes.c_double),
        ("string_value", ctypes.c_char_p),
        ("int_array", ctypes.POINTER(ctypes.c_int64)),
        ("float_array", ctypes.POINTER(ctypes.c_double)),
    ]


class Call(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_int64),
        ("abi_version", ctypes.c_int64),
        ("n_out", ctypes.c_int64),
        ("out", ctypes.POINTER(Array)),
        ("n_in", ctypes.c_int64),
        ("in", ctypes.POINTER(Array)),
        ("n_kwargs", ctypes.c_int64),
        ("kwargs", ctypes.POINTER(Kwarg)),
        ("error", ctypes.c_void_p),
        ("error_size", ctypes.c_int64),
        ("kwarg_error", ctypes.c_void_p),
        ("kwarg_error_size", ctypes.c_int64),
    ]

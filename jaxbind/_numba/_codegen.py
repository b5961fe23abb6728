"""What the generated code is made of, made once per process: small intrinsics, a guard per variant and
the generic entry every entry's trampoline calls.

The generated code reads the call struct as int64 words (:data:`CALL`,
:data:`ARRAY` and :data:`KWARG` give each field's word) through the
intrinsics: ``_ptr`` (an address as a pointer), ``_call_kernel`` and
``_call_hook`` (calls through function pointers); the guard calls ``fn`` with
numba's calling convention, so that an exception ``fn`` raises comes back as
a status.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from ._call_struct import ARRAY, ARRAY_WORDS, CALL, CALL_WORDS, KWARG, KWARG_WORDS
from ._callbacks import EXITING, HOOK_ADDRESS, report
from ._checks import numba_or_raise, object_mode_refusal

__all__ = ["TABLE_WORDS", "guard", "machinery", "read_only", "text_source"]

TABLE_WORDS = 4096  # an entry's table (signatures past it are found by the hook, slowly)

_MACHINERY = {}
_MACHINERY_LOCK = threading.Lock()


def machinery() -> dict:
    """The intrinsics, helpers and the generic entry the generated code uses (made once)."""
    with _MACHINERY_LOCK:  # (held while compiling: two threads must not make two)
        if not _MACHINERY:
            _MACHINERY.update(_make_machinery())
        return _MACHINERY


def _make_machinery() -> dict:
    """The names the generated code uses, and the generic entry compiled from them."""
    numba = numba_or_raise()
    from numba import carray, types

    namespace = dict(numba=numba, carray=carray, types=types, np=np, **_pointer_intrinsics())
    namespace.update(_struct_helpers(namespace["_ptr"]))
    texts = []
    entry = _compile_entry(namespace, texts)
    return dict(namespace, guard=guard, entry=entry, texts=texts, read_only=read_only)


def _pointer_intrinsics() -> dict:
    """``_ptr`` (an int64 address as a pointer), ``_call_kernel`` and ``_call_hook`` (calls by address)."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def _ptr(typingctx, address):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(types.voidptr))

        return types.voidptr(types.int64), codegen

    @intrinsic
    def _call_kernel(typingctx, address, call):
        """int kernel(const jaxbind_call*) at ``address``."""

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.IntType(32), [ir.IntType(8).as_pointer()])
            return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [args[1]])

        return types.int32(types.int64, types.voidptr), codegen

    @intrinsic
    def _call_hook(typingctx, address, entry_id, call):
        """int64 hook(int64 entry_id, const jaxbind_call*) at ``address`` (a ctypes callback)."""

        def codegen(context, builder, signature, args):
            fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(8).as_pointer()])
            return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [args[1], args[2]])

        return types.int64(types.int64, types.int64, types.voidptr), codegen

    return dict(_ptr=_ptr, _call_kernel=_call_kernel, _call_hook=_call_hook)


def _struct_helpers(_ptr) -> dict:
    """``_fail`` (a message into the call's error buffer) and ``_find`` (a kwarg's index by name)."""
    numba = numba_or_raise()
    from numba import carray

    error_word, error_size_word, name_word = CALL["error"], CALL["error_size"], KWARG["name"]

    @numba.njit(nogil=True)
    def _fail(c, message):
        """Write ``message`` (a NUL-terminated uint8 array) to the call's error buffer; return 1."""
        size = c[error_size_word]
        if c[error_word] != 0 and size > 0:
            buffer = carray(_ptr(c[error_word]), size, np.uint8)
            n = min(message.size, size)
            for k in range(n):
                buffer[k] = message[k]
            buffer[n - 1] = 0
        return np.int32(1)

    @numba.njit(nogil=True)
    def _same_name(address, name):
        """Whether the C string at ``address`` is ``name`` (uint8, NUL included); stops at the first difference."""
        if address == 0:
            return False
        chars = carray(_ptr(address), name.size, np.uint8)
        for k in range(name.size):
            if chars[k] != name[k]:
                return False
        return True

    @numba.njit(nogil=True)
    def _find(words, n_kwargs, hint, name):
        """The index of the kwarg called ``name``: ``hint`` when it is there, else a search; -1 if absent."""
        if hint < n_kwargs and _same_name(words[hint * KWARG_WORDS + name_word], name):
            return hint
        for k in range(n_kwargs):
            if _same_name(words[k * KWARG_WORDS + name_word], name):
                return k
        return -1

    return dict(_fail=_fail, _find=_find)


def read_only(tuple_type):
    """A tuple (or named tuple) type with its array members read-only."""
    from numba import types

    members = [t.copy(readonly=True) if isinstance(t, types.Array) else t for t in tuple_type]
    if isinstance(tuple_type, (types.NamedTuple, types.NamedUniTuple)):
        return types.BaseTuple.from_types(members, tuple_type.instance_class)
    return types.BaseTuple.from_types(members)


def guard(dispatcher, variant_id: int):
    """An intrinsic ``guarded(call, out, args, kwargs) -> int32`` that calls ``dispatcher`` (fn)
    and returns 0, or, when fn raised, writes its message to the call's error buffer (taking
    the GIL for that only) and returns 1; 2 (no message) when Python is exiting."""
    from numba import types
    from numba.extending import intrinsic

    # numba keeps every intrinsic in its registries for the process: this one holds fn's
    # dispatcher only weakly (it needs it while the variant compiles), so that a freed
    # kernel's function, and whatever it captured, can go.
    dispatcher_ref = weakref.ref(dispatcher)
    del dispatcher

    @intrinsic
    def guarded(typingctx, call, out, args, kwargs):
        # fn sees its inputs and kwargs as read-only arrays (the same data model as the
        # writable arrays the variant makes, so the values pass as they are): an input is
        # XLA's buffer, perhaps the caller's jax.Array, and an array kwarg is shared by
        # every call with an equal kwarg. A write into one fails to compile, with numba's message.
        argtypes = (out, read_only(args), read_only(kwargs))
        symbol, restype, fn_argtypes = _link_compiled_fn(dispatcher_ref(), argtypes, variant_id)

        def codegen(context, builder, signature, llargs):
            return _emit_guarded_call(context, builder, llargs, symbol, restype, fn_argtypes, variant_id)

        return types.int32(call, out, args, kwargs), codegen

    return guarded


def _link_compiled_fn(dispatcher, argtypes: tuple, variant_id: int):
    """fn compiled for ``argtypes``, made an external symbol; returns (symbol, return type, argument types)."""
    import llvmlite.binding as llvm

    dispatcher.compile(argtypes)  # (numba's own errors, e.g. typing, surface here)
    compiled = dispatcher.overloads[argtypes]
    if compiled.objectmode:  # (the kernel's form was checked when it was made; this is the last word)
        raise TypeError(object_mode_refusal(dispatcher.py_func))
    # fn is called by the address of its compiled code, as an external symbol: not
    # linked into (and optimized again with) every variant
    symbol = f"jaxbind_numba_fn_{variant_id}"
    llvm.add_symbol(symbol, compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name))
    return symbol, compiled.signature.return_type, compiled.signature.args


def _emit_guarded_call(context, builder, llargs, symbol, restype, fn_argtypes, variant_id: int):
    """The IR of the guard: call fn by ``symbol``; on an error status, 2 if Python is exiting, else
    report the exception and 1; 0 otherwise."""
    from llvmlite import ir
    from numba.core import cgutils

    callee = cgutils.get_or_insert_function(
        builder.module, context.call_conv.get_function_type(restype, fn_argtypes), symbol
    )
    status, _ = context.call_conv.call_function(builder, callee, restype, fn_argtypes, llargs[1:])
    i64, i32 = ir.IntType(64), ir.IntType(32)
    result = cgutils.alloca_once_value(builder, ir.Constant(i32, 0))
    with builder.if_then(status.is_error, likely=False):
        exiting_at = ir.Constant(i64, EXITING.ctypes.data).inttoptr(i64.as_pointer())
        exiting = builder.icmp_signed("!=", builder.load(exiting_at), ir.Constant(i64, 0))
        with builder.if_else(exiting) as (then, otherwise):
            with then:
                builder.store(ir.Constant(i32, 2), result)
            with otherwise:
                builder.store(ir.Constant(i32, 1), result)
                _emit_report(context, builder, status, llargs[0], variant_id)
    return builder.load(result)


def _emit_report(context, builder, status, call, variant_id: int) -> None:
    """The IR that, with the GIL, raises fn's exception from ``status`` and hands it to :func:`report`."""
    from llvmlite import ir
    from numba.core import cgutils

    i64 = ir.IntType(64)
    pyapi = context.get_python_api(builder)
    gil = pyapi.gil_ensure()
    context.call_conv.raise_error(builder, pyapi, status)
    slots = [cgutils.alloca_once(builder, pyapi.pyobj) for _ in range(3)]
    pyapi.err_fetch(*slots)
    exc_type, exc_value, traceback = (builder.load(slot) for slot in slots)
    none = pyapi.borrow_none()
    objects = [builder.select(cgutils.is_null(builder, obj), none, obj) for obj in (exc_type, exc_value)]
    objects.append(pyapi.long_from_longlong(builder.ptrtoint(call, i64)))
    objects.append(pyapi.long_from_longlong(ir.Constant(i64, variant_id)))
    reporter = ir.Constant(i64, id(report)).inttoptr(pyapi.pyobj)
    done = pyapi.call_function_objargs(reporter, objects)
    for obj in [done, exc_type, exc_value, traceback] + objects[2:]:
        pyapi.decref(obj)  # (Py_DecRef: NULL-safe)
    pyapi.err_clear()
    pyapi.gil_release(gil)


def _compile_entry(namespace: dict, texts: list):
    """The generic entry all call sites run (through a trampoline naming its table), compiled: it finds
    the call's signature in the table, or asks the hook for it."""
    numba = numba_or_raise()
    from numba import types

    exiting = text_source("numba kernel: not compiled for this call's signature, and Python is exiting", texts)
    scope = dict(namespace)
    exec(compile(_entry_source(exiting), "<jaxbind numba entry>", "exec"), scope)
    return numba.cfunc(types.int32(types.voidptr, types.int64, types.int64), nopython=True)(scope["entry"])


def _entry_source(exiting: str) -> str:
    """The generic entry's Python source (``exiting``: the source of its message when Python is exiting)."""
    return f"""
def entry(call, table, entry_id):
    c = carray(call, {CALL_WORDS}, np.int64)
    n_in, n_out, n_kwargs = c[{CALL["n_in"]}], c[{CALL["n_out"]}], c[{CALL["n_kwargs"]}]
    i = carray(_ptr(c[{CALL["in_"]}]), {ARRAY_WORDS} * n_in, np.int64)
    o = carray(_ptr(c[{CALL["out"]}]), {ARRAY_WORDS} * n_out, np.int64)
    t = carray(_ptr(table), {TABLE_WORDS}, np.int64)
    p = 0
    while p + 4 <= {TABLE_WORDS}:
        if t[p] < 0 or t[p + 1] < 0 or t[p + 2] < 0:
            break
        length = 4 + 2 * (t[p] + t[p + 1])
        if t[p] == n_in and t[p + 1] == n_out and t[p + 2] == n_kwargs:
            same = True
            for k in range(n_in + n_out):
                d = i if k < n_in else o
                q = {ARRAY_WORDS} * (k if k < n_in else k - n_in)
                if t[p + 3 + 2 * k] != d[q + {ARRAY["dtype"]}] or t[p + 4 + 2 * k] != d[q + {ARRAY["rank"]}]:
                    same = False
                    break
            if same:
                address = t[p + length - 1]
                if address == 0:
                    break
                return _call_kernel(address, call)
        p += length
    if carray(_ptr({EXITING.ctypes.data}), 1, np.int64)[0] != 0:
        return _fail(c, {exiting})
    address = _call_hook({HOOK_ADDRESS}, entry_id, call)
    if address == 0:
        return np.int32(1)
    return _call_kernel(address, call)
"""


def text_source(text: str, keep: list) -> str:
    """Source code for a NUL-terminated UTF-8 ``text`` as a uint8 array, which ``keep`` owns.

    (By address: numba makes an LLVM constant of a global array element by
    element, which costs more than the rest of a variant's compilation.)
    """
    data = np.frombuffer(text.encode("utf-8") + b"\0", np.uint8).copy()
    keep.append(data)
    return f"carray(_ptr({data.ctypes.data}), {data.size}, np.uint8)"

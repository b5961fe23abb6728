"""numba kernels: native kernels written in Python (numba's nopython subset).

``numba_kernel(fn)`` turns ``fn(out, args, kwargs)`` into a :class:`NativeKernel`
that jaxbind calls like a C kernel: no Python and no GIL on the call path, the
parallel walk under vmap. What runs when XLA calls it, all compiled:

1. an *entry* (the address ``address_for`` gives a call site; one per kwarg
   signature): it reads the call's arity, dtypes and ranks and finds them in
   its table;
2. the *variant* compiled for them (a ``numba.cfunc``): it makes the arrays
   (``numba.carray`` over the data pointers) and the kwargs (a namedtuple) from
   the call struct and calls ``fn`` through numba's calling convention, so that
   an exception ``fn`` raises comes back as a status, and its message is
   written to the call's error buffer (the GIL taken for that only).

The signature is looked up at run time because a call site cannot know it: in a
vmap walk the kernel sees one element of each batched array, while the site's
avals are those of the whole batch, and jaxbind keeps one site for calls that
differ only in their avals. A signature met for the first time is compiled then,
by a hook that takes the GIL (a ctypes callback); after that the table answers.

numba is imported on first use only: ``import jaxbind`` does not pay for it.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import functools
import itertools
import keyword
import threading
import weakref
from typing import Optional

import numpy as np

from . import _trampoline
from ._native import (KW_BOOL, KW_FLOAT, KW_FLOAT_ARRAY, KW_INT, KW_INT_ARRAY, KW_STRING, NativeKernel,
                      _kwarg_entry)

__all__ = ["NumbaKernel", "numba_kernel"]

INSTALL_HINT = "pip install 'jaxbind-ffi[numba]'"


# ---------------------------------------------------------------------------
# The call struct of jaxbind.h, mirrored with ctypes: the offsets the generated
# code reads come from here (tests check them against the C header). Every field
# is 8 bytes (int64_t, a pointer or a double), so the code reads int64 words.
# ---------------------------------------------------------------------------


class _Array(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("shape", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("dtype", ctypes.c_int64)]


class _Kwarg(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("type", ctypes.c_int64), ("size", ctypes.c_int64),
                ("int_value", ctypes.c_int64), ("float_value", ctypes.c_double),
                ("string_value", ctypes.c_void_p), ("int_array", ctypes.c_void_p),
                ("float_array", ctypes.c_void_p)]


class _Call(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_int64), ("abi_version", ctypes.c_int64), ("n_out", ctypes.c_int64),
                ("out", ctypes.c_void_p), ("n_in", ctypes.c_int64), ("in_", ctypes.c_void_p),
                ("n_kwargs", ctypes.c_int64), ("kwargs", ctypes.c_void_p), ("error", ctypes.c_void_p),
                ("error_size", ctypes.c_int64)]


def _words(struct) -> dict:
    """Field name -> the index of its 8-byte word."""
    assert all(ctypes.sizeof(t) == 8 for _, t in struct._fields_)
    return {name: getattr(struct, name).offset // 8 for name, _ in struct._fields_}


CALL, ARRAY, KWARG = _words(_Call), _words(_Array), _words(_Kwarg)
CALL_WORDS, ARRAY_WORDS, KWARG_WORDS = (ctypes.sizeof(s) // 8 for s in (_Call, _Array, _Kwarg))

# kwarg type code -> the type of the kernel's kwargs field (for messages)
_KWARG_KINDS = {KW_INT: "int64", KW_FLOAT: "float64", KW_BOOL: "bool", KW_INT_ARRAY: "int64[::1]",
                KW_FLOAT_ARRAY: "float64[::1]"}
_TABLE_WORDS = 4096  # an entry's table (signatures past it are found by the hook, slowly)


def _write_error(call_address: int, text: str) -> None:
    """Write ``text`` (truncated, NUL-terminated UTF-8) into a call's error buffer."""
    call = _Call.from_address(call_address)
    if not call.error or call.error_size <= 0:
        return
    data = text.encode("utf-8", "replace")[: call.error_size - 1]
    data = data.decode("utf-8", "ignore").encode("utf-8") + b"\0"  # (no character cut in half)
    ctypes.memmove(call.error, data, len(data))


def _call_signature(call_address: int):
    """What a call carries: ``(dtype code, rank)`` of each input and output, ``(name, type)`` of each kwarg."""
    call = _Call.from_address(call_address)
    ins = (_Array * call.n_in).from_address(call.in_) if call.n_in else ()
    outs = (_Array * call.n_out).from_address(call.out) if call.n_out else ()
    kwargs = (_Kwarg * call.n_kwargs).from_address(call.kwargs) if call.n_kwargs else ()
    return (tuple((a.dtype, a.rank) for a in ins), tuple((a.dtype, a.rank) for a in outs),
            tuple((ctypes.string_at(k.name).decode("utf-8", "replace"), k.type) for k in kwargs))


# ---------------------------------------------------------------------------
# The kernel object
# ---------------------------------------------------------------------------


class NumbaKernel(NativeKernel):
    """A jaxbind kernel written in Python and compiled by numba for each signature it meets.

    Equal (and hashed) by its function, name and mode. ``address`` is 0: the
    code it runs is compiled per call site (:meth:`address_for`).
    """

    __slots__ = ("fn", "_program")
    _per_site = True

    def __init__(self, fn, name: Optional[str] = None, concurrent: bool = False, keepalive=None):
        self.address = 0
        self.__name__ = name or getattr(fn, "__name__", None) or type(fn).__name__
        self.concurrent = bool(concurrent)
        self._keepalive = keepalive
        self.fn = fn
        self._program = _Program.of(fn)

    def _key(self):
        return ("numba", self.fn, self.__name__, self.concurrent)

    def _with(self, name, concurrent, keepalive):
        return NumbaKernel(self.fn, name or self.__name__, concurrent, (self._keepalive, keepalive))

    def address_for(self, in_avals, out_avals, kwargs: dict) -> int:
        return self._program.entry_for(self.__name__, in_avals, out_avals, kwargs).address

    def __repr__(self):
        mode = ", concurrent" if self.concurrent else ""
        return f"<jaxbind numba kernel {self.__name__!r} of {getattr(self.fn, '__qualname__', self.fn)!r}{mode}>"


def numba_kernel(fn=None, *, name: Optional[str] = None, concurrent: bool = False):
    """A jaxbind native kernel written in Python with numba's nopython subset.

    ``fn(out, args, kwargs)`` writes every array of the tuple ``out`` from the
    arrays of the tuple ``args``, both C-contiguous with the call's shapes and
    dtypes; ``kwargs`` holds the op call's keyword arguments as attributes
    (``kwargs.factor``): ints as int64, floats as float64, bools, and 1-d
    sequences as int64 or float64 arrays. The arrays of ``args`` and of
    ``kwargs`` are read-only (numba's read-only array types: a kernel that
    writes one does not compile, and the op call fails with numba's message),
    since an input may be the caller's own array and an array kwarg is shared
    by every call with an equal value. With
    ``func_can_batch=True`` it also has ``batch_levels`` and ``batch_axes`` (the
    header's flat layout). A kernel that raises (``raise ValueError("...")``)
    makes the op call fail with an error naming the op and carrying the message.

    jaxbind compiles ``fn`` with ``numba.njit(nogil=True, error_model="numpy")``
    (pass an ``njit``-decorated function to choose other options) once for each
    combination of dtypes, ranks and kwarg types it is called with, when it
    first runs with it, and then calls it with no Python and no GIL; vmapped, it
    runs on XLA's threads like a C kernel.

    Usable as ``numba_kernel(fn)``, ``@numba_kernel`` or
    ``@numba_kernel(name=..., concurrent=...)``. ``name`` names the kernel in
    messages and is the op's default name (else ``fn.__name__``);
    ``concurrent`` as for :func:`jaxbind.native`. Kernels are equal by
    function, name and mode.

    Parameters
    ----------
    fn : callable, optional
        ``fn(out, args, kwargs)``, a Python function in numba's nopython
        subset, or a ``numba.njit`` function. Omitted (``None``), the call
        returns a decorator taking it.
    name : str, optional
        The kernel's name in messages, and the default name of an op made
        from it (default: ``fn.__name__``).
    concurrent : bool, default False
        Run the kernel on XLA's thread pool (see :func:`jaxbind.native`).

    Returns
    -------
    NativeKernel or callable
        The kernel (a :class:`jaxbind.NativeKernel` compiled per signature),
        accepted wherever an op takes a callback; or, when ``fn`` is omitted,
        a decorator that makes one with ``name`` and ``concurrent``.

    Raises
    ------
    ImportError
        If numba is not installed (``pip install 'jaxbind-ffi[numba]'``).
    TypeError
        If ``name`` is not a non-empty string, or ``fn`` is not callable, is a
        native kernel already, is a numba function compiled in object mode
        (``forceobj=True``: its code needs the GIL), or
        is a numba object other than an ``njit`` function (a ``numba.cfunc``
        with the kernel signature is a kernel already: pass it to the op
        directly).

    Notes
    -----
    Errors that depend on a call are raised when the op is lowered or first
    called with it, naming the kernel: a dtype numba does not take (float16,
    bfloat16 and the other types beyond bool, integers, float32/64 and
    complex64/128) or a keyword argument it cannot take (a string, a name
    that is not an identifier or begins with an underscore) is a
    ``TypeError``; a kernel numba cannot compile for the call's signature
    fails that call with numba's message; an exception ``fn`` raises fails
    the op call with an error carrying its message. Compiling costs some
    tenths of a second to a second per signature, once per process.

    Examples
    --------
    >>> import jax.numpy as jnp, jaxbind
    >>> @jaxbind.numba_kernel
    ... def scale(out, args, kwargs):                  # y = factor * x
    ...     x, y = args[-1], out[0]
    ...     for i in range(x.shape[0]):
    ...         y[i] = kwargs.factor * x[i]
    >>> def like_last(*args, **kwargs):
    ...     return ((args[-1].shape, args[-1].dtype),)
    >>> op = jaxbind.get_linear_call(scale, scale, like_last, like_last)
    >>> y, = op(jnp.arange(3.0), factor=2.0)
    """
    _numba_or_raise()
    if fn is None:
        return functools.partial(numba_kernel, name=name, concurrent=concurrent)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise TypeError(f"jaxbind.numba_kernel: name must be a non-empty string, got {name!r:.100}.")
    if not callable(fn) or isinstance(fn, NativeKernel):
        raise TypeError(
            "jaxbind.numba_kernel: expected a Python function fn(out, args, kwargs) (or a numba.njit "
            f"function), got {type(fn).__name__}."
        )
    if type(fn).__module__.startswith("numba") and not _is_dispatcher(fn):
        raise TypeError(
            f"jaxbind.numba_kernel: {fn!r:.100} is a {type(fn).__name__}, not a Python function or a "
            "numba.njit function; a numba.cfunc with the kernel signature is a kernel already: pass it "
            "to the op directly."
        )
    if _is_dispatcher(fn) and fn.targetoptions.get("forceobj"):
        raise TypeError(_object_mode_refusal(fn.py_func))
    return NumbaKernel(fn, name, concurrent)


def _object_mode_refusal(py_func) -> str:
    """Why a numba function compiled in object mode is not a kernel."""
    name = getattr(py_func, "__name__", None) or type(py_func).__name__
    return (
        f"jaxbind.numba_kernel: '{name}' is compiled in numba's object mode (forceobj=True), whose "
        "code handles Python objects and needs the GIL, which "
        "a native kernel runs without; compile it in nopython mode (numba.njit, or pass the plain Python "
        "function), or make the op from a Python callback instead."
    )


@functools.lru_cache(None)
def _numba_or_raise():
    try:
        import numba  # noqa: F401
    except ImportError as err:
        raise ImportError(
            f"jaxbind.numba_kernel needs numba, which is not installed: {INSTALL_HINT}"
        ) from err
    return numba


def _is_dispatcher(fn) -> bool:
    from numba.core.registry import CPUDispatcher
    return isinstance(fn, CPUDispatcher)


# ---------------------------------------------------------------------------
# Compiled state per function: its entries and variants
# ---------------------------------------------------------------------------

_EXITING = np.zeros(1, np.int64)  # set at exit: the compiled code then calls no Python
_ENTRIES: "weakref.WeakValueDictionary[int, _Entry]" = weakref.WeakValueDictionary()
_ENTRY_IDS = itertools.count(1)


def _at_exit():
    _EXITING[0] = 1


atexit.register(_at_exit)  # (runs before jaxbind's own exit hook, registered earlier)


def _hook(entry_id: int, call_address: int) -> int:
    """Called (with the GIL, by ctypes) by an entry that met a call signature new to it."""
    try:
        entry = _ENTRIES.get(entry_id)
        if entry is None:
            raise RuntimeError("the kernel's compiled state is gone")
        return entry.variant_address(call_address)
    except BaseException as err:  # nothing may escape into XLA's thread
        try:
            _write_error(call_address, str(err))
        except BaseException:
            pass
        return 0


_HOOK_TYPE = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)
_HOOK = _HOOK_TYPE(_hook)
_HOOK_ADDRESS = ctypes.cast(_HOOK, ctypes.c_void_p).value


class _Program:
    """The numba dispatcher of one function, and everything compiled from it."""

    # Kernels of the same function share it; it lives as long as a kernel (and so a call site)
    # holds it, and its function with it (a closure's captured arrays too).
    _by_fn: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
    _lock = threading.Lock()

    @classmethod
    def of(cls, fn) -> "_Program":
        with cls._lock:
            program = cls._by_fn.get(fn)
            if program is None:
                program = cls._by_fn[fn] = cls(fn)
            return program

    def __init__(self, fn):
        numba = _numba_or_raise()
        self.fn = fn
        self.fn_name = getattr(fn, "__name__", None) or type(fn).__name__
        self.dispatcher = fn if _is_dispatcher(fn) else numba.njit(nogil=True, error_model="numpy")(fn)
        self.lock = threading.RLock()  # compiling, and the tables (writers only)
        self.entries = {}
        self.variants = {}

    # -- at lowering ---------------------------------------------------------

    def entry_for(self, kernel_name: str, in_avals, out_avals, kwargs: dict) -> "_Entry":
        """The entry for a call site's kwargs; refuses, naming them, dtypes and kwargs numba cannot take."""
        where = f"jaxbind numba kernel '{kernel_name}'"
        for side, avals in (("input", in_avals), ("output", out_avals)):
            for k, aval in enumerate(avals):
                _check_dtype(aval.dtype, f"{where}: {side} {k}")
        signature = _kwarg_signature(kwargs, where)
        with self.lock:
            entry = self.entries.get(signature)
            if entry is None:
                entry = self.entries[signature] = _Entry(self)
            return entry

    # -- at run time, from the hook ------------------------------------------

    def variant(self, in_sig, out_sig, kwargs) -> "_Variant":
        """The variant for ``(dtype code, rank)`` per input and output and ``(name, type)`` per kwarg."""
        key = (in_sig, out_sig, kwargs)
        with self.lock:
            variant = self.variants.get(key)
            if variant is None:
                try:
                    variant = _Variant(self, in_sig, out_sig, kwargs)
                except Exception as err:  # kept: the next call fails as fast, with the same message
                    variant = err
                self.variants[key] = variant
            if isinstance(variant, Exception):
                raise variant
            return variant


_NUMPY_DTYPES = {}  # dtype code -> NumPy dtype, for the codes of dtypes NumPy itself has
for _name, _code in _trampoline.DTYPE_CODES.items():
    try:
        _NUMPY_DTYPES[_code] = np.dtype(_name)
    except TypeError:
        pass
_DTYPE_NAMES = {code: name for name, code in _trampoline.DTYPE_CODES.items()}


def _check_dtype(dtype, what: str, code: Optional[int] = None) -> np.dtype:
    """``dtype`` if numba takes it (None: the dtype of the code ``code``, which NumPy lacks)."""
    numba = _numba_or_raise()
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


def _kwarg_signature(kwargs: dict, where: str) -> tuple:
    """``((name, type code), ...)`` of an op call's kwargs; refuses what a numba kernel cannot take."""
    signature = []
    for key, value in kwargs.items():
        _, code, _ = _kwarg_entry(key, value, where)
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


# ---------------------------------------------------------------------------
# Code generation. The generated code reads the call struct as int64 words (CALL,
# ARRAY and KWARG give each field's word) through small intrinsics: _ptr (an
# address as a pointer), _call_kernel and _call_hook (calls through function
# pointers), and a guard per variant that calls fn with numba's calling
# convention, so that an exception fn raises comes back as a status.
# ---------------------------------------------------------------------------


_MACHINERY = {}
_MACHINERY_LOCK = threading.Lock()


def _machinery() -> dict:
    """The intrinsics, helpers and the generic entry the generated code uses (made once)."""
    with _MACHINERY_LOCK:  # (held while compiling: two threads must not make two)
        if not _MACHINERY:
            _MACHINERY.update(_make_machinery())
        return _MACHINERY


def _make_machinery() -> dict:
    numba = _numba_or_raise()
    import llvmlite.binding as llvm
    from llvmlite import ir
    from numba import carray, types
    from numba.core import cgutils
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

    def _read_only(tuple_type):
        """A tuple (or named tuple) type with its array members read-only."""
        members = [t.copy(readonly=True) if isinstance(t, types.Array) else t for t in tuple_type]
        if isinstance(tuple_type, (types.NamedTuple, types.NamedUniTuple)):
            return types.BaseTuple.from_types(members, tuple_type.instance_class)
        return types.BaseTuple.from_types(members)

    def guard(dispatcher, variant_id):
        """An intrinsic ``guarded(call, out, args, kwargs) -> int32`` that calls ``dispatcher`` (fn)
        and returns 0, or, when fn raised, writes its message to the call's error buffer (taking
        the GIL for that only) and returns 1; 2 (no message) when Python is exiting."""

        # numba keeps every intrinsic in its registries for the process: this one holds fn's
        # dispatcher only weakly (it needs it while the variant compiles), so that a freed
        # kernel's function, and whatever it captured, can go.
        dispatcher_ref = weakref.ref(dispatcher)
        del dispatcher

        @intrinsic
        def guarded(typingctx, call, out, args, kwargs):
            dispatcher = dispatcher_ref()
            # fn sees its inputs and kwargs as read-only arrays (the same data model as the
            # writable arrays the variant makes, so the values pass as they are): an input is
            # XLA's buffer, perhaps the caller's jax.Array, and an array kwarg is shared by
            # every call with an equal kwarg. A write into one fails to compile, with numba's message.
            argtypes = (out, _read_only(args), _read_only(kwargs))
            dispatcher.compile(argtypes)  # (numba's own errors, e.g. typing, surface here)
            compiled = dispatcher.overloads[argtypes]
            if compiled.objectmode:  # (the kernel's form was checked when it was made; this is the last word)
                raise TypeError(_object_mode_refusal(dispatcher.py_func))
            # fn is called by the address of its compiled code, as an external symbol: not
            # linked into (and optimized again with) every variant
            symbol = f"jaxbind_numba_fn_{variant_id}"
            llvm.add_symbol(symbol, compiled.library.get_pointer_to_function(compiled.fndesc.llvm_func_name))
            restype, fn_argtypes = compiled.signature.return_type, compiled.signature.args

            def codegen(context, builder, signature, llargs):
                callee = cgutils.get_or_insert_function(
                    builder.module, context.call_conv.get_function_type(restype, fn_argtypes), symbol)
                status, _ = context.call_conv.call_function(builder, callee, restype, fn_argtypes, llargs[1:])
                i64, i32 = ir.IntType(64), ir.IntType(32)
                result = cgutils.alloca_once_value(builder, ir.Constant(i32, 0))
                with builder.if_then(status.is_error, likely=False):
                    exiting_at = ir.Constant(i64, _EXITING.ctypes.data).inttoptr(i64.as_pointer())
                    exiting = builder.icmp_signed("!=", builder.load(exiting_at), ir.Constant(i64, 0))
                    with builder.if_else(exiting) as (then, otherwise):
                        with then:
                            builder.store(ir.Constant(i32, 2), result)
                        with otherwise:
                            builder.store(ir.Constant(i32, 1), result)
                            pyapi = context.get_python_api(builder)
                            gil = pyapi.gil_ensure()
                            context.call_conv.raise_error(builder, pyapi, status)
                            slots = [cgutils.alloca_once(builder, pyapi.pyobj) for _ in range(3)]
                            pyapi.err_fetch(*slots)
                            exc_type, exc_value, traceback = (builder.load(slot) for slot in slots)
                            none = pyapi.borrow_none()
                            objects = [builder.select(cgutils.is_null(builder, obj), none, obj)
                                       for obj in (exc_type, exc_value)]
                            objects.append(pyapi.long_from_longlong(builder.ptrtoint(llargs[0], i64)))
                            objects.append(pyapi.long_from_longlong(ir.Constant(i64, variant_id)))
                            reporter = ir.Constant(i64, id(_report)).inttoptr(pyapi.pyobj)
                            done = pyapi.call_function_objargs(reporter, objects)
                            for obj in [done, exc_type, exc_value, traceback] + objects[2:]:
                                pyapi.decref(obj)  # (Py_DecRef: NULL-safe)
                            pyapi.err_clear()
                            pyapi.gil_release(gil)
                return builder.load(result)

            return types.int32(call, out, args, kwargs), codegen

        return guarded

    namespace = dict(numba=numba, carray=carray, types=types, np=np, _ptr=_ptr, _call_kernel=_call_kernel,
                     _call_hook=_call_hook, _fail=_fail, _find=_find)
    # The entry all call sites run (through a trampoline naming its table): finds the call's
    # signature in the table, or asks the hook for it.
    texts = []
    exiting = _text("numba kernel: not compiled for this call's signature, and Python is exiting", texts)
    source = f"""
def entry(call, table, entry_id):
    c = carray(call, {CALL_WORDS}, np.int64)
    n_in, n_out, n_kwargs = c[{CALL['n_in']}], c[{CALL['n_out']}], c[{CALL['n_kwargs']}]
    i = carray(_ptr(c[{CALL['in_']}]), {ARRAY_WORDS} * n_in, np.int64)
    o = carray(_ptr(c[{CALL['out']}]), {ARRAY_WORDS} * n_out, np.int64)
    t = carray(_ptr(table), {_TABLE_WORDS}, np.int64)
    p = 0
    while p + 4 <= {_TABLE_WORDS}:
        if t[p] < 0 or t[p + 1] < 0 or t[p + 2] < 0:
            break
        length = 4 + 2 * (t[p] + t[p + 1])
        if t[p] == n_in and t[p + 1] == n_out and t[p + 2] == n_kwargs:
            same = True
            for k in range(n_in + n_out):
                d = i if k < n_in else o
                q = {ARRAY_WORDS} * (k if k < n_in else k - n_in)
                if t[p + 3 + 2 * k] != d[q + {ARRAY['dtype']}] or t[p + 4 + 2 * k] != d[q + {ARRAY['rank']}]:
                    same = False
                    break
            if same:
                address = t[p + length - 1]
                if address == 0:
                    break
                return _call_kernel(address, call)
        p += length
    if carray(_ptr({_EXITING.ctypes.data}), 1, np.int64)[0] != 0:
        return _fail(c, {exiting})
    address = _call_hook({_HOOK_ADDRESS}, entry_id, call)
    if address == 0:
        return np.int32(1)
    return _call_kernel(address, call)
"""
    scope = dict(namespace)
    exec(compile(source, "<jaxbind numba entry>", "exec"), scope)
    entry = numba.cfunc(types.int32(types.voidptr, types.int64, types.int64), nopython=True)(scope["entry"])
    return dict(namespace, guard=guard, entry=entry, texts=texts, read_only=_read_only)


def _text(text: str, keep: list) -> str:
    """Source code for a NUL-terminated UTF-8 ``text`` as a uint8 array, which ``keep`` owns.

    (By address: numba makes an LLVM constant of a global array element by
    element, which costs more than the rest of a variant's compilation.)
    """
    data = np.frombuffer(text.encode("utf-8") + b"\0", np.uint8).copy()
    keep.append(data)
    return f"carray(_ptr({data.ctypes.data}), {data.size}, np.uint8)"


# Engines of trampolines whose entries were freed, disposed of by the next trampoline compiled (under
# numba's compiler lock): an engine freed by the collector could be disposed of in the middle of a
# compilation of numba's, on the same thread.
_FREED_ENGINES = []


def _free_engine(engine):
    _FREED_ENGINES.append(engine)


def _trampoline(target: int, *constants: int):
    """``int f(const jaxbind_call *call)`` calling ``int target(call, *constants)`` (int64 constants).

    A few lines of LLVM IR, compiled in milliseconds: what gives each entry an
    address of its own. Returns (address, the owner of the code). Under numba's
    compiler lock: LLVM's context is not to be used by two threads at once.
    """
    from numba.core.compiler_lock import global_compiler_lock

    with global_compiler_lock:
        return _compile_trampoline(target, constants)


def _compile_trampoline(target: int, constants: tuple):
    import llvmlite.binding as llvm
    from llvmlite import ir

    while _FREED_ENGINES:
        _FREED_ENGINES.pop().close()
    # A target machine of its own: an engine owns the one it is made with and frees it with itself.
    machine = llvm.Target.from_default_triple().create_target_machine()
    i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)
    module = ir.Module(name="jaxbind_numba_trampoline")
    module.triple = llvm.get_process_triple()
    function = ir.Function(module, ir.FunctionType(i32, [i8p]), name="jaxbind_numba_trampoline")
    builder = ir.IRBuilder(function.append_basic_block())
    target_type = ir.FunctionType(i32, [i8p] + [i64] * len(constants))
    callee = builder.inttoptr(ir.Constant(i64, target), target_type.as_pointer())
    builder.ret(builder.call(callee, [function.args[0]] + [ir.Constant(i64, c) for c in constants]))
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    engine = llvm.create_mcjit_compiler(parsed, machine)
    engine.finalize_object()
    return engine.get_function_address("jaxbind_numba_trampoline"), engine


class _Entry:
    """The address call sites get: finds the call's signature in its table and runs the variant
    made for it, or has the hook make one.

    A call site's address serves every call the site makes, and jaxbind keeps one site for
    calls that differ in their avals (dtypes, ranks, even arity: a site is keyed by the op's
    callback, kwargs and batch), so the entry reads all of that from each call. The table is
    a flat int64 array of rows ``[n_in, n_out, n_kwargs, (dtype, rank) per input and output,
    address]``, ended by -1; the hook appends rows under the program's lock, writing the
    first word last, so that a reader sees -1 or a whole row. The code is one generic entry,
    compiled once; each entry is a trampoline passing it the entry's table.
    """

    def __init__(self, program: _Program):
        self.program = program
        self.table = np.full(_TABLE_WORDS, -1, np.int64)
        self.used = 0  # words of the table in rows
        self.id = next(_ENTRY_IDS)
        _ENTRIES[self.id] = self
        generic = _machinery()["entry"]
        self.address, engine = _trampoline(generic.address, self.table.ctypes.data, self.id)
        self._code = generic  # (the trampoline calls the generic entry by its address)
        weakref.finalize(self, _free_engine, engine)

    def variant_address(self, call_address: int) -> int:
        """The variant for this call's signature, compiled if new, entered in the table."""
        in_sig, out_sig, kwargs = _call_signature(call_address)
        variant = self.program.variant(in_sig, out_sig, kwargs)
        row = [len(in_sig), len(out_sig), len(kwargs)] + [w for pair in in_sig + out_sig for w in pair]
        row.append(variant.address)
        with self.program.lock:
            if self.id not in variant.in_tables and self.used + len(row) <= _TABLE_WORDS:
                self.table[self.used + 1:self.used + len(row)] = row[1:]
                self.table[self.used] = row[0]  # last: a reader sees -1 or a whole row
                self.used += len(row)
                variant.in_tables.add(self.id)
        return variant.address


_REPORTS = {}  # variant id -> the name of its function, for messages
_VARIANT_IDS = itertools.count(1)


def _report(exc_type, exc_value, call_address, variant_id):
    """Called with the GIL by a variant whose fn raised: the exception's message into the call's error buffer."""
    exc = exc_value
    if not isinstance(exc, BaseException):
        try:
            args = exc if isinstance(exc, tuple) else (() if exc is None else (exc,))
            exc = exc_type(*args)
        except Exception:
            exc = None
    name = _REPORTS.get(variant_id, "?")
    if exc is None:
        text = f"numba kernel '{name}' raised an exception"
    else:
        text = f"numba kernel '{name}' raised {type(exc).__name__}: {exc}"
    _write_error(call_address, text)


class _Variant:
    """``fn`` for one combination of dtypes, ranks and kwargs, behind the kernel signature:
    one cfunc that makes the arrays and the kwargs from the call and calls fn through the guard."""

    def __init__(self, program: _Program, in_sig: tuple, out_sig: tuple, kwargs: tuple):
        m = _machinery()
        n_in, n_out = len(in_sig), len(out_sig)
        where = f"numba kernel '{program.fn_name}'"
        dtypes = [code for code, _ in in_sig + out_sig]
        ranks = [rank for _, rank in in_sig + out_sig]
        dtypes_np = [_check_dtype(_NUMPY_DTYPES.get(code), f"{where}: " + (
            f"input {k}" if k < n_in else f"output {k - n_in}"), code) for k, code in enumerate(dtypes)]
        self.description = ", ".join(
            (f"input {k}" if k < n_in else f"output {k - n_in}") + f": {dtypes_np[k].name}[{ranks[k]}d]"
            for k in range(n_in + n_out))
        self.in_tables = set()  # ids of the entries whose table has this variant
        for name, code in kwargs:
            if code not in _KWARG_KINDS:
                raise TypeError(f"{where}: keyword argument '{name}' has a type a numba kernel cannot take "
                                f"(code {code})")
        self.id = next(_VARIANT_IDS)
        _REPORTS[self.id] = program.fn_name
        self._texts = []  # the messages and names the compiled code reads by address
        mismatch = _text(f"{where}: the call does not match the signature it was compiled for "
                         f"({self.description}); a jaxbind bug", self._texts)
        exiting = _text(f"{where} raised an exception while Python was exiting", self._texts)

        namespace = {"guarded": m["guard"](program.dispatcher, self.id),
                     "KW": collections.namedtuple("kwargs", [n for n, _ in kwargs])}
        checks = [f"c[{CALL['n_in']}] != {n_in}", f"c[{CALL['n_out']}] != {n_out}",
                  f"c[{CALL['n_kwargs']}] != {len(kwargs)}"]
        lines = [f"    i = carray(_ptr(c[{CALL['in_']}]), {ARRAY_WORDS * n_in}, np.int64)",
                 f"    o = carray(_ptr(c[{CALL['out']}]), {ARRAY_WORDS * n_out}, np.int64)"]
        arrays = {"i": [], "o": []}
        for k in range(n_in + n_out):
            side, index = ("i", k) if k < n_in else ("o", k - n_in)
            base = index * ARRAY_WORDS
            name = f"{side}{index}"
            namespace[f"D_{name}"] = dtypes_np[k]
            if ranks[k]:
                lines.append(f"    s = carray(_ptr({side}[{base + ARRAY['shape']}]), {ranks[k]}, np.int64)")
                shape = "(" + "".join(f"s[{d}], " for d in range(ranks[k])) + ")"
            else:
                shape = "()"
            lines.append(f"    {name} = carray(_ptr({side}[{base + ARRAY['data']}]), {shape}, D_{name})")
            arrays[side].append(name)
        if kwargs:
            lines += [f"    w = carray(_ptr(c[{CALL['kwargs']}]), {KWARG_WORDS * len(kwargs)}, np.int64)",
                      f"    f = carray(_ptr(c[{CALL['kwargs']}]), {KWARG_WORDS * len(kwargs)}, np.float64)"]
        values = []
        for k, (name, code) in enumerate(kwargs):
            lines += [f"    k = _find(w, {len(kwargs)}, {k}, {_text(name, self._texts)})",
                      f"    if k < 0 or w[k * {KWARG_WORDS} + {KWARG['type']}] != {code}:",
                      f"        return _fail(c, {mismatch})",
                      f"    b = k * {KWARG_WORDS}"]
            if code == KW_INT:
                lines.append(f"    v{k} = w[b + {KWARG['int_value']}]")
            elif code == KW_BOOL:
                lines.append(f"    v{k} = w[b + {KWARG['int_value']}] != 0")
            elif code == KW_FLOAT:
                lines.append(f"    v{k} = f[b + {KWARG['float_value']}]")
            else:
                field, dtype = ("int_array", "np.int64") if code == KW_INT_ARRAY else ("float_array", "np.float64")
                lines.append(f"    v{k} = carray(_ptr(w[b + {KWARG[field]}]), w[b + {KWARG['size']}], {dtype})")
            values.append(f"v{k}")
        tuple_of = lambda names: "(" + "".join(f"{n}, " for n in names) + ")"  # noqa: E731
        source = "\n".join(
            ["def variant(call):",
             f"    c = carray(call, {CALL_WORDS}, np.int64)",
             f"    if {checks[0]} or {checks[1]} or {checks[2]}:",
             f"        return _fail(c, {mismatch})"]
            + lines  # (the entry checked the dtypes and ranks: it found this variant by them)
            + [f"    status = guarded(call, {tuple_of(arrays['o'])}, {tuple_of(arrays['i'])}, KW({', '.join(values)}))",
               "    if status == 2:",
               f"        return _fail(c, {exiting})",
               "    return status"]) + "\n"
        # fn first, on its own, for numba's own message when it does not compile (the guard
        # compiles it for the same types again, which finds this compiled version)
        types = m["types"]
        arrays_t = [types.Array(m["numba"].from_dtype(dtypes_np[k]), ranks[k], "C") for k in range(n_in + n_out)]
        field_t = {KW_INT: types.int64, KW_FLOAT: types.float64, KW_BOOL: types.boolean,
                   KW_INT_ARRAY: types.Array(types.int64, 1, "C"), KW_FLOAT_ARRAY: types.Array(types.float64, 1, "C")}
        argtypes = (types.BaseTuple.from_types(arrays_t[n_in:]),
                    m["read_only"](types.BaseTuple.from_types(arrays_t[:n_in])),
                    m["read_only"](types.BaseTuple.from_types([field_t[code] for _, code in kwargs],
                                                              namespace["KW"])))
        try:
            program.dispatcher.compile(argtypes)
        except Exception as err:
            raise RuntimeError(_compile_error(program.fn_name, self.description, kwargs, err)) from None
        scope = dict(m, **namespace)
        exec(compile(source, f"<jaxbind numba variant of {program.fn_name}>", "exec"), scope)
        try:
            self.cfunc = m["numba"].cfunc(m["types"].int32(m["types"].voidptr), nopython=True)(scope["variant"])
        except Exception as err:
            raise RuntimeError(_compile_error(program.fn_name, self.description, kwargs, err)) from None
        self.address = self.cfunc.address


def _compile_error(fn_name, description, kwargs, err) -> str:
    """numba's error for a kernel that does not compile, without the frames of jaxbind's wrapper."""
    kinds = ", ".join(f"{name}: {_KWARG_KINDS.get(code, '?')}" for name, code in kwargs) or "none"
    kept = []
    for line in str(err).strip().splitlines():
        if "During: resolving callee type" in line or "<jaxbind numba" in line:
            break
        if line.startswith("File ") and line in kept:  # (numba shows the place twice)
            break
        if not (kept and line == kept[-1]):
            kept.append(line)
    details = "\n".join(kept).strip()
    return f"numba could not compile kernel '{fn_name}' for {description} (kwargs: {kinds}):\n{details}"

"""Native kernels: C function pointers that XLA calls with no Python and no GIL.

A kernel has the signature ``int kernel(const jaxbind_call *call)`` declared in
the public header ``jaxbind.h`` (its folder: :func:`get_include`).
"""

from __future__ import annotations

import ctypes
import functools
import numbers
import os

import numpy as np

from . import _trampoline
from ._native_kwargs import declare

__all__ = ["NativeKernel", "as_kernel", "get_include", "native"]


def get_include() -> str:
    """The folder holding ``jaxbind.h`` and its Fortran twin ``jaxbind.f90``.

    Give it to the compiler (``-I``, and the Fortran module's source path) when
    compiling a native kernel. The header documents the calling convention of
    a kernel, ``int kernel(const jaxbind_call *call)``.

    Returns
    -------
    str
        The absolute path of the ``include`` folder of the installed package.

    Examples
    --------
    ``cc -O2 -shared -fPIC -I$(python -c "import jaxbind; print(jaxbind.get_include())") kernel.c``
    """
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


class NativeKernel:
    """The address of a C function with the jaxbind kernel signature.

    A kernel is ``int kernel(const jaxbind_call *call)`` (see the header in
    :func:`jaxbind.get_include`); XLA calls it with no Python and no GIL.
    Make one with :func:`jaxbind.native` (which also accepts a ctypes
    function, a ``numba.cfunc`` or a ``PyCapsule``) rather than with the
    constructor, which does not check the address. Any callback of an op
    (``f``, a transpose, ``f_jvp``, ``f_vjp``) may be a kernel.

    Equal (and hashed) by address, name, mode and declared kwargs, so ops
    built from the same kernels share compiled code, and an error always
    names the kernel the op was given. ``keepalive`` holds whatever owns the code (a ctypes function, a
    numba cfunc, a library handle) for as long as the kernel lives.
    ``concurrent`` kernels run on XLA's thread pool (see :func:`jaxbind.native`).

    Without a name the kernel takes the name of the exported symbol at its
    address, when there is one (``dladdr``); a kernel that still has none
    (``__name__`` None) is named by the op it is given to (after the op and
    the callback's place, ``op.f_T``), or, when the op would be named after
    it, refused with a request for ``name=``.

    Parameters
    ----------
    address : int
        The function's address (converted with ``int``).
    name : str, optional
        A name for error messages and jaxprs (default: the exported symbol at
        ``address``, if any).
    keepalive : object, optional
        An object to keep alive as long as the kernel (the owner of the code).
    concurrent : bool, default False
        Run the kernel on XLA's thread pool (see :func:`jaxbind.native`).
    kwargs : dict, optional
        The keyword arguments the kernel takes (see :func:`jaxbind.native`).

    Attributes
    ----------
    address : int
        The function's address (0 for a kernel compiled per call site, such as
        one made by :func:`jaxbind.numba_kernel`).
    concurrent : bool
        Whether the kernel runs on XLA's thread pool.
    declared : object or None
        The kwargs it declares (``kwargs=``), or None when it declares none.

    Raises
    ------
    TypeError
        If ``address`` is not a number ``int`` can convert (``None``, ...),
        or ``kwargs`` declares a kind a kernel cannot take.
    ValueError
        If ``address`` is a string that is not an integer, or ``kwargs``
        declares a name jaxbind passes itself. An address of 0 is refused
        when the kernel is given to an op, not here.
    """

    __slots__ = ("address", "__name__", "concurrent", "declared", "_keepalive")
    _per_site = False  # True: the address comes from address_for only (compiled per call site)
    _kind = "native kernel"  # (for messages)
    _fields = False  # True: it reads its kwargs as fields, so a declared kwarg without a default must be passed

    def __init__(self, address: int, name: str | None = None, keepalive=None, concurrent: bool = False, kwargs=None):
        self.address = int(address)
        self.__name__ = name or _symbol_name(self.address)
        self.concurrent = bool(concurrent)
        self.declared = _declare(kwargs, "jaxbind.native", self._fields)
        self._keepalive = keepalive

    def _key(self):
        return (self.address, self.__name__, self.concurrent, self.declared)

    def _with(self, name: str | None, concurrent: bool, keepalive, kwargs=None) -> NativeKernel:
        """The same code under another name, mode or declaration (a subclass keeps its kind)."""
        return NativeKernel(
            self.address,
            name or self.__name__,
            (self._keepalive, keepalive),
            concurrent,
            self.declared if kwargs is None else kwargs,
        )

    def address_for(self, in_avals, out_avals, kwargs: dict) -> int:
        """The address to call for one call site: its inputs' and outputs' avals and its kwargs.

        A plain kernel has one address; a kernel compiled per signature (e.g.
        from Python with numba) compiles or looks up the one for these.
        jaxbind calls it when it registers a call site; user code has no need
        to.

        Parameters
        ----------
        in_avals : sequence of jax.core.ShapedArray
            The shapes and dtypes of the call site's inputs.
        out_avals : sequence of jax.core.ShapedArray
            The shapes and dtypes of its outputs.
        kwargs : dict
            The op call's keyword arguments.

        Returns
        -------
        int
            The address of the function to call (here: :attr:`address`).
        """
        return self.address

    def __eq__(self, other):
        return isinstance(other, NativeKernel) and self._key() == other._key()

    def __hash__(self):
        return hash(("jaxbind-native",) + self._key())

    def __repr__(self):
        mode = ", concurrent" if self.concurrent else ""
        declared = "" if self.declared is None else f", kwargs={self.declared!r}"
        return f"<jaxbind native kernel {self.__name__!r} at {self.address:#x}{mode}{declared}>"


def _declare(kwargs, where: str, fields: bool):
    """A kernel's declared kwargs (``_native_kwargs.declare``), or None when it declares none."""
    return None if kwargs is None else declare(kwargs, where, fields)


class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


@functools.lru_cache(None)
def _dladdr():
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except (OSError, AttributeError, TypeError):  # (no dladdr on this platform)
        return None
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    dladdr.restype = ctypes.c_int
    return dladdr


def _symbol_name(address: int) -> str | None:
    """The exported symbol that begins at ``address`` (``dladdr``), or None."""
    dladdr = _dladdr()
    if dladdr is None or not address:
        return None
    info = _DlInfo()
    try:
        if not dladdr(address, ctypes.byref(info)):
            return None
    except (ctypes.ArgumentError, OverflowError):
        return None
    if not info.dli_sname or info.dli_saddr != address:
        return None
    return info.dli_sname.decode("utf-8", "replace")


def native(kernel, *, name: str | None = None, keepalive=None, concurrent: bool = False, kwargs=None) -> NativeKernel:
    """Mark a native kernel (``int kernel(const jaxbind_call*)``) for jaxbind.

    A native kernel is accepted wherever an op takes a callback (``f``, a
    transpose, ``f_jvp``, ``f_vjp``); XLA then calls it directly, with no
    Python and no GIL, and vmap walks the batch in C++ (over XLA's threads
    when the elements are long). A bare integer is not accepted as a callback:
    wrap an address with this function. Ctypes functions, numba cfuncs and
    PyCapsules can be given to an op as they are; pass them here to name
    them, keep an owner alive or make them concurrent.

    Parameters
    ----------
    kernel : int or native kernel
        The function's address as an integer (e.g. from
        ``ctypes.cast(fn, ctypes.c_void_p).value``), or any native form jaxbind
        accepts (a ctypes function, a numba cfunc, a PyCapsule, a
        :class:`jaxbind.NativeKernel`).
    name : str, optional
        A name for error messages and jaxprs (default: the kernel's own name,
        else the exported symbol at its address, if any).
    keepalive : object, optional
        An object to keep alive as long as the kernel (the owner of the code).
    concurrent : bool, default False
        Run the kernel on XLA's thread pool, so that XLA goes on with
        independent work (other kernels included) while it runs. Worth it for
        kernels that take tens of microseconds or more; it adds a few
        microseconds per call. XLA runs small programs (up to 8 operations)
        sequentially whatever the op does.
    kwargs : dict, optional
        The keyword arguments the kernel takes, ``{name: kind}`` with a kind
        of ``int``, ``float``, ``bool``, ``str``, ``list[int]`` or
        ``list[float]``, or ``{name: default}`` with a default value (whose
        type is the kind: ``1.0`` declares a float, ``1`` an int). An op call
        passing a name the kernel does not declare, or a value its kind does
        not take, is then refused when the op is called, naming the op, the
        kernel and the kwarg. A value the kind takes reaches the kernel as the
        kind (an int declared ``float`` as a float, ``[1, 2]`` declared
        ``list[float]`` as floats); an omitted kwarg gets its default, or,
        without one, is absent (the kernel's own fallback applies). ``{}``
        declares a kernel that takes no kwargs. Default: nothing declared,
        every kwarg passed as it is (an accessor that cannot read one as it
        asks fails the call). A kernel that declares kwargs is another kernel
        than the same code without (another op).

    Returns
    -------
    NativeKernel
        The kernel, equal to every kernel of the same address (or function),
        name, mode and declared kwargs.

    Raises
    ------
    TypeError
        If ``kernel`` is neither an integer nor a native form, or is a ctypes
        function or ``numba.cfunc`` declared with another signature than the
        kernel's (``restype`` ``c_int`` and one pointer argument;
        ``int32(voidptr)``).
        Also if ``kwargs`` is not a dict or declares a kind (or a default
        value) a kernel cannot take.
    ValueError
        If the address is 0 (a null function pointer, also a ``PyCapsule``
        holding NULL) or is not a valid 64-bit address, or ``kwargs``
        declares ``batch_levels`` or ``batch_axes`` (jaxbind passes them).

    Examples
    --------
    >>> import ctypes, jaxbind                          # doctest: +SKIP
    >>> lib = ctypes.CDLL("./libscale.so")              # doctest: +SKIP
    >>> kernel = jaxbind.native(lib.scale, concurrent=True, kwargs={"factor": float})  # doctest: +SKIP
    >>> op = jaxbind.get_linear_call(kernel, kernel, abstract, abstract)  # doctest: +SKIP
    """
    if isinstance(kernel, (bool, np.bool_)) or not isinstance(kernel, (numbers.Integral, np.integer)):
        found = as_kernel(kernel, "the kernel", None, name_unnamed=False)
        if found is None:
            raise TypeError(f"jaxbind.native: expected an address or a native kernel, got {type(kernel).__name__}.")
        return found._with(name, concurrent, keepalive, kwargs)
    if kernel == 0:
        raise ValueError("jaxbind.native: the address is 0 (a null function pointer).")
    if kernel < 0 or kernel >= 1 << 64:
        raise ValueError(f"jaxbind.native: {kernel} is not a valid address.")
    return NativeKernel(kernel, name, keepalive, concurrent, kwargs)


def _is_numba_cfunc(obj) -> bool:
    module = type(obj).__module__ or ""
    return module.startswith("numba") and hasattr(obj, "address") and hasattr(obj, "native_name")


KERNEL_SIGNATURE = "int kernel(const jaxbind_call *call)"


def _numba_signature_problem(obj) -> str | None:
    """Why a numba cfunc's signature is not the kernel signature, or None."""
    from numba import types  # (numba is imported already: obj is a cfunc)

    signature = getattr(obj, "_sig", None)
    if signature is None:
        return None  # (unknown: a numba that keeps it elsewhere)
    args, result = tuple(signature.args), signature.return_type
    pointer_like = len(args) == 1 and (
        args[0] == types.voidptr or isinstance(args[0], types.CPointer) or args[0] in (types.int64, types.uint64)
    )
    if result == types.int32 and pointer_like:
        return None
    return (
        f"is a numba.cfunc with the signature {result}({', '.join(map(str, args))}), but a jaxbind "
        f"kernel is {KERNEL_SIGNATURE}: declare it @numba.cfunc(numba.types.int32(numba.types.voidptr)) "
        "(or int32(CPointer(...))), or write it in Python with jaxbind.numba_kernel"
    )


def _ctypes_signature_problem(obj) -> str | None:
    """Why a ctypes function's declared restype/argtypes are not the kernel signature, or None.

    Undeclared argtypes (None, a CDLL function's default) say nothing and pass.
    """
    restype = getattr(obj, "restype", ctypes.c_int)
    argtypes = getattr(obj, "argtypes", None)

    def pointer_like(t):
        return isinstance(t, type) and (
            issubclass(t, (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_wchar_p, ctypes._Pointer))
            or (issubclass(t, ctypes._SimpleCData) and t._type_ in "lLqQ" and ctypes.sizeof(t) == 8)
        )

    good_result = isinstance(restype, type) and issubclass(restype, ctypes.c_int)
    good_args = argtypes is None or (len(argtypes) == 1 and pointer_like(argtypes[0]))
    if good_result and good_args:
        return None
    names = "?" if argtypes is None else ", ".join(getattr(t, "__name__", repr(t)) for t in argtypes)
    result = "None (void)" if restype is None else getattr(restype, "__name__", repr(restype))
    return (
        f"is a ctypes function declared with restype {result} and argtypes [{names}], but a jaxbind "
        f"kernel is {KERNEL_SIGNATURE}: declare restype = ctypes.c_int and argtypes = "
        "[ctypes.c_void_p] (or leave argtypes unset)"
    )


def as_kernel(obj, what: str, op_name: str | None, name_unnamed: bool = True):
    """``obj`` as a :class:`NativeKernel` when it is a native form, else None.

    Native forms: a ctypes function pointer, a numba cfunc, a PyCapsule holding a
    function pointer, or :func:`native`. Raises when ``obj`` looks like an
    address but is unusable, or declares a signature that is not the kernel's.
    ``op_name`` is None while the op has no name yet (it is being named after
    ``f``). A kernel with no name of its own (no symbol at its address) is named
    after the op and its place, ``op.f_T``, or, when that names the op itself,
    refused with a request for ``name=`` (not with ``name_unnamed`` False).
    """
    shown = op_name or getattr(obj, "__name__", None)  # (the op is named after f when op_name is None)
    prefix = f"jaxbind op '{shown}'" if isinstance(shown, str) else "jaxbind"

    def null():
        return ValueError(
            f"{prefix}: {what} is a null function pointer (address 0); pass the address of a compiled kernel."
        )

    if isinstance(obj, NativeKernel):
        kernel = obj
    elif isinstance(obj, ctypes._CFuncPtr):  # a CDLL function or a CFUNCTYPE object
        if _runs_python(obj):
            raise TypeError(
                f"{prefix}: {what} is a ctypes callback of a Python function, which is not a native "
                "kernel: it needs the GIL on XLA's threads, and ctypes prints and ignores its exceptions "
                "(the call would succeed with its outputs unwritten). Pass the Python function itself as "
                "a callback f(out, args, kwargs_dump), or compile it (jaxbind.numba_kernel)."
            )
        address = ctypes.cast(obj, ctypes.c_void_p).value or 0
        problem = _ctypes_signature_problem(obj) if address else None
        if problem:
            raise TypeError(f"{prefix}: {what} {problem}.")
        kernel = NativeKernel(address, getattr(obj, "__name__", None), keepalive=obj)
    elif type(obj).__name__ == "PyCapsule":
        try:
            address = _trampoline.capsule_pointer(obj)
        except ValueError:  # CPython refuses a capsule holding NULL
            raise null() from None
        kernel = NativeKernel(address, None, keepalive=obj)
    elif _is_numba_cfunc(obj):
        problem = _numba_signature_problem(obj)
        if problem:
            raise TypeError(f"{prefix}: {what} {problem}.")
        kernel = NativeKernel(int(obj.address), getattr(obj, "__name__", None), keepalive=obj)
    elif isinstance(obj, (numbers.Integral, np.integer)) and not isinstance(obj, bool):
        raise TypeError(
            f"{prefix}: {what} is an integer. If it is the address of a native "
            "kernel, wrap it: jaxbind.native(address)."
        )
    else:
        return None
    if kernel.address == 0 and not kernel._per_site:
        raise null()
    if kernel.__name__ is None and name_unnamed:
        if op_name is None:
            raise ValueError(
                f"jaxbind: {what} is a native kernel at {kernel.address:#x} with no name jaxbind can find "
                "(no exported symbol begins there), and the op would be named after it: pass name='...' "
                "to the op, or name the kernel: jaxbind.native(kernel, name='...')"
                + (" (or pass a numba cfunc itself, not its .ctypes)." if isinstance(obj, ctypes._CFuncPtr) else ".")
            )
        kernel = kernel._with(f"{op_name}.{what.split()[0]}", kernel.concurrent, None)
    return kernel


def _runs_python(function) -> bool:
    """Whether a ctypes function object is ``CFUNCTYPE(...)(python_callable)`` (its thunk runs Python)."""
    held = getattr(function, "_objects", None) or {}
    return any(type(o).__name__ == "CThunkObject" for o in held.values())

"""The public face: :func:`numba_kernel` checks the form of ``fn`` and makes the :class:`NumbaKernel`, a
:class:`NativeKernel` whose address each call site asks for (:meth:`NumbaKernel.address_for`)."""

from __future__ import annotations

import functools

from .._native import NativeKernel, _declare
from .._native_kwargs import native_kwarg_entry
from ._checks import is_dispatcher, numba_or_raise, object_mode_refusal
from ._program import Program

__all__ = ["NumbaKernel", "numba_kernel"]


def numba_kernel(fn=None, *, name: str | None = None, concurrent: bool = False, kwargs=None):
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
    ``@numba_kernel(name=..., concurrent=..., kwargs=...)``. ``name`` names
    the kernel in messages and is the op's default name (else
    ``fn.__name__``); ``concurrent`` as for :func:`jaxbind.native`, and
    ``kwargs`` too, except that a declared kwarg without a default must be
    passed (``fn`` reads it as a field, which every call must have). Kernels
    are equal by function, name, mode and declared kwargs.

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
    kwargs : dict, optional
        The keyword arguments ``fn`` takes, ``{name: kind}`` (``int``,
        ``float``, ``bool``, ``list[int]``, ``list[float]``) or ``{name:
        default}``: ``fn`` gets each as its kind (an int declared ``float``
        as a float64), an omitted one its default, and a call passing a name
        not declared, a value the kind does not take or (with no default) no
        value is refused when the op is called. Default: nothing declared;
        the fields are typed by each call's values.

    Returns
    -------
    NativeKernel or callable
        The kernel (a :class:`jaxbind.NativeKernel` compiled per signature),
        accepted wherever an op takes a callback; or, when ``fn`` is omitted,
        a decorator that makes one with ``name`` and ``concurrent``.

    Raises
    ------
    ImportError
        If numba is not installed (``pip install numba``).
    TypeError
        If ``name`` is not a non-empty string, ``kwargs`` declares a kind a
        numba kernel cannot take (a string), or ``fn`` is not callable, is a
        native kernel already, is a numba function compiled in object mode
        (``forceobj=True``: its code needs the GIL), or
        is a numba object other than an ``njit`` function (a ``numba.cfunc``
        with the kernel signature is a kernel already: pass it to the op
        directly).
    ValueError
        If ``kwargs`` declares a name that cannot be a field of ``fn``'s
        kwargs (not an identifier, a Python keyword, or beginning with an
        underscore) or that jaxbind passes itself (``batch_levels``,
        ``batch_axes``).

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
    numba_or_raise()
    if fn is None:
        return functools.partial(numba_kernel, name=name, concurrent=concurrent, kwargs=kwargs)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise TypeError(f"jaxbind.numba_kernel: name must be a non-empty string, got {name!r:.100}.")
    if not callable(fn) or isinstance(fn, NativeKernel):
        raise TypeError(
            "jaxbind.numba_kernel: expected a Python function fn(out, args, kwargs) (or a numba.njit "
            f"function), got {type(fn).__name__}."
        )
    if type(fn).__module__.startswith("numba") and not is_dispatcher(fn):
        raise TypeError(
            f"jaxbind.numba_kernel: {fn!r:.100} is a {type(fn).__name__}, not a Python function or a "
            "numba.njit function; a numba.cfunc with the kernel signature is a kernel already: pass it "
            "to the op directly."
        )
    if is_dispatcher(fn) and fn.targetoptions.get("forceobj"):
        raise TypeError(object_mode_refusal(fn.py_func))
    return NumbaKernel(fn, name, concurrent, kwargs=kwargs)


class NumbaKernel(NativeKernel):
    """A jaxbind kernel written in Python and compiled by numba for each signature it meets.

    Equal (and hashed) by its function, name, mode and declared kwargs.
    ``address`` is 0: the code it runs is compiled per call site
    (:meth:`address_for`).
    """

    __slots__ = ("fn", "_program")
    _per_site = True
    _kind = "numba kernel"
    _fields = True

    def __init__(self, fn, name: str | None = None, concurrent: bool = False, keepalive=None, kwargs=None):
        self.address = 0
        self.__name__ = name or getattr(fn, "__name__", None) or type(fn).__name__
        self.concurrent = bool(concurrent)
        self.declared = _declare(kwargs, "jaxbind.numba_kernel", True)
        self._keepalive = keepalive
        self.fn = fn
        self._program = Program.of(fn)

    def _key(self):
        return ("numba", self.fn, self.__name__, self.concurrent, self.declared)

    def _with(self, name, concurrent, keepalive, kwargs=None):
        return NumbaKernel(
            self.fn,
            name or self.__name__,
            concurrent,
            (self._keepalive, keepalive),
            self.declared if kwargs is None else kwargs,
        )

    def address_for(self, in_avals, out_avals, kwargs: dict) -> int:
        label = f"numba kernel '{self.__name__}'"
        if self.declared is not None:  # (as the declaration makes them: the fields' types)
            entries = self.declared.entries(kwargs, label, self)
        else:
            entries = [native_kwarg_entry(key, value, label) for key, value in kwargs.items()]
        return self._program.entry_for(self.__name__, in_avals, out_avals, entries).address

    def __repr__(self):
        mode = ", concurrent" if self.concurrent else ""
        declared = "" if self.declared is None else f", kwargs={self.declared!r}"
        return (
            f"<jaxbind numba kernel {self.__name__!r} of {getattr(self.fn, '__qualname__', self.fn)!r}{mode}{declared}>"
        )

"""The op object: argument checks, the role an arity plays, and the cached compiled call of an eager call."""

from __future__ import annotations

import collections
import functools
import numbers
import threading
from typing import NamedTuple

import jax
import numpy as np

from . import (
    _primitive,  # noqa: F401  (registers the primitive's rules with JAX)
    _trampoline,
)
from ._arguments import check_native_kwargs
from ._bind import bind
from ._definition import OpDef, OpKind, Role
from ._jax_compat import ArrayImpl, runtime_error_of_fast_path
from ._kwargs import Kwargs
from ._sites import register_definition

__all__ = ["Op"]


class OpFunction(NamedTuple):
    """What an op's ``functools.partial`` form carries as its ``_func`` keyword.

    Code written for JAXbind reads ops as ``functools.partial(call, _func=...)``
    and may make a variant with ``op.keywords["_func"]._replace(can_batch=False)``
    and ``functools.partial(op.func, **keywords)``: that variant is the same op
    without the callbacks' own batching (vmap then walks the batch).
    """

    definition: OpDef
    can_batch: bool


def _call_function(*args, _func: OpFunction, **kwargs):
    """``op.func``: calls the op that ``_func`` describes."""
    return Op.of(_func)(*args, **kwargs)


class Op(functools.partial):
    """A callable JAX operation made from user callbacks.

    Ops are made by :func:`jaxbind.get_linear_call` and
    :func:`jaxbind.get_nonlinear_call`, not constructed directly.
    ``op(*arrays, **kwargs)`` returns the list of outputs, eagerly, under
    ``jax.jit``, ``jax.vmap`` and JAX's differentiation (see Notes).
    Keyword arguments are static: they reach ``abstract`` as keyword
    arguments and the callbacks serialized in ``kwargs_dump``.

    Ops are values: ops built from the same functions, flags and name compare
    and hash equal and share compiled code. An op takes attributes
    (``op.__doc__ = ...``), which play no part in equality. An op is also a
    ``functools.partial`` of ``op.func`` with the keyword ``_func`` (an
    ``OpFunction``), as JAXbind's ops are; calling that partial's parts calls
    the op.

    Parameters
    ----------
    definition : OpDef
        Everything the op was made from (its kind, name, callbacks, abstracts
        and flags), as built by :func:`jaxbind.get_linear_call` or
        :func:`jaxbind.get_nonlinear_call`; the constructor is internal.

    Attributes
    ----------
    definition : OpDef
        The op's definition (``op.definition.name``,
        ``op.definition.kind``, ...).

    See Also
    --------
    jaxbind.testing.check_op : check an op's abstracts, derivatives and batching.

    Notes
    -----
    **Calling an op**, ``op(*arrays, **kwargs)``:

    - ``arrays``: the array arguments, JAX or NumPy arrays or scalars, the
      fixed ones first. A linear op needs at least one after its
      ``first_n_args_fixed`` fixed ones, a multilinear op exactly one per
      transpose after them.
    - ``kwargs``: static values of any picklable type (numbers, strings,
      lists, NumPy arrays, ...), keyed by value, so a repeated value never
      recompiles. They are pickled when the op is called and only that
      pickle is kept: mutating a list after passing it changes nothing
      already traced or compiled. With a native kernel among the callbacks,
      only ints, floats, bools, strings and 1-d sequences of ints or floats.
    - Returns the list of the outputs the abstract declares (a nonlinear
      op's residuals excluded). An eager call on concrete arrays runs a
      cached jitted call (at most 128 of them in the process, least recently
      used first out).

    **Errors of a call.** Misuse is reported when the op is called or
    traced, naming the op: ``TypeError`` for an argument that is not an array
    or a scalar, a number of arguments that does not fit the op, a keyword
    argument that is traced, cannot be pickled or cannot be passed to a native
    kernel, ``batch_axes`` passed to an op with ``func_can_batch=True``, or an
    abstract that does not accept the arguments or returns something other
    than one ``(shape, dtype)`` pair per output (or a dtype jaxbind cannot
    pass); ``ValueError`` for an abstract that declares an output larger than
    the machine's memory or no output besides the residuals (or, with
    ``func_can_batch``, an output without every batch level at the axis it
    names), a derivative with respect to a fixed argument, a second-order
    derivative of a nonlinear op, or any derivative of an op made without
    derivatives. A built-in exception raised by an abstract arrives as a
    subclass of its type and of :class:`jaxbind.JaxbindError`.

    An exception raised in a callback (or a failing native kernel) surfaces
    as an exception whose message starts ``INTERNAL: jaxbind op '<name>'``
    and carries the original type, message and traceback: a
    ``jax.errors.JaxRuntimeError`` (a ``RuntimeError``) from an eager call, a
    jitted function's first call and programs XLA runs on its worker
    threads, but a ``ValueError`` from a jitted function that already ran and
    whose program runs on the calling thread (JAX's fast path). Catch
    ``(RuntimeError, ValueError)`` to catch callback failures everywhere.
    """

    # functools.partial gives ops a __dict__ (code written for JAXbind sets
    # attributes on ops, op.__doc__ = ...) and weak references; neither plays
    # a part in equality or hashing.
    __slots__ = ("definition", "_entries", "_eager_keys", "_plain")

    def __new__(cls, definition: OpDef):
        self = super().__new__(cls, _call_function, _func=OpFunction(definition, definition.func_can_batch))
        self.definition = definition
        self._entries = {}  # number of arguments -> the role the op then plays
        self._eager_keys = []  # its entries in _EAGER
        # number of arguments -> the jitted call of a call without kwargs on
        # concrete arrays: the fast path of __call__ (see there)
        self._plain = {}
        register_definition(definition)  # its place among the ops of its name
        return self

    def __init__(self, definition: OpDef):
        pass  # (made in __new__: functools.partial takes its arguments there)

    @staticmethod
    def of(function: OpFunction) -> Op:
        """The op an ``OpFunction`` describes (its own, or its variant with other flags).

        What ``op.func`` calls: code written for JAXbind may make a variant of
        an op with ``op.keywords["_func"]._replace(can_batch=False)``, which is
        the same op without the callbacks' own batching (vmap then walks the batch).

        Parameters
        ----------
        function : OpFunction
            The ``_func`` keyword of an op's ``functools.partial`` form (its
            definition and ``can_batch`` flag).

        Returns
        -------
        Op
            The op of that definition, with ``func_can_batch`` set to
            ``function.can_batch``; made once per definition and flag, then
            reused.
        """
        return function.definition.op_with(bool(function.can_batch), Op)

    def __reduce__(self):
        return (Op, (self.definition,))

    def __del__(self):
        # The op's eager calls go with it (they hold its definition, and so its
        # callbacks and what they capture).
        # An entry equal ops share stays until the last of them is gone.
        gone, lock = _EAGER_GONE, _EAGER_LOCK
        if gone is None or lock is None:  # the module is torn down at exit
            return
        gone.append((id(self), self._eager_keys))
        # Not waiting for the lock: this may run inside a section that holds it (a collection, or
        # an entry that section dropped); the next section settles it then.
        if lock.acquire(blocking=False):
            try:
                left = _settle_gone()
            finally:
                lock.release()
            del left  # (dropped with the lock released: dropping an entry may run any code)

    @property
    def name(self) -> str:
        """The op's name (``name=`` when it was made, else the name of ``f``)."""
        return self.definition.name

    def _call(self, *args, **kwargs):
        """Call the op: run its function on ``args`` and return the list of outputs.

        Parameters
        ----------
        *args : array_like
            The array arguments: JAX or NumPy arrays, or scalars (the fixed
            ones first). A linear op needs at least one array after its
            ``first_n_args_fixed`` fixed ones; a multilinear op exactly one per
            transpose after them.
        **kwargs
            Static keyword arguments: any picklable values (numbers, strings,
            lists, NumPy arrays, ...), passed to the abstracts as keyword
            arguments and to the callbacks in ``kwargs_dump``. With a native
            kernel among the callbacks, only ints, floats, bools, strings and
            1-d sequences of ints or floats.

        Returns
        -------
        list of jax.Array
            One array per output the abstract declares (a nonlinear op's
            residuals excluded), with the declared shapes and dtypes.

        Raises
        ------
        TypeError
            If an argument is not an array or a scalar, the number of
            arguments does not fit the op, a keyword argument is a traced
            value, cannot be pickled, or cannot be passed to a native kernel,
            or ``batch_axes`` is passed to an op with ``func_can_batch=True``
            (jaxbind passes it itself); also when the abstract does not accept
            the arguments or returns something that is not one ``(shape,
            dtype)`` pair per output, or declares a dtype jaxbind cannot pass.
        ValueError
            If the abstract declares an output larger than the machine's
            memory, or no output besides ``n_residuals`` residuals, or (with
            ``func_can_batch``) an output that does not hold every batch level
            at the axis it names; if a derivative is asked for with respect to
            a fixed argument, or (nonlinear ops) a second-order derivative; if an op
            made without derivatives is differentiated; if a callback fails on
            a jitted call JAX runs on its fast path (see the Notes of
            :class:`jaxbind.Op`).
        JaxbindError
            Together with the built-in type it raised (a subclass of both),
            if the abstract raises a built-in exception; an exception type of
            the user's own is raised itself, with a note naming the op.
        jax.errors.JaxRuntimeError
            If a callback raises or a native kernel fails while the op runs
            (a ``RuntimeError`` whose message names the op and carries the
            original exception).
        """
        # (Op.__call__, in the compiled core, runs this unless the call takes
        # the fast path: see _plain below.)
        role = self._entries.get(len(args)) or self._entry(len(args))
        odd_numpy = False
        for i, a in enumerate(args):
            if not isinstance(a, _ARRAY_TYPES):
                raise TypeError(
                    f"jaxbind op '{self.name}': argument {i} is a {type(a).__name__}; op arguments "
                    "must be arrays (jax or NumPy) or scalars. Pass static values as keyword "
                    "arguments instead."
                )
            if isinstance(a, _NUMPY_TYPES) and (not a.dtype.isnative or a.dtype.kind in _NOT_JAX_KINDS):
                # (float0, a void dtype JAX takes, comes here too: rare, eager)
                odd_numpy = True
        if odd_numpy:
            args = self._numpy_for_jax(args)
        kwargs = self._kwargs(kwargs) if kwargs else _NO_KWARGS
        if any(isinstance(a, jax.core.Tracer) for a in args):
            return _bind_arrays(*args, role=role, kwargs=kwargs)
        # Called on concrete arrays: run a cached compiled call, as jax.jit
        # would, instead of dispatching the primitive anew each time.
        # Equal ops play equal roles, so they share the entry (and its executable).
        key = (role, kwargs)
        with _EAGER_LOCK:  # (one thread at a time: without a GIL, the cache's steps interleave)
            left = _settle_gone()
            entry = _EAGER.get(key)
            if entry is None:
                entry = _EAGER[key] = (jax.jit(functools.partial(_bind_arrays, role=role, kwargs=kwargs)), set())
                if len(_EAGER) > EAGER_CACHE_SIZE:
                    left.append(_EAGER.popitem(last=False))
            else:
                _EAGER.move_to_end(key)
            if id(self) not in entry[1]:
                entry[1].add(id(self))
                self._eager_keys.append(key)
                if len(self._eager_keys) > EAGER_CACHE_SIZE:  # forget the evicted ones
                    self._eager_keys = [k for k in self._eager_keys if k in _EAGER]
        del left  # (dropped with the lock released: dropping an entry may run any code)
        call = entry[0]
        if kwargs is _NO_KWARGS and all(type(a) in _CONCRETE_TYPES for a in args):
            # The fast path of later calls like this one, an eager call as a
            # script's loop makes it (no kwargs, JAX or NumPy arrays, by exact
            # type): Op.__call__ goes straight to this jitted call, which
            # JAX's C++ dispatch then serves as it serves jax.jit's. (That
            # keeps the entry of _EAGER running for this op even after it
            # leaves _EAGER by age.)
            self._plain[len(args)] = call
        try:
            return call(*args)
        except ValueError as err:
            raise _callback_error(err)  # noqa: B904  (err itself, or its twin that suppresses err as context)

    def _numpy_for_jax(self, args):
        """``args`` with NumPy arrays in the other byte order copied into native order; a dtype
        JAX cannot take refused, naming the op.

        JAX refuses a swapped array on a first call but reads its bytes as native
        ones on a warm one (wrong values); its values are unambiguous, so an op
        takes them as NumPy would. Op.__call__'s fast path leaves both cases here.
        """
        for i, a in enumerate(args):
            if isinstance(a, _NUMPY_TYPES) and a.dtype.kind in _NOT_JAX_KINDS and not _jax_takes(a.dtype):
                raise TypeError(
                    f"jaxbind op '{self.name}': argument {i} is a NumPy {type(a).__name__} of dtype "
                    f"{a.dtype}, which JAX cannot pass (object, string, structured and datetime dtypes "
                    "are not array types of JAX's). Convert it to a numeric dtype, or pass it as a "
                    "keyword argument if it is a static value."
                )
        return tuple(
            a.astype(a.dtype.newbyteorder("=")) if isinstance(a, np.ndarray) and not a.dtype.isnative else a
            for a in args
        )

    def _entry(self, n: int):
        """Check the number of arguments once; the role the op plays when called with n."""
        d = self.definition
        if d.kind is OpKind.MULTILINEAR and n != d.first_n_args_fixed + d.n_linear_args:
            raise TypeError(
                f"jaxbind op '{d.name}' takes {d.first_n_args_fixed} fixed and "
                f"{d.n_linear_args} multilinear array arguments (one per transpose given), "
                f"but was called with {n}."
            )
        if d.kind is not OpKind.NONLINEAR and n <= d.first_n_args_fixed:
            raise TypeError(
                f"jaxbind op '{d.name}' has first_n_args_fixed={d.first_n_args_fixed} and needs at "
                f"least one linear argument after them, but was called with {n} argument(s)."
            )
        if n < d.first_n_args_fixed:
            raise TypeError(
                f"jaxbind op '{d.name}' has first_n_args_fixed={d.first_n_args_fixed}, "
                f"but was called with only {n} argument(s)."
            )
        role = self._entries[n] = Role.forward(d, n)
        return role

    def _kwargs(self, values: dict) -> Kwargs:
        d = self.definition
        if d.func_can_batch and "batch_axes" in values:
            raise TypeError(
                f"jaxbind op '{d.name}': 'batch_axes' is reserved for ops with func_can_batch=True; "
                "jaxbind passes it to the callbacks itself."
            )
        kwargs = Kwargs(values, d.name)
        if d.has_native:
            check_native_kwargs(values, d)  # refuses what a kernel cannot take or does not declare
        return kwargs

    def __eq__(self, other):
        return isinstance(other, Op) and self.definition == other.definition

    def __hash__(self):
        return hash(self.definition)

    def __repr__(self):
        return f"<jaxbind {self.definition.kind} op '{self.name}'>"


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, numbers.Number)
# The argument types of Op.__call__'s fast path: concrete arrays, by exact type
# (an isinstance check of jax.Array costs more than the rest of the path; the
# compiled core checks the same two types).
_CONCRETE_TYPES = (ArrayImpl, np.ndarray)
_NUMPY_TYPES = (np.ndarray, np.generic)
# NumPy dtype kinds JAX has no array type for: object, bytes, str, void
# (structured), datetime, timedelta, StringDType (the fast path leaves them to
# Op._call by their type numbers).
_NOT_JAX_KINDS = frozenset("OSUVMmT")
_FLOAT0 = jax.dtypes.float0  # (a void dtype, JAX's own)


def _jax_takes(dtype: np.dtype) -> bool:
    """Whether JAX has a type for a NumPy dtype of an odd kind: float0, and the void dtypes of
    ml_dtypes (bfloat16, float8, int4: numbers to jax.numpy) are JAX's; the others are not."""
    return dtype == _FLOAT0 or (dtype.kind == "V" and dtype.names is None and jax.numpy.issubdtype(dtype, np.number))


# How the errors of jaxbind's handler begin (an XLA status code, then jaxbind's text).
_RUNTIME_ERROR_PREFIXES = ("INTERNAL: jaxbind", "INVALID_ARGUMENT: jaxbind")
_NO_KWARGS = Kwargs({}, "")
# (role, kwargs) -> (the jitted call that concrete arguments run, the ids of the
# ops that used it), least recently used first. Equal ops share an entry; it
# leaves with the last of them (Op.__del__) or, past the bound, by age (an op
# whose callback holds the op itself is freed that way).
EAGER_CACHE_SIZE = 128
_EAGER: collections.OrderedDict = collections.OrderedDict()
_EAGER_LOCK = threading.Lock()
# (id, keys) of ops gone while a section held the lock, settled by the next section. An id
# reused by a new op meanwhile is harmless: every section settles these before it adds an id.
_EAGER_GONE: list = []


def _settle_gone() -> list:
    """Under ``_EAGER_LOCK``: the gone ops leave their entries, and an entry no op uses any more
    leaves the cache. Returns those entries, for the caller to drop once it released the lock."""
    left = []
    while _EAGER_GONE:
        me, keys = _EAGER_GONE.pop()
        for key in keys:
            entry = _EAGER.get(key)
            if entry is not None:
                entry[1].discard(me)
                if not entry[1]:
                    left.append(_EAGER.pop(key))
    return left


def _raise_failed_call(err: ValueError):
    """Raise what an eager call on the fast path raises for ``err`` (Op.__call__ calls it)."""
    try:
        raise err
    except ValueError:
        raise _callback_error(err)  # noqa: B904  (err itself, or its twin that suppresses err as context)


# An op's calls: the fast path in the compiled core, everything else Op._call.
Op.__call__ = _trampoline.make_op_call(Op, "_plain", Op._call, _raise_failed_call, *_CONCRETE_TYPES)


def _callback_error(err: ValueError) -> Exception:
    """What an eager call raises for ``err``, raised by a jitted call: what the
    first call raises (see _jax_compat) for a callback's failure, else ``err``."""
    runtime_error = runtime_error_of_fast_path(err, _RUNTIME_ERROR_PREFIXES)
    if runtime_error is None:
        return err
    runtime_error.__suppress_context__ = True
    return runtime_error


def _bind_arrays(*args, role: Role, kwargs: Kwargs):
    # The scope puts the op's name into the compiled program's op metadata
    # (op_name "jit(f)/<name>/jaxbind"), which is what profilers and XLA dumps
    # show; JAX carries it through jvp, transpose and vmap.
    with jax.named_scope(role.op.name):
        outs = bind(args, role, kwargs)
    k = role.op.n_residuals  # f's last outputs are for its derivatives only
    return outs[: len(outs) - k] if k else outs

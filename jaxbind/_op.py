"""The op object: argument checks, the role an arity plays, and the cached compiled call of an eager call."""

from __future__ import annotations

import collections
import dataclasses
import functools
import numbers
from typing import NamedTuple

import jax
import numpy as np

from ._definition import OpDef, OpKind, Role
from ._jax_compat import runtime_error_of_fast_path
from ._kwargs import Kwargs
from ._native import kernel_kwargs
from ._primitive import bind
from ._sites import register_definition

__all__ = ["Op"]


class OpFunction(NamedTuple):
    """What an op's ``functools.partial`` form carries as its ``_func`` keyword.

    Code written for JAXbind reads ops as ``functools.partial(call, _func=...)``
    and may make a variant with ``op.keywords["_func"]._replace(can_batch=False)``
    and ``functools.partial(op.func, **keywords)``: that variant is the same op
    without native batching (vmap then walks the batch).
    """

    definition: OpDef
    can_batch: bool


def _call_function(*args, _func: OpFunction, **kwargs):
    """``op.func``: calls the op that ``_func`` describes."""
    return Op.of(_func)(*args, **kwargs)


class Op(functools.partial):
    """A callable JAX operation made from user callbacks.

    ``op(*arrays, **kwargs)`` returns the list of outputs. Keyword arguments are
    static: they reach ``abstract`` as keyword arguments and the callbacks
    serialized in ``kwargs_dump``. Ops built from the same functions and flags
    compare and hash equal. An op is also a ``functools.partial`` of
    ``op.func`` with the keyword ``_func`` (an :class:`OpFunction`), as
    JAXbind's ops are; calling that partial's parts calls the op.
    """

    # functools.partial gives ops a __dict__ (code written for JAXbind sets
    # attributes on ops, op.__doc__ = ...) and weak references; neither plays
    # a part in equality or hashing.
    __slots__ = ("definition", "_entries", "_eager_keys")

    def __new__(cls, definition: OpDef):
        self = super().__new__(cls, _call_function, _func=OpFunction(definition, definition.func_can_batch))
        self.definition = definition
        self._entries = {}  # number of arguments -> the role the op then plays
        self._eager_keys = []  # its entries in _EAGER
        register_definition(definition)  # its place among the ops of its name
        return self

    def __init__(self, definition: OpDef):
        pass  # (made in __new__: functools.partial takes its arguments there)

    @staticmethod
    def of(function: OpFunction) -> "Op":
        """The op an :class:`OpFunction` describes (its own, or its variant with other flags)."""
        definition = function.definition
        if function.can_batch == definition.func_can_batch:
            variant = definition
        else:
            variant = dataclasses.replace(definition, func_can_batch=bool(function.can_batch))
        ops = vars(definition).setdefault("_variant_ops", {})
        op = ops.get(variant.func_can_batch)
        if op is None:
            op = ops[variant.func_can_batch] = Op(variant)
        return op

    def __reduce__(self):
        return (Op, (self.definition,))

    def __del__(self):
        # The op's eager calls go with it (they hold its definition, and so its
        # callbacks and what they capture).
        eager = _EAGER
        if eager is not None:
            for key in self._eager_keys:
                eager.pop(key, None)

    @property
    def name(self) -> str:
        return self.definition.name

    def __call__(self, *args, **kwargs):
        role = self._entries.get(len(args)) or self._entry(len(args))
        for i, a in enumerate(args):
            if not isinstance(a, _ARRAY_TYPES):
                raise TypeError(
                    f"jaxbind op '{self.name}': argument {i} is a {type(a).__name__}; op arguments "
                    "must be arrays (jax or NumPy) or scalars. Pass static values as keyword "
                    "arguments instead."
                )
        kwargs = self._kwargs(kwargs) if kwargs else _NO_KWARGS
        if any(isinstance(a, jax.core.Tracer) for a in args):
            return _bind_arrays(*args, role=role, kwargs=kwargs)
        # Called on concrete arrays: run a cached compiled call, as jax.jit
        # would, instead of dispatching the primitive anew each time.
        key = (id(self), role, kwargs)
        call = _EAGER.get(key)
        if call is None:
            call = _EAGER[key] = jax.jit(functools.partial(_bind_arrays, role=role, kwargs=kwargs))
            self._eager_keys.append(key)
            if len(self._eager_keys) > EAGER_CACHE_SIZE:  # forget the evicted ones
                self._eager_keys = [k for k in self._eager_keys if k in _EAGER]
            if len(_EAGER) > EAGER_CACHE_SIZE:
                _EAGER.popitem(last=False)
        else:
            try:
                _EAGER.move_to_end(key)
            except KeyError:  # evicted meanwhile by another thread's call
                pass
        try:
            return call(*args)
        except ValueError as err:
            # An eager call raises what the first call raises (see _jax_compat).
            runtime_error = runtime_error_of_fast_path(err, _RUNTIME_ERROR_PREFIXES)
            if runtime_error is None:
                raise
            raise runtime_error from None

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
            kernel_kwargs(values, f"op '{d.name}'")  # refuses what a kernel cannot take
        return kwargs

    def __eq__(self, other):
        return isinstance(other, Op) and self.definition == other.definition

    def __hash__(self):
        return hash(self.definition)

    def __repr__(self):
        return f"<jaxbind {self.definition.kind} op '{self.name}'>"


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, numbers.Number)
# How the errors of jaxbind's handler begin (an XLA status code, then jaxbind's text).
_RUNTIME_ERROR_PREFIXES = ("INTERNAL: jaxbind", "INVALID_ARGUMENT: jaxbind")
_NO_KWARGS = Kwargs({}, "")
# (id(op), role, kwargs) -> the jitted call that concrete arguments run, least
# recently used first. Entries leave with their op (Op.__del__) or, past the
# bound, by age (an op whose callback holds the op itself is freed that way).
EAGER_CACHE_SIZE = 128
_EAGER: "collections.OrderedDict" = collections.OrderedDict()


def _bind_arrays(*args, role: Role, kwargs: Kwargs):
    # The scope puts the op's name into the compiled program's op metadata
    # (op_name "jit(f)/<name>/jaxbind"), which is what profilers and XLA dumps
    # show; JAX carries it through jvp, transpose and vmap.
    with jax.named_scope(role.op.name):
        outs = bind(args, role, kwargs)
    k = role.op.n_residuals  # f's last outputs are for its derivatives only
    return outs[:len(outs) - k] if k else outs

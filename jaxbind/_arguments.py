"""The checks of ``get_linear_call``'s and ``get_nonlinear_call``'s arguments, each failing with a message
naming the op; what passes is returned in the form the definition holds."""

from __future__ import annotations

import inspect
import numbers
import re
from collections.abc import Sequence

import numpy as np

from ._definition import CallbackKind, name_of
from ._native import NativeKernel, as_kernel
from ._native_kwargs import kernel_kwargs
from ._state import DEFAULT_SETUP_CACHE, Setup
from ._vmap_methods import DOOR_OP, accepted, method_of

__all__ = [
    "CALLBACK_PARAMETERS",
    "arguments_hint",
    "as_callback",
    "callback_form_hint",
    "callback_parameters",
    "check_callable",
    "check_flags",
    "check_n_residuals",
    "check_native_kwargs",
    "check_no_setup_cache",
    "check_setup",
    "declared_setup",
    "check_thread_safe",
    "drop_fixed_places",
    "inplace_pairs",
    "named_callback",
]

# What jaxbind calls a Python callback with, positionally (an op with setup= adds the state).
CALLBACK_PARAMETERS = ("out", "args", "kwargs_dump")


def callback_parameters(setup) -> tuple:
    """What the callbacks of an op get: the state too when it has ``setup``."""
    return CALLBACK_PARAMETERS + ("state",) if setup is not None else CALLBACK_PARAMETERS


def as_callback(value, what: str, name: str | None, parameters: Sequence[str] = CALLBACK_PARAMETERS):
    """A callback as given: a Python callable, or a native kernel in any of its forms.

    ``name`` is the op's, or None while the op is being named after ``f``;
    ``parameters`` what jaxbind will pass a Python callable, positionally.
    """
    kernel = as_kernel(value, what, name)
    if kernel is not None:
        return kernel
    if not callable(value):
        raise TypeError(
            f"jaxbind op '{name or name_of(value)}': {what} must be a Python callable or a native kernel (a ctypes "
            f"function, a numba cfunc, a PyCapsule or jaxbind.native(address)), got {type(value).__name__}."
        )
    why = _why_not_callable_with(value, len(parameters))
    if why is not None:
        form = f"f({', '.join(parameters)})"
        raise TypeError(
            f"jaxbind op '{name or name_of(value)}': {what} ('{name_of(value)}') cannot be called as a "
            f"callback, {form}: {why}. {callback_form_hint(parameters)}"
        )
    return value


def callback_form_hint(parameters: Sequence[str] = CALLBACK_PARAMETERS) -> str:
    """What a callback is, and where a function ``f(x) -> y`` goes instead (for messages)."""
    state = " With setup=, the fourth is the state setup made for the call's inputs." if "state" in parameters else ""
    return (
        f"jaxbind calls a callback as f({', '.join(parameters)}), with {len(parameters)} positional "
        "arguments: it writes its results into the arrays of `out` (one per output the abstract "
        "declares, e.g. out[0][...] = y), reads its inputs from the tuple `args` and returns None."
        f"{state} A function f(x) -> y (np.sin, say) is what jaxbind.pure_callback(f, result_shape_dtypes, "
        "*args) takes."
    )


def _why_not_callable_with(value, n: int) -> str | None:
    """Why ``value`` cannot be called with ``n`` positional arguments, or None if it can or might.

    Only a provable refusal counts: a callable whose signature cannot be read is
    accepted (the call then fails with a hint, _runtime.format_callback_error).
    """
    if isinstance(value, np.ufunc):  # no signature, but its inputs and outputs are known
        if value.nin <= n <= value.nin + value.nout:
            return None
        most = value.nin + value.nout
        takes = f"{value.nin}" if most == value.nin else f"from {value.nin} to {most}"
        return (
            f"it is a NumPy ufunc of {value.nin} input(s) and {value.nout} output(s), which takes "
            f"{takes} positional arguments, not {n}"
        )
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):  # builtins without a text signature, some extension types
        return None
    try:
        signature.bind(*range(n))
    except TypeError as err:
        return f"its signature is {signature}, and a call with {n} positional arguments fails ({err})"
    return None


def drop_fixed_places(name: str, f_T: tuple, abstract_T: tuple, n_fixed: int):
    """Transposes and abstracts of a multilinear op, one per linear argument.

    JAXbind's form indexes them by argument position, fixed arguments included,
    with None in the fixed places: ``(None, f_T1)`` with ``first_n_args_fixed=1``.
    """
    if not any(t is None for t in f_T + abstract_T):
        return f_T, abstract_T
    places = [i for i, (t, a) in enumerate(zip(f_T, abstract_T)) if t is None or a is None]
    if places != list(range(n_fixed)) or any(t is not None for t in f_T[:n_fixed] + abstract_T[:n_fixed]):
        raise ValueError(
            f"jaxbind op '{name}': f_T and abstract_T have None at positions {places}. None marks a "
            f"fixed argument when the transposes are indexed by argument position, so it must be "
            f"at exactly the first first_n_args_fixed={n_fixed} positions of both (then one "
            "transpose per linear argument follows); otherwise give one transpose per linear "
            "argument and no None."
        )
    return f_T[n_fixed:], abstract_T[n_fixed:]


def check_callable(value, what: str, name: str):
    if not callable(value):
        raise TypeError(f"jaxbind op '{name}': {what} must be callable, got {type(value).__name__}.")


def named_callback(f, name, parameters: Sequence[str] = CALLBACK_PARAMETERS):
    """``f`` as a callback, and the op's name: ``name`` when given, else the name of ``f``."""
    if name is None:  # (the op is named after f: a kernel without a name of its own is refused)
        f = as_callback(f, "f", None, parameters)
        return f, name_of(f)
    if not isinstance(name, str) or not name.strip():
        error = TypeError if not isinstance(name, str) else ValueError
        raise error(f"jaxbind op '{name_of(f)}': name must be a non-empty string, got {name!r:.100}.")
    return as_callback(f, "f", name, parameters), name


def check_setup(name: str, setup, setup_cache, families) -> int:
    """``setup`` callable with ``(args, kwargs)``, every callback a Python one, ``setup_cache`` a positive
    int or None (the default): the cache size."""
    if not callable(setup):
        raise TypeError(
            f"jaxbind op '{name}': setup must be a callable setup(args, kwargs) -> state, got {type(setup).__name__}."
        )
    why = _why_not_callable_with(setup, 2)
    if why is not None:
        raise TypeError(
            f"jaxbind op '{name}': setup ('{name_of(setup)}') cannot be called as setup(args, kwargs): {why}. "
            "jaxbind calls it with 2 positional arguments, the call's leading inputs (a tuple of arrays) and "
            "its kwargs (a dict), and gives what it returns to every callback as their fourth argument, state."
        )
    for family in families:
        for callback, label in zip(family.callbacks, family.labels):
            if isinstance(callback, NativeKernel):
                what = "f" if label == "forward" else f"the {label}"
                raise TypeError(
                    f"jaxbind op '{name}': setup is given, but {what} ('{name_of(callback)}') is a native "
                    "kernel, which takes no Python object: setup's state goes to Python callbacks only. "
                    "Keep a native kernel's state on the C side (a handle passed as an int kwarg), or "
                    "make the op without setup."
                )
    if setup_cache is None:
        return DEFAULT_SETUP_CACHE
    if isinstance(setup_cache, (bool, np.bool_)) or not isinstance(setup_cache, numbers.Integral) or setup_cache < 1:
        raise ValueError(
            f"jaxbind op '{name}': setup_cache must be a positive integer (the states the op "
            f"keeps), got {setup_cache!r:.100}."
        )
    return int(setup_cache)


def check_no_setup_cache(name, f, setup, setup_cache) -> None:
    """``setup_cache`` without ``setup``: a cache of nothing, most likely a forgotten ``setup=``."""
    if setup is None and setup_cache is not None:
        if not isinstance(name, str) or not name.strip():  # (a bad name= is refused after this)
            name = name_of(f)
        raise TypeError(
            f"jaxbind op '{name}': setup_cache={setup_cache!r:.100} is given without setup; it sizes the cache of "
            "the states setup makes, so an op without setup has none. Pass setup=, a callable "
            "setup(args, kwargs) -> state, or leave setup_cache out."
        )


def check_thread_safe(name: str, thread_safe) -> bool:
    if not isinstance(thread_safe, (bool, np.bool_)):
        raise TypeError(f"jaxbind op '{name}': thread_safe must be a bool, got {thread_safe!r:.100}.")
    return bool(thread_safe)


def check_n_residuals(name: str, n_residuals) -> int:
    if isinstance(n_residuals, (bool, np.bool_)) or not isinstance(n_residuals, numbers.Integral):
        raise TypeError(f"jaxbind op '{name}': n_residuals must be a non-negative integer, got {n_residuals!r:.100}.")
    if n_residuals < 0:
        raise ValueError(f"jaxbind op '{name}': n_residuals must be a non-negative integer, got {n_residuals!r}.")
    return int(n_residuals)


def inplace_pairs(name: str, inplace) -> tuple:
    """``inplace={output: argument}`` as sorted (output, argument) pairs; indices count every argument."""
    if inplace is None:
        return ()
    if not isinstance(inplace, dict):
        raise TypeError(
            f"jaxbind op '{name}': inplace must be a dict {{output index: argument index}}, got {inplace!r:.100}."
        )
    pairs = []
    for out, arg in inplace.items():
        for what, index in (("output", out), ("argument", arg)):
            if isinstance(index, (bool, np.bool_)) or not isinstance(index, numbers.Integral) or index < 0:
                raise ValueError(
                    f"jaxbind op '{name}': inplace maps {out!r} to {arg!r}: the {what} index must be a "
                    "non-negative integer (outputs in the order the abstract returns them, arguments "
                    "counting the fixed ones)."
                )
        pairs.append((int(out), int(arg)))
    args = [a for _, a in pairs]
    shared = sorted({a for a in args if args.count(a) > 1})
    if shared:
        outs = [o for o, a in sorted(pairs) if a == shared[0]]
        raise ValueError(
            f"jaxbind op '{name}': inplace puts outputs {outs} on argument {shared[0]}: an argument's "
            "memory can hold one output; give the other outputs memory of their own."
        )
    return tuple(sorted(pairs))


def check_flags(name: str, first_n_args_fixed, func_can_batch, vmap_method):
    if (
        isinstance(first_n_args_fixed, bool)
        or not isinstance(first_n_args_fixed, numbers.Integral)
        or first_n_args_fixed < 0
    ):
        raise ValueError(
            f"jaxbind op '{name}': first_n_args_fixed must be a non-negative integer, got {first_n_args_fixed!r}."
        )
    if not isinstance(func_can_batch, (bool, np.bool_)):
        raise TypeError(f"jaxbind op '{name}': func_can_batch must be a bool, got {func_can_batch!r}.")
    if not isinstance(vmap_method, str) or vmap_method not in accepted(DOOR_OP):
        raise ValueError(
            f"jaxbind op '{name}': vmap_method must be one of {', '.join(map(repr, accepted(DOOR_OP)))} "
            f"(as for jax.pure_callback), got {vmap_method!r:.100}."
        )
    if func_can_batch and not method_of(vmap_method).walked:
        raise ValueError(
            f"jaxbind op '{name}': func_can_batch=True and vmap_method={vmap_method!r} both say how "
            "the callbacks see a batch; give one of them. func_can_batch: the callbacks get "
            "batch_axes and handle any layout; vmap_method='expand_dims' or 'broadcast_all': they "
            "get every batch level as a leading axis and need no batch_axes."
        )
    return int(first_n_args_fixed), bool(func_can_batch), vmap_method


_ARGUMENTS_ERROR = re.compile(r"\bargument|\bpositional|\bparameter")


def arguments_hint(exc: BaseException) -> str | None:
    """What a callback is, for a callback that could not take the call's arguments (its signature
    was not readable when the op was made), or None for another error.

    Such a TypeError comes from the call itself: it has no frame of the callback's own.
    """
    if not isinstance(exc, TypeError) or exc.__traceback__ is not None or not _ARGUMENTS_ERROR.search(str(exc)):
        return None
    return f"(The callback could not be called with jaxbind's arguments. {callback_form_hint()})"


def check_native_kwargs(values: dict, definition) -> None:
    """Refuse, when an op is called, kwargs one of its native kernels cannot take or does not declare.

    The forward kernel (the one the call runs) is asked first, so a value it refuses is refused in its
    name; a derivative or transpose kernel that refuses what the forward one takes is named with its role.
    """
    label = f"op '{definition.name}'"
    callbacks = [
        (kind, role, callback)
        for family in definition.families
        for kind, role, callback in zip(family.kinds, family.labels, family.callbacks)
        if isinstance(callback, NativeKernel) and callback.declared is not None
    ]
    callbacks.sort(key=lambda entry: entry[0] is not CallbackKind.FORWARD)  # (stable: the rest as given)
    checked = set()
    for kind, role, callback in callbacks:
        if callback in checked:
            continue
        checked.add(callback)
        try:
            callback.declared.entries(values, label, callback)
        except TypeError as error:
            if kind is CallbackKind.FORWARD:
                raise
            raise TypeError(
                f"{error} ({callback._kind.capitalize()} '{callback.__name__}' is the op's "
                f"{role.removesuffix(' callback')} callback, which gets the call's keyword arguments too.)"
            ) from None
    if not checked:
        kernel_kwargs(values, label)  # (refuses the types no kernel can take)


def declared_setup(families: tuple, setup, setup_cache, name: str) -> Setup | None:
    """What an op declares for ``setup=`` (its function and the size of its cache of states), checked; or None."""
    if setup is None:
        return None
    return Setup(setup, check_setup(name, setup, setup_cache, families))

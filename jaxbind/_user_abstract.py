"""Calling a user's abstract function and checking what it returns (dtypes, shapes, sizes)."""

from __future__ import annotations

import builtins
import inspect
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from ._definition import CallbackKind, Role, dtype_name, name_of
from ._dtypes import SUPPORTED_DTYPES
from ._errors import JaxbindError
from ._kwargs import Kwargs


def check_dtype(dtype, role: Role, what: str):
    dtype = np.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES and dtype != jax.dtypes.float0:
        raise TypeError(
            f"jaxbind {role.label}: {what} has dtype {dtype_name(dtype)}, which jaxbind cannot "
            f"pass to a callback. Supported: "
            f"{', '.join(sorted(dtype_name(d) for d in SUPPORTED_DTYPES))}, and float0 (tangents "
            "of integers, which reach a callback as bool arrays of zeros)."
        )


def _bad_abstract(role: Role, result, why: str):
    axis = " (and the output batch axis as a third entry when batching)" if role.op.func_can_batch else ""
    return TypeError(
        f"jaxbind {role.label}: its abstract function must return a tuple with one "
        f"(shape, dtype) pair per output{axis}; "
        f"{why}. It returned {result!r:.200}."
    )


def _looks_like_pair(result) -> bool:
    return (
        isinstance(result, tuple)
        and len(result) == 2
        and isinstance(result[0], tuple)
        and all(isinstance(d, (int, np.integer)) for d in result[0])
        and not isinstance(result[1], (tuple, list))
    )


def _is_dimension(d) -> bool:
    return isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_))


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX
        return 1 << 62


# No output may need more bytes than the machine has: XLA would abort the process
# (a size beyond int64) or fail without naming the op.
MAX_OUTPUT_BYTES = _memory_bytes()


def check_size(role: Role, k: int, shape, dtype):
    size = math.prod(shape)
    if size * dtype.itemsize > MAX_OUTPUT_BYTES:
        raise ValueError(
            f"jaxbind {role.label}: its abstract function declares output {k} with shape {shape} "
            f"and dtype {dtype}: {size * dtype.itemsize:.3g} bytes, more than this machine's memory "
            f"({MAX_OUTPUT_BYTES:.3g} bytes). Check the shapes the abstract computes."
        )


def _role_inputs(role: Role, n: int) -> str:
    """What the arrays jaxbind passes to a non-forward role's abstract are."""
    what, k = role.callback_kind, role.op.n_residuals
    if what is CallbackKind.JVP and k:
        return f"{n} array arguments (the primal(s) alone: with residuals, the tangents take the outputs' shapes)"
    if what is CallbackKind.JVP:
        return (
            f"{n} array arguments (the {role.n_fixed} primal(s), then the tangents of the "
            f"{n - role.n_fixed} differentiable argument(s))"
        )
    if what is CallbackKind.VJP:
        return (
            f"{n} array arguments (the {role.n_fixed - k} primal(s), "
            + (f"the {k} residual(s), " if k else "")
            + f"then the {n - role.n_fixed} output cotangent(s))"
        )
    return (
        f"{n} array arguments (the {role.n_fixed} fixed argument(s), then the arrays of the "
        "other slots, with the output cotangents in the outputs' place)"
    )


_abstract_error_types: dict = {}


def _raise_abstract_failure(role: Role, err: Exception):
    """Raise, for a user's abstract that raised ``err``, an exception of ``err``'s own type.

    A built-in exception type (``ValueError``, ``AssertionError``, ...) becomes
    an instance of a type derived from it and from :class:`JaxbindError`, whose
    message names the op and which prints as the built-in's name: ``except
    ValueError`` and ``except jaxbind.JaxbindError`` both catch it. Any other
    type (the user's own, whose constructor and attributes jaxbind cannot know)
    is raised itself, with a note naming the op.
    """
    message = f"jaxbind {role.label}: its abstract function raised {type(err).__name__}: {err}"
    base = type(err)
    # Built-in by identity, not by ``__module__``: a class defined in code run
    # without a module name (``exec``, doctests) reports the module "builtins" too.
    if getattr(builtins, base.__name__, None) is base:
        try:
            derived = _abstract_error_types.get(base)
            if derived is None:
                derived = type(base.__name__, (base, JaxbindError), {"__module__": "builtins"})
                _abstract_error_types[base] = derived
            failure = derived(message)
        except TypeError:  # a built-in whose layout or constructor allows no such type
            pass
        else:
            raise failure from err
    err.add_note(message)
    raise err


def check_inplace_outputs(role: Role, structs, outs, batch_axes=None):
    """Each in-place output is its argument: an output and an argument there are, of one shape and dtype."""
    for out, arg in role.inplace_pairs:
        where = f"jaxbind {role.label}: inplace maps output {out} to argument {arg}"
        if out >= len(outs):
            raise ValueError(
                f"{where}, but its abstract declares {len(outs)} output(s) "
                "(residuals counted); map an output the op has."
            )
        if arg >= len(structs):
            raise ValueError(
                f"{where}, but the op was called with {len(structs)} argument(s) "
                "(the fixed ones counted); map an argument the op is called with."
            )
        shape, dtype, axis = outs[out]
        given = structs[arg]
        if tuple(given.shape) != tuple(shape) or np.dtype(given.dtype) != np.dtype(dtype):
            raise ValueError(
                f"{where}, but the output is {dtype_name(dtype)}{list(shape)} and the argument "
                f"{dtype_name(given.dtype)}{list(given.shape)}: an output updated in place has its "
                "argument's shape and dtype."
            )
        arg_axes = batch_axes[arg] if batch_axes is not None else None
        if axis is not None and arg_axes and arg_axes[-1] != axis:
            raise ValueError(
                f"{where}, but under vmap the abstract puts the output's batch axis at {axis} and the "
                f"argument's is at {arg_axes[-1]}: return the argument's batch axis for an output "
                "updated in place."
            )


def call_abstract(role: Role, structs, kwargs: Kwargs, batch_axes=None, want_axis=False):
    """Run the user's abstract for ``role`` and check what it returns.

    Returns a list of ``(shape, dtype, out_axis)`` (``out_axis`` None unless given).
    """
    structs = role.abstract_inputs(structs)
    result = _run_abstract(role, structs, kwargs.values, batch_axes)
    if _looks_like_pair(result):
        raise _bad_abstract(role, result, "got a single pair; wrap it in a tuple: ((shape, dtype),)")
    if not isinstance(result, (tuple, list)):
        raise _bad_abstract(role, result, f"got a {type(result).__name__}")
    if not result and role.op.effect is None:
        # XLA drops a pure call whose results nobody uses: the callback would never run.
        raise _bad_abstract(
            role,
            result,
            "got no outputs; a pure op needs at least one (XLA skips pure calls whose results are not "
            'used); an op called for its side effects alone is made with effect="io" or "ordered"',
        )
    outs = [_output_entry(role, result, k, want_axis) for k in range(len(result))]
    if role.inplace_pairs:
        check_inplace_outputs(role, structs, outs, None if batch_axes is None else role.abstract_inputs(batch_axes))
    return _role_outputs(role, outs)


def _run_abstract(role: Role, structs, values: dict, batch_axes):
    """The abstract's result for the role's inputs; its failure raised naming the op (and why, when a
    signature refuses the arguments)."""
    if role.op.func_can_batch:
        values = {**values, "batch_axes": None if batch_axes is None else tuple(role.abstract_inputs(batch_axes))}
    try:
        return role.abstract(*structs, **values)
    except TypeError as err:
        try:
            inspect.signature(role.abstract).bind(*structs, **values)
        except TypeError as sig_err:
            if role.callback_kind is CallbackKind.FORWARD:
                raise TypeError(
                    f"jaxbind {role.label} was called with {len(structs)} array argument(s) "
                    f"and keyword arguments {sorted(values)}, which its abstract function "
                    f"does not accept: {sig_err}. Check the number of arguments passed to the op."
                ) from err
            # jaxbind chose these arguments, not the caller: the signature is wrong.
            raise TypeError(
                f"jaxbind {role.label}: its abstract function '{name_of(role.abstract)}' is called "
                f"with {_role_inputs(role, len(structs))} and keyword arguments {sorted(values)}, "
                f"but its signature does not accept them: {sig_err}. Give it a signature that "
                "takes them (e.g. abstract(*args, **kwargs))."
            ) from err
        except ValueError:  # no signature available (builtins)
            pass
        _raise_abstract_failure(role, err)
    except Exception as err:
        _raise_abstract_failure(role, err)


def _output_entry(role: Role, result, k: int, want_axis: bool):
    """Entry ``k`` of an abstract's result, checked: ``(shape, dtype, out_axis)``."""
    entry = result[k]
    if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
        raise _bad_abstract(role, result, f"entry {k} is not a (shape, dtype) pair")
    shape, dtype = entry[0], entry[1]
    try:
        if isinstance(shape, (str, bytes)):
            raise TypeError("a string is not a shape")
        dims = list(shape)
        dtype = np.dtype(dtype)
    except Exception:
        raise _bad_abstract(role, result, f"entry {k} has no valid shape and dtype") from None
    if not all(_is_dimension(d) for d in dims):
        raise _bad_abstract(
            role,
            result,
            f"entry {k} has a shape whose dimensions are not all integers (a float or a bool is not a dimension)",
        )
    shape = tuple(int(d) for d in dims)
    if any(d < 0 for d in shape):
        raise _bad_abstract(role, result, f"entry {k} has a negative dimension")
    check_dtype(dtype, role, f"output {k} (from its abstract)")
    check_size(role, k, shape, dtype)
    axis = entry[2] if len(entry) == 3 else None
    if want_axis:
        if not isinstance(axis, (int, np.integer)) or not -len(shape) <= axis < len(shape):
            raise _bad_abstract(
                role,
                result,
                f"entry {k} needs a valid output batch axis as its third element "
                f"(the op has func_can_batch=True and is being batched)",
            )
        axis = int(axis) % len(shape)
    return (shape, dtype, axis)


def _role_outputs(role: Role, outs: list) -> list:
    """The outputs the role computes of what its abstract declares: residuals checked, and a jvp's
    tangents only (none for residuals or integer outputs)."""
    if role.declares_residuals:
        k = role.op.n_residuals
        if len(outs) <= k:
            raise ValueError(
                f"jaxbind op '{role.op.name}': n_residuals={k}, but its abstract function "
                f"'{name_of(role.abstract)}' declares {len(outs)} array(s) in all; it must declare "
                f"the op's outputs (at least one) followed by its {k} residual(s)."
            )
        if role.is_jvp:
            outs = outs[:-k]
    if role.is_jvp:
        # The abstract describes all of f's outputs; only inexact ones have tangents.
        outs = [out for out in outs if is_differentiable(out[1])]
    return outs


def is_differentiable(dtype) -> bool:
    """Whether arrays of ``dtype`` have tangents (float and complex; not int, bool)."""
    return jnp.issubdtype(dtype, jnp.inexact)


def structs(avals):
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


def check_input_dtypes(role: Role, avals):
    for i, aval in enumerate(avals):
        check_dtype(aval.dtype, role, f"argument {i}")


# NumPy's words for a write of one shape into an array of another (written, target), and for a ufunc
# whose operands do not broadcast (with out=, the output is the last of them).
_NUMPY_WRITE = (
    (re.compile(r"could not broadcast input array from shape (\([\d, ]*\)) into shape (\([\d, ]*\))"), 1, 2),
    (
        re.compile(
            r"non-broadcastable output operand with shape (\([\d, ]*\)) doesn't match the broadcast "
            r"shape (\([\d, ]*\))"
        ),
        2,
        1,
    ),
)
_NUMPY_OPERANDS = re.compile(r"operands could not be broadcast together with shapes ((?:\([\d, ]*\) ?)+)")


def _shape_in(text: str) -> tuple:
    return tuple(int(d) for d in re.findall(r"\d+", text))


def output_shape_hint(exc: BaseException, outs):
    """For NumPy's broadcast error on a write into a callback's output: which output, what the
    abstract declared for it and the shape written; None for another error.

    ``outs``: the callback's output arrays (what the abstract declared), or None.
    """
    if not isinstance(exc, ValueError) or not outs:
        return None
    text, written, target, surely = str(exc), None, None, True
    for pattern, w, t in _NUMPY_WRITE:
        match = pattern.search(text)
        if match:
            written, target = _shape_in(match.group(w)), _shape_in(match.group(t))
            break
    else:
        match = _NUMPY_OPERANDS.search(text)
        if match is None:
            return None
        shapes = [_shape_in(m) for m in re.findall(r"\([\d, ]*\)", match.group(1))]
        try:  # a ufunc's out= that does not fit what its inputs broadcast to
            written, target, surely = np.broadcast_shapes(*shapes[:-1]), shapes[-1], False
        except ValueError:  # the inputs do not broadcast either: not about an output
            return None
    found = [j for j, out in enumerate(outs) if tuple(out.shape) == target]
    if not found:  # a write into part of an output, or into an array of the callback's own
        return None
    which = f"output {found[0]}" if len(found) == 1 else "output " + " or ".join(map(str, found))
    declared = f"which the abstract declares with shape {target} and dtype {outs[found[0]].dtype}"
    check = "check that the abstract declares the shape the callback computes"
    if surely:
        return f"(The callback wrote an array of shape {written} into {which}, {declared}: {check}.)"
    return (
        f"(If the last of these arrays is {which}, {declared}, the callback computed shape {written} for it: {check}.)"
    )

"""The jaxbind primitive: abstract evaluation, jvp, transpose, batching and lowering.

Every op binds the same primitive with three static parameters: ``role`` (which
callback of which op, see ``_definition``), ``kwargs`` (the op call's static
keyword arguments) and ``batch`` (how the arrays are batched, or None). Each
rule below is written once and reads the op definition through the role.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import traceback
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from . import _trampoline
from ._definition import FORWARD, JaxbindError, Role, _name_of
from ._jax_compat import (
    Primitive, ad, apply_primitive, auto_device_count, batch_partitioning_attributes, batching,
    cast_to_common_vma,
    get_aval, mlir, register_batch_partitionable, reshard_like, set_frontend_attribute, shaped_array,
    sharding_spec, varying_axes,
)
from ._kwargs import Kwargs
from ._native import NativeKernel, kernel_kwargs

# ---------------------------------------------------------------------------
# Batching parameters
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WalkBatch:
    """Batched by jaxbind, as the op's ``vmap_method`` says.

    There are ``L`` batch levels (outermost first). ``masks[i][l]`` says whether
    input ``i`` is mapped at level ``l``. Every output has all ``L`` levels in
    front. With ``"sequential"`` an input's mapped levels are its leading
    dimensions, in level order, and the handler calls the callback once per
    element. Otherwise every input has all ``L`` levels in front, of size 1
    where it is not mapped (``"expand_dims"``; ``"broadcast_all"`` maps every
    input at every level), and the callback is called once on the whole arrays.
    """

    masks: Tuple[Tuple[bool, ...], ...]

    @property
    def levels(self) -> int:
        return len(self.masks[0]) if self.masks else 0

    def __repr__(self):
        return "walk" + "".join("(" + "".join("b" if m else "_" for m in mask) + ")" for mask in self.masks)


@dataclasses.dataclass(frozen=True)
class NativeBatch:
    """Batched by the callback itself (``func_can_batch``).

    ``in_axes[i]`` are the batch axes of input ``i`` (the ``batch_axes`` the
    callback sees), one per level, oldest level first, or ``()`` for an input
    mapped at no level: an input is mapped at every level or at none.
    ``out_axes[j]`` are those of output ``j`` (always one per level) and
    ``sizes`` the size of each level.
    """

    in_axes: Tuple[Tuple[int, ...], ...]
    out_axes: Tuple[Tuple[int, ...], ...]
    sizes: Tuple[int, ...]


Batch = Optional[Union[WalkBatch, NativeBatch]]


def _whole(role: Role) -> bool:
    """Whether a batch reaches the callbacks whole (one call) rather than walked."""
    return role.op.vmap_method != "sequential"


def _batch_dims(role: Role, mask) -> int:
    """How many leading dimensions of an input with batch mask ``mask`` are batch levels."""
    return len(mask) if _whole(role) else sum(mask)


# ---------------------------------------------------------------------------
# The primitive
# ---------------------------------------------------------------------------

jaxbind_p = Primitive("jaxbind")
jaxbind_p.multiple_results = True
jaxbind_p.def_impl(functools.partial(apply_primitive, jaxbind_p))


def bind(args, role: Role, kwargs: Kwargs, batch: Batch = None):
    # Inside shard_map the inputs must vary over the same manual axes (see
    # cast_to_common_vma): every bind, the rules' included, goes through here.
    return jaxbind_p.bind(*cast_to_common_vma(args), role=role, kwargs=kwargs, batch=batch)


# ---------------------------------------------------------------------------
# Abstract evaluation
# ---------------------------------------------------------------------------

# XLA FFI dtype codes (XLA's PrimitiveType numbers) and their NumPy dtypes.
_DTYPE_CODES = _trampoline.DTYPE_CODES
SUPPORTED_DTYPES = {}
for _name, _code in _DTYPE_CODES.items():
    try:
        _dtype = jnp.dtype(_name)
    except TypeError:  # a float8 type this ml_dtypes does not have
        continue
    _trampoline.set_dtype(_code, _dtype)
    SUPPORTED_DTYPES[_dtype] = _code


def _check_dtype(dtype, role: Role, what: str):
    if np.dtype(dtype) not in SUPPORTED_DTYPES:
        raise TypeError(
            f"jaxbind {role.label}: {what} has dtype {np.dtype(dtype)}, which jaxbind cannot "
            f"pass to a callback. Supported: {', '.join(sorted(str(d) for d in SUPPORTED_DTYPES))}."
        )


def _bad_abstract(role: Role, result, why: str):
    return TypeError(
        f"jaxbind {role.label}: its abstract function must return a tuple with one "
        f"(shape, dtype) pair per output{' (and the output batch axis as a third entry when batching)' if role.op.func_can_batch else ''}; "
        f"{why}. It returned {result!r:.200}."
    )


def _looks_like_pair(result) -> bool:
    return (
        isinstance(result, tuple) and len(result) == 2
        and isinstance(result[0], tuple) and all(isinstance(d, (int, np.integer)) for d in result[0])
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


def _check_size(role: Role, k: int, shape, dtype):
    size = math.prod(shape)
    if size * dtype.itemsize > MAX_OUTPUT_BYTES:
        raise ValueError(
            f"jaxbind {role.label}: its abstract function declares output {k} with shape {shape} "
            f"and dtype {dtype}: {size * dtype.itemsize:.3g} bytes, more than this machine's memory "
            f"({MAX_OUTPUT_BYTES:.3g} bytes). Check the shapes the abstract computes."
        )


def _role_inputs(role: Role, n: int) -> str:
    """What the arrays jaxbind passes to a non-forward role's abstract are."""
    what = role.op.families[role.family].labels[role.slot]
    k = role.op.n_residuals
    if what == "jvp callback" and k:
        return f"{n} array arguments (the primal(s) alone: with residuals, the tangents take the outputs' shapes)"
    if what == "jvp callback":
        return (f"{n} array arguments (the {role.n_fixed} primal(s), then the tangents of the "
                f"{n - role.n_fixed} differentiable argument(s))")
    if what == "vjp callback":
        return (f"{n} array arguments (the {role.n_fixed - k} primal(s), "
                + (f"the {k} residual(s), " if k else "")
                + f"then the {n - role.n_fixed} output cotangent(s))")
    return (f"{n} array arguments (the {role.n_fixed} fixed argument(s), then the arrays of the "
            "other slots, with the output cotangents in the outputs' place)")


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
    if base.__module__ == "builtins":
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
    if hasattr(err, "add_note"):
        err.add_note(message)
    else:  # Python 3.10: shown by nothing, but there to read
        err.__notes__ = [*getattr(err, "__notes__", []), message]
    raise err


def call_abstract(role: Role, structs, kwargs: Kwargs, batch_axes=None, want_axis=False):
    """Run the user's abstract for ``role`` and check what it returns.

    Returns a list of ``(shape, dtype, out_axis)`` (``out_axis`` None unless given).
    """
    values = kwargs.values
    structs = role.abstract_inputs(structs)
    if role.op.func_can_batch:
        values = {**values, "batch_axes": None if batch_axes is None else tuple(role.abstract_inputs(batch_axes))}
    try:
        result = role.abstract(*structs, **values)
    except TypeError as err:
        try:
            inspect.signature(role.abstract).bind(*structs, **values)
        except TypeError as sig_err:
            if role.op.families[role.family].labels[role.slot] == FORWARD:
                raise TypeError(
                    f"jaxbind {role.label} was called with {len(structs)} array argument(s) "
                    f"and keyword arguments {sorted(values)}, which its abstract function "
                    f"does not accept: {sig_err}. Check the number of arguments passed to the op."
                ) from err
            # jaxbind chose these arguments, not the caller: the signature is wrong.
            raise TypeError(
                f"jaxbind {role.label}: its abstract function '{_name_of(role.abstract)}' is called "
                f"with {_role_inputs(role, len(structs))} and keyword arguments {sorted(values)}, "
                f"but its signature does not accept them: {sig_err}. Give it a signature that "
                "takes them (e.g. abstract(*args, **kwargs))."
            ) from err
        except ValueError:  # no signature available (builtins)
            pass
        _raise_abstract_failure(role, err)
    except Exception as err:
        _raise_abstract_failure(role, err)
    if _looks_like_pair(result):
        raise _bad_abstract(role, result, "got a single pair; wrap it in a tuple: ((shape, dtype),)")
    if not isinstance(result, (tuple, list)):
        raise _bad_abstract(role, result, f"got a {type(result).__name__}")
    if not result:
        # XLA drops a pure call whose results nobody uses: the callback would never run.
        raise _bad_abstract(role, result, "got no outputs; an op needs at least one (XLA skips "
                                          "pure calls whose results are not used)")
    outs = []
    for k, entry in enumerate(result):
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
            raise _bad_abstract(role, result, f"entry {k} has a shape whose dimensions are not all "
                                              "integers (a float or a bool is not a dimension)")
        shape = tuple(int(d) for d in dims)
        if any(d < 0 for d in shape):
            raise _bad_abstract(role, result, f"entry {k} has a negative dimension")
        _check_dtype(dtype, role, f"output {k} (from its abstract)")
        _check_size(role, k, shape, dtype)
        axis = entry[2] if len(entry) == 3 else None
        if want_axis:
            if not isinstance(axis, (int, np.integer)) or not -len(shape) <= axis < len(shape):
                raise _bad_abstract(
                    role, result,
                    f"entry {k} needs a valid output batch axis as its third element "
                    f"(the op has func_can_batch=True and is being batched)",
                )
            axis = int(axis) % len(shape)
        outs.append((shape, dtype, axis))
    if role.declares_residuals:
        k = role.op.n_residuals
        if len(outs) <= k:
            raise ValueError(
                f"jaxbind op '{role.op.name}': n_residuals={k}, but its abstract function "
                f"'{_name_of(role.abstract)}' declares {len(outs)} array(s) in all; it must declare "
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


def _structs(avals):
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


def _walk_batch_shape(shapes, batch: WalkBatch, whole: bool = False):
    """Sizes of the batch levels, read off the inputs mapped at each level.

    ``whole``: every input has all levels in front (not only its mapped ones).
    """
    sizes = [1] * batch.levels
    for shape, mask in zip(shapes, batch.masks):
        pos = 0
        for level, mapped in enumerate(mask):
            if mapped:
                sizes[level] = shape[pos]
            pos += 1 if mapped or whole else 0
    return tuple(sizes)


def _abstract_eval(*avals, role: Role, kwargs: Kwargs, batch: Batch):
    for i, aval in enumerate(avals):
        _check_dtype(aval.dtype, role, f"argument {i}")
    # Outputs vary over the manual axes their inputs vary over (bind made them
    # agree); a partitioned batch keeps its sharding, other outputs are whole.
    typed = functools.partial(shaped_array, like=avals[0] if avals else None,
                              vma=frozenset().union(*map(varying_axes, avals)),
                              spec=_batch_spec(avals, partitionable_levels(batch)))
    if isinstance(batch, WalkBatch):
        core = [
            jax.ShapeDtypeStruct(a.shape[_batch_dims(role, m):], a.dtype) for a, m in zip(avals, batch.masks)
        ]
        prefix = _walk_batch_shape([a.shape for a in avals], batch, _whole(role))
        outs = call_abstract(role, core, kwargs)
        for k, (shape, dtype, _) in enumerate(outs):  # the whole batch of it must fit too
            _check_size(role, k, prefix + shape, dtype)
        return [typed(prefix + shape, dtype) for shape, dtype, _ in outs]
    axes = batch.in_axes if isinstance(batch, NativeBatch) else None
    outs = call_abstract(role, _structs(avals), kwargs, batch_axes=axes)
    if isinstance(batch, NativeBatch):
        _check_native_levels(role, outs, batch)
    return [typed(shape, dtype) for shape, dtype, _ in outs]


def _check_native_levels(role: Role, outs, batch: NativeBatch):
    """Every output of a natively batched call holds every batch level where it says.

    Checked at trace time: a mistake in an abstract's batch bookkeeping would
    otherwise surface as a shape error inside the callback, or not at all.
    """
    for j, ((shape, _, _), axes) in enumerate(zip(outs, batch.out_axes)):
        for level, (axis, size) in enumerate(zip(axes, batch.sizes)):
            if axis >= len(shape) or shape[axis] != size:
                has = f"has size {shape[axis]} there" if axis < len(shape) else "has no such axis"
                raise ValueError(
                    f"jaxbind {role.label}: its abstract function '{_name_of(role.abstract)}' "
                    f"declares output {j} with shape {shape}, which does not hold the batch: vmap "
                    f"level {level} (size {size}) is its axis {axis} (from the batch axes the "
                    f"abstract returned, {tuple(axes)}), but the declared shape {has}. With "
                    "func_can_batch the abstract must return each output's shape with every batch "
                    f"level in it, and its batch axis (inputs' batch_axes: {batch.in_axes})."
                )


def _batch_spec(avals, levels: int) -> tuple:
    """The sharding of the leading ``levels`` dims of a partitioned call's outputs.

    XLA splits all operands alike along those dims; the first input sharded
    there says how (the others are resharded to match).
    """
    specs = [sharding_spec(a)[:levels] for a in avals]
    return next((s for s in specs if any(e is not None for e in s)), ())


jaxbind_p.def_abstract_eval(_abstract_eval)


# ---------------------------------------------------------------------------
# Differentiation
# ---------------------------------------------------------------------------


def _not_differentiable(role: Role, index: int, verb: str):
    if role.family > 0:
        return ValueError(
            f"jaxbind op '{role.op.name}': second-order derivatives of a nonlinear op are not "
            f"supported (its jvp and vjp callbacks are not differentiable with respect to the "
            f"primal point; {verb} argument {index} of {role.label} was requested). Take "
            "first-order derivatives only, or bind the derivative itself as a jaxbind op with "
            "its own jvp and vjp."
        )
    return ValueError(
        f"jaxbind {role.label}: argument {index} is one of the first_n_args_fixed="
        f"{role.n_fixed} fixed arguments and cannot be differentiated ({verb} it was requested). "
        "Wrap the call so that it is held constant (e.g. jax.lax.stop_gradient), or "
        "lower first_n_args_fixed."
    )


def _instantiate(t):
    return ad.instantiate_zeros(t) if type(t) is ad.Zero else t


def _tangent_value(t, primal):
    """A tangent as an array the callbacks can take.

    An integer argument's tangent is ``float0``, which no callback can take: as
    it is zero, zeros of the argument's own dtype stand for it (an op jointly
    linear in an integer and a float argument, differentiated in the float one).
    """
    dtype = t.aval.dtype if type(t) is ad.Zero else get_aval(t).dtype
    if dtype == jax.dtypes.float0:
        return jnp.zeros_like(primal)
    return _instantiate(t)


def _zero_tangents(outs):
    return [ad.Zero(get_aval(o).to_tangent_aval()) for o in outs]


def _jvp_rule(primals, tangents, *, role: Role, kwargs: Kwargs, batch: Batch):
    for i in range(role.n_fixed):
        if type(tangents[i]) is not ad.Zero:
            raise _not_differentiable(role, i, "a derivative with respect to")
    outs = bind(primals, role, kwargs, batch)
    tangent_out = None
    if role.linear:
        # Linear within a slot, multilinear across slots: one call per slot
        # whose tangents are not all zero, with that slot's arrays replaced.
        for _, start, stop in role.input_groups():
            group = tangents[start:stop]
            if all(type(t) is ad.Zero for t in group):
                continue
            args = list(primals)
            args[start:stop] = [_tangent_value(t, p) for t, p in zip(group, primals[start:stop])]
            term = bind(args, role, kwargs, batch)
            tangent_out = term if tangent_out is None else [a + b for a, b in zip(tangent_out, term)]
    elif any(type(t) is not ad.Zero for t in tangents[role.n_fixed:]) and _inexact(outs, role):
        if not role.op.has_derivatives:
            raise role.op.no_derivatives_error("its jvp (as jvp, grad, vjp and the jacobians do)")
        # The derivative family of a nonlinear op: f_jvp(*primals, *residuals,
        # *tangents), the residuals (f's last outputs) fixed like the primals.
        # It computes the tangents of the inexact outputs only.
        n, n_fixed, k = len(primals), role.n_fixed, role.op.n_residuals
        n_out, inexact = len(outs) - k, _inexact(outs, role)
        jvp_role = Role(role.op, family=1, slot=1, n_fixed=n + k, in_sizes=(n - n_fixed,))
        args = [*primals, *outs[n_out:],
                *[_tangent_value(t, p) for t, p in zip(tangents[n_fixed:], primals[n_fixed:])]]
        if isinstance(batch, NativeBatch):
            # Tangents are batched like their primals, residuals as f wrote
            # them; the output tangents go where f's outputs are.
            in_axes = batch.in_axes + batch.out_axes[n_out:] + batch.in_axes[n_fixed:]
            out_axes, _ = _native_out_layout(jvp_role, args, in_axes, kwargs)
            tangent_out = bind(args, jvp_role, kwargs, NativeBatch(in_axes, out_axes, batch.sizes))
            tangent_out = [_move_levels(t, src, batch.out_axes[j])
                           for t, src, j in zip(tangent_out, out_axes, inexact)]
        else:
            # f's outputs, residuals included, have every level in front.
            walk = WalkBatch(batch.masks + ((True,) * batch.levels,) * k + batch.masks[n_fixed:]) if batch is not None else None
            tangent_out = bind(args, jvp_role, kwargs, walk)
        tangent_out = dict(zip(inexact, tangent_out))
        tangent_out = [tangent_out.get(j) for j in range(len(outs))]
    if tangent_out is None:
        tangent_out = _zero_tangents(outs)
    else:
        # Residuals, integer and bool outputs have symbolic zero tangents (a
        # linear op's callback computed values for the integer ones: dropped).
        tangent_out = [t if t is not None and is_differentiable(get_aval(o).dtype) else z
                       for t, o, z in zip(tangent_out, outs, _zero_tangents(outs))]
    return outs, tangent_out


def _inexact(outs, role: Role):
    """Indices of the outputs (residuals excluded) that have tangents."""
    return [j for j in range(len(outs) - role.op.n_residuals) if is_differentiable(get_aval(outs[j]).dtype)]


def _regroup(role: Role, new_slot: int, fixed, inputs, outputs):
    """Inputs of ``role.with_slot(new_slot)``, given per-array items of ``role``.

    Items may be arrays, batch masks or batch axes: the arrays of slot
    ``role.slot`` (``outputs``) take their place among the slots, and the
    arrays of ``new_slot`` drop out.
    """
    by_slot = {role.slot: list(outputs)}
    for slot, start, stop in role.input_groups():
        by_slot[slot] = list(inputs[start - role.n_fixed:stop - role.n_fixed])
    regrouped = list(fixed)
    for slot in range(role.n_slots):
        if slot != new_slot:
            regrouped += by_slot[slot]
    return regrouped


def _transpose_rule(cts, *args, role: Role, kwargs: Kwargs, batch: Batch):
    if not role.op.has_derivatives:
        raise role.op.no_derivatives_error("its linear transpose")
    if not role.linear:  # JAX transposes only what our jvp rule emitted
        raise JaxbindError(f"jaxbind {role.label}: cannot transpose a nonlinear callback")
    for i in range(role.n_fixed):
        if ad.is_undefined_primal(args[i]):
            raise _not_differentiable(role, i, "a transpose with respect to")
    linear = [g for g in role.input_groups() if any(ad.is_undefined_primal(a) for a in args[g[1]:g[2]])]
    if not linear or all(type(ct) is ad.Zero for ct in cts):
        return [None] * len(args)
    if len(linear) > 1:
        raise ValueError(
            f"jaxbind {role.label}: the op is multilinear, not linear, in arguments "
            f"{linear[0][1]} and {linear[1][1]} together; it can be transposed with respect "
            "to one of them at a time only."
        )
    slot, start, stop = linear[0]
    cts = _cotangent_values(cts, args, role, kwargs, batch)
    n_fixed = role.n_fixed
    new_role = role.with_slot(slot, len(cts))
    new_args = _regroup(role, slot, args[:n_fixed], args[n_fixed:], cts)
    structs = _structs(map(get_aval, new_args))
    moves = []  # (result batch axes, primal batch axes), native batching
    if isinstance(batch, WalkBatch):
        full = (True,) * batch.levels
        new_batch = WalkBatch(tuple(_regroup(
            role, slot, batch.masks[:n_fixed], batch.masks[n_fixed:], [full] * len(cts))))
        declared = [s.shape for s in _abstract_eval(*structs, role=new_role, kwargs=kwargs, batch=new_batch)]
        declared = [shape[batch.levels:] for shape in declared]
        primal = [args[i].aval.shape[_batch_dims(role, batch.masks[i]):] for i in range(start, stop)]
    elif isinstance(batch, NativeBatch):
        # The callback lays out its outputs as its abstract says; they are
        # moved into the layout of the primals they are cotangents of.
        in_axes = tuple(_regroup(role, slot, batch.in_axes[:n_fixed], batch.in_axes[n_fixed:], batch.out_axes))
        out_axes, outs = _native_out_layout(new_role, new_args, in_axes, kwargs)
        new_batch = NativeBatch(in_axes, out_axes, batch.sizes)
        moves = list(zip(out_axes, batch.in_axes[start:stop]))
        declared = [_moved_shape(shape, src, dst) for (shape, _, _), (src, dst) in zip(outs, moves)]
        primal = [args[i].aval.shape for i in range(start, stop)]
    else:
        new_batch = None
        declared = [shape for shape, _, _ in call_abstract(new_role, structs, kwargs)]
        primal = [args[i].aval.shape for i in range(start, stop)]
    n_declared = len(outs) if isinstance(batch, NativeBatch) else len(declared)  # declared: zipped with moves
    if n_declared != stop - start:
        raise ValueError(
            f"jaxbind {new_role.label}: its abstract function '{_name_of(new_role.abstract)}' "
            f"declares {n_declared} output(s), but this callback computes the cotangents of "
            f"{stop - start} linear argument(s) ({', '.join(_argument_text(role, i, start) for i in range(start, stop))}). "
            "It must return one (shape, dtype) per linear argument, in order."
        )
    for i, got, want in zip(range(start, stop), declared, primal):
        if got != want:
            raise ValueError(
                f"jaxbind {new_role.label}: its abstract declares shape {got} for the cotangent of "
                f"{_argument_text(role, i, start)}, but that argument has shape {want}. A transpose "
                "must return one array per linear argument, with that argument's shape."
            )
    results = bind(new_args, new_role, kwargs, new_batch)
    if isinstance(batch, WalkBatch):
        # Levels at which an argument was not mapped were broadcast over: its
        # cotangent is the sum over them (kept as size-1 axes by expand_dims).
        results = [
            r if all(mask) else jnp.sum(r, axis=tuple(l for l, m in enumerate(mask) if not m),
                                        keepdims=_whole(role))
            for r, mask in zip(results, batch.masks[start:stop])
        ]
    results = [_move_levels(r, src, dst) for r, (src, dst) in zip(results, moves)] or results
    out = [None] * len(args)
    for i in range(start, stop):
        if ad.is_undefined_primal(args[i]):
            out[i] = _as_cotangent(results[i - start], args[i].aval, new_role, i)
    return out


def _cotangent_values(cts, args, role: Role, kwargs: Kwargs, batch: Batch):
    """Output cotangents as arrays the transpose callback can take.

    An integer or bool output's cotangent is ``float0`` (always zero), which no
    callback can take: zeros of the output's own dtype stand for it.
    """
    def dtype_of(ct):
        return ct.aval.dtype if type(ct) is ad.Zero else get_aval(ct).dtype

    if not any(dtype_of(ct) == jax.dtypes.float0 for ct in cts):
        return [_instantiate(ct) for ct in cts]
    avals = [a.aval if ad.is_undefined_primal(a) else get_aval(a) for a in args]
    outs = _abstract_eval(*avals, role=role, kwargs=kwargs, batch=batch)
    return [jnp.zeros(out.shape, out.dtype) if dtype_of(ct) == jax.dtypes.float0 else _instantiate(ct)
            for ct, out in zip(cts, outs)]


def _argument_text(role: Role, i: int, start: int) -> str:
    """How the user knows input ``i`` of ``role`` (its linear slot starts at ``start``)."""
    what = role.op.families[role.family].labels[role.slot]
    if what == FORWARD:
        return f"argument {i}"
    if what == "jvp callback":  # inputs: the primals, then the tangents
        return f"argument {role.op.first_n_args_fixed + i - start}"
    return f"input {i} of the {what}"


def _as_cotangent(result, aval, role: Role, index: int):
    """Match a transpose's result to the dtype of the primal it is the cotangent of.

    A transpose callback sees only cotangents, so its abstract cannot know the
    primal's dtype: a real primal of a complex-valued map gets the real part,
    other dtypes are converted, as JAX does for its own casts.
    """
    result = reshard_like(result, aval)  # a whole (gathered) result of a sharded primal
    if result.dtype == aval.dtype:
        return result
    if jnp.iscomplexobj(result) and not jnp.issubdtype(aval.dtype, jnp.complexfloating):
        result = jnp.real(result)
    return result.astype(aval.dtype)


ad.primitive_jvps[jaxbind_p] = _jvp_rule
ad.primitive_transposes[jaxbind_p] = _transpose_rule


# ---------------------------------------------------------------------------
# Batching
# ---------------------------------------------------------------------------


def _batch_rule(args, dims, *, role: Role, kwargs: Kwargs, batch: Batch):
    if role.op.func_can_batch:
        return _batch_native(args, dims, role, kwargs, batch)
    # Move each new batch axis to the front: levels are leading dimensions,
    # outermost first. "sequential": the handler walks them; otherwise the
    # callback gets them whole, with a size-1 axis where an input is not mapped
    # ("expand_dims") or every input broadcast over the level ("broadcast_all").
    method = role.op.vmap_method
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    old = batch.masks if batch is not None else ((),) * len(args)
    new_args, masks = [], []
    for x, d, mask in zip(args, dims, old):
        mapped = d is not None
        if mapped:
            x = jnp.moveaxis(x, d, 0) if d != 0 else x
        elif method == "expand_dims":
            x = jnp.expand_dims(x, 0)
        elif method == "broadcast_all":
            x, mapped = jnp.broadcast_to(x, (size,) + jnp.shape(x)), True
        new_args.append(x)
        masks.append((mapped,) + mask)
    outs = bind(new_args, role, kwargs, WalkBatch(tuple(masks)))
    return outs, [0] * len(outs)


def _shift(axes, new_axis):
    """Axes after inserting ``new_axis``, then ``new_axis`` appended."""
    return tuple(a + 1 if a >= new_axis else a for a in axes) + (new_axis,)


def _batch_native(args, dims, role: Role, kwargs: Kwargs, batch: Batch):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    sizes = batch.sizes if batch is not None else ()
    old_in = batch.in_axes if batch is not None else ((),) * len(args)
    new_args, in_axes = [], []
    for i, (x, d, axes) in enumerate(zip(args, dims, old_in)):
        if d is None and (axes or i >= role.n_fixed):
            # Keep every input mapped at all levels or at none, so that
            # batch_axes is unambiguous; and differentiable inputs at all
            # levels, so that transposes produce cotangents at every level.
            x, d = jnp.broadcast_to(x[None], (size,) + x.shape), 0
        elif d is not None and sizes and not axes:
            # Mapped now but at no older level: broadcast over the older ones.
            x, d = jnp.broadcast_to(x, sizes + x.shape), d + len(sizes)
            axes = tuple(range(len(sizes)))
        new_args.append(x)
        in_axes.append(axes if d is None else _shift(axes, d))
    in_axes = tuple(in_axes)
    structs = _structs(map(get_aval, new_args))
    outs_abstract = call_abstract(role, structs, kwargs, batch_axes=in_axes, want_axis=True)
    out_new = [axis for _, _, axis in outs_abstract]
    old_out = batch.out_axes if batch is not None else ((),) * len(out_new)
    out_axes = tuple(_shift(axes, a) for axes, a in zip(old_out, out_new))
    outs = bind(new_args, role, kwargs, NativeBatch(in_axes, out_axes, sizes + (size,)))
    return outs, out_new


def _peel(axes, shape):
    """Drop the newest batch level from an array's batch axes and shape."""
    if not axes:
        return axes, shape
    last = axes[-1]
    return tuple(a - 1 if a > last else a for a in axes[:-1]), shape[:last] + shape[last + 1:]


def _native_out_layout(role: Role, args, in_axes, kwargs: Kwargs):
    """Output batch axes of a natively batched role that was never batched itself.

    Its abstract tells where each level's output axis goes given the older
    levels, so replay the levels one at a time, oldest first, as vmap would
    have. Returns the output axes and the abstract's entries at all levels.
    """
    layouts = [(in_axes, tuple(get_aval(a).shape for a in args))]
    while any(layouts[-1][0]):
        layouts.append(tuple(zip(*map(_peel, *layouts[-1]))))
    dtypes = [get_aval(a).dtype for a in args]
    out_axes = None
    for axes, shapes in reversed(layouts[:-1]):
        structs = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in zip(shapes, dtypes)]
        outs = call_abstract(role, structs, kwargs, batch_axes=tuple(axes), want_axis=True)
        out_axes = [_shift(o, axis) for o, (_, _, axis) in zip(out_axes or [()] * len(outs), outs)]
    return tuple(out_axes), outs


def _moved_shape(shape, src, dst):
    return np.moveaxis(np.broadcast_to(np.empty((), np.int8), shape), src, dst).shape


def _move_levels(x, src, dst):
    return x if tuple(src) == tuple(dst) else jnp.moveaxis(x, src, dst)


batching.primitive_batchers[jaxbind_p] = _batch_rule


# ---------------------------------------------------------------------------
# Lowering: a custom call that names a registered call site
# ---------------------------------------------------------------------------

TARGET = "jaxbind_dispatch"
ASYNC_TARGET = "jaxbind_dispatch_async"  # concurrent native kernels, on XLA's thread pool
jax.ffi.register_ffi_target(TARGET, _trampoline.handler(), platform="cpu")
jax.ffi.register_ffi_target(ASYNC_TARGET, _trampoline.async_handler(), platform="cpu")
# XLA may split a call that carries `num_batch_dims` (see partitionable_levels);
# a call without it is never split.
for _target in (TARGET, ASYNC_TARGET):
    register_batch_partitionable(_target)
_ffi_lowerings = {target: jax.ffi.ffi_lowering(target) for target in (TARGET, ASYNC_TARGET)}
_SESSION = np.int64(_trampoline.session())  # compiled beside each site id
_sites: dict = {}


def format_callback_error(label: str, exc: BaseException) -> str:
    """The message of the error a failing callback raises from the compiled call."""
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return (
        f"jaxbind {label}: the callback raised {type(exc).__name__}: {exc}\n"
        + "".join(frames).rstrip()
    )


_trampoline.set_error_formatter(format_callback_error)


def site_for(role: Role, kwargs: Kwargs, batch: Batch, avals_in, padded: bool = False) -> int:
    """The registry id of the call site, registered on first use.

    ``padded``: the call's last operand is the validity operand of a batch XLA
    may pad (see ``_validity``); the handler calls nothing for padding elements.
    """
    key = (role.callback, role.label, kwargs, batch, role.op.vmap_method, padded)
    site = _sites.get(key)
    if site is None:
        callback, can_batch = role.callback, role.op.func_can_batch
        batch_axes = batch.in_axes if isinstance(batch, NativeBatch) else None
        # The handler reads batch sizes off the buffers: only which input is
        # mapped at which level is compiled in.
        # A batch handed over whole is one call on the whole arrays (levels 0).
        walked = isinstance(batch, WalkBatch) and not _whole(role)
        layout = (batch.levels, [list(map(int, m)) for m in batch.masks]) if walked else (0, [])
        valid_levels = batch.levels if padded else 0
        if isinstance(callback, NativeKernel):
            entries = kernel_kwargs(kwargs.values, role.label, batch_axes, len(avals_in) - padded, can_batch)
            site = _trampoline.register_site(role.label, None, b"", *layout, callback.address, entries,
                                             valid_levels)
        else:
            dump = kwargs.with_values(batch_axes=batch_axes).dump if can_batch else kwargs.dump
            site = _trampoline.register_site(role.label, callback, dump, *layout, 0, [], valid_levels)
        _sites[key] = site
    return site


def partitionable_levels(batch: Batch) -> int:
    """How many leading dimensions XLA may split across devices (0: none).

    A walked call whose every input is mapped at every level is a batch of
    independent elements along the leading dimensions of all its arrays: any
    device can run any slice of it. So is such a call handed over whole
    (``vmap_method`` "expand_dims" or "broadcast_all"), whose callback sees the
    slice as its batch. Other calls (an input with a size-1 level among them)
    see whole arrays.
    """
    if isinstance(batch, WalkBatch) and batch.levels and all(all(m) for m in batch.masks):
        return batch.levels
    return 0


def _padded_levels(ctx, levels: int) -> tuple:
    """The batch levels of a partitionable call that XLA may pad.

    XLA splits a level over a number of devices that divides the devices it
    partitions over; a level whose size that count divides is never padded.
    """
    devices = auto_device_count(ctx)
    if not levels or devices <= 1:
        return ()
    return tuple(l for l in range(levels) if ctx.avals_out[0].shape[l] % devices)


def _validity(ctx, levels: int, padded: tuple):
    """The validity operand of a batch that XLA may pad, and its type.

    Shape: the batch dims and a trailing 1 (XLA's batch partitioner replicates
    an operand with no dimension beyond the batch). Value: over the levels that
    may be padded, the least of (level size - index along the level), positive
    exactly on real elements. XLA partitions it with the batch; a padding
    element gets either the value computed there (the partitioned iota counts on
    past the level's end: <= 0; what Shardy does) or the zero XLA pads a
    resharded operand with (what GSPMD does): never a positive one.
    """
    shape = tuple(ctx.avals_out[0].shape[:levels]) + (1,)
    dtype = np.int32 if max(shape) < 2**31 else np.int64
    aval = jax.core.ShapedArray(shape, dtype)

    def validity():
        remaining = [shape[l] - jax.lax.broadcasted_iota(dtype, shape, l) for l in padded]
        return functools.reduce(jnp.minimum, remaining)

    value = mlir.lower_fun(validity, multiple_results=False)(ctx.replace(avals_in=[], avals_out=[aval]))
    return (value[0] if isinstance(value, (list, tuple)) else value), aval


def _lowering(ctx, *args, role: Role, kwargs: Kwargs, batch: Batch):
    target = ASYNC_TARGET if getattr(role.callback, "concurrent", False) else TARGET
    levels = partitionable_levels(batch)
    padded = _padded_levels(ctx, levels)
    avals_in = tuple(ctx.avals_in)
    if padded:  # padding elements must never reach the callback
        value, aval = _validity(ctx, levels, padded)
        args, avals_in = (*args, value), (*avals_in, aval)
    site = site_for(role, kwargs, batch, avals_in, bool(padded))
    rule = _ffi_lowerings[target] if not levels else jax.ffi.ffi_lowering(
        target, extra_attributes=batch_partitioning_attributes(ctx, levels, avals_in))
    results = rule(ctx.replace(avals_in=avals_in), *args, session=_SESSION, site=np.int64(site))
    return set_frontend_attribute(results, "jaxbind_op", role.op.name)  # the name in the HLO


mlir.register_lowering(jaxbind_p, _lowering, platform="cpu")

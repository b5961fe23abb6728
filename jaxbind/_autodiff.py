"""The autodiff rules: jvp (one call per slot, or a nonlinear op's jvp callback) and transpose."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._abstract_eval import jaxbind_abstract_eval
from ._batch_types import Batch, as_batch
from ._bind import bind
from ._definition import CallbackKind, Role, name_of
from ._errors import JaxbindError
from ._jax_compat import ad, get_aval, reshard_like
from ._kwargs import Kwargs
from ._user_abstract import is_differentiable

# ---------------------------------------------------------------------------
# jvp
# ---------------------------------------------------------------------------


def jaxbind_jvp(primals, tangents, *, role: Role, kwargs: Kwargs, batch: Batch):
    if role.op.effect is not None:  # (a linear op's too: its jvp would call it again)
        raise role.op.no_derivatives_error("its jvp (as jvp, grad, vjp and the jacobians do)")
    for i in range(role.n_fixed):
        if type(tangents[i]) is not ad.Zero:
            raise _not_differentiable(role, i, "a derivative with respect to")
    outs = bind(primals, role, kwargs, batch)
    if role.linear:
        tangent_out = _linear_jvp(primals, tangents, role, kwargs, batch)
    elif any(type(t) is not ad.Zero for t in tangents[role.n_fixed :]) and _inexact(outs, role):
        tangent_out = _nonlinear_jvp(primals, tangents, outs, role, kwargs, batch)
    else:
        tangent_out = None
    if tangent_out is None:
        return outs, _zero_tangents(outs)
    # Residuals, integer and bool outputs have symbolic zero tangents (a
    # linear op's callback computed values for the integer ones: dropped).
    return outs, [
        t if t is not None and is_differentiable(get_aval(o).dtype) else z
        for t, o, z in zip(tangent_out, outs, _zero_tangents(outs))
    ]


def _linear_jvp(primals, tangents, role: Role, kwargs: Kwargs, batch: Batch):
    # Linear within a slot, multilinear across slots: one call per slot
    # whose tangents are not all zero, with that slot's arrays replaced.
    tangent_out = None
    for _, start, stop in role.input_groups():
        group = tangents[start:stop]
        if all(type(t) is ad.Zero for t in group):
            continue
        args = list(primals)
        args[start:stop] = [_tangent_value(t, p) for t, p in zip(group, primals[start:stop])]
        term = bind(args, role, kwargs, batch)
        tangent_out = term if tangent_out is None else [a + b for a, b in zip(tangent_out, term)]
    return tangent_out


def _nonlinear_jvp(primals, tangents, outs, role: Role, kwargs: Kwargs, batch: Batch):
    """Output tangents (None where there are none) from the derivative family's jvp callback.

    ``f_jvp(*primals, *residuals, *tangents)``, the residuals (f's last
    outputs) fixed like the primals; it computes the tangents of the inexact
    outputs only.
    """
    if not role.op.has_derivatives:
        raise role.op.no_derivatives_error("its jvp (as jvp, grad, vjp and the jacobians do)")
    n_fixed, n_out = role.n_fixed, len(outs) - role.op.n_residuals
    inexact = _inexact(outs, role)
    jvp_role = Role.jvp(role.op, len(primals))
    args = [*primals, *outs[n_out:], *[_tangent_value(t, p) for t, p in zip(tangents[n_fixed:], primals[n_fixed:])]]
    computed = dict(zip(inexact, as_batch(batch).jvp(role, jvp_role, args, kwargs, n_out, inexact)))
    return [computed.get(j) for j in range(len(outs))]


def _not_differentiable(role: Role, index: int, verb: str):
    if role.is_derivative:
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


def _inexact(outs, role: Role):
    """Indices of the outputs (residuals excluded) that have tangents."""
    return [j for j in range(len(outs) - role.op.n_residuals) if is_differentiable(get_aval(outs[j]).dtype)]


# ---------------------------------------------------------------------------
# Transpose
# ---------------------------------------------------------------------------


def jaxbind_transpose(cts, *args, role: Role, kwargs: Kwargs, batch: Batch):
    if not role.op.has_derivatives:
        raise role.op.no_derivatives_error("its linear transpose")
    if not role.linear:  # JAX transposes only what our jvp rule emitted
        raise JaxbindError(f"jaxbind {role.label}: cannot transpose a nonlinear callback")
    for i in range(role.n_fixed):
        if ad.is_undefined_primal(args[i]):
            raise _not_differentiable(role, i, "a transpose with respect to")
    linear = [g for g in role.input_groups() if any(ad.is_undefined_primal(a) for a in args[g[1] : g[2]])]
    if not linear or all(type(ct) is ad.Zero for ct in cts):
        return [None] * len(args)
    if len(linear) > 1:
        raise ValueError(
            f"jaxbind {role.label}: the op is multilinear, not linear, in arguments "
            f"{linear[0][1]} and {linear[1][1]} together; it can be transposed with respect "
            "to one of them at a time only."
        )
    group = slot, start, stop = linear[0]
    cts = _cotangent_values(cts, args, role, kwargs, batch)
    new_role = role.with_slot(slot, len(cts))
    new_args = role.regroup(slot, args[: role.n_fixed], args[role.n_fixed :], cts)
    plan = as_batch(batch).transpose(role, new_role, group, args, new_args, len(cts), kwargs)
    _check_declared(role, new_role, start, stop, plan)
    results = plan.finish(bind(new_args, new_role, kwargs, plan.batch))
    out = [None] * len(args)
    for i in range(start, stop):
        if ad.is_undefined_primal(args[i]):
            out[i] = _as_cotangent(results[i - start], args[i].aval, new_role, i)
    return out


def _check_declared(role: Role, new_role: Role, start: int, stop: int, plan):
    """The transpose's abstract declares one cotangent per linear argument, of its shape."""
    if len(plan.declared) != stop - start:
        linear = ", ".join(_argument_text(role, i, start) for i in range(start, stop))
        raise ValueError(
            f"jaxbind {new_role.label}: its abstract function '{name_of(new_role.abstract)}' "
            f"declares {len(plan.declared)} output(s), but this callback computes the cotangents of "
            f"{stop - start} linear argument(s) ({linear}). "
            "It must return one (shape, dtype) per linear argument, in order."
        )
    for i, got, want in zip(range(start, stop), plan.declared, plan.primal):
        if got != want:
            raise ValueError(
                f"jaxbind {new_role.label}: its abstract declares shape {got} for the cotangent of "
                f"{_argument_text(role, i, start)}, but that argument has shape {want}. A transpose "
                "must return one array per linear argument, with that argument's shape."
            )


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
    outs, _ = jaxbind_abstract_eval(*avals, role=role, kwargs=kwargs, batch=batch)
    return [
        jnp.zeros(out.shape, out.dtype) if dtype_of(ct) == jax.dtypes.float0 else _instantiate(ct)
        for ct, out in zip(cts, outs)
    ]


def _argument_text(role: Role, i: int, start: int) -> str:
    """How the user knows input ``i`` of ``role`` (its linear slot starts at ``start``)."""
    if role.callback_kind is CallbackKind.FORWARD:
        return f"argument {i}"
    if role.callback_kind is CallbackKind.JVP:  # inputs: the primals, then the tangents
        return f"argument {role.op.first_n_args_fixed + i - start}"
    return f"input {i} of the {role.what}"


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

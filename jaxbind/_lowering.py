"""The lowering rule: a custom call naming its call site (see _sites), with what XLA needs to split it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _programs  # noqa: F401  (sets the core's program check and resolver before a program runs)
from ._batch_types import Batch
from ._definition import Role
from ._effects import ORDERED
from ._errors import JaxbindError
from ._jax_compat import (
    add_keepalive,
    auto_device_count,
    batch_partitioning_attributes,
    ffi_call_operation,
    hold_as_host_callback,
    lowering_for_export,
    mlir,
    place_callback,
    set_frontend_attribute,
    uses_shardy,
)
from ._jax_effects import abstract_token, ordered_token, set_ordered_token
from ._kwargs import Kwargs
from ._runtime import ASYNC_TARGET, EFFECT_TARGET, TARGET
from ._sites import check_exportable, describe, partitioned_levels, site_for

_ffi_lowerings = {target: jax.ffi.ffi_lowering(target) for target in (TARGET, ASYNC_TARGET)}


def _padded_levels(ctx, levels: int) -> tuple:
    """The batch levels of a partitionable call that XLA may pad.

    XLA splits a level over a number of devices that divides the devices it
    partitions over; a level whose size that count divides is never padded.
    """
    devices = auto_device_count(ctx)
    if not levels or devices <= 1:
        return ()
    return tuple(level for level in range(levels) if ctx.avals_out[0].shape[level] % devices)


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
        remaining = [shape[level] - jax.lax.broadcasted_iota(dtype, shape, level) for level in padded]
        return functools.reduce(jnp.minimum, remaining)

    value = mlir.lower_fun(validity, multiple_results=False)(ctx.replace(avals_in=[], avals_out=[aval]))
    return (value[0] if isinstance(value, (list, tuple)) else value), aval


def _operand_output_aliases(ctx, role: Role) -> dict:
    """{operand: result} for the outputs updated in place: XLA gives each its operand's buffer.

    (XLA's word and direction: an ``inplace`` pair (output, argument) is the alias argument -> output.)

    XLA's buffer assignment passes the operand's own buffer when nothing reads
    it after the call (a donated parameter, a loop carry, a dead intermediate)
    and copies it into the output first otherwise, so the caller's value is
    never changed.
    """
    aliases = {}
    for out, arg in role.inplace_pairs:
        given, made = ctx.avals_in[arg], ctx.avals_out[out]
        if given.shape != made.shape or given.dtype != made.dtype:  # (the batching rules align them)
            raise JaxbindError(
                f"jaxbind {role.label}: inplace maps output {out} to argument {arg}, but in this "
                f"program they are {made.str_short()} and {given.str_short()}; an output updated in "
                "place must have its argument's shape, dtype and batch layout."
            )
        aliases[arg] = out
    return aliases


def _check_effect_placement(ctx, role: Role) -> None:
    """Refuse an op with an effect in a program XLA partitions over several devices itself.

    Inside ``shard_map`` every device runs its own calls, as JAX's callbacks
    do. Outside it, the call is pinned to one device by the sharding JAX
    gives its own callbacks, which GSPMD keeps; Shardy keeps it for JAX's
    callback targets only, and drops jaxbind's (XLA then refuses a
    side-effecting call without one).
    """
    devices = auto_device_count(ctx)
    if devices > 1 and uses_shardy():
        raise NotImplementedError(
            f"jaxbind op '{role.op.name}' has an effect ({role.op.effect!r}) and is called in a program that "
            f"XLA partitions over {devices} devices with Shardy, which does not keep jaxbind's call on one "
            "device: call it inside jax.shard_map (every device then runs its own calls, in order), or in a "
            "program on one device (jax.jit of unsharded arguments outside a multi-device mesh), or "
            "partition with GSPMD (jax.config.update('jax_use_shardy_partitioner', False)), which keeps it."
        )


def jaxbind_lowering(ctx, *args, role: Role, kwargs: Kwargs, batch: Batch):
    target = ASYNC_TARGET if getattr(role.callback, "concurrent", False) else TARGET
    if role.op.effect is not None:
        target = EFFECT_TARGET
        _check_effect_placement(ctx, role)
    jax_callback = role.op.jax_callback  # jaxbind.pure_callback's: placed as jax.pure_callback is
    # A batch XLA may split over devices, unless the callback is pinned to one device.
    levels = partitioned_levels(role, batch)
    padded = _padded_levels(ctx, levels)
    avals_in = tuple(ctx.avals_in)
    if padded:  # padding elements must never reach the callback
        value, aval = _validity(ctx, levels, padded)
        args, avals_in = (*args, value), (*avals_in, aval)
    if lowering_for_export(ctx):  # resolved by the op's name where it is deserialized
        check_exportable(role)
        text, key = describe(
            role, kwargs, batch, avals_in[: len(avals_in) - bool(padded)], ctx.avals_out, bool(padded), exported=True
        )
    else:
        handle = site_for(role, kwargs, batch, avals_in, ctx.avals_out, bool(padded))
        add_keepalive(ctx, handle)  # the site lives as long as the compiled program
        if jax_callback is not None or role.op.effect is not None:
            # JAX runs a program that holds jax.pure_callback synchronously, so that the call
            # raises what the callback raised (and an effect's calls run before the call returns,
            # never after the interpreter began to exit): this one too (see hold_as_host_callback)
            hold_as_host_callback(ctx)
        text, key = handle.description, handle.key
    aliases = _operand_output_aliases(ctx, role)
    effect = role.op.effect
    avals_out = tuple(ctx.avals_out)
    if effect == "ordered":  # the effect's token first among operands and results (the core drops them)
        args = (ordered_token(ctx, ORDERED), *args)
        avals_in, avals_out = (abstract_token, *avals_in), (abstract_token, *avals_out)
        aliases = {arg + 1: out + 1 for arg, out in aliases.items()}
    lowered = ctx.replace(avals_in=avals_in, avals_out=avals_out)
    if not levels and not aliases and effect is None and jax_callback is None:
        results = _ffi_lowerings[target](lowered, *args, jaxbind=text, site=np.int64(key))
        call = results[0].owner
    else:
        extra = batch_partitioning_attributes(ctx, levels, avals_in) if levels else None
        call = ffi_call_operation(
            target,
            lowered,
            args,
            extra_attributes=extra,
            operand_output_aliases=aliases or None,
            has_side_effect=effect is not None,
            jaxbind=text,
            site=np.int64(key),
        )
        if (jax_callback is not None or effect is not None) and not levels:
            # as JAX places its callbacks; an op with an effect runs once in a sharded program
            sharding = jax_callback.sharding if jax_callback is not None else None
            place_callback(ctx, call, sharding, tokened=effect == "ordered")
        results = list(call.results)
    if effect == "ordered":
        token, *results = results
        set_ordered_token(ctx, ORDERED, token)
    set_frontend_attribute(call, "jaxbind_op", role.op.name)  # the name in the HLO
    return results

"""The lowering rule: a custom call naming its call site (see _sites), with what XLA needs to split it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _programs  # noqa: F401  (sets the core's program check and resolver before a program runs)
from ._batch_types import Batch
from ._definition import Role
from ._errors import JaxbindError
from ._jax_compat import (
    add_keepalive,
    auto_device_count,
    batch_partitioning_attributes,
    hold_as_host_callback,
    lowering_for_export,
    mlir,
    place_callback,
    set_frontend_attribute,
)
from ._kwargs import Kwargs
from ._runtime import ASYNC_TARGET, TARGET
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


def jaxbind_lowering(ctx, *args, role: Role, kwargs: Kwargs, batch: Batch):
    target = ASYNC_TARGET if getattr(role.callback, "concurrent", False) else TARGET
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
        if jax_callback is not None:
            # JAX runs a program that holds jax.pure_callback synchronously, so that the call
            # raises what the callback raised: this one too (see hold_as_host_callback)
            hold_as_host_callback(ctx)
        text, key = handle.description, handle.key
    aliases = _operand_output_aliases(ctx, role)
    if not levels and not aliases:
        rule = _ffi_lowerings[target]
    else:
        extra = batch_partitioning_attributes(ctx, levels, avals_in) if levels else None
        rule = jax.ffi.ffi_lowering(target, extra_attributes=extra, operand_output_aliases=aliases or None)
    results = rule(ctx.replace(avals_in=avals_in), *args, jaxbind=text, site=np.int64(key))
    if jax_callback is not None and not levels and results:
        place_callback(ctx, results, jax_callback.sharding)
    return set_frontend_attribute(results, "jaxbind_op", role.op.name)  # the name in the HLO

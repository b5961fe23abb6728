"""The lowering rule: a custom call naming a registered call site, with what XLA needs to split it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _trampoline
from ._batch_types import Batch, as_batch
from ._definition import Role
from ._jax_compat import auto_device_count, batch_partitioning_attributes, mlir, set_frontend_attribute
from ._kwargs import Kwargs
from ._native import NativeKernel, kernel_kwargs
from ._runtime import ASYNC_TARGET, SESSION, TARGET

_ffi_lowerings = {target: jax.ffi.ffi_lowering(target) for target in (TARGET, ASYNC_TARGET)}
_sites: dict = {}


def site_for(role: Role, kwargs: Kwargs, batch: Batch, avals_in, avals_out, padded: bool = False) -> int:
    """The registry id of the call site, registered on first use.

    ``padded``: the call's last operand is the validity operand of a batch XLA
    may pad (see ``_validity``); the handler calls nothing for padding elements.
    """
    key = (role.callback, role.label, kwargs, batch, role.op.vmap_method, padded)
    site = _sites.get(key)
    if site is None:
        callback, can_batch, kind = role.callback, role.op.func_can_batch, as_batch(batch)
        batch_axes = kind.callback_batch_axes
        layout = kind.site_layout(role)
        valid_levels = batch.levels if padded else 0
        if isinstance(callback, NativeKernel):
            entries = kernel_kwargs(kwargs.values, role.label, batch_axes, len(avals_in) - padded, can_batch)
            address = callback.address_for(tuple(avals_in[:len(avals_in) - padded]), tuple(avals_out),
                                           kwargs.values)
            site = _trampoline.register_site(role.label, None, b"", *layout, address, entries, valid_levels)
        else:
            dump = kwargs.with_values(batch_axes=batch_axes).dump if can_batch else kwargs.dump
            site = _trampoline.register_site(role.label, callback, dump, *layout, 0, [], valid_levels)
        _sites[key] = site
    return site


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


def jaxbind_lowering(ctx, *args, role: Role, kwargs: Kwargs, batch: Batch):
    target = ASYNC_TARGET if getattr(role.callback, "concurrent", False) else TARGET
    levels = as_batch(batch).partitionable_levels()
    padded = _padded_levels(ctx, levels)
    avals_in = tuple(ctx.avals_in)
    if padded:  # padding elements must never reach the callback
        value, aval = _validity(ctx, levels, padded)
        args, avals_in = (*args, value), (*avals_in, aval)
    site = site_for(role, kwargs, batch, avals_in, ctx.avals_out, bool(padded))
    rule = _ffi_lowerings[target] if not levels else jax.ffi.ffi_lowering(
        target, extra_attributes=batch_partitioning_attributes(ctx, levels, avals_in))
    results = rule(ctx.replace(avals_in=avals_in), *args, session=SESSION, site=np.int64(site))
    return set_frontend_attribute(results, "jaxbind_op", role.op.name)  # the name in the HLO

"""The batching rule: a vmap level added to a walked batch, or handed to a callback that batches itself."""

from __future__ import annotations

import jax.numpy as jnp

from ._batch_types import Batch, SelfBatch, WalkBatch, as_batch, shift_axes
from ._bind import bind
from ._definition import Role
from ._jax_compat import get_aval
from ._kwargs import Kwargs
from ._user_abstract import call_abstract, structs
from ._vmap_methods import DOOR_PURE_CALLBACK, Unmapped, accepted, method_of


def jaxbind_batch(args, dims, *, role: Role, kwargs: Kwargs, batch: Batch):
    if role.op.effect == "ordered":
        if role.op.jax_callback is not None:  # jax.io_callback's words
            raise ValueError(f"Cannot `vmap` ordered IO callback. (jaxbind op '{role.op.name}')")
        raise ValueError(
            f"jaxbind op '{role.op.name}' has effect='ordered', and vmap cannot keep program order: "
            "the batch's calls have no order between them. Loop over the batch with jax.lax.scan or "
            'jax.lax.map (each call then in order), or make the op with effect="io".'
        )
    if method_of(role.op.vmap_method) is None:  # jaxbind.pure_callback's default, as jax.pure_callback's
        *names, last = [repr(n) for n in accepted(DOOR_PURE_CALLBACK) if n is not None]
        raise NotImplementedError(
            f"vmap is only supported for the {role.op.name} op when vmap_method is one of "
            f"{', '.join(names)}, or {last}. Got vmap_method=None."
        )
    if role.op.func_can_batch:
        return _batch_self(args, dims, role, kwargs, as_batch(batch))
    return _batch_walk(args, dims, role, kwargs, as_batch(batch))


def _batch_walk(args, dims, role: Role, kwargs: Kwargs, batch):
    # Move each new batch axis to the front: levels are leading dimensions,
    # outermost first. An input the level does not map gets what the op's
    # method says (_vmap_methods).
    unmapped = method_of(role.op.vmap_method).unmapped
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    new_args, masks = [], []
    in_place = {arg for _, arg in role.inplace_pairs}
    for i, (x, d, mask) in enumerate(zip(args, dims, batch.masks_for(len(args)))):
        mapped = d is not None
        if mapped:
            x = jnp.moveaxis(x, d, 0) if d != 0 else x
        elif i in in_place:  # an output updated in place is batched: so must its argument be
            x, mapped = jnp.broadcast_to(x, (size,) + jnp.shape(x)), True
        elif unmapped is Unmapped.SIZE_ONE:
            x = jnp.expand_dims(x, 0)
        elif unmapped is Unmapped.BROADCAST:
            x, mapped = jnp.broadcast_to(x, (size,) + jnp.shape(x)), True
        new_args.append(x)
        masks.append((mapped,) + mask)
    outs = bind(new_args, role, kwargs, WalkBatch(tuple(masks)))
    return outs, [0] * len(outs)


def _batch_self(args, dims, role: Role, kwargs: Kwargs, batch):
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    sizes = batch.sizes
    new_args, in_axes = [], []
    in_place = {arg for _, arg in role.inplace_pairs}
    for i, (x, d, axes) in enumerate(zip(args, dims, batch.in_axes_for(len(args)))):
        if d is None and (axes or i >= role.n_fixed or i in in_place):
            # Keep every input mapped at all levels or at none, so that
            # batch_axes is unambiguous; and differentiable inputs at all
            # levels, so that transposes produce cotangents at every level.
            x, d = jnp.broadcast_to(x[None], (size,) + x.shape), 0
        elif d is not None and sizes and not axes:
            # Mapped now but at no older level: broadcast over the older ones.
            x, d = jnp.broadcast_to(x, sizes + x.shape), d + len(sizes)
            axes = tuple(range(len(sizes)))
        new_args.append(x)
        in_axes.append(axes if d is None else shift_axes(axes, d))
    in_axes = tuple(in_axes)
    outs_abstract = call_abstract(role, structs(map(get_aval, new_args)), kwargs, batch_axes=in_axes, want_axis=True)
    out_new = [axis for _, _, axis in outs_abstract]
    out_axes = tuple(shift_axes(axes, a) for axes, a in zip(batch.out_axes_for(len(out_new)), out_new))
    outs = bind(new_args, role, kwargs, SelfBatch(in_axes, out_axes, sizes + (size,)))
    return outs, out_new

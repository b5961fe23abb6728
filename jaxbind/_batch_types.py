"""How a call is batched (not at all, walked by jaxbind, or by the callback itself: self-batched), and what
each means to the rules.

The primitive's ``batch`` parameter is None, a :class:`WalkBatch` or a
:class:`SelfBatch`. What the rules do differently for each (the output
types, the jvp call, the transpose, the call site's layout) is a method of
each kind, so that every rule is written once; :func:`as_batch` gives the
object with those methods for a parameter, :data:`UNBATCHED` for None.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._bind import bind
from ._definition import Role, name_of
from ._jax_compat import get_aval
from ._user_abstract import call_abstract, check_input_dtypes, check_size, structs
from ._vmap_methods import method_of


class TransposePlan(NamedTuple):
    """A transpose call under a batch: how to bind it, what to check, how to finish."""

    batch: object  # the transpose's batch parameter
    declared: list  # the shapes its abstract declares, comparable with ``primal``
    primal: list  # the shapes of the linear arguments it computes the cotangents of
    finish: Callable  # its results -> cotangents in the layout of the primals


def _walked(role: Role) -> bool:
    """Whether the core walks a batch element by element (else the callbacks get it in one call)."""
    return method_of(role.op.vmap_method).walked


def _all_levels(role: Role) -> bool:
    """Whether every input carries every batch level in front, mapped or not (else an input's
    leading dimensions are its mapped levels only)."""
    return method_of(role.op.vmap_method).all_levels


def _linear_shapes(args, start: int, stop: int):
    return [args[i].aval.shape for i in range(start, stop)]


class Unbatched:
    """No batch: arrays reach the callback as they are (zero levels of either kind)."""

    sizes = ()
    callback_batch_axes = None

    def masks_for(self, n: int):
        return ((),) * n

    def in_axes_for(self, n: int):
        return ((),) * n

    out_axes_for = in_axes_for

    def partitionable_levels(self) -> int:
        return 0

    def description(self):
        """What a call's description says of its batch (JSON; see _sites.describe)."""
        return None

    def site_layout(self, role: Role):
        return 0, []

    def output_shapes(self, role: Role, avals, kwargs):
        outs = call_abstract(role, structs(avals), kwargs, batch_axes=None)
        return [(shape, dtype) for shape, dtype, _ in outs]

    def jvp(self, role: Role, jvp_role: Role, args, kwargs, n_out: int, inexact):
        return bind(args, jvp_role, kwargs, None)

    def transpose(self, role: Role, new_role: Role, group, args, new_args, n_cts: int, kwargs) -> TransposePlan:
        _, start, stop = group
        declared = [shape for shape, _, _ in call_abstract(new_role, structs(map(get_aval, new_args)), kwargs)]
        return TransposePlan(None, declared, _linear_shapes(args, start, stop), lambda results: results)


UNBATCHED = Unbatched()


@dataclasses.dataclass(frozen=True)
class WalkBatch:
    """Batched by jaxbind, as the op's ``vmap_method`` says.

    There are ``L`` batch levels (outermost first). ``masks[i][l]`` says whether
    input ``i`` is mapped at level ``l``. Every output has all ``L`` levels in
    front. With ``"sequential"`` an input's mapped levels are its leading
    dimensions, in level order, and the handler calls the callback once per
    element. Otherwise the callback is called once on the whole arrays: with
    ``"expand_dims"`` every input has all ``L`` levels in front, of size 1 where
    it is not mapped (``"broadcast_all"`` maps every input at every level); with
    ``"legacy_vectorized"`` (``jaxbind.pure_callback``'s) an input has its mapped
    levels in front, as with ``"sequential"``, and the callback broadcasts.
    """

    masks: tuple[tuple[bool, ...], ...]
    callback_batch_axes = None

    @property
    def levels(self) -> int:
        return len(self.masks[0]) if self.masks else 0

    def __repr__(self):
        return "walk" + "".join("(" + "".join("b" if m else "_" for m in mask) + ")" for mask in self.masks)

    def masks_for(self, n: int):
        return self.masks

    def batch_dims(self, role: Role, mask) -> int:
        """How many leading dimensions of an input with batch mask ``mask`` are batch levels."""
        return len(mask) if _all_levels(role) else sum(mask)

    def level_sizes(self, shapes, all_levels: bool = False):
        """Sizes of the batch levels, read off the inputs mapped at each level.

        ``all_levels``: every input has all levels in front (not only its mapped ones).
        """
        sizes = [1] * self.levels
        for shape, mask in zip(shapes, self.masks):
            pos = 0
            for level, mapped in enumerate(mask):
                if mapped:
                    sizes[level] = shape[pos]
                pos += 1 if mapped or all_levels else 0
        return tuple(sizes)

    def description(self):
        return {"walk": [[int(m) for m in mask] for mask in self.masks]}

    def partitionable_levels(self) -> int:
        """How many leading dimensions XLA may split across devices (0: none).

        A walked call whose every input is mapped at every level is a batch of
        independent elements along the leading dimensions of all its arrays:
        any device can run any slice of it. So is such a call handed over
        whole (a method that is not walked: ``vmap_method`` "expand_dims",
        "broadcast_all" or "legacy_vectorized"), whose callback sees the slice
        as its batch. Other calls (an input with a size-1 level
        among them) see whole arrays.
        """
        if self.levels and all(all(m) for m in self.masks):
            return self.levels
        return 0

    def site_layout(self, role: Role):
        # The handler reads batch sizes off the buffers: only which input is
        # mapped at which level is compiled in. A batch handed over whole is
        # one call on the whole arrays (levels 0).
        if not _walked(role):
            return 0, []
        return self.levels, [list(map(int, m)) for m in self.masks]

    def output_shapes(self, role: Role, avals, kwargs):
        core = [jax.ShapeDtypeStruct(a.shape[self.batch_dims(role, m) :], a.dtype) for a, m in zip(avals, self.masks)]
        prefix = self.level_sizes([a.shape for a in avals], _all_levels(role))
        outs = call_abstract(role, core, kwargs)
        for k, (shape, dtype, _) in enumerate(outs):  # the whole batch of it must fit too
            check_size(role, k, prefix + shape, dtype)
        return [(prefix + shape, dtype) for shape, dtype, _ in outs]

    def jvp(self, role: Role, jvp_role: Role, args, kwargs, n_out: int, inexact):
        # f's outputs, residuals included, have every level in front.
        full = ((True,) * self.levels,) * role.op.n_residuals
        return bind(args, jvp_role, kwargs, WalkBatch(self.masks + full + self.masks[role.n_fixed :]))

    def transpose(self, role: Role, new_role: Role, group, args, new_args, n_cts: int, kwargs) -> TransposePlan:
        slot, start, stop = group
        n_fixed = role.n_fixed
        full = (True,) * self.levels
        batch = WalkBatch(tuple(role.regroup(slot, self.masks[:n_fixed], self.masks[n_fixed:], [full] * n_cts)))
        new_structs = structs(map(get_aval, new_args))
        check_input_dtypes(new_role, new_structs)
        declared = [shape[self.levels :] for shape, _ in batch.output_shapes(new_role, new_structs, kwargs)]
        primal = [args[i].aval.shape[self.batch_dims(role, self.masks[i]) :] for i in range(start, stop)]
        masks = self.masks[start:stop]

        def finish(results):
            # Levels at which an argument was not mapped were broadcast over: its
            # cotangent is the sum over them (kept as size-1 axes by expand_dims).
            return [
                r
                if all(mask)
                else jnp.sum(r, axis=tuple(axis for axis, m in enumerate(mask) if not m), keepdims=_all_levels(role))
                for r, mask in zip(results, masks)
            ]

        return TransposePlan(batch, declared, primal, finish)


@dataclasses.dataclass(frozen=True)
class SelfBatch:
    """Batched by the callback itself (``func_can_batch``): a self-batched call.

    ``in_axes[i]`` are the batch axes of input ``i`` (the ``batch_axes`` the
    callback sees), one per level, oldest level first, or ``()`` for an input
    mapped at no level: an input is mapped at every level or at none.
    ``out_axes[j]`` are those of output ``j`` (always one per level) and
    ``sizes`` the size of each level.
    """

    in_axes: tuple[tuple[int, ...], ...]
    out_axes: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]

    @property
    def callback_batch_axes(self):
        return self.in_axes

    def in_axes_for(self, n: int):
        return self.in_axes

    def out_axes_for(self, n: int):
        return self.out_axes

    def description(self):
        return {SELF_BATCH_FIELD: [[list(a) for a in self.in_axes], [list(a) for a in self.out_axes], list(self.sizes)]}

    def partitionable_levels(self) -> int:
        return 0

    def site_layout(self, role: Role):
        return 0, []

    def output_shapes(self, role: Role, avals, kwargs):
        outs = call_abstract(role, structs(avals), kwargs, batch_axes=self.in_axes)
        self._check_levels(role, outs)
        return [(shape, dtype) for shape, dtype, _ in outs]

    def _check_levels(self, role: Role, outs):
        """Every output holds every batch level where it says.

        Checked at trace time: a mistake in an abstract's batch bookkeeping would
        otherwise surface as a shape error inside the callback, or not at all.
        """
        for j, ((shape, _, _), axes) in enumerate(zip(outs, self.out_axes)):
            for level, (axis, size) in enumerate(zip(axes, self.sizes)):
                if axis >= len(shape) or shape[axis] != size:
                    has = f"has size {shape[axis]} there" if axis < len(shape) else "has no such axis"
                    raise ValueError(
                        f"jaxbind {role.label}: its abstract function '{name_of(role.abstract)}' "
                        f"declares output {j} with shape {shape}, which does not hold the batch: vmap "
                        f"level {level} (size {size}) is its axis {axis} (from the batch axes the "
                        f"abstract returned, {tuple(axes)}), but the declared shape {has}. With "
                        "func_can_batch the abstract must return each output's shape with every batch "
                        f"level in it, and its batch axis (inputs' batch_axes: {self.in_axes})."
                    )

    def jvp(self, role: Role, jvp_role: Role, args, kwargs, n_out: int, inexact):
        # Tangents are batched like their primals, residuals as f wrote them;
        # the output tangents go where f's outputs are.
        in_axes = self.in_axes + self.out_axes[n_out:] + self.in_axes[role.n_fixed :]
        out_axes, _ = self_batched_out_layout(jvp_role, args, in_axes, kwargs)
        tangents = bind(args, jvp_role, kwargs, SelfBatch(in_axes, out_axes, self.sizes))
        return [move_levels(t, src, self.out_axes[j]) for t, src, j in zip(tangents, out_axes, inexact)]

    def transpose(self, role: Role, new_role: Role, group, args, new_args, n_cts: int, kwargs) -> TransposePlan:
        # The callback lays out its outputs as its abstract says; they are
        # moved into the layout of the primals they are cotangents of.
        slot, start, stop = group
        n_fixed = role.n_fixed
        in_axes = tuple(role.regroup(slot, self.in_axes[:n_fixed], self.in_axes[n_fixed:], self.out_axes))
        out_axes, outs = self_batched_out_layout(new_role, new_args, in_axes, kwargs)
        moves = list(zip(out_axes, self.in_axes[start:stop]))
        if len(outs) == len(moves):
            declared = [_moved_shape(shape, src, dst) for (shape, _, _), (src, dst) in zip(outs, moves)]
        else:  # refused for its count: its shapes cannot be moved
            declared = [shape for shape, _, _ in outs]

        def finish(results):
            return [move_levels(r, src, dst) for r, (src, dst) in zip(results, moves)]

        return TransposePlan(
            SelfBatch(in_axes, out_axes, self.sizes), declared, _linear_shapes(args, start, stop), finish
        )


Batch = WalkBatch | SelfBatch | None


def as_batch(batch: Batch):
    """The object with the batch kind's methods for the primitive's ``batch`` parameter."""
    return UNBATCHED if batch is None else batch


# ---------------------------------------------------------------------------
# Batch axes of self-batched calls
# ---------------------------------------------------------------------------


def shift_axes(axes, new_axis):
    """Axes after inserting ``new_axis``, then ``new_axis`` appended."""
    return tuple(a + 1 if a >= new_axis else a for a in axes) + (new_axis,)


def _peel(axes, shape):
    """Drop the newest batch level from an array's batch axes and shape."""
    if not axes:
        return axes, shape
    last = axes[-1]
    return tuple(a - 1 if a > last else a for a in axes[:-1]), shape[:last] + shape[last + 1 :]


def self_batched_out_layout(role: Role, args, in_axes, kwargs):
    """Output batch axes of a self-batched role that was never batched itself.

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
        level_structs = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in zip(shapes, dtypes)]
        outs = call_abstract(role, level_structs, kwargs, batch_axes=tuple(axes), want_axis=True)
        out_axes = [shift_axes(o, axis) for o, (_, _, axis) in zip(out_axes or [()] * len(outs), outs)]
    return tuple(out_axes), outs


def _moved_shape(shape, src, dst):
    return np.moveaxis(np.broadcast_to(np.empty((), np.int8), shape), src, dst).shape


def move_levels(x, src, dst):
    return x if tuple(src) == tuple(dst) else jnp.moveaxis(x, src, dst)


# The description's field for a self-batched call. Its name since schema 1, from when that kind was
# called "native" batching; kept, since renaming it would change the key of every such site and make
# the programs made so far unreadable (a new schema).
SELF_BATCH_FIELD = "native"


def batch_from_description(value):
    """The batch parameter a call's description says (the inverse of each kind's ``description``)."""
    if value is None:
        return None
    if "walk" in value:
        return WalkBatch(tuple(tuple(bool(m) for m in mask) for mask in value["walk"]))
    in_axes, out_axes, sizes = value[SELF_BATCH_FIELD]
    return SelfBatch(tuple(map(tuple, in_axes)), tuple(map(tuple, out_axes)), tuple(sizes))

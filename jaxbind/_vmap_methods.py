"""The vmap methods, each defined once: whether the core walks it, what an unmapped input gets, which front doors
take it. The front doors, the batching rule, the batch kinds and the error texts all read this table.

A method says how a vmapped op (without ``func_can_batch``) hands its batch to the
callbacks; the names and meanings are ``jax.pure_callback``'s. An op keeps the
method's name (a call description carries it); the rules ask :func:`method_of`.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["DOOR_OP", "DOOR_PURE_CALLBACK", "NO_METHOD", "Unmapped", "VmapMethod", "accepted", "method_of", "named"]

# The front doors: get_linear_call / get_nonlinear_call, and jaxbind.pure_callback.
DOOR_OP, DOOR_PURE_CALLBACK = "op", "pure_callback"


class Unmapped(enum.Enum):
    """What an input that a vmap level does not map gets for that level."""

    AS_IS = "nothing: it keeps its shape"  # its leading dimensions are its mapped levels only
    SIZE_ONE = "a leading axis of size 1"
    BROADCAST = "the level, broadcast"


@dataclasses.dataclass(frozen=True)
class VmapMethod:
    """One way of handing a batch to the callbacks.

    ``walked``: the core calls the callback once per batch element (one custom
    call walks the batch); otherwise the callback gets the whole batch in one
    call, every level a leading axis of the inputs it maps. ``unmapped``: what
    an input gets at a level that does not map it. ``doors``: the front doors
    that take it.
    """

    name: str
    walked: bool
    unmapped: Unmapped
    doors: frozenset

    @property
    def all_levels(self) -> bool:
        """Whether every input has every level in front, mapped or not."""
        return self.unmapped is not Unmapped.AS_IS


_BOTH = frozenset({DOOR_OP, DOOR_PURE_CALLBACK})
_METHODS = {
    m.name: m
    for m in (
        VmapMethod("sequential", walked=True, unmapped=Unmapped.AS_IS, doors=_BOTH),
        VmapMethod("expand_dims", walked=False, unmapped=Unmapped.SIZE_ONE, doors=_BOTH),
        VmapMethod("broadcast_all", walked=False, unmapped=Unmapped.BROADCAST, doors=_BOTH),
        # the callback broadcasts unmapped inputs itself (jax.pure_callback's deprecated default)
        VmapMethod("legacy_vectorized", walked=False, unmapped=Unmapped.AS_IS, doors=frozenset({DOOR_PURE_CALLBACK})),
    )
}
# Other names of a method: jax.pure_callback's "sequential_unrolled" (unrolling the loop changes
# nothing a pure callback can see).
_OTHER_NAMES = {"sequential_unrolled": ("sequential", DOOR_PURE_CALLBACK)}
# jax.pure_callback's default: no method, vmap raises NotImplementedError (see _batching).
NO_METHOD = None


def accepted(door: str) -> tuple[str | None, ...]:
    """The values a front door takes for ``vmap_method``, in the table's order (None: no method)."""
    names = [m.name for m in _METHODS.values() if door in m.doors]
    for other, (name, other_door) in _OTHER_NAMES.items():
        if other_door == door:
            names.insert(names.index(name) + 1, other)
    return tuple(names) + ((NO_METHOD,) if door == DOOR_PURE_CALLBACK else ())


def named(name: str | None) -> str | None:
    """The name an op keeps for a value its front door took: another name of a method gives the method's own.

    Each front door checks the value against :func:`accepted` first, in its own words.
    """
    return _OTHER_NAMES.get(name, (name,))[0] if name is not None else None


def method_of(name: str | None) -> VmapMethod | None:
    """The method an op's ``vmap_method`` names, or None (an op that cannot be vmapped)."""
    return _METHODS[name] if name is not None else None

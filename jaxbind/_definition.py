"""Op definitions: the callbacks and abstracts a user binds, and the roles they play.

Every op is described by *families* of callbacks. Within a family the arrays
form *slots*: groups of arrays such that the family is linear in each slot (and
jointly linear within a slot). Each callback of a family computes one slot from
all the others; transposing it with respect to another slot gives that slot's
callback. This one picture covers every kind of op:

- a linear op ``y = f(fixed, x)``: slots ``[x (all linear args), y (outputs)]``,
  callbacks ``(f_T, f)``;
- a multilinear op ``y = f(fixed, a0, ..., an)``: slots ``[a0], ..., [an], [y]``,
  callbacks ``(f_T[0], ..., f_T[n], f)``;
- a nonlinear op: its forward ``f`` (family 0, not linear) and the linear family
  of its derivative at the primal point, slots ``[dx, dy]``, callbacks
  ``(f_vjp, f_jvp)``, with every primal as a fixed argument;
- a nonlinear op without derivatives: its forward family alone.

A nonlinear op with ``n_residuals=k`` computes, in its forward family, its
outputs followed by ``k`` residuals; the residuals join the primals as fixed
arrays of the derivative family, so the derivatives reuse what the forward
computed. Only the inexact (float, complex) outputs of any op have tangents and
cotangents: the derivative family's output slot holds those alone.

A :class:`Role` names one callback of one family, with the slot sizes it is
bound with; it is the static parameter the jaxbind primitive carries. What an
op is (:class:`OpKind`) and what a callback computes (:class:`CallbackKind`)
are enums; the rules decide by them, never by the text of a label.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import weakref
from collections.abc import Callable

import jax
import numpy as np

from ._native import NativeKernel


class _TextEnum(enum.StrEnum):
    """An enum whose members are their values as text.

    Compared with and formatted as that text (``enum.StrEnum``): ``definition.kind == "linear"``
    and ``f"{kind}"`` keep working for code written against strings.
    """

    def __repr__(self):  # shown where the string was, e.g. in check_op's OpCheck(kind=...)
        return repr(self.value)


class OpKind(_TextEnum):
    """What an op is; decides its entry role and how it is differentiated."""

    LINEAR = "linear"
    MULTILINEAR = "multilinear"
    NONLINEAR = "nonlinear"


class CallbackKind(enum.Enum):
    """What one callback of a family computes; the rules decide by this, labels are for messages."""

    FORWARD = "forward"  # the op's own function f
    TRANSPOSE = "transpose"  # f_T, or one of a multilinear op's f_T[i]
    JVP = "jvp"  # f_jvp of a nonlinear op
    VJP = "vjp"  # f_vjp of a nonlinear op


# Family 0 holds the op's own function f (computing the family's last slot);
# a nonlinear op's derivative family, slots [dx, dy], has f_vjp computing dx
# and f_jvp computing dy.
FORWARD_FAMILY, DERIVATIVE_FAMILY = 0, 1
TANGENT_IN_SLOT, TANGENT_OUT_SLOT = 0, 1


def name_of(fn) -> str:
    """How messages name a user's function: its ``__name__``, else its type's."""
    return getattr(fn, "__name__", None) or type(fn).__name__


@dataclasses.dataclass(frozen=True)
class Family:
    """Callbacks and abstracts by slot; ``linear`` says whether slots are linear.

    ``kinds`` say what each callback computes, which is what the rules go by;
    ``labels`` only name it in messages (``"transpose 1 callback"``).
    """

    callbacks: tuple[Callable, ...]
    abstracts: tuple[Callable, ...]
    kinds: tuple[CallbackKind, ...]
    labels: tuple[str, ...]  # what each callback is, for messages only
    linear: bool


@dataclasses.dataclass(frozen=True)
class JaxCallback:
    """What makes an op behave as a JAX callback (``jaxbind.pure_callback``'s ops), declared in one place.

    Such an op is placed in a sharded program as JAX places its own callbacks
    (on ``sharding``'s device, else the program's first; on every device inside
    ``shard_map``), refuses every derivative in ``jax.pure_callback``'s words,
    vmaps only with a method (``vmap_method=None`` raises JAX's
    ``NotImplementedError``), and is never exported. Room for JAX's other
    callback semantics (``io_callback``'s ordered effects) when an op needs them.
    """

    sharding: object | None = None  # a jax.sharding.Sharding pinning the call to one device, or None


def dtype_name(dtype) -> str:
    """A dtype's name in messages and descriptions (``float0``'s, not its record layout)."""
    dtype = np.dtype(dtype)
    return "float0" if dtype == jax.dtypes.float0 else dtype.name


@dataclasses.dataclass(frozen=True, eq=False)
class OpDef:
    """Everything the user passed when creating an op, and this process's state of the op.

    Two definitions built from the same functions, flags and name are equal, so
    ops share compiled code. The name is part of the key because errors and
    compiled programs carry it: an op must never run under another's name. The
    state (the op's index among the ops of its name, its call sites, the ops of
    its ``func_can_batch`` variants) plays no part in equality.
    """

    kind: OpKind
    name: str
    families: tuple[Family, ...]
    first_n_args_fixed: int
    func_can_batch: bool
    vmap_method: str = "sequential"  # how vmap hands a batch to the callbacks: a name in _vmap_methods' table
    n_residuals: int = 0  # arrays f writes after its outputs, for the derivatives only
    thread_safe: bool = False  # Python callbacks may run on several threads at once (walks spread)
    # An op that behaves as a JAX callback (jaxbind.pure_callback's), or None for every other op.
    jax_callback: JaxCallback | None = None
    # ((output, argument), ...): forward outputs that are arguments updated in place (see _lowering)
    inplace: tuple[tuple[int, int], ...] = ()
    # setup=: the state its Python callbacks share, or None. A _state.Setup (which keeps the states);
    # not named here, since _state sits above this module (it reads OpKind).
    setup: object | None = None
    # Side effects (see _effects): None (pure), "io" (never dropped or merged) or "ordered" (also in
    # program order). An op with one runs one call at a time unless thread_safe.
    effect: str | None = None
    # The lock every call of the op holds (a _trampoline.Exclusive), for an op with an effect that is
    # not thread_safe; None otherwise. Not part of equality: state, shared by the op's variants.
    exclusive: object | None = None

    # This process's state of the op, kept with the definition (it dies with it). Not part of
    # equality, not copied by dataclasses.replace (a variant is another op); set by the methods below.
    _hash: int = dataclasses.field(init=False, repr=False)  # parameters are hashed often while tracing
    _index: int | None = dataclasses.field(default=None, init=False, repr=False)  # see take_index
    # (role, kwargs, batch, padded, avals) -> SiteHandle, while a program holds it (see _sites)
    _sites: weakref.WeakValueDictionary | None = dataclasses.field(default=None, init=False, repr=False)
    # key -> SiteHandle made for a program's key, the newest last (see keep_resolved)
    _resolved: collections.OrderedDict | None = dataclasses.field(default=None, init=False, repr=False)
    _ops: dict = dataclasses.field(default_factory=dict, init=False, repr=False)  # func_can_batch -> Op

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash(self._key()))

    def _key(self):
        return (
            self.kind,
            self.name,
            self.families,
            self.first_n_args_fixed,
            self.func_can_batch,
            self.vmap_method,
            self.n_residuals,
            self.thread_safe,
            self.jax_callback,
            self.inplace,
            self.setup,
            self.effect,
        )

    def __eq__(self, other):
        return isinstance(other, OpDef) and (self is other or self._key() == other._key())

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return self.name

    # -- this process's state of the op ---------------------------------------

    def op_with(self, func_can_batch: bool, make: Callable):
        """The op of this definition, or of its variant with another ``func_can_batch`` (``Op.of``):
        ``make(definition)`` once per flag, then kept here."""
        op = self._ops.get(func_can_batch)
        if op is None:
            variant = self
            if func_can_batch != self.func_can_batch:
                variant = dataclasses.replace(self, func_can_batch=func_can_batch)
            # (two threads may both make it: every caller gets the one kept)
            op = self._ops.setdefault(func_can_batch, make(variant))
        return op

    @property
    def index(self) -> int | None:
        """The op's place among this process's ops of its name (``_sites``); None until it has one."""
        return self._index

    def take_index(self, index: int) -> None:
        """Give the op its index (once, by ``_sites.register_definition``) and its tables of call sites."""
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_sites", weakref.WeakValueDictionary())
        object.__setattr__(self, "_resolved", collections.OrderedDict())

    def site(self, memo_key):
        """The handle of the op's live call site for ``memo_key`` (``_sites.site_for``), or None."""
        return self._sites.get(memo_key)

    def keep_site(self, memo_key, handle) -> None:
        """Find ``handle`` again by ``memo_key`` while a program holds it (weakly: it goes with them)."""
        self._sites[memo_key] = handle

    def keep_resolved(self, key: int, handle, limit: int) -> None:
        """Hold a site made anew for a program's key; past ``limit`` the oldest goes (made again if called)."""
        resolved = self._resolved
        resolved[key] = handle
        resolved.move_to_end(key)
        while len(resolved) > limit:
            resolved.popitem(last=False)

    # -- what the op is -------------------------------------------------------

    @property
    def has_native(self) -> bool:
        """Whether any callback is a native kernel (which limits the kwargs)."""
        return any(isinstance(cb, NativeKernel) for family in self.families for cb in family.callbacks)

    @property
    def has_derivatives(self) -> bool:
        """False for a nonlinear op made with ``f_derivative=None``, and for an op with an effect."""
        if self.effect is not None:
            return False
        return self.kind is not OpKind.NONLINEAR or len(self.families) > 1

    def no_derivatives_error(self, requested: str) -> ValueError:
        """The error for differentiating an op made without derivatives."""
        what = "transpose" if "transpose" in requested else "JVP"
        if self.jax_callback is not None and self.effect is not None:  # jax.io_callback's words
            return ValueError(f"IO callbacks do not support {what}. (jaxbind op '{self.name}')")
        if self.effect is not None:
            return ValueError(
                f"jaxbind op '{self.name}' has effect={self.effect!r} and so no derivatives: JAX asked for "
                f"{requested}. Each call of a stateful op changes its state, so a derivative that called it "
                "again would see another one. Differentiate in JAX if the op's outputs have a derivative "
                "(jax.custom_vjp around the op, with rules of your own; JAX allows effects there from "
                "0.12), or hold its inputs constant with jax.lax.stop_gradient."
            )
        if self.jax_callback is not None:  # jax.pure_callback's words, which code may test for
            rule = "jax.custom_vjp" if what == "transpose" else "jax.custom_jvp"
            return ValueError(
                f"Pure callbacks do not support {what}. Please use `{rule}` to use callbacks while "
                f"taking gradients. (jaxbind op '{self.name}')"
            )
        return ValueError(
            f"jaxbind op '{self.name}' was made without derivatives (f_derivative=None) and "
            f"cannot be differentiated: JAX asked for {requested}. Give it derivatives in JAX: "
            "wrap the op in jax.custom_jvp or jax.custom_vjp with rules written in jax.numpy (call the wrapped "
            "function itself for the primal output to get higher orders), or, for a solver, use "
            "it as the solve of jax.lax.custom_root (implicit differentiation); or make the op "
            "with f_derivative=(f_jvp, f_vjp). Arguments the derivative does not depend on can "
            "be held constant with jax.lax.stop_gradient."
        )

    @property
    def n_linear_args(self) -> int | None:
        """The number of multilinear arguments, fixed by the transposes given."""
        if self.kind is OpKind.MULTILINEAR:
            return len(self.families[0].callbacks) - 1
        return None


@dataclasses.dataclass(frozen=True)
class Role:
    """One callback of one family of an op, as bound in a program.

    Inputs of the callback are the ``n_fixed`` fixed arrays followed by the
    arrays of every slot except ``slot``, in slot order; ``in_sizes`` gives those
    slots' sizes. Its outputs are the arrays of slot ``slot``.
    """

    op: OpDef
    family: int
    slot: int
    n_fixed: int
    in_sizes: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.op, self.family, self.slot, self.n_fixed, self.in_sizes)))

    def __hash__(self):
        return self._hash

    @classmethod
    def forward(cls, op: OpDef, n_args: int) -> Role:
        """The op's own function ``f`` called with ``n_args`` arrays (a count the op checked)."""
        n_fixed = op.first_n_args_fixed
        if op.kind is OpKind.LINEAR:
            in_sizes = (n_args - n_fixed,)
        elif op.kind is OpKind.MULTILINEAR:
            in_sizes = (1,) * op.n_linear_args
        else:
            in_sizes = ()
        return cls(op, FORWARD_FAMILY, slot=len(in_sizes), n_fixed=n_fixed, in_sizes=in_sizes)

    @classmethod
    def jvp(cls, op: OpDef, n_primals: int) -> Role:
        """The jvp callback of nonlinear ``op`` called with ``n_primals`` arrays.

        Its fixed arrays are the primals and the residuals; its one input slot
        the tangents of the differentiable arguments.
        """
        return cls(
            op,
            DERIVATIVE_FAMILY,
            slot=TANGENT_OUT_SLOT,
            n_fixed=n_primals + op.n_residuals,
            in_sizes=(n_primals - op.first_n_args_fixed,),
        )

    @property
    def callback_kind(self) -> CallbackKind:
        return self.op.families[self.family].kinds[self.slot]

    @property
    def callback(self):
        return self.op.families[self.family].callbacks[self.slot]

    @property
    def abstract(self):
        return self.op.families[self.family].abstracts[self.slot]

    @property
    def linear(self) -> bool:
        return self.op.families[self.family].linear

    @property
    def label(self) -> str:
        """e.g. ``op 'scale'`` or ``op 'scale' (transpose callback 'scale_T')``."""
        if self.callback_kind is CallbackKind.FORWARD:
            return f"op '{self.op.name}'"
        return f"op '{self.op.name}' ({self.what} '{name_of(self.callback)}')"

    @property
    def what(self) -> str:
        """What the callback is, in words (``"transpose callback"``), for messages."""
        return self.op.families[self.family].labels[self.slot]

    @property
    def inplace_pairs(self) -> tuple[tuple[int, int], ...]:
        """(output, argument) pairs this call updates in place: the op's ``inplace``, forward calls only."""
        return self.op.inplace if self.callback_kind is CallbackKind.FORWARD else ()

    @property
    def is_jvp(self) -> bool:
        """Whether this is the jvp callback of a nonlinear op."""
        return self.callback_kind is CallbackKind.JVP

    @property
    def is_derivative(self) -> bool:
        """Whether this is the jvp or vjp callback of a nonlinear op (not differentiable again)."""
        return self.callback_kind in (CallbackKind.JVP, CallbackKind.VJP)

    @property
    def declares_residuals(self) -> bool:
        """Whether the abstract this role calls declares the op's residuals after its outputs."""
        return self.op.n_residuals > 0 and (
            self.is_jvp or (self.callback_kind is CallbackKind.FORWARD and self.op.kind is OpKind.NONLINEAR)
        )

    def abstract_inputs(self, items):
        """The part of this role's inputs (arrays, structs or batch axes) its abstract is called with.

        With residuals the jvp callback's inputs are ``(*primals, *residuals,
        *tangents)``, and its outputs (the output tangents) are described by the
        op's abstract called with the fixed primals and the tangents, which have
        the shapes and dtypes of the primals they stand for. The tangents, not
        the primals, carry the batch layout of ``jacfwd`` (a vmap over
        tangents at a fixed primal point).
        """
        if self.is_jvp and self.op.n_residuals:
            return items[: self.op.first_n_args_fixed] + items[self.n_fixed :]
        return items

    @property
    def n_slots(self) -> int:
        return len(self.in_sizes) + 1

    def slot_sizes(self, n_out: int) -> tuple[int, ...]:
        """Sizes of all slots, given how many outputs (this role's slot) there are."""
        sizes = list(self.in_sizes)
        sizes.insert(self.slot, n_out)
        return tuple(sizes)

    def input_groups(self):
        """``(slot, start, stop)`` of each input slot within the argument list."""
        groups, start, others = [], self.n_fixed, [s for s in range(self.n_slots) if s != self.slot]
        for slot, size in zip(others, self.in_sizes):
            groups.append((slot, start, start + size))
            start += size
        return groups

    def regroup(self, new_slot: int, fixed, inputs, outputs) -> list:
        """Inputs of ``self.with_slot(new_slot)``, given per-array items of this role.

        Items may be arrays, batch masks or batch axes: the arrays of slot
        ``self.slot`` (``outputs``) take their place among the slots, and the
        arrays of ``new_slot`` drop out.
        """
        by_slot = {self.slot: list(outputs)}
        for slot, start, stop in self.input_groups():
            by_slot[slot] = list(inputs[start - self.n_fixed : stop - self.n_fixed])
        regrouped = list(fixed)
        for slot in range(self.n_slots):
            if slot != new_slot:
                regrouped += by_slot[slot]
        return regrouped

    def with_slot(self, slot: int, n_out: int) -> Role:
        """The role of the same family that computes ``slot`` (the transpose)."""
        sizes = self.slot_sizes(n_out)
        return dataclasses.replace(self, slot=slot, in_sizes=tuple(s for i, s in enumerate(sizes) if i != slot))

    def __repr__(self):
        return self.label.replace("op ", "", 1)

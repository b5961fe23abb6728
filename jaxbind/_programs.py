"""Programs made elsewhere: what a compiled program's call of a site is allowed to run.

The compiled core asks this module twice about a program it did not make with a
live site of this process: once per compiled program, whether its call may run
at all (:func:`check_program`: a live site answers only its own description, and
a key must be its description's digest), and on the first call of a key with no
live site, to make that site from the description (:func:`resolve`), if and only
if this process defines the op it names, with the structure it names. A
program is untrusted input: it runs only what its description says, its kwargs
are read as plain data unless this process wrote them, and every refusal names
the op and says what to do.
"""

from __future__ import annotations

import base64
import json

import numpy as np

from . import _sites, _trampoline
from ._batch_types import SelfBatch, WalkBatch, as_batch, batch_from_description
from ._definition import OpDef, Role, dtype_name
from ._errors import JaxbindError
from ._kwargs import Kwargs
from ._sites import SCHEMA, SiteHandle
from ._user_abstract import check_input_dtypes

__all__ = ["check_avals", "check_program", "resolve"]


def check_program(key: int, text: str) -> None:
    """Accept a compiled program's call (its site key and description), or raise why not.

    Called by the compiled core once per compiled program (XLA's instantiate
    stage: a program compiled here, loaded from the persistent cache or
    deserialized), when the key's live site, if any, has another description
    than the program's. A program runs only what its description says: a live
    site is reused only for its own description, and a key without one must be
    the description's own digest, so that no site registered later under that
    key can answer a program that describes something else.
    """
    description = _read(text)
    name = _shown(description["op"])
    handle = _sites.live_site(key)
    if handle is not None and handle.description != text:
        raise JaxbindError(
            f"jaxbind op '{name}': the program names call site {key:#x}, which in this process "
            f"belongs to {_owner_of(handle)} with another description: the program was altered "
            "(a site key copied into a call that describes something else) and is refused. "
            "Export the program again (jaxbind.export) from where it was made."
        )
    if _sites.key_of(text) != key:
        raise JaxbindError(
            f"jaxbind op '{name}': the program's call-site key does not match its description: the program was altered."
        )


def _owner_of(handle: SiteHandle) -> str:
    try:
        return f"op '{_shown(json.loads(handle.description)['op'])}'"
    except (ValueError, KeyError, TypeError):
        return "another op"


def _shown(name) -> str:
    """An op name from a program, as messages show it (a forged one may be anything, of any length)."""
    text = name if isinstance(name, str) else repr(name)
    return text if len(text) <= 120 else text[:117] + "..."


def resolve(key: int, text: str) -> None:
    """Make this process's site for a key a program names, or raise why it cannot.

    Called by the compiled core (under the GIL, from the thread running the
    program) when it has no live site for ``key``.
    """
    description = _read(text)
    name = description["op"]
    label = f"op '{_shown(name)}'"
    if _sites.key_of(text) != key:
        raise JaxbindError(
            f"jaxbind {label}: the program's call-site key does not match its description: the program was altered."
        )
    definition = _find_definition(name, description)
    # The description is this process's own when it is the one it registered this key for: its
    # kwargs' bytes are then read as the op wrote them, else as plain data only.
    ours = _sites.made_here(key, text)
    if definition.jax_callback is not None and not ours:
        raise JaxbindError(
            f"jaxbind {label}: the program calls a function given to jaxbind.pure_callback, which "
            "a program made elsewhere may not run (it would run that function, found by its name, on "
            "inputs of the program's choosing; jaxbind.export refuses such programs the same way). "
            "Bind the function as an op (jaxbind.get_nonlinear_call(..., name=...)), define it here "
            "and export the program again."
        )
    here = _sites.structure(definition)
    if description.get("def") != here:
        raise JaxbindError(
            f"jaxbind {label}: the program was made with a different op of this name: "
            f"{_differing_fields(description.get('def'), here)}. "
            "Define the op here as it was defined where the program was made."
        )
    role, batch, padded, avals_in, avals_out = _call_of(description, definition, label)
    try:
        dump = base64.b64decode(description["kwargs"], validate=True)
    except ValueError:
        raise JaxbindError(f"jaxbind {label}: the program's kwargs are not base64: was it altered?") from None
    kwargs = Kwargs.from_program(dump, _shown(name), ours)
    if not ours:  # (this process's own description: its avals are what the op's abstract gave here)
        check_avals(role, batch, avals_in, avals_out, kwargs)
    try:
        _sites.site_from_program(role, kwargs, batch, avals_in, avals_out, padded, key, text)
    except (TypeError, ValueError) as err:  # a layout the compiled core refuses
        raise JaxbindError(
            f"jaxbind {label}: the program's description of the call is not valid ({err}); was the program altered?"
        ) from None


def _differing_fields(theirs, structure: dict) -> str:
    """The fields in which a program's op structure differs from this process's, each side shown."""
    if not isinstance(theirs, dict):
        return f"its structure is {theirs!r:.80}, not a mapping of fields"
    absent = object()

    def shown(value) -> str:
        return "absent" if value is absent else f"{value!r:.80}"

    fields = list(structure) + sorted(str(f) for f in theirs if f not in structure)
    return ", ".join(
        f"{field} ({shown(theirs.get(field, absent))} there, {shown(structure.get(field, absent))} here)"
        for field in fields
        if theirs.get(field, absent) != structure.get(field, absent)
    )


def _call_of(description: dict, definition: OpDef, label: str):
    """The role, batch, padding and avals a description gives, checked against the op."""
    try:
        family, slot, n_fixed, in_sizes = description["role"]
        if not all(isinstance(v, int) for v in (family, slot, n_fixed, *in_sizes)):
            raise TypeError("the role's numbers are not integers")
        if not (0 <= family < len(definition.families) and 0 <= slot < len(definition.families[family].callbacks)):
            raise ValueError("no such callback")
        role = Role(definition, family, slot, n_fixed, tuple(in_sizes))
        batch = batch_from_description(description["batch"])
        padded = description["padded"]
        if not isinstance(padded, bool):
            raise TypeError("'padded' is not true or false")
        if padded and (batch is None or not batch.partitionable_levels()):
            raise ValueError("a padded call has no batch that XLA may split")
        avals_in, avals_out = _sites.avals_of(description["in"]), _sites.avals_of(description["out"])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        raise JaxbindError(
            f"jaxbind {label}: the program's description of the call is not valid ({err}); was the program altered?"
        ) from None
    return role, batch, padded, avals_in, avals_out


def _typed(avals) -> str:
    """Avals as messages show them (a forged description's may be many: cut at 200 characters)."""
    text = ", ".join(f"{dtype_name(a.dtype)}{list(a.shape)}" for a in avals[:20]) or "none"
    return text if len(text) <= 200 and len(avals) <= 20 else text[:197] + "..."


def check_avals(role: Role, batch, avals_in, avals_out, kwargs: Kwargs) -> None:
    """Refuse a program's call whose output avals are not what the op's abstract gives for its inputs.

    The abstract runs as the op's abstract evaluation runs it (``output_shapes``
    of the call's batch kind: the whole batch of a walk, the ``batch_axes`` of a
    self-batched call), on the description's input avals and kwargs. What the
    compiled core then checks at each call is that XLA's buffers are these
    avals (the buffer types ``_sites`` registers with the site): no kernel or callback sees other buffers.
    """
    kind = as_batch(batch)
    n = len(avals_in)
    if isinstance(kind, WalkBatch) and (
        len(kind.masks) != n or any(a.ndim < kind.batch_dims(role, m) for a, m in zip(avals_in, kind.masks))
    ):
        layout = "batch masks" if len(kind.masks) != n else "batch levels"
        raise JaxbindError(
            f"jaxbind {role.label}: the program's description gives {n} input(s) ({_typed(avals_in)}) "
            f"and {layout} that do not fit them: the program was altered and is refused."
        )
    if isinstance(kind, SelfBatch) and len(kind.in_axes) != n:
        raise JaxbindError(
            f"jaxbind {role.label}: the program's description gives {n} input(s) and batch axes for "
            f"{len(kind.in_axes)}: the program was altered and is refused."
        )
    try:
        check_input_dtypes(role, avals_in)
        expected = kind.output_shapes(role, avals_in, kwargs)
    except Exception as err:  # the op's own abstract (user code) refuses the program's inputs
        raise JaxbindError(
            f"jaxbind {role.label}: the program calls it on {_typed(avals_in)}, which the op here "
            f"refuses ({str(err)[:300]}): the program was made with another op of this name, or "
            "altered, and is refused. Define the op here as where the program was made."
        ) from None
    if len(expected) != len(avals_out):
        raise JaxbindError(
            f"jaxbind {role.label}: the program expects {len(avals_out)} output(s) ({_typed(avals_out)}), "
            f"but the op's abstract gives {len(expected)} for inputs {_typed(avals_in)}: the program was "
            "made with another op of this name, or altered, and is refused. Define the op here as "
            "where the program was made."
        )
    for k, ((shape, dtype), aval) in enumerate(zip(expected, avals_out)):
        if tuple(shape) != tuple(aval.shape) or np.dtype(dtype) != np.dtype(aval.dtype):
            raise JaxbindError(
                f"jaxbind {role.label}: the program expects output {k} as "
                f"{dtype_name(aval.dtype)}{list(aval.shape)}, but the op's abstract gives "
                f"{dtype_name(dtype)}{list(shape)} for inputs {_typed(avals_in)} and the program's "
                "kwargs: the program was made with another op of this name (another abstract), or "
                "altered, and is refused before anything runs. Define the op here as where the "
                "program was made, or export the program again."
            )


def _read(text: str) -> dict:
    try:
        description = json.loads(text)
        if not isinstance(description, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError):
        raise JaxbindError(
            "jaxbind: the program names a jaxbind call site whose description is not readable: "
            "the program was altered or made by an unknown tool."
        ) from None
    name = description.get("op")
    if not isinstance(name, str) or not isinstance(description.get("kwargs"), str):
        raise JaxbindError("jaxbind: the program's description of a call names no op: was it altered?")
    schema = description.get("schema")
    if schema != SCHEMA:
        raise JaxbindError(
            f"jaxbind op '{_shown(name)}': the program was made by a jaxbind whose call-site schema is "
            f"{schema!r:.40}; this jaxbind reads schema {SCHEMA}. Run it with the jaxbind version that "
            "made it, or make (export) the program again with this one."
        )
    return description


def _find_definition(name: str, description: dict) -> OpDef:
    live = _sites.definitions_named(name)
    index = description.get("index")
    if index is not None:  # made by a lowering in a process like this one
        matches = [d for d, i in live if i == index]
    else:
        matches = [d for d, _ in live]
    if len(matches) == 1:
        return matches[0]
    shown = _shown(name)
    if not matches:
        raise JaxbindError(
            f"jaxbind op '{shown}': the program calls op '{shown}', which this process does not "
            f"define (now): define it (jaxbind.get_linear_call / get_nonlinear_call with "
            f"name='{shown}', as where the program was made) before calling the program. (An op "
            "made inside a function given to a temporary jax.jit can be gone before XLA runs the "
            "program it queued: make ops once, outside the functions you jit.)"
        )
    raise JaxbindError(
        f"jaxbind op '{shown}': the program calls op '{shown}', and this process defines "
        f"{len(matches)} different ops of that name, so it cannot tell which: give them distinct "
        "name=... values."
    )


_trampoline.set_resolver(resolve, check_program)

"""Call sites: what a compiled program names, how a process finds its own, and how long they live.

A *call site* is one custom call's target in this process: an op's callback in
one role, with its kwargs and batch layout. A compiled program names it by a
**key**, a 63-bit digest of the call's **description** (the JSON text below),
and carries the description beside it. Neither depends on where anything sits
in this process, so the same script lowers to the same program in every run
(JAX's persistent compilation cache hits) and a serialized program
(``jax.export``) says which op it calls.

The description holds the op's name, its structure (kind, fixed arguments,
flags, callbacks per family), the role (family, slot, slot sizes), the batch
layout, the avals, the kwargs' bytes and the schema version; ops that share a
name in one process get ``index`` 0, 1, ... in the order they were defined
(equal definitions share one). Two different sites of one process therefore
never share a description, and keys are digests of descriptions: a collision
(two descriptions, one key, chance 2**-63 per pair) is refused when the second
registers, never run. Programs made for ``jax.export`` leave the index out:
another process resolves them by the op's name, which must then be unique.

The handler looks a key up in the compiled core's table; a key it has no live
site for (a program made elsewhere, or whose op was freed) reaches
``_programs.resolve``, which makes the site from the description if, and only if,
this process defines that op now. Nothing else can be called: a program names
ops, never addresses or callables, and kwargs from a program are read by a
loader that builds only plain data.

A site lives as long as its :class:`SiteHandle`, which every compiled program
that names it holds (the lowering adds the handle to the executable's
keepalives); the op's definition finds its sites weakly, so a long-lived op
called with ever new kwargs keeps no site of a program that is gone. When the
last holder goes, the handle releases the site, and with it the kwargs' bytes.
JAX may still run a program after it dropped the Python half that holds the
keepalives (an executable in flight, or one its C++ dispatch cache still
holds): a dispatch running then finishes with the references the release
hands it, and a later call of the released key makes the site anew from the
call's description, through ``_programs.resolve``, like a program made elsewhere.
A handle that is going is found nowhere from the moment it starts to go (see
:class:`SiteHandle`); if its key is registered again before its release has
run, the new site takes the key over and the old one is released as usual.
For a key this process made, the description's kwargs are bytes this process
wrote (the key is their digest), so they are read as the op wrote them; the
definition keeps the last :data:`RESOLVED_KEPT` sites made so.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import os
import threading
import weakref

import jax
import numpy as np

from . import _trampoline
from ._batch_types import as_batch
from ._definition import OpDef, Role, dtype_name
from ._dtypes import SUPPORTED_DTYPES
from ._errors import JaxbindError
from ._kwargs import Kwargs
from ._native import NativeKernel
from ._native_kwargs import kernel_kwargs
from ._state import setup_inputs

__all__ = [
    "RESOLVED_KEPT",
    "SCHEMA",
    "SiteHandle",
    "avals_of",
    "definitions_named",
    "key_of",
    "live_site",
    "made_here",
    "register_definition",
    "site_for",
    "site_from_program",
    "structure",
]

SCHEMA = 1  # of the description; a program with another is refused, never guessed at

_lock = threading.RLock()  # lowering (a Python thread) and resolve (XLA's) both register
_live: weakref.WeakValueDictionary[int, SiteHandle] = weakref.WeakValueDictionary()
_names: dict = {}  # op name -> _Name
# key -> the keyed digest of the description this process registered under it from its own
# lowering. Its kwargs' bytes are this process's own exactly when a program's description has
# that digest: the key alone is a digest anyone can compute, this one needs the process's secret.
_made_here: dict = {}
_SECRET = os.urandom(32)
RESOLVED_KEPT = 64  # sites a definition keeps that were made anew for a program's key


class SiteHandle:
    """Owns one registered call site; the site is released when the handle goes.

    Holds what the compiled core borrows (the callback, the kwargs' bytes), so
    that the garbage collector sees them: a cycle through a callback is
    collected like any other.

    The release is a weak reference's callback (:data:`_owners`), not a
    ``__del__``: CPython clears every weak reference to an object before it
    runs any of their callbacks, so no thread can find a handle (in
    :data:`_live` or an op's table) whose site is being released. A
    ``__del__`` runs while those references still answer, and another thread
    that took the GIL in between got the dying handle back, kept it alive, and
    its program then named a released site for good.
    """

    __slots__ = ("serial", "key", "description", "callback", "kwargs_dump", "__weakref__")

    def __init__(self, serial, key, description, callback, kwargs_dump):
        self.serial, self.key, self.description = serial, key, description
        self.callback, self.kwargs_dump = callback, kwargs_dump

    def __repr__(self):
        return f"<jaxbind call site {self.key:#x} #{self.serial}>"


_release = _trampoline.release_site
_owners: dict = {}  # serial -> the weak reference whose callback releases that site


def _handle_gone(serial: int, _ref) -> None:
    release, owners = _release, _owners
    if release is None or owners is None:  # the module is torn down at exit
        return
    owners.pop(serial, None)
    release(serial)


class _Name:
    """The ops of this process that have one name: (weak definition, index) pairs.

    Equal definitions (an op defined again, as a notebook cell run twice) share
    an index and are each listed, so that the name finds the op while any of
    them lives.
    """

    __slots__ = ("next_index", "defs")

    def __init__(self):
        self.next_index, self.defs = 0, []

    def live(self):
        """The live (definition, index) pairs, one per index (equal definitions are one op)."""
        self.defs = [(ref, i) for ref, i in self.defs if ref() is not None]
        pairs, seen = [], set()
        for ref, index in self.defs:
            definition = ref()
            if definition is not None and index not in seen:
                seen.add(index)
                pairs.append((definition, index))
        return pairs


def register_definition(definition: OpDef) -> None:
    """Give a new op its index among the ops of its name (equal definitions share one)."""
    if definition.index is not None:
        return
    with _lock:
        name = _names.setdefault(definition.name, _Name())
        for other, index in name.live():  # noqa: B007  (an equal op found: its index, read after the loop)
            if other == definition:
                break
        else:
            index, name.next_index = name.next_index, name.next_index + 1
        name.defs.append((weakref.ref(definition), index))
        definition.take_index(index)


def definitions_named(name: str) -> list:
    """The distinct live ops with this name: (a definition, its index) per index."""
    with _lock:
        entry = _names.get(name)
        return entry.live() if entry is not None else []


# ---------------------------------------------------------------------------
# Descriptions and keys
# ---------------------------------------------------------------------------


def structure(definition: OpDef) -> dict:
    """What must match between the op a program was made with and the one it runs."""
    structure = {
        "kind": str(definition.kind),
        "fixed": definition.first_n_args_fixed,
        "can_batch": definition.func_can_batch,
        "vmap_method": definition.vmap_method,
        "residuals": definition.n_residuals,
        "callbacks": [len(family.callbacks) for family in definition.families],
    }
    if definition.inplace:  # (only then: the descriptions, and so the keys, of other ops stay as they were)
        structure["inplace"] = [list(pair) for pair in definition.inplace]
    if definition.effect is not None:  # (likewise)
        structure["effect"] = definition.effect
    return structure


def _avals_json(avals):
    return [[list(a.shape), dtype_name(a.dtype)] for a in avals]


def _dtype_of(name: str):
    return jax.dtypes.float0 if name == "float0" else np.dtype(name)


def avals_of(pairs) -> tuple:
    """The avals a description lists as ``[[shape], dtype name]`` pairs (``describe``'s ``in``/``out``).

    Raises ``TypeError``/``ValueError`` for pairs that are not such (a forged description's).
    """
    return tuple(jax.core.ShapedArray(tuple(shape), _dtype_of(name)) for shape, name in pairs)


def key_of(text: str) -> int:
    """The key a program names a description by: 63 bits of its digest, never 0."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & (2**63 - 1)) or 1


def _secret_digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8"), key=_SECRET, digest_size=16).digest()


def describe(role: Role, kwargs: Kwargs, batch, avals_in, avals_out, padded: bool, exported: bool = False):
    """The description of a call (JSON text, deterministic) and its key.

    ``avals_in`` are the callback's inputs (not the validity operand).
    ``exported``: for a serialized program, which other processes resolve by
    the op's name alone (no index).
    """
    definition = role.op
    description = {
        "schema": SCHEMA,
        "op": definition.name,
        "def": structure(definition),
        "role": [role.family, role.slot, role.n_fixed, list(role.in_sizes)],
        "batch": as_batch(batch).description(),
        "padded": bool(padded),
        "in": _avals_json(avals_in),
        "out": _avals_json(avals_out),
        "kwargs": base64.b64encode(kwargs.dump).decode("ascii"),
    }
    if not exported:
        register_definition(definition)
        description["index"] = definition.index
    text = json.dumps(description, sort_keys=True, separators=(",", ":"))
    return text, key_of(text)


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def site_for(role: Role, kwargs: Kwargs, batch, avals_in, avals_out, padded: bool = False):
    """The handle of this process's site for a call, registered on first use.

    ``padded``: the call's last operand is the validity operand of a batch XLA
    may pad (see ``_lowering._validity``); the handler calls nothing for
    padding elements. Returns the handle (its ``description`` and ``key`` are
    what the custom call carries).
    """
    definition = role.op
    register_definition(definition)
    avals_in, avals_out = tuple(avals_in), tuple(avals_out)
    memo_key = (role, kwargs, batch, padded, avals_in, avals_out)
    handle = definition.site(memo_key)
    if handle is None:
        callee_in = avals_in[: len(avals_in) - padded]
        text, key = describe(role, kwargs, batch, callee_in, avals_out, padded)
        with _lock:
            handle = _live.get(key)
            if handle is None:
                handle = _register(role, kwargs, batch, callee_in, avals_out, padded, key, text)
                _made_here[key] = _secret_digest(text)
            elif handle.description != text:  # two descriptions, one digest: never run either
                raise JaxbindError(
                    f"jaxbind {role.label}: its call site's key collides with another site's "
                    "(a 2**-63 event); rename the op (name=...) to change its key."
                )
        definition.keep_site(memo_key, handle)
    return handle


# ---------------------------------------------------------------------------
# The registry's face for programs made elsewhere (``_programs``): lookups and the one
# registration a program may cause, each taking the registry's lock itself.
# ---------------------------------------------------------------------------


def live_site(key: int) -> SiteHandle | None:
    """The live site registered under ``key``, if any."""
    with _lock:
        return _live.get(key)


def made_here(key: int, text: str) -> bool:
    """Whether this process's own lowering registered ``key`` for exactly this description.

    Its kwargs' bytes are then ones this process wrote. The key alone proves
    nothing (anyone can compute a digest); the comparison is with a digest keyed
    by this process's secret.
    """
    with _lock:
        made = _made_here.get(key)
    return made is not None and hmac.compare_digest(made, _secret_digest(text))


def site_from_program(role: Role, kwargs: Kwargs, batch, avals_in, avals_out, padded, key, text) -> SiteHandle:
    """The live site for a program's key: the one registered under it, or one made now from its description.

    The caller has checked the description against the op. The op keeps the
    site among its last :data:`RESOLVED_KEPT` made so. Raises
    ``TypeError``/``ValueError`` for a layout the compiled core refuses.
    """
    with _lock:
        handle = _live.get(key)
        if handle is None:
            handle = _register(role, kwargs, batch, avals_in, avals_out, padded, key, text)
        role.op.keep_resolved(key, handle, RESOLVED_KEPT)
        return handle


def _register(role: Role, kwargs: Kwargs, batch, avals_in, avals_out, padded, key, text) -> SiteHandle:
    """Register a site in the compiled core (under ``_lock``)."""
    callback, can_batch, kind = role.callback, role.op.func_can_batch, as_batch(batch)
    batch_axes = kind.callback_batch_axes
    layout = kind.site_layout(role)
    valid_levels = batch.levels if padded else 0
    types = _buffer_types(role, batch, avals_in, avals_out, padded)
    # (an ordered op's calls pass tokens, which the core drops; an op with an effect holds its lock)
    effect = (role.op.effect == "ordered", role.op.exclusive)
    if isinstance(callback, NativeKernel):
        entries = kernel_kwargs(kwargs.values, role.label, batch_axes, len(avals_in), can_batch, callback)
        address = callback.address_for(avals_in, avals_out, kwargs.values)
        dump = b""
        serial = _trampoline.register_site(
            key, text, role.label, None, dump, *layout, address, entries, valid_levels, False, *effect, *types
        )
    else:
        dump = kwargs.with_values(batch_axes=batch_axes).dump if can_batch else kwargs.dump
        if role.op.setup is not None:  # called with the state of its leading inputs
            callback = role.op.setup.bind(callback, setup_inputs(role, len(avals_in)), can_batch)
        serial = _trampoline.register_site(
            key, text, role.label, callback, dump, *layout, 0, [], valid_levels, role.op.thread_safe, *effect, *types
        )
    handle = SiteHandle(serial, key, text, callback, dump)
    _owners[serial] = weakref.ref(handle, functools.partial(_handle_gone, serial))
    _live[key] = handle
    return handle


def partitioned_levels(role: Role, batch) -> int:
    """The leading dims of a call's arrays that XLA may split over devices (see ``_lowering``)."""
    jax_callback = role.op.jax_callback  # jaxbind.pure_callback's, pinned to a device: never split
    if jax_callback is not None and jax_callback.sharding is not None:
        return 0
    return as_batch(batch).partitionable_levels()


def _buffer_types(role: Role, batch, avals_in, avals_out, padded: bool):
    """What XLA must hand each call of a site: (types, inputs, outputs, free leading dims).

    ``types`` is flat: per buffer (the inputs, the validity operand of a padded
    batch, then the outputs) its XLA dtype code, rank and dims. The compiled
    core fails a call whose buffers differ (a program altered to describe
    other arrays than it passes); only the ``free`` leading dims, those XLA
    may split over devices, may be smaller, alike in every buffer.
    """
    free = partitioned_levels(role, batch)
    avals = list(avals_in)
    if padded:  # as _lowering._validity makes it
        shape = tuple(avals_out[0].shape[:free]) + (1,)
        avals.append(jax.core.ShapedArray(shape, np.int32 if max(shape) < 2**31 else np.int64))
    types = []
    for aval in (*avals, *avals_out):
        dtype = np.dtype(bool) if aval.dtype == jax.dtypes.float0 else np.dtype(aval.dtype)  # (XLA's PRED)
        code = SUPPORTED_DTYPES.get(dtype)
        if code is None:
            raise ValueError(f"dtype {dtype_name(aval.dtype)} cannot reach a callback")
        types += [code, len(aval.shape), *map(int, aval.shape)]
    return types, len(avals), len(avals_out), free


def check_exportable(role: Role) -> None:
    """A serialized program names ops by name: refuse one another process could not resolve."""
    name = role.op.name
    if role.op.jax_callback is not None:  # jaxbind.pure_callback's: a function, not an op
        raise NotImplementedError(
            f"jaxbind.export: the program calls {name}, and serialization of host_callbacks is not "
            "yet implemented (jax.export refuses jax.pure_callback the same way): a serialized "
            "program names ops, which the process that loads it defines. Bind the function as an "
            'op instead, jaxbind.get_nonlinear_call(f, None, abstract, None, name="...") (f '
            "writes its results into out; see the porting guide), and define that op by the same "
            "name where the program is loaded."
        )
    others = [d for d, _ in definitions_named(name)]
    if len(others) > 1:
        raise ValueError(
            f"jaxbind op '{name}': this process defines {len(others)} different ops named "
            f"'{name}', and a serialized program names its ops by name: give them distinct "
            "name=... (get_linear_call / get_nonlinear_call) before exporting."
        )

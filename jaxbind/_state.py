"""State an op's callbacks share (``setup=``): made once per distinct inputs and kwargs, kept in a bounded
cache that is never the owner of a result.

An op made with ``setup=S`` declares it: its definition's ``setup`` is a
:class:`Setup` (the function and the cache's size), which keeps one
:class:`StateCache` for all the op's callbacks. The callbacks stay the user's; a
call site binds each to the number of its leading inputs that setup takes (the
primals of a nonlinear op, the fixed arguments of a linear one:
:func:`setup_inputs`). A call
finds the state made for those inputs' exact bytes and the call's kwargs, or
makes it with ``S(inputs, kwargs)``, and calls ``callback(out, args,
kwargs_dump, state)``. A state that is gone (evicted, another process, an op
made again) is made again: every value is computed from the call's own inputs,
so it is the same.
"""

from __future__ import annotations

import collections
import pickle
import threading
import time
from collections.abc import Callable

import numpy as np

from . import _trampoline
from ._definition import OpKind, name_of
from ._errors import JaxbindError

__all__ = ["DEFAULT_SETUP_CACHE", "Setup", "SetupError", "StateCache", "read_only", "setup_inputs", "state_cache"]

# States an op keeps unless told otherwise: one input at a time needs one (the forward and its
# derivatives share it); a vmapped gradient over B distinct inputs needs B (the forward walk makes
# them, the vjp walk finds them); a state may be large (a factorization), so not many more.
DEFAULT_SETUP_CACHE = 8

# A call that needs a state another thread's setup is making waits for it in slices of _WAIT_SLICE s. After
# each it reads that thread's CPU clock: a setup that used less than _BUSY of the slice is waiting on
# something (another thread, I/O, a program of JAX), perhaps on this very call, so the call makes the
# state itself rather than risk waiting for ever (a second run of setup: the same values). A setup that
# computes is waited for, _LONGEST_WAIT s at most (and _BLIND_WAIT s where no thread has a CPU clock).
_WAIT_SLICE = 0.25
_BUSY = 0.05
_LONGEST_WAIT = 600.0
_BLIND_WAIT = 5.0


class SetupError(JaxbindError):
    """An op's ``setup`` raised (``__cause__``); the call's error names the op, its callback and setup."""


class _Making:
    """A setup running: on which thread, its CPU clock (or None), and the event set when it ends."""

    __slots__ = ("thread", "clock", "event")

    def __init__(self, thread: int):
        self.thread, self.clock, self.event = thread, _own_cpu_clock(), threading.Event()


def _own_cpu_clock():
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError, OverflowError):  # (not every platform has per-thread clocks)
        return None


def _cpu_time(clock):
    """The CPU time of a thread by its clock, or None when that clock cannot be read (the thread ended)."""
    try:
        return time.clock_gettime(clock)
    except OSError:
        return None


def _wait_for(making: _Making) -> bool:
    """Wait for another thread's setup: True when it ended, False when it is idle or took too long."""
    used = _cpu_time(making.clock) if making.clock is not None else None
    waited = 0.0
    while not making.event.wait(_WAIT_SLICE):
        waited += _WAIT_SLICE
        if making.clock is None:
            if waited >= _BLIND_WAIT:
                return False
            continue
        now = _cpu_time(making.clock)
        if now is None or used is None:  # (its thread is gone: look again)
            return True
        if now - used < _BUSY * _WAIT_SLICE or waited >= _LONGEST_WAIT:
            return False
        used = now
    return True


class _Entry:
    __slots__ = ("inputs", "state")

    def __init__(self, inputs, state):
        self.inputs, self.state = inputs, state


class StateCache:
    """The states of one op: at most ``size``, least recently used first out, found by exact bytes."""

    def __init__(self, setup: Callable, size: int):
        self.setup, self.size = setup, size
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[tuple, list] = collections.OrderedDict()
        self._count = 0
        self._making: dict = {}  # key -> _Making: a setup running for that key
        self._kwargs: dict = {}  # (kwargs_dump, n, can_batch) -> (key bytes, kwargs for setup)
        self.setups = 0  # setups run (for tests and benchmarks)
        self.waits = 0  # calls that waited for another thread's setup (for tests)

    def __len__(self) -> int:
        return self._count

    def clear(self) -> None:
        """Drop every kept state (each is made again when a call needs it)."""
        with self._lock:
            self._entries.clear()
            self._count = 0

    def state_for(self, inputs: tuple, kwargs_dump: bytes, can_batch: bool):
        """The state made for ``inputs``' bytes and the kwargs, made now if none is kept.

        A setup running for the same key on another thread is waited for, unless it is idle (see
        _WAIT_SLICE): then, as on its own thread (a setup that calls its own op), the call makes its
        own, so a setup that waits on its op from another thread (a pool, a program of JAX run on
        XLA's threads) cannot deadlock.
        """
        kwargs_key, kwargs = self._kwargs_of(kwargs_dump, len(inputs), can_batch)
        key = (_trampoline.fingerprint(inputs), kwargs_key)
        me = threading.get_ident()
        mine = None
        while True:
            with self._lock:
                entry = self._find(key, inputs)
                if entry is not None:
                    return entry.state
                making = self._making.get(key)
                if making is None:
                    mine = self._making[key] = _Making(me)
                    break
                if making.thread == me:  # (a setup that calls its own op on the same inputs makes its own)
                    break
                self.waits += 1
            if not _wait_for(making):
                break  # (the setup it waited for is idle, maybe waiting on this call: made here too)
        try:
            copies = tuple(_kept_copy(a) for a in inputs)
            state = self._run_setup(copies, kwargs)
            with self._lock:
                kept = self._find(key, copies)  # (made meanwhile by the setup this call did not wait for)
                if kept is None:
                    self._keep(key, _Entry(copies, state))
            return state if kept is None else kept.state
        finally:
            if mine is not None:
                with self._lock:
                    if self._making.get(key) is mine:
                        del self._making[key]
                mine.event.set()

    def _find(self, key, inputs):
        entries = self._entries.get(key)
        if entries:
            for entry in entries:
                if _trampoline.same_bytes(entry.inputs, inputs):
                    self._entries.move_to_end(key)
                    return entry
        return None

    def _keep(self, key, entry) -> None:
        self._entries.setdefault(key, []).append(entry)
        self._entries.move_to_end(key)
        self._count += 1
        while self._count > self.size:
            oldest = next(iter(self._entries))
            entries = self._entries[oldest]
            entries.pop(0)
            if not entries:
                del self._entries[oldest]
            self._count -= 1

    def _run_setup(self, inputs, kwargs):
        self.setups += 1
        try:
            state = self.setup(inputs, dict(kwargs))
        except Exception as err:
            raise SetupError(f"its setup '{name_of(self.setup)}' raised {type(err).__name__}: {err}") from err
        return read_only(state)

    def _kwargs_of(self, kwargs_dump: bytes, n: int, can_batch: bool):
        """The kwargs' part of a state's key and the kwargs setup gets (read once per dump).

        With ``func_can_batch`` the dump holds the call's ``batch_axes``: setup gets, and the key
        holds, those of its own inputs only (the tangents' or cotangents' axes change nothing a
        state depends on).
        """
        memo = (kwargs_dump, n, can_batch)
        found = self._kwargs.get(memo)
        if found is None:
            kwargs = pickle.loads(kwargs_dump)
            key = kwargs_dump
            if can_batch:
                axes = kwargs.pop("batch_axes", None)
                kwargs["batch_axes"] = None if axes is None else tuple(axes[:n])
                key = pickle.dumps(sorted(kwargs.items()), protocol=pickle.HIGHEST_PROTOCOL)
            if len(self._kwargs) >= 256:  # (one entry per call site: bounded for long-lived ops)
                self._kwargs.clear()
            found = self._kwargs[memo] = (key, kwargs)
        return found


def _kept_copy(array: np.ndarray) -> np.ndarray:
    """A C-contiguous, read-only copy of an input: compared with later calls' inputs, and what setup
    gets (which it may keep, unlike the views a callback gets)."""
    copy = np.array(array, order="C", copy=True)
    copy.flags.writeable = False
    return copy


_READ_ONLY_NOTE = (
    "(The arrays of args, and the NumPy arrays in the state setup made, are read-only: one state serves "
    "every call on the same inputs and kwargs, so a callback that changed it would change later results. "
    "Write results into out only; keep scratch space in the callback.)"
)


def read_only(state, depth: int = 0):
    """The state callbacks get: a NumPy array in it (the state itself, or an item of its tuples, lists and
    dicts, 4 levels deep) as a read-only view. A callback that writes into one fails at once, naming the
    array, instead of changing what later calls compute (every call, the derivatives' too, shares it, and
    a state made again after an eviction would not hold the change). The setup's own arrays stay as they
    were; other objects (a factorization, a plan) are the callbacks' to leave alone (check_op checks it).
    """
    kind = type(state)
    if kind is np.ndarray:
        if not state.flags.writeable:
            return state
        view = state.view()
        view.flags.writeable = False
        return view
    if depth >= 4 or kind not in (tuple, list, dict):
        return state
    if kind is dict:
        items = {k: read_only(v, depth + 1) for k, v in state.items()}
        return state if all(items[k] is v for k, v in state.items()) else items
    items = [read_only(v, depth + 1) for v in state]
    if all(a is b for a, b in zip(items, state)):
        return state
    return items if kind is list else tuple(items)


class Setup:
    """An op's ``setup=`` as its definition declares it: the function and the size of its cache of states.

    Equal for the same function and size (so that equal ops stay equal and share
    compiled code); the cache is this declaration's, and so the op's.
    :meth:`bind` gives the callable a call site registers for one of the op's
    Python callbacks.
    """

    __slots__ = ("function", "size", "cache")

    def __init__(self, function: Callable, size: int):
        self.function, self.size = function, size
        self.cache = StateCache(function, size)

    def __eq__(self, other):
        return type(other) is Setup and (self.function, self.size) == (other.function, other.size)

    def __hash__(self):
        return hash((self.function, self.size))

    def __repr__(self):
        return f"<setup {name_of(self.function)}, {self.size} state(s) kept>"

    def bind(self, callback: Callable, n_inputs: int, can_batch: bool) -> Callable:
        """The callable ``(out, args, kwargs_dump)`` a call site runs for ``callback``: it calls
        ``callback(out, args, kwargs_dump, state)`` with the state setup makes of ``args[:n_inputs]``."""
        state_for = self.cache.state_for

        def call_with_state(out, args, kwargs_dump):
            state = state_for(args[:n_inputs], kwargs_dump, can_batch)
            try:
                callback(out, args, kwargs_dump, state)
            except ValueError as err:  # (NumPy's "assignment destination is read-only", "output array is ...")
                if "read-only" in str(err):
                    err.add_note(_READ_ONLY_NOTE)
                raise

        call_with_state.__name__ = name_of(callback)
        return call_with_state


def setup_inputs(role, n_in: int) -> int:
    """How many of a call's leading inputs setup takes: a nonlinear op's primals (the forward's every
    input; the derivatives' fixed arrays but the residuals), a linear or multilinear op's fixed
    arguments."""
    op = role.op
    if op.kind is not OpKind.NONLINEAR:
        return role.n_fixed
    if role.is_derivative:
        return role.n_fixed - op.n_residuals
    return n_in


def state_cache(definition):
    """The cache of states of an op made with ``setup``, or None."""
    return None if definition.setup is None else definition.setup.cache

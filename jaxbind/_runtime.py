"""Where the compiled core meets the Python runtime: settings, interpreter exit, views kept too long."""

from __future__ import annotations

import atexit
import gc
import os

import numpy as np

from . import _trampoline

__all__ = ["config"]

# How long the exit hook waits for callbacks that are still running on XLA's threads.
EXIT_TIMEOUT_SECONDS = 10.0


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


class Config:
    """jaxbind's process-wide settings (``jaxbind.config``).

    Attributes:
      check_unwritten: checking mode. Before every callback and native kernel,
        jaxbind fills the outputs with a sentinel (a NaN with an unusual payload
        for float types, ``0xA5`` bytes for the others) and afterwards reports an
        output element still holding it as an error naming the op and the
        output. It costs a fill and a scan of every output: for tests and
        debugging. The environment variable ``JAXBIND_CHECK_UNWRITTEN=1`` turns
        it on at import. Integer and float8 outputs can hold the sentinel as a
        legal value: writing exactly that value is reported too.
    """

    __slots__ = ("_check_unwritten",)

    def __init__(self):
        self._check_unwritten = False
        self.check_unwritten = _env_flag("JAXBIND_CHECK_UNWRITTEN")

    @property
    def check_unwritten(self) -> bool:
        return self._check_unwritten

    @check_unwritten.setter
    def check_unwritten(self, on: bool):
        if not isinstance(on, (bool, np.bool_)):
            raise TypeError(f"jaxbind.config.check_unwritten must be True or False, got {on!r}.")
        _trampoline.set_check_unwritten(bool(on))
        self._check_unwritten = bool(on)

    def __repr__(self):
        return f"jaxbind.config(check_unwritten={self._check_unwritten})"


config = Config()


def _retire_derived(views):
    """Retire every array and memoryview found that still reaches the memory of ``views``.

    Called by the trampoline when a callback kept one of its arrays (only then:
    it walks the heap). Derived NumPy views point into the same memory through
    their own data pointer; they hold their ``base``, so they are found through
    whatever holds them (a list, a dict, a closure, an object).
    """
    kept = {id(v) for v in views}
    holders = gc.get_objects()
    memoryviews = []  # memoryviews of the kept views (NumPy makes one for np.asarray(memoryview))
    for holder in holders:
        if isinstance(holder, memoryview):
            try:
                if id(holder.obj) in kept:
                    memoryviews.append(holder)
            except ValueError:  # released
                pass
    reaching = kept | {id(m) for m in memoryviews}
    ndarray = np.ndarray
    found = {id(obj): obj for obj in gc.get_referents(*holders)
             if isinstance(obj, ndarray) and id(obj.base) in reaching and id(obj) not in kept}
    for array in found.values():
        if not array.flags.owndata:
            _trampoline.retire(array)
    for view in memoryviews:
        try:
            view.release()
        except BufferError:  # exported further: reported, and its users above retired
            pass


def _at_exit():
    # Runs before the interpreter finalizes (and before JAX's own hooks, which
    # were registered earlier): from here on a callback XLA starts is refused
    # with an error instead of taking the GIL of a dying interpreter.
    _trampoline.shutdown(EXIT_TIMEOUT_SECONDS)


_trampoline.set_derived_view_retirer(_retire_derived)
atexit.register(_at_exit)

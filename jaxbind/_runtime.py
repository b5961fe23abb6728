"""The compiled core's process-wide wiring at import: the custom-call targets, the callback error text,
the kept-view sweep (``_kept_views``), the exit hook and ``jaxbind.config``.

(The core's other hooks are set by the modules that own them: the dtypes by ``_dtypes``, the
resolver of programs made elsewhere by ``_programs``.)"""

from __future__ import annotations

import atexit
import os
import traceback

import jax
import jax.extend.backend
import numpy as np

from . import _trampoline
from ._arguments import arguments_hint
from ._jax_compat import register_batch_partitionable
from ._kept_views import retire_overlapping
from ._state import SetupError
from ._user_abstract import output_shape_hint

__all__ = ["ASYNC_TARGET", "EFFECT_TARGET", "TARGET", "config", "format_callback_error"]

# How long the exit hook waits for callbacks that are still running on XLA's threads.
EXIT_TIMEOUT_SECONDS = 10.0


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


class Config:
    """jaxbind's process-wide settings (``jaxbind.config``).

    ``jaxbind.config`` is the one instance; set its attributes to change the
    settings (``jaxbind.config.check_unwritten = True``). The constructor
    takes no arguments and reads the environment.

    Attributes
    ----------
    check_unwritten : bool
        Checking mode (default: off, unless the environment variable
        ``JAXBIND_CHECK_UNWRITTEN`` is set to something other than ``""``,
        ``0``, ``false``, ``no`` or ``off`` at import). Before every callback
        and native kernel, jaxbind fills the outputs with a sentinel (a NaN
        with an unusual payload for float and complex types, ``0xA5`` bytes
        for the others) and afterwards reports an output element still
        holding it as an error naming the op, the output, how many elements
        and the first one's index (under ``vmap`` too). It costs a fill and a
        scan of every output: for tests and debugging.
        :func:`jaxbind.testing.check_op` turns it on while it runs. Integer,
        bool and float8 outputs can hold the sentinel as a legal value:
        writing exactly that value is reported too. Setting it to anything but
        a bool raises ``TypeError``.

    Examples
    --------
    >>> import jaxbind
    >>> jaxbind.config.check_unwritten = True
    >>> jaxbind.config
    jaxbind.config(check_unwritten=True)
    >>> jaxbind.config.check_unwritten = False
    """

    __slots__ = ("_check_unwritten",)

    def __init__(self):
        self._check_unwritten = False
        self.check_unwritten = _env_flag("JAXBIND_CHECK_UNWRITTEN")

    @property
    def check_unwritten(self) -> bool:
        """Whether the checking mode for unwritten outputs is on (see ``jaxbind.config``).

        Assigning ``True`` or ``False`` (or a NumPy bool) turns it on or off
        for every op of the process. Assigning
        anything else raises ``TypeError``.
        """
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


# ---------------------------------------------------------------------------
# The custom-call targets
# ---------------------------------------------------------------------------

TARGET = "jaxbind_dispatch"
ASYNC_TARGET = "jaxbind_dispatch_async"  # concurrent native kernels, on XLA's thread pool
# Ops with an effect: the handler of TARGET, under a name XLA never partitions as a batch, so that
# the sharding a sharded program gives the call (one device, as JAX's callbacks) holds.
EFFECT_TARGET = "jaxbind_dispatch_effect"
# Each target's instantiate stage runs once per compiled program, before its calls: it checks
# that every call's site key and description belong together (_programs.check_program).
jax.ffi.register_ffi_target(
    TARGET, {"instantiate": _trampoline.instantiate_handler(), "execute": _trampoline.handler()}, platform="cpu"
)
jax.ffi.register_ffi_target(
    EFFECT_TARGET, {"instantiate": _trampoline.instantiate_handler(), "execute": _trampoline.handler()}, platform="cpu"
)
jax.ffi.register_ffi_target(
    ASYNC_TARGET,
    {"instantiate": _trampoline.instantiate_handler(), "execute": _trampoline.async_handler()},
    platform="cpu",
)
# XLA may split a call that carries `num_batch_dims` (see
# _batch_types.WalkBatch.partitionable_levels); a call without it is never split.
for _target in (TARGET, ASYNC_TARGET):
    register_batch_partitionable(_target)


# ---------------------------------------------------------------------------
# Callback errors and interpreter exit
# ---------------------------------------------------------------------------


def format_callback_error(label: str, exc: BaseException, outs=None) -> str:
    """The message of the error a failing callback raises from the compiled call.

    ``outs``: the callback's output arrays (the shapes and dtypes the abstract
    declared), or None. A mistake with a likely cause gets a line that says it.
    """
    if isinstance(exc, SetupError) and exc.__cause__ is not None:  # the setup's own failure, its own frames
        cause = exc.__cause__
        frames = traceback.format_exception(type(cause), cause, cause.__traceback__)
        return f"jaxbind {label}: {exc}\n" + "".join(frames).rstrip()
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    hint = arguments_hint(exc) or output_shape_hint(exc, outs)
    return (
        f"jaxbind {label}: the callback raised {type(exc).__name__}: {exc}\n"
        + (f"{hint}\n" if hint else "")
        + "".join(frames).rstrip()
    )


def _at_exit():
    # Runs before the interpreter finalizes (and before JAX's own hooks, which
    # were registered earlier): from here on a callback XLA starts is refused
    # with an error instead of taking the GIL of a dying interpreter.
    if _trampoline.shutdown(EXIT_TIMEOUT_SECONDS) == 0:
        return
    # A callback outlived the wait. When it next takes the interpreter (back
    # from a sleep, a NumPy call, a helper's start), CPython >= 3.13.8 parks its
    # XLA thread for ever (gh-87135); the client whose pool owns that thread
    # joins it when destroyed, and finalization may destroy it (the
    # free-threaded build's last collection does): the process would hang. The
    # clients live until the process ends instead, whose exit ends the thread.
    for client in jax.extend.backend.backends().values():
        _trampoline.keep_forever(client)


_trampoline.set_error_formatter(format_callback_error)
_trampoline.set_overlap_retirer(retire_overlapping)
atexit.register(_at_exit)

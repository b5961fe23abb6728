"""Side effects of ops (``effect=``) and of ``jaxbind.io_callback``: JAX effects of jaxbind's own.

An op's ``effect`` is None (pure: XLA may drop, merge, reorder and overlap its
calls), ``"io"`` (never dropped or merged: :data:`IO`) or ``"ordered"`` (also
run in program order, within a program and across the programs one thread
dispatches: :data:`ORDERED`). The two effects are jaxbind's own types, entered
in every one of JAX's effect sets that holds JAX's ``io_callback`` effects, so
that each JAX version allows and refuses them where it allows and refuses its
own (``scan``/``cond``/``while_loop``; ``custom_jvp``/``custom_vjp`` from 0.12).

JAX orders the programs of an ordered effect with a runtime token per effect
and thread, which each program takes and returns. A program whose callback
failed returns an errored token, and JAX would hand it to every later program,
each then failing with the old error without running (jax-ml/jax#37587; from
jax 0.12 on only the next program fails so, then JAX makes a new token). For
jaxbind's ordered effect the token a program returns is waited for as JAX
stores it: an errored one is not stored (the previous token stays, so the next
program runs) and the failure is raised from the call that caused it.
"""

from __future__ import annotations

import atexit

from . import _trampoline
from ._jax_effects import effects_module, jax_io_effects, runtime_token_set

__all__ = ["EFFECTS", "IO", "ORDERED", "check_effect", "effects_of", "exclusive_for"]

_effects = effects_module()
_JAX_IO, _JAX_ORDERED = jax_io_effects()


class JaxbindIO(_effects.Effect):
    """A jaxbind op with side effects: its calls are never dropped or merged.

    Equal to every instance of its type (``jax.export`` makes one anew where a
    program is loaded) and to JAX's ``io_callback`` effect, so that JAX's own
    checks of that effect (``vmap`` of a ``cond``, of a ``while_loop`` with a
    batched predicate) refuse jaxbind's calls in JAX's words.
    """

    def __eq__(self, other):
        return isinstance(other, JaxbindIO) or other is _JAX_IO

    def __hash__(self):
        return hash(_JAX_IO)

    def __str__(self):
        return "jaxbind.IO"


class JaxbindOrderedIO(_effects.Effect):
    """A jaxbind op whose calls also run in program order.

    Equal to JAX's ordered ``io_callback`` effect (as :class:`JaxbindIO`): the
    two share one order, in a program and across programs.
    """

    def __eq__(self, other):
        return isinstance(other, JaxbindOrderedIO) or other is _JAX_ORDERED

    def __hash__(self):
        return hash(_JAX_ORDERED)

    def __str__(self):
        return "jaxbind.OrderedIO"


IO = JaxbindIO()
ORDERED = JaxbindOrderedIO()
EFFECTS = {None: frozenset(), "io": frozenset({IO}), "ordered": frozenset({ORDERED})}
_ACCEPTED = tuple(EFFECTS)


def _register() -> None:
    """Enter jaxbind's effects in each of JAX's effect sets that holds its io_callback effect."""
    for value in vars(_effects).values():
        if isinstance(value, _effects.EffectTypeSet):
            if value.contains(_JAX_IO):
                value.add_type(JaxbindIO)
            if value.contains(_JAX_ORDERED):
                value.add_type(JaxbindOrderedIO)


def check_effect(name: str, effect) -> str | None:
    """An op's ``effect=``, checked."""
    if effect not in _ACCEPTED or isinstance(effect, bool):
        raise ValueError(
            f"jaxbind op '{name}': effect must be one of None (a pure op), \"io\" (side effects: "
            f'never dropped or merged) or "ordered" (side effects, in program order), got {effect!r:.100}.'
        )
    return effect


def effects_of(effect: str | None) -> frozenset:
    return EFFECTS[effect]


def exclusive_for(effect: str | None, thread_safe: bool):
    """The lock an op's calls hold (one call at a time): for an op with an effect, not thread_safe."""
    return _trampoline.Exclusive() if effect is not None and not thread_safe else None


def _keep_good_tokens() -> None:
    """Make JAX's store of runtime tokens wait for jaxbind's ordered token and refuse an errored one."""
    tokens_type = type(runtime_token_set())
    stock = tokens_type.set_token_result
    if getattr(stock, "_jaxbind", False):
        return

    def set_token_result(self, eff, token):
        if type(eff) is JaxbindOrderedIO:
            try:
                token.block_until_ready()
            except Exception:
                # The program failed: its failure is raised here, from its call, and none of its
                # tokens is stored (the devices' runtime tokens it returned fail the same way).
                _drop_failed(self.output_runtime_tokens)
                raise
        stock(self, eff, token)

    set_token_result._jaxbind = True
    tokens_type.set_token_result = set_token_result


def _drop_failed(runtime_tokens: dict, ours_only: bool = False) -> None:
    """Forget the tokens of programs that failed (those whose failure a jaxbind op raised: ``ours_only``)."""
    for key, token in list(runtime_tokens.items()):
        try:
            token.block_until_ready()
        except Exception as err:
            if not ours_only or "jaxbind op '" in str(err):
                del runtime_tokens[key]


def _quiet_exit() -> None:
    """At exit, before JAX waits for its runtime tokens: forget those of programs a jaxbind op failed.

    Such a failure was logged when the callback raised, and raised from the
    call (ordered) or from its results (a program XLA ran asynchronously,
    under ``shard_map``); JAX would report it once more at exit.
    """
    tokens = runtime_token_set()
    _drop_failed(tokens.current_tokens, ours_only=True)
    _drop_failed(tokens.output_runtime_tokens, ours_only=True)


_register()
_keep_good_tokens()
atexit.register(_quiet_exit)  # (after JAX's: run before them)

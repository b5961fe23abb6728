"""The JAX internals that jaxbind's effects touch (``_effects``, the ordered lowering).

The second part of ``_jax_compat``, the one place jaxbind touches JAX internals.
"""

from __future__ import annotations

from jax._src import core as _core

from ._jax_compat import mlir

__all__ = [
    "abstract_token",
    "effects_module",
    "jax_io_effects",
    "ordered_token",
    "runtime_token_set",
    "set_ordered_token",
]

abstract_token = _core.abstract_token  # (jax.core's name for it is deprecated)


def effects_module():
    """JAX's module of effect types and the sets that say where each is allowed."""
    from jax._src import effects as _effects

    return _effects


def jax_io_effects() -> tuple:
    """``jax.experimental.io_callback``'s effects: (unordered, ordered)."""
    from jax._src import callback as _callback

    return _callback._IOEffect, _callback._OrderedIOEffect


def runtime_token_set():
    """JAX's store (per thread) of the runtime tokens that order the programs of an ordered effect."""
    from jax._src import dispatch as _dispatch

    return _dispatch.runtime_tokens


def ordered_token(ctx, effect):
    """The token an ordered effect's call takes in a lowering."""
    return ctx.tokens_in.get(effect)


def set_ordered_token(ctx, effect, token) -> None:
    """The token an ordered effect's call returns, handed on to the next call of the effect."""
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({effect: token})))

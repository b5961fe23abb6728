"""The one place jaxbind touches JAX internals; everything else imports from here."""

from __future__ import annotations

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

try:  # the eager implementation of a primitive: compile it alone and run it
    from jax._src.dispatch import apply_primitive
except ImportError:  # pragma: no cover - older layouts
    from jax.interpreters.xla import apply_primitive  # type: ignore[attr-defined,no-redef]

__all__ = ["Primitive", "ad", "apply_primitive", "batching", "mlir"]

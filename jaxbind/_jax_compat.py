"""The one place jaxbind touches JAX internals; everything else imports from here."""

from __future__ import annotations

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

try:  # the eager implementation of a primitive: compile it alone and run it
    from jax._src.dispatch import apply_primitive
except ImportError:  # pragma: no cover - older layouts
    from jax.interpreters.xla import apply_primitive  # type: ignore[attr-defined,no-redef]

import jax

# The abstract value of an array or tracer: jax.typeof from 0.6 on.
get_aval = getattr(jax, "typeof", None) or jax.core.get_aval

__all__ = ["Primitive", "ad", "apply_primitive", "batching", "get_aval", "mlir"]

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


def set_frontend_attribute(results, key: str, value: str):
    """Attach ``key = value`` to the frontend attributes of the op that made ``results``.

    XLA keeps frontend attributes through compilation (``frontend_attributes=``
    in the compiled HLO), so they name the op in lowered and compiled programs.
    Returns ``results``.
    """
    op = results[0].owner
    attrs = {}
    if "mhlo.frontend_attributes" in op.attributes:  # keep any already there
        attrs = {a.name: a.attr for a in op.attributes["mhlo.frontend_attributes"]}
    attrs[key] = mlir.ir.StringAttr.get(value)
    op.attributes["mhlo.frontend_attributes"] = mlir.ir.DictAttr.get(attrs)
    return results


__all__ = ["Primitive", "ad", "apply_primitive", "batching", "get_aval", "mlir", "set_frontend_attribute"]

"""The jaxbind primitive: every rule JAX calls for it, registered in one block (at import).

Every op binds the same primitive (``_bind``) with static parameters ``role``,
``kwargs`` and ``batch``; each rule is written once, in its own module, and
reads the op definition through the role. This module exports nothing: importing
it registers the rules (``_op`` does).
"""

from __future__ import annotations

import functools

from ._abstract_eval import jaxbind_abstract_eval
from ._autodiff import jaxbind_jvp, jaxbind_transpose
from ._batching import jaxbind_batch
from ._bind import PRIMITIVES, jaxbind_pinned_p
from ._definition import Role
from ._jax_compat import (
    ad,
    apply_primitive,
    batching,
    hold_weakly_in_jax_caches,
    mlir,
    needs_devices_to_lower,
    register_replication_rules,
)
from ._lowering import jaxbind_lowering

__all__ = []

# ---------------------------------------------------------------------------
# Registration: the only place the primitive meets JAX's rule tables
# ---------------------------------------------------------------------------

for _p in PRIMITIVES:
    _p.def_impl(functools.partial(apply_primitive, _p))
    _p.def_effectful_abstract_eval(jaxbind_abstract_eval)
    ad.primitive_jvps[_p] = jaxbind_jvp
    ad.primitive_transposes[_p] = jaxbind_transpose
    batching.primitive_batchers[_p] = jaxbind_batch
    mlir.register_lowering(_p, jaxbind_lowering, platform="cpu")
    register_replication_rules(_p)
needs_devices_to_lower(jaxbind_pinned_p)
hold_weakly_in_jax_caches(Role)  # the parameter that holds an op's definition

"""The jaxbind primitive object and ``bind``, the one way ops and rules emit it.

Every op binds the same primitive with three static parameters: ``role`` (which
callback of which op, see ``_definition``), ``kwargs`` (the op call's static
keyword arguments) and ``batch`` (how the arrays are batched, or None; see
``_batch_types``). Its rules are registered in ``_primitive``; this module has
no rules so that the rule modules can import ``bind`` from it.
"""

from __future__ import annotations

from ._jax_compat import Primitive, cast_to_common_vma

jaxbind_p = Primitive("jaxbind")
jaxbind_p.multiple_results = True
# The same primitive for the calls of a pure_callback pinned to a device
# (sharding=...) and of ops with an effect: JAX must know the program's
# devices while lowering it, to say which one runs the callback, and it asks
# that of a primitive.
jaxbind_pinned_p = Primitive("jaxbind_pinned")
jaxbind_pinned_p.multiple_results = True
PRIMITIVES = (jaxbind_p, jaxbind_pinned_p)


def bind(args, role, kwargs, batch=None):
    # Inside shard_map the inputs must vary over the same manual axes (see
    # cast_to_common_vma): every bind, the rules' included, goes through here.
    # (and an op with an effect, which a sharded program runs on one device: see _lowering)
    jax_callback = role.op.jax_callback
    pinned = role.op.effect is not None or (jax_callback is not None and jax_callback.sharding is not None)
    primitive = jaxbind_pinned_p if pinned else jaxbind_p
    return primitive.bind(*cast_to_common_vma(args), role=role, kwargs=kwargs, batch=batch)

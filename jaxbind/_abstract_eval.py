"""The abstract evaluation rule: the types of a call's outputs, from the user's abstract."""

from __future__ import annotations

import functools

from ._batch_types import Batch, as_batch
from ._definition import Role
from ._effects import effects_of
from ._jax_compat import shaped_array, sharding_spec, varying_axes
from ._kwargs import Kwargs
from ._user_abstract import check_input_dtypes


def jaxbind_abstract_eval(*avals, role: Role, kwargs: Kwargs, batch: Batch):
    """The outputs' types and the op's effects (none for a pure op)."""
    return _output_types(avals, role, kwargs, batch), effects_of(role.op.effect)


def _output_types(avals, role: Role, kwargs: Kwargs, batch: Batch):
    check_input_dtypes(role, avals)
    batch = as_batch(batch)
    # Outputs vary over the manual axes their inputs vary over (bind made them
    # agree); a partitioned batch keeps its sharding, other outputs are whole. An op with an
    # effect runs on one device of a sharded program (as JAX's callbacks): its outputs are
    # typed as JAX types its io_callback's, on no mesh.
    typed = functools.partial(
        shaped_array,
        like=avals[0] if avals else None,
        on_mesh=role.op.effect is None,
        vma=frozenset().union(*map(varying_axes, avals)),
        spec=_batch_spec(avals, batch.partitionable_levels()),
    )
    return [typed(shape, dtype) for shape, dtype in batch.output_shapes(role, avals, kwargs)]


def _batch_spec(avals, levels: int) -> tuple:
    """The sharding of the leading ``levels`` dims of a partitioned call's outputs.

    XLA splits all operands alike along those dims; the first input sharded
    there says how (the others are resharded to match).
    """
    specs = [sharding_spec(a)[:levels] for a in avals]
    return next((s for s in specs if any(e is not None for e in s)), ())

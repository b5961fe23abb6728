"""``jaxbind.io_callback``: ``jax.experimental.io_callback``'s signature and semantics, run by the trampoline.

The op of a call is ``jaxbind.pure_callback``'s (``_pure_callback``: one op per
callback, argument structure and sharding, its result specs as kwargs) with an
effect: ``"io"``, or ``"ordered"`` for ``ordered=True`` (``_effects``). Its calls
are never dropped or merged, the ordered ones run in program order, and the
calls of one callback never overlap (one lock per callback, taken by the core).
A vmapped unordered call runs the callback once per element, in order, as
JAX's does; an ordered one refuses ``vmap``, and neither has derivatives, in
JAX's words.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from ._jax_compat import at_top_level
from ._pure_callback import _eager, _op_for, _op_name_for, exclusive_of
from ._pure_callback_checks import check_arguments, check_spec, flatten_arguments

__all__ = ["io_callback"]


def io_callback(
    callback: Callable[..., Any],
    result_shape_dtypes: Any,
    *args: Any,
    sharding: jax.sharding.Sharding | None = None,
    ordered: bool = False,
    **kwargs: Any,
):
    """Call a Python function with side effects from JAX: :func:`jax.experimental.io_callback`, run by jaxbind's core.

    The signature and semantics are JAX's, so that replacing the name is the
    whole port; the call goes through jaxbind's trampoline (see the porting
    guide for the cost per call).

    Parameters
    ----------
    callback : callable
        ``callback(*args, **kwargs)``, returning a pytree of arrays with the
        structure, shapes and dtypes of ``result_shape_dtypes`` (as for
        :func:`jaxbind.pure_callback`: inside compiled code it receives
        read-only NumPy arrays viewing XLA's buffers; outside any trace, jax
        Arrays on a CPU device). It may keep state: every call of the program
        runs it (none is dropped when its results are unused, no two equal
        calls are merged), and its calls never overlap, whichever threads or
        devices XLA runs them on.
    result_shape_dtypes : pytree
        Leaves with ``.shape`` and ``.dtype``; may be empty (``None``, ``()``):
        the callback still runs.
    *args, **kwargs : pytrees
        The arguments, pytrees of arrays or scalars.
    sharding : jax.sharding.SingleDeviceSharding, optional
        The device the callback runs on in a sharded program (default: the
        first of the program's devices); inside ``shard_map``, every device
        runs it.
    ordered : bool, default False
        Run the calls in program order, within a program and across the
        programs a thread dispatches (one order for every ordered
        ``jaxbind.io_callback``, op with ``effect="ordered"`` and JAX's own
        ordered ``io_callback``: their effects compare equal).

    Returns
    -------
    pytree of jax.Array
        With the structure of ``result_shape_dtypes``.

    Raises
    ------
    TypeError
        As :func:`jaxbind.pure_callback`, for a result spec without shape or
        dtype, an argument that is not an array, or a ``sharding`` that is not
        a ``jax.sharding.Sharding``.
    ValueError
        Under ``jax.jvp``/``jax.grad`` ("IO callbacks do not support JVP.")
        and transposition, under ``jax.vmap`` with ``ordered=True`` ("Cannot
        `vmap` ordered IO callback."), as JAX's; for a 64-bit result type
        without ``jax_enable_x64``.
    jax.errors.JaxRuntimeError
        From the call, when the callback raises (logged as JAX logs it, "jax.io_callback
        failed" on the logger ``jax._src.callback``) or returns results of another
        number, shape or dtype than declared. The program's next call runs as
        usual (an ordered one too, in ``shard_map`` too, on jax 0.10 and newer).

    Examples
    --------
    >>> seen = []
    >>> def log(x):
    ...     seen.append(float(x))
    ...     return np.float32(len(seen))
    >>> f = jax.jit(lambda x: jaxbind.io_callback(log, jax.ShapeDtypeStruct((), jnp.float32), x, ordered=True))
    >>> _ = f(jnp.float32(2.0)), f(jnp.float32(3.0))
    >>> seen
    [2.0, 3.0]
    """
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(f"jaxbind.io_callback: sharding must be a jax.sharding.Sharding, got {sharding!r:.100}")
    name = _op_name_for(callback, "io_callback")
    flat_args, in_tree = flatten_arguments(args, kwargs, name)
    check_arguments(flat_args, args, kwargs, name)
    flat_specs, out_tree = jax.tree_util.tree_flatten(result_shape_dtypes)
    specs = tuple(check_spec(s, i, name) for i, s in enumerate(flat_specs))
    if at_top_level() and not any(isinstance(a, jax.core.Tracer) for a in flat_args):
        return _eager(callback, flat_args, in_tree, specs, out_tree, "io_callback", exclusive_of(callback))
    op = _op_for(callback, in_tree, "sequential", sharding, "ordered" if ordered else "io")
    outs = op(*flat_args, result=tuple((shape, name) for shape, _, name in specs))
    return out_tree.unflatten(outs)

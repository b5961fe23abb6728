"""``jaxbind.export``: ``jax.export.export`` with jaxbind's custom-call targets declared."""

from __future__ import annotations

import importlib

import jax

from ._runtime import ASYNC_TARGET, EFFECT_TARGET, TARGET

__all__ = ["export"]


def export(fun, **kwargs):
    """Export ``fun`` with ``jax.export``, allowing the jaxbind ops it calls.

    Takes and returns what :func:`jax.export.export` does (call the result
    with example arguments or ``jax.ShapeDtypeStruct`` s to get a
    ``jax.export.Exported``); jaxbind's two custom-call targets are added to
    ``disabled_checks`` (JAX's public way to allow a custom call it does not
    know in a serialized program).

    A serialized program names each jaxbind op by its ``name``: a process that
    deserializes it must define ops of the same names (and structure: kind,
    fixed arguments, flags, number of callbacks) before calling it, and runs
    its own callbacks. Each call carries the version of jaxbind's call
    description (its schema); a program whose schema this jaxbind does not
    read is refused when called.

    Parameters
    ----------
    fun : callable
        A function (typically ``jax.jit``-ed) that may call jaxbind ops.
    **kwargs
        Passed on to :func:`jax.export.export` (``platforms``,
        ``disabled_checks``, ...).

    Returns
    -------
    callable
        ``jax.export.export(fun, **kwargs)`` with the jaxbind targets allowed.

    Raises
    ------
    ValueError
        When exporting (calling the returned function), if a jaxbind op in
        ``fun`` shares its name with another op of this process: a serialized
        program could not say which one it calls. Give ops distinct
        ``name=`` values.

    Notes
    -----
    Where a serialized program runs, sites are resolved on its first call;
    what cannot be resolved (an op not defined, two ops of the name, a
    structure that differs, another schema, keyword arguments that are not
    plain data) is an error then, raised as a ``jax.errors.JaxRuntimeError``
    naming the op. Kwargs from a program are read as plain data only
    (numbers, strings, bools, None, lists, tuples, dicts, sets, NumPy arrays
    and scalars); nothing in a program is executed.

    Examples
    --------
    >>> exported = jaxbind.export(jax.jit(loss))(              # doctest: +SKIP
    ...     jax.ShapeDtypeStruct((4, 3), jnp.float64))
    >>> blob = exported.serialize(vjp_order=1)                 # doctest: +SKIP

    In another process, after defining the same ops (same names):

    >>> exported = jax.export.deserialize(blob)                # doctest: +SKIP
    >>> y = exported.call(x)                                   # doctest: +SKIP
    """
    jax_export = _jax_export()
    allowed = [jax_export.DisabledSafetyCheck.custom_call(target) for target in (TARGET, ASYNC_TARGET, EFFECT_TARGET)]
    disabled = list(kwargs.pop("disabled_checks", ()))
    disabled += [check for check in allowed if check not in disabled]
    return jax_export.export(fun, disabled_checks=disabled, **kwargs)


def _jax_export():
    """``jax.export``, imported here: jax < 0.6 does not import it with ``jax``, and it needs absl-py."""
    try:
        return importlib.import_module("jax.export")
    except ImportError as err:
        raise ImportError(
            f"jaxbind.export: jax {jax.__version__}'s jax.export cannot be imported ({err}); "
            "on jax < 0.6 it needs absl-py: pip install absl-py"
        ) from err

"""What ``jaxbind.pure_callback`` (and ``io_callback``) refuse, in words that name the callback.

The result specs (:func:`check_spec`) and the arguments (:func:`check_arguments`,
:func:`flatten_arguments`) before an op is bound, and the callback's results
(:func:`write_results`) when it ran: refused where JAX refuses them, with the
reason and the fix.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np

from ._definition import dtype_name
from ._jax_compat import canonicalize_dtype

_dtypes: dict = {}  # dtype name -> NumPy's own dtype object of that name (see check_spec)
# What JAX takes as an argument of a callback (the op's own check, plus what JAX converts itself)
_ARGUMENT_TYPES = (jax.Array, np.ndarray, np.generic, numbers.Number)
# Options of jaxbind's ops, which a pure callback does not take: its keyword arguments are the callback's
_OP_OPTIONS = ("setup", "setup_cache", "thread_safe", "inplace")


def dtype_named(name: str):
    """NumPy's own dtype object of a name (``jax.dtypes.float0`` for "float0")."""
    dtype = _dtypes.get(name)
    if dtype is None:
        # (the dtype of its scalar type is NumPy's one object of the name: ml_dtypes' types too)
        dtype = jax.dtypes.float0 if name == "float0" else np.dtype(np.dtype(name).type)
        _dtypes[name] = dtype
    return dtype


def check_spec(spec, index: int, name: str):
    """A result spec's shape, dtype (NumPy's own object of it) and dtype name.

    ``index``: the leaf's position among the flattened specs; ``name``: the op's
    (``pure_callback(f)``).
    """
    try:
        shape, dtype = tuple(spec.shape), np.dtype(spec.dtype)
    except (AttributeError, TypeError) as err:
        raise TypeError(
            "jaxbind.pure_callback: each leaf of result_shape_dtypes needs .shape and .dtype "
            f"(a jax.ShapeDtypeStruct or an array), got {spec!r:.100}"
        ) from err
    if not dtype.isnative:  # (jax.pure_callback: "No dtype_to_ir_type handler for dtype: >f8")
        raise TypeError(
            f"jaxbind.{name}: result_shape_dtypes leaf {index} has dtype {dtype.str!r}, in the byte order "
            "of another machine: JAX has no arrays of it, and jax.pure_callback refuses it too. Declare "
            f"{dtype.newbyteorder('=').name} (its values in this machine's order) and return that."
        )
    if dtype != jax.dtypes.float0 and canonicalize_dtype(dtype) != dtype:
        raise ValueError("result_shape_dtypes cannot specify 64-bit types when `jax_enable_x64` is disabled")
    name = dtype_name(dtype)
    own = dtype_named(name)
    # An unpickled dtype is a new object equal to NumPy's, and JAX (which compares dtypes by
    # identity in places) would carry it into its results and caches.
    return tuple(int(d) for d in shape), (own if own == dtype else dtype), name


def check_arguments(flat_args, args, kwargs, name: str) -> None:
    """Refuse a leaf of ``(args, kwargs)`` that cannot be an array, naming where it is.

    ``jax.pure_callback`` refuses it too ("Error interpreting argument to
    pure_callback as a JAX value"); an option of jaxbind's ops (``setup=``)
    passed here is pointed to the op that takes it.
    """
    for leaf in flat_args:
        if not isinstance(leaf, _ARGUMENT_TYPES) and not hasattr(leaf, "__jax_array__"):
            break
    else:
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
        if isinstance(leaf, _ARGUMENT_TYPES) or hasattr(leaf, "__jax_array__"):
            continue
        kind = type(leaf).__name__
        inner = jax.tree_util.keystr(path[2:])
        if path[0].idx == 0:
            where = f"argument {path[1].idx}{inner}"
        elif (key := path[1].key) in _OP_OPTIONS:
            raise TypeError(
                f"jaxbind.{name}: jaxbind.pure_callback takes no {key}= (here a {kind}): as with "
                "jax.pure_callback, its keyword arguments are passed to the callback, and so must be "
                f"arrays. {key}= is an option of jaxbind's ops: bind the function with "
                f"jaxbind.get_nonlinear_call(..., {key}=...) (see the porting guide, 'A factorization "
                "made once: setup=')."
            )
        else:
            where = f"keyword argument {key}{inner}"
        raise TypeError(
            f"jaxbind.{name}: {where} is a {kind}; the arguments of a pure callback are pytrees of "
            "arrays (jax or NumPy) or scalars, as jax.pure_callback's are. Pass another value to the "
            "callback by closing over it (functools.partial)."
        )


def flatten_arguments(args, kwargs, name):
    """The arguments' leaves and structure, or an error naming the argument JAX cannot flatten."""
    try:
        return jax.tree_util.tree_flatten((args, kwargs))
    except (TypeError, ValueError) as err:
        named = [*(f"argument {i}" for i in range(len(args))), *(f"keyword argument '{k}'" for k in kwargs)]
        for label, value in zip(named, (*args, *kwargs.values())):
            try:
                jax.tree_util.tree_flatten(value)
            except (TypeError, ValueError):
                raise TypeError(
                    f"jaxbind.{name}: {label} is a pytree JAX cannot flatten ({err}); a dict's keys must "
                    "be of one sortable type (not 1 and 'b' together). The arguments of pure_callback are "
                    "arrays passed to the function, as with jax.pure_callback: close over other values "
                    "(functools.partial(f, table=table)) instead."
                ) from None
        raise


def write_results(name, out, result, leaves):
    """The callback's results into XLA's buffers, checked as JAX checks them."""
    results = leaves(result)
    if len(results) != len(out):
        raise RuntimeError(
            f"{name}: Mismatched number of outputs from callback. Expected: {len(out)}, Actual: {len(results)}"
        )
    for i, (o, r) in enumerate(zip(out, results)):
        r = np.asarray(r)
        if r.shape != o.shape:
            raise RuntimeError(
                f"{name}: Incorrect output shape for return value #{i}: Expected: {o.shape}, Actual: {r.shape}"
            )
        if r.dtype != o.dtype:
            if o.dtype == np.bool_ and r.dtype == jax.dtypes.float0:  # a float0 output: no data
                o[...] = False
                continue
            if canonicalize_dtype(r.dtype) != o.dtype:
                raise RuntimeError(
                    f"{name}: Incorrect output dtype for return value #{i}: Expected: {o.dtype}, "
                    f"Actual: {canonicalize_dtype(r.dtype)}"
                )
        o[...] = r

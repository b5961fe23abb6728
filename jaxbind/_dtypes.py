"""The dtypes a callback can take: XLA's FFI dtype codes and their NumPy dtypes, handed to the compiled core."""

from __future__ import annotations

import jax.numpy as jnp

from . import _trampoline

__all__ = ["SUPPORTED_DTYPES"]

# XLA FFI dtype codes (XLA's PrimitiveType numbers) and their NumPy dtypes.
SUPPORTED_DTYPES = {}
for _name, _code in _trampoline.DTYPE_CODES.items():  # the header's enum, exported by the module
    try:
        _dtype = jnp.dtype(_name)
    except TypeError:  # a float8 type this ml_dtypes does not have
        continue
    _trampoline.set_dtype(_code, _dtype)
    SUPPORTED_DTYPES[_dtype] = _code

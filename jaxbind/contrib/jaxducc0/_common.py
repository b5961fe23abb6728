"""What the jaxducc0 ops share: dtype pairs and the checks their abstracts make."""

import math

import numpy as np

_COMPLEX_OF = {np.dtype(np.float32): np.dtype(np.complex64), np.dtype(np.float64): np.dtype(np.complex128)}
_REAL_OF = {c: r for r, c in _COMPLEX_OF.items()}
_SQRT2 = math.sqrt(2.0)


# The errors of the abstracts below reach the caller with their own type (also
# a jaxbind.JaxbindError) and a message that names the op.


def _check_kwargs(kwargs, allowed):
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(sorted(allowed))}."
        )


def _check_dtype(what, dtype, accepted):
    dtype = np.dtype(dtype)
    if dtype not in accepted:
        names = " or ".join(d.name for d in accepted)
        raise TypeError(f"{what} must be {names}, got {dtype.name}.")

"""ducc0's transforms as jaxbind linear ops.

Every op here is linear in its (non-fixed) input, so it jit-compiles,
differentiates to any order (``jvp``, ``vjp``/``grad``, ``linear_transpose``)
and vmaps. The transposes follow JAX's convention (the plain transpose, no
complex conjugation).

- :func:`c2c`: complex FFT (``ducc0.fft.c2c``), self-batched under ``vmap``.
- :func:`genuine_fht`: Hartley transform (``ducc0.fft.genuine_fht``),
  self-batched under ``vmap``.
- :func:`get_healpix_sht`: spherical harmonic synthesis onto a HEALPix map
  (``ducc0.sht.synthesis``, transpose from ``ducc0.sht.adjoint_synthesis``) on
  real-packed :math:`a_{lm}` (see :func:`alm2realalm`), self-batched under
  ``vmap``; :func:`nalm`.
- :func:`get_wgridder`: the radio-interferometric degridder image -> visibilities
  (``ducc0.wgridder.experimental.dirty2vis``, transpose from ``vis2dirty``).
- :func:`nufft`: the non-uniform FFT from a uniform grid to points
  (``ducc0.nufft.plan``'s ``u2nu``, transpose from its ``nu2u``), with a plan
  made once per set of points by the op's ``setup`` and kept for its transpose
  and later calls.

The functions :func:`get_healpix_sht` and :func:`get_wgridder` return are
``functools.partial`` s of the ops :func:`healpix_sht` and :func:`wgridder`
with their keyword arguments. :func:`alm2realalm` and :func:`realalm2alm`
convert :math:`a_{lm}` between ducc0's complex layout and the ops' real one.

Like every jaxbind op, each returns the list of its outputs: ``y, = c2c(x)``.
Needs ``ducc0`` (``pip install ducc0``).
"""

try:
    import ducc0  # noqa: F401  (imported to say early, in words, that ducc0 is missing)
except ImportError as _err:
    raise ImportError(
        "jaxbind.contrib.jaxducc0 needs the ducc0 package, which is not installed: pip install ducc0", name="ducc0"
    ) from _err

import numpy as _np

from ._common import _COMPLEX_OF, _REAL_OF
from ._fft import c2c, genuine_fht
from ._nufft import nufft
from ._sht import alm2realalm, get_healpix_sht, healpix_sht, nalm, realalm2alm
from ._wgridder import get_wgridder, wgridder

__all__ = [
    "alm2realalm",
    "c2c",
    "genuine_fht",
    "get_healpix_sht",
    "get_wgridder",
    "healpix_sht",
    "nalm",
    "nufft",
    "realalm2alm",
    "wgridder",
]


# JAXbind 1.3.1's module had these private helpers, which its own tests (and
# code copied from them) call: the same, in terms of this module's.
def _complextype(dtype):
    """The complex dtype of a real one (float32 -> complex64, float64 -> complex128)."""
    return _COMPLEX_OF[_np.dtype(dtype)]


def _realtype(dtype):
    """The real dtype of a complex one (complex64 -> float32, complex128 -> float64)."""
    return _REAL_OF[_np.dtype(dtype)]


def _into(out, value):
    """``value``, or ``out`` filled with it (JAXbind 1.3.1's ``out=`` convention)."""
    if out is None:
        return value
    out[...] = value
    return out


def _alm2realalm(alm, lmax, dtype, out=None):
    """:func:`alm2realalm` with JAXbind 1.3.1's signature (``dtype``: the real dtype; into ``out``)."""
    return _into(out, alm2realalm(_np.asarray(alm).astype(_complextype(dtype), copy=False), lmax))


def _realalm2alm(alm, lmax, dtype, out=None):
    """:func:`realalm2alm` with JAXbind 1.3.1's signature (``dtype``: the complex dtype; into ``out``)."""
    return _into(out, realalm2alm(_np.asarray(alm).astype(_realtype(dtype), copy=False), lmax))

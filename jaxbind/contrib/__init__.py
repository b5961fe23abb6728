"""Ready-made jaxbind ops for third-party libraries.

Each submodule needs its own optional dependency and imports it only when the
submodule itself is imported, so ``import jaxbind.contrib`` needs nothing
beyond jaxbind:

- :mod:`jaxbind.contrib.jaxducc0`: ducc0's FFT, Hartley transform, HEALPix
  spherical harmonic synthesis and radio-interferometric (w-)gridder as linear
  ops (``pip install ducc0``).
"""

# Empty on purpose: a star import must not pull in a submodule and its dependency.
__all__ = []

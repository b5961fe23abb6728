"""jaxbind: turn functions JAX cannot see into JAX ops that jit, differentiate and vmap.

A function JAX cannot trace (NumPy or SciPy code, a wrapped C, C++ or Fortran
routine, an external solver) becomes a JAX operation, called from XLA through a
small compiled trampoline on NumPy arrays that view XLA's buffers. CPU only.

- :func:`get_linear_call` and :func:`get_nonlinear_call` make an :class:`Op`
  from a function, its transpose or its jvp and vjp, and abstract functions
  that give the outputs' shapes and dtypes; :func:`load_kwargs` reads the
  call's keyword arguments inside a callback.
- :func:`native`, :func:`numba_kernel` and :class:`NativeKernel` make native
  kernels, which XLA calls with no Python and no GIL; :func:`get_include` is
  the folder of their header.
- :func:`export` is ``jax.export.export`` allowing jaxbind's custom calls.
- ``jaxbind.config`` holds the process-wide settings (the checking mode for
  unwritten outputs); :class:`JaxbindError` marks a failure of a user's
  abstract function.
- :mod:`jaxbind.testing` checks an op (:func:`jaxbind.testing.check_op`).
"""

try:
    from . import _trampoline  # noqa: F401  (the compiled core)
except ImportError as _err:  # pragma: no cover - depends on how jaxbind was imported
    raise ImportError(
        "jaxbind's compiled core (jaxbind._trampoline) was not found. Install the package with "
        "`pip install .` and import it from outside the source folder (a `jaxbind/` folder in the "
        "current directory shadows the installed package)."
    ) from _err

from . import _install_check

_install_check.warn_if_shared()

from . import testing
from ._errors import JaxbindError
from ._export import export
from ._io_callback import io_callback
from ._kwargs import load_kwargs
from ._linear_call import get_linear_call
from ._native import NativeKernel, get_include, native
from ._nonlinear_call import get_nonlinear_call
from ._numba import numba_kernel
from ._op import Op
from ._pure_callback import pure_callback
from ._runtime import config

__all__ = [
    "JaxbindError",
    "NativeKernel",
    "Op",
    "config",
    "export",
    "get_include",
    "get_linear_call",
    "get_nonlinear_call",
    "load_kwargs",
    "native",
    "numba_kernel",
    "io_callback",
    "pure_callback",
    "testing",
]
__version__ = "0.2.0"

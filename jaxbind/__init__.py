"""jaxbind: turn functions JAX cannot see into JAX ops that jit, differentiate and vmap."""

try:
    from . import _trampoline  # noqa: F401  (the compiled core)
except ImportError as _err:  # pragma: no cover - depends on how jaxbind was imported
    raise ImportError(
        "jaxbind's compiled core (jaxbind._trampoline) was not found. Install the package with "
        "`pip install .` and import it from outside the source folder (a `jaxbind/` folder in the "
        "current directory shadows the installed package)."
    ) from _err

from ._api import Op, get_linear_call, get_nonlinear_call
from ._definition import JaxbindError
from ._export import export
from ._kwargs import load_kwargs
from ._native import NativeKernel, get_include, native
from ._numba import numba_kernel
from ._runtime import config
from . import testing  # noqa: E402  (jaxbind.testing.check_op)

__all__ = [
    "JaxbindError", "NativeKernel", "Op", "config", "export", "get_include", "get_linear_call", "get_nonlinear_call",
    "load_kwargs", "native", "numba_kernel", "testing",
]
__version__ = "0.1.0"

"""jaxbind: turn functions JAX cannot see into JAX ops that jit, differentiate and vmap."""

from ._api import Op, get_linear_call, get_nonlinear_call
from ._definition import JaxbindError
from ._kwargs import load_kwargs

__all__ = ["JaxbindError", "Op", "get_linear_call", "get_nonlinear_call", "load_kwargs"]
__version__ = "0.1.0"

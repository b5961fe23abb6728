"""A pytest plugin that runs other projects' tests with JAX's callbacks replaced by jaxbind's.

    PYTHONPATH=compat pytest -p jax_swap <jax checkout>/tests/python_callback_test.py -k PureCallbackTest

(see compat/README.md). ``jax.pure_callback`` becomes ``jaxbind.pure_callback``, and
``jax.experimental.io_callback`` becomes ``jaxbind.io_callback`` wherever a project can reach it:
``jax.experimental.io_callback`` (and so ``from jax.experimental import io_callback``) and
``jax._src.callback.io_callback``. A plugin loads before the tests import anything, so a module
that copies the name at import gets jaxbind's. Set JAXBIND_SWAP=0 to run the same tests on stock
JAX, for the side-by-side count (jaxbind is then not imported at all).
"""

import os

import jax
import jax._src.callback
import jax.experimental

STOCK_PURE_CALLBACK = jax.pure_callback
STOCK_IO_CALLBACK = jax.experimental.io_callback
SWAPPED = os.environ.get("JAXBIND_SWAP", "1") != "0"

if SWAPPED:
    import jaxbind

    jax.pure_callback = jaxbind.pure_callback
    jax.experimental.io_callback = jaxbind.io_callback
    jax._src.callback.io_callback = jaxbind.io_callback

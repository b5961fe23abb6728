"""A pytest plugin that runs JAX's own callback tests with ``jax.pure_callback`` replaced.

    PYTHONPATH=compat pytest -p jax_swap <jax checkout>/tests/python_callback_test.py -k PureCallbackTest

(see compat/README.md). Set JAXBIND_SWAP=0 to run the same tests on stock JAX,
for the side-by-side count.
"""

import os

import jax

import jaxbind

if os.environ.get("JAXBIND_SWAP", "1") != "0":
    jax.pure_callback = jaxbind.pure_callback

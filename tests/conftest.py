"""Shared fixtures for the jaxbind tests.

Double precision is enabled so that float64/complex128 ops are really computed
in double precision (JAX would otherwise silently downcast to 32 bit).
"""

import functools

import _kernels
import jax
import jax.test_util
import numpy as np
import pytest
from _shared import CALLS

jax.config.update("jax_enable_x64", True)

ALL_DTYPES = (np.float32, np.float64, np.complex64, np.complex128)
SINGLE_PRECISION = (np.dtype(np.float32), np.dtype(np.complex64))


@pytest.fixture(params=ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def dtype(request):
    """Parametrizes a test over float32, float64, complex64 and complex128."""
    return np.dtype(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def rand(rng):
    """``rand(*shape, dtype=...)``: standard normal data of the given dtype.

    Complex dtypes get genuinely complex data (independent real and imaginary
    parts), so that a missing or spurious conjugation is caught.
    """

    def make(*shape, dtype=np.float64):
        dtype = np.dtype(dtype)
        x = rng.standard_normal(shape)
        if dtype.kind == "c":
            x = x + 1j * rng.standard_normal(shape)
        return x.astype(dtype)

    return make


@pytest.fixture
def tol(dtype):
    """``assert_allclose`` tolerances for values computed in ``dtype``."""
    if dtype in SINGLE_PRECISION:
        return dict(rtol=1e-4, atol=1e-5)
    return dict(rtol=1e-11, atol=1e-12)


@pytest.fixture
def check_grads(dtype):
    """``jax.test_util.check_grads`` with a finite-difference step fit for ``dtype``.

    In single precision the default step (1e-4) loses most digits to rounding;
    a larger step is harmless for the (multi)linear ops and accurate enough for
    the smooth nonlinear ones tested here.
    """
    eps = 1e-2 if dtype in SINGLE_PRECISION else 1e-5
    return functools.partial(jax.test_util.check_grads, eps=eps)


@pytest.fixture(scope="session")
def kernels():
    """The test kernels (``kernels/test_kernels.c``) as a ``ctypes.CDLL``, compiled once.

    Modules that make ops at import call ``_kernels.load()`` (the same library)."""
    return _kernels.load()


@pytest.fixture
def calls():
    """``_shared.CALLS``, the calls the test module's callbacks record, empty at the start and the end of
    the test. Modules whose callbacks record use it in every test (``pytest.mark.usefixtures``)."""
    CALLS.clear()
    yield CALLS
    CALLS.clear()

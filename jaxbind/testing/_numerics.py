"""The checker's numerics: its constants, overflow-free norms and pairings, and the rounding model's growth."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

BATCH = 3  # elements of the batches the one-level vmap checks build
NESTED = (2, 3)  # sizes of the outer and inner levels of the nested vmap checks
# A check is meaningful when its relative tolerance is below this: it then
# catches any error of 100 % (a zero or doubled derivative, a wrong sign).
MEANINGFUL = 0.5
# The best relative accuracy assumed of any op, whatever its dtype: special
# functions, FFTs and solves are accurate to some float64 ulps, not to one.
FLOOR = 64 * float(np.finfo(np.float64).eps)
# Fourth-order central differences: f'(x) t ~ sum_k W_k f(x + k e t) / e.
FD_POINTS = (-2, -1, 1, 2)
FD_WEIGHTS = (1 / 12, -8 / 12, 8 / 12, -1 / 12)
FD_LADDER = (1.0, 0.1, 0.01)  # the steps tried, as fractions of the first
FD_MAX_STEP = 0.2  # of each element's magnitude: a step never crosses zero
COMBINED = 1 << 20  # batched checks of at most this many elements in all are compiled as one program


def _inexact(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _is_complex(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.complexfloating)


def _eps(dtype) -> float:
    return float(jnp.finfo(dtype).eps) if _inexact(dtype) else 0.0


def _wide(x) -> np.ndarray:
    """``x`` as a float64 or complex128 NumPy array (exact for every narrower dtype)."""
    x = np.asarray(x)
    return x.astype(np.complex128 if x.dtype.kind == "c" else np.float64, copy=False)


def _norm(x) -> float:
    """The 2-norm of ``x``, scaled so that it neither overflows nor underflows."""
    x = _wide(x).ravel()
    if x.size == 0:
        return 0.0
    m = float(np.max(np.abs(x)))
    if m == 0 or not math.isfinite(m):
        return m
    if 1e-140 < m < 1e140:  # the squares cannot overflow or underflow
        return float(np.sqrt(np.real(np.vdot(x, x))))
    x = x / m
    return m * float(np.sqrt(np.real(np.vdot(x, x))))


def _pair(a, b) -> float:
    """``Re sum(a * b)``: the bilinear pairing of JAX's transpose convention (no conjugation), scaled."""
    a, b = _wide(a).ravel(), _wide(b).ravel()
    if a.size == 0:
        return 0.0
    ma, mb = float(np.max(np.abs(a))), float(np.max(np.abs(b)))
    if ma == 0 or mb == 0:
        return 0.0
    if 1e-140 < ma < 1e140 and 1e-140 < mb < 1e140:  # the products cannot overflow or underflow
        return float(np.real(np.dot(a, b)))
    return ma * mb * float(np.real(np.dot(a / ma, b / mb)))


def _growth(n: int) -> float:
    """How much rounding an op of ``n`` elements may accumulate, in units of eps (see the module doc)."""
    return 4.0 * (1.0 + math.log2(max(int(n), 1)))


def _size(x) -> int:
    return int(np.prod(np.shape(x), dtype=np.int64))


def _relative(value: float, magnitude: float) -> float:
    """``value`` relative to ``magnitude`` (``value`` itself where the magnitude is zero)."""
    return value / magnitude if magnitude else value


class _Worst:
    """The (error, tolerance) pair closest to failing among those offered: one summary entry per group."""

    def __init__(self):
        self.entry = None

    @staticmethod
    def ratio(entry) -> float:
        return entry[0] / entry[1] if entry[1] else (0.0 if entry[0] == 0 else math.inf)

    def offer(self, error: float, tolerance: float):
        if self.entry is None or self.ratio((error, tolerance)) > self.ratio(self.entry):
            self.entry = (error, tolerance)

    def report(self, summary, check: str, argument: str):
        """Add the entry to ``summary`` (an OpCheck) as one check."""
        if self.entry is not None:
            summary.add(check, argument, *self.entry)


def _nonfinite(x) -> int:
    x = np.asarray(x)
    if not _inexact(x.dtype):
        return 0
    return int(np.size(x) - np.count_nonzero(np.isfinite(_wide(x))))

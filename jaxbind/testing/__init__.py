"""The op checker: ``check_op`` tests an op's abstracts, derivatives and batching on given arguments.

The tolerances come from a rounding model, not from constants:

- every array the op computes in a dtype is taken to be accurate to
  ``G(n) * eps`` relative to its own 2-norm, with ``eps`` the largest of that
  dtype's machine epsilon, the coarsest epsilon among the op's inexact
  arguments, and FLOOR (64 float64 epsilons: library routines are accurate to
  some ulps, not one); ``G(n) = 4 (1 + log2 n)`` for the largest size ``n``
  involved; integer and bool arrays are exact;
- a pairing ``<a, b>`` then has the tolerance ``G eps |a| |b|`` per computed
  factor, a finite difference of step ``e`` that of ``f`` at its points (its
  norm) magnified by ``1.5 / e``, plus the jvp's own;
- norms and pairings are scaled by the largest element (no overflow or
  underflow), and each test is reported relative to the magnitude of what it
  compares, so that a 100 % error reads 1.

A comparison whose tolerance is not below MEANINGFUL (0.5) of that magnitude
could not tell a 100 % error from rounding: unless it fails, it is reported in
``OpCheck.skipped`` with the reason, never as passed.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from .._op import Op
from .._runtime import config
from ._checker import Checker
from ._report import OpCheck

__all__ = ["OpCheck", "check_op"]


def check_op(op: Op, /, *args, fd_rtol: float | None = None, **kwargs) -> OpCheck:
    """Check an op on the given arguments, as ``torch.library.opcheck`` does for PyTorch.

    Checks, on the arguments given (see the guide "Checking an op", docs/guides/checking.md):
    the outputs against the abstract (fully written, finite), eager against
    jit; for linear and multilinear ops linearity (all linear arguments
    jointly for a linear op, each one for a multilinear op) and the dot-product
    test ``<f x, y> == <x, f_T y>`` in every linear argument and jointly; for
    nonlinear ops the jvp against central finite differences and the vjp
    against the jvp; ``vmap`` at one and two levels with mixed ``in_axes``, of
    the op, its vjp and (nonlinear ops) its jvp, against Python loops; for
    ops made with ``thread_safe=True`` a ``vmap`` of 256 elements walked on
    every thread at once (chunks of a few elements, Python switching threads
    every microsecond), three times, against calling it element by element.
    Random data is complex wherever an array is complex. Tolerances follow
    from a rounding model: the dtypes' epsilons, the sizes and the magnitudes
    of the values involved. A check the precision makes meaningless is listed
    in ``OpCheck.skipped`` with its reason.

    It runs with ``jaxbind.config.check_unwritten``
    on (and restores the previous setting), so every callback it runs must
    write all its outputs.

    Parameters
    ----------
    op : Op
        A jaxbind op (:func:`jaxbind.get_linear_call`,
        :func:`jaxbind.get_nonlinear_call`); positional-only, so that the
        op's keyword arguments may have any name (``op=``, ``args=``).
    *args : array_like
        Array arguments to call it with (JAX or NumPy arrays, or scalars):
        the point the checks run at.
    fd_rtol : float, optional
        An extra relative tolerance of the jvp against finite differences,
        for an op computed to an accuracy of its own (an adaptive ODE solver,
        an iterative solve): its relative accuracy, a finite non-negative
        number. The name is reserved: it is not passed to the op.
    **kwargs
        The op call's keyword arguments.

    Returns
    -------
    OpCheck
        Each check with the argument it was about, the measured error and
        its tolerance (``print`` it for a table), and the checks skipped,
        with the reason.

    Raises
    ------
    AssertionError
        Naming the op, the check, the argument and the measured error, for
        the first check that fails. A check in which running the op (or a
        transformation of it) raises fails too, with that exception as the
        ``__cause__``.
    TypeError
        If ``op`` is not a jaxbind op, or an argument is not an array (or a
        scalar).
    ValueError
        If ``fd_rtol`` is not a finite non-negative number.

    Notes
    -----
    Integer and bool outputs are compared exactly (eager against jit, batched
    against the loop) and are not differentiated. With ``fd_rtol``, a jvp
    wrong by more than that accuracy is still caught. It costs a few tenths of
    a second to a few seconds per op, mostly compilations (the batched checks
    are compiled together, as one program).

    Examples
    --------
    >>> from jaxbind.testing import check_op          # doctest: +SKIP
    >>> summary = check_op(op, A, x, factor=2.0)       # doctest: +SKIP
    >>> print(summary)                                 # doctest: +SKIP
    """
    if not isinstance(op, Op):
        raise TypeError(f"check_op takes a jaxbind op, got {type(op).__name__}.")
    name = op.definition.name
    if fd_rtol is not None:
        if (
            isinstance(fd_rtol, bool)
            or not isinstance(fd_rtol, numbers.Real)
            or not math.isfinite(float(fd_rtol))
            or fd_rtol < 0
        ):
            raise ValueError(
                f"check_op: jaxbind op '{name}': fd_rtol must be a finite non-negative number "
                f"(the op's relative accuracy), got {fd_rtol!r}."
            )
        fd_rtol = float(fd_rtol)
    arrays = []
    for i, a in enumerate(args):
        if not isinstance(a, (jax.Array, np.ndarray, np.generic, numbers.Number)) or isinstance(a, str):
            raise TypeError(
                f"check_op: jaxbind op '{name}': argument {i} is a {type(a).__name__}; the "
                "arguments must be arrays (jax or NumPy) or scalars. Pass static values as "
                "keyword arguments."
            )
        arrays.append(jnp.asarray(a))
    previous = config.check_unwritten
    config.check_unwritten = True
    try:
        return Checker(op, arrays, kwargs, fd_rtol).run()
    finally:
        config.check_unwritten = previous

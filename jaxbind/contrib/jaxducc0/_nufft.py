"""The non-uniform FFT with a plan made once per set of points: uniform grid to points, nu2u as the transpose."""

import threading

import ducc0
import numpy as np

from ... import get_linear_call, load_kwargs
from ._common import _COMPLEX_OF, _check_dtype

# ---------------------------------------------------------------------------
# values[j] = sum_k grid[k] exp(-+ i k . coord[j]): linear in the grid (complex), the
# points fixed. ducc0's u2nu computes it; the transpose (JAX's: no conjugation) sums
# over the points with the same sign, which is nu2u with the same `forward`. Both
# run from one plan, made by setup for the points and the grid's shape and kept
# by the op: a new set of points makes a new plan, new grids reuse it.
# ---------------------------------------------------------------------------


def _check_points(coord, shape):
    if len(coord.shape) != 2 or coord.shape[1] != len(shape):
        raise ValueError(
            f"coord must have shape (npoints, {len(shape)}) for a grid of shape {tuple(shape)}, "
            f"got {tuple(coord.shape)}."
        )
    _check_dtype("coord", coord.dtype, (np.dtype(np.float32), np.dtype(np.float64)))


def _u2nu_abstract(coord, grid, *, shape, **kwargs):
    _check_points(coord, shape)
    _check_dtype("the grid", grid.dtype, tuple(_COMPLEX_OF.values()))
    if tuple(grid.shape) != tuple(shape):
        raise ValueError(
            f"the grid must have shape {tuple(shape)} (the keyword argument shape), got {tuple(grid.shape)}."
        )
    if _COMPLEX_OF[np.dtype(coord.dtype)] != np.dtype(grid.dtype):  # (the plan's precision is the points')
        raise TypeError(
            f"coord of {np.dtype(coord.dtype).name} goes with a grid of "
            f"{_COMPLEX_OF[np.dtype(coord.dtype)].name}, got {np.dtype(grid.dtype).name}."
        )
    return (((coord.shape[0],), grid.dtype),)


def _nu2u_abstract(coord, values, *, shape, **kwargs):
    _check_points(coord, shape)
    return ((tuple(shape), values.dtype),)


def _plan(args, kwargs):
    # A ducc0 plan must not run two transforms at once: calls from several threads take turns.
    plan = ducc0.nufft.plan(
        nu2u=False,
        coord=args[0],
        grid_shape=tuple(kwargs["shape"]),
        epsilon=float(kwargs["epsilon"]),
        nthreads=int(kwargs.get("nthreads", 1)),
    )
    return plan, threading.Lock()


def _u2nu(out, args, kwargs_dump, state):
    plan, lock = state
    with lock:
        plan.u2nu(grid=args[1], forward=bool(load_kwargs(kwargs_dump).get("forward", True)), out=out[0])


def _nu2u(out, args, kwargs_dump, state):
    plan, lock = state
    with lock:
        plan.nu2u(points=args[1], forward=bool(load_kwargs(kwargs_dump).get("forward", True)), out=out[0])


nufft = get_linear_call(
    _u2nu,
    _nu2u,
    _u2nu_abstract,
    _nu2u_abstract,
    first_n_args_fixed=1,
    setup=_plan,
    setup_cache=4,
    name="jaxducc0.nufft",
)
nufft.__doc__ = """nufft(coord, grid, *, shape, epsilon, forward=True, nthreads=1)

ducc0's non-uniform FFT (a uniform grid to values at non-uniform points, "type 2")
as a linear jaxbind op whose plan is made once per set of points.

``values[j] = sum_k grid[k] exp(-i k . coord[j])`` (``+i`` with ``forward=False``),
``k`` over the grid's frequencies from ``-n/2`` on each axis; the coordinates are
periodic with period 2 pi. The op is linear in ``grid``; its transpose is
``ducc0``'s ``nu2u`` with the same sign (JAX's convention: the transpose, not the
adjoint). ``coord`` is a fixed argument: the op's setup makes a
``ducc0.nufft.plan`` for it (and ``shape``, ``epsilon``, ``nthreads``) once, and
the forward transform and its transpose use it, for every grid, until other
points come (the op keeps plans for its 4 most recent sets of points). Under
``vmap`` the batch is walked, one ducc0 call per element; a batch of distinct
point sets makes a plan each.

Parameters
----------
coord : jax.Array
    The points, shape ``(npoints, ndim)``, float32 or float64 (fixed: not
    differentiable); its precision is the plan's.
grid : jax.Array
    The grid, shape ``shape``: complex64 with float32 points, complex128 with
    float64 ones.
shape : tuple of int
    The grid's shape (``ndim`` entries), keyword-only.
epsilon : float
    The requested accuracy (> 2e-13; > 1e-6 for complex64), keyword-only.
forward : bool, default True
    The sign of the exponent: ``-i`` when True.
nthreads : int, default 1
    ducc0's threads (0: all hardware threads).

Returns
-------
list of jax.Array
    ``[values]``: shape ``(npoints,)``, the grid's dtype.

Raises
------
ValueError
    If ``coord`` is not of shape ``(npoints, ndim)`` or ``grid`` not of shape
    ``shape`` (raised while tracing, also a :class:`jaxbind.JaxbindError`).
TypeError
    If ``coord`` is not float32 or float64, or ``grid`` not of the complex
    dtype of its precision (also a :class:`jaxbind.JaxbindError`).
"""

"""The fuzzed ops' numba kernels (tests/transforms/test_fuzz_ops.py): the functions in complex128, with
the batch layout worked out by index. Imported only where numba is installed."""

import cmath
import functools

import numpy as np
from numba import njit, types
from numba.extending import overload

import jaxbind


def _to_complex(v):  # pragma: no cover - compiled
    raise NotImplementedError


@overload(_to_complex)
def _to_complex_impl(v):
    if isinstance(v, types.Boolean):
        return lambda v: 1.0 + 0j if v else 0j
    return lambda v: v + 0j


def _store(flat, i, v):  # pragma: no cover - compiled
    raise NotImplementedError


@overload(_store)
def _store_impl(flat, i, v):
    dtype = flat.dtype
    if isinstance(dtype, types.Complex):

        def store(flat, i, v):
            flat[i] = v
    elif isinstance(dtype, types.Float):

        def store(flat, i, v):
            flat[i] = v.real
    elif isinstance(dtype, types.Boolean):

        def store(flat, i, v):
            flat[i] = v.real != 0
    else:

        def store(flat, i, v):
            flat[i] = round(v.real)

    return store


@njit
def _shape(a):
    s = np.empty(a.ndim, np.int64)
    for d, n in enumerate(a.shape):
        s[d] = n
    return s


@njit
def _axes_of(i, levels, axes, can_batch):
    """The batch axes of argument i, oldest level first (-1: mapped at none)."""
    if can_batch:
        return axes[i * levels : (i + 1) * levels].copy()
    return np.arange(levels)  # walked, or the levels in front


@njit
def _logical_dims(ndim, levels, axes):
    """For each dimension of an array, its logical dimension: a batch level, or levels + its core dimension."""
    lvl = np.full(ndim, -1, np.int64)
    if levels > 0 and axes[0] >= 0:
        for level in range(levels):
            lvl[axes[level]] = level
    core = 0
    for d in range(ndim):
        if lvl[d] < 0:
            lvl[d] = levels + core
            core += 1
    return lvl


@njit
def _offsets(shape, lvl, logical):
    """Flat offset into an array of each element of the logical (levels + core) index space;
    size-1 dimensions broadcast."""
    total = 1
    for n in logical:
        total *= n
    strides = np.empty(shape.size, np.int64)
    step = 1
    for d in range(shape.size - 1, -1, -1):
        strides[d] = step
        step *= shape[d]
    offsets = np.zeros(total, np.int64)
    index = np.zeros(logical.size, np.int64)
    for e in range(total):
        rest = e
        for k in range(logical.size - 1, -1, -1):
            index[k] = rest % logical[k]
            rest //= logical[k]
        offset = 0
        for d in range(shape.size):
            if shape[d] > 1:
                offset += index[lvl[d]] * strides[d]
        offsets[e] = offset
    return offsets


@njit
def _put(flat, start, a, shapes, ndims, i):
    """Append ``a``'s elements to ``flat`` as complex128 and record its shape (once per array type)."""
    ndims[i] = a.ndim
    for d, size in enumerate(a.shape):
        shapes[i, d] = size
    values = a.reshape(a.size)
    for e in range(a.size):
        flat[start + e] = _to_complex(values[e])
    return start + a.size


@njit
def _line_up(flat, starts, ndims, shapes, out_shape, levels, axes, can_batch, core, layout):
    """Every argument as a row in the logical (levels + core) order, and the outputs' offsets."""
    n = starts.size
    out_axes = _axes_of(n - 1, levels, axes, can_batch) if can_batch and layout == 1 else np.arange(levels)
    out_lvl = _logical_dims(out_shape.size, levels, out_axes)
    logical = np.empty(levels + core, np.int64)
    for d in range(out_shape.size):
        logical[out_lvl[d]] = out_shape[d]
    out_offsets = _offsets(out_shape, out_lvl, logical)
    values = np.empty((n, out_offsets.size), np.complex128)
    for i in range(n):
        shape = shapes[i, : ndims[i]].copy()
        offsets = _offsets(shape, _logical_dims(ndims[i], levels, _axes_of(i, levels, axes, can_batch)), logical)
        for e in range(offsets.size):
            values[i, e] = flat[starts[i] + offsets[e]]
    return values, out_offsets


@njit
def _take(o, row, offsets):
    """Write one output from its row of results (once per array type)."""
    flat = o.reshape(o.size)
    for e in range(offsets.size):
        _store(flat, offsets[e], row[e])


# The functions on the lined-up values (a row per argument, a column per element), in
# complex128, element by element (loops of scalars compile faster than array expressions).


@njit
def _nb_fixed(v, nf, e):
    F = 1.0 + 0j
    for k in range(nf):
        F *= v[k, e]
    return F


@njit
def _nb_extra(x, code):
    if x.real > 0:
        return 1.0 + 0j
    return -1.0 + 0j if x.real < 0 and code == 2 else 0j


@njit
def _nb_derivative(v, nf, coef, nres, j, e):
    """dy/dx_j; with residuals D_0 from them (f wrote D_0, then int16 arrays of 2, 3, ...)."""
    if j == 0 and nres:
        n_in, D = nf + coef.size, v[nf + coef.size, e]
        for k in range(1, nres):
            D *= v[n_in + k, e] / (k + 1)
        return D
    x = v[nf + j, e]
    return _nb_fixed(v, nf, e) * coef[j] * (cmath.sin(x) + x * cmath.cos(x))


@njit
def nb_lincomb_f(v, nf, coef, factor, extra, nres, n_out):
    r = np.zeros((n_out, v.shape[1]), np.complex128)
    for e in range(v.shape[1]):
        for j in range(coef.size):
            r[0, e] += coef[j] * v[nf + j, e]
        r[0, e] *= _nb_fixed(v, nf, e)
        if extra:
            r[1, e] = _nb_extra(v[nf + coef.size - 1, e], extra)
    return r


@njit
def nb_lincomb_T(v, nf, coef, factor, extra, nres, n_out):  # (*fixed, ct_y[, ct_extra])
    r = np.zeros((n_out, v.shape[1]), np.complex128)
    for e in range(v.shape[1]):
        for j in range(coef.size):
            r[j, e] = coef[j] * _nb_fixed(v, nf, e) * v[nf, e]
    return r


@njit
def nb_scale_f(v, nf, coef, factor, extra, nres, n_out):
    r = np.zeros((n_out, v.shape[1]), np.complex128)
    for e in range(v.shape[1]):
        r[0, e] = factor * v[nf, e]
        if extra:
            r[1, e] = _nb_extra(v[nf, e], extra)
    return r


@njit
def nb_scale_T(v, nf, coef, factor, extra, nres, n_out):
    r = np.zeros((n_out, v.shape[1]), np.complex128)
    for e in range(v.shape[1]):
        r[0, e] = factor * v[nf, e]
    return r


@njit
def nb_product_f(v, nf, coef, factor, extra, nres, n_out):
    r = np.zeros((n_out, v.shape[1]), np.complex128)
    for e in range(v.shape[1]):
        r[0, e] = _nb_fixed(v, nf + coef.size, e)  # F times every x
        if extra:
            r[1, e] = _nb_extra(v[nf + coef.size - 1, e], extra)
    return r


@njit
def nb_product_T(v, nf, coef, factor, extra, nres, n_out):  # (*fixed, *the other x, ct_y[, ct_extra])
    r = np.zeros((n_out, v.shape[1]), np.complex128)
    for e in range(v.shape[1]):
        r[0, e] = _nb_fixed(v, nf + coef.size - 1, e) * v[nf + coef.size - 1, e]
    return r


@njit
def nb_sinmix_f(v, nf, coef, factor, extra, nres, n_out):
    r = np.zeros((n_out, v.shape[1]), np.complex128)
    k = 2 if extra else 1
    for e in range(v.shape[1]):
        for j in range(coef.size):
            r[0, e] += coef[j] * v[nf + j, e] * cmath.sin(v[nf + j, e])
        r[0, e] *= _nb_fixed(v, nf, e)
        if extra:
            r[1, e] = _nb_extra(v[nf + coef.size - 1, e], extra)
        if nres:
            r[k, e] = _nb_derivative(v, nf, coef, 0, 0, e)
        for m in range(1, nres):
            r[k + m, e] = m + 1
    return r


@njit
def nb_sinmix_jvp(v, nf, coef, factor, extra, nres, n_out):  # (*primals, *residuals, *tangents)
    r = np.zeros((n_out, v.shape[1]), np.complex128)
    for e in range(v.shape[1]):
        for j in range(coef.size):
            r[0, e] += _nb_derivative(v, nf, coef, nres, j, e) * v[nf + coef.size + nres + j, e]
    return r


@njit
def nb_sinmix_vjp(v, nf, coef, factor, extra, nres, n_out):  # (*primals, *residuals, ct_y)
    r = np.zeros((n_out, v.shape[1]), np.complex128)
    for e in range(v.shape[1]):
        for j in range(coef.size):
            r[j, e] = _nb_derivative(v, nf, coef, nres, j, e) * v[nf + coef.size + nres, e]
    return r


MAX_RANK = 8  # of any array a kernel meets (2 core dimensions, 3 vmap levels)


@functools.lru_cache(None)
def numba_callback(role, n_args, n_out, can_batch):
    """The numba kernel of ``role`` for ``n_args`` inputs and ``n_out`` outputs.

    Its code is written out for these counts, so that each new signature (dtypes, ranks) it
    meets compiles only these lines: the helpers compile once per array type."""
    compute = globals()["nb_" + role]
    if can_batch:
        layout = ["    levels, axes, layout = kwargs.batch_levels, kwargs.batch_axes, kwargs.layout"]
    else:  # walked, or the levels in front
        layout = ["    levels, axes, layout = out[0].ndim - kwargs.core, np.zeros(0, np.int64), 0"]
    lines = (
        ["def kernel(out, args, kwargs):"]
        + layout
        + [
            f"    flat = np.empty({' + '.join(f'args[{i}].size' for i in range(n_args))}, np.complex128)",
            f"    starts, ndims = np.empty({n_args}, np.int64), np.empty({n_args}, np.int64)",
            f"    shapes = np.ones(({n_args}, {MAX_RANK}), np.int64)",
            "    start = 0",
        ]
    )
    for i in range(n_args):
        lines += [f"    starts[{i}] = start", f"    start = _put(flat, start, args[{i}], shapes, ndims, {i})"]
    lines += [
        f"    values, offsets = _line_up(flat, starts, ndims, shapes, _shape(out[0]), levels, axes, {can_batch},"
        " kwargs.core, layout)",
        f"    results = compute(values, kwargs.nfix, kwargs.coef, kwargs.factor, kwargs.extra, kwargs.nres, {n_out})",
    ] + [f"    _take(out[{k}], results[{k}], offsets)" for k in range(n_out)]
    scope = {"np": np, "_put": _put, "_line_up": _line_up, "_shape": _shape, "_take": _take, "compute": compute}
    exec("\n".join(lines), scope)
    name = f"nb_{role}_{n_args}_{n_out}" + ("_batching" if can_batch else "")
    return jaxbind.numba_kernel(scope["kernel"], name=name)

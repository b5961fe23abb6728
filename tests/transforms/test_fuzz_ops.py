"""Fuzzing the boundary: random op definitions under random compositions of transformations.

Each example draws an op definition and a program, builds the op (once per distinct
definition: ``OPS``), and checks every output of the program (values, shapes, dtypes, the
float0 tangents of integer outputs) against the same program applied to a jax.numpy reference.

The definition (:class:`Definition`) is one of four elementwise functions, each with a jnp
reference and hand-written transposes or derivatives (``F`` is the elementwise product of the
fixed arguments, 1 without any; ``c`` and ``factor`` are keyword arguments of the call):

- ``lincomb``: ``y = F * sum_j c_j x_j``, linear (one joint transpose);
- ``scale``: ``y = factor * x_last``, linear (the fixed arguments are passed, not used);
- ``product``: ``y = F * prod_j x_j``, multilinear (a transpose per ``x_j``);
- ``sinmix``: ``y = F * sum_j c_j x_j sin(x_j)``, nonlinear with jvp and vjp, 0-2 residuals
  (``dy/dx_0``, then int16 arrays the derivatives check by using them).

It has 1-3 arguments, the first ``first_n_args_fixed`` fixed, each float32, float64, complex64
or complex128 (mixed: the result is computed in their result type, and a cotangent is cast
back to its argument's dtype, the real part for a real one); maybe an extra bool, int32 or
int64 output (``real(x_last) > 0``, or its sign), whose tangents are float0;
``func_can_batch`` (the output laid out with the batch levels in front, or like the last
argument) or a ``vmap_method``; ``thread_safe``; and each callback a Python NumPy function, a
numba kernel or, where ``tests/kernels/test_kernels.c`` has one that computes it, a native C
kernel, chosen independently (ops mix them). The numba kernels and the Python callbacks read
the layout of the batch (``batch_axes``, or the leading levels of ``expand_dims`` and
``broadcast_all``) and the function's parameters from the call's kwargs.

The program is 1-3 transformations among ``jit``, ``vmap`` (each argument mapped at axis 0 or
not mapped, size 1-3, nestable), ``jvp``, ``vjp`` and ``grad`` of a real scalar loss (each
derivative with respect to a drawn subset of the differentiable arguments; at most one for the
nonlinear op, which is first order, and two for the linear ones), applied alike to the op and
to the reference.

Bounded for CI: JAXBIND_PROPERTY_EXAMPLES examples (default 25), derandomized so that a run is
reproducible; JAXBIND_PROPERTY_SEED=<int> searches other programs.
"""

import cmath
import dataclasses
import functools
import operator
import os
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import _kernels  # noqa: E402
import jaxbind  # noqa: E402
from _shared import sample  # noqa: E402

try:
    import numba
except ImportError:  # pragma: no cover - numba is an optional dependency
    numba = None

LIB = _kernels.load()
# Examples (random programs): JAXBIND_PROPERTY_EXAMPLES (default 25; each compiles a program or
# two, and the numba kernels compile once per signature). Derandomized, unless
# JAXBIND_PROPERTY_SEED picks another search (hypothesis's seed).
EXAMPLES = int(os.environ.get("JAXBIND_PROPERTY_EXAMPLES", "25"))
SEED = os.environ.get("JAXBIND_PROPERTY_SEED")
BOUNDED = settings(max_examples=EXAMPLES, deadline=None, derandomize=SEED is None, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SEEDED = hypothesis.seed(int(SEED)) if SEED is not None else (lambda test: test)

FLOATING = ("float32", "float64", "complex64", "complex128")
FUNCTIONS = ("lincomb", "scale", "product", "sinmix")
EXTRAS = (None, "bool", "int32", "int64")
VALUES = (-2.0, -1.0, -0.5, 0.5, 1.0, 1.5, 3.0)  # coefficients and factors
KINDS = ("python", "numba") if numba is not None else ("python",)


# ---------------------------------------------------------------------------
# The definition
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Definition:
    function: str
    n_fixed: int
    dtypes: Tuple[str, ...]  # of every argument, the fixed ones first
    extra: Optional[str]  # dtype of the extra (non-differentiable) output, or None
    func_can_batch: bool
    vmap_method: str
    layout: str  # func_can_batch: "front" (levels in front, oldest first) or "last" (like the last argument)
    n_residuals: int
    thread_safe: bool
    kinds: Tuple[str, ...]  # per callback: (f, *transposes) or (f, f_jvp, f_vjp)

    @property
    def n_x(self):
        return len(self.dtypes) - self.n_fixed

    @property
    def linear(self):
        return self.function != "sinmix"

    @property
    def roles(self):
        """The callbacks of the op, in the order of ``kinds``."""
        f = self.function
        if f == "sinmix":
            return ("sinmix_f", "sinmix_jvp", "sinmix_vjp")
        if f == "product":
            return ("product_f",) + ("product_T",) * self.n_x
        return (f + "_f", f + "_T")

    @property
    def result_dtype(self):
        if self.function == "scale":
            return np.dtype(self.dtypes[-1])
        return np.result_type(*map(np.dtype, self.dtypes))

    @property
    def single_precision(self):
        return any(d in ("float32", "complex64") for d in self.dtypes)


def native_kernels_fit(d: Definition) -> bool:
    """Whether one of the C test kernels computes each callback of ``d``.

    They compute one output (no extra output, no residual) from arrays of one element's
    shape or a whole batch in which every input has the same size (not "expand_dims")."""
    if d.extra or d.n_residuals or d.vmap_method == "expand_dims":
        return False
    if d.function == "scale":  # jb_scale (y = factor * in[last]), jb_batched_scale (float64, like in[last])
        return not d.func_can_batch or (d.layout == "last" and set(d.dtypes) == {"float64"})
    if d.function == "product":  # jb_multiply: in[0] * in[1], all of one dtype
        return not d.func_can_batch and len(d.dtypes) == 2 and len(set(d.dtypes)) == 1
    if d.function == "sinmix":  # jb_xsin, jb_xsin_derivative: x sin(x), float64
        return not d.func_can_batch and d.n_fixed == 0 and d.dtypes == ("float64",)
    return False


# How an op's callbacks are chosen: all Python, all numba (each new signature a numba kernel
# meets compiles for 1-2 s, so fewer of them), all native (the definition made to fit the C
# kernels), or each callback on its own among the kinds that fit (a third of them made to fit).
STYLES = ("python",) * 3 + ("mixed",) * 2 + ("numba", "native") if numba is not None else ("python", "native")


@st.composite
def definitions(draw):
    style = draw(st.sampled_from(STYLES))
    function = draw(st.sampled_from(FUNCTIONS[1:] if style == "native" else FUNCTIONS))
    n_x = 1 if function == "scale" else draw(st.integers(1, 3))
    n_fixed = draw(st.integers(0, 3 - n_x))
    func_can_batch = draw(st.booleans())
    vmap_method = "sequential" if func_can_batch else draw(st.sampled_from(jaxbind._arguments.VMAP_METHODS))
    layout = draw(st.sampled_from(["front", "last"])) if func_can_batch else "front"
    dtypes = tuple(draw(st.sampled_from(FLOATING)) for _ in range(n_fixed + n_x))
    extra = draw(st.sampled_from(EXTRAS))
    n_residuals = draw(st.integers(0, 2)) if function == "sinmix" else 0
    if style == "native" or (style == "mixed" and draw(st.integers(0, 2)) == 0):  # made to fit the C kernels
        extra, n_residuals = None, 0
        if vmap_method == "expand_dims":
            vmap_method = draw(st.sampled_from(["sequential", "broadcast_all"]))
        if function == "scale" and func_can_batch:
            layout, dtypes = "last", ("float64",) * len(dtypes)
        elif function == "product":
            func_can_batch, layout = False, "front"
            vmap_method = draw(st.sampled_from(["sequential", "broadcast_all"]))
            n_x = draw(st.integers(1, 2))
            n_fixed = 2 - n_x
            dtypes = (draw(st.sampled_from(FLOATING)),) * 2
        elif function == "sinmix":
            func_can_batch, layout, n_fixed, dtypes = False, "front", 0, ("float64",)
            vmap_method = draw(st.sampled_from(["sequential", "broadcast_all"]))
    d = Definition(function, n_fixed, dtypes, extra, func_can_batch, vmap_method, layout, n_residuals,
                   draw(st.booleans()), ())
    available = KINDS + (("native",) if native_kernels_fit(d) else ())
    if style == "mixed":
        kinds = tuple(draw(st.sampled_from(available)) for _ in d.roles)
    else:
        kinds = (style if style in available else "python",) * len(d.roles)
    return dataclasses.replace(d, kinds=kinds)


# ---------------------------------------------------------------------------
# Python callbacks: NumPy on the arrays lined up (batch levels in front)
# ---------------------------------------------------------------------------


def _cast(value, dtype):
    value = np.asarray(value)
    if np.iscomplexobj(value) and not np.issubdtype(dtype, np.complexfloating):
        value = value.real  # the transpose of a real -> complex promotion
    return value.astype(dtype)


def _fixed_product(a, nf, dt):
    return functools.reduce(operator.mul, [x.astype(dt) for x in a[:nf]], np.ones((), dt))


def _extra_value(x, code):
    return np.real(x) > 0 if code == 1 else np.sign(np.real(x))


def py_lincomb_f(a, kw, dts):
    nf, c, dt = kw["nfix"], kw["coef"], dts[0]
    y = _fixed_product(a, nf, dt) * sum(cj * a[nf + j].astype(dt) for j, cj in enumerate(c))
    return [y] + ([_extra_value(a[nf + len(c) - 1], kw["extra"])] if kw["extra"] else [])


def py_lincomb_T(a, kw, dts):  # (*fixed, ct_y[, ct_extra])
    nf = kw["nfix"]
    ct = a[nf]
    F = _fixed_product(a, nf, ct.dtype)
    return [cj * F * ct for cj in kw["coef"]]


def py_scale_f(a, kw, dts):
    x = a[kw["nfix"]]
    return [kw["factor"] * x] + ([_extra_value(x, kw["extra"])] if kw["extra"] else [])


def py_scale_T(a, kw, dts):
    return [kw["factor"] * a[kw["nfix"]]]


def py_product_f(a, kw, dts):
    nf, nx, dt = kw["nfix"], len(kw["coef"]), dts[0]
    y = functools.reduce(operator.mul, [a[nf + j].astype(dt) for j in range(nx)], _fixed_product(a, nf, dt))
    return [y] + ([_extra_value(a[nf + nx - 1], kw["extra"])] if kw["extra"] else [])


def py_product_T(a, kw, dts):  # (*fixed, *the other x, ct_y[, ct_extra])
    nf, nx = kw["nfix"], len(kw["coef"])
    ct = a[nf + nx - 1]
    others = [x.astype(ct.dtype) for x in a[nf:nf + nx - 1]]
    return [functools.reduce(operator.mul, others, _fixed_product(a, nf, ct.dtype)) * ct]


def _sinmix_derivatives(a, kw, dt, residuals):
    """D_j = dy/dx_j; with residuals D_0 from them (f wrote D_0, then int16 arrays of 2, 3, ...)."""
    nf, c = kw["nfix"], kw["coef"]
    F = _fixed_product(a, nf, dt)
    xs = [a[nf + j].astype(dt) for j in range(len(c))]
    D = [F * cj * (np.sin(x) + x * np.cos(x)) for cj, x in zip(c, xs)]
    if residuals:
        D[0] = functools.reduce(operator.mul, [(r / (k + 2)).astype(dt) for k, r in enumerate(residuals[1:])],
                                residuals[0].astype(dt))
    return D


def py_sinmix_f(a, kw, dts):
    nf, c, dt = kw["nfix"], kw["coef"], dts[0]
    xs = [a[nf + j].astype(dt) for j in range(len(c))]
    outs = [_fixed_product(a, nf, dt) * sum(cj * x * np.sin(x) for cj, x in zip(c, xs))]
    if kw["extra"]:
        outs.append(_extra_value(a[nf + len(c) - 1], kw["extra"]))
    if kw["nres"]:
        outs.append(_sinmix_derivatives(a, kw, dt, ())[0])
        outs += [np.int16(k + 2) for k in range(kw["nres"] - 1)]
    return outs


def py_sinmix_jvp(a, kw, dts):  # (*primals, *residuals, *tangents of the x)
    n_in, nres, dt = kw["nfix"] + len(kw["coef"]), kw["nres"], dts[0]
    D = _sinmix_derivatives(a, kw, dt, a[n_in:n_in + nres])
    return [sum(Dj * t.astype(dt) for Dj, t in zip(D, a[n_in + nres:]))]


def py_sinmix_vjp(a, kw, dts):  # (*primals, *residuals, ct_y)
    n_in, nres = kw["nfix"] + len(kw["coef"]), kw["nres"]
    ct = a[n_in + nres]
    return [Dj * ct for Dj in _sinmix_derivatives(a, kw, ct.dtype, a[n_in:n_in + nres])]


def _python(compute, name):
    """A Python callback that lines its arguments up, computes, and writes in the op's layout."""

    def callback(out, args, kwargs_dump):
        kw = jaxbind.load_kwargs(kwargs_dump)
        axes = kw.get("batch_axes")
        views = list(out)
        if axes is not None:  # func_can_batch: move every level to the front, oldest first
            levels = range(max(len(ax) for ax in axes))
            args = [np.moveaxis(x, ax, levels) if ax else x for x, ax in zip(args, axes)]
            if kw["layout"] == 1:  # the outputs are laid out like the last argument
                views = [np.moveaxis(o, axes[-1], levels) for o in out]
        # (else: walked, or the levels in front with size 1 where not mapped: broadcasting)
        for view, value in zip(views, compute(args, kw, [o.dtype for o in out])):
            view[...] = _cast(value, view.dtype)

    callback.__name__ = callback.__qualname__ = name
    return callback


PYTHON = {name[3:]: _python(fn, name) for name, fn in dict(globals()).items() if name.startswith("py_")}


# ---------------------------------------------------------------------------
# numba kernels: the same in complex128, with the batch layout worked out by index
# ---------------------------------------------------------------------------

if numba is not None:
    from numba import njit, types
    from numba.extending import overload

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
            return axes[i * levels:(i + 1) * levels].copy()
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
            shape = shapes[i, :ndims[i]].copy()
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
        lines = ["def kernel(out, args, kwargs):"] + layout + [
            f"    flat = np.empty({' + '.join(f'args[{i}].size' for i in range(n_args))}, np.complex128)",
            f"    starts, ndims = np.empty({n_args}, np.int64), np.empty({n_args}, np.int64)",
            f"    shapes = np.ones(({n_args}, {MAX_RANK}), np.int64)",
            "    start = 0",
        ]
        for i in range(n_args):
            lines += [f"    starts[{i}] = start", f"    start = _put(flat, start, args[{i}], shapes, ndims, {i})"]
        lines += [
            f"    values, offsets = _line_up(flat, starts, ndims, shapes, _shape(out[0]), levels, axes, {can_batch},"
            " kwargs.core, layout)",
            "    results = compute(values, kwargs.nfix, kwargs.coef, kwargs.factor, kwargs.extra, kwargs.nres, "
            f"{n_out})",
        ] + [f"    _take(out[{k}], results[{k}], offsets)" for k in range(n_out)]
        scope = {"np": np, "_put": _put, "_line_up": _line_up, "_shape": _shape, "_take": _take, "compute": compute}
        exec("\n".join(lines), scope)
        name = f"nb_{role}_{n_args}_{n_out}" + ("_batching" if can_batch else "")
        return jaxbind.numba_kernel(scope["kernel"], name=name)


NATIVE = {
    ("scale_f", False): LIB.jb_scale, ("scale_T", False): LIB.jb_scale,
    ("scale_f", True): LIB.jb_batched_scale, ("scale_T", True): LIB.jb_batched_scale,
    ("product_f", False): LIB.jb_multiply, ("product_T", False): LIB.jb_multiply,
    ("sinmix_f", False): LIB.jb_xsin, ("sinmix_jvp", False): LIB.jb_xsin_derivative,
    ("sinmix_vjp", False): LIB.jb_xsin_derivative,
}


# ---------------------------------------------------------------------------
# Abstracts and the op
# ---------------------------------------------------------------------------


def _layout(args, batch_axes, layout):
    """The outputs' shape and, with func_can_batch, the newest level's axis."""
    if batch_axes is None:
        return tuple(args[-1].shape), None
    levels = max(len(ax) for ax in batch_axes)
    if layout == "last":
        return tuple(args[-1].shape), batch_axes[-1][-1]
    shape, axes = next((a.shape, ax) for a, ax in zip(args, batch_axes) if ax)
    return tuple(shape[k] for k in axes) + tuple(n for k, n in enumerate(shape) if k not in axes), levels - 1


def _abstract(dtypes, layout):
    def abstract(*args, batch_axes=None, **kwargs):
        shape, axis = _layout(args, batch_axes, layout)
        return tuple((shape, dt) if axis is None else (shape, dt, axis) for dt in dtypes)

    return abstract


def counts(d: Definition, role):
    """How many inputs and outputs the callback of ``role`` has."""
    n_in, n_outputs = len(d.dtypes), 1 + bool(d.extra)  # (a transpose gets a cotangent of every output)
    return {"f": (n_in, n_outputs + d.n_residuals),
            "lincomb_T": (d.n_fixed + n_outputs, d.n_x), "scale_T": (d.n_fixed + n_outputs, 1),
            "product_T": (n_in - 1 + n_outputs, 1),
            "sinmix_jvp": (n_in + d.n_residuals + d.n_x, 1),  # the float output's tangent only
            "sinmix_vjp": (n_in + d.n_residuals + 1, d.n_x)}[role if role in COUNTED else "f"]


COUNTED = ("lincomb_T", "scale_T", "product_T", "sinmix_jvp", "sinmix_vjp")


def _callback(d, role, kind):
    if kind == "python":
        return PYTHON[role]
    if kind == "numba":
        return numba_callback(role, *counts(d, role), d.func_can_batch)
    return NATIVE[role, d.func_can_batch]


OPS = {}  # Definition -> op: each distinct definition is made once


def make_op(d: Definition):
    if d in OPS:
        return OPS[d]
    rt, xs = d.result_dtype, [np.dtype(t) for t in d.dtypes[d.n_fixed:]]
    outputs = [rt] + ([np.dtype(d.extra)] if d.extra else [])
    callbacks = [_callback(d, role, kind) for role, kind in zip(d.roles, d.kinds)]
    flags = dict(first_n_args_fixed=d.n_fixed, func_can_batch=d.func_can_batch, vmap_method=d.vmap_method,
                 thread_safe=d.thread_safe, name=f"fuzz{len(OPS)}_{d.function}")
    if d.function == "sinmix":
        residuals = [rt] + [np.dtype(np.int16)] * (d.n_residuals - 1) if d.n_residuals else []
        op = jaxbind.get_nonlinear_call(callbacks[0], tuple(callbacks[1:]), _abstract(outputs + residuals, d.layout),
                                        _abstract(xs, d.layout), n_residuals=d.n_residuals, **flags)
    elif d.function == "product":
        op = jaxbind.get_linear_call(callbacks[0], tuple(callbacks[1:]), _abstract(outputs, d.layout),
                                     tuple(_abstract([x], d.layout) for x in xs), **flags)
    else:
        op = jaxbind.get_linear_call(callbacks[0], callbacks[1], _abstract(outputs, d.layout),
                                     _abstract(xs, d.layout), **flags)
    OPS[d] = op
    return op


def reference(d: Definition, kwargs):
    """The op's outputs in jax.numpy."""
    nf, coef, factor = d.n_fixed, kwargs["coef"], kwargs["factor"]

    def ref(*args):
        if d.function == "scale":
            y = factor * args[-1]
        else:
            dt = jnp.result_type(*args)
            a = [x.astype(dt) for x in args]
            F = functools.reduce(operator.mul, a[:nf], 1.0)
            if d.function == "lincomb":
                y = F * sum(c * x for c, x in zip(coef, a[nf:]))
            elif d.function == "product":
                y = F * functools.reduce(operator.mul, a[nf:])
            else:
                y = F * sum(c * x * jnp.sin(x) for c, x in zip(coef, a[nf:]))
        if d.extra is None:
            return (y,)
        extra = jnp.real(args[-1]) > 0 if d.extra == "bool" else jnp.sign(jnp.real(args[-1])).astype(d.extra)
        return (y, extra)

    return ref


# ---------------------------------------------------------------------------
# Transformations, applied alike to the op's program and the reference's
# ---------------------------------------------------------------------------


def _inexact(dtype):
    return jnp.issubdtype(dtype, jnp.inexact)


def _loss(outs):
    """A real scalar of every float or complex output (linear and quadratic terms)."""
    total = 0.0
    for k, o in enumerate(outs):
        if not _inexact(o.dtype):
            continue
        real = jnp.real(o)
        w = np.cos(0.7 * np.arange(o.size) + k).reshape(o.shape).astype(real.dtype)
        total = total + jnp.sum(w * real) + 0.25 * jnp.sum(real * real)
        if jnp.iscomplexobj(o):
            imag = jnp.imag(o)
            total = total + jnp.sum(w[::-1] * imag if o.ndim else w * imag) + 0.25 * jnp.sum(imag * imag)
    return total


def _substitute(fn, args, argnums):
    def inner(*values):
        full = list(args)
        for i, v in zip(argnums, values):
            full[i] = v
        return fn(*full)

    return inner


def t_jvp(fn, n, argnums):
    def program(*args):
        primals, tangents = args[:n], args[n:]
        out, tout = jax.jvp(_substitute(fn, primals, argnums), tuple(primals[i] for i in argnums), tuple(tangents))
        return tuple(out) + tuple(tout)

    return program


def t_vjp(fn, n, argnums):
    def program(*args):
        primals, cts = args[:n], iter(args[n:])
        out, pullback = jax.vjp(_substitute(fn, primals, argnums), *(primals[i] for i in argnums))
        full = tuple(next(cts) if _inexact(o.dtype) else np.zeros(o.shape, jax.dtypes.float0) for o in out)
        return tuple(out) + tuple(pullback(full))

    return program


def t_grad(fn, argnums):
    grad = jax.grad(lambda *args: _loss(fn(*args)), argnums=argnums)
    return lambda *args: tuple(grad(*args))


def build_program(data, d: Definition, op, kwargs, core):
    """Draw transformations; returns (op program, reference program, argument specs, description)."""
    ours = lambda *args: tuple(op(*args, **kwargs))  # noqa: E731
    ref = reference(d, kwargs)
    specs = [(core, np.dtype(t)) for t in d.dtypes]
    diff = list(range(d.n_fixed, len(specs)))  # the arguments that may be differentiated
    derivatives_left = 2 if d.linear else 1
    steps = []
    for _ in range(data.draw(st.integers(1, 3), label="transformations")):
        choices = ["vmap"] + (["grad", "vjp", "jvp"] if derivatives_left else []) + ["jit"]
        t = data.draw(st.sampled_from(choices), label="transformation")
        if t in ("jvp", "vjp", "grad"):
            derivatives_left -= 1
            argnums = tuple(sorted(data.draw(st.lists(st.sampled_from(diff), min_size=1, unique=True),
                                             label=f"{t} argnums")))
        n = len(specs)
        if t == "jit":
            ours = jax.jit(ours)
            steps.append("jit")
        elif t == "vmap":
            size = data.draw(st.integers(1, 3), label="vmap size")
            axes = [data.draw(st.sampled_from([0, None]), label="in_axes") for _ in specs]
            if all(a is None for a in axes):
                axes[data.draw(st.integers(0, n - 1), label="mapped argument")] = 0
            ours, ref = jax.vmap(ours, in_axes=tuple(axes)), jax.vmap(ref, in_axes=tuple(axes))
            specs = [(s if a is None else (size,) + s, dt) for (s, dt), a in zip(specs, axes)]
            steps.append(f"vmap(in_axes={tuple(axes)}, size={size})")
        elif t == "jvp":
            ours, ref = t_jvp(ours, n, argnums), t_jvp(ref, n, argnums)
            specs = specs + [specs[i] for i in argnums]
            diff = diff + list(range(n, len(specs)))
            steps.append(f"jvp(argnums={argnums})")
        elif t == "vjp":
            outs = jax.eval_shape(ref, *(jax.ShapeDtypeStruct(s, dt) for s, dt in specs))
            ours, ref = t_vjp(ours, n, argnums), t_vjp(ref, n, argnums)
            specs = specs + [(o.shape, o.dtype) for o in outs if _inexact(o.dtype)]
            diff = diff + list(range(n, len(specs)))
            steps.append(f"vjp(argnums={argnums})")
        else:
            ours, ref = t_grad(ours, argnums), t_grad(ref, argnums)
            steps.append(f"grad(loss, argnums={argnums})")
    return ours, ref, specs, " . ".join(reversed(steps))


# ---------------------------------------------------------------------------
# The test
# ---------------------------------------------------------------------------

def tolerance(d: Definition, want):
    tol = 2e-4 if d.single_precision else 1e-10
    scale = float(np.max(np.abs(want))) if want.size else 1.0
    return dict(rtol=tol, atol=tol * max(1.0, scale))


@SEEDED
@BOUNDED
@given(d=definitions(), core=st.lists(st.integers(1, 3), max_size=2).map(tuple),
       coef=st.lists(st.sampled_from(VALUES), min_size=3, max_size=3), factor=st.sampled_from(VALUES),
       seed=st.integers(0, 2**16), data=st.data())
def test_random_ops_under_random_transformations_match_jax_numpy(d, core, coef, factor, seed, data):
    if d.function == "sinmix" and "native" in d.kinds:
        coef = [1.0] * 3  # jb_xsin computes x sin(x)
    kwargs = dict(nfix=d.n_fixed, coef=tuple(float(c) for c in coef[:d.n_x]), factor=float(factor),
                  core=len(core), layout=int(d.layout == "last"),
                  extra={None: 0, "bool": 1}.get(d.extra, 2), nres=d.n_residuals)
    op = make_op(d)
    ours, ref, specs, description = build_program(data, d, op, kwargs, core)
    note(f"program: {description}; arguments {[(s, dt.name) for s, dt in specs]}; kwargs {kwargs}")
    args = [sample(dt, s, seed=seed + k) for k, (s, dt) in enumerate(specs)]
    got, want = jax.tree.leaves(ours(*args)), jax.tree.leaves(ref(*args))
    assert len(got) == len(want), description
    values = 0
    for k, (g, w) in enumerate(zip(got, want)):
        g, w = np.asarray(g), np.asarray(w)
        message = f"output {k} of {description}"
        assert g.shape == w.shape and g.dtype == w.dtype, f"{message}: {g.shape} {g.dtype} != {w.shape} {w.dtype}"
        if w.dtype == jax.dtypes.float0:
            continue  # the tangent of an integer output: nothing but its shape
        if _inexact(w.dtype):
            np.testing.assert_allclose(g, w, err_msg=message, **tolerance(d, w))
        else:
            np.testing.assert_array_equal(g, w, err_msg=message)
        values += w.size
    assert values > 0, description  # every example checks values

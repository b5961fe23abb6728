"""The fuzzed ops' Python callbacks (tests/transforms/test_fuzz_ops.py): NumPy on the arguments lined up
(batch levels in front), written in the op's layout."""

import functools
import operator

import numpy as np

import jaxbind


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
    others = [x.astype(ct.dtype) for x in a[nf : nf + nx - 1]]
    return [functools.reduce(operator.mul, others, _fixed_product(a, nf, ct.dtype)) * ct]


def _sinmix_derivatives(a, kw, dt, residuals):
    """D_j = dy/dx_j; with residuals D_0 from them (f wrote D_0, then int16 arrays of 2, 3, ...)."""
    nf, c = kw["nfix"], kw["coef"]
    F = _fixed_product(a, nf, dt)
    xs = [a[nf + j].astype(dt) for j in range(len(c))]
    D = [F * cj * (np.sin(x) + x * np.cos(x)) for cj, x in zip(c, xs)]
    if residuals:
        D[0] = functools.reduce(
            operator.mul, [(r / (k + 2)).astype(dt) for k, r in enumerate(residuals[1:])], residuals[0].astype(dt)
        )
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
    D = _sinmix_derivatives(a, kw, dt, a[n_in : n_in + nres])
    return [sum(Dj * t.astype(dt) for Dj, t in zip(D, a[n_in + nres :]))]


def py_sinmix_vjp(a, kw, dts):  # (*primals, *residuals, ct_y)
    n_in, nres = kw["nfix"] + len(kw["coef"]), kw["nres"]
    ct = a[n_in + nres]
    return [Dj * ct for Dj in _sinmix_derivatives(a, kw, ct.dtype, a[n_in : n_in + nres])]


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

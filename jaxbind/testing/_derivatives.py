"""Checks of nonlinear ops' derivatives: the jvp against finite differences, the vjp against the jvp."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ._numerics import (
    FD_LADDER,
    FD_MAX_STEP,
    FD_POINTS,
    FD_WEIGHTS,
    MEANINGFUL,
    _eps,
    _growth,
    _norm,
    _pair,
    _relative,
    _size,
    _wide,
    _Worst,
)


class DerivativeChecks:
    """The jvp against finite differences and the vjp against the jvp, of nonlinear ops (mixed into the checker)."""

    def f_of_one(self, i):
        def f(x):
            args = list(self.args)
            args[i] = x
            return self.call(*args)

        return f

    def check_jvp_and_vjp(self):
        for i in self.differentiable():
            self.check_fd(i)
            self.check_vjp(i)

    def tangent(self, x0):
        """A random tangent ``v`` with ``|v| <= |x0|`` elementwise (``|x0|`` where zero: the rms of x0, or 1).

        Central differences ``x0 + k e v``, ``|k e| <= 2 FD_MAX_STEP < 1``,
        then never cross zero for an element that is not zero: a function
        defined for positive values (log, sqrt) is evaluated in its domain.
        """
        x = _wide(x0)
        scale = np.abs(x)
        nonzero = scale[scale > 0]
        fallback = float(np.sqrt(np.mean(nonzero**2))) if nonzero.size else 1.0
        scale = np.where(scale > 0, scale, fallback)
        magnitude = self.rng.uniform(0.5, 1.0, x.shape)
        if x.dtype.kind == "c":
            t = magnitude * np.exp(2j * np.pi * self.rng.uniform(size=x.shape))
        else:
            t = magnitude * self.rng.choice([-1.0, 1.0], x.shape)
        return scale * t

    def check_fd(self, i):
        """The jvp in argument i against fourth-order central differences, output by output.

        The step is ``e |x|`` per element, ``e = min((eps/2)^(1/5), 0.2)`` for
        the coarsest precision involved (it balances rounding against
        truncation). An output that disagrees there is tried at e/10 and
        e/100 (a kink, a function varying on a scale finer than |x|); one
        whose rounding tolerance at e is too coarse to be meaningful (a large
        offset, a low precision) at larger steps, up to 0.2, where a
        disagreement may be truncation and is reported as skipped. The
        differences are compared with the jvp of the tangent they actually
        took (the points are rounded to the argument's dtype). The tolerance
        is the rounding model: the outputs' rounding, magnified by 1/e, plus
        the jvp's own, plus ``fd_rtol`` times the jvp.
        """
        check = "jvp against central differences"
        argument = f"argument {i}"
        x0 = self.args[i]
        dtype = np.dtype(x0.dtype)
        f = self.f_of_one(i)
        x = _wide(x0)
        v = self.tangent(x0)
        g = _growth(max([_size(x0)] + [_size(o) for o in self.outs] + [1]))
        coarsest = max([_eps(dtype)] + [self.eps(self.outs[j].dtype) for j in self.inexact_outputs])
        first = min(FD_MAX_STEP, (coarsest / 2) ** 0.2)
        evaluated = {}

        def at(e):
            """The jvp and f at the points of step e: evaluated once, for every output."""
            if e not in evaluated:
                points = [jnp.asarray((x + (k * e) * v).astype(dtype)) for k in FD_POINTS]
                taken = sum(w * (_wide(p) - x) for w, p in zip(FD_WEIGHTS, points)) / e
                t = jnp.asarray(taken.astype(dtype))
                _, jv = self.attempt(check, argument, lambda: jax.jvp(f, (x0,), (t,)))
                if not evaluated:
                    for j in self.inexact_outputs:
                        o = self.outs[j]
                        if (jv[j].shape, jv[j].dtype) != (o.shape, o.dtype):
                            self.fail(
                                check,
                                argument,
                                f"the tangent of output {j} has shape {jv[j].shape} and "
                                f"dtype {jv[j].dtype}, but the output has {o.shape} {o.dtype} (check what "
                                "the abstract declares when called with the tangents)",
                            )
                    self.finite(check, argument, "tangent of output", [(j, jv[j]) for j in self.inexact_outputs])
                values = [self.attempt(check, argument, lambda p=p: f(p)) for p in points]
                evaluated[e] = (jv, values)
            return evaluated[e]

        def measure(j, e):
            """(error, tolerance, magnitude, e) of output j at step e; error inf where f is not finite."""
            jv, values = at(e)
            fd = sum(w * _wide(val[j]) for w, val in zip(FD_WEIGHTS, values)) / e
            jn = _norm(jv[j])
            if not np.all(np.isfinite(fd)):
                return math.inf, 0.0, jn, e
            rounding = sum(abs(w) * _norm(val[j]) for w, val in zip(FD_WEIGHTS, values)) / e
            tolerance = g * self.eps(self.outs[j].dtype) * (rounding + jn) + (self.fd_rtol or 0.0) * jn
            return _norm(fd - _wide(jv[j])), tolerance, max(_norm(fd), jn), e

        label = (lambda j: f"{argument}, output {j}") if len(self.inexact_outputs) > 1 else (lambda j: argument)
        worst = _Worst()
        for j in self.inexact_outputs:
            r, tried = _fd_search(lambda e, j=j: measure(j, e), first)
            if r[0] > r[1] and r[3] <= first:
                self._fd_disagrees(check, label(j), tried)
            if r[0] > r[1] or not _meaningful(r):
                self._fd_too_coarse(check, label(j), j, dtype, r)
                continue
            worst.offer(_relative(r[0], r[2]), _relative(r[1], r[2]))
        worst.report(self.summary, check, argument)

    def _fd_disagrees(self, check, where, tried):
        """Report a jvp that disagrees with finite differences at every step tried."""
        miss = min(tried, key=_fd_ratio)
        rtol = f"plus fd_rtol={self.fd_rtol:g} of the jvp" if self.fd_rtol is not None else "no fd_rtol given"
        steps = ", ".join(f"{t[3]:.2g}" for t in tried)
        detail = (
            f"the jvp disagrees with finite differences of f at every step tried ({steps} times "
            "each element's magnitude)"
        )
        if miss[0] == math.inf:
            detail = (
                f"finite differences of f are not finite at a step of {miss[3]:.2g} times each "
                "element's magnitude (f leaves its domain, or is not finite near the arguments)"
            )
        self.fail(
            check,
            where,
            detail,
            _relative(miss[0], miss[2]),
            _relative(miss[1], miss[2]),
            hint=f"The tolerance is the rounding model's ({rtol}). If f is computed to an accuracy of its "
            "own (an iterative or adaptive solver, an interpolation table), pass fd_rtol= its "
            "relative accuracy: the jvp may then differ from finite differences by that much more, "
            "and a jvp wrong by more is still caught.",
        )

    def _fd_too_coarse(self, check, where, j, dtype, r):
        """Skip, with the reason, an output whose finite differences cannot decide."""
        why = (
            f"the rounding tolerance, {_relative(r[1], r[2]):.2g} relative at a step of {r[3]:.2g} times "
            "each element's magnitude, would let a 100 % error pass"
            if not _meaningful(r)
            else f"at the step of {r[3]:.2g} times each element's magnitude where rounding allows a "
            f"meaningful check, the disagreement ({_relative(r[0], r[2]):.2g} relative) may be "
            "truncation"
        )
        self.summary.skip(
            f"{check} for {where}: {self.outs[j].dtype} outputs of {dtype} arguments are "
            f"too coarse for finite differences ({why}); the vjp is still checked against "
            "the jvp"
        )

    def check_vjp(self, i):
        """``<vjp(c), t> == <c, jvp(t)>``: probes that catch a wrong vjp and a wrong jvp (as the dot test)."""
        check = "vjp against jvp: <vjp(c),t> == <c,jvp(t)>"
        argument = f"argument {i}"
        x0 = self.args[i]
        f = self.f_of_one(i)
        complex_data = True  # complex data wherever a dtype is complex
        t = self.random(x0.shape, x0.dtype)
        _, jv = self.attempt(check, argument, lambda: jax.jvp(f, (x0,), (t,)))
        _, pullback = self.attempt(check, argument, lambda: jax.vjp(f, x0))
        n = max([_size(x0)] + [_size(o) for o in self.outs] + [1])
        g = _growth(n)
        probes = []
        for j in self.inexact_outputs:
            c = self.probe(jv[j], self.declared[j], complex_data)
            (ct,) = self.attempt(check, argument, lambda c=c, j=j: pullback(self.zero_cotangents({j: c})))
            self.finite(check, argument, "vjp for argument", [(i, ct)])
            probes.append((f"a cotangent on output {j} alone", t, ct, {j: c}, jv))
        cs = {
            j: self.random(self.declared[j].shape, self.declared[j].dtype, complex_data) for j in self.inexact_outputs
        }
        (ct,) = self.attempt(check, argument, lambda: pullback(self.zero_cotangents(cs)))
        self.finite(check, argument, "vjp for argument", [(i, ct)])
        t2 = self.probe(ct, x0, complex_data)
        _, jv2 = self.attempt(check, argument, lambda: jax.jvp(f, (x0,), (t2,)))
        self.finite(check, argument, "tangent of output", [(j, jv2[j]) for j in self.inexact_outputs])
        probes.append(("random cotangents", t2, ct, cs, jv2))
        worst = _Worst()
        for what, t_, ct_, cs_, jv_ in probes:
            lhs = _pair(ct_, t_)
            rhs = sum(_pair(c, jv_[j]) for j, c in cs_.items())
            tol = g * (
                self.eps(x0.dtype) * _norm(ct_) * _norm(t_)
                + sum(self.eps(jv_[j].dtype) * _norm(c) * _norm(jv_[j]) for j, c in cs_.items())
            )
            self.pairing(check, argument, what, lhs, rhs, tol, "<vjp(c), t> == <c, jvp(t)>", "", worst)
        worst.report(self.summary, check, argument)


def _meaningful(r) -> bool:
    """Whether a measurement's tolerance is fine enough to catch a 100 % error (MEANINGFUL)."""
    return r[0] == 0 or r[1] < MEANINGFUL * r[2]


def _fd_ratio(r) -> float:
    return r[0] / r[1] if r[1] else (0.0 if r[0] == 0 else math.inf)


def _fd_search(measure, first):
    """The measurement (error, tolerance, magnitude, step) that decides an output, and the smaller steps tried.

    A disagreement at the first step is tried at smaller ones (truncation, a kink); a tolerance too coarse
    to mean anything, at larger ones up to FD_MAX_STEP (rounding hides the derivative).
    """
    r = measure(first)
    tried = [r]
    if _meaningful(r) and r[0] > r[1]:
        for fraction in FD_LADDER[1:]:  # truncation or a kink: smaller steps
            s_ = measure(first * fraction)
            if not _meaningful(s_):
                break
            tried.append(s_)
            if s_[0] <= s_[1]:
                r = s_
                break
    elif not _meaningful(r) and r[0] <= r[1]:
        e = first
        while e < FD_MAX_STEP:  # rounding hides the derivative: larger steps
            e = min(FD_MAX_STEP, 10 * e)
            s_ = measure(e)
            if _meaningful(s_):
                r = s_  # agreeing or not: the closest a meaningful check comes
                break
    return r, tried

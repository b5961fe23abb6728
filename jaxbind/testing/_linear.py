"""Checks of linear and multilinear ops: linearity (joint and per argument) and the dot-product test."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ._numerics import MEANINGFUL, _growth, _inexact, _is_complex, _norm, _pair, _relative, _size, _wide, _Worst


class LinearChecks:
    """Linearity and the dot-product tests of linear and multilinear ops (mixed into the checker)."""

    def linear_groups(self):
        """The linear arguments checked on their own, and (linear ops) all together."""
        d = self.definition
        linear = list(range(self.n_fixed, len(self.args)))
        for i in linear:
            if not _inexact(self.args[i].dtype):
                self.summary.skip(f"transposes for argument {i} ({self.args[i].dtype}: not differentiable)")
        linear = [i for i in linear if _inexact(self.args[i].dtype)]
        groups = [(f"argument {i}", [i]) for i in linear]
        if d.kind == "linear" and len(linear) > 1:
            groups.append((f"arguments {', '.join(map(str, linear))} jointly", linear))
        return groups

    def f_of(self, idx):
        """f as a function of the arguments ``idx``; a linear op's other linear arguments are zero."""
        d = self.definition

        def f(*xs):
            args = list(self.args)
            if d.kind == "linear":
                args = args[: self.n_fixed] + [jnp.zeros_like(a) for a in args[self.n_fixed :]]
            for i, x in zip(idx, xs):
                args[i] = x
            return self.call(*args)

        return f

    def check_linearity(self):
        """f(a x + b x') == a f(x) + b f(x'), the linear arguments together (linear) or one at a time."""
        d = self.definition
        check = "linearity: f(a x + b x') == a f(x) + b f(x')"
        groups = self.linear_groups()
        if d.kind == "linear":
            groups = groups[-1:]  # all linear arguments jointly
        alpha, beta = 0.75, -1.5  # a + b != 1: an affine map is caught too
        complex_data = any(_is_complex(self.args[i].dtype) for _, idx in groups for i in idx)
        for label, idx in groups:
            f = self.f_of(idx)
            xs = [self.random(self.args[i].shape, self.args[i].dtype, complex_data) for i in idx]
            xs2 = [self.random(self.args[i].shape, self.args[i].dtype, complex_data) for i in idx]
            mixed = [jnp.asarray((alpha * _wide(a) + beta * _wide(b)).astype(a.dtype)) for a, b in zip(xs, xs2)]
            f1, f2, f3 = (self.attempt(check, label, lambda v=v, f=f: f(*v)) for v in (xs, xs2, mixed))
            for fs in (f1, f2, f3):
                self.finite(check, label, "output", enumerate(fs))
            worst = _Worst()
            for j in self.inexact_outputs:
                want = alpha * _wide(f1[j]) + beta * _wide(f2[j])
                error, magnitude = _norm(_wide(f3[j]) - want), abs(alpha) * _norm(f1[j]) + abs(beta) * _norm(f2[j])
                n = max([_size(f3[j])] + [_size(x) for x in xs])
                # The three evaluations' rounding and that of the mixed input (relative to the inputs).
                tolerance = _growth(n) * self.eps(f3[j].dtype) * (magnitude + _norm(f3[j]))
                if not error <= tolerance:
                    self.fail(
                        check,
                        f"{label}, output {j}",
                        "f is not linear: f(a x + b x') differs from "
                        "a f(x) + b f(x') (an affine map, a term in a product of linear arguments)",
                        error / magnitude if magnitude else math.inf,
                        tolerance / magnitude if magnitude else 0,
                    )
                if magnitude > 0 and error > 0 and not tolerance < MEANINGFUL * magnitude:
                    self.summary.skip(
                        f"{check} for {label}, output {j}: {f3[j].dtype} is too coarse (the rounding "
                        f"tolerance, {tolerance / magnitude:.2g} relative, would let a 100 % error pass)"
                    )
                    continue
                worst.offer(_relative(error, magnitude), _relative(tolerance, magnitude) if magnitude else 0.0)
            worst.report(self.summary, check, label)

    def dot_test(self, check, label, idx, complex_data):
        """The dot-product test for arguments ``idx``: probes that catch a wrong f or a wrong f_T.

        Each output alone, with a cotangent pairing with f(x) positively (a
        wrong or zero transpose then shows as an error of order 1); then
        random cotangents and an x pairing with the transpose's result (a
        wrong or zero f shows).
        """
        f = self.f_of(idx)
        lin = [self.args[i] for i in idx]
        xs = [self.random(a.shape, a.dtype, complex_data) for a in lin]
        fx, pullback = self.attempt(check, label, lambda: jax.vjp(f, *xs))
        self.finite(check, label, "output", enumerate(fx))
        n = max([_size(a) for a in lin] + [_size(o) for o in self.outs] + [1])
        g = _growth(n)

        def weigh(xs_, cts_, fxs_, ys_):
            """|<f x, y> - <x, f_T y>|, its rounding tolerance and the pairings' magnitude."""
            lhs = sum(_pair(fxs_[j], ys_[j]) for j in self.inexact_outputs)
            rhs = sum(_pair(x, c) for x, c in zip(xs_, cts_))
            tol = g * (
                sum(self.eps(fxs_[j].dtype) * _norm(fxs_[j]) * _norm(ys_[j]) for j in self.inexact_outputs)
                + sum(self.eps(x.dtype) * _norm(x) * _norm(c) for x, c in zip(xs_, cts_))
            )
            return lhs, rhs, tol

        probes = []
        for j in self.inexact_outputs:
            y = self.probe(fx[j], self.declared[j], complex_data)
            cts = self.attempt(check, label, lambda y=y, j=j: pullback(self.zero_cotangents({j: y})))
            self.finite(check, label, "cotangent of argument", zip(idx, cts))
            probes.append((f"a cotangent on output {j} alone", xs, cts, fx, self.zero_cotangents({j: y})))
        ys = {
            j: self.random(self.declared[j].shape, self.declared[j].dtype, complex_data) for j in self.inexact_outputs
        }
        cts = self.attempt(check, label, lambda: pullback(self.zero_cotangents(ys)))
        self.finite(check, label, "cotangent of argument", zip(idx, cts))
        xs2 = [self.probe(c, a, complex_data) for c, a in zip(cts, lin)]
        fx2 = self.attempt(check, label, lambda: f(*xs2))
        self.finite(check, label, "output", enumerate(fx2))
        probes.append(("random cotangents", xs2, cts, fx2, self.zero_cotangents(ys)))

        worst = _Worst()
        for what, xs_, cts_, fxs_, ys_ in probes:
            self.pairing(
                check,
                label,
                what,
                *weigh(xs_, cts_, fxs_, ys_),
                "<f x, y> == <x, f_T y>",
                ": the transpose is not the transpose of f",
                worst,
            )
        worst.report(self.summary, check, label)

    def check_dot_products(self):
        check = "dot product: <f x, y> == <x, f_T y>"
        if not self.inexact_outputs:
            self.summary.skip(f"{check} (the op has no float or complex output)")
            return
        groups = self.linear_groups()
        # Complex data wherever an argument or an output is complex, whatever the others' dtypes.
        any_complex = any(_is_complex(self.args[i].dtype) for _, idx in groups for i in idx) or any(
            _is_complex(self.outs[j].dtype) for j in self.inexact_outputs
        )
        kinds = [("real data", False)] + ([("complex data", True)] if any_complex else [])
        for label, idx in groups:
            for kind, complex_data in kinds:
                self.dot_test(check, f"{label} ({kind})", idx, complex_data)

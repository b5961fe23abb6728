"""The checker: one run of check_op over an op and its arguments, its shared helpers and the order of the checks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .._op import Op
from .._state import state_cache
from ._batching import BatchingChecks
from ._derivatives import DerivativeChecks
from ._linear import LinearChecks
from ._numerics import FLOOR, MEANINGFUL, _eps, _growth, _inexact, _nonfinite, _norm, _relative, _size, _wide, _Worst
from ._report import Failure, OpCheck


def distinct_digits(a: float, b: float):
    """``a`` and ``b`` as text with as many significant digits as tell them apart (6 to 17)."""
    for digits in range(6, 18):
        left, right = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if left != right:
            return left, right
    return f"{a:.6g}", f"{b:.6g}"


class Checker(LinearChecks, DerivativeChecks, BatchingChecks):
    """One run of check_op: the shared helpers and the order of the checks; the checks are in the mixins."""

    def __init__(self, op: Op, args, kwargs, fd_rtol=None):
        self.op, self.kwargs, self.fd_rtol = op, kwargs, fd_rtol
        self.definition = d = op.definition
        self.name = d.name
        self.args = list(args)
        self.n_fixed = d.first_n_args_fixed
        self.summary = OpCheck(d.name, d.kind)
        self.rng = np.random.default_rng(0)
        self.elements = {}  # batch element k -> its arguments
        # The precision every computed array is held to: its own dtype's, or
        # the least precise of the op's inexact arguments if that is coarser
        # (a callback may compute in the precision of its inputs).
        self.eps_args = max((_eps(a.dtype) for a in self.args), default=0.0)

    # -- helpers ----------------------------------------------------------

    def eps(self, dtype) -> float:
        """The relative precision of an array of ``dtype`` computed by the op (0: exact)."""
        if not _inexact(dtype):
            return 0.0
        return max(_eps(dtype), self.eps_args, FLOOR)

    def fail(
        self,
        check: str,
        argument: str,
        detail: str,
        error: float | None = None,
        tolerance: float | None = None,
        cause: BaseException | None = None,
        hint: str = "",
    ):
        measured = f" Measured error {error:.3g}, tolerance {tolerance:.3g}." if error is not None else ""
        message = f"check_op: jaxbind op '{self.name}': {check} failed for {argument}: {detail}.{measured}" + (
            f" {hint}" if hint else ""
        )
        if cause is not None:
            raise Failure(message) from cause
        raise Failure(message)

    def call(self, *args):
        return list(self.op(*args, **self.kwargs))

    def attempt(self, check: str, argument: str, fn):
        try:
            result = fn()
            for leaf in jax.tree_util.tree_leaves(result):  # runtime errors surface when waited for
                if isinstance(leaf, jax.Array):
                    leaf.block_until_ready()
            return result
        except Failure:
            raise
        except Exception as err:
            text = str(err).split("\n--------------------")[0].strip()
            self.fail(check, argument, f"running it raised {type(err).__name__}: {text}", cause=err)

    def finite(self, check: str, argument: str, what: str, arrays):
        for j, a in arrays:
            bad = _nonfinite(a)
            if bad:
                self.fail(
                    check,
                    argument,
                    f"{what} {j} has {bad} non-finite (NaN or inf) element(s) of {_size(a)} at finite arguments",
                )

    def random(self, shape, dtype, complex_data=True):
        dtype = np.dtype(dtype)
        x = self.rng.standard_normal(shape)
        if dtype.kind == "c" and complex_data:
            x = x + 1j * self.rng.standard_normal(shape)
        return jnp.asarray(x.astype(dtype))

    def probe(self, a, like, complex_data):
        """A direction of ``like``'s shape and dtype that pairs positively with ``a``: conj(a) plus noise.

        ``<a, probe(a)>`` is about ``|a|``, so that a zero or wrong map on the
        other side of a dot test shows as an error of order 1, at any
        precision; the random half keeps the direction generic.
        """
        dtype = np.dtype(like.dtype)
        a = _wide(a)
        a = np.conj(a) if complex_data and dtype.kind == "c" else np.real(a)
        r = _wide(self.random(like.shape, dtype, complex_data))
        out = np.zeros(like.shape, np.complex128 if dtype.kind == "c" else np.float64)
        for part in (a, r):
            n = _norm(part)
            if n > 0:
                m = float(np.max(np.abs(part)))
                out = out + (part / m) / (n / m)
        return jnp.asarray(out.astype(dtype))

    def zero_cotangents(self, values: dict):
        """Cotangents for all outputs: ``values[j]`` for output j, zeros elsewhere (float0 for integer ones)."""
        cts = []
        for j, o in enumerate(self.declared):
            if j in values:
                cts.append(values[j])
            elif _inexact(o.dtype):
                cts.append(jnp.zeros(o.shape, o.dtype))
            else:
                cts.append(np.zeros(o.shape, jax.dtypes.float0))
        return cts

    def judge(
        self,
        check: str,
        argument: str,
        error: float,
        tolerance: float,
        magnitude: float,
        detail: str,
        skip_reason: str,
        hint: str = "",
    ):
        """Pass, fail or skip a comparison: errors and tolerance absolute, ``magnitude`` their scale.

        Reported relative to ``magnitude``. Exact agreement always passes; a
        passing comparison whose tolerance is not below MEANINGFUL x magnitude
        could not have told a 100 % error from rounding, and is skipped.
        Returns True if it passed.
        """
        if not (error <= tolerance):  # NaN fails
            rel = error / magnitude if magnitude > 0 else math.inf
            self.fail(check, argument, detail, rel, tolerance / magnitude if magnitude > 0 else tolerance, hint=hint)
        if error == 0:
            self.summary.add(check, argument, 0.0, tolerance / magnitude if magnitude > 0 else 0.0)
            return True
        if not tolerance < MEANINGFUL * magnitude:
            self.summary.skip(
                f"{check} for {argument}: {skip_reason} (the rounding tolerance, "
                f"{tolerance / magnitude if magnitude else math.inf:.2g} relative, would let "
                "a 100 % error pass)"
            )
            return False
        self.summary.add(check, argument, error / magnitude, tolerance / magnitude)
        return True

    def pairing(
        self,
        check: str,
        label: str,
        what: str,
        lhs: float,
        rhs: float,
        tolerance: float,
        names: str,
        detail: str,
        worst: _Worst,
    ):
        """Judge two pairings that should agree up to ``tolerance`` (absolute): fail, skip or offer to ``worst``."""
        error, magnitude = abs(lhs - rhs), max(abs(lhs), abs(rhs))
        left, right = names.split(" == ")
        if not error <= tolerance:
            a, b = distinct_digits(lhs, rhs)
            self.fail(
                check,
                label,
                f"with {what}, {left} = {a} but {right} = {b}{detail}",
                _relative(error, magnitude) if magnitude else math.inf,
                _relative(tolerance, magnitude),
            )
        if error == 0:
            worst.offer(0.0, _relative(tolerance, magnitude) if magnitude else 0.0)
        elif not tolerance < MEANINGFUL * magnitude:
            self.summary.skip(
                f"{check} for {label} with {what}: the precision is too coarse (the rounding "
                f"tolerance, {tolerance / magnitude:.2g} relative, would let a 100 % error pass)"
            )
        else:
            worst.offer(error / magnitude, tolerance / magnitude)

    # -- the checks -------------------------------------------------------

    def run(self) -> OpCheck:
        d = self.definition
        self.check_outputs()
        if state_cache(d) is not None:  # (first: a changed state fails the other checks, naming no cause)
            self.check_state()
        self.check_eager_against_jit()
        if d.kind in ("linear", "multilinear"):
            self.check_linearity()
            self.check_dot_products()
        elif not d.has_derivatives:
            self.summary.skip("derivatives (the op was made without them)")
        elif not self.inexact_outputs:
            self.summary.skip("derivatives (the op has no float or complex output)")
        elif not self.differentiable():
            self.summary.skip("derivatives (no argument after the fixed ones is float or complex)")
        else:
            self.check_jvp_and_vjp()
        if d.thread_safe:  # (first: a race also fails the vmap checks, with a message that names no cause)
            self.check_thread_safe()
        self.check_vmap()
        return self.summary

    def check_state(self):
        """An op with ``setup``: the same results whether its states were kept or made again, and a kept
        state used again gives what a new one gives (no callback changes it)."""
        check, cache = "state: kept or made again", state_cache(self.definition)
        cache.clear()
        again = self.attempt(check, "the outputs", lambda: self.call(*self.args))
        used = self.attempt(check, "the outputs", lambda: self.call(*self.args))
        self.compare_all(
            check,
            "the outputs",
            used,
            again,
            [o.dtype for o in self.outs],
            "a second call on the same inputs, with the state the first one made, gives other values: a "
            "callback changes its state (which every call and derivative on those inputs shares, until it "
            "is evicted and made again); write results into out only",
        )
        self.compare_all(
            check,
            "the outputs",
            again,
            self.outs,
            [o.dtype for o in self.outs],
            "the op gives other values once its states are made again",
        )
        if not (self.definition.has_derivatives and self.inexact_outputs and self.differentiable()):
            return
        wrt = self.differentiable()

        def pulled(clear_between):
            def partial(*diff):
                full = list(self.args)
                for i, v in zip(wrt, diff):
                    full[i] = v
                return [self.call(*full)[j] for j in self.inexact_outputs]

            outs, pullback = jax.vjp(partial, *[self.args[i] for i in wrt])
            if clear_between:  # the derivative runs without the state its forward made
                cache.clear()
            return pullback([jnp.ones_like(o) for o in outs])

        kept = self.attempt(check, "the vjp", lambda: pulled(False))
        remade = self.attempt(check, "the vjp", lambda: pulled(True))
        self.compare_all(
            check,
            "the vjp",
            remade,
            kept,
            [self.args[i].dtype for i in wrt],
            "the vjp gives other values when its state is made again",
        )

    def check_outputs(self):
        check = "outputs: abstract, fully written"
        declared = self.attempt(check, "the abstract", lambda: jax.eval_shape(self.call, *self.args))
        self.declared = declared
        outs = self.attempt(check, "the given arguments", lambda: self.call(*self.args))
        if len(outs) != len(declared):
            self.fail(
                check, "the outputs", f"the abstract declares {len(declared)} outputs, the op returned {len(outs)}"
            )
        for j, (o, d) in enumerate(zip(outs, declared)):
            if o.shape != d.shape or o.dtype != d.dtype:
                self.fail(check, f"output {j}", f"declared {d.shape} {d.dtype}, got {o.shape} {o.dtype}")
        self.finite(check, "the given arguments", "output", enumerate(outs))
        self.outs = outs
        self.inexact_outputs = [j for j, o in enumerate(outs) if _inexact(o.dtype)]
        self.summary.add(check, f"{len(outs)} output(s)", 0.0, 0.0)

    def compare(self, check: str, argument: str, got, want, dtypes, detail: str):
        """Arrays that should agree up to rounding: per output, the 2-norm of the difference."""
        for j, (g, w, dtype) in enumerate(zip(got, want, dtypes)):
            g, w = np.asarray(g), np.asarray(w)
            if g.shape != w.shape:
                self.fail(check, argument, f"{detail}: output {j} has shape {g.shape}, the loop gives {w.shape}")
            if not _inexact(dtype):
                if not np.array_equal(g, w):
                    self.fail(
                        check,
                        argument,
                        f"{detail}: output {j} ({np.dtype(dtype).name}) differs in "
                        f"{int(np.count_nonzero(g != w))} of {w.size} elements",
                        math.inf,
                        0.0,
                    )
                continue
            error, magnitude = _norm(_wide(g) - _wide(w)), _norm(w)
            tolerance = _growth(max(w.size, 1)) * self.eps(dtype) * magnitude
            where = f"{argument}, output {j}" if len(want) > 1 else argument
            self.judge(
                check, where, error, tolerance, magnitude, detail, f"{np.dtype(dtype).name} is too coarse to compare"
            )

    def check_eager_against_jit(self):
        check = "eager against jit"
        jitted = self.attempt(check, "the given arguments", lambda: jax.jit(self.call)(*self.args))
        self.compare_all(
            check,
            "the outputs",
            jitted,
            self.outs,
            [o.dtype for o in self.outs],
            "jit gives other values than an eager call",
        )

    def compare_all(self, check, argument, got, want, dtypes, detail):
        """``compare``, with one summary entry for all outputs (the worst)."""
        n = len(self.summary.checks)
        self.compare(check, argument, got, want, dtypes, detail)
        entries = self.summary.checks[n:]
        del self.summary.checks[n:]
        if entries:
            worst = max(entries, key=lambda c: c["error"] / c["tolerance"] if c["tolerance"] else 0.0)
            self.summary.add(check, argument, worst["error"], worst["tolerance"])
        elif not any(s.startswith(check + " for " + argument) for s in self.summary.skipped):
            self.summary.add(check, argument, 0.0, 0.0)  # integer outputs only: compared exactly

    def differentiable(self):
        return [i for i in range(self.n_fixed, len(self.args)) if _inexact(self.args[i].dtype)]

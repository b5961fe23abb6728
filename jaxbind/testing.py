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

import dataclasses
import math
import numbers
from typing import List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ._api import Op
from ._runtime import config

__all__ = ["OpCheck", "check_op"]

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


@dataclasses.dataclass
class OpCheck:
    """What ``check_op`` checked: one entry per check, with its measured error and tolerance.

    ``checks`` holds the checks that passed; ``skipped`` says, for each check
    that was not run or could not be meaningful, why.
    """

    op: str
    kind: str
    checks: List[dict] = dataclasses.field(default_factory=list)
    skipped: List[str] = dataclasses.field(default_factory=list)

    def add(self, check: str, argument: str, error: float, tolerance: float):
        self.checks.append(dict(check=check, argument=argument, error=float(error), tolerance=float(tolerance)))

    def skip(self, text: str):
        if text not in self.skipped:
            self.skipped.append(text)

    def __str__(self):
        lines = [f"check_op: jaxbind {self.kind} op '{self.op}': {len(self.checks)} checks passed"
                 + (f", {len(self.skipped)} skipped" if self.skipped else "")]
        lines += [f"  {c['check']:<44} {c['argument']:<40} error {c['error']:.1e} <= {c['tolerance']:.1e}"
                  for c in self.checks]
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)


class _Failure(AssertionError):
    pass


def check_op(op: Op, /, *args, fd_rtol: Optional[float] = None, **kwargs) -> OpCheck:
    """Check an op on the given arguments, as ``torch.library.opcheck`` does for PyTorch.

    Checks, on the arguments given (see the README section "Checking an op"):
    the outputs against the abstract (fully written, finite), eager against
    jit; for linear and multilinear ops linearity (all linear arguments
    jointly for a linear op, each one for a multilinear op) and the dot-product
    test ``<f x, y> == <x, f_T y>`` in every linear argument and jointly; for
    nonlinear ops the jvp against central finite differences and the vjp
    against the jvp; ``vmap`` at one and two levels with mixed ``in_axes``, of
    the op, its vjp and (nonlinear ops) its jvp, against Python loops.
    Random data is complex wherever an array is complex. Tolerances follow
    from a rounding model: the dtypes' epsilons, the sizes and the magnitudes
    of the values involved. A check the precision makes meaningless is listed
    in ``OpCheck.skipped`` with its reason.

    Args:
      op: a jaxbind op (``get_linear_call``/``get_nonlinear_call``);
        positional-only, so that the op's keyword arguments may have any name.
      *args: array arguments to call it with (the point the checks run at).
      fd_rtol: an extra relative tolerance of the jvp against finite
        differences, for an op computed to an accuracy of its own (an adaptive
        ODE solver, an iterative solve): its relative accuracy. The name is
        reserved: it is not passed to the op.
      **kwargs: the op call's keyword arguments.

    Returns:
      An :class:`OpCheck`: each check with the argument it was about, the
      measured error and its tolerance (``print`` it for a table), and the
      checks skipped, with the reason.

    Raises:
      AssertionError: naming the op, the check, the argument and the measured
        error, for the first check that fails.
      TypeError, ValueError: for what is not an op, an argument that is not an
        array, or an ``fd_rtol`` that is not a non-negative number.
    """
    if not isinstance(op, Op):
        raise TypeError(f"check_op takes a jaxbind op, got {type(op).__name__}.")
    name = op.definition.name
    if fd_rtol is not None:
        if (isinstance(fd_rtol, bool) or not isinstance(fd_rtol, numbers.Real)
                or not math.isfinite(float(fd_rtol)) or fd_rtol < 0):
            raise ValueError(f"check_op: jaxbind op '{name}': fd_rtol must be a finite non-negative number "
                             f"(the op's relative accuracy), got {fd_rtol!r}.")
        fd_rtol = float(fd_rtol)
    arrays = []
    for i, a in enumerate(args):
        if not isinstance(a, (jax.Array, np.ndarray, np.generic, numbers.Number)) or isinstance(a, str):
            raise TypeError(f"check_op: jaxbind op '{name}': argument {i} is a {type(a).__name__}; the "
                            "arguments must be arrays (jax or NumPy) or scalars. Pass static values as "
                            "keyword arguments.")
        arrays.append(jnp.asarray(a))
    previous = config.check_unwritten
    config.check_unwritten = True
    try:
        return _Checker(op, arrays, kwargs, fd_rtol).run()
    finally:
        config.check_unwritten = previous


# ---------------------------------------------------------------------------
# Numerics: exact-range norms and pairings, the rounding model
# ---------------------------------------------------------------------------


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

    def report(self, summary: "OpCheck", check: str, argument: str):
        if self.entry is not None:
            summary.add(check, argument, *self.entry)


def _nonfinite(x) -> int:
    x = np.asarray(x)
    if not _inexact(x.dtype):
        return 0
    return int(np.size(x) - np.count_nonzero(np.isfinite(_wide(x))))


class _Checker:
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

    def fail(self, check: str, argument: str, detail: str, error: Optional[float] = None,
             tolerance: Optional[float] = None, cause: Optional[BaseException] = None, hint: str = ""):
        measured = f" Measured error {error:.3g}, tolerance {tolerance:.3g}." if error is not None else ""
        message = (f"check_op: jaxbind op '{self.name}': {check} failed for {argument}: {detail}.{measured}"
                   + (f" {hint}" if hint else ""))
        if cause is not None:
            raise _Failure(message) from cause
        raise _Failure(message)

    def call(self, *args):
        return list(self.op(*args, **self.kwargs))

    def attempt(self, check: str, argument: str, fn):
        try:
            result = fn()
            for leaf in jax.tree_util.tree_leaves(result):  # runtime errors surface when waited for
                if isinstance(leaf, jax.Array):
                    leaf.block_until_ready()
            return result
        except _Failure:
            raise
        except Exception as err:
            text = str(err).split("\n--------------------")[0].strip()
            self.fail(check, argument, f"running it raised {type(err).__name__}: {text}", cause=err)

    def finite(self, check: str, argument: str, what: str, arrays):
        for j, a in arrays:
            bad = _nonfinite(a)
            if bad:
                self.fail(check, argument, f"{what} {j} has {bad} non-finite (NaN or inf) element(s) of "
                          f"{_size(a)} at finite arguments")

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

    def judge(self, check: str, argument: str, error: float, tolerance: float, magnitude: float,
              detail: str, skip_reason: str, hint: str = ""):
        """Pass, fail or skip a comparison: errors and tolerance absolute, ``magnitude`` their scale.

        Reported relative to ``magnitude``. Exact agreement always passes; a
        passing comparison whose tolerance is not below MEANINGFUL x magnitude
        could not have told a 100 % error from rounding, and is skipped.
        Returns True if it passed.
        """
        if not (error <= tolerance):  # NaN fails
            rel = error / magnitude if magnitude > 0 else math.inf
            self.fail(check, argument, detail, rel, tolerance / magnitude if magnitude > 0 else tolerance,
                      hint=hint)
        if error == 0:
            self.summary.add(check, argument, 0.0, tolerance / magnitude if magnitude > 0 else 0.0)
            return True
        if not tolerance < MEANINGFUL * magnitude:
            self.summary.skip(f"{check} for {argument}: {skip_reason} (the rounding tolerance, "
                              f"{tolerance / magnitude if magnitude else math.inf:.2g} relative, would let "
                              "a 100 % error pass)")
            return False
        self.summary.add(check, argument, error / magnitude, tolerance / magnitude)
        return True

    def pairing(self, check: str, label: str, what: str, lhs: float, rhs: float, tolerance: float,
                names: str, detail: str, worst: _Worst):
        """Judge two pairings that should agree up to ``tolerance`` (absolute): fail, skip or offer to ``worst``."""
        error, magnitude = abs(lhs - rhs), max(abs(lhs), abs(rhs))
        left, right = names.split(" == ")
        if not error <= tolerance:
            self.fail(check, label, f"with {what}, {left} = {lhs:.6g} but {right} = {rhs:.6g}{detail}",
                      _relative(error, magnitude) if magnitude else math.inf, _relative(tolerance, magnitude))
        if error == 0:
            worst.offer(0.0, _relative(tolerance, magnitude) if magnitude else 0.0)
        elif not tolerance < MEANINGFUL * magnitude:
            self.summary.skip(f"{check} for {label} with {what}: the precision is too coarse (the rounding "
                              f"tolerance, {tolerance / magnitude:.2g} relative, would let a 100 % error pass)")
        else:
            worst.offer(error / magnitude, tolerance / magnitude)

    # -- the checks -------------------------------------------------------

    def run(self) -> OpCheck:
        d = self.definition
        self.check_outputs()
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
        self.check_vmap()
        return self.summary

    def check_outputs(self):
        check = "outputs: abstract, fully written"
        declared = self.attempt(check, "the abstract", lambda: jax.eval_shape(self.call, *self.args))
        self.declared = declared
        outs = self.attempt(check, "the given arguments", lambda: self.call(*self.args))
        if len(outs) != len(declared):
            self.fail(check, "the outputs", f"the abstract declares {len(declared)} outputs, the op returned {len(outs)}")
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
                    self.fail(check, argument, f"{detail}: output {j} ({np.dtype(dtype).name}) differs in "
                              f"{int(np.count_nonzero(g != w))} of {w.size} elements", math.inf, 0.0)
                continue
            error, magnitude = _norm(_wide(g) - _wide(w)), _norm(w)
            tolerance = _growth(max(w.size, 1)) * self.eps(dtype) * magnitude
            where = f"{argument}, output {j}" if len(want) > 1 else argument
            self.judge(check, where, error, tolerance, magnitude, detail,
                       f"{np.dtype(dtype).name} is too coarse to compare")

    def check_eager_against_jit(self):
        check = "eager against jit"
        jitted = self.attempt(check, "the given arguments", lambda: jax.jit(self.call)(*self.args))
        self.compare_all(check, "the outputs", jitted, self.outs, [o.dtype for o in self.outs],
                         "jit gives other values than an eager call")

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

    # -- linear and multilinear ops ----------------------------------------

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
                args = args[:self.n_fixed] + [jnp.zeros_like(a) for a in args[self.n_fixed:]]
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
            f1, f2, f3 = (self.attempt(check, label, lambda v=v: f(*v)) for v in (xs, xs2, mixed))
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
                    self.fail(check, f"{label}, output {j}", "f is not linear: f(a x + b x') differs from "
                              "a f(x) + b f(x') (an affine map, a term in a product of linear arguments)",
                              error / magnitude if magnitude else math.inf, tolerance / magnitude if magnitude else 0)
                if magnitude > 0 and error > 0 and not tolerance < MEANINGFUL * magnitude:
                    self.summary.skip(f"{check} for {label}, output {j}: {f3[j].dtype} is too coarse (the rounding "
                                      f"tolerance, {tolerance / magnitude:.2g} relative, would let a 100 % error pass)")
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
            tol = g * (sum(self.eps(fxs_[j].dtype) * _norm(fxs_[j]) * _norm(ys_[j]) for j in self.inexact_outputs)
                       + sum(self.eps(x.dtype) * _norm(x) * _norm(c) for x, c in zip(xs_, cts_)))
            return lhs, rhs, tol

        probes = []
        for j in self.inexact_outputs:
            y = self.probe(fx[j], self.declared[j], complex_data)
            cts = self.attempt(check, label, lambda y=y: pullback(self.zero_cotangents({j: y})))
            self.finite(check, label, "cotangent of argument", zip(idx, cts))
            probes.append((f"a cotangent on output {j} alone", xs, cts, fx, self.zero_cotangents({j: y})))
        ys = {j: self.random(self.declared[j].shape, self.declared[j].dtype, complex_data)
              for j in self.inexact_outputs}
        cts = self.attempt(check, label, lambda: pullback(self.zero_cotangents(ys)))
        self.finite(check, label, "cotangent of argument", zip(idx, cts))
        xs2 = [self.probe(c, a, complex_data) for c, a in zip(cts, lin)]
        fx2 = self.attempt(check, label, lambda: f(*xs2))
        self.finite(check, label, "output", enumerate(fx2))
        probes.append(("random cotangents", xs2, cts, fx2, self.zero_cotangents(ys)))

        worst = _Worst()
        for what, xs_, cts_, fxs_, ys_ in probes:
            self.pairing(check, label, what, *weigh(xs_, cts_, fxs_, ys_), "<f x, y> == <x, f_T y>",
                         ": the transpose is not the transpose of f", worst)
        worst.report(self.summary, check, label)

    def check_dot_products(self):
        check = "dot product: <f x, y> == <x, f_T y>"
        if not self.inexact_outputs:
            self.summary.skip(f"{check} (the op has no float or complex output)")
            return
        groups = self.linear_groups()
        # Complex data wherever an argument or an output is complex, whatever the others' dtypes.
        any_complex = any(_is_complex(self.args[i].dtype) for _, idx in groups for i in idx) or any(
            _is_complex(self.outs[j].dtype) for j in self.inexact_outputs)
        kinds = [("real data", False)] + ([("complex data", True)] if any_complex else [])
        for label, idx in groups:
            for kind, complex_data in kinds:
                self.dot_test(check, f"{label} ({kind})", idx, complex_data)

    # -- nonlinear ops --------------------------------------------------------

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
        fallback = float(np.sqrt(np.mean(nonzero ** 2))) if nonzero.size else 1.0
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
                            self.fail(check, argument, f"the tangent of output {j} has shape {jv[j].shape} and "
                                      f"dtype {jv[j].dtype}, but the output has {o.shape} {o.dtype} (check what "
                                      "the abstract declares when called with the tangents)")
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

        def meaningful(r):
            return r[0] == 0 or r[1] < MEANINGFUL * r[2]

        def ratio(r):
            return r[0] / r[1] if r[1] else (0.0 if r[0] == 0 else math.inf)

        label = (lambda j: f"{argument}, output {j}") if len(self.inexact_outputs) > 1 else (lambda j: argument)
        worst = _Worst()
        for j in self.inexact_outputs:
            r = measure(j, first)
            tried = [r]
            if meaningful(r) and r[0] > r[1]:
                for fraction in FD_LADDER[1:]:  # truncation or a kink: smaller steps
                    s_ = measure(j, first * fraction)
                    if not meaningful(s_):
                        break
                    tried.append(s_)
                    if s_[0] <= s_[1]:
                        r = s_
                        break
            elif not meaningful(r) and r[0] <= r[1]:
                e = first
                while e < FD_MAX_STEP:  # rounding hides the derivative: larger steps
                    e = min(FD_MAX_STEP, 10 * e)
                    s_ = measure(j, e)
                    if meaningful(s_):
                        r = s_  # agreeing or not: the closest a meaningful check comes
                        break
            if r[0] > r[1] and r[3] <= first:
                miss = min(tried, key=ratio)
                rtol = (f"plus fd_rtol={self.fd_rtol:g} of the jvp" if self.fd_rtol is not None
                        else "no fd_rtol given")
                steps = ", ".join(f"{t[3]:.2g}" for t in tried)
                detail = (f"the jvp disagrees with finite differences of f at every step tried ({steps} times "
                          "each element's magnitude)")
                if miss[0] == math.inf:
                    detail = (f"finite differences of f are not finite at a step of {miss[3]:.2g} times each "
                              "element's magnitude (f leaves its domain, or is not finite near the arguments)")
                self.fail(check, label(j), detail, _relative(miss[0], miss[2]), _relative(miss[1], miss[2]),
                          hint=f"The tolerance is the rounding model's ({rtol}). If f is computed to an accuracy of its "
                          "own (an iterative or adaptive solver, an interpolation table), pass fd_rtol= its "
                          "relative accuracy: the jvp may then differ from finite differences by that much more, "
                          "and a jvp wrong by more is still caught.")
            if r[0] > r[1] or not meaningful(r):
                why = (f"the rounding tolerance, {_relative(r[1], r[2]):.2g} relative at a step of {r[3]:.2g} times "
                       "each element's magnitude, would let a 100 % error pass" if not meaningful(r) else
                       f"at the step of {r[3]:.2g} times each element's magnitude where rounding allows a "
                       f"meaningful check, the disagreement ({_relative(r[0], r[2]):.2g} relative) may be "
                       "truncation")
                self.summary.skip(f"{check} for {label(j)}: {self.outs[j].dtype} outputs of {dtype} arguments are "
                                  f"too coarse for finite differences ({why}); the vjp is still checked against "
                                  "the jvp")
                continue
            worst.offer(_relative(r[0], r[2]), _relative(r[1], r[2]))
        worst.report(self.summary, check, argument)

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
            (ct,) = self.attempt(check, argument, lambda c=c: pullback(self.zero_cotangents({j: c})))
            self.finite(check, argument, "vjp for argument", [(i, ct)])
            probes.append((f"a cotangent on output {j} alone", t, ct, {j: c}, jv))
        cs = {j: self.random(self.declared[j].shape, self.declared[j].dtype, complex_data)
              for j in self.inexact_outputs}
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
            tol = g * (self.eps(x0.dtype) * _norm(ct_) * _norm(t_)
                       + sum(self.eps(jv_[j].dtype) * _norm(c) * _norm(jv_[j]) for j, c in cs_.items()))
            self.pairing(check, argument, what, lhs, rhs, tol, "<vjp(c), t> == <c, jvp(t)>", "", worst)
        worst.report(self.summary, check, argument)

    # -- batching -----------------------------------------------------------

    def element(self, k):
        """Element ``k`` of the batches: the given arguments, perturbed (inexact ones) for k > 0.

        Fixed arguments are parameters whose structure an op may rely on (a
        monotonic time grid, a sign pattern): they are scaled as a whole.
        """
        if k in self.elements:
            return list(self.elements[k])
        rng = np.random.default_rng(100 + k)
        out = []
        for i, a in enumerate(self.args):
            if k and _inexact(a.dtype) and a.size:
                noise = 0.4 * k if i < self.n_fixed else rng.standard_normal(a.shape)
                a = a * jnp.asarray(1 + 0.05 * noise).astype(a.dtype)
            out.append(a)
        self.elements[k] = out
        return list(out)

    def batched(self, check, label, fn, items, axes, dtypes, detail):
        """A task: ``fn`` vmapped over the levels of ``axes`` (outer first) against a loop over ``items``.

        ``items[k1][k2]...`` are argument lists; an argument whose axis is None
        at a level takes the value of that level's element 0.
        """
        sizes = []
        level = items
        for _ in axes:
            sizes.append(len(level))
            level = level[0]
        n = len(axes[0])

        def value(i, ks):
            item = items
            for l, k in enumerate(ks):
                item = item[0 if axes[l][i] is None else k]
            return item[i]

        def build(i, l, ks):
            if l == len(axes):
                return value(i, ks)
            if axes[l][i] is None:
                return build(i, l + 1, ks + [0])
            return jnp.stack([build(i, l + 1, ks + [k]) for k in range(sizes[l])], axis=axes[l][i])

        mapped = fn
        for a in reversed(axes):
            mapped = jax.vmap(mapped, in_axes=tuple(a))

        def loop(l=0, ks=()):
            if l == len(axes):
                return fn(*[value(i, list(ks)) for i in range(n)])
            rows = [loop(l + 1, ks + (k,)) for k in range(sizes[l])]
            return [jnp.stack([r[m] for r in rows]) for m in range(len(rows[0]))]

        return dict(check=check, label=label, mapped=mapped, inputs=lambda: [build(i, 0, []) for i in range(n)],
                    loop=loop, dtypes=dtypes, detail=detail)

    def run_batched(self, tasks):
        """Run the tasks' vmapped functions, compiled together (one program), and compare each with its loop.

        If the program fails, each task runs on its own, so that the failure
        names the one that raised. Large arguments run task by task, so that
        the results of one are freed before the next runs.
        """
        results = None
        size = sum(_size(a) * (2 if t["check"] == "vmap of vmap against a loop" else 1)
                   for t in tasks for a in self.args)
        if size * BATCH <= COMBINED:
            try:
                results = jax.jit(lambda inputs: [t["mapped"](*i) for t, i in zip(tasks, inputs)])(
                    [t["inputs"]() for t in tasks])
                jax.block_until_ready(results)
            except Exception:
                results = None
        for k, t in enumerate(tasks):
            check, label = t["check"], t["label"]
            got = results[k] if results is not None else self.attempt(
                check, label, lambda: jax.jit(t["mapped"])(*t["inputs"]()))
            want = self.attempt(check, label + " (the loop)", t["loop"])
            if len(got) != len(want):
                self.fail(check, label, f"{t['detail']}: {len(got)} results, the loop gives {len(want)}")
            self.compare_all(check, label, got, want, t["dtypes"], t["detail"])
            del got, want
            if results is not None:
                results[k] = None

    def grid(self, sizes, extra=None):
        """Nested lists of element argument lists (plus ``extra(k)`` appended), element k = flat index."""
        def make(l, offset):
            if l == len(sizes):
                return self.element(offset) + (extra(offset) if extra else [])
            stride = int(np.prod(sizes[l + 1:], dtype=np.int64))
            return [make(l + 1, offset + k * stride) for k in range(sizes[l])]
        return make(0, 0)

    def check_vmap(self):
        d = self.definition
        n = len(self.args)
        dtypes = [o.dtype for o in self.outs]
        ones = [min(1, a.ndim) for a in self.args]
        patterns = [("in_axes 0", [0] * n), ("in_axes 1", ones)]
        if n > 1:
            patterns.append(("in_axes None-mixed", [None if i % 2 == 0 else 0 for i in range(n)]))
            patterns.append(("in_axes None-mixed", [0 if i % 2 == 0 else None for i in range(n)]))
        check = "vmap against a Python loop"
        detail = "the vmapped op gives other values than calling it element by element"
        items = self.grid([BATCH])
        tasks = [self.batched(check, f"{name} {tuple(axes)}", self.call, items, [axes], dtypes, detail)
                 for name, axes in patterns]
        if n == 1:
            # The op inside a vmap over something else (a scale of its outputs).
            scale = lambda s, *args: [s * o if _inexact(o.dtype) else o for o in self.call(*args)]  # noqa: E731
            scaled = self.grid([BATCH], lambda k: [jnp.asarray(1.0 + k)])
            scaled = [item[-1:] + item[:-1] for item in scaled]
            tasks.append(self.batched(check, "in_axes None-mixed (None,)", scale, scaled, [[0, None]], dtypes, detail))

        # Two levels: every argument at both (the inner at axis 1); then some at both, the others
        # at the inner level only (jaxbind broadcasts those over the outer one).
        check = "vmap of vmap against a loop"
        nested = [("outer 0, inner 1", [[0] * n, ones])]
        if n > 1:
            nested.append(("outer None-mixed, inner 1", [[a if i % 2 == 0 else None for i, a in enumerate(ones)],
                                                         ones]))
        items2 = self.grid(list(NESTED))
        tasks += [self.batched(check, f"{name} {tuple(axes[0])} {tuple(axes[1])}", self.call, items2, axes,
                               dtypes, detail) for name, axes in nested]

        diff = [i for i in range(self.n_fixed, n) if _inexact(self.args[i].dtype)]
        if d.has_derivatives and diff and self.inexact_outputs:
            tasks += self.vmap_of_vjp_tasks(patterns, diff)
            if d.kind == "nonlinear":
                tasks += self.batched_jvp_tasks(diff, ones)
        self.run_batched(tasks)

    def restrict(self, args, diff):
        """f of the arguments ``diff``, the others held at ``args``."""
        return lambda *dv: self.call(*[dv[diff.index(i)] if i in diff else a for i, a in enumerate(args)])

    def vmap_of_vjp_tasks(self, patterns, diff):
        n = len(self.args)
        outs = self.inexact_outputs

        def vjp(*values):
            args, cts = values[:n], values[n:]
            pullback = jax.vjp(self.restrict(args, diff), *[args[i] for i in diff])[1]
            return list(pullback(self.zero_cotangents(dict(zip(outs, cts)))))

        cotangents = lambda k: [self.random(self.outs[j].shape, self.outs[j].dtype) for j in outs]  # noqa: E731
        items = self.grid([BATCH], cotangents)
        dtypes = [self.args[i].dtype for i in diff]
        return [self.batched("vmap of the vjp against a loop", f"{name} {tuple(axes)}", vjp, items,
                             [list(axes) + [0] * len(outs)], dtypes,
                             "the vmapped vjp gives other values than calling it element by element")
                for name, axes in patterns if any(a is not None for a in axes)]

    def batched_jvp_tasks(self, diff, ones):
        """f_jvp batched: vmap of the jvp over tangents (jacfwd), over primals and tangents, jvp of vmap."""
        n = len(self.args)
        outs = self.inexact_outputs
        dtypes = [self.outs[j].dtype for j in outs]
        check = "batched jvp against a loop"
        detail = "the batched jvp gives other values than the jvp element by element"

        def jvp(*values):
            args, ts = values[:n], values[n:]
            tangents = jax.jvp(self.restrict(args, diff), tuple(args[i] for i in diff), tuple(ts))[1]
            return [tangents[j] for j in outs]

        tangents = lambda k: [self.random(self.args[i].shape, self.args[i].dtype) for i in diff]  # noqa: E731
        items = self.grid([BATCH], tangents)
        all_ones = [ones[i] for i in range(n)] + [ones[i] for i in diff]
        tasks = [
            # vmap over the tangents at fixed primals: what jax.jacfwd does
            self.batched(check, "vmap of jvp, tangents batched (jacfwd)", jvp, items,
                         [[None] * n + [0] * len(diff)], dtypes, detail),
            self.batched(check, f"vmap of jvp, in_axes {tuple(all_ones)}", jvp, items, [all_ones], dtypes, detail),
        ]
        # jvp of vmap: the op vmapped (some fixed arguments unmapped), then differentiated
        in_axes = [None if i < self.n_fixed and i % 2 == 0 else 0 for i in range(n)]

        def jvp_of_vmap(*values):
            args, ts = values[:n], values[n:]
            f = lambda *dv: jax.vmap(self.call, in_axes=tuple(in_axes))(  # noqa: E731
                *[dv[diff.index(i)] if i in diff else a for i, a in enumerate(args)])
            tangents_out = jax.jvp(f, tuple(args[i] for i in diff), tuple(ts))[1]
            return [tangents_out[j] for j in outs]

        task = self.batched(check, f"jvp of vmap, in_axes {tuple(in_axes)}", jvp, items,
                            [in_axes + [0] * len(diff)], dtypes, detail)
        inputs = lambda: [jnp.stack([items[k][i] for k in range(BATCH)]) if in_axes[i] == 0 else items[0][i]  # noqa: E731
                          for i in range(n)] + [jnp.stack([items[k][n + m] for k in range(BATCH)])
                                                for m in range(len(diff))]
        task.update(mapped=jvp_of_vmap, inputs=inputs)  # the loop stays the jvp element by element
        tasks.append(task)
        return tasks

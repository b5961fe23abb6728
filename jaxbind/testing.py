"""The op checker: ``check_op`` tests an op's abstracts, derivatives and batching on given arguments."""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ._api import Op
from ._runtime import config

__all__ = ["OpCheck", "check_op"]

BATCH = 3  # elements of the batches the vmap checks build


@dataclasses.dataclass
class OpCheck:
    """What ``check_op`` checked: one entry per check, with its measured error and tolerance."""

    op: str
    kind: str
    checks: List[dict] = dataclasses.field(default_factory=list)
    skipped: List[str] = dataclasses.field(default_factory=list)

    def add(self, check: str, argument: str, error: float, tolerance: float):
        self.checks.append(dict(check=check, argument=argument, error=float(error), tolerance=float(tolerance)))

    def __str__(self):
        lines = [f"check_op: jaxbind {self.kind} op '{self.op}': {len(self.checks)} checks passed"]
        lines += [f"  {c['check']:<42} {c['argument']:<34} error {c['error']:.1e} <= {c['tolerance']:.1e}"
                  for c in self.checks]
        lines += [f"  not checked: {s}" for s in self.skipped]
        return "\n".join(lines)


class _Failure(AssertionError):
    pass


def check_op(op: Op, *args, fd_rtol: Optional[float] = None, **kwargs) -> OpCheck:
    """Check an op on the given arguments, as ``torch.library.opcheck`` does for PyTorch.

    Checks that every output matches its abstract and is fully written (in
    ``jaxbind.config.check_unwritten`` mode, for every callback the checks run);
    for linear and multilinear ops the dot-product test ``<f x, y> == <x, f_T y>``
    in every linear argument, with random real (and for complex dtypes complex)
    data; for nonlinear ops the jvp against central finite differences and the
    vjp against the jvp (``<vjp(c), t> == <c, jvp(t)>``); ``vmap`` with
    ``in_axes`` 0, 1 and None-mixed, of the op and of its vjp, against a Python
    loop; eager against jit. Tolerances scale with the precision of the dtypes.

    Args:
      op: a jaxbind op (``get_linear_call``/``get_nonlinear_call``).
      *args: array arguments to call it with (the point the checks run at).
      fd_rtol: the relative tolerance of the jvp against finite differences,
        for an op computed to an accuracy of its own (an adaptive ODE solver,
        an iterative solve); by default it follows from the dtype. The name is
        reserved: it is not passed to the op.
      **kwargs: the op call's keyword arguments.

    Returns:
      An :class:`OpCheck`: each check with the argument it was about, the
      measured error and its tolerance (``print`` it for a table).

    Raises:
      AssertionError: naming the op, the check, the argument and the measured
        error, for the first check that fails.
    """
    if not isinstance(op, Op):
        raise TypeError(f"check_op takes a jaxbind op, got {type(op).__name__}.")
    previous = config.check_unwritten
    config.check_unwritten = True
    try:
        return _Checker(op, args, kwargs, fd_rtol).run()
    finally:
        config.check_unwritten = previous


def _is_inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _eps(dtypes) -> float:
    inexact = [np.dtype(d) for d in dtypes if jnp.issubdtype(d, jnp.inexact)]
    return max((float(jnp.finfo(d).eps) for d in inexact), default=float(jnp.finfo(jnp.float64).eps))


def _norm(x) -> float:
    return float(jnp.sqrt(jnp.sum(jnp.abs(jnp.asarray(x, dtype=jnp.result_type(x, jnp.float32))) ** 2)))


def _pairing(a, b):
    """The real part of the bilinear pairing sum(a * b), JAX's transpose convention."""
    return sum(float(jnp.real(jnp.sum(jnp.asarray(x) * jnp.asarray(y)))) for x, y in zip(a, b))


def _distance(got, want) -> float:
    """Largest |got - want| relative to the largest |want| (0 for equal empty arrays)."""
    errors = []
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.size == 0:
            continue
        scale = max(float(np.max(np.abs(w))), np.finfo(np.float64).tiny) if w.dtype.kind in "fc" \
            else max(float(np.max(np.abs(w.astype(np.float64)))), 1.0)
        diff = np.abs(g.astype(np.complex128 if g.dtype.kind == "c" else np.float64)
                      - w.astype(np.complex128 if w.dtype.kind == "c" else np.float64))
        errors.append(float(np.max(diff)) / scale if not np.isnan(diff).any() else math.inf)
    return max(errors, default=0.0)


class _Checker:
    def __init__(self, op: Op, args, kwargs, fd_rtol=None):
        self.op, self.kwargs, self.fd_rtol = op, kwargs, fd_rtol
        self.definition = d = op.definition
        self.args = [jnp.asarray(a) for a in args]
        self.n_fixed = d.first_n_args_fixed
        self.summary = OpCheck(d.name, d.kind)
        self.rng = np.random.default_rng(0)

    # -- helpers ----------------------------------------------------------

    def fail(self, check: str, argument: str, detail: str, error: Optional[float] = None,
             tolerance: Optional[float] = None, cause: Optional[BaseException] = None):
        measured = f" Measured error {error:.3g}, tolerance {tolerance:.3g}." if error is not None else ""
        message = f"check_op: jaxbind op '{self.definition.name}': {check} failed for {argument}: {detail}.{measured}"
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

    def random(self, shape, dtype, complex_data=True):
        dtype = np.dtype(dtype)
        x = self.rng.standard_normal(shape)
        if dtype.kind == "c" and complex_data:
            x = x + 1j * self.rng.standard_normal(shape)
        return jnp.asarray(x.astype(dtype))

    def data_kinds(self, dtype):
        return [("real", False), ("complex", True)] if np.dtype(dtype).kind == "c" else [("real", False)]

    # -- the checks -------------------------------------------------------

    def run(self) -> OpCheck:
        self.check_outputs()
        self.check_eager_against_jit()
        if self.definition.kind in ("linear", "multilinear"):
            self.check_dot_products()
        elif self.definition.has_derivatives:
            self.check_jvp_and_vjp()
        else:
            self.summary.skipped.append("derivatives (the op was made without them)")
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
        self.outs = outs
        self.eps = _eps([a.dtype for a in self.args] + [o.dtype for o in outs])
        self.summary.add(check, f"{len(outs)} output(s)", 0.0, 0.0)

    def check_eager_against_jit(self):
        check = "eager against jit"
        jitted = self.attempt(check, "the given arguments", lambda: jax.jit(self.call)(*self.args))
        error, tol = _distance(jitted, self.outs), 10 * self.eps
        if error > tol:
            self.fail(check, "the outputs", "jit gives other values than an eager call", error, tol)
        self.summary.add(check, "the outputs", error, tol)

    def differentiable(self):
        return [i for i in range(self.n_fixed, len(self.args)) if _is_inexact(self.args[i])]

    def check_dot_products(self):
        d = self.definition
        tol = 1e3 * self.eps
        # Multilinear: each argument with the others held at the given values;
        # linear: jointly linear, so each argument with the others at zero.
        for i in range(self.n_fixed, len(self.args)):
            dtype = self.args[i].dtype
            for kind, complex_data in self.data_kinds(dtype):
                check = "dot product: <f x, y> == <x, f_T y>"
                argument = f"argument {i} ({kind} data)"

                def f_of(x, i=i):
                    args = list(self.args)
                    if d.kind == "linear":
                        args = args[:self.n_fixed] + [jnp.zeros_like(a) for a in args[self.n_fixed:]]
                    args[i] = x
                    return self.call(*args)

                x = self.random(self.args[i].shape, dtype, complex_data)
                ys = [self.random(o.shape, o.dtype, complex_data) for o in self.declared]
                fx, pullback = self.attempt(check, argument, lambda: jax.vjp(f_of, x))
                (ct,) = self.attempt(check, argument, lambda: pullback(ys))
                lhs, rhs = _pairing(fx, ys), _pairing([x], [ct])
                scale = max(_norm(x) * _norm(ct), sum(_norm(a) * _norm(b) for a, b in zip(fx, ys)), 1e-300)
                error = abs(lhs - rhs) / scale
                if not error <= tol:
                    self.fail(check, argument, f"<f x, y> = {lhs:.6g} but <x, f_T y> = {rhs:.6g}: the "
                              "transpose is not the transpose of f", error, tol)
                self.summary.add(check, argument, error, tol)

    def check_jvp_and_vjp(self):
        for i in self.differentiable():
            x0 = self.args[i]
            argument = f"argument {i}"

            def f_of(x, i=i):
                args = list(self.args)
                args[i] = x
                return [o for o in self.call(*args)]

            t = self.random(x0.shape, x0.dtype)
            # Fourth-order central differences, step ~ eps^(1/5) of the argument's scale.
            eps = float(jnp.finfo(x0.dtype).eps)
            h = eps ** 0.2 * max(1.0, float(jnp.sqrt(jnp.mean(jnp.abs(x0) ** 2))) if x0.size else 1.0)
            check = "jvp against central differences"
            _, tangent_out = self.attempt(check, argument, lambda: jax.jvp(f_of, (x0,), (t,)))
            for j, (jv, o) in enumerate(zip(tangent_out, self.outs)):
                if jnp.issubdtype(o.dtype, jnp.inexact) and (jv.shape, jv.dtype) != (o.shape, o.dtype):
                    self.fail(check, argument, f"the tangent of output {j} has shape {jv.shape} and dtype "
                              f"{jv.dtype}, but the output has {o.shape} {o.dtype} (check what the abstract "
                              "declares when called with the tangents)")
            points = [self.attempt(check, argument, lambda k=k: f_of(x0 + (k * h) * t)) for k in (-2, -1, 1, 2)]
            fd = [(m2 - 8 * m1 + 8 * p1 - p2) / (12 * h) for m2, m1, p1, p2 in zip(*points)]
            tol = 1e3 * eps ** 0.8 if self.fd_rtol is None else float(self.fd_rtol)
            errors = []
            for j, (jv, f) in enumerate(zip(tangent_out, fd)):
                if not jnp.issubdtype(f.dtype, jnp.inexact):
                    continue
                scale = max(_norm(jv), _norm(f), 1e-300) + eps ** 0.8 * _norm(self.outs[j]) / h
                errors.append(_norm(jnp.asarray(jv) - f) / scale)
            error = max(errors, default=0.0)
            if not error <= tol:
                self.fail(check, argument, "the jvp disagrees with finite differences of f", error, tol)
            self.summary.add(check, argument, error, tol)

            check = "vjp against jvp: <vjp(c),t> == <c,jvp(t)>"
            cts = [self.random(o.shape, o.dtype) for o in self.declared]
            _, pullback = self.attempt(check, argument, lambda: jax.vjp(f_of, x0))
            (ct,) = self.attempt(check, argument, lambda: pullback(cts))
            lhs, rhs = _pairing([ct], [t]), _pairing(cts, tangent_out)
            scale = max(_norm(ct) * _norm(t), sum(_norm(a) * _norm(b) for a, b in zip(cts, tangent_out)), 1e-300)
            tol = 1e3 * self.eps
            error = abs(lhs - rhs) / scale
            if not error <= tol:
                self.fail(check, argument, f"<vjp(c), t> = {lhs:.6g} but <c, jvp(t)> = {rhs:.6g}", error, tol)
            self.summary.add(check, argument, error, tol)

    def element(self, k):
        """Element ``k`` of the batches: the given arguments, perturbed (inexact ones) for k > 0.

        Fixed arguments are parameters whose structure an op may rely on (a
        monotonic time grid, a sign pattern): they are scaled as a whole.
        """
        rng = np.random.default_rng(100 + k)
        out = []
        for i, a in enumerate(self.args):
            if k and _is_inexact(a) and a.size:
                noise = 0.4 * k if i < self.n_fixed else rng.standard_normal(a.shape)
                a = a * jnp.asarray(1 + 0.05 * noise).astype(a.dtype)
            out.append(a)
        return out

    def check_vmap(self):
        n = len(self.args)
        patterns = [("in_axes 0", [0] * n), ("in_axes 1", [1 if a.ndim >= 1 else 0 for a in self.args])]
        if n > 1:
            patterns.append(("in_axes None-mixed", [None if i % 2 == 0 else 0 for i in range(n)]))
            patterns.append(("in_axes None-mixed", [0 if i % 2 == 0 else None for i in range(n)]))
        else:
            patterns.append(("in_axes None-mixed", [None]))  # the op inside a vmap over another value
        has_vjp = self.definition.has_derivatives and (
            self.definition.kind != "nonlinear" or self.differentiable())
        elements = [self.element(k) for k in range(BATCH)]
        cotangents = [[self.random(o.shape, o.dtype) for o in self.declared] for _ in range(BATCH)]
        diff = self.differentiable() if self.definition.kind == "nonlinear" else list(range(self.n_fixed, n))
        diff = [i for i in diff if _is_inexact(self.args[i])]
        tol = 1e2 * self.eps
        for name, axes in patterns:
            # An argument at in_axes None takes element 0's value in every element.
            items = [[e[i] if axes[i] is not None else elements[0][i] for i in range(n)] for e in elements]
            batched = [jnp.stack([items[k][i] for k in range(BATCH)], axis=axes[i]) if axes[i] is not None
                       else elements[0][i] for i in range(n)]
            if all(a is None for a in axes):
                # The op inside a vmap over something else (a scale of its outputs).
                scales = jnp.arange(1.0, BATCH + 1.0)
                fn = lambda s: [s * o for o in self.call(*elements[0])]
                got = self.attempt("vmap against a Python loop", f"{name} {tuple(axes)}", lambda: jax.vmap(fn)(scales))
                want = [jnp.stack([s * o for s in scales]) for o in self.call(*elements[0])]
            else:
                got = self.attempt("vmap against a Python loop", f"{name} {tuple(axes)}",
                                   lambda: jax.jit(jax.vmap(self.call, in_axes=axes))(*batched))
                want = [jnp.stack([self.call(*items[k])[j] for k in range(BATCH)]) for j in range(len(self.declared))]
            error = _distance(got, want)
            if not error <= tol:
                self.fail("vmap against a Python loop", f"{name} {tuple(axes)}", "the vmapped op gives other values "
                          "than calling it element by element", error, tol)
            self.summary.add("vmap against a Python loop", f"{name} {tuple(axes)}", error, tol)
            if not has_vjp or not diff or all(axes[i] is None for i in range(n)):
                continue

            def vjp(cts, *args):
                f = lambda *d: self.call(*[d[diff.index(i)] if i in diff else a for i, a in enumerate(args)])
                return jax.vjp(f, *[args[i] for i in diff])[1](list(cts))

            cts = [jnp.stack([c[j] for c in cotangents]) for j in range(len(self.declared))]
            got = self.attempt("vmap of the vjp against a loop", f"{name} {tuple(axes)}",
                               lambda: jax.jit(jax.vmap(vjp, in_axes=(0, *axes)))(cts, *batched))
            want = [jnp.stack([vjp(cotangents[k], *items[k])[m] for k in range(BATCH)]) for m in range(len(diff))]
            error = _distance(got, want)
            if not error <= tol:
                self.fail("vmap of the vjp against a loop", f"{name} {tuple(axes)}", "the vmapped vjp gives "
                          "other values than calling it element by element", error, tol)
            self.summary.add("vmap of the vjp against a loop", f"{name} {tuple(axes)}", error, tol)

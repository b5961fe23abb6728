"""Fuzzing the boundary: random op definitions under random compositions of transformations.

Each example draws an op definition and a program, builds the op (once per distinct
definition: ``_fuzz_ops.OPS``), and checks every output of the program (values, shapes, dtypes, the
float0 tangents of integer outputs) against the same program applied to a jax.numpy reference.

The definition (``_fuzz_ops.Definition``) is one of four elementwise functions, each with a jnp
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
``broadcast_all``) and the function's parameters from the call's kwargs. The definitions and the op
are in ``_fuzz_ops.py``, the Python callbacks in ``_fuzz_python.py``, the numba kernels in
``_fuzz_numba.py``; this file has the reference, the programs and the test.

The program is 1-3 transformations among ``jit``, ``vmap`` (each argument mapped at axis 0 or
not mapped, size 1-3, nestable), ``jvp``, ``vjp`` and ``grad`` of a real scalar loss (each
derivative with respect to a drawn subset of the differentiable arguments; at most one for the
nonlinear op, which is first order, and two for the linear ones), applied alike to the op and
to the reference.

Bounded for CI: JAXBIND_PROPERTY_EXAMPLES examples (default 25), derandomized so that a run is
reproducible; JAXBIND_PROPERTY_SEED=<int> searches other programs.
"""

import functools
import operator
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from _fuzz_ops import Definition, definitions, make_op
from _shared import sample
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

# Examples (random programs): JAXBIND_PROPERTY_EXAMPLES (default 25; each compiles a program or
# two, and the numba kernels compile once per signature). Derandomized, unless
# JAXBIND_PROPERTY_SEED picks another search (hypothesis's seed).
EXAMPLES = int(os.environ.get("JAXBIND_PROPERTY_EXAMPLES", "25"))
SEED = os.environ.get("JAXBIND_PROPERTY_SEED")
BOUNDED = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=SEED is None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SEEDED = hypothesis.seed(int(SEED)) if SEED is not None else (lambda test: test)

VALUES = (-2.0, -1.0, -0.5, 0.5, 1.0, 1.5, 3.0)  # coefficients and factors


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
    ours = lambda *args: tuple(op(*args, **kwargs))
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
            argnums = tuple(
                sorted(data.draw(st.lists(st.sampled_from(diff), min_size=1, unique=True), label=f"{t} argnums"))
            )
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
@given(
    d=definitions(),
    core=st.lists(st.integers(1, 3), max_size=2).map(tuple),
    coef=st.lists(st.sampled_from(VALUES), min_size=3, max_size=3),
    factor=st.sampled_from(VALUES),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_random_ops_under_random_transformations_match_jax_numpy(d, core, coef, factor, seed, data):
    if d.function == "sinmix" and "native" in d.kinds:
        coef = [1.0] * 3  # jb_xsin computes x sin(x)
    kwargs = dict(
        nfix=d.n_fixed,
        coef=tuple(float(c) for c in coef[: d.n_x]),
        factor=float(factor),
        core=len(core),
        layout=int(d.layout == "last"),
        extra={None: 0, "bool": 1}.get(d.extra, 2),
        nres=d.n_residuals,
    )
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

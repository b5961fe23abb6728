"""The op zoo: each reference op as a Python callback and as a native kernel, with its
jax.numpy reference.

``transforms/test_zoo.py`` runs every entry, for every kind of callback, through jit,
jvp, vjp, grad, linear_transpose, vmap (several axes, unmapped arguments, nested),
their compositions and ``jaxbind.testing.check_op``. The kinds of an entry compute
the same function, so one reference serves them all:

- ``python``: NumPy callbacks;
- ``native``: the kernels of ``kernels/test_kernels.c``;
- for the nonlinear entry also mixes (a native ``f`` with Python derivatives, ...).
"""

import dataclasses
from collections.abc import Callable

import _kernels
import jax.numpy as jnp
import numpy as np

import jaxbind

LIB = _kernels.load()
FACTOR = -1.75  # the scale entries' kwarg (the kernel's default is 2)
FLOATS = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.complex64), np.dtype(np.complex128))
TWO = (np.dtype(np.float32), np.dtype(np.complex128))  # one single, one double precision
F64 = (np.dtype(np.float64),)


def like_last(*args, **kwargs):
    """One output shaped like the last argument."""
    return ((args[-1].shape, args[-1].dtype),)


def like_first(*args, **kwargs):
    """One output shaped like the first argument."""
    return ((args[0].shape, args[0].dtype),)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One op of the zoo.

    ``ops``: kind -> jaxbind op; ``apply(op, *args)``: the op's float outputs (a tuple);
    ``reference(*args)``: the same in jax.numpy; ``shapes``: of the arguments for one
    call; ``argnums``: the differentiable arguments (the others are fixed); ``kwargs``:
    the op call's keyword arguments; ``linear``: linear in each differentiable argument.
    """

    name: str
    ops: dict[str, object]
    reference: Callable
    shapes: tuple[tuple, ...]
    dtypes: tuple[np.dtype, ...]
    argnums: tuple[int, ...]
    linear: bool
    kwargs: dict[str, object] = dataclasses.field(default_factory=dict)
    n_float_outputs: int = 1

    def apply(self, kind, *args):
        outs = self.ops[kind](*args, **self.kwargs)
        return tuple(outs[: self.n_float_outputs])


# ---------------------------------------------------------------------------
# scale: y = factor * x (kwarg "factor", default 2), its own transpose
# ---------------------------------------------------------------------------


def scale_py(out, args, kwargs_dump):
    factor = jaxbind.load_kwargs(kwargs_dump).get("factor", 2.0)
    np.multiply(args[-1], np.asarray(factor, dtype=np.real(args[-1]).dtype), out=out[0])


SCALE = Entry(
    "scale",
    {
        "python": jaxbind.get_linear_call(scale_py, scale_py, like_last, like_last),
        "native": jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_scale, like_last, like_last),
    },
    reference=lambda x: (FACTOR * x,),
    shapes=((3, 4),),
    dtypes=FLOATS,
    argnums=(0,),
    linear=True,
    kwargs={"factor": FACTOR},
)

# ---------------------------------------------------------------------------
# multiply: y = w * x elementwise; with w fixed (linear in x), and bilinear
# ---------------------------------------------------------------------------


def multiply_py(out, args, kwargs_dump):  # f and each transpose: (other factor, cotangent)
    np.multiply(args[0], args[1], out=out[0])


FIXED = Entry(
    "fixed",
    {
        "python": jaxbind.get_linear_call(multiply_py, multiply_py, like_last, like_last, first_n_args_fixed=1),
        "native": jaxbind.get_linear_call(LIB.jb_multiply, LIB.jb_multiply, like_last, like_last, first_n_args_fixed=1),
    },
    reference=lambda w, x: (w * x,),
    shapes=((3, 4), (3, 4)),
    dtypes=TWO,
    argnums=(1,),
    linear=True,
)

MULTILINEAR = Entry(
    "multilinear",
    {
        "python": jaxbind.get_linear_call(multiply_py, (multiply_py, multiply_py), like_last, (like_last, like_last)),
        "native": jaxbind.get_linear_call(
            LIB.jb_multiply, (LIB.jb_multiply, LIB.jb_multiply), like_last, (like_last, like_last)
        ),
    },
    reference=lambda w, x: (w * x,),
    shapes=((3, 4), (3, 4)),
    dtypes=TWO,
    argnums=(0, 1),
    linear=True,
)

# ---------------------------------------------------------------------------
# two outputs of different shapes: (3 x, sum(x)), linear
# ---------------------------------------------------------------------------


def triple_and_sum_py(out, args, kwargs_dump):
    out[0][...] = 3 * args[0]
    out[1][...] = np.sum(args[0])


def triple_and_sum_T_py(out, args, kwargs_dump):
    ct_y, ct_s = args
    out[0][...] = 3 * ct_y + ct_s


def triple_and_sum_abstract(x, **kwargs):
    return ((x.shape, x.dtype), ((), x.dtype))


def triple_and_sum_T_abstract(ct_y, ct_s, **kwargs):
    return ((ct_y.shape, ct_y.dtype),)


TWO_OUTPUTS = Entry(
    "two_outputs",
    {
        "python": jaxbind.get_linear_call(
            triple_and_sum_py, triple_and_sum_T_py, triple_and_sum_abstract, triple_and_sum_T_abstract
        ),
        "native": jaxbind.get_linear_call(
            LIB.jb_triple_and_sum, LIB.jb_triple_and_sum_T, triple_and_sum_abstract, triple_and_sum_T_abstract
        ),
    },
    reference=lambda x: (3 * x, jnp.sum(x)),
    shapes=((3, 4),),
    dtypes=F64,
    argnums=(0,),
    linear=True,
    n_float_outputs=2,
)

# ---------------------------------------------------------------------------
# nonlinear: y = x sin(x), with its jvp and vjp; native, Python and mixed
# ---------------------------------------------------------------------------


def xsin_py(out, args, kwargs_dump):
    out[0][...] = np.sin(args[0]) * args[0]


def xsin_derivative_py(out, args, kwargs_dump):  # the jvp (x, t) and the vjp (x, ct)
    x, t = args
    out[0][...] = (np.cos(x) * x + np.sin(x)) * t


def _xsin(f, jvp, vjp):
    return jaxbind.get_nonlinear_call(f, (jvp, vjp), like_first, like_first)


NONLINEAR = Entry(
    "nonlinear",
    {
        "python": _xsin(xsin_py, xsin_derivative_py, xsin_derivative_py),
        "native": _xsin(LIB.jb_xsin, LIB.jb_xsin_derivative, LIB.jb_xsin_derivative),
        "native_f_python_derivatives": _xsin(LIB.jb_xsin, xsin_derivative_py, xsin_derivative_py),
        "python_f_native_derivatives": _xsin(xsin_py, LIB.jb_xsin_derivative, LIB.jb_xsin_derivative),
        "native_jvp_python_vjp": _xsin(LIB.jb_xsin, LIB.jb_xsin_derivative, xsin_derivative_py),
    },
    reference=lambda x: (x * jnp.sin(x),),
    shapes=((3, 4),),
    dtypes=F64,
    argnums=(0,),
    linear=False,
)

# ---------------------------------------------------------------------------
# func_can_batch: y = factor * x, the whole batch in one call
# ---------------------------------------------------------------------------


def batched_scale_py(out, args, kwargs_dump):  # as jb_batched_scale: the levels in out[1], if any
    kwargs = jaxbind.load_kwargs(kwargs_dump)
    axes = kwargs["batch_axes"]
    for a in axes or ():
        assert len(a) == len(axes[0]) and all(-1 <= k < args[0].ndim for k in a), axes
    out[0][...] = kwargs.get("factor", 2.0) * args[-1]
    if len(out) > 1:
        out[1][...] = len(axes[0]) if axes else 0


def batched_scale_abstract(x, *, batch_axes, factor=2.0):
    """The output laid out like the input, and (with_levels) an int64 entry per batch element."""
    if batch_axes is None:  # not batched
        return ((x.shape, x.dtype),)
    (axes,) = batch_axes  # the input's axis per level, oldest first
    return ((x.shape, x.dtype, axes[-1]),)


def batched_scale_levels_abstract(x, *, batch_axes, factor=2.0):
    if batch_axes is None:
        return ((x.shape, x.dtype), ((), np.int64))
    (axes,) = batch_axes
    sizes = tuple(x.shape[a] for a in axes)
    return ((x.shape, x.dtype, axes[-1]), (sizes, np.int64, len(sizes) - 1))


def _batched(f, abstract=batched_scale_abstract, abstract_T=batched_scale_abstract):
    return jaxbind.get_linear_call(f, f, abstract, abstract_T, func_can_batch=True)


FUNC_CAN_BATCH = Entry(
    "func_can_batch",
    {"python": _batched(batched_scale_py), "native": _batched(LIB.jb_batched_scale)},
    reference=lambda x: (FACTOR * x,),
    shapes=((3, 4),),
    dtypes=F64,
    argnums=(0,),
    linear=True,
    kwargs={"factor": FACTOR},
)

# The same with the levels each call saw as a second output (not differentiated).
BATCHED_LEVELS = {
    "python": _batched(batched_scale_py, batched_scale_levels_abstract),
    "native": _batched(LIB.jb_batched_scale, batched_scale_levels_abstract),
}

ENTRIES = {e.name: e for e in (SCALE, FIXED, MULTILINEAR, TWO_OUTPUTS, NONLINEAR, FUNC_CAN_BATCH)}


def cases(linear_only=False, reduced=False):
    """(entry name, kind, dtype) for every entry, kind and dtype of the zoo.

    ``reduced``: for the slower compositions, one single and one double precision dtype
    (of those an entry has)."""

    def dtypes(e):
        return [d for d in e.dtypes if d in TWO] or e.dtypes if reduced else e.dtypes

    return [
        (e.name, kind, dtype)
        for e in ENTRIES.values()
        if e.linear or not linear_only
        for kind in e.ops
        for dtype in dtypes(e)
    ]


def case_id(case):
    name, kind, dtype = case
    return f"{name}-{kind}-{np.dtype(dtype).name}"


# The native scale op the native tests share (jb_scale with the zoo's factor), and a loss for grads.
TIGHT = dict(rtol=1e-12, atol=1e-13)
scale_op = jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_scale, like_last, like_last)


def reference_scale(x):
    return FACTOR * x


def loss_of(f):
    """A real loss of a (possibly complex) array through ``f`` (the real*imag term
    catches a missing or spurious conjugation)."""

    def loss(x):
        y = f(x)
        return jnp.sum(jnp.abs(y) ** 2) + jnp.sum(jnp.real(y) * jnp.imag(y)) + jnp.sum(jnp.real(y))

    return loss

"""The fuzzed op definitions (tests/transforms/test_fuzz_ops.py): what hypothesis draws, and the jaxbind op
made from one with each callback Python, numba or a C test kernel."""

import dataclasses

import _kernels
import numpy as np
from _fuzz_python import PYTHON
from hypothesis import strategies as st

import jaxbind
from jaxbind import _vmap_methods

try:
    import numba
except ImportError:  # pragma: no cover - numba is an optional dependency
    numba = None
if numba is not None:
    from _fuzz_numba import numba_callback

LIB = _kernels.load()

FLOATING = ("float32", "float64", "complex64", "complex128")
FUNCTIONS = ("lincomb", "scale", "product", "sinmix")
EXTRAS = (None, "bool", "int32", "int64")
KINDS = ("python", "numba") if numba is not None else ("python",)


# ---------------------------------------------------------------------------
# The definition
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Definition:
    function: str
    n_fixed: int
    dtypes: tuple[str, ...]  # of every argument, the fixed ones first
    extra: str | None  # dtype of the extra (non-differentiable) output, or None
    func_can_batch: bool
    vmap_method: str
    layout: str  # func_can_batch: "front" (levels in front, oldest first) or "last" (like the last argument)
    n_residuals: int
    thread_safe: bool
    kinds: tuple[str, ...]  # per callback: (f, *transposes) or (f, f_jvp, f_vjp)

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
    methods = _vmap_methods.accepted(_vmap_methods.DOOR_OP)
    vmap_method = "sequential" if func_can_batch else draw(st.sampled_from(methods))
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
    d = Definition(
        function, n_fixed, dtypes, extra, func_can_batch, vmap_method, layout, n_residuals, draw(st.booleans()), ()
    )
    available = KINDS + (("native",) if native_kernels_fit(d) else ())
    if style == "mixed":
        kinds = tuple(draw(st.sampled_from(available)) for _ in d.roles)
    else:
        kinds = (style if style in available else "python",) * len(d.roles)
    return dataclasses.replace(d, kinds=kinds)


# ---------------------------------------------------------------------------
# Abstracts and the op
# ---------------------------------------------------------------------------

# The C test kernels (tests/kernels/test_kernels.c) by (role, func_can_batch).
NATIVE = {
    ("scale_f", False): LIB.jb_scale,
    ("scale_T", False): LIB.jb_scale,
    ("scale_f", True): LIB.jb_batched_scale,
    ("scale_T", True): LIB.jb_batched_scale,
    ("product_f", False): LIB.jb_multiply,
    ("product_T", False): LIB.jb_multiply,
    ("sinmix_f", False): LIB.jb_xsin,
    ("sinmix_jvp", False): LIB.jb_xsin_derivative,
    ("sinmix_vjp", False): LIB.jb_xsin_derivative,
}


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
    return {
        "f": (n_in, n_outputs + d.n_residuals),
        "lincomb_T": (d.n_fixed + n_outputs, d.n_x),
        "scale_T": (d.n_fixed + n_outputs, 1),
        "product_T": (n_in - 1 + n_outputs, 1),
        "sinmix_jvp": (n_in + d.n_residuals + d.n_x, 1),  # the float output's tangent only
        "sinmix_vjp": (n_in + d.n_residuals + 1, d.n_x),
    }[role if role in COUNTED else "f"]


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
    rt, xs = d.result_dtype, [np.dtype(t) for t in d.dtypes[d.n_fixed :]]
    outputs = [rt] + ([np.dtype(d.extra)] if d.extra else [])
    callbacks = [_callback(d, role, kind) for role, kind in zip(d.roles, d.kinds)]
    flags = dict(
        first_n_args_fixed=d.n_fixed,
        func_can_batch=d.func_can_batch,
        vmap_method=d.vmap_method,
        thread_safe=d.thread_safe,
        name=f"fuzz{len(OPS)}_{d.function}",
    )
    if d.function == "sinmix":
        residuals = [rt] + [np.dtype(np.int16)] * (d.n_residuals - 1) if d.n_residuals else []
        op = jaxbind.get_nonlinear_call(
            callbacks[0],
            tuple(callbacks[1:]),
            _abstract(outputs + residuals, d.layout),
            _abstract(xs, d.layout),
            n_residuals=d.n_residuals,
            **flags,
        )
    elif d.function == "product":
        op = jaxbind.get_linear_call(
            callbacks[0],
            tuple(callbacks[1:]),
            _abstract(outputs, d.layout),
            tuple(_abstract([x], d.layout) for x in xs),
            **flags,
        )
    else:
        op = jaxbind.get_linear_call(
            callbacks[0], callbacks[1], _abstract(outputs, d.layout), _abstract(xs, d.layout), **flags
        )
    OPS[d] = op
    return op

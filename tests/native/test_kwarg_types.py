"""Kwargs of the wrong type or name for native kernels: never the fallback in silence.

A C kernel's accessor that cannot read a kwarg as it asks fails the call with a message naming the
op, the kwarg, the type passed and the type asked for, eagerly, under jit, in a vmap walk and in the
parallel walk; a kernel that declares its kwargs (``jaxbind.native(kernel, kwargs={...})``,
``jaxbind.numba_kernel(fn, kwargs={...})``) has an unknown name or a value of the wrong type refused
when the op is called, before anything is compiled, and gets the values it takes converted to the
declared kinds. Values are checked against NumPy; errors by the parts of their text.
"""

import ctypes
import re

import _abi
import _kernels
import jax
import numpy as np
import pytest
from zoo import batched_scale_levels_abstract

import jaxbind
from jaxbind import _trampoline
from jaxbind._numba._call_struct import Call

LIB = _kernels.load()


def like_first(x, **kwargs):
    return ((x.shape, x.dtype),)


def three(*args, **kwargs):
    return (((3,), np.float64),)


radius = jaxbind.get_nonlinear_call(LIB.jb_radius, None, like_first, None)
reader = jaxbind.get_nonlinear_call(LIB.jb_kwarg_read, None, three, None)


def run(f, x):
    """f(x) eagerly, jitted and vmapped (a walk over 4 elements, of which one is kept), as NumPy."""
    return [
        np.asarray(jax.block_until_ready(g(x)))
        for g in (f, jax.jit(f), lambda v: jax.jit(jax.vmap(f))(np.stack([v] * 4))[2])
    ]


def first_line(info) -> str:
    """The message of a raised exception without the note JAX adds under a trace."""
    return str(info.value).split("\n")[0]


def kwarg_error(name, passed, asked, accessor, takes, op="jb_radius"):
    return (
        rf"(?m)^INTERNAL: jaxbind op '{op}': native kernel failed: keyword argument '{name}' is "
        rf"{re.escape(passed)}, but the kernel reads it as {asked} \({accessor}\): pass {re.escape(takes)}$"
    )


# ---------------------------------------------------------------------------
# Undeclared C kernels: the accessor fails the call
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("way", ["eager", "jit", "vmap"])
def test_a_float_kwarg_passed_as_a_string_fails_the_call(way):
    x = np.arange(1.0, 4.0)
    f = {
        "eager": lambda v: radius(v, r="0.1")[0],
        "jit": jax.jit(lambda v: radius(v, r="0.1")[0]),
        "vmap": jax.jit(jax.vmap(lambda v: radius(v, r="0.1")[0])),
    }[way]
    argument = np.stack([x] * 5) if way == "vmap" else x
    with pytest.raises(
        RuntimeError,
        match=kwarg_error("r", "a string ('0.1')", "a float", "jaxbind_kwarg_float", "a float (or an int)"),
    ):
        jax.block_until_ready(f(argument))
    # the process and the op go on
    np.testing.assert_array_equal(jax.jit(lambda v: radius(v, r=0.1)[0])(x), 0.1 * x)


def test_a_concurrent_kernel_reports_the_kwarg_too():
    # (run on XLA's thread pool by the asynchronous handler)
    op = jaxbind.get_nonlinear_call(jaxbind.native(LIB.jb_radius, concurrent=True), None, like_first, None)
    with pytest.raises(
        RuntimeError,
        match=kwarg_error("r", "an int array of 2 entries", "a float", "jaxbind_kwarg_float", "a float (or an int)"),
    ):
        jax.block_until_ready(jax.jit(lambda v: op(v, r=[1, 2])[0])(np.ones(3)))
    np.testing.assert_array_equal(jax.jit(lambda v: op(v, r=2)[0])(np.ones(3)), [2, 2, 2])


def test_an_int_for_a_float_is_read_as_the_float():
    x = np.arange(1.0, 4.0)
    for result in run(lambda v: radius(v, r=3)[0], x):
        np.testing.assert_array_equal(result, 3.0 * x)
    np.testing.assert_array_equal(radius(x)[0], 0.25 * x)  # absent: the kernel's fallback


def test_the_kwarg_error_is_reported_over_what_the_kernel_did_next():
    # jb_radius fails on purpose after reading r: the kwarg it could not read is the cause
    with pytest.raises(
        RuntimeError, match=kwarg_error("r", "a bool (True)", "a float", "jaxbind_kwarg_float", "a float (or an int)")
    ):
        jax.block_until_ready(radius(np.ones(2), r=True, fail=1)[0])
    with pytest.raises(RuntimeError, match=r"(?m)native kernel failed: jb_radius: failed on purpose$"):
        jax.block_until_ready(radius(np.ones(2), r=0.5, fail=1)[0])


def test_an_undeclared_kernel_takes_a_misspelt_name_as_absent():
    # (what declaring the kwargs is for: see test_a_declared_kernel_refuses_an_unknown_name)
    np.testing.assert_array_equal(radius(np.ones(2), rr=0.1)[0], [0.25, 0.25])


FALLBACK = {0: [-7, 1, 1], 1: [-2.5, 1, 1], 2: [2, 1, 1], 3: [ord("f"), 8, 1], 4: [0, 0, 1], 5: [0, 0, 1]}
ACCESSORS = {
    0: ("an int", "jaxbind_kwarg_int", "an int (or a bool)"),
    1: ("a float", "jaxbind_kwarg_float", "a float (or an int)"),
    2: ("a bool", "jaxbind_kwarg_bool", "a bool (or the int 0 or 1)"),
    3: ("a string", "jaxbind_kwarg_string", "a string"),
    4: ("an int array", "jaxbind_kwarg_int_array", "a 1-d sequence or array of ints"),
    5: ("a float array", "jaxbind_kwarg_float_array", "a 1-d sequence or array of floats ([1.0, 2.0], not [1, 2])"),
}
READS = [  # (accessor, value passed, what it reads: [value, size, 0] or the refusal's "passed" text)
    (0, 5, [5, 1, 0]),
    (0, True, [1, 1, 0]),
    (0, -(2**63), [float(-(2**63)), 1, 0]),
    (0, 2.5, "a float (2.5)"),
    (0, 2.0, "a float (2)"),
    (0, "5", "a string ('5')"),
    (0, [1, 2], "an int array of 2 entries"),
    (1, 2.5, [2.5, 1, 0]),
    (1, 3, [3, 1, 0]),
    (1, np.float32(0.5), [0.5, 1, 0]),
    (1, True, "a bool (True)"),
    (1, "0.1", "a string ('0.1')"),
    (1, [0.5], "a float array of 1 entry"),
    (1, "x" * 50, "a string ('" + "x" * 40 + "...')"),
    (2, True, [1, 1, 0]),
    (2, False, [0, 1, 0]),
    (2, 1, [1, 1, 0]),
    (2, 0, [0, 1, 0]),
    (2, 2, "an int (2)"),
    (2, 1.0, "a float (1)"),
    (3, "héllo", [ord("h"), len("héllo".encode()), 0]),
    (3, 5, "an int (5)"),
    (3, False, "a bool (False)"),
    (4, [1, 2, 39], [42, 3, 0]),
    (4, np.array([], np.float64), [0, 0, 0]),
    (4, [0.5], "a float array of 1 entry"),
    (4, 3, "an int (3)"),
    (5, [0.5, 1.25], [1.75, 2, 0]),
    (5, [], [0, 0, 0]),
    (5, [1, 2], "an int array of 2 entries"),
    (5, 2.5, "a float (2.5)"),
]


@pytest.mark.parametrize("how, value, expected", READS)
def test_every_accessor_reads_what_it_takes_and_refuses_the_rest(how, value, expected):
    if isinstance(expected, list):
        np.testing.assert_array_equal(jax.jit(lambda v: reader(v, how=how, v=value)[0])(np.zeros(1)), expected)
        return
    asked, accessor, takes = ACCESSORS[how]
    with pytest.raises(RuntimeError, match=kwarg_error("v", expected, asked, accessor, takes, op="jb_kwarg_read")):
        jax.block_until_ready(jax.jit(lambda v: reader(v, how=how, v=value)[0])(np.zeros(1)))


@pytest.mark.parametrize("how", sorted(FALLBACK))
def test_an_absent_kwarg_reads_as_the_fallback(how):
    np.testing.assert_array_equal(reader(np.zeros(1), how=how)[0], FALLBACK[how])


class CallV1(ctypes.Structure):
    """A caller of ABI version 1: the call struct without kwarg_error (its last two fields)."""

    _fields_ = Call._fields_[:-2]
    assert [name for name, _ in Call._fields_[-2:]] == ["kwarg_error", "kwarg_error_size"]


def test_a_caller_of_version_1_gets_the_fallback_and_nothing_written_past_its_struct():
    # A kernel compiled against this header, called by a jaxbind of ABI version 1: its call has
    # no kwarg_error, which the accessor must not touch; it returns the fallback, as version 1 did.
    out, shape = np.full(3, np.nan), (ctypes.c_int64 * 1)(3)
    array = _abi.Array(out.ctypes.data, shape, 1, 12)
    kwargs = (_abi.Kwarg * 2)(
        _abi.Kwarg(b"how", 1, 1, 1, 0.0, None, None, None), _abi.Kwarg(b"v", 4, 3, 0, 0.0, b"0.1", None, None)
    )
    error = ctypes.create_string_buffer(64)
    call = CallV1(
        ctypes.sizeof(CallV1),
        1,
        1,
        ctypes.addressof(array),
        0,
        None,
        2,
        ctypes.addressof(kwargs),
        ctypes.cast(error, ctypes.c_void_p),
        64,
    )
    kernel = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(ctypes.cast(LIB.jb_kwarg_read, ctypes.c_void_p).value)
    assert kernel(ctypes.addressof(call)) == 0
    np.testing.assert_array_equal(out, [-2.5, 1, 1])
    assert error.value == b""


def test_a_kwarg_error_in_a_parallel_walk_names_the_kwarg():
    # Only elements whose first entry is negative read negative_scale: the one here is far from the
    # first, in a chunk another thread may run.
    busy = jaxbind.get_nonlinear_call(
        LIB.jb_busy_thread, None, lambda x, **k: ((x.shape, x.dtype), ((), np.int64)), None
    )
    walk = lambda x, **kw: jax.jit(jax.vmap(lambda r: busy(r, iterations=20000, **kw)[0]))(x)
    x = np.abs(np.random.default_rng(5).standard_normal((64, 3))) + 1.0
    x[50] *= -1
    with pytest.raises(
        RuntimeError,
        match=kwarg_error(
            "negative_scale",
            "a string ('2')",
            "a float",
            "jaxbind_kwarg_float",
            "a float (or an int)",
            op="jb_busy_thread",
        ),
    ):
        jax.block_until_ready(walk(x, negative_scale="2"))
    expected = x.copy()
    expected[50] *= 2
    np.testing.assert_array_equal(walk(x, negative_scale=2), expected)


# ---------------------------------------------------------------------------
# Declared kwargs: refused at the call, converted to the declared kinds
# ---------------------------------------------------------------------------

declared_radius = jaxbind.native(LIB.jb_radius, kwargs={"r": float, "fail": bool})
declared_op = jaxbind.get_nonlinear_call(declared_radius, None, like_first, None)


@pytest.mark.parametrize("way", ["eager", "jit", "vmap"])
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(rr=0.1),
            "keyword argument 'rr' is not one that native kernel 'jb_radius' declares (fail: bool, r: float); "
            "check its name, or add it to the kernel's kwargs={...} (every callback of an op gets every "
            "keyword argument of its call).",
        ),
        (
            dict(r="0.1"),
            "keyword argument 'r' is a str ('0.1'), but native kernel 'jb_radius' declares it float: pass "
            "a float (or an int).",
        ),
        (
            dict(r=0.5, fail=2),
            "keyword argument 'fail' is an int (2), but native kernel 'jb_radius' declares it bool: "
            "pass a bool (or the int 0 or 1).",
        ),
        (
            dict(r=[0.5]),
            "keyword argument 'r' is a list ([0.5]), but native kernel 'jb_radius' declares it float: pass "
            "a float (or an int).",
        ),
    ],
)
def test_a_declared_kernel_refuses_an_unknown_name_or_a_wrong_type_at_the_call(way, kwargs, message):
    f = lambda v: declared_op(v, **kwargs)[0]
    g = {"eager": f, "jit": jax.jit(f), "vmap": jax.jit(jax.vmap(f))}[way]
    sites = _trampoline.num_sites()
    with pytest.raises(TypeError) as info:
        g(np.ones((2, 3)))
    assert first_line(info) == "jaxbind op 'jb_radius': " + message
    assert _trampoline.num_sites() == sites  # refused before anything was compiled


def test_a_declared_kernel_gets_the_values_it_takes():
    x = np.arange(1.0, 4.0)
    for result in run(lambda v: declared_op(v, r=3, fail=0)[0], x):
        np.testing.assert_array_equal(result, 3.0 * x)
    np.testing.assert_array_equal(declared_op(x)[0], 0.25 * x)  # omitted: the kernel's fallback


def declared_reader(**declared):
    return jaxbind.get_nonlinear_call(
        jaxbind.native(LIB.jb_kwarg_read, kwargs=dict(how=int, **declared)), None, three, None
    )


def test_the_kernel_receives_the_declared_kind():
    # v declared float and passed 3 reaches the kernel as a float: read as an int, it is refused
    floats = declared_reader(v=float)
    np.testing.assert_array_equal(floats(np.zeros(1), how=1, v=3)[0], [3, 1, 0])
    with pytest.raises(RuntimeError, match=kwarg_error("v", "a float (3)", *ACCESSORS[0], op="jb_kwarg_read")):
        jax.block_until_ready(floats(np.zeros(1), how=0, v=3)[0])
    # [1, 2] declared list[float] reaches it as floats (undeclared, it is an int array)
    np.testing.assert_array_equal(declared_reader(v=list[float])(np.zeros(1), how=5, v=[1, 2])[0], [3, 2, 0])
    # True declared int is the int 1; the int 1 declared bool is True
    np.testing.assert_array_equal(declared_reader(v=int)(np.zeros(1), how=0, v=True)[0], [1, 1, 0])
    np.testing.assert_array_equal(declared_reader(v=bool)(np.zeros(1), how=2, v=1)[0], [1, 1, 0])


def test_a_declared_default_fills_an_omitted_kwarg():
    op = declared_reader(v=0.75)
    np.testing.assert_array_equal(op(np.zeros(1), how=1)[0], [0.75, 1, 0])  # not the kernel's -2.5
    np.testing.assert_array_equal(op(np.zeros(1), how=1, v=2)[0], [2, 1, 0])
    strings = declared_reader(v="abc")
    np.testing.assert_array_equal(strings(np.zeros(1), how=3)[0], [ord("a"), 3, 0])
    np.testing.assert_array_equal(declared_reader(v=(1, 2))(np.zeros(1), how=4)[0], [3, 2, 0])
    with pytest.raises(
        TypeError,
        match=r"keyword argument 'v' is a float \(0\.5\), but native kernel "
        r"'jb_kwarg_read' declares it list\[int\]",
    ):
        declared_reader(v=(1, 2))(np.zeros(1), how=4, v=0.5)


def test_an_empty_declaration_takes_no_kwargs():
    op = jaxbind.get_nonlinear_call(jaxbind.native(LIB.jb_radius, kwargs={}), None, like_first, None)
    np.testing.assert_array_equal(op(np.ones(2))[0], [0.25, 0.25])
    with pytest.raises(TypeError, match=r"'r' is not one that native kernel 'jb_radius' declares \(none\)"):
        op(np.ones(2), r=0.5)


def test_every_declared_kernel_of_an_op_checks_the_call():
    # a Python f and a declared native transpose: the transpose gets every kwarg of the call
    def python_scale(out, args, kwargs_dump):
        np.multiply(args[-1], jaxbind.load_kwargs(kwargs_dump).get("factor", 2.0), out=out[0])

    op = jaxbind.get_linear_call(
        python_scale,
        jaxbind.native(LIB.jb_scale, kwargs={"factor": float}),
        like_first,
        like_first,
        name="half_declared",
    )
    x = np.arange(3.0)
    np.testing.assert_array_equal(op(x, factor=3)[0], 3 * x)
    np.testing.assert_array_equal(jax.linear_transpose(lambda v: op(v, factor=3)[0], x)(x)[0], 3 * x)
    with pytest.raises(
        TypeError,
        match=r"^jaxbind op 'half_declared': keyword argument 'mode' is not one that "
        r"native kernel 'jb_scale' declares \(factor: float\)",
    ):
        op(x, factor=3, mode="fast")


def test_a_batching_kernel_still_gets_the_batch_layout():
    # batch_levels and batch_axes are jaxbind's, not the call's: a declaration neither lists nor refuses them
    kernel = jaxbind.native(LIB.jb_batched_scale, kwargs={"factor": float})
    op = jaxbind.get_linear_call(
        kernel, kernel, batched_scale_levels_abstract, batched_scale_levels_abstract, func_can_batch=True
    )
    x = np.arange(6.0).reshape(2, 3)
    y, levels = jax.vmap(lambda v: tuple(op(v, factor=4)), in_axes=1, out_axes=(1, 0))(x)
    np.testing.assert_array_equal(y, 4 * x)
    np.testing.assert_array_equal(levels, [1, 1, 1])


@pytest.mark.parametrize(
    "spec, error, message",
    [
        (
            [("r", float)],
            TypeError,
            "jaxbind.native: kwargs must be a dict of name -> type (int, float, bool, str, "
            "list[int], list[float]) or default value, got list.",
        ),
        (
            {"r": complex},
            TypeError,
            "jaxbind.native: kwargs declares 'r' as <class 'complex'>, which is neither a kind "
            "a native kernel takes (int, float, bool, str, list[int], list[float]) nor a default "
            "value of one (an int, a float, a bool, a string or a 1-d sequence of ints or "
            "floats).",
        ),
        ({"n": 2**64}, TypeError, "jaxbind.native: kwargs declares 'n' as 18446744073709551616, which is neither"),
        ({"r": list[str]}, TypeError, "jaxbind.native: kwargs declares 'r' as list[str], which is neither"),
        ({"r": None}, TypeError, "jaxbind.native: kwargs declares 'r' as None, which is neither"),
        ({1: float}, TypeError, "jaxbind.native: kwargs declares 1, which is not a keyword argument name."),
        ({"r\ud800": float}, TypeError, "jaxbind.native: kwargs declares 'r\\ud800', which is not a keyword argument"),
        (
            {"batch_axes": list[int]},
            ValueError,
            "jaxbind.native: kwargs declares 'batch_axes', which jaxbind passes "
            "itself to the kernels of ops with func_can_batch=True",
        ),
    ],
)
def test_a_declaration_a_kernel_cannot_take_is_refused_when_the_kernel_is_made(spec, error, message):
    with pytest.raises(error, match="^" + re.escape(message)):
        jaxbind.native(LIB.jb_radius, kwargs=spec)


def test_the_declaration_is_part_of_the_kernels_identity():
    a = jaxbind.native(LIB.jb_radius, kwargs={"r": float, "fail": bool})
    assert a == declared_radius and hash(a) == hash(declared_radius)  # (the order written does not count)
    assert a == jaxbind.native(LIB.jb_radius, kwargs={"fail": bool, "r": float})
    assert a != jaxbind.native(LIB.jb_radius) and a != jaxbind.native(LIB.jb_radius, kwargs={"r": float})
    assert a != jaxbind.native(LIB.jb_radius, kwargs={"r": 0.5, "fail": bool})
    assert jaxbind.native(a, name="renamed").declared == a.declared  # kept by another wrapping
    # ops that differ only in it are different ops: a jit keyed by the op traces each, and checks each
    assert jaxbind.get_nonlinear_call(a, None, like_first, None) == declared_op != radius
    apply = jax.jit(lambda op, v: op(v, rr=1.0)[0], static_argnums=0)
    np.testing.assert_array_equal(apply(radius, np.ones(2)), [0.25, 0.25])
    with pytest.raises(TypeError, match="'rr' is not one that native kernel 'jb_radius' declares"):
        apply(declared_op, np.ones(2))
    assert "kwargs={fail: bool, r: float}" in repr(a)


# ---------------------------------------------------------------------------
# numba kernels
# ---------------------------------------------------------------------------


def numba_scale():
    pytest.importorskip("numba")

    def nb_radius(out, args, kwargs):
        x, y = args[0], out[0]
        for i in range(x.size):
            y.flat[i] = kwargs.r * x.flat[i]

    return nb_radius


def test_a_declared_numba_kernel_gets_the_declared_kinds():
    kernel = jaxbind.numba_kernel(numba_scale(), kwargs={"r": float})
    op = jaxbind.get_nonlinear_call(kernel, None, like_first, None)
    x = np.arange(1.0, 4.0)
    for r in (3, 3.0, np.int32(3)):
        for result in run(lambda v: op(v, r=r)[0], x):
            np.testing.assert_array_equal(result, 3.0 * x)
    # one variant for every call: the int came as the declared float64
    assert {kwargs for _, _, kwargs in kernel._program.variants} == {(("r", 2),)}
    # declared through jaxbind.native, it is the same kernel
    assert jaxbind.native(jaxbind.numba_kernel(kernel.fn), kwargs={"r": float}) == kernel


def test_a_declared_numba_kernel_refuses_at_the_call():
    kernel = jaxbind.numba_kernel(numba_scale(), kwargs={"r": float}, name="nb_declared")
    op = jaxbind.get_nonlinear_call(kernel, None, like_first, None)
    for kwargs, message in [
        (dict(rr=0.1), "keyword argument 'rr' is not one that numba kernel 'nb_declared' declares (r: float)"),
        (dict(r="0.1"), "keyword argument 'r' is a str ('0.1'), but numba kernel 'nb_declared' declares it float"),
        (
            dict(),
            "numba kernel 'nb_declared' declares keyword argument 'r' (float) without a default, and the "
            "call does not pass it",
        ),
    ]:
        sites = _trampoline.num_sites()
        for f in (
            lambda v: op(v, **kwargs)[0],
            jax.jit(lambda v: op(v, **kwargs)[0]),
            jax.vmap(lambda v: op(v, **kwargs)[0]),
        ):
            with pytest.raises(TypeError, match="^" + re.escape("jaxbind op 'nb_declared") + ".*" + re.escape(message)):
                f(np.ones((2, 2)))
        assert _trampoline.num_sites() == sites


def test_a_numba_kernel_takes_a_declared_default():
    kernel = jaxbind.numba_kernel(numba_scale(), kwargs={"r": 0.5})
    op = jaxbind.get_nonlinear_call(kernel, None, like_first, None)
    x = np.arange(1.0, 4.0)
    np.testing.assert_array_equal(jax.jit(lambda v: op(v)[0])(x), 0.5 * x)
    np.testing.assert_array_equal(jax.jit(jax.vmap(lambda v: op(v, r=2)[0]))(np.stack([x, x])), [2 * x, 2 * x])


def test_an_undeclared_numba_kernel_fails_on_a_misspelt_name():
    op = jaxbind.get_nonlinear_call(jaxbind.numba_kernel(numba_scale(), name="nb_undeclared"), None, like_first, None)
    with pytest.raises(
        RuntimeError,
        match=r"op 'nb_undeclared': native kernel failed: numba could not compile "
        r"kernel 'nb_radius'(.|\n)*Unknown attribute 'r'",
    ):
        jax.block_until_ready(op(np.ones(2), rr=0.1)[0])


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"mode": str}, "jaxbind.numba_kernel: kwargs declares 'mode' a string, which a numba kernel cannot take"),
        ({"mode": "fast"}, "jaxbind.numba_kernel: kwargs declares 'mode' a string, which a numba kernel cannot take"),
        ({"_r": float}, "jaxbind.numba_kernel: kwargs declares '_r', which cannot be a field of the kernel's kwargs"),
    ],
)
def test_a_numba_declaration_it_cannot_take_is_refused(spec, message):
    fn = numba_scale()
    with pytest.raises((TypeError, ValueError), match="^" + re.escape(message)):
        jaxbind.numba_kernel(fn, kwargs=spec)

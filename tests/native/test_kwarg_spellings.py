"""Native kwargs as users write them (issue 40, item 8).

A 0-d NumPy array or a NumPy scalar is the scalar it holds, typed by its dtype (bool, int or float): the
C accessors read it as they read the Python scalar (checked against what they read for the Python
value, and refuse as they refuse it). A declaration that writes a kind as a string (``{"alpha":
"float"}``) is refused when the kernel is made, not taken as a str default. A kwarg a forward call
cannot pass is refused in the name of the forward kernel; a transpose kernel that refuses it is named
with its role.
"""

import re

import _kernels
import jax
import numpy as np
import pytest

import jaxbind
from jaxbind._native_kwargs import KW_BOOL, KW_FLOAT, KW_INT, native_kwarg_entry

LIB = _kernels.load()


def like_first(x, **kwargs):
    return ((x.shape, x.dtype),)


def three(*args, **kwargs):
    return (((3,), np.float64),)


reader = jaxbind.get_nonlinear_call(LIB.jb_kwarg_read, None, three, None)
INT, FLOAT, BOOL = 0, 1, 2  # jb_kwarg_read's how=: the accessor it reads v with


def read(how, value):
    return np.asarray(jax.jit(lambda v: reader(v, how=how, v=value)[0])(np.zeros(1)))


# (value, its Python twin, the type code it must have)
ZERO_D = [
    (np.array(2), 2, KW_INT),
    (np.array(-3, np.int8), -3, KW_INT),
    (np.array(7, np.uint16), 7, KW_INT),
    (np.array(2.5), 2.5, KW_FLOAT),
    (np.array(0.5, np.float32), 0.5, KW_FLOAT),
    (np.array(True), True, KW_BOOL),
    (np.int64(4), 4, KW_INT),
    (np.float32(1.5), 1.5, KW_FLOAT),
    (np.bool_(False), False, KW_BOOL),
]


@pytest.mark.parametrize("value, twin, code", ZERO_D, ids=repr)
def test_a_0d_array_or_numpy_scalar_is_the_scalar_it_holds(value, twin, code):
    assert native_kwarg_entry("v", value, "op 'x'") == ("v", code, twin)
    assert native_kwarg_entry("v", twin, "op 'x'") == ("v", code, twin)
    how = {KW_INT: INT, KW_FLOAT: FLOAT, KW_BOOL: BOOL}[code]
    np.testing.assert_array_equal(read(how, value), [float(twin), 1, 0])  # read by its own accessor
    np.testing.assert_array_equal(read(how, value), read(how, twin))


@pytest.mark.parametrize("value, twin", [(np.array(2.5), 2.5), (np.array(True), True), (np.array(3), 3)], ids=repr)
def test_a_0d_array_is_refused_as_its_scalar_is(value, twin):
    how = {float: INT, bool: FLOAT, int: BOOL}[type(twin)]
    with pytest.raises(RuntimeError) as twin_info:
        read(how, twin)
    with pytest.raises(RuntimeError) as value_info:
        read(how, value)
    assert str(value_info.value).split("\n")[0] == str(twin_info.value).split("\n")[0]


def test_a_0d_array_reaches_a_scaling_kernel_as_its_value():
    scale = jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_scale, like_first, like_first, name="scale_0d")
    declared = jaxbind.native(LIB.jb_scale, kwargs={"factor": float})
    checked = jaxbind.get_linear_call(declared, declared, like_first, like_first, name="checked_0d")
    x = np.arange(4.0)
    for op in (scale, checked):
        np.testing.assert_array_equal(op(x, factor=np.array(3))[0], 3 * x)
        np.testing.assert_array_equal(jax.jit(lambda v, op=op: op(v, factor=np.array(0.5))[0])(x), 0.5 * x)


@pytest.mark.parametrize("value", [np.array(1 + 2j), np.array("a"), np.array([[1.0]])], ids=repr)
def test_other_arrays_are_still_refused(value):
    with pytest.raises(TypeError, match=r"^jaxbind op 'x': keyword argument 'v' \(ndarray"):
        native_kwarg_entry("v", value, "op 'x'")


@pytest.mark.parametrize("spelling", ["float", "int", "bool", "str", "list[float]", "list[int]", " Float", "double"])
def test_a_kind_written_as_a_string_is_refused(spelling):
    message = (
        f"jaxbind.native: kwargs declares 'alpha' as the string {spelling!r}, which would declare a str "
        f"whose default is {spelling!r}; to declare the kind, write the type itself, not in quotes"
    )
    with pytest.raises(TypeError, match="^" + re.escape(message)):
        jaxbind.native(LIB.jb_scale, kwargs={"alpha": spelling})


@pytest.mark.parametrize("spelling", ["float", "list[int]", " Float"])
def test_a_kind_written_as_a_string_is_refused_by_a_numba_kernel_too(spelling):
    pytest.importorskip("numba")  # (no numba for the free-threaded build)
    with pytest.raises(TypeError, match=r"^jaxbind.numba_kernel: kwargs declares 'alpha' as the string"):
        jaxbind.numba_kernel(lambda out, args, kwargs: None, kwargs={"alpha": spelling})


def test_a_string_default_that_spells_no_kind_declares_a_str():
    kernel = jaxbind.native(LIB.jb_scale, kwargs={"mode": "fast", "alpha": float})
    assert kernel.declared.describe() == "alpha: float, mode: str = 'fast'"


def test_a_forward_call_is_refused_in_the_forward_kernels_name():
    forward = jaxbind.native(LIB.jb_scale, kwargs={"factor": float})
    transpose = jaxbind.native(LIB.jb_scale, name="scale_T", kwargs={"factor": float})
    op = jaxbind.get_linear_call(forward, transpose, like_first, like_first, name="named")
    x = np.arange(3.0)
    np.testing.assert_array_equal(op(x, factor=2)[0], 2 * x)
    with pytest.raises(TypeError) as info:
        op(x, factor="2")
    assert str(info.value) == (
        "jaxbind op 'named': keyword argument 'factor' is a str ('2'), but native kernel 'jb_scale' "
        "declares it float: pass a float (or an int)."
    )


def test_a_transpose_kernel_that_refuses_is_named_with_its_role():
    def python_scale(out, args, kwargs_dump):
        np.multiply(args[-1], jaxbind.load_kwargs(kwargs_dump).get("factor", 2.0), out=out[0])

    transpose = jaxbind.native(LIB.jb_scale, name="scale_T", kwargs={"factor": float})
    op = jaxbind.get_linear_call(python_scale, transpose, like_first, like_first, name="half")
    with pytest.raises(TypeError) as info:
        op(np.arange(3.0), factor="2")
    assert str(info.value) == (
        "jaxbind op 'half': keyword argument 'factor' is a str ('2'), but native kernel 'scale_T' declares it "
        "float: pass a float (or an int). (Native kernel 'scale_T' is the op's transpose callback, which gets "
        "the call's keyword arguments too.)"
    )

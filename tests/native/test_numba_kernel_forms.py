"""Native-form checks: a numba cfunc or a ctypes function whose signature is not the kernel's is
refused when the op is made; a kernel that fails without a message says which op and which
callback; ops from raw pointers get readable names (the exported symbol) or ask for ``name=``;
the struct layout numba kernels read agrees with the C header.
"""

import ctypes
import functools
import os
import shutil
import subprocess

import _kernels
import jax
import numpy as np
import pytest
from zoo import like_first, like_last

import jaxbind

LIB = _kernels.load()
SCALE_ADDRESS = ctypes.cast(LIB.jb_scale, ctypes.c_void_p).value
SILENT_ADDRESS = ctypes.cast(LIB.jb_fail_silently, ctypes.c_void_p).value


def fresh_library():
    """The test kernels through a CDLL of their own, whose functions' declarations tests may change."""
    return ctypes.CDLL(LIB._name)


# ---------------------------------------------------------------------------
# Signatures
# ---------------------------------------------------------------------------


@functools.lru_cache(None)
def cfuncs():
    """numba cfuncs, made once and kept for the session: a freed cfunc leaves llvmlite a dead weakref
    proxy, which the kept-view tests' heap walk trips over (a bug of that walk, reported)."""
    numba = pytest.importorskip("numba")
    from numba import types

    def jit_quiet(call):  # JIT code: no exported symbol at its address
        return 3

    return dict(
        wrong=[
            numba.cfunc(types.float64(types.float64))(lambda x: x),
            numba.cfunc(types.int64(types.voidptr))(lambda call: 0),
            numba.cfunc(types.int32(types.voidptr, types.int64))(lambda call, n: 0),
            numba.cfunc(types.int32(types.float64))(lambda x: 0),
        ],
        right=[
            numba.cfunc(types.int32(types.voidptr))(lambda call: 0),
            numba.cfunc(types.int32(types.CPointer(types.int64)))(lambda call: 0),
        ],
        jit_quiet=numba.cfunc(types.int32(types.voidptr))(jit_quiet),
    )


def test_a_numba_cfunc_with_another_signature_is_refused():
    for cfunc in cfuncs()["wrong"]:
        with pytest.raises(
            TypeError,
            match=r"op 'jb_scale': f_T is a numba\.cfunc with the signature "
            r".*int32\(numba\.types\.voidptr\)",
        ):
            jaxbind.get_linear_call(LIB.jb_scale, cfunc, like_last, like_last)
        with pytest.raises(TypeError, match=r"op '.*': f is a numba\.cfunc with the signature"):
            jaxbind.get_linear_call(cfunc, LIB.jb_scale, like_last, like_last)
        with pytest.raises(TypeError, match=r"numba\.cfunc with the signature"):
            jaxbind.native(cfunc)
    # the kernel signature, spelled either way, is taken (and runs)
    for quiet in cfuncs()["right"]:
        op = jaxbind.get_linear_call(quiet, quiet, like_first, like_first, name="quiet")
        jax.block_until_ready(op(np.ones(2)))


def test_a_ctypes_function_declared_with_another_signature_is_refused():
    lib = fresh_library()
    lib.jb_scale.restype = ctypes.c_double
    lib.jb_double.restype = None
    lib.jb_copy_any.argtypes = [ctypes.c_double]
    lib.jb_xsin.argtypes = [ctypes.c_void_p, ctypes.c_int]
    for fn, shown in (
        (lib.jb_scale, r"restype c_double"),
        (lib.jb_double, r"restype None \(void\)"),
        (lib.jb_copy_any, r"argtypes \[c_double\]"),
        (lib.jb_xsin, r"argtypes \[c_void_p, c_int\]"),
    ):
        with pytest.raises(
            TypeError,
            match=rf"op 'checked': f_T is a ctypes function declared with .*{shown}.*"
            r"restype = ctypes\.c_int and argtypes = \[ctypes\.c_void_p\]",
        ):
            jaxbind.get_linear_call(LIB.jb_scale, fn, like_last, like_last, name="checked")
    prototype = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_double)(SCALE_ADDRESS)
    with pytest.raises(TypeError, match=r"ctypes function declared with restype c_double and argtypes \[c_double\]"):
        jaxbind.get_linear_call(prototype, prototype, like_last, like_last, name="typed")
    # declared right (or argtypes left undeclared): taken
    lib.jb_multiply.argtypes = [ctypes.c_void_p]
    lib.jb_multiply.restype = ctypes.c_int
    for fn in (
        lib.jb_multiply,
        fresh_library().jb_scale,
        ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int64))(SCALE_ADDRESS),
    ):
        jaxbind.get_linear_call(fn, fn, like_last, like_last)
    op = jaxbind.get_linear_call(lib.jb_multiply, (lib.jb_multiply, lib.jb_multiply), like_last, (like_last, like_last))
    np.testing.assert_array_equal(
        jax.jit(lambda a, b: op(a, b)[0])(np.arange(3.0), np.arange(3.0)), np.arange(3.0) ** 2
    )


# ---------------------------------------------------------------------------
# A kernel that fails without a message
# ---------------------------------------------------------------------------


def test_a_silent_failure_names_the_op_and_the_callback():
    forward = jaxbind.get_linear_call(LIB.jb_fail_silently, LIB.jb_scale, like_last, like_last, name="quiet_f")
    with pytest.raises(
        RuntimeError,
        match=r"op 'quiet_f': native kernel failed: the forward callback \(a native "
        r"kernel\) returned 7 without a message .*jaxbind_fail\(call",
    ):
        jax.block_until_ready(jax.jit(lambda v: forward(v)[0])(np.ones(2)))
    transposed = jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_fail_silently, like_last, like_last, name="quiet_T")
    f = lambda v: transposed(v)[0]
    with pytest.raises(
        RuntimeError,
        match=r"op 'quiet_T' \(transpose callback 'jb_fail_silently'\): native "
        r"kernel failed: the transpose callback 'jb_fail_silently' \(a native "
        r"kernel\) returned 7 without a message",
    ):
        jax.block_until_ready(jax.linear_transpose(f, np.ones(2))(np.ones(2)))
    nonlinear = jaxbind.get_nonlinear_call(
        LIB.jb_xsin, (LIB.jb_xsin_derivative, LIB.jb_fail_silently), like_first, like_first
    )
    with pytest.raises(
        RuntimeError,
        match=r"op 'jb_xsin' \(vjp callback 'jb_fail_silently'\).*the vjp callback "
        r"'jb_fail_silently' \(a native kernel\) returned 7",
    ):
        jax.block_until_ready(jax.grad(lambda v: nonlinear(v)[0].sum())(np.ones(2)))


# ---------------------------------------------------------------------------
# Names of ops from raw pointers
# ---------------------------------------------------------------------------


def make_capsule(address):
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(address, b"jaxbind_kernel", None)


def test_raw_pointers_are_named_after_their_symbol():
    forms = [
        jaxbind.native(SCALE_ADDRESS),
        make_capsule(SCALE_ADDRESS),
        ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(SCALE_ADDRESS),
    ]
    for form in forms:
        op = jaxbind.get_linear_call(form, form, like_last, like_last)
        assert op.name == "jb_scale"
        np.testing.assert_allclose(jax.jit(lambda v: op(v, factor=3.0)[0])(np.ones(2)), [3.0, 3.0])
    assert jaxbind.native(SILENT_ADDRESS).__name__ == "jb_fail_silently"
    assert "0x" not in repr(jaxbind.native(SCALE_ADDRESS)).split("at")[0]


def test_a_pointer_without_a_symbol_asks_for_a_name():
    jit_quiet = cfuncs()["jit_quiet"]
    for unnamed in (jaxbind.native(jit_quiet.address), jit_quiet.ctypes, make_capsule(jit_quiet.address)):
        with pytest.raises(
            ValueError,
            match=r"f is a native kernel at 0x[0-9a-f]+ with no name jaxbind can find.*"
            r"pass name='\.\.\.' to the op, or name the kernel",
        ):
            jaxbind.get_linear_call(unnamed, LIB.jb_scale, like_last, like_last)
    with pytest.raises(ValueError, match=r"pass a numba cfunc itself, not its \.ctypes"):
        jaxbind.get_linear_call(jit_quiet.ctypes, LIB.jb_scale, like_last, like_last)
    # the cfunc itself has its name; with name= the op is named, and so is an unnamed transpose
    assert jaxbind.get_linear_call(jit_quiet, jit_quiet, like_last, like_last).name == "jit_quiet"
    op = jaxbind.get_linear_call(
        jaxbind.native(jit_quiet.address), jit_quiet.ctypes, like_last, like_last, name="named"
    )
    assert op.name == "named"
    f = lambda v: op(v)[0]
    with pytest.raises(RuntimeError, match=r"op 'named': .*forward callback"):
        jax.block_until_ready(jax.jit(f)(np.ones(2)))
    with pytest.raises(RuntimeError, match=r"op 'named' \(transpose callback 'named\.f_T'\).*returned 3"):
        jax.block_until_ready(jax.linear_transpose(f, np.ones(2))(np.ones(2)))
    # jaxbind.native(address, name=...) names it too
    op = jaxbind.get_linear_call(jaxbind.native(jit_quiet.address, name="by_hand"), LIB.jb_scale, like_last, like_last)
    assert op.name == "by_hand"


# ---------------------------------------------------------------------------
# The struct layout numba kernels read, against the C header
# ---------------------------------------------------------------------------

LAYOUT_SOURCE = r"""
#include <stddef.h>
#include <jaxbind.h>
#define FIELD(s, f) out[n++] = (int64_t)offsetof(s, f)
int64_t jbt_layout(int64_t *out) {
  int64_t n = 0;
  FIELD(jaxbind_call, struct_size); FIELD(jaxbind_call, abi_version); FIELD(jaxbind_call, n_out);
  FIELD(jaxbind_call, out); FIELD(jaxbind_call, n_in); FIELD(jaxbind_call, in);
  FIELD(jaxbind_call, n_kwargs); FIELD(jaxbind_call, kwargs); FIELD(jaxbind_call, error);
  FIELD(jaxbind_call, error_size); FIELD(jaxbind_call, kwarg_error); FIELD(jaxbind_call, kwarg_error_size);
  FIELD(jaxbind_array, data); FIELD(jaxbind_array, shape); FIELD(jaxbind_array, rank); FIELD(jaxbind_array, dtype);
  FIELD(jaxbind_kwarg, name); FIELD(jaxbind_kwarg, type); FIELD(jaxbind_kwarg, size);
  FIELD(jaxbind_kwarg, int_value); FIELD(jaxbind_kwarg, float_value); FIELD(jaxbind_kwarg, string_value);
  FIELD(jaxbind_kwarg, int_array); FIELD(jaxbind_kwarg, float_array);
  out[n++] = sizeof(jaxbind_call); out[n++] = sizeof(jaxbind_array); out[n++] = sizeof(jaxbind_kwarg);
  return n;
}
"""


def test_the_struct_layout_numba_kernels_read_is_the_headers(tmp_path):
    compiler = os.environ.get("CC") or shutil.which("cc")
    if not compiler:
        pytest.skip("no C compiler")
    from jaxbind._numba import _call_struct

    source, library = tmp_path / "layout.c", tmp_path / "liblayout.so"
    source.write_text(LAYOUT_SOURCE)
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-I", jaxbind.get_include(), str(source), "-o", str(library)],
        check=True,
        env=env,
    )
    layout = ctypes.CDLL(str(library)).jbt_layout
    layout.argtypes, layout.restype = [ctypes.POINTER(ctypes.c_int64)], ctypes.c_int64
    out = (ctypes.c_int64 * 32)()
    n = layout(out)
    values = list(out)[:n]
    mirrored = [
        getattr(struct, name).offset
        for struct in (_call_struct.Call, _call_struct.Array, _call_struct.Kwarg)
        for name, _ in struct._fields_
    ]
    mirrored += [ctypes.sizeof(s) for s in (_call_struct.Call, _call_struct.Array, _call_struct.Kwarg)]
    assert values == mirrored
    # the word indices the generated code uses
    assert _call_struct.CALL["in_"] * 8 == values[5] and _call_struct.KWARG["float_value"] * 8 == values[20]

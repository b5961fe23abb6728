"""Fortran kernels against the shipped module ``jaxbind.f90``.

The module (in ``jaxbind.get_include()``, beside ``jaxbind.h``) and the kernels
below are compiled with gfortran when the tests start; a kernel is bound from
Python exactly like a C kernel, as a function of a ``ctypes.CDLL``. Checked:
values under jit, grad and vmap against ``jax.numpy``; row-major arrays seen from
Fortran; kwargs read with the module's helpers; ``jaxbind_fail`` messages
reaching Python (cut and terminated like the C helper's); and the layout of the
derived types, against the C header compiled by the same compiler and against
ctypes mirrors of it.
"""

import ctypes
import os
import re
import shutil
import subprocess

import _abi
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind

KERNELS = r"""
! y = factor * x (float64, any shape): linear, its own transpose.
integer(c_int) function fscale(call) bind(C)
  use, intrinsic :: iso_c_binding
  use jaxbind
  implicit none
  type(jaxbind_call), intent(in) :: call
  type(jaxbind_array), pointer :: ins(:), outs(:)
  real(c_double), pointer :: x(:), y(:)
  character(len=100) :: message
  call c_f_pointer(call%in, ins, [call%n_in])
  call c_f_pointer(call%out, outs, [call%n_out])
  if (ins(call%n_in)%dtype /= JAXBIND_FLOAT64) then
    write (message, '(a, i0, a)') 'fscale: input has dtype code ', ins(call%n_in)%dtype, &
                                  ', only float64 (12) is supported'
    fscale = jaxbind_fail(call, message)  ! a blank-padded buffer: the blanks are dropped
    return
  end if
  call c_f_pointer(ins(call%n_in)%data, x, [jaxbind_size(ins(call%n_in))])
  call c_f_pointer(outs(1)%data, y, [jaxbind_size(outs(1))])
  y = jaxbind_kwarg_float(call, "factor", 2.0_c_double) * x
  fscale = 0
end function fscale

! y = x sin(x), nonlinear.
integer(c_int) function fxsin(call) bind(C)
  use, intrinsic :: iso_c_binding
  use jaxbind
  implicit none
  type(jaxbind_call), intent(in) :: call
  type(jaxbind_array), pointer :: ins(:), outs(:)
  real(c_double), pointer :: x(:), y(:)
  call c_f_pointer(call%in, ins, [call%n_in])
  call c_f_pointer(call%out, outs, [call%n_out])
  call c_f_pointer(ins(1)%data, x, [jaxbind_size(ins(1))])
  call c_f_pointer(outs(1)%data, y, [jaxbind_size(outs(1))])
  y = x * sin(x)
  fxsin = 0
end function fxsin

! Its jvp and vjp alike (the Jacobian is diagonal): inputs (x, v), out = (sin x + x cos x) v.
integer(c_int) function fxsin_derivative(call) bind(C)
  use, intrinsic :: iso_c_binding
  use jaxbind
  implicit none
  type(jaxbind_call), intent(in) :: call
  type(jaxbind_array), pointer :: ins(:), outs(:)
  real(c_double), pointer :: x(:), v(:), y(:)
  integer(c_int64_t) :: n
  call c_f_pointer(call%in, ins, [call%n_in])
  call c_f_pointer(call%out, outs, [call%n_out])
  n = jaxbind_size(ins(1))
  call c_f_pointer(ins(1)%data, x, [n])
  call c_f_pointer(ins(2)%data, v, [n])
  call c_f_pointer(outs(1)%data, y, [n])
  y = (sin(x) + x * cos(x)) * v
  fxsin_derivative = 0
end function fxsin_derivative

! Row sums of a row-major (m, n) matrix, which Fortran sees as a(n, m): linear.
integer(c_int) function frow_sums(call) bind(C)
  use, intrinsic :: iso_c_binding
  use jaxbind
  implicit none
  type(jaxbind_call), intent(in) :: call
  type(jaxbind_array), pointer :: ins(:), outs(:)
  integer(c_int64_t), pointer :: shape(:)
  real(c_double), pointer :: a(:, :), sums(:)
  call c_f_pointer(call%in, ins, [call%n_in])
  call c_f_pointer(call%out, outs, [call%n_out])
  if (ins(1)%rank /= 2) then
    frow_sums = jaxbind_fail(call, "frow_sums: expected a matrix")
    return
  end if
  call c_f_pointer(ins(1)%shape, shape, [2_c_int64_t])  ! (m, n), C order
  call c_f_pointer(ins(1)%data, a, [shape(2), shape(1)])
  call c_f_pointer(outs(1)%data, sums, [shape(1)])
  sums = sum(a, dim=1)
  frow_sums = 0
end function frow_sums

! Its transpose: every row of the (m, n) result is the cotangent's entry.
integer(c_int) function frow_sums_transposed(call) bind(C)
  use, intrinsic :: iso_c_binding
  use jaxbind
  implicit none
  type(jaxbind_call), intent(in) :: call
  type(jaxbind_array), pointer :: ins(:), outs(:)
  integer(c_int64_t), pointer :: shape(:)
  real(c_double), pointer :: ct(:), a(:, :)
  integer(c_int64_t) :: j
  call c_f_pointer(call%in, ins, [call%n_in])
  call c_f_pointer(call%out, outs, [call%n_out])
  call c_f_pointer(outs(1)%shape, shape, [2_c_int64_t])
  call c_f_pointer(ins(1)%data, ct, [shape(1)])
  call c_f_pointer(outs(1)%data, a, [shape(2), shape(1)])
  do j = 1, shape(1)
    a(:, j) = ct(j)
  end do
  frow_sums_transposed = 0
end function frow_sums_transposed

! What the helpers read from the kwargs, into a float64 output of 12 entries (each read as its type).
integer(c_int) function fkwargs_probe(call) bind(C)
  use, intrinsic :: iso_c_binding
  use jaxbind
  implicit none
  type(jaxbind_call), intent(in) :: call
  type(jaxbind_array), pointer :: outs(:)
  type(jaxbind_kwarg), pointer :: kw
  real(c_double), pointer :: probe(:), weights(:)
  integer(c_int64_t), pointer :: counts(:)
  character(kind=c_char), pointer :: label(:)
  call c_f_pointer(call%out, outs, [call%n_out])
  call c_f_pointer(outs(1)%data, probe, [12])
  probe = -99
  probe(1) = real(jaxbind_kwarg_int(call, "n", -1_c_int64_t), c_double)
  probe(2) = jaxbind_kwarg_float(call, "x", -1.5_c_double)
  probe(3) = real(jaxbind_kwarg_int(call, "flag", 0), c_double)      ! a bool; default-kind fallback
  probe(4) = jaxbind_kwarg_float(call, "n", 0.0)                     ! an int read as a float
  probe(5) = merge(1.0_c_double, 0.0_c_double, jaxbind_kwarg_bool(call, "flag", .true.))
  probe(6) = real(jaxbind_kwarg_int(call, "absent", 11_c_int64_t), c_double)
  probe(7) = jaxbind_kwarg_float(call, "absent", 0.25_c_double)
  kw => jaxbind_find_kwarg(call, "label")
  if (associated(kw)) then
    if (kw%type == JAXBIND_KW_STRING) then
      call c_f_pointer(kw%string_value, label, [kw%size + 1])
      probe(8) = real(kw%size, c_double)
      probe(9) = real(ichar(label(1)), c_double)
      if (label(kw%size + 1) /= c_null_char) probe(9) = -1
    end if
  end if
  kw => jaxbind_find_kwarg(call, "weights")
  if (associated(kw)) then
    if (kw%type == JAXBIND_KW_FLOAT_ARRAY) then
      call c_f_pointer(kw%float_array, weights, [kw%size])
      probe(10) = sum(weights)
    end if
  end if
  kw => jaxbind_find_kwarg(call, "counts")
  if (associated(kw)) then
    if (kw%type == JAXBIND_KW_INT_ARRAY) then
      call c_f_pointer(kw%int_array, counts, [kw%size])
      probe(11) = real(product(counts), c_double)
    end if
  end if
  probe(12) = merge(1.0_c_double, 0.0_c_double, associated(jaxbind_find_kwarg(call, "lab")))
  fkwargs_probe = 0
end function fkwargs_probe

! Reads kwarg "v" with the accessor chosen by kwarg "how" (0 int, 1 float, 2 bool, 3 string, 4 int
! array, 5 float array), like jb_kwarg_read of tests/kernels/test_kernels.c, and reports [what it
! read, its size, 1 if "v" is absent] into a float64 output of 3 entries: a number as it is (a bool
! as 0 or 1), a string's first byte and its length, an array's sum and its length. The fallbacks
! are -7, -2.5, .false. and "fallback". It returns 0 whatever it read.
integer(c_int) function fkwarg_read(call) bind(C)
  use, intrinsic :: iso_c_binding
  use jaxbind
  implicit none
  type(jaxbind_call), intent(in) :: call
  type(jaxbind_array), pointer :: outs(:)
  real(c_double), pointer :: o(:), floats(:)
  integer(c_int64_t), pointer :: ints(:)
  character(len=:), allocatable :: text
  call c_f_pointer(call%out, outs, [call%n_out])
  call c_f_pointer(outs(1)%data, o, [3])
  o = [0.0_c_double, 1.0_c_double, merge(1.0_c_double, 0.0_c_double, .not. associated(jaxbind_find_kwarg(call, "v")))]
  select case (jaxbind_kwarg_int(call, "how", 0))
  case (0)
    o(1) = real(jaxbind_kwarg_int(call, "v", -7), c_double)
  case (1)
    o(1) = jaxbind_kwarg_float(call, "v", -2.5_c_double)
  case (2)
    o(1) = merge(1.0_c_double, 0.0_c_double, jaxbind_kwarg_bool(call, "v", .false.))
  case (3)
    text = jaxbind_kwarg_string(call, "v", "fallback")
    if (len(text) > 0) o(1) = real(ichar(text(1:1)), c_double)
    o(2) = real(len(text), c_double)
  case (4)
    ints => jaxbind_kwarg_int_array(call, "v")
    o(2) = 0
    if (associated(ints)) o(1:2) = [real(sum(ints), c_double), real(size(ints), c_double)]
  case (5)
    floats => jaxbind_kwarg_float_array(call, "v")
    o(2) = 0
    if (associated(floats)) o(1:2) = [sum(floats), real(size(floats), c_double)]
  end select
  fkwarg_read = 0
end function fkwarg_read

! Fails with a message naming the row (kwarg "row").
integer(c_int) function ffail(call) bind(C)
  use, intrinsic :: iso_c_binding
  use jaxbind
  implicit none
  type(jaxbind_call), intent(in) :: call
  character(len=80) :: message
  write (message, '(a, i0)') 'ffail: zero pivot at row ', jaxbind_kwarg_int(call, "row", 0)
  ffail = jaxbind_fail(call, message)
end function ffail

! Fails with a message of `length` x's, longer than any buffer.
integer(c_int) function ffail_long(call) bind(C)
  use, intrinsic :: iso_c_binding
  use jaxbind
  implicit none
  type(jaxbind_call), intent(in) :: call
  ffail_long = jaxbind_fail(call, repeat("x", int(jaxbind_kwarg_int(call, "length", 5000))))
end function ffail_long

! What the caller put in the call, into an int64 output of 6 entries.
integer(c_int) function fcall_info(call) bind(C)
  use, intrinsic :: iso_c_binding
  use jaxbind
  implicit none
  type(jaxbind_call), intent(in) :: call
  type(jaxbind_array), pointer :: outs(:)
  integer(c_int64_t), pointer :: info(:)
  call c_f_pointer(call%out, outs, [call%n_out])
  call c_f_pointer(outs(1)%data, info, [6])
  info = [call%struct_size, call%abi_version, call%n_in, call%n_out, call%n_kwargs, &
          int(c_sizeof(call), c_int64_t)]
  fcall_info = 0
end function fcall_info

! Sizes of the three types, then the byte offset of every component, in order.
subroutine fortran_layout(out) bind(C)
  use, intrinsic :: iso_c_binding
  use jaxbind
  implicit none
  integer(c_int64_t), intent(out) :: out(27)
  type(jaxbind_array), target :: a
  type(jaxbind_kwarg), target :: k
  type(jaxbind_call), target :: c
  out(1:3) = [c_sizeof(a), c_sizeof(k), c_sizeof(c)]
  out(4:7) = [at(c_loc(a%data)), at(c_loc(a%shape)), at(c_loc(a%rank)), at(c_loc(a%dtype))] &
             - at(c_loc(a))
  out(8:15) = [at(c_loc(k%name)), at(c_loc(k%type)), at(c_loc(k%size)), at(c_loc(k%int_value)), &
               at(c_loc(k%float_value)), at(c_loc(k%string_value)), at(c_loc(k%int_array)), &
               at(c_loc(k%float_array))] - at(c_loc(k))
  out(16:27) = [at(c_loc(c%struct_size)), at(c_loc(c%abi_version)), at(c_loc(c%n_out)), &
                at(c_loc(c%out)), at(c_loc(c%n_in)), at(c_loc(c%in)), at(c_loc(c%n_kwargs)), &
                at(c_loc(c%kwargs)), at(c_loc(c%error)), at(c_loc(c%error_size)), &
                at(c_loc(c%kwarg_error)), at(c_loc(c%kwarg_error_size))] - at(c_loc(c))
contains
  integer(c_int64_t) function at(pointer)
    type(c_ptr), intent(in) :: pointer
    at = transfer(pointer, 0_c_int64_t)
  end function at
end subroutine fortran_layout
"""

# The same numbers from the C header, compiled by the same compiler (gfortran drives gcc).
C_LAYOUT = r"""
#include <stddef.h>
#include <jaxbind.h>

void c_layout(int64_t *out) {
  const int64_t layout[27] = {
    sizeof(jaxbind_array), sizeof(jaxbind_kwarg), sizeof(jaxbind_call),
    offsetof(jaxbind_array, data), offsetof(jaxbind_array, shape), offsetof(jaxbind_array, rank),
    offsetof(jaxbind_array, dtype),
    offsetof(jaxbind_kwarg, name), offsetof(jaxbind_kwarg, type), offsetof(jaxbind_kwarg, size),
    offsetof(jaxbind_kwarg, int_value), offsetof(jaxbind_kwarg, float_value),
    offsetof(jaxbind_kwarg, string_value), offsetof(jaxbind_kwarg, int_array),
    offsetof(jaxbind_kwarg, float_array),
    offsetof(jaxbind_call, struct_size), offsetof(jaxbind_call, abi_version),
    offsetof(jaxbind_call, n_out), offsetof(jaxbind_call, out), offsetof(jaxbind_call, n_in),
    offsetof(jaxbind_call, in), offsetof(jaxbind_call, n_kwargs), offsetof(jaxbind_call, kwargs),
    offsetof(jaxbind_call, error), offsetof(jaxbind_call, error_size),
    offsetof(jaxbind_call, kwarg_error), offsetof(jaxbind_call, kwarg_error_size)};
  for (int i = 0; i < 27; ++i) out[i] = layout[i];
}
"""


@pytest.fixture(scope="module")
def flib(tmp_path_factory):
    """The module and the kernels above, compiled and linked into one library."""
    gfortran = shutil.which("gfortran")
    if gfortran is None:
        pytest.skip("gfortran not found: install it (e.g. apt-get install gfortran) to test Fortran kernels")
    folder = tmp_path_factory.mktemp("fortran")
    module = os.path.join(jaxbind.get_include(), "jaxbind.f90")
    (folder / "kernels.f90").write_text(KERNELS)
    (folder / "layout.c").write_text(C_LAYOUT)
    library = folder / "libkernels.so"

    def run(*args):
        subprocess.run([gfortran, *args], check=True, capture_output=True, text=True, cwd=folder)

    run("-O2", "-fPIC", "-Wall", "-Werror", "-std=f2008", "-c", module, "-J", str(folder), "-o", "jaxbind.o")
    run("-O2", "-fPIC", "-Wall", "-Werror", "-std=f2008", "-c", "kernels.f90", "-I", str(folder), "-o", "kernels.o")
    run("-O2", "-fPIC", "-Wall", "-Werror", f"-I{jaxbind.get_include()}", "-c", "layout.c", "-o", "layout.o")
    run("-shared", "kernels.o", "jaxbind.o", "layout.o", "-o", str(library))
    return ctypes.CDLL(str(library))


def like_last(*args, **kwargs):
    return ((args[-1].shape, args[-1].dtype),)


def like_first(*args, **kwargs):
    return ((args[0].shape, args[0].dtype),)


def test_module_ships_beside_the_header():
    assert os.path.isfile(os.path.join(jaxbind.get_include(), "jaxbind.f90"))
    assert os.path.isfile(os.path.join(jaxbind.get_include(), "jaxbind.h"))


# ---------------------------------------------------------------------------
# Layout: the derived types are the header's structs
# ---------------------------------------------------------------------------


def ctypes_layout():
    layout = [ctypes.sizeof(t) for t in (_abi.Array, _abi.Kwarg, _abi.Call)]
    for mirror in (_abi.Array, _abi.Kwarg, _abi.Call):
        layout += [getattr(mirror, name).offset for name, _ in mirror._fields_]
    return layout


def layout_of(function):
    out = (ctypes.c_int64 * 27)()
    function.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    function(out)
    return list(out)


def test_derived_types_have_the_header_layout(flib):
    fortran, c = layout_of(flib.fortran_layout), layout_of(flib.c_layout)
    assert fortran == c
    assert c == ctypes_layout()
    assert c[:3] == [32, 64, 96]  # array, kwarg (its double included), call (ABI version 2)


def test_the_trampoline_fills_the_call_fortran_sees(flib):
    op = jaxbind.get_nonlinear_call(flib.fcall_info, None, lambda *a, **k: (((6,), np.int64),), None)
    info = jax.jit(lambda a, b: op(a, b, alpha=1, beta=2.0, gamma="c")[0])(np.ones(3), np.ones(2))
    struct_size, abi_version, n_in, n_out, n_kwargs, fortran_size = np.asarray(info)
    assert struct_size == fortran_size == 96
    assert (abi_version, n_in, n_out, n_kwargs) == (2, 2, 1, 3)


def call_directly(kernel, error_size):
    """Call a kernel through ctypes with a hand-made call: its return and error buffer."""
    buffer = ctypes.create_string_buffer(max(error_size, 1))
    call = _abi.Call(
        ctypes.sizeof(_abi.Call),
        2,
        0,
        None,
        0,
        None,
        0,
        None,
        ctypes.cast(buffer, ctypes.c_void_p) if error_size >= 0 else None,
        max(error_size, 0),
        None,
        0,
    )
    typed = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_abi.Call))(ctypes.cast(kernel, ctypes.c_void_p).value)
    return typed(ctypes.byref(call)), buffer.raw


def test_fail_writes_the_error_buffer_as_the_c_helper_does(flib):
    # Cut to the buffer and NUL-terminated, trailing blanks of the Fortran string dropped; returns 1.
    assert call_directly(flib.ffail, 64) == (1, b"ffail: zero pivot at row 0" + b"\0" * 38)
    assert call_directly(flib.ffail, 8) == (1, b"ffail: \0")
    assert call_directly(flib.ffail, 1) == (1, b"\0")
    assert call_directly(flib.ffail, 0) == (1, b"\0")  # no room: nothing written
    assert call_directly(flib.ffail, -1) == (1, b"\0")  # a null buffer: nothing written


# ---------------------------------------------------------------------------
# Kernels as ops, under every transformation
# ---------------------------------------------------------------------------


@pytest.fixture
def x(rng):
    return rng.standard_normal((3, 4))


def test_linear_kernel_under_jit_grad_vmap(flib, x, rng):
    op = jaxbind.get_linear_call(flib.fscale, flib.fscale, like_last, like_last)
    f = lambda v: op(v, factor=-1.5)[0]
    np.testing.assert_allclose(f(x), -1.5 * x, rtol=1e-15)
    np.testing.assert_allclose(jax.jit(f)(x), -1.5 * x, rtol=1e-15)
    np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(jnp.sin(f(v))))(x), -1.5 * jnp.cos(-1.5 * x), rtol=1e-14)
    ct = rng.standard_normal(x.shape)
    np.testing.assert_allclose(jax.linear_transpose(f, x)(ct)[0], -1.5 * ct, rtol=1e-15)
    np.testing.assert_allclose(jax.vmap(f, in_axes=1, out_axes=1)(x), -1.5 * x, rtol=1e-15)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.vmap(f)))(x[..., None]), -1.5 * x[..., None], rtol=1e-15)
    np.testing.assert_allclose(jax.jit(lambda v: op(v)[0])(x), 2.0 * x, rtol=1e-15)  # the fallback
    jax.test_util.check_grads(f, (x,), order=2, modes=("fwd", "rev"))


def test_nonlinear_kernel_under_jit_grad_vmap(flib, x, rng):
    op = jaxbind.get_nonlinear_call(flib.fxsin, (flib.fxsin_derivative, flib.fxsin_derivative), like_first, like_first)
    f = lambda v: op(v)[0]
    reference = lambda v: v * jnp.sin(v)
    np.testing.assert_allclose(jax.jit(f)(x), reference(x), rtol=1e-14)
    loss = lambda g: lambda v: jnp.sum(jnp.exp(g(v)))
    np.testing.assert_allclose(jax.jit(jax.grad(loss(f)))(x), jax.grad(loss(reference))(x), rtol=1e-13)
    t = rng.standard_normal(x.shape)
    np.testing.assert_allclose(jax.jvp(f, (x,), (t,))[1], jax.jvp(reference, (x,), (t,))[1], rtol=1e-13)
    np.testing.assert_allclose(jax.vmap(jax.grad(loss(f)))(x), jax.vmap(jax.grad(loss(reference)))(x), rtol=1e-13)
    np.testing.assert_allclose(jax.jacfwd(f)(x[0]), jax.jacfwd(reference)(x[0]), rtol=1e-13, atol=1e-15)
    jax.test_util.check_grads(f, (x,), order=1, modes=("fwd", "rev"))


def test_row_major_matrix_seen_from_fortran(flib, rng):
    op = jaxbind.get_linear_call(
        flib.frow_sums,
        flib.frow_sums_transposed,
        lambda a: (((a.shape[0],), a.dtype),),
        lambda s: (((s.shape[0], 5), s.dtype),),
    )
    a = rng.standard_normal((3, 5))
    f = lambda m: op(m)[0]
    np.testing.assert_allclose(jax.jit(f)(a), a.sum(axis=1), rtol=1e-14)
    np.testing.assert_allclose(
        jax.vmap(f, in_axes=2)(np.stack([a, 2 * a], axis=2)), [a.sum(axis=1), 2 * a.sum(axis=1)], rtol=1e-14
    )
    w = rng.standard_normal(3)
    np.testing.assert_allclose(jax.grad(lambda m: jnp.dot(w, f(m)))(a), np.repeat(w[:, None], 5, axis=1), rtol=1e-15)
    jax.test_util.check_grads(f, (a,), order=1, modes=("rev",))


# ---------------------------------------------------------------------------
# Kwargs and errors
# ---------------------------------------------------------------------------


def probe(flib, **kwargs):
    op = jaxbind.get_nonlinear_call(flib.fkwargs_probe, None, lambda array, **k: (((12,), np.float64),), None)
    return np.asarray(jax.jit(lambda v: op(v, **kwargs)[0])(np.zeros(1)))


def test_kwargs_read_from_fortran(flib):
    got = probe(flib, n=5, x=0.75, flag=True, label="hello", weights=[0.5, 1.5, 2.0], counts=(2, 3, 4))
    np.testing.assert_array_equal(got, [5, 0.75, 1, 5.0, 1, 11, 0.25, 5, ord("h"), 4.0, 24, 0])
    np.testing.assert_array_equal(probe(flib), [-1, -1.5, 0, 0, 1, 11, 0.25, -99, -99, -99, -99, 0])
    assert probe(flib, flag=False, x=3)[[1, 2, 4]].tolist() == [3.0, 0, 0]  # an int x reads as a float
    assert probe(flib, flag=1)[[2, 4]].tolist() == [1, 1]  # the int 1 reads as an int and as a bool


def test_kernel_error_reaches_python_naming_the_op(flib):
    op = jaxbind.get_nonlinear_call(flib.ffail, None, like_first, None, name="thomas_solve")
    with pytest.raises(
        RuntimeError,
        match=r"(?m)jaxbind op 'thomas_solve': native kernel failed: "
        r"ffail: zero pivot at row 17$",
    ):
        jax.block_until_ready(jax.jit(lambda v: op(v, row=17)[0])(np.ones(2)))
    with pytest.raises(RuntimeError, match=r"(?m)jaxbind op 'thomas_solve'.*zero pivot at row 3$"):
        jax.block_until_ready(jax.vmap(lambda v: op(v, row=3)[0])(np.ones((4, 2))))


def test_blank_padded_message_and_dtype_check(flib):
    op = jaxbind.get_linear_call(flib.fscale, flib.fscale, like_last, like_last)
    with pytest.raises(
        RuntimeError,
        match=r"(?m)op 'fscale': native kernel failed: fscale: input has dtype code 11, "
        r"only float64 \(12\) is supported$",
    ):
        jax.block_until_ready(jax.jit(lambda v: op(v)[0])(np.ones(3, np.float32)))
    np.testing.assert_allclose(op(np.ones(3))[0], 2.0 * np.ones(3))  # the process goes on


def test_long_message_is_cut_to_the_buffer(flib):
    op = jaxbind.get_nonlinear_call(flib.ffail_long, None, like_first, None)
    with pytest.raises(RuntimeError) as info:
        jax.block_until_ready(op(np.ones(1), length=5000)[0])
    written = re.search(r"op 'ffail_long': native kernel failed: (x*)", str(info.value)).group(1)
    assert len(written) == 2047  # the trampoline's buffer has 2048 bytes, the NUL included


# The accessors: what each reads, and the call failing, with the header's message, on what it cannot read.
FORTRAN_READS = [
    (0, 5, [5, 1, 0]),
    (0, True, [1, 1, 0]),
    (0, 2.5, "a float (2.5)"),
    (0, "5", "a string ('5')"),
    (1, 3, [3, 1, 0]),
    (1, 0.75, [0.75, 1, 0]),
    (1, True, "a bool (True)"),
    (1, [0.5], "a float array of 1 entry"),
    (1, "x" * 50, "a string ('" + "x" * 40 + "...')"),
    (2, True, [1, 1, 0]),
    (2, 0, [0, 1, 0]),
    (2, 2, "an int (2)"),
    (3, "héllo", [ord("h"), len("héllo".encode()), 0]),
    (3, 5, "an int (5)"),
    (4, [1, 2, 39], [42, 3, 0]),
    (4, [], [0, 0, 0]),
    (4, [0.5, 1.0], "a float array of 2 entries"),
    (5, [0.5, 1.25], [1.75, 2, 0]),
    (5, np.array([], np.int64), [0, 0, 0]),
    (5, [1, 2], "an int array of 2 entries"),
]
FORTRAN_ABSENT = {0: [-7, 1, 1], 1: [-2.5, 1, 1], 2: [0, 1, 1], 3: [ord("f"), 8, 1], 4: [0, 0, 1], 5: [0, 0, 1]}


def three(*args, **kwargs):
    return (((3,), np.float64),)


@pytest.mark.parametrize("how, value, expected", FORTRAN_READS)
def test_kwarg_accessors_read_and_refuse_as_the_headers_do(flib, kernels, how, value, expected):
    fortran = jaxbind.get_nonlinear_call(flib.fkwarg_read, None, three, None, name="fortran_read")
    if isinstance(expected, list):
        np.testing.assert_array_equal(jax.jit(lambda v: fortran(v, how=how, v=value)[0])(np.zeros(1)), expected)
        return
    messages = []
    for op in (fortran, jaxbind.get_nonlinear_call(kernels.jb_kwarg_read, None, three, None)):
        with pytest.raises(RuntimeError) as info:
            jax.block_until_ready(jax.jit(lambda v: op(v, how=how, v=value)[0])(np.zeros(1)))
        messages.append(str(info.value).split("\n")[0].split(": native kernel failed: ")[1])
    assert messages[0] == messages[1]  # the Fortran module's message is the C header's
    assert messages[0].startswith(f"keyword argument 'v' is {expected}, but the kernel reads it as ")


@pytest.mark.parametrize("how", sorted(FORTRAN_ABSENT))
def test_an_absent_kwarg_reads_as_the_fallback_in_fortran(flib, how):
    op = jaxbind.get_nonlinear_call(flib.fkwarg_read, None, three, None)
    np.testing.assert_array_equal(op(np.zeros(1), how=how)[0], FORTRAN_ABSENT[how])


def test_a_kwarg_error_in_fortran_fails_a_walk(flib):
    op = jaxbind.get_linear_call(flib.fscale, flib.fscale, like_last, like_last)
    with pytest.raises(
        RuntimeError,
        match=r"(?m)^INTERNAL: jaxbind op 'fscale': native kernel failed: keyword "
        r"argument 'factor' is a string \('2'\), but the kernel reads it as a "
        r"float \(jaxbind_kwarg_float\): pass a float \(or an int\)$",
    ):
        jax.block_until_ready(jax.jit(jax.vmap(lambda v: op(v, factor="2")[0]))(np.ones((3, 2))))
    np.testing.assert_array_equal(jax.vmap(lambda v: op(v, factor=2)[0])(np.ones((3, 2))), 2 * np.ones((3, 2)))

"""Demo 7: a classic Fortran routine as a JAX op, called from XLA with no Python and no GIL.

What you learn here
-------------------
* how a Fortran kernel is written against jaxbind's Fortran module
  (``jaxbind.f90``, shipped beside ``jaxbind.h`` in ``jaxbind.get_include()``):
  ``type(jaxbind_call)``, ``jaxbind_size``, ``jaxbind_fail``;
* how it is compiled with gfortran (the module, then the kernel, then one
  shared library) and loaded with ctypes, exactly like a C kernel;
* how a solver that is linear in its right-hand side becomes a linear op with
  its transpose, then is jitted, differentiated and vmapped;
* how derivatives with respect to the matrix are added in JAX on top of it.

The routine: the Thomas algorithm, which solves a tridiagonal system
``A x = r`` (sub-diagonal ``lower``, diagonal ``diag``, super-diagonal
``upper``; LAPACK's ``dgtsv`` layout) in O(n). ``x = A^-1 r`` is linear in
``r``, and its transpose is a solve with ``A^T``, whose sub- and super-diagonals
are ``upper`` and ``lower``: the same routine with the two swapped.

Needs gfortran (``apt-get install gfortran`` on Debian/Ubuntu); without it the
demo says so and exits.
"""

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from _checks import check, failures, finish, op_check

import jaxbind

FORTRAN_SOURCE = r"""
module tridiagonal
  use, intrinsic :: iso_c_binding
  use jaxbind
  implicit none
contains

  ! The Thomas algorithm: A x = r, A tridiagonal with sub-diagonal lower(1:n-1),
  ! diagonal diag(1:n) and super-diagonal upper(1:n-1). No pivoting (fine for
  ! diagonally dominant A); info is 0, or the row whose pivot is zero.
  subroutine thomas(n, lower, diag, upper, r, x, info)
    integer(c_int64_t), intent(in) :: n
    real(c_double), intent(in) :: lower(n - 1), diag(n), upper(n - 1), r(n)
    real(c_double), intent(out) :: x(n)
    integer(c_int64_t), intent(out) :: info
    real(c_double), allocatable :: c(:)
    real(c_double) :: pivot
    integer(c_int64_t) :: i
    allocate (c(n))
    info = 0
    do i = 1, n
      pivot = diag(i)
      if (i > 1) pivot = pivot - lower(i - 1) * c(i - 1)
      if (pivot == 0) then
        info = i
        return
      end if
      if (i < n) c(i) = upper(i) / pivot
      x(i) = r(i)
      if (i > 1) x(i) = x(i) - lower(i - 1) * x(i - 1)
      x(i) = x(i) / pivot
    end do
    do i = n - 1, 1, -1
      x(i) = x(i) - c(i) * x(i + 1)
    end do
  end subroutine thomas

  ! Inputs (lower, diag, upper, r), output x; `transposed` solves with A^T.
  integer(c_int) function solve(call, transposed)
    type(jaxbind_call), intent(in) :: call
    logical, intent(in) :: transposed
    type(jaxbind_array), pointer :: ins(:), outs(:)
    real(c_double), pointer :: lower(:), diag(:), upper(:), r(:), x(:)
    character(len=120) :: message
    integer(c_int64_t) :: n, i, info
    call c_f_pointer(call%in, ins, [call%n_in])
    call c_f_pointer(call%out, outs, [call%n_out])
    if (call%n_in /= 4 .or. call%n_out /= 1) then
      solve = jaxbind_fail(call, "tridiagonal solve: expected inputs (lower, diag, upper, rhs) and one output")
      return
    end if
    do i = 1, 4
      if (ins(i)%dtype /= JAXBIND_FLOAT64 .or. ins(i)%rank /= 1) then
        write (message, '(a, i0, a)') 'tridiagonal solve: input ', i - 1, ' must be a float64 vector'
        solve = jaxbind_fail(call, message)
        return
      end if
    end do
    n = jaxbind_size(ins(2))
    if (jaxbind_size(ins(1)) /= n - 1 .or. jaxbind_size(ins(3)) /= n - 1 .or. jaxbind_size(ins(4)) /= n) then
      solve = jaxbind_fail(call, "tridiagonal solve: sizes must be n - 1, n, n - 1 and n")
      return
    end if
    call c_f_pointer(ins(1)%data, lower, [n - 1])
    call c_f_pointer(ins(2)%data, diag, [n])
    call c_f_pointer(ins(3)%data, upper, [n - 1])
    call c_f_pointer(ins(4)%data, r, [n])
    call c_f_pointer(outs(1)%data, x, [n])
    if (transposed) then  ! A^T: the sub- and super-diagonals swap places
      call thomas(n, upper, diag, lower, r, x, info)
    else
      call thomas(n, lower, diag, upper, r, x, info)
    end if
    if (info /= 0) then
      write (message, '(a, i0, a)') 'tridiagonal solve: zero pivot in row ', info - 1, ' (0-based)'
      solve = jaxbind_fail(call, message)
      return
    end if
    solve = 0
  end function solve

end module tridiagonal

integer(c_int) function tridiagonal_solve(call) bind(C)
  use tridiagonal
  type(jaxbind_call), intent(in) :: call
  tridiagonal_solve = solve(call, .false.)
end function tridiagonal_solve

integer(c_int) function tridiagonal_solve_transposed(call) bind(C)
  use tridiagonal
  type(jaxbind_call), intent(in) :: call
  tridiagonal_solve_transposed = solve(call, .true.)
end function tridiagonal_solve_transposed
"""


def build_library(gfortran, folder):
    """Compile jaxbind's Fortran module and the kernels, and link one shared library."""
    module = os.path.join(jaxbind.get_include(), "jaxbind.f90")
    source = os.path.join(folder, "tridiagonal.f90")
    library = os.path.join(folder, "libtridiagonal.so")
    with open(source, "w") as handle:
        handle.write(FORTRAN_SOURCE)
    for command in (
        [gfortran, "-O2", "-fPIC", "-c", module, "-J", folder, "-o", os.path.join(folder, "jaxbind.o")],
        [
            gfortran,
            "-O2",
            "-fPIC",
            "-c",
            source,
            "-I",
            folder,
            "-J",
            folder,
            "-o",
            os.path.join(folder, "tridiagonal.o"),
        ],
        [gfortran, "-shared", os.path.join(folder, "tridiagonal.o"), os.path.join(folder, "jaxbind.o"), "-o", library],
    ):
        subprocess.run(command, check=True)
    return ctypes.CDLL(library)


def abstract(lower, diag, upper, rhs):
    """x has the shape and dtype of the right-hand side (for the solve and its transpose)."""
    n = diag.shape[0]
    if diag.ndim != 1 or lower.shape != (n - 1,) or upper.shape != (n - 1,) or rhs.shape != (n,):
        raise ValueError(
            f"expected sizes n - 1, n, n - 1, n; got {lower.shape}, {diag.shape}, {upper.shape}, {rhs.shape}"
        )
    return ((rhs.shape, rhs.dtype),)


def dense(lower, diag, upper):
    return jnp.diag(diag) + jnp.diag(lower, -1) + jnp.diag(upper, 1)


def reference(lower, diag, upper, rhs):
    return jnp.linalg.solve(dense(lower, diag, upper), rhs)


def check_message(name, fn, expected):
    """Check that ``fn()`` raises an error whose message contains ``expected``.

    (Any exception type: JAX raises a RuntimeError for a failed call, but a
    ValueError when a jitted function that ran before fails on new inputs.)
    """
    try:
        fn()
        message = "(no error)"
    except Exception as err:
        message = str(err).splitlines()[0]
    ok = expected in message
    print(f"{'OK  ' if ok else 'FAIL'} {name:50s} {message[:90]}")
    if not ok:
        failures.append(name)


def main():
    gfortran = shutil.which("gfortran")
    if gfortran is None:
        print(
            "SKIP demos/07_fortran.py: gfortran (the GNU Fortran compiler) was not found on PATH.\n"
            "     Install it to run this demo, e.g. `apt-get install gfortran` (Debian/Ubuntu),\n"
            "     `dnf install gcc-gfortran` (Fedora) or `brew install gcc` (macOS)."
        )
        sys.exit(0)
    folder = tempfile.mkdtemp(prefix="jaxbind-demo-fortran-")
    try:
        lib = build_library(gfortran, folder)
        # Fortran kernels passed straight from the ctypes library: XLA calls them.
        solve_op = jaxbind.get_linear_call(
            lib.tridiagonal_solve,
            lib.tridiagonal_solve_transposed,
            abstract,
            abstract,
            first_n_args_fixed=3,
            name="tridiagonal_solve",
        )

        def solve(lower, diag, upper, rhs):
            return solve_op(lower, diag, upper, rhs)[0]

        rng = np.random.default_rng(0)
        n = 40
        lower, upper = rng.uniform(-1, 1, n - 1), rng.uniform(-1, 1, n - 1)
        diag = 3.0 + rng.uniform(0, 1, n)  # diagonally dominant: no pivoting needed
        rhs = rng.standard_normal(n)
        matrix = (lower, diag, upper)
        check("value", solve(*matrix, rhs), reference(*matrix, rhs))
        check("jit", jax.jit(solve)(*matrix, rhs), reference(*matrix, rhs))

        def loss(rhs, f):
            return jnp.sum(jnp.sin(f(*matrix, rhs)))

        check(
            "grad in the right-hand side (the transposed solve)",
            jax.grad(loss)(rhs, solve),
            jax.grad(loss)(rhs, reference),
        )
        check("jit(grad)", jax.jit(jax.grad(loss), static_argnums=1)(rhs, solve), jax.grad(loss)(rhs, reference))
        cotangent = rng.standard_normal(n)
        check(
            "linear_transpose = solve with A^T",
            jax.linear_transpose(lambda r: solve(*matrix, r), rhs)(cotangent)[0],
            jnp.linalg.solve(dense(*matrix).T, cotangent),
        )
        tangent = rng.standard_normal(n)
        check(
            "jvp",
            jax.jvp(lambda r: solve(*matrix, r), (rhs,), (tangent,)),
            jax.jvp(lambda r: reference(*matrix, r), (rhs,), (tangent,)),
        )

        rhs_batch = rng.standard_normal((8, n))
        batch_axes = (None, None, None, 0)
        check(
            "vmap over right-hand sides (walked in C++)",
            jax.vmap(solve, batch_axes)(*matrix, rhs_batch),
            jax.vmap(reference, batch_axes)(*matrix, rhs_batch),
        )
        systems = [np.stack([m] * 3) + 0.1 * rng.standard_normal((3, m.size)) for m in matrix]
        check(
            "jit(vmap) over whole systems",
            jax.jit(jax.vmap(solve))(*systems, rhs_batch[:3]),
            jax.vmap(reference)(*systems, rhs_batch[:3]),
        )
        check(
            "jit(vmap(grad))",
            jax.jit(jax.vmap(jax.grad(loss), (0, None)), static_argnums=1)(rhs_batch, solve),
            jax.vmap(jax.grad(loss), (0, None))(rhs_batch, reference),
        )

        # jaxbind's op checker on the Fortran kernels (the transposed solve by a dot-product test).
        op_check("check_op", solve_op, *matrix, rhs)

        # The matrix is a fixed argument of the op. Derivatives in it come from
        # the same two kernels: with x = A^-1 r and lam = A^-T x_bar,
        # dA = -lam x^T, restricted to the three diagonals.
        @jax.custom_vjp
        def solve_all(lower, diag, upper, rhs):
            return solve(lower, diag, upper, rhs)

        def solve_all_fwd(lower, diag, upper, rhs):
            x = solve(lower, diag, upper, rhs)
            return x, (lower, diag, upper, x)

        def solve_all_bwd(residuals, x_bar):
            lower, diag, upper, x = residuals
            lam = solve(upper, diag, lower, x_bar)  # A^T: diagonals swapped
            return -lam[1:] * x[:-1], -lam * x, -lam[:-1] * x[1:], lam

        solve_all.defvjp(solve_all_fwd, solve_all_bwd)

        def loss_all(f):
            return lambda *args: jnp.sum(jnp.cos(f(*args)) * jnp.arange(n))

        check(
            "grad in the matrix and the right-hand side (custom_vjp)",
            jax.grad(loss_all(solve_all), argnums=(0, 1, 2, 3))(*matrix, rhs),
            jax.grad(loss_all(reference), argnums=(0, 1, 2, 3))(*matrix, rhs),
            rtol=1e-9,
        )

        # The Fortran routine's own error message reaches Python, naming the op.
        singular = (lower, np.concatenate([[0.0], diag[1:]]), upper)
        check_message(
            "zero pivot reported by the Fortran code",
            lambda: jax.block_until_ready(jax.jit(solve)(*singular, rhs)),
            "jaxbind op 'tridiagonal_solve': native kernel failed: tridiagonal solve: zero pivot in row 0 (0-based)",
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    finish()


if __name__ == "__main__":
    main()

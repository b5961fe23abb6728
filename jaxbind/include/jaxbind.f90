! jaxbind.f90 -- the calling convention of jaxbind native kernels, for Fortran.
!
! The Fortran twin of jaxbind.h (same folder; read it for the rules): the same
! structs as BIND(C) derived types, the same codes as named constants and the
! same helpers as module procedures, all under the C names. A kernel is
!
!     integer(c_int) function my_kernel(call) bind(C)
!       use, intrinsic :: iso_c_binding
!       use jaxbind
!       type(jaxbind_call), intent(in) :: call
!
! and is bound from Python exactly like a C kernel (ctypes.CDLL(...).my_kernel).
! Compile this file with the same compiler as your kernels, into a folder of
! your own (-J: where the .mod file goes), and link the two:
!
!     INC=$(python -c "import jaxbind; print(jaxbind.get_include())")
!     gfortran -O2 -fPIC -c "$INC/jaxbind.f90" -J build -o build/jaxbind.o
!     gfortran -O2 -fPIC -shared -I build kernels.f90 build/jaxbind.o -o libkernels.so
!
! From C to Fortran:
!   - call->in[i] is ins(i + 1) after call c_f_pointer(call%in, ins, [call%n_in])
!     (the same for call%out and call%kwargs): Fortran arrays count from 1.
!   - An array's elements: call c_f_pointer(ins(1)%data, x, [jaxbind_size(ins(1))]).
!     Arrays are row-major (C order): a (m, n) array is Fortran's x(n, m), its
!     shape reversed; ins(1)%shape points at the rank dimensions in C order.
!   - jaxbind_fail(call, message) takes a Fortran string (trailing blanks are
!     dropped, so a blank-padded buffer written with `write` works).
!   - jaxbind_kwarg_int and jaxbind_kwarg_float take the fallback in either of the
!     two usual kinds (int32 or int64; float32 or float64) and return int64 and
!     double values.
!
! The layout matches jaxbind.h field for field: int64_t is integer(c_int64_t),
! double is real(c_double), pointers are type(c_ptr). This is ABI version 1;
! like the header, later versions only append fields and codes.
module jaxbind
  use, intrinsic :: iso_c_binding, only: c_char, c_double, c_f_pointer, c_float, c_int, c_int32_t, &
                                         c_int64_t, c_null_char, c_ptr, c_associated
  implicit none
  private

  integer(c_int64_t), parameter, public :: JAXBIND_ABI_VERSION = 1

  ! Element types (enum jaxbind_dtype; XLA's element type codes).
  integer(c_int64_t), parameter, public :: &
    JAXBIND_BOOL = 1, JAXBIND_INT8 = 2, JAXBIND_INT16 = 3, JAXBIND_INT32 = 4, JAXBIND_INT64 = 5, &
    JAXBIND_UINT8 = 6, JAXBIND_UINT16 = 7, JAXBIND_UINT32 = 8, JAXBIND_UINT64 = 9, &
    JAXBIND_FLOAT16 = 10, JAXBIND_FLOAT32 = 11, JAXBIND_FLOAT64 = 12, &
    JAXBIND_COMPLEX64 = 15, JAXBIND_BFLOAT16 = 16, JAXBIND_COMPLEX128 = 18, &
    JAXBIND_FLOAT8_E5M2 = 19, JAXBIND_FLOAT8_E4M3FN = 20, JAXBIND_FLOAT8_E4M3B11FNUZ = 23, &
    JAXBIND_FLOAT8_E5M2FNUZ = 24, JAXBIND_FLOAT8_E4M3FNUZ = 25, JAXBIND_FLOAT8_E4M3 = 28, &
    JAXBIND_FLOAT8_E3M4 = 29

  ! Kinds of keyword argument (enum jaxbind_kwarg_type).
  integer(c_int64_t), parameter, public :: &
    JAXBIND_KW_INT = 1, JAXBIND_KW_FLOAT = 2, JAXBIND_KW_BOOL = 3, JAXBIND_KW_STRING = 4, &
    JAXBIND_KW_INT_ARRAY = 5, JAXBIND_KW_FLOAT_ARRAY = 6

  ! One array: an input or an output (struct jaxbind_array).
  type, bind(C), public :: jaxbind_array
    type(c_ptr) :: data                 ! first element; dense, row-major
    type(c_ptr) :: shape                ! rank int64 entries (const int64_t *)
    integer(c_int64_t) :: rank
    integer(c_int64_t) :: dtype         ! a JAXBIND_<dtype> code
  end type jaxbind_array

  ! One keyword argument of the op call (struct jaxbind_kwarg). Fields that do
  ! not apply are 0 / null.
  type, bind(C), public :: jaxbind_kwarg
    type(c_ptr) :: name                 ! NUL-terminated
    integer(c_int64_t) :: type          ! a JAXBIND_KW_<kind> code
    integer(c_int64_t) :: size          ! elements (arrays), bytes (strings), 1 (scalars)
    integer(c_int64_t) :: int_value
    real(c_double) :: float_value
    type(c_ptr) :: string_value         ! NUL-terminated UTF-8
    type(c_ptr) :: int_array            ! size int64 entries
    type(c_ptr) :: float_array          ! size double entries
  end type jaxbind_kwarg

  ! Everything one kernel call gets (struct jaxbind_call).
  type, bind(C), public :: jaxbind_call
    integer(c_int64_t) :: struct_size   ! sizeof(jaxbind_call) as the caller knows it
    integer(c_int64_t) :: abi_version   ! JAXBIND_ABI_VERSION of the caller
    integer(c_int64_t) :: n_out
    type(c_ptr) :: out                  ! n_out jaxbind_array outputs, to be written
    integer(c_int64_t) :: n_in
    type(c_ptr) :: in                   ! n_in jaxbind_array inputs, read-only
    integer(c_int64_t) :: n_kwargs
    type(c_ptr) :: kwargs               ! n_kwargs jaxbind_kwarg
    type(c_ptr) :: error                ! room for an error message...
    integer(c_int64_t) :: error_size    ! ...of this many bytes, NUL included
  end type jaxbind_call

  ! The kernel signature (typedef jaxbind_kernel), for procedure(jaxbind_kernel) declarations.
  abstract interface
    integer(c_int) function jaxbind_kernel(call) bind(C)
      import :: c_int, jaxbind_call
      type(jaxbind_call), intent(in) :: call
    end function jaxbind_kernel
  end interface
  public :: jaxbind_kernel

  ! Integer and float kwargs with a fallback when absent (ints convert to floats).
  interface jaxbind_kwarg_int
    module procedure kwarg_int_fallback_int64, kwarg_int_fallback_int32
  end interface jaxbind_kwarg_int
  interface jaxbind_kwarg_float
    module procedure kwarg_float_fallback_double, kwarg_float_fallback_float
  end interface jaxbind_kwarg_float

  public :: jaxbind_fail, jaxbind_find_kwarg, jaxbind_kwarg_float, jaxbind_kwarg_int, jaxbind_size

contains

  ! Number of elements of an array.
  integer(c_int64_t) function jaxbind_size(array)
    type(jaxbind_array), intent(in) :: array
    integer(c_int64_t), pointer :: shape(:)
    jaxbind_size = 1
    if (array%rank <= 0) return  ! a scalar: its shape may be a null pointer
    call c_f_pointer(array%shape, shape, [array%rank])
    jaxbind_size = product(shape)
  end function jaxbind_size

  ! Write an error message and return 1: `k = jaxbind_fail(call, "..."); return`.
  ! The message is cut to the buffer and NUL-terminated, as the C helper does.
  integer(c_int) function jaxbind_fail(call, message)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: message
    character(kind=c_char), pointer :: buffer(:)
    integer(c_int64_t) :: n, i
    jaxbind_fail = 1
    if (.not. c_associated(call%error) .or. call%error_size <= 0) return
    call c_f_pointer(call%error, buffer, [call%error_size])
    n = min(int(len_trim(message), c_int64_t), call%error_size - 1)
    do i = 1, n
      buffer(i) = message(i:i)
    end do
    buffer(n + 1) = c_null_char
  end function jaxbind_fail

  ! The kwarg called `name`, or a null pointer: `kw => jaxbind_find_kwarg(call, "name")`,
  ! then `if (associated(kw))`. Trailing blanks of `name` are ignored.
  function jaxbind_find_kwarg(call, name) result(found)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: name
    type(jaxbind_kwarg), pointer :: found
    type(jaxbind_kwarg), pointer :: kwargs(:)
    integer(c_int64_t) :: i
    found => null()
    if (call%n_kwargs <= 0) return
    call c_f_pointer(call%kwargs, kwargs, [call%n_kwargs])
    do i = 1, call%n_kwargs
      if (c_string_is(kwargs(i)%name, trim(name))) then
        found => kwargs(i)
        return
      end if
    end do
  end function jaxbind_find_kwarg

  ! Whether the NUL-terminated C string at `text` equals `name`. It reads no
  ! further than the first character that differs, so never past the NUL.
  logical function c_string_is(text, name)
    type(c_ptr), intent(in) :: text
    character(len=*), intent(in) :: name
    character(kind=c_char), pointer :: chars(:)
    integer :: i
    call c_f_pointer(text, chars, [len(name) + 1])
    c_string_is = .false.
    do i = 1, len(name)
      if (chars(i) /= name(i:i)) return
    end do
    c_string_is = chars(len(name) + 1) == c_null_char
  end function c_string_is

  integer(c_int64_t) function kwarg_int_fallback_int64(call, name, fallback) result(value)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: name
    integer(c_int64_t), intent(in) :: fallback
    type(jaxbind_kwarg), pointer :: kw
    value = fallback
    kw => jaxbind_find_kwarg(call, name)
    if (.not. associated(kw)) return
    if (kw%type == JAXBIND_KW_INT .or. kw%type == JAXBIND_KW_BOOL) value = kw%int_value
  end function kwarg_int_fallback_int64

  integer(c_int64_t) function kwarg_int_fallback_int32(call, name, fallback) result(value)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: name
    integer(c_int32_t), intent(in) :: fallback
    value = kwarg_int_fallback_int64(call, name, int(fallback, c_int64_t))
  end function kwarg_int_fallback_int32

  real(c_double) function kwarg_float_fallback_double(call, name, fallback) result(value)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: name
    real(c_double), intent(in) :: fallback
    type(jaxbind_kwarg), pointer :: kw
    value = fallback
    kw => jaxbind_find_kwarg(call, name)
    if (.not. associated(kw)) return
    if (kw%type == JAXBIND_KW_FLOAT) value = kw%float_value
    if (kw%type == JAXBIND_KW_INT) value = real(kw%int_value, c_double)
  end function kwarg_float_fallback_double

  real(c_double) function kwarg_float_fallback_float(call, name, fallback) result(value)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: name
    real(c_float), intent(in) :: fallback
    value = kwarg_float_fallback_double(call, name, real(fallback, c_double))
  end function kwarg_float_fallback_float

end module jaxbind

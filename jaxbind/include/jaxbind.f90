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
!   - The kwarg accessors read and convert as the header's do, and a kwarg of a
!     type one cannot read fails the call the same way (the message in
!     call%kwarg_error). jaxbind_kwarg_int and jaxbind_kwarg_float take the
!     fallback in either of the two usual kinds (int32 or int64; float32 or
!     float64) and return int64 and double values; jaxbind_kwarg_bool takes and
!     returns a logical; jaxbind_kwarg_string returns a copy (an allocatable
!     string); jaxbind_kwarg_int_array and jaxbind_kwarg_float_array return a
!     pointer to the entries (its size is theirs), disassociated when the kwarg
!     is absent or refused.
!
! The layout matches jaxbind.h field for field: int64_t is integer(c_int64_t),
! double is real(c_double), pointers are type(c_ptr). This is ABI version 2;
! like the header, each version only appends fields and codes.
module jaxbind
  use, intrinsic :: iso_c_binding, only: c_char, c_double, c_f_pointer, c_float, c_int, c_int32_t, &
                                         c_int64_t, c_null_char, c_ptr, c_associated
  implicit none
  private

  integer(c_int64_t), parameter, public :: JAXBIND_ABI_VERSION = 2

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
    ! Version 2: read only when call%struct_size >= 96 (the caller filled them).
    type(c_ptr) :: kwarg_error          ! why a kwarg accessor could not read a kwarg as asked...
    integer(c_int64_t) :: kwarg_error_size  ! ...in this many bytes; a message there fails the call
  end type jaxbind_call

  ! The bytes of a version 2 call, which has kwarg_error.
  integer(c_int64_t), parameter :: CALL_SIZE_V2 = 96

  ! The kernel signature (typedef jaxbind_kernel), for procedure(jaxbind_kernel) declarations.
  abstract interface
    integer(c_int) function jaxbind_kernel(call) bind(C)
      import :: c_int, jaxbind_call
      type(jaxbind_call), intent(in) :: call
    end function jaxbind_kernel
  end interface
  public :: jaxbind_kernel

  ! The kwarg accessors, with a fallback when absent (see the header for what each reads).
  interface jaxbind_kwarg_int
    module procedure kwarg_int_fallback_int64, kwarg_int_fallback_int32
  end interface jaxbind_kwarg_int
  interface jaxbind_kwarg_float
    module procedure kwarg_float_fallback_double, kwarg_float_fallback_float
  end interface jaxbind_kwarg_float

  public :: jaxbind_fail, jaxbind_find_kwarg, jaxbind_kwarg_bool, jaxbind_kwarg_float, &
            jaxbind_kwarg_float_array, jaxbind_kwarg_int, jaxbind_kwarg_int_array, jaxbind_kwarg_string, &
            jaxbind_size

  ! What an absent or empty array kwarg's pointer points to (c_f_pointer takes no null address).
  integer(c_int64_t), target, save :: no_ints(0)
  real(c_double), target, save :: no_floats(0)

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
    jaxbind_fail = 1
    call write_c_string(call%error, call%error_size, message)
  end function jaxbind_fail

  ! `message` without its trailing blanks into the C buffer `buffer` of `size`
  ! bytes, cut to it and NUL-terminated; nothing without a buffer.
  subroutine write_c_string(buffer, size, message)
    type(c_ptr), intent(in) :: buffer
    integer(c_int64_t), intent(in) :: size
    character(len=*), intent(in) :: message
    character(kind=c_char), pointer :: chars(:)
    integer(c_int64_t) :: n, i
    if (.not. c_associated(buffer) .or. size <= 0) return
    call c_f_pointer(buffer, chars, [size])
    n = min(int(len_trim(message), c_int64_t), size - 1)
    do i = 1, n
      chars(i) = message(i:i)
    end do
    chars(n + 1) = c_null_char
  end subroutine write_c_string

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

  ! The C string at `text` (NUL-terminated), as a Fortran string of `size` bytes.
  function c_string(text, size) result(copy)
    type(c_ptr), intent(in) :: text
    integer(c_int64_t), intent(in) :: size
    character(len=:), allocatable :: copy
    character(kind=c_char), pointer :: chars(:)
    integer(c_int64_t) :: i
    allocate (character(len=size) :: copy)
    if (size <= 0 .or. .not. c_associated(text)) return
    call c_f_pointer(text, chars, [size])
    do i = 1, size
      copy(i:i) = chars(i)
    end do
  end function c_string

  ! How a kwarg's type reads in a message, with an article, and its value.
  function kwarg_described(kw) result(text)
    type(jaxbind_kwarg), intent(in) :: kw
    character(len=:), allocatable :: text
    character(len=40) :: number
    select case (kw%type)
    case (JAXBIND_KW_INT)
      write (number, '(i0)') kw%int_value
      text = 'an int (' // trim(number) // ')'
    case (JAXBIND_KW_FLOAT)
      text = 'a float (' // short_real(kw%float_value) // ')'
    case (JAXBIND_KW_BOOL)
      text = 'a bool (' // merge('True ', 'False', kw%int_value /= 0)
      text = trim(text) // ')'
    case (JAXBIND_KW_STRING)
      text = "a string ('" // c_string(kw%string_value, min(kw%size, 40_c_int64_t)) // &
             merge("...", "   ", kw%size > 40)
      text = trim(text) // "')"
    case (JAXBIND_KW_INT_ARRAY, JAXBIND_KW_FLOAT_ARRAY)
      write (number, '(i0)') kw%size
      text = merge('an int array ', 'a float array', kw%type == JAXBIND_KW_INT_ARRAY)
      text = trim(text) // ' of ' // trim(number) // merge(' entry  ', ' entries', kw%size == 1)
      text = trim(text)
    case default
      write (number, '(i0)') kw%type
      text = 'a kwarg of an unknown type (type code ' // trim(number) // ')'
    end select
  end function kwarg_described

  ! `x` with 6 significant digits and no trailing zeros (2.5, not 2.50000), as C's %g writes it.
  function short_real(x) result(text)
    real(c_double), intent(in) :: x
    character(len=:), allocatable :: text
    character(len=40) :: number
    integer :: last
    write (number, '(g0.6)') x
    text = trim(adjustl(number))
    if (index(text, '.') == 0 .or. scan(text, 'eE') /= 0) return
    last = len(text)
    do while (text(last:last) == '0')
      last = last - 1
    end do
    if (text(last:last) == '.') last = last - 1
    text = text(1:last)
  end function short_real

  ! An accessor's failure, as the header's jaxbind_kwarg_refuse_: why `kw` cannot be read as
  ! `asked` by `accessor`, which takes `takes`, into call%kwarg_error (the first failure only;
  ! nothing for a caller older than version 2).
  subroutine kwarg_refuse(call, kw, accessor, asked, takes)
    type(jaxbind_call), intent(in) :: call
    type(jaxbind_kwarg), intent(in) :: kw
    character(len=*), intent(in) :: accessor, asked, takes
    character(kind=c_char), pointer :: first(:)
    if (call%struct_size < CALL_SIZE_V2) return
    if (.not. c_associated(call%kwarg_error) .or. call%kwarg_error_size <= 0) return
    call c_f_pointer(call%kwarg_error, first, [1])
    if (first(1) /= c_null_char) return
    call write_c_string(call%kwarg_error, call%kwarg_error_size, &
                        "keyword argument '" // c_string(kw%name, c_strlen(kw%name)) // "' is " // &
                        kwarg_described(kw) // ", but the kernel reads it as " // asked // " (" // &
                        accessor // "): pass " // takes)
  end subroutine kwarg_refuse

  ! The length of the NUL-terminated C string at `text`.
  integer(c_int64_t) function c_strlen(text)
    type(c_ptr), intent(in) :: text
    character(kind=c_char), pointer :: chars(:)
    c_strlen = 0
    if (.not. c_associated(text)) return
    do
      call c_f_pointer(text, chars, [c_strlen + 1])
      if (chars(c_strlen + 1) == c_null_char) return
      c_strlen = c_strlen + 1
    end do
  end function c_strlen

  ! An int; a bool reads as 0 or 1. A float is refused, even a whole one.
  integer(c_int64_t) function kwarg_int_fallback_int64(call, name, fallback) result(value)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: name
    integer(c_int64_t), intent(in) :: fallback
    type(jaxbind_kwarg), pointer :: kw
    value = fallback
    kw => jaxbind_find_kwarg(call, name)
    if (.not. associated(kw)) return
    if (kw%type == JAXBIND_KW_INT .or. kw%type == JAXBIND_KW_BOOL) then
      value = kw%int_value
    else
      call kwarg_refuse(call, kw, "jaxbind_kwarg_int", "an int", "an int (or a bool)")
    end if
  end function kwarg_int_fallback_int64

  integer(c_int64_t) function kwarg_int_fallback_int32(call, name, fallback) result(value)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: name
    integer(c_int32_t), intent(in) :: fallback
    value = kwarg_int_fallback_int64(call, name, int(fallback, c_int64_t))
  end function kwarg_int_fallback_int32

  ! A float; an int converts. A bool is refused.
  real(c_double) function kwarg_float_fallback_double(call, name, fallback) result(value)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: name
    real(c_double), intent(in) :: fallback
    type(jaxbind_kwarg), pointer :: kw
    value = fallback
    kw => jaxbind_find_kwarg(call, name)
    if (.not. associated(kw)) return
    if (kw%type == JAXBIND_KW_FLOAT) then
      value = kw%float_value
    else if (kw%type == JAXBIND_KW_INT) then
      value = real(kw%int_value, c_double)
    else
      call kwarg_refuse(call, kw, "jaxbind_kwarg_float", "a float", "a float (or an int)")
    end if
  end function kwarg_float_fallback_double

  real(c_double) function kwarg_float_fallback_float(call, name, fallback) result(value)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: name
    real(c_float), intent(in) :: fallback
    value = kwarg_float_fallback_double(call, name, real(fallback, c_double))
  end function kwarg_float_fallback_float

  ! A bool; the ints 0 and 1 read as bools, other ints are refused.
  logical function jaxbind_kwarg_bool(call, name, fallback) result(value)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: name
    logical, intent(in) :: fallback
    type(jaxbind_kwarg), pointer :: kw
    value = fallback
    kw => jaxbind_find_kwarg(call, name)
    if (.not. associated(kw)) return
    if (kw%type == JAXBIND_KW_BOOL .or. &
        (kw%type == JAXBIND_KW_INT .and. (kw%int_value == 0 .or. kw%int_value == 1))) then
      value = kw%int_value /= 0
    else
      call kwarg_refuse(call, kw, "jaxbind_kwarg_bool", "a bool", "a bool (or the int 0 or 1)")
    end if
  end function jaxbind_kwarg_bool

  ! A string, copied (its size in bytes is the kwarg's).
  function jaxbind_kwarg_string(call, name, fallback) result(value)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: name, fallback
    character(len=:), allocatable :: value
    type(jaxbind_kwarg), pointer :: kw
    value = fallback
    kw => jaxbind_find_kwarg(call, name)
    if (.not. associated(kw)) return
    if (kw%type == JAXBIND_KW_STRING) then
      value = c_string(kw%string_value, kw%size)
    else
      call kwarg_refuse(call, kw, "jaxbind_kwarg_string", "a string", "a string")
    end if
  end function jaxbind_kwarg_string

  ! An int array's entries; disassociated when absent or refused. An empty float array reads as empty.
  function jaxbind_kwarg_int_array(call, name) result(values)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: name
    integer(c_int64_t), pointer :: values(:)
    type(jaxbind_kwarg), pointer :: kw
    values => null()
    kw => jaxbind_find_kwarg(call, name)
    if (.not. associated(kw)) return
    if (kw%size == 0 .and. (kw%type == JAXBIND_KW_INT_ARRAY .or. kw%type == JAXBIND_KW_FLOAT_ARRAY)) then
      values => no_ints
    else if (kw%type == JAXBIND_KW_INT_ARRAY) then
      call c_f_pointer(kw%int_array, values, [kw%size])
    else
      call kwarg_refuse(call, kw, "jaxbind_kwarg_int_array", "an int array", "a 1-d sequence or array of ints")
    end if
  end function jaxbind_kwarg_int_array

  ! A float array's entries; disassociated when absent or refused. An int array is refused (write
  ! [1.0, 2.0], not [1, 2], or declare it list[float]); an empty one reads as empty.
  function jaxbind_kwarg_float_array(call, name) result(values)
    type(jaxbind_call), intent(in) :: call
    character(len=*), intent(in) :: name
    real(c_double), pointer :: values(:)
    type(jaxbind_kwarg), pointer :: kw
    values => null()
    kw => jaxbind_find_kwarg(call, name)
    if (.not. associated(kw)) return
    if (kw%size == 0 .and. (kw%type == JAXBIND_KW_INT_ARRAY .or. kw%type == JAXBIND_KW_FLOAT_ARRAY)) then
      values => no_floats
    else if (kw%type == JAXBIND_KW_FLOAT_ARRAY) then
      call c_f_pointer(kw%float_array, values, [kw%size])
    else
      call kwarg_refuse(call, kw, "jaxbind_kwarg_float_array", "a float array", &
                        "a 1-d sequence or array of floats ([1.0, 2.0], not [1, 2])")
    end if
  end function jaxbind_kwarg_float_array

end module jaxbind

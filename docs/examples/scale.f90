integer(c_int) function scale(call) bind(C)         ! y = factor * x
  use, intrinsic :: iso_c_binding
  use jaxbind
  implicit none
  type(jaxbind_call), intent(in) :: call
  type(jaxbind_array), pointer :: ins(:), outs(:)
  real(c_double), pointer :: x(:), y(:)
  call c_f_pointer(call%in, ins, [call%n_in])        ! ins(1) is call->in[0]
  call c_f_pointer(call%out, outs, [call%n_out])
  if (ins(1)%dtype /= JAXBIND_FLOAT64) then
    scale = jaxbind_fail(call, "float64 only")
    return
  end if
  call c_f_pointer(ins(1)%data, x, [jaxbind_size(ins(1))])
  call c_f_pointer(outs(1)%data, y, [jaxbind_size(outs(1))])
  y = jaxbind_kwarg_float(call, "factor", 2.0_c_double) * x
  scale = 0
end function scale

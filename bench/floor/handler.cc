// The floor of a custom call: XLA typed-FFI handlers written by hand against
// the installed jaxlib's headers, doing what jaxbind's benchmark kernels do
// (y = 2 x on float64). bench/_floor.py compiles this file at run time.

#include <cstdint>
#include <string_view>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Double(ffi::Buffer<ffi::F64> x, ffi::ResultBuffer<ffi::F64> y) {
  const double* in = x.typed_data();
  double* out = y->typed_data();
  for (size_t i = 0, n = x.element_count(); i < n; ++i) out[i] = 2.0 * in[i];
  return ffi::Error::Success();
}

// The same work, decoding the attributes every jaxbind call carries (a string
// and an int64) and the thread pool jaxbind's handler asks for.
ffi::Error DoubleWithAttributes(ffi::ThreadPool pool, std::string_view call, int64_t site,
                                ffi::Buffer<ffi::F64> x, ffi::ResultBuffer<ffi::F64> y) {
  if (call.empty() || site == 0) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "floor handler: empty attributes");
  }
  return Double(x, y);
}

ffi::Error Empty(ffi::Buffer<ffi::F64>, ffi::ResultBuffer<ffi::F64>) {
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(floor_double, Double,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F64>>().Ret<ffi::Buffer<ffi::F64>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(floor_double_attributes, DoubleWithAttributes,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<std::string_view>("jaxbind")
                                  .Attr<int64_t>("site")
                                  .Arg<ffi::Buffer<ffi::F64>>()
                                  .Ret<ffi::Buffer<ffi::F64>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(floor_empty, Empty,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F64>>().Ret<ffi::Buffer<ffi::F64>>());

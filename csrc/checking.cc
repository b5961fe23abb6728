// The checking mode: outputs filled with a sentinel before a call, then searched for elements left
// unwritten.

#include "internal.h"

namespace {

std::atomic<bool> g_check_unwritten{false};
// check_op's thread-safety check: every walk of a thread-safe Python site is
// spread over the pool in chunks of a few elements, however short they are.
std::atomic<bool> g_spread_walks{false};

constexpr size_t kMaxSentinel = 16;  // bytes: complex128

// The bytes an element holds until a callback writes it: for float types a NaN
// with a payload arithmetic does not produce, else 0xA5 bytes (a legal value of
// integer and float8 types, so one written on purpose is reported too; an
// invalid bool). Returns the element width, 0 for an unknown dtype.
size_t Sentinel(int64_t dtype, unsigned char* pattern) {
  const int64_t width = ItemSize(dtype);
  if (width <= 0 || width > static_cast<int64_t>(kMaxSentinel)) return 0;
  std::memset(pattern, 0xA5, static_cast<size_t>(width));
  // Little-endian high bytes of a NaN (each half of a complex number).
  switch (dtype) {
    case JAXBIND_FLOAT16: pattern[1] = 0x7D; break;   // 0x7DA5
    case JAXBIND_BFLOAT16: pattern[1] = 0x7F; break;  // 0x7FA5
    case JAXBIND_FLOAT32:
    case JAXBIND_COMPLEX64:  // 0x7FA5A5A5
      for (int64_t h = 3; h < width; h += 4) pattern[h] = 0x7F;
      break;
    case JAXBIND_FLOAT64:
    case JAXBIND_COMPLEX128:  // 0x7FF5A5A5A5A5A5A5
      for (int64_t h = 7; h < width; h += 8) {
        pattern[h] = 0x7F;
        pattern[h - 1] = 0xF5;
      }
      break;
    default: break;
  }
  return static_cast<size_t>(width);
}

int64_t NumElements(const XLA_FFI_Buffer* buf) {
  int64_t n = 1;
  for (int64_t d = 0; d < buf->rank; ++d) n *= buf->dims[d];
  return n;
}

// Whether an output is an input's own buffer (an output updated in place,
// `inplace=`): it holds the input's values, which the callback may rightly leave.
bool UpdatedInPlace(const XLA_FFI_Buffer* out, size_t n_in, void* const* ins) {
  for (size_t i = 0; i < n_in; ++i) {
    if (static_cast<const XLA_FFI_Buffer*>(ins[i])->data == out->data) return true;
  }
  return false;
}

void FillSentinel(size_t n_in, void* const* ins, size_t n_out, void* const* outs) {
  unsigned char pattern[kMaxSentinel];
  for (size_t k = 0; k < n_out; ++k) {
    auto* buf = static_cast<XLA_FFI_Buffer*>(outs[k]);
    if (UpdatedInPlace(buf, n_in, ins)) continue;
    const size_t width = Sentinel(buf->dtype, pattern);
    auto* data = static_cast<unsigned char*>(buf->data);
    const int64_t n = NumElements(buf);
    for (int64_t e = 0; width != 0 && data != nullptr && e < n; ++e) {
      std::memcpy(data + e * width, pattern, width);
    }
  }
}

// Empty, or the message naming the first output element still holding the sentinel.
std::string FindUnwritten(size_t n_in, void* const* ins, size_t n_out, void* const* outs) {
  unsigned char pattern[kMaxSentinel];
  for (size_t k = 0; k < n_out; ++k) {
    auto* buf = static_cast<XLA_FFI_Buffer*>(outs[k]);
    if (UpdatedInPlace(buf, n_in, ins)) continue;
    const size_t width = Sentinel(buf->dtype, pattern);
    const auto* data = static_cast<const unsigned char*>(buf->data);
    const int64_t n = NumElements(buf);
    for (int64_t e = 0; width != 0 && data != nullptr && e < n; ++e) {
      if (std::memcmp(data + e * width, pattern, width) != 0) continue;
      int64_t count = 0;
      for (int64_t f = e; f < n; ++f) count += std::memcmp(data + f * width, pattern, width) == 0;
      std::string index, shape;
      for (int64_t d = buf->rank, rest = e; d-- > 0;) {
        index = std::to_string(rest % buf->dims[d]) + (index.empty() ? "" : ", ") + index;
        rest /= buf->dims[d];
      }
      for (int64_t d = 0; d < buf->rank; ++d)
        shape += (d ? ", " : "") + std::to_string(buf->dims[d]);
      return "output " + std::to_string(k) + " (shape (" + shape +
             ")) was not fully written: " + std::to_string(count) +
             " element(s) still hold the checking mode's sentinel, the "
             "first at index (" +
             index +
             "). A callback must write every element of every "
             "output (jaxbind.config.check_unwritten is on)";
    }
  }
  return std::string();
}

}  // namespace

// The buffers of a call: XLA's must be the arrays the site was registered for.
//
// A program carries its call's description (whose avals the op's abstract
// gave, checked again when a program from elsewhere is resolved:
// jaxbind/_programs.py) and, separately, the operand and result types XLA
// allocates its buffers by. A program altered to pass other arrays than it
// describes would hand a kernel buffers smaller than the ones it writes, so
// every call compares the buffers' dtype codes and dims with the site's: a few
// integer compares per buffer, before anything reads them.

#include "internal.h"

namespace {

// Under the registry's rules (a value_error refuses the registration): every
// buffer's type whole, and the free leading dims in every buffer.
void SetBufferTypes(Site& site, const std::vector<int64_t>& types, size_t n_args, size_t n_rets,
                    size_t free_levels) {
  size_t at = 0;
  for (size_t i = 0; i < n_args + n_rets; ++i) {
    if (at + 2 > types.size()) throw nb::value_error("a buffer type per input and output expected");
    const int64_t rank = types[at + 1];
    if (rank < 0 || rank > 64 || at + 2 + static_cast<size_t>(rank) > types.size()) {
      throw nb::value_error("a buffer type's rank is not that of its dims");
    }
    if (static_cast<size_t>(rank) < free_levels) {
      throw nb::value_error("a buffer has fewer dims than the batch levels XLA may split");
    }
    for (int64_t d = 0; d < rank; ++d) {
      if (types[at + 2 + d] < 0) throw nb::value_error("a negative dimension");
    }
    at += 2 + static_cast<size_t>(rank);
  }
  if (at != types.size()) throw nb::value_error("more buffer types than inputs and outputs");
  if (n_args + n_rets == 0) throw nb::value_error("a call has buffers");
  site.types = types;
  site.n_args = n_args;
  site.n_rets = n_rets;
  site.free_levels = free_levels;
}

inline const XLA_FFI_Buffer* BufferAt(size_t i, size_t n_in, void* const* ins, void* const* outs) {
  return static_cast<const XLA_FFI_Buffer*>(i < n_in ? ins[i] : outs[i - n_in]);
}

// Whether one buffer has the type `t` points at (dtype code, rank, dims): its
// first `free` dims those of `lead` (the call's first buffer), at most `t`'s.
inline bool BufferIs(const XLA_FFI_Buffer* buf, const int64_t* t, int64_t free,
                     const int64_t* lead) {
  const int64_t rank = t[1];
  if (static_cast<int64_t>(buf->dtype) != t[0] || buf->rank != rank) return false;
  int64_t d = 0;
  for (; d < free; ++d) {
    if (buf->dims[d] != lead[d] || buf->dims[d] > t[2 + d] || buf->dims[d] < 0) return false;
  }
  for (; d < rank; ++d) {
    if (buf->dims[d] != t[2 + d]) return false;
  }
  return true;
}

// Whether every buffer of a call has the type the site was registered for.
inline bool BuffersAsRegistered(const Site& site, size_t n_in, void* const* ins, size_t n_out,
                                void* const* outs) {
  if (n_in != site.n_args || n_out != site.n_rets) return false;
  const int64_t* t = site.types.data();
  const int64_t free = static_cast<int64_t>(site.free_levels);  // 0 but for a partitioned batch
  const int64_t* lead = BufferAt(0, n_in, ins, outs)->dims;
  for (size_t i = 0; i < n_in + n_out; ++i) {
    if (!BufferIs(BufferAt(i, n_in, ins, outs), t, free, lead)) return false;
    t += 2 + t[1];
  }
  return true;
}

const char* DtypeName(int64_t code) {
  switch (code) {
    case JAXBIND_BOOL: return "bool";
    case JAXBIND_INT8: return "int8";
    case JAXBIND_INT16: return "int16";
    case JAXBIND_INT32: return "int32";
    case JAXBIND_INT64: return "int64";
    case JAXBIND_UINT8: return "uint8";
    case JAXBIND_UINT16: return "uint16";
    case JAXBIND_UINT32: return "uint32";
    case JAXBIND_UINT64: return "uint64";
    case JAXBIND_FLOAT16: return "float16";
    case JAXBIND_FLOAT32: return "float32";
    case JAXBIND_FLOAT64: return "float64";
    case JAXBIND_COMPLEX64: return "complex64";
    case JAXBIND_BFLOAT16: return "bfloat16";
    case JAXBIND_COMPLEX128: return "complex128";
    default: return nullptr;
  }
}

std::string TypeText(int64_t dtype, int64_t rank, const int64_t* dims) {
  const char* name = DtypeName(dtype);
  std::string text = name ? name : "dtype code " + std::to_string(dtype) + " ";
  text += "[";
  for (int64_t d = 0; d < rank; ++d) text += (d ? ", " : "") + std::to_string(dims[d]);
  return text + "]";
}

std::string BufferName(size_t i, size_t n_args) {
  return i < n_args ? "input " + std::to_string(i) : "output " + std::to_string(i - n_args);
}

// The message of a call whose buffers differ from the site's: the first that differs.
ffi::Error BuffersRefused(const Site& site, size_t n_in, void* const* ins, size_t n_out,
                          void* const* outs) {
  const std::string fix =
      ": the program was altered (its arrays are not those its description names, which the op's "
      "abstract gave) and is refused before anything reads them. Export the program again "
      "(jaxbind.export) from where it was made.";
  if (n_in != site.n_args || n_out != site.n_rets) {
    return ErrorText(&site, "the program passes " + std::to_string(n_in) + " input(s) and " +
                                std::to_string(n_out) + " output(s), but its call site has " +
                                std::to_string(site.n_args) + " and " +
                                std::to_string(site.n_rets) + fix);
  }
  const int64_t* t = site.types.data();
  const int64_t free = static_cast<int64_t>(site.free_levels);
  const XLA_FFI_Buffer* first = BufferAt(0, n_in, ins, outs);
  for (size_t i = 0; i < n_in + n_out; ++i) {
    const XLA_FFI_Buffer* buf = BufferAt(i, n_in, ins, outs);
    const int64_t rank = t[1];
    // (the first buffer's leading dims are compared with its registered ones only)
    if (!BufferIs(buf, t, i == 0 ? 0 : free, first->dims) ||
        (i == 0 && !BufferIs(buf, t, free, buf->dims))) {
      std::string what = "the program passes " + BufferName(i, site.n_args) + " as " +
                         TypeText(buf->dtype, buf->rank, buf->dims) + ", but its call site has " +
                         TypeText(t[0], rank, t + 2);
      if (site.free_levels != 0) {
        what += " (of which the first " + std::to_string(site.free_levels) +
                " dim(s), a batch XLA may split, may be smaller, alike in every array)";
      }
      return ErrorText(&site, what + fix);
    }
    t += 2 + rank;
  }
  return ErrorText(&site,
                   "internal error: a buffer differs from its call site's, but none was found");
}

}  // namespace

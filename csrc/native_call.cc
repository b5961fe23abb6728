// The call of a native kernel: its kwargs made at registration, the runner, the parallel walk.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>

#include "walk.h"

namespace {

// Converts the (name, type code, value) entries that jaxbind/_native.py made
// into the site's kwargs. The Python side checks every value first; a value
// that still does not convert is an error naming the op and the kwarg.
void SetNativeKwargs(NativeSite& site, nb::handle native_kwargs) {
  site.storage.resize(nb::len(native_kwargs));
  size_t k = 0;
  for (nb::handle item : native_kwargs) {
    NativeKwarg& kw = site.storage[k++];
    try {
      nb::tuple entry = nb::cast<nb::tuple>(item);
      kw.name = nb::cast<std::string>(entry[0]);
      kw.type = nb::cast<int64_t>(entry[1]);
      switch (kw.type) {
        case JAXBIND_KW_INT:
        case JAXBIND_KW_BOOL: kw.int_value = nb::cast<int64_t>(entry[2]); break;
        case JAXBIND_KW_FLOAT: kw.float_value = nb::cast<double>(entry[2]); break;
        case JAXBIND_KW_STRING: kw.string_value = nb::cast<std::string>(entry[2]); break;
        case JAXBIND_KW_INT_ARRAY: kw.int_array = nb::cast<std::vector<int64_t>>(entry[2]); break;
        case JAXBIND_KW_FLOAT_ARRAY:
          kw.float_array = nb::cast<std::vector<double>>(entry[2]);
          break;
        default: throw nb::value_error("unknown native kwarg type");
      }
    } catch (const std::exception& err) {
      PyErr_Clear();
      throw nb::type_error(("jaxbind " + site.name + ": keyword argument '" + kw.name +
                            "' cannot be passed to a native kernel (" + err.what() +
                            "): ints must fit in 64 bits, strings be valid UTF-8")
                               .c_str());
    }
  }
  // Only now that the storage is complete (it no longer moves) can views point into it.
  for (const NativeKwarg& kw : site.storage) {
    jaxbind_kwarg view{};
    view.name = kw.name.c_str();
    view.type = kw.type;
    view.size = 1;
    view.int_value = kw.int_value;
    view.float_value = kw.float_value;
    if (kw.type == JAXBIND_KW_STRING) {
      view.string_value = kw.string_value.c_str();
      view.size = static_cast<int64_t>(kw.string_value.size());
    } else if (kw.type == JAXBIND_KW_INT_ARRAY) {
      view.int_array = kw.int_array.data();
      view.size = static_cast<int64_t>(kw.int_array.size());
    } else if (kw.type == JAXBIND_KW_FLOAT_ARRAY) {
      view.float_array = kw.float_array.data();
      view.size = static_cast<int64_t>(kw.float_array.size());
    }
    site.kwargs.push_back(view);
  }
}

// Why a kernel call failed, the text after the site's name ("op 'scale'", or
// "op 'scale' (transpose callback 'scale_T')" for a callback other than the
// forward one): a kwarg the kernel could not read as it asked (written by the
// header's accessors, whatever the kernel returned: the root cause of anything
// the kernel did next), else the kernel's own message, or, without one, which
// callback failed and how to give a message.
std::string KernelFailure(const NativeSite& site, char* error, size_t size, int code,
                          char* kwarg_error, size_t kwarg_size) {
  kwarg_error[kwarg_size - 1] = '\0';
  if (kwarg_error[0]) return "native kernel failed: " + std::string(kwarg_error);
  error[size - 1] = '\0';
  if (error[0]) return "native kernel failed: " + std::string(error);
  const std::string& name = site.name;
  const size_t open = name.find(" (");
  const std::string which = open != std::string::npos && name.back() == ')'
                                ? "the " + name.substr(open + 2, name.size() - open - 3)
                                : std::string("the forward callback");
  return "native kernel failed: " + which + " (a native kernel) returned " + std::to_string(code) +
         " without a message (a kernel that fails should write one: return jaxbind_fail(call, "
         "\"...\"))";
}

// Room for the message of a kwarg an accessor could not read (a kwarg's name,
// two type names and a value, cut at 40 bytes, in one sentence).
constexpr size_t kKwargErrorSize = 512;

// The buffers of a kernel call without a walk, described straight from XLA's.
constexpr size_t kDirectMax = 16;  // buffers; more take the walk's path

inline void Describe(void* const* buffers, size_t n, jaxbind_array* arrays) {
  for (size_t i = 0; i < n; ++i) {
    const auto* buf = static_cast<const XLA_FFI_Buffer*>(buffers[i]);
    arrays[i] = jaxbind_array{ElementData(buffers[i], 0), buf->dims, buf->rank, buf->dtype};
  }
}

// A call that RunNativeDirect serves: no walk, no padding, few buffers.
inline bool DirectCall(const NativeSite& site, size_t n_in, size_t n_out) {
  return site.levels == 0 && site.valid_levels == 0 && n_in <= kDirectMax && n_out <= kDirectMax;
}

// The most common call, the direct one: one kernel call over the buffers as
// they are, nothing planned, nothing allocated, the kernel's descriptors filled
// in place. (Its inputs have no batch levels to skip: site.levels is 0.)
// The checking mode for unwritten outputs is RunNativeChecked's, which
// reaches this through RunNativeWalk.
ffi::Error RunNativeDirect(const NativeSite& site, size_t n_in, void* const* ins, size_t n_out,
                           void* const* outs) {
  jaxbind_array in[kDirectMax], out[kDirectMax];
  Describe(ins, n_in, in);
  Describe(outs, n_out, out);
  char error[2048], kwarg_error[kKwargErrorSize];
  error[0] = '\0';
  kwarg_error[0] = '\0';
  jaxbind_call call{static_cast<int64_t>(sizeof(jaxbind_call)),
                    JAXBIND_ABI_VERSION,
                    static_cast<int64_t>(n_out),
                    out,
                    static_cast<int64_t>(n_in),
                    in,
                    static_cast<int64_t>(site.kwargs.size()),
                    site.kwargs.data(),
                    error,
                    static_cast<int64_t>(sizeof(error)),
                    kwarg_error,
                    static_cast<int64_t>(sizeof(kwarg_error))};
  const int code = site.kernel(&call);
  if (code == 0 && kwarg_error[0] == '\0') return ffi::Error::Success();
  return ErrorText(
      &site, KernelFailure(site, error, sizeof(error), code, kwarg_error, sizeof(kwarg_error)));
}

// Runs a native kernel over elements of a walk: descriptors on the stack, no
// Python, no GIL. One runner per thread (it owns the descriptors and the
// error buffer the kernel writes).
class NativeRunner {
 public:
  NativeRunner(const NativeSite& site, const WalkPlan& plan, void* const* ins, void* const* outs)
      : site_(site),
        plan_(plan),
        ins_(ins),
        outs_(outs),
        n_in_(plan.valid != nullptr ? plan.n_in - 1 : plan.n_in),
        in_(plan.n_in),
        out_(plan.n_out) {
    const int64_t out_skip = static_cast<int64_t>(site.levels);
    for (size_t i = 0; i < n_in_; ++i) {
      auto* buf = static_cast<XLA_FFI_Buffer*>(ins[i]);
      int skip = InputSkip(site, i);
      in_[i] = jaxbind_array{nullptr, buf->dims + skip, buf->rank - skip, buf->dtype};
    }
    for (size_t j = 0; j < plan.n_out; ++j) {
      auto* buf = static_cast<XLA_FFI_Buffer*>(outs[j]);
      out_[j] = jaxbind_array{nullptr, buf->dims + out_skip, buf->rank - out_skip, buf->dtype};
    }
    error_[0] = '\0';
    kwarg_error_[0] = '\0';
    call_ = jaxbind_call{static_cast<int64_t>(sizeof(jaxbind_call)),
                         JAXBIND_ABI_VERSION,
                         static_cast<int64_t>(plan.n_out),
                         out_.data(),
                         static_cast<int64_t>(n_in_),
                         in_.data(),
                         static_cast<int64_t>(site.kwargs.size()),
                         site.kwargs.data(),
                         error_,
                         static_cast<int64_t>(sizeof(error_)),
                         kwarg_error_,
                         static_cast<int64_t>(sizeof(kwarg_error_))};
  }
  NativeRunner(const NativeRunner&) = delete;
  NativeRunner& operator=(const NativeRunner&) = delete;

  // Elements [begin, end); false when the kernel failed (see Message).
  bool Run(int64_t begin, int64_t end) {
    return WalkRange(plan_, begin, end, [&](const int64_t* in_off, const int64_t* out_off) {
      for (size_t i = 0; i < n_in_; ++i) in_[i].data = ElementData(ins_[i], in_off[i]);
      for (size_t j = 0; j < plan_.n_out; ++j) out_[j].data = ElementData(outs_[j], out_off[j]);
      error_[0] = '\0';  // a failing element's message is its own, never an earlier element's
      code_ = site_.kernel(&call_);
      return code_ == 0 && kwarg_error_[0] == '\0';  // (no reset: a kwarg error ends the walk)
    });
  }

  std::string Message() {
    return KernelFailure(site_, error_, sizeof(error_), code_, kwarg_error_, sizeof(kwarg_error_));
  }

 private:
  const NativeSite& site_;
  const WalkPlan& plan_;
  void* const* ins_;
  void* const* outs_;
  size_t n_in_;  // the kernel's inputs (a padded walk's validity operand is not one)
  SmallBuffer<jaxbind_array> in_, out_;
  char error_[2048];
  char kwarg_error_[kKwargErrorSize];
  jaxbind_call call_;
  int code_ = 0;
};

// A native kernel over all of a call (every element of a walk). With a pool,
// a long walk is spread over XLA's intra-op threads: kernels are reentrant
// by contract, and each element writes its own part of the outputs.
ffi::Error RunNativeWalk(const NativeSite& site, size_t n_in, void* const* ins, size_t n_out,
                         void* const* outs, ffi::ThreadPool* pool) {
  if (DirectCall(site, n_in, n_out)) return RunNativeDirect(site, n_in, ins, n_out, outs);
  WalkPlan plan(site.levels, n_in, n_out);
  if (site.levels != 0) {
    std::string bad = PlanWalk(site, ins, outs, &plan);
    if (!bad.empty()) return ErrorText(&site, bad);
  }
  NativeRunner runner(site, plan, ins, outs);
  if (pool == nullptr || plan.total < 2) {
    return runner.Run(0, plan.total) ? ffi::Error::Success() : ErrorText(&site, runner.Message());
  }
  double element_ns = 0.0;
  if (!TimeFirstElements([&](int64_t b, int64_t e) { return runner.Run(b, e); }, &element_ns)) {
    return ErrorText(&site, runner.Message());
  }
  const int64_t threads = pool->num_threads();
  auto walk = std::make_shared<ChunkedWalk>();
  if (!walk->Plan(2, plan.total, element_ns, threads)) {
    return runner.Run(2, plan.total) ? ffi::Error::Success() : ErrorText(&site, runner.Message());
  }
  // Each thread makes its own runner (its call struct and error buffer) once it has a chunk.
  auto work = [walk, &site, &plan, ins, outs]() {
    std::optional<NativeRunner> own;
    walk->Work([&](int64_t begin, int64_t end, std::string* why) {
      if (!own) own.emplace(site, plan, ins, outs);
      if (own->Run(begin, end)) return true;
      *why = own->Message();
      return false;
    });
  };
  for (int64_t h = 0, helpers = walk->Helpers(threads); h < helpers; ++h)
    pool->Schedule([work]() { work(); });
  work();
  walk->Wait();
  if (walk->failed.load()) return ErrorText(&site, walk->error);
  return ffi::Error::Success();
}

// A native kernel call, with the checking mode for unwritten outputs around it.
ffi::Error RunNativeChecked(const NativeSite& site, size_t n_in, void* const* ins, size_t n_out,
                            void* const* outs, ffi::ThreadPool* pool) {
  const bool check = g_check_unwritten.load(std::memory_order_relaxed);
  if (check) FillSentinel(n_in, ins, n_out, outs);
  ffi::Error result = RunNativeWalk(site, n_in, ins, n_out, outs, pool);
  if (result.success() && check) {
    std::string unwritten = FindUnwritten(n_in, ins, n_out, outs);
    if (!unwritten.empty()) return ErrorText(&site, "native kernel: " + unwritten);
  }
  return result;
}

// A native kernel call (a walk, or the batch handed over whole), padding left out.
ffi::Error RunNative(const NativeSite& site, size_t n_in, void* const* ins, size_t n_out,
                     void* const* outs, ffi::ThreadPool* pool) {
  if (site.valid_levels != 0 && site.levels == 0) {  // (a walk skips padding itself)
    return RunNativeWholePadded(site, n_in, ins, n_out, outs, pool);
  }
  return RunNativeChecked(site, n_in, ins, n_out, outs, pool);
}

}  // namespace

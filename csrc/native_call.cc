// The call of a native kernel: its kwargs made at registration, the runner, the parallel walk.

#include "walk.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>

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
        case JAXBIND_KW_INT: case JAXBIND_KW_BOOL: kw.int_value = nb::cast<int64_t>(entry[2]); break;
        case JAXBIND_KW_FLOAT: kw.float_value = nb::cast<double>(entry[2]); break;
        case JAXBIND_KW_STRING: kw.string_value = nb::cast<std::string>(entry[2]); break;
        case JAXBIND_KW_INT_ARRAY: kw.int_array = nb::cast<std::vector<int64_t>>(entry[2]); break;
        case JAXBIND_KW_FLOAT_ARRAY: kw.float_array = nb::cast<std::vector<double>>(entry[2]); break;
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

// Runs a native kernel over elements of a walk: descriptors on the stack, no
// Python, no GIL. One runner per thread (it owns the descriptors and the
// error buffer the kernel writes).
class NativeRunner {
 public:
  NativeRunner(const NativeSite& site, const WalkPlan& plan, void* const* ins, void* const* outs)
      : site_(site), plan_(plan), ins_(ins), outs_(outs),
        n_in_(plan.valid != nullptr ? plan.n_in - 1 : plan.n_in), in_(plan.n_in), out_(plan.n_out) {
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
    call_ = jaxbind_call{static_cast<int64_t>(sizeof(jaxbind_call)), JAXBIND_ABI_VERSION,
                         static_cast<int64_t>(plan.n_out), out_.data(),
                         static_cast<int64_t>(n_in_), in_.data(),
                         static_cast<int64_t>(site.kwargs.size()),
                         site.kwargs.data(), error_, static_cast<int64_t>(sizeof(error_))};
  }
  NativeRunner(const NativeRunner&) = delete;
  NativeRunner& operator=(const NativeRunner&) = delete;

  // Elements [begin, end); false when the kernel failed (see Message).
  bool Run(int64_t begin, int64_t end) {
    return WalkRange(plan_, begin, end, [&](const int64_t* in_off, const int64_t* out_off) {
      for (size_t i = 0; i < n_in_; ++i) in_[i].data = ElementData(ins_[i], in_off[i]);
      for (size_t j = 0; j < plan_.n_out; ++j) out_[j].data = ElementData(outs_[j], out_off[j]);
      code_ = site_.kernel(&call_);
      return code_ == 0;
    });
  }

  // The text after the site's name ("op 'scale'", or "op 'scale' (transpose
  // callback 'scale_T')" for a callback other than the forward one). Without
  // a message of the kernel's own it says which callback failed, and how to
  // give a message.
  std::string Message() {
    error_[sizeof(error_) - 1] = '\0';
    if (error_[0]) return "native kernel failed: " + std::string(error_);
    const std::string& name = site_.name;
    const size_t open = name.find(" (");
    const std::string which = open != std::string::npos && name.back() == ')'
                                  ? "the " + name.substr(open + 2, name.size() - open - 3)
                                  : std::string("the forward callback");
    return "native kernel failed: " + which + " (a native kernel) returned " + std::to_string(code_) +
           " without a message (a kernel that fails should write one: return jaxbind_fail(call, "
           "\"...\"))";
  }

 private:
  const NativeSite& site_;
  const WalkPlan& plan_;
  void* const* ins_;
  void* const* outs_;
  size_t n_in_;  // the kernel's inputs (a padded walk's validity operand is not one)
  SmallBuffer<jaxbind_array> in_, out_;
  char error_[2048];
  jaxbind_call call_;
  int code_ = 0;
};

// Spreading a walk over XLA's thread pool pays only for elements that take
// longer than waking a thread (tens of microseconds on this kind of machine):
// the first element is timed, and the rest is split only when it is long.
constexpr double kParallelMinNs = 100e3;  // the rest of the walk, at least
constexpr double kChunkMinNs = 25e3;      // one chunk of elements, at least

// The elements [first, total) of a walk split into chunks that the calling thread
// and helpers on the pool claim one at a time. The caller waits only for
// chunks a thread has claimed, so it never depends on a helper being
// scheduled at all; a helper that starts late finds nothing to claim and
// touches nothing but this object, which it co-owns.
struct ParallelWalk {
  const NativeSite* site;
  const WalkPlan* plan;
  void* const* ins;
  void* const* outs;
  int64_t first = 0, chunk = 1, n_chunks = 0;  // chunk c: [first + c chunk, first + (c+1) chunk)
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  std::condition_variable all_done;
  int64_t done = 0;   // guarded by mutex
  std::string error;  // the first failure, guarded by mutex

  void Work() {
    std::optional<NativeRunner> runner;  // made once this thread has a chunk
    for (int64_t c; (c = next.fetch_add(1)) < n_chunks;) {
      bool ok = true;
      if (!failed.load(std::memory_order_relaxed)) {
        if (!runner) runner.emplace(*site, *plan, ins, outs);
        ok = runner->Run(first + c * chunk, std::min(plan->total, first + (c + 1) * chunk));
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (!ok && !failed.exchange(true)) error = runner->Message();
      if (++done == n_chunks) all_done.notify_all();
    }
  }
};

// A native kernel over a whole call (every element of a walk). With a pool,
// a long walk is spread over XLA's intra-op threads: kernels are reentrant
// by contract, and each element writes its own part of the outputs.
ffi::Error RunNativeWalk(const NativeSite& site, size_t n_in, void* const* ins, size_t n_out,
                         void* const* outs, ffi::ThreadPool* pool) {
  WalkPlan plan(site.levels, n_in, n_out);
  if (site.levels != 0) {
    std::string bad = PlanWalk(site, ins, outs, &plan);
    if (!bad.empty()) return ErrorText(&site, bad);
  }
  NativeRunner runner(site, plan, ins, outs);
  if (pool == nullptr || plan.total < 2) {
    return runner.Run(0, plan.total) ? ffi::Error::Success() : ErrorText(&site, runner.Message());
  }
  // The first element may be slow for reasons of its own (cold caches, a first
  // touch of the kernel's code): time the second one too and go by the faster.
  double element_ns = 0.0;
  for (int64_t e = 0; e < 2; ++e) {
    const auto start = std::chrono::steady_clock::now();
    if (!runner.Run(e, e + 1)) return ErrorText(&site, runner.Message());
    const double ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    element_ns = e == 0 ? ns : std::min(element_ns, ns);
  }
  const int64_t first = 2, rest = plan.total - first;
  if (rest <= 0) return ffi::Error::Success();
  const int64_t threads = pool->num_threads();
  if (threads < 1 || element_ns * rest < kParallelMinNs) {
    return runner.Run(first, plan.total) ? ffi::Error::Success() : ErrorText(&site, runner.Message());
  }
  auto walk = std::make_shared<ParallelWalk>();
  walk->site = &site;
  walk->plan = &plan;
  walk->ins = ins;
  walk->outs = outs;
  walk->first = first;
  // Several chunks per thread (8) keep the threads' shares even at the end of
  // the walk; none shorter than kChunkMinNs.
  const int64_t by_time = static_cast<int64_t>(kChunkMinNs / std::max(element_ns, 1.0)) + 1;
  const int64_t by_balance = (rest + 8 * (threads + 1) - 1) / (8 * (threads + 1));
  walk->chunk = std::max<int64_t>(1, std::max(by_time, by_balance));
  walk->n_chunks = (rest + walk->chunk - 1) / walk->chunk;
  // Every pool thread gets a helper, although the calling thread works too:
  // an idle pool thread spins looking for work, taking a core anyway
  // (measured: one helper fewer made a 2-core walk 20% slower).
  const int64_t helpers = std::min(threads, walk->n_chunks - 1);
  for (int64_t h = 0; h < helpers; ++h) pool->Schedule([walk]() { walk->Work(); });
  walk->Work();
  std::unique_lock<std::mutex> lock(walk->mutex);
  walk->all_done.wait(lock, [&]() { return walk->done == walk->n_chunks; });
  if (walk->failed.load()) return ErrorText(&site, walk->error);
  return ffi::Error::Success();
}

// A native kernel call, with the checking mode for unwritten outputs around it.
ffi::Error RunNativeChecked(const NativeSite& site, size_t n_in, void* const* ins, size_t n_out,
                            void* const* outs, ffi::ThreadPool* pool) {
  const bool check = g_check_unwritten.load(std::memory_order_relaxed);
  if (check) FillSentinel(n_out, outs);
  ffi::Error result = RunNativeWalk(site, n_in, ins, n_out, outs, pool);
  if (result.success() && check) {
    std::string unwritten = FindUnwritten(n_out, outs);
    if (!unwritten.empty()) return ErrorText(&site, "native kernel: " + unwritten);
  }
  return result;
}

// A native kernel call (a walk, or one whole call), padding left out.
ffi::Error RunNative(const NativeSite& site, size_t n_in, void* const* ins, size_t n_out,
                     void* const* outs, ffi::ThreadPool* pool) {
  if (site.valid_levels != 0 && site.levels == 0) {  // (a walk skips padding itself)
    return RunNativeWholePadded(site, n_in, ins, n_out, outs, pool);
  }
  return RunNativeChecked(site, n_in, ins, n_out, outs, pool);
}

}  // namespace

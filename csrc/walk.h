// The walk of a batch: one call's plan and the loop over its elements, templates for both calls.
//
// The Python and the native call instantiate the loop with their per-element
// call; the plan is made in walk.cc.
#ifndef JAXBIND_CSRC_WALK_H_
#define JAXBIND_CSRC_WALK_H_

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "internal.h"

namespace {

// A few values on the stack, more on the heap: the per-call path allocates
// nothing for ops with up to 16 inputs and outputs, and a buffer of a call
// without a walk costs a pointer and a few zeros.
template <typename T>
class SmallBuffer {
 public:
  explicit SmallBuffer(size_t n) : heap_(n > kInline ? new T[n]() : nullptr) {
    data_ = heap_ ? heap_.get() : inline_;
    if (!heap_) std::fill(inline_, inline_ + n, T{});
  }
  T* data() { return data_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }

 private:
  static constexpr size_t kInline = 16;
  T inline_[kInline];
  std::unique_ptr<T[]> heap_;
  T* data_;
};

// The batch of one walked call: level sizes and per-level byte strides of
// every buffer, read off the buffers themselves.
struct WalkPlan {
  WalkPlan(size_t levels, size_t n_in, size_t n_out)
      : levels(levels),
        n_in(n_in),
        n_out(n_out),
        sizes(levels),
        in_strides(n_in * levels),
        out_strides(n_out * levels) {}
  size_t levels, n_in, n_out;
  int64_t total = 1;                 // number of elements
  SmallBuffer<int64_t> sizes;        // per level
  SmallBuffer<int64_t> in_strides;   // [input * levels + level], 0 = not mapped
  SmallBuffer<int64_t> out_strides;  // [output * levels + level]
  // A padded batch (the validity operand): input `valid_input` says which elements
  // are real; the others are not called and their outputs are zeroed.
  const char* valid = nullptr;  // the validity operand's data (null: no padding)
  size_t valid_input = 0;       // its index among the inputs (its offsets are in_off's)
  bool valid_wide = false;      // int64 rather than int32
  void* const* outs = nullptr;  // the outputs, for zeroing padding elements
};

int64_t DimStride(const XLA_FFI_Buffer* buf, int64_t dim);
std::string PlanWalk(const Site& site, void* const* ins, void* const* outs, WalkPlan* plan);
bool RealElement(const WalkPlan& plan, const int64_t* in_off);
void ZeroElement(const WalkPlan& plan, const int64_t* out_off);

// WalkRange's loop; `kPadded`: a padded batch, whose padding elements are
// zeroed instead of called (a separate instance, so that the walk of a batch
// without padding pays nothing for it).
template <bool kPadded, typename CallOnce>
bool WalkElements(const WalkPlan& plan, int64_t begin, int64_t end, CallOnce& call_once) {
  const size_t levels = plan.levels, n_in = plan.n_in, n_out = plan.n_out;
  SmallBuffer<int64_t> in_off(n_in), out_off(n_out);
  SmallBuffer<int64_t> index(levels);
  for (int64_t rest = begin, l = static_cast<int64_t>(levels) - 1; l >= 0; --l) {
    index[l] = rest % plan.sizes[l];
    rest /= plan.sizes[l];
    for (size_t i = 0; i < n_in; ++i) in_off[i] += index[l] * plan.in_strides[i * levels + l];
    for (size_t j = 0; j < n_out; ++j) out_off[j] += index[l] * plan.out_strides[j * levels + l];
  }
  for (int64_t e = begin; e < end; ++e) {
    if (kPadded && !RealElement(plan, in_off.data())) {
      ZeroElement(plan, out_off.data());  // padding: never reaches the callback
    } else if (!call_once(in_off.data(), out_off.data())) {
      return false;
    }
    for (size_t l = levels; l-- > 0;) {
      const int64_t back = ++index[l] < plan.sizes[l] ? 1 : -(plan.sizes[l] - 1);
      if (back < 0) index[l] = 0;
      for (size_t i = 0; i < n_in; ++i) in_off[i] += back * plan.in_strides[i * levels + l];
      for (size_t j = 0; j < n_out; ++j) out_off[j] += back * plan.out_strides[j * levels + l];
      if (back > 0) break;
    }
  }
  return true;
}

// The walk of a padded batch, kept out of line: it must not change how the
// compiler lays out the walk of a batch without padding (measured: inlined
// beside it, it made a Python walk 15% slower).
template <typename CallOnce>
JAXBIND_NOINLINE bool WalkPadded(const WalkPlan& plan, int64_t begin, int64_t end,
                                 CallOnce& call_once) {
  return WalkElements<true>(plan, begin, end, call_once);
}

// Calls `call_once(in_offsets, out_offsets)` for the elements [begin, end) of
// a walk, with the byte offsets of each element in every buffer (innermost
// level fastest); once with zero offsets when nothing is batched. Stops at a
// failure. Padding elements of a padded batch are not called.
template <typename CallOnce>
bool WalkRange(const WalkPlan& plan, int64_t begin, int64_t end, CallOnce&& call_once) {
  if (plan.levels == 0) {
    SmallBuffer<int64_t> in_off(plan.n_in), out_off(plan.n_out);
    return call_once(in_off.data(), out_off.data());
  }
  if (begin >= end) return true;  // (an empty batch has levels of size 0)
  if (plan.valid == nullptr) return WalkElements<false>(plan, begin, end, call_once);
  return WalkPadded(plan, begin, end, call_once);
}

// ---- Spreading a walk over XLA's thread pool --------------------------------

// It pays only for elements that take longer than waking a thread (tens of
// microseconds on this kind of machine): the first elements are timed, and the
// rest is split only when it is long.
constexpr double kParallelMinNs = 100e3;  // the rest of the walk, at least
constexpr double kChunkMinNs = 25e3;      // one chunk of elements, at least

// Runs elements 0 and 1 (`run(begin, end)` -> ok), timing each: the first may
// be slow for reasons of its own (cold caches, a first touch of the code), so
// the faster counts. False if either fails.
template <typename Run>
bool TimeFirstElements(Run&& run, double* element_ns) {
  for (int64_t e = 0; e < 2; ++e) {
    const auto start = std::chrono::steady_clock::now();
    if (!run(e, e + 1)) return false;
    const double ns =
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    *element_ns = e == 0 ? ns : std::min(*element_ns, ns);
  }
  return true;
}

// The elements [first, total) of a walk split into chunks that the calling
// thread and helpers on the pool claim one at a time. The caller waits only for
// chunks a thread has claimed, so it never depends on a helper being scheduled
// at all; a helper that starts late finds nothing to claim and touches nothing
// but this object, which it co-owns (a shared_ptr).
struct ChunkedWalk {
  int64_t first = 0, total = 0, chunk = 1, n_chunks = 0;  // chunk c: [first + c chunk, ...)
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::atomic<int64_t> helped{0};  // chunks claimed by helpers
  std::mutex mutex;
  std::condition_variable all_done;
  int64_t done = 0;   // guarded by mutex
  std::string error;  // the first failure, guarded by mutex

  // Chunks of [first, total) for `threads` pool threads and elements taking
  // `element_ns`; false when the rest is too short to be worth spreading.
  bool Plan(int64_t from, int64_t to, double element_ns, int64_t threads) {
    const int64_t rest = to - from;
    if (rest <= 0 || threads < 1 || element_ns * rest < kParallelMinNs) return false;
    first = from;
    total = to;
    // Several chunks per thread (8) keep the threads' shares even at the end
    // of the walk; none shorter than kChunkMinNs.
    const int64_t by_time = static_cast<int64_t>(kChunkMinNs / std::max(element_ns, 1.0)) + 1;
    const int64_t by_balance = (rest + 8 * (threads + 1) - 1) / (8 * (threads + 1));
    chunk = std::max<int64_t>(1, std::max(by_time, by_balance));
    n_chunks = (rest + chunk - 1) / chunk;
    return true;
  }

  // Every pool thread gets a helper, although the calling thread works too:
  // an idle pool thread spins looking for work, taking a core anyway
  // (measured: one helper fewer made a 2-core walk 20% slower).
  int64_t Helpers(int64_t threads) const { return std::min(threads, n_chunks - 1); }

  // Claims chunks until none is left: `run(begin, end, &why)` -> ok. A chunk
  // counts as done however `run` leaves (an exception, CPython ending the
  // thread), so that the caller's wait always ends. `helper`: counted in
  // `helped` (read by the caller once all chunks are done).
  template <typename Run>
  void Work(Run&& run, bool helper = false) {
    for (int64_t c; (c = next.fetch_add(1)) < n_chunks;) {
      if (helper) helped.fetch_add(1, std::memory_order_relaxed);
      struct Done {
        ChunkedWalk* walk;
        bool ok = false;
        std::string why = "a helper thread stopped";
        ~Done() {
          std::lock_guard<std::mutex> lock(walk->mutex);
          if (!ok && !walk->failed.exchange(true)) walk->error = why;
          if (++walk->done == walk->n_chunks) walk->all_done.notify_all();
        }
      } done_chunk{this};
      if (failed.load(std::memory_order_relaxed)) {
        done_chunk.ok = true;  // (another chunk's failure is the error)
        continue;
      }
      done_chunk.ok =
          run(first + c * chunk, std::min(total, first + (c + 1) * chunk), &done_chunk.why);
    }
  }

  bool AllDone() {
    std::lock_guard<std::mutex> lock(mutex);
    return done == n_chunks;
  }

  void Wait() {
    std::unique_lock<std::mutex> lock(mutex);
    all_done.wait(lock, [&]() { return done == n_chunks; });
  }
};

}  // namespace

#endif  // JAXBIND_CSRC_WALK_H_

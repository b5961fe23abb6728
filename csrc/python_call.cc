// The call of a Python callback: views in, the callback under the GIL, kept views refused.

#include "walk.h"

#if defined(__GLIBCXX__)
#include <cxxabi.h>  // abi::__forced_unwind: CPython ending a thread
#endif

namespace {

// Runs body() and returns what it returns. When CPython ends this thread inside
// it (it waited for the GIL while the interpreter finalized: see Shutdown), the
// unwinding is a libstdc++ abi::__forced_unwind: abandon() gives up what may not
// be dropped without the GIL, and the unwinding goes on. libc++ has no such type
// (there the holders' destructors ask EndedByPython instead).
template <typename Body, typename Abandon>
auto UnlessEndedByPython(Body&& body, Abandon&& abandon) -> decltype(body()) {
#if defined(__GLIBCXX__)
  try {
    return body();
  } catch (abi::__forced_unwind&) {
    abandon();
    throw;
  }
#else
  (void)abandon;
  return body();
#endif
}

// Builds (out, args) tuples of views for one batch element and calls the site.
// `in_offsets`/`out_offsets` are byte offsets into each buffer. On failure,
// `error` is the message of the error the call becomes.
bool CallOnce(const PythonSite& site, const PythonRefs& refs, const XLA_FFI_Args* args,
              const XLA_FFI_Rets* rets, const int64_t* in_offsets, const int64_t* out_offsets,
              int out_skip, std::string* error) {
  // The cached views are this call's only if no other call has them.
  const bool use_cache = ClaimViewCache(site);
  PyObject* in_tuple = ViewTuple(use_cache ? site.cached_in : nullptr, args->args, args->size,
                                 in_offsets, site, -1, /*writable=*/false);
  PyObject* out_tuple = ViewTuple(use_cache ? site.cached_out : nullptr, rets->rets, rets->size,
                                  out_offsets, site, out_skip, /*writable=*/true);
  bool ok = in_tuple != nullptr && out_tuple != nullptr;
  if (!ok) *error = MessageFromPython(site);
  bool kept = false;
  if (ok) {
    PyObject* argv[3] = {out_tuple, in_tuple, refs.kwargs_dump()};
    PyObject* result = PyObject_Vectorcall(refs.callable(), argv, 3, nullptr);
    if (result == nullptr) {
      *error = MessageFromPython(site, out_tuple);  // frees the frames of the traceback
      ok = false;
    } else if (result != Py_None) {
      PyObject* rtype = PyObject_Type(result);
      PyObject* rname = rtype ? PyObject_GetAttrString(rtype, "__name__") : nullptr;
      *error = "jaxbind " + site.name + ": the callback returned a value of type '" +
               PyUnicodeToString(rname) +
               "'; jaxbind callbacks must return None and write their results "
               "into the arrays of `out` (e.g. out[0][...] = result)";
      Py_XDECREF(rname);
      Py_XDECREF(rtype);
      PyErr_Clear();
      Py_DECREF(result);
      ok = false;
    }
    // The views point into memory XLA reuses after this call. A callback
    // that kept one would later read or write freed memory: refuse it.
    Py_ssize_t ours_in = 1 + (use_cache && in_tuple == site.cached_in);
    Py_ssize_t ours_out = 1 + (use_cache && out_tuple == site.cached_out);
    if ((Kept(in_tuple, ours_in) || Kept(out_tuple, ours_out)) &&
        KeptAfterCollecting(in_tuple, ours_in, out_tuple, ours_out)) {
      if (ok) {
        *error = "jaxbind " + site.name + ": the callback";
      } else {
        *error += "\n(Besides, the callback";
      }
      *error +=
          " kept a reference to one of its `out` or `args` arrays (or a view of one, or "
          "a weak reference) after returning; these arrays view memory that is only "
          "valid during the call, and the kept ones are now empty: store a copy "
          "instead (np.array(x))";
      if (!ok) *error += ")";
      ok = false;
      kept = true;
    }
  }
  const bool alive = site.alive.load();
  if (ok && use_cache && alive) {  // keep the views for the next call
    if (site.cached_in != in_tuple) std::swap(site.cached_in, in_tuple);
    if (site.cached_out != out_tuple) std::swap(site.cached_out, out_tuple);
  } else if (!ok) {
    // Someone may hold the views: cut them off XLA's memory, never reuse them.
    RetireViews(in_tuple, out_tuple, kept);
    if (use_cache && site.cached_in == in_tuple) Py_CLEAR(site.cached_in);
    if (use_cache && site.cached_out == out_tuple) Py_CLEAR(site.cached_out);
  }
  if (use_cache) {
    if (!alive) {  // released during the call: its cache goes with it
      Py_CLEAR(site.cached_in);
      Py_CLEAR(site.cached_out);
    }
    ReturnViewCache(site);
  }
  Py_XDECREF(in_tuple);
  Py_XDECREF(out_tuple);
  return ok;
}

// Walks of a site run on the calling thread alone after a spread walk that no
// helper could join (then one in kSerialAfterNoHelp + 1 walks tries again, so
// a body that releases the GIL only sometimes, or a pool busy for a while,
// gets its threads back).
constexpr int kSerialAfterNoHelp = 16;

// A walk of a thread-safe site spread over XLA's thread pool, as the native
// walk is: the calling thread and each helper take the GIL (a kept thread
// state per pool thread) and call the callback for the elements of the chunks
// they claim. Callbacks that release the GIL (NumPy on large arrays, SciPy's
// compiled routines, numba's nogil functions) then run side by side. Called
// with the GIL held and elements [0, 2) done; returns with the GIL held.
bool RunPythonParallel(const PythonSite& site, const PythonRefs& refs, const WalkPlan& plan,
                       const XLA_FFI_Args* callee, const XLA_FFI_Rets* rets,
                       std::shared_ptr<ChunkedWalk> walk, int64_t threads, ffi::ThreadPool* pool,
                       std::string* error) {
  const int out_skip = static_cast<int>(site.levels);
  // (The helpers use the dispatch's references: it waits for them below.)
  auto run = [&site, &refs, &plan, callee, rets, out_skip](int64_t begin, int64_t end,
                                                           std::string* why) {
    return WalkRange(plan, begin, end, [&](const int64_t* in_off, const int64_t* out_off) {
      return CallOnce(site, refs, callee, rets, in_off, out_off, out_skip, why);
    });
  };
  auto helper = [walk, run]() {
    if (walk->next.load() >= walk->n_chunks) return;  // started late: nothing left to claim
    GilHold gil;                                      // held until this thread has no chunk left
    if (!gil.held()) {
      walk->Work([](int64_t, int64_t, std::string* why) {
        *why = "the callback was not run: the Python interpreter is shutting down";
        return false;
      });
      return;
    }
    UnlessEndedByPython([&] { walk->Work(run, /*helper=*/true); }, [&] { gil.Abandon(); });
  };
  for (int64_t h = 0, helpers = walk->Helpers(threads); h < helpers; ++h)
    pool->Schedule([helper]() { helper(); });
  walk->Work(run);
  // The helpers need the GIL to finish the chunks they claimed; when this
  // thread did them all (bodies that hold the GIL), there is nothing to hand over.
  if (!walk->AllDone()) {
    Py_BEGIN_ALLOW_THREADS walk->Wait();
    Py_END_ALLOW_THREADS
  }
  // No helper got the GIL while this thread worked: the body holds it (or the
  // pool was busy), and spreading the next walks would only add a helper's GIL
  // round trip after each of them.
  if (walk->helped.load(std::memory_order_relaxed) == 0) {
    site.serial_walks.store(kSerialAfterNoHelp, std::memory_order_relaxed);
  }
  if (!walk->failed.load()) return true;
  *error = walk->error;
  return false;
}

// A Python callback over a whole call without a walk: the call of almost every
// op, kept apart from the walk's machinery (its plan, offsets and pool).
ffi::Error RunPythonOnce(const PythonSite& site, const PythonRefs& refs, const XLA_FFI_Args* args,
                         const XLA_FFI_Rets* rets) {
  const bool check = g_check_unwritten.load(std::memory_order_relaxed);
  if (check) FillSentinel(args->size, args->args, rets->size, rets->rets);
  std::string error;
  if (!CallOnce(site, refs, args, rets, /*in_offsets=*/nullptr, /*out_offsets=*/nullptr, 0,
                &error)) {
    return ffi::Error(ffi::ErrorCode::kInternal, ValidUtf8(error));
  }
  if (check) {
    std::string unwritten = FindUnwritten(args->size, args->args, rets->size, rets->rets);
    if (!unwritten.empty()) return ErrorText(&site, unwritten);
  }
  return ffi::Error::Success();
}

// A Python callback over a whole call: once, or once per element of a walk
// (spread over `pool` when the site is thread-safe and the walk is long).
ffi::Error RunPython(const PythonSite& site, const PythonRefs& refs, const XLA_FFI_Args* args,
                     const XLA_FFI_Rets* rets, ffi::ThreadPool* pool) {
  if (site.levels == 0) return RunPythonOnce(site, refs, args, rets);
  WalkPlan plan(site.levels, args->size, rets->size);
  std::string bad = PlanWalk(site, args->args, rets->rets, &plan);
  if (!bad.empty()) return ErrorText(&site, bad);
  const int out_skip = static_cast<int>(site.levels);
  // A walk over a padded batch: the validity operand (the last input) is the
  // walk's, not the callback's.
  XLA_FFI_Args trimmed = *args;
  trimmed.size -= 1;
  const XLA_FFI_Args* callee = plan.valid != nullptr ? &trimmed : args;
  const bool check = g_check_unwritten.load(std::memory_order_relaxed);
  if (check) FillSentinel(args->size, args->args, rets->size, rets->rets);
  std::string error;
  bool ok = false;
  auto call_range = [&](int64_t begin, int64_t end) {
    return WalkRange(plan, begin, end, [&](const int64_t* in_off, const int64_t* out_off) {
      return CallOnce(site, refs, callee, rets, in_off, out_off, out_skip, &error);
    });
  };
  const int64_t threads = site.thread_safe && pool != nullptr ? pool->num_threads() : 0;
  double element_ns = 0.0;
  if (threads > 0 && plan.total >= 2) {
    auto walk = std::make_shared<ChunkedWalk>();
    ok = TimeFirstElements(call_range, &element_ns);
    int serial = site.serial_walks.load(std::memory_order_relaxed);
    if (serial > 0) site.serial_walks.store(serial - 1, std::memory_order_relaxed);
    if (g_spread_walks.load(std::memory_order_relaxed)) {
      serial = 0;
      element_ns = std::max(element_ns, kParallelMinNs);  // (chunks of a few elements: see Plan)
    }
    if (ok && serial <= 0 && walk->Plan(2, plan.total, element_ns, threads)) {
      ok = RunPythonParallel(site, refs, plan, callee, rets, walk, threads, pool, &error);
    } else if (ok) {
      ok = call_range(2, plan.total);
    }
  } else {
    ok = call_range(0, plan.total);
  }
  if (ok && check) {
    std::string unwritten = FindUnwritten(args->size, args->args, rets->size, rets->rets);
    if (!unwritten.empty()) return ErrorText(&site, unwritten);
  }
  if (ok) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, ValidUtf8(error));
}

ffi::Error CallPython(const PythonSite* site, int64_t key, std::string_view call,
                      const XLA_FFI_Args* args, const XLA_FFI_Rets* rets, ffi::ThreadPool* pool) {
  GilHold gil;
  if (!gil.held()) {
    return ErrorText(site, "the callback was not run: the Python interpreter is shutting down");
  }
  PythonRefs refs;  // (declared after the GIL's holder: dropped while it still holds the GIL)
  std::string why;
  site = HoldPythonSite(site, key, call, &refs, &why);
  if (site == nullptr) return ffi::Error(ffi::ErrorCode::kInvalidArgument, why);
  return UnlessEndedByPython(
      [&] {
        return site->valid_levels != 0 && site->levels == 0
                   ? RunPythonWholePadded(*site, refs, args, rets)
                   : RunPython(*site, refs, args, rets, pool);
      },
      [&] {
        refs.Abandon();
        gil.Abandon();
      });
}

}  // namespace

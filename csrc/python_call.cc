// The call of a Python callback: views in, the callback under the GIL, kept views refused.

#include "walk.h"

#if defined(__GLIBCXX__)
#include <cxxabi.h>  // abi::__forced_unwind: CPython ending a thread
#endif

namespace {

// Builds (out, args) tuples of views for one batch element and calls the site.
// `in_offsets`/`out_offsets` are byte offsets into each buffer. On failure,
// `error` is the message of the error the call becomes.
bool CallOnce(const PythonSite& site, const XLA_FFI_Args* args, const XLA_FFI_Rets* rets,
              const int64_t* in_offsets, const int64_t* out_offsets,
              int out_skip, std::string* error) {
  if (site.callable == nullptr) {  // released while a walk ran (its op was freed meanwhile)
    *error = "jaxbind " + site.name + ": the op was freed while the program called it";
    return false;
  }
  const bool use_cache = !site.cache_busy;
  PyObject* in_tuple = ViewTuple(use_cache ? site.cached_in : nullptr, args->args, args->size,
                                 in_offsets, site, -1, /*writable=*/false);
  PyObject* out_tuple = ViewTuple(use_cache ? site.cached_out : nullptr, rets->rets, rets->size,
                                  out_offsets, site, out_skip, /*writable=*/true);
  bool ok = in_tuple != nullptr && out_tuple != nullptr;
  if (!ok) *error = MessageFromPython(site);
  bool kept = false;
  if (ok) {
    // A re-entrant or overlapping call (another thread, while this callback
    // released the GIL) makes its own views; only the cache's user frees it.
    if (use_cache) site.cache_busy = true;
    // Held for the call: the site may be released meanwhile (by the callback, or
    // by another thread while the callback released the GIL).
    PyObject* callable = site.callable;
    PyObject* kwargs_dump = site.kwargs_dump;
    Py_INCREF(callable);
    Py_INCREF(kwargs_dump);
    PyObject* argv[3] = {out_tuple, in_tuple, kwargs_dump};
    PyObject* result = PyObject_Vectorcall(callable, argv, 3, nullptr);
    Py_DECREF(kwargs_dump);
    Py_DECREF(callable);
    if (use_cache) site.cache_busy = false;
    if (result == nullptr) {
      *error = MessageFromPython(site);  // frees the frames of the traceback
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
    Py_ssize_t ours_in = 1 + (in_tuple == site.cached_in);
    Py_ssize_t ours_out = 1 + (out_tuple == site.cached_out);
    if ((Kept(in_tuple, ours_in) || Kept(out_tuple, ours_out)) &&
        KeptAfterCollecting(in_tuple, ours_in, out_tuple, ours_out)) {
      if (ok) {
        *error = "jaxbind " + site.name + ": the callback";
      } else {
        *error += "\n(Besides, the callback";
      }
      *error += " kept a reference to one of its `out` or `args` arrays (or a view of one, or "
                "a weak reference) after returning; these arrays view memory that is only "
                "valid during the call, and the kept ones are now empty: store a copy "
                "instead (np.array(x))";
      if (!ok) *error += ")";
      ok = false;
      kept = true;
    }
  }
  if (ok && use_cache && site.callable != nullptr) {  // keep the views for the next call
    if (site.cached_in != in_tuple) std::swap(site.cached_in, in_tuple);
    if (site.cached_out != out_tuple) std::swap(site.cached_out, out_tuple);
  } else if (!ok) {
    // Someone may hold the views: cut them off XLA's memory, never reuse them.
    RetireViews(in_tuple, out_tuple, kept);
    if (site.cached_in == in_tuple) Py_CLEAR(site.cached_in);
    if (site.cached_out == out_tuple) Py_CLEAR(site.cached_out);
  }
  if (site.callable == nullptr) {  // released during the call: its cache goes with it
    Py_CLEAR(site.cached_in);
    Py_CLEAR(site.cached_out);
  }
  Py_XDECREF(in_tuple);
  Py_XDECREF(out_tuple);
  return ok;
}

// A Python callback over a whole call: once, or once per element of a walk.
ffi::Error RunPython(const PythonSite& site, const XLA_FFI_Args* args, const XLA_FFI_Rets* rets) {
  WalkPlan plan(site.levels, args->size, rets->size);
  if (site.levels != 0) {
    std::string bad = PlanWalk(site, args->args, rets->rets, &plan);
    if (!bad.empty()) return ErrorText(&site, bad);
  }
  const int out_skip = static_cast<int>(site.levels);
  // A walk over a padded batch: the validity operand (the last input) is the
  // walk's, not the callback's.
  XLA_FFI_Args trimmed = *args;
  trimmed.size -= 1;
  const XLA_FFI_Args* callee = plan.valid != nullptr ? &trimmed : args;
  GilHold gil;
  if (!gil.held()) {
    return ErrorText(&site, "the callback was not run: the Python interpreter is shutting down");
  }
  const bool check = g_check_unwritten.load(std::memory_order_relaxed);
  if (check) FillSentinel(rets->size, rets->rets);
  std::string error;
  bool ok = false;
#if defined(__GLIBCXX__)
  try {
#endif
    ok = WalkRange(plan, 0, plan.total, [&](const int64_t* in_off, const int64_t* out_off) {
      return CallOnce(site, callee, rets, in_off, out_off, out_skip, &error);
    });
#if defined(__GLIBCXX__)
  } catch (abi::__forced_unwind&) {
    gil.Abandon();  // CPython ends this thread: Python is finalizing (see Shutdown)
    throw;
  }
#endif
  if (ok && check) {
    std::string unwritten = FindUnwritten(rets->size, rets->rets);
    if (!unwritten.empty()) return ErrorText(&site, unwritten);
  }
  if (ok) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInternal, error);
}

}  // namespace

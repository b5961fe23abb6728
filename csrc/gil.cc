// The GIL from any thread, and the shutdown that keeps XLA's threads out of a finalizing Python.

#include "internal.h"

#include <chrono>
#include <thread>

namespace {

// Python callbacks that are running or waiting for the GIL, and whether the
// interpreter is shutting down. jaxbind's atexit hook sets the flag and waits
// for the running callbacks, so that no XLA thread takes the GIL once Python
// finalizes: CPython ends a thread that waits for the GIL then, and a guard
// that released a GIL it no longer holds would abort the process.
std::atomic<int64_t> g_python_calls{0};
std::atomic<bool> g_shutting_down{false};
std::atomic<unsigned long> g_exiting_thread{0};  // runs the exit hooks, then finalizes

bool PythonFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// XLA calls handlers on the Python thread that launched the program or on its
// own worker threads, which have no Python thread state. PyGILState_Ensure and
// Release would create and destroy a thread state on every call there; instead
// each thread gets one thread state, made on first use and kept.
// `inline` as when the class body held it: without, the per-call path calls it.
inline GilHold::GilHold() {
  g_python_calls.fetch_add(1);  // sequentially consistent with Shutdown's flag
  if (!Py_IsInitialized() || PythonFinalizing()) return;
  // After the exit hook only the exiting thread (CPython never ends it) may
  // still run callbacks, e.g. from later exit hooks.
  if (g_shutting_down.load() && PyThread_get_thread_ident() != g_exiting_thread.load()) return;
  held_ = true;
  if (PyGILState_Check()) return;  // this thread holds the GIL already
  PyThreadState* ts = PyGILState_GetThisThreadState();
  if (ts == nullptr) {
    // Bound to this OS thread as its GILState thread state, so the next call
    // finds it through PyGILState_GetThisThreadState.
    ts = PyThreadState_New(PyInterpreterState_Main());
  }
  PyEval_RestoreThread(ts);
  acquired_ = true;
}

inline GilHold::~GilHold() {
  if (acquired_) PyEval_SaveThread();
  g_python_calls.fetch_sub(1);
}

// Refuses new Python callbacks and waits up to `timeout` seconds for the
// running ones; called (with the GIL) by jaxbind's atexit hook. Returns how
// many callbacks were still running.
int64_t Shutdown(double timeout) {
  g_exiting_thread.store(PyThread_get_thread_ident());
  g_shutting_down.store(true);
  PyThreadState* state = PyEval_SaveThread();  // let running callbacks finish
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
  while (g_python_calls.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const int64_t running = g_python_calls.load();
  PyEval_RestoreThread(state);
  return running;
}

}  // namespace

// The GIL from any thread, and the shutdown that keeps XLA's threads out of a finalizing Python.

#include <chrono>
#include <thread>

#include "internal.h"

namespace {

// Python callbacks that are running or waiting for the GIL, and whether the
// interpreter is shutting down. jaxbind's atexit hook sets the flag and waits
// for the running callbacks, so that no XLA thread takes the GIL once Python
// finalizes: CPython ends a thread that waits for the GIL then, and a guard
// that released a GIL it no longer holds would abort the process.
std::atomic<int64_t> g_python_calls{0};
std::atomic<bool> g_shutting_down{false};
std::atomic<unsigned long> g_exiting_thread{0};  // runs the exit hooks, then finalizes
// The thread states GilHold made for XLA's threads, kept for the life of the process.
std::mutex g_kept_states_mutex;
std::vector<PyThreadState*> g_kept_states;

bool PythonFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// A thread that holds the GIL cannot find the interpreter finalizing, but for
// the thread that finalizes it: any other that does is being ended by CPython.
#if !defined(__GLIBCXX__)
// (The exit hook sets g_shutting_down before the interpreter finalizes: the
// per-call path of a libc++ build pays one relaxed load, not a call into Python.)
bool EndedByPython() {
  return g_shutting_down.load(std::memory_order_relaxed) && PythonFinalizing() &&
         PyThread_get_thread_ident() != g_exiting_thread.load();
}
#endif

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
    std::lock_guard<std::mutex> lock(g_kept_states_mutex);
    g_kept_states.push_back(ts);
  }
  PyEval_RestoreThread(ts);
  acquired_ = true;
}

inline GilHold::~GilHold() {
#if !defined(__GLIBCXX__)
  if (acquired_ && EndedByPython()) acquired_ = false;  // (see EndedByPython) no GIL to release
#endif
  if (acquired_) PyEval_SaveThread();
  g_python_calls.fetch_sub(1);
}

// The per-thread dicts of the kept thread states (threading.local values, and
// the tables C extensions keep there) are set aside, never destroyed. CPython
// would clear those thread states late in finalization, on the main thread,
// with modules half torn down: a library's thread-local destructor then runs
// where it was never meant to (SciPy's SuperLU table of allocations left a
// TypeError behind it, and the process ended with status 120), or frees memory
// that objects still alive elsewhere use. Set aside, they live to the end of
// the process like the state of a thread still running at exit. Called with
// the GIL, once no callback runs on any of those threads.
void SetAsideThreadLocals() {
  std::lock_guard<std::mutex> lock(g_kept_states_mutex);
  for (PyThreadState* ts : g_kept_states) {
    if (ts != PyThreadState_Get()) ts->dict = nullptr;  // (its reference is kept: never freed)
  }
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
  if (running == 0) SetAsideThreadLocals();
  return running;
}

// Takes a reference that is never given back: `obj` lives until the process
// ends. For the exit hook, when a callback outlived its wait: since CPython
// 3.13.8 (gh-87135) a thread that tries to take the interpreter back once it
// finalizes is parked for ever, and a parked XLA worker must never meet the
// teardown of the client that owns its pool, which joins it (on the
// free-threaded build the final collection destroys jaxlib's CPU client: the
// process hung at exit).
void KeepForever(nb::handle obj) { obj.inc_ref(); }

}  // namespace

// The XLA custom-call trampoline: moves XLA's buffers into registered callables.
//
// One typed-FFI handler serves every jaxbind op. The compiled program carries a
// single integer attribute, `site`, that indexes the registry below; the entry
// says which callable to run, with which serialized kwargs, and how to walk a
// batch. The handler knows no calculus: jvp, transpose and batching rules live
// in Python and only decide which site a custom call names.

#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <chrono>
#include <condition_variable>
#include <optional>
#include <cstdint>
#include <thread>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#if defined(__GLIBCXX__)
#include <cxxabi.h>  // abi::__forced_unwind: CPython ending a thread
#endif

#include "jaxbind.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

static_assert(sizeof(npy_intp) == sizeof(int64_t),
              "XLA dimensions are handed to NumPy without conversion");

namespace {

// ---------------------------------------------------------------------------
// Registry of call sites.
// ---------------------------------------------------------------------------

// A kwarg of a native kernel with the storage its pointers point into.
struct NativeKwarg {
  std::string name;
  int64_t type = 0;
  int64_t int_value = 0;
  double float_value = 0.0;
  std::string string_value;
  std::vector<int64_t> int_array;
  std::vector<double> float_array;
};

// One compiled custom call: a callable plus everything that is static about it.
struct Site {
  std::string name;      // e.g. "op 'scale' (transpose callback 'scale_T')", for errors
  // A Python callback (strong references, owned for the process lifetime)...
  PyObject* callable = nullptr;
  PyObject* kwargs_dump = nullptr;  // bytes, handed to every call unchanged
  // ...or a native kernel and its kwargs (pointers into native_storage).
  jaxbind_kernel native = nullptr;
  std::vector<NativeKwarg> native_storage;
  std::vector<jaxbind_kwarg> native_kwargs;
  // The (args, out) tuples of views from the last call, reused while nobody
  // else holds them (guarded by the GIL).
  mutable PyObject* cached_in = nullptr;
  mutable PyObject* cached_out = nullptr;
  mutable bool cache_busy = false;
  // Batch walk (levels == 0 when the callable sees the whole arrays). Only
  // which input is mapped at which level is static: sizes and strides are
  // read off the buffers of each call, since XLA may hand a partitioned call
  // a piece of the batch.
  size_t levels = 0;
  std::vector<std::vector<char>> in_masks;  // per input, per level (outermost first)
  std::vector<int> in_mapped;               // leading dims of each input that are levels
  // A partitioned batch that XLA may pad: when not 0, the last input is the
  // validity operand (made by _validity in jaxbind/_primitive.py) and every
  // array has this many batch levels in front (equal to `levels` for a walk;
  // a whole call has levels 0).
  size_t valid_levels = 0;
};

// Sites are published lock-free to XLA threads: a fixed table of chunks, each
// chunk a fixed array of atomic pointers. Entries are never removed, so a
// pointer read once stays valid.
constexpr int64_t kChunkBits = 10;
constexpr int64_t kChunkSize = int64_t{1} << kChunkBits;
constexpr int64_t kNumChunks = 4096;  // up to 4M sites

struct Chunk {
  std::atomic<Site*> entries[kChunkSize];
};

std::atomic<Chunk*> g_chunks[kNumChunks];
std::atomic<int64_t> g_num_sites{0};
std::mutex g_register_mutex;

int64_t PublishSite(std::unique_ptr<Site> site) {
  std::lock_guard<std::mutex> lock(g_register_mutex);
  int64_t id = g_num_sites.load(std::memory_order_relaxed);
  int64_t chunk = id >> kChunkBits;
  if (chunk >= kNumChunks) {
    throw std::runtime_error("jaxbind: too many distinct compiled call sites");
  }
  Chunk* c = g_chunks[chunk].load(std::memory_order_relaxed);
  if (c == nullptr) {
    c = new Chunk();
    for (auto& e : c->entries) e.store(nullptr, std::memory_order_relaxed);
    g_chunks[chunk].store(c, std::memory_order_release);
  }
  c->entries[id & (kChunkSize - 1)].store(site.release(),
                                          std::memory_order_release);
  g_num_sites.store(id + 1, std::memory_order_release);
  return id;
}

// A random number of this process, compiled into every program beside the
// site id: a program made in another process (e.g. by jax.export) names ids
// of that process, and must be refused rather than call whatever has that id here.
const int64_t g_session = []() {
  std::random_device device;
  return static_cast<int64_t>((uint64_t{device()} << 32) ^ device()) & INT64_MAX;
}();

const Site* LookupSite(int64_t session, int64_t id) {
  if (session != g_session || id < 0 || id >= g_num_sites.load(std::memory_order_acquire)) {
    return nullptr;
  }
  Chunk* c = g_chunks[id >> kChunkBits].load(std::memory_order_acquire);
  if (c == nullptr) return nullptr;
  return c->entries[id & (kChunkSize - 1)].load(std::memory_order_acquire);
}

// ---------------------------------------------------------------------------
// Python-side tables, set once at import.
// ---------------------------------------------------------------------------

// NumPy dtype for each XLA_FFI_DataType code (nullptr = not supported).
constexpr int kNumDtypeCodes = 64;
PyArray_Descr* g_descr[kNumDtypeCodes] = {};
// Turns (op name, exception) into the message an error carries.
PyObject* g_format_error = nullptr;

// Bytes per element for each XLA_FFI_DataType code (0 = not supported).
int64_t g_itemsize[kNumDtypeCodes] = {};
// Where views of zero-size buffers point (see ElementData).
alignas(64) char g_empty_storage[64];

// ---------------------------------------------------------------------------
// The GIL, from any thread.
// ---------------------------------------------------------------------------

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
// `held()` is false when Python is shutting down: the caller must then not
// touch Python at all, and returns an error result instead.
class GilHold {
 public:
  GilHold() {
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
  ~GilHold() {
    if (acquired_) PyEval_SaveThread();
    g_python_calls.fetch_sub(1);
  }
  bool held() const { return held_; }
  // CPython is ending this thread from inside the callback (it waited for the
  // GIL while the interpreter finalized): it holds no GIL to release.
  void Abandon() { acquired_ = false; }
  GilHold(const GilHold&) = delete;
  GilHold& operator=(const GilHold&) = delete;

 private:
  bool held_ = false;
  bool acquired_ = false;
};

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

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

std::string PyUnicodeToString(PyObject* s) {
  if (s == nullptr || !PyUnicode_Check(s)) return std::string();
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(s, &size);
  if (data == nullptr) {
    PyErr_Clear();
    return std::string();
  }
  return std::string(data, size);
}

// Consumes the pending Python exception (dropping its traceback, and so the
// callback's frames) and returns the message of the error it becomes.
std::string MessageFromPython(const Site& site) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr && value != nullptr) PyException_SetTraceback(value, tb);
  std::string message;
  if (g_format_error != nullptr && value != nullptr) {
    PyObject* name = PyUnicode_FromStringAndSize(site.name.data(), site.name.size());
    PyObject* text = name ? PyObject_CallFunctionObjArgs(g_format_error, name, value, nullptr)
                          : nullptr;
    message = PyUnicodeToString(text);
    Py_XDECREF(text);
    Py_XDECREF(name);
    PyErr_Clear();
  }
  if (message.empty()) {
    message = "jaxbind " + site.name + ": the callback raised an exception";
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return message;
}

ffi::Error ErrorText(const Site* site, const std::string& what) {
  std::string name = site ? site->name : std::string("op '?'");
  return ffi::Error(ffi::ErrorCode::kInternal, "jaxbind " + name + ": " + what);
}

// ---------------------------------------------------------------------------
// Array views
// ---------------------------------------------------------------------------

// The first byte of one batch element of a buffer. Zero-size buffers may come
// with a null data pointer, which NumPy would take as "allocate": point those
// at a small static block instead.
char* ElementData(void* buffer, int64_t offset) {
  char* data = static_cast<char*>(static_cast<XLA_FFI_Buffer*>(buffer)->data);
  return data != nullptr ? data + offset : g_empty_storage;
}

// How many leading dimensions of input `i` are batch levels the handler walks.
int InputSkip(const Site& site, size_t i) {
  return site.in_mapped.empty() ? 0 : site.in_mapped[i];
}

// A NumPy array over XLA's memory (`data`, never null): no copy, read-only for inputs.
PyObject* MakeView(const XLA_FFI_Buffer* buf, char* data, int skip_dims,
                   bool writable) {
  unsigned code = static_cast<unsigned>(buf->dtype);
  PyArray_Descr* descr = code < kNumDtypeCodes ? g_descr[code] : nullptr;
  if (descr == nullptr) {
    PyErr_Format(PyExc_TypeError, "XLA dtype code %u has no NumPy equivalent", code);
    return nullptr;
  }
  int nd = static_cast<int>(buf->rank) - skip_dims;
  npy_intp* dims = reinterpret_cast<npy_intp*>(buf->dims + skip_dims);
  Py_INCREF(descr);  // stolen by the constructor
  return PyArray_NewFromDescr(&PyArray_Type, descr, nd, dims, nullptr, data,
                              writable ? NPY_ARRAY_WRITEABLE : 0, nullptr);
}

// Whether a cached view can describe `buf` from `skip` dims on: nobody else
// holds it, and its shape, dtype, layout and writability are as made.
bool Reusable(PyObject* view, const XLA_FFI_Buffer* buf, int skip, bool writable) {
  auto* array = reinterpret_cast<PyArrayObject*>(view);
  const int nd = static_cast<int>(buf->rank) - skip;
  const unsigned code = static_cast<unsigned>(buf->dtype);
  if (Py_REFCNT(view) != 1 || PyArray_NDIM(array) != nd || code >= kNumDtypeCodes ||
      PyArray_DESCR(array) != g_descr[code] || !PyArray_IS_C_CONTIGUOUS(array) ||
      PyArray_ISWRITEABLE(array) != writable) {
    return false;
  }
  const npy_intp* dims = PyArray_DIMS(array);
  for (int d = 0; d < nd; ++d) {
    if (dims[d] != buf->dims[skip + d]) return false;
  }
  return true;
}

// A tuple of views of `n` buffers at byte offsets: the cached tuple re-pointed
// when it can be, else a new one. Returns a new reference or null.
PyObject* ViewTuple(PyObject* cached, void* const* buffers, int64_t n, const int64_t* offsets,
                    const Site& site, int fixed_skip, bool writable) {
  auto skip_of = [&](int64_t i) { return fixed_skip >= 0 ? fixed_skip : InputSkip(site, i); };
  bool reuse = cached != nullptr && Py_REFCNT(cached) == 1 && PyTuple_GET_SIZE(cached) == n;
  for (int64_t i = 0; reuse && i < n; ++i) {
    reuse = Reusable(PyTuple_GET_ITEM(cached, i), static_cast<XLA_FFI_Buffer*>(buffers[i]),
                     skip_of(i), writable);
  }
  if (reuse) {
    for (int64_t i = 0; i < n; ++i) {
      // The array owns nothing and nobody else sees it: moving its data
      // pointer is the same as making a new view, without the allocation.
      reinterpret_cast<PyArrayObject_fields*>(PyTuple_GET_ITEM(cached, i))->data =
          ElementData(buffers[i], offsets[i]);
    }
    Py_INCREF(cached);
    return cached;
  }
  PyObject* tuple = PyTuple_New(n);
  for (int64_t i = 0; tuple != nullptr && i < n; ++i) {
    PyObject* view = MakeView(static_cast<XLA_FFI_Buffer*>(buffers[i]),
                              ElementData(buffers[i], offsets[i]), skip_of(i), writable);
    if (view == nullptr) {
      Py_CLEAR(tuple);
    } else {
      PyTuple_SET_ITEM(tuple, i, view);
    }
  }
  return tuple;
}

// Whether a view is reachable from anything but its tuple: a strong reference
// (a derived view such as a slice holds one to it) or a live weak reference.
bool ViewKept(PyObject* view) {
  return Py_REFCNT(view) != 1 ||
         reinterpret_cast<PyArrayObject_fields*>(view)->weakreflist != nullptr;
}

// Whether anything besides us (and the cache) holds a tuple or one of its views.
bool Kept(PyObject* tuple, Py_ssize_t ours) {
  if (Py_REFCNT(tuple) != ours) return true;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); ++i) {
    if (ViewKept(PyTuple_GET_ITEM(tuple, i))) return true;
  }
  return false;
}

// Where retired 0-d views point: scratch nobody reads.
alignas(64) char g_retired_storage[64];

// Cuts an array off the memory it views: it becomes empty (0-d: a scratch
// element) and read-only, so that whoever kept it can never reach XLA's memory.
void Retire(PyObject* array) {
  auto* fields = reinterpret_cast<PyArrayObject_fields*>(array);
  fields->data = fields->nd > 0 ? g_empty_storage : g_retired_storage;
  for (int d = 0; d < fields->nd; ++d) fields->dimensions[d] = 0;
  PyArray_CLEARFLAGS(reinterpret_cast<PyArrayObject*>(array), NPY_ARRAY_WRITEABLE);
  PyArray_UpdateFlags(reinterpret_cast<PyArrayObject*>(array), NPY_ARRAY_UPDATE_ALL);
}

// Whether anything besides us holds the views once unreachable garbage is
// gone. Callbacks that hand a closure over a view to a solver (SciPy's root,
// solve_ivp), to JAX or to numba leave it in reference cycles that nobody can
// reach but the collector has not freed yet: that is not keeping it. The
// youngest generation holds what the call made unless a collection ran during
// it, so it is collected first; an older one only while something still holds
// a view. Only a call whose views look kept pays; a callback that keeps
// nothing never gets here. Returns true if a view is still held.
bool KeptAfterCollecting(PyObject* in_tuple, Py_ssize_t ours_in, PyObject* out_tuple,
                         Py_ssize_t ours_out) {
  static PyObject* collect = nullptr;  // gc.collect, looked up once (the GIL is held)
  if (collect == nullptr) {
    PyObject* gc = PyImport_ImportModule("gc");
    collect = gc != nullptr ? PyObject_GetAttrString(gc, "collect") : nullptr;
    Py_XDECREF(gc);
  }
  for (long generation = 0; collect != nullptr && generation <= 2; ++generation) {
    PyObject* arg = PyLong_FromLong(generation);
    PyObject* result = arg != nullptr ? PyObject_CallOneArg(collect, arg) : nullptr;
    Py_XDECREF(arg);
    Py_XDECREF(result);
    PyErr_Clear();  // a failing finalizer is not the callback's error
    if (!Kept(in_tuple, ours_in) && !Kept(out_tuple, ours_out)) return false;
  }
  return true;
}

// Finds and cuts off every other array that reaches the memory of kept views
// (slices, DLPack imports, memoryviews); set once at import. Called with a
// list of the views before they are retired, so that it can read their memory.
PyObject* g_retire_aliases = nullptr;

// Retires every view of the tuples (null entries are skipped); with `aliases`,
// first whatever else reaches the memory of a view that someone still holds.
void RetireViews(PyObject* in_tuple, PyObject* out_tuple, bool aliases) {
  PyObject* held = aliases ? PyList_New(0) : nullptr;
  for (PyObject* tuple : {in_tuple, out_tuple}) {
    for (Py_ssize_t i = 0; held != nullptr && tuple != nullptr && i < PyTuple_GET_SIZE(tuple); ++i) {
      PyObject* view = PyTuple_GET_ITEM(tuple, i);
      if (ViewKept(view)) PyList_Append(held, view);
    }
  }
  if (held != nullptr && PyList_GET_SIZE(held) > 0 && g_retire_aliases != nullptr) {
    PyObject* result = PyObject_CallOneArg(g_retire_aliases, held);
    Py_XDECREF(result);
  }
  Py_XDECREF(held);
  for (PyObject* tuple : {in_tuple, out_tuple}) {
    for (Py_ssize_t i = 0; tuple != nullptr && i < PyTuple_GET_SIZE(tuple); ++i) {
      Retire(PyTuple_GET_ITEM(tuple, i));
    }
  }
  PyErr_Clear();
}

// Builds (out, args) tuples of views for one batch element and calls the site.
// `in_offsets`/`out_offsets` are byte offsets into each buffer. On failure,
// `error` is the message of the error the call becomes.
bool CallOnce(const Site& site, const XLA_FFI_Args* args, const XLA_FFI_Rets* rets,
              const int64_t* in_offsets, const int64_t* out_offsets,
              int out_skip, std::string* error) {
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
    PyObject* argv[3] = {out_tuple, in_tuple, site.kwargs_dump};
    PyObject* result = PyObject_Vectorcall(site.callable, argv, 3, nullptr);
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
  if (ok && use_cache) {  // keep the views for the next call
    if (site.cached_in != in_tuple) std::swap(site.cached_in, in_tuple);
    if (site.cached_out != out_tuple) std::swap(site.cached_out, out_tuple);
  } else if (!ok) {
    // Someone may hold the views: cut them off XLA's memory, never reuse them.
    RetireViews(in_tuple, out_tuple, kept);
    if (site.cached_in == in_tuple) Py_CLEAR(site.cached_in);
    if (site.cached_out == out_tuple) Py_CLEAR(site.cached_out);
  }
  Py_XDECREF(in_tuple);
  Py_XDECREF(out_tuple);
  return ok;
}

// A few values on the stack, more on the heap: the per-call path allocates
// nothing for ops with up to 16 inputs and outputs.
template <typename T>
class SmallBuffer {
 public:
  explicit SmallBuffer(size_t n) : heap_(n > kInline ? n : 0) {
    data_ = n > kInline ? heap_.data() : inline_;
    for (size_t i = 0; i < n; ++i) data_[i] = T{};
  }
  T* data() { return data_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }

 private:
  static constexpr size_t kInline = 16;
  T inline_[kInline];
  std::vector<T> heap_;
  T* data_;
};

// The batch of one walked call: level sizes and per-level byte strides of
// every buffer, read off the buffers themselves.
struct WalkPlan {
  WalkPlan(size_t levels, size_t n_in, size_t n_out)
      : levels(levels), n_in(n_in), n_out(n_out), sizes(levels),
        in_strides(n_in * levels), out_strides(n_out * levels) {}
  size_t levels, n_in, n_out;
  int64_t total = 1;                 // number of elements
  SmallBuffer<int64_t> sizes;        // per level
  SmallBuffer<int64_t> in_strides;   // [input * levels + level], 0 = not mapped
  SmallBuffer<int64_t> out_strides;  // [output * levels + level]
  // A padded batch (the validity operand): input `valid_input` says which elements
  // are real; the others are not called and their outputs are zeroed.
  const char* valid = nullptr;   // the validity operand's data (null: no padding)
  size_t valid_input = 0;        // its index among the inputs (its offsets are in_off's)
  bool valid_wide = false;       // int64 rather than int32
  void* const* outs = nullptr;   // the outputs, for zeroing padding elements
};

// Byte stride of dimension `dim` of a dense row-major buffer.
int64_t DimStride(const XLA_FFI_Buffer* buf, int64_t dim) {
  unsigned code = static_cast<unsigned>(buf->dtype);
  int64_t stride = code < kNumDtypeCodes ? g_itemsize[code] : 0;
  for (int64_t d = dim + 1; d < buf->rank; ++d) stride *= buf->dims[d];
  return stride;
}

// Fills `plan` from the buffers; an error (never a walk past a buffer's end)
// when their leading dimensions disagree with each other or with the site.
std::string PlanWalk(const Site& site, void* const* ins, void* const* outs, WalkPlan* plan) {
  const size_t levels = plan->levels;
  if (plan->n_out == 0) return "internal error: a batched call without outputs";
  // Every output carries every level in front: the sizes come from the first.
  const auto* first = static_cast<const XLA_FFI_Buffer*>(outs[0]);
  if (first->rank < static_cast<int64_t>(levels)) {
    return "internal error: output 0 has fewer dimensions than batch levels";
  }
  for (size_t l = 0; l < levels; ++l) {
    plan->sizes[l] = first->dims[l];
    plan->total *= first->dims[l];
  }
  for (size_t j = 0; j < plan->n_out; ++j) {
    const auto* buf = static_cast<const XLA_FFI_Buffer*>(outs[j]);
    for (size_t l = 0; l < levels; ++l) {
      if (buf->rank < static_cast<int64_t>(levels) || buf->dims[l] != plan->sizes[l]) {
        return "internal error: the batch dimensions of output " + std::to_string(j) +
               " differ from those of output 0";
      }
      plan->out_strides[j * levels + l] = DimStride(buf, l);
    }
  }
  for (size_t i = 0; i < plan->n_in; ++i) {
    const auto* buf = static_cast<const XLA_FFI_Buffer*>(ins[i]);
    int64_t dim = 0;
    for (size_t l = 0; l < levels; ++l) {
      int64_t stride = 0;
      if (site.in_masks[i][l]) {
        if (dim >= buf->rank || buf->dims[dim] != plan->sizes[l]) {
          return "internal error: the batch dimensions of input " + std::to_string(i) +
                 " differ from those of the outputs";
        }
        stride = DimStride(buf, dim++);
      }
      plan->in_strides[i * levels + l] = stride;
    }
  }
  if (site.valid_levels != 0) {
    const size_t v = plan->n_in - 1;
    const auto* buf = static_cast<const XLA_FFI_Buffer*>(ins[v]);
    if (buf->dtype != XLA_FFI_DataType_S32 && buf->dtype != XLA_FFI_DataType_S64) {
      return "internal error: the validity operand of a padded batch is not an integer array";
    }
    plan->valid = ElementData(ins[v], 0);
    plan->valid_input = v;
    plan->valid_wide = buf->dtype == XLA_FFI_DataType_S64;
    plan->outs = outs;
  }
  return std::string();
}

// Whether the element at these offsets is a real one, not padding: XLA pads a
// batch that does not divide evenly over the devices, and the validity operand
// (jaxbind/_primitive.py, _validity) is positive exactly on the real elements.
bool RealElement(const WalkPlan& plan, const int64_t* in_off) {
  const char* at = plan.valid + in_off[plan.valid_input];
  if (plan.valid_wide) {
    int64_t v;
    std::memcpy(&v, at, sizeof v);
    return v > 0;
  }
  int32_t v;
  std::memcpy(&v, at, sizeof v);
  return v > 0;
}

// Zeroes the outputs of one (padding) element: XLA drops them.
void ZeroElement(const WalkPlan& plan, const int64_t* out_off) {
  const size_t levels = plan.levels;
  for (size_t j = 0; j < plan.n_out; ++j) {
    auto* buf = static_cast<XLA_FFI_Buffer*>(plan.outs[j]);
    const int64_t bytes = plan.out_strides[j * levels + levels - 1];  // one element's
    if (buf->data != nullptr && bytes > 0) {
      std::memset(static_cast<char*>(buf->data) + out_off[j], 0, bytes);
    }
  }
}

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
__attribute__((noinline)) bool WalkPadded(const WalkPlan& plan, int64_t begin, int64_t end,
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

// ---------------------------------------------------------------------------
// Checking mode: outputs a callback leaves unwritten
// ---------------------------------------------------------------------------

std::atomic<bool> g_check_unwritten{false};

// The bytes an element holds until a callback writes it: for float types a NaN
// with a payload arithmetic does not produce, else 0xA5 bytes (a legal value of
// integer and float8 types, so one written on purpose is reported too; an
// invalid bool). Returns the element width, 0 for an unknown dtype.
size_t Sentinel(int64_t dtype, unsigned char* pattern) {
  size_t width = 0;
  switch (dtype) {
    case JAXBIND_BOOL: case JAXBIND_INT8: case JAXBIND_UINT8: case JAXBIND_FLOAT8_E5M2:
    case JAXBIND_FLOAT8_E4M3FN: case JAXBIND_FLOAT8_E4M3B11FNUZ: case JAXBIND_FLOAT8_E5M2FNUZ:
    case JAXBIND_FLOAT8_E4M3FNUZ: case JAXBIND_FLOAT8_E4M3: case JAXBIND_FLOAT8_E3M4: width = 1; break;
    case JAXBIND_INT16: case JAXBIND_UINT16: case JAXBIND_FLOAT16: case JAXBIND_BFLOAT16: width = 2; break;
    case JAXBIND_INT32: case JAXBIND_UINT32: case JAXBIND_FLOAT32: width = 4; break;
    case JAXBIND_INT64: case JAXBIND_UINT64: case JAXBIND_FLOAT64: case JAXBIND_COMPLEX64: width = 8; break;
    case JAXBIND_COMPLEX128: width = 16; break;
    default: return 0;
  }
  std::memset(pattern, 0xA5, width);
  // Little-endian high bytes of a NaN (each half of a complex number).
  switch (dtype) {
    case JAXBIND_FLOAT16: pattern[1] = 0x7D; break;   // 0x7DA5
    case JAXBIND_BFLOAT16: pattern[1] = 0x7F; break;  // 0x7FA5
    case JAXBIND_FLOAT32: case JAXBIND_COMPLEX64:     // 0x7FA5A5A5
      for (size_t h = 3; h < width; h += 4) pattern[h] = 0x7F;
      break;
    case JAXBIND_FLOAT64: case JAXBIND_COMPLEX128:    // 0x7FF5A5A5A5A5A5A5
      for (size_t h = 7; h < width; h += 8) { pattern[h] = 0x7F; pattern[h - 1] = 0xF5; }
      break;
    default: break;
  }
  return width;
}

int64_t NumElements(const XLA_FFI_Buffer* buf) {
  int64_t n = 1;
  for (int64_t d = 0; d < buf->rank; ++d) n *= buf->dims[d];
  return n;
}

void FillSentinel(size_t n_out, void* const* outs) {
  unsigned char pattern[16];
  for (size_t k = 0; k < n_out; ++k) {
    auto* buf = static_cast<XLA_FFI_Buffer*>(outs[k]);
    const size_t width = Sentinel(buf->dtype, pattern);
    auto* data = static_cast<unsigned char*>(buf->data);
    const int64_t n = NumElements(buf);
    for (int64_t e = 0; width != 0 && data != nullptr && e < n; ++e) {
      std::memcpy(data + e * width, pattern, width);
    }
  }
}

// Empty, or the message naming the first output element still holding the sentinel.
std::string FindUnwritten(size_t n_out, void* const* outs) {
  unsigned char pattern[16];
  for (size_t k = 0; k < n_out; ++k) {
    auto* buf = static_cast<XLA_FFI_Buffer*>(outs[k]);
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
      for (int64_t d = 0; d < buf->rank; ++d) shape += (d ? ", " : "") + std::to_string(buf->dims[d]);
      return "output " + std::to_string(k) + " (shape (" + shape + ")) was not fully written: " +
             std::to_string(count) + " element(s) still hold the checking mode's sentinel, the "
             "first at index (" + index + "). A callback must write every element of every "
             "output (jaxbind.config.check_unwritten is on)";
    }
  }
  return std::string();
}

ffi::Error RunPython(const Site& site, const XLA_FFI_Args* args, const XLA_FFI_Rets* rets) {
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

// Runs a native kernel over elements of a walk: descriptors on the stack, no
// Python, no GIL. One runner per thread (it owns the descriptors and the
// error buffer the kernel writes).
class NativeRunner {
 public:
  NativeRunner(const Site& site, const WalkPlan& plan, void* const* ins, void* const* outs)
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
                         static_cast<int64_t>(site.native_kwargs.size()),
                         site.native_kwargs.data(), error_, static_cast<int64_t>(sizeof(error_))};
  }
  NativeRunner(const NativeRunner&) = delete;
  NativeRunner& operator=(const NativeRunner&) = delete;

  // Elements [begin, end); false when the kernel failed (see Message).
  bool Run(int64_t begin, int64_t end) {
    return WalkRange(plan_, begin, end, [&](const int64_t* in_off, const int64_t* out_off) {
      for (size_t i = 0; i < n_in_; ++i) in_[i].data = ElementData(ins_[i], in_off[i]);
      for (size_t j = 0; j < plan_.n_out; ++j) out_[j].data = ElementData(outs_[j], out_off[j]);
      code_ = site_.native(&call_);
      return code_ == 0;
    });
  }

  std::string Message() {
    error_[sizeof(error_) - 1] = '\0';
    return "native kernel failed: " +
           (error_[0] ? std::string(error_)
                      : "the native kernel returned " + std::to_string(code_) + " without a message");
  }

 private:
  const Site& site_;
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
  const Site* site;
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
ffi::Error RunNativeWalk(const Site& site, size_t n_in, void* const* ins, size_t n_out,
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
ffi::Error RunNativeChecked(const Site& site, size_t n_in, void* const* ins, size_t n_out,
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

// A batch handed over whole (vmap_method "expand_dims" or "broadcast_all")
// that XLA partitioned and padded: the callable gets the real elements only.
// The real elements of a block are a prefix along each level (XLA pads at the
// end of a level), so they are arrays of the same rank with smaller batch
// sizes: views of the buffers when that prefix is contiguous (only the
// outermost cut level holds more than one row), else gathered into scratch
// and the outputs scattered back. Padding outputs are zeroed.
class WholePadded {
 public:
  WholePadded(const Site& site, size_t n_in, void* const* ins, size_t n_out, void* const* outs)
      : levels_(site.valid_levels), n_in_(n_in - 1), n_out_(n_out), ins_(ins), outs_(outs) {}

  // Empty, or an internal error. Then `real()` is the number of real elements.
  std::string Plan() {
    const auto* valid = static_cast<const XLA_FFI_Buffer*>(ins_[n_in_]);
    if ((valid->dtype != XLA_FFI_DataType_S32 && valid->dtype != XLA_FFI_DataType_S64) ||
        valid->rank < static_cast<int64_t>(levels_)) {
      return "internal error: the validity operand of a padded batch is malformed";
    }
    sizes_.assign(valid->dims, valid->dims + levels_);
    // Every array has the same batch levels in front (never a copy past an end).
    for (size_t k = 0; k < n_in_ + n_out_; ++k) {
      const auto* buf = Buf(k < n_in_ ? ins_[k] : outs_[k - n_in_]);
      bool same = buf->rank >= static_cast<int64_t>(levels_);
      for (size_t l = 0; same && l < levels_; ++l) same = buf->dims[l] == sizes_[l];
      if (!same) {
        return "internal error: the batch dimensions of " +
               (k < n_in_ ? "input " + std::to_string(k) : "output " + std::to_string(k - n_in_)) +
               " differ from those of the validity operand";
      }
    }
    total_ = 1;
    for (int64_t n : sizes_) total_ *= n;
    const bool wide = valid->dtype == XLA_FFI_DataType_S64;
    const char* data = ElementData(ins_[n_in_], 0);
    auto real = [&](int64_t e) {
      int64_t v = 0;
      if (wide) {
        std::memcpy(&v, data + 8 * e, 8);
      } else {
        int32_t w;
        std::memcpy(&w, data + 4 * e, 4);
        v = w;
      }
      return v > 0;
    };
    // The prefix: along each level, from element 0, as far as elements are real.
    prefix_.assign(levels_, 0);
    if (total_ > 0 && real(0)) {
      int64_t stride = total_;
      for (size_t l = 0; l < levels_; ++l) {
        stride /= sizes_[l];
        while (prefix_[l] < sizes_[l] && real(prefix_[l] * stride)) ++prefix_[l];
      }
    }
    real_ = 1;
    for (int64_t n : prefix_) real_ *= n;
    // Every element is real exactly when it lies in the prefix.
    std::vector<int64_t> index(levels_, 0);
    for (int64_t e = 0; e < total_; ++e) {
      bool inside = true;
      for (size_t l = 0; l < levels_; ++l) inside = inside && index[l] < prefix_[l];
      if (inside != real(e)) {
        return "internal error: the padding XLA added to a partitioned batch is not at the end "
               "of its levels";
      }
      for (size_t l = levels_; l-- > 0;) {
        if (++index[l] < sizes_[l]) break;
        index[l] = 0;
      }
    }
    return std::string();
  }

  int64_t real() const { return real_; }
  bool full() const { return real_ == total_; }

  // The inputs (the validity operand left out) and outputs the callable sees:
  // the real elements. Inputs are gathered here when not contiguous.
  void MakeFrame() {
    contiguous_ = true;
    size_t last_cut = 0;
    for (size_t l = 0; l < levels_; ++l) {
      if (prefix_[l] < sizes_[l]) last_cut = l;
    }
    for (size_t l = 0; l < last_cut; ++l) contiguous_ = contiguous_ && prefix_[l] == 1;
    const size_t n = n_in_ + n_out_;
    buffers_.resize(n);
    dims_.resize(n);
    scratch_.resize(n);
    pointers_.resize(n);
    for (size_t k = 0; k < n; ++k) {
      const auto* buf = Buf(k < n_in_ ? ins_[k] : outs_[k - n_in_]);
      buffers_[k] = *buf;
      dims_[k].assign(buf->dims, buf->dims + buf->rank);
      for (size_t l = 0; l < levels_; ++l) dims_[k][l] = prefix_[l];
      buffers_[k].dims = dims_[k].data();
      if (!contiguous_ && real_ > 0) {
        scratch_[k].resize(static_cast<size_t>(real_ * ElementBytes(buf)));
        buffers_[k].data = scratch_[k].data();
        if (k < n_in_) Copy(buf, /*gather=*/true, scratch_[k].data());
      }
      pointers_[k] = &buffers_[k];
    }
  }
  void* const* ins() const { return pointers_.data(); }
  void* const* outs() const { return pointers_.data() + n_in_; }
  size_t n_in() const { return n_in_; }

  // After the call: outputs scattered into place and their padding zeroed.
  void Finish() {
    for (size_t j = 0; j < n_out_; ++j) {
      const auto* buf = Buf(outs_[j]);
      if (buf->data == nullptr) continue;
      const int64_t bytes = ElementBytes(buf);
      char* data = static_cast<char*>(buf->data);
      if (contiguous_) {  // written in place: zero what follows the prefix
        std::memset(data + real_ * bytes, 0, static_cast<size_t>((total_ - real_) * bytes));
      } else {
        std::memset(data, 0, static_cast<size_t>(total_ * bytes));
        Copy(buf, /*gather=*/false, scratch_[n_in_ + j].data());
      }
    }
  }

 private:
  static const XLA_FFI_Buffer* Buf(void* p) { return static_cast<const XLA_FFI_Buffer*>(p); }

  // Bytes of one batch element of a buffer with `levels_` batch levels in front.
  int64_t ElementBytes(const XLA_FFI_Buffer* buf) const {
    return levels_ == 0 ? 0 : DimStride(buf, static_cast<int64_t>(levels_) - 1);
  }

  // The prefix elements of `buf` to (gather) or from (scatter) `dense`, in order.
  void Copy(const XLA_FFI_Buffer* buf, bool gather, char* dense) const {
    const int64_t bytes = ElementBytes(buf);
    char* base = static_cast<char*>(buf->data);
    std::vector<int64_t> index(levels_, 0);
    for (int64_t e = 0; e < real_; ++e) {
      int64_t offset = 0;
      for (size_t l = 0; l < levels_; ++l) offset += index[l] * DimStride(buf, static_cast<int64_t>(l));
      if (gather) {
        std::memcpy(dense + e * bytes, base + offset, static_cast<size_t>(bytes));
      } else {
        std::memcpy(base + offset, dense + e * bytes, static_cast<size_t>(bytes));
      }
      for (size_t l = levels_; l-- > 0;) {
        if (++index[l] < prefix_[l]) break;
        index[l] = 0;
      }
    }
  }

  size_t levels_, n_in_, n_out_;
  void* const* ins_;
  void* const* outs_;
  std::vector<int64_t> sizes_, prefix_;
  int64_t total_ = 0, real_ = 0;
  bool contiguous_ = true;
  std::vector<XLA_FFI_Buffer> buffers_;  // inputs, then outputs
  std::vector<std::vector<int64_t>> dims_;
  std::vector<std::vector<char>> scratch_;
  std::vector<void*> pointers_;
};

// Runs `run(n_in, ins, outs)` on the real elements of a whole call over a
// padded batch (the validity operand is the last of the `n_in` inputs).
template <typename Run>
ffi::Error RunWholePadded(const Site& site, size_t n_in, void* const* ins, size_t n_out,
                          void* const* outs, Run&& run) {
  if (n_in == 0) return ErrorText(&site, "internal error: a padded batch without its validity operand");
  WholePadded whole(site, n_in, ins, n_out, outs);
  std::string bad = whole.Plan();
  if (!bad.empty()) return ErrorText(&site, bad);
  if (whole.full()) return run(n_in - 1, ins, outs);  // (the validity operand is last)
  if (whole.real() == 0) {  // a block of padding only: no call
    whole.Finish();
    return ffi::Error::Success();
  }
  whole.MakeFrame();
  ffi::Error result = run(whole.n_in(), whole.ins(), whole.outs());
  if (result.success()) whole.Finish();
  return result;
}

// The whole calls over a padded batch, out of line (see WalkPadded).
__attribute__((noinline)) ffi::Error RunNativeWholePadded(const Site& site, size_t n_in,
                                                          void* const* ins, size_t n_out,
                                                          void* const* outs, ffi::ThreadPool* pool) {
  return RunWholePadded(site, n_in, ins, n_out, outs,
                        [&](size_t n, void* const* real_ins, void* const* real_outs) {
                          return RunNativeChecked(site, n, real_ins, n_out, real_outs, pool);
                        });
}

__attribute__((noinline)) ffi::Error RunPythonWholePadded(const Site& site, const XLA_FFI_Args* args,
                                                          const XLA_FFI_Rets* rets) {
  return RunWholePadded(site, args->size, args->args, rets->size, rets->rets,
                        [&](size_t n, void* const* ins, void* const* outs) {
                          XLA_FFI_Args real_args = *args;
                          real_args.size = static_cast<int64_t>(n);
                          real_args.args = const_cast<void**>(ins);
                          XLA_FFI_Rets real_rets = *rets;
                          real_rets.rets = const_cast<void**>(outs);
                          return RunPython(site, &real_args, &real_rets);
                        });
}

// A native kernel call (a walk, or one whole call), padding left out.
ffi::Error RunNative(const Site& site, size_t n_in, void* const* ins, size_t n_out,
                     void* const* outs, ffi::ThreadPool* pool) {
  if (site.valid_levels != 0 && site.levels == 0) {  // (a walk skips padding itself)
    return RunNativeWholePadded(site, n_in, ins, n_out, outs, pool);
  }
  return RunNativeChecked(site, n_in, ins, n_out, outs, pool);
}

// The buffers of one call, copied: XLA may reuse its call frame once an
// asynchronous handler returns, while the buffers stay valid until the
// handler's future completes.
struct OwnedFrame {
  OwnedFrame(const XLA_FFI_Args* args, const XLA_FFI_Rets* rets)
      : buffers(args->size + rets->size), dims(buffers.size()), pointers(buffers.size()) {
    for (size_t i = 0; i < buffers.size(); ++i) {
      const bool is_in = i < static_cast<size_t>(args->size);
      const auto* buf = static_cast<const XLA_FFI_Buffer*>(
          is_in ? args->args[i] : rets->rets[i - args->size]);
      buffers[i] = *buf;
      dims[i].assign(buf->dims, buf->dims + buf->rank);
      buffers[i].dims = dims[i].data();
      pointers[i] = &buffers[i];
    }
    n_in = args->size;
  }
  std::vector<XLA_FFI_Buffer> buffers;  // inputs, then outputs
  std::vector<std::vector<int64_t>> dims;
  std::vector<void*> pointers;
  size_t n_in = 0;
};

// RemainingArgs/RemainingRets keep the raw frame protected; a member pointer
// formed through a derived class reads it without copying or decoding.
struct RawFrame : ffi::RemainingArgs, ffi::RemainingRets {
  static const XLA_FFI_Args* Args(const ffi::RemainingArgs& a) {
    return (a.*(&RawFrame::args))();
  }
  static const XLA_FFI_Rets* Rets(const ffi::RemainingRets& r) {
    return (r.*(&RawFrame::rets))();
  }
};

ffi::Error UnknownSite(int64_t session, int64_t site_id) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    "jaxbind: the compiled program names call site " + std::to_string(site_id) +
                        (session == g_session ? std::string(", which is not registered")
                                              : std::string(" of another process")) +
                        "; programs that call jaxbind ops run only in the process that "
                        "compiled them (trace and compile them again here)");
}

// The one XLA handler for every jaxbind op.
ffi::Error Dispatch(ffi::ThreadPool pool, int64_t session, int64_t site_id,
                    ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const Site* site = LookupSite(session, site_id);
  if (site == nullptr) return UnknownSite(session, site_id);
  const XLA_FFI_Args* raw_args = RawFrame::Args(args);
  const XLA_FFI_Rets* raw_rets = RawFrame::Rets(rets);
  if (site->levels != 0 && site->in_masks.size() != static_cast<size_t>(raw_args->size)) {
    return ErrorText(site, "internal error: the call site was registered for " +
                               std::to_string(site->in_masks.size()) + " inputs");
  }
  if (site->native != nullptr) {
    return RunNative(*site, raw_args->size, raw_args->args, raw_rets->size, raw_rets->rets, &pool);
  }
  if (!Py_IsInitialized()) return ErrorText(site, "the Python interpreter is not running");
  if (site->valid_levels != 0 && site->levels == 0) {
    return RunPythonWholePadded(*site, raw_args, raw_rets);
  }
  return RunPython(*site, raw_args, raw_rets);
}

// The handler for concurrent native kernels: the kernel runs on XLA's
// thread pool, and XLA goes on with independent work until it completes.
ffi::Future DispatchAsync(ffi::ThreadPool pool, int64_t session, int64_t site_id,
                          ffi::RemainingArgs args,
                          ffi::RemainingRets rets) {
  // Shared, because a Promise is move-only in some versions of the FFI headers
  // and the task that completes it must be copyable in others.
  auto promise = std::make_shared<ffi::Promise>();
  ffi::Future future(*promise);
  const Site* site = LookupSite(session, site_id);
  if (site == nullptr || site->native == nullptr) {
    promise->SetError(UnknownSite(session, site_id));
    return future;
  }
  auto frame = std::make_shared<OwnedFrame>(RawFrame::Args(args), RawFrame::Rets(rets));
  pool.Schedule([site, frame, promise]() {
    void* const* pointers = frame->pointers.data();
    ffi::Error error = RunNative(*site, frame->n_in, pointers,
                                 frame->pointers.size() - frame->n_in, pointers + frame->n_in,
                                 /*pool=*/nullptr);
    if (error.success()) {
      promise->SetAvailable();
    } else {
      promise->SetError(std::move(error));
    }
  });
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxbind_dispatch_async, DispatchAsync,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int64_t>("session")
                                  .Attr<int64_t>("site")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxbind_dispatch, Dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Attr<int64_t>("session")
                                  .Attr<int64_t>("site")
                                  .RemainingArgs()
                                  .RemainingRets());

NB_MODULE(_trampoline, m) {
  if (PyArray_ImportNumPyAPI() < 0) throw nb::python_error();
  m.doc() = "jaxbind's compiled core: the XLA custom-call handler and its registry.";

  m.def("handler", []() {
    return nb::capsule(reinterpret_cast<void*>(&jaxbind_dispatch));
  }, "The XLA FFI handler, as a capsule for jax.ffi.register_ffi_target.");
  m.def("async_handler", []() {
    return nb::capsule(reinterpret_cast<void*>(&jaxbind_dispatch_async));
  }, "The XLA FFI handler of concurrent native kernels (runs them on XLA's thread pool).");

  m.def("set_dtype", [](int code, nb::handle dtype) {
    if (code < 0 || code >= kNumDtypeCodes) throw nb::value_error("dtype code out of range");
    PyArray_Descr* descr = nullptr;
    if (!PyArray_DescrConverter(dtype.ptr(), &descr)) throw nb::python_error();
    PyArray_Descr* old = g_descr[code];
    g_descr[code] = descr;  // keeps the new reference
    g_itemsize[code] = PyDataType_ELSIZE(descr);
    Py_XDECREF(old);
  }, nb::arg("code"), nb::arg("dtype"), "Map an XLA FFI dtype code to a NumPy dtype.");

  m.def("set_alias_retirer", [](nb::handle fn) {
    Py_XINCREF(fn.ptr());
    Py_XDECREF(g_retire_aliases);
    g_retire_aliases = fn.ptr();
  }, "Set the function (list of kept views) -> None that cuts off every other array reaching "
     "their memory; it is called before the views themselves are retired.");

  m.def("retire", [](nb::handle array) {
    if (!PyArray_Check(array.ptr())) throw nb::type_error("not a NumPy array");
    if (PyArray_CHKFLAGS(reinterpret_cast<PyArrayObject*>(array.ptr()), NPY_ARRAY_OWNDATA)) {
      throw nb::value_error("the array owns its memory");
    }
    Retire(array.ptr());
  }, "Make a view that does not own its memory empty and read-only (cuts it off that memory).");

  m.def("shutdown", &Shutdown, nb::arg("timeout"),
        "Refuse new Python callbacks and wait up to `timeout` seconds for the running ones "
        "(jaxbind's atexit hook). Returns how many still run.");

  m.def("set_check_unwritten", [](bool on) { g_check_unwritten.store(on); }, nb::arg("on"),
        "Fill outputs with a sentinel before every callback and report elements left unwritten.");

  m.def("set_error_formatter", [](nb::handle fn) {
    Py_XINCREF(fn.ptr());
    Py_XDECREF(g_format_error);
    g_format_error = fn.ptr();
  }, "Set the function (op_name, exception) -> str used for callback errors.");

  m.def("register_site",
        [](std::string name, nb::handle callable, nb::bytes kwargs_dump,
           size_t levels, std::vector<std::vector<int>> in_masks,
           uintptr_t native_address, nb::list native_kwargs, size_t valid_levels) {
          auto site = std::make_unique<Site>();
          site->name = std::move(name);
          if (native_address != 0) {
            site->native = reinterpret_cast<jaxbind_kernel>(native_address);
            site->native_storage.resize(nb::len(native_kwargs));
            size_t k = 0;
            for (nb::handle item : native_kwargs) {
              NativeKwarg& kw = site->native_storage[k++];
              // The Python side checks every value first; a value that still
              // does not convert is an error naming the op and the kwarg.
              try {
                nb::tuple entry = nb::cast<nb::tuple>(item);
                kw.name = nb::cast<std::string>(entry[0]);
                kw.type = nb::cast<int64_t>(entry[1]);
                switch (kw.type) {
                  case JAXBIND_KW_INT: case JAXBIND_KW_BOOL:
                    kw.int_value = nb::cast<int64_t>(entry[2]); break;
                  case JAXBIND_KW_FLOAT: kw.float_value = nb::cast<double>(entry[2]); break;
                  case JAXBIND_KW_STRING: kw.string_value = nb::cast<std::string>(entry[2]); break;
                  case JAXBIND_KW_INT_ARRAY:
                    kw.int_array = nb::cast<std::vector<int64_t>>(entry[2]); break;
                  case JAXBIND_KW_FLOAT_ARRAY:
                    kw.float_array = nb::cast<std::vector<double>>(entry[2]); break;
                  default: throw nb::value_error("unknown native kwarg type");
                }
              } catch (const std::exception& err) {
                PyErr_Clear();
                throw nb::type_error(("jaxbind " + site->name + ": keyword argument '" + kw.name +
                                      "' cannot be passed to a native kernel (" + err.what() +
                                      "): ints must fit in 64 bits, strings be valid UTF-8")
                                         .c_str());
              }
            }
            // Point the C views at the storage, which no longer moves.
            for (const NativeKwarg& kw : site->native_storage) {
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
              site->native_kwargs.push_back(view);
            }
          } else {
            Py_INCREF(callable.ptr());
            site->callable = callable.ptr();
            Py_INCREF(kwargs_dump.ptr());
            site->kwargs_dump = kwargs_dump.ptr();
          }
          site->levels = levels;
          for (const auto& mask : in_masks) {
            if (mask.size() != levels) throw nb::value_error("a batch mask per level expected");
            site->in_masks.emplace_back(mask.begin(), mask.end());
            site->in_mapped.push_back(static_cast<int>(levels - std::count(mask.begin(), mask.end(), 0)));
          }
          if (valid_levels != 0 && levels != 0 && valid_levels != levels) {
            throw nb::value_error("a padded walk has the validity operand at every level");
          }
          site->valid_levels = valid_levels;
          if (valid_levels != 0 && levels != 0) {  // the validity operand: mapped at every level
            site->in_masks.emplace_back(levels, 1);
            site->in_mapped.push_back(static_cast<int>(levels));
          }
          return PublishSite(std::move(site));
        },
        nb::arg("name"), nb::arg("callable").none(), nb::arg("kwargs_dump"),
        nb::arg("levels"), nb::arg("in_masks"), nb::arg("native_address"),
        nb::arg("native_kwargs"), nb::arg("valid_levels") = 0,
        "Register a call site (a Python callable, or a native kernel when "
        "native_address is not 0); returns the id the compiled program carries. With "
        "valid_levels, the last input is the validity operand of a padded batch.");

  m.def("capsule_pointer", [](nb::handle capsule) {
    if (!PyCapsule_CheckExact(capsule.ptr())) throw nb::type_error("not a PyCapsule");
    void* ptr = PyCapsule_GetPointer(capsule.ptr(), PyCapsule_GetName(capsule.ptr()));
    if (ptr == nullptr) throw nb::python_error();
    return reinterpret_cast<uintptr_t>(ptr);
  }, "The pointer a PyCapsule holds, whatever its name.");

  m.def("num_sites", []() { return g_num_sites.load(); }, "Number of registered call sites.");
  m.def("session", []() { return g_session; }, "This process's token, compiled beside site ids.");

  // Diagnostics for bench/: the cost of each step of the per-call path, alone.
  // Each returns nanoseconds per iteration.
  m.def("_diag_gil", [](int64_t n, bool worker) {
    auto loop = [n]() {
      auto t0 = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < n; ++i) { GilHold gil; }
      return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n;
    };
    double ns = 0.0;
    nb::gil_scoped_release release;  // as XLA runs: the launching thread gave up the GIL
    if (worker) {
      std::thread t([&]() { loop(); ns = loop(); });  // the first loop makes the thread state
      t.join();
    } else {
      ns = loop();
    }
    return ns;
  }, nb::arg("n"), nb::arg("worker"),
     "Take and release the GIL n times from a thread without it (an XLA worker thread, or this one).");

  m.def("_diag_views", [](int64_t n) {
    int64_t dims[1] = {1};
    double in_data = 1.0, out_data = 0.0;
    XLA_FFI_Buffer in_buf{sizeof(XLA_FFI_Buffer), nullptr, XLA_FFI_DataType_F64, &in_data, 1, dims};
    XLA_FFI_Buffer out_buf = in_buf;
    out_buf.data = &out_data;
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n; ++i) {
      PyObject* in_tuple = PyTuple_New(1);
      PyObject* out_tuple = PyTuple_New(1);
      PyTuple_SET_ITEM(in_tuple, 0, MakeView(&in_buf, static_cast<char*>(in_buf.data), 0, false));
      PyTuple_SET_ITEM(out_tuple, 0, MakeView(&out_buf, static_cast<char*>(out_buf.data), 0, true));
      Py_DECREF(in_tuple);
      Py_DECREF(out_tuple);
    }
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n;
  }, nb::arg("n"), "Make and free the (out, args) tuples of 1-element views n times.");

  m.def("_diag_call", [](nb::handle fn, nb::handle out, nb::handle args, nb::handle kwargs, int64_t n) {
    PyObject* argv[3] = {out.ptr(), args.ptr(), kwargs.ptr()};
    auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < n; ++i) {
      PyObject* result = PyObject_Vectorcall(fn.ptr(), argv, 3, nullptr);
      if (result == nullptr) throw nb::python_error();
      Py_DECREF(result);
    }
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / n;
  }, nb::arg("fn"), nb::arg("out"), nb::arg("args"), nb::arg("kwargs_dump"), nb::arg("n"),
     "Call fn(out, args, kwargs_dump) n times from C.");
}

// The types and declarations that the files of csrc/ share.
//
// csrc/ is jaxbind's XLA custom-call trampoline: one typed-FFI handler serves
// every jaxbind op. A compiled program carries two attributes: `site`, a key
// derived from what defines the call (the same in every process), and
// `jaxbind`, the call's description (op name, role, kwargs, layout) from which
// a process that defines the op can make the site when it has not yet; the
// site says which callable to run, with which kwargs, and how to walk a batch. The handler knows no
// calculus: jvp, transpose and batching rules live in Python and only decide which site a custom
// call names.
//
// csrc/ is one translation unit (CMakeLists.txt builds it with CMake's unity
// build), so everything here has internal linkage and the compiler sees the
// whole per-call path at once: CallOnce's helpers inline as they did when this
// was a single file. NumPy's C API table is per translation unit too (no
// PY_ARRAY_UNIQUE_SYMBOL): compiled apart, the files would not even share it.
#ifndef JAXBIND_CSRC_INTERNAL_H_
#define JAXBIND_CSRC_INTERNAL_H_

#ifndef JAXBIND_ONE_UNIT
#error \
    "csrc/*.cc are parts of one translation unit: build them with CMake's unity build (CMakeLists.txt)"
#endif

#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <numpy/arrayobject.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "jaxbind.h"

// A function kept out of its callers (the per-call path's cold branches): GCC
// and Clang spell it as an attribute, MSVC as a declspec.
#if defined(_MSC_VER) && !defined(__clang__)
#define JAXBIND_NOINLINE __declspec(noinline)
#else
#define JAXBIND_NOINLINE __attribute__((noinline))
#endif

#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

static_assert(sizeof(npy_intp) == sizeof(int64_t),
              "XLA dimensions are handed to NumPy without conversion");

namespace {

// ---- Call sites (registry.cc) ---------------------------------------------

// What every compiled custom call has, whatever it calls: a name for errors
// and how the handler walks a batch. Only which input is mapped at which
// level is static: sizes and strides are read off the buffers of each call,
// since XLA may hand a partitioned call a piece of the batch.
struct Site {
  std::string name;  // e.g. "op 'scale' (transpose callback 'scale_T')"
  // The description programs carry for this site (jaxbind/_sites.py): a program
  // runs the site only if it carries exactly this text (CheckProgramSite, once
  // per compiled program). Read and cleared (on release) under the registry's lock.
  std::string description;
  int64_t key = 0;      // what programs name it by
  int64_t serial = -1;  // its place among every site this process made
  // False once the Python handle that owns the site is gone: the site is then
  // a shell that nothing calls (see ReleaseSite).
  std::atomic<bool> alive{true};
  size_t levels = 0;  // batch levels walked; 0: the callee sees the whole arrays
  std::vector<std::vector<char>> in_masks;  // per input, per level (outermost first)
  std::vector<int> in_mapped;               // leading dims of each input that are levels
  // A partitioned batch that XLA may pad: when not 0, the last input is the
  // validity operand (made by _validity in jaxbind/_lowering.py) and every
  // array has this many batch levels in front (equal to `levels` for a walk;
  // a whole call has levels 0).
  size_t valid_levels = 0;
  // What XLA must hand every call (the description's avals, jaxbind/_sites.py's
  // _buffer_types): per buffer (inputs, the validity operand, then outputs) its
  // XLA dtype code, rank and dims. A call with other buffers (a program altered
  // to pass other arrays than it describes) fails naming the op, before anything
  // reads them (BuffersAsRegistered: a few integer compares per buffer).
  std::vector<int64_t> types;
  size_t n_args = 0, n_rets = 0;
  // Leading dims XLA may split over devices (a partitionable batch): in every
  // buffer alike, and at most their registered sizes.
  size_t free_levels = 0;
  // An ordered op's call (effect="ordered"): XLA passes a token first among the
  // inputs and first among the outputs, which order the op's calls in the
  // program; the handler checks and drops them before anything else (TrimTokens).
  bool tokens = false;
  // An op with an effect whose calls must never overlap (not thread_safe): every
  // site of the op (or of one io_callback's callback) holds the same mutex, taken
  // for the whole call before the GIL (recursive: a callback that calls its own
  // op eagerly on the same thread does not deadlock).
  std::shared_ptr<std::recursive_mutex> exclusive;
};

// What Python hands register_site for an op whose calls must not overlap: one per op.
struct Exclusive {
  std::shared_ptr<std::recursive_mutex> mutex = std::make_shared<std::recursive_mutex>();
};

// A Python callback, called as callable(out, args, kwargs_dump).
// A mutex only where CPython runs without a GIL (as nanobind's ft_mutex): on a GIL build the GIL
// already orders what it guards, and locking it costs nothing.
#ifdef Py_GIL_DISABLED
using FtMutex = std::mutex;
#else
struct FtMutex {
  void lock() {}
  void unlock() {}
};
#endif

// A flag one thread at a time may claim. Every claim is made with the GIL, so on a GIL build a load
// and a store suffice; without a GIL, an atomic exchange.
class ClaimFlag {
 public:
  bool Claim() {
#ifdef Py_GIL_DISABLED
    return !busy_.exchange(true, std::memory_order_acquire);
#else
    if (busy_.load(std::memory_order_relaxed)) return false;
    busy_.store(true, std::memory_order_relaxed);
    return true;
#endif
  }
  void Return() { busy_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> busy_{false};
};

struct PythonSite : Site {
  // Borrowed from the site's Python handle (which the garbage collector sees);
  // null once the site is released. Read and cleared under the GIL and under
  // `refs` (PythonRefs::Hold, ReleaseSite), a lock only without a GIL: a release
  // on another thread must not free them between a call's read and its new
  // reference.
  PyObject* callable = nullptr;
  PyObject* kwargs_dump = nullptr;  // bytes, handed to every call unchanged
  mutable FtMutex refs;
  // The (args, out) tuples of views from the last call, reused while nobody
  // else holds them (claimed by ClaimViewCache).
  mutable PyObject* cached_in = nullptr;
  mutable PyObject* cached_out = nullptr;
  mutable ClaimFlag cache_claim;
  // Declared safe to call on several threads at once: a walk may then spread
  // over XLA's thread pool, each thread taking the GIL (see RunPython).
  bool thread_safe = false;
  // Walks left to run on the calling thread alone: set when a spread walk's
  // helpers ran no chunk (a body that holds the GIL, or a busy pool), so that
  // such bodies pay for a helper's GIL round trip only once in
  // kSerialAfterNoHelp walks (see RunPython).
  mutable std::atomic<int> serial_walks{0};
};

// Whether CPython is ending this thread (it waited for the GIL while the
// interpreter finalized, and CPython < 3.13.8 then calls pthread_exit, whose
// unwinding runs the destructors of the frames it leaves). Built with libstdc++
// the dispatch catches that unwinding (abi::__forced_unwind, UnlessEndedByPython
// in python_call.cc) and abandons what it holds; libc++ has no such type (and a
// catch (...) that rethrows it terminates the process), so there the holders'
// destructors ask this.
#if !defined(__GLIBCXX__)
bool EndedByPython();
#endif

// New references to a Python site's callable and kwargs, which one dispatch
// takes with the GIL and holds for every call it makes; its destructor drops
// them, before the dispatch's GIL holder releases the GIL. A program may
// outlive the Python holders of its sites (JAX may run an executable after it
// dropped its Python half): the site's release then takes nothing from a
// dispatch that runs it.
class PythonRefs {
 public:
  PythonRefs() = default;
  ~PythonRefs() {
#if !defined(__GLIBCXX__)
    if (EndedByPython()) return;  // nothing may be dropped without the GIL
#endif
    Py_XDECREF(kwargs_dump_);
    Py_XDECREF(callable_);
  }
  PythonRefs(const PythonRefs&) = delete;
  PythonRefs& operator=(const PythonRefs&) = delete;
  // The site's, if it is not released; false otherwise.
  bool Hold(const PythonSite& site) {
    std::lock_guard<FtMutex> lock(site.refs);
    if (site.callable == nullptr) return false;
    callable_ = site.callable;
    kwargs_dump_ = site.kwargs_dump;
    Py_INCREF(callable_);
    Py_INCREF(kwargs_dump_);
    return true;
  }
  // CPython is ending this thread: nothing may be dropped without the GIL.
  void Abandon() { callable_ = kwargs_dump_ = nullptr; }
  PyObject* callable() const { return callable_; }
  PyObject* kwargs_dump() const { return kwargs_dump_; }

 private:
  PyObject* callable_ = nullptr;
  PyObject* kwargs_dump_ = nullptr;
};

// The view cache's claim: a re-entrant or overlapping call (another thread,
// while this callback released the GIL, or a parallel walk) makes its own
// views.
inline bool ClaimViewCache(const PythonSite& site) { return site.cache_claim.Claim(); }

inline void ReturnViewCache(const PythonSite& site) { site.cache_claim.Return(); }

// A kwarg of a native kernel with the storage its C view points into.
struct NativeKwarg {
  std::string name;
  int64_t type = 0;
  int64_t int_value = 0;
  double float_value = 0.0;
  std::string string_value;
  std::vector<int64_t> int_array;
  std::vector<double> float_array;
};

// A C kernel (jaxbind.h), called with no Python and no GIL.
struct NativeSite : Site {
  jaxbind_kernel kernel = nullptr;
  std::vector<NativeKwarg> storage;
  std::vector<jaxbind_kwarg> kwargs;  // views of `storage`, which never moves once made
};

// A registered site is one or the other; the handler asks which.
using AnySite = std::variant<PythonSite, NativeSite>;

// What every site has (its name, key and batch layout), whatever it calls.
inline const Site& BaseSite(const AnySite& site) {
  return std::visit([](const Site& s) -> const Site& { return s; }, site);
}

extern std::atomic<int64_t> g_num_sites;
extern std::atomic<int64_t> g_num_live_sites;
// The live site of a key, or null (a key this process has no live site for).
const AnySite* LookupSite(int64_t key);
// Asks Python to make the site of a key from the call's description; null
// with `error` set when this process cannot (the op is not defined here, ...).
const AnySite* ResolveSite(int64_t key, std::string_view call, std::string* error);
// Whether a compiled program may name `key` with the description `call`: the
// key's live site has exactly that description, or (no live site) Python finds
// that the key is the description's own. Called once per program, when XLA
// instantiates its custom call; false with `error` set otherwise.
bool CheckProgramSite(int64_t key, std::string_view call, std::string* error);
void SetResolver(nb::handle resolve, nb::handle check);
int64_t RegisterSite(int64_t key, std::string description, std::string name, nb::handle callable,
                     nb::bytes kwargs_dump, size_t levels,
                     const std::vector<std::vector<int>>& in_masks, uintptr_t native_address,
                     nb::handle native_kwargs, size_t valid_levels, bool thread_safe, bool tokens,
                     const Exclusive* exclusive,
                     const std::vector<int64_t>& types, size_t n_args, size_t n_rets,
                     size_t free_levels);
void ReleaseSite(int64_t serial);
// The Python site a dispatch calls now, its references in `refs` (with the
// GIL): `site`, or the site made anew for `key` if `site` was released (the
// program outlived its holders); null with `error` set if none can be.
const PythonSite* HoldPythonSite(const PythonSite* site, int64_t key, std::string_view call,
                                 PythonRefs* refs, std::string* error);

// ---- The buffers of a call (buffers.cc) -------------------------------------

void SetBufferTypes(Site& site, const std::vector<int64_t>& types, size_t n_args, size_t n_rets,
                    size_t free_levels);
inline bool BuffersAsRegistered(const Site& site, size_t n_in, void* const* ins, size_t n_out,
                                void* const* outs);
JAXBIND_NOINLINE ffi::Error BuffersRefused(const Site& site, size_t n_in, void* const* ins,
                                           size_t n_out, void* const* outs);

// ---- The GIL and shutdown (gil.cc) ------------------------------------------

// Takes the GIL on any thread, XLA's worker threads included. `held()` is
// false when Python is shutting down: the caller must then not touch Python
// at all, and returns an error result instead.
class GilHold {
 public:
  GilHold();
  ~GilHold();
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

int64_t Shutdown(double timeout);
void KeepForever(nb::handle obj);

// ---- Errors (errors.cc) -----------------------------------------------------

std::string PyUnicodeToString(PyObject* s);
std::string ValidUtf8(const std::string& text);
std::string MessageFromPython(const Site& site, PyObject* outs = nullptr);
ffi::Error ErrorText(const Site* site, const std::string& what);
void SetErrorFormatter(nb::handle fn);

// ---- Views of XLA's buffers (views.cc) --------------------------------------

// Tables indexed by XLA_FFI_DataType code, filled by set_dtype at import.
constexpr int kNumDtypeCodes = 64;
extern PyArray_Descr* g_descr[kNumDtypeCodes];  // nullptr: not supported
extern int64_t g_itemsize[kNumDtypeCodes];      // 0: not supported

inline int64_t ItemSize(int64_t code) {
  return code >= 0 && code < kNumDtypeCodes ? g_itemsize[code] : 0;
}

char* ElementData(void* buffer, int64_t offset);
int InputSkip(const Site& site, size_t i);
PyObject* MakeView(const XLA_FFI_Buffer* buf, char* data, int skip_dims, bool writable);
PyObject* ViewTuple(PyObject* cached, void* const* buffers, int64_t n, const int64_t* offsets,
                    const Site& site, int fixed_skip, bool writable);
bool Kept(PyObject* tuple, Py_ssize_t ours);
bool KeptAfterCollecting(PyObject* in_tuple, Py_ssize_t ours_in, PyObject* out_tuple,
                         Py_ssize_t ours_out);
void RetireViews(PyObject* in_tuple, PyObject* out_tuple, bool overlapping);
void SetDtype(int code, nb::handle dtype);
void SetOverlapRetirer(nb::handle fn);
void RetireArray(nb::handle array);

// ---- The checking mode (checking.cc) ----------------------------------------

extern std::atomic<bool> g_check_unwritten;
extern std::atomic<bool> g_spread_walks;
void FillSentinel(size_t n_in, void* const* ins, size_t n_out, void* const* outs);
std::string FindUnwritten(size_t n_in, void* const* ins, size_t n_out, void* const* outs);

// ---- Calls (python_call.cc, native_call.cc, padded.cc) ---------------------

// A dispatch of a Python site: the GIL, the site's references, the call.
ffi::Error CallPython(const PythonSite* site, int64_t key, std::string_view call,
                      const XLA_FFI_Args* args, const XLA_FFI_Rets* rets, ffi::ThreadPool* pool);
// With the GIL held and the site's references in `refs`.
ffi::Error RunPython(const PythonSite& site, const PythonRefs& refs, const XLA_FFI_Args* args,
                     const XLA_FFI_Rets* rets, ffi::ThreadPool* pool);
ffi::Error RunNative(const NativeSite& site, size_t n_in, void* const* ins, size_t n_out,
                     void* const* outs, ffi::ThreadPool* pool);
ffi::Error RunNativeChecked(const NativeSite& site, size_t n_in, void* const* ins, size_t n_out,
                            void* const* outs, ffi::ThreadPool* pool);
// Out of line, so that padding does not change the code of calls without it.
JAXBIND_NOINLINE ffi::Error RunNativeWholePadded(const NativeSite& site, size_t n_in,
                                                 void* const* ins, size_t n_out, void* const* outs,
                                                 ffi::ThreadPool* pool);
JAXBIND_NOINLINE ffi::Error RunPythonWholePadded(const PythonSite& site, const PythonRefs& refs,
                                                 const XLA_FFI_Args* args,
                                                 const XLA_FFI_Rets* rets);
void SetNativeKwargs(NativeSite& site, nb::handle native_kwargs);

// ---- The module (module.cc, diagnostics.cc, eager.cc) -----------------------

void AddDiagnostics(nb::module_& m);
void AddOpCall(nb::module_& m);
void AddFingerprints(nb::module_& m);

}  // namespace

// The handlers (handlers.cc), handed to JAX as capsules.
extern "C" XLA_FFI_Error* jaxbind_dispatch(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* jaxbind_dispatch_async(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* jaxbind_instantiate(XLA_FFI_CallFrame* call_frame);

#endif  // JAXBIND_CSRC_INTERNAL_H_

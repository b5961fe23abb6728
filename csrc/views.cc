// NumPy views of XLA's buffers: dtype tables, view tuples and their cache, kept views, retirement.

#include "internal.h"

namespace {

PyArray_Descr* g_descr[kNumDtypeCodes] = {};
int64_t g_itemsize[kNumDtypeCodes] = {};
// Where views of zero-size buffers point (see ElementData).
alignas(64) char g_empty_storage[64];
// Where retired 0-d views point: scratch nobody reads.
alignas(64) char g_retired_storage[64];

// Finds and cuts off every other array that reaches the memory of kept views
// (slices, DLPack imports, memoryviews); set once at import. Called with a
// list of the views before they are retired, so that it can read their memory.
PyObject* g_retire_overlapping = nullptr;

void SetDtype(int code, nb::handle dtype) {
  if (code < 0 || code >= kNumDtypeCodes) throw nb::value_error("dtype code out of range");
  PyArray_Descr* descr = nullptr;
  if (!PyArray_DescrConverter(dtype.ptr(), &descr)) throw nb::python_error();
  PyArray_Descr* old = g_descr[code];
  g_descr[code] = descr;  // keeps the new reference
  g_itemsize[code] = PyDataType_ELSIZE(descr);
  Py_XDECREF(old);
}

void SetOverlapRetirer(nb::handle fn) {
  Py_XINCREF(fn.ptr());
  Py_XDECREF(g_retire_overlapping);
  g_retire_overlapping = fn.ptr();
}

// The first byte of one batch element of a buffer. Zero-size buffers may come
// with a null data pointer, which NumPy would take as "allocate": point those
// at a small static block instead.
char* ElementData(void* buffer, int64_t offset) {
  char* data = static_cast<char*>(static_cast<XLA_FFI_Buffer*>(buffer)->data);
  return data != nullptr ? data + offset : g_empty_storage;
}

// How many leading dimensions of input `i` are batch levels the handler walks.
int InputSkip(const Site& site, size_t i) { return site.in_mapped.empty() ? 0 : site.in_mapped[i]; }

// A NumPy array over XLA's memory (`data`, never null): no copy, read-only for inputs.
PyObject* MakeView(const XLA_FFI_Buffer* buf, char* data, int skip_dims, bool writable) {
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

// A tuple of views of `n` buffers at byte offsets (null: all 0, a call without
// a walk): the cached tuple re-pointed when it can be, else a new one.
// `fixed_skip` < 0: each input skips its own mapped dims. Returns a new
// reference or null.
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
          ElementData(buffers[i], offsets != nullptr ? offsets[i] : 0);
    }
    Py_INCREF(cached);
    return cached;
  }
  PyObject* tuple = PyTuple_New(n);
  for (int64_t i = 0; tuple != nullptr && i < n; ++i) {
    PyObject* view = MakeView(static_cast<XLA_FFI_Buffer*>(buffers[i]),
                              ElementData(buffers[i], offsets != nullptr ? offsets[i] : 0),
                              skip_of(i), writable);
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
  // The empty tuple is CPython's one shared object (an op with no inputs): it views nothing.
  if (PyTuple_GET_SIZE(tuple) == 0) return false;
  if (Py_REFCNT(tuple) != ours) return true;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); ++i) {
    if (ViewKept(PyTuple_GET_ITEM(tuple, i))) return true;
  }
  return false;
}

// Cuts an array off the memory it views: it becomes empty (0-d: a scratch
// element) and read-only, so that whoever kept it can never reach XLA's memory.
void Retire(PyObject* array) {
  auto* fields = reinterpret_cast<PyArrayObject_fields*>(array);
  fields->data = fields->nd > 0 ? g_empty_storage : g_retired_storage;
  for (int d = 0; d < fields->nd; ++d) fields->dimensions[d] = 0;
  PyArray_CLEARFLAGS(reinterpret_cast<PyArrayObject*>(array), NPY_ARRAY_WRITEABLE);
  PyArray_UpdateFlags(reinterpret_cast<PyArrayObject*>(array), NPY_ARRAY_UPDATE_ALL);
}

// Cuts a flat iterator (`a.flat`, an iterator of np.broadcast) off its array:
// it copied the array's data pointer and shape when it was made, so retiring
// the array alone leaves it reading the old memory. With no elements left it
// iterates nothing and every index is out of range.
void RetireFlatIterator(PyArrayIterObject* it) {
  it->size = 0;
  it->index = 0;
  it->dataptr = g_retired_storage;
}

// The module's `retire`: cuts off what Python found reaching a kept view's
// memory: an array (Retire), a flat iterator, or an np.broadcast object and
// its iterators.
void RetireArray(nb::handle obj) {
  PyObject* o = obj.ptr();
  if (PyArrayIter_Check(o)) {
    RetireFlatIterator(reinterpret_cast<PyArrayIterObject*>(o));
    return;
  }
  if (PyObject_TypeCheck(o, &PyArrayMultiIter_Type)) {
    auto* multi = reinterpret_cast<PyArrayMultiIterObject*>(o);
    multi->size = 0;
    multi->index = 0;
    for (int i = 0; i < multi->numiter; ++i) RetireFlatIterator(multi->iters[i]);
    return;
  }
  if (!PyArray_Check(o))
    throw nb::type_error("not a NumPy array, flat iterator or broadcast object");
  if (PyArray_CHKFLAGS(reinterpret_cast<PyArrayObject*>(o), NPY_ARRAY_OWNDATA)) {
    throw nb::value_error("the array owns its memory");
  }
  Retire(o);
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
  // gc.collect, looked up once. Atomic: with the GIL off two threads may look it up at once (the
  // one that loses drops its own); not a function-local static, whose guard would be held across
  // an import that can switch threads (a thread waiting on it with the GIL would deadlock).
  static std::atomic<PyObject*> g_collect{nullptr};
  PyObject* collect = g_collect.load(std::memory_order_acquire);
  if (collect == nullptr) {
    PyObject* gc = PyImport_ImportModule("gc");
    PyObject* found = gc != nullptr ? PyObject_GetAttrString(gc, "collect") : nullptr;
    Py_XDECREF(gc);
    if (found == nullptr) {
      PyErr_Clear();
    } else if (g_collect.compare_exchange_strong(collect, found, std::memory_order_acq_rel)) {
      collect = found;  // (kept for the life of the process)
    } else {
      Py_DECREF(found);  // another thread's is kept; `collect` now holds it
    }
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

// Retires every view of the tuples (null entries are skipped); with `overlapping`,
// first whatever else reaches the memory of a view that someone still holds.
void RetireViews(PyObject* in_tuple, PyObject* out_tuple, bool overlapping) {
  PyObject* held = overlapping ? PyList_New(0) : nullptr;
  for (PyObject* tuple : {in_tuple, out_tuple}) {
    for (Py_ssize_t i = 0; held != nullptr && tuple != nullptr && i < PyTuple_GET_SIZE(tuple);
         ++i) {
      PyObject* view = PyTuple_GET_ITEM(tuple, i);
      if (ViewKept(view)) PyList_Append(held, view);
    }
  }
  if (held != nullptr && PyList_GET_SIZE(held) > 0 && g_retire_overlapping != nullptr) {
    PyObject* result = PyObject_CallOneArg(g_retire_overlapping, held);
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

}  // namespace

// Op.__call__ in C: an eager call that the op has made before goes straight to its jitted call.
//
// An op called in a script's loop (no kwargs, JAX or NumPy arrays in native
// byte order, an arity it was called with before) only forwards to the jitted
// call it keeps for that arity (Op._plain, filled by the Python path on the
// first such call).
// Written in Python, that forwarding cost ~0.4 µs of a ~4.5 µs eager call; as
// a method descriptor (vectorcall, no frame, no tuple of arguments) it costs
// a few dozen nanoseconds. Everything else, first calls, kwargs, tracers,
// other types, runs the Python method (Op._call), which decides as before.

#include "internal.h"
#include "walk.h"  // SmallBuffer

#if PY_VERSION_HEX < 0x030C0000
#include <structmember.h>  // T_OBJECT_EX (Py_T_OBJECT_EX from Python 3.12)
#endif

namespace {

constexpr int kStringDTypeNum = 2056;  // NPY_VSTRING (NumPy 2's StringDType; not in older headers)

struct OpCallState {
  Py_ssize_t plain_offset = 0;  // where an op keeps its dict: arity -> jitted call
  PyObject* slow = nullptr;     // Op._call(self, *args, **kwargs)
  PyObject* failed =
      nullptr;  // _raise_failed_call(err): what a ValueError of the jitted call becomes
  PyTypeObject* concrete[2] = {nullptr, nullptr};  // the argument types of the fast path, exactly
  std::string doc;                                 // Op._call's docstring, with the signature
  PyMethodDef def{};  // lives as long as the descriptor made from it: for good
};
OpCallState g_op_call;

// Whether JAX takes a NumPy array as it is. Not one in the other byte order:
// JAX's warm dispatch reads its bytes as native ones (wrong values, silently)
// where its first call refuses it; Op._call converts it to native order. Nor
// one of a dtype JAX has no type for (object to timedelta, StringDType), which
// Op._call refuses naming the op (and passes float0, a void dtype of JAX's).
bool JaxReady(PyArrayObject* array) {
  const PyArray_Descr* descr = PyArray_DESCR(array);
  if (!PyArray_ISNBO(descr->byteorder)) return false;
  const int num = descr->type_num;
  return (num < NPY_OBJECT || num > NPY_TIMEDELTA) && num != kStringDTypeNum;
}

bool Concrete(PyObject* const* args, Py_ssize_t n) {
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyTypeObject* type = Py_TYPE(args[i]);
    if (type == g_op_call.concrete[0]) continue;
    if (type != g_op_call.concrete[1] || !JaxReady(reinterpret_cast<PyArrayObject*>(args[i]))) {
      return false;
    }
  }
  return true;
}

// The jitted call the op keeps for n arguments (a new reference), or nullptr
// without an error set.
PyObject* PlainCall(PyObject* self, Py_ssize_t n) {
  PyObject* plain =
      *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(self) + g_op_call.plain_offset);
  if (plain == nullptr || !PyDict_CheckExact(plain) || PyDict_GET_SIZE(plain) == 0) return nullptr;
  PyObject* key = PyLong_FromSsize_t(n);  // a cached small int
  if (key == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  PyObject* call = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  if (PyDict_GetItemRef(plain, key, &call) < 0) PyErr_Clear();
#else
  call = PyDict_GetItemWithError(plain, key);
  if (call == nullptr) PyErr_Clear();
  Py_XINCREF(call);
#endif
  Py_DECREF(key);
  return call;
}

// A ValueError raised by the jitted call: Python decides what the eager call
// raises (a callback's failure, as the first call raises it).
PyObject* RaiseFailedCall() {
#if PY_VERSION_HEX >= 0x030C0000
  PyObject* err = PyErr_GetRaisedException();
#else
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyErr_NormalizeException(&type, &value, &traceback);
  if (traceback != nullptr) PyException_SetTraceback(value, traceback);
  Py_XDECREF(type);
  Py_XDECREF(traceback);
  PyObject* err = value;
#endif
  PyObject* result = PyObject_CallOneArg(g_op_call.failed, err);
  Py_DECREF(err);
  Py_XDECREF(result);  // (it raises: result is nullptr)
  return nullptr;
}

// The Python method, with self in front of the arguments.
PyObject* CallSlow(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  const Py_ssize_t n_kw = kwnames != nullptr ? PyTuple_GET_SIZE(kwnames) : 0;
  const size_t total = static_cast<size_t>(nargs + n_kw) + 1;
  SmallBuffer<PyObject*> stack(total);
  stack[0] = self;
  std::copy(args, args + nargs + n_kw, stack.data() + 1);
  return PyObject_Vectorcall(g_op_call.slow, stack.data(), static_cast<size_t>(nargs) + 1, kwnames);
}

PyObject* OpCall(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  if ((kwnames == nullptr || PyTuple_GET_SIZE(kwnames) == 0) && Concrete(args, nargs)) {
    if (PyObject* call = PlainCall(self, nargs)) {
      PyObject* result = PyObject_Vectorcall(call, args, static_cast<size_t>(nargs), nullptr);
      Py_DECREF(call);
      if (result == nullptr && PyErr_ExceptionMatches(PyExc_ValueError)) return RaiseFailedCall();
      return result;
    }
  }
  return CallSlow(self, args, nargs, kwnames);
}

// The descriptor to install as cls.__call__: reads the dict in cls's slot
// `plain_slot`, runs `slow` otherwise. Made once per process.
nb::object MakeOpCall(nb::handle cls, const char* plain_slot, nb::handle slow, nb::handle failed,
                      nb::handle array_type, nb::handle ndarray_type) {
  if (g_op_call.slow != nullptr) throw nb::value_error("the op call is made once per process");
  if (!PyType_Check(cls.ptr()) || !PyType_Check(array_type.ptr()) ||
      ndarray_type.ptr() != reinterpret_cast<PyObject*>(&PyArray_Type)) {
    throw nb::type_error("make_op_call: cls and array_type must be types, ndarray_type np.ndarray");
  }
  nb::object slot = nb::getattr(cls, plain_slot, nb::none());  // (the class's member descriptor)
  PyObject* member = slot.ptr();
  if (!Py_IS_TYPE(member, &PyMemberDescr_Type) ||
      reinterpret_cast<PyDescrObject*>(member)->d_type !=
          reinterpret_cast<PyTypeObject*>(cls.ptr())) {
    throw nb::type_error("make_op_call: the dict of jitted calls must be a slot of the class");
  }
  const PyMemberDef* def = reinterpret_cast<PyMemberDescrObject*>(member)->d_member;
#if PY_VERSION_HEX >= 0x030C0000
  const bool object_slot = def->type == Py_T_OBJECT_EX;
#else
  const bool object_slot = def->type == T_OBJECT_EX;
#endif
  if (!object_slot) throw nb::type_error("make_op_call: the slot must hold an object");
  g_op_call.plain_offset = def->offset;
  g_op_call.slow = nb::borrow(slow).release().ptr();
  g_op_call.failed = nb::borrow(failed).release().ptr();
  g_op_call.concrete[0] = reinterpret_cast<PyTypeObject*>(nb::borrow(array_type).release().ptr());
  g_op_call.concrete[1] = reinterpret_cast<PyTypeObject*>(nb::borrow(ndarray_type).release().ptr());
  nb::object doc = nb::getattr(slow, "__doc__", nb::none());
  g_op_call.doc = "__call__($self, /, *args, **kwargs)\n--\n\n" +
                  (doc.is_none() ? std::string() : nb::cast<std::string>(doc));
  g_op_call.def =
      PyMethodDef{"__call__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&OpCall)),
                  METH_FASTCALL | METH_KEYWORDS, g_op_call.doc.c_str()};
  PyObject* descriptor =
      PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), &g_op_call.def);
  if (descriptor == nullptr) throw nb::python_error();
  return nb::steal(descriptor);
}

void AddOpCall(nb::module_& m) {
  m.def("make_op_call", &MakeOpCall, nb::arg("cls"), nb::arg("plain_slot"), nb::arg("slow"),
        nb::arg("failed"), nb::arg("array_type"), nb::arg("ndarray_type"),
        "The method descriptor for cls.__call__: a call without kwargs whose arguments are all "
        "exactly array_type or ndarray_type (in native byte order), and whose arity has a jitted "
        "call in the dict in "
        "slot plain_slot, calls it (a ValueError it raises goes to failed(err), which raises); "
        "every other call runs slow(self, *args, **kwargs).");
}

}  // namespace

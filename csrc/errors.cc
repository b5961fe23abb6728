// The messages of the errors a call becomes: a callback's exception, the handler's own failures.

#include "internal.h"

namespace {

// Turns (op name, exception) into the message an error carries; set once at import.
PyObject* g_format_error = nullptr;

void SetErrorFormatter(nb::handle fn) {
  Py_XINCREF(fn.ptr());
  Py_XDECREF(g_format_error);
  g_format_error = fn.ptr();
}

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

}  // namespace

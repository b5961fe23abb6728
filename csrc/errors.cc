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

// A Python string as UTF-8; lone surrogates (a message decoded with
// surrogateescape, say) are written as \udcXX escapes rather than lost.
std::string PyUnicodeToString(PyObject* s) {
  if (s == nullptr || !PyUnicode_Check(s)) return std::string();
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(s, &size);
  if (data != nullptr) return std::string(data, size);
  PyErr_Clear();
  PyObject* bytes = PyUnicode_AsEncodedString(s, "utf-8", "backslashreplace");
  std::string text = bytes != nullptr
                         ? std::string(PyBytes_AS_STRING(bytes), PyBytes_GET_SIZE(bytes))
                         : std::string();
  Py_XDECREF(bytes);
  PyErr_Clear();
  return text;
}

// `text` as valid UTF-8: every byte that does not begin a well-formed sequence
// (a kernel's message in Latin-1, one cut in the middle of a character by its
// buffer's size) becomes a \xNN escape. XLA's status carries bytes, and JAX
// decodes them as UTF-8: an invalid byte would become a UnicodeDecodeError
// that names no op instead of the message.
std::string ValidUtf8(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  const auto* s = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = s[i];
    size_t len = c < 0x80           ? 1
                 : (c >> 5) == 0x6  ? 2
                 : (c >> 4) == 0xE  ? 3
                 : (c >> 3) == 0x1E ? 4
                                    : 0;
    bool ok = len != 0 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) ok = (s[i + k] & 0xC0) == 0x80;
    if (ok && len > 1) {  // no overlong forms, surrogates or code points past U+10FFFF
      const unsigned char d = s[i + 1];
      ok = !(len == 2 && c < 0xC2) && !(len == 3 && c == 0xE0 && d < 0xA0) &&
           !(len == 3 && c == 0xED && d >= 0xA0) && !(len == 4 && c == 0xF0 && d < 0x90) &&
           !(len == 4 && (c > 0xF4 || (c == 0xF4 && d >= 0x90)));
    }
    if (ok) {
      out.append(text, i, len);
      i += len;
    } else {
      static const char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 0xF];
      i += 1;
    }
  }
  return out;
}

// Consumes the pending Python exception (dropping its traceback, and so the
// callback's frames) and returns the message of the error it becomes. `outs`:
// the callback's output views, whose shapes the message may name (or nullptr).
std::string MessageFromPython(const Site& site, PyObject* outs) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (tb != nullptr && value != nullptr) PyException_SetTraceback(value, tb);
  std::string message;
  if (g_format_error != nullptr && value != nullptr) {
    PyObject* name = PyUnicode_FromStringAndSize(site.name.data(), site.name.size());
    PyObject* text = name ? PyObject_CallFunctionObjArgs(g_format_error, name, value,
                                                         outs != nullptr ? outs : Py_None, nullptr)
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
  return ffi::Error(ffi::ErrorCode::kInternal, ValidUtf8("jaxbind " + name + ": " + what));
}

}  // namespace

// The _diag_* probes of bench/overhead.py: the cost of each step of the per-call path, alone.

#include <chrono>
#include <thread>

#include "internal.h"

namespace {

double NsSince(std::chrono::steady_clock::time_point start, int64_t n) {
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start)
             .count() /
         n;
}

// Each probe returns nanoseconds per iteration.
void AddDiagnostics(nb::module_& m) {
  m.def(
      "_diag_gil",
      [](int64_t n, bool worker) {
        auto loop = [n]() {
          auto t0 = std::chrono::steady_clock::now();
          for (int64_t i = 0; i < n; ++i) {
            GilHold gil;
          }
          return NsSince(t0, n);
        };
        double ns = 0.0;
        nb::gil_scoped_release release;  // as XLA runs: the launching thread gave up the GIL
        if (worker) {
          std::thread t([&]() {
            loop();
            ns = loop();
          });  // the first loop makes the thread state
          t.join();
        } else {
          ns = loop();
        }
        return ns;
      },
      nb::arg("n"), nb::arg("worker"),
      "Take and release the GIL n times from a thread without it (an XLA worker thread, or this "
      "one).");

  m.def(
      "_diag_views",
      [](int64_t n) {
        int64_t dims[1] = {1};
        double in_data = 1.0, out_data = 0.0;
        XLA_FFI_Buffer in_buf{
            sizeof(XLA_FFI_Buffer), nullptr, XLA_FFI_DataType_F64, &in_data, 1, dims};
        XLA_FFI_Buffer out_buf = in_buf;
        out_buf.data = &out_data;
        auto t0 = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < n; ++i) {
          PyObject* in_tuple = PyTuple_New(1);
          PyObject* out_tuple = PyTuple_New(1);
          PyTuple_SET_ITEM(in_tuple, 0,
                           MakeView(&in_buf, static_cast<char*>(in_buf.data), 0, false));
          PyTuple_SET_ITEM(out_tuple, 0,
                           MakeView(&out_buf, static_cast<char*>(out_buf.data), 0, true));
          Py_DECREF(in_tuple);
          Py_DECREF(out_tuple);
        }
        return NsSince(t0, n);
      },
      nb::arg("n"), "Make and free the (out, args) tuples of 1-element views n times.");

  m.def(
      "_diag_call",
      [](nb::handle fn, nb::handle out, nb::handle args, nb::handle kwargs, int64_t n) {
        PyObject* argv[3] = {out.ptr(), args.ptr(), kwargs.ptr()};
        auto t0 = std::chrono::steady_clock::now();
        for (int64_t i = 0; i < n; ++i) {
          PyObject* result = PyObject_Vectorcall(fn.ptr(), argv, 3, nullptr);
          if (result == nullptr) throw nb::python_error();
          Py_DECREF(result);
        }
        return NsSince(t0, n);
      },
      nb::arg("fn"), nb::arg("out"), nb::arg("args"), nb::arg("kwargs_dump"), nb::arg("n"),
      "Call fn(out, args, kwargs_dump) n times from C.");
}

}  // namespace

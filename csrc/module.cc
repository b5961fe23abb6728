// The Python module _trampoline: the handlers, registration, the setters, and jaxbind.h's codes.

#include <cctype>

#include "internal.h"

namespace {

struct NamedCode {
  const char* name;
  int64_t code;
};

// Named as jaxbind.h names them (exported lower-case, which for dtypes is
// NumPy's and ml_dtypes' spelling), valued by the header: the codes are
// written down nowhere else, and a misspelled entry does not compile.
#define JAXBIND_DTYPE(NAME) \
  NamedCode { #NAME, JAXBIND_##NAME }
constexpr NamedCode kDtypeCodes[] = {
    JAXBIND_DTYPE(BOOL),
    JAXBIND_DTYPE(INT8),
    JAXBIND_DTYPE(INT16),
    JAXBIND_DTYPE(INT32),
    JAXBIND_DTYPE(INT64),
    JAXBIND_DTYPE(UINT8),
    JAXBIND_DTYPE(UINT16),
    JAXBIND_DTYPE(UINT32),
    JAXBIND_DTYPE(UINT64),
    JAXBIND_DTYPE(FLOAT16),
    JAXBIND_DTYPE(FLOAT32),
    JAXBIND_DTYPE(FLOAT64),
    JAXBIND_DTYPE(COMPLEX64),
    JAXBIND_DTYPE(BFLOAT16),
    JAXBIND_DTYPE(COMPLEX128),
    JAXBIND_DTYPE(FLOAT8_E5M2),
    JAXBIND_DTYPE(FLOAT8_E4M3FN),
    JAXBIND_DTYPE(FLOAT8_E4M3B11FNUZ),
    JAXBIND_DTYPE(FLOAT8_E5M2FNUZ),
    JAXBIND_DTYPE(FLOAT8_E4M3FNUZ),
    JAXBIND_DTYPE(FLOAT8_E4M3),
    JAXBIND_DTYPE(FLOAT8_E3M4),
};
#undef JAXBIND_DTYPE

#define JAXBIND_KWARG(NAME) \
  NamedCode { #NAME, JAXBIND_KW_##NAME }
constexpr NamedCode kKwargTypes[] = {
    JAXBIND_KWARG(INT),    JAXBIND_KWARG(FLOAT),     JAXBIND_KWARG(BOOL),
    JAXBIND_KWARG(STRING), JAXBIND_KWARG(INT_ARRAY), JAXBIND_KWARG(FLOAT_ARRAY),
};
#undef JAXBIND_KWARG

template <size_t N>
nb::dict CodeTable(const NamedCode (&table)[N]) {
  nb::dict codes;
  for (const NamedCode& entry : table) {
    std::string name(entry.name);
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    codes[name.c_str()] = entry.code;
  }
  return codes;
}

uintptr_t CapsulePointer(nb::handle capsule) {
  if (!PyCapsule_CheckExact(capsule.ptr())) throw nb::type_error("not a PyCapsule");
  void* ptr = PyCapsule_GetPointer(capsule.ptr(), PyCapsule_GetName(capsule.ptr()));
  if (ptr == nullptr) throw nb::python_error();
  return reinterpret_cast<uintptr_t>(ptr);
}

}  // namespace

NB_MODULE(_trampoline, m) {
  if (PyArray_ImportNumPyAPI() < 0) throw nb::python_error();
  m.doc() = "jaxbind's compiled core: the XLA custom-call handler and its registry.";
  m.attr("DTYPE_CODES") = CodeTable(kDtypeCodes);
  m.attr("KWARG_TYPES") = CodeTable(kKwargTypes);

  m.def(
      "handler", []() { return nb::capsule(reinterpret_cast<void*>(&jaxbind_dispatch)); },
      "The XLA FFI handler, as a capsule for jax.ffi.register_ffi_target.");
  m.def(
      "async_handler",
      []() { return nb::capsule(reinterpret_cast<void*>(&jaxbind_dispatch_async)); },
      "The XLA FFI handler of concurrent native kernels (runs them on XLA's thread pool).");
  m.def(
      "instantiate_handler",
      []() { return nb::capsule(reinterpret_cast<void*>(&jaxbind_instantiate)); },
      "The instantiate stage of both targets: checks once per compiled program that each "
      "call's key and description belong together.");

  m.def(
      "register_site",
      [](int64_t key, std::string description, std::string name, nb::handle callable,
         nb::bytes kwargs_dump, size_t levels, std::vector<std::vector<int>> in_masks,
         uintptr_t native_address, nb::list native_kwargs, size_t valid_levels, bool thread_safe,
         bool tokens, const Exclusive* exclusive, std::vector<int64_t> types, size_t n_args,
         size_t n_rets, size_t free_levels) {
        return RegisterSite(key, std::move(description), std::move(name), callable, kwargs_dump,
                            levels, in_masks, native_address, native_kwargs, valid_levels,
                            thread_safe, tokens, exclusive, types, n_args, n_rets, free_levels);
      },
      nb::arg("key"), nb::arg("description"), nb::arg("name"), nb::arg("callable").none(),
      nb::arg("kwargs_dump"), nb::arg("levels"), nb::arg("in_masks"), nb::arg("native_address"),
      nb::arg("native_kwargs"), nb::arg("valid_levels"), nb::arg("thread_safe"), nb::arg("tokens"),
      nb::arg("exclusive").none(), nb::arg("types"),
      nb::arg("n_args"), nb::arg("n_rets"), nb::arg("free_levels"),
      "Register the call site programs name by `key` and describe by `description` (a Python "
      "callable, or a native kernel "
      "when native_address is not 0); returns its serial number, for release_site. The "
      "callable and kwargs_dump are borrowed: the caller keeps them alive until it releases "
      "the site. With valid_levels, the last input is the validity operand of a padded batch; a "
      "thread_safe Python callback's walks may spread over XLA's thread pool. tokens: calls pass an "
      "ordering token first among inputs and outputs (an ordered op); exclusive: an Exclusive whose "
      "lock every call holds (an op with an effect), or None. types: per buffer "
      "(inputs, then outputs) its dtype code, rank and dims, which every call's buffers must "
      "have (only the free_levels leading dims may be smaller, alike in every buffer).");
  nb::class_<Exclusive>(m, "Exclusive", nb::is_weak_referenceable(),
                        "A lock that every call of the sites registered with it holds: the calls "
                        "of an op with an effect never overlap.")
      .def(nb::init<>());
  m.def("release_site", &ReleaseSite, nb::arg("serial"),
        "Free a site: nothing calls it again (a program naming its key resolves it anew).");
  m.def("set_resolver", &SetResolver, nb::arg("resolve"), nb::arg("check"),
        "Set the functions (key, description) -> None that make the site of a key this process "
        "has none for (resolve) and accept a compiled program's key and description (check), "
        "or raise why they cannot.");
  m.def("num_sites", []() { return g_num_sites.load(); }, "Number of call sites ever made.");
  m.def(
      "num_live_sites", []() { return g_num_live_sites.load(); },
      "Number of call sites not yet released.");

  m.def("set_dtype", &SetDtype, nb::arg("code"), nb::arg("dtype"),
        "Map an XLA FFI dtype code to a NumPy dtype.");
  m.def("set_overlap_retirer", &SetOverlapRetirer,
        "Set the function (list of kept views) -> None that cuts off every other array reaching "
        "their memory; it is called before the views themselves are retired.");
  m.def("set_error_formatter", &SetErrorFormatter,
        "Set the function (op_name, exception, outs) -> str used for callback errors (outs: the "
        "callback's output views, or None).");
  m.def(
      "set_check_unwritten", [](bool on) { g_check_unwritten.store(on); }, nb::arg("on"),
      "Fill outputs with a sentinel before every callback and report elements left unwritten.");

  m.def(
      "set_spread_walks", [](bool on) { g_spread_walks.store(on); }, nb::arg("on"),
      "Spread every walk of a thread-safe Python callback over the pool, however short its "
      "elements (check_op's thread-safety check).");
  m.def("retire", &RetireArray,
        "Cut an object off the memory it reaches: a view that does not own its memory becomes "
        "empty and read-only; a flat iterator or an np.broadcast object iterates nothing.");
  m.def("shutdown", &Shutdown, nb::arg("timeout"),
        "Refuse new Python callbacks and wait up to `timeout` seconds for the running ones "
        "(jaxbind's atexit hook). Returns how many still run.");
  m.def("keep_forever", &KeepForever, nb::arg("obj"),
        "Keep `obj` alive until the process ends (the exit hook keeps JAX's clients so when a "
        "callback outlived its wait: their thread pools would join a thread CPython parked).");
  m.def("capsule_pointer", &CapsulePointer, "The pointer a PyCapsule holds, whatever its name.");

  AddDiagnostics(m);
  AddOpCall(m);
  AddFingerprints(m);
}

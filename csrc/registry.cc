// The registry of call sites: made by Python at trace time (or when a program
// made elsewhere names a site this process has not made yet), read lock-free
// by XLA's threads.

#include <algorithm>
#include <mutex>

#include "internal.h"

namespace {

// A compiled program names a site by its key: a 63-bit digest of what defines
// the call (jaxbind/_sites.py), the same in every process that defines the
// same op. The key table maps keys to sites, open-addressed, read without a
// lock: an entry's site is written before its key, readers load the key first.
// Entries are never removed; a freed site stays in place as a dead shell
// (a few hundred bytes: its name and layout), so that a pointer read once
// stays valid, and a key whose site died can be bound to a new one.
struct KeyEntry {
  std::atomic<int64_t> key{0};  // 0: empty
  std::atomic<AnySite*> site{nullptr};
};

struct KeyTable {
  explicit KeyTable(int64_t capacity) : capacity(capacity), entries(new KeyEntry[capacity]) {}
  int64_t capacity;  // a power of two
  std::unique_ptr<KeyEntry[]> entries;
};

std::atomic<KeyTable*> g_keys{new KeyTable(1024)};
std::vector<std::unique_ptr<KeyTable>> g_old_tables;  // outgrown: readers may still be in them
std::vector<std::unique_ptr<AnySite>> g_all_sites;    // by serial number, never freed
int64_t g_num_keys = 0;
std::atomic<int64_t> g_num_sites{0};
std::atomic<int64_t> g_num_live_sites{0};
std::mutex g_register_mutex;

// Keys are digests already: their low bits are a good hash.
KeyEntry* Probe(KeyTable* table, int64_t key) {
  const int64_t mask = table->capacity - 1;
  for (int64_t i = key & mask;; i = (i + 1) & mask) {
    KeyEntry& e = table->entries[i];
    const int64_t k = e.key.load(std::memory_order_acquire);
    if (k == key || k == 0) return &e;
  }
}

// Under g_register_mutex.
void Bind(int64_t key, AnySite* site) {
  KeyTable* table = g_keys.load(std::memory_order_relaxed);
  KeyEntry* e = Probe(table, key);
  if (e->key.load(std::memory_order_relaxed) == key) {  // a dead site's key, bound anew
    e->site.store(site, std::memory_order_release);
    return;
  }
  if (2 * (g_num_keys + 1) > table->capacity) {  // grow: copy, then publish the copy
    auto bigger = std::make_unique<KeyTable>(table->capacity * 2);
    for (int64_t i = 0; i < table->capacity; ++i) {
      const int64_t k = table->entries[i].key.load(std::memory_order_relaxed);
      if (k == 0) continue;
      KeyEntry* moved = Probe(bigger.get(), k);
      moved->site.store(table->entries[i].site.load(std::memory_order_relaxed),
                        std::memory_order_relaxed);
      moved->key.store(k, std::memory_order_relaxed);
    }
    KeyTable* published = bigger.release();
    g_keys.store(published, std::memory_order_release);
    g_old_tables.emplace_back(table);
    table = published;
    e = Probe(table, key);
  }
  e->site.store(site, std::memory_order_release);
  e->key.store(key, std::memory_order_release);
  ++g_num_keys;
}

// The live site a program's key names, or null (not made here, or freed).
const AnySite* LookupSite(int64_t key) {
  if (key <= 0) return nullptr;
  KeyEntry* e = Probe(g_keys.load(std::memory_order_acquire), key);
  if (e->key.load(std::memory_order_acquire) != key) return nullptr;
  const AnySite* site = e->site.load(std::memory_order_acquire);
  if (site == nullptr || !BaseSite(*site).alive.load(std::memory_order_acquire)) return nullptr;
  return site;
}

// Called with a key this process has no live site for: (key, the call's
// description) -> None, having registered the site, or raises why it cannot.
PyObject* g_resolver = nullptr;
// (key, the description a program carries) -> None if the program may name
// that key with it, or raises why not (jaxbind/_programs.py's check_program).
PyObject* g_program_checker = nullptr;

void SetResolver(nb::handle resolve, nb::handle check) {
  Py_XINCREF(resolve.ptr());
  Py_XINCREF(check.ptr());
  Py_XDECREF(g_resolver);
  Py_XDECREF(g_program_checker);
  g_resolver = resolve.ptr();
  g_program_checker = check.ptr();
}

// Calls fn(key, description) with the GIL; false with `error` set to the
// message of what it raised.
bool CallWithDescription(PyObject* fn, int64_t key, std::string_view call, std::string* error) {
  GilHold gil;
  if (!gil.held()) {
    *error =
        "jaxbind: the program's call site was not resolved: the Python interpreter is "
        "shutting down";
    return false;
  }
  if (fn == nullptr) {
    *error = "jaxbind: internal error: no call-site resolver is set";
    return false;
  }
  PyObject* text =
      PyUnicode_DecodeUTF8(call.data(), static_cast<Py_ssize_t>(call.size()), "replace");
  PyObject* py_key = PyLong_FromLongLong(key);
  PyObject* result =
      text && py_key ? PyObject_CallFunctionObjArgs(fn, py_key, text, nullptr) : nullptr;
  Py_XDECREF(text);
  Py_XDECREF(py_key);
  if (result != nullptr) {
    Py_DECREF(result);
    return true;
  }
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyObject* message = value ? PyObject_Str(value) : nullptr;
  *error = PyUnicodeToString(message);
  if (error->empty()) *error = "jaxbind: the program's call site could not be resolved";
  Py_XDECREF(message);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  PyErr_Clear();
  return false;
}

// A program names a key this process has no live site for: a program made by
// another process (jax.export), or one whose op was freed. Python finds the op
// the description names among those this process defined, or explains why not;
// nothing else can be called.
// The op the resolver found can be freed as it returns (its last other user let it go
// meanwhile, on another thread: the resolver's own reference was the last), and the site with
// it: the resolver then runs again, with the ops that live now.
const AnySite* ResolveSite(int64_t key, std::string_view call, std::string* error) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (!CallWithDescription(g_resolver, key, call, error)) return nullptr;
    if (const AnySite* site = LookupSite(key)) return site;
  }
  *error =
      "jaxbind: the program's call site was released as soon as it was made, three times: the "
      "op it names was freed each time (keep the op alive while its programs run)";
  return nullptr;
}

bool CheckProgramSite(int64_t key, std::string_view call, std::string* error) {
  {
    std::lock_guard<std::mutex> lock(g_register_mutex);
    const AnySite* site = LookupSite(key);
    if (site != nullptr && BaseSite(*site).description == call) return true;
  }
  // Another description under a live site's key, or a key with no live site:
  // Python reads the description and says why it is refused, or that it names
  // itself (its key is its digest) and may be resolved when it is called.
  return CallWithDescription(g_program_checker, key, call, error);
}

// The batch layout, checked: a mask per input and level, and the validity
// operand of a padded walk mapped at every level.
void SetLayout(Site& site, size_t levels, const std::vector<std::vector<int>>& in_masks,
               size_t valid_levels) {
  site.levels = levels;
  for (const auto& mask : in_masks) {
    if (mask.size() != levels) throw nb::value_error("a batch mask per level expected");
    site.in_masks.emplace_back(mask.begin(), mask.end());
    site.in_mapped.push_back(static_cast<int>(levels - std::count(mask.begin(), mask.end(), 0)));
  }
  if (valid_levels != 0 && levels != 0 && valid_levels != levels) {
    throw nb::value_error("a padded walk has the validity operand at every level");
  }
  site.valid_levels = valid_levels;
  if (valid_levels != 0 && levels != 0) {
    site.in_masks.emplace_back(levels, 1);
    site.in_mapped.push_back(static_cast<int>(levels));
  }
}

// A native kernel when `native_address` is not 0 (the Python side's
// convention, kept for its API), else a Python callback. The callable and the
// kwargs are borrowed: the Python handle that owns the site holds them (so
// that the garbage collector sees them) and releases the site before it lets
// them go. Returns the site's serial number, which the handle releases it by.
int64_t RegisterSite(int64_t key, std::string description, std::string name, nb::handle callable,
                     nb::bytes kwargs_dump, size_t levels,
                     const std::vector<std::vector<int>>& in_masks, uintptr_t native_address,
                     nb::handle native_kwargs, size_t valid_levels, bool thread_safe, bool tokens,
                     const Exclusive* exclusive, const std::vector<int64_t>& types, size_t n_args, size_t n_rets,
                     size_t free_levels) {
  if (key <= 0) throw nb::value_error("a call-site key is positive");
  std::unique_ptr<AnySite> entry;
  if (native_address != 0) {
    // Made in place: the kwargs' C views point into the site's own storage.
    entry = std::make_unique<AnySite>(std::in_place_type<NativeSite>);
    NativeSite& site = std::get<NativeSite>(*entry);
    site.kernel = reinterpret_cast<jaxbind_kernel>(native_address);
    SetNativeKwargs(site, native_kwargs);
  } else {
    entry = std::make_unique<AnySite>(std::in_place_type<PythonSite>);
    PythonSite& site = std::get<PythonSite>(*entry);
    site.callable = callable.ptr();
    site.kwargs_dump = kwargs_dump.ptr();
    site.thread_safe = thread_safe;
  }
  Site& site = std::visit([](Site& s) -> Site& { return s; }, *entry);
  site.name = std::move(name);
  site.description = std::move(description);
  site.key = key;
  site.tokens = tokens;
  if (exclusive != nullptr) site.exclusive = exclusive->mutex;
  SetLayout(site, levels, in_masks, valid_levels);
  SetBufferTypes(site, types, n_args, n_rets, free_levels);
  // A key still bound to a live site is taken over: Python registers a key
  // only when no handle holds it, so that site's handle is going and its
  // release (a weak reference's callback, not run yet) marks it dead later.
  std::lock_guard<std::mutex> lock(g_register_mutex);
  site.serial = static_cast<int64_t>(g_all_sites.size());
  AnySite* published = entry.get();
  g_all_sites.push_back(std::move(entry));
  Bind(key, published);
  g_num_sites.store(site.serial + 1, std::memory_order_release);
  g_num_live_sites.fetch_add(1, std::memory_order_relaxed);
  return site.serial;
}

// The handle of a site is gone (under the GIL): nothing may look it up any
// more. The site's borrowed references are cleared (the handle lets them go
// after this returns); a dispatch running it holds references of its own, and
// later calls of the key make the site anew or fail with a message naming the op.
void ReleaseSite(int64_t serial) {
  PythonSite* python = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_register_mutex);
    if (serial < 0 || serial >= static_cast<int64_t>(g_all_sites.size())) return;
    AnySite& entry = *g_all_sites[serial];
    Site& site = std::visit([](Site& s) -> Site& { return s; }, entry);
    if (!site.alive.load(std::memory_order_seq_cst)) return;
    python = std::get_if<PythonSite>(&entry);
    site.alive.store(false, std::memory_order_seq_cst);
    std::string().swap(site.description);  // (a shell keeps its name and layout only)
    g_num_live_sites.fetch_sub(1, std::memory_order_relaxed);
  }
  if (python == nullptr) return;
  {
    std::lock_guard<FtMutex> refs(python->refs);
    python->callable = nullptr;
    python->kwargs_dump = nullptr;
  }
  // Out of the registry's lock: dropping the views may run Python code, which
  // may release another site or let another thread register one. A call that
  // has the cache drops it when it returns (it sees the site released).
  if (ClaimViewCache(*python)) {
    Py_CLEAR(python->cached_in);
    Py_CLEAR(python->cached_out);
    ReturnViewCache(*python);
  }
}

const PythonSite* HoldPythonSite(const PythonSite* site, int64_t key, std::string_view call,
                                 PythonRefs* refs, std::string* error) {
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (site->alive.load(std::memory_order_acquire) && refs->Hold(*site)) return site;
    const AnySite* again = ResolveSite(key, call, error);
    if (again == nullptr) return nullptr;
    site = std::get_if<PythonSite>(again);
    if (site == nullptr) {
      *error = "jaxbind " + BaseSite(*again).name +
               ": the program runs a Python callback, but in this process it is a native kernel";
      return nullptr;
    }
  }
  *error = "jaxbind " + site->name + ": the op was freed while the program called it";
  return nullptr;
}

}  // namespace

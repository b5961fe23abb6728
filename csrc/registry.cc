// The registry of call sites: made by Python at trace time, read lock-free by XLA's threads.

#include "internal.h"

#include <algorithm>
#include <mutex>
#include <random>

namespace {

// Sites are published lock-free to XLA threads: a fixed table of chunks, each
// chunk a fixed array of atomic pointers. Entries are never removed, so a
// pointer read once stays valid.
constexpr int64_t kChunkBits = 10;
constexpr int64_t kChunkSize = int64_t{1} << kChunkBits;
constexpr int64_t kNumChunks = 4096;  // up to 4M sites

struct Chunk {
  std::atomic<AnySite*> entries[kChunkSize];
};

std::atomic<Chunk*> g_chunks[kNumChunks];
std::atomic<int64_t> g_num_sites{0};
std::mutex g_register_mutex;

int64_t PublishSite(std::unique_ptr<AnySite> site) {
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
  c->entries[id & (kChunkSize - 1)].store(site.release(), std::memory_order_release);
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

const AnySite* LookupSite(int64_t session, int64_t id) {
  if (session != g_session || id < 0 || id >= g_num_sites.load(std::memory_order_acquire)) {
    return nullptr;
  }
  Chunk* c = g_chunks[id >> kChunkBits].load(std::memory_order_acquire);
  if (c == nullptr) return nullptr;
  return c->entries[id & (kChunkSize - 1)].load(std::memory_order_acquire);
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
// convention, kept for its API), else a Python callback.
int64_t RegisterSite(std::string name, nb::handle callable, nb::bytes kwargs_dump, size_t levels,
                     const std::vector<std::vector<int>>& in_masks, uintptr_t native_address,
                     nb::handle native_kwargs, size_t valid_levels) {
  std::unique_ptr<AnySite> entry;
  if (native_address != 0) {
    // Made in place: the kwargs' C views point into the site's own storage.
    entry = std::make_unique<AnySite>(std::in_place_type<NativeSite>);
    NativeSite& site = std::get<NativeSite>(*entry);
    site.name = std::move(name);
    site.kernel = reinterpret_cast<jaxbind_kernel>(native_address);
    SetNativeKwargs(site, native_kwargs);
    SetLayout(site, levels, in_masks, valid_levels);
  } else {
    entry = std::make_unique<AnySite>(std::in_place_type<PythonSite>);
    PythonSite& site = std::get<PythonSite>(*entry);
    site.name = std::move(name);
    SetLayout(site, levels, in_masks, valid_levels);
    // Only now, when nothing can throw: a refused site leaks no references.
    site.callable = callable.inc_ref().ptr();
    site.kwargs_dump = kwargs_dump.inc_ref().ptr();
  }
  return PublishSite(std::move(entry));
}

}  // namespace

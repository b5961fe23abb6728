// The XLA FFI handlers: from a call frame to the registered site, synchronous and asynchronous.

#include "internal.h"

namespace {

// The buffers of one call, copied: XLA may reuse its call frame once an
// asynchronous handler returns, while the buffers stay valid until the
// handler's future completes.
struct OwnedFrame {
  OwnedFrame(const XLA_FFI_Args* args, const XLA_FFI_Rets* rets)
      : buffers(args->size + rets->size), dims(buffers.size()), pointers(buffers.size()) {
    for (size_t i = 0; i < buffers.size(); ++i) {
      const bool is_in = i < static_cast<size_t>(args->size);
      const auto* buf =
          static_cast<const XLA_FFI_Buffer*>(is_in ? args->args[i] : rets->rets[i - args->size]);
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
  static const XLA_FFI_Args* Args(const ffi::RemainingArgs& a) { return (a.*(&RawFrame::args))(); }
  static const XLA_FFI_Rets* Rets(const ffi::RemainingRets& r) { return (r.*(&RawFrame::rets))(); }
};

// The site a program's key names when this process has no live one yet: made
// now from the call's description (a program made elsewhere, or one that
// outlived its op).
JAXBIND_NOINLINE const AnySite* SiteMadeNow(int64_t key, std::string_view call, ffi::Error* error) {
  std::string why;
  const AnySite* site = ResolveSite(key, call, &why);
  if (site == nullptr) *error = ffi::Error(ffi::ErrorCode::kInvalidArgument, why);
  return site;
}

const AnySite* SiteOf(int64_t key, std::string_view call, ffi::Error* error) {
  if (const AnySite* site = LookupSite(key)) return site;
  return SiteMadeNow(key, call, error);
}

// An ordered op's call: the leading token of its inputs and of its outputs
// dropped from the frame (views into XLA's own arrays, which outlive the call).
// A call without them (a program that describes the op otherwise) is refused.
bool IsToken(const void* buffer) {
  return static_cast<const XLA_FFI_Buffer*>(buffer)->dtype == XLA_FFI_DataType_TOKEN;
}

JAXBIND_NOINLINE bool TrimTokens(const Site& site, const XLA_FFI_Args** args,
                                 const XLA_FFI_Rets** rets, XLA_FFI_Args* args_left,
                                 XLA_FFI_Rets* rets_left, ffi::Error* error) {
  const XLA_FFI_Args* a = *args;
  const XLA_FFI_Rets* r = *rets;
  if (a->size < 1 || r->size < 1 || !IsToken(a->args[0]) || !IsToken(r->rets[0])) {
    *error = ErrorText(&site,
                       "the op is ordered (effect=\"ordered\"), but this program's call passes "
                       "no ordering token: the program was made for an op without that effect; "
                       "define the op as the program's was");
    return false;
  }
  *args_left = *a;
  args_left->size -= 1;
  args_left->types += 1;
  args_left->args += 1;
  *rets_left = *r;
  rets_left->size -= 1;
  rets_left->types += 1;
  rets_left->rets += 1;
  *args = args_left;
  *rets = rets_left;
  return true;
}

// The one XLA handler for every jaxbind op.
ffi::Error Dispatch(ffi::ThreadPool pool, std::string_view call, int64_t key,
                    ffi::RemainingArgs args, ffi::RemainingRets rets) {
  const XLA_FFI_Args* raw_args = RawFrame::Args(args);
  const XLA_FFI_Rets* raw_rets = RawFrame::Rets(rets);
  const AnySite* entry = LookupSite(key);
  if (entry == nullptr) {
    ffi::Error unresolved;
    entry = SiteMadeNow(key, call, &unresolved);
    if (entry == nullptr) return unresolved;
  }
  const Site& site = BaseSite(*entry);
  XLA_FFI_Args args_left;
  XLA_FFI_Rets rets_left;
  if (site.tokens) [[unlikely]] {
    ffi::Error untokened;
    if (!TrimTokens(site, &raw_args, &raw_rets, &args_left, &rets_left, &untokened)) {
      return untokened;
    }
  }
  if (!BuffersAsRegistered(site, raw_args->size, raw_args->args, raw_rets->size, raw_rets->rets))
      [[unlikely]] {
    return BuffersRefused(site, raw_args->size, raw_args->args, raw_rets->size, raw_rets->rets);
  }
  // An op with an effect: its calls one at a time, the lock taken before the GIL.
  std::unique_lock<std::recursive_mutex> one_at_a_time;
  if (site.exclusive) [[unlikely]] {
    one_at_a_time = std::unique_lock<std::recursive_mutex>(*site.exclusive);
  }
  const auto* native = std::get_if<NativeSite>(entry);
  // The common native call goes straight to the kernel (the checking mode
  // for unwritten outputs takes RunNative's way, which fills and checks).
  if (native != nullptr && DirectCall(*native, raw_args->size, raw_rets->size) &&
      !g_check_unwritten.load(std::memory_order_relaxed)) {
    return RunNativeDirect(*native, raw_args->size, raw_args->args, raw_rets->size, raw_rets->rets);
  }
  if (site.levels != 0 && site.in_masks.size() != static_cast<size_t>(raw_args->size)) {
    return ErrorText(&site, "internal error: the call site was registered for " +
                                std::to_string(site.in_masks.size()) + " inputs");
  }
  if (native != nullptr) {
    return RunNative(*native, raw_args->size, raw_args->args, raw_rets->size, raw_rets->rets,
                     &pool);
  }
  if (!Py_IsInitialized()) return ErrorText(&site, "the Python interpreter is not running");
  return CallPython(std::get_if<PythonSite>(entry), key, call, raw_args, raw_rets, &pool);
}

// The handler for concurrent native kernels: the kernel runs on XLA's
// thread pool, and XLA goes on with independent work until it completes.
ffi::Future DispatchAsync(ffi::ThreadPool pool, std::string_view call, int64_t key,
                          ffi::RemainingArgs args, ffi::RemainingRets rets) {
  // Shared, because a Promise is move-only in some versions of the FFI headers
  // and the task that completes it must be copyable in others.
  auto promise = std::make_shared<ffi::Promise>();
  ffi::Future future(*promise);
  ffi::Error unresolved = ffi::Error::Success();
  const AnySite* entry = SiteOf(key, call, &unresolved);
  const NativeSite* site = entry != nullptr ? std::get_if<NativeSite>(entry) : nullptr;
  if (site == nullptr) {
    if (entry != nullptr) {  // a program made where the op had a concurrent native kernel
      unresolved = ErrorText(&BaseSite(*entry),
                             "the program runs it as a concurrent native kernel, "
                             "but in this process it is not one: define the op "
                             "as the program's was");
    }
    promise->SetError(std::move(unresolved));
    return future;
  }
  const XLA_FFI_Args* raw_args = RawFrame::Args(args);
  const XLA_FFI_Rets* raw_rets = RawFrame::Rets(rets);
  XLA_FFI_Args args_left;
  XLA_FFI_Rets rets_left;
  if (site->tokens) {
    ffi::Error untokened;
    if (!TrimTokens(*site, &raw_args, &raw_rets, &args_left, &rets_left, &untokened)) {
      promise->SetError(std::move(untokened));
      return future;
    }
  }
  if (!BuffersAsRegistered(*site, raw_args->size, raw_args->args, raw_rets->size, raw_rets->rets)) {
    promise->SetError(
        BuffersRefused(*site, raw_args->size, raw_args->args, raw_rets->size, raw_rets->rets));
    return future;
  }
  auto frame = std::make_shared<OwnedFrame>(raw_args, raw_rets);
  pool.Schedule([site, frame, promise]() {
    std::unique_lock<std::recursive_mutex> one_at_a_time;  // (an op with an effect)
    if (site->exclusive) one_at_a_time = std::unique_lock<std::recursive_mutex>(*site->exclusive);
    void* const* pointers = frame->pointers.data();
    ffi::Error error = RunNative(*site, frame->n_in, pointers, frame->pointers.size() - frame->n_in,
                                 pointers + frame->n_in,
                                 /*pool=*/nullptr);
    if (error.success()) {
      promise->SetAvailable();
    } else {
      promise->SetError(std::move(error));
    }
  });
  return future;
}

// What both handlers decode from a call: the pool, the program's attributes
// (in XLA's order, by name: the call's description, then its site key), and
// the buffers left raw.
auto DispatchBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Attr<std::string_view>("jaxbind")
      .Attr<int64_t>("site")
      .RemainingArgs()
      .RemainingRets();
}

// The instantiate stage of both targets, run by XLA once per compiled program
// (also one loaded from the persistent cache or deserialized from jax.export),
// before any of its calls: a program runs a live site only if it carries that
// site's own description, so that a key copied from another site's call into
// a program describing something else is refused before anything runs.
ffi::Error Instantiate(std::string_view call, int64_t key) {
  std::string why;
  if (CheckProgramSite(key, call, &why)) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, ValidUtf8(why));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxbind_instantiate, Instantiate,
    ffi::Ffi::BindInstantiate().Attr<std::string_view>("jaxbind").Attr<int64_t>("site"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxbind_dispatch, Dispatch, DispatchBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxbind_dispatch_async, DispatchAsync, DispatchBinding());

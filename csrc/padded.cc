// Whole calls over a padded batch: the callee sees the real elements only, padding outputs are
// zeroed.

#include "walk.h"

namespace {

// A batch handed over whole (a vmap_method that is not walked: "expand_dims",
// "broadcast_all" or "legacy_vectorized")
// that XLA partitioned and padded: the callable gets the real elements only.
// The real elements of a block are a prefix along each level (XLA pads at the
// end of a level), so they are arrays of the same rank with smaller batch
// sizes: views of the buffers when that prefix is contiguous (only the
// outermost cut level holds more than one row), else gathered into scratch
// and the outputs scattered back. Padding outputs are zeroed.
class WholePadded {
 public:
  WholePadded(const Site& site, size_t n_in, void* const* ins, size_t n_out, void* const* outs)
      : levels_(site.valid_levels), n_in_(n_in - 1), n_out_(n_out), ins_(ins), outs_(outs) {}

  // Empty, or an internal error. Then `real()` is the number of real elements.
  std::string Plan() {
    const auto* valid = static_cast<const XLA_FFI_Buffer*>(ins_[n_in_]);
    if ((valid->dtype != XLA_FFI_DataType_S32 && valid->dtype != XLA_FFI_DataType_S64) ||
        valid->rank < static_cast<int64_t>(levels_)) {
      return "internal error: the validity operand of a padded batch is malformed";
    }
    sizes_.assign(valid->dims, valid->dims + levels_);
    // Every array has the same batch levels in front (never a copy past an end).
    for (size_t k = 0; k < n_in_ + n_out_; ++k) {
      const auto* buf = Buf(k < n_in_ ? ins_[k] : outs_[k - n_in_]);
      bool same = buf->rank >= static_cast<int64_t>(levels_);
      for (size_t l = 0; same && l < levels_; ++l) same = buf->dims[l] == sizes_[l];
      if (!same) {
        return "internal error: the batch dimensions of " +
               (k < n_in_ ? "input " + std::to_string(k) : "output " + std::to_string(k - n_in_)) +
               " differ from those of the validity operand";
      }
    }
    total_ = 1;
    for (int64_t n : sizes_) total_ *= n;
    const bool wide = valid->dtype == XLA_FFI_DataType_S64;
    const char* data = ElementData(ins_[n_in_], 0);
    auto real = [&](int64_t e) {
      int64_t v = 0;
      if (wide) {
        std::memcpy(&v, data + 8 * e, 8);
      } else {
        int32_t w;
        std::memcpy(&w, data + 4 * e, 4);
        v = w;
      }
      return v > 0;
    };
    // The prefix: along each level, from element 0, as far as elements are real.
    prefix_.assign(levels_, 0);
    if (total_ > 0 && real(0)) {
      int64_t stride = total_;
      for (size_t l = 0; l < levels_; ++l) {
        stride /= sizes_[l];
        while (prefix_[l] < sizes_[l] && real(prefix_[l] * stride)) ++prefix_[l];
      }
    }
    real_ = 1;
    for (int64_t n : prefix_) real_ *= n;
    // Every element is real exactly when it lies in the prefix.
    std::vector<int64_t> index(levels_, 0);
    for (int64_t e = 0; e < total_; ++e) {
      bool inside = true;
      for (size_t l = 0; l < levels_; ++l) inside = inside && index[l] < prefix_[l];
      if (inside != real(e)) {
        return "internal error: the padding XLA added to a partitioned batch is not at the end "
               "of its levels";
      }
      for (size_t l = levels_; l-- > 0;) {
        if (++index[l] < sizes_[l]) break;
        index[l] = 0;
      }
    }
    return std::string();
  }

  int64_t real() const { return real_; }
  bool full() const { return real_ == total_; }

  // The inputs (the validity operand left out) and outputs the callable sees:
  // the real elements. Inputs are gathered here when not contiguous.
  void MakeFrame() {
    contiguous_ = true;
    size_t last_cut = 0;
    for (size_t l = 0; l < levels_; ++l) {
      if (prefix_[l] < sizes_[l]) last_cut = l;
    }
    for (size_t l = 0; l < last_cut; ++l) contiguous_ = contiguous_ && prefix_[l] == 1;
    const size_t n = n_in_ + n_out_;
    buffers_.resize(n);
    dims_.resize(n);
    scratch_.resize(n);
    pointers_.resize(n);
    for (size_t k = 0; k < n; ++k) {
      const auto* buf = Buf(k < n_in_ ? ins_[k] : outs_[k - n_in_]);
      buffers_[k] = *buf;
      dims_[k].assign(buf->dims, buf->dims + buf->rank);
      for (size_t l = 0; l < levels_; ++l) dims_[k][l] = prefix_[l];
      buffers_[k].dims = dims_[k].data();
      if (!contiguous_ && real_ > 0) {
        scratch_[k].resize(static_cast<size_t>(real_ * ElementBytes(buf)));
        buffers_[k].data = scratch_[k].data();
        if (k < n_in_) Copy(buf, /*gather=*/true, scratch_[k].data());
      }
      pointers_[k] = &buffers_[k];
    }
  }
  void* const* ins() const { return pointers_.data(); }
  void* const* outs() const { return pointers_.data() + n_in_; }
  size_t n_in() const { return n_in_; }

  // After the call: outputs scattered into place and their padding zeroed.
  void Finish() {
    for (size_t j = 0; j < n_out_; ++j) {
      const auto* buf = Buf(outs_[j]);
      if (buf->data == nullptr) continue;
      const int64_t bytes = ElementBytes(buf);
      char* data = static_cast<char*>(buf->data);
      if (contiguous_) {  // written in place: zero what follows the prefix
        std::memset(data + real_ * bytes, 0, static_cast<size_t>((total_ - real_) * bytes));
      } else {
        std::memset(data, 0, static_cast<size_t>(total_ * bytes));
        Copy(buf, /*gather=*/false, scratch_[n_in_ + j].data());
      }
    }
  }

 private:
  static const XLA_FFI_Buffer* Buf(void* p) { return static_cast<const XLA_FFI_Buffer*>(p); }

  // Bytes of one batch element of a buffer with `levels_` batch levels in front.
  int64_t ElementBytes(const XLA_FFI_Buffer* buf) const {
    return levels_ == 0 ? 0 : DimStride(buf, static_cast<int64_t>(levels_) - 1);
  }

  // The prefix elements of `buf` to (gather) or from (scatter) `dense`, in order.
  void Copy(const XLA_FFI_Buffer* buf, bool gather, char* dense) const {
    const int64_t bytes = ElementBytes(buf);
    char* base = static_cast<char*>(buf->data);
    std::vector<int64_t> index(levels_, 0);
    for (int64_t e = 0; e < real_; ++e) {
      int64_t offset = 0;
      for (size_t l = 0; l < levels_; ++l)
        offset += index[l] * DimStride(buf, static_cast<int64_t>(l));
      if (gather) {
        std::memcpy(dense + e * bytes, base + offset, static_cast<size_t>(bytes));
      } else {
        std::memcpy(base + offset, dense + e * bytes, static_cast<size_t>(bytes));
      }
      for (size_t l = levels_; l-- > 0;) {
        if (++index[l] < prefix_[l]) break;
        index[l] = 0;
      }
    }
  }

  size_t levels_, n_in_, n_out_;
  void* const* ins_;
  void* const* outs_;
  std::vector<int64_t> sizes_, prefix_;
  int64_t total_ = 0, real_ = 0;
  bool contiguous_ = true;
  std::vector<XLA_FFI_Buffer> buffers_;  // inputs, then outputs
  std::vector<std::vector<int64_t>> dims_;
  std::vector<std::vector<char>> scratch_;
  std::vector<void*> pointers_;
};

// Runs `run(n_in, ins, outs)` on the real elements of a whole call over a
// padded batch (the validity operand is the last of the `n_in` inputs).
template <typename Run>
ffi::Error RunWholePadded(const Site& site, size_t n_in, void* const* ins, size_t n_out,
                          void* const* outs, Run&& run) {
  if (n_in == 0)
    return ErrorText(&site, "internal error: a padded batch without its validity operand");
  WholePadded whole(site, n_in, ins, n_out, outs);
  std::string bad = whole.Plan();
  if (!bad.empty()) return ErrorText(&site, bad);
  if (whole.full()) return run(n_in - 1, ins, outs);  // (the validity operand is last)
  if (whole.real() == 0) {                            // a block of padding only: no call
    whole.Finish();
    return ffi::Error::Success();
  }
  whole.MakeFrame();
  ffi::Error result = run(whole.n_in(), whole.ins(), whole.outs());
  if (result.success()) whole.Finish();
  return result;
}

// Both out of line (see WalkPadded in walk.h): padding must not change how the
// compiler lays out the calls of a batch without it.
JAXBIND_NOINLINE ffi::Error RunNativeWholePadded(const NativeSite& site, size_t n_in,
                                                 void* const* ins, size_t n_out, void* const* outs,
                                                 ffi::ThreadPool* pool) {
  return RunWholePadded(site, n_in, ins, n_out, outs,
                        [&](size_t n, void* const* real_ins, void* const* real_outs) {
                          return RunNativeChecked(site, n, real_ins, n_out, real_outs, pool);
                        });
}

JAXBIND_NOINLINE ffi::Error RunPythonWholePadded(const PythonSite& site, const PythonRefs& refs,
                                                 const XLA_FFI_Args* args,
                                                 const XLA_FFI_Rets* rets) {
  return RunWholePadded(site, args->size, args->args, rets->size, rets->rets,
                        [&](size_t n, void* const* ins, void* const* outs) {
                          XLA_FFI_Args real_args = *args;
                          real_args.size = static_cast<int64_t>(n);
                          real_args.args = const_cast<void**>(ins);
                          XLA_FFI_Rets real_rets = *rets;
                          real_rets.rets = const_cast<void**>(outs);
                          return RunPython(site, refs, &real_args, &real_rets, /*pool=*/nullptr);
                        });
}

}  // namespace

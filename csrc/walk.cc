// Planning the walk of a batch from one call's buffers, and its padding elements.

#include "walk.h"

namespace {

// Byte stride of dimension `dim` of a dense row-major buffer.
int64_t DimStride(const XLA_FFI_Buffer* buf, int64_t dim) {
  int64_t stride = ItemSize(buf->dtype);
  for (int64_t d = dim + 1; d < buf->rank; ++d) stride *= buf->dims[d];
  return stride;
}

// The batch's sizes when there are no outputs to read them from: level l's from
// the first input it maps (an input's mapped levels are its leading dims, in order).
std::string LevelSizesFromInputs(const Site& site, void* const* ins, WalkPlan* plan) {
  for (size_t l = 0; l < plan->levels; ++l) {
    bool found = false;
    for (size_t i = 0; i < plan->n_in && !found; ++i) {
      if (!site.in_masks[i][l]) continue;
      int64_t dim = 0;
      for (size_t k = 0; k < l; ++k) dim += site.in_masks[i][k] ? 1 : 0;
      const auto* buf = static_cast<const XLA_FFI_Buffer*>(ins[i]);
      if (dim >= buf->rank)
        return "internal error: input " + std::to_string(i) + " lacks a batch level";
      plan->sizes[l] = buf->dims[dim];
      plan->total *= buf->dims[dim];
      found = true;
    }
    if (!found) return "internal error: batch level " + std::to_string(l) + " maps no array";
  }
  return std::string();
}

// Fills `plan` from the buffers; an error (never a walk past a buffer's end)
// when their leading dimensions disagree with each other or with the site.
std::string PlanWalk(const Site& site, void* const* ins, void* const* outs, WalkPlan* plan) {
  const size_t levels = plan->levels;
  if (plan->n_out == 0) {
    // A call for its effect alone (no outputs): each level's size from an input it maps
    std::string missing = LevelSizesFromInputs(site, ins, plan);
    if (!missing.empty()) return missing;
  } else {
    // Every output carries every level in front: the sizes come from the first.
    const auto* first = static_cast<const XLA_FFI_Buffer*>(outs[0]);
    if (first->rank < static_cast<int64_t>(levels)) {
      return "internal error: output 0 has fewer dimensions than batch levels";
    }
    for (size_t l = 0; l < levels; ++l) {
      plan->sizes[l] = first->dims[l];
      plan->total *= first->dims[l];
    }
  }
  for (size_t j = 0; j < plan->n_out; ++j) {
    const auto* buf = static_cast<const XLA_FFI_Buffer*>(outs[j]);
    for (size_t l = 0; l < levels; ++l) {
      if (buf->rank < static_cast<int64_t>(levels) || buf->dims[l] != plan->sizes[l]) {
        return "internal error: the batch dimensions of output " + std::to_string(j) +
               " differ from those of output 0";
      }
      plan->out_strides[j * levels + l] = DimStride(buf, l);
    }
  }
  for (size_t i = 0; i < plan->n_in; ++i) {
    const auto* buf = static_cast<const XLA_FFI_Buffer*>(ins[i]);
    int64_t dim = 0;
    for (size_t l = 0; l < levels; ++l) {
      int64_t stride = 0;
      if (site.in_masks[i][l]) {
        if (dim >= buf->rank || buf->dims[dim] != plan->sizes[l]) {
          return "internal error: the batch dimensions of input " + std::to_string(i) +
                 " differ from those of the outputs";
        }
        stride = DimStride(buf, dim++);
      }
      plan->in_strides[i * levels + l] = stride;
    }
  }
  if (site.valid_levels != 0) {
    const size_t v = plan->n_in - 1;
    const auto* buf = static_cast<const XLA_FFI_Buffer*>(ins[v]);
    if (buf->dtype != XLA_FFI_DataType_S32 && buf->dtype != XLA_FFI_DataType_S64) {
      return "internal error: the validity operand of a padded batch is not an integer array";
    }
    plan->valid = ElementData(ins[v], 0);
    plan->valid_input = v;
    plan->valid_wide = buf->dtype == XLA_FFI_DataType_S64;
    plan->outs = outs;
  }
  return std::string();
}

// Whether the element at these offsets is a real one, not padding: XLA pads a
// batch that does not divide evenly over the devices, and the validity operand
// (jaxbind/_lowering.py, _validity) is positive exactly on the real elements.
bool RealElement(const WalkPlan& plan, const int64_t* in_off) {
  const char* at = plan.valid + in_off[plan.valid_input];
  if (plan.valid_wide) {
    int64_t v;
    std::memcpy(&v, at, sizeof v);
    return v > 0;
  }
  int32_t v;
  std::memcpy(&v, at, sizeof v);
  return v > 0;
}

// Zeroes the outputs of one (padding) element: XLA drops them.
void ZeroElement(const WalkPlan& plan, const int64_t* out_off) {
  const size_t levels = plan.levels;
  for (size_t j = 0; j < plan.n_out; ++j) {
    auto* buf = static_cast<XLA_FFI_Buffer*>(plan.outs[j]);
    const int64_t bytes = plan.out_strides[j * levels + levels - 1];  // one element's
    if (buf->data != nullptr && bytes > 0) {
      std::memset(static_cast<char*>(buf->data) + out_off[j], 0, bytes);
    }
  }
}

}  // namespace

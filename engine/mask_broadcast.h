// Mask broadcasting: an attn_mask tensor view as the MaskParams the kernels
// read, with NumPy's right-aligned broadcasting rule.
#ifndef ATTNSERVE_ENGINE_MASK_BROADCAST_H_
#define ATTNSERVE_ENGINE_MASK_BROADCAST_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "engine/attention_params.h"
#include "engine/tensor.h"

namespace attnserve {

// Builds MaskParams for `mask` (rank 2..4, right-aligned like NumPy
// broadcasting) against scores [batch, heads, q_len, kv_len]. An empty view
// gives Kind::kNone. Error (InvalidArgument, field "attn_mask") when the
// shape does not broadcast. The result points into `mask`'s data.
absl::StatusOr<MaskParams> MakeMaskParams(const TensorView& mask, int64_t batch,
                                          int64_t heads, int64_t q_len,
                                          int64_t kv_len);

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_MASK_BROADCAST_H_

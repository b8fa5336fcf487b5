// Mask broadcasting: turns an attn_mask view into element strides over the
// scores [b, h, i, j] with NumPy's right-aligned broadcasting rule.
#include "engine/mask_broadcast.h"

#include <array>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnserve {

absl::StatusOr<MaskParams> MakeMaskParams(const TensorView& mask, int64_t batch,
                                          int64_t heads, int64_t q_len,
                                          int64_t kv_len) {
  MaskParams params;
  if (mask.empty()) return params;

  const std::array<int64_t, 4> target = {batch, heads, q_len, kv_len};
  const std::string target_string =
      absl::StrCat("[B, Hq, Lq, Lk] = ", ShapeString(target));
  const int64_t rank = mask.rank();
  if (rank < 2 || rank > 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "attn_mask: rank must be 2, 3 or 4 (broadcastable to ", target_string,
        "), got rank ", rank, " with shape ", ShapeString(mask.shape)));
  }
  switch (mask.dtype) {
    case DType::kBool:
      params.kind = MaskParams::Kind::kBool;
      break;
    case DType::kFloat32:
    case DType::kFloat16:
    case DType::kBFloat16:
      params.kind = MaskParams::Kind::kAdditive;
      break;
  }
  params.dtype = mask.dtype;
  params.data = mask.data;

  // Walk the mask's dims from the right against [B, Hq, Lq, Lk]; missing
  // leading dims broadcast (stride 0), as do dims of size 1.
  std::array<int64_t, 4> strides = {0, 0, 0, 0};
  int64_t contiguous = 1;
  for (int64_t k = 0; k < rank; ++k) {
    const int64_t mask_axis = rank - 1 - k;
    const int64_t target_axis = 3 - k;
    const int64_t d = mask.shape[static_cast<size_t>(mask_axis)];
    const int64_t t = target[static_cast<size_t>(target_axis)];
    if (d != t && d != 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "attn_mask: shape ", ShapeString(mask.shape), " does not broadcast to ",
          target_string, ": dims are matched from the right and each must equal the "
          "target dim or be 1, but dim ", mask_axis, " is ", d, " against ", t));
    }
    strides[static_cast<size_t>(target_axis)] = d == 1 ? 0 : contiguous;
    contiguous *= d;
  }
  params.stride_b = strides[0];
  params.stride_h = strides[1];
  params.stride_q = strides[2];
  params.stride_k = strides[3];
  return params;
}

}  // namespace attnserve

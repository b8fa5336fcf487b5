// The engines' guard on bare AttentionParams: dims, heads, pointers, dtypes
// and mask kind checked before any memory is touched.
#include "engine/attention_params_check.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnserve {

absl::Status CheckAttentionParams(const AttentionParams& p) {
  if (p.batch < 1 || p.num_heads < 1 || p.num_kv_heads < 1 || p.head_dim < 1 ||
      p.head_dim_v < 1 || p.q_len < 1 || p.kv_len < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AttentionParams: every dim must be >= 1, got batch ", p.batch, ", num_heads ",
        p.num_heads, ", num_kv_heads ", p.num_kv_heads, ", head_dim ", p.head_dim,
        ", head_dim_v ", p.head_dim_v, ", q_len ", p.q_len, ", kv_len ", p.kv_len));
  }
  if (p.num_heads % p.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AttentionParams: num_heads must be a multiple of num_kv_heads, got ", p.num_heads,
        " and ", p.num_kv_heads));
  }
  if (p.q == nullptr || p.k == nullptr || p.v == nullptr || p.out == nullptr) {
    return absl::InvalidArgumentError("AttentionParams: q, k, v and out must be set");
  }
  if (p.dtype == DType::kBool || p.out_dtype == DType::kBool ||
      (p.weights != nullptr && p.weights_dtype == DType::kBool)) {
    return absl::InvalidArgumentError(
        "AttentionParams: input, output and weights dtypes must be float types");
  }
  if (p.mask.kind != MaskParams::Kind::kNone && p.mask.data == nullptr) {
    return absl::InvalidArgumentError("AttentionParams: mask has a kind but no data");
  }
  if (p.mask.kind == MaskParams::Kind::kAdditive && p.mask.dtype == DType::kBool) {
    return absl::InvalidArgumentError("AttentionParams: an additive mask must be a float type");
  }
  return absl::OkStatus();
}

}  // namespace attnserve

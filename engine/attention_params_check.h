// The engines' guard for AttentionParams handed to them directly (Attend),
// kept apart from attention_params.h so that that header stays plain.
#ifndef ATTNSERVE_ENGINE_ATTENTION_PARAMS_CHECK_H_
#define ATTNSERVE_ENGINE_ATTENTION_PARAMS_CHECK_H_

#include "absl/status/status.h"
#include "engine/attention_params.h"

namespace attnserve {

// Dims >= 1, num_heads a multiple of num_kv_heads, q/k/v/out set, float
// dtypes, a mask with data when it has a kind. InvalidArgument on failure.
// (Strides and key_lengths values are trusted.)
absl::Status CheckAttentionParams(const AttentionParams& p);

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_ATTENTION_PARAMS_CHECK_H_

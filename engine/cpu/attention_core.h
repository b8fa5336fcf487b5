// The cpu backend's attention core, behind one function so that a fused
// kernel (issue #5) can replace it without touching projections or dispatch.
#ifndef ATTNSERVE_ENGINE_CPU_ATTENTION_CORE_H_
#define ATTNSERVE_ENGINE_CPU_ATTENTION_CORE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "engine/attention_params.h"
#include "engine/cpu/dnnl_matmul.h"
#include "oneapi/dnnl/dnnl.hpp"

namespace attnserve::cpu {

// softmax(Q K^T * scale + mask) V for one request, in fp32.
//
// Preconditions: p was checked (dims >= 1, heads divisible, mask strides
// valid); p.dtype == p.out_dtype == FLOAT32 (the engine converts fp16/bf16 at
// its edges). p.weights may be any float dtype. The result depends only on
// `p` (never on other requests), and is bitwise reproducible for the same
// `p` and thread count.
//
// `scores_budget` bounds the fp32 score scratch (in elements): a request
// whose scores [B, Hq, Lq, Lk] exceed it is processed one batch element and
// a block of query rows at a time. The split depends only on the request's
// own dims, so it never breaks batch invariance.
//
// Thread safety: may run concurrently on different streams.
inline constexpr int64_t kDefaultScoresBudget = int64_t{16} << 20;  // 64 MiB
absl::Status AttentionCoreF32(const AttentionParams& p, MatmulCache& matmuls,
                              dnnl::stream& stream,
                              int64_t scores_budget = kDefaultScoresBudget);

}  // namespace attnserve::cpu

#endif  // ATTNSERVE_ENGINE_CPU_ATTENTION_CORE_H_

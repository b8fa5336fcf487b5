// The cpu backend's attention core, behind one function so that a fused
// kernel (issue #5) can replace it without touching projections or dispatch.
#ifndef ATTNSERVE_ENGINE_CPU_ATTENTION_CORE_H_
#define ATTNSERVE_ENGINE_CPU_ATTENTION_CORE_H_

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
// Thread safety: may run concurrently on different streams.
absl::Status AttentionCoreF32(const AttentionParams& p, MatmulCache& matmuls,
                              dnnl::stream& stream);

}  // namespace attnserve::cpu

#endif  // ATTNSERVE_ENGINE_CPU_ATTENTION_CORE_H_

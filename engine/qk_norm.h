// QK-norm as Hugging Face transformers computes it (Qwen3RMSNorm,
// Gemma3RMSNorm applied per head; Olmo2RMSNorm over the whole projection):
// x / sqrt(mean(x^2) + eps) * w, or * (1 + w) with weight_offset. The mean
// accumulates in float64.
#ifndef ATTNSERVE_ENGINE_QK_NORM_H_
#define ATTNSERVE_ENGINE_QK_NORM_H_

#include <cmath>
#include <cstdint>

#include "engine/attention_layer.h"

namespace attnserve {

// The vectors QK-norm normalises in one token's row of `heads` heads of
// head_dim features (contiguous): each head, or the whole row at once
// (whole_projection). Their weights have `dim` values.
struct QkNormVectors {
  int64_t count = 0;  // per row
  int64_t dim = 0;
};
inline QkNormVectors QkNormShape(const QkNormConfig& norm, int64_t heads, int64_t head_dim) {
  return norm.whole_projection ? QkNormVectors{1, heads * head_dim}
                               : QkNormVectors{heads, head_dim};
}

// Normalises one head vector x[dim] in place with weights w[dim] (float).
template <typename T>
void NormalizeHead(T* x, const float* w, int64_t dim, const QkNormConfig& norm) {
  double sum = 0;
  for (int64_t d = 0; d < dim; ++d) sum += static_cast<double>(x[d]) * static_cast<double>(x[d]);
  const T inv = static_cast<T>(1.0 / std::sqrt(sum / static_cast<double>(dim) + norm.eps));
  for (int64_t d = 0; d < dim; ++d) {
    const T weight = norm.weight_offset ? static_cast<T>(1) + static_cast<T>(w[d])
                                        : static_cast<T>(w[d]);
    x[d] = x[d] * inv * weight;
  }
}

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_QK_NORM_H_

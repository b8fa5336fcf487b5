// QK-norm as Hugging Face transformers computes it (Qwen3RMSNorm,
// Gemma3RMSNorm applied per head; Olmo2RMSNorm over the whole projection;
// CohereLayerNorm per head with weights per head), and the value norm
// without weights (Gemma 3n, Gemma 4):
// x / sqrt(mean(x^2) + eps) * w, or * (1 + w) with weight_offset, or
// (x - mean) / sqrt(var + eps) * w with subtract_mean. The means accumulate
// in float64.
#ifndef ATTNSERVE_ENGINE_QK_NORM_H_
#define ATTNSERVE_ENGINE_QK_NORM_H_

#include <cmath>
#include <cstdint>

#include "engine/attention_layer.h"

namespace attnserve {

// The vectors QK-norm normalises in one token's row of `heads` heads of
// head_dim features (contiguous): each head, or the whole row at once
// (whole_projection). Vector v's weights are the `dim` values at
// w + v * weight_stride (0: every vector shares them; dim:
// per_head_weights).
struct QkNormVectors {
  int64_t count = 0;  // per row
  int64_t dim = 0;
  int64_t weight_stride = 0;
};
inline QkNormVectors QkNormShape(const QkNormConfig& norm, int64_t heads, int64_t head_dim) {
  if (norm.whole_projection) return QkNormVectors{1, heads * head_dim, 0};
  return QkNormVectors{heads, head_dim, norm.per_head_weights ? head_dim : 0};
}
// The number of weights of the norm of `heads` heads (q_norm, k_norm).
inline int64_t QkNormWeightCount(const QkNormConfig& norm, int64_t heads, int64_t head_dim) {
  return norm.whole_projection || norm.per_head_weights ? heads * head_dim : head_dim;
}

// Normalises one vector x[dim] in place with weights w[dim] (float; nullptr:
// weights of 1, v_norm): RMSNorm, or with subtract_mean LayerNorm without a
// bias, (x - mean) / sqrt(var + eps) * w, the mean and variance in float64.
template <typename T>
void NormalizeHead(T* x, const float* w, int64_t dim, const QkNormConfig& norm) {
  double mean = 0;
  if (norm.subtract_mean) {
    for (int64_t d = 0; d < dim; ++d) mean += static_cast<double>(x[d]);
    mean /= static_cast<double>(dim);
  }
  double sum = 0;
  for (int64_t d = 0; d < dim; ++d) {
    const double centred = static_cast<double>(x[d]) - mean;
    sum += centred * centred;
  }
  const T inv = static_cast<T>(1.0 / std::sqrt(sum / static_cast<double>(dim) + norm.eps));
  const T shift = static_cast<T>(mean);
  for (int64_t d = 0; d < dim; ++d) {
    const T weight = w == nullptr          ? static_cast<T>(1)
                     : norm.weight_offset ? static_cast<T>(1) + static_cast<T>(w[d])
                                          : static_cast<T>(w[d]);
    x[d] = (norm.subtract_mean ? x[d] - shift : x[d]) * inv * weight;
  }
}

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_QK_NORM_H_

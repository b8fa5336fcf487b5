// The output gate of gated attention (LayerConfig::output_gate), as Hugging
// Face transformers computes it (Qwen3NextAttention, Qwen3_5Attention,
// AfmoeAttention): each token's core output, its heads concatenated, times
// sigmoid(gate) elementwise, where gate = x Wg^T + bg is projected from the
// token's query input; then the output projection.
#ifndef ATTNSERVE_ENGINE_OUTPUT_GATE_H_
#define ATTNSERVE_ENGINE_OUTPUT_GATE_H_

#include <cmath>

namespace attnserve {

// sigmoid(x) = 1 / (1 + exp(-x)): 0 at -inf, 1 at +inf, NaN for NaN.
template <typename T>
inline T Sigmoid(T x) {
  return static_cast<T>(1) / (static_cast<T>(1) + std::exp(-x));
}

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_OUTPUT_GATE_H_

// The models attnserve serves with no files: "sdpa" (bare attention, head
// layout) and "demo-mha" (a 512-wide, 8-head projection layer whose weights
// come from a fixed seed, identical on every machine and compiler).
#ifndef ATTNSERVE_ENGINE_MODEL_BUILTIN_MODELS_H_
#define ATTNSERVE_ENGINE_MODEL_BUILTIN_MODELS_H_

#include <cstdint>
#include <memory>

#include "engine/attention_layer.h"

namespace attnserve {

// "sdpa": has_projections = false, no weights; dims come from each request.
std::shared_ptr<const AttentionLayer> MakeSdpaLayer();

// "demo-mha": nn.MultiheadAttention-like, embed_dim 512, 8 heads of 64,
// query/key/value/out dims 512, all four biases. Every weight and bias is
// uniform in +-1/sqrt(fan_in) (PyTorch's nn.Linear init range) drawn from
// splitmix64 with a fixed seed, so the values are bit-identical everywhere.
// Each call builds a fresh layer (about 4 MiB); callers share it.
std::shared_ptr<const AttentionLayer> MakeDemoMhaLayer();

// The deterministic generator behind demo-mha, exposed for tests and for
// building other seeded layers: splitmix64 (Steele, Lea, Flood 2014).
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [-bound, bound): 24 random bits -> [0, 1), computed in
  // double and rounded once to float (IEEE, so portable).
  float Uniform(float bound) {
    const double u = static_cast<double>(Next() >> 40) * 0x1.0p-24;
    return static_cast<float>((2.0 * u - 1.0) * static_cast<double>(bound));
  }

 private:
  uint64_t state_;
};

// A FLOAT32 tensor of `shape` filled with SplitMix64(seed).Uniform(bound).
Tensor SeededUniformTensor(Shape shape, uint64_t seed, float bound);

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_MODEL_BUILTIN_MODELS_H_

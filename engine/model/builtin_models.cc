// The built-in models; demo-mha's weights are a pure function of fixed seeds.
#include "engine/model/builtin_models.h"

#include <cmath>

namespace attnserve {

Tensor SeededUniformTensor(Shape shape, uint64_t seed, float bound) {
  Tensor t(DType::kFloat32, std::move(shape));
  SplitMix64 rng(seed);
  float* p = t.data_as<float>();
  for (int64_t i = 0, n = t.num_elements(); i < n; ++i) p[i] = rng.Uniform(bound);
  return t;
}

std::shared_ptr<const AttentionLayer> MakeSdpaLayer() {
  auto layer = std::make_shared<AttentionLayer>();
  layer->config.name = "sdpa";
  layer->config.has_projections = false;
  return layer;
}

std::shared_ptr<const AttentionLayer> MakeDemoMhaLayer() {
  constexpr int64_t kEmbed = 512, kHeads = 8, kHeadDim = 64;
  // Changing this changes every demo-mha output that clients may have pinned.
  constexpr uint64_t kSeed = 0xA77E'5E4Fu;

  auto layer = std::make_shared<AttentionLayer>();
  LayerConfig& c = layer->config;
  c.name = "demo-mha";
  c.has_projections = true;
  c.embed_dim = kEmbed;
  c.num_heads = kHeads;
  c.num_kv_heads = kHeads;
  c.head_dim = kHeadDim;
  c.query_dim = c.key_dim = c.value_dim = c.out_dim = kEmbed;

  // sqrt is correctly rounded in IEEE arithmetic, so the bound is portable.
  const float bound = static_cast<float>(1.0 / std::sqrt(static_cast<double>(kEmbed)));
  LayerWeights& w = layer->weights;
  // One independent stream per tensor, so that each tensor's values do not
  // depend on the sizes of the ones drawn before it.
  w.wq = SeededUniformTensor({kEmbed, kEmbed}, kSeed + 1, bound);
  w.bq = SeededUniformTensor({kEmbed}, kSeed + 2, bound);
  w.wk = SeededUniformTensor({kEmbed, kEmbed}, kSeed + 3, bound);
  w.bk = SeededUniformTensor({kEmbed}, kSeed + 4, bound);
  w.wv = SeededUniformTensor({kEmbed, kEmbed}, kSeed + 5, bound);
  w.bv = SeededUniformTensor({kEmbed}, kSeed + 6, bound);
  w.wo = SeededUniformTensor({kEmbed, kEmbed}, kSeed + 7, bound);
  w.bo = SeededUniformTensor({kEmbed}, kSeed + 8, bound);
  return layer;
}

}  // namespace attnserve

// Random multi-head latent attention layers (LatentAttention in
// engine/attention_layer.h) for the engine tests, drawn through a caller's
// generator so that each test keeps its own random stream.
#ifndef ATTNSERVE_TESTS_UNIT_ENGINE_TEST_LATENT_LAYER_H_
#define ATTNSERVE_TESTS_UNIT_ENGINE_TEST_LATENT_LAYER_H_

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/attention_layer.h"
#include "engine/tensor.h"

namespace attnserve::testutil {

struct LatentShape {
  int64_t heads = 2;
  int64_t nope = 8;       // head_dim = nope + rope
  int64_t rope = 4;
  int64_t v_head_dim = 6;
  int64_t q_lora_rank = 0;  // 0: one q_proj
  int64_t kv_lora_rank = 12;
  int64_t embed = 16;
  int64_t out = 16;
  bool biases = false;  // q_a_proj / kv_a_proj_with_mqa / o_proj biases (attention_bias)
};

// `uniform(lo, hi)`: a float in [lo, hi). Projections scaled by
// 1/sqrt(in), the two RMSNorm weights around 1 as trained ones are; no RoPE
// (the caller sets config.rope, rotary_dim = shape.rope).
template <typename Uniform>
std::shared_ptr<AttentionLayer> RandomLatentLayer(const LatentShape& s, Precision precision,
                                                  Uniform&& uniform) {
  auto layer = std::make_shared<AttentionLayer>();
  LayerConfig& c = layer->config;
  c.name = "random-latent";
  c.has_projections = true;
  c.num_heads = c.num_kv_heads = s.heads;
  c.head_dim = s.nope + s.rope;
  c.embed_dim = c.query_dim = c.key_dim = c.value_dim = s.embed;
  c.out_dim = s.out;
  c.precision = precision;
  c.latent.enabled = true;
  c.latent.q_lora_rank = s.q_lora_rank;
  c.latent.kv_lora_rank = s.kv_lora_rank;
  c.latent.rope_dim = s.rope;
  c.latent.v_head_dim = s.v_head_dim;
  c.latent.q_norm_eps = 1e-6;
  c.latent.kv_norm_eps = 1e-5;
  auto random = [&](Shape shape, float lo, float hi) {
    Tensor t(DType::kFloat32, std::move(shape));
    for (int64_t i = 0; i < t.num_elements(); ++i) {
      t.data_as<float>()[i] = RoundTo(precision, uniform(lo, hi));
    }
    return t;
  };
  auto weight = [&](int64_t out, int64_t in) {
    const float a = 1.0f / std::sqrt(static_cast<float>(in));
    return random({out, in}, -a, a);
  };
  LayerWeights& w = layer->weights;
  const int64_t qk = s.heads * c.head_dim;
  if (s.q_lora_rank > 0) {
    w.wq_a = weight(s.q_lora_rank, s.embed);
    w.q_a_norm = random({s.q_lora_rank}, 0.5f, 1.5f);
    w.wq = weight(qk, s.q_lora_rank);
    if (s.biases) w.bq_a = random({s.q_lora_rank}, -0.5f, 0.5f);
  } else {
    w.wq = weight(qk, s.embed);
  }
  w.wkv_a = weight(s.kv_lora_rank + s.rope, s.embed);
  w.kv_a_norm = random({s.kv_lora_rank}, 0.5f, 1.5f);
  w.wk = weight(s.heads * s.nope, s.kv_lora_rank);
  w.wv = weight(s.heads * s.v_head_dim, s.kv_lora_rank);
  w.wo = weight(s.out, s.heads * s.v_head_dim);
  if (s.biases) {
    w.bkv_a = random({s.kv_lora_rank + s.rope}, -0.5f, 0.5f);
    w.bo = random({s.out}, -0.5f, 0.5f);
  }
  return layer;
}

}  // namespace attnserve::testutil

#endif  // ATTNSERVE_TESTS_UNIT_ENGINE_TEST_LATENT_LAYER_H_

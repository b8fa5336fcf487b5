// LayerConfig -> ModelConfig proto.
#include "server/model_config_codec.h"

namespace attnserve {
namespace {

const char* PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kFloat32: return "fp32";
    case Precision::kBFloat16: return "bf16";
    case Precision::kFloat16: return "fp16";
  }
  return "fp32";
}

}  // namespace

v1::ModelConfig LayerToModelConfig(const AttentionLayer& layer) {
  const LayerConfig& c = layer.config;
  v1::ModelConfig config;
  config.set_name(c.name);
  config.set_kind(c.has_projections ? "mha" : "sdpa");
  config.set_embed_dim(c.embed_dim);
  config.set_num_heads(c.num_heads);
  config.set_num_kv_heads(c.num_kv_heads);
  config.set_head_dim(c.head_dim);
  config.set_query_dim(c.query_dim);
  config.set_key_dim(c.key_dim);
  config.set_value_dim(c.value_dim);
  config.set_out_dim(c.out_dim);
  // LayerWeights: an empty bias tensor means no bias.
  config.set_q_bias(layer.weights.bq.byte_size() > 0);
  config.set_k_bias(layer.weights.bk.byte_size() > 0);
  config.set_v_bias(layer.weights.bv.byte_size() > 0);
  config.set_out_bias(layer.weights.bo.byte_size() > 0);
  config.set_scale(c.scale);
  config.set_causal(c.causal);
  config.set_precision(PrecisionName(c.precision));
  return config;
}

}  // namespace attnserve

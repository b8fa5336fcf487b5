// ModelConfig proto <-> LayerConfig, WeightSpec and ModelBatching.
#include "server/models/model_config_codec.h"

#include <string>

#include "engine/rope.h"

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

DType ToWarmupDType(const v1::WarmupShape& warmup) {
  return warmup.dtype() == "bf16"   ? DType::kBFloat16
         : warmup.dtype() == "fp16" ? DType::kFloat16
                                    : DType::kFloat32;
}

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
  config.set_sliding_window(c.sliding_window);
  config.set_softcap(c.softcap);
  config.set_sinks(c.sinks);
  config.set_attention_chunk(c.attention_chunk);
  config.set_clip_qkv(c.clip_qkv);
  if (c.v_norm_eps > 0) config.mutable_v_norm()->set_eps(c.v_norm_eps);
  config.set_kv_source(c.kv_source);
  config.set_sparse_index_topk(c.sparse_index_topk);
  config.mutable_alibi_slopes()->Assign(c.alibi_slopes.begin(), c.alibi_slopes.end());
  config.set_relative_bias_distance(c.relative_bias_distance);
  if (c.relative_embeddings.distance > 0) {
    v1::RelativeEmbeddings* r = config.mutable_relative_embeddings();
    r->set_distance(c.relative_embeddings.distance);
    r->set_content_to_position(c.relative_embeddings.content_to_position);
    r->set_position_to_content(c.relative_embeddings.position_to_content);
  }
  if (c.temperature_tuning.enabled) {
    config.mutable_temperature_tuning()->set_floor_scale(c.temperature_tuning.floor_scale);
    config.mutable_temperature_tuning()->set_attn_scale(c.temperature_tuning.attn_scale);
    config.mutable_temperature_tuning()->set_by_position(c.temperature_tuning.by_position);
  }
  if (c.has_projections) *config.mutable_rope() = FromRopeConfig(c.rope);
  if (c.qk_norm.enabled) {
    config.mutable_qk_norm()->set_eps(c.qk_norm.eps);
    config.mutable_qk_norm()->set_weight_offset(c.qk_norm.weight_offset);
    config.mutable_qk_norm()->set_whole_projection(c.qk_norm.whole_projection);
    config.mutable_qk_norm()->set_after_rope(c.qk_norm.after_rope);
    config.mutable_qk_norm()->set_subtract_mean(c.qk_norm.subtract_mean);
    config.mutable_qk_norm()->set_per_head_weights(c.qk_norm.per_head_weights);
  }
  if (c.latent.enabled) {
    v1::LatentAttention* m = config.mutable_latent_attention();
    m->set_q_lora_rank(c.latent.q_lora_rank);
    m->set_kv_lora_rank(c.latent.kv_lora_rank);
    m->set_qk_rope_head_dim(c.latent.rope_dim);
    m->set_v_head_dim(c.latent.v_head_dim);
    m->set_q_norm_eps(c.latent.q_norm_eps);
    m->set_kv_norm_eps(c.latent.kv_norm_eps);
    config.set_q_bias(layer.weights.bq_a.byte_size() > 0);
    config.set_k_bias(layer.weights.bkv_a.byte_size() > 0);
  }
  if (c.output_gate) {
    // The layer holds the gate as a linear of its own, whatever the file did.
    config.mutable_output_gate()->set_weights("separate");
    config.mutable_output_gate()->set_bias(layer.weights.bg.byte_size() > 0);
  }
  return config;
}

RopeConfig ToRopeConfig(const v1::RotaryEmbedding& r) {
  RopeConfig rope;
  absl::StatusOr<RopeConfig::Type> type = ParseRopeType(r.type().empty() ? "none" : r.type());
  rope.type = type.ok() ? *type : RopeConfig::Type::kNone;
  rope.theta = r.theta();
  rope.rotary_dim = r.rotary_dim();
  rope.interleaved = r.interleaved();
  rope.factor = r.factor();
  rope.low_freq_factor = r.low_freq_factor();
  rope.high_freq_factor = r.high_freq_factor();
  rope.original_max_position_embeddings = r.original_max_position_embeddings();
  rope.beta_fast = r.beta_fast();
  rope.beta_slow = r.beta_slow();
  rope.attention_factor = r.attention_factor();
  rope.truncate = !r.no_truncate();
  rope.short_factor.assign(r.short_factor().begin(), r.short_factor().end());
  rope.long_factor.assign(r.long_factor().begin(), r.long_factor().end());
  return rope;
}

v1::RotaryEmbedding FromRopeConfig(const RopeConfig& rope) {
  v1::RotaryEmbedding r;
  r.set_type(RopeTypeName(rope.type));
  if (rope.type == RopeConfig::Type::kNone) return r;
  r.set_theta(rope.theta);
  r.set_rotary_dim(rope.rotary_dim);
  r.set_interleaved(rope.interleaved);
  r.set_factor(rope.factor);
  r.set_low_freq_factor(rope.low_freq_factor);
  r.set_high_freq_factor(rope.high_freq_factor);
  r.set_original_max_position_embeddings(rope.original_max_position_embeddings);
  r.set_beta_fast(rope.beta_fast);
  r.set_beta_slow(rope.beta_slow);
  r.set_attention_factor(rope.attention_factor);
  r.set_no_truncate(!rope.truncate);
  for (double f : rope.short_factor) r.add_short_factor(f);
  for (double f : rope.long_factor) r.add_long_factor(f);
  return r;
}

LayerConfig ToLayerConfig(const v1::ModelConfig& c) {
  LayerConfig layer;
  layer.name = c.name();
  layer.has_projections = c.kind() != "sdpa";
  layer.embed_dim = c.embed_dim();
  layer.num_heads = c.num_heads();
  layer.num_kv_heads = c.num_kv_heads();
  layer.head_dim = c.head_dim();
  layer.query_dim = c.query_dim();
  layer.key_dim = c.key_dim();
  layer.value_dim = c.value_dim();
  layer.out_dim = c.out_dim();
  layer.scale = c.scale();
  layer.causal = c.causal();
  layer.precision = c.precision() == "bf16"   ? Precision::kBFloat16
                    : c.precision() == "fp16" ? Precision::kFloat16
                                              : Precision::kFloat32;
  layer.sliding_window = c.sliding_window();
  layer.softcap = c.softcap();
  layer.sinks = layer.has_projections && c.sinks();
  layer.output_gate = layer.has_projections && c.has_output_gate();
  layer.attention_chunk = c.attention_chunk();
  layer.clip_qkv = layer.has_projections ? c.clip_qkv() : 0.0f;
  layer.v_norm_eps = layer.has_projections && c.has_v_norm() ? c.v_norm().eps() : 0.0;
  layer.kv_source = layer.has_projections ? c.kv_source() : std::string();
  layer.sparse_index_topk = layer.has_projections ? c.sparse_index_topk() : 0;
  layer.alibi_slopes.assign(c.alibi_slopes().begin(), c.alibi_slopes().end());
  layer.relative_bias_distance = layer.has_projections ? c.relative_bias_distance() : 0;
  if (layer.has_projections && c.has_relative_embeddings()) {
    layer.relative_embeddings.distance = c.relative_embeddings().distance();
    layer.relative_embeddings.content_to_position = c.relative_embeddings().content_to_position();
    layer.relative_embeddings.position_to_content = c.relative_embeddings().position_to_content();
  }
  if (layer.has_projections && c.has_temperature_tuning()) {
    layer.temperature_tuning.enabled = true;
    layer.temperature_tuning.floor_scale = c.temperature_tuning().floor_scale();
    layer.temperature_tuning.attn_scale = c.temperature_tuning().attn_scale();
    layer.temperature_tuning.by_position = c.temperature_tuning().by_position();
  }
  if (layer.has_projections && c.has_latent_attention()) {
    const v1::LatentAttention& m = c.latent_attention();
    layer.latent.enabled = true;
    layer.latent.q_lora_rank = m.q_lora_rank();
    layer.latent.kv_lora_rank = m.kv_lora_rank();
    layer.latent.rope_dim = m.qk_rope_head_dim();
    layer.latent.v_head_dim = m.v_head_dim();
    layer.latent.q_norm_eps = m.q_norm_eps();
    layer.latent.kv_norm_eps = m.kv_norm_eps();
  }
  if (layer.has_projections) layer.rope = ToRopeConfig(c.rope());
  if (layer.has_projections && c.has_qk_norm()) {
    layer.qk_norm.enabled = true;
    layer.qk_norm.eps = c.qk_norm().eps();
    layer.qk_norm.weight_offset = c.qk_norm().weight_offset();
    layer.qk_norm.whole_projection = c.qk_norm().whole_projection();
    layer.qk_norm.after_rope = c.qk_norm().after_rope();
    layer.qk_norm.subtract_mean = c.qk_norm().subtract_mean();
    layer.qk_norm.per_head_weights = c.qk_norm().per_head_weights();
  }
  return layer;
}

WeightLayout ToWeightLayout(v1::ModelConfig::WeightLayout layout) {
  switch (layout) {
    case v1::ModelConfig::SEPARATE_QKV: return WeightLayout::kSeparateQkv;
    case v1::ModelConfig::FUSED_QKV_PER_HEAD: return WeightLayout::kFusedQkvPerHead;
    case v1::ModelConfig::KERAS_DENSE: return WeightLayout::kKerasDense;
    default: return WeightLayout::kTorchMha;
  }
}

WeightSpec ToWeightSpec(const v1::ModelConfig& c) {
  WeightSpec spec;
  spec.qk_norm = c.has_qk_norm();
  spec.sinks = c.sinks();
  if (c.has_output_gate()) {
    spec.gate = c.output_gate().weights() == "query_per_head" ? WeightSpec::Gate::kQueryPerHead
                                                              : WeightSpec::Gate::kSeparate;
    spec.gate_bias = c.output_gate().bias();
  }
  spec.layout = ToWeightLayout(c.weight_layout());
  spec.tensor_prefix = c.tensor_prefix();
  spec.tensor_names.insert(c.tensor_names().begin(), c.tensor_names().end());
  spec.q_bias = c.q_bias();
  spec.k_bias = c.k_bias();
  spec.v_bias = c.v_bias();
  spec.out_bias = c.out_bias();
  return spec;
}

ModelBatching ToModelBatching(const v1::ModelConfig& c) {
  ModelBatching b;
  b.max_batch_requests = c.batching().max_batch_requests();
  b.max_batch_tokens = c.batching().max_batch_tokens();
  b.max_queue_delay_us = c.batching().max_queue_delay_us();
  b.max_queue_size = c.batching().max_queue_size();
  b.instances = c.instances();
  return b;
}

}  // namespace attnserve

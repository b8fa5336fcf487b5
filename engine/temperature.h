// Attention temperature tuning (LayerConfig::temperature_tuning) as Hugging
// Face transformers computes it: the query at index p of its sequence is
// multiplied by log1p(floor((p + 1) / floor_scale)) * attn_scale + 1
// (Llama4TextAttention on its layers without RoPE), or, by_position, the
// query at rotary position p by 1 + attn_scale * log(1 + floor(p /
// floor_scale)) (get_llama_4_attn_scale: Ministral 3's and Mistral 4's
// llama_4_scaling_beta over original_max_position_embeddings).
#ifndef ATTNSERVE_ENGINE_TEMPERATURE_H_
#define ATTNSERVE_ENGINE_TEMPERATURE_H_

#include <cmath>
#include <cstdint>

#include "engine/attention_layer.h"

namespace attnserve {

// The factor of the query at index (or, by_position, position) p >= 0, in
// float64.
inline double QueryTemperature(const TemperatureTuning& t, int64_t p) {
  const double shifted = static_cast<double>(p) + (t.by_position ? 0.0 : 1.0);
  return std::log1p(std::floor(shifted / t.floor_scale)) * t.attn_scale + 1.0;
}

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_TEMPERATURE_H_

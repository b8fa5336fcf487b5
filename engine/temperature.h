// Attention temperature tuning (LayerConfig::temperature_tuning) as Hugging
// Face transformers computes it (Llama4TextAttention on its layers without
// RoPE): the query at index p of its sequence is multiplied by
// log1p(floor((p + 1) / floor_scale)) * attn_scale + 1.
#ifndef ATTNSERVE_ENGINE_TEMPERATURE_H_
#define ATTNSERVE_ENGINE_TEMPERATURE_H_

#include <cmath>
#include <cstdint>

#include "engine/attention_layer.h"

namespace attnserve {

// The factor of the query at index p (>= 0), in float64.
inline double QueryTemperature(const TemperatureTuning& t, int64_t p) {
  return std::log1p(std::floor((static_cast<double>(p) + 1.0) / t.floor_scale)) * t.attn_scale +
         1.0;
}

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_TEMPERATURE_H_

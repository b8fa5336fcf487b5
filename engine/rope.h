// Rotary position embeddings as Hugging Face transformers computes them: the
// inverse frequencies of each scaling type (its _compute_*_parameters
// functions), and the rotation of a head's first rotary_dim features. Every
// angle, cosine and sine is computed in float64 and rounded once, so fp32
// results stay within 2e-5 of a float64 forward at positions in the
// thousands (transformers itself forms the angles in fp32).
#ifndef ATTNSERVE_ENGINE_ROPE_H_
#define ATTNSERVE_ENGINE_ROPE_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attention_layer.h"

namespace attnserve {

// The name of a type as configs spell it ("default", "linear", "llama3",
// "yarn"; "none"), and back. ParseRopeType: InvalidArgument naming the type
// (as rope.type) for anything else.
const char* RopeTypeName(RopeConfig::Type type);
absl::StatusOr<RopeConfig::Type> ParseRopeType(std::string_view name);

// Checks `rope` against a head of `head_dim` features: InvalidArgument
// naming the field (as "rope.<field>") and the rule.
absl::Status ValidateRope(const RopeConfig& rope, int64_t head_dim);

// The frequencies of a validated config: rotary_dim / 2 inverse frequencies,
// and the factor that multiplies cos and sin (1 except for YaRN).
struct RopeFrequencies {
  std::vector<double> inv_freq;
  double attention_factor = 1.0;
};
RopeFrequencies ComputeRopeFrequencies(const RopeConfig& rope);

// cos and sin of position * inv_freq[i] (times the attention factor), in
// float64, for i < inv_freq.size().
void RopeAngles(const RopeFrequencies& f, int64_t position, double* cos_out, double* sin_out);

// Rotates the first rotary_dim features of one head vector in place, given
// RopeAngles at its position (T: float or double; features past rotary_dim
// are left as they are).
template <typename T, typename C>
void RotateHead(T* x, const C* cos_v, const C* sin_v, int64_t rotary_dim, bool interleaved) {
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const int64_t a = interleaved ? 2 * i : i;
    const int64_t b = interleaved ? 2 * i + 1 : i + half;
    const T x1 = x[a], x2 = x[b];
    const T c = static_cast<T>(cos_v[i]), s = static_cast<T>(sin_v[i]);
    x[a] = x1 * c - x2 * s;
    x[b] = x2 * c + x1 * s;
  }
}

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_ROPE_H_

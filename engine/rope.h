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
#include "absl/types/span.h"
#include "engine/attention_layer.h"

namespace attnserve {

// The name of a type as configs spell it ("default", "linear", "llama3",
// "yarn", "longrope"; "none"), and back. ParseRopeType: InvalidArgument naming the type
// (as rope.type) for anything else.
const char* RopeTypeName(RopeConfig::Type type);
absl::StatusOr<RopeConfig::Type> ParseRopeType(std::string_view name);

// Checks `rope` against a head of `head_dim` features: InvalidArgument
// naming the field (as "rope.<field>") and the rule.
absl::Status ValidateRope(const RopeConfig& rope, int64_t head_dim);

// The frequencies of a validated config: rotary_dim / 2 inverse frequencies,
// and the factor that multiplies cos and sin (1 except for YaRN and
// LongRoPE).
struct RopeFrequencies {
  std::vector<double> inv_freq;
  double attention_factor = 1.0;
};

// The frequencies a forward call rotates with, given the largest position it
// rotates (LargestRopePosition). Only LongRoPE depends on it: transformers
// picks a call's factors from max(position_ids) + 1, the long ones past
// original_max_position_embeddings tokens, the short ones otherwise, for the
// whole call (so a session's cached keys keep the rotation of the call that
// appended them, as transformers' KV cache does). Other types ignore it.
RopeFrequencies ComputeRopeFrequencies(const RopeConfig& rope, int64_t max_position);

// The factor on cos and sin (RopeFrequencies::attention_factor): YaRN's and
// LongRoPE's, 1 for the other types. The same for every call's positions.
double RopeAttentionFactor(const RopeConfig& rope);

// Whether ComputeRopeFrequencies(rope, max_position) takes LongRoPE's long
// factors.
bool RopeUsesLongFactors(const RopeConfig& rope, int64_t max_position);

// The largest position of a call's keys (its queries sit at the last of
// them): the largest of its explicit `positions`, or, without them, the last
// of first_key .. first_key + kv_len - 1 (first_key: a session's cached
// tokens, else 0).
int64_t LargestRopePosition(absl::Span<const int64_t> positions, int64_t first_key,
                            int64_t kv_len);

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

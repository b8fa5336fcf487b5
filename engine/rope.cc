// RoPE frequencies: transformers' modeling_rope_utils formulas, in float64.
#include "engine/rope.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

constexpr double kPi = 3.14159265358979323846;

absl::Status RopeError(const char* field, const std::string& rule) {
  return absl::InvalidArgumentError(absl::StrCat("rope.", field, ": ", rule));
}

bool Positive(double x) { return std::isfinite(x) && x > 0; }

// YaRN's default attention factor for a scaling factor (get_mscale).
double YarnMscale(double factor) { return factor <= 1 ? 1.0 : 0.1 * std::log(factor) + 1.0; }

// LongRoPE's attention factor: the config's, or the paper's default for the
// extension factor (_compute_longrope_parameters).
double LongRopeAttentionFactor(const RopeConfig& r) {
  if (r.attention_factor > 0) return r.attention_factor;
  if (r.factor <= 1) return 1.0;
  return std::sqrt(1 + std::log(r.factor) /
                           std::log(static_cast<double>(r.original_max_position_embeddings)));
}

}  // namespace

const char* RopeTypeName(RopeConfig::Type type) {
  switch (type) {
    case RopeConfig::Type::kNone: return "none";
    case RopeConfig::Type::kDefault: return "default";
    case RopeConfig::Type::kLinear: return "linear";
    case RopeConfig::Type::kLlama3: return "llama3";
    case RopeConfig::Type::kYarn: return "yarn";
    case RopeConfig::Type::kLongRope: return "longrope";
  }
  return "none";
}

absl::StatusOr<RopeConfig::Type> ParseRopeType(std::string_view name) {
  for (RopeConfig::Type t : {RopeConfig::Type::kNone, RopeConfig::Type::kDefault,
                             RopeConfig::Type::kLinear, RopeConfig::Type::kLlama3,
                             RopeConfig::Type::kYarn, RopeConfig::Type::kLongRope}) {
    if (name == RopeTypeName(t)) return t;
  }
  return RopeError("type", absl::StrCat("\"", std::string(name),
                                        "\" is not supported (supported: none, default, "
                                        "linear, llama3, yarn, longrope); a layer whose "
                                        "positions attnserve cannot compute is refused"));
}

absl::Status ValidateRope(const RopeConfig& r, int64_t head_dim) {
  using Type = RopeConfig::Type;
  if (r.type == Type::kNone) return absl::OkStatus();
  if (!Positive(r.theta)) return RopeError("theta", absl::StrCat("must be > 0, got ", r.theta));
  if (r.rotary_dim < 2 || r.rotary_dim % 2 != 0 || r.rotary_dim > head_dim) {
    return RopeError("rotary_dim", absl::StrCat("must be even and in [2, head_dim ", head_dim,
                                                "], got ", r.rotary_dim));
  }
  if (r.type != Type::kDefault && !Positive(r.factor)) {
    return RopeError("factor", absl::StrCat("must be > 0 for type ", RopeTypeName(r.type),
                                            ", got ", r.factor));
  }
  if (r.type == Type::kLlama3) {
    if (!Positive(r.low_freq_factor)) {
      return RopeError("low_freq_factor", absl::StrCat("must be > 0, got ", r.low_freq_factor));
    }
    if (!(std::isfinite(r.high_freq_factor) && r.high_freq_factor >= r.low_freq_factor)) {
      return RopeError("high_freq_factor",
                       absl::StrCat("must be >= low_freq_factor ", r.low_freq_factor, ", got ",
                                    r.high_freq_factor));
    }
    if (r.high_freq_factor == r.low_freq_factor && r.original_max_position_embeddings > 0) {
      // No band to blend (Llama 4 Scout: both 1), unless a wavelength sits
      // exactly on its edge, where transformers divides 0 by 0.
      const double edge =
          static_cast<double>(r.original_max_position_embeddings) / r.low_freq_factor;
      RopeConfig plain;
      plain.type = Type::kDefault;
      plain.theta = r.theta;
      plain.rotary_dim = r.rotary_dim;
      const RopeFrequencies f = ComputeRopeFrequencies(plain, 0);
      for (double x : f.inv_freq) {
        if (2 * kPi / x == edge) {
          return RopeError("high_freq_factor",
                           "equal to low_freq_factor with a wavelength on the band's edge, "
                           "where transformers' llama3 scaling is 0 / 0");
        }
      }
    }
  }
  if ((r.type == Type::kLlama3 || r.type == Type::kYarn || r.type == Type::kLongRope) &&
      r.original_max_position_embeddings <= 0) {
    return RopeError("original_max_position_embeddings",
                     absl::StrCat("must be > 0 for type ", RopeTypeName(r.type), ", got ",
                                  r.original_max_position_embeddings));
  }
  if (r.type != Type::kLongRope && (!r.short_factor.empty() || !r.long_factor.empty())) {
    return RopeError(r.short_factor.empty() ? "long_factor" : "short_factor",
                     absl::StrCat("is for type longrope only, not ", RopeTypeName(r.type)));
  }
  if (r.type == Type::kLongRope) {
    const size_t pairs = static_cast<size_t>(r.rotary_dim / 2);
    for (const auto& [field, factors] :
         {std::pair<const char*, const std::vector<double>*>{"short_factor", &r.short_factor},
          {"long_factor", &r.long_factor}}) {
      if (factors->size() != pairs) {
        return RopeError(field, absl::StrCat("must have rotary_dim / 2 = ", pairs,
                                             " values, got ", factors->size()));
      }
      for (size_t i = 0; i < pairs; ++i) {
        if (!Positive((*factors)[i])) {
          return RopeError(field, absl::StrCat("values must be > 0, got ", (*factors)[i],
                                               " at index ", i));
        }
      }
    }
    if (!(r.attention_factor == 0 || Positive(r.attention_factor))) {
      return RopeError("attention_factor",
                       absl::StrCat("must be > 0 (0 = sqrt(1 + ln(factor) / "
                                    "ln(original_max_position_embeddings))), got ",
                                    r.attention_factor));
    }
  }
  if (r.type == Type::kYarn) {
    if (!Positive(r.beta_fast)) {
      return RopeError("beta_fast", absl::StrCat("must be > 0, got ", r.beta_fast));
    }
    if (!Positive(r.beta_slow)) {
      return RopeError("beta_slow", absl::StrCat("must be > 0, got ", r.beta_slow));
    }
    if (!(r.attention_factor == 0 || Positive(r.attention_factor))) {
      return RopeError("attention_factor",
                       absl::StrCat("must be > 0 (0 = 0.1 ln(factor) + 1), got ",
                                    r.attention_factor));
    }
  }
  return absl::OkStatus();
}

bool RopeUsesLongFactors(const RopeConfig& r, int64_t max_position) {
  return r.type == RopeConfig::Type::kLongRope &&
         max_position + 1 > r.original_max_position_embeddings;
}

int64_t LargestRopePosition(absl::Span<const int64_t> positions, int64_t first_key,
                            int64_t kv_len) {
  if (positions.empty()) return first_key + kv_len - 1;
  return *std::max_element(positions.begin(), positions.end());
}

RopeFrequencies ComputeRopeFrequencies(const RopeConfig& r, int64_t max_position) {
  using Type = RopeConfig::Type;
  RopeFrequencies f;
  if (r.type == Type::kNone) return f;
  const int64_t dim = r.rotary_dim;
  const int64_t half = dim / 2;
  // theta^(2i / dim): the wavelength scale of pair i.
  std::vector<double> pos_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    pos_freq[i] = std::pow(r.theta, static_cast<double>(2 * i) / static_cast<double>(dim));
  }
  f.inv_freq.resize(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) f.inv_freq[i] = 1.0 / pos_freq[i];
  switch (r.type) {
    case Type::kNone:
    case Type::kDefault:
      break;
    case Type::kLinear:
      for (double& x : f.inv_freq) x /= r.factor;
      break;
    case Type::kLlama3: {
      // Long wavelengths are divided by factor, short ones kept, and the band
      // between blended smoothly (_compute_llama3_parameters).
      const double old_len = static_cast<double>(r.original_max_position_embeddings);
      const double low_wavelen = old_len / r.low_freq_factor;
      const double high_wavelen = old_len / r.high_freq_factor;
      for (double& x : f.inv_freq) {
        const double wavelen = 2 * kPi / x;
        if (wavelen > low_wavelen) {
          x /= r.factor;
        } else if (!(wavelen < high_wavelen)) {  // the band (empty when high == low)
          const double smooth =
              (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
          x = (1 - smooth) * x / r.factor + smooth * x;
        }
      }
      break;
    }
    case Type::kYarn: {
      // _compute_yarn_parameters: interpolate the low frequencies, keep
      // (extrapolate) the high ones, a linear ramp between the correction
      // dims of beta_fast and beta_slow rotations.
      const double orig = static_cast<double>(r.original_max_position_embeddings);
      auto correction_dim = [&](double rotations) {
        return static_cast<double>(dim) * std::log(orig / (rotations * 2 * kPi)) /
               (2 * std::log(r.theta));
      };
      double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
      if (r.truncate) {
        low = std::floor(low);
        high = std::ceil(high);
      }
      low = std::max(low, 0.0);
      high = std::min(high, static_cast<double>(dim - 1));
      if (low == high) high += 0.001;
      for (int64_t i = 0; i < half; ++i) {
        const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
        const double extrapolation = 1 - ramp;
        const double inv_extra = 1.0 / pos_freq[i];
        const double inv_inter = 1.0 / (r.factor * pos_freq[i]);
        f.inv_freq[i] = inv_inter * (1 - extrapolation) + inv_extra * extrapolation;
      }
      break;
    }
    case Type::kLongRope: {
      // _compute_longrope_parameters: each frequency divided by its own
      // factor, from the set the call's length picks.
      const std::vector<double>& factors =
          RopeUsesLongFactors(r, max_position) ? r.long_factor : r.short_factor;
      for (int64_t i = 0; i < half; ++i) f.inv_freq[i] = 1.0 / (factors[i] * pos_freq[i]);
      break;
    }
  }
  f.attention_factor = RopeAttentionFactor(r);
  return f;
}

double RopeAttentionFactor(const RopeConfig& r) {
  switch (r.type) {
    case RopeConfig::Type::kYarn:
      return r.attention_factor > 0 ? r.attention_factor : YarnMscale(r.factor);
    case RopeConfig::Type::kLongRope:
      return LongRopeAttentionFactor(r);
    default:
      return 1.0;
  }
}

void RopeAngles(const RopeFrequencies& f, int64_t position, double* cos_out, double* sin_out) {
  const double p = static_cast<double>(position);
  for (size_t i = 0; i < f.inv_freq.size(); ++i) {
    const double angle = p * f.inv_freq[i];
    cos_out[i] = std::cos(angle) * f.attention_factor;
    sin_out[i] = std::sin(angle) * f.attention_factor;
  }
}

}  // namespace attnserve

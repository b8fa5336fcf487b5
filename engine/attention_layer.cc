// Consistency checks for an AttentionLayer, run once when a model is loaded
// so that the engines can trust dims and weight shapes afterwards.
#include "engine/attention_layer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/qk_norm.h"
#include "engine/rope.h"

namespace attnserve {
namespace {

absl::Status CheckWeight(const std::string& layer, const char* name, const Tensor& t,
                         const Shape& expected, bool optional) {
  if (optional && t.byte_size() == 0) return absl::OkStatus();  // no bias
  if (t.dtype() != DType::kFloat32) {
    return absl::InvalidArgumentError(absl::StrCat("layer '", layer, "': weight ", name,
                                                   " must be FLOAT32, got ",
                                                   std::string(DTypeName(t.dtype()))));
  }
  if (t.shape() != expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer '", layer, "': weight ", name, " must have shape ",
                     ShapeString(expected), ", got ", ShapeString(t.shape())));
  }
  return absl::OkStatus();
}

struct WeightCheck {
  const char* name;
  const Tensor* tensor;
  Shape expected;
  bool optional;
};

// A latent layer's own rules (LatentAttention), once the dims common to
// every projection layer are checked.
absl::Status ValidateLatentLayer(const AttentionLayer& layer) {
  const LayerConfig& c = layer.config;
  const LatentAttention& m = c.latent;
  auto fail = [&](auto&&... parts) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer '", c.name, "': latent_attention: ", parts...));
  };
  if (m.q_lora_rank < 0) return fail("q_lora_rank must be >= 0 (0 = none), got ", m.q_lora_rank);
  if (m.kv_lora_rank < 1) return fail("kv_lora_rank must be >= 1, got ", m.kv_lora_rank);
  if (m.v_head_dim < 1) return fail("v_head_dim must be >= 1, got ", m.v_head_dim);
  if (m.rope_dim < 2 || m.rope_dim % 2 != 0 || m.rope_dim >= c.head_dim) {
    return fail("qk_rope_head_dim must be even and in [2, head_dim ", c.head_dim,
                "), the rest of head_dim being the nope features; got ", m.rope_dim);
  }
  for (const auto& [name, eps] : {std::pair<const char*, double>{"q_norm_eps", m.q_norm_eps},
                                  {"kv_norm_eps", m.kv_norm_eps}}) {
    if (!std::isfinite(eps) || eps <= 0) return fail(name, " must be > 0, got ", eps);
  }
  if (c.num_kv_heads != c.num_heads) {
    return fail("num_kv_heads must equal num_heads (", c.num_heads, "), got ", c.num_kv_heads);
  }
  if (c.key_dim != c.query_dim || c.value_dim != c.query_dim) {
    return fail("key_dim and value_dim must equal query_dim (K and V come from the query's own "
                "tokens), got ", c.key_dim, " and ", c.value_dim, " with query_dim ", c.query_dim);
  }
  if (c.rope.type != RopeConfig::Type::kNone && c.rope.rotary_dim != m.rope_dim) {
    return fail("rope.rotary_dim must equal qk_rope_head_dim ", m.rope_dim, ", got ",
                c.rope.rotary_dim);
  }
  if (c.qk_norm.enabled || c.output_gate || c.sinks || c.clip_qkv > 0 || c.v_norm_eps > 0 ||
      c.relative_bias_distance > 0 || c.relative_embeddings.distance > 0) {
    return fail("a latent layer takes no qk_norm, output_gate, sinks, clip_qkv, v_norm, "
                "relative_bias_distance or relative_embeddings");
  }
  const LayerWeights& w = layer.weights;
  if (w.q_norm.byte_size() != 0 || w.k_norm.byte_size() != 0 || w.wg.byte_size() != 0 ||
      w.bg.byte_size() != 0 || w.bq.byte_size() != 0 || w.bk.byte_size() != 0 ||
      w.bv.byte_size() != 0 || w.relative_bias.byte_size() != 0 ||
      w.relative_key.byte_size() != 0 || w.relative_query.byte_size() != 0) {
    return fail("weights q_norm, k_norm, wg, bg, bq, bk, bv, relative_bias, relative_key and "
                "relative_query must be empty");
  }
  const int64_t h = c.num_heads, nope = c.head_dim - m.rope_dim;
  const int64_t q_in = m.q_lora_rank > 0 ? m.q_lora_rank : c.query_dim;
  std::vector<WeightCheck> checks = {
      {"wq", &w.wq, {h * c.head_dim, q_in}, false},
      {"wkv_a", &w.wkv_a, {m.kv_lora_rank + m.rope_dim, c.query_dim}, false},
      {"bkv_a", &w.bkv_a, {m.kv_lora_rank + m.rope_dim}, true},
      {"kv_a_norm", &w.kv_a_norm, {m.kv_lora_rank}, false},
      {"wk", &w.wk, {h * nope, m.kv_lora_rank}, false},
      {"wv", &w.wv, {h * m.v_head_dim, m.kv_lora_rank}, false},
      {"wo", &w.wo, {c.out_dim, h * m.v_head_dim}, false},
      {"bo", &w.bo, {c.out_dim}, true},
  };
  if (m.q_lora_rank > 0) {
    checks.push_back({"wq_a", &w.wq_a, {m.q_lora_rank, c.query_dim}, false});
    checks.push_back({"bq_a", &w.bq_a, {m.q_lora_rank}, true});
    checks.push_back({"q_a_norm", &w.q_a_norm, {m.q_lora_rank}, false});
  } else if (w.wq_a.byte_size() != 0 || w.bq_a.byte_size() != 0 ||
             w.q_a_norm.byte_size() != 0) {
    return fail("wq_a, bq_a and q_a_norm need q_lora_rank > 0");
  }
  for (const WeightCheck& check : checks) {
    if (absl::Status s = CheckWeight(c.name, check.name, *check.tensor, check.expected,
                                     check.optional);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

// The learned relative position bias: a table [num_heads, 2 * distance + 1]
// of finite values with relative_bias_distance > 0, no table without.
absl::Status ValidateRelativeBias(const LayerConfig& c, const Tensor& table) {
  const int64_t distance = c.relative_bias_distance;
  if (distance < 0 || distance > kMaxRelativeBiasDistance) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer '", c.name, "': relative_bias_distance must be in [0, ",
                     kMaxRelativeBiasDistance, "], got ", distance));
  }
  if (distance == 0) {
    if (table.byte_size() == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        "layer '", c.name, "': a relative_bias table without relative_bias_distance"));
  }
  const Shape expected{c.num_heads, 2 * distance + 1};
  if (table.dtype() != DType::kFloat32 || table.shape() != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer '", c.name, "': relative_bias must be FLOAT32 ", ShapeString(expected),
        " (num_heads, 2 * relative_bias_distance + 1), got ", ShapeString(table.shape())));
  }
  const float* values = table.data_as<float>();
  for (int64_t i = 0; i < table.num_elements(); ++i) {
    if (!std::isfinite(values[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer '", c.name, "': relative_bias[", i / expected[1], "][", i % expected[1],
          "] must be finite, got ", values[i]));
    }
  }
  return absl::OkStatus();
}

// Relative position embeddings: with a distance in (0, max], one or both
// tables, each FLOAT32 [num_heads, head_dim, 2 * distance + 1] and finite;
// without, neither.
absl::Status ValidateRelativeEmbeddings(const LayerConfig& c, const LayerWeights& w) {
  const RelativeEmbeddings& r = c.relative_embeddings;
  auto fail = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("layer '", c.name, "': ", parts...));
  };
  if (r.distance < 0 || r.distance > kMaxRelativeEmbeddingDistance) {
    return fail("relative_embeddings.distance must be in [0, ", kMaxRelativeEmbeddingDistance,
                "], got ", r.distance);
  }
  if (r.distance > 0 && !r.content_to_position && !r.position_to_content) {
    return fail("relative_embeddings needs content_to_position, position_to_content or both");
  }
  const Shape expected{c.num_heads, c.head_dim, 2 * r.distance + 1};
  for (const auto& [name, flag, table] :
       {std::tuple<const char*, bool, const Tensor*>{"relative_key", r.content_to_position,
                                                     &w.relative_key},
        {"relative_query", r.position_to_content, &w.relative_query}}) {
    const bool used = r.distance > 0 && flag;
    if (!used) {
      if (table->byte_size() == 0) continue;
      return fail("a ", name, " table without relative_embeddings.",
                  table == &w.relative_key ? "content_to_position" : "position_to_content");
    }
    if (table->dtype() != DType::kFloat32 || table->shape() != expected) {
      return fail(name, " must be FLOAT32 ", ShapeString(expected),
                  " (num_heads, head_dim, 2 * relative_embeddings.distance + 1), got ",
                  ShapeString(table->shape()));
    }
    const float* values = table->data_as<float>();
    for (int64_t i = 0; i < table->num_elements(); ++i) {
      if (!std::isfinite(values[i])) {
        const int64_t row = expected[1] * expected[2];
        return fail(name, "[", i / row, "][", i % row / expected[2], "][", i % expected[2],
                    "] must be finite, got ", values[i]);
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateLayer(const AttentionLayer& layer) {
  const LayerConfig& c = layer.config;
  if (c.name.empty()) return absl::InvalidArgumentError("layer: name must not be empty");
  if (!std::isfinite(c.scale) || c.scale < 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer '", c.name, "': scale must be finite and >= 0 (0 = 1/sqrt(head_dim)), got ",
        c.scale));
  }
  if (!std::isfinite(c.softcap) || c.softcap < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer '", c.name, "': softcap must be finite and >= 0 (0 = none), got ", c.softcap));
  }
  if (!std::isfinite(c.clip_qkv) || c.clip_qkv < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer '", c.name, "': clip_qkv must be finite and >= 0 (0 = none), got ", c.clip_qkv));
  }
  if (!std::isfinite(c.v_norm_eps) || c.v_norm_eps < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer '", c.name, "': v_norm eps must be finite and > 0 (0 = no v_norm), got ",
        c.v_norm_eps));
  }
  if (c.sliding_window < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer '", c.name, "': sliding_window must be >= 0 (0 = none), got ", c.sliding_window));
  }
  if (c.attention_chunk < 0 || (c.attention_chunk > 0 && !c.causal)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer '", c.name, "': attention_chunk must be >= 0 (0 = none), and > 0 only on a "
        "causal layer; got ", c.attention_chunk, c.causal ? "" : " on a layer that is not causal"));
  }
  const TemperatureTuning& t = c.temperature_tuning;
  if (t.enabled && (!std::isfinite(t.floor_scale) || t.floor_scale <= 0 ||
                    !std::isfinite(t.attn_scale))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer '", c.name, "': temperature_tuning needs floor_scale > 0 and a finite attn_scale, "
        "got ", t.floor_scale, " and ", t.attn_scale));
  }
  for (size_t h = 0; h < c.alibi_slopes.size(); ++h) {
    if (!std::isfinite(c.alibi_slopes[h])) {
      return absl::InvalidArgumentError(absl::StrCat("layer '", c.name, "': alibi_slopes[", h,
                                                     "] must be finite, got ",
                                                     c.alibi_slopes[h]));
    }
  }
  if (c.has_projections && !c.alibi_slopes.empty() &&
      static_cast<int64_t>(c.alibi_slopes.size()) != c.num_heads) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer '", c.name, "': alibi_slopes must hold one slope per query head (num_heads ",
        c.num_heads, "), got ", c.alibi_slopes.size()));
  }
  if (!c.has_projections) {
    // Head layout: dims come from each request, and there is nothing to weigh.
    const LayerWeights& w = layer.weights;
    for (const Tensor* t : {&w.wq, &w.bq, &w.wk, &w.bk, &w.wv, &w.bv, &w.wo, &w.bo}) {
      if (t->byte_size() != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer '", c.name, "': a layer without projections must carry no weights"));
      }
    }
    if (c.rope.type != RopeConfig::Type::kNone || c.qk_norm.enabled || c.sinks ||
        c.output_gate || c.temperature_tuning.enabled || c.latent.enabled || c.clip_qkv > 0 ||
        c.v_norm_eps > 0 || c.relative_bias_distance != 0 ||
        layer.weights.relative_bias.byte_size() != 0 || c.relative_embeddings.distance != 0 ||
        w.relative_key.byte_size() != 0 || w.relative_query.byte_size() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer '", c.name,
          "': rope, qk_norm, sinks, output_gate, temperature_tuning, latent_attention, "
          "clip_qkv, v_norm, relative_bias_distance and relative_embeddings apply to projection "
          "layers only"));
    }
    return absl::OkStatus();
  }
  if (absl::Status rope = ValidateRope(c.rope, c.head_dim); !rope.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("layer '", c.name, "': ", rope.message()));
  }
  {
    const LayerWeights& w = layer.weights;
    if (c.qk_norm.enabled) {
      if (!std::isfinite(c.qk_norm.eps) || c.qk_norm.eps <= 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer '", c.name, "': qk_norm.eps must be > 0, got ", c.qk_norm.eps));
      }
      if (c.qk_norm.whole_projection && c.qk_norm.per_head_weights) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer '", c.name, "': qk_norm.per_head_weights and qk_norm.whole_projection "
            "exclude each other (one norm per head, or one over all heads)"));
      }
      const bool wide = c.qk_norm.whole_projection || c.qk_norm.per_head_weights;
      for (const auto& [name, t, heads] :
           {std::tuple<const char*, const Tensor*, int64_t>{"q_norm", &w.q_norm, c.num_heads},
            {"k_norm", &w.k_norm, c.num_kv_heads}}) {
        const int64_t width = QkNormWeightCount(c.qk_norm, heads, c.head_dim);
        if (t->dtype() != DType::kFloat32 || t->shape() != Shape{width}) {
          return absl::InvalidArgumentError(absl::StrCat(
              "layer '", c.name, "': ", name, " weight must be FLOAT32 [", width, "] (",
              wide ? (t == &w.q_norm ? "num_heads" : "num_kv_heads") : "",
              c.qk_norm.whole_projection  ? " * head_dim, qk_norm.whole_projection"
              : c.qk_norm.per_head_weights ? " * head_dim, qk_norm.per_head_weights"
                                           : "head_dim",
              "), got ", ShapeString(t->shape())));
        }
      }
    } else if (w.q_norm.byte_size() != 0 || w.k_norm.byte_size() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer '", c.name, "': q_norm/k_norm weights without qk_norm in the config"));
    }
    const bool sinks_ok = w.sinks.dtype() == DType::kFloat32 && w.sinks.shape() == Shape{c.num_heads};
    if (c.sinks != (w.sinks.byte_size() != 0) || (c.sinks && !sinks_ok)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer '", c.name, "': sinks ", c.sinks ? "must be" : "without the config flag are",
          " FLOAT32 [", c.num_heads, "] (num_heads), got ", ShapeString(w.sinks.shape())));
    }
    if (absl::Status s = ValidateRelativeBias(c, w.relative_bias); !s.ok()) return s;
    if (absl::Status s = ValidateRelativeEmbeddings(c, w); !s.ok()) return s;
  }

  struct Dim {
    const char* name;
    int64_t value;
  };
  for (const Dim& d : {Dim{"num_heads", c.num_heads}, Dim{"num_kv_heads", c.num_kv_heads},
                       Dim{"head_dim", c.head_dim}, Dim{"query_dim", c.query_dim},
                       Dim{"key_dim", c.key_dim}, Dim{"value_dim", c.value_dim},
                       Dim{"out_dim", c.out_dim}}) {
    if (d.value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer '", c.name, "': ", d.name, " must be >= 1, got ", d.value));
    }
  }
  if (c.embed_dim < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer '", c.name, "': embed_dim must be >= 0, got ", c.embed_dim));
  }
  if (c.num_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer '", c.name, "': num_heads must be a multiple of num_kv_heads, got ",
                     c.num_heads, " and ", c.num_kv_heads));
  }

  if (c.latent.enabled) return ValidateLatentLayer(layer);
  {
    const LayerWeights& w = layer.weights;
    for (const Tensor* t : {&w.wq_a, &w.bq_a, &w.q_a_norm, &w.wkv_a, &w.bkv_a, &w.kv_a_norm}) {
      if (t->byte_size() != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "layer '", c.name, "': latent attention weights (wq_a, wkv_a, ...) without "
            "latent_attention in the config"));
      }
    }
  }

  const int64_t q_features = c.num_heads * c.head_dim;
  const int64_t kv_features = c.num_kv_heads * c.head_dim;
  const LayerWeights& w = layer.weights;
  const WeightCheck checks[] = {
      {"wq", &w.wq, {q_features, c.query_dim}, false},
      {"bq", &w.bq, {q_features}, true},
      {"wk", &w.wk, {kv_features, c.key_dim}, false},
      {"bk", &w.bk, {kv_features}, true},
      {"wv", &w.wv, {kv_features, c.value_dim}, false},
      {"bv", &w.bv, {kv_features}, true},
      {"wo", &w.wo, {c.out_dim, q_features}, false},
      {"bo", &w.bo, {c.out_dim}, true},
  };
  for (const WeightCheck& check : checks) {
    if (absl::Status s = CheckWeight(c.name, check.name, *check.tensor, check.expected,
                                     check.optional);
        !s.ok()) {
      return s;
    }
  }
  if (!c.output_gate) {
    if (w.wg.byte_size() != 0 || w.bg.byte_size() != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer '", c.name, "': output gate weights (wg, bg) without output_gate in the config"));
    }
    return absl::OkStatus();
  }
  if (absl::Status s = CheckWeight(c.name, "wg", w.wg, {q_features, c.query_dim}, false);
      !s.ok()) {
    return s;
  }
  return CheckWeight(c.name, "bg", w.bg, {q_features}, true);
}

namespace {

// `w` is [out, in] FLOAT32 (or empty), `b` [out] (or empty); shapes were
// checked by ValidateLayer or are checked there before any request runs.
// Rows [row0, row0 + rows) only, when rows >= 0.
ProjectionBound MeasureProjection(const Tensor& w, const Tensor& b, int64_t row0 = 0,
                                  int64_t rows = -1) {
  ProjectionBound bound;
  if (w.byte_size() != 0 && w.shape().size() == 2) {
    const int64_t cols = w.shape()[1];
    const int64_t end = rows < 0 ? w.shape()[0] : row0 + rows;
    const float* data = w.data_as<float>();
    for (int64_t r = row0; r < end; ++r) {
      double sum = 0;
      for (int64_t c = 0; c < cols; ++c) sum += std::fabs(static_cast<double>(data[r * cols + c]));
      // NaN compares false: a NaN weight makes the bound infinite.
      bound.gain = std::isnan(sum) ? INFINITY : std::max(bound.gain, sum);
      if (std::isinf(bound.gain)) break;
    }
  }
  const float* bias = b.data_as<float>();
  const int64_t count = static_cast<int64_t>(b.byte_size() / sizeof(float));
  const int64_t end = rows < 0 ? count : std::min(count, row0 + rows);
  for (int64_t i = rows < 0 ? 0 : row0; i < end; ++i) {
    const double a = std::fabs(static_cast<double>(bias[i]));
    bound.bias = std::isnan(a) ? INFINITY : std::max(bound.bias, a);
  }
  return bound;
}

// The largest |x| of a FLOAT32 tensor (or empty); +inf past a NaN.
double MaxAbs(const Tensor& t) {
  double largest = 0;
  if (t.byte_size() == 0) return largest;
  const float* data = t.data_as<float>();
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    const double x = std::fabs(static_cast<double>(data[i]));
    largest = std::isnan(x) ? INFINITY : std::max(largest, x);
  }
  return largest;
}

// The largest |feature| an RMSNorm with weights `norm` can output: each
// |x_i| / sqrt(mean(x^2) + eps) is at most sqrt(n), times max |w_i|.
double RmsNormBound(const Tensor& norm) {
  return std::sqrt(static_cast<double>(norm.num_elements())) * MaxAbs(norm);
}

// A latent layer's (LayerWeightBounds): the normalised latents bound the
// query (with q_lora_rank), the keys' nope features and the values whatever
// the input; the rotary key grows with it.
LayerWeightBounds MeasureLatentBounds(const LayerWeights& w) {
  LayerWeightBounds b;
  const int64_t kv_rank = w.kv_a_norm.num_elements();
  const int64_t kv_a_rows = w.wkv_a.shape()[0];
  const double c_max = RmsNormBound(w.kv_a_norm);
  const ProjectionBound wk = MeasureProjection(w.wk, w.bk);
  const ProjectionBound wv = MeasureProjection(w.wv, w.bv);
  const ProjectionBound rope = MeasureProjection(w.wkv_a, w.bkv_a, kv_rank, kv_a_rows - kv_rank);
  b.k = {rope.gain, std::max(rope.bias, wk.Apply(c_max))};
  b.v = {0, wv.Apply(c_max)};
  b.latent = MeasureProjection(w.wkv_a, w.bkv_a);
  const ProjectionBound wq = MeasureProjection(w.wq, w.bq);
  if (w.wq_a.byte_size() != 0) {
    const ProjectionBound q_a = MeasureProjection(w.wq_a, w.bq_a);
    b.latent = {std::max(b.latent.gain, q_a.gain), std::max(b.latent.bias, q_a.bias)};
    b.q = {0, wq.Apply(RmsNormBound(w.q_a_norm))};
  } else {
    b.q = wq;
  }
  b.o = MeasureProjection(w.wo, w.bo);
  return b;
}

}  // namespace

LayerWeightBounds MeasureWeightBounds(const LayerWeights& w) {
  if (w.wkv_a.byte_size() != 0) return MeasureLatentBounds(w);
  LayerWeightBounds bounds{MeasureProjection(w.wq, w.bq), MeasureProjection(w.wk, w.bk),
                           MeasureProjection(w.wv, w.bv), MeasureProjection(w.wo, w.bo),
                           MeasureProjection(w.wg, w.bg), {}};
  bounds.q_norm = MaxAbs(w.q_norm);
  bounds.k_norm = MaxAbs(w.k_norm);
  bounds.relative_key = MaxAbs(w.relative_key);
  bounds.relative_query = MaxAbs(w.relative_query);
  return bounds;
}

LayerId::LayerId() {
  static std::atomic<uint64_t> next{1};
  value_ = next.fetch_add(1, std::memory_order_relaxed);
}

LayerId& LayerId::operator=(const LayerId&) {
  value_ = LayerId().value_;
  return *this;
}

}  // namespace attnserve

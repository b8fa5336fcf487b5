// Consistency checks for an AttentionLayer, run once when a model is loaded
// so that the engines can trust dims and weight shapes afterwards.
#include "engine/attention_layer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
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
        c.output_gate || c.temperature_tuning.enabled) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer '", c.name,
          "': rope, qk_norm, sinks, output_gate and temperature_tuning apply to projection "
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
      const bool whole = c.qk_norm.whole_projection;
      for (const auto& [name, t, heads] :
           {std::tuple<const char*, const Tensor*, int64_t>{"q_norm", &w.q_norm, c.num_heads},
            {"k_norm", &w.k_norm, c.num_kv_heads}}) {
        const int64_t width = whole ? heads * c.head_dim : c.head_dim;
        if (t->dtype() != DType::kFloat32 || t->shape() != Shape{width}) {
          return absl::InvalidArgumentError(absl::StrCat(
              "layer '", c.name, "': ", name, " weight must be FLOAT32 [", width, "] (",
              whole ? (t == &w.q_norm ? "num_heads" : "num_kv_heads") : "",
              whole ? " * head_dim, qk_norm.whole_projection" : "head_dim", "), got ",
              ShapeString(t->shape())));
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

  const int64_t q_features = c.num_heads * c.head_dim;
  const int64_t kv_features = c.num_kv_heads * c.head_dim;
  const LayerWeights& w = layer.weights;
  struct Check {
    const char* name;
    const Tensor* tensor;
    Shape expected;
    bool optional;
  };
  const Check checks[] = {
      {"wq", &w.wq, {q_features, c.query_dim}, false},
      {"bq", &w.bq, {q_features}, true},
      {"wk", &w.wk, {kv_features, c.key_dim}, false},
      {"bk", &w.bk, {kv_features}, true},
      {"wv", &w.wv, {kv_features, c.value_dim}, false},
      {"bv", &w.bv, {kv_features}, true},
      {"wo", &w.wo, {c.out_dim, q_features}, false},
      {"bo", &w.bo, {c.out_dim}, true},
  };
  for (const Check& check : checks) {
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
ProjectionBound MeasureProjection(const Tensor& w, const Tensor& b) {
  ProjectionBound bound;
  if (w.byte_size() != 0 && w.shape().size() == 2) {
    const int64_t rows = w.shape()[0], cols = w.shape()[1];
    const float* data = w.data_as<float>();
    for (int64_t r = 0; r < rows; ++r) {
      double sum = 0;
      for (int64_t c = 0; c < cols; ++c) sum += std::fabs(static_cast<double>(data[r * cols + c]));
      // NaN compares false: a NaN weight makes the bound infinite.
      bound.gain = std::isnan(sum) ? INFINITY : std::max(bound.gain, sum);
      if (std::isinf(bound.gain)) break;
    }
  }
  const float* bias = b.data_as<float>();
  for (size_t i = 0; i < b.byte_size() / sizeof(float); ++i) {
    const double a = std::fabs(static_cast<double>(bias[i]));
    bound.bias = std::isnan(a) ? INFINITY : std::max(bound.bias, a);
  }
  return bound;
}

}  // namespace

LayerWeightBounds MeasureWeightBounds(const LayerWeights& w) {
  return {MeasureProjection(w.wq, w.bq), MeasureProjection(w.wk, w.bk),
          MeasureProjection(w.wv, w.bv), MeasureProjection(w.wo, w.bo),
          MeasureProjection(w.wg, w.bg)};
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

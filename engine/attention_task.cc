// Task dims, output shapes, scale resolution, and the engines' defensive
// shape checks before they translate a task into AttentionParams.
#include "engine/attention_task.h"

#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/mask_broadcast.h"

namespace attnserve {

TaskDims GetTaskDims(const LayerConfig& layer, const AttentionTask& task) {
  TaskDims d;
  const Shape& q = task.query.shape;
  if (!layer.has_projections) {
    if (q.size() != 4 || task.key.shape.size() != 4 || task.value.shape.size() != 4) return d;
    d.batch = q[0];
    d.num_heads = q[1];
    d.q_len = q[2];
    d.head_dim = q[3];
    d.num_kv_heads = task.key.shape[1];
    d.kv_len = task.key.shape[2];
    d.head_dim_v = task.value.shape[3];
    return d;
  }
  if (q.size() != 3) return d;
  d.batch = q[0];
  d.q_len = q[1];
  d.kv_len = task.key.empty() || task.key.shape.size() != 3 ? q[1] : task.key.shape[1];
  d.num_heads = layer.num_heads;
  d.num_kv_heads = layer.num_kv_heads;
  d.head_dim = layer.head_dim;
  d.head_dim_v = ValueHeadDim(layer);
  return d;
}

Shape OutputShape(const LayerConfig& layer, const TaskDims& dims) {
  if (!layer.has_projections) return {dims.batch, dims.num_heads, dims.q_len, dims.head_dim_v};
  return {dims.batch, dims.q_len, layer.out_dim};
}

Shape WeightsShape(const TaskDims& dims, bool average_weights) {
  if (average_weights) return {dims.batch, dims.q_len, dims.kv_len};
  return {dims.batch, dims.num_heads, dims.q_len, dims.kv_len};
}

float ResolveScale(const LayerConfig& layer, float request_scale, int64_t head_dim) {
  if (request_scale != 0.0f) return request_scale;
  if (layer.scale != 0.0f) return layer.scale;
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

namespace {

absl::Status CheckView(const char* field, const TensorView& v, const Shape* expected,
                       int64_t rank) {
  if (v.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": missing"));
  if (!IsFloat(v.dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": dtype must be FLOAT32, FLOAT16 or BFLOAT16, got BOOL"));
  }
  if (v.rank() != rank) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": rank must be ", rank,
                                                   ", got shape ", ShapeString(v.shape)));
  }
  if (absl::StatusOr<int64_t> n = NumElements(v.shape); !n.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", n.status().message()));
  }
  if (expected != nullptr && v.shape != *expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": shape must be ", ShapeString(*expected), ", got ", ShapeString(v.shape)));
  }
  return absl::OkStatus();
}

// Per-request window, softcap, sinks and positions (attention_task.h).
absl::Status CheckTaskOptions(const LayerConfig& layer, const AttentionTask& task,
                              const TaskDims& d) {
  if (layer.has_projections && (task.window != 0 || task.softcap != 0.0f || !task.sinks.empty())) {
    return absl::InvalidArgumentError(
        "window, softcap, sinks: per request only for layers without projections (a projection "
        "layer has them in its config)");
  }
  if (task.window < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("window: must be >= 0 (0 = none), got ", task.window));
  }
  if (!std::isfinite(task.softcap) || task.softcap < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("softcap: must be finite and >= 0 (0 = none), got ", task.softcap));
  }
  if (!task.sinks.empty()) {
    if (static_cast<int64_t>(task.sinks.size()) != d.num_heads) {
      return absl::InvalidArgumentError(absl::StrCat("sinks: must have one value per query head (",
                                                     d.num_heads, "), got ", task.sinks.size()));
    }
    for (size_t h = 0; h < task.sinks.size(); ++h) {
      if (!std::isfinite(task.sinks[h])) {
        return absl::InvalidArgumentError(
            absl::StrCat("sinks[", h, "]: must be finite, got ", task.sinks[h]));
      }
    }
  }
  if (!layer.alibi_slopes.empty() &&
      static_cast<int64_t>(layer.alibi_slopes.size()) != d.num_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("query: the layer's alibi_slopes hold ", layer.alibi_slopes.size(),
                     " slopes, one per query head, but the query has ", d.num_heads, " heads"));
  }
  // The temperature of query i is that of its index, cached + Lk - Lq + i
  // (temperature.h), defined for indexes >= 0 only: log1p(floor(p /
  // floor_scale)) is -inf or NaN below. With explicit positions too, whose
  // queries are the last Lq keys (Lq <= Lk, below).
  if (layer.temperature_tuning.enabled) {
    const int64_t cached = task.paged.enabled() ? task.paged.cached_len : 0;
    if (d.q_len > cached + d.kv_len) {
      return absl::InvalidArgumentError(absl::StrCat(
          "query: the layer's temperature_tuning needs Lq <= Lk", cached > 0 ? " + cached" : "",
          " (query i is at index ", cached > 0 ? "cached + " : "",
          "Lk - Lq + i, and its temperature is defined for indexes >= 0), got Lq ", d.q_len,
          ", Lk ", d.kv_len, cached > 0 ? absl::StrCat(", cached ", cached) : ""));
    }
  }
  if (!task.positions.empty()) {
    if (layer.rope.type == RopeConfig::Type::kNone) {
      return absl::InvalidArgumentError("positions: the layer has no rotary embedding");
    }
    if (layer.attention_chunk > 0) {
      // Its chunks follow the token index; positions would only move the
      // rotation, not the chunks (transformers shifts them by left padding).
      return absl::InvalidArgumentError(absl::StrCat(
          "positions: not supported by a chunked-attention layer (attention_chunk ",
          layer.attention_chunk, "): its chunks follow the token index"));
    }
    if (static_cast<int64_t>(task.positions.size()) != d.batch * d.kv_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("positions: must hold B * Lk = ", d.batch * d.kv_len, " values, got ",
                       task.positions.size()));
    }
    if (task.paged.enabled()) {
      return absl::InvalidArgumentError("positions: a session numbers its tokens itself");
    }
    if (d.q_len > d.kv_len) {
      return absl::InvalidArgumentError(
          "positions: need Lq <= Lk (the queries are the last Lq key tokens)");
    }
    for (size_t i = 0; i < task.positions.size(); ++i) {
      if (task.positions[i] < 0 || task.positions[i] > kMaxRotaryPosition) {
        return absl::InvalidArgumentError(absl::StrCat("positions[", i, "]: must be in [0, ",
                                                       kMaxRotaryPosition, "], got ",
                                                       task.positions[i]));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTask(const LayerConfig& layer, const AttentionTask& task) {
  if (task.paged.enabled() && (task.query.rank() < 1 || task.query.shape[0] != 1)) {
    return absl::InvalidArgumentError("query: a session task must have batch 1");
  }
  const TensorView& q = task.query;
  const bool self_attention =
      layer.has_projections && task.key.empty() && task.value.empty();
  if (absl::Status s = CheckView("query", q, nullptr, layer.has_projections ? 3 : 4);
      !s.ok()) {
    return s;
  }
  if (layer.latent.enabled && !self_attention) {
    // Its keys and values come from each token's own latent.
    return absl::InvalidArgumentError(
        "key, value: a latent attention layer (latent_attention) takes the query only: its keys "
        "and values come from the same tokens");
  }
  if (!self_attention) {
    for (const auto& [name, view] : {std::pair<const char*, const TensorView*>{"key", &task.key},
                                     {"value", &task.value}}) {
      if (absl::Status s = CheckView(name, *view, nullptr, q.rank()); !s.ok()) return s;
      if (view->dtype != q.dtype) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": dtype must match query's ",
                                                       std::string(DTypeName(q.dtype)), ", got ",
                                                       std::string(DTypeName(view->dtype))));
      }
    }
  }
  const TaskDims d = GetTaskDims(layer, task);
  if (!layer.has_projections) {
    const Shape key_expected = {d.batch, d.num_kv_heads, d.kv_len, d.head_dim};
    if (task.key.shape != key_expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          "key: shape must be ", ShapeString(key_expected), " given query ",
          ShapeString(q.shape), ", got ", ShapeString(task.key.shape)));
    }
    const Shape value_expected = {d.batch, d.num_kv_heads, d.kv_len, d.head_dim_v};
    if (task.value.shape != value_expected) {
      return absl::InvalidArgumentError(absl::StrCat(
          "value: shape must be [B, Hkv, Lk, Dv] = ", ShapeString(value_expected),
          " given key ", ShapeString(task.key.shape), ", got ",
          ShapeString(task.value.shape)));
    }
    if (d.num_heads % d.num_kv_heads != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("key: query heads (", d.num_heads,
                       ") must be a multiple of key/value heads (", d.num_kv_heads, ")"));
    }
  } else {
    if (q.shape[2] != layer.query_dim) {
      return absl::InvalidArgumentError(absl::StrCat("query: last dim must be query_dim ",
                                                     layer.query_dim, ", got ",
                                                     ShapeString(q.shape)));
    }
    if (self_attention && (layer.key_dim != layer.query_dim ||
                           layer.value_dim != layer.query_dim)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "key: may be omitted (self-attention) only when key_dim and value_dim equal "
          "query_dim; layer has query_dim ", layer.query_dim, ", key_dim ", layer.key_dim,
          ", value_dim ", layer.value_dim));
    }
    if (!self_attention) {
      const Shape key_expected = {d.batch, d.kv_len, layer.key_dim};
      const Shape value_expected = {d.batch, d.kv_len, layer.value_dim};
      if (task.key.shape != key_expected) {
        return absl::InvalidArgumentError(absl::StrCat("key: shape must be ",
                                                       ShapeString(key_expected), ", got ",
                                                       ShapeString(task.key.shape)));
      }
      if (task.value.shape != value_expected) {
        return absl::InvalidArgumentError(absl::StrCat("value: shape must be ",
                                                       ShapeString(value_expected), ", got ",
                                                       ShapeString(task.value.shape)));
      }
    }
  }

  if (task.output.empty() || !IsFloat(task.output.dtype)) {
    return absl::InvalidArgumentError("output: missing, or not a float dtype");
  }
  if (const Shape expected = OutputShape(layer, d); task.output.shape != expected) {
    return absl::InvalidArgumentError(absl::StrCat("output: shape must be ",
                                                   ShapeString(expected), ", got ",
                                                   ShapeString(task.output.shape)));
  }
  if (!task.weights.empty()) {
    if (!IsFloat(task.weights.dtype)) {
      return absl::InvalidArgumentError("weights: dtype must be a float dtype, got BOOL");
    }
    if (const Shape expected = WeightsShape(d, task.average_weights);
        task.weights.shape != expected) {
      return absl::InvalidArgumentError(absl::StrCat("weights: shape must be ",
                                                     ShapeString(expected), ", got ",
                                                     ShapeString(task.weights.shape)));
    }
  }
  if (!std::isfinite(task.scale) || task.scale <= 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale: must be finite and > 0 once resolved, got ", task.scale));
  }
  if (!task.key_lengths.empty()) {
    if (static_cast<int64_t>(task.key_lengths.size()) != d.batch) {
      return absl::InvalidArgumentError(
          absl::StrCat("key_lengths: must have one entry per batch element (", d.batch,
                       "), got ", task.key_lengths.size()));
    }
    for (size_t b = 0; b < task.key_lengths.size(); ++b) {
      const int64_t len = task.key_lengths[b];
      if (len < 0 || len > d.kv_len) {
        return absl::InvalidArgumentError(absl::StrCat("key_lengths[", b, "]: must be in [0, ",
                                                       d.kv_len, "], got ", len));
      }
    }
  }
  if (absl::Status s = CheckTaskOptions(layer, task, d); !s.ok()) return s;
  if (!task.attn_mask.empty()) {
    absl::StatusOr<int64_t> n = NumElements(task.attn_mask.shape);
    if (!n.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("attn_mask: ", n.status().message()));
    }
    absl::StatusOr<MaskParams> mask =
        MakeMaskParams(task.attn_mask, d.batch, d.num_heads, d.q_len, d.kv_len);
    if (!mask.ok()) return mask.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<AttentionParams> MakeCoreParams(const LayerConfig& layer,
                                               const AttentionTask& task) {
  const TaskDims d = GetTaskDims(layer, task);
  AttentionParams p;
  p.batch = d.batch;
  p.num_heads = d.num_heads;
  p.num_kv_heads = d.num_kv_heads;
  p.head_dim = d.head_dim;
  p.head_dim_v = d.head_dim_v;
  p.q_len = d.q_len;
  p.kv_len = d.kv_len;
  p.dtype = task.query.dtype;
  p.causal = task.causal;
  p.window = task.window > 0 ? task.window : layer.sliding_window;
  p.chunk = layer.attention_chunk;
  p.softcap = task.softcap > 0.0f ? task.softcap : layer.softcap;
  p.sinks = task.sinks.empty() ? nullptr : task.sinks.data();
  p.alibi_slopes = layer.alibi_slopes.empty() ? nullptr : layer.alibi_slopes.data();
  p.key_lengths = task.key_lengths.empty() ? nullptr : task.key_lengths.data();
  absl::StatusOr<MaskParams> mask =
      MakeMaskParams(task.attn_mask, d.batch, d.num_heads, d.q_len, d.kv_len);
  if (!mask.ok()) return mask.status();
  p.mask = *mask;
  p.scale = task.scale;
  p.weights = task.weights.empty() ? nullptr : task.weights.data;
  p.weights_dtype = task.weights.dtype;
  p.average_weights = task.average_weights;
  p.out_dtype = task.output.dtype;
  if (!layer.has_projections) {
    p.q = task.query.data;
    p.k = task.key.data;
    p.v = task.value.data;
    p.out = task.output.data;
    SetContiguousStrides(&p, HeadLayoutStrides);
  }
  return p;
}

}  // namespace attnserve

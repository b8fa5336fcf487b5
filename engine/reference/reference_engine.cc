// The reference backend: every semantic of an AttentionTask written as the
// most direct loop over doubles, so that reading it is the specification. It
// reads the task's views itself and shares no checking or mask code with the
// engines it is the oracle of.
#include "engine/reference/reference_engine.h"


#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/attention_task.h"
#include "engine/output_gate.h"
#include "engine/qk_norm.h"
#include "engine/rope.h"
#include "engine/temperature.h"

namespace attnserve {
namespace {

// The dims of one task: scores are [batch, heads, q_len, kv_len].
struct Dims {
  int64_t batch = 0, heads = 0, kv_heads = 0, q_len = 0, kv_len = 0;
  int64_t head_dim = 0, head_dim_v = 0;
};

absl::Status Invalid(const char* field, const std::string& rule) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", rule));
}

// A present float tensor of `rank` whose dims are all >= 1 and whose size fits.
absl::Status CheckInput(const char* field, const TensorView& v, int64_t rank) {
  if (v.empty()) return Invalid(field, "missing");
  if (!IsFloat(v.dtype)) {
    return Invalid(field, absl::StrCat("dtype must be FLOAT32, FLOAT16 or BFLOAT16, got ",
                                       std::string(DTypeName(v.dtype))));
  }
  if (v.rank() != rank) {
    return Invalid(field, absl::StrCat("rank must be ", rank, ", got shape ",
                                       ShapeString(v.shape)));
  }
  if (absl::StatusOr<int64_t> n = NumElements(v.shape); !n.ok()) {
    return Invalid(field, std::string(n.status().message()));
  }
  return absl::OkStatus();
}

absl::Status CheckShape(const char* field, const Shape& got, const Shape& want) {
  if (got == want) return absl::OkStatus();
  return Invalid(field, absl::StrCat("shape must be ", ShapeString(want), ", got ",
                                     ShapeString(got)));
}

// Checks the inputs against the layer and derives the dims from them.
absl::StatusOr<Dims> CheckInputs(const LayerConfig& c, const AttentionTask& t) {
  const bool self_attention = c.has_projections && t.key.empty() && t.value.empty();
  const int64_t rank = c.has_projections ? 3 : 4;
  if (absl::Status s = CheckInput("query", t.query, rank); !s.ok()) return s;
  if (c.latent.enabled && !self_attention) {
    return Invalid("key", "a latent attention layer takes the query only (its keys and values "
                          "come from the same tokens)");
  }
  if (!self_attention) {
    if (absl::Status s = CheckInput("key", t.key, rank); !s.ok()) return s;
    if (absl::Status s = CheckInput("value", t.value, rank); !s.ok()) return s;
    for (const auto& [field, view] : {std::pair{"key", &t.key}, std::pair{"value", &t.value}}) {
      if (view->dtype != t.query.dtype) {
        return Invalid(field, absl::StrCat("dtype must match query's ",
                                           std::string(DTypeName(t.query.dtype)), ", got ",
                                           std::string(DTypeName(view->dtype))));
      }
    }
  }
  const Shape& q = t.query.shape;
  Dims d;
  d.batch = q[0];
  if (!c.has_projections) {
    // query [B, Hq, Lq, Dk], key [B, Hkv, Lk, Dk], value [B, Hkv, Lk, Dv].
    d.heads = q[1];
    d.q_len = q[2];
    d.head_dim = q[3];
    d.kv_heads = t.key.shape[1];
    d.kv_len = t.key.shape[2];
    d.head_dim_v = t.value.shape[3];
    if (absl::Status s =
            CheckShape("key", t.key.shape, {d.batch, d.kv_heads, d.kv_len, d.head_dim});
        !s.ok()) {
      return s;
    }
    if (absl::Status s =
            CheckShape("value", t.value.shape, {d.batch, d.kv_heads, d.kv_len, d.head_dim_v});
        !s.ok()) {
      return s;
    }
    if (d.heads % d.kv_heads != 0) {
      return Invalid("key", absl::StrCat("query heads (", d.heads,
                                         ") must be a multiple of key/value heads (", d.kv_heads,
                                         ")"));
    }
    return d;
  }
  // query [B, Lq, query_dim], key [B, Lk, key_dim], value [B, Lk, value_dim].
  d.heads = c.num_heads;
  d.kv_heads = c.num_kv_heads;
  d.head_dim = c.head_dim;
  d.head_dim_v = ValueHeadDim(c);
  d.q_len = q[1];
  if (q[2] != c.query_dim) {
    return Invalid("query", absl::StrCat("last dim must be query_dim ", c.query_dim, ", got ",
                                         ShapeString(q)));
  }
  if (self_attention) {
    if (c.key_dim != c.query_dim || c.value_dim != c.query_dim) {
      return Invalid("key", absl::StrCat("may be omitted (self-attention) only when key_dim (",
                                         c.key_dim, ") and value_dim (", c.value_dim,
                                         ") equal query_dim (", c.query_dim, ")"));
    }
    d.kv_len = d.q_len;
    return d;
  }
  d.kv_len = t.key.shape[1];
  if (absl::Status s = CheckShape("key", t.key.shape, {d.batch, d.kv_len, c.key_dim}); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckShape("value", t.value.shape, {d.batch, d.kv_len, c.value_dim});
      !s.ok()) {
    return s;
  }
  return d;
}

// Everything but the inputs: output and weights buffers, scale, key_lengths
// and the mask's broadcast against the scores.
absl::Status CheckRest(const LayerConfig& c, const AttentionTask& t, const Dims& d) {
  if (t.output.empty() || !IsFloat(t.output.dtype)) {
    return Invalid("output", "missing, or not a FLOAT32/FLOAT16/BFLOAT16 buffer");
  }
  const Shape output = c.has_projections ? Shape{d.batch, d.q_len, c.out_dim}
                                         : Shape{d.batch, d.heads, d.q_len, d.head_dim_v};
  if (absl::Status s = CheckShape("output", t.output.shape, output); !s.ok()) return s;
  if (!t.weights.empty()) {
    if (!IsFloat(t.weights.dtype)) {
      return Invalid("weights", absl::StrCat("dtype must be a float dtype, got ",
                                             std::string(DTypeName(t.weights.dtype))));
    }
    const Shape weights = t.average_weights ? Shape{d.batch, d.q_len, d.kv_len}
                                            : Shape{d.batch, d.heads, d.q_len, d.kv_len};
    if (absl::Status s = CheckShape("weights", t.weights.shape, weights); !s.ok()) return s;
  }
  if (!std::isfinite(t.scale) || t.scale <= 0.0f) {
    return Invalid("scale", absl::StrCat("must be finite and > 0, got ", t.scale));
  }
  if (t.window < 0) return Invalid("window", absl::StrCat("must be >= 0, got ", t.window));
  if (!std::isfinite(t.softcap) || t.softcap < 0.0f) {
    return Invalid("softcap", absl::StrCat("must be finite and >= 0, got ", t.softcap));
  }
  if (c.has_projections && (t.window != 0 || t.softcap != 0.0f || !t.sinks.empty())) {
    return Invalid("window", "window, softcap and sinks per request need a layer without "
                             "projections");
  }
  // Query i sits at index Lk - Lq + i; the temperature's log1p(floor(p /
  // floor_scale)) is -inf or NaN below index 0.
  if (c.temperature_tuning.enabled && d.q_len > d.kv_len) {
    return Invalid("query", absl::StrCat("the layer's temperature_tuning needs Lq <= Lk (its "
                                         "factor is defined for indexes >= 0), got Lq ",
                                         d.q_len, ", Lk ", d.kv_len));
  }
  if (!c.alibi_slopes.empty() && static_cast<int64_t>(c.alibi_slopes.size()) != d.heads) {
    return Invalid("query", absl::StrCat("the layer's alibi_slopes hold ", c.alibi_slopes.size(),
                                         " slopes, one per query head, but the query has ",
                                         d.heads, " heads"));
  }
  if (!t.sinks.empty() && static_cast<int64_t>(t.sinks.size()) != d.heads) {
    return Invalid("sinks", absl::StrCat("must hold one value per query head (", d.heads,
                                         "), got ", t.sinks.size()));
  }
  if (!t.positions.empty()) {
    if (c.rope.type == RopeConfig::Type::kNone) {
      return Invalid("positions", "the layer has no rotary embedding");
    }
    if (static_cast<int64_t>(t.positions.size()) != d.batch * d.kv_len) {
      return Invalid("positions", absl::StrCat("must hold B * Lk = ", d.batch * d.kv_len,
                                               " values, got ", t.positions.size()));
    }
    if (d.q_len > d.kv_len) return Invalid("positions", "need Lq <= Lk");
    for (const int64_t pos : t.positions) {
      if (pos < 0) return Invalid("positions", absl::StrCat("must be >= 0, got ", pos));
    }
  }
  if (!t.key_lengths.empty()) {
    if (static_cast<int64_t>(t.key_lengths.size()) != d.batch) {
      return Invalid("key_lengths", absl::StrCat("must have one entry per batch element (",
                                                 d.batch, "), got ", t.key_lengths.size()));
    }
    for (const int64_t len : t.key_lengths) {
      if (len < 0 || len > d.kv_len) {
        return Invalid("key_lengths", absl::StrCat("each must be in [0, ", d.kv_len, "], got ",
                                                   len));
      }
    }
  }
  if (!t.attn_mask.empty()) {
    const Shape& m = t.attn_mask.shape;
    if (m.size() < 2 || m.size() > 4) {
      return Invalid("attn_mask", absl::StrCat("rank must be 2, 3 or 4, got shape ",
                                               ShapeString(m)));
    }
    if (absl::StatusOr<int64_t> n = NumElements(m); !n.ok()) {
      return Invalid("attn_mask", std::string(n.status().message()));
    }
    // NumPy broadcasting: dims matched from the right, each equal or 1.
    const int64_t scores[4] = {d.batch, d.heads, d.q_len, d.kv_len};
    for (size_t a = 0; a < m.size(); ++a) {
      const int64_t target = scores[4 - m.size() + a];
      if (m[a] != 1 && m[a] != target) {
        return Invalid("attn_mask", absl::StrCat("shape ", ShapeString(m),
                                                 " does not broadcast to [B, Hq, Lq, Lk] = ",
                                                 ShapeString(scores), " (dim ", a, ")"));
      }
    }
  }
  return absl::OkStatus();
}

// Element (b, h, i, j) of a mask broadcast to [B, Hq, Lq, Lk]: its own dims
// right-aligned with those, a dim of size 1 read at index 0.
int64_t MaskIndex(const Shape& m, int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t at[4] = {b, h, i, j};
  int64_t index = 0;
  for (size_t a = 0; a < m.size(); ++a) {
    index = index * m[a] + (m[a] == 1 ? 0 : at[4 - m.size() + a]);
  }
  return index;
}

// Rows of D doubles addressed as (b, h, l): head layout [B, H, L, D] or token
// layout [B, L, H * D], whichever `heads_outer` says.
struct Rows {
  std::vector<double> data;
  int64_t heads = 0, len = 0, dim = 0;
  bool heads_outer = true;

  int64_t at(int64_t b, int64_t h, int64_t l) const {
    return heads_outer ? ((b * heads + h) * len + l) * dim : ((b * len + l) * heads + h) * dim;
  }
  double* row(int64_t b, int64_t h, int64_t l) { return data.data() + at(b, h, l); }
  const double* row(int64_t b, int64_t h, int64_t l) const { return data.data() + at(b, h, l); }
};

std::vector<double> LoadAll(const TensorView& t) {
  std::vector<double> out(static_cast<size_t>(t.num_elements()));
  for (int64_t i = 0; i < static_cast<int64_t>(out.size()); ++i) {
    out[i] = LoadAsFloat(t.dtype, t.data, i);
  }
  return out;
}

// y[r, n] = sum_c x[r, c] * w[n, c] + bias[n] for x [rows, in] and w
// [out, in] FLOAT32 (PyTorch Linear layout): the weights as stored, whatever
// the layer's precision.
std::vector<double> Linear(const std::vector<double>& x, int64_t rows, int64_t in,
                           const Tensor& w, const Tensor& bias) {
  const int64_t out = w.shape()[0];
  const float* wp = w.data_as<float>();
  const float* bp = bias.byte_size() != 0 ? bias.data_as<float>() : nullptr;
  std::vector<double> y(static_cast<size_t>(rows * out));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < out; ++n) {
      double acc = bp != nullptr ? bp[n] : 0.0;
      for (int64_t c = 0; c < in; ++c) acc += x[r * in + c] * static_cast<double>(wp[n * in + c]);
      y[r * out + n] = acc;
    }
  return y;
}

void StoreAll(const std::vector<double>& values, const MutableTensorView& to) {
  for (int64_t i = 0; i < static_cast<int64_t>(values.size()); ++i) {
    StoreFromFloat(to.dtype, to.data, i, static_cast<float>(values[i]));
  }
}

const float* TableOrNull(const Tensor& t) {
  return t.byte_size() != 0 ? t.data_as<float>() : nullptr;
}

// The biases a layer adds by position, in float64: ALiBi's alibi[h] * r and
// a relative bias table's entry for r = j - (i + Lk - Lq), clamped to
// [-distance, distance] (LayerConfig::alibi_slopes, relative_bias_distance).
struct PositionBias {
  const std::vector<float>& alibi;
  const float* table = nullptr;  // [heads, 2 * distance + 1], or none
  int64_t distance = 0;

  // Relative position embeddings (LayerConfig::relative_embeddings): each
  // [heads, head_dim, 2 * embedding_distance + 1], or none.
  const float* relative_key = nullptr;
  const float* relative_query = nullptr;
  int64_t embedding_distance = 0;
  int64_t head_dim = 0;

  bool empty() const { return alibi.empty() && table == nullptr; }
  bool embedded() const { return relative_key != nullptr || relative_query != nullptr; }
  // The embeddings' terms of head h's raw score for r = j - position: q .
  // relative_key[h][:, c] + k . relative_query[h][:, c].
  double Embedded(int64_t h, int64_t r, const double* q, const double* k) const {
    const int64_t n = 2 * embedding_distance + 1;
    const int64_t c = std::clamp(r, -embedding_distance, embedding_distance) + embedding_distance;
    double sum = 0.0;
    for (int64_t f = 0; f < head_dim; ++f) {
      const int64_t at = (h * head_dim + f) * n + c;
      if (relative_key != nullptr) sum += q[f] * static_cast<double>(relative_key[at]);
      if (relative_query != nullptr) sum += k[f] * static_cast<double>(relative_query[at]);
    }
    return sum;
  }
  double operator()(int64_t h, int64_t r) const {
    double bias = 0.0;
    if (!alibi.empty()) bias += static_cast<double>(alibi[h]) * static_cast<double>(r);
    if (table != nullptr) {
      bias += table[h * (2 * distance + 1) + std::clamp(r, -distance, distance) + distance];
    }
    return bias;
  }
};

// softmax(Q K^T * scale + mask) V per head, into `out` (rows of Dv, zeroed
// by the caller), and the probabilities into t.weights when wanted.
// Query head h reads key/value head h / (Hq / Hkv). Query i sees key j iff
// causal => j <= i + (Lk - Lq), window > 0 => j >= i + (Lk - Lq) - window + 1
// (and, without causal, j <= i + (Lk - Lq) + window - 1: a two-sided window),
// chunk > 0 => j >= the start of the chunk of `chunk` keys that holds
// i + (Lk - Lq) (its own chunk, with causal),
// j < key_lengths[b], and a bool mask is nonzero there; a float mask is added
// to the scaled score (after softcap * tanh(score / softcap) when softcap >
// 0, and after the position biases; relative position embeddings join the
// raw score, before the scale); sinks[h], when given, joins the softmax
// denominator. A row that sees no key, or only keys at -inf, is zeros
// (output and weights), not NaN.
void AttendHeads(const AttentionTask& t, const Dims& d, int64_t window, int64_t chunk,
                 double softcap, const float* sinks, const PositionBias& position_bias,
                 const Rows& q, const Rows& k, const Rows& v, Rows& out) {
  const int64_t group = d.heads / d.kv_heads;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  const TensorView& mask = t.attn_mask;
  const bool bool_mask = !mask.empty() && mask.dtype == DType::kBool;
  const bool float_mask = !mask.empty() && mask.dtype != DType::kBool;
  auto sees = [&](int64_t b, int64_t h, int64_t i, int64_t j) {
    if (t.causal && j > i + (d.kv_len - d.q_len)) return false;
    if (window > 0 && j < i + (d.kv_len - d.q_len) - window + 1) return false;
    if (window > 0 && !t.causal && j > i + (d.kv_len - d.q_len) + window - 1) return false;
    if (chunk > 0 && j < (i + (d.kv_len - d.q_len)) / chunk * chunk) return false;
    if (!t.key_lengths.empty() && j >= t.key_lengths[b]) return false;
    if (bool_mask) {
      return static_cast<const uint8_t*>(mask.data)[MaskIndex(mask.shape, b, h, i, j)] != 0;
    }
    return true;
  };
  auto added = [&](int64_t b, int64_t h, int64_t i, int64_t j) {
    if (!float_mask) return 0.0;
    return static_cast<double>(
        LoadAsFloat(mask.dtype, mask.data, MaskIndex(mask.shape, b, h, i, j)));
  };
  std::vector<double> scores(static_cast<size_t>(d.kv_len));
  std::vector<bool> visible(static_cast<size_t>(d.kv_len));
  std::vector<double> p(static_cast<size_t>(d.kv_len));
  std::vector<double> head_sum(static_cast<size_t>(d.kv_len));
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t i = 0; i < d.q_len; ++i) {
      std::fill(head_sum.begin(), head_sum.end(), 0.0);
      for (int64_t h = 0; h < d.heads; ++h) {
        const int64_t g = h / group;
        const double* qi = q.row(b, h, i);
        double row_max = neg_inf;
        for (int64_t j = 0; j < d.kv_len; ++j) {
          visible[j] = sees(b, h, i, j);
          if (!visible[j]) continue;
          const double* kj = k.row(b, g, j);
          double dot = 0.0;
          for (int64_t c = 0; c < d.head_dim; ++c) dot += qi[c] * kj[c];
          if (position_bias.embedded()) {
            dot += position_bias.Embedded(h, j - (i + d.kv_len - d.q_len), qi, kj);
          }
          double scaled = dot * static_cast<double>(t.scale);
          if (softcap > 0) scaled = softcap * std::tanh(scaled / softcap);
          if (!position_bias.empty()) scaled += position_bias(h, j - (i + d.kv_len - d.q_len));
          scores[j] = scaled + added(b, h, i, j);
          row_max = std::max(row_max, scores[j]);
        }
        std::fill(p.begin(), p.end(), 0.0);
        // A sink is one more logit in the denominator, with no value row.
        const double sink = sinks != nullptr ? static_cast<double>(sinks[h]) : neg_inf;
        if (row_max != neg_inf) {
          row_max = std::max(row_max, sink);
          double sum = sinks != nullptr ? std::exp(sink - row_max) : 0.0;
          for (int64_t j = 0; j < d.kv_len; ++j) {
            p[j] = visible[j] ? std::exp(scores[j] - row_max) : 0.0;
            sum += p[j];
          }
          for (int64_t j = 0; j < d.kv_len; ++j) p[j] /= sum;
          double* oi = out.row(b, h, i);
          for (int64_t j = 0; j < d.kv_len; ++j) {
            if (p[j] == 0.0) continue;
            const double* vj = v.row(b, g, j);
            for (int64_t c = 0; c < d.head_dim_v; ++c) oi[c] += p[j] * vj[c];
          }
        }
        for (int64_t j = 0; j < d.kv_len; ++j) {
          head_sum[j] += p[j];
          if (!t.weights.empty() && !t.average_weights) {
            StoreFromFloat(t.weights.dtype, t.weights.data,
                           ((b * d.heads + h) * d.q_len + i) * d.kv_len + j,
                           static_cast<float>(p[j]));
          }
        }
      }
      if (!t.weights.empty() && t.average_weights) {
        for (int64_t j = 0; j < d.kv_len; ++j) {
          StoreFromFloat(t.weights.dtype, t.weights.data, (b * d.q_len + i) * d.kv_len + j,
                         static_cast<float>(head_sum[j] / static_cast<double>(d.heads)));
        }
      }
    }
  }
}

// One task of a layer without projections: inputs and output in head layout.
void RunBare(const LayerConfig& c, const AttentionTask& t, const Dims& d) {
  const Rows q{LoadAll(t.query), d.heads, d.q_len, d.head_dim};
  const Rows k{LoadAll(t.key), d.kv_heads, d.kv_len, d.head_dim};
  const Rows v{LoadAll(t.value), d.kv_heads, d.kv_len, d.head_dim_v};
  Rows out{std::vector<double>(static_cast<size_t>(d.batch * d.heads * d.q_len * d.head_dim_v)),
           d.heads, d.q_len, d.head_dim_v};
  AttendHeads(t, d, t.window > 0 ? t.window : c.sliding_window, c.attention_chunk,
              t.softcap > 0.0f ? t.softcap : c.softcap,
              t.sinks.empty() ? nullptr : t.sinks.data(), PositionBias{c.alibi_slopes}, q, k,
              v, out);
  StoreAll(out.data, t.output);
}

// RMSNorm in float64 of each row of `x` ([rows, stride]) over its features
// [offset, offset + dim), with weights w[dim], into a new [rows, dim].
std::vector<double> RmsNormColumns(const std::vector<double>& x, int64_t rows, int64_t stride,
                                   int64_t offset, int64_t dim, const Tensor& w, double eps) {
  std::vector<double> y(static_cast<size_t>(rows * dim));
  const float* wp = w.data_as<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const double* in = x.data() + r * stride + offset;
    double sum = 0;
    for (int64_t i = 0; i < dim; ++i) sum += in[i] * in[i];
    const double inv = 1.0 / std::sqrt(sum / static_cast<double>(dim) + eps);
    for (int64_t i = 0; i < dim; ++i) y[r * dim + i] = in[i] * inv * static_cast<double>(wp[i]);
  }
  return y;
}

// Multi-head latent attention's projections (LatentAttention): the query
// heads, and keys and values, each in token layout [rows, heads, dim]; keys
// [nope | rope] per head with the one rotary key copied into every head.
struct LatentQkv {
  std::vector<double> q, k, v;
};
LatentQkv LatentProjections(const LayerConfig& c, const LayerWeights& w,
                            const std::vector<double>& x, int64_t rows) {
  const LatentAttention& m = c.latent;
  LatentQkv out;
  if (m.q_lora_rank > 0) {
    const std::vector<double> qa = Linear(x, rows, c.query_dim, w.wq_a, w.bq_a);
    const std::vector<double> qn = RmsNormColumns(qa, rows, m.q_lora_rank, 0, m.q_lora_rank,
                                                  w.q_a_norm, m.q_norm_eps);
    out.q = Linear(qn, rows, m.q_lora_rank, w.wq, w.bq);
  } else {
    out.q = Linear(x, rows, c.query_dim, w.wq, w.bq);
  }
  const int64_t a_dim = m.kv_lora_rank + m.rope_dim;
  const std::vector<double> kv_a = Linear(x, rows, c.query_dim, w.wkv_a, w.bkv_a);
  const std::vector<double> latent =
      RmsNormColumns(kv_a, rows, a_dim, 0, m.kv_lora_rank, w.kv_a_norm, m.kv_norm_eps);
  const std::vector<double> k_nope = Linear(latent, rows, m.kv_lora_rank, w.wk, w.bk);
  out.v = Linear(latent, rows, m.kv_lora_rank, w.wv, w.bv);
  const int64_t h = c.num_heads, nope = c.head_dim - m.rope_dim;
  out.k.resize(static_cast<size_t>(rows * h * c.head_dim));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t head = 0; head < h; ++head) {
      double* key = out.k.data() + (r * h + head) * c.head_dim;
      std::copy_n(k_nope.data() + (r * h + head) * nope, nope, key);
      std::copy_n(kv_a.data() + r * a_dim + m.kv_lora_rank, m.rope_dim, key + nope);
    }
  }
  return out;
}

// One task of nn.MultiheadAttention (batch first): project the tokens, attend
// per head over the projected [B, L, H * D] rows, concatenate the heads,
// gate them (output_gate), project out.
void RunProjected(const AttentionLayer& layer, const AttentionTask& t, const Dims& d) {
  const LayerConfig& c = layer.config;
  const LayerWeights& w = layer.weights;
  const bool self_attention = t.key.empty();
  const std::vector<double> xq = LoadAll(t.query);
  const std::vector<double> xk = self_attention ? xq : LoadAll(t.key);
  const std::vector<double> xv = self_attention ? xq : LoadAll(t.value);
  const int64_t q_rows = d.batch * d.q_len, kv_rows = d.batch * d.kv_len;
  LatentQkv latent;
  if (c.latent.enabled) latent = LatentProjections(c, w, xq, q_rows);
  Rows q{c.latent.enabled ? std::move(latent.q) : Linear(xq, q_rows, c.query_dim, w.wq, w.bq),
         d.heads, d.q_len, d.head_dim, false};
  Rows k{c.latent.enabled
             ? std::move(latent.k)
             : Linear(xk, kv_rows, self_attention ? c.query_dim : c.key_dim, w.wk, w.bk),
         d.kv_heads, d.kv_len, d.head_dim, false};
  // RoPE rotates a latent layer's last rope_dim features of each head.
  const int64_t rope_offset = c.latent.enabled ? c.head_dim - c.latent.rope_dim : 0;
  // RMSNorm (or LayerNorm, subtract_mean) of every head of Q and K, or of
  // each token's whole projection (its heads are contiguous here), in
  // float64; before RoPE, or after it (qk_norm.after_rope).
  auto normalize = [&] {
    if (!c.qk_norm.enabled) return;
    const QkNormVectors qn = QkNormShape(c.qk_norm, d.heads, d.head_dim);
    const QkNormVectors kn = QkNormShape(c.qk_norm, d.kv_heads, d.head_dim);
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t i = 0; i < d.q_len; ++i) {
        for (int64_t v = 0; v < qn.count; ++v) {
          NormalizeHead(q.row(b, 0, i) + v * qn.dim,
                        w.q_norm.data_as<float>() + v * qn.weight_stride, qn.dim, c.qk_norm);
        }
      }
      for (int64_t j = 0; j < d.kv_len; ++j) {
        for (int64_t v = 0; v < kn.count; ++v) {
          NormalizeHead(k.row(b, 0, j) + v * kn.dim,
                        w.k_norm.data_as<float>() + v * kn.weight_stride, kn.dim, c.qk_norm);
        }
      }
    }
  };
  if (!c.qk_norm.after_rope) normalize();
  // QKV clipping (OLMo, DBRX): after the projections and a QK-norm before
  // RoPE (OLMoE's order), before RoPE.
  auto clip = [&](std::vector<double>& values) {
    if (c.clip_qkv <= 0) return;
    const double limit = c.clip_qkv;
    for (double& x : values) x = std::clamp(x, -limit, limit);
  };
  clip(q.data);
  clip(k.data);
  if (c.rope.type != RopeConfig::Type::kNone) {
    // Keys at positions j (or the task's positions[b][j]) and queries at the
    // last Lq of them; the angles in float64, never rounded. The call's
    // largest position picks LongRoPE's factors.
    const RopeFrequencies f =
        ComputeRopeFrequencies(c.rope, LargestRopePosition(t.positions, 0, d.kv_len));
    std::vector<double> cos_v(f.inv_freq.size()), sin_v(f.inv_freq.size());
    auto position = [&](int64_t b, int64_t j) {
      return t.positions.empty() ? j : t.positions[static_cast<size_t>(b * d.kv_len + j)];
    };
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t i = 0; i < d.q_len; ++i) {
        RopeAngles(f, position(b, d.kv_len - d.q_len + i), cos_v.data(), sin_v.data());
        for (int64_t h = 0; h < d.heads; ++h) {
          RotateHead(q.row(b, h, i) + rope_offset, cos_v.data(), sin_v.data(),
                     c.rope.rotary_dim, c.rope.interleaved);
        }
      }
      for (int64_t j = 0; j < d.kv_len; ++j) {
        RopeAngles(f, position(b, j), cos_v.data(), sin_v.data());
        for (int64_t g = 0; g < d.kv_heads; ++g) {
          RotateHead(k.row(b, g, j) + rope_offset, cos_v.data(), sin_v.data(),
                     c.rope.rotary_dim, c.rope.interleaved);
        }
      }
    }
  }
  if (c.qk_norm.after_rope) normalize();
  if (c.temperature_tuning.enabled) {
    // Llama 4's layers without RoPE: query i, at index Lk - Lq + i; by
    // position (Ministral 3): at positions[b][Lk - Lq + i] when given.
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t i = 0; i < d.q_len; ++i) {
        const int64_t index = d.kv_len - d.q_len + i;
        const int64_t p = c.temperature_tuning.by_position && !t.positions.empty()
                              ? t.positions[static_cast<size_t>(b * d.kv_len + index)]
                              : index;
        const double factor = QueryTemperature(c.temperature_tuning, p);
        for (int64_t h = 0; h < d.heads; ++h) {
          double* row = q.row(b, h, i);
          for (int64_t x = 0; x < d.head_dim; ++x) row[x] *= factor;
        }
      }
    }
  }
  Rows v{c.latent.enabled
             ? std::move(latent.v)
             : Linear(xv, kv_rows, self_attention ? c.query_dim : c.value_dim, w.wv, w.bv),
         d.kv_heads, d.kv_len, d.head_dim_v, false};
  if (c.v_norm_eps > 0) {
    // Gemma 3n's and Gemma 4's v_norm: RMSNorm of each value head, no weight.
    QkNormConfig norm;
    norm.enabled = true;
    norm.eps = c.v_norm_eps;
    for (int64_t b = 0; b < d.batch; ++b) {
      for (int64_t g = 0; g < d.kv_heads; ++g) {
        for (int64_t j = 0; j < d.kv_len; ++j) {
          NormalizeHead(v.row(b, g, j), static_cast<const float*>(nullptr), d.head_dim_v, norm);
        }
      }
    }
  }
  clip(v.data);
  Rows merged{std::vector<double>(static_cast<size_t>(q_rows * d.heads * d.head_dim_v)), d.heads,
              d.q_len, d.head_dim_v, false};
  AttendHeads(t, d, c.sliding_window, c.attention_chunk, c.softcap,
              c.sinks ? w.sinks.data_as<float>() : nullptr,
              PositionBias{c.alibi_slopes,
                           c.relative_bias_distance > 0 ? w.relative_bias.data_as<float>()
                                                        : nullptr,
                           c.relative_bias_distance, TableOrNull(w.relative_key),
                           TableOrNull(w.relative_query), c.relative_embeddings.distance,
                           c.head_dim},
              q, k, v, merged);
  if (c.output_gate) {
    // Gated attention: each token's concatenated heads times sigmoid of its
    // gate, projected from the same token's query input.
    const std::vector<double> gate = Linear(xq, q_rows, c.query_dim, w.wg, w.bg);
    for (size_t i = 0; i < gate.size(); ++i) merged.data[i] *= Sigmoid(gate[i]);
  }
  StoreAll(Linear(merged.data, q_rows, d.heads * d.head_dim_v, w.wo, w.bo), t.output);
}

class ReferenceEngine final : public AttentionEngine {
 public:
  std::string_view name() const override { return "reference"; }

  absl::Status Run(const AttentionLayer& layer, absl::Span<const AttentionTask> batch) override {
    try {
      if (layer.config.has_projections) {
        // The weights are read with the config's dims: check they agree.
        if (absl::Status s = ValidateLayer(layer); !s.ok()) return s;
      }
      for (const AttentionTask& task : batch) {
        if (task.paged.enabled()) {
          return absl::UnimplementedError("reference engine: sessions (a paged K/V cache) are "
                                          "served by the cpu engine");
        }
        absl::StatusOr<Dims> dims = CheckInputs(layer.config, task);
        if (!dims.ok()) return dims.status();
        if (absl::Status s = CheckRest(layer.config, task, *dims); !s.ok()) return s;
        if (layer.config.has_projections) {
          RunProjected(layer, task, *dims);
        } else {
          RunBare(layer.config, task, *dims);
        }
      }
      return absl::OkStatus();
    } catch (const std::bad_alloc&) {  // the only thing that can throw here
      return absl::ResourceExhaustedError("reference engine: out of memory");
    }
  }
};

}  // namespace

std::unique_ptr<AttentionEngine> NewReferenceEngine() {
  return std::make_unique<ReferenceEngine>();
}

}  // namespace attnserve

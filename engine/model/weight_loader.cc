// Checkpoint layouts -> canonical LayerWeights: name resolution, shape checks
// with messages that name the tensor, and the per-layout splits/transposes.
#include "engine/model/weight_loader.h"

#include <cstring>
#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "engine/qk_norm.h"

namespace attnserve {
namespace {

struct RoleDefault {
  const char* role;
  const char* name;
};

constexpr RoleDefault kTorchMhaNames[] = {
    {"in_proj_weight", "in_proj_weight"}, {"in_proj_bias", "in_proj_bias"},
    {"q_weight", "q_proj_weight"},       {"k_weight", "k_proj_weight"},
    {"v_weight", "v_proj_weight"},       {"out_weight", "out_proj.weight"},
    {"out_bias", "out_proj.bias"},
    {"q_norm_weight", "q_norm.weight"},
    {"k_norm_weight", "k_norm.weight"},
    {"sinks", "sinks"}, {"relative_bias", "relative_bias"},
    {"relative_key", "relative_key"}, {"relative_query", "relative_query"},
    {"gate_weight", "gate_proj.weight"}, {"gate_bias", "gate_proj.bias"},
};
constexpr RoleDefault kSeparateQkvNames[] = {
    {"q_weight", "q_proj.weight"}, {"q_bias", "q_proj.bias"},
    {"k_weight", "k_proj.weight"}, {"k_bias", "k_proj.bias"},
    {"v_weight", "v_proj.weight"}, {"v_bias", "v_proj.bias"},
    {"out_weight", "o_proj.weight"}, {"out_bias", "o_proj.bias"},
    {"q_norm_weight", "q_norm.weight"}, {"k_norm_weight", "k_norm.weight"},
    {"sinks", "sinks"}, {"relative_bias", "relative_bias"},
    {"relative_key", "relative_key"}, {"relative_query", "relative_query"},
    {"gate_weight", "gate_proj.weight"}, {"gate_bias", "gate_proj.bias"},
    // Multi-head latent attention (DeepSeek's names).
    {"q_a_weight", "q_a_proj.weight"}, {"q_a_norm_weight", "q_a_layernorm.weight"},
    {"q_b_weight", "q_b_proj.weight"},
    {"kv_a_weight", "kv_a_proj_with_mqa.weight"}, {"kv_a_bias", "kv_a_proj_with_mqa.bias"},
    {"kv_a_norm_weight", "kv_a_layernorm.weight"}, {"kv_b_weight", "kv_b_proj.weight"},
    {"q_a_bias", "q_a_proj.bias"},
};
constexpr RoleDefault kFusedNames[] = {
    {"qkv_weight", "qkv.weight"},
    {"qkv_bias", "qkv.bias"},
    {"out_weight", "out_proj.weight"},
    {"out_bias", "out_proj.bias"},
    {"q_norm_weight", "q_norm.weight"},
    {"k_norm_weight", "k_norm.weight"},
    {"sinks", "sinks"}, {"relative_bias", "relative_bias"},
    {"relative_key", "relative_key"}, {"relative_query", "relative_query"},
    {"gate_weight", "gate_proj.weight"}, {"gate_bias", "gate_proj.bias"},
};
constexpr RoleDefault kKerasNames[] = {
    {"q_weight", "query/kernel"},   {"q_bias", "query/bias"},
    {"k_weight", "key/kernel"},     {"k_bias", "key/bias"},
    {"v_weight", "value/kernel"},   {"v_bias", "value/bias"},
    {"out_weight", "attention_output/kernel"}, {"out_bias", "attention_output/bias"},
    {"q_norm_weight", "q_norm.weight"}, {"k_norm_weight", "k_norm.weight"},
    {"sinks", "sinks"}, {"relative_bias", "relative_bias"},
    {"relative_key", "relative_key"}, {"relative_query", "relative_query"},
    {"gate_weight", "gate/kernel"}, {"gate_bias", "gate/bias"},
};

absl::Span<const RoleDefault> RoleTable(WeightLayout layout) {
  switch (layout) {
    case WeightLayout::kTorchMha: return kTorchMhaNames;
    case WeightLayout::kSeparateQkv: return kSeparateQkvNames;
    case WeightLayout::kFusedQkvPerHead: return kFusedNames;
    case WeightLayout::kKerasDense: return kKerasNames;
  }
  return {};
}

// Reads tensors for one layer and reports problems in one voice.
Tensor MakeTensor(Shape shape, const float* src) {
  Tensor t(DType::kFloat32, std::move(shape));
  if (t.byte_size() > 0) std::memcpy(t.data(), src, t.byte_size());
  return t;
}

class Reader {
 public:
  Reader(const SafetensorsFile& file, const WeightSpec& spec, Precision precision)
      : file_(file), spec_(spec), precision_(precision) {}

  std::string NameOf(const std::string& role) const {
    auto it = spec_.tensor_names.find(role);
    std::string local = it != spec_.tensor_names.end() ? it->second
                                                        : DefaultTensorName(spec_.layout, role);
    return spec_.tensor_prefix + local;
  }

  bool Has(const std::string& role) const { return file_.Find(NameOf(role)) != nullptr; }

  // A bias the file holds for this layer but the config turns off is almost
  // always a forgotten flag: refuse rather than drop it silently.
  // A tensor of this layer in the file that the config does not use.
  absl::Status CheckUnused(const std::string& role, bool used, const char* why) const {
    if (used || !Has(role)) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        file_.path(), ": tensor '", NameOf(role), "' (", role, " of layout ",
        WeightLayoutName(spec_.layout), ") is in the file but ", why,
        "; configure it, or remove the tensor"));
  }

  absl::Status CheckUnusedBias(const std::string& role, bool used, const char* flags) const {
    if (used || !Has(role)) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(
        file_.path(), ": tensor '", NameOf(role), "' (", role, " of layout ",
        WeightLayoutName(spec_.layout), ") is in the file but ", flags,
        " false; set it to true to use the bias, or remove the tensor"));
  }

  // The tensor for `role` as float32 values, rounded to the layer precision.
  // `shapes` lists the accepted shapes (same element count, same memory
  // order); the first is the one named in errors.
  absl::StatusOr<std::vector<float>> Read(const std::string& role,
                                          std::initializer_list<Shape> shapes) const {
    const std::string name = NameOf(role);
    const SafetensorsEntry* entry = file_.Find(name);
    std::vector<std::string> expected;
    for (const Shape& s : shapes) expected.push_back(ShapeString(s));
    if (entry == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(file_.path(), ": tensor '", name, "' is missing (", role, " of layout ",
                       WeightLayoutName(spec_.layout), "); expected shape ",
                       absl::StrJoin(expected, " or "), ". ", Inventory()));
    }
    bool match = false;
    for (const Shape& s : shapes) match = match || s == entry->shape;
    if (!match) {
      return absl::InvalidArgumentError(
          absl::StrCat(file_.path(), ": tensor '", name, "' (", role, " of layout ",
                       WeightLayoutName(spec_.layout), ") has shape ",
                       ShapeString(entry->shape), "; expected ",
                       absl::StrJoin(expected, " or ")));
    }
    std::vector<float> values = file_.ReadAsFloat(*entry);
    if (precision_ != Precision::kFloat32) {
      for (float& v : values) v = RoundTo(precision_, v);
    }
    return values;
  }

  // A bias the spec asks for, as a 1-D tensor of shapes[0]'s element count
  // (the canonical layout); left empty when `wanted` is false.
  absl::Status ReadBias(const std::string& role, bool wanted,
                        std::initializer_list<Shape> shapes, Tensor* out) const {
    if (!wanted) return absl::OkStatus();
    absl::StatusOr<std::vector<float>> values = Read(role, shapes);
    if (!values.ok()) return values.status();
    *out = MakeTensor({static_cast<int64_t>(values->size())}, values->data());
    return absl::OkStatus();
  }

 private:
  // A hint for a wrong prefix or name: what the file does hold.
  std::string Inventory() const {
    const auto& entries = file_.entries();
    if (entries.empty()) return "The file holds no tensors.";
    std::vector<std::string> names;
    for (const auto& [name, entry] : entries) {
      if (names.size() == 8) break;
      names.push_back(absl::StrCat("'", name, "'"));
    }
    return absl::StrCat("The file holds ", entries.size(), " tensors: ", absl::StrJoin(names, ", "),
                        entries.size() > names.size() ? ", ..." : "");
  }

  const SafetensorsFile& file_;
  const WeightSpec& spec_;
  Precision precision_;
};

// Rows [row0, row0 + rows) of a row-major [*, cols] matrix.
Tensor RowSlice(const std::vector<float>& m, int64_t cols, int64_t row0, int64_t rows) {
  return MakeTensor({rows, cols}, m.data() + row0 * cols);
}

Tensor VectorSlice(const std::vector<float>& v, int64_t begin, int64_t n) {
  return MakeTensor({n}, v.data() + begin);
}

// [in, out] (row-major) -> [out, in].
Tensor Transpose(const std::vector<float>& kernel, int64_t in, int64_t out) {
  Tensor t(DType::kFloat32, {out, in});
  float* dst = t.data_as<float>();
  for (int64_t i = 0; i < in; ++i) {
    for (int64_t o = 0; o < out; ++o) dst[o * in + i] = kernel[static_cast<size_t>(i * out + o)];
  }
  return t;
}

#define RETURN_IF_ERROR(expr)                    \
  if (absl::Status s_ = (expr); !s_.ok()) return s_

#define ASSIGN_OR_RETURN(lhs, expr)          \
  auto lhs##_or = (expr);                    \
  if (!lhs##_or.ok()) return lhs##_or.status(); \
  auto lhs = std::move(*lhs##_or)

absl::StatusOr<LayerWeights> LoadTorchMha(const Reader& r, const LayerConfig& c,
                                          const WeightSpec& spec) {
  const int64_t q_out = c.num_heads * c.head_dim;
  const int64_t kv_out = c.num_kv_heads * c.head_dim;
  const int64_t packed_rows = q_out + 2 * kv_out;
  LayerWeights w;
  const bool same_in = c.query_dim == c.key_dim && c.key_dim == c.value_dim;
  // PyTorch packs iff kdim == vdim == embed_dim; follow the file when it has
  // the separate tensors instead, so a hand-made export also loads.
  const bool packed = same_in && (r.Has("in_proj_weight") || !r.Has("q_weight"));
  if (packed) {
    ASSIGN_OR_RETURN(in_proj, r.Read("in_proj_weight", {{packed_rows, c.query_dim}}));
    w.wq = RowSlice(in_proj, c.query_dim, 0, q_out);
    w.wk = RowSlice(in_proj, c.query_dim, q_out, kv_out);
    w.wv = RowSlice(in_proj, c.query_dim, q_out + kv_out, kv_out);
  } else {
    ASSIGN_OR_RETURN(wq, r.Read("q_weight", {{q_out, c.query_dim}}));
    ASSIGN_OR_RETURN(wk, r.Read("k_weight", {{kv_out, c.key_dim}}));
    ASSIGN_OR_RETURN(wv, r.Read("v_weight", {{kv_out, c.value_dim}}));
    w.wq = MakeTensor({q_out, c.query_dim}, wq.data());
    w.wk = MakeTensor({kv_out, c.key_dim}, wk.data());
    w.wv = MakeTensor({kv_out, c.value_dim}, wv.data());
  }
  if (absl::Status s = r.CheckUnusedBias("in_proj_bias", spec.q_bias || spec.k_bias || spec.v_bias,
                                         "q_bias, k_bias and v_bias are");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = r.CheckUnusedBias("out_bias", spec.out_bias, "out_bias is"); !s.ok()) {
    return s;
  }
  if (spec.q_bias || spec.k_bias || spec.v_bias) {
    ASSIGN_OR_RETURN(in_bias, r.Read("in_proj_bias", {{packed_rows}}));
    if (spec.q_bias) w.bq = VectorSlice(in_bias, 0, q_out);
    if (spec.k_bias) w.bk = VectorSlice(in_bias, q_out, kv_out);
    if (spec.v_bias) w.bv = VectorSlice(in_bias, q_out + kv_out, kv_out);
  }
  ASSIGN_OR_RETURN(wo, r.Read("out_weight", {{c.out_dim, q_out}}));
  w.wo = MakeTensor({c.out_dim, q_out}, wo.data());
  RETURN_IF_ERROR(r.ReadBias("out_bias", spec.out_bias, {{c.out_dim}}, &w.bo));
  return w;
}

// De-interleaves a matrix fused per head, [h * n * hd, cols] for n parts (a
// bias is cols = 1): its row (head, part, d), at head*n*hd + part*hd + d,
// becomes row head*hd + d of parts[part] (each [h * hd, cols], already
// allocated). QKV per head (n = 3), a query with its gate (n = 2).
void SplitFusedPerHead(const float* fused, int64_t h, int64_t hd, int64_t cols,
                       absl::Span<Tensor* const> parts) {
  const size_t block = static_cast<size_t>(hd * cols);
  const int64_t n = static_cast<int64_t>(parts.size());
  for (int64_t head = 0; head < h; ++head) {
    for (int64_t part = 0; part < n; ++part) {
      std::memcpy(parts[part]->data_as<float>() + head * block,
                  fused + (head * n + part) * block, sizeof(float) * block);
    }
  }
}

// For layouts with one bias tensor per projection.
absl::Status CheckUnusedBiases(const Reader& r, const WeightSpec& spec) {
  const std::pair<const char*, bool> roles[] = {
      {"q_bias", spec.q_bias}, {"k_bias", spec.k_bias}, {"v_bias", spec.v_bias},
      {"out_bias", spec.out_bias}};
  for (const auto& [role, used] : roles) {
    if (absl::Status s = r.CheckUnusedBias(role, used, absl::StrCat(role, " is").c_str());
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<LayerWeights> LoadSeparate(const Reader& r, const LayerConfig& c,
                                          const WeightSpec& spec) {
  const int64_t q_out = c.num_heads * c.head_dim;
  const int64_t kv_out = c.num_kv_heads * c.head_dim;
  if (absl::Status s = CheckUnusedBiases(r, spec); !s.ok()) return s;
  LayerWeights w;
  if (spec.gate == WeightSpec::Gate::kQueryPerHead) {
    // Qwen3-Next: q_proj's rows are [q_h | gate_h] per head.
    ASSIGN_OR_RETURN(wqg, r.Read("q_weight", {{2 * q_out, c.query_dim}}));
    w.wq = Tensor(DType::kFloat32, {q_out, c.query_dim});
    w.wg = Tensor(DType::kFloat32, {q_out, c.query_dim});
    SplitFusedPerHead(wqg.data(), c.num_heads, c.head_dim, c.query_dim, {&w.wq, &w.wg});
    if (spec.q_bias) {
      ASSIGN_OR_RETURN(bqg, r.Read("q_bias", {{2 * q_out}}));
      w.bq = Tensor(DType::kFloat32, {q_out});
      w.bg = Tensor(DType::kFloat32, {q_out});
      SplitFusedPerHead(bqg.data(), c.num_heads, c.head_dim, 1, {&w.bq, &w.bg});
    }
  } else {
    ASSIGN_OR_RETURN(wq, r.Read("q_weight", {{q_out, c.query_dim}}));
    w.wq = MakeTensor({q_out, c.query_dim}, wq.data());
    RETURN_IF_ERROR(r.ReadBias("q_bias", spec.q_bias, {{q_out}}, &w.bq));
  }
  ASSIGN_OR_RETURN(wk, r.Read("k_weight", {{kv_out, c.key_dim}}));
  ASSIGN_OR_RETURN(wv, r.Read("v_weight", {{kv_out, c.value_dim}}));
  ASSIGN_OR_RETURN(wo, r.Read("out_weight", {{c.out_dim, q_out}}));
  w.wk = MakeTensor({kv_out, c.key_dim}, wk.data());
  w.wv = MakeTensor({kv_out, c.value_dim}, wv.data());
  w.wo = MakeTensor({c.out_dim, q_out}, wo.data());
  RETURN_IF_ERROR(r.ReadBias("k_bias", spec.k_bias, {{kv_out}}, &w.bk));
  RETURN_IF_ERROR(r.ReadBias("v_bias", spec.v_bias, {{kv_out}}, &w.bv));
  RETURN_IF_ERROR(r.ReadBias("out_bias", spec.out_bias, {{c.out_dim}}, &w.bo));
  return w;
}

// Multi-head latent attention (LatentAttention, SEPARATE_QKV): kv_b_proj's
// rows, [k_nope_h | v_h] per head, split into wk and wv.
absl::StatusOr<LayerWeights> LoadLatent(const Reader& r, const LayerConfig& c,
                                        const WeightSpec& spec) {
  const LatentAttention& m = c.latent;
  const int64_t h = c.num_heads, nope = c.head_dim - m.rope_dim, dv = m.v_head_dim;
  const int64_t q_out = h * c.head_dim, kv_a_rows = m.kv_lora_rank + m.rope_dim;
  const bool q_lora = m.q_lora_rank > 0;
  // The roles of the other form of the query, and those no latent layer has.
  const std::pair<const char*, const char*> unused[] = {
      {q_lora ? "q_weight" : "q_b_weight",
       q_lora ? "latent_attention.q_lora_rank > 0 (the query comes from q_a_proj and q_b_proj)"
              : "latent_attention.q_lora_rank is 0 (one q_proj)"},
      {q_lora ? "q_bias" : "q_a_weight", q_lora ? "q_bias applies to q_a_proj"
                                                : "latent_attention.q_lora_rank is 0"},
      {"k_weight", "a latent layer's keys come from kv_a_proj_with_mqa and kv_b_proj"},
      {"v_weight", "a latent layer's values come from kv_b_proj"},
      {"k_bias", "k_bias applies to kv_a_proj_with_mqa"},
      {"v_bias", "a latent layer has no value bias"}};
  for (const auto& [role, why] : unused) {
    if (absl::Status s = r.CheckUnused(role, false, why); !s.ok()) return s;
  }
  if (!q_lora) {
    if (absl::Status s = r.CheckUnused("q_a_norm_weight", false,
                                       "latent_attention.q_lora_rank is 0");
        !s.ok()) {
      return s;
    }
  }
  if (spec.v_bias) {
    return absl::InvalidArgumentError(
        "v_bias: a latent attention layer has no value bias (its values come from kv_b_proj)");
  }
  RETURN_IF_ERROR(r.CheckUnusedBias(q_lora ? "q_a_bias" : "q_bias", spec.q_bias, "q_bias is"));
  RETURN_IF_ERROR(r.CheckUnusedBias("kv_a_bias", spec.k_bias, "k_bias is"));
  RETURN_IF_ERROR(r.CheckUnusedBias("out_bias", spec.out_bias, "out_bias is"));
  LayerWeights w;
  if (q_lora) {
    ASSIGN_OR_RETURN(wq_a, r.Read("q_a_weight", {{m.q_lora_rank, c.query_dim}}));
    ASSIGN_OR_RETURN(q_norm, r.Read("q_a_norm_weight", {{m.q_lora_rank}}));
    ASSIGN_OR_RETURN(wq_b, r.Read("q_b_weight", {{q_out, m.q_lora_rank}}));
    w.wq_a = MakeTensor({m.q_lora_rank, c.query_dim}, wq_a.data());
    w.q_a_norm = MakeTensor({m.q_lora_rank}, q_norm.data());
    w.wq = MakeTensor({q_out, m.q_lora_rank}, wq_b.data());
    RETURN_IF_ERROR(r.ReadBias("q_a_bias", spec.q_bias, {{m.q_lora_rank}}, &w.bq_a));
  } else {
    if (spec.q_bias) {
      return absl::InvalidArgumentError(
          "q_bias: applies to q_a_proj, and latent_attention.q_lora_rank is 0 (DeepSeek's "
          "q_proj has no bias)");
    }
    ASSIGN_OR_RETURN(wq, r.Read("q_weight", {{q_out, c.query_dim}}));
    w.wq = MakeTensor({q_out, c.query_dim}, wq.data());
  }
  ASSIGN_OR_RETURN(wkv_a, r.Read("kv_a_weight", {{kv_a_rows, c.query_dim}}));
  ASSIGN_OR_RETURN(kv_norm, r.Read("kv_a_norm_weight", {{m.kv_lora_rank}}));
  ASSIGN_OR_RETURN(wkv_b, r.Read("kv_b_weight", {{h * (nope + dv), m.kv_lora_rank}}));
  w.wkv_a = MakeTensor({kv_a_rows, c.query_dim}, wkv_a.data());
  w.kv_a_norm = MakeTensor({m.kv_lora_rank}, kv_norm.data());
  RETURN_IF_ERROR(r.ReadBias("kv_a_bias", spec.k_bias, {{kv_a_rows}}, &w.bkv_a));
  w.wk = Tensor(DType::kFloat32, {h * nope, m.kv_lora_rank});
  w.wv = Tensor(DType::kFloat32, {h * dv, m.kv_lora_rank});
  const size_t row_bytes = sizeof(float) * static_cast<size_t>(m.kv_lora_rank);
  for (int64_t head = 0; head < h; ++head) {
    const float* src = wkv_b.data() + head * (nope + dv) * m.kv_lora_rank;
    std::memcpy(w.wk.data_as<float>() + head * nope * m.kv_lora_rank, src, nope * row_bytes);
    std::memcpy(w.wv.data_as<float>() + head * dv * m.kv_lora_rank,
                src + nope * m.kv_lora_rank, dv * row_bytes);
  }
  ASSIGN_OR_RETURN(wo, r.Read("out_weight", {{c.out_dim, h * dv}}));
  w.wo = MakeTensor({c.out_dim, h * dv}, wo.data());
  RETURN_IF_ERROR(r.ReadBias("out_bias", spec.out_bias, {{c.out_dim}}, &w.bo));
  return w;
}

absl::StatusOr<LayerWeights> LoadFusedPerHead(const Reader& r, const LayerConfig& c,
                                              const WeightSpec& spec) {
  const int64_t h = c.num_heads;
  const int64_t hd = c.head_dim;
  const int64_t in = c.query_dim;
  const int64_t q_out = h * hd;
  LayerWeights w;
  ASSIGN_OR_RETURN(qkv, r.Read("qkv_weight", {{h * 3 * hd, in}}));
  w.wq = Tensor(DType::kFloat32, {q_out, in});
  w.wk = Tensor(DType::kFloat32, {q_out, in});
  w.wv = Tensor(DType::kFloat32, {q_out, in});
  SplitFusedPerHead(qkv.data(), h, hd, in, {&w.wq, &w.wk, &w.wv});
  if (absl::Status s = r.CheckUnusedBias("qkv_bias", spec.q_bias || spec.k_bias || spec.v_bias,
                                         "q_bias, k_bias and v_bias are");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = r.CheckUnusedBias("out_bias", spec.out_bias, "out_bias is"); !s.ok()) {
    return s;
  }
  if (spec.q_bias || spec.k_bias || spec.v_bias) {
    ASSIGN_OR_RETURN(bias, r.Read("qkv_bias", {{h * 3 * hd}}));
    Tensor b[3] = {Tensor(DType::kFloat32, {q_out}), Tensor(DType::kFloat32, {q_out}),
                   Tensor(DType::kFloat32, {q_out})};
    SplitFusedPerHead(bias.data(), h, hd, 1, {&b[0], &b[1], &b[2]});
    if (spec.q_bias) w.bq = std::move(b[0]);
    if (spec.k_bias) w.bk = std::move(b[1]);
    if (spec.v_bias) w.bv = std::move(b[2]);
  }
  ASSIGN_OR_RETURN(wo, r.Read("out_weight", {{c.out_dim, q_out}}));
  w.wo = MakeTensor({c.out_dim, q_out}, wo.data());
  RETURN_IF_ERROR(r.ReadBias("out_bias", spec.out_bias, {{c.out_dim}}, &w.bo));
  return w;
}

absl::StatusOr<LayerWeights> LoadKeras(const Reader& r, const LayerConfig& c,
                                       const WeightSpec& spec) {
  const int64_t h = c.num_heads;
  const int64_t hkv = c.num_kv_heads;
  const int64_t hd = c.head_dim;
  const int64_t q_out = h * hd;
  const int64_t kv_out = hkv * hd;
  if (absl::Status s = CheckUnusedBiases(r, spec); !s.ok()) return s;
  LayerWeights w;
  // Dense kernels are [in, units]; EinsumDense (keras MultiHeadAttention)
  // keeps the heads apart, [in, H, hd] and [H, hd, out], same memory order.
  ASSIGN_OR_RETURN(kq, r.Read("q_weight", {{c.query_dim, q_out}, {c.query_dim, h, hd}}));
  ASSIGN_OR_RETURN(kk, r.Read("k_weight", {{c.key_dim, kv_out}, {c.key_dim, hkv, hd}}));
  ASSIGN_OR_RETURN(kv, r.Read("v_weight", {{c.value_dim, kv_out}, {c.value_dim, hkv, hd}}));
  ASSIGN_OR_RETURN(ko, r.Read("out_weight", {{q_out, c.out_dim}, {h, hd, c.out_dim}}));
  w.wq = Transpose(kq, c.query_dim, q_out);
  w.wk = Transpose(kk, c.key_dim, kv_out);
  w.wv = Transpose(kv, c.value_dim, kv_out);
  w.wo = Transpose(ko, q_out, c.out_dim);
  RETURN_IF_ERROR(r.ReadBias("q_bias", spec.q_bias, {{q_out}, {h, hd}}, &w.bq));
  RETURN_IF_ERROR(r.ReadBias("k_bias", spec.k_bias, {{kv_out}, {hkv, hd}}, &w.bk));
  RETURN_IF_ERROR(r.ReadBias("v_bias", spec.v_bias, {{kv_out}, {hkv, hd}}, &w.bv));
  RETURN_IF_ERROR(r.ReadBias("out_bias", spec.out_bias, {{c.out_dim}}, &w.bo));
  return w;
}

#undef ASSIGN_OR_RETURN

}  // namespace

const char* WeightLayoutName(WeightLayout layout) {
  switch (layout) {
    case WeightLayout::kTorchMha: return "TORCH_MHA";
    case WeightLayout::kSeparateQkv: return "SEPARATE_QKV";
    case WeightLayout::kFusedQkvPerHead: return "FUSED_QKV_PER_HEAD";
    case WeightLayout::kKerasDense: return "KERAS_DENSE";
  }
  return "?";
}

std::vector<std::string> WeightRoles(WeightLayout layout) {
  std::vector<std::string> roles;
  for (const RoleDefault& d : RoleTable(layout)) roles.emplace_back(d.role);
  return roles;
}

std::string DefaultTensorName(WeightLayout layout, const std::string& role) {
  for (const RoleDefault& d : RoleTable(layout)) {
    if (role == d.role) return d.name;
  }
  return "";
}

namespace {
// The projections' weights and biases of `spec.layout`.
absl::StatusOr<LayerWeights> LoadProjections(const Reader& reader, const SafetensorsFile& file,
                                             const LayerConfig& config, const WeightSpec& spec);
}  // namespace

absl::StatusOr<LayerWeights> LoadLayerWeights(const SafetensorsFile& file,
                                              const LayerConfig& config,
                                              const WeightSpec& spec) {
  if (!config.has_projections) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": model '", config.name, "' has no projections to load"));
  }
  if (config.num_heads <= 0 || config.num_kv_heads <= 0 || config.head_dim <= 0 ||
      config.query_dim <= 0 || config.key_dim <= 0 || config.value_dim <= 0 ||
      config.out_dim <= 0 || config.num_heads % config.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.path(), ": model '", config.name, "' has unresolved or inconsistent dims"));
  }
  for (const auto& [role, name] : spec.tensor_names) {
    if (DefaultTensorName(spec.layout, role).empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor_names key '", role, "' is not a role of layout ", WeightLayoutName(spec.layout),
          "; expected one of ", absl::StrJoin(WeightRoles(spec.layout), ", ")));
    }
  }
  if (spec.gate == WeightSpec::Gate::kQueryPerHead &&
      spec.layout != WeightLayout::kSeparateQkv) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.path(), ": output_gate.weights \"query_per_head\" needs layout SEPARATE_QKV, got ",
        WeightLayoutName(spec.layout)));
  }
  if (config.latent.enabled &&
      (spec.layout != WeightLayout::kSeparateQkv || spec.gate != WeightSpec::Gate::kNone ||
       spec.qk_norm || spec.sinks)) {
    return absl::InvalidArgumentError(absl::StrCat(
        file.path(), ": latent_attention needs layout SEPARATE_QKV (DeepSeek's names), and no "
        "output_gate, qk_norm or sinks; got ", WeightLayoutName(spec.layout)));
  }
  Reader reader(file, spec, config.precision);
  if (!config.latent.enabled && spec.layout == WeightLayout::kSeparateQkv) {
    for (const char* role : {"kv_a_weight", "kv_b_weight", "q_a_weight"}) {
      if (absl::Status s = reader.CheckUnused(role, false, "the config has no latent_attention");
          !s.ok()) {
        return s;
      }
    }
  }
  absl::StatusOr<LayerWeights> weights = LoadProjections(reader, file, config, spec);
  if (!weights.ok()) return weights.status();
  for (const char* role : {"q_norm_weight", "k_norm_weight"}) {
    if (absl::Status s = reader.CheckUnused(role, spec.qk_norm, "the config has no qk_norm");
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = reader.CheckUnused("sinks", spec.sinks, "the config has no sinks");
      !s.ok()) {
    return s;
  }
  const bool separate_gate = spec.gate == WeightSpec::Gate::kSeparate;
  if (absl::Status s = reader.CheckUnused(
          "gate_weight", separate_gate,
          "the config has no output_gate with separate weights");
      !s.ok()) {
    return s;
  }
  if (absl::Status s = reader.CheckUnusedBias("gate_bias", separate_gate && spec.gate_bias,
                                              "output_gate.bias is");
      !s.ok()) {
    return s;
  }
  if (separate_gate) {
    const int64_t g_out = config.num_heads * config.head_dim;
    if (spec.layout == WeightLayout::kKerasDense) {
      absl::StatusOr<std::vector<float>> kernel = reader.Read(
          "gate_weight", {{config.query_dim, g_out},
                          {config.query_dim, config.num_heads, config.head_dim}});
      if (!kernel.ok()) return kernel.status();
      weights->wg = Transpose(*kernel, config.query_dim, g_out);
    } else {
      absl::StatusOr<std::vector<float>> wg =
          reader.Read("gate_weight", {{g_out, config.query_dim}});
      if (!wg.ok()) return wg.status();
      weights->wg = MakeTensor({g_out, config.query_dim}, wg->data());
    }
    if (absl::Status s = reader.ReadBias("gate_bias", spec.gate_bias,
                                         {{g_out}, {config.num_heads, config.head_dim}},
                                         &weights->bg);
        !s.ok()) {
      return s;
    }
  }
  const int64_t distance = config.relative_bias_distance;
  if (absl::Status s = reader.CheckUnused("relative_bias", distance > 0,
                                          "the config has no relative_bias_distance");
      !s.ok()) {
    return s;
  }
  if (distance > 0) {
    const Shape shape{config.num_heads, 2 * distance + 1};
    absl::StatusOr<std::vector<float>> table = reader.Read("relative_bias", {shape});
    if (!table.ok()) return table.status();
    weights->relative_bias = MakeTensor(shape, table->data());
  }
  const RelativeEmbeddings& embeddings = config.relative_embeddings;
  for (const auto& [role, used, flag, tensor] :
       {std::tuple<const char*, bool, const char*, Tensor*>{
            "relative_key", embeddings.content_to_position, "content_to_position",
            &weights->relative_key},
        {"relative_query", embeddings.position_to_content, "position_to_content",
         &weights->relative_query}}) {
    const std::string why = absl::StrCat("the config has no relative_embeddings with ", flag);
    if (absl::Status s = reader.CheckUnused(role, embeddings.distance > 0 && used, why.c_str());
        !s.ok()) {
      return s;
    }
    if (embeddings.distance > 0 && used) {
      const Shape shape{config.num_heads, config.head_dim, 2 * embeddings.distance + 1};
      absl::StatusOr<std::vector<float>> table = reader.Read(role, {shape});
      if (!table.ok()) return table.status();
      *tensor = MakeTensor(shape, table->data());
    }
  }
  if (spec.sinks) {
    absl::StatusOr<std::vector<float>> sinks = reader.Read("sinks", {{config.num_heads}});
    if (!sinks.ok()) return sinks.status();
    weights->sinks = MakeTensor({config.num_heads}, sinks->data());
  }
  if (spec.qk_norm) {
    // Shared by the heads, over the whole projection (OLMo-2), or per head
    // (Cohere's [heads, head_dim]).
    const int64_t q_width = QkNormWeightCount(config.qk_norm, config.num_heads, config.head_dim);
    const int64_t k_width =
        QkNormWeightCount(config.qk_norm, config.num_kv_heads, config.head_dim);
    const bool per_head = config.qk_norm.per_head_weights;
    absl::StatusOr<std::vector<float>> qn = reader.Read(
        "q_norm_weight",
        {{q_width}, per_head ? Shape{config.num_heads, config.head_dim} : Shape{q_width}});
    if (!qn.ok()) return qn.status();
    absl::StatusOr<std::vector<float>> kn = reader.Read(
        "k_norm_weight",
        {{k_width}, per_head ? Shape{config.num_kv_heads, config.head_dim} : Shape{k_width}});
    if (!kn.ok()) return kn.status();
    weights->q_norm = MakeTensor({q_width}, qn->data());
    weights->k_norm = MakeTensor({k_width}, kn->data());
  }
  return weights;
}

namespace {

absl::StatusOr<LayerWeights> LoadProjections(const Reader& reader, const SafetensorsFile& file,
                                             const LayerConfig& config, const WeightSpec& spec) {
  switch (spec.layout) {
    case WeightLayout::kTorchMha:
      return LoadTorchMha(reader, config, spec);
    case WeightLayout::kSeparateQkv:
      if (config.latent.enabled) return LoadLatent(reader, config, spec);
      return LoadSeparate(reader, config, spec);
    case WeightLayout::kFusedQkvPerHead:
      if (config.query_dim != config.key_dim || config.key_dim != config.value_dim ||
          config.num_kv_heads != config.num_heads) {
        return absl::InvalidArgumentError(absl::StrCat(
            file.path(), ": layout FUSED_QKV_PER_HEAD needs query_dim == key_dim == value_dim "
            "and num_kv_heads == num_heads; got ", config.query_dim, ", ", config.key_dim, ", ",
            config.value_dim, " and ", config.num_kv_heads, " vs ", config.num_heads));
      }
      return LoadFusedPerHead(reader, config, spec);
    case WeightLayout::kKerasDense:
      return LoadKeras(reader, config, spec);
  }
  return absl::InvalidArgumentError("unknown weight layout");
}

}  // namespace

}  // namespace attnserve

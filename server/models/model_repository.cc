// Model repository loading: config.pbtxt -> resolved ModelConfig -> engine
// LayerConfig + weights from weights.safetensors, one folder at a time.
#include "server/models/model_repository.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <system_error>
#include <tuple>
#include <utility>

#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "engine/attention_layer.h"
#include "engine/model/safetensors.h"
#include "engine/rope.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "server/models/model_config_codec.h"

namespace attnserve {
namespace {

namespace fs = std::filesystem;

// Far above any real attention layer, far below int64 overflow in the
// products the loader and the engine form from these dims.
constexpr int64_t kMaxDim = int64_t{1} << 20;
constexpr int64_t kMaxHeads = 4096;
constexpr int64_t kMaxProjectionWidth = int64_t{1} << 24;  // heads * head_dim

class CollectErrors : public google::protobuf::io::ErrorCollector {
 public:
  explicit CollectErrors(const std::string& path) : path_(path) {}
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    // The parser counts from 0; editors count from 1.
    errors_.push_back(absl::StrCat(path_, ":", line + 1, ":", column + 1, ": ", message));
  }
  const std::vector<std::string>& errors() const { return errors_; }

 private:
  const std::string& path_;
  std::vector<std::string> errors_;
};

absl::Status ConfigError(const std::string& path, absl::string_view field, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", field, ": ", what));
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::error_code ec(errno, std::generic_category());
    return absl::InvalidArgumentError(absl::StrCat(path, ": cannot read: ", ec.message()));
  }
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Appended to errors that say "Permission denied": in a container the files
// are often owned by the host user and the server runs as another uid, so
// the error names the uid and gid the process runs as.
std::string WithAccessHint(absl::string_view message) {
  if (!absl::StrContains(message, std::strerror(EACCES))) return std::string(message);
  return absl::StrCat(message, " (attnserve runs as uid ", getuid(), ", gid ", getgid(),
                      ": every folder of the repository must be readable and searchable by it "
                      "and every file readable, e.g. chmod -R a+rX on the host)");
}

bool OneOf(const std::string& value, std::initializer_list<const char*> allowed) {
  return std::any_of(allowed.begin(), allowed.end(),
                     [&](const char* a) { return value == a; });
}

// `message` with every "DIR/" (and DIR itself) replaced by "" / ".", so that
// paths inside the repository read relative to it.
std::string RelativeToRepository(absl::string_view message, const std::string& dir) {
  std::string root = fs::path(dir).lexically_normal().string();
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  std::string out = absl::StrReplaceAll(message, {{root + "/", ""}});
  return absl::StrReplaceAll(out, {{root, "."}});
}

bool ValidName(const std::string& name) {
  return !name.empty() && std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
  });
}

absl::Status ResolveProjectionDims(const std::string& path, v1::ModelConfig* c) {
  struct Dim {
    const char* field;
    int64_t value;
  };
  for (const Dim& d : {Dim{"embed_dim", c->embed_dim()}, Dim{"num_heads", c->num_heads()},
                       Dim{"num_kv_heads", c->num_kv_heads()}, Dim{"head_dim", c->head_dim()},
                       Dim{"query_dim", c->query_dim()}, Dim{"key_dim", c->key_dim()},
                       Dim{"value_dim", c->value_dim()}, Dim{"out_dim", c->out_dim()}}) {
    if (d.value < 0) return ConfigError(path, d.field, absl::StrCat("must be >= 0, got ", d.value));
    if (d.value > kMaxDim) {
      return ConfigError(path, d.field, absl::StrCat("must be <= ", kMaxDim, ", got ", d.value));
    }
  }
  if (c->embed_dim() == 0) return ConfigError(path, "embed_dim", "required for kind \"mha\" (> 0)");
  if (c->num_heads() == 0) return ConfigError(path, "num_heads", "required for kind \"mha\" (> 0)");
  if (c->num_heads() > kMaxHeads) {
    return ConfigError(path, "num_heads",
                       absl::StrCat("must be <= ", kMaxHeads, ", got ", c->num_heads()));
  }
  if (c->num_kv_heads() == 0) c->set_num_kv_heads(c->num_heads());
  if (c->num_heads() % c->num_kv_heads() != 0) {
    return ConfigError(path, "num_kv_heads",
                       absl::StrCat("num_heads (", c->num_heads(), ") must be a multiple of "
                                    "num_kv_heads (", c->num_kv_heads(), ")"));
  }
  if (c->head_dim() == 0) {
    if (c->embed_dim() % c->num_heads() != 0) {
      return ConfigError(path, "head_dim",
                         absl::StrCat("unset, and embed_dim (", c->embed_dim(),
                                      ") is not a multiple of num_heads (", c->num_heads(),
                                      "); set head_dim"));
    }
    c->set_head_dim(c->embed_dim() / c->num_heads());
  }
  if (c->num_heads() * c->head_dim() > kMaxProjectionWidth) {
    return ConfigError(path, "head_dim",
                       absl::StrCat("num_heads * head_dim = ", c->num_heads() * c->head_dim(),
                                    " exceeds ", kMaxProjectionWidth));
  }
  if (c->query_dim() == 0) c->set_query_dim(c->embed_dim());
  if (c->key_dim() == 0) c->set_key_dim(c->embed_dim());
  if (c->value_dim() == 0) c->set_value_dim(c->embed_dim());
  if (c->out_dim() == 0) c->set_out_dim(c->embed_dim());
  if (c->weight_layout() == v1::ModelConfig::WEIGHT_LAYOUT_UNSPECIFIED) {
    c->set_weight_layout(v1::ModelConfig::TORCH_MHA);
  }
  if (c->weight_layout() == v1::ModelConfig::FUSED_QKV_PER_HEAD &&
      (c->query_dim() != c->key_dim() || c->key_dim() != c->value_dim() ||
       c->num_kv_heads() != c->num_heads())) {
    return ConfigError(path, "weight_layout",
                       absl::StrCat("FUSED_QKV_PER_HEAD needs query_dim == key_dim == value_dim "
                                    "and num_kv_heads == num_heads; got ",
                                    c->query_dim(), ", ", c->key_dim(), ", ", c->value_dim(),
                                    " and ", c->num_kv_heads(), " vs ", c->num_heads()));
  }
  const WeightLayout layout = ToWeightLayout(c->weight_layout());
  for (const auto& [role, name] : c->tensor_names()) {
    if (DefaultTensorName(layout, role).empty()) {
      return ConfigError(path, "tensor_names",
                         absl::StrCat("key '", role, "' is not a role of layout ",
                                      WeightLayoutName(layout), "; expected one of ",
                                      absl::StrJoin(WeightRoles(layout), ", ")));
    }
    if (name.empty()) {
      return ConfigError(path, "tensor_names", absl::StrCat("key '", role, "' maps to \"\""));
    }
  }
  return absl::OkStatus();
}

// sdpa has no projections: fields that only make sense with weights would be
// silently ignored, so they are refused.
absl::Status CheckNoProjectionFields(const std::string& path, const v1::ModelConfig& c) {
  const google::protobuf::Descriptor* d = c.GetDescriptor();
  const google::protobuf::Reflection* r = c.GetReflection();
  for (const char* field : {"embed_dim", "num_heads", "num_kv_heads", "head_dim", "query_dim",
                            "key_dim", "value_dim", "out_dim", "q_bias", "k_bias", "v_bias",
                            "out_bias", "weight_layout", "tensor_prefix", "tensor_names",
                            "rope", "qk_norm", "sinks", "output_gate",
                            "temperature_tuning", "latent_attention", "clip_qkv", "v_norm",
                            "kv_source", "sparse_index_topk", "relative_bias_distance",
                            "relative_embeddings"}) {
    const google::protobuf::FieldDescriptor* f = d->FindFieldByName(field);
    bool set = f->is_repeated() ? r->FieldSize(c, f) > 0 : r->HasField(c, f);
    if (set) {
      return ConfigError(path, field,
                         "not allowed for kind \"sdpa\" (no projections, no weights); remove it "
                         "or use kind \"mha\"");
    }
  }
  return absl::OkStatus();
}

// Fills the default of output_gate.weights and checks where the gate's
// weights can come from (model_config.proto, OutputGate).
absl::Status ResolveOutputGate(const std::string& path, v1::ModelConfig* c) {
  if (!c->has_output_gate()) return absl::OkStatus();
  v1::OutputGate* gate = c->mutable_output_gate();
  if (gate->weights().empty()) gate->set_weights("separate");
  if (!OneOf(gate->weights(), {"separate", "query_per_head"})) {
    return ConfigError(path, "output_gate.weights",
                       absl::StrCat("must be \"separate\" or \"query_per_head\", got \"",
                                    gate->weights(), "\""));
  }
  if (gate->weights() == "query_per_head") {
    if (c->weight_layout() != v1::ModelConfig::SEPARATE_QKV) {
      return ConfigError(path, "output_gate.weights",
                         absl::StrCat("\"query_per_head\" (the gate inside q_proj) needs "
                                      "weight_layout SEPARATE_QKV, got ",
                                      v1::ModelConfig::WeightLayout_Name(c->weight_layout())));
    }
    if (gate->bias()) {
      return ConfigError(path, "output_gate.bias",
                         "must be unset with weights \"query_per_head\": the gate's bias is "
                         "part of q_proj's (q_bias)");
    }
  }
  return absl::OkStatus();
}

// Fills the defaults of latent_attention (model_config.proto,
// LatentAttention) and checks it against the dims; the engine checks the
// weights (ValidateLayer).
absl::Status ResolveLatentAttention(const std::string& path, v1::ModelConfig* c) {
  if (!c->has_latent_attention()) return absl::OkStatus();
  v1::LatentAttention* m = c->mutable_latent_attention();
  if (m->q_norm_eps() == 0) m->set_q_norm_eps(1e-6);
  if (m->kv_norm_eps() == 0) m->set_kv_norm_eps(1e-6);
  const std::string field = "latent_attention";
  if (c->weight_layout() != v1::ModelConfig::SEPARATE_QKV) {
    return ConfigError(path, "weight_layout",
                       absl::StrCat("latent_attention needs SEPARATE_QKV (DeepSeek's tensor "
                                    "names), got ",
                                    v1::ModelConfig::WeightLayout_Name(c->weight_layout())));
  }
  for (const auto& [name, value, min] :
       {std::tuple<const char*, int64_t, int64_t>{"q_lora_rank", m->q_lora_rank(), 0},
        {"kv_lora_rank", m->kv_lora_rank(), 1},
        {"v_head_dim", m->v_head_dim(), 1}}) {
    if (value < min) {
      return ConfigError(path, absl::StrCat(field, ".", name),
                         absl::StrCat("must be >= ", min, ", got ", value));
    }
  }
  if (m->qk_rope_head_dim() < 2 || m->qk_rope_head_dim() % 2 != 0 ||
      m->qk_rope_head_dim() >= c->head_dim()) {
    return ConfigError(path, field + ".qk_rope_head_dim",
                       absl::StrCat("must be even and in [2, head_dim ", c->head_dim(),
                                    "), the rest of head_dim being the nope features; got ",
                                    m->qk_rope_head_dim()));
  }
  for (const auto& [name, eps] : {std::pair<const char*, double>{"q_norm_eps", m->q_norm_eps()},
                                  {"kv_norm_eps", m->kv_norm_eps()}}) {
    if (!std::isfinite(eps) || eps < 0) {
      return ConfigError(path, absl::StrCat(field, ".", name),
                         absl::StrCat("must be > 0, got ", eps));
    }
  }
  if (c->num_kv_heads() != c->num_heads()) {
    return ConfigError(path, "num_kv_heads",
                       absl::StrCat("must equal num_heads (", c->num_heads(),
                                    ") with latent_attention, got ", c->num_kv_heads()));
  }
  if (c->key_dim() != c->query_dim() || c->value_dim() != c->query_dim()) {
    return ConfigError(path, "key_dim",
                       absl::StrCat("key_dim and value_dim must equal query_dim with "
                                    "latent_attention (K and V come from the query's tokens); "
                                    "got ", c->key_dim(), " and ", c->value_dim(), " with ",
                                    c->query_dim()));
  }
  if (c->v_bias()) {
    return ConfigError(path, "v_bias",
                       "must be false with latent_attention (its values come from kv_b_proj, "
                       "which has no bias)");
  }
  if (c->has_qk_norm() || c->has_output_gate() || c->sinks() || c->clip_qkv() != 0 ||
      c->has_v_norm() || !c->kv_source().empty() || c->relative_bias_distance() != 0 ||
      c->has_relative_embeddings()) {
    return ConfigError(path, field,
                       "takes no qk_norm, output_gate, sinks, clip_qkv, v_norm, kv_source, "
                       "relative_bias_distance or relative_embeddings");
  }
  if (c->rope().rotary_dim() == 0 && !c->rope().type().empty() && c->rope().type() != "none") {
    c->mutable_rope()->set_rotary_dim(m->qk_rope_head_dim());
  }
  if (c->rope().rotary_dim() != 0 && c->rope().rotary_dim() != m->qk_rope_head_dim()) {
    return ConfigError(path, "rope.rotary_dim",
                       absl::StrCat("must equal latent_attention.qk_rope_head_dim ",
                                    m->qk_rope_head_dim(), ", got ", c->rope().rotary_dim()));
  }
  return absl::OkStatus();
}

// Fills the defaults of `rope` (docs in model_config.proto) and checks it
// against the head dim, with the engine's rules (engine/rope.h).
absl::Status ResolveRope(const std::string& path, v1::ModelConfig* c) {
  v1::RotaryEmbedding* r = c->mutable_rope();
  if (r->type().empty()) r->set_type("none");
  absl::StatusOr<RopeConfig::Type> type = ParseRopeType(r->type());
  if (!type.ok()) {  // the message names rope.type
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", type.status().message()));
  }
  if (*type == RopeConfig::Type::kNone) {
    v1::RotaryEmbedding only_type;
    only_type.set_type("none");
    if (r->SerializeAsString() != only_type.SerializeAsString()) {
      return ConfigError(path, "rope", "fields are set but rope.type is \"none\": set the type");
    }
    return absl::OkStatus();
  }
  if (r->theta() == 0) r->set_theta(10000.0);
  if (r->rotary_dim() == 0) r->set_rotary_dim(c->head_dim());
  if (*type == RopeConfig::Type::kLlama3) {
    if (r->low_freq_factor() == 0) r->set_low_freq_factor(1.0);
    if (r->high_freq_factor() == 0) r->set_high_freq_factor(4.0);
  }
  if (*type == RopeConfig::Type::kYarn) {
    if (r->beta_fast() == 0) r->set_beta_fast(32.0);
    if (r->beta_slow() == 0) r->set_beta_slow(1.0);
    if (r->attention_factor() == 0 && r->factor() > 0) {
      r->set_attention_factor(r->factor() <= 1 ? 1.0 : 0.1 * std::log(r->factor()) + 1.0);
    }
  }
  if (*type == RopeConfig::Type::kLongRope && r->attention_factor() == 0 && r->factor() > 0 &&
      r->original_max_position_embeddings() > 1) {
    r->set_attention_factor(
        r->factor() <= 1 ? 1.0
                         : std::sqrt(1 + std::log(r->factor()) /
                                             std::log(static_cast<double>(
                                                 r->original_max_position_embeddings()))));
  }
  const RopeConfig rope = ToRopeConfig(*r);
  if (absl::Status s = ValidateRope(rope, c->head_dim()); !s.ok()) {
    // ValidateRope names the field as "rope.<field>: rule".
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::ModelConfig> ParseModelConfig(const std::string& text, const std::string& path) {
  v1::ModelConfig config;
  CollectErrors errors(path);
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  parser.AllowUnknownField(false);
  if (!parser.ParseFromString(text, &config)) {
    if (errors.errors().empty()) return ConfigError(path, "config", "does not parse");
    return absl::InvalidArgumentError(absl::StrJoin(errors.errors(), "; "));
  }
  return config;
}

// `warmup` entries: kv_len 0 -> q_len, dtype "" -> "fp32", sdpa heads 8 x 64;
// dims in [1, 2^20], at most 2^24 tokens (batch x the longer length), 2^28
// elements per input and 2^32 attention scores, so that a typo cannot make a
// load allocate gigabytes of zeros or compute for minutes.
static absl::Status ResolveWarmupShapes(const std::string& path, v1::ModelConfig* c) {
  constexpr int64_t kMaxWarmupDim = int64_t{1} << 20;
  constexpr int64_t kMaxWarmupTokens = int64_t{1} << 24;
  constexpr int64_t kMaxWarmupHeads = 4096;  // heads and head dims
  constexpr int64_t kMaxWarmupElements = int64_t{1} << 28;  // per input tensor
  constexpr int64_t kMaxWarmupScores = int64_t{1} << 32;    // 16x a request's default limit
  for (int i = 0; i < c->warmup_size(); ++i) {
    v1::WarmupShape* w = c->mutable_warmup(i);
    const std::string entry = absl::StrCat("warmup[", i, "]");
    if (w->kv_len() == 0) w->set_kv_len(w->q_len());
    if (w->dtype().empty()) w->set_dtype("fp32");
    for (const auto& [name, value] : {std::pair<const char*, int64_t>{"batch", w->batch()},
                                      {"q_len", w->q_len()},
                                      {"kv_len", w->kv_len()}}) {
      if (value < 1 || value > kMaxWarmupDim) {
        return ConfigError(path, absl::StrCat(entry, ".", name),
                           absl::StrCat("must be in [1, ", kMaxWarmupDim, "], got ", value));
      }
    }
    if (c->has_latent_attention() && w->kv_len() != w->q_len()) {
      return ConfigError(path, absl::StrCat(entry, ".kv_len"),
                         absl::StrCat("must equal q_len (", w->q_len(), ") on a latent "
                                      "attention layer (self-attention only), got ",
                                      w->kv_len()));
    }
    const bool sdpa = c->kind() == "sdpa";
    if (sdpa) {
      // ALiBi's slopes fix the heads: one per query head.
      if (w->num_heads() == 0) {
        w->set_num_heads(c->alibi_slopes_size() > 0 ? c->alibi_slopes_size() : 8);
      }
      if (c->alibi_slopes_size() > 0 && w->num_heads() != c->alibi_slopes_size()) {
        return ConfigError(path, absl::StrCat(entry, ".num_heads"),
                           absl::StrCat("must equal the ", c->alibi_slopes_size(),
                                        " alibi_slopes (one per query head), got ",
                                        w->num_heads()));
      }
      if (w->num_kv_heads() == 0) w->set_num_kv_heads(w->num_heads());
      if (w->head_dim() == 0) w->set_head_dim(64);
    }
    for (const auto& [name, value] : {std::pair<const char*, int64_t>{"num_heads", w->num_heads()},
                                      {"num_kv_heads", w->num_kv_heads()},
                                      {"head_dim", w->head_dim()}}) {
      if (sdpa && (value < 1 || value > kMaxWarmupHeads)) {
        return ConfigError(path, absl::StrCat(entry, ".", name),
                           absl::StrCat("must be in [1, ", kMaxWarmupHeads, "], got ", value));
      }
      if (!sdpa && value != 0) {
        return ConfigError(path, absl::StrCat(entry, ".", name),
                           "only for kind \"sdpa\" (an \"mha\" layer has its own heads)");
      }
    }
    if (sdpa && w->num_heads() % w->num_kv_heads() != 0) {
      return ConfigError(path, absl::StrCat(entry, ".num_kv_heads"),
                         absl::StrCat("must divide num_heads (", w->num_heads(), "), got ",
                                      w->num_kv_heads()));
    }
    // The widest input or output row, and the query heads.
    const int64_t row = sdpa ? w->num_heads() * w->head_dim()
                             : std::max({c->query_dim(), c->key_dim(), c->value_dim(),
                                         c->out_dim()});
    const int64_t heads = sdpa ? w->num_heads() : c->num_heads();
    if (w->batch() * std::max(w->q_len(), w->kv_len()) > kMaxWarmupTokens) {
      return ConfigError(path, entry,
                         absl::StrCat("batch x max(q_len, kv_len) must be <= ", kMaxWarmupTokens,
                                      " tokens, got ", w->batch(), " x ",
                                      std::max(w->q_len(), w->kv_len())));
    }
    // Both products fit: batch x length <= 2^24, row and heads <= 2^22.
    if (w->batch() * std::max(w->q_len(), w->kv_len()) * row > kMaxWarmupElements) {
      return ConfigError(path, entry,
                         absl::StrCat("an input of batch x max(q_len, kv_len) x ", row,
                                      " elements must be <= ", kMaxWarmupElements));
    }
    if (static_cast<double>(w->batch()) * heads * w->q_len() * w->kv_len() >
        static_cast<double>(kMaxWarmupScores)) {
      return ConfigError(path, entry,
                         absl::StrCat("batch x ", heads, " heads x q_len x kv_len attention "
                                      "scores must be <= ", kMaxWarmupScores));
    }
    if (!OneOf(w->dtype(), {"fp32", "bf16", "fp16"})) {
      return ConfigError(path, absl::StrCat(entry, ".dtype"),
                         absl::StrCat("must be \"fp32\", \"bf16\" or \"fp16\", got \"",
                                      w->dtype(), "\""));
    }
  }
  return absl::OkStatus();
}

absl::Status ResolveModelConfig(const std::string& path, const std::string& default_name,
                                v1::ModelConfig* c) {
  if (c->name().empty()) c->set_name(default_name);
  if (!ValidName(c->name())) {
    return ConfigError(path, "name",
                       absl::StrCat("\"", c->name(), "\" must be non-empty and use only letters, "
                                    "digits, '-', '_' and '.'"));
  }
  if (c->kind().empty()) c->set_kind("mha");
  if (c->kind() == "mha") {
    if (absl::Status s = ResolveProjectionDims(path, c); !s.ok()) return s;
    if (absl::Status s = ResolveLatentAttention(path, c); !s.ok()) return s;
    if (absl::Status s = ResolveRope(path, c); !s.ok()) return s;
    if (absl::Status s = ResolveOutputGate(path, c); !s.ok()) return s;
    if (c->has_temperature_tuning()) {
      const v1::TemperatureTuning& t = c->temperature_tuning();
      if (!std::isfinite(t.floor_scale()) || t.floor_scale() <= 0) {
        return ConfigError(path, "temperature_tuning.floor_scale",
                           absl::StrCat("must be > 0 (Llama 4: 8192), got ", t.floor_scale()));
      }
      if (!std::isfinite(t.attn_scale()) || t.attn_scale() == 0) {
        return ConfigError(path, "temperature_tuning.attn_scale",
                           absl::StrCat("must be finite and not 0 (Llama 4: 0.1), got ",
                                        t.attn_scale()));
      }
    }
    if (c->has_qk_norm()) {
      if (c->qk_norm().eps() == 0) c->mutable_qk_norm()->set_eps(1e-6);
      if (!std::isfinite(c->qk_norm().eps()) || c->qk_norm().eps() < 0) {
        return ConfigError(path, "qk_norm.eps",
                           absl::StrCat("must be > 0, got ", c->qk_norm().eps()));
      }
      if (c->qk_norm().per_head_weights() && c->qk_norm().whole_projection()) {
        return ConfigError(path, "qk_norm.per_head_weights",
                           "excludes qk_norm.whole_projection (one norm per head, or one over "
                           "all heads)");
      }
    }
  } else if (c->kind() == "sdpa") {
    if (absl::Status s = CheckNoProjectionFields(path, *c); !s.ok()) return s;
  } else {
    return ConfigError(path, "kind",
                       absl::StrCat("\"", c->kind(), "\" is not one of \"mha\", \"sdpa\""));
  }
  if (!std::isfinite(c->scale()) || c->scale() < 0) {
    return ConfigError(path, "scale",
                       absl::StrCat("must be finite and >= 0 (0 = 1/sqrt(head_dim)), got ",
                                    c->scale()));
  }
  if (c->precision().empty()) c->set_precision("fp32");
  if (!OneOf(c->precision(), {"fp32", "bf16", "fp16"})) {
    return ConfigError(path, "precision",
                       absl::StrCat("\"", c->precision(), "\" is not one of fp32, bf16, fp16"));
  }
  if (c->backend().empty()) c->set_backend("auto");
  if (!OneOf(c->backend(), {"auto", "cpu", "cuda", "reference"})) {
    return ConfigError(path, "backend",
                       absl::StrCat("\"", c->backend(), "\" is not one of auto, cpu, cuda, "
                                    "reference"));
  }
  if (!std::isfinite(c->clip_qkv()) || c->clip_qkv() < 0) {
    return ConfigError(path, "clip_qkv",
                       absl::StrCat("must be finite and >= 0 (0 = none), got ", c->clip_qkv()));
  }
  for (int h = 0; h < c->alibi_slopes_size(); ++h) {
    if (!std::isfinite(c->alibi_slopes(h))) {
      return ConfigError(path, absl::StrCat("alibi_slopes[", h, "]"),
                         absl::StrCat("must be finite, got ", c->alibi_slopes(h)));
    }
  }
  if (c->kind() != "sdpa" && c->alibi_slopes_size() > 0 &&
      c->alibi_slopes_size() != c->num_heads()) {
    return ConfigError(path, "alibi_slopes",
                       absl::StrCat("must hold one slope per query head (num_heads ",
                                    c->num_heads(), "), got ", c->alibi_slopes_size()));
  }
  if (c->relative_bias_distance() < 0 ||
      c->relative_bias_distance() > kMaxRelativeBiasDistance) {
    return ConfigError(path, "relative_bias_distance",
                       absl::StrCat("must be in [0, ", kMaxRelativeBiasDistance,
                                    "] (0 = none), got ", c->relative_bias_distance()));
  }
  if (c->has_relative_embeddings()) {
    const v1::RelativeEmbeddings& r = c->relative_embeddings();
    if (r.distance() < 1 || r.distance() > kMaxRelativeEmbeddingDistance) {
      return ConfigError(path, "relative_embeddings.distance",
                         absl::StrCat("must be in [1, ", kMaxRelativeEmbeddingDistance, "], got ",
                                      r.distance()));
    }
    if (!r.content_to_position() && !r.position_to_content()) {
      return ConfigError(path, "relative_embeddings",
                         "needs content_to_position, position_to_content or both");
    }
  }
  if (c->sparse_index_topk() < 0) {
    return ConfigError(path, "sparse_index_topk",
                       absl::StrCat("must be >= 0 (0 = none), got ", c->sparse_index_topk()));
  }
  if (c->has_v_norm()) {
    if (c->v_norm().eps() == 0) c->mutable_v_norm()->set_eps(1e-6);
    if (!std::isfinite(c->v_norm().eps()) || c->v_norm().eps() <= 0) {
      return ConfigError(path, "v_norm.eps",
                         absl::StrCat("must be finite and > 0, got ", c->v_norm().eps()));
    }
  }
  if (!std::isfinite(c->softcap()) || c->softcap() < 0) {
    return ConfigError(path, "softcap",
                       absl::StrCat("must be finite and >= 0 (0 = none), got ", c->softcap()));
  }
  if (c->attention_chunk() < 0 || (c->attention_chunk() > 0 && !c->causal())) {
    return ConfigError(path, "attention_chunk",
                       c->attention_chunk() < 0
                           ? absl::StrCat("must be >= 0 (0 = none), got ", c->attention_chunk())
                           : std::string("chunked attention needs causal: true (a query sees "
                                         "the keys of its own chunk up to itself)"));
  }
  if (c->sliding_window() < 0) {
    return ConfigError(path, "sliding_window",
                       absl::StrCat("must be >= 0 (0 = none), got ", c->sliding_window()));
  }
  if (c->instances() < 0) {
    return ConfigError(path, "instances", absl::StrCat("must be >= 0, got ", c->instances()));
  }
  const v1::BatchingConfig& b = c->batching();
  struct Field {
    const char* name;
    int64_t value;
  };
  for (const Field& f : {Field{"batching.max_batch_requests", b.max_batch_requests()},
                         Field{"batching.max_batch_tokens", b.max_batch_tokens()},
                         Field{"batching.max_queue_delay_us", b.max_queue_delay_us()},
                         Field{"batching.max_queue_size", b.max_queue_size()}}) {
    if (f.value < 0) return ConfigError(path, f.name, absl::StrCat("must be >= 0, got ", f.value));
  }
  return ResolveWarmupShapes(path, c);
}

RepositoryModel LoadModelFolder(const std::string& directory) {
  RepositoryModel model;
  model.directory = directory;
  const std::string folder = fs::path(directory).filename().string();
  model.name = folder;
  const std::string config_path = (fs::path(directory) / kModelConfigFile).string();
  absl::StatusOr<std::string> text = ReadFile(config_path);
  if (!text.ok()) {
    model.status = text.status();
    return model;
  }
  absl::StatusOr<v1::ModelConfig> config = ParseModelConfig(*text, config_path);
  if (!config.ok()) {
    model.status = config.status();
    return model;
  }
  model.config = *std::move(config);
  model.status = ResolveModelConfig(config_path, folder, &model.config);
  if (!model.config.name().empty()) model.name = model.config.name();
  if (!model.status.ok()) return model;

  auto layer = std::make_shared<AttentionLayer>();
  layer->config = ToLayerConfig(model.config);
  if (layer->config.has_projections) {
    const std::string weights_path = (fs::path(directory) / kModelWeightsFile).string();
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(weights_path);
    if (!file.ok()) {
      model.status = absl::InvalidArgumentError(file.status().message());
      return model;
    }
    absl::StatusOr<LayerWeights> weights =
        LoadLayerWeights(**file, layer->config, ToWeightSpec(model.config));
    if (!weights.ok()) {
      model.status = weights.status();
      return model;
    }
    layer->weights = *std::move(weights);
  }
  if (absl::Status valid = ValidateLayer(*layer); !valid.ok()) {
    model.status = absl::InvalidArgumentError(absl::StrCat(directory, ": ", valid.message()));
    return model;
  }
  model.layer = std::move(layer);
  return model;
}

absl::StatusOr<std::vector<std::string>> ListModelFolders(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--model-repository ", dir, ": not a directory",
                     ec ? absl::StrCat(" (", ec.message(), ")") : ""));
  }
  std::vector<std::string> folders;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    std::error_code type_ec;
    if (name.empty() || name[0] == '.' || !it->is_directory(type_ec)) continue;
    folders.push_back(it->path().string());
  }
  if (ec) {
    return absl::InvalidArgumentError(WithAccessHint(
        absl::StrCat("--model-repository ", dir, ": cannot list: ", ec.message())));
  }
  std::sort(folders.begin(), folders.end());
  return folders;
}

std::string ModelNameOfFolder(const std::string& directory) {
  const std::string folder = fs::path(directory).filename().string();
  const std::string config_path = (fs::path(directory) / kModelConfigFile).string();
  absl::StatusOr<std::string> text = ReadFile(config_path);
  if (!text.ok()) return folder;
  absl::StatusOr<v1::ModelConfig> config = ParseModelConfig(*text, config_path);
  if (!config.ok() || config->name().empty()) return folder;
  return config->name();
}

absl::StatusOr<std::vector<RepositoryModel>> LoadModelRepository(const std::string& dir) {
  absl::StatusOr<std::vector<std::string>> folders = ListModelFolders(dir);
  if (!folders.ok()) return folders.status();
  std::vector<RepositoryModel> models;
  std::map<std::string, std::string> folder_of;  // model name -> folder
  for (const std::string& folder : *folders) {
    RepositoryModel model = LoadModelFolder(folder);
    if (!model.status.ok()) {
      model.status = absl::Status(model.status.code(), WithAccessHint(model.status.message()));
    }
    auto [it, inserted] = folder_of.emplace(model.name, folder);
    if (!inserted && model.status.ok()) {
      model.status = absl::InvalidArgumentError(
          absl::StrCat(folder, ": model name '", model.name, "' is already used by ", it->second));
      model.layer.reset();
    }
    models.push_back(std::move(model));
  }
  return models;
}

BackendEngines::BackendEngines(std::shared_ptr<AttentionEngine> default_engine,
                               EngineOptions engine_options)
    : engine_options_(std::move(engine_options)) {
  engines_["auto"] = default_engine;
  if (default_engine != nullptr) engines_[std::string(default_engine->name())] = default_engine;
}

absl::StatusOr<std::shared_ptr<AttentionEngine>> BackendEngines::For(const std::string& backend) {
  absl::MutexLock lock(&mu_);
  auto it = engines_.find(backend);
  if (it != engines_.end()) return it->second;
  absl::StatusOr<std::unique_ptr<AttentionEngine>> engine = CreateEngine(backend, engine_options_);
  if (!engine.ok()) return engine.status();
  return engines_.emplace(backend, std::shared_ptr<AttentionEngine>(*std::move(engine)))
      .first->second;
}

std::shared_ptr<ServedModel> MakeRepositoryServedModel(const RepositoryModel& m,
                                                       const std::string& dir,
                                                       BackendEngines* engines,
                                                       std::string* failure) {
  auto model = std::make_shared<ServedModel>();
  model->name = m.name;
  model->batching = ToModelBatching(m.config);
  auto config = std::make_shared<v1::ModelConfig>(m.config);
  if (config->name().empty()) config->set_name(m.name);
  model->config = std::move(config);
  absl::Status status = m.status;
  if (status.ok()) {
    const std::string& backend = m.config.backend();
    absl::StatusOr<std::shared_ptr<AttentionEngine>> engine = engines->For(backend);
    if (engine.ok()) {
      model->engine = *std::move(engine);
    } else {
      status = absl::InvalidArgumentError(absl::StrCat(
          m.directory, ": backend \"", backend, "\" is unavailable: ", engine.status().message()));
    }
  }
  if (status.ok()) {
    model->layer = m.layer;
    model->weight_bounds = MeasureWeightBounds(m.layer->weights);
    model->state = ModelState::kReady;
  } else {
    model->state = ModelState::kFailed;
    model->engine.reset();
    // Callers see the reason (GetModel, ListModels, Attend errors): name
    // files relative to the repository, not by the server's own paths.
    // The operator's log line keeps the full paths (`failure`).
    model->reason = RelativeToRepository(status.message(), dir);
    if (failure != nullptr) *failure = std::string(status.message());
  }
  return model;
}

absl::Status AddRepositoryModels(const std::string& dir, bool strict, BackendEngines* engines,
                                 ModelRegistry* registry) {
  absl::StatusOr<std::vector<RepositoryModel>> models = LoadModelRepository(dir);
  if (!models.ok()) return models.status();

  std::vector<std::shared_ptr<ServedModel>> served;
  std::vector<std::string> failures;
  for (RepositoryModel& m : *models) {
    if (m.status.ok() && registry->Find(m.name).ok()) {
      m.status = absl::AlreadyExistsError(absl::StrCat(
          m.directory, ": model name '", m.name, "' is already taken (a built-in model)"));
    }
    std::string failure;
    served.push_back(MakeRepositoryServedModel(m, dir, engines, &failure));
    if (!failure.empty()) failures.push_back(absl::StrCat("model '", m.name, "': ", failure));
  }

  if (strict && !failures.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model repository ", dir, ": ", failures.size(), " model(s) failed to load "
        "(--strict-model-loading=false serves the others):\n  ",
        absl::StrJoin(failures, "\n  ")));
  }
  for (const std::string& failure : failures) {
    std::fprintf(stderr, "attnserve: model repository %s: %s (not ready)\n", dir.c_str(),
                 failure.c_str());
  }
  for (std::shared_ptr<ServedModel>& model : served) {
    if (absl::Status s = registry->Add(model); !s.ok()) {
      // A clash with a built-in is already FAILED above; anything else here
      // is a bug worth surfacing.
      if (strict || model->ready()) return s;
      std::fprintf(stderr, "attnserve: model repository %s: %s\n", dir.c_str(),
                   std::string(s.message()).c_str());
    }
  }
  return absl::OkStatus();
}

}  // namespace attnserve

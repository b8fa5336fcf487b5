// config.pbtxt parsing and defaults, and repository folders loaded into the
// registry (strict and not), without a server process.
#include "server/models/model_repository.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/models/model_config_codec.h"

namespace attnserve {
namespace {

namespace fs = std::filesystem;

// The engines of one AddRepositoryModels call, kept for the test's life.
BackendEngines* Engines(std::shared_ptr<AttentionEngine> default_engine) {
  static std::vector<std::unique_ptr<BackendEngines>>* kept =
      new std::vector<std::unique_ptr<BackendEngines>>;
  kept->push_back(std::make_unique<BackendEngines>(std::move(default_engine), EngineOptions{}));
  return kept->back().get();
}
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

v1::ModelConfig Resolved(const std::string& text) {
  absl::StatusOr<v1::ModelConfig> c = ParseModelConfig(text, "m/config.pbtxt");
  EXPECT_TRUE(c.ok()) << c.status();
  absl::Status s = ResolveModelConfig("m/config.pbtxt", "folder", &*c);
  EXPECT_TRUE(s.ok()) << s;
  return *c;
}

absl::Status ResolveError(const std::string& text) {
  absl::StatusOr<v1::ModelConfig> c = ParseModelConfig(text, "m/config.pbtxt");
  if (!c.ok()) return c.status();
  absl::Status s = ResolveModelConfig("m/config.pbtxt", "folder", &*c);
  EXPECT_FALSE(s.ok()) << "resolved a bad config: " << text;
  return s;
}

TEST(ModelConfigTest, DefaultsFollowEmbedDimAndHeads) {
  v1::ModelConfig c = Resolved("embed_dim: 64 num_heads: 8");
  EXPECT_EQ(c.name(), "folder");
  EXPECT_EQ(c.kind(), "mha");
  EXPECT_EQ(c.num_kv_heads(), 8);
  EXPECT_EQ(c.head_dim(), 8);
  EXPECT_EQ(c.query_dim(), 64);
  EXPECT_EQ(c.key_dim(), 64);
  EXPECT_EQ(c.value_dim(), 64);
  EXPECT_EQ(c.out_dim(), 64);
  EXPECT_EQ(c.weight_layout(), v1::ModelConfig::TORCH_MHA);
  EXPECT_EQ(c.precision(), "fp32");
  EXPECT_EQ(c.backend(), "auto");

  LayerConfig layer = ToLayerConfig(c);
  EXPECT_TRUE(layer.has_projections);
  EXPECT_EQ(layer.head_dim, 8);
  EXPECT_EQ(layer.precision, Precision::kFloat32);
}

TEST(ModelConfigTest, ExplicitValuesAreKept) {
  v1::ModelConfig c = Resolved(R"(
      name: "llama-3" embed_dim: 40 num_heads: 4 num_kv_heads: 2 head_dim: 16
      query_dim: 40 key_dim: 12 value_dim: 20 out_dim: 7 q_bias: true
      weight_layout: SEPARATE_QKV tensor_prefix: "model.layers.3.self_attn."
      tensor_names { key: "out_weight" value: "dense.weight" }
      scale: 0.125 causal: true precision: "bf16" backend: "reference" instances: 2
      batching { max_batch_requests: 8 max_queue_delay_us: 500 })");
  EXPECT_EQ(c.name(), "llama-3");
  EXPECT_EQ(c.head_dim(), 16);
  EXPECT_EQ(c.key_dim(), 12);
  EXPECT_EQ(c.out_dim(), 7);
  EXPECT_EQ(c.batching().max_batch_requests(), 8);
  LayerConfig layer = ToLayerConfig(c);
  EXPECT_EQ(layer.precision, Precision::kBFloat16);
  EXPECT_FLOAT_EQ(layer.scale, 0.125f);
  EXPECT_TRUE(layer.causal);
  WeightSpec spec = ToWeightSpec(c);
  EXPECT_EQ(spec.layout, WeightLayout::kSeparateQkv);
  EXPECT_EQ(spec.tensor_prefix, "model.layers.3.self_attn.");
  EXPECT_EQ(spec.tensor_names.at("out_weight"), "dense.weight");
  EXPECT_TRUE(spec.q_bias);
  EXPECT_FALSE(spec.k_bias);
}

TEST(ModelConfigTest, UnknownFieldNamesFileLineAndField) {
  absl::StatusOr<v1::ModelConfig> c =
      ParseModelConfig("embed_dim: 8\nnum_heads: 2\nnum_layers: 3\n", "repo/m/config.pbtxt");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(c.status().message(),
              AllOf(HasSubstr("repo/m/config.pbtxt:3:"), HasSubstr("num_layers")));
}

TEST(ModelConfigTest, BadEnumAndSyntaxAreReported) {
  absl::StatusOr<v1::ModelConfig> c =
      ParseModelConfig("weight_layout: PYTORCH\n", "repo/m/config.pbtxt");
  ASSERT_FALSE(c.ok());
  EXPECT_THAT(std::string(c.status().message()),
              AllOf(HasSubstr("repo/m/config.pbtxt:"), HasSubstr("PYTORCH"),
                    HasSubstr("weight_layout")));
  c = ParseModelConfig("embed_dim: \"eight\"\n", "repo/m/config.pbtxt");
  ASSERT_FALSE(c.ok());
  // Protobuf names the line and column and what it expected there.
  EXPECT_THAT(std::string(c.status().message()),
              AllOf(HasSubstr("repo/m/config.pbtxt:1:"), HasSubstr("Expected integer")));
}

TEST(ModelConfigTest, EachRuleHasItsMessage) {
  struct Case {
    const char* text;
    std::vector<const char*> words;
  };
  const Case cases[] = {
      {"num_heads: 2", {"embed_dim", "required"}},
      {"embed_dim: 8", {"num_heads", "required"}},
      {"embed_dim: -8 num_heads: 2", {"embed_dim", ">= 0", "-8"}},
      {"embed_dim: 8 num_heads: 4 num_kv_heads: 3", {"num_kv_heads", "multiple", "(4)", "(3)"}},
      {"embed_dim: 10 num_heads: 3", {"head_dim", "not a multiple", "set head_dim"}},
      {"embed_dim: 8 num_heads: 2 kind: \"flash\"", {"kind", "\"flash\""}},
      {"embed_dim: 8 num_heads: 2 precision: \"fp8\"", {"precision", "fp8", "fp32, bf16, fp16"}},
      {"embed_dim: 8 num_heads: 2 backend: \"tpu\"", {"backend", "tpu"}},
      {"embed_dim: 8 num_heads: 2 scale: -1", {"scale", ">= 0"}},
      {"embed_dim: 8 num_heads: 2 scale: inf", {"scale", "finite"}},
      {"embed_dim: 8 num_heads: 2 instances: -1", {"instances"}},
      {"embed_dim: 8 num_heads: 2 sliding_window: -4", {"sliding_window", ">= 0", "-4"}},
      {"embed_dim: 8 num_heads: 2 softcap: -1", {"softcap", ">= 0"}},
      {"embed_dim: 8 num_heads: 2 softcap: nan", {"softcap", "finite"}},
      {"embed_dim: 8 num_heads: 2 batching { max_queue_size: -1 }", {"batching.max_queue_size"}},
      {"embed_dim: 8 num_heads: 2 name: \"a b\"", {"name", "\"a b\""}},
      {"embed_dim: 4194304 num_heads: 2", {"embed_dim", "<="}},
      {"embed_dim: 8 num_heads: 2 key_dim: 4 weight_layout: FUSED_QKV_PER_HEAD",
       {"FUSED_QKV_PER_HEAD", "query_dim == key_dim"}},
      {"embed_dim: 8 num_heads: 2 tensor_names { key: \"qkv_weight\" value: \"x\" }",
       {"tensor_names", "'qkv_weight'", "TORCH_MHA", "in_proj_weight"}},
      {"kind: \"sdpa\" embed_dim: 8", {"embed_dim", "not allowed for kind \"sdpa\""}},
      {"embed_dim: 8 num_heads: 2 warmup { q_len: 16 }", {"warmup[0].batch", "[1, 1048576]", "0"}},
      {"embed_dim: 8 num_heads: 2 warmup { batch: 1 q_len: 16 } warmup { batch: 1 q_len: -3 }",
       {"warmup[1].q_len", "-3"}},
      {"embed_dim: 8 num_heads: 2 warmup { batch: 1 q_len: 1 kv_len: 2000000 }",
       {"warmup[0].kv_len", "2000000"}},
      {"embed_dim: 8 num_heads: 2 warmup { batch: 64 q_len: 1048576 }",
       {"warmup[0]", "batch x max(q_len, kv_len)", "16777216", "64 x 1048576"}},
      {"embed_dim: 8 num_heads: 2 warmup { batch: 1 q_len: 1 dtype: \"int8\" }",
       {"warmup[0].dtype", "\"int8\""}},
      {"embed_dim: 8 num_heads: 2 warmup { batch: 1 q_len: 1 num_heads: 4 }",
       {"warmup[0].num_heads", "only for kind \"sdpa\""}},
      {"kind: \"sdpa\" warmup { batch: 1 q_len: 1 num_heads: 6 num_kv_heads: 4 }",
       {"warmup[0].num_kv_heads", "divide num_heads (6)", "4"}},
      {"kind: \"sdpa\" warmup { batch: 1 q_len: 1 head_dim: 5000 }",
       {"warmup[0].head_dim", "[1, 4096]", "5000"}},
      {"kind: \"sdpa\" warmup { batch: 64 q_len: 1024 num_heads: 64 head_dim: 128 }",
       {"warmup[0]", "x 8192 elements", "<= 268435456"}},
      {"embed_dim: 4096 num_heads: 32 warmup { batch: 16 q_len: 8192 }",
       {"warmup[0]", "x 4096 elements", "<= 268435456"}},
      {"kind: \"sdpa\" warmup { batch: 1 q_len: 65536 num_heads: 2 head_dim: 8 }",
       {"warmup[0]", "2 heads", "attention scores", "<= 4294967296"}},
      {"embed_dim: 64 num_heads: 8 warmup { batch: 2 q_len: 32768 }",
       {"warmup[0]", "8 heads", "attention scores"}},
  };
  for (const Case& c : cases) {
    absl::Status s = ResolveError(c.text);
    EXPECT_THAT(s.message(), HasSubstr("m/config.pbtxt")) << c.text;
    for (const char* w : c.words) EXPECT_THAT(s.message(), HasSubstr(w)) << c.text;
  }
}

TEST(ModelConfigTest, WarmupShapesResolveTheirDefaults) {
  const v1::ModelConfig c = Resolved(
      "embed_dim: 8 num_heads: 2 "
      "warmup { batch: 4 q_len: 128 } "
      "warmup { batch: 1 q_len: 1 kv_len: 4096 dtype: \"bf16\" causal: true }");
  ASSERT_EQ(c.warmup_size(), 2);
  EXPECT_EQ(c.warmup(0).kv_len(), 128) << "kv_len 0 = q_len";
  EXPECT_EQ(c.warmup(0).dtype(), "fp32");
  EXPECT_FALSE(c.warmup(0).causal());
  EXPECT_EQ(c.warmup(1).kv_len(), 4096);
  EXPECT_EQ(c.warmup(1).dtype(), "bf16");
  EXPECT_TRUE(c.warmup(1).causal());
  EXPECT_EQ(c.warmup(0).num_heads(), 0) << "an mha layer's heads are its own";

  const v1::ModelConfig sdpa = Resolved(
      "kind: \"sdpa\" warmup { batch: 1 q_len: 8 } "
      "warmup { batch: 1 q_len: 8 num_heads: 32 num_kv_heads: 8 head_dim: 128 }");
  EXPECT_EQ(sdpa.warmup(0).num_heads(), 8);
  EXPECT_EQ(sdpa.warmup(0).num_kv_heads(), 8);
  EXPECT_EQ(sdpa.warmup(0).head_dim(), 64);
  EXPECT_EQ(sdpa.warmup(1).num_heads(), 32);
  EXPECT_EQ(sdpa.warmup(1).num_kv_heads(), 8);
  EXPECT_EQ(sdpa.warmup(1).head_dim(), 128);
}

TEST(ModelConfigTest, RopeDefaultsResolveAndReachTheLayer) {
  v1::ModelConfig c = Resolved("embed_dim: 64 num_heads: 4 rope { type: \"default\" }");
  EXPECT_EQ(c.rope().theta(), 10000.0);
  EXPECT_EQ(c.rope().rotary_dim(), 16);  // head_dim
  LayerConfig layer = ToLayerConfig(c);
  EXPECT_EQ(layer.rope.type, RopeConfig::Type::kDefault);
  EXPECT_EQ(layer.rope.rotary_dim, 16);

  c = Resolved("embed_dim: 64 num_heads: 4 rope { type: \"yarn\" factor: 4 "
               "original_max_position_embeddings: 4096 }");
  EXPECT_EQ(c.rope().beta_fast(), 32.0);
  EXPECT_EQ(c.rope().beta_slow(), 1.0);
  EXPECT_DOUBLE_EQ(c.rope().attention_factor(), 0.1 * std::log(4.0) + 1.0);
  EXPECT_TRUE(ToLayerConfig(c).rope.truncate);

  c = Resolved("embed_dim: 64 num_heads: 4 rope { type: \"llama3\" factor: 8 "
               "original_max_position_embeddings: 8192 rotary_dim: 8 }");
  EXPECT_EQ(c.rope().low_freq_factor(), 1.0);
  EXPECT_EQ(c.rope().high_freq_factor(), 4.0);
  EXPECT_EQ(c.rope().rotary_dim(), 8);  // partial rotary kept

  // LongRoPE (Phi-3.5): head_dim 16 -> 8 factors per set; the attention
  // factor from the paper's formula; every factor reaches the layer.
  c = Resolved("embed_dim: 64 num_heads: 4 rope { type: \"longrope\" factor: 32 "
               "original_max_position_embeddings: 4096 "
               "short_factor: [1, 1, 1, 1, 1.5, 2, 2, 3] "
               "long_factor: [1, 2, 3, 4, 5, 6, 7, 8.5] }");
  EXPECT_DOUBLE_EQ(c.rope().attention_factor(),
                   std::sqrt(1 + std::log(32.0) / std::log(4096.0)));
  LayerConfig phi = ToLayerConfig(c);
  EXPECT_EQ(phi.rope.type, RopeConfig::Type::kLongRope);
  EXPECT_EQ(phi.rope.short_factor,
            (std::vector<double>{1, 1, 1, 1, 1.5, 2, 2, 3}));
  EXPECT_EQ(phi.rope.long_factor, (std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8.5}));
  EXPECT_EQ(FromRopeConfig(phi.rope).long_factor_size(), 8);  // GetModel reports them
  c = Resolved("embed_dim: 64 num_heads: 4 rope { type: \"longrope\" factor: 1 "
               "original_max_position_embeddings: 4096 rotary_dim: 4 "
               "short_factor: [1, 1] long_factor: [2, 2] }");
  EXPECT_EQ(c.rope().attention_factor(), 1.0);  // no extension, no scaling

  c = Resolved("embed_dim: 64 num_heads: 4");  // no rope: "none", nothing else
  EXPECT_EQ(c.rope().type(), "none");
  EXPECT_EQ(ToLayerConfig(c).rope.type, RopeConfig::Type::kNone);
}

TEST(ModelConfigTest, RopeRulesNameTheField) {
  struct Case {
    const char* text;
    std::vector<const char*> words;
  };
  const Case cases[] = {
      {"rope { type: \"dynamic\" factor: 2 }", {"rope.type", "\"dynamic\"", "yarn"}},
      {"rope { type: \"longrope\" factor: 4 original_max_position_embeddings: 64 }",
       {"rope.short_factor", "rotary_dim / 2 = 8", "got 0"}},
      {"rope { type: \"longrope\" factor: 4 original_max_position_embeddings: 64 "
       "short_factor: [1, 1, 1, 1, 1, 1, 1, 1] long_factor: [1, 1, 1, 1, 1, 1, 1] }",
       {"rope.long_factor", "8 values, got 7"}},
      {"rope { type: \"longrope\" factor: 4 original_max_position_embeddings: 64 "
       "short_factor: [1, 1, 1, 1, 1, 1, 1, 1] long_factor: [1, 1, 1, 0, 1, 1, 1, 1] }",
       {"rope.long_factor", "> 0", "index 3"}},
      {"rope { type: \"longrope\" factor: 4 short_factor: [1, 1, 1, 1, 1, 1, 1, 1] "
       "long_factor: [1, 1, 1, 1, 1, 1, 1, 1] }",
       {"rope.original_max_position_embeddings", "longrope"}},
      {"rope { type: \"yarn\" factor: 4 original_max_position_embeddings: 64 "
       "long_factor: [1, 1, 1, 1, 1, 1, 1, 1] }",
       {"rope.long_factor", "longrope only", "yarn"}},
      {"rope { type: \"default\" rotary_dim: 7 }", {"rope.rotary_dim", "even", "7"}},
      {"rope { type: \"default\" rotary_dim: 32 }", {"rope.rotary_dim", "head_dim 16", "32"}},
      {"rope { type: \"default\" theta: -1 }", {"rope.theta", "> 0"}},
      {"rope { type: \"linear\" }", {"rope.factor", "linear"}},
      {"rope { type: \"llama3\" factor: 8 }", {"rope.original_max_position_embeddings"}},
      {"rope { type: \"llama3\" factor: 8 original_max_position_embeddings: 10 "
       "low_freq_factor: 4 high_freq_factor: 2 }",
       {"rope.high_freq_factor", "low_freq_factor"}},
      {"rope { type: \"yarn\" factor: 4 }", {"rope.original_max_position_embeddings", "yarn"}},
      {"rope { theta: 500000 }", {"rope", "\"none\""}},
  };
  for (const Case& c : cases) {
    absl::Status s = ResolveError(absl::StrCat("embed_dim: 64 num_heads: 4 ", c.text));
    EXPECT_THAT(s.message(), HasSubstr("m/config.pbtxt")) << c.text;
    for (const char* w : c.words) EXPECT_THAT(s.message(), HasSubstr(w)) << c.text;
  }
  absl::Status eps = ResolveError("embed_dim: 64 num_heads: 4 qk_norm { eps: -1 }");
  EXPECT_THAT(eps.message(), AllOf(HasSubstr("qk_norm.eps"), HasSubstr("> 0")));
  v1::ModelConfig norm = Resolved("embed_dim: 64 num_heads: 4 qk_norm { }");
  EXPECT_EQ(norm.qk_norm().eps(), 1e-6);  // present, defaults filled
  EXPECT_TRUE(ToLayerConfig(norm).qk_norm.enabled);
  EXPECT_TRUE(ToWeightSpec(norm).qk_norm);
  EXPECT_FALSE(ToLayerConfig(norm).qk_norm.whole_projection);
  v1::ModelConfig olmo = Resolved("embed_dim: 64 num_heads: 4 qk_norm { whole_projection: true }");
  EXPECT_TRUE(ToLayerConfig(olmo).qk_norm.whole_projection);
  AttentionLayer olmo_layer;
  olmo_layer.config = ToLayerConfig(olmo);
  EXPECT_TRUE(LayerToModelConfig(olmo_layer).qk_norm().whole_projection());  // reported
  EXPECT_FALSE(olmo_layer.config.qk_norm.after_rope);
  v1::ModelConfig hunyuan = Resolved("embed_dim: 64 num_heads: 4 qk_norm { after_rope: true }");
  AttentionLayer hunyuan_layer;
  hunyuan_layer.config = ToLayerConfig(hunyuan);
  EXPECT_TRUE(hunyuan_layer.config.qk_norm.after_rope);
  EXPECT_TRUE(LayerToModelConfig(hunyuan_layer).qk_norm().after_rope());
  EXPECT_FALSE(ToLayerConfig(Resolved("embed_dim: 64 num_heads: 4")).qk_norm.enabled);
  absl::Status sdpa_sinks = ResolveError("kind: \"sdpa\" sinks: true");
  EXPECT_THAT(sdpa_sinks.message(), HasSubstr("sinks"));
  absl::Status sdpa = ResolveError("kind: \"sdpa\" rope { type: \"default\" }");
  EXPECT_THAT(sdpa.message(), HasSubstr("rope"));
  EXPECT_THAT(sdpa.message(), HasSubstr("not allowed for kind \"sdpa\""));
}

// output_gate: "separate" by default, reaching the layer and the weight
// spec; "query_per_head" only with SEPARATE_QKV and with its bias in q_proj's;
// each rule names its field.
TEST(ModelConfigTest, OutputGateResolvesAndItsRulesNameTheField) {
  v1::ModelConfig afmoe = Resolved("embed_dim: 64 num_heads: 4 output_gate { bias: true }");
  EXPECT_EQ(afmoe.output_gate().weights(), "separate");  // the default, reported
  EXPECT_TRUE(ToLayerConfig(afmoe).output_gate);
  EXPECT_EQ(ToWeightSpec(afmoe).gate, WeightSpec::Gate::kSeparate);
  EXPECT_TRUE(ToWeightSpec(afmoe).gate_bias);
  v1::ModelConfig qwen = Resolved(
      "embed_dim: 64 num_heads: 4 weight_layout: SEPARATE_QKV "
      "output_gate { weights: \"query_per_head\" }");
  EXPECT_EQ(ToWeightSpec(qwen).gate, WeightSpec::Gate::kQueryPerHead);
  EXPECT_TRUE(ToLayerConfig(qwen).output_gate);
  v1::ModelConfig plain = Resolved("embed_dim: 64 num_heads: 4");
  EXPECT_FALSE(ToLayerConfig(plain).output_gate);
  EXPECT_EQ(ToWeightSpec(plain).gate, WeightSpec::Gate::kNone);
  EXPECT_FALSE(LayerToModelConfig(AttentionLayer{ToLayerConfig(plain), {}, {}})
                   .has_output_gate());
  AttentionLayer gated;
  gated.config = ToLayerConfig(qwen);
  gated.weights.bg = Tensor(DType::kFloat32, {64});
  const v1::ModelConfig reported = LayerToModelConfig(gated);
  EXPECT_EQ(reported.output_gate().weights(), "separate");  // as the layer holds it
  EXPECT_TRUE(reported.output_gate().bias());

  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 output_gate { weights: \"fused\" }")
                  .message(),
              AllOf(HasSubstr("output_gate.weights"), HasSubstr("query_per_head")));
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 "
                           "output_gate { weights: \"query_per_head\" }")
                  .message(),
              AllOf(HasSubstr("output_gate.weights"), HasSubstr("SEPARATE_QKV"),
                    HasSubstr("TORCH_MHA")));
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 weight_layout: SEPARATE_QKV "
                           "output_gate { weights: \"query_per_head\" bias: true }")
                  .message(),
              AllOf(HasSubstr("output_gate.bias"), HasSubstr("q_bias")));
  EXPECT_THAT(ResolveError("kind: \"sdpa\" output_gate { }").message(),
              AllOf(HasSubstr("output_gate"), HasSubstr("not allowed for kind \"sdpa\"")));
}

// latent_attention (DeepSeek): defaults filled and reported, RoPE's
// rotary_dim defaulting to the rotating features, the values' head dim
// reaching the layer, and each rule naming its field.
TEST(ModelConfigTest, LatentAttentionResolvesAndItsRulesNameTheField) {
  const std::string base =
      "embed_dim: 64 num_heads: 4 head_dim: 24 weight_layout: SEPARATE_QKV causal: true ";
  v1::ModelConfig v3 = Resolved(
      base + "rope { type: \"default\" interleaved: true } "
             "latent_attention { q_lora_rank: 16 kv_lora_rank: 32 qk_rope_head_dim: 8 "
             "v_head_dim: 12 }");
  EXPECT_EQ(v3.latent_attention().q_norm_eps(), 1e-6);
  EXPECT_EQ(v3.latent_attention().kv_norm_eps(), 1e-6);
  EXPECT_EQ(v3.rope().rotary_dim(), 8);
  const LayerConfig layer = ToLayerConfig(v3);
  EXPECT_TRUE(layer.latent.enabled);
  EXPECT_EQ(layer.latent.q_lora_rank, 16);
  EXPECT_EQ(layer.latent.rope_dim, 8);
  EXPECT_EQ(ValueHeadDim(layer), 12);
  EXPECT_EQ(layer.num_kv_heads, 4);
  AttentionLayer loaded;
  loaded.config = layer;
  const v1::ModelConfig reported = LayerToModelConfig(loaded);
  EXPECT_EQ(reported.latent_attention().kv_lora_rank(), 32);
  EXPECT_EQ(reported.latent_attention().v_head_dim(), 12);
  EXPECT_FALSE(LayerToModelConfig(AttentionLayer{ToLayerConfig(Resolved("embed_dim: 64 "
                                                                        "num_heads: 4")),
                                                 {}, {}})
                   .has_latent_attention());

  const std::string latent =
      "latent_attention { kv_lora_rank: 32 qk_rope_head_dim: 8 v_head_dim: 12 }";
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 head_dim: 24 " + latent).message(),
              AllOf(HasSubstr("weight_layout"), HasSubstr("SEPARATE_QKV")));
  EXPECT_THAT(ResolveError(base + "num_kv_heads: 2 " + latent).message(),
              AllOf(HasSubstr("num_kv_heads"), HasSubstr("num_heads")));
  EXPECT_THAT(ResolveError(base + "rope { type: \"default\" rotary_dim: 4 } " + latent)
                  .message(),
              AllOf(HasSubstr("rope.rotary_dim"), HasSubstr("qk_rope_head_dim")));
  EXPECT_THAT(ResolveError(base + "latent_attention { kv_lora_rank: 32 qk_rope_head_dim: 24 "
                                  "v_head_dim: 12 }")
                  .message(),
              HasSubstr("latent_attention.qk_rope_head_dim"));
  EXPECT_THAT(ResolveError(base + "latent_attention { qk_rope_head_dim: 8 v_head_dim: 12 }")
                  .message(),
              HasSubstr("latent_attention.kv_lora_rank"));
  EXPECT_THAT(ResolveError(base + "v_bias: true " + latent).message(), HasSubstr("v_bias"));
  EXPECT_THAT(ResolveError(base + "qk_norm { } " + latent).message(),
              AllOf(HasSubstr("latent_attention"), HasSubstr("qk_norm")));
  EXPECT_THAT(ResolveError(base + latent + " warmup { batch: 1 q_len: 4 kv_len: 8 }").message(),
              HasSubstr("warmup[0].kv_len"));
  EXPECT_THAT(ResolveError("kind: \"sdpa\" " + latent).message(),
              AllOf(HasSubstr("latent_attention"), HasSubstr("not allowed for kind \"sdpa\"")));
}

// Temperature tuning by position (Ministral 3, and Mistral 4's on latent
// attention) reaches the layer and comes back.
TEST(ModelConfigTest, TemperatureByPositionResolves) {
  v1::ModelConfig ministral = Resolved(
      "embed_dim: 64 num_heads: 4 rope { type: \"default\" } temperature_tuning { "
      "floor_scale: 16384 attn_scale: 0.1 by_position: true }");
  const LayerConfig layer = ToLayerConfig(ministral);
  EXPECT_TRUE(layer.temperature_tuning.by_position);
  EXPECT_EQ(layer.temperature_tuning.floor_scale, 16384.0);
  EXPECT_TRUE(
      LayerToModelConfig(AttentionLayer{layer, {}, {}}).temperature_tuning().by_position());
  // Mistral 4: the same on latent attention.
  const LayerConfig mistral4 = ToLayerConfig(Resolved(
      "embed_dim: 64 num_heads: 4 head_dim: 24 weight_layout: SEPARATE_QKV causal: true "
      "rope { type: \"default\" } latent_attention { q_lora_rank: 16 kv_lora_rank: 32 "
      "qk_rope_head_dim: 8 v_head_dim: 12 } temperature_tuning { floor_scale: 8192 "
      "attn_scale: 0.1 by_position: true }"));
  EXPECT_TRUE(mistral4.latent.enabled);
  EXPECT_TRUE(mistral4.temperature_tuning.by_position);
}

// The value norm (Gemma 3n, Gemma 4): its eps defaulted and reported, on
// the layer; refused with latent attention, for kind "sdpa" and with a bad
// eps, naming the field.
TEST(ModelConfigTest, ValueNormResolvesAndItsRulesNameTheField) {
  v1::ModelConfig gemma = Resolved("embed_dim: 64 num_heads: 4 v_norm { }");
  EXPECT_EQ(gemma.v_norm().eps(), 1e-6);
  const LayerConfig layer = ToLayerConfig(gemma);
  EXPECT_EQ(layer.v_norm_eps, 1e-6);
  EXPECT_EQ(LayerToModelConfig(AttentionLayer{layer, {}, {}}).v_norm().eps(), 1e-6);
  EXPECT_FALSE(LayerToModelConfig(AttentionLayer{ToLayerConfig(Resolved("embed_dim: 64 "
                                                                        "num_heads: 4")),
                                                 {}, {}})
                   .has_v_norm());
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 v_norm { eps: -1 }").message(),
              AllOf(HasSubstr("v_norm.eps"), HasSubstr("must be finite and > 0")));
  EXPECT_THAT(ResolveError("kind: \"sdpa\" v_norm { }").message(),
              AllOf(HasSubstr("v_norm"), HasSubstr("not allowed for kind \"sdpa\"")));
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 head_dim: 24 weight_layout: SEPARATE_QKV "
                           "latent_attention { kv_lora_rank: 32 qk_rope_head_dim: 8 "
                           "v_head_dim: 12 } v_norm { }")
                  .message(),
              AllOf(HasSubstr("latent_attention"), HasSubstr("v_norm")));
}

// DSA's sparse_index_topk reaches the layer and comes back; refused below 0
// and for kind "sdpa".
TEST(ModelConfigTest, SparseIndexTopkResolvesAndItsRulesNameTheField) {
  const LayerConfig layer =
      ToLayerConfig(Resolved("embed_dim: 64 num_heads: 4 sparse_index_topk: 2048"));
  EXPECT_EQ(layer.sparse_index_topk, 2048);
  EXPECT_EQ(LayerToModelConfig(AttentionLayer{layer, {}, {}}).sparse_index_topk(), 2048);
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 sparse_index_topk: -1").message(),
              AllOf(HasSubstr("sparse_index_topk"), HasSubstr("must be >= 0")));
  EXPECT_THAT(ResolveError("kind: \"sdpa\" sparse_index_topk: 8").message(),
              AllOf(HasSubstr("sparse_index_topk"), HasSubstr("not allowed for kind \"sdpa\"")));
}

// ALiBi's slopes reach the layer and come back, for both kinds; refused when
// not finite, when an "mha" layer has another count than num_heads, and when
// an "sdpa" layer's warm-up asks for another count of query heads (which the
// slopes default).
TEST(ModelConfigTest, AlibiSlopesResolveAndTheirRulesNameTheField) {
  const LayerConfig layer = ToLayerConfig(
      Resolved("embed_dim: 64 num_heads: 2 alibi_slopes: [0.25, 0.0625]"));
  EXPECT_THAT(layer.alibi_slopes, ::testing::ElementsAre(0.25f, 0.0625f));
  const v1::ModelConfig back = LayerToModelConfig(AttentionLayer{layer, {}, {}});
  EXPECT_THAT(back.alibi_slopes(), ::testing::ElementsAre(0.25f, 0.0625f));
  EXPECT_TRUE(ToLayerConfig(Resolved("embed_dim: 64 num_heads: 2")).alibi_slopes.empty());
  const v1::ModelConfig sdpa =
      Resolved("kind: \"sdpa\" alibi_slopes: [0.5, 0.25, 0.125] warmup { batch: 1 q_len: 4 }");
  EXPECT_EQ(ToLayerConfig(sdpa).alibi_slopes.size(), 3u);
  EXPECT_EQ(sdpa.warmup(0).num_heads(), 3);
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 alibi_slopes: [0.5, 0.25]").message(),
              AllOf(HasSubstr("alibi_slopes"), HasSubstr("num_heads 4"), HasSubstr("got 2")));
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 2 alibi_slopes: [0.5, nan]").message(),
              AllOf(HasSubstr("alibi_slopes[1]"), HasSubstr("finite")));
  EXPECT_THAT(ResolveError("kind: \"sdpa\" alibi_slopes: [0.5, 0.25] "
                           "warmup { batch: 1 q_len: 4 num_heads: 8 }")
                  .message(),
              AllOf(HasSubstr("warmup[0].num_heads"), HasSubstr("alibi_slopes")));
}

// A relative position bias's distance reaches the layer and comes back;
// refused below 0 or above the most a layer takes, for kind "sdpa" (its
// table is a weight) and with latent attention.
TEST(ModelConfigTest, RelativeBiasDistanceResolvesAndItsRulesNameTheField) {
  const LayerConfig layer =
      ToLayerConfig(Resolved("embed_dim: 64 num_heads: 2 relative_bias_distance: 128"));
  EXPECT_EQ(layer.relative_bias_distance, 128);
  EXPECT_EQ(LayerToModelConfig(AttentionLayer{layer, {}, {}}).relative_bias_distance(), 128);
  EXPECT_EQ(ToLayerConfig(Resolved("embed_dim: 64 num_heads: 2")).relative_bias_distance, 0);
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 2 relative_bias_distance: -1").message(),
              AllOf(HasSubstr("relative_bias_distance"), HasSubstr("got -1")));
  EXPECT_THAT(
      ResolveError("embed_dim: 64 num_heads: 2 relative_bias_distance: 65537").message(),
      AllOf(HasSubstr("relative_bias_distance"), HasSubstr("65536")));
  EXPECT_THAT(ResolveError("kind: \"sdpa\" relative_bias_distance: 8").message(),
              AllOf(HasSubstr("relative_bias_distance"), HasSubstr("not allowed for kind")));
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 head_dim: 24 weight_layout: "
                           "SEPARATE_QKV relative_bias_distance: 8 latent_attention { "
                           "kv_lora_rank: 32 qk_rope_head_dim: 8 v_head_dim: 12 }")
                  .message(),
              AllOf(HasSubstr("latent_attention"), HasSubstr("relative_bias_distance")));
}

// Relative position embeddings reach the layer and come back; refused
// without a term, with a distance out of range, for kind "sdpa" and with
// latent attention.
TEST(ModelConfigTest, RelativeEmbeddingsResolveAndTheirRulesNameTheField) {
  const LayerConfig layer = ToLayerConfig(Resolved(
      "embed_dim: 64 num_heads: 2 relative_embeddings { distance: 512 content_to_position: true "
      "position_to_content: true }"));
  EXPECT_EQ(layer.relative_embeddings.distance, 512);
  EXPECT_TRUE(layer.relative_embeddings.content_to_position);
  EXPECT_TRUE(layer.relative_embeddings.position_to_content);
  const v1::ModelConfig back = LayerToModelConfig(AttentionLayer{layer, {}, {}});
  EXPECT_EQ(back.relative_embeddings().distance(), 512);
  EXPECT_TRUE(back.relative_embeddings().position_to_content());
  EXPECT_FALSE(LayerToModelConfig(AttentionLayer{ToLayerConfig(Resolved(
                                                     "embed_dim: 64 num_heads: 2")),
                                                 {}, {}})
                   .has_relative_embeddings());
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 2 relative_embeddings { distance: 8 }")
                  .message(),
              AllOf(HasSubstr("relative_embeddings"), HasSubstr("content_to_position")));
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 2 relative_embeddings { distance: 0 "
                           "content_to_position: true }")
                  .message(),
              AllOf(HasSubstr("relative_embeddings.distance"), HasSubstr("got 0")));
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 2 relative_embeddings { distance: 65537 "
                           "content_to_position: true }")
                  .message(),
              HasSubstr("65536"));
  EXPECT_THAT(ResolveError("kind: \"sdpa\" relative_embeddings { distance: 8 "
                           "content_to_position: true }")
                  .message(),
              AllOf(HasSubstr("relative_embeddings"), HasSubstr("not allowed for kind")));
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 head_dim: 24 weight_layout: "
                           "SEPARATE_QKV relative_embeddings { distance: 8 "
                           "content_to_position: true } latent_attention { "
                           "kv_lora_rank: 32 qk_rope_head_dim: 8 v_head_dim: 12 }")
                  .message(),
              AllOf(HasSubstr("latent_attention"), HasSubstr("relative_embeddings")));
}

// KV sharing (Gemma 3n, Gemma 4): the source layer's name reaches the layer
// and comes back; refused for kind "sdpa" and with latent attention.
TEST(ModelConfigTest, KvSourceResolvesAndItsRulesNameTheField) {
  const v1::ModelConfig shared =
      Resolved("embed_dim: 64 num_heads: 4 kv_source: \"model.layers.3.self_attn\"");
  const LayerConfig layer = ToLayerConfig(shared);
  EXPECT_EQ(layer.kv_source, "model.layers.3.self_attn");
  EXPECT_EQ(LayerToModelConfig(AttentionLayer{layer, {}, {}}).kv_source(),
            "model.layers.3.self_attn");
  EXPECT_TRUE(ToLayerConfig(Resolved("embed_dim: 64 num_heads: 4")).kv_source.empty());
  EXPECT_THAT(ResolveError("kind: \"sdpa\" kv_source: \"x\"").message(),
              AllOf(HasSubstr("kv_source"), HasSubstr("not allowed for kind \"sdpa\"")));
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 head_dim: 24 weight_layout: SEPARATE_QKV "
                           "latent_attention { kv_lora_rank: 32 qk_rope_head_dim: 8 "
                           "v_head_dim: 12 } kv_source: \"x\"")
                  .message(),
              AllOf(HasSubstr("latent_attention"), HasSubstr("kv_source")));
}

// QK-norm's LayerNorm form with weights per head (Cohere) reaches the layer
// and comes back; per-head weights over the whole projection are refused.
TEST(ModelConfigTest, LayerNormQkNormResolves) {
  v1::ModelConfig cohere = Resolved(
      "embed_dim: 64 num_heads: 4 qk_norm { eps: 1e-5 subtract_mean: true per_head_weights: "
      "true }");
  const LayerConfig layer = ToLayerConfig(cohere);
  EXPECT_TRUE(layer.qk_norm.subtract_mean);
  EXPECT_TRUE(layer.qk_norm.per_head_weights);
  const v1::ModelConfig back = LayerToModelConfig(AttentionLayer{layer, {}, {}});
  EXPECT_TRUE(back.qk_norm().subtract_mean());
  EXPECT_TRUE(back.qk_norm().per_head_weights());
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 qk_norm { per_head_weights: true "
                           "whole_projection: true }")
                  .message(),
              AllOf(HasSubstr("qk_norm.per_head_weights"), HasSubstr("whole_projection")));
}

// clip_qkv (OLMo, DBRX): reaches the layer and comes back; negative or
// on sdpa refused naming the field.
TEST(ModelConfigTest, ClipQkvResolvesAndItsRulesNameTheField) {
  v1::ModelConfig olmo = Resolved("embed_dim: 64 num_heads: 4 clip_qkv: 8");
  EXPECT_EQ(ToLayerConfig(olmo).clip_qkv, 8.0f);
  AttentionLayer layer;
  layer.config = ToLayerConfig(olmo);
  EXPECT_EQ(LayerToModelConfig(layer).clip_qkv(), 8.0f);
  EXPECT_EQ(ToLayerConfig(Resolved("embed_dim: 64 num_heads: 4")).clip_qkv, 0.0f);
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 clip_qkv: -1").message(),
              AllOf(HasSubstr("clip_qkv"), HasSubstr(">= 0")));
  EXPECT_THAT(ResolveError("kind: \"sdpa\" clip_qkv: 8").message(),
              AllOf(HasSubstr("clip_qkv"), HasSubstr("not allowed for kind \"sdpa\"")));
}

// Llama 4: attention_chunk on causal layers only (sdpa too), temperature
// tuning on projection layers with both its numbers; each reaches the layer
// and is reported back.
TEST(ModelConfigTest, ChunkedAttentionAndTemperatureRulesNameTheField) {
  v1::ModelConfig chunked = Resolved("embed_dim: 64 num_heads: 4 causal: true "
                                     "attention_chunk: 8192");
  AttentionLayer layer;
  layer.config = ToLayerConfig(chunked);
  EXPECT_EQ(layer.config.attention_chunk, 8192);
  EXPECT_EQ(LayerToModelConfig(layer).attention_chunk(), 8192);
  EXPECT_EQ(ToLayerConfig(Resolved("kind: \"sdpa\" causal: true attention_chunk: 16"))
                .attention_chunk,
            16);
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 attention_chunk: 16").message(),
              AllOf(HasSubstr("attention_chunk"), HasSubstr("causal: true")));
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 causal: true attention_chunk: -1")
                  .message(),
              AllOf(HasSubstr("attention_chunk"), HasSubstr(">= 0")));

  v1::ModelConfig nope = Resolved("embed_dim: 64 num_heads: 4 causal: true "
                                  "temperature_tuning { floor_scale: 8192 attn_scale: 0.1 }");
  layer.config = ToLayerConfig(nope);
  EXPECT_TRUE(layer.config.temperature_tuning.enabled);
  EXPECT_EQ(layer.config.temperature_tuning.floor_scale, 8192);
  EXPECT_EQ(layer.config.temperature_tuning.attn_scale, 0.1);
  EXPECT_EQ(LayerToModelConfig(layer).temperature_tuning().floor_scale(), 8192);
  EXPECT_FALSE(ToLayerConfig(Resolved("embed_dim: 64 num_heads: 4")).temperature_tuning.enabled);
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 temperature_tuning { attn_scale: 0.1 }")
                  .message(),
              AllOf(HasSubstr("temperature_tuning.floor_scale"), HasSubstr("> 0")));
  EXPECT_THAT(ResolveError("embed_dim: 64 num_heads: 4 temperature_tuning { floor_scale: 4 }")
                  .message(),
              HasSubstr("temperature_tuning.attn_scale"));
  EXPECT_THAT(ResolveError("kind: \"sdpa\" temperature_tuning { floor_scale: 4 attn_scale: 1 }")
                  .message(),
              AllOf(HasSubstr("temperature_tuning"), HasSubstr("not allowed for kind")));
}

TEST(ModelConfigTest, SdpaNeedsNoDims) {
  v1::ModelConfig c = Resolved("kind: \"sdpa\" causal: true scale: 0.5 sliding_window: 128");
  LayerConfig layer = ToLayerConfig(c);
  EXPECT_FALSE(layer.has_projections);
  EXPECT_TRUE(layer.causal);
  EXPECT_EQ(layer.sliding_window, 128);  // a window applies to bare attention too
}

// A repository written by the test: safetensors bytes built by hand.
class RepositoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/model_repository_test_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }

  void WriteFile(const std::string& rel, const std::string& bytes) {
    fs::path p = fs::path(dir_) / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }

  // An nn.MultiheadAttention(embed, heads, bias=False) folder.
  void WriteMha(const std::string& folder, int64_t embed, const std::string& extra_config = "") {
    std::vector<std::string> entries;
    std::string data;
    auto add = [&](const std::string& name, int64_t rows, int64_t cols) {
      size_t begin = data.size();
      std::vector<float> v(static_cast<size_t>(rows * cols));
      for (size_t i = 0; i < v.size(); ++i) v[i] = 0.01f * static_cast<float>(i % 17);
      data.append(reinterpret_cast<const char*>(v.data()), v.size() * 4);
      entries.push_back(absl::StrCat("\"", name, "\":{\"dtype\":\"F32\",\"shape\":[", rows, ",",
                                     cols, "],\"data_offsets\":[", begin, ",", data.size(), "]}"));
    };
    add("in_proj_weight", 3 * embed, embed);
    add("out_proj.weight", embed, embed);
    std::string header = absl::StrCat("{", absl::StrJoin(entries, ","), "}");
    uint64_t n = header.size();
    std::string bytes(8, '\0');
    std::memcpy(bytes.data(), &n, 8);
    WriteFile(folder + "/weights.safetensors", bytes + header + data);
    WriteFile(folder + "/config.pbtxt",
              absl::StrCat("embed_dim: ", embed, "\nnum_heads: 2\n", extra_config));
  }

  std::string dir_;
};

TEST_F(RepositoryTest, LoadsFoldersSortedAndReportsEachProblem) {
  WriteMha("b-good", 8);
  WriteMha("a-bad", 8, "out_dim: 6\n");    // out_proj.weight is [8, 8]
  WriteMha(".hidden", 8, "nonsense: 1\n");  // skipped
  WriteFile("c-empty/README", "no config here");
  WriteFile("stray-file.txt", "ignored");
  absl::StatusOr<std::vector<RepositoryModel>> models = LoadModelRepository(dir_);
  ASSERT_TRUE(models.ok()) << models.status();
  ASSERT_EQ(models->size(), 3u);
  EXPECT_EQ((*models)[0].name, "a-bad");
  EXPECT_THAT((*models)[0].status.message(),
              AllOf(HasSubstr("a-bad/weights.safetensors"), HasSubstr("'out_proj.weight'"),
                    HasSubstr("has shape [8, 8]; expected [6, 8]")));
  EXPECT_EQ((*models)[0].layer, nullptr);
  EXPECT_EQ((*models)[0].config.out_dim(), 6);  // the resolved config is still reported
  EXPECT_EQ((*models)[1].name, "b-good");
  EXPECT_TRUE((*models)[1].status.ok()) << (*models)[1].status;
  ASSERT_NE((*models)[1].layer, nullptr);
  EXPECT_EQ((*models)[1].layer->weights.wk.shape(), (Shape{8, 8}));
  EXPECT_EQ((*models)[2].name, "c-empty");
  EXPECT_THAT((*models)[2].status.message(),
              AllOf(HasSubstr("c-empty/config.pbtxt"), HasSubstr("cannot read")));
}

TEST_F(RepositoryTest, StrictRefusesAndAddsNothing) {
  WriteMha("good", 8);
  WriteMha("bad", 8, "head_dim: 3\n");
  auto engine = CreateEngine("reference");
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::shared_ptr<AttentionEngine> shared = *std::move(engine);
  ModelRegistry registry;
  absl::Status s = AddRepositoryModels(dir_, /*strict=*/true, Engines(shared), &registry);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("1 model(s) failed"), HasSubstr("model 'bad'"),
                                 HasSubstr("in_proj_weight")));
  EXPECT_TRUE(registry.List().empty());
}

TEST_F(RepositoryTest, NonStrictAddsTheBadOneAsFailed) {
  WriteMha("good", 8);
  WriteMha("bad", 8, "head_dim: 3\n");
  auto engine = CreateEngine("reference");
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::shared_ptr<AttentionEngine> shared = *std::move(engine);
  ModelRegistry registry;
  ASSERT_TRUE(AddRepositoryModels(dir_, /*strict=*/false, Engines(shared), &registry).ok());
  auto good = registry.Find("good");
  ASSERT_TRUE(good.ok());
  EXPECT_TRUE((*good)->ready());
  EXPECT_EQ((*good)->engine, shared);
  EXPECT_EQ((*good)->config->num_kv_heads(), 2);
  auto bad = registry.Find("bad");
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ((*bad)->state, ModelState::kFailed);
  EXPECT_THAT((*bad)->reason, AllOf(HasSubstr("bad/weights.safetensors"),
                                    HasSubstr("expected [18, 8]")));
  // Callers see paths relative to the repository, never the server's own.
  EXPECT_THAT((*bad)->reason, ::testing::StartsWith("bad/weights.safetensors"));
  EXPECT_THAT((*bad)->reason, ::testing::Not(HasSubstr(dir_)));
}

// Stands in for the CUDA engine (no GPU here): its name is what the
// repository decides by. Never run.
class NamedCudaEngine final : public AttentionEngine {
 public:
  std::string_view name() const override { return "cuda"; }
  absl::Status Run(const AttentionLayer&, absl::Span<const AttentionTask>) override {
    return absl::InternalError("not to be run");
  }
};

// The CUDA engine computes every layer feature the cpu engine does (RoPE,
// QK-norm, sliding windows, softcapping, sinks): on a server whose engine is
// cuda, such models stay on it, with backend "auto" or "cuda".
TEST_F(RepositoryTest, RopeModelsStayOnTheGpu) {
  WriteMha("plain", 8);
  WriteMha("rope-auto", 8, "rope { type: \"default\" }\n");
  WriteMha("rope-cuda", 8, "rope { type: \"default\" }\nbackend: \"cuda\"\n");
  auto gpu = std::make_shared<NamedCudaEngine>();
  ModelRegistry registry;
  ASSERT_TRUE(AddRepositoryModels(dir_, /*strict=*/false, Engines(gpu), &registry).ok());
  for (const char* name : {"plain", "rope-auto", "rope-cuda"}) {
    SCOPED_TRACE(name);
    auto model = registry.Find(name);
    ASSERT_TRUE(model.ok());
    EXPECT_TRUE((*model)->ready()) << (*model)->reason;
    EXPECT_EQ((*model)->engine, gpu);
  }
}

// A failed model's reason reaches any client (GetModel, ListModels, Attend
// errors): it names files relative to the repository, never the server's
// full path; the operator's startup error/log keeps the full path.
TEST_F(RepositoryTest, ReasonsNameFilesRelativeToTheRepository) {
  WriteMha("good", 8);
  WriteMha("no-weights", 8);
  fs::remove(fs::path(dir_) / "no-weights" / "weights.safetensors");
  WriteMha("bad-shape", 8, "out_dim: 6\n");
  WriteMha("bad-syntax", 8, "nonsense: 1\n");
  WriteMha("bad-dims", 8, "head_dim: 3\n");
  WriteFile("no-config/README", "no config here");
  WriteMha("dup", 8, "name: \"good\"\n");
  WriteMha("builtin", 8, "name: \"taken\"\n");
  WriteMha("no-backend", 8, "backend: \"cuda\"\n");
  auto engine = CreateEngine("reference");
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::shared_ptr<AttentionEngine> shared = *std::move(engine);
  ModelRegistry registry;
  auto builtin = std::make_shared<ServedModel>();
  builtin->name = "taken";
  builtin->config = std::make_shared<v1::ModelConfig>();
  ASSERT_TRUE(registry.Add(builtin).ok());
  ASSERT_TRUE(AddRepositoryModels(dir_ + "/", /*strict=*/false, Engines(shared), &registry).ok());

  const std::vector<std::pair<std::string, std::string>> expected = {
      {"no-weights", "no-weights/weights.safetensors: cannot open"},
      {"bad-shape", "bad-shape/weights.safetensors: tensor 'out_proj.weight'"},
      {"bad-syntax", "bad-syntax/config.pbtxt:3:"},
      {"bad-dims", "bad-dims/weights.safetensors"},
      {"no-config", "no-config/config.pbtxt: cannot read"},
      {"no-backend", "no-backend: backend \"cuda\""},
  };
  for (const auto& [name, start] : expected) {
    auto model = registry.Find(name);
    ASSERT_TRUE(model.ok()) << name;
    EXPECT_EQ((*model)->state, ModelState::kFailed) << name;
    EXPECT_THAT((*model)->reason, AllOf(StartsWith(start), Not(HasSubstr(dir_)))) << name;
  }
  for (const auto& model : registry.List()) {
    EXPECT_THAT(model->reason, Not(HasSubstr(dir_))) << model->name;
  }

  // Strict: the startup error is the operator's and names the full path.
  ModelRegistry strict_registry;
  absl::Status s = AddRepositoryModels(dir_, /*strict=*/true, Engines(shared), &strict_registry);
  EXPECT_THAT(s.message(),
              HasSubstr(absl::StrCat("model 'no-weights': ", dir_,
                                     "/no-weights/weights.safetensors: cannot open")));
}

TEST(RepositoryDirTest, MissingDirectoryIsAnError) {
  absl::StatusOr<std::vector<RepositoryModel>> models =
      LoadModelRepository("/nonexistent/model/repo");
  ASSERT_FALSE(models.ok());
  EXPECT_THAT(models.status().message(),
              AllOf(HasSubstr("/nonexistent/model/repo"), HasSubstr("not a directory")));
}

}  // namespace
}  // namespace attnserve

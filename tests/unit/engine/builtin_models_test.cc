// Tests for the built-in models and ValidateLayer: demo-mha's seeded weights
// are pinned to values computed independently (a Python splitmix64), so a
// change to the generator or seeds cannot go unnoticed.
#include "engine/model/builtin_models.h"

#include <cmath>
#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

TEST(SplitMix64Test, MatchesPublishedSequence) {
  // First output of splitmix64 seeded with 0 (the reference C implementation).
  SplitMix64 rng(0);
  EXPECT_EQ(rng.Next(), 0xE220A8397B1DCDAFull);
}

TEST(BuiltinModelsTest, Sdpa) {
  std::shared_ptr<const AttentionLayer> sdpa = MakeSdpaLayer();
  EXPECT_EQ(sdpa->config.name, "sdpa");
  EXPECT_FALSE(sdpa->config.has_projections);
  EXPECT_TRUE(ValidateLayer(*sdpa).ok());
}

TEST(BuiltinModelsTest, DemoMhaConfig) {
  std::shared_ptr<const AttentionLayer> mha = MakeDemoMhaLayer();
  const LayerConfig& c = mha->config;
  EXPECT_EQ(c.name, "demo-mha");
  EXPECT_TRUE(c.has_projections);
  EXPECT_EQ(c.embed_dim, 512);
  EXPECT_EQ(c.num_heads, 8);
  EXPECT_EQ(c.num_kv_heads, 8);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.query_dim, 512);
  EXPECT_EQ(c.key_dim, 512);
  EXPECT_EQ(c.value_dim, 512);
  EXPECT_EQ(c.out_dim, 512);
  const absl::Status s = ValidateLayer(*mha);
  EXPECT_TRUE(s.ok()) << s;
  for (const Tensor* b : {&mha->weights.bq, &mha->weights.bk, &mha->weights.bv,
                          &mha->weights.bo}) {
    EXPECT_EQ(b->shape(), Shape{512});
  }
}

TEST(BuiltinModelsTest, DemoMhaWeightsArePinned) {
  std::shared_ptr<const AttentionLayer> mha = MakeDemoMhaLayer();
  // Values from an independent Python splitmix64 + numpy float32 rounding.
  const float* wq = mha->weights.wq.data_as<float>();
  EXPECT_EQ(BitsOf(wq[0]), 0xBA82722Eu);  // -0.000995224109
  EXPECT_EQ(BitsOf(wq[1]), 0x3D29D31Fu);  //  0.0414611064
  EXPECT_EQ(BitsOf(wq[2]), 0x3CF99D29u);  //  0.0304704476
  const float* bo = mha->weights.bo.data_as<float>();
  EXPECT_EQ(BitsOf(bo[0]), 0x3BF5832Fu);
  EXPECT_EQ(BitsOf(bo[1]), 0x3C1FFA7Au);
  EXPECT_EQ(BitsOf(bo[2]), 0x3C549104u);

  // Every weight is inside PyTorch's nn.Linear init range, and two builds
  // give the same bytes.
  const float bound = 1.0f / std::sqrt(512.0f);
  std::shared_ptr<const AttentionLayer> again = MakeDemoMhaLayer();
  for (const auto& [a, b] : {std::pair{&mha->weights.wk, &again->weights.wk},
                             {&mha->weights.wo, &again->weights.wo}}) {
    ASSERT_EQ(a->byte_size(), b->byte_size());
    EXPECT_EQ(std::memcmp(a->data(), b->data(), a->byte_size()), 0);
    for (int64_t i = 0; i < a->num_elements(); ++i) {
      ASSERT_LE(std::fabs(a->data_as<float>()[i]), bound);
    }
  }
}

TEST(ValidateLayerTest, NamesTheBadWeight) {
  AttentionLayer layer;
  layer.config.name = "tiny";
  layer.config.has_projections = true;
  layer.config.num_heads = 2;
  layer.config.num_kv_heads = 1;
  layer.config.head_dim = 4;
  layer.config.query_dim = 6;
  layer.config.key_dim = 5;
  layer.config.value_dim = 3;
  layer.config.out_dim = 7;
  layer.weights.wq = Tensor(DType::kFloat32, {8, 6});
  layer.weights.wk = Tensor(DType::kFloat32, {4, 5});
  layer.weights.wv = Tensor(DType::kFloat32, {4, 3});
  layer.weights.wo = Tensor(DType::kFloat32, {7, 8});
  EXPECT_TRUE(ValidateLayer(layer).ok());

  layer.weights.bk = Tensor(DType::kFloat32, {8});
  absl::Status s = ValidateLayer(layer);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("bk"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("[4]"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("[8]"));
  layer.weights.bk = Tensor();

  // QK-norm weights: [head_dim] per head; over the whole projection
  // (OLMo-2) as wide as Q's and K's projections.
  layer.config.qk_norm.enabled = true;
  layer.weights.q_norm = Tensor(DType::kFloat32, {4});
  layer.weights.k_norm = Tensor(DType::kFloat32, {4});
  EXPECT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);
  layer.config.qk_norm.whole_projection = true;
  s = ValidateLayer(layer);
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("q_norm weight must be FLOAT32 [8] (num_heads * head_dim"),
                    HasSubstr("got [4]")));
  layer.weights.q_norm = Tensor(DType::kFloat32, {8});
  EXPECT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);  // K: 1 head of 4
  layer.weights.k_norm = Tensor(DType::kFloat32, {8});
  s = ValidateLayer(layer);
  EXPECT_THAT(std::string(s.message()),
              AllOf(HasSubstr("k_norm weight must be FLOAT32 [4] (num_kv_heads * head_dim"),
                    HasSubstr("got [8]")));
  layer.config.qk_norm = QkNormConfig();
  layer.weights.q_norm = layer.weights.k_norm = Tensor();

  layer.config.num_kv_heads = 3;
  s = ValidateLayer(layer);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.message()), HasSubstr("multiple of num_kv_heads"));
}

}  // namespace
}  // namespace attnserve

// ModelRegistry: lookup by name and default, NotFound listing the models,
// FAILED models listed but marked; built-ins and their reported config.
#include "server/models/model_registry.h"

#include <string>

#include "attnserve/v1/model_config.pb.h"
#include "engine/model/builtin_models.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

std::shared_ptr<AttentionEngine> ReferenceEngine() {
  absl::StatusOr<std::unique_ptr<AttentionEngine>> engine = CreateEngine("reference");
  EXPECT_TRUE(engine.ok()) << engine.status();
  return std::shared_ptr<AttentionEngine>(*std::move(engine));
}

TEST(ModelRegistryTest, BuiltinsAndDefault) {
  ModelRegistry registry;
  ASSERT_TRUE(AddBuiltinModels(ReferenceEngine(), &registry).ok());
  ASSERT_TRUE(registry.SetDefaultModel("demo-mha").ok());
  EXPECT_EQ(registry.default_model(), "demo-mha");

  auto models = registry.List();
  ASSERT_EQ(models.size(), 2u);
  EXPECT_EQ(models[0]->name, "demo-mha");  // sorted
  EXPECT_EQ(models[1]->name, "sdpa");
  for (const auto& m : models) {
    EXPECT_TRUE(m->ready()) << m->name << ": " << m->reason;
    EXPECT_EQ(m->config->backend(), "reference");
  }

  absl::StatusOr<std::shared_ptr<const ServedModel>> found = registry.Find("");
  ASSERT_TRUE(found.ok());
  EXPECT_EQ((*found)->name, "demo-mha");
  const v1::ModelConfig& config = *(*found)->config;
  EXPECT_EQ(config.kind(), "mha");
  EXPECT_EQ(config.embed_dim(), 512);
  EXPECT_EQ(config.num_heads(), 8);
  EXPECT_EQ(config.head_dim(), 64);
  EXPECT_TRUE(config.q_bias() && config.k_bias() && config.v_bias() && config.out_bias());
  EXPECT_EQ(config.precision(), "fp32");

  found = registry.Find("sdpa");
  ASSERT_TRUE(found.ok());
  EXPECT_EQ((*found)->config->kind(), "sdpa");
}

TEST(ModelRegistryTest, UnknownModelListsAvailable) {
  ModelRegistry registry;
  ASSERT_TRUE(AddBuiltinModels(ReferenceEngine(), &registry).ok());
  absl::StatusOr<std::shared_ptr<const ServedModel>> found = registry.Find("gpt");
  EXPECT_EQ(found.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(found.status().message()), HasSubstr("'gpt'"));
  EXPECT_THAT(std::string(found.status().message()), HasSubstr("demo-mha, sdpa"));

  absl::Status s = registry.SetDefaultModel("gpt");
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  // No default set: an unnamed request has nowhere to go.
  EXPECT_EQ(registry.Find("").status().code(), absl::StatusCode::kNotFound);
}

TEST(ModelRegistryTest, DuplicateNameRefused) {
  ModelRegistry registry;
  auto engine = ReferenceEngine();
  ASSERT_TRUE(registry.Add(MakeServedModel(MakeSdpaLayer(), engine)).ok());
  EXPECT_EQ(registry.Add(MakeServedModel(MakeSdpaLayer(), engine)).code(),
            absl::StatusCode::kAlreadyExists);
}

TEST(ModelRegistryTest, InvalidLayerIsListedAsFailed) {
  auto layer = std::make_shared<AttentionLayer>();
  layer->config.name = "broken";
  layer->config.has_projections = true;
  layer->config.embed_dim = layer->config.query_dim = layer->config.key_dim =
      layer->config.value_dim = layer->config.out_dim = 16;
  layer->config.num_heads = layer->config.num_kv_heads = 2;
  layer->config.head_dim = 8;  // and no weights at all
  ModelRegistry registry;
  ASSERT_TRUE(registry.Add(MakeServedModel(layer, ReferenceEngine())).ok());
  absl::StatusOr<std::shared_ptr<const ServedModel>> found = registry.Find("broken");
  ASSERT_TRUE(found.ok());
  EXPECT_FALSE((*found)->ready());
  EXPECT_EQ((*found)->state, ModelState::kFailed);
  EXPECT_FALSE((*found)->reason.empty());
}

}  // namespace
}  // namespace attnserve

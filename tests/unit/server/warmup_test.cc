// WarmUpModel: the task each kind of layer gets (seen by a recording
// engine), the real cpu engine on the built-in models, and a failing
// engine's error naming the model.
#include "server/models/warmup.h"

#include <memory>
#include <string>
#include <vector>

#include "engine/model/builtin_models.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/models/model_registry.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

class RecordingEngine final : public AttentionEngine {
 public:
  std::string_view name() const override { return "recording"; }
  absl::Status Run(const AttentionLayer& layer, absl::Span<const AttentionTask> tasks) override {
    for (const AttentionTask& t : tasks) {
      if (absl::Status s = CheckTask(layer.config, t); !s.ok()) return s;
      queries.push_back(t.query.shape);
      self_attention.push_back(t.key.empty());
      causal.push_back(t.causal);
    }
    return fail;
  }
  std::vector<Shape> queries;
  std::vector<bool> self_attention, causal;
  absl::Status fail;
};

TEST(WarmUpTest, EachLayerKindGetsOneValidBatch) {
  auto engine = std::make_shared<RecordingEngine>();
  std::shared_ptr<const ServedModel> demo = MakeServedModel(MakeDemoMhaLayer(), engine);
  std::shared_ptr<const ServedModel> sdpa = MakeServedModel(MakeSdpaLayer(), engine);
  ASSERT_TRUE(WarmUpModel(*demo).ok());
  ASSERT_TRUE(WarmUpModel(*sdpa).ok());
  ASSERT_EQ(engine->queries.size(), 2u);
  EXPECT_EQ(engine->queries[0], (Shape{1, 16, 512}));  // demo-mha: self-attention, 16 tokens
  EXPECT_TRUE(engine->self_attention[0]);
  EXPECT_EQ(engine->queries[1], (Shape{1, 8, 16, 64}));  // sdpa: the default dims
  EXPECT_FALSE(engine->self_attention[1]);

  // A cross-attention layer (key_dim != query_dim) gets key and value.
  auto cross = std::make_shared<AttentionLayer>(*MakeDemoMhaLayer());
  cross->config.name = "cross";
  cross->config.key_dim = 32;
  cross->config.value_dim = 32;
  cross->weights.wk = Tensor(DType::kFloat32, {cross->config.num_kv_heads * cross->config.head_dim, 32});
  cross->weights.wv = Tensor(DType::kFloat32, {cross->config.num_kv_heads * cross->config.head_dim, 32});
  std::shared_ptr<const ServedModel> c = MakeServedModel(cross, engine);
  ASSERT_TRUE(c->ready()) << c->reason;
  ASSERT_TRUE(WarmUpModel(*c).ok());
  EXPECT_FALSE(engine->self_attention.back());
}

TEST(WarmUpTest, TheCpuEngineWarmsTheBuiltInModels) {
  absl::StatusOr<std::unique_ptr<AttentionEngine>> cpu = CreateEngine("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::shared_ptr<AttentionEngine> engine = *std::move(cpu);
  for (auto layer : {MakeDemoMhaLayer(), MakeSdpaLayer()}) {
    absl::StatusOr<absl::Duration> took = WarmUpModel(*MakeServedModel(layer, engine));
    ASSERT_TRUE(took.ok()) << took.status();
    EXPECT_GT(*took, absl::ZeroDuration());
  }
}

TEST(WarmUpTest, AFailingEngineNamesTheModel) {
  auto engine = std::make_shared<RecordingEngine>();
  engine->fail = absl::InternalError("out of cheese");
  absl::StatusOr<absl::Duration> took = WarmUpModel(*MakeServedModel(MakeSdpaLayer(), engine));
  EXPECT_EQ(took.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(took.status().message()),
              HasSubstr("model 'sdpa': warm-up failed: out of cheese"));
}

}  // namespace
}  // namespace attnserve

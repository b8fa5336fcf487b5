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
#include "attnserve/v1/model_config.pb.h"
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
      keys.push_back(t.key.empty() ? Shape{} : t.key.shape);
      dtypes.push_back(t.query.dtype);
      self_attention.push_back(t.key.empty());
      causal.push_back(t.causal);
      if (fail_at_query_len > 0 && t.query.shape[t.query.shape.size() - 2] == fail_at_query_len) {
        return absl::InvalidArgumentError("no such shape here");
      }
    }
    return fail;
  }
  std::vector<Shape> queries, keys;
  std::vector<DType> dtypes;
  std::vector<bool> self_attention, causal;
  absl::Status fail;
  int64_t fail_at_query_len = 0;  // > 0: refuse tasks of this query length
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

// `model` with `warmup` entries (as ResolveModelConfig leaves them) in its
// reported config.
std::shared_ptr<const ServedModel> WithWarmup(std::shared_ptr<const ServedModel> model,
                                              const std::vector<v1::WarmupShape>& warmup) {
  auto m = std::make_shared<ServedModel>(*model);
  auto config = std::make_shared<v1::ModelConfig>(*model->config);
  for (const v1::WarmupShape& w : warmup) *config->add_warmup() = w;
  m->config = config;
  return m;
}

v1::WarmupShape Shape4(int64_t batch, int64_t q_len, int64_t kv_len, const char* dtype,
                       bool causal) {
  v1::WarmupShape w;
  w.set_batch(batch);
  w.set_q_len(q_len);
  w.set_kv_len(kv_len);
  w.set_dtype(dtype);
  w.set_causal(causal);
  return w;
}

TEST(WarmUpTest, TheConfigsShapesFollowTheDefaultBatch) {
  auto engine = std::make_shared<RecordingEngine>();
  std::shared_ptr<const ServedModel> demo =
      WithWarmup(MakeServedModel(MakeDemoMhaLayer(), engine),
                 {Shape4(4, 128, 128, "fp32", false), Shape4(2, 1, 4096, "bf16", true)});
  ASSERT_TRUE(WarmUpModel(*demo).ok());
  ASSERT_EQ(engine->queries.size(), 3u);
  EXPECT_EQ(engine->queries[0], (Shape{1, 16, 512}));  // the default batch first
  EXPECT_EQ(engine->queries[1], (Shape{4, 128, 512}));
  EXPECT_TRUE(engine->self_attention[1]);
  EXPECT_EQ(engine->dtypes[1], DType::kFloat32);
  EXPECT_FALSE(engine->causal[1]);
  EXPECT_EQ(engine->queries[2], (Shape{2, 1, 512}));
  EXPECT_EQ(engine->keys[2], (Shape{2, 4096, 512})) << "kv_len != q_len: keys of their own";
  EXPECT_EQ(engine->dtypes[2], DType::kBFloat16);
  EXPECT_TRUE(engine->causal[2]);

  std::shared_ptr<const ServedModel> sdpa = WithWarmup(
      MakeServedModel(MakeSdpaLayer(), engine), {Shape4(3, 64, 256, "fp16", false)});
  ASSERT_TRUE(WarmUpModel(*sdpa).ok());
  EXPECT_EQ(engine->queries.back(), (Shape{3, 8, 64, 64}));
  EXPECT_EQ(engine->keys.back(), (Shape{3, 8, 256, 64}));
  EXPECT_EQ(engine->dtypes.back(), DType::kFloat16);

  // An sdpa entry's own heads (grouped-query here) and head dim.
  v1::WarmupShape gqa = Shape4(1, 2048, 2048, "bf16", true);
  gqa.set_num_heads(16);
  gqa.set_num_kv_heads(4);
  gqa.set_head_dim(128);
  ASSERT_TRUE(WarmUpModel(*WithWarmup(MakeServedModel(MakeSdpaLayer(), engine), {gqa})).ok());
  EXPECT_EQ(engine->queries.back(), (Shape{1, 16, 2048, 128}));
  EXPECT_EQ(engine->keys.back(), (Shape{1, 4, 2048, 128}));
  EXPECT_TRUE(engine->causal.back());
}

TEST(WarmUpTest, AShapeTheEngineRefusesFailsNamingTheEntry) {
  auto engine = std::make_shared<RecordingEngine>();
  engine->fail_at_query_len = 64;
  std::shared_ptr<const ServedModel> demo =
      WithWarmup(MakeServedModel(MakeDemoMhaLayer(), engine),
                 {Shape4(1, 32, 32, "fp32", false), Shape4(2, 64, 64, "bf16", false)});
  absl::StatusOr<absl::Duration> took = WarmUpModel(*demo);
  EXPECT_EQ(took.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(took.status().message()),
              HasSubstr("model 'demo-mha': warm-up failed at warmup[1] (batch 2, q_len 64, "
                        "kv_len 64, bf16): no such shape here"));
}

TEST(WarmUpTest, TheCpuEngineComputesTheConfigsShapes) {
  absl::StatusOr<std::unique_ptr<AttentionEngine>> cpu = CreateEngine("cpu");
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::shared_ptr<AttentionEngine> engine = *std::move(cpu);
  std::shared_ptr<const ServedModel> demo =
      WithWarmup(MakeServedModel(MakeDemoMhaLayer(), engine),
                 {Shape4(2, 100, 100, "fp32", true), Shape4(1, 3, 40, "fp16", false)});
  absl::StatusOr<absl::Duration> took = WarmUpModel(*demo);
  ASSERT_TRUE(took.ok()) << took.status();
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

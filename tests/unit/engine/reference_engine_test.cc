// Tests for the reference backend against cases worked out by hand (softmax
// of known scores), plus the structural identities it must satisfy: GQA
// equals repeated K/V, fully masked rows give zeros, projections compose.
#include "engine/reference/reference_engine.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "engine/attention_engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

constexpr float kInf = std::numeric_limits<float>::infinity();

Tensor Values(DType dtype, Shape shape, const std::vector<float>& values) {
  Tensor t(dtype, std::move(shape));
  EXPECT_EQ(t.num_elements(), static_cast<int64_t>(values.size()));
  ConvertFromFloat(values.data(), static_cast<int64_t>(values.size()), dtype, t.data());
  return t;
}

Tensor Random(Shape shape, uint32_t seed) {
  Tensor t(DType::kFloat32, std::move(shape));
  std::mt19937 rng(seed);
  for (int64_t i = 0; i < t.num_elements(); ++i) {
    t.data_as<float>()[i] = static_cast<float>(rng() % 2001) / 1000.0f - 1.0f;
  }
  return t;
}

std::vector<float> AsFloats(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.num_elements()));
  ConvertToFloat(t.dtype(), t.data(), t.num_elements(), out.data());
  return out;
}

// An sdpa task over q/k/v with outputs allocated to match.
struct SdpaRun {
  Tensor out, weights;
  AttentionTask task;

  SdpaRun(const Tensor& q, const Tensor& k, const Tensor& v, bool need_weights = true,
          bool average = false, DType out_dtype = DType::kFloat32) {
    task.query = q.view();
    task.key = k.view();
    task.value = v.view();
    const LayerConfig sdpa;
    task.scale = ResolveScale(sdpa, 0.0f, q.shape()[3]);
    const TaskDims d = GetTaskDims(sdpa, task);
    out = Tensor(out_dtype, OutputShape(sdpa, d));
    task.output = out.mutable_view();
    if (need_weights) {
      weights = Tensor(DType::kFloat32, WeightsShape(d, average));
      task.weights = weights.mutable_view();
      task.average_weights = average;
    }
  }
};

absl::Status RunSdpa(AttentionTask& task) {
  AttentionLayer sdpa;
  sdpa.config.name = "sdpa";
  return NewReferenceEngine()->Run(sdpa, {&task, 1});
}

void ExpectNear(const std::vector<float>& actual, const std::vector<double>& expected,
                double tol = 1e-6) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_NEAR(actual[i], expected[i], tol) << "element " << i;
  }
}

// Q = K = I (2x2), V = [[1, 2], [3, 4]], scale 0.5: the scores are
// 0.5 * I, so row 0 has weights [a, 1 - a] with a = e^.5 / (e^.5 + 1).
TEST(ReferenceEngineTest, TwoByTwoByHand) {
  const Tensor q = Values(DType::kFloat32, {1, 1, 2, 2}, {1, 0, 0, 1});
  const Tensor k = q;
  const Tensor v = Values(DType::kFloat32, {1, 1, 2, 2}, {1, 2, 3, 4});
  SdpaRun run(q, k, v);
  run.task.scale = 0.5f;
  ASSERT_TRUE(RunSdpa(run.task).ok());
  const double a = std::exp(0.5) / (std::exp(0.5) + 1.0), b = 1.0 - a;
  ExpectNear(AsFloats(run.weights), {a, b, b, a});
  ExpectNear(AsFloats(run.out), {a * 1 + b * 3, a * 2 + b * 4, b * 1 + a * 3, b * 2 + a * 4});
}

TEST(ReferenceEngineTest, DefaultScaleIsInverseSqrtHeadDim) {
  // One query, two keys; q.k0 = 4, q.k1 = 0, head_dim 4 -> scale 1/2 -> the
  // scores are [2, 0].
  const Tensor q = Values(DType::kFloat32, {1, 1, 1, 4}, {1, 1, 1, 1});
  const Tensor k = Values(DType::kFloat32, {1, 1, 2, 4}, {1, 1, 1, 1, 0, 0, 0, 0});
  const Tensor v = Values(DType::kFloat32, {1, 1, 2, 1}, {10, 20});
  SdpaRun run(q, k, v);
  ASSERT_TRUE(RunSdpa(run.task).ok());
  const double a = std::exp(2.0) / (std::exp(2.0) + 1.0);
  ExpectNear(AsFloats(run.weights), {a, 1 - a});
  ExpectNear(AsFloats(run.out), {10 * a + 20 * (1 - a)}, 1e-5);
}

TEST(ReferenceEngineTest, AdditiveMasksOfEachDType) {
  // Zero scores plus a mask of [0, 1] give weights [1, e] / (1 + e).
  const Tensor q = Values(DType::kFloat32, {1, 1, 1, 2}, {0, 0});
  const Tensor k = Values(DType::kFloat32, {1, 1, 2, 2}, {1, 2, 3, 4});
  const Tensor v = Values(DType::kFloat32, {1, 1, 2, 1}, {1, -1});
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const Tensor mask = Values(dt, {1, 2}, {0, 1});
    SdpaRun run(q, k, v);
    run.task.attn_mask = mask.view();
    ASSERT_TRUE(RunSdpa(run.task).ok());
    const double e = std::exp(1.0);
    ExpectNear(AsFloats(run.weights), {1 / (1 + e), e / (1 + e)});
    ExpectNear(AsFloats(run.out), {(1 - e) / (1 + e)});
  }
}

TEST(ReferenceEngineTest, CausalIsBottomRightAligned) {
  // All scores 0, so visible keys share the weight equally.
  const Tensor v2 = Values(DType::kFloat32, {1, 1, 2, 1}, {2, 4});
  {
    // Lq = 3 > Lk = 2: query i sees j <= i - 1; row 0 sees nothing.
    const Tensor q = Values(DType::kFloat32, {1, 1, 3, 1}, {0, 0, 0});
    const Tensor k = Values(DType::kFloat32, {1, 1, 2, 1}, {0, 0});
    SdpaRun run(q, k, v2);
    run.task.causal = true;
    ASSERT_TRUE(RunSdpa(run.task).ok());
    ExpectNear(AsFloats(run.weights), {0, 0, 1, 0, 0.5, 0.5});
    ExpectNear(AsFloats(run.out), {0, 2, 3});
  }
  {
    // Lq = 2 < Lk = 3: query i sees j <= i + 1.
    const Tensor q = Values(DType::kFloat32, {1, 1, 2, 1}, {0, 0});
    const Tensor k = Values(DType::kFloat32, {1, 1, 3, 1}, {0, 0, 0});
    const Tensor v3 = Values(DType::kFloat32, {1, 1, 3, 1}, {3, 6, 9});
    SdpaRun run(q, k, v3);
    run.task.causal = true;
    ASSERT_TRUE(RunSdpa(run.task).ok());
    ExpectNear(AsFloats(run.weights), {0.5, 0.5, 0, 1. / 3, 1. / 3, 1. / 3});
    ExpectNear(AsFloats(run.out), {4.5, 6}, 1e-5);
  }
}

TEST(ReferenceEngineTest, KeyLengthsPadAndZeroLengthGivesZeros) {
  const Tensor q = Random({2, 1, 2, 3}, 1);
  const Tensor k = Random({2, 1, 3, 3}, 2);
  const Tensor v = Random({2, 1, 3, 2}, 3);
  const int64_t lengths[] = {1, 0};
  SdpaRun run(q, k, v);
  run.task.key_lengths = lengths;
  ASSERT_TRUE(RunSdpa(run.task).ok());
  const std::vector<float> w = AsFloats(run.weights);  // [2, 1, 2, 3]
  const std::vector<float> o = AsFloats(run.out);      // [2, 1, 2, 2]
  const std::vector<float> vv = AsFloats(v);
  for (int i = 0; i < 2; ++i) {
    // Batch 0 sees key 0 only: weight 1, output = v[0, 0, 0, :].
    EXPECT_EQ(w[i * 3 + 0], 1.0f);
    EXPECT_EQ(w[i * 3 + 1], 0.0f);
    EXPECT_EQ(w[i * 3 + 2], 0.0f);
    EXPECT_FLOAT_EQ(o[i * 2 + 0], vv[0]);
    EXPECT_FLOAT_EQ(o[i * 2 + 1], vv[1]);
  }
  for (int i = 6; i < 12; ++i) EXPECT_EQ(w[i], 0.0f);  // batch 1: nothing
  for (int i = 4; i < 8; ++i) EXPECT_EQ(o[i], 0.0f);
}

TEST(ReferenceEngineTest, FullyMaskedRowsAreZeroNotNaN) {
  const Tensor q = Random({1, 2, 2, 4}, 4);
  const Tensor k = Random({1, 2, 3, 4}, 5);
  const Tensor v = Random({1, 2, 3, 4}, 6);
  // Row 0 of every head masked out entirely; row 1 sees keys 0 and 2.
  const Tensor bool_mask = Values(DType::kBool, {2, 3}, {0, 0, 0, 1, 0, 1});
  // The same through an additive mask of -inf.
  const Tensor add_mask = Values(DType::kFloat32, {2, 3}, {-kInf, -kInf, -kInf, 0, -kInf, 0});
  std::vector<float> outs[2], weights[2];
  int n = 0;
  for (const Tensor* mask : {&bool_mask, &add_mask}) {
    SdpaRun run(q, k, v);
    run.task.attn_mask = mask->view();
    ASSERT_TRUE(RunSdpa(run.task).ok());
    outs[n] = AsFloats(run.out);
    weights[n] = AsFloats(run.weights);
    for (int h = 0; h < 2; ++h) {
      for (int d = 0; d < 4; ++d) EXPECT_EQ(outs[n][(h * 2 + 0) * 4 + d], 0.0f);
      for (int j = 0; j < 3; ++j) EXPECT_EQ(weights[n][(h * 2 + 0) * 3 + j], 0.0f);
      EXPECT_EQ(weights[n][(h * 2 + 1) * 3 + 1], 0.0f);
      EXPECT_NEAR(weights[n][(h * 2 + 1) * 3 + 0] + weights[n][(h * 2 + 1) * 3 + 2], 1.0,
                  1e-6);
    }
    for (float x : outs[n]) EXPECT_FALSE(std::isnan(x));
    ++n;
  }
  EXPECT_EQ(outs[0], outs[1]);
  EXPECT_EQ(weights[0], weights[1]);
}

TEST(ReferenceEngineTest, GroupedQueryEqualsRepeatedKeysAndValues) {
  // Hq = 4 over Hkv = 2: query head h reads kv head h / 2.
  const Tensor q = Random({2, 4, 3, 5}, 7);
  const Tensor k = Random({2, 2, 4, 5}, 8);
  const Tensor v = Random({2, 2, 4, 6}, 9);
  Tensor k_rep(DType::kFloat32, {2, 4, 4, 5}), v_rep(DType::kFloat32, {2, 4, 4, 6});
  for (int b = 0; b < 2; ++b)
    for (int h = 0; h < 4; ++h) {
      std::memcpy(k_rep.data_as<float>() + (b * 4 + h) * 20, k.data_as<float>() + (b * 2 + h / 2) * 20,
                  20 * sizeof(float));
      std::memcpy(v_rep.data_as<float>() + (b * 4 + h) * 24, v.data_as<float>() + (b * 2 + h / 2) * 24,
                  24 * sizeof(float));
    }
  SdpaRun gqa(q, k, v), mha(q, k_rep, v_rep);
  ASSERT_TRUE(RunSdpa(gqa.task).ok());
  ASSERT_TRUE(RunSdpa(mha.task).ok());
  EXPECT_EQ(AsFloats(gqa.out), AsFloats(mha.out));
  EXPECT_EQ(AsFloats(gqa.weights), AsFloats(mha.weights));
}

TEST(ReferenceEngineTest, AveragedWeightsAreTheMeanOverHeads) {
  const Tensor q = Random({1, 3, 2, 4}, 10);
  const Tensor k = Random({1, 3, 5, 4}, 11);
  const Tensor v = Random({1, 3, 5, 4}, 12);
  SdpaRun per_head(q, k, v), averaged(q, k, v, true, /*average=*/true);
  ASSERT_TRUE(RunSdpa(per_head.task).ok());
  ASSERT_TRUE(RunSdpa(averaged.task).ok());
  const std::vector<float> w = AsFloats(per_head.weights), avg = AsFloats(averaged.weights);
  ASSERT_EQ(avg.size(), 10u);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 5; ++j) {
      const double mean = (w[(0 * 2 + i) * 5 + j] + w[(1 * 2 + i) * 5 + j] +
                           w[(2 * 2 + i) * 5 + j]) / 3.0;
      EXPECT_NEAR(avg[i * 5 + j], mean, 1e-6);
    }
  EXPECT_EQ(AsFloats(per_head.out), AsFloats(averaged.out));
}

TEST(ReferenceEngineTest, OutputIsRoundedToItsDType) {
  const Tensor q = Random({1, 2, 3, 4}, 13);
  const Tensor k = Random({1, 2, 3, 4}, 14);
  const Tensor v = Random({1, 2, 3, 4}, 15);
  SdpaRun f32(q, k, v, false);
  ASSERT_TRUE(RunSdpa(f32.task).ok());
  const std::vector<float> exact = AsFloats(f32.out);
  for (DType dt : {DType::kFloat16, DType::kBFloat16}) {
    SdpaRun low(q, k, v, false, false, dt);
    ASSERT_TRUE(RunSdpa(low.task).ok());
    Tensor rounded = Values(dt, f32.out.shape(), exact);
    EXPECT_EQ(std::memcmp(rounded.data(), low.out.data(), rounded.byte_size()), 0);
  }
}

TEST(ReferenceEngineTest, HalfInputsAreReadExactly) {
  // Values exactly representable in fp16 and bf16 give the fp32 result.
  const Tensor q = Values(DType::kFloat32, {1, 1, 2, 2}, {1, 0.5, -2, 0.25});
  const Tensor k = Values(DType::kFloat32, {1, 1, 2, 2}, {0.75, 1, 1, -1});
  const Tensor v = Values(DType::kFloat32, {1, 1, 2, 2}, {1, 2, 3, 4});
  SdpaRun f32(q, k, v);
  ASSERT_TRUE(RunSdpa(f32.task).ok());
  for (DType dt : {DType::kFloat16, DType::kBFloat16}) {
    const Tensor qh = Values(dt, q.shape(), AsFloats(q));
    const Tensor kh = Values(dt, k.shape(), AsFloats(k));
    const Tensor vh = Values(dt, v.shape(), AsFloats(v));
    SdpaRun low(qh, kh, vh);
    ASSERT_TRUE(RunSdpa(low.task).ok());
    EXPECT_EQ(AsFloats(low.out), AsFloats(f32.out));
  }
}

// A 1-head projection layer with identity weights is bare attention on the
// inputs; biases and scaled weights then act exactly as written.
TEST(ReferenceEngineTest, ProjectionsCompose) {
  AttentionLayer layer;
  layer.config.name = "identity";
  layer.config.has_projections = true;
  layer.config.embed_dim = 3;
  layer.config.num_heads = layer.config.num_kv_heads = 1;
  layer.config.head_dim = 3;
  layer.config.query_dim = layer.config.key_dim = layer.config.value_dim = 3;
  layer.config.out_dim = 3;
  const std::vector<float> eye = {1, 0, 0, 0, 1, 0, 0, 0, 1};
  layer.weights.wq = Values(DType::kFloat32, {3, 3}, eye);
  layer.weights.wk = Values(DType::kFloat32, {3, 3}, eye);
  layer.weights.wv = Values(DType::kFloat32, {3, 3}, {2, 0, 0, 0, 2, 0, 0, 0, 2});
  layer.weights.wo = Values(DType::kFloat32, {3, 3}, eye);
  layer.weights.bo = Values(DType::kFloat32, {3}, {1, -1, 0.5});
  ASSERT_TRUE(ValidateLayer(layer).ok());

  const Tensor x = Random({2, 4, 3}, 16);  // [B, L, 3] == [B, 1, L, 3] as heads
  const Tensor x_heads = Values(DType::kFloat32, {2, 1, 4, 3}, AsFloats(x));
  SdpaRun bare(x_heads, x_heads, x_heads);  // keeps views: x_heads must outlive it
  ASSERT_TRUE(RunSdpa(bare.task).ok());
  const std::vector<float> attended = AsFloats(bare.out);

  std::unique_ptr<AttentionEngine> engine = NewReferenceEngine();
  for (bool self_attention : {true, false}) {
    Tensor out(DType::kFloat32, {2, 4, 3});
    AttentionTask task;
    task.query = x.view();
    if (!self_attention) {
      task.key = x.view();
      task.value = x.view();
    }
    task.scale = ResolveScale(layer.config, 0.0f, 3);
    task.output = out.mutable_view();
    ASSERT_TRUE(engine->Run(layer, {&task, 1}).ok());
    const std::vector<float> y = AsFloats(out);
    const float bias[] = {1, -1, 0.5};
    for (size_t i = 0; i < y.size(); ++i) {
      EXPECT_NEAR(y[i], 2.0 * attended[i] + bias[i % 3], 1e-6) << i;
    }
  }
}

TEST(ReferenceEngineTest, RejectsMismatchedOutput) {
  const Tensor q = Random({1, 2, 3, 4}, 17);
  SdpaRun run(q, q, q);
  Tensor wrong(DType::kFloat32, {1, 2, 3, 5});
  run.task.output = wrong.mutable_view();
  const absl::Status s = RunSdpa(run.task);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("output"));
}

TEST(CreateEngineTest, Names) {
  absl::StatusOr<std::unique_ptr<AttentionEngine>> e = CreateEngine("reference");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ((*e)->name(), "reference");
  e = CreateEngine("cpu");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ((*e)->name(), "cpu");
  // "auto" is cuda where a GPU is usable, else cpu; "cuda" without one is
  // Unavailable.
  absl::StatusOr<std::unique_ptr<AttentionEngine>> cuda = CreateEngine("cuda");
  if (!cuda.ok()) {
    EXPECT_EQ(cuda.status().code(), absl::StatusCode::kUnavailable) << cuda.status();
  }
  e = CreateEngine("auto");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ((*e)->name(), cuda.ok() ? "cuda" : "cpu");
  EXPECT_EQ(CreateEngine("tpu").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace attnserve

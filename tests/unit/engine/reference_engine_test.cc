// Tests for the reference backend against cases worked out by hand (softmax
// of known scores), plus the structural identities it must satisfy: GQA
// equals repeated K/V, fully masked rows give zeros, projections compose.
#include "engine/reference/reference_engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/attention_engine.h"
#include "engine/qk_norm.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::AllOf;
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

float InverseSqrt(int64_t head_dim) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
}

// An sdpa task over q/k/v with outputs allocated to match.
struct SdpaRun {
  Tensor out, weights;
  AttentionTask task;

  // Default scale 1/sqrt(Dk); output [B, Hq, Lq, Dv]; weights [B, Hq, Lq, Lk]
  // or [B, Lq, Lk].
  SdpaRun(const Tensor& q, const Tensor& k, const Tensor& v, bool need_weights = true,
          bool average = false, DType out_dtype = DType::kFloat32) {
    task.query = q.view();
    task.key = k.view();
    task.value = v.view();
    const Shape& qs = q.shape();
    task.scale = InverseSqrt(qs[3]);
    out = Tensor(out_dtype, {qs[0], qs[1], qs[2], v.shape()[3]});
    task.output = out.mutable_view();
    if (need_weights) {
      const int64_t lk = k.shape()[2];
      weights = Tensor(DType::kFloat32, average ? Shape{qs[0], qs[2], lk}
                                                : Shape{qs[0], qs[1], qs[2], lk});
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
    task.scale = InverseSqrt(3);
    task.output = out.mutable_view();
    ASSERT_TRUE(engine->Run(layer, {&task, 1}).ok());
    const std::vector<float> y = AsFloats(out);
    const float bias[] = {1, -1, 0.5};
    for (size_t i = 0; i < y.size(); ++i) {
      EXPECT_NEAR(y[i], 2.0 * attended[i] + bias[i % 3], 1e-6) << i;
    }
  }
}

// The oracle's oracle: attention over doubles written the way NumPy would do
// it, over whole [B, Hq, Lq, Lk] score arrays. A mask's shape is padded with
// leading 1s to rank 4 and read at index (b % mb, h % mh, i % mi, j % mj),
// which repeats each dim of size 1. Returns the output [B, Hq, Lq, Dv] and the
// weights [B, Hq, Lq, Lk].
struct Naive {
  std::vector<double> out, weights;
};

struct NaiveOptions {
  double scale = 0.0;  // 0: 1/sqrt(Dk)
  bool causal = false;
  std::vector<int64_t> key_lengths;
  const Tensor* mask = nullptr;
};

// q [B, Hq, Lq, Dk], k [B, Hkv, Lk, Dk], v [B, Hkv, Lk, Dv] as doubles.
Naive NaiveAttention(const std::vector<double>& q, const std::vector<double>& k,
                     const std::vector<double>& v, int64_t B, int64_t Hq, int64_t Hkv,
                     int64_t Lq, int64_t Lk, int64_t Dk, int64_t Dv, const NaiveOptions& o) {
  const double scale = o.scale != 0.0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(Dk));
  Shape ms = {1, 1, 1, 1};
  std::vector<float> mask;
  if (o.mask != nullptr) {
    const Shape& m = o.mask->shape();
    std::copy(m.begin(), m.end(), ms.end() - static_cast<int64_t>(m.size()));
    mask = AsFloats(*o.mask);
  }
  Naive r{std::vector<double>(B * Hq * Lq * Dv, 0.0), std::vector<double>(B * Hq * Lq * Lk, 0.0)};
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < Hq; ++h)
      for (int64_t i = 0; i < Lq; ++i) {
        std::vector<double> s(Lk, -kInf);
        for (int64_t j = 0; j < Lk; ++j) {
          const int64_t at =
              ((b % ms[0] * ms[1] + h % ms[1]) * ms[2] + i % ms[2]) * ms[3] + j % ms[3];
          const float m = mask.empty() ? 0.0f : mask[at];
          const bool allowed = (!o.causal || j - i <= Lk - Lq) &&
                               (o.key_lengths.empty() || j < o.key_lengths[b]) &&
                               !(o.mask != nullptr && o.mask->dtype() == DType::kBool && m == 0);
          if (!allowed) continue;
          double dot = 0.0;
          for (int64_t c = 0; c < Dk; ++c) {
            dot += q[((b * Hq + h) * Lq + i) * Dk + c] *
                   k[((b * Hkv + h * Hkv / Hq) * Lk + j) * Dk + c];
          }
          s[j] = dot * scale + (o.mask != nullptr && o.mask->dtype() != DType::kBool ? m : 0.0);
        }
        const double max = *std::max_element(s.begin(), s.end());
        if (max == -kInf) continue;  // nothing visible: zeros
        double sum = 0.0;
        for (double& x : s) sum += (x = std::exp(x - max));
        for (int64_t j = 0; j < Lk; ++j) {
          const double p = s[j] / sum;
          r.weights[((b * Hq + h) * Lq + i) * Lk + j] = p;
          for (int64_t c = 0; c < Dv; ++c) {
            r.out[((b * Hq + h) * Lq + i) * Dv + c] +=
                p * v[((b * Hkv + h * Hkv / Hq) * Lk + j) * Dv + c];
          }
        }
      }
  return r;
}

std::vector<double> AsDoubles(const Tensor& t) {
  const std::vector<float> f = AsFloats(t);
  return {f.begin(), f.end()};
}

// [B, Hq, Lq, Lk] -> the mean over heads [B, Lq, Lk].
std::vector<double> MeanOverHeads(const std::vector<double>& w, int64_t B, int64_t H, int64_t Lq,
                                  int64_t Lk) {
  std::vector<double> mean(B * Lq * Lk, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Lq * Lk; ++i) {
        mean[b * Lq * Lk + i] += w[(b * H + h) * Lq * Lk + i] / H;
      }
  return mean;
}

// Tolerance: both sides are double; the engine rounds once to fp32.
void ExpectClose(const std::vector<float>& got, const std::vector<double>& want,
                 const std::string& label) {
  ASSERT_EQ(got.size(), want.size()) << label;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-6 * std::max(1.0, std::fabs(want[i]))) << label << " at " << i;
  }
}

TEST(ReferenceEngineTest, MatchesNaiveAttentionOverEveryMaskShape) {
  constexpr int64_t B = 2, Hq = 4, Hkv = 2, Lq = 3, Lk = 5, Dk = 6, Dv = 3;
  const std::vector<Shape> mask_shapes = {
      {Lq, Lk}, {1, Lk}, {Lq, 1}, {Hq, 1, Lk}, {1, Lq, Lk}, {B, 1, Lq, Lk}, {1, Hq, Lq, Lk},
      {B, Hq, Lq, Lk}, {B, 1, 1, 1}};
  uint32_t seed = 100;
  for (DType in : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    // Inputs rounded to `in` once; the naive side reads the rounded values.
    const Tensor q = Values(in, {B, Hq, Lq, Dk}, AsFloats(Random({B, Hq, Lq, Dk}, ++seed)));
    const Tensor k = Values(in, {B, Hkv, Lk, Dk}, AsFloats(Random({B, Hkv, Lk, Dk}, ++seed)));
    const Tensor v = Values(in, {B, Hkv, Lk, Dv}, AsFloats(Random({B, Hkv, Lk, Dv}, ++seed)));
    for (const Shape& shape : mask_shapes) {
      for (DType mask_dtype : {DType::kBool, DType::kFloat16}) {
        for (int options = 0; options < 4; ++options) {
          Tensor mask(mask_dtype, shape);
          const Tensor values = Random(shape, ++seed);
          for (int64_t i = 0; i < mask.num_elements(); ++i) {
            const float x = values.data_as<float>()[i];
            const float m = mask_dtype == DType::kBool ? x > -0.5f : 3 * x;
            StoreFromFloat(mask_dtype, mask.data(), i, m);
          }
          NaiveOptions o;
          o.mask = &mask;
          o.causal = options & 1;
          if (options & 2) o.key_lengths = {Lk - 1, 2};
          o.scale = options == 3 ? 0.3 : 0.0;
          const bool average = options == 2;
          SdpaRun run(q, k, v, /*need_weights=*/true, average);
          run.task.attn_mask = mask.view();
          run.task.causal = o.causal;
          run.task.key_lengths = o.key_lengths;
          if (o.scale != 0.0) run.task.scale = 0.3f;
          o.scale = run.task.scale;
          ASSERT_TRUE(RunSdpa(run.task).ok()) << ShapeString(shape);
          const Naive want = NaiveAttention(AsDoubles(q), AsDoubles(k), AsDoubles(v), B, Hq, Hkv,
                                            Lq, Lk, Dk, Dv, o);
          const std::string label =
              absl::StrCat("in ", std::string(DTypeName(in)), ", mask ",
                           std::string(DTypeName(mask_dtype)), ShapeString(shape), ", options ",
                           options);
          ExpectClose(AsFloats(run.out), want.out, label);
          ExpectClose(AsFloats(run.weights),
                      average ? MeanOverHeads(want.weights, B, Hq, Lq, Lk) : want.weights, label);
        }
      }
    }
  }
}

// y = x W^T + b over doubles for x [rows, in], W [out, in].
std::vector<double> NaiveLinear(const std::vector<double>& x, int64_t rows, const Tensor& w,
                                const Tensor& bias) {
  const int64_t out = w.shape()[0], in = w.shape()[1];
  const std::vector<double> wd = AsDoubles(w);
  const std::vector<double> bd = bias.byte_size() != 0 ? AsDoubles(bias) : std::vector<double>();
  std::vector<double> y(rows * out);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < out; ++n) {
      double acc = bd.empty() ? 0.0 : bd[n];
      for (int64_t c = 0; c < in; ++c) acc += x[r * in + c] * wd[n * in + c];
      y[r * out + n] = acc;
    }
  return y;
}

// [B, L, H * D] -> [B, H, L, D], and back when `inverse`.
std::vector<double> Transpose12(const std::vector<double>& x, int64_t B, int64_t L, int64_t H,
                                int64_t D, bool inverse = false) {
  std::vector<double> y(x.size());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < D; ++d) {
          const int64_t token = ((b * L + l) * H + h) * D + d, head = ((b * H + h) * L + l) * D + d;
          (inverse ? y[token] : y[head]) = inverse ? x[head] : x[token];
        }
  return y;
}

// Runs `layer` (a bare sdpa layer) on random inputs of Lq queries over Lk
// keys, and expects the same output and weights bitwise as an explicit bool
// mask whose entry (i, j) is allowed(query position i + Lk - Lq, key j).
void ExpectSameAsBoolMask(const AttentionLayer& layer, int64_t lq, int64_t lk,
                          const std::function<bool(int64_t, int64_t)>& allowed) {
  const Tensor q = Random({2, 2, lq, 4}, 800), k = Random({2, 2, lk, 4}, 801);
  const Tensor v = Random({2, 2, lk, 5}, 802);
  ASSERT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);
  SdpaRun run(q, k, v);
  run.task.causal = layer.config.causal;
  ASSERT_TRUE(NewReferenceEngine()->Run(layer, {&run.task, 1}).ok());
  std::vector<float> visible(static_cast<size_t>(lq * lk));
  for (int64_t i = 0; i < lq; ++i) {
    for (int64_t j = 0; j < lk; ++j) visible[i * lk + j] = allowed(i + lk - lq, j);
  }
  const Tensor mask = Values(DType::kBool, {lq, lk}, visible);
  SdpaRun masked(q, k, v);
  masked.task.attn_mask = mask.view();
  ASSERT_TRUE(RunSdpa(masked.task).ok());
  const std::string label =
      absl::StrCat("causal ", layer.config.causal, " Lq ", lq, " Lk ", lk);
  EXPECT_EQ(AsFloats(run.out), AsFloats(masked.out)) << label;
  EXPECT_EQ(AsFloats(run.weights), AsFloats(masked.weights)) << label;
}

// Chunked attention (Llama 4) is a causal mask that also hides every key
// before the query's chunk: the same as a bool mask of transformers' rule
// (key j and query position p in the same chunk of 3, j <= p), Lq < Lk too.
TEST(ReferenceEngineTest, ChunkedAttentionIsTransformersChunkedMask) {
  constexpr int64_t kChunk = 3;
  AttentionLayer chunked;
  chunked.config.name = "chunked";
  chunked.config.causal = true;
  chunked.config.attention_chunk = kChunk;
  for (const auto& [lq, lk] : {std::pair<int64_t, int64_t>{7, 7}, {4, 11}}) {
    ExpectSameAsBoolMask(chunked, lq, lk, [&](int64_t p, int64_t j) {
      return j <= p && j / kChunk == p / kChunk;
    });
  }
  AttentionLayer not_causal;
  not_causal.config.name = "chunked";
  not_causal.config.attention_chunk = kChunk;
  EXPECT_THAT(std::string(ValidateLayer(not_causal).message()),
              ::testing::HasSubstr("only on a causal layer"));
}

// A sliding window without causal is two-sided: the same as a bool mask of
// |j - p| < window (EmbeddingGemma's rule), Lq < Lk too; with causal the
// same window keeps only the keys up to p.
TEST(ReferenceEngineTest, WindowWithoutCausalIsTwoSided) {
  constexpr int64_t kWindow = 3;
  for (const bool causal : {false, true}) {
    AttentionLayer windowed;
    windowed.config.name = "windowed";
    windowed.config.causal = causal;
    windowed.config.sliding_window = kWindow;
    for (const auto& [lq, lk] : {std::pair<int64_t, int64_t>{7, 7}, {4, 11}}) {
      ExpectSameAsBoolMask(windowed, lq, lk, [&](int64_t p, int64_t j) {
        return std::abs(j - p) < kWindow && (!causal || j <= p);
      });
    }
  }
}

// ALiBi as BLOOM computes it: a float mask [1, H, 1, Lk] of slope_h * j
// added to the scaled scores. The engine adds slope_h * (j - p) instead, a
// constant per row away, so outputs and weights agree to rounding; with and
// without causal, Lq < Lk, slopes of both signs, need_weights.
TEST(ReferenceEngineTest, AlibiIsBloomsLinearBiasOfTheKeyIndex) {
  const std::vector<float> slopes = {0.5f, 0.125f, -0.25f};
  for (const bool causal : {false, true}) {
    for (const auto& [lq, lk] : {std::pair<int64_t, int64_t>{6, 6}, {3, 9}}) {
      const Tensor q = Random({2, 3, lq, 4}, 900), k = Random({2, 3, lk, 4}, 901);
      const Tensor v = Random({2, 3, lk, 5}, 902);
      AttentionLayer alibi;
      alibi.config.name = "alibi";
      alibi.config.alibi_slopes = slopes;
      ASSERT_TRUE(ValidateLayer(alibi).ok()) << ValidateLayer(alibi);
      SdpaRun run(q, k, v);
      run.task.causal = causal;
      ASSERT_TRUE(NewReferenceEngine()->Run(alibi, {&run.task, 1}).ok());
      std::vector<float> bias;
      for (const float slope : slopes) {
        for (int64_t j = 0; j < lk; ++j) bias.push_back(slope * static_cast<float>(j));
      }
      const Tensor mask = Values(DType::kFloat32, {1, 3, 1, lk}, bias);
      SdpaRun bloom(q, k, v);
      bloom.task.causal = causal;
      bloom.task.attn_mask = mask.view();
      ASSERT_TRUE(RunSdpa(bloom.task).ok());
      const std::string label = absl::StrCat("causal ", causal, " Lq ", lq, " Lk ", lk);
      const std::vector<float> out = AsFloats(run.out), want = AsFloats(bloom.out);
      const std::vector<float> w = AsFloats(run.weights), want_w = AsFloats(bloom.weights);
      for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], want[i], 1e-6) << label;
      for (size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(w[i], want_w[i], 1e-6) << label;
      // And the bias is there: without it the weights differ.
      SdpaRun plain(q, k, v);
      plain.task.causal = causal;
      ASSERT_TRUE(RunSdpa(plain.task).ok());
      EXPECT_NE(AsFloats(plain.weights), w) << label;
    }
  }
  AttentionLayer wrong;
  wrong.config.name = "alibi";
  wrong.config.alibi_slopes = {0.5f, std::numeric_limits<float>::quiet_NaN()};
  EXPECT_THAT(std::string(ValidateLayer(wrong).message()), HasSubstr("alibi_slopes[1]"));
  wrong.config.alibi_slopes = slopes;  // 3 slopes, 2 query heads
  SdpaRun two_heads(Random({1, 2, 3, 4}, 1), Random({1, 2, 3, 4}, 2), Random({1, 2, 3, 4}, 3));
  EXPECT_THAT(std::string(NewReferenceEngine()->Run(wrong, {&two_heads.task, 1}).message()),
              HasSubstr("alibi_slopes"));
}

// T5's bucket of the relative position r = j - p (transformers'
// T5Attention._relative_position_bucket, its log in float as torch's): exact
// below buckets / 4 (bidirectional) or / 2, then logarithmic up to
// max_distance, one bucket from there on.
int64_t T5Bucket(int64_t r, bool bidirectional, int64_t buckets, int64_t max_distance) {
  int64_t bucket = 0;
  if (bidirectional) {
    buckets /= 2;
    if (r > 0) bucket += buckets;
    r = std::abs(r);
  } else {
    r = -std::min<int64_t>(r, 0);
  }
  const int64_t exact = buckets / 2;
  if (r < exact) return bucket + r;
  const float ratio = std::log(static_cast<float>(r) / static_cast<float>(exact)) /
                      static_cast<float>(std::log(static_cast<double>(max_distance) / exact));
  const int64_t large = exact + static_cast<int64_t>(ratio * static_cast<float>(buckets - exact));
  return bucket + std::min(large, buckets - 1);
}

// A relative position bias (T5, MPNet) is T5's: each head's learned value
// of the bucket of j - p, here a float mask built from T5's bucket rule and
// a bucket table, against the layer with the table written out per distance
// up to max_distance. Encoder (bidirectional) and decoder (causal, Lq < Lk:
// queries after cached keys) buckets, sequences past max_distance both
// ways, with and without weights; and the layer check's rules.
TEST(ReferenceEngineTest, RelativeBiasIsT5sBucketedBias) {
  constexpr int64_t H = 3, D = 4, E = 8, kBuckets = 16, kMaxDistance = 12;
  const Tensor embedding = Random({kBuckets, H}, 950);  // T5's nn.Embedding
  for (const bool decoder : {false, true}) {
    AttentionLayer layer;
    LayerConfig& c = layer.config;
    c.name = decoder ? "t5-decoder" : "t5-encoder";
    c.has_projections = true;
    c.num_heads = c.num_kv_heads = H;
    c.head_dim = D;
    c.query_dim = c.key_dim = c.value_dim = c.out_dim = E;
    c.scale = 1.0f;  // T5 does not scale its scores
    c.causal = decoder;
    LayerWeights& w = layer.weights;
    w.wq = Random({H * D, E}, 951);
    w.wk = Random({H * D, E}, 952);
    w.wv = Random({H * D, E}, 953);
    w.wo = Random({E, H * D}, 954);
    AttentionLayer plain = layer;  // the same layer with T5's bias as a mask
    c.relative_bias_distance = kMaxDistance;
    std::vector<float> table;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t r = -kMaxDistance; r <= kMaxDistance; ++r) {
        table.push_back(embedding.data_as<float>()[T5Bucket(r, !decoder, kBuckets,
                                                            kMaxDistance) * H + h]);
      }
    }
    w.relative_bias = Values(DType::kFloat32, {H, 2 * kMaxDistance + 1}, table);
    ASSERT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);
    for (const auto& [lq, lk] : {std::pair<int64_t, int64_t>{30, 30}, {5, 31}}) {
      if (!decoder && lq != lk) continue;  // an encoder attends over its own tokens
      const Tensor xq = Random({2, lq, E}, 955), xkv = Random({2, lk, E}, 956);
      std::vector<float> bias;
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < lq; ++i) {
          for (int64_t j = 0; j < lk; ++j) {
            const int64_t r = j - (i + lk - lq);
            bias.push_back(
                embedding.data_as<float>()[T5Bucket(r, !decoder, kBuckets, kMaxDistance) * H + h]);
          }
        }
      }
      const Tensor mask = Values(DType::kFloat32, {1, H, lq, lk}, bias);
      std::vector<float> outs[2], weights[2];
      for (int run = 0; run < 2; ++run) {
        Tensor out(DType::kFloat32, {2, lq, E}), probs(DType::kFloat32, {2, H, lq, lk});
        AttentionTask task;
        task.query = xq.view();
        if (lq != lk) {
          task.key = xkv.view();
          task.value = xkv.view();
        }
        task.causal = decoder;
        task.output = out.mutable_view();
        task.weights = probs.mutable_view();
        if (run == 1) task.attn_mask = mask.view();
        ASSERT_TRUE(NewReferenceEngine()->Run(run == 0 ? layer : plain, {&task, 1}).ok());
        outs[run] = AsFloats(out);
        weights[run] = AsFloats(probs);
      }
      const std::string label = absl::StrCat(c.name, " Lq ", lq, " Lk ", lk);
      for (size_t i = 0; i < outs[0].size(); ++i) {
        EXPECT_NEAR(outs[0][i], outs[1][i], 1e-5) << label;
      }
      for (size_t i = 0; i < weights[0].size(); ++i) {
        EXPECT_NEAR(weights[0][i], weights[1][i], 1e-6) << label;
      }
    }
  }
  AttentionLayer wrong;
  wrong.config.name = "t5";
  wrong.config.has_projections = true;
  wrong.config.num_heads = wrong.config.num_kv_heads = 1;
  wrong.config.head_dim = 2;
  wrong.config.query_dim = wrong.config.key_dim = wrong.config.value_dim = 2;
  wrong.config.out_dim = 2;
  wrong.weights.wq = wrong.weights.wk = wrong.weights.wv = wrong.weights.wo = Random({2, 2}, 1);
  wrong.config.relative_bias_distance = 2;
  wrong.weights.relative_bias = Random({1, 4}, 2);
  EXPECT_THAT(std::string(ValidateLayer(wrong).message()),
              AllOf(HasSubstr("relative_bias"), HasSubstr("[1, 5]"), HasSubstr("[1, 4]")));
  wrong.weights.relative_bias = Values(DType::kFloat32, {1, 5}, {0, 1, kInf, 3, 4});
  EXPECT_THAT(std::string(ValidateLayer(wrong).message()), HasSubstr("relative_bias[0][2]"));
  wrong.config.relative_bias_distance = 0;
  EXPECT_THAT(std::string(ValidateLayer(wrong).message()),
              HasSubstr("without relative_bias_distance"));
  wrong.config.relative_bias_distance = kMaxRelativeBiasDistance + 1;
  EXPECT_THAT(std::string(ValidateLayer(wrong).message()), HasSubstr("65536"));
  AttentionLayer bare;  // a layer without projections takes none
  bare.config.name = "sdpa";
  bare.config.relative_bias_distance = 2;
  EXPECT_THAT(std::string(ValidateLayer(bare).message()), HasSubstr("projection layers only"));
}

// DeBERTa v2/v3's log bucket of a relative position r = i - j
// (make_log_bucket_position): exact up to half the buckets, then
// logarithmic up to max_position, signed.
int64_t DebertaBucket(int64_t r, int64_t buckets, int64_t max_position) {
  const int64_t mid = buckets / 2;
  if (std::abs(r) <= mid) return r;
  const double log_pos =
      std::ceil(std::log(static_cast<double>(std::abs(r)) / mid) /
                std::log(static_cast<double>(max_position - 1) / mid) * (mid - 1)) +
      mid;
  return r > 0 ? static_cast<int64_t>(log_pos) : -static_cast<int64_t>(log_pos);
}

// Relative position embeddings are DeBERTa's disentangled attention: its
// content-to-position and position-to-content scores, built here as DeBERTa
// builds them (the relative embeddings through the layer's own query and
// key projections, c2p gathered at clamp(bucket(i - j) + span), p2c gathered
// over key pairs and transposed) and added as a float mask after the scale,
// against the layer with each distance's projected vectors written out up
// to where the buckets stop changing. Self-attention over sequences past
// that reach, padded by key lengths, c2p alone, p2c alone and both, with
// and without weights; and the layer check's rules.
TEST(ReferenceEngineTest, RelativeEmbeddingsAreDebertasDisentangledAttention) {
  constexpr int64_t H = 3, D = 4, E = 8, kSpan = 8, kMaxPosition = 16, L = 40, B = 2;
  const Tensor rel = Random({2 * kSpan, E}, 960);  // the encoder's rel_embeddings
  auto column = [](int64_t r) {  // r = i - j's row of the gathered tables
    return std::clamp<int64_t>(DebertaBucket(r, kSpan, kMaxPosition) + kSpan, 0, 2 * kSpan - 1);
  };
  int64_t reach = 1;  // every |i - j| >= reach in the first or last row
  for (int64_t r = 2; r < 1000; ++r) {
    if (column(r) != column(r - 1) || column(-r) != column(1 - r)) reach = r;
  }
  ASSERT_LT(reach, L - 1);  // the sequences go past it both ways
  AttentionLayer layer;
  LayerConfig& c = layer.config;
  c.name = "deberta";
  c.has_projections = true;
  c.num_heads = c.num_kv_heads = H;
  c.head_dim = D;
  c.query_dim = c.key_dim = c.value_dim = c.out_dim = E;
  c.scale = static_cast<float>(1.0 / std::sqrt(3.0 * D));
  LayerWeights& w = layer.weights;
  w.wq = Random({H * D, E}, 961);
  w.bq = Random({H * D}, 962);
  w.wk = Random({H * D, E}, 963);
  w.bk = Random({H * D}, 964);
  w.wv = Random({H * D, E}, 965);
  w.wo = Random({E, H * D}, 966);
  const AttentionLayer plain = layer;
  // Projected rows, float64: y[n][o] = sum_e x[n][e] w[o][e] + b[o].
  auto project = [&](const Tensor& x, int64_t rows, const Tensor& wt, const Tensor& bias) {
    std::vector<double> y(static_cast<size_t>(rows * H * D));
    for (int64_t n = 0; n < rows; ++n) {
      for (int64_t o = 0; o < H * D; ++o) {
        double sum = bias.data_as<float>()[o];
        for (int64_t e = 0; e < E; ++e) {
          sum += static_cast<double>(x.data_as<float>()[n * E + e]) * wt.data_as<float>()[o * E + e];
        }
        y[n * H * D + o] = sum;
      }
    }
    return y;
  };
  const std::vector<double> pos_key = project(rel, 2 * kSpan, w.wk, w.bk);  // share_att_key
  const std::vector<double> pos_query = project(rel, 2 * kSpan, w.wq, w.bq);
  // The layer's tables: column r + reach for r = j - p = -(i - j).
  auto table = [&](const std::vector<double>& pos) {
    std::vector<float> t;
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t f = 0; f < D; ++f) {
        for (int64_t r = -reach; r <= reach; ++r) {
          t.push_back(static_cast<float>(pos[column(-r) * H * D + h * D + f]));
        }
      }
    }
    return Values(DType::kFloat32, {H, D, 2 * reach + 1}, t);
  };
  const Tensor x = Random({B, L, E}, 967);
  const std::vector<double> q = project(x, B * L, w.wq, w.bq), k = project(x, B * L, w.wk, w.bk);
  auto dot = [&](const std::vector<double>& a, int64_t row, const std::vector<double>& b,
                 int64_t pos, int64_t h) {
    double sum = 0;
    for (int64_t f = 0; f < D; ++f) sum += a[row * H * D + h * D + f] * b[pos * H * D + h * D + f];
    return sum;
  };
  const std::vector<int64_t> key_lengths = {L, 27};
  for (const auto& [c2p, p2c] : {std::pair{true, true}, {true, false}, {false, true}}) {
    AttentionLayer embedded = layer;
    embedded.config.relative_embeddings = {reach, c2p, p2c};
    if (c2p) embedded.weights.relative_key = table(pos_key);
    if (p2c) embedded.weights.relative_query = table(pos_query);
    ASSERT_TRUE(ValidateLayer(embedded).ok()) << ValidateLayer(embedded);
    // DeBERTa's scores beside Q K^T, over the scale: c2p[b][h][i][j] = q_i .
    // pos_key[c(i - j)]; p2c = (k_a . pos_query[c(-(a - b))])^T.
    std::vector<float> mask;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t i = 0; i < L; ++i) {
          for (int64_t j = 0; j < L; ++j) {
            double extra = 0;
            if (c2p) extra += dot(q, b * L + i, pos_key, column(i - j), h);
            if (p2c) extra += dot(k, b * L + j, pos_query, std::clamp<int64_t>(
                                      -DebertaBucket(j - i, kSpan, kMaxPosition) + kSpan, 0,
                                      2 * kSpan - 1), h);
            mask.push_back(static_cast<float>(extra * c.scale));
          }
        }
      }
    }
    const Tensor added = Values(DType::kFloat32, {B, H, L, L}, mask);
    std::vector<float> outs[2], weights[2];
    for (int run = 0; run < 2; ++run) {
      Tensor out(DType::kFloat32, {B, L, E}), probs(DType::kFloat32, {B, H, L, L});
      AttentionTask task;
      task.query = x.view();
      task.scale = c.scale;  // as the server resolves it
      task.key_lengths = key_lengths;
      task.output = out.mutable_view();
      task.weights = probs.mutable_view();
      if (run == 1) task.attn_mask = added.view();
      ASSERT_TRUE(NewReferenceEngine()->Run(run == 0 ? embedded : plain, {&task, 1}).ok());
      outs[run] = AsFloats(out);
      weights[run] = AsFloats(probs);
    }
    const std::string label = absl::StrCat("c2p ", c2p, " p2c ", p2c);
    for (size_t i = 0; i < outs[0].size(); ++i) EXPECT_NEAR(outs[0][i], outs[1][i], 1e-5) << label;
    for (size_t i = 0; i < weights[0].size(); ++i) {
      EXPECT_NEAR(weights[0][i], weights[1][i], 1e-6) << label;
    }
  }
  AttentionLayer wrong = layer;
  wrong.config.relative_embeddings = {2, true, false};
  wrong.weights.relative_key = Random({H, D, 4}, 2);
  EXPECT_THAT(std::string(ValidateLayer(wrong).message()),
              AllOf(HasSubstr("relative_key"), HasSubstr("[3, 4, 5]"), HasSubstr("[3, 4, 4]")));
  std::vector<float> values(H * D * 5, 0.5f);
  values[5 + 2] = kInf;
  wrong.weights.relative_key = Values(DType::kFloat32, {H, D, 5}, values);
  EXPECT_THAT(std::string(ValidateLayer(wrong).message()), HasSubstr("relative_key[0][1][2]"));
  wrong.weights.relative_key = Random({H, D, 5}, 3);
  wrong.weights.relative_query = Random({H, D, 5}, 4);
  EXPECT_THAT(std::string(ValidateLayer(wrong).message()),
              AllOf(HasSubstr("relative_query"), HasSubstr("position_to_content")));
  wrong.weights.relative_query = Tensor();
  wrong.config.relative_embeddings = {2, false, false};
  EXPECT_THAT(std::string(ValidateLayer(wrong).message()),
              HasSubstr("needs content_to_position, position_to_content or both"));
  wrong.config.relative_embeddings = {kMaxRelativeEmbeddingDistance + 1, true, false};
  EXPECT_THAT(std::string(ValidateLayer(wrong).message()), HasSubstr("65536"));
  AttentionLayer bare;  // a layer without projections takes none
  bare.config.name = "sdpa";
  bare.config.relative_embeddings = {2, true, true};
  EXPECT_THAT(std::string(ValidateLayer(bare).message()), HasSubstr("projection layers only"));
}

// An output gate whose weights are zero gates every token by sigmoid of its
// bias alone: the same as no gate with each output weight column f scaled
// by sigmoid(bg[f]). And the layer check's rules for the gate's weights.
TEST(ReferenceEngineTest, OutputGateOfABiasAloneScalesTheOutputWeightColumns) {
  constexpr int64_t H = 2, D = 3, E = 5, B = 2, L = 4;
  AttentionLayer gated;
  LayerConfig& c = gated.config;
  c.name = "gated";
  c.has_projections = true;
  c.num_heads = c.num_kv_heads = H;
  c.head_dim = D;
  c.query_dim = c.key_dim = c.value_dim = c.out_dim = E;
  c.causal = true;
  c.output_gate = true;
  LayerWeights& w = gated.weights;
  w.wq = Random({H * D, E}, 700);
  w.wk = Random({H * D, E}, 701);
  w.wv = Random({H * D, E}, 702);
  w.wo = Random({E, H * D}, 703);
  w.bo = Random({E}, 704);
  w.wg = Values(DType::kFloat32, {H * D, E}, std::vector<float>(H * D * E, 0.0f));
  w.bg = Values(DType::kFloat32, {H * D}, {-4, -1, 0, 0.5, 2, 6});
  ASSERT_TRUE(ValidateLayer(gated).ok()) << ValidateLayer(gated);

  AttentionLayer scaled;
  scaled.config = c;
  scaled.config.output_gate = false;
  scaled.weights = w;
  scaled.weights.wg = Tensor();
  scaled.weights.bg = Tensor();
  for (int64_t o = 0; o < E; ++o) {
    for (int64_t f = 0; f < H * D; ++f) {
      const double g = w.bg.data_as<float>()[f];
      scaled.weights.wo.data_as<float>()[o * H * D + f] *=
          static_cast<float>(1.0 / (1.0 + std::exp(-g)));
    }
  }
  ASSERT_TRUE(ValidateLayer(scaled).ok()) << ValidateLayer(scaled);

  const Tensor x = Random({B, L, E}, 705);
  std::vector<float> outs[2];
  for (int i = 0; i < 2; ++i) {
    Tensor out(DType::kFloat32, {B, L, E});
    AttentionTask task;
    task.query = x.view();
    task.causal = true;
    task.output = out.mutable_view();
    ASSERT_TRUE(NewReferenceEngine()->Run(i == 0 ? gated : scaled, {&task, 1}).ok());
    outs[i] = AsFloats(out);
  }
  for (size_t i = 0; i < outs[0].size(); ++i) {
    EXPECT_NEAR(outs[0][i], outs[1][i], 1e-5 * (1 + std::fabs(outs[1][i]))) << i;
  }

  AttentionLayer bad = gated;
  bad.weights.wg = Random({H * D, E + 1}, 706);
  EXPECT_THAT(std::string(ValidateLayer(bad).message()),
              ::testing::AllOf(::testing::HasSubstr("wg"), ::testing::HasSubstr("[6, 5]")));
  bad = gated;
  bad.config.output_gate = false;
  EXPECT_THAT(std::string(ValidateLayer(bad).message()),
              ::testing::HasSubstr("without output_gate"));
}

// Temperature by position (Ministral 3): queries whose positions all fall
// in one band [k * floor_scale, (k + 1) * floor_scale) share the factor
// 1 + attn_scale * log(1 + k), which is the same as the layer without it at
// a scale that many times larger; below floor_scale the factor is 1.
TEST(ReferenceEngineTest, TemperatureByPositionScalesTheScores) {
  constexpr int64_t H = 2, D = 4, E = 8, B = 1, L = 5;
  AttentionLayer plain;
  LayerConfig& c = plain.config;
  c.name = "ministral";
  c.has_projections = true;
  c.num_heads = c.num_kv_heads = H;
  c.head_dim = D;
  c.query_dim = c.key_dim = c.value_dim = c.out_dim = E;
  c.causal = true;
  c.rope.type = RopeConfig::Type::kDefault;
  c.rope.theta = 10000.0;
  c.rope.rotary_dim = D;
  plain.weights.wq = Random({H * D, E}, 950);
  plain.weights.wk = Random({H * D, E}, 951);
  plain.weights.wv = Random({H * D, E}, 952);
  plain.weights.wo = Random({E, H * D}, 953);
  AttentionLayer tuned = plain;
  tuned.config.temperature_tuning = {true, 16.0, 0.1, true};
  ASSERT_TRUE(ValidateLayer(tuned).ok()) << ValidateLayer(tuned);
  const Tensor x = Random({B, L, E}, 954);
  auto run = [&](const AttentionLayer& layer, std::vector<int64_t> positions, float scale) {
    Tensor out(DType::kFloat32, {B, L, E});
    AttentionTask task;
    task.query = x.view();
    task.causal = true;
    task.scale = scale;
    task.positions = positions;
    task.output = out.mutable_view();
    EXPECT_TRUE(NewReferenceEngine()->Run(layer, {&task, 1}).ok());
    return AsFloats(out);
  };
  const float scale = InverseSqrt(D);
  // Positions 40..44: band 2 (32..47), the factor 1 + 0.1 * log(3).
  const std::vector<int64_t> far = {40, 41, 42, 43, 44};
  const double factor = 1.0 + 0.1 * std::log(3.0);
  const std::vector<float> got = run(tuned, far, scale);
  const std::vector<float> want = run(plain, far, static_cast<float>(scale * factor));
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6) << i;
  // (The first token sees one key: any scale gives it the same output.)
  const size_t last = (L - 1) * E;
  EXPECT_GT(std::fabs(got[last] - run(plain, far, scale)[last]), 1e-4);
  // Positions 0..4 (implicit): the factor is 1.
  const std::vector<float> near = run(tuned, {}, scale);
  const std::vector<float> untouched = run(plain, {}, scale);
  for (size_t i = 0; i < near.size(); ++i) EXPECT_EQ(near[i], untouched[i]) << i;
  // More queries than keys put the first at negative indexes, where the
  // factor is log1p(-1) = -inf: refused, naming the rule; Lq == Lk serves.
  for (const int64_t lk : {L - 1, L}) {
    const Tensor kv = Random({B, lk, E}, 955);
    Tensor out(DType::kFloat32, {B, L, E});
    AttentionTask task;
    task.query = x.view();
    task.key = kv.view();
    task.value = kv.view();
    task.scale = scale;
    task.output = out.mutable_view();
    const absl::Status status = NewReferenceEngine()->Run(tuned, {&task, 1});
    if (lk == L) {
      EXPECT_TRUE(status.ok()) << status;
    } else {
      EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
      EXPECT_THAT(status.message(), ::testing::HasSubstr("temperature_tuning needs Lq <= Lk"));
    }
  }
}

// QK-norm's LayerNorm form (Cohere): (x - mean) / sqrt(var + eps) * w, the
// variance about the mean; the RMSNorm form unchanged beside it.
TEST(ReferenceEngineTest, QkNormLayerNormFormIsCohereLayerNorm) {
  const std::vector<double> x0 = {3.0, -1.0, 4.5, 0.25, 2.0};
  const std::vector<float> w = {1.5f, -0.5f, 2.0f, 1.0f, 0.75f};
  QkNormConfig norm;
  norm.enabled = true;
  norm.eps = 1e-3;
  norm.subtract_mean = true;
  std::vector<double> x = x0;
  NormalizeHead(x.data(), w.data(), 5, norm);
  const double mean = (3.0 - 1.0 + 4.5 + 0.25 + 2.0) / 5;
  double var = 0;
  for (double v : x0) var += (v - mean) * (v - mean) / 5;
  for (size_t i = 0; i < x0.size(); ++i) {
    EXPECT_NEAR(x[i], (x0[i] - mean) / std::sqrt(var + 1e-3) * w[i], 1e-12) << i;
  }
  norm.subtract_mean = false;
  x = x0;
  NormalizeHead(x.data(), w.data(), 5, norm);
  double ms = 0;
  for (double v : x0) ms += v * v / 5;
  for (size_t i = 0; i < x0.size(); ++i) {
    EXPECT_NEAR(x[i], x0[i] / std::sqrt(ms + 1e-3) * w[i], 1e-12) << i;
  }
}

// A layer of H heads of D features whose projections are all the identity
// (one head per feature block, no biases, out-projection the identity): its
// output is bare attention over the inputs split into heads, per head.
AttentionLayer IdentityProjectionLayer(const char* name, int64_t heads, int64_t head_dim) {
  const int64_t e = heads * head_dim;
  std::vector<float> eye(static_cast<size_t>(e * e), 0.0f);
  for (int64_t i = 0; i < e; ++i) eye[static_cast<size_t>(i * e + i)] = 1.0f;
  AttentionLayer layer;
  LayerConfig& c = layer.config;
  c.name = name;
  c.has_projections = true;
  c.num_heads = c.num_kv_heads = heads;
  c.head_dim = head_dim;
  c.query_dim = c.key_dim = c.value_dim = c.out_dim = e;
  for (Tensor* w : {&layer.weights.wq, &layer.weights.wk, &layer.weights.wv, &layer.weights.wo}) {
    *w = Values(DType::kFloat32, {e, e}, eye);
  }
  return layer;
}

// QKV clipping: an identity projection layer with clip_qkv c is bare
// attention over the clamped inputs, per head.
TEST(ReferenceEngineTest, ClipQkvClampsTheProjectedValues) {
  constexpr int64_t H = 2, D = 3, E = H * D, B = 2, L = 4;
  constexpr float kClip = 0.4f;
  AttentionLayer layer = IdentityProjectionLayer("clipped", H, D);
  layer.config.clip_qkv = kClip;
  ASSERT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);
  const Tensor x = Random({B, L, E}, 900);
  Tensor out(DType::kFloat32, {B, L, E});
  AttentionTask task;
  task.query = x.view();
  task.causal = true;
  task.scale = InverseSqrt(D);
  task.output = out.mutable_view();
  ASSERT_TRUE(NewReferenceEngine()->Run(layer, {&task, 1}).ok());

  // The clamped inputs in head layout [B, H, L, D] through bare attention.
  Tensor heads(DType::kFloat32, {B, H, L, D});
  int64_t clamped = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t f = 0; f < E; ++f) {
        const float v = x.data_as<float>()[(b * L + l) * E + f];
        clamped += std::fabs(v) > kClip;
        heads.data_as<float>()[((b * H + f / D) * L + l) * D + f % D] =
            std::clamp(v, -kClip, kClip);
      }
    }
  }
  ASSERT_GT(clamped, 0);
  SdpaRun bare(heads, heads, heads, false);
  bare.task.causal = true;
  ASSERT_TRUE(RunSdpa(bare.task).ok());
  const std::vector<float> got = AsFloats(out), want_heads = AsFloats(bare.out);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t f = 0; f < E; ++f) {
        EXPECT_NEAR(got[(b * L + l) * E + f], want_heads[((b * H + f / D) * L + l) * D + f % D],
                    1e-6)
            << "b " << b << " l " << l << " f " << f;
      }
    }
  }
  AttentionLayer bad = layer;
  bad.config.clip_qkv = -1.0f;
  EXPECT_THAT(std::string(ValidateLayer(bad).message()), HasSubstr("clip_qkv"));
}

// The value norm (Gemma 3n, Gemma 4): a layer whose projections are the
// identity with v_norm is bare attention over the raw queries and keys and
// each value head divided by its root mean square (plus eps), written out
// here.
TEST(ReferenceEngineTest, ValueNormDividesEachValueHeadByItsRms) {
  constexpr int64_t H = 2, D = 4, E = H * D, B = 2, L = 5;
  constexpr double kEps = 1e-3;
  AttentionLayer layer = IdentityProjectionLayer("v-norm", H, D);
  layer.config.v_norm_eps = kEps;
  ASSERT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);
  const Tensor x = Random({B, L, E}, 901);
  Tensor out(DType::kFloat32, {B, L, E});
  AttentionTask task;
  task.query = x.view();
  task.causal = true;
  task.scale = InverseSqrt(D);
  task.output = out.mutable_view();
  ASSERT_TRUE(NewReferenceEngine()->Run(layer, {&task, 1}).ok());

  // Q and K: the inputs in head layout [B, H, L, D]; V: each head's D
  // features over sqrt(mean of their squares + eps).
  Tensor qk(DType::kFloat32, {B, H, L, D}), v(DType::kFloat32, {B, H, L, D});
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t h = 0; h < H; ++h) {
        const float* in = x.data_as<float>() + (b * L + l) * E + h * D;
        double squares = 0;
        for (int64_t d = 0; d < D; ++d) squares += static_cast<double>(in[d]) * in[d];
        const double rms = std::sqrt(squares / D + kEps);
        for (int64_t d = 0; d < D; ++d) {
          qk.data_as<float>()[((b * H + h) * L + l) * D + d] = in[d];
          v.data_as<float>()[((b * H + h) * L + l) * D + d] = static_cast<float>(in[d] / rms);
        }
      }
    }
  }
  SdpaRun bare(qk, qk, v, false);
  bare.task.causal = true;
  ASSERT_TRUE(RunSdpa(bare.task).ok());
  const std::vector<float> got = AsFloats(out), want_heads = AsFloats(bare.out);
  double largest_change = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t f = 0; f < E; ++f) {
        const float want = want_heads[((b * H + f / D) * L + l) * D + f % D];
        EXPECT_NEAR(got[(b * L + l) * E + f], want, 1e-6)
            << "b " << b << " l " << l << " f " << f;
        largest_change = std::max(largest_change,
                                  std::fabs(static_cast<double>(want) -
                                            x.data_as<float>()[(b * L + l) * E + f]));
      }
    }
  }
  EXPECT_GT(largest_change, 0.1);  // the norm changed the answer
  AttentionLayer bad = layer;
  bad.config.v_norm_eps = -1.0;
  EXPECT_THAT(std::string(ValidateLayer(bad).message()), HasSubstr("v_norm"));
}

// Multi-head latent attention as transformers' DeepseekV3Attention writes
// it, in float64 here: the query through its normalised latent, the keys'
// nope features and the values from one normalised latent (kv_b_proj's rows
// per head [k_nope | v], split into wk and wv as the loader splits them),
// one rotary key per token shared by the heads, RoPE on the last features
// either as rotate-half or as DeepSeek-V3's interleaved form (which
// de-interleaves each pair first: the same scores as rotating pairs in
// place), causal softmax, o_proj.
TEST(ReferenceEngineTest, LatentAttentionIsDeepSeeksFormula) {
  constexpr int64_t H = 2, NOPE = 3, ROPE = 4, DV = 5, QR = 6, KVR = 7, E = 8, B = 2, L = 5;
  constexpr int64_t DQK = NOPE + ROPE;
  constexpr double kEps = 1e-6, kTheta = 10000.0;
  const Tensor wqa = Random({QR, E}, 800), bqa = Random({QR}, 801), gq = Random({QR}, 802);
  const Tensor wqb = Random({H * DQK, QR}, 803), wkva = Random({KVR + ROPE, E}, 804);
  const Tensor bkva = Random({KVR + ROPE}, 805), gkv = Random({KVR}, 806);
  const Tensor wkvb = Random({H * (NOPE + DV), KVR}, 807), wo = Random({E, H * DV}, 808);
  const Tensor bo = Random({E}, 809), x = Random({B, L, E}, 810);
  auto at = [](const Tensor& t, int64_t i) { return static_cast<double>(t.data_as<float>()[i]); };
  // y[n] = sum_c x[c] w[n, c] (+ b[n]).
  auto linear = [&](const std::vector<double>& in, const Tensor& w, const Tensor* b) {
    const int64_t n_out = w.shape()[0], n_in = w.shape()[1];
    std::vector<double> y(static_cast<size_t>(n_out));
    for (int64_t n = 0; n < n_out; ++n) {
      double acc = b != nullptr ? at(*b, n) : 0.0;
      for (int64_t c = 0; c < n_in; ++c) acc += in[c] * at(w, n * n_in + c);
      y[n] = acc;
    }
    return y;
  };
  auto rms_norm = [&](std::vector<double> v, const Tensor& g) {
    double sum = 0;
    for (double e : v) sum += e * e;
    const double inv = 1.0 / std::sqrt(sum / static_cast<double>(v.size()) + kEps);
    for (size_t i = 0; i < v.size(); ++i) v[i] *= inv * at(g, static_cast<int64_t>(i));
    return v;
  };
  // transformers' rotate-half RoPE of x[ROPE] at `pos`; `interleave`: its
  // apply_rotary_pos_emb_interleave, pairs de-interleaved first.
  auto rope = [&](std::vector<double> v, int64_t pos, bool interleave) {
    if (interleave) {
      std::vector<double> d(ROPE);
      for (int64_t i = 0; i < ROPE / 2; ++i) {
        d[i] = v[2 * i];
        d[ROPE / 2 + i] = v[2 * i + 1];
      }
      v = d;
    }
    std::vector<double> out(ROPE);
    for (int64_t i = 0; i < ROPE; ++i) {
      const int64_t f = i % (ROPE / 2);
      const double angle = static_cast<double>(pos) / std::pow(kTheta, 2.0 * f / ROPE);
      const double rotated = i < ROPE / 2 ? -v[i + ROPE / 2] : v[i - ROPE / 2];
      out[i] = v[i] * std::cos(angle) + rotated * std::sin(angle);
    }
    return out;
  };
  for (const bool interleaved : {false, true}) {
    SCOPED_TRACE(interleaved ? "interleaved" : "rotate half");
    AttentionLayer layer;
    LayerConfig& c = layer.config;
    c.name = "latent";
    c.has_projections = true;
    c.num_heads = c.num_kv_heads = H;
    c.head_dim = DQK;
    c.query_dim = c.key_dim = c.value_dim = c.out_dim = E;
    c.causal = true;
    c.latent = {true, QR, KVR, ROPE, DV, kEps, kEps};
    c.rope.type = RopeConfig::Type::kDefault;
    c.rope.theta = kTheta;
    c.rope.rotary_dim = ROPE;
    c.rope.interleaved = interleaved;
    LayerWeights& w = layer.weights;
    w.wq_a = wqa;
    w.bq_a = bqa;
    w.q_a_norm = gq;
    w.wq = wqb;
    w.wkv_a = wkva;
    w.bkv_a = bkva;
    w.kv_a_norm = gkv;
    w.wk = Tensor(DType::kFloat32, {H * NOPE, KVR});
    w.wv = Tensor(DType::kFloat32, {H * DV, KVR});
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t r = 0; r < NOPE + DV; ++r) {
        float* dst = r < NOPE ? w.wk.data_as<float>() + (h * NOPE + r) * KVR
                              : w.wv.data_as<float>() + (h * DV + r - NOPE) * KVR;
        std::memcpy(dst, wkvb.data_as<float>() + (h * (NOPE + DV) + r) * KVR,
                    KVR * sizeof(float));
      }
    }
    w.wo = wo;
    w.bo = bo;
    ASSERT_TRUE(ValidateLayer(layer).ok()) << ValidateLayer(layer);

    std::vector<double> want(static_cast<size_t>(B * L * E));
    for (int64_t b = 0; b < B; ++b) {
      // Per token: q [H][DQK] and k [H][DQK] as [nope | rope], v [H][DV].
      std::vector<std::vector<double>> q(L), k(L), v(L);
      for (int64_t t = 0; t < L; ++t) {
        std::vector<double> xt(x.data_as<float>() + (b * L + t) * E,
                               x.data_as<float>() + (b * L + t + 1) * E);
        q[t] = linear(rms_norm(linear(xt, wqa, &bqa), gq), wqb, nullptr);
        const std::vector<double> kv_a = linear(xt, wkva, &bkva);
        const std::vector<double> latent = rms_norm(
            std::vector<double>(kv_a.begin(), kv_a.begin() + KVR), gkv);
        const std::vector<double> kv = linear(latent, wkvb, nullptr);
        const std::vector<double> k_pe =
            rope(std::vector<double>(kv_a.begin() + KVR, kv_a.end()), t, interleaved);
        for (int64_t h = 0; h < H; ++h) {
          std::vector<double> q_pe(q[t].begin() + h * DQK + NOPE, q[t].begin() + (h + 1) * DQK);
          q_pe = rope(q_pe, t, interleaved);
          std::copy(q_pe.begin(), q_pe.end(), q[t].begin() + h * DQK + NOPE);
          for (int64_t d = 0; d < NOPE; ++d) k[t].push_back(kv[h * (NOPE + DV) + d]);
          k[t].insert(k[t].end(), k_pe.begin(), k_pe.end());
          for (int64_t d = 0; d < DV; ++d) v[t].push_back(kv[h * (NOPE + DV) + NOPE + d]);
        }
      }
      for (int64_t i = 0; i < L; ++i) {
        std::vector<double> merged;
        for (int64_t h = 0; h < H; ++h) {
          std::vector<double> p(static_cast<size_t>(i + 1));
          double max = -1e300, sum = 0;
          for (int64_t j = 0; j <= i; ++j) {
            double dot = 0;
            for (int64_t d = 0; d < DQK; ++d) dot += q[i][h * DQK + d] * k[j][h * DQK + d];
            p[j] = dot / std::sqrt(static_cast<double>(DQK));
            max = std::max(max, p[j]);
          }
          for (double& e : p) sum += (e = std::exp(e - max));
          for (int64_t d = 0; d < DV; ++d) {
            double o = 0;
            for (int64_t j = 0; j <= i; ++j) o += p[j] / sum * v[j][h * DV + d];
            merged.push_back(o);
          }
        }
        const std::vector<double> y = linear(merged, wo, &bo);
        std::copy(y.begin(), y.end(), want.begin() + (b * L + i) * E);
      }
    }
    Tensor out(DType::kFloat32, {B, L, E});
    AttentionTask task;
    task.query = x.view();
    task.causal = true;
    task.scale = InverseSqrt(DQK);
    task.output = out.mutable_view();
    ASSERT_TRUE(NewReferenceEngine()->Run(layer, {&task, 1}).ok());
    ExpectNear(AsFloats(out), want, 1e-5);

    // A key and value are refused; so is a layer whose shapes disagree.
    AttentionTask cross = task;
    cross.key = x.view();
    cross.value = x.view();
    EXPECT_THAT(std::string(NewReferenceEngine()->Run(layer, {&cross, 1}).message()),
                HasSubstr("latent"));
    AttentionLayer bad = layer;
    bad.weights.wk = Random({H * NOPE, KVR + 1}, 811);
    EXPECT_THAT(std::string(ValidateLayer(bad).message()), HasSubstr("wk"));
    bad = layer;
    bad.config.latent.rope_dim = 2;
    EXPECT_THAT(std::string(ValidateLayer(bad).message()), HasSubstr("rotary_dim"));
  }
}

// nn.MultiheadAttention-style layer with grouped K/V heads, distinct
// query/key/value/out dims, and a missing bias (bk), against NumPy-style
// projections written here; self-attention on a layer whose dims allow it.
TEST(ReferenceEngineTest, ProjectionLayerMatchesNaiveMultiheadAttention) {
  constexpr int64_t Hq = 4, Hkv = 2, D = 5;
  auto make_layer = [](int64_t qd, int64_t kd, int64_t vd, int64_t od, uint32_t seed) {
    AttentionLayer layer;
    LayerConfig& c = layer.config;
    c.name = "naive";
    c.has_projections = true;
    c.num_heads = Hq;
    c.num_kv_heads = Hkv;
    c.head_dim = D;
    c.query_dim = qd;
    c.key_dim = kd;
    c.value_dim = vd;
    c.out_dim = od;
    LayerWeights& w = layer.weights;
    w.wq = Random({Hq * D, qd}, seed);
    w.bq = Random({Hq * D}, seed + 1);
    w.wk = Random({Hkv * D, kd}, seed + 2);
    w.wv = Random({Hkv * D, vd}, seed + 3);
    w.bv = Random({Hkv * D}, seed + 4);
    w.wo = Random({od, Hq * D}, seed + 5);
    w.bo = Random({od}, seed + 6);
    EXPECT_TRUE(ValidateLayer(layer).ok());
    return layer;
  };
  const AttentionLayer cross = make_layer(7, 6, 3, 9, 200);
  const AttentionLayer self = make_layer(8, 8, 8, 8, 300);
  constexpr int64_t B = 2, Lq = 3;
  for (const AttentionLayer* layer : {&cross, &self}) {
    const LayerConfig& c = layer->config;
    const bool self_attention = layer == &self;
    const int64_t Lk = self_attention ? Lq : 4;
    const Tensor x = Random({B, Lq, c.query_dim}, 400);
    const Tensor xk = Random({B, Lk, c.key_dim}, 401);
    const Tensor xv = Random({B, Lk, c.value_dim}, 402);
    const Tensor mask = Values(DType::kFloat32, {Lq, 1}, {0.5, -1, 2});  // a per-row offset
    for (bool causal : {false, true}) {
      Tensor out(DType::kFloat32, {B, Lq, c.out_dim}), weights(DType::kFloat32, {B, Hq, Lq, Lk});
      AttentionTask task;
      task.query = x.view();
      if (!self_attention) {
        task.key = xk.view();
        task.value = xv.view();
      }
      task.causal = causal;
      task.scale = 0.4f;
      task.attn_mask = mask.view();
      task.output = out.mutable_view();
      task.weights = weights.mutable_view();
      ASSERT_TRUE(NewReferenceEngine()->Run(*layer, {&task, 1}).ok());

      const LayerWeights& w = layer->weights;
      const std::vector<double> q = Transpose12(NaiveLinear(AsDoubles(x), B * Lq, w.wq, w.bq), B,
                                                Lq, Hq, D);
      const std::vector<double> k = Transpose12(
          NaiveLinear(AsDoubles(self_attention ? x : xk), B * Lk, w.wk, w.bk), B, Lk, Hkv, D);
      const std::vector<double> v = Transpose12(
          NaiveLinear(AsDoubles(self_attention ? x : xv), B * Lk, w.wv, w.bv), B, Lk, Hkv, D);
      NaiveOptions o;
      o.scale = 0.4f;
      o.causal = causal;
      o.mask = &mask;
      const Naive a = NaiveAttention(q, k, v, B, Hq, Hkv, Lq, Lk, D, D, o);
      const std::vector<double> y =
          NaiveLinear(Transpose12(a.out, B, Lq, Hq, D, /*inverse=*/true), B * Lq, w.wo, w.bo);
      const std::string label =
          absl::StrCat(self_attention ? "self" : "cross", causal ? " causal" : "");
      ExpectClose(AsFloats(out), y, label);
      ExpectClose(AsFloats(weights), a.weights, label);
    }
  }
}

// Every malformed task is refused before any memory is touched, with
// InvalidArgument naming the field.
TEST(ReferenceEngineTest, RejectsBadTasksNamingTheField) {
  const Tensor q = Random({2, 4, 3, 6}, 500);
  const Tensor k = Random({2, 2, 5, 6}, 501);
  const Tensor v = Random({2, 2, 5, 3}, 502);
  const Tensor q_half = Values(DType::kFloat16, q.shape(), AsFloats(q));
  const Tensor k3 = Random({2, 3, 5, 6}, 503), v3 = Random({2, 3, 5, 3}, 503);
  const Tensor v_short = Random({2, 2, 4, 3}, 504);
  const Tensor q_rank3 = Random({2, 3, 6}, 505);
  const Tensor bool_q = Values(DType::kBool, q.shape(), std::vector<float>(144, 1));
  const Tensor mask_bad = Values(DType::kBool, {4, 5}, std::vector<float>(20, 1));
  const Tensor mask_rank1 = Values(DType::kBool, {5}, std::vector<float>(5, 1));
  const Tensor mask_rank5 = Values(DType::kBool, {1, 1, 1, 3, 5}, std::vector<float>(15, 1));
  Tensor wrong_weights(DType::kFloat32, {2, 3, 5});  // per-head shape expected
  Tensor bool_weights(DType::kBool, {2, 4, 3, 5});
  Tensor bool_out(DType::kBool, {2, 4, 3, 3});
  const int64_t lengths_short[] = {5};
  const int64_t lengths_over[] = {5, 6};
  const int64_t lengths_negative[] = {-1, 2};

  struct Bad {
    const char* field;
    std::function<void(AttentionTask&)> spoil;
  };
  const std::vector<Bad> bads = {
      {"query", [&](AttentionTask& t) { t.query = TensorView(); }},
      {"query", [&](AttentionTask& t) { t.query = q_rank3.view(); }},
      {"query", [&](AttentionTask& t) { t.query = bool_q.view(); }},
      {"key", [&](AttentionTask& t) { t.query = q_half.view(); }},  // dtype differs from query's
      {"key", [&](AttentionTask& t) { t.key = k3.view(), t.value = v3.view(); }},  // 4 over 3
      {"value", [&](AttentionTask& t) { t.value = v_short.view(); }},
      {"value", [&](AttentionTask& t) { t.value = TensorView(); }},
      {"output", [&](AttentionTask& t) { t.output = MutableTensorView(); }},
      {"output", [&](AttentionTask& t) { t.output = bool_out.mutable_view(); }},
      {"weights", [&](AttentionTask& t) { t.weights = wrong_weights.mutable_view(); }},
      {"weights", [&](AttentionTask& t) { t.weights = bool_weights.mutable_view(); }},
      {"scale", [&](AttentionTask& t) { t.scale = 0.0f; }},
      {"scale", [&](AttentionTask& t) { t.scale = std::nanf(""); }},
      {"key_lengths", [&](AttentionTask& t) { t.key_lengths = lengths_short; }},
      {"key_lengths", [&](AttentionTask& t) { t.key_lengths = lengths_over; }},
      {"key_lengths", [&](AttentionTask& t) { t.key_lengths = lengths_negative; }},
      {"attn_mask", [&](AttentionTask& t) { t.attn_mask = mask_bad.view(); }},
      {"attn_mask", [&](AttentionTask& t) { t.attn_mask = mask_rank1.view(); }},
      {"attn_mask", [&](AttentionTask& t) { t.attn_mask = mask_rank5.view(); }},
  };
  for (const Bad& bad : bads) {
    SdpaRun run(q, k, v);
    ASSERT_TRUE(RunSdpa(run.task).ok());
    bad.spoil(run.task);
    const absl::Status s = RunSdpa(run.task);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.field << ": " << s;
    EXPECT_THAT(std::string(s.message()), ::testing::StartsWith(std::string(bad.field) + ":"))
        << s;
  }

  // A projection layer: the query's last dim, self-attention only where the
  // dims allow it, and key without value.
  AttentionLayer layer;
  layer.config.name = "p";
  layer.config.has_projections = true;
  layer.config.num_heads = layer.config.num_kv_heads = 1;
  layer.config.head_dim = 2;
  layer.config.query_dim = 3;
  layer.config.key_dim = 4;
  layer.config.value_dim = 3;
  layer.config.out_dim = 3;
  layer.weights.wq = Random({2, 3}, 506);
  layer.weights.wk = Random({2, 4}, 507);
  layer.weights.wv = Random({2, 3}, 508);
  layer.weights.wo = Random({3, 2}, 509);
  ASSERT_TRUE(ValidateLayer(layer).ok());
  const Tensor x = Random({1, 2, 3}, 510), x_wide = Random({1, 2, 4}, 511);
  Tensor out(DType::kFloat32, {1, 2, 3});
  const Tensor* const none = nullptr;
  // {field named, key, value, query}: a bad query dim, a key of the wrong
  // dim, self-attention where key_dim differs, value missing.
  for (const auto& [field, key, value, query] :
       {std::tuple{"query", &x_wide, &x, &x_wide}, std::tuple{"key", &x, &x, &x},
        std::tuple{"key", none, none, &x}, std::tuple{"value", &x_wide, none, &x}}) {
    AttentionTask task;
    task.query = query->view();
    if (key != nullptr) task.key = key->view();
    if (value != nullptr) task.value = value->view();
    task.scale = 1.0f;
    task.output = out.mutable_view();
    const absl::Status s = NewReferenceEngine()->Run(layer, {&task, 1});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field << ": " << s;
    EXPECT_THAT(std::string(s.message()), ::testing::StartsWith(std::string(field) + ":")) << s;
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

// Host-side logic of the cuDNN SDPA path (engine/cuda/cudnn_sdpa.h), which
// runs without a GPU: the shape buckets, the rule that sends rows seeing no
// key to our kernels (against a brute-force oracle of attention_params.h's
// visibility rule), the refusals and their messages, the source names, and
// loading cuDNN (OK, or Unavailable naming libcudnn.so.9; never a crash).
// Linked against the CUDA backend's objects (the module hides them).
#include "engine/cuda/cudnn_sdpa.h"

#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "engine/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve::cuda {
namespace {

using ::testing::HasSubstr;

TEST(SdpaBucketLengthTest, KnownValues) {
  const std::vector<std::pair<int64_t, int64_t>> cases = {
      {1, 1},     {2, 2},     {3, 4},       {5, 8},       {33, 64},    {64, 64},
      {65, 80},   {100, 112}, {128, 128},   {129, 160},   {1000, 1024}, {2000, 2048},
      {2049, 2560}, {4000, 4096}, {4097, 5120}, {16384, 16384}};
  for (auto [len, bucket] : cases) EXPECT_EQ(SdpaBucketLength(len), bucket) << "len " << len;
}

TEST(SdpaBucketLengthTest, CoversWithAtMostAQuarterOfPaddingAndFewBuckets) {
  std::set<int64_t> buckets;
  int64_t previous = 0;
  for (int64_t len = 1; len <= 32768; ++len) {
    const int64_t b = SdpaBucketLength(len);
    ASSERT_GE(b, len);
    ASSERT_GE(b, previous) << "not monotonic at " << len;
    if (len > 64) {
      ASSERT_LE(b * 4, len * 5) << "more than 25% padding at " << len;
    }
    ASSERT_EQ(SdpaBucketLength(b), b) << "a bucket is its own bucket";
    previous = b;
    buckets.insert(b);
  }
  // 1..64: 7 powers of two; then 4 buckets per octave for 9 octaves.
  EXPECT_LE(buckets.size(), 7u + 4u * 9u);
}

// attention_params.h's rule, expanded element by element: does query row
// (b, h, i) see any key?
bool RowSeesAKey(const AttentionParams& p, int64_t b, int64_t h, int64_t i) {
  for (int64_t j = 0; j < p.kv_len; ++j) {
    if (p.causal && j > i + (p.kv_len - p.q_len)) continue;
    if (p.key_lengths != nullptr && j >= p.key_lengths[b]) continue;
    const MaskParams& m = p.mask;
    if (m.kind != MaskParams::Kind::kNone) {
      const int64_t at = b * m.stride_b + h * m.stride_h + i * m.stride_q + j * m.stride_k;
      if (m.kind == MaskParams::Kind::kBool && static_cast<const uint8_t*>(m.data)[at] == 0) {
        continue;
      }
      if (m.kind == MaskParams::Kind::kAdditive &&
          LoadAsFloat(m.dtype, m.data, at) == -std::numeric_limits<float>::infinity()) {
        continue;
      }
    }
    return true;
  }
  return false;
}

TEST(SomeRowSeesNoKeyTest, AgreesWithTheExpandedRuleOnRandomCases) {
  std::mt19937 rng(29);
  int empty_found = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    AttentionParams p;
    p.batch = 1 + rng() % 3;
    p.num_heads = 1 + rng() % 3;
    p.q_len = 1 + rng() % 6;
    p.kv_len = 1 + rng() % 6;
    p.causal = rng() % 2 == 0;
    std::vector<int64_t> lengths(static_cast<size_t>(p.batch));
    if (rng() % 3 == 0) {
      for (int64_t& l : lengths) l = rng() % (p.kv_len + 1);
      p.key_lengths = lengths.data();
    }
    // A dense [B, H, Lq, Lk] mask read through strides that broadcast a
    // random subset of its dims.
    std::vector<uint8_t> bools(static_cast<size_t>(p.batch * p.num_heads * p.q_len * p.kv_len));
    std::vector<float> floats(bools.size());
    const int kind = rng() % 3;
    if (kind != 0) {
      std::bernoulli_distribution allowed(rng() % 2 == 0 ? 0.9 : 0.4);
      for (size_t i = 0; i < bools.size(); ++i) {
        bools[i] = allowed(rng) ? 1 : 0;
        floats[i] = bools[i] != 0 ? 0.5f : -std::numeric_limits<float>::infinity();
      }
      MaskParams& m = p.mask;
      m.kind = kind == 1 ? MaskParams::Kind::kBool : MaskParams::Kind::kAdditive;
      m.dtype = kind == 1 ? DType::kBool : DType::kFloat32;
      m.data = kind == 1 ? static_cast<const void*>(bools.data()) : floats.data();
      m.stride_k = 1;
      m.stride_q = rng() % 3 == 0 ? 0 : p.kv_len;
      m.stride_h = rng() % 3 == 0 ? 0 : p.q_len * p.kv_len;
      m.stride_b = rng() % 3 == 0 ? 0 : p.num_heads * p.q_len * p.kv_len;
    }
    bool want = false;
    for (int64_t b = 0; b < p.batch; ++b)
      for (int64_t h = 0; h < p.num_heads; ++h)
        for (int64_t i = 0; i < p.q_len; ++i) want = want || !RowSeesAKey(p, b, h, i);
    ASSERT_EQ(SomeRowSeesNoKey(p), want) << "trial " << trial;
    empty_found += want ? 1 : 0;
  }
  // Both answers occur often enough for the comparison to mean something.
  EXPECT_GT(empty_found, 300);
  EXPECT_LT(empty_found, 2700);
}

AttentionParams Eligible() {
  AttentionParams p;
  p.batch = 2;
  p.num_heads = 8;
  p.num_kv_heads = 2;
  p.head_dim = p.head_dim_v = 128;
  p.q_len = 100;
  p.kv_len = 300;
  p.causal = true;
  return p;
}

TEST(SdpaRefusalTest, TakesFp16AndBf16AndNamesWhatItRefuses) {
  AttentionParams p = Eligible();
  EXPECT_EQ(SdpaRefusal(p, DType::kFloat16), std::nullopt);
  EXPECT_EQ(SdpaRefusal(p, DType::kBFloat16), std::nullopt);
  EXPECT_THAT(SdpaRefusal(p, DType::kFloat32).value_or(""), HasSubstr("fp16/bf16"));

  // need_weights: cuDNN's row statistics and one score GEMM; not with sinks.
  AttentionParams weights = Eligible();
  float w = 0;
  weights.weights = &w;
  EXPECT_EQ(SdpaRefusal(weights, DType::kFloat16), std::nullopt);
  const float sinks[8] = {};
  weights.sinks = sinks;
  EXPECT_THAT(SdpaRefusal(weights, DType::kFloat16).value_or(""), HasSubstr("need_weights"));

  AttentionParams odd = Eligible();
  odd.head_dim = 20;
  EXPECT_THAT(SdpaRefusal(odd, DType::kFloat16).value_or(""), HasSubstr("multiples of 8"));
  AttentionParams dv = Eligible();
  dv.head_dim_v = 72;  // a multiple of 8, Dv != Dk: cuDNN's to decide
  EXPECT_EQ(SdpaRefusal(dv, DType::kBFloat16), std::nullopt);

  AttentionParams empty_row = Eligible();
  const int64_t lengths[] = {300, 0};
  empty_row.key_lengths = lengths;
  EXPECT_THAT(SdpaRefusal(empty_row, DType::kFloat16).value_or(""), HasSubstr("sees no key"));
  AttentionParams short_keys = Eligible();
  short_keys.q_len = 400;  // causal, Lq > Lk: the first 100 rows see nothing
  EXPECT_THAT(SdpaRefusal(short_keys, DType::kFloat16).value_or(""), HasSubstr("sees no key"));
  short_keys.causal = false;
  EXPECT_EQ(SdpaRefusal(short_keys, DType::kFloat16), std::nullopt);
}

// Sliding windows go to cuDNN's band only with bottom-right causal alone;
// sinks without a mask; softcapping, ALiBi, a relative position bias and
// relative position embeddings never (the kernels written here serve the
// rest).
TEST(SdpaRefusalTest, LayerFeaturesCudnnComputesAndTheRest) {
  AttentionParams window = Eligible();
  window.window = 64;
  EXPECT_EQ(SdpaRefusal(window, DType::kBFloat16), std::nullopt);
  AttentionParams not_causal = window;
  not_causal.causal = false;
  EXPECT_THAT(SdpaRefusal(not_causal, DType::kBFloat16).value_or(""),
              HasSubstr("sliding window"));
  AttentionParams with_lengths = window;
  const int64_t lengths[] = {300, 200};
  with_lengths.key_lengths = lengths;
  EXPECT_THAT(SdpaRefusal(with_lengths, DType::kBFloat16).value_or(""),
              HasSubstr("sliding window"));
  AttentionParams masked = window;
  const uint8_t allowed = 1;
  masked.mask.kind = MaskParams::Kind::kBool;
  masked.mask.data = &allowed;
  EXPECT_THAT(SdpaRefusal(masked, DType::kBFloat16).value_or(""), HasSubstr("sliding window"));

  const float sink_logits[8] = {};
  AttentionParams sinks = Eligible();
  sinks.sinks = sink_logits;
  EXPECT_EQ(SdpaRefusal(sinks, DType::kFloat16), std::nullopt);
  sinks.mask = masked.mask;
  EXPECT_THAT(SdpaRefusal(sinks, DType::kFloat16).value_or(""), HasSubstr("sinks"));

  AttentionParams softcap = Eligible();
  softcap.softcap = 50.0f;
  EXPECT_THAT(SdpaRefusal(softcap, DType::kBFloat16).value_or(""), HasSubstr("softcapping"));

  // cuDNN's alibi mask has its own slopes, not the layer's.
  const float slopes[8] = {0.5f, 0.25f, 0.125f, 0.0625f, 0.03125f, 0.015625f, 0.0078125f,
                           0.00390625f};
  AttentionParams alibi = Eligible();
  alibi.alibi_slopes = slopes;
  EXPECT_THAT(SdpaRefusal(alibi, DType::kFloat16).value_or(""), HasSubstr("ALiBi"));
  EXPECT_THAT(SdpaRefusal(alibi, DType::kBFloat16).value_or(""), HasSubstr("ALiBi"));

  // cuDNN takes no bias table, only a bias tensor the size of the scores.
  const float table[8 * 7] = {};
  AttentionParams relative = Eligible();
  relative.relative_bias = table;
  relative.relative_bias_distance = 3;
  EXPECT_THAT(SdpaRefusal(relative, DType::kFloat16).value_or(""),
              HasSubstr("relative position bias"));
  EXPECT_THAT(SdpaRefusal(relative, DType::kBFloat16).value_or(""),
              HasSubstr("relative position bias"));

  // Nor terms of the raw scores from per-distance tables: either table
  // alone is refused.
  static const float embeddings[8 * 128 * 7] = {};
  for (int which = 0; which < 2; ++which) {
    AttentionParams embedded = Eligible();
    (which == 0 ? embedded.relative_key : embedded.relative_query) = embeddings;
    embedded.relative_embedding_distance = 3;
    for (const DType dtype : {DType::kFloat16, DType::kBFloat16}) {
      EXPECT_THAT(SdpaRefusal(embedded, dtype).value_or(""),
                  HasSubstr("relative position embeddings"))
          << which;
    }
  }
}

TEST(CudnnSdpaTest, SequenceLengthsOnlyWhenThePlanMasksPadding) {
  SdpaShape s;
  s.q_len = s.kv_len = s.q_rows = s.kv_rows = 1024;
  EXPECT_FALSE(CudnnSdpa::NeedsSequenceLengths(s));
  s.has_key_lengths = true;
  EXPECT_TRUE(CudnnSdpa::NeedsSequenceLengths(s));
  s.has_key_lengths = false;
  s.kv_len = 1000;  // rows 1000..1023 of K and V are padding
  EXPECT_TRUE(CudnnSdpa::NeedsSequenceLengths(s));
  s.kv_len = 1024;
  s.q_len = s.q_rows = 1;  // a decode row: its own bucket
  EXPECT_FALSE(CudnnSdpa::NeedsSequenceLengths(s));
}

TEST(AttentionSourceTest, ParsesTheThreeNamesAndNamesTheVariableOtherwise) {
  EXPECT_EQ(ParseAttentionSource("").value(), AttentionSource::kAuto);
  EXPECT_EQ(ParseAttentionSource("auto").value(), AttentionSource::kAuto);
  EXPECT_EQ(ParseAttentionSource("cudnn").value(), AttentionSource::kCudnn);
  EXPECT_EQ(ParseAttentionSource("kernels").value(), AttentionSource::kKernels);
  absl::StatusOr<AttentionSource> bad = ParseAttentionSource("flash");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("ATTNSERVE_CUDA_ATTENTION"));
  EXPECT_THAT(bad.status().message(), HasSubstr("'flash'"));
}

TEST(CudnnAvailableTest, OkOrUnavailableNamingTheLibrary) {
  const absl::Status status = CudnnAvailable();
  if (!status.ok()) {
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
    EXPECT_THAT(status.message(), HasSubstr("libcudnn.so.9"));
  }
  EXPECT_EQ(CudnnAvailable(), status) << "loaded once, the same answer after";
  // Without a GPU a handle cannot be made: an error, never a crash.
  absl::StatusOr<std::unique_ptr<CudnnSdpa>> sdpa = CudnnSdpa::Create(4);
  if (!status.ok()) {
    EXPECT_FALSE(sdpa.ok());
  }
}

}  // namespace
}  // namespace attnserve::cuda

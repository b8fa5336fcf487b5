// Paged K/V (sessions): rows appended in chunks into blocks and gathered back
// are the rows; the flash kernel over gathered paged params equals it over
// the contiguous ones bitwise; the cpu engine run step by step through a
// session cache (sdpa and a projection layer) equals one causal stateless
// task over the whole sequence; engines without sessions refuse paged tasks.
#include "engine/paged_kv.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/attention_engine.h"
#include "engine/cpu/flash_attention.h"
#include "engine/model/builtin_models.h"
#include "engine/tensor.h"
#include "gtest/gtest.h"
#include "tests/unit/engine/test_rng.h"

namespace attnserve {
namespace {

using testutil::Rng;

Tensor Random(Rng& rng, Shape shape) {
  Tensor t(DType::kFloat32, std::move(shape));
  for (int64_t i = 0; i < t.num_elements(); ++i) t.data_as<float>()[i] = rng.Normal();
  return t;
}

// Blocks of fp32 K/V for Hkv heads, as the server's pool lays them out.
struct Cache {
  Cache(int64_t hkv, int64_t dk, int64_t dv, int64_t bt, int64_t max_tokens)
      : hkv(hkv), dk(dk), dv(dv), bt(bt) {
    const int64_t blocks = (max_tokens + bt - 1) / bt;
    for (int64_t i = 0; i < blocks; ++i) {
      storage.emplace_back(static_cast<size_t>(hkv * bt * (dk + dv)), std::nanf(""));
      k.push_back(storage.back().data());
      v.push_back(storage.back().data() + hkv * bt * dk);
    }
  }
  PagedKv At(int64_t cached) const {
    PagedKv p;
    p.dtype = DType::kFloat32;
    p.num_kv_heads = hkv;
    p.head_dim = dk;
    p.head_dim_v = dv;
    p.block_tokens = bt;
    p.cached_len = cached;
    p.k_blocks = absl::MakeConstSpan(k);
    p.v_blocks = absl::MakeConstSpan(v);
    return p;
  }
  int64_t hkv, dk, dv, bt;
  std::vector<std::vector<float>> storage;
  std::vector<void*> k, v;
};

// Contiguous head-layout params over q [1,Hq,Lq,Dk], k/v [1,Hkv,Lk,D].
AttentionParams Params(const Tensor& q, const Tensor& k, const Tensor& v, Tensor* out,
                       int64_t q_row0, int64_t lq, int64_t k_row0, int64_t lk) {
  AttentionParams p;
  p.batch = 1;
  p.num_heads = q.shape()[1];
  p.num_kv_heads = k.shape()[1];
  p.head_dim = q.shape()[3];
  p.head_dim_v = v.shape()[3];
  p.q_len = lq;
  p.kv_len = lk;
  HeadLayoutStrides(p.num_heads, q.shape()[2], p.head_dim, &p.q_stride_b, &p.q_stride_h,
                    &p.q_stride_row);
  HeadLayoutStrides(p.num_kv_heads, k.shape()[2], p.head_dim, &p.k_stride_b, &p.k_stride_h,
                    &p.k_stride_row);
  HeadLayoutStrides(p.num_kv_heads, v.shape()[2], p.head_dim_v, &p.v_stride_b, &p.v_stride_h,
                    &p.v_stride_row);
  HeadLayoutStrides(p.num_heads, lq, p.head_dim_v, &p.o_stride_b, &p.o_stride_h,
                    &p.o_stride_row);
  p.q = q.data_as<float>() + q_row0 * p.head_dim;
  p.k = k.data_as<float>() + k_row0 * p.head_dim;
  p.v = v.data_as<float>() + k_row0 * p.head_dim_v;
  p.out = out->data();
  p.causal = true;
  p.scale = 0.25f;
  return p;
}

TEST(PagedKvTest, AppendThenGatherGivesTheRowsAndTheSameAttentionBitwise) {
  Rng rng(1);
  const int64_t hq = 4, hkv = 2, dk = 16, dv = 8, len = 45, bt = 16;
  const Tensor q = Random(rng, {1, hq, 3, dk});
  const Tensor k = Random(rng, {1, hkv, len, dk});
  const Tensor v = Random(rng, {1, hkv, len, dv});
  Cache cache(hkv, dk, dv, bt, len);
  Tensor scratch_out(DType::kFloat32, {1, hq, 3, dv});
  int64_t cached = 0;
  for (int64_t chunk : {7, 1, 20, 17}) {  // crosses block boundaries mid-chunk
    const AttentionParams rows = Params(q, k, v, &scratch_out, 0, 1, cached, chunk);
    ASSERT_TRUE(CheckPagedKv(cache.At(cached), rows).ok());
    AppendPagedRows(cache.At(cached), rows);
    cached += chunk;
  }
  ASSERT_EQ(cached, len);

  Tensor want(DType::kFloat32, {1, hq, 3, dv}), got(DType::kFloat32, {1, hq, 3, dv});
  AttentionParams contiguous = Params(q, k, v, &want, 0, 3, 0, len);
  AttentionParams paged = Params(q, k, v, &got, 0, 3, 0, 0);
  paged.kv_len = 0;
  PointAtPagedKv(cache.At(len), &paged);
  EXPECT_EQ(paged.kv_len, len);
  EXPECT_EQ(paged.k, nullptr);
  std::vector<char> scratch;
  GatherPagedKv(&paged, &scratch);
  ASSERT_EQ(paged.k_blocks, nullptr);
  EXPECT_EQ(std::memcmp(paged.k, k.data(), k.byte_size()), 0);
  EXPECT_EQ(std::memcmp(paged.v, v.data(), v.byte_size()), 0);
  ASSERT_TRUE(cpu::FlashAttention({&contiguous, 1}).ok());
  ASSERT_TRUE(cpu::FlashAttention({&paged, 1}).ok());
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.byte_size()), 0);
}

TEST(PagedKvTest, CheckRefusesShortTablesAndBatches) {
  Rng rng(2);
  const Tensor q = Random(rng, {1, 2, 1, 8}), k = Random(rng, {1, 2, 20, 8}),
               v = Random(rng, {1, 2, 20, 8});
  Tensor out(DType::kFloat32, {1, 2, 1, 8});
  Cache cache(2, 8, 8, 16, 16);  // one block
  AttentionParams rows = Params(q, k, v, &out, 0, 1, 0, 17);
  EXPECT_EQ(CheckPagedKv(cache.At(0), rows).code(), absl::StatusCode::kInvalidArgument);
  rows.kv_len = 16;
  EXPECT_TRUE(CheckPagedKv(cache.At(0), rows).ok());
  rows.batch = 2;
  EXPECT_EQ(CheckPagedKv(cache.At(0), rows).code(), absl::StatusCode::kInvalidArgument);
}

double MaxRelError(const Tensor& got, const Tensor& want) {
  double err = 0, scale = 1e-30;
  for (int64_t i = 0; i < want.num_elements(); ++i) {
    err = std::max(err, std::abs(double(got.data_as<float>()[i]) - want.data_as<float>()[i]));
    scale = std::max(scale, std::abs(double(want.data_as<float>()[i])));
  }
  return err / std::max(scale, 1.0);
}

// Rows [r0, r0 + n) of dim `axis` (1 or 2) of a contiguous tensor, copied.
Tensor Slice(const Tensor& t, int axis, int64_t r0, int64_t n) {
  Shape shape = t.shape();
  const int64_t outer = axis == 1 ? shape[0] : shape[0] * shape[1];
  const int64_t inner = axis == 1 ? shape[2] : shape[3];
  const int64_t len = shape[axis];
  shape[axis] = n;
  Tensor out(DType::kFloat32, shape);
  const int64_t per_row = axis == 1 ? shape[2] : shape[3];
  (void)inner;
  for (int64_t o = 0; o < outer; ++o) {
    std::memcpy(out.data_as<float>() + o * n * per_row,
                t.data_as<float>() + (o * len + r0) * per_row, n * per_row * sizeof(float));
  }
  return out;
}

TEST(PagedKvTest, CpuEngineSessionStepsEqualOneCausalTask) {
  absl::StatusOr<std::unique_ptr<AttentionEngine>> cpu = CreateEngine("cpu");
  ASSERT_TRUE(cpu.ok());
  ASSERT_TRUE((*cpu)->SupportsSessions());
  Rng rng(3);
  enum class Bias { kNone, kAlibi, kRelative, kEmbedded };
  for (const auto& [projections, bias] :
       {std::pair<bool, Bias>{false, Bias::kNone}, {true, Bias::kNone}, {false, Bias::kAlibi},
        {true, Bias::kAlibi}, {true, Bias::kRelative}, {true, Bias::kEmbedded}}) {
    SCOPED_TRACE(absl::StrCat(projections ? "demo-mha" : "sdpa",
                              bias == Bias::kAlibi      ? " with ALiBi"
                              : bias == Bias::kRelative ? " with a relative bias"
                              : bias == Bias::kEmbedded ? " with relative embeddings"
                                                        : ""));
    auto own = std::make_shared<AttentionLayer>(projections ? *MakeDemoMhaLayer()
                                                            : *MakeSdpaLayer());
    // ALiBi's bias and a relative bias follow the distance from each query's
    // position in the whole sequence, so each step's rows must be placed
    // after the cached tokens (a distance of 6: most keys take its ends);
    // so do relative position embeddings, whose key terms read the cache.
    const int64_t heads = projections ? own->config.num_heads : 4;
    for (int64_t h = 0; bias == Bias::kAlibi && h < heads; ++h) {
      own->config.alibi_slopes.push_back(0.5f / static_cast<float>(h + 1));
    }
    if (bias == Bias::kRelative) {
      own->config.relative_bias_distance = 6;
      own->weights.relative_bias = Random(rng, {heads, 13});
      for (int64_t i = 0; i < heads * 13; ++i) own->weights.relative_bias.data_as<float>()[i] *= 4;
      ASSERT_TRUE(ValidateLayer(*own).ok()) << ValidateLayer(*own);
    }
    if (bias == Bias::kEmbedded) {
      const int64_t dim = own->config.head_dim;
      own->config.relative_embeddings = {6, true, true};
      own->weights.relative_key = Random(rng, {heads, dim, 13});
      own->weights.relative_query = Random(rng, {heads, dim, 13});
      ASSERT_TRUE(ValidateLayer(*own).ok()) << ValidateLayer(*own);
    }
    const std::shared_ptr<const AttentionLayer> layer = own;
    const LayerConfig& c = layer->config;
    const int64_t len = 37, hq = projections ? c.num_heads : 4;
    const int64_t hkv = projections ? c.num_kv_heads : 2;
    const int64_t dk = projections ? c.head_dim : 16, dv = projections ? c.head_dim : 8;
    // sdpa: head layout q/k/v; demo-mha: self-attention over hidden states.
    const Tensor x = projections ? Random(rng, {1, len, c.query_dim}) : Random(rng, {1, hq, len, dk});
    const Tensor k = projections ? Tensor() : Random(rng, {1, hkv, len, dk});
    const Tensor v = projections ? Tensor() : Random(rng, {1, hkv, len, dv});
    const Shape out_shape = projections ? Shape{1, len, c.out_dim} : Shape{1, hq, len, dv};
    Tensor want(DType::kFloat32, out_shape);
    AttentionTask full;
    full.query = x.view();
    if (!projections) {
      full.key = k.view();
      full.value = v.view();
    }
    full.causal = true;
    full.scale = ResolveScale(c, 0.0f, dk);
    full.output = want.mutable_view();
    ASSERT_TRUE((*cpu)->Run(*layer, {&full, 1}).ok());

    const int axis = projections ? 1 : 2;
    Cache cache(hkv, dk, dv, 16, len);
    int64_t cached = 0;
    for (int64_t step : {5, 1, 1, 12, 1, 1, 16}) {
      const Tensor qs = Slice(x, axis, cached, step);
      const Tensor ks = projections ? Tensor() : Slice(k, 2, cached, step);
      const Tensor vs = projections ? Tensor() : Slice(v, 2, cached, step);
      Shape os = out_shape;
      os[axis] = step;
      Tensor got(DType::kFloat32, os);
      AttentionTask t = full;
      t.query = qs.view();
      if (!projections) {
        t.key = ks.view();
        t.value = vs.view();
      }
      t.output = got.mutable_view();
      t.paged = cache.At(cached);
      ASSERT_TRUE((*cpu)->Run(*layer, {&t, 1}).ok());
      EXPECT_LE(MaxRelError(got, Slice(want, axis, cached, step)), 1e-6) << "at " << cached;
      cached += step;
    }
    ASSERT_EQ(cached, len);
  }
}

TEST(PagedKvTest, EnginesWithoutSessionsRefusePagedTasks) {
  absl::StatusOr<std::unique_ptr<AttentionEngine>> ref = CreateEngine("reference");
  ASSERT_TRUE(ref.ok());
  EXPECT_FALSE((*ref)->SupportsSessions());
  Rng rng(4);
  const Tensor q = Random(rng, {1, 2, 1, 8}), k = Random(rng, {1, 2, 1, 8});
  Tensor out(DType::kFloat32, {1, 2, 1, 8});
  Cache cache(2, 8, 8, 16, 16);
  AttentionTask t;
  t.query = q.view();
  t.key = k.view();
  t.value = k.view();
  t.scale = 1.0f;
  t.output = out.mutable_view();
  t.paged = cache.At(0);
  EXPECT_EQ((*ref)->Run(*MakeSdpaLayer(), {&t, 1}).code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace attnserve

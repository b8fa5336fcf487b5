// The sessions' kernels (engine/cuda/paged_attention.cu, its source and
// launchers compiled here for the host) run on the CPU by warp_emulator.h:
// the split-KV decode over paged K/V against float64 attention over the
// same cache (attention_oracle.h), through every rule of a session (causal
// bottom-right, grouped-query heads, a sliding window, softcapping, sinks,
// ALiBi, a relative position bias, relative position embeddings, Dv !=
// Dk), a decode of many chunks, and
// a batch of requests sharing one launch giving each request's bits alone;
// append and gather round-trip a cache. Checked without a GPU;
// cuda_engine_test runs them on one.
#include "tests/unit/engine/cuda/warp_emulator.h"  // first: it stands in for the device

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "engine/cuda/paged_attention.cu"  // NOLINT(build/include): the kernels themselves
#include "gtest/gtest.h"
#include "tests/unit/engine/cuda/attention_oracle.h"

namespace attnserve::cuda {
namespace {

using oracle::Case;

// A session's cache: the case's K and V ([1, Hkv, L, D] head layout, in its
// dtype) copied into blocks of `block_tokens` tokens
// ([Hkv][block_tokens][D] each), and the block tables.
struct PagedCache {
  std::vector<std::vector<unsigned char>> k_blocks, v_blocks;
  std::vector<const void*> k_table, v_table;
};

PagedCache Page(const oracle::Inputs& in, int64_t block_tokens) {
  const AttentionParams& a = in.params;
  const size_t elem = DTypeSize(a.dtype);
  const int64_t blocks = (a.kv_len + block_tokens - 1) / block_tokens;
  PagedCache cache;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    for (const bool is_k : {true, false}) {
      const int64_t dim = is_k ? a.head_dim : a.head_dim_v;
      const std::vector<uint8_t>& src = is_k ? in.k_bytes : in.v_bytes;
      const int64_t stride_h = is_k ? a.k_stride_h : a.v_stride_h;
      const int64_t stride_row = is_k ? a.k_stride_row : a.v_stride_row;
      std::vector<unsigned char> block(static_cast<size_t>(a.num_kv_heads * block_tokens * dim) *
                                       elem);
      for (int64_t h = 0; h < a.num_kv_heads; ++h) {
        for (int64_t r = 0; r < block_tokens && blk * block_tokens + r < a.kv_len; ++r) {
          std::memcpy(block.data() + (h * block_tokens + r) * dim * elem,
                      src.data() + (h * stride_h + (blk * block_tokens + r) * stride_row) * elem,
                      dim * elem);
        }
      }
      (is_k ? cache.k_blocks : cache.v_blocks).push_back(std::move(block));
    }
  }
  for (auto& b : cache.k_blocks) cache.k_table.push_back(b.data());
  for (auto& b : cache.v_blocks) cache.v_table.push_back(b.data());
  return cache;
}

// A session request over its whole cache: the case's inputs, paged.
struct Session {
  oracle::Inputs in;
  PagedCache cache;
  AttentionParams params;  // the case's, reading K and V from the blocks
  std::vector<float> scratch;
};

Session MakeSession(const Case& c, int64_t block_tokens, std::mt19937& rng) {
  Session s;
  s.in = oracle::MakeInputs(c, rng);
  s.cache = Page(s.in, block_tokens);
  s.params = s.in.params;
  s.params.k = s.params.v = nullptr;  // the kernels read the blocks
  s.params.k_blocks = s.cache.k_table.data();
  s.params.v_blocks = s.cache.v_table.data();
  s.params.block_tokens = block_tokens;
  s.scratch.resize(PagedDecodeScratchBytes(s.params) / sizeof(float) + 1);
  return s;
}

// A decode-shaped session case: batch 1, causal, head layout.
Case SessionCase(DType dtype, int64_t heads, int64_t kv_heads, int64_t q_len, int64_t kv_len,
                 int64_t dim) {
  return oracle::MakeCase(dtype, 1, heads, kv_heads, q_len, kv_len, dim, /*causal=*/true);
}

// Case c's session (blocks of `block_tokens`) on the split-KV decode,
// against float64.
void DecodeAndCompare(const Case& c, int64_t block_tokens, std::mt19937& rng) {
  SCOPED_TRACE(c.Describe());
  Session s = MakeSession(c, block_tokens, rng);
  ASSERT_TRUE(PagedDecodeSupports(s.params));
  ASSERT_EQ(LaunchPagedDecode(s.params, s.scratch.data(), nullptr), cudaSuccess);
  EXPECT_EQ(oracle::CompareWithFloat64(s.in, s.in.out.data()), 0);
}

TEST(PagedDecodeEmulated, MatchesFloat64ForEverySessionRule) {
  std::mt19937 rng(35);
  int n = 0;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (auto [heads, kv_heads, q_len, kv_len, dim] :
         {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{8, 2, 1, 300, 64},
          {4, 4, 3, 37, 128},
          {8, 2, 16, 200, 64},
          {6, 3, 5, 1, 32},
          {2, 1, 1, 700, 256}}) {
      Case c = SessionCase(dtype, heads, kv_heads, q_len, kv_len, dim);
      // Today's layers' rules on some: a window, softcapping, sinks.
      if (n % 3 == 1) c.window = 50;
      if (n % 4 == 2) c.softcap = 5.0f, c.scale = 0.5f;
      if (n % 5 == 3) c.sinks = true;
      // A multi-row append with a two-sided window (not causal) narrower
      // than the append, so that it cuts keys after a row too.
      if (n == 7) c.causal = false, c.window = 5;
      DecodeAndCompare(c, n % 2 == 0 ? 16 : 64, rng);
      if (HasFatalFailure()) return;
      ++n;
    }
  }
}

// A position bias over a session's cache, each case given its bias by
// `add_bias` (its index n, after the common rules): decode steps and
// multi-row appends whose rows sit after the cached tokens (query i at
// position kv_len - q_len + i, which the biases count from), decode tiles
// whose rows span a group's heads (each row its own head's slope or table
// row), keys split into several chunks, with a window (one two-sided, within
// the append: case 5), softcapping and sinks, in the three dtypes.
void DecodeWithPositionBias(uint32_t seed, const std::function<void(int, Case&)>& add_bias) {
  std::mt19937 rng(seed);
  int n = 0;
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (auto [heads, kv_heads, q_len, kv_len, dim] :
         {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{8, 2, 1, 300, 64},
          {6, 3, 5, 200, 64},
          {4, 4, 16, 150, 128},
          {8, 2, 3, 700, 128}}) {
      Case c = SessionCase(dtype, heads, kv_heads, q_len, kv_len, dim);
      if (n % 3 == 1) c.window = 50;
      if (n % 4 == 2) c.softcap = 5.0f, c.scale = 0.5f;
      if (n % 5 == 3) c.sinks = true;
      if (n == 5) c.causal = false, c.window = 5;
      add_bias(n, c);
      DecodeAndCompare(c, n % 2 == 0 ? 16 : 64, rng);
      if (::testing::Test::HasFatalFailure()) return;
      ++n;
    }
  }
}

// ALiBi: every case with its slopes.
TEST(PagedDecodeEmulated, MatchesFloat64WithAlibi) {
  DecodeWithPositionBias(38, [](int, Case& c) { c.alibi = true; });
}

// A relative position bias table: distances 3 and 5 (the earlier keys
// clamped; the later ones too in case 5's two-sided window, wider than its
// distance 3), one past the whole cache (no clamp), ALiBi's slopes beside it
// on some.
TEST(PagedDecodeEmulated, MatchesFloat64WithRelativeBias) {
  DecodeWithPositionBias(39, [](int n, Case& c) {
    c.relative_bias_distance = n % 2 == 0 ? 3 : 5;
    if (n == 6) c.relative_bias_distance = 1000;
    if (n == 5) c.relative_bias_distance = 3;
    if (n % 4 == 3) c.alibi = true;
  });
}

// Relative position embeddings: the three sets of tables in turn,
// distances 3 and 5 (clamped as the relative bias's above), one past the
// whole cache (no clamp), a relative bias table and ALiBi's slopes beside
// them on some; each tile row its own head's tables against the kv head's
// keys.
TEST(PagedDecodeEmulated, MatchesFloat64WithRelativeEmbeddings) {
  DecodeWithPositionBias(40, [](int n, Case& c) {
    const oracle::Embeddings sets[] = {oracle::Embeddings::kBoth,
                                       oracle::Embeddings::kContentToPosition,
                                       oracle::Embeddings::kPositionToContent};
    c.embeddings = sets[n % 3];
    c.relative_embedding_distance = n % 2 == 0 ? 3 : 5;
    if (n == 6) c.relative_embedding_distance = 1000;
    if (n == 5) c.relative_embedding_distance = 3;
    if (n % 4 == 3) c.alibi = true, c.relative_bias_distance = 4;
  });
}

// Requests of different lengths, rows and heads in one launch of each
// kernel give the bits each gives in a launch of its own.
TEST(PagedDecodeEmulated, ABatchSharingOneLaunchGivesEachRequestsBits) {
  std::mt19937 rng(36);
  std::vector<Session> sessions;
  for (auto [heads, kv_heads, q_len, kv_len] :
       {std::tuple<int64_t, int64_t, int64_t, int64_t>{8, 2, 1, 500},
        {8, 2, 4, 33},
        {4, 4, 1, 129},
        {8, 1, 2, 260}}) {
    sessions.push_back(
        MakeSession(SessionCase(DType::kBFloat16, heads, kv_heads, q_len, kv_len, 64), 16, rng));
  }
  // Alone first.
  std::vector<std::vector<uint8_t>> alone;
  for (Session& s : sessions) {
    ASSERT_EQ(LaunchPagedDecode(s.params, s.scratch.data(), nullptr), cudaSuccess);
    alone.push_back(s.in.out);
    EXPECT_EQ(oracle::CompareWithFloat64(s.in, s.in.out.data()), 0) << s.in.c.Describe();
    std::fill(s.in.out.begin(), s.in.out.end(), 0xff);
  }
  // Together.
  std::vector<AttentionParams> requests;
  std::vector<void*> scratch;
  for (Session& s : sessions) {
    requests.push_back(s.params);
    scratch.push_back(s.scratch.data());
  }
  std::vector<PagedDecodeEntry> entries(sessions.size());
  const PagedDecodeBatchPlan plan = PlanPagedDecodeBatch(
      requests.data(), scratch.data(), static_cast<int>(requests.size()), entries.data());
  ASSERT_EQ(LaunchPagedDecodeBatch(plan, entries.data(), nullptr), cudaSuccess);
  for (size_t i = 0; i < sessions.size(); ++i) {
    EXPECT_EQ(sessions[i].in.out, alone[i]) << "request " << i << " differs in the batch";
  }
}

// Append writes new rows at their positions in the blocks (converting
// dtype), and gather reads the whole cache back contiguous: at its length
// or at more rows per head (zeros past the cache), in head or token layout,
// in the cache's dtype or another.
TEST(PagedDecodeEmulated, AppendThenGatherRoundTripsTheCache) {
  std::mt19937 rng(37);
  const int64_t kv_heads = 2, dim = 64, dim_v = 32, block_tokens = 16, cached = 21, rows = 30;
  const int64_t total = cached + rows;
  const int64_t blocks = (total + block_tokens - 1) / block_tokens;
  std::vector<std::vector<uint16_t>> k_store(blocks), v_store(blocks);
  std::vector<void*> k_table, v_table;
  for (int64_t b = 0; b < blocks; ++b) {
    k_store[b].assign(kv_heads * block_tokens * dim, 0);
    v_store[b].assign(kv_heads * block_tokens * dim_v, 0);
    k_table.push_back(k_store[b].data());
    v_table.push_back(v_store[b].data());
  }
  // The new rows, fp32 [1, Hkv, rows, D], appended into a bf16 cache.
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::vector<float> k_new(kv_heads * rows * dim), v_new(kv_heads * rows * dim_v);
  for (float& x : k_new) x = dist(rng);
  for (float& x : v_new) x = dist(rng);
  AttentionParams add;
  add.batch = 1;
  add.num_heads = add.num_kv_heads = kv_heads;
  add.head_dim = dim;
  add.head_dim_v = dim_v;
  add.kv_len = rows;
  add.dtype = DType::kFloat32;
  add.k = k_new.data();
  add.v = v_new.data();
  HeadLayoutStrides(kv_heads, rows, dim, &add.k_stride_b, &add.k_stride_h, &add.k_stride_row);
  HeadLayoutStrides(kv_heads, rows, dim_v, &add.v_stride_b, &add.v_stride_h, &add.v_stride_row);
  PagedCacheArgs cache;
  cache.dtype = DType::kBFloat16;
  cache.k_blocks = k_table.data();
  cache.v_blocks = v_table.data();
  cache.block_tokens = block_tokens;
  cache.cached_len = cached;
  ASSERT_EQ(LaunchPagedAppend(add, cache, nullptr), cudaSuccess);

  AttentionParams all;
  all.batch = 1;
  all.num_heads = all.num_kv_heads = kv_heads;
  all.head_dim = dim;
  all.head_dim_v = dim_v;
  all.kv_len = total;
  all.dtype = DType::kBFloat16;
  std::vector<const void*> k_const(k_table.begin(), k_table.end());
  std::vector<const void*> v_const(v_table.begin(), v_table.end());
  all.k_blocks = k_const.data();
  all.v_blocks = v_const.data();
  all.block_tokens = block_tokens;
  // Into the cache's dtype at exactly its rows, at a cuDNN bucket's rows (64
  // for 51) in head layout, and at the bucket in token layout converted to
  // fp32 (a projection layer's route): the rows past the cache zeros where
  // the buffers held NaNs.
  struct Target {
    DType dtype;
    int64_t rows;
    bool token_layout;
  };
  for (const Target& target : {Target{DType::kBFloat16, total, false},
                               Target{DType::kBFloat16, 64, false},
                               Target{DType::kFloat32, 64, true}}) {
    SCOPED_TRACE(testing::Message() << "gathered into " << target.rows << " rows per head, "
                                    << DTypeName(target.dtype)
                                    << (target.token_layout ? ", token layout" : ", head layout"));
    const size_t elem = DTypeSize(target.dtype);
    std::vector<unsigned char> k_all(kv_heads * target.rows * dim * elem, 0xff);
    std::vector<unsigned char> v_all(kv_heads * target.rows * dim_v * elem, 0xff);
    const PagedGatherOut out{k_all.data(), v_all.data(), target.dtype, target.rows,
                             target.token_layout};
    ASSERT_EQ(LaunchPagedGather(all, out, nullptr), cudaSuccess);
    // The cache's value at (h, pos, d) of `fresh`'s rows: rows before
    // `cached` were never written (the blocks' zeros), rows past `total`
    // are the padding.
    auto want = [&](const std::vector<float>& fresh, int64_t h, int64_t pos, int64_t d,
                    int64_t width) {
      if (pos < cached || pos >= total) return 0.0f;
      return BFloat16ToFloat(FloatToBFloat16(fresh[(h * rows + pos - cached) * width + d]));
    };
    auto got = [&](const std::vector<unsigned char>& buffer, int64_t h, int64_t pos, int64_t d,
                   int64_t width) {
      const int64_t at = target.token_layout ? (pos * kv_heads + h) * width + d
                                             : (h * target.rows + pos) * width + d;
      return LoadElement(buffer.data(), target.dtype, at);
    };
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t pos = 0; pos < target.rows; ++pos) {
        for (int64_t d = 0; d < dim; ++d) {
          ASSERT_EQ(got(k_all, h, pos, d, dim), want(k_new, h, pos, d, dim))
              << "k h " << h << " pos " << pos << " d " << d;
        }
        for (int64_t d = 0; d < dim_v; ++d) {
          ASSERT_EQ(got(v_all, h, pos, d, dim_v), want(v_new, h, pos, d, dim_v))
              << "v h " << h << " pos " << pos << " d " << d;
        }
      }
    }
  }
  std::vector<uint16_t> small(kv_heads * total * dim);
  EXPECT_EQ(LaunchPagedGather(all, PagedGatherOut{small.data(), small.data(), DType::kBFloat16,
                                                  total - 1, false},
                              nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace attnserve::cuda

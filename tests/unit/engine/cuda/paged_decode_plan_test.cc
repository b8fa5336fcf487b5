// Host-side planning of the batched split-KV decode
// (engine/cuda/paged_attention.h, PlanPagedDecodeBatch), which runs without
// a GPU: every request's grid and scratch, the offsets that let each CUDA
// block find its request, the kernel's template bounds, and the property
// that makes sharing a launch safe: a request's split is the same alone and
// in any batch. Linked against the CUDA backend's objects (the module hides
// them).
#include "engine/cuda/paged_attention.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve::cuda {
namespace {

AttentionParams Decode(int64_t heads, int64_t kv_heads, int64_t dk, int64_t dv, int64_t q_len,
                       int64_t kv_len) {
  AttentionParams a;
  a.batch = 1;
  a.num_heads = heads;
  a.num_kv_heads = kv_heads;
  a.head_dim = dk;
  a.head_dim_v = dv;
  a.q_len = q_len;
  a.kv_len = kv_len;
  a.dtype = a.out_dtype = DType::kBFloat16;
  a.causal = true;
  a.block_tokens = 16;
  static const void* const kTable[1] = {nullptr};
  a.k_blocks = a.v_blocks = kTable;
  return a;
}

// The plan of `requests`, with a distinct fake scratch address each.
PagedDecodeBatchPlan Plan(const std::vector<AttentionParams>& requests,
                          std::vector<PagedDecodeEntry>* entries) {
  std::vector<void*> scratch;
  for (size_t i = 0; i < requests.size(); ++i) {
    scratch.push_back(reinterpret_cast<void*>(uintptr_t{4096} * (i + 1)));
  }
  entries->assign(requests.size(), PagedDecodeEntry{});
  return PlanPagedDecodeBatch(requests.data(), scratch.data(), static_cast<int>(requests.size()),
                              entries->data());
}

TEST(PagedDecodePlanTest, EachRequestsSplitCoversItsKeysAndFitsItsScratch) {
  for (int64_t kv_len : {1, 7, 127, 128, 129, 1000, 4096, 65536, 1 << 20}) {
    for (auto [heads, kv_heads, q_len] :
         {std::tuple{32, 8, 1}, {8, 8, 1}, {16, 2, 16}, {6, 3, 5}}) {
      const AttentionParams a = Decode(heads, kv_heads, 128, 64, q_len, kv_len);
      std::vector<PagedDecodeEntry> e;
      const PagedDecodeBatchPlan plan = Plan({a}, &e);
      SCOPED_TRACE(testing::Message() << "kv_len " << kv_len << " heads " << heads << "/"
                                      << kv_heads << " q_len " << q_len);
      ASSERT_GE(e[0].chunks, 1);
      ASSERT_GE(e[0].chunk_keys, 1);
      // No empty chunk, every key in one: (chunks - 1) * chunk_keys < kv_len
      // <= chunks * chunk_keys.
      EXPECT_LT((e[0].chunks - 1) * e[0].chunk_keys, kv_len);
      EXPECT_GE(e[0].chunks * e[0].chunk_keys, kv_len);
      // No more chunks than kPagedDecodeMinChunkKeys-key pieces of the
      // cache, evened out.
      EXPECT_LE(e[0].chunks, (kv_len + kPagedDecodeMinChunkKeys - 1) / kPagedDecodeMinChunkKeys);
      EXPECT_LE(e[0].chunks * e[0].chunk_keys - kv_len, e[0].chunks - 1);
      // Tiles of up to 8 of a kv head's query rows.
      const int64_t group_rows = heads / kv_heads * q_len;
      EXPECT_EQ(e[0].tiles, (group_rows + 7) / 8);
      EXPECT_EQ(plan.blocks, kv_heads * e[0].tiles * e[0].chunks);
      EXPECT_EQ(plan.rows, heads * q_len);
      EXPECT_EQ(plan.max_tile_rows, std::min<int64_t>(8, group_rows));
      // One partial (max, sum, Dv accumulators) per row and chunk.
      EXPECT_EQ(PagedDecodeScratchBytes(a),
                static_cast<size_t>(heads * q_len * e[0].chunks * (64 + 2)) * sizeof(float));
    }
  }
}

TEST(PagedDecodePlanTest, BlocksAndRowsOfABatchAreEachRequestsInTurn) {
  std::mt19937 rng(1);
  for (int round = 0; round < 50; ++round) {
    std::vector<AttentionParams> requests;
    const int count = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < count; ++i) {
      const int64_t kv_heads = 1 + rng() % 8;
      const int64_t group = 1 + rng() % 8;
      const int64_t q_len = rng() % 5 == 0 ? 0 : 1 + rng() % 16;  // some with nothing to do
      const int64_t kv_len = rng() % 7 == 0 ? 0 : 1 + rng() % 20000;
      requests.push_back(Decode(kv_heads * group, kv_heads, 8 * (1 + rng() % 32),
                                8 * (1 + rng() % 32), q_len, kv_len));
    }
    std::vector<PagedDecodeEntry> entries;
    const PagedDecodeBatchPlan plan = Plan(requests, &entries);
    ASSERT_EQ(plan.count, count);
    int64_t blocks = 0, rows = 0, widest = 0, fullest = 0;
    for (int i = 0; i < count; ++i) {
      const AttentionParams& a = requests[i];
      const PagedDecodeEntry& e = entries[i];
      SCOPED_TRACE(testing::Message() << "round " << round << " request " << i);
      EXPECT_EQ(e.first_block, blocks);
      EXPECT_EQ(e.first_row, rows);
      EXPECT_EQ(e.partial, reinterpret_cast<float*>(uintptr_t{4096} * (i + 1)));
      EXPECT_EQ(e.a.kv_len, a.kv_len);
      EXPECT_EQ(e.a.q_len, a.q_len);
      const bool empty = a.q_len == 0 || a.kv_len == 0;
      // The same split as planned alone: a batch changes no request's sums.
      std::vector<PagedDecodeEntry> alone;
      Plan({a}, &alone);
      EXPECT_EQ(e.tiles, alone[0].tiles);
      EXPECT_EQ(e.chunks, alone[0].chunks);
      EXPECT_EQ(e.chunk_keys, alone[0].chunk_keys);
      if (empty) continue;  // no block and no row: the next request starts here
      blocks += a.num_kv_heads * e.tiles * e.chunks;
      rows += a.num_heads * a.q_len;
      widest = std::max(widest, a.head_dim_v);
      fullest = std::max(fullest, std::min<int64_t>(8, a.num_heads / a.num_kv_heads * a.q_len));
    }
    EXPECT_EQ(plan.blocks, blocks);
    EXPECT_EQ(plan.rows, rows);
    EXPECT_EQ(plan.max_head_dim_v, widest);
    EXPECT_EQ(plan.max_tile_rows, fullest);
  }
}

}  // namespace
}  // namespace attnserve::cuda

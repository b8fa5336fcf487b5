// KvBlockPool: recycling under the budget, blocks carved from huge-page
// slabs, the slab-granular release, and a random allocate/free sequence
// whose blocks must stay disjoint and intact.
#include "server/sessions/kv_block_pool.h"

#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(KvBlockPoolTest, RecyclesBlocksUnderItsBudget) {
  KvBlockPool pool(3 * 100);
  void* a = pool.Allocate(100);
  void* b = pool.Allocate(100);
  void* c = pool.Allocate(100);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 64, 0u);
  EXPECT_EQ(pool.Allocate(100), nullptr);
  pool.Free(b, 100);
  EXPECT_EQ(pool.blocks_used(), 2);
  EXPECT_EQ(pool.blocks_free(), 1);
  EXPECT_EQ(pool.Allocate(100), b);  // reused, not reallocated
  pool.Free(a, 100);
  pool.Free(b, 100);
  // Another size: the free blocks of the first share their slab with c,
  // which is in use, so they cannot make room yet.
  EXPECT_EQ(pool.Allocate(200), nullptr);
  EXPECT_EQ(pool.held_bytes(), 300);
  pool.Free(c, 100);
  // Now the whole slab is free: it is given back and the new size fits.
  void* d = pool.Allocate(200);
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(pool.held_bytes(), 200);
  EXPECT_EQ(pool.blocks_free(), 0);
  EXPECT_EQ(pool.blocks_used(), 1);
  std::memset(d, 1, 200);
  pool.Free(d, 200);
}

// Blocks come from 2 MiB-aligned slabs (transparent huge pages), packed at
// 64-byte strides; a block bigger than a slab gets a slab of its own size.
TEST(KvBlockPoolTest, CarvesBlocksFromHugePageSlabs) {
  constexpr int64_t kSlab = int64_t{2} << 20;
  constexpr int64_t kBlock = 64 * 1024 + 8;  // rounded up to a 64-byte stride
  KvBlockPool pool(int64_t{64} << 20);
  std::vector<char*> blocks;
  for (int i = 0; i < 40; ++i) {
    blocks.push_back(static_cast<char*>(pool.Allocate(kBlock)));
    ASSERT_NE(blocks.back(), nullptr);
    std::memset(blocks.back(), i, kBlock);  // every byte writable
  }
  EXPECT_EQ(reinterpret_cast<uintptr_t>(blocks[0]) % kSlab, 0u);
  const int64_t stride = (kBlock + 63) / 64 * 64;
  const int64_t per_slab = kSlab / stride;  // 31
  for (int64_t i = 1; i < per_slab; ++i) EXPECT_EQ(blocks[i] - blocks[i - 1], stride) << i;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(blocks[per_slab]) % kSlab, 0u);  // the next slab
  for (int i = 0; i < 40; ++i) EXPECT_EQ(blocks[i][kBlock - 1], static_cast<char>(i));
  EXPECT_EQ(pool.held_bytes(), 40 * kBlock);

  void* big = pool.Allocate(3 * kSlab + 5);
  ASSERT_NE(big, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big) % kSlab, 0u);
  std::memset(big, 7, 3 * kSlab + 5);
  pool.Free(big, 3 * kSlab + 5);
  for (char* b : blocks) pool.Free(b, kBlock);
  EXPECT_EQ(pool.blocks_used(), 0);
}

// Random allocations and frees of four sizes (one bigger than a slab)
// under a budget that forces refusals and cross-size releases: every block
// the pool hands out is 64-byte aligned, disjoint from the others (each is
// filled with its own byte and checked when freed), and the counters add up.
TEST(KvBlockPoolTest, RandomAllocateFreeKeepsBlocksDisjointAndCounted) {
  const std::vector<int64_t> sizes = {100, 4096 + 8, 70000, (int64_t{3} << 20) + 64};
  KvBlockPool pool(int64_t{12} << 20);
  struct Live {
    char* p;
    int64_t bytes;
    char fill;
  };
  std::vector<Live> live;
  std::mt19937 gen(17);
  int refused = 0, released = 0;
  auto check_and_free = [&](size_t i) {
    const Live& b = live[i];
    for (int64_t k = 0; k < b.bytes; k += 997) ASSERT_EQ(b.p[k], b.fill) << "block of " << b.bytes;
    ASSERT_EQ(b.p[b.bytes - 1], b.fill);
    pool.Free(b.p, b.bytes);
    live[i] = live.back();
    live.pop_back();
  };
  for (int step = 0; step < 3000; ++step) {
    if (live.empty() || gen() % 3 != 0) {
      // Mostly one size at a time, so other sizes' slabs fall free.
      const int64_t bytes = sizes[(step / 500 + (gen() % 4 == 0 ? 1 : 0)) % sizes.size()];
      const int64_t held = pool.held_bytes();
      char* p = static_cast<char*>(pool.Allocate(bytes));
      if (p != nullptr && pool.held_bytes() < held + bytes) ++released;  // other sizes' slabs went
      if (p == nullptr) {
        ++refused;
        if (!live.empty()) check_and_free(gen() % live.size());
        continue;
      }
      ASSERT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
      const char fill = static_cast<char>(1 + step % 250);
      std::memset(p, fill, static_cast<size_t>(bytes));
      live.push_back({p, bytes, fill});
    } else {
      check_and_free(gen() % live.size());
    }
    if (HasFatalFailure()) return;
    ASSERT_EQ(pool.blocks_used(), static_cast<int64_t>(live.size()));
    ASSERT_LE(pool.held_bytes(), pool.capacity_bytes());
  }
  EXPECT_GT(refused, 0);   // the budget was reached
  EXPECT_GT(released, 0);  // and free slabs of other sizes made room
  while (!live.empty()) {
    check_and_free(live.size() - 1);
    if (HasFatalFailure()) return;
  }
  EXPECT_EQ(pool.blocks_used(), 0);
}

}  // namespace
}  // namespace attnserve

// KvBlockPool: recycling under the budget, blocks carved from huge-page
// slabs, the slab-granular release, and a random allocate/free sequence
// whose blocks must stay disjoint and intact; with an engine's slab memory
// (a fake that hands out addresses nobody may touch), the same decisions
// with every slab mapped and unmapped through it.
#include "server/sessions/kv_block_pool.h"

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
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

// An engine's slab memory that records its calls and hands out addresses in
// a range no one has mapped (like device pointers, the host must never
// dereference them: a pool that did would crash). Optionally refuses.
class FakeSlabMemory final : public KvSlabMemory {
 public:
  void* Map(int64_t bytes) override {
    ++maps;
    if (refuse) return nullptr;
    const uintptr_t base = next_;
    next_ += static_cast<uintptr_t>((bytes + 4095) / 4096 * 4096 + 4096);  // a gap between slabs
    live[base] = bytes;
    return reinterpret_cast<void*>(base);
  }
  void Unmap(void* base, int64_t bytes) override {
    ++unmaps;
    auto it = live.find(reinterpret_cast<uintptr_t>(base));
    ASSERT_NE(it, live.end()) << "unmapped a slab that is not mapped";
    EXPECT_EQ(it->second, bytes) << "unmapped with another size";
    live.erase(it);
  }
  // Whether [p, p + bytes) lies inside one mapped slab.
  bool Holds(const void* p, int64_t bytes) const {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = live.upper_bound(a);
    if (it == live.begin()) return false;
    --it;
    return a + static_cast<uintptr_t>(bytes) <= it->first + static_cast<uintptr_t>(it->second);
  }

  bool refuse = false;
  int maps = 0, unmaps = 0;
  std::map<uintptr_t, int64_t> live;  // base -> bytes

 private:
  uintptr_t next_ = uintptr_t{0x7e0000000000};  // unmapped in this test's process
};

TEST(KvBlockPoolTest, EngineSlabMemoryMapsAndUnmapsEverySlab) {
  auto memory = std::make_shared<FakeSlabMemory>();
  {
    KvBlockPool pool(3 * 100, memory);
    EXPECT_EQ(pool.memory(), memory);
    void* a = pool.Allocate(100);
    void* b = pool.Allocate(100);
    void* c = pool.Allocate(100);
    ASSERT_TRUE(a && b && c);
    EXPECT_EQ(memory->maps, 1);  // one 2 MiB slab carries all three
    ASSERT_EQ(memory->live.size(), 1u);
    EXPECT_EQ(memory->live.begin()->second, int64_t{2} << 20);
    for (void* p : {a, b, c}) {
      EXPECT_TRUE(memory->Holds(p, 100));
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
    }
    EXPECT_EQ(pool.Allocate(100), nullptr);  // the budget, as with host memory
    pool.Free(b, 100);
    EXPECT_EQ(pool.Allocate(100), b);
    pool.Free(a, 100);
    pool.Free(b, 100);
    EXPECT_EQ(pool.Allocate(200), nullptr);  // c keeps the slab
    pool.Free(c, 100);
    void* d = pool.Allocate(200);  // the free slab goes back through Unmap
    ASSERT_NE(d, nullptr);
    EXPECT_EQ(memory->unmaps, 1);
    EXPECT_EQ(memory->maps, 2);
    EXPECT_TRUE(memory->Holds(d, 200));
    EXPECT_EQ(pool.held_bytes(), 200);
    pool.Free(d, 200);
  }
  EXPECT_TRUE(memory->live.empty()) << "the pool's destructor unmaps every slab";
  EXPECT_EQ(memory->maps, memory->unmaps);
}

TEST(KvBlockPoolTest, EngineSlabMemoryRefusalIsAFullPool) {
  auto memory = std::make_shared<FakeSlabMemory>();
  memory->refuse = true;
  KvBlockPool pool(int64_t{64} << 20, memory);
  EXPECT_EQ(pool.Allocate(4096), nullptr);
  EXPECT_EQ(pool.held_bytes(), 0);
  EXPECT_EQ(pool.blocks_used(), 0);
  memory->refuse = false;
  void* b = pool.Allocate(4096);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(pool.held_bytes(), 4096);
  pool.Free(b, 4096);
}

// The same random allocate/free sequence on a host pool and on one over an
// engine's memory: the same refusals and the same counters at every step
// (the budget, eviction pressure and metrics do not depend on where the
// slabs live), and every block of the second inside a slab it mapped.
TEST(KvBlockPoolTest, EngineSlabMemoryKeepsTheHostPoolsDecisions) {
  const std::vector<int64_t> sizes = {100, 4096 + 8, 70000, (int64_t{3} << 20) + 64};
  auto memory = std::make_shared<FakeSlabMemory>();
  {
    KvBlockPool host(int64_t{12} << 20);
    KvBlockPool engine(int64_t{12} << 20, memory);
    struct Live {
      void* host;
      void* engine;
      int64_t bytes;
    };
    std::vector<Live> live;
    std::mt19937 gen(23);
    for (int step = 0; step < 3000; ++step) {
      if (live.empty() || gen() % 3 != 0) {
        const int64_t bytes = sizes[(step / 500 + (gen() % 4 == 0 ? 1 : 0)) % sizes.size()];
        void* h = host.Allocate(bytes);
        void* e = engine.Allocate(bytes);
        ASSERT_EQ(h == nullptr, e == nullptr) << "step " << step;
        if (h == nullptr) {
          if (!live.empty()) {
            const size_t i = gen() % live.size();
            host.Free(live[i].host, live[i].bytes);
            engine.Free(live[i].engine, live[i].bytes);
            live[i] = live.back();
            live.pop_back();
          }
          continue;
        }
        ASSERT_TRUE(memory->Holds(e, bytes)) << "step " << step;
        live.push_back({h, e, bytes});
      } else {
        const size_t i = gen() % live.size();
        host.Free(live[i].host, live[i].bytes);
        engine.Free(live[i].engine, live[i].bytes);
        live[i] = live.back();
        live.pop_back();
      }
      ASSERT_EQ(host.held_bytes(), engine.held_bytes()) << "step " << step;
      ASSERT_EQ(host.blocks_used(), engine.blocks_used()) << "step " << step;
      ASSERT_EQ(host.blocks_free(), engine.blocks_free()) << "step " << step;
    }
    EXPECT_GT(memory->unmaps, 0);  // slabs of other sizes were given back
    for (const Live& b : live) {
      host.Free(b.host, b.bytes);
      engine.Free(b.engine, b.bytes);
    }
  }
  EXPECT_TRUE(memory->live.empty());
  EXPECT_EQ(memory->maps, memory->unmaps);
}

}  // namespace
}  // namespace attnserve

// HostBufferPool: size classes, reuse of freed buffers within the idle
// limits, Contains, a backing without memory, and buffers that outlive the
// pool's other owners.
#include "engine/host_buffer.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace attnserve {
namespace {

// A backing that counts what it hands out and can be told to fail.
struct CountingBacking {
  std::mutex mu;
  int allocations = 0;
  int releases = 0;
  size_t live_bytes = 0;
  bool fail = false;
  std::map<void*, size_t> live;

  HostBufferPool::Backing Make() {
    return {[this](size_t bytes) -> void* {
              std::lock_guard<std::mutex> lock(mu);
              if (fail) return nullptr;
              void* p = std::aligned_alloc(64, bytes);
              ++allocations;
              live_bytes += bytes;
              live[p] = bytes;
              return p;
            },
            [this](void* p, size_t bytes) {
              std::lock_guard<std::mutex> lock(mu);
              EXPECT_EQ(live.at(p), bytes) << "released with another size than allocated";
              live.erase(p);
              live_bytes -= bytes;
              ++releases;
              std::free(p);
            }};
  }
};

TEST(HostBufferPoolTest, SizeClassesAreAtMostAQuarterOverAndFixedPoints) {
  for (size_t n = 1; n < (size_t{1} << 26); n = n * 3 / 2 + 7) {
    const size_t c = HostBufferPool::SizeClass(n);
    EXPECT_GE(c, n);
    EXPECT_LE(c, std::max<size_t>(4096, n + n / 4 + 1)) << n;
    EXPECT_EQ(c % 64, 0u) << n;
    EXPECT_EQ(HostBufferPool::SizeClass(c), c) << n;
  }
  EXPECT_EQ(HostBufferPool::SizeClass(4097), 5120u);
  EXPECT_EQ(HostBufferPool::SizeClass(1 << 20), size_t{1} << 20);
  EXPECT_EQ(HostBufferPool::SizeClass((1 << 20) + 1), (size_t{1} << 20) + (size_t{1} << 18));
}

TEST(HostBufferPoolTest, AFreedBufferIsReusedForTheSameClass) {
  CountingBacking backing;
  auto pool = std::make_shared<HostBufferPool>(backing.Make(), 1 << 20, 1 << 20);
  char* first;
  {
    absl::StatusOr<HostBuffer> a = pool->Allocate(10000);
    ASSERT_TRUE(a.ok());
    EXPECT_EQ(a->size(), 10000u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 64, 0u);
    std::memset(a->data(), 1, a->size());
    first = a->data();
  }
  EXPECT_EQ(pool->idle_bytes(), HostBufferPool::SizeClass(10000));
  absl::StatusOr<HostBuffer> b = pool->Allocate(9000);  // the same class as 10000
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->data(), first);
  EXPECT_EQ(b->size(), 9000u);
  EXPECT_EQ(backing.allocations, 1);
  EXPECT_EQ(pool->idle_bytes(), 0u);
  absl::StatusOr<HostBuffer> c = pool->Allocate(100000);  // another class: new memory
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(backing.allocations, 2);
  absl::StatusOr<HostBuffer> empty = pool->Allocate(0);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->size(), 0u);
  EXPECT_EQ(backing.allocations, 2);
}

TEST(HostBufferPoolTest, IdleMemoryStaysWithinItsLimits) {
  CountingBacking backing;
  // At most 64 KiB kept in all, each buffer at most 32 KiB.
  auto pool = std::make_shared<HostBufferPool>(backing.Make(), 64 << 10, 32 << 10);
  {
    absl::StatusOr<HostBuffer> big = pool->Allocate(40 << 10);
    ASSERT_TRUE(big.ok());
  }
  EXPECT_EQ(pool->idle_bytes(), 0u) << "a buffer over the per-buffer limit is kept";
  EXPECT_EQ(backing.releases, 1);
  {
    std::vector<HostBuffer> held;
    for (int i = 0; i < 5; ++i) {
      absl::StatusOr<HostBuffer> b = pool->Allocate(20 << 10);  // class 20 KiB
      ASSERT_TRUE(b.ok());
      held.push_back(*std::move(b));
    }
  }
  // Three 20 KiB buffers fit under 64 KiB; the other two went back.
  EXPECT_EQ(pool->idle_bytes(), size_t{60} << 10);
  EXPECT_EQ(backing.releases, 3);
  pool.reset();
  EXPECT_EQ(backing.live_bytes, 0u) << "the pool's destructor frees its idle buffers";
  EXPECT_EQ(backing.releases, backing.allocations);
}

TEST(HostBufferPoolTest, ReleaseIdleGivesBackWhatStayedUnusedForAWholeInterval) {
  CountingBacking backing;
  auto pool = std::make_shared<HostBufferPool>(backing.Make(), 1 << 20, 1 << 20);
  const size_t a_class = HostBufferPool::SizeClass(10000);
  const size_t b_class = HostBufferPool::SizeClass(100000);
  {
    absl::StatusOr<HostBuffer> a = pool->Allocate(10000);
    absl::StatusOr<HostBuffer> b = pool->Allocate(100000);
    ASSERT_TRUE(a.ok() && b.ok());
  }
  ASSERT_EQ(pool->idle_bytes(), a_class + b_class);
  // Freed since the last call (there was none): kept one more interval.
  EXPECT_EQ(pool->ReleaseIdle(), 0u);
  EXPECT_EQ(backing.releases, 0);
  // `a`'s class is used again in the interval; `b`'s is not.
  {
    absl::StatusOr<HostBuffer> a = pool->Allocate(9000);
    ASSERT_TRUE(a.ok());
  }
  EXPECT_EQ(backing.allocations, 2) << "the kept buffer was reused";
  EXPECT_EQ(pool->ReleaseIdle(), b_class);
  EXPECT_EQ(backing.releases, 1);
  EXPECT_EQ(pool->idle_bytes(), a_class);
  // Now `a` too stays unused for a whole interval.
  EXPECT_EQ(pool->ReleaseIdle(), a_class);
  EXPECT_EQ(pool->idle_bytes(), 0u);
  EXPECT_EQ(backing.live_bytes, 0u);
  // A released class is allocated afresh, and kept again.
  {
    absl::StatusOr<HostBuffer> b = pool->Allocate(100000);
    ASSERT_TRUE(b.ok());
  }
  EXPECT_EQ(backing.allocations, 3);
  EXPECT_EQ(pool->idle_bytes(), b_class);
}

TEST(HostBufferPoolTest, ContainsOnlyTheBytesOfBuffersHandedOut) {
  CountingBacking backing;
  auto pool = std::make_shared<HostBufferPool>(backing.Make(), 1 << 20, 1 << 20);
  absl::StatusOr<HostBuffer> a = pool->Allocate(8192);
  absl::StatusOr<HostBuffer> b = pool->Allocate(100000);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_TRUE(pool->Contains(a->data(), 8192));
  EXPECT_TRUE(pool->Contains(a->data() + 100, 8000));
  EXPECT_TRUE(pool->Contains(b->data() + 5000, 1000));
  EXPECT_FALSE(pool->Contains(a->data(), HostBufferPool::SizeClass(8192) + 1));
  EXPECT_FALSE(pool->Contains(a->data() - 1, 2));
  int on_stack = 0;
  EXPECT_FALSE(pool->Contains(&on_stack, sizeof(on_stack)));
  const char* freed = b->data();
  b->Reset();
  EXPECT_FALSE(pool->Contains(freed, 1)) << "a buffer given back is not the caller's any more";
  EXPECT_TRUE(pool->Contains(a->data(), 1));
}

TEST(HostBufferPoolTest, ABackingWithoutMemoryIsResourceExhausted) {
  CountingBacking backing;
  backing.fail = true;
  auto pool = std::make_shared<HostBufferPool>(backing.Make(), 1 << 20, 1 << 20);
  absl::StatusOr<HostBuffer> a = pool->Allocate(5000);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(HostBufferPoolTest, BuffersKeepTheirPoolAlive) {
  CountingBacking backing;
  HostBuffer kept;
  {
    auto pool = std::make_shared<HostBufferPool>(backing.Make(), 1 << 20, 1 << 20);
    absl::StatusOr<HostBuffer> a = pool->Allocate(5000);
    ASSERT_TRUE(a.ok());
    kept = *std::move(a);
  }
  std::memset(kept.data(), 7, kept.size());  // still the caller's
  HostBuffer moved = std::move(kept);
  EXPECT_EQ(kept.data(), nullptr);
  moved.Reset();  // back to the pool, whose last owner it was
  EXPECT_EQ(backing.live_bytes, 0u);
  EXPECT_EQ(backing.releases, backing.allocations);
}

TEST(HostBufferPoolTest, OrdinaryMemoryIsAlignedAndWritable) {
  std::shared_ptr<HostBufferPool> pool = HostBufferPool::Ordinary();
  for (size_t n : {1, 63, 4096, 5000, 1 << 20, 5 << 20}) {
    absl::StatusOr<HostBuffer> b = pool->Allocate(n);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(b->data()) % 64, 0u);
    std::memset(b->data(), 3, n);
  }
  EXPECT_LE(pool->idle_bytes(), size_t{128} << 20);
}

// A 16 MiB request's input and answer are kept for the next one (faulting
// 32 MiB of fresh pages in per request cost as much as its attention), up
// to 128 MiB; a buffer over 64 MiB is not kept; buffers of at most 4 MiB
// keep their own 16 MiB.
TEST(HostBufferPoolTest, OrdinaryMemoryKeepsLargeRequestsBuffers) {
  std::shared_ptr<HostBufferPool> pool = HostBufferPool::Ordinary();
  const size_t mib16 = size_t{16} << 20;
  {
    absl::StatusOr<HostBuffer> in = pool->Allocate(mib16);
    absl::StatusOr<HostBuffer> out = pool->Allocate(mib16);
    ASSERT_TRUE(in.ok() && out.ok());
  }
  EXPECT_EQ(pool->idle_bytes(), 2 * mib16);
  {
    absl::StatusOr<HostBuffer> huge = pool->Allocate((size_t{64} << 20) + 1);
    ASSERT_TRUE(huge.ok());
  }
  EXPECT_EQ(pool->idle_bytes(), 2 * mib16);
  {
    std::vector<HostBuffer> held;
    for (int i = 0; i < 10; ++i) {
      absl::StatusOr<HostBuffer> b = pool->Allocate(mib16);
      ASSERT_TRUE(b.ok());
      held.push_back(*std::move(b));
    }
  }
  EXPECT_EQ(pool->idle_bytes(), size_t{128} << 20);
  {
    std::vector<HostBuffer> held;
    for (int i = 0; i < 10; ++i) {
      absl::StatusOr<HostBuffer> b = pool->Allocate(size_t{2} << 20);
      ASSERT_TRUE(b.ok());
      held.push_back(*std::move(b));
    }
  }
  EXPECT_EQ(pool->idle_bytes(), size_t{(128 + 16)} << 20);
  pool->ReleaseIdle();
  EXPECT_EQ(pool->ReleaseIdle(), size_t{(128 + 16)} << 20);
}

TEST(HostBufferPoolTest, EachTierKeepsItsOwnBytes) {
  CountingBacking backing;
  auto pool = std::make_shared<HostBufferPool>(
      backing.Make(), std::vector<HostBufferPool::IdleTier>{{8 << 10, 16 << 10},
                                                            {64 << 10, 64 << 10}});
  {
    std::vector<HostBuffer> held;
    for (int i = 0; i < 3; ++i) {
      for (size_t n : {size_t{8} << 10, size_t{32} << 10}) {
        absl::StatusOr<HostBuffer> b = pool->Allocate(n);
        ASSERT_TRUE(b.ok());
        held.push_back(*std::move(b));
      }
    }
    absl::StatusOr<HostBuffer> over = pool->Allocate(80 << 10);  // fits no tier
    ASSERT_TRUE(over.ok());
    held.push_back(*std::move(over));
  }
  // Two 8 KiB buffers fill the first tier, two 32 KiB the second; the third
  // of each and the 80 KiB one went back.
  EXPECT_EQ(pool->idle_bytes(), size_t{(16 + 64)} << 10);
  EXPECT_EQ(backing.releases, 3);
  // Reusing the first tier's buffers frees room in that tier only.
  absl::StatusOr<HostBuffer> a = pool->Allocate(8 << 10);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(backing.allocations, 7);
  EXPECT_EQ(pool->idle_bytes(), size_t{(8 + 64)} << 10);
}

// Run under TSan by scripts/sanitize.sh tsan.
TEST(HostBufferPoolTest, ThreadsShareOnePool) {
  CountingBacking backing;
  auto safe = std::make_shared<HostBufferPool>(backing.Make(), 1 << 20, 1 << 20);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&safe, t] {
      for (int i = 0; i < 500; ++i) {
        const size_t n = 1000 + static_cast<size_t>((i * 7 + t) % 5) * 3000;
        absl::StatusOr<HostBuffer> b = safe->Allocate(n);
        ASSERT_TRUE(b.ok());
        std::memset(b->data(), t, n);
        EXPECT_TRUE(safe->Contains(b->data(), n));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  safe.reset();
  EXPECT_EQ(backing.live_bytes, 0u);
}

}  // namespace
}  // namespace attnserve

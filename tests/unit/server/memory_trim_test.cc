// MemoryTrimmer: trims on its interval and stops at once when destroyed,
// whatever the interval (a server shutting down never waits for it).
// ConfigureMalloc: a fixed mmap threshold keeps tensor-sized blocks mmapped.
#include "server/memory_trim.h"

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(MemoryTrimmerTest, StopsAtOnceWhateverTheInterval) {
  const auto start = std::chrono::steady_clock::now();
  { MemoryTrimmer trimmer(absl::Hours(1)); }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(MemoryTrimmerTest, TrimsWhileOtherThreadsAllocate) {
  MemoryTrimmer trimmer(absl::Milliseconds(1));
  // Allocation and free racing the trims (malloc_trim takes each arena's
  // lock): nothing to assert but that it neither crashes nor hangs.
  for (int round = 0; round < 200; ++round) {
    std::vector<std::vector<char>> blocks;
    for (int i = 0; i < 16; ++i) blocks.emplace_back(static_cast<size_t>(1) << (10 + i % 10));
  }
}

#if defined(__GLIBC__)
// glibc's default threshold rises to the size of an mmapped block when it is
// freed, so the next block of that size comes from an arena. With the
// threshold fixed (the server's default), every 4 MiB block is mmapped (and
// returned to the OS when freed), however many were freed before it.
TEST(ConfigureMallocTest, FixedThresholdKeepsEveryLargeBlockMmapped) {
  ASSERT_TRUE(ConfigureMalloc(2, int64_t{1} << 20).ok());
  const size_t before = mallinfo2().hblks;
  for (int round = 0; round < 4; ++round) {
    void* block = std::malloc(size_t{4} << 20);
    ASSERT_NE(block, nullptr);
    std::memset(block, round, size_t{4} << 20);
    // A read the compiler cannot drop (else it may elide the whole block).
    ASSERT_EQ(static_cast<volatile char*>(block)[100], static_cast<char>(round));
    EXPECT_EQ(mallinfo2().hblks, before + 1) << "round " << round;
    std::free(block);
  }
}
#endif

}  // namespace
}  // namespace attnserve

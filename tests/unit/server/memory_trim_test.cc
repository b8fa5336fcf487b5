// MemoryTrimmer: trims on its interval and stops at once when destroyed,
// whatever the interval (a server shutting down never waits for it).
#include "server/memory_trim.h"

#include <chrono>
#include <cstdlib>
#include <vector>

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

}  // namespace
}  // namespace attnserve

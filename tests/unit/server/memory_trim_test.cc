// MemoryTrimmer: trims on its interval and stops at once when destroyed,
// whatever the interval (a server shutting down never waits for it).
// ConfigureMalloc: a fixed mmap threshold keeps tensor-sized blocks mmapped
// under glibc's malloc; under another allocator (ASan's, in the sanitizer
// suite) the settings are skipped with the reason; a value glibc's own
// malloc refuses is an error naming the flag.
#include "server/memory_trim.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "gmock/gmock.h"
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

TEST(MemoryTrimmerTest, RunsItsHookBeforeEachTrim) {
  std::atomic<int> runs{0};
  {
    MemoryTrimmer trimmer(absl::Milliseconds(1), [&runs] { runs.fetch_add(1); });
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (runs.load() < 3 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  EXPECT_GE(runs.load(), 3);
  const int after_stop = runs.load();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(runs.load(), after_stop) << "the hook ran after the trimmer stopped";
}

using ::testing::HasSubstr;

// Records what it was asked and answers `answer` (glibc's contract: 1 = set).
struct FakeMallopt {
  static inline int answer = 1;
  static inline std::vector<std::pair<int, int>> calls;
  static int Call(int param, int value) {
    calls.emplace_back(param, value);
    return answer;
  }
};

MallocControl Fake(bool is_glibc, int answer) {
  FakeMallopt::answer = answer;
  FakeMallopt::calls.clear();
  MallocControl c;
  c.is_glibc = is_glibc;
  c.mallopt = &FakeMallopt::Call;
  c.arena_max_param = 101;
  c.mmap_threshold_param = 102;
  c.trim_threshold_param = 103;
  return c;
}

constexpr MallocSettings kServerDefaults{
    .arena_max = 2, .mmap_threshold = 1 << 20, .trim_threshold = 64 << 20};

TEST(ConfigureMallocTest, SetsEachUnderGlibcsMalloc) {
  absl::StatusOr<MallocConfigured> done = ConfigureMallocWith(Fake(true, 1), kServerDefaults);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_TRUE(done->applied);
  EXPECT_EQ(FakeMallopt::calls,
            (std::vector<std::pair<int, int>>{{101, 2}, {102, 1 << 20}, {103, 64 << 20}}));
}

TEST(ConfigureMallocTest, AnotherAllocatorIsSkippedWithTheReasonNotAnError) {
  // ASan's mallopt answers 0 to everything: never called, never fatal.
  absl::StatusOr<MallocConfigured> done = ConfigureMallocWith(Fake(false, 0), kServerDefaults);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_FALSE(done->applied);
  EXPECT_THAT(done->reason, HasSubstr("not glibc's"));
  EXPECT_TRUE(FakeMallopt::calls.empty());
}

TEST(ConfigureMallocTest, GlibcRefusingAValueIsAnErrorNamingTheFlag) {
  absl::StatusOr<MallocConfigured> done = ConfigureMallocWith(Fake(true, 0), kServerDefaults);
  ASSERT_FALSE(done.ok());
  EXPECT_EQ(done.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(done.status().message(), HasSubstr("--malloc-arena-max: glibc refused 2"));
  done = ConfigureMallocWith(Fake(true, 0), {.trim_threshold = 5});
  ASSERT_FALSE(done.ok());
  EXPECT_THAT(done.status().message(), HasSubstr("--malloc-trim-threshold: glibc refused 5"));
  // 0 = glibc's default: not set.
  done = ConfigureMallocWith(Fake(true, 1), {.mmap_threshold = 1 << 20});
  ASSERT_TRUE(done.ok());
  EXPECT_EQ(FakeMallopt::calls, (std::vector<std::pair<int, int>>{{102, 1 << 20}}));
}

TEST(ConfigureMallocTest, ThisProcessGetsAnAnswerNeverAnError) {
  // The real allocator: applied under glibc's malloc, skipped with a reason
  // under a sanitizer's.
  absl::StatusOr<MallocConfigured> done = ConfigureMalloc(kServerDefaults);
  ASSERT_TRUE(done.ok()) << done.status();
  EXPECT_EQ(done->applied, MallocIsGlibcs()) << done->reason;
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  EXPECT_FALSE(MallocIsGlibcs()) << "a sanitizer's malloc replaces glibc's";
#endif
}

#if defined(__GLIBC__)
// glibc's default threshold rises to the size of an mmapped block when it is
// freed, so the next block of that size comes from an arena. With the
// threshold fixed (the server's default), every 4 MiB block is mmapped (and
// returned to the OS when freed), however many were freed before it.
TEST(ConfigureMallocTest, FixedThresholdKeepsEveryLargeBlockMmapped) {
  if (!MallocIsGlibcs()) {
    GTEST_SKIP() << "malloc is not glibc's (a sanitizer's replaces it): glibc's mmap threshold "
                    "and mallinfo2 do not describe its blocks";
  }
  absl::StatusOr<MallocConfigured> done = ConfigureMalloc(kServerDefaults);
  ASSERT_TRUE(done.ok() && done->applied) << done.status();
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

// A request's small blocks (gRPC's receive slices: 4 MiB of 64 KiB here, each
// under the mmap threshold) freed together: with glibc's 128 KiB trim
// threshold the arena gives them back to the OS at once, and the next
// request faults every page in again; with the server's 64 MiB they stay for
// the next request (the trimmer gives them back on its interval).
TEST(ConfigureMallocTest, TrimThresholdKeepsARequestsFreedBlocksForTheNext) {
  if (!MallocIsGlibcs()) {
    GTEST_SKIP() << "malloc is not glibc's (a sanitizer's replaces it): mallopt and mallinfo2 "
                    "do not describe its blocks";
  }
  // Bytes the arenas hold from the OS, before and after freeing the blocks.
  auto held = [](int64_t trim_threshold) {
    MallocSettings settings = kServerDefaults;
    settings.trim_threshold = trim_threshold;
    EXPECT_TRUE(ConfigureMalloc(settings).ok());
    std::vector<void*> blocks;
    for (int i = 0; i < 64; ++i) {
      blocks.push_back(std::malloc(size_t{64} << 10));
      std::memset(blocks.back(), i, size_t{64} << 10);
    }
    const size_t before = mallinfo2().arena;
    for (size_t i = blocks.size(); i-- > 0;) std::free(blocks[i]);
    return std::make_pair(before, mallinfo2().arena);
  };
  const auto [glibc_before, glibc_after] = held(128 << 10);
  EXPECT_LT(glibc_after + (size_t{2} << 20), glibc_before)
      << "with glibc's threshold the freed blocks go back to the OS";
  const auto [server_before, server_after] = held(64 << 20);
  EXPECT_GE(server_after + (size_t{256} << 10), server_before)
      << "with the server's threshold the freed blocks stay in the arena";
  malloc_trim(0);
}
#endif

}  // namespace
}  // namespace attnserve

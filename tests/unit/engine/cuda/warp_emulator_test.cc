// warp_emulator.h's own contract, on small kernels written here: indices,
// barriers that order what they should, and an order of the CUDA threads
// that shows a missing barrier as a wrong value (a GPU may or may not).
// The kernel tests (*_emulated_test) rely on it.
#include "tests/unit/engine/cuda/warp_emulator.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <vector>

namespace attnserve::emu {
namespace {

__global__ void WriteIndices(int* out) {
  out[blockIdx.x * blockDim.x + threadIdx.x] =
      static_cast<int>(blockIdx.x * 1000 + threadIdx.x + gridDim.x * 100000);
}

// Each thread writes its slot of shared memory, then reads another warp's.
template <bool kBlockBarrier>
__global__ void ReadAnotherWarpsSlot(float* out) {
  ATTNSERVE_DYNAMIC_SHARED(raw);
  float* slots = reinterpret_cast<float*>(raw);
  const unsigned t = threadIdx.x;
  slots[t] = static_cast<float>(t);
  if (kBlockBarrier) {
    __syncthreads();
  } else {
    __syncwarp();  // orders the warp's own threads only
  }
  out[t] = slots[(t + 32) % blockDim.x];
}

TEST(WarpEmulator, ThreadsAndBlocksSeeTheirIndices) {
  std::vector<int> out(3 * 64, -1);
  ATTNSERVE_LAUNCH(WriteIndices, 3, 64, 0, nullptr, out.data());
  for (int b = 0; b < 3; ++b) {
    for (int t = 0; t < 64; ++t) EXPECT_EQ(out[b * 64 + t], b * 1000 + t + 300000);
  }
}

TEST(WarpEmulator, SyncthreadsOrdersOneWarpsWriteBeforeAnothersRead) {
  std::vector<float> out(64, -1.0f);
  ATTNSERVE_LAUNCH(ReadAnotherWarpsSlot<true>, 1, 64, 64 * sizeof(float), nullptr, out.data());
  for (int t = 0; t < 64; ++t) EXPECT_EQ(out[t], static_cast<float>((t + 32) % 64)) << t;
}

#if !defined(__SANITIZE_THREAD__)
TEST(WarpEmulator, WithoutSyncthreadsTheFirstWarpReadsBeforeTheSecondWrites) {
  // The first warp runs ahead to its read: what it reads is the fresh
  // block's NaN, not the second warp's value.
  std::vector<float> out(64, -1.0f);
  ATTNSERVE_LAUNCH(ReadAnotherWarpsSlot<false>, 1, 64, 64 * sizeof(float), nullptr, out.data());
  for (int t = 0; t < 32; ++t) EXPECT_TRUE(std::isnan(out[t])) << t << ": " << out[t];
}
#else
TEST(WarpEmulatorDeathTest, UnderTsanAMissingSyncthreadsIsADataRace) {
  // In a child process of its own (TSan's report there, not in this
  // process's log), which exits with TSan's status for a report, 66.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        std::vector<float> out(64, -1.0f);
        ATTNSERVE_LAUNCH(ReadAnotherWarpsSlot<false>, 1, 64, 64 * sizeof(float), nullptr,
                         out.data());
        std::exit(0);
      },
      testing::ExitedWithCode(66), "ThreadSanitizer: data race.*ReadAnotherWarpsSlot");
}
#endif

__global__ void HalfTheBlockSynchronises() {
  if (threadIdx.x < 32) __syncthreads();
}

TEST(WarpEmulatorDeathTest, ABarrierNotEveryThreadReachesStopsTheTest) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(ATTNSERVE_LAUNCH(HalfTheBlockSynchronises, 1, 64, 0, nullptr),
               "barrier that not all of its threads reach");
}

}  // namespace
}  // namespace attnserve::emu

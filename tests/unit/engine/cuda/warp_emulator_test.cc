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

// One tf32 mma: A's row 0 has 1.0 at k = 0 (zeros elsewhere), B's column 0
// has 1.0 at k = 0, C[0][0] starts at 3 * 2^-24; out[0] is D[0][0].
__global__ void OneTf32Mma(float* out) {
  const int lane = static_cast<int>(threadIdx.x);
  const int g = lane / 4, t = lane % 4;
  const uint32_t one = 0x3f800000u;
  const uint32_t a[4] = {g == 0 && t == 0 ? one : 0u, 0u, 0u, 0u};  // a0 = A[g][t]
  const uint32_t b0 = g == 0 && t == 0 ? one : 0u;                   // b0 = B[t][g]
  float d[4] = {lane == 0 ? 3.0f * std::ldexp(1.0f, -24) : 0.0f, 0.0f, 0.0f, 0.0f};
  MmaM16N8K8Tf32(d, a, b0, 0u);
  if (lane == 0) out[0] = d[0];
}

// 1 + 3 * 2^-24 lies halfway between two floats: an fma rounds it to the
// even one, 1 + 2^-22; the tensor cores' truncated sum (Tf32Accumulation::
// kTruncated, 24 bits below the product's leading bit) cuts the
// accumulator to 2^-23 first: 1 + 2^-23. With 22 bits, to 1.
TEST(WarpEmulator, Tf32MmaSumsAsAFusedAddOrAsTheTensorCoresTruncate) {
  float out = 0.0f;
  ATTNSERVE_LAUNCH(OneTf32Mma, 1, 32, 0, nullptr, &out);
  EXPECT_EQ(out, 1.0f + std::ldexp(1.0f, -22));
  {
    const ScopedTf32Accumulation truncated(Tf32Accumulation::kTruncated);
    ATTNSERVE_LAUNCH(OneTf32Mma, 1, 32, 0, nullptr, &out);
    EXPECT_EQ(out, 1.0f + std::ldexp(1.0f, -23));
  }
  {
    const ScopedTf32Accumulation truncated(Tf32Accumulation::kTruncated, 22);
    ATTNSERVE_LAUNCH(OneTf32Mma, 1, 32, 0, nullptr, &out);
    EXPECT_EQ(out, 1.0f);
  }
  ATTNSERVE_LAUNCH(OneTf32Mma, 1, 32, 0, nullptr, &out);  // the scope ended: fused again
  EXPECT_EQ(out, 1.0f + std::ldexp(1.0f, -22));
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

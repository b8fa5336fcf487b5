// The emulated CUDA runtime's streams (cuda_runtime_emulator.h) against
// CUDA's documented ordering rules: work on a stream runs when the host has
// to see it, the event waits CUDA code writes hold back what depends on
// them, and work without them runs in the order that shows the mistake
// (a reader before its writer, a writer before an earlier reader). Copies
// follow the host memory's kind; cuBLAS calls run on their handle's stream.
// The other emulated tests and the emulated CUDA module rely on these
// rules to show a missing event as a wrong result.
#include "tests/unit/engine/cuda/cuda_runtime_emulator.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace attnserve::emu {
namespace {

class Streams : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(cudaStreamCreateWithFlags(&a_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&b_, cudaStreamNonBlocking), cudaSuccess);
    ASSERT_EQ(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming), cudaSuccess);
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&device_), kBytes), cudaSuccess);
  }
  void TearDown() override {
    EXPECT_EQ(cudaFree(device_), cudaSuccess);
    EXPECT_EQ(cudaEventDestroy(event_), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(b_), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(a_), cudaSuccess);
  }

  static constexpr size_t kBytes = 64;
  cudaStream_t a_ = nullptr, b_ = nullptr;
  cudaEvent_t event_ = nullptr;
  unsigned char* device_ = nullptr;
};

TEST_F(Streams, FreshMemoryIsGarbageAndWorkRunsWhenTheStreamIsSynchronised) {
  EXPECT_EQ(device_[0], 0xff);  // what nothing wrote
  ASSERT_EQ(cudaMemsetAsync(device_, 7, kBytes, a_), cudaSuccess);
  EXPECT_EQ(device_[0], 0xff) << "a stream's memset ran before anything waited for it";
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  EXPECT_EQ(device_[0], 7);
  EXPECT_EQ(device_[kBytes - 1], 7);
}

TEST_F(Streams, AReaderOnAnotherStreamSeesTheWriteOnlyThroughAnEvent) {
  for (const bool wait : {false, true}) {
    SCOPED_TRACE(wait ? "with the event" : "without it");
    ASSERT_EQ(cudaMemsetAsync(device_, 0, kBytes, a_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(device_, 1, kBytes, a_), cudaSuccess);  // the writer
    if (wait) {
      ASSERT_EQ(cudaEventRecord(event_, a_), cudaSuccess);
      ASSERT_EQ(cudaStreamWaitEvent(b_, event_, 0), cudaSuccess);
    }
    int seen = -1;
    Enqueue(b_, [this, &seen] { seen = device_[0]; });  // the reader
    // The host waits for both, the writer's stream first.
    ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(b_), cudaSuccess);
    EXPECT_EQ(seen, wait ? 1 : 0);
  }
}

TEST_F(Streams, AWriterOnAnotherStreamWaitsForAnEarlierReaderOnlyThroughAnEvent) {
  for (const bool wait : {false, true}) {
    SCOPED_TRACE(wait ? "with the event" : "without it");
    ASSERT_EQ(cudaMemsetAsync(device_, 3, kBytes, b_), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(b_), cudaSuccess);
    int seen = -1;
    Enqueue(a_, [this, &seen] { seen = device_[0]; });  // the reader
    if (wait) {
      ASSERT_EQ(cudaEventRecord(event_, a_), cudaSuccess);
      ASSERT_EQ(cudaStreamWaitEvent(b_, event_, 0), cudaSuccess);
    }
    ASSERT_EQ(cudaMemsetAsync(device_, 4, kBytes, b_), cudaSuccess);  // the next writer
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(seen, wait ? 3 : 4);
  }
}

TEST_F(Streams, AnEventSynchronisationRunsItsStreamUpToTheRecord) {
  ASSERT_EQ(cudaMemsetAsync(device_, 5, kBytes / 2, a_), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(event_, a_), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(device_ + kBytes / 2, 6, kBytes / 2, a_), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(event_), cudaErrorNotReady);
  ASSERT_EQ(cudaEventSynchronize(event_), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(event_), cudaSuccess);
  EXPECT_EQ(device_[0], 5);
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  EXPECT_EQ(device_[kBytes - 1], 6);
}

TEST_F(Streams, CopiesReadPageLockedMemoryWhenTheyRunAndPageableMemoryWhenCalled) {
  unsigned char* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&pinned), kBytes, cudaHostAllocDefault),
            cudaSuccess);
  std::memset(pinned, 1, kBytes);
  ASSERT_EQ(cudaMemcpyAsync(device_, pinned, kBytes, cudaMemcpyHostToDevice, a_), cudaSuccess);
  std::memset(pinned, 2, kBytes);  // before the copy has run: CUDA code must not do this
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  EXPECT_EQ(device_[0], 2);

  std::vector<unsigned char> pageable(kBytes, 8);
  ASSERT_EQ(cudaMemcpyAsync(device_, pageable.data(), kBytes, cudaMemcpyHostToDevice, a_),
            cudaSuccess);
  pageable.assign(kBytes, 9);  // CUDA copied it to its own staging before returning
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  EXPECT_EQ(device_[0], 8);
  ASSERT_EQ(cudaFreeHost(pinned), cudaSuccess);
}

TEST_F(Streams, ADownloadIntoPageableMemoryReturnsDoneAndIntoPageLockedMemoryDoesNot) {
  unsigned char* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(reinterpret_cast<void**>(&pinned), kBytes, cudaHostAllocDefault),
            cudaSuccess);
  std::memset(pinned, 0, kBytes);
  ASSERT_EQ(cudaMemsetAsync(device_, 4, kBytes, a_), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned, device_, kBytes, cudaMemcpyDeviceToHost, a_), cudaSuccess);
  EXPECT_EQ(pinned[0], 0);
  std::vector<unsigned char> pageable(kBytes, 0);
  ASSERT_EQ(cudaMemcpyAsync(pageable.data(), device_, kBytes, cudaMemcpyDeviceToHost, a_),
            cudaSuccess);
  EXPECT_EQ(pageable[0], 4);
  EXPECT_EQ(pinned[0], 4);  // earlier on the same stream
  ASSERT_EQ(cudaFreeHost(pinned), cudaSuccess);
}

TEST_F(Streams, FreeSynchronisesTheDeviceAndTheNullStreamRunsAtOnce) {
  void* other = nullptr;
  ASSERT_EQ(cudaMalloc(&other, 16), cudaSuccess);
  ASSERT_EQ(cudaMemsetAsync(device_, 2, kBytes, b_), cudaSuccess);
  ASSERT_EQ(cudaFree(other), cudaSuccess);
  EXPECT_EQ(device_[0], 2);
  bool ran = false;
  Enqueue(nullptr, [&ran] { ran = true; });
  EXPECT_TRUE(ran);
}

TEST_F(Streams, CublasRunsOnItsStreamWithAlphaReadWhenCalled) {
  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(cublasSetStream(handle, a_), CUBLAS_STATUS_SUCCESS);
  float* m = reinterpret_cast<float*>(device_);  // a 2x2 A, a 2x1 x, a 2x1 y
  const float values[] = {1, 2, 3, 4, 1, 1};
  std::memcpy(m, values, sizeof(values));
  float alpha = 2.0f, beta = 0.0f;
  ASSERT_EQ(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, 2, 1, 2, &alpha, m, CUDA_R_32F, 2,
                         m + 4, CUDA_R_32F, 2, &beta, m + 6, CUDA_R_32F, 2, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
  alpha = 100.0f;
  EXPECT_TRUE(std::isnan(m[6])) << "the GEMM ran before its stream was synchronised";
  ASSERT_EQ(cudaStreamSynchronize(a_), cudaSuccess);
  EXPECT_EQ(m[6], 2.0f * (1 + 3));  // column-major: y = alpha A x
  EXPECT_EQ(m[7], 2.0f * (2 + 4));
  ASSERT_EQ(cublasDestroy(handle), CUBLAS_STATUS_SUCCESS);
}

}  // namespace
}  // namespace attnserve::emu

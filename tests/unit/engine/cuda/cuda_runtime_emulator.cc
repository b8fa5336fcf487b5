// Host stand-ins for the CUDA runtime calls the CUDA engine and its kernels'
// launchers make, for code compiled on warp_emulator.h: one device (an
// sm_90 with an H100's shared memory per block), device and page-locked
// memory from the host's heap, streams and events that run nothing (every
// copy, memset and launch completes when its call returns, so a stream's
// order is program order). Linked into every emulated test and into the
// emulated CUDA module (libattnserve_cuda_emulated.so). Test-only; written
// here.
#include "tests/unit/engine/cuda/cuda_runtime_emulator.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace attnserve::emu {

int& MaxSharedOptin() {
  static int bytes = 227 * 1024;  // an H100's (and H200's)
  return bytes;
}

}  // namespace attnserve::emu

namespace {

constexpr size_t kAlignment = 256;  // what cudaMalloc guarantees

void* Allocate(size_t bytes) {
  return std::aligned_alloc(kAlignment, (std::max<size_t>(bytes, 1) + kAlignment - 1) /
                                            kAlignment * kAlignment);
}

}  // namespace

extern "C" {

cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaPeekAtLastError(void) { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    default:
      return "cudaError (emulated)";
  }
}
const char* cudaGetErrorString(cudaError_t error) { return cudaGetErrorName(error); }

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}
cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrComputeCapabilityMajor:
      *value = 9;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = 0;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = attnserve::emu::MaxSharedOptin();
      return cudaSuccess;
    case cudaDevAttrMultiProcessorCount:
      *value = 132;
      return cudaSuccess;
    default:
      return cudaErrorInvalidValue;
  }
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  *prop = cudaDeviceProp{};
  std::strncpy(prop->name, "attnserve CPU emulation", sizeof(prop->name) - 1);
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 132;
  prop->sharedMemPerBlockOptin = static_cast<size_t>(attnserve::emu::MaxSharedOptin());
  prop->sharedMemPerBlock = 48 * 1024;
  prop->maxThreadsPerBlock = 1024;
  prop->warpSize = 32;
  prop->totalGlobalMem = size_t{80} << 30;
  return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void* /*func*/, cudaFuncAttribute /*attr*/, int /*value*/) {
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t bytes) {
  *ptr = Allocate(bytes);
  return *ptr != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void* ptr) {
  std::free(ptr);  // cudaFree(nullptr) creates the context on a GPU: nothing here
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** ptr, size_t bytes, unsigned int /*flags*/) {
  return cudaMalloc(ptr, bytes);
}
cudaError_t cudaMallocHost(void** ptr, size_t bytes) { return cudaMalloc(ptr, bytes); }
cudaError_t cudaFreeHost(void* ptr) { return cudaFree(ptr); }

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind /*kind*/) {
  if (bytes > 0) std::memmove(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t /*stream*/) {
  return cudaMemcpy(dst, src, bytes, kind);
}
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind /*kind*/,
                              cudaStream_t /*stream*/) {
  if (width > dpitch || width > spitch) return cudaErrorInvalidPitchValue;
  for (size_t r = 0; r < height; ++r) {
    std::memcpy(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch,
                width);
  }
  return cudaSuccess;
}
cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  if (bytes > 0) std::memset(ptr, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t /*stream*/) {
  return cudaMemset(ptr, value, bytes);
}
cudaError_t cudaMemset2DAsync(void* ptr, size_t pitch, int value, size_t width, size_t height,
                              cudaStream_t /*stream*/) {
  if (width > pitch) return cudaErrorInvalidPitchValue;
  for (size_t r = 0; r < height; ++r) {
    std::memset(static_cast<char*>(ptr) + r * pitch, value, width);
  }
  return cudaSuccess;
}

// Streams and events: distinct handles that nothing waits on.
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int /*flags*/) {
  *stream = reinterpret_cast<cudaStream_t>(new char);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete reinterpret_cast<char*>(stream);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t /*stream*/) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t /*stream*/, cudaEvent_t /*event*/,
                                unsigned int /*flags*/) {
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* event) {
  *event = reinterpret_cast<cudaEvent_t>(new char);
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int /*flags*/) {
  return cudaEventCreate(event);
}
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  delete reinterpret_cast<char*>(event);
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t /*event*/, cudaStream_t /*stream*/) { return cudaSuccess; }
cudaError_t cudaEventSynchronize(cudaEvent_t /*event*/) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t /*start*/, cudaEvent_t /*end*/) {
  *ms = 0.0f;
  return cudaSuccess;
}

}  // extern "C"

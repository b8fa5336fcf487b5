// Growing arenas and device buffers over the CUDA runtime allocators.
#include "engine/cuda/device_memory.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/cuda/cuda_status.h"

namespace attnserve::cuda {
namespace {

constexpr size_t kMinChunkBytes = size_t{4} << 20;  // 4 MiB

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

Arena::~Arena() { FreeChunks(); }

void Arena::FreeChunks() {
  for (Chunk& c : chunks_) {
    if (kind_ == Kind::kDevice) {
      (void)cudaFree(c.data);
    } else {
      (void)cudaFreeHost(c.data);
    }
  }
  chunks_.clear();
}

absl::Status Arena::AddChunk(size_t min_bytes) {
  size_t size = std::max(RoundUp(min_bytes, kMinChunkBytes), kMinChunkBytes);
  // Grow geometrically so that a call that keeps asking allocates O(log n) times.
  if (!chunks_.empty()) size = std::max(size, 2 * chunks_.back().size);
  Chunk chunk;
  chunk.size = size;
  const cudaError_t err = kind_ == Kind::kDevice
                              ? cudaMalloc(&chunk.data, size)
                              : cudaHostAlloc(&chunk.data, size, cudaHostAllocDefault);
  if (err != cudaSuccess) {
    return CudaStatus(err, absl::StrCat(kind_ == Kind::kDevice ? "cudaMalloc" : "cudaHostAlloc",
                                        " of ", size, " bytes"));
  }
  chunks_.push_back(chunk);
  return absl::OkStatus();
}

absl::StatusOr<void*> Arena::Allocate(size_t bytes) {
  const size_t size = RoundUp(std::max<size_t>(bytes, 1), kAlignment);
  if (chunks_.empty() || chunks_.back().size - chunks_.back().used < size) {
    ATTNSERVE_CUDA_RETURN_IF_ERROR(AddChunk(size));
  }
  Chunk& chunk = chunks_.back();
  void* p = static_cast<char*>(chunk.data) + chunk.used;
  chunk.used += size;
  used_since_reset_ += size;
  return p;
}

void Arena::Reset() {
  if (chunks_.size() > 1) {
    // The last call outgrew one chunk: keep one that fits it whole next time.
    const size_t needed = used_since_reset_;
    FreeChunks();
    (void)AddChunk(needed);  // on failure Allocate tries again when needed
  }
  for (Chunk& c : chunks_) c.used = 0;
  used_since_reset_ = 0;
}

size_t Arena::capacity() const {
  size_t total = 0;
  for (const Chunk& c : chunks_) total += c.size;
  return total;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) (void)cudaFree(data_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) (void)cudaFree(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(size_t bytes) {
  DeviceBuffer buffer;
  const size_t size = std::max<size_t>(bytes, 1);
  if (const cudaError_t err = cudaMalloc(&buffer.data_, size); err != cudaSuccess) {
    buffer.data_ = nullptr;
    return CudaStatus(err, absl::StrCat("cudaMalloc of ", size, " bytes"));
  }
  buffer.size_ = size;
  return buffer;
}

}  // namespace attnserve::cuda

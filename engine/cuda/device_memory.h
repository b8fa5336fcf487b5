// Memory the CUDA engine allocates once and then reuses: growing arenas of
// device memory and of pinned host memory (for asynchronous copies), and a
// plain owning device buffer for long-lived data such as weights.
#ifndef ATTNSERVE_ENGINE_CUDA_DEVICE_MEMORY_H_
#define ATTNSERVE_ENGINE_CUDA_DEVICE_MEMORY_H_

#include <cstddef>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"

namespace attnserve::cuda {

// Where a component enqueuing GPU work takes its scratch: device memory that
// stays valid until the stream has run it (a call's arena, in the engine).
using DeviceAllocator = absl::FunctionRef<absl::StatusOr<void*>(size_t bytes)>;

// A bump allocator over chunks of device or pinned host memory. A call takes
// what it needs with Allocate and gives it all back with Reset once its work
// on the GPU has finished. When one call needed more than the current chunk,
// Reset replaces the chunks with a single one of the total size, so a
// steady stream of similar calls allocates nothing (no per-request cudaMalloc).
//
// Not thread-safe: each engine workspace owns its own arenas.
class Arena {
 public:
  enum class Kind { kDevice, kPinnedHost };
  // Every allocation starts on this boundary (what cuBLASLt and 16-byte
  // vector loads want).
  static constexpr size_t kAlignment = 256;

  explicit Arena(Kind kind) : kind_(kind) {}
  ~Arena();  // precondition: no work in flight uses the memory
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // `bytes` (at least one alignment unit) that stay valid until Reset.
  // ResourceExhausted when the memory cannot be had.
  absl::StatusOr<void*> Allocate(size_t bytes);

  // Forgets every allocation. Precondition: no work in flight uses them.
  void Reset();

  // Bytes held, over all chunks.
  size_t capacity() const;

 private:
  struct Chunk {
    void* data = nullptr;
    size_t size = 0;
    size_t used = 0;
  };
  absl::Status AddChunk(size_t min_bytes);
  void FreeChunks();

  const Kind kind_;
  std::vector<Chunk> chunks_;
  size_t used_since_reset_ = 0;
};

// One cudaMalloc'd buffer, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  static absl::StatusOr<DeviceBuffer> Allocate(size_t bytes);

  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace attnserve::cuda

#endif  // ATTNSERVE_ENGINE_CUDA_DEVICE_MEMORY_H_

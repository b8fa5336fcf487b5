// Host memory for the tensor bytes of requests. A front end copies each
// tensor's bytes from the wire into a HostBuffer once, and the engine reads
// them there. An engine that uploads fastest from memory of its own (the
// CUDA engine: page-locked memory, which the GPU copies from directly)
// provides the pool its front ends allocate from
// (AttentionEngine::request_memory); the others read ordinary memory, from a
// pool that keeps a few freed buffers so that a large request does not fault
// in fresh pages every time.
#ifndef ATTNSERVE_ENGINE_HOST_BUFFER_H_
#define ATTNSERVE_ENGINE_HOST_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {

class HostBufferPool;

// One buffer from a HostBufferPool; returns itself to the pool when
// destroyed. Move-only. The bytes are 64-byte aligned and uninitialised.
class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(HostBuffer&& other) noexcept { *this = std::move(other); }
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer() { Reset(); }

  char* data() const { return data_; }
  size_t size() const { return size_; }
  // Gives the memory back to its pool now; the buffer is empty afterwards.
  void Reset();

 private:
  friend class HostBufferPool;
  std::shared_ptr<HostBufferPool> pool_;  // null: empty
  char* data_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;  // the size class it came from
};

// Thread-safe. Create with std::make_shared: buffers keep their pool alive.
class HostBufferPool : public std::enable_shared_from_this<HostBufferPool> {
 public:
  // Where the pool's memory comes from: allocate(bytes) returns memory
  // aligned to at least 64 bytes, or nullptr when there is none;
  // release(data, bytes) takes it back.
  struct Backing {
    std::function<void*(size_t bytes)> allocate;
    std::function<void(void* data, size_t bytes)> release;
  };
  // Freed buffers are kept for reuse as long as each is at most
  // `max_idle_buffer` bytes and all kept ones together at most
  // `max_idle_bytes`; the rest go back to the backing at once.
  HostBufferPool(Backing backing, size_t max_idle_bytes, size_t max_idle_buffer);
  ~HostBufferPool();

  // Ordinary memory (aligned operator new), keeping at most 16 MiB of
  // freed buffers of at most 4 MiB each: enough for the requests a busy
  // server recycles, little against its memory limits.
  static std::shared_ptr<HostBufferPool> Ordinary();

  // A buffer of `bytes` (0 allowed: an empty buffer that owns nothing).
  // ResourceExhausted when the backing has no memory.
  absl::StatusOr<HostBuffer> Allocate(size_t bytes);

  // Whether [data, data + bytes) lies inside one buffer of this pool that
  // has not been given back.
  bool Contains(const void* data, size_t bytes) const;

  // The size class a request of `bytes` is rounded up to: 4 KiB at least,
  // then steps of a quarter of the power of two below (at most 25% over).
  static size_t SizeClass(size_t bytes);

  // Bytes of freed buffers kept for reuse.
  size_t idle_bytes() const;

 private:
  friend class HostBuffer;
  void Give(char* data, size_t capacity);

  const Backing backing_;
  const size_t max_idle_bytes_;
  const size_t max_idle_buffer_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<size_t, std::vector<char*>> idle_ ABSL_GUARDED_BY(mu_);  // by size class
  size_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uintptr_t, size_t> out_ ABSL_GUARDED_BY(mu_);  // start -> capacity, handed out
};

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_HOST_BUFFER_H_

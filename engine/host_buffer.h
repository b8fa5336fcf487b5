// Host memory for the tensor bytes of requests. A front end copies each
// tensor's bytes from the wire into a HostBuffer once, and the engine reads
// them there. An engine that uploads fastest from memory of its own (the
// CUDA engine: page-locked memory, which the GPU copies from directly)
// provides the pool its front ends allocate from
// (AttentionEngine::request_memory); the others read ordinary memory, from a
// pool that keeps freed buffers so that a large request does not fault in
// fresh pages every time, and gives back those that stay unused.
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
  // Which freed buffers are kept for reuse: a buffer belongs to the first
  // tier whose `max_buffer` it fits, and is kept while that tier's kept
  // buffers total at most `max_bytes`; the rest go back to the backing at
  // once, as does a buffer that fits no tier.
  struct IdleTier {
    size_t max_buffer;
    size_t max_bytes;
  };
  HostBufferPool(Backing backing, std::vector<IdleTier> tiers);
  // One tier: buffers of at most `max_idle_buffer` bytes, `max_idle_bytes`
  // in all.
  HostBufferPool(Backing backing, size_t max_idle_bytes, size_t max_idle_buffer);
  ~HostBufferPool();

  // Ordinary memory (aligned operator new). Kept: up to 16 MiB of buffers
  // of at most 4 MiB (the many sizes of small requests), and up to 128 MiB
  // of buffers of at most 64 MiB (a 16 MiB request whose input and answer
  // were not kept faulted 8192 fresh pages in, as long as its attention
  // took). ReleaseIdle gives back what stays unused.
  static std::shared_ptr<HostBufferPool> Ordinary();

  // Gives back to the backing every kept buffer that has not been handed
  // out again since the previous call; returns their bytes. Called on an
  // interval (the server's --malloc-trim-interval), what a burst of large
  // requests left behind goes back within two intervals, while a steady
  // load keeps reusing its buffers.
  size_t ReleaseIdle();

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

  // The tier a buffer of `capacity` belongs to; tiers_.size() if none.
  size_t TierOf(size_t capacity) const;

  const Backing backing_;
  const std::vector<IdleTier> tiers_;
  mutable absl::Mutex mu_;
  struct Idle {
    char* data;
    bool seen_by_release;  // idle when ReleaseIdle last ran: goes at the next
  };
  absl::flat_hash_map<size_t, std::vector<Idle>> idle_ ABSL_GUARDED_BY(mu_);  // by size class
  std::vector<size_t> tier_idle_bytes_ ABSL_GUARDED_BY(mu_);  // per tier
  std::map<uintptr_t, size_t> out_ ABSL_GUARDED_BY(mu_);  // start -> capacity, handed out
};

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_HOST_BUFFER_H_

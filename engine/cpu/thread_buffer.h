// Buffers that a thread reuses from one engine call to the next. Internal to
// engine/cpu.
//
// A batch's stacked activations and each worker's chunk buffers are
// megabytes that every call used to allocate and free. The server mmaps every
// block of 1 MiB or more (--malloc-mmap-threshold), so each call mapped fresh
// pages, faulted every one of them in and unmapped them again: a fifth of the
// engine's time at demo-mha B1 L16 batches (perf, docs/PERFORMANCE.md). A
// ThreadBuffer borrows one of the calling thread's slots instead; the slot
// keeps its memory for the thread's next call.
#ifndef ATTNSERVE_ENGINE_CPU_THREAD_BUFFER_H_
#define ATTNSERVE_ENGINE_CPU_THREAD_BUFFER_H_

#include <cstddef>

namespace attnserve::cpu {

// What a buffer holds; two buffers alive at once on one thread use two slots.
enum class BufferSlot : int {
  kQkvActivations,   // the fused [Q K V] projection's output
  kQActivations,     // cross-attention Q, K, V projection outputs
  kKActivations,
  kVActivations,
  kGActivations,     // cross-attention output gate projection
  kCoreOutput,       // the attention core's stacked output
  kLatentQueries,    // a latent layer's session queries, absorbed into the latent
  kLatentOutput,     //   and the core's output over the latent
  kStagedRows,       // RunLinearJobs: chunks gathered once for every panel
  kChunkSrc,         // RunLinearJobs, per worker: one chunk's input,
  kChunkDst,         //   its output,
  kChunkScratchpad,  //   and oneDNN's scratchpad
  kCount,
};

// Memory a thread keeps across calls, all slots together. A buffer released
// while its thread already keeps more is freed instead, so a thread that
// once served a huge batch does not hold that much for ever.
inline constexpr size_t kThreadBufferKeepBytes = size_t{32} << 20;

// One slot of the calling thread, at least `bytes` long and 64-byte aligned,
// for the ThreadBuffer's lifetime; its contents are unspecified. Use it on
// the thread that made it (other threads may read and write the memory while
// it lives). Not reentrant per slot: a second live ThreadBuffer of the same
// thread and slot aborts.
class ThreadBuffer {
 public:
  ThreadBuffer(BufferSlot slot, size_t bytes);  // throws std::bad_alloc
  ~ThreadBuffer();
  ThreadBuffer(const ThreadBuffer&) = delete;
  ThreadBuffer& operator=(const ThreadBuffer&) = delete;

  unsigned char* data() const { return data_; }

  // Bytes the calling thread keeps in its slots between calls (tests).
  static size_t KeptBytes();

 private:
  struct Slots;
  static Slots& ThisThread();

  Slots* slots_;  // the thread's; a ThreadBuffer ends on the thread it began on
  int slot_;
  unsigned char* data_ = nullptr;
};

}  // namespace attnserve::cpu

#endif  // ATTNSERVE_ENGINE_CPU_THREAD_BUFFER_H_

// The memory of one model's KV cache: fixed-size blocks recycled through free
// lists under a byte budget (--kv-cache-bytes), so that a session grows by
// whole blocks and a decode step allocates nothing.
//
// Hand-written: no maintained C++ library does a paged KV cache (vLLM's
// block manager is Python over its own CUDA allocator); what is needed here
// is a budgeted free list.
#ifndef ATTNSERVE_SERVER_SESSIONS_KV_BLOCK_POOL_H_
#define ATTNSERVE_SERVER_SESSIONS_KV_BLOCK_POOL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "engine/attention_engine.h"

namespace attnserve {

// Blocks are sized by the caller: a session's block holds block_tokens
// tokens of K and V for its geometry (Hkv, Dk, Dv, dtype), and every session
// of a projection model has the same one; sdpa sessions take theirs from
// their first request, so a pool may hold a few sizes, each with its own
// free list.
//
// Blocks are carved from slabs of 2 MiB (or a multiple, for bigger blocks),
// mapped 2 MiB-aligned and marked for transparent huge pages
// (MADV_HUGEPAGE): a decode step reads every block of every session, and
// with 4 KiB pages each block's rows cost TLB misses (paged_decode_bench:
// the step 20% slower). The budget counts carved blocks; a partly carved
// slab per block size adds at most one slab to what the pool holds. A slab
// is unmapped when all its blocks are free and another size needs the
// room (so a free block of another size makes room only once the rest of
// its slab is free too), and when the pool is destroyed.
//
// With a KvSlabMemory (the engine's: a GPU's memory) the slabs come from its
// Map and go back through its Unmap instead; sizes, carving, budget and
// release are the same. The pool never reads or writes a block's contents
// (nor does the rest of server/), so blocks may be memory the host cannot
// dereference.
//
// Thread-compatible: the SessionManager's lock guards it.
class KvBlockPool {
 public:
  // `capacity_bytes`: most bytes held in blocks, used or free (> 0).
  // `memory`: where the slabs live; nullptr = host memory mapped here.
  explicit KvBlockPool(int64_t capacity_bytes, std::shared_ptr<KvSlabMemory> memory = nullptr);
  ~KvBlockPool();
  KvBlockPool(const KvBlockPool&) = delete;
  KvBlockPool& operator=(const KvBlockPool&) = delete;

  // The memory the slabs come from (nullptr: host memory).
  const std::shared_ptr<KvSlabMemory>& memory() const { return memory_; }

  // A block of `bytes` (> 0), 64-byte aligned, contents unspecified: a free
  // one of that size, else a new one if the budget allows (free blocks of
  // other sizes are released to make room). nullptr when the budget is
  // spent on blocks in use: the caller evicts a session and retries.
  void* Allocate(int64_t bytes);
  // Returns a block from Allocate(bytes) to its free list.
  void Free(void* block, int64_t bytes);

  int64_t capacity_bytes() const { return capacity_; }
  // Bytes held in blocks (used + free).
  int64_t held_bytes() const { return held_; }
  int64_t blocks_used() const { return used_blocks_; }
  // Blocks on the free lists.
  int64_t blocks_free() const { return free_blocks_; }

 private:
  struct Slab {
    char* base = nullptr;
    int64_t bytes = 0;   // mapped
    int64_t carved = 0;  // blocks handed out so far (used or free)
  };
  struct SizeClass {
    std::vector<void*> free;
    Slab* carving = nullptr;  // the slab new blocks come from, if not full
  };
  // Maps a slab for blocks of `bytes`; nullptr when the OS (or the slab
  // memory) refuses.
  Slab* NewSlab(int64_t bytes);
  // Returns a slab to where it came from.
  void UnmapSlab(const Slab& slab);
  // Unmaps the slabs of sizes other than `bytes` whose blocks are all free,
  // until a block of `bytes` fits the budget or none is left.
  void ReleaseFreeSlabs(int64_t bytes);

  const int64_t capacity_;
  const std::shared_ptr<KvSlabMemory> memory_;  // null: host mmap
  int64_t held_ = 0;
  int64_t used_blocks_ = 0;
  int64_t free_blocks_ = 0;
  std::map<int64_t, SizeClass> sizes_;  // by block size in bytes
  std::map<uintptr_t, Slab> slabs_;     // by base address
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_SESSIONS_KV_BLOCK_POOL_H_

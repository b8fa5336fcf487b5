// Budgeted free lists of KV-cache blocks, carved from huge-page slabs (or
// from the engine's slab memory).
#include "server/sessions/kv_block_pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <iterator>
#include <utility>

namespace attnserve {
namespace {

constexpr int64_t kAlignment = 64;  // a cache line: kernels load rows with vector loads
constexpr int64_t kSlabBytes = int64_t{2} << 20;  // one x86-64 huge page

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// `bytes` (a multiple of kSlabBytes) mapped at a kSlabBytes-aligned address:
// map one slab more, then unmap the unaligned head and the tail.
char* MapAligned(int64_t bytes) {
  const size_t len = static_cast<size_t>(bytes + kSlabBytes);
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(p);
  const uintptr_t aligned = (start + kSlabBytes - 1) / kSlabBytes * kSlabBytes;
  if (aligned > start) munmap(p, aligned - start);
  const uintptr_t end = start + len, used_end = aligned + static_cast<uintptr_t>(bytes);
  if (end > used_end) munmap(reinterpret_cast<void*>(used_end), end - used_end);
  char* base = reinterpret_cast<char*>(aligned);
  madvise(base, static_cast<size_t>(bytes), MADV_HUGEPAGE);  // advice: fine if refused
  return base;
}

}  // namespace

KvBlockPool::KvBlockPool(int64_t capacity_bytes, std::shared_ptr<KvSlabMemory> memory)
    : capacity_(capacity_bytes), memory_(std::move(memory)) {}

KvBlockPool::~KvBlockPool() {
  for (auto& [base, slab] : slabs_) UnmapSlab(slab);
}

void KvBlockPool::UnmapSlab(const Slab& slab) {
  if (memory_ != nullptr) {
    memory_->Unmap(slab.base, slab.bytes);
  } else {
    munmap(slab.base, static_cast<size_t>(slab.bytes));
  }
}

KvBlockPool::Slab* KvBlockPool::NewSlab(int64_t bytes) {
  const int64_t slab_bytes = RoundUp(std::max(bytes, kSlabBytes), kSlabBytes);
  // The engine's memory is used as it comes (its alignment is at least the
  // blocks' kAlignment); host slabs are huge-page aligned.
  char* base = memory_ != nullptr ? static_cast<char*>(memory_->Map(slab_bytes))
                                  : MapAligned(slab_bytes);
  if (base == nullptr) return nullptr;
  Slab& slab = slabs_[reinterpret_cast<uintptr_t>(base)];
  slab.base = base;
  slab.bytes = slab_bytes;
  return &slab;
}

void* KvBlockPool::Allocate(int64_t bytes) {
  SizeClass& size = sizes_[bytes];
  if (!size.free.empty()) {
    void* b = size.free.back();
    size.free.pop_back();
    --free_blocks_;
    ++used_blocks_;
    return b;
  }
  // Make room by giving back free slabs of other sizes (a model whose sdpa
  // sessions changed geometry).
  if (held_ + bytes > capacity_) ReleaseFreeSlabs(bytes);
  if (held_ + bytes > capacity_) return nullptr;
  const int64_t stride = RoundUp(bytes, kAlignment);
  Slab* slab = size.carving;
  if (slab == nullptr || (slab->carved + 1) * stride > slab->bytes) {
    slab = NewSlab(bytes);
    size.carving = slab;
    if (slab == nullptr) return nullptr;
  }
  void* b = slab->base + slab->carved * stride;
  ++slab->carved;
  held_ += bytes;
  ++used_blocks_;
  return b;
}

void KvBlockPool::Free(void* block, int64_t bytes) {
  sizes_[bytes].free.push_back(block);
  --used_blocks_;
  ++free_blocks_;
}

void KvBlockPool::ReleaseFreeSlabs(int64_t bytes) {
  for (auto& [other, size] : sizes_) {
    if (other == bytes || size.free.empty()) continue;
    // Free blocks per slab of this size.
    std::map<uintptr_t, int64_t> free_in;
    for (void* b : size.free) {
      auto it = std::prev(slabs_.upper_bound(reinterpret_cast<uintptr_t>(b)));
      ++free_in[it->first];
    }
    for (const auto& [base, n] : free_in) {
      if (held_ + bytes <= capacity_) return;
      Slab& slab = slabs_.at(base);
      if (n != slab.carved) continue;  // some block of it is in use
      const char* lo = slab.base;
      const char* hi = slab.base + slab.bytes;
      std::erase_if(size.free, [&](void* b) {
        return static_cast<const char*>(b) >= lo && static_cast<const char*>(b) < hi;
      });
      free_blocks_ -= n;
      held_ -= n * other;
      if (size.carving == &slab) size.carving = nullptr;
      UnmapSlab(slab);
      slabs_.erase(base);
    }
  }
}

}  // namespace attnserve

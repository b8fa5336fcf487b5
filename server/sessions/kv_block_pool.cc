// Budgeted free lists of KV-cache blocks.
#include "server/sessions/kv_block_pool.h"

#include <cstdlib>
#include <new>

namespace attnserve {
namespace {

constexpr size_t kAlignment = 64;  // a cache line: kernels load rows with vector loads

size_t Rounded(int64_t bytes) {
  return (static_cast<size_t>(bytes) + kAlignment - 1) / kAlignment * kAlignment;
}

}  // namespace

KvBlockPool::KvBlockPool(int64_t capacity_bytes) : capacity_(capacity_bytes) {}

KvBlockPool::~KvBlockPool() {
  for (auto& [bytes, blocks] : free_) {
    for (void* b : blocks) std::free(b);
  }
}

void* KvBlockPool::Allocate(int64_t bytes) {
  std::vector<void*>& same = free_[bytes];
  if (!same.empty()) {
    void* b = same.back();
    same.pop_back();
    --free_blocks_;
    ++used_blocks_;
    return b;
  }
  // Make room by giving back free blocks of other sizes (a model whose sdpa
  // sessions changed geometry).
  for (auto it = free_.begin(); held_ + bytes > capacity_ && it != free_.end(); ++it) {
    while (!it->second.empty() && held_ + bytes > capacity_) {
      std::free(it->second.back());
      it->second.pop_back();
      --free_blocks_;
      held_ -= it->first;
    }
  }
  if (held_ + bytes > capacity_) return nullptr;
  void* b = std::aligned_alloc(kAlignment, Rounded(bytes));
  if (b == nullptr) return nullptr;
  held_ += bytes;
  ++used_blocks_;
  return b;
}

void KvBlockPool::Free(void* block, int64_t bytes) {
  free_[bytes].push_back(block);
  --used_blocks_;
  ++free_blocks_;
}

}  // namespace attnserve

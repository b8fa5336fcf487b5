// HostBufferPool: size classes, a bounded set of freed buffers for reuse
// (given back once unused for a whole ReleaseIdle interval), and the record
// of buffers handed out (Contains).
#include "engine/host_buffer.h"

#include <new>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace attnserve {

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  if (this != &other) {
    Reset();
    pool_ = std::move(other.pool_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

void HostBuffer::Reset() {
  if (pool_ != nullptr && data_ != nullptr) pool_->Give(data_, capacity_);
  pool_.reset();
  data_ = nullptr;
  size_ = 0;
  capacity_ = 0;
}

HostBufferPool::HostBufferPool(Backing backing, std::vector<IdleTier> tiers)
    : backing_(std::move(backing)), tiers_(std::move(tiers)), tier_idle_bytes_(tiers_.size(), 0) {}

HostBufferPool::HostBufferPool(Backing backing, size_t max_idle_bytes, size_t max_idle_buffer)
    : HostBufferPool(std::move(backing), {IdleTier{max_idle_buffer, max_idle_bytes}}) {}

size_t HostBufferPool::TierOf(size_t capacity) const {
  size_t tier = 0;
  while (tier < tiers_.size() && capacity > tiers_[tier].max_buffer) ++tier;
  return tier;
}

HostBufferPool::~HostBufferPool() {
  // Every buffer holds the pool, so none is out any more.
  for (auto& [capacity, buffers] : idle_) {
    for (const Idle& idle : buffers) backing_.release(idle.data, capacity);
  }
}

std::shared_ptr<HostBufferPool> HostBufferPool::Ordinary() {
  constexpr std::align_val_t kAlign{64};
  return std::make_shared<HostBufferPool>(
      Backing{[=](size_t bytes) -> void* { return ::operator new(bytes, kAlign, std::nothrow); },
              [=](void* data, size_t) { ::operator delete(data, kAlign); }},
      std::vector<IdleTier>{{size_t{4} << 20, size_t{16} << 20},
                            {size_t{64} << 20, size_t{128} << 20}});
}

size_t HostBufferPool::SizeClass(size_t bytes) {
  constexpr size_t kMin = 4096;
  if (bytes <= kMin) return kMin;
  size_t power = kMin;  // the largest power of two below `bytes`
  while (power * 2 < bytes) power *= 2;
  const size_t step = power / 4;
  return (bytes + step - 1) / step * step;
}

absl::StatusOr<HostBuffer> HostBufferPool::Allocate(size_t bytes) {
  HostBuffer buffer;
  if (bytes == 0) return buffer;
  const size_t capacity = SizeClass(bytes);
  char* data = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = idle_.find(capacity);
    if (it != idle_.end() && !it->second.empty()) {
      // The most recently freed: the older ones age out.
      data = it->second.back().data;
      it->second.pop_back();
      tier_idle_bytes_[TierOf(capacity)] -= capacity;
    }
  }
  if (data == nullptr) data = static_cast<char*>(backing_.allocate(capacity));
  if (data == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("no host memory for a request tensor of ", bytes, " bytes"));
  }
  {
    absl::MutexLock lock(&mu_);
    out_.emplace(reinterpret_cast<uintptr_t>(data), capacity);
  }
  buffer.pool_ = shared_from_this();
  buffer.data_ = data;
  buffer.size_ = bytes;
  buffer.capacity_ = capacity;
  return buffer;
}

void HostBufferPool::Give(char* data, size_t capacity) {
  {
    absl::MutexLock lock(&mu_);
    out_.erase(reinterpret_cast<uintptr_t>(data));
    const size_t tier = TierOf(capacity);
    if (tier < tiers_.size() && tier_idle_bytes_[tier] + capacity <= tiers_[tier].max_bytes) {
      idle_[capacity].push_back(Idle{data, false});
      tier_idle_bytes_[tier] += capacity;
      return;
    }
  }
  backing_.release(data, capacity);
}

bool HostBufferPool::Contains(const void* data, size_t bytes) const {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  absl::MutexLock lock(&mu_);
  auto it = out_.upper_bound(begin);  // the first buffer starting after `data`
  if (it == out_.begin()) return false;
  --it;
  return begin - it->first + bytes <= it->second;
}

size_t HostBufferPool::ReleaseIdle() {
  std::vector<std::pair<char*, size_t>> released;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [capacity, buffers] : idle_) {
      size_t kept = 0;
      for (Idle& idle : buffers) {
        if (idle.seen_by_release) {
          released.emplace_back(idle.data, capacity);
          tier_idle_bytes_[TierOf(capacity)] -= capacity;
        } else {
          idle.seen_by_release = true;
          buffers[kept++] = idle;
        }
      }
      buffers.resize(kept);
    }
  }
  size_t bytes = 0;
  for (const auto& [data, capacity] : released) {
    backing_.release(data, capacity);
    bytes += capacity;
  }
  return bytes;
}

size_t HostBufferPool::idle_bytes() const {
  absl::MutexLock lock(&mu_);
  size_t bytes = 0;
  for (size_t b : tier_idle_bytes_) bytes += b;
  return bytes;
}

}  // namespace attnserve

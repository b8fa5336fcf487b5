// MemoryTrimmer: the thread that calls malloc_trim.
#include "server/memory_trim.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "absl/strings/str_cat.h"

namespace attnserve {

absl::Status ConfigureMalloc(int arena_max, int64_t mmap_threshold) {
#if defined(__GLIBC__)
  if (arena_max > 0 && mallopt(M_ARENA_MAX, arena_max) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--malloc-arena-max: glibc refused ", arena_max));
  }
  if (mmap_threshold > 0 && mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_threshold)) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--malloc-mmap-threshold: glibc refused ", mmap_threshold));
  }
#else
  (void)arena_max;
  (void)mmap_threshold;
#endif
  return absl::OkStatus();
}

MemoryTrimmer::MemoryTrimmer(absl::Duration interval)
    : interval_(interval), thread_([this] { Loop(); }) {}

MemoryTrimmer::~MemoryTrimmer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void MemoryTrimmer::Loop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    // Wakes early only to stop. The trimmer only paces itself: it decides
    // nothing a client sees, so it reads the real clock.
    mu_.AwaitWithTimeout(absl::Condition(&stop_), interval_);
    if (stop_) return;
    mu_.Unlock();
#if defined(__GLIBC__)
    malloc_trim(0);
#endif
    mu_.Lock();
  }
}

}  // namespace attnserve

// MemoryTrimmer: the thread that calls malloc_trim.
#include "server/memory_trim.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace attnserve {

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

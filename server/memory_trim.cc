// The allocator settings (mallopt where malloc is glibc's) and
// MemoryTrimmer, the thread that calls malloc_trim.
#include "server/memory_trim.h"

#if defined(__GLIBC__)
#include <dlfcn.h>
#include <malloc.h>
#endif

#include "absl/strings/str_cat.h"

namespace attnserve {

bool MallocIsGlibcs() {
#if defined(__GLIBC__)
  // The malloc every call in the process reaches against libc's own: an
  // allocator linked in or preloaded (ASan's runtime, tcmalloc) comes first.
  void* libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
  if (libc == nullptr) return false;
  const void* reached = dlsym(RTLD_DEFAULT, "malloc");
  const void* glibcs = dlsym(libc, "malloc");
  dlclose(libc);
  return reached != nullptr && reached == glibcs;
#else
  return false;
#endif
}

absl::StatusOr<MallocConfigured> ConfigureMallocWith(const MallocControl& control, int arena_max,
                                                     int64_t mmap_threshold) {
  MallocConfigured done;
  if (arena_max <= 0 && mmap_threshold <= 0) {
    done.applied = true;  // nothing asked
    return done;
  }
  if (!control.is_glibc || control.mallopt == nullptr) {
    done.reason =
        "malloc is not glibc's (a sanitizer or another allocator replaces it and ignores "
        "mallopt); its own defaults apply";
    return done;
  }
  if (arena_max > 0 && control.mallopt(control.arena_max_param, arena_max) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--malloc-arena-max: glibc refused ", arena_max));
  }
  if (mmap_threshold > 0 &&
      control.mallopt(control.mmap_threshold_param, static_cast<int>(mmap_threshold)) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--malloc-mmap-threshold: glibc refused ", mmap_threshold));
  }
  done.applied = true;
  return done;
}

absl::StatusOr<MallocConfigured> ConfigureMalloc(int arena_max, int64_t mmap_threshold) {
  MallocControl control;
#if defined(__GLIBC__)
  control.is_glibc = MallocIsGlibcs();
  control.mallopt = &mallopt;
  control.arena_max_param = M_ARENA_MAX;
  control.mmap_threshold_param = M_MMAP_THRESHOLD;
#endif
  return ConfigureMallocWith(control, arena_max, mmap_threshold);
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

// The allocator settings (mallopt where malloc is glibc's) and
// MemoryTrimmer, the thread that calls malloc_trim.
#include "server/memory_trim.h"

#if defined(__GLIBC__)
#include <dlfcn.h>
#include <malloc.h>
#endif

#include <utility>

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

absl::StatusOr<MallocConfigured> ConfigureMallocWith(const MallocControl& control,
                                                     const MallocSettings& settings) {
  MallocConfigured done;
  if (settings.arena_max <= 0 && settings.mmap_threshold <= 0 && settings.trim_threshold <= 0) {
    done.applied = true;  // nothing asked
    return done;
  }
  if (!control.is_glibc || control.mallopt == nullptr) {
    done.reason =
        "malloc is not glibc's (a sanitizer or another allocator replaces it and ignores "
        "mallopt); its own defaults apply";
    return done;
  }
  struct Setting {
    const char* flag;
    int param;
    int64_t value;
  };
  for (const Setting& s : {Setting{"--malloc-arena-max", control.arena_max_param,
                                   settings.arena_max},
                           Setting{"--malloc-mmap-threshold", control.mmap_threshold_param,
                                   settings.mmap_threshold},
                           Setting{"--malloc-trim-threshold", control.trim_threshold_param,
                                   settings.trim_threshold}}) {
    if (s.value > 0 && control.mallopt(s.param, static_cast<int>(s.value)) != 1) {
      return absl::InvalidArgumentError(absl::StrCat(s.flag, ": glibc refused ", s.value));
    }
  }
  done.applied = true;
  return done;
}

absl::StatusOr<MallocConfigured> ConfigureMalloc(const MallocSettings& settings) {
  MallocControl control;
#if defined(__GLIBC__)
  control.is_glibc = MallocIsGlibcs();
  control.mallopt = &mallopt;
  control.arena_max_param = M_ARENA_MAX;
  control.mmap_threshold_param = M_MMAP_THRESHOLD;
  control.trim_threshold_param = M_TRIM_THRESHOLD;
#endif
  return ConfigureMallocWith(control, settings);
}

MemoryTrimmer::MemoryTrimmer(absl::Duration interval, std::function<void()> before_trim)
    : interval_(interval), before_trim_(std::move(before_trim)), thread_([this] { Loop(); }) {}

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
    if (before_trim_) before_trim_();
#if defined(__GLIBC__)
    malloc_trim(0);
#endif
    mu_.Lock();
  }
}

}  // namespace attnserve

// Gives the heap memory the process has freed back to the OS at a fixed
// interval. glibc keeps freed memory in its per-thread arenas; with requests
// of very different sizes decoded, computed and answered on many threads,
// RSS then creeps up for a long time although the live heap stays flat (the
// soak measured 73 MB held against 19 MB in use after 30 minutes).
#ifndef ATTNSERVE_SERVER_MEMORY_TRIM_H_
#define ATTNSERVE_SERVER_MEMORY_TRIM_H_

#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnserve {

// What ConfigureMalloc did.
struct MallocConfigured {
  bool applied = false;
  // When not applied: why (malloc is not glibc's: a sanitizer or another
  // allocator replaces it, and such allocators ignore mallopt).
  std::string reason;
};

// glibc's allocator settings for the server's load. 0 in a field leaves
// glibc's default for it.
struct MallocSettings {
  // At most this many arenas (glibc: 8 per core; with many threads each
  // freed block stays in the arena that made it). --malloc-arena-max.
  int arena_max = 0;
  // Every block of at least this many bytes mmapped (glibc: a threshold that
  // rises to the size of each large block freed, up to 32 MiB, after which
  // tensors come from the arenas and their pages stay there).
  // --malloc-mmap-threshold.
  int64_t mmap_threshold = 0;
  // An arena gives the free memory at its top back to the OS when a free
  // leaves more than this many bytes there (glibc: 128 KiB, or twice its
  // dynamic mmap threshold while that one is in effect; fixing
  // mmap_threshold fixes this one at 128 KiB). A request's small blocks
  // (gRPC's receive slices, protobuf's parse) freed together then shrink the
  // arena by the request's size, and the next request faults every page in
  // again; a MemoryTrimmer gives such memory back on its interval instead.
  // --malloc-trim-threshold.
  int64_t trim_threshold = 0;
};

// Sets glibc's allocator for such a load, before the server starts its
// threads. Best effort where malloc is not glibc's own (AddressSanitizer,
// tcmalloc, jemalloc, or no glibc): nothing is set and the result says why.
// An error, naming the flag and the value, only where glibc's own malloc
// refuses one.
absl::StatusOr<MallocConfigured> ConfigureMalloc(const MallocSettings& settings);

// True when the process's malloc is glibc's own, not one interposed by a
// sanitizer or another allocator.
bool MallocIsGlibcs();

// ConfigureMalloc over an injected allocator interface (tests).
struct MallocControl {
  bool is_glibc = false;
  int (*mallopt)(int param, int value) = nullptr;  // glibc's contract: 1 = set
  int arena_max_param = 0, mmap_threshold_param = 0, trim_threshold_param = 0;
};
absl::StatusOr<MallocConfigured> ConfigureMallocWith(const MallocControl& control,
                                                     const MallocSettings& settings);

// One background thread that calls malloc_trim(0) every `interval` (a no-op
// where the C library has none). Each call walks every arena under its lock
// and madvises whole free pages away: well under a millisecond at this
// server's heap sizes, so a 10 s interval costs nothing measurable. Stops
// (and joins) in the destructor.
class MemoryTrimmer {
 public:
  // `before_trim`, if set, runs on the trimmer's thread before each trim
  // (the server gives its request memory's unused buffers back there).
  explicit MemoryTrimmer(absl::Duration interval, std::function<void()> before_trim = nullptr);
  ~MemoryTrimmer();
  MemoryTrimmer(const MemoryTrimmer&) = delete;
  MemoryTrimmer& operator=(const MemoryTrimmer&) = delete;

 private:
  void Loop();

  const absl::Duration interval_;
  const std::function<void()> before_trim_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_MEMORY_TRIM_H_

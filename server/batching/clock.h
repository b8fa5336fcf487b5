// The time source of the batcher. Injected so that batch-closing and deadline
// decisions can be tested with a fake clock and no sleeps.
#ifndef ATTNSERVE_SERVER_BATCHING_CLOCK_H_
#define ATTNSERVE_SERVER_BATCHING_CLOCK_H_

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace attnserve {

// Thread safety: implementations are thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

// Wall-clock time (absl::Now). Same time base as gRPC deadlines converted
// with absl, so queue deadlines and client deadlines compare directly.
class RealClock final : public Clock {
 public:
  absl::Time Now() const override { return absl::Now(); }

  // A process-wide instance; never destroyed.
  static Clock* Get() {
    static RealClock* clock = new RealClock;
    return clock;
  }
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_BATCHING_CLOCK_H_

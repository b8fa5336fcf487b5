// The one time source of the request path. Every decision that depends on
// time (deadlines, batch closing, queue and compute timing, the shutdown
// grace) reads an injected Clock, so each rule is testable with FakeClock and
// no sleeps.
#ifndef ATTNSERVE_SERVER_REQUEST_CLOCK_H_
#define ATTNSERVE_SERVER_REQUEST_CLOCK_H_

#include <chrono>

#include "absl/time/time.h"

namespace attnserve {

// Times are absl::Time values on a MONOTONIC time base (not wall time): only
// differences and comparisons mean something. absl::InfiniteFuture() stands
// for "never" (no deadline).
//
// Thread safety: implementations are thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;
};

// std::chrono::steady_clock, which never jumps when the wall clock is set.
class MonotonicClock final : public Clock {
 public:
  absl::Time Now() const override {
    return absl::UnixEpoch() + absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
  }

  // A process-wide instance; never destroyed.
  static Clock* Get() {
    static MonotonicClock* clock = new MonotonicClock;
    return clock;
  }
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_REQUEST_CLOCK_H_

// A manually advanced clock for tests: time moves only when the test says so.
#ifndef ATTNSERVE_SERVER_REQUEST_FAKE_CLOCK_H_
#define ATTNSERVE_SERVER_REQUEST_FAKE_CLOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/request/clock.h"

namespace attnserve {

// Thread-safe. Starts at an arbitrary fixed instant (not the Unix epoch, so
// that "deadline 0" bugs show up as far-past deadlines).
class FakeClock final : public Clock {
 public:
  explicit FakeClock(absl::Time start = absl::FromUnixSeconds(1'700'000'000))
      : now_(start) {}

  absl::Time Now() const override {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&mu_);
    now_ += d;
  }
  void Set(absl::Time t) {
    absl::MutexLock lock(&mu_);
    now_ = t;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_REQUEST_FAKE_CLOCK_H_

// CallTracker: the calls and streams a gRPC service has open, so that
// graceful shutdown can refuse newcomers and wait for what it accepted. One
// per service (attnserve.v1, KServe v2); AttnServer::Shutdown drives them.
#ifndef ATTNSERVE_SERVER_TRANSPORT_CALL_TRACKER_H_
#define ATTNSERVE_SERVER_TRANSPORT_CALL_TRACKER_H_

#include <atomic>
#include <cstdint>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace attnserve {

class StreamReactor;

// Thread-safe.
class CallTracker {
 public:
  // Counts a call opened before BeginShutdown (returns true) so that
  // WaitForNoCalls waits for it; calls opened later are not counted (false):
  // the service refuses them (UNAVAILABLE) and shutdown does not wait.
  bool CallStarted();
  // Ends a call for which CallStarted returned true.
  void CallDone();
  // Open streams, told to drain at BeginShutdown. A stream added after it is
  // told at once.
  void AddStream(StreamReactor* stream);
  void RemoveStream(StreamReactor* stream);
  // From now on shutting_down() is true and every open stream drains
  // (StreamReactor::ServerShutdown). Idempotent.
  void BeginShutdown();
  bool shutting_down() const { return shutting_down_.load(); }
  // Waits until every call counted by CallStarted is done, up to `timeout`.
  // True when they all are.
  bool WaitForNoCalls(absl::Duration timeout);

 private:
  std::atomic<bool> shutting_down_{false};
  absl::Mutex calls_mu_;
  int64_t open_calls_ ABSL_GUARDED_BY(calls_mu_) = 0;
  absl::Mutex streams_mu_;
  std::set<StreamReactor*> streams_ ABSL_GUARDED_BY(streams_mu_);
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_CALL_TRACKER_H_

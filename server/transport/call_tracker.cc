// CallTracker: open-call counting and stream draining for graceful shutdown.
#include "server/transport/call_tracker.h"

#include "server/transport/stream_reactor.h"

namespace attnserve {

bool CallTracker::CallStarted() {
  absl::MutexLock lock(&calls_mu_);
  if (shutting_down_.load()) return false;
  ++open_calls_;
  return true;
}

void CallTracker::CallDone() {
  absl::MutexLock lock(&calls_mu_);
  --open_calls_;
}

void CallTracker::AddStream(StreamReactor* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.insert(stream);
  // A stream opened after shutdown began: drain (and so end) it at once.
  if (shutting_down_.load()) stream->ServerShutdown();
}

void CallTracker::RemoveStream(StreamReactor* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.erase(stream);
}

void CallTracker::BeginShutdown() {
  {
    // Under calls_mu_: a call is either counted or sees the flag.
    absl::MutexLock lock(&calls_mu_);
    shutting_down_.store(true);
  }
  absl::MutexLock lock(&streams_mu_);
  for (StreamReactor* stream : streams_) stream->ServerShutdown();
}

bool CallTracker::WaitForNoCalls(absl::Duration timeout) {
  absl::MutexLock lock(&calls_mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) { return open_calls_ == 0; };
  return calls_mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

}  // namespace attnserve

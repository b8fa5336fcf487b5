// The seam between the gRPC service and compute: the service hands over a
// validated request as an AttendWork; a scheduler runs it (alone today, in a
// dynamic batch later) and reports back through its completion callback.
// Nothing here knows about gRPC or protobuf.
#ifndef ATTNSERVE_SERVER_ATTEND_SCHEDULER_H_
#define ATTNSERVE_SERVER_ATTEND_SCHEDULER_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "engine/attention_task.h"
#include "server/model_registry.h"

namespace attnserve {

using SteadyClock = std::chrono::steady_clock;

// Where a request's time went inside the scheduler.
struct WorkTiming {
  SteadyClock::duration queue{};    // scheduled -> compute started
  SteadyClock::duration compute{};  // compute started -> finished
  int batch_requests = 0;           // requests that shared the engine call
};

// One request, ready to run.
struct AttendWork {
  // Keeps the layer and engine alive while the work exists.
  std::shared_ptr<const ServedModel> model;
  // Validated; output (and weights) point at the response's buffers. Every
  // buffer the task points to stays valid until `done` has been called.
  AttentionTask task;
  // Set by the caller right before Schedule().
  SteadyClock::time_point scheduled_at;
  // Work still queued at its deadline finishes DeadlineExceeded, without
  // compute. Default: none.
  SteadyClock::time_point deadline = SteadyClock::time_point::max();
  // Optional: true once nobody waits for the result any more (client gone);
  // such work finishes Cancelled without compute. Thread-safe.
  std::function<bool()> is_cancelled;
  // Called exactly once, from a scheduler thread, when the work is finished
  // (OK: task.output is written) or abandoned. Must not block for long.
  absl::AnyInvocable<void(absl::Status status, const WorkTiming& timing)> done;
};

// Thread safety: Schedule may be called concurrently from any thread.
class AttendScheduler {
 public:
  virtual ~AttendScheduler() = default;

  // Non-blocking. On OK the scheduler owns the work (`*work` is reset) and
  // will call its `done` exactly once. On error the caller keeps `*work`,
  // `done` is never called: ResourceExhausted when the queue is full,
  // Unavailable when shutting down.
  virtual absl::Status Schedule(std::unique_ptr<AttendWork>* work) = 0;

  // Hint: some queued work of `model` (empty = any model) may have become
  // cancelled; look now rather than when the next batch closes. Default:
  // nothing (a scheduler that checks at dispatch only).
  virtual void Wake(const std::string& model) {}
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTEND_SCHEDULER_H_

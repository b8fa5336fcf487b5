// One engine call per request, on the executor.
#include "server/unbatched_scheduler.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"

namespace attnserve {

absl::Status UnbatchedScheduler::Schedule(std::unique_ptr<AttendWork>* work) {
  // The closure gets the raw pointer and ownership only on success: on
  // failure the executor leaves the closure unrun and the caller keeps the
  // work. release() after success touches no memory, so it is fine even if
  // a worker has already finished (and freed) the work.
  AttendWork* raw = work->get();
  absl::Status status =
      executor_->Schedule([raw] { Run(std::unique_ptr<AttendWork>(raw)); });
  if (status.ok()) static_cast<void>(work->release());
  return status;
}

void UnbatchedScheduler::Run(std::unique_ptr<AttendWork> work) {
  const SteadyClock::time_point start = SteadyClock::now();
  WorkTiming timing;
  timing.queue = start - work->scheduled_at;
  if (work->is_cancelled && work->is_cancelled()) {
    work->done(absl::CancelledError("request cancelled before compute"), timing);
    return;
  }
  if (start >= work->deadline) {
    work->done(absl::DeadlineExceededError(absl::StrCat(
                   "deadline exceeded after ",
                   std::chrono::duration_cast<std::chrono::microseconds>(timing.queue).count(),
                   " us in the queue, before compute")),
               timing);
    return;
  }
  timing.batch_requests = 1;
  const ServedModel& model = *work->model;
  absl::Status status = model.engine->Run(*model.layer, absl::MakeConstSpan(&work->task, 1));
  timing.compute = SteadyClock::now() - start;
  work->done(std::move(status), timing);
}

}  // namespace attnserve

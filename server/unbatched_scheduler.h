// The simplest AttendScheduler: each request runs alone (batch of one) on an
// Executor worker. The dynamic batcher replaces it behind the same interface.
#ifndef ATTNSERVE_SERVER_UNBATCHED_SCHEDULER_H_
#define ATTNSERVE_SERVER_UNBATCHED_SCHEDULER_H_

#include <memory>

#include "absl/status/status.h"
#include "server/attend_scheduler.h"
#include "server/executor.h"

namespace attnserve {

// Thread-safe. Does not own the executor, which must outlive every
// scheduled work item (shut the executor down before destroying this).
class UnbatchedScheduler final : public AttendScheduler {
 public:
  explicit UnbatchedScheduler(Executor* executor) : executor_(executor) {}

  absl::Status Schedule(std::unique_ptr<AttendWork>* work) override;

 private:
  static void Run(std::unique_ptr<AttendWork> work);

  Executor* const executor_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_UNBATCHED_SCHEDULER_H_

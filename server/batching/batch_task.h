// BatchTask: one request as the batcher sees it (size, timing, cancellation)
// plus its exactly-once completion. No gRPC in here: the server subclasses it.
#ifndef ATTNSERVE_SERVER_BATCHING_BATCH_TASK_H_
#define ATTNSERVE_SERVER_BATCHING_BATCH_TASK_H_

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace attnserve {

// Thread safety: tokens(), deadline() and enqueue_time() are fixed once the
// task is scheduled. cancelled() and Complete() may be called from any
// thread. Complete() takes effect once; later calls are ignored, so a
// cancellation racing with the end of a computation cannot answer twice.
class BatchTask {
 public:
  // tokens: the query tokens of the request (batch * query length), the unit
  // of BatcherOptions::max_batch_tokens. deadline: after it the result is of
  // no use to anyone; absl::InfiniteFuture() for none.
  explicit BatchTask(int64_t tokens,
                     absl::Time deadline = absl::InfiniteFuture())
      : tokens_(tokens), deadline_(deadline) {}
  virtual ~BatchTask() = default;
  BatchTask(const BatchTask&) = delete;
  BatchTask& operator=(const BatchTask&) = delete;

  int64_t tokens() const { return tokens_; }
  absl::Time deadline() const { return deadline_; }
  // Set by the batcher when Schedule accepts the task.
  absl::Time enqueue_time() const { return enqueue_time_; }

  // True once the requester no longer wants the result (client cancelled).
  // The batcher drops such tasks from the queue with CANCELLED. Must be
  // cheap and must not block: it is called under the batcher's lock.
  virtual bool cancelled() const { return false; }

  // Answers the request: OK once the results are in place, or the reason it
  // failed. Only the first call has an effect (returns true); it runs
  // OnComplete on the calling thread. Never call it while holding the
  // batcher's lock.
  bool Complete(absl::Status status) {
    if (completed_.exchange(true, std::memory_order_acq_rel)) return false;
    OnComplete(std::move(status));
    return true;
  }
  bool completed() const { return completed_.load(std::memory_order_acquire); }

 protected:
  // Called exactly once per task that is completed. Must not call back into
  // the batcher that owns the task. The task may be destroyed right after.
  virtual void OnComplete(absl::Status status) = 0;

 private:
  friend class DynamicBatcher;
  const int64_t tokens_;
  const absl::Time deadline_;
  absl::Time enqueue_time_ = absl::InfinitePast();
  std::atomic<bool> completed_{false};
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_BATCHING_BATCH_TASK_H_

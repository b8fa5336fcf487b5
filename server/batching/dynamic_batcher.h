// DynamicBatcher: one model's request queue. Groups queued requests into
// batches (by count, by query tokens, or when the oldest has waited long
// enough; after a batch of session requests, briefly for those sessions'
// next steps) and hands each batch to a worker. No gRPC in here.
#ifndef ATTNSERVE_SERVER_BATCHING_DYNAMIC_BATCHER_H_
#define ATTNSERVE_SERVER_BATCHING_DYNAMIC_BATCHER_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/batching/batcher_options.h"
#include "server/request/clock.h"
#include "server/request/inference_request.h"

namespace attnserve {

// A closed batch: a group of requests computed by one engine call, as
// handed to the process function.
struct Batch {
  // In queue order (oldest first). Never empty. Each one's timing.queue is
  // set (closed_at - enqueued).
  std::vector<std::unique_ptr<InferenceRequest>> requests;
  // Sum of requests[i]->tokens().
  int64_t tokens = 0;
  // When the batch closed.
  absl::Time closed_at;
};

// Thread safety: Schedule, Wake, queue_depth and Shutdown may be called
// concurrently from any thread. ProcessReadyBatches is for manual mode
// (instances == 0) and may run on one thread at a time.
//
// Completion guarantee: every request accepted by Schedule is completed
// exactly once -- by the process function (normally), or by the batcher with
// CANCELLED (requester gave up while queued), DEADLINE_EXCEEDED (deadline
// passed while queued; never computed), UNAVAILABLE (still queued when the
// shutdown grace ran out) or INTERNAL (the process function returned without
// completing it). Requests are destroyed by the batcher after completion.
//
// Time: every decision reads the injected clock.
class DynamicBatcher {
 public:
  // Computes a batch and completes each of its requests
  // (InferenceRequest::Complete).
  // Runs on a worker thread (or the thread calling ProcessReadyBatches /
  // Shutdown in manual mode), never under the batcher's lock. May run
  // concurrently with itself when instances > 1.
  using ProcessFn = std::function<void(Batch& batch)>;
  // Observes the number of queued requests after every change. Called under
  // the batcher's lock: must be cheap and must not call into the batcher.
  using QueueDepthFn = std::function<void(int64_t depth)>;
  // Observes each refill wait's outcome (BatcherOptions::refill_wait): true
  // for a hit. Called under the batcher's lock, as QueueDepthFn.
  using RefillFn = std::function<void(bool hit)>;

  // model: used in status messages. clock: nullptr = MonotonicClock; must outlive
  // the batcher. Starts options.instances worker threads. InvalidArgument for
  // out-of-range options.
  static absl::StatusOr<std::unique_ptr<DynamicBatcher>> Create(
      std::string model, const BatcherOptions& options, ProcessFn process,
      Clock* clock = nullptr, QueueDepthFn on_queue_depth = nullptr,
      RefillFn on_refill = nullptr);

  // Shutdown(absl::ZeroDuration()) unless Shutdown already ran.
  ~DynamicBatcher();
  DynamicBatcher(const DynamicBatcher&) = delete;
  DynamicBatcher& operator=(const DynamicBatcher&) = delete;

  // Non-blocking. On OK the batcher owns the request, sets its `enqueued`,
  // and *request is null. On error *request is untouched and the caller
  // still owns (and must answer) it: RESOURCE_EXHAUSTED when max_queue_size
  // requests are already queued or its bytes would take the queue past
  // max_queue_bytes, UNAVAILABLE once Shutdown has begun,
  // INVALID_ARGUMENT for a null request.
  absl::Status Schedule(std::unique_ptr<InferenceRequest>* request);

  // Re-examines the queue now. Call it after a queued request's cancelled()
  // turned true so that it leaves the queue without waiting for the next
  // batch to close.
  void Wake();

  // Manual mode (instances == 0) only: forms and runs, on the calling thread,
  // every batch that is ready at clock->Now(); fails cancelled and expired
  // requests. Returns the number of batches run. Does nothing (returns 0) in
  // threaded mode.
  int ProcessReadyBatches();

  // Stops accepting (Schedule answers UNAVAILABLE from now on), closes every
  // remaining batch without waiting for max_queue_delay, and waits up to
  // `grace` (on the injected clock) for the queue to drain. Requests still
  // queued after the grace are failed UNAVAILABLE. Batches already being
  // computed cannot be interrupted: Shutdown waits for them, then joins the
  // workers. In manual mode the draining runs on the calling thread.
  // Idempotent; a concurrent second call waits for the first.
  void Shutdown(absl::Duration grace);

  // Requests waiting in the queue (not those being computed).
  int64_t queue_depth() const;
  const std::string& model() const { return model_; }
  const BatcherOptions& options() const { return options_; }

 private:
  enum class State { kRunning, kDraining, kStopped };

  // What FormBatchLocked decided at one instant.
  struct Decision {
    Batch batch;  // requests non-empty: run it now
    // Requests that must never be computed, with the status to fail them
    // with. Completed by the caller after releasing the lock.
    std::vector<std::pair<std::unique_ptr<InferenceRequest>, absl::Status>> dropped;
    // When batch is empty: when the decision may change by the clock alone.
    absl::Time wake_at = absl::InfiniteFuture();
  };

  DynamicBatcher(std::string model, const BatcherOptions& options,
                 ProcessFn process, Clock* clock, QueueDepthFn on_queue_depth,
                 RefillFn on_refill);

  Decision FormBatchLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WorkerLoop();
  // Polls, with mu_ released, until a request is scheduled or
  // options_.idle_spin_us pass (BatcherOptions::idle_spin_us); returns at
  // once if another worker is polling. Called and returns with mu_ held.
  void PollForWorkLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs process_ and completes what it left uncompleted. Without the lock.
  void RunBatch(Batch& batch) ABSL_LOCKS_EXCLUDED(mu_);
  // `requests`: the batch's size; `sessions`: its session requests;
  // `took`: its process time; `arrived_before`: scheduled_ when it started.
  // Sets the next batch's wait, if any.
  void BatchDone(size_t requests, size_t sessions, absl::Duration took, uint64_t arrived_before)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A refill wait ended at `now` with the batch closing: `filled` says
  // whether the target was reached before it ran out. Judges the wait (see
  // kRefillContrast) and sets the backoff.
  void RefillOutcomeLocked(bool filled, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Requests/s scheduled since the pending refill wait began.
  double RefillRateLocked(absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PublishDepthLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes every queued request with status UNAVAILABLE (grace ran out).
  std::vector<std::pair<std::unique_ptr<InferenceRequest>, absl::Status>> TakeAllLocked()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void FailAll(
      std::vector<std::pair<std::unique_ptr<InferenceRequest>, absl::Status>>& requests);

  const std::string model_;
  const BatcherOptions options_;
  const ProcessFn process_;
  Clock* const clock_;
  const QueueDepthFn on_queue_depth_;
  const RefillFn on_refill_;

  mutable absl::Mutex mu_;
  absl::CondVar work_cv_;     // queue or state changed; workers wait on it
  absl::CondVar drained_cv_;  // queue emptied or a batch finished (Shutdown)
  std::deque<std::unique_ptr<InferenceRequest>> queue_ ABSL_GUARDED_BY(mu_);
  // Sum of queue_'s requests' bytes (BatcherOptions::max_queue_bytes).
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  State state_ ABSL_GUARDED_BY(mu_) = State::kRunning;
  int running_batches_ ABSL_GUARDED_BY(mu_) = 0;
  // The wait for answered requests to come back (BatcherOptions::
  // session_wait_us and refill_wait): a finished batch leaves the next one a
  // target (the queue then plus the requests it answered, at most
  // max_batch_requests) to wait for until answered_wait_until_.
  size_t answered_wait_target_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time answered_wait_until_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // Whether the pending wait is a refill wait (its outcome sets the backoff),
  // the refill waits that ran out in a row, and how many more eligible
  // batches skip the refill wait.
  bool refill_pending_ ABSL_GUARDED_BY(mu_) = false;
  int refill_misses_ ABSL_GUARDED_BY(mu_) = 0;
  int refill_skip_ ABSL_GUARDED_BY(mu_) = 0;
  // The pending refill wait's start, its halfway check, scheduled_ at its
  // start, and the arrival rate (requests/s) while the batch before it
  // computed.
  absl::Time refill_started_ ABSL_GUARDED_BY(mu_);
  absl::Time refill_check_at_ ABSL_GUARDED_BY(mu_);
  uint64_t refill_arrived_ ABSL_GUARDED_BY(mu_) = 0;
  double refill_compute_rate_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutdown_started_ ABSL_GUARDED_BY(mu_) = false;
  bool shutdown_done_ ABSL_GUARDED_BY(mu_) = false;

  std::vector<std::thread> workers_;  // written only by Create and Shutdown
  // Requests ever scheduled (what a polling worker watches, lock-free), and
  // whether a worker is polling.
  std::atomic<uint64_t> scheduled_{0};
  std::atomic<bool> polling_{false};
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_BATCHING_DYNAMIC_BATCHER_H_

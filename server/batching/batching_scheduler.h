// BatchingScheduler: the request path's queueing stage. One DynamicBatcher
// per served model; each closed batch goes to the model's engine as ONE
// ragged AttentionEngine::Run call. No gRPC, no protobuf in here.
#ifndef ATTNSERVE_SERVER_BATCHING_BATCHING_SCHEDULER_H_
#define ATTNSERVE_SERVER_BATCHING_BATCHING_SCHEDULER_H_

#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/batching/batcher_options.h"
#include "server/batching/dynamic_batcher.h"
#include "server/metrics/metrics.h"
#include "server/models/model_registry.h"
#include "server/request/clock.h"
#include "server/request/inference_request.h"

namespace attnserve {

// A model's batching options: `defaults` (server flags) with each nonzero
// field of the model's own settings taking precedence.
BatcherOptions ModelBatcherOptions(const BatcherOptions& defaults, const ModelBatching& model);

// Thread safety: Schedule, Wake, WakeAll and Shutdown may be called
// concurrently. Completion: every request accepted by Schedule is completed
// exactly once, from a batcher worker (or from the thread that calls
// Shutdown, for requests failed UNAVAILABLE when the grace runs out).
class BatchingScheduler final {
 public:
  // One batcher per READY model of `registry` (as it is now; models added
  // later are refused with UNAVAILABLE). metrics may be null; otherwise it
  // must outlive this object. clock: nullptr = MonotonicClock; must outlive
  // this object. InvalidArgument names the model and option when a model's
  // batching options are out of range.
  static absl::StatusOr<std::unique_ptr<BatchingScheduler>> Create(
      const ModelRegistry& registry, const BatcherOptions& defaults, Metrics* metrics,
      Clock* clock = nullptr);

  // Shutdown(absl::ZeroDuration()) unless already shut down.
  ~BatchingScheduler();
  BatchingScheduler(const BatchingScheduler&) = delete;
  BatchingScheduler& operator=(const BatchingScheduler&) = delete;

  // Non-blocking. Precondition: request->model is set. On OK the scheduler
  // owns the request (*request is null) and completes it exactly once. On
  // error the caller keeps it and must answer it: RESOURCE_EXHAUSTED (the
  // model's queue is full), UNAVAILABLE (shutting down, or a model without
  // a queue).
  absl::Status Schedule(std::unique_ptr<InferenceRequest>* request);

  // Makes the batcher of `model` (WakeAll: of every model) look at its queue
  // now: call it when a queued request's cancelled() has turned true, so
  // that it leaves the queue at once. An unknown name does nothing.
  void Wake(absl::string_view model);
  void WakeAll();

  // All batchers stop accepting at once, then drain concurrently for up to
  // `grace`; requests still queued after it are failed UNAVAILABLE. Returns
  // when every accepted request is completed. Idempotent.
  void Shutdown(absl::Duration grace);

  // The options the model's batcher runs with; null for an unknown model.
  const BatcherOptions* options(absl::string_view model) const;

 private:
  BatchingScheduler() = default;

  // One batcher per model name. Built by Create, then only read: lookups
  // need no lock.
  std::map<std::string, std::unique_ptr<DynamicBatcher>, std::less<>> batchers_;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_BATCHING_BATCHING_SCHEDULER_H_

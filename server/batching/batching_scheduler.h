// BatchingScheduler: the request path's queueing stage. One DynamicBatcher
// per served model; each closed batch goes to the model's engine as ONE
// ragged AttentionEngine::Run call. No gRPC, no protobuf in here.
#ifndef ATTNSERVE_SERVER_BATCHING_BATCHING_SCHEDULER_H_
#define ATTNSERVE_SERVER_BATCHING_BATCHING_SCHEDULER_H_

#include <map>
#include <memory>
#include <optional>
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

// Thread safety: every method may be called concurrently. Completion: every
// request accepted by Schedule is completed exactly once, from a batcher
// worker (or from the thread that shuts its batcher down, for requests failed
// UNAVAILABLE when the grace runs out).
//
// Models come and go while requests run (ModelManager): MakeBatcher builds a
// model version's queue beside the running one, Replace swaps it in and
// hands the old one back to be drained (DynamicBatcher::Shutdown) by the
// caller, so that requests queued on the old version finish on it.
class BatchingScheduler final {
 public:
  // One batcher per READY model of `registry` as it is now (later models
  // come through MakeBatcher + Replace). metrics may be null; otherwise it
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

  // The queue of `model` (ready), started but not yet receiving requests:
  // its batches run `model`'s layer on `model`'s engine. InvalidArgument
  // names the model and option when its batching options are out of range.
  absl::StatusOr<std::unique_ptr<DynamicBatcher>> MakeBatcher(
      std::shared_ptr<const ServedModel> model) const;

  // Makes `batcher` (MakeBatcher(model)) the queue of model->name and
  // returns the queue it replaces (null if none), still running: the caller
  // shuts it down, which drains it. After Shutdown began: Unavailable, and
  // `batcher` is shut down and dropped.
  absl::StatusOr<std::unique_ptr<DynamicBatcher>> Replace(
      std::shared_ptr<const ServedModel> model, std::unique_ptr<DynamicBatcher> batcher);

  // Takes model `name`'s queue out (later requests for it get UNAVAILABLE)
  // and returns it, still running, for the caller to shut down; null if it
  // had none or Shutdown began (which drains it).
  std::unique_ptr<DynamicBatcher> Remove(absl::string_view name);

  // Non-blocking. Precondition: request->model is set. On OK the scheduler
  // owns the request (*request is null) and completes it exactly once. On
  // error the caller keeps it and must answer it: RESOURCE_EXHAUSTED (the
  // model's queue is full), UNAVAILABLE (shutting down, a model without a
  // queue, or a request validated against a version that has since been
  // replaced).
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

  // The options the model's batcher runs with; nullopt for a model without
  // a queue.
  std::optional<BatcherOptions> options(absl::string_view model) const;

 private:
  BatchingScheduler(const BatcherOptions& defaults, Metrics* metrics, Clock* clock)
      : defaults_(defaults), metrics_(metrics), clock_(clock) {}

  struct Queue {
    // The version the batcher computes: a request validated against another
    // one is refused rather than run on the wrong layer.
    std::shared_ptr<const ServedModel> model;
    std::unique_ptr<DynamicBatcher> batcher;
  };

  const BatcherOptions defaults_;
  Metrics* const metrics_;
  Clock* const clock_;
  // Shared by Schedule and Wake (a lookup, then the batcher's own lock),
  // exclusive for Replace and Shutdown.
  mutable absl::Mutex mu_;
  std::map<std::string, Queue, std::less<>> queues_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  // Serializes Shutdown calls: a second waits for the first.
  absl::Mutex shutdown_mu_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_BATCHING_BATCHING_SCHEDULER_H_

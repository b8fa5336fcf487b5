// BatchingScheduler: the AttendScheduler that batches. One DynamicBatcher per
// served model; each closed batch goes to the model's engine as ONE ragged
// AttentionEngine::Run call. No gRPC in here.
#ifndef ATTNSERVE_SERVER_BATCHING_SCHEDULER_H_
#define ATTNSERVE_SERVER_BATCHING_SCHEDULER_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "attnserve/v1/model_config.pb.h"
#include "server/attend_scheduler.h"
#include "server/batching/batcher_options.h"
#include "server/batching/dynamic_batcher.h"
#include "server/metrics.h"
#include "server/model_registry.h"

namespace attnserve {

// A model's batching options: `defaults` (server flags) with each nonzero
// field of config.batching and config.instances taking precedence.
BatcherOptions ModelBatcherOptions(const BatcherOptions& defaults, const v1::ModelConfig& config);

// Thread safety: Schedule, Wake and Shutdown may be called concurrently.
// Completion: every work accepted by Schedule has `done` called exactly once,
// from a batcher worker (or from the thread that calls Shutdown, for work
// failed UNAVAILABLE when the grace runs out).
class BatchingScheduler final : public AttendScheduler {
 public:
  // One batcher per READY model of `registry` (as it is now; models added
  // later are refused with UNAVAILABLE). metrics may be null; otherwise it
  // must outlive this object. InvalidArgument names the model and option
  // when a model's batching options are out of range.
  static absl::StatusOr<std::unique_ptr<BatchingScheduler>> Create(
      const ModelRegistry& registry, const BatcherOptions& defaults, Metrics* metrics);

  // Shutdown(absl::ZeroDuration()) unless already shut down.
  ~BatchingScheduler() override;

  // AttendScheduler contract. Errors: RESOURCE_EXHAUSTED (the model's queue
  // is full), UNAVAILABLE (shutting down, or a model without a batcher).
  absl::Status Schedule(std::unique_ptr<AttendWork>* work) override;

  // Makes the model's batcher (every batcher when `model` is empty) look at
  // its queue now: call it when a queued work's is_cancelled() has turned
  // true, so that the work leaves the queue at once.
  void Wake(const std::string& model) override;

  // All batchers stop accepting at once, then drain concurrently for up to
  // `grace`; work still queued after it is failed UNAVAILABLE. Returns when
  // every accepted work is done. Idempotent.
  void Shutdown(absl::Duration grace);

  // The options the model's batcher runs with; null for an unknown model.
  const BatcherOptions* options(const std::string& model) const;

 private:
  BatchingScheduler() = default;

  struct Queue {
    std::unique_ptr<DynamicBatcher> batcher;
    ModelMetrics* metrics = nullptr;  // null without metrics
  };
  // Built by Create, then only read: lookups need no lock.
  std::map<std::string, Queue, std::less<>> queues_;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_BATCHING_SCHEDULER_H_

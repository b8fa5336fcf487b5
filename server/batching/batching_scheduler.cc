// BatchingScheduler: a DynamicBatcher per model, and one ragged engine call
// per batch.
#include "server/batching/batching_scheduler.h"

#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "engine/attention_task.h"

namespace attnserve {
namespace {

// Runs one closed batch as a single ragged engine call. Each request keeps
// its own shapes, masks and options; the engine computes each independently,
// so a request's bits do not depend on its co-tenants (batch invariance).
void ProcessBatch(const ServedModel& model, Clock* clock, ModelMetrics* metrics, Batch& batch) {
  const size_t n = batch.requests.size();
  std::vector<AttentionTask> tasks;
  tasks.reserve(n);
  for (const auto& r : batch.requests) tasks.push_back(r->task);

  const absl::Time start = clock->Now();
  absl::Status status = model.engine->Run(*model.layer, absl::MakeConstSpan(tasks));
  std::vector<absl::Status> statuses(n, status);
  if (!status.ok() && n > 1) {
    // One request's failure must not fail its co-tenants: rerun each alone
    // so that only the culprit reports an error.
    for (size_t i = 0; i < n; ++i) {
      statuses[i] = model.engine->Run(*model.layer, absl::MakeConstSpan(&tasks[i], 1));
    }
  }
  const absl::Duration compute = clock->Now() - start;

  if (metrics != nullptr) {
    metrics->BatchDone(static_cast<int64_t>(n), batch.tokens, absl::ToDoubleSeconds(compute));
  }
  for (size_t i = 0; i < n; ++i) {
    InferenceRequest& r = *batch.requests[i];
    r.timing.compute = compute;
    r.timing.batch_requests = static_cast<int>(n);
    if (metrics != nullptr) metrics->Queued(absl::ToDoubleSeconds(r.timing.queue));
    r.Complete(std::move(statuses[i]));
  }
}

}  // namespace

BatcherOptions ModelBatcherOptions(const BatcherOptions& defaults, const ModelBatching& model) {
  BatcherOptions o = defaults;
  if (model.max_batch_requests != 0) o.max_batch_requests = model.max_batch_requests;
  if (model.max_batch_tokens != 0) o.max_batch_tokens = model.max_batch_tokens;
  if (model.max_queue_delay_us != 0) o.max_queue_delay_us = model.max_queue_delay_us;
  if (model.max_queue_size != 0) o.max_queue_size = model.max_queue_size;
  if (model.instances != 0) o.instances = model.instances;
  return o;
}

absl::StatusOr<std::unique_ptr<BatchingScheduler>> BatchingScheduler::Create(
    const ModelRegistry& registry, const BatcherOptions& defaults, Metrics* metrics,
    Clock* clock) {
  if (clock == nullptr) clock = MonotonicClock::Get();
  std::unique_ptr<BatchingScheduler> s(new BatchingScheduler);
  for (const std::shared_ptr<const ServedModel>& model : registry.List()) {
    if (!model->ready()) continue;
    ModelMetrics* mm = metrics != nullptr ? metrics->ForModel(model->name) : nullptr;
    const BatcherOptions options = ModelBatcherOptions(defaults, model->batching);
    DynamicBatcher::QueueDepthFn depth;
    if (mm != nullptr) {
      depth = [mm](int64_t d) { mm->SetQueueDepth(d); };
      mm->SetQueueCapacity(options.max_queue_size);
    }
    absl::StatusOr<std::unique_ptr<DynamicBatcher>> batcher = DynamicBatcher::Create(
        model->name, options,
        [model, clock, mm](Batch& batch) { ProcessBatch(*model, clock, mm, batch); }, clock,
        std::move(depth));
    if (!batcher.ok()) return batcher.status();
    s->batchers_.emplace(model->name, *std::move(batcher));
  }
  return s;
}

BatchingScheduler::~BatchingScheduler() { Shutdown(absl::ZeroDuration()); }

absl::Status BatchingScheduler::Schedule(std::unique_ptr<InferenceRequest>* request) {
  const std::string& model = (*request)->model->name;
  auto it = batchers_.find(model);
  if (it == batchers_.end()) {
    return absl::UnavailableError(
        absl::StrCat("model ", model, " has no request queue (it was not ready at startup)"));
  }
  return it->second->Schedule(request);
}

void BatchingScheduler::Wake(absl::string_view model) {
  auto it = batchers_.find(model);
  if (it != batchers_.end()) it->second->Wake();
}

void BatchingScheduler::WakeAll() {
  for (auto& [name, batcher] : batchers_) batcher->Wake();
}

void BatchingScheduler::Shutdown(absl::Duration grace) {
  absl::MutexLock lock(&shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  // Concurrently: a batcher still accepting while another drains would let
  // new requests in after shutdown began.
  std::vector<std::thread> threads;
  for (auto& [name, batcher] : batchers_) {
    threads.emplace_back([b = batcher.get(), grace] { b->Shutdown(grace); });
  }
  for (auto& t : threads) t.join();
}

const BatcherOptions* BatchingScheduler::options(absl::string_view model) const {
  auto it = batchers_.find(model);
  return it == batchers_.end() ? nullptr : &it->second->options();
}

}  // namespace attnserve

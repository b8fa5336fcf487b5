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
  std::unique_ptr<BatchingScheduler> s(new BatchingScheduler(defaults, metrics, clock));
  for (std::shared_ptr<const ServedModel>& model : registry.List()) {
    if (!model->ready()) continue;
    absl::StatusOr<std::unique_ptr<DynamicBatcher>> batcher = s->MakeBatcher(model);
    if (!batcher.ok()) return batcher.status();
    absl::MutexLock lock(&s->mu_);
    const std::string name = model->name;
    s->queues_[name] = Queue{std::move(model), *std::move(batcher)};
  }
  return s;
}

absl::StatusOr<std::unique_ptr<DynamicBatcher>> BatchingScheduler::MakeBatcher(
    std::shared_ptr<const ServedModel> model) const {
  ModelMetrics* mm = metrics_ != nullptr ? metrics_->ForModel(model->name) : nullptr;
  const BatcherOptions options = ModelBatcherOptions(defaults_, model->batching);
  DynamicBatcher::QueueDepthFn depth;
  DynamicBatcher::RefillFn refill;
  if (mm != nullptr) {
    depth = [mm](int64_t d) { mm->SetQueueDepth(d); };
    refill = [mm](bool hit) { mm->RefillWait(hit); };
    mm->SetQueueCapacity(options.max_queue_size);
  }
  Clock* const clock = clock_;
  const std::string name = model->name;
  return DynamicBatcher::Create(
      name, options,
      [model = std::move(model), clock, mm](Batch& batch) { ProcessBatch(*model, clock, mm, batch); },
      clock, std::move(depth), std::move(refill));
}

absl::StatusOr<std::unique_ptr<DynamicBatcher>> BatchingScheduler::Replace(
    std::shared_ptr<const ServedModel> model, std::unique_ptr<DynamicBatcher> batcher) {
  {
    absl::MutexLock lock(&mu_);
    if (!shut_down_) {
      Queue& q = queues_[model->name];
      std::unique_ptr<DynamicBatcher> old = std::move(q.batcher);
      q = Queue{std::move(model), std::move(batcher)};
      return old;
    }
  }
  batcher->Shutdown(absl::ZeroDuration());  // outside the lock: it joins workers
  return absl::UnavailableError(
      absl::StrCat("model ", model->name, ": the server is shutting down"));
}

std::unique_ptr<DynamicBatcher> BatchingScheduler::Remove(absl::string_view name) {
  absl::MutexLock lock(&mu_);
  auto it = queues_.find(name);
  // After Shutdown began the queue stays: Shutdown drains it.
  if (shut_down_ || it == queues_.end()) return nullptr;
  std::unique_ptr<DynamicBatcher> old = std::move(it->second.batcher);
  queues_.erase(it);
  return old;
}

BatchingScheduler::~BatchingScheduler() { Shutdown(absl::ZeroDuration()); }

absl::Status BatchingScheduler::Schedule(std::unique_ptr<InferenceRequest>* request) {
  const ServedModel* model = (*request)->model.get();
  absl::ReaderMutexLock lock(&mu_);
  auto it = queues_.find(model->name);
  if (it == queues_.end()) {
    return absl::UnavailableError(
        absl::StrCat("model: '", model->name, "' has no request queue (not loaded)"));
  }
  if (it->second.model.get() != model) {
    // Only a session's queued request can get here (the request path holds
    // the registry's serving lock from lookup to queueing); the change that
    // replaced its version ended the session.
    return absl::UnavailableError(absl::StrCat(
        "model: '", model->name, "' was reloaded after this request was validated; send it again"));
  }
  return it->second.batcher->Schedule(request);
}

void BatchingScheduler::Wake(absl::string_view model) {
  absl::ReaderMutexLock lock(&mu_);
  auto it = queues_.find(model);
  if (it != queues_.end()) it->second.batcher->Wake();
}

void BatchingScheduler::WakeAll() {
  absl::ReaderMutexLock lock(&mu_);
  for (auto& [name, q] : queues_) q.batcher->Wake();
}

void BatchingScheduler::Shutdown(absl::Duration grace) {
  absl::MutexLock serial(&shutdown_mu_);
  std::vector<DynamicBatcher*> batchers;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    for (auto& [name, q] : queues_) batchers.push_back(q.batcher.get());
  }
  // Concurrently: a batcher still accepting while another drains would let
  // new requests in after shutdown began. The queues stay in the map (no
  // Replace or Remove after shut_down_), so the pointers stay valid.
  std::vector<std::thread> threads;
  for (DynamicBatcher* b : batchers) {
    threads.emplace_back([b, grace] { b->Shutdown(grace); });
  }
  for (auto& t : threads) t.join();
}

std::optional<BatcherOptions> BatchingScheduler::options(absl::string_view model) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = queues_.find(model);
  if (it == queues_.end()) return std::nullopt;
  return it->second.batcher->options();
}

}  // namespace attnserve

// BatchingScheduler: AttendWork <-> BatchTask, and one ragged engine call per
// batch.
#include "server/batching_scheduler.h"

#include <chrono>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "engine/attention_task.h"

namespace attnserve {
namespace {

double Seconds(SteadyClock::duration d) { return std::chrono::duration<double>(d).count(); }

// The work's deadline on absl's clock (the batcher's time base).
absl::Time AbslDeadline(SteadyClock::time_point deadline) {
  if (deadline == SteadyClock::time_point::max()) return absl::InfiniteFuture();
  return absl::Now() + absl::FromChrono(deadline - SteadyClock::now());
}

// One request in a model's queue.
class WorkTask final : public BatchTask {
 public:
  WorkTask(std::unique_ptr<AttendWork> work, int64_t tokens, ModelMetrics* metrics)
      : BatchTask(tokens, AbslDeadline(work->deadline)),
        work_(std::move(work)),
        metrics_(metrics) {}

  bool cancelled() const override { return work_->is_cancelled && work_->is_cancelled(); }

  AttendWork& work() { return *work_; }
  // Gives the work back (Schedule refused the task).
  std::unique_ptr<AttendWork> Release() { return std::move(work_); }

  // Filled by ProcessBatch before Complete; stays zero for work that never
  // reached the engine.
  WorkTiming timing;

 protected:
  void OnComplete(absl::Status status) override {
    const SteadyClock::time_point now = SteadyClock::now();
    if (timing.batch_requests == 0) timing.queue = now - work_->scheduled_at;
    // gRPC cancels a call when its deadline passes, and its timer may fire a
    // hair before our clocks agree the deadline is due: a cancellation at
    // the deadline is the deadline.
    if (status.code() == absl::StatusCode::kCancelled &&
        now >= work_->deadline - std::chrono::milliseconds(1)) {
      status = absl::DeadlineExceededError(absl::StrCat(
          "deadline passed after ",
          std::chrono::duration_cast<std::chrono::microseconds>(timing.queue).count(),
          " us in the queue of model ", work_->model->name, "; not computed"));
    }
    if (metrics_ != nullptr) metrics_->InflightAdd(-1);
    work_->done(std::move(status), timing);
  }

 private:
  std::unique_ptr<AttendWork> work_;
  ModelMetrics* const metrics_;
};

// Runs one closed batch as a single ragged engine call. Each task keeps its
// own shapes, masks and options; the engine computes each independently, so
// a request's bits do not depend on its co-tenants (batch invariance).
void ProcessBatch(const ServedModel& model, ModelMetrics* metrics, Batch& batch) {
  const size_t n = batch.tasks.size();
  std::vector<AttentionTask> tasks;
  tasks.reserve(n);
  for (auto& t : batch.tasks) tasks.push_back(static_cast<WorkTask*>(t.get())->work().task);

  const SteadyClock::time_point start = SteadyClock::now();
  absl::Status status = model.engine->Run(*model.layer, absl::MakeConstSpan(tasks));
  std::vector<absl::Status> statuses(n, status);
  if (!status.ok() && n > 1) {
    // One request's failure must not fail its co-tenants: rerun each alone
    // so that only the culprit reports an error.
    for (size_t i = 0; i < n; ++i) {
      statuses[i] = model.engine->Run(*model.layer, absl::MakeConstSpan(&tasks[i], 1));
    }
  }
  const SteadyClock::time_point end = SteadyClock::now();

  if (metrics != nullptr) metrics->BatchDone(static_cast<int64_t>(n), batch.tokens, Seconds(end - start));
  for (size_t i = 0; i < n; ++i) {
    auto* task = static_cast<WorkTask*>(batch.tasks[i].get());
    task->timing.queue = start - task->work().scheduled_at;
    task->timing.compute = end - start;
    task->timing.batch_requests = static_cast<int>(n);
    if (metrics != nullptr) metrics->Queued(Seconds(task->timing.queue));
    task->Complete(std::move(statuses[i]));
  }
}

}  // namespace

BatcherOptions ModelBatcherOptions(const BatcherOptions& defaults, const v1::ModelConfig& config) {
  BatcherOptions o = defaults;
  const v1::BatchingConfig& b = config.batching();
  if (b.max_batch_requests() != 0) o.max_batch_requests = b.max_batch_requests();
  if (b.max_batch_tokens() != 0) o.max_batch_tokens = b.max_batch_tokens();
  if (b.max_queue_delay_us() != 0) o.max_queue_delay_us = b.max_queue_delay_us();
  if (b.max_queue_size() != 0) o.max_queue_size = b.max_queue_size();
  if (config.instances() != 0) o.instances = config.instances();
  return o;
}

absl::StatusOr<std::unique_ptr<BatchingScheduler>> BatchingScheduler::Create(
    const ModelRegistry& registry, const BatcherOptions& defaults, Metrics* metrics) {
  std::unique_ptr<BatchingScheduler> s(new BatchingScheduler);
  for (const std::shared_ptr<const ServedModel>& model : registry.List()) {
    if (!model->ready()) continue;
    ModelMetrics* mm = metrics != nullptr ? metrics->ForModel(model->name) : nullptr;
    DynamicBatcher::QueueDepthFn depth;
    if (mm != nullptr) depth = [mm](int64_t d) { mm->SetQueueDepth(d); };
    absl::StatusOr<std::unique_ptr<DynamicBatcher>> batcher = DynamicBatcher::Create(
        model->name, ModelBatcherOptions(defaults, model->config),
        [model, mm](Batch& batch) { ProcessBatch(*model, mm, batch); }, /*clock=*/nullptr,
        std::move(depth));
    if (!batcher.ok()) return batcher.status();
    s->queues_.emplace(model->name, Queue{*std::move(batcher), mm});
  }
  return s;
}

BatchingScheduler::~BatchingScheduler() { Shutdown(absl::ZeroDuration()); }

absl::Status BatchingScheduler::Schedule(std::unique_ptr<AttendWork>* work) {
  const ServedModel& model = *(*work)->model;
  auto it = queues_.find(model.name);
  if (it == queues_.end()) {
    return absl::UnavailableError(
        absl::StrCat("model ", model.name, " has no request queue (it was not ready at startup)"));
  }
  const Queue& queue = it->second;
  const TaskDims dims = GetTaskDims(model.layer->config, (*work)->task);
  // Counted before Schedule: a fast completion must never see the gauge
  // go below zero.
  if (queue.metrics != nullptr) queue.metrics->InflightAdd(1);
  std::unique_ptr<BatchTask> task =
      std::make_unique<WorkTask>(std::move(*work), dims.batch * dims.q_len, queue.metrics);
  absl::Status status = queue.batcher->Schedule(&task);
  if (!status.ok()) {
    // Refused: the caller keeps its work (and answers it).
    *work = static_cast<WorkTask*>(task.get())->Release();
    if (queue.metrics != nullptr) queue.metrics->InflightAdd(-1);
  }
  return status;
}

void BatchingScheduler::Wake(const std::string& model) {
  if (model.empty()) {
    for (auto& [name, queue] : queues_) queue.batcher->Wake();
    return;
  }
  auto it = queues_.find(model);
  if (it != queues_.end()) it->second.batcher->Wake();
}

void BatchingScheduler::Shutdown(absl::Duration grace) {
  absl::MutexLock lock(&shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  // Concurrently: a batcher still accepting while another drains would let
  // new work in after shutdown began.
  std::vector<std::thread> threads;
  for (auto& [name, queue] : queues_) {
    threads.emplace_back([b = queue.batcher.get(), grace] { b->Shutdown(grace); });
  }
  for (auto& t : threads) t.join();
}

const BatcherOptions* BatchingScheduler::options(const std::string& model) const {
  auto it = queues_.find(model);
  return it == queues_.end() ? nullptr : &it->second.batcher->options();
}

}  // namespace attnserve

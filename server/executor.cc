// Bounded-queue worker pool.
#include "server/executor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace attnserve {

Executor::Executor(ExecutorOptions options) : options_(std::move(options)) {
  const int threads = std::max(1, options_.num_threads);
  workers_.reserve(static_cast<size_t>(threads));
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

Executor::~Executor() { Shutdown(); }

absl::Status Executor::Schedule(absl::AnyInvocable<void()>&& fn) {
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    return absl::UnavailableError(absl::StrCat(options_.name, ": shutting down"));
  }
  if (queue_.size() >= static_cast<size_t>(std::max(0, options_.max_queue_size))) {
    return absl::ResourceExhaustedError(
        absl::StrCat(options_.name, ": queue full (", options_.max_queue_size,
                     " requests waiting); retry later"));
  }
  queue_.push_back(std::move(fn));
  return absl::OkStatus();
}

void Executor::Shutdown() {
  absl::MutexLock shutdown_lock(&shutdown_mu_);
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (std::thread& worker : workers_) worker.join();
  workers_.clear();
}

void Executor::WorkerLoop() {
  while (true) {
    absl::AnyInvocable<void()> fn;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      // Drain before exiting: every accepted closure runs exactly once.
      if (queue_.empty()) return;
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    fn();
  }
}

}  // namespace attnserve

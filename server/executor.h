// A fixed pool of worker threads fed by a bounded FIFO queue. Scheduling
// never blocks: a full queue is reported to the caller, who turns it into
// RESOURCE_EXHAUSTED rather than letting memory grow without bound.
#ifndef ATTNSERVE_SERVER_EXECUTOR_H_
#define ATTNSERVE_SERVER_EXECUTOR_H_

#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace attnserve {

struct ExecutorOptions {
  // Worker threads. Each runs one closure at a time. Default: 2.
  int num_threads = 2;
  // Most closures waiting for a worker (not counting running ones); Schedule
  // fails beyond it. Default: 256.
  int max_queue_size = 256;
  // Used in error messages. Default: "executor".
  std::string name = "executor";
};

// Thread-safe. Closures run in FIFO order on any worker.
class Executor {
 public:
  explicit Executor(ExecutorOptions options);
  // Shutdown().
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  // Non-blocking. On OK `fn` was moved from and will run exactly once. On
  // error `fn` is left as it was: ResourceExhausted when the queue is full,
  // Unavailable after Shutdown().
  absl::Status Schedule(absl::AnyInvocable<void()>&& fn);

  // Stops accepting closures, runs every queued one, joins the workers.
  // Idempotent. Must not be called from a worker.
  void Shutdown();

  const ExecutorOptions& options() const { return options_; }

 private:
  void WorkerLoop();

  const ExecutorOptions options_;
  absl::Mutex mu_;
  std::deque<absl::AnyInvocable<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;  // written by the constructor and Shutdown
  absl::Mutex shutdown_mu_;           // serializes Shutdown calls
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_EXECUTOR_H_

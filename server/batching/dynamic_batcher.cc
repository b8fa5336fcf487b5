// DynamicBatcher: the queue, the batch-forming decision and the workers.
#include "server/batching/dynamic_batcher.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"

namespace attnserve {
namespace {

// See FormBatchLocked, step 1.
constexpr absl::Duration kDeadlineTimerSlack = absl::Milliseconds(50);

// BatcherOptions::refill_wait: after k refill waits in a row missed, the
// next 2^min(k, kMaxRefillMisses) eligible batches do not wait. A wait hits
// when the answered requests came back in time and, during the wait, at
// least kRefillContrast times as fast as requests arrived while the batch
// computed: arrivals that do not follow answers (open-loop traffic) come as
// fast in both.
constexpr int kMaxRefillMisses = 10;  // at most 1024 batches put off
constexpr double kRefillContrast = 2.0;
// Halfway through its time, a refill wait whose arrivals so far come less
// than kRefillEarlyContrast times as fast as during the compute is cut short
// (a miss): it shows no sign of answered clients coming back.
constexpr double kRefillEarlyContrast = 1.2;

}  // namespace

absl::StatusOr<std::unique_ptr<DynamicBatcher>> DynamicBatcher::Create(
    std::string model, const BatcherOptions& options, ProcessFn process,
    Clock* clock, QueueDepthFn on_queue_depth, RefillFn on_refill) {
  if (absl::Status s = ValidateBatcherOptions(options); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("batching options of model ", model, ": ", s.message()));
  }
  if (!process) return absl::InvalidArgumentError("process function is empty");
  std::unique_ptr<DynamicBatcher> b(
      new DynamicBatcher(std::move(model), options, std::move(process),
                         clock ? clock : MonotonicClock::Get(),
                         std::move(on_queue_depth), std::move(on_refill)));
  b->workers_.reserve(options.instances);
  for (int i = 0; i < options.instances; ++i) {
    b->workers_.emplace_back([p = b.get()] { p->WorkerLoop(); });
  }
  return b;
}

DynamicBatcher::DynamicBatcher(std::string model, const BatcherOptions& options,
                               ProcessFn process, Clock* clock,
                               QueueDepthFn on_queue_depth, RefillFn on_refill)
    : model_(std::move(model)),
      options_(options),
      process_(std::move(process)),
      clock_(clock),
      on_queue_depth_(std::move(on_queue_depth)),
      on_refill_(std::move(on_refill)) {}

DynamicBatcher::~DynamicBatcher() { Shutdown(absl::ZeroDuration()); }

absl::Status DynamicBatcher::Schedule(std::unique_ptr<InferenceRequest>* request) {
  if (request == nullptr || *request == nullptr) {
    return absl::InvalidArgumentError("Schedule: null request");
  }
  absl::MutexLock lock(&mu_);
  if (state_ != State::kRunning) {
    return absl::UnavailableError(absl::StrCat(
        "model ", model_, " is shutting down and accepts no new requests"));
  }
  if (queue_.size() >= static_cast<size_t>(options_.max_queue_size)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("queue of model ", model_, " is full (", queue_.size(),
                     " requests); retry later"));
  }
  const int64_t bytes = (*request)->bytes;
  if (!queue_.empty() && queued_bytes_ + bytes > options_.max_queue_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "queue of model ", model_, " holds ", queued_bytes_, " bytes of requests; this one's ",
        bytes, " would pass the limit of ", options_.max_queue_bytes,
        " (--max-queue-bytes); retry later"));
  }
  (*request)->enqueued = clock_->Now();
  queued_bytes_ += bytes;
  queue_.push_back(std::move(*request));
  scheduled_.fetch_add(1, std::memory_order_release);
  PublishDepthLocked();
  work_cv_.Signal();
  return absl::OkStatus();
}

void DynamicBatcher::Wake() {
  absl::MutexLock lock(&mu_);
  work_cv_.SignalAll();
}

int64_t DynamicBatcher::queue_depth() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(queue_.size());
}

void DynamicBatcher::PublishDepthLocked() {
  if (on_queue_depth_) on_queue_depth_(static_cast<int64_t>(queue_.size()));
  if (queue_.empty()) drained_cv_.SignalAll();
}

// The batch-forming decision, in one place. At instant `now`:
//
// 1. Requests that must never be computed leave the queue: cancelled ones
//    (CANCELLED) and those whose deadline has passed (DEADLINE_EXCEEDED).
//    Checking here, right before a batch closes, is what guarantees that an
//    expired request is not computed; the caller fails them outside the lock.
// 2. The candidate batch is the longest prefix of the queue (FIFO: a large
//    request is never overtaken indefinitely by small ones) that fits in
//    max_batch_requests and max_batch_tokens. The first request always fits: a
//    request larger than max_batch_tokens runs alone instead of starving.
// 3. The batch closes now if it is full (request count reached, token budget
//    reached, or the next request would not fit -- waiting cannot make it
//    bigger), if the oldest request has waited max_queue_delay, or if the batcher
//    is draining for shutdown (waiting for company no longer pays off).
//    It also waits, even when the delay is over, while the requests the last
//    batch answered are still coming back (BatcherOptions::session_wait_us
//    and refill_wait; BatchDone sets the target and the time limit).
//    Otherwise nothing runs and wake_at says when the answer changes by the
//    clock alone: the oldest request's delay running out, the answered
//    requests' wait running out, or the earliest deadline (so an expiring
//    request is failed promptly, not at the next batch).
DynamicBatcher::Decision DynamicBatcher::FormBatchLocked(absl::Time now) {
  Decision d;

  // 1. Drop cancelled and expired requests, keeping the others in order.
  absl::Time earliest_deadline = absl::InfiniteFuture();
  const size_t before = queue_.size();
  std::deque<std::unique_ptr<InferenceRequest>> kept;
  for (auto& r : queue_) {
    // A call's deadline also ends it as a cancellation, which can reach
    // this queue before this clock reaches the deadline: the transport's
    // timer may fire a hair early, and a client cancels at its own copy of
    // the deadline, which started when it sent the call while the server's
    // started when the call arrived, so its cancellation comes early by
    // however much longer the call took to arrive than the cancellation
    // (milliseconds on a loaded host). A cancellation within
    // kDeadlineTimerSlack of the deadline is the deadline, the more useful
    // answer (had it stayed, the request would have expired queued anyway
    // unless its batch closed within that time).
    const bool expired = r->deadline <= now;
    if (expired || r->cancelled()) {
      queued_bytes_ -= r->bytes;
      r->timing.queue = now - r->enqueued;
      absl::Status status =
          expired || now >= r->deadline - kDeadlineTimerSlack
              ? absl::DeadlineExceededError(absl::StrCat(
                    "deadline passed after ", absl::ToInt64Microseconds(r->timing.queue),
                    " us in the queue of model ", model_, "; not computed"))
              : absl::CancelledError("request cancelled while queued; not computed");
      d.dropped.emplace_back(std::move(r), std::move(status));
    } else {
      earliest_deadline = std::min(earliest_deadline, r->deadline);
      kept.push_back(std::move(r));
    }
  }
  queue_.swap(kept);
  if (queue_.size() != before) PublishDepthLocked();
  if (queue_.empty()) return d;

  // 2. Longest FIFO prefix that fits.
  const size_t max_requests = static_cast<size_t>(options_.max_batch_requests);
  const int64_t max_tokens = options_.max_batch_tokens;  // 0 = unlimited
  size_t n = 0;
  int64_t tokens = 0;
  bool next_does_not_fit = false;
  for (const auto& r : queue_) {
    if (n == max_requests) break;
    if (max_tokens > 0 && n > 0 && tokens + r->tokens() > max_tokens) {
      next_does_not_fit = true;
      break;
    }
    ++n;
    tokens += r->tokens();
  }

  // 3. Close now, or say when to look again.
  const bool full = n == max_requests || next_does_not_fit ||
                    (max_tokens > 0 && tokens >= max_tokens);
  const absl::Time delay_over =
      queue_.front()->enqueued +
      absl::Microseconds(options_.max_queue_delay_us);
  const bool waited_enough = now >= delay_over;
  // The requests the last batch answered are on their way back.
  bool answered_coming = queue_.size() < answered_wait_target_ && now < answered_wait_until_;
  if (answered_coming && refill_pending_ && now >= refill_check_at_ &&
      RefillRateLocked(now) < kRefillEarlyContrast * refill_compute_rate_) {
    answered_coming = false;
  }
  if (!full && (!waited_enough || answered_coming) && state_ == State::kRunning) {
    absl::Time until = waited_enough ? absl::InfinitePast() : delay_over;
    if (answered_coming) {
      until = std::max(until, refill_pending_ && now < refill_check_at_ ? refill_check_at_
                                                                         : answered_wait_until_);
    }
    d.wake_at = std::min(until, earliest_deadline);
    return d;
  }
  if (refill_pending_ && state_ == State::kRunning) {
    RefillOutcomeLocked(full || queue_.size() >= answered_wait_target_, now);
  }
  refill_pending_ = false;
  answered_wait_target_ = 0;

  d.batch.requests.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    queue_.front()->timing.queue = now - queue_.front()->enqueued;
    queued_bytes_ -= queue_.front()->bytes;
    d.batch.requests.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  d.batch.tokens = tokens;
  d.batch.closed_at = now;
  PublishDepthLocked();
  return d;
}

void DynamicBatcher::FailAll(
    std::vector<std::pair<std::unique_ptr<InferenceRequest>, absl::Status>>& requests) {
  for (auto& [request, status] : requests) request->Complete(std::move(status));
  requests.clear();
}

std::vector<std::pair<std::unique_ptr<InferenceRequest>, absl::Status>>
DynamicBatcher::TakeAllLocked() {
  std::vector<std::pair<std::unique_ptr<InferenceRequest>, absl::Status>> out;
  const absl::Time now = clock_->Now();
  for (auto& r : queue_) {
    r->timing.queue = now - r->enqueued;
    out.emplace_back(std::move(r),
                     absl::UnavailableError(absl::StrCat(
                         "server shut down before the request could run "
                         "(model ", model_, ")")));
  }
  queue_.clear();
  queued_bytes_ = 0;
  PublishDepthLocked();
  return out;
}

void DynamicBatcher::RunBatch(Batch& batch) {
  const size_t requests = batch.requests.size();
  size_t sessions = 0;
  for (const auto& r : batch.requests) sessions += r->session_id.empty() ? 0 : 1;
  const uint64_t arrived_before = scheduled_.load(std::memory_order_relaxed);
  const absl::Time start = clock_->Now();
  process_(batch);
  const absl::Duration took = clock_->Now() - start;
  // Exactly-once guarantee even when the process function forgot a
  // request; Complete is a no-op for the ones it did answer.
  for (auto& r : batch.requests) {
    r->Complete(absl::InternalError(
        "batch finished without answering this request (server bug)"));
  }
  batch.requests.clear();  // destroy the requests before the batch counts as done
  BatchDone(requests, sessions, took, arrived_before);
}

void DynamicBatcher::BatchDone(size_t requests, size_t sessions, absl::Duration took,
                               uint64_t arrived_before) {
  absl::MutexLock lock(&mu_);
  --running_batches_;
  const uint64_t arrived = scheduled_.load(std::memory_order_relaxed);
  const size_t max_requests = static_cast<size_t>(options_.max_batch_requests);
  // Which of the waits applies (BatcherOptions): the sessions' next steps,
  // or, after a batch of stateless requests at least half full, a refill.
  size_t coming = 0;
  absl::Duration wait;
  if (sessions > 0) {
    if (options_.session_wait_us > 0) {
      coming = sessions;
      wait = std::min(took, absl::Microseconds(options_.session_wait_us));
    }
  } else if (options_.refill_wait && options_.instances <= 1 &&
             requests >= std::max<size_t>(2, max_requests / 2) &&
             queue_.size() < max_requests) {  // (a full queue has nothing to wait for)
    if (refill_skip_ > 0) {
      --refill_skip_;
    } else {
      coming = requests;
      wait = took;
    }
  }
  if (coming > 0) {
    const absl::Time now = clock_->Now();
    answered_wait_target_ = std::min(queue_.size() + coming, max_requests);
    answered_wait_until_ = now + wait;
    refill_pending_ = sessions == 0;
    if (refill_pending_) {
      refill_started_ = now;
      refill_check_at_ = now + wait / 2;
      refill_arrived_ = arrived;
      refill_compute_rate_ = static_cast<double>(arrived - arrived_before) /
                             std::max(absl::ToDoubleSeconds(took), 1e-6);
    }
  }
  drained_cv_.SignalAll();  // Shutdown waits for running_batches_ == 0
}

double DynamicBatcher::RefillRateLocked(absl::Time now) const {
  return static_cast<double>(scheduled_.load(std::memory_order_relaxed) - refill_arrived_) /
         std::max(absl::ToDoubleSeconds(now - refill_started_), 1e-6);
}

void DynamicBatcher::RefillOutcomeLocked(bool filled, absl::Time now) {
  const bool hit = filled && RefillRateLocked(now) >= kRefillContrast * refill_compute_rate_;
  if (on_refill_) on_refill_(hit);
  if (hit) {
    refill_misses_ = 0;
    refill_skip_ = 0;
    return;
  }
  refill_misses_ = std::min(refill_misses_ + 1, kMaxRefillMisses);
  refill_skip_ = 1 << refill_misses_;
}

void DynamicBatcher::WorkerLoop() {
  // Lone requests in a row: polling starts after two (one lone batch among
  // full ones is a loaded server's straggler, where polling would take the
  // CPU that gRPC needs to bring in the next batch).
  int lone = 0;
  bool poll = false;
  for (;;) {
    Decision d;
    {
      absl::MutexLock lock(&mu_);
      for (;;) {
        if (state_ == State::kStopped) return;
        d = FormBatchLocked(clock_->Now());
        if (!d.batch.requests.empty() || !d.dropped.empty()) break;
        if (d.wake_at == absl::InfiniteFuture()) {
          if (poll && state_ == State::kRunning) {
            poll = false;
            PollForWorkLocked();
            continue;
          }
          work_cv_.Wait(&mu_);
        } else {
          work_cv_.WaitWithTimeout(&mu_, d.wake_at - clock_->Now());
        }
      }
      if (!d.batch.requests.empty()) {
        ++running_batches_;
        // Another idle worker may be able to start on what is left.
        if (!queue_.empty()) work_cv_.Signal();
      }
    }
    FailAll(d.dropped);
    if (!d.batch.requests.empty()) {
      lone = d.batch.requests.size() == 1 ? lone + 1 : 0;
      poll = options_.idle_spin_us > 0 && lone >= 2;
      RunBatch(d.batch);
    }
  }
}

void DynamicBatcher::PollForWorkLocked() {
  if (polling_.exchange(true, std::memory_order_acquire)) return;
  const uint64_t seen = scheduled_.load(std::memory_order_relaxed);
  mu_.Unlock();
  const auto until =
      std::chrono::steady_clock::now() + std::chrono::microseconds(options_.idle_spin_us);
  while (scheduled_.load(std::memory_order_acquire) == seen &&
         std::chrono::steady_clock::now() < until) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  mu_.Lock();
  polling_.store(false, std::memory_order_release);
}

int DynamicBatcher::ProcessReadyBatches() {
  if (options_.instances != 0) return 0;
  int batches = 0;
  for (;;) {
    Decision d;
    {
      absl::MutexLock lock(&mu_);
      if (state_ == State::kStopped) return batches;
      d = FormBatchLocked(clock_->Now());
      if (!d.batch.requests.empty()) ++running_batches_;
    }
    FailAll(d.dropped);
    if (d.batch.requests.empty()) return batches;
    RunBatch(d.batch);
    ++batches;
  }
}

void DynamicBatcher::Shutdown(absl::Duration grace) {
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_started_) {
      mu_.Await(absl::Condition(&shutdown_done_));
      return;
    }
    shutdown_started_ = true;
    state_ = State::kDraining;
    work_cv_.SignalAll();  // waiting workers close partial batches at once
  }

  std::vector<std::pair<std::unique_ptr<InferenceRequest>, absl::Status>> leftover;
  if (options_.instances == 0) {
    // Manual mode: the caller's thread is the worker. Draining closes every
    // batch at once, so each ProcessReadyBatches round makes progress.
    const absl::Time until = clock_->Now() + grace;
    for (;;) {
      Decision d;
      {
        absl::MutexLock lock(&mu_);
        if (queue_.empty() || clock_->Now() >= until) break;
        d = FormBatchLocked(clock_->Now());
        if (!d.batch.requests.empty()) ++running_batches_;
      }
      FailAll(d.dropped);
      if (!d.batch.requests.empty()) RunBatch(d.batch);
    }
  } else {
    absl::MutexLock lock(&mu_);
    auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return queue_.empty() && running_batches_ == 0;
    };
    const absl::Time until = clock_->Now() + grace;
    for (absl::Time now = clock_->Now(); !drained() && now < until; now = clock_->Now()) {
      drained_cv_.WaitWithTimeout(&mu_, until - now);
    }
  }
  {
    absl::MutexLock lock(&mu_);
    leftover = TakeAllLocked();
  }
  FailAll(leftover);  // before joining: nobody waits on a computation for them

  {
    absl::MutexLock lock(&mu_);
    // Workers finish the batch they hold (compute is not interruptible), then
    // see kStopped and exit.
    while (running_batches_ > 0) drained_cv_.Wait(&mu_);
    state_ = State::kStopped;
    work_cv_.SignalAll();
  }
  for (auto& w : workers_) w.join();
  workers_.clear();
  absl::MutexLock lock(&mu_);
  shutdown_done_ = true;
}

}  // namespace attnserve

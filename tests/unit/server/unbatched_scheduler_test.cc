// UnbatchedScheduler: one engine call per work item, `done` exactly once,
// no compute for work that is past its deadline or cancelled.
#include "server/unbatched_scheduler.h"

#include <atomic>
#include <memory>

#include "absl/synchronization/notification.h"
#include "engine/model/builtin_models.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

class CountingEngine : public AttentionEngine {
 public:
  std::string_view name() const override { return "counting"; }
  absl::Status Run(const AttentionLayer&, absl::Span<const AttentionTask> batch) override {
    calls.fetch_add(1);
    last_batch_size.store(static_cast<int>(batch.size()));
    return result;
  }
  absl::Status Attend(absl::Span<const AttentionParams>) override {
    return absl::UnimplementedError("not used");
  }
  std::atomic<int> calls{0};
  std::atomic<int> last_batch_size{0};
  absl::Status result = absl::OkStatus();
};

struct Outcome {
  absl::Notification finished;
  absl::Status status;
  WorkTiming timing;
  int done_calls = 0;
};

std::unique_ptr<AttendWork> MakeWork(std::shared_ptr<AttentionEngine> engine, Outcome* outcome) {
  auto work = std::make_unique<AttendWork>();
  work->model = MakeServedModel(MakeSdpaLayer(), std::move(engine));
  work->scheduled_at = SteadyClock::now();
  work->done = [outcome](absl::Status status, const WorkTiming& timing) {
    outcome->status = std::move(status);
    outcome->timing = timing;
    ++outcome->done_calls;
    outcome->finished.Notify();
  };
  return work;
}

TEST(UnbatchedSchedulerTest, RunsAloneAndReportsTiming) {
  auto engine = std::make_shared<CountingEngine>();
  Executor executor({.num_threads = 1});
  UnbatchedScheduler scheduler(&executor);
  Outcome outcome;
  std::unique_ptr<AttendWork> work = MakeWork(engine, &outcome);
  ASSERT_TRUE(scheduler.Schedule(&work).ok());
  EXPECT_EQ(work, nullptr);  // the scheduler owns it now
  outcome.finished.WaitForNotification();
  executor.Shutdown();
  EXPECT_TRUE(outcome.status.ok()) << outcome.status;
  EXPECT_EQ(outcome.done_calls, 1);
  EXPECT_EQ(outcome.timing.batch_requests, 1);
  EXPECT_GE(outcome.timing.queue.count(), 0);
  EXPECT_EQ(engine->calls.load(), 1);
  EXPECT_EQ(engine->last_batch_size.load(), 1);
}

TEST(UnbatchedSchedulerTest, EngineErrorReachesDone) {
  auto engine = std::make_shared<CountingEngine>();
  engine->result = absl::InternalError("boom");
  Executor executor({.num_threads = 1});
  UnbatchedScheduler scheduler(&executor);
  Outcome outcome;
  std::unique_ptr<AttendWork> work = MakeWork(engine, &outcome);
  ASSERT_TRUE(scheduler.Schedule(&work).ok());
  outcome.finished.WaitForNotification();
  EXPECT_EQ(outcome.status.code(), absl::StatusCode::kInternal);
}

TEST(UnbatchedSchedulerTest, ExpiredWorkIsNotComputed) {
  auto engine = std::make_shared<CountingEngine>();
  Executor executor({.num_threads = 1});
  UnbatchedScheduler scheduler(&executor);
  Outcome outcome;
  std::unique_ptr<AttendWork> work = MakeWork(engine, &outcome);
  work->deadline = SteadyClock::now() - std::chrono::milliseconds(1);
  ASSERT_TRUE(scheduler.Schedule(&work).ok());
  outcome.finished.WaitForNotification();
  EXPECT_EQ(outcome.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(engine->calls.load(), 0);
}

TEST(UnbatchedSchedulerTest, CancelledWorkIsNotComputed) {
  auto engine = std::make_shared<CountingEngine>();
  Executor executor({.num_threads = 1});
  UnbatchedScheduler scheduler(&executor);
  Outcome outcome;
  std::unique_ptr<AttendWork> work = MakeWork(engine, &outcome);
  work->is_cancelled = [] { return true; };
  ASSERT_TRUE(scheduler.Schedule(&work).ok());
  outcome.finished.WaitForNotification();
  EXPECT_EQ(outcome.status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(engine->calls.load(), 0);
}

TEST(UnbatchedSchedulerTest, RefusalLeavesWorkWithCaller) {
  auto engine = std::make_shared<CountingEngine>();
  Executor executor({.num_threads = 1});
  executor.Shutdown();
  UnbatchedScheduler scheduler(&executor);
  Outcome outcome;
  std::unique_ptr<AttendWork> work = MakeWork(engine, &outcome);
  EXPECT_EQ(scheduler.Schedule(&work).code(), absl::StatusCode::kUnavailable);
  ASSERT_NE(work, nullptr);
  EXPECT_EQ(outcome.done_calls, 0);
}

}  // namespace
}  // namespace attnserve

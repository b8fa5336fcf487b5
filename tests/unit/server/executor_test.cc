// Executor: every accepted closure runs once; a full queue and a stopped
// executor refuse without taking the closure.
#include "server/executor.h"

#include <atomic>

#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

TEST(ExecutorTest, RunsEveryClosureAndDrainsOnShutdown) {
  std::atomic<int> ran{0};
  Executor executor({.num_threads = 3, .max_queue_size = 1000});
  for (int i = 0; i < 500; ++i) {
    ASSERT_TRUE(executor.Schedule([&ran] { ran.fetch_add(1); }).ok());
  }
  executor.Shutdown();
  EXPECT_EQ(ran.load(), 500);
}

TEST(ExecutorTest, FullQueueRefusesAndLeavesTheClosure) {
  absl::Notification started, release;
  Executor executor({.num_threads = 1, .max_queue_size = 1, .name = "test queue"});
  ASSERT_TRUE(executor.Schedule([&] {
    started.Notify();
    release.WaitForNotification();
  }).ok());
  started.WaitForNotification();  // the worker is busy; the queue is empty
  bool queued_ran = false;
  ASSERT_TRUE(executor.Schedule([&] { queued_ran = true; }).ok());

  bool refused_ran = false;
  absl::AnyInvocable<void()> refused = [&] { refused_ran = true; };
  absl::Status status = executor.Schedule(std::move(refused));
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(status.message().find("test queue"), absl::string_view::npos);
  ASSERT_TRUE(refused);  // still ours
  refused();
  EXPECT_TRUE(refused_ran);

  release.Notify();
  executor.Shutdown();
  EXPECT_TRUE(queued_ran);
}

TEST(ExecutorTest, RefusesAfterShutdown) {
  Executor executor({.num_threads = 1});
  executor.Shutdown();
  executor.Shutdown();  // idempotent
  EXPECT_EQ(executor.Schedule([] {}).code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace attnserve

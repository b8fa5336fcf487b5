// Tests of DynamicBatcher: the batch-closing rules and queue policy with a
// fake clock in manual mode (no threads, no sleeps), then shutdown and
// exactly-once completion with real worker threads.
#include "server/batching/dynamic_batcher.h"

#include <atomic>
#include <functional>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/request/fake_clock.h"

namespace attnserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

// What happened to one request, shared by the test and its task.
struct Record {
  std::atomic<int> completions{0};
  std::atomic<bool> computed{false};
  std::atomic<bool> cancel{false};
  absl::Mutex mu;
  absl::Status status ABSL_GUARDED_BY(mu);
  absl::Notification done;

  absl::Status GetStatus() {
    absl::MutexLock lock(&mu);
    return status;
  }
};

// Request `id` with `tokens` query tokens, answered into `record`.
std::unique_ptr<InferenceRequest> MakeRequest(int id, int64_t tokens, Record* record,
                                              absl::Time deadline = absl::InfiniteFuture()) {
  auto r = std::make_unique<InferenceRequest>();
  r->id = std::to_string(id);
  r->dims.batch = 1;
  r->dims.q_len = tokens;
  r->deadline = deadline;
  r->is_cancelled = [record] { return record->cancel.load(); };
  r->done = [record](absl::Status status, const InferenceRequest&) {
    {
      absl::MutexLock lock(&record->mu);
      record->status = std::move(status);
    }
    if (record->completions.fetch_add(1) == 0) record->done.Notify();
  };
  return r;
}

int IdOf(const InferenceRequest& r) { return std::stoi(r.id); }

// Records the ids of every batch it is given and completes each task OK.
class Recorder {
 public:
  // records[id] is request id's Record.
  explicit Recorder(Record* records) : records_(records) {}
  DynamicBatcher::ProcessFn Fn() {
    return [this](Batch& batch) {
      std::vector<int> ids;
      int64_t tokens = 0;
      for (auto& r : batch.requests) {
        ids.push_back(IdOf(*r));
        tokens += r->tokens();
        records_[IdOf(*r)].computed = true;
      }
      EXPECT_EQ(tokens, batch.tokens);
      {
        absl::MutexLock lock(&mu_);
        batches_.push_back(ids);
      }
      for (auto& r : batch.requests) r->Complete(absl::OkStatus());
    };
  }
  std::vector<std::vector<int>> batches() {
    absl::MutexLock lock(&mu_);
    return batches_;
  }

 private:
  Record* const records_;
  absl::Mutex mu_;
  std::vector<std::vector<int>> batches_ ABSL_GUARDED_BY(mu_);
};

class ManualBatcherTest : public ::testing::Test {
 protected:
  void Make(BatcherOptions options) {
    options.instances = 0;  // manual mode: the test drives the batcher
    auto b = DynamicBatcher::Create("m", options, recorder_.Fn(), &clock_);
    ASSERT_TRUE(b.ok()) << b.status();
    batcher_ = *std::move(b);
  }
  // Schedules request `id` with `tokens`; records live in records_[id].
  absl::Status Send(int id, int64_t tokens,
                    absl::Time deadline = absl::InfiniteFuture()) {
    std::unique_ptr<InferenceRequest> task = MakeRequest(id, tokens, &records_[id], deadline);
    absl::Status s = batcher_->Schedule(&task);
    EXPECT_EQ(s.ok(), task == nullptr) << "ownership contract";
    return s;
  }

  FakeClock clock_;
  Record records_[64];
  Recorder recorder_{records_};
  std::unique_ptr<DynamicBatcher> batcher_;
};

TEST_F(ManualBatcherTest, ClosesOnRequestCount) {
  Make({.max_batch_requests = 4, .max_batch_tokens = 0,
        .max_queue_delay_us = 1000});
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Send(i, 1).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);  // 3 < 4 and no delay yet
  ASSERT_TRUE(Send(3, 1).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  for (int i = 4; i < 6; ++i) ASSERT_TRUE(Send(i, 1).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0, 1, 2, 3)));
  EXPECT_EQ(batcher_->queue_depth(), 2);
}

TEST_F(ManualBatcherTest, ClosesOnTokens) {
  Make({.max_batch_requests = 100, .max_batch_tokens = 100,
        .max_queue_delay_us = 1000});
  ASSERT_TRUE(Send(0, 40).ok());
  ASSERT_TRUE(Send(1, 40).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);  // 80 < 100
  // 30 more would make 110: the batch of 80 cannot grow, so it closes; the
  // 30 starts a new batch that is not full yet.
  ASSERT_TRUE(Send(2, 30).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  // Exactly reaching the budget closes it too.
  ASSERT_TRUE(Send(3, 70).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  EXPECT_THAT(recorder_.batches(),
              ElementsAre(ElementsAre(0, 1), ElementsAre(2, 3)));
}

TEST_F(ManualBatcherTest, ClosesOnDelayOfOldest) {
  Make({.max_batch_requests = 8, .max_batch_tokens = 0,
        .max_queue_delay_us = 1000});
  ASSERT_TRUE(Send(0, 1).ok());
  clock_.Advance(absl::Microseconds(600));
  ASSERT_TRUE(Send(1, 1).ok());
  clock_.Advance(absl::Microseconds(399));
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);  // oldest waited 999 us
  clock_.Advance(absl::Microseconds(1));          // oldest waited 1000 us
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0, 1)));
}

TEST_F(ManualBatcherTest, ZeroDelayRunsWhateverIsQueued) {
  Make({.max_batch_requests = 8, .max_batch_tokens = 0,
        .max_queue_delay_us = 0});
  ASSERT_TRUE(Send(0, 1).ok());
  ASSERT_TRUE(Send(1, 1).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(0, 1)));
}

TEST_F(ManualBatcherTest, OversizedRequestRunsAloneInsteadOfStarving) {
  Make({.max_batch_requests = 8, .max_batch_tokens = 100,
        .max_queue_delay_us = 1000});
  ASSERT_TRUE(Send(0, 500).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);  // alone, at once
  ASSERT_TRUE(Send(1, 10).ok());
  ASSERT_TRUE(Send(2, 500).ok());
  // FIFO: the small one closes (the big one cannot join), then the big one.
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 2);
  EXPECT_THAT(recorder_.batches(),
              ElementsAre(ElementsAre(0), ElementsAre(1), ElementsAre(2)));
}

TEST_F(ManualBatcherTest, BatchingOffRunsOneAtATime) {
  Make({.max_batch_requests = 1, .max_batch_tokens = 0,
        .max_queue_delay_us = 1000});
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Send(i, 1).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 3);
  EXPECT_THAT(recorder_.batches(),
              ElementsAre(ElementsAre(0), ElementsAre(1), ElementsAre(2)));
}

TEST_F(ManualBatcherTest, ExpiredInQueueIsNeverComputed) {
  Make({.max_batch_requests = 8, .max_batch_tokens = 0,
        .max_queue_delay_us = 1000});
  ASSERT_TRUE(Send(0, 1, clock_.Now() + absl::Microseconds(500)).ok());
  ASSERT_TRUE(Send(1, 1).ok());
  clock_.Advance(absl::Microseconds(600));
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);  // 1 is still waiting
  EXPECT_EQ(records_[0].completions, 1);
  EXPECT_EQ(records_[0].GetStatus().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(records_[0].GetStatus().message(), HasSubstr("not computed"));
  EXPECT_FALSE(records_[0].computed);
  EXPECT_EQ(batcher_->queue_depth(), 1);
  clock_.Advance(absl::Microseconds(400));
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(1)));
  EXPECT_TRUE(records_[1].GetStatus().ok());
}

TEST_F(ManualBatcherTest, DeadlineAlreadyPassedAtScheduleIsNotComputed) {
  Make({.max_batch_requests = 1, .max_batch_tokens = 0,
        .max_queue_delay_us = 0});
  ASSERT_TRUE(Send(0, 1, clock_.Now()).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  EXPECT_EQ(records_[0].GetStatus().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(records_[0].computed);
}

TEST_F(ManualBatcherTest, ExpiredAndCancelledIsDeadlineExceeded) {
  // gRPC also marks a call cancelled when its deadline passes.
  Make({.max_batch_requests = 8, .max_batch_tokens = 0,
        .max_queue_delay_us = 1000});
  ASSERT_TRUE(Send(0, 1, clock_.Now() + absl::Microseconds(10)).ok());
  records_[0].cancel = true;
  clock_.Advance(absl::Microseconds(10));
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  EXPECT_EQ(records_[0].GetStatus().code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(ManualBatcherTest, CancelledJustBeforeTheDeadlineIsTheDeadline) {
  // gRPC's deadline timer, or the client's own copy of the deadline, may
  // cancel the call a little before this clock reaches the deadline: within
  // 50 ms it counts as the deadline; earlier it is a client's cancellation.
  Make({.max_batch_requests = 8, .max_batch_tokens = 0, .max_queue_delay_us = 1000});
  ASSERT_TRUE(Send(0, 1, clock_.Now() + absl::Milliseconds(49)).ok());
  ASSERT_TRUE(Send(1, 1, clock_.Now() + absl::Milliseconds(51)).ok());
  records_[0].cancel = true;
  records_[1].cancel = true;
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  EXPECT_EQ(records_[0].GetStatus().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(records_[1].GetStatus().code(), absl::StatusCode::kCancelled);
}

TEST_F(ManualBatcherTest, CancelledLeavesTheQueue) {
  Make({.max_batch_requests = 2, .max_batch_tokens = 0,
        .max_queue_delay_us = 1000});
  ASSERT_TRUE(Send(0, 1).ok());
  records_[0].cancel = true;
  ASSERT_TRUE(Send(1, 1).ok());
  // Without the cancelled one the batch is not full: nothing runs yet.
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  EXPECT_EQ(records_[0].completions, 1);
  EXPECT_EQ(records_[0].GetStatus().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(records_[0].computed);
  ASSERT_TRUE(Send(2, 1).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  EXPECT_THAT(recorder_.batches(), ElementsAre(ElementsAre(1, 2)));
}

TEST_F(ManualBatcherTest, QueueFullIsResourceExhaustedAndCallerKeepsTask) {
  Make({.max_batch_requests = 8, .max_batch_tokens = 0,
        .max_queue_delay_us = 1000, .max_queue_size = 3});
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Send(i, 1).ok());
  std::unique_ptr<InferenceRequest> task = MakeRequest(3, 1, &records_[3]);
  absl::Status s = batcher_->Schedule(&task);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(s.message(), HasSubstr("queue of model m is full (3 requests)"));
  EXPECT_NE(task, nullptr);  // still ours
  EXPECT_EQ(records_[3].completions, 0);
}

TEST_F(ManualBatcherTest, ShutdownDrainsWithinGraceThenFailsTheRest) {
  // Each batch "takes" one second of fake time; the grace covers three.
  auto b = DynamicBatcher::Create(
      "m",
      {.max_batch_requests = 1, .max_batch_tokens = 0,
       .max_queue_delay_us = 1'000'000, .instances = 0},
      [this](Batch& batch) {
        recorder_.Fn()(batch);
        clock_.Advance(absl::Seconds(1));
      },
      &clock_);
  ASSERT_TRUE(b.ok());
  batcher_ = *std::move(b);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(Send(i, 1).ok());
  batcher_->Shutdown(absl::Milliseconds(2500));
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(records_[i].completions, 1) << i;
    EXPECT_EQ(records_[i].GetStatus().code(),
              i < 3 ? absl::StatusCode::kOk : absl::StatusCode::kUnavailable)
        << i;
    EXPECT_EQ(records_[i].computed, i < 3) << i;
  }
  absl::Status s = Send(5, 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("shutting down"));
}

TEST_F(ManualBatcherTest, UnansweredTaskIsCompletedInternal) {
  auto b = DynamicBatcher::Create(
      "m", {.max_batch_requests = 2, .max_queue_delay_us = 0, .instances = 0},
      [](Batch& batch) { batch.requests[0]->Complete(absl::OkStatus()); },
      &clock_);
  ASSERT_TRUE(b.ok());
  batcher_ = *std::move(b);
  ASSERT_TRUE(Send(0, 1).ok());
  ASSERT_TRUE(Send(1, 1).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  EXPECT_TRUE(records_[0].GetStatus().ok());
  EXPECT_EQ(records_[1].GetStatus().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(records_[0].completions + records_[1].completions, 2);
}

TEST_F(ManualBatcherTest, QueueTimeEndsWhenTheBatchCloses) {
  absl::Duration waited;
  auto b = DynamicBatcher::Create(
      "m", {.max_batch_requests = 8, .max_queue_delay_us = 300, .instances = 0},
      [&](Batch& batch) {
        waited = batch.closed_at - batch.requests[0]->enqueued;
        EXPECT_EQ(batch.requests[0]->timing.queue, waited);
        for (auto& r : batch.requests) r->Complete(absl::OkStatus());
      },
      &clock_);
  ASSERT_TRUE(b.ok());
  batcher_ = *std::move(b);
  ASSERT_TRUE(Send(0, 1).ok());
  clock_.Advance(absl::Microseconds(450));
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  EXPECT_EQ(waited, absl::Microseconds(450));
}

// A batcher in manual mode whose batches each "compute" for 1000 us on the
// fake clock, during which during_compute_ (if set) runs once: requests that
// arrive while a batch computes.
class TimedBatcherTest : public ManualBatcherTest {
 protected:
  void MakeTimed(BatcherOptions options) {
    options.instances = 0;
    hits_ = misses_ = 0;
    auto b = DynamicBatcher::Create(
        "m", options,
        [this](Batch& batch) {
          std::function<void()> arrivals;
          arrivals.swap(during_compute_);
          if (arrivals) arrivals();
          clock_.Advance(absl::Microseconds(1000));
          recorder_.Fn()(batch);
        },
        &clock_, nullptr, [this](bool hit) { ++(hit ? hits_ : misses_); });
    ASSERT_TRUE(b.ok()) << b.status();
    batcher_ = *std::move(b);
  }
  std::function<void()> during_compute_;
  int hits_ = 0, misses_ = 0;  // refill waits judged (DynamicBatcher::RefillFn)
};

// BatcherOptions::session_wait_us. Requests sent with SendSession belong to
// sessions (ids 40-63), those sent with Send are stateless.
class SessionWaitTest : public TimedBatcherTest {
 protected:
  void Make(int64_t session_wait_us, int max_batch_requests = 8) {
    MakeTimed({.max_batch_requests = max_batch_requests, .session_wait_us = session_wait_us});
  }
  void SendSession(int id) {
    std::unique_ptr<InferenceRequest> task = MakeRequest(id, 1, &records_[id]);
    task->session_id = absl::StrCat("s", id);
    ASSERT_TRUE(batcher_->Schedule(&task).ok());
  }
};

TEST_F(SessionWaitTest, TheNextBatchWaitsForTheSessionsJustAnswered) {
  Make(5000);
  SendSession(41);
  SendSession(42);
  SendSession(43);
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);  // nothing answered yet: no wait
  // Two sessions send their next step; the third is still on its way.
  SendSession(51);
  SendSession(52);
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  clock_.Advance(absl::Microseconds(400));
  SendSession(53);
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);  // all three: it closes at once
  EXPECT_THAT(recorder_.batches(),
              ElementsAre(ElementsAre(41, 42, 43), ElementsAre(51, 52, 53)));
}

TEST_F(SessionWaitTest, WaitsAtMostTheLastBatchsTimeAndTheOption) {
  Make(5000);
  SendSession(41);
  SendSession(42);
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);  // took 1000 us
  SendSession(51);
  clock_.Advance(absl::Microseconds(999));
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  clock_.Advance(absl::Microseconds(1));  // one batch's time: it runs alone
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  EXPECT_EQ(records_[51].GetStatus(), absl::OkStatus());

  // The option bounds it below the batch's time.
  Make(300);
  SendSession(44);
  SendSession(45);
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  SendSession(54);
  clock_.Advance(absl::Microseconds(299));
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  clock_.Advance(absl::Microseconds(1));
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
}

TEST_F(SessionWaitTest, NoWaitAfterStatelessBatchesOrWhenOff) {
  Make(5000);
  ASSERT_TRUE(Send(1, 1).ok());
  ASSERT_TRUE(Send(2, 1).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  ASSERT_TRUE(Send(3, 1).ok());
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1) << "stateless answers make no one wait";

  Make(0);
  SendSession(46);
  SendSession(47);
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  SendSession(56);
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1) << "session_wait_us = 0: no wait";
}

TEST_F(SessionWaitTest, AFullBatchAndShutdownDoNotWait) {
  Make(5000, /*max_batch_requests=*/2);
  SendSession(41);
  SendSession(42);
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  // Waits for 2 (the queue was empty, 2 answered, at most 2 per batch).
  SendSession(51);
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  SendSession(52);
  SendSession(53);
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1) << "full at 2; 53 waits for its company";
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  batcher_->Shutdown(absl::Seconds(1));  // drains 53 at once, no session wait
  EXPECT_EQ(records_[53].GetStatus(), absl::OkStatus());
  EXPECT_THAT(recorder_.batches(),
              ElementsAre(ElementsAre(41, 42), ElementsAre(51, 52), ElementsAre(53)));
}

// BatcherOptions::refill_wait.
class RefillWaitTest : public TimedBatcherTest {
 protected:
  void Make(bool refill_wait, int max_batch_requests = 8) {
    MakeTimed({.max_batch_requests = max_batch_requests, .refill_wait = refill_wait});
  }
  void SendAll(std::initializer_list<int> ids) {
    for (int id : ids) ASSERT_TRUE(Send(id, 1).ok());
  }
  // Runs one half-full batch (ids first..first+3), nothing arriving while it
  // computes, so that the next batch waits for four requests.
  void RunEligibleBatch(int first) {
    SendAll({first, first + 1, first + 2, first + 3});
    ASSERT_EQ(batcher_->ProcessReadyBatches(), 1);
  }
  // The same for ids 1-4, with `arriving` sent while it computes.
  void RunEligibleBatchWhileArriving(std::initializer_list<int> arriving) {
    during_compute_ = [this, ids = std::vector<int>(arriving)] {
      for (int id : ids) ASSERT_TRUE(Send(id, 1).ok());
    };
    RunEligibleBatch(1);
  }
};

TEST_F(RefillWaitTest, AfterAHalfFullBatchTheNextWaitsForTheRequestsItAnswered) {
  Make(true);
  RunEligibleBatch(1);
  SendAll({11, 12, 13});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0) << "three of the four answered are back";
  clock_.Advance(absl::Microseconds(300));
  SendAll({14});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  EXPECT_THAT(recorder_.batches(),
              ElementsAre(ElementsAre(1, 2, 3, 4), ElementsAre(11, 12, 13, 14)));
}

TEST_F(RefillWaitTest, WaitsAtMostTheLastBatchsTime) {
  Make(true);
  RunEligibleBatch(1);  // took 1000 us
  SendAll({11});
  clock_.Advance(absl::Microseconds(999));
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  clock_.Advance(absl::Microseconds(1));
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  EXPECT_EQ(records_[11].GetStatus(), absl::OkStatus());
}

TEST_F(RefillWaitTest, SmallBatchesOffAndBatchingOffNeverWait) {
  Make(true);
  SendAll({1, 2, 3});  // less than half of 8
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  SendAll({11});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);

  Make(false);
  RunEligibleBatch(21);
  SendAll({31});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1) << "refill_wait off";

  Make(true, /*max_batch_requests=*/1);
  SendAll({41});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  SendAll({42});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1) << "batching off";
}

TEST_F(RefillWaitTest, AWaitThatRunsOutPutsTheNextEligibleBatchesOff) {
  Make(true);
  RunEligibleBatch(1);
  SendAll({11});
  clock_.Advance(absl::Microseconds(1000));
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);  // ran out: a miss
  // The next two eligible batches do not wait; the third does again.
  for (int first : {21, 31}) {
    RunEligibleBatch(first);
    SendAll({first + 5});
    EXPECT_EQ(batcher_->ProcessReadyBatches(), 1) << "eligible batch " << first << " skipped";
  }
  RunEligibleBatch(41);
  SendAll({46});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0) << "the wait is back after two";
  SendAll({47, 48, 49});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);  // a hit: nothing is put off
  RunEligibleBatch(51);
  SendAll({56});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  EXPECT_EQ(misses_, 1);
  EXPECT_EQ(hits_, 2) << "46-49 came back, and so did 51-54 (at once)";
}

TEST_F(RefillWaitTest, ArrivalsAsFastWhileComputingAreNotAnswersComingBack) {
  Make(true);
  // Four arrive while the batch computes (4 per ms), then the wait sees the
  // same rate: traffic that does not follow the answers. Halfway through
  // the wait's 1000 us it is cut short, a miss.
  RunEligibleBatchWhileArriving({11, 12, 13, 14});
  clock_.Advance(absl::Microseconds(250));
  SendAll({21});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  clock_.Advance(absl::Microseconds(249));
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  clock_.Advance(absl::Microseconds(1));
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1) << "halfway at 2 per ms: cut short";
  EXPECT_EQ(misses_, 1);
  // So the next eligible batch does not wait.
  RunEligibleBatch(31);
  SendAll({36});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  EXPECT_THAT(recorder_.batches(),
              ElementsAre(ElementsAre(1, 2, 3, 4), ElementsAre(11, 12, 13, 14, 21),
                          ElementsAre(31, 32, 33, 34), ElementsAre(36)));
}

TEST_F(RefillWaitTest, FilledAtTheComputesRateIsAMiss) {
  Make(true);
  // Four arrive while the batch computes (4 per ms); during the wait four
  // more come at 4.8 per ms, 1.2 times that (not cut short), but a hit needs
  // twice the compute's rate.
  RunEligibleBatchWhileArriving({11, 12, 13, 14});
  for (int id : {21, 22, 23, 24}) {
    clock_.Advance(absl::Microseconds(id == 21 ? 209 : 208));
    SendAll({id});
  }
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);  // 11-14, 21-24 at 833 us: full
  EXPECT_EQ(misses_, 1);
  EXPECT_EQ(hits_, 0);
  RunEligibleBatch(31);
  SendAll({36});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1) << "a miss: the next eligible batch skips";
}

TEST_F(RefillWaitTest, AnswersComingBackFasterThanTheComputesArrivalsAreAHit) {
  Make(true);
  // Two arrive while the batch computes (2 per ms); the four answered come
  // back within 700 us (5.7 per ms).
  RunEligibleBatchWhileArriving({11, 12});
  for (int id : {21, 22, 23}) {
    clock_.Advance(absl::Microseconds(150));
    SendAll({id});
    EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  }
  clock_.Advance(absl::Microseconds(250));
  SendAll({24});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);  // 11, 12, 21-24: a hit
  EXPECT_EQ(hits_, 1);
  // Nothing is put off: after that batch of six the next waits for six.
  SendAll({31, 32, 33, 34, 35});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  SendAll({36});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 1);
  EXPECT_THAT(recorder_.batches(),
              ElementsAre(ElementsAre(1, 2, 3, 4), ElementsAre(11, 12, 21, 22, 23, 24),
                          ElementsAre(31, 32, 33, 34, 35, 36)));
}

TEST_F(RefillWaitTest, AFullQueueAndShutdownDoNotWait) {
  Make(true);
  during_compute_ = [this] { SendAll({11, 12, 13, 14, 15, 16, 17, 18, 19}); };  // > a batch
  SendAll({1, 2, 3, 4});
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 2) << "1-4, then 11-18 at once";
  // 11-18 left 19 queued, waiting for eight to come back.
  EXPECT_EQ(batcher_->ProcessReadyBatches(), 0);
  batcher_->Shutdown(absl::Seconds(1));  // drains 19 at once
  EXPECT_EQ(records_[19].GetStatus(), absl::OkStatus());
  EXPECT_THAT(recorder_.batches(),
              ElementsAre(ElementsAre(1, 2, 3, 4), ElementsAre(11, 12, 13, 14, 15, 16, 17, 18),
                          ElementsAre(19)));
}

TEST(BatcherOptionsTest, RejectsOutOfRange) {
  EXPECT_TRUE(ValidateBatcherOptions({}).ok());
  EXPECT_EQ(ValidateBatcherOptions({.max_batch_requests = 0}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateBatcherOptions({.max_batch_tokens = -1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateBatcherOptions({.max_queue_delay_us = -1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateBatcherOptions({.max_queue_size = 0}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateBatcherOptions({.idle_spin_us = -1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateBatcherOptions({.idle_spin_us = 10001}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateBatcherOptions({.idle_spin_us = 0}).ok());
  EXPECT_EQ(ValidateBatcherOptions({.session_wait_us = -1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateBatcherOptions({.session_wait_us = 1000001}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateBatcherOptions({.session_wait_us = 0}).ok());
  EXPECT_TRUE(ValidateBatcherOptions({.refill_wait = false}).ok());
  auto b = DynamicBatcher::Create("m", {.max_queue_size = 0},
                                  [](Batch&) {});
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(b.status().message(), HasSubstr("max_queue_size"));
}

// ---- Real worker threads. Waits are on notifications, never on sleeps. ----

TEST(ThreadedBatcherTest, QueueFullWithOneRunningRejectsExactlyTheExcess) {
  constexpr int kQueue = 5, kExtra = 3;
  absl::Notification started, release;
  std::atomic<int> computed{0};
  auto b = DynamicBatcher::Create(
      "m",
      {.max_batch_requests = 1, .max_batch_tokens = 0, .max_queue_delay_us = 0,
       .max_queue_size = kQueue, .instances = 1},
      [&](Batch& batch) {
        if (!started.HasBeenNotified()) started.Notify();
        release.WaitForNotification();
        computed += batch.requests.size();
        for (auto& r : batch.requests) r->Complete(absl::OkStatus());
      });
  ASSERT_TRUE(b.ok());
  auto& batcher = *b;
  Record records[1 + kQueue + kExtra];
  std::unique_ptr<InferenceRequest> first = MakeRequest(0, 1, &records[0]);
  ASSERT_TRUE(batcher->Schedule(&first).ok());
  started.WaitForNotification();  // request 0 is running; the queue is empty
  int exhausted = 0;
  for (int i = 1; i < 1 + kQueue + kExtra; ++i) {
    std::unique_ptr<InferenceRequest> t = MakeRequest(i, 1, &records[i]);
    absl::Status s = batcher->Schedule(&t);
    if (s.code() == absl::StatusCode::kResourceExhausted) {
      ++exhausted;
      EXPECT_THAT(s.message(), HasSubstr("is full (5 requests)"));
      EXPECT_NE(t, nullptr);
    } else {
      EXPECT_TRUE(s.ok()) << s;
    }
  }
  EXPECT_EQ(exhausted, kExtra);
  release.Notify();
  batcher->Shutdown(absl::Seconds(30));
  EXPECT_EQ(computed, 1 + kQueue);
  for (int i = 0; i < 1 + kQueue + kExtra; ++i) {
    EXPECT_EQ(records[i].completions, i <= kQueue ? 1 : 0) << i;
  }
}

TEST(ThreadedBatcherTest, ShutdownCompletesEveryAcceptedRequest) {
  constexpr int kInFlight = 37;
  Record records[kInFlight + 1];
  Recorder recorder(records);
  // A one-minute delay: only draining (not the delay) can close partial
  // batches, so the test also checks that Shutdown does not wait for it.
  auto b = DynamicBatcher::Create(
      "m",
      {.max_batch_requests = 4, .max_batch_tokens = 0,
       .max_queue_delay_us = 60'000'000, .instances = 2},
      recorder.Fn());
  ASSERT_TRUE(b.ok());
  for (int i = 0; i < kInFlight; ++i) {
    std::unique_ptr<InferenceRequest> t = MakeRequest(i, 1, &records[i]);
    ASSERT_TRUE((*b)->Schedule(&t).ok());
  }
  const absl::Time start = absl::Now();
  (*b)->Shutdown(absl::Seconds(30));
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  int ok = 0;
  for (int i = 0; i < kInFlight; ++i) {
    EXPECT_EQ(records[i].completions, 1) << i;
    ok += records[i].GetStatus().ok();
  }
  EXPECT_EQ(ok, kInFlight);
  std::unique_ptr<InferenceRequest> late = MakeRequest(kInFlight, 1, &records[kInFlight]);
  EXPECT_EQ((*b)->Schedule(&late).code(), absl::StatusCode::kUnavailable);
}

TEST(ThreadedBatcherTest, LoneRequestsMeetAPollingWorker) {
  // Each request is sent only after the previous one completed, so every
  // batch is a lone request and a worker is (most likely) polling when the
  // next one arrives: each must still run exactly once, alone, in order. A
  // shutdown right after the last one must not wait for the poll to end.
  constexpr int kRequests = 200;
  std::vector<Record> records(kRequests);
  Recorder recorder(records.data());
  auto b = DynamicBatcher::Create(
      "m", {.max_batch_requests = 8, .instances = 2, .idle_spin_us = 10000}, recorder.Fn());
  ASSERT_TRUE(b.ok());
  for (int i = 0; i < kRequests; ++i) {
    std::unique_ptr<InferenceRequest> t = MakeRequest(i, 1, &records[i]);
    ASSERT_TRUE((*b)->Schedule(&t).ok());
    ASSERT_TRUE(records[i].done.WaitForNotificationWithTimeout(absl::Seconds(10))) << i;
    EXPECT_TRUE(records[i].GetStatus().ok()) << records[i].GetStatus();
  }
  (*b)->Shutdown(absl::Seconds(10));
  const std::vector<std::vector<int>> batches = recorder.batches();
  ASSERT_EQ(batches.size(), static_cast<size_t>(kRequests));
  for (int i = 0; i < kRequests; ++i) EXPECT_EQ(batches[i], std::vector<int>{i});
}

TEST(ThreadedBatcherTest, SeveralInstancesNeverWaitForARefill) {
  // Two workers; batches "compute" for 1 s on a fake clock that nothing else
  // moves. Requests 0 and 1 hold one worker each; 2 and 3 queue behind them
  // and form a half-full batch once 1 is released. A refill wait after it
  // would hold request 4 until the fake clock passed that second: never.
  FakeClock clock;
  std::vector<Record> records(5);
  Recorder recorder(records.data());
  absl::Notification started[2], release[2];
  auto b = DynamicBatcher::Create(
      "m", {.max_batch_requests = 4, .instances = 2, .refill_wait = true},
      [&](Batch& batch) {
        const int first = IdOf(*batch.requests[0]);
        if (first < 2) {
          started[first].Notify();
          release[first].WaitForNotification();
        }
        clock.Advance(absl::Seconds(1));
        recorder.Fn()(batch);
      },
      &clock);
  ASSERT_TRUE(b.ok());
  auto send = [&](int id) {
    std::unique_ptr<InferenceRequest> t = MakeRequest(id, 1, &records[id]);
    ASSERT_TRUE((*b)->Schedule(&t).ok());
  };
  send(0);
  started[0].WaitForNotification();
  send(1);
  started[1].WaitForNotification();
  send(2);
  send(3);
  release[1].Notify();
  ASSERT_TRUE(records[3].done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  send(4);
  EXPECT_TRUE(records[4].done.WaitForNotificationWithTimeout(absl::Seconds(10)))
      << "request 4 waited for a refill";
  release[0].Notify();
  (*b)->Shutdown(absl::Seconds(10));
  EXPECT_THAT(recorder.batches(), testing::UnorderedElementsAre(ElementsAre(0), ElementsAre(1),
                                                                ElementsAre(2, 3), ElementsAre(4)));
}

TEST(ThreadedBatcherTest, WakeFailsCancelledTaskPromptly) {
  Record record;
  Recorder recorder(&record);
  auto b = DynamicBatcher::Create(
      "m",
      {.max_batch_requests = 8, .max_queue_delay_us = 60'000'000,
       .instances = 1},
      recorder.Fn());
  ASSERT_TRUE(b.ok());
  std::unique_ptr<InferenceRequest> t = MakeRequest(0, 1, &record);
  ASSERT_TRUE((*b)->Schedule(&t).ok());
  record.cancel = true;
  (*b)->Wake();
  ASSERT_TRUE(record.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(record.GetStatus().code(), absl::StatusCode::kCancelled);
  EXPECT_FALSE(record.computed);
}

TEST(ThreadedBatcherTest, WorkerWakesForQueuedDeadline) {
  // The delay is long; the deadline is short. The worker must wake for the
  // deadline and fail the request without computing it.
  Record record;
  Recorder recorder(&record);
  auto b = DynamicBatcher::Create(
      "m",
      {.max_batch_requests = 8, .max_queue_delay_us = 60'000'000,
       .instances = 1},
      recorder.Fn());
  ASSERT_TRUE(b.ok());
  std::unique_ptr<InferenceRequest> t = MakeRequest(
      0, 1, &record, MonotonicClock::Get()->Now() + absl::Milliseconds(20));
  ASSERT_TRUE((*b)->Schedule(&t).ok());
  ASSERT_TRUE(record.done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(record.GetStatus().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(record.computed);
}

// Many producers, several workers, random cancellations, deadlines, process
// functions that forget tasks, and a shutdown racing with Schedule: every
// accepted task completes exactly once; every rejected one never does.
TEST(ThreadedBatcherTest, ExactlyOnceUnderConcurrentStress) {
  constexpr int kProducers = 6, kPerProducer = 400;
  constexpr int kTotal = kProducers * kPerProducer;
  std::vector<Record> records(kTotal);
  std::atomic<int> scheduled_so_far{0};
  absl::Notification half_sent;

  auto b = DynamicBatcher::Create(
      "m",
      {.max_batch_requests = 8, .max_batch_tokens = 64,
       .max_queue_delay_us = 50, .max_queue_size = 64, .instances = 3},
      [&records](Batch& batch) {
        for (auto& r : batch.requests) {
          const int id = IdOf(*r);
          records[id].computed = true;
          // Every 7th is left for the batcher to fail INTERNAL; some are
          // answered twice (the second must be ignored).
          if (id % 7 == 0) continue;
          r->Complete(absl::OkStatus());
          if (id % 5 == 0) r->Complete(absl::AbortedError("twice"));
        }
      });
  ASSERT_TRUE(b.ok());
  DynamicBatcher* batcher = b->get();

  std::vector<std::atomic<bool>> accepted(kTotal);
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&, p] {
      std::mt19937 rng(p);
      for (int i = 0; i < kPerProducer; ++i) {
        const int id = p * kPerProducer + i;
        absl::Time deadline = absl::InfiniteFuture();
        if (rng() % 10 == 0) {
          deadline = MonotonicClock::Get()->Now() + absl::Microseconds(rng() % 200);
        }
        std::unique_ptr<InferenceRequest> t = MakeRequest(
            id, 1 + rng() % 40, &records[id], deadline);
        if (rng() % 10 == 0) records[id].cancel = true;
        absl::Status s = batcher->Schedule(&t);
        accepted[id] = s.ok();
        if (!s.ok()) {
          EXPECT_TRUE(s.code() == absl::StatusCode::kResourceExhausted ||
                      s.code() == absl::StatusCode::kUnavailable)
              << s;
          EXPECT_NE(t, nullptr);
        }
        if (rng() % 16 == 0) batcher->Wake();
        if (++scheduled_so_far == kTotal / 2) half_sent.Notify();
        if (rng() % 4 == 0) std::this_thread::yield();
      }
    });
  }
  half_sent.WaitForNotification();
  batcher->Shutdown(absl::Seconds(20));
  for (auto& t : producers) t.join();
  b->reset();

  int n_accepted = 0, n_ok = 0;
  for (int id = 0; id < kTotal; ++id) {
    const int c = records[id].completions;
    if (accepted[id]) {
      ++n_accepted;
      EXPECT_EQ(c, 1) << id;
      n_ok += records[id].GetStatus().ok();
      if (records[id].GetStatus().code() == absl::StatusCode::kAborted) {
        ADD_FAILURE() << "second completion took effect for " << id;
      }
    } else {
      EXPECT_EQ(c, 0) << id;
    }
  }
  EXPECT_GT(n_accepted, 0);
  EXPECT_GT(n_ok, 0);
}

}  // namespace
}  // namespace attnserve

// BatchingScheduler: per-model options, one ragged engine call per batch,
// failure isolation inside a batch, and the Schedule ownership contract.
#include "server/batching/batching_scheduler.h"

#include <atomic>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "engine/model/builtin_models.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/request/fake_clock.h"

namespace attnserve {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Records the size of every Run call; a batch containing a task whose scale
// is kPoison fails as a whole (as a real engine would on one bad task).
constexpr float kPoison = 13.0f;
class RecordingEngine : public AttentionEngine {
 public:
  std::string_view name() const override { return "recording"; }
  absl::Status Run(const AttentionLayer&, absl::Span<const AttentionTask> tasks) override {
    if (clock != nullptr) clock->Advance(compute_time);
    absl::MutexLock lock(&mu);
    sizes.push_back(static_cast<int>(tasks.size()));
    for (const AttentionTask& t : tasks) {
      if (t.scale == kPoison) return absl::InternalError("poisoned task");
    }
    return absl::OkStatus();
  }
  std::vector<int> Sizes() {
    absl::MutexLock lock(&mu);
    return sizes;
  }
  absl::Mutex mu;
  std::vector<int> sizes ABSL_GUARDED_BY(mu);
  // When set, each Run takes compute_time on this clock.
  FakeClock* clock = nullptr;
  absl::Duration compute_time;
};

struct Outcome {
  absl::Notification finished;
  absl::Status status;
  RequestTiming timing;
  std::atomic<int> done_calls{0};
};

class BatchingSchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = std::make_shared<RecordingEngine>();
    model_ = MakeServedModel(MakeSdpaLayer(), engine_);
    ASSERT_TRUE(registry_.Add(model_).ok());
  }

  std::unique_ptr<InferenceRequest> MakeRequest(Outcome* outcome, float scale = 1.0f) {
    auto request = std::make_unique<InferenceRequest>();
    request->model = model_;
    request->task.query.shape = {1, 2, 4, 8};
    request->task.key.shape = {1, 2, 4, 8};
    request->task.value.shape = {1, 2, 4, 8};
    request->task.scale = scale;
    request->dims.batch = 1;
    request->dims.q_len = 4;  // 4 query tokens
    request->done = [outcome](absl::Status status, const InferenceRequest& r) {
      outcome->status = std::move(status);
      outcome->timing = r.timing;
      outcome->done_calls.fetch_add(1);
      outcome->finished.Notify();
    };
    return request;
  }

  // Batches close only when full or on shutdown: deterministic batches.
  static BatcherOptions Held(int max_batch_requests) {
    BatcherOptions o;
    o.max_batch_requests = max_batch_requests;
    o.max_queue_delay_us = 60'000'000;
    return o;
  }

  ModelRegistry registry_;
  std::shared_ptr<RecordingEngine> engine_;
  std::shared_ptr<const ServedModel> model_;
};

TEST(ModelBatcherOptionsTest, ConfigOverridesNonzeroFieldsOnly) {
  BatcherOptions defaults;
  defaults.max_batch_requests = 32;
  defaults.max_queue_delay_us = 100;
  ModelBatching model;
  model.max_batch_requests = 4;
  model.max_queue_size = 7;
  model.instances = 2;
  const BatcherOptions o = ModelBatcherOptions(defaults, model);
  EXPECT_EQ(o.max_batch_requests, 4);
  EXPECT_EQ(o.max_queue_size, 7);
  EXPECT_EQ(o.instances, 2);
  EXPECT_EQ(o.max_queue_delay_us, 100);
  EXPECT_EQ(o.max_batch_tokens, defaults.max_batch_tokens);
}

TEST_F(BatchingSchedulerTest, BatchRunsAsOneEngineCall) {
  auto s = BatchingScheduler::Create(registry_, Held(3), nullptr);
  ASSERT_TRUE(s.ok()) << s.status();
  Outcome outcomes[3];
  for (Outcome& o : outcomes) {
    std::unique_ptr<InferenceRequest> work = MakeRequest(&o);
    ASSERT_TRUE((*s)->Schedule(&work).ok());
    EXPECT_EQ(work, nullptr);
  }
  for (Outcome& o : outcomes) {
    o.finished.WaitForNotification();
    EXPECT_TRUE(o.status.ok()) << o.status;
    EXPECT_EQ(o.timing.batch_requests, 3);
  }
  EXPECT_THAT(engine_->Sizes(), ElementsAre(3));
}

TEST_F(BatchingSchedulerTest, OneBadTaskDoesNotFailItsCoTenants) {
  auto s = BatchingScheduler::Create(registry_, Held(3), nullptr);
  ASSERT_TRUE(s.ok());
  Outcome outcomes[3];
  for (int i = 0; i < 3; ++i) {
    std::unique_ptr<InferenceRequest> work = MakeRequest(&outcomes[i], i == 1 ? kPoison : 1.0f);
    ASSERT_TRUE((*s)->Schedule(&work).ok());
  }
  for (Outcome& o : outcomes) o.finished.WaitForNotification();
  EXPECT_TRUE(outcomes[0].status.ok());
  EXPECT_EQ(outcomes[1].status.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(outcomes[2].status.ok());
  // The batch, then each task alone to find the culprit.
  EXPECT_THAT(engine_->Sizes(), ElementsAre(3, 1, 1, 1));
}

TEST_F(BatchingSchedulerTest, TimingReadsTheInjectedClock) {
  FakeClock clock;
  engine_->clock = &clock;
  engine_->compute_time = absl::Milliseconds(7);
  // The batch (max 2) waits for company for 3 ms of the fake clock: the
  // worker runs it only once the test has advanced the clock past that.
  BatcherOptions o = Held(2);
  o.max_queue_delay_us = 3000;
  auto s = BatchingScheduler::Create(registry_, o, nullptr, &clock);
  ASSERT_TRUE(s.ok()) << s.status();
  Outcome outcome;
  std::unique_ptr<InferenceRequest> r = MakeRequest(&outcome);
  ASSERT_TRUE((*s)->Schedule(&r).ok());
  clock.Advance(absl::Milliseconds(5));  // past the 3 ms delay
  (*s)->WakeAll();
  outcome.finished.WaitForNotification();
  ASSERT_TRUE(outcome.status.ok()) << outcome.status;
  EXPECT_EQ(outcome.timing.queue, absl::Milliseconds(5));
  EXPECT_EQ(outcome.timing.compute, absl::Milliseconds(7));
  EXPECT_EQ(outcome.timing.batch_requests, 1);
}

TEST_F(BatchingSchedulerTest, RefusedRequestStaysWithTheCaller) {
  BatcherOptions o = Held(64);
  o.max_queue_size = 1;
  auto s = BatchingScheduler::Create(registry_, o, nullptr);
  ASSERT_TRUE(s.ok());
  Outcome first, second;
  std::unique_ptr<InferenceRequest> a = MakeRequest(&first);
  ASSERT_TRUE((*s)->Schedule(&a).ok());
  std::unique_ptr<InferenceRequest> b = MakeRequest(&second);
  absl::Status status = (*s)->Schedule(&b);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(status.message(), HasSubstr("queue of model sdpa is full (1 requests)"));
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->model, model_);  // intact: the caller answers it
  (*s)->Shutdown(absl::Seconds(30));
  first.finished.WaitForNotification();
  EXPECT_TRUE(first.status.ok());
  EXPECT_EQ(second.done_calls.load(), 0);
  // After shutdown: UNAVAILABLE, still the caller's.
  EXPECT_EQ((*s)->Schedule(&b).code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(b, nullptr);
}

TEST_F(BatchingSchedulerTest, BadModelBatchingConfigFailsCreate) {
  auto layer = MakeSdpaLayer();
  auto served = std::make_shared<ServedModel>(*MakeServedModel(layer, engine_));
  served->name = "broken";
  served->batching.max_queue_size = -1;
  ASSERT_TRUE(registry_.Add(served).ok());
  auto s = BatchingScheduler::Create(registry_, BatcherOptions{}, nullptr);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("broken"));
  EXPECT_THAT(s.status().message(), HasSubstr("max_queue_size"));
}

}  // namespace
}  // namespace attnserve

// BatchingScheduler: per-model options, one ragged engine call per batch,
// failure isolation inside a batch, and the Schedule ownership contract.
#include "server/batching_scheduler.h"

#include <atomic>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "engine/model/builtin_models.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

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
  absl::Status Run(const AttentionLayer&, absl::Span<const AttentionTask> batch) override {
    absl::MutexLock lock(&mu);
    sizes.push_back(static_cast<int>(batch.size()));
    for (const AttentionTask& t : batch) {
      if (t.scale == kPoison) return absl::InternalError("poisoned task");
    }
    return absl::OkStatus();
  }
  absl::Status Attend(absl::Span<const AttentionParams>) override {
    return absl::UnimplementedError("not used");
  }
  std::vector<int> Sizes() {
    absl::MutexLock lock(&mu);
    return sizes;
  }
  absl::Mutex mu;
  std::vector<int> sizes ABSL_GUARDED_BY(mu);
};

struct Outcome {
  absl::Notification finished;
  absl::Status status;
  WorkTiming timing;
  std::atomic<int> done_calls{0};
};

class BatchingSchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = std::make_shared<RecordingEngine>();
    model_ = MakeServedModel(MakeSdpaLayer(), engine_);
    ASSERT_TRUE(registry_.Add(model_).ok());
  }

  std::unique_ptr<AttendWork> MakeWork(Outcome* outcome, float scale = 1.0f) {
    auto work = std::make_unique<AttendWork>();
    work->model = model_;
    work->task.query.shape = {1, 2, 4, 8};  // 4 query tokens
    work->task.key.shape = {1, 2, 4, 8};
    work->task.value.shape = {1, 2, 4, 8};
    work->task.scale = scale;
    work->scheduled_at = SteadyClock::now();
    work->done = [outcome](absl::Status status, const WorkTiming& timing) {
      outcome->status = std::move(status);
      outcome->timing = timing;
      outcome->done_calls.fetch_add(1);
      outcome->finished.Notify();
    };
    return work;
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
  v1::ModelConfig config;
  config.mutable_batching()->set_max_batch_requests(4);
  config.mutable_batching()->set_max_queue_size(7);
  config.set_instances(2);
  const BatcherOptions o = ModelBatcherOptions(defaults, config);
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
    std::unique_ptr<AttendWork> work = MakeWork(&o);
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
    std::unique_ptr<AttendWork> work = MakeWork(&outcomes[i], i == 1 ? kPoison : 1.0f);
    ASSERT_TRUE((*s)->Schedule(&work).ok());
  }
  for (Outcome& o : outcomes) o.finished.WaitForNotification();
  EXPECT_TRUE(outcomes[0].status.ok());
  EXPECT_EQ(outcomes[1].status.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(outcomes[2].status.ok());
  // The batch, then each task alone to find the culprit.
  EXPECT_THAT(engine_->Sizes(), ElementsAre(3, 1, 1, 1));
}

TEST_F(BatchingSchedulerTest, RefusedWorkStaysWithTheCaller) {
  BatcherOptions o = Held(64);
  o.max_queue_size = 1;
  auto s = BatchingScheduler::Create(registry_, o, nullptr);
  ASSERT_TRUE(s.ok());
  Outcome first, second;
  std::unique_ptr<AttendWork> a = MakeWork(&first);
  ASSERT_TRUE((*s)->Schedule(&a).ok());
  std::unique_ptr<AttendWork> b = MakeWork(&second);
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
  v1::ModelConfig config;
  config.set_name("broken");
  config.set_kind("sdpa");
  config.mutable_batching()->set_max_queue_size(-1);
  auto layer = MakeSdpaLayer();
  auto served = std::make_shared<ServedModel>(*MakeServedModel(layer, engine_));
  served->name = "broken";
  served->config = config;
  ASSERT_TRUE(registry_.Add(served).ok());
  auto s = BatchingScheduler::Create(registry_, BatcherOptions{}, nullptr);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.status().message(), HasSubstr("broken"));
  EXPECT_THAT(s.status().message(), HasSubstr("max_queue_size"));
}

}  // namespace
}  // namespace attnserve

// RequestDispatcher and sessions: an engine is asked whether it accepts a
// session request as the paged task it will run (so an engine that computes
// an option only on paged tasks serves it there and still refuses it on
// stateless requests), and OpenSession hands the model's pool the engine's
// slab memory.
#include "server/dispatch/request_dispatcher.h"

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "engine/attention_engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/batching/batching_scheduler.h"
#include "server/models/model_registry.h"
#include "server/request/clock.h"
#include "server/sessions/session_manager.h"

namespace attnserve {
namespace {

// Slab memory the host can use (so that the engine below may write blocks),
// recording what it maps.
class CountingSlabMemory final : public KvSlabMemory {
 public:
  void* Map(int64_t bytes) override {
    void* p = ::operator new(static_cast<size_t>(bytes), std::align_val_t{256});
    live[p] = bytes;
    return p;
  }
  void Unmap(void* base, int64_t bytes) override {
    EXPECT_EQ(live[base], bytes);
    live.erase(base);
    ::operator delete(base, std::align_val_t{256});
  }
  std::map<void*, int64_t> live;
};

// Accepts a window only on paged tasks (like the cuda engine today); Run
// writes zeros and records whether each task was paged and where its blocks
// were.
class PagedOnlyWindowEngine final : public AttentionEngine {
 public:
  std::string_view name() const override { return "paged-only-window"; }
  bool SupportsSessions() const override { return true; }
  std::shared_ptr<KvSlabMemory> kv_slab_memory() const override { return memory; }
  absl::Status Accepts(const LayerConfig&, const AttentionTask& task) const override {
    accepts_saw_paged.push_back(task.paged.enabled());
    EXPECT_TRUE(task.paged.k_blocks.empty()) << "not bound yet when asked";
    if (task.window > 0 && !task.paged.enabled()) {
      return absl::UnimplementedError("window: only on sessions here");
    }
    return absl::OkStatus();
  }
  absl::Status Run(const AttentionLayer&, absl::Span<const AttentionTask> tasks) override {
    for (const AttentionTask& t : tasks) {
      ran_paged.push_back(t.paged.enabled());
      if (t.paged.enabled()) first_block = t.paged.k_blocks[0];
      std::memset(t.output.data, 0, t.output.byte_size());
    }
    return absl::OkStatus();
  }

  std::shared_ptr<CountingSlabMemory> memory = std::make_shared<CountingSlabMemory>();
  mutable std::vector<bool> accepts_saw_paged;
  std::vector<bool> ran_paged;
  void* first_block = nullptr;
};

TEST(RequestDispatcherTest, AsksTheEngineAboutASessionRequestAsAPagedTask) {
  auto engine = std::make_shared<PagedOnlyWindowEngine>();
  ModelRegistry registry;
  ASSERT_TRUE(AddBuiltinModels(engine, &registry).ok());
  Clock* clock = MonotonicClock::Get();
  std::unique_ptr<BatchingScheduler> scheduler =
      BatchingScheduler::Create(registry, BatcherOptions{}, nullptr, clock).value();
  SessionManager sessions(SessionOptions{}, clock, nullptr);
  RequestDispatcher dispatcher(&registry, scheduler.get(), nullptr, clock, ValidationOptions{},
                               &sessions);
  absl::StatusOr<OpenedSession> opened =
      dispatcher.OpenSession("sdpa", absl::ZeroDuration(), 0, "");
  ASSERT_TRUE(opened.ok()) << opened.status();

  const std::vector<float> q(2 * 3 * 8, 0.5f);
  std::vector<float> out(q.size());
  auto submit = [&](absl::string_view session_id) {
    absl::Notification answered;
    absl::Status status;
    auto request = std::make_unique<InferenceRequest>();
    request->received = clock->Now();
    request->done = [&](absl::Status s, const InferenceRequest&) {
      status = std::move(s);
      answered.Notify();
    };
    AttendInputs inputs;
    inputs.model = "sdpa";
    for (InputTensor* t : {&inputs.query, &inputs.key, &inputs.value}) {
      t->present = true;
      t->shape = {1, 2, 3, 8};
      t->data = absl::string_view(reinterpret_cast<const char*>(q.data()),
                                  q.size() * sizeof(float));
    }
    inputs.window = 2;
    inputs.session_id = session_id;
    dispatcher.Submit(std::move(request), inputs,
                      [&](OutputName, DType dtype, const Shape& shape) {
                        return MutableTensorView{dtype, shape, out.data()};
                      });
    answered.WaitForNotification();
    return status;
  };

  // Stateless: asked as it is, refused.
  EXPECT_EQ(submit("").code(), absl::StatusCode::kUnimplemented);
  // A session's request: asked as a paged task, accepted, run bound to
  // blocks in the engine's memory.
  const absl::Status session = submit(opened->id);
  EXPECT_TRUE(session.ok()) << session;
  EXPECT_THAT(engine->accepts_saw_paged, ::testing::ElementsAre(false, true));
  EXPECT_THAT(engine->ran_paged, ::testing::ElementsAre(true));
  ASSERT_EQ(engine->memory->live.size(), 1u);
  const char* slab = static_cast<const char*>(engine->memory->live.begin()->first);
  const char* block = static_cast<const char*>(engine->first_block);
  EXPECT_TRUE(block >= slab && block < slab + engine->memory->live.begin()->second);
  scheduler->Shutdown(absl::Seconds(5));
}

}  // namespace
}  // namespace attnserve

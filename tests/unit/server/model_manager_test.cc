// Model control end to end in process: a real AttnServer over a temporary
// model repository, called through the gRPC stub while its models are
// loaded, reloaded and unloaded (explicit mode) or their files change (poll
// mode, polled by the test). The oracle of every answer is the reference
// engine run on the layer each version's files hold, loaded here apart from
// the server. Also under TSan (scripts/sanitize.sh tsan): the swap against
// requests in flight.
#include "server/models/model_manager.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "engine/attention_engine.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "absl/synchronization/notification.h"
#include "server/attn_server.h"
#include "server/dispatch/request_dispatcher.h"
#include "server/models/model_repository.h"

namespace attnserve {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kEmbed = 16;
constexpr int64_t kTokens = 5;

// One query every test sends: [1, kTokens, kEmbed].
std::vector<float> Query() {
  std::vector<float> q(kTokens * kEmbed);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (float& v : q) v = normal(rng);
  return q;
}

class ModelManagerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/model_manager_test_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    absl::StatusOr<std::unique_ptr<AttentionEngine>> engine = CreateEngine("reference", {});
    ASSERT_TRUE(engine.ok()) << engine.status();
    oracle_ = *std::move(engine);
  }
  void TearDown() override {
    server_.reset();
    fs::remove_all(dir_);
  }

  // An nn.MultiheadAttention(kEmbed, 2, bias=False) folder whose weights
  // are `scale` times a fixed pattern, written beside and renamed into
  // place (how an operator publishes new weights atomically).
  void WriteModel(const std::string& folder, float scale, const std::string& config = "") {
    std::vector<std::string> entries;
    std::string data;
    auto add = [&](const std::string& name, int64_t rows, int64_t cols) {
      const size_t begin = data.size();
      std::vector<float> v(static_cast<size_t>(rows * cols));
      for (size_t i = 0; i < v.size(); ++i) {
        v[i] = scale * 0.05f * static_cast<float>(static_cast<int>(i % 13) - 6);
      }
      data.append(reinterpret_cast<const char*>(v.data()), v.size() * 4);
      entries.push_back(absl::StrCat("\"", name, "\":{\"dtype\":\"F32\",\"shape\":[", rows, ",",
                                     cols, "],\"data_offsets\":[", begin, ",", data.size(), "]}"));
    };
    add("in_proj_weight", 3 * kEmbed, kEmbed);
    add("out_proj.weight", kEmbed, kEmbed);
    const std::string header = absl::StrCat("{", absl::StrJoin(entries, ","), "}");
    const uint64_t n = header.size();
    std::string bytes(8, '\0');
    std::memcpy(bytes.data(), &n, 8);
    fs::create_directories(fs::path(dir_) / folder);
    Publish(folder + "/weights.safetensors", bytes + header + data);
    Publish(folder + "/config.pbtxt",
            config.empty() ? absl::StrCat("embed_dim: ", kEmbed, "\nnum_heads: 2\n") : config);
  }

  void Publish(const std::string& rel, const std::string& bytes) {
    const fs::path path = fs::path(dir_) / rel;
    const fs::path tmp = path.string() + ".tmp";
    std::ofstream(tmp, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    fs::rename(tmp, path);
  }

  // What the model in `folder` computes for Query(), by the reference
  // engine on the layer its files hold now.
  std::vector<float> Expected(const std::string& folder) {
    RepositoryModel m = LoadModelFolder((fs::path(dir_) / folder).string());
    EXPECT_TRUE(m.status.ok()) << m.status;
    if (!m.status.ok()) return {};
    std::vector<float> q = Query();
    std::vector<float> out(q.size());
    AttentionTask task;
    task.query = TensorView{DType::kFloat32, {1, kTokens, kEmbed}, q.data()};
    task.scale = 1.0f / std::sqrt(static_cast<float>(kEmbed / 2));  // two heads
    task.output = MutableTensorView{DType::kFloat32, {1, kTokens, kEmbed}, out.data()};
    absl::Status s = oracle_->Run(*m.layer, absl::MakeConstSpan(&task, 1));
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }

  void StartServer(ModelControlMode mode, std::vector<std::string> load_models = {},
                   const std::string& backend = "reference") {
    ServerOptions options;
    options.address = "127.0.0.1:0";
    options.metrics_address = "127.0.0.1:0";
    options.backend = backend;
    options.engine_threads = 1;
    options.model_repository = dir_;
    options.model_control_mode = mode;
    options.load_models = std::move(load_models);
    // The test polls (PollOnce) when it wants to; the thread stays idle.
    options.repository_poll_interval = std::chrono::hours(1);
    absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
    stub_ = v1::AttentionService::NewStub(channel_);
  }

  grpc::Status Attend(const std::string& model, std::vector<float>* out,
                      const std::string& session_id = "") {
    v1::AttendRequest request;
    request.set_model(model);
    request.set_session_id(session_id);
    const std::vector<float> q = Query();
    v1::Tensor* t = request.mutable_query();
    t->set_dtype(v1::FLOAT32);
    for (int64_t d : {int64_t{1}, kTokens, kEmbed}) t->add_shape(d);
    t->set_data(q.data(), q.size() * sizeof(float));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::AttendResponse response;
    grpc::Status status = stub_->Attend(&context, request, &response);
    if (status.ok() && out != nullptr) {
      out->resize(response.output().data().size() / sizeof(float));
      std::memcpy(out->data(), response.output().data().data(), response.output().data().size());
    }
    return status;
  }

  // Which of `versions` `got` is (its index), or -1 for none.
  static int VersionOf(const std::vector<float>& got,
                       const std::vector<std::vector<float>>& versions) {
    for (size_t v = 0; v < versions.size(); ++v) {
      if (got.size() != versions[v].size()) continue;
      bool same = true;
      for (size_t i = 0; i < got.size() && same; ++i) {
        same = std::fabs(got[i] - versions[v][i]) <= 1e-6f * (1 + std::fabs(versions[v][i]));
      }
      if (same) return static_cast<int>(v);
    }
    return -1;
  }

  ModelState State(const std::string& name) {
    absl::StatusOr<std::shared_ptr<const ServedModel>> m = server_->registry().Find(name);
    EXPECT_TRUE(m.ok()) << m.status();
    return m.ok() ? (*m)->state : ModelState::kFailed;
  }

  std::string dir_;
  std::unique_ptr<AttentionEngine> oracle_;
  std::unique_ptr<AttnServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

TEST_F(ModelManagerTest, ExplicitModeLoadsReloadsAndUnloads) {
  WriteModel("a", 1.0f);
  WriteModel("b", 3.0f);
  StartServer(ModelControlMode::kExplicit, {"a"});
  ModelManager* models = server_->models();
  ASSERT_NE(models, nullptr);

  // b is listed but not loaded: refused UNAVAILABLE, naming it and why.
  EXPECT_EQ(State("b"), ModelState::kUnloaded);
  EXPECT_THAT(server_->metrics().Serialize(), Not(HasSubstr("model=\"b\"")));
  grpc::Status s = Attend("b", nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("'b' is not ready: not loaded"));
  {
    grpc::ClientContext context;
    v1::GetModelRequest get;
    get.set_name("b");
    v1::ModelStatus status;
    ASSERT_TRUE(stub_->GetModel(&context, get, &status).ok());
    EXPECT_EQ(status.state(), v1::ModelStatus::UNLOADED);
    EXPECT_THAT(status.reason(), HasSubstr("RepositoryModelLoad"));
  }

  ASSERT_TRUE(models->LoadAndWait("b").ok());
  std::vector<float> out;
  ASSERT_TRUE(Attend("b", &out).ok());
  EXPECT_EQ(VersionOf(out, {Expected("b")}), 0);

  // A reload re-reads the files: the new weights answer.
  const std::vector<float> a1 = Expected("a");
  ASSERT_TRUE(Attend("a", &out).ok());
  EXPECT_EQ(VersionOf(out, {a1}), 0);
  WriteModel("a", -2.0f);
  const std::vector<float> a2 = Expected("a");
  ASSERT_EQ(VersionOf(a2, {a1}), -1) << "the versions must differ for the test to mean anything";
  ASSERT_TRUE(models->LoadAndWait("a").ok());
  ASSERT_TRUE(Attend("a", &out).ok());
  EXPECT_EQ(VersionOf(out, {a1, a2}), 1);

  // A broken new version: refused with its reason, the old one serves on.
  Publish("a/config.pbtxt", "embed_dim: 16\nnum_heads: 3\n");
  absl::Status load = models->LoadAndWait("a");
  EXPECT_EQ(load.code(), absl::StatusCode::kInvalidArgument) << load;
  EXPECT_THAT(load.message(), HasSubstr("num_heads"));
  EXPECT_EQ(State("a"), ModelState::kReady);
  EXPECT_THAT(server_->registry().LoadError("a"), HasSubstr("previous one is serving"));
  ASSERT_TRUE(Attend("a", &out).ok());
  EXPECT_EQ(VersionOf(out, {a1, a2}), 1);

  // attnserve_model_ready: 1 while a serves (0 would page: the alert
  // AttnserveModelNotReady watches it), no series for b... until loaded.
  auto ready_series = [&](const std::string& model) {
    const std::string text = server_->metrics().Serialize();
    const std::string key = absl::StrCat("model=\"", model, "\"");
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      if (absl::StartsWith(line, "attnserve_model_ready{") && absl::StrContains(line, key)) {
        return std::string(line.substr(line.rfind(' ') + 1));
      }
    }
    return std::string("(none)");
  };
  EXPECT_EQ(ready_series("a"), "1");
  EXPECT_EQ(ready_series("b"), "1");

  // Unloaded: later requests are refused UNAVAILABLE naming it.
  ASSERT_TRUE(models->UnloadAndWait("a").ok());
  EXPECT_EQ(ready_series("a"), "(none)");
  s = Attend("a", nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("'a' is not ready: unloaded"));
  EXPECT_TRUE(models->UnloadAndWait("a").ok()) << "unloading twice is not an error";

  EXPECT_EQ(models->LoadAndWait("nope").code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(models->LoadAndWait("nope").message(), HasSubstr("no model 'nope'"));
  EXPECT_EQ(models->LoadAndWait("sdpa").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(models->UnloadAndWait("demo-mha").code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(ModelManagerTest, ExplicitModeRefusesAnUnknownLoadModel) {
  WriteModel("a", 1.0f);
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.metrics_address = "127.0.0.1:0";
  options.backend = "reference";
  options.model_repository = dir_;
  options.model_control_mode = ModelControlMode::kExplicit;
  options.load_models = {"a", "zz"};
  absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(server.status().message(), HasSubstr("--load-model: no model 'zz'"));
  options.model_control_mode = ModelControlMode::kPoll;
  server = AttnServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_THAT(server.status().message(), HasSubstr("--load-model is for"));
}

TEST_F(ModelManagerTest, PollModeReloadsUnderLoadWithoutAFailedRequest) {
  WriteModel("a", 1.0f);
  StartServer(ModelControlMode::kPoll);
  std::vector<std::vector<float>> versions = {Expected("a")};
  // `versions` grows only before `latest` says so, and never reallocates:
  // the clients never read an element being written.
  versions.reserve(6);

  std::atomic<bool> stop{false};
  std::atomic<int> failed{0}, unknown{0};
  std::vector<std::atomic<int>> answers_of(6);
  std::vector<std::thread> clients;
  std::atomic<int> latest{0};
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&] {
      // Each thread's own copy of the versions published so far.
      while (!stop.load()) {
        std::vector<float> out;
        grpc::Status s = Attend("a", &out);
        if (!s.ok()) {
          ++failed;
          ADD_FAILURE() << s.error_message();
          continue;
        }
        const int known = latest.load();
        int v = -1;
        for (int i = 0; i <= known && v < 0; ++i) {
          if (VersionOf(out, {versions[static_cast<size_t>(i)]}) == 0) v = i;
        }
        if (v < 0) {
          ++unknown;
        } else {
          ++answers_of[static_cast<size_t>(v)];
        }
      }
    });
  }
  for (int v = 1; v < static_cast<int>(answers_of.size()); ++v) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    WriteModel("a", 1.0f + static_cast<float>(v));
    versions.push_back(Expected("a"));
    latest.store(v);
    ASSERT_TRUE(server_->models()->PollOnce().ok());
    // Once the poll returns, the new version answers.
    std::vector<float> out;
    ASSERT_TRUE(Attend("a", &out).ok());
    EXPECT_EQ(VersionOf(out, {versions.back()}), 0) << "version " << v;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  stop.store(true);
  for (auto& t : clients) t.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(unknown.load(), 0) << "answers that are no version's";
  int total = 0;
  for (auto& n : answers_of) total += n.load();
  EXPECT_GT(total, 20);
  EXPECT_GT(answers_of.back().load(), 0);
}

TEST_F(ModelManagerTest, PollModeKeepsTheOldVersionWhenTheNewOneIsBroken) {
  WriteModel("a", 1.0f);
  StartServer(ModelControlMode::kPoll);
  const std::vector<float> a1 = Expected("a");
  Publish("a/config.pbtxt", "embed_dim: 16\nnum_heads: 2\nbogus_field: 1\n");
  ASSERT_TRUE(server_->models()->PollOnce().ok());
  EXPECT_EQ(State("a"), ModelState::kReady);
  EXPECT_THAT(server_->registry().LoadError("a"), HasSubstr("bogus_field"));
  std::vector<float> out;
  ASSERT_TRUE(Attend("a", &out).ok());
  EXPECT_EQ(VersionOf(out, {a1}), 0);

  // Fixed: the next poll loads it; the error is gone.
  WriteModel("a", 2.0f);
  const std::vector<float> a2 = Expected("a");
  ASSERT_TRUE(server_->models()->PollOnce().ok());
  EXPECT_EQ(server_->registry().LoadError("a"), "");
  ASSERT_TRUE(Attend("a", &out).ok());
  EXPECT_EQ(VersionOf(out, {a1, a2}), 1);
}

TEST_F(ModelManagerTest, PollModeFollowsFoldersComingAndGoing) {
  WriteModel("a", 1.0f);
  StartServer(ModelControlMode::kPoll);
  WriteModel("b", 2.0f);
  ASSERT_TRUE(server_->models()->PollOnce().ok());
  std::vector<float> out;
  ASSERT_TRUE(Attend("b", &out).ok());
  EXPECT_EQ(VersionOf(out, {Expected("b")}), 0);

  fs::remove_all(fs::path(dir_) / "a");
  ASSERT_TRUE(server_->models()->PollOnce().ok());
  EXPECT_EQ(State("a"), ModelState::kUnloaded);
  grpc::Status s = Attend("a", nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("left the model repository"));
  ASSERT_TRUE(Attend("b", &out).ok());
}

TEST_F(ModelManagerTest, UnloadUnderLoadAnswersEveryRequest) {
  WriteModel("a", 1.0f);
  StartServer(ModelControlMode::kExplicit, {"*"});
  const std::vector<float> a1 = Expected("a");
  std::atomic<bool> stop{false}, unloaded{false};
  std::atomic<int> ok{0}, ok_after_unload{0}, unavailable{0}, other{0}, wrong{0};
  std::vector<std::thread> clients;
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&] {
      while (!stop.load()) {
        // Judged by when the request was sent: an answer already on its way
        // when the unload returned is not one that came after it.
        const bool sent_after_unload = unloaded.load();
        std::vector<float> out;
        grpc::Status s = Attend("a", &out);
        if (s.ok()) {
          ++ok;
          if (sent_after_unload) ++ok_after_unload;
          if (VersionOf(out, {a1}) != 0) ++wrong;
        } else if (s.error_code() == grpc::StatusCode::UNAVAILABLE &&
                   s.error_message().find("'a'") != std::string::npos) {
          ++unavailable;
        } else {
          ++other;
          ADD_FAILURE() << s.error_code() << " " << s.error_message();
        }
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(server_->models()->UnloadAndWait("a").ok());
  unloaded.store(true);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  stop.store(true);
  for (auto& t : clients) t.join();
  EXPECT_GT(ok.load(), 0);
  EXPECT_EQ(ok_after_unload.load(), 0) << "answered by a model that was unloaded";
  EXPECT_GT(unavailable.load(), 0);
  EXPECT_EQ(other.load(), 0);
  EXPECT_EQ(wrong.load(), 0);
}

TEST_F(ModelManagerTest, SessionsEndWhenTheirModelIsReloaded) {
  WriteModel("a", 1.0f);
  StartServer(ModelControlMode::kExplicit, {"a"}, "cpu");  // the engine that serves sessions
  v1::OpenSessionRequest open;
  open.set_model("a");
  v1::OpenSessionResponse opened;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->OpenSession(&context, open, &opened).ok());
  }
  ASSERT_TRUE(Attend("", nullptr, opened.session_id()).ok());
  WriteModel("a", 2.0f);
  ASSERT_TRUE(server_->models()->LoadAndWait("a").ok());
  grpc::Status s = Attend("", nullptr, opened.session_id());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(s.error_message(), HasSubstr("model 'a' was reloaded"));
  // A new session works on the new version.
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->OpenSession(&context, open, &opened).ok());
  }
  EXPECT_TRUE(Attend("", nullptr, opened.session_id()).ok());
  // And ends on unload.
  ASSERT_TRUE(server_->models()->UnloadAndWait("a").ok());
  s = Attend("", nullptr, opened.session_id());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_THAT(s.error_message(), HasSubstr("model 'a' was unloaded"));
}

// The swap against the request path without gRPC in between (so that
// ThreadSanitizer sees every handoff: Debian's gRPC is not instrumented):
// the server's parts wired as AttnServer wires them, client threads
// submitting to the dispatcher while the model is reloaded and unloaded.
TEST_F(ModelManagerTest, DispatcherRacesReloadsAndUnloads) {
  WriteModel("a", 1.0f);
  std::vector<std::vector<float>> versions = {Expected("a")};
  versions.reserve(16);
  std::atomic<int> latest{0};

  std::shared_ptr<AttentionEngine> engine = CreateEngine("reference", {}).value();
  ModelRegistry registry;
  ASSERT_TRUE(AddBuiltinModels(engine, &registry).ok());
  ModelControlOptions control;
  control.mode = ModelControlMode::kExplicit;
  control.repository = dir_;
  control.load_models = {"a"};
  control.drain_grace = absl::Seconds(30);
  absl::StatusOr<std::unique_ptr<ModelManager>> models = ModelManager::Create(
      control, std::make_shared<BackendEngines>(engine, EngineOptions{}), &registry);
  ASSERT_TRUE(models.ok()) << models.status();
  Clock* clock = MonotonicClock::Get();
  std::unique_ptr<BatchingScheduler> scheduler =
      BatchingScheduler::Create(registry, BatcherOptions{}, nullptr, clock).value();
  SessionManager sessions(SessionOptions{}, clock, nullptr);
  RequestDispatcher dispatcher(&registry, scheduler.get(), nullptr, clock, ValidationOptions{},
                               &sessions);
  (*models)->Start(scheduler.get(), &sessions, nullptr);

  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, unavailable{0}, bad{0};
  const std::vector<float> q = Query();
  std::vector<std::thread> clients;
  for (int c = 0; c < 3; ++c) {
    clients.emplace_back([&] {
      std::vector<float> out(q.size());
      while (!stop.load()) {
        absl::Notification answered;
        absl::Status status;
        auto request = std::make_unique<InferenceRequest>();
        request->received = clock->Now();
        request->done = [&](absl::Status s, const InferenceRequest&) {
          status = std::move(s);
          answered.Notify();
        };
        AttendInputs inputs;
        inputs.model = "a";
        inputs.query.present = true;
        inputs.query.shape = {1, kTokens, kEmbed};
        inputs.query.data = absl::string_view(reinterpret_cast<const char*>(q.data()),
                                              q.size() * sizeof(float));
        dispatcher.Submit(std::move(request), inputs,
                          [&](OutputName, DType dtype, const Shape& shape) {
                            return MutableTensorView{dtype, shape, out.data()};
                          });
        answered.WaitForNotification();
        if (status.ok()) {
          const int known = latest.load();
          int v = -1;
          for (int i = 0; i <= known && v < 0; ++i) {
            if (VersionOf(out, {versions[static_cast<size_t>(i)]}) == 0) v = i;
          }
          ++(v >= 0 ? ok : bad);
        } else if (status.code() == absl::StatusCode::kUnavailable &&
                   absl::StrContains(status.message(), "'a'")) {
          ++unavailable;
        } else {
          ++bad;
          ADD_FAILURE() << status;
        }
      }
    });
  }
  for (int round = 1; round <= 6; ++round) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (round % 3 == 0) {
      ASSERT_TRUE((*models)->UnloadAndWait("a").ok());
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    WriteModel("a", 1.0f + static_cast<float>(round));
    versions.push_back(Expected("a"));
    latest.store(round);
    ASSERT_TRUE((*models)->LoadAndWait("a").ok());
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  stop.store(true);
  for (auto& t : clients) t.join();
  (*models)->Stop();
  scheduler->Shutdown(absl::Seconds(5));
  EXPECT_GT(ok.load(), 10);
  EXPECT_GT(unavailable.load(), 0);
  EXPECT_EQ(bad.load(), 0);
}

}  // namespace
}  // namespace attnserve

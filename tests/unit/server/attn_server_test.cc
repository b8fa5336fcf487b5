// AttnServer end to end in process: a real gRPC server on an ephemeral
// loopback port, called through the generated stub. Covers the answers a
// client sees: results, id/timing, every error class, health, reflection,
// and serving on after bad requests.
#include "server/attn_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "engine/model/builtin_models.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;

v1::Tensor RandomTensor(std::vector<int64_t> shape, std::mt19937* rng) {
  v1::Tensor t;
  t.set_dtype(v1::FLOAT32);
  int64_t n = 1;
  for (int64_t d : shape) {
    t.add_shape(d);
    n *= d;
  }
  std::vector<float> values(static_cast<size_t>(n));
  std::normal_distribution<float> normal;
  for (float& v : values) v = normal(*rng);
  t.set_data(values.data(), values.size() * sizeof(float));
  return t;
}

const float* Floats(const v1::Tensor& t) { return reinterpret_cast<const float*>(t.data().data()); }

class AttnServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ServerOptions options;
    options.address = "127.0.0.1:0";
    options.metrics_address = "127.0.0.1:0";
    options.backend = "reference";  // the oracle: this tests the server, not the kernels
    options.engine_threads = 1;
    options.max_message_bytes = 1 << 20;
    absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }

  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    channel_ = grpc::CreateCustomChannel(server_->address(), grpc::InsecureChannelCredentials(),
                                         ChannelArgs());
    stub_ = v1::AttentionService::NewStub(channel_);
  }

  static grpc::ChannelArguments ChannelArgs() {
    grpc::ChannelArguments args;
    args.SetMaxSendMessageSize(64 << 20);
    return args;
  }

  grpc::Status Attend(const v1::AttendRequest& request, v1::AttendResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return stub_->Attend(&context, request, response);
  }

  // grpc.health.v1.Health/Check through the generic stub (no generated
  // health stubs in C++): request {service}, response {status}.
  std::string HealthCheck(const std::string& service, grpc::Status* status) {
    grpc::GenericStub generic(channel_);
    std::string request;
    if (!service.empty()) {
      request.push_back('\x0a');
      request.push_back(static_cast<char>(service.size()));
      request += service;
    }
    grpc::Slice slice(request);
    grpc::ByteBuffer request_buffer(&slice, 1);
    grpc::ByteBuffer response_buffer;
    grpc::ClientContext context;
    std::promise<grpc::Status> done;
    generic.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(),
                      &request_buffer, &response_buffer,
                      [&done](grpc::Status s) { done.set_value(std::move(s)); });
    *status = done.get_future().get();
    std::vector<grpc::Slice> slices;
    std::string out;
    if (status->ok() && response_buffer.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
    return out;
  }

  static AttnServer* server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
};

AttnServer* AttnServerTest::server_ = nullptr;

TEST_F(AttnServerTest, AddressHasTheBoundPort) {
  EXPECT_GT(server_->port(), 0);
  EXPECT_EQ(server_->address(), "127.0.0.1:" + std::to_string(server_->port()));
}

TEST_F(AttnServerTest, SdpaMatchesNaiveAttention) {
  constexpr int B = 2, Hq = 4, Hkv = 2, Lq = 3, Lk = 5, D = 8, Dv = 4;
  std::mt19937 rng(7);
  v1::AttendRequest request;
  request.set_model("sdpa");
  request.set_id("req-1");
  *request.mutable_query() = RandomTensor({B, Hq, Lq, D}, &rng);
  *request.mutable_key() = RandomTensor({B, Hkv, Lk, D}, &rng);
  *request.mutable_value() = RandomTensor({B, Hkv, Lk, Dv}, &rng);
  request.set_need_weights(true);
  v1::AttendResponse response;
  grpc::Status status = Attend(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();

  EXPECT_EQ(response.id(), "req-1");
  EXPECT_EQ(response.output().dtype(), v1::FLOAT32);
  EXPECT_THAT(response.output().shape(), ::testing::ElementsAre(B, Hq, Lq, Dv));
  EXPECT_THAT(response.weights().shape(), ::testing::ElementsAre(B, Hq, Lq, Lk));
  EXPECT_EQ(response.timing().batch_requests(), 1);
  EXPECT_GE(response.timing().total_us(), response.timing().compute_us());
  EXPECT_GE(response.timing().queue_us(), 0);

  const float* q = Floats(request.query());
  const float* k = Floats(request.key());
  const float* v = Floats(request.value());
  const float* o = Floats(response.output());
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < Hq; ++h) {
      const int kh = h / (Hq / Hkv);
      for (int i = 0; i < Lq; ++i) {
        std::vector<double> p(Lk);
        double max = -INFINITY, sum = 0;
        for (int j = 0; j < Lk; ++j) {
          double s = 0;
          for (int d = 0; d < D; ++d) {
            s += double{q[((b * Hq + h) * Lq + i) * D + d]} * k[((b * Hkv + kh) * Lk + j) * D + d];
          }
          p[j] = s / std::sqrt(double{D});
          max = std::max(max, p[j]);
        }
        for (double& x : p) sum += (x = std::exp(x - max));
        for (int d = 0; d < Dv; ++d) {
          double expected = 0;
          for (int j = 0; j < Lk; ++j) expected += p[j] / sum * v[((b * Hkv + kh) * Lk + j) * Dv + d];
          EXPECT_NEAR(o[((b * Hq + h) * Lq + i) * Dv + d], expected, 1e-5);
        }
      }
    }
  }
}

TEST_F(AttnServerTest, DefaultModelIsDemoMhaSelfAttention) {
  std::mt19937 rng(1);
  v1::AttendRequest request;
  *request.mutable_query() = RandomTensor({1, 4, 512}, &rng);
  v1::AttendResponse response;
  grpc::Status status = Attend(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_THAT(response.output().shape(), ::testing::ElementsAre(1, 4, 512));
  ASSERT_EQ(response.output().data().size(), 4u * 512 * 4);

  // The values: demo-mha's weights through nn.MultiheadAttention's arithmetic
  // in double, written out here (tests/python/test_demo_mha.py checks the
  // same layer against PyTorch itself).
  constexpr int L = 4, E = 512, H = 8, D = 64;
  const std::shared_ptr<const AttentionLayer> demo = MakeDemoMhaLayer();
  const LayerWeights& w = demo->weights;
  auto linear = [](const std::vector<double>& x, const Tensor& weight, const Tensor& bias) {
    std::vector<double> y(L * E);
    for (int r = 0; r < L; ++r)
      for (int n = 0; n < E; ++n) {
        double acc = bias.data_as<float>()[n];
        for (int c = 0; c < E; ++c) acc += x[r * E + c] * weight.data_as<float>()[n * E + c];
        y[r * E + n] = acc;
      }
    return y;
  };
  const std::vector<double> x(Floats(request.query()), Floats(request.query()) + L * E);
  const std::vector<double> q = linear(x, w.wq, w.bq), k = linear(x, w.wk, w.bk),
                            v = linear(x, w.wv, w.bv);
  std::vector<double> heads(L * E, 0.0);  // [L, H * D]
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < L; ++i) {
      double p[L], max = -INFINITY, sum = 0;
      for (int j = 0; j < L; ++j) {
        p[j] = 0;
        for (int d = 0; d < D; ++d) p[j] += q[i * E + h * D + d] * k[j * E + h * D + d];
        max = std::max(max, p[j] /= std::sqrt(double{D}));
      }
      for (double& s : p) sum += (s = std::exp(s - max));
      for (int j = 0; j < L; ++j)
        for (int d = 0; d < D; ++d) heads[i * E + h * D + d] += p[j] / sum * v[j * E + h * D + d];
    }
  const std::vector<double> y = linear(heads, w.wo, w.bo);
  const float* o = Floats(response.output());
  for (int i = 0; i < L * E; ++i) ASSERT_NEAR(o[i], y[i], 1e-5) << "element " << i;
}

TEST_F(AttnServerTest, OutputDtypeFollowsRequest) {
  std::mt19937 rng(2);
  v1::AttendRequest request;
  request.set_model("sdpa");
  *request.mutable_query() = RandomTensor({1, 1, 2, 4}, &rng);
  *request.mutable_key() = RandomTensor({1, 1, 3, 4}, &rng);
  *request.mutable_value() = RandomTensor({1, 1, 3, 4}, &rng);
  request.set_output_dtype(v1::BFLOAT16);
  request.set_need_weights(true);
  request.set_average_weights(true);
  v1::AttendResponse response;
  ASSERT_TRUE(Attend(request, &response).ok());
  EXPECT_EQ(response.output().dtype(), v1::BFLOAT16);
  EXPECT_EQ(response.output().data().size(), 2u * 4 * 2);
  EXPECT_EQ(response.weights().dtype(), v1::BFLOAT16);
  EXPECT_THAT(response.weights().shape(), ::testing::ElementsAre(1, 2, 3));
}

TEST_F(AttnServerTest, BadRequestsGetTheirCodeAndTheServerServesOn) {
  std::mt19937 rng(3);
  v1::AttendResponse response;

  v1::AttendRequest unknown;
  unknown.set_model("no-such-model");
  *unknown.mutable_query() = RandomTensor({1, 2, 512}, &rng);
  grpc::Status status = Attend(unknown, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(status.error_message(), HasSubstr("no-such-model"));
  EXPECT_THAT(status.error_message(), HasSubstr("demo-mha, sdpa"));

  v1::AttendRequest bad_bytes;
  *bad_bytes.mutable_query() = RandomTensor({1, 2, 512}, &rng);
  bad_bytes.mutable_query()->mutable_data()->resize(100);
  status = Attend(bad_bytes, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("query.data: expected 4096 bytes"));

  v1::AttendRequest bad_scale;
  *bad_scale.mutable_query() = RandomTensor({1, 2, 512}, &rng);
  bad_scale.set_scale(-1.0f);
  status = Attend(bad_scale, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("scale"));

  // Over --max-message-bytes (1 MiB here): gRPC refuses before parsing.
  v1::AttendRequest huge;
  *huge.mutable_query() = RandomTensor({1, 1024, 512}, &rng);  // 2 MiB
  status = Attend(huge, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);

  v1::AttendRequest good;
  good.set_id("after");
  *good.mutable_query() = RandomTensor({1, 2, 512}, &rng);
  status = Attend(good, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.id(), "after");
}

TEST_F(AttnServerTest, ListAndGetModels) {
  grpc::ClientContext list_context;
  v1::ListModelsResponse list;
  ASSERT_TRUE(stub_->ListModels(&list_context, v1::ListModelsRequest(), &list).ok());
  ASSERT_EQ(list.models_size(), 2);
  EXPECT_EQ(list.models(0).name(), "demo-mha");
  EXPECT_TRUE(list.models(0).is_default());
  EXPECT_EQ(list.models(0).state(), v1::ModelStatus::READY);
  EXPECT_EQ(list.models(0).backend(), "reference");
  EXPECT_EQ(list.models(0).config().num_heads(), 8);
  EXPECT_EQ(list.models(1).name(), "sdpa");
  EXPECT_FALSE(list.models(1).is_default());

  grpc::ClientContext get_context;
  v1::GetModelRequest get;
  get.set_name("sdpa");
  v1::ModelStatus model;
  ASSERT_TRUE(stub_->GetModel(&get_context, get, &model).ok());
  EXPECT_EQ(model.config().kind(), "sdpa");

  grpc::ClientContext missing_context;
  get.set_name("missing");
  EXPECT_EQ(stub_->GetModel(&missing_context, get, &model).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

// Interleaved good and bad messages: one answer per message, in any order,
// each with its request's id and its own status; the stream ends OK.
TEST_F(AttnServerTest, AttendStreamAnswersEachMessageWithItsIdAndStatus) {
  std::mt19937 rng(11);
  v1::AttendRequest good;
  good.set_model("sdpa");
  *good.mutable_query() = RandomTensor({1, 2, 3, 4}, &rng);
  *good.mutable_key() = RandomTensor({1, 2, 5, 4}, &rng);
  *good.mutable_value() = RandomTensor({1, 2, 5, 4}, &rng);
  v1::AttendRequest bad_dtype = good;
  bad_dtype.mutable_key()->set_dtype(v1::DATA_TYPE_UNSPECIFIED);
  v1::AttendRequest unknown_model = good;
  unknown_model.set_model("no-such-model");

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = stub_->AttendStream(&context);
  std::map<std::string, grpc::StatusCode> want;
  for (int round = 0; round < 3; ++round) {
    for (auto [request, code] : {std::pair{&good, grpc::StatusCode::OK},
                                 std::pair{&bad_dtype, grpc::StatusCode::INVALID_ARGUMENT},
                                 std::pair{&unknown_model, grpc::StatusCode::NOT_FOUND}}) {
      v1::AttendRequest r = *request;
      r.set_id("m" + std::to_string(want.size()));
      want[r.id()] = code;
      ASSERT_TRUE(stream->Write(r));
    }
  }
  stream->WritesDone();
  std::map<std::string, grpc::StatusCode> got;
  v1::AttendStreamResponse response;
  while (stream->Read(&response)) {
    EXPECT_EQ(got.count(response.id()), 0u) << "two answers for " << response.id();
    got[response.id()] = static_cast<grpc::StatusCode>(response.code());
    if (response.code() == 0) {
      EXPECT_EQ(response.response().id(), response.id());
      EXPECT_THAT(response.response().output().shape(), ::testing::ElementsAre(1, 2, 3, 4));
      EXPECT_GE(response.response().timing().batch_requests(), 1);
    } else {
      EXPECT_FALSE(response.message().empty());
      EXPECT_FALSE(response.has_response());
    }
  }
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(got, want);
}

// Streams that half-close right after their one message: the answer comes
// from a batcher worker after the client's WritesDone, so that worker is the
// one that finishes the stream, racing gRPC's OnDone (which deletes the
// reactor) on another thread. It used to call Finish under the reactor's
// mutex and unlock it after the delete (the soak's "Mutex unlocked when
// destroyed" abort); under scripts/sanitize.sh tsan or asan that shows as a
// use after free. Many at once, from several threads, to hit the window.
TEST_F(AttnServerTest, StreamsFinishedByTheirLastAnswerAfterHalfClose) {
  std::mt19937 rng(12);
  v1::AttendRequest request;
  request.set_model("sdpa");
  *request.mutable_query() = RandomTensor({1, 1, 2, 4}, &rng);
  *request.mutable_key() = RandomTensor({1, 1, 2, 4}, &rng);
  *request.mutable_value() = RandomTensor({1, 1, 2, 4}, &rng);
  constexpr int kThreads = 4, kStreamsEach = 50;
  std::atomic<int> answered{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kStreamsEach; ++i) {
        grpc::ClientContext context;
        context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
        auto stream = stub_->AttendStream(&context);
        v1::AttendRequest r = request;
        r.set_id(absl::StrCat(t, "-", i));
        if (!stream->Write(r)) continue;
        stream->WritesDone();
        v1::AttendStreamResponse response;
        while (stream->Read(&response)) {
          if (response.code() == 0 && response.id() == r.id()) answered.fetch_add(1);
        }
        EXPECT_TRUE(stream->Finish().ok());
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(answered.load(), kThreads * kStreamsEach);
}

TEST_F(AttnServerTest, HealthServing) {
  grpc::Status status;
  EXPECT_EQ(HealthCheck("", &status), std::string("\x08\x01", 2));  // SERVING
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(HealthCheck(kAttentionServiceName, &status), std::string("\x08\x01", 2));
  EXPECT_TRUE(status.ok()) << status.error_message();
  HealthCheck("no.such.Service", &status);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST(AttnServerStartTest, BadOptionsFailToStart) {
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.metrics_address = "127.0.0.1:0";
  options.default_model = "nope";
  absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Start(options);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(server.status().message()), HasSubstr("--default-model"));

  options.default_model = "sdpa";
  options.backend = "tpu";
  EXPECT_EQ(AttnServer::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AttnServerStartTest, PortInUseFailsAndShutdownRefusesNewCalls) {
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.metrics_address = "127.0.0.1:0";
  options.backend = "reference";
  absl::StatusOr<std::unique_ptr<AttnServer>> first = AttnServer::Start(options);
  ASSERT_TRUE(first.ok()) << first.status();

  options.address = (*first)->address();
  absl::StatusOr<std::unique_ptr<AttnServer>> second = AttnServer::Start(options);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);

  auto channel = grpc::CreateChannel((*first)->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::AttentionService::NewStub(channel);
  (*first)->Shutdown();
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::ListModelsResponse list;
  EXPECT_EQ(stub->ListModels(&context, v1::ListModelsRequest(), &list).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

// One HTTP/1.1 request on a fresh connection; the whole answer (the server
// closes: "Connection: close").
std::string HttpRequest(int port, const std::string& request) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
  std::string answer;
  if (connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) == 0) {
    (void)!write(fd, request.data(), request.size());
    char buf[4096];
    for (ssize_t n; (n = read(fd, buf, sizeof buf)) > 0;) {
      answer.append(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return answer;
}

// The KServe HTTP endpoint in process (what the sanitizers see of it):
// concurrent JSON inferences through the batcher, each answered 200 with the
// values one key gives (softmax over one key is 1: the output is its value
// row), then a graceful shutdown.
TEST(AttnServerHttpTest, ConcurrentJsonInferencesThenShutdown) {
  ServerOptions options;
  options.address = "127.0.0.1:0";
  options.metrics_address = "127.0.0.1:0";
  options.http.address = "127.0.0.1:0";
  options.backend = "cpu";
  absl::StatusOr<std::unique_ptr<AttnServer>> server = AttnServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->http_address();
  ASSERT_FALSE(address.empty());
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  // One key: each query row's output is that key's value row exactly.
  const std::string body =
      R"({"inputs": [{"name": "query", "shape": [1, 1, 2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]},
                     {"name": "key", "shape": [1, 1, 1, 2], "datatype": "FP32", "data": [0.5, 0.5]},
                     {"name": "value", "shape": [1, 1, 1, 2], "datatype": "FP32", "data": [7, -3]}]})";
  const std::string request = absl::StrCat(
      "POST /v2/models/sdpa/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: ",
      body.size(), "\r\n\r\n", body);
  std::vector<std::future<std::string>> answers;
  for (int i = 0; i < 8; ++i) {
    answers.push_back(std::async(std::launch::async, [&] { return HttpRequest(port, request); }));
  }
  for (auto& a : answers) {
    const std::string answer = a.get();
    EXPECT_THAT(answer, HasSubstr("HTTP/1.1 200"));
    EXPECT_THAT(answer, HasSubstr(R"("data":[7.0,-3.0,7.0,-3.0])"));
  }
  (*server)->Shutdown();
  server->reset();
}

}  // namespace
}  // namespace attnserve

// Tests of server/metrics: names, labels and units of every metric, and the
// /metrics endpoint on an ephemeral loopback port.
#include "server/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace attnserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A plain HTTP/1.0 GET over loopback; returns the whole reply.
std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return "";
  }
  const std::string req = "GET " + path + " HTTP/1.0\r\nHost: localhost\r\n\r\n";
  (void)!write(fd, req.data(), req.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) out.append(buf, n);
  close(fd);
  return out;
}

// A loopback connection that has sent the first half of a request and then
// stays silent (a slow or hostile client). Reads on it give up after 5 s.
int OpenHalfRequest(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval five_seconds{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &five_seconds, sizeof five_seconds);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  const std::string half = "GET /metrics HTTP/1.1\r\nHost: local";
  (void)!write(fd, half.data(), half.size());
  return fd;
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

MetricsOptions Options(const std::string& address) {
  MetricsOptions o;
  o.address = address;
  return o;
}

TEST(MetricsTest, ExposesEveryFamilyLabelledByModel) {
  auto m = Metrics::Create({.address = "", .build_labels = {{"backend", "cpu"}}});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->port(), 0);
  ModelMetrics* mm = (*m)->ForModel("demo-mha");
  EXPECT_EQ(mm, (*m)->ForModel("demo-mha"));
  mm->RequestDone(absl::StatusCode::kOk, 0.002);
  mm->RequestDone(absl::StatusCode::kOk, 0.003);
  mm->RequestDone(absl::StatusCode::kResourceExhausted, 0.00001);
  mm->Queued(0.0005);
  mm->BatchDone(2, 32, 0.001);
  mm->SetQueueDepth(3);
  mm->SetQueueCapacity(1024);
  mm->InflightAdd(2);
  mm->InflightAdd(-1);
  mm->RefillWait(true);
  mm->RefillWait(true);
  mm->RefillWait(false);
  const std::string text = (*m)->Serialize();
  EXPECT_THAT(text, HasSubstr("attnserve_requests_total{code=\"OK\",model=\"demo-mha\"} 2"));
  EXPECT_THAT(text, HasSubstr(
      "attnserve_requests_total{code=\"RESOURCE_EXHAUSTED\",model=\"demo-mha\"} 1"));
  EXPECT_THAT(text, HasSubstr("attnserve_request_duration_seconds_count{model=\"demo-mha\"} 3"));
  EXPECT_THAT(text, HasSubstr("attnserve_queue_duration_seconds_count{model=\"demo-mha\"} 1"));
  EXPECT_THAT(text, HasSubstr("attnserve_compute_duration_seconds_count{model=\"demo-mha\"} 1"));
  EXPECT_THAT(text, HasSubstr("attnserve_batch_requests_sum{model=\"demo-mha\"} 2"));
  EXPECT_THAT(text, HasSubstr("attnserve_batch_tokens_sum{model=\"demo-mha\"} 32"));
  EXPECT_THAT(text, HasSubstr("attnserve_queue_depth{model=\"demo-mha\"} 3"));
  EXPECT_THAT(text, HasSubstr("attnserve_queue_capacity{model=\"demo-mha\"} 1024"));
  EXPECT_THAT(text, HasSubstr("attnserve_inflight_requests{model=\"demo-mha\"} 1"));
  EXPECT_THAT(text, HasSubstr("attnserve_tokens_total{model=\"demo-mha\"} 32"));
  EXPECT_THAT(text, HasSubstr(
      "attnserve_batch_refill_waits_total{model=\"demo-mha\",outcome=\"hit\"} 2"));
  EXPECT_THAT(text, HasSubstr(
      "attnserve_batch_refill_waits_total{model=\"demo-mha\",outcome=\"miss\"} 1"));
  EXPECT_THAT(text, HasSubstr("attnserve_build_info{backend=\"cpu\",version="));
  // Buckets span 10 us .. 10 s.
  EXPECT_THAT(text, HasSubstr("attnserve_request_duration_seconds_bucket{model=\"demo-mha\",le=\"1e-05\"}"));
  EXPECT_THAT(text, HasSubstr("attnserve_request_duration_seconds_bucket{model=\"demo-mha\",le=\"10\"}"));
}

TEST(MetricsTest, ModelReadyCarriesStateAndBackend) {
  auto m = Metrics::Create({.address = "", .build_labels = {}});
  ASSERT_TRUE(m.ok()) << m.status();
  (*m)->SetModelReady("demo-mha", "cpu", true);
  (*m)->SetModelReady("broken", "", false);
  const std::string text = (*m)->Serialize();
  EXPECT_THAT(text, HasSubstr("attnserve_model_ready{backend=\"cpu\",model=\"demo-mha\"} 1"));
  EXPECT_THAT(text, HasSubstr("attnserve_model_ready{backend=\"\",model=\"broken\"} 0"));
}

TEST(MetricsTest, ServesOnEphemeralPort) {
  auto m = Metrics::Create(Options("127.0.0.1:0"));
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_GT((*m)->port(), 0);
  EXPECT_EQ((*m)->address(), "127.0.0.1:" + std::to_string((*m)->port()));
  (*m)->ForModel("sdpa")->RequestDone(absl::StatusCode::kOk, 0.001);
  const std::string reply = HttpGet((*m)->port(), "/metrics");
  EXPECT_THAT(reply, HasSubstr("200 OK"));
  EXPECT_THAT(reply, HasSubstr("attnserve_requests_total{code=\"OK\",model=\"sdpa\"} 1"));
}

TEST(MetricsTest, BusyPortIsUnavailable) {
  auto first = Metrics::Create(Options("127.0.0.1:0"));
  ASSERT_TRUE(first.ok());
  auto second = Metrics::Create(Options("127.0.0.1:" + std::to_string((*first)->port())));
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
}

TEST(MetricsTest, ConnectionsShedIsReadAtEachScrape) {
  int64_t shed = 0;
  MetricsOptions o = Options("127.0.0.1:0");
  o.connections_shed = [&shed] { return shed; };
  auto m = Metrics::Create(o);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_THAT((*m)->Serialize(), HasSubstr("attnserve_connections_shed_total 0"));
  shed = 3;
  EXPECT_THAT(HttpGet((*m)->port(), "/metrics"),
              HasSubstr("# TYPE attnserve_connections_shed_total counter\n"
                        "attnserve_connections_shed_total 3"));
  EXPECT_THAT(Metrics::Create(Options("")).value()->Serialize(),
              Not(HasSubstr("attnserve_connections_shed_total")));
}

TEST(MetricsTest, RejectsNoThreadsAndNoTimeout) {
  MetricsOptions o = Options("127.0.0.1:0");
  o.threads = 0;
  EXPECT_EQ(Metrics::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o = Options("127.0.0.1:0");
  o.request_timeout = std::chrono::milliseconds(0);
  EXPECT_EQ(Metrics::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// Issue 14: with 2 threads and civetweb's 30 s request timeout, two clients
// that sent half a request blocked every scrape for 29.7 s.
TEST(MetricsTest, ScrapeAnswersWhileClientsHoldHalfRequests) {
  const MetricsOptions o = Options("127.0.0.1:0");  // default threads and timeout
  auto m = Metrics::Create(o);
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<int> slow;
  for (int i = 0; i + 1 < o.threads; ++i) slow.push_back(OpenHalfRequest((*m)->port()));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(HttpGet((*m)->port(), "/metrics"), HasSubstr("200 OK"));
  EXPECT_LT(SecondsSince(start), 1.0);
  // Closing them frees their workers at once; a worker still waiting for
  // its request notices the stop only within 2 s (civetweb's poll quantum).
  for (int fd : slow) close(fd);
}

TEST(MetricsTest, RequestTimeoutDropsAHalfRequest) {
  MetricsOptions o = Options("127.0.0.1:0");
  o.threads = 1;
  o.request_timeout = std::chrono::milliseconds(200);
  auto m = Metrics::Create(o);
  ASSERT_TRUE(m.ok()) << m.status();
  const int slow = OpenHalfRequest((*m)->port());
  ASSERT_GE(slow, 0);
  const auto start = std::chrono::steady_clock::now();
  // The only worker is held until the timeout; then the scrape gets it.
  EXPECT_THAT(HttpGet((*m)->port(), "/metrics"), HasSubstr("200 OK"));
  EXPECT_GE(SecondsSince(start), 0.1);
  EXPECT_LT(SecondsSince(start), 2.0);
  // The slow client was dropped: its read ends (EOF or an error reply), it
  // does not wait for the 5 s receive timeout.
  char buf[4096];
  while (read(slow, buf, sizeof buf) > 0) {
  }
  EXPECT_LT(SecondsSince(start), 2.0);
  close(slow);
}

}  // namespace
}  // namespace attnserve

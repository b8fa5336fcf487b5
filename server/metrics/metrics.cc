// Metric families, bucket layouts and the /metrics endpoint.
#include "server/metrics/metrics.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include <cmath>
#include <exception>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "prometheus/exposer.h"
#include "prometheus/text_serializer.h"

#ifndef ATTNSERVE_VERSION
#define ATTNSERVE_VERSION "unknown"
#endif

namespace attnserve {
namespace {

// a == b in time that depends only on a.size() (a: what the client sent),
// for basic-auth credentials.
bool SameSecret(const std::string& a, const std::string& b) {
  if (b.empty()) return a.empty();
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i]) ^ static_cast<unsigned char>(b[i % b.size()]);
  }
  return diff == 0;
}


// 10 us .. 10 s, four buckets per decade (x1.78 each): fine enough that
// histogram_quantile's interpolation stays within ~1.8x of the true value,
// coarse enough to keep 25 series per histogram.
prometheus::Histogram::BucketBoundaries SecondsBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (int i = 0; i <= 24; ++i) b.push_back(1e-5 * std::pow(10.0, i / 4.0));
  return b;
}

// Batch sizes in requests: exact for small batches, then doubling.
prometheus::Histogram::BucketBoundaries RequestBuckets() {
  return {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024};
}

// Batch sizes in query tokens: 1 .. 1M, doubling.
prometheus::Histogram::BucketBoundaries TokenBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double v = 1; v <= (1 << 20); v *= 2) b.push_back(v);
  return b;
}

// Families whose value lives outside this object (a process-wide counter)
// and is read when scraped.
class ReadOnScrape : public prometheus::Collectable {
 public:
  explicit ReadOnScrape(std::function<int64_t()> connections_shed)
      : connections_shed_(std::move(connections_shed)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    prometheus::MetricFamily family;
    family.name = "attnserve_connections_shed_total";
    family.help =
        "Incoming gRPC connections closed at once because the process had no free file "
        "descriptor (the listener keeps accepting; raise the open files limit)";
    family.type = prometheus::MetricType::Counter;
    prometheus::ClientMetric value;
    value.counter.value = static_cast<double>(connections_shed_());
    family.metric.push_back(std::move(value));
    return {std::move(family)};
  }

 private:
  const std::function<int64_t()> connections_shed_;
};

}  // namespace

const char* StatusCodeLabel(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk: return "OK";
    case absl::StatusCode::kCancelled: return "CANCELLED";
    case absl::StatusCode::kUnknown: return "UNKNOWN";
    case absl::StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case absl::StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case absl::StatusCode::kNotFound: return "NOT_FOUND";
    case absl::StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case absl::StatusCode::kPermissionDenied: return "PERMISSION_DENIED";
    case absl::StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case absl::StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case absl::StatusCode::kAborted: return "ABORTED";
    case absl::StatusCode::kOutOfRange: return "OUT_OF_RANGE";
    case absl::StatusCode::kUnimplemented: return "UNIMPLEMENTED";
    case absl::StatusCode::kInternal: return "INTERNAL";
    case absl::StatusCode::kUnavailable: return "UNAVAILABLE";
    case absl::StatusCode::kDataLoss: return "DATA_LOSS";
    case absl::StatusCode::kUnauthenticated: return "UNAUTHENTICATED";
    default: return "UNKNOWN";
  }
}

namespace {
uint64_t Nanos(double seconds) { return seconds > 0 ? static_cast<uint64_t>(seconds * 1e9) : 0; }
}  // namespace

void ModelMetrics::RequestDone(absl::StatusCode code, double total_seconds) {
  int index = static_cast<int>(code);
  if (index < 0 || index >= kNumCodes) index = static_cast<int>(absl::StatusCode::kUnknown);
  requests_[index]->Increment();
  request_duration_->Observe(total_seconds);
  const bool ok = code == absl::StatusCode::kOk;
  (ok ? success_count_ : fail_count_).fetch_add(1, std::memory_order_relaxed);
  (ok ? success_ns_ : fail_ns_).fetch_add(Nanos(total_seconds), std::memory_order_relaxed);
  last_inference_ms_.store(static_cast<uint64_t>(absl::ToUnixMillis(absl::Now())),
                           std::memory_order_relaxed);
}

void ModelMetrics::Queued(double queue_seconds) {
  queue_duration_->Observe(queue_seconds);
  queue_count_.fetch_add(1, std::memory_order_relaxed);
  queue_ns_.fetch_add(Nanos(queue_seconds), std::memory_order_relaxed);
}

void ModelMetrics::BatchDone(int64_t requests, int64_t tokens, double compute_seconds) {
  batch_requests_->Observe(static_cast<double>(requests));
  batch_tokens_->Observe(static_cast<double>(tokens));
  compute_duration_->Observe(compute_seconds);
  tokens_->Increment(static_cast<double>(tokens));
  execution_count_.fetch_add(1, std::memory_order_relaxed);
  inference_count_.fetch_add(static_cast<uint64_t>(requests), std::memory_order_relaxed);
  compute_ns_.fetch_add(Nanos(compute_seconds), std::memory_order_relaxed);
  compute_request_ns_.fetch_add(Nanos(compute_seconds) * static_cast<uint64_t>(requests),
                                std::memory_order_relaxed);
}

ModelStatsSnapshot ModelMetrics::Stats() const {
  ModelStatsSnapshot s;
  s.success_count = success_count_.load(std::memory_order_relaxed);
  s.success_ns = success_ns_.load(std::memory_order_relaxed);
  s.fail_count = fail_count_.load(std::memory_order_relaxed);
  s.fail_ns = fail_ns_.load(std::memory_order_relaxed);
  s.queue_count = queue_count_.load(std::memory_order_relaxed);
  s.queue_ns = queue_ns_.load(std::memory_order_relaxed);
  s.execution_count = execution_count_.load(std::memory_order_relaxed);
  s.compute_ns = compute_ns_.load(std::memory_order_relaxed);
  s.inference_count = inference_count_.load(std::memory_order_relaxed);
  s.compute_request_ns = compute_request_ns_.load(std::memory_order_relaxed);
  s.last_inference_ms = last_inference_ms_.load(std::memory_order_relaxed);
  return s;
}

const ModelMetrics* Metrics::FindModel(const std::string& model) const {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(model);
  return it == models_.end() ? nullptr : it->second.get();
}

absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ReadBasicAuthFile(
    const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read"));
  std::vector<std::pair<std::string, std::string>> users;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    const absl::string_view text = absl::StripAsciiWhitespace(line);
    if (text.empty() || text[0] == '#') continue;
    const size_t colon = text.find(':');
    if (colon == absl::string_view::npos || colon == 0 || colon + 1 == text.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, " line ", number, ": expected 'user:password' with neither empty"));
    }
    users.emplace_back(std::string(text.substr(0, colon)), std::string(text.substr(colon + 1)));
  }
  if (users.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": no 'user:password' line"));
  }
  return users;
}

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Create(const MetricsOptions& options) {
  if (options.threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics threads: must be >= 1, got ", options.threads));
  }
  if (options.request_timeout.count() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics request timeout: must be >= 1 ms, got ", options.request_timeout.count(),
        " ms"));
  }
  std::unique_ptr<Metrics> m(new Metrics);
  m->registry_ = std::make_shared<prometheus::Registry>();
  prometheus::Registry& r = *m->registry_;

  m->requests_ = &prometheus::BuildCounter()
                      .Name("attnserve_requests_total")
                      .Help("Attend requests answered (one count per request, also per stream "
                            "message), by model and final gRPC status code")
                      .Register(r);
  m->request_duration_ = &prometheus::BuildHistogram()
                              .Name("attnserve_request_duration_seconds")
                              .Help("Server-side time of one request, from receipt to its "
                                    "response being handed to gRPC (any status)")
                              .Register(r);
  m->queue_duration_ = &prometheus::BuildHistogram()
                            .Name("attnserve_queue_duration_seconds")
                            .Help("Time one request waited in its model's queue until its "
                                  "batch closed")
                            .Register(r);
  m->compute_duration_ = &prometheus::BuildHistogram()
                              .Name("attnserve_compute_duration_seconds")
                              .Help("Engine time of one executed batch (one count per batch, "
                                    "whatever its size)")
                              .Register(r);
  m->batch_requests_ = &prometheus::BuildHistogram()
                            .Name("attnserve_batch_requests")
                            .Help("Requests in one executed batch (one count per batch)")
                            .Register(r);
  m->batch_tokens_ = &prometheus::BuildHistogram()
                          .Name("attnserve_batch_tokens")
                          .Help("Query tokens (batch x query length, summed over requests) in "
                                "one executed batch (one count per batch)")
                          .Register(r);
  m->queue_depth_ = &prometheus::BuildGauge()
                         .Name("attnserve_queue_depth")
                         .Help("Requests waiting in the model's queue (not yet in a batch)")
                         .Register(r);
  m->queue_capacity_ = &prometheus::BuildGauge()
                            .Name("attnserve_queue_capacity")
                            .Help("Most requests the model's queue holds (max_queue_size); "
                                  "beyond it requests get RESOURCE_EXHAUSTED")
                            .Register(r);
  m->inflight_ = &prometheus::BuildGauge()
                      .Name("attnserve_inflight_requests")
                      .Help("Requests accepted and not yet answered (queued or computing)")
                      .Register(r);
  m->tokens_ = &prometheus::BuildCounter()
                    .Name("attnserve_tokens_total")
                    .Help("Query tokens computed (a request of batch B and query length L "
                          "counts B*L)")
                    .Register(r);
  m->model_ready_ = &prometheus::BuildGauge()
                         .Name("attnserve_model_ready")
                         .Help("1 when the model is loaded and serving, 0 when it failed to "
                               "load; labelled with the backend that serves it")
                         .Register(r);
  m->model_loads_ = &prometheus::BuildCounter()
                         .Name("attnserve_model_loads_total")
                         .Help("Model loads and reloads after startup (model control), by "
                               "result: success (the new version serves) or failure (the "
                               "previous version, if any, still serves)")
                         .Register(r);
  m->model_unloads_ = &prometheus::BuildCounter()
                           .Name("attnserve_model_unloads_total")
                           .Help("Models taken out of service by model control")
                           .Register(r);
  m->unparseable_ = &prometheus::BuildCounter()
                         .Name("attnserve_unparseable_messages_total")
                         .Help("Request messages that were not a valid protobuf encoding of "
                               "their type, answered INVALID_ARGUMENT, by RPC method")
                         .Register(r);
  m->sessions_open_ = &prometheus::BuildGauge()
                           .Name("attnserve_sessions_open")
                           .Help("Attention sessions open (OpenSession, not yet closed, expired "
                                 "or evicted)")
                           .Register(r);
  m->kv_blocks_ = &prometheus::BuildGauge()
                       .Name("attnserve_kv_cache_blocks")
                       .Help("KV-cache blocks of the model's session pool: state=used (held by "
                             "sessions) or free (allocated, on the free list)")
                       .Register(r);
  m->kv_bytes_ = &prometheus::BuildGauge()
                      .Name("attnserve_kv_cache_bytes")
                      .Help("KV-cache bytes of the model's session pool: state=held (in blocks, "
                            "used or free) or capacity (--kv-cache-bytes)")
                      .Register(r);
  m->session_appends_ = &prometheus::BuildCounter()
                             .Name("attnserve_session_appends_total")
                             .Help("Session requests whose K/V rows were appended to the cache "
                                   "(one per successful session request)")
                             .Register(r);
  m->session_evictions_ = &prometheus::BuildCounter()
                               .Name("attnserve_session_evictions_total")
                               .Help("Idle sessions evicted (least recently used first) to make "
                                     "room in a full KV cache")
                               .Register(r);
  m->session_expiries_ = &prometheus::BuildCounter()
                              .Name("attnserve_session_expiries_total")
                              .Help("Sessions closed by the server after their idle TTL")
                              .Register(r);
  m->refill_waits_ = &prometheus::BuildCounter()
                          .Name("attnserve_batch_refill_waits_total")
                          .Help("Refill waits judged (--refill-wait): outcome=\"hit\" when the "
                                "requests a batch answered came back to fill the next, "
                                "\"miss\" when the wait ran out or was cut short")
                          .Register(r);
  std::map<std::string, std::string> build = options.build_labels;
  build["version"] = ATTNSERVE_VERSION;
  prometheus::BuildGauge()
      .Name("attnserve_build_info")
      .Help("Always 1; the labels describe the running build")
      .Register(r)
      .Add(build)
      .Set(1);

  if (options.connections_shed) {
    m->read_on_scrape_ = std::make_shared<ReadOnScrape>(options.connections_shed);
  }

  if (!options.address.empty()) {
    try {
      // civetweb serves one connection per worker thread and by default
      // waits 30 s for a request to arrive in full: two clients that sent
      // half a request blocked every scrape for 29.7 s with 2 threads.
      // request_timeout_ms bounds the whole request read (not each read()),
      // so trickling a byte at a time does not extend it. Keep-alive stays
      // off: an idle scraper connection would hold a worker between scrapes.
      m->exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
          "listening_ports", options.address,
          "num_threads", std::to_string(options.threads),
          "request_timeout_ms", std::to_string(options.request_timeout.count()),
          "enable_keep_alive", "no"});
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("metrics endpoint cannot listen on ",
                                                 options.address, ": ", e.what()));
    }
    if (!options.basic_auth.empty()) {
      m->exposer_->RegisterAuth(
          [users = options.basic_auth](const std::string& user, const std::string& password) {
            bool ok = false;
            for (const auto& [u, p] : users) {
              // Every pair, both fields: no early exit tells which was close.
              ok |= SameSecret(user, u) & SameSecret(password, p);
            }
            return ok;
          },
          "attnserve metrics", "/metrics");
    }
    m->exposer_->RegisterCollectable(m->registry_);
    if (m->read_on_scrape_ != nullptr) m->exposer_->RegisterCollectable(m->read_on_scrape_);
    std::vector<int> ports = m->exposer_->GetListeningPorts();
    m->port_ = ports.empty() ? 0 : ports.front();
    const size_t colon = options.address.rfind(':');
    const std::string host =
        colon == std::string::npos ? options.address : options.address.substr(0, colon);
    m->address_ = absl::StrCat(host, ":", m->port_);
  }
  return m;
}

namespace {

// Opens and closes a TCP connection to host:port ("0.0.0.0" and "::" mean
// this machine). Best effort: errors are ignored.
void PokeListener(const std::string& host, int port) {
  std::string target = host;
  if (!target.empty() && target.front() == '[') target = target.substr(1, target.size() - 2);
  if (target == "0.0.0.0" || target.empty()) target = "127.0.0.1";
  if (target == "::") target = "::1";
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (getaddrinfo(target.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const bool connected = connect(fd, a->ai_addr, a->ai_addrlen) == 0;
    close(fd);
    if (connected) break;
  }
  freeaddrinfo(found);
}

}  // namespace

Metrics::~Metrics() {
  if (exposer_ == nullptr) return;
  // civetweb's listener thread sleeps in poll() for up to 2 s between looks
  // at its stop flag, so a plain stop takes up to 2 s (every server test and
  // every container stop paid it). Stop on another thread and poke the
  // listening socket until it has: an incoming connection ends the poll at
  // once.
  std::atomic<bool> stopped{false};
  std::thread stopper([this, &stopped] {
    exposer_.reset();
    stopped.store(true);
  });
  const size_t colon = address_.rfind(':');
  const std::string host = colon == std::string::npos ? address_ : address_.substr(0, colon);
  while (!stopped.load()) {
    PokeListener(host, port_);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stopper.join();
}

void ModelMetrics::SetSessionCache(int64_t sessions_open, int64_t blocks_used,
                                   int64_t blocks_free, int64_t bytes_held,
                                   int64_t bytes_capacity) {
  sessions_open_->Set(static_cast<double>(sessions_open));
  kv_blocks_used_->Set(static_cast<double>(blocks_used));
  kv_blocks_free_->Set(static_cast<double>(blocks_free));
  kv_bytes_held_->Set(static_cast<double>(bytes_held));
  kv_bytes_capacity_->Set(static_cast<double>(bytes_capacity));
}

void Metrics::SetModelReady(const std::string& model, const std::string& backend, bool ready) {
  model_ready_->Add({{"model", model}, {"backend", backend}}).Set(ready ? 1.0 : 0.0);
}

void Metrics::RemoveModelReady(const std::string& model, const std::string& backend) {
  prometheus::Gauge& g = model_ready_->Add({{"model", model}, {"backend", backend}});
  model_ready_->Remove(&g);
}

void Metrics::ModelLoadFinished(const std::string& model, bool success) {
  model_loads_->Add({{"model", model}, {"result", success ? "success" : "failure"}}).Increment();
}

void Metrics::ModelUnloaded(const std::string& model) {
  model_unloads_->Add({{"model", model}}).Increment();
}

void Metrics::UnparseableMessage(absl::string_view method) {
  // Family::Add finds the existing series under the family's own lock.
  unparseable_->Add({{"method", std::string(method)}}).Increment();
}

ModelMetrics* Metrics::ForModel(const std::string& model) {
  absl::MutexLock lock(&mu_);
  auto it = models_.find(model);
  if (it != models_.end()) return it->second.get();
  std::unique_ptr<ModelMetrics> mm(new ModelMetrics);
  const prometheus::Labels labels{{"model", model}};
  for (int c = 0; c < ModelMetrics::kNumCodes; ++c) {
    mm->requests_[c] =
        &requests_->Add({{"model", model},
                         {"code", StatusCodeLabel(static_cast<absl::StatusCode>(c))}});
  }
  mm->request_duration_ = &request_duration_->Add(labels, SecondsBuckets());
  mm->queue_duration_ = &queue_duration_->Add(labels, SecondsBuckets());
  mm->compute_duration_ = &compute_duration_->Add(labels, SecondsBuckets());
  mm->batch_requests_ = &batch_requests_->Add(labels, RequestBuckets());
  mm->batch_tokens_ = &batch_tokens_->Add(labels, TokenBuckets());
  mm->queue_depth_ = &queue_depth_->Add(labels);
  mm->queue_capacity_ = &queue_capacity_->Add(labels);
  mm->inflight_ = &inflight_->Add(labels);
  mm->tokens_ = &tokens_->Add(labels);
  mm->sessions_open_ = &sessions_open_->Add(labels);
  mm->kv_blocks_used_ = &kv_blocks_->Add({{"model", model}, {"state", "used"}});
  mm->kv_blocks_free_ = &kv_blocks_->Add({{"model", model}, {"state", "free"}});
  mm->kv_bytes_held_ = &kv_bytes_->Add({{"model", model}, {"state", "held"}});
  mm->kv_bytes_capacity_ = &kv_bytes_->Add({{"model", model}, {"state", "capacity"}});
  mm->session_appends_ = &session_appends_->Add(labels);
  mm->session_evictions_ = &session_evictions_->Add(labels);
  mm->session_expiries_ = &session_expiries_->Add(labels);
  mm->refill_hits_ = &refill_waits_->Add({{"model", model}, {"outcome", "hit"}});
  mm->refill_misses_ = &refill_waits_->Add({{"model", model}, {"outcome", "miss"}});
  ModelMetrics* raw = mm.get();
  models_.emplace(model, std::move(mm));
  return raw;
}

std::string Metrics::Serialize() const {
  std::vector<prometheus::MetricFamily> families = registry_->Collect();
  if (read_on_scrape_ != nullptr) {
    for (prometheus::MetricFamily& f : read_on_scrape_->Collect()) families.push_back(std::move(f));
  }
  return prometheus::TextSerializer().Serialize(families);
}

}  // namespace attnserve

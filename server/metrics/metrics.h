// Prometheus metrics of one attnserve process: the metric families, per-model
// handles that the request path updates, and the /metrics HTTP endpoint.
#ifndef ATTNSERVE_SERVER_METRICS_METRICS_H_
#define ATTNSERVE_SERVER_METRICS_METRICS_H_

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
}  // namespace prometheus

namespace attnserve {

struct MetricsOptions {
  // host:port of the /metrics endpoint; port 0 picks a free port (see
  // Metrics::port()). Empty = no endpoint (metrics still collected, e.g. for
  // tests). Default: 127.0.0.1:9464.
  std::string address = "127.0.0.1:9464";
  // Labels of attnserve_build_info (besides version). Default: none.
  std::map<std::string, std::string> build_labels;
  // HTTP worker threads of the endpoint: each serves one connection at a
  // time, so this many clients that send half a request occupy them all
  // (until request_timeout). Default: 8.
  int threads = 8;
  // How long the endpoint waits for a request to arrive in full, and for a
  // response write to progress, before it closes the connection. Bounds
  // how long a slow or silent client can hold a worker thread.
  // Default: 5 s.
  std::chrono::milliseconds request_timeout{5000};
  // Read at every scrape as attnserve_connections_shed_total: incoming
  // connections closed at once because the process had no free file
  // descriptor (see KeepAcceptingWhenOutOfFds). Thread-safe, cheap.
  // Default: none (the family is absent).
  std::function<int64_t()> connections_shed = nullptr;
  // HTTP basic authentication of /metrics: accepted (user, password) pairs.
  // Set: a scrape without one of them gets 401. Passwords travel in clear
  // unless a TLS side-car or the network protects the port
  // (docs/SECURITY.md). Default: none = open.
  std::vector<std::pair<std::string, std::string>> basic_auth;
};

// The (user, password) pairs of a --metrics-auth-file: one `user:password`
// per line (the password is everything after the first ':'), blank lines and
// '#' comments ignored. InvalidArgument naming the file and line (never the
// password) for a line without ':' or with an empty user or password, or a
// file with no pair; NotFound when it cannot be read.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ReadBasicAuthFile(
    const std::string& path);

// Cumulative totals of one model since the server started, for the KServe v2
// ModelStatistics RPC (Triton's per-model statistics). Durations in ns.
struct ModelStatsSnapshot {
  uint64_t success_count = 0, success_ns = 0;  // answered OK: count, receipt -> answer
  uint64_t fail_count = 0, fail_ns = 0;        // answered with an error
  uint64_t queue_count = 0, queue_ns = 0;      // requests that reached a batch: time queued
  uint64_t execution_count = 0, compute_ns = 0;  // engine calls (batches) and their time
  uint64_t inference_count = 0;                // requests computed (summed batch sizes)
  // Each computed request's share of time: its batch's engine time, summed
  // over requests (as Triton reports compute_infer per request).
  uint64_t compute_request_ns = 0;
  uint64_t last_inference_ms = 0;              // wall time of the last answer, ms since epoch
};

// The metrics of one served model. Every method is thread-safe and cheap
// (atomics, or a short per-histogram lock); none allocates once created.
class ModelMetrics {
 public:
  // One answered request: its final status code (absl and gRPC codes share
  // numbering) and the server-side time from receipt to response.
  void RequestDone(absl::StatusCode code, double total_seconds);
  // A request that reached its batch: time from queued to its batch closing.
  void Queued(double queue_seconds);
  // One executed batch: its size in requests and query tokens, and the time
  // its engine call took.
  void BatchDone(int64_t requests, int64_t tokens, double compute_seconds);
  void SetQueueDepth(int64_t depth) { queue_depth_->Set(static_cast<double>(depth)); }
  // The most requests the model's queue holds (its max_queue_size), so that
  // dashboards and alerts can show depth as a fraction of it.
  void SetQueueCapacity(int64_t capacity) {
    queue_capacity_->Set(static_cast<double>(capacity));
  }
  // Accepted requests not yet answered (queued or computing).
  void InflightAdd(int64_t delta) { inflight_->Increment(static_cast<double>(delta)); }

  // Sessions (server/sessions): the model's KV cache now.
  void SetSessionCache(int64_t sessions_open, int64_t blocks_used, int64_t blocks_free,
                       int64_t bytes_held, int64_t bytes_capacity);
  // One session request's rows appended (a committed request).
  void SessionAppended() { session_appends_->Increment(); }
  // One idle session evicted to make room, or expired past its TTL.
  void SessionEvicted() { session_evictions_->Increment(); }
  void SessionExpired() { session_expiries_->Increment(); }
  // One refill wait judged (BatcherOptions::refill_wait): `hit` when the
  // answered requests came back, a miss when it ran out or was cut short.
  void RefillWait(bool hit) { (hit ? refill_hits_ : refill_misses_)->Increment(); }

  // The totals so far (each field read atomically; fields read one by one).
  ModelStatsSnapshot Stats() const;

 private:
  friend class Metrics;
  ModelMetrics() = default;

  static constexpr int kNumCodes = 17;  // absl::StatusCode 0..16
  std::array<prometheus::Counter*, kNumCodes> requests_{};
  prometheus::Histogram* request_duration_ = nullptr;
  prometheus::Histogram* queue_duration_ = nullptr;
  prometheus::Histogram* compute_duration_ = nullptr;
  prometheus::Histogram* batch_requests_ = nullptr;
  prometheus::Histogram* batch_tokens_ = nullptr;
  prometheus::Gauge* queue_depth_ = nullptr;
  prometheus::Gauge* queue_capacity_ = nullptr;
  prometheus::Gauge* inflight_ = nullptr;
  prometheus::Counter* tokens_ = nullptr;
  prometheus::Gauge* sessions_open_ = nullptr;
  prometheus::Gauge* kv_blocks_used_ = nullptr;
  prometheus::Gauge* kv_blocks_free_ = nullptr;
  prometheus::Gauge* kv_bytes_held_ = nullptr;
  prometheus::Gauge* kv_bytes_capacity_ = nullptr;
  prometheus::Counter* session_appends_ = nullptr;
  prometheus::Counter* session_evictions_ = nullptr;
  prometheus::Counter* session_expiries_ = nullptr;
  prometheus::Counter* refill_hits_ = nullptr;
  prometheus::Counter* refill_misses_ = nullptr;
  // Stats(): the histograms' sums are not readable per status code.
  std::atomic<uint64_t> success_count_{0}, success_ns_{0}, fail_count_{0}, fail_ns_{0};
  std::atomic<uint64_t> queue_count_{0}, queue_ns_{0}, execution_count_{0}, compute_ns_{0};
  std::atomic<uint64_t> inference_count_{0}, compute_request_ns_{0}, last_inference_ms_{0};
};

// Thread-safe. Owns the registry and, when an address is given, the HTTP
// endpoint (prometheus-cpp's Exposer on civetweb). Scrapes run on civetweb
// threads with small (100 KiB) stacks: they only serialize what is here,
// nothing on the request path runs there.
class Metrics {
 public:
  // InvalidArgument when threads < 1 or request_timeout < 1 ms;
  // Unavailable when the endpoint cannot listen on options.address.
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(const MetricsOptions& options);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // The handle for `model`, created on first use; the pointer stays valid
  // for the life of this object. Pass only names of served models: every
  // name becomes a set of time series.
  ModelMetrics* ForModel(const std::string& model);
  // The handle for `model` if it exists, else null (creates nothing).
  const ModelMetrics* FindModel(const std::string& model) const;

  // attnserve_model_ready{model,backend}: 1 when the model is READY, 0 when
  // it failed to load (so a bad model in a non-strict repository shows up in
  // dashboards and alerts, not only in GetModel). `backend` names the engine
  // serving it ("cpu", "cuda", "reference"; empty when it has none).
  void SetModelReady(const std::string& model, const std::string& backend, bool ready);
  // Removes that series: a model taken out of service on purpose (unloaded,
  // or not loaded yet under explicit model control) has none, so that an
  // alert on attnserve_model_ready == 0 sees only models that failed.
  void RemoveModelReady(const std::string& model, const std::string& backend);

  // attnserve_model_loads_total{model,result="success"|"failure"}: loads
  // and reloads by model control (ModelManager), after startup.
  void ModelLoadFinished(const std::string& model, bool success);
  // attnserve_model_unloads_total{model}.
  void ModelUnloaded(const std::string& model);

  // attnserve_unparseable_messages_total{method}: one request message (of
  // any attnserve.v1 RPC: "Attend", "GetModel", ...) that was not
  // a valid protobuf encoding of its type and was answered INVALID_ARGUMENT.
  // Attend's and AttendStream's are also in attnserve_requests_total under
  // model="(unknown)". Pass only the service's method names (each name is a
  // time series).
  void UnparseableMessage(absl::string_view method);

  // The endpoint's port (the one picked when options.address had port 0);
  // 0 when there is no endpoint.
  int port() const { return port_; }
  // host:port actually bound, e.g. "127.0.0.1:40123"; empty without endpoint.
  const std::string& address() const { return address_; }
  // The text exposition of every metric (what /metrics serves).
  std::string Serialize() const;

 private:
  Metrics() = default;

  std::shared_ptr<prometheus::Registry> registry_;
  // Families read from elsewhere at scrape time (connections_shed).
  std::shared_ptr<prometheus::Collectable> read_on_scrape_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
  std::string address_;

  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Family<prometheus::Histogram>* request_duration_ = nullptr;
  prometheus::Family<prometheus::Histogram>* queue_duration_ = nullptr;
  prometheus::Family<prometheus::Histogram>* compute_duration_ = nullptr;
  prometheus::Family<prometheus::Histogram>* batch_requests_ = nullptr;
  prometheus::Family<prometheus::Histogram>* batch_tokens_ = nullptr;
  prometheus::Family<prometheus::Gauge>* queue_depth_ = nullptr;
  prometheus::Family<prometheus::Gauge>* queue_capacity_ = nullptr;
  prometheus::Family<prometheus::Gauge>* inflight_ = nullptr;
  prometheus::Family<prometheus::Counter>* tokens_ = nullptr;
  prometheus::Family<prometheus::Gauge>* model_ready_ = nullptr;
  prometheus::Family<prometheus::Counter>* model_loads_ = nullptr;
  prometheus::Family<prometheus::Counter>* model_unloads_ = nullptr;
  prometheus::Family<prometheus::Counter>* unparseable_ = nullptr;
  prometheus::Family<prometheus::Gauge>* sessions_open_ = nullptr;
  prometheus::Family<prometheus::Gauge>* kv_blocks_ = nullptr;
  prometheus::Family<prometheus::Gauge>* kv_bytes_ = nullptr;
  prometheus::Family<prometheus::Counter>* session_appends_ = nullptr;
  prometheus::Family<prometheus::Counter>* session_evictions_ = nullptr;
  prometheus::Family<prometheus::Counter>* session_expiries_ = nullptr;
  prometheus::Family<prometheus::Counter>* refill_waits_ = nullptr;

  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<ModelMetrics>> models_ ABSL_GUARDED_BY(mu_);
};

// "OK", "INVALID_ARGUMENT", ...: the gRPC spelling used in the code label.
const char* StatusCodeLabel(absl::StatusCode code);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_METRICS_METRICS_H_

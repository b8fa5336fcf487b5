// attn_bench: load generator for attnserve (and for anything serving the same
// Attend RPC, e.g. bench/echo_server). Closed loop (--concurrency) or open loop
// (--rate), unary or --stream, over one or many channels; reports throughput,
// latency percentiles and errors by status code, as text or --json. --session:
// token-by-token decode through server-side sessions (--concurrency sessions,
// each prefilled with --context tokens, then --decode-steps one-token steps).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <malloc.h>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "client/client_security.h"
#include "client/request_builder.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address, host:port.");

// The metadata that carries a session's id on each of its calls (what a load
// balancer hashes on; docs/OPERATIONS.md).
constexpr char kSessionHeader[] = "x-attnserve-session";
ABSL_FLAG(std::string, model, "", "Model name. Default: the server's default model.");
ABSL_FLAG(std::string, layout, "auto",
          "Input layout: sdpa ([B,H,L,D] query/key/value), mha ([B,L,query_dim], "
          "self-attention), or auto (ask the server with GetModel).");
ABSL_FLAG(int64_t, embed_dim, 512, "mha layout without GetModel: query_dim.");
ABSL_FLAG(int64_t, batch, 1, "Batch size B of each request.");
ABSL_FLAG(int64_t, seq, 16, "Query length Lq.");
ABSL_FLAG(int64_t, kv_seq, 0, "Key/value length Lk. Default 0: --seq (sdpa); self-attention (mha).");
ABSL_FLAG(int64_t, heads, 8, "sdpa: query heads Hq.");
ABSL_FLAG(int64_t, kv_heads, 0, "sdpa: key/value heads. Default 0: --heads.");
ABSL_FLAG(int64_t, head_dim, 64, "sdpa: head dim of query, key and value.");
ABSL_FLAG(std::string, dtype, "fp32", "Input dtype: fp32, fp16 or bf16.");
ABSL_FLAG(bool, causal, false, "Causal mask.");
ABSL_FLAG(int64_t, window, 0, "sdpa: sliding window of every request. 0: none.");
ABSL_FLAG(double, softcap, 0, "sdpa: logit softcapping of every request. 0: none.");
ABSL_FLAG(int, concurrency, 1, "Closed loop: requests kept in flight.");
ABSL_FLAG(double, rate, 0, "Open loop: requests per second (evenly spaced). 0 = closed loop.");
ABSL_FLAG(int64_t, max_outstanding, 10000,
          "Open loop: most requests in flight; a send beyond it is counted as "
          "CLIENT_OVERLOADED instead of being made.");
ABSL_FLAG(double, duration, 0, "Seconds to send for (default 0: use --requests).");
ABSL_FLAG(int64_t, requests, 0, "Requests to send in total (default 0: use --duration; "
                                "neither: 1000).");
ABSL_FLAG(int64_t, warmup_requests, 0,
          "Requests sent (closed loop, same concurrency) before measuring; not reported.");
ABSL_FLAG(bool, stream, false, "Use AttendStream: one stream per channel, messages matched by id.");
ABSL_FLAG(int, channels, 1, "gRPC channels (separate TCP connections); load is spread round-robin.");
ABSL_FLAG(std::string, lb_policy, "",
          "gRPC load-balancing policy of each channel: round_robin spreads RPCs over every "
          "address the target resolves to (dns:///headless-service:50051, or "
          "ipv4:127.0.0.1:50061,127.0.0.1:50062); pick_first uses one. Default: gRPC's "
          "(pick_first).");
ABSL_FLAG(std::string, compression, "none",
          "Compress every request: none, gzip or deflate (gRPC's message compression; the "
          "server's answers follow its --grpc-response-compression-level).");
ABSL_FLAG(std::string, health_check_service, "",
          "Client-side health checking: the grpc.health.v1 service name each address is "
          "watched for (attnserve.v1.AttentionService); an address that reports NOT_SERVING, "
          "e.g. a replica shutting down, gets no new RPCs. Needs --lb-policy=round_robin. "
          "Default: none.");
ABSL_FLAG(int64_t, timeout_ms, 30000, "Deadline of each unary RPC, and of each stream as a whole.");
ABSL_FLAG(bool, json, false, "Print one JSON object instead of text.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the random inputs.");
ABSL_FLAG(bool, session, false,
          "Session decode mode: --concurrency sessions (OpenSession), each prefilled with "
          "--context tokens in one request, then --decode-steps requests of one token each "
          "(query, key and value rows of that token only), run concurrently; reports decode "
          "steps/s and bytes on the wire per step. The stateless peer is the default mode "
          "with --seq=1 --kv-seq=CONTEXT --causal (K/V re-sent every step).");
ABSL_FLAG(int64_t, context, 4096, "--session: tokens prefilled into each session.");
ABSL_FLAG(int64_t, decode_steps, 32, "--session: one-token decode steps per session.");

namespace attnserve::bench {
namespace {

namespace pb = ::attnserve::v1;
using Clock = std::chrono::steady_clock;

constexpr int kMaxMessageBytes = 1 << 30;

// gRPC and Abseil number their status codes alike; a stream response carries
// its code as a plain int, which may be out of range.
std::string CodeName(int code) {
  const std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? "UNKNOWN" : name;
}

// The q-quantile (nearest rank) of `sorted`; 0 when empty.
double Percentile(const std::vector<int64_t>& sorted, double q) {
  if (sorted.empty()) return 0;
  const size_t i = static_cast<size_t>(std::ceil(q * static_cast<double>(sorted.size())));
  return static_cast<double>(sorted[std::clamp<size_t>(i, 1, sorted.size()) - 1]);
}

// Everything measured, shared by all callbacks.
class Stats {
 public:
  void Record(int code, Clock::duration latency, const pb::Timing* timing) {
    absl::MutexLock lock(&mu_);
    ++codes_[code];
    if (code != 0) return;
    latencies_ns_.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(latency).count());
    if (timing != nullptr) {
      batch_requests_sum_ += timing->batch_requests();
      batch_requests_max_ = std::max<int64_t>(batch_requests_max_, timing->batch_requests());
      queue_us_sum_ += timing->queue_us();
      compute_us_sum_ += timing->compute_us();
      server_total_us_sum_ += timing->total_us();
      queue_us_.push_back(timing->queue_us());
      server_total_us_.push_back(timing->total_us());
    }
  }
  void RecordNamed(const std::string& name) {
    absl::MutexLock lock(&mu_);
    ++named_errors_[name];
  }

  nlohmann::json Summary(double seconds) {
    absl::MutexLock lock(&mu_);
    std::vector<int64_t> lat = latencies_ns_;
    std::sort(lat.begin(), lat.end());
    auto pct = [&](double q) { return Percentile(lat, q) / 1e3; };
    int64_t total = 0, ok = 0;
    nlohmann::json errors = nlohmann::json::object();
    for (const auto& [code, n] : codes_) {
      total += n;
      if (code == 0) ok = n; else errors[CodeName(code)] = n;
    }
    for (const auto& [name, n] : named_errors_) errors[name] = n;
    double mean = 0;
    for (int64_t v : lat) mean += static_cast<double>(v);
    mean = lat.empty() ? 0 : mean / static_cast<double>(lat.size()) / 1e3;
    const double okd = std::max<double>(1.0, static_cast<double>(ok));
    // Percentiles of what the server reported per request (its queue wait,
    // and its whole time from receipt to answer), to tell the server's share
    // of a latency percentile from the transport's and the client's.
    auto server_pct = [](std::vector<int64_t> v, double q) {
      std::sort(v.begin(), v.end());
      return Percentile(v, q);
    };
    return {
        {"requests", total},
        {"ok", ok},
        {"errors", errors},
        {"seconds", seconds},
        {"throughput_rps", seconds > 0 ? static_cast<double>(total) / seconds : 0.0},
        {"ok_throughput_rps", seconds > 0 ? static_cast<double>(ok) / seconds : 0.0},
        {"latency_us",
         {{"p50", pct(0.50)}, {"p90", pct(0.90)}, {"p99", pct(0.99)}, {"p999", pct(0.999)},
          {"mean", mean}, {"max", lat.empty() ? 0.0 : static_cast<double>(lat.back()) / 1e3}}},
        {"server_timing",
         {{"batch_requests_mean", static_cast<double>(batch_requests_sum_) / okd},
          {"batch_requests_max", batch_requests_max_},
          {"queue_us_mean", static_cast<double>(queue_us_sum_) / okd},
          {"compute_us_mean", static_cast<double>(compute_us_sum_) / okd},
          {"total_us_mean", static_cast<double>(server_total_us_sum_) / okd},
          {"queue_us_p99", server_pct(queue_us_, 0.99)},
          {"total_us_p99", server_pct(server_total_us_, 0.99)}}},
    };
  }

 private:
  absl::Mutex mu_;
  std::vector<int64_t> latencies_ns_ ABSL_GUARDED_BY(mu_);  // OK requests only
  std::map<int, int64_t> codes_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, int64_t> named_errors_ ABSL_GUARDED_BY(mu_);
  int64_t batch_requests_sum_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t batch_requests_max_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t queue_us_sum_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t compute_us_sum_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t server_total_us_sum_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int64_t> queue_us_ ABSL_GUARDED_BY(mu_);         // per OK request with timing
  std::vector<int64_t> server_total_us_ ABSL_GUARDED_BY(mu_);  // per OK request with timing
};

// Decides whether another request may start: by count, or by end time.
class Budget {
 public:
  Budget(int64_t requests, Clock::time_point end) : requests_(requests), end_(end) {}
  bool Take() {
    if (requests_ > 0) return issued_.fetch_add(1) < requests_;
    return Clock::now() < end_;
  }

 private:
  const int64_t requests_;  // 0 = by time
  const Clock::time_point end_;
  std::atomic<int64_t> issued_{0};
};

// One in-flight unary RPC.
struct UnaryCall {
  grpc::ClientContext context;
  pb::AttendResponse response;
  Clock::time_point start;
};

void StartUnary(pb::AttentionService::Stub* stub, const pb::AttendRequest* request,
                Clock::time_point start, Stats* stats, std::function<void()> then) {
  auto* call = new UnaryCall;
  call->start = start;
  call->context.set_deadline(std::chrono::system_clock::now() +
                             std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms)));
  client::AddAuthorization(&call->context);
  stub->async()->Attend(&call->context, request, &call->response,
                        [call, stats, then = std::move(then)](grpc::Status status) {
                          const auto latency = Clock::now() - call->start;
                          stats->Record(status.error_code(), latency,
                                        status.ok() ? &call->response.timing() : nullptr);
                          delete call;
                          then();
                        });
}

// One AttendStream. Writes are queued (gRPC allows one outstanding write per
// stream); responses are matched to their request by id. The hold keeps the
// stream open while requests are still to come from outside its reactions.
class StreamClient : public grpc::ClientBidiReactor<pb::AttendRequest, pb::AttendStreamResponse> {
 public:
  // on_response(slot) runs on a gRPC thread after each response.
  StreamClient(pb::AttentionService::Stub* stub, Stats* stats,
               std::function<void(int slot)> on_response)
      : stats_(stats), on_response_(std::move(on_response)) {
    context_.set_deadline(std::chrono::system_clock::now() +
                          std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms)));
    client::AddAuthorization(&context_);
    stub->async()->AttendStream(&context_, this);
    AddHold();
    StartRead(&response_);
    StartCall();
  }

  // Sends a copy of `base` with a fresh id; latency counts from `start`.
  void Send(const pb::AttendRequest& base, int slot, Clock::time_point start) {
    auto req = std::make_unique<pb::AttendRequest>(base);
    absl::MutexLock lock(&mu_);
    if (done_) {
      stats_->Record(grpc::UNAVAILABLE, Clock::duration{}, nullptr);
      return;
    }
    req->set_id(absl::StrCat(next_id_++));
    pending_[req->id()] = {slot, start};
    queue_.push_back(std::move(req));
    if (!writing_) WriteNextLocked();
  }

  // No more Sends: half-close once the queued writes are out.
  void Finish() {
    absl::MutexLock lock(&mu_);
    closing_ = true;
    if (!writing_) CloseLocked();
  }

  void Wait() { finished_.WaitForNotification(); }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    queue_.pop_front();
    writing_ = false;
    if (ok && !queue_.empty()) {
      WriteNextLocked();
    } else if (closing_) {
      CloseLocked();
    }
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // stream over; OnDone follows
    int slot = -1;
    {
      absl::MutexLock lock(&mu_);
      auto it = pending_.find(response_.id());
      if (it != pending_.end()) {
        slot = it->second.slot;
        stats_->Record(response_.code(), Clock::now() - it->second.start,
                       response_.code() == 0 ? &response_.response().timing() : nullptr);
        pending_.erase(it);
      } else {
        stats_->RecordNamed("UNMATCHED_ID");
      }
    }
    StartRead(&response_);  // before on_response_: that may Send on this stream
    if (slot >= 0) on_response_(slot);
  }

  void OnDone(const grpc::Status& status) override {
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      // Requests that never got a response end with the stream's status.
      for (const auto& [id, p] : pending_) {
        stats_->Record(status.ok() ? grpc::INTERNAL : status.error_code(), Clock::now() - p.start,
                       nullptr);
      }
      pending_.clear();
      if (!status.ok()) stream_status_ = status;
    }
    finished_.Notify();
  }

 private:
  struct Pending {
    int slot;
    Clock::time_point start;
  };
  void WriteNextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    writing_ = true;
    StartWrite(queue_.front().get());
  }
  void CloseLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closed_) return;
    closed_ = true;
    StartWritesDone();
    RemoveHold();
  }

  grpc::ClientContext context_;
  pb::AttendStreamResponse response_;
  Stats* const stats_;
  const std::function<void(int)> on_response_;
  absl::Notification finished_;
  absl::Mutex mu_;
  std::deque<std::unique_ptr<pb::AttendRequest>> queue_ ABSL_GUARDED_BY(mu_);  // front = writing
  absl::flat_hash_map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status stream_status_ ABSL_GUARDED_BY(mu_);
};

// The request every RPC sends, shaped for the model.
// seq / kv_seq >= 0 override --seq / --kv-seq (session prefill and decode).
absl::StatusOr<pb::AttendRequest> BuildBenchRequest(pb::AttentionService::Stub& stub,
                                                    int64_t seq = -1, int64_t kv_seq = -1) {
  absl::StatusOr<client::RequestSpec> spec = client::RequestSpecFromFlags();
  if (!spec.ok()) return spec.status();
  if (seq >= 0) spec->seq = seq;
  if (kv_seq >= 0) spec->kv_seq = kv_seq;
  const std::string layout_flag = absl::GetFlag(FLAGS_layout);
  client::InputLayout layout;
  if (layout_flag == "auto") {
    pb::GetModelRequest req;
    req.set_name(spec->model);
    pb::ModelStatus model;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    client::AddAuthorization(&ctx);
    grpc::Status s = stub.GetModel(&ctx, req, &model);
    if (!s.ok()) {
      return absl::UnavailableError(absl::StrCat("GetModel failed (", CodeName(s.error_code()),
                                                 ": ", s.error_message(),
                                                 "); pass --layout=sdpa|mha"));
    }
    absl::StatusOr<client::InputLayout> of_model = client::InputLayoutOf(model.config());
    if (!of_model.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat(of_model.status().message(), "; pass --layout=sdpa|mha"));
    }
    layout = *of_model;
  } else if (layout_flag == "sdpa") {
    layout.kind = client::InputLayout::Kind::kSdpa;
  } else if (layout_flag == "mha") {
    const int64_t d = absl::GetFlag(FLAGS_embed_dim);
    layout = {client::InputLayout::Kind::kMha, d, d, d};
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--layout must be auto, sdpa or mha, got ", layout_flag));
  }
  absl::StatusOr<pb::AttendRequest> request = client::BuildRequest(*spec, layout);
  if (request.ok()) {
    request->set_window(absl::GetFlag(FLAGS_window));
    request->set_softcap(static_cast<float>(absl::GetFlag(FLAGS_softcap)));
  }
  return request;
}

// Runs one phase (warm-up or measured) and returns its wall time in seconds.
double RunPhase(const std::vector<std::unique_ptr<pb::AttentionService::Stub>>& stubs,
                const pb::AttendRequest& request, Stats* stats, int64_t requests,
                double duration_s, double rate, int concurrency, bool stream) {
  const Clock::time_point start = Clock::now();
  const Clock::time_point end =
      start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(duration_s));
  Budget budget(requests, end);
  const int n_channels = static_cast<int>(stubs.size());

  // In-flight accounting: the phase ends when nothing is in flight and no
  // more may start.
  absl::Mutex mu;
  int64_t in_flight = 0;
  auto begin_one = [&] { absl::MutexLock l(&mu); ++in_flight; };
  auto end_one = [&] { absl::MutexLock l(&mu); --in_flight; };

  std::vector<std::unique_ptr<StreamClient>> streams;
  std::function<void(int)> next;  // closed loop: slot finished one request
  if (rate <= 0) {
    next = [&](int slot) {
      if (budget.Take()) {
        begin_one();
        const Clock::time_point now = Clock::now();
        if (stream) {
          streams[slot % n_channels]->Send(request, slot, now);
        } else {
          // next before end_one: in_flight must not touch 0 while another
          // request is about to start.
          StartUnary(stubs[slot % n_channels].get(), &request, now, stats, [&, slot] {
            next(slot);
            end_one();
          });
        }
      }
    };
  }
  if (stream) {
    for (int c = 0; c < n_channels; ++c) {
      streams.push_back(std::make_unique<StreamClient>(stubs[c].get(), stats, [&](int slot) {
        if (next) next(slot);
        end_one();
      }));
    }
  }

  if (rate <= 0) {
    for (int slot = 0; slot < concurrency; ++slot) next(slot);
  } else {
    // Open loop: evenly spaced sends; latency counts from the scheduled send
    // time, so a stalled client does not hide server queueing.
    const auto interval = std::chrono::duration<double>(1.0 / rate);
    const int64_t max_out = absl::GetFlag(FLAGS_max_outstanding);
    for (int64_t i = 0;; ++i) {
      const Clock::time_point due =
          start + std::chrono::duration_cast<Clock::duration>(interval * static_cast<double>(i));
      if (!budget.Take()) break;
      std::this_thread::sleep_until(due);
      bool overloaded;
      {
        absl::MutexLock l(&mu);
        overloaded = in_flight >= max_out;
        if (!overloaded) ++in_flight;
      }
      if (overloaded) {
        stats->RecordNamed("CLIENT_OVERLOADED");
        continue;
      }
      const int ch = static_cast<int>(i % n_channels);
      if (stream) {
        streams[ch]->Send(request, ch, due);
      } else {
        StartUnary(stubs[ch].get(), &request, due, stats, end_one);
      }
    }
  }
  {
    absl::MutexLock l(&mu);
    mu.Await(absl::Condition(
        +[](int64_t* n) { return *n == 0; }, &in_flight));
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  for (auto& s : streams) s->Finish();
  for (auto& s : streams) s->Wait();
  return seconds;
}

// --session: decode through server-side sessions. One thread per session,
// blocking unary calls; sessions spread round-robin over the channels.
int RunSessions(const std::vector<std::unique_ptr<pb::AttentionService::Stub>>& stubs,
                int sessions) {
  const int64_t context = absl::GetFlag(FLAGS_context);
  const int64_t steps = absl::GetFlag(FLAGS_decode_steps);
  if (context < 1 || steps < 1) {
    std::fprintf(stderr, "attn_bench: --context and --decode-steps must be >= 1\n");
    return 1;
  }
  // Each step carries its token's query, key and value rows (projection
  // models: hidden states, projected on the server).
  absl::StatusOr<pb::AttendRequest> prefill = BuildBenchRequest(*stubs[0], context, context);
  absl::StatusOr<pb::AttendRequest> decode = BuildBenchRequest(*stubs[0], 1, 1);
  if (!prefill.ok() || !decode.ok()) {
    const absl::Status& s = !prefill.ok() ? prefill.status() : decode.status();
    std::fprintf(stderr, "attn_bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  const auto deadline = [] {
    return std::chrono::system_clock::now() +
           std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  };
  // Each session's id is chosen here (random) and sent as
  // x-attnserve-session metadata on every call of it, OpenSession included:
  // a balancer hashing on it keeps the session on one replica.
  std::vector<std::string> ids(sessions);
  std::random_device random;
  for (int i = 0; i < sessions; ++i) {
    ids[i] = absl::StrFormat("b%08x%08x%08x%08x", random(), random(), random(), random());
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline());
    ctx.AddMetadata(kSessionHeader, ids[i]);
    pb::OpenSessionRequest req;
    req.set_model(absl::GetFlag(FLAGS_model));
    req.set_max_tokens(context + steps);
    req.set_session_id(ids[i]);
    pb::OpenSessionResponse resp;
    grpc::Status s = stubs[i % stubs.size()]->OpenSession(&ctx, req, &resp);
    if (!s.ok()) {
      std::fprintf(stderr, "attn_bench: OpenSession: %s: %s\n", CodeName(s.error_code()).c_str(),
                   s.error_message().c_str());
      return 1;
    }
  }
  // Runs `n` requests like `base` on every session concurrently; returns the
  // wall time. Response bytes are summed into *response_bytes.
  std::atomic<int64_t> failures{0}, response_bytes{0};
  auto run = [&](const pb::AttendRequest& base, int64_t n, Stats* stats) {
    const Clock::time_point start = Clock::now();
    std::vector<std::thread> threads;
    for (int i = 0; i < sessions; ++i) {
      threads.emplace_back([&, i] {
        pb::AttendRequest req = base;
        req.set_session_id(ids[i]);
        for (int64_t k = 0; k < n; ++k) {
          grpc::ClientContext ctx;
          ctx.set_deadline(deadline());
          ctx.AddMetadata(kSessionHeader, ids[i]);
          pb::AttendResponse resp;
          const Clock::time_point t0 = Clock::now();
          grpc::Status s = stubs[i % stubs.size()]->Attend(&ctx, req, &resp);
          stats->Record(s.error_code(), Clock::now() - t0, s.ok() ? &resp.timing() : nullptr);
          if (!s.ok()) {
            if (failures.fetch_add(1) == 0) {
              std::fprintf(stderr, "attn_bench: Attend: %s: %s\n",
                           CodeName(s.error_code()).c_str(), s.error_message().c_str());
            }
            return;
          }
          response_bytes += static_cast<int64_t>(resp.ByteSizeLong());
        }
      });
    }
    for (std::thread& t : threads) t.join();
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  Stats prefill_stats, decode_stats;
  const double prefill_s = run(*prefill, 1, &prefill_stats);
  response_bytes = 0;
  const double decode_s = run(*decode, steps, &decode_stats);
  for (int i = 0; i < sessions; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline());
    ctx.AddMetadata(kSessionHeader, ids[i]);
    pb::CloseSessionRequest req;
    req.set_session_id(ids[i]);
    pb::CloseSessionResponse resp;
    stubs[i % stubs.size()]->CloseSession(&ctx, req, &resp);
  }
  nlohmann::json out = decode_stats.Summary(decode_s);
  const int64_t total_steps = sessions * steps;
  out["mode"] = "session";
  out["sessions"] = sessions;
  out["context"] = context;
  out["decode_steps"] = steps;
  out["prefill_seconds"] = prefill_s;
  out["prefill_request_bytes"] = prefill->ByteSizeLong();
  out["decode_steps_per_s"] = static_cast<double>(total_steps) / decode_s;
  out["request_bytes_per_step"] = decode->ByteSizeLong();
  out["response_bytes_per_step"] =
      static_cast<double>(response_bytes.load()) / static_cast<double>(total_steps);
  out["failures"] = failures.load();
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("attn_bench: session decode, %d sessions, context %lld, %lld steps each\n",
                sessions, static_cast<long long>(context), static_cast<long long>(steps));
    std::printf("prefill: %.3f s (request %zu bytes per session)\n", prefill_s,
                prefill->ByteSizeLong());
    std::printf("decode: %lld steps in %.3f s: %.1f steps/s; per step: request %zu bytes, "
                "response %.0f bytes\n",
                static_cast<long long>(total_steps), decode_s,
                out["decode_steps_per_s"].get<double>(), decode->ByteSizeLong(),
                out["response_bytes_per_step"].get<double>());
    const auto& l = out["latency_us"];
    std::printf("latency us: p50 %.1f  p99 %.1f  mean %.1f\n", l["p50"].get<double>(),
                l["p99"].get<double>(), l["mean"].get<double>());
    const auto& t = out["server_timing"];
    std::printf("server: batch_requests mean %.2f, compute_us mean %.1f\n",
                t["batch_requests_mean"].get<double>(), t["compute_us_mean"].get<double>());
  }
  return failures.load() == 0 ? 0 : 1;
}

int Main(int argc, char** argv) {
  // As in the server (server/main.cc): Debian's abseil leaves absl::Mutex's
  // deadlock detection on, and gRPC's mutexes then update its global
  // lock-order graph on every call (GraphCycles: 2% of this client's CPU
  // under perf at concurrency 32). A load generator that shares the cores
  // with the server should not spend them there.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Each call serializes a request and parses an answer of up to megabytes.
  // With glibc's defaults those blocks are mapped fresh (or trimmed back to
  // the kernel) every call, and the page faults of touching them again took
  // a fifth of this client's CPU at 3 MiB (perf): CPU the server under test
  // shares. Keep freed blocks for the next call instead.
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  absl::SetProgramUsageMessage(
      "attn_bench --target=HOST:PORT [--model=M] [--concurrency=N | --rate=R] "
      "[--duration=S | --requests=N] [--stream] [--channels=N] [--lb-policy=round_robin] "
      "[--compression=none|gzip|deflate] "
      "[--json]\n"
      "Flags may be spelled with dashes or underscores.");
  const std::vector<std::string> rest = client::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "attn_bench: unexpected argument '%s'\n", rest[1].c_str());
    return 1;
  }
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  const int n_channels = absl::GetFlag(FLAGS_channels);
  const double rate = absl::GetFlag(FLAGS_rate);
  double duration = absl::GetFlag(FLAGS_duration);
  int64_t requests = absl::GetFlag(FLAGS_requests);
  if (duration <= 0 && requests <= 0) requests = 1000;
  if (concurrency < 1 || n_channels < 1) {
    std::fprintf(stderr, "attn_bench: --concurrency and --channels must be >= 1\n");
    return 1;
  }
  // gRPC falls back to pick_first on a name it does not know, silently here.
  if (const std::string lb = absl::GetFlag(FLAGS_lb_policy);
      !lb.empty() && lb != "pick_first" && lb != "round_robin") {
    std::fprintf(stderr, "attn_bench: --lb-policy must be pick_first or round_robin, got '%s'\n",
                 lb.c_str());
    return 1;
  }
  if (!absl::GetFlag(FLAGS_health_check_service).empty() &&
      absl::GetFlag(FLAGS_lb_policy) != "round_robin") {
    std::fprintf(stderr, "attn_bench: --health-check-service needs --lb-policy=round_robin\n");
    return 1;
  }

  const std::string compression = absl::GetFlag(FLAGS_compression);
  grpc_compression_algorithm algorithm = GRPC_COMPRESS_NONE;
  if (compression == "gzip") {
    algorithm = GRPC_COMPRESS_GZIP;
  } else if (compression == "deflate") {
    algorithm = GRPC_COMPRESS_DEFLATE;
  } else if (compression != "none") {
    std::fprintf(stderr, "attn_bench: --compression must be none, gzip or deflate, got '%s'\n",
                 compression.c_str());
    return 1;
  }

  if (absl::Status s = client::LoadTokenFromFlags(); !s.ok()) {
    std::fprintf(stderr, "attn_bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::vector<std::unique_ptr<pb::AttentionService::Stub>> stubs;
  for (int c = 0; c < n_channels; ++c) {
    grpc::ChannelArguments args;
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> credentials =
        client::ChannelCredentialsFromFlags(&args);
    if (!credentials.ok()) {
      std::fprintf(stderr, "attn_bench: %s\n", std::string(credentials.status().message()).c_str());
      return 1;
    }
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    args.SetMaxSendMessageSize(kMaxMessageBytes);
    // Distinct args and a local pool: each channel gets its own connection.
    args.SetInt("attn_bench.channel", c);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    if (algorithm != GRPC_COMPRESS_NONE) args.SetCompressionAlgorithm(algorithm);
    if (const std::string lb = absl::GetFlag(FLAGS_lb_policy); !lb.empty()) {
      args.SetLoadBalancingPolicyName(lb);
    }
    if (const std::string health = absl::GetFlag(FLAGS_health_check_service); !health.empty()) {
      args.SetServiceConfigJSON(nlohmann::json{{"healthCheckConfig", {{"serviceName", health}}}}.dump());
    }
    stubs.push_back(pb::AttentionService::NewStub(grpc::CreateCustomChannel(
        absl::GetFlag(FLAGS_target), *credentials, args)));
  }
  if (absl::GetFlag(FLAGS_session)) return RunSessions(stubs, concurrency);
  absl::StatusOr<pb::AttendRequest> request = BuildBenchRequest(*stubs[0]);
  if (!request.ok()) {
    std::fprintf(stderr, "attn_bench: %s\n", std::string(request.status().message()).c_str());
    return 1;
  }
  const bool stream = absl::GetFlag(FLAGS_stream);

  if (const int64_t w = absl::GetFlag(FLAGS_warmup_requests); w > 0) {
    Stats warm;
    RunPhase(stubs, *request, &warm, w, 0, 0, concurrency, stream);
  }
  Stats stats;
  const double seconds =
      RunPhase(stubs, *request, &stats, requests, duration, rate, concurrency, stream);

  nlohmann::json out = stats.Summary(seconds);
  out["mode"] = rate > 0 ? "open" : "closed";
  out["rpc"] = stream ? "stream" : "unary";
  out["concurrency"] = rate > 0 ? 0 : concurrency;
  out["rate"] = rate;
  out["channels"] = n_channels;
  out["target"] = absl::GetFlag(FLAGS_target);
  out["model"] = absl::GetFlag(FLAGS_model);
  out["request_bytes"] = request->ByteSizeLong();
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", out.dump().c_str());
    return 0;
  }
  std::printf("attn_bench: %s %s loop, %s, %d channel(s), request %zu bytes\n",
              out["rpc"].get<std::string>().c_str(), out["mode"].get<std::string>().c_str(),
              rate > 0 ? absl::StrCat(rate, " req/s").c_str()
                       : absl::StrCat("concurrency ", concurrency).c_str(),
              n_channels, request->ByteSizeLong());
  std::printf("requests %lld (ok %lld) in %.3f s: %.1f req/s\n",
              static_cast<long long>(out["requests"].get<int64_t>()),
              static_cast<long long>(out["ok"].get<int64_t>()), seconds,
              out["throughput_rps"].get<double>());
  const auto& l = out["latency_us"];
  std::printf("latency us: p50 %.1f  p90 %.1f  p99 %.1f  p99.9 %.1f  mean %.1f  max %.1f\n",
              l["p50"].get<double>(), l["p90"].get<double>(), l["p99"].get<double>(),
              l["p999"].get<double>(), l["mean"].get<double>(), l["max"].get<double>());
  const auto& t = out["server_timing"];
  std::printf("server: batch_requests mean %.2f max %lld, queue_us mean %.1f p99 %.0f, "
              "compute_us mean %.1f, total_us mean %.1f p99 %.0f\n",
              t["batch_requests_mean"].get<double>(),
              static_cast<long long>(t["batch_requests_max"].get<int64_t>()),
              t["queue_us_mean"].get<double>(), t["queue_us_p99"].get<double>(),
              t["compute_us_mean"].get<double>(), t["total_us_mean"].get<double>(),
              t["total_us_p99"].get<double>());
  for (const auto& [name, n] : out["errors"].items()) {
    std::printf("errors %s: %lld\n", name.c_str(), static_cast<long long>(n.get<int64_t>()));
  }
  return 0;
}

}  // namespace
}  // namespace attnserve::bench

int main(int argc, char** argv) { return attnserve::bench::Main(argc, argv); }

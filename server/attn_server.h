// One running attnserve: engine, models, one batching queue per model, the
// metrics endpoint and the gRPC server (AttentionService, health,
// reflection), started and stopped as a unit.
#ifndef ATTNSERVE_SERVER_ATTN_SERVER_H_
#define ATTNSERVE_SERVER_ATTN_SERVER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "engine/host_buffer.h"
#include "grpcpp/server.h"
#include "server/batching/batching_scheduler.h"
#include "server/dispatch/request_dispatcher.h"
#include "server/memory_trim.h"
#include "server/metrics/metrics.h"
#include "server/models/model_manager.h"
#include "server/models/model_registry.h"
#include "server/server_options.h"
#include "server/sessions/session_manager.h"
#include "server/transport/attention_service.h"
#include "server/transport/bearer_tokens.h"
#include "server/transport/kserve_core.h"
#include "server/transport/kserve_http.h"
#include "server/transport/kserve_service.h"

namespace attnserve {

// The gRPC service name that health reports on, besides "" (the server).
inline constexpr char kAttentionServiceName[] = "attnserve.v1.AttentionService";

// Thread-safe: Shutdown may be called from any thread, any number of times.
class AttnServer {
 public:
  // Builds the engine and the built-in models, and starts serving. Errors:
  // InvalidArgument for bad options, NotFound for an unknown default model
  // or backend, Unavailable when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<AttnServer>> Start(const ServerOptions& options);

  // Shutdown().
  ~AttnServer();
  AttnServer(const AttnServer&) = delete;
  AttnServer& operator=(const AttnServer&) = delete;

  // The address actually bound: options.address with port 0 replaced by the
  // port the kernel picked, e.g. "127.0.0.1:40123".
  const std::string& address() const { return address_; }
  int port() const { return port_; }
  // The metrics endpoint actually bound (port 0 resolved), e.g.
  // "127.0.0.1:40124".
  const std::string& metrics_address() const { return metrics_->address(); }
  // The KServe v2 HTTP endpoint actually bound (port 0 resolved); empty
  // when it is off.
  std::string http_address() const { return http_ != nullptr ? http_->address() : ""; }
  // "warmed up N models in T (--model-warmup)"; empty without warm-up.
  const std::string& warmup_summary() const { return warmup_summary_; }
  const Metrics& metrics() const { return *metrics_; }
  const ModelRegistry& registry() const { return registry_; }
  // Model control; null when the server has no model repository.
  ModelManager* models() const { return models_.get(); }
  const SessionManager& sessions() const { return *sessions_; }

  // Health turns NOT_SERVING; new requests (unary and stream messages) get
  // UNAVAILABLE; every accepted request is computed and answered within
  // options.shutdown_grace, those still queued after it get UNAVAILABLE;
  // open streams end once answered. Returns when everything has stopped.
  void Shutdown();

 private:
  explicit AttnServer(const ServerOptions& options);

  const ServerOptions options_;
  ModelRegistry registry_;
  Clock* const clock_;
  // Destroyed in reverse order: the gRPC server goes first, then the
  // service, the dispatcher and scheduler it hands requests to, and the
  // metrics all of them update.
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<BatchingScheduler> scheduler_;
  std::unique_ptr<SessionManager> sessions_;
  // Model control (null without a repository); stopped before the
  // scheduler and sessions it changes.
  std::unique_ptr<ModelManager> models_;
  std::unique_ptr<RequestDispatcher> dispatcher_;
  std::unique_ptr<BearerTokens> tokens_;  // null: no authentication
  // Clients' shared-memory regions, one table for both KServe front ends
  // (null without --allow-client-shm); outlives them.
  std::unique_ptr<SystemSharedMemory> shared_memory_;
  std::unique_ptr<AttentionServiceImpl> service_;
  std::unique_ptr<KServeServiceImpl> kserve_;
  std::unique_ptr<grpc::Server> server_;
  // KServe v2 over HTTP (null without --http-address); stopped before the
  // scheduler and dispatcher it hands requests to.
  std::unique_ptr<KServeCore> kserve_core_;
  std::unique_ptr<KServeHttpServer> http_;
  std::string warmup_summary_;
  // The front ends' tensor memory when the engine has none of its own
  // (null otherwise); the trimmer gives its unused buffers back.
  std::shared_ptr<HostBufferPool> ordinary_request_memory_;
  std::unique_ptr<MemoryTrimmer> trimmer_;  // null when the interval is 0
  std::string address_;
  int port_ = 0;

  // Closes expired sessions once a second (they are also closed lazily when
  // memory is needed), so that their memory and the metrics follow the TTL.
  std::thread sweeper_;
  absl::Notification stop_sweeper_;

  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_ATTN_SERVER_H_

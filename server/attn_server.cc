// Wiring of one attnserve process.
#include "server/attn_server.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/attention_engine.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "server/model_repository.h"

namespace attnserve {

AttnServer::AttnServer(const ServerOptions& options) : options_(options) {}

AttnServer::~AttnServer() { Shutdown(); }

absl::StatusOr<std::unique_ptr<AttnServer>> AttnServer::Start(const ServerOptions& options) {
  if (absl::Status s = CheckServerOptions(options); !s.ok()) return s;
  std::unique_ptr<AttnServer> server(new AttnServer(options));

  EngineOptions engine_options;
  engine_options.num_threads = options.engine_threads;
  absl::StatusOr<std::unique_ptr<AttentionEngine>> engine =
      CreateEngine(options.backend, engine_options);
  if (!engine.ok()) {
    return absl::Status(engine.status().code(),
                        absl::StrCat("--backend ", options.backend, ": ",
                                     engine.status().message()));
  }
  std::shared_ptr<AttentionEngine> shared_engine = *std::move(engine);
  if (absl::Status s = AddBuiltinModels(shared_engine, &server->registry_); !s.ok()) return s;
  if (!options.model_repository.empty()) {
    if (absl::Status s = AddRepositoryModels(options.model_repository, options.strict_model_loading,
                                             shared_engine, engine_options, &server->registry_);
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = server->registry_.SetDefaultModel(options.default_model); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("--default-model: ", s.message()));
  }

  server->executor_ = std::make_unique<Executor>(options.executor);
  server->scheduler_ = std::make_unique<UnbatchedScheduler>(server->executor_.get());
  server->service_ = std::make_unique<AttentionServiceImpl>(
      &server->registry_, server->scheduler_.get(),
      AttentionServiceOptions{.validation = options.validation});

  // Both are process-wide switches read by ServerBuilder; they must be set
  // before BuildAndStart.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default, which would let a second server
  // silently share a fixed port with this one.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(options.address, grpc::InsecureServerCredentials(), &server->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(server->service_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    server->server_.reset();
    server->executor_->Shutdown();
    return absl::UnavailableError(absl::StrCat(
        "--address: cannot listen on ", options.address, " (in use or not a local address?)"));
  }
  server->server_->GetHealthCheckService()->SetServingStatus(kAttentionServiceName, true);

  const size_t colon = options.address.rfind(':');
  server->address_ = absl::StrCat(options.address.substr(0, colon), ":", server->port_);
  return server;
}

void AttnServer::Shutdown() {
  absl::MutexLock lock(&shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (server_ != nullptr) {
    // Tell load balancers first; Shutdown() also does this, but only once
    // it starts refusing calls.
    server_->GetHealthCheckService()->SetServingStatus(false);
    // Waits for in-flight calls (their work keeps running on the executor)
    // up to the grace period, then cancels the rest; queued work then sees
    // the cancellation and finishes without compute.
    server_->Shutdown(std::chrono::system_clock::now() + options_.shutdown_grace);
    server_->Wait();
  }
  if (executor_ != nullptr) executor_->Shutdown();
}

}  // namespace attnserve

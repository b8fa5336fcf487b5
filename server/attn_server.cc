// Wiring of one attnserve process.
#include "server/attn_server.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/attention_engine.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/server_builder.h"
#include "server/fd_limit.h"
#include "server/models/model_repository.h"
#include "server/models/warmup.h"
#include "server/transport/payload_copier.h"
#include "server/transport/tls_credentials.h"

namespace attnserve {
namespace {

// Turns gRPC server reflection on or off for one ServerBuilder. Linking
// grpc++_reflection registers its plugin for every builder of the process
// (a static initializer), so "off" must remove it; "on" keeps exactly one.
class ReflectionOption final : public grpc::ServerBuilderOption {
 public:
  explicit ReflectionOption(bool enabled) : enabled_(enabled) {}
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    const std::string name = grpc::reflection::ProtoServerReflectionPlugin().name();
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [&](const auto& p) { return p->name() == name; }),
                   plugins->end());
    if (enabled_) {
      plugins->push_back(std::make_unique<grpc::reflection::ProtoServerReflectionPlugin>());
    }
  }

 private:
  const bool enabled_;
};

}  // namespace

AttnServer::AttnServer(const ServerOptions& options)
    : options_(options), clock_(options.clock != nullptr ? options.clock : MonotonicClock::Get()) {}

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
  if (!options.model_repository.empty() || options.model_control_mode != ModelControlMode::kNone ||
      !options.load_models.empty()) {
    ModelControlOptions control;
    control.mode = options.model_control_mode;
    control.repository = options.model_repository;
    control.strict = options.strict_model_loading;
    control.poll_interval = absl::FromChrono(options.repository_poll_interval);
    control.load_models = options.load_models;
    control.warmup = options.model_warmup;
    control.drain_grace = absl::FromChrono(options.shutdown_grace);
    absl::StatusOr<std::unique_ptr<ModelManager>> models = ModelManager::Create(
        std::move(control), std::make_shared<BackendEngines>(shared_engine, engine_options),
        &server->registry_);
    if (!models.ok()) return models.status();
    server->models_ = *std::move(models);
  }
  if (absl::Status s = server->registry_.SetDefaultModel(options.default_model); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("--default-model: ", s.message()));
  }
  // Before any port opens: the first client request finds the models warm.
  if (options.model_warmup) {
    absl::Duration total;
    int warmed = 0;
    for (const auto& model : server->registry_.List()) {
      if (!model->ready()) continue;
      absl::StatusOr<absl::Duration> took = WarmUpModel(*model);
      if (!took.ok()) return took.status();
      total += *took;
      ++warmed;
    }
    server->warmup_summary_ =
        absl::StrCat("warmed up ", warmed, " models in ",
                     absl::FormatDuration(absl::Trunc(total, absl::Milliseconds(1))),
                     " (--model-warmup)");
  }

  MetricsOptions metrics_options;
  metrics_options.address = options.metrics_address;
  metrics_options.threads = options.metrics_threads;
  metrics_options.request_timeout = options.metrics_request_timeout;
  metrics_options.connections_shed = &ConnectionsShedForFds;
  if (!options.metrics_auth_file.empty()) {
    auto users = ReadBasicAuthFile(options.metrics_auth_file);
    if (!users.ok()) {
      return absl::Status(users.status().code(),
                          absl::StrCat("--metrics-auth-file: ", users.status().message()));
    }
    metrics_options.basic_auth = *std::move(users);
  }
  metrics_options.build_labels = {{"backend", options.backend},
                                  {"grpc_version", grpc::Version()}};
  absl::StatusOr<std::unique_ptr<Metrics>> metrics = Metrics::Create(metrics_options);
  if (!metrics.ok()) {
    return absl::Status(metrics.status().code(),
                        absl::StrCat("--metrics-address: ", metrics.status().message()));
  }
  server->metrics_ = *std::move(metrics);
  for (const auto& model : server->registry_.List()) {
    if (model->state == ModelState::kUnloaded) continue;  // not loaded on purpose: no series
    server->metrics_->SetModelReady(
        model->name, model->engine != nullptr ? std::string(model->engine->name()) : "",
        model->ready());
  }
  absl::StatusOr<std::unique_ptr<BatchingScheduler>> scheduler =
      BatchingScheduler::Create(server->registry_, options.batching, server->metrics_.get(),
                                server->clock_);
  if (!scheduler.ok()) return scheduler.status();
  server->scheduler_ = *std::move(scheduler);
  server->sessions_ =
      std::make_unique<SessionManager>(options.sessions, server->clock_, server->metrics_.get());
  server->dispatcher_ = std::make_unique<RequestDispatcher>(
      &server->registry_, server->scheduler_.get(), server->metrics_.get(), server->clock_,
      options.validation, server->sessions_.get());
  // Changes start once the queues, sessions and metrics exist; the first
  // poll comes one interval after startup.
  if (server->models_ != nullptr) {
    server->models_->Start(server->scheduler_.get(), server->sessions_.get(),
                           server->metrics_.get());
  }
  AttentionServiceOptions service_options;
  // One pool for every front end's tensors: the engine's (page-locked for
  // the CUDA engine, which keeps what it pinned) or ordinary memory, whose
  // unused buffers the trimmer gives back.
  service_options.request_memory = shared_engine->request_memory();
  if (service_options.request_memory == nullptr) {
    service_options.request_memory = HostBufferPool::Ordinary();
    server->ordinary_request_memory_ = service_options.request_memory;
  }
  service_options.payload_copier = std::make_shared<PayloadCopier>(
      options.payload_copy_threads >= 0 ? options.payload_copy_threads
                                        : PayloadCopier::DefaultHelpers());
  if (!options.auth_token_file.empty()) {
    absl::StatusOr<BearerTokens> tokens = BearerTokens::FromFile(options.auth_token_file);
    if (!tokens.ok()) {
      return absl::Status(tokens.status().code(),
                          absl::StrCat("--auth-token-file: ", tokens.status().message()));
    }
    // A misspelt model would silently lock its token out of the model meant.
    for (const std::string& model : tokens->RestrictedModels()) {
      if (!server->registry_.Find(model).ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--auth-token-file: a token is restricted to model '", model,
            "', which this server does not serve"));
      }
    }
    server->tokens_ = std::make_unique<BearerTokens>(*std::move(tokens));
    service_options.tokens = server->tokens_.get();
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      MakeServerCredentials(options.tls);
  if (!credentials.ok()) return credentials.status();
  server->service_ = std::make_unique<AttentionServiceImpl>(
      &server->registry_, server->dispatcher_.get(), server->metrics_.get(), service_options);
  // The KServe v2 / Open Inference Protocol front end, on the same port,
  // behind the same tokens.
  if (options.allow_client_shm) server->shared_memory_ = std::make_unique<SystemSharedMemory>();
  server->kserve_ = std::make_unique<KServeServiceImpl>(
      &server->registry_, server->dispatcher_.get(), server->metrics_.get(),
      service_options.max_stream_backlog, service_options.tokens, server->models_.get(),
      service_options.request_memory, server->shared_memory_.get(),
      service_options.payload_copier);

  // A process-wide switch read by ServerBuilder; it must be set before
  // BuildAndStart. Health is never behind the tokens: probes need it.
  grpc::EnableDefaultHealthCheckService(true);

  // Without this, the first accept4 that fails with EMFILE stops gRPC
  // 1.51's listener for good.
  KeepAcceptingWhenOutOfFds();

  grpc::ServerBuilder builder;
  // gRPC sets SO_REUSEPORT by default, which would let a second server
  // silently share a fixed port with this one.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(options.address, *credentials, &server->port_);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  const ConnectionLimits& limits = options.connections;
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, limits.max_concurrent_streams);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                             static_cast<int>(limits.keepalive_time.count()));
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                             static_cast<int>(limits.keepalive_timeout.count()));
  if (limits.max_connection_idle.count() > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS,
                               static_cast<int>(limits.max_connection_idle.count()));
  }
  if (limits.max_connection_age.count() > 0) {
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_MS,
                               static_cast<int>(limits.max_connection_age.count()));
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_AGE_GRACE_MS,
                               static_cast<int>(limits.max_connection_age_grace.count()));
  }
  // gRPC compresses each answer at this level, with an algorithm the call's
  // client accepts; requests are decompressed regardless.
  switch (options.grpc_response_compression) {
    case ResponseCompression::kNone:
      break;
    case ResponseCompression::kLow:
      builder.SetDefaultCompressionLevel(GRPC_COMPRESS_LEVEL_LOW);
      break;
    case ResponseCompression::kMedium:
      builder.SetDefaultCompressionLevel(GRPC_COMPRESS_LEVEL_MED);
      break;
    case ResponseCompression::kHigh:
      builder.SetDefaultCompressionLevel(GRPC_COMPRESS_LEVEL_HIGH);
      break;
  }
  builder.SetOption(std::make_unique<ReflectionOption>(options.reflection));
  builder.RegisterService(server->service_.get());
  builder.RegisterService(server->kserve_.get());
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    server->server_.reset();
    if (server->models_ != nullptr) server->models_->Stop();
    server->scheduler_->Shutdown(absl::ZeroDuration());
    return absl::UnavailableError(absl::StrCat(
        "--address: cannot listen on ", options.address, " (in use or not a local address?)"));
  }
  // KServe v2 over HTTP/REST: the same operations, the same tokens, and
  // with --tls-cert-file HTTPS with the same certificate.
  if (!options.http.address.empty()) {
    server->kserve_core_ = std::make_unique<KServeCore>(
        &server->registry_, server->dispatcher_.get(), server->metrics_.get(),
        server->models_.get(), server->shared_memory_.get());
    HttpOptions http_options = options.http;
    http_options.tls = options.tls;
    absl::StatusOr<std::unique_ptr<KServeHttpServer>> http = KServeHttpServer::Start(
        http_options, server->kserve_core_.get(), service_options.tokens);
    if (!http.ok()) {
      server->server_->Shutdown();
      server->server_.reset();
      if (server->models_ != nullptr) server->models_->Stop();
      server->scheduler_->Shutdown(absl::ZeroDuration());
      return http.status();
    }
    server->http_ = *std::move(http);
  }
  server->server_->GetHealthCheckService()->SetServingStatus(kAttentionServiceName, true);
  server->sweeper_ = std::thread([s = server.get()] {
    while (!s->stop_sweeper_.WaitForNotificationWithTimeout(absl::Seconds(1))) {
      s->sessions_->Sweep();
    }
  });

  const size_t colon = options.address.rfind(':');
  server->address_ = absl::StrCat(options.address.substr(0, colon), ":", server->port_);
  if (options.malloc_trim_interval.count() > 0) {
    std::function<void()> before_trim;
    if (server->ordinary_request_memory_ != nullptr) {
      before_trim = [memory = server->ordinary_request_memory_] { memory->ReleaseIdle(); };
    }
    server->trimmer_ = std::make_unique<MemoryTrimmer>(
        absl::FromChrono(options.malloc_trim_interval), std::move(before_trim));
  }
  return server;
}

void AttnServer::Shutdown() {
  absl::MutexLock lock(&shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (server_ == nullptr) return;
  // 1. Tell load balancers first; no model changes from here on (a load in
  //    progress finishes, queued ones are refused).
  server_->GetHealthCheckService()->SetServingStatus(false);
  if (models_ != nullptr) models_->Stop();
  // 2. Refuse new requests (UNAVAILABLE) and stop reading open streams.
  service_->BeginShutdown();
  kserve_->BeginShutdown();
  if (http_ != nullptr) http_->BeginShutdown();
  // 3. Every accepted request is computed (batches close at once, no
  //    max_queue_delay wait) or, past the grace, answered UNAVAILABLE. When
  //    this returns every accepted request has its answer.
  const absl::Time start = clock_->Now();
  scheduler_->Shutdown(absl::FromChrono(options_.shutdown_grace));
  // 4. Keep serving (new calls get UNAVAILABLE from the service) until every
  //    open call has been answered and sent -- streams whose client reads
  //    slowly included -- for what is left of the grace.
  const absl::Duration left =
      absl::FromChrono(options_.shutdown_grace) - (clock_->Now() - start);
  service_->WaitForNoCalls(std::max(left, absl::ZeroDuration()));
  kserve_->WaitForNoCalls(
      std::max(absl::FromChrono(options_.shutdown_grace) - (clock_->Now() - start),
               absl::ZeroDuration()));
  if (http_ != nullptr) {
    // Answers are written by the worker that read the request before it
    // counts the call done: stopping once this returns loses none.
    http_->WaitForNoCalls(
        std::max(absl::FromChrono(options_.shutdown_grace) - (clock_->Now() - start),
                 absl::ZeroDuration()));
    http_->Stop();
  }
  // 5. Stop gRPC. Every accepted call has been answered (or the grace is
  //    spent), but the last answers may still sit in gRPC's write path: a
  //    deadline of "now" closed the connections under them, and a client
  //    that was still sending got a reset instead of its answer (seen under
  //    load behind a balancer: 2 of ~900 accepted requests lost). So gRPC
  //    gets kFlushAnswers to send GOAWAY and flush; clients that stay idle
  //    are then cut off, which bounds what every stop pays.
  constexpr auto kFlushAnswers = std::chrono::milliseconds(250);
  server_->Shutdown(std::chrono::system_clock::now() + kFlushAnswers);
  server_->Wait();
  stop_sweeper_.Notify();
  if (sweeper_.joinable()) sweeper_.join();
}

}  // namespace attnserve

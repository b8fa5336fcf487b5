// inference.GRPCInferenceService (KServe v2 / Open Inference Protocol, as
// Triton serves it) on gRPC's callback API: the second front end. ModelInfer
// and each ModelStreamInfer message are parsed, translated (kserve_codec.h)
// and handed to the same RequestDispatcher as Attend; health, metadata,
// config, statistics and the repository index are answered from the model
// registry and the metrics.
#ifndef ATTNSERVE_SERVER_TRANSPORT_KSERVE_SERVICE_H_
#define ATTNSERVE_SERVER_TRANSPORT_KSERVE_SERVICE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/byte_buffer.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/dispatch/request_dispatcher.h"
#include "server/metrics/metrics.h"
#include "server/models/model_registry.h"
#include "server/transport/kserve_codec.h"

namespace attnserve {

class KServeStreamReactor;

struct KServeServiceOptions {
  // ModelStreamInfer flow control: most responses one stream may owe at once
  // (as AttentionServiceOptions::max_stream_backlog). Default: 64.
  size_t max_stream_backlog = 64;
  // ServerMetadata's version. Default: attnserve's version.
  std::string server_version;
};

// ModelInfer and ModelStreamInfer take gRPC's raw bytes and parse them here,
// so that a message that is not a valid ModelInferRequest is answered like
// any other bad request (INVALID_ARGUMENT, counted in the metrics).
using KServeServiceBase = inference::GRPCInferenceService::WithCallbackMethod_ServerLive<
    inference::GRPCInferenceService::WithCallbackMethod_ServerReady<
        inference::GRPCInferenceService::WithCallbackMethod_ModelReady<
            inference::GRPCInferenceService::WithCallbackMethod_ServerMetadata<
                inference::GRPCInferenceService::WithCallbackMethod_ModelMetadata<
                    inference::GRPCInferenceService::WithRawCallbackMethod_ModelInfer<
                        inference::GRPCInferenceService::WithRawCallbackMethod_ModelStreamInfer<
                            inference::GRPCInferenceService::WithCallbackMethod_ModelConfig<
                                inference::GRPCInferenceService::WithCallbackMethod_ModelStatistics<
                                    inference::GRPCInferenceService::
                                        WithCallbackMethod_RepositoryIndex<
                                            inference::GRPCInferenceService::
                                                WithCallbackMethod_RepositoryModelLoad<
                                                    inference::GRPCInferenceService::
                                                        WithCallbackMethod_RepositoryModelUnload<
                                                            inference::GRPCInferenceService::
                                                                Service>>>>>>>>>>>>;

// Thread-safe (gRPC calls handlers concurrently). Does not own the registry,
// the dispatcher or the metrics (nullable: ModelStatistics then reports
// zeros); all must outlive the grpc::Server this is registered with.
//
// Every inference request gets exactly one answer: the unary status, or one
// ModelStreamInferResponse per stream message (error_message set when it
// failed; the stream goes on). Its metrics are those of Attend (no protocol
// label: a request counts the same whichever front end brought it).
class KServeServiceImpl final : public KServeServiceBase {
 public:
  KServeServiceImpl(const ModelRegistry* registry, RequestDispatcher* dispatcher,
                    Metrics* metrics, KServeServiceOptions options = {});

  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest* request,
                                       inference::ServerLiveResponse* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest* request,
                                        inference::ServerReadyResponse* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest* request,
                                           inference::ServerMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override;
  // `request` holds a serialized ModelInferRequest; `response` receives the
  // serialized ModelInferResponse.
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ModelStreamInfer(
      grpc::CallbackServerContext* context) override;
  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* context,
                                        const inference::ModelConfigRequest* request,
                                        inference::ModelConfigResponse* response) override;
  grpc::ServerUnaryReactor* ModelStatistics(grpc::CallbackServerContext* context,
                                            const inference::ModelStatisticsRequest* request,
                                            inference::ModelStatisticsResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryIndex(grpc::CallbackServerContext* context,
                                            const inference::RepositoryIndexRequest* request,
                                            inference::RepositoryIndexResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryModelLoad(
      grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest* request,
      inference::RepositoryModelLoadResponse* response) override;
  grpc::ServerUnaryReactor* RepositoryModelUnload(
      grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest* request,
      inference::RepositoryModelUnloadResponse* response) override;

  // As AttentionServiceImpl::BeginShutdown: new inference requests get
  // UNAVAILABLE, ServerReady and ModelReady turn false, open streams end
  // once every request they accepted is answered. Idempotent.
  void BeginShutdown();
  // As AttentionServiceImpl::WaitForNoCalls.
  bool WaitForNoCalls(absl::Duration timeout);

 private:
  friend class KServeStreamReactor;
  class InferReactor;

  // Decodes one ModelInferRequest into `decoded` and submits it; `parsed` is
  // what ParseMessage said of its bytes (not OK: refused with that status
  // through the dispatcher, counted, not run). `done` runs exactly once with
  // the final status (the response's model_name, model_version and id set),
  // from this thread or a batcher worker. Everything passed must stay valid
  // until it has run; `decoded` must not move.
  void StartInfer(grpc::CallbackServerContext* context, const absl::Status& parsed,
                  const inference::ModelInferRequest& request, KServeInferInputs* decoded,
                  inference::ModelInferResponse* response, std::string* scratch,
                  absl::AnyInvocable<void(absl::Status)> done);

  void AddStream(KServeStreamReactor* stream);
  void RemoveStream(KServeStreamReactor* stream);
  bool CallStarted();
  void CallDone();

  const ModelRegistry* const registry_;
  RequestDispatcher* const dispatcher_;
  Metrics* const metrics_;
  const KServeServiceOptions options_;

  std::atomic<bool> shutting_down_{false};
  absl::Mutex streams_mu_;
  std::set<KServeStreamReactor*> streams_ ABSL_GUARDED_BY(streams_mu_);
  absl::Mutex calls_mu_;
  // ModelInfer + ModelStreamInfer calls opened before shutdown, not yet done.
  int64_t open_calls_ ABSL_GUARDED_BY(calls_mu_) = 0;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_KSERVE_SERVICE_H_

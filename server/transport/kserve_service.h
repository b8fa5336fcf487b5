// inference.GRPCInferenceService (KServe v2 / Open Inference Protocol, as
// Triton serves it) on gRPC's callback API: the second front end, on the same
// port as attnserve.v1. ModelInfer and each ModelStreamInfer message are
// parsed here (message_codec.h), translated (kserve_codec.h) and handed to
// the shared RequestDispatcher: the same validation, batching, deadlines,
// queue bounds, sessions, metrics and shutdown as Attend. The rest answers
// from the model registry (readiness, metadata, config) and the metrics
// (statistics).
#ifndef ATTNSERVE_SERVER_TRANSPORT_KSERVE_SERVICE_H_
#define ATTNSERVE_SERVER_TRANSPORT_KSERVE_SERVICE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "engine/host_buffer.h"
#include "grpcpp/support/byte_buffer.h"
#include "inference/grpc_service.grpc.pb.h"
#include "server/dispatch/request_dispatcher.h"
#include "server/metrics/metrics.h"
#include "server/models/model_registry.h"
#include "server/request/model_access.h"
#include "server/transport/bearer_tokens.h"
#include "server/transport/call_tracker.h"
#include "server/transport/kserve_codec.h"
#include "server/transport/kserve_core.h"
#include "server/transport/payload_copier.h"
#include "server/transport/stream_reactor.h"

namespace attnserve {

// ModelInfer and ModelStreamInfer take gRPC's raw bytes and parse them here
// (a message that does not parse is answered INVALID_ARGUMENT and counted).
namespace kserve_internal {
using S = inference::GRPCInferenceService;
using Base = S::WithRawCallbackMethod_ModelInfer<S::WithRawCallbackMethod_ModelStreamInfer<
    S::WithCallbackMethod_ServerLive<S::WithCallbackMethod_ServerReady<
        S::WithCallbackMethod_ModelReady<S::WithCallbackMethod_ServerMetadata<
            S::WithCallbackMethod_ModelMetadata<S::WithCallbackMethod_ModelConfig<
                S::WithCallbackMethod_ModelStatistics<S::WithCallbackMethod_RepositoryIndex<
                    S::WithCallbackMethod_RepositoryModelLoad<
                        S::WithCallbackMethod_RepositoryModelUnload<
                            S::WithCallbackMethod_SystemSharedMemoryStatus<
                                S::WithCallbackMethod_SystemSharedMemoryRegister<
                                    S::WithCallbackMethod_SystemSharedMemoryUnregister<
                                        S::WithCallbackMethod_CudaSharedMemoryStatus<
                                            S::WithCallbackMethod_CudaSharedMemoryRegister<
                                                S::WithCallbackMethod_CudaSharedMemoryUnregister<
                                                    S::Service>>>>>>>>>>>>>>>>>>;
}  // namespace kserve_internal
using KServeServiceBase = kserve_internal::Base;

// Thread-safe. Does not own the registry, the dispatcher or the metrics
// (nullable); all must outlive the grpc::Server this is registered with.
//
// Answers as Triton does: a ModelStreamInfer message that fails is answered
// in the stream (error_message, with the request's id) and the stream goes
// on; ModelReady of an unknown model is `ready: false`; the RPCs attnserve
// does not serve (model load/unload, shared memory) are UNIMPLEMENTED with a
// message saying why. With --auth-token-file every RPC but ServerLive and
// ServerReady (health: probes need them) needs a valid bearer token
// (UNAUTHENTICATED); a restricted token gets PERMISSION_DENIED for other
// models, and sees only its models in RepositoryIndex and ModelStatistics.
// Requests are counted in the metrics like Attend's (the
// request counters have no protocol label).
class KServeServiceImpl final : public KServeServiceBase, private StreamHandler {
 public:
  // max_stream_backlog: ModelStreamInfer flow control, as
  // AttentionServiceOptions::max_stream_backlog. tokens (nullable, not
  // owned): the bearer tokens of --auth-token-file, as for attnserve.v1.
  // `models`: model control (RepositoryModelLoad/Unload); null = none.
  // `request_memory`: where results are written and sent from, as
  // AttentionServiceOptions::request_memory (null: ordinary memory).
  // `shared_memory`: the regions clients register (system_shared_memory.h),
  // shared with the HTTP front end; null: --allow-client-shm is off.
  // `payload_copier`: copies raw inputs off the wire, as
  // AttentionServiceOptions::payload_copier (null: one without helpers).
  KServeServiceImpl(const ModelRegistry* registry, RequestDispatcher* dispatcher,
                    const Metrics* metrics, size_t max_stream_backlog,
                    const BearerTokens* tokens = nullptr, ModelManager* models = nullptr,
                    std::shared_ptr<HostBufferPool> request_memory = nullptr,
                    SystemSharedMemory* shared_memory = nullptr,
                    std::shared_ptr<PayloadCopier> payload_copier = nullptr);

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
  grpc::ServerUnaryReactor* SystemSharedMemoryStatus(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryStatusRequest* request,
      inference::SystemSharedMemoryStatusResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryRegister(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryRegisterRequest* request,
      inference::SystemSharedMemoryRegisterResponse* response) override;
  grpc::ServerUnaryReactor* SystemSharedMemoryUnregister(
      grpc::CallbackServerContext* context,
      const inference::SystemSharedMemoryUnregisterRequest* request,
      inference::SystemSharedMemoryUnregisterResponse* response) override;
  // CUDA shared memory: UNIMPLEMENTED, with the reason.
  grpc::ServerUnaryReactor* CudaSharedMemoryStatus(
      grpc::CallbackServerContext* context, const inference::CudaSharedMemoryStatusRequest* request,
      inference::CudaSharedMemoryStatusResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryRegister(
      grpc::CallbackServerContext* context,
      const inference::CudaSharedMemoryRegisterRequest* request,
      inference::CudaSharedMemoryRegisterResponse* response) override;
  grpc::ServerUnaryReactor* CudaSharedMemoryUnregister(
      grpc::CallbackServerContext* context,
      const inference::CudaSharedMemoryUnregisterRequest* request,
      inference::CudaSharedMemoryUnregisterResponse* response) override;

  // `request` holds a serialized ModelInferRequest; `response` receives the
  // serialized ModelInferResponse.
  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* ModelStreamInfer(
      grpc::CallbackServerContext* context) override;

  // As AttentionServiceImpl's: new requests are refused (UNAVAILABLE), open
  // streams end once what they accepted is answered; ServerReady turns false.
  void BeginShutdown();
  bool WaitForNoCalls(absl::Duration timeout);

 private:
  class UnaryReactor;

  // One inference: `parsed` is what ParseModelInferRequest said of
  // `request` and `raw_inputs` (not OK: refused through the dispatcher,
  // counted). `done` runs exactly once with the final status, `response`
  // filled when OK, its results' bytes in `results` (kserve_wire.h).
  // `access`: the models the caller may use.
  // `received`: when the message was handed to the front end, before it was
  // parsed.
  void StartInfer(grpc::CallbackServerContext* context, absl::Time received,
                  const absl::Status& parsed,
                  const ModelAccess& access, const inference::ModelInferRequest& request,
                  absl::Span<const HostBuffer> raw_inputs,
                  KServeRequest* decoded, inference::ModelInferResponse* response,
                  std::vector<HostBuffer>* results, absl::AnyInvocable<void(absl::Status)> done);

  void StartStreamMessage(grpc::CallbackServerContext* context, grpc::ByteBuffer* bytes,
                          int64_t number, AnswerFn answer) override;
  void StreamCancelled() override;

  // OK when the call's credentials allow model `name` (empty: any model the
  // call may use; authentication only); UNAUTHENTICATED or
  // PERMISSION_DENIED otherwise. `access` (nullable) receives the access.
  absl::Status Authorize(const grpc::CallbackServerContext& context, absl::string_view name,
                         ModelAccess* access = nullptr) const;

  // RepositoryModelLoad (`unload` false) or RepositoryModelUnload: the
  // caller's rights, the repository name and the parameters, then the
  // change, answered when it is made (from the model manager's thread).
  template <typename Request>
  grpc::ServerUnaryReactor* ChangeModel(grpc::CallbackServerContext* context,
                                        const Request& request, bool unload);

  const ModelRegistry* const registry_;
  RequestDispatcher* const dispatcher_;
  const Metrics* const metrics_;
  const size_t max_stream_backlog_;
  const BearerTokens* const tokens_;  // null: no authentication
  const std::shared_ptr<HostBufferPool> request_memory_;  // never null
  const std::shared_ptr<PayloadCopier> payload_copier_;   // never null
  const KServeCore core_;
  CallTracker calls_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_KSERVE_SERVICE_H_

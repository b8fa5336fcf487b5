// GRPCInferenceService handlers: inference through the shared request path,
// and the registry- and metrics-backed RPCs Triton's clients call.
#include "server/transport/kserve_service.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/transport/kserve_json.h"
#include "server/transport/kserve_wire.h"
#include "server/transport/message_codec.h"
#include "server/transport/server_deadline.h"
#include "server/transport/status_util.h"

namespace attnserve {
namespace {

grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// attnserve has one model repository: a request naming another is refused
// rather than served from this one.
absl::Status CheckRepositoryName(const std::string& name) {
  if (name.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "repository_name: \"", name, "\" is not a repository of this server; it has one "
      "(--model-repository): leave repository_name empty"));
}

// Load's and unload's parameters, as the HTTP front end checks them.
absl::Status CheckParameters(
    const google::protobuf::Map<std::string, inference::ModelRepositoryParameter>& parameters,
    bool unload) {
  for (const auto& [name, value] : parameters) {
    const bool is_bool =
        value.parameter_choice_case() == inference::ModelRepositoryParameter::kBoolParam;
    if (absl::Status s = CheckModelRepositoryParameter(name, is_bool, unload); !s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

KServeServiceImpl::KServeServiceImpl(const ModelRegistry* registry, RequestDispatcher* dispatcher,
                                     const Metrics* metrics, size_t max_stream_backlog,
                                     const BearerTokens* tokens, ModelManager* models,
                                     std::shared_ptr<HostBufferPool> request_memory,
                                     SystemSharedMemory* shared_memory,
                                     std::shared_ptr<PayloadCopier> payload_copier)
    : registry_(registry),
      dispatcher_(dispatcher),
      metrics_(metrics),
      max_stream_backlog_(max_stream_backlog),
      tokens_(tokens),
      request_memory_(request_memory != nullptr ? std::move(request_memory)
                                                : HostBufferPool::Ordinary()),
      payload_copier_(payload_copier != nullptr ? std::move(payload_copier)
                                                : std::make_shared<PayloadCopier>(0)),
      core_(registry, dispatcher, metrics, models, shared_memory) {}

absl::Status KServeServiceImpl::Authorize(const grpc::CallbackServerContext& context,
                                          absl::string_view name, ModelAccess* access) const {
  absl::StatusOr<ModelAccess> a = CallAccess(tokens_, context);
  if (!a.ok()) return a.status();
  if (!name.empty()) {
    if (absl::Status s = a->Check(name, [] { return std::string(); }); !s.ok()) return s;
  }
  if (access != nullptr) *access = *std::move(a);
  return absl::OkStatus();
}

// ------------------------------------------------------------- inference

void KServeServiceImpl::StartInfer(grpc::CallbackServerContext* context, absl::Time received,
                                   const absl::Status& parsed,
                                   const ModelAccess& access,
                                   const inference::ModelInferRequest& request,
                                   absl::Span<const HostBuffer> raw_inputs,
                                   KServeRequest* decoded, inference::ModelInferResponse* response,
                                   std::vector<HostBuffer>* results,
                                   absl::AnyInvocable<void(absl::Status)> done) {
  KServeCore::Call call;
  call.received = received;
  call.result_memory = request_memory_.get();
  call.result_buffers = results;
  call.raw_inputs = raw_inputs;
  call.deadline = ServerDeadline(*context, *dispatcher_->clock());
  call.is_cancelled = [context] { return context->IsCancelled(); };
  call.access = access;
  call.shutting_down = calls_.shutting_down();
  core_.StartInfer(call, parsed, request, decoded, response, std::move(done));
}

// Finishes from the request's completion, as AttentionServiceImpl's.
class KServeServiceImpl::UnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  // Authenticates the call, then parses `request_bytes` (an
  // unauthenticated call's bytes are never parsed).
  UnaryReactor(KServeServiceImpl* service, const grpc::CallbackServerContext& context,
               const grpc::ByteBuffer* request_bytes)
      : service_(service),
        received_(service->dispatcher_->clock()->Now()),
        authorized_(service->Authorize(context, "", &access_)),
        // gRPC frees the buffer only at OnDone; releasing it now keeps one
        // copy of the inputs, not two.
        parsed_(authorized_.ok()
                    ? ParseModelInferRequest(const_cast<grpc::ByteBuffer*>(request_bytes),
                                             "request", 0, *service->request_memory_,
                                             *service->payload_copier_, &request_, &raw_inputs_)
                    : authorized_),
        model_(request_.model_name()),
        counted_(service->calls_.CallStarted()) {}

  void Start(grpc::CallbackServerContext* context, grpc::ByteBuffer* response_bytes) {
    service_->StartInfer(context, received_, parsed_, access_, request_, raw_inputs_, &decoded_,
                         &response_, &results_,
                         [this, response_bytes](absl::Status status) {
                           if (status.ok()) {
                             status = SerializeModelInferResponse(
                                 response_, std::move(results_), response_bytes);
                           }
                           Finish(ToGrpcStatus(status));
                         });
  }

  void OnCancel() override { service_->dispatcher_->Cancelled(model_); }
  void OnDone() override {
    KServeServiceImpl* service = service_;
    const bool counted = counted_;
    delete this;
    if (counted) service->calls_.CallDone();
  }

 private:
  KServeServiceImpl* const service_;
  const absl::Time received_;  // before the parse: the request's total time counts it
  ModelAccess access_ = ModelAccess::None();
  const absl::Status authorized_;
  inference::ModelInferRequest request_;
  std::vector<HostBuffer> raw_inputs_;  // request_'s raw_input_contents (kserve_wire.h)
  KServeRequest decoded_;
  inference::ModelInferResponse response_;
  std::vector<HostBuffer> results_;  // response_'s outputs' bytes (kserve_wire.h)
  const absl::Status parsed_;
  const std::string model_;
  const bool counted_;
};

grpc::ServerUnaryReactor* KServeServiceImpl::ModelInfer(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  auto* reactor = new UnaryReactor(this, *context, request);
  reactor->Start(context, response);
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KServeServiceImpl::ModelStreamInfer(
    grpc::CallbackServerContext* context) {
  // An unauthenticated stream ends before its first read.
  if (absl::Status s = Authorize(*context, ""); !s.ok()) return FinishedStream(ToGrpcStatus(s));
  return new StreamReactor(&calls_, this, context, max_stream_backlog_);
}

void KServeServiceImpl::StartStreamMessage(grpc::CallbackServerContext* context,
                                           grpc::ByteBuffer* bytes, int64_t number,
                                           AnswerFn answer) {
  struct Message {
    inference::ModelInferRequest request;
    std::vector<HostBuffer> raw_inputs;  // request's raw_input_contents (kserve_wire.h)
    KServeRequest decoded;
    inference::ModelStreamInferResponse answer;
    std::vector<HostBuffer> results;  // the answer's outputs' bytes (kserve_wire.h)
  };
  auto* message = new Message;
  const absl::Time received = dispatcher_->clock()->Now();
  const absl::Status parsed =
      ParseModelInferRequest(bytes, "ModelStreamInfer message", number, *request_memory_,
                             *payload_copier_, &message->request, &message->raw_inputs);
  inference::ModelInferResponse* response = message->answer.mutable_infer_response();
  // Authenticated when the stream opened; the same access for every message.
  ModelAccess access = ModelAccess::None();
  const absl::Status authorized = Authorize(*context, "", &access);
  StartInfer(context, received, authorized.ok() ? parsed : authorized, access, message->request,
             message->raw_inputs, &message->decoded, response, &message->results,
             [message, answer = std::move(answer)](absl::Status status) mutable {
               std::unique_ptr<Message> owned(message);
               owned->request.Clear();  // inputs no longer needed; free them now
               owned->raw_inputs.clear();
               inference::ModelInferResponse* response = owned->answer.mutable_infer_response();
               if (!status.ok()) {
                 // As Triton: the error in the stream, with the request's id.
                 response->clear_outputs();
                 response->clear_raw_output_contents();
                 response->clear_parameters();
                 owned->results.clear();
                 owned->answer.set_error_message(ToGrpcStatus(status).error_message());
               }
               grpc::ByteBuffer bytes;
               if (absl::Status s = SerializeModelStreamInferResponse(
                       owned->answer, std::move(owned->results), &bytes);
                   !s.ok()) {
                 response->clear_outputs();
                 response->clear_raw_output_contents();
                 owned->answer.set_error_message(ToGrpcStatus(s).error_message());
                 SerializeMessage(owned->answer, &bytes).IgnoreError();
               }
               answer(std::move(bytes));
             });
}

void KServeServiceImpl::StreamCancelled() { dispatcher_->CancelledOnAnyModel(); }

// ------------------------------------------------------------- shutdown

void KServeServiceImpl::BeginShutdown() { calls_.BeginShutdown(); }

bool KServeServiceImpl::WaitForNoCalls(absl::Duration timeout) {
  return calls_.WaitForNoCalls(timeout);
}

// ------------------------------------------------------- server, models

grpc::ServerUnaryReactor* KServeServiceImpl::ServerLive(grpc::CallbackServerContext* context,
                                                        const inference::ServerLiveRequest*,
                                                        inference::ServerLiveResponse* response) {
  response->set_live(true);
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::ServerReady(grpc::CallbackServerContext* context,
                                                         const inference::ServerReadyRequest*,
                                                         inference::ServerReadyResponse* response) {
  // As the health service: serving until shutdown begins.
  response->set_ready(!calls_.shutting_down());
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::ModelReady(grpc::CallbackServerContext* context,
                                                        const inference::ModelReadyRequest* request,
                                                        inference::ModelReadyResponse* response) {
  if (absl::Status s = Authorize(*context, request->name()); !s.ok()) return Answer(context, s);
  response->set_ready(core_.ModelReady(request->name(), request->version()) &&
                      !calls_.shutting_down());
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* response) {
  if (absl::Status s = Authorize(*context, ""); !s.ok()) return Answer(context, s);
  core_.ServerMetadata(response);
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  if (absl::Status s = Authorize(*context, request->name()); !s.ok()) return Answer(context, s);
  return Answer(context, core_.ModelMetadata(request->name(), request->version(), response));
}

grpc::ServerUnaryReactor* KServeServiceImpl::ModelConfig(grpc::CallbackServerContext* context,
                                                         const inference::ModelConfigRequest* request,
                                                         inference::ModelConfigResponse* response) {
  if (absl::Status s = Authorize(*context, request->name()); !s.ok()) return Answer(context, s);
  return Answer(context, core_.ModelConfig(request->name(), request->version(), response));
}

grpc::ServerUnaryReactor* KServeServiceImpl::ModelStatistics(
    grpc::CallbackServerContext* context, const inference::ModelStatisticsRequest* request,
    inference::ModelStatisticsResponse* response) {
  ModelAccess access;
  if (absl::Status s = Authorize(*context, request->name(), &access); !s.ok()) {
    return Answer(context, s);
  }
  return Answer(context,
                core_.ModelStatistics(request->name(), request->version(), access, response));
}

grpc::ServerUnaryReactor* KServeServiceImpl::RepositoryIndex(
    grpc::CallbackServerContext* context, const inference::RepositoryIndexRequest* request,
    inference::RepositoryIndexResponse* response) {
  ModelAccess access;
  if (absl::Status s = Authorize(*context, "", &access); !s.ok()) return Answer(context, s);
  core_.RepositoryIndex(request->ready(), access, response);
  return Answer(context, absl::OkStatus());
}

template <typename Request>
grpc::ServerUnaryReactor* KServeServiceImpl::ChangeModel(grpc::CallbackServerContext* context,
                                                         const Request& request, bool unload) {
  ModelAccess access;
  if (absl::Status s = Authorize(*context, "", &access); !s.ok()) return Answer(context, s);
  if (absl::Status s = KServeCore::CheckRepositoryControl(
          unload ? "RepositoryModelUnload" : "RepositoryModelLoad", access);
      !s.ok()) {
    return Answer(context, s);
  }
  if (absl::Status s = CheckRepositoryName(request.repository_name()); !s.ok()) {
    return Answer(context, s);
  }
  if (absl::Status s = CheckParameters(request.parameters(), unload); !s.ok()) {
    return Answer(context, s);
  }
  // Answered when the change is made (a load reads weights and warms up):
  // the reactor finishes from the model manager's thread.
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto finish = [reactor](absl::Status s) { reactor->Finish(ToGrpcStatus(s)); };
  if (unload) {
    core_.UnloadModel(request.model_name(), access, finish);
  } else {
    core_.LoadModel(request.model_name(), access, finish);
  }
  return reactor;
}

grpc::ServerUnaryReactor* KServeServiceImpl::RepositoryModelLoad(
    grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest* request,
    inference::RepositoryModelLoadResponse*) {
  return ChangeModel(context, *request, /*unload=*/false);
}

grpc::ServerUnaryReactor* KServeServiceImpl::RepositoryModelUnload(
    grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest* request,
    inference::RepositoryModelUnloadResponse*) {
  return ChangeModel(context, *request, /*unload=*/true);
}

grpc::ServerUnaryReactor* KServeServiceImpl::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* context, const inference::SystemSharedMemoryStatusRequest* request,
    inference::SystemSharedMemoryStatusResponse* response) {
  ModelAccess access;
  if (absl::Status s = Authorize(*context, "", &access); !s.ok()) return Answer(context, s);
  return Answer(context, core_.SystemSharedMemoryStatus(request->name(), access, response));
}

grpc::ServerUnaryReactor* KServeServiceImpl::SystemSharedMemoryRegister(
    grpc::CallbackServerContext* context,
    const inference::SystemSharedMemoryRegisterRequest* request,
    inference::SystemSharedMemoryRegisterResponse*) {
  ModelAccess access;
  if (absl::Status s = Authorize(*context, "", &access); !s.ok()) return Answer(context, s);
  return Answer(context,
                core_.RegisterSystemSharedMemory(request->name(), request->key(),
                                                 request->offset(), request->byte_size(), access));
}

grpc::ServerUnaryReactor* KServeServiceImpl::SystemSharedMemoryUnregister(
    grpc::CallbackServerContext* context,
    const inference::SystemSharedMemoryUnregisterRequest* request,
    inference::SystemSharedMemoryUnregisterResponse*) {
  ModelAccess access;
  if (absl::Status s = Authorize(*context, "", &access); !s.ok()) return Answer(context, s);
  return Answer(context, core_.UnregisterSystemSharedMemory(request->name(), access));
}

namespace {

absl::Status NoCudaSharedMemory(const char* op) {
  return absl::UnimplementedError(absl::StrCat(
      op, ": attnserve has no CUDA shared memory; send tensors in the request "
      "(raw_input_contents) or, from the server's host, in system shared memory"));
}

}  // namespace

grpc::ServerUnaryReactor* KServeServiceImpl::CudaSharedMemoryStatus(
    grpc::CallbackServerContext* context, const inference::CudaSharedMemoryStatusRequest*,
    inference::CudaSharedMemoryStatusResponse*) {
  return Answer(context, NoCudaSharedMemory("CudaSharedMemoryStatus"));
}

grpc::ServerUnaryReactor* KServeServiceImpl::CudaSharedMemoryRegister(
    grpc::CallbackServerContext* context, const inference::CudaSharedMemoryRegisterRequest*,
    inference::CudaSharedMemoryRegisterResponse*) {
  return Answer(context, NoCudaSharedMemory("CudaSharedMemoryRegister"));
}

grpc::ServerUnaryReactor* KServeServiceImpl::CudaSharedMemoryUnregister(
    grpc::CallbackServerContext* context, const inference::CudaSharedMemoryUnregisterRequest*,
    inference::CudaSharedMemoryUnregisterResponse*) {
  return Answer(context, NoCudaSharedMemory("CudaSharedMemoryUnregister"));
}

}  // namespace attnserve

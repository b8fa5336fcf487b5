// GRPCInferenceService handlers: inference through the shared request path,
// and the registry- and metrics-backed RPCs Triton's clients call.
#include "server/transport/kserve_service.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/transport/message_codec.h"
#include "server/transport/server_deadline.h"
#include "server/transport/status_util.h"

#ifndef ATTNSERVE_VERSION
#define ATTNSERVE_VERSION "unknown"
#endif

namespace attnserve {
namespace {

grpc::ServerUnaryReactor* Answer(grpc::CallbackServerContext* context, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// A model's version as the protocol names it: "" or "1".
absl::Status CheckVersion(const std::string& model, const std::string& version) {
  if (version.empty() || version == "1") return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat("model '", model, "' has no version \"", version,
                                          "\"; attnserve serves version \"1\" of each model"));
}

void AddTensor(google::protobuf::RepeatedPtrField<inference::ModelMetadataResponse::TensorMetadata>* to,
               const char* name, const char* datatype, std::initializer_list<int64_t> shape) {
  auto* t = to->Add();
  t->set_name(name);
  t->set_datatype(datatype);
  for (int64_t d : shape) t->add_shape(d);
}

// Inputs and outputs as ModelMetadata reports them: -1 for every dim a
// request chooses. The float inputs accept FP32, FP16 and BF16 alike; the
// metadata names FP32.
void DescribeTensors(const LayerConfig& layer, inference::ModelMetadataResponse* m) {
  if (layer.has_projections) {
    AddTensor(m->mutable_inputs(), "query", "FP32", {-1, -1, layer.query_dim});
    AddTensor(m->mutable_inputs(), "key", "FP32", {-1, -1, layer.key_dim});
    AddTensor(m->mutable_inputs(), "value", "FP32", {-1, -1, layer.value_dim});
    AddTensor(m->mutable_outputs(), "output", "FP32", {-1, -1, layer.out_dim});
  } else {
    AddTensor(m->mutable_inputs(), "query", "FP32", {-1, -1, -1, -1});
    AddTensor(m->mutable_inputs(), "key", "FP32", {-1, -1, -1, -1});
    AddTensor(m->mutable_inputs(), "value", "FP32", {-1, -1, -1, -1});
    AddTensor(m->mutable_outputs(), "output", "FP32", {-1, -1, -1, -1});
  }
  AddTensor(m->mutable_inputs(), "attn_mask", "BOOL", {-1, -1, -1, -1});
  AddTensor(m->mutable_inputs(), "key_lengths", "INT64", {-1});
  if (layer.rope.type != RopeConfig::Type::kNone) {
    AddTensor(m->mutable_inputs(), "positions", "INT64", {-1, -1});
  }
  if (!layer.has_projections) AddTensor(m->mutable_inputs(), "sinks", "FP32", {-1});
  AddTensor(m->mutable_outputs(), "weights", "FP32", {-1, -1, -1, -1});
}

inference::DataType ConfigDataType(const std::string& datatype) {
  if (datatype == "BOOL") return inference::TYPE_BOOL;
  if (datatype == "INT64") return inference::TYPE_INT64;
  return inference::TYPE_FP32;
}

void SetDuration(inference::StatisticDuration* d, uint64_t count, uint64_t ns) {
  d->set_count(count);
  d->set_ns(ns);
}

}  // namespace

KServeServiceImpl::KServeServiceImpl(const ModelRegistry* registry, RequestDispatcher* dispatcher,
                                     const Metrics* metrics, size_t max_stream_backlog,
                                     const BearerTokens* tokens)
    : registry_(registry),
      dispatcher_(dispatcher),
      metrics_(metrics),
      max_stream_backlog_(max_stream_backlog),
      tokens_(tokens) {}

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

void KServeServiceImpl::StartInfer(grpc::CallbackServerContext* context, const absl::Status& parsed,
                                   const ModelAccess& access,
                                   const inference::ModelInferRequest& request,
                                   KServeRequest* decoded, inference::ModelInferResponse* response,
                                   absl::AnyInvocable<void(absl::Status)> done) {
  Clock* const clock = dispatcher_->clock();
  auto r = std::make_unique<InferenceRequest>();
  r->id = request.id();
  r->received = clock->Now();
  r->deadline = ServerDeadline(*context, *clock);
  r->is_cancelled = [context] { return context->IsCancelled(); };
  r->access = access;
  response->set_id(request.id());
  response->set_model_name(request.model_name());
  response->set_model_version("1");
  r->done = [done = std::move(done), response, decoded](absl::Status status,
                                                        const InferenceRequest& r) mutable {
    if (status.ok()) {
      KeepRequestedOutputs(*decoded, response);
      if (!r.session_id.empty()) {
        (*response->mutable_parameters())["session_length"].set_int64_param(r.session_length);
      }
      if (response->model_name().empty() && r.model != nullptr) {
        response->set_model_name(r.model->name);
      }
    }
    done(std::move(status));
  };
  if (calls_.shutting_down()) {
    dispatcher_->Reject(std::move(r),
                        absl::UnavailableError("server is shutting down; not accepting requests"));
    return;
  }
  if (!parsed.ok()) {
    dispatcher_->Reject(std::move(r), parsed);
    return;
  }
  // A request the mapping cannot express goes through the request path all
  // the same: the model lookup answers first (an unknown model is NOT_FOUND
  // whatever else is wrong, as Triton answers), then validation reports it.
  decoded->inputs.decode_error = DecodeModelInferRequest(request, decoded);
  if (decoded->timeout_us > 0) {
    r->deadline = std::min(r->deadline, r->received + absl::Microseconds(decoded->timeout_us));
  }
  dispatcher_->Submit(std::move(r), decoded->inputs,
                      [response](OutputName name, DType dtype, const Shape& shape) {
                        return AllocateKServeOutput(response, name, dtype, shape);
                      });
}

// Finishes from the request's completion, as AttentionServiceImpl's.
class KServeServiceImpl::UnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  // Authenticates the call, then parses `request_bytes` (an
  // unauthenticated call's bytes are never parsed).
  UnaryReactor(KServeServiceImpl* service, const grpc::CallbackServerContext& context,
               const grpc::ByteBuffer* request_bytes)
      : service_(service),
        authorized_(service->Authorize(context, "", &access_)),
        // gRPC frees the buffer only at OnDone; releasing it now keeps one
        // copy of the inputs, not two.
        parsed_(authorized_.ok()
                    ? ParseRequestMessage(const_cast<grpc::ByteBuffer*>(request_bytes), "request",
                                          0, &request_)
                    : authorized_),
        model_(request_.model_name()),
        counted_(service->calls_.CallStarted()) {}

  void Start(grpc::CallbackServerContext* context, grpc::ByteBuffer* response_bytes) {
    service_->StartInfer(context, parsed_, access_, request_, &decoded_, &response_,
                         [this, response_bytes](absl::Status status) {
                           if (status.ok()) status = SerializeMessage(response_, response_bytes);
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
  ModelAccess access_ = ModelAccess::None();
  const absl::Status authorized_;
  inference::ModelInferRequest request_;
  KServeRequest decoded_;
  inference::ModelInferResponse response_;
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
    KServeRequest decoded;
    inference::ModelStreamInferResponse answer;
  };
  auto* message = new Message;
  const absl::Status parsed =
      ParseRequestMessage(bytes, "ModelStreamInfer message", number, &message->request);
  inference::ModelInferResponse* response = message->answer.mutable_infer_response();
  // Authenticated when the stream opened; the same access for every message.
  ModelAccess access = ModelAccess::None();
  const absl::Status authorized = Authorize(*context, "", &access);
  StartInfer(context, authorized.ok() ? parsed : authorized, access, message->request,
             &message->decoded, response,
             [message, answer = std::move(answer)](absl::Status status) mutable {
               std::unique_ptr<Message> owned(message);
               owned->request.Clear();  // inputs no longer needed; free them now
               inference::ModelInferResponse* response = owned->answer.mutable_infer_response();
               if (!status.ok()) {
                 // As Triton: the error in the stream, with the request's id.
                 response->clear_outputs();
                 response->clear_raw_output_contents();
                 response->clear_parameters();
                 owned->answer.set_error_message(ToGrpcStatus(status).error_message());
               }
               grpc::ByteBuffer bytes;
               if (absl::Status s = SerializeMessage(owned->answer, &bytes); !s.ok()) {
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
  auto model = registry_->Find(request->name());
  response->set_ready(model.ok() && (*model)->ready() &&
                      CheckVersion(request->name(), request->version()).ok() &&
                      !calls_.shutting_down());
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* response) {
  if (absl::Status s = Authorize(*context, ""); !s.ok()) return Answer(context, s);
  response->set_name("attnserve");
  response->set_version(ATTNSERVE_VERSION);
  for (const char* e : {"model_configuration", "parameters", "statistics"}) {
    response->add_extensions(e);
  }
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  if (absl::Status s = Authorize(*context, request->name()); !s.ok()) return Answer(context, s);
  auto model = registry_->Find(request->name());
  if (!model.ok()) return Answer(context, model.status());
  if (absl::Status s = CheckVersion((*model)->name, request->version()); !s.ok()) {
    return Answer(context, s);
  }
  if (!(*model)->ready()) {
    return Answer(context, absl::UnavailableError(absl::StrCat(
                               "model '", (*model)->name, "' is not ready: ", (*model)->reason)));
  }
  response->set_name((*model)->name);
  response->add_versions("1");
  response->set_platform("attnserve");
  DescribeTensors((*model)->layer->config, response);
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::ModelConfig(grpc::CallbackServerContext* context,
                                                         const inference::ModelConfigRequest* request,
                                                         inference::ModelConfigResponse* response) {
  if (absl::Status s = Authorize(*context, request->name()); !s.ok()) return Answer(context, s);
  auto model = registry_->Find(request->name());
  if (!model.ok()) return Answer(context, model.status());
  if (absl::Status s = CheckVersion((*model)->name, request->version()); !s.ok()) {
    return Answer(context, s);
  }
  if (!(*model)->ready()) {
    return Answer(context, absl::UnavailableError(absl::StrCat(
                               "model '", (*model)->name, "' is not ready: ", (*model)->reason)));
  }
  const LayerConfig& layer = (*model)->layer->config;
  inference::ModelConfig* c = response->mutable_config();
  c->set_name((*model)->name);
  c->set_platform("attnserve");
  c->set_backend(std::string((*model)->engine->name()));
  // 0: the batch dimension is part of each input's shape (B), not Triton's
  // implicit one; the server batches whole requests on its own.
  c->set_max_batch_size(0);
  inference::ModelMetadataResponse m;
  DescribeTensors(layer, &m);
  for (const auto& t : m.inputs()) {
    auto* in = c->add_input();
    in->set_name(t.name());
    in->set_data_type(ConfigDataType(t.datatype()));
    in->mutable_dims()->CopyFrom(t.shape());
    in->set_optional(t.name() != "query");
  }
  for (const auto& t : m.outputs()) {
    auto* out = c->add_output();
    out->set_name(t.name());
    out->set_data_type(ConfigDataType(t.datatype()));
    out->mutable_dims()->CopyFrom(t.shape());
  }
  c->mutable_dynamic_batching()->set_max_queue_delay_microseconds(
      static_cast<uint64_t>(std::max<int64_t>(0, (*model)->batching.max_queue_delay_us)));
  auto& params = *c->mutable_parameters();
  params["kind"].set_string_value(layer.has_projections ? "projection" : "sdpa");
  if (layer.has_projections) {
    params["num_heads"].set_string_value(absl::StrCat(layer.num_heads));
    params["num_kv_heads"].set_string_value(absl::StrCat(layer.num_kv_heads));
    params["head_dim"].set_string_value(absl::StrCat(layer.head_dim));
  }
  params["causal"].set_string_value(layer.causal ? "true" : "false");
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::ModelStatistics(
    grpc::CallbackServerContext* context, const inference::ModelStatisticsRequest* request,
    inference::ModelStatisticsResponse* response) {
  ModelAccess access;
  if (absl::Status s = Authorize(*context, request->name(), &access); !s.ok()) {
    return Answer(context, s);
  }
  std::vector<std::shared_ptr<const ServedModel>> models;
  if (request->name().empty()) {
    for (auto& model : registry_->List()) {
      if (access.Allows(model->name)) models.push_back(std::move(model));
    }
  } else {
    auto model = registry_->Find(request->name());
    if (!model.ok()) return Answer(context, model.status());
    if (absl::Status s = CheckVersion((*model)->name, request->version()); !s.ok()) {
      return Answer(context, s);
    }
    models.push_back(*model);
  }
  for (const auto& model : models) {
    inference::ModelStatistics* st = response->add_model_stats();
    st->set_name(model->name);
    st->set_version("1");
    const ModelMetrics* mm = metrics_ != nullptr ? metrics_->FindModel(model->name) : nullptr;
    const ModelStatsSnapshot s = mm != nullptr ? mm->Stats() : ModelStatsSnapshot{};
    st->set_last_inference(s.last_inference_ms);
    st->set_inference_count(s.inference_count);
    st->set_execution_count(s.execution_count);
    inference::InferStatistics* is = st->mutable_inference_stats();
    SetDuration(is->mutable_success(), s.success_count, s.success_ns);
    SetDuration(is->mutable_fail(), s.fail_count, s.fail_ns);
    SetDuration(is->mutable_queue(), s.queue_count, s.queue_ns);
    // As Triton: compute_* per computed request (each request's batch's
    // engine time). attnserve decodes inputs before queueing and writes
    // outputs in place, so there is no separate input or output step: 0 ns.
    SetDuration(is->mutable_compute_input(), s.inference_count, 0);
    SetDuration(is->mutable_compute_infer(), s.inference_count, s.compute_request_ns);
    SetDuration(is->mutable_compute_output(), s.inference_count, 0);
  }
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::RepositoryIndex(
    grpc::CallbackServerContext* context, const inference::RepositoryIndexRequest* request,
    inference::RepositoryIndexResponse* response) {
  ModelAccess access;
  if (absl::Status s = Authorize(*context, "", &access); !s.ok()) return Answer(context, s);
  for (const auto& model : registry_->List()) {
    if (request->ready() && !model->ready()) continue;
    if (!access.Allows(model->name)) continue;
    auto* m = response->add_models();
    m->set_name(model->name);
    m->set_version("1");
    m->set_state(model->ready() ? "READY" : "UNAVAILABLE");
    m->set_reason(model->reason);
  }
  return Answer(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::RepositoryModelLoad(
    grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest*,
    inference::RepositoryModelLoadResponse*) {
  return Answer(context, absl::UnimplementedError(
                             "RepositoryModelLoad: attnserve loads its models at startup "
                             "(--model-repository); restart the server to change them"));
}

grpc::ServerUnaryReactor* KServeServiceImpl::RepositoryModelUnload(
    grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest*,
    inference::RepositoryModelUnloadResponse*) {
  return Answer(context, absl::UnimplementedError(
                             "RepositoryModelUnload: attnserve loads its models at startup "
                             "(--model-repository); restart the server to change them"));
}

grpc::ServerUnaryReactor* KServeServiceImpl::SystemSharedMemoryStatus(
    grpc::CallbackServerContext* context, const inference::SystemSharedMemoryStatusRequest*,
    inference::SystemSharedMemoryStatusResponse*) {
  return Answer(context, absl::UnimplementedError(
                             "SystemSharedMemoryStatus: attnserve has no shared-memory "
                             "extension; send tensors in the request (raw_input_contents)"));
}

grpc::ServerUnaryReactor* KServeServiceImpl::CudaSharedMemoryStatus(
    grpc::CallbackServerContext* context, const inference::CudaSharedMemoryStatusRequest*,
    inference::CudaSharedMemoryStatusResponse*) {
  return Answer(context, absl::UnimplementedError(
                             "CudaSharedMemoryStatus: attnserve has no shared-memory "
                             "extension; send tensors in the request (raw_input_contents)"));
}

}  // namespace attnserve

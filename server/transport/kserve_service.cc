// GRPCInferenceService handlers: health, metadata, config, statistics,
// repository index, unary ModelInfer, and the call bookkeeping that graceful
// shutdown waits on. ModelStreamInfer's reactor is kserve_stream_reactor.cc.
#include "server/transport/kserve_service.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/model_config.pb.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"
#include "google/protobuf/text_format.h"
#include "server/models/model_config_codec.h"
#include "server/transport/attend_codec.h"
#include "server/transport/call_deadline.h"
#include "server/transport/kserve_stream_reactor.h"
#include "server/transport/protobuf_log.h"
#include "server/transport/status_util.h"

#ifndef ATTNSERVE_VERSION
#define ATTNSERVE_VERSION "unknown"
#endif

namespace attnserve {
namespace {

// Triton's name for the model platform field; the engine is in `backend`.
constexpr char kPlatform[] = "attnserve";

// One input or output as ModelMetadata and ModelConfig describe it.
struct TensorSpec {
  const char* name;
  const char* datatype;
  inference::DataType type;
  Shape dims;  // -1 = any size
  bool optional = false;
};

int64_t DimOrAny(int64_t d) { return d > 0 ? d : -1; }

// Float inputs are reported as FP32 (the type perf_analyzer generates); FP16
// and BF16 are accepted too, and the outputs follow the query's type.
std::vector<TensorSpec> InputSpecs(const LayerConfig& c) {
  const Shape any4 = {-1, -1, -1, -1};
  if (!c.has_projections) {
    return {{"query", "FP32", inference::TYPE_FP32, any4},
            {"key", "FP32", inference::TYPE_FP32, any4},
            {"value", "FP32", inference::TYPE_FP32, any4},
            {"attn_mask", "BOOL", inference::TYPE_BOOL, any4, true},
            {"key_lengths", "INT64", inference::TYPE_INT64, {-1}, true}};
  }
  // Key and value may be left out for self-attention when widths allow.
  const bool self = c.key_dim == c.query_dim && c.value_dim == c.query_dim;
  return {{"query", "FP32", inference::TYPE_FP32, {-1, -1, DimOrAny(c.query_dim)}},
          {"key", "FP32", inference::TYPE_FP32, {-1, -1, DimOrAny(c.key_dim)}, self},
          {"value", "FP32", inference::TYPE_FP32, {-1, -1, DimOrAny(c.value_dim)}, self},
          {"attn_mask", "BOOL", inference::TYPE_BOOL, any4, true},
          {"key_lengths", "INT64", inference::TYPE_INT64, {-1}, true}};
}

// `weights` is [B, Hq, Lq, Lk] ([B, Lq, Lk] with average_weights).
std::vector<TensorSpec> OutputSpecs(const LayerConfig& c) {
  const Shape any4 = {-1, -1, -1, -1};
  if (!c.has_projections) {
    return {{"output", "FP32", inference::TYPE_FP32, any4},
            {"weights", "FP32", inference::TYPE_FP32, any4}};
  }
  return {{"output", "FP32", inference::TYPE_FP32, {-1, -1, DimOrAny(c.out_dim)}},
          {"weights", "FP32", inference::TYPE_FP32, {-1, DimOrAny(c.num_heads), -1, -1}}};
}

// attnserve's own config fields, as text: "kind", "num_heads",
// "batching.max_queue_delay_us", ... (set fields only).
void AddConfigParameters(const google::protobuf::Message& message, const std::string& prefix,
                         inference::ModelConfig* config) {
  const google::protobuf::Reflection* reflection = message.GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(message, &fields);
  for (const google::protobuf::FieldDescriptor* field : fields) {
    const std::string name = prefix + field->name();
    // Maps (tensor_names) are weight-file details; the name is the config's own.
    if (field->is_repeated() || name == "name") continue;
    if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) {
      AddConfigParameters(reflection->GetMessage(message, field), name + ".", config);
      continue;
    }
    std::string text;
    google::protobuf::TextFormat::PrintFieldValueToString(message, field, -1, &text);
    if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_STRING &&
        text.size() >= 2) {
      text = text.substr(1, text.size() - 2);  // unquote
    }
    (*config->mutable_parameters())[name].set_string_value(text);
  }
}

grpc::ServerUnaryReactor* FinishWith(grpc::CallbackServerContext* context,
                                     const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

// The model a metadata call names (empty = the default model) at a version
// attnserve serves.
absl::StatusOr<std::shared_ptr<const ServedModel>> FindModel(const ModelRegistry& registry,
                                                             const std::string& name,
                                                             const std::string& version) {
  absl::StatusOr<std::shared_ptr<const ServedModel>> model = registry.Find(name);
  if (!model.ok()) return model.status();
  if (absl::Status s = CheckModelVersion((*model)->name, version); !s.ok()) return s;
  return model;
}

void FillStatistics(const ServedModel& model, Metrics* metrics, inference::ModelStatistics* out) {
  out->set_name(model.name);
  out->set_version(kKServeModelVersion);
  if (metrics == nullptr) return;
  const ModelStatisticsSnapshot s = metrics->ForModel(model.name)->Statistics();
  out->set_last_inference(s.last_inference_ms);
  out->set_inference_count(s.inference_count);
  out->set_execution_count(s.execution_count);
  inference::InferStatistics* stats = out->mutable_inference_stats();
  auto set = [](const ModelStatisticsSnapshot::Duration& d, inference::StatisticDuration* to) {
    to->set_count(d.count);
    to->set_ns(d.ns);
  };
  set(s.success, stats->mutable_success());
  set(s.fail, stats->mutable_fail());
  set(s.queue, stats->mutable_queue());
  set(s.compute, stats->mutable_compute_infer());
  // Inputs are read in place and outputs written in place: no separate
  // input/output stages. Their counts follow compute_infer's so that clients
  // that divide by them see 0 ns, not a division by zero.
  stats->mutable_compute_input()->set_count(s.compute.count);
  stats->mutable_compute_output()->set_count(s.compute.count);
}

}  // namespace

KServeServiceImpl::KServeServiceImpl(const ModelRegistry* registry, RequestDispatcher* dispatcher,
                                     Metrics* metrics, KServeServiceOptions options)
    : registry_(registry),
      dispatcher_(dispatcher),
      metrics_(metrics),
      options_(std::move(options)) {
  InstallProtobufLogHandler();
}

// ---------------------------------------------------------------- health

grpc::ServerUnaryReactor* KServeServiceImpl::ServerLive(grpc::CallbackServerContext* context,
                                                        const inference::ServerLiveRequest*,
                                                        inference::ServerLiveResponse* response) {
  response->set_live(true);
  return FinishWith(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::ServerReady(
    grpc::CallbackServerContext* context, const inference::ServerReadyRequest*,
    inference::ServerReadyResponse* response) {
  response->set_ready(!shutting_down_.load());
  return FinishWith(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::ModelReady(grpc::CallbackServerContext* context,
                                                        const inference::ModelReadyRequest* request,
                                                        inference::ModelReadyResponse* response) {
  // Unknown model or version: not ready, not an error (Triton's answer).
  absl::StatusOr<std::shared_ptr<const ServedModel>> model =
      FindModel(*registry_, request->name(), request->version());
  response->set_ready(model.ok() && (*model)->ready() && !shutting_down_.load());
  return FinishWith(context, absl::OkStatus());
}

// ---------------------------------------------------------------- metadata

grpc::ServerUnaryReactor* KServeServiceImpl::ServerMetadata(
    grpc::CallbackServerContext* context, const inference::ServerMetadataRequest*,
    inference::ServerMetadataResponse* response) {
  response->set_name("attnserve");
  response->set_version(options_.server_version.empty() ? ATTNSERVE_VERSION
                                                        : options_.server_version);
  for (const char* extension : {"model_configuration", "statistics", "parameters"}) {
    response->add_extensions(extension);
  }
  return FinishWith(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::ModelMetadata(
    grpc::CallbackServerContext* context, const inference::ModelMetadataRequest* request,
    inference::ModelMetadataResponse* response) {
  absl::StatusOr<std::shared_ptr<const ServedModel>> model =
      FindModel(*registry_, request->name(), request->version());
  if (!model.ok()) return FinishWith(context, model.status());
  const LayerConfig layer = ToLayerConfig(*(*model)->config);
  response->set_name((*model)->name);
  response->add_versions(kKServeModelVersion);
  response->set_platform(kPlatform);
  for (const TensorSpec& spec : InputSpecs(layer)) {
    auto* t = response->add_inputs();
    t->set_name(spec.name);
    t->set_datatype(spec.datatype);
    t->mutable_shape()->Assign(spec.dims.begin(), spec.dims.end());
  }
  for (const TensorSpec& spec : OutputSpecs(layer)) {
    auto* t = response->add_outputs();
    t->set_name(spec.name);
    t->set_datatype(spec.datatype);
    t->mutable_shape()->Assign(spec.dims.begin(), spec.dims.end());
  }
  return FinishWith(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::ModelConfig(
    grpc::CallbackServerContext* context, const inference::ModelConfigRequest* request,
    inference::ModelConfigResponse* response) {
  absl::StatusOr<std::shared_ptr<const ServedModel>> model =
      FindModel(*registry_, request->name(), request->version());
  if (!model.ok()) return FinishWith(context, model.status());
  const ServedModel& served = **model;
  const LayerConfig layer = ToLayerConfig(*served.config);
  inference::ModelConfig* config = response->mutable_config();
  config->set_name(served.name);
  config->set_platform(kPlatform);
  if (served.engine != nullptr) config->set_backend(std::string(served.engine->name()));
  // Inputs carry their own batch dimension; the server batches requests.
  config->set_max_batch_size(0);
  for (const TensorSpec& spec : InputSpecs(layer)) {
    auto* t = config->add_input();
    t->set_name(spec.name);
    t->set_data_type(spec.type);
    t->mutable_dims()->Assign(spec.dims.begin(), spec.dims.end());
    t->set_optional(spec.optional);
  }
  for (const TensorSpec& spec : OutputSpecs(layer)) {
    auto* t = config->add_output();
    t->set_name(spec.name);
    t->set_data_type(spec.type);
    t->mutable_dims()->Assign(spec.dims.begin(), spec.dims.end());
  }
  AddConfigParameters(*served.config, "", config);
  return FinishWith(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::ModelStatistics(
    grpc::CallbackServerContext* context, const inference::ModelStatisticsRequest* request,
    inference::ModelStatisticsResponse* response) {
  if (request->name().empty()) {
    // Every model (Triton: "if not given returns statistics for all models").
    for (const auto& model : registry_->List()) {
      FillStatistics(*model, metrics_, response->add_model_stats());
    }
    return FinishWith(context, absl::OkStatus());
  }
  absl::StatusOr<std::shared_ptr<const ServedModel>> model =
      FindModel(*registry_, request->name(), request->version());
  if (!model.ok()) return FinishWith(context, model.status());
  FillStatistics(**model, metrics_, response->add_model_stats());
  return FinishWith(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::RepositoryIndex(
    grpc::CallbackServerContext* context, const inference::RepositoryIndexRequest* request,
    inference::RepositoryIndexResponse* response) {
  for (const auto& model : registry_->List()) {
    if (request->ready() && !model->ready()) continue;
    auto* entry = response->add_models();
    entry->set_name(model->name);
    entry->set_version(kKServeModelVersion);
    entry->set_state(model->ready() ? "READY" : "UNAVAILABLE");
    entry->set_reason(model->reason);
  }
  return FinishWith(context, absl::OkStatus());
}

grpc::ServerUnaryReactor* KServeServiceImpl::RepositoryModelLoad(
    grpc::CallbackServerContext* context, const inference::RepositoryModelLoadRequest*,
    inference::RepositoryModelLoadResponse*) {
  return FinishWith(context, absl::UnimplementedError(
                                 "RepositoryModelLoad: attnserve loads its models once, at "
                                 "startup (--model-repository); restart it to change them"));
}

grpc::ServerUnaryReactor* KServeServiceImpl::RepositoryModelUnload(
    grpc::CallbackServerContext* context, const inference::RepositoryModelUnloadRequest*,
    inference::RepositoryModelUnloadResponse*) {
  return FinishWith(context, absl::UnimplementedError(
                                 "RepositoryModelUnload: attnserve loads its models once, at "
                                 "startup (--model-repository); restart it to change them"));
}

// ---------------------------------------------------------------- inference

void KServeServiceImpl::StartInfer(grpc::CallbackServerContext* context,
                                   const absl::Status& parsed,
                                   const inference::ModelInferRequest& request,
                                   KServeInferInputs* decoded,
                                   inference::ModelInferResponse* response, std::string* scratch,
                                   absl::AnyInvocable<void(absl::Status)> done) {
  Clock* const clock = dispatcher_->clock();
  auto r = std::make_unique<InferenceRequest>();
  r->id = request.id();
  r->received = clock->Now();
  r->deadline = ServerDeadline(*context, *clock);
  r->is_cancelled = [context] { return context->IsCancelled(); };
  response->set_id(request.id());
  response->set_model_name(request.model_name());
  r->done = [done = std::move(done), response](absl::Status status,
                                                const InferenceRequest& r) mutable {
    // The model that ran (the default model's name when none was named).
    if (r.model != nullptr) response->set_model_name(r.model->name);
    if (status.ok()) response->set_model_version(kKServeModelVersion);
    done(std::move(status));
  };
  if (shutting_down_.load()) {
    dispatcher_->Reject(std::move(r),
                        absl::UnavailableError("server is shutting down; not accepting requests"));
    return;
  }
  if (!parsed.ok()) {
    dispatcher_->Reject(std::move(r), parsed);
    return;
  }
  DecodeModelInferRequest(request, decoded);
  if (decoded->timeout != absl::InfiniteDuration()) {
    r->deadline = std::min(r->deadline, r->received + decoded->timeout);
  }
  dispatcher_->Submit(std::move(r), decoded->inputs,
                      [decoded, response, scratch](OutputName name, DType dtype,
                                                   const Shape& shape) {
                        return AllocateKServeOutput(*decoded, response, scratch, name, dtype,
                                                    shape);
                      });
}

// Finishes from the request's completion; OnCancel asks the dispatcher to
// drop the queued request at once.
class KServeServiceImpl::InferReactor final : public grpc::ServerUnaryReactor {
 public:
  InferReactor(KServeServiceImpl* service, const grpc::ByteBuffer* request_bytes)
      : service_(service),
        // gRPC owns the buffer until OnDone; releasing it now keeps one copy
        // of the inputs, not two.
        parsed_(ParseMessage(const_cast<grpc::ByteBuffer*>(request_bytes), "request", 0,
                             &request_)),
        model_(request_.model_name()),
        counted_(service->CallStarted()) {}

  void Start(grpc::CallbackServerContext* context, grpc::ByteBuffer* response_bytes) {
    service_->StartInfer(context, parsed_, request_, &decoded_, &response_, &scratch_,
                         [this, response_bytes](absl::Status status) {
                           if (status.ok()) {
                             status = SerializeMessage(response_, response_bytes);
                           }
                           Finish(ToGrpcStatus(status));
                         });
  }

  void OnCancel() override { service_->dispatcher_->Cancelled(model_); }
  void OnDone() override {
    KServeServiceImpl* service = service_;
    const bool counted = counted_;
    delete this;
    if (counted) service->CallDone();
  }

 private:
  KServeServiceImpl* const service_;
  inference::ModelInferRequest request_;
  KServeInferInputs decoded_;
  inference::ModelInferResponse response_;
  std::string scratch_;
  const absl::Status parsed_;
  const std::string model_;
  const bool counted_;
};

grpc::ServerUnaryReactor* KServeServiceImpl::ModelInfer(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  auto* reactor = new InferReactor(this, request);
  reactor->Start(context, response);
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* KServeServiceImpl::ModelStreamInfer(
    grpc::CallbackServerContext* context) {
  return new KServeStreamReactor(this, context);
}

// ------------------------------------------------------ call bookkeeping

void KServeServiceImpl::AddStream(KServeStreamReactor* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.insert(stream);
  if (shutting_down_.load()) stream->ServerShutdown();
}

void KServeServiceImpl::RemoveStream(KServeStreamReactor* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.erase(stream);
}

bool KServeServiceImpl::CallStarted() {
  absl::MutexLock lock(&calls_mu_);
  if (shutting_down_.load()) return false;
  ++open_calls_;
  return true;
}

void KServeServiceImpl::CallDone() {
  absl::MutexLock lock(&calls_mu_);
  --open_calls_;
}

bool KServeServiceImpl::WaitForNoCalls(absl::Duration timeout) {
  absl::MutexLock lock(&calls_mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) { return open_calls_ == 0; };
  return calls_mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

void KServeServiceImpl::BeginShutdown() {
  {
    absl::MutexLock lock(&calls_mu_);
    shutting_down_.store(true);
  }
  absl::MutexLock lock(&streams_mu_);
  for (KServeStreamReactor* stream : streams_) stream->ServerShutdown();
}

}  // namespace attnserve

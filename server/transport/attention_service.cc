// AttentionService handlers: unary Attend, model listing, and the call
// bookkeeping that graceful shutdown waits on. AttendStream's reactor is in
// attend_stream_reactor.cc.
#include "server/transport/attention_service.h"

#include <chrono>
#include <memory>
#include <string>
#include <utility>

#include "attnserve/v1/model_config.pb.h"
#include "server/transport/attend_codec.h"
#include "server/transport/attend_stream_reactor.h"
#include "server/transport/protobuf_log.h"
#include "server/transport/status_util.h"

namespace attnserve {
namespace {

// The call's deadline on the server's clock; InfiniteFuture when there is
// none (gRPC reports "none" as a far-future wall time). gRPC states
// deadlines in wall time: this is the one place that reads it.
absl::Time ServerDeadline(const grpc::CallbackServerContext& context, const Clock& clock) {
  const auto wall_deadline = context.deadline();
  const auto wall_now = std::chrono::system_clock::now();
  if (wall_deadline >= wall_now + std::chrono::hours(24 * 365)) return absl::InfiniteFuture();
  return clock.Now() + absl::FromChrono(wall_deadline - wall_now);
}

v1::ModelStatus ToModelStatus(const ServedModel& model, const std::string& default_name) {
  v1::ModelStatus status;
  status.set_name(model.name);
  *status.mutable_config() = *model.config;
  status.set_state(model.ready() ? v1::ModelStatus::READY : v1::ModelStatus::FAILED);
  status.set_reason(model.reason);
  if (model.engine != nullptr) status.set_backend(std::string(model.engine->name()));
  status.set_is_default(model.name == default_name);
  return status;
}

}  // namespace

AttentionServiceImpl::AttentionServiceImpl(const ModelRegistry* registry,
                                           RequestDispatcher* dispatcher, Metrics* metrics,
                                           AttentionServiceOptions options)
    : registry_(registry),
      dispatcher_(dispatcher),
      metrics_(metrics),
      options_(std::move(options)) {
  InstallProtobufLogHandler();
}

void AttentionServiceImpl::StartAttend(grpc::CallbackServerContext* context,
                                       const absl::Status& parsed,
                                       const v1::AttendRequest& request,
                                       v1::AttendResponse* response,
                                       absl::AnyInvocable<void(absl::Status)> done) {
  Clock* const clock = dispatcher_->clock();
  auto r = std::make_unique<InferenceRequest>();
  r->id = request.id();
  r->received = clock->Now();
  r->deadline = ServerDeadline(*context, *clock);
  r->is_cancelled = [context] { return context->IsCancelled(); };
  response->set_id(request.id());
  r->done = [done = std::move(done), response, clock](absl::Status status,
                                                      const InferenceRequest& r) mutable {
    if (status.ok()) SetTiming(r, clock->Now(), response);
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
  dispatcher_->Submit(std::move(r), DecodeAttendRequest(request),
                      [response](OutputName name, DType dtype, const Shape& shape) {
                        return AllocateAttendOutput(response, name, dtype, shape);
                      });
}

// ---------------------------------------------------------------- Attend

// Finishes from the request's completion; OnCancel asks the dispatcher to
// drop the queued request at once instead of when its batch would close.
class AttentionServiceImpl::UnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  // Parses `request_bytes` (and frees them, as gRPC's generated handler
  // would have after parsing).
  UnaryReactor(AttentionServiceImpl* service, const grpc::ByteBuffer* request_bytes)
      : service_(service),
        // gRPC owns the (non-const) buffer until OnDone and only frees it
        // then; releasing it now keeps one copy of the inputs, not two.
        parsed_(ParseAttendRequest(const_cast<grpc::ByteBuffer*>(request_bytes), "request", 0,
                                   &request_)),
        model_(request_.model()),
        counted_(service->CallStarted()) {
    if (!parsed_.ok()) service_->CountUnparseable("Attend");
  }

  void Start(grpc::CallbackServerContext* context, grpc::ByteBuffer* response_bytes) {
    // request_, response_, context and response_bytes stay valid until
    // OnDone: gRPC frees its part only after the reactor is done.
    service_->StartAttend(context, parsed_, request_, &response_,
                          [this, response_bytes](absl::Status status) {
                            // request_ and response_ are freed in OnDone, as
                            // gRPC freed its messages: not while the client
                            // waits for the answer.
                            if (status.ok()) status = SerializeMessage(response_, response_bytes);
                            Finish(ToGrpcStatus(status));
                          });
  }

  void OnCancel() override { service_->dispatcher_->Cancelled(model_); }
  void OnDone() override {
    AttentionServiceImpl* service = service_;
    const bool counted = counted_;
    delete this;
    if (counted) service->CallDone();
  }

 private:
  AttentionServiceImpl* const service_;
  v1::AttendRequest request_;
  v1::AttendResponse response_;
  const absl::Status parsed_;
  const std::string model_;  // as the client named it
  const bool counted_;       // opened before shutdown: shutdown waits for it
};

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  auto* reactor = new UnaryReactor(this, request);
  reactor->Start(context, response);
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionServiceImpl::AttendStream(grpc::CallbackServerContext* context) {
  return new AttendStreamReactor(this, context);
}

// ------------------------------------------------------ call bookkeeping

void AttentionServiceImpl::AddStream(AttendStreamReactor* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.insert(stream);
  // A stream opened after shutdown began: drain (and so end) it at once.
  if (shutting_down_.load()) stream->ServerShutdown();
}

void AttentionServiceImpl::RemoveStream(AttendStreamReactor* stream) {
  absl::MutexLock lock(&streams_mu_);
  streams_.erase(stream);
}

bool AttentionServiceImpl::CallStarted() {
  absl::MutexLock lock(&calls_mu_);
  if (shutting_down_.load()) return false;
  ++open_calls_;
  return true;
}

void AttentionServiceImpl::CallDone() {
  absl::MutexLock lock(&calls_mu_);
  --open_calls_;
}

bool AttentionServiceImpl::WaitForNoCalls(absl::Duration timeout) {
  absl::MutexLock lock(&calls_mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(calls_mu_) { return open_calls_ == 0; };
  return calls_mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

void AttentionServiceImpl::BeginShutdown() {
  {
    // Under calls_mu_: a call is either counted or sees the flag.
    absl::MutexLock lock(&calls_mu_);
    shutting_down_.store(true);
  }
  absl::MutexLock lock(&streams_mu_);
  for (AttendStreamReactor* stream : streams_) stream->ServerShutdown();
}

// ---------------------------------------------------------------- models

void AttentionServiceImpl::CountUnparseable(absl::string_view method) {
  if (metrics_ != nullptr) metrics_->UnparseableMessage(method);
}

namespace {

// Parses a model RPC's request; on failure finishes `reactor` with the
// parse error and returns false.
bool ParseModelRequest(const grpc::ByteBuffer* bytes, google::protobuf::MessageLite* request,
                       grpc::ServerUnaryReactor* reactor) {
  // gRPC owns the buffer until the call is done; parsing releases its
  // slices early, as for Attend.
  const absl::Status parsed =
      ParseMessage(const_cast<grpc::ByteBuffer*>(bytes), "request", 0, request);
  if (parsed.ok()) return true;
  reactor->Finish(ToGrpcStatus(parsed));
  return false;
}

// Serializes `message` as the call's answer and finishes.
void FinishWith(const google::protobuf::MessageLite& message, grpc::ByteBuffer* response,
                grpc::ServerUnaryReactor* reactor) {
  reactor->Finish(ToGrpcStatus(SerializeMessage(message, response)));
}

}  // namespace

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request_bytes,
                                                           grpc::ByteBuffer* response_bytes) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  v1::ListModelsRequest request;
  if (!ParseModelRequest(request_bytes, &request, reactor)) {
    CountUnparseable("ListModels");
    return reactor;
  }
  v1::ListModelsResponse response;
  const std::string default_name = registry_->default_model();
  for (const auto& model : registry_->List()) {
    *response.add_models() = ToModelStatus(*model, default_name);
  }
  FinishWith(response, response_bytes, reactor);
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request_bytes,
                                                         grpc::ByteBuffer* response_bytes) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  v1::GetModelRequest request;
  if (!ParseModelRequest(request_bytes, &request, reactor)) {
    CountUnparseable("GetModel");
    return reactor;
  }
  absl::StatusOr<std::shared_ptr<const ServedModel>> model = registry_->Find(request.name());
  if (!model.ok()) {
    reactor->Finish(ToGrpcStatus(model.status()));
  } else {
    FinishWith(ToModelStatus(**model, registry_->default_model()), response_bytes, reactor);
  }
  return reactor;
}

}  // namespace attnserve

// AttentionService handlers: unary Attend, model listing, and the call
// AttendStream's messages; the stream's reads, writes and flow control are
// stream_reactor.cc, the shutdown bookkeeping call_tracker.cc.
#include "server/transport/attention_service.h"

#include <memory>
#include <string>
#include <utility>

#include "attnserve/v1/model_config.pb.h"
#include "server/transport/attend_codec.h"
#include "server/transport/message_codec.h"
#include "server/transport/protobuf_log.h"
#include "server/transport/server_deadline.h"
#include "server/transport/status_util.h"

namespace attnserve {
namespace {

AttentionServiceOptions WithRequestMemory(AttentionServiceOptions options) {
  if (options.request_memory == nullptr) options.request_memory = HostBufferPool::Ordinary();
  if (options.payload_copier == nullptr) {
    options.payload_copier = std::make_shared<PayloadCopier>(PayloadCopier::DefaultHelpers());
  }
  return options;
}

v1::ModelStatus ToModelStatus(const ServedModel& model, const std::string& default_name) {
  v1::ModelStatus status;
  status.set_name(model.name);
  *status.mutable_config() = *model.config;
  switch (model.state) {
    case ModelState::kReady: status.set_state(v1::ModelStatus::READY); break;
    case ModelState::kFailed: status.set_state(v1::ModelStatus::FAILED); break;
    case ModelState::kUnloaded: status.set_state(v1::ModelStatus::UNLOADED); break;
  }
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
      options_(WithRequestMemory(std::move(options))) {
  InstallProtobufLogHandler();
}

void AttentionServiceImpl::StartAttend(grpc::CallbackServerContext* context,
                                       absl::Time received, const absl::Status& parsed,
                                       const ModelAccess& access,
                                       const v1::AttendRequest& request,
                                       const AttendPayloads& payloads,
                                       v1::AttendResponse* response, AttendResults* results,
                                       absl::AnyInvocable<void(absl::Status)> done) {
  Clock* const clock = dispatcher_->clock();
  auto r = std::make_unique<InferenceRequest>();
  r->id = request.id();
  r->received = received;
  r->deadline = ServerDeadline(*context, *clock);
  r->is_cancelled = [context] { return context->IsCancelled(); };
  r->access = access;
  response->set_id(request.id());
  r->done = [done = std::move(done), response, clock](absl::Status status,
                                                      const InferenceRequest& r) mutable {
    if (status.ok()) {
      SetTiming(r, clock->Now(), response);
      if (!r.session_id.empty()) response->set_session_length(r.session_length);
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
  HostBufferPool& memory = *options_.request_memory;
  dispatcher_->Submit(std::move(r), DecodeAttendRequest(request, &payloads),
                      [response, results, &memory](OutputName name, DType dtype,
                                                   const Shape& shape) {
                        return name == OutputName::kOutput
                                   ? AllocateResult(memory, dtype, shape,
                                                    response->mutable_output(), &results->output)
                                   : AllocateResult(memory, dtype, shape,
                                                    response->mutable_weights(),
                                                    &results->weights);
                      });
}

// ---------------------------------------------------------------- Attend

// Finishes from the request's completion; OnCancel asks the dispatcher to
// drop the queued request at once instead of when its batch would close.
class AttentionServiceImpl::UnaryReactor final : public grpc::ServerUnaryReactor {
 public:
  // Authenticates the call, then parses `request_bytes` (and frees them, as
  // gRPC's generated handler would have after parsing); an unauthenticated
  // call's bytes are never parsed.
  UnaryReactor(AttentionServiceImpl* service, const grpc::CallbackServerContext& context,
               const grpc::ByteBuffer* request_bytes)
      : service_(service),
        received_(service->dispatcher_->clock()->Now()),
        access_(CallAccess(service->options_.tokens, context)),
        // gRPC owns the (non-const) buffer until OnDone and only frees it
        // then; releasing it now keeps one copy of the inputs, not two.
        parsed_(access_.ok()
                    ? ParseAttendRequest(const_cast<grpc::ByteBuffer*>(request_bytes), "request",
                                         0, *service->options_.request_memory,
                                         *service->options_.payload_copier, &request_,
                                         &payloads_)
                    : access_.status()),
        model_(request_.model()),
        counted_(service->calls_.CallStarted()) {
    if (access_.ok() && !parsed_.ok()) service_->CountUnparseable("Attend");
  }

  void Start(grpc::CallbackServerContext* context, grpc::ByteBuffer* response_bytes) {
    // request_, payloads_, response_, context and response_bytes stay valid
    // until OnDone: gRPC frees its part only after the reactor is done.
    service_->StartAttend(context, received_, parsed_,
                          access_.ok() ? *access_ : ModelAccess::None(), request_, payloads_,
                          &response_, &results_,
                          [this, response_bytes](absl::Status status) {
                            // request_ and response_ are freed in OnDone, as
                            // gRPC freed its messages: not while the client
                            // waits for the answer.
                            if (status.ok()) {
                              status = SerializeAttendResponse(response_, std::move(results_),
                                                               response_bytes);
                            }
                            Finish(ToGrpcStatus(status));
                          });
  }

  void OnCancel() override { service_->dispatcher_->Cancelled(model_); }
  void OnDone() override {
    AttentionServiceImpl* service = service_;
    const bool counted = counted_;
    delete this;
    if (counted) service->calls_.CallDone();
  }

 private:
  AttentionServiceImpl* const service_;
  const absl::Time received_;  // before the parse: timing.total_us counts it
  const absl::StatusOr<ModelAccess> access_;
  v1::AttendRequest request_;
  AttendPayloads payloads_;  // request_'s tensors' bytes (attend_wire.h)
  v1::AttendResponse response_;
  AttendResults results_;  // response_'s tensors' bytes (attend_wire.h)
  const absl::Status parsed_;
  const std::string model_;  // as the client named it
  const bool counted_;       // opened before shutdown: shutdown waits for it
};

grpc::ServerUnaryReactor* AttentionServiceImpl::Attend(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request,
                                                       grpc::ByteBuffer* response) {
  auto* reactor = new UnaryReactor(this, *context, request);
  reactor->Start(context, response);
  return reactor;
}

grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttentionServiceImpl::AttendStream(
    grpc::CallbackServerContext* context) {
  // An unauthenticated stream ends before its first read.
  if (absl::StatusOr<ModelAccess> access = CallAccess(options_.tokens, *context); !access.ok()) {
    return FinishedStream(ToGrpcStatus(access.status()));
  }
  return new StreamReactor(&calls_, this, context, options_.max_stream_backlog);
}

// ---------------------------------------------------------- AttendStream

void AttentionServiceImpl::StartStreamMessage(grpc::CallbackServerContext* context,
                                              grpc::ByteBuffer* bytes, int64_t number,
                                              AnswerFn answer) {
  // The message's tensors must outlive its request: parse it into its own
  // state (the one copy of the bytes, into request memory), which the
  // completion owns (it may even run before StartAttend returns).
  struct Message {
    v1::AttendRequest request;
    AttendPayloads payloads;
    v1::AttendStreamResponse answer;
    AttendResults results;
  };
  auto* message = new Message;
  const absl::Time received = dispatcher_->clock()->Now();
  const absl::Status parsed =
      ParseAttendRequest(bytes, "AttendStream message", number, *options_.request_memory,
                         *options_.payload_copier, &message->request, &message->payloads);
  if (!parsed.ok()) CountUnparseable("AttendStream");
  message->answer.set_id(message->request.id());
  // The stream was authenticated when it opened (AttendStream); its access
  // is the same for every message.
  absl::StatusOr<ModelAccess> access = CallAccess(options_.tokens, *context);
  StartAttend(context, received, access.ok() ? parsed : access.status(),
              access.ok() ? *access : ModelAccess::None(), message->request, message->payloads,
              message->answer.mutable_response(), &message->results,
              [message, answer = std::move(answer)](absl::Status status) mutable {
                std::unique_ptr<Message> owned(message);
                // Inputs no longer needed; free them now.
                owned->request.Clear();
                owned->payloads = AttendPayloads();
                if (!status.ok()) {
                  owned->answer.clear_response();
                  owned->results = AttendResults();
                  owned->answer.set_code(static_cast<int>(status.code()));
                  owned->answer.set_message(ToGrpcStatus(status).error_message());
                }
                grpc::ByteBuffer bytes;
                if (absl::Status s = SerializeAttendStreamResponse(
                        owned->answer, std::move(owned->results), &bytes);
                    !s.ok()) {
                  // Over protobuf's size limit: answer the error instead.
                  owned->answer.clear_response();
                  owned->answer.set_code(static_cast<int>(s.code()));
                  owned->answer.set_message(ToGrpcStatus(s).error_message());
                  SerializeMessage(owned->answer, &bytes).IgnoreError();
                }
                answer(std::move(bytes));
              });
}

void AttentionServiceImpl::StreamCancelled() { dispatcher_->CancelledOnAnyModel(); }

// ------------------------------------------------------------- shutdown

bool AttentionServiceImpl::WaitForNoCalls(absl::Duration timeout) {
  return calls_.WaitForNoCalls(timeout);
}

void AttentionServiceImpl::BeginShutdown() { calls_.BeginShutdown(); }

// ---------------------------------------------------------------- models

void AttentionServiceImpl::CountUnparseable(absl::string_view method) {
  if (metrics_ != nullptr) metrics_->UnparseableMessage(method);
}

// The unary RPCs besides Attend take raw bytes too. The call is
// authenticated first (UNAUTHENTICATED, its bytes never parsed); then
// `handle` runs on the parsed request; an unparseable one is answered
// INVALID_ARGUMENT ("request could not be parsed as
// attnserve.v1.GetModelRequest: ..."), counted under `method` and never
// logged, where gRPC's own parse answered UNIMPLEMENTED with no message and
// wrote a libprotobuf ERROR line.
template <typename Request, typename Response, typename Handle>
grpc::ServerUnaryReactor* AttentionServiceImpl::RawUnary(grpc::CallbackServerContext* context,
                                                         absl::string_view method,
                                                         const grpc::ByteBuffer* request_bytes,
                                                         grpc::ByteBuffer* response_bytes,
                                                         Handle handle) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  absl::StatusOr<ModelAccess> access = CallAccess(options_.tokens, *context);
  if (!access.ok()) {
    reactor->Finish(ToGrpcStatus(access.status()));
    return reactor;
  }
  Request request;
  // gRPC owns the buffer until the call is done; parsing releases its
  // slices early, as for Attend.
  absl::Status status = ParseRequestMessage(const_cast<grpc::ByteBuffer*>(request_bytes),
                                            "request", 0, &request);
  if (!status.ok()) {
    CountUnparseable(method);
    reactor->Finish(ToGrpcStatus(status));
    return reactor;
  }
  Response response;
  status = handle(*access, request, &response);
  if (status.ok()) status = SerializeMessage(response, response_bytes);
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* AttentionServiceImpl::ListModels(grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request,
                                                           grpc::ByteBuffer* response) {
  return RawUnary<v1::ListModelsRequest, v1::ListModelsResponse>(
      context, "ListModels", request, response,
      [this](const ModelAccess& access, const v1::ListModelsRequest&,
             v1::ListModelsResponse* out) {
        // A restricted token sees only the models it may use.
        const std::string default_name = registry_->default_model();
        for (const auto& model : registry_->List()) {
          if (access.Allows(model->name)) *out->add_models() = ToModelStatus(*model, default_name);
        }
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::GetModel(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request,
                                                         grpc::ByteBuffer* response) {
  return RawUnary<v1::GetModelRequest, v1::ModelStatus>(
      context, "GetModel", request, response,
      [this](const ModelAccess& access, const v1::GetModelRequest& in,
             v1::ModelStatus* out) -> absl::Status {
        // Checked on the name first: PERMISSION_DENIED whether or not the
        // model exists, so a restricted token cannot probe for names.
        if (absl::Status s = access.Check(in.name(), [this] { return registry_->default_model(); });
            !s.ok()) {
          return s;
        }
        absl::StatusOr<std::shared_ptr<const ServedModel>> model = registry_->Find(in.name());
        if (!model.ok()) return model.status();
        *out = ToModelStatus(**model, registry_->default_model());
        return absl::OkStatus();
      });
}

// -------------------------------------------------------------- sessions

namespace {

absl::Duration FromProto(const google::protobuf::Duration& d) {
  return absl::Seconds(d.seconds()) + absl::Nanoseconds(d.nanos());
}

void ToProto(absl::Duration d, google::protobuf::Duration* out) {
  const int64_t seconds = absl::IDivDuration(d, absl::Seconds(1), &d);
  out->set_seconds(seconds);
  out->set_nanos(static_cast<int32_t>(absl::ToInt64Nanoseconds(d)));
}

}  // namespace

grpc::ServerUnaryReactor* AttentionServiceImpl::OpenSession(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* request,
                                                            grpc::ByteBuffer* response) {
  return RawUnary<v1::OpenSessionRequest, v1::OpenSessionResponse>(
      context, "OpenSession", request, response,
      [this](const ModelAccess& access, const v1::OpenSessionRequest& in,
             v1::OpenSessionResponse* out) -> absl::Status {
        if (calls_.shutting_down()) return absl::UnavailableError("server is shutting down");
        if (absl::Status s =
                access.Check(in.model(), [this] { return registry_->default_model(); });
            !s.ok()) {
          return s;
        }
        absl::StatusOr<OpenedSession> opened =
            dispatcher_->OpenSession(in.model(), FromProto(in.ttl()), in.max_tokens(),
                                     in.session_id());
        if (!opened.ok()) return opened.status();
        out->set_session_id(opened->id);
        out->set_model(opened->model);
        ToProto(opened->ttl, out->mutable_ttl());
        out->set_max_tokens(opened->max_tokens);
        out->set_block_tokens(opened->block_tokens);
        return absl::OkStatus();
      });
}

grpc::ServerUnaryReactor* AttentionServiceImpl::CloseSession(grpc::CallbackServerContext* context,
                                                             const grpc::ByteBuffer* request,
                                                             grpc::ByteBuffer* response) {
  return RawUnary<v1::CloseSessionRequest, v1::CloseSessionResponse>(
      context, "CloseSession", request, response,
      [this](const ModelAccess& access, const v1::CloseSessionRequest& in,
             v1::CloseSessionResponse* out) -> absl::Status {
        // A restricted token may close only sessions of models it may use.
        if (access.restricted()) {
          absl::StatusOr<std::string> model = dispatcher_->SessionModel(in.session_id());
          if (!model.ok()) return model.status();
          if (absl::Status s = access.Check(*model, [] { return std::string(); }); !s.ok()) {
            return s;
          }
        }
        absl::StatusOr<int64_t> released = dispatcher_->CloseSession(in.session_id());
        if (!released.ok()) return released.status();
        out->set_released_tokens(*released);
        return absl::OkStatus();
      });
}

}  // namespace attnserve

// attnserve.v1.AttentionService on gRPC's callback API: the attnserve.v1
// front end. Handlers return at once: Attend (and each AttendStream message,
// see stream_reactor.h) is parsed and translated (attend_codec.h) and
// handed to the shared RequestDispatcher, whose completion sends the answer.
#ifndef ATTNSERVE_SERVER_TRANSPORT_ATTENTION_SERVICE_H_
#define ATTNSERVE_SERVER_TRANSPORT_ATTENTION_SERVICE_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.grpc.pb.h"
#include "engine/host_buffer.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/dispatch/request_dispatcher.h"
#include "server/metrics/metrics.h"
#include "server/models/model_registry.h"
#include "server/request/model_access.h"
#include "server/transport/attend_wire.h"
#include "server/transport/bearer_tokens.h"
#include "server/transport/call_tracker.h"
#include "server/transport/payload_copier.h"
#include "server/transport/stream_reactor.h"

namespace attnserve {

struct AttentionServiceOptions {
  // AttendStream flow control: most responses one stream may owe at once
  // (requests being computed plus responses waiting to be written). At the
  // bound the server stops reading the stream until the client reads.
  // Default: 64.
  size_t max_stream_backlog = 64;
  // Bearer tokens every call must present (--auth-token-file); not owned,
  // must outlive the service. Null: no authentication. Default: null.
  const BearerTokens* tokens = nullptr;
  // Where Attend copies its tensors' bytes from the wire, and where the
  // engine writes its results for gRPC to send from (attend_wire.h): the
  // backend engine's request_memory(). Null: ordinary memory
  // (HostBufferPool::Ordinary()). Default: null.
  std::shared_ptr<HostBufferPool> request_memory;
  // Copies (and scans) the tensors' bytes into request_memory
  // (payload_copier.h); shared with the other front ends. Null: one with
  // PayloadCopier::DefaultHelpers() helpers. Default: null.
  std::shared_ptr<PayloadCopier> payload_copier;
};

// Attend and AttendStream take gRPC's raw bytes and parse them here, so that
// a message that is not a valid AttendRequest is answered like any other bad
// request (INVALID_ARGUMENT, counted in the metrics) instead of by gRPC
// (UNIMPLEMENTED for a unary call, a silent end of the stream with OK).
// The other unary RPCs take raw bytes for the same reason.
using AttentionServiceBase = v1::AttentionService::WithRawCallbackMethod_Attend<
    v1::AttentionService::WithRawCallbackMethod_AttendStream<
        v1::AttentionService::WithRawCallbackMethod_ListModels<
            v1::AttentionService::WithRawCallbackMethod_GetModel<
                v1::AttentionService::WithRawCallbackMethod_OpenSession<
                    v1::AttentionService::WithRawCallbackMethod_CloseSession<
                        v1::AttentionService::Service>>>>>>;

// Thread-safe (gRPC calls handlers concurrently). Does not own the registry
// or the dispatcher; both must outlive the grpc::Server this is registered
// with (i.e. until its Shutdown() has returned).
//
// Every request gets exactly one answer: the unary status, or one
// AttendStreamResponse per stream message carrying the request's id and its
// own status (a failed message does not end the stream). A message that
// cannot be parsed is answered INVALID_ARGUMENT naming it ("request", or
// "AttendStream message N", counting from 1; its answer's id is empty) and
// never reaches the dispatcher's model lookup or validation. An unparseable
// ListModels, GetModel, OpenSession or CloseSession request is answered
// INVALID_ARGUMENT ("request could not be parsed as
// attnserve.v1.GetModelRequest: ..."). Every unparseable message is counted
// in attnserve_unparseable_messages_total{method} and logs nothing.
//
// Authentication (options.tokens set): every call's `authorization` header is
// checked first (CallAccess). A unary call without a valid token is answered
// UNAUTHENTICATED without its message being parsed; an AttendStream ends
// UNAUTHENTICATED before its first read. A restricted token's ModelAccess
// travels on each InferenceRequest; the dispatcher answers
// PERMISSION_DENIED for a model outside it, per request and per stream
// message. ListModels lists only the models the token may use, and GetModel
// of any other name is PERMISSION_DENIED (existing or not, so a restricted
// token cannot probe for names).
//
// Constructing one installs the process's protobuf log handler
// (protobuf_log.h), so that clients' bytes cannot flood the log.
class AttentionServiceImpl final : public AttentionServiceBase, private StreamHandler {
 public:
  // `metrics` (nullable, not owned, must outlive this) receives the
  // unparseable-message counts.
  AttentionServiceImpl(const ModelRegistry* registry, RequestDispatcher* dispatcher,
                       Metrics* metrics, AttentionServiceOptions options = {});

  // `request` holds a serialized AttendRequest; `response` receives the
  // serialized AttendResponse.
  grpc::ServerUnaryReactor* Attend(grpc::CallbackServerContext* context,
                                   const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  // Reads serialized AttendRequests, writes serialized AttendStreamResponses.
  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* AttendStream(
      grpc::CallbackServerContext* context) override;
  // Serialized ListModelsRequest -> serialized ListModelsResponse.
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  // Serialized GetModelRequest -> serialized ModelStatus.
  grpc::ServerUnaryReactor* GetModel(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  // Sessions (RequestDispatcher::OpenSession / CloseSession), serialized
  // Open/CloseSessionRequest -> Response; UNAVAILABLE once shutdown has begun.
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const grpc::ByteBuffer* request,
                                         grpc::ByteBuffer* response) override;

  // From now on new requests (unary or stream messages) are answered
  // UNAVAILABLE; open streams stop reading and end (UNAVAILABLE) once every
  // request they accepted has been answered. Requests already accepted are
  // left to the scheduler to finish. Idempotent.
  void BeginShutdown();

  // Waits until every Attend and AttendStream call opened before
  // BeginShutdown is done (its answers handed to gRPC and sent), up to
  // `timeout`. True when they all are. Calls opened later are answered
  // UNAVAILABLE at once and not waited for, so a steady stream of newcomers
  // cannot hold shutdown up.
  bool WaitForNoCalls(absl::Duration timeout);

 private:
  class UnaryReactor;

  // StreamHandler: one AttendStream message, answered with its
  // AttendStreamResponse (the response, or its code and message).
  void StartStreamMessage(grpc::CallbackServerContext* context, grpc::ByteBuffer* bytes,
                          int64_t number, AnswerFn answer) override;
  void StreamCancelled() override;

  // Counts one message of `method` that could not be parsed.
  void CountUnparseable(absl::string_view method);
  // A unary RPC on raw bytes: authenticates the call (UNAUTHENTICATED
  // before any parsing), parses a Request (unparseable: counted,
  // INVALID_ARGUMENT), runs `handle(const ModelAccess&, const Request&,
  // Response*)` -> absl::Status and answers the serialized Response when it
  // is OK.
  template <typename Request, typename Response, typename Handle>
  grpc::ServerUnaryReactor* RawUnary(grpc::CallbackServerContext* context,
                                     absl::string_view method,
                                     const grpc::ByteBuffer* request_bytes,
                                     grpc::ByteBuffer* response_bytes, Handle handle);

  // Translates one AttendRequest and submits it; `parsed` is what
  // ParseRequestMessage said of it (or the authentication failure): not OK,
  // the request (empty) is refused with that status through the dispatcher
  // (counted, not run). `access`: the models the caller may use. `done` runs
  // exactly once with the final status (response->timing filled in when OK),
  // from this thread or a batcher worker.
  // request, payloads, response, results and context must stay valid until
  // it has run.
  // The results are allocated in `results` (options_.request_memory).
  // `received`: when the call's message was handed to the front end, before
  // it was parsed (the start of the answer's timing.total_us).
  void StartAttend(grpc::CallbackServerContext* context, absl::Time received,
                   const absl::Status& parsed,
                   const ModelAccess& access, const v1::AttendRequest& request,
                   const AttendPayloads& payloads, v1::AttendResponse* response,
                   AttendResults* results, absl::AnyInvocable<void(absl::Status)> done);

  const ModelRegistry* const registry_;
  RequestDispatcher* const dispatcher_;
  Metrics* const metrics_;
  const AttentionServiceOptions options_;

  CallTracker calls_;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_ATTENTION_SERVICE_H_

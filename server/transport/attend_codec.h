// The attnserve.v1 front end's translation: gRPC's bytes <-> the messages,
// AttendRequest -> the request path's AttendInputs, and a finished
// InferenceRequest -> AttendResponse fields. Everything else about a request
// is shared (server/dispatch).
#ifndef ATTNSERVE_SERVER_TRANSPORT_ATTEND_CODEC_H_
#define ATTNSERVE_SERVER_TRANSPORT_ATTEND_CODEC_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "attnserve/v1/attention.pb.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/dispatch/request_dispatcher.h"
#include "server/request/attend_inputs.h"
#include "server/request/inference_request.h"

namespace attnserve {

// Parses one request message of any type as gRPC's generated handlers would
// (the same deserializer: bytes are copied once, from gRPC's slices into
// `message`; invalid UTF-8 in a string field is refused) and releases
// `bytes`. Not parseable: INVALID_ARGUMENT "<what> could not be parsed as
// <message type>: <reason>", `message` left empty, and nothing logged
// (protobuf's own complaint becomes the reason; see protobuf_log.h).
// `what` names the message for the client ("request", or "AttendStream
// message" with `number` 3: "AttendStream message 3"; 0 = no number); it is
// formatted only when the parse fails.
absl::Status ParseMessage(grpc::ByteBuffer* bytes, absl::string_view what, int64_t number,
                          google::protobuf::MessageLite* message);

// ParseMessage for an AttendRequest ("... could not be parsed as
// attnserve.v1.AttendRequest: <reason>").
absl::Status ParseAttendRequest(grpc::ByteBuffer* bytes, absl::string_view what, int64_t number,
                                v1::AttendRequest* request);

// Serializes `message` into `bytes` as gRPC's generated handlers would.
// Fails (INTERNAL) only for a message over protobuf's 2 GiB limit.
absl::Status SerializeMessage(const google::protobuf::MessageLite& message,
                              grpc::ByteBuffer* bytes);

// Lifetime: the result points into `request`, which must outlive it.
AttendInputs DecodeAttendRequest(const v1::AttendRequest& request);

// Allocates the result tensors in `response` (output, weights).
MutableTensorView AllocateAttendOutput(v1::AttendResponse* response, OutputName name, DType dtype,
                                       const Shape& shape);

// Fills response->timing from a request answered OK at `now`.
void SetTiming(const InferenceRequest& request, absl::Time now, v1::AttendResponse* response);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_ATTEND_CODEC_H_

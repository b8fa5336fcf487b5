// gRPC's bytes <-> protobuf messages, for the front ends that take gRPC's raw
// bytes and parse requests themselves: a message that is not valid is then
// answered like any other bad request (INVALID_ARGUMENT, counted) instead of
// by gRPC (UNIMPLEMENTED for a unary call, a silent end of a stream).
#ifndef ATTNSERVE_SERVER_TRANSPORT_MESSAGE_CODEC_H_
#define ATTNSERVE_SERVER_TRANSPORT_MESSAGE_CODEC_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message_lite.h"
#include "grpcpp/support/byte_buffer.h"

namespace attnserve {

// Parses one request message as gRPC's generated handlers would (the same
// deserializer: the tensor bytes are copied once, from gRPC's slices into
// `request`; invalid UTF-8 in a string field is refused) and releases
// `bytes`. Not parseable: INVALID_ARGUMENT "<what> could not be parsed as
// <message type>: <reason>", `request` left empty, and nothing
// logged (protobuf's own complaint becomes the reason; see protobuf_log.h).
// `what` names the message for the client ("request", or "AttendStream
// message" with `number` 3: "AttendStream message 3"; 0 = no number); it is
// formatted only when the parse fails.
absl::Status ParseRequestMessage(grpc::ByteBuffer* bytes, absl::string_view what, int64_t number,
                                 google::protobuf::MessageLite* request);

// Serializes `message` into `bytes` as gRPC's generated handlers would.
// Fails (INTERNAL) only for a message over protobuf's 2 GiB limit.
absl::Status SerializeMessage(const google::protobuf::MessageLite& message,
                              grpc::ByteBuffer* bytes);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_MESSAGE_CODEC_H_

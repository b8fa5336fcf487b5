// gRPC's bytes <-> protobuf messages for the front ends that parse their
// requests themselves (so that a message that does not parse is answered like
// any other bad request).
#include "server/transport/message_codec.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
// SerializationTraits for protobuf messages: the (de)serializers gRPC's
// generated handlers use.
#include "grpcpp/impl/codegen/proto_utils.h"
#include "server/transport/protobuf_log.h"

namespace attnserve {

absl::Status ParseRequestMessage(grpc::ByteBuffer* bytes, absl::string_view what, int64_t number,
                                 google::protobuf::MessageLite* request) {
  const size_t size = bytes->Length();
  grpc::Status parsed;
  std::string reason;
  {
    // What protobuf would log about these bytes (invalid UTF-8 in a string
    // field) is the client's answer, not a line in the server's log.
    ScopedProtobufLogCapture capture;
    parsed = grpc::SerializationTraits<google::protobuf::MessageLite>::Deserialize(bytes, request);
    reason = capture.captured();
  }
  if (parsed.ok()) return absl::OkStatus();
  request->Clear();  // a failed parse leaves the fields read before the fault
  // Protobuf's advice to the proto's author is no help to the client.
  if (size_t advice = reason.find(" Use the 'bytes' type"); advice != std::string::npos) {
    reason.erase(advice);
  }
  absl::StripTrailingAsciiWhitespace(&reason);
  if (reason.empty()) {
    reason = absl::StrCat("not a valid protobuf encoding of that message (", size, " bytes)");
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, number > 0 ? absl::StrCat(" ", number) : "",
                   " could not be parsed as ", request->GetTypeName(), ": ", reason));
}

absl::Status SerializeMessage(const google::protobuf::MessageLite& message,
                              grpc::ByteBuffer* bytes) {
  bool own_buffer = false;
  const grpc::Status status =
      grpc::SerializationTraits<google::protobuf::MessageLite>::Serialize(message, bytes,
                                                                         &own_buffer);
  if (status.ok()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("could not serialize the ", message.GetTypeName(),
                                          " answer (", message.ByteSizeLong(),
                                          " bytes): ", status.error_message()));
}

}  // namespace attnserve

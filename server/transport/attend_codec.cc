// Bytes <-> AttendRequest / AttendResponse <-> the request path's types.
#include "server/transport/attend_codec.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
// SerializationTraits for protobuf messages: the (de)serializers gRPC's
// generated handlers use.
#include "grpcpp/impl/codegen/proto_utils.h"
#include "server/transport/protobuf_log.h"
#include "server/transport/tensor_codec.h"

namespace attnserve {

absl::Status ParseMessage(grpc::ByteBuffer* bytes, absl::string_view what, int64_t number,
                          google::protobuf::MessageLite* message) {
  const size_t size = bytes->Length();
  grpc::Status parsed;
  std::string reason;
  {
    // What protobuf would log about these bytes (invalid UTF-8 in a string
    // field) is the client's answer, not a line in the server's log.
    ScopedProtobufLogCapture capture;
    parsed = grpc::SerializationTraits<google::protobuf::MessageLite>::Deserialize(bytes, message);
    reason = capture.captured();
  }
  if (parsed.ok()) return absl::OkStatus();
  message->Clear();  // a failed parse leaves the fields read before the fault
  // Protobuf's advice to the proto's author is no help to the client.
  if (size_t advice = reason.find(" Use the 'bytes' type"); advice != std::string::npos) {
    reason.erase(advice);
  }
  absl::StripTrailingAsciiWhitespace(&reason);
  if (reason.empty()) {
    reason = absl::StrCat("not a valid protobuf encoding of that message (", size, " bytes)");
  }
  return absl::InvalidArgumentError(absl::StrCat(what, number > 0 ? absl::StrCat(" ", number) : "",
                                                 " could not be parsed as ",
                                                 message->GetTypeName(), ": ", reason));
}

absl::Status ParseAttendRequest(grpc::ByteBuffer* bytes, absl::string_view what, int64_t number,
                                v1::AttendRequest* request) {
  return ParseMessage(bytes, what, number, request);
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

AttendInputs DecodeAttendRequest(const v1::AttendRequest& request) {
  AttendInputs in;
  in.model = request.model();
  in.query = DecodeTensor(request.query(), request.has_query(), "query");
  in.key = DecodeTensor(request.key(), request.has_key(), "key");
  in.value = DecodeTensor(request.value(), request.has_value(), "value");
  in.attn_mask = DecodeTensor(request.attn_mask(), request.has_attn_mask(), "attn_mask");
  in.key_lengths = absl::MakeConstSpan(request.key_lengths().data(),
                                       static_cast<size_t>(request.key_lengths_size()));
  in.causal = request.causal();
  in.scale = request.scale();
  in.need_weights = request.need_weights();
  in.average_weights = request.average_weights();
  if (request.output_dtype() != v1::DATA_TYPE_UNSPECIFIED) {
    absl::StatusOr<DType> dtype = DTypeFromProto(request.output_dtype(), "output_dtype");
    if (dtype.ok()) {
      in.output_dtype = *dtype;
    } else {
      in.output_dtype_error = absl::InvalidArgumentError(absl::StrCat(
          "output_dtype: must be FLOAT32, FLOAT16, BFLOAT16 or unset (= the query's dtype), got ",
          ProtoDTypeName(request.output_dtype())));
    }
  }
  return in;
}

MutableTensorView AllocateAttendOutput(v1::AttendResponse* response, OutputName name, DType dtype,
                                       const Shape& shape) {
  return AllocateTensor(dtype, shape,
                        name == OutputName::kOutput ? response->mutable_output()
                                                    : response->mutable_weights());
}

void SetTiming(const InferenceRequest& request, absl::Time now, v1::AttendResponse* response) {
  v1::Timing* t = response->mutable_timing();
  t->set_queue_us(absl::ToInt64Microseconds(request.timing.queue));
  t->set_compute_us(absl::ToInt64Microseconds(request.timing.compute));
  t->set_total_us(absl::ToInt64Microseconds(now - request.received));
  t->set_batch_requests(request.timing.batch_requests);
}

}  // namespace attnserve

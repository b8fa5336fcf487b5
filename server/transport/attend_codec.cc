// Bytes <-> AttendRequest / AttendResponse <-> the request path's types.
#include "server/transport/attend_codec.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "server/transport/tensor_codec.h"

namespace attnserve {

namespace {

const HostBuffer* Payload(const AttendPayloads* payloads,
                          std::optional<HostBuffer> AttendPayloads::*field) {
  if (payloads == nullptr || !(payloads->*field).has_value()) return nullptr;
  return &*(payloads->*field);
}

}  // namespace

AttendInputs DecodeAttendRequest(const v1::AttendRequest& request,
                                 const AttendPayloads* payloads) {
  AttendInputs in;
  in.model = request.model();
  in.query = DecodeTensor(request.query(), request.has_query(), "query",
                          Payload(payloads, &AttendPayloads::query));
  in.key = DecodeTensor(request.key(), request.has_key(), "key",
                        Payload(payloads, &AttendPayloads::key));
  in.value = DecodeTensor(request.value(), request.has_value(), "value",
                          Payload(payloads, &AttendPayloads::value));
  in.attn_mask = DecodeTensor(request.attn_mask(), request.has_attn_mask(), "attn_mask",
                              Payload(payloads, &AttendPayloads::attn_mask));
  in.key_lengths = absl::MakeConstSpan(request.key_lengths().data(),
                                       static_cast<size_t>(request.key_lengths_size()));
  in.causal = request.causal();
  in.scale = request.scale();
  in.need_weights = request.need_weights();
  in.average_weights = request.average_weights();
  in.session_id = request.session_id();
  in.positions = absl::MakeConstSpan(request.positions().data(),
                                     static_cast<size_t>(request.positions_size()));
  in.window = request.window();
  in.softcap = request.softcap();
  if (request.sinks_size() > 0) {
    in.sinks.present = true;
    in.sinks.dtype = DType::kFloat32;
    in.sinks.shape = {request.sinks_size()};
    in.sinks.data = absl::string_view(reinterpret_cast<const char*>(request.sinks().data()),
                                      request.sinks_size() * sizeof(float));
  }
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

void SetTiming(const InferenceRequest& request, absl::Time now, v1::AttendResponse* response) {
  v1::Timing* t = response->mutable_timing();
  t->set_queue_us(absl::ToInt64Microseconds(request.timing.queue));
  t->set_compute_us(absl::ToInt64Microseconds(request.timing.compute));
  t->set_total_us(absl::ToInt64Microseconds(now - request.received));
  t->set_batch_requests(request.timing.batch_requests);
}

}  // namespace attnserve

// Bytes <-> AttendRequest / AttendResponse <-> the request path's types.
#include "server/transport/attend_codec.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "server/transport/tensor_codec.h"

namespace attnserve {

namespace {

// A Tensor field's input, its data from `payloads` when the wire's bytes
// went there (with the scan its copy made).
InputTensor DecodeField(const v1::Tensor& tensor, bool has, absl::string_view field,
                        const AttendPayloads* payloads,
                        std::optional<AttendPayload> AttendPayloads::*payload) {
  const AttendPayload* taken = payloads != nullptr && (payloads->*payload).has_value()
                                   ? &*(payloads->*payload)
                                   : nullptr;
  InputTensor input = DecodeTensor(tensor, has, field, taken != nullptr ? &taken->bytes : nullptr);
  if (taken != nullptr && input.present) input.scan = taken->scan;
  return input;
}

}  // namespace

AttendInputs DecodeAttendRequest(const v1::AttendRequest& request,
                                 const AttendPayloads* payloads) {
  AttendInputs in;
  in.model = request.model();
  in.query = DecodeField(request.query(), request.has_query(), "query", payloads,
                         &AttendPayloads::query);
  in.key = DecodeField(request.key(), request.has_key(), "key", payloads, &AttendPayloads::key);
  in.value = DecodeField(request.value(), request.has_value(), "value", payloads,
                         &AttendPayloads::value);
  in.attn_mask = DecodeField(request.attn_mask(), request.has_attn_mask(), "attn_mask", payloads,
                             &AttendPayloads::attn_mask);
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

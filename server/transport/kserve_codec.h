// The KServe v2 (Open Inference Protocol) front end's translation:
// ModelInferRequest -> the request path's AttendInputs, and a finished
// InferenceRequest -> ModelInferResponse. The mapping (input and output names,
// datatypes, parameters) is the one docs/API.md "Calling it from Triton
// clients" documents; everything else about a request is shared
// (server/dispatch).
#ifndef ATTNSERVE_SERVER_TRANSPORT_KSERVE_CODEC_H_
#define ATTNSERVE_SERVER_TRANSPORT_KSERVE_CODEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "engine/tensor.h"
#include "inference/grpc_service.pb.h"
#include "server/dispatch/request_dispatcher.h"
#include "server/request/attend_inputs.h"

namespace attnserve {

// The one model version attnserve serves; requests may also leave it empty.
inline constexpr char kKServeModelVersion[] = "1";

// NotFound unless `version` is "" or "1" (attnserve keeps one version of each
// model), naming the model and the version asked for.
absl::Status CheckModelVersion(absl::string_view model, absl::string_view version);

// "FP32", "FP16", "BF16", "BOOL": the protocol's datatype names.
const char* KServeDatatype(DType dtype);

// One ModelInferRequest decoded. Lives as long as the request it came from
// (inputs' views point into that message, key_lengths into this object), and
// must not be moved once decoded.
struct KServeInferInputs {
  AttendInputs inputs;
  // key_lengths widened to int64 (INT32 on the wire, or unaligned raw bytes).
  std::vector<int64_t> key_lengths;
  // Which outputs the response carries: requested_outputs, or when none are
  // named, "output" and ("weights" when need_weights).
  bool return_output = true;
  bool return_weights = false;
  // Triton's "timeout" request parameter (queue timeout); InfiniteDuration =
  // none.
  absl::Duration timeout = absl::InfiniteDuration();
  // Triton's "triton_enable_empty_final_response": stream responses are then
  // flagged "triton_final_response" (each request has exactly one).
  bool flag_final_response = false;
};

// Decodes `request` into `out` without copying tensor bytes (key_lengths
// aside). Nothing is refused here: a request the protocol mapping cannot
// express (an unknown input or parameter, a datatype attnserve does not take,
// contents in the wrong field) becomes out->inputs.decode_error, or the
// tensor's decode_error, naming what is wrong and the rule, so the shared
// request path reports it after the model lookup (an unknown model is still
// NOT_FOUND) and counts it like every other answer.
//
// Lifetime: out->inputs points into `request` and into out->key_lengths.
void DecodeModelInferRequest(const inference::ModelInferRequest& request, KServeInferInputs* out);

// The RequestDispatcher::OutputAllocator of a KServe response: a returned
// output gets an InferOutputTensor (name, datatype, shape) and its bytes in
// raw_output_contents; an output the client did not ask for (the attention
// output when only weights were requested) is written to `scratch`.
MutableTensorView AllocateKServeOutput(const KServeInferInputs& decoded,
                                       inference::ModelInferResponse* response,
                                       std::string* scratch, OutputName name, DType dtype,
                                       const Shape& shape);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_TRANSPORT_KSERVE_CODEC_H_

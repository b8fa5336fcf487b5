// The one set of rules for an Attend request, whatever front end it came
// through: every check that can be made before compute, against the layer
// that will serve it. The result is the engine's AttentionTask; nothing that
// fails here reaches the engine, which checks only its own invariants.
#ifndef ATTNSERVE_SERVER_REQUEST_VALIDATION_H_
#define ATTNSERVE_SERVER_REQUEST_VALIDATION_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "engine/attention_layer.h"
#include "engine/attention_task.h"
#include "engine/tensor.h"
#include "server/request/attend_inputs.h"

namespace attnserve {

// Server-side size limits; a request over one gets ResourceExhausted.
struct ValidationOptions {
  // Most elements in one input tensor (query, key, value, attn_mask).
  // Inputs are also bounded by the gRPC message size limit.
  // Default: 2^30.
  int64_t max_input_elements = int64_t{1} << 30;
  // Most bytes in the output tensor, and separately in the weights tensor.
  // Outputs are not bounded by the receive limit: weights grow as Lq * Lk.
  // Default: 1 GiB.
  int64_t max_output_bytes = int64_t{1} << 30;
  // Most attention scores (B * Hq * Lq * Lk) in one request: bounds the
  // compute one request can buy, refused (ResourceExhausted) before any
  // compute. The default is about a second of one core at head_dim 64 (the
  // fp32 core does ~250M scores/s on a 2-vCPU AVX2 EPYC: engine_bench
  // Core/B8_L512, 25M scores in 97 ms); B1 H16 L4096 still fits. Server flag
  // --max-attention-scores. Default: 2^28.
  int64_t max_attention_scores = int64_t{1} << 28;
};

// A request that passed every check, in the engine's terms.
struct ValidatedRequest {
  // Inputs, options and resolved scale set; `output` and `weights` are
  // empty: the caller allocates them (output_shape / weights_shape) where the
  // response will carry them. Views point into the request (see below).
  AttentionTask task;
  TaskDims dims;
  DType output_dtype = DType::kFloat32;  // also the weights' dtype
  Shape output_shape;
  Shape weights_shape;  // empty when need_weights is false
};

// The rules of one input tensor, in order: decoded (InputTensor::decode_error
// is OK); every dim >= 1; the element count fits in int64 and is at most
// `max_elements` (else ResourceExhausted: a server limit, not a malformed
// request); `data` holds exactly elements * element size bytes. `field`
// ("query", "attn_mask") starts every message. Ranks are checked against the
// model by ValidateAttendInputs.
//
// Lifetime: the view points where `tensor.data` does.
absl::StatusOr<TensorView> ViewInput(const InputTensor& tensor, absl::string_view field,
                                     int64_t max_elements = INT64_MAX);

// Checks `request` against `layer` (the model already resolved by name).
// Errors are InvalidArgument whose message starts with the field ("query.data",
// "key_lengths[1]", ...), states the rule and the values seen; or
// ResourceExhausted for a request over one of `options`' limits.
//
// Lifetime: the returned task's views (tensors, key_lengths) point where
// `request`'s do (the front end's message), which must outlive them.
absl::StatusOr<ValidatedRequest> ValidateAttendInputs(const AttendInputs& request,
                                                      const LayerConfig& layer,
                                                      const ValidationOptions& options = {});

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_REQUEST_VALIDATION_H_

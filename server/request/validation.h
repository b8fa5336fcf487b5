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

// What validation does with NaN and +-Inf in a request's inputs.
enum class NonfiniteInputs {
  // Refuse the request with InvalidArgument naming the tensor and the first
  // offending element: NaN or +-Inf in query, key or value; NaN or +Inf in a
  // float attn_mask (-Inf is the SDPA way to say "masked" and is accepted);
  // and inputs whose scores or output sums could overflow float32 (see
  // ValidateAttendInputs). An engine never sees a value it could turn into
  // a silently different answer.
  kReject,
  // (Not implemented.) Propagating like PyTorch (NaN rows) would need every
  // engine's softmax to treat NaN and +Inf as PyTorch does; the enum keeps
  // the name of the option so that the flag can grow it.
};

// Server-side limits; a request over one gets ResourceExhausted. The flag
// that sets each one is named in its message.
struct ValidationOptions {
  // Most elements in one input tensor (query, key, value, attn_mask)
  // (--max-tensor-elements). Checked on the declared shape before the data:
  // a small message cannot make the server allocate for a large shape.
  // Inputs are also bounded by the gRPC message size limit.
  // Default: 2^30.
  int64_t max_input_elements = int64_t{1} << 30;
  // Most attention weights one request may ask to get back
  // (--max-returned-weights): elements of the weights tensor, B*Hq*Lq*Lk
  // (B*Lq*Lk with average_weights). The server allocates them in the
  // response before compute, and they grow as Lq*Lk however small the
  // request. 2^26 float32 weights are 256 MiB. Default: 2^26.
  int64_t max_returned_weights = int64_t{1} << 26;
  // Most bytes in the output tensor, and separately in the weights tensor.
  // Outputs are not bounded by the receive limit: weights grow as Lq * Lk.
  // Default: 1 GiB.
  int64_t max_output_bytes = int64_t{1} << 30;
  // Most attention scores (B * Hq * Lq * Lk) in one request
  // (--max-attention-scores): bounds the per-score work (softmax, masking)
  // and engine scratch whatever the head dim. The CPU engine spends 3-4 ns
  // of one core per score at head dims up to 64 (docs/OPERATIONS.md), so
  // 2^28 is about one second of a core. Default: 2^28.
  int64_t max_attention_scores = int64_t{1} << 28;
  // Most multiply-adds of the request's matrix products
  // (--max-multiply-adds): attention B * Hq * Lq * Lk * (Dk + Dv), plus, for
  // projection models, the Q, K, V and output projections
  // B * (Lq * query_dim * Hq * Dk + Lk * key_dim * Hkv * Dk +
  //      Lk * value_dim * Hkv * Dv + Lq * Hq * Dv * out_dim).
  // Bounds what max_attention_scores does not: large head dims and
  // projection work (many tokens, few scores). About 1 s of a core for
  // attention, 2 s for projections on the CPU engine. Default: 2^35.
  int64_t max_multiply_adds = int64_t{1} << 35;
  // NaN and +-Inf in the inputs. Default: kReject.
  NonfiniteInputs nonfinite_inputs = NonfiniteInputs::kReject;
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
// Session requests (request.session_id set): B must be 1, and attn_mask,
// key_lengths and need_weights are refused (InvalidArgument naming the
// field); the task is causal (bottom-right over the whole cache). Dims and
// limits are those of the request's own rows; the session manager checks
// them against the session (shape, dtype, token limit).
//
// Per-request layer options: positions only for models with rotary
// embeddings, [B, Lk] values in [0, kMaxRotaryPosition] that do not
// decrease along a sequence, never with
// session_id; window (>= 0), softcap (finite, >= 0) and sinks (FLOAT32 [Hq],
// finite) only for models without projections, and a session request's
// window only equal to the model's sliding_window when it has one.
//
// Values (options.nonfinite_inputs == kReject), checked last because they are
// the one check that reads the data (one pass over each input):
//   - query, key, value: no NaN or +-Inf, fp16/bf16 included;
//   - a float attn_mask: no NaN or +Inf (-Inf = masked is accepted);
//   - head-layout models: the bound on a score before softmax,
//       max|query| * max|key| * Dk * max(1, scale) + max(0, max attn_mask),
//     must not exceed FLT_MAX (engines may form the dot product before
//     scaling), and max|value| * Lk must not exceed FLT_MAX (engines sum up
//     to Lk weighted values before normalising). Conservative: a request
//     refused here might not have overflowed, but an accepted one cannot.
//   - projection models, given `weight_bounds` (the layer's weights
//     measured once, MeasureWeightBounds): the same rules on the projected
//     values, against the largest value of the layer's precision (FLT_MAX;
//     65504 for float16): each of query, key, value projected,
//       gain * max|input| + max|bias| (gain = the weight's largest row sum
//       of |w|; key = value = query for self-attention),
//     the scores from the projected query and key as above, max|projected
//     value| * Lk, and the output projection of max|projected value|.
//     Without `weight_bounds`, projection models get only the NaN/Inf rules.
//
// Lifetime: the returned task's views (tensors, key_lengths) point where
// `request`'s do (the front end's message), which must outlive them.
absl::StatusOr<ValidatedRequest> ValidateAttendInputs(const AttendInputs& request,
                                                      const LayerConfig& layer,
                                                      const ValidationOptions& options = {},
                                                      const LayerWeightBounds* weight_bounds =
                                                          nullptr);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_REQUEST_VALIDATION_H_

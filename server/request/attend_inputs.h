// What a front end hands to the shared request path: one Attend request as it
// arrived on the wire, decoded into plain C++ (dtype codes mapped, bytes not
// copied) and not yet checked. Every front end (attnserve.v1, KServe v2)
// produces one; server/request/validation.h owns every rule about it.
#ifndef ATTNSERVE_SERVER_REQUEST_ATTEND_INPUTS_H_
#define ATTNSERVE_SERVER_REQUEST_ATTEND_INPUTS_H_

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "engine/tensor.h"
#include "server/request/value_scan.h"

namespace attnserve {

// One input tensor as received. Nothing here has been checked.
struct InputTensor {
  // False: the client did not send it (or sent an empty message).
  bool present = false;
  // A decoding failure of this tensor (e.g. an unknown dtype code), with a
  // message naming the field. Validation reports it when it reaches this
  // tensor, so errors come in the same order whatever the front end.
  absl::Status decode_error;
  DType dtype = DType::kFloat32;
  Shape shape;
  // The tensor's bytes, row-major, little-endian, as received.
  absl::string_view data;
  // What the front end's copy of `data` off the wire found in it, read at
  // the width of the dtype the wire gave before the bytes (value_scan.h);
  // unset: not scanned. Validation uses it only at this dtype's width, and
  // otherwise reads the bytes itself.
  std::optional<ValueScan> scan;
};

// Lifetime: every view points into the front end's request message, which
// outlives the request (until its completion has run).
struct AttendInputs {
  // Empty = the server's default model.
  absl::string_view model;
  // A decoding failure of the request as a whole (an unknown input or
  // parameter, contents that do not match the inputs): validation reports it
  // first, after the model lookup, so that an unknown model is NOT_FOUND
  // whatever else is wrong (as Triton answers) and the refusal is counted
  // under the model, like a tensor's own decode_error.
  absl::Status decode_error;
  InputTensor query, key, value, attn_mask;
  // Empty = none.
  absl::Span<const int64_t> key_lengths;
  bool causal = false;
  // 0 = the model's default.
  float scale = 0.0f;
  bool need_weights = false;
  bool average_weights = false;
  // Unset = the query's dtype.
  std::optional<DType> output_dtype;
  // Like InputTensor::decode_error, for output_dtype.
  absl::Status output_dtype_error;
  // Explicit rotary positions of the key tokens, [B, Lk] row-major; empty =
  // the implicit ones. Only for models with rotary embeddings.
  absl::Span<const int64_t> positions;
  // Models without projections only: a sliding window (> 0), logit
  // softcapping (> 0) and per-head attention sinks ([Hq] FLOAT32); 0 / not
  // present = the model's own (none, unless its config sets them).
  int64_t window = 0;
  float softcap = 0.0f;
  InputTensor sinks;
  // Empty = stateless. Otherwise the session (OpenSession) whose cache the
  // key/value rows are appended to and the query attends over; B must be 1
  // and attn_mask, key_lengths and need_weights are refused (validation.h).
  absl::string_view session_id;
};

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_REQUEST_ATTEND_INPUTS_H_

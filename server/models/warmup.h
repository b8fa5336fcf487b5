// Warm-up: one small batch through each ready model's engine before the
// server takes requests (as Triton's model_warmup), so that no client's
// request pays the engine's first-call costs: for projection models the
// packing of the weights and oneDNN's primitives, for every model the
// engine's thread team and scratch buffers. The inputs are zeros of
// default shapes: 16 tokens of one sequence (self-attention when the layer
// allows it), and for bare sdpa the layer's pinned dims or 8 heads of 64.
#ifndef ATTNSERVE_SERVER_MODELS_WARMUP_H_
#define ATTNSERVE_SERVER_MODELS_WARMUP_H_

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/models/served_model.h"

namespace attnserve {

// Runs the warm-up batch of `model` (ready: layer and engine set) and
// returns how long it took. The engine's error, with the model named, when
// it fails (a model that cannot compute 16 zeros is not ready to serve).
absl::StatusOr<absl::Duration> WarmUpModel(const ServedModel& model);

}  // namespace attnserve

#endif  // ATTNSERVE_SERVER_MODELS_WARMUP_H_

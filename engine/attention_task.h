// One request through a layer, as the engine receives it: validated input
// views, resolved options and caller-owned output buffers.
#ifndef ATTNSERVE_ENGINE_ATTENTION_TASK_H_
#define ATTNSERVE_ENGINE_ATTENTION_TASK_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/attention_layer.h"
#include "engine/attention_params.h"
#include "engine/paged_kv.h"
#include "engine/tensor.h"

namespace attnserve {

// Everything here was validated by the caller (server/request/validation) against the
// layer: ranks, dims, dtypes, mask broadcastability, key_lengths range.
struct AttentionTask {
  // Layer without projections: query [B, Hq, Lq, Dk], key [B, Hkv, Lk, Dk],
  // value [B, Hkv, Lk, Dv]. Layer with projections: query [B, Lq, query_dim],
  // key [B, Lk, key_dim], value [B, Lk, value_dim]; key and value both empty
  // = self-attention (key = value = query; the only form a latent layer
  // takes). Same dtype for all three.
  TensorView query, key, value;

  bool causal = false;  // already OR-ed with the layer's default
  float scale = 1.0f;   // resolved: finite, > 0
  absl::Span<const int64_t> key_lengths;  // empty, or [B] values in [0, Lk]
  TensorView attn_mask;  // empty, or broadcastable to [B, Hq, Lq, Lk]

  // Per-request options of a layer WITHOUT projections (bare sdpa); a
  // projection layer takes them from its config only (CheckTask refuses them
  // there). 0 / empty = the layer's own (LayerConfig::sliding_window,
  // softcap; no sinks).
  int64_t window = 0;    // > 0: sliding window (AttentionParams::window)
  float softcap = 0.0f;  // > 0: logit softcapping (AttentionParams::softcap)
  absl::Span<const float> sinks;  // empty, or [Hq] finite sink logits

  // Explicit rotary positions (projection layers with RoPE only): empty =
  // the implicit ones (keys 0..Lk-1, queries the last Lq of them); else
  // [B, Lk] row-major, the position of every key token of each sequence,
  // the queries at the last Lq of them (the same tokens in self-attention;
  // so Lq <= Lk).
  // Values in [0, kMaxRotaryPosition]. Masks (causal, window) stay by index.
  absl::Span<const int64_t> positions;

  // Written by the engine, every byte (callers need not clear them; the
  // server hands over reused memory). output: [B, Hq, Lq, Dv] (no projections) or
  // [B, Lq, out_dim]; weights: empty (not wanted), [B, Hq, Lq, Lk], or
  // [B, Lq, Lk] when average_weights. Any float dtype.
  MutableTensorView output;
  MutableTensorView weights;
  bool average_weights = false;

  // A server-side session (enabled() = block_tokens > 0): key and value (or,
  // for self-attention projection layers, the query's tokens) are the NEW
  // rows only. The engine appends them, projected, into the cache at
  // [cached_len, cached_len + Lk) and attends the query over all
  // cached_len + Lk tokens. B == 1, no key_lengths, no mask, no weights
  // (validated by the server; CheckPagedKv guards the engine). Only engines
  // whose SupportsSessions() is true accept it.
  PagedKv paged;
};

// Largest explicit rotary position a task may carry (2^31 - 1): far past
// every context length in use, and position * inv_freq stays exact enough in
// float64.
inline constexpr int64_t kMaxRotaryPosition = (int64_t{1} << 31) - 1;

// Dims of a task, derived from its shapes and the layer. `batch` is B, the
// sequences of ONE request (a group of requests is a "batch" only in
// server/batching).
struct TaskDims {
  int64_t batch = 0, q_len = 0, kv_len = 0;
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0, head_dim_v = 0;
};
TaskDims GetTaskDims(const LayerConfig& layer, const AttentionTask& task);

// Shape of the output / weights for a task (used to allocate them).
Shape OutputShape(const LayerConfig& layer, const TaskDims& dims);
Shape WeightsShape(const TaskDims& dims, bool average_weights);

// Resolves the scale: request value if nonzero, else the layer's, else
// 1/sqrt(head_dim).
float ResolveScale(const LayerConfig& layer, float request_scale, int64_t head_dim);

// The production engines' invariants, checked before they touch memory:
// ranks, dims, dtypes, the output and weights shapes, key_lengths and the
// mask against the layer -- what keeps a call inside its buffers. Not the
// rules a client is told about: server/request/validation.cc owns those, and
// nothing it accepts fails here (tests/unit/server/validation_test.cc holds
// the two together). InvalidArgument naming the field on failure. The
// reference engine has its own checks, to stay an independent oracle.
absl::Status CheckTask(const LayerConfig& layer, const AttentionTask& task);

// The attention-core params of a checked task: dims, masks, scale, weights;
// window and softcap the task's when set, else the layer's; sinks the
// task's (a projection layer's learned sinks are the engine's to point at);
// ALiBi slopes the layer's (host memory).
// For a layer without projections q/k/v/out point into the task's views
// (head layout, task dtypes). For a layer with projections they are left
// null for the engine to point at its projected buffers.
absl::StatusOr<AttentionParams> MakeCoreParams(const LayerConfig& layer,
                                               const AttentionTask& task);

}  // namespace attnserve

#endif  // ATTNSERVE_ENGINE_ATTENTION_TASK_H_

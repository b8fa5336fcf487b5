// The warm-up task of a model: zeros of default shapes through its engine.
#include "server/models/warmup.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/attention_task.h"
#include "engine/tensor.h"

namespace attnserve {

absl::StatusOr<absl::Duration> WarmUpModel(const ServedModel& model) {
  if (!model.ready() || model.layer == nullptr || model.engine == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("model '", model.name, "': not ready, nothing to warm up"));
  }
  const LayerConfig& c = model.layer->config;
  constexpr int64_t kTokens = 16;
  Tensor query, key, value;
  if (c.has_projections) {
    query = Tensor(DType::kFloat32, {1, kTokens, c.query_dim});  // zeros
    if (c.key_dim != c.query_dim || c.value_dim != c.query_dim) {  // no self-attention
      key = Tensor(DType::kFloat32, {1, kTokens, c.key_dim});
      value = Tensor(DType::kFloat32, {1, kTokens, c.value_dim});
    }
  } else {
    const int64_t heads = c.num_heads > 0 ? c.num_heads : 8;
    const int64_t kv_heads = c.num_kv_heads > 0 ? c.num_kv_heads : heads;
    const int64_t dim = c.head_dim > 0 ? c.head_dim : 64;
    query = Tensor(DType::kFloat32, {1, heads, kTokens, dim});
    key = Tensor(DType::kFloat32, {1, kv_heads, kTokens, dim});
    value = Tensor(DType::kFloat32, {1, kv_heads, kTokens, dim});
  }
  AttentionTask task;
  task.query = query.view();
  if (key.byte_size() > 0) {
    task.key = key.view();
    task.value = value.view();
  }
  task.causal = c.causal;
  const TaskDims dims = GetTaskDims(c, task);
  task.scale = ResolveScale(c, 0.0f, dims.head_dim);
  Tensor output(DType::kFloat32, OutputShape(c, dims));
  task.output = output.mutable_view();
  const absl::Time start = absl::Now();
  if (absl::Status s = model.engine->Run(*model.layer, {&task, 1}); !s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("model '", model.name, "': warm-up failed: ", s.message()));
  }
  return absl::Now() - start;
}

}  // namespace attnserve

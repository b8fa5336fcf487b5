// The warm-up tasks of a model: zeros of the default shape, then of each of
// its config's warmup shapes, through its engine.
#include "server/models/warmup.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "attnserve/v1/model_config.pb.h"
#include "engine/attention_task.h"
#include "engine/tensor.h"
#include "server/models/model_config_codec.h"

namespace attnserve {
namespace {

// A bare sdpa layer's request heads and head dim; 0: the layer's pinned
// value, else 8 heads of 64.
struct SdpaHeads {
  int64_t heads = 0, kv_heads = 0, dim = 0;
};

// One batch of zeros: `batch` sequences of `q_len` queries over `kv_len`
// keys (self-attention when the layer allows it and the lengths agree, and
// its keys and values are its own: a kv_source layer's requests carry them).
absl::Status RunZeros(const ServedModel& model, int64_t batch, int64_t q_len, int64_t kv_len,
                      DType dtype, bool causal, SdpaHeads sdpa = {}) {
  const LayerConfig& c = model.layer->config;
  Tensor query, key, value;
  if (c.has_projections) {
    query = Tensor(dtype, {batch, q_len, c.query_dim});  // zeros
    if (c.key_dim != c.query_dim || c.value_dim != c.query_dim || kv_len != q_len ||
        !c.kv_source.empty()) {
      key = Tensor(dtype, {batch, kv_len, c.key_dim});
      value = Tensor(dtype, {batch, kv_len, c.value_dim});
    }
  } else {
    // ALiBi's slopes fix an sdpa layer's query heads.
    const int64_t alibi_heads = static_cast<int64_t>(c.alibi_slopes.size());
    const int64_t heads = sdpa.heads > 0    ? sdpa.heads
                          : c.num_heads > 0 ? c.num_heads
                          : alibi_heads > 0 ? alibi_heads
                                            : 8;
    const int64_t kv_heads = sdpa.kv_heads > 0       ? sdpa.kv_heads
                             : c.num_kv_heads > 0 ? c.num_kv_heads
                                                  : heads;
    const int64_t dim = sdpa.dim > 0 ? sdpa.dim : c.head_dim > 0 ? c.head_dim : 64;
    query = Tensor(dtype, {batch, heads, q_len, dim});
    key = Tensor(dtype, {batch, kv_heads, kv_len, dim});
    value = Tensor(dtype, {batch, kv_heads, kv_len, dim});
  }
  AttentionTask task;
  task.query = query.view();
  if (key.byte_size() > 0) {
    task.key = key.view();
    task.value = value.view();
  }
  task.causal = c.causal || causal;
  const TaskDims dims = GetTaskDims(c, task);
  task.scale = ResolveScale(c, 0.0f, dims.head_dim);
  Tensor output(dtype, OutputShape(c, dims));
  task.output = output.mutable_view();
  return model.engine->Run(*model.layer, {&task, 1});
}

}  // namespace

absl::StatusOr<absl::Duration> WarmUpModel(const ServedModel& model) {
  if (!model.ready() || model.layer == nullptr || model.engine == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("model '", model.name, "': not ready, nothing to warm up"));
  }
  constexpr int64_t kTokens = 16;
  const absl::Time start = absl::Now();
  if (absl::Status s = RunZeros(model, 1, kTokens, kTokens, DType::kFloat32, false); !s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("model '", model.name, "': warm-up failed: ", s.message()));
  }
  // The config's own shapes (resolved: kv_len and dtype set).
  const int n = model.config != nullptr ? model.config->warmup_size() : 0;
  for (int i = 0; i < n; ++i) {
    const v1::WarmupShape& w = model.config->warmup(i);
    absl::Status s = RunZeros(model, w.batch(), w.q_len(), w.kv_len(), ToWarmupDType(w),
                              w.causal(), {w.num_heads(), w.num_kv_heads(), w.head_dim()});
    if (!s.ok()) {
      const std::string heads =
          w.num_heads() > 0 ? absl::StrCat(", heads ", w.num_heads(), "/", w.num_kv_heads(),
                                           " of ", w.head_dim())
                            : "";
      return absl::Status(
          s.code(), absl::StrCat("model '", model.name, "': warm-up failed at warmup[", i,
                                 "] (batch ", w.batch(), ", q_len ", w.q_len(), ", kv_len ",
                                 w.kv_len(), heads, ", ", w.dtype(), "): ", s.message()));
    }
  }
  return absl::Now() - start;
}

}  // namespace attnserve

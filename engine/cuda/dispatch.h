// One request on the GPU: the kernels and GEMMs that compute it, enqueued in
// order on a staged Call. Each request has its own launches and GEMM shapes,
// which depend on that request alone: that is what makes results
// batch-invariant.
#ifndef ATTNSERVE_ENGINE_CUDA_DISPATCH_H_
#define ATTNSERVE_ENGINE_CUDA_DISPATCH_H_

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "engine/attention_layer.h"
#include "engine/attention_params.h"
#include "engine/attention_task.h"
#include "engine/cuda/staging.h"
#include "engine/dtype.h"
#include "engine/paged_kv.h"

namespace attnserve::cuda {

// Attention over host-side params (checked; head layout or any strides):
// uploads Q, K, V, the mask and the key lengths, converts the inputs to
// `compute` if needed, attends, and delivers the output (into p.out's
// strides) and the weights at call.Finish. InvalidArgument for a relative
// position bias or relative position embeddings (projection layers only).
absl::Status EnqueueHostAttention(Call& call, const AttentionParams& p, DType compute);

// The split-KV decodes of a Run's session requests (paged_attention.h),
// launched together: one launch of each kernel per cache dtype instead of
// two per request, so a step of many sessions is one grid wide enough to
// keep the GPU reading. A request's decode joins with the work that reads
// its output (its out-projection, its download); Flush enqueues the
// decodes, then that work in request order. Each request computes what it
// would alone, bitwise (LaunchPagedDecodeBatch).
class PagedDecodes {
 public:
  void Add(const AttentionParams& params, void* scratch, std::function<absl::Status()> then);
  absl::Status Flush(Call& call);

 private:
  struct Pending {
    AttentionParams params;  // device-side, as LaunchPagedDecode takes them
    void* scratch;
    std::function<absl::Status()> then;
  };
  std::vector<Pending> pending_;
};

// nn.MultiheadAttention (batch first) for a checked task on a layer with
// projections: in-projections, attention over the projected [B, L, H*D]
// buffers, out-projection, all in w.type; delivers task.output and the
// weights at call.Finish. `p` is MakeCoreParams(config, task). A session's
// decode step (and its out-projection) waits in `decodes` for Flush.
absl::Status EnqueueProjected(Call& call, const LayerConfig& config, const DeviceLayer& w,
                              const AttentionTask& task, const AttentionParams& p,
                              PagedDecodes& decodes);

// Sessions (AttentionTask::paged enabled; the blocks in device memory, from
// the engine's kv_slab_memory()).
//
// The engine's checks of a paged task that passed CheckTask, before anything
// is enqueued: CheckPagedKv over its core params, and what the GPU computes.
// InvalidArgument / Unimplemented naming the rule.
absl::Status CheckPagedTask(const LayerConfig& config, const AttentionTask& task);

// Bare attention of a checked paged task (host-side `p` = MakeCoreParams,
// over the new rows): uploads Q and the new K/V rows, appends the rows into
// `cache` on the device (converted to cache.dtype), attends the query over
// the whole cache and delivers the output into p.out's strides at
// call.Finish (a decode step waits in `decodes` for Flush); InvalidArgument
// as EnqueueHostAttention. Projection layers take EnqueueProjected, which
// does the same with the projected rows.
absl::Status EnqueuePagedHostAttention(Call& call, const AttentionParams& p,
                                       const PagedKv& cache, PagedDecodes& decodes);

}  // namespace attnserve::cuda

#endif  // ATTNSERVE_ENGINE_CUDA_DISPATCH_H_

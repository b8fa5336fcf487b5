// One request on the GPU: the kernels and GEMMs that compute it, enqueued in
// order on a staged Call. Each request has its own launches and GEMM shapes,
// which depend on that request alone: that is what makes results
// batch-invariant.
#ifndef ATTNSERVE_ENGINE_CUDA_DISPATCH_H_
#define ATTNSERVE_ENGINE_CUDA_DISPATCH_H_

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
// strides) and the weights at call.Finish.
absl::Status EnqueueHostAttention(Call& call, const AttentionParams& p, DType compute);

// nn.MultiheadAttention (batch first) for a checked task on a layer with
// projections: in-projections, attention over the projected [B, L, H*D]
// buffers, out-projection, all in w.type; delivers task.output and the
// weights at call.Finish. `p` is MakeCoreParams(config, task).
absl::Status EnqueueProjected(Call& call, const LayerConfig& config, const DeviceLayer& w,
                              const AttentionTask& task, const AttentionParams& p);

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
// call.Finish. Projection layers take EnqueueProjected, which does the same
// with the projected rows.
absl::Status EnqueuePagedHostAttention(Call& call, const AttentionParams& p,
                                       const PagedKv& cache);

}  // namespace attnserve::cuda

#endif  // ATTNSERVE_ENGINE_CUDA_DISPATCH_H_

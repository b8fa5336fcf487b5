// The CUDA backend: cuBLASLt projections and CUDA attention kernels behind
// the AttentionEngine interface. It lives in the module libattnserve_cuda.so
// and is reached through LoadCudaEngine (cuda_loader.h), never by linking.
//
// Thread-safe, as the interface requires: each concurrent call takes its own
// workspace (a CUDA stream with its pinned staging and device arenas) from a
// pool, so calls overlap on the GPU. Device-resident weights are shared,
// uploaded once per layer (keyed by the layer's address) and converted to
// the layer's precision.
#ifndef ATTNSERVE_ENGINE_CUDA_CUDA_ENGINE_H_
#define ATTNSERVE_ENGINE_CUDA_CUDA_ENGINE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "engine/attention_engine.h"

namespace attnserve::cuda {

// Unavailable, with the reason, when there is no usable GPU (no driver, no
// device, or compute capability below 8.0).
absl::StatusOr<std::unique_ptr<AttentionEngine>> NewCudaEngine(const EngineOptions& options);

}  // namespace attnserve::cuda

#endif  // ATTNSERVE_ENGINE_CUDA_CUDA_ENGINE_H_

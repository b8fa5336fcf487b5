// Attention as two batched GEMMs around a softmax: S = Q K^T on cuBLAS in
// full fp32 (no TF32), P = softmax(S * scale + masks) with every rule of
// attention_params.h (softmax_rows.cu), O = P V. It serves fp32 inputs
// exactly at fp32 GEMM speed, and need_weights (P is materialised), for what
// neither cuDNN nor the fused kernel takes. Scores are materialised for a
// chunk of (batch, head) pairs at a time, so memory stays bounded.
#ifndef ATTNSERVE_ENGINE_CUDA_UNFUSED_ATTENTION_H_
#define ATTNSERVE_ENGINE_CUDA_UNFUSED_ATTENTION_H_

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/attention_params.h"
#include "engine/cuda/device_memory.h"

namespace attnserve::cuda {

// One per workspace stream; not thread-safe.
class UnfusedAttention {
 public:
  static absl::StatusOr<std::unique_ptr<UnfusedAttention>> Create(cudaStream_t stream);
  ~UnfusedAttention();
  UnfusedAttention(const UnfusedAttention&) = delete;
  UnfusedAttention& operator=(const UnfusedAttention&) = delete;

  // Score bytes of one chunk at most (a single (b, h) pair may need more:
  // then Supports is false). Default: 256 MiB.
  static constexpr size_t kMaxChunkScoreBytes = size_t{256} << 20;

  // Whether `a` fits: one pair's scores within kMaxChunkScoreBytes.
  static bool Supports(const AttentionParams& a);

  // Enqueues attention for device-side `a`: q, k, v FLOAT32 at their
  // strides; out at its strides in out_dtype; weights (optional) per head,
  // contiguous [B, Hq, Lq, Lk] in weights_dtype. Scratch from `alloc`.
  absl::Status Enqueue(const AttentionParams& a, DeviceAllocator alloc, cudaStream_t stream);

 private:
  UnfusedAttention() = default;
  cublasHandle_t blas_ = nullptr;
};

}  // namespace attnserve::cuda

#endif  // ATTNSERVE_ENGINE_CUDA_UNFUSED_ATTENTION_H_

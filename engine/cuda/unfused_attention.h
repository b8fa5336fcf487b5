// Attention as two batched GEMMs around a softmax: S = Q K^T on cuBLAS,
// P = softmax(S * scale + masks) with every rule of attention_params.h
// (softmax_rows.cu; the relative position embeddings' terms join S there,
// from Q and K), O = P V. It serves fp32 inputs exactly, and
// need_weights (P is materialised), for what neither cuDNN nor the fused
// kernel takes. Scores are materialised for a chunk of (batch, head) pairs
// at a time, so memory stays bounded.
//
// The GEMMs are exact fp32 products either way (Gemm below): by default
// 3xTF32 on the tensor cores, each fp32 operand x split into its TF32 high
// part h and the rest l (x = h + l exactly) and x y computed as
// h_x h_y + h_x l_y + l_x h_y with fp32 accumulation (the dropped l_x l_y
// is below 2^-20 of the product, as is TF32's rounding of l): for Q K^T one
// TF32 GEMM over [h | h | l] and [h | l | h] rows (K = 3 D); for P V the
// softmax writes P's parts, [h | l] of V gives P_h V_h and P_h V_l in one
// GEMM, and P_l V_h accumulates onto the first. Or full fp32 on cuBLAS
// (CUBLAS_COMPUTE_32F_PEDANTIC), for comparison.
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
  enum class Gemm { k3xTf32, kFp32 };
  static absl::StatusOr<std::unique_ptr<UnfusedAttention>> Create(cudaStream_t stream,
                                                                 Gemm gemm = Gemm::k3xTf32);
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

  // need_weights beside a fused kernel that gives each row's log-sum-exp
  // (cuDNN's statistics, cudnn_sdpa.h): S = Q K^T as a GEMM of a's FLOAT16
  // or BFLOAT16 q and k with fp32 accumulation (exact products, fp32 sums;
  // a causal request's by row blocks, as Enqueue), then a.weights = exp(t -
  // lse) per key a row sees (LaunchWeightsFromStats). lse[(b * Hq + h) *
  // lse_rows + i] on the device. No softcap, no sinks, no ALiBi, no
  // relative position bias, no relative position embeddings.
  static bool SupportsWeights(const AttentionParams& a);
  absl::Status EnqueueWeights(const AttentionParams& a, const float* lse, int64_t lse_rows,
                              DeviceAllocator alloc, cudaStream_t stream);

 private:
  explicit UnfusedAttention(Gemm gemm) : gemm_(gemm) {}
  const Gemm gemm_;
  cublasHandle_t blas_ = nullptr;
};

}  // namespace attnserve::cuda

#endif  // ATTNSERVE_ENGINE_CUDA_UNFUSED_ATTENTION_H_

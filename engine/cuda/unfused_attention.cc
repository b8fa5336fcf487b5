// UnfusedAttention: per chunk of (b, h) pairs, pointer arrays, S = Q K^T,
// softmax in place, O = P V, scatter into the output.
#include "engine/cuda/unfused_attention.h"

#include <algorithm>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/cuda_status.h"

namespace attnserve::cuda {

absl::StatusOr<std::unique_ptr<UnfusedAttention>> UnfusedAttention::Create(cudaStream_t stream) {
  std::unique_ptr<UnfusedAttention> u(new UnfusedAttention());
  ATTNSERVE_CUBLAS_CALL(cublasCreate(&u->blas_));
  ATTNSERVE_CUBLAS_CALL(cublasSetStream(u->blas_, stream));
  // Full fp32: no TF32 tensor-core shortcut, whatever the environment says.
  ATTNSERVE_CUBLAS_CALL(cublasSetMathMode(u->blas_, CUBLAS_PEDANTIC_MATH));
  return u;
}

UnfusedAttention::~UnfusedAttention() {
  if (blas_ != nullptr) (void)cublasDestroy(blas_);
}

bool UnfusedAttention::Supports(const AttentionParams& a) {
  return a.dtype == DType::kFloat32 && a.k_blocks == nullptr &&
         static_cast<double>(a.q_len) * static_cast<double>(a.kv_len) * 4.0 <=
             static_cast<double>(kMaxChunkScoreBytes) &&
         a.q_len <= (int64_t{1} << 30) && a.kv_len <= (int64_t{1} << 30) &&
         a.head_dim <= (int64_t{1} << 20) && a.head_dim_v <= (int64_t{1} << 20);
}

absl::Status UnfusedAttention::Enqueue(const AttentionParams& a, DeviceAllocator alloc,
                                       cudaStream_t stream) {
  if (!Supports(a)) {
    return absl::InternalError("unfused attention: a request it does not support");
  }
  const int64_t pairs = a.batch * a.num_heads;
  if (pairs == 0 || a.q_len == 0) return absl::OkStatus();
  const int64_t scores = a.q_len * a.kv_len;
  const size_t pair_bytes = static_cast<size_t>(std::max<int64_t>(scores, 1)) * 4;
  const int64_t chunk =
      std::clamp<int64_t>(static_cast<int64_t>(kMaxChunkScoreBytes / pair_bytes), 1, pairs);
  absl::StatusOr<void*> s = alloc(static_cast<size_t>(chunk * std::max<int64_t>(scores, 1)) * 4);
  if (!s.ok()) return s.status();
  absl::StatusOr<void*> o = alloc(static_cast<size_t>(chunk * a.q_len * a.head_dim_v) * 4);
  if (!o.ok()) return o.status();
  absl::StatusOr<void*> ptrs = alloc(static_cast<size_t>(5 * chunk) * sizeof(void*));
  if (!ptrs.ok()) return ptrs.status();
  auto** table = static_cast<void**>(*ptrs);
  const void** q_ptrs = const_cast<const void**>(table);
  const void** k_ptrs = const_cast<const void**>(table + chunk);
  const void** v_ptrs = const_cast<const void**>(table + 2 * chunk);
  void** s_ptrs = table + 3 * chunk;
  void** o_ptrs = table + 4 * chunk;
  float* sf = static_cast<float*>(*s);
  float* of = static_cast<float*>(*o);

  const float one = 1.0f, zero = 0.0f;
  for (int64_t p0 = 0; p0 < pairs; p0 += chunk) {
    const int64_t count = std::min(chunk, pairs - p0);
    ATTNSERVE_CUDA_CALL(LaunchPairPointers(a, p0, count, sf, of, q_ptrs, k_ptrs, v_ptrs, s_ptrs,
                                           o_ptrs, stream));
    if (a.kv_len > 0) {
      // Column-major view: S^T [Lk, Lq] = K [Lk, D] x Q^T [D, Lq], per pair.
      ATTNSERVE_CUBLAS_CALL(cublasGemmBatchedEx(
          blas_, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(a.kv_len), static_cast<int>(a.q_len),
          static_cast<int>(a.head_dim), &one, k_ptrs, CUDA_R_32F,
          static_cast<int>(a.k_stride_row), q_ptrs, CUDA_R_32F, static_cast<int>(a.q_stride_row),
          &zero, s_ptrs, CUDA_R_32F, static_cast<int>(a.kv_len), static_cast<int>(count),
          CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT));
    }
    ATTNSERVE_CUDA_CALL(LaunchSoftmaxRows(a, p0, count, sf, stream));
    if (a.kv_len > 0) {
      // O^T [Dv, Lq] = V^T [Dv, Lk] x P^T [Lk, Lq].
      ATTNSERVE_CUBLAS_CALL(cublasGemmBatchedEx(
          blas_, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(a.head_dim_v),
          static_cast<int>(a.q_len), static_cast<int>(a.kv_len), &one, v_ptrs, CUDA_R_32F,
          static_cast<int>(a.v_stride_row), const_cast<const void**>(s_ptrs), CUDA_R_32F,
          static_cast<int>(a.kv_len), &zero, o_ptrs, CUDA_R_32F,
          static_cast<int>(a.head_dim_v), static_cast<int>(count), CUBLAS_COMPUTE_32F_PEDANTIC,
          CUBLAS_GEMM_DEFAULT));
    } else {
      ATTNSERVE_CUDA_CALL(
          cudaMemsetAsync(of, 0, static_cast<size_t>(count * a.q_len * a.head_dim_v) * 4, stream));
    }
    ATTNSERVE_CUDA_CALL(LaunchScatterOutput(a, p0, count, of, stream));
  }
  return absl::OkStatus();
}

}  // namespace attnserve::cuda

// The CUDA kernels' host-side interface: plain argument structs over device
// pointers and the launchers that pick a compiled variant. No absl and no
// engine headers here, so the .cu files compile with nvcc alone.
#ifndef ATTNSERVE_ENGINE_CUDA_ATTENTION_KERNELS_H_
#define ATTNSERVE_ENGINE_CUDA_ATTENTION_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace attnserve::cuda {

// Same numbering as attnserve::DType (checked by a static_assert in
// cuda_engine.cc): the kernels cannot include engine/tensor.h.
enum class ElemType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kBool = 3 };

enum class MaskKind : uint8_t { kNone = 0, kBool = 1, kAdditive = 2 };

// A mask over scores [b, h, i, j] read through element strides (0 broadcasts).
struct DeviceMask {
  MaskKind kind = MaskKind::kNone;
  ElemType type = ElemType::kBool;  // kBool: nonzero byte = may attend
  const void* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_q = 0, stride_k = 0;
};

// softmax(Q K^T * scale + mask) V for one request, every pointer on the
// device. Same meaning as attnserve::AttentionParams: element (b, h, i, d) of
// Q is q[b*q_stride_b + h*q_stride_h + i*q_stride_row + d].
struct DeviceAttention {
  int64_t batch = 0, num_heads = 0, num_kv_heads = 0;
  int64_t head_dim = 0, head_dim_v = 0, q_len = 0, kv_len = 0;

  ElemType type = ElemType::kF32;  // of q, k and v
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t q_stride_b = 0, q_stride_h = 0, q_stride_row = 0;
  int64_t k_stride_b = 0, k_stride_h = 0, k_stride_row = 0;
  int64_t v_stride_b = 0, v_stride_h = 0, v_stride_row = 0;

  ElemType out_type = ElemType::kF32;
  void* out = nullptr;
  int64_t o_stride_b = 0, o_stride_h = 0, o_stride_row = 0;

  bool causal = false;                   // bottom-right aligned
  const int64_t* key_lengths = nullptr;  // [batch] or null
  DeviceMask mask;
  float scale = 1.0f;

  // Per-head probabilities, contiguous [batch, num_heads, q_len, kv_len] in
  // weights_type, or null. Only the general kernel writes them.
  void* weights = nullptr;
  ElemType weights_type = ElemType::kF32;
};

// The fused tensor-core kernel (flash_attention.cu) serves a request when its
// inputs are FLOAT16/BFLOAT16, head_dim == head_dim_v is 64 or 128, no
// weights are wanted and q/k/v are 16-byte aligned with strides that are
// multiples of 8 elements. Everything else goes to LaunchAttentionGeneral.
bool FlashAttentionSupports(const DeviceAttention& args);
cudaError_t LaunchFlashAttention(const DeviceAttention& args, cudaStream_t stream);

// The general kernel (attention_general.cu): any float dtype, any head dims,
// writes weights when asked. Slower; one warp per query row.
cudaError_t LaunchAttentionGeneral(const DeviceAttention& args, cudaStream_t stream);

// dst[i] = (dst_type) src[i] for i < n (float dtypes only).
cudaError_t LaunchConvert(const void* src, ElemType src_type, void* dst, ElemType dst_type,
                          int64_t n, cudaStream_t stream);

// y[r, c] += bias[c] for a row-major [rows, cols] y; y and bias share `type`.
cudaError_t LaunchAddBias(void* y, const void* bias, ElemType type, int64_t rows, int64_t cols,
                          cudaStream_t stream);

// out[b, r] = mean over h of probs[b, h, r] for probs [batch, heads, per_head]
// (fp32), summed in head order so that the result is deterministic.
cudaError_t LaunchAverageHeads(const float* probs, int64_t batch, int64_t heads, int64_t per_head,
                               void* out, ElemType out_type, cudaStream_t stream);

}  // namespace attnserve::cuda

#endif  // ATTNSERVE_ENGINE_CUDA_ATTENTION_KERNELS_H_

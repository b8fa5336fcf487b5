// Small element-wise kernels around the GEMMs and the attention core: dtype
// conversion, bias addition (for the plain cuBLAS fallback GEMM), the output
// gate, latent attention's keys, the mean of the probabilities over heads, and a mask expanded into
// cuDNN's bias.
#include <algorithm>
#include <cstdint>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_utils.cuh"

namespace attnserve::cuda {
namespace {

constexpr int kThreads = 256;

// Enough blocks to cover n with a grid-stride loop, capped so the grid stays
// well inside the hardware limit.
unsigned GridFor(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, 65535 * 8));
}

__global__ void ConvertKernel(const void* src, DType src_type, void* dst, DType dst_type,
                              int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    StoreElement(dst, dst_type, i, LoadElement(src, src_type, i));
  }
}

__global__ void AddBiasKernel(void* y, const void* bias, DType type, int64_t rows,
                              int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    StoreElement(y, type, i, LoadElement(y, type, i) + LoadElement(bias, type, i % cols));
  }
}

// `v` rounded to `type` (a float dtype) and widened back.
__device__ __forceinline__ float RoundedTo(DType type, float v) {
  switch (type) {
    case DType::kFloat16: return __half2float(__float2half_rn(v));
    case DType::kBFloat16: return __bfloat162float(__float2bfloat16_rn(v));
    default: return v;
  }
}

__global__ void OutputGateKernel(void* x, const void* gate, DType type, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float s = RoundedTo(type, 1.0f / (1.0f + expf(-LoadElement(gate, type, i))));
    StoreElement(x, type, i, LoadElement(x, type, i) * s);
  }
}

__global__ void AssembleLatentKeysKernel(void* key, const void* nope, const void* rope,
                                         DType type, int64_t rows, int64_t heads,
                                         int64_t nope_dim, int64_t rope_dim) {
  const int64_t head_dim = nope_dim + rope_dim;
  const int64_t n = rows * heads * head_dim;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d = i % head_dim, row_head = i / head_dim;
    const int64_t r = row_head / heads;
    // A float dtype widened to float and back is the same value.
    const float value = d < nope_dim ? LoadElement(nope, type, row_head * nope_dim + d)
                                     : LoadElement(rope, type, r * rope_dim + d - nope_dim);
    StoreElement(key, type, i, value);
  }
}

__global__ void AverageHeadsKernel(const float* probs, int64_t batch, int64_t heads,
                                   int64_t per_head, void* out, DType out_type) {
  const int64_t n = batch * per_head;
  const float inv_heads = 1.0f / static_cast<float>(heads);
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < n;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = idx / per_head;
    const int64_t r = idx % per_head;
    const float* p = probs + b * heads * per_head + r;
    float sum = 0.0f;
    for (int64_t h = 0; h < heads; ++h) sum += p[h * per_head];
    StoreElement(out, out_type, idx, sum * inv_heads);
  }
}

__global__ void ExpandMaskKernel(MaskParams m, int64_t heads, int64_t q_len, int64_t kv_len,
                                 int64_t q_pad, int64_t kv_pad, int64_t n, void* out,
                                 DType out_type) {
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < n;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t j = idx % kv_pad;
    const int64_t i = (idx / kv_pad) % q_pad;
    const int64_t bh = idx / (kv_pad * q_pad);
    const int64_t h = bh % heads;
    const int64_t b = bh / heads;
    float value = 0.0f;  // the padding: masked by cuDNN's sequence lengths
    if (i < q_len && j < kv_len) {
      const int64_t at = b * m.stride_b + h * m.stride_h + i * m.stride_q + j * m.stride_k;
      value = m.kind == MaskParams::Kind::kBool
                  ? (static_cast<const uint8_t*>(m.data)[at] != 0 ? 0.0f : -INFINITY)
                  : LoadElement(m.data, m.dtype, at);
    }
    StoreElement(out, out_type, idx, value);
  }
}

}  // namespace

cudaError_t LaunchExpandMask(const MaskParams& mask, int64_t batch, int64_t heads, int64_t q_len,
                             int64_t kv_len, int64_t q_pad, int64_t kv_pad, void* out,
                             DType out_type, cudaStream_t stream) {
  const int64_t n = batch * heads * q_pad * kv_pad;
  if (n <= 0) return cudaSuccess;
  ATTNSERVE_LAUNCH(ExpandMaskKernel, GridFor(n), kThreads, 0, stream, mask, heads, q_len, kv_len,
                   q_pad, kv_pad, n, out, out_type);
  return cudaGetLastError();
}

cudaError_t LaunchConvert(const void* src, DType src_type, void* dst, DType dst_type,
                          int64_t n, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  ATTNSERVE_LAUNCH(ConvertKernel, GridFor(n), kThreads, 0, stream, src, src_type, dst, dst_type, n);
  return cudaGetLastError();
}

cudaError_t LaunchAddBias(void* y, const void* bias, DType type, int64_t rows, int64_t cols,
                          cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  ATTNSERVE_LAUNCH(AddBiasKernel, GridFor(rows * cols), kThreads, 0, stream, y, bias, type, rows,
                   cols);
  return cudaGetLastError();
}

cudaError_t LaunchOutputGate(void* x, const void* gate, DType type, int64_t n,
                             cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  ATTNSERVE_LAUNCH(OutputGateKernel, GridFor(n), kThreads, 0, stream, x, gate, type, n);
  return cudaGetLastError();
}

cudaError_t LaunchAssembleLatentKeys(void* key, const void* nope, const void* rope, DType type,
                                     int64_t rows, int64_t heads, int64_t nope_dim,
                                     int64_t rope_dim, cudaStream_t stream) {
  const int64_t n = rows * heads * (nope_dim + rope_dim);
  if (n <= 0) return cudaSuccess;
  ATTNSERVE_LAUNCH(AssembleLatentKeysKernel, GridFor(n), kThreads, 0, stream, key, nope, rope,
                   type, rows, heads, nope_dim, rope_dim);
  return cudaGetLastError();
}

cudaError_t LaunchAverageHeads(const float* probs, int64_t batch, int64_t heads, int64_t per_head,
                               void* out, DType out_type, cudaStream_t stream) {
  if (batch <= 0 || per_head <= 0) return cudaSuccess;
  ATTNSERVE_LAUNCH(AverageHeadsKernel, GridFor(batch * per_head), kThreads, 0, stream, probs, batch,
                   heads, per_head, out, out_type);
  return cudaGetLastError();
}

}  // namespace attnserve::cuda

// Device helpers shared by the attention kernels: loads and stores of any
// float dtype, and the visibility rule of attention_params.h.
#ifndef ATTNSERVE_ENGINE_CUDA_DEVICE_UTILS_CUH_
#define ATTNSERVE_ENGINE_CUDA_DEVICE_UTILS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "engine/cuda/attention_kernels.h"

// kernel<<<grid, block, shared, stream>>>(...) (a kernel name with template
// arguments goes in parentheses), and a kernel's dynamic shared memory,
// `name` its first byte; tests/unit/engine/cuda/warp_emulator.h defines both
// to run the kernel on its CPU emulation instead.
#if !defined(ATTNSERVE_CUDA_EMULATION)
#define ATTNSERVE_LAUNCH(kernel, grid, block, shared, stream, ...) \
  kernel<<<grid, block, shared, stream>>>(__VA_ARGS__)
#define ATTNSERVE_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace attnserve::cuda {

__device__ __forceinline__ float ToFloat(float x) { return x; }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }

// Element i of a buffer of `type`, as float (BOOL reads as 0 or 1).
__device__ __forceinline__ float LoadElement(const void* data, DType type, int64_t i) {
  switch (type) {
    case DType::kFloat32:
      return static_cast<const float*>(data)[i];
    case DType::kFloat16:
      return __half2float(static_cast<const __half*>(data)[i]);
    case DType::kBFloat16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[i]);
    case DType::kBool:
      return static_cast<const uint8_t*>(data)[i] != 0 ? 1.0f : 0.0f;
  }
  return 0.0f;
}

// Writes `value` rounded to nearest even into element i of a float buffer.
__device__ __forceinline__ void StoreElement(void* data, DType type, int64_t i, float value) {
  switch (type) {
    case DType::kFloat32:
      static_cast<float*>(data)[i] = value;
      break;
    case DType::kFloat16:
      static_cast<__half*>(data)[i] = __float2half_rn(value);
      break;
    case DType::kBFloat16:
      static_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16_rn(value);
      break;
    case DType::kBool:
      break;
  }
}

#if !defined(ATTNSERVE_CUDA_EMULATION)
// x rounded to TF32 (10 explicit mantissa bits, nearest, ties away), as an
// fp32 value whose low 13 bits are zero; x - Tf32High(x) is then exact in
// fp32. A finite x that would round to infinity is truncated instead.
__device__ __forceinline__ float Tf32High(float x) {
  uint32_t bits;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));
  const float hi = __uint_as_float(bits);
  if (isinf(hi) && !isinf(x)) return __uint_as_float(__float_as_uint(x) & 0xffffe000u);
  return hi;
}
#endif  // !ATTNSERVE_CUDA_EMULATION

// Keys [0, RowKeyEnd) may be visible to query row i of batch b; causal, a
// two-sided window (a window without causal) and key_lengths each cut a
// prefix. May be <= 0 (the row sees nothing).
__device__ __forceinline__ int64_t RowKeyEnd(const AttentionParams& a, int64_t b, int64_t i) {
  int64_t end = a.kv_len;
  if (a.key_lengths != nullptr) end = min(end, a.key_lengths[b]);
  if (a.causal) {
    end = min(end, i + (a.kv_len - a.q_len) + 1);
  } else if (a.window > 0) {
    end = min(end, i + (a.kv_len - a.q_len) + a.window);
  }
  return end;
}

// Keys before RowKeyBegin are outside query row i's sliding window or its
// chunk (0 without either; FirstVisibleKey of attention_params.h).
__device__ __forceinline__ int64_t RowKeyBegin(const AttentionParams& a, int64_t i) {
  const int64_t position = i + (a.kv_len - a.q_len);
  int64_t begin = 0;
  if (a.window > 0) begin = max(begin, position - a.window + 1);
  if (a.chunk > 0) begin = max(begin, position / a.chunk * a.chunk);
  return begin;
}

// Logit softcapping of a scaled score (attention_params.h): softcap *
// tanh(s / softcap) when softcap > 0, else s unchanged.
__device__ __forceinline__ float Softcap(const AttentionParams& a, float scaled_score) {
  return a.softcap > 0.0f ? a.softcap * tanhf(scaled_score / a.softcap) : scaled_score;
}

// ALiBi's bias (attention_params.h) of key j for the query at `position`:
// slope * (j - position), the product rounded once and never contracted
// into the sum it joins (j - position is exact in float), as the cpu engine
// rounds it.
__device__ __forceinline__ float AlibiBias(float slope, int64_t position, int64_t j) {
  return __fmul_rn(slope, static_cast<float>(j - position));
}

// The learned relative position bias (attention_params.h) of key j for the
// query at `position`, from its head's row of the table (2 * distance + 1
// floats, entry distance for j == position): every key further than
// `distance` either way shares the outermost entry on its side.
__device__ __forceinline__ float RelativeBias(const float* head_row, int64_t distance,
                                              int64_t position, int64_t j) {
  return head_row[min(max(j - position, -distance), distance) + distance];
}

// A softcapped score of key j for the query at `position` of head h plus the
// position biases `a` has, in attention_params.h's order: ALiBi's
// (a.alibi_slopes a device array of num_heads), then the relative bias
// table's (a.relative_bias a device array [num_heads, 2D + 1]); to go
// before the mask.
__device__ __forceinline__ float AddPositionBias(const AttentionParams& a, int64_t h,
                                                 int64_t position, int64_t j, float score) {
  if (a.alibi_slopes != nullptr) score += AlibiBias(a.alibi_slopes[h], position, j);
  if (a.relative_bias != nullptr) {
    const int64_t distance = a.relative_bias_distance;
    score += RelativeBias(a.relative_bias + h * (2 * distance + 1), distance, position, j);
  }
  return score;
}

// Whether `a` has relative position embeddings (attention_params.h): either
// table, a device array [num_heads, head_dim, 2D + 1].
__device__ __forceinline__ bool HasRelativeEmbeddings(const AttentionParams& a) {
  return a.relative_key != nullptr || a.relative_query != nullptr;
}

// The relative position embeddings' terms of head h's raw score of key j for
// the query at `position` (attention_params.h): q . relative_key[h][:, c] +
// k . relative_query[h][:, c], c = clamp(j - position, -D, D) + D, in fp32,
// feature by feature in increasing order; q and k are the query's and the
// key's head_dim features (any element type ToFloat reads). To be added to
// the raw score Q_i . K_j, before the scale. Zero without either table.
template <typename Q, typename K>
__device__ __forceinline__ float RelativeEmbeddings(const AttentionParams& a, int64_t h,
                                                    int64_t position, int64_t j, const Q* q,
                                                    const K* k) {
  const int64_t distance = a.relative_embedding_distance, columns = 2 * distance + 1;
  const int64_t c = min(max(j - position, -distance), distance) + distance;
  const int64_t first = h * a.head_dim * columns + c;  // feature 0's entry
  const float* key_table = a.relative_key != nullptr ? a.relative_key + first : nullptr;
  const float* query_table = a.relative_query != nullptr ? a.relative_query + first : nullptr;
  float sum = 0.0f;
  for (int64_t f = 0; f < a.head_dim; ++f) {
    if (key_table != nullptr) sum += ToFloat(q[f]) * key_table[f * columns];
    if (query_table != nullptr) sum += ToFloat(k[f]) * query_table[f * columns];
  }
  return sum;
}

// The scaled score after the mask for a key j < RowKeyEnd: -inf where a bool
// mask forbids it, plus the additive mask value otherwise.
__device__ __forceinline__ float ApplyMask(const MaskParams& m, int64_t b, int64_t h, int64_t i,
                                           int64_t j, float scaled_score) {
  if (m.kind == MaskParams::Kind::kNone) return scaled_score;
  const int64_t at = b * m.stride_b + h * m.stride_h + i * m.stride_q + j * m.stride_k;
  if (m.kind == MaskParams::Kind::kBool) {
    return static_cast<const uint8_t*>(m.data)[at] != 0 ? scaled_score : -INFINITY;
  }
  return scaled_score + LoadElement(m.data, m.dtype, at);
}

}  // namespace attnserve::cuda

#endif  // ATTNSERVE_ENGINE_CUDA_DEVICE_UTILS_CUH_

// The general attention kernel: every dtype, every head dim, optional
// probabilities. One warp per query row, two passes over the keys (row
// maximum and sum first, then normalised probabilities times V), all in fp32.
// It is the fallback for what the fused kernel does not serve, so it is
// written to be plainly correct rather than fast.
#include <algorithm>
#include <cstdint>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_utils.cuh"

namespace attnserve::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Shared memory per warp: the query row and the output accumulator (fp32),
// and one probability per lane.
__host__ __device__ inline int64_t WarpSharedFloats(int64_t head_dim, int64_t head_dim_v) {
  return head_dim + head_dim_v + kWarpSize;
}

// Query row i's (sq, in fp32) logit of key j (k_row) in head h of batch b:
// the raw score plus the relative position embeddings' terms, then the
// scale, softcap, position biases and mask.
template <typename T>
__device__ __forceinline__ float Score(const AttentionParams& a, const float* sq, const T* k_row,
                                       int64_t b, int64_t h, int64_t i, int64_t j) {
  const int64_t position = i + (a.kv_len - a.q_len);
  float dot = 0.0f;
  for (int64_t d = 0; d < a.head_dim; ++d) dot += sq[d] * ToFloat(k_row[d]);
  if (HasRelativeEmbeddings(a)) dot += RelativeEmbeddings(a, h, position, j, sq, k_row);
  const float t = AddPositionBias(a, h, position, j, Softcap(a, dot * a.scale));
  return ApplyMask(a.mask, b, h, i, j, t);
}

// Grid: one block per (b, h, tile of `rows_per_block` query rows), flattened
// into blockIdx.x; one warp per row.
template <typename T>
__global__ void AttentionGeneralKernel(AttentionParams a, int rows_per_block, int64_t q_tiles) {
  ATTNSERVE_DYNAMIC_SHARED(smem_bytes);
  float* const smem = reinterpret_cast<float*>(smem_bytes);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;

  int64_t block = blockIdx.x;
  const int64_t tile = block % q_tiles;
  block /= q_tiles;
  const int64_t h = block % a.num_heads;
  const int64_t b = block / a.num_heads;
  const int64_t i = tile * rows_per_block + warp;
  // Whole warps leave together; the kernel has no block-wide barrier.
  if (i >= a.q_len) return;

  float* sq = smem + warp * WarpSharedFloats(a.head_dim, a.head_dim_v);
  float* so = sq + a.head_dim;
  float* sp = so + a.head_dim_v;

  const int64_t kv_head = h / (a.num_heads / a.num_kv_heads);
  const T* q_row =
      static_cast<const T*>(a.q) + b * a.q_stride_b + h * a.q_stride_h + i * a.q_stride_row;
  const T* k_base = static_cast<const T*>(a.k) + b * a.k_stride_b + kv_head * a.k_stride_h;
  const T* v_base = static_cast<const T*>(a.v) + b * a.v_stride_b + kv_head * a.v_stride_h;
  const int64_t out_row = b * a.o_stride_b + h * a.o_stride_h + i * a.o_stride_row;
  const int64_t weights_row = ((b * a.num_heads + h) * a.q_len + i) * a.kv_len;

  for (int64_t d = lane; d < a.head_dim; d += kWarpSize) sq[d] = ToFloat(q_row[d]);
  for (int64_t d = lane; d < a.head_dim_v; d += kWarpSize) so[d] = 0.0f;
  __syncwarp();

  const int64_t begin = RowKeyBegin(a, i);
  const int64_t end = RowKeyEnd(a, b, i);

  // Pass 1: each lane keeps an online (max, sum) over its keys, then the warp
  // combines them. The combination is symmetric, so every lane ends with the
  // same values.
  float m = -INFINITY;
  float l = 0.0f;
  for (int64_t j = begin + lane; j < end; j += kWarpSize) {
    const float s = Score(a, sq, k_base + j * a.k_stride_row, b, h, i, j);
    if (s == -INFINITY) continue;
    if (s > m) {
      l = l * expf(m - s) + 1.0f;
      m = s;
    } else {
      l += expf(s - m);
    }
  }
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float m_other = __shfl_xor_sync(kFullMask, m, offset);
    const float l_other = __shfl_xor_sync(kFullMask, l, offset);
    const float m_new = fmaxf(m, m_other);
    l = m_new == -INFINITY ? 0.0f : l * expf(m - m_new) + l_other * expf(m_other - m_new);
    m = m_new;
  }
  // A row that sees a key counts its head's sink in the denominator
  // (attention_params.h); the sink has no value row.
  if (a.sinks != nullptr && m != -INFINITY) {
    const float sink = a.sinks[h];
    const float m_new = fmaxf(m, sink);
    l = l * expf(m - m_new) + expf(sink - m_new);
    m = m_new;
  }

  if (m == -INFINITY) {
    // No visible key (or only -inf scores): zeros, never NaN.
    for (int64_t d = lane; d < a.head_dim_v; d += kWarpSize) {
      StoreElement(a.out, a.out_dtype, out_row + d, 0.0f);
    }
    if (a.weights != nullptr) {
      for (int64_t j = lane; j < a.kv_len; j += kWarpSize) {
        StoreElement(a.weights, a.weights_dtype, weights_row + j, 0.0f);
      }
    }
    return;
  }

  // Pass 2: probabilities for 32 keys at a time (one per lane), then every
  // lane accumulates its own output dims over those keys.
  const float inv_l = 1.0f / l;
  if (a.weights != nullptr) {
    for (int64_t j = lane; j < min(begin, a.kv_len); j += kWarpSize) {
      StoreElement(a.weights, a.weights_dtype, weights_row + j, 0.0f);
    }
  }
  for (int64_t j0 = begin; j0 < end; j0 += kWarpSize) {
    const int64_t j = j0 + lane;
    float p = 0.0f;
    if (j < end) {
      const float s = Score(a, sq, k_base + j * a.k_stride_row, b, h, i, j);
      p = s == -INFINITY ? 0.0f : expf(s - m) * inv_l;
      if (a.weights != nullptr) StoreElement(a.weights, a.weights_dtype, weights_row + j, p);
    }
    sp[lane] = p;
    __syncwarp();
    const int count = static_cast<int>(min(static_cast<int64_t>(kWarpSize), end - j0));
    for (int64_t d = lane; d < a.head_dim_v; d += kWarpSize) {
      float acc = so[d];
      for (int t = 0; t < count; ++t) {
        const float pt = sp[t];
        if (pt != 0.0f) acc += pt * ToFloat(v_base[(j0 + t) * a.v_stride_row + d]);
      }
      so[d] = acc;
    }
    __syncwarp();
  }
  if (a.weights != nullptr) {
    for (int64_t j = max(end, begin) + lane; j < a.kv_len; j += kWarpSize) {
      StoreElement(a.weights, a.weights_dtype, weights_row + j, 0.0f);
    }
  }
  for (int64_t d = lane; d < a.head_dim_v; d += kWarpSize) {
    StoreElement(a.out, a.out_dtype, out_row + d, so[d]);
  }
}

template <typename T>
cudaError_t Launch(const AttentionParams& a, cudaStream_t stream) {
  constexpr int64_t kDefaultSharedBytes = 48 * 1024;
  const int64_t per_warp = WarpSharedFloats(a.head_dim, a.head_dim_v) * int64_t{sizeof(float)};
  int rows_per_block = static_cast<int>(std::clamp<int64_t>(kDefaultSharedBytes / per_warp, 1, 4));
  const int64_t shared_bytes = per_warp * rows_per_block;
  if (shared_bytes > kDefaultSharedBytes) {
    // Very large head dims: one warp per block with opted-in shared memory
    // (fails with cudaErrorInvalidValue beyond the device's limit).
    const cudaError_t err =
        cudaFuncSetAttribute(AttentionGeneralKernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(std::min<int64_t>(shared_bytes, INT32_MAX)));
    if (err != cudaSuccess) return err;
  }
  const int64_t q_tiles = (a.q_len + rows_per_block - 1) / rows_per_block;
  const int64_t blocks = q_tiles * a.num_heads * a.batch;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  ATTNSERVE_LAUNCH(AttentionGeneralKernel<T>, static_cast<unsigned>(blocks),
                   rows_per_block * kWarpSize, static_cast<size_t>(shared_bytes), stream, a,
                   rows_per_block, q_tiles);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchAttentionGeneral(const AttentionParams& args, cudaStream_t stream) {
  // Per-head weights only: an averaged buffer is too small for them.
  if (args.weights != nullptr && args.average_weights) return cudaErrorInvalidValue;
  switch (args.dtype) {
    case DType::kFloat32:
      return Launch<float>(args, stream);
    case DType::kFloat16:
      return Launch<__half>(args, stream);
    case DType::kBFloat16:
      return Launch<__nv_bfloat16>(args, stream);
    case DType::kBool:
      break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace attnserve::cuda

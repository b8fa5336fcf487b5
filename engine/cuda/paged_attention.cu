// The paged K/V kernels of server-side sessions (paged_attention.h): append,
// gather, and the split-KV decode with its combine pass.
#include "engine/cuda/paged_attention.h"

#include <algorithm>
#include <cstdint>

#include "engine/cuda/device_utils.cuh"

namespace attnserve::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Elementwise kernels: grid-stride loops over a capped grid.
constexpr int kCopyThreads = 256;
unsigned CopyGrid(int64_t n) {
  return static_cast<unsigned>(std::min<int64_t>((n + kCopyThreads - 1) / kCopyThreads, 1 << 16));
}

// The decode kernel: 4 warps per block, each warp taking every 4th key of
// the block's chunk.
constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = kDecodeWarps * kWarpSize;
constexpr int kPerLane = static_cast<int>(kPagedDecodeMaxHeadDim) / kWarpSize;  // 8
constexpr int kCombineThreads = 128;

// How the keys of every row are split: `chunks` chunks of `chunk_keys`
// keys (the last one shorter), none empty.
struct Split {
  int64_t chunks = 1;
  int64_t chunk_keys = 1;
};

Split SplitFor(const AttentionParams& a) {
  const int64_t rows = a.num_heads * a.q_len;
  const int64_t most = (a.kv_len + kPagedDecodeMinChunkKeys - 1) / kPagedDecodeMinChunkKeys;
  const int64_t wanted = (kPagedDecodeTargetBlocks + rows - 1) / rows;
  Split split;
  const int64_t chunks = std::max<int64_t>(1, std::min(most, wanted));
  split.chunk_keys = (a.kv_len + chunks - 1) / chunks;
  split.chunks = (a.kv_len + split.chunk_keys - 1) / split.chunk_keys;
  return split;
}

// One partial per (row, chunk): max, sum, then head_dim_v accumulators.
__host__ __device__ inline int64_t PartialFloats(const AttentionParams& a) {
  return a.head_dim_v + 2;
}

// Element n of the new rows' K (first) then V, in order (h, r, d): written
// to the block that holds token cached_len + r.
__global__ void PagedAppendKernel(AttentionParams rows, PagedCacheArgs cache) {
  const int64_t hkv = rows.num_kv_heads, len = rows.kv_len;
  const int64_t k_elems = hkv * len * rows.head_dim;
  const int64_t n = k_elems + hkv * len * rows.head_dim_v;
  const int64_t bt = cache.block_tokens;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const bool is_k = e < k_elems;
    const int64_t f = is_k ? e : e - k_elems;
    const int64_t dim = is_k ? rows.head_dim : rows.head_dim_v;
    const int64_t d = f % dim;
    const int64_t r = (f / dim) % len;
    const int64_t h = f / dim / len;
    const int64_t src = is_k ? h * rows.k_stride_h + r * rows.k_stride_row + d
                             : h * rows.v_stride_h + r * rows.v_stride_row + d;
    const int64_t pos = cache.cached_len + r;
    void* block = (is_k ? cache.k_blocks : cache.v_blocks)[pos / bt];
    if (block == nullptr) continue;  // never the case for new rows (CheckPagedKv)
    StoreElement(block, cache.dtype, (h * bt + pos % bt) * dim + d,
                 LoadElement(is_k ? rows.k : rows.v, rows.dtype, src));
  }
}

// Element n of k [Hkv, kv_len, Dk] (first) then v [Hkv, kv_len, Dv].
__global__ void PagedGatherKernel(AttentionParams a, void* k, void* v) {
  const int64_t hkv = a.num_kv_heads, len = a.kv_len;
  const int64_t k_elems = hkv * len * a.head_dim;
  const int64_t n = k_elems + hkv * len * a.head_dim_v;
  const int64_t bt = a.block_tokens;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const bool is_k = e < k_elems;
    const int64_t f = is_k ? e : e - k_elems;
    const int64_t dim = is_k ? a.head_dim : a.head_dim_v;
    const int64_t d = f % dim;
    const int64_t j = (f / dim) % len;
    const int64_t h = f / dim / len;
    const void* block = (is_k ? a.k_blocks : a.v_blocks)[j / bt];
    const float x =
        block == nullptr ? 0.0f : LoadElement(block, a.dtype, (h * bt + j % bt) * dim + d);
    StoreElement(is_k ? k : v, a.dtype, f, x);
  }
}

// Row j of kv head `g` in a K (dim = head_dim) or V (head_dim_v) table.
template <typename T>
__device__ __forceinline__ const T* PagedRow(const void* const* blocks, int64_t block_tokens,
                                             int64_t dim, int64_t g, int64_t j) {
  const T* block = static_cast<const T*>(blocks[j / block_tokens]);
  return block + (g * block_tokens + j % block_tokens) * dim;
}

// Grid: one block per (row, chunk), row = h * q_len + i, flattened as
// row * chunks + chunk. Writes partial[(row * chunks + chunk) * (Dv + 2)]:
// the chunk's max score m (-inf when it sees no key), the sum of
// exp(score - m) and the Dv accumulators sum exp(score - m) * v.
template <typename T>
__global__ void __launch_bounds__(kDecodeThreads)
    PagedDecodeKernel(AttentionParams a, int64_t chunks, int64_t chunk_keys, float* partial) {
  __shared__ float sq[kPagedDecodeMaxHeadDim];
  __shared__ float warp_m[kDecodeWarps];
  __shared__ float warp_l[kDecodeWarps];
  __shared__ float warp_acc[kDecodeWarps][kPagedDecodeMaxHeadDim];

  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) % chunks;
  const int64_t row = static_cast<int64_t>(blockIdx.x) / chunks;
  const int64_t i = row % a.q_len;
  const int64_t h = row / a.q_len;
  const int64_t g = h / (a.num_heads / a.num_kv_heads);

  const T* q_row = static_cast<const T*>(a.q) + h * a.q_stride_h + i * a.q_stride_row;
  for (int64_t d = threadIdx.x; d < a.head_dim; d += kDecodeThreads) sq[d] = ToFloat(q_row[d]);
  __syncthreads();

  // The keys of this chunk that row i sees (attention_params.h): query i
  // sits at position i + kv_len - q_len.
  const int64_t position = i + a.kv_len - a.q_len;
  int64_t lo = chunk * chunk_keys;
  int64_t hi = min(a.kv_len, lo + chunk_keys);
  if (a.causal) hi = min(hi, position + 1);
  if (a.window > 0) lo = max(lo, position - a.window + 1);

  // Each warp: an online softmax over keys lo + warp, lo + warp + 4, ...;
  // lane owns accumulators d = lane + 32 t.
  float m = -INFINITY;
  float l = 0.0f;
  float acc[kPerLane];
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) acc[t] = 0.0f;
  for (int64_t j = lo + warp; j < hi; j += kDecodeWarps) {
    const T* k = PagedRow<T>(a.k_blocks, a.block_tokens, a.head_dim, g, j);
    float dot = 0.0f;
    for (int64_t d = lane; d < a.head_dim; d += kWarpSize) dot += sq[d] * ToFloat(k[d]);
    // Butterfly: every lane ends with the same (bitwise) sum.
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      dot += __shfl_xor_sync(kFullMask, dot, offset);
    }
    float s = dot * a.scale;
    if (a.softcap > 0.0f) s = a.softcap * tanhf(s / a.softcap);
    if (s == -INFINITY) continue;
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new);  // 0 while m is -inf
    const float p = expf(s - m_new);
    l = l * correction + p;
    const T* v = PagedRow<T>(a.v_blocks, a.block_tokens, a.head_dim_v, g, j);
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) {
      const int64_t d = lane + t * kWarpSize;
      if (d < a.head_dim_v) acc[t] = acc[t] * correction + p * ToFloat(v[d]);
    }
    m = m_new;
  }
  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = l;
  }
#pragma unroll
  for (int t = 0; t < kPerLane; ++t) {
    const int64_t d = lane + t * kWarpSize;
    if (d < a.head_dim_v) warp_acc[warp][d] = acc[t];
  }
  __syncthreads();

  // The block's warps combined in warp order.
  float chunk_m = -INFINITY;
  for (int w = 0; w < kDecodeWarps; ++w) chunk_m = fmaxf(chunk_m, warp_m[w]);
  float* out = partial + (row * chunks + chunk) * PartialFloats(a);
  float factor[kDecodeWarps];
  for (int w = 0; w < kDecodeWarps; ++w) {
    factor[w] = warp_m[w] == -INFINITY ? 0.0f : expf(warp_m[w] - chunk_m);
  }
  if (threadIdx.x == 0) {
    float chunk_l = 0.0f;
    for (int w = 0; w < kDecodeWarps; ++w) chunk_l += warp_l[w] * factor[w];
    out[0] = chunk_m;
    out[1] = chunk_l;
  }
  for (int64_t d = threadIdx.x; d < a.head_dim_v; d += kDecodeThreads) {
    float sum = 0.0f;
    for (int w = 0; w < kDecodeWarps; ++w) sum += warp_acc[w][d] * factor[w];
    out[2 + d] = sum;
  }
}

// Grid: one block per row (h * q_len + i). Combines the row's chunks in
// chunk order, the sink (if any) joining the denominator, and writes the
// output row at a.out's strides in a.out_dtype.
__global__ void PagedCombineKernel(AttentionParams a, int64_t chunks, const float* partial) {
  const int64_t row = blockIdx.x;
  const int64_t i = row % a.q_len;
  const int64_t h = row / a.q_len;
  const int64_t stride = PartialFloats(a);
  const float* base = partial + row * chunks * stride;
  const int64_t out_row = h * a.o_stride_h + i * a.o_stride_row;

  float row_m = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) row_m = fmaxf(row_m, base[c * stride]);
  if (row_m == -INFINITY) {  // sees no key: zeros (a sink alone has no value row)
    for (int64_t d = threadIdx.x; d < a.head_dim_v; d += blockDim.x) {
      StoreElement(a.out, a.out_dtype, out_row + d, 0.0f);
    }
    return;
  }
  const float sink = a.sinks != nullptr ? a.sinks[h] : -INFINITY;
  row_m = fmaxf(row_m, sink);
  float row_l = a.sinks != nullptr ? expf(sink - row_m) : 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float m = base[c * stride];
    if (m != -INFINITY) row_l += base[c * stride + 1] * expf(m - row_m);
  }
  // row_l >= 1: the largest of the row's maxima (a key's or the sink) adds
  // exp(0).
  for (int64_t d = threadIdx.x; d < a.head_dim_v; d += blockDim.x) {
    float sum = 0.0f;
    for (int64_t c = 0; c < chunks; ++c) {
      const float m = base[c * stride];
      if (m != -INFINITY) sum += base[c * stride + 2 + d] * expf(m - row_m);
    }
    StoreElement(a.out, a.out_dtype, out_row + d, sum / row_l);
  }
}

template <typename T>
cudaError_t LaunchDecode(const AttentionParams& a, float* partial, cudaStream_t stream) {
  const Split split = SplitFor(a);
  const int64_t rows = a.num_heads * a.q_len;
  PagedDecodeKernel<T><<<static_cast<unsigned>(rows * split.chunks), kDecodeThreads, 0, stream>>>(
      a, split.chunks, split.chunk_keys, partial);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  PagedCombineKernel<<<static_cast<unsigned>(rows), kCombineThreads, 0, stream>>>(a, split.chunks,
                                                                                  partial);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchPagedAppend(const AttentionParams& rows, const PagedCacheArgs& cache,
                              cudaStream_t stream) {
  const int64_t n = rows.num_kv_heads * rows.kv_len * (rows.head_dim + rows.head_dim_v);
  if (n <= 0) return cudaSuccess;
  PagedAppendKernel<<<CopyGrid(n), kCopyThreads, 0, stream>>>(rows, cache);
  return cudaGetLastError();
}

cudaError_t LaunchPagedGather(const AttentionParams& a, void* k, void* v, cudaStream_t stream) {
  const int64_t n = a.num_kv_heads * a.kv_len * (a.head_dim + a.head_dim_v);
  if (n <= 0) return cudaSuccess;
  PagedGatherKernel<<<CopyGrid(n), kCopyThreads, 0, stream>>>(a, k, v);
  return cudaGetLastError();
}

bool PagedDecodeSupports(const AttentionParams& a) {
  return a.batch == 1 && a.k_blocks != nullptr && a.v_blocks != nullptr && a.block_tokens > 0 &&
         a.head_dim >= 1 && a.head_dim <= kPagedDecodeMaxHeadDim && a.head_dim_v >= 1 &&
         a.head_dim_v <= kPagedDecodeMaxHeadDim && a.key_lengths == nullptr &&
         a.mask.kind == MaskParams::Kind::kNone && a.weights == nullptr && a.dtype != DType::kBool;
}

size_t PagedDecodeScratchBytes(const AttentionParams& a) {
  return static_cast<size_t>(a.num_heads * a.q_len * SplitFor(a).chunks * PartialFloats(a)) *
         sizeof(float);
}

cudaError_t LaunchPagedDecode(const AttentionParams& a, void* scratch, cudaStream_t stream) {
  if (a.num_heads * a.q_len <= 0 || a.kv_len <= 0) return cudaSuccess;
  float* partial = static_cast<float*>(scratch);
  switch (a.dtype) {
    case DType::kFloat16:
      return LaunchDecode<__half>(a, partial, stream);
    case DType::kBFloat16:
      return LaunchDecode<__nv_bfloat16>(a, partial, stream);
    default:
      return LaunchDecode<float>(a, partial, stream);
  }
}

}  // namespace attnserve::cuda

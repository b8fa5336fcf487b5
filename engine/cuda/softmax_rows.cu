// The kernels of the unfused attention path (unfused_attention.h): the
// pointer arrays of its batched GEMMs, the softmax over materialised score
// rows with every rule of attention_params.h, and the output's scatter into
// its strides and dtype.
#include <algorithm>
#include <cstdint>

#include "engine/cuda/attention_kernels.h"
#include "engine/cuda/device_utils.cuh"

namespace attnserve::cuda {
namespace {

constexpr int kThreads = 256;
// Static shared memory of the softmax kernel (its reductions), kept out of
// the dynamic part's limit.
constexpr int kSharedReserve = 1024;

// Pair n of a chunk starting at pair p0 is (b, h) = divmod(p0 + n, Hq).
__global__ void PairPointersKernel(AttentionParams a, int64_t p0, int64_t count, const float* s,
                                   const float* lo, float* o, const void** q_ptrs,
                                   const void** k_ptrs, const void** v_ptrs, void** s_ptrs,
                                   void** lo_ptrs, void** o_ptrs) {
  const int64_t n = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (n >= count) return;
  const int64_t pair = p0 + n;
  const int64_t b = pair / a.num_heads, h = pair % a.num_heads;
  const int64_t g = h / (a.num_heads / a.num_kv_heads);
  const int64_t elem = a.dtype == DType::kFloat32 ? 4 : 2;  // bytes of a's inputs
  q_ptrs[n] = static_cast<const char*>(a.q) + (b * a.q_stride_b + h * a.q_stride_h) * elem;
  k_ptrs[n] = static_cast<const char*>(a.k) + (b * a.k_stride_b + g * a.k_stride_h) * elem;
  v_ptrs[n] = a.v == nullptr
                  ? nullptr
                  : static_cast<const char*>(a.v) + (b * a.v_stride_b + g * a.v_stride_h) * elem;
  s_ptrs[n] = const_cast<float*>(s) + n * a.q_len * a.kv_len;
  if (lo_ptrs != nullptr) lo_ptrs[n] = const_cast<float*>(lo) + n * a.q_len * a.kv_len;
  o_ptrs[n] = o + n * a.q_len * a.head_dim_v;
}

__device__ __forceinline__ float BlockReduce(float v, float* shared, bool is_max) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = is_max ? fmaxf(v, other) : v + other;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `shared` may still be read by the previous reduction
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  float r = is_max ? -INFINITY : 0.0f;
  for (int w = 0; w < kThreads / 32; ++w) r = is_max ? fmaxf(r, shared[w]) : r + shared[w];
  return r;
}

// One block per score row of the chunk: t = mask(softcap((s + the relative
// position embeddings' terms) * scale) + ALiBi's bias + the relative bias
// table's) for the keys the row sees (-inf elsewhere: outside [RowKeyBegin,
// RowKeyEnd) or blocked by a bool mask), P = exp(t - max) / sum in place,
// with the head's sink logit, when there are sinks, in the max and the sum
// but given no probability; the probabilities also into `weights` when set.
// A row that sees no key is zeros. With kRowInShared the row's intermediate
// values stay in shared memory (kv_len floats of dynamic shared memory), so
// the scores are read once and the probabilities written once; else they go
// through the score row itself.
template <bool kRowInShared>
__global__ void SoftmaxRowsKernel(AttentionParams a, int64_t p0, float* s, float* lo) {
  __shared__ float shared[kThreads / 32];
  ATTNSERVE_DYNAMIC_SHARED(row_bytes);
  float* const row_values = reinterpret_cast<float*>(row_bytes);
  const int64_t row = blockIdx.x;  // within the chunk: n * q_len + i
  const int64_t n = row / a.q_len, i = row % a.q_len;
  const int64_t pair = p0 + n;
  const int64_t b = pair / a.num_heads, h = pair % a.num_heads;
  float* srow = s + row * a.kv_len;
  float* buf = kRowInShared ? row_values : srow;
  const int64_t begin = RowKeyBegin(a, i);
  const int64_t end = RowKeyEnd(a, b, i);
  const int64_t position = i + (a.kv_len - a.q_len);
  // The relative position embeddings' operands: the row's query and its kv
  // head's keys (FLOAT32, LaunchSoftmaxRows).
  const bool embedded = HasRelativeEmbeddings(a);
  const float* q_row = static_cast<const float*>(a.q) + b * a.q_stride_b + h * a.q_stride_h +
                       i * a.q_stride_row;
  const float* k_rows = static_cast<const float*>(a.k) + b * a.k_stride_b +
                        h / (a.num_heads / a.num_kv_heads) * a.k_stride_h;
  float mx = -INFINITY;
  for (int64_t j = threadIdx.x; j < a.kv_len; j += kThreads) {
    float t = -INFINITY;
    if (j >= begin && j < end) {
      float raw = srow[j];
      if (embedded) {
        raw += RelativeEmbeddings(a, h, position, j, q_row, k_rows + j * a.k_stride_row);
      }
      t = ApplyMask(a.mask, b, h, i, j,
                    AddPositionBias(a, h, position, j, Softcap(a, raw * a.scale)));
    }
    buf[j] = t;
    mx = fmaxf(mx, t);
  }
  mx = BlockReduce(mx, shared, true);
  // Only a row that sees a key counts its sink (attention_params.h).
  const float sink = a.sinks != nullptr && mx != -INFINITY ? a.sinks[h] : -INFINITY;
  mx = fmaxf(mx, sink);
  float sum = 0.0f;
  if (mx != -INFINITY) {
    for (int64_t j = threadIdx.x; j < a.kv_len; j += kThreads) {
      const float e = expf(buf[j] - mx);
      buf[j] = e;
      sum += e;
    }
  }
  sum = BlockReduce(sum, shared, false);
  if (sink != -INFINITY) sum += expf(sink - mx);
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  const int64_t weights_row = ((b * a.num_heads + h) * a.q_len + i) * a.kv_len;
  for (int64_t j = threadIdx.x; j < a.kv_len; j += kThreads) {
    const float pj = mx != -INFINITY ? buf[j] * inv : 0.0f;
    if (lo != nullptr) {
      const float hi = Tf32High(pj);
      srow[j] = hi;
      lo[row * a.kv_len + j] = pj - hi;
    } else {
      srow[j] = pj;
    }
    if (a.weights != nullptr) StoreElement(a.weights, a.weights_dtype, weights_row + j, pj);
  }
}

// One block per score row of the chunk: the weights exp(t - lse) of the
// keys the row sees, zeros elsewhere (LaunchWeightsFromStats).
__global__ void WeightsFromStatsKernel(AttentionParams a, int64_t p0, const float* s,
                                       const float* lse, int64_t lse_rows) {
  const int64_t row = blockIdx.x;  // within the chunk: n * q_len + i
  const int64_t n = row / a.q_len, i = row % a.q_len;
  const int64_t pair = p0 + n;
  const int64_t b = pair / a.num_heads, h = pair % a.num_heads;
  const float* srow = s + row * a.kv_len;
  const int64_t begin = RowKeyBegin(a, i);
  const int64_t end = RowKeyEnd(a, b, i);
  const float row_lse = lse[pair * lse_rows + i];
  const int64_t weights_row = (pair * a.q_len + i) * a.kv_len;
  for (int64_t j = threadIdx.x; j < a.kv_len; j += blockDim.x) {
    const float t = j >= begin && j < end ? ApplyMask(a.mask, b, h, i, j, srow[j] * a.scale)
                                          : -INFINITY;
    StoreElement(a.weights, a.weights_dtype, weights_row + j,
                 t == -INFINITY ? 0.0f : expf(t - row_lse));
  }
}

// o [count, q_len, head_dim_v] fp32 (or, split, [count, q_len, 2 *
// head_dim_v], summed by halves) -> a.out at its strides and dtype.
__global__ void ScatterOutputKernel(AttentionParams a, int64_t p0, int64_t count, const float* o,
                                    bool split) {
  const int64_t total = count * a.q_len * a.head_dim_v;
  for (int64_t x = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; x < total;
       x += int64_t{gridDim.x} * blockDim.x) {
    const int64_t c = x % a.head_dim_v;
    const int64_t i = (x / a.head_dim_v) % a.q_len;
    const int64_t pair = p0 + x / (a.head_dim_v * a.q_len);
    const int64_t b = pair / a.num_heads, h = pair % a.num_heads;
    const float value = split ? o[2 * (x - c) + c] + o[2 * (x - c) + a.head_dim_v + c] : o[x];
    StoreElement(a.out, a.out_dtype, b * a.o_stride_b + h * a.o_stride_h + i * a.o_stride_row + c,
                 value);
  }
}

__global__ void Tf32SplitKernel(const float* x, int64_t heads, int64_t len, int64_t dim,
                                int64_t stride_b, int64_t stride_h, int64_t stride_row,
                                Tf32Split pattern, float* out, int64_t total) {
  const int parts = pattern == Tf32Split::kHl ? 2 : 3;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t d = e % dim;
    const int64_t row = e / dim;  // (b * heads + h) * len + r
    const int64_t r = row % len, bh = row / len;
    const float v = x[(bh / heads) * stride_b + (bh % heads) * stride_h + r * stride_row + d];
    const float hi = Tf32High(v), lo = v - hi;
    float* o = out + row * parts * dim + d;
    o[0] = hi;
    o[dim] = pattern == Tf32Split::kHhl ? hi : lo;
    if (parts == 3) o[2 * dim] = pattern == Tf32Split::kHhl ? lo : hi;
  }
}

}  // namespace

cudaError_t LaunchTf32Split(const float* x, int64_t batch, int64_t heads, int64_t len,
                            int64_t dim, int64_t stride_b, int64_t stride_h, int64_t stride_row,
                            Tf32Split pattern, float* out, cudaStream_t stream) {
  const int64_t total = batch * heads * len * dim;
  if (total <= 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535 * 8);
  ATTNSERVE_LAUNCH(Tf32SplitKernel, static_cast<unsigned>(blocks), kThreads, 0, stream, x, heads,
                   len, dim, stride_b, stride_h, stride_row, pattern, out, total);
  return cudaGetLastError();
}

cudaError_t LaunchPairPointers(const AttentionParams& a, int64_t p0, int64_t count,
                               const float* s, const float* lo, float* o, const void** q_ptrs,
                               const void** k_ptrs, const void** v_ptrs, void** s_ptrs,
                               void** lo_ptrs, void** o_ptrs, cudaStream_t stream) {
  if (count <= 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>((count + kThreads - 1) / kThreads);
  ATTNSERVE_LAUNCH(PairPointersKernel, blocks, kThreads, 0, stream, a, p0, count, s, lo, o, q_ptrs,
                   k_ptrs, v_ptrs, s_ptrs, lo_ptrs, o_ptrs);
  return cudaGetLastError();
}

cudaError_t LaunchSoftmaxRows(const AttentionParams& a, int64_t p0, int64_t count, float* s,
                              float* lo, cudaStream_t stream) {
  const int64_t rows = count * a.q_len;
  // The relative position embeddings read Q and K as FLOAT32.
  if ((a.relative_key != nullptr || a.relative_query != nullptr) && a.dtype != DType::kFloat32) {
    return cudaErrorInvalidValue;
  }
  if (rows <= 0) return cudaSuccess;
  if (rows > INT32_MAX) return cudaErrorInvalidConfiguration;
  // The row in shared memory where it fits (opting in past the default
  // 48 KiB once per process, up to what the device allows).
  static const int max_shared = [] {
    int device = 0, bytes = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
            cudaSuccess ||
        cudaFuncSetAttribute(SoftmaxRowsKernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             bytes - kSharedReserve) != cudaSuccess) {
      (void)cudaGetLastError();
      return 48 * 1024 - kSharedReserve;
    }
    return bytes - kSharedReserve;
  }();
  const int64_t row_bytes = a.kv_len * int64_t{sizeof(float)};
  if (row_bytes <= max_shared) {
    ATTNSERVE_LAUNCH(SoftmaxRowsKernel<true>, static_cast<unsigned>(rows), kThreads,
                     static_cast<size_t>(row_bytes), stream, a, p0, s, lo);
  } else {
    ATTNSERVE_LAUNCH(SoftmaxRowsKernel<false>, static_cast<unsigned>(rows), kThreads, 0, stream, a,
                     p0, s, lo);
  }
  return cudaGetLastError();
}

cudaError_t LaunchWeightsFromStats(const AttentionParams& a, int64_t p0, int64_t count,
                                   const float* s, const float* lse, int64_t lse_rows,
                                   cudaStream_t stream) {
  const int64_t rows = count * a.q_len;
  if (rows <= 0 || a.kv_len <= 0) return cudaSuccess;
  if (rows > INT32_MAX) return cudaErrorInvalidConfiguration;
  ATTNSERVE_LAUNCH(WeightsFromStatsKernel, static_cast<unsigned>(rows), kThreads, 0, stream, a, p0,
                   s, lse, lse_rows);
  return cudaGetLastError();
}

cudaError_t LaunchScatterOutput(const AttentionParams& a, int64_t p0, int64_t count,
                                const float* o, bool split, cudaStream_t stream) {
  const int64_t total = count * a.q_len * a.head_dim_v;
  if (total <= 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, 65535 * 8);
  ATTNSERVE_LAUNCH(ScatterOutputKernel, static_cast<unsigned>(blocks), kThreads, 0, stream, a, p0,
                   count, o, split);
  return cudaGetLastError();
}

}  // namespace attnserve::cuda
